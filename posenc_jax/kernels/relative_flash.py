"""Flash attention that builds Toeplitz (relative) biases inside the kernel.

A relative-position bias depends on the query/key positions only through the
offset ``rel = j - i`` (key minus query position, as
:func:`posenc_jax.terms.relative_offsets`). For ``Lq`` queries and ``Lk`` keys
there are ``Lq + Lk - 1`` offsets, so the whole bias of a head is one vector

    offset_bias[h, o],   o = rel + Lq - 1 in [0, Lq + Lk - 1)

(:func:`posenc_jax.terms.offsets` lists the ``rel`` of each ``o``). A scheme turns its small
table into that vector outside the kernel (DIET-REL: a clipped gather, T5: a
bucket gather, ALiBi: slope times distance; see
:meth:`posenc_jax.terms.Toeplitz.offset_values`), which costs ``O(H L)``, and
:func:`relative_flash_attention` computes

    out[b, i, h] = sum_j softmax_j(scale * q_i . k_j + offset_bias[h, j - i + Lq - 1]) v_j

with an online (flash) softmax blocked over queries and keys. Each
``[block_q, block_k]`` bias tile is built inside the kernel from the
vector, so no ``[B, H, L, L]`` or ``[H, L, L]`` array is ever materialised,
in the forward or the backward pass. The backward pass returns the vector's
gradient: each logit-cotangent tile is summed along its diagonals
(``O(block_q (block_q + block_k))`` per tile) into the offsets it covers;
JAX then carries that gradient back through the scheme's gather to its table.

A separable term (``row_bias [B, H, Lq]``, ``col_bias [B, H, Lk]``: logit ``(i, j)`` gets
``row_bias[i] + col_bias[j]``, the forgetting gates' ``c_i - c_j``) is read per tile as a
``[bq, 1]`` column and a ``[1, bk]`` row and added in float32 whatever q's dtype; the
backward returns its gradients ``sum_j dS_ij`` (the query-block kernel) and ``sum_i dS_ij``
(the key-block kernel). The Hopper passes take none.

A closed-form bias (``offset_fn``, ``offset_params``: ALiBi's ``-m_h |j - i|``, KERPLE's
``-r1 log(1 + r2 |j - i|)`` and ``-r1 |j - i|^r2``) is not turned into a vector at all: each
tile is ``offset_fn.closed(params_h, j - i)``, computed from the tile's positions (iotas) and the
head's few parameters, so no kernel reads an offset vector or a band, and nothing of size
``L`` is built. The parameters' gradient is, per tile, the reduction ``sum_ij dS_ij
d offset_fn / d params`` (``jax.vjp`` of the function in the tile), accumulated in registers
by the query-block kernel into one ``[R_p]`` row per (example, head, query block) and summed
outside; no atomics, no ``[H, 2L - 1]`` or ``[L, L]`` array. The Hopper passes take none yet.

Masking: ``q_segment_ids [B, Lq]`` and ``kv_segment_ids [B, Lk]`` (packed
sequences: a query sees only keys of its own segment), a ``mask [B, Lk]`` of
keys (True = attend), and ``causal`` (``j > i`` masked, top-left aligned as
:func:`posenc_jax.attention.attend`). ``zero_first`` zeroes the bias in row 0
and column 0 (TUPE-R's [CLS] reset). A query row whose keys are *all* masked
returns zeros (the materialised reference averages every value uniformly
there instead).

Dropout (``dropout_rate``, ``dropout_seed``): each probability tile is
multiplied by ``keep / (1 - rate)`` drawn from a counter-based hash of
(seed, batch, head, i, j) (:mod:`posenc_jax.kernels.dropout`); the softmax
normaliser sums the undropped probabilities, and the backward kernels draw
the same tiles again (``dP = Z * dO V^T``, ``dV = (Z * P)^T dO``), so no mask
is stored and the reference route, drawing the same hash, agrees exactly.

Three ways of building tiles (``tiles``), all exact and all tested in
interpret mode on CPU (``interpret=None`` picks it on the CPU backend):

* ``gather`` (GPU, Pallas' Triton backend): the tile is an in-kernel gather
  ``ob[j - i + Lq_p - 1]``; its gradient goes through a ``[bq, bk]`` scratch
  read back skewed (one diagonal per column), in a window of ``bq + bk``
  diagonals widened to a power of two. Every in-kernel array has a
  power-of-two size, square tiles or not: block sizes are powers of two, the
  q/k and v head dims (each to its own width) and the offset vector are
  zero-padded to powers of two.
* ``band`` (GPU, Triton; square tiles): no gather in any kernel. The kernels read
  tiles as column blocks of a band of ``bq`` shifted copies of the vector
  (:mod:`posenc_jax.kernels.band`, ``[H, bq, Loff_p]``, one gather per call outside).
  The gradient: tiles of one diagonal of the tile grid read the same columns, so a
  fourth kernel, one program per such diagonal, recomputes their logit cotangents
  (two more products per tile) and sums them in registers; the band's diagonals are
  summed outside, scatter-free. Which of the two Triton ways is faster is for
  ``python -m posenc_jax.benchmarks.routes`` to tell on the GPU at hand.
* ``roll`` (TPU, Pallas' Mosaic backend, which has no gather): blocks are
  multiples of 128, so each tile's window of ``bq + bk`` offsets is a
  lane-aligned slice; broadcast to the rows and rotated by one strided roll
  (row ``r`` by ``bk + 1 + r``) it is the tile. The gradient rolls the
  zero-padded cotangent tile back and sums its rows.

``forward="hopper"`` and ``backward="hopper"`` run the forward and the backward pass on
Hopper GPUs through Pallas' Mosaic GPU backend instead
(:mod:`posenc_jax.kernels.hopper_flash`), each on its own.

Tile sizes, Triton's warps and pipelining stages come from
:func:`~posenc_jax.kernels.blocks.kernel_blocks`, which estimates each choice's shared memory
(Triton) or VMEM (Mosaic) against the device's (:func:`~posenc_jax.kernels.blocks.memory_budget`).
Float32 inputs are multiplied exactly unless ``precision="tensorfloat32"``
(:func:`~posenc_jax.kernels.precision.dot_precision`).

Both lower for their accelerator without one (``jax.export``, tested). The gather
kernels ran on an H100 (jaxlib 0.11.2): the shared-memory model is fitted to
what Triton asked for there, and exact float32 matched a float64 reference to
4e-7 (TF32: 1.5e-4). The roll kernels have not run on a TPU.

The tile math and the Pallas kernels are in :mod:`posenc_jax.kernels.relative_kernels`; this
module holds their static settings (``_Config``), the ``pallas_call`` wrappers, the custom
VJP and the public entry.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plt

from posenc_jax.kernels import hopper_flash
from posenc_jax.kernels.band import bias_band, unit_gradient
from posenc_jax.kernels.blocks import (KernelBlocks, kernel_blocks, next_pow2, round_up,
                                       window_width)
from posenc_jax.kernels.common import SMEM_BYTES
from posenc_jax.kernels.relative_kernels import (dbias_kernel, dkv_kernel, dq_kernel,
                                                 fwd_kernel)

Array = jax.Array

_Q_PAD, _K_PAD = -2, -1  # segment ids of padded query rows / masked keys: never equal


@dataclasses.dataclass(frozen=True)
class _Config:
  """Static kernel settings; lengths are the padded ones unless named otherwise."""

  has_bias: bool
  tiles: str  # "gather" or "band" (Triton, interpret) or "roll" (Mosaic, interpret)
  zero_first: bool
  causal: bool
  scale: float
  precision: str  # "float32" (exact float32 products) or "tensorfloat32"
  dropout_rate: float
  blocks: KernelBlocks
  q_len: int  # Lq_p
  k_len: int  # Lk_p
  interpret: bool
  forward: str = "tiles"  # "tiles" (relative_kernels.fwd_kernel) or "hopper"
  warpgroups: int | None = None  # the Hopper forward's consumer warpgroups (None: most that fit)
  backward: str = "tiles"  # "tiles" (relative_kernels' backward kernels) or "hopper"
  separable: bool = False  # a row and a column vector added to every logit (r_i + s_j)
  closed: Any = None  # a closed-form offset function, its .closed(params, rel) in the tiles
  num_params: int = 0  # R: the closed form's parameters per head

  @property
  def compiler_params(self):
    if self.interpret:
      return None
    if self.tiles == "roll":
      return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))
    return plt.CompilerParams(num_warps=self.blocks.num_warps,
                              num_stages=self.blocks.num_stages)

  @property
  def reads_band(self) -> bool:
    """Whether the Triton kernels read bias tiles from a band (:func:`_band`)."""
    return self.has_bias and self.tiles == "band" and self.closed is None

  @property
  def window(self) -> int:
    """Width of a tile's window of offsets: its ``bq + bk`` diagonals, widened to a power of
    two with gather tiles (Triton's arrays; the extra columns hold no diagonal of the tile)."""
    return window_width(self.blocks.block_q, self.blocks.block_k, self.tiles)

  @property
  def offset_len(self) -> int:
    """``Loff_p``: the padded offset vector's length, a power of two long enough for every
    offset (``Lq_p + Lk_p - 1``) and for the last tile's whole window; with a closed form,
    ``R_p``, R padded to a power of two (the ref holds the head's parameters)."""
    if self.closed is not None:
      return next_pow2(self.num_params)
    bq, bk = self.blocks.block_q, self.blocks.block_k
    return next_pow2(self.q_len + self.k_len - (bq + bk) + self.window)

  def window_start(self, qi, kj):
    """Offset index (in the padded vector) of the first diagonal a tile touches.

    Column ``w`` of a tile's window holds ``rel = kj*bk - qi*bq + w - (bq - 1)``,
    i.e. vector entry ``window_start + w``; the window has ``self.window`` entries.
    With roll tiles it is a multiple of 128 (lane-aligned), and says so to Mosaic.
    """
    bq, bk = self.blocks.block_q, self.blocks.block_k
    start = kj * bk - qi * bq + self.q_len - bq
    return pl.multiple_of(start, 128) if self.tiles == "roll" else start


# ---------------------------------------------------------------------------
# pallas_call wrappers on padded, head-major arrays: q [B, H, Lq_p, Dqk_p], k [B, H, Lk_p,
# Dqk_p], v [B, H, Lk_p, Dv_p], out/do [B, H, Lq_p, Dv_p], offset bias [H, 1, Loff_p], query
# segment ids [B, Lq_p, 1], key segment ids [B, 1, Lk_p], the separable term's row vector
# [B, H, Lq_p, 1] and column vector [B, H, 1, Lk_p], lse/delta [B, H, Lq_p, 1] float32.


class _Specs(NamedTuple):
  """BlockSpecs of one grid (see :func:`_specs`)."""

  q: pl.BlockSpec
  k: pl.BlockSpec
  v: pl.BlockSpec
  out: pl.BlockSpec  # out and do
  offset_bias: pl.BlockSpec
  q_segments: pl.BlockSpec
  kv_segments: pl.BlockSpec
  col: pl.BlockSpec  # the separable term's column vector
  seed: pl.BlockSpec
  row: pl.BlockSpec  # lse, delta and the separable term's row vector

  @property
  def inputs(self):
    """Specs of the backward kernels' inputs (q, k, v, ob, qseg, kseg, row, col, seed, do,
    lse, delta); the forward takes the first nine."""
    return [self.q, self.k, self.v, self.offset_bias, self.q_segments, self.kv_segments,
            self.row, self.col, self.seed, self.out, self.row, self.row]


def _specs(cfg, *, over: str) -> _Specs:
  """BlockSpecs for a grid ``(B, H, n)``: ``over`` ``"queries"`` (program ``n`` gets query
  block ``n`` and every key), ``"keys"`` (key block ``n``, every query) or ``"units"``
  (every query and key: :func:`dbias_kernel`)."""
  q_rows = cfg.blocks.block_q if over == "queries" else cfg.q_len
  k_rows = cfg.blocks.block_k if over == "keys" else cfg.k_len

  def q_block(n):
    return n if over == "queries" else 0

  def k_block(n):
    return n if over == "keys" else 0

  def q_spec(width):
    return pl.BlockSpec((None, None, q_rows, width), lambda b, h, n: (b, h, q_block(n), 0))

  def k_spec(width):
    return pl.BlockSpec((None, None, k_rows, width), lambda b, h, n: (b, h, k_block(n), 0))

  qk_dim, v_dim = cfg.blocks.qk_dim, cfg.blocks.v_dim
  bias_rows = cfg.blocks.block_q if cfg.reads_band else 1  # the band, else the vector
  return _Specs(
      q=q_spec(qk_dim), k=k_spec(qk_dim), v=k_spec(v_dim), out=q_spec(v_dim),
      offset_bias=pl.BlockSpec((None, bias_rows, cfg.offset_len), lambda b, h, n: (h, 0, 0)),
      q_segments=pl.BlockSpec((None, q_rows, 1), lambda b, h, n: (b, q_block(n), 0)),
      kv_segments=pl.BlockSpec((None, 1, k_rows), lambda b, h, n: (b, 0, k_block(n))),
      col=pl.BlockSpec((None, None, 1, k_rows), lambda b, h, n: (b, h, 0, k_block(n))),
      seed=pl.BlockSpec((1, 1), lambda b, h, n: (0, 0)), row=q_spec(1))


def _forward(cfg, q, k, v, ob, qseg, kseg, row, col, seed):
  if cfg.forward == "hopper":  # the Hopper kernels take no separable term (_hopper_problem)
    return hopper_flash.forward(
        q, k, v, ob, qseg, kseg, seed, block_k=cfg.blocks.block_k, scale=cfg.scale,
        causal=cfg.causal, zero_first=cfg.zero_first, has_bias=cfg.has_bias,
        dropout_rate=cfg.dropout_rate, interpret=cfg.interpret, warpgroups=cfg.warpgroups,
        closed=cfg.closed, num_params=cfg.num_params)
  b, h = q.shape[:2]
  specs = _specs(cfg, over="queries")
  if cfg.reads_band:
    ob = _band(cfg, ob)
  return pl.pallas_call(
      functools.partial(fwd_kernel, cfg),
      out_shape=(jax.ShapeDtypeStruct((b, h, cfg.q_len, cfg.blocks.v_dim), q.dtype),
                 jax.ShapeDtypeStruct((b, h, cfg.q_len, 1), jnp.float32)),
      grid=(b, h, cfg.q_len // cfg.blocks.block_q),
      in_specs=specs.inputs[:9],
      out_specs=(specs.out, specs.row),
      interpret=cfg.interpret,
      compiler_params=cfg.compiler_params,
      name="relative_flash_fwd",
  )(q, k, v, ob, qseg, kseg, row, col, seed)


def _backward(cfg, q, k, v, ob, qseg, kseg, row, col, seed, out, lse, do):
  """``(dq, dk, dv, d offset bias, d row, d col)``; the last two None without a separable
  term."""
  b, h = q.shape[:2]
  bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
  nq, nk = cfg.q_len // bq, cfg.k_len // bk
  delta = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32), axis=-1, keepdims=True)
  if cfg.backward == "hopper":
    dq, dk, dv, dob = hopper_flash.backward(
        q, k, v, ob, qseg, kseg, seed, lse, delta, do, scale=cfg.scale, causal=cfg.causal,
        zero_first=cfg.zero_first, has_bias=cfg.has_bias, dropout_rate=cfg.dropout_rate,
        interpret=cfg.interpret, closed=cfg.closed, num_params=cfg.num_params)
    return dq, dk, dv, dob.astype(ob.dtype), None, None
  args = (q, k, v, _band(cfg, ob) if cfg.reads_band else ob, qseg, kseg, row, col, seed, do,
          lse, delta)

  specs = _specs(cfg, over="queries")
  out_shapes, out_specs = [jax.ShapeDtypeStruct(q.shape, q.dtype)], [specs.q]
  if cfg.separable:
    out_shapes.append(jax.ShapeDtypeStruct(row.shape, jnp.float32))
    out_specs.append(specs.row)
  if cfg.has_bias and not cfg.reads_band:  # per query block: the offset-bias (or the closed
    # form's parameters') gradient, and the gather's scratch
    loff = cfg.offset_len
    out_shapes.append(jax.ShapeDtypeStruct((b, h, nq, 1, loff), jnp.float32))
    out_specs.append(pl.BlockSpec((None, None, None, 1, loff), lambda b, h, i: (b, h, i, 0, 0)))
    if cfg.tiles == "gather" and cfg.closed is None:
      out_shapes.append(jax.ShapeDtypeStruct((b, h, nq, bq, bk), jnp.float32))
      out_specs.append(pl.BlockSpec((None, None, None, bq, bk), lambda b, h, i: (b, h, i, 0, 0)))
  dq, *rest = pl.pallas_call(
      functools.partial(dq_kernel, cfg),
      out_shape=tuple(out_shapes),
      grid=(b, h, nq),
      in_specs=specs.inputs,
      out_specs=tuple(out_specs),
      interpret=cfg.interpret,
      compiler_params=cfg.compiler_params,
      name="relative_flash_dq",
  )(*args)

  drow = rest.pop(0) if cfg.separable else None
  specs = _specs(cfg, over="keys")
  out_shapes = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
  out_specs = [specs.k, specs.v]
  if cfg.separable:
    out_shapes.append(jax.ShapeDtypeStruct(col.shape, jnp.float32))
    out_specs.append(specs.col)
  dk, dv, *dcol = pl.pallas_call(
      functools.partial(dkv_kernel, cfg),
      out_shape=tuple(out_shapes),
      grid=(b, h, nk),
      in_specs=specs.inputs,
      out_specs=tuple(out_specs),
      interpret=cfg.interpret,
      compiler_params=cfg.compiler_params,
      name="relative_flash_dkv",
  )(*args)
  grads = dq, dk, dv
  vectors = (drow, dcol[0] if dcol else None)
  if not cfg.has_bias:
    return *grads, jnp.zeros_like(ob), *vectors
  if not cfg.reads_band:
    return *grads, jnp.sum(rest[0], axis=(0, 2)).astype(ob.dtype), *vectors
  units = (cfg.q_len + cfg.k_len) // bq - 1  # square tiles: one per diagonal of tiles
  specs = _specs(cfg, over="units")
  du = pl.pallas_call(
      functools.partial(dbias_kernel, cfg),
      out_shape=jax.ShapeDtypeStruct((b, h, units, bq, bq), jnp.float32),
      grid=(b, h, units),
      in_specs=specs.inputs,
      out_specs=pl.BlockSpec((None, None, None, bq, bq), lambda b, h, n: (b, h, n, 0, 0)),
      interpret=cfg.interpret,
      compiler_params=cfg.compiler_params,
      name="relative_flash_dbias",
  )(*args)
  return *grads, unit_gradient(du, cfg.offset_len)[:, None, :].astype(ob.dtype), *vectors


def _band(cfg, ob):
  """The ``[H, bq, Loff_p]`` band of the offset vector ``ob`` ``[H, 1, Loff_p]`` that band
  tiles read: ``band[h, r, w] = ob[h, w - r + bq - 1]``, so tile ``(qi, kj)`` is its columns
  ``cfg.window_start(qi, kj) + [0, bk)``."""
  return bias_band(ob[:, 0, :], cfg.blocks.block_q, cfg.offset_len)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg, q, k, v, ob, qseg, kseg, row, col, seed):
  return _forward(cfg, q, k, v, ob, qseg, kseg, row, col, seed)[0]


def _flash_fwd(cfg, q, k, v, ob, qseg, kseg, row, col, seed):
  out, lse = _forward(cfg, q, k, v, ob, qseg, kseg, row, col, seed)
  return out, (q, k, v, ob, qseg, kseg, row, col, seed, out, lse)


def _flash_bwd(cfg, res, do):
  q, k, v, ob, qseg, kseg, row, col, seed, out, lse = res
  dq, dk, dv, dob, drow, dcol = _backward(cfg, q, k, v, ob, qseg, kseg, row, col, seed, out,
                                          lse, do)
  return dq, dk, dv, dob, None, None, drow, dcol, None  # None: no cotangent


_flash.defvjp(_flash_fwd, _flash_bwd)


# ---------------------------------------------------------------------------
# Public entry point.


def hopper_takes(dtype, blocks: KernelBlocks, *, has_bias: bool, backward: bool) -> bool:
  """Whether the Hopper forward (``backward`` False: :func:`hopper_flash.fits`) or backward
  (:func:`hopper_flash.backward_fits`) takes these blocks and padded head dims: what the
  route plan asks (:mod:`posenc_jax.route_plan`) and :func:`relative_flash_attention`
  asserts."""
  shapes = dict(dtype=dtype, block_q=blocks.block_q, block_k=blocks.block_k,
                qk_dim=blocks.qk_dim, v_dim=blocks.v_dim)
  return (hopper_flash.backward_fits(**shapes) if backward
          else hopper_flash.fits(**shapes, has_bias=has_bias))


def _hopper_problem(dtype, blocks: KernelBlocks, *, has_bias: bool, forward: str,
                    backward: str, warpgroups: int | None, separable: bool = False,
                    closed: bool = False) -> str | None:
  """The one-line error for Hopper passes (and ``warpgroups``) these blocks or a separable
  term cannot take, or None. A closed form (``closed``) copies no band: its shared memory is
  that of no bias."""
  if separable and "hopper" in (forward, backward):
    return (f"{'forward' if forward == 'hopper' else 'backward'}: 'hopper' takes no "
            "row_bias or col_bias; use 'tiles'")
  has_bias = has_bias and not closed  # what the shared memory holds: band windows
  got = (f"got {jnp.dtype(dtype).name}, head dims {blocks.qk_dim}/{blocks.v_dim}, blocks "
         f"{blocks.block_q}x{blocks.block_k}")
  if forward == "hopper" and not hopper_takes(dtype, blocks, has_bias=has_bias, backward=False):
    return (f"forward: 'hopper' takes bfloat16/float16 q, k, v, head dims padded to multiples "
            f"of 64 and {hopper_flash.BLOCK_Q}-row query blocks, key blocks of "
            f"{' or '.join(map(str, hopper_flash.BLOCK_KS))} and buffers within "
            f"{SMEM_BYTES['9.0']} bytes of shared memory; {got}")
  if backward == "hopper" and not hopper_takes(dtype, blocks, has_bias=has_bias, backward=True):
    return (f"backward: 'hopper' takes bfloat16/float16 q, k, v, head dims padded to "
            f"multiples of 64 up to {hopper_flash.BACKWARD_MAX_DIM} and blocks of multiples "
            f"of 64; {got}")
  if warpgroups is not None:
    most = (hopper_flash.max_warpgroups(block_k=blocks.block_k, qk_dim=blocks.qk_dim,
                                        v_dim=blocks.v_dim, itemsize=jnp.dtype(dtype).itemsize,
                                        has_bias=has_bias) if forward == "hopper" else 0)
    if not 1 <= warpgroups <= most:
      return f"warpgroups: got {warpgroups!r}; allowed: " + (
          f"1 to {most} at these shapes" if most else "None unless forward='hopper' fits")
  return None


def hopper_fits(q_len: int, k_len: int, qk_dim: int, v_dim: int, dtype,
                has_bias: bool = True, *, backward: bool = False) -> bool:
  """Whether :func:`relative_flash_attention` can run ``forward="hopper"`` (``backward``:
  ``backward="hopper"`` beside it) at these shapes with its default blocks (gather tiles,
  this device's shared memory)."""
  blocks = kernel_blocks(q_len, k_len, qk_dim, v_dim, itemsize=jnp.dtype(dtype).itemsize,
                         has_bias=has_bias, block_q=hopper_flash.BLOCK_Q)
  return hopper_takes(dtype, blocks, has_bias=has_bias, backward=backward)


def relative_flash_attention(
    q: Array,
    k: Array,
    v: Array,
    offset_bias: Array | None = None,
    *,
    offset_fn: Any = None,
    offset_params: Array | None = None,
    row_bias: Array | None = None,
    col_bias: Array | None = None,
    mask: Array | None = None,
    q_segment_ids: Array | None = None,
    kv_segment_ids: Array | None = None,
    causal: bool = False,
    zero_first: bool = False,
    scale: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    blocks: KernelBlocks | None = None,
    tiles: str | None = None,
    precision: str = "float32",
    dropout_rate: float = 0.0,
    dropout_seed: Array | None = None,
    forward: str = "tiles",
    warpgroups: int | None = None,
    backward: str = "tiles",
    interpret: bool | None = None,
) -> Array:
  """Flash attention with a Toeplitz bias ``offset_bias[h, j - i + Lq - 1]`` built in the kernel.

  Args:
    q: ``[B, Lq, H, D]`` queries.
    k: ``[B, Lk, H, D]`` keys.
    v: ``[B, Lk, H, Dv]`` values.
    offset_bias: ``[H|1, Lq + Lk - 1]`` bias of each offset ``rel = j - i``
      (:func:`posenc_jax.terms.offsets`), or None for plain flash attention (no positional
      term).
    offset_fn, offset_params: a closed-form Toeplitz bias instead of ``offset_bias``:
      ``offset_fn.closed(params, rel)`` of the head's ``R`` parameters ``params`` (a tuple
      of float32 arrays broadcastable against ``rel``: here ``[1, 1]`` each, from
      ``offset_params [H|1, R]``) and an int32 array of offsets ``rel = j - i``,
      elementwise in ``rel`` (ALiBi's :class:`~posenc_jax.schemes.alibi.LinearDistance`,
      KERPLE's :class:`~posenc_jax.schemes.kerple.KernelDistance`); a hashable object whose
      ``closed`` is made of jnp operations. The kernels evaluate it on each tile from the
      positions, reading no vector, and the parameters' gradient is a per-tile reduction in
      the query-block kernel (``jax.vjp`` of ``offset_fn`` in the tile), summed outside over
      examples and blocks; the Hopper passes evaluate it in their tiles too, and their
      backward pulls the offset vector's gradient (its per-diagonal sums) back through
      ``offset_fn`` over the ``Lq + Lk - 1`` offsets.
    row_bias, col_bias: ``[B|1, H|1, Lq]`` and ``[B|1, H|1, Lk]``, a separable term: logit
      ``(i, j)`` gets ``row_bias[b, h, i] + col_bias[b, h, j]``, added to each tile in
      float32 whatever q's dtype (the forgetting gates' ``c_i - c_j``, whose parts grow
      without bound); None: zero. Not with the Hopper passes.
    mask: ``[B, Lk]`` key mask, True = attend.
    q_segment_ids: ``[B, Lq]`` int segment of each query (packed sequences);
      needs ``kv_segment_ids``.
    kv_segment_ids: ``[B, Lk]`` int segment of each key.
    causal: mask keys ``j > i``.
    zero_first: zero the bias in row 0 and column 0 (TUPE-R's [CLS] reset).
    scale: content scale; None gives ``1 / sqrt(D)``. The bias is not scaled.
    block_q, block_k: tile sizes, powers of two, ``>= 16`` (gather) or ``>= 128`` (roll);
      lengths are padded to block multiples internally, and gather tiles are clamped to the
      padded lengths. None: :func:`kernel_blocks` picks them (and Triton's warps and
      pipelining stages) to fit this device's on-chip memory.
    blocks: the :class:`KernelBlocks` settled by the route plan
      (:class:`posenc_jax.route_plan.KernelPlan`); given, ``block_q`` and ``block_k`` are not
      read and nothing is chosen here (the Hopper passes asked for are still asserted).
    tiles: how bias tiles are built: ``"gather"`` or ``"band"`` (GPU/Triton; band tiles
      are square) or ``"roll"`` (TPU/Mosaic); None picks ``roll`` on TPU, else
      ``gather``. All run in interpret mode.
    precision: products of float32 inputs: ``"float32"`` multiplies exactly
      (``lax.Precision.HIGHEST``: IEEE float32 on Triton, fp32 contraction on Mosaic);
      ``"tensorfloat32"`` opts into the backend's default, TF32 on a GPU's tensor cores
      (10 mantissa bits: about 1e-4 absolute error on unit-scale attention, against 4e-7
      exact). Exact products skip the tensor cores: on an H100 they were 10-30 times
      slower than TF32. bfloat16/float16 inputs are unaffected.
    dropout_rate: attention-probability dropout, in ``[0, 1)``; the mask is a hash of
      ``(dropout_seed, b, h, i, j)`` (:mod:`posenc_jax.kernels.dropout`), regenerated in
      the backward pass and equal to the reference route's.
    dropout_seed: int32 seed (any shape of one element; :func:`dropout_seed` draws one
      from a PRNG key); needed when ``dropout_rate > 0``.
    forward: the forward pass's kernel: ``"tiles"`` (the ``tiles`` kernel) or ``"hopper"``
      (:mod:`posenc_jax.kernels.hopper_flash`: Mosaic GPU, warpgroup MMA, for Hopper GPUs;
      16-bit inputs, head dims padded to multiples of 64, 64-row query blocks, the default
      ``block_q`` with it; :func:`hopper_fits`).
    backward: the backward pass's kernels: ``"tiles"`` (these) or ``"hopper"``
      (:func:`hopper_flash.backward`: Mosaic GPU on 64 x 64 tiles; 16-bit inputs, head dims
      padded to multiples of 64 up to 128, blocks multiples of 64). Either forward works
      with either backward.
    warpgroups: the Hopper forward's consumer warpgroups per block of the grid, each on
      its own 64-row query block and all sharing each key, value and bias copy; None: the
      most whose buffers fit in shared memory (:func:`hopper_flash.max_warpgroups`).
    interpret: Pallas interpret mode; None picks it on the CPU backend.

  Returns:
    ``[B, Lq, H, Dv]``, differentiable in q, k, v, ``offset_bias``, ``offset_params``,
    ``row_bias`` and ``col_bias``.
  """
  b, lq, h, d = q.shape
  lk, dv = k.shape[1], v.shape[-1]
  if k.shape != (b, lk, h, d) or v.shape[:3] != (b, lk, h):
    raise ValueError(f"q, k, v: shapes {q.shape}, {k.shape}, {v.shape} do not match "
                     "[B, Lq, H, D], [B, Lk, H, D], [B, Lk, H, Dv]")
  if offset_bias is not None and (offset_bias.ndim != 2 or offset_bias.shape[0] not in (1, h)
                                  or offset_bias.shape[1] != lq + lk - 1):
    raise ValueError(f"offset_bias: got shape {offset_bias.shape}; expected "
                     f"[{h} or 1, Lq + Lk - 1 = {lq + lk - 1}]")
  if (offset_fn is None) != (offset_params is None) or (
      offset_fn is not None and offset_bias is not None):
    raise ValueError("offset_fn, offset_params: give both (a closed form) or neither, and not "
                     "with offset_bias")
  if offset_params is not None and (offset_params.ndim != 2
                                    or offset_params.shape[0] not in (1, h)):
    raise ValueError(f"offset_params: got shape {offset_params.shape}; expected [{h} or 1, R]")
  if tiles is None:
    tiles = "roll" if jax.default_backend() == "tpu" else "gather"
  for name, value in (("forward", forward), ("backward", backward)):
    if value not in ("tiles", "hopper"):
      raise ValueError(f"{name}: got {value!r}; allowed: tiles, hopper")
  has_bias = offset_bias is not None or offset_fn is not None
  if blocks is None:
    blocks = kernel_blocks(lq, lk, d, dv, itemsize=max(x.dtype.itemsize for x in (q, k, v)),
                           has_bias=has_bias, tiles=tiles, precision=precision,
                           block_q=(hopper_flash.BLOCK_Q if forward == "hopper" and block_q is None
                                    else block_q), block_k=block_k)
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("q_segment_ids, kv_segment_ids: give both or neither")
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  scale = 1.0 / math.sqrt(d) if scale is None else scale
  if not 0.0 <= dropout_rate < 1.0:
    raise ValueError(f"dropout_rate: got {dropout_rate!r}; allowed: a number in [0, 1)")
  if dropout_rate and (dropout_seed is None or jnp.size(dropout_seed) != 1):
    raise ValueError(f"dropout_seed: got {dropout_seed!r}; allowed: one int32 with dropout")
  seed = (jnp.zeros((1, 1), jnp.int32) if dropout_seed is None
          else jnp.reshape(dropout_seed, (1, 1)).astype(jnp.int32))

  separable = row_bias is not None or col_bias is not None
  for name, vector, length in (("row_bias", row_bias, lq), ("col_bias", col_bias, lk)):
    if vector is not None and (vector.ndim != 3 or vector.shape[0] not in (1, b)
                               or vector.shape[1] not in (1, h) or vector.shape[2] != length):
      raise ValueError(f"{name}: got shape {vector.shape}; expected [{b} or 1, {h} or 1, "
                       f"{length}]")
  problem = _hopper_problem(q.dtype, blocks, has_bias=has_bias, forward=forward,
                            backward=backward, warpgroups=warpgroups, separable=separable,
                            closed=offset_fn is not None)
  if problem:
    raise ValueError(problem)
  lq_p, lk_p = round_up(lq, blocks.block_q), round_up(lk, blocks.block_k)
  cfg = _Config(has_bias=has_bias, tiles=tiles, zero_first=zero_first,
                causal=causal, scale=float(scale), precision=precision,
                dropout_rate=float(dropout_rate), blocks=blocks,
                q_len=lq_p, k_len=lk_p, interpret=bool(interpret), forward=forward,
                warpgroups=warpgroups, backward=backward, separable=separable, closed=offset_fn,
                num_params=0 if offset_params is None else offset_params.shape[1])
  loff = cfg.offset_len

  def heads_major(x, length, width):
    x = jnp.swapaxes(x, 1, 2)  # [B, H, L, D]
    return jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[2]), (0, width - x.shape[3])))

  if q_segment_ids is None:
    qseg, kseg = jnp.zeros((b, lq), jnp.int32), jnp.zeros((b, lk), jnp.int32)
  else:
    qseg, kseg = q_segment_ids.astype(jnp.int32), kv_segment_ids.astype(jnp.int32)
    if qseg.shape != (b, lq) or kseg.shape != (b, lk):
      raise ValueError(f"q_segment_ids, kv_segment_ids: got {qseg.shape}, {kseg.shape}; "
                       f"expected {(b, lq)}, {(b, lk)}")
  if mask is not None:
    if mask.shape != (b, lk):
      raise ValueError(f"mask: got shape {mask.shape}; expected a [B, Lk] = {(b, lk)} key mask")
    kseg = jnp.where(mask.astype(bool), kseg, _K_PAD)
  qseg = jnp.pad(qseg, ((0, 0), (0, lq_p - lq)), constant_values=_Q_PAD)[:, :, None]
  kseg = jnp.pad(kseg, ((0, 0), (0, lk_p - lk)), constant_values=_K_PAD)[:, None, :]
  if offset_params is not None:  # [H, 1, R_p]: each head's parameters, zero-padded
    params = jnp.broadcast_to(offset_params.astype(jnp.float32), (h, offset_params.shape[1]))
    ob = jnp.pad(params, ((0, 0), (0, loff - params.shape[1])))
  elif offset_bias is None:
    ob = jnp.zeros((1, loff), jnp.float32)
  else:
    # Offset o = rel + Lq - 1 moves to rel + Lq_p - 1; the padding is masked.
    ob = jnp.pad(jnp.broadcast_to(offset_bias, (h, lq + lk - 1)),
                 ((0, 0), (lq_p - lq, loff - (lq_p - lq) - (lq + lk - 1))))
  ob = jnp.broadcast_to(ob, (h, loff))[:, None, :]  # [H, 1, Loff_p]

  def vector(x, length, padded):  # [B|1, H|1, L] -> [B, H, L_p] float32; padding is masked
    if x is None:
      return jnp.zeros((b, h, padded), jnp.float32)
    x = jnp.broadcast_to(x.astype(jnp.float32), (b, h, length))
    return jnp.pad(x, ((0, 0), (0, 0), (0, padded - length)))

  row = vector(row_bias, lq, lq_p)[..., None]  # [B, H, Lq_p, 1]
  col = vector(col_bias, lk, lk_p)[:, :, None, :]  # [B, H, 1, Lk_p]
  out = _flash(cfg, heads_major(q, lq_p, blocks.qk_dim), heads_major(k, lk_p, blocks.qk_dim),
               heads_major(v, lk_p, blocks.v_dim), ob, qseg, kseg, row, col, seed)
  return jnp.swapaxes(out[:, :, :lq, :dv], 1, 2)
