"""The memory and block model of the Triton and Mosaic TPU kernels of
:func:`~posenc_jax.kernels.relative_flash.relative_flash_attention`: tile sizes, Triton's
warps and pipelining stages from the shapes and the chip's on-chip memory.

:func:`kernel_blocks` estimates each choice's shared memory (Triton: :func:`kernel_memory`,
fitted to what Triton asked for on an H100, jaxlib 0.11.2) or VMEM (Mosaic, unmeasured)
against the device's (:func:`memory_budget`) and picks the best that fits.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from posenc_jax.kernels.common import SMEM_BYTES
from posenc_jax.kernels.precision import dot_precision

TILES = ("gather", "band", "roll")  # how bias tiles are built (relative_flash's docstring)
_SMEM_MARGIN = 8 * 1024  # the model's slack: Triton versions allocate differently
# Scoped VMEM Mosaic gives a kernel by default on TPU v4 and v5 (v6e: 32 MiB); a quarter is
# left as margin, the VMEM model being unmeasured.
VMEM_BYTES = 16 * 2**20


@dataclasses.dataclass(frozen=True)
class KernelBlocks:
  """Tile sizes and launch settings of
  :func:`~posenc_jax.kernels.relative_flash.relative_flash_attention`'s kernels.

  Attributes:
    block_q, block_k: query / key rows of a tile, powers of two (``>= 16`` with gather
      tiles, ``>= 128`` with roll tiles).
    qk_dim, v_dim: widths q/k and v are zero-padded to (each a power of two ``>= 16``).
    num_warps, num_stages: Triton launch settings (``num_stages``: software-pipelining
      stages of the loads in the kernels' loops); None with roll tiles.
  """

  block_q: int
  block_k: int
  qk_dim: int
  v_dim: int
  num_warps: int | None = None
  num_stages: int | None = None


def gpu_compute_capability() -> str | None:
  """The CUDA compute capability of the first device (e.g. ``"9.0"``), None if not an NVIDIA
  GPU. Block choice here and cuDNN's fit (:func:`posenc_jax.attention.cudnn_unsupported`)
  read it."""
  return getattr(jax.devices()[0], "compute_capability", None)


def memory_budget(tiles: str = "gather", compute_capability: str | None = None) -> int:
  """Bytes of on-chip memory :func:`kernel_blocks` may plan for, a margin below the limit.

  Args:
    tiles: ``"gather"``: shared memory of a Triton program on the GPU of
      ``compute_capability`` (e.g. ``"9.0"``; :data:`~posenc_jax.kernels.common.SMEM_BYTES`);
      ``"roll"``: 3/4 of the default scoped VMEM of a TPU (:data:`VMEM_BYTES`).
    compute_capability: None reads it from ``jax.devices()[0]`` (a GPU's); an unknown one
      (or none: no GPU) gets the smallest GPU in :data:`~posenc_jax.kernels.common.SMEM_BYTES`.
  """
  if tiles == "roll":
    return VMEM_BYTES * 3 // 4
  if compute_capability is None:
    compute_capability = gpu_compute_capability()
  return SMEM_BYTES.get(compute_capability, min(SMEM_BYTES.values())) - _SMEM_MARGIN


def kernel_memory(blocks: KernelBlocks, *, q_len: int, k_len: int, itemsize: int,
                  has_bias: bool, tiles: str = "gather", precision: str = "float32") -> int:
  """Estimated on-chip bytes of the most demanding of the three kernels (forward, dq, dk/dv).

  ``gather`` (Triton): shared memory per program, see :func:`_triton_smem`. ``roll``
  (Mosaic): VMEM, see :func:`_mosaic_vmem`.

  Args:
    blocks: the tile sizes and settings.
    q_len, k_len: unpadded sequence lengths.
    itemsize: bytes per element of q, k and v.
    has_bias: whether an offset bias is built into the tiles.
    tiles: ``"gather"`` or ``"roll"``.
    precision: as :func:`~posenc_jax.kernels.relative_flash.relative_flash_attention`'s
      (exact float32 products take another path through Triton).
  """
  if tiles == "roll":
    return _mosaic_vmem(blocks, q_len, k_len, itemsize, has_bias)
  return _triton_smem(blocks, itemsize, has_bias, exact=itemsize == 4 and precision == "float32")


def kernel_blocks(q_len: int, k_len: int, qk_dim: int, v_dim: int, *, itemsize: int,
                  has_bias: bool, tiles: str = "gather", precision: str = "float32",
                  budget: int | None = None, block_q: int | None = None,
                  block_k: int | None = None) -> KernelBlocks:
  """Picks tile sizes and launch settings that fit on chip (:func:`kernel_memory`).

  Gather (Triton): 64 x 64 tiles, 4 warps, 2 pipelining stages where they fit (on an H100
  they beat 128-row tiles: BERT-base bf16 at L = 512 took 0.66 ms forward + backward with
  64 x 64, 0.70 / 0.96 / 1.07 ms with 128 x 64 / 64 x 128 / 128 x 128; at D = 128,
  L = 2048, 2.1 ms against 2.4-4.3); else the largest tiles down to 16 rows, 2 stages before
  1, squarer before longer. Roll (Mosaic): 256-row tiles where they add no padding to the
  128-multiple length and fit, else 128. Blocks never exceed the padded lengths. If nothing
  fits, the least demanding choice.

  Args:
    q_len, k_len: sequence lengths (unpadded).
    qk_dim, v_dim: head dims of q/k (terms folded in) and of v.
    itemsize: bytes per element of q, k and v.
    has_bias: whether an offset bias is built into the tiles.
    tiles: ``"gather"`` or ``"band"`` (Triton; band tiles are square) or ``"roll"``
      (Mosaic).
    precision: ``"float32"`` or ``"tensorfloat32"``
      (:func:`~posenc_jax.kernels.precision.dot_precision`).
    budget: bytes of on-chip memory; None gives :func:`memory_budget` of this device.
    block_q, block_k: fixed tile sizes (validated; gather ones clamped to the padded
      lengths), or None to choose.

  Returns:
    The :class:`KernelBlocks`.
  """
  if tiles not in TILES:
    raise ValueError(f"tiles: got {tiles!r}; allowed: {', '.join(TILES)}")
  if tiles == "band" and None not in (block_q, block_k) and block_q != block_k:
    raise ValueError(f"block_q, block_k: got {block_q}x{block_k}; band tiles are square")
  dot_precision(precision, jnp.float32)  # validates the name
  smallest = 128 if tiles == "roll" else 16
  for name, size in (("block_q", block_q), ("block_k", block_k)):
    if size is not None and (size < smallest or size & (size - 1)):
      raise ValueError(f"{name}: got {size}; expected a power of two >= {smallest} "
                       f"(tiles={tiles!r})")
  budget = memory_budget(tiles) if budget is None else budget
  widths = (max(16, next_pow2(qk_dim)), max(16, next_pow2(v_dim)))
  launches = [(None, None)] if tiles == "roll" else [(4, 2), (4, 1)]
  candidates = [KernelBlocks(bq, bk, *widths, *launch)
                for launch in launches
                for bq in _block_sizes(q_len, block_q, tiles)
                for bk in _block_sizes(k_len, block_k, tiles)
                if tiles != "band" or bq == bk]
  if not candidates:  # band: the clamped sizes differ (one length is short); square them
    side = min(_block_sizes(q_len, block_q, tiles) + _block_sizes(k_len, block_k, tiles))
    candidates = [KernelBlocks(side, side, *widths, *launch) for launch in launches]

  def memory(blocks):
    return kernel_memory(blocks, q_len=q_len, k_len=k_len, itemsize=itemsize,
                         has_bias=has_bias, tiles=tiles, precision=precision)

  fitting = [c for c in candidates if memory(c) <= budget]
  if not fitting:
    return min(candidates, key=memory)
  return max(fitting, key=lambda c: (c.num_stages or 0, min(c.block_q, c.block_k),
                                     c.block_q * c.block_k, c.block_q))


def _block_sizes(length: int, fixed: int | None, tiles: str) -> list[int]:
  """Candidate block sizes along a sequence of ``length``: ``fixed`` (gather: clamped to the
  padded length), else each size the chooser considers that does not overrun it."""
  if tiles == "roll":
    padded = round_up(length, 128)
    return [fixed] if fixed else [b for b in (256, 128) if padded % b == 0]
  longest = next_pow2(max(length, 16))
  return [min(fixed, longest)] if fixed else [b for b in (64, 32, 16) if b <= longest]


def _triton_smem(blocks: KernelBlocks, itemsize: int, has_bias: bool, exact: bool) -> int:
  """Shared memory (bytes) of the larger Triton backward kernel; the forward's tiles are a
  subset of dq's.

  Tiles, in bytes: ``Q = bq Dqk``, ``dO = bq Dv`` (the do rows), ``K = bk Dqk``,
  ``V = bk Dv`` at the inputs' itemsize, ``P = bq bk`` at that itemsize (a probability or
  cotangent tile converted for a product) and ``F = 4 bq bk`` (a float32 tile).

  * Tensor-core products (bfloat16/float16, TF32): dq holds ``Q + dO`` and, per pipelining
    stage ``S``, the ``K + V`` its loop loads, plus ``P`` (and ``2 F`` for the bias: its tile
    and diagonal sums); dk/dv holds ``K + V``, ``S (Q + dO)``, ``2 P`` (and ``F``).
  * Exact float32 products (FMA, no tensor cores): the four tiles once each, plus
    ``(S + bias) F``.

  Plus 1 KiB for small buffers. Fitted to the bytes XLA's Triton (jaxlib 0.11.2) asked for
  on an H100 in 13 configurations (32 to 128-row tiles, head dims 128 and 256, 1 and 2
  stages, with and without bias, bfloat16, TF32 and exact float32): an upper bound on the
  larger kernel of each, within 0.3 % in exact float32 and 4-8 % for 64- and 128-row
  tensor-core tiles, 12-49 % over where Triton takes other paths (TF32 with 32-row tiles or
  one stage). The TUPE kernels of the old defaults (float32, 64 x 64 tiles, q/k padded
  136 -> 256 and v with them to 256, 2 stages), which asked for up to 426752 bytes (TF32)
  and 312064 (exact) against the H100's 232448, are estimated at 443392 and 312320.
  """
  bq, bk, stages = blocks.block_q, blocks.block_k, blocks.num_stages
  q, do = bq * blocks.qk_dim * itemsize, bq * blocks.v_dim * itemsize
  k, v = bk * blocks.qk_dim * itemsize, bk * blocks.v_dim * itemsize
  p, f = bq * bk * itemsize, 4 * bq * bk
  if exact:
    return q + do + k + v + (stages + has_bias) * f + 1024
  dq = q + do + stages * (k + v) + p + 2 * f * has_bias
  dkv = k + v + stages * (q + do) + 2 * p + f * has_bias
  return max(dq, dkv) + 1024


def _mosaic_vmem(blocks: KernelBlocks, q_len: int, k_len: int, itemsize: int,
                 has_bias: bool) -> int:
  """VMEM (bytes) of the largest Mosaic kernel, not measured on a TPU.

  Every block of a ``pallas_call`` is double-buffered, in ``(8 or 16, 128)`` tiles (so a
  ``[L, 1]`` column takes ``L x 128`` words): the forward and dq hold a block of q (and do)
  and the whole k, v, key segment ids and offset bias; dk/dv a block of k, v and the whole
  q, do, query segment ids, lse and delta. Then float32 temporaries: accumulators, eight
  ``[bq, bk]`` tiles and four ``[bq, bq + bk]`` windows for the bias.
  """
  bq, bk, dqk, dv = blocks.block_q, blocks.block_k, blocks.qk_dim, blocks.v_dim
  lq, lk = round_up(q_len, bq), round_up(k_len, bk)
  window = window_width(bq, bk, "roll")
  loff = next_pow2(lq + lk - (bq + bk) + window)

  def vmem(rows, cols, size=4):
    return round_up(rows, 32 // size) * round_up(cols, 128) * size

  def rows(n, size=itemsize):  # n rows of q/do or of k/v (both widths)
    return vmem(n, dqk, size) + vmem(n, dv, size)

  bias = vmem(1, loff) * has_bias
  fwd = rows(bq) + rows(lk) + vmem(1, lk) + 2 * vmem(bq, 1) + bias
  dq = fwd + rows(bq) + 2 * vmem(bq, 1) + bias
  dkv = 2 * rows(bk) + rows(lq) + 3 * vmem(lq, 1) + vmem(1, bk) + bias
  temporaries = rows(max(bq, bk), 4) + 8 * vmem(bq, bk) + 4 * vmem(bq, window) * has_bias
  return 2 * max(fwd, dq, dkv) + temporaries


def window_width(block_q: int, block_k: int, tiles: str) -> int:
  """Width of the window of offsets a ``[block_q, block_k]`` tile touches: its
  ``block_q + block_k`` diagonals, widened to a power of two except with roll tiles."""
  width = block_q + block_k
  return width if tiles == "roll" else next_pow2(width)


def next_pow2(x: int) -> int:
  """The least power of two ``>= x`` (1 for ``x <= 1``)."""
  return 1 << max(0, (x - 1).bit_length())


def round_up(x: int, m: int) -> int:
  """``x`` rounded up to a multiple of ``m``."""
  return -(-x // m) * m
