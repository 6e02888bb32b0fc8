"""Each scheme's training cost against the baseline's (DIET Table 1), with the functions of
:mod:`posenc_jax.benchmarks.model_steps`, on the model the experiment trains: the causal
language model for an LM experiment (extrapolation, probes; with the corpus's vocabulary),
else the masked-LM BERT (the causal LM for a causal-only scheme and its baseline,
:func:`~posenc_jax.benchmarks.model_steps.model_of`). At each of the cost's lengths (by
default the training length and the longest evaluated one) with the same tokens per step,
each scheme's train step (forward, backward, AdamW) and its inference (the forward pass)
are timed alternately with the baseline's in this process, round by round; the baseline's
train step is also timed against itself, so that the table shows the timing's own noise
beside the ratios. Peak memory is what XLA
plans for the compiled step (on every backend, and per scheme, unlike a device's running
peak).
"""

from __future__ import annotations

from typing import Any

import ml_collections

from posenc_jax.messages import first_line


def peak_bytes(size: str, scheme: str, **dims) -> int | None:
  """The peak memory XLA plans for the compiled train step of
  :func:`posenc_jax.benchmarks.model_steps.model_steps` (``dims``: its keywords;
  :func:`posenc_jax.memory.planned_bytes`)."""
  import jax  # noqa: PLC0415

  from posenc_jax import memory  # noqa: PLC0415
  from posenc_jax.benchmarks.model_steps import model_steps  # noqa: PLC0415

  _, train, _, init = model_steps(size, scheme, **dims)
  return memory.planned_bytes(
      jax.jit(train).lower(*jax.eval_shape(init)).compile().memory_analysis())


def spread(ratios: list[float]) -> dict[str, float]:
  """``{"median", "min", "max"}`` of one scheme's per-round time ratios."""
  ordered = sorted(ratios)
  return {"median": ordered[len(ordered) // 2], "min": ordered[0], "max": ordered[-1]}


def measure(size: str, schemes: list[str], baseline: str, cost: ml_collections.ConfigDict,
            lengths: list[int], lm: bool = False, corpus: str | None = None) -> dict[str, Any]:
  """The cost table: ``{"baseline", "size", "batch", "lengths", "dtype", "note", "noise":
  {length: spread of the baseline timed against itself}, "rows": {scheme: {"model",
  "lengths": {length: {"train_ms", "train_ratio": spread, "infer_ms", "infer_ratio": spread,
  "peak_bytes", "memory_ratio"}}} or {"na": reason}}}``.

  Args:
    size: the experiment's size preset (``bert_tiny``, ...).
    schemes, baseline: position presets; every row is timed against ``baseline``.
    cost: the experiment's ``cost`` fields (``batch``: sequences per step at the first
      length, the same tokens per step at the others; ``repeats``; ``dtype``).
    lengths: the sequence lengths timed, increasing.
    lm: time the causal LM for every scheme (an LM experiment); else ``model_of`` decides.
    corpus: the causal LM's corpus name (its vocabulary), e.g. ``stdlib``.
  """
  from posenc_jax.benchmarks import model_steps, timing  # noqa: PLC0415

  sizes = {preset: name for name, preset in model_steps.BERT_SIZES.items()}
  tokens = cost.batch * lengths[0]
  batches = {length: max(1, tokens // length) for length in lengths}

  def head(scheme):
    return "lm" if lm else model_steps.model_of(scheme, baseline)

  on_lm = [scheme for scheme in schemes if head(scheme) == "lm"]
  models = ("the causal LM the experiment trains" + (f" ({corpus})" if corpus else "")
            if lm else "BERT MLM" + (f" (causal LM for {', '.join(on_lm)}: causal-only, and "
                                     f"{baseline} beside them)" if on_lm else ""))
  note = (f"Cost: {models} train step and inference (forward pass) at {size}, {tokens} "
          f"tokens per step ({', '.join(f'batch {batches[n]} x {n}' for n in lengths)}), "
          f"{cost.dtype}; per "
          f"round against {baseline} on the same model, median (min-max) of {cost.repeats} "
          f"rounds; noise: {baseline} timed against itself; peak memory as XLA plans the "
          "compiled step.")
  out = {"baseline": baseline, "size": size, "batch": cost.batch, "lengths": lengths,
         "dtype": cost.dtype, "model": "lm" if lm else "auto", "note": note, "noise": {},
         "rows": {}}
  if size not in sizes:
    return out | {"note": f"Cost: not measured: {size} is no size of posenc_jax.benchmarks "
                          f"({', '.join(sizes)})"}
  for length in lengths:
    dims = dict(batch=batches[length], length=length, dtype=cost.dtype, corpus=corpus)
    bases = {}  # head -> the baseline's (train step, inference, peak bytes) on that model
    for scheme in schemes:
      model = head(scheme)
      if model not in bases:  # a baseline that does not build raises: no ratio without it
        steps = model_steps.compiled_steps(sizes[size], baseline, head=model, **dims)[:2]
        bases[model] = (*steps, peak_bytes(sizes[size], baseline, head=model, **dims))
        if model == head(baseline):
          out["noise"][str(length)] = spread(timing.ratios(steps[0], steps[0], cost.repeats)[2])
      base_train, base_infer, base_bytes = bases[model]
      row = out["rows"].setdefault(scheme, {"model": model, "lengths": {}})
      if "na" in row:
        continue
      try:
        train, infer = (base_train, base_infer) if scheme == baseline else (
            model_steps.compiled_steps(sizes[size], scheme, head=model, **dims)[:2])
        train_s, _, ratios = timing.ratios(train, base_train, cost.repeats)
        infer_s, _, infer_ratios = timing.ratios(infer, base_infer, cost.repeats)
        memory = peak_bytes(sizes[size], scheme, head=model, **dims)
      except Exception as e:  # noqa: BLE001 - one scheme that does not build is one n/a row
        out["rows"][scheme] = {"na": f"at length {length}: {first_line(e)}"}
        continue
      row["lengths"][str(length)] = {
          "train_ms": 1e3 * train_s, "train_ratio": spread(ratios),
          "infer_ms": 1e3 * infer_s, "infer_ratio": spread(infer_ratios), "peak_bytes": memory,
          "memory_ratio": memory / base_bytes if memory and base_bytes else None}
  return out
