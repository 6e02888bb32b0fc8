"""Training objectives: masked-LM (BERT) and teacher-forced translation.

Each returns summed loss and weight (so micro-batches and hosts combine
exactly) and summed metric numerators over one batch.

MLM batch (``[B, L]`` each): ``input_ids``, ``segment_ids``, ``mask`` (1 at
real tokens), ``mlm_targets`` (original id at masked positions),
``mlm_weights`` (1 at masked positions).

Translation batch: ``inputs`` ``[B, Ls]``, ``targets`` ``[B, Lt]`` (0 is
padding; the decoder input is ``targets`` shifted right by one).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from posenc_jax.models.transformer import shift_right

Array = jax.Array

OBJECTIVES = ("mlm", "translation")


def weighted_cross_entropy(logits: Array, targets: Array, weights: Array,
                           label_smoothing: float = 0.0) -> tuple[Array, Array, Array]:
  """Summed loss, summed weight and summed correct predictions.

  Args:
    logits: ``[.., V]`` float32.
    targets: ``[..]`` int.
    weights: ``[..]`` (0 where a position does not count).
    label_smoothing: mass spread over the other classes (0: plain cross-entropy).
  """
  vocab = logits.shape[-1]
  confidence = 1.0 - label_smoothing
  low = label_smoothing / (vocab - 1)
  soft = jax.nn.one_hot(targets, vocab) * (confidence - low) + low
  loss = optax.softmax_cross_entropy(logits, soft)
  if label_smoothing:  # subtract the entropy of the smoothed target: 0 at the optimum
    loss = loss + (confidence * jnp.log(confidence)
                   + (vocab - 1) * low * jnp.log(low + 1e-20))
  weights = weights.astype(jnp.float32)
  correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
  return jnp.sum(loss * weights), jnp.sum(weights), jnp.sum(correct * weights)


def mlm_objective(model: nn.Module, params: Any, batch: dict[str, Array], rng: Array | None,
                  label_smoothing: float = 0.0) -> tuple[Array, dict[str, Array]]:
  """Masked-LM loss over the masked positions of a batch."""
  deterministic = rng is None
  logits = model.apply({"params": params}, batch["input_ids"], batch["segment_ids"],
                       batch["mask"], deterministic=deterministic,
                       rngs=None if deterministic else {"dropout": rng})
  loss, weight, correct = weighted_cross_entropy(logits, batch["mlm_targets"],
                                                 batch["mlm_weights"], label_smoothing)
  return loss, {"loss": loss, "weight": weight, "correct": correct}


def translation_objective(model: nn.Module, params: Any, batch: dict[str, Array],
                          rng: Array | None, label_smoothing: float = 0.0
                          ) -> tuple[Array, dict[str, Array]]:
  """Teacher forcing: predict ``targets`` from ``inputs`` and the shifted targets."""
  deterministic = rng is None
  logits = model.apply({"params": params}, batch["inputs"], shift_right(batch["targets"]),
                       batch["inputs"] > 0, deterministic=deterministic,
                       rngs=None if deterministic else {"dropout": rng})
  loss, weight, correct = weighted_cross_entropy(logits, batch["targets"],
                                                 batch["targets"] > 0, label_smoothing)
  return loss, {"loss": loss, "weight": weight, "correct": correct}


def objective(name: str):
  return {"mlm": mlm_objective, "translation": translation_objective}[name]
