"""Host-local batches for the trainer from seqio tasks (TensorFlow stays in here).

Every host reads its own shard of the data (pre-training: of the source or of the global
stream, ``config.data_sharding``), and a run resumed at step ``s`` starts from exactly the
batch an uninterrupted run would see at step ``s``: training batches (pre-training, causal
LM, translation, fine-tuning) come as an :class:`InputIterator`, whose ``tf.data`` state the
checkpoints hold (resuming costs the same at any step); without that state (old
checkpoints, another host count, a source with Python state) the pipelines, deterministic
in the seed and the step, are rebuilt at ``start_step``.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Iterator

import ml_collections
import numpy as np

from posenc_jax.data import probes
from posenc_jax.models.config import model_config
from posenc_jax.training.config import TrainConfigError, cache_data


class InputIterator:
  """Numpy batches of a ``tf.data`` pipeline whose position can be saved and restored.

  ``save_state(prefix)`` writes the iterator's state (``tf.train.Checkpoint(iterator=...)``: files
  ``<prefix>.index`` and ``<prefix>.data-*``) after the batches taken so far;
  ``restore_state(prefix)`` on a fresh iterator of the same pipeline continues from there, at a
  cost independent of the position (:mod:`posenc_jax.data.preprocessors`: what the state
  holds, and its size).

  A pipeline holding Python state (``tf.py_function``, ``from_generator``: e.g. some TFDS
  builders, or ``tfds.testing.mock_data``) cannot be saved: the first ``save_state`` finds
  out, writes nothing, logs one line and sets ``checkpointable`` False, so checkpoints
  leave the input out and a resume rebuilds the pipeline at the step.
  """

  def __init__(self, dataset):
    self._iterator = iter(dataset)
    self.checkpointable = True

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    import tensorflow as tf  # noqa: PLC0415

    return tf.nest.map_structure(lambda t: t.numpy(), next(self._iterator))

  def _checkpoint(self):
    import tensorflow as tf  # noqa: PLC0415

    return tf.train.Checkpoint(iterator=self._iterator)

  def save_state(self, prefix: str) -> None:
    import tensorflow as tf  # noqa: PLC0415

    if not self.checkpointable:
      return
    try:
      self._checkpoint().write(prefix)
    except tf.errors.FailedPreconditionError as e:  # a stateful op: nothing was written
      self.checkpointable = False
      logging.warning("the input pipeline cannot save its position (%s); a resume rebuilds "
                      "it at the step, a cost that grows with the step",
                      str(e).strip().splitlines()[0])

  def restore_state(self, prefix: str) -> None:
    self._checkpoint().read(prefix).assert_consumed()


class EvaluationBatches:
  """``data`` (``data(config, split, start_step, shard_id, num_shards)``), with every
  evaluation split read from its source once: a pass that reaches the split's end, with at
  most ``limit_bytes`` of arrays, is kept in host memory (read-only) and replayed to the
  evaluations after it; a larger split, or a pass stopped early, is read again next time.

  Evaluation batches are the same at every evaluation (:func:`make_batches`), so a replay
  equals a fresh read; it saves rebuilding the split's ``tf.data`` pipeline and tokenising
  it again at every evaluation after the first (and, with several processes, for the task's
  metrics, which read the whole split beside each host's shard).
  Training batches (``split`` ``"train"``) are ``data``'s own.
  """

  def __init__(self, data, limit_bytes: int = 256 * 2**20):
    self._data, self._limit = data, limit_bytes
    self._kept: dict[tuple, list[dict[str, np.ndarray]]] = {}

  def __call__(self, config, split: str, start_step: int, shard_id: int = 0,
               num_shards: int = 1) -> Iterator[dict[str, np.ndarray]]:
    key = (split, start_step, shard_id, num_shards)
    if key in self._kept:
      return iter(self._kept[key])
    batches = self._data(config, split, start_step, shard_id, num_shards)
    return batches if split == "train" else self._recorded(key, batches)

  def _recorded(self, key: tuple, batches: Iterator) -> Iterator[dict[str, np.ndarray]]:
    kept, size = [], 0
    for batch in batches:
      if kept is not None:
        size += sum(np.asarray(v).nbytes for v in batch.values())
        if size <= self._limit:
          kept.append(_read_only(batch))
        else:
          kept = None
      yield batch
    if kept is not None:
      self._kept[key] = kept


def _read_only(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """A copy of ``batch`` whose arrays cannot be written (a replay cannot be altered)."""
  copy = {k: np.array(v) for k, v in batch.items()}
  for value in copy.values():
    value.setflags(write=False)
  return copy


def reads_tensorflow(task: str) -> bool:
  """Whether a run of ``task`` reads its batches through ``tf.data`` (every seqio task; a
  probe's are generated with numpy): the commands start TensorFlow
  (:func:`posenc_jax.cli.start_tensorflow_quietly`, seconds of import) only then."""
  return not probes.is_probe(task)


def _task(name: str):
  import tensorflow as tf  # noqa: PLC0415

  tf.config.set_visible_devices([], "GPU")  # the input pipeline must not take accelerator memory
  import posenc_jax.tasks  # noqa: F401, PLC0415 - registers every task
  import seqio  # noqa: PLC0415

  try:
    return seqio.get_mixture_or_task(name)
  except ValueError:
    raise TrainConfigError(f"task: {name!r} is not a registered seqio task; registered: "
                           f"{', '.join(sorted(seqio.TaskRegistry.names()))}") from None


# The token feature each pre-training objective packs, and a bundled task that has it.
TEXT_FEATURES = {"mlm": ("text", "wordnet_glosses"), "lm": ("targets", "wordnet_glosses_lm")}


def check_data_config(config: ml_collections.ConfigDict) -> None:
  """The task exists, has the token feature the objective packs, and its vocabulary fits the
  model (before anything compiles); a probe (``probe:<name>``, objective ``lm``) has valid
  parameters and fits ``seq_len``."""
  if probes.is_probe(config.task):
    _check_probe_config(config)
    return
  import seqio  # noqa: PLC0415

  task = _task(config.task)
  needed, example = TEXT_FEATURES.get(config.objective, (None, None))
  if needed and needed not in task.output_features:
    raise TrainConfigError(f"task: {config.task!r} has no {needed!r} feature; allowed with "
                           f"objective {config.objective!r}: a task with one, e.g. {example!r}")
  vocab_size = model_config(config.model).vocab_size
  for name, feature in task.output_features.items():
    if isinstance(feature.vocabulary, seqio.PassThroughVocabulary):
      continue  # labels, segment ids, masks: not token ids
    if feature.vocabulary.vocab_size > vocab_size:
      raise TrainConfigError(
          f"model.vocab_size: {vocab_size} is smaller than task {config.task!r}'s "
          f"{name!r} vocabulary ({feature.vocabulary.vocab_size})")
  if not config.get("prepare_data", False):
    for field in ("task", "eval_task"):
      if config.get(field):
        _check_prepared(field, config[field])


def _check_prepared(field: str, name: str) -> None:
  """Task ``name`` reads no TFDS dataset that is missing from its data folder: reading one
  would download and prepare it (many gigabytes for the corpora at scale), which a run does
  only when asked (``prepare_data``). One line naming the dataset and how to prepare it."""
  from posenc_jax.data import tasks  # noqa: PLC0415

  missing = tasks.unprepared(_task(name))
  if missing:
    first = missing[0]
    beam = " (an Apache Beam pipeline)" if first["beam"] else ""
    raise TrainConfigError(
        f"{field}: {name!r} reads the TFDS dataset {first['dataset']!r}, which is not prepared "
        f"in {first['data_dir']} (TFDS's data folder: $TFDS_DATA_DIR, else ~/tensorflow_datasets); prepare it{beam} with `tfds build "
        f"{first['dataset']} --data_dir={first['data_dir']}` (TFDS's command needs `pip "
        "install apache-beam`), or rerun with --config.prepare_data=true to download and "
        "prepare it in this run (nothing was downloaded)")


def sequence_lengths(config: ml_collections.ConfigDict) -> dict[str, int] | None:
  """The ``sequence_length`` the pipeline asks ``config``'s task for (None: pre-training
  packs the task's lines itself)."""
  if config.objective == "translation":
    return {"inputs": config.input_len, "targets": config.target_len}
  if config.objective in FINETUNE_FEATURES:
    return dict.fromkeys(("input_ids", "segment_ids", "mask"), config.seq_len)
  if config.objective == "lm":
    return {"targets": config.seq_len}
  return None


def evaluation_split(config: ml_collections.ConfigDict) -> tuple[str, str]:
  """``(task, split)`` the evaluation reads: fine-tuning's ``eval_task`` and ``eval_split``
  where set, else the task's ``validation`` split."""
  if config.objective in FINETUNE_FEATURES:
    return config.get("eval_task") or config.task, config.get("eval_split") or "validation"
  return config.task, "validation"


def _split_problem(config: ml_collections.ConfigDict, name: str, split: str) -> str | None:
  """What keeps ``split`` of task ``name`` from giving batches (no such split, or no
  example in it: the first is read, in order), or None."""
  task = _task(name)
  if split not in task.splits:
    return f"{name!r} has no {split!r} split (splits: {', '.join(task.splits)})"
  examples = task.get_dataset(sequence_lengths(config), split=split, shuffle=False,
                              num_epochs=1, use_cached=False)
  if not list(examples.take(1)):
    return f"{name!r} has no examples in its {split!r} split"
  return None


def check_examples(config: ml_collections.ConfigDict) -> None:
  """The training split, and with ``eval_every`` the evaluation split, each hold an example
  (an empty training split would have the endless pipeline look for one forever, an empty
  evaluation split evaluate nothing); probes generate theirs.

  Raises:
    TrainConfigError: one line, ``task`` or ``eval_every`` first.
  """
  if probes.is_probe(config.task):
    return
  problem = _split_problem(config, config.task, "train")
  if problem:
    raise TrainConfigError(f"task: {problem}; nothing to train on")
  if config.eval_every:
    problem = _split_problem(config, *evaluation_split(config))
    if problem:
      raise TrainConfigError(f"eval_every: {config.eval_every}, but task {problem}; set "
                             "--config.eval_every=0 or evaluate on a split with examples")


def _check_probe_config(config: ml_collections.ConfigDict) -> None:
  if config.objective != "lm":
    raise TrainConfigError(f"objective: got {config.objective!r}; allowed: 'lm' for task "
                           f"{config.task!r} (probes train the causal LM)")
  spec = probes.config_probe(config)
  spec.check_length(config.seq_len, "seq_len")
  vocab_size = model_config(config.model).vocab_size
  if spec.vocab_size() > vocab_size:
    raise TrainConfigError(f"model.vocab_size: {vocab_size} is smaller than task "
                           f"{config.task!r}'s ids ({spec.vocab_size()})")


def _probe(config, split, start_step, shard_id, num_shards):
  """A probe's batches at ``seq_len``: training from ``start_step`` (seed ``config.seed``),
  evaluation ``eval_steps`` batches of the held-out seed."""
  spec = probes.config_probe(config)
  if split == "train":
    return probes.batches(spec, config.seq_len, config.batch_size, config.seed, start_step,
                          shard_id, num_shards)
  return itertools.islice(probes.batches(spec, config.seq_len, config.batch_size,
                                         probes.HELD_OUT_SEED, 0, shard_id, num_shards),
                          config.eval_steps)


def _translation(config, split, start_step, shard_id, num_shards):
  import seqio  # noqa: PLC0415

  task = _task(config.task)
  lengths = sequence_lengths(config)
  train = split == "train"
  ds = task.get_dataset(lengths, split=split, shuffle=train, seed=config.seed,
                        num_epochs=None if train else 1,
                        shard_info=seqio.ShardInfo(shard_id, num_shards))
  ds = seqio.utils.trim_and_pad_dataset(ds, lengths)
  ds = ds.map(lambda x: {"inputs": x["inputs"], "targets": x["targets"]})
  ds = ds.batch(config.batch_size // num_shards, drop_remainder=True)
  return ds.skip(start_step) if train else ds.take(config.eval_steps)


FINETUNE_FEATURES = {"classification": ("label",), "regression": ("label",),
                     "span": ("start_positions", "end_positions")}


@functools.lru_cache(maxsize=None)
def _split_examples(task_name: str, split: str, length: int) -> int:
  """``N``: examples of a fine-tuning task's split (one pass; cached per process)."""
  import seqio  # noqa: PLC0415

  from posenc_jax.data.preprocessors import count  # noqa: PLC0415
  task = seqio.get_mixture_or_task(task_name)
  return count(task.get_dataset({"input_ids": length, "segment_ids": length, "mask": length},
                                split=split, shuffle=False, num_epochs=1))


def _finetune(config, split, start_step, shard_id, num_shards):
  """Task examples with fixed-length BERT inputs. Training: endless and shuffled, skipped to
  ``start_step``. Evaluation: one pass, the last batch padded with ``weight`` 0 rows (with
  several hosts, each host's shard is first padded to ``ceil(N / num_shards)`` rows, so every
  host has the same number of batches)."""
  import seqio  # noqa: PLC0415
  import tensorflow as tf  # noqa: PLC0415

  train = split == "train"
  task_name, split = (config.task, split) if train else evaluation_split(config)
  task = _task(task_name)
  length = config.seq_len
  ds = task.get_dataset(sequence_lengths(config), split=split, shuffle=train, seed=config.seed,
                        num_epochs=None if train else 1,
                        shard_info=seqio.ShardInfo(shard_id, num_shards))
  keys = ("input_ids", "segment_ids", "mask") + FINETUNE_FEATURES[config.objective]
  ds = ds.map(lambda x: {k: x[k] for k in keys} | {"weight": tf.constant(1.0)})
  local = config.batch_size // num_shards
  if train:
    return ds.batch(local, drop_remainder=True).skip(start_step)
  if num_shards > 1:
    # Every host takes ceil(N / num_shards) rows, its shard then ``weight`` 0 rows, so all
    # hosts run the same number of evaluation steps (a step is a collective over hosts).
    total = _split_examples(task.name, split, length)
    blank = tf.data.Dataset.from_tensors(
        {k: tf.zeros([length if d is None else d for d in spec.shape], spec.dtype)
         for k, spec in ds.element_spec.items()}).repeat()
    ds = ds.concatenate(blank).take(-(-total // num_shards))

  def pad_rows(batch):
    missing = local - tf.shape(batch["weight"])[0]
    return {k: tf.pad(v, [[0, missing]] + [[0, 0]] * (len(v.shape) - 1))
            for k, v in batch.items()}
  return ds.batch(local).map(pad_rows)


def make_batches(config: ml_collections.ConfigDict, split: str, start_step: int,
                 shard_id: int = 0, num_shards: int = 1) -> Iterator[dict[str, np.ndarray]]:
  """Endless training batches from ``start_step``, or the evaluation batches (``eval_steps``
  of them for pre-training, causal LM, probes and translation, the whole split for
  fine-tuning).

  Each batch is this host's ``batch_size / num_shards`` rows (numpy). Training batches
  are an :class:`InputIterator` (its state saved with checkpoints); pre-training's are
  sharded as ``config.data_sharding`` says and cached as ``config.cache_data`` says, and
  its evaluation batches always come from the global stream (``eval_steps`` of them, the
  same on every host count), uncached. A probe's (task ``probe:<name>``,
  :mod:`posenc_jax.data.probes`) are generated from the seed and the step, without state.
  """
  train = split == "train"
  if probes.is_probe(config.task):
    return _probe(config, split, start_step, shard_id, num_shards)
  if config.objective == "translation":
    ds = _translation(config, split, start_step, shard_id, num_shards)
  elif config.objective in FINETUNE_FEATURES:
    ds = _finetune(config, split, start_step, shard_id, num_shards)
  else:
    _task(config.task)
    from posenc_jax.data.causal_lm import lm_dataset  # noqa: PLC0415
    from posenc_jax.data.preprocessors import mlm_dataset  # noqa: PLC0415

    stream = dict(shard_id=shard_id, num_shards=num_shards, repeat=train,
                  start_step=start_step if train else 0,
                  cache=cache_data(config) if train else False,
                  sharding=config.get("data_sharding", "stream") if train else "stream")
    local = config.batch_size // num_shards
    if config.objective == "lm":
      ds = lm_dataset(config.task, split, config.seq_len, local, config.seed, **stream)
    else:
      ds = mlm_dataset(config.task, split, config.seq_len, local, config.seed,
                       mask_rate=config.mask_rate,
                       segments=config.get("packed_segments", False), **stream)
    if not train:
      ds = ds.take(config.eval_steps)
  return InputIterator(ds) if train else ds.as_numpy_iterator()
