"""Command-line overrides a run would drop without a word: :func:`check_overrides`, which
``train.py`` and ``finetune.py`` call with the ``--config.<field>`` paths they were given."""

from __future__ import annotations

import ml_collections

from posenc_jax.data.probes import is_probe
from posenc_jax.data.randomized_positions import TOKENS
from posenc_jax.training.config import TrainConfigError
from posenc_jax.training.workdir import ARCHITECTURE


def _reads_pretraining_stream(config: ml_collections.ConfigDict) -> bool:
  """The run's training batches come from the pre-training stream (objectives mlm and lm,
  not a probe's generated batches): what ``data_sharding`` and ``cache_data`` shape."""
  return config.objective in TOKENS and not is_probe(config.task)


# Train config fields a run reads only in some settings, each with the test that it is read
# and the reason it is not ({objective}, {head}: the config's). Set on the command line where it is
# not read, a field would be dropped without a word: check_overrides refuses it. (The fields
# that validate_train_config refuses by value for another objective, max_predictions_per_seq,
# packed_segments and randomized_positions, are not repeated here.)
READ_WHEN = {
    "mask_rate": (lambda c: c.objective == "mlm",
                  "objective {objective!r} masks nothing; mask_rate is the masked LM's"),
    "data_sharding": (_reads_pretraining_stream,
                      "only the pre-training stream of objectives 'mlm' and 'lm' is sharded"),
    "cache_data": (_reads_pretraining_stream,
                   "only the pre-training stream of objectives 'mlm' and 'lm' is cached"),
    # make_batches: fine-tuning evaluates on the whole split.
    "eval_steps": (lambda c: c.objective in ("mlm", "lm", "translation"),
                   "objective {objective!r} evaluates on the whole split"),
    "label_smoothing": (lambda c: c.objective != "regression",
                        "objective 'regression' has no classes to smooth"),
    "seq_len": (lambda c: c.objective != "translation",
                "translation's batches are input_len and target_len long"),
    "randomized_positions_eval": (lambda c: c.get("randomized_positions") is not None,
                                  "randomized_positions is None (off)"),
    "model.pooler": (lambda c: c.head not in ("lm", "translation"),
                     "head {head!r} has no pooler"),
    "model.share_embeddings": (lambda c: c.head in ("lm", "translation"),
                               ("the BERT heads always tie the MLM output to the token "
                                "embedding; head {head!r} reads no such choice")),
    "optimizer.warmup_steps": (lambda c: not c.optimizer.warmup_fraction,
                               ("optimizer.warmup_fraction sets the warm-up (set it to 0 to "
                                "count warm-up steps)")),
}


def check_overrides(config: ml_collections.ConfigDict, overrides, *,
                    init_checkpoint: str | None = None, sweep: bool = False) -> None:
  """One :class:`TrainConfigError` line for a ``--config.<field>`` override that the run
  would drop without a word.

  Args:
    config: the parsed config (overrides applied).
    overrides: the dotted paths the command line set (``model.d_model``, ``mask_rate``).
    init_checkpoint: finetune.py's ``--init_checkpoint``: with no presets in the config
      argument (``config.presets`` None) the model's architecture is the checkpoint's
      (:func:`posenc_jax.training.finetune.adopt_checkpoint_model`), so overriding one of
      its fields is refused, with the presets' remedy.
    sweep: finetune.py's ``--sweep``; without it ``sweep.*`` is not read.

  Refused: a :data:`READ_WHEN` field where it is not read, ``sweep.*`` without ``--sweep``,
  and ``model.<architecture field>`` with an ``init_checkpoint`` that supplies the model.
  """
  for path in overrides:
    for field, (read, why) in READ_WHEN.items():
      if (path == field or path.startswith(f"{field}.")) and not read(config):
        raise TrainConfigError(f"{field}: set on the command line, but this run does not read "
                               f"it: {why.format(objective=config.objective, head=config.head)}; drop "
                               f"--config.{field}")
    if path.partition(".")[0] == "sweep" and not sweep:
      raise TrainConfigError(f"{path}: set on the command line, but only finetune.py --sweep "
                             "reads the sweep section; add --sweep or drop it")
    field = path.split(".")[1] if path.startswith("model.") else None
    if init_checkpoint and config.get("presets", None) is None and field in ARCHITECTURE:
      raise TrainConfigError(
          f"model.{field}: set on the command line, but the config argument names no presets, "
          f"so the model is init_checkpoint's ({init_checkpoint!r}, its config.json); name the "
          "presets in the config argument and set --config.reinitialise=True to start what "
          f"differs from scratch, or drop --config.{path}")
