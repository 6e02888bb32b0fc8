"""Evaluation with the task's own metrics.

* Translation: beam search on validation batches, then the task's metric
  functions (SacreBLEU for WMT) on the detokenised text.
* Classification / regression: the model's predictions on the whole
  validation split (padding rows of the last batch, ``weight`` 0, dropped),
  scored by the task's metric functions (MCC, F1, Pearson/Spearman, ...).
* Span prediction (SQuAD, XQuAD, MLQA, TyDiQA): start/end logits of every
  window of the split, mapped back to answer text and scored with SQuAD's
  (or MLQA's) F1/EM.

Multi-process jobs (TPU pods, multi-node GPU): every process reads the same
evaluation batches (the whole split, not a host shard), hands its rows of each
batch to the model, sharded over the mesh like training batches, and gets
every row's output back (``process_allgather``). The examples, their order,
the padding rows and the metric computation are then those of one process, so
the metrics are identical.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from posenc_jax.models.decoding import translate


def batch_sharding_of(params: Any) -> NamedSharding:
  """The batch sharding (rows over ``data``) of the mesh ``params`` live on."""
  from posenc_jax.training import mesh as mesh_lib  # noqa: PLC0415

  for leaf in jax.tree.leaves(params):
    if isinstance(getattr(leaf, "sharding", None), NamedSharding):
      return mesh_lib.batch_sharding(leaf.sharding.mesh)
  raise ValueError("multi-process evaluation needs parameters placed on a mesh")


def _rows_multiple(sharding: NamedSharding) -> int:
  """How many shards the first (row) axis is split into."""
  axes = sharding.spec[0] if len(sharding.spec) else None
  axes = () if axes is None else axes if isinstance(axes, tuple) else (axes,)
  return math.prod(sharding.mesh.shape[a] for a in axes)


def apply_on_all_processes(run, params: Any, inputs: dict[str, np.ndarray],
                           sharding: NamedSharding | None) -> Any:
  """``run(params, inputs)`` with host numpy ``inputs`` that every process holds in full
  (the same rows on each): single-process (or ``sharding`` None), as is; multi-process,
  the rows (zero-padded to a multiple of the shards) sharded by ``sharding`` so each
  device computes its rows, and the outputs gathered to every process as numpy, the
  padding rows dropped. The result is the whole batch's, in row order, on every process."""
  if sharding is None or jax.process_count() == 1:
    return jax.tree.map(np.asarray, run(params, inputs))
  rows = len(next(iter(inputs.values())))
  multiple = _rows_multiple(sharding)
  padded = -(-rows // multiple) * multiple
  arrays = {}
  for key, value in inputs.items():
    value = np.asarray(value)
    if padded > rows:
      value = np.concatenate([value, np.zeros((padded - rows,) + value.shape[1:], value.dtype)])
    arrays[key] = jax.make_array_from_callback(value.shape, sharding,
                                               lambda index, v=value: v[index])
  outputs = multihost_utils.process_allgather(run(params, arrays), tiled=True)
  return jax.tree.map(lambda x: np.asarray(x)[:rows], outputs)


def decode_batches(model: nn.Module, params: Any, batches: Iterable[dict[str, np.ndarray]],
                   decode: ml_collections.ConfigDict, eos_id: int = 1,
                   sharding: NamedSharding | None = None
                   ) -> tuple[list[np.ndarray], list[np.ndarray]]:
  """(predicted ids, reference ids) per example, cut at EOS; ``translate``'s best beam.
  Multi-process: every process passes the same ``batches`` and gets every example
  (:func:`apply_on_all_processes` with ``sharding``)."""
  predictions, references = [], []
  run = jax.jit(lambda p, b: translate(model, p, b["inputs"], b["inputs"] > 0,
                                       max_decode_len=decode.max_decode_len,
                                       beam_size=decode.beam_size, alpha=decode.alpha,
                                       eos_id=eos_id)[0][:, 0])
  for batch in batches:
    tokens = apply_on_all_processes(run, params, {"inputs": batch["inputs"]}, sharding)
    for row, ref in zip(tokens, batch["targets"]):
      predictions.append(_cut(row, eos_id))
      references.append(_cut(np.asarray(ref), eos_id))
  return predictions, references


def predict_batches(model: nn.Module, params: Any, batches: Iterable[dict[str, np.ndarray]],
                    objective: str, sharding: NamedSharding | None = None) -> tuple[list, list]:
  """(predictions, labels) over all real rows: class ids, or floats for regression.
  Multi-process: every process passes the same ``batches`` and gets every example
  (:func:`apply_on_all_processes` with ``sharding``)."""
  run = jax.jit(lambda p, b: model.apply({"params": p}, b["input_ids"], b["segment_ids"],
                                         b["mask"]))
  inputs = ("input_ids", "segment_ids", "mask")

  def outputs():
    for batch in batches:
      yield apply_on_all_processes(run, params, {k: batch[k] for k in inputs}, sharding), batch

  return row_predictions(outputs(), objective)


def row_predictions(outputs: Iterable[tuple[np.ndarray, dict[str, np.ndarray]]],
                    objective: str) -> tuple[list, list]:
  """(predictions, labels) of the real rows (``weight`` > 0) of ``(model outputs, batch)``
  pairs: the argmax of ``[B, C]`` logits, or the ``[B]`` regression outputs as they are."""
  predictions, labels = [], []
  for out, batch in outputs:
    out = np.asarray(out)
    out = out if objective == "regression" else out.argmax(-1)
    keep = np.asarray(batch.get("weight", np.ones(len(out)))) > 0
    predictions.extend(out[keep].tolist())
    labels.extend(np.asarray(batch["label"])[keep].tolist())
  return predictions, labels


def span_metrics(model: nn.Module, params: Any, task_name: str, split: str, seq_len: int,
                 batch_size: int, max_batches: int | None = None,
                 sharding: NamedSharding | None = None) -> dict[str, float]:
  """SQuAD-style F1/EM (``task_f1``, ``task_exact_match``) of the model on a QA task's split.
  Multi-process: every process reads the whole split and gets every window's logits
  (:func:`apply_on_all_processes` with ``sharding``), then post-processes as one would."""
  import seqio  # noqa: PLC0415

  from posenc_jax.data import xtreme_qa  # noqa: PLC0415

  task = seqio.get_mixture_or_task(task_name)
  ds = task.get_dataset({"input_ids": seq_len}, split=split, shuffle=False, num_epochs=1)
  ds = ds.batch(batch_size)
  if max_batches:
    ds = ds.take(max_batches)
  run = jax.jit(lambda p, b: model.apply({"params": p}, b["input_ids"], b["segment_ids"],
                                         b["mask"]))
  features: dict[str, list[np.ndarray]] = {}
  starts, ends = [], []
  for batch in ds.as_numpy_iterator():
    start, end = apply_on_all_processes(
        run, params, {k: batch[k] for k in ("input_ids", "segment_ids", "mask")}, sharding)
    starts.append(np.asarray(start))
    ends.append(np.asarray(end))
    for key in ("example_id", "context", "token_offsets", "max_context"):
      features.setdefault(key, []).append(batch[key])
  if not starts:
    return {}
  features = {k: np.concatenate(v) for k, v in features.items()}
  scores = xtreme_qa.evaluate_logits(task_name, split, features, np.concatenate(starts),
                                     np.concatenate(ends))
  return {f"task_{k}": float(v) for k, v in scores.items()}


def _cut(ids: np.ndarray, eos_id: int) -> np.ndarray:
  """Ids before the first EOS, padding removed."""
  ends = np.flatnonzero(ids == eos_id)
  ids = ids[:ends[0]] if ends.size else ids
  return ids[ids > 0]


def task_metrics(task_name: str, predictions: list, references: list) -> dict[str, float]:
  """The task's ``metric_fns`` as ``task_<name>`` (0-100); token-id sequences are first
  detokenised with the task's ``targets`` vocabulary."""
  import seqio  # noqa: PLC0415

  task = seqio.get_mixture_or_task(task_name)
  if predictions and isinstance(predictions[0], np.ndarray):
    vocab = task.output_features["targets"].vocabulary
    predictions = [vocab.decode(p.tolist()) for p in predictions]
    references = [vocab.decode(r.tolist()) for r in references]
  scores: dict[str, float] = {}
  for fn in task.metric_fns:
    scores |= {f"task_{k}": float(v) for k, v in fn(references, predictions).items()}
  return scores


# (references, predictions) of two examples per fine-tuning objective, as task_metrics and
# span_metrics hand them to the task's metric functions.
_SAMPLES = {"classification": ([0, 1], [0, 1]), "regression": ([0.0, 1.0], [0.0, 1.0]),
            "span": ([["a b"], ["c"]], ["a b", "c"])}


def metric_names(task_name: str, objective: str) -> list[str]:
  """The ``task_<name>`` keys the task's metrics report for ``objective`` (``classification``,
  ``regression`` or ``span``), from its metric functions scored on a two-example sample."""
  references, predictions = _SAMPLES[objective]
  return sorted(task_metrics(task_name, predictions, references))
