"""The Hopper backward pass (``backward="hopper"``; :mod:`posenc_jax.kernels.hopper_flash`
describes both passes and re-exports this one's entry points).

Three kernels on 64 x 64 tiles. dq: warp-specialised as the forward, ``G`` consumer
warpgroups on consecutive query blocks sharing each key block's copies and a window of ``G``
band units; dk/dv: the same on consecutive key blocks over query blocks (``p^T dO`` and
``dS^T q`` from transposed shared-memory operands); the bias gradient: one warpgroup per unit
of the band (a diagonal of the tile grid) over its (query block, key block) pairs, summing
their logit cotangents in registers. The band's diagonals are summed outside
(:func:`~posenc_jax.kernels.band.band_gradient`), so no kernel sums diagonals and none adds
atomically. :func:`backward` takes q, k, v ``[B, H, L_p, D_p]`` and returns their gradients
and the offset vector's ``[H, 1, Loff_p]``; :func:`backward_fits` says which shapes it takes.
The pieces it shares with the forward are in :mod:`posenc_jax.kernels.hopper_mosaic`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from posenc_jax.kernels.band import unit_gradient
from posenc_jax.kernels.dropout import dropout_multiplier
from posenc_jax.kernels.hopper_mosaic import (BLOCK_Q, STAGES, TileBias, closed_gradient,
                                              mosaic_gpu, operand_transforms, product,
                                              specialised_pipeline, tile_logits,
                                              warpgroup_buffers, window_spec)

Array = jax.Array

BACKWARD_MAX_DIM = 128  # head dims whose dk/dv buffers fit in shared memory


def backward_warpgroups(*, qk_dim: int, v_dim: int) -> int:
  """Consumer warpgroups per block of the backward's dq and dk/dv grids (each on its own
  query or key block, sharing the other side's copies): 2 at head dims up to 64, else 1
  (dk/dv's buffers would pass 227 KiB)."""
  return 2 if max(qk_dim, v_dim) <= 64 else 1


def backward_fits(*, dtype, block_q: int, block_k: int, qk_dim: int, v_dim: int) -> bool:
  """Whether :func:`backward` takes these (padded) shapes: 16-bit inputs, blocks multiples
  of 64 (its tiles), head dims multiples of 64 up to ``BACKWARD_MAX_DIM``."""
  return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
          and block_q % BLOCK_Q == 0 and block_k % BLOCK_Q == 0
          and all(d % 64 == 0 and d <= BACKWARD_MAX_DIM for d in (qk_dim, v_dim)))


@dataclasses.dataclass(frozen=True)
class _Backward:
  """Static settings of :func:`backward`'s kernels; blocks are 64 rows (``BLOCK_Q``)."""

  scale: float
  causal: bool
  zero_first: bool
  dropout_rate: float
  interpret: bool
  dtype: jnp.dtype  # of q, k, v
  qk_dim: int  # Dqk_p
  v_dim: int  # Dv_p
  nq: int  # query blocks
  nk: int  # key blocks
  groups: int  # consumer warpgroups per block of the dq and dk/dv grids (backward_warpgroups)
  source: TileBias  # the bias tiles: the band's, a closed form's or none

  @property
  def q_ctas(self) -> int:
    """Blocks of dq's grid, ``G`` query blocks each."""
    return -(-self.nq // self.groups)

  @property
  def k_ctas(self) -> int:
    """Blocks of dk/dv's grid, ``G`` key blocks each."""
    return -(-self.nk // self.groups)

  @property
  def lead(self) -> int:
    """Band units before the first tile's: dq's idle warpgroups in its last grid block."""
    return self.q_ctas * self.groups - self.nq


def backward(q: Array, k: Array, v: Array, offset_bias: Array, q_segments: Array,
             kv_segments: Array, seed: Array, lse: Array, delta: Array, do: Array, *,
             scale: float, causal: bool, zero_first: bool, has_bias: bool,
             dropout_rate: float, interpret: bool, closed=None,
             num_params: int = 0) -> tuple[Array, Array, Array, Array]:
  """Gradients of :func:`forward`'s output from its cotangent ``do``.

  Args:
    q, k, v, offset_bias, q_segments, kv_segments, seed: as :func:`forward`'s (lengths
      multiples of 64).
    lse: ``[B, H, Lq_p, 1]`` float32 from the forward pass.
    delta: ``[B, H, Lq_p, 1]`` float32 row sums of ``out * do``.
    do: ``[B, H, Lq_p, Dv_p]``.
    scale, causal, zero_first, has_bias, dropout_rate, interpret, closed, num_params: as
      :func:`forward`'s.

  Returns:
    ``dq``, ``dk``, ``dv`` shaped and typed as q, k, v, and the offset vector's gradient
    ``[H, 1, Loff_p]`` float32 (zeros without a bias; with ``closed``, the parameters'
    ``[H, 1, R_p]``: the offset vector's gradient from the same per-unit sums, pulled back
    through the closed form, :func:`~posenc_jax.kernels.hopper_mosaic.closed_gradient`).
  """
  q_len, qk_dim = q.shape[2:]
  k_len, v_dim = k.shape[2], v.shape[-1]
  groups = backward_warpgroups(qk_dim=qk_dim, v_dim=v_dim)
  cfg = _Backward(scale=scale, causal=causal, zero_first=zero_first,
                  dropout_rate=dropout_rate, interpret=interpret, dtype=q.dtype,
                  qk_dim=qk_dim, v_dim=v_dim, nq=q_len // BLOCK_Q, nk=k_len // BLOCK_Q,
                  groups=groups, source=TileBias(has_bias, closed, num_params))
  # One band for the three kernels, padded for dq's idle warpgroups (the last grid block's
  # query blocks past the end: before the first unit) and dk/dv's (after the last unit); a
  # closed form's parameters instead, or a placeholder.
  band = cfg.source.operand(offset_bias, q_len, k_len, lead=cfg.lead,
                            trail=cfg.k_ctas * groups - cfg.nk)
  # What every kernel reads: q, k, v, the band, segment ids [B, Lq_p] and [B, Lk_p], the
  # seed [1], lse and delta [B, H, Lq_p], do.
  inputs = (q, k, v, band, q_segments[:, :, 0], kv_segments[:, 0, :], jnp.reshape(seed, (1,)),
            lse[..., 0], delta[..., 0], do)
  dq = _backward_dq(cfg, inputs)
  dk, dv = _backward_dkv(cfg, inputs)
  if not has_bias:
    return dq, dk, dv, jnp.zeros((q.shape[1], 1, offset_bias.shape[-1]), jnp.float32)
  if closed is None:
    return dq, dk, dv, unit_gradient(_backward_dbias(cfg, inputs),
                                     offset_bias.shape[-1])[:, None, :]
  d_offsets = unit_gradient(_backward_dbias(cfg, inputs), q_len + k_len - 1)
  return dq, dk, dv, closed_gradient(closed, offset_bias, num_params, d_offsets, q_len)


def _cotangents(cfg, q_tile, k_tile, v_tile, do_tile, bias_tile, q_seg, k_seg, lse_rows,
                delta_rows, q0, k0, seed_value, b, h):
  """``(p, ds, i, j)`` of one 64 x 64 tile (float32, WGMMA layout): the probabilities as
  applied (dropped out), ``ds = P * (Z * dO v^T - delta)`` and the positions (None unless
  zero_first, causal or dropout needs them); the arguments as :func:`tile_logits`' and the
  tile's ``[64]`` rows of lse and delta."""
  tile = (BLOCK_Q, BLOCK_Q)
  s, valid, i, j = tile_logits(q_tile, k_tile, bias_tile, q_seg, k_seg, q0, k0, scale=cfg.scale,
                           causal=cfg.causal, zero_first=cfg.zero_first,
                           positions=bool(cfg.dropout_rate))
  p = jnp.where(valid, jnp.exp(s - lax.broadcast_in_dim(lse_rows, tile, [0])), 0.0)
  dp = product(do_tile, v_tile.T, tile)
  if cfg.dropout_rate:
    keep = dropout_multiplier(seed_value, b, h, i, j, cfg.dropout_rate)
    p_applied, dp = p * keep, dp * keep
  else:
    p_applied = p
  return p_applied, p * (dp - lax.broadcast_in_dim(delta_rows, tile, [0])), i, j


def _tile_spec(cfg, cols: int, index_map):
  """Pipeline block of 64 rows of a ``cols``-wide ``wgmma`` operand (q, k, v or do)."""
  plgpu = mosaic_gpu()
  return plgpu.BlockSpec((BLOCK_Q, cols), index_map, transforms=operand_transforms(cols, cfg.dtype))


def _row_spec(index_map):
  """Pipeline block of 64 entries of a row (segment ids, lse, delta)."""
  return mosaic_gpu().BlockSpec((BLOCK_Q,), index_map)


def _store(value: Array, buffer, target) -> None:
  """Copies ``value`` through the shared-memory ``buffer`` to ``target`` in global memory."""
  plgpu = mosaic_gpu()
  buffer[...] = value.astype(buffer.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(buffer, target)


def _zeros(cols: int) -> Array:
  """``[64, cols]`` float32 zeros in the WGMMA layout (an accumulator's start)."""
  plgpu = mosaic_gpu()
  return plgpu.layout_cast(jnp.zeros((BLOCK_Q, cols), jnp.float32), plgpu.Layout.WGMMA)


def _backward_call(cfg, kernel, inputs, blocks: int, out_type, scratch, name: str,
                   groups: int | None = None):
  """``kernel`` on :func:`backward`'s ``inputs`` over a ``(B, H, blocks)`` grid; ``groups``:
  consumer warpgroups (plus the memory one) per block of the grid, None for one warpgroup."""
  plgpu = mosaic_gpu()
  threads = {} if groups is None else dict(num_threads=groups + 1, thread_name="wg")
  return plgpu.kernel(kernel, out_type=out_type, scratch_types=scratch,
                      grid=(*inputs[0].shape[:2], blocks),
                      grid_names=("batch", "heads", "blocks"), **threads,
                      interpret=plgpu.InterpretGPUParams() if cfg.interpret else False,
                      kernel_name=name)(*inputs)


def _backward_dq(cfg, inputs) -> Array:
  """dq ``[B, H, Lq_p, Dqk_p]``: query blocks ``cta G + g`` (warpgroup g) against every key
  block, warp-specialised as the forward (each step copies a key block and, with a bias, a
  window of ``G`` band units)."""
  plgpu = mosaic_gpu()
  rows_layout, cols_layout = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
  groups, nq, qk_dim = cfg.groups, cfg.nq, cfg.qk_dim

  def kernel(q_ref, k_ref, v_ref, band_ref, qs_ref, ks_ref, seed_ref, lse_ref, delta_ref,
             do_ref, dq_ref, q_smem, do_smem, ds_smem, out_smem, barriers):
    b, h, cta, wg = (lax.axis_index(a) for a in ("batch", "heads", "blocks", "wg"))
    qi = cta * groups + wg
    live = qi < nq
    rows = pl.ds(jnp.minimum(qi, nq - 1) * BLOCK_Q, BLOCK_Q)  # idle: the last block's
    q_tile, do_tile, ds_tile = q_smem.at[wg], do_smem.at[wg], ds_smem.at[wg]

    def compute(pipeline):
      plgpu.copy_gmem_to_smem(q_ref.at[b, h, rows], q_tile, barriers.at[2 * wg])
      plgpu.copy_gmem_to_smem(do_ref.at[b, h, rows], do_tile, barriers.at[2 * wg + 1])
      loaded = tuple(plgpu.load(ref, layout=rows_layout, optimized=False)
                     for ref in (qs_ref.at[b, rows], lse_ref.at[b, h, rows],
                                 delta_ref.at[b, h, rows]))
      params = cfg.source.params(band_ref, h)
      plgpu.barrier_wait(barriers.at[2 * wg])
      plgpu.barrier_wait(barriers.at[2 * wg + 1])
      dq, *_ = pipeline((_zeros(qk_dim), *loaded, *params))

      @pl.when(live)
      def _():
        _store(dq * cfg.scale, out_smem.at[wg], dq_ref.at[b, h, rows])
        plgpu.wait_smem_to_gmem(0)

    def step(index, k_smem, v_smem, ks_smem, *rest):
      *t_smem, carry = rest
      kj = index[0]

      def attend(carry):
        dq, q_seg, lse_rows, delta_rows, *params = carry
        # Warpgroup g's unit is G - 1 - g into the step's window (as the forward's).
        bias = cfg.source.tile(lambda: t_smem[0].at[:, pl.ds((groups - 1 - wg) * BLOCK_Q, BLOCK_Q)],
                        params)
        _, ds, _, _ = _cotangents(cfg, q_tile, k_smem, v_smem, do_tile, bias, q_seg,
                                  plgpu.load(ks_smem, layout=cols_layout), lse_rows,
                                  delta_rows, qi * BLOCK_Q, kj * BLOCK_Q,
                                  seed_ref[0] if cfg.dropout_rate else None, b, h)
        ds_tile[...] = ds.astype(cfg.dtype)
        plgpu.commit_smem()
        return (dq + product(ds_tile, k_smem, (BLOCK_Q, qk_dim)), q_seg, lse_rows, delta_rows,
                *params)

      run = live & (kj <= qi) if cfg.causal else live  # causal: later key blocks masked whole
      return lax.cond(run, attend, lambda c: c, carry)

    specs = [_tile_spec(cfg, qk_dim, lambda kj: (kj, 0)),
             _tile_spec(cfg, cfg.v_dim, lambda kj: (kj, 0)), _row_spec(lambda kj: (kj,))]
    sources = [k_ref.at[b, h], v_ref.at[b, h], ks_ref.at[b]]
    if cfg.source.band_tiles:  # units kj + (ctas - 1 - cta) G + [0, G) of the band (after its lead)
      specs.append(window_spec(groups, lambda kj: kj + (cfg.q_ctas - 1 - cta) * groups))
      sources.append(band_ref.at[h])
    specialised_pipeline(step, specs, compute, steps=cfg.nk, groups=groups)(*sources)

  def tiles(cols):
    return warpgroup_buffers(groups, cols, cfg.dtype)

  return _backward_call(
      cfg, kernel, inputs, cfg.q_ctas, jax.ShapeDtypeStruct(inputs[0].shape, cfg.dtype),
      [tiles(qk_dim), tiles(cfg.v_dim), tiles(BLOCK_Q), tiles(qk_dim),
       plgpu.Barrier(num_barriers=2 * groups)], "relative_flash_dq_hopper", groups)


def _backward_dkv(cfg, inputs) -> tuple[Array, Array]:
  """dk ``[B, H, Lk_p, Dqk_p]`` and dv ``[B, H, Lk_p, Dv_p]``: key blocks ``cta G + g``
  (warpgroup g) against every query block, warp-specialised (``p^T dO`` and ``dS^T q`` from
  transposed shared-memory operands)."""
  plgpu = mosaic_gpu()
  rows_layout, cols_layout = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
  groups, nq, nk = cfg.groups, cfg.nq, cfg.nk
  qk_dim, v_dim = cfg.qk_dim, cfg.v_dim

  def kernel(q_ref, k_ref, v_ref, band_ref, qs_ref, ks_ref, seed_ref, lse_ref, delta_ref,
             do_ref, dk_ref, dv_ref, k_smem, v_smem, ks_smem, p_smem, ds_smem, dk_smem,
             dv_smem, barriers):
    b, h, cta, wg = (lax.axis_index(a) for a in ("batch", "heads", "blocks", "wg"))
    kj = cta * groups + wg
    live = kj < nk
    keys = pl.ds(jnp.minimum(kj, nk - 1) * BLOCK_Q, BLOCK_Q)  # idle: the last block's
    k_tile, v_tile, ks_tile = k_smem.at[wg], v_smem.at[wg], ks_smem.at[wg]
    p_tile, ds_tile = p_smem.at[wg], ds_smem.at[wg]

    def compute(pipeline):
      for n, (source, target) in enumerate(((k_ref.at[b, h, keys], k_tile),
                                            (v_ref.at[b, h, keys], v_tile),
                                            (ks_ref.at[b, keys], ks_tile))):
        plgpu.copy_gmem_to_smem(source, target, barriers.at[3 * wg + n])
      params = cfg.source.params(band_ref, h)
      for n in range(3):
        plgpu.barrier_wait(barriers.at[3 * wg + n])
      dk, dv, *_ = pipeline((_zeros(qk_dim), _zeros(v_dim),
                             plgpu.load(ks_tile, layout=cols_layout), *params))

      @pl.when(live)
      def _():
        _store(dk * cfg.scale, dk_smem.at[wg], dk_ref.at[b, h, keys])
        _store(dv, dv_smem.at[wg], dv_ref.at[b, h, keys])
        plgpu.wait_smem_to_gmem(0)

    def step(index, q_tile, do_tile, qs_smem, lse_smem, delta_smem, *rest):
      *t_smem, carry = rest
      qi = index[0]

      def attend(carry):
        dk, dv, k_seg, *params = carry
        # Warpgroup g's unit is g into the step's window.
        bias = cfg.source.tile(lambda: t_smem[0].at[:, pl.ds(wg * BLOCK_Q, BLOCK_Q)], params)
        q_seg, lse_rows, delta_rows = (plgpu.load(x, layout=rows_layout)
                                       for x in (qs_smem, lse_smem, delta_smem))
        p, ds, _, _ = _cotangents(cfg, q_tile, k_tile, v_tile, do_tile, bias, q_seg, k_seg,
                                  lse_rows, delta_rows, qi * BLOCK_Q, kj * BLOCK_Q,
                                  seed_ref[0] if cfg.dropout_rate else None, b, h)
        p_tile[...] = p.astype(cfg.dtype)
        ds_tile[...] = ds.astype(cfg.dtype)
        plgpu.commit_smem()
        return (dk + product(ds_tile.T, q_tile, (BLOCK_Q, qk_dim)),
                dv + product(p_tile.T, do_tile, (BLOCK_Q, v_dim)), k_seg, *params)

      run = live & (qi >= kj) if cfg.causal else live  # causal: earlier q blocks masked whole
      return lax.cond(run, attend, lambda c: c, carry)

    specs = [_tile_spec(cfg, qk_dim, lambda qi: (qi, 0)),
             _tile_spec(cfg, v_dim, lambda qi: (qi, 0))]
    specs += [_row_spec(lambda qi: (qi,))] * 3
    sources = [q_ref.at[b, h], do_ref.at[b, h], qs_ref.at[b], lse_ref.at[b, h],
               delta_ref.at[b, h]]
    if cfg.source.band_tiles:  # units cta G - qi + nq - 1 + [0, G) past the band's lead
      specs.append(window_spec(groups, lambda qi: cfg.lead + cta * groups - qi + nq - 1))
      sources.append(band_ref.at[h])
    specialised_pipeline(step, specs, compute, steps=nq, groups=groups)(*sources)

  def tiles(cols):
    return warpgroup_buffers(groups, cols, cfg.dtype)

  k, v = inputs[1:3]
  return _backward_call(
      cfg, kernel, inputs, cfg.k_ctas,
      (jax.ShapeDtypeStruct(k.shape, cfg.dtype), jax.ShapeDtypeStruct(v.shape, cfg.dtype)),
      [tiles(qk_dim), tiles(v_dim), plgpu.SMEM((groups, BLOCK_Q), jnp.int32), tiles(BLOCK_Q),
       tiles(BLOCK_Q), tiles(qk_dim), tiles(v_dim), plgpu.Barrier(num_barriers=3 * groups)],
      "relative_flash_dkv_hopper", groups)


def _backward_dbias(cfg, inputs) -> Array:
  """The bias gradient's units ``[B, H, nq + nk - 1, 64, 64]`` float32
  (:func:`~posenc_jax.kernels.band.unit_gradient` sums them into the offset vector's): one
  warpgroup per unit of the band (a diagonal of the tile grid), summing the logit cotangents
  of its (query block, key block) pairs in registers."""
  plgpu = mosaic_gpu()
  rows_layout, cols_layout = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
  nq, nk = cfg.nq, cfg.nk
  units = nq + nk - 1  # diagonals of the tile grid: unit kj - qi + nq - 1

  def kernel(q_ref, k_ref, v_ref, band_ref, qs_ref, ks_ref, seed_ref, lse_ref, delta_ref,
             do_ref, du_ref, t_smem, du_smem, barrier):
    b, h, n = (lax.axis_index(a) for a in ("batch", "heads", "blocks"))
    shift = n - (nq - 1)  # kj - qi on this unit
    if cfg.source.band_tiles:  # every tile of the unit reads its one unit of the band
      plgpu.copy_gmem_to_smem(band_ref.at[h, :, pl.ds((cfg.lead + n) * BLOCK_Q, BLOCK_Q)],
                              t_smem, barrier)
    params = cfg.source.params(band_ref, h)
    seed_value = seed_ref[0] if cfg.dropout_rate else None
    if cfg.source.band_tiles:
      plgpu.barrier_wait(barrier)

    def key_block(qi):  # clamped: steps off the grid load a block they do not use
      return jnp.clip(qi + shift, 0, nk - 1)

    def step(index, q_smem, do_smem, qs_smem, lse_smem, delta_smem, k_smem, v_smem, ks_smem,
             carry):
      qi = index[0]
      kj = qi + shift

      def attend(carry):
        du, *params = carry
        _, ds, i, j = _cotangents(
            cfg, q_smem, k_smem, v_smem, do_smem, cfg.source.tile(lambda: t_smem, params),
            plgpu.load(qs_smem, layout=rows_layout), plgpu.load(ks_smem, layout=cols_layout),
            *(plgpu.load(x, layout=rows_layout) for x in (lse_smem, delta_smem)),
            qi * BLOCK_Q, kj * BLOCK_Q, seed_value, b, h)
        if cfg.zero_first:  # the bias is zero there: no gradient reaches the vector
          ds = jnp.where((i == 0) | (j == 0), 0.0, ds)
        return du + ds, *params

      run = (kj >= 0) & (kj < nk)
      if cfg.causal:
        run = run & (kj <= qi)
      return lax.cond(run, attend, lambda c: c, carry)

    qk_dim, v_dim = cfg.qk_dim, cfg.v_dim
    specs = [_tile_spec(cfg, qk_dim, lambda qi: (qi, 0)),
             _tile_spec(cfg, v_dim, lambda qi: (qi, 0))]
    specs += [_row_spec(lambda qi: (qi,))] * 3
    specs += [_tile_spec(cfg, qk_dim, lambda qi: (key_block(qi), 0)),
              _tile_spec(cfg, v_dim, lambda qi: (key_block(qi), 0)),
              _row_spec(lambda qi: (key_block(qi),))]
    sources = [q_ref.at[b, h], do_ref.at[b, h], qs_ref.at[b], lse_ref.at[b, h],
               delta_ref.at[b, h], k_ref.at[b, h], v_ref.at[b, h], ks_ref.at[b]]
    du, *_ = plgpu.emit_pipeline(step, grid=(nq,), in_specs=specs,
                                 init_carry=(_zeros(BLOCK_Q), *params),
                                 max_concurrent_steps=min(STAGES, nq))(*sources)
    _store(du, du_smem, du_ref.at[b, h, n])
    plgpu.wait_smem_to_gmem(0)

  def tile():  # float32: no tiling or swizzle
    return plgpu.SMEM((BLOCK_Q, BLOCK_Q), jnp.float32, transforms=())

  b_size, heads = inputs[0].shape[:2]
  return _backward_call(
      cfg, kernel, inputs, units,
      jax.ShapeDtypeStruct((b_size, heads, units, BLOCK_Q, BLOCK_Q), jnp.float32),
      [tile(), tile(), plgpu.Barrier()], "relative_flash_dbias_hopper")
