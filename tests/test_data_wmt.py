"""WMT18 translation tasks under ``tfds.testing.mock_data`` (``MockPolicy.USE_CODE``: offline,
no metadata files; seqio's split-size lookup, only used for in-memory caching, is reported
as unknown)."""

import importlib

import numpy as np
import pytest

from tests.conftest import require

tf = require("tensorflow")
seqio = require("seqio")
tfds = require("tensorflow_datasets")
sacrebleu = require("sacrebleu")

from posenc_jax.data import metrics, wmt  # noqa: E402
from posenc_jax.data import vocab as vocab_lib  # noqa: E402
from tests import tfds_mock  # noqa: E402
from posenc_jax.data.wordpiece import WordPieceVocabulary  # noqa: E402

NAMES = ("wmt18_en_de", "wmt18_de_en", "wmt18_en_cs", "wmt18_cs_en")
NUM_EXAMPLES = 4


def mock_tfds(num_examples=NUM_EXAMPLES):
  return tfds_mock.mock_tfds(num_examples)


@pytest.mark.parametrize("name", NAMES)
def test_translation_task_features(name):
  source, target = name.split("_")[1:]
  task = seqio.get_mixture_or_task(name)
  assert set(task.splits) == {"train", "validation", "test"}
  assert task.metric_fns == [metrics.bleu]
  vocabulary = task.output_features["targets"].vocabulary
  assert vocabulary == task.output_features["inputs"].vocabulary == vocab_lib.vocabulary()
  with mock_tfds():
    raw = list(task.source.get_dataset(split="test", shuffle=False).as_numpy_iterator())
    assert set(raw[0]) == {source, target}
    for length in (6, 64):               # 6 trims (EOS still last), 64 keeps everything
      ds = task.get_dataset({"inputs": length, "targets": length}, split="test",
                            shuffle=False, num_epochs=1)
      spec = ds.element_spec
      assert spec["inputs"].dtype == spec["targets"].dtype == tf.int32
      assert spec["inputs"].shape.as_list() == spec["targets"].shape.as_list() == [None]
      examples = list(ds.as_numpy_iterator())
      assert len(examples) == NUM_EXAMPLES
      for ex, src in zip(examples, raw):
        for key, lang in (("inputs", source), ("targets", target)):
          expected = vocabulary.encode(src[lang].decode())[:length - 1] + [vocabulary.eos_id]
          assert ex[key].tolist() == expected
          assert ex[f"{key}_pretokenized"] == src[lang]
    batch = next(seqio.utils.trim_and_pad_dataset(ds, {"inputs": 64, "targets": 64})
                 .batch(2).as_numpy_iterator())
  assert batch["inputs"].shape == batch["targets"].shape == (2, 64)


def test_bleu_on_decoded_targets_is_sacrebleu():
  task = seqio.get_mixture_or_task("wmt18_en_de")
  vocabulary = task.output_features["targets"].vocabulary
  with mock_tfds():
    examples = list(task.get_dataset({"inputs": 64, "targets": 64}, split="test",
                                     shuffle=False).as_numpy_iterator())
  references = [ex["targets_pretokenized"].decode() for ex in examples]
  predictions = [vocabulary.decode(ex["targets"].tolist()) for ex in examples]
  predictions[0] = ""                                       # an empty hypothesis
  scores = {}
  for fn in task.metric_fns:
    scores |= fn(references, predictions)
  assert scores == {"bleu": sacrebleu.corpus_bleu(predictions, [references]).score}


def test_newstest2018_is_the_test_split_and_czeng_is_manual(tmp_path):
  from tensorflow_datasets.translate import wmt as tfds_wmt  # noqa: PLC0415
  for config, source in (("de-en", "de"), ("cs-en", "cs")):
    builder = tfds.builder(f"wmt18_translate/{config}:{wmt.WMT18_VERSION}", data_dir=tmp_path)
    subsets = builder.subsets
    assert subsets[tfds.Split.TEST] == ["newstest2018"]
    assert subsets[tfds.Split.VALIDATION] == ["newstest2017"]
    manual = {name: tfds_wmt.DATASET_MAP[name].get_manual_dl_files(source)
              for names in subsets.values() for name in names}
    needs_hand = {name: files for name, files in manual.items() if files}
    if config == "de-en":
      assert not needs_hand
    else:
      assert needs_hand == {"czeng_17": [f"data-plaintext-format.{i}.tar" for i in range(10)]}
  assert "data-plaintext-format.0.tar" in wmt.__doc__ and "downloads/manual" in wmt.__doc__


def test_register_under_another_vocabulary(tmp_path):
  spm_path = vocab_lib.train([f"line {i} of some text with words {i * 7}" for i in range(300)],
                             tmp_path / "spm", vocab_size=60)
  other = vocab_lib.vocabulary(spm_path)
  names = wmt.register_wmt18(other, suffix="_test60")
  assert names == [n + "_test60" for n in NAMES]
  assert wmt.register_wmt18(other, suffix="_test60") == names      # again: no error
  task = seqio.get_mixture_or_task("wmt18_de_en_test60")
  assert task.output_features["inputs"].vocabulary.vocab_size == 60
  with mock_tfds():
    ex = next(task.get_dataset({"inputs": 32, "targets": 32}, split="train",
                               shuffle=False).as_numpy_iterator())
  assert ex["targets"][-1] == 1 and ex["targets"].max() < 60
  with pytest.raises(ValueError, match="another vocabulary"):
    wmt.register_wmt18(vocab_lib.vocabulary(), suffix="_test60")
  (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]))
  with pytest.raises(ValueError, match="EOS"):
    wmt.register_wmt18(WordPieceVocabulary(tmp_path / "vocab.txt"), suffix="_wp")


def test_registration_is_idempotent():
  before = [seqio.get_mixture_or_task(name) for name in NAMES]
  importlib.reload(wmt)
  assert [seqio.get_mixture_or_task(name) for name in NAMES] == before
  assert np.all([seqio.get_mixture_or_task(n) is t for n, t in zip(NAMES, before)])
