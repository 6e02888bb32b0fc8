"""Flash attention that builds Toeplitz relative biases inside the kernel.

A relative-position bias depends on the query/key positions only through the
offset ``rel = j - i`` (key minus query position, as
:func:`posenc_jax.terms.relative_offsets`) and on a small per-head table
``table[h, r]``. :func:`relative_flash_attention` computes

    out[b, i, h] = sum_j softmax_j(scale * q_i . k_j + bias_h(j - i)) v_j

with an online (flash) softmax blocked over queries and keys. Each
``[block_q, block_k]`` bias tile is rebuilt inside the kernel from the iota of
``i`` and ``j`` and the ``[H, R]`` table, so neither ``[B, H, L, L]`` nor
``[H, L, L]`` is ever materialised, in the forward or the backward pass.

Two modes:

* ``mode="gather"`` (default): ``bias_h(rel) = table[h, index_fn(rel)]`` with
  an int32 ``index_fn`` in ``[0, R)``. The gather is a one-hot contraction
  ``[bq, bk, R] x [R]``, and ``d table`` is the matching one-hot reduction of
  the logit cotangents (``[bq, bk] x [bq, bk, R] -> [R]``).
* ``mode="linear"``: ``bias_h(rel) = table[h, 0] * coef_fn(rel)`` with a float
  ``coef_fn``; ``table`` is ``[H]`` or ``[H, 1]``.

How the schemes of :mod:`posenc_jax.schemes` map on it (index functions are
provided here):

* DIET-REL (clip ``t``): ``table`` = the layer's ``relative_bias``
  ``[H, 2t + 1]``, ``bias_index_fn=diet_rel_index(t)``, i.e.
  ``clip(i - j, -t, t) + t`` (``T[h,i,j] = R_h[clip(i - j, -t, t)]``).
* T5 (``n`` buckets, ``max_distance``): ``table`` = the layer's
  ``relative_bias`` ``[H, n]``, ``bias_index_fn=t5_index(n, max_distance,
  bidirectional)``, i.e. :func:`~posenc_jax.schemes.t5.relative_position_bucket`
  of ``j - i``.
* ALiBi: ``table`` = :func:`~posenc_jax.schemes.alibi.alibi_slopes` ``[H]``,
  ``mode="linear"``, ``bias_index_fn=alibi_coef(causal)`` (the default in
  linear mode): ``-m_h |i - j|``, causal form ``-m_h max(i - j, 0)``.

A table with a leading head axis of 1 (head sharing) is broadcast; its
gradient is summed over heads by JAX.

Masking: ``mask`` is a ``[B, Lk]`` padding mask (True = attend); ``causal``
masks ``j > i`` (top-left aligned, as :func:`posenc_jax.attention._reference`).
Sequences of any length are padded internally to block multiples and the
padding is masked. A query row whose keys are *all* masked returns zeros
(the materialised reference instead averages every value uniformly).

Backward: ``jax.custom_vjp``; the forward stores the per-row logsumexp and the
backward recomputes the probabilities blockwise (one kernel for ``dq`` and the
per-query-block ``d table`` partials, one for ``dk``/``dv``).

Pallas on CPU runs only in interpret mode; ``interpret=None`` picks it when the
default backend is CPU. Status: correct (tested in interpret mode against the
materialised reference), not yet tuned or lowered for GPU (Triton) or TPU
(Mosaic): the one-hot gather costs ``bq * bk * R`` work per tile, and the
index functions use integer/float ops that Mosaic may not lower as is.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from posenc_jax.schemes.t5 import relative_position_bucket

Array = jax.Array

_NEG = -1e30  # finite "minus infinity" for masked logits (avoids inf - inf)


# ---------------------------------------------------------------------------
# Index / coefficient functions of ``rel = j - i`` (int32 arrays of any shape).


def diet_rel_index(clip: int) -> Callable[[Array], Array]:
  """DIET-REL: ``clip(i - j, -t, t) + t`` in ``[0, 2t + 1)``."""

  def index(rel):
    return jnp.clip(-rel, -clip, clip) + clip

  return index


def t5_index(num_buckets: int = 32, max_distance: int = 128,
             bidirectional: bool = True) -> Callable[[Array], Array]:
  """T5: :func:`posenc_jax.schemes.t5.relative_position_bucket` of ``j - i``."""

  def index(rel):
    return relative_position_bucket(rel, bidirectional=bidirectional, num_buckets=num_buckets,
                                    max_distance=max_distance)

  return index


def alibi_coef(causal: bool = False) -> Callable[[Array], Array]:
  """ALiBi (mode ``linear``, table = slopes): ``-|i - j|`` (causal: ``-max(i - j, 0)``)."""

  def coef(rel):
    dist = jnp.maximum(-rel, 0) if causal else jnp.abs(rel)
    return -dist.astype(jnp.float32)

  return coef


# ---------------------------------------------------------------------------
# Static configuration.


@dataclasses.dataclass(frozen=True)
class _Config:
  bias_fn: Callable[[Array], Array]
  mode: str
  num_entries: int  # R
  causal: bool
  scale: float
  block_q: int
  block_k: int
  q_len: int  # unpadded lengths
  k_len: int
  interpret: bool


def _bias_tile(cfg: _Config, table_row: Array, rel: Array) -> Array:
  """``[bq, bk]`` float32 bias from ``rel`` ``[bq, bk]`` and ``table_row`` ``[R]``."""
  if cfg.mode == "linear":
    return table_row[0] * cfg.bias_fn(rel).astype(jnp.float32)
  onehot = _onehot(cfg, rel)
  return jnp.sum(onehot * table_row[None, None, :], axis=-1)


def _onehot(cfg: _Config, rel: Array) -> Array:
  idx = cfg.bias_fn(rel).astype(jnp.int32)
  entries = lax.broadcasted_iota(jnp.int32, rel.shape + (cfg.num_entries,), 2)
  return (idx[:, :, None] == entries).astype(jnp.float32)


def _table_grad_tile(cfg: _Config, ds: Array, rel: Array) -> Array:
  """``[R]`` contribution of the logit cotangents ``ds`` ``[bq, bk]``."""
  if cfg.mode == "linear":
    return jnp.sum(ds * cfg.bias_fn(rel).astype(jnp.float32)).reshape(1)
  return jnp.sum(_onehot(cfg, rel) * ds[:, :, None], axis=(0, 1))


def _tile_logits_and_valid(cfg, q, k, table_row, kvalid, qi, kj):
  """Scaled logits + bias ``[bq, bk]`` (float32) and the validity mask."""
  bq, bk = cfg.block_q, cfg.block_k
  s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  s = s * cfg.scale
  i = qi * bq + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
  j = kj * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
  s = s + _bias_tile(cfg, table_row, j - i)
  valid = (j < cfg.k_len) & (kvalid[None, :] > 0)
  if cfg.causal:
    valid = valid & (j <= i)
  return jnp.where(valid, s, _NEG), valid, j - i


def _num_k_blocks(cfg, qi, nk):
  """k-blocks a query block needs (causal: up to the diagonal)."""
  if not cfg.causal:
    return nk
  return jnp.minimum(nk, ((qi + 1) * cfg.block_q + cfg.block_k - 1) // cfg.block_k)


# ---------------------------------------------------------------------------
# Forward kernel.


def _fwd_kernel(cfg, nk, q_ref, k_ref, v_ref, table_ref, kvalid_ref, o_ref, lse_ref):
  qi = pl.program_id(2)
  bq, bk = cfg.block_q, cfg.block_k
  q = q_ref[...]
  table_row = table_ref[0, :].astype(jnp.float32)
  d = v_ref.shape[-1]

  def body(kj, carry):
    m, l, acc = carry
    k = k_ref[pl.ds(kj * bk, bk), :]
    v = v_ref[pl.ds(kj * bk, bk), :]
    kvalid = kvalid_ref[0, pl.ds(kj * bk, bk)]
    s, valid, _ = _tile_logits_and_valid(cfg, q, k, table_row, kvalid, qi, kj)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.where(valid, jnp.exp(s - m_new[:, None]), 0.0)
    alpha = jnp.exp(m - m_new)
    l_new = alpha * l + jnp.sum(p, axis=1)
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                         preferred_element_type=jnp.float32)
    return m_new, l_new, alpha[:, None] * acc + pv

  init = (jnp.full((bq,), _NEG, jnp.float32), jnp.zeros((bq,), jnp.float32),
          jnp.zeros((bq, d), jnp.float32))
  m, l, acc = lax.fori_loop(0, _num_k_blocks(cfg, qi, nk), body, init)
  empty = l == 0.0
  l_safe = jnp.where(empty, 1.0, l)
  o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
  # Empty rows get lse = +big so that exp(s - lse) = 0 in the backward.
  lse_ref[0, :] = jnp.where(empty, -_NEG, m + jnp.log(l_safe))


# ---------------------------------------------------------------------------
# Backward kernels.


def _dq_kernel(cfg, nk, q_ref, k_ref, v_ref, table_ref, kvalid_ref, do_ref, lse_ref,
               delta_ref, dq_ref, dtable_ref):
  qi = pl.program_id(2)
  bk = cfg.block_k
  q = q_ref[...]
  do = do_ref[...]
  lse = lse_ref[0, :]
  delta = delta_ref[0, :]
  table_row = table_ref[0, :].astype(jnp.float32)

  def body(kj, carry):
    dq, dtab = carry
    k = k_ref[pl.ds(kj * bk, bk), :]
    v = v_ref[pl.ds(kj * bk, bk), :]
    kvalid = kvalid_ref[0, pl.ds(kj * bk, bk)]
    s, valid, rel = _tile_logits_and_valid(cfg, q, k, table_row, kvalid, qi, kj)
    p = jnp.where(valid, jnp.exp(s - lse[:, None]), 0.0)
    dp = lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    ds = p * (dp - delta[:, None])
    dq = dq + lax.dot_general(ds.astype(k.dtype), k, (((1,), (0,)), ((), ())),
                              preferred_element_type=jnp.float32)
    return dq, dtab + _table_grad_tile(cfg, ds, rel)

  init = (jnp.zeros(q.shape, jnp.float32), jnp.zeros(dtable_ref.shape[-1:], jnp.float32))
  dq, dtab = lax.fori_loop(0, _num_k_blocks(cfg, qi, nk), body, init)
  dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)
  dtable_ref[0, :] = dtab


def _dkv_kernel(cfg, nq, q_ref, k_ref, v_ref, table_ref, kvalid_ref, do_ref, lse_ref,
                delta_ref, dk_ref, dv_ref):
  kj = pl.program_id(2)
  bq, bk = cfg.block_q, cfg.block_k
  k = k_ref[...]
  v = v_ref[...]
  kvalid = kvalid_ref[0, :]
  table_row = table_ref[0, :].astype(jnp.float32)

  def body(qi, carry):
    dk, dv = carry
    q = q_ref[pl.ds(qi * bq, bq), :]
    do = do_ref[pl.ds(qi * bq, bq), :]
    lse = lse_ref[0, pl.ds(qi * bq, bq)]
    delta = delta_ref[0, pl.ds(qi * bq, bq)]
    s, valid, _ = _tile_logits_and_valid(cfg, q, k, table_row, kvalid, qi, kj)
    p = jnp.where(valid, jnp.exp(s - lse[:, None]), 0.0)
    dv = dv + lax.dot_general(p.astype(do.dtype), do, (((0,), (0,)), ((), ())),
                              preferred_element_type=jnp.float32)
    dp = lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    ds = p * (dp - delta[:, None])
    dk = dk + lax.dot_general(ds.astype(q.dtype), q, (((0,), (0,)), ((), ())),
                              preferred_element_type=jnp.float32)
    return dk, dv

  start = (kj * bk) // bq if cfg.causal else 0
  init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
  dk, dv = lax.fori_loop(start, nq, body, init)
  dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


# ---------------------------------------------------------------------------
# pallas_call wrappers on padded, head-major arrays: q [B, H, Lq_p, D],
# k/v [B, H, Lk_p, D], table [H, R], kvalid [B, Lk_p] int32.


def _specs(cfg, lq_p, lk_p, d, r, *, rows_blocked: bool):
  """BlockSpecs for (q, k, v, table, kvalid): one block of q (or of k/v)."""
  bq, bk = cfg.block_q, cfg.block_k
  if rows_blocked:  # grid over q-blocks
    q_spec = pl.BlockSpec((None, None, bq, d), lambda b, h, i: (b, h, i, 0))
    kv_spec = pl.BlockSpec((None, None, lk_p, d), lambda b, h, i: (b, h, 0, 0))
    kvalid_spec = pl.BlockSpec((1, lk_p), lambda b, h, i: (b, 0))
  else:  # grid over k-blocks
    q_spec = pl.BlockSpec((None, None, lq_p, d), lambda b, h, j: (b, h, 0, 0))
    kv_spec = pl.BlockSpec((None, None, bk, d), lambda b, h, j: (b, h, j, 0))
    kvalid_spec = pl.BlockSpec((1, bk), lambda b, h, j: (b, j))
  table_spec = pl.BlockSpec((1, r), lambda b, h, i: (h, 0))
  return q_spec, kv_spec, table_spec, kvalid_spec


def _row_spec(size, blocked):
  """Spec of a per-query-row ``[B, H, 1, Lq_p]`` float array (lse, delta)."""
  if blocked:
    return pl.BlockSpec((None, None, 1, size), lambda b, h, i: (b, h, 0, i))
  return pl.BlockSpec((None, None, 1, size), lambda b, h, j: (b, h, 0, 0))


def _forward(cfg, q, k, v, table, kvalid):
  b, h, lq_p, d = q.shape
  lk_p, r = k.shape[2], table.shape[1]
  nq, nk = lq_p // cfg.block_q, lk_p // cfg.block_k
  q_spec, kv_spec, table_spec, kvalid_spec = _specs(cfg, lq_p, lk_p, d, r, rows_blocked=True)
  out, lse = pl.pallas_call(
      functools.partial(_fwd_kernel, cfg, nk),
      out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((b, h, 1, lq_p), jnp.float32)),
      grid=(b, h, nq),
      in_specs=[q_spec, kv_spec, kv_spec, table_spec, kvalid_spec],
      out_specs=(q_spec, _row_spec(cfg.block_q, True)),
      interpret=cfg.interpret,
      name="relative_flash_fwd",
  )(q, k, v, table, kvalid)
  return out, lse


def _backward(cfg, q, k, v, table, kvalid, out, lse, do):
  b, h, lq_p, d = q.shape
  lk_p, r = k.shape[2], table.shape[1]
  nq, nk = lq_p // cfg.block_q, lk_p // cfg.block_k
  delta = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)[:, :, None, :]

  q_spec, kv_spec, table_spec, kvalid_spec = _specs(cfg, lq_p, lk_p, d, r, rows_blocked=True)
  row = _row_spec(cfg.block_q, True)
  dq, dtable = pl.pallas_call(
      functools.partial(_dq_kernel, cfg, nk),
      out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((b, h, nq, r), jnp.float32)),
      grid=(b, h, nq),
      in_specs=[q_spec, kv_spec, kv_spec, table_spec, kvalid_spec, q_spec, row, row],
      out_specs=(q_spec, pl.BlockSpec((None, None, 1, r), lambda b, h, i: (b, h, i, 0))),
      interpret=cfg.interpret,
      name="relative_flash_dq",
  )(q, k, v, table, kvalid, do, lse, delta)

  q_spec, kv_spec, table_spec, kvalid_spec = _specs(cfg, lq_p, lk_p, d, r, rows_blocked=False)
  row = _row_spec(lq_p, False)
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, cfg, nq),
      out_shape=(jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
      grid=(b, h, nk),
      in_specs=[q_spec, kv_spec, kv_spec, table_spec, kvalid_spec, q_spec, row, row],
      out_specs=(kv_spec, kv_spec),
      interpret=cfg.interpret,
      name="relative_flash_dkv",
  )(q, k, v, table, kvalid, do, lse, delta)
  dtable = jnp.sum(dtable, axis=(0, 2)).astype(table.dtype)
  return dq, dk, dv, dtable


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg, q, k, v, table, kvalid):
  return _forward(cfg, q, k, v, table, kvalid)[0]


def _flash_fwd(cfg, q, k, v, table, kvalid):
  out, lse = _forward(cfg, q, k, v, table, kvalid)
  return out, (q, k, v, table, kvalid, out, lse)


def _flash_bwd(cfg, res, do):
  q, k, v, table, kvalid, out, lse = res
  dq, dk, dv, dtable = _backward(cfg, q, k, v, table, kvalid, out, lse, do)
  return dq, dk, dv, dtable, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ---------------------------------------------------------------------------
# Public entry point.


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def relative_flash_attention(
    q: Array,
    k: Array,
    v: Array,
    table: Array,
    *,
    bias_index_fn: Callable[[Array], Array] | None = None,
    mode: Literal["gather", "linear"] = "gather",
    mask: Array | None = None,
    causal: bool = False,
    scale: float | None = None,
    block_q: int = 128,
    block_k: int = 128,
    interpret: bool | None = None,
) -> Array:
  """Flash attention with a relative bias ``bias_h(j - i)`` built in the kernel.

  Args:
    q: ``[B, Lq, H, D]`` queries.
    k: ``[B, Lk, H, D]`` keys.
    v: ``[B, Lk, H, D]`` values.
    table: ``[H|1, R]`` per-head bias table (``mode="gather"``), or ``[H|1]`` /
      ``[H|1, 1]`` per-head coefficients (``mode="linear"``, e.g. ALiBi slopes).
    bias_index_fn: function of the int32 offsets ``rel = j - i`` (any shape):
      int32 indices in ``[0, R)`` (gather) or float coefficients (linear);
      see :func:`diet_rel_index`, :func:`t5_index`, :func:`alibi_coef`.
      None: ``alibi_coef(causal)`` in linear mode; required in gather mode.
    mode: ``"gather"`` (``table[h, fn(rel)]``) or ``"linear"``
      (``table[h] * fn(rel)``).
    mask: ``[B, Lk]`` padding mask, True = attend.
    causal: mask keys ``j > i``.
    scale: content scale; None gives ``1 / sqrt(D)``. The bias is not scaled.
    block_q, block_k: tile sizes (clamped to the padded lengths; lengths are
      padded to multiples internally).
    interpret: Pallas interpret mode; None picks it on the CPU backend.

  Returns:
    ``[B, Lq, H, D]``, differentiable in q, k, v and table.
  """
  if mode not in ("gather", "linear"):
    raise ValueError(f"mode must be 'gather' or 'linear', got {mode!r}")
  if bias_index_fn is None:
    if mode == "gather":
      raise ValueError("mode='gather' needs a bias_index_fn (e.g. diet_rel_index(clip))")
    bias_index_fn = alibi_coef(causal)
  b, lq, h, d = q.shape
  lk = k.shape[1]
  if k.shape != (b, lk, h, d) or v.shape[:3] != (b, lk, h) or v.shape[3] != d:
    raise ValueError(f"shape mismatch: q {q.shape}, k {k.shape}, v {v.shape}")
  if mode == "linear" and table.ndim == 1:
    table = table[:, None]
  if table.ndim != 2 or table.shape[0] not in (1, h):
    raise ValueError(f"table must be [H|1, R] with H={h}, got {table.shape}")
  if mode == "linear" and table.shape[1] != 1:
    raise ValueError(f"mode='linear' needs one coefficient per head, got {table.shape}")
  table = jnp.broadcast_to(table, (h, table.shape[1]))
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  if scale is None:
    scale = 1.0 / math.sqrt(d)

  block_q = min(block_q, _round_up(lq, 8))
  block_k = min(block_k, _round_up(lk, 8))
  lq_p, lk_p = _round_up(lq, block_q), _round_up(lk, block_k)
  cfg = _Config(bias_fn=bias_index_fn, mode=mode, num_entries=table.shape[1], causal=causal,
                scale=float(scale), block_q=block_q, block_k=block_k, q_len=lq, k_len=lk,
                interpret=bool(interpret))

  def to_heads(x, length):
    x = jnp.swapaxes(x, 1, 2)  # [B, H, L, D]
    return jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[2]), (0, 0)))

  kvalid = jnp.ones((b, lk), jnp.int32) if mask is None else mask.astype(jnp.int32)
  if kvalid.shape != (b, lk):
    raise ValueError(f"mask must be a [B, Lk] = {(b, lk)} padding mask, got {kvalid.shape}")
  kvalid = jnp.pad(kvalid, ((0, 0), (0, lk_p - lk)))
  out = _flash(cfg, to_heads(q, lq_p), to_heads(k, lk_p), to_heads(v, lk_p), table, kvalid)
  return jnp.swapaxes(out[:, :, :lq], 1, 2)
