"""Runs an experiment's cells, each step a subprocess (``python -m posenc_jax.train``,
``posenc_jax.finetune``, ``posenc_jax.evaluate``) whose output goes to ``<cell>/log.txt``, so
that a crashing cell is reported and the others go on: one at a time, or with ``slots``
(:mod:`posenc_jax.comparison.slots`) as many at once, each on the devices of a slot of its
own, the next cell starting as a slot frees. A progress line says when each cell starts and
ends, another at least every :data:`HEARTBEAT_S` seconds which cells are running and the
grid's ETA, and one the whole grid's outcome at the end.

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

import concurrent.futures
import contextlib
import dataclasses
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import IO, Any

from etils import epath

from posenc_jax.comparison.collect import collect, recorded_seconds
from posenc_jax.comparison.plan import Cell, Step, groups
from posenc_jax.paths import OutputPathError, write_atomic
from posenc_jax.comparison.slots import Slot
from posenc_jax.messages import first_line

MARKER = "cell.json"
LOG = "log.txt"
HEARTBEAT_S = 60.0  # the longest a grid goes without a progress line
_PRINTING = threading.Lock()


def progress(line: str) -> None:
  """Prints a progress line at once (a log file or a pipe would otherwise buffer it), whole
  even when cells running at once print together."""
  with _PRINTING:
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


def launched(command: list[str], cpus: tuple[int, ...] | None = None) -> list[str]:
  """``command`` started by a bare interpreter that becomes it (``os.execvp``; no
  ``preexec_fn``, which is unsafe once this process has threads, as JAX's) after, on Linux,
  asking the kernel to send it SIGTERM when this process dies (``PR_SET_PDEATHSIG``: a
  compare ended by SIGHUP or ``kill -9`` leaves no step running; the trainer saves its step
  and stops as on any SIGTERM), and, given ``cpus``, pinning it to those cores alone."""
  lines = ["import os, sys"]
  if sys.platform.startswith("linux"):
    lines += ["import ctypes, signal",
              "ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)",  # 1: PR_SET_PDEATHSIG
              f"os.getppid() == {os.getpid()} or sys.exit(143)"]  # the parent died before it
  if cpus:
    lines.append(f"os.sched_setaffinity(0, {set(cpus)!r})")
  lines.append("os.execvp(sys.argv[1], sys.argv[1:])")
  return [sys.executable, "-c", "; ".join(lines), *command]


class _Steps:
  """The steps running now, in any thread, and the signals this process got while they ran:
  SIGTERM and SIGINT go to every one of them (:func:`forwarding`)."""

  def __init__(self):
    self.lock = threading.Lock()
    self.running: set[subprocess.Popen] = set()
    self.received: list[int] = []

  def forward(self, signum, frame):
    del frame
    with self.lock:
      self.received.append(signum)
      for child in self.running:
        child.send_signal(signum)


_STEPS = _Steps()


@contextlib.contextmanager
def forwarding() -> Iterator[None]:
  """While inside, SIGTERM and SIGINT go to every running step (the main thread only: Python
  takes signals there; elsewhere, and inside an outer ``forwarding``, nothing changes)."""
  installed = {}
  if (threading.current_thread() is threading.main_thread()
      and signal.getsignal(signal.SIGTERM) != _STEPS.forward):
    installed = {sig: signal.signal(sig, _STEPS.forward) for sig in (signal.SIGTERM,
                                                                     signal.SIGINT)}
  try:
    yield
  finally:
    for sig, handler in installed.items():
      signal.signal(sig, handler)


def subprocess_status(command: list[str], out: IO[str], slot: Slot | None = None) -> int:
  """Runs ``command`` with its output (stdout and stderr) in ``out``; returns its status.
  ``slot``: its variables go into the step's environment and, on CPUs, the step runs on the
  slot's cores.

  SIGTERM and SIGINT that this process gets while the step runs go to the step, which stops
  as it does on its own (a trainer saves its current step); then :class:`StepInterrupted`
  (not a failed cell: a rerun resumes the step). Cells running at once in other threads get
  the signals through the main thread's :func:`forwarding`."""
  env = {**os.environ, **slot.env} if slot is not None and slot.env else None
  cpus = slot.cpus if slot is not None else None
  with forwarding():
    with _STEPS.lock:
      before = len(_STEPS.received)
      child = subprocess.Popen(launched(command, cpus), stdout=out,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
      _STEPS.running.add(child)
    try:
      status = child.wait()
    finally:
      with _STEPS.lock:
        _STEPS.running.discard(child)
        received = _STEPS.received[before:]
  if received:
    raise StepInterrupted(received[0], status, command)
  return status


def run_steps(cell: Cell, log: epath.Path,
              launch: Callable[[list[str], IO[str]], int] = subprocess_status,
              slot: Slot | None = None) -> None:
  """Runs ``cell``'s steps in order through ``launch`` (default: subprocesses; on ``slot``'s
  devices where given), their output appended to ``log`` after each command line, and after a
  step that succeeds the line ``# <step>: <seconds> s`` (its process from start to exit).

  Raises:
    CellFailed: ``<step> exited <status>: <its last output line>``.
  """
  for step in cell.steps:
    command = step.command()
    with log.open("a") as out:
      out.write(f"$ {' '.join(command)}\n")
      out.flush()
      start = time.perf_counter()
      status = launch(command, out, slot) if slot is not None else launch(command, out)
      if not status:
        out.write(f"# {step.name}: {time.perf_counter() - start:.1f} s\n")
    if status:
      lines = [line for line in log.read_text().splitlines() if line.strip()]
      raise CellFailed(f"{step.name} exited {status}: {lines[-1] if lines else 'no output'}")


def evaluation_file(step: Step) -> epath.Path | None:
  """The file an evaluate step writes (``<workdir>/eval/<protocol>-<settings>.json``, its
  settings resolved with the run's ``config.json``); None for other steps or an untrained
  workdir."""
  from posenc_jax.evaluation.report import settings_key  # noqa: PLC0415
  from posenc_jax.evaluation.protocols import SETTINGS, protocol_settings  # noqa: PLC0415
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


def changed_settings(step: Step) -> list[str]:
  """The ``--config.<field>=`` settings of a training step that its workdir's run did not
  train with (``field: <the run's> -> <the step's>``): a setting changed since the grid ran
  (``--config.train.total_steps`` raised). Fields the run's ``config.json`` lacks are not
  compared."""
  from posenc_jax.cli import literal  # noqa: PLC0415
  from posenc_jax.training.workdir import saved_config  # noqa: PLC0415

  saved = saved_config(step.workdir) or {}
  changed = []
  for field, text in step.overrides().items():
    value = saved
    for key in field.split("."):
      value = value.get(key, KeyError) if isinstance(value, dict) else KeyError
    wanted = json.loads(json.dumps(literal(text)))  # as config.json holds it (tuples: lists)
    if value is not KeyError and value != wanted:
      changed.append(f"{field}: {value!r} -> {wanted!r}")
  return changed


def missing_steps(cell: Cell) -> list[Step]:
  """The steps of a finished ``cell`` whose output is not there: a training step whose run
  did not train to its end (:func:`~posenc_jax.training.workdir.trained_to_the_end`: a task
  added to the experiment since, or its run killed) or with other settings
  (:func:`changed_settings`: it runs again, so the trainer resumes to a raised
  ``total_steps``, or refuses in one line a setting a run cannot change), and an evaluate
  step whose file is missing (a window kind added) or whose run trains again. A run whose checkpoints were all removed
  after it was evaluated (files under ``eval/``) counts as trained."""
  from posenc_jax.training.workdir import has_checkpoints, trained_to_the_end  # noqa: PLC0415

  missing = []
  retrained = set()  # an evaluation of a run that trains again is redone after it
  for step in cell.steps:
    if step.evaluation is None:
      done = not changed_settings(step) and (trained_to_the_end(step.workdir) or (
          not has_checkpoints(step.workdir)
          and any((epath.Path(step.workdir) / "eval").glob("*.json"))))
      if not done:
        retrained.add(step.workdir)
    else:
      path = evaluation_file(step)
      done = step.workdir not in retrained and path is not None and path.exists()
    if not done:
      missing.append(step)
  return missing


def keep_final_params(cell: Cell, prefix: str, say: Callable[[str], None]) -> None:
  """Drops what a finished ``cell``'s training runs (its steps with ``params_only``) kept
  only to resume: each workdir's checkpoints become its final parameters
  (:func:`posenc_jax.training.params_only.keep_params_only`, which also finishes one killed
  midway). Where that fails, one line (``<prefix>: ...``) says why; the cell stays
  finished, its checkpoints whole."""
  from posenc_jax.training.params_only import keep_params_only  # noqa: PLC0415 - JAX

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


def _run_cell(index: int, cells: list[Cell], run_cell: Callable[..., None],
              say: Callable[[str], None], slot: Slot | None) -> tuple[list, dict | None]:
  """One cell of :func:`run_grid`: ``(its records, None)``, or ``([], the failure)``."""
  cell = cells[index]
  folder = epath.Path(cell.folder)
  marker, log = folder / MARKER, folder / LOG
  prefix = f"[{index + 1}/{len(cells)}] {cell.name}"
  where = f" on {slot.name}" if slot is not None else ""
  before = 0.0
  if marker.exists():
    missing = missing_steps(cell)
    if not missing:
      records = cell_records(cell)
      say(f"{prefix}: finished before ({marker}), not rerun")
      keep_final_params(cell, prefix, say)  # a run killed after cell.json, before or in it
      return records, None
    before = recorded_seconds(marker)
    todo = dataclasses.replace(cell, steps=tuple(missing))
    say(f"{prefix}: finished before; running its {len(missing)} new step(s){where}, output "
        f"in {log}")
  else:
    todo = cell
    say(f"{prefix}: running {len(cell.steps)} step(s){where}, output in {log}")
  start = time.perf_counter()
  try:
    folder.mkdir(parents=True, exist_ok=True)
    if slot is None:
      run_cell(todo, log)
    else:
      run_cell(todo, log, slot=slot)
    mine = cell_records(cell)
  except OSError as e:  # its folder or log.txt cannot be written (a full disk): the grid stops
    raise OutputPathError(
        f"workdir: {folder} cannot be written ({e.strerror or first_line(e)}); free space "
        "(or fix the folder) and run the same command: the finished cells are kept") from None
  except (CellFailed, ValueError) as e:  # ValueError: a run that does not read (collect)
    say(f"{prefix}: FAILED: {e} (log: {log})")
    return [], {"cell": cell.name, "reason": str(e), "log": str(log)}
  seconds = before + time.perf_counter() - start
  write_atomic(marker, json.dumps({"cell": cell.name, "seconds": seconds, "records": mine},
                                  indent=2, sort_keys=True))
  say(f"{prefix}: done in {seconds:.0f} s")
  keep_final_params(cell, prefix, say)
  return mine, None


class _Heartbeat:
  """A progress line at least every ``every`` seconds while the grid runs: the cells done,
  the ones running (with their time so far) and an ETA from the cells that ran here."""

  def __init__(self, total: int, width: int, say: Callable[[str], None], every: float):
    self.total, self.width, self.say, self.every = total, width, say, every
    self.lock, self.stop = threading.Lock(), threading.Event()
    self.running: dict[str, float] = {}
    self.done, self.ran = 0, []
    self.thread = threading.Thread(target=self._beat, daemon=True)

  def started(self, name: str) -> None:
    with self.lock:
      self.running[name] = time.perf_counter()

  def ended(self, name: str) -> None:
    with self.lock:
      start = self.running.pop(name, None)
      self.done += 1
      if start is not None and time.perf_counter() - start > 1.0:  # not a cell kept as it was
        self.ran.append(time.perf_counter() - start)

  def line(self) -> str:
    with self.lock:
      now = time.perf_counter()
      running = ", ".join(f"{n} ({(now - t) / 60:.1f} min)" for n, t in self.running.items())
      left = self.total - self.done
      eta = ("no cell has finished here yet" if not self.ran else
             f"ETA {sum(self.ran) / len(self.ran) * left / self.width / 60:.0f} min")
    return (f"compare: {self.done}/{self.total} cells done; running {running or 'none'}; "
            f"{eta}")

  def _beat(self) -> None:
    while not self.stop.wait(self.every):
      self.say(self.line())

  def __enter__(self):
    self.thread.start()
    return self

  def __exit__(self, *exc):
    self.stop.set()
    self.thread.join()


def run_grid(cells: list[Cell], run_cell: Callable[..., None] = run_steps,
             say: Callable[[str], None] = progress, slots: list[Slot] | None = None,
             heartbeat_s: float = HEARTBEAT_S) -> tuple[list[dict[str, Any]], list[dict]]:
  """Runs every cell without a ``cell.json`` through ``run_cell(cell, log_path)`` (and, of
  a finished cell, the steps it lacks: :func:`missing_steps`), one progress line each as it
  starts and ends, then keeps each finished cell's final parameters only
  (:func:`keep_final_params`); returns the records of all finished cells and the failed
  cells (``{"cell", "reason", "log"}``), in the cells' order.

  With two or more ``slots`` (:mod:`posenc_jax.comparison.slots`), as many cells run at once,
  each called as ``run_cell(cell, log_path, slot=slot)`` (:func:`run_steps` runs its steps on
  the slot's devices); the next starts as a slot frees. Cells that fine-tune another's
  pre-trained model run after it on its slot (:func:`~posenc_jax.comparison.plan.groups`). SIGTERM or SIGINT reaches every
  running step (each saves), no further cell starts, and once they have stopped the first
  :class:`StepInterrupted` is raised; the same command resumes.

  Raises:
    CollectError: a cell finished before whose workdirs no longer read.
    StepInterrupted: see above.
  """
  width = len(slots) if slots and len(slots) > 1 else 1
  results: list[tuple[list, dict | None] | None] = [None] * len(cells)
  start = time.perf_counter()
  with _Heartbeat(len(cells), width, say, heartbeat_s) as beat:

    def one(index: int, slot: Slot | None) -> None:
      beat.started(cells[index].name)
      try:
        results[index] = _run_cell(index, cells, run_cell, say, slot)
      finally:
        beat.ended(cells[index].name)

    if width == 1:
      for index in range(len(cells)):
        one(index, None)
    else:
      _run_in_parallel(groups(cells), slots, one)
  records = [r for result in results if result for r in result[0]]
  failed = [result[1] for result in results if result and result[1]]
  where = f" on {width} slots ({'; '.join(s.name for s in slots)})" if width > 1 else ""
  say(f"compare: {len(cells)} cells, {len(cells) - len(failed)} finished, {len(failed)} "
      f"failed, in {(time.perf_counter() - start) / 60:.1f} min{where}")
  return records, failed


def _run_in_parallel(ordered: list[list[int]], slots: list[Slot],
                     one: Callable[[int, Slot], None]) -> None:
  """``one(index, slot)`` for every index of every group of ``ordered``
  (:func:`posenc_jax.comparison.plan.groups`: a group's cells in order, on one slot), as many
  groups at once as there are slots, each on a free one; stops starting groups once a signal
  came (:class:`_Steps`) and re-raises the first error once every started group has ended."""
  free: queue.Queue[Slot] = queue.Queue()
  for slot in slots:
    free.put(slot)
  futures, signals = [], len(_STEPS.received)
  with forwarding(), concurrent.futures.ThreadPoolExecutor(len(slots)) as pool:
    for group in ordered:
      slot = None
      while slot is None and len(_STEPS.received) == signals:
        with contextlib.suppress(queue.Empty):
          slot = free.get(timeout=0.2)
      if slot is None:  # interrupted: no new cell
        break

      def work(group=group, slot=slot):
        try:
          for index in group:
            if len(_STEPS.received) != signals:
              break
            one(index, slot)
        finally:
          free.put(slot)

      futures.append(pool.submit(work))
    concurrent.futures.wait(futures)
  errors = [f.exception() for f in futures if f.exception() is not None]
  if errors:
    raise errors[0]
