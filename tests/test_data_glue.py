"""GLUE and XNLI tasks under ``tfds.testing.mock_data``: features, shapes, dtypes, segments.

``MockPolicy.USE_CODE`` builds fake examples from each builder's feature spec, offline and
without metadata files. Its ``DatasetInfo`` has no split sizes, which seqio asks for only to
decide on in-memory caching, so ``mock_tfds`` also reports the size as unknown.
"""

import importlib

import numpy as np
import pytest

from tests.conftest import require

tf = require("tensorflow")
seqio = require("seqio")
tfds = require("tensorflow_datasets")

from posenc_jax.data import glue, metrics  # noqa: E402
from posenc_jax.data import vocab as vocab_lib  # noqa: E402
from tests import tfds_mock  # noqa: E402
from posenc_jax.data.wordpiece import WordPieceVocabulary  # noqa: E402

NUM_EXAMPLES = 4
SHORT, LONG = 12, 64          # SHORT truncates the mock texts (~20 chars), LONG does not


def mock_tfds(num_examples=NUM_EXAMPLES, as_dataset_fn=None):
  return tfds_mock.mock_tfds(num_examples, as_dataset_fn)


def bert_truncate(a, b, budget):
  """BERT's ``_truncate_seq_pair``: pop from the longer (``b`` on a tie) until it fits."""
  a, b = list(a), list(b)
  while len(a) + len(b) > budget:
    (a if len(a) > len(b) else b).pop()
  return a, b


def reference_features(vocabulary, texts, max_len):
  """The expected ``input_ids``/``segment_ids``/``mask`` from the Python encoder."""
  cls_id, sep_id = glue.special_ids(vocabulary)
  pieces = [vocabulary.encode(t.decode() if isinstance(t, bytes) else t) for t in texts]
  if len(pieces) == 1:
    ids = [cls_id] + pieces[0][:max_len - 2] + [sep_id]
    segments = [0] * len(ids)
  else:
    a, b = bert_truncate(pieces[0], pieces[1], max_len - 3)
    ids = [cls_id] + a + [sep_id] + b + [sep_id]
    segments = [0] * (len(a) + 2) + [1] * (len(b) + 1)
  pad = max_len - len(ids)
  return ids + [0] * pad, segments + [0] * pad, [1] * len(ids) + [0] * pad


def raw_examples(task, split):
  return list(task.source.get_dataset(split=split, shuffle=False).as_numpy_iterator())


def check_examples(task, info, split, max_len, raw=None):
  """Every example of ``split`` equals the reference encoding of its raw text."""
  ds = task.get_dataset({"input_ids": max_len}, split=split, shuffle=False, num_epochs=1)
  label_dtype = tf.float32 if info.regression else tf.int32
  expected_spec = {"input_ids": ([max_len], tf.int32), "segment_ids": ([max_len], tf.int32),
                   "mask": ([max_len], tf.int32), "label": ([], label_dtype)}
  if "idx" in task.output_features:
    expected_spec["idx"] = ([], tf.int32)
  assert {k: (s.shape.as_list(), s.dtype) for k, s in ds.element_spec.items()} == expected_spec
  examples = list(ds.as_numpy_iterator())
  raw = raw if raw is not None else raw_examples(task, split)
  assert len(examples) == len(raw) == NUM_EXAMPLES
  vocabulary = task.output_features["input_ids"].vocabulary
  for ex, source in zip(examples, raw):
    ids, segments, mask = reference_features(
        vocabulary, [source[k] for k in info.text_keys], max_len)
    np.testing.assert_array_equal(ex["input_ids"], ids)
    np.testing.assert_array_equal(ex["segment_ids"], segments)
    np.testing.assert_array_equal(ex["mask"], mask)
    assert ex["label"] == pytest.approx(source["label"])
    if "idx" in ex:
      assert ex["idx"] == source["idx"]
  return examples


def check_layout(examples, vocabulary, is_pair):
  """[CLS] a [SEP] (b [SEP]) then padding; segment 1 exactly on b [SEP]."""
  cls_id, sep_id = glue.special_ids(vocabulary)
  for ex in examples:
    length = int(ex["mask"].sum())
    ids, segments = ex["input_ids"][:length], ex["segment_ids"][:length]
    assert ids[0] == cls_id and ids[-1] == sep_id and np.all(ex["input_ids"][length:] == 0)
    assert np.all(ex["mask"][:length] == 1) and np.all(ex["segment_ids"][length:] == 0)
    seps = np.flatnonzero(ids == sep_id)
    if is_pair:
      assert len(seps) == 2
      np.testing.assert_array_equal(segments, np.arange(length) > seps[0])
    else:
      assert list(seps) == [length - 1] and not segments.any()


# The TFDS split names, as the builders' ``_split_generators`` define them (the mock accepts
# any split name, so they are pinned here).
TFDS_SPLITS = {"glue_mnli": {"train", "validation_matched", "validation_mismatched",
                             "test_matched", "test_mismatched"},
               "glue_ax": {"test"}}


@pytest.mark.parametrize("name", glue.GLUE_TASKS + ("xnli_train",))
def test_glue_task_yields_bert_features(name):
  info = glue.TASK_INFO[name]
  task = seqio.get_mixture_or_task(name)
  assert set(task.splits) == set(info.splits) and set(info.eval_splits) <= set(info.splits)
  config = info.tfds_name.split(":")[0].removeprefix("glue/")
  assert set(info.splits.values()) <= TFDS_SPLITS.get(f"glue_{config}",
                                                      {"train", "validation", "test"})
  assert task.metric_fns == list(info.metric_fns) and info.metric_fns
  split = info.eval_splits[-1] if info.eval_splits else "test"
  with mock_tfds():
    examples = check_examples(task, info, split, SHORT)
  check_layout(examples, task.output_features["input_ids"].vocabulary, info.is_pair)
  assert any(ex["mask"].all() for ex in examples)        # SHORT truncated something


@pytest.mark.parametrize("name", ["glue_cola", "glue_stsb"])
def test_long_sequences_are_padded_and_batch(name):
  info = glue.TASK_INFO[name]
  task = seqio.get_mixture_or_task(name)
  with mock_tfds():
    examples = check_examples(task, info, "train", LONG)
    batch = next(task.get_dataset({"input_ids": LONG}, split="train", shuffle=False)
                 .batch(3).as_numpy_iterator())
  check_layout(examples, task.output_features["input_ids"].vocabulary, info.is_pair)
  assert not any(ex["mask"].all() for ex in examples)    # LONG kept everything
  assert batch["input_ids"].shape == batch["segment_ids"].shape == batch["mask"].shape == (
      3, LONG)
  assert batch["label"].shape == (3,) and batch["label"].dtype == (
      np.float32 if info.regression else np.int32)


def test_task_info_matches_the_tfds_builders(tmp_path):
  for name, info in glue.TASK_INFO.items():
    builder = tfds.builder(info.tfds_name, data_dir=tmp_path)
    features = builder.info.features
    for key in info.text_keys:
      assert key in features, (name, key)
    if info.regression:
      assert features["label"].dtype == tf.float32 and info.num_labels == 1
    else:
      assert tuple(features["label"].names) == info.label_names, name
      assert info.num_labels == len(info.label_names)
  # Zero-shot XNLI: the MNLI training labels mean the same classes.
  assert tuple(tfds.builder("xnli", data_dir=tmp_path).info.features["label"].names) == (
      tuple(tfds.builder("glue/mnli", data_dir=tmp_path).info.features["label"].names))
  assert set(glue.TASK_INFO["xnli_train"].splits.values()) <= {"train", "validation_matched"}
  assert len(glue.XNLI_TASKS) == 16 and len(glue.GLUE_TASKS) == 10


def test_metrics_per_task_are_the_reported_ones():
  expected = {"glue_cola": {"matthews_corr"}, "glue_mrpc": {"f1", "accuracy"},
              "glue_qqp": {"f1", "accuracy"}, "glue_stsb": {"pearson", "spearman"},
              "glue_ax": {"matthews_corr"}}
  for name, info in glue.TASK_INFO.items():
    values = [0, 1, 1, 0, 1] if not info.regression else [0.0, 1.5, 2.0, 4.0, 5.0]
    out = {}
    for fn in seqio.get_mixture_or_task(name).metric_fns:
      out |= fn(values, values[::-1])
    assert set(out) == expected.get(name, {"accuracy"}) == set(info.metrics), name
  assert glue.task_score("glue_mrpc", {"f1": 90.0, "accuracy": 86.0}) == 88.0
  assert glue.task_score("glue_stsb", {"pearson": 88.0, "spearman": 87.0}) == 87.5
  assert glue.TASK_INFO["glue_mnli"].eval_splits == ("validation_matched",
                                                     "validation_mismatched")


def test_pair_truncation_is_berts_longest_first():
  for budget in range(0, 16):
    for la in range(0, 14):
      for lb in range(0, 14):
        a, b = bert_truncate(range(la), range(lb), budget)
        got = glue.pair_lengths(tf.constant(la), tf.constant(lb), budget)
        assert (int(got[0]), int(got[1])) == (len(a), len(b)), (la, lb, budget)


def test_default_length_and_inconsistent_lengths():
  task = seqio.get_mixture_or_task("glue_rte")
  with mock_tfds():
    ex = next(task.get_dataset(None, split="validation", shuffle=False).as_numpy_iterator())
    assert ex["input_ids"].shape == (glue.DEFAULT_MAX_LEN,)
    with pytest.raises(ValueError, match="same length"):
      task.get_dataset({"input_ids": 16, "mask": 8}, split="validation")


XNLI_FAKE = [
    ({lang: f"premise {i} in {lang}" for lang in glue.XNLI_LANGUAGES},
     list(reversed(glue.XNLI_LANGUAGES)), i % 3)
    for i in range(NUM_EXAMPLES)
]


def fake_xnli(builder, split, *args, **kwargs):
  """XNLI-shaped examples: every language present, the hypotheses in another order."""
  assert builder.name == "xnli"
  premises = {lang: [p[lang] for p, _, _ in XNLI_FAKE] for lang in glue.XNLI_LANGUAGES}
  languages = [order for _, order, _ in XNLI_FAKE]
  translations = [[f"hypothesis {i} in {lang} {split}" for lang in order]
                  for i, (_, order, _) in enumerate(XNLI_FAKE)]
  return tf.data.Dataset.from_tensor_slices({
      "premise": premises,
      "hypothesis": {"language": tf.constant(languages), "translation": tf.constant(translations)},
      "label": tf.constant([label for _, _, label in XNLI_FAKE], tf.int64),
  })


@pytest.mark.parametrize("language", glue.XNLI_LANGUAGES)
def test_xnli_language_task_keeps_its_language(language):
  name = f"xnli_{language}"
  task = seqio.get_mixture_or_task(name)
  info = glue.TASK_INFO[name]
  assert set(task.splits) == {"validation", "test"} and "idx" not in task.output_features
  splits = ("validation", "test") if language == "en" else ("test",)
  with mock_tfds(as_dataset_fn=fake_xnli):
    for split in splits:
      raw = [{"premise": f"premise {i} in {language}",
              "hypothesis": f"hypothesis {i} in {language} {split}", "label": label}
             for i, (_, _, label) in enumerate(XNLI_FAKE)]
      examples = check_examples(task, info, split, LONG, raw=raw)
  check_layout(examples, task.output_features["input_ids"].vocabulary, True)


def test_xnli_without_the_language_is_an_error():
  task = seqio.get_mixture_or_task("xnli_de")
  with mock_tfds():     # random "language" strings: no German hypothesis
    ds = task.get_dataset({"input_ids": 16}, split="test", shuffle=False)
    with pytest.raises(tf.errors.InvalidArgumentError, match="exactly one de hypothesis"):
      next(ds.as_numpy_iterator())


def test_register_under_a_wordpiece_vocabulary(tmp_path):
  tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list("abcdefghij") + [
      "##" + c for c in "abcdefghij"]
  (tmp_path / "vocab.txt").write_text("\n".join(tokens) + "\n")
  wp = WordPieceVocabulary(tmp_path / "vocab.txt")
  names = glue.register_classification_tasks(wp, suffix="_wptest",
                                             names=["glue_mrpc", "glue_sst2", "xnli_fr"])
  assert names == ["glue_mrpc_wptest", "glue_sst2_wptest", "xnli_fr_wptest"]
  assert glue.register_classification_tasks(wp, suffix="_wptest", names=["glue_mrpc"]) == [
      "glue_mrpc_wptest"]                                    # again: no error
  with pytest.raises(ValueError, match="registered with vocabulary"):
    glue.register_classification_tasks(vocab_lib.vocabulary(), suffix="_wptest",
                                       names=["glue_mrpc"])
  assert glue.special_ids(wp) == (2, 3)
  assert glue.task_score("glue_mrpc_wptest", {"f1": 80.0, "accuracy": 70.0}) == 75.0
  for name in ("glue_mrpc", "glue_sst2"):
    task = seqio.get_mixture_or_task(name + "_wptest")
    with mock_tfds():
      examples = check_examples(task, glue.TASK_INFO[name], "validation", SHORT)
    assert all(ex["input_ids"][0] == 2 for ex in examples)


def test_majority_baseline():
  with mock_tfds():
    cola = glue.majority_baseline("glue_cola", "validation")
    assert cola == {"matthews_corr": 0.0}
    task = seqio.get_mixture_or_task("glue_sst2")
    labels = [ex["label"] for ex in raw_examples(task, "train")]
    expected = metrics.accuracy(labels, [np.bincount(labels).argmax()] * len(labels))
    assert glue.majority_baseline("glue_sst2", "validation") == expected  # mock: same examples


def test_registration_is_idempotent():
  before = {name: seqio.get_mixture_or_task(name) for name in glue.TASK_INFO}
  importlib.reload(glue)
  assert all(seqio.get_mixture_or_task(name) is task for name, task in before.items())
