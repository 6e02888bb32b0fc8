r"""Evaluates a trained workdir, without training: ``python -m posenc_jax.evaluate``.

  python -m posenc_jax.evaluate --workdir=/tmp/posenc_lm                   # loss, perplexity
  python -m posenc_jax.evaluate --workdir=/tmp/run --checkpoint=best       # a fine-tuned run
  python -m posenc_jax.evaluate --workdir=/tmp/posenc_lm --protocol=extrapolation \
      --lengths=64,128,256,512 [--windows=sliding --stride=32] [--tokens=16384]
  python -m posenc_jax.evaluate --workdir=/tmp/probe_copy --protocol=probes --lengths=32,64,128
  python -m posenc_jax.evaluate --workdir=/tmp/posenc_demo --protocol=indicators

``--protocol=loss`` (default): the objective's metrics on ``--split`` as the trainer's
evaluation computes them (masked LM: loss and accuracy; causal LM: loss, accuracy and
perplexity), and for fine-tuned runs the task's own metrics. ``--protocol=extrapolation``:
perplexity (causal LM) or masked-LM loss at each of ``--lengths`` on the same first
``--tokens`` tokens of the split (Press et al.'s protocol, :mod:`posenc_jax.evaluation.protocols`),
beside the perplexity of a unigram model of the train split on those tokens (causal LM);
a length the scheme cannot reach (a learned table of ``max_len`` rows) is ``n/a`` with the
reason. ``--protocol=probes``: a synthetic-probe run's (``configs/probe.py``) accuracy on its
probe at each of ``--lengths`` (``--examples`` of the held-out ``--seed``), beside chance.
``--protocol=indicators``: Wang et al.'s property indicators (their Table 2) of an encoder
run, from identical-word probing of its first layer (``--examples`` words of ``--seed``),
beside the paper's row for its scheme.

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
import types
from collections.abc import Callable, Sequence
from typing import Any

from absl import flags

from posenc_jax import allocator, cli
from posenc_jax import usage as usage_lib
from posenc_jax.evaluation.protocols import KIND_WORDS, PROTOCOLS, RUN_KINDS
from posenc_jax.evaluation.runs import parse_checkpoint
from posenc_jax.evaluation.windows import WINDOWS

PROG = "evaluate"


def _lengths(text: str) -> tuple[int, ...]:
  """Comma-separated positive integers, increasing."""
  lengths = tuple(cli.positive_int(part) for part in text.split(","))
  if any(b <= a for a, b in zip(lengths, lengths[1:])):
    raise ValueError(f"got {text}; allowed: increasing lengths, no repeats")
  return lengths


def _checkpoint(text: str) -> str | int:
  try:
    return parse_checkpoint(text)
  except ValueError:
    raise ValueError(f"got {text!r}; allowed: latest, best or a saved step") from None


def _non_negative(text: str) -> int:
  """An integer >= 0."""
  try:
    value = int(text)
  except ValueError:
    value = -1
  if value < 0:
    raise ValueError(f"got {text!r}; allowed: a non-negative integer")
  return value


class _Parser(flags.ArgumentParser):
  """An absl flag parser from a function of the flag's text that raises ``ValueError`` or, as
  :func:`posenc_jax.cli.positive_int` and :func:`posenc_jax.cli.one_of` do,
  ``argparse.ArgumentTypeError``: both become absl's error naming the flag."""

  def __init__(self, convert: Callable[[str], Any]):
    self.convert = convert

  def parse(self, argument: str) -> Any:
    try:
      return self.convert(argument)
    except argparse.ArgumentTypeError as e:
      raise ValueError(str(e)) from None


# The flags: (name, parser of the text, default, help), in --help's order.
FLAG_SPECS = (
    ("workdir", str, None, "a train.py or finetune.py workdir (required)"),
    ("protocol", cli.one_of(PROTOCOLS), "loss", f"one of {', '.join(PROTOCOLS)}"),
    ("checkpoint", _checkpoint, "latest",
     "latest (the newest good one), best (<workdir>/best) or a step"),
    ("out", str, None, "the output folder (default <workdir>/eval)"),
    ("split", str, None, "the task split (default validation)"),
    ("eval_steps", cli.positive_int, None,
     "loss: batches to evaluate (default the run's eval_steps)"),
    ("lengths", _lengths, None, "extrapolation, probes: evaluation lengths, e.g. 64,128,256,512 "
     "(default 1, 2, 4 and 8 times the training length)"),
    ("windows", cli.one_of(WINDOWS), None,
     "extrapolation: non_overlapping (default) or sliding (causal LM)"),
    ("stride", cli.positive_int, None,
     "extrapolation with --windows=sliding: tokens scored per window"),
    ("tokens", cli.positive_int, None,
     "extrapolation: the first N tokens of the split (default 16384)"),
    ("batch_size", cli.positive_int, None,
     "extrapolation: windows per step (default: the training batch's tokens)"),
    ("examples", cli.positive_int, None, "probes: examples scored at each length (default "
     "256); indicators: identical-word sequences probed (default 300)"),
    ("seed", _non_negative, None,
     "probes: the examples' seed (default the trainer's held-out one); indicators: the "
     "probing words' (default 0)"),
    ("mask_seed", _non_negative, None,
     "extrapolation, masked LM: the stream's masking seed (default 0)"),
)

# The flags that are protocol options, passed on only when given.
OPTIONS = ("split", "eval_steps", "lengths", "windows", "stride", "tokens", "batch_size",
           "mask_seed", "examples", "seed")


def usage() -> str:
  """``--help``'s opening: this module's docstring, then each protocol's first sentence and
  the kinds of run it scores."""
  protocols = "\n".join(textwrap.fill(
      " ".join(re.split(r"\.\s", fn.__doc__, maxsplit=1)[0].split()).replace("``", "").rstrip(".")
      + ". Runs it scores: " + ", ".join(KIND_WORDS[k] for k in RUN_KINDS[name]) + ".",
      width=92, initial_indent=f"  {name:<14}", subsequent_indent=" " * 16,
      break_on_hyphens=False) for name, fn in PROTOCOLS.items())
  return f"{__doc__.rstrip()}\n\nProtocols (--protocol):\n{protocols}"


def parse_args(argv: Sequence[str]) -> types.SimpleNamespace:
  """The flags of the command line ``argv`` (without the program's name), one attribute each,
  parsed into flags of their own (not absl's global ``FLAGS``: any number of command lines
  parse in one process). ``--help`` prints the usage and the flags (:mod:`posenc_jax.usage`,
  as compare's) and exits with status 0; a bad or unknown flag, a stray argument or no
  ``--workdir`` ends the process with one line ``evaluate: ...`` (exit status 1)."""
  fv = flags.FlagValues()
  for name, convert, default, help_text in FLAG_SPECS:
    flags.DEFINE(_Parser(convert), name, default, help_text, flag_values=fv)
  rest = cli.flags_parser(PROG, config_flag=None, fv=fv,
                          help=usage_lib.helper(PROG, usage(), configs=()))([PROG, *argv])
  if rest[1:]:
    sys.exit(f"{PROG}: unexpected argument {rest[1]!r}")
  if not fv.workdir:
    sys.exit(f"{PROG}: --workdir is required")
  return types.SimpleNamespace(**fv.flag_values_dict())


def main(argv: Sequence[str] | None = None) -> dict:
  """Runs the command line ``argv`` (default ``sys.argv[1:]``); returns the document.
  Errors, a malformed flag's included, end the process with one line ``evaluate: <field>:
  ...`` and exit status 1."""
  args = parse_args(sys.argv[1:] if argv is None else argv)
  options = {k: getattr(args, k) for k in OPTIONS if getattr(args, k) is not None}
  from absl import logging  # noqa: PLC0415

  logging.set_verbosity(logging.WARNING)
  cli.quiet_library_tracebacks()
  cli.quiet_library_notices()
  allocator.keep_freed_buffers()
  from posenc_jax.evaluation import report  # noqa: PLC0415
  from posenc_jax.evaluation.protocols import evaluate_workdir  # noqa: PLC0415
  from posenc_jax.evaluation.runs import EvaluationError  # noqa: PLC0415
  from posenc_jax.training.errors import USER_ERRORS  # noqa: PLC0415
  from posenc_jax.training.input_pipeline import reads_tensorflow  # noqa: PLC0415
  from posenc_jax.training.workdir import saved_config  # noqa: PLC0415

  out = args.out or os.path.join(args.workdir, "eval")
  try:
    saved = saved_config(args.workdir)  # None: evaluate_workdir says what is missing
    if saved is None or reads_tensorflow(saved.get("task", "")):
      cli.start_tensorflow_quietly()
    document = evaluate_workdir(args.workdir, args.protocol, checkpoint=args.checkpoint,
                                out=out, progress=lambda line: print(line, flush=True),
                                **options)
  except (EvaluationError, *USER_ERRORS) as e:
    cli.exit_with(PROG, e)
  print(report.table(document), flush=True)
  return document


if __name__ == "__main__":
  cli.run_command(main, sys.argv[1:])
