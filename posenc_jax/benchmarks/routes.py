"""Each scheme's cost in a whole BERT, or each attention kernel's (--attention), as time ratios.

  python -m posenc_jax.bench [--size tiny|small|base] [--length 128] [--batch 8]
      [--schemes bert,diet_abs,diet_rel,...] [--baseline bert] [--route auto]
      [--dtype float32|bfloat16] [--repeats 10] [--json out.json]
  python -m posenc_jax.bench --compile [--size tiny,base] [--schemes bert,...] [--length 128]
      [--batch 8] [--dtype float32|bfloat16] [--repeats 1] [--json out.json]
  python -m posenc_jax.bench --attention [--batch 8] [--length 128] [--heads 12]
      [--head_dim 64] [--causal] [--dtype float32|bfloat16] [--repeats 10] [--json out.json]
      [--rank R] [--route_table routes.json]

For every scheme preset (``posenc_jax.presets.SCHEMES``) it builds the
masked-LM BERT of the given size, compiles a training step (forward,
backward, AdamW update) and an inference forward pass, and times both after
warm-up as the median of ``--repeats`` runs, each timed alternately with the
baseline (default ``bert``: Devlin et al.'s input table; ``--baseline none``
compares against the same attention with no positional term) so that load
drifts cancel. ``--route`` sets the attention route of every model
(``reference``, ``fused``, ``auto``; see :mod:`posenc_jax.attention`), e.g.
``--route fused --baseline none --schemes diet_rel`` measures the Pallas
Toeplitz kernel against itself without a bias.
It prints milliseconds, the ratio to the baseline, tokens/s, peak device
memory where the device reports it, MFU (analytic FLOPs over the
device's peak) on accelerators, and the seconds of the first train step and
inference pass (compile and one run, layers scanned); ``--json`` writes the
same rows. A scheme that is also the baseline is compiled once.

``--attention`` times attention alone, q/k/v ``[B, L, H, D]`` (``--batch``,
``--length``, ``--heads``, ``--head_dim``; self-attention, ``Lq = Lk = L``), once
per kernel of :data:`ATTENTION_KERNELS`: the Pallas Toeplitz kernel with an
offset bias ``[H, 2L - 1]`` (and again with attention dropout 0.1), the Pallas
kernel without a bias, cuDNN (``jax.nn.dot_product_attention``) without a bias
and with the bias materialised as ``[1, H, L, L]``, and the materialised XLA
reference route (:func:`posenc_jax.attend` ``route="reference"``) without and
with that bias. ``--rank R`` adds two rows for a batch-free factored term ``u.v`` of
rank ``R`` (DIET-ABS's ``d_p``) on the fused route: folded into q/k (``D + R`` wide) and
materialised as a ``[1, H, L, L]`` bias. ``--route_table FILE`` adds this run's
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

  python -m posenc_jax.bench --attention --batch 1 --length 16384 --dtype bfloat16 \
      --json attention_16k.json
  python -m posenc_jax.bench --attention --batch 32 --length 512 --dtype bfloat16 \
      --json attention_512.json

``--compile`` times compilation instead (trace, lower and compile from abstract
inputs; nothing runs): for each size and scheme the train step and the inference
pass with unrolled layers and with scanned ones (``model.scan_layers``), and the
ratio, e.g. BERT-tiny and BERT-base in one run::

  python -m posenc_jax.bench --compile --size tiny,base --length 128 --batch 8

On CPU the Pallas kernels run in interpret mode: only tiny shapes are quick there.
Compilation is excluded. Every flag is checked (and the ``--json`` path made) before
anything compiles; a bad one is one line ``bench: --<flag>: got ...; allowed: ...``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from posenc_jax import cli, route_table
from posenc_jax.attention import ROUTES, attend, cudnn_unsupported
from posenc_jax.kernels import blocks, relative_flash, relative_flash_attention
from posenc_jax.kernels.dropout import dropout_seed
from posenc_jax.models import BertForMaskedLM, model_config
from posenc_jax.models.config import DTYPES
from posenc_jax.presets import SCHEMES, preset_config
from posenc_jax.terms import Bias, Factored, toeplitz_bias
from posenc_jax.training.metrics import peak_flops, train_flops_per_step
from posenc_jax.training.objectives import weighted_cross_entropy

SIZES = {"tiny": "bert_tiny", "small": "bert_small", "base": "bert_base"}
DEFAULT_SCHEMES = ("bert", "shaw", "t5", "tupe_a", "tupe_r", "diet_rel", "diet_rel_share",
                   "diet_abs", "diet_abs_share", "alibi", "rope")
BASELINE = "bert"
# Presets that set a position scheme (not the modifiers: segment_per_head, pre_ln, bf16, ...).
POSITION_SCHEMES = tuple(name for name, preset in SCHEMES.items() if "scheme" in preset)


def model_steps(size: str, scheme: str, *, batch: int, length: int, dtype: str,
                route: str = "auto", scan_layers: bool = True):
  """The masked-LM BERT's uncompiled steps: ``(cfg, train, infer, init)``.

  ``train(params, opt_state)`` is one AdamW step on a fixed random batch (15% of the
  tokens weighted), ``infer(params)`` the forward pass, ``init()`` the initial
  ``(params, opt_state)``.
  """
  cfg = preset_config(f"{SIZES[size]},{scheme}").model
  cfg = model_config(cfg, max_len=max(length, cfg.get("max_len", 512)), dtype=dtype,
                     dropout_rate=0.0, attention_dropout_rate=0.0, route=route,
                     scan_layers=scan_layers)
  model = BertForMaskedLM(cfg)
  key_ids, key_mask = jax.random.split(jax.random.key(0))
  ids = jax.random.randint(key_ids, (batch, length), 6, cfg.vocab_size)
  segments = jnp.zeros_like(ids)
  mask = jnp.ones_like(ids)
  weights = (jax.random.uniform(key_mask, (batch, length)) < 0.15).astype(jnp.float32)
  tx = optax.adamw(1e-4)

  def loss(p):
    logits = model.apply({"params": p}, ids, segments, mask)
    total, weight, _ = weighted_cross_entropy(logits, ids, weights)
    return total / weight

  def train(p, s):
    grads = jax.grad(loss)(p)
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s

  def init():
    params = model.init(jax.random.key(1), ids, segments, mask)["params"]
    return params, tx.init(params)

  return cfg, train, lambda p: model.apply({"params": p}, ids, segments, mask), init


def compiled_steps(size: str, scheme: str, *, batch: int, length: int, dtype: str,
                   route: str = "auto"):
  """Zero-argument (train step, inference) callables of the compiled model, its config, and
  the seconds of the first train step and inference pass (compile, then one run each)."""
  cfg, train, infer, init = model_steps(size, scheme, batch=batch, length=length, dtype=dtype,
                                        route=route)
  train, infer = jax.jit(train), jax.jit(infer)
  state = list(jax.jit(init)())

  def train_step():
    state[0], state[1] = train(state[0], state[1])
    jax.block_until_ready(state[0])

  def infer_step():
    jax.block_until_ready(infer(state[0]))

  start = time.perf_counter()
  train_step()  # compile and warm up
  first = time.perf_counter()
  infer_step()
  return train_step, infer_step, cfg, {"train_s": first - start,
                                       "infer_s": time.perf_counter() - first}


def compile_seconds(size: str, scheme: str, *, batch: int, length: int, dtype: str,
                    route: str = "auto", scan_layers: bool = True) -> dict[str, float]:
  """Seconds to trace, lower and compile the model's train step and its inference pass,
  from abstract inputs (nothing is initialised or run): ``{"train_s", "infer_s"}``."""
  _, train, infer, init = model_steps(size, scheme, batch=batch, length=length, dtype=dtype,
                                      route=route, scan_layers=scan_layers)
  params, opt_state = jax.eval_shape(init)
  jax.clear_caches()  # nothing traced for an earlier model is reused
  out = {}
  for name, fn, inputs in (("train_s", train, (params, opt_state)), ("infer_s", infer, (params,))):
    start = time.perf_counter()
    jax.jit(fn).lower(*inputs).compile()
    out[name] = time.perf_counter() - start
  return out


def _seconds(step) -> float:
  start = time.perf_counter()
  step()
  return time.perf_counter() - start


def timed(steps, repeats: int) -> list[float]:
  """Median seconds of each of ``steps`` over ``repeats`` rounds, each round running every step
  once in turn (so load drifts cancel between them)."""
  rounds = [[_seconds(step) for step in steps] for _ in range(repeats)]
  return [sorted(times)[len(times) // 2] for times in zip(*rounds)]


def timed_against(step, baseline, repeats: int) -> tuple[float, float]:
  """Median seconds of ``step`` and of ``baseline``, timed alternately (so load drifts cancel)."""
  step_s, baseline_s = timed((step, baseline), repeats)
  return step_s, baseline_s


def peak_memory() -> int | None:
  """Peak bytes in use on the first device, where the backend reports it (GPU, TPU)."""
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


# --attention: one attention call per kernel, forward and forward+backward.

ATTENTION_DROPOUT = 0.1  # BERT's attention_probs_dropout_prob
# The Hopper forward with one consumer warpgroup per block (the route table's row has the
# most that fit): how much sharing the key, value and bias copies gains.
HOPPER_ONE_ROW = "pallas toeplitz hopper fwd 1wg"


class Kernel(NamedTuple):
  """One row of the ``--attention`` table.

  Attributes:
    name: the row's name.
    family: ``pallas`` (:func:`posenc_jax.kernels.relative_flash_attention`), ``cudnn``
      (:func:`jax.nn.dot_product_attention`), ``xla`` (:func:`posenc_jax.attend`'s
      materialised ``reference`` route) or ``fused`` (``attend``'s fused route with a
      batch-free :class:`~posenc_jax.terms.Factored` term of rank ``--rank``, in the way
      :func:`posenc_jax.route_table.forced` sets: ``bias`` False folds it into q/k, True
      materialises it).
    bias: adds the Toeplitz bias: Pallas as the offset vector ``[H, 2L - 1]``, cuDNN and
      XLA materialised as ``[1, H, L, L]``; ``fused``: see above.
    dropout: attention-dropout rate (Pallas only).
    forward: the Pallas kernel's forward (``tiles`` or ``hopper``, as
      :func:`~posenc_jax.kernels.relative_flash_attention`'s).
    warpgroups: the Hopper forward's consumer warpgroups; None: the most that fit.
    tiles: the Triton kernels' bias tiles (``gather`` or ``band``, as
      :func:`~posenc_jax.kernels.relative_flash_attention`'s); None: the default.
    backward: the Pallas kernel's backward (``tiles`` or ``hopper``).
  """

  name: str
  family: str
  bias: bool
  dropout: float = 0.0
  forward: str = "tiles"
  warpgroups: int | None = None
  tiles: str | None = None
  backward: str = "tiles"

  @property
  def bias_text(self) -> str:
    if self.family == "fused":
      return "factored u.v, " + ("materialised [1, H, L, L]" if self.bias else "folded: D+R wide")
    text = ("offsets [H, 2L-1]" if self.family == "pallas" else "materialised [1, H, L, L]"
            ) if self.bias else "none"
    if self.forward == "hopper":
      text += ", Hopper forward" + (f", {self.warpgroups} warpgroup(s)" if self.warpgroups
                                    else "")
    if self.backward == "hopper":
      text += ", Hopper backward"
    if self.tiles:
      text += f", {self.tiles} tiles"
    return f"{text}, dropout {self.dropout}" if self.dropout else text


ATTENTION_KERNELS = (
    Kernel("pallas toeplitz", "pallas", bias=True),
    Kernel("pallas toeplitz band", "pallas", bias=True, tiles="band"),
    Kernel(route_table.HOPPER_ROW, "pallas", bias=True, forward="hopper"),
    Kernel(HOPPER_ONE_ROW, "pallas", bias=True, forward="hopper", warpgroups=1),
    Kernel(route_table.HOPPER_BOTH_ROW, "pallas", bias=True, forward="hopper",
           backward="hopper"),
    Kernel("pallas toeplitz dropout", "pallas", bias=True, dropout=ATTENTION_DROPOUT),
    Kernel("pallas no bias", "pallas", bias=False),
    Kernel("cudnn no bias", "cudnn", bias=False),
    Kernel("cudnn bias", "cudnn", bias=True),
    Kernel("xla no bias", "xla", bias=False),
    Kernel("xla bias", "xla", bias=True),
)
# With --rank: a factored term on the fused route, folded and materialised.
FACTORED_KERNELS = (
    Kernel("fused factored folded", "fused", bias=False),
    Kernel("fused factored materialised", "fused", bias=True),
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


def attention_kernel(kernel: Kernel, q: jax.Array, *, causal: bool, seed: jax.Array):
  """``kernel`` as ``(f, reason)``.

  ``f(q, k, v, offset_bias)`` takes q/k/v ``[B, L, H, D]`` (``q`` here gives their shape
  and dtype) and the float32 offset bias ``[H, 2L - 1]`` (a kernel without a bias ignores
  it; materialised ones expand it with :func:`posenc_jax.terms.toeplitz_bias` inside
  ``f``, so the backward pass carries its gradient back to the vector, as in training) and
  returns ``[B, L, H, D]``; for the ``fused`` family the fourth argument is instead the
  factored term's ``(u, v)``, each ``[L, H, R]``. ``reason`` is why the kernel cannot run on this backend
  (:func:`posenc_jax.attention.cudnn_unsupported` for cuDNN), else None. ``seed``: the
  ``[1, 1]`` int32 dropout seed.
  """
  length = q.shape[1]
  bias = lambda ob: toeplitz_bias(ob, length, length)  # noqa: E731  [1, H, L, L] float32
  if kernel.family == "pallas":
    reason = hopper_unsupported(q) if "hopper" in (kernel.forward, kernel.backward) else None
    if kernel.tiles == "band" and jax.default_backend() == "tpu":
      reason = "band tiles are the Triton kernels' (GPU); a TPU builds roll tiles"
    return (lambda q, k, v, ob: relative_flash_attention(
        q, k, v, ob if kernel.bias else None, causal=causal, dropout_rate=kernel.dropout,
        dropout_seed=seed if kernel.dropout else None, forward=kernel.forward,
        warpgroups=kernel.warpgroups, tiles=kernel.tiles, backward=kernel.backward)), reason
  if kernel.family == "fused":
    def factored(q, k, v, uv):
      with route_table.forced(factored=kernel.bias):  # at trace time
        return attend(q, k, v, [Factored(*uv)], causal=causal, route="fused")
    return factored, None
  if kernel.family == "cudnn":
    reason = cudnn_unsupported(q.shape, q.shape, q.dtype, has_bias=kernel.bias)
    return (lambda q, k, v, ob: jax.nn.dot_product_attention(
        q, k, v, bias=bias(ob).astype(q.dtype) if kernel.bias else None, is_causal=causal,
        implementation="cudnn")), reason
  return (lambda q, k, v, ob: attend(q, k, v, [Bias(bias(ob))] if kernel.bias else [],
                                     causal=causal, route="reference")), None


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
      once = _seconds(step_of(fn, inputs, 1))
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
  seed = dropout_seed(keys[5])

  uv = tuple(0.1 * jax.random.normal(key, (args.length, args.heads, args.rank))
             for key in jax.random.split(keys[5])) if args.rank else None
  kernels = ATTENTION_KERNELS + (FACTORED_KERNELS if args.rank else ())

  def prepare(kernel):
    f, reason = attention_kernel(kernel, q, causal=args.causal, seed=seed)
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
    row = {"kernel": name, "bias": kernel.bias_text}
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
          "batch": args.batch, "length": args.length, "heads": args.heads,
          "head_dim": args.head_dim, "rank": args.rank or 0, "dtype": args.dtype,
          "causal": args.causal, "repeats": args.repeats, "ratio_to": baseline, "ratio_note": passed_over,
          "flops": flops, "rows": rows}


def add_route_points(path: str, document: dict) -> None:
  """Adds the route comparisons of an ``--attention`` run to the table file ``path``,
  printing one line per form (the point and the way it picks, or why there is none)."""
  found, missing = route_table.points_from_attention(document)
  route_table.write(path, found)
  for point in found:
    hopper = "" if point.hopper_ms is None else f", hopper {point.hopper_ms:.3f} ms"
    print(f"route table {path}: {point.form} at L={point.length}"
          f"{f' rank {point.rank}' if point.rank else ''} on {point.device} {point.dtype}: "
          f"default {point.default_ms:.3f} ms, materialised {point.materialised_ms:.3f} ms"
          f"{hopper} -> {point.fastest}")
  for line in missing:
    print(f"route table {path}: {line}")


# Flags of one mode only, with their defaults: given in the other mode, they are an error.
MODEL_FLAGS = {"size": ("tiny",), "schemes": DEFAULT_SCHEMES, "baseline": BASELINE,
               "route": "auto"}
ATTENTION_FLAGS = {"heads": 12, "head_dim": 64, "causal": False, "rank": 0,
                   "route_table": None}


def compile_table(args) -> list[dict]:
  """``--compile``: per size and scheme, the compile seconds of unrolled and scanned layers
  (``model.scan_layers``) and their ratio, each the median of ``--repeats`` compiles made
  alternately."""
  print(f"device: {jax.devices()[0].device_kind}; trace + lower + compile of the MLM BERT's "
        f"train step (fwd+bwd+AdamW) and inference pass, B={args.batch} L={args.length} "
        f"{args.dtype}, route {args.route}; median of {args.repeats}, unrolled and scanned "
        "layers compiled alternately")
  print(f"{'size':<6}{'scheme':<16}{'layers':>7}{'train unrolled s':>18}{'scanned s':>11}"
        f"{'x faster':>9}{'infer unrolled s':>18}{'scanned s':>11}{'x faster':>9}")
  dims = dict(batch=args.batch, length=args.length, dtype=args.dtype, route=args.route)
  rows = []
  for size in args.size:
    for scheme in args.schemes:
      rounds = [[compile_seconds(size, scheme, scan_layers=scan, **dims) for scan in (False, True)]
                for _ in range(args.repeats)]
      median = lambda values: sorted(values)[len(values) // 2]  # noqa: E731
      row = {"size": size, "scheme": scheme,
             "layers": model_config(preset_config(SIZES[size]).model).num_layers}
      for part in ("train_s", "infer_s"):
        unrolled = median([r[0][part] for r in rounds])
        scanned = median([r[1][part] for r in rounds])
        row |= {f"{part}_unrolled": unrolled, f"{part}_scanned": scanned,
                f"{part}_speedup": unrolled / scanned}
      rows.append(row)
      print(f"{size:<6}{scheme:<16}{row['layers']:>7}{row['train_s_unrolled']:>18.2f}"
            f"{row['train_s_scanned']:>11.2f}{row['train_s_speedup']:>9.2f}"
            f"{row['infer_s_unrolled']:>18.2f}{row['infer_s_scanned']:>11.2f}"
            f"{row['infer_s_speedup']:>9.2f}", flush=True)
  return rows


def parse_args(argv=None) -> argparse.Namespace:
  """The flags of ``argv``, checked (and the ``--json`` and ``--route_table`` paths made)
  before anything compiles, defaults filled in; a bad one exits with one line ``bench:
  --<flag>: got ...; allowed: ...``."""
  parser = cli.ArgumentParser(prog="bench", description=__doc__.splitlines()[0])
  parser.add_argument("--attention", action="store_true",
                      help="time each attention kernel at one shape (forward, forward+backward) "
                      "instead of whole BERTs")
  parser.add_argument("--compile", action="store_true",
                      help="time compiling each model with unrolled and with scanned layers "
                      "instead of running it")
  parser.add_argument("--size", type=cli.one_of(SIZES, sep=","), default=None,
                      help=f"BERT size: {', '.join(SIZES)} (default tiny); with --compile a "
                      "comma-separated list")
  parser.add_argument("--length", type=cli.positive_int, default=128, help="tokens per example")
  parser.add_argument("--batch", type=cli.positive_int, default=8, help="examples per step")
  parser.add_argument("--heads", type=cli.positive_int, default=None,
                      help="--attention: heads H (default 12)")
  parser.add_argument("--head_dim", type=cli.positive_int, default=None,
                      help="--attention: head dim D (default 64)")
  parser.add_argument("--causal", action="store_true", default=None,
                      help="--attention: causal attention (FLOPs halved)")
  parser.add_argument("--rank", type=cli.positive_int, default=None,
                      help="--attention: also time a factored term of this rank on the fused "
                      "route, folded into q/k and materialised")
  parser.add_argument("--route_table", default=None,
                      help="--attention: add this run's route comparisons to this "
                      "posenc_jax.route_table file (created if missing)")
  parser.add_argument("--dtype", type=cli.one_of(DTYPES), default="float32",
                      help=f"compute dtype: {', '.join(DTYPES)}")
  parser.add_argument("--repeats", type=cli.positive_int, default=None,
                      help="timed runs of each step, the median is reported (default 10; "
                      "with --compile 1)")
  parser.add_argument("--schemes", type=cli.one_of(POSITION_SCHEMES, sep=","), default=None,
                      help=f"comma-separated scheme presets: {', '.join(POSITION_SCHEMES)} "
                      f"(default {','.join(DEFAULT_SCHEMES)})")
  parser.add_argument("--baseline", type=cli.one_of(POSITION_SCHEMES), default=None,
                      help=f"scheme preset to divide by (default {BASELINE})")
  parser.add_argument("--route", type=cli.one_of(ROUTES), default=None,
                      help=f"attention route: {', '.join(ROUTES)} (default auto)")
  parser.add_argument("--json", default=None, help="also write the rows to this file")
  args = parser.parse_args(argv)
  unused, used = (MODEL_FLAGS, ATTENTION_FLAGS) if args.attention else (ATTENTION_FLAGS,
                                                                        MODEL_FLAGS)
  for flag in unused:
    if getattr(args, flag) is not None:
      parser.error(f"--{flag}: not with --attention (it times attention alone, every route)"
                   if args.attention else f"--{flag}: only with --attention")
  if args.compile and args.attention:
    parser.error("--compile: not with --attention (it compiles whole models)")
  if args.compile and args.baseline is not None:
    parser.error("--baseline: not with --compile (each model's unrolled layers are its "
                 "baseline)")
  if not args.compile and args.size is not None and len(args.size) > 1:
    parser.error(f"--size: got {','.join(args.size)!r}; one size (a list only with --compile)")
  if args.compile and args.schemes is None:
    args.schemes = (BASELINE,)
  for flag, default in {**unused, **used, "repeats": 1 if args.compile else 10}.items():
    setattr(args, flag, default if getattr(args, flag) is None else getattr(args, flag))
  for flag in ("json", "route_table"):
    if getattr(args, flag) is not None:
      try:  # before anything compiles, so no timing is lost to a bad path
        cli.check_output_file(f"--{flag}", getattr(args, flag))
        if flag == "route_table":  # a file to add to: it must be a table already
          route_table.read(args.route_table)
      except cli.OutputPathError as e:
        parser.error(str(e))
      except ValueError as e:
        parser.error(f"--{flag}: {e}")
  return args


def main(argv=None):
  args = parse_args(argv)
  if args.attention or args.compile:
    document = attention_table(args) if args.attention else {
        "device": jax.devices()[0].device_kind, "batch": args.batch, "length": args.length,
        "dtype": args.dtype, "route": args.route, "rows": compile_table(args)}
    if args.json:
      with open(args.json, "w") as f:
        json.dump(document, f, indent=2)
    if args.attention and args.route_table:
      add_route_points(args.route_table, document)
    return document["rows"]
  args.size = args.size[0]
  dims = dict(batch=args.batch, length=args.length, dtype=args.dtype, route=args.route)
  tokens = args.batch * args.length
  peak = peak_flops(dtype=args.dtype)
  print(f"device: {jax.devices()[0].device_kind}; BERT-{args.size}, B={args.batch} "
        f"L={args.length} {args.dtype}, route {args.route}; median of {args.repeats}, each "
        f"timed alternately with the '{args.baseline}' baseline; train = fwd+bwd+AdamW, "
        f"infer = fwd")
  compiled = {args.baseline: compiled_steps(args.size, args.baseline, **dims)}
  base_train, base_infer, _, _ = compiled[args.baseline]
  ratio = f"x {args.baseline}"[:8]
  print(f"{'scheme':<16}{'train ms':>10}{ratio:>8}{'infer ms':>10}{ratio:>8}"
        f"{'tokens/s':>11}{'peak MB':>9}{'MFU':>7}{'compile s':>11}")
  rows = []
  for scheme in args.schemes:
    if scheme not in compiled:  # the baseline's row times it against itself, compiled once
      compiled[scheme] = compiled_steps(args.size, scheme, **dims)
    train, infer, cfg, first = compiled[scheme]
    train_s, train_base = timed_against(train, base_train, args.repeats)
    infer_s, infer_base = timed_against(infer, base_infer, args.repeats)
    flops = train_flops_per_step(cfg, args.batch, args.length)  # the MLM head at every token
    memory = peak_memory()
    row = {"scheme": scheme, "train_ms": 1e3 * train_s, "train_ratio": train_s / train_base,
           "infer_ms": 1e3 * infer_s, "infer_ratio": infer_s / infer_base,
           "tokens_per_s": tokens / train_s, "peak_bytes": memory,
           "mfu": flops / train_s / peak if peak else None,
           "first_train_s": first["train_s"], "first_infer_s": first["infer_s"]}
    rows.append(row)
    mem = f"{memory / 2**20:>9.0f}" if memory else f"{'n/a':>9}"
    mfu = f"{row['mfu']:>7.1%}" if row["mfu"] is not None else f"{'n/a':>7}"
    print(f"{scheme:<16}{row['train_ms']:>10.2f}{row['train_ratio']:>8.2f}"
          f"{row['infer_ms']:>10.2f}{row['infer_ratio']:>8.2f}{row['tokens_per_s']:>11.0f}"
          f"{mem}{mfu}{row['first_train_s'] + row['first_infer_s']:>11.1f}", flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"device": jax.devices()[0].device_kind, "size": args.size,
                 "baseline": args.baseline, **dims, "rows": rows}, f, indent=2)
  return rows


if __name__ == "__main__":
  main()
