"""Training objectives: masked-LM (BERT), teacher-forced translation, causal LM.

Each returns summed loss and weight (so micro-batches and hosts combine
exactly) and summed metric numerators over one batch.

MLM batch (``[B, L]`` each): ``input_ids``, ``segment_ids``, ``mask`` (1 at
real tokens), ``mlm_targets`` (original id at masked positions),
``mlm_weights`` (1 at masked positions); optionally ``position_ids`` and
``packed_segment_ids`` (packed sequences, passed to the model). With
``max_predictions`` ``P`` (BERT's ``max_predictions_per_seq``; the trainer's
default is the most ``mask_rate`` masks in a row) the vocabulary projection
runs only at the ``P`` positions of each row that carry weight (padded with
weight-0 positions), not at all ``L``: the same loss and gradients when no row
has more than ``P`` (the trainer checks every batch).

Translation batch: ``inputs`` ``[B, Ls]``, ``targets`` ``[B, Lt]`` (0 is
padding; the decoder input is ``targets`` shifted right by one).

Causal-LM batch: ``targets`` ``[B, L]`` (packed text, 0 is padding); the model reads them
shifted right by one and predicts each from the ones before it. An optional float
``loss_weights`` ``[B, L]`` weighs the predictions (synthetic probes: 1 on answer tokens);
without it every non-padding token weighs 1.

Fine-tuning batches carry ``input_ids``, ``segment_ids``, ``mask`` and
``label`` ``[B]`` (int for classification, float for regression), or
``start_positions``/``end_positions`` ``[B]`` for span prediction. A
``weight`` ``[B]`` feature, if present, marks padding rows of a last
partial evaluation batch with 0.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from posenc_jax.models.transformer import shift_right

Array = jax.Array

OBJECTIVES = ("mlm", "translation", "classification", "regression", "span", "lm")
# The model head each objective trains.
HEAD_OF = {"mlm": "mlm", "translation": "translation", "classification": "classification",
           "regression": "classification", "span": "span", "lm": "lm"}


# The objectives that score the tokens of a text stream (perplexity, the unigram reference).
PRETRAINING = ("lm", "mlm")


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


# Optional [B, L] int32 batch features a packing pipeline adds: the position of each token
# (restarting per packed sequence) and the packed sequence it belongs to.
PACKING_FEATURES = ("position_ids", "packed_segment_ids")


def packing_inputs(batch: dict[str, Array]) -> dict[str, Array]:
  """The model keyword arguments of :data:`PACKING_FEATURES` present in ``batch``."""
  return {name: batch[name] for name in PACKING_FEATURES if name in batch}


def masked_positions(weights: Array, max_predictions: int) -> Array:
  """``[B, P]`` int32 positions of each row's ``P`` largest ``weights`` ``[B, L]`` (the
  masked positions first, in order, then weight-0 ones)."""
  _, positions = jax.lax.top_k(weights.astype(jnp.float32), max_predictions)  # ties: lower index
  return positions.astype(jnp.int32)


def _at(x: Array, positions: Array) -> Array:
  """``x[b, positions[b, p]]`` ``[B, P]`` of ``x`` ``[B, L]``, by a one-hot select-and-sum
  (no gather: on accelerators scatters and gathers are slow, and this is exact)."""
  hit = positions[..., None] == jnp.arange(x.shape[1])
  return jnp.sum(jnp.where(hit, x[:, None, :], jnp.zeros((), x.dtype)), axis=-1)


def mlm_objective(model: nn.Module, params: Any, batch: dict[str, Array], rng: Array | None,
                  label_smoothing: float = 0.0, max_predictions: int | None = None
                  ) -> tuple[Array, dict[str, Array]]:
  """Masked-LM loss over the masked positions of a batch (logits at ``max_predictions``
  positions per row, or at every position when None)."""
  deterministic = rng is None
  targets, weights, positions = batch["mlm_targets"], batch["mlm_weights"], None
  if max_predictions:
    positions = masked_positions(weights, max_predictions)
    targets, weights = _at(targets, positions), _at(weights, positions)
  logits = model.apply({"params": params}, batch["input_ids"], batch["segment_ids"],
                       batch["mask"], masked_positions=positions, deterministic=deterministic,
                       rngs=None if deterministic else {"dropout": rng},
                       **packing_inputs(batch))
  loss, weight, correct = weighted_cross_entropy(logits, targets, weights, label_smoothing)
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


def lm_objective(model: nn.Module, params: Any, batch: dict[str, Array], rng: Array | None,
                 label_smoothing: float = 0.0) -> tuple[Array, dict[str, Array]]:
  """Next-token prediction: the logits at ``shift_right(targets)`` predict ``targets``,
  weighed by ``loss_weights`` when the batch has it, else padding (0) weighs 0. Padding
  only ends a row, so causal attention keeps it from every real position and no key mask
  is needed. ``position_ids`` and ``packed_segment_ids``, when in the batch, describe the
  prediction slots (slot ``t`` reads target ``t - 1`` and predicts target ``t``) and go to
  the model as they are."""
  deterministic = rng is None
  logits = model.apply({"params": params}, shift_right(batch["targets"]),
                       deterministic=deterministic,
                       rngs=None if deterministic else {"dropout": rng},
                       **packing_inputs(batch))
  weights = batch["loss_weights"] if "loss_weights" in batch else batch["targets"] > 0
  loss, weight, correct = weighted_cross_entropy(logits, batch["targets"], weights,
                                                 label_smoothing)
  return loss, {"loss": loss, "weight": weight, "correct": correct}


def _encoder_inputs(batch):
  return batch["input_ids"], batch["segment_ids"], batch["mask"]


def _apply(model, params, batch, rng):
  deterministic = rng is None
  return model.apply({"params": params}, *_encoder_inputs(batch), deterministic=deterministic,
                     rngs=None if deterministic else {"dropout": rng})


def _row_weights(batch) -> Array:
  return batch.get("weight", jnp.ones(batch["input_ids"].shape[:1], jnp.float32))


def classification_loss(logits, batch, label_smoothing=0.0):
  """Cross-entropy of ``label`` from the pooled [CLS] logits ``[B, C]``."""
  loss, weight, correct = weighted_cross_entropy(logits, batch["label"], _row_weights(batch),
                                                 label_smoothing)
  return loss, {"loss": loss, "weight": weight, "correct": correct}


def classification_objective(model, params, batch, rng, label_smoothing=0.0):
  """:func:`classification_loss` of the model's logits ``[B, C]``."""
  return classification_loss(_apply(model, params, batch, rng), batch, label_smoothing)


def regression_objective(model, params, batch, rng, label_smoothing=0.0):
  """:func:`regression_loss` of the model's prediction ``[B]``."""
  return regression_loss(_apply(model, params, batch, rng), batch, label_smoothing)


def regression_loss(prediction, batch, label_smoothing=0.0):
  """Squared error of a scalar prediction ``[B]`` (STS-B); ``correct`` counts |error| < 0.5."""
  del label_smoothing
  weights = _row_weights(batch)
  error = prediction - batch["label"].astype(jnp.float32)
  loss = jnp.sum(weights * error ** 2)
  correct = jnp.sum(weights * (jnp.abs(error) < 0.5))
  return loss, {"loss": loss, "weight": jnp.sum(weights), "correct": correct}


def span_objective(model, params, batch, rng, label_smoothing=0.0):
  """Mean of the start and end cross-entropies; ``correct`` counts exact spans."""
  start, end = _apply(model, params, batch, rng)
  weights = _row_weights(batch)
  start_loss, weight, _ = weighted_cross_entropy(start, batch["start_positions"], weights,
                                                 label_smoothing)
  end_loss, _, _ = weighted_cross_entropy(end, batch["end_positions"], weights, label_smoothing)
  exact = ((jnp.argmax(start, -1) == batch["start_positions"])
           & (jnp.argmax(end, -1) == batch["end_positions"]))
  loss = (start_loss + end_loss) / 2
  return loss, {"loss": loss, "weight": weight, "correct": jnp.sum(weights * exact)}


# The objectives whose model outputs, one per row, are also the task's predictions: their loss
# of those outputs, so that one forward pass gives the evaluation's loss and the predictions.
OUTPUT_LOSSES = {"classification": classification_loss, "regression": regression_loss}


def loss_and_outputs(name: str):
  """``(model, params, batch) -> (sums, outputs)`` for an objective of :data:`OUTPUT_LOSSES`:
  its summed metrics, deterministic, and the model's outputs (``[B, C]`` logits, ``[B]``
  predictions) from the same forward pass."""
  loss = OUTPUT_LOSSES[name]

  def with_outputs(model, params, batch):
    outputs = _apply(model, params, batch, None)
    return loss(outputs, batch)[1], outputs

  return with_outputs


def objective(name: str, max_predictions: int | None = None):
  """The loss function ``(model, params, batch, rng, label_smoothing)`` of objective ``name``
  (``max_predictions``: the MLM head's positions per row, see the module docstring)."""
  if name == "mlm":
    return functools.partial(mlm_objective, max_predictions=max_predictions or None)
  return {"translation": translation_objective, "classification": classification_objective,
          "regression": regression_objective, "span": span_objective, "lm": lm_objective}[name]
