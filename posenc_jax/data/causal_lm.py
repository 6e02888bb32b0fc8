"""Causal-LM data: the ``wordnet_glosses_lm`` task and ``lm_dataset`` for the trainer.

Importing this module registers (again: no error)::

    wordnet_glosses_lm  the lines of ``wordnet_glosses`` (the same files and the same bundled
                        ``spm8k`` vocabulary) as one token stream
                        ``line_1 EOS line_2 EOS ...``, cut into examples
                        ``{"targets": int32 [L]}`` of exactly ``L = sequence_length["targets"]``
                        tokens, the last one padded with 0; without a length, one example per
                        line with its EOS. Splits ``train`` and ``validation``.
    python_stdlib_lm    the bundled long documents (:mod:`posenc_jax.data.stdlib_corpus`: the
                        Python 3.13.0 standard library's source files, median 16 kB), one
                        token per UTF-8 byte (``seqio.ByteVocabulary``, 259 ids), packed the
                        same way ``doc_1 EOS doc_2 EOS ...``. Splits ``train`` (258 files,
                        7.3M tokens) and ``validation`` (17, 575k); the corpus's hash is
                        checked on reading.
    pg19_lm, c4_en_lm   whole documents of TFDS ``pg19:0.1.1`` (Project Gutenberg books before
                        1919, Rae et al. 2020) and ``c4/en:3.1.0``, one token per byte, packed
                        the same way: the extrapolation experiments at scale (prepared with
                        TFDS first; PG-19 is a download of about 11 GB, C4 needs Beam).

    ds = seqio.get_mixture_or_task("wordnet_glosses_lm").get_dataset(
        {"targets": 128}, split="train", shuffle=False)

Packing concatenates lines as GPT-2's and T5's LM pre-training do, with no segment ids:
attention crosses the line boundaries inside a sequence and the EOS marks where a line ends,
so a packed sequence is an ordinary causal sequence (every scheme sees positions
``0 .. L-1``, and cached decoding equals teacher forcing on it). A sequence may start inside
a line.

``lm_dataset(task, split, seq_len, batch_size, seed, ...)`` is what the training loop calls:
the task's packed examples through :func:`posenc_jax.data.preprocessors.packed_stream`
(shuffled in blocks each epoch, epochs concatenated, sharded over hosts at the stream or at
the source, resumed exactly at a step or from a saved iterator, as the masked-LM pipeline),
batched as ``{"targets": int32 [batch_size, L]}``.

Other text-line corpora: ``register_causal_lm(name, split_to_files, vocabulary)``; any seqio
task or TFDS text corpus with a ``targets`` feature (C4, PG-19, ...) trains and evaluates the
same way by naming it in ``config.task``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping

import seqio
import tensorflow as tf

from posenc_jax.data import SHUFFLE_BLOCK, preprocessors, stdlib_corpus
from posenc_jax.data import tasks as tasks_lib
from posenc_jax.data.vocab import EOS_ID

FEATURE = "targets"


def pack_targets(dataset: tf.data.Dataset, sequence_length: Mapping[str, int] | None = None,
                 output_features=None) -> tf.data.Dataset:
  """A seqio preprocessor: tokenised lines ``{"targets": int32 [n]}`` -> the stream
  ``line_1 EOS line_2 EOS ...`` cut into ``{"targets": int32 [L]}`` (``L`` from
  ``sequence_length``; the last example padded with 0), or each line with its EOS when no
  length is given."""
  del output_features
  if not sequence_length or sequence_length.get(FEATURE) is None:
    return dataset.map(lambda ex: {FEATURE: tf.concat([ex[FEATURE], [EOS_ID]], 0)})
  packed = preprocessors.pack_lines(dataset, sequence_length[FEATURE], FEATURE,
                                    separator=EOS_ID, start=None)
  return packed.map(lambda ex: {FEATURE: ex["input_ids"]})


def register_causal_lm(name: str, split_to_files: Mapping[str, str | os.PathLike],
                       vocabulary: seqio.Vocabulary) -> seqio.Task:
  """Registers a causal-LM task over the lines of text files (module docstring)."""
  return tasks_lib.register_text_lines(name, split_to_files, vocabulary, feature=FEATURE,
                                       add_eos=True, postprocessors=[pack_targets])


register_causal_lm(
    "wordnet_glosses_lm", tasks_lib.WORDNET_GLOSSES_FILES,
    seqio.get_mixture_or_task("wordnet_glosses").output_features["text"].vocabulary)


def register_tfds_lm(name: str, tfds_name: str, splits: Mapping[str, str],
                     text_key: str = "text",
                     vocabulary: seqio.Vocabulary | None = None) -> seqio.Task:
  """Registers a causal-LM task over a TFDS text corpus: each example's ``text_key`` string is
  one document, tokenised by ``vocabulary`` (default: bytes) and packed as the others."""
  return tasks_lib.register(
      name,
      source=seqio.TfdsDataSource(tfds_name=tfds_name, splits=dict(splits)),
      preprocessors=[functools.partial(seqio.preprocessors.rekey, key_map={FEATURE: text_key}),
                     seqio.preprocessors.tokenize, pack_targets],
      output_features={FEATURE: seqio.Feature(vocabulary or seqio.ByteVocabulary(),
                                              add_eos=True, dtype=tf.int32)},
      metric_fns=[],
      shuffle_buffer_size=10_000,
  )


register_tfds_lm("pg19_lm", "pg19:0.1.1", {"train": "train", "validation": "validation"},
                 "book_text")
register_tfds_lm("c4_en_lm", "c4/en:3.1.0", {"train": "train", "validation": "validation"})


def _stdlib_documents(split: str, shuffle_files: bool = False,
                      seed: int | None = None) -> tf.data.Dataset:
  """``seqio.FunctionDataSource``'s dataset function: the split's documents
  ``{"targets": string}``, in path order (the corpus is one file: nothing to shuffle)."""
  del shuffle_files, seed
  texts = [doc.text for doc in stdlib_corpus.documents(split)]
  return tf.data.Dataset.from_tensor_slices({FEATURE: tf.constant(texts, tf.string)})


tasks_lib.register(
    stdlib_corpus.TASK,
    source=seqio.FunctionDataSource(_stdlib_documents, splits=stdlib_corpus.SPLITS),
    preprocessors=[seqio.preprocessors.tokenize, pack_targets],
    output_features={FEATURE: seqio.Feature(seqio.ByteVocabulary(), add_eos=True,
                                            dtype=tf.int32)},
    metric_fns=[],
    shuffle_buffer_size=10_000,
)


def packed_epoch(task_name: str, split: str, seq_len: int, shard_id: int = 0,
                 num_shards: int = 1) -> tf.data.Dataset:
  """One epoch of a causal-LM task's packed examples ``{"targets": [L]}`` (of the split, or
  of host ``shard_id``'s part of it), in source order."""
  task = seqio.get_mixture_or_task(task_name)
  return task.get_dataset({FEATURE: seq_len}, split=split, shuffle=False, num_epochs=1,
                          use_cached=False,
                          shard_info=preprocessors.shard_info(shard_id, num_shards))


def epoch_length(task_name: str, split: str, seq_len: int, shard_id: int = 0,
                 num_shards: int = 1) -> int:
  """``N``: packed examples per epoch (one pass over the split or the host's part; cached
  per process)."""
  return _epoch_length(task_name, split, seq_len, shard_id, num_shards)


@functools.lru_cache(maxsize=None)
def _epoch_length(*args) -> int:
  return preprocessors.count(packed_epoch(*args))


def lm_dataset(task_name: str, split: str, seq_len: int, batch_size: int, seed: int,
               shard_id: int = 0, num_shards: int = 1, repeat: bool = True,
               shuffle: bool | None = None, start_step: int = 0,
               shuffle_block: int = SHUFFLE_BLOCK, drop_remainder: bool = True,
               cache: bool | str = True,
               sharding: str = "stream") -> tf.data.Dataset:
  """Batches of a causal-LM task: ``{"targets": int32 [batch_size, L]}``.

  Args:
    task_name: a registered task with a packed ``targets`` feature (``wordnet_glosses_lm``).
    split: the task split.
    seq_len: ``L``, tokens per sequence.
    batch_size: sequences per batch on this host.
    seed: the seed of shuffling.
    shard_id, num_shards, repeat, shuffle, start_step, shuffle_block, drop_remainder, cache,
      sharding: as :func:`posenc_jax.data.preprocessors.mlm_dataset`'s (the same order,
      shards, cache decision and resume).
  """
  preprocessors.check_shard(shard_id, num_shards, sharding)
  part = (shard_id, num_shards) if sharding == "source" else (0, 1)
  ds = preprocessors.packed_stream(
      packed_epoch(task_name, split, seq_len, *part),
      lambda: epoch_length(task_name, split, seq_len, *part),
      batch_size, seed, shard_id=shard_id, num_shards=num_shards, repeat=repeat,
      shuffle=shuffle, start_step=start_step, shuffle_block=shuffle_block,
      cache=preprocessors.resolve_cache(cache, task_name, split, part[1]), sharding=sharding)
  ds = ds.map(lambda e, i, x: x).batch(batch_size, drop_remainder=drop_remainder or repeat)
  return ds.prefetch(tf.data.AUTOTUNE)
