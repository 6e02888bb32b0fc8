"""Randomized positional encodings (Ruoss et al., ACL 2023, "Randomized Positional Encodings
Boost Length Generalization of Transformers", Section 3): the position ids of a sequence of
``n`` tokens are an ordered random subset of ``[0, N)``, ``N`` (the paper's ``L``) larger than
the training length, drawn afresh for every sequence, so that every position a longer test
sequence uses has been seen in training.

For a sequence of length ``n <= N`` the ids are ``sort(S)`` with ``S`` a subset of size ``n``
of ``{0, ..., N - 1}``, uniform over the ``C(N, n)`` subsets (the reference code's
``noisy_fixed_positional_encodings``: ``jax.random.choice(..., replace=False)`` then
``jnp.sort``): strictly increasing, unique, inside ``[0, N)``, and every id can occur. A
packed row (``packed_segment_ids`` 1, 2, ..., 0 at padding; ``position_ids`` restarting at 0
in every segment) gets one subset per segment, indexed by the segment's own positions; its
padding keeps position 0.

The draws are counter-based: the ids of row ``r`` of step ``s`` (or of evaluation batch
``s``) come from Philox with key ``(seed, stream)`` and counter ``(0, 0, r, s)``, so they
depend on nothing but the training seed, the step and the row, and a run resumed at step
``s`` (the step is the data position every checkpoint saves) draws exactly what an
uninterrupted run draws there. The reference code draws one subset per batch; here each
example has its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import ml_collections
import numpy as np

# The key's stream: training steps and evaluation batches never share draws.
TRAIN, EVAL = 0, 1
# ``randomized_positions_eval``: the paper's default first (the reference code draws the
# randomized ids in every forward pass, evaluation included), then ``0..n-1``.
EVAL_POSITIONS = ("randomized", "plain")
# The objectives whose batches carry position ids to the model, and their token feature.
TOKENS = {"mlm": "input_ids", "lm": "targets"}


def generator(seed: int, stream: int, step: int, row: int) -> np.random.Generator:
  """The counter-based generator of one row: Philox, key ``(seed, stream)``, counter
  ``(0, 0, row, step)`` (draws advance the lowest word)."""
  return np.random.Generator(np.random.Philox(
      key=np.array([seed, stream], np.uint64), counter=np.array([0, 0, row, step], np.uint64)))


def sorted_subset(rng: np.random.Generator, length: int, max_length: int) -> np.ndarray:
  """``[length]`` int32: an ordered uniform random subset of ``[0, max_length)``."""
  return np.sort(rng.choice(max_length, size=length, replace=False)).astype(np.int32)


def randomized_position_ids(shape: tuple[int, int], max_length: int, seed: int, stream: int,
                            step: int, row_offset: int = 0,
                            packed_segment_ids: np.ndarray | None = None,
                            position_ids: np.ndarray | None = None) -> np.ndarray:
  """``[B, L]`` int32 randomized position ids of one batch.

  Args:
    shape: ``(B, L)``, this host's rows.
    max_length: ``N``: the ids lie in ``[0, N)``; ``N >= L``.
    seed, stream, step: the key and the step of :func:`generator`.
    row_offset: the global index of this host's first row.
    packed_segment_ids, position_ids: ``[B, L]`` of a packed batch (both or neither): each
      segment gets its own subset, ``ids[position_ids]``; padding (segment 0) keeps 0.
  """
  batch, length = shape
  out = np.zeros(shape, np.int32)
  for row in range(batch):
    rng = generator(seed, stream, step, row_offset + row)
    if packed_segment_ids is None:
      out[row] = sorted_subset(rng, length, max_length)
      continue
    for segment in np.unique(packed_segment_ids[row]):
      if segment == 0:
        continue
      where = packed_segment_ids[row] == segment
      ids = sorted_subset(rng, int(np.sum(where)), max_length)
      out[row, where] = ids[position_ids[row, where]]
  return out


class RandomizedPositions:
  """The batches of ``batches`` with ``position_ids`` drawn by
  :func:`randomized_position_ids`, the ``k``-th batch at step ``start + k``.

  Its state is the step, which every checkpoint saves as the data position: a resume builds
  it at the restored step over the restored batches. ``save_state``, ``restore_state`` and
  ``checkpointable`` are those of ``batches`` (:class:`~posenc_jax.training.input_pipeline.
  InputIterator`), when it has them. Host ``shard_id``'s rows are the global rows from
  ``shard_id * B`` (``B`` rows a host).
  """

  def __init__(self, batches: Iterator[dict[str, np.ndarray]], max_length: int, seed: int,
               stream: int, start: int, shard_id: int, tokens: str):
    self._batches = batches
    self._draw = dict(max_length=max_length, seed=seed, stream=stream)
    self._shard_id = shard_id
    self._tokens = tokens
    self.step = start

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    batch = dict(next(self._batches))
    packed = {k: batch[k] for k in ("packed_segment_ids", "position_ids") if k in batch}
    shape = batch[self._tokens].shape
    batch["position_ids"] = randomized_position_ids(shape, step=self.step,
                                                    row_offset=self._shard_id * shape[0],
                                                    **self._draw, **packed)
    self.step += 1
    return batch

  def __getattr__(self, name: str) -> Any:
    if name in ("save_state", "restore_state", "checkpointable"):
      return getattr(self._batches, name)
    raise AttributeError(name)


def evaluated_range(config: ml_collections.ConfigDict) -> int | None:
  """``N`` where a run's evaluation reads randomized position ids from ``[0, N)``
  (``randomized_positions`` set and ``randomized_positions_eval`` not ``"plain"``), else
  None (positions ``0 .. L - 1``)."""
  if config.get("randomized_positions_eval", EVAL_POSITIONS[0]) == "plain":
    return None
  return config.get("randomized_positions")


def randomized_batches(config: ml_collections.ConfigDict, batches: Iterator, start: int,
                       shard_id: int = 0, evaluation: bool = False) -> Iterator:
  """``batches`` (training from step ``start``, or ``evaluation``'s from 0) with randomized
  position ids when ``config.randomized_positions`` is set (and, for evaluation,
  ``config.randomized_positions_eval`` is ``"randomized"``); else ``batches`` as they are.
  Evaluation draws the same ids at every evaluation."""
  max_length = evaluated_range(config) if evaluation else config.get("randomized_positions")
  if max_length is None:
    return batches
  return RandomizedPositions(batches, max_length, config.seed, EVAL if evaluation else TRAIN,
                             start, shard_id, TOKENS[config.objective])
