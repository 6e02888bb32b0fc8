"""A trained workdir's model, restored read-only, and the evaluation protocols run on it.

``evaluate_workdir(workdir, protocol, ...)`` restores the newest good checkpoint (or
``best/``, or a step), builds the model from the workdir's ``config.json``, runs one protocol
of :data:`PROTOCOLS` and returns its JSON document (and, given ``out``, writes it there with
a plot: :mod:`posenc_jax.evaluation.report`). Nothing is ever written under
``<workdir>/checkpoints`` or ``<workdir>/best``.

Protocols (each a function ``(run, *, progress, **options) -> document``; a new one is one
entry of :data:`PROTOCOLS`):

* ``loss``: the objective's metrics on a split, as the trainer's periodic evaluation
  computes them (``eval_loss``, ``eval_accuracy``; for a pre-training run ``eval_perplexity``
  and ``eval_unigram_perplexity``, the unigram reference of the same tokens), and
  for fine-tuned runs the task's own metrics (:func:`~posenc_jax.training.loop.task_evaluation`).
* ``extrapolation``: causal-LM perplexity or masked-LM loss at several evaluation lengths, on
  the same first ``tokens`` tokens of the split's stream at every length
  (:mod:`posenc_jax.evaluation.windows`). The causal-LM stream is the task's lines joined with
  EOS, exactly as :func:`posenc_jax.data.causal_lm.packed_epoch` packs them; the masked-LM
  stream is the lines joined with [SEP] as :func:`posenc_jax.data.preprocessors.pack_lines`
  packs them, corrupted once as a whole by :func:`~posenc_jax.data.preprocessors.bert_mask`
  with a fixed seed, and each window is [CLS] and ``L - 1`` stream tokens. A length the model
  cannot reach is a row with ``value`` None and the reason in ``na``.
  A causal LM's document also holds ``unigram``: the perplexity, on the same tokens, of the
  add-one smoothed unigram model of the task's ``train`` split (a reference no scheme should
  need a position for), and ``corpus_sha256`` for the bundled corpus
  (:mod:`posenc_jax.data.stdlib_corpus`).
* ``indicators``: Wang et al.'s property indicators (their Table 2) of an encoder run, from
  identical-word probing of its first layer at its training length, beside the paper's row
  for its scheme (:func:`indicators_protocol`).
* ``probes``: a synthetic-probe run's (:mod:`posenc_jax.data.probes`) accuracy on its probe at
  several lengths, the same held-out examples for every run, and at each length the
  accuracy of chance (:meth:`~posenc_jax.data.probes.Probe.chance`).

Every document holds ``settings``: the options that change its numbers (:data:`SETTINGS`,
defaults filled in by :func:`protocol_settings`); lengths are not among them. Its file is
``<out>/<protocol>-<settings>.json`` (:func:`posenc_jax.evaluation.report.settings_key`), so
that evaluations with other settings sit beside it instead of replacing it.

A length past ``model.max_len`` runs the trained model when it accepts that length (a
relative table clipped at a distance, T5 buckets, ALiBi); else the model rebuilt with
``max_len`` = that length when its parameters have the same shapes (sinusoidal tables, a
scheme whose fixed tables ``max_len`` sizes); else it is ``n/a`` (a learned table of
``max_len`` rows). Before anything is read or compiled, the forward pass at each length is
estimated (:func:`check_memory`): a length that cannot fit is one line naming ``lengths`` (or
``batch_size``) and what fits, as the trainer refuses a ``seq_len``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from etils import epath

from posenc_jax import memory, presets, route_table
from posenc_jax.paths import absolute
from posenc_jax.data import probes, randomized_positions
from posenc_jax.data import unigram
from posenc_jax.evaluation import windows as windows_lib
from posenc_jax.messages import first_line
from posenc_jax.models.build import abstract_params, build_model
from posenc_jax.models.config import model_config
from posenc_jax.training import checkpoint as checkpoint_lib
from posenc_jax.training.objectives import PRETRAINING, objective
from posenc_jax.training.workdir import CONFIG_FILE, saved_config

MASK_SEED = 0  # the masked-LM stream's masking seed: the same masks for every run
DEFAULT_TOKENS = 16_384
# [W, L] arrays of an evaluation batch on the device, at most (masked LM: ids, segments, mask,
# targets, weights), int32 or float32 each.
BATCH_FEATURES = 5


class EvaluationError(ValueError):
  """An evaluation cannot run as asked (one line naming the field)."""


@dataclasses.dataclass
class Run:
  """A workdir's trained model.

  Attributes:
    workdir: the run's folder (absolute, or a URI).
    config: its ``config.json`` as a ConfigDict.
    model: the module built from it.
    params: the restored parameters (on the first local device).
    step: the step they were saved at.
    checkpoint: what was asked: ``"latest"``, ``"best"`` or a step.
  """

  workdir: str
  config: ml_collections.ConfigDict
  model: nn.Module
  params: Any
  step: int
  checkpoint: str | int

  def build(self, **overrides) -> nn.Module:
    """The run's model, its model config changed by ``overrides`` (e.g. ``max_len=``)."""
    return build_model(model_config(self.config.model, **overrides), self.config.head,
                       num_labels=self.config.get("num_labels", 2))


def parse_checkpoint(text: str | int) -> str | int:
  """``"latest"``, ``"best"`` or a step (a non-negative integer, from an int or its text)."""
  if text in ("latest", "best"):
    return text
  try:
    step = int(text)
  except (TypeError, ValueError):
    step = -1
  if step < 0:
    raise EvaluationError(f"checkpoint: got {text!r}; allowed: latest, best or a saved step")
  return step


def _restore_best(workdir: str, abstract: Any) -> tuple[int, Any]:
  """``(step, params)`` kept in ``<workdir>/best`` by
  :class:`~posenc_jax.training.loop.BestKeeper` (read-only)."""
  import orbax.checkpoint as ocp  # noqa: PLC0415

  folder = epath.Path(workdir) / "best"
  if not folder.is_dir():
    raise EvaluationError(f"checkpoint: 'best' needs {folder} (kept by runs with a "
                          "best_metric); this workdir has none: use latest or a step")
  manager = ocp.CheckpointManager(folder, options=ocp.CheckpointManagerOptions(
      create=False, read_only=True))
  try:
    step = manager.latest_step()
    if step is None:
      raise EvaluationError(f"checkpoint: {folder} holds no complete checkpoint")
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                          abstract)
    try:
      params = manager.restore(step, args=ocp.args.StandardRestore(target))
    except Exception as e:  # noqa: BLE001 - any unreadable checkpoint is one line
      raise EvaluationError(f"checkpoint: {folder}/{step} does not restore: "
                            f"{first_line(e)}") from None
  finally:
    manager.close()
  problem = checkpoint_lib.damage(params, None)
  if problem:
    raise EvaluationError(f"checkpoint: {folder}/{step} is damaged ({problem})")
  return step, params


def load_run(workdir: str, checkpoint: str | int = "latest") -> Run:
  """The model of ``workdir`` (its ``config.json``) with the parameters of ``checkpoint``:
  ``"latest"`` (the newest that restores and verifies; damaged ones are skipped, never
  moved), ``"best"`` (``<workdir>/best``) or a saved step.

  Raises:
    EvaluationError, CheckpointError, TrainConfigError, ModelConfigError: one line.
  """
  workdir = absolute(workdir)
  checkpoint = parse_checkpoint(checkpoint)
  saved = saved_config(workdir)
  if saved is None:
    raise EvaluationError(f"workdir: {workdir} has no {CONFIG_FILE} (train.py and "
                          "finetune.py write it), so its model is unknown")
  config = ml_collections.ConfigDict(saved)
  model = build_model(saved["model"], config.head, num_labels=config.get("num_labels", 2))
  abstract = abstract_params(model)
  if checkpoint == "best":
    step, params = _restore_best(workdir, abstract)
  else:
    step, params = checkpoint_lib.restore_params(
        workdir, abstract, step=None if checkpoint == "latest" else checkpoint)
  return Run(workdir, config, model, params, step, checkpoint)


def _quiet(message: str) -> None:
  del message


# ---------------------------------------------------------------------------- loss protocol


def loss_protocol(run: Run, *, split: str = "validation", eval_steps: int | None = None,
                  progress: Callable[[str], None] = _quiet) -> dict[str, Any]:
  """The objective's metrics on ``split`` over ``eval_steps`` batches (default the run's),
  as the trainer's evaluation computes them, and for fine-tuned runs the task's metrics."""
  from posenc_jax.training.input_pipeline import check_data_config, make_batches  # noqa: PLC0415
  from posenc_jax.training.loop import (evaluate, make_eval_step,  # noqa: PLC0415
                                        task_evaluation, unigram_reference)

  config = ml_collections.ConfigDict(run.config.to_dict())
  settings = protocol_settings("loss", config, split=split, eval_steps=eval_steps)
  config.eval_steps = settings["eval_steps"]
  config.eval_split = split
  check_data_config(config)
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  batches = make_batches(config, split, 0)
  if config.objective in PRETRAINING or config.objective == "translation":
    batches = itertools.islice(batches, config.eval_steps)  # the train split is endless
  total = config.eval_steps if config.objective in PRETRAINING else None

  def counted(items: Iterator) -> Iterator:
    every = max(1, total // 4) if total else 50
    for i, batch in enumerate(items, 1):
      if i % every == 0:
        progress(f"loss: batch {i}{f'/{total}' if total else ''} of split {split!r}")
      yield batch

  metrics = evaluate(jax.jit(make_eval_step(run.model, config)), run.params,
                     counted(batches), device, perplexity=config.objective in PRETRAINING,
                     reference=unigram_reference(config))
  if not metrics:
    raise EvaluationError(f"split: {split!r} of task {config.task!r} gave no batch")
  progress("loss: task metrics" if config.objective not in PRETRAINING else "loss: done")
  metrics |= task_evaluation(config, run.model, run.params, make_batches)
  return {"protocol": "loss", "workdir": run.workdir, "step": run.step,
          "checkpoint": run.checkpoint, "objective": config.objective, "settings": settings,
          "split": split, "metrics": {k: float(v) for k, v in metrics.items()}}


# --------------------------------------------------------------------- extrapolation protocol


def token_stream(config: ml_collections.ConfigDict, split: str, tokens: int,
                 mask_seed: int = MASK_SEED) -> dict[str, np.ndarray]:
  """The first ``tokens`` tokens of the split's stream (fewer if the split is shorter),
  ``[N]`` arrays (read-only: one copy per process serves every run of the same task):
  ``targets`` (causal LM), or ``input_ids`` (corrupted), ``mlm_targets`` and
  ``mlm_weights`` (masked LM, masked with ``mask_seed``)."""
  from posenc_jax.training.input_pipeline import check_data_config  # noqa: PLC0415

  check_data_config(config)  # registers the tasks; the task has the objective's feature
  return _token_stream(config.objective, config.task, split, tokens, mask_seed,
                       config.mask_rate)


@functools.lru_cache(maxsize=8)
def _token_stream(objective_name: str, task: str, split: str, tokens: int, mask_seed: int,
                  mask_rate: float) -> dict[str, np.ndarray]:
  pieces, have = [], 0
  for piece in unigram.packed_examples(objective_name, task, split):
    pieces.append(piece)
    have += len(piece)
    if have >= tokens:
      break
  stream = np.concatenate(pieces)[:tokens].astype(np.int32) if pieces else np.zeros(0, np.int32)
  if not len(stream):
    raise EvaluationError(f"split: {split!r} of task {task!r} holds no tokens")
  if objective_name == "lm":
    arrays = {"targets": stream}
  else:
    import seqio  # noqa: PLC0415
    import tensorflow as tf  # noqa: PLC0415

    from posenc_jax.data.preprocessors import bert_mask  # noqa: PLC0415
    vocab_size = seqio.get_mixture_or_task(task).output_features["text"].vocabulary.vocab_size
    masked = bert_mask({"input_ids": tf.constant(stream), "mask": tf.ones_like(stream)},
                       tf.constant([mask_seed, 0], tf.int64), vocab_size, mask_rate)
    arrays = {k: masked[k].numpy() for k in ("input_ids", "mlm_targets", "mlm_weights")}
  for array in arrays.values():
    array.flags.writeable = False
  return arrays


def window_batches(stream: dict[str, np.ndarray], objective_name: str, length: int,
                   kind: str, stride: int | None) -> tuple[dict[str, np.ndarray], int]:
  """``(batch, scored)``: every window of ``length`` model positions over ``stream`` as one
  batch of ``[W, length]`` arrays (causal LM: ``targets`` and ``loss_weights``; masked LM:
  :func:`~posenc_jax.training.objectives.mlm_objective`'s features, [CLS] and ``length - 1``
  stream tokens per window, ``mlm_weights`` at the masked positions it scores), and the
  number of stream tokens scored."""
  if objective_name == "lm":
    cut = windows_lib.windows(len(stream["targets"]), length, kind, stride)
    ids, _, scored = windows_lib.window_arrays(stream["targets"], cut)
    return {"targets": ids, "loss_weights": scored.astype(np.float32)}, int(scored.sum())
  from posenc_jax.data.vocab import CLS_ID  # noqa: PLC0415
  if length < 2:
    raise EvaluationError(f"lengths: got {length}; allowed for a masked LM: at least 2 "
                          "([CLS] and one token)")
  cut = windows_lib.windows(len(stream["input_ids"]), length - 1, kind, stride)
  ids, valid, scored = windows_lib.window_arrays(stream["input_ids"], cut)
  targets = windows_lib.window_arrays(stream["mlm_targets"], cut)[0]
  weights = windows_lib.window_arrays(stream["mlm_weights"], cut)[0] * scored

  def with_cls(x: np.ndarray, first: int) -> np.ndarray:
    return np.concatenate([np.full((len(x), 1), first, x.dtype), x], axis=1)

  batch = {"input_ids": with_cls(ids, CLS_ID), "segment_ids": np.zeros((len(ids), length),
                                                                       np.int32),
           "mask": with_cls(valid.astype(np.int32), 1), "mlm_targets": with_cls(targets, 0),
           "mlm_weights": with_cls(weights.astype(np.float32), 0)}
  return batch, int(scored.sum())


def model_at(run: Run, length: int) -> tuple[nn.Module | None, str | None]:
  """``(model, None)``: the model that evaluates ``length`` tokens (module docstring), or
  ``(None, reason)`` when the scheme cannot reach ``length``."""
  max_len = model_config(run.config.model).max_len
  if length <= max_len:
    return run.model, None
  name = run.config.objective
  loss_fn = objective(name)
  keys = ("targets",) if name == "lm" else ("input_ids", "mlm_targets", "mlm_weights")
  # One window's features, abstract at ``length`` (nothing of that size is allocated).
  small = min(length, 2)
  zeros = {k: np.zeros(small - (name != "lm"), np.int32) for k in keys}
  features = window_batches(zeros, name, small, "non_overlapping", None)[0]
  probe = {k: jax.ShapeDtypeStruct((1, length), v.dtype) for k, v in features.items()}
  try:
    jax.eval_shape(lambda p, b: loss_fn(run.model, p, b, None), run.params, probe)
    return run.model, None
  except ValueError as e:
    refusal = first_line(e)
  try:
    longer = run.build(max_len=length)
  except ValueError as e:
    return None, f"{refusal}; model.max_len={length} is refused: {first_line(e)}"
  mismatch = checkpoint_lib.shape_mismatch(run.params, abstract_params(longer))
  if mismatch:
    return None, (f"{refusal}; its parameters depend on max_len (trained {max_len} vs "
                  f"{length}: {mismatch.partition(': ')[2]})")
  return longer, None


def rows_per_step(run: Run, length: int, batch_size: int | None = None) -> int:
  """Windows (or probe examples) per evaluation step at ``length``: ``batch_size``, else the
  training batch's tokens per step (at least one)."""
  return batch_size or max(1, run.config.batch_size * run.config.seq_len // length)


def check_memory(run: Run, lengths: Sequence[int], batch_size: int | None = None,
                 most_rows: int | None = None) -> None:
  """Raises one :class:`EvaluationError` line, before anything is compiled, when the forward
  pass at one of ``lengths`` that the model reaches (:func:`model_at`) needs more memory than
  is free beyond the estimate's error: :func:`posenc_jax.memory.step_memory` without
  optimizer state of ``[rows, length]`` windows (:func:`rows_per_step`, at most
  ``most_rows``), logits at every position, refused by :func:`posenc_jax.memory.refusal`.
  The line names ``batch_size`` where one row fits (with the most that do), else
  ``lengths`` (with the longest length that fits)."""
  cfg = model_config(run.config.model)
  causal = run.config.objective == "lm"
  forms = memory.attention_forms(cfg, causal)
  free = memory.available()

  def needs(rows: int, length: int) -> memory.Estimate:
    return memory.step_memory(cfg, batch=rows, length=length, params=run.params, forms=forms,
                              causal=causal, input_bytes=rows * length * BATCH_FEATURES * 4)

  def fits(rows: int, length: int) -> bool:
    return needs(rows, length).total <= free[0]

  def rows_at(length: int) -> int:
    return min(rows_per_step(run, length, batch_size), most_rows or math.inf)

  for length in lengths:
    rows = rows_at(length)
    estimate = needs(rows, length)
    if memory.refusal(estimate, "lengths", length, free=free) is None or (
        model_at(run, length)[0] is None):  # n/a: never run
      continue
    if batch_size and fits(1, length):
      most = memory.largest(lambda n, length=length: fits(n, length), rows)
      raise EvaluationError(memory.refusal(estimate, "batch_size", batch_size, free=free,
                                           hint=f" (at most about {most} fit at length "
                                           f"{length})"))
    most = memory.largest(lambda n: fits(rows_at(n), n), length)
    raise EvaluationError(memory.refusal(estimate, "lengths", length, free=free, what="length",
                                         hint=f" (at most about {most} fit)" if most else ""))


def score(model: nn.Module, params: Any, objective_name: str, batch: dict[str, np.ndarray],
          batch_size: int, progress: Callable[[str], None] = _quiet) -> dict[str, float]:
  """Summed ``loss``, ``weight`` and ``correct`` (float64 on the host) of the objective
  over ``batch`` ``[W, L]``, in jitted batches of ``batch_size`` windows (the last padded
  with weight-0 copies of the first window); ``progress`` hears of every quarter."""
  loss_fn = objective(objective_name)  # masked LM: logits at every position
  step = jax.jit(lambda p, b: loss_fn(model, p, b, None)[1])
  weight_key = "loss_weights" if objective_name == "lm" else "mlm_weights"
  count = len(batch[weight_key])
  totals = {"loss": 0.0, "weight": 0.0, "correct": 0.0}
  report_every = max(1, -(-count // batch_size) // 4) * batch_size
  for first in range(0, count, batch_size):
    rows = {k: v[first:first + batch_size] for k, v in batch.items()}
    missing = batch_size - len(rows[weight_key])
    if missing:
      rows = {k: np.concatenate([v, np.repeat(batch[k][:1], missing, axis=0)])
              for k, v in rows.items()}
      rows[weight_key][-missing:] = 0
    sums = jax.device_get(step(params, rows))
    for key in totals:
      totals[key] += float(sums[key])
    if (first + batch_size) % report_every == 0 and first + batch_size < count:
      progress(f"{first + batch_size}/{count} windows")
  return totals


def extrapolation_protocol(run: Run, *, split: str = "validation",
                           lengths: Sequence[int] | None = None,
                           windows: str = "non_overlapping",
                           stride: int | None = None, tokens: int = DEFAULT_TOKENS,
                           batch_size: int | None = None, mask_seed: int | None = None,
                           progress: Callable[[str], None] = _quiet) -> dict[str, Any]:
  """Perplexity (causal LM) or masked-LM loss at each of ``lengths`` (default 1, 2, 4 and 8
  times the training length) over the first ``tokens`` tokens of ``split``, cut into
  ``windows`` (``non_overlapping``, or ``sliding`` with ``stride``, causal LM only);
  ``batch_size`` windows per step (default: the training batch's tokens per step);
  ``mask_seed`` (masked LM only) the stream's masking seed (default :data:`MASK_SEED`).
  A length the model cannot reach, or longer than the tokens read (no whole window of it),
  is a row with ``value`` None and the reason in ``na``.
  A causal LM's document has ``unigram``: the perplexity of those tokens under the add-one
  smoothed unigram of the ``train`` split (:func:`~posenc_jax.data.unigram.train_counts`), and the train tokens it
  counted (``unigram_train_tokens``); a masked LM's None."""
  config = run.config
  settings = protocol_settings("extrapolation", config, split=split, windows=windows,
                               stride=stride, tokens=tokens, mask_seed=mask_seed)
  name = config.objective
  if name not in PRETRAINING:
    raise EvaluationError(f"protocol: 'extrapolation' needs a pre-training run (objective "
                          f"lm or mlm); {run.workdir} has objective {name!r}")
  if windows == "sliding" and name != "lm":
    raise EvaluationError("windows: 'sliding' scores a token with the context before it, "
                          f"for a causal LM (objective lm); this run's objective is {name!r}")
  if mask_seed is not None and name != "mlm":
    raise EvaluationError("mask_seed: only for a masked-LM run (objective mlm); this run's "
                          f"objective is {name!r}")
  train_length = config.seq_len
  lengths = check_lengths(lengths or [train_length * k for k in (1, 2, 4, 8)])
  check_windows(windows, stride, lengths)
  if int(tokens) != tokens or tokens < 1:
    raise EvaluationError(f"tokens: got {tokens!r}; allowed: a positive integer")
  if batch_size is not None and (int(batch_size) != batch_size or batch_size < 1):
    raise EvaluationError(f"batch_size: got {batch_size!r}; allowed: a positive integer")
  check_memory(run, lengths, batch_size)
  progress(f"extrapolation: reading the first {tokens} tokens of split {split!r} of "
           f"{config.task!r}")
  stream = token_stream(config, split, tokens, settings.get("mask_seed", MASK_SEED))
  tokens = len(next(iter(stream.values())))
  unigram_ppl = counted = None
  if name == "lm":
    progress(f"extrapolation: counting the tokens of split 'train' of {config.task!r} (the "
             "unigram reference)")
    counts = unigram.train_counts(name, config.task, model_config(config.model).vocab_size)
    unigram_ppl, counted = unigram.unigram_perplexity(counts, stream["targets"]), int(counts.sum())
  rows = []
  for index, length in enumerate(lengths, 1):
    start = time.perf_counter()
    model, reason = model_at(run, length)
    need = length - 1 if name == "mlm" else length  # a masked-LM window is [CLS] + L - 1
    if model is not None and tokens < need:  # no whole window: it would score fewer tokens
      model, reason = None, (f"the first {tokens} tokens of split {split!r} hold no whole "
                             f"window of {length}; --tokens of at least {need} scores it")
    row = {"length": length, "value": None, "loss": None, "accuracy": None,
           "scored_tokens": 0, "na": reason}
    if model is not None:
      batch, scored = window_batches(stream, name, length, windows, stride)
      sums = score(model, run.params, name, batch, rows_per_step(run, length, batch_size),
                   lambda text, length=length: progress(f"extrapolation: length {length} "
                                                        f"({index}/{len(lengths)}): {text}"))
      weight = max(sums["weight"], 1.0)
      loss = sums["loss"] / weight
      row |= {"value": math.exp(min(loss, 700.0)) if name == "lm" else loss, "loss": loss,
              "accuracy": sums["correct"] / weight, "scored_tokens": scored}
    rows.append(row)
    value = "n/a" if row["value"] is None else f"{row['value']:.4g}"
    progress(f"extrapolation: length {length} ({index}/{len(lengths)}): {value} "
             f"({time.perf_counter() - start:.1f} s)")
  from posenc_jax.data import stdlib_corpus  # noqa: PLC0415
  return {"protocol": "extrapolation", "workdir": run.workdir, "step": run.step,
          "checkpoint": run.checkpoint, "objective": name, "settings": settings,
          "metric": "perplexity" if name == "lm" else "mlm_loss", "task": config.task,
          "corpus_sha256": stdlib_corpus.content_sha256()
          if config.task == stdlib_corpus.TASK else None, "split": split,
          "train_length": train_length, "windows": windows, "stride": stride,
          "tokens": tokens, "mask_seed": settings.get("mask_seed"), "unigram": unigram_ppl,
          "unigram_train_tokens": counted, "rows": rows}


# --------------------------------------------------------------------------- probes protocol


def probes_protocol(run: Run, *, lengths: Sequence[int] | None = None, examples: int = 256,
                    seed: int = probes.HELD_OUT_SEED, batch_size: int | None = None,
                    progress: Callable[[str], None] = _quiet) -> dict[str, Any]:
  """Accuracy of a synthetic-probe run on its own probe at each of ``lengths`` (default 1,
  2, 4 and 8 times the training length). The run's task is ``probe:<name>``
  (:mod:`posenc_jax.data.probes`); the examples are ``0 .. examples - 1`` of ``seed``
  (default the held-out seed the trainer evaluates on), the same examples for every run;
  ``batch_size`` examples per step (default: the training batch's tokens per step). A length
  the scheme cannot reach, or too short for the probe, is ``n/a`` with the reason. Each row
  has ``chance``: the accuracy of guessing (:meth:`~posenc_jax.data.probes.Probe.chance`)."""
  config = run.config
  if not probes.is_probe(config.task):
    raise EvaluationError(f"protocol: 'probes' needs a probe run (task "
                          f"{probes.TASK_PREFIX}<name>, configs/probe.py); {run.workdir} has "
                          f"task {config.task!r}")
  spec = probes.config_probe(config)
  train_length = config.seq_len
  randomized = randomized_positions.evaluated_range(config)  # as the trainer evaluates
  lengths = check_lengths(lengths or [train_length * k for k in (1, 2, 4, 8)])
  check_memory(run, lengths, batch_size, most_rows=examples)  # probes.score's rows
  settings = protocol_settings("probes", config, examples=examples, seed=seed)
  rows = []
  for index, length in enumerate(lengths, 1):
    start = time.perf_counter()
    model, reason = model_at(run, length)
    row = {"length": length, "accuracy": None, "token_accuracy": None, "chance": None,
           "na": reason}
    try:
      row["chance"] = spec.chance(length)
    except probes.ProbeError as e:
      model, row["na"] = None, row["na"] or first_line(e)
    if model is not None and randomized is not None and length > randomized:
      model, row["na"] = None, (f"trained on randomized positions from [0, {randomized}), "
                                f"fewer than {length}")
    if model is not None:
      result = probes.score(model, run.params, spec, length, examples=examples, seed=seed,
                            batch_size=rows_per_step(run, length, batch_size),
                            randomized_positions=randomized)
      row |= {k: v for k, v in result.items() if k in ("accuracy", "token_accuracy",
                                                       "by_depth")}
    rows.append(row)
    value = "n/a" if row["accuracy"] is None else f"{row['accuracy']:.4g}"
    progress(f"probes: length {length} ({index}/{len(lengths)}): accuracy {value} "
             f"({time.perf_counter() - start:.1f} s)")
  return {"protocol": "probes", "workdir": run.workdir, "step": run.step,
          "checkpoint": run.checkpoint, "objective": config.objective, "settings": settings,
          "task": config.task, "probe": probes.describe(spec), "train_length": train_length,
          "positions": "plain" if randomized is None else "randomized",
          "randomized_positions": randomized, "examples": examples, "seed": seed, "rows": rows}


# ------------------------------------------------------------------------ indicators protocol


def indicators_protocol(run: Run, *, examples: int = 300, seed: int = 0,
                        progress: Callable[[str], None] = _quiet) -> dict[str, Any]:
  """Wang et al.'s property indicators of an encoder run (their Table 2): identical-word
  probing of the first layer at the run's training length (at most ``max_len``),
  ``examples`` words drawn with ``seed`` (the paper: 300), monotonicity over every offset and
  the first 20, translation invariance with and without [CLS], symmetry and direction
  balance within 20 (:mod:`posenc_jax.analysis.indicators`), beside the paper's row for the
  run's scheme where one has its setup (``paper_row``, ``paper``; else
  ``paper_setup_differences`` says what differs). A masked LM or a fine-tuned BERT; a causal
  LM or an encoder-decoder is one line (identical-word probing reads attention to both sides
  of each position)."""
  from posenc_jax import analysis  # noqa: PLC0415
  from posenc_jax.analysis.loading import check_model, loaded  # noqa: PLC0415

  cfg = model_config(run.config.model)
  head = run.config.get("head", "mlm")
  try:
    check_model(cfg, head, "indicators")
    model = loaded(cfg, head, run.params, f"checkpoint:{run.workdir}@{run.step}", run.step)
    length = min(int(run.config.seq_len), cfg.max_len)
    probe = analysis.identical_word_probing(model.encoder, model.variables, model.tokens,
                                            length=length, num_words=examples, seed=seed)
  except analysis.AnalysisError as e:
    raise EvaluationError(f"protocol: 'indicators': {e}") from None
  values = analysis.indicators(probe.attention, probe.special_positions)  # the paper's 20
  row = analysis.paper_row(cfg.scheme)
  progress(f"indicators: {len(probe.words)} words at length {length}, layer {probe.layer}")
  return {"protocol": "indicators", "workdir": run.workdir, "step": run.step,
          "checkpoint": run.checkpoint, "objective": run.config.objective,
          "settings": protocol_settings("indicators", run.config, examples=examples, seed=seed),
          "length": length, "layer": probe.layer, "examples": len(probe.words),
          "special_positions": list(probe.special_positions), "indicators": values,
          "paper_row": row,
          "paper": dict(zip(analysis.TABLE2_COLUMNS, analysis.PAPER_TABLE2[row])) if row
          else None, "paper_setup_differences": analysis.paper_setup_differences(cfg.scheme)}


def check_lengths(lengths: Sequence[int]) -> list[int]:
  """``lengths`` as a list, after checking they are positive integers, increasing."""
  lengths = list(lengths)
  for length in lengths:
    if isinstance(length, bool) or int(length) != length or length < 1:
      raise EvaluationError(f"lengths: got {length!r} in {lengths}; allowed: positive integers")
  if any(b <= a for a, b in zip(lengths, lengths[1:])):
    raise EvaluationError(f"lengths: got {','.join(map(str, lengths))}; allowed: increasing, "
                          "no repeats")
  return [int(length) for length in lengths]


def check_windows(kind: str, stride: int | None, lengths: Sequence[int]) -> None:
  """``windows`` and ``stride`` fit together and every length (one line naming the field)."""
  if kind not in windows_lib.WINDOWS:
    raise EvaluationError(f"windows: got {kind!r}; allowed: {', '.join(windows_lib.WINDOWS)}")
  if kind == "non_overlapping" and stride is not None:
    raise EvaluationError(f"stride: got {stride}; allowed only with windows 'sliding'")
  if kind == "sliding" and (stride is None or int(stride) != stride or stride < 1
                            or stride > min(lengths)):
    given = "required" if stride is None else f"got {stride!r}"
    raise EvaluationError(f"stride: {given}; allowed with windows 'sliding': an integer in "
                          f"[1, {min(lengths)}] (the smallest length)")


PROTOCOLS: dict[str, Callable[..., dict[str, Any]]] = {
    "loss": loss_protocol,
    "extrapolation": extrapolation_protocol,
    "probes": probes_protocol,
    "indicators": indicators_protocol,
}


# The options of each protocol that change its numbers: its documents' ``settings``.
SETTINGS: dict[str, tuple[str, ...]] = {
    "loss": ("split", "eval_steps"),
    "extrapolation": ("split", "windows", "stride", "tokens", "mask_seed"),
    "probes": ("examples", "seed"),
    "indicators": ("examples", "seed"),
}


def protocol_settings(protocol: str, config: Mapping[str, Any], **options) -> dict[str, Any]:
  """The :data:`SETTINGS` of ``protocol`` for a run of train config ``config`` asked for
  ``options`` (its keywords; others are ignored): an option not given (or None) is the
  protocol's default, ``eval_steps`` the run's and ``mask_seed`` a masked LM's
  :data:`MASK_SEED`; one that does not apply (``stride`` of non-overlapping windows,
  ``mask_seed`` of a causal LM) is left out. In :data:`SETTINGS` order."""
  params = inspect.signature(PROTOCOLS[protocol]).parameters
  fallback = {"eval_steps": config.get("eval_steps"),
              "mask_seed": MASK_SEED if config.get("objective") == "mlm" else None}
  chosen = {}
  for name in SETTINGS[protocol]:
    value = options.get(name)
    value = params[name].default if value is None else value
    value = fallback.get(name) if value is None else value
    if value is not None:
      chosen[name] = value
  return chosen


def protocol_options(protocol: str) -> list[str]:
  """The keyword options of ``protocol`` (its function's, ``progress`` aside)."""
  params = inspect.signature(PROTOCOLS[protocol]).parameters
  return [p for p in params if params[p].kind == inspect.Parameter.KEYWORD_ONLY
          and p != "progress"]


def check_protocol(protocol: str, options: dict[str, Any]) -> None:
  """``protocol`` is known and takes every one of ``options`` (one line naming the first
  that is not)."""
  from posenc_jax.messages import nearest  # noqa: PLC0415
  if protocol not in PROTOCOLS:
    raise EvaluationError(f"protocol: got {protocol!r}{nearest(protocol, list(PROTOCOLS))} "
                          f"allowed: {', '.join(PROTOCOLS)}")
  allowed = protocol_options(protocol)
  for option in options:
    if option not in allowed:
      raise EvaluationError(f"{option}: not an option of protocol {protocol!r} (its options: "
                            f"{', '.join(allowed)})")


def evaluate_workdir(workdir: str, protocol: str = "loss", *, checkpoint: str | int = "latest",
                     out: str | None = None, progress: Callable[[str], None] | None = None,
                     **options) -> dict[str, Any]:
  """Runs ``protocol`` on ``workdir``'s model and returns its document (module docstring);
  given ``out`` (e.g. ``<workdir>/eval``), also writes ``<out>/<protocol>-<settings>.json``
  and, where it makes sense, the PNG beside it (:func:`posenc_jax.evaluation.report.write`).
  The document's ``scheme`` names the run's scheme preset
  (:func:`posenc_jax.presets.scheme_name`).

  Args:
    workdir: a train.py or finetune.py workdir (local or a URI such as ``gs://...``).
    protocol: a name in :data:`PROTOCOLS`.
    checkpoint: ``"latest"``, ``"best"`` or a saved step.
    out: the folder to write into (checked, and created, once the run is restored, before
      the protocol runs; removed again, if it was made and is still empty, when the protocol
      refuses, e.g. a length whose step would not fit in memory); never inside ``<workdir>/checkpoints`` or ``<workdir>/best``.
    progress: called with one line per stage (None: silent).
    options: the protocol's keyword options (:func:`protocol_options`).

  Raises:
    EvaluationError and the trainer's one-line errors (``USER_ERRORS``).
  """
  from posenc_jax.evaluation import report  # noqa: PLC0415

  check_protocol(protocol, options)
  route_table.points()  # a bad $POSENC_JAX_ROUTE_TABLE is one line before any work
  run = load_run(workdir, checkpoint)
  made = None  # the folder check_out created, removed again if the protocol refuses
  if out is not None:
    existed = epath.Path(out).exists()
    out = report.check_out(out, run.workdir)
    made = None if existed else epath.Path(out)
  try:
    document = {"scheme": presets.scheme_name(run.config.model.to_dict()),
                **PROTOCOLS[protocol](run, progress=progress or _quiet, **options)}
  except BaseException:
    if made is not None and made.is_dir() and not any(made.iterdir()):
      made.rmdir()
    raise
  if out is not None:
    report.write(document, out, progress=progress or _quiet)
  return document
