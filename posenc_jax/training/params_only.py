"""A finished run's checkpoints compacted to what evaluation needs (``python -m
posenc_jax.compare`` asks it of its finished cells): :func:`keep_params_only` rewrites the newest
good step with its parameters alone and their fingerprints, marked so
(:func:`posenc_jax.training.checkpoint.params_only_step`), through a folder beside
``checkpoints/`` swapped in atomically, so that a kill at any point leaves a readable step."""

from __future__ import annotations

import ctypes
import errno
import os

import orbax.checkpoint as ocp
from etils import epath

from posenc_jax.paths import absolute, is_remote
from posenc_jax.training.checkpoint import (CheckpointError, abandon_failed_io, check_writable,
                                            checkpoint_steps, drop_closed_loop_callbacks,
                                            fingerprints, io_reason, params_only_step,
                                            restore_params)

SWAP = "checkpoints.swap"  # beside checkpoints/: keep_params_only's new step, then the old one
_RENAME_EXCHANGE = 2  # renameat2's flag (<linux/fs.h>): the two paths trade places at once
_AT_FDCWD = -100  # renameat2's "relative to the working directory" (the paths are absolute)


def _exchange(a: epath.Path, b: epath.Path) -> bool:
  """Swaps the local folders ``a`` and ``b`` in one atomic step (Linux's ``renameat2`` with
  ``RENAME_EXCHANGE``); False, nothing moved, where the system or its file system cannot."""
  renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
  if renameat2 is None:
    return False
  if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
    return True
  code = ctypes.get_errno()
  if code in (errno.EINVAL, errno.ENOSYS):  # EINVAL: this file system cannot exchange
    return False
  raise OSError(code, os.strerror(code), os.fspath(b))


def _swap_in(new: epath.Path, live: epath.Path) -> None:
  """Puts the complete folder ``new`` in ``live``'s place and the old one at ``new``'s: one
  atomic exchange (:func:`_exchange`), else two renames (``live`` to ``<new>.old``, then
  ``new`` to ``live``), where a kill between the two leaves ``live`` absent and ``new``
  complete (:func:`_finish_swap` moves it in)."""
  if not _exchange(new, live):
    live.rename(new.parent / f"{new.name}.old")
    new.rename(live)


def _finish_swap(live: epath.Path, swap: epath.Path) -> None:
  """Ends a :func:`keep_params_only` killed midway: a complete step in ``swap`` that
  ``live`` (the checkpoints folder) lacks (killed between :func:`_swap_in`'s two renames)
  moves in; the rest of ``swap`` (a step half written, or the old one swapped out) is
  deleted."""
  if not swap.exists():
    return
  for folder in swap.iterdir():
    if (folder.name.isdigit() and not (live / folder.name).exists()
        and ocp.path.step.is_path_finalized(folder)):
      folder.rename(live / folder.name)
  swap.rmtree()


def keep_params_only(workdir: str) -> int | None:
  """Compacts ``<workdir>/checkpoints`` to what evaluation needs; returns the step kept, or
  None for a workdir without ``checkpoints/`` (nothing was saved).

  The newest step that restores and verifies (:func:`restore_params`) is rewritten with its
  ``params`` alone, bit for bit, and their fingerprints, so readers still verify them (its
  JSON item marked ``"params_only": true``, which training refuses to resume from); the
  optimizer state, the step counter and the input iterator's state (what only resuming
  training reads) are dropped, and so are the other steps. The step is written whole into
  ``<workdir>/checkpoints.swap/<step>`` (Orbax's atomic save), then swapped with
  ``checkpoints/<step>`` (:func:`_swap_in`: one atomic exchange on a local Linux file system)
  and the old one deleted, so a failure or a kill at any point leaves a readable checkpoint,
  and the next call finishes the job (:func:`_finish_swap`); a step already compacted is
  left as is. For one process (compare's) and a local workdir: an object store (``gs://``)
  moves a folder file by file, where a kill midway could leave no readable step.

  Raises:
    CheckpointError: a ``gs://`` workdir, no step restores, or the new step could not be
      written (one line; the checkpoints are left whole, what was written of the new step
      is deleted by the next call).
  """
  root = epath.Path(absolute(workdir))
  live, swap = root / "checkpoints", root / SWAP
  if not live.is_dir():
    return None
  if is_remote(workdir):
    raise CheckpointError(f"workdir: {workdir} is in an object store, which moves a folder "
                          "file by file: its checkpoints are left whole (a swap killed midway "
                          "could leave no readable step)")
  _finish_swap(live, swap)
  steps = checkpoint_steps(workdir)
  kept = steps[-1] if steps and params_only_step(workdir, steps[-1]) else None
  if kept is None:
    kept, params = restore_params(workdir)
    check_writable(os.fspath(swap), "workdir")  # else Orbax would wait minutes, not fail
    try:
      with ocp.CheckpointManager(swap, options=ocp.CheckpointManagerOptions(
          create=True, enable_async_checkpointing=False), item_names=("state", "data")) as staging:
        staging.save(kept, force=True, args=ocp.args.Composite(
            state=ocp.args.StandardSave({"params": params}),
            data=ocp.args.JsonSave({"step": kept, "params_only": True,
                                    "fingerprints": fingerprints({"params": params})})))
    except Exception as e:  # noqa: BLE001 - a failed write leaves the checkpoints whole
      # Writes of the failed save may still land in the swap folder: the next call deletes it.
      drop_closed_loop_callbacks()
      abandon_failed_io()
      raise CheckpointError(f"workdir: writing the parameters of step {kept} to {swap} failed "
                            f"({io_reason(e)}); {live} is left whole") from None
    _swap_in(swap / str(kept), live / str(kept))
    swap.rmtree()
  for step in steps:
    if step != kept:
      (live / str(step)).rmtree()
  return kept
