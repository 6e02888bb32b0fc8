"""Decoding evaluation for translation: beam search on validation batches, then the
task's own metric functions (e.g. SacreBLEU for WMT) on the detokenised text."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import flax.linen as nn
import jax
import ml_collections
import numpy as np

from posenc_jax.models.decoding import translate


def decode_batches(model: nn.Module, params: Any, batches: Iterable[dict[str, np.ndarray]],
                   decode: ml_collections.ConfigDict, eos_id: int = 1
                   ) -> tuple[list[np.ndarray], list[np.ndarray]]:
  """(predicted ids, reference ids) per example, cut at EOS; ``translate``'s best beam."""
  predictions, references = [], []
  run = jax.jit(lambda p, src: translate(model, p, src, src > 0,
                                         max_decode_len=decode.max_decode_len,
                                         beam_size=decode.beam_size, alpha=decode.alpha,
                                         eos_id=eos_id)[0][:, 0])
  for batch in batches:
    tokens = np.asarray(run(params, batch["inputs"]))
    for row, ref in zip(tokens, batch["targets"]):
      predictions.append(_cut(row, eos_id))
      references.append(_cut(np.asarray(ref), eos_id))
  return predictions, references


def _cut(ids: np.ndarray, eos_id: int) -> np.ndarray:
  """Ids before the first EOS, padding removed."""
  ends = np.flatnonzero(ids == eos_id)
  ids = ids[:ends[0]] if ends.size else ids
  return ids[ids > 0]


def task_metrics(task_name: str, predictions: list[np.ndarray], references: list[np.ndarray]
                 ) -> dict[str, float]:
  """Detokenises with the task's target vocabulary and applies its ``metric_fns``."""
  import seqio  # noqa: PLC0415

  task = seqio.get_mixture_or_task(task_name)
  vocab = task.output_features["targets"].vocabulary
  pred_text = [vocab.decode(p.tolist()) for p in predictions]
  ref_text = [vocab.decode(r.tolist()) for r in references]
  scores: dict[str, float] = {}
  for fn in task.metric_fns:
    scores |= {f"eval_{k}": float(v) for k, v in fn(ref_text, pred_text).items()}
  return scores
