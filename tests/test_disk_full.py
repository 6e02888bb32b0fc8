"""A full disk: every tool ends in one line, leaves no partial file and loses nothing it had.

A write that raises ``ENOSPC`` (patched in, as a full disk raises it) hits the atomic writer
every document goes through (:func:`posenc_jax.paths.write_atomic`), compare's grid between
cells (a cell's folder or ``log.txt``), ``--collect``'s results and the evaluate tool's file.
"""

import errno
import json
import os
import pathlib

import pytest
from etils import epath

from posenc_jax.comparison import pages
from posenc_jax.paths import OutputPathError, write_atomic
from tests.test_compare import fake_glue_cell, glue_config

from posenc_jax import compare as compare_cli  # noqa: E402 - after the fakes' imports


LOCAL = type(epath.Path("/"))  # the class epath gives a local path


def _full(*args, **kwargs):
  raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _files(folder: pathlib.Path) -> dict[str, bytes]:
  return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("data", ["new text", b"new bytes"])
def test_a_failed_atomic_write_leaves_the_old_file_and_no_temporary_one(tmp_path, monkeypatch,
                                                                        data):
  path = tmp_path / "results.json"
  path.write_text("old")
  monkeypatch.setattr(LOCAL, "write_bytes" if isinstance(data, bytes) else "write_text",
                      _full)
  with pytest.raises(OutputPathError) as raised:
    write_atomic(path, data)
  assert str(raised.value) == (f"{str(path)!r} cannot be written: No space left on device "
                               "(nothing there was changed)")
  assert _files(tmp_path) == {"results.json": b"old"}


def test_a_failed_rename_removes_the_temporary_file(tmp_path, monkeypatch):
  monkeypatch.setattr(LOCAL, "replace", _full)
  with pytest.raises(OutputPathError):
    write_atomic(tmp_path / "new.json", "{}")
  assert _files(tmp_path) == {}


def test_compare_stops_in_one_line_when_the_next_cell_cannot_be_written(tmp_path, monkeypatch):
  """The grid had failed one cell, then crashed with OSError opening the next one's log.txt;
  now the first full write stops it in one line, the finished cells kept for the rerun."""
  root = tmp_path / "root"
  calls = []

  def cell(cell, log):
    calls.append(cell.name)
    if len(calls) == 2:
      _full()  # the disk filled up after the first cell
    fake_glue_cell(cell, log)

  with pytest.raises(OutputPathError) as raised:
    compare_cli.compare(glue_config(), str(root), cell, say=lambda s: None)
  line = str(raised.value)
  assert line == (f"workdir: {root}/bert/seed1 cannot be written (No space left on device); "
                  "free space (or fix the folder) and run the same command: the finished "
                  "cells are kept")
  assert calls == ["bert/seed0", "bert/seed1"]  # no cell started after it
  assert (root / "bert" / "seed0" / "cell.json").exists() and not (root / "results.json").exists()
  summary = compare_cli.compare(glue_config(), str(root), fake_glue_cell, say=lambda s: None)
  assert not summary["failed"]  # the rerun after space was freed


def test_results_that_cannot_be_written_keep_the_earlier_ones(tmp_path, monkeypatch):
  root = tmp_path / "root"
  summary = compare_cli.compare(glue_config(), str(root), fake_glue_cell, say=lambda s: None)
  before = {name: (root / name).read_bytes() for name in ("results.json", "results.md")}
  monkeypatch.setattr(LOCAL, "write_text", _full)
  with pytest.raises(OutputPathError, match="results.json' cannot be written: No space left"):
    pages.write(str(root), summary)
  assert {name: (root / name).read_bytes() for name in before} == before
  assert not list(root.glob(".*.tmp-*"))


def test_an_evaluation_file_that_cannot_be_written_is_one_line_and_no_partial_file(tmp_path,
                                                                                   monkeypatch):
  from posenc_jax.evaluation import report  # noqa: PLC0415

  doc = {"protocol": "loss", "workdir": str(tmp_path), "step": 3, "checkpoint": "latest",
         "objective": "lm", "settings": {"split": "validation", "eval_steps": 1},
         "split": "validation", "metrics": {"eval_loss": 1.0}}
  out = tmp_path / "eval"
  monkeypatch.setattr(LOCAL, "write_text", _full)
  with pytest.raises(OutputPathError, match="cannot be written: No space left on device"):
    report.write(doc, str(out))
  assert _files(out) == {}
  assert json.dumps(doc)  # the document itself is intact
