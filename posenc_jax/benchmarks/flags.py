"""Flags that several benchmark tools share, and the check of the files a tool will write."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from posenc_jax import cli, route_table
from posenc_jax.models.config import DTYPES
from posenc_jax.route_plan import ROUTES


def add_model_flags(parser: cli.ArgumentParser) -> None:
  """``--length``, ``--batch`` and ``--dtype`` of the model's input batch ``[B, L]``, and the
  attention ``--route`` of every layer."""
  parser.add_argument("--length", type=cli.positive_int, default=128, help="tokens per example")
  parser.add_argument("--batch", type=cli.positive_int, default=8, help="examples per step")
  parser.add_argument("--dtype", type=cli.one_of(DTYPES), default="float32",
                      help=f"compute dtype: {', '.join(DTYPES)}")
  parser.add_argument("--route", type=cli.one_of(ROUTES), default="auto",
                      help=f"attention route: {', '.join(ROUTES)} (default auto)")


def parse_checked(parser: cli.ArgumentParser, argv: Sequence[str] | None,
                  outputs: Sequence[str] = ("json",)) -> argparse.Namespace:
  """``parser``'s flags of ``argv``, each file flag of ``outputs`` that is given checked (its
  folder made) before anything compiles, so no timing is lost to a bad path; a bad one exits
  with one line ``<prog>: --<flag>: ...``. So does a ``$POSENC_JAX_ROUTE_TABLE`` naming a
  missing or malformed file (:class:`~posenc_jax.route_table.RouteTableError`, status 1), as
  train.py, finetune.py and evaluate say it."""
  args = parser.parse_args(argv)
  try:
    route_table.points()
  except route_table.RouteTableError as e:
    cli.exit_with(parser.prog, e)
  for flag in outputs:
    if getattr(args, flag) is not None:
      try:
        cli.check_output_file(f"--{flag}", getattr(args, flag))
      except cli.OutputPathError as e:
        parser.error(str(e))
  return args
