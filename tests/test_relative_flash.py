"""Pallas Toeplitz-bias flash attention (interpret mode) against the materialised reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from posenc_jax.attention import attend
from posenc_jax.kernels import relative_flash_attention
from posenc_jax.schemes.alibi import alibi_slopes
from posenc_jax.schemes.t5 import relative_position_bucket
from posenc_jax.terms import Bias, offsets, relative_offsets

H, D = 2, 8
TOL = 1e-4


def _inputs(b, lq, lk, seed=0, d=D):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(ks[0], (b, lq, H, d))
  k = jax.random.normal(ks[1], (b, lk, H, d))
  v = jax.random.normal(ks[2], (b, lk, H, d))
  cot = jax.random.normal(ks[3], (b, lq, H, d))
  return q, k, v, cot


# Offset-bias vectors from a table (what posenc_jax.terms.Toeplitz.offset_values computes),
# and the same bias materialised independently from the [Lq, Lk] offsets.
def _diet(table, rel, clip):
  return jnp.take(table, jnp.clip(-rel, -clip, clip) + clip, axis=-1)


def _t5(table, rel, bidirectional):
  return jnp.take(table, relative_position_bucket(rel, bidirectional=bidirectional,
                                                  num_buckets=table.shape[-1], max_distance=16),
                  axis=-1)


def _alibi(slopes, rel, causal):
  dist = jnp.maximum(-rel, 0) if causal else jnp.abs(rel)
  return -slopes.reshape((-1,) + (1,) * rel.ndim) * dist.astype(jnp.float32)


def _check(q, k, v, cot, param, bias_fn, *, zero_first=False, **kw):
  """Values and (q, k, v, param) gradients of the kernel vs attend(route='reference')."""
  lq, lk = q.shape[1], k.shape[1]

  blocks = {} if kw.get("tiles") == "roll" else dict(block_q=16, block_k=16)

  def kernel(q, k, v, param):
    return relative_flash_attention(q, k, v, bias_fn(param, offsets(lq, lk)),
                                    zero_first=zero_first, **blocks, **kw)

  def reference(q, k, v, param):
    bias = bias_fn(param, relative_offsets(lq, lk))
    if zero_first:
      keep = (jnp.arange(lq) != 0)[:, None] & (jnp.arange(lk) != 0)[None, :]
      bias = bias * keep
    mask = kw.get("mask")  # as the kernel: [B, Lk] keys, and segments when given
    if "q_segment_ids" in kw:
      same = kw["q_segment_ids"][:, :, None] == kw["kv_segment_ids"][:, None, :]
      mask = same if mask is None else same & mask[:, None, :]
      mask = mask[:, None]
    return attend(q, k, v, (Bias(bias),), mask=mask, causal=kw.get("causal", False),
                  route="reference")

  np.testing.assert_allclose(kernel(q, k, v, param), reference(q, k, v, param), atol=TOL,
                             rtol=TOL)
  grads = [jax.grad(lambda *a, f=f: jnp.sum(f(*a) * cot), argnums=(0, 1, 2, 3))(q, k, v, param)
           for f in (kernel, reference)]
  for name, got, want in zip("q k v param".split(), *grads):
    np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL, err_msg=f"d{name}")


@pytest.mark.parametrize("clip", [5, 40])  # clip < L and clip >= L
def test_diet_rel_odd_length(clip):
  q, k, v, cot = _inputs(1, 37, 37)
  table = jax.random.normal(jax.random.PRNGKey(7), (H, 2 * clip + 1))
  _check(q, k, v, cot, table, lambda t, rel: _diet(t, rel, clip))


def test_t5_bidirectional_buckets_with_cls_reset():
  # 8 buckets, max_distance 16: exact, log-binned and saturated offsets all occur at L = 37.
  q, k, v, cot = _inputs(1, 37, 37)
  table = jax.random.normal(jax.random.PRNGKey(7), (H, 8))
  _check(q, k, v, cot, table, lambda t, rel: _t5(t, rel, True), zero_first=True)


def test_alibi_slopes_gradient():
  q, k, v, cot = _inputs(1, 37, 37)
  _check(q, k, v, cot, alibi_slopes(H), lambda s, rel: _alibi(s, rel, False))


def test_padding_mask_batch():
  q, k, v, cot = _inputs(2, 37, 37)
  table = jax.random.normal(jax.random.PRNGKey(7), (H, 11))
  mask = jnp.arange(37)[None, :] < jnp.array([[37], [20]])
  _check(q, k, v, cot, table, lambda t, rel: _diet(t, rel, 5), mask=mask)


def test_segment_ids_packed_sequences():
  q, k, v, cot = _inputs(2, 40, 40)
  table = jax.random.normal(jax.random.PRNGKey(7), (H, 11))
  segments = jnp.stack([jnp.repeat(jnp.arange(4), 10), (jnp.arange(40) >= 23).astype(int)])
  mask = jnp.arange(40)[None, :] < jnp.array([[36], [40]])
  _check(q, k, v, cot, table, lambda t, rel: _diet(t, rel, 5), q_segment_ids=segments,
         kv_segment_ids=segments, mask=mask)


def test_causal_t5_unidirectional_with_mask():
  q, k, v, cot = _inputs(2, 37, 37)
  table = jax.random.normal(jax.random.PRNGKey(7), (H, 8))
  # Right padding: every query row keeps key 0, so no row is fully masked.
  mask = jnp.arange(37)[None, :] < jnp.array([[37], [25]])
  _check(q, k, v, cot, table, lambda t, rel: _t5(t, rel, False), mask=mask, causal=True)


def test_causal_alibi():
  q, k, v, cot = _inputs(1, 40, 40)
  _check(q, k, v, cot, alibi_slopes(H), lambda s, rel: _alibi(s, rel, True), causal=True)


def test_cross_lengths_and_shared_table():
  # Lq != Lk, and one table shared by the heads (its gradient sums over heads).
  q, _, _, cot = _inputs(1, 19, 19)
  _, k, v, _ = _inputs(1, 37, 37, seed=1)
  table = jax.random.normal(jax.random.PRNGKey(7), (1, 7))
  _check(q, k, v, cot, table, lambda t, rel: _diet(t, rel, 3))


def test_no_bias_is_plain_attention():
  q, k, v, cot = _inputs(2, 33, 33)
  mask = jnp.arange(33)[None, :] < jnp.array([[33], [17]])
  got = relative_flash_attention(q, k, v, mask=mask, block_q=16, block_k=16)
  want = attend(q, k, v, mask=mask, route="reference")
  np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL)


def test_jit_and_no_quadratic_tensor():
  q, k, v, cot = _inputs(1, 37, 37)
  table = jax.random.normal(jax.random.PRNGKey(7), (H, 11))

  def loss(q, k, v, table):
    ob = _diet(table, offsets(37, 37), 5)
    out = relative_flash_attention(q, k, v, ob, block_q=16, block_k=16)
    return jnp.sum(out * cot)

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in grad(q, k, v, table))
  text = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, table))
  # Padded length 48, tiles 16: no [.., 37, 37] or [.., 48, 48] array anywhere.
  assert "37,37" not in text and "48,48" not in text


def test_fully_masked_rows_are_zero():
  q, k, v, _ = _inputs(1, 20, 20)
  ob = jnp.ones((H, 39))
  out = relative_flash_attention(q, k, v, ob, mask=jnp.zeros((1, 20), bool), block_q=16,
                                 block_k=16)
  np.testing.assert_array_equal(out, 0.0)


@pytest.mark.parametrize("causal", [False, True])
def test_lowers_for_gpu_triton(causal):
  """Forward and backward lower through Pallas' Triton backend (no GPU needed to lower)."""
  q, k, v, _ = _inputs(2, 200, 200, d=64)
  table = jnp.zeros((H, 32))

  def loss(q, k, v, table):
    ob = _t5(table, offsets(200, 200), bidirectional=not causal)
    out = relative_flash_attention(q, k, v, ob, mask=jnp.ones((2, 200), bool), causal=causal,
                                   zero_first=True, interpret=False)
    return jnp.sum(out.astype(jnp.float32))

  shapes = [jax.ShapeDtypeStruct(x.shape, jnp.bfloat16) for x in (q, k, v)]
  shapes.append(jax.ShapeDtypeStruct(table.shape, jnp.float32))
  exported = export.export(
      jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))), platforms=["cuda"],
      disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*shapes)
  text = exported.mlir_module()
  assert text.count("__gpu$xla.gpu.triton") == 3  # forward, dq (+ bias), dk/dv


def test_argument_errors():
  q, k, v, _ = _inputs(1, 8, 8)
  with pytest.raises(ValueError, match="offset_bias"):
    relative_flash_attention(q, k, v, jnp.ones((H, 8)))
  with pytest.raises(ValueError, match="block_q"):
    relative_flash_attention(q, k, v, block_q=24)
  with pytest.raises(ValueError, match="mask"):
    relative_flash_attention(q, k, v, mask=jnp.ones((1, 7), bool))
  with pytest.raises(ValueError, match="segment_ids"):
    relative_flash_attention(q, k, v, q_segment_ids=jnp.zeros((1, 8), int))
  with pytest.raises(ValueError, match="block_q: got 64; expected a power of two >= 128"):
    relative_flash_attention(q, k, v, tiles="roll", block_q=64)
  with pytest.raises(ValueError, match="tiles"):
    relative_flash_attention(q, k, v, tiles="onehot")


def test_bfloat16_inputs_against_float32_reference():
  """bf16 q/k/v (float32 accumulation inside) stay within bf16 rounding of the float32 result."""
  q, k, v, _ = _inputs(2, 64, 64, d=16)
  table = jax.random.normal(jax.random.PRNGKey(7), (H, 11))
  ob = _diet(table, offsets(64, 64), 5)
  bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
  got = relative_flash_attention(*bf, ob, causal=True, block_q=16, block_k=16)
  want = relative_flash_attention(*(x.astype(jnp.float32) for x in bf), ob, causal=True,
                                  block_q=16, block_k=16)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(got.astype(jnp.float32), want, atol=3e-2, rtol=3e-2)
  reference = attend(*(x.astype(jnp.float32) for x in bf),
                     (Bias(_diet(table, relative_offsets(64, 64), 5)),), causal=True,
                     route="reference")
  np.testing.assert_allclose(want, reference, atol=TOL, rtol=TOL)


# The TPU (Mosaic) way of building tiles: strided rolls of each tile's window, 128-blocks.
ROLL = dict(tiles="roll")


def test_roll_tiles_diet_rel_with_padding():
  q, k, v, cot = _inputs(2, 200, 200)
  table = jax.random.normal(jax.random.PRNGKey(7), (H, 81))
  mask = jnp.arange(200)[None, :] < jnp.array([[200], [150]])
  _check(q, k, v, cot, table, lambda t, rel: _diet(t, rel, 40), mask=mask, **ROLL)


def test_roll_tiles_causal_t5_with_cls_reset():
  q, k, v, cot = _inputs(1, 300, 300)
  table = jax.random.normal(jax.random.PRNGKey(7), (H, 8))
  _check(q, k, v, cot, table, lambda t, rel: _t5(t, rel, False), zero_first=True, causal=True,
         **ROLL)


def test_roll_tiles_cross_lengths_segments_alibi():
  q, _, _, cot = _inputs(2, 130, 130)
  _, k, v, _ = _inputs(2, 260, 260, seed=1)
  q_seg = jnp.stack([(jnp.arange(130) >= 60).astype(int)] * 2)
  kv_seg = jnp.stack([(jnp.arange(260) >= 100).astype(int)] * 2)
  _check(q, k, v, cot, alibi_slopes(H), lambda s, rel: _alibi(s, rel, False),
         q_segment_ids=q_seg, kv_segment_ids=kv_seg, **ROLL)


@pytest.mark.parametrize("causal", [False, True])
def test_roll_tiles_lower_for_tpu_mosaic(causal):
  """Forward and backward lower through Pallas' Mosaic backend (no TPU needed to lower)."""
  def loss(q, k, v, table):
    ob = _t5(table, offsets(200, 200), bidirectional=not causal)
    out = relative_flash_attention(q, k, v, ob, mask=jnp.ones((2, 200), bool), causal=causal,
                                   zero_first=True, tiles="roll", interpret=False)
    return jnp.sum(out.astype(jnp.float32))

  shapes = [jax.ShapeDtypeStruct((2, 200, H, 64), jnp.bfloat16)] * 3
  shapes.append(jax.ShapeDtypeStruct((H, 32), jnp.float32))
  exported = export.export(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))),
                           platforms=["tpu"])(*shapes)
  assert exported.mlir_module().count("tpu_custom_call") == 3  # forward, dq (+ bias), dk/dv
