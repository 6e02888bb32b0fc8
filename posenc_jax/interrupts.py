"""Ctrl-C to a posenc-jax command is one line, wherever it lands: in the imports, the training
loop, the last checkpoint's wait or a library's thread join.

The trainer stops at a step boundary on SIGINT and SIGTERM and saves
(:mod:`posenc_jax.training.signals`); outside the loop a ``KeyboardInterrupt`` can reach the
top of the process from anywhere. :func:`install` (called first by ``posenc_jax/__init__.py``,
before any heavy import, in a process that runs a posenc-jax command line and in no other)
sets ``sys.excepthook`` to print ``<tool>: interrupted (SIGINT) ...`` for it instead of a
traceback; every other exception goes to the hook that was there. It imports only the
standard library.
"""

from __future__ import annotations

import os
import sys

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


def _hook(kind, value, traceback, previous=sys.excepthook) -> None:
  if issubclass(kind, KeyboardInterrupt):
    print(f"{tool_name()}: interrupted (SIGINT); run the same command to resume (a training "
          "run resumes from its last checkpoint)", file=sys.stderr, flush=True)
    return
  previous(kind, value, traceback)


def install() -> None:
  """Words an uncaught ``KeyboardInterrupt`` as one line in a command-line process (module
  docstring); a no-op in any other process (a library user's script, a notebook, a test)."""
  if _command_line() and sys.excepthook is sys.__excepthook__:
    sys.excepthook = _hook
