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
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from posenc_jax.kernels.band import bias_band, unit_gradient
from posenc_jax.kernels.common import NEG, SMEM_BYTES
from posenc_jax.kernels.dropout import dropout_multiplier

Array = jax.Array

BLOCK_Q = 64  # one warpgroup's wgmma rows
BLOCK_KS = (64, 128)
MAX_WARPGROUPS = 2  # consumer warpgroups per block of the grid
STAGES = 2  # pipeline steps in flight
MEMORY_REGISTERS = 40  # per thread of the copying warpgroup
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


def hopper_band(offset_bias: Array, q_len: int, k_len: int, lead: int = 0,
                trail: int = 0) -> Array:
  """``[H, 64, 64 N]`` float32 band of the padded offset vector (module docstring;
  :func:`~posenc_jax.kernels.band.bias_band`), ``N = lead + (Lk + Lq) / 64 - 1 + trail``
  units of 64 columns.

  Args:
    offset_bias: ``[H, 1, Loff_p]``, offset ``o = j - i + q_len - 1`` (relative_flash's).
    q_len, k_len: padded lengths, multiples of 64.
    lead, trail: units of padding before the first tile and after the last.
  """
  units = lead + (k_len + q_len) // BLOCK_Q - 1 + trail
  return bias_band(offset_bias[:, 0, :], BLOCK_Q, units * BLOCK_Q, lead=lead * BLOCK_Q)


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


def _warpgroup_buffers(groups: int, cols: int, dtype):
  """``[G, 64, cols]`` shared memory: one ``[64, cols]`` ``wgmma`` operand buffer per
  consumer warpgroup."""
  plgpu = _mosaic_gpu()
  return plgpu.SMEM((groups, BLOCK_Q, cols), dtype, transforms=_transforms(cols, dtype))


def _window_spec(units: int, first):
  """Pipeline block of ``units`` band units (``[64, 64 units]`` float32 columns) from unit
  ``first(step)``: the units a step's warpgroups read."""
  plgpu = _mosaic_gpu()
  return plgpu.BlockSpec((BLOCK_Q, pl.Element(units * BLOCK_Q)),
                         lambda n: (0, first(n) * BLOCK_Q))


def _specialised_pipeline(step, specs, compute, *, steps: int, groups: int):
  """The warp-specialised pipeline over ``steps`` blocks: a memory warpgroup copying
  ``specs``' blocks (``STAGES`` in flight) for ``groups`` consumer warpgroups that run
  ``step`` inside ``compute`` (``emit_pipeline_warp_specialized``'s arguments)."""
  plgpu = _mosaic_gpu()
  return plgpu.emit_pipeline_warp_specialized(
      step, grid=(steps,), in_specs=specs, max_concurrent_steps=min(STAGES, steps),
      wg_axis="wg", num_compute_wgs=groups, memory_registers=MEMORY_REGISTERS,
      compute_context=compute)


def _product(a_ref, b_ref, shape: tuple[int, int]) -> Array:
  """``a @ b`` of two shared-memory ``wgmma`` operands (either may be a ``.T`` view) as a
  ``shape`` float32 array in the WGMMA layout."""
  plgpu = _mosaic_gpu()

  def body(acc_ref):
    plgpu.wgmma(acc_ref, a_ref, b_ref)
    return acc_ref[...]

  return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))


def _logits(q_tile, k_tile, bias_tile, q_seg: Array, k_seg: Array, q0, k0, *, scale: float,
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
  plgpu = _mosaic_gpu()
  layout = plgpu.Layout.WGMMA
  shape = (BLOCK_Q, k_tile.shape[0])
  s = _product(q_tile, k_tile.T, shape) * scale
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


def forward(q: Array, k: Array, v: Array, offset_bias: Array, q_segments: Array,
            kv_segments: Array, seed: Array, *, block_k: int, scale: float, causal: bool,
            zero_first: bool, has_bias: bool, dropout_rate: float, interpret: bool,
            warpgroups: int | None = None) -> tuple[Array, Array]:
  """Output and lse of the padded, head-major arrays of relative_flash's kernels.

  Args:
    q: ``[B, H, Lq_p, Dqk_p]``; k: ``[B, H, Lk_p, Dqk_p]``; v: ``[B, H, Lk_p, Dv_p]``.
    offset_bias: ``[H, 1, Loff_p]`` (read only with ``has_bias``).
    q_segments: ``[B, Lq_p, 1]`` and kv_segments ``[B, 1, Lk_p]`` int32 segment ids (masked
      keys and padding already given ids that match nothing).
    seed: ``[1, 1]`` int32 dropout seed.
    block_k, scale, causal, zero_first, dropout_rate: as relative_flash's.
    interpret: run in Mosaic GPU's interpret mode (CPU).
    warpgroups: consumer warpgroups per block of the grid (``G``, validated by the caller);
      None: the most that fit (:func:`max_warpgroups`).

  Returns:
    ``out [B, H, Lq_p, Dv_p]`` in q's dtype and ``lse [B, H, Lq_p, 1]`` float32.
  """
  plgpu = _mosaic_gpu()
  b_size, heads, q_len, qk_dim = q.shape
  k_len, v_dim = k.shape[2], v.shape[-1]
  dtype = q.dtype
  groups = warpgroups or max_warpgroups(block_k=block_k, qk_dim=qk_dim, v_dim=v_dim,
                                        itemsize=dtype.itemsize, has_bias=has_bias)
  nq, nk, units = q_len // BLOCK_Q, k_len // block_k, block_k // BLOCK_Q
  ctas = -(-nq // groups)
  idle = ctas * groups - nq  # warpgroups of the last block with no query block
  window = groups + units - 1  # bias units one step of a block reads
  # Without a bias no band is made or copied (a placeholder keeps the signature).
  band = (hopper_band(offset_bias, q_len, k_len, lead=idle) if has_bias
          else jnp.zeros((1, 1, 1), jnp.float32))
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
      plgpu.barrier_wait(q_barriers.at[wg])
      acc, m, l, _ = pipeline((
          plgpu.layout_cast(jnp.zeros((BLOCK_Q, v_dim), jnp.float32), wgmma_layout),
          plgpu.layout_cast(jnp.full((BLOCK_Q,), NEG, jnp.float32), rows_layout),
          plgpu.layout_cast(jnp.zeros((BLOCK_Q,), jnp.float32), rows_layout), q_seg))
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
      segment ids ride along in the carry unchanged."""
      acc, m, l, q_seg = carry
      # Warpgroup g's bias tile starts (G - 1 - g) units into the step's window.
      bias = (t_smem[0].at[:, pl.ds((groups - 1 - wg) * BLOCK_Q, block_k)] if has_bias
              else None)
      s, valid, i, j = _logits(q_tile, k_smem, bias, q_seg,
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
      pv = _product(p_tile, v_smem, (BLOCK_Q, v_dim))
      return acc * lax.broadcast_in_dim(alpha, pv.shape, [0]) + pv, m_new, l_new, q_seg

    specs = [plgpu.BlockSpec((block_k, qk_dim), lambda kj: (kj, 0),
                             transforms=_transforms(qk_dim, dtype)),
             plgpu.BlockSpec((block_k, v_dim), lambda kj: (kj, 0),
                             transforms=_transforms(v_dim, dtype)),
             plgpu.BlockSpec((block_k,), lambda kj: (kj,))]
    sources = [k_ref.at[b, h], v_ref.at[b, h], ks_ref.at[b]]
    if has_bias:
      # The step's window: units first + kj * s + [0, G + s - 1) of the band (hopper_band).
      specs.append(_window_spec(window, lambda kj: (ctas - 1 - cta) * groups + kj * units))
      sources.append(band_ref.at[h])
    _specialised_pipeline(step, specs, compute, steps=nk, groups=groups)(*sources)

  def tile(cols):
    return _warpgroup_buffers(groups, cols, dtype)

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


# ---------------------------------------------------------------------------
# The backward pass: three kernels on 64 x 64 tiles. dq: warp-specialised as the forward,
# ``G`` consumer warpgroups on consecutive query blocks sharing each key block's copies and a
# window of ``G`` band units; dk/dv: the same on consecutive key blocks over query blocks
# (``p^T dO`` and ``dS^T q`` from transposed shared-memory operands); the bias gradient: one
# warpgroup per unit of the band (a diagonal of the tile grid) over its (query block, key
# block) pairs, summing their logit cotangents in registers. The band's diagonals are summed
# outside (:func:`~posenc_jax.kernels.band.band_gradient`), so no kernel sums diagonals and
# none adds atomically.

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
  has_bias: bool
  dropout_rate: float
  interpret: bool
  dtype: jnp.dtype  # of q, k, v
  qk_dim: int  # Dqk_p
  v_dim: int  # Dv_p
  nq: int  # query blocks
  nk: int  # key blocks
  groups: int  # consumer warpgroups per block of the dq and dk/dv grids (backward_warpgroups)

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
             dropout_rate: float, interpret: bool) -> tuple[Array, Array, Array, Array]:
  """Gradients of :func:`forward`'s output from its cotangent ``do``.

  Args:
    q, k, v, offset_bias, q_segments, kv_segments, seed: as :func:`forward`'s (lengths
      multiples of 64).
    lse: ``[B, H, Lq_p, 1]`` float32 from the forward pass.
    delta: ``[B, H, Lq_p, 1]`` float32 row sums of ``out * do``.
    do: ``[B, H, Lq_p, Dv_p]``.
    scale, causal, zero_first, has_bias, dropout_rate, interpret: as :func:`forward`'s.

  Returns:
    ``dq``, ``dk``, ``dv`` shaped and typed as q, k, v, and the offset vector's gradient
    ``[H, 1, Loff_p]`` float32 (zeros without a bias).
  """
  q_len, qk_dim = q.shape[2:]
  k_len, v_dim = k.shape[2], v.shape[-1]
  groups = backward_warpgroups(qk_dim=qk_dim, v_dim=v_dim)
  cfg = _Backward(scale=scale, causal=causal, zero_first=zero_first, has_bias=has_bias,
                  dropout_rate=dropout_rate, interpret=interpret, dtype=q.dtype,
                  qk_dim=qk_dim, v_dim=v_dim, nq=q_len // BLOCK_Q, nk=k_len // BLOCK_Q,
                  groups=groups)
  # One band for the three kernels, padded for dq's idle warpgroups (the last grid block's
  # query blocks past the end: before the first unit) and dk/dv's (after the last unit).
  band = (hopper_band(offset_bias, q_len, k_len, lead=cfg.lead,
                      trail=cfg.k_ctas * groups - cfg.nk)
          if has_bias else jnp.zeros((1, BLOCK_Q, BLOCK_Q), jnp.float32))
  # What every kernel reads: q, k, v, the band, segment ids [B, Lq_p] and [B, Lk_p], the
  # seed [1], lse and delta [B, H, Lq_p], do.
  inputs = (q, k, v, band, q_segments[:, :, 0], kv_segments[:, 0, :], jnp.reshape(seed, (1,)),
            lse[..., 0], delta[..., 0], do)
  dq = _backward_dq(cfg, inputs)
  dk, dv = _backward_dkv(cfg, inputs)
  if not has_bias:
    return dq, dk, dv, jnp.zeros((q.shape[1], 1, offset_bias.shape[-1]), jnp.float32)
  return dq, dk, dv, unit_gradient(_backward_dbias(cfg, inputs), offset_bias.shape[-1])[:, None, :]


def _cotangents(cfg, q_tile, k_tile, v_tile, do_tile, bias_tile, q_seg, k_seg, lse_rows,
                delta_rows, q0, k0, seed_value, b, h):
  """``(p, ds, i, j)`` of one 64 x 64 tile (float32, WGMMA layout): the probabilities as
  applied (dropped out), ``ds = P * (Z * dO v^T - delta)`` and the positions (None unless
  zero_first, causal or dropout needs them); the arguments as :func:`_logits`' and the
  tile's ``[64]`` rows of lse and delta."""
  tile = (BLOCK_Q, BLOCK_Q)
  s, valid, i, j = _logits(q_tile, k_tile, bias_tile, q_seg, k_seg, q0, k0, scale=cfg.scale,
                           causal=cfg.causal, zero_first=cfg.zero_first,
                           positions=bool(cfg.dropout_rate))
  p = jnp.where(valid, jnp.exp(s - lax.broadcast_in_dim(lse_rows, tile, [0])), 0.0)
  dp = _product(do_tile, v_tile.T, tile)
  if cfg.dropout_rate:
    keep = dropout_multiplier(seed_value, b, h, i, j, cfg.dropout_rate)
    p_applied, dp = p * keep, dp * keep
  else:
    p_applied = p
  return p_applied, p * (dp - lax.broadcast_in_dim(delta_rows, tile, [0])), i, j


def _tile_spec(cfg, cols: int, index_map):
  """Pipeline block of 64 rows of a ``cols``-wide ``wgmma`` operand (q, k, v or do)."""
  plgpu = _mosaic_gpu()
  return plgpu.BlockSpec((BLOCK_Q, cols), index_map, transforms=_transforms(cols, cfg.dtype))


def _row_spec(index_map):
  """Pipeline block of 64 entries of a row (segment ids, lse, delta)."""
  return _mosaic_gpu().BlockSpec((BLOCK_Q,), index_map)


def _store(value: Array, buffer, target) -> None:
  """Copies ``value`` through the shared-memory ``buffer`` to ``target`` in global memory."""
  plgpu = _mosaic_gpu()
  buffer[...] = value.astype(buffer.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(buffer, target)


def _zeros(cols: int) -> Array:
  """``[64, cols]`` float32 zeros in the WGMMA layout (an accumulator's start)."""
  plgpu = _mosaic_gpu()
  return plgpu.layout_cast(jnp.zeros((BLOCK_Q, cols), jnp.float32), plgpu.Layout.WGMMA)


def _backward_call(cfg, kernel, inputs, blocks: int, out_type, scratch, name: str,
                   groups: int | None = None):
  """``kernel`` on :func:`backward`'s ``inputs`` over a ``(B, H, blocks)`` grid; ``groups``:
  consumer warpgroups (plus the memory one) per block of the grid, None for one warpgroup."""
  plgpu = _mosaic_gpu()
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
  plgpu = _mosaic_gpu()
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
      plgpu.barrier_wait(barriers.at[2 * wg])
      plgpu.barrier_wait(barriers.at[2 * wg + 1])
      dq, *_ = pipeline((_zeros(qk_dim), *loaded))

      @pl.when(live)
      def _():
        _store(dq * cfg.scale, out_smem.at[wg], dq_ref.at[b, h, rows])
        plgpu.wait_smem_to_gmem(0)

    def step(index, k_smem, v_smem, ks_smem, *rest):
      *t_smem, carry = rest
      kj = index[0]

      def attend(carry):
        dq, q_seg, lse_rows, delta_rows = carry
        # Warpgroup g's unit is G - 1 - g into the step's window (as the forward's).
        bias = (t_smem[0].at[:, pl.ds((groups - 1 - wg) * BLOCK_Q, BLOCK_Q)] if cfg.has_bias
                else None)
        _, ds, _, _ = _cotangents(cfg, q_tile, k_smem, v_smem, do_tile, bias, q_seg,
                                  plgpu.load(ks_smem, layout=cols_layout), lse_rows,
                                  delta_rows, qi * BLOCK_Q, kj * BLOCK_Q,
                                  seed_ref[0] if cfg.dropout_rate else None, b, h)
        ds_tile[...] = ds.astype(cfg.dtype)
        plgpu.commit_smem()
        return dq + _product(ds_tile, k_smem, (BLOCK_Q, qk_dim)), q_seg, lse_rows, delta_rows

      run = live & (kj <= qi) if cfg.causal else live  # causal: later key blocks masked whole
      return lax.cond(run, attend, lambda c: c, carry)

    specs = [_tile_spec(cfg, qk_dim, lambda kj: (kj, 0)),
             _tile_spec(cfg, cfg.v_dim, lambda kj: (kj, 0)), _row_spec(lambda kj: (kj,))]
    sources = [k_ref.at[b, h], v_ref.at[b, h], ks_ref.at[b]]
    if cfg.has_bias:  # units kj + (ctas - 1 - cta) G + [0, G) of the band (after its lead)
      specs.append(_window_spec(groups, lambda kj: kj + (cfg.q_ctas - 1 - cta) * groups))
      sources.append(band_ref.at[h])
    _specialised_pipeline(step, specs, compute, steps=cfg.nk, groups=groups)(*sources)

  def tiles(cols):
    return _warpgroup_buffers(groups, cols, cfg.dtype)

  return _backward_call(
      cfg, kernel, inputs, cfg.q_ctas, jax.ShapeDtypeStruct(inputs[0].shape, cfg.dtype),
      [tiles(qk_dim), tiles(cfg.v_dim), tiles(BLOCK_Q), tiles(qk_dim),
       plgpu.Barrier(num_barriers=2 * groups)], "relative_flash_dq_hopper", groups)


def _backward_dkv(cfg, inputs) -> tuple[Array, Array]:
  """dk ``[B, H, Lk_p, Dqk_p]`` and dv ``[B, H, Lk_p, Dv_p]``: key blocks ``cta G + g``
  (warpgroup g) against every query block, warp-specialised (``p^T dO`` and ``dS^T q`` from
  transposed shared-memory operands)."""
  plgpu = _mosaic_gpu()
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
      for n in range(3):
        plgpu.barrier_wait(barriers.at[3 * wg + n])
      dk, dv, _ = pipeline((_zeros(qk_dim), _zeros(v_dim),
                            plgpu.load(ks_tile, layout=cols_layout)))

      @pl.when(live)
      def _():
        _store(dk * cfg.scale, dk_smem.at[wg], dk_ref.at[b, h, keys])
        _store(dv, dv_smem.at[wg], dv_ref.at[b, h, keys])
        plgpu.wait_smem_to_gmem(0)

    def step(index, q_tile, do_tile, qs_smem, lse_smem, delta_smem, *rest):
      *t_smem, carry = rest
      qi = index[0]

      def attend(carry):
        dk, dv, k_seg = carry
        # Warpgroup g's unit is g into the step's window.
        bias = t_smem[0].at[:, pl.ds(wg * BLOCK_Q, BLOCK_Q)] if cfg.has_bias else None
        q_seg, lse_rows, delta_rows = (plgpu.load(x, layout=rows_layout)
                                       for x in (qs_smem, lse_smem, delta_smem))
        p, ds, _, _ = _cotangents(cfg, q_tile, k_tile, v_tile, do_tile, bias, q_seg, k_seg,
                                  lse_rows, delta_rows, qi * BLOCK_Q, kj * BLOCK_Q,
                                  seed_ref[0] if cfg.dropout_rate else None, b, h)
        p_tile[...] = p.astype(cfg.dtype)
        ds_tile[...] = ds.astype(cfg.dtype)
        plgpu.commit_smem()
        return (dk + _product(ds_tile.T, q_tile, (BLOCK_Q, qk_dim)),
                dv + _product(p_tile.T, do_tile, (BLOCK_Q, v_dim)), k_seg)

      run = live & (qi >= kj) if cfg.causal else live  # causal: earlier q blocks masked whole
      return lax.cond(run, attend, lambda c: c, carry)

    specs = [_tile_spec(cfg, qk_dim, lambda qi: (qi, 0)),
             _tile_spec(cfg, v_dim, lambda qi: (qi, 0))]
    specs += [_row_spec(lambda qi: (qi,))] * 3
    sources = [q_ref.at[b, h], do_ref.at[b, h], qs_ref.at[b], lse_ref.at[b, h],
               delta_ref.at[b, h]]
    if cfg.has_bias:  # units cta G - qi + nq - 1 + [0, G) past the band's lead
      specs.append(_window_spec(groups, lambda qi: cfg.lead + cta * groups - qi + nq - 1))
      sources.append(band_ref.at[h])
    _specialised_pipeline(step, specs, compute, steps=nq, groups=groups)(*sources)

  def tiles(cols):
    return _warpgroup_buffers(groups, cols, cfg.dtype)

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
  plgpu = _mosaic_gpu()
  rows_layout, cols_layout = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
  nq, nk = cfg.nq, cfg.nk
  units = nq + nk - 1  # diagonals of the tile grid: unit kj - qi + nq - 1

  def kernel(q_ref, k_ref, v_ref, band_ref, qs_ref, ks_ref, seed_ref, lse_ref, delta_ref,
             do_ref, du_ref, t_smem, du_smem, barrier):
    b, h, n = (lax.axis_index(a) for a in ("batch", "heads", "blocks"))
    shift = n - (nq - 1)  # kj - qi on this unit
    plgpu.copy_gmem_to_smem(band_ref.at[h, :, pl.ds((cfg.lead + n) * BLOCK_Q, BLOCK_Q)],
                            t_smem, barrier)
    seed_value = seed_ref[0] if cfg.dropout_rate else None
    plgpu.barrier_wait(barrier)

    def key_block(qi):  # clamped: steps off the grid load a block they do not use
      return jnp.clip(qi + shift, 0, nk - 1)

    def step(index, q_smem, do_smem, qs_smem, lse_smem, delta_smem, k_smem, v_smem, ks_smem,
             du):
      qi = index[0]
      kj = qi + shift

      def attend(du):
        _, ds, i, j = _cotangents(
            cfg, q_smem, k_smem, v_smem, do_smem, t_smem,
            plgpu.load(qs_smem, layout=rows_layout), plgpu.load(ks_smem, layout=cols_layout),
            *(plgpu.load(x, layout=rows_layout) for x in (lse_smem, delta_smem)),
            qi * BLOCK_Q, kj * BLOCK_Q, seed_value, b, h)
        if cfg.zero_first:  # the bias is zero there: no gradient reaches the vector
          ds = jnp.where((i == 0) | (j == 0), 0.0, ds)
        return du + ds

      run = (kj >= 0) & (kj < nk)
      if cfg.causal:
        run = run & (kj <= qi)
      return lax.cond(run, attend, lambda c: c, du)

    qk_dim, v_dim = cfg.qk_dim, cfg.v_dim
    specs = [_tile_spec(cfg, qk_dim, lambda qi: (qi, 0)),
             _tile_spec(cfg, v_dim, lambda qi: (qi, 0))]
    specs += [_row_spec(lambda qi: (qi,))] * 3
    specs += [_tile_spec(cfg, qk_dim, lambda qi: (key_block(qi), 0)),
              _tile_spec(cfg, v_dim, lambda qi: (key_block(qi), 0)),
              _row_spec(lambda qi: (key_block(qi),))]
    sources = [q_ref.at[b, h], do_ref.at[b, h], qs_ref.at[b], lse_ref.at[b, h],
               delta_ref.at[b, h], k_ref.at[b, h], v_ref.at[b, h], ks_ref.at[b]]
    du = plgpu.emit_pipeline(step, grid=(nq,), in_specs=specs, init_carry=_zeros(BLOCK_Q),
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
