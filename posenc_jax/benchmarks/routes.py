"""Each attention kernel and route at one shape, forward and forward+backward, as time ratios.

  python -m posenc_jax.benchmarks.routes [--batch 8] [--length 128] [--heads 12]
      [--head_dim 64] [--causal] [--dtype float32|bfloat16] [--repeats 10] [--json out.json]
      [--rank R] [--route_table routes.json]

It times attention alone, q/k/v ``[B, L, H, D]`` (``--batch``,
``--length``, ``--heads``, ``--head_dim``; self-attention, ``Lq = Lk = L``), once
per kernel of :data:`ATTENTION_KERNELS`: the Pallas Toeplitz kernel with an
offset bias ``[H, 2L - 1]`` (and again with attention dropout 0.1), the Pallas
kernel without a bias, cuDNN (``jax.nn.dot_product_attention``) without a bias
and with the bias materialised as ``[1, H, L, L]``, with ``--causal`` causal ALiBi and FoX's
forget gates folded into q/k channels for cuDNN (:mod:`posenc_jax.terms.channels`), the
materialised XLA reference route without and with that bias, and, where the package is
installed (``pip install tokamax``) on a GPU, openxla/tokamax's Mosaic GPU and Triton
attention without a bias and with that bias materialised. ``--rank R`` adds two rows for a
batch-free factored term ``u.v`` of rank ``R`` (DIET-ABS's ``d_p``) on the fused route: folded into q/k
(``D + R`` wide) and materialised as a ``[1, H, L, L]`` bias. Each row that is a route
attention can take runs through :func:`posenc_jax.attend` (the bias as a Toeplitz term of
the offset vector, its ways forced by :func:`posenc_jax.route_table.using`), so it times what
attention runs; before timing, the row's route plan
(:func:`posenc_jax.route_plan.plan_for`) must be the one it is named for, else the row is
``n/a (attend plans ...)``, and the ``--json`` rows say the plan. The band tiles and the
Hopper forward with one warpgroup are kernel variants, not plans: they call the kernel
directly. ``--route_table FILE`` adds this run's
comparisons (the Toeplitz kernel against the materialised bias, and with ``--rank``
folding against materialising) to a table of :mod:`posenc_jax.route_table`, which
``attend``'s fused route reads from ``$POSENC_JAX_ROUTE_TABLE`` to pick the faster
way per device kind, dtype and length. Each row has the forward pass and the forward+backward pass
(output and the gradients of q, k, v and the bias, the cotangent a fixed random
``[B, L, H, D]``): milliseconds per call (median of ``--repeats`` timed runs after
a compiling warm-up, each run enough back-to-back calls to last about 20 ms, so a
fast kernel's dispatch overhead does not count), TFLOP/s, and the time ratio to
cuDNN without a bias, timed alternately with it in the same run (> 1: slower).
Where cuDNN cannot run (CPU, TPU, float32) the ratios are to the first of
:data:`RATIO_BASELINES` that runs, and the output says which (``ratio to: xla no
bias``); a kernel that cannot run or fails to compile is a row ``n/a (<reason>)``.
FLOPs count as FlashAttention's benchmark does: forward ``4 B H L^2 D`` (q k^T
and p v, 2 flops per multiply-add), halved with ``--causal``; forward+backward
3.5 times the forward (backward 2.5: dq, dk, dv, dp and the recomputed q k^T).
Float32 inputs multiply exactly on every row (the routes' default precision); on
GPU measure bfloat16:

  python -m posenc_jax.benchmarks.routes --batch 1 --length 16384 --dtype bfloat16 \\
      --json attention_16k.json
  python -m posenc_jax.benchmarks.routes --batch 32 --length 512 --dtype bfloat16 \\
      --json attention_512.json

On CPU the Pallas kernels run in interpret mode: only tiny shapes are quick there.
Compilation is excluded. Every flag is checked (and the ``--json`` and ``--route_table``
paths made) before anything compiles; a bad one is one line
``posenc_jax.benchmarks.routes: --<flag>: got ...; allowed: ...``.
"""

from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from posenc_jax import cli, route_plan, route_table
from posenc_jax.attention import attend
from posenc_jax.benchmarks import flags
from posenc_jax.benchmarks.timing import seconds, timed, timed_against
from posenc_jax.kernels import blocks, relative_flash, relative_flash_attention
from posenc_jax.models.config import DTYPES
from posenc_jax.route_plan import cudnn_unsupported
from posenc_jax.schemes.alibi import LinearDistance
from posenc_jax.schemes.kerple import KernelDistance
from posenc_jax.schemes.t5 import BucketedOffsets
from posenc_jax.terms import Factored, ForgettingGates, Toeplitz

PROG = "posenc_jax.benchmarks.routes"

ATTENTION_DROPOUT = 0.1  # BERT's attention_probs_dropout_prob
# The Hopper forward with one consumer warpgroup per block (the route table's row has the
# most that fit): how much sharing the key, value and bias copies gains.
HOPPER_ONE_ROW = "pallas toeplitz hopper fwd 1wg"
# Each closed form evaluated in the tiles of both Hopper passes (issue 51): against its row in
# the Triton tiles (route_table.CLOSED_ROW) and the Hopper passes reading the band.
CLOSED_HOPPER_ROW = "pallas {} closed hopper"
# The closed forms timed in the tiles: (row name, offset function, parameters per head). T5's
# buckets name no closed_form (the plan keeps them on the offset vector): timed to decide.
CLOSED_FORMS = (*((fn.closed_form, fn, width) for fn, width in (
    (LinearDistance(), 1), (KernelDistance("log"), 2), (KernelDistance("power"), 2))),
                ("t5", BucketedOffsets(), 32))


def offset_vector(table: jax.Array, rel: jax.Array) -> jax.Array:
  """The bench's Toeplitz ``offset_fn`` (:class:`~posenc_jax.terms.Toeplitz`): its table is
  the offset vector itself, ``[H, 2L - 1]`` holding offsets ``-(L - 1) .. L - 1`` in order;
  ``rel`` int32 ``[N]`` gives ``[H, N]``, each offset's entry (a gather: the gradient reaches
  the vector)."""
  return jnp.take(table, rel + (table.shape[-1] - 1) // 2, axis=-1)


class Request(NamedTuple):
  """The :func:`posenc_jax.attend` call that produces a row (a route attend can take).

  Attributes:
    term: ``toeplitz`` (a :class:`~posenc_jax.terms.Toeplitz` term whose table is the offset
      vector ``[H, 2L - 1]``, :func:`offset_vector`), ``factored`` (a batch-free
      :class:`~posenc_jax.terms.Factored` term ``u.v`` of rank ``--rank``), ``alibi`` (causal
      ALiBi, slopes ``|x_h0| + 0.1`` of the vector), ``fox`` (forget gates from biases
      ``x_h0 + 2`` alone) or None (no term).
    route: attend's ``route``.
    implementation: attend's ``implementation``.
    ways: the ways forced over an empty route table, as ``(name, way)`` pairs of
      :meth:`posenc_jax.route_table.RouteTable.forcing`'s keywords.
  """

  term: str | None
  route: str = "fused"
  implementation: str | None = None
  ways: tuple[tuple[str, bool | str], ...] = ()

  @property
  def table(self) -> route_table.RouteTable:
    """The route table attend reads for the row (:func:`posenc_jax.route_table.using`)."""
    return route_table.RouteTable().forcing(**dict(self.ways))


class Kernel(NamedTuple):
  """One row of the table: what it measures, and the attend call that runs it.

  Attributes:
    name: the row's name.
    family: ``pallas`` (:func:`posenc_jax.kernels.relative_flash_attention`), ``cudnn``
      (:func:`jax.nn.dot_product_attention` on cuDNN), ``channels`` (a separable causal term
      folded into q/k channels, then cuDNN), ``xla`` (``attend``'s materialised
      ``reference`` route) or ``fused`` (``attend``'s fused route with a batch-free
      :class:`~posenc_jax.terms.Factored` term of rank ``--rank``: ``bias`` False folds it into
      q/k, True materialises it).
    bias: adds the Toeplitz term: Pallas as the offset vector ``[H, 2L - 1]``, cuDNN and XLA
      materialised as ``[1, H, L, L]``; ``fused``: see above.
    request: the :class:`Request` whose route plan is the row's (checked before timing:
      :func:`plan_problem`); None for the kernel variants, not plans (band tiles, the Hopper
      forward with one warpgroup), which call the Pallas kernel directly.
    dropout: attention-dropout rate (Pallas only).
    forward: the Pallas kernel's forward (``tiles`` or ``hopper``, as
      :func:`~posenc_jax.kernels.relative_flash_attention`'s).
    warpgroups: the Hopper forward's consumer warpgroups (a kernel variant); None: the most
      that fit.
    tiles: the Triton kernels' bias tiles (a kernel variant: ``band``); None: the plan's.
    backward: the Pallas kernel's backward (``tiles`` or ``hopper``).
    closed: ``(offset_fn, R)``: a closed-form bias evaluated in the tiles (a kernel variant),
      its ``[H, R]`` parameters taken from the row's offset vector (its first ``R`` entries,
      repeated where it is shorter, ``|x| + 0.1``, so that
      the gradient reaches the vector as the other rows'); None: the vector.
    tokamax: the ``tokamax`` family's implementation (``tokamax.dot_product_attention``'s
      ``implementation``: ``mosaic`` or ``triton``), its bias materialised as
      ``[1, H, L, L]``.
  """

  name: str
  family: str
  bias: bool
  request: Request | None
  dropout: float = 0.0
  forward: str = "tiles"
  warpgroups: int | None = None
  tiles: str | None = None
  backward: str = "tiles"
  closed: tuple[Callable, int] | None = None
  tokamax: str | None = None

  @property
  def bias_text(self) -> str:
    if self.family == "fused":
      return "factored u.v, " + ("materialised [1, H, L, L]" if self.bias else "folded: D+R wide")
    if self.family == "channels":
      return f"{self.request.term} key vector in q/k channels"
    text = ("offsets [H, 2L-1]" if self.family == "pallas" else "materialised [1, H, L, L]"
            ) if self.bias else "none"
    if self.closed:
      text = f"closed form {type(self.closed[0]).__name__} in the tiles, [H, {self.closed[1]}]"
    if self.forward == "hopper":
      text += ", Hopper forward" + (f", {self.warpgroups} warpgroup(s)" if self.warpgroups
                                    else "")
    if self.backward == "hopper":
      text += ", Hopper backward"
    if self.tiles:
      text += f", {self.tiles} tiles"
    return f"{text}, dropout {self.dropout}" if self.dropout else text


def _kernel_toeplitz(hopper: bool | str = False) -> Request:
  """The Toeplitz term on the fused route, kept in the kernel with these Hopper passes."""
  return Request("toeplitz", ways=(("toeplitz", False), ("hopper", hopper)))


ATTENTION_KERNELS = (
    Kernel("pallas toeplitz", "pallas", bias=True, request=_kernel_toeplitz()),
    Kernel("pallas toeplitz band", "pallas", bias=True, request=None, tiles="band"),
    Kernel(route_table.HOPPER_ROW, "pallas", bias=True, request=_kernel_toeplitz(True),
           forward="hopper"),
    Kernel(HOPPER_ONE_ROW, "pallas", bias=True, request=None, forward="hopper", warpgroups=1),
    Kernel(route_table.HOPPER_BOTH_ROW, "pallas", bias=True, request=_kernel_toeplitz("both"),
           forward="hopper", backward="hopper"),
    *(Kernel(row.format(name), "pallas", bias=True, request=None,
             closed=(fn, width), forward=passes, backward=passes)
      for row, passes in ((route_table.CLOSED_ROW, "tiles"), (CLOSED_HOPPER_ROW, "hopper"))
      for name, fn, width in CLOSED_FORMS),
    Kernel("pallas toeplitz dropout", "pallas", bias=True, request=_kernel_toeplitz(),
           dropout=ATTENTION_DROPOUT),
    # Bias-free attention runs the kernel where dot_product_attention would run XLA's.
    Kernel("pallas no bias", "pallas", bias=False, request=Request(None, implementation="xla")),
    Kernel("cudnn no bias", "cudnn", bias=False, request=Request(None, implementation="cudnn")),
    Kernel("cudnn bias", "cudnn", bias=True,
           request=Request("toeplitz", implementation="cudnn", ways=(("toeplitz", True),))),
    # Causal ALiBi and the forget gates with --causal: the key vector folded into q/k channels
    # for cuDNN without a bias (posenc_jax.terms.channels); n/a without --causal.
    Kernel("cudnn alibi channels", "channels", bias=True, request=Request("alibi")),
    Kernel("cudnn fox channels", "channels", bias=True, request=Request("fox")),
    Kernel("xla no bias", "xla", bias=False, request=Request(None, route="reference")),
    Kernel("xla bias", "xla", bias=True, request=Request("toeplitz", route="reference")),
    # A maintained base kernel to measure against cuDNN and ours (issue 51): openxla/tokamax.
    *(Kernel(f"tokamax {implementation}" + (" bias" if bias else " no bias"), "tokamax",
             bias=bias, request=None, tokamax=implementation)
      for implementation in ("mosaic", "triton") for bias in (False, True)),
)
# With --rank: a factored term on the fused route, folded and materialised.
FACTORED_KERNELS = (
    Kernel("fused factored folded", "fused", bias=False,
           request=Request("factored", ways=(("factored", False),))),
    Kernel("fused factored materialised", "fused", bias=True,
           request=Request("factored", ways=(("factored", True),))),
)
# What the ratios divide by: the first of these that runs on the device.
RATIO_BASELINES = ("cudnn no bias", "xla no bias", "pallas no bias")
MODES = ("fwd", "fwd_bwd")
MODE_TITLES = {"fwd": "fwd", "fwd_bwd": "fwd+bwd"}
STEP_SECONDS = 0.02  # a timed run repeats a fast kernel's call to last about this long
MAX_CALLS = 1000


def attention_flops(batch: int, length: int, heads: int, head_dim: int,
                    causal: bool) -> dict[str, float]:
  """FLOPs of one attention call by mode, as FlashAttention's benchmark counts them.

  ``fwd``: ``4 B H L^2 D`` (q k^T and p v, ``2 B H L^2 D`` each: a multiply-add is 2
  flops), halved when causal; ``fwd_bwd``: 3.5 times that (the backward pass is 2.5
  forwards: dq, dk, dv, dp and the recomputed q k^T). Softmax, bias and dropout are
  not counted.
  """
  forward = 4.0 * batch * heads * length * length * head_dim / (2 if causal else 1)
  return {"fwd": forward, "fwd_bwd": 3.5 * forward}


def _terms(request: Request, x) -> list:
  """``request``'s terms from the row's input ``x``: the offset vector ``[H, 2L - 1]``, or
  for a factored term ``(u, v)``, each ``[L, H, R]`` (arrays or shapes)."""
  if request.term == "toeplitz":
    return [Toeplitz(x, offset_vector)]
  if request.term == "alibi":  # causal ALiBi, its slopes read from the vector
    return [Toeplitz(jnp.abs(x[:, :1]) + 0.1, LinearDistance(causal=True))]
  if request.term == "fox":  # bias-only forget gates (no layer input), one bias per head
    return [ForgettingGates(jnp.zeros((1, x.shape[0]), jnp.float32), x[:, 0] + 2.0)]
  return [Factored(*x)] if request.term == "factored" else []


def row_plan(kernel: Kernel, q: jax.Array, *, causal: bool, rank: int = 0) -> route_plan.Plan:
  """The route plan :func:`posenc_jax.attend` follows for ``kernel``'s request
  (:func:`posenc_jax.route_plan.plan_for`, this device) on q/k/v shaped and typed like ``q``
  ``[B, L, H, D]``; ``rank``: a factored term's."""
  _, length, heads, _ = q.shape
  request = kernel.request
  x = (jax.ShapeDtypeStruct((length, heads, rank), jnp.float32),) * 2 if (
      request.term == "factored") else jax.ShapeDtypeStruct((heads, 2 * length - 1), jnp.float32)
  if request.term in ("alibi", "fox"):  # their parameters are read from the vector's values
    x = jnp.zeros(x.shape, x.dtype)
  return route_plan.plan_for(q, q, q, _terms(request, x), causal=causal,
                             dropout=kernel.dropout > 0, route=request.route,
                             implementation=request.implementation, table=request.table)


def plan_problem(kernel: Kernel, plan: route_plan.Plan) -> str | None:
  """Why ``plan`` (:func:`row_plan`) is not the one ``kernel``'s row is about, one line naming
  it, or None: the Pallas rows need the kernel with their bias, passes and dropout, the cuDNN
  rows dot_product_attention on cuDNN (the bias materialised once per call), the XLA rows the
  reference route, the factored rows the term folded or materialised."""
  runs = plan.kernel if plan.runner == "kernel" else None
  wanted = {
      "pallas": runs is not None and (runs.bias, runs.forward, runs.backward, runs.dropout) == (
          kernel.bias, kernel.forward, kernel.backward, kernel.dropout > 0),
      "cudnn": (plan.runner, plan.implementation, plan.entries) == (
          "dot_product_attention", "cudnn", ("table",) if kernel.bias else ()),
      "xla": plan.route == "reference",
      "fused": plan.entries == (("table",) if kernel.bias else ("fold",)),
      "channels": (plan.runner, plan.implementation, plan.entries) == (
          "dot_product_attention", "cudnn", ("channels",)),
  }[kernel.family]
  return None if wanted else f"attend plans {_one_line(plan, '; ')}"


def _one_line(plan: route_plan.Plan, joint: str) -> str:
  return joint.join(line.strip() for line in str(plan).splitlines())


def attention_kernel(kernel: Kernel, q: jax.Array, *, causal: bool, rng: jax.Array,
                     rank: int = 0):
  """``kernel`` as ``(f, reason)``.

  ``f(q, k, v, offset_bias)`` takes q/k/v ``[B, L, H, D]`` (``q`` here gives their shape
  and dtype) and the float32 offset bias ``[H, 2L - 1]`` (a row without a bias ignores it)
  and returns ``[B, L, H, D]``; for the ``fused`` family the fourth argument is instead the
  factored term's ``(u, v)``, each ``[L, H, R]`` (``rank`` R). A row with a request calls
  :func:`posenc_jax.attend` under its route table (read when ``f`` is traced), the offset
  vector as a :class:`~posenc_jax.terms.Toeplitz` term (materialised ones expand it inside
  ``f``, so the backward pass carries its gradient back to the vector, as in training); a
  kernel variant calls :func:`~posenc_jax.kernels.relative_flash_attention` directly.
  ``reason`` is why the row cannot run on this backend (:func:`hopper_unsupported`,
  :func:`posenc_jax.route_plan.cudnn_unsupported`, then :func:`plan_problem`), else None.
  ``rng``: the dropout's PRNG key.
  """
  reason = (hopper_unsupported(q) if "hopper" in (kernel.forward, kernel.backward) else
            cudnn_unsupported(q.shape, q.shape, q.dtype, has_bias=kernel.bias)
            if kernel.family == "cudnn" else None)
  if kernel.family == "tokamax":
    return _tokamax_attention(kernel.tokamax, kernel.bias, causal), tokamax_unsupported()
  request = kernel.request
  if request is None:
    if kernel.tiles == "band" and jax.default_backend() == "tpu":
      reason = "band tiles are the Triton kernels' (GPU); a TPU builds roll tiles"
    if kernel.closed:
      offset_fn, width = kernel.closed
      return (lambda q, k, v, ob: relative_flash_attention(
          q, k, v, offset_fn=offset_fn,
          offset_params=jnp.abs(ob[:, jnp.arange(width) % ob.shape[1]]) + 0.1,
          causal=causal, forward=kernel.forward, backward=kernel.backward)), reason
    return (lambda q, k, v, ob: relative_flash_attention(
        q, k, v, ob, causal=causal, forward=kernel.forward, warpgroups=kernel.warpgroups,
        tiles=kernel.tiles, backward=kernel.backward)), reason
  reason = reason or plan_problem(kernel, row_plan(kernel, q, causal=causal, rank=rank))

  def through_attend(q, k, v, x):
    with route_table.using(request.table):  # at trace time
      return attend(q, k, v, _terms(request, x), causal=causal, route=request.route,
                    implementation=request.implementation, dropout_rate=kernel.dropout,
                    dropout_rng=rng if kernel.dropout else None)

  return through_attend, reason


def _tokamax_attention(implementation: str, bias: bool, causal: bool):
  """``f(q, k, v, offset_bias)`` of :func:`attention_kernel` on
  ``tokamax.dot_product_attention`` (the same ``[B, L, H, D]`` layout), the bias
  materialised ``[1, H, L, L]`` as the Toeplitz term does it (its gradient reaching the
  offset vector), in the inputs' dtype."""

  def f(q, k, v, offset_bias):
    import tokamax  # noqa: PLC0415 - optional: its rows say so where it is absent

    length = q.shape[1]
    dense = (Toeplitz(offset_bias, offset_vector).materialise(length, length).value
             .astype(q.dtype) if bias else None)
    return tokamax.dot_product_attention(q, k, v, bias=dense, is_causal=causal,
                                         implementation=implementation)

  return f


def tokamax_unsupported() -> str | None:
  """Why the ``tokamax`` rows cannot run here, or None: the package is optional, and its
  Mosaic GPU and Triton implementations refuse any backend but a GPU when traced (they
  cannot be lowered for CUDA from a CPU host, as ours are)."""
  if importlib.util.find_spec("tokamax") is None:
    return "tokamax is not installed (pip install tokamax; a device call: scripts/gpu_session.py)"
  if jax.default_backend() != "gpu":
    return f"tokamax's kernels run on GPUs only; backend {jax.default_backend()}"
  return None


def hopper_unsupported(q: jax.Array) -> str | None:
  """Why the Hopper kernels cannot run q/k/v shaped and typed like ``q`` here, or None: they
  need a GPU of compute capability 9.x (or the CPU, interpreted) and the forward's shapes
  (:func:`posenc_jax.kernels.relative_flash.hopper_fits`; the backward's are a subset up to
  head dim 128, which padded head dims above 128 never meet either)."""
  capability = blocks.gpu_compute_capability()
  if jax.default_backend() != "cpu" and not (capability or "").startswith("9."):
    return f"Mosaic GPU wgmma needs compute capability 9.x; this device: {capability}"
  length, head_dim = q.shape[1], q.shape[-1]
  if not relative_flash.hopper_fits(length, length, head_dim, head_dim, q.dtype):
    return (f"takes bfloat16/float16 and head dims padded to multiples of 64 within shared "
            f"memory; got {q.dtype}, D={head_dim}")
  return None


def forward_backward(f):
  """``(q, k, v, offset_bias, do) -> (out, (dq, dk, dv, d offset_bias))``: a training step's
  attention work for ``f`` of :func:`attention_kernel`, ``do`` the output's cotangent
  ``[B, L, H, D]`` (the output is kept: it is the next layer's input)."""

  def fwd_bwd(q, k, v, offset_bias, do):
    out, pull = jax.vjp(f, q, k, v, offset_bias)
    return out, pull(do)

  return fwd_bwd


def _reason(error: BaseException) -> str:
  """One short line for a failure (a table cell: no '|')."""
  lines = [line.strip() for line in str(error).splitlines() if line.strip()]
  text = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
  text = text.replace("|", "/")
  return text if len(text) <= 120 else text[:117] + "..."


class AttentionStep(NamedTuple):
  """One compiled mode of one kernel: ``step()`` runs ``calls`` calls back to back (so a
  fast kernel's time is not its dispatch overhead); None, with ``reason``, where it failed."""

  step: Callable[[], None] | None
  calls: int = 0
  reason: str | None = None


def attention_steps(f, args) -> dict[str, AttentionStep]:
  """``{mode: AttentionStep}`` for ``fwd`` and ``fwd_bwd`` of ``f`` on ``args`` (q, k, v,
  offset bias, output cotangent ``[B, L, H, D]``), each compiled and run twice (warm-up),
  the second run sizing ``calls`` to fill :data:`STEP_SECONDS`."""

  def step_of(fn, inputs, calls):
    def step():
      for _ in range(calls):  # dispatched asynchronously; earlier outputs are freed
        out = fn(*inputs)
      jax.block_until_ready(out)  # the device runs them in order
    return step

  steps = {}
  for mode, fn, inputs in (("fwd", f, args[:4]), ("fwd_bwd", forward_backward(f), args)):
    fn = jax.jit(fn)
    try:
      step_of(fn, inputs, 1)()  # compile
      once = seconds(step_of(fn, inputs, 1))
      calls = max(1, min(MAX_CALLS, math.ceil(STEP_SECONDS / max(once, 1e-9))))
      steps[mode] = AttentionStep(step_of(fn, inputs, calls), calls)
    except Exception as e:  # noqa: BLE001 - a kernel that fails here is a row, not a crash
      steps[mode] = AttentionStep(None, reason=_reason(e))
  return steps


def _cells(row: dict) -> list[str]:
  """The timing cells of a row: ms, TFLOP/s and ratio per mode, or ``n/a (<reason>)``."""
  reasons = [row[f"{mode}_na"] for mode in MODES]
  if reasons[0] and len(set(reasons)) == 1:  # the whole kernel cannot run: say so once
    return [f"n/a ({reasons[0]})"] + [""] * (3 * len(MODES) - 1)
  cells = []
  for mode in MODES:
    if row[f"{mode}_na"]:
      cells += [f"n/a ({row[f'{mode}_na']})", "", ""]
    else:
      ratio = row[f"{mode}_ratio"]
      cells += [f"{row[f'{mode}_ms']:.3f}", f"{row[f'{mode}_tflops']:.3g}",
                "n/a" if ratio is None else f"{ratio:.2f}"]
  return cells


def attention_table(args) -> dict:
  """Times every kernel of :data:`ATTENTION_KERNELS` at ``args``' shape (module docstring),
  printing a header and a markdown table row by row; returns the ``--json`` document."""
  shape = (args.batch, args.length, args.heads, args.head_dim)
  keys = jax.random.split(jax.random.key(0), 6)
  q, k, v, do = (jax.random.normal(key, shape, args.dtype) for key in keys[:4])
  ob = 0.1 * jax.random.normal(keys[4], (args.heads, 2 * args.length - 1), jnp.float32)
  rng = keys[5]

  uv = tuple(0.1 * jax.random.normal(key, (args.length, args.heads, args.rank))
             for key in jax.random.split(keys[5])) if args.rank else None
  kernels = ATTENTION_KERNELS + (FACTORED_KERNELS if args.rank else ())

  def prepare(kernel):
    f, reason = attention_kernel(kernel, q, causal=args.causal, rng=rng, rank=args.rank)
    if reason:
      return {mode: AttentionStep(None, reason=reason) for mode in MODES}
    return attention_steps(f, (q, k, v, uv if kernel.family == "fused" else ob, do))

  prepared, baseline, passed_over = {}, None, []
  for name in RATIO_BASELINES:
    prepared[name] = prepare(next(k for k in ATTENTION_KERNELS if k.name == name))
    reason = next((s.reason for s in prepared[name].values() if s.reason), None)
    if reason is None:
      baseline = name
      break
    passed_over.append(f"{name}: n/a, {reason}")
  flops = attention_flops(*shape, causal=args.causal)
  device = jax.devices()[0]
  print(f"device: {device.device_kind} ({jax.default_backend()}); attention B={args.batch} "
        f"L={args.length} H={args.heads} D={args.head_dim} {args.dtype}, "
        f"{'causal' if args.causal else 'not causal'}; ms per call, median of {args.repeats} "
        f"runs of back-to-back calls (~{STEP_SECONDS * 1e3:.0f} ms each) after a warm-up, each "
        f"timed alternately with the ratio's baseline; fwd+bwd = output and d(q, k, v, "
        f"bias); TFLOP/s from {flops['fwd']:.4g} FLOPs fwd (4BHL^2D, halved causal), "
        f"{flops['fwd_bwd']:.4g} fwd+bwd (3.5x)")
  note = f" ({'; '.join(passed_over)})" if passed_over else ""
  print(f"ratio to: {baseline or 'none (no baseline runs)'}{note}")
  titles = [f"{MODE_TITLES[m]} {c}" for m in MODES for c in ("ms", "TFLOP/s", "ratio")]
  print("| " + " | ".join(["kernel", "bias", *titles]) + " |")
  print("|" + "|".join([":--", ":--"] + ["--:"] * len(titles)) + "|", flush=True)
  rows = []
  for kernel in kernels:
    name = kernel.name
    steps = prepared[name] if name in prepared else prepare(kernel)
    plan = None if kernel.request is None else _one_line(
        row_plan(kernel, q, causal=args.causal, rank=args.rank), " | ")
    row = {"kernel": name, "bias": kernel.bias_text, "plan": plan}
    for mode in MODES:
      step, calls, reason = steps[mode]
      seconds = ratio = None
      if step is not None:
        try:
          if baseline is None or name == baseline:
            (seconds,) = timed([step], args.repeats)
            ratio = None if baseline is None else 1.0
          else:
            base = prepared[baseline][mode]
            seconds, base_s = timed_against(step, base.step, args.repeats)
            ratio = seconds / calls / (base_s / base.calls)
          seconds /= calls
        except Exception as e:  # noqa: BLE001 - e.g. out of memory on a later run
          seconds, reason = None, _reason(e)
      row.update({f"{mode}_ms": None if seconds is None else 1e3 * seconds,
                  f"{mode}_tflops": None if seconds is None else flops[mode] / seconds / 1e12,
                  f"{mode}_ratio": ratio, f"{mode}_calls": calls or None, f"{mode}_na": reason})
    rows.append(row)
    print("| " + " | ".join([name, kernel.bias_text, *_cells(row)]) + " |", flush=True)
  return {"mode": "attention", "device": device.device_kind, "backend": jax.default_backend(),
          "compute_capability": blocks.gpu_compute_capability(), "batch": args.batch,
          "length": args.length, "heads": args.heads,
          "head_dim": args.head_dim, "rank": args.rank or 0, "dtype": args.dtype,
          "causal": args.causal, "repeats": args.repeats, "ratio_to": baseline,
          "ratio_note": passed_over,
          "flops": flops, "rows": rows}


def add_route_points(path: str, document: dict) -> None:
  """Adds the route comparisons of a run (``document``: its ``--json``) to the table file
  ``path``, printing one line per form (the point and the way it picks, or why there is none)."""
  found, missing = route_table.points_from_attention(document)
  route_table.write(path, found)
  for point in found:
    hopper = "" if point.hopper_ms is None else f", hopper {point.hopper_ms:.3f} ms"
    closed = "".join(f"; {name} closed {ms:.3f} ms -> {point.fastest(name)}"
                     for name, ms in point.closed_ms)
    print(f"route table {path}: {point.form} at L={point.length}"
          f"{f' rank {point.rank}' if point.rank else ''} on {point.device} {point.dtype}: "
          f"default {point.default_ms:.3f} ms, materialised {point.materialised_ms:.3f} ms"
          f"{hopper} -> {point.fastest()}{closed}")
  for line in missing:
    print(f"route table {path}: {line}")


def parse_args(argv=None):
  """The flags of ``argv``, checked (and the ``--json`` and ``--route_table`` paths made)
  before anything compiles; a bad one exits with one line ``<prog>: --<flag>: got ...;
  allowed: ...``."""
  # No abbreviations: the steps tool's --route would otherwise be taken for --route_table.
  parser = cli.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0], allow_abbrev=False)
  parser.add_argument("--length", type=cli.positive_int, default=128, help="tokens L")
  parser.add_argument("--batch", type=cli.positive_int, default=8, help="examples B")
  parser.add_argument("--heads", type=cli.positive_int, default=12, help="heads H (default 12)")
  parser.add_argument("--head_dim", type=cli.positive_int, default=64,
                      help="head dim D (default 64)")
  parser.add_argument("--causal", action="store_true", help="causal attention (FLOPs halved)")
  parser.add_argument("--rank", type=cli.positive_int, default=0,
                      help="also time a factored term of this rank on the fused route, folded "
                      "into q/k and materialised")
  parser.add_argument("--route_table", default=None,
                      help="add this run's route comparisons to this posenc_jax.route_table "
                      "file (created if missing)")
  parser.add_argument("--dtype", type=cli.one_of(DTYPES), default="float32",
                      help=f"compute dtype: {', '.join(DTYPES)}")
  parser.add_argument("--repeats", type=cli.positive_int, default=10,
                      help="timed runs of each kernel, the median is reported (default 10)")
  parser.add_argument("--json", default=None, help="also write the rows to this file")
  args = flags.parse_checked(parser, argv, outputs=("json", "route_table"))
  if args.route_table is not None:
    try:  # a file to add to: it must be a table already
      route_table.read(args.route_table)
    except ValueError as e:
      parser.error(f"--route_table: {e}")
  return args


def main(argv=None):
  args = parse_args(argv)
  document = attention_table(args)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(document, f, indent=2)
  if args.route_table:
    add_route_points(args.route_table, document)
  return document["rows"]


if __name__ == "__main__":
  cli.run_command(main)
