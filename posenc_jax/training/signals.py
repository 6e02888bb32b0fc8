"""SIGTERM and SIGINT during training: finish the step, save it, stop (preemption, ``kill``, Ctrl-C).

While :class:`StopSignals` is entered (in the main thread), those signals only
record that a stop was asked for; the loop then saves a checkpoint at the
step it has reached and raises :class:`TrainingInterrupted`, so nothing since
the last periodic checkpoint is lost and a restart continues exactly there.
"""

from __future__ import annotations

import signal
import threading

import jax
import numpy as np

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class TrainingInterrupted(RuntimeError):
  """The run stopped on a signal after saving its current step."""


class StopSignals:
  """Context manager: SIGTERM/SIGINT set :attr:`signum` instead of ending the process.

  Outside the main thread (where Python cannot take signals) it does nothing.
  """

  def __init__(self):
    self.signum: int | None = None
    self._previous: dict[int, object] = {}

  def __enter__(self) -> StopSignals:
    if threading.current_thread() is threading.main_thread():
      for sig in SIGNALS:
        self._previous[sig] = signal.signal(sig, self._record)
    return self

  def __exit__(self, *exc) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous.clear()

  def _record(self, signum, frame) -> None:
    del frame
    self.signum = signum

  def agreed(self) -> int | None:
    """The signal to stop on, the same on every host (any host's), or None.

    Multi-process jobs exchange the flag (a collective: call it at the same step on
    every host).
    """
    if jax.process_count() == 1:
      return self.signum
    from jax.experimental import multihost_utils  # noqa: PLC0415
    flags = multihost_utils.process_allgather(np.int32(self.signum or 0))
    return int(np.max(flags)) or None
