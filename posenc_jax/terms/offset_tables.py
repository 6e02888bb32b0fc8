"""Offsets ``j - i`` (key minus query position) and the tables read at them.

:func:`relative_offsets` ``[Lq, Lk]`` and :func:`offsets` ``[Lq + Lk - 1]`` (the layout of a
Toeplitz term's values); :func:`skew_offsets` and :func:`toeplitz_bias` turn per-offset rows or
values into ``[.., Lq, Lk]`` by pad and reshape; :func:`id_offsets` ``[B, L, L]`` and
:func:`toeplitz_bias_at` ``[B, H|1, L, L]`` do the same at per-token positions ``[B, L]``;
:func:`lookup` and :func:`lookup_rows` read small tables as one-hot contractions. None gathers,
and no gradient scatters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array


def relative_offsets(q_len: int, k_len: int, q_offset: int | Array = 0) -> Array:
  """``[Lq, Lk]`` int32 matrix of ``j - i`` (key position minus query position)."""
  i = jnp.arange(q_len, dtype=jnp.int32)[:, None] + q_offset
  j = jnp.arange(k_len, dtype=jnp.int32)[None, :]
  return j - i


def offsets(q_len: int, k_len: int) -> Array:
  """``[Lq + Lk - 1]`` int32 offsets ``rel = j - i``, from ``-(Lq - 1)`` to ``Lk - 1``.

  Entry ``o`` is ``rel = o - (Lq - 1)``: the layout of a Toeplitz term's
  per-offset values (:meth:`Toeplitz.offset_values`).
  """
  return jnp.arange(-(q_len - 1), k_len, dtype=jnp.int32)


def skew_offsets(x: Array) -> Array:
  """Per-offset rows -> the ``[Lq, Lk]`` matrix they describe (Music Transformer's skewing).

  Args:
    x: ``[..., Lq, Lq + Lk - 1]``; column ``o`` of row ``i`` holds offset
      ``j - i = o - (Lq - 1)`` (the layout of :func:`offsets`).

  Returns:
    ``[..., Lq, Lk]`` with ``out[..., i, j] = x[..., i, j - i + Lq - 1]``.

  Only pad, reshape and slice, so its autodiff transpose is slice, reshape
  and pad again: no gather, and no scatter in the backward pass.
  """
  *batch, q_len, width = x.shape
  # With one zero appended per row, row i starts i entries later in rows of
  # ``width``; dropping the first Lq - 1 entries then moves its column
  # j - i + Lq - 1 to column j.
  x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, 1)])
  flat = x.reshape(*batch, q_len * (width + 1))[..., q_len - 1:q_len - 1 + q_len * width]
  return flat.reshape(*batch, q_len, width)[..., :width - q_len + 1]


def toeplitz_bias(offset_bias: Array, q_len: int, k_len: int, zero_first: bool = False,
                  q_offset: int | Array = 0) -> Array:
  """``[H|1, Lq + Lk - 1]`` per-offset values -> the ``[1, H|1, Lq, Lk]`` bias they describe.

  Entry ``o`` of ``offset_bias`` holds local offset ``j - i = o - (Lq - 1)``;
  ``zero_first`` zeroes the row of absolute query position 0 (query row
  ``i`` sits at ``i + q_offset``) and key column 0. Built by
  :func:`skew_offsets`, so its gradient is a sum, not a scatter-add.
  """
  shape = offset_bias.shape[:-1] + (q_len, q_len + k_len - 1)
  bias = skew_offsets(jnp.broadcast_to(offset_bias[..., None, :], shape))
  if zero_first:
    rows = jnp.arange(q_len) + q_offset != 0
    bias = bias * (rows[:, None] & (jnp.arange(k_len) != 0)[None, :])
  return bias[None]


def lookup(table: Array, index: Array) -> Array:
  """``table[..., index]`` for a small table, as a one-hot contraction.

  Args:
    table: ``[..., R]``.
    index: int ``[N]`` in ``[0, R)`` (may be traced).

  Returns:
    ``[..., N]``, exactly the table's entries. Its gradient is a matmul,
    where ``jnp.take``'s is a scatter-add with colliding indices.
  """
  one_hot = jax.nn.one_hot(index, table.shape[-1], dtype=table.dtype)
  return jnp.einsum("...r,nr->...n", table, one_hot, precision=lax.Precision.HIGHEST)


def lookup_rows(table: Array, ids: Array, axis: int = 0) -> Array:
  """``jnp.take(table, ids, axis)`` for position ids, as a one-hot contraction.

  Args:
    table: ``[..., M, ...]`` with ``M`` rows along ``axis``.
    ids: int ``[B, L]`` in ``[0, M)`` (may be traced; an id outside it reads a row of
      zeros).

  Returns:
    ``table`` with ``axis`` replaced by ``[B, L]``, exactly the table's rows. Its gradient
    is a matmul, where ``jnp.take``'s is a scatter-add (see :func:`lookup`).
  """
  axis = axis % table.ndim
  one_hot = jax.nn.one_hot(ids, table.shape[axis], dtype=table.dtype)  # [B, L, M]
  rows = jnp.tensordot(one_hot, table, axes=((2,), (axis,)), precision=lax.Precision.HIGHEST)
  return jnp.moveaxis(rows, (0, 1), (axis, axis + 1))  # [B, L, ...] -> the table's layout


def id_offsets(position_ids: Array) -> Array:
  """``[B, Lq, Lk]`` int32 offsets ``position_ids[b, j] - position_ids[b, i]`` of ``[B, L]``
  ids (self-attention): :func:`relative_offsets` for per-token positions."""
  ids = position_ids.astype(jnp.int32)
  return ids[:, None, :] - ids[:, :, None]


def toeplitz_bias_at(offset_values: Array, position_ids: Array, zero_first: bool = False
                     ) -> Array:
  """A Toeplitz term at per-token positions: ``[B, H|1, L, L]`` with entry ``(b, h, i, j)``
  the value of offset ``position_ids[b, j] - position_ids[b, i]``.

  Args:
    offset_values: ``[H|1, 2M - 1]`` values of offsets ``-(M - 1) .. M - 1`` (the layout of
      :func:`offsets` for ``Lq = Lk = M``).
    position_ids: int ``[B, L]`` in ``[0, M)`` (an id outside it gets a bias of 0).
    zero_first: zero the rows and columns of tokens at position 0 (TUPE-R's [CLS] reset).

  Returns:
    ``O T O^T`` with ``T`` the ``[H, M, M]`` Toeplitz matrix (:func:`toeplitz_bias`) and
    ``O`` the ``[B, L, M]`` one-hot positions: exact (one non-zero product per entry) and,
    like :func:`lookup`, free of gathers and scatters in both passes.
  """
  num_positions = (offset_values.shape[-1] + 1) // 2
  table = toeplitz_bias(offset_values, num_positions, num_positions)[0]  # [H, M, M]
  one_hot = jax.nn.one_hot(position_ids, num_positions, dtype=offset_values.dtype)
  bias = jnp.einsum("bia,hac,bjc->bhij", one_hot, table, one_hot,
                    precision=lax.Precision.HIGHEST)
  if zero_first:
    kept = position_ids != 0
    bias = bias * (kept[:, None, :, None] & kept[:, None, None, :])
  return bias
