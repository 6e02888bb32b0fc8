"""The tile math and Pallas kernels of
:func:`~posenc_jax.kernels.relative_flash.relative_flash_attention`, whose module docstring
describes the method (the online softmax, the ``gather``, ``band`` and ``roll`` tiles, the
separable term, dropout).

Each kernel runs on one (batch, head) slice of the padded, head-major arrays (shapes below):
:func:`fwd_kernel`, a query block's output and lse; :func:`dq_kernel`, a query block's dq, with
its row vector's gradient and (gather and roll tiles) its part of the offset vector's;
:func:`dkv_kernel`, a key block's dk and dv, with its column vector's gradient;
:func:`dbias_kernel`, band tiles' bias gradient per diagonal of the tile grid. ``cfg`` is
relative_flash's static ``_Config``; the ``pallas_call`` wrappers and the custom VJP are there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plt

from posenc_jax.kernels.common import NEG
from posenc_jax.kernels.dropout import dropout_multiplier
from posenc_jax.kernels.precision import dot_precision


def _dot(cfg, a, b, contract):
  """``a`` . ``b`` contracting dim ``contract[0]`` of ``a`` with ``contract[1]`` of ``b``
  (2-D operands), accumulated in float32. Float32 operands are multiplied exactly (IEEE)
  unless ``cfg.precision`` is ``"tensorfloat32"`` (the backend's default: TF32 on Triton)."""
  return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                         precision=dot_precision(cfg.precision, a.dtype),
                         preferred_element_type=jnp.float32)


def _barrier(cfg) -> None:
  """Synchronises the threads of a Triton program (no-op in interpret mode)."""
  if not cfg.interpret:
    plt.debug_barrier()


def _tile(cfg, q, k, ob_ref, qseg, kseg, row, col, qi, kj):
  """Scaled logits + bias ``[bq, bk]`` (float32, masked to ``NEG``) and the validity mask.

  ``qseg`` ``[bq, 1]`` and ``kseg`` ``[1, bk]`` are the tile's segment ids, ``row``
  ``[bq, 1]`` and ``col`` ``[1, bk]`` its part of the separable term (float32, added as
  ``row + col``, the order of the reference route's sum; read only with ``cfg.separable``).
  """
  s = _dot(cfg, q, k, (1, 1)) * cfg.scale
  i, j = _positions(cfg, qi, kj)
  if cfg.has_bias:
    s = s + _cls_reset(cfg, _bias_tile(cfg, ob_ref, i, j, qi, kj), i, j)
  if cfg.separable:
    s = s + (row + col)
  valid = qseg == kseg
  if cfg.causal:
    valid = valid & (j <= i)
  return jnp.where(valid, s, NEG), valid


def _positions(cfg, qi, kj):
  """Query and key positions ``i``, ``j`` of a tile, each ``[bq, bk]`` int32."""
  bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
  shape = (bq, bk)
  return (qi * bq + lax.broadcasted_iota(jnp.int32, shape, 0),
          kj * bk + lax.broadcasted_iota(jnp.int32, shape, 1))


def _cls_reset(cfg, tile, i, j):
  """``tile`` (positions ``i``, ``j``) with row 0 and column 0 zeroed under ``zero_first``
  (TUPE-R), else itself."""
  if not cfg.zero_first:
    return tile
  return jnp.where((i == 0) | (j == 0), 0.0, tile)


def _stream(cfg, seed_ref):
  """``(seed [1, 1], batch, head)`` of this program for :func:`_dropout` (read at the kernel's
  top level: interpret mode has no program ids inside loops), or None without dropout."""
  if not cfg.dropout_rate:
    return None
  return seed_ref[...], pl.program_id(0), pl.program_id(1)


def _dropout(cfg, stream, qi, kj):
  """The tile's dropout multipliers ``[bq, bk]`` (``keep / (1 - rate)``), or None without
  dropout: a hash of (seed, batch, head, i, j), the same in every kernel and route."""
  if stream is None:
    return None
  return dropout_multiplier(*stream, *_positions(cfg, qi, kj), cfg.dropout_rate)


def _closed_params(cfg, ob_ref):
  """The head's ``cfg.num_params`` closed-form parameters, each read as its own ``[1, 1]``
  float32 block of the ``[1, R_p]`` ref (Triton lowers no slice of a loaded array)."""
  return tuple(ob_ref[:, pl.ds(r, 1)].astype(jnp.float32) for r in range(cfg.num_params))


def _closed_tile(cfg, params, i, j):
  """``[bq, bk]`` float32 tile of the closed-form bias ``offset_fn.closed(params, j - i)``,
  evaluated from the tile's positions (iotas) and the head's ``[1, 1]`` parameters."""
  return cfg.closed.closed(params, j - i).astype(jnp.float32)


def _closed_gradient(cfg, params, i, j, dbias):
  """The tile's part of each parameter's gradient, ``sum_ij dbias_ij d bias_ij / d p``, each
  ``[1, 1]``: ``jax.vjp`` of the closed form at parameters broadcast to the tile (elementwise,
  no transposed broadcast), then the tile summed one axis at a time, in registers."""
  tiled = tuple(jnp.broadcast_to(p, dbias.shape) for p in params)
  _, pullback = jax.vjp(lambda *p: _closed_tile(cfg, p, i, j), *tiled)
  return tuple(jnp.sum(jnp.sum(g, axis=1, keepdims=True), axis=0, keepdims=True)
               for g in pullback(dbias))


def _bias_tile(cfg, ob_ref, i, j, qi, kj):
  """``[bq, bk]`` float32 tile ``ob[j - i + Lq_p - 1]`` from the ``[1, Loff_p]`` ref.

  With a closed form (``cfg.closed``) the ref holds the head's ``[1, R_p]`` parameters
  instead, and the tile is :func:`_closed_tile`: no vector is read, whatever ``cfg.tiles``.

  ``gather``: an in-kernel gather (Triton loads through a pointer tensor).
  ``band``: columns ``window_start + [0, bk)`` of the ``[bq, Loff_p]`` band ref, a block load.
  ``roll``: the tile's window of ``W = cfg.window`` entries (a lane-aligned slice, the
  blocks being multiples of 128) broadcast to every row, row ``r`` rotated by
  ``W - (bq - 1) + r`` (one strided roll), then its first ``bk`` columns.
  """
  if cfg.closed is not None:
    return _closed_tile(cfg, _closed_params(cfg, ob_ref), i, j)
  if cfg.tiles == "gather":
    return ob_ref[0, j - i + (cfg.q_len - 1)].astype(jnp.float32)
  if cfg.tiles == "band":  # ob_ref is the [bq, Loff_p] band (relative_flash._band)
    return ob_ref[:, pl.ds(cfg.window_start(qi, kj), cfg.blocks.block_k)]
  bq, bk, width = cfg.blocks.block_q, cfg.blocks.block_k, cfg.window
  window = ob_ref[:, pl.ds(cfg.window_start(qi, kj), width)]
  rows = jnp.broadcast_to(window.astype(jnp.float32), (bq, width))
  return pltpu.roll(rows, width - (bq - 1), 1, stride=1, stride_axis=0)[:, :bk]


def _diagonal_sums(cfg, dbias, ds_ref):
  """``[1, W]`` sums of the tile ``dbias`` ``[bq, bk]`` along its diagonals (window order,
  ``W = cfg.window``; columns past the tile's ``bq + bk - 1`` diagonals sum to zero).

  ``gather``: the tile goes through the ``ds_ref`` scratch and is read back
  skewed (column ``w`` of row ``r`` is tile column ``r + w - (bq - 1)``).
  ``roll``: the tile, zero-padded to the window width, is rotated back (row
  ``r`` by ``bq - 1 - r``, modulo ``W``) and summed over rows.
  """
  bq, bk, width = cfg.blocks.block_q, cfg.blocks.block_k, cfg.window
  if cfg.tiles == "roll":
    padded = jnp.concatenate([dbias, jnp.zeros((bq, width - bk), jnp.float32)], axis=1)
    back = pltpu.roll(padded, bq - 1, 1, stride=width - 1, stride_axis=0)
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


def _dropped(x, keep):
  """``x * keep`` (``keep`` None: no dropout)."""
  return x if keep is None else x * keep


def _cotangent(cfg, q, k, v, do, ob_ref, qseg, kseg, row, col, lse, delta, stream, qi, kj):
  """One tile's probabilities ``p``, its dropout multipliers ``keep`` (None without) and
  logit cotangent ``ds = p * (keep * dO v^T - delta)``, all ``[bq, bk]`` float32, from the
  tile's rows of q/dO/lse/delta/row and columns of k/v/col (what the backward kernels
  share)."""
  s, valid = _tile(cfg, q, k, ob_ref, qseg, kseg, row, col, qi, kj)
  p = jnp.where(valid, jnp.exp(s - lse), 0.0)
  keep = _dropout(cfg, stream, qi, kj)
  return p, keep, p * (_dropped(_dot(cfg, do, v, (1, 1)), keep) - delta)


def _num_k_blocks(cfg, qi):
  """k-blocks a query block needs (causal: up to the diagonal)."""
  bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
  nk = cfg.k_len // bk
  if not cfg.causal:
    return nk
  # lax.div: truncating division of non-negative ints (Mosaic lowers no floor division).
  return jnp.minimum(nk, lax.div((qi + 1) * bq + bk - 1, bk))


# ---------------------------------------------------------------------------
# Kernels. Refs are one (batch, head) slice, every array 2-D: q [bq or Lq_p, Dqk_p],
# k [Lk_p or bk, Dqk_p], v [Lk_p or bk, Dv_p], out/do [bq or Lq_p, Dv_p], offset bias
# [1, Loff_p] (a closed form: the head's parameters [1, R_p]), query segment ids, the
# separable term's row vector and lse/delta columns
# [bq or Lq_p, 1], key segment ids and the column vector rows [1, Lk_p or bk], the dropout
# seed [1, 1] (read only with dropout).


def fwd_kernel(cfg, q_ref, k_ref, v_ref, ob_ref, qseg_ref, kseg_ref, row_ref, col_ref,
                seed_ref, o_ref, lse_ref):
  qi = pl.program_id(2)
  bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
  q, qseg, row = q_ref[...], qseg_ref[...], row_ref[...]
  stream = _stream(cfg, seed_ref)

  def body(kj, carry):
    m, l, acc = carry
    cols = pl.ds(kj * bk, bk)
    k = k_ref[cols, :]
    v = v_ref[cols, :]
    s, valid = _tile(cfg, q, k, ob_ref, qseg, kseg_ref[:, cols], row, col_ref[:, cols], qi, kj)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    p = jnp.where(valid, jnp.exp(s - m_new), 0.0)
    alpha = jnp.exp(m - m_new)
    keep = _dropout(cfg, stream, qi, kj)  # the normaliser l sums every probability
    pv = _dot(cfg, _dropped(p, keep).astype(v.dtype), v, (1, 0))
    return m_new, alpha * l + jnp.sum(p, axis=1, keepdims=True), alpha * acc + pv

  init = (jnp.full((bq, 1), NEG, jnp.float32), jnp.zeros((bq, 1), jnp.float32),
          jnp.zeros(o_ref.shape, jnp.float32))
  m, l, acc = lax.fori_loop(0, _num_k_blocks(cfg, qi), body, init)
  empty = l == 0.0
  l_safe = jnp.where(empty, 1.0, l)
  o_ref[...] = (acc / l_safe).astype(o_ref.dtype)
  # Empty rows get lse = +big so that exp(s - lse) = 0 in the backward.
  lse_ref[...] = jnp.where(empty, -NEG, m + jnp.log(l_safe))


def dq_kernel(cfg, q_ref, k_ref, v_ref, ob_ref, qseg_ref, kseg_ref, row_ref, col_ref,
               seed_ref, do_ref, lse_ref, delta_ref, dq_ref, *grads):
  """``dq`` of one query block and, with a separable term, its row vector's gradient
  ``dr_i = sum_j dS_ij`` (``grads[0]``, ``[bq, 1]``) and, with a bias (gather and roll tiles),
  its part of the offset-bias gradient.

  The next of ``grads``, ``dob_ref`` ``[1, Loff_p]``, accumulates the diagonal sums of every
  logit cotangent tile of this query block (then ``ds_ref`` ``[bq, bk]``: the gather
  mode's scratch, see :func:`_diagonal_sums`). Band tiles leave the bias gradient to
  :func:`dbias_kernel`. With a closed form, ``dob_ref`` ``[1, R_p]`` accumulates each tile's
  :func:`_closed_gradient` instead, parameter by parameter (no scratch, no diagonal sums).
  """
  dr_ref, *grads = grads if cfg.separable else (None, *grads)
  dob_ref, ds_ref = (*grads, None, None)[:2]
  qi = pl.program_id(2)
  bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
  q, do, qseg, row = q_ref[...], do_ref[...], qseg_ref[...], row_ref[...]
  lse, delta = lse_ref[...], delta_ref[...]
  stream = _stream(cfg, seed_ref)
  params = _closed_params(cfg, ob_ref) if cfg.closed is not None else None
  if dob_ref is not None:
    dob_ref[...] = jnp.zeros(dob_ref.shape, jnp.float32)

  def body(kj, carry):
    dq, dr = carry
    cols = pl.ds(kj * bk, bk)
    k = k_ref[cols, :]
    _, _, ds = _cotangent(cfg, q, k, v_ref[cols, :], do, ob_ref, qseg, kseg_ref[:, cols], row,
                          col_ref[:, cols], lse, delta, stream, qi, kj)
    if dob_ref is not None:
      i, j = _positions(cfg, qi, kj)
      dbias = _cls_reset(cfg, ds, i, j)
      if cfg.closed is not None:
        for r, grad in enumerate(_closed_gradient(cfg, params, i, j, dbias)):
          dob_ref[:, pl.ds(r, 1)] = dob_ref[:, pl.ds(r, 1)] + grad
      else:
        window = (slice(None), pl.ds(cfg.window_start(qi, kj), cfg.window))
        dob_ref[window] = dob_ref[window] + _diagonal_sums(cfg, dbias, ds_ref)
    if cfg.separable:
      dr = dr + jnp.sum(ds, axis=1, keepdims=True)
    return dq + _dot(cfg, ds.astype(k.dtype), k, (1, 0)), dr

  init = (jnp.zeros(q.shape, jnp.float32), jnp.zeros((bq, 1), jnp.float32))
  dq, dr = lax.fori_loop(0, _num_k_blocks(cfg, qi), body, init)
  dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)
  if dr_ref is not None:
    dr_ref[...] = dr


def dkv_kernel(cfg, q_ref, k_ref, v_ref, ob_ref, qseg_ref, kseg_ref, row_ref, col_ref,
                seed_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, dc_ref=None):
  """``dk``, ``dv`` of one key block and, with a separable term, its column vector's
  gradient ``ds_j = sum_i dS_ij`` (``dc_ref`` ``[1, bk]``)."""
  kj = pl.program_id(2)
  bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
  k, v, kseg, col = k_ref[...], v_ref[...], kseg_ref[...], col_ref[...]
  stream = _stream(cfg, seed_ref)

  def body(qi, carry):
    dk, dv, dc = carry
    rows = pl.ds(qi * bq, bq)
    q, do = q_ref[rows, :], do_ref[rows, :]
    p, keep, ds = _cotangent(cfg, q, k, v, do, ob_ref, qseg_ref[rows, :], kseg,
                             row_ref[rows, :], col, lse_ref[rows, :], delta_ref[rows, :],
                             stream, qi, kj)
    if cfg.separable:
      dc = dc + jnp.sum(ds, axis=0, keepdims=True)
    return (dk + _dot(cfg, ds.astype(q.dtype), q, (0, 0)),
            dv + _dot(cfg, _dropped(p, keep).astype(do.dtype), do, (0, 0)), dc)

  start = lax.div(kj * bk, bq) if cfg.causal else 0
  init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32),
          jnp.zeros((1, bk), jnp.float32))
  dk, dv, dc = lax.fori_loop(start, cfg.q_len // bq, body, init)
  dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)
  if dc_ref is not None:
    dc_ref[...] = dc


def dbias_kernel(cfg, q_ref, k_ref, v_ref, band_ref, qseg_ref, kseg_ref, row_ref, col_ref,
                  seed_ref, do_ref, lse_ref, delta_ref, du_ref):
  """Band tiles' bias gradient: unit ``n`` of one (batch, head), the sum of the logit
  cotangent tiles of every (query block ``qi``, key block ``kj = qi + n - (nq - 1)``) pair,
  all of which read the same band columns ``n b + [0, b)`` (square ``b x b`` tiles).

  Each pair's cotangent is recomputed (``q k^T`` and ``dO v^T``) and accumulated in
  registers, ``du_ref`` ``[b, b]`` takes the sum; :func:`band.unit_gradient` turns the
  units into the offset vector's gradient outside the kernel, so no kernel sums diagonals.
  """
  n = pl.program_id(2)
  side = cfg.blocks.block_q
  nq, nk = cfg.q_len // side, cfg.k_len // side
  stream = _stream(cfg, seed_ref)
  first = jnp.maximum(0, nq - 1 - n)  # the unit's first query block with a key block
  last = jnp.minimum(nq, nq - 1 - n + nk)
  if cfg.causal:  # key blocks past the query block's are masked whole
    last = jnp.where(n > nq - 1, first, last)

  def body(qi, du):
    kj = qi + n - (nq - 1)
    rows, cols = pl.ds(qi * side, side), pl.ds(kj * side, side)
    _, _, ds = _cotangent(cfg, q_ref[rows, :], k_ref[cols, :], v_ref[cols, :],
                          do_ref[rows, :], band_ref, qseg_ref[rows, :], kseg_ref[:, cols],
                          row_ref[rows, :], col_ref[:, cols], lse_ref[rows, :],
                          delta_ref[rows, :], stream, qi, kj)
    return du + _cls_reset(cfg, ds, *_positions(cfg, qi, kj))

  du_ref[...] = lax.fori_loop(first, last, body, jnp.zeros(du_ref.shape, jnp.float32))
