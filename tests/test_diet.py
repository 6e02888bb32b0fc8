"""DIET-ABS (Chen et al. 2021) against float64 transcriptions of the spec: head-wise sharing,
a custom content scale, and the reference route's causal and packed-segment masks."""

import jax.numpy as jnp
import numpy as np
import pytest

from posenc_jax import attend
from tests.conftest import (DIMS, LENGTH, SCHEME_CONFIGS, attention_float64, init_scheme,
                            padding_mask, qkv, segment_ids)


def diet_abs_float64(params, layer, length):
  """``T[h, i, j] = sum_r P_Q[i, r] P_K[j, r]`` of one layer, ``[1, L, L]``: with head-wise
  sharing the layer holds one ``[L_max, d_p]`` pair for all its heads."""
  p_q, p_k = (np.asarray(params["params"][name].value, np.float64)[layer, :length]
              for name in ("p_query", "p_key"))  # [L, 1, d_p]: one head's tables
  assert p_q.shape[1] == 1
  bias = np.zeros((length, length))
  for i in range(length):
    for j in range(length):
      bias[i, j] = np.dot(p_q[i, 0], p_k[j, 0])
  return bias[None]


def keep_float64(padding, causal, segments):
  """``[B, 1, L, L]``: key j unpadded, (causal) ``j <= i``, (segments) in query i's segment."""
  padding, length = np.asarray(padding), padding.shape[-1]
  keep = np.broadcast_to(padding[:, None, :], (padding.shape[0], length, length)).copy()
  if causal:
    keep &= np.tril(np.ones((length, length), bool))
  if segments is not None:
    seg = np.asarray(segments)
    keep &= seg[:, :, None] == seg[:, None, :]
  return keep[:, None]


@pytest.mark.parametrize("causal,packed", [(False, False), (True, False), (False, True),
                                           (True, True)])
def test_diet_abs_head_sharing_and_content_scale_equal_float64(causal, packed):
  """``softmax(0.1 q . k + P_Q P_K^T) v`` per layer (configured ``content_scale`` 0.1, not
  1/sqrt(D)), with the padding, causal and same-segment masks the reference route applies."""
  _, params, st = init_scheme(SCHEME_CONFIGS["diet_abs_head"])
  assert st.content_scale == 0.1
  q, k, v = qkv()
  segments = segment_ids() if packed else None
  keep = keep_float64(padding_mask(), causal, segments)
  assert keep.any(-1).all()  # every query keeps a key
  for layer in range(DIMS["num_layers"]):
    expected = attention_float64(q, k, v, 0.1, diet_abs_float64(params, layer, LENGTH)[None],
                                 keep)
    got = attend(q, k, v, st.for_layer(layer), mask=padding_mask(), causal=causal,
                 segment_ids=segments, scale=st.content_scale, route="reference")
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5, err_msg=f"layer {layer}")


def test_diet_abs_layers_differ_and_heads_share():
  """Head-wise sharing: one table per layer (layers differ), the same bias in every head."""
  _, params, st = init_scheme(SCHEME_CONFIGS["diet_abs_head"])
  q = jnp.zeros((1, LENGTH, DIMS["num_heads"], DIMS["head_dim"]))
  biases = [np.asarray(st.for_layer(layer)[0].logits(q, 1.0)) for layer in (0, 1)]
  for layer, bias in enumerate(biases):
    np.testing.assert_allclose(bias[0], np.broadcast_to(diet_abs_float64(params, layer, LENGTH),
                                                        bias.shape[1:]), rtol=1e-5, atol=1e-5)
  assert np.abs(biases[0] - biases[1]).max() > 1e-1
