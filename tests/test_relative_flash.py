"""Pallas relative-bias flash attention (interpret mode) against the materialised reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posenc_jax.attention import attend
from posenc_jax.kernels import alibi_coef, diet_rel_index, relative_flash_attention, t5_index
from posenc_jax.schemes.alibi import alibi_slopes
from posenc_jax.schemes.t5 import t5_bias
from posenc_jax.terms import Bias, relative_offsets

H, D = 2, 8
TOL = 1e-4


def _inputs(b, lq, lk, r, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 5)
  q = jax.random.normal(ks[0], (b, lq, H, D))
  k = jax.random.normal(ks[1], (b, lk, H, D))
  v = jax.random.normal(ks[2], (b, lk, H, D))
  table = jax.random.normal(ks[3], (H, r))
  cot = jax.random.normal(ks[4], (b, lq, H, D))
  return q, k, v, table, cot


def _diet_bias(table, lq, lk, clip):  # as posenc_jax.schemes.diet.DietRel
  index = jnp.clip(-relative_offsets(lq, lk), -clip, clip) + clip
  return jnp.take(table, index, axis=-1)


def _alibi_bias(slopes, lq, lk, causal):  # as posenc_jax.schemes.alibi.Alibi
  dist = -relative_offsets(lq, lk)
  dist = jnp.maximum(dist, 0) if causal else jnp.abs(dist)
  return -slopes.reshape(-1)[:, None, None] * dist.astype(jnp.float32)


def _check(q, k, v, table, cot, bias_of_table, *, mask=None, causal=False, **kw):
  """Values and (q, k, v, table) gradients of the kernel vs attend(route='reference')."""

  def kernel(q, k, v, table):
    return relative_flash_attention(q, k, v, table, mask=mask, causal=causal, block_q=16,
                                    block_k=16, **kw)

  def reference(q, k, v, table):
    return attend(q, k, v, (Bias(bias_of_table(table)),), mask=mask, causal=causal,
                  route="reference")

  np.testing.assert_allclose(kernel(q, k, v, table), reference(q, k, v, table), atol=TOL,
                             rtol=TOL)
  grads = [jax.grad(lambda *a, f=f: jnp.sum(f(*a) * cot), argnums=(0, 1, 2, 3))(q, k, v, table)
           for f in (kernel, reference)]
  for name, got, want in zip("q k v table".split(), *grads):
    np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL, err_msg=f"d{name}")


@pytest.mark.parametrize("clip", [5, 40])  # clip < L and clip >= L
def test_diet_rel_odd_length(clip):
  q, k, v, table, cot = _inputs(1, 37, 37, 2 * clip + 1)
  _check(q, k, v, table, cot, lambda t: _diet_bias(t, 37, 37, clip),
         bias_index_fn=diet_rel_index(clip))


def test_t5_bidirectional_buckets():
  # 8 buckets, max_distance 16: exact, log-binned and saturated offsets all occur at L = 37.
  q, k, v, table, cot = _inputs(1, 37, 37, 8)
  _check(q, k, v, table, cot,
         lambda t: t5_bias(t, 37, 37, bidirectional=True, max_distance=16),
         bias_index_fn=t5_index(8, 16, bidirectional=True))


def test_alibi_linear():
  q, k, v, _, cot = _inputs(1, 37, 37, 1)
  slopes = alibi_slopes(H)
  _check(q, k, v, slopes, cot, lambda s: _alibi_bias(s, 37, 37, False), mode="linear")


def test_padding_mask_batch():
  q, k, v, table, cot = _inputs(2, 37, 37, 11)
  mask = jnp.arange(37)[None, :] < jnp.array([[37], [20]])
  _check(q, k, v, table, cot, lambda t: _diet_bias(t, 37, 37, 5), mask=mask,
         bias_index_fn=diet_rel_index(5))


def test_causal_t5_unidirectional_with_mask():
  q, k, v, table, cot = _inputs(2, 37, 37, 8)
  # Right padding: every query row keeps key 0, so no row is fully masked.
  mask = jnp.arange(37)[None, :] < jnp.array([[37], [25]])
  _check(q, k, v, table, cot,
         lambda t: t5_bias(t, 37, 37, bidirectional=False, max_distance=16), mask=mask,
         causal=True, bias_index_fn=t5_index(8, 16, bidirectional=False))


def test_causal_alibi():
  q, k, v, _, cot = _inputs(1, 40, 40, 1)
  slopes = alibi_slopes(H)
  _check(q, k, v, slopes[:, None], cot, lambda s: _alibi_bias(s, 40, 40, True), causal=True,
         mode="linear", bias_index_fn=alibi_coef(causal=True))


def test_cross_lengths_and_shared_table():
  # Lq != Lk, and one table shared by the heads (its gradient sums over heads).
  q, _, _, _, cot = _inputs(1, 19, 19, 1)
  _, k, v, table, _ = _inputs(1, 37, 37, 7, seed=1)
  _check(q, k, v, table[:1], cot, lambda t: _diet_bias(jnp.broadcast_to(t, (H, 7)), 19, 37, 3),
         bias_index_fn=diet_rel_index(3))


def test_jit_and_no_quadratic_tensor():
  q, k, v, table, cot = _inputs(1, 37, 37, 11)
  fn = diet_rel_index(5)

  def loss(q, k, v, table):
    out = relative_flash_attention(q, k, v, table, bias_index_fn=fn, block_q=16, block_k=16)
    return jnp.sum(out * cot)

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in grad(q, k, v, table))
  text = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, table))
  # Padded length 48, tiles 16: no [.., 37, 37] or [.., 48, 48] array anywhere.
  assert "37,37" not in text and "48,48" not in text


def test_fully_masked_rows_are_zero():
  q, k, v, table, _ = _inputs(1, 20, 20, 11)
  mask = jnp.zeros((1, 20), bool)
  out = relative_flash_attention(q, k, v, table, bias_index_fn=diet_rel_index(5), mask=mask,
                                 block_q=16, block_k=16)
  np.testing.assert_array_equal(out, 0.0)


def test_argument_errors():
  q, k, v, table, _ = _inputs(1, 8, 8, 3)
  with pytest.raises(ValueError, match="bias_index_fn"):
    relative_flash_attention(q, k, v, table)
  with pytest.raises(ValueError, match="linear"):
    relative_flash_attention(q, k, v, table, mode="linear")
  with pytest.raises(ValueError, match="table"):
    relative_flash_attention(q, k, v, jnp.ones((3, 3)), bias_index_fn=diet_rel_index(1))
