"""The forward pass of :func:`~posenc_jax.kernels.relative_flash_attention` for Hopper GPUs.

Pallas' Mosaic GPU backend: warpgroup matrix multiplies (``wgmma``) on operands that TMA
copies into shared memory, pipelined over key blocks (:func:`plgpu.emit_pipeline`, two
steps in flight), one warpgroup per 64-row query block. The Triton forward builds each bias
tile by a gather from the offset vector; Mosaic GPU has no gather into a ``wgmma``
fragment, so here the tiles come from memory instead:

    tiles[h, n, r, c] = offset_bias[h, n * 64 + c - r + 63]       [H, N, 64, block_k]

A tile of query block ``qi`` and key block ``kj`` depends only on ``kj * block_k - qi * 64``,
so the ``N = (Lk - block_k) / 64 + Lq / 64`` distinct tiles (one per 64-row step of that
offset) cover every tile of every query block: ``O(H L block_k)`` floats built once per
call by one gather, against ``O(H L^2)`` for a materialised bias. Each pipeline step
copies its tile next to the key and value blocks (TMA) and adds it to the logits in
registers. The tiles are float32, as the Triton kernels' bias.

Everything else is the Triton forward's (same inputs, outputs and conventions, see
:mod:`posenc_jax.kernels.relative_flash`): key masks and packed segments through segment
ids, ``causal``, ``zero_first``, dropout from the same counter-based hash, empty rows
returning zeros with ``lse = 1e30``. Causal runs skip the MMAs of key blocks wholly past a
query block's last row (their copies still run: the pipeline's grid is static). The backward
pass stays the Triton kernels', which read this ``lse``.

Limits (:func:`fits`): 16-bit q/k/v, query blocks of 64 rows, key blocks of 64 or 128 rows,
head dims a multiple of 64. Tested in Mosaic GPU's interpret mode on CPU (values, lse,
gradients through the Triton backward) and lowered for CUDA; its speed is read from
``python -m posenc_jax.bench --attention`` on a Hopper GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from posenc_jax.kernels.dropout import dropout_multiplier

Array = jax.Array

BLOCK_Q = 64  # one warpgroup's wgmma rows
BLOCK_KS = (64, 128)
# Finite "minus infinity" for masked logits (avoids inf - inf); empty rows get lse = -NEG.
# Both forwards and the Triton backward use it (relative_flash reads it from here).
NEG = -1e30


def fits(*, dtype, block_q: int, block_k: int, qk_dim: int, v_dim: int) -> bool:
  """Whether this forward takes these (padded) shapes: 16-bit inputs, ``block_q`` 64,
  ``block_k`` 64 or 128, both head dims multiples of 64."""
  return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
          and block_q == BLOCK_Q and block_k in BLOCK_KS
          and qk_dim % 64 == 0 and v_dim % 64 == 0)


def bias_tiles(offset_bias: Array, q_len: int, k_len: int, block_k: int) -> Array:
  """``[H, N, 64, block_k]`` float32 tiles (module docstring) of the padded offset vector.

  Args:
    offset_bias: ``[H, 1, Loff_p]``, offset ``o = j - i + q_len - 1`` (relative_flash's).
    q_len, k_len: padded lengths, multiples of 64 and of ``block_k``.
    block_k: key block rows.
  """
  n = (k_len - block_k) // BLOCK_Q + q_len // BLOCK_Q
  index = (BLOCK_Q * jnp.arange(n)[:, None, None] + jnp.arange(block_k)[None, None, :]
           - jnp.arange(BLOCK_Q)[None, :, None] + BLOCK_Q - 1)
  return offset_bias[:, 0, :][:, index].astype(jnp.float32)


def _mosaic_gpu():
  """Pallas' Mosaic GPU module, imported on first use (0.3 s: kept out of
  ``import posenc_jax``)."""
  from jax.experimental.pallas import mosaic_gpu
  return mosaic_gpu


def _transforms(cols: int, dtype) -> tuple:
  """Shared-memory tiling and swizzle of a ``wgmma`` operand ``cols`` wide."""
  plgpu = _mosaic_gpu()
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = plgpu.find_swizzle(cols * itemsize * 8)
  return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def forward(q: Array, k: Array, v: Array, offset_bias: Array, q_segments: Array,
            kv_segments: Array, seed: Array, *, block_k: int, scale: float, causal: bool,
            zero_first: bool, has_bias: bool, dropout_rate: float,
            interpret: bool) -> tuple[Array, Array]:
  """Output and lse of the padded, head-major arrays of relative_flash's kernels.

  Args:
    q: ``[B, H, Lq_p, Dqk_p]``; k: ``[B, H, Lk_p, Dqk_p]``; v: ``[B, H, Lk_p, Dv_p]``.
    offset_bias: ``[H, 1, Loff_p]`` (read only with ``has_bias``).
    q_segments: ``[B, Lq_p, 1]`` and kv_segments ``[B, 1, Lk_p]`` int32 segment ids (masked
      keys and padding already given ids that match nothing).
    seed: ``[1, 1]`` int32 dropout seed.
    block_k, scale, causal, zero_first, dropout_rate: as relative_flash's.
    interpret: run in Mosaic GPU's interpret mode (CPU).

  Returns:
    ``out [B, H, Lq_p, Dv_p]`` in q's dtype and ``lse [B, H, Lq_p, 1]`` float32.
  """
  plgpu = _mosaic_gpu()
  b_size, heads, q_len, qk_dim = q.shape
  k_len, v_dim = k.shape[2], v.shape[-1]
  nq, nk = q_len // BLOCK_Q, k_len // block_k
  dtype = q.dtype
  # Without a bias no tiles are made or copied (a [1] placeholder keeps the signature).
  tiles = (bias_tiles(offset_bias, q_len, k_len, block_k) if has_bias
           else jnp.zeros((1,), jnp.float32))
  wgmma_layout, rows_layout = plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1)
  shape = (BLOCK_Q, block_k)

  def kernel(q_ref, k_ref, v_ref, t_ref, qs_ref, ks_ref, seed_ref, o_ref, lse_ref,
             q_smem, o_smem, p_smem, barrier):
    b, h, qi = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("q_blocks")
    q0 = qi * BLOCK_Q
    plgpu.copy_gmem_to_smem(q_ref.at[b, h, pl.ds(q0, BLOCK_Q)], q_smem, barrier)
    q_seg = plgpu.load(qs_ref.at[b, pl.ds(q0, BLOCK_Q)], layout=rows_layout)
    seed_value = seed_ref[0] if dropout_rate else None
    plgpu.barrier_wait(barrier)
    first_tile = nq - 1 - qi

    def step(index, k_smem, v_smem, ks_smem, *rest):
      *t_smem, carry = rest  # the bias tile's buffer, with a bias
      kj = index[0]
      if not causal:
        return attend(kj, k_smem, v_smem, ks_smem, t_smem, carry)
      # Causal: a key block past the query block's last row is masked whole (p = 0, alpha =
      # 1: the carry would come out unchanged), so its MMAs are skipped. The pipeline's grid
      # is static: its copies still happen.
      return lax.cond(kj * block_k < q0 + BLOCK_Q,
                      lambda c: attend(kj, k_smem, v_smem, ks_smem, t_smem, c),
                      lambda c: c, carry)

    def attend(kj, k_smem, v_smem, ks_smem, t_smem, carry):
      """One key block's update of the online softmax ``(acc, m, l)``."""
      acc, m, l = carry

      def logits(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, k_smem.T)
        return acc_ref[...]

      s = pl.run_scoped(logits, plgpu.ACC(shape, jnp.float32)) * scale
      if zero_first or causal or dropout_rate:  # the tile's query and key positions
        i = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=wgmma_layout) + q0
        j = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=wgmma_layout) + kj * block_k
      if has_bias:
        bias = plgpu.load(t_smem[0], layout=wgmma_layout)
        if zero_first:
          bias = jnp.where((i == 0) | (j == 0), 0.0, bias)
        s = s + bias
      k_seg = plgpu.load(ks_smem, layout=plgpu.Layout.WGMMA.reduce(0))
      valid = lax.broadcast_in_dim(q_seg, shape, [0]) == lax.broadcast_in_dim(k_seg, shape, [1])
      if causal:
        valid = valid & (j <= i)
      s = jnp.where(valid, s, NEG)
      m_new = jnp.maximum(m, s.max(axis=1))
      p = jnp.where(valid, jnp.exp(s - lax.broadcast_in_dim(m_new, shape, [0])), 0.0)
      alpha = jnp.exp(m - m_new)
      l_new = l * alpha + p.sum(axis=1)  # the normaliser sums every probability
      if dropout_rate:
        p = p * dropout_multiplier(seed_value, b, h, i, j, dropout_rate)
      p_smem[...] = p.astype(dtype)
      plgpu.commit_smem()

      def values(acc_ref):
        plgpu.wgmma(acc_ref, p_smem, v_smem)
        return acc_ref[...]

      pv = pl.run_scoped(values, plgpu.ACC((BLOCK_Q, v_dim), jnp.float32))
      return acc * lax.broadcast_in_dim(alpha, pv.shape, [0]) + pv, m_new, l_new

    init = (plgpu.layout_cast(jnp.zeros((BLOCK_Q, v_dim), jnp.float32), wgmma_layout),
            plgpu.layout_cast(jnp.full((BLOCK_Q,), NEG, jnp.float32), rows_layout),
            plgpu.layout_cast(jnp.zeros((BLOCK_Q,), jnp.float32), rows_layout))
    steps = block_k // BLOCK_Q
    specs = [plgpu.BlockSpec((block_k, qk_dim), lambda kj: (kj, 0),
                             transforms=_transforms(qk_dim, dtype)),
             plgpu.BlockSpec((block_k, v_dim), lambda kj: (kj, 0),
                             transforms=_transforms(v_dim, dtype)),
             plgpu.BlockSpec((block_k,), lambda kj: (kj,))]
    sources = [k_ref.at[b, h], v_ref.at[b, h], ks_ref.at[b]]
    if has_bias:
      specs.append(plgpu.BlockSpec((None,) + shape, lambda kj: (first_tile + kj * steps, 0, 0)))
      sources.append(t_ref.at[h])
    pipeline = plgpu.emit_pipeline(step, grid=(nk,), in_specs=specs, max_concurrent_steps=2,
                                   init_carry=init)
    acc, m, l = pipeline(*sources)
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    o_smem[...] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, h, pl.ds(q0, BLOCK_Q)])
    plgpu.store(lse_ref.at[b, h, pl.ds(q0, BLOCK_Q)],
                jnp.where(empty, -NEG, m + jnp.log(l_safe)))
    plgpu.wait_smem_to_gmem(0)

  out, lse = plgpu.kernel(
      kernel,
      out_type=(jax.ShapeDtypeStruct((b_size, heads, q_len, v_dim), dtype),
                jax.ShapeDtypeStruct((b_size, heads, q_len), jnp.float32)),
      scratch_types=[plgpu.SMEM((BLOCK_Q, qk_dim), dtype, transforms=_transforms(qk_dim, dtype)),
                     plgpu.SMEM((BLOCK_Q, v_dim), dtype, transforms=_transforms(v_dim, dtype)),
                     plgpu.SMEM(shape, dtype, transforms=_transforms(block_k, dtype)),
                     plgpu.Barrier()],
      grid=(b_size, heads, nq), grid_names=("batch", "heads", "q_blocks"),
      interpret=plgpu.InterpretGPUParams() if interpret else False,
      kernel_name="relative_flash_fwd_hopper",
  )(q, k, v, tiles, q_segments[:, :, 0], kv_segments[:, 0, :], jnp.reshape(seed, (1,)))
  return out, lse[..., None]
