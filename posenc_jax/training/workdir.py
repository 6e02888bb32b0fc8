"""A workdir belongs to the run that created it: ``<workdir>/config.json`` holds that run's
full resolved config, and only a run with the same config may resume there.

Fields that change how a run is carried out but not what it computes may
differ on resume (:data:`RESUMABLE`: the step budget, logging, checkpoint and
evaluation cadence, the mesh, the compilation cache, profiling, the attention
route). Anything else (the
model, the task, the batch, the optimizer) is refused with one line before
anything in the folder is touched.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import ml_collections
from etils import epath

from posenc_jax.models.config import model_config
from posenc_jax.training.config import TrainConfigError

CONFIG_FILE = "config.json"
RESUMABLE = ("total_steps", "log_every", "eval_every", "eval_steps", "checkpoint_every",
             "keep_checkpoints", "async_checkpointing", "mesh", "decode", "sweep",
             "compilation_cache_dir", "profile_steps", "model.route", "cache_data",
             "model.attention_precision")


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


def saved_config(workdir: str) -> dict[str, Any] | None:
  """The resolved config a ``train.py`` run recorded in ``<workdir>/config.json`` (None
  without one).

  Raises:
    TrainConfigError: the file does not read as JSON.
  """
  path = epath.Path(workdir) / CONFIG_FILE
  if not path.exists():
    return None
  try:
    saved = json.loads(path.read_text())
  except (OSError, ValueError) as e:
    raise TrainConfigError(f"workdir: {path} does not read as JSON ({e}); move it away to "
                           "reuse this workdir") from None
  if isinstance(saved.get("model"), dict):  # runs from before scan_layers were unrolled
    saved["model"].setdefault("scan_layers", False)
  return saved


def architecture_differences(theirs: dict[str, Any], ours: dict[str, Any]) -> list[str]:
  """``model.<field>: <theirs> there, <ours> here`` for each :data:`ARCHITECTURE` field of
  two resolved model configs that differs."""
  return [f"model.{f}: {theirs.get(f)!r} there, {ours.get(f)!r} here" for f in ARCHITECTURE
          if theirs.get(f) != ours.get(f)]


def has_checkpoints(workdir: str) -> bool:
  directory = epath.Path(workdir) / "checkpoints"
  return directory.is_dir() and any(p.name.isdigit() for p in directory.iterdir())


def claim(workdir: str, config: ml_collections.ConfigDict) -> None:
  """Checks that ``config`` may run in ``workdir`` and records it in ``config.json``.

  Raises:
    TrainConfigError: ``workdir`` cannot be written, or holds another config's run
      (or checkpoints with no ``config.json``); the folder is left untouched.
  """
  from posenc_jax.cli import OutputPathError, check_output_dir  # noqa: PLC0415

  current = resolved_config(config)
  path = epath.Path(workdir) / CONFIG_FILE
  try:
    check_output_dir("workdir", workdir)
  except OutputPathError as e:
    raise TrainConfigError(str(e)) from None
  saved = saved_config(workdir)
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
    tmp = path.parent / f"{CONFIG_FILE}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(current, indent=2, sort_keys=True))
    tmp.replace(path)  # atomic on a local disk: a reader sees the old file or the new one
