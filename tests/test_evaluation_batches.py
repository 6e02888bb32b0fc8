"""EvaluationBatches: an evaluation split read to its end once is replayed, unchanged."""

import numpy as np
import pytest

from posenc_jax.training.input_pipeline import EvaluationBatches


class Source:
  """A data function counting the batches it reads, per split."""

  def __init__(self, batches: int = 3, rows: int = 4):
    self.batches, self.rows, self.read = batches, rows, {"train": 0, "validation": 0}

  def __call__(self, config, split, start_step, shard_id=0, num_shards=1):
    for i in range(self.batches):
      self.read[split] += 1
      yield {"input_ids": np.full((self.rows, 8), 10 * i + shard_id, np.int32),
             "weight": np.ones(self.rows, np.float32)}


def _values(batches):
  return [(b["input_ids"].copy(), b["weight"].copy()) for b in batches]


def test_a_whole_pass_is_read_once_and_replayed_equal_and_read_only():
  source = Source()
  data = EvaluationBatches(source)
  first = _values(data(None, "validation", 0))
  again = list(data(None, "validation", 0))
  assert source.read["validation"] == 3  # the second evaluation read nothing
  assert len(again) == 3
  for (ids, weight), batch in zip(first, again):
    np.testing.assert_array_equal(batch["input_ids"], ids)
    np.testing.assert_array_equal(batch["weight"], weight)
  with pytest.raises(ValueError, match="read-only"):
    again[0]["input_ids"][0, 0] = 1
  list(data(None, "validation", 0, shard_id=1, num_shards=2))  # another shard: its own read
  assert source.read["validation"] == 6


def test_a_pass_stopped_early_or_over_the_limit_is_read_again():
  source = Source()
  data = EvaluationBatches(source)
  next(iter(data(None, "validation", 0)))  # an islice'd pass (translation's decoding)
  list(data(None, "validation", 0))
  assert source.read["validation"] == 4  # 1 + a whole pass: the early stop was not kept
  list(data(None, "validation", 0))
  assert source.read["validation"] == 4

  big = Source()
  limited = EvaluationBatches(big, limit_bytes=2 * (4 * 8 * 4 + 4 * 4))  # two batches' bytes
  for _ in range(2):
    assert len(list(limited(None, "validation", 0))) == 3
  assert big.read["validation"] == 6


def test_training_batches_are_the_sources_own():
  source = Source()
  data = EvaluationBatches(source)
  for _ in range(2):
    assert len(list(data(None, "train", 0))) == 3
  assert source.read["train"] == 6
