"""The route plan: one pure function decides how one attention call runs.

:func:`posenc_jax.attend` checks its arguments, describes the call (static shapes, dtype, each
term's :class:`~posenc_jax.terms.TermForm`, the mask kind, causal, dropout, packed segments),
asks :func:`plan` once, and executes the :class:`Plan` it gets. Nothing else decides a route:
the kernels receive settled settings. The plan reads only its arguments: the device
(:class:`Device`, which :func:`current_device` reads once per call) and the measured
crossovers (:class:`posenc_jax.route_table.RouteTable`, which
:func:`posenc_jax.route_table.current` reads once per call), so a plan can be asked for any
platform on any machine, and printed::

  from posenc_jax import route_plan
  print(route_plan.plan_for(q, k, v, terms, mask=mask))   # this device
  print(route_plan.plan((32, 512, 12, 64), (32, 512, 12, 64), (32, 512, 12, 64), "bfloat16",
                        forms, mask="key", device=route_plan.Device("gpu", "H100", "9.0"),
                        table=route_table.RouteTable()))

What the plan decides, in order:

1. **Route** (:func:`choose_route`): ``"auto"`` is the reference route on CPU (at short
   lengths a materialised term costs less than folding it into every example's q/k, and
   Pallas only interprets there) and where a term cannot fuse (Shaw's value table), else the
   fused route.
2. **How each term enters** (:data:`ENTRIES`): a q/k transform has run already; a factored
   term folds into q/k; a Toeplitz term's offset vector goes to the Pallas kernel, which
   builds its tiles (a closed-form one, ALiBi's or KERPLE's, is evaluated in the Triton
   tiles from its parameters where it is the call's only Toeplitz term and the route table
   has not measured the Hopper passes faster); a separable term's row and column vectors
   (the forgetting gates) go to the kernel too, which adds them to its tiles in float32;
   under a causal mask in bfloat16 on a GPU, terms that are ``r_i + s_j`` there (causal
   ALiBi, the forgetting gates) fold ``s`` into q/k channels instead, so that cuDNN runs the
   call without a bias (:func:`_channel_terms`, :mod:`posenc_jax.terms.channels`);
   dense terms are a bias. A batch-free Toeplitz or factored term is materialised once per
   call as a bias instead where the route table measured that faster (not with dropout or
   packed segments, which need the kernel).
3. **What runs** (:data:`RUNNERS`): the Pallas kernel (Triton gather tiles on GPU and CPU,
   Mosaic roll tiles on TPU; the Hopper forward and backward where the table measured them
   fastest and they fit; never with a separable term) for Toeplitz and separable terms
   without dense ones, and for bias-free attention where cuDNN cannot run, with packed
   segments, or with dropout (the kernel draws the reference route's mask); splash attention
   on TPU for bias-free self-attention over a multiple of 128 positions;
   :func:`jax.nn.dot_product_attention` (cuDNN where :func:`cudnn_unsupported` allows, else
   XLA) for dense terms, with any Toeplitz vector materialised and any separable term
   broadcast to ``r_i + s_j`` (no cuDNN or splash call takes two vectors); the reference
   route for dropout the kernel cannot take.
4. **How a mask reaches dot_product_attention** (:data:`MASKS`): with cuDNN, a key mask that
   keeps a prefix of every row goes as ``key_value_seq_lengths`` (no ``[Lq, Lk]`` array);
   whether it does is known only at run time, so the plan names the fallback (the kernel, or
   the mask broadcast to ``[B, 1, Lq, Lk]``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from posenc_jax import route_table
from posenc_jax.kernels import blocks, hopper_flash, relative_flash
from posenc_jax.kernels.blocks import KernelBlocks
from posenc_jax.terms import Term, TermForm
from posenc_jax.terms.channels import channel_count

ROUTES = ("auto", "reference", "fused")
IMPLEMENTATIONS = ("xla", "cudnn")
MASK_KINDS = ("none", "key", "full")  # no mask, a [B, Lk] key mask, a mask broadcastable to 4-D
# How each term enters the call: "logits" (the reference route materialises every term),
# "transform" (nothing left: a q/k transform that has run, or an input-level term), "fold"
# (concatenated to q/k), "kernel" (an offset vector whose tiles the kernel builds), "bias" (a
# dense bias), "offsets" (a Toeplitz vector materialised as a bias: the kernel cannot run),
# "table" (materialised once per call: the route table measured that faster), "vectors" (a
# separable term's row and column vectors, added in the kernel's tiles), "broadcast" (the two
# vectors broadcast to a dense bias: the kernel cannot run), "registers" (a closed-form
# Toeplitz term evaluated in the kernel's tiles from its parameters: no vector), "channels" (a
# term separable under the causal mask, its key vector folded into q/k channels:
# posenc_jax.terms.channels).
ENTRIES = ("logits", "transform", "fold", "kernel", "bias", "offsets", "table", "vectors",
           "broadcast", "registers", "channels")
RUNNERS = ("reference", "kernel", "splash", "dot_product_attention")
# How a mask reaches dot_product_attention: None (no mask), "mask" (as given, 4-D), "full"
# (broadcast to [B, 1, Lq, Lk]), "lengths or kernel" / "lengths or full" (sequence lengths
# where the key mask keeps a prefix of every row, decided at run time, else the other).
MASKS = (None, "mask", "full", "lengths or kernel", "lengths or full")


class Device(NamedTuple):
  """What a plan needs to know of the device.

  Attributes:
    platform: JAX's backend name, ``"cpu"``, ``"gpu"`` or ``"tpu"``.
    kind: the device kind the route table is keyed by (``"NVIDIA H100 80GB HBM3"``).
    compute_capability: an NVIDIA GPU's (``"9.0"``), else None.
  """

  platform: str
  kind: str
  compute_capability: str | None = None


def current_device() -> Device:
  """The :class:`Device` of JAX's default backend (its first device)."""
  platform = jax.default_backend()
  return Device(platform, route_table.device_kind(),
                blocks.gpu_compute_capability() if platform == "gpu" else None)


@dataclasses.dataclass(frozen=True)
class KernelPlan:
  """The settled settings of :func:`posenc_jax.kernels.relative_flash_attention`.

  Attributes:
    tiles: ``"gather"`` (Triton; CPU in interpret mode) or ``"roll"`` (Mosaic TPU).
    forward, backward: ``"tiles"`` or ``"hopper"`` (Mosaic GPU warpgroup kernels).
    blocks: tile sizes, padded head dims and launch settings.
    bias: an offset vector goes in (Toeplitz terms); ``zero_first``: TUPE-R's reset.
    dropout: the kernel draws attention dropout.
    separable: a row and a column vector go in (separable terms).
    closed: the bias is a closed form the tiles evaluate (``bias`` is then True).
  """

  tiles: str
  forward: str
  backward: str
  blocks: KernelBlocks
  bias: bool
  zero_first: bool
  dropout: bool
  separable: bool = False
  closed: bool = False

  def __str__(self) -> str:
    b = self.blocks
    passes = ("Triton" if self.tiles == "gather" else "Mosaic TPU") + f" {self.tiles} tiles"
    if "hopper" in (self.forward, self.backward):
      passes = (f"forward {'Hopper' if self.forward == 'hopper' else passes}, "
                f"backward {'Hopper' if self.backward == 'hopper' else passes}")
    launch = f", {b.num_warps} warps, {b.num_stages} stages" if b.num_warps else ""
    return (f"{passes}; blocks {b.block_q}x{b.block_k}, head dims {b.qk_dim}/{b.v_dim}"
            f"{launch}; "
            f"{'closed-form bias' if self.closed else 'offset bias' if self.bias else 'no bias'}"
            f"{' (zero first row/column)' if self.zero_first else ''}"
            f"{', row/column vectors' if self.separable else ''}"
            f"{', dropout' if self.dropout else ''}")


@dataclasses.dataclass(frozen=True)
class Plan:
  """How one attention call runs (:func:`plan`); ``str(plan)`` says it in words.

  Attributes:
    route: ``"reference"`` or ``"fused"`` (:func:`choose_route`).
    runner: what computes attention (:data:`RUNNERS`).
    entries: how each term enters, in the order of the terms (:data:`ENTRIES`).
    names: each term's class name.
    qk_dim: the q/k width the runner sees: D on the reference route, else D plus every folded
      rank, zero-padded to a multiple of 8 (zero columns change no product).
    implementation: :func:`jax.nn.dot_product_attention`'s, ``"cudnn"`` or ``"xla"``, where
      it runs (runner or a mask's fallback), else None.
    mask: how a mask reaches dot_product_attention (:data:`MASKS`).
    kernel: the kernel's settings where it runs (runner or a mask's fallback), else None.
    points_of: on the fused route, the device kind whose route-table points it read: the
      device's own, or without them those of a kind of the same compute capability
      (:meth:`posenc_jax.route_table.RouteTable.whose`; a note says so); None where there
      are none (the default ways).
    notes: why, one short clause each.
  """

  route: str
  runner: str
  entries: tuple[str, ...]
  names: tuple[str, ...]
  qk_dim: int
  implementation: str | None = None
  mask: str | None = None
  kernel: KernelPlan | None = None
  points_of: str | None = None
  notes: tuple[str, ...] = ()

  def __str__(self) -> str:
    runner = self.runner
    if runner == "dot_product_attention":
      runner = f"dot_product_attention ({self.implementation})"
    lines = [f"route {self.route}: {runner}, q/k width {self.qk_dim}"]
    lines += [f"  term {name}: {entry}" for name, entry in zip(self.names, self.entries)]
    if self.mask:
      lines.append(f"  mask: {self.mask}")
    if self.kernel is not None:
      lines.append(f"  kernel: {self.kernel}")
    if self.route == "fused":
      lines.append(f"  route table: {self.points_of}'s points" if self.points_of else
                   "  route table: no points for this device (the default ways)")
    lines += [f"  because {note}" for note in self.notes]
    return "\n".join(lines)


def choose_route(route: str, forms: Sequence[TermForm], backend: str) -> str:
  """``"reference"`` or ``"fused"`` for the route asked with terms of these ``forms``
  (``"auto"`` picks per ``backend``, JAX's platform name); one ValueError line when
  ``"fused"`` is asked for and a term cannot fuse."""
  unfusable = [f.name for f in forms if not f.fusable]
  if route == "auto":
    return "reference" if unfusable or backend == "cpu" else "fused"
  if route == "fused" and unfusable:
    raise ValueError(f"route: 'fused' cannot run {', '.join(unfusable)}; use route='reference'")
  return route


def cudnn_unsupported(q_shape: Sequence[int], k_shape: Sequence[int], dtype, *,
                      has_bias: bool, backend: str | None = None,
                      compute_capability: float | None = None) -> str | None:
  """Why :func:`jax.nn.dot_product_attention` cannot run on cuDNN, or None if it can.

  Args:
    q_shape, k_shape: ``[B, L, H, D]`` after folding (D includes the folded rank).
    dtype: compute dtype of q/k/v.
    has_bias: an additive bias goes with the call.
    backend, compute_capability: the device's (None: read from the first device).
  """
  backend = jax.default_backend() if backend is None else backend
  if backend != "gpu":
    return f"backend {backend} has no cuDNN"
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"dtype {jnp.dtype(dtype).name} (cuDNN flash attention takes bfloat16/float16)"
  if compute_capability is None:
    compute_capability = float(blocks.gpu_compute_capability() or 0)
  head_max = 256 if compute_capability >= 9.0 else 128
  head_dim = q_shape[-1]
  if head_dim % 8 or head_dim > head_max:
    return f"head dim {head_dim} after folding (needs a multiple of 8, at most {head_max})"
  if has_bias and (q_shape[1] % 2 or k_shape[1] % 2):
    return f"odd lengths {q_shape[1]}, {k_shape[1]} with a bias"
  return None


def splash_fits(q_len: int, k_len: int) -> bool:
  """Splash attention's shape needs: self-attention, length a multiple of its 128-row
  blocks."""
  return q_len == k_len and q_len % 128 == 0


def _kernel_plan(q_len: int, k_len: int, qk_dim: int, v_dim: int, dtype, *, bias: bool,
                 zero_first: bool, dropout: bool, separable: bool, closed: str | None,
                 precision: str, device: Device, table: route_table.RouteTable) -> KernelPlan:
  """The kernel's tiles, passes and blocks at these shapes (q/k already folded); the Hopper
  passes decline a separable term. A closed form (``closed``: the name of the call's one
  Toeplitz term's, which the tiles can evaluate) goes into the Triton tiles in place of
  their gather, except where the route table has the Hopper passes (which read the vector)
  measured faster than the Triton kernel, and than that closed form where it measured it."""
  tiles = "roll" if device.platform == "tpu" else "gather"
  choose = lambda block_q=None: blocks.kernel_blocks(  # noqa: E731
      q_len, k_len, qk_dim, v_dim, itemsize=jnp.dtype(dtype).itemsize, has_bias=bias,
      tiles=tiles, precision=precision,
      budget=blocks.memory_budget(tiles, device.compute_capability), block_q=block_q)
  hopper = both = False
  if bias and not separable and tiles == "gather":
    # The Hopper kernels take 64-row query blocks; where they fit and the table measured them
    # fastest, the forward (and the backward) run there.
    chosen = choose(hopper_flash.BLOCK_Q)
    takes = lambda backward: relative_flash.hopper_takes(  # noqa: E731
        dtype, chosen, has_bias=True, backward=backward)
    hopper = takes(False) and table.hopper_way(
        dtype=jnp.dtype(dtype).name, length=math.sqrt(q_len * k_len), head_dim=v_dim,
        device=device.kind, compute_capability=device.compute_capability, closed=closed)
    both = hopper == "both" and takes(True)
  if not hopper:
    chosen = choose()
  return KernelPlan(tiles=tiles, forward="hopper" if hopper else "tiles",
                    backward="hopper" if both else "tiles", blocks=chosen, bias=bias,
                    zero_first=zero_first, dropout=dropout, separable=separable,
                    closed=closed is not None and not hopper)


def _channel_terms(forms: Sequence[TermForm], entries: Sequence[str], q_shape: Sequence[int],
                   k_shape: Sequence[int], dtype, *, mask: str, causal: bool, dropout: bool,
                   segments: bool, implementation: str | None, device: Device) -> list[int]:
  """The terms whose key vectors fold into q/k channels (:mod:`posenc_jax.terms.channels`),
  or none: under a causal mask, on a GPU, in bfloat16 (float16's range cannot hold ``s / c``
  at long lengths; float32 does not run on cuDNN), when every term is ``causal_separable`` or
  already in q/k (a transform, a fold), nothing needs the kernel (packed segments, dropout,
  a 4-D mask) and cuDNN takes the folded width without a bias. ``q_shape``: q's after the
  folds so far; ``k_shape``: ``[B, Lk, H]``."""
  candidates = [i for i, (f, e) in enumerate(zip(forms, entries))
                if f.causal_separable and e not in ("transform", "fold")]
  if (not candidates or not causal or dropout or segments or mask == "full"
      or device.platform != "gpu" or implementation == "xla"
      or jnp.dtype(dtype) != jnp.dtype(jnp.bfloat16)
      or any(e not in ("transform", "fold") for i, e in enumerate(entries)
             if i not in candidates)):
    return []
  width = q_shape[-1] + channel_count(dtype)
  width += -width % 8
  why = cudnn_unsupported((*q_shape[:3], width), (*k_shape, width), dtype, has_bias=False,
                          backend=device.platform,
                          compute_capability=float(device.compute_capability or 0))
  return [] if why else candidates


def plan(q_shape: Sequence[int], k_shape: Sequence[int], v_shape: Sequence[int], dtype,
         forms: Sequence[TermForm], *, mask: str = "none", causal: bool = False,
         dropout: bool = False, segments: bool = False, route: str = "auto",
         implementation: str | None = None, precision: str = "float32",
         device: Device, table: route_table.RouteTable) -> Plan:
  """How attention over these shapes and terms runs on ``device`` (module docstring).

  Args:
    q_shape, k_shape, v_shape: ``[B, Lq, H, D]``, ``[B, Lk, H, D]``, ``[B, Lk, H, Dv]``
      (after the terms' q/k transforms).
    dtype: the compute dtype of q, k and v.
    forms: each term's :meth:`~posenc_jax.terms.Term.fused_form`.
    mask: ``"none"``, ``"key"`` (``[B, Lk]``) or ``"full"`` (broadcastable to
      ``[B, H, Lq, Lk]``); ``causal``: keys after the query are masked.
    dropout: attention dropout is drawn (a rate and a key given).
    segments: packed segment ids go with the call.
    route: ``"auto"``, ``"reference"`` or ``"fused"``.
    implementation: dot_product_attention's, ``"xla"`` or ``"cudnn"``; None: cuDNN where
      :func:`cudnn_unsupported` allows.
    precision: ``"float32"`` or ``"tensorfloat32"`` (the kernel's blocks depend on it).
    device: the :class:`Device` to plan for; ``table``: the measured crossovers.

  Returns:
    The :class:`Plan`.
  """
  names = tuple(f.name for f in forms)
  chosen = choose_route(route, forms, device.platform)
  batch, q_len, heads, head_dim = q_shape
  k_len, v_dim = k_shape[1], v_shape[-1]
  if chosen == "reference":
    return Plan("reference", "reference", ("logits",) * len(forms), names, head_dim,
                notes=("route='reference' was asked for" if route == "reference" else
                       f"a term cannot fuse ({', '.join(f.name for f in forms if not f.fusable)})"
                       if any(not f.fusable for f in forms) else
                       "auto on CPU: a materialised term costs less than folding, and Pallas "
                       "only interprets",))
  dtype_name = jnp.dtype(dtype).name
  length = math.sqrt(q_len * k_len)
  entries, notes, zero_firsts, width = [], [], set(), head_dim
  points_of = table.whose(device.kind, device.compute_capability)
  if points_of not in (None, device.kind):
    notes.append(f"{device.kind} has no route-table points of its own: it reads {points_of}'s, "
                 f"of the same compute capability {device.compute_capability}")
  # A lone Toeplitz term in closed form can run in the Triton tiles ("registers" below).
  toeplitz_forms = [f for f in forms if f.entry == "toeplitz"]
  closed = (toeplitz_forms[0].closed if len(toeplitz_forms) == 1 and device.platform != "tpu"
            else None)
  for form in forms:
    # Dropout and packed segments need the kernel (cuDNN draws its own mask, takes no ids).
    if (not dropout and not segments and form.table_form is not None
        and table.materialise(form.table_form, dtype=dtype_name, length=length,
                              head_dim=head_dim, rank=form.rank, device=device.kind,
                              compute_capability=device.compute_capability,
                              closed=closed if form.entry == "toeplitz" else None)):
      entries.append("table")
      notes.append(f"the route table has {form.name} materialised at L={length:g} on "
                   f"{points_of} {dtype_name}")
      continue
    entry = {"none": "transform", "fold": "fold", "toeplitz": "kernel", "bias": "bias",
             "separable": "vectors"}[form.entry]
    entries.append(entry)
    width += form.rank if entry == "fold" else 0
    if entry == "kernel":
      zero_firsts.add(form.zero_first)
  folds = _channel_terms(forms, entries, (batch, q_len, heads, width), (batch, k_len, heads),
                         dtype, mask=mask, causal=causal, dropout=dropout, segments=segments,
                         implementation=implementation, device=device)
  if folds:
    entries = ["channels" if i in folds else e for i, e in enumerate(entries)]
    width += channel_count(dtype)
    notes.append(f"{', '.join(names[i] for i in folds)}: separable under the causal mask, "
                 f"folded into {channel_count(dtype)} q/k channels for cuDNN without a bias")
  if closed and "kernel" in entries:
    entries[entries.index("kernel")] = "registers"  # "offsets" below where the kernel does not run
  else:
    closed = None
  width += -width % 8
  dense = any(e in ("bias", "table") for e in entries)
  toeplitz = "kernel" in entries or closed is not None
  separable = "vectors" in entries
  key_mask = mask in ("none", "key")
  kernel_fits = not dense and key_mask and len(zero_firsts) <= 1
  if not kernel_fits:
    notes.append("the kernel takes no " + ("dense bias" if dense else "4-D mask" if not key_mask
                                            else "mix of [CLS]-reset and plain Toeplitz terms"))
  folded_q, folded_k = (batch, q_len, heads, width), (batch, k_len, heads, width)
  if implementation is None:
    # A 4-D mask or packed segments reach cuDNN as a full [B, 1, Lq, Lk] bias.
    full_mask = not key_mask or (segments and not kernel_fits)
    why = cudnn_unsupported(folded_q, folded_k, dtype,
                            has_bias=dense or toeplitz or separable or full_mask,
                            backend=device.platform,
                            compute_capability=float(device.compute_capability or 0))
    implementation = "xla" if why else "cudnn"
    if why and device.platform == "gpu":
      notes.append(f"no cuDNN: {why}")
  kernel = lambda closed=closed: _kernel_plan(  # noqa: E731
      q_len, k_len, width, v_dim, dtype, bias=toeplitz, zero_first=True in zero_firsts,
      dropout=dropout, separable=separable, closed=closed, precision=precision, device=device,
      table=table)
  if dropout and not kernel_fits:
    return Plan("fused", "reference", ("logits",) * len(forms), names, head_dim,
                points_of=points_of,
                notes=(*notes, "dropout: the reference route draws the kernel's mask"))
  if (kernel_fits and not toeplitz and not separable and device.platform == "tpu"
      and splash_fits(q_len, k_len)
      and not dropout):
    return Plan("fused", "splash", tuple(entries), names, width, points_of=points_of,
                notes=tuple(notes))
  # Packed segments: cuDNN (through dot_product_attention) has no segment ids; the kernel has.
  # Dropout: cuDNN's mask is its own; the kernel draws the reference route's.
  if kernel_fits and (toeplitz or separable or implementation == "xla" or segments or dropout):
    chosen_kernel = kernel()
    if closed:
      name = names[entries.index("registers")]
      if chosen_kernel.closed:
        notes.append(f"{name}'s bias is a closed form: the Triton tiles evaluate it from its "
                     "parameters instead of gathering an offset vector")
      else:
        entries = ["kernel" if e == "registers" else e for e in entries]
        notes.append(f"{name}'s bias is a closed form, but the route table has the Hopper "
                     "passes (which read the offset vector) measured faster here")
    return Plan("fused", "kernel", tuple(entries), names, width, kernel=chosen_kernel,
                points_of=points_of, notes=tuple(notes))
  entries = [{"kernel": "offsets", "registers": "offsets", "vectors": "broadcast"}.get(e, e)
             for e in entries]
  mask_4d = mask != "none" or segments
  fallback = None
  if implementation != "cudnn" or not mask_4d:
    how = "mask" if mask_4d else None
  elif not key_mask or segments:
    how = "full"
  else:
    how = "lengths or kernel" if kernel_fits else "lengths or full"
    fallback = kernel(closed=None) if kernel_fits else None  # the vectors, as the entries say
  return Plan("fused", "dot_product_attention", tuple(entries), names, width,
              implementation=implementation, mask=how, kernel=fallback, points_of=points_of,
              notes=tuple(notes))


def mask_kind(mask: jax.Array | None) -> str:
  """``mask``'s :data:`MASK_KINDS` entry."""
  return "none" if mask is None else "key" if mask.ndim == 2 else "full"


def plan_for(q: jax.Array, k: jax.Array, v: jax.Array, terms: Sequence[Term] = (), *,
             mask: jax.Array | None = None, causal: bool = False, dropout: bool = False,
             segment_ids: jax.Array | None = None, route: str = "auto",
             implementation: str | None = None, precision: str = "float32",
             device: Device | None = None,
             table: route_table.RouteTable | None = None) -> Plan:
  """The plan :func:`posenc_jax.attend` follows for these arguments (arrays or
  :class:`jax.ShapeDtypeStruct` s; ``terms`` after :meth:`Term.with_key_length` and the q/k
  transforms, as attend has them). ``device`` / ``table`` None: :func:`current_device` /
  :func:`posenc_jax.route_table.current`."""
  return plan(q.shape, k.shape, v.shape, q.dtype, [t.fused_form() for t in terms],
              mask=mask_kind(mask), causal=causal, dropout=dropout,
              segments=segment_ids is not None, route=route, implementation=implementation,
              precision=precision, device=current_device() if device is None else device,
              table=route_table.current() if table is None else table)
