"""The forward and backward passes of :func:`~posenc_jax.kernels.relative_flash_attention`
for Hopper GPUs.

Pallas' Mosaic GPU backend, warp-specialised: in each block of the grid a memory warpgroup
copies key, value and bias blocks into shared memory (TMA, two steps in flight) for ``G``
consumer warpgroups, each on its own 64-row query block, that run warpgroup matrix
multiplies (``wgmma``) and the online softmax. Sharing the copies among ``G`` query blocks
divides the key/value traffic per logit by ``G``.

The Triton forward builds each bias tile by a gather from the offset vector; Mosaic GPU has
no gather into a ``wgmma`` fragment, so here the tiles come from memory instead, from a band
of 64 shifted copies of the offset vector:

    band[h, r, c] = offset_bias[h, c - r + 63 - 64 * lead]        [H, 64, 64 N]

The bias of query block ``qi`` and 64 keys from ``64 kb`` is its 64 columns from
``64 (kb - qi + Lq / 64 - 1 + lead)``: every tile of every query block is a 64-aligned
window of the band, ``O(64 H L)`` floats built once per call by one gather, against
``O(H L^2)`` for a materialised bias. The ``G`` query blocks of a grid block are
consecutive, so at one key block their tiles overlap: each step copies one window of
``G + block_k / 64 - 1`` units of 64 columns (float32, as the Triton kernels' bias) and
warpgroup ``g`` reads its ``block_k`` columns from unit ``G - 1 - g``, adding them to the
logits in registers. Per logit that is ``4 (G + s - 1) / (G s)`` bytes of bias
(``s = block_k / 64``) and ``4 / G`` of keys and values at a head dim of 64.
``lead = G ceil(Lq / 64G) - Lq / 64`` pads the band for the last grid block's idle
warpgroups (they read the last query block and write nothing).

A closed-form bias (relative_flash's ``offset_fn``: ALiBi's, KERPLE's) needs no band: each
tile evaluates ``offset_fn.closed(params, j - i)`` from its positions, the head's parameters
loaded once per warpgroup and carried through the pipeline
(:class:`~posenc_jax.kernels.hopper_mosaic.ClosedBias`), in this forward and in the three
backward kernels; only the copies of keys and values remain. The parameters' gradient is the
offset vector's, from the same per-unit sums of dS, pulled back through the closed form over
the ``Lq + Lk - 1`` offsets (:func:`~posenc_jax.kernels.hopper_mosaic.closed_gradient`, one
small ``jax.vjp`` in XLA).

Everything else is the Triton forward's (same inputs, outputs and conventions, see
:mod:`posenc_jax.kernels.relative_flash`): key masks and packed segments through segment
ids, ``causal``, ``zero_first``, dropout from the same counter-based hash, empty rows
returning zeros with ``lse = 1e30``. Causal runs skip the MMAs of key blocks wholly past a
query block's last row (their copies still run: the pipeline's grid is static).

The backward pass (:func:`backward`, ``backward="hopper"``; else the Triton kernels read this
forward's ``lse``) is three kernels on 64 x 64 tiles of the same band: dq per query block,
dk/dv per key block (``p^T dO`` and ``dS^T q`` from transposed shared-memory operands), both
warp-specialised with two consumer warpgroups sharing the copies at head dims up to 64, and
the bias gradient per diagonal of the tile grid, whose tiles all read one unit of the band:
their logit cotangents are recomputed (two more products per tile) and summed in registers,
and the band's diagonals are summed outside, without a scatter
(:func:`~posenc_jax.kernels.band.band_gradient`). No kernel adds atomically.

Limits (:func:`fits`): 16-bit q/k/v, query blocks of 64 rows, key blocks of 64 or 128 rows,
head dims a multiple of 64, and shared memory for at least one consumer warpgroup
(:func:`smem_bytes`); the backward's: head dims up to 128, blocks multiples of 64
(:func:`backward_fits`). Tested
in Mosaic GPU's interpret mode on CPU (values, lse, gradients through the Triton backward
and through this one, one and two warpgroups) and lowered for CUDA; their speed is read
from ``python -m posenc_jax.benchmarks.routes`` on a Hopper GPU.

This module holds the forward and its limits; the backward's kernels are in
:mod:`posenc_jax.kernels.hopper_backward` (:func:`backward`, :func:`backward_fits` and
:func:`backward_warpgroups` are re-exported here), the pieces both passes share in
:mod:`posenc_jax.kernels.hopper_mosaic`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from posenc_jax.kernels.common import NEG, SMEM_BYTES
from posenc_jax.kernels.dropout import dropout_multiplier
from posenc_jax.kernels.hopper_backward import (BACKWARD_MAX_DIM, backward, backward_fits,
                                                backward_warpgroups)
from posenc_jax.kernels.hopper_mosaic import (BLOCK_Q, STAGES, TileBias, hopper_band,
                                              mosaic_gpu, operand_transforms, product,
                                              specialised_pipeline, tile_logits,
                                              warpgroup_buffers, window_spec)

Array = jax.Array

__all__ = [
    "BACKWARD_MAX_DIM", "BLOCK_KS", "BLOCK_Q", "MAX_WARPGROUPS", "SMEM_ALIGN", "SMEM_RESERVED",
    "backward", "backward_fits", "backward_warpgroups", "fits", "forward", "hopper_band",
    "max_warpgroups", "smem_bytes",
]

BLOCK_KS = (64, 128)
MAX_WARPGROUPS = 2  # consumer warpgroups per block of the grid
SMEM_ALIGN = 1024  # Mosaic GPU aligns each buffer to 1 KiB
SMEM_RESERVED = 3 * 1024  # the pipeline's barriers and Mosaic GPU's own (2.1 KiB measured)


def smem_bytes(*, warpgroups: int, block_k: int, qk_dim: int, v_dim: int, itemsize: int,
               has_bias: bool) -> int:
  """Shared memory of one block of the grid, at least Mosaic GPU's count when it lowers the
  kernel: ``STAGES`` key, value, key-segment and bias-window buffers, each consumer
  warpgroup's query, probability and output tiles (the output in the query's buffer when
  they are the same width) and lse row, each buffer aligned to ``SMEM_ALIGN``, and
  ``SMEM_RESERVED``."""
  rows = qk_dim + block_k + (0 if qk_dim == v_dim else v_dim)
  buffers = [STAGES * block_k * qk_dim * itemsize, STAGES * block_k * v_dim * itemsize,
             STAGES * block_k * 4, warpgroups * BLOCK_Q * rows * itemsize,
             warpgroups * BLOCK_Q * 4]
  if has_bias:
    buffers.append(STAGES * BLOCK_Q * (warpgroups + block_k // BLOCK_Q - 1) * BLOCK_Q * 4)
  return sum(-(-x // SMEM_ALIGN) * SMEM_ALIGN for x in buffers) + SMEM_RESERVED


def max_warpgroups(*, block_k: int, qk_dim: int, v_dim: int, itemsize: int,
                   has_bias: bool) -> int:
  """The most consumer warpgroups (up to ``MAX_WARPGROUPS``) whose buffers fit in a Hopper
  GPU's shared memory (``SMEM_BYTES["9.0"]``); 0 if not even one does."""
  return max((g for g in range(1, MAX_WARPGROUPS + 1)
              if smem_bytes(warpgroups=g, block_k=block_k, qk_dim=qk_dim, v_dim=v_dim,
                            itemsize=itemsize, has_bias=has_bias) <= SMEM_BYTES["9.0"]),
             default=0)


def fits(*, dtype, block_q: int, block_k: int, qk_dim: int, v_dim: int,
         has_bias: bool = True) -> bool:
  """Whether this forward takes these (padded) shapes: 16-bit inputs, ``block_q`` 64,
  ``block_k`` 64 or 128, both head dims multiples of 64, one warpgroup's buffers in shared
  memory."""
  dtype = jnp.dtype(dtype)
  return (dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
          and block_q == BLOCK_Q and block_k in BLOCK_KS
          and qk_dim % 64 == 0 and v_dim % 64 == 0
          and max_warpgroups(block_k=block_k, qk_dim=qk_dim, v_dim=v_dim,
                             itemsize=dtype.itemsize, has_bias=has_bias) > 0)


def forward(q: Array, k: Array, v: Array, offset_bias: Array, q_segments: Array,
            kv_segments: Array, seed: Array, *, block_k: int, scale: float, causal: bool,
            zero_first: bool, has_bias: bool, dropout_rate: float, interpret: bool,
            warpgroups: int | None = None, closed=None, num_params: int = 0
            ) -> tuple[Array, Array]:
  """Output and lse of the padded, head-major arrays of relative_flash's kernels.

  Args:
    q: ``[B, H, Lq_p, Dqk_p]``; k: ``[B, H, Lk_p, Dqk_p]``; v: ``[B, H, Lk_p, Dv_p]``.
    offset_bias: ``[H, 1, Loff_p]`` (read only with ``has_bias``); with ``closed``, the
      heads' parameters ``[H, 1, R_p]``.
    q_segments: ``[B, Lq_p, 1]`` and kv_segments ``[B, 1, Lk_p]`` int32 segment ids (masked
      keys and padding already given ids that match nothing).
    seed: ``[1, 1]`` int32 dropout seed.
    block_k, scale, causal, zero_first, dropout_rate: as relative_flash's.
    interpret: run in Mosaic GPU's interpret mode (CPU).
    warpgroups: consumer warpgroups per block of the grid (``G``, validated by the caller);
      None: the most that fit (:func:`max_warpgroups`).
    closed, num_params: a closed-form bias (relative_flash's ``offset_fn``) and its ``R``
      parameters per head, evaluated in the tiles (:class:`~posenc_jax.kernels.hopper_mosaic.
      ClosedBias`): no band is built or copied.

  Returns:
    ``out [B, H, Lq_p, Dv_p]`` in q's dtype and ``lse [B, H, Lq_p, 1]`` float32.
  """
  plgpu = mosaic_gpu()
  b_size, heads, q_len, qk_dim = q.shape
  k_len, v_dim = k.shape[2], v.shape[-1]
  dtype = q.dtype
  source = TileBias(has_bias, closed, num_params)
  groups = warpgroups or max_warpgroups(block_k=block_k, qk_dim=qk_dim, v_dim=v_dim,
                                        itemsize=dtype.itemsize, has_bias=source.band_tiles)
  nq, nk, units = q_len // BLOCK_Q, k_len // block_k, block_k // BLOCK_Q
  ctas = -(-nq // groups)
  idle = ctas * groups - nq  # warpgroups of the last block with no query block
  window = groups + units - 1  # bias units one step of a block reads
  # Without band tiles no band is made or copied: a closed form's parameters, or a
  # placeholder, keep the signature.
  band = source.operand(offset_bias, q_len, k_len, lead=idle)
  wgmma_layout, rows_layout = plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1)
  shape = (BLOCK_Q, block_k)

  def kernel(q_ref, k_ref, v_ref, band_ref, qs_ref, ks_ref, seed_ref, o_ref, lse_ref,
             q_smem, p_smem, lse_smem, q_barriers, *o_smem):
    b, h = lax.axis_index("batch"), lax.axis_index("heads")
    cta, wg = lax.axis_index("q_blocks"), lax.axis_index("wg")
    qi = cta * groups + wg  # this warpgroup's query block
    live = qi < nq
    q0 = jnp.minimum(qi, nq - 1) * BLOCK_Q  # an idle warpgroup reads the last block
    # The output tile reuses the query tile's buffer when they are the same width.
    q_tile, p_tile = q_smem.at[wg], p_smem.at[wg]
    o_tile = o_smem[0].at[wg] if o_smem else q_tile

    def compute(pipeline):
      plgpu.copy_gmem_to_smem(q_ref.at[b, h, pl.ds(q0, BLOCK_Q)], q_tile, q_barriers.at[wg])
      # Plain loads: jax 0.11's optimised transfers from global memory take no row layout.
      q_seg = plgpu.load(qs_ref.at[b, pl.ds(q0, BLOCK_Q)], layout=rows_layout, optimized=False)
      params = source.params(band_ref, h)
      plgpu.barrier_wait(q_barriers.at[wg])
      acc, m, l, *_ = pipeline((
          plgpu.layout_cast(jnp.zeros((BLOCK_Q, v_dim), jnp.float32), wgmma_layout),
          plgpu.layout_cast(jnp.full((BLOCK_Q,), NEG, jnp.float32), rows_layout),
          plgpu.layout_cast(jnp.zeros((BLOCK_Q,), jnp.float32), rows_layout), q_seg, *params))
      empty = l == 0.0
      l_safe = jnp.where(empty, 1.0, l)

      @pl.when(live)
      def _():
        o_tile[...] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(dtype)
        lse_smem.at[wg][...] = jnp.where(empty, -NEG, m + jnp.log(l_safe))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_tile, o_ref.at[b, h, pl.ds(q0, BLOCK_Q)])
        plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, h, pl.ds(q0, BLOCK_Q)])
        plgpu.wait_smem_to_gmem(0)

    def step(index, k_smem, v_smem, ks_smem, *rest):
      *t_smem, carry = rest  # the bias window, with a bias
      kj = index[0]
      run = live
      if causal:
        # A key block past the query block's last row is masked whole (p = 0, alpha = 1:
        # the carry would come out unchanged), so its MMAs are skipped; its copies still
        # happen, the pipeline's grid being static.
        run = run & (kj * block_k < q0 + BLOCK_Q)
      if not causal and not idle:
        return attend(kj, k_smem, v_smem, ks_smem, t_smem, carry)
      return lax.cond(run, lambda c: attend(kj, k_smem, v_smem, ks_smem, t_smem, c),
                      lambda c: c, carry)

    def attend(kj, k_smem, v_smem, ks_smem, t_smem, carry):
      """One key block's update of the online softmax ``(acc, m, l)``; the query block's
      segment ids and a closed form's parameters ride along in the carry unchanged."""
      acc, m, l, q_seg, *params = carry
      # Warpgroup g's bias tile starts (G - 1 - g) units into the step's window.
      bias = source.tile(lambda: t_smem[0].at[:, pl.ds((groups - 1 - wg) * BLOCK_Q, block_k)],
                         params)
      s, valid, i, j = tile_logits(q_tile, k_smem, bias, q_seg,
                               plgpu.load(ks_smem, layout=plgpu.Layout.WGMMA.reduce(0)), q0,
                               kj * block_k, scale=scale, causal=causal, zero_first=zero_first,
                               positions=bool(dropout_rate))
      m_new = jnp.maximum(m, s.max(axis=1))
      p = jnp.where(valid, jnp.exp(s - lax.broadcast_in_dim(m_new, shape, [0])), 0.0)
      alpha = jnp.exp(m - m_new)
      l_new = l * alpha + p.sum(axis=1)  # the normaliser sums every probability
      if dropout_rate:
        p = p * dropout_multiplier(seed_ref[0], b, h, i, j, dropout_rate)

      p_tile[...] = p.astype(dtype)
      plgpu.commit_smem()
      pv = product(p_tile, v_smem, (BLOCK_Q, v_dim))
      return (acc * lax.broadcast_in_dim(alpha, pv.shape, [0]) + pv, m_new, l_new, q_seg,
              *params)

    specs = [plgpu.BlockSpec((block_k, qk_dim), lambda kj: (kj, 0),
                             transforms=operand_transforms(qk_dim, dtype)),
             plgpu.BlockSpec((block_k, v_dim), lambda kj: (kj, 0),
                             transforms=operand_transforms(v_dim, dtype)),
             plgpu.BlockSpec((block_k,), lambda kj: (kj,))]
    sources = [k_ref.at[b, h], v_ref.at[b, h], ks_ref.at[b]]
    if source.band_tiles:
      # The step's window: units first + kj * s + [0, G + s - 1) of the band (hopper_band).
      specs.append(window_spec(window, lambda kj: (ctas - 1 - cta) * groups + kj * units))
      sources.append(band_ref.at[h])
    specialised_pipeline(step, specs, compute, steps=nk, groups=groups)(*sources)

  def tile(cols):
    return warpgroup_buffers(groups, cols, dtype)

  out, lse = plgpu.kernel(
      kernel,
      out_type=(jax.ShapeDtypeStruct((b_size, heads, q_len, v_dim), dtype),
                jax.ShapeDtypeStruct((b_size, heads, q_len), jnp.float32)),
      scratch_types=[tile(qk_dim), tile(block_k), plgpu.SMEM((groups, BLOCK_Q), jnp.float32),
                     plgpu.Barrier(num_barriers=groups)]
      + ([] if qk_dim == v_dim else [tile(v_dim)]),
      grid=(b_size, heads, ctas), grid_names=("batch", "heads", "q_blocks"),
      num_threads=groups + 1, thread_name="wg",
      interpret=plgpu.InterpretGPUParams() if interpret else False,
      kernel_name="relative_flash_fwd_hopper",
  )(q, k, v, band, q_segments[:, :, 0], kv_segments[:, 0, :], jnp.reshape(seed, (1,)))
  return out, lse[..., None]
