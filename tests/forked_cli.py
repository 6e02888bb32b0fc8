"""Command-line tools run as fresh processes that skip the library imports.

A bad-flag case needs a process of its own (absl's flags, the exit status, nothing printed or
written), but importing JAX, Flax, Orbax, TensorFlow and seqio costs each one 1.5-7 s, and the
error tables hold over a hundred cases. :func:`run` forks every case from one multiprocessing
fork server that imported those libraries once (no JAX backend, TensorFlow op or tool module
is started there, so forking it is safe: checked, three OS threads). The child runs the tool as
``python`` would (``runpy`` as ``__main__``, ``sys.argv``, the working directory), with its
stdout and stderr in files and its exit status the process's, 0.1 s a case. What a child skips
against a plain subprocess: interpreter start-up, those imports, and ``atexit`` handlers
(multiprocessing ends children with ``os._exit``). Children get the environment the server
started with (the first :func:`run` of the test process), not a later ``monkeypatch.setenv``;
``run(..., env={...})`` sets variables in the child alone.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile

PRELOAD = ["jax", "flax.linen", "optax", "orbax.checkpoint", "ml_collections.config_flags",
           "absl.app", "tensorflow", "seqio", "posenc_jax", "posenc_jax.tasks",
           "posenc_jax.training.loop"]


@functools.cache
def _context():
  """The fork-server context with :data:`PRELOAD` (its server starts on the first ``run``)."""
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # as the tools set it before TensorFlow
  context = multiprocessing.get_context("forkserver")
  context.set_forkserver_preload(PRELOAD)
  return context


def _child(argv: list[str], cwd: str, out: str, err: str, env: dict[str, str]) -> None:
  """Runs ``python *argv`` (a script, or ``-m module``) in this forked process, with ``env``
  added to its environment."""
  os.environ.update(env)
  for fd, path in ((1, out), (2, err)):
    os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
  sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)
  os.chdir(cwd)
  try:
    if argv[0] == "-m":
      sys.argv = argv[1:]
      sys.path[0] = cwd
      runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
      sys.argv = list(argv)
      sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
      runpy.run_path(argv[0], run_name="__main__")
  except SystemExit as e:  # what the interpreter does with it
    if e.code is None or isinstance(e.code, int):
      code = e.code or 0
    else:
      print(e.code, file=sys.stderr)
      code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(argv: list[str], *, cwd: str, timeout: float,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
  """``subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True)``,
  forked from the preloaded server (an uncaught exception prints its traceback to the
  captured stderr and exits 1, as Python does); ``env``: variables added to the child's
  environment."""
  with tempfile.TemporaryDirectory() as tmp:
    out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
    process = _context().Process(target=_child, args=(list(argv), cwd, out, err,
                                                      dict(env or {})))
    process.start()
    process.join(timeout)
    if process.exitcode is None:
      process.kill()
      process.join()
      raise subprocess.TimeoutExpired(argv, timeout)
    with open(out) as f_out, open(err) as f_err:
      return subprocess.CompletedProcess([sys.executable, *argv], process.exitcode,
                                         f_out.read(), f_err.read())
