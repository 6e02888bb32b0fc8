"""Masked-LM pre-training corpora from TensorFlow Datasets, shaped like ``wordnet_glosses``.

Importing this module registers (again: no error), over the bundled SentencePiece vocabulary:

    wikipedia_en       TFDS ``wikipedia/20230601.en:1.0.0`` (English Wikipedia, DIET/BERT)
    c4_en              TFDS ``c4/en:3.1.0`` (the cleaned English Common Crawl, T5)
    wiki40b_<lang>     TFDS ``wiki40b/<lang>:1.3.0`` for its 41 languages (multilingual
                       Wikipedia for the XTREME models; ``zh-cn`` -> ``wiki40b_zh_cn``)

Each example is one paragraph: ``{"text": int32 [n]}`` (no EOS; the raw string is kept as
``text_pretokenized``), exactly what ``wordnet_glosses`` gives, so
``posenc_jax.data.preprocessors.mlm_dataset(task, split, ...)`` packs them into
full-sentence [CLS] ... [SEP] ... sequences and masks them. A document is cut into
paragraphs at newlines (Wikipedia, C4); empty ones are dropped. Wiki40B's markup is removed:
only the paragraph bodies (the lines after ``_START_PARAGRAPH_``) are kept, cut at
``_NEWLINE_``; article and section titles are dropped.

Splits: ``train`` and ``validation`` (C4, Wiki40B: TFDS's; Wiki40B also ``test``).
Wikipedia has one TFDS split, so its first ``WIKIPEDIA_VALIDATION_ARTICLES`` articles are
``validation`` and the rest ``train`` (TFDS slicing: disjoint and the same on every host).

Other vocabularies (the multilingual models use a SentencePiece model trained on their
corpus, 120k pieces in DIET) and other Wikipedia languages or dumps::

    pretraining.register_pretraining(vocab_lib.vocabulary(path), suffix="_mspm")
    pretraining.register_wikipedia("de", vocabulary=..., date="20230601")   # wikipedia_de

All three are Apache Beam builders in TFDS (``BeamBasedBuilder``): preparing them needs
Beam (TFDS's "beam datasets" guide) and a large download; none is prepared in testing,
which uses ``tfds.testing.mock_data``.
"""

from __future__ import annotations


import seqio
import tensorflow as tf
import tensorflow_datasets as tfds

from posenc_jax.data import tasks as tasks_lib
from posenc_jax.data import vocab as vocab_lib

WIKIPEDIA_DATE = "20230601"
WIKIPEDIA_VERSION = "1.0.0"
C4_VERSION = "3.1.0"
WIKI40B_VERSION = "1.3.0"
WIKIPEDIA_VALIDATION_ARTICLES = 10_000


def _wiki40b_languages() -> tuple[str, ...]:
  return tuple(c.name for c in tfds.builder_cls("wiki40b").BUILDER_CONFIGS)


WIKI40B_LANGUAGES = _wiki40b_languages()


def _unbatch_lines(dataset: tf.data.Dataset, to_lines) -> tf.data.Dataset:
  """``{"text": document}`` -> one ``{"text": line}`` per non-empty stripped line."""
  def lines(ex):
    parts = tf.strings.strip(to_lines(ex["text"]))
    return {"text": tf.boolean_mask(parts, tf.strings.length(parts) > 0)}
  return dataset.map(lines, num_parallel_calls=tf.data.AUTOTUNE).unbatch()


def split_paragraphs(dataset: tf.data.Dataset) -> tf.data.Dataset:
  """A seqio preprocessor: documents -> their newline-separated paragraphs (empty dropped)."""
  return _unbatch_lines(dataset, lambda text: tf.strings.split(text, "\n"))


def wiki40b_paragraphs(dataset: tf.data.Dataset) -> tf.data.Dataset:
  """A seqio preprocessor: Wiki40B articles -> paragraph bodies (module docstring)."""
  def to_lines(text):
    lines = tf.strings.split(text, "\n")
    after_marker = tf.concat([[False], lines[:-1] == "_START_PARAGRAPH_"], 0)
    paragraphs = tf.boolean_mask(lines, after_marker)
    return tf.strings.split(paragraphs, "_NEWLINE_").flat_values
  return _unbatch_lines(dataset, to_lines)


def _select_text(dataset: tf.data.Dataset) -> tf.data.Dataset:
  return dataset.map(lambda ex: {"text": ex["text"]}, num_parallel_calls=tf.data.AUTOTUNE)


def register_corpus(name: str, tfds_name: str, splits: dict[str, str], to_paragraphs,
                    vocabulary: seqio.Vocabulary) -> seqio.Task:
  """Registers one corpus task (``{"text": int32 [n]}`` per paragraph)."""
  task = tasks_lib.register(
      name,
      source=seqio.TfdsDataSource(tfds_name=tfds_name, splits=splits),
      preprocessors=[_select_text, to_paragraphs, seqio.preprocessors.tokenize],
      output_features={"text": seqio.Feature(vocabulary, add_eos=False, dtype=tf.int32)},
      metric_fns=[],
      shuffle_buffer_size=10_000,
  )
  if task.output_features["text"].vocabulary != vocabulary:
    raise ValueError(f"task {name!r} is registered with another vocabulary; register under "
                     "another suffix")
  return task


def register_wikipedia(language: str = "en", vocabulary: seqio.Vocabulary | None = None,
                       suffix: str = "", date: str = WIKIPEDIA_DATE,
                       validation_articles: int = WIKIPEDIA_VALIDATION_ARTICLES) -> str:
  """Registers ``wikipedia_<language><suffix>`` from ``wikipedia/<date>.<language>``."""
  vocabulary = vocabulary if vocabulary is not None else vocab_lib.vocabulary()
  name = f"wikipedia_{language.replace('-', '_')}{suffix}"
  splits = {"train": f"train[{validation_articles}:]",
            "validation": f"train[:{validation_articles}]"}
  return register_corpus(name, f"wikipedia/{date}.{language}:{WIKIPEDIA_VERSION}", splits,
                         split_paragraphs, vocabulary).name


def register_pretraining(vocabulary: seqio.Vocabulary | None = None, suffix: str = "",
                         wiki40b_languages=WIKI40B_LANGUAGES) -> list[str]:
  """Registers ``wikipedia_en``, ``c4_en`` and ``wiki40b_<lang>`` (with ``suffix``) over
  ``vocabulary`` (default: the bundled one); returns the names."""
  vocabulary = vocabulary if vocabulary is not None else vocab_lib.vocabulary()
  names = [register_wikipedia("en", vocabulary, suffix)]
  names.append(register_corpus(
      f"c4_en{suffix}", f"c4/en:{C4_VERSION}", {"train": "train", "validation": "validation"},
      split_paragraphs, vocabulary).name)
  for language in wiki40b_languages:
    names.append(register_corpus(
        f"wiki40b_{language.replace('-', '_')}{suffix}", f"wiki40b/{language}:{WIKI40B_VERSION}",
        {"train": "train", "validation": "validation", "test": "test"}, wiki40b_paragraphs,
        vocabulary).name)
  return names


PRETRAINING_TASKS = tuple(register_pretraining())
