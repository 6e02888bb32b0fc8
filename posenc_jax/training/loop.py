"""The training loop, read top to bottom: config, mesh, data, state with shardings,
jitted step with donated state, periodic eval, checkpoint, metrics.

``train(config, workdir)`` is what ``train.py`` runs. A run resumes from the
newest complete checkpoint in ``workdir``: state and data position, so it
sees exactly the examples an uninterrupted run would. A NaN or Inf loss is
never applied (the step keeps the old state), and stops the run with one
message naming the step and the last good checkpoint. SIGTERM or SIGINT
(preemption, ``kill``, Ctrl-C) lets the step in flight finish, saves it, and
stops with one line (:class:`~posenc_jax.training.signals.TrainingInterrupted`).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from etils import epath
from flax.training import train_state
from jax.experimental import multihost_utils

from posenc_jax import route_table
from posenc_jax.paths import OutputPathError, absolute, check_output_dir, hold, write_atomic
from posenc_jax.data import probes, unigram
from posenc_jax.data.randomized_positions import randomized_batches
from posenc_jax.models.build import build_model
from posenc_jax.models.config import ModelConfig, model_config
from posenc_jax.schemes.registry import scheme_parts
from posenc_jax.training import mesh as mesh_lib
from posenc_jax.training import workdir as workdir_lib
from posenc_jax.training.checkpoint import Checkpointer, check_writable
from posenc_jax.training.config import (TrainConfigError, compilation_cache_dir,
                                        max_predictions, validate_train_config)
from posenc_jax.training.memory import check_train_memory
from posenc_jax.training.metrics import (MetricWriter, Throughput, console_line, eval_line,
                                         train_flops_per_step)
from posenc_jax.training.objectives import (OUTPUT_LOSSES, PRETRAINING, loss_and_outputs,
                                            objective)
from posenc_jax.training.optim import make_optimizer
from posenc_jax.training.signals import StopSignals, TrainingInterrupted

Batch = dict[str, Any]


class NonFiniteLossError(RuntimeError):
  """The loss or the gradients became NaN or Inf."""


class DataError(ValueError):
  """A batch holds values the model cannot embed."""


def batch_limits(cfg: ModelConfig) -> dict[str, tuple[int, str]]:
  """``{feature: (bound, name of the bound)}``: ids must lie in ``[0, bound)``."""
  vocab = (cfg.vocab_size, f"model.vocab_size={cfg.vocab_size}")
  limits = {k: vocab for k in ("input_ids", "inputs", "targets", "mlm_targets")}
  for part in () if cfg.segment is None else scheme_parts(cfg.segment):  # segment schemes
    segments = part.values["num_segments"]
    limits["segment_ids"] = (segments, f"model.segment num_segments={segments}")
  return limits


def check_batch(batch: dict[str, np.ndarray], limits: dict[str, tuple[int, str]], step: int,
                predictions: int | None = None) -> dict[str, np.ndarray]:
  """``batch`` (host-local numpy), after checking its ids against ``limits`` (an id outside
  a table would embed as NaN, or be clamped) and its masked positions per row against the
  MLM head's ``predictions`` (more would drop out of the loss)."""
  if predictions and "mlm_weights" in batch:
    most = int(np.max(np.sum(batch["mlm_weights"] > 0, axis=-1), initial=0))
    if most > predictions:
      raise DataError(f"data: a row of the batch for step {step + 1} has {most} masked "
                      f"positions, more than the MLM head's {predictions} "
                      "(max_predictions_per_seq)")
  for key, (bound, name) in limits.items():
    if key in batch and batch[key].size:
      low, high = int(np.min(batch[key])), int(np.max(batch[key]))
      if low < 0 or high >= bound:
        bad = high if high >= bound else low
        raise DataError(f"data: {key} of the batch for step {step + 1} holds {bad}, outside "
                        f"[0, {name})")
  return batch


class TrainState(train_state.TrainState):
  """Step, parameters (float32) and optimizer state."""


def _check_finite(all_finite: jax.Array, step: int, scalars: dict[str, float] | None,
                  checkpointer: Checkpointer) -> None:
  """Raises :class:`NonFiniteLossError` (after pending saves land) if any step so far had a
  non-finite loss, gradient or updated parameters."""
  if bool(all_finite):
    return
  checkpointer.wait()
  last = "" if scalars is None else (f" (last loss {scalars['loss']}, grad norm "
                                     f"{scalars['grad_norm']})")
  raise NonFiniteLossError(
      f"loss or gradients became NaN/Inf by step {step}{last}: stopping; no such update was "
      f"applied and the last good checkpoint is step {checkpointer.last_saved} in "
      f"{checkpointer.directory}")


def _sum_metrics(a: dict[str, jax.Array], b: dict[str, jax.Array]) -> dict[str, jax.Array]:
  return {k: a[k] + b[k] for k in a}


class BestKeeper:
  """Keeps the parameters of the best evaluation (``metric`` higher is better)."""

  def __init__(self, workdir: str, metric: str | None):
    self.metric = metric
    self.path = epath.Path(workdir) / workdir_lib.BEST_FILE
    self.record: dict[str, float] | None = None
    if metric and self.path.exists():
      self.record = workdir_lib.read_object(self.path)
    self.manager = None
    if metric:
      import orbax.checkpoint as ocp  # noqa: PLC0415
      self.directory = os.path.join(absolute(workdir), "best")
      check_writable(self.directory, "best")
      self.manager = ocp.CheckpointManager(
          self.directory,
          options=ocp.CheckpointManagerOptions(max_to_keep=1, create=True))

  def update(self, step: int, scalars: dict[str, float], params: Any) -> None:
    if not self.metric:
      return
    if self.metric not in scalars:
      names = sorted(k for k in scalars if k.startswith(("eval_", "task_")))
      raise TrainConfigError(f"best_metric: {self.metric!r} is not among the evaluation "
                             f"metrics {names}")
    score = scalars[self.metric]
    if self.record is None or score > self.record["score"]:
      import orbax.checkpoint as ocp  # noqa: PLC0415
      # Probed before each save: Orbax, given a folder made read-only mid-run, would wait
      # minutes (its coordination timeout) instead of failing.
      check_writable(self.directory, "best")
      self.manager.save(step, args=ocp.args.StandardSave(params), force=True)
      self.manager.wait_until_finished()
      self.record = {"step": step, "metric": self.metric, "score": score}
      if jax.process_index() == 0:
        write_atomic(self.path, json.dumps(self.record))

  def close(self) -> None:
    if self.manager is not None:
      self.manager.close()


def use_compilation_cache(path: str | None) -> None:
  """Persists compiled programs in ``path`` (created; a bad path is one line naming
  ``compilation_cache_dir``), unless JAX already has a cache directory (e.g. from
  ``JAX_COMPILATION_CACHE_DIR``) or ``path`` is None."""
  if path is None or jax.config.jax_compilation_cache_dir:
    return
  try:
    path = check_output_dir("compilation_cache_dir", path)
  except OutputPathError as e:
    raise TrainConfigError(str(e)) from None
  jax.config.update("jax_compilation_cache_dir", path)


class Profiler:
  """Traces steps ``[first, first + count)`` (1-based step numbers) into ``logdir``
  (TensorBoard's profile plugin and Perfetto read it); process 0 only."""

  def __init__(self, logdir: str, first: int, count: int):
    self.logdir, self.first, self.last = logdir, first, first + count - 1
    self.active = count > 0 and jax.process_index() == 0
    self.tracing = False

  def before(self, step: int) -> None:
    """Call before running step ``step``."""
    if self.active and step == self.first:
      jax.profiler.start_trace(self.logdir)
      self.tracing = True

  def after(self, step: int, outputs: Any) -> None:
    """Call after step ``step``, with its outputs (waited for before the trace stops)."""
    if self.tracing and step >= self.last:
      jax.block_until_ready(outputs)
      jax.profiler.stop_trace()
      self.tracing = False
      print(f"profile of steps {self.first}-{self.last} in {self.logdir} (TensorBoard: "
            "Profile tab)", flush=True)


def make_train_step(model: nn.Module, config: ml_collections.ConfigDict,
                    schedule: optax.Schedule) -> Callable:
  """``step(state, batch, rng) -> (state, metrics)``, accumulating ``grad_accum_steps``
  micro-batches; the update is skipped (state kept) when the loss, the gradients or the
  updated parameters' norm (overflowing float32) are not finite."""
  loss_fn = objective(config.objective, max_predictions(config))
  accum = config.grad_accum_steps
  smoothing = config.get("label_smoothing", 0.0)

  def micro_grads(params, micro, rng):
    return jax.grad(lambda p: loss_fn(model, p, micro, rng, smoothing), has_aux=True)(params)

  def step(state: TrainState, batch: Batch, rng: jax.Array):
    rng = jax.random.fold_in(rng, state.step)
    if accum == 1:
      grads, sums = micro_grads(state.params, batch, rng)
    else:
      micro = jax.tree.map(lambda x: x.reshape((accum, -1) + x.shape[1:]), batch)

      def body(carry, xs):
        index, micro_batch = xs
        g, m = micro_grads(state.params, micro_batch, jax.random.fold_in(rng, index))
        return (jax.tree.map(jnp.add, carry[0], g), _sum_metrics(carry[1], m)), None

      zeros = jax.tree.map(jnp.zeros_like, state.params)
      first = {k: jnp.zeros((), jnp.float32) for k in ("loss", "weight", "correct")}
      (grads, sums), _ = jax.lax.scan(body, (zeros, first), (jnp.arange(accum), micro))
    weight = jnp.maximum(sums["weight"], 1.0)
    grads = jax.tree.map(lambda g: g / weight, grads)  # gradient of the mean loss
    grad_norm = optax.tree.norm(grads)
    updated = state.apply_gradients(grads=grads)
    finite = (jnp.isfinite(sums["loss"]) & jnp.isfinite(grad_norm)
              & jnp.isfinite(optax.tree.norm(updated.params)))
    state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), updated, state)
    state = state.replace(step=updated.step)  # the step (and data position) always advance
    metrics = {"loss": sums["loss"] / weight, "accuracy": sums["correct"] / weight,
               "grad_norm": grad_norm, "learning_rate": schedule(state.step - 1),
               "finite": finite.astype(jnp.float32), "tokens": sums["weight"]}
    return state, metrics

  return step


def jit_train_step(model: nn.Module, config: ml_collections.ConfigDict,
                   schedule: optax.Schedule, state_shardings: Any,
                   mesh: jax.sharding.Mesh) -> Callable:
  """The step :func:`train` runs: :func:`make_train_step` jitted with the state in
  ``state_shardings`` (:func:`init_state`'s) and donated, the batch over ``mesh``'s ``data``
  axis and the rng replicated (``benchmarks.steps`` times this same step)."""
  return jax.jit(make_train_step(model, config, schedule),
                 in_shardings=(state_shardings, mesh_lib.batch_sharding(mesh),
                               mesh_lib.replicated(mesh)),
                 out_shardings=(state_shardings, mesh_lib.replicated(mesh)),
                 donate_argnums=(0,))


def make_eval_step(model: nn.Module, config: ml_collections.ConfigDict,
                   outputs: bool = False) -> Callable:
  """``eval_step(params, batch) -> summed metrics`` (deterministic); with ``outputs`` (an
  objective of ``OUTPUT_LOSSES``), ``-> (summed metrics, the model's outputs)`` of one
  forward pass (:func:`evaluate` collects them for :func:`task_evaluation`)."""
  if outputs:
    with_outputs = loss_and_outputs(config.objective)
    return lambda params, batch: with_outputs(model, params, batch)
  loss_fn = objective(config.objective, max_predictions(config))

  def eval_step(params, batch):
    _, sums = loss_fn(model, params, batch, None)
    return sums

  return eval_step


def init_state(model: nn.Module, tx: optax.GradientTransformation, init_batch: Batch,
               mesh: jax.sharding.Mesh, config: ml_collections.ConfigDict, seed: int
               ) -> tuple[TrainState, Any]:
  """Initialises the state directly into its shardings; returns it and the shardings."""
  inputs = model_inputs(init_batch, config.objective)

  def init(rng):
    variables = model.init(rng, *inputs)
    return TrainState.create(apply_fn=model.apply, params=variables["params"], tx=tx)

  abstract = jax.eval_shape(init, jax.random.key(seed))
  shardings = mesh_lib.shardings(abstract, mesh, mesh_lib.rules(config.mesh))
  unboxed_init = jax.jit(lambda rng: nn.unbox(init(rng)), out_shardings=shardings)
  return unboxed_init(jax.random.key(seed)), shardings


def model_inputs(batch: Batch, objective_name: str) -> tuple[Any, ...]:
  """The positional inputs of ``model.init`` for one batch."""
  if objective_name == "translation":
    return batch["inputs"], batch["targets"], batch["inputs"] > 0
  if objective_name == "lm":
    return (batch["targets"],)
  return batch["input_ids"], batch["segment_ids"], batch["mask"]


def _global(batch: dict[str, np.ndarray], sharding) -> Batch:
  """Host-local numpy batch -> global arrays sharded over ``data``."""
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
          for k, v in batch.items()}


def _host_scalars(metrics: dict[str, jax.Array]) -> dict[str, float]:
  return {k: float(v) for k, v in jax.device_get(metrics).items()}


def _perplexity(loss: float) -> float:
  return math.exp(min(loss, 700.0))  # no overflow


def scored_targets(batch: dict[str, np.ndarray], objective_name: str,
                   predictions: int | None = None) -> tuple[np.ndarray, np.ndarray]:
  """``(targets, weights)`` ``[B, L]`` of the tokens a pre-training batch's loss scores: a
  masked LM's masked tokens (the first ``predictions`` of a row when its head reads that
  many positions), a causal LM's weighted (or non-padding) targets."""
  if objective_name == "mlm":
    targets, weights = batch["mlm_targets"], np.asarray(batch["mlm_weights"], np.float64)
    if predictions:
      weights = weights * (np.cumsum(weights > 0, axis=1) <= predictions)
    return targets, weights
  targets = batch["targets"]
  return targets, np.asarray(batch.get("loss_weights", targets > 0), np.float64)


def unigram_reference(config: ml_collections.ConfigDict
                      ) -> tuple[np.ndarray, str, int | None] | None:
  """``evaluate``'s ``reference`` for a pre-training run: the ``[V]`` log-probabilities of
  the add-one smoothed unigram model of the task's ``train`` split
  (:mod:`posenc_jax.data.unigram`; counted once per process), the objective and the masked
  LM's predictions per row; None for other objectives and for synthetic probes."""
  if config.objective not in PRETRAINING or probes.is_probe(config.task):
    return None
  counts = unigram.train_counts(config.objective, config.task,
                                model_config(config.model).vocab_size)
  return unigram.log_probs(counts), config.objective, max_predictions(config)


def evaluate(eval_step, params, batches: Iterator, sharding, perplexity: bool = False,
             reference: tuple[np.ndarray, str, int | None] | None = None,
             outputs: list | None = None) -> dict[str, float]:
  """Mean loss and accuracy over the eval batches, and (``perplexity``) ``exp`` of the
  mean loss as ``eval_perplexity``. ``reference`` = ``(log_p [V], objective, predictions)``
  adds ``eval_unigram_perplexity``: the unigram model's perplexity of the same scored tokens
  (:func:`scored_targets`), summed over every host's batches as the loss is. With
  ``outputs`` (a list; ``eval_step`` of ``make_eval_step(..., outputs=True)``), each batch's
  ``(model outputs, batch)`` is appended to it."""
  total, unigram_loss, unigram_weight = None, 0.0, 0.0
  for batch in batches:
    result = eval_step(params, _global(batch, sharding))
    sums = result if outputs is None else result[0]
    if outputs is not None:
      outputs.append((np.asarray(result[1]), batch))
    total = sums if total is None else _sum_metrics(total, sums)
    if reference is not None:
      log_p, objective_name, predictions = reference
      targets, weights = scored_targets(batch, objective_name, predictions)
      unigram_loss -= float((log_p[targets] * weights).sum())
      unigram_weight += float(weights.sum())
  if total is None:
    return {}
  if reference is not None and jax.process_count() > 1:  # each host scored its own rows
    unigram_loss, unigram_weight = np.asarray(multihost_utils.process_allgather(
        np.array([unigram_loss, unigram_weight], np.float32))).astype(np.float64).sum(
            axis=0).tolist()
  total = _host_scalars(total)
  weight = max(total["weight"], 1.0)
  scalars = {"eval_loss": total["loss"] / weight, "eval_accuracy": total["correct"] / weight}
  if perplexity:
    scalars["eval_perplexity"] = _perplexity(scalars["eval_loss"])
  if reference is not None and unigram_weight:
    scalars["eval_unigram_perplexity"] = _perplexity(unigram_loss / unigram_weight)
  return scalars


def task_evaluation(config, model, params, data, sharding=None,
                    outputs: list | None = None) -> dict[str, float]:
  """The task's own metrics on the validation split (classification and regression: from
  ``outputs``, :func:`evaluate`'s of the same split in one process, when given).

  Translation: beam search on ``config.decode.eval_batches`` batches (BLEU for
  WMT). Classification and regression: predictions on the whole split, scored
  by the task's ``metric_fns`` (MCC, F1, Pearson/Spearman, accuracy). Span
  prediction: SQuAD/MLQA F1 and EM of the answers decoded from the logits.

  Every process reads the same batches (``data(..., shard_id=0, num_shards=1)``,
  not its host shard); in multi-process jobs each hands its rows to the model
  (``sharding``: the batch sharding, by default that of ``params``' mesh) and
  gets every example's prediction back, so the metrics are those of one process.
  """
  if config.objective not in ("translation", "classification", "regression", "span"):
    return {}
  from posenc_jax.training import task_eval  # noqa: PLC0415
  if jax.process_count() > 1 and sharding is None:
    sharding = task_eval.batch_sharding_of(params)
  whole = dict(shard_id=0, num_shards=1)  # the same examples, in order, on every process
  task = config.get("eval_task") or config.task
  if config.objective == "span":
    return task_eval.span_metrics(model, params, task, config.get("eval_split") or "validation",
                                  config.seq_len, config.batch_size, config.get("eval_batches"),
                                  sharding=sharding)
  if config.objective == "translation":
    decode = config.get("decode")
    if not decode or not decode.eval_batches:
      return {}
    batches = itertools.islice(data(config, "validation", 0, **whole), decode.eval_batches)
    predictions, references = task_eval.decode_batches(model, params, batches, decode,
                                                       sharding=sharding)
  elif outputs is not None:
    predictions, references = task_eval.row_predictions(outputs, config.objective)
  else:
    predictions, references = task_eval.predict_batches(
        model, params, data(config, "validation", 0, **whole), config.objective,
        sharding=sharding)
  return task_eval.task_metrics(task, predictions, references)


def _train_batches(data: Callable[..., Iterator], config: ml_collections.ConfigDict,
                   start_step: int, host: dict[str, int], checkpointer: Checkpointer) -> Iterator:
  """The training batches from ``start_step``: the pipeline built at step 0 with the input
  state of checkpoint ``start_step`` restored into it (a cost independent of the step), or,
  when there is none (or the iterator has no state), the pipeline rebuilt at ``start_step``
  by the step number; with ``config.randomized_positions``, their position ids drawn from
  the step on (:mod:`posenc_jax.data.randomized_positions`)."""
  batches = data(config, "train", 0, **host) if start_step else None
  if batches is not None and checkpointer.restore_input(start_step, batches):
    logging.info("input pipeline restored from its state at step %d", start_step)
  else:
    batches = data(config, "train", start_step, **host)
  return randomized_batches(config, batches, start_step, host["shard_id"])


def summary_line(history: list[dict[str, float]]) -> str:
  """The end of a run: ``first loss 9.0066 (step 1), last loss 4.2210 (step 500); eval
  perplexity 301.2 against the unigram's 978.1 (0.31x) at step 500`` (the last evaluation
  with a unigram reference, when there is one)."""
  line = (f"first loss {history[0]['loss']:.4f} (step {history[0]['step']}), last loss "
          f"{history[-1]['loss']:.4f} (step {history[-1]['step']})")
  evaluated = [h for h in history if "eval_unigram_perplexity" in h]
  if evaluated:
    last = evaluated[-1]
    ppl, reference = last["eval_perplexity"], last["eval_unigram_perplexity"]
    line += (f"; eval perplexity {ppl:.1f} against the unigram's {reference:.1f} "
             f"({ppl / reference:.2f}x) at step {last['step']}")
  return line


def train(config: ml_collections.ConfigDict, workdir: str,
          data: Callable[..., Iterator[dict[str, np.ndarray]]] | None = None,
          init_params: Callable[[Any], Any] | None = None) -> dict[str, Any]:
  """Trains ``config`` in ``workdir``; returns the final state and metrics.

  Args:
    config: a train config (``configs/pretrain.py``, ``configs/translate.py``,
      ``configs/lm.py``).
    workdir: checkpoints, ``metrics.jsonl`` and TensorBoard events go here.
    data: ``data(config, split, start_step, shard_id, num_shards)`` -> iterator of
      host-local numpy batches; None uses :mod:`posenc_jax.training.input_pipeline`. A
      training iterator with ``save_state(prefix)`` and ``restore_state(prefix)``
      (``InputIterator``) has its state saved with every checkpoint and restored on resume.
    init_params: maps the fresh parameters to the starting ones (fine-tuning from a
      pre-trained model); not applied when resuming from a checkpoint.

  With ``config.best_metric`` set (e.g. ``eval_accuracy``), the parameters of the
  best evaluation so far are kept in ``<workdir>/best`` and the score in
  ``<workdir>/best.json``.

  Raises:
    NonFiniteLossError: the loss became NaN or Inf (the last good checkpoint stays).
    RouteTableError: ``$POSENC_JAX_ROUTE_TABLE`` names a missing or malformed file.
  """
  route_table.points()  # a bad $POSENC_JAX_ROUTE_TABLE is one line before any work
  cfg = validate_train_config(config)  # before anything is compiled or written
  mesh = mesh_lib.make_mesh(config.mesh.shape, config.mesh.axes)
  mesh_lib.check_batch(config.batch_size, mesh)
  check_train_memory(config, cfg, mesh)  # before any allocation or compile: one line
  default_data = data is None
  if data is None:
    from posenc_jax.training.input_pipeline import (  # noqa: PLC0415
        EvaluationBatches, check_data_config, check_examples, make_batches)
    check_data_config(config)
    check_examples(config)  # an empty split: one line, not an endless search
    data = EvaluationBatches(make_batches)
  workdir_lib.claim(workdir, config)  # refuses another config's workdir, touching nothing
  if jax.process_index() == 0:
    hold("workdir", workdir)  # one process writes it: a second is one line with the pid
  use_compilation_cache(compilation_cache_dir(config))
  model = build_model(cfg, config.head, num_labels=config.get("num_labels", 2))
  tx, schedule = make_optimizer(config.optimizer, config.total_steps)
  batch_sharding = mesh_lib.batch_sharding(mesh)
  host = dict(shard_id=jax.process_index(), num_shards=jax.process_count())

  checkpointer = Checkpointer(workdir, save_interval_steps=config.checkpoint_every,
                              max_to_keep=config.keep_checkpoints,
                              async_save=config.async_checkpointing)
  limits = batch_limits(cfg)
  predictions = max_predictions(config)
  first_batch = check_batch(next(data(config, "train", 0, **host)), limits, 0, predictions)
  state, state_shardings = init_state(model, tx, _global(first_batch, batch_sharding), mesh,
                                      config, config.seed)
  start_step = 0
  restored = checkpointer.restore_latest(
      jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                   state, state_shardings))
  if restored is not None:
    start_step, state, data_state = restored
    logging.info("resumed from step %d (data position %s)", start_step, data_state)
  elif init_params is not None:
    params = init_params(jax.device_get(state.params))  # on the host, then placed
    state = state.replace(params=jax.device_put(params, state_shardings.params))
  train_batches = _train_batches(data, config, start_step, host, checkpointer)

  step_fn = jit_train_step(model, config, schedule, state_shardings, mesh)
  # One process reads the whole split: the loss pass's outputs are the task's predictions.
  one_pass = config.objective in OUTPUT_LOSSES and jax.process_count() == 1
  eval_fn = jax.jit(make_eval_step(model, config, outputs=one_pass))
  writer = MetricWriter(workdir, start_step)
  best = BestKeeper(workdir, config.get("best_metric"))
  length = config.get("target_len") or config.seq_len
  tokens_per_step = config.batch_size * length
  flops = train_flops_per_step(
      cfg, config.batch_size, config.get("input_len") or config.seq_len,
      target_length=config.get("target_len"), predictions_per_seq=predictions,
      head=config.head, num_labels=config.get("num_labels", 2))
  throughput = Throughput(config.total_steps, tokens_per_step, flops, dtype=cfg.dtype)
  rng = jax.random.key(config.seed + 1)
  history: list[dict[str, float]] = []
  say = print if jax.process_index() == 0 else (lambda *a, **k: None)
  say(f"training {config.total_steps} steps from step {start_step} on {jax.device_count()} "
        f"devices, mesh {dict(mesh.shape)}, workdir {workdir}", flush=True)

  step = start_step
  all_finite = jnp.array(True)  # combined on device, read only when logging or saving
  # After the compile (first) and one warm-up step of this start.
  profiler = Profiler(os.path.join(workdir, "tensorboard"), start_step + 3,
                      min(config.profile_steps, config.total_steps - start_step - 2))
  stop = StopSignals()
  with stop:
    while step < config.total_steps:
      # Multi-process jobs agree on a stop at logging steps (a collective), others at once.
      if (jax.process_count() == 1 or step % config.log_every == 0) and stop.agreed():
        break
      checkpointer.check()  # a failed background save stops the run here
      batch = _global(check_batch(next(train_batches), limits, step, predictions),
                      batch_sharding)
      compile_start = time.perf_counter()
      profiler.before(step + 1)
      state, metrics = step_fn(state, batch, rng)
      step += 1
      profiler.after(step, metrics)
      if throughput.compile_seconds is None:
        jax.block_until_ready(metrics)
        throughput.compile_seconds = time.perf_counter() - compile_start
        throughput.start(step)
      all_finite = all_finite & (metrics["finite"] > 0)
      log_now = (step % config.log_every == 0 or step == config.total_steps
                 or step == start_step + 1)
      save_now = step % config.checkpoint_every == 0 or step == config.total_steps
      if log_now or save_now:
        scalars = _host_scalars(metrics)
        scalars.pop("finite")
        _check_finite(all_finite, step, scalars, checkpointer)
        if log_now:
          scalars.pop("tokens")
          scalars |= throughput.report(step)
          scalars["compile_s"] = throughput.compile_seconds
          if config.eval_every and (step % config.eval_every == 0 or step == config.total_steps):
            # The default pipeline's split is what the reference counts.
            reference = unigram_reference(config) if default_data else None
            outputs = [] if one_pass else None
            scalars |= evaluate(eval_fn, state.params,
                                randomized_batches(config, data(config, "validation", 0, **host),
                                                   0, host["shard_id"], evaluation=True),
                                batch_sharding, perplexity=config.objective in PRETRAINING,
                                reference=reference, outputs=outputs)
            scalars |= task_evaluation(config, model, state.params, data, batch_sharding,
                                       outputs)
            best.update(step, scalars, state.params)
          writer.write(step, scalars)
          history.append({"step": step, **scalars})
          say(console_line(step, config.total_steps, scalars), flush=True)
          evaluated = eval_line(step, scalars)
          if evaluated:
            say(evaluated, flush=True)
        if save_now:
          checkpointer.save(step, state, {"step": step}, force=True,
                            input_iterator=train_batches)
  if stop.signum is not None and step < config.total_steps:
    _check_finite(all_finite, step, None, checkpointer)
    if checkpointer.last_saved != step:
      checkpointer.save(step, state, {"step": step}, force=True, input_iterator=train_batches)
    checkpointer.close()
    best.close()
    writer.close()
    name = signal.Signals(stop.signum).name
    raise TrainingInterrupted(f"stopped by {name} after step {step}: checkpoint {step} saved in "
                              f"{checkpointer.directory}; run the same command to resume")
  checkpointer.close()
  best.close()
  writer.close()
  if history:
    say(summary_line(history), flush=True)
  return {"state": state, "history": history, "mesh": mesh, "best": best.record}
