"""The masked-LM pipeline: full-sentence packing, BERT masking, seeds, shards and resuming."""

import numpy as np
import pytest
import tensorflow as tf

from posenc_jax.data import preprocessors as pp
from posenc_jax.data.vocab import CLS_ID, MASK_ID, NUM_RESERVED, SEP_ID

TASK, SPLIT = "wordnet_glosses", "validation"
L = 128
N = 1271        # sequences of L tokens from its 5,997 lines with the bundled vocabulary
BATCH = 41      # N = 31 * 41: batches of 41 end exactly at the epoch's end


def _take(ds, n):
  return [b for _, b in zip(range(n), ds.as_numpy_iterator())]


def _lines_dataset(lines):
  return tf.data.Dataset.from_generator(
      lambda: ({"text": np.array(x, np.int32)} for x in lines),
      output_signature={"text": tf.TensorSpec([None], tf.int32)})


@pytest.fixture(scope="module")
def packed():
  """The validation epoch packed at length L, in order, unmasked: {name: [N, L]}."""
  rows = list(pp.packed_epoch(TASK, SPLIT, L).as_numpy_iterator())
  return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


@pytest.fixture(scope="module")
def one_epoch(packed):
  """The same epoch through mlm_dataset without shuffling: 31 batches of 41."""
  batches = list(pp.mlm_dataset(TASK, SPLIT, L, BATCH, seed=7, repeat=False).as_numpy_iterator())
  return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


@pytest.mark.parametrize("lines_per_chunk", [1, 3, 1024])
def test_packing_concatenates_lines_with_sep(lines_per_chunk):
  rng = np.random.default_rng(0)
  lines = [rng.integers(NUM_RESERVED, 100, size=n).tolist() for n in (3, 0, 11, 1, 7, 20, 2)]
  out = list(pp.pack_lines(_lines_dataset(lines), 8, lines_per_chunk=lines_per_chunk)
             .as_numpy_iterator())
  stream = [t for line in lines for t in line + [SEP_ID]]              # 51 tokens
  assert len(out) == -(-len(stream) // 7)                              # ceil(51 / 7) = 8
  for i, ex in enumerate(out):
    assert ex["input_ids"].shape == ex["mask"].shape == (8,)
    assert ex["input_ids"].dtype == ex["mask"].dtype == np.int32
    assert ex["input_ids"][0] == CLS_ID and ex["mask"][0] == 1
    assert ex["mask"].all() == (i < len(out) - 1)                      # only the last is padded
  body = np.concatenate([ex["input_ids"][1:] for ex in out])
  mask = np.concatenate([ex["mask"][1:] for ex in out])
  assert body[mask == 1].tolist() == stream
  assert (body[mask == 0] == 0).all() and mask.sum() == len(stream)


def test_packing_an_exact_multiple_pads_nothing():
  out = list(pp.pack_lines(_lines_dataset([[10, 11, 12], [13, 14]]), 4).as_numpy_iterator())
  assert [ex["input_ids"].tolist() for ex in out] == [[CLS_ID, 10, 11, 12],
                                                      [CLS_ID, SEP_ID, 13, 14],
                                                      [CLS_ID, SEP_ID, 0, 0]]
  assert out[-1]["mask"].tolist() == [1, 1, 0, 0]


@pytest.mark.parametrize("lines_per_chunk", [1, 1024])
def test_packed_segments_restart_positions_at_every_line(lines_per_chunk):
  """With ``segments``: the same tokens; per row, 1, 2, ... per piece of a line ([CLS] in the
  first piece, each [SEP] in its line's) and positions counting from 0 in each piece, both 0
  at padding. Worked example: lines [10 11 12] [13 14] [15] at L = 5."""
  lines = [[10, 11, 12], [13, 14], [15]]
  out = list(pp.pack_lines(_lines_dataset(lines), 5, lines_per_chunk=lines_per_chunk,
                           segments=True).as_numpy_iterator())
  plain = list(pp.pack_lines(_lines_dataset(lines), 5).as_numpy_iterator())
  assert [ex["input_ids"].tolist() for ex in out] == [ex["input_ids"].tolist() for ex in plain]
  assert [ex["input_ids"].tolist() for ex in out] == [[CLS_ID, 10, 11, 12, SEP_ID],
                                                      [CLS_ID, 13, 14, SEP_ID, 15],
                                                      [CLS_ID, SEP_ID, 0, 0, 0]]
  assert [ex["packed_segment_ids"].tolist() for ex in out] == [[1, 1, 1, 1, 1],
                                                               [1, 1, 1, 1, 2],
                                                               [1, 1, 0, 0, 0]]
  assert [ex["position_ids"].tolist() for ex in out] == [[0, 1, 2, 3, 4],
                                                         [0, 1, 2, 3, 0],
                                                         [0, 1, 0, 0, 0]]
  assert all(ex["position_ids"].dtype == ex["packed_segment_ids"].dtype == np.int32
             for ex in out)


def test_mlm_dataset_with_segments_adds_them_and_changes_nothing_else():
  """``segments=True`` batches equal the default's in every MLM feature (same seed), and a
  new piece starts after every [SEP] of the row."""
  plain, segmented = (_take(pp.mlm_dataset(TASK, SPLIT, L, 4, seed=2, segments=s), 2)
                      for s in (False, True))
  for a, b in zip(plain, segmented):
    assert set(b) == set(a) | set(pp.SEGMENT_FEATURES)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    original = np.where(b["mlm_weights"] > 0, b["mlm_targets"], b["input_ids"])
    after_sep = np.pad(original[:, :-1] == SEP_ID, ((0, 0), (1, 0)))
    real = b["mask"] > 0
    assert np.array_equal(b["position_ids"][real] == 0, (after_sep | (np.arange(L) == 0))[real])
    assert (np.diff(b["packed_segment_ids"], axis=1)[real[:, 1:]] >= 0).all()


def test_packing_rejects_a_length_below_two():
  with pytest.raises(ValueError, match="seq_len"):
    pp.pack_lines(_lines_dataset([[10]]), 1)


def test_packed_task_is_all_real_tokens_except_the_end(packed):
  ids, mask = packed["input_ids"], packed["mask"]
  assert ids.shape == (N, L) and (ids[:, 0] == CLS_ID).all()
  assert pp.epoch_length(TASK, SPLIT, L) == N
  assert mask[:-1].all() and not mask[-1].all()
  assert (ids[mask == 1][1:] != 0).all()
  assert (ids == SEP_ID).sum() == 5_997                               # one per line


def test_bert_mask_selects_an_exact_count_of_candidates():
  ids = tf.constant([CLS_ID] + list(range(10, 30)) + [SEP_ID, 40, 41, 0, 0], tf.int32)
  mask = tf.constant([1] * 24 + [0, 0], tf.int32)
  for s in range(20):
    out = pp.bert_mask({"input_ids": ids, "mask": mask}, tf.constant([s, 1], tf.int64), 8192)
    weights = out["mlm_weights"].numpy()
    assert weights.sum() == 3                                # round(0.15 * 22 candidates)
    assert weights[[0, 21, 24, 25]].sum() == 0               # [CLS], [SEP], padding
    assert (out["mlm_targets"].numpy() == np.where(weights > 0, ids.numpy(), 0)).all()
    assert (out["segment_ids"].numpy() == 0).all()


def test_masking_rates(packed, one_epoch):
  original, corrupted = packed["input_ids"], one_epoch["input_ids"]
  assert original.shape == corrupted.shape
  selected = one_epoch["mlm_weights"] == 1
  candidates = (packed["mask"] == 1) & (original >= NUM_RESERVED)
  assert candidates.sum() > 140_000
  per_sequence = candidates.sum(1)
  assert (selected.sum(1) == np.maximum(1, np.round(0.15 * per_sequence))).all()
  assert abs(selected.sum() / candidates.sum() - 0.15) < 0.005
  assert not (selected & ~candidates).any()                          # specials never selected
  assert (corrupted[~selected] == original[~selected]).all()         # nothing else changes
  assert (one_epoch["mlm_targets"][selected] == original[selected]).all()
  assert (one_epoch["mlm_targets"][~selected] == 0).all()
  to_mask = (corrupted[selected] == MASK_ID).mean()
  kept = (corrupted[selected] == original[selected]).mean()
  to_random = 1 - to_mask - kept
  assert abs(to_mask - 0.8) < 0.015 and abs(kept - 0.1) < 0.01 and abs(to_random - 0.1) < 0.01
  assert (corrupted[selected] >= NUM_RESERVED).sum() + (corrupted[selected] == MASK_ID).sum() \
      == selected.sum()                                              # random ids are pieces
  assert one_epoch["mlm_weights"].dtype == np.float32
  assert all(one_epoch[k].dtype == np.int32 for k in ("input_ids", "segment_ids", "mask",
                                                       "mlm_targets"))


def test_same_seed_same_batches_other_seed_other_batches():
  a, b, c = (_take(pp.mlm_dataset(TASK, SPLIT, L, 16, seed=s), 3) for s in (0, 0, 1))
  for x, y in zip(a, b):
    assert all((x[k] == y[k]).all() for k in pp.MLM_FEATURES)
  assert not (a[0]["input_ids"] == c[0]["input_ids"]).all()
  assert set(a[0]) == set(pp.MLM_FEATURES) and a[0]["input_ids"].shape == (16, L)


def test_shards_are_disjoint_and_cover_one_host():
  whole = _take(pp.mlm_dataset(TASK, SPLIT, L, 8, seed=3), 3)
  shards = [_take(pp.mlm_dataset(TASK, SPLIT, L, 4, seed=3, shard_id=k, num_shards=2), 3)
            for k in (0, 1)]
  for step in range(3):
    for k in pp.MLM_FEATURES:
      assert (shards[0][step][k] == whole[step][k][0::2]).all()
      assert (shards[1][step][k] == whole[step][k][1::2]).all()
  rows = [tuple(r) for s in shards for b in s for r in b["input_ids"]]
  assert len(set(rows)) == len(rows)


@pytest.mark.parametrize("num_shards", [1, 2])
def test_start_step_resumes_exactly_across_an_epoch_boundary(num_shards):
  # 8 sequences per global batch, N = 1271: batch 158 holds the last 7 sequences of epoch 0
  # and the first of epoch 1; resuming at 159 starts inside epoch 1.
  batch = 8 // num_shards
  full = _take(pp.mlm_dataset(TASK, SPLIT, L, batch, seed=5, num_shards=num_shards), 161)
  for start in (158, 159):
    resumed = _take(pp.mlm_dataset(TASK, SPLIT, L, batch, seed=5, num_shards=num_shards,
                                   start_step=start), 161 - start)
    for x, y in zip(full[start:], resumed, strict=True):
      assert all((x[k] == y[k]).all() for k in pp.MLM_FEATURES)


def test_epochs_are_shuffled_and_masked_anew(packed):
  per_epoch = N // BATCH
  batches = _take(pp.mlm_dataset(TASK, SPLIT, L, BATCH, seed=0), 2 * per_epoch)
  epochs = []
  for e in (0, 1):
    b = {k: np.concatenate([x[k] for x in batches[e * per_epoch:(e + 1) * per_epoch]])
         for k in pp.MLM_FEATURES}
    original = np.where(b["mlm_weights"] == 1, b["mlm_targets"], b["input_ids"])
    epochs.append((original, b["mlm_weights"]))
    # Each epoch is the packed epoch, permuted.
    assert sorted(map(tuple, original)) == sorted(map(tuple, packed["input_ids"]))
    assert not (original == packed["input_ids"]).all()
  (first, first_weights), (second, second_weights) = epochs
  assert not (first == second).all()
  rows = {tuple(r): w for r, w in zip(first, first_weights)}
  same_masks = [(rows[tuple(r)] == w).all() for r, w in zip(second, second_weights)]
  assert np.mean(same_masks) < 0.01                       # a sequence is masked anew


def test_bad_shard_id():
  with pytest.raises(ValueError, match="shard_id"):
    pp.mlm_dataset(TASK, SPLIT, L, 8, seed=0, shard_id=2, num_shards=2)
