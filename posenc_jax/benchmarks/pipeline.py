"""The masked-LM input pipeline alone: examples/s and source lines read per (simulated) host.

  python -m posenc_jax.benchmarks.pipeline [--source bundled,mock] [--hosts 4]
      [--sharding source,stream] [--seq_len 128] [--batch_size 32] [--shuffle_block 1024]
      [--split validation] [--mock_files 8] [--mock_lines 5000] [--json out.json]

For each source, sharding mode and host count ``n`` in ``1, --hosts``, hosts
``k = 0 .. n-1`` run one after the other in this process, each through one epoch of its
:func:`~posenc_jax.data.preprocessors.mlm_dataset` (its ``batch_size / n`` rows of a global
batch of ``--batch_size``, shuffled in blocks, masked, batched; no cache). Per host it prints
the examples it produced, its examples/s, the source lines it read (a counter in the file
reader) and that count's ratio to one host's. ``source`` sharding reads ``1/n`` of the lines
per host (whole files when the split has at least ``n`` files); ``stream`` reads every line on
every host and keeps ``1/n`` of the packed stream.

Sources: ``bundled``, the WordNet glosses (``--split``: ``train`` 99,477 lines, ``validation``
5,997); ``mock``, a generated corpus of ``--mock_files`` gzip files of ``--mock_lines`` lines
each (random sentences over a small English word list) in a temporary folder, tokenised with
the same bundled vocabulary. Timing includes tokenising, packing, shuffling, masking and
batching, after a warm-up batch; it is CPU time of this machine's TensorFlow threads, so run
it on an otherwise idle machine.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence

import numpy as np

from posenc_jax import cli

WORDS = ("the a of to in and is for on with as by at from that this an be are or it not "
         "which one two three part made form set small large used having act state quality "
         "person place water body plant animal genus family group member food light time "
         "line side point area work move change make take give long short high low old new "
         "red green white black hard soft open close early late first last other").split()


def write_corpus(directory: str | os.PathLike, num_files: int, lines_per_file: int,
                 seed: int = 0) -> list[str]:
  """Writes ``num_files`` gzip text files of ``lines_per_file`` lines each (``i <n> w w ...``:
  a unique line number, then 4 to 24 random words) into ``directory``; returns their paths."""
  rng = np.random.default_rng(seed)
  paths = []
  for f in range(num_files):
    path = os.path.join(directory, f"part-{f:05d}-of-{num_files:05d}.txt.gz")
    lengths = rng.integers(4, 25, lines_per_file)
    words = rng.integers(0, len(WORDS), int(lengths.sum()))
    lines, at = [], 0
    for i, n in enumerate(lengths):
      lines.append(f"i {f * lines_per_file + i} " + " ".join(WORDS[w] for w in words[at:at + n]))
      at += n
    with gzip.open(path, "wt") as out:
      out.write("\n".join(lines) + "\n")
    paths.append(path)
  return paths


def register_counted(name: str, split_to_files, counter=None):
  """(Re-)registers ``name``: a text-lines task over ``split_to_files`` with the bundled
  vocabulary, whose reader adds each line read to ``counter`` (an int64 ``tf.Variable``, new
  if None); returns ``(task, counter)``."""
  import seqio  # noqa: PLC0415
  import tensorflow as tf  # noqa: PLC0415

  from posenc_jax.data import tasks, vocab  # noqa: PLC0415

  counter = tf.Variable(0, dtype=tf.int64, trainable=False) if counter is None else counter
  seqio.TaskRegistry.remove(name)  # a new counter and new files replace an earlier task
  task = tasks.register_text_lines(name, split_to_files, vocab.vocabulary(vocab.BUNDLED_VOCAB),
                                   read_counter=counter)
  return task, counter


def run_host(task_name: str, split: str, counter, *, seq_len: int, batch_size: int,
             shard_id: int, num_shards: int, sharding: str, shuffle_block: int,
             seed: int = 0) -> dict:
  """One host's epoch: ``{"examples", "seconds", "examples_per_s", "lines_read"}``."""
  from posenc_jax.data.preprocessors import mlm_dataset  # noqa: PLC0415

  ds = mlm_dataset(task_name, split, seq_len, batch_size, seed, shard_id=shard_id,
                   num_shards=num_shards, repeat=False, shuffle=True, drop_remainder=False,
                   shuffle_block=shuffle_block, cache=False, sharding=sharding)
  counter.assign(0)
  start = time.perf_counter()
  examples = sum(int(b["input_ids"].shape[0]) for b in ds)
  seconds = time.perf_counter() - start
  return {"examples": examples, "seconds": seconds,
          "examples_per_s": examples / seconds if seconds else float("nan"),
          "lines_read": int(counter.numpy())}


def measure(task_name: str, split: str, counter, *, hosts: int, shardings: Sequence[str],
            seq_len: int, batch_size: int, shuffle_block: int) -> list[dict]:
  """Rows of :func:`run_host` for 1 host and for each of ``hosts`` hosts, per sharding, with
  ``lines_ratio``: the host's lines read over the one-host run's."""
  from posenc_jax.data.preprocessors import mlm_dataset  # noqa: PLC0415

  next(iter(mlm_dataset(task_name, split, seq_len, 1, 0, repeat=False, cache=False)))  # warm-up
  rows = []
  for sharding in shardings:
    single = None
    for n in sorted({1, hosts}):
      for k in range(n):
        row = run_host(task_name, split, counter, seq_len=seq_len,
                       batch_size=max(1, batch_size // n), shard_id=k, num_shards=n,
                       sharding=sharding, shuffle_block=shuffle_block)
        single = row["lines_read"] if n == 1 else single
        row |= {"task": task_name, "split": split, "sharding": sharding, "hosts": n,
                "host": k, "lines_ratio": row["lines_read"] / max(single, 1)}
        rows.append(row)
        print(f"{task_name:<22}{sharding:<8}{n:>6}{k:>6}{row['examples']:>10}"
              f"{row['examples_per_s']:>14.1f}{row['lines_read']:>12}{row['lines_ratio']:>8.3f}",
              flush=True)
  return rows


def main(argv: Sequence[str] | None = None) -> int:
  from posenc_jax import cli  # noqa: PLC0415
  from posenc_jax.benchmarks import flags  # noqa: PLC0415

  parser = cli.ArgumentParser(prog="posenc_jax.benchmarks.pipeline",
                              description=__doc__.splitlines()[0])
  parser.add_argument("--source", type=cli.one_of(("bundled", "mock"), sep=","),
                      default=("bundled", "mock"), help="bundled, mock or both (comma-separated)")
  parser.add_argument("--sharding", type=cli.one_of(("source", "stream"), sep=","),
                      default=("source", "stream"))
  parser.add_argument("--hosts", type=cli.positive_int, default=4,
                      help="simulated hosts (also measured: 1)")
  parser.add_argument("--seq_len", type=cli.positive_int, default=128)
  parser.add_argument("--batch_size", type=cli.positive_int, default=32,
                      help="global batch; each of n hosts takes batch_size / n rows")
  parser.add_argument("--shuffle_block", type=cli.positive_int, default=1024)
  parser.add_argument("--split", type=cli.one_of(("train", "validation")),
                      default="validation", help="the bundled corpus's split")
  parser.add_argument("--mock_files", type=cli.positive_int, default=8)
  parser.add_argument("--mock_lines", type=cli.positive_int, default=5000,
                      help="lines per mock file")
  parser.add_argument("--json", default=None, help="also write the rows to this file")
  args = flags.parse_checked(parser, argv)
  if args.seq_len < 2:
    parser.error(f"--seq_len: got {args.seq_len}; allowed: an integer >= 2 ([CLS] and one "
                 "token)")
  if args.batch_size % args.hosts:
    parser.error(f"--batch_size: got {args.batch_size}; allowed: a multiple of --hosts="
                 f"{args.hosts}")

  import tensorflow as tf  # noqa: PLC0415

  tf.config.set_visible_devices([], "GPU")
  from posenc_jax.data import tasks  # noqa: PLC0415

  print(f"{'task':<22}{'mode':<8}{'hosts':>6}{'host':>6}{'examples':>10}{'examples/s':>14}"
        f"{'lines read':>12}{'ratio':>8}", flush=True)
  rows = []
  shape = dict(hosts=args.hosts, shardings=args.sharding, seq_len=args.seq_len,
               batch_size=args.batch_size, shuffle_block=args.shuffle_block)
  with tempfile.TemporaryDirectory(prefix="posenc_bench_") as tmp:
    for source in args.source:
      if source == "bundled":
        name = "bench_wordnet_glosses"
        _, counter = register_counted(name, tasks.WORDNET_GLOSSES_FILES)
        rows += measure(name, args.split, counter, **shape)
      else:
        files = write_corpus(tmp, args.mock_files, args.mock_lines)
        name = f"bench_mock_{args.mock_files}x{args.mock_lines}"
        _, counter = register_counted(name, {"train": files})
        rows += measure(name, "train", counter, **shape)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(cli.run_command(main))
