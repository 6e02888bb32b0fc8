"""The Mosaic GPU pieces that the Hopper forward (:mod:`posenc_jax.kernels.hopper_flash`) and
backward (:mod:`posenc_jax.kernels.hopper_backward`) share: the 64-row blocks (``BLOCK_Q``), the
``[H, 64, 64 N]`` band of the offset vector (:func:`hopper_band`), shared-memory operand
layouts, the warp-specialised pipeline, ``wgmma`` products and one tile's masked logits
(:func:`tile_logits`). Pallas' Mosaic GPU module is imported on first use
(:func:`mosaic_gpu`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from posenc_jax.kernels.band import bias_band
from posenc_jax.kernels.common import NEG

Array = jax.Array

BLOCK_Q = 64  # one warpgroup's wgmma rows
STAGES = 2  # pipeline steps in flight
MEMORY_REGISTERS = 40  # per thread of the copying warpgroup


def hopper_band(offset_bias: Array, q_len: int, k_len: int, lead: int = 0,
                trail: int = 0) -> Array:
  """``[H, 64, 64 N]`` float32 band of the padded offset vector (hopper_flash's docstring;
  :func:`~posenc_jax.kernels.band.bias_band`), ``N = lead + (Lk + Lq) / 64 - 1 + trail``
  units of 64 columns.

  Args:
    offset_bias: ``[H, 1, Loff_p]``, offset ``o = j - i + q_len - 1`` (relative_flash's).
    q_len, k_len: padded lengths, multiples of 64.
    lead, trail: units of padding before the first tile and after the last.
  """
  units = lead + (k_len + q_len) // BLOCK_Q - 1 + trail
  return bias_band(offset_bias[:, 0, :], BLOCK_Q, units * BLOCK_Q, lead=lead * BLOCK_Q)


def mosaic_gpu():
  """Pallas' Mosaic GPU module, imported on first use (0.3 s: kept out of
  ``import posenc_jax``)."""
  from jax.experimental.pallas import mosaic_gpu
  return mosaic_gpu


def operand_transforms(cols: int, dtype) -> tuple:
  """Shared-memory tiling and swizzle of a ``wgmma`` operand ``cols`` wide."""
  plgpu = mosaic_gpu()
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = plgpu.find_swizzle(cols * itemsize * 8)
  return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def warpgroup_buffers(groups: int, cols: int, dtype):
  """``[G, 64, cols]`` shared memory: one ``[64, cols]`` ``wgmma`` operand buffer per
  consumer warpgroup."""
  plgpu = mosaic_gpu()
  return plgpu.SMEM((groups, BLOCK_Q, cols), dtype, transforms=operand_transforms(cols, dtype))


def window_spec(units: int, first):
  """Pipeline block of ``units`` band units (``[64, 64 units]`` float32 columns) from unit
  ``first(step)``: the units a step's warpgroups read."""
  plgpu = mosaic_gpu()
  return plgpu.BlockSpec((BLOCK_Q, pl.Element(units * BLOCK_Q)),
                         lambda n: (0, first(n) * BLOCK_Q))


def specialised_pipeline(step, specs, compute, *, steps: int, groups: int):
  """The warp-specialised pipeline over ``steps`` blocks: a memory warpgroup copying
  ``specs``' blocks (``STAGES`` in flight) for ``groups`` consumer warpgroups that run
  ``step`` inside ``compute`` (``emit_pipeline_warp_specialized``'s arguments)."""
  plgpu = mosaic_gpu()
  return plgpu.emit_pipeline_warp_specialized(
      step, grid=(steps,), in_specs=specs, max_concurrent_steps=min(STAGES, steps),
      wg_axis="wg", num_compute_wgs=groups, memory_registers=MEMORY_REGISTERS,
      compute_context=compute)


def product(a_ref, b_ref, shape: tuple[int, int]) -> Array:
  """``a @ b`` of two shared-memory ``wgmma`` operands (either may be a ``.T`` view) as a
  ``shape`` float32 array in the WGMMA layout."""
  plgpu = mosaic_gpu()

  def body(acc_ref):
    plgpu.wgmma(acc_ref, a_ref, b_ref)
    return acc_ref[...]

  return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))


def tile_logits(q_tile, k_tile, bias_tile, q_seg: Array, k_seg: Array, q0, k0, *, scale: float,
            causal: bool, zero_first: bool, positions: bool):
  """One tile's logits: ``(s, valid, i, j)``.

  ``s`` ``[64, bk]`` float32 (WGMMA layout): ``scale q k^T`` plus the bias tile (its row 0
  and column 0 zeroed with ``zero_first``), ``NEG`` where ``valid`` is False (segments
  differ, or ``causal`` and ``j > i``). ``i``, ``j``: the query and key positions (from
  ``q0``, ``k0``), made when ``positions``, ``zero_first`` or ``causal`` needs them, else
  None.

  Args:
    q_tile, k_tile: ``[64, D]`` and ``[bk, D]`` shared-memory operands.
    bias_tile: ``[64, bk]`` float32 shared-memory view, or None without a bias.
    q_seg, k_seg: ``[64]`` (WGMMA row layout) and ``[bk]`` (column layout) segment ids.
  """
  plgpu = mosaic_gpu()
  layout = plgpu.Layout.WGMMA
  shape = (BLOCK_Q, k_tile.shape[0])
  s = product(q_tile, k_tile.T, shape) * scale
  i = j = None
  if positions or zero_first or causal:
    i = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=layout) + q0
    j = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=layout) + k0
  if bias_tile is not None:
    bias = plgpu.load(bias_tile, layout=layout)
    if zero_first:
      bias = jnp.where((i == 0) | (j == 0), 0.0, bias)
    s = s + bias
  valid = lax.broadcast_in_dim(q_seg, shape, [0]) == lax.broadcast_in_dim(k_seg, shape, [1])
  if causal:
    valid = valid & (j <= i)
  return jnp.where(valid, s, NEG), valid, i, j
