"""Runs an experiment's cells in sequence, each step a subprocess (``python -m
posenc_jax.train``, ``posenc_jax.finetune``, ``posenc_jax.evaluate``) whose output goes to
``<cell>/log.txt``, so that a crashing cell is reported and the others go on.

A cell that completes gets ``<cell>/cell.json`` (written atomically: its records, read from
its workdirs by :mod:`~posenc_jax.comparison.collect`); a rerun runs only the steps added
to it since (a task, a window kind: :func:`missing_steps`) and reads its records from its
workdirs again. An unfinished cell runs again: train.py and finetune.py resume from their
checkpoints. Once a cell is finished (its ``cell.json`` written), its training runs keep
their final parameters only (:func:`keep_final_params`), so a kill at any point leaves no
cell that needs what was dropped: before ``cell.json`` the cell resumes whole, after it the
next run finishes the compaction.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import IO, Any

from etils import epath

from posenc_jax.comparison.collect import collect, recorded_seconds
from posenc_jax.comparison.plan import Cell, Step
from posenc_jax.comparison.report import write_atomic
from posenc_jax.messages import first_line

MARKER = "cell.json"
LOG = "log.txt"


def progress(line: str) -> None:
  """Prints a progress line at once (a log file or a pipe would otherwise buffer it)."""
  print(line, flush=True)


class CellFailed(RuntimeError):
  """A step of a cell exited non-zero; the message says which and its last output line."""


class StepInterrupted(Exception):
  """compare got SIGTERM or SIGINT while a step ran: the step got the signal too (train.py
  and finetune.py save the step they are at) and has exited with ``status``."""

  def __init__(self, signum: int, status: int, command: list[str]):
    self.signum, self.status = signum, status
    workdir = next((a for a in command if a.startswith("--workdir=")), "")
    super().__init__(f"stopped by {signal.Signals(signum).name}: the running step got it and "
                     f"exited {status} ({' '.join([*command[2:3], workdir]).strip()}); the same "
                     "command resumes")


def subprocess_status(command: list[str], out: IO[str]) -> int:
  """Runs ``command`` with its output (stdout and stderr) in ``out``; returns its status.

  SIGTERM and SIGINT that this process gets while the step runs go to the step, which stops
  as it does on its own (a trainer saves its current step); then :class:`StepInterrupted`
  (not a failed cell: a rerun resumes the step). Outside the main thread, where Python takes
  no signals, the step just runs."""
  child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                           stdin=subprocess.DEVNULL)
  received = []

  def forward(signum, frame):
    del frame
    received.append(signum)
    child.send_signal(signum)

  previous = {}
  if threading.current_thread() is threading.main_thread():
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
  try:
    status = child.wait()
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)
  if received:
    raise StepInterrupted(received[0], status, command)
  return status


def run_steps(cell: Cell, log: epath.Path,
              launch: Callable[[list[str], IO[str]], int] = subprocess_status) -> None:
  """Runs ``cell``'s steps in order through ``launch`` (default: subprocesses), their
  output appended to ``log`` after each command line.

  Raises:
    CellFailed: ``<step> exited <status>: <its last output line>``.
  """
  for step in cell.steps:
    command = step.command()
    with log.open("a") as out:
      out.write(f"$ {' '.join(command)}\n")
      out.flush()
      status = launch(command, out)
    if status:
      lines = [line for line in log.read_text().splitlines() if line.strip()]
      raise CellFailed(f"{step.name} exited {status}: {lines[-1] if lines else 'no output'}")


def evaluation_file(step: Step) -> epath.Path | None:
  """The file an evaluate step writes (``<workdir>/eval/<protocol>-<settings>.json``, its
  settings resolved with the run's ``config.json``); None for other steps or an untrained
  workdir."""
  from posenc_jax.evaluation.report import settings_key  # noqa: PLC0415
  from posenc_jax.evaluation.runs import SETTINGS, protocol_settings  # noqa: PLC0415
  from posenc_jax.training.workdir import saved_config  # noqa: PLC0415

  if step.evaluation is None:
    return None
  protocol, options = step.evaluation
  config = saved_config(step.workdir)
  if config is None:
    return None
  settings = protocol_settings(protocol, config, **{k: options.get(k) for k in
                                                     SETTINGS[protocol]})
  return epath.Path(step.workdir) / "eval" / f"{protocol}-{settings_key(settings)}.json"


def missing_steps(cell: Cell) -> list[Step]:
  """The steps of a finished ``cell`` whose output is not there: a training step whose run
  did not train to its end (:func:`~posenc_jax.training.workdir.trained_to_the_end`: a task
  added to the experiment since, or its run killed) and an evaluate step whose file is
  missing (a window kind added). A run whose checkpoints were all removed after it was
  evaluated (files under ``eval/``) counts as trained."""
  from posenc_jax.training.workdir import has_checkpoints, trained_to_the_end  # noqa: PLC0415

  missing = []
  for step in cell.steps:
    if step.evaluation is None:
      done = trained_to_the_end(step.workdir) or (
          not has_checkpoints(step.workdir)
          and any((epath.Path(step.workdir) / "eval").glob("*.json")))
    else:
      path = evaluation_file(step)
      done = path is not None and path.exists()
    if not done:
      missing.append(step)
  return missing


def keep_final_params(cell: Cell, prefix: str, say: Callable[[str], None]) -> None:
  """Drops what a finished ``cell``'s training runs (its steps with ``params_only``) kept
  only to resume: each workdir's checkpoints become its final parameters
  (:func:`posenc_jax.training.checkpoint.keep_params_only`, which also finishes one killed
  midway). Where that fails, one line (``<prefix>: ...``) says why; the cell stays
  finished, its checkpoints whole."""
  from posenc_jax.training.checkpoint import keep_params_only  # noqa: PLC0415 - JAX

  try:
    for step in cell.steps:
      if step.params_only:
        keep_params_only(step.workdir)
  except (ValueError, OSError) as e:  # CheckpointError is a ValueError
    say(f"{prefix}: its checkpoints stay whole: {first_line(e)}")


def cell_records(cell: Cell) -> list[dict[str, Any]]:
  """The records of ``cell``'s workdirs, labelled with the cell's size, scheme and seed."""
  return [r | {"size": cell.size, "scheme": cell.scheme, "seed": cell.seed}
          for r in collect([cell.folder])]


def run_grid(cells: list[Cell], run_cell: Callable[[Cell, epath.Path], None] = run_steps,
             say: Callable[[str], None] = progress) -> tuple[list[dict[str, Any]], list[dict]]:
  """Runs every cell without a ``cell.json`` through ``run_cell(cell, log_path)`` (and, of
  a finished cell, the steps it lacks: :func:`missing_steps`), one progress line each,
  then keeps each finished cell's final parameters only (:func:`keep_final_params`);
  returns the records of all finished cells and the failed cells (``{"cell", "reason",
  "log"}``).

  Raises:
    CollectError: a cell finished before whose workdirs no longer read.
  """
  records, failed = [], []
  for index, cell in enumerate(cells, 1):
    folder = epath.Path(cell.folder)
    marker, log = folder / MARKER, folder / LOG
    prefix = f"[{index}/{len(cells)}] {cell.name}"
    before = 0.0
    if marker.exists():
      missing = missing_steps(cell)
      if not missing:
        records += cell_records(cell)
        say(f"{prefix}: finished before ({marker}), not rerun")
        keep_final_params(cell, prefix, say)  # a run killed after cell.json, before or in it
        continue
      before = recorded_seconds(marker)
      todo = dataclasses.replace(cell, steps=tuple(missing))
      say(f"{prefix}: finished before; running its {len(missing)} new step(s), output in "
          f"{log}")
    else:
      todo = cell
      folder.mkdir(parents=True, exist_ok=True)
      say(f"{prefix}: running {len(cell.steps)} step(s), output in {log}")
    start = time.perf_counter()
    try:
      run_cell(todo, log)
      mine = cell_records(cell)
    except (CellFailed, ValueError) as e:  # ValueError: a run that does not read (collect)
      failed.append({"cell": cell.name, "reason": str(e), "log": str(log)})
      say(f"{prefix}: FAILED: {e} (log: {log})")
      continue
    seconds = before + time.perf_counter() - start
    write_atomic(marker, json.dumps({"cell": cell.name, "seconds": seconds, "records": mine},
                                    indent=2, sort_keys=True))
    records += mine
    say(f"{prefix}: done in {seconds:.0f} s")
    keep_final_params(cell, prefix, say)
  return records, failed
