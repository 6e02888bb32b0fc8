"""seqio tasks of posenc_jax; importing this module registers them (again: no error).

The trainer only ever asks for a task name and feature lengths::

    import seqio
    from posenc_jax.data import tasks  # registers
    ds = seqio.get_mixture_or_task("wordnet_glosses").get_dataset(
        {"text": 128}, split="train", shuffle=False)   # {"text": int32 [<=128]}

Registered:

    wordnet_glosses   pre-training text: one WordNet 3.0 synset per example,
                      "<lemmas>: <gloss>" (``bundled/wordnet/README.md``); splits ``train``
                      (99,477 lines) and ``validation`` (5,997); feature ``text`` tokenised
                      with the bundled ``spm8k`` vocabulary, no EOS appended.

The causal-LM task ``wordnet_glosses_lm`` (the same lines, packed) is registered by
:mod:`posenc_jax.data.causal_lm`.

New text-line tasks are one ``register_text_lines(...)`` call; other sources (TFDS,
GLUE, ...) call ``register(name, source=..., ...)`` with seqio's arguments.
"""

import os
from collections.abc import Mapping, Sequence

import seqio
import tensorflow as tf

from posenc_jax.data import vocab as vocab_lib

WORDNET_DIR = vocab_lib.BUNDLED_DIR


def register(name: str, **task_kwargs) -> seqio.Task:
  """``seqio.TaskRegistry.add(name, **task_kwargs)`` unless ``name`` is registered already.

  Returns the registered task (the existing one on a second import).
  """
  if name not in seqio.TaskRegistry.names():
    seqio.TaskRegistry.add(name, **task_kwargs)
  return seqio.TaskRegistry.get(name)


def _line_reader(compression: str):
  """``read_file_fn`` for ``seqio.FileDataSource``: file name tensor -> its text lines."""
  def read(filename: tf.Tensor) -> tf.data.Dataset:
    return tf.data.TextLineDataset(filename, compression_type=compression)
  return read


def _line_to_feature(feature: str):
  """A seqio preprocessor: scalar string examples -> ``{feature: string}``."""
  @seqio.map_over_dataset
  def fn(line):
    return {feature: line}
  return fn


def register_text_lines(name: str, split_to_files: Mapping[str, str | os.PathLike],
                        vocabulary: seqio.Vocabulary, feature: str = "text",
                        add_eos: bool = False, postprocessors: Sequence = ()) -> seqio.Task:
  """Registers a task whose examples are the lines of text files.

  Either all files are gzip (names ending in ``.gz``) or none is.

  Each example is ``{feature: int32 [n]}``, the line tokenised by ``vocabulary`` (the raw
  string is kept as ``<feature>_pretokenized``), then passed through ``postprocessors``
  (seqio preprocessors, e.g. packing).
  """
  files = {split: str(path) for split, path in split_to_files.items()}
  gzipped = {path.endswith(".gz") for path in files.values()}
  if len(gzipped) != 1:
    raise ValueError(f"task {name!r}: mix of gzip and plain files {files}")
  return register(
      name,
      source=seqio.FileDataSource(read_file_fn=_line_reader("GZIP" if gzipped.pop() else ""),
                                  split_to_filepattern=files),
      preprocessors=[_line_to_feature(feature), seqio.preprocessors.tokenize, *postprocessors],
      output_features={feature: seqio.Feature(vocabulary, add_eos=add_eos, dtype=tf.int32)},
      metric_fns=[],
      shuffle_buffer_size=10_000,
  )


WORDNET_GLOSSES_FILES = {"train": WORDNET_DIR / "pretrain_train.txt.gz",
                         "validation": WORDNET_DIR / "pretrain_validation.txt.gz"}

register_text_lines("wordnet_glosses", WORDNET_GLOSSES_FILES,
                    vocab_lib.vocabulary(vocab_lib.BUNDLED_VOCAB))

