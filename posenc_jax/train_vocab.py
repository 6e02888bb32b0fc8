"""The vocabulary trainer: a SentencePiece model with the reserved ids of
:mod:`posenc_jax.data.vocab`, from text files or from a registered seqio task's text.

Train from text files (``.gz`` read as gzip) or from the raw text feature of any registered
seqio task (its preprocessors up to tokenisation are applied)::

    python -m posenc_jax.train_vocab --files=a.txt.gz,b.txt --vocab_size=8000 \\
        --output=path/spm
    python -m posenc_jax.train_vocab --task=wordnet_glosses --split=train \\
        --feature=text --vocab_size=8192 --output=/tmp/spm

Both write ``<output>.model`` and ``<output>.vocab``. The bundled
``data/bundled/wordnet/spm8k.model`` was made with the first form on
``data/bundled/wordnet/pretrain_train.txt.gz`` (``scripts/make_wordnet_corpus.py`` has the
command).
"""

from __future__ import annotations

import argparse
import functools
import gzip
import os
import sys
from collections.abc import Iterator, Sequence

import seqio
from seqio import utils as seqio_utils

import posenc_jax.tasks  # noqa: F401 - registers every task
from posenc_jax import cli
from posenc_jax.data.vocab import train


def read_text_files(paths: Sequence[str | os.PathLike]) -> Iterator[str]:
  """Lines (without the newline) of text files in order; ``*.gz`` files are read as gzip."""
  for path in paths:
    path = str(path)
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
      for line in f:
        yield line.rstrip("\n")


def _is_tokenization(preprocessor) -> bool:
  """True for seqio's tokenising preprocessors and the cache placeholder (where raw text ends)."""
  fn = preprocessor.func if isinstance(preprocessor, functools.partial) else preprocessor
  return (fn in (seqio.preprocessors.tokenize, seqio.preprocessors.tokenize_and_append_eos)
          or isinstance(preprocessor, seqio.CacheDatasetPlaceholder))


def read_task_text(task_name: str, split: str = "train", feature: str = "text") -> Iterator[str]:
  """The raw string ``feature`` of a registered seqio task's ``split``, in source order.

  Applies the task's preprocessors that come before its first tokenising one, so rekeying
  and text cleaning are seen, and stops there.
  """
  task = seqio.get_mixture_or_task(task_name)
  dataset = task.source.get_dataset(split=split, shuffle=False)
  for preprocessor in task.preprocessors:
    if _is_tokenization(preprocessor):
      break
    dataset = seqio_utils.add_kwargs_to_transform(
        preprocessor, sequence_length=None, output_features=task.output_features)(dataset)
  for example in dataset.as_numpy_iterator():
    yield example[feature].decode("utf-8")


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(
      prog="python -m posenc_jax.train_vocab",
      description="Train a SentencePiece unigram vocabulary with [CLS]/[SEP]/[MASK] pieces.")
  source = parser.add_mutually_exclusive_group(required=True)
  source.add_argument("--files", help="comma-separated text files (.gz read as gzip)")
  source.add_argument("--task", help="a registered seqio task name")
  parser.add_argument("--split", default="train", help="task split (with --task)")
  parser.add_argument("--feature", default="text", help="raw string feature (with --task)")
  parser.add_argument("--vocab_size", type=int, required=True)
  parser.add_argument("--output", required=True, help="path prefix of .model and .vocab")
  parser.add_argument("--input_sentence_size", type=int, default=2_000_000)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--character_coverage", type=float, default=1.0)
  args = parser.parse_args(argv)
  if args.files:
    lines = read_text_files([f for f in args.files.split(",") if f])
  else:
    lines = read_task_text(args.task, args.split, args.feature)
  path = train(lines, args.output, args.vocab_size, args.input_sentence_size, args.seed,
               args.character_coverage)
  print(f"wrote {path} ({path.stat().st_size:,} bytes)", file=sys.stderr)


if __name__ == "__main__":
  cli.run_command(main)
