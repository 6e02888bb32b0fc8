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
from absl import logging

from posenc_jax.data import vocab as vocab_lib

WORDNET_DIR = vocab_lib.BUNDLED_DIR


def register(name: str, **task_kwargs) -> seqio.Task:
  """``seqio.TaskRegistry.add(name, **task_kwargs)`` unless ``name`` is registered already.

  Returns the registered task (the existing one on a second import).
  """
  if name not in seqio.TaskRegistry.names():
    seqio.TaskRegistry.add(name, **task_kwargs)
  return seqio.TaskRegistry.get(name)


def _line_reader(compression: str, counter: tf.Variable | None = None):
  """``read_file_fn`` for ``seqio.FileDataSource``: file name tensor -> its text lines
  (each line read adds 1 to ``counter`` if given)."""
  def read(filename: tf.Tensor) -> tf.data.Dataset:
    lines = tf.data.TextLineDataset(filename, compression_type=compression)
    if counter is None:
      return lines

    def counted(line):
      with tf.control_dependencies([counter.assign_add(1)]):
        return tf.identity(line)
    return lines.map(counted)
  return read


def source_bytes(task: seqio.Task, split: str) -> int | None:
  """The stored size of a task split's source: the total bytes of its files
  (``FileDataSource``: ``register_text_lines`` tasks, seqio's TFRecord/text sources) or the
  TFDS split's ``num_bytes`` (``TfdsDataSource``); None when unknown."""
  source = task.source
  try:
    if isinstance(source, seqio.TfdsDataSource):
      return int(source.tfds_dataset.builder.info.splits[split].num_bytes) or None
    if isinstance(source, seqio.FileDataSource):
      return sum(tf.io.gfile.stat(path).length for path in source.list_shards(split))
  except Exception:  # noqa: BLE001 - any unreadable metadata: size unknown
    return None
  return None


def tfds_sources(task: seqio.Task | seqio.Mixture) -> list[seqio.TfdsDataSource]:
  """The TFDS sources a task (or each task of a mixture) reads, in order, without repeats."""
  tasks = task.tasks if isinstance(task, seqio.Mixture) else [task]
  sources = [t.source for t in tasks if isinstance(t.source, seqio.TfdsDataSource)]
  return [s for i, s in enumerate(sources) if s not in sources[:i]]


def unprepared(task: seqio.Task | seqio.Mixture) -> list[dict[str, str | bool]]:
  """The TFDS datasets ``task`` reads that are not prepared in their data folder (reading
  them would make TFDS download and prepare them first):
  ``[{"dataset": "pg19:0.1.1", "data_dir": "/root/tensorflow_datasets", "beam": False}]``
  (``beam``: preparing it runs an Apache Beam pipeline). Looks only at the local folder."""
  import tensorflow_datasets as tfds  # noqa: PLC0415

  missing = []
  for source in tfds_sources(task):
    loader = source.tfds_dataset
    if loader.name is None:
      continue  # a split map of other datasets: seqio reads them by split
    builder = tfds.builder(loader.name, data_dir=loader.data_dir)
    verbosity = logging.get_verbosity()
    logging.set_verbosity(logging.ERROR)  # TFDS warns of a folder without dataset_info.json
    try:
      prepared = builder.is_prepared()
    finally:
      logging.set_verbosity(verbosity)
    if prepared:
      continue
    folder = os.fspath(builder.data_dir).removesuffix(builder.info.full_name).rstrip("/")
    missing.append({"dataset": loader.name, "data_dir": folder,
                    "beam": isinstance(builder, tfds.core.BeamBasedBuilder)})
  return missing


def _line_to_feature(feature: str):
  """A seqio preprocessor: scalar string examples -> ``{feature: string}``."""
  @seqio.map_over_dataset
  def fn(line):
    return {feature: line}
  return fn


def register_text_lines(name: str, split_to_files: Mapping[str, str | os.PathLike | Sequence],
                        vocabulary: seqio.Vocabulary, feature: str = "text",
                        add_eos: bool = False, postprocessors: Sequence = (),
                        read_counter: tf.Variable | None = None) -> seqio.Task:
  """Registers a task whose examples are the lines of text files.

  A split is one file, a glob pattern, or a list of files (source sharding hands whole files
  to hosts when a split has at least as many files as hosts). Either all files are gzip
  (names ending in ``.gz``) or none is. ``read_counter`` (an int64 ``tf.Variable``) counts
  the lines read, for the input benchmark and tests (:mod:`posenc_jax.benchmarks.pipeline`); it is
  state outside the pipeline, so saving an iterator that is reading a file through it needs
  ``tf.data.Options().experimental_external_state_policy`` ``IGNORE`` (the count is not
  saved).

  Each example is ``{feature: int32 [n]}``, the line tokenised by ``vocabulary`` (the raw
  string is kept as ``<feature>_pretokenized``), then passed through ``postprocessors``
  (seqio preprocessors, e.g. packing).
  """
  files = {split: ([str(p) for p in path] if isinstance(path, (list, tuple)) else str(path))
           for split, path in split_to_files.items()}
  gzipped = {p.endswith(".gz") for path in files.values()
             for p in (path if isinstance(path, list) else [path])}
  if len(gzipped) != 1:
    raise ValueError(f"task {name!r}: mix of gzip and plain files {files}")
  reader = _line_reader("GZIP" if gzipped.pop() else "", read_counter)
  return register(
      name,
      source=seqio.FileDataSource(read_file_fn=reader, split_to_filepattern=files),
      preprocessors=[_line_to_feature(feature), seqio.preprocessors.tokenize, *postprocessors],
      output_features={feature: seqio.Feature(vocabulary, add_eos=add_eos, dtype=tf.int32)},
      metric_fns=[],
      shuffle_buffer_size=10_000,
  )


WORDNET_GLOSSES_FILES = {"train": WORDNET_DIR / "pretrain_train.txt.gz",
                         "validation": WORDNET_DIR / "pretrain_validation.txt.gz"}

register_text_lines("wordnet_glosses", WORDNET_GLOSSES_FILES,
                    vocab_lib.vocabulary(vocab_lib.BUNDLED_VOCAB))

