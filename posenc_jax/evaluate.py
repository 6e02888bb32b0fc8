"""Evaluates a trained workdir, without training: ``python -m posenc_jax.evaluate``.

  python -m posenc_jax.evaluate --workdir=/tmp/posenc_lm                   # loss, perplexity
  python -m posenc_jax.evaluate --workdir=/tmp/run --checkpoint=best       # a fine-tuned run
  python -m posenc_jax.evaluate --workdir=/tmp/posenc_lm --protocol=extrapolation \
      --lengths=64,128,256,512 [--windows=sliding --stride=32] [--tokens=16384]
  python -m posenc_jax.evaluate --workdir=/tmp/probe_copy --protocol=probes --lengths=32,64,128

``--protocol=loss`` (default): the objective's metrics on ``--split`` as the trainer's
evaluation computes them (masked LM: loss and accuracy; causal LM: loss, accuracy and
perplexity), and for fine-tuned runs the task's own metrics. ``--protocol=extrapolation``:
perplexity (causal LM) or masked-LM loss at each of ``--lengths`` on the same first
``--tokens`` tokens of the split (Press et al.'s protocol, :mod:`posenc_jax.evaluation.runs`),
beside the perplexity of a unigram model of the train split on those tokens (causal LM);
a length the scheme cannot reach (a learned table of ``max_len`` rows) is ``n/a`` with the
reason. ``--protocol=probes``: a synthetic-probe run's (``configs/probe.py``) accuracy on its
probe at each of ``--lengths`` (``--examples`` of the held-out ``--seed``), beside chance.

The model is built from ``<workdir>/config.json`` and restored from the newest checkpoint
that restores and verifies (``--checkpoint=latest``), from ``<workdir>/best``
(``--checkpoint=best``) or from a saved step. It prints a table and writes
``<out>/<protocol>-<settings>.json`` (``--out``, default ``<workdir>/eval``), where
``<settings>`` names the options that change the numbers, defaults included (lengths aside:
e.g. ``extrapolation-split=validation,windows=non_overlapping,tokens=16384.json``), so an
evaluation with other settings never replaces it; for ``extrapolation`` and ``probes`` a PNG
of the same name beside it (with matplotlib). It prints each file it wrote. Nothing is
written under ``<workdir>/checkpoints`` or ``<workdir>/best``. Workdirs may be ``gs://`` URIs.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import textwrap
from collections.abc import Sequence

from posenc_jax import cli
from posenc_jax.evaluation.runs import PROTOCOLS, parse_checkpoint
from posenc_jax.evaluation.windows import WINDOWS

PROG = "evaluate"


def _lengths(text: str) -> tuple[int, ...]:
  """An ``argparse`` type: comma-separated positive integers, increasing."""
  lengths = tuple(cli.positive_int(part) for part in text.split(","))
  if any(b <= a for a, b in zip(lengths, lengths[1:])):
    raise argparse.ArgumentTypeError(f"got {text}; allowed: increasing lengths, no repeats")
  return lengths


def _checkpoint(text: str) -> str | int:
  try:
    return parse_checkpoint(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"got {text!r}; allowed: latest, best or a saved "
                                     "step") from None


def _non_negative(text: str) -> int:
  """An ``argparse`` type: an integer >= 0."""
  try:
    value = int(text)
  except ValueError:
    value = -1
  if value < 0:
    raise argparse.ArgumentTypeError(f"got {text!r}; allowed: a non-negative integer")
  return value


# The flags that are protocol options, passed on only when given.
OPTIONS = ("split", "eval_steps", "lengths", "windows", "stride", "tokens", "batch_size",
           "mask_seed", "examples", "seed")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  protocols = "\n".join(textwrap.fill(  # each protocol's first sentence
      " ".join(re.split(r"\.\s", fn.__doc__, maxsplit=1)[0].split()).replace("``", ""),
      width=92, initial_indent=f"  {name:<14}", subsequent_indent=" " * 16)
      for name, fn in PROTOCOLS.items())
  parser = cli.ArgumentParser(prog=PROG, description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter,
                              epilog=f"protocols (--protocol):\n{protocols}")
  parser.add_argument("--workdir", required=True, help="a train.py or finetune.py workdir")
  parser.add_argument("--protocol", type=cli.one_of(PROTOCOLS), default="loss",
                      help=f"one of {', '.join(PROTOCOLS)} (default loss)")
  parser.add_argument("--checkpoint", type=_checkpoint, default="latest",
                      help="latest (the newest good one), best (<workdir>/best) or a step")
  parser.add_argument("--out", help="the output folder (default <workdir>/eval)")
  parser.add_argument("--split", help="the task split (default validation)")
  parser.add_argument("--eval_steps", type=cli.positive_int,
                      help="loss: batches to evaluate (default the run's eval_steps)")
  parser.add_argument("--lengths", type=_lengths,
                      help="extrapolation, probes: evaluation lengths, e.g. 64,128,256,512 "
                      "(default 1, 2, 4 and 8 times the training length)")
  parser.add_argument("--windows", type=cli.one_of(WINDOWS),
                      help="extrapolation: non_overlapping (default) or sliding (causal LM)")
  parser.add_argument("--stride", type=cli.positive_int,
                      help="extrapolation with --windows=sliding: tokens scored per window")
  parser.add_argument("--tokens", type=cli.positive_int,
                      help="extrapolation: the first N tokens of the split (default 16384)")
  parser.add_argument("--batch_size", type=cli.positive_int,
                      help="extrapolation: windows per step (default: the training batch's "
                      "tokens)")
  parser.add_argument("--examples", type=cli.positive_int,
                      help="probes: examples scored at each length (default 256)")
  parser.add_argument("--seed", type=_non_negative,
                      help="probes: the examples' seed (default the trainer's held-out one)")
  parser.add_argument("--mask_seed", type=_non_negative,
                      help="extrapolation, masked LM: the stream's masking seed (default 0)")
  return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict:
  """Runs the command line ``argv`` (default ``sys.argv[1:]``); returns the document.
  Errors end the process with one line ``evaluate: <field>: ...`` (exit status 1, or 2 for
  a malformed flag)."""
  args = parse_args(argv)
  options = {k: getattr(args, k) for k in OPTIONS if getattr(args, k) is not None}
  from absl import logging  # noqa: PLC0415

  logging.set_verbosity(logging.WARNING)
  cli.quiet_library_tracebacks()
  cli.quiet_library_notices()
  cli.start_tensorflow_quietly()
  from posenc_jax.evaluation import report  # noqa: PLC0415
  from posenc_jax.evaluation.runs import EvaluationError, evaluate_workdir  # noqa: PLC0415
  from posenc_jax.training.errors import USER_ERRORS  # noqa: PLC0415

  out = args.out or os.path.join(args.workdir, "eval")
  try:
    document = evaluate_workdir(args.workdir, args.protocol, checkpoint=args.checkpoint,
                                out=out, progress=lambda line: print(line, flush=True),
                                **options)
  except (EvaluationError, *USER_ERRORS) as e:
    cli.exit_with(PROG, e)
  print(report.table(document), flush=True)
  return document


if __name__ == "__main__":
  cli.run_command(main, sys.argv[1:])
