"""A train config's memory: its step (:func:`posenc_jax.memory.step_memory`) and its input
buffers, checked before anything is compiled, allocated or written.

:class:`TrainMemory` builds the model and the optimizer abstractly (``jax.eval_shape``:
nothing allocated) and estimates one device's step at any batch and length; the input
pipeline's host buffers (:func:`input_buffers`: the pre-training shuffle block of
``shuffle_block`` sequences, :func:`posenc_jax.data.preprocessors.mlm_dataset`, and the
batches it prefetches) count with the step on a CPU host, whose memory they share, and
against the host's memory with an accelerator. :func:`check_train_memory` refuses a config
that cannot fit with one :class:`~posenc_jax.training.config.TrainConfigError` line naming
the field to shrink: ``seq_len`` when one row per device does not fit, else ``batch_size``;
the model itself (``model``) when not even 8 positions fit.
"""

from __future__ import annotations

from typing import Any

import jax
import ml_collections

from posenc_jax import memory
from posenc_jax.data import SHUFFLE_BLOCK, probes
from posenc_jax.models.build import abstract_params, build_model
from posenc_jax.models.config import ModelConfig
from posenc_jax.training.config import TrainConfigError, max_predictions
from posenc_jax.training.optim import make_optimizer

# [B, L] arrays of a batch, at most (MLM: ids, segments, mask, targets, weights, positions),
# int32 or float32 each.
BATCH_FEATURES = 6
# Batches the input pipeline holds besides the shuffle block (tf.data's prefetch).
PREFETCHED_BATCHES = 2


def input_buffers(config: ml_collections.ConfigDict, rows: int, length: int) -> int:
  """Host bytes of the input pipeline at ``rows`` per host batch and ``length``: the
  prefetched batches and, for pre-training (``mlm``, ``lm``) from a seqio task, the shuffle
  block (``shuffle_block * L * 8`` bytes, :mod:`posenc_jax.data.preprocessors`)."""
  shuffled = (config.objective in ("mlm", "lm")
              and not probes.is_probe(config.task))
  return (PREFETCHED_BATCHES * rows * length * BATCH_FEATURES * 4
          + (SHUFFLE_BLOCK * length * 8 if shuffled else 0))


class TrainMemory:
  """The step and input estimates of one train config at any per-device batch and length
  (the model, optimizer state and attention terms read once)."""

  def __init__(self, config: ml_collections.ConfigDict, cfg: ModelConfig, data_devices: int):
    self.config, self.cfg, self.data_devices = config, cfg, data_devices
    model = build_model(cfg, config.head, num_labels=config.get("num_labels", 2))
    tx, _ = make_optimizer(config.optimizer, config.total_steps)
    self.params = abstract_params(model)
    self.opt_state = jax.eval_shape(tx.init, self.params)
    self.causal = config.objective == "lm"
    self.forms = memory.attention_forms(cfg, self.causal)

  def step(self, rows: int, length: int, host_buffers: bool = True) -> memory.Estimate:
    """The step's :class:`~posenc_jax.memory.Estimate` at ``rows`` per device and
    ``length``, with the batch's arrays and (on a host without an accelerator, whose memory
    they share) the input buffers; ``host_buffers`` False leaves those out (a benchmark of
    the step, which runs no input pipeline)."""
    config = self.config
    predictions = max_predictions(config)
    estimate = memory.step_memory(
        self.cfg, batch=rows, length=length, params=self.params, opt_state=self.opt_state,
        forms=self.forms,
        predictions=None if predictions is None else min(predictions, length),
        vocab_outputs=config.head in ("mlm", "lm", "translation"),
        input_bytes=rows * length * BATCH_FEATURES * 4,
        micro_batches=config.grad_accum_steps, causal=self.causal,
        segments=bool(config.get("packed_segments", False)))
    if jax.default_backend() != "cpu" or not host_buffers:
      return estimate
    host_rows = rows * self.data_devices // jax.process_count()
    return memory.Estimate({**estimate.parts,
                            "input buffers": input_buffers(config, host_rows, length)})


def train_length(config: ml_collections.ConfigDict) -> int:
  """The longest sequence a step of ``config`` attends over."""
  return max(config.seq_len, config.get("input_len") or 0, config.get("target_len") or 0)


def train_memory(config: ml_collections.ConfigDict, cfg: ModelConfig,
                 data_devices: int = 1) -> memory.Estimate:
  """The :class:`~posenc_jax.memory.Estimate` of one device's training step of ``config``
  (validated; ``cfg`` its model config) with the batch split over ``data_devices``."""
  rows = max(config.batch_size // data_devices, 1)
  return TrainMemory(config, cfg, data_devices).step(rows, train_length(config))


def check_input_buffers(config: ml_collections.ConfigDict, rows: int, length: int,
                        free: tuple[int, str] | None = None) -> None:
  """Raises one :class:`TrainConfigError` line when the input pipeline's host buffers at
  ``rows`` per host and ``length`` (:func:`input_buffers`) exceed the host's available
  memory (``free``; None: :func:`posenc_jax.memory.host_available`) beyond the estimate's
  error: naming ``seq_len`` when the shuffle block alone does, else ``batch_size``."""
  free = (memory.host_available(), "available host memory") if free is None else free
  estimate = memory.Estimate({"input buffers": input_buffers(config, rows, length)})
  field = "seq_len" if input_buffers(config, 0, length) > free[0] else "batch_size"
  line = memory.refusal(estimate, field, config[field], free=free)
  if line:
    raise TrainConfigError(line)


def check_train_memory(config: ml_collections.ConfigDict, cfg: ModelConfig,
                       mesh: Any = None) -> None:
  """Raises one :class:`TrainConfigError` line when the step of ``config`` (on ``mesh``'s
  data-parallel devices; None: one) and its input buffers need more memory than is free
  (beyond the estimate's error, :func:`posenc_jax.memory.refusal`), with the estimate, the
  free memory and the largest value whose estimate fits: naming ``seq_len``
  when one row per device does not fit, else ``batch_size``, and ``model`` when not even 8
  positions do. With an accelerator, the input buffers are checked against the host's
  memory first (:func:`check_input_buffers`)."""
  data = 1 if mesh is None else mesh.shape["data"]
  length = train_length(config)
  if jax.default_backend() != "cpu":  # else step() counts them with the device's
    check_input_buffers(config, config.batch_size // jax.process_count(), length)
  estimates = TrainMemory(config, cfg, data)
  free = memory.available()

  def fits(rows: int, length: int) -> bool:
    return estimates.step(rows, length).total <= free[0]

  rows = max(config.batch_size // data, 1)
  estimate = estimates.step(rows, length)
  if memory.refusal(estimate, "batch_size", config.batch_size, free=free) is None:
    return
  if fits(1, length):
    most = memory.largest(lambda n: fits(n, length), rows) * data
    field, value, hint = "batch_size", config.batch_size, f" (at most about {most} fit)"
  elif fits(1, min(length, 8)):
    at = rows if fits(rows, min(length, 8)) else 1
    most = memory.largest(lambda n: fits(at, n), length)
    field, value, hint = "seq_len", config.seq_len, (f" (at most about {most} fit with "
                                                     f"{at * data} rows)")
  else:
    field, value = "model", (f"{memory.tree_bytes(estimates.params) // 4:,} parameters "
                             f"(max_len={cfg.max_len})")
    hint = ""
  raise TrainConfigError(memory.refusal(estimate, field, value, hint=hint, free=free))
