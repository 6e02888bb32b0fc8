"""Records of finished runs, read from their workdirs through ``etils.epath`` (so ``gs://``
folders read as local ones): each train.py or finetune.py workdir found under the folders
given becomes one record.

A record is ``{"workdir", "size", "scheme", "seed", "task", "objective", "best", "eval"}``:
``size`` and ``scheme`` are the preset names whose fields the run's ``config.json`` model
has (:func:`preset_name`), ``best`` the best evaluation (``best.json``, else the highest
``best_metric`` in ``metrics.jsonl``), ``eval`` the evaluate tool's documents by protocol
(``eval/<protocol>.json``).
"""

from __future__ import annotations

import json
from typing import Any

from etils import epath

from posenc_jax.presets import POSITION_PRESETS, SCHEME_PRESETS, SIZES
from posenc_jax.training.workdir import CONFIG_FILE, WorkdirError, read_metrics, saved_config

# Folders a run writes that hold no other run.
RUN_PARTS = ("checkpoints", "best", "tensorboard", "eval")
MAX_DEPTH = 4


class CollectError(ValueError):
  """A folder that holds no run, or a run that does not read; the message names it."""


def preset_name(model: dict[str, Any], presets: dict[str, dict], default: str) -> str:
  """The name of the preset of ``presets`` whose every field ``model`` has (a scheme's given
  fields included), the one with the most fields if several do; else ``default``."""
  def fits(preset):
    for key, value in preset.items():
      have = model.get(key)
      if isinstance(value, dict):
        if not isinstance(have, dict) or any(have.get(k) != v for k, v in value.items()):
          return False
      elif have != value:
        return False
    return True

  def fields(preset):
    return sum(len(v) if isinstance(v, dict) else 1 for v in preset.values())

  matches = [name for name, preset in presets.items() if fits(preset)]
  return max(matches, key=lambda n: fields(presets[n])) if matches else default


def _json(path: epath.Path) -> Any:
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError) as e:
    raise CollectError(f"collect: {path} does not read as JSON ({e})") from None


def best_score(workdir: epath.Path, metric: str | None) -> dict[str, Any] | None:
  """``{"step", "metric", "score"}`` of the run's best evaluation, or None without one."""
  if (workdir / "best.json").exists():
    return _json(workdir / "best.json")
  if not metric:
    return None
  try:  # the trainer's reader: a torn last line (a run killed mid-write) is left out
    records, _ = read_metrics(workdir / "metrics.jsonl")
  except WorkdirError as e:
    raise CollectError(f"collect: {e}") from None
  rows = [r for r in (json.loads(line) for _, line in records) if metric in r]
  if not rows:
    return None
  top = max(rows, key=lambda r: r[metric])
  return {"step": top["step"], "metric": metric, "score": top[metric]}


def read_run(workdir: str | epath.Path) -> dict[str, Any]:
  """The record of the run in ``workdir`` (which has a ``config.json``)."""
  folder = epath.Path(workdir)
  try:
    config = saved_config(str(folder))
  except WorkdirError as e:
    raise CollectError(f"collect: {e}") from None
  if config is None:
    raise CollectError(f"collect: {folder} is no train.py workdir (no {CONFIG_FILE})")
  model = config.get("model") or {}
  scheme_presets = {n: SCHEME_PRESETS[n] for n in POSITION_PRESETS}
  size_presets = {n: {k: p[k] for k in ("d_model", "num_layers", "num_heads", "mlp_dim")
                      if k in p} for n, p in SIZES.items()}
  evals = {}
  if (folder / "eval").is_dir():
    for path in sorted((folder / "eval").iterdir(), key=lambda p: p.name):
      if path.name.endswith(".json"):
        evals[path.name[:-len(".json")]] = _json(path)
  return {"workdir": str(folder),
          "size": preset_name(model, size_presets, f"d{model.get('d_model')}"
                              f"L{model.get('num_layers')}"),
          "scheme": preset_name(model, scheme_presets, str((model.get("scheme") or {})
                                                            .get("name"))),
          "seed": config.get("seed"), "task": config.get("task"),
          "objective": config.get("objective"),
          "best": best_score(folder, config.get("best_metric")), "eval": evals}


def find_runs(folder: str | epath.Path, depth: int = 0) -> list[epath.Path]:
  """The workdirs (folders with a ``config.json``) at or under ``folder``, sorted."""
  folder = epath.Path(folder)
  if (folder / CONFIG_FILE).exists():
    return [folder]
  if depth >= MAX_DEPTH or not folder.is_dir():
    return []
  runs = []
  for child in sorted(folder.iterdir(), key=lambda p: p.name):
    if child.is_dir() and child.name not in RUN_PARTS:
      runs += find_runs(child, depth + 1)
  return runs


def collect(folders: list[str]) -> list[dict[str, Any]]:
  """The records of every run at or under each of ``folders``.

  Raises:
    CollectError: a folder that does not exist or holds no workdir, named.
  """
  records = []
  for folder in folders:
    if not epath.Path(folder).exists():
      raise CollectError(f"collect: {folder!r} does not exist")
    runs = find_runs(folder)
    if not runs:
      raise CollectError(f"collect: {folder!r} holds no train.py or finetune.py workdir (no "
                         f"{CONFIG_FILE} in it or in its subfolders)")
    records += [read_run(run) for run in runs]
  return records
