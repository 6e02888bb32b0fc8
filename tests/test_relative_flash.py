"""Pallas Toeplitz-bias flash attention (interpret mode) against the materialised reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from posenc_jax.attention import attend
from posenc_jax.kernels import (KernelBlocks, kernel_blocks, kernel_memory, memory_budget,
                                relative_flash_attention)
from posenc_jax.kernels.dropout import dropout_multipliers, dropout_seed
from posenc_jax.kernels.common import SMEM_BYTES
from posenc_jax.schemes.alibi import alibi_slopes
from posenc_jax.schemes.t5 import relative_position_bucket
from posenc_jax.terms import Bias, offsets, relative_offsets

H, D = 2, 8
TOL = 1e-4
TRITON = "__gpu$xla.gpu.triton"
# Pallas' Triton lowering reads the target GPU's kind; exports for "cuda" name an H100.
H100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="cuda")


def _inputs(b, lq, lk, seed=0, d=D, dv=None):
  """q ``[b, lq, H, d]``, k ``[b, lk, H, d]``, v ``[b, lk, H, dv or d]`` and an output
  cotangent."""
  dv = dv or d
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(ks[0], (b, lq, H, d))
  k = jax.random.normal(ks[1], (b, lk, H, d))
  v = jax.random.normal(ks[2], (b, lk, H, dv))
  cot = jax.random.normal(ks[3], (b, lq, H, dv))
  return q, k, v, cot


# Offset-bias vectors from a table (what posenc_jax.terms.Toeplitz.offset_values computes),
# and the same bias materialised independently from the [Lq, Lk] offsets.
def _diet(table, rel, clip):
  return jnp.take(table, jnp.clip(-rel, -clip, clip) + clip, axis=-1)


def _t5(table, rel, bidirectional):
  return jnp.take(table, relative_position_bucket(rel, bidirectional=bidirectional,
                                                  num_buckets=table.shape[-1], max_distance=24),
                  axis=-1)


def _alibi(slopes, rel, causal):
  dist = jnp.maximum(-rel, 0) if causal else jnp.abs(rel)
  return -slopes.reshape((-1,) + (1,) * rel.ndim) * dist.astype(jnp.float32)


def _check(q, k, v, cot, param, bias_fn, *, zero_first=False, dropout=None, **kw):
  """Values and (q, k, v, param) gradients of the kernel vs attend(route='reference');
  ``dropout``: ``(rate, PRNG key)`` for both."""
  lq, lk = q.shape[1], k.shape[1]
  blocks = {} if kw.get("tiles") == "roll" else dict(block_q=16, block_k=16)
  blocks.update((name, kw.pop(name)) for name in ("block_q", "block_k") if name in kw)
  rate, rng = dropout or (0.0, None)
  seed = None if rng is None else dropout_seed(rng)

  def kernel(q, k, v, param):
    return relative_flash_attention(q, k, v, bias_fn(param, offsets(lq, lk)),
                                    zero_first=zero_first, dropout_rate=rate, dropout_seed=seed,
                                    **blocks, **kw)

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
    # attend wants v shaped like k (v may be narrower here): zero-pad it, then slice.
    dv = v.shape[-1]
    v = jnp.pad(v, [(0, 0)] * 3 + [(0, k.shape[-1] - dv)])
    return attend(q, k, v, (Bias(bias),), mask=mask, causal=kw.get("causal", False),
                  route="reference", dropout_rate=rate, dropout_rng=rng)[..., :dv]

  @jax.jit
  def values_and_grads(q, k, v, param):  # one program each: outputs and (q, k, v, param) vjps
    return [(out, vjp(cot)) for out, vjp in (jax.vjp(f, q, k, v, param)
                                             for f in (kernel, reference))]

  (got, got_grads), (want, want_grads) = values_and_grads(q, k, v, param)
  np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL)
  for name, got, want in zip("q k v param".split(), got_grads, want_grads):
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


@pytest.mark.parametrize("lq, lk, block_q, block_k, causal", [
    (150, 150, 128, 64, False), (150, 150, 64, 128, True), (37, 53, 32, 16, False)])
def test_non_square_tiles(lq, lk, block_q, block_k, causal):
  """Tiles with block_q != block_k (their diagonal-sum window widened to a power of two),
  and v narrower than q/k (each padded to its own width: 32 and 16)."""
  q, _, _, cot = _inputs(1, lq, lq, d=24, dv=8)
  _, k, v, _ = _inputs(1, lk, lk, seed=1, d=24, dv=8)
  table = jax.random.normal(jax.random.PRNGKey(7), (H, 81))
  _check(q, k, v, cot, table, lambda t, rel: _diet(t, rel, 40), zero_first=True,
         causal=causal, block_q=block_q, block_k=block_k)


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


def _lowered(fn, shapes, platform):
  """MLIR text of ``jax.jit(fn)`` exported for ``platform`` ("cuda", as for an H100; "tpu")."""
  if platform == "tpu":
    return export.export(jax.jit(fn), platforms=["tpu"])(*shapes).mlir_module()
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                abstract_device=H100)):
    exported = export.export(jax.jit(fn), platforms=["cuda"],
                             disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON)])
    return exported(*shapes).mlir_module()


def _lowered_step(platform, *, length=200, dims=(64, 64), dtype=jnp.bfloat16, causal=False,
                  **kw):
  """Forward and backward (q, k, v and a T5 table) of the kernel lowered for ``platform``:
  q/k ``[2, length, H, dims[0]]``, v ``[2, length, H, dims[1]]``, a padding mask and the
  [CLS] reset; ``kw`` goes to :func:`relative_flash_attention`."""

  def loss(q, k, v, table):
    ob = _t5(table, offsets(length, length), bidirectional=not causal)
    out = relative_flash_attention(q, k, v, ob, mask=jnp.ones((2, length), bool),
                                   causal=causal, zero_first=True, interpret=False, **kw)
    return jnp.sum(out.astype(jnp.float32))

  shapes = [jax.ShapeDtypeStruct((2, length, H, dims[0]), dtype)] * 2
  shapes += [jax.ShapeDtypeStruct((2, length, H, dims[1]), dtype),
             jax.ShapeDtypeStruct((H, 32), jnp.float32)]
  return _lowered(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)), shapes, platform)


@pytest.mark.parametrize("causal", [False, True])
def test_lowers_for_gpu_triton(causal):
  """Forward and backward lower through Pallas' Triton backend (no GPU needed to lower)."""
  assert _lowered_step("cuda", causal=causal).count(TRITON) == 3  # forward, dq (+ bias), dk/dv


@pytest.mark.parametrize("block_k", [16, 32, 64, 128])
@pytest.mark.parametrize("block_q", [16, 32, 64, 128])
def test_every_gather_block_pair_lowers_for_triton(block_q, block_k):
  """Every block pair, square or not (the chooser's 16-64 and explicit 128s), has
  power-of-two arrays only: Triton lowers the forward and backward. Also TUPE's widths:
  q/k 136 (padded to 256), v 64."""
  text = _lowered_step("cuda", dims=(136, 64), block_q=block_q, block_k=block_k)
  assert text.count(TRITON) == 3


@pytest.mark.parametrize("causal", [False, True])
def test_dropout_draws_the_reference_mask_values_and_gradients(causal):
  """The kernel's in-tile dropout (forward, and regenerated in dq and dk/dv) is the reference
  route's mask: odd length, padding mask, T5 bias with the [CLS] reset."""
  q, k, v, cot = _inputs(2, 37, 37)
  table = jax.random.normal(jax.random.PRNGKey(7), (H, 16 if causal else 32))
  mask = jnp.arange(37)[None, :] < jnp.array([[37], [30]])
  _check(q, k, v, cot, table, lambda t, rel: _t5(t, rel, bidirectional=not causal),
         zero_first=True, mask=mask, causal=causal, dropout=(0.3, jax.random.PRNGKey(11)))


def test_dropout_mask_statistics():
  """Keeps 1 - rate of the entries, scaled by 1 / (1 - rate); independent across seeds,
  examples and heads."""
  shape = (2, 3, 128, 128)
  a = dropout_multipliers(dropout_seed(jax.random.PRNGKey(0)), shape, 0.1)
  b = dropout_multipliers(dropout_seed(jax.random.PRNGKey(1)), shape, 0.1)
  assert set(np.unique(a).tolist()) == {0.0, np.float32(1 / 0.9)}
  kept = np.asarray(a > 0)
  assert abs(kept.mean() - 0.9) < 0.005  # 98k entries: 5 standard deviations is 0.005
  for x, y in ((kept, np.asarray(b > 0)), (kept[0], kept[1]), (kept[:, 0], kept[:, 1])):
    assert abs((x == y).mean() - (0.9 ** 2 + 0.1 ** 2)) < 0.01  # as independent draws
  assert abs(np.asarray(dropout_multipliers(dropout_seed(jax.random.PRNGKey(0)), shape, 0.5)
                        > 0).mean() - 0.5) < 0.01


@pytest.mark.parametrize("platform,tiles", [("cuda", "gather"), ("tpu", "roll")])
def test_dropout_lowers(platform, tiles):
  text = _lowered_step(platform, tiles=tiles, dropout_rate=0.1,
                       dropout_seed=jnp.array([[7]], jnp.int32))
  assert text.count(TRITON if platform == "cuda" else "tpu_custom_call") == 3


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
  with pytest.raises(ValueError, match="precision: got 'highest'"):
    relative_flash_attention(q, k, v, precision="highest")


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


@pytest.mark.parametrize("dtype, precision, exact", [
    (jnp.float32, "float32", True), (jnp.float32, "tensorfloat32", False),
    (jnp.bfloat16, "float32", False)])
def test_precision_reaches_every_kernel_product(dtype, precision, exact):
  """Every product in the three kernels asks for HIGHEST precision (which Pallas lowers to
  IEEE float32 on Triton, fp32 contraction on Mosaic) for float32 inputs unless TF32 is
  asked for; bfloat16 products keep the default. (The lowered kernels are bytecode inside
  the export, so this reads the kernels' jaxprs.)"""
  q = jnp.zeros((1, 20, H, D), dtype)

  def loss(q, ob):
    out = relative_flash_attention(q, q, q, ob, precision=precision, interpret=False)
    return jnp.sum(out.astype(jnp.float32))

  text = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(q, jnp.zeros((H, 39))))
  assert text.count("dot_general") == 9  # forward 2, dq 3, dk/dv 4
  assert text.count("precision=(Precision.HIGHEST, Precision.HIGHEST)") == 9 * exact


@pytest.mark.parametrize("precision", ["float32", "tensorfloat32"])
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_float32_precisions_lower(platform, precision):
  text = _lowered_step(platform, dtype=jnp.float32, precision=precision,
                       tiles="roll" if platform == "tpu" else "gather")
  assert text.count(TRITON if platform == "cuda" else "tpu_custom_call") == 3


# Block choice. Budgets: H100, A100 and a GPU with 99 KiB of shared memory (L4, RTX 4090).
BUDGETS = {cc: memory_budget("gather", cc) for cc in ("9.0", "8.0", "8.9")}
# Shared memory XLA's Triton (jaxlib 0.11.2) asked for on an H100 (the larger of the dq and
# dk/dv kernels; RESOURCE_EXHAUSTED reports it): (blocks, itemsize, bias, precision, bytes).
# The first four are TUPE's float32 kernels under the old defaults (v padded to q/k's 256).
H100_REQUESTED = [
    (KernelBlocks(64, 64, 256, 256, 4, 2), 4, False, "tensorfloat32", 410368),
    (KernelBlocks(64, 64, 256, 256, 4, 2), 4, True, "tensorfloat32", 426752),
    (KernelBlocks(64, 64, 256, 256, 4, 2), 4, False, "float32", 295680),
    (KernelBlocks(64, 64, 256, 256, 4, 2), 4, True, "float32", 312064),
    (KernelBlocks(64, 64, 256, 256, 4, 1), 4, True, "float32", 294912),
    (KernelBlocks(64, 64, 256, 256, 4, 1), 4, True, "tensorfloat32", 278528),
    (KernelBlocks(64, 32, 256, 256, 4, 2), 4, True, "tensorfloat32", 237696),
    (KernelBlocks(32, 64, 256, 256, 4, 2), 4, True, "tensorfloat32", 278912),
    (KernelBlocks(128, 128, 256, 256, 8, 2), 2, False, "float32", 427520),
    (KernelBlocks(128, 128, 256, 256, 8, 2), 2, True, "float32", 524800),
    (KernelBlocks(128, 64, 256, 256, 4, 2), 2, True, "float32", 378368),
    (KernelBlocks(64, 128, 256, 256, 4, 2), 2, True, "float32", 393728),
]


def _smem(blocks, itemsize, has_bias, precision="float32"):
  return kernel_memory(blocks, q_len=1000, k_len=1000, itemsize=itemsize, has_bias=has_bias,
                       precision=precision)


@pytest.mark.parametrize("blocks, itemsize, has_bias, precision, requested", H100_REQUESTED)
def test_smem_model_bounds_what_triton_asked_for(blocks, itemsize, has_bias, precision,
                                                 requested):
  """The estimate is an upper bound on a measured kernel and not a vacuous one; the old
  TUPE defaults are over the H100's shared memory, as they were on the H100."""
  assert requested <= _smem(blocks, itemsize, has_bias, precision) <= 1.5 * requested
  assert _smem(blocks, itemsize, has_bias, precision) > SMEM_BYTES["9.0"]


@pytest.mark.parametrize("precision", ["float32", "tensorfloat32"])
@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("itemsize", [4, 2])
@pytest.mark.parametrize("dims", [(130, 64), (136, 64), (64, 64), (128, 128), (256, 256)])
@pytest.mark.parametrize("cc", BUDGETS)
def test_kernel_blocks_fit_the_budget(cc, dims, itemsize, has_bias, precision):
  """TUPE's folded widths (q/k 130 or 136 beside v 64) and plain head dims 64-256, float32
  and bfloat16, each GPU: the choice fits, its blocks are powers of two >= 16, and q/k and
  v are padded each to its own power of two."""
  blocks = kernel_blocks(1000, 1000, *dims, itemsize=itemsize, has_bias=has_bias,
                         precision=precision, budget=BUDGETS[cc])
  assert _smem(blocks, itemsize, has_bias, precision) <= BUDGETS[cc]
  for size in (blocks.block_q, blocks.block_k):
    assert size >= 16 and size & (size - 1) == 0
  assert (blocks.qk_dim, blocks.v_dim) == (256 if dims[0] > 128 else dims[0], dims[1])
  assert (blocks.num_warps, blocks.num_stages) in ((4, 2), (4, 1))


def test_kernel_blocks_choices():
  h100 = BUDGETS["9.0"]

  def pick(length, dims, itemsize=2, budget=h100, **kw):
    return kernel_blocks(length, length, *dims, itemsize=itemsize, has_bias=True,
                         budget=budget, **kw)

  # BERT-base, bfloat16: 64 x 64 tiles (faster on an H100 than 128-row ones), at any length.
  assert pick(512, (64, 64)) == pick(16384, (64, 64)) == KernelBlocks(64, 64, 64, 64, 4, 2)
  # TUPE-R in float32: q/k 136 -> 256 but v keeps 64, so 64 x 64 tiles fit again.
  assert pick(1000, (136, 64), itemsize=4) == KernelBlocks(64, 64, 256, 64, 4, 2)
  # Wider heads shrink the tiles; a tight budget drops a pipelining stage last.
  assert pick(1024, (256, 256), itemsize=4) == KernelBlocks(64, 32, 256, 256, 4, 2)
  assert pick(1024, (256, 256), itemsize=4, precision="tensorfloat32",
              budget=BUDGETS["8.9"]) == KernelBlocks(16, 16, 256, 256, 4, 1)
  # Nothing fits: the least demanding choice.
  assert pick(1024, (256, 256), budget=1) == KernelBlocks(16, 16, 256, 256, 4, 1)
  # Short sequences clamp the tiles; fixed sizes are kept (clamped too).
  short = kernel_blocks(20, 9, 8, 8, itemsize=4, has_bias=False, budget=h100)
  assert (short.block_q, short.block_k, short.qk_dim) == (32, 16, 16)
  fixed = pick(20, (64, 64), block_q=128, block_k=16)
  assert (fixed.block_q, fixed.block_k) == (32, 16)
  # An unknown GPU gets the smallest listed.
  assert memory_budget("gather", "7.5") == BUDGETS["8.9"]


def test_kernel_blocks_roll():
  """Mosaic tiles: 256 rows where that adds no padding to the 128-multiple length (else
  128), within the VMEM budget; fixed sizes kept."""
  def pick(lq, lk, **kw):
    blocks = kernel_blocks(lq, lk, 64, 64, itemsize=2, has_bias=True, tiles="roll", **kw)
    return blocks.block_q, blocks.block_k

  assert pick(512, 512) == (256, 256) and pick(300, 300) == (128, 128)
  assert pick(130, 260) == (256, 128) and pick(512, 512, block_q=128) == (128, 256)
  blocks = kernel_blocks(512, 512, 64, 64, itemsize=2, has_bias=True, tiles="roll")
  assert kernel_memory(blocks, q_len=512, k_len=512, itemsize=2, has_bias=True,
                       tiles="roll") <= memory_budget("roll")


# The TPU (Mosaic) way of building tiles: strided rolls of each tile's window, 128-blocks.
# Interpreted on CPU and compiled on a TPU; a GPU compiles Triton, not Mosaic TPU (its
# lowering for TPU is checked below on any machine).
ROLL = dict(tiles="roll")
MOSAIC_TPU_RUNS = pytest.mark.skipif(jax.default_backend() == "gpu",
                                     reason="roll tiles are Mosaic TPU's; a GPU cannot run them")


@MOSAIC_TPU_RUNS
def test_roll_tiles_diet_rel_with_padding():
  q, k, v, cot = _inputs(2, 200, 200)
  table = jax.random.normal(jax.random.PRNGKey(7), (H, 81))
  mask = jnp.arange(200)[None, :] < jnp.array([[200], [150]])
  _check(q, k, v, cot, table, lambda t, rel: _diet(t, rel, 40), mask=mask, **ROLL)


@MOSAIC_TPU_RUNS
def test_roll_tiles_causal_t5_with_cls_reset():
  q, k, v, cot = _inputs(1, 300, 300)
  table = jax.random.normal(jax.random.PRNGKey(7), (H, 8))
  _check(q, k, v, cot, table, lambda t, rel: _t5(t, rel, False), zero_first=True, causal=True,
         **ROLL)


@pytest.mark.parametrize("tiles, lq, lk", [pytest.param("roll", 130, 260, marks=MOSAIC_TPU_RUNS),
                                           ("band", 19, 53)])
def test_roll_and_band_tiles_cross_lengths_segments_alibi(tiles, lq, lk):
  q, _, _, cot = _inputs(2, lq, lq)
  _, k, v, _ = _inputs(2, lk, lk, seed=1)
  q_seg = jnp.stack([(jnp.arange(lq) >= lq // 2).astype(int)] * 2)
  kv_seg = jnp.stack([(jnp.arange(lk) >= lk * 2 // 5).astype(int)] * 2)
  _check(q, k, v, cot, alibi_slopes(H), lambda s, rel: _alibi(s, rel, False),
         q_segment_ids=q_seg, kv_segment_ids=kv_seg, tiles=tiles)


@pytest.mark.parametrize("causal", [False, True])
def test_roll_tiles_lower_for_tpu_mosaic(causal):
  """Forward and backward lower through Pallas' Mosaic backend (no TPU needed to lower)."""
  text = _lowered_step("tpu", causal=causal, tiles="roll")
  assert text.count("tpu_custom_call") == 3  # forward, dq (+ bias), dk/dv


@pytest.mark.parametrize("block_k", [128, 256])
@pytest.mark.parametrize("block_q", [128, 256])
def test_every_roll_block_pair_lowers_for_mosaic(block_q, block_k):
  text = _lowered_step("tpu", tiles="roll", block_q=block_q, block_k=block_k)
  assert text.count("tpu_custom_call") == 3


# The Triton way without gathers: band column blocks, and the bias gradient summed per
# diagonal of tiles by a fourth kernel.
BAND = dict(tiles="band")


def test_band_tiles_diet_rel_padding_and_dropout():
  q, k, v, cot = _inputs(2, 37, 37)
  table = jax.random.normal(jax.random.PRNGKey(7), (H, 11))
  mask = jnp.arange(37)[None, :] < jnp.array([[37], [20]])
  _check(q, k, v, cot, table, lambda t, rel: _diet(t, rel, 5), mask=mask,
         dropout=(0.2, jax.random.PRNGKey(3)), **BAND)


def test_band_tiles_causal_t5_with_cls_reset():
  q, k, v, cot = _inputs(1, 40, 40)
  table = jax.random.normal(jax.random.PRNGKey(7), (H, 8))
  _check(q, k, v, cot, table, lambda t, rel: _t5(t, rel, False), zero_first=True, causal=True,
         **BAND)


def test_band_tiles_equal_gather_tiles_with_32_row_blocks():
  """Same values and gradients as the gather tiles (only summation order differs), shared
  table across heads, 32 x 32 tiles."""
  q, k, v, cot = _inputs(1, 70, 70, d=24, dv=8)
  table = jax.random.normal(jax.random.PRNGKey(7), (1, 81))

  def run(tiles):
    def f(q, k, v, table):
      out = relative_flash_attention(q, k, v, _diet(table, offsets(70, 70), 40), tiles=tiles,
                                     block_q=32, block_k=32)
      return jnp.sum(out * cot)
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3)))(q, k, v, table)

  (band_loss, band_grads), (gather_loss, gather_grads) = run("band"), run("gather")
  np.testing.assert_allclose(band_loss, gather_loss, rtol=1e-6)
  for name, got, want in zip("q k v table".split(), band_grads, gather_grads):
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=f"d{name}")


def test_band_tiles_are_square_and_lower_scatter_free_for_triton():
  q, k, v, _ = _inputs(1, 8, 8)
  with pytest.raises(ValueError, match=r"^block_q, block_k: got 32x16; band tiles are square$"):
    relative_flash_attention(q, k, v, tiles="band", block_q=32, block_k=16)
  blocks = kernel_blocks(40, 300, 64, 64, itemsize=2, has_bias=True, tiles="band")
  assert blocks.block_q == blocks.block_k == 64
  texts = {tiles: _lowered_step("cuda", tiles=tiles, causal=True, dropout_rate=0.1,
                                dropout_seed=jnp.array([[7]], jnp.int32))
           for tiles in ("band", "gather")}
  assert texts["band"].count(TRITON) == 4  # forward, dq, dk/dv, the bias gradient
  # The one scatter is the T5 table's gradient (its bucket gather's), in both.
  assert texts["band"].count('"stablehlo.scatter"(') == texts["gather"].count(
      '"stablehlo.scatter"(') == 1
