"""How much memory a step needs, estimated before anything is compiled or allocated.

:func:`step_memory` adds up, in bytes, what one device holds at the peak of a training step
(forward, backward, optimizer update) or of an inference pass: the parameters (float32),
the optimizer state and the gradients, the batch, the activations the backward pass keeps
(as ``ModelConfig.remat`` says), the attention arrays that the route materialises (asked of
:func:`posenc_jax.route_plan.plan` for this device: q, k, v and the output in the kernel's
padded layout where the Pallas kernel runs, none where splash attention does, ``[B|1, H, L,
L]`` logits and probabilities on the reference route and XLA's ``dot_product_attention``, the
dense bias on cuDNN), the arrays over ``[L, L]`` that the scheme's own computation holds (as
its class declares, :meth:`~posenc_jax.schemes.base.Scheme.grid_bytes`: CoPE's gates and
positions, FIRE's MLP over the offsets) and the output logits over the vocabulary (the
peak comes at the loss, with the logits, or inside a layer, with its working arrays: only
the larger of the two counts). :func:`available` is what the device has free
(``memory_stats``; on CPU the host's available memory), and :func:`refusal` the one line
that says a step cannot fit::

  from posenc_jax import memory
  estimate = memory.step_memory(cfg, batch=32, length=512, params=params, opt_state=opt_state)
  print(estimate)                      # 1.4 GiB (parameters 0.42 GiB, ...): the total, by part
  print(memory.refusal(estimate, "seq_len", 512))   # None where it fits

The trainer (:mod:`posenc_jax.training.memory`), :func:`posenc_jax.models.generate` and the
evaluate tool (:func:`posenc_jax.evaluation.runs.check_memory`, at each length) refuse a size
that cannot fit with that line, in well under a second. The counts are an
estimate: ``tests/test_memory_estimate.py`` holds them within 1.3 of XLA's own
``compiled.memory_analysis()`` for every scheme (docs/faults.md has the measured ratios),
and a step is refused only beyond :data:`FACTOR`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from posenc_jax import route_plan, route_table
from posenc_jax.schemes import build_scheme
from posenc_jax.schemes.base import GridBytes
from posenc_jax.schemes.registry import scheme_parts
from posenc_jax.terms import TermForm

# The estimate lies within this factor of XLA's compiled peak (argument + output + temp
# bytes, less donated aliases) on CPU, with a margin (within 1.3 for every scheme and on
# the kernel's route at attention-bound sizes): tests/test_memory_estimate.py checks both.
# A step is refused only when its estimate exceeds the free memory by more than this factor.
FACTOR = 1.5
# Activations the backward pass keeps per token and layer (``ModelConfig.remat``), as arrays
# of (d_model in float32, d_model in the compute dtype, mlp_dim in the compute dtype): every
# intermediate (the residual stream and the LayerNorms' work in float32; q/k/v, the attention
# output and projection, the MLP's pre-activation and activation), the matmul outputs alone,
# or the layer's input alone.
KEPT_PER_TOKEN = {"none": (6, 6, 4), "dots": (0, 6, 1), "full": (0, 1, 0)}
# [B, H, L, L] arrays each layer keeps where attention materialises its logits, as (float32,
# compute dtype): the probabilities in float32 (the softmax's backward reads its output) and
# in the compute dtype (the value matmul's input), or the logits (a matmul output, what
# ``dots`` keeps); none under ``full`` (recomputed).
KEPT_ATTENTION = {"none": (1, 1), "dots": (1, 0), "full": (0, 0)}
# The one layer being differentiated at a time: its own intermediates (recomputed under
# remat) and their gradients, [B, H, L, L] arrays (logits, probabilities, their gradients)
# and per-token units of d_model and mlp_dim.
WORKING_ATTENTION = 3
WORKING_PER_TOKEN = (12, 3)
# Where the Pallas kernel runs, bytes per query row (example, head, position) and column of
# its padded q/k and value widths that the layer being differentiated holds: the backward's
# gradients of q, k and v in its layout, in float32 and the compute dtype.
KERNEL_WORKING = 16


@dataclasses.dataclass(frozen=True)
class Estimate:
  """Bytes a step needs on one device, by part (``parts``: name -> bytes, in the order
  they are reported); ``total`` their sum, ``str()`` both in GiB."""

  parts: Mapping[str, int]

  @property
  def total(self) -> int:
    return sum(self.parts.values())

  def __str__(self) -> str:
    shown = ", ".join(f"{name} {gib(size)}" for name, size in self.parts.items() if size)
    return f"{gib(self.total)} ({shown})"


def gib(size: float) -> str:
  """``size`` bytes in GiB to three significant figures (``"0.0312 GiB"``, ``"7.45e+09 GiB"``)."""
  return f"{size / 2**30:.3g} GiB"


def planned_bytes(stats: Any) -> int | None:
  """The bytes XLA plans for a compiled program, from its ``memory_analysis()`` (``stats``;
  None where the backend gives none): arguments + outputs + temporaries, less the outputs
  that alias donated arguments. (``peak_memory_in_bytes`` misses the buffers of a scan's
  layers on CPU.)"""
  if stats is None:
    return None
  return (stats.argument_size_in_bytes + stats.output_size_in_bytes
          + stats.temp_size_in_bytes - stats.alias_size_in_bytes)


def tree_bytes(tree: Any) -> int:
  """Bytes of a tree of arrays or :class:`jax.ShapeDtypeStruct` s."""
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def term_forms(scheme: Any, segment: Any, dims: Mapping[str, int]) -> tuple[TermForm, ...]:
  """The :class:`~posenc_jax.terms.TermForm` of each attention term of ``scheme`` (and of the
  segment scheme ``segment``, None for none) at the model's ``dims``
  (:data:`posenc_jax.schemes.base.DIMENSIONS`), read from the schemes' abstract output over
  8 positions (``jax.eval_shape``: nothing is computed; a term's form does not depend on
  the length)."""
  forms = []
  for config in (scheme, segment):
    if config is None:
      continue
    module = build_scheme(config, **dims)
    ids = jnp.zeros((1, 8), jnp.int32)
    terms = jax.eval_shape(lambda m=module, ids=ids: m.init_with_output(jax.random.key(0), 8,
                                                                        ids)[0])
    forms += [term.fused_form() for term in terms.terms]
  return tuple(forms)


def grid_bytes(scheme: Any, segment: Any, dims: Mapping[str, int]) -> GridBytes:
  """The :class:`~posenc_jax.schemes.base.GridBytes` of the scheme config ``scheme`` and of
  the segment scheme ``segment`` (None for none), summed over their parts, at the model's
  ``dims`` (:data:`posenc_jax.schemes.base.DIMENSIONS`)."""
  declared = [part.module.grid_bytes(part.values, dims)
              for config in (scheme, segment) if config is not None
              for part in scheme_parts(config)]
  return GridBytes(*map(sum, zip(GridBytes(), *declared)))


def scheme_arrays(grid: GridBytes, batch: int, length: int, keys: int, training: bool,
                  remat: str) -> tuple[int, int, int]:
  """``(kept, working, held)``: bytes of the arrays over ``[L, Lk]`` (``Lk = keys``) that the
  scheme's own computation holds (``grid``): those each layer keeps for the backward pass,
  those the layer being computed holds, and the batch-free ones held through the step."""
  pairs = length * keys
  if not training:
    return 0, pairs * batch * grid.forward, pairs * grid.batch_free_forward
  kept = {"none": grid.kept, "dots": grid.kept_dots, "full": 0}[remat]
  # What a layer does not keep, its backward recomputes and holds beside its own work.
  return (pairs * batch * kept, pairs * batch * (grid.working + grid.kept - kept),
          pairs * grid.batch_free)


def attention_arrays(plan: route_plan.Plan, forms: tuple[TermForm, ...], batch: int,
                     heads: int, length: int, keys: int, training: bool, remat: str,
                     dropout: bool, itemsize: int) -> tuple[int, int]:
  """``(kept, working)``: bytes of the ``[B|1, H, L, Lk]`` arrays that ``plan`` materialises
  (``Lk = keys``; ``itemsize``: the compute dtype's), those each layer keeps for the
  backward pass and those the layer being computed holds."""
  square = heads * length * keys * 4  # one float32 [1, H, L, Lk]
  if plan.runner == "kernel":
    # q, k, v and the output in the kernel's layout [B, H, L, width], zero-padded, in the
    # compute dtype, and the log-sum-exp of each row in float32, kept for the backward pass.
    widths = plan.kernel.blocks.qk_dim + plan.kernel.blocks.v_dim
    layout = batch * heads * ((length + keys) * widths * itemsize + length * 4)
    return ((layout, KERNEL_WORKING * batch * heads * length * widths) if training
            else (0, layout))
  if plan.runner == "splash":
    return 0, 0
  # Dense biases: batch-free terms (a table form) once, the others per example.
  bias = sum((1 if form.table_form else batch) * square
             for form, entry in zip(forms, plan.entries)
             if entry in ("bias", "table", "offsets", "logits") and form.entry != "none")
  if plan.mask == "full":
    bias += batch * length * keys  # the bool mask [B, 1, L, Lk]
  logits = plan.runner == "reference" or plan.implementation == "xla"
  if not logits:  # cuDNN: the bias is all that is materialised
    return (bias if training and remat != "full" else 0), bias
  arrays = batch * square
  floats, computed = KEPT_ATTENTION[remat]
  # Attention dropout keeps its multipliers and the dropped probabilities too.
  floats += 2 if dropout and remat == "none" else 0
  kept = (floats * 4 + computed * itemsize) * batch * heads * length * keys
  return (kept if training else 0), bias + WORKING_ATTENTION * arrays


def step_memory(cfg: Any, *, batch: int, length: int, params: Any, opt_state: Any = None,
                scheme: Any = None, predictions: int | None = None, vocab_outputs: bool = True,
                input_bytes: int = 0, micro_batches: int = 1, segments: bool = False,
                causal: bool = False, forms: tuple[TermForm, ...] | None = None,
                device: route_plan.Device | None = None) -> Estimate:
  """The memory one device needs for a step of ``cfg``'s model on ``[batch, length]`` tokens.

  Args:
    cfg: the :class:`~posenc_jax.models.config.ModelConfig` (its ``num_layers`` plus
      ``num_decoder_layers`` layers attend over ``length`` positions).
    batch: B, the rows on this device (a step's batch over the data-parallel devices).
    length: L, positions per row.
    params: the parameter tree (arrays or :class:`jax.ShapeDtypeStruct` s).
    opt_state: the optimizer state tree for a training step; None for inference (no
      gradients, no activations kept).
    scheme: the scheme config attention runs (None: ``cfg.scheme``; a decoder passes its
      causal form).
    predictions: positions per row that get vocabulary logits (the MLM head's; None:
      every position).
    vocab_outputs: the model ends in logits over the vocabulary (MLM, LM, translation).
    input_bytes: the batch's arrays on the device.
    micro_batches: gradient accumulation steps (activations are a micro-batch's).
    segments: packed segment ids go to attention.
    causal: attention is causal.
    forms: the terms' forms (None: :func:`term_forms` of ``scheme`` and ``cfg.segment``).
    device: the :class:`~posenc_jax.route_plan.Device` the route is planned for (None: this
      one).

  Returns:
    The :class:`Estimate`, parts ``parameters``, ``optimizer``, ``gradients``, ``batch``,
    ``activations``, ``attention``, ``scheme`` (the arrays the scheme's own computation holds,
    :func:`grid_bytes`) and ``logits``.
  """
  training = opt_state is not None
  rows = -(-batch // micro_batches)
  heads, head_dim, width = cfg.num_heads, cfg.dim_per_head, cfg.d_model
  scheme = cfg.scheme if scheme is None else scheme
  dims = {"num_layers": cfg.num_layers, "num_heads": heads, "head_dim": head_dim,
          "d_model": width, "max_len": cfg.max_len}
  if forms is None:
    forms = term_forms(scheme, cfg.segment, dims)
  dropout = training and cfg.attention_dropout_rate > 0
  keys = cfg.linformer_k if cfg.attention == "linformer" else length  # Linformer's projected
  plan = route_plan.plan(
      (rows, length, heads, head_dim), (rows, keys, heads, head_dim),
      (rows, keys, heads, head_dim), cfg.compute_dtype, forms, mask="key", causal=causal,
      dropout=dropout, segments=segments, route=cfg.route, precision=cfg.attention_precision,
      device=route_plan.current_device() if device is None else device,
      table=route_table.current())
  remat = cfg.remat if training else "full"  # inference keeps nothing past a layer
  itemsize = cfg.compute_dtype.itemsize
  kept_attention, working_attention = attention_arrays(plan, forms, rows, heads, length, keys,
                                                       training, remat, dropout, itemsize)
  kept_scheme, working_scheme, held_scheme = scheme_arrays(
      grid_bytes(scheme, cfg.segment, dims), rows, length, keys, training, remat)
  layers = cfg.num_layers + cfg.num_decoder_layers
  tokens = rows * length
  kept_float, kept_d, kept_f = KEPT_PER_TOKEN[remat]
  work_d, work_f = WORKING_PER_TOKEN
  kept = ((kept_float * width * 4 + (kept_d * width + kept_f * cfg.mlp_dim) * itemsize) * tokens
          if training else 0)
  working = (work_d * width + work_f * cfg.mlp_dim) * tokens * itemsize
  outputs = rows * (length if predictions is None else predictions)
  # Logits: in a training step the float32 logits that the loss reads and two arrays in the
  # compute dtype (the head's output and its gradient); in a forward pass the float32 logits.
  logits = ((4 + 2 * itemsize if training else 4) * outputs * cfg.vocab_size
            if vocab_outputs else 0)
  # The peak comes either at the loss (the logits and their gradient live) or inside a layer
  # (its working arrays live), whichever holds more: neither outlives its part of the step.
  if logits > working + working_attention + working_scheme:
    working = working_attention = working_scheme = 0
  else:
    logits = 0
  weights = tree_bytes(params)
  return Estimate({
      "parameters": weights,
      "optimizer": tree_bytes(opt_state) if training else 0,
      "gradients": weights * (2 if micro_batches > 1 else 1) if training else 0,
      "batch": input_bytes,
      "activations": layers * (kept + kept_attention) + working,
      "attention": working_attention,
      "scheme": layers * kept_scheme + working_scheme + held_scheme,
      "logits": logits,
  })


def attention_forms(cfg: Any, causal: bool = False) -> tuple[TermForm, ...]:
  """:func:`term_forms` of the terms ``cfg``'s attention runs: its scheme (the scheme's
  decoder form where ``causal``, :func:`posenc_jax.models.config.causal_variant`) and its
  segment scheme, at its dimensions; computed once for many estimates (``forms=``)."""
  from posenc_jax.models.config import causal_variant, scheme_dims  # noqa: PLC0415 - a cycle

  scheme = causal_variant(cfg.scheme) if causal else cfg.scheme
  return term_forms(scheme, cfg.segment, scheme_dims(cfg))


def decode_memory(cfg: Any, *, batch: int, length: int, params: Any) -> Estimate:
  """The memory of cached decoding (:func:`posenc_jax.models.generate`) over ``length``
  positions of ``batch`` rows: the parameters, the KV cache (each layer's keys and values
  ``[B, L, H, D]`` in the compute dtype), the tokens ``[B, L]`` and one step's attention
  arrays ``[B, H, 1, L]`` and logits ``[B, V]`` (float32); ``cfg`` as in
  :func:`step_memory`."""
  layers = cfg.num_layers + cfg.num_decoder_layers
  heads = cfg.num_heads
  return Estimate({
      "parameters": tree_bytes(params),
      "cache": 2 * layers * batch * length * heads * cfg.dim_per_head
               * cfg.compute_dtype.itemsize,
      "tokens": 2 * batch * length * 4,
      "step": batch * (WORKING_ATTENTION * heads * length + 3 * cfg.vocab_size) * 4,
  })


def check_decoding(caller: str, cfg: Any, params: Any, batch: int, prompt: int,
                   max_new_tokens: int) -> None:
  """Raises one ValueError line ``<caller>: max_new_tokens: ...`` (``prompt`` when not even
  one new token fits) when decoding ``max_new_tokens`` after ``prompt`` positions of
  ``batch`` rows (:func:`decode_memory`) needs more memory than is free."""
  free = available()

  def needs(new: int) -> Estimate:
    return decode_memory(cfg, batch=batch, length=prompt + new, params=params)

  estimate = needs(max_new_tokens)
  if refusal(estimate, "max_new_tokens", max_new_tokens, free=free) is None:
    return
  if needs(1).total > free[0]:
    line = refusal(estimate, "prompt", f"[{batch}, {prompt}] ids", free=free,
                   hint=" (fewer rows or positions)")
  else:
    most = largest(lambda n: needs(n).total <= free[0], max_new_tokens)
    line = refusal(estimate, "max_new_tokens", max_new_tokens, free=free,
                   hint=f" (at most about {most} fit)")
  raise ValueError(f"{caller}: {line}")


def largest(fits: Any, high: int) -> int:
  """The largest ``n`` in ``[1, high]`` with ``fits(n)`` (true up to a point, false after
  it), or 0 when ``fits(1)`` is false."""
  low = 0
  while low < high:
    middle = (low + high + 1) // 2
    low, high = (middle, high) if fits(middle) else (low, middle - 1)
  return low


def host_available() -> int:
  """Bytes of host memory available now (``MemAvailable`` of ``/proc/meminfo``, else the
  free physical pages)."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def available(device: jax.Device | None = None) -> tuple[int, str]:
  """``(bytes, where)``: the memory free on ``device`` (None: this process's first device; with
  several processes only their own devices report memory) from its
  ``memory_stats()`` (``bytes_limit - bytes_in_use``), or where the device reports none (CPU)
  the host's available memory; ``where`` names it for a message."""
  device = jax.local_devices()[0] if device is None else device
  stats = device.memory_stats() or {}
  if "bytes_limit" in stats:
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0), f"{device.device_kind} memory"
  return host_available(), "available host memory"


def refusal(estimate: Estimate, field: str, value: Any, *, hint: str = "",
            free: tuple[int, str] | None = None, what: str | None = None) -> str | None:
  """The one line refusing ``field = value`` when ``estimate`` exceeds what is free
  (``free``: :func:`available` when None) by more than :data:`FACTOR`, the estimate's own
  error (a step that could fit is never refused), else None::

    seq_len: got 1000000000; the step needs about 1.2e+12 GiB (parameters ..., attention
    7.23e+11 GiB, ...), more than the 19.5 GiB of available host memory; allowed: a smaller
    seq_len<hint>

  (one line; ``what`` names the thing to shrink where it is not ``field``, e.g. ``length``
  for a list field ``lengths``; ``hint``, e.g. ``" (at most about 2700 fit)"``, ends it).
  """
  size, where = available() if free is None else free
  if estimate.total <= FACTOR * size:
    return None
  return (f"{field}: got {value!r}; the step needs about {estimate}, more than the "
          f"{gib(size)} of {where}; allowed: a smaller {what or field}{hint}")
