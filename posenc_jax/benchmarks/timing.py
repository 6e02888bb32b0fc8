"""Wall-clock timing for the benchmarks: medians of steps timed alternately, so that load
drifts of the machine cancel between the steps compared."""

from __future__ import annotations

import time


def seconds(step) -> float:
  """Seconds of one call of the zero-argument ``step``."""
  start = time.perf_counter()
  step()
  return time.perf_counter() - start


def timed(steps, repeats: int) -> list[float]:
  """Median seconds of each of ``steps`` over ``repeats`` rounds, each round running every step
  once in turn (so load drifts cancel between them)."""
  rounds = [[seconds(step) for step in steps] for _ in range(repeats)]
  return [sorted(times)[len(times) // 2] for times in zip(*rounds)]


def timed_against(step, baseline, repeats: int) -> tuple[float, float]:
  """Median seconds of ``step`` and of ``baseline``, timed alternately (so load drifts cancel)."""
  step_s, baseline_s = timed((step, baseline), repeats)
  return step_s, baseline_s


def ratios(step, baseline, repeats: int) -> tuple[float, float, list[float]]:
  """Median seconds of ``step`` and of ``baseline``, timed alternately, and each round's ratio
  ``step / baseline`` (their spread is the timing's noise; ``step`` may be ``baseline``)."""
  rounds = [(seconds(step), seconds(baseline)) for _ in range(repeats)]
  step_s, baseline_s = (sorted(times)[len(times) // 2] for times in zip(*rounds))
  return step_s, baseline_s, [a / b for a, b in rounds]
