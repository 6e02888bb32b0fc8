"""Orbax checkpoints: atomic, asynchronous, keep-N, resumable from the newest complete one.

A checkpoint holds the train state (sharded arrays, restored onto the
current mesh's shardings) and the data position (JSON), so a resumed run
sees exactly the examples an uninterrupted one would. Orbax writes each
step into a temporary directory and renames it when complete; a directory
that still fails to restore (cut short outside Orbax) is skipped for the
next older one, with a warning.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import orbax.checkpoint as ocp


class Checkpointer:
  """Saves and restores ``(state, data_state)`` under ``<workdir>/checkpoints``.

  Args:
    workdir: the run's directory.
    save_interval_steps: save when ``step % save_interval_steps == 0``.
    max_to_keep: newest checkpoints kept.
    async_save: write in the background while training goes on.
  """

  def __init__(self, workdir: str, *, save_interval_steps: int, max_to_keep: int = 3,
               async_save: bool = True):
    options = ocp.CheckpointManagerOptions(
        save_interval_steps=save_interval_steps, max_to_keep=max_to_keep,
        enable_async_checkpointing=async_save, cleanup_tmp_directories=True, create=True)
    self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    self.manager = ocp.CheckpointManager(self.directory, options=options,
                                         item_names=("state", "data"))

  def save(self, step: int, state: Any, data_state: dict[str, Any], *, force: bool = False
           ) -> bool:
    """Saves if the interval says so (or ``force``); returns whether it saved."""
    return self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)), force=force)

  def restore_latest(self, abstract_state: Any) -> tuple[int, Any, dict[str, Any]] | None:
    """``(step, state, data_state)`` of the newest checkpoint that restores, or None.

    Args:
      abstract_state: the state's ``jax.ShapeDtypeStruct`` tree with shardings.
    """
    for step in sorted(self.manager.all_steps(), reverse=True):
      try:
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
      except Exception as e:  # noqa: BLE001 - any unreadable checkpoint is skipped
        logging.warning("checkpoint %d in %s does not restore (%s); trying an older one",
                        step, self.directory, str(e).splitlines()[0] if str(e) else type(e))
        continue
      return step, restored.state, dict(restored.data)
    return None

  def wait(self) -> None:
    """Blocks until pending asynchronous saves are on disk."""
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
