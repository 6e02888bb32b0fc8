"""Ctrl-C to a posenc-jax command is one line, wherever it lands: in the imports, the training
loop, the last checkpoint's wait or a library's thread join.

The trainer stops at a step boundary on SIGINT and SIGTERM and saves
(:mod:`posenc_jax.training.signals`); outside the loop a ``KeyboardInterrupt`` can reach the
top of the process from anywhere. :func:`install` (called first by ``posenc_jax/__init__.py``,
before any heavy import, in a process that runs a posenc-jax command line and in no other)
sets ``sys.excepthook`` to print ``<tool>: interrupted (SIGINT) ...`` for it instead of a
traceback; every other exception goes to the hook that was there. It imports only the
standard library.

Python raises ``KeyboardInterrupt`` in whatever Python code runs when SIGINT arrives; when
that is a garbage-collection callback (JAX registers one) or a finalizer, Python prints
"Exception ignored in ..." and carries on, and the Ctrl-C is lost (train.py then trained on).
The handler :func:`install` sets sends such a SIGINT again once the collection is over.

A ``KeyboardInterrupt`` raised inside a C extension's initialisation does not reach the top:
numpy prints it (through ``sys.excepthook``) and raises ``ImportError: numpy._core.multiarray
failed to import``, and the importer (jaxlib) chains its own ``ImportError`` to that. After a
SIGINT the handler raised, the hook words any uncaught exception as the interruption, once.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading

SCRIPTS = ("train.py", "finetune.py")  # the checkout's entry scripts (the others are -m)


def _command_line() -> bool:
  """This process runs a posenc-jax command line: ``python -m posenc_jax.<tool>`` (while the
  package is imported for it, ``sys.argv[0]`` is still ``-m``) or the checkout's scripts."""
  first = sys.argv[0] if sys.argv else ""
  return first == "-m" or os.path.basename(first) in SCRIPTS


def tool_name() -> str:
  """The name the running command's errors begin with: ``train.py``, ``compare``,
  ``evaluate``, ``analysis`` (from ``sys.argv[0]``, the script or the module's file)."""
  path = sys.argv[0] if sys.argv else ""
  if path in ("", "-m", "-c"):  # the package's own imports, before runpy names the module
    return "posenc_jax"
  name = os.path.basename(path)
  if name in SCRIPTS:
    return name
  if name == "__main__.py":
    return os.path.basename(os.path.dirname(path))
  return name.removesuffix(".py") or "posenc_jax"


_state = {"interrupted": False, "reported": False}  # a SIGINT raised here; its line printed


def _hook(kind, value, traceback, previous=sys.excepthook) -> None:
  if issubclass(kind, KeyboardInterrupt) or _state["interrupted"]:
    if _state["reported"]:
      return
    _state["reported"] = True
    print(f"{tool_name()}: interrupted (SIGINT); run the same command to resume (a training "
          "run resumes from its last checkpoint)", file=sys.stderr, flush=True)
    return
  previous(kind, value, traceback)


def _dropped_there(frame) -> bool:
  """``frame`` runs inside a garbage-collection callback or a finalizer (``__del__``), where
  an exception is printed and dropped."""
  callbacks = {getattr(callback, "__code__", None) for callback in gc.callbacks}
  while frame is not None:
    if frame.f_code in callbacks or frame.f_code.co_name == "__del__":
      return True
    frame = frame.f_back
  return False


def _interrupt(signum, frame) -> None:
  """SIGINT: ``KeyboardInterrupt`` here, or, where it would be dropped, the signal again in
  50 ms (from a thread: by then the collection is over)."""
  if _dropped_there(frame):
    again = threading.Timer(0.05, os.kill, (os.getpid(), signum))
    again.daemon = True
    again.start()
    return
  _state["interrupted"] = True
  raise KeyboardInterrupt


def install() -> None:
  """Words an uncaught ``KeyboardInterrupt`` as one line in a command-line process and makes
  sure no Ctrl-C is dropped (module docstring); a no-op in any other process (a library
  user's script, a notebook, a test) and for a SIGINT the process was started ignoring (a
  background job of a script)."""
  if not _command_line():
    return
  if sys.excepthook is sys.__excepthook__:
    sys.excepthook = _hook
  if (threading.current_thread() is threading.main_thread()
      and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
    signal.signal(signal.SIGINT, _interrupt)
