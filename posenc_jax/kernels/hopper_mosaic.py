"""The Mosaic GPU pieces that the Hopper forward (:mod:`posenc_jax.kernels.hopper_flash`) and
backward (:mod:`posenc_jax.kernels.hopper_backward`) share: the 64-row blocks (``BLOCK_Q``), the
``[H, 64, 64 N]`` band of the offset vector (:func:`hopper_band`), shared-memory operand
layouts, the warp-specialised pipeline, ``wgmma`` products, closed-form biases evaluated in
the tiles (:class:`ClosedBias`, and their parameters' gradient), where a pass's bias tiles
come from (:class:`TileBias`) and one tile's masked logits
(:func:`tile_logits`). Pallas' Mosaic GPU module is imported on first use
(:func:`mosaic_gpu`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.extend import core as jex_core

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


def closed_params(params_ref, head, num_params: int) -> tuple[Array, ...]:
  """The head's ``R`` closed-form parameters, each a ``[64]`` row in the WGMMA row layout,
  from ``params_ref`` ``[H, R, 64]`` (:func:`closed_rows`): what a :class:`ClosedBias` holds
  (a pipeline carries them: its steps cannot read values made outside them)."""
  plgpu = mosaic_gpu()
  return tuple(plgpu.load(params_ref.at[head, r], layout=plgpu.Layout.WGMMA.reduce(1),
                          optimized=False) for r in range(num_params))


def _pow(x: Array, y: Array) -> Array:
  """``x ** y`` for ``x >= 0`` through exp and log (``0 ** y`` is 0, ``0 ** 0`` is 1)."""
  positive = x > 0
  return jnp.where(positive, jnp.exp(y * jnp.log(jnp.where(positive, x, 1.0))),
                   (y == 0).astype(x.dtype))


# Primitives a closed form may use that Mosaic GPU does not lower (jax 0.12: log1p, pow), in
# the ones it does (log, exp): KERPLE's forms, evaluated in the Hopper tiles.
LOWERED_AS = {lax.log1p_p: lambda x: jnp.log(1.0 + x), lax.pow_p: _pow}


def _evaluate(jaxpr, consts, args) -> list:
  """``jaxpr`` on ``args``, each primitive of :data:`LOWERED_AS` replaced by its form there
  (nested jaxprs too: a jitted jnp function)."""
  env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))

  def read(var):
    return var.val if isinstance(var, jex_core.Literal) else env[var]

  for eqn in jaxpr.eqns:
    ins = [read(var) for var in eqn.invars]
    inner = eqn.params.get("jaxpr")
    if eqn.primitive in LOWERED_AS:
      outs = [LOWERED_AS[eqn.primitive](*ins)]
    elif isinstance(inner, jex_core.ClosedJaxpr):
      outs = _evaluate(inner.jaxpr, inner.consts, ins)
    else:
      outs = eqn.primitive.bind(*ins, **eqn.params)
      outs = outs if eqn.primitive.multiple_results else [outs]
    env.update(zip(eqn.outvars, outs))
  return [read(var) for var in jaxpr.outvars]


class ClosedBias:
  """A closed-form Toeplitz bias evaluated in a tile from its positions: ``offset_fn.closed(
  params, j - i)`` (relative_flash's ``offset_fn``) with the head's parameters ``rows``
  (:func:`closed_params`) broadcast over the tile, its ``log1p`` and ``pow`` written with
  ``log`` and ``exp`` (:data:`LOWERED_AS`); no band is read."""

  def __init__(self, offset_fn, rows: tuple[Array, ...]):
    self.offset_fn, self.rows = offset_fn, rows

  def __call__(self, i: Array, j: Array) -> Array:
    params = tuple(lax.broadcast_in_dim(row, i.shape, [0]) for row in self.rows)
    closed = jax.make_jaxpr(self.offset_fn.closed)(params, j - i)
    (bias,) = _evaluate(closed.jaxpr, closed.consts, [*params, j - i])
    return bias.astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class TileBias:
  """Where the Hopper kernels' bias tiles come from, the same in the forward and the backward:
  windows of the band (``has_bias``), a closed form evaluated in the tiles (``closed``, with
  its ``num_params`` parameters per head) or nothing."""

  has_bias: bool
  closed: Any = None  # relative_flash's offset_fn
  num_params: int = 0  # R

  @property
  def band_tiles(self) -> bool:
    """Whether the tiles are copied from the band (its windows in shared memory)."""
    return self.has_bias and self.closed is None

  def operand(self, offset_bias: Array, q_len: int, k_len: int, *, lead: int = 0,
              trail: int = 0) -> Array:
    """What the kernels get in the bias's place: the band (:func:`hopper_band`), the closed
    form's ``[H, R, 64]`` parameters (:func:`closed_rows`), or a placeholder."""
    if self.band_tiles:
      return hopper_band(offset_bias, q_len, k_len, lead=lead, trail=trail)
    if self.closed is not None:
      return closed_rows(offset_bias, self.num_params)
    return jnp.zeros((1, 1, 1), jnp.float32)

  def params(self, operand_ref, head) -> tuple[Array, ...]:
    """The closed form's parameters of ``head`` (:func:`closed_params`), or none: what a
    pipeline carries."""
    if self.closed is None:
      return ()
    return closed_params(operand_ref, head, self.num_params)

  def tile(self, window, params: tuple[Array, ...]):
    """A tile's bias for :func:`tile_logits`: the band's ``window()`` view, the closed form
    of the carried ``params`` (:class:`ClosedBias`), or None."""
    if self.band_tiles:
      return window()
    return ClosedBias(self.closed, tuple(params)) if self.closed is not None else None


def closed_rows(params: Array, num_params: int) -> Array:
  """``[H, R, 64]`` float32: each head's first ``num_params`` parameters of relative_flash's
  ``[H, 1, R_p]``, each repeated over a row of 64 (what :class:`ClosedBias` loads)."""
  rows = params[:, 0, :num_params].astype(jnp.float32)
  return jnp.broadcast_to(rows[:, :, None], (*rows.shape, BLOCK_Q))


def closed_gradient(offset_fn, params: Array, num_params: int, d_offsets: Array,
                    q_len: int) -> Array:
  """The parameters' gradient ``[H, 1, R_p]`` (zero past ``num_params``) from the offset
  vector's ``d_offsets [H, Lq + Lk - 1]`` (offset ``o`` is ``rel = o - (Lq - 1)``): the bias
  is Toeplitz, so ``sum_ij dS_ij d closed(j - i) / d params`` is the closed form's ``jax.vjp``
  over the offsets."""
  rel = jnp.arange(d_offsets.shape[-1], dtype=jnp.int32)[None, :] - (q_len - 1)

  def vector(p):
    return offset_fn.closed(tuple(p[:, 0, r:r + 1] for r in range(num_params)), rel)

  _, pullback = jax.vjp(vector, params.astype(jnp.float32))
  return pullback(d_offsets.astype(jnp.float32))[0]


def tile_logits(q_tile, k_tile, bias, q_seg: Array, k_seg: Array, q0, k0, *, scale: float,
            causal: bool, zero_first: bool, positions: bool):
  """One tile's logits: ``(s, valid, i, j)``.

  ``s`` ``[64, bk]`` float32 (WGMMA layout): ``scale q k^T`` plus the bias tile (its row 0
  and column 0 zeroed with ``zero_first``), ``NEG`` where ``valid`` is False (segments
  differ, or ``causal`` and ``j > i``). ``i``, ``j``: the query and key positions (from
  ``q0``, ``k0``), made when ``positions``, ``zero_first``, ``causal`` or a closed form needs
  them, else None.

  Args:
    q_tile, k_tile: ``[64, D]`` and ``[bk, D]`` shared-memory operands.
    bias: a ``[64, bk]`` float32 shared-memory view of the band, a :class:`ClosedBias`, or
      None without a bias.
    q_seg, k_seg: ``[64]`` (WGMMA row layout) and ``[bk]`` (column layout) segment ids.
  """
  plgpu = mosaic_gpu()
  layout = plgpu.Layout.WGMMA
  shape = (BLOCK_Q, k_tile.shape[0])
  s = product(q_tile, k_tile.T, shape) * scale
  i = j = None
  closed = isinstance(bias, ClosedBias)
  if positions or zero_first or causal or closed:
    i = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=layout) + q0
    j = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=layout) + k0
  if bias is not None:
    values = bias(i, j) if closed else plgpu.load(bias, layout=layout)
    if zero_first:
      values = jnp.where((i == 0) | (j == 0), 0.0, values)
    s = s + values
  valid = lax.broadcast_in_dim(q_seg, shape, [0]) == lax.broadcast_in_dim(k_seg, shape, [1])
  if causal:
    valid = valid & (j <= i)
  return jnp.where(valid, s, NEG), valid, i, j
