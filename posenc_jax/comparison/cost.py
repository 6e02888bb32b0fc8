"""Each scheme's training cost against the baseline's (DIET Table 1), with the functions of
:mod:`posenc_jax.benchmarks.model_steps`: the masked-LM BERT of the experiment's size, or for a
causal-only scheme (and its baseline) the causal language model of that size
(:func:`~posenc_jax.benchmarks.model_steps.model_of`), at ``cost.batch`` x ``cost.length``, its
train step (forward, backward, AdamW) timed alternately with the baseline's on the same model in
this process, and the peak memory XLA plans for that step (compiled memory analysis: on every
backend, and per scheme, unlike a device's running peak).
"""

from __future__ import annotations

from typing import Any

import ml_collections

from posenc_jax.messages import first_line


def peak_bytes(size: str, scheme: str, **dims) -> int | None:
  """The peak memory of the compiled train step of
  :func:`posenc_jax.benchmarks.model_steps.model_steps` (``dims``: its keywords)."""
  import jax  # noqa: PLC0415

  from posenc_jax.benchmarks.model_steps import model_steps  # noqa: PLC0415

  _, train, _, init = model_steps(size, scheme, **dims)
  stats = jax.jit(train).lower(*jax.eval_shape(init)).compile().memory_analysis()
  if stats is None:
    return None
  peak = getattr(stats, "peak_memory_in_bytes", None)
  return peak or (stats.argument_size_in_bytes + stats.output_size_in_bytes
                  + stats.temp_size_in_bytes - stats.alias_size_in_bytes)


def measure(size: str, schemes: list[str], baseline: str,
            cost: ml_collections.ConfigDict) -> dict[str, Any]:
  """``{"baseline", "size", "batch", "length", "rows": {scheme: {"model", "train_ms",
  "train_ratio", "peak_bytes", "memory_ratio"} or {"na": reason}}, "note"}``; ``model`` is
  the head timed, ``mlm`` or ``lm``, the baseline's too."""
  from posenc_jax.benchmarks import model_steps, timing  # noqa: PLC0415

  sizes = {preset: name for name, preset in model_steps.BERT_SIZES.items()}
  dims = dict(batch=cost.batch, length=cost.length, dtype=cost.dtype)
  on_lm = [scheme for scheme in schemes if model_steps.model_of(scheme, baseline) == "lm"]
  models = "BERT MLM" + (f" (causal LM for {', '.join(on_lm)}: causal-only, and {baseline} "
                         "beside them)" if on_lm else "")
  note = (f"Cost: {models} train step at {size}, batch {cost.batch}, length {cost.length}, "
          f"{cost.dtype}; median of {cost.repeats} runs timed alternately with {baseline} on "
          "the same model; peak memory as XLA plans the compiled step.")
  out = {"baseline": baseline, "size": size, **dims, "note": note, "rows": {}}
  if size not in sizes:
    return out | {"note": f"Cost: not measured: {size} is no size of posenc_jax.benchmarks "
                          f"({', '.join(sizes)})"}
  bases = {}  # head -> the baseline's (train step, peak bytes) on that model
  for scheme in schemes:
    head = model_steps.model_of(scheme, baseline)
    if head not in bases:  # a baseline that does not build raises: no ratio without it
      bases[head] = (model_steps.compiled_steps(sizes[size], baseline, head=head, **dims)[0],
                     peak_bytes(sizes[size], baseline, head=head, **dims))
    base_train, base_bytes = bases[head]
    try:
      train = base_train if scheme == baseline else model_steps.compiled_steps(
          sizes[size], scheme, head=head, **dims)[0]
      train_s, base_s = timing.timed_against(train, base_train, cost.repeats)
      memory = peak_bytes(sizes[size], scheme, head=head, **dims)
    except Exception as e:  # noqa: BLE001 - one scheme that does not build is one n/a row
      out["rows"][scheme] = {"na": first_line(e)}
      continue
    out["rows"][scheme] = {"model": head, "train_ms": 1e3 * train_s,
                           "train_ratio": train_s / base_s, "peak_bytes": memory,
                           "memory_ratio": memory / base_bytes if memory and base_bytes
                           else None}
  return out
