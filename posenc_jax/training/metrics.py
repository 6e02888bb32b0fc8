"""Training metrics: JSON lines and TensorBoard events in the workdir, a compact console line.

Throughput follows t5x: steps/s, tokens/s, tokens/s per device, the
compile time (the first step, excluded from rates), an ETA, and MFU where
the device's peak FLOP/s is known.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import jax

# Dense bf16 peak FLOP/s per device (vendor figures), by jax device_kind prefix.
PEAK_FLOPS = {
    "NVIDIA H100": 989e12,
    "NVIDIA H200": 989e12,
    "NVIDIA A100": 312e12,
    "TPU v2": 45e12,
    "TPU v3": 123e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,
}


def peak_flops(device: jax.Device | None = None) -> float | None:
  """The device's peak FLOP/s, or None when unknown (e.g. CPUs)."""
  kind = (device or jax.devices()[0]).device_kind
  for prefix, flops in PEAK_FLOPS.items():
    if kind.startswith(prefix):
      return flops
  return None


def train_flops_per_step(num_params: int, tokens: int, num_layers: int, length: int,
                         d_model: int) -> float:
  """Analytic FLOPs of one training step (forward + backward = 3 x forward).

  ``6 N T`` for the weights (Kaplan et al.; the word-embedding table counts
  once, as the tied output projection) plus the attention scores and
  mixing, ``12 n_layers L d`` per token. Position tables are counted as
  weights, a small overestimate.
  """
  dense = 6.0 * num_params * tokens
  attention = 12.0 * num_layers * length * d_model * tokens
  return dense + attention


class Throughput:
  """Rates over the steps since the last report, compilation excluded.

  Args:
    total_steps: for the ETA.
    tokens_per_step: global tokens in one step.
    flops_per_step: analytic FLOPs of one step (None: no MFU).
  """

  def __init__(self, total_steps: int, tokens_per_step: int, flops_per_step: float | None = None):
    self.total_steps = total_steps
    self.tokens_per_step = tokens_per_step
    self.flops_per_step = flops_per_step
    self.compile_seconds: float | None = None
    self._mark: tuple[int, float] | None = None

  def start(self, step: int) -> None:
    """Call once the first (compiling) step has finished."""
    self._mark = (step, time.perf_counter())

  def report(self, step: int) -> dict[str, float]:
    """Rates since the previous report."""
    if self._mark is None:
      return {}
    last_step, last_time = self._mark
    now = time.perf_counter()
    self._mark = (step, now)
    if step <= last_step:
      return {}
    steps_per_s = (step - last_step) / max(now - last_time, 1e-9)
    tokens = steps_per_s * self.tokens_per_step
    out = {"steps_per_s": steps_per_s, "tokens_per_s": tokens,
           "tokens_per_s_per_device": tokens / jax.device_count(),
           "eta_s": (self.total_steps - step) / steps_per_s}
    peak = peak_flops()
    if self.flops_per_step and peak:
      out["mfu"] = self.flops_per_step * steps_per_s / (peak * jax.device_count())
    return out


def _truncate_after(path: str, step: int) -> None:
  """Keeps the lines of ``path`` (JSONL with a ``step``) up to ``step``; replaced atomically."""
  if not os.path.exists(path):
    return
  with open(path) as f:
    lines = f.readlines()
  kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
  if len(kept) == len(lines):
    return
  with open(path + ".tmp", "w") as f:
    f.writelines(kept)
  os.replace(path + ".tmp", path)


class MetricWriter:
  """Writes scalars to ``<workdir>/metrics.jsonl`` and TensorBoard events (host 0 only).

  A run resumed at ``start_step`` first drops the file's lines of later steps
  (written after that checkpoint by the interrupted run, and about to be
  recomputed), so every step appears once; TensorBoard hides those steps'
  events (``purge_step``).
  """

  def __init__(self, workdir: str, start_step: int = 0):
    self.active = jax.process_index() == 0
    self._jsonl = None
    self._tb = None
    if self.active:
      os.makedirs(workdir, exist_ok=True)
      path = os.path.join(workdir, "metrics.jsonl")
      _truncate_after(path, start_step)
      self._jsonl = open(path, "a")  # noqa: SIM115
      from tensorboardX import SummaryWriter  # noqa: PLC0415
      self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"),
                               purge_step=start_step + 1 if start_step else None)

  def write(self, step: int, scalars: dict[str, Any]) -> None:
    if not self.active:
      return
    scalars = {k: float(v) for k, v in scalars.items()}
    self._jsonl.write(json.dumps({"step": step, **scalars}) + "\n")
    self._jsonl.flush()
    for name, value in scalars.items():
      if math.isfinite(value):
        self._tb.add_scalar(name, value, step)
    self._tb.flush()

  def close(self) -> None:
    if self.active:
      self._jsonl.close()
      self._tb.close()


def console_line(step: int, total: int, scalars: dict[str, float]) -> str:
  """``step 120/1000 ( 12%) loss 6.912 acc 0.041 lr 1.2e-04 | 8.1 steps/s ETA 1m48s``."""
  eta = scalars.get("eta_s")
  eta_text = f" ETA {int(eta // 60)}m{int(eta % 60):02d}s" if eta is not None else ""
  rate = f" | {scalars['steps_per_s']:.2f} steps/s" if "steps_per_s" in scalars else ""
  parts = [f"step {step}/{total} ({100 * step / total:3.0f}%)"]
  for key, label, fmt in (("loss", "loss", ".4f"), ("accuracy", "acc", ".3f"),
                          ("learning_rate", "lr", ".2e"), ("grad_norm", "gnorm", ".3f")):
    if key in scalars:
      parts.append(f"{label} {scalars[key]:{fmt}}")
  return " ".join(parts) + rate + eta_text
