"""Orbax checkpoints that are atomic, verified and never collide with a damaged one.

A checkpoint holds the train state (sharded arrays, restored onto the current mesh's shardings) and
a JSON item: the data position, so a resumed run sees exactly the examples an uninterrupted one
would, and a fingerprint of every state leaf (:func:`fingerprints`: two position-weighted sums of
the leaf's bits, and whether it is finite). Orbax writes each step into a temporary directory and
renames it when complete.

On restore, a step that does not restore (missing or truncated files), whose arrays do not match
their fingerprints (flipped bytes), or whose floating leaves are not finite is skipped with a
one-line warning for the next older one. The training run (:meth:`Checkpointer.restore_latest`)
also moves it to ``<workdir>/damaged_checkpoints/<step>``, so retraining to that step saves afresh
instead of colliding with it; read-only readers (analysis, ``--init_checkpoint``) use
:func:`restore_params` and leave the folder as is. A save that fails in the background stops the
run at the next step (:meth:`Checkpointer.check`).

A third item, ``input``, holds each process's input-iterator state (a ``tf.data`` iterator
checkpoint, :class:`posenc_jax.training.input_pipeline.InputIterator`) in
``input/process_<k>-of-<n>/``, written when the step is saved (before training goes on), inside the
step's temporary directory, so it is atomic with the step. Resuming reads it back
(:meth:`Checkpointer.restore_input`) at a cost independent of the step; a checkpoint without it
(older runs, data hooks without state, another number of processes) resumes by the step number
instead.

A finished run's checkpoints can be compacted to what evaluation needs
(:func:`posenc_jax.training.params_only.keep_params_only`, asked by ``python -m
posenc_jax.compare`` for its finished cells): one step holding the parameters alone, with their
fingerprints, marked so (:func:`params_only_step` reads the mark). Every reader of parameters
(:func:`restore_params`: the evaluate tool, analysis, ``--init_checkpoint``) reads it as
before; training refuses to resume from it in one line (:meth:`Checkpointer.restore_latest`).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import re
import sys
import threading
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils
from orbax.checkpoint._src.futures import future, synchronization

from posenc_jax.paths import absolute
from posenc_jax.messages import first_line
from posenc_jax.models.scan import match_layout

_GOLDEN = 2654435761  # Knuth's multiplicative hash constant: weights differ per position


class CheckpointError(ValueError):
  """A checkpoint folder cannot be written, or holds no checkpoint that restores."""


class BackgroundSaveError(CheckpointError):
  """An asynchronous save failed. With one process its waiting Orbax threads are released
  (:func:`_release_waiting_writers`); with several they stay blocked for Orbax's
  coordination timeout, so an entry point ends the process at once."""

  abandon_threads = True


def _release_waiting_writers(operation_id: str) -> None:
  """Ends the writer threads of a failed single-process save: each waits for a signal (its
  step or item directory created) that the failed save never sends, and would hold the
  interpreter's exit for Orbax's coordination timeout (300 s). Each is cancelled, then its
  signals are sent (keys of this operation only, in this process's own store), so it
  returns without writing. Reads Orbax internals (``_SignalingThread``), pinned by
  ``tests/test_checkpoint.py``."""
  for thread in threading.enumerate():
    if (isinstance(thread, future._SignalingThread)  # noqa: SLF001
        and thread._operation_id == operation_id):  # noqa: SLF001
      thread.cancel()
      future.set_signals(thread._receive_signals, operation_id=operation_id)  # noqa: SLF001


# Orbax's logs of one failed save, each with a traceback (writer threads, commit, finalize).
_SAID_BY_THE_RUN = ("_SignalingThread.run() raised an exception", "in background save thread",
                    "Save Finalize thread")


class _ReportedByTheRun(logging.Filter):
  """Drops Orbax's logs of a failed save (:data:`_SAID_BY_THE_RUN`): the run reports that
  failure itself, in one line (:meth:`Checkpointer.wait`, :meth:`Checkpointer.save`)."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not any(said in str(record.msg) for said in _SAID_BY_THE_RUN)


def _abandoned_task(record: logging.LogRecord) -> bool:
  """False for asyncio's record of a failed restore's or save's task's error, never read."""
  return not record.getMessage().split("\n", 1)[0].endswith("exception was never retrieved")


def abandon_failed_io() -> None:
  """After Orbax's reads or writes failed (not a missing item or a bad fingerprint: a full
  collection costs seconds in a large process), its other items' coroutines are never awaited,
  by design: Python's warning for each is off from now on, and the garbage collected now."""
  warnings.filterwarnings("ignore", category=RuntimeWarning,
                          message=r"coroutine '.*' was never awaited")
  gc.collect()


def io_reason(error: BaseException) -> str:
  """A failed write's reason without TensorFlow's decoration (``{{function_node ..}} <path>;
  <reason> [Op:SaveV2]``): the reason alone, since the caller names the folder."""
  text = re.sub(r"^\{\{function_node [^}]*\}\}\s*|\s*\[Op:\w+\]$", "", first_line(error))
  return text.rsplit("; ", 1)[-1] if text.startswith("/") and "; " in text else text


def _closed_loop_callback(unraisable) -> bool:
  """Whether an unraisable error is a read of an abandoned restore completing after its event
  loop closed (asyncio's ``call_soon_threadsafe`` on a closed loop): harmless, and printed as
  a bare traceback per pending read."""
  frames = []
  tb = unraisable.exc_traceback
  while tb is not None:
    frames.append(tb.tb_frame.f_code.co_name)
    tb = tb.tb_next
  return (unraisable.exc_type is RuntimeError and str(unraisable.exc_value) ==
          "Event loop is closed" and "call_soon_threadsafe" in frames)


def drop_closed_loop_callbacks() -> None:
  """From now on, the tracebacks of a failed restore's reads (or a failed save's writes)
  completing after Orbax closed its event loop are not printed, nor asyncio's of their tasks
  (:func:`_abandoned_task`). Installed before each restore and after a failed write."""
  logging.getLogger("asyncio").addFilter(_abandoned_task)  # once: addFilter skips a repeat
  hook = sys.unraisablehook
  if not getattr(hook, "drops_closed_loop_callbacks", False):
    def quiet(unraisable):
      if not _closed_loop_callback(unraisable):
        hook(unraisable)
    quiet.drops_closed_loop_callbacks = True
    sys.unraisablehook = quiet


def _unreadable(error: BaseException) -> str:
  """Why a checkpoint did not restore, in one short line (TensorStore's error names the file
  and then dumps its whole spec, which is cut)."""
  text = first_line(error)
  for tail in (" [tensorstore_spec", " See full TensorStore details"):
    text = text.split(tail)[0]
  return text


def _leaf_name(path: tuple) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                  for k in path)


def _words(x: jax.Array) -> jax.Array:
  """The bits of ``x`` as uint32 words, same shape (8-byte types: low and high words summed)."""
  x = jnp.asarray(x)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  size = x.dtype.itemsize
  if size == 4:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  if size in (1, 2):
    unsigned = jnp.uint8 if size == 1 else jnp.uint16
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
  halves = jax.lax.bitcast_convert_type(x, jnp.uint32)  # [..., 2]
  return halves[..., 0] + halves[..., 1] * jnp.uint32(_GOLDEN)


def _position(shape: tuple[int, ...]) -> jax.Array:
  """Row-major index of every element as uint32 (wrapping), built from iotas (no reshape,
  so a sharded leaf stays sharded)."""
  index = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(len(shape))):
    iota = jax.lax.broadcasted_iota(jnp.uint32, shape, axis)
    index = index + iota * jnp.uint32(stride % 2**32)
    stride *= shape[axis]
  return index


@jax.jit
def _leaf_fingerprints(leaves: list[jax.Array]) -> jax.Array:
  """``[n, 3]`` uint32: per leaf, the sum of its words, their position-weighted sum, and 1
  if every element is finite."""
  rows = []
  for x in leaves:
    words = _words(x)
    weights = _position(words.shape) * jnp.uint32(_GOLDEN) + jnp.uint32(1)
    finite = (jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact)
              else jnp.bool_(True))
    rows.append(jnp.stack([jnp.sum(words, dtype=jnp.uint32),
                           jnp.sum(words * weights, dtype=jnp.uint32),
                           finite.astype(jnp.uint32)]))
  return jnp.stack(rows) if rows else jnp.zeros((0, 3), jnp.uint32)


def fingerprints(tree: Any) -> dict[str, list[int]]:
  """``{leaf path: [word sum, weighted word sum, finite]}`` of a pytree of arrays.

  Any change of a single element changes the first sum (mod 2^32); swapped
  elements change the second. Integer sums are exact, so the result does not
  depend on how the leaves are sharded.
  """
  named = jax.tree_util.tree_leaves_with_path(tree)
  table = np.asarray(jax.device_get(_leaf_fingerprints([leaf for _, leaf in named])))
  return {_leaf_name(path): [int(v) for v in row] for (path, _), row in zip(named, table)}


def damage(tree: Any, recorded: dict[str, list[int]] | None, prefix: str = "") -> str | None:
  """What is wrong with restored ``tree`` (leaves named under ``prefix``), or None.

  Args:
    tree: restored arrays.
    recorded: the fingerprints saved with them (None: a checkpoint written before
      fingerprints; only finiteness is checked).
    prefix: the path of ``tree`` within the saved state (``"params/"``).
  """
  actual = fingerprints(tree)
  nonfinite = [name for name, row in actual.items() if not row[2]]
  if nonfinite:
    return f"non-finite values in {prefix}{nonfinite[0]} ({len(nonfinite)} leaves)"
  if recorded is None:
    return None
  for name, row in actual.items():
    saved = recorded.get(prefix + name)
    if saved is None:
      return f"{prefix}{name} has no recorded checksum"
    if saved[:2] != row[:2]:
      return f"checksum mismatch in {prefix}{name}"
  return None


def _move_tree(source: epath.Path, target: epath.Path) -> None:
  """Moves the folder ``source`` to ``target`` file by file (object stores such as GCS
  rename objects, not folders)."""
  for folder, _, files in source.walk():
    for name in files:
      destination = target / folder.relative_to(source) / name
      destination.parent.mkdir(parents=True, exist_ok=True)
      (folder / name).rename(destination)
  source.rmtree()


def _input_folder(directory: epath.Path) -> epath.Path:
  """This process's folder inside the ``input`` item's directory."""
  return directory / f"process_{jax.process_index()}-of-{jax.process_count()}"


class InputStateHandler(ocp.CheckpointHandler):
  """The ``input`` item: each process writes (and reads) its own iterator's state in
  ``process_<k>-of-<n>/iterator*`` (the iterator's ``save_state(prefix)`` /
  ``restore_state(prefix)``)."""

  def save(self, directory: epath.Path, args: InputSave) -> None:
    folder = _input_folder(directory)
    folder.mkdir(parents=True, exist_ok=True)
    args.iterator.save_state(os.fspath(folder / "iterator"))

  def restore(self, directory: epath.Path, args: InputRestore) -> None:
    folder = _input_folder(directory)
    if not (folder / "iterator.index").exists():
      raise FileNotFoundError(f"no input state for process {jax.process_index()} of "
                              f"{jax.process_count()} in {directory}")
    args.iterator.restore_state(os.fspath(folder / "iterator"))


@ocp.args.register_with_handler(InputStateHandler, for_save=True)
@dataclasses.dataclass
class InputSave(ocp.args.CheckpointArgs):
  """An iterator with ``save_state(prefix)``."""

  iterator: Any


@ocp.args.register_with_handler(InputStateHandler, for_restore=True)
@dataclasses.dataclass
class InputRestore(ocp.args.CheckpointArgs):
  """An iterator with ``restore_state(prefix)``, restored in place."""

  iterator: Any


def check_writable(directory: str, field: str) -> None:
  """Raises :class:`CheckpointError` (``<field>: <directory> is not writable (<reason>)``)
  unless a file can be written in ``directory`` (created if missing): process 0 writes and
  removes a probe file. Orbax, given a folder it cannot write, would wait minutes (its
  coordination timeout) for the signal that the step's folder exists."""
  if jax.process_index() != 0:
    return
  probe = epath.Path(directory) / f".writable-{os.getpid()}"
  try:
    probe.parent.mkdir(parents=True, exist_ok=True)
    probe.write_text("")
    probe.unlink()
  except Exception as e:  # noqa: BLE001 - OSError locally, the backend's own remotely
    reason = e.strerror if isinstance(e, OSError) and e.strerror else first_line(e)
    raise CheckpointError(f"{field}: {directory} is not writable ({reason})") from None


class Checkpointer:
  """Saves and restores ``(state, data_state)`` (and the input iterator's state) under
  ``<workdir>/checkpoints``.

  Args:
    workdir: the run's directory.
    save_interval_steps: save when ``step % save_interval_steps == 0``.
    max_to_keep: newest checkpoints kept.
    async_save: write in the background while training goes on.

  Raises:
    CheckpointError: the folder cannot be written (checked by writing to it).
  """

  def __init__(self, workdir: str, *, save_interval_steps: int, max_to_keep: int = 3,
               async_save: bool = True):
    self.workdir = absolute(workdir)
    self.directory = os.path.join(self.workdir, "checkpoints")
    check_writable(self.directory, "checkpoints")
    options = ocp.CheckpointManagerOptions(
        save_interval_steps=save_interval_steps, max_to_keep=max_to_keep,
        enable_async_checkpointing=async_save, cleanup_tmp_directories=True, create=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options,
                                         item_names=("state", "data", "input"))
    absl_logger = logging.getLogger("absl")
    if not any(isinstance(f, _ReportedByTheRun) for f in absl_logger.filters):
      absl_logger.addFilter(_ReportedByTheRun())
    self.last_saved: int | None = None
    self._operation: str | None = None  # Orbax's operation id of the newest save

  def check(self) -> None:
    """Raises :class:`BackgroundSaveError` if a background save failed (does not wait for one
    in progress)."""
    if not self.manager.is_saving_in_progress():
      self.wait()

  def wait(self) -> None:
    """Blocks until pending asynchronous saves are on disk; raises
    :class:`BackgroundSaveError` (one line) if one failed."""
    try:
      self.manager.wait_until_finished()
    except Exception as e:  # noqa: BLE001 - any failed write stops the run with one line
      if jax.process_count() == 1 and self._operation is not None:
        _release_waiting_writers(self._operation)
      abandon_failed_io()
      self.manager.reload()
      newest = self.manager.latest_step()
      raise BackgroundSaveError(
          f"checkpoints: a save to {self.directory} failed ({io_reason(e)}); stopping: "
          + (f"the newest complete checkpoint is step {newest}" if newest is not None
             else "no complete checkpoint is left there")) from None

  def save(self, step: int, state: Any, data_state: dict[str, Any], *, force: bool = False,
           input_iterator: Any = None) -> bool:
    """Saves if the interval says so (or ``force``; before each save the folder is probed,
    :func:`check_writable`), with the state's fingerprints and, when
    ``input_iterator`` has a ``save_state(prefix)`` (and is not known to be
    ``checkpointable`` False), its state (taken before this returns); returns whether it
    saved."""
    self.check()
    if not (force or self.manager.should_save(step)):
      return False
    # Every save probes the folder first: given a folder it cannot write (from the start, or
    # made read-only mid-run), Orbax would wait minutes (its coordination timeout), not fail.
    check_writable(self.directory, "checkpoints")
    data = dict(data_state) | {"fingerprints": fingerprints(state)}
    items = dict(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data))
    if (callable(getattr(input_iterator, "save_state", None))
        and getattr(input_iterator, "checkpointable", True)):
      items["input"] = InputSave(input_iterator)
    try:
      saved = self.manager.save(step, args=ocp.args.Composite(**items), force=True)
      self._operation = synchronization.OperationIdGenerator.get_current_operation_id()
    except Exception as e:  # noqa: BLE001 - a failed write stops the run with one line
      abandon_failed_io()
      raise CheckpointError(f"checkpoints: saving step {step} to {self.directory} failed "
                            f"({io_reason(e)})") from None
    if saved:
      self.last_saved = step
    return saved

  def restore_latest(self, abstract_state: Any) -> tuple[int, Any, dict[str, Any]] | None:
    """``(step, state, data_state)`` of the newest checkpoint that restores and verifies, or
    None; damaged ones on the way are moved to ``<workdir>/damaged_checkpoints``.

    Args:
      abstract_state: the state's ``jax.ShapeDtypeStruct`` tree with shardings.

    Raises:
      CheckpointError: the newest step holds the parameters only
        (:func:`posenc_jax.training.params_only.keep_params_only`):
        whole, but nothing to resume from, so left where it is.
    """
    drop_closed_loop_callbacks()
    steps = sorted(self.manager.all_steps(), reverse=True)
    if steps and params_only_step(self.workdir, steps[0]):
      raise CheckpointError(
          f"checkpoints: step {steps[0]} in {self.directory} holds the parameters only (kept so "
          "by keep_params_only, as a finished compare cell is): it evaluates, and fine-tunes "
          "through --init_checkpoint, but training cannot resume from it; train in a new "
          "workdir")
    for step in steps:
      failed_reads = False  # only Orbax's restore raises here
      try:
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
        data = dict(restored.data)
        problem = damage(restored.state, data.pop("fingerprints", None))
      except Exception as e:  # noqa: BLE001 - any unreadable checkpoint is skipped
        problem, failed_reads = _unreadable(e), True
      if problem is None:
        self.last_saved = step
        return step, restored.state, data
      if failed_reads:  # here, past the except block that held the abandoned reads
        abandon_failed_io()
      moved = self._quarantine(step)
      logging.warning("checkpoint %d is damaged (%s): moved to %s; trying an older one", step,
                      problem, moved)
    return None

  def restore_input(self, step: int, iterator: Any) -> bool:
    """Restores ``iterator`` (with a ``restore_state(prefix)``) to its state saved at ``step``;
    False (with one logged line) when the step holds none for this process or it does not
    restore, so the caller resumes by the step number."""
    if not callable(getattr(iterator, "restore_state", None)):
      return False
    if not (epath.Path(self.directory) / str(step) / "input").exists():
      return False
    try:
      self.manager.restore(step, args=ocp.args.Composite(input=InputRestore(iterator)))
    except Exception as e:  # noqa: BLE001 - any failure falls back to the step number
      logging.warning("checkpoint %d: the input state does not restore (%s); resuming the "
                      "data by the step number", step, first_line(e))
      return False
    return True

  def _quarantine(self, step: int) -> str:
    """Moves step ``step`` out of the checkpoint folder (process 0; all processes wait)."""
    target = os.path.join(self.workdir, "damaged_checkpoints", str(step))
    if jax.process_index() == 0:
      suffix = 0
      while epath.Path(target + (f".{suffix}" if suffix else "")).exists():
        suffix += 1
      target += f".{suffix}" if suffix else ""
      _move_tree(epath.Path(self.directory) / str(step), epath.Path(target))
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"posenc_jax quarantine {step}")
    self.manager.reload()
    return target

  def close(self) -> None:
    self.wait()
    self.manager.close()


def _shapes(tree: Any) -> dict[str, tuple[int, ...]]:
  return {_leaf_name(path): tuple(leaf.shape)
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def shape_mismatch(saved_tree: Any, expected_tree: Any) -> str | None:
  """One line naming what differs between two parameter trees (arrays or
  ``ShapeDtypeStruct``s: leaves missing, extra, or of another shape), or None."""
  return _compare(_shapes(saved_tree), _shapes(expected_tree))


def _compare(saved: dict[str, tuple], expected: dict[str, tuple]) -> str | None:
  """One line naming what differs between the saved and the expected parameters, or None."""
  missing = sorted(set(expected) - set(saved))
  extra = sorted(set(saved) - set(expected))
  shapes = [f"{k} {saved[k]} vs {expected[k]}" for k in sorted(set(saved) & set(expected))
            if saved[k] != expected[k]]
  problems = [f"{what}: {', '.join(items[:4])}{' ...' if len(items) > 4 else ''}"
              for what, items in (("missing in the checkpoint", missing),
                                  ("not in the config's model", extra),
                                  ("shape (checkpoint vs model)", shapes)) if items]
  return "; ".join(problems) or None


def checkpoint_steps(workdir: str, field: str = "workdir") -> list[int]:
  """Complete steps saved under ``<workdir>/checkpoints``, oldest first."""
  manager = _open(workdir, field)
  try:
    return sorted(manager.all_steps())
  finally:
    manager.close()


def _open(workdir: str, field: str) -> ocp.CheckpointManager:
  directory = epath.Path(absolute(workdir)) / "checkpoints"
  if not directory.is_dir():
    raise CheckpointError(f"{field}: {workdir} has no checkpoints/ folder (train.py writes "
                          "<workdir>/checkpoints)")
  return ocp.CheckpointManager(
      directory, options=ocp.CheckpointManagerOptions(create=False), item_names=("state", "data"),
      item_handlers={"state": ocp.PyTreeCheckpointHandler(), "data": ocp.JsonCheckpointHandler()})


class _UnreadItem(logging.Filter):
  """Drops Orbax's warning that an item of the checkpoint "could not be restored" for
  ``item``, which the caller leaves unread on purpose (its other warnings pass)."""

  def __init__(self, item: str):
    super().__init__()
    self.item = item

  def filter(self, record: logging.LogRecord) -> bool:
    return not (str(record.msg).startswith('Item "%s" was found in the checkpoint, but could '
                                           "not be restored")
                and record.args == (self.item,))


def restore_params(workdir: str, abstract_params: Any = None, *, step: int | None = None,
                   field: str = "workdir") -> tuple[int, Any]:
  """``(step, params)``: the ``params`` of the newest checkpoint in ``<workdir>/checkpoints``
  that restores and verifies (or of ``step``), on the first local device. Read-only:
  damaged steps are skipped with a warning, not moved.

  Only the parameters are read (Orbax partial restore), whatever optimizer the
  run used.

  Args:
    workdir: a train.py workdir.
    abstract_params: the expected parameter tree (shapes); the saved one must match
      it exactly, else :class:`CheckpointError` says what differs, up to the layers'
      layout: scanned or unrolled layers are converted to the expected layout
      (:mod:`posenc_jax.models.scan`). None: as saved.
    step: a saved step; None: the newest good one.
    field: the flag or argument named in errors (``workdir``, ``init_checkpoint``).
  """
  drop_closed_loop_callbacks()
  manager = _open(workdir, field)
  unread = _UnreadItem("input")  # the input iterator's state: not needed for parameters
  logging.getLogger("absl").addFilter(unread)  # Orbax logs through absl's logger
  try:
    steps = sorted(manager.all_steps())
    if not steps:
      raise CheckpointError(f"{field}: {workdir}/checkpoints holds no complete checkpoint")
    if step is not None and step not in steps:
      raise CheckpointError(f"step: {step} is not saved in {workdir}/checkpoints; saved: "
                            f"{', '.join(map(str, steps))}")
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    errors = []
    for candidate in [step] if step is not None else sorted(steps, reverse=True):
      reading = True
      try:
        items = manager.item_metadata(candidate)  # reads the arrays' metadata
        reading, metadata = False, items["state"]
        saved = getattr(metadata, "tree", metadata)["params"]
        expected = saved
        if abstract_params is not None:  # in the saved layout (scanned or unrolled layers)
          expected = jax.eval_shape(lambda p: match_layout(p, saved), abstract_params)
          mismatch = shape_mismatch(saved, expected)
          if mismatch:
            raise CheckpointError(f"{field}: checkpoint step {candidate} does not hold the "
                                  f"config's model (is --config the run's?): {mismatch}")
        target = {"params": jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), expected)}
        restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=device), target)
        reading = True
        restored = manager.restore(candidate, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(item=target, restore_args=restore_args,
                                         partial_restore=True),
            data=ocp.args.JsonRestore()))
        reading, params = False, restored.state["params"]
        problem = damage(params, dict(restored.data).get("fingerprints"), prefix="params/")
      except CheckpointError:
        raise
      except Exception as e:  # noqa: BLE001 - reported below, or an older step is tried
        problem = _unreadable(e)
      if problem is None:
        return candidate, params if abstract_params is None else match_layout(
            params, abstract_params)
      if reading:
        abandon_failed_io()
      errors.append(f"step {candidate}: {problem}")
      logging.warning("checkpoint %s in %s is damaged (%s); skipped", candidate, workdir,
                      problem)
  finally:
    manager.close()
    logging.getLogger("absl").removeFilter(unread)
  raise CheckpointError(f"{field}: no checkpoint in {workdir}/checkpoints restores: "
                        f"{'; '.join(errors)}")


def params_only_step(workdir: str, step: int) -> bool:
  """Whether checkpoint ``step`` of ``workdir`` holds the parameters alone: its JSON item
  says ``"params_only": true`` (the mark of
  :func:`posenc_jax.training.params_only.keep_params_only`), read without an Orbax
  manager; False for one whose JSON does not read (its restore says what is wrong)."""
  try:
    data = ocp.JsonCheckpointHandler().restore(
        epath.Path(absolute(workdir)) / "checkpoints" / str(step) / "data")
  except (OSError, ValueError):
    return False
  return isinstance(data, dict) and data.get("params_only") is True
