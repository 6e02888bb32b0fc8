"""Flash attention that builds Toeplitz (relative) biases inside the kernel.

A relative-position bias depends on the query/key positions only through the
offset ``rel = j - i`` (key minus query position, as
:func:`posenc_jax.terms.relative_offsets`). For ``Lq`` queries and ``Lk`` keys
there are ``Lq + Lk - 1`` offsets, so the whole bias of a head is one vector

    offset_bias[h, o],   o = rel + Lq - 1 in [0, Lq + Lk - 1)

(:func:`posenc_jax.terms.offsets` lists the ``rel`` of each ``o``). A scheme turns its small
table into that vector outside the kernel (DIET-REL: a clipped gather, T5: a
bucket gather, ALiBi: slope times distance; see
:meth:`posenc_jax.terms.Toeplitz.offset_values`), which costs ``O(H L)``, and
:func:`relative_flash_attention` computes

    out[b, i, h] = sum_j softmax_j(scale * q_i . k_j + offset_bias[h, j - i + Lq - 1]) v_j

with an online (flash) softmax blocked over queries and keys. Each
``[block_q, block_k]`` bias tile is built inside the kernel from the
vector, so no ``[B, H, L, L]`` or ``[H, L, L]`` array is ever materialised,
in the forward or the backward pass. The backward pass returns the vector's
gradient: each logit-cotangent tile is summed along its diagonals
(``O(block_q (block_q + block_k))`` per tile) into the offsets it covers;
JAX then carries that gradient back through the scheme's gather to its table.

Masking: ``q_segment_ids [B, Lq]`` and ``kv_segment_ids [B, Lk]`` (packed
sequences: a query sees only keys of its own segment), a ``mask [B, Lk]`` of
keys (True = attend), and ``causal`` (``j > i`` masked, top-left aligned as
:func:`posenc_jax.attention.attend`). ``zero_first`` zeroes the bias in row 0
and column 0 (TUPE-R's [CLS] reset). A query row whose keys are *all* masked
returns zeros (the materialised reference averages every value uniformly
there instead).

Two ways of building tiles (``tiles``), both exact and both tested in
interpret mode on CPU (``interpret=None`` picks it on the CPU backend):

* ``gather`` (GPU, Pallas' Triton backend): the tile is an in-kernel gather
  ``ob[j - i + Lq_p - 1]``; its gradient goes through a ``[bq, bk]`` scratch
  read back skewed (one diagonal per column). Every in-kernel array has a
  power-of-two size: block sizes are powers of two, the head dim and the
  offset vector are zero-padded to powers of two.
* ``roll`` (TPU, Pallas' Mosaic backend, which has no gather): blocks are
  multiples of 128, so each tile's window of ``bq + bk`` offsets is a
  lane-aligned slice; broadcast to the rows and rotated by one strided roll
  (row ``r`` by ``bk + 1 + r``) it is the tile. The gradient rolls the
  zero-padded cotangent tile back and sums its rows.

Both lower for their accelerator without one (``jax.export``, tested); neither
has yet been run or tuned on a GPU or TPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plt

Array = jax.Array

_NEG = -1e30  # finite "minus infinity" for masked logits (avoids inf - inf)
_Q_PAD, _K_PAD = -2, -1  # segment ids of padded query rows / masked keys: never equal


def _next_pow2(x: int) -> int:
  return 1 << max(0, (x - 1).bit_length())


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


@dataclasses.dataclass(frozen=True)
class _Config:
  """Static kernel settings; lengths are the padded ones unless named otherwise."""

  has_bias: bool
  tiles: str  # "gather" (Triton, interpret) or "roll" (Mosaic, interpret)
  zero_first: bool
  causal: bool
  scale: float
  block_q: int
  block_k: int
  q_len: int  # Lq_p
  k_len: int  # Lk_p
  interpret: bool

  @property
  def compiler_params(self):
    if self.interpret:
      return None
    if self.tiles == "roll":
      return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))
    return plt.CompilerParams(num_warps=4, num_stages=2)

  def window_start(self, qi, kj):
    """Offset index (in the padded vector) of the first diagonal a tile touches.

    Column ``w`` of a tile's window holds ``rel = kj*bk - qi*bq + w - (bq - 1)``,
    i.e. vector entry ``window_start + w``; the window has ``bq + bk`` entries.
    With roll tiles it is a multiple of 128 (lane-aligned), and says so to Mosaic.
    """
    start = kj * self.block_k - qi * self.block_q + self.q_len - self.block_q
    return pl.multiple_of(start, 128) if self.tiles == "roll" else start


def _barrier(cfg: _Config) -> None:
  """Synchronises the threads of a Triton program (no-op in interpret mode)."""
  if not cfg.interpret:
    plt.debug_barrier()


def _tile(cfg, q, k, ob_ref, qseg, kseg, qi, kj):
  """Scaled logits + bias ``[bq, bk]`` (float32, masked to ``_NEG``) and the validity mask.

  ``qseg`` ``[bq, 1]`` and ``kseg`` ``[1, bk]`` are the tile's segment ids.
  """
  s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  s = s * cfg.scale
  i, j = _positions(cfg, qi, kj)
  if cfg.has_bias:
    s = s + _cls_reset(cfg, _bias_tile(cfg, ob_ref, i, j, qi, kj), i, j)
  valid = qseg == kseg
  if cfg.causal:
    valid = valid & (j <= i)
  return jnp.where(valid, s, _NEG), valid


def _positions(cfg, qi, kj):
  """Query and key positions ``i``, ``j`` of a tile, each ``[bq, bk]`` int32."""
  shape = (cfg.block_q, cfg.block_k)
  return (qi * cfg.block_q + lax.broadcasted_iota(jnp.int32, shape, 0),
          kj * cfg.block_k + lax.broadcasted_iota(jnp.int32, shape, 1))


def _cls_reset(cfg, tile, i, j):
  """``tile`` (positions ``i``, ``j``) with row 0 and column 0 zeroed under ``zero_first``
  (TUPE-R), else itself."""
  if not cfg.zero_first:
    return tile
  return jnp.where((i == 0) | (j == 0), 0.0, tile)


def _bias_tile(cfg, ob_ref, i, j, qi, kj):
  """``[bq, bk]`` float32 tile ``ob[j - i + Lq_p - 1]`` from the ``[1, Loff_p]`` ref.

  ``gather``: an in-kernel gather (Triton loads through a pointer tensor).
  ``roll``: the tile's window of ``bq + bk`` entries (a lane-aligned slice, the
  blocks being multiples of 128) broadcast to every row, row ``r`` rotated by
  ``bk + 1 + r`` (one strided roll), then its first ``bk`` columns.
  """
  if cfg.tiles == "gather":
    return ob_ref[0, j - i + (cfg.q_len - 1)].astype(jnp.float32)
  bq, bk = cfg.block_q, cfg.block_k
  window = ob_ref[:, pl.ds(cfg.window_start(qi, kj), bq + bk)]
  rows = jnp.broadcast_to(window.astype(jnp.float32), (bq, bq + bk))
  return pltpu.roll(rows, bk + 1, 1, stride=1, stride_axis=0)[:, :bk]


def _diagonal_sums(cfg, dbias, ds_ref):
  """``[1, bq + bk]`` sums of the tile ``dbias`` ``[bq, bk]`` along its diagonals (window order).

  ``gather``: the tile goes through the ``ds_ref`` scratch and is read back
  skewed (column ``w`` of row ``r`` is tile column ``r + w - (bq - 1)``).
  ``roll``: the tile, zero-padded to the window width, is rotated back (row
  ``r`` by ``-(bk + 1 + r)``) and summed over rows.
  """
  bq, bk = cfg.block_q, cfg.block_k
  width = bq + bk
  if cfg.tiles == "roll":
    padded = jnp.concatenate([dbias, jnp.zeros((bq, width - bk), jnp.float32)], axis=1)
    back = pltpu.roll(padded, width - bk - 1, 1, stride=width - 1, stride_axis=0)
    return jnp.sum(back, axis=0, keepdims=True)
  row = lax.broadcasted_iota(jnp.int32, (bq, width), 0)
  col = row + lax.broadcasted_iota(jnp.int32, (bq, width), 1) - (bq - 1)
  on_tile = (col >= 0) & (col < bk)
  ds_ref[...] = dbias
  _barrier(cfg)
  sums = jnp.sum(jnp.where(on_tile, ds_ref[row, jnp.clip(col, 0, bk - 1)], 0.0), axis=0,
                 keepdims=True)
  _barrier(cfg)
  return sums


def _num_k_blocks(cfg, qi):
  """k-blocks a query block needs (causal: up to the diagonal)."""
  nk = cfg.k_len // cfg.block_k
  if not cfg.causal:
    return nk
  # lax.div: truncating division of non-negative ints (Mosaic lowers no floor division).
  return jnp.minimum(nk, lax.div((qi + 1) * cfg.block_q + cfg.block_k - 1, cfg.block_k))


# ---------------------------------------------------------------------------
# Kernels. Refs are one (batch, head) slice, every array 2-D: q/do [bq or Lq_p, Dp],
# k/v [Lk_p or bk, Dp], offset bias [1, Loff_p], query segment ids and lse/delta
# columns [bq or Lq_p, 1], key segment ids a row [1, Lk_p or bk].


def _fwd_kernel(cfg, q_ref, k_ref, v_ref, ob_ref, qseg_ref, kseg_ref, o_ref, lse_ref):
  qi = pl.program_id(2)
  bq, bk = cfg.block_q, cfg.block_k
  q, qseg = q_ref[...], qseg_ref[...]

  def body(kj, carry):
    m, l, acc = carry
    k = k_ref[pl.ds(kj * bk, bk), :]
    v = v_ref[pl.ds(kj * bk, bk), :]
    s, valid = _tile(cfg, q, k, ob_ref, qseg, kseg_ref[:, pl.ds(kj * bk, bk)], qi, kj)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    p = jnp.where(valid, jnp.exp(s - m_new), 0.0)
    alpha = jnp.exp(m - m_new)
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                         preferred_element_type=jnp.float32)
    return m_new, alpha * l + jnp.sum(p, axis=1, keepdims=True), alpha * acc + pv

  init = (jnp.full((bq, 1), _NEG, jnp.float32), jnp.zeros((bq, 1), jnp.float32),
          jnp.zeros(o_ref.shape, jnp.float32))
  m, l, acc = lax.fori_loop(0, _num_k_blocks(cfg, qi), body, init)
  empty = l == 0.0
  l_safe = jnp.where(empty, 1.0, l)
  o_ref[...] = (acc / l_safe).astype(o_ref.dtype)
  # Empty rows get lse = +big so that exp(s - lse) = 0 in the backward.
  lse_ref[...] = jnp.where(empty, -_NEG, m + jnp.log(l_safe))


def _dq_kernel(cfg, q_ref, k_ref, v_ref, ob_ref, qseg_ref, kseg_ref, do_ref, lse_ref, delta_ref,
               dq_ref, dob_ref=None, ds_ref=None):
  """``dq`` of one query block and, with a bias, its part of the offset-bias gradient.

  ``dob_ref`` ``[1, Loff_p]`` accumulates the diagonal sums of every logit
  cotangent tile of this query block (``ds_ref`` ``[bq, bk]``: the gather
  mode's scratch, see :func:`_diagonal_sums`).
  """
  qi = pl.program_id(2)
  bq, bk = cfg.block_q, cfg.block_k
  q, do, qseg = q_ref[...], do_ref[...], qseg_ref[...]
  lse, delta = lse_ref[...], delta_ref[...]
  if cfg.has_bias:
    dob_ref[...] = jnp.zeros(dob_ref.shape, jnp.float32)

  def body(kj, dq):
    k = k_ref[pl.ds(kj * bk, bk), :]
    v = v_ref[pl.ds(kj * bk, bk), :]
    s, valid = _tile(cfg, q, k, ob_ref, qseg, kseg_ref[:, pl.ds(kj * bk, bk)], qi, kj)
    p = jnp.where(valid, jnp.exp(s - lse), 0.0)
    dp = lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    ds = p * (dp - delta)
    if cfg.has_bias:
      window = (slice(None), pl.ds(cfg.window_start(qi, kj), bq + bk))
      dbias = _cls_reset(cfg, ds, *_positions(cfg, qi, kj))
      dob_ref[window] = dob_ref[window] + _diagonal_sums(cfg, dbias, ds_ref)
    return dq + lax.dot_general(ds.astype(k.dtype), k, (((1,), (0,)), ((), ())),
                                preferred_element_type=jnp.float32)

  dq = lax.fori_loop(0, _num_k_blocks(cfg, qi), body, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


def _dkv_kernel(cfg, q_ref, k_ref, v_ref, ob_ref, qseg_ref, kseg_ref, do_ref, lse_ref, delta_ref,
                dk_ref, dv_ref):
  kj = pl.program_id(2)
  bq, bk = cfg.block_q, cfg.block_k
  k, v, kseg = k_ref[...], v_ref[...], kseg_ref[...]

  def body(qi, carry):
    dk, dv = carry
    rows = pl.ds(qi * bq, bq)
    q, do = q_ref[rows, :], do_ref[rows, :]
    s, valid = _tile(cfg, q, k, ob_ref, qseg_ref[rows, :], kseg, qi, kj)
    p = jnp.where(valid, jnp.exp(s - lse_ref[rows, :]), 0.0)
    dv = dv + lax.dot_general(p.astype(do.dtype), do, (((0,), (0,)), ((), ())),
                              preferred_element_type=jnp.float32)
    dp = lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    ds = p * (dp - delta_ref[rows, :])
    dk = dk + lax.dot_general(ds.astype(q.dtype), q, (((0,), (0,)), ((), ())),
                              preferred_element_type=jnp.float32)
    return dk, dv

  start = lax.div(kj * bk, bq) if cfg.causal else 0
  init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
  dk, dv = lax.fori_loop(start, cfg.q_len // bq, body, init)
  dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


# ---------------------------------------------------------------------------
# pallas_call wrappers on padded, head-major arrays: q/do [B, H, Lq_p, Dp],
# k/v [B, H, Lk_p, Dp], offset bias [H, 1, Loff_p], query segment ids
# [B, Lq_p, 1], key segment ids [B, 1, Lk_p], lse/delta [B, H, Lq_p, 1] float32.


def _specs(cfg, d, loff, *, over_queries: bool):
  """BlockSpecs of (q, k, v, offset bias, q segments, kv segments, lse/delta) for a grid
  ``(B, H, query blocks)`` or ``(B, H, key blocks)``."""
  q_rows = cfg.block_q if over_queries else cfg.q_len
  k_rows = cfg.k_len if over_queries else cfg.block_k

  def q_block(n):
    return n if over_queries else 0

  def k_block(n):
    return 0 if over_queries else n

  q_spec = pl.BlockSpec((None, None, q_rows, d), lambda b, h, n: (b, h, q_block(n), 0))
  kv_spec = pl.BlockSpec((None, None, k_rows, d), lambda b, h, n: (b, h, k_block(n), 0))
  ob_spec = pl.BlockSpec((None, 1, loff), lambda b, h, n: (h, 0, 0))
  qseg_spec = pl.BlockSpec((None, q_rows, 1), lambda b, h, n: (b, q_block(n), 0))
  kseg_spec = pl.BlockSpec((None, 1, k_rows), lambda b, h, n: (b, 0, k_block(n)))
  row_spec = pl.BlockSpec((None, None, q_rows, 1), lambda b, h, n: (b, h, q_block(n), 0))
  return q_spec, kv_spec, ob_spec, qseg_spec, kseg_spec, row_spec


def _forward(cfg, q, k, v, ob, qseg, kseg):
  b, h, _, d = q.shape
  q_spec, kv_spec, ob_spec, qseg_spec, kseg_spec, row = _specs(cfg, d, ob.shape[-1],
                                                               over_queries=True)
  return pl.pallas_call(
      functools.partial(_fwd_kernel, cfg),
      out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((b, h, cfg.q_len, 1), jnp.float32)),
      grid=(b, h, cfg.q_len // cfg.block_q),
      in_specs=[q_spec, kv_spec, kv_spec, ob_spec, qseg_spec, kseg_spec],
      out_specs=(q_spec, row),
      interpret=cfg.interpret,
      compiler_params=cfg.compiler_params,
      name="relative_flash_fwd",
  )(q, k, v, ob, qseg, kseg)


def _backward(cfg, q, k, v, ob, qseg, kseg, out, lse, do):
  b, h, _, d = q.shape
  loff = ob.shape[-1]
  nq, nk = cfg.q_len // cfg.block_q, cfg.k_len // cfg.block_k
  delta = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32), axis=-1, keepdims=True)
  args = (q, k, v, ob, qseg, kseg, do, lse, delta)

  q_spec, kv_spec, ob_spec, qseg_spec, kseg_spec, row = _specs(cfg, d, loff, over_queries=True)
  in_specs = [q_spec, kv_spec, kv_spec, ob_spec, qseg_spec, kseg_spec, q_spec, row, row]
  out_shapes, out_specs = [jax.ShapeDtypeStruct(q.shape, q.dtype)], [q_spec]
  if cfg.has_bias:  # per query block: the offset-bias gradient (and the gather's scratch)
    out_shapes.append(jax.ShapeDtypeStruct((b, h, nq, 1, loff), jnp.float32))
    out_specs.append(pl.BlockSpec((None, None, None, 1, loff), lambda b, h, i: (b, h, i, 0, 0)))
    if cfg.tiles == "gather":
      tile = (cfg.block_q, cfg.block_k)
      out_shapes.append(jax.ShapeDtypeStruct((b, h, nq) + tile, jnp.float32))
      out_specs.append(pl.BlockSpec((None, None, None) + tile, lambda b, h, i: (b, h, i, 0, 0)))
  dq, *rest = pl.pallas_call(
      functools.partial(_dq_kernel, cfg),
      out_shape=tuple(out_shapes),
      grid=(b, h, nq),
      in_specs=in_specs,
      out_specs=tuple(out_specs),
      interpret=cfg.interpret,
      compiler_params=cfg.compiler_params,
      name="relative_flash_dq",
  )(*args)

  q_spec, kv_spec, ob_spec, qseg_spec, kseg_spec, row = _specs(cfg, d, loff, over_queries=False)
  in_specs = [q_spec, kv_spec, kv_spec, ob_spec, qseg_spec, kseg_spec, q_spec, row, row]
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, cfg),
      out_shape=(jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
      grid=(b, h, nk),
      in_specs=in_specs,
      out_specs=(kv_spec, kv_spec),
      interpret=cfg.interpret,
      compiler_params=cfg.compiler_params,
      name="relative_flash_dkv",
  )(*args)
  dob = jnp.sum(rest[0], axis=(0, 2)).astype(ob.dtype) if cfg.has_bias else jnp.zeros_like(ob)
  return dq, dk, dv, dob


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg, q, k, v, ob, qseg, kseg):
  return _forward(cfg, q, k, v, ob, qseg, kseg)[0]


def _flash_fwd(cfg, q, k, v, ob, qseg, kseg):
  out, lse = _forward(cfg, q, k, v, ob, qseg, kseg)
  return out, (q, k, v, ob, qseg, kseg, out, lse)


def _flash_bwd(cfg, res, do):
  q, k, v, ob, qseg, kseg, out, lse = res
  return _backward(cfg, q, k, v, ob, qseg, kseg, out, lse, do) + (None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


# ---------------------------------------------------------------------------
# Public entry point.


def relative_flash_attention(
    q: Array,
    k: Array,
    v: Array,
    offset_bias: Array | None = None,
    *,
    mask: Array | None = None,
    q_segment_ids: Array | None = None,
    kv_segment_ids: Array | None = None,
    causal: bool = False,
    zero_first: bool = False,
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    tiles: str | None = None,
    interpret: bool | None = None,
) -> Array:
  """Flash attention with a Toeplitz bias ``offset_bias[h, j - i + Lq - 1]`` built in the kernel.

  Args:
    q: ``[B, Lq, H, D]`` queries.
    k: ``[B, Lk, H, D]`` keys.
    v: ``[B, Lk, H, Dv]`` values.
    offset_bias: ``[H|1, Lq + Lk - 1]`` bias of each offset ``rel = j - i``
      (:func:`posenc_jax.terms.offsets`), or None for plain flash attention (no positional
      term).
    mask: ``[B, Lk]`` key mask, True = attend.
    q_segment_ids: ``[B, Lq]`` int segment of each query (packed sequences);
      needs ``kv_segment_ids``.
    kv_segment_ids: ``[B, Lk]`` int segment of each key.
    causal: mask keys ``j > i``.
    zero_first: zero the bias in row 0 and column 0 (TUPE-R's [CLS] reset).
    scale: content scale; None gives ``1 / sqrt(D)``. The bias is not scaled.
    block_q, block_k: tile sizes, powers of two (lengths are padded to block
      multiples internally); None gives 64 (gather) or 128 (roll, which needs
      multiples of 128). Gather tiles are clamped to the padded lengths.
    tiles: how bias tiles are built: ``"gather"`` (GPU/Triton) or ``"roll"``
      (TPU/Mosaic); None picks ``roll`` on TPU, else ``gather``. Both run in
      interpret mode.
    interpret: Pallas interpret mode; None picks it on the CPU backend.

  Returns:
    ``[B, Lq, H, Dv]``, differentiable in q, k, v and ``offset_bias``.
  """
  b, lq, h, d = q.shape
  lk, dv = k.shape[1], v.shape[-1]
  if k.shape != (b, lk, h, d) or v.shape[:3] != (b, lk, h):
    raise ValueError(f"q, k, v: shapes {q.shape}, {k.shape}, {v.shape} do not match "
                     "[B, Lq, H, D], [B, Lk, H, D], [B, Lk, H, Dv]")
  if offset_bias is not None and (offset_bias.ndim != 2 or offset_bias.shape[0] not in (1, h)
                                  or offset_bias.shape[1] != lq + lk - 1):
    raise ValueError(f"offset_bias: got shape {offset_bias.shape}; expected "
                     f"[{h} or 1, Lq + Lk - 1 = {lq + lk - 1}]")
  if tiles is None:
    tiles = "roll" if jax.default_backend() == "tpu" else "gather"
  if tiles not in ("gather", "roll"):
    raise ValueError(f"tiles: got {tiles!r}; allowed: gather, roll")
  smallest = 128 if tiles == "roll" else 16
  block_q = (128 if tiles == "roll" else 64) if block_q is None else block_q
  block_k = (128 if tiles == "roll" else 64) if block_k is None else block_k
  for name, size in (("block_q", block_q), ("block_k", block_k)):
    if size < smallest or size & (size - 1):
      raise ValueError(f"{name}: got {size}; expected a power of two >= {smallest} "
                       f"(tiles={tiles!r})")
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("q_segment_ids, kv_segment_ids: give both or neither")
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  scale = 1.0 / math.sqrt(d) if scale is None else scale

  if tiles == "gather":
    block_q = min(block_q, _next_pow2(max(lq, 16)))
    block_k = min(block_k, _next_pow2(max(lk, 16)))
  lq_p, lk_p = _round_up(lq, block_q), _round_up(lk, block_k)
  d_p = max(16, _next_pow2(max(d, dv)))
  loff = _next_pow2(lq_p + lk_p)
  cfg = _Config(has_bias=offset_bias is not None, tiles=tiles, zero_first=zero_first,
                causal=causal,
                scale=float(scale), block_q=block_q, block_k=block_k, q_len=lq_p, k_len=lk_p,
                interpret=bool(interpret))

  def heads_major(x, length):
    x = jnp.swapaxes(x, 1, 2)  # [B, H, L, D]
    return jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[2]), (0, d_p - x.shape[3])))

  if q_segment_ids is None:
    qseg, kseg = jnp.zeros((b, lq), jnp.int32), jnp.zeros((b, lk), jnp.int32)
  else:
    qseg, kseg = q_segment_ids.astype(jnp.int32), kv_segment_ids.astype(jnp.int32)
    if qseg.shape != (b, lq) or kseg.shape != (b, lk):
      raise ValueError(f"q_segment_ids, kv_segment_ids: got {qseg.shape}, {kseg.shape}; "
                       f"expected {(b, lq)}, {(b, lk)}")
  if mask is not None:
    if mask.shape != (b, lk):
      raise ValueError(f"mask: got shape {mask.shape}; expected a [B, Lk] = {(b, lk)} key mask")
    kseg = jnp.where(mask.astype(bool), kseg, _K_PAD)
  qseg = jnp.pad(qseg, ((0, 0), (0, lq_p - lq)), constant_values=_Q_PAD)[:, :, None]
  kseg = jnp.pad(kseg, ((0, 0), (0, lk_p - lk)), constant_values=_K_PAD)[:, None, :]
  if offset_bias is None:
    ob = jnp.zeros((1, loff), jnp.float32)
  else:
    # Offset o = rel + Lq - 1 moves to rel + Lq_p - 1; the padding is masked.
    ob = jnp.pad(jnp.broadcast_to(offset_bias, (h, lq + lk - 1)),
                 ((0, 0), (lq_p - lq, loff - (lq_p - lq) - (lq + lk - 1))))
  ob = jnp.broadcast_to(ob, (h, loff))[:, None, :]  # [H, 1, Loff_p]
  out = _flash(cfg, heads_major(q, lq_p), heads_major(k, lk_p), heads_major(v, lk_p), ob, qseg,
               kseg)
  return jnp.swapaxes(out[:, :, :lq, :dv], 1, 2)
