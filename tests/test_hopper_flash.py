"""The Hopper kernels (posenc_jax.kernels.hopper_flash) in Mosaic GPU's interpret mode on CPU.
The forward, with one and two consumer warpgroups: values and lse against a float32
reference and against the Triton forward, gradients through the Triton backward that reads
its lse, dropout's mask, the bias band, shared memory against Mosaic GPU's own limit. The
backward: gradients against the Triton backward's. Errors, and lowering for CUDA."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posenc_jax.kernels import hopper_flash, kernel_blocks, relative_flash_attention
from posenc_jax.kernels import relative_flash as rf
from posenc_jax.kernels.dropout import dropout_seed
from posenc_jax.terms import offsets, relative_offsets
from tests.test_relative_flash import TRITON, _alibi, _diet, _lowered, _t5

H = 2
MOSAIC_GPU = "mosaic_gpu"
BF16_TOL = 2e-2  # bfloat16 outputs of unit-scale attention against a float32 reference


def _inputs(b, length, d=64, dv=None, dtype=jnp.bfloat16, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  q, k = (jax.random.normal(key, (b, length, H, d)).astype(dtype) for key in ks[:2])
  v = jax.random.normal(ks[2], (b, length, H, dv or d)).astype(dtype)
  return q, k, v, jax.random.normal(ks[3], (b, length, H, dv or d))


def _reference(q, k, v, bias, *, mask=None, segments=None, causal=False, zero_first=False):
  """float32 softmax attention with the materialised ``bias [H, Lq, Lk]``; rows with no key
  give zeros (the kernels' convention), and the lse ``[B, H, Lq]``."""
  q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  lq, lk = q.shape[1], k.shape[1]
  if zero_first:
    bias = bias * ((jnp.arange(lq) != 0)[:, None] & (jnp.arange(lk) != 0)[None, :])
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") / np.sqrt(q.shape[-1]) + bias
  valid = jnp.ones((q.shape[0], 1, lq, lk), bool)
  if mask is not None:
    valid &= mask[:, None, None, :]
  if segments is not None:
    valid &= (segments[:, :, None] == segments[:, None, :])[:, None]
  if causal:
    valid &= jnp.arange(lk)[None, :] <= jnp.arange(lq)[:, None]
  lse = jax.nn.logsumexp(jnp.where(valid, s, -jnp.inf), axis=-1)
  p = jnp.where(valid, jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
  return jnp.einsum("bhqk,bkhd->bqhd", p, v, precision="highest"), lse


CASES = {
    # name: (length, bias of (table, rel), table size, kernel keywords)
    "diet_rel odd length, padding": (100, lambda t, rel: _diet(t, rel, 7), 15,
                                     dict(mask="pad")),
    "t5 causal, cls reset, 128-row keys": (
        192, lambda t, rel: _t5(t, rel, bidirectional=False), 16,
        dict(causal=True, zero_first=True, block_k=128)),
    "alibi packed segments": (128, lambda t, rel: _alibi(jnp.abs(t[:, 0]), rel, False), 1,
                              dict(segments=True)),
    "no bias, v 128 wide": (64, None, 0, dict(dv=128)),
}


@pytest.mark.parametrize("name, warpgroups", [(name, 2) for name in CASES] + [(
    "t5 causal, cls reset, 128-row keys", 1)])
def test_forward_matches_the_float32_reference_and_the_triton_forward(name, warpgroups):
  """Two warpgroups: 100 and 128 rows fill every block of the grid, 64 and 192 leave the
  last block's second warpgroup idle. One warpgroup: the causal case (and the lse tests)."""
  length, bias_fn, table_size, kw = CASES[name]
  kw = dict(kw)
  q, k, v, _ = _inputs(2, length, dv=kw.pop("dv", None))
  table = jax.random.normal(jax.random.PRNGKey(3), (H, max(table_size, 1)))
  ob = None if bias_fn is None else bias_fn(table, offsets(length, length))
  bias = 0.0 if bias_fn is None else bias_fn(table, relative_offsets(length, length))
  mask = jnp.arange(length)[None, :] < jnp.array([[length], [length - 29]])
  segments = jnp.broadcast_to(jnp.arange(length) * 3 // length, (2, length))
  call = dict(causal=kw.get("causal", False), zero_first=kw.get("zero_first", False),
              mask=mask if kw.get("mask") else None, block_q=64, block_k=kw.get("block_k", 64))
  if kw.get("segments"):
    call.update(q_segment_ids=segments, kv_segment_ids=segments)
  hopper = relative_flash_attention(q, k, v, ob, forward="hopper", warpgroups=warpgroups,
                                    **call)
  tiles = relative_flash_attention(q, k, v, ob, **call)
  want, _ = _reference(q, k, v, bias, mask=call["mask"],
                       segments=segments if kw.get("segments") else None,
                       causal=call["causal"], zero_first=call["zero_first"])
  assert hopper.dtype == jnp.bfloat16 and hopper.shape == want.shape
  np.testing.assert_allclose(hopper.astype(jnp.float32), want, atol=BF16_TOL, rtol=BF16_TOL)
  # Same operands and float32 accumulation: only the summation order differs.
  np.testing.assert_allclose(hopper.astype(jnp.float32), tiles.astype(jnp.float32), atol=1e-2,
                             rtol=0)
  assert float(jnp.mean(jnp.abs(hopper.astype(jnp.float32) - tiles.astype(jnp.float32)))) < 1e-4


def _padded_call(length, block_k=64, causal=False, dropout=0.0):
  """The padded head-major arrays relative_flash gives its kernels, and its lse through the
  Triton forward (the reference for the Hopper forward's lse)."""
  q, k, v, _ = _inputs(1, length)
  table = jax.random.normal(jax.random.PRNGKey(5), (H, 16))
  ob = _t5(table, offsets(length, length), bidirectional=not causal)
  blocks = kernel_blocks(length, length, 64, 64, itemsize=2, has_bias=True, block_q=64,
                         block_k=block_k)
  cfg = rf._Config(has_bias=True, tiles="gather", zero_first=False, causal=causal,
                   scale=0.125, precision="float32", dropout_rate=dropout, blocks=blocks,
                   q_len=length, k_len=length,
                   interpret=jax.default_backend() == "cpu")
  head_major = [jnp.swapaxes(x, 1, 2) for x in (q, k, v)]
  loff = cfg.offset_len
  obp = jnp.pad(ob, ((0, 0), (0, loff - ob.shape[1])))[:, None, :]
  qseg = jnp.zeros((1, length, 1), jnp.int32)
  kseg = jnp.where(jnp.arange(length) < length - 9, 0, -1)[None, None, :].astype(jnp.int32)
  seed = jnp.array([[1234]], jnp.int32)
  rows, cols = jnp.zeros((1, H, length, 1)), jnp.zeros((1, H, 1, length))  # no separable term
  args = (*head_major, obp, qseg, kseg, rows, cols, seed)
  return cfg, args


@pytest.mark.parametrize("warpgroups", [1, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_lse_equals_the_triton_forwards(causal, warpgroups):
  cfg, args = _padded_call(192, causal=causal)
  out_t, lse_t = rf._forward(cfg, *args)
  hopper = dataclasses.replace(cfg, forward="hopper", warpgroups=warpgroups)
  out_h, lse_h = rf._forward(hopper, *args)
  assert lse_h.shape == lse_t.shape == (1, H, 192, 1)
  np.testing.assert_allclose(lse_h, lse_t, atol=1e-5, rtol=1e-6)
  np.testing.assert_allclose(out_h.astype(jnp.float32), out_t.astype(jnp.float32), atol=1e-2)
  # Causal: key blocks past a query block's last row skip their MMAs behind one cond (its
  # values are checked above: query block 0 never reads key block 1). Two warpgroups leave
  # one idle in the last block here, behind a cond either way.
  if causal and warpgroups == 1:
    conds = [str(jax.make_jaxpr(functools.partial(rf._forward, dataclasses.replace(
        hopper, causal=c)))(*args)).count("cond[") for c in (False, True)]
    assert conds[1] == conds[0] + 1, conds


def test_gradients_through_the_triton_backward():
  """The Triton backward reads the Hopper forward's out and lse: the gradients of q, k, v and
  the bias table equal the all-Triton ones (float32 accumulation, bf16 operands)."""
  length = 96
  q, k, v, cot = _inputs(2, length)
  table = jax.random.normal(jax.random.PRNGKey(9), (H, 15))
  mask = jnp.arange(length)[None, :] < jnp.array([[length], [70]])

  def loss(forward):
    def f(q, k, v, table):
      out = relative_flash_attention(q, k, v, _diet(table, offsets(length, length), 7),
                                     mask=mask, block_q=64, block_k=64, forward=forward)
      return jnp.sum(out.astype(jnp.float32) * cot)
    return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3)))(q, k, v, table)

  for name, got, want in zip("q k v table".split(), loss("hopper"), loss("tiles")):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=2e-2, rtol=2e-2, err_msg=f"d{name}")


def test_dropout_draws_the_triton_forwards_mask():
  """Same (seed, b, h, i, j) hash in the Hopper tiles: the outputs agree, and differ from the
  output without dropout."""
  length = 128
  q, k, v, _ = _inputs(1, length)
  ob = _t5(jax.random.normal(jax.random.PRNGKey(2), (H, 16)), offsets(length, length), True)
  seed = dropout_seed(jax.random.PRNGKey(4))
  call = dict(block_q=64, block_k=64, dropout_rate=0.3, dropout_seed=seed)
  hopper = relative_flash_attention(q, k, v, ob, forward="hopper", **call)
  tiles = relative_flash_attention(q, k, v, ob, **call)
  np.testing.assert_allclose(hopper.astype(jnp.float32), tiles.astype(jnp.float32), atol=1e-2)
  plain = relative_flash_attention(q, k, v, ob, forward="hopper", block_q=64, block_k=64)
  assert float(jnp.max(jnp.abs(hopper.astype(jnp.float32) - plain.astype(jnp.float32)))) > 0.1


def test_fully_masked_rows_are_zero():
  q, k, v, _ = _inputs(1, 64)
  out = relative_flash_attention(q, k, v, jnp.ones((H, 127)), mask=jnp.zeros((1, 64), bool),
                                 forward="hopper", block_q=64, block_k=64)
  np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)


@pytest.mark.parametrize("lead", [0, 1])
def test_the_bias_band_holds_every_tile_of_the_toeplitz_bias(lead):
  """The 64x64 tile of query block ``qi`` and keys ``64 kb + [0, 64)`` is the band's 64
  columns from unit ``kb - qi + Lq / 64 - 1 + lead``."""
  lq, lk = 192, 256
  ob = jnp.arange(1, lq + lk, dtype=jnp.float32)[None, None, :]
  full = ob[0, 0][jnp.arange(lk)[None, :] - jnp.arange(lq)[:, None] + lq - 1]
  band = hopper_flash.hopper_band(ob, lq, lk, lead=lead)
  assert band.shape == (1, 64, 64 * (lead + (lq + lk) // 64 - 1)) and band.dtype == jnp.float32
  for qi in range(lq // 64):
    for kb in range(lk // 64):
      n = kb - qi + lq // 64 - 1 + lead
      np.testing.assert_array_equal(band[0, :, 64 * n:64 * (n + 1)],
                                    full[64 * qi:64 * (qi + 1), 64 * kb:64 * (kb + 1)])
  # The lead units continue the band to the left, with zeros before the vector.
  index = np.arange(band.shape[2])[None, :] - np.arange(64)[:, None] + 63 - 64 * lead
  np.testing.assert_array_equal(band[0], np.where(index >= 0, np.asarray(ob[0, 0])[index], 0))


def _lowered_forward(length, dim, block_k, warpgroups, has_bias=True):
  """The Hopper forward alone lowered for CUDA: q/k/v ``[1, H, length, dim]`` bfloat16."""
  qkv = jax.ShapeDtypeStruct((1, H, length, dim), jnp.bfloat16)
  args = (qkv, qkv, qkv, jax.ShapeDtypeStruct((H, 1, 2 * length), jnp.float32),
          jax.ShapeDtypeStruct((1, length, 1), jnp.int32),
          jax.ShapeDtypeStruct((1, 1, length), jnp.int32),
          jax.ShapeDtypeStruct((1, 1), jnp.int32))
  f = functools.partial(hopper_flash.forward, block_k=block_k, scale=0.125, causal=False,
                        zero_first=False, has_bias=has_bias, dropout_rate=0.0,
                        interpret=False, warpgroups=warpgroups)
  return _lowered(f, args, "cuda")


SHAPES = [(dim, block_k, has_bias) for dim in (64, 128) for block_k in hopper_flash.BLOCK_KS
          for has_bias in (True, False)]


@pytest.mark.parametrize("dim, block_k, has_bias", SHAPES)
def test_shared_memory_admits_what_mosaic_gpu_lowers(dim, block_k, has_bias):
  """At every head dim and key block the most warpgroups ``max_warpgroups`` admits lower for
  CUDA within Mosaic GPU's own shared-memory limit (227 KiB). The one shape it refuses, head
  dim 128 with 128-row key blocks and a bias, is over that limit with one warpgroup too."""
  most = hopper_flash.max_warpgroups(block_k=block_k, qk_dim=dim, v_dim=dim, itemsize=2,
                                     has_bias=has_bias)
  if (dim, block_k, has_bias) == (128, 128, True):
    assert most == 0
    with pytest.raises(ValueError, match="exceeds available shared memory"):
      _lowered_forward(512, dim, block_k, 1)
  else:
    assert most == hopper_flash.MAX_WARPGROUPS
    assert "relative_flash_fwd_hopper" in _lowered_forward(512, dim, block_k, most, has_bias)


def test_errors_are_one_line():
  q, k, v, _ = _inputs(1, 64)
  with pytest.raises(ValueError, match=r"^forward: got 'cudnn'; allowed: tiles, hopper$"):
    relative_flash_attention(q, k, v, forward="cudnn")
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  with pytest.raises(ValueError, match=r"^forward: 'hopper' takes bfloat16/float16 .*float32"):
    relative_flash_attention(*f32, forward="hopper", block_q=64)
  with pytest.raises(ValueError, match=r"^forward: 'hopper' .*blocks 32x64$"):
    relative_flash_attention(q, k, v, forward="hopper", block_q=32, block_k=64)
  with pytest.raises(ValueError, match=r"^warpgroups: got 3; allowed: 1 to 2 at these shapes$"):
    relative_flash_attention(q, k, v, forward="hopper", warpgroups=3)
  with pytest.raises(ValueError, match=r"^warpgroups: got 1; allowed: None unless "
                                       r"forward='hopper' fits$"):
    relative_flash_attention(q, k, v, warpgroups=1)
  q128, k128, v128, _ = _inputs(1, 128, d=128)
  with pytest.raises(ValueError, match=r"^forward: 'hopper' .* within 232448 bytes of shared "
                                       r"memory; got bfloat16, head dims 128/128, blocks 64x128$"):
    relative_flash_attention(q128, k128, v128, jnp.zeros((H, 255)), forward="hopper",
                             block_k=128)


@pytest.mark.parametrize("causal", [False, True])
def test_forward_and_backward_lower_for_cuda(causal):
  """The Hopper forward lowers to one Mosaic GPU kernel, the backward to the two Triton
  kernels (with the T5 bias, padding mask, [CLS] reset and dropout)."""
  length = 256

  def loss(q, k, v, table):
    ob = _t5(table, offsets(length, length), bidirectional=not causal)
    out = relative_flash_attention(q, k, v, ob, mask=jnp.ones((2, length), bool),
                                   causal=causal, zero_first=True, block_q=64, block_k=128,
                                   dropout_rate=0.1, dropout_seed=jnp.array([[7]], jnp.int32),
                                   forward="hopper", interpret=False)
    return jnp.sum(out.astype(jnp.float32))

  shapes = [jax.ShapeDtypeStruct((2, length, H, 64), jnp.bfloat16)] * 3
  shapes.append(jax.ShapeDtypeStruct((H, 32), jnp.float32))
  text = _lowered(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)), shapes, "cuda")
  assert text.count(MOSAIC_GPU) >= 1 and "relative_flash_fwd_hopper" in text
  assert text.count(TRITON) == 2  # dq (+ bias) and dk/dv


BACKWARD_CASES = {
    # name: (batch, length, bias of (table, rel) or None, table size, keywords)
    "diet_rel odd length, padding, dropout": (2, 100, lambda t, rel: _diet(t, rel, 7), 15,
                                              dict(mask=True, dropout=0.2)),
    "t5 causal, cls reset, idle warpgroups": (
        1, 192, lambda t, rel: _t5(t, rel, bidirectional=False), 16,
        dict(causal=True, zero_first=True, block_k=64)),
    "alibi packed segments": (1, 128, lambda t, rel: _alibi(t[:, 0], rel, False), 1,
                              dict(segments=True)),
    "no bias": (1, 64, None, 1, {}),
}


@pytest.mark.parametrize("name", BACKWARD_CASES)
def test_hopper_backward_matches_the_triton_backward(name):
  """The Mosaic GPU backward (dq, dk/dv and the per-diagonal bias gradient) against the
  Triton one, both after the Hopper forward: bf16 operands, float32 accumulation."""
  batch, length, bias_fn, table_size, kw = BACKWARD_CASES[name]
  q, k, v, cot = _inputs(batch, length, seed=1)
  table = jax.random.normal(jax.random.PRNGKey(9), (H, table_size))
  mask = jnp.arange(length)[None, :] < jnp.array([[length], [length - 37]])[:batch]
  segments = jnp.broadcast_to(jnp.arange(length) * 3 // length, (batch, length))
  call = dict(causal=kw.get("causal", False), zero_first=kw.get("zero_first", False),
              block_q=64, block_k=kw.get("block_k", 64), forward="hopper",
              mask=mask if kw.get("mask") else None)
  if kw.get("segments"):
    call.update(q_segment_ids=segments, kv_segment_ids=segments)
  if kw.get("dropout"):
    call.update(dropout_rate=kw["dropout"], dropout_seed=dropout_seed(jax.random.PRNGKey(4)))

  def grads(backward):
    def f(q, k, v, table):
      ob = None if bias_fn is None else bias_fn(table, offsets(length, length))
      out = relative_flash_attention(q, k, v, ob, backward=backward, **call)
      return jnp.sum(out.astype(jnp.float32) * cot)
    return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3)))(q, k, v, table)

  hopper = grads("hopper")
  for n, got, want in zip("q k v table".split(), hopper, grads("tiles")):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2, err_msg=f"d{n}")
    assert np.abs(got - want).mean() <= 2e-3 * max(np.abs(want).mean(), 1e-3), f"d{n}"
  if bias_fn is not None:
    assert np.abs(np.asarray(hopper[3])).max() > 0.1


@pytest.mark.parametrize("dim", [64, 128])
def test_hopper_backward_lowers_for_cuda_without_triton(dim):
  """Forward and backward both on Mosaic GPU: four kernels (forward; dq, dk/dv and the bias
  gradient), no Triton, and no scatter besides the DIET table's own; within shared memory
  with two warpgroups at head dim 64 and one at 128."""
  length = 256
  assert hopper_flash.backward_warpgroups(qk_dim=dim, v_dim=dim) == {64: 2, 128: 1}[dim]

  def loss(q, k, v, table):
    ob = _diet(table, offsets(length, length), 7)
    out = relative_flash_attention(q, k, v, ob, mask=jnp.ones((2, length), bool), causal=True,
                                   zero_first=True, block_q=64, block_k=8192 // dim,
                                   dropout_rate=0.1,
                                   dropout_seed=jnp.array([[7]], jnp.int32), forward="hopper",
                                   backward="hopper", interpret=False)
    return jnp.sum(out.astype(jnp.float32))

  shapes = [jax.ShapeDtypeStruct((2, length, H, dim), jnp.bfloat16)] * 3
  shapes.append(jax.ShapeDtypeStruct((H, 15), jnp.float32))
  text = _lowered(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)), shapes, "cuda")
  for name in ("fwd", "dq", "dkv", "dbias"):
    assert f"relative_flash_{name}_hopper" in text, name
  assert TRITON not in text
  assert text.count('"stablehlo.scatter"(') == 1  # the DIET table's own clipped gather


def test_hopper_backward_errors_are_one_line():
  q, k, v, _ = _inputs(1, 64)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  with pytest.raises(ValueError, match=r"^backward: got 'cudnn'; allowed: tiles, hopper$"):
    relative_flash_attention(q, k, v, backward="cudnn")
  with pytest.raises(ValueError, match=r"^backward: 'hopper' takes bfloat16/float16 .*; got "
                                       r"float32, head dims 64/64, blocks 64x64$"):
    relative_flash_attention(*f32, backward="hopper", block_q=64, block_k=64)
  wide = _inputs(1, 64, d=256)[:3]
  with pytest.raises(ValueError, match=r"^backward: 'hopper' .* up to 128 .*head dims 256/256"):
    relative_flash_attention(*wide, backward="hopper", block_q=64, block_k=64)
  # What the fused route asks before it runs both Hopper passes: the same refusals.
  assert rf.hopper_fits(512, 512, 64, 64, jnp.bfloat16, backward=True)
  assert rf.hopper_fits(256, 200, 40, 64, jnp.float16, backward=True)  # padded 64/64
  assert not rf.hopper_fits(512, 512, 64, 64, jnp.float32, backward=True)
  assert not rf.hopper_fits(512, 512, 64, 192, jnp.bfloat16, backward=True)
