"""Toeplitz bands: ``rows`` shifted copies of an offset vector, so that every tile of a
Toeplitz bias is a block of columns (a plain block load in a kernel, no gather).

    band[h, r, w] = vector[h, w - r + rows - 1 - lead]        (0 off the vector)

With the offset vector of :mod:`posenc_jax.kernels.relative_flash` (``vector[o]`` the bias of
``j - i = o - (Lq - 1)``), the ``[rows, cols]`` block of the band from column ``w0`` is the
bias tile of queries ``i0 + [0, rows)`` and keys ``j0 + [0, cols)`` for any ``j0 - i0 = w0 -
lead - (Lq - rows)``: one band serves every tile. Building it is one gather of ``O(rows
width)`` entries; :func:`band_gradient` carries a band's cotangent back to the vector
without a scatter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def bias_band(vector: Array, rows: int, width: int, lead: int = 0) -> Array:
  """``[H, rows, width]`` float32 band of ``vector`` (module docstring).

  Args:
    vector: ``[H, L]`` offset vector.
    rows: the band's rows (a tile's query rows).
    width: its columns.
    lead: columns of zeros before the vector starts on row ``rows - 1``.
  """
  length = vector.shape[-1]
  right = max(0, width + rows - 1 - lead - length)
  padded = jnp.pad(vector.astype(jnp.float32), ((0, 0), (lead, right)))
  index = jnp.arange(width)[None, :] - jnp.arange(rows)[:, None] + rows - 1
  return padded[:, index]


def band_gradient(dband: Array, length: int, lead: int = 0) -> Array:
  """The cotangent ``[H, length]`` of :func:`bias_band`'s ``vector`` from the band's
  ``dband [H, rows, width]``: ``d vector[o] = sum_r dband[r, o + r - (rows - 1) + lead]``.

  Scatter-free: rows reversed and zero-padded by ``rows`` columns, then read back with one
  column fewer per row (a reshape), each row lands shifted by its index, and the column sums
  are the sums along the band's diagonals.
  """
  heads, rows, width = dband.shape
  padded = jnp.pad(dband[:, ::-1, :], ((0, 0), (0, 0), (0, rows)))
  flat = padded.reshape(heads, rows * (width + rows))[:, :rows * (width + rows - 1)]
  sums = flat.reshape(heads, rows, width + rows - 1).sum(axis=1)  # [H, width + rows - 1]
  sums = jnp.pad(sums, ((0, 0), (0, max(0, lead + length - sums.shape[1]))))
  return sums[:, lead:lead + length]


def unit_gradient(du: Array, length: int) -> Array:
  """The cotangent ``[H, length]`` of :func:`bias_band`'s ``vector`` (``lead`` 0) from
  per-unit sums ``du [B, H, N, b, b]``: the band's cotangent summed over the batch, unit
  ``n`` being its columns ``n b + [0, b)`` of a band of ``b`` rows."""
  _, heads, units, rows, _ = du.shape
  dband = jnp.sum(du, axis=0).transpose(0, 2, 1, 3).reshape(heads, rows, units * rows)
  return band_gradient(dband, length)
