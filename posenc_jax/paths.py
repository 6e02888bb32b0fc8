"""The paths a tool reads and writes: local paths and URIs (``gs://bucket/run``, through
``etils.epath``), and the one-line error of an output that cannot be written. The training
loop, the checkpointer, the workdir and the evaluation write through these; the command-line
front door (:mod:`posenc_jax.cli`) sits above them all. Every document another process reads
(results, evaluation files, a workdir's config and records, the route table) is written with
:func:`write_atomic`."""

from __future__ import annotations

import os

from posenc_jax.messages import first_line


def is_remote(path: str | os.PathLike) -> bool:
  """A URI (``gs://bucket/run``) that ``etils.epath`` reads and writes, not a local path."""
  return "://" in os.fspath(path)


def absolute(path: str | os.PathLike) -> str:
  """A local path made absolute; a URI (:func:`is_remote`) as it is."""
  return os.fspath(path) if is_remote(path) else os.path.abspath(path)


def check_output_dir(field: str, path: str) -> str:
  """Creates ``path`` (a directory the tool writes into) or raises ``ValueError`` naming
  ``field``; returns :func:`absolute` of it. A URI is created through ``etils.epath``."""
  if is_remote(path):
    from etils import epath  # noqa: PLC0415

    try:
      epath.Path(path).mkdir(parents=True, exist_ok=True)
    except Exception as e:  # noqa: BLE001 - each filesystem raises its own errors
      raise OutputPathError(f"{field}: {path!r} cannot be created: {first_line(e)}") from None
    return path
  path = os.path.abspath(path)
  parent = path
  while not os.path.exists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    raise OutputPathError(f"{field}: {path!r} cannot be created: {parent!r} is a file")
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise OutputPathError(f"{field}: {path!r} cannot be created: {e.strerror}") from None
  if not os.access(path, os.W_OK | os.X_OK):
    raise OutputPathError(f"{field}: {path!r} is not writable")
  return path


def check_output_file(field: str, path: str) -> str:
  """Checks that ``path`` (a file the tool will write at the end) can be written, creating
  its folder; raises ``OutputPathError`` naming ``field``. Returns the absolute path."""
  path = os.path.abspath(path)
  if os.path.isdir(path):
    raise OutputPathError(f"{field}: {path!r} is a directory, not a file")
  check_output_dir(field, os.path.dirname(path))
  if os.path.exists(path) and not os.access(path, os.W_OK):
    raise OutputPathError(f"{field}: {path!r} is not writable")
  return path


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
  """Writes ``data`` to ``path`` through a temporary file beside it, renamed over it: a reader
  sees the old file or the new one, never part of one. A write that fails (a full disk, a
  read-only folder) removes the temporary file, leaves ``path`` as it was and raises
  :class:`OutputPathError` naming ``path`` and the system's reason."""
  from etils import epath  # noqa: PLC0415

  path = epath.Path(path)
  tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
  try:
    if isinstance(data, bytes):
      tmp.write_bytes(data)
    else:
      tmp.write_text(data)
    tmp.replace(path)
  except BaseException as e:
    try:
      tmp.unlink(missing_ok=True)
    except OSError:
      pass  # the write's own error is the one to report
    if isinstance(e, OSError):
      raise OutputPathError(f"{os.fspath(path)!r} cannot be written: "
                            f"{e.strerror or first_line(e)} (nothing there was changed)") from None
    raise


LOCK_FILE = ".lock"  # in a folder one process writes at a time: that process's pid
_HELD: dict[str, int] = {}  # the folders this process holds: path -> the lock's descriptor


def hold(field: str, folder: str) -> None:
  """Makes this process the one that writes ``folder`` (a local path; a URI is not locked),
  until it exits: an exclusive ``flock`` on ``<folder>/.lock``, which records its pid. The
  kernel releases it when the process ends, however it ends (``kill -9`` included), so a
  stale file never blocks a rerun. Holding a folder again is a no-op.

  Raises:
    OutputPathError: another process holds ``folder``: one line naming ``field``, the folder
      and that process's pid.
  """
  if is_remote(folder):
    return
  import fcntl  # noqa: PLC0415 - POSIX

  folder = os.path.realpath(folder)
  if folder in _HELD:
    return
  path = os.path.join(folder, LOCK_FILE)
  try:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  except OSError as e:
    raise OutputPathError(f"{field}: {path!r} cannot be created: {e.strerror}") from None
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
    os.close(fd)
    raise OutputPathError(f"{field}: {folder} is in use by process {holder} (it holds "
                          f"{path}); wait for it to end or stop it, or use another --{field} "
                          "(nothing there was changed)") from None
  os.ftruncate(fd, 0)
  os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
  os.set_inheritable(fd, False)
  _HELD[folder] = fd


class OutputPathError(ValueError):
  """A path a tool must write to cannot be written."""
