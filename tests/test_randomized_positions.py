"""Randomized positional encodings (Ruoss et al., ACL 2023, Section 3): ids sorted, unique and
inside [0, N), per packed segment; every id and every subset can occur; deterministic in the
seed, the step and the row; a resume draws what an uninterrupted run draws; evaluation ids
per ``randomized_positions_eval``; validation; a tiny training run."""

import itertools
import math

import jax
import numpy as np
import pytest

from posenc_jax.data.randomized_positions import (EVAL, TRAIN, RandomizedPositions,
                                                  randomized_batches, randomized_position_ids)
from posenc_jax.presets import preset_config
from posenc_jax.training import loop
from posenc_jax.training.config import TrainConfigError, base_train_config, validate_train_config


def _ids(step, seed=0, shape=(4, 8), n=32, **kw):
  return randomized_position_ids(shape, n, seed, TRAIN, step, **kw)


def test_ids_are_sorted_unique_and_inside_the_range():
  for step in range(5):
    ids = _ids(step)
    assert ids.dtype == np.int32 and ids.shape == (4, 8)
    assert np.all(np.diff(ids, axis=1) > 0)  # strictly increasing: sorted and unique
    assert ids.min() >= 0 and ids.max() < 32
  assert np.array_equal(_ids(0, n=8), np.tile(np.arange(8), (4, 1)))  # N = L: plain positions


def test_deterministic_in_seed_step_and_row_and_different_across_them():
  assert np.array_equal(_ids(3), _ids(3))
  assert not np.array_equal(_ids(3), _ids(4))
  assert not np.array_equal(_ids(3), _ids(3, seed=1))
  assert not np.array_equal(_ids(3), randomized_position_ids((4, 8), 32, 0, EVAL, 3))
  assert len({tuple(row) for row in _ids(3)}) == 4  # each example its own subset
  # Host 1 of 2 (2 rows each) draws the global rows 2 and 3 of one host's batch.
  assert np.array_equal(_ids(3, shape=(2, 8), row_offset=2), _ids(3)[2:])


def test_every_id_and_every_subset_can_occur():
  """N = 5, n = 2: all C(5, 2) = 10 ordered subsets appear, roughly equally often (an offset
  window or sorted draws with replacement would miss or skew some)."""
  draws = np.concatenate([_ids(step, shape=(8, 2), n=5) for step in range(100)])
  counts = {s: 0 for s in itertools.combinations(range(5), 2)}
  for row in draws:
    counts[tuple(int(i) for i in row)] += 1
  assert len(counts) == math.comb(5, 2) and min(counts.values()) > 800 / 10 / 2
  assert set(np.concatenate([_ids(s, shape=(4, 3), n=8) for s in range(30)]).ravel()) \
      == set(range(8))


def test_packed_segments_get_their_own_subsets():
  segments = np.array([[1, 1, 1, 2, 2, 3, 0, 0]] * 4)
  positions = np.array([[0, 1, 2, 0, 1, 0, 0, 0]] * 4)
  crossed = False
  for step in range(20):
    ids = _ids(step, n=6, packed_segment_ids=segments, position_ids=positions)
    for s in (1, 2, 3):
      piece = ids[:, segments[0] == s]
      assert np.all(np.diff(piece, axis=1) > 0) and piece.min() >= 0 and piece.max() < 6
    assert np.all(ids[:, 6:] == 0)  # padding keeps position 0
    crossed |= bool(np.any(ids[:, 3] < ids[:, 2]))  # segment 2 restarts below segment 1
  assert crossed


def _stream(config, split, start_step, shard_id=0, num_shards=1):
  """Batches of 2 rows of length 8; the ids of step s are s."""
  for step in itertools.count(start_step):
    yield {"input_ids": np.full((2, 8), step, np.int32)}


class _Stateful:
  """A training iterator whose state a fake checkpointer restores."""

  def __init__(self):
    self.batches = _stream(None, "train", 0)

  def __iter__(self):
    return self

  def __next__(self):
    return next(self.batches)

  def restore_state(self, step):
    self.batches = _stream(None, "train", step)


class _Checkpointer:
  def __init__(self, restores):
    self.restores = restores

  def restore_input(self, step, batches):
    if self.restores:
      batches.restore_state(step)
    return self.restores


def _config(preset="rope", **fields):
  config = base_train_config()
  config.update(preset_config(f"bert_tiny,{preset}"))
  config.update(dict(seq_len=8, batch_size=2, randomized_positions=64, seed=7) | fields)
  config.optimizer.warmup_steps = 0
  return config


@pytest.mark.parametrize("restores", [True, False])
def test_a_resume_draws_what_an_uninterrupted_run_draws(restores):
  config = _config()
  host = dict(shard_id=0, num_shards=1)
  data = (lambda *a, **k: _Stateful()) if restores else _stream
  whole = list(itertools.islice(loop._train_batches(data, config, 0, host, None), 6))
  resumed = list(itertools.islice(
      loop._train_batches(data, config, 3, host, _Checkpointer(restores)), 3))
  for a, b in zip(whole[3:], resumed):
    assert np.array_equal(a["input_ids"], b["input_ids"])
    assert np.array_equal(a["position_ids"], b["position_ids"])
  assert not np.array_equal(whole[0]["position_ids"], whole[1]["position_ids"])


def test_evaluation_positions_follow_the_option():
  config = _config()

  def evaluation(c):
    return next(randomized_batches(c, _stream(c, "validation", 0), 0, evaluation=True))

  first, again = evaluation(config), evaluation(config)
  assert np.array_equal(first["position_ids"], again["position_ids"])  # every evaluation
  train = next(randomized_batches(config, _stream(config, "train", 0), 0))
  assert not np.array_equal(first["position_ids"], train["position_ids"])
  config.randomized_positions_eval = "plain"
  assert "position_ids" not in evaluation(config)
  config.randomized_positions = None
  batches = _stream(config, "train", 0)
  assert randomized_batches(config, batches, 0) is batches
  assert isinstance(randomized_batches(_config(), batches, 0), RandomizedPositions)


@pytest.mark.parametrize("fields, preset, message", [
    (dict(randomized_positions=4), "rope", "randomized_positions: got 4; allowed: None (off) or "
     "an integer >= seq_len=8"),
    (dict(randomized_positions_eval="fixed"), "rope", "randomized_positions_eval: got 'fixed';"
     " allowed: 'randomized', 'plain'"),
    (dict(objective="classification", head="classification"), "rope",
     "randomized_positions: got 64; allowed: None for objective 'classification'"),
    (dict(randomized_positions=1024), "bert", "randomized_positions: 1024 exceeds "
     "model.max_len=512, the size of scheme 'learned_ape'"),
])
def test_bad_fields_fail_with_one_line_naming_them(fields, preset, message):
  config = _config(preset)
  config.model.max_len = 512
  config.update(fields)
  with pytest.raises(TrainConfigError) as e:
    validate_train_config(config)
  assert str(e.value).startswith(message) and "\n" not in str(e.value)
  config.update(dict(randomized_positions=512, randomized_positions_eval="plain",
                     objective="mlm", head="mlm"))
  validate_train_config(config)  # N = max_len fits a table


class _Stop(Exception):
  """Kills a run between two steps."""


def test_a_tiny_training_run_finite_and_resumed_exactly(tmp_path, monkeypatch):
  """bert_tiny (one layer) with ALiBi, masked LM, 4 steps and an evaluation: finite losses,
  every batch reaching the step carries drawn ids, and a run killed after its step-2
  checkpoint and resumed ends with the uninterrupted run's parameters and losses."""
  config = _config("alibi", total_steps=4, log_every=1, eval_every=4, eval_steps=1,
                   checkpoint_every=2, async_checkpointing=False, max_predictions_per_seq=8,
                   compilation_cache_dir=str(tmp_path / "xla"))
  config.model.update(dict(vocab_size=64, d_model=32, num_layers=1, num_heads=2, mlp_dim=64,
                           max_len=8, dropout_rate=0.0, attention_dropout_rate=0.0))
  kill_at = []

  def data(config, split, start_step, shard_id=0, num_shards=1):
    steps = itertools.count(start_step) if split == "train" else range(config.eval_steps)
    for step in steps:
      if split == "train" and step in kill_at:
        kill_at.clear()
        raise _Stop
      rng = np.random.default_rng(step)
      ids = rng.integers(6, 64, (2, 8)).astype(np.int32)
      weights = (rng.random((2, 8)) < 0.3).astype(np.float32)
      yield {"input_ids": np.where(weights > 0, 5, ids), "segment_ids": np.zeros_like(ids),
             "mask": np.ones_like(ids), "mlm_targets": ids * (weights > 0),
             "mlm_weights": weights}

  seen = []
  place = loop._global
  monkeypatch.setattr(loop, "_global", lambda b, s: seen.append(sorted(b)) or place(b, s))
  whole = loop.train(config, str(tmp_path / "whole"), data=data)
  losses = [h["loss"] for h in whole["history"]] + [whole["history"][-1]["eval_loss"]]
  assert len(losses) == 5 and np.all(np.isfinite(losses))
  assert all("position_ids" in keys for keys in seen[1:])  # seen[0]: the init batch
  kill_at.append(2)
  with pytest.raises(_Stop):
    loop.train(config, str(tmp_path / "resumed"), data=data)
  resumed = loop.train(config, str(tmp_path / "resumed"), data=data)
  assert [h["step"] for h in resumed["history"]] == [3, 4]
  np.testing.assert_array_equal([h["loss"] for h in resumed["history"]], losses[2:4])
  for a, b in zip(jax.tree.leaves(whole["state"].params), jax.tree.leaves(resumed["state"].params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
