"""The unigram reference of a pre-training task: what word frequencies alone score.

A model that uses no context at all can still reach the perplexity of the add-one smoothed
unigram model of the task's ``train`` split; a pre-trained model is judged against it. The
trainer prints it beside every evaluation's perplexity (masked LM and causal LM), the
evaluate tool stores it in an extrapolation document, and compare's tables mark a run whose
perplexity is not clearly below it as one that did not learn.

    counts = train_counts("mlm", "wordnet_glosses", 8192)     # [V] int64
    unigram_perplexity(counts, tokens)                         # exp(-mean log p(token))

The counts are those of the split's token stream as the trainer packs it (the whole split,
or its first :data:`UNIGRAM_TOKENS` tokens for a web-scale corpus), read once per process.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import numpy as np

CHUNK = 1024  # tokens per packed example read while streaming a split
UNIGRAM_TOKENS = 50_000_000  # the unigram reference counts at most this many train tokens


def packed_examples(objective_name: str, task: str, split: str) -> Iterator[np.ndarray]:
  """The split's token stream in pieces (numpy int32), in source order, no padding: the
  causal LM's lines joined with EOS, the masked LM's joined with [SEP] ([CLS] left out)."""
  if objective_name == "lm":
    from posenc_jax.data import causal_lm  # noqa: PLC0415
    for example in causal_lm.packed_epoch(task, split, CHUNK).as_numpy_iterator():
      yield example["targets"][example["targets"] > 0]
  else:
    from posenc_jax.data import preprocessors  # noqa: PLC0415
    packed = preprocessors.packed_epoch(task, split, CHUNK)  # [CLS] + CHUNK - 1 tokens
    for example in packed.as_numpy_iterator():
      yield example["input_ids"][1:][example["mask"][1:] > 0]


@functools.lru_cache(maxsize=4)
def train_counts(objective_name: str, task: str, vocab_size: int) -> np.ndarray:
  """``[vocab_size]`` int64: how often each id occurs in the task's ``train`` stream
  (:func:`packed_examples`), the whole split or its first :data:`UNIGRAM_TOKENS` tokens.
  Read once per process; read-only."""
  counts, left = np.zeros(vocab_size, np.int64), UNIGRAM_TOKENS
  for piece in packed_examples(objective_name, task, "train"):
    counts += np.bincount(piece[:left], minlength=vocab_size)[:vocab_size]
    left -= len(piece[:left])
    if not left:
      break
  counts.flags.writeable = False
  return counts


def log_probs(counts: np.ndarray) -> np.ndarray:
  """``[V]`` float64: ``log p(i)``, ``p(i) = (counts[i] + 1) / (sum(counts) + V)``."""
  return np.log(counts + 1.0) - np.log(counts.sum() + float(len(counts)))


def unigram_perplexity(counts: np.ndarray, tokens: np.ndarray) -> float:
  """The perplexity of ``tokens`` ``[N]`` under the unigram model of ``counts`` ``[V]``
  smoothed by adding one to every id of the vocabulary: ``exp(-mean log p(token))``."""
  return float(np.exp(-log_probs(counts)[tokens].mean()))
