"""Train configs: the defaults every ``configs/*.py`` starts from, and validation
that fails before anything is compiled, with one line naming the field."""

from __future__ import annotations

import math
import os

import ml_collections

from posenc_jax.data.randomized_positions import EVAL_POSITIONS, TOKENS
from posenc_jax.messages import nearest
from posenc_jax.models.build import HEADS, check_head
from posenc_jax.models.config import ModelConfig, position_schemes
from posenc_jax.schemes.registry import scheme_parts
from posenc_jax.training.mesh import check_mesh_config
from posenc_jax.training.objectives import HEAD_OF, OBJECTIVES
from posenc_jax.training.optim import check_optimizer_config, default_optimizer_config


class TrainConfigError(ValueError):
  """An invalid train config field."""


def base_train_config() -> ml_collections.ConfigDict:
  """Fields shared by pre-training and translation (the config files fill the rest)."""
  config = ml_collections.ConfigDict()
  config.objective = "mlm"
  config.head = "mlm"
  config.task = "wordnet_glosses"
  config.seq_len = 128
  config.mask_rate = 0.15
  # MLM head positions per row (BERT's); None: as many as mask_rate masks; 0: every position.
  config.max_predictions_per_seq = ml_collections.config_dict.placeholder(int)
  config.batch_size = 32
  config.grad_accum_steps = 1
  config.label_smoothing = 0.0
  config.total_steps = 1000
  config.seed = 0
  config.optimizer = default_optimizer_config()
  config.log_every = 50
  config.eval_every = 500
  config.eval_steps = 10
  config.checkpoint_every = 500
  config.keep_checkpoints = 3
  config.async_checkpointing = True
  # Compiled steps persist here and are reused by the next start with the same program
  # (None: the user's cache dir, see compilation_cache_dir(); "": off).
  config.compilation_cache_dir = ml_collections.config_dict.placeholder(str)
  # Pre-training input (mlm, lm): "source": each host reads, packs and masks only its part of
  # the split; "stream": every host packs the whole stream and keeps its positions (the union
  # of the hosts' batches is one host's batch). One host: the same batches either way.
  config.data_sharding = "source"
  # Keep the packed training epoch in host memory: "auto" (when a host's share of the
  # split's source files is under 256 MiB), "true" or "false".
  config.cache_data = "auto"
  # Masked-LM packing: False lets attention cross the packed lines with positions 0..L-1
  # (RoBERTa's FULL-SENTENCES, the papers' setup); True makes each line its own packed
  # segment (attention within it, positions restarting at 0), as T5 packs.
  config.packed_segments = False
  config.profile_steps = 0  # trace this many steps after warm-up into <workdir>/tensorboard
  # A TFDS dataset the task reads that is not prepared in TFDS's data folder: False refuses in
  # one line naming it and how to prepare it; True downloads and prepares it in this run.
  config.prepare_data = False
  # Randomized positions (Ruoss et al. 2023; mlm and lm): N, each training example's position
  # ids a sorted random subset of [0, N) (None: off); evaluation "randomized" (the paper's)
  # or "plain" (0..n-1). posenc_jax.data.randomized_positions.
  config.randomized_positions = ml_collections.config_dict.placeholder(int)
  config.randomized_positions_eval = "randomized"
  config.mesh = ml_collections.ConfigDict(dict(shape=(-1, 1), axes=("data", "model"),
                                               rules=()))
  return config


def _fail(field: str, value, allowed: str):
  raise TrainConfigError(f"{field}: got {value!r}; allowed: {allowed}")


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(config, field: str) -> None:
  value = config[field]
  if not (_is_int(value) and value > 0):
    _fail(field, value, "a positive integer")


def absolute_table_schemes(cfg: ModelConfig) -> list[str]:
  """Names of the parts of the position schemes (``cfg.scheme`` and the alternate scheme
  some layers run, :func:`~posenc_jax.models.config.position_schemes`) that own an absolute
  position table."""
  return [part.name for _, form in position_schemes(cfg) for part in scheme_parts(form)
          if part.module.absolute_table]


def compilation_cache_dir(config: ml_collections.ConfigDict) -> str | None:
  """Where compiled steps persist: ``config.compilation_cache_dir``, or for None
  ``$XDG_CACHE_HOME/posenc_jax/xla`` (``~/.cache/...``); None when it is ``""`` (off)."""
  path = config.get("compilation_cache_dir")
  if path is None:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "posenc_jax", "xla")
  return path or None


CACHE_DATA = ("auto", "true", "false")
DATA_SHARDINGS = ("source", "stream")  # posenc_jax.data.preprocessors.SHARDINGS


def cache_data(config: ml_collections.ConfigDict) -> bool | str:
  """``config.cache_data`` (``"auto"``, ``"true"``, ``"false"``, any case; a bool in a
  config built without the default) as the input pipeline's ``cache``: ``"auto"``, True or
  False."""
  value = config.get("cache_data", "auto")
  if isinstance(value, bool):
    return value
  if isinstance(value, str) and value.lower() in CACHE_DATA:
    return {"true": True, "false": False}.get(value.lower(), "auto")
  _fail("cache_data", value, ", ".join(CACHE_DATA))


def most_masked(config: ml_collections.ConfigDict) -> int:
  """The most positions ``mask_rate`` masks in a row of ``seq_len`` ([CLS] is never masked)."""
  return math.ceil(config.mask_rate * (config.seq_len - 1))


def max_predictions(config: ml_collections.ConfigDict) -> int | None:
  """The MLM head's positions per row: ``max_predictions_per_seq``, or :func:`most_masked`
  when it is None; None (every position) when it is 0 or the objective is not MLM."""
  if config.objective != "mlm":
    return None
  predictions = config.get("max_predictions_per_seq")
  return most_masked(config) if predictions is None else (predictions or None)


def validate_train_config(config: ml_collections.ConfigDict) -> ModelConfig:
  """The validated model config of ``config``, after checking every field.

  Raises one :class:`TrainConfigError` (or a Model-, Optimizer- or MeshConfigError) line
  naming the bad field.
  """
  for field, allowed in (("objective", OBJECTIVES), ("head", HEADS)):
    if config[field] not in allowed:
      raise TrainConfigError(f"{field}: got {config[field]!r}{nearest(config[field], allowed)} "
                             f"allowed: {', '.join(allowed)}")
  expected_head = HEAD_OF[config.objective]
  if config.head != expected_head:
    _fail("head", config.head, f"{expected_head!r} for objective {config.objective!r}")
  for field in ("seq_len", "batch_size", "total_steps", "grad_accum_steps", "log_every",
                "checkpoint_every", "keep_checkpoints", "eval_steps"):
    _positive_int(config, field)
  if config.seq_len < 2:
    _fail("seq_len", config.seq_len, "an integer >= 2 ([CLS] and one token)")
  for field in ("eval_every", "seed"):
    if not (_is_int(config[field]) and config[field] >= 0):
      _fail(field, config[field], "an integer >= 0" + (" (0: no evaluation)"
                                                        if field == "eval_every" else ""))
  if not (_is_int(config.profile_steps) and 0 <= config.profile_steps <= config.total_steps - 2):
    _fail("profile_steps", config.profile_steps, f"an integer in [0, total_steps - 2 = "
          f"{config.total_steps - 2}] (the first two steps compile and warm up)")
  cache = config.get("compilation_cache_dir")
  if not (cache is None or isinstance(cache, str)):
    _fail("compilation_cache_dir", cache, "a directory, '' (off) or None (the user cache dir)")
  sharding = config.get("data_sharding", "stream")  # configs without the field: the old way
  if sharding not in DATA_SHARDINGS:
    _fail("data_sharding", sharding, "'source' or 'stream'")
  cache_data(config)
  segments = config.get("packed_segments", False)
  if not isinstance(segments, bool):
    _fail("packed_segments", segments, "true or false")
  if segments and config.objective != "mlm":
    _fail("packed_segments", segments, f"false for objective {config.objective!r} (packed "
          "segments are the masked-LM pipeline's)")
  if not isinstance(config.async_checkpointing, bool):
    _fail("async_checkpointing", config.async_checkpointing, "true or false")
  if not (isinstance(config.mask_rate, (int, float)) and 0 < config.mask_rate <= 1):
    _fail("mask_rate", config.mask_rate, "a number in (0, 1]")
  predictions = config.get("max_predictions_per_seq")
  if predictions:
    most = most_masked(config)
    if config.objective != "mlm":
      _fail("max_predictions_per_seq", predictions, "None or 0 (it sets the MLM head's "
            "positions)")
    if not (_is_int(predictions) and most <= predictions <= config.seq_len):
      _fail("max_predictions_per_seq", predictions,
            f"0, or an integer in [{most}, seq_len={config.seq_len}] (mask_rate="
            f"{config.mask_rate} masks up to {most} positions of a row)")
  if config.batch_size % config.grad_accum_steps:
    _fail("batch_size", config.batch_size,
          f"a multiple of grad_accum_steps={config.grad_accum_steps}")
  if not (isinstance(config.label_smoothing, (int, float)) and 0 <= config.label_smoothing < 1):
    _fail("label_smoothing", config.label_smoothing, "a number in [0, 1)")
  check_optimizer_config(config.optimizer, config.total_steps)
  check_mesh_config(config.mesh)
  cfg = check_head(config.model, config.head)  # ModelConfigError names model.<field>
  lengths = [config.seq_len] + [config.get(f) for f in ("input_len", "target_len")
                                if config.get(f)]
  if max(lengths) > cfg.max_len:
    tables = absolute_table_schemes(cfg)
    if tables or cfg.attention == "linformer":
      what = f"scheme {tables[0]!r}" if tables else "Linformer's E/F"
      raise TrainConfigError(f"seq_len: {max(lengths)} exceeds model.max_len={cfg.max_len}, "
                             f"the length {what} covers")
  check_randomized_positions(config, cfg)
  return cfg


def check_randomized_positions(config: ml_collections.ConfigDict, cfg: ModelConfig) -> None:
  """``randomized_positions`` (``N``: training position ids drawn from ``[0, N)``,
  :mod:`posenc_jax.data.randomized_positions`; None: off) is an integer ``>= seq_len``, for
  an objective whose batches carry position ids, within every absolute position table, and
  ``randomized_positions_eval`` one of ``EVAL_POSITIONS``."""
  evaluation = config.get("randomized_positions_eval", EVAL_POSITIONS[0])
  if evaluation not in EVAL_POSITIONS:
    _fail("randomized_positions_eval", evaluation, ", ".join(map(repr, EVAL_POSITIONS)))
  n = config.get("randomized_positions")
  if n is None:
    return
  if not (_is_int(n) and n >= config.seq_len):
    _fail("randomized_positions", n, f"None (off) or an integer >= seq_len={config.seq_len} "
          "(the ids are drawn from [0, randomized_positions))")
  if config.objective not in TOKENS:
    _fail("randomized_positions", n, f"None for objective {config.objective!r} (randomized "
          f"positions are for objectives {', '.join(map(repr, TOKENS))})")
  tables = absolute_table_schemes(cfg)
  if tables and n > cfg.max_len:
    raise TrainConfigError(f"randomized_positions: {n} exceeds model.max_len={cfg.max_len}, "
                           f"the size of scheme {tables[0]!r}'s absolute position table")

