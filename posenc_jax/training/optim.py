"""Optimisers as the papers used them.

* TUPE / BERT: AdamW (b1 0.9, b2 0.999, eps 1e-6), LR 1e-4, linear warm-up
  over 10k steps then linear decay to 0, weight decay 0.01, clip 1.0.
* DIET: a LAMB-style large-batch optimiser, LR 0.0018 at batch 4096,
  warm-up 2.5% of the steps.

Weight decay skips biases and LayerNorm parameters (BERT's mask).
``position_lr_scale`` multiplies the learning rate of the positional-encoding
parameters alone (see :func:`position_mask`). Gradient
accumulation is the training step's (it scans micro-batches), so one step is
one optimizer update whatever ``grad_accum_steps`` is.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import ml_collections
import optax

from posenc_jax.messages import nearest

OPTIMIZERS = ("adamw", "adam", "lamb")
SCHEDULES = ("linear", "constant", "rsqrt")


class OptimizerConfigError(ValueError):
  """An invalid optimizer config field."""


def default_optimizer_config() -> ml_collections.ConfigDict:
  """TUPE's AdamW settings; DIET's LAMB in ``configs/pretrain.py``'s ``diet`` protocol."""
  return ml_collections.ConfigDict(dict(
      name="adamw", learning_rate=1e-4, warmup_steps=10_000, warmup_fraction=0.0,
      schedule="linear", b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.01, grad_clip_norm=1.0,
      position_lr_scale=1.0))


def warmup_steps(config: ml_collections.ConfigDict, total_steps: int) -> int:
  """``warmup_fraction`` of ``total_steps`` if set, else ``warmup_steps``."""
  if config.warmup_fraction:
    return int(round(config.warmup_fraction * total_steps))
  return int(config.warmup_steps)


def learning_rate_schedule(config: ml_collections.ConfigDict, total_steps: int) -> optax.Schedule:
  """Linear warm-up to ``learning_rate``, then linear decay to 0 at ``total_steps``
  (``linear``), a constant, or inverse square root (``rsqrt``, Vaswani et al.)."""
  warmup = warmup_steps(config, total_steps)
  peak = config.learning_rate
  warm = optax.linear_schedule(0.0, peak, max(warmup, 1))
  if config.schedule == "linear":
    after = optax.linear_schedule(peak, 0.0, max(total_steps - warmup, 1))
  elif config.schedule == "constant":
    after = optax.constant_schedule(peak)
  else:
    after = lambda step: peak * (max(warmup, 1) / (step + max(warmup, 1))) ** 0.5  # noqa: E731
  return optax.join_schedules([warm, after], [warmup])


def decay_mask(params: Any) -> Any:
  """True for weights that take weight decay: not biases, not LayerNorm scales."""
  def decays(path, _):
    name = str(path[-1].key) if hasattr(path[-1], "key") else str(path[-1])
    return name not in ("bias", "scale")
  return jax.tree_util.tree_map_with_path(decays, params)


# The modules every model builds its position schemes as (models/bert.py, models/transformer.py).
POSITION_MODULES = ("position", "alternate_position")


def position_mask(params: Any) -> Any:
  """True for the parameters of the positional-encoding modules (``.../position/...``,
  ``.../alternate_position/...``): the learned APE table, TUPE's projections, the
  relative tables and DIET-ABS's factors; not the segment terms, the token embedding or
  the attention weights."""
  def positional(path, _):
    return any(getattr(key, "key", None) in POSITION_MODULES for key in path)
  return jax.tree_util.tree_map_with_path(positional, params)


def _is_number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_optimizer_config(config: ml_collections.ConfigDict, total_steps: int) -> None:
  """Raises one :class:`OptimizerConfigError` line naming the first invalid field."""
  def fail(field, value, allowed):
    raise OptimizerConfigError(f"optimizer.{field}: got {value!r}; allowed: {allowed}")
  if config.name not in OPTIMIZERS:
    raise OptimizerConfigError(f"optimizer.name: got {config.name!r}"
                               f"{nearest(config.name, OPTIMIZERS)} allowed: "
                               f"{', '.join(OPTIMIZERS)}")
  if config.schedule not in SCHEDULES:
    fail("schedule", config.schedule, ", ".join(SCHEDULES))
  if not (_is_number(config.learning_rate) and config.learning_rate > 0):
    fail("learning_rate", config.learning_rate, "a positive finite number")
  for field in ("b1", "b2"):
    if not (_is_number(config[field]) and 0 <= config[field] < 1):
      fail(field, config[field], "a number in [0, 1)")
  if not (_is_number(config.eps) and config.eps > 0):
    fail("eps", config.eps, "a positive finite number")
  if not (_is_number(config.weight_decay) and config.weight_decay >= 0):
    fail("weight_decay", config.weight_decay, "a finite number >= 0")
  if config.name == "adam" and config.weight_decay:
    fail("weight_decay", config.weight_decay, "0 with name 'adam' (Adam has no weight decay; "
         "use 'adamw')")
  clip = config.grad_clip_norm
  if not (clip is None or (_is_number(clip) and clip >= 0)):
    fail("grad_clip_norm", clip, "a finite number > 0, or 0 / None for no clipping")
  scale = config.position_lr_scale
  if not (_is_number(scale) and scale > 0):
    fail("position_lr_scale", scale, "a positive finite number")
  if not (_is_number(config.warmup_fraction) and 0 <= config.warmup_fraction < 1):
    fail("warmup_fraction", config.warmup_fraction, "a number in [0, 1)")
  if not (isinstance(config.warmup_steps, int) and not isinstance(config.warmup_steps, bool)
          and 0 <= warmup_steps(config, total_steps) <= total_steps):
    fail("warmup_steps", config.warmup_steps, f"an integer in [0, total_steps={total_steps}]")


def make_optimizer(config: ml_collections.ConfigDict, total_steps: int
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """The optimizer (clipping, decay mask, schedule) and its LR schedule."""
  check_optimizer_config(config, total_steps)
  schedule = learning_rate_schedule(config, total_steps)
  if config.name == "lamb":
    inner = optax.lamb(schedule, b1=config.b1, b2=config.b2, eps=config.eps,
                       weight_decay=config.weight_decay, mask=decay_mask)
  elif config.name == "adamw":
    inner = optax.adamw(schedule, b1=config.b1, b2=config.b2, eps=config.eps,
                        weight_decay=config.weight_decay, mask=decay_mask)
  else:
    inner = optax.adam(schedule, b1=config.b1, b2=config.b2, eps=config.eps)
  chain = [optax.clip_by_global_norm(config.grad_clip_norm)] if config.grad_clip_norm else []
  chain.append(inner)
  scale = config.position_lr_scale
  if scale != 1.0:  # after the update: the step and its decoupled weight decay both scale
    chain.append(optax.masked(optax.scale(scale), position_mask))
  return optax.chain(*chain), schedule
