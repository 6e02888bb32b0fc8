"""A trained workdir's model, restored read-only, and what the evaluation protocols
(:mod:`posenc_jax.evaluation.protocols`) share: the run (:func:`load_run`), the split's token
stream cut into windows (:func:`token_stream`, :func:`window_batches`), the model at a length
(:func:`model_at`), scoring a batch (:func:`score`) and the memory check before compiling
(:func:`check_memory`). Nothing is ever written under ``<workdir>/checkpoints`` or
``<workdir>/best``.

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
import math
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from etils import epath

from posenc_jax import memory
from posenc_jax.paths import absolute
from posenc_jax.data import unigram
from posenc_jax.evaluation import windows as windows_lib
from posenc_jax.messages import first_line
from posenc_jax.models.build import abstract_params, build_model
from posenc_jax.models.config import model_config
from posenc_jax.training import checkpoint as checkpoint_lib
from posenc_jax.training.config import validate_train_config
from posenc_jax.training.errors import USER_ERRORS
from posenc_jax.training.objectives import objective
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
  try:  # foreign input: a config.json edited by hand holds any value
    validate_train_config(config)
  except USER_ERRORS as e:
    raise EvaluationError(f"workdir: {epath.Path(workdir) / CONFIG_FILE}: {first_line(e)}; not "
                          "the config a run writes") from None
  model = build_model(saved["model"], config.head, num_labels=config.get("num_labels", 2))
  abstract = abstract_params(model)
  if checkpoint == "best":
    step, params = _restore_best(workdir, abstract)
  else:
    step, params = checkpoint_lib.restore_params(
        workdir, abstract, step=None if checkpoint == "latest" else checkpoint)
  return Run(workdir, config, model, params, step, checkpoint)


def quiet(message: str) -> None:
  """A ``progress`` that says nothing."""
  del message


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
          batch_size: int, progress: Callable[[str], None] = quiet) -> dict[str, float]:
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
