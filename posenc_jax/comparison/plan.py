"""The cells of an experiment (``configs/compare.py``) and the command lines that make each.

A cell is one ``(size, scheme, seed)``: its folder is ``ROOT/<scheme>/seed<k>``
(``ROOT/<size>,<scheme>/seed<k>`` with several sizes). Inside it each step has its own
workdir: ``train`` (the pre-training or LM run), ``<task>`` (a fine-tuning run from
``train``; or, for probes, the probe's training run), and the evaluate tool writes into
the workdir it scores. With ``pretrain_seeds`` (the fine-tuning protocol) only those seeds
pre-train; every other seed's cell fine-tunes from the first of them (``seed<first>/train``),
as DIET and TUPE fine-tune one pre-trained model per scheme with several seeds. Each
pre-trained model of the fine-tuning protocol is also scored by the evaluate tool's
``indicators`` (Wang et al.'s Table 2), where it has an ``[L, L]`` attention matrix to probe
(:func:`probed`: not Linformer's).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import ml_collections

from posenc_jax.messages import nearest
from posenc_jax.models.config import MATRIX_ATTENTIONS, ModelConfig
from posenc_jax.presets import POSITION_PRESETS, SCHEME_PRESETS, SIZES

PROTOCOLS = ("finetune", "extrapolation", "probes")
# A row is a position preset, optionally with modifiers: ``<scheme>+<modifier>``. A training
# modifier sets the train.py field of the same name to the experiment's value of it:
# ``rope+randomized_positions`` trains RoPE on randomized position ids drawn from
# ``[0, config.randomized_positions)`` (Ruoss et al. 2023) beside a plain ``rope`` row. A
# model modifier is the model preset of that name (posenc_jax.presets) added to the run's
# config spec after the scheme: ``diet_abs_share+segment_per_head`` pre-trains DIET-ABS with
# per-head segment attention beside a plain ``diet_abs_share`` row, whose segments are input
# embeddings (DIET Tables 5, 8).
TRAIN_MODIFIERS = ("randomized_positions",)
MODEL_MODIFIERS = ("segment_per_head",)
MODIFIERS = TRAIN_MODIFIERS + MODEL_MODIFIERS
# What a cell keeps (``config.keep``): its final parameters only, or all its checkpoints.
KEEP = ("params", "all")


class PlanError(ValueError):
  """An experiment config that cannot be planned; the message names the field."""


@dataclasses.dataclass(frozen=True)
class Step:
  """One command of a cell: ``argv`` (after ``python -m``) that writes ``workdir``; an
  evaluate step also names its ``evaluation``: ``(protocol, the evaluate tool's options)``;
  a training step whose checkpoints keep its final parameters only once the cell finished
  (``keep`` ``params``) has ``params_only``."""

  name: str
  workdir: str
  argv: tuple[str, ...]
  evaluation: tuple[str, dict[str, Any]] | None = None
  params_only: bool = False

  def command(self) -> list[str]:
    return [sys.executable, "-m", *self.argv]

  def overrides(self) -> dict[str, str]:
    """``{"optimizer.learning_rate": "3e-3", ...}``: the step's ``--config.<field>=`` flags."""
    return dict(a.removeprefix("--config.").split("=", 1) for a in self.argv
                if a.startswith("--config.") and "=" in a)


@dataclasses.dataclass(frozen=True)
class Cell:
  """One ``(size, scheme, seed)`` of the grid, made by ``steps`` in order, in ``folder``
  (``scheme``: the row, a preset with its modifiers)."""

  size: str
  scheme: str
  seed: int
  folder: str
  steps: tuple[Step, ...]

  @property
  def name(self) -> str:
    """``<scheme>/seed<k>`` (or ``<size>,<scheme>/seed<k>``): the folder under ROOT."""
    return self.folder.rstrip("/").rsplit("/", 2)[-2] + f"/seed{self.seed}"


def names(config: ml_collections.ConfigDict, field: str) -> list[str]:
  """The comma-separated list ``config.<field>``, without blanks."""
  return [n.strip() for n in str(config.get(field) or "").split(",") if n.strip()]


def integers(config: ml_collections.ConfigDict, field: str, *, positive: bool) -> list[int]:
  """``config.<field>`` as integers (> 0 with ``positive``, else >= 0), or one line naming it."""
  values = names(config, field)
  allowed = "positive" if positive else "non-negative"
  try:
    numbers = [int(v) for v in values]
  except ValueError:
    numbers = None
  if not values or numbers is None or min(numbers) < (1 if positive else 0):
    raise PlanError(f"{field}: got {config.get(field)!r}; allowed: comma-separated {allowed} "
                    "integers")
  if len(set(numbers)) != len(numbers):
    raise PlanError(f"{field}: got {config.get(field)!r}; each value once")
  return numbers


def lengths(config: ml_collections.ConfigDict) -> list[int]:
  """``config.lengths``: positive and increasing, or one line naming the field."""
  values = integers(config, "lengths", positive=True)
  if values != sorted(values):
    raise PlanError(f"lengths: got {config.lengths!r}; allowed: increasing lengths")
  return values


def _one_of(config, field: str, allowed) -> list[str]:
  values = names(config, field)
  if not values:
    raise PlanError(f"{field}: empty; allowed: comma-separated names of {', '.join(allowed)}")
  for value in values:
    if value not in allowed:
      raise PlanError(f"{field}: {value!r} is unknown{nearest(value, allowed)} allowed: "
                      f"{', '.join(allowed)}")
  return values


def scheme_of(row: str) -> str:
  """The position preset of a row: ``rope`` for ``rope`` and ``rope+randomized_positions``."""
  return row.split("+", 1)[0]


def presets_of(row: str) -> str:
  """The presets a row's config spec names after its size: the position preset, then each
  model modifier (``diet_abs_share,segment_per_head`` for ``diet_abs_share+segment_per_head``)."""
  scheme, *modifiers = row.split("+")
  return ",".join([scheme, *(m for m in modifiers if m in MODEL_MODIFIERS)])


def probed(row: str) -> bool:
  """Whether a row's pre-trained model has the property indicators (identical-word probing
  reads an ``[L, L]`` attention matrix: not Linformer's, over projected keys)."""
  attention = SCHEME_PRESETS[scheme_of(row)].get("attention", ModelConfig.attention)
  return attention in MATRIX_ATTENTIONS


def _has_preset(model: Any, preset: dict[str, Any]) -> bool:
  """Whether ``model`` (a config's model mapping) has every field of ``preset`` (a mapping
  value: every key of it)."""
  for key, value in preset.items():
    have = model.get(key) if hasattr(model, "get") else None
    if isinstance(value, dict):
      if not hasattr(have, "get") or any(have.get(k) != v for k, v in value.items()):
        return False
    elif have != value:
      return False
  return True


def row_name(scheme: str, train_config: Any) -> str:
  """The row of a run of ``scheme`` whose train.py config is ``train_config`` (a mapping):
  ``scheme``, then ``+<modifier>`` for each of :data:`TRAIN_MODIFIERS` the run set and each of
  :data:`MODEL_MODIFIERS` whose preset's fields its model has."""
  model = train_config.get("model") or {}
  return scheme + "".join(
      f"+{m}" for m in MODIFIERS
      if (train_config.get(m) is not None if m in TRAIN_MODIFIERS
          else _has_preset(model, SCHEME_PRESETS[m])))


def _rows(config) -> list[str]:
  rows = names(config, "schemes")
  if not rows:
    raise PlanError(f"schemes: empty; allowed: comma-separated names of "
                    f"{', '.join(POSITION_PRESETS)}, each optionally +{' +'.join(MODIFIERS)}")
  for row in rows:
    scheme, *modifiers = row.split("+")
    if scheme not in POSITION_PRESETS:
      raise PlanError(f"schemes: {scheme!r} is unknown{nearest(scheme, POSITION_PRESETS)} "
                      f"allowed: {', '.join(POSITION_PRESETS)}")
    for modifier in modifiers:
      if modifier not in MODIFIERS:
        raise PlanError(f"schemes: modifier {modifier!r} of {row!r} is unknown"
                        f"{nearest(modifier, MODIFIERS)} allowed: {', '.join(MODIFIERS)}")
      if modifier in TRAIN_MODIFIERS and config.get(modifier) is None:
        raise PlanError(f"{modifier}: unset, but row {row!r} needs its value (e.g. "
                        f"--config.{modifier}=...)")
  return rows


def _pretrain_seeds(config: ml_collections.ConfigDict, seeds: list[int]) -> list[int]:
  """``config.pretrain_seeds`` (empty or absent: every seed), checked against ``seeds``."""
  if not names(config, "pretrain_seeds"):
    return seeds
  if config.protocol != "finetune":
    raise PlanError(f"pretrain_seeds: got {config.pretrain_seeds!r} for the {config.protocol} "
                    "protocol; allowed: empty (only fine-tuning runs share a pre-training)")
  chosen = integers(config, "pretrain_seeds", positive=False)
  for seed in chosen:
    if seed not in seeds:
      raise PlanError(f"pretrain_seeds: {seed} is not among the seeds "
                      f"({', '.join(map(str, seeds))})")
  return [seed for seed in seeds if seed in chosen]


def check(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The experiment's lists, checked: ``{"protocol", "sizes", "schemes", "baseline", "seeds",
  "pretrain_seeds", "tasks", "task_schemes", "keep", "lengths"}`` (``task_schemes``: the
  rows of each task that names its own); raises :class:`PlanError` naming the
  first bad field."""
  if config.get("protocol") not in PROTOCOLS:
    raise PlanError(f"protocol: got {config.get('protocol')!r}; allowed: {', '.join(PROTOCOLS)}")
  schemes = _rows(config)
  baseline = config.get("baseline") or schemes[0]
  if baseline not in schemes:
    raise PlanError(f"baseline: {baseline!r} is not among the schemes{nearest(baseline, schemes)}"
                    f" schemes: {', '.join(schemes)}")
  keep = config.get("keep", KEEP[0])  # an experiment of a results.json from before the field
  if keep not in KEEP:
    raise PlanError(f"keep: got {keep!r}{nearest(keep, KEEP)} allowed: {', '.join(KEEP)}")
  checkpoint = config.evaluate.get("checkpoint")
  if keep == "params" and checkpoint not in (None, "latest", "best"):
    raise PlanError(f"evaluate.checkpoint: step {checkpoint} is not kept: a cell keeps its "
                    "final checkpoint only (keep 'params'); allowed: latest or best, or "
                    "--config.keep=all")
  seeds = integers(config, "seeds", positive=False)
  plan = {"protocol": config.protocol, "sizes": _one_of(config, "sizes", tuple(SIZES)),
          "schemes": schemes, "baseline": baseline, "seeds": seeds,
          "pretrain_seeds": _pretrain_seeds(config, seeds), "tasks": names(config, "tasks"),
          "keep": keep,
          "lengths": lengths(config) if config.protocol != "finetune" else []}
  randomized = config.get("randomized_positions")
  if (plan["lengths"] and randomized is not None and max(plan["lengths"]) > randomized
      and any("+randomized_positions" in row for row in schemes)):
    raise PlanError(f"randomized_positions: got {randomized}; allowed: at least the longest "
                    f"evaluated length ({max(plan['lengths'])}): a randomized row's position "
                    "ids are drawn from [0, N), so a longer evaluation reads ids it never "
                    "trained on (docs/evaluation.md)")
  if config.protocol != "extrapolation" and not plan["tasks"]:
    raise PlanError(f"tasks: empty; the {config.protocol} protocol runs one per task")
  for field in ("finetune_by_task", "task_schemes"):
    for task in config.get(field) or {}:
      if task not in plan["tasks"]:
        raise PlanError(f"{field}: task {task!r} is not among the tasks"
                        f"{nearest(task, plan['tasks'])} tasks: {', '.join(plan['tasks'])}")
  plan["task_schemes"] = {}
  for task in config.get("task_schemes") or {}:
    chosen = names(config.task_schemes, task)
    for row in chosen:
      if row not in schemes:
        raise PlanError(f"task_schemes.{task}: {row!r} is not among the schemes"
                        f"{nearest(row, schemes)} schemes: {', '.join(schemes)}")
    if not chosen:
      raise PlanError(f"task_schemes.{task}: empty; allowed: comma-separated schemes of the "
                      "grid (a task no scheme runs is left out of tasks)")
    plan["task_schemes"][task] = chosen
  for field in ("train_config", "finetune_config") if config.protocol == "finetune" else (
      "train_config",):
    if not config.get(field):
      raise PlanError(f"{field}: empty; allowed: a config spec such as configs/pretrain.py:"
                      "{size},{scheme}")
    fill_spec(field, config.get(field), size="", scheme="", task="")  # its fields are known
  return plan


SPEC_FIELDS = ("size", "scheme", "task")  # what a train_config or finetune_config names


def fill_spec(field: str, template: Any, **values: str) -> str:
  """The config spec ``template`` (of config field ``field``) with each ``{size}``,
  ``{scheme}`` and ``{task}`` replaced by ``values`` (``{{`` and ``}}`` are braces); any other
  replacement field (``{0}``, ``{scheme.__class__}``, ``{task!r}``, an unclosed brace) is one
  :class:`PlanError` line naming ``field``. Nothing else of Python's formatting is run."""
  import string  # noqa: PLC0415

  if not isinstance(template, str):
    raise PlanError(f"{field}: got {template!r}; allowed: a config spec (a string)")
  allowed = f"allowed fields: {', '.join('{' + f + '}' for f in SPEC_FIELDS)}"
  try:
    parts = list(string.Formatter().parse(template))
  except ValueError as e:
    raise PlanError(f"{field}: {template!r} is not a config spec ({e}); {allowed}") from None
  out = []
  for literal, name, spec, conversion in parts:
    out.append(literal)
    if name is None:
      continue
    if name not in SPEC_FIELDS or spec or conversion:
      given = "{" + name + (f"!{conversion}" if conversion else "") + (
          f":{spec}" if spec else "") + "}"
      raise PlanError(f"{field}: {given} in {template!r} is not a field it can name; {allowed}")
    out.append(values[name])
  return "".join(out)


def overrides(values: ml_collections.ConfigDict, prefix: str = "--config.") -> list[str]:
  """``--config.<a.b>=<value>`` for every leaf of ``values`` that is set (nested fields
  dotted)."""
  flags = []
  for key, value in values.items():
    if isinstance(value, ml_collections.ConfigDict):
      flags += overrides(value, f"{prefix}{key}.")
    elif value is not None:
      flags.append(f"{prefix}{key}={value}")
  return flags


def evaluate_options(config: ml_collections.ConfigDict) -> list[dict[str, Any]]:
  """The evaluate tool's options of each evaluation the experiment makes of a run: its
  ``evaluate`` fields, once per window kind when ``evaluate.windows`` lists several
  (``non_overlapping,sliding``; ``stride`` goes with ``sliding`` only)."""
  from posenc_jax.evaluation.windows import WINDOWS  # noqa: PLC0415 - numpy only

  options = {k: v for k, v in config.evaluate.to_dict().items() if v is not None}
  kinds = [w.strip() for w in str(options.pop("windows", "") or "").split(",") if w.strip()]
  for kind in kinds:
    if kind not in WINDOWS:
      raise PlanError(f"evaluate.windows: {kind!r} is unknown{nearest(kind, WINDOWS)} allowed: "
                      f"comma-separated names of {', '.join(WINDOWS)}")
  if "sliding" in kinds and options.get("stride") is None:
    raise PlanError("evaluate.stride: required with evaluate.windows 'sliding' (the tokens each "
                    "window scores)")
  if len(kinds) <= 1:
    return [options | ({"windows": kinds[0]} if kinds else {})]
  return [{k: v for k, v in options.items() if k != "stride" or kind == "sliding"}
          | {"windows": kind} for kind in kinds]


def _evaluate(workdir: str, protocol: str, lengths_: list[int], options: dict[str, Any]
              ) -> Step:
  argv = ("posenc_jax.evaluate", f"--workdir={workdir}", f"--protocol={protocol}",
          *([f"--lengths={','.join(map(str, lengths_))}"] if lengths_ else []),
          *(f"--{k}={v}" for k, v in options.items()))
  windows = f" ({options['windows']})" if "windows" in options else ""
  return Step(f"evaluate {protocol}{windows}", workdir, argv, (protocol, dict(options)))


def finetune_overrides(config: ml_collections.ConfigDict, task: str
                       ) -> ml_collections.ConfigDict:
  """The ``--config.<field>`` overrides of ``task``'s fine-tuning runs: ``finetune`` (every
  task's), then ``finetune_by_task.<task>`` over it (one task's budget)."""
  values = ml_collections.ConfigDict(config.finetune.to_dict())
  by_task = config.get("finetune_by_task") or {}
  if task in by_task:
    values.update(by_task[task].to_dict())
  return values


def _one_checkpoint(values: ml_collections.ConfigDict, params_only: bool) -> list[str]:
  """The flag that makes a training run keep one checkpoint (enough to resume it) when its
  cell keeps its final parameters only, unless ``values`` (the experiment's ``train`` or
  ``finetune``) sets ``keep_checkpoints`` itself."""
  return (["--config.keep_checkpoints=1"]
          if params_only and values.get("keep_checkpoints") is None else [])


def cells(config: ml_collections.ConfigDict, root: str) -> list[Cell]:
  """Every cell of the experiment under ``root``, sizes outermost, then schemes, then seeds."""
  plan = check(config)
  params_only = plan["keep"] == "params"
  out = []
  for size in plan["sizes"]:
    for scheme in plan["schemes"]:
      label = scheme if len(plan["sizes"]) == 1 else f"{size},{scheme}"
      for seed in plan["seeds"]:
        folder = f"{root.rstrip('/')}/{label}/seed{seed}"
        fill = dict(size=size, scheme=presets_of(scheme))
        train = overrides(config.train) + [f"--config.seed={seed}"] + [
            f"--config.{m}={config.get(m)}" for m in scheme.split("+")[1:]
            if m in TRAIN_MODIFIERS] + _one_checkpoint(config.train, params_only)
        steps = []
        if plan["protocol"] == "probes":
          for task in plan["tasks"]:
            workdir = f"{folder}/{task}"
            spec = fill_spec("train_config", config.train_config, **fill, task=task)
            steps.append(Step(f"train {task}", workdir, ("posenc_jax.train", f"--config={spec}",
                                                         f"--workdir={workdir}", *train),
                              params_only=params_only))
            steps += [_evaluate(workdir, "probes", plan["lengths"], options)
                      for options in evaluate_options(config)]
        elif seed in plan["pretrain_seeds"]:
          workdir = f"{folder}/train"
          spec = fill_spec("train_config", config.train_config, **fill, task="")
          steps.append(Step("train", workdir, ("posenc_jax.train", f"--config={spec}",
                                               f"--workdir={workdir}", *train),
                            params_only=params_only))
          if plan["protocol"] == "finetune" and probed(scheme):  # Wang et al.'s Table 2
            steps.append(_evaluate(workdir, "indicators", [], {}))
        else:  # fine-tunes the first pre-training seed's model (made earlier in this order)
          workdir = f"{root.rstrip('/')}/{label}/seed{plan['pretrain_seeds'][0]}/train"
        if plan["protocol"] == "extrapolation":
          steps += [_evaluate(workdir, "extrapolation", plan["lengths"], options)
                    for options in evaluate_options(config)]
        if plan["protocol"] == "finetune":
          for task in plan["tasks"]:
            if scheme not in plan["task_schemes"].get(task, plan["schemes"]):
              continue
            spec = fill_spec("finetune_config", config.finetune_config, **fill, task=task)
            budget = finetune_overrides(config, task)
            steps.append(Step(f"finetune {task}", f"{folder}/{task}", (
                "posenc_jax.finetune", f"--config={spec}", f"--init_checkpoint={workdir}",
                f"--workdir={folder}/{task}", *overrides(budget),
                f"--config.seed={seed}", *_one_checkpoint(budget, params_only)),
                params_only=params_only))
        out.append(Cell(size, scheme, seed, folder, tuple(steps)))
  return out


def groups(cells: list[Cell]) -> list[list[int]]:
  """The cells (indices into ``cells``) that must run in order, one after another: a cell
  that fine-tunes another cell's pre-trained model (``pretrain_seeds``) joins that cell's
  group. Each group in the cells' order, its cells too; groups can run at once (a job
  array's task, a slot of ``compare --parallel``)."""
  made = {step.workdir: index for index, cell in enumerate(cells) for step in cell.steps
          if step.name == "train"}
  owner = list(range(len(cells)))
  for index, cell in enumerate(cells):
    for step in cell.steps:
      for arg in step.argv:
        source = made.get(arg.partition("=")[2]) if arg.startswith("--init_checkpoint=") else None
        if source is not None and source != index:
          owner[index] = owner[source]
  out: dict[int, list[int]] = {}
  for index, root in enumerate(owner):
    out.setdefault(root, []).append(index)
  return list(out.values())

