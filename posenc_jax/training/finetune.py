"""Fine-tuning: start from a pre-trained encoder, train a task head, keep the best checkpoint,
and sweep seeds x learning rates for the papers' statistic.

A pre-trained encoder comes from a ``train.py`` workdir (its newest Orbax
checkpoint; the encoder is the ``bert`` subtree of the MLM model) or from a
Hugging Face BERT folder (``config.json`` present; read by
:func:`posenc_jax.convert.load_hf_bert`). The model's architecture is the
checkpoint's (:func:`adopt_checkpoint_model`: a config argument with no
presets takes it from the checkpoint's ``config.json``; named presets that
differ are refused with one ``model.<field>`` line unless
``config.reinitialise``). Every encoder parameter whose path and shape match is
copied; the rest (the task head, a per-head segment scheme switched on for
sentence pairs as DIET did, a swapped-in position scheme under
``reinitialise``) keep their fresh initialisation, and the report says which.
Any other difference (another size, layer count or vocabulary) is refused with
one line naming ``init_checkpoint``, the first parameter that differs and the
``model.<field>`` to set.

:func:`check_finetune` runs first and rejects, with one line naming the field,
what would otherwise go wrong silently or late: a ``num_labels`` other than
the task's label count, an unregistered task or split, a ``best_metric`` the
evaluation does not report, a sweep without seeds or learning rates.

The sweep reports what DIET reports: for each learning rate the median over
seeds of each run's best evaluation score, and the best of those medians.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import statistics
from typing import Any

import jax
import ml_collections
import numpy as np
from etils import epath
from flax import traverse_util

from posenc_jax.messages import nearest
from posenc_jax.models.scan import layout_for, match_layout
from posenc_jax.training.config import TrainConfigError, validate_train_config
from posenc_jax.training.input_pipeline import FINETUNE_FEATURES
from posenc_jax.training.workdir import (ARCHITECTURE, architecture_differences, resolved_model,
                                         saved_config, saved_model)

# Encoder parameters that may differ in shape, be fresh or go unused: the position and segment
# schemes (one swapped in; per-head segments for pairs). The pooler may also be absent.
SCHEMES = ("position/", "segment/")
OPTIONAL = SCHEMES + ("pooler/",)
# Size fields read off parameter shapes, in the order a mismatch is explained by them.
SIZE_FIELDS = ("num_layers", "vocab_size", "d_model", "num_heads", "mlp_dim")


@dataclasses.dataclass
class InitReport:
  """Which encoder parameters came from the pre-trained model.

  Attributes:
    source: the checkpoint path.
    loaded: parameter paths copied.
    fresh: target paths left freshly initialised.
    unused: source paths with no slot (or another shape) in the target.
  """

  source: str
  loaded: list[str] = dataclasses.field(default_factory=list)
  fresh: list[str] = dataclasses.field(default_factory=list)
  unused: list[str] = dataclasses.field(default_factory=list)

  def summary(self) -> str:
    return (f"{self.source}: {len(self.loaded)} encoder parameters loaded; fresh: "
            f"{', '.join(self.fresh) or 'none'}; unused: {', '.join(self.unused) or 'none'}")


def hf_encoder(path: str) -> dict[str, Any]:
  """The encoder parameters of the Hugging Face folder ``path``, read with its own
  ``config.json`` (so that :func:`merge_encoder` compares sizes): only the tensors it holds.

  Raises:
    ConversionError: ``init_checkpoint: <file>: <problem>`` (not JSON, a field missing, a
      truncated ``model.safetensors``, a tensor of the wrong shape).
  """
  from flax import linen as nn  # noqa: PLC0415

  from posenc_jax.convert.hf_bert import ConversionError, load_hf_bert  # noqa: PLC0415
  try:
    _, variables, report = load_hf_bert(path)
  except ConversionError as e:
    raise ConversionError(f"init_checkpoint: {e}") from None
  # The report names unrolled paths (layers_i/...).
  flat = traverse_util.flatten_dict(layout_for(nn.unbox(variables["params"]), False), sep="/")
  return traverse_util.unflatten_dict({p: v for p, v in flat.items() if p in report.loaded},
                                      sep="/")


def is_train_workdir(path: str) -> bool:
  """``path`` (local or an epath URI) is a ``train.py`` workdir: it has ``checkpoints/``."""
  return (epath.Path(path) / "checkpoints").is_dir()


def not_an_encoder(path: str, layers: int) -> TrainConfigError:
  """The one ``init_checkpoint`` line for a checkpoint of the causal language model (head
  ``lm``: decoder-only, ``layers`` decoder layers), which holds no encoder to fine-tune."""
  return TrainConfigError(
      f"init_checkpoint: {path!r} holds a causal language model (decoder-only, {layers} "
      "decoder layers), not a BERT encoder; fine-tune from a masked-LM train.py workdir "
      "(configs/pretrain.py) or a Hugging Face BERT folder")


def check_init_checkpoint(path: str) -> None:
  """Raises one line naming ``init_checkpoint`` (and the file at fault) unless ``path`` is a
  folder that holds an encoder: a ``train.py`` workdir (``checkpoints/``) whose
  ``config.json``, where there is one, reads and is not a causal language model's, or a
  Hugging Face folder whose ``config.json`` reads as a JSON object.

  Raises:
    TrainConfigError: a file, a folder that is neither, an unreadable workdir
      ``config.json`` (:class:`~posenc_jax.training.workdir.WorkdirError`), a language model.
    ConversionError: a Hugging Face ``config.json`` that is empty or not a JSON object.
  """
  folder = epath.Path(path)
  if not folder.is_dir():
    raise TrainConfigError(f"init_checkpoint: {path!r} is a file; allowed: a train.py "
                           "workdir (with checkpoints/) or a Hugging Face BERT folder "
                           "(config.json, model.safetensors, vocab.txt)")
  if is_train_workdir(path):
    saved = saved_config(path, "init_checkpoint")
    if saved is not None and saved.get("head") == "lm":
      raise not_an_encoder(path, saved["model"].get("num_layers"))
    return
  if not (folder / "config.json").exists():
    raise TrainConfigError(f"init_checkpoint: {path!r} is neither a train.py workdir (no "
                           "checkpoints/) nor a Hugging Face folder (no config.json)")
  from posenc_jax.convert.hf_bert import ConversionError, read_hf_config  # noqa: PLC0415
  try:
    read_hf_config(path)
  except ConversionError as e:
    raise ConversionError(f"init_checkpoint: {e}") from None


def pretrained_encoder(path: str) -> dict[str, Any]:
  """The encoder parameters (``BertEncoder`` layout, plain arrays) stored at ``path``: a
  ``train.py`` workdir (``checkpoints/``; its ``config.json`` is the run's) or else a Hugging
  Face folder (``config.json``), checked first (:func:`check_init_checkpoint`)."""
  check_init_checkpoint(path)
  if not is_train_workdir(path):
    return hf_encoder(path)
  from posenc_jax.training.checkpoint import CheckpointError, restore_params  # noqa: PLC0415

  try:  # the newest checkpoint that restores and verifies; damaged ones are skipped
    _, params = restore_params(path, field="init_checkpoint")
  except CheckpointError as e:
    raise TrainConfigError(str(e)) from None
  params = jax.device_get(params)
  if "bert" not in params and "decoder" in params and "encoder" not in params:
    layers = encoder_sizes(traverse_util.flatten_dict(params["decoder"], sep="/"))
    raise not_an_encoder(path, layers.get("num_layers", 0))
  return params["bert"] if "bert" in params else params


def checkpoint_model(path: str) -> dict[str, Any] | None:
  """The resolved model config of the encoder at ``path``: a ``train.py`` workdir's
  ``config.json`` model, or a Hugging Face folder's ``config.json`` mapped by
  :func:`~posenc_jax.convert.hf_bert.config_from_hf`; None for a workdir without one."""
  if is_train_workdir(path):
    return saved_model(path, "init_checkpoint")
  from posenc_jax.convert.hf_bert import (ConversionError, config_from_hf,  # noqa: PLC0415
                                          read_hf_config)

  try:
    return resolved_model(config_from_hf(read_hf_config(path)))
  except ConversionError as e:
    raise ConversionError(f"init_checkpoint: {e}") from None


def adopt_checkpoint_model(config: ml_collections.ConfigDict, init_checkpoint: str) -> None:
  """Makes ``config.model`` the pre-trained encoder's architecture (``ARCHITECTURE`` fields).

  With no presets in the config argument (``config.presets`` None) the fields are taken from
  the checkpoint (:func:`checkpoint_model`). Presets that give another architecture are one
  ``model.<field>`` line, unless ``config.reinitialise`` is set: then the parameters that do
  not fit start from scratch (a swapped-in position scheme, say) and the report names them.
  """
  theirs = checkpoint_model(init_checkpoint)
  if theirs is None:
    return
  if config.get("presets") is None:
    for field in ARCHITECTURE:
      config.model[field] = theirs[field]
    return
  diffs = architecture_differences(theirs, resolved_model(config.model))
  if diffs and not config.get("reinitialise"):
    more = f" (and {len(diffs) - 1} more)" if len(diffs) > 1 else ""
    raise TrainConfigError(
        f"{diffs[0].replace(' there,', ' in init_checkpoint,', 1)}{more}: the presets "
        f"{config.presets!r} are not the pre-trained model; drop them from the config "
        "argument to fine-tune the checkpoint's model, or set --config.reinitialise=True to "
        "start what differs from scratch")


def _vocab_file(path: str) -> str:
  """The ``vocab.txt`` that ``config.vocab`` names (the file, or a folder holding one)."""
  return os.path.join(path, "vocab.txt") if os.path.isdir(path) else path


def _same_tokens(a: str, b: str) -> bool:
  with open(a, encoding="utf-8") as fa, open(b, encoding="utf-8") as fb:
    return fa.read().split() == fb.read().split()


def use_vocabulary(config: ml_collections.ConfigDict, init_checkpoint: str | None) -> None:
  """Tokenises the tasks with the pre-trained model's vocabulary.

  ``config.vocab`` (a WordPiece ``vocab.txt`` or a folder holding one) defaults to a Hugging
  Face ``init_checkpoint``'s own; the tasks are then registered over it
  (:func:`posenc_jax.tasks.register_wordpiece`) and ``config.task`` / ``config.eval_task``
  renamed to those registrations. None keeps the bundled SentencePiece vocabulary, which a
  ``train.py`` checkpoint trained with.

  Raises:
    TrainConfigError: one ``vocab`` line naming both vocabularies when they are not the
      checkpoint's, or a vocabulary file that does not exist.
  """
  vocab = config.get("vocab")
  hf = bool(init_checkpoint) and not is_train_workdir(init_checkpoint)
  if hf:
    own = os.path.join(init_checkpoint, "vocab.txt")
    if not os.path.isfile(own):
      if vocab is None:
        raise TrainConfigError(f"vocab: unset, and init_checkpoint {init_checkpoint!r} has no "
                               "vocab.txt; give the checkpoint's WordPiece vocabulary as "
                               "--config.vocab=<vocab.txt> (the bundled SentencePiece one is "
                               "not the checkpoint's)")
    elif vocab is None:
      vocab = init_checkpoint
    elif os.path.isfile(_vocab_file(vocab)) and not _same_tokens(_vocab_file(vocab), own):
      raise TrainConfigError(f"vocab: {_vocab_file(vocab)!r} is not the vocabulary of "
                             f"init_checkpoint ({own!r}); drop --config.vocab to use the "
                             "checkpoint's")
  elif init_checkpoint and vocab is not None:
    trained = (saved_config(init_checkpoint, "init_checkpoint") or {}).get("vocab")
    if trained is None or not _same_tokens(_vocab_file(vocab), _vocab_file(trained)):
      raise TrainConfigError(
          f"vocab: {vocab!r}, but init_checkpoint {init_checkpoint!r} was trained with "
          f"{trained or 'the bundled SentencePiece vocabulary'!r}; drop --config.vocab")
  if vocab is None:
    return
  if not os.path.isfile(_vocab_file(vocab)):
    raise TrainConfigError(f"vocab: {vocab!r} is neither a vocab.txt nor a folder holding one")
  from posenc_jax.tasks import register_wordpiece  # noqa: PLC0415

  try:
    suffix = register_wordpiece(vocab)
  except ValueError as e:  # a vocab.txt WordPieceVocabulary refuses (a duplicate, no [CLS])
    raise TrainConfigError(f"vocab: {e}") from None
  config.vocab = vocab
  for field in ("task", "eval_task"):
    if config.get(field) and not config[field].endswith(suffix):
      config[field] = config[field] + suffix


def encoder_sizes(flat: dict[str, Any]) -> dict[str, int]:
  """The ``SIZE_FIELDS`` that flat encoder parameters (``a/b/c`` paths; arrays or shapes,
  scanned or unrolled layers) show."""
  flat = traverse_util.flatten_dict(jax.eval_shape(
      lambda tree: layout_for(tree, False), traverse_util.unflatten_dict(flat, sep="/")),
      sep="/")
  layers = len({p.split("/")[0] for p in flat if p.startswith("layers_")})
  sizes = {"num_layers": layers} if layers else {}  # none: parameters of no encoder stack
  for path, fields in (("token_embed/embedding", ("vocab_size", "d_model")),
                       ("layers_0/attention/query/kernel", (None, "num_heads")),
                       ("layers_0/mlp/wi/kernel", (None, "mlp_dim"))):
    if path in flat:
      sizes |= {f: n for f, n in zip(fields, np.shape(flat[path])) if f}
  return sizes


def check_encoder_fit(target: dict[str, Any], source: dict[str, Any], source_name: str) -> None:
  """Raises one ``init_checkpoint`` line unless the flat encoders ``target`` (the model's) and
  ``source`` (the checkpoint's) differ only in ``OPTIONAL`` parameters: the first parameter
  of another shape, or that one side lacks, and the ``model.<field>`` values that explain it."""
  def fail(problem: str):
    ours, theirs = encoder_sizes(target), encoder_sizes(source)
    sizes = ", ".join(f"{f}={theirs[f]} (model.{f} is {ours[f]})" for f in SIZE_FIELDS
                      if f in ours and f in theirs and ours[f] != theirs[f])
    hint = (f"the pre-trained model has {sizes}" if sizes
            else "the model's presets must be the pre-trained model's")
    raise TrainConfigError(f"init_checkpoint: {source_name!r} does not fit the model: "
                           f"{problem}; {hint}")

  for path, value in target.items():
    if path in source and not path.startswith(SCHEMES) and (
        np.shape(source[path]) != np.shape(value)):
      fail(f"bert/{path} has shape {np.shape(source[path])} in the checkpoint, "
           f"{np.shape(value)} in the model")
  for one, other, here, there in ((target, source, "model", "checkpoint"),
                                  (source, target, "checkpoint", "model")):
    only = [p for p in one if p not in other and not p.startswith(OPTIONAL)]
    if only:
      fail(f"bert/{only[0]} is in the {here}, not in the {there} ({len(only)} such parameters)")


def in_layout_of(source: dict[str, Any], target: dict[str, Any], source_name: str
                 ) -> dict[str, Any]:
  """Encoder parameters ``source`` with their layers laid out (scanned or unrolled) as the
  encoder ``target``'s; layers that cannot be stacked are one ``init_checkpoint`` line."""
  try:
    return match_layout(source, target)
  except ValueError as e:  # scan_params: layers that differ
    raise TrainConfigError(f"init_checkpoint: {source_name!r}: {e}") from None


def merge_encoder(target: Any, source: dict[str, Any], source_name: str) -> tuple[Any, InitReport]:
  """``target`` params (``bert/...`` + head) with every matching encoder leaf from ``source``
  (scanned or unrolled layers: converted to ``target``'s layout).

  Raises:
    TrainConfigError: the encoders differ beyond the schemes and the pooler
      (:func:`check_encoder_fit`).
  """
  report = InitReport(source_name)
  source = in_layout_of(source, target["bert"], source_name)
  flat_target = traverse_util.flatten_dict(target, sep="/")
  flat_source = traverse_util.flatten_dict(source, sep="/")
  check_encoder_fit({p.removeprefix("bert/"): v for p, v in flat_target.items()
                     if p.startswith("bert/")}, flat_source, source_name)
  for path, value in flat_target.items():
    inner = path.removeprefix("bert/")
    if path.startswith("bert/") and inner in flat_source and (
        np.shape(flat_source[inner]) == np.shape(value)):
      flat_target[path] = np.asarray(flat_source[inner], dtype=value.dtype)
      report.loaded.append(path)
    else:
      report.fresh.append(path)
  report.unused = sorted(p for p in flat_source if f"bert/{p}" not in report.loaded)
  return traverse_util.unflatten_dict(flat_target, sep="/"), report


def _registered_task(field: str, name: str):
  """The seqio task ``name`` (``config.<field>``); one line with the nearest name if none."""
  import seqio  # noqa: PLC0415

  from posenc_jax.training import input_pipeline  # noqa: PLC0415
  try:
    return input_pipeline._task(name)  # noqa: SLF001 - registers every task, TF off the GPU
  except TrainConfigError:
    names = sorted(n for n in seqio.TaskRegistry.names()
                   if _objective_features(seqio.get_mixture_or_task(n)))
    raise TrainConfigError(f"{field}: {name!r} is not a registered task{nearest(name, names)} "
                           f"fine-tuning tasks: {', '.join(names)}") from None


def _objective_features(task) -> list[str]:
  """The fine-tuning objectives whose features ``task`` has."""
  return [o for o, keys in FINETUNE_FEATURES.items() if set(keys) <= set(task.output_features)]


def _check_labels(config: ml_collections.ConfigDict, field: str, task) -> None:
  """``task`` (``config.<field>``) has the objective's features and ``num_labels`` labels."""
  objectives = _objective_features(task)
  if config.objective not in objectives:
    raise TrainConfigError(f"objective: got {config.objective!r}; the task {task.name!r} "
                           f"({field}) fits {' or '.join(map(repr, objectives)) or 'none'}")
  if config.objective == "span":
    return
  label = task.output_features["label"]
  if label.dtype.is_floating != (config.objective == "regression"):
    kind, fits = ("real", "regression") if label.dtype.is_floating else ("class", "classification")
    raise TrainConfigError(f"objective: got {config.objective!r}; the task {task.name!r} "
                           f"({field}) has {kind} labels: use {fits!r}")
  count = label.vocabulary.vocab_size
  if config.num_labels != count:
    raise TrainConfigError(f"num_labels: got {config.num_labels!r}; the task {task.name!r} "
                           f"has {count} label{'s' if count != 1 else ''}")


def _check_sweep(config: ml_collections.ConfigDict) -> None:
  """``sweep.seeds`` and ``sweep.learning_rates``: non-empty, valid, each run its own workdir."""
  if not isinstance(config.get("sweep"), ml_collections.ConfigDict):
    raise TrainConfigError("sweep: the config has no sweep section (sweep.seeds, "
                           "sweep.learning_rates), as configs/finetune_*.py have")
  rules = {"seeds": (lambda v: isinstance(v, int) and v >= 0, "non-negative integers"),
           "learning_rates": (lambda v: isinstance(v, (int, float)) and 0 < v < float("inf"),
                              "positive numbers")}
  for name, (valid, allowed) in rules.items():
    values = config.sweep.get(name)
    if not isinstance(values, (list, tuple)) or not values:
      raise TrainConfigError(f"sweep.{name}: got {values!r}; allowed: a non-empty list of "
                             f"{allowed}")
    bad = [v for v in values if isinstance(v, bool) or not valid(v)]
    if bad:
      raise TrainConfigError(f"sweep.{name}: got {bad[0]!r} in {list(values)}; allowed: "
                             f"{allowed}")
    names = [f"{v:g}" for v in values]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice:
      raise TrainConfigError(f"sweep.{name}: {twice} appears twice in {list(values)}; each "
                             "run needs its own workdir")


def check_finetune(config: ml_collections.ConfigDict, init_checkpoint: str | None = None, *,
                   sweep: bool = False) -> None:
  """Raises one :class:`TrainConfigError` line naming the field before anything is built.

  Checks the train config, the fine-tuning objective, the sweep section (``sweep``), that
  ``init_checkpoint`` exists and holds an encoder (:func:`check_init_checkpoint`), that
  ``task`` and ``eval_task`` are registered (nearest name suggested) with a ``train`` and the
  evaluation split, that ``num_labels`` is the tasks' label count, and that ``best_metric``
  is one the evaluation reports (higher is better, so not ``eval_loss``) with
  ``eval_every`` > 0; a sweep needs one.
  """
  from posenc_jax import route_table  # noqa: PLC0415
  from posenc_jax.training import task_eval  # noqa: PLC0415

  route_table.points()  # a bad $POSENC_JAX_ROUTE_TABLE: one line, RouteTableError
  if sweep:
    _check_sweep(config)
  if init_checkpoint and not epath.Path(init_checkpoint).exists():
    raise TrainConfigError(f"init_checkpoint: {init_checkpoint!r} does not exist")
  if init_checkpoint:
    check_init_checkpoint(init_checkpoint)
  validate_train_config(config)
  if config.objective not in FINETUNE_FEATURES:
    raise TrainConfigError(f"objective: got {config.objective!r}; allowed for fine-tuning: "
                           f"{', '.join(FINETUNE_FEATURES)}")
  num_labels = config.get("num_labels")
  if config.objective != "span" and (isinstance(num_labels, bool) or not isinstance(
      num_labels, int) or num_labels < 1):
    raise TrainConfigError(f"num_labels: got {num_labels!r}; allowed: a positive integer")
  task = _registered_task("task", config.task)
  if "train" not in task.splits:
    raise TrainConfigError(f"task: {config.task!r} has no 'train' split (splits: "
                           f"{', '.join(task.splits)}); to evaluate on it, set eval_task")
  _check_labels(config, "task", task)
  eval_task = task
  if config.get("eval_task"):
    eval_task = _registered_task("eval_task", config.eval_task)
    _check_labels(config, "eval_task", eval_task)
  split = config.get("eval_split") or "validation"
  if split not in eval_task.splits:
    given = f"got {split!r}" if config.get("eval_split") else "unset (so 'validation')"
    raise TrainConfigError(f"eval_split: {given}{nearest(split, eval_task.splits)} the task "
                           f"{eval_task.name!r} has {', '.join(eval_task.splits)}")
  metric = config.get("best_metric")
  if not metric:
    if sweep:
      raise TrainConfigError("best_metric: unset; the sweep scores each run by its best "
                             "evaluation of it")
    return
  reported = ["eval_loss", "eval_accuracy", *task_eval.metric_names(eval_task.name,
                                                                     config.objective)]
  if metric not in reported:
    raise TrainConfigError(f"best_metric: got {metric!r}{nearest(metric, reported)} the "
                           f"evaluation reports {', '.join(reported)}")
  if metric == "eval_loss":
    raise TrainConfigError(f"best_metric: got 'eval_loss'; the best evaluation is the highest "
                           f"score, so pick one of {', '.join(reported[1:])}")
  if not config.eval_every:  # validate_train_config: an integer >= 0
    raise TrainConfigError(f"eval_every: got 0; best_metric {metric!r} needs evaluations: a "
                           "positive integer")


def finetune(config: ml_collections.ConfigDict, workdir: str, init_checkpoint: str | None = None,
             data=None) -> dict[str, Any]:
  """One fine-tuning run: ``train`` with the pre-trained encoder and best-checkpoint keeping.

  Raises:
    TrainConfigError: :func:`check_finetune`'s findings, or an ``init_checkpoint`` whose
      encoder does not fit the model (:func:`check_encoder_fit`).
    ConversionError: a broken Hugging Face folder as ``init_checkpoint``.
  """
  from posenc_jax.models.build import abstract_params, build_model  # noqa: PLC0415
  from posenc_jax.training.loop import train  # noqa: PLC0415

  check_finetune(config, init_checkpoint)
  config = copy.deepcopy(config)
  use_vocabulary(config, init_checkpoint)
  init = None
  if init_checkpoint:
    adopt_checkpoint_model(config, init_checkpoint)
    model = build_model(config.model, config.head, num_labels=config.get("num_labels", 2))
    target = abstract_params(model)["bert"]
    source = in_layout_of(pretrained_encoder(init_checkpoint), target, init_checkpoint)
    check_encoder_fit(traverse_util.flatten_dict(target, sep="/"),
                      traverse_util.flatten_dict(source, sep="/"), init_checkpoint)  # shapes only

    def merge_pretrained(params):
      merged, report = merge_encoder(params, source, init_checkpoint)
      if jax.process_index() == 0:
        print(report.summary(), flush=True)
      return merged

    init = merge_pretrained
  return train(config, workdir, data=data, init_params=init)


def sweep(config: ml_collections.ConfigDict, workdir: str, init_checkpoint: str | None = None,
          data=None) -> dict[str, Any]:
  """Runs ``config.sweep.seeds`` x ``config.sweep.learning_rates``; writes sweep.json/.md.

  Returns:
    ``{"metric", "runs": [...], "by_learning_rate": {lr: median}, "best_learning_rate",
    "score"}`` where ``score`` is the best over learning rates of the median over seeds
    of each run's best evaluation.
  """
  check_finetune(config, init_checkpoint, sweep=True)
  runs = []
  for lr in config.sweep.learning_rates:
    for seed in config.sweep.seeds:
      run_config = copy.deepcopy(config)
      run_config.optimizer.learning_rate = lr
      run_config.seed = seed
      run_dir = os.path.join(workdir, f"lr{lr:g}_seed{seed}")
      result = finetune(run_config, run_dir, init_checkpoint, data)
      runs.append({"learning_rate": lr, "seed": seed, **(result["best"] or {})})
  by_lr = {lr: statistics.median(r["score"] for r in runs if r["learning_rate"] == lr)
           for lr in config.sweep.learning_rates}
  best_lr = max(by_lr, key=by_lr.get)
  summary = {"task": config.task, "metric": config.best_metric, "runs": runs,
             "by_learning_rate": {f"{lr:g}": v for lr, v in by_lr.items()},
             "best_learning_rate": best_lr, "score": by_lr[best_lr]}
  if jax.process_index() == 0:
    folder = epath.Path(workdir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sweep.json").write_text(json.dumps(summary, indent=2))
    (folder / "sweep.md").write_text(sweep_table(summary))
  return summary


def sweep_table(summary: dict[str, Any]) -> str:
  """Markdown: one row per learning rate (each seed's best, the median), then the result."""
  seeds = sorted({r["seed"] for r in summary["runs"]})
  lines = [f"{summary['task']}: {summary['metric']} (best checkpoint of each run)", "",
           "| learning rate | " + " | ".join(f"seed {s}" for s in seeds) + " | median |",
           "|---|" + "---|" * (len(seeds) + 1)]
  for lr, median in summary["by_learning_rate"].items():
    scores = {r["seed"]: r["score"] for r in summary["runs"] if f"{r['learning_rate']:g}" == lr}
    lines.append(f"| {lr} | " + " | ".join(f"{scores[s]:.4f}" for s in seeds)
                 + f" | {median:.4f} |")
  lines += ["", f"**{summary['score']:.4f}** (median over seeds, best learning rate "
                f"{summary['best_learning_rate']:g})", ""]
  return "\n".join(lines)
