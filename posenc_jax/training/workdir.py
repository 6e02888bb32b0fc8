"""A workdir belongs to the run that created it: ``<workdir>/config.json`` holds that run's
full resolved config, and only a run with the same config may resume there.

Fields that change how a run is carried out but not what it computes may
differ on resume (:data:`RESUMABLE`: the step budget, logging, checkpoint and
evaluation cadence, the mesh, the compilation cache, profiling, the attention
route). Anything else (the
model, the task, the batch, the optimizer) is refused with one line before
anything in the folder is touched.

The files a run reads back on resume (``config.json``, ``metrics.jsonl``, ``best.json``)
are checked in the same place (:func:`claim`): a ``metrics.jsonl`` whose last line a
killed write left torn is accepted (that line is the record of a step the resume
recomputes, and the writer drops it with a warning); any other file that is not what a run
writes there (binary, a folder, JSON of another shape, a torn line before the last), or one
that cannot be written, is one :class:`WorkdirError` line naming it, with nothing changed.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import ml_collections
from etils import epath

from posenc_jax import foreign
from posenc_jax.paths import OutputPathError, check_output_dir, is_remote, write_atomic
from posenc_jax.models.config import model_config
from posenc_jax.training.config import TrainConfigError

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
BEST_FILE = "best.json"
# How every line of ``metrics.jsonl`` begins (``json.dumps({"step": step, ...})``).
RECORD_HEAD = '{"step": '
RESUMABLE = ("total_steps", "log_every", "eval_every", "eval_steps", "checkpoint_every",
             "keep_checkpoints", "async_checkpointing", "mesh", "decode", "sweep",
             "compilation_cache_dir", "profile_steps", "model.route", "cache_data",
             "model.attention_precision", "prepare_data")


def resolved_model(model: Any) -> dict[str, Any]:
  """A model config (ConfigDict, dict or ModelConfig) as JSON-ready data, every field set."""
  return json.loads(json.dumps(model_config(model).to_dict(), default=str))


def resolved_config(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """``config`` as JSON-ready data, with the model's unset fields filled with their defaults."""
  data = json.loads(json.dumps(config.to_dict(), default=str))
  data["model"] = resolved_model(config.model)
  return data


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
  if isinstance(data, dict) and data:
    out = {}
    for key, value in data.items():
      out |= _flatten(value, f"{prefix}{key}.")
    return out
  return {prefix[:-1]: data}


# Fields newer than some workdirs, and the value a run without the field used.
ADDED = {"data_sharding": "stream", "packed_segments": False, "randomized_positions": None,
         "randomized_positions_eval": "randomized"}


def differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
  """``field: saved -> current`` for every field outside :data:`RESUMABLE` that differs (a
  field of :data:`ADDED` missing from ``saved`` has its value there)."""
  old, new = _flatten(saved), _flatten(current)
  old |= {f: v for f, v in ADDED.items() if f in new and f not in old}
  diffs = []
  for field in sorted(set(old) | set(new)):
    if any(field == r or field.startswith(r + ".") for r in RESUMABLE):
      continue
    if old.get(field, "<unset>") != new.get(field, "<unset>"):
      diffs.append(f"{field}: {old.get(field, '<unset>')!r} there, "
                   f"{new.get(field, '<unset>')!r} here")
  return diffs


# The ModelConfig fields that give an encoder's parameters their meaning: a model that
# differs in one of them is another model (dropout, dtype, the route, remat, the layer
# layout, the pooler and the segment terms a fine-tuning run adds are not).
ARCHITECTURE = ("vocab_size", "d_model", "num_layers", "num_heads", "head_dim", "mlp_dim",
                "max_len", "scheme", "attention", "linformer_k", "linformer_sharing", "pre_ln",
                "activation", "layer_norm_eps")


class WorkdirError(TrainConfigError):
  """A file in a workdir is not what a run writes there, or cannot be written."""


def _foreign(field: str, path: epath.Path, problem: str) -> WorkdirError:
  return WorkdirError(f"{field}: {path} {problem}, not the file a run writes there; move it "
                      "away (nothing there was changed)")


def _read_text(path: epath.Path, field: str) -> str:
  """The text of the file ``path`` (UTF-8), or :class:`WorkdirError` naming it."""
  try:
    data = path.read_bytes()
  except IsADirectoryError:
    raise _foreign(field, path, "is a folder") from None
  except OSError as e:
    raise WorkdirError(f"{field}: {path} cannot be read ({e.strerror or e})") from None
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise _foreign(field, path, f"is not text (byte {e.start} is {data[e.start]:#04x})") from None


def read_object(path: epath.Path, field: str = "workdir") -> dict[str, Any]:
  """The JSON object the file ``path`` holds.

  Raises:
    WorkdirError: one line naming ``path``: not readable, not text, empty, not JSON, or JSON
      that is not an object (a list, ``null``, a string).
  """
  text = _read_text(path, field)
  if not text.strip():
    raise _foreign(field, path, "is empty")
  try:
    data = foreign.loads(text)
  except ValueError as e:
    raise _foreign(field, path, f"does not read as JSON ({e})") from None
  if not isinstance(data, dict):
    raise _foreign(field, path, f"holds a JSON {type(data).__name__} ({text.strip()[:40]}), "
                   "not an object")
  return data


def saved_config(workdir: str, field: str = "workdir") -> dict[str, Any] | None:
  """The resolved config a ``train.py`` run recorded in ``<workdir>/config.json`` (None
  without one).

  Raises:
    WorkdirError: one line naming the file (``field`` first) when it is not a JSON object
      (:func:`read_object`) with a ``model`` object.
  """
  path = epath.Path(workdir) / CONFIG_FILE
  if not path.exists():
    return None
  saved = read_object(path, field)
  if not isinstance(saved.get("model"), dict):
    raise _foreign(field, path, "holds no 'model' object")
  saved["model"].setdefault("scan_layers", False)  # runs from before scan_layers were unrolled
  return saved


def saved_model(workdir: str, field: str = "workdir") -> dict[str, Any] | None:
  """The model of :func:`saved_config` (None without a ``config.json``), which must hold
  every :data:`ARCHITECTURE` field (else :class:`WorkdirError` naming the file)."""
  saved = saved_config(workdir, field)
  if saved is None:
    return None
  missing = [f for f in ARCHITECTURE if f not in saved["model"]]
  if missing:
    raise _foreign(field, epath.Path(workdir) / CONFIG_FILE,
                   f"holds a model without {', '.join(missing[:3])}"
                   f"{' ...' if len(missing) > 3 else ''}")
  return saved["model"]


def read_metrics(path: epath.Path, field: str = "workdir"
                 ) -> tuple[list[tuple[int, str]], str | None]:
  """The records of a ``metrics.jsonl``: ``[(step, line)]`` (lines without their newline,
  blank ones left out), and its torn last line (None when it is whole).

  A torn line is the head of a record (``{"step": ...`` cut short, with or without a
  newline): what a process killed while writing leaves, and only as the last line.

  Raises:
    WorkdirError: one line naming the file and line when any other line is not a record
      (the file binary, a folder, JSON of another shape, a torn line followed by others).
  """
  if not path.exists():
    return [], None
  lines = [(n, line) for n, line in enumerate(_read_text(path, field).split("\n"), 1)
           if line.strip()]
  records, torn = [], None
  for index, (number, line) in enumerate(lines):
    try:
      record = foreign.loads(line)
    except ValueError:
      record = None
      if (index == len(lines) - 1 and line.isascii()
          and (line.startswith(RECORD_HEAD) or RECORD_HEAD.startswith(line))):
        torn = line
        continue
    step = record.get("step") if isinstance(record, dict) else None
    if not isinstance(step, int) or isinstance(step, bool):
      raise _foreign(field, path, f"line {number} ({line.strip()[:40]!r}) is not a record "
                     '{"step": <int>, ...}')
    records.append((step, line))
  return records, torn


def check_files(workdir: str, config: ml_collections.ConfigDict) -> None:
  """Checks that the files a run in ``workdir`` reads back and appends to are its own
  (:func:`read_metrics`; ``best.json`` with ``config.best_metric``) and that they and the
  ``checkpoints`` folder are writable (the checkpoints' own probe would come after
  ``config.json`` is written).

  Raises:
    WorkdirError: one line naming the file.
  """
  folder = epath.Path(workdir)
  read_metrics(folder / METRICS_FILE)
  if config.get("best_metric") and (folder / BEST_FILE).exists():
    record = read_object(folder / BEST_FILE)
    if not isinstance(record.get("score"), (int, float)):
      raise _foreign("workdir", folder / BEST_FILE, "holds no numeric 'score'")
  events = folder / "tensorboard"
  if events.exists() and not events.is_dir():
    raise _foreign("workdir", events, "is a file, not a folder")
  for path in (folder / METRICS_FILE, events, folder / "checkpoints"):
    if path.exists() and not is_remote(workdir) and not os.access(path, os.W_OK):
      raise WorkdirError(f"workdir: {path} is not writable")


def architecture_differences(theirs: dict[str, Any], ours: dict[str, Any]) -> list[str]:
  """``model.<field>: <theirs> there, <ours> here`` for each :data:`ARCHITECTURE` field of
  two resolved model configs that differs."""
  return [f"model.{f}: {theirs.get(f)!r} there, {ours.get(f)!r} here" for f in ARCHITECTURE
          if theirs.get(f) != ours.get(f)]


def has_checkpoints(workdir: str) -> bool:
  directory = epath.Path(workdir) / "checkpoints"
  return directory.is_dir() and any(p.name.isdigit() for p in directory.iterdir())


def trained_to_the_end(workdir: str) -> bool:
  """Whether ``workdir``'s run finished training: its ``config.json``'s ``total_steps`` is a
  complete saved step (``checkpoints/<total_steps>``; Orbax writes a step under a temporary
  name and renames it when complete), whole or kept as final parameters only."""
  config = saved_config(workdir)
  steps = config.get("total_steps") if config else None
  return isinstance(steps, int) and (epath.Path(workdir) / "checkpoints" / str(steps)).is_dir()


def claim(workdir: str, config: ml_collections.ConfigDict) -> None:
  """Checks that ``config`` may run in ``workdir`` and records it in ``config.json``.

  Raises:
    TrainConfigError: ``workdir`` cannot be written, or holds another config's run
      (or checkpoints with no ``config.json``), or a file that is not a run's
      (:class:`WorkdirError`); the folder is left untouched.
  """
  current = resolved_config(config)
  path = epath.Path(workdir) / CONFIG_FILE
  try:
    check_output_dir("workdir", workdir)
  except OutputPathError as e:
    raise TrainConfigError(str(e)) from None
  saved = saved_config(workdir)
  check_files(workdir, config)
  if saved is not None:
    diffs = differences(saved, current)
    if diffs:
      more = f" (and {len(diffs) - 1} more)" if len(diffs) > 1 else ""
      raise TrainConfigError(f"workdir: {workdir} holds a run of another config: {diffs[0]}"
                             f"{more}; use a new --workdir (nothing there was changed)")
  elif has_checkpoints(workdir):
    raise TrainConfigError(f"workdir: {workdir} holds checkpoints but no {CONFIG_FILE}, so "
                           "their model is unknown; use a new --workdir (nothing there was "
                           "changed)")
  if jax.process_index() == 0:
    write_atomic(path, json.dumps(current, indent=2, sort_keys=True))
