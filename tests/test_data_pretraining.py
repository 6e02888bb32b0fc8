"""Masked-LM corpora (Wikipedia, C4, Wiki40B) under ``tfds.testing.mock_data``
(``MockPolicy.USE_CODE``: offline, no metadata files; seqio's split-size lookup, only used
for in-memory caching, is reported as unknown)."""

import importlib

import numpy as np
import pytest

from tests.conftest import require

tf = require("tensorflow")
seqio = require("seqio")
tfds = require("tensorflow_datasets")

from posenc_jax.data import pretraining  # noqa: E402
from posenc_jax.data import vocab as vocab_lib  # noqa: E402
from tests import tfds_mock  # noqa: E402
from posenc_jax.data.preprocessors import MLM_FEATURES, mlm_dataset  # noqa: E402

NUM_EXAMPLES = 3
WIKI40B_ARTICLE = (
    "\n_START_ARTICLE_\nDog\n_START_SECTION_\nTaxonomy\n_START_PARAGRAPH_\n"
    "The dog is a domesticated descendant of the wolf._NEWLINE_It is a mammal.\n"
    "_START_SECTION_\nHistory\n_START_PARAGRAPH_\nDogs were the first species "
    "domesticated._NEWLINE_ _NEWLINE_\n_START_PARAGRAPH_\nA third paragraph.")
WIKI40B_PARAGRAPHS = ["The dog is a domesticated descendant of the wolf.", "It is a mammal.",
                      "Dogs were the first species domesticated.", "A third paragraph."]


def mock_tfds(num_examples=NUM_EXAMPLES, as_dataset_fn=None):
  return tfds_mock.mock_tfds(num_examples, as_dataset_fn)


def fake_wiki40b(builder, split, *args, **kwargs):
  """Wiki40B-shaped articles (the mock's random text has no markup)."""
  assert builder.name == "wiki40b"
  n = NUM_EXAMPLES
  return tf.data.Dataset.from_tensor_slices({
      "wikidata_id": [f"Q{i}" for i in range(n)], "version_id": ["1"] * n,
      "text": [WIKI40B_ARTICLE.replace("dog", f"dog {i} {builder.builder_config.name}")
               for i in range(n)]})


def _texts(ds):
  return [t.decode() for t in ds.map(lambda ex: ex["text"]).as_numpy_iterator()]


def test_task_names_and_sources():
  names = pretraining.PRETRAINING_TASKS
  assert names[:2] == ("wikipedia_en", "c4_en")
  assert len(pretraining.WIKI40B_LANGUAGES) == 41
  assert {f"wiki40b_{lang.replace('-', '_')}" for lang in pretraining.WIKI40B_LANGUAGES} == (
      set(names[2:]))
  assert {"wiki40b_en", "wiki40b_de", "wiki40b_zh_cn", "wiki40b_zh_tw"} <= set(names)
  configs = {"wikipedia": {c.name for c in tfds.builder_cls("wikipedia").BUILDER_CONFIGS},
             "c4": {c.name for c in tfds.builder_cls("c4").BUILDER_CONFIGS},
             "wiki40b": set(pretraining.WIKI40B_LANGUAGES)}
  for name in names:
    task = seqio.get_mixture_or_task(name)
    builder, rest = task.source.tfds_dataset.name.split("/")
    config, version = rest.split(":")
    assert config in configs[builder], name
    assert version == str(tfds.builder_cls(builder).VERSION if builder == "wikipedia"
                          else tfds.builder_cls(builder).BUILDER_CONFIGS[0].version)
    assert task.output_features["text"].vocabulary == vocab_lib.vocabulary()
    assert not task.output_features["text"].add_eos
  wikipedia_splits = seqio.get_mixture_or_task("wikipedia_en").source.tfds_dataset._split_map
  assert wikipedia_splits == {"train": "train[10000:]", "validation": "train[:10000]"}
  for spec in wikipedia_splits.values():       # valid TFDS slicing
    tfds.core.ReadInstruction.from_spec(spec)


def test_split_paragraphs():
  doc = "First paragraph.\n\n  Second one, indented.  \n\nThird\n"
  ds = tf.data.Dataset.from_tensor_slices({"text": [doc, "", "single"]})
  assert _texts(pretraining.split_paragraphs(ds)) == [
      "First paragraph.", "Second one, indented.", "Third", "single"]


def test_wiki40b_paragraphs_drop_markup_and_titles():
  ds = tf.data.Dataset.from_tensor_slices({"text": [WIKI40B_ARTICLE, "no markup at all"]})
  assert _texts(pretraining.wiki40b_paragraphs(ds)) == WIKI40B_PARAGRAPHS


@pytest.mark.parametrize("name", ["wikipedia_en", "c4_en"])
def test_document_corpus_yields_tokenised_paragraphs(name):
  task = seqio.get_mixture_or_task(name)
  vocabulary = task.output_features["text"].vocabulary
  with mock_tfds():
    raw = list(task.source.get_dataset(split="train", shuffle=False).as_numpy_iterator())
    for split in task.splits:
      ds = task.get_dataset(None, split=split, shuffle=False, num_epochs=1)
      assert ds.element_spec["text"].dtype == tf.int32
      assert ds.element_spec["text"].shape.as_list() == [None]
      examples = list(ds.as_numpy_iterator())
      # The mock's texts have no newline: one paragraph per document, stripped.
      assert [ex["text_pretokenized"].decode() for ex in examples] == [
          r["text"].decode().strip() for r in raw]
      for ex in examples:
        assert ex["text"].tolist() == vocabulary.encode(ex["text_pretokenized"].decode())


def test_every_wiki40b_task_yields_its_paragraphs():
  vocabulary = vocab_lib.vocabulary()
  with mock_tfds(as_dataset_fn=fake_wiki40b):
    for language in pretraining.WIKI40B_LANGUAGES:
      task = seqio.get_mixture_or_task(f"wiki40b_{language.replace('-', '_')}")
      assert set(task.splits) == {"train", "validation", "test"}
      examples = list(task.get_dataset(None, split="validation", shuffle=False,
                                       num_epochs=1).as_numpy_iterator())
      expected = [p.replace("dog", f"dog {i} {language}") for i in range(NUM_EXAMPLES)
                  for p in WIKI40B_PARAGRAPHS]
      assert [ex["text_pretokenized"].decode() for ex in examples] == expected, language
      assert all(ex["text"].dtype == np.int32 for ex in examples)
      assert examples[0]["text"].tolist() == vocabulary.encode(expected[0])


@pytest.mark.parametrize("name,fake", [("wikipedia_en", None), ("wiki40b_de", fake_wiki40b)])
def test_mlm_dataset_packs_the_corpus(name, fake):
  seq_len, batch = 16, 2
  with mock_tfds(as_dataset_fn=fake):
    lines = [ex["text"].tolist() for ex in seqio.get_mixture_or_task(name).get_dataset(
        None, split="validation", shuffle=False, num_epochs=1).as_numpy_iterator()]
    batches = list(mlm_dataset(name, "validation", seq_len, batch, seed=0, repeat=False,
                               drop_remainder=False).as_numpy_iterator())
  assert set(batches[0]) == set(MLM_FEATURES)
  assert batches[0]["input_ids"].shape == (batch, seq_len)
  assert batches[0]["input_ids"].dtype == np.int32 and batches[0]["mlm_weights"].dtype == np.float32
  # Unmasked, the packed stream is [CLS] + the paragraphs each followed by [SEP].
  stream = []
  for b in batches:
    original = np.where(b["mlm_weights"] > 0, b["mlm_targets"], b["input_ids"])
    for row, mask in zip(original, b["mask"]):
      assert row[0] == vocab_lib.CLS_ID
      stream += row[1:mask.sum()].tolist()
  assert stream == [t for line in lines for t in line + [vocab_lib.SEP_ID]]


def test_register_other_vocabulary_and_wikipedia_language(tmp_path):
  spm_path = vocab_lib.train([f"line {i} of some text with words {i * 7}" for i in range(300)],
                             tmp_path / "spm", vocab_size=60)
  other = vocab_lib.vocabulary(spm_path)
  names = pretraining.register_pretraining(other, suffix="_t60", wiki40b_languages=("de",))
  assert names == ["wikipedia_en_t60", "c4_en_t60", "wiki40b_de_t60"]
  assert pretraining.register_wikipedia("de", other, suffix="_t60") == "wikipedia_de_t60"
  task = seqio.get_mixture_or_task("wikipedia_de_t60")
  assert task.source.tfds_dataset.name == "wikipedia/20230601.de:1.0.0"
  with mock_tfds():
    ex = next(task.get_dataset(None, split="train", shuffle=False).as_numpy_iterator())
  assert ex["text"].max() < 60
  with pytest.raises(ValueError, match="another vocabulary"):
    pretraining.register_wikipedia("de", vocab_lib.vocabulary(), suffix="_t60")


def test_registration_is_idempotent():
  before = {name: seqio.get_mixture_or_task(name) for name in pretraining.PRETRAINING_TASKS}
  importlib.reload(pretraining)
  assert all(seqio.get_mixture_or_task(n) is t for n, t in before.items())
