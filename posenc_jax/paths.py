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


class OutputPathError(ValueError):
  """A path a tool must write to cannot be written."""
