"""Flash attention that builds Toeplitz (relative) biases inside the kernel.

A relative-position bias depends on the query/key positions only through the
offset ``rel = j - i`` (key minus query position, as
:func:`posenc_jax.terms.relative_offsets`). For ``Lq`` queries and ``Lk`` keys
there are ``Lq + Lk - 1`` offsets, so the whole bias of a head is one vector

    offset_bias[h, o],   o = rel + Lq - 1 in [0, Lq + Lk - 1)

(:func:`offsets` lists the ``rel`` of each ``o``). A scheme turns its small
table into that vector outside the kernel (DIET-REL: a clipped gather, T5: a
bucket gather, ALiBi: slope times distance; see
:meth:`posenc_jax.terms.Toeplitz.offset_values`), which costs ``O(H L)``, and
:func:`relative_flash_attention` computes

    out[b, i, h] = sum_j softmax_j(scale * q_i . k_j + offset_bias[h, j - i + Lq - 1]) v_j

with an online (flash) softmax blocked over queries and keys. Each
``[block_q, block_k]`` bias tile is gathered inside the kernel from the
vector, so no ``[B, H, L, L]`` or ``[H, L, L]`` array is ever materialised,
in the forward or the backward pass. The backward pass returns the vector's
gradient: each logit-cotangent tile is summed along its diagonals (a skewed
gather over the tile, ``O(block_q (block_q + block_k))`` per tile) into the
offsets it covers; JAX then carries that gradient back through the scheme's
gather to its table.

Masking: ``q_segment_ids [B, Lq]`` and ``kv_segment_ids [B, Lk]`` (packed
sequences: a query sees only keys of its own segment), a ``mask [B, Lk]`` of
keys (True = attend), and ``causal`` (``j > i`` masked, top-left aligned as
:func:`posenc_jax.attention.attend`). ``zero_first`` zeroes the bias in row 0
and column 0 (TUPE-R's [CLS] reset). A query row whose keys are *all* masked
returns zeros (the materialised reference averages every value uniformly
there instead).

Lowering: GPU through Pallas' Triton backend (every in-kernel array has a
power-of-two size: block sizes are powers of two, the head dim and the offset
vector are zero-padded to powers of two); CPU in interpret mode
(``interpret=None`` picks it on the CPU backend). TPU (Mosaic) is not
supported: Mosaic has no in-kernel gather, so on TPU
:func:`posenc_jax.attend` materialises the bias instead.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

Array = jax.Array

_NEG = -1e30  # finite "minus infinity" for masked logits (avoids inf - inf)
_Q_PAD, _K_PAD = -2, -1  # segment ids of padded query rows / masked keys: never equal


def offsets(q_len: int, k_len: int) -> Array:
  """``[Lq + Lk - 1]`` int32 offsets ``rel = j - i``, from ``-(Lq - 1)`` to ``Lk - 1``."""
  return jnp.arange(-(q_len - 1), k_len, dtype=jnp.int32)


def _next_pow2(x: int) -> int:
  return 1 << max(0, (x - 1).bit_length())


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


@dataclasses.dataclass(frozen=True)
class _Config:
  """Static kernel settings; lengths are the padded ones unless named otherwise."""

  has_bias: bool
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
    return None if self.interpret else plt.CompilerParams(num_warps=4, num_stages=2)


def _barrier(cfg: _Config) -> None:
  """Synchronises the threads of a Triton program (no-op in interpret mode)."""
  if not cfg.interpret:
    plt.debug_barrier()


def _tile(cfg, q, k, ob_ref, qseg, kseg, qi, kj):
  """Scaled logits + bias ``[bq, bk]`` (float32, masked to ``_NEG``) and the validity mask."""
  bq, bk = cfg.block_q, cfg.block_k
  s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  s = s * cfg.scale
  i = qi * bq + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
  j = kj * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
  if cfg.has_bias:
    bias = ob_ref[j - i + (cfg.q_len - 1)].astype(jnp.float32)
    if cfg.zero_first:
      bias = jnp.where((i == 0) | (j == 0), 0.0, bias)
    s = s + bias
  valid = qseg[:, None] == kseg[None, :]
  if cfg.causal:
    valid = valid & (j <= i)
  return jnp.where(valid, s, _NEG), valid


def _num_k_blocks(cfg, qi):
  """k-blocks a query block needs (causal: up to the diagonal)."""
  nk = cfg.k_len // cfg.block_k
  if not cfg.causal:
    return nk
  return jnp.minimum(nk, ((qi + 1) * cfg.block_q + cfg.block_k - 1) // cfg.block_k)


# ---------------------------------------------------------------------------
# Kernels. Refs are one (batch, head) slice: q/do [bq or Lq_p, Dp], k/v
# [Lk_p or bk, Dp], offset bias [Loff_p], segment ids and lse/delta rows 1-D.


def _fwd_kernel(cfg, q_ref, k_ref, v_ref, ob_ref, qseg_ref, kseg_ref, o_ref, lse_ref):
  qi = pl.program_id(2)
  bq, bk = cfg.block_q, cfg.block_k
  q, qseg = q_ref[...], qseg_ref[...]

  def body(kj, carry):
    m, l, acc = carry
    k = k_ref[pl.ds(kj * bk, bk), :]
    v = v_ref[pl.ds(kj * bk, bk), :]
    s, valid = _tile(cfg, q, k, ob_ref, qseg, kseg_ref[pl.ds(kj * bk, bk)], qi, kj)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.where(valid, jnp.exp(s - m_new[:, None]), 0.0)
    alpha = jnp.exp(m - m_new)
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                         preferred_element_type=jnp.float32)
    return m_new, alpha * l + jnp.sum(p, axis=1), alpha[:, None] * acc + pv

  init = (jnp.full((bq,), _NEG, jnp.float32), jnp.zeros((bq,), jnp.float32),
          jnp.zeros(o_ref.shape, jnp.float32))
  m, l, acc = lax.fori_loop(0, _num_k_blocks(cfg, qi), body, init)
  empty = l == 0.0
  l_safe = jnp.where(empty, 1.0, l)
  o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
  # Empty rows get lse = +big so that exp(s - lse) = 0 in the backward.
  lse_ref[...] = jnp.where(empty, -_NEG, m + jnp.log(l_safe))


def _dq_kernel(cfg, q_ref, k_ref, v_ref, ob_ref, qseg_ref, kseg_ref, do_ref, lse_ref, delta_ref,
               dq_ref, dob_ref, ds_ref):
  """``dq`` of one query block and, with a bias, its part of the offset-bias gradient.

  ``dob_ref`` ``[Loff_p]`` accumulates the diagonal sums of every logit
  cotangent tile of this query block; ``ds_ref`` ``[bq, bk]`` is the tile's
  scratch copy, read back skewed so that each column is one diagonal.
  """
  qi = pl.program_id(2)
  bq, bk = cfg.block_q, cfg.block_k
  q, do, qseg = q_ref[...], do_ref[...], qseg_ref[...]
  lse, delta = lse_ref[...], delta_ref[...]
  if cfg.has_bias:
    dob_ref[...] = jnp.zeros(dob_ref.shape, jnp.float32)
    row = lax.broadcasted_iota(jnp.int32, (bq, bq + bk), 0)
    col = row + lax.broadcasted_iota(jnp.int32, (bq, bq + bk), 1) - (bq - 1)
    on_tile = (col >= 0) & (col < bk)
    col = jnp.clip(col, 0, bk - 1)

  def body(kj, dq):
    k = k_ref[pl.ds(kj * bk, bk), :]
    v = v_ref[pl.ds(kj * bk, bk), :]
    s, valid = _tile(cfg, q, k, ob_ref, qseg, kseg_ref[pl.ds(kj * bk, bk)], qi, kj)
    p = jnp.where(valid, jnp.exp(s - lse[:, None]), 0.0)
    dp = lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    ds = p * (dp - delta[:, None])
    if cfg.has_bias:
      dbias = ds
      if cfg.zero_first:
        i = qi * bq + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
        j = kj * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
        dbias = jnp.where((i == 0) | (j == 0), 0.0, dbias)
      ds_ref[...] = dbias
      _barrier(cfg)
      diagonals = jnp.sum(jnp.where(on_tile, ds_ref[row, col], 0.0), axis=0)  # [bq + bk]
      _barrier(cfg)
      # Column w of the skewed tile holds rel = kj*bk - qi*bq + w - (bq - 1).
      start = kj * bk - qi * bq + cfg.q_len - bq
      dob_ref[pl.ds(start, bq + bk)] += diagonals
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
    s, valid = _tile(cfg, q, k, ob_ref, qseg_ref[rows], kseg, qi, kj)
    p = jnp.where(valid, jnp.exp(s - lse_ref[rows][:, None]), 0.0)
    dv = dv + lax.dot_general(p.astype(do.dtype), do, (((0,), (0,)), ((), ())),
                              preferred_element_type=jnp.float32)
    dp = lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    ds = p * (dp - delta_ref[rows][:, None])
    dk = dk + lax.dot_general(ds.astype(q.dtype), q, (((0,), (0,)), ((), ())),
                              preferred_element_type=jnp.float32)
    return dk, dv

  start = (kj * bk) // bq if cfg.causal else 0
  init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
  dk, dv = lax.fori_loop(start, cfg.q_len // bq, body, init)
  dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


# ---------------------------------------------------------------------------
# pallas_call wrappers on padded, head-major arrays: q/do [B, H, Lq_p, Dp],
# k/v [B, H, Lk_p, Dp], offset bias [H, Loff_p], segment ids [B, L_p] int32,
# lse/delta [B, H, Lq_p] float32.


def _specs(cfg, d, loff, *, over_queries: bool):
  """BlockSpecs of (q, k, v, offset bias, q segments, kv segments, q rows) for a grid
  ``(B, H, query blocks)`` or ``(B, H, key blocks)``."""
  bq, bk, lq, lk = cfg.block_q, cfg.block_k, cfg.q_len, cfg.k_len
  q_rows = bq if over_queries else lq
  k_rows = lk if over_queries else bk

  def q_map(b, h, n):
    return (b, h, n if over_queries else 0, 0)

  def k_map(b, h, n):
    return (b, h, 0 if over_queries else n, 0)

  q_spec = pl.BlockSpec((None, None, q_rows, d), q_map)
  kv_spec = pl.BlockSpec((None, None, k_rows, d), k_map)
  ob_spec = pl.BlockSpec((None, loff), lambda b, h, n: (h, 0))
  qseg_spec = pl.BlockSpec((None, q_rows), lambda b, h, n: (b, q_map(b, h, n)[2]))
  kseg_spec = pl.BlockSpec((None, k_rows), lambda b, h, n: (b, k_map(b, h, n)[2]))
  row_spec = pl.BlockSpec((None, None, q_rows), lambda b, h, n: (b, h, q_map(b, h, n)[2]))
  return q_spec, kv_spec, ob_spec, qseg_spec, kseg_spec, row_spec


def _forward(cfg, q, k, v, ob, qseg, kseg):
  b, h, _, d = q.shape
  q_spec, kv_spec, ob_spec, qseg_spec, kseg_spec, row = _specs(cfg, d, ob.shape[-1],
                                                               over_queries=True)
  return pl.pallas_call(
      functools.partial(_fwd_kernel, cfg),
      out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((b, h, cfg.q_len), jnp.float32)),
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
  delta = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
  args = (q, k, v, ob, qseg, kseg, do, lse, delta)

  q_spec, kv_spec, ob_spec, qseg_spec, kseg_spec, row = _specs(cfg, d, loff, over_queries=True)
  in_specs = [q_spec, kv_spec, kv_spec, ob_spec, qseg_spec, kseg_spec, q_spec, row, row]
  dq, dob, _ = pl.pallas_call(
      functools.partial(_dq_kernel, cfg),
      out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((b, h, nq, loff), jnp.float32),
                 jax.ShapeDtypeStruct((b, h, nq, cfg.block_q, cfg.block_k), jnp.float32)),
      grid=(b, h, nq),
      in_specs=in_specs,
      out_specs=(q_spec, pl.BlockSpec((None, None, None, loff), lambda b, h, i: (b, h, i, 0)),
                 pl.BlockSpec((None, None, None, cfg.block_q, cfg.block_k),
                              lambda b, h, i: (b, h, i, 0, 0))),
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
  dob = jnp.sum(dob, axis=(0, 2)).astype(ob.dtype) if cfg.has_bias else jnp.zeros_like(ob)
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
    block_q: int = 64,
    block_k: int = 64,
    interpret: bool | None = None,
) -> Array:
  """Flash attention with a Toeplitz bias ``offset_bias[h, j - i + Lq - 1]`` built in the kernel.

  Args:
    q: ``[B, Lq, H, D]`` queries.
    k: ``[B, Lk, H, D]`` keys.
    v: ``[B, Lk, H, Dv]`` values.
    offset_bias: ``[H|1, Lq + Lk - 1]`` bias of each offset ``rel = j - i``
      (:func:`offsets`), or None for plain flash attention (no positional
      term).
    mask: ``[B, Lk]`` key mask, True = attend.
    q_segment_ids: ``[B, Lq]`` int segment of each query (packed sequences);
      needs ``kv_segment_ids``.
    kv_segment_ids: ``[B, Lk]`` int segment of each key.
    causal: mask keys ``j > i``.
    zero_first: zero the bias in row 0 and column 0 (TUPE-R's [CLS] reset).
    scale: content scale; None gives ``1 / sqrt(D)``. The bias is not scaled.
    block_q, block_k: tile sizes, powers of two (clamped to the padded
      lengths; lengths are padded to block multiples internally).
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
  for name, size in (("block_q", block_q), ("block_k", block_k)):
    if size < 16 or size & (size - 1):
      raise ValueError(f"{name}: got {size}; expected a power of two >= 16")
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("q_segment_ids, kv_segment_ids: give both or neither")
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  scale = 1.0 / math.sqrt(d) if scale is None else scale

  block_q = min(block_q, _next_pow2(max(lq, 16)))
  block_k = min(block_k, _next_pow2(max(lk, 16)))
  lq_p, lk_p = _round_up(lq, block_q), _round_up(lk, block_k)
  d_p = max(16, _next_pow2(max(d, dv)))
  loff = _next_pow2(lq_p + lk_p)
  cfg = _Config(has_bias=offset_bias is not None, zero_first=zero_first, causal=causal,
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
  qseg = jnp.pad(qseg, ((0, 0), (0, lq_p - lq)), constant_values=_Q_PAD)
  kseg = jnp.pad(kseg, ((0, 0), (0, lk_p - lk)), constant_values=_K_PAD)
  if offset_bias is None:
    ob = jnp.zeros((1, loff), jnp.float32)
  else:
    # Offset o = rel + Lq - 1 moves to rel + Lq_p - 1; the padding is masked.
    ob = jnp.pad(jnp.broadcast_to(offset_bias, (h, lq + lk - 1)),
                 ((0, 0), (lq_p - lq, loff - (lq_p - lq) - (lq + lk - 1))))
  ob = jnp.broadcast_to(ob, (h, loff))
  out = _flash(cfg, heads_major(q, lq_p), heads_major(k, lk_p), heads_major(v, lk_p), ob, qseg,
               kseg)
  return jnp.swapaxes(out[:, :, :lq, :dv], 1, 2)
