"""Records of finished runs, read from their workdirs through ``etils.epath`` (so ``gs://``
folders read as local ones): each train.py or finetune.py workdir found under the folders
given becomes one record.

A record is ``{"workdir", "size", "scheme", "seed", "task", "objective", "steps", "model",
"best", "eval", "curve", "chance_score"}``: ``size`` and ``scheme`` are the preset names whose
fields the run's ``config.json`` model has (:func:`posenc_jax.presets.preset_name`; ``scheme``
with the training modifiers the run set, :func:`~posenc_jax.comparison.plan.row_name`),
``steps`` its ``total_steps``, ``model`` its ``d_model``, ``num_layers`` and ``num_heads``,
``best`` the best evaluation (``best.json``, else the highest ``best_metric`` in
``metrics.jsonl``), ``eval`` the evaluate tool's documents by file name
(``eval/<protocol>-<settings>.json`` without ``.json``), ``curve`` a pre-training run's
held-out evaluations (:func:`eval_curve`; None for other runs), ``chance_score`` a fine-tuning
run's majority-class score on the 0-100 scale of ``best`` (None where its config has none).

These files come from elsewhere (``config.json``, ``best.json``, ``metrics.jsonl``,
``eval/*.json``, and a compare ROOT's ``cell.json``, ``cost.json`` and ``results.json``): a
field of the wrong kind (a score that is no number, an evaluation without ``settings`` or
``rows``, a scheme that is no object) is one :class:`CollectError` line naming the file and
the field, raised before anything is written. :func:`evaluations` groups the documents into
tables, one per protocol, task and settings, and refuses runs of one table evaluated with
different settings.
"""

from __future__ import annotations

import math
import re
from typing import Any

import ml_collections
from etils import epath

from posenc_jax import foreign
from posenc_jax.comparison import plan
from posenc_jax.data import probes
from posenc_jax.presets import scheme_name, size_name
from posenc_jax.training.workdir import (CONFIG_FILE, METRICS_FILE, WorkdirError, read_metrics,
                                         saved_config)

# Folders a run writes that hold no other run.
RUN_PARTS = ("checkpoints", "best", "tensorboard", "eval")
MAX_DEPTH = 4
CURVES = ("extrapolation", "probes")  # the evaluate tool's protocols that make tables
PRETRAINING_OBJECTIVES = ("mlm",)  # the runs a record reads the eval curve of
# A curve point's numbers beside its step (the perplexities absent from older runs' lines).
CURVE_FIELDS = ("eval_loss", "eval_perplexity", "eval_unigram_perplexity")
MODEL_FIELDS = ("d_model", "num_layers", "num_heads")  # a record's ``model``


class CollectError(ValueError):
  """A folder that holds no run, or a run that does not read; the message names it."""


def _json(path: epath.Path) -> Any:
  try:
    return foreign.loads(path.read_text())
  except (OSError, ValueError) as e:
    raise CollectError(f"collect: {path} does not read as JSON ({e})") from None


# The largest magnitude of a number (a score, loss, perplexity, ratio, seconds) and of an
# integer (a step, length, seed, token count) a run's files may hold: far beyond any a run
# writes, and within what a table, a ratio or a plot computes with (1e308 and 10**30 are not).
MAX_NUMBER = 1e12
MAX_INTEGER = 2**53

# What a field may hold: its kind's test and its name in an error.
KINDS = {
    "number": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
               and math.isfinite(v) and abs(v) <= MAX_NUMBER,
               "a finite number within ±1e12"),
    "integer": (lambda v: isinstance(v, int) and not isinstance(v, bool)
                and abs(v) <= MAX_INTEGER, "an integer within ±2**53"),
    "length": (lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 < v <= 2**31,
               "a positive integer at most 2**31"),
    "string": (lambda v: isinstance(v, str), "a string"),
    "object": (lambda v: isinstance(v, dict), "a JSON object"),
    "list": (lambda v: isinstance(v, list), "a list"),
}


def field(path: Any, data: Any, name: str, kind: str, *, null: bool = False,
          optional: bool = False, where: str = "") -> Any:
  """``data[name]`` after checking it is of ``kind`` (a key of :data:`KINDS`; or None with
  ``null``), else one :class:`CollectError` line naming ``path`` and the field (``where``:
  its place, e.g. ``rows[2].``); with ``optional``, None where ``data`` lacks it (a file
  from before the field)."""
  test, expected = KINDS[kind]
  if not isinstance(data, dict):
    raise CollectError(f"collect: {path}: {where.rstrip('. ') or 'the file'} holds "
                       f"{type(data).__name__}; expected a JSON object")
  if name not in data:
    if optional:
      return None
    raise CollectError(f"collect: {path}: {where}{name}: missing; expected {expected}")
  value = data[name]
  if not (test(value) or (null and value is None)):
    raise CollectError(f"collect: {path}: {where}{name}: got {value!r}; expected {expected}"
                       + (" or null" if null else ""))
  return value


def check_scheme(path: Any, model: dict[str, Any]) -> None:
  """``model`` (``path``'s ``model`` object) has the ``scheme`` a record is named by: an
  object with a ``name``, or a list of them (schemes composed); else one
  :class:`CollectError` line naming the file and the field."""
  scheme = model.get("scheme")
  if isinstance(scheme, list):
    for index, part in enumerate(scheme):
      field(path, part, "name", "string", where=f"model.scheme[{index}].")
  else:
    field(path, field(path, model, "scheme", "object", where="model."), "name", "string",
          where="model.scheme.")


def recorded_seconds(path: epath.Path) -> float:
  """The ``seconds`` that a compare ROOT's ``cell.json`` or ``cost.json`` at ``path``
  records (0 where it records none), checked as :func:`field` does."""
  doc = _json(path)
  if isinstance(doc, dict) and "seconds" not in doc:
    return 0.0
  return float(field(path, doc, "seconds", "number"))


def _metrics(path: epath.Path) -> list[tuple[int, dict[str, Any]]]:
  """The records of the ``metrics.jsonl`` at ``path``: ``[(step, its JSON object)]``, read
  by the trainer's reader (a torn last line, a run killed mid-write, is left out)."""
  try:
    records, _ = read_metrics(path)
  except WorkdirError as e:
    raise CollectError(f"collect: {e}") from None
  return [(step, foreign.loads(line)) for step, line in records]  # each an object with a step


def eval_curve(workdir: epath.Path) -> list[dict[str, Any]]:
  """The held-out evaluations in a pre-training run's ``metrics.jsonl``, in its order (steps
  rising: a resumed run truncates what came after its checkpoint): ``[{"step",
  "eval_loss", "eval_perplexity", "eval_unigram_perplexity"}]`` of each line with an
  ``eval_loss``; the last two None where the line lacks them (a run from before they were
  written)."""
  path = workdir / METRICS_FILE
  return [{"step": step} | {name: field(path, row, name, "number", optional=True,
                                        where=f"step {step}: ") for name in CURVE_FIELDS}
          for step, row in _metrics(path) if "eval_loss" in row]


def best_score(workdir: epath.Path, metric: str | None) -> dict[str, Any] | None:
  """``{"step", "metric", "score"}`` of the run's best evaluation, or None without one."""
  path = workdir / "best.json"
  if path.exists():
    best = _json(path)
    field(path, best, "step", "integer")
    field(path, best, "metric", "string")
    field(path, best, "score", "number")
    return best
  if not metric:
    return None
  path = workdir / METRICS_FILE
  rows = []
  for step, row in _metrics(path):
    if metric in row:
      field(path, row, metric, "number", where=f"step {step}: ")
      rows.append(row)
  if not rows:
    return None
  top = max(rows, key=lambda r: r[metric])
  return {"step": top["step"], "metric": metric, "score": top[metric]}


def check_evaluation(path: epath.Path, doc: Any) -> dict[str, Any]:
  """``doc`` (read from ``path``) after checking the fields the tables read: every
  document's ``protocol`` and ``settings``; an extrapolation or probes document's lengths
  and values; an indicators document's length, examples, paper row and the six values of
  Wang et al.'s Table 2 (:mod:`posenc_jax.evaluation.protocols`)."""
  protocol = field(path, doc, "protocol", "string")
  field(path, doc, "settings", "object")
  if protocol == "indicators":
    from posenc_jax.analysis.indicators import TABLE2_COLUMNS  # noqa: PLC0415
    for name in ("length", "examples"):
      field(path, doc, name, "length")
    field(path, doc, "paper_row", "string", null=True)
    values = field(path, doc, "indicators", "object")
    for name in TABLE2_COLUMNS:
      field(path, values, name, "number", where="indicators.")
    return doc
  if protocol not in CURVES:
    return doc
  field(path, doc, "train_length", "length")
  key = "value" if protocol == "extrapolation" else "accuracy"
  if protocol == "extrapolation":
    field(path, doc, "metric", "string")
    for name in ("split", "windows"):
      field(path, doc, name, "string")
    field(path, doc, "tokens", "length")
    field(path, doc, "stride", "length", null=True)
    field(path, doc, "unigram", "number", null=True)
    field(path, doc, "unigram_train_tokens", "integer", null=True)
    field(path, doc, "corpus_sha256", "string", null=True)
  else:
    field(path, doc, "examples", "length")
    field(path, doc, "seed", "integer")
    field(path, field(path, doc, "probe", "object"), "name", "string", where="probe.")
    try:
      probes.probe(doc["probe"])
    except probes.ProbeError as e:
      raise CollectError(f"collect: {path}: {e}") from None
  for index, row in enumerate(field(path, doc, "rows", "list")):
    where = f"rows[{index}]."
    field(path, row, "length", "length", where=where)
    field(path, row, key, "number", null=True, where=where)
    field(path, row, "na", "string", null=True, where=where)
    if protocol == "probes":
      field(path, row, "token_accuracy", "number", null=True, where=where)
      field(path, row, "chance", "number", null=True, where=where)
  return doc


def read_run(workdir: str | epath.Path) -> dict[str, Any]:
  """The record of the run in ``workdir`` (which has a ``config.json``)."""
  folder = epath.Path(workdir)
  try:
    config = saved_config(str(folder))
  except WorkdirError as e:
    raise CollectError(f"collect: {e}") from None
  if config is None:
    raise CollectError(f"collect: {folder} is no train.py workdir (no {CONFIG_FILE})")
  path = folder / CONFIG_FILE
  model = field(path, config, "model", "object")
  check_scheme(path, model)
  evals = {}
  if (folder / "eval").is_dir():
    for item in sorted((folder / "eval").iterdir(), key=lambda p: p.name):
      if item.name.endswith(".json"):
        evals[item.name[:-len(".json")]] = check_evaluation(item, _json(item))
  objective = field(path, config, "objective", "string")
  return {"workdir": str(folder), "size": size_name(model),
          "scheme": plan.row_name(scheme_name(model), config),
          "seed": field(path, config, "seed", "integer"),
          "task": field(path, config, "task", "string"), "objective": objective,
          "steps": field(path, config, "total_steps", "integer", null=True),
          "model": {k: field(path, model, k, "integer", null=True, where="model.")
                    for k in MODEL_FIELDS},
          "best": best_score(folder, config.get("best_metric")), "eval": evals,
          "curve": eval_curve(folder) if objective in PRETRAINING_OBJECTIVES else None,
          "chance_score": field(path, config, "chance_score", "number", null=True,
                                optional=True)}


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
    CollectError: a folder that does not exist or holds no workdir, named; a file of a run
      that does not read, named with its field.
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


def read_cost(path: epath.Path) -> dict[str, Any]:
  """A compare ROOT's ``cost.json`` (:func:`posenc_jax.comparison.cost.measure`), its rows
  checked."""
  cost = _json(path)
  field(path, cost, "baseline", "string", null=True)
  for scheme, row in field(path, cost, "rows", "object").items():
    where = f"rows.{scheme}."
    if isinstance(row, dict) and "na" in row:
      field(path, row, "na", "string", where=where)
      continue
    field(path, row, "model", "string", where=where)
    for length, at in field(path, row, "lengths", "object", where=where).items():
      field(path, at, "memory_ratio", "number", null=True, where=f"{where}lengths.{length}.")
      for kind in ("train_ratio", "infer_ratio"):  # inference: timed since 2026-11-29
        if kind == "infer_ratio" and kind not in at:
          continue
        for name in ("median", "min", "max"):
          field(path, field(path, at, kind, "object", where=f"{where}lengths.{length}."),
                name, "number", where=f"{where}lengths.{length}.{kind}.")
  noise = field(path, cost, "noise", "object") if "noise" in cost else {}
  for length, noise in noise.items():
    for name in ("median", "min", "max"):
      field(path, noise, name, "number", where=f"noise.{length}.")
  return cost


def kept_experiment(path: epath.Path) -> ml_collections.ConfigDict | None:
  """The experiment config of an earlier ``results.json`` at ``path`` (None without the file
  or an experiment in it), checked as :func:`posenc_jax.comparison.plan.check` does."""
  if not path.exists():
    return None
  config = field(path, _json(path), "config", "object", null=True)
  if config is None:
    return None
  field(path, config, "experiment", "string", where="config.")
  field(path, config, "evaluate", "object", where="config.")
  config = ml_collections.ConfigDict(config)
  try:
    plan.check(config)
  except plan.PlanError as e:  # a field given an object shows it over lines: one line
    line = re.sub(r"\s*\n\s*", " ", str(e).strip()).replace(" ;", ";")
    raise CollectError(f"collect: {path}: config.{line}") from None
  return config


def _differing(a: dict[str, Any], b: dict[str, Any]) -> tuple[str, str]:
  """The settings where ``a`` and ``b`` differ, as ``name=value,...`` of each."""
  names = [n for n in dict.fromkeys([*a, *b]) if a.get(n) != b.get(n)]
  return tuple(",".join(f"{n}={s.get(n)}" for n in names) for s in (a, b))


def evaluations(records: list[dict[str, Any]], protocol: str | None = None,
                evaluate: list[dict[str, Any]] | None = None
                ) -> dict[tuple[str, str, str], list[tuple[dict, dict]]]:
  """The records' extrapolation and probes documents by table: ``{(protocol, task, settings
  key): [(record, document), ...]}`` (records in order, one document each).

  Without an experiment (``protocol`` None) a table is every settings that all the runs of a
  protocol and task were evaluated with. With one (its ``protocol`` and the options of each
  of its evaluations, :func:`~posenc_jax.comparison.plan.evaluate_options`), each run's
  document of the settings each evaluation asks for
  (:func:`~posenc_jax.evaluation.protocols.protocol_settings`), and every run must have them.

  Raises:
    CollectError: runs of one protocol and task evaluated with different settings (one line
      naming two workdirs and the setting), or a run without the experiment's.
  """
  from posenc_jax.evaluation.report import settings_key  # noqa: PLC0415
  from posenc_jax.evaluation.protocols import SETTINGS, protocol_settings  # noqa: PLC0415

  members = {}  # (protocol, task) -> [(record, {settings key: document})]
  for record in records:
    mine = {}
    for doc in record["eval"].values():
      if doc["protocol"] in CURVES:
        mine.setdefault(doc["protocol"], {})[settings_key(doc["settings"])] = doc
    if protocol in CURVES and protocol not in mine:
      mine[protocol] = {}
    for name, docs in mine.items():
      members.setdefault((name, record["task"]), []).append((record, docs))
  groups = {}
  for (name, task), runs in sorted(members.items()):
    if protocol is not None:
      for record, docs in runs:
        for options in evaluate or [{}]:
          key = settings_key(protocol_settings(name, {"objective": record["objective"]}, **{
              k: options.get(k) for k in SETTINGS[name]}))
          if key not in docs:
            have = "; ".join(docs) or "none"
            raise CollectError(f"collect: {record['workdir']}: no {name} evaluation with the "
                               f"experiment's settings {key} (it has: {have}); run the "
                               "evaluate tool with them")
          groups.setdefault((name, task, key), []).append((record, docs[key]))
      continue
    first = runs[0]
    for run in runs[1:]:
      # Settings the first run has and this one lacks, else the other way round.
      alone = sorted(set(first[1]) - set(run[1])) or sorted(set(run[1]) - set(first[1]))
      if alone:
        (one, ones), (other, others) = (first, run) if alone[0] in first[1] else (run, first)
        mine, theirs = _differing(ones[alone[0]]["settings"],
                                  next(iter(others.values()))["settings"])
        raise CollectError(f"collect: runs of one {name} table ({task}) were evaluated with "
                           f"different settings: {one['workdir']} has {mine}, "
                           f"{other['workdir']} has {theirs}; evaluate every run alike or "
                           "pass the experiment's --config")
    for key in sorted(first[1]):
      groups[(name, task, key)] = [(record, docs[key]) for record, docs in runs]
  return groups
