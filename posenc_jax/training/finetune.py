"""Fine-tuning: start from a pre-trained encoder, train a task head, keep the best checkpoint,
and sweep seeds x learning rates for the papers' statistic.

A pre-trained encoder comes from a ``train.py`` workdir (its newest Orbax
checkpoint; the encoder is the ``bert`` subtree of the MLM model) or from a
Hugging Face BERT folder (``config.json`` present; read by
:func:`posenc_jax.convert.load_hf_bert`). Every encoder parameter whose path
and shape match is copied; the rest (the task head, a per-head segment
scheme switched on for sentence pairs as DIET did, a swapped-in position
scheme) keep their fresh initialisation, and the report says which.

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
from flax import traverse_util

from posenc_jax.training.config import TrainConfigError


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


def pretrained_encoder(path: str, config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The encoder parameters (``BertEncoder`` layout, plain arrays) stored at ``path``."""
  from flax import linen as nn  # noqa: PLC0415

  if os.path.exists(os.path.join(path, "config.json")):
    from posenc_jax.convert.hf_bert import load_hf_bert  # noqa: PLC0415
    _, variables, _ = load_hf_bert(path, config.model)
    return nn.unbox(variables["params"])
  import orbax.checkpoint as ocp  # noqa: PLC0415

  directory = os.path.join(os.path.abspath(path), "checkpoints")
  if not os.path.isdir(directory):
    raise TrainConfigError(f"init_checkpoint: {path!r} is neither a train.py workdir (no "
                           "checkpoints/) nor a Hugging Face folder (no config.json)")
  manager = ocp.CheckpointManager(directory, item_names=("state", "data"))
  step = manager.latest_step()
  if step is None:
    raise TrainConfigError(f"init_checkpoint: {directory} holds no complete checkpoint")
  state = manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.PyTreeRestore()))["state"]
  manager.close()
  params = state["params"]
  return params["bert"] if "bert" in params else params


def merge_encoder(target: Any, source: dict[str, Any], source_name: str) -> tuple[Any, InitReport]:
  """``target`` params (``bert/...`` + head) with every matching encoder leaf from ``source``."""
  report = InitReport(source_name)
  flat_target = traverse_util.flatten_dict(target, sep="/")
  flat_source = traverse_util.flatten_dict(source, sep="/")
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


def finetune(config: ml_collections.ConfigDict, workdir: str, init_checkpoint: str | None = None,
             data=None) -> dict[str, Any]:
  """One fine-tuning run: ``train`` with the pre-trained encoder and best-checkpoint keeping."""
  from posenc_jax.training.loop import train  # noqa: PLC0415

  init = None
  if init_checkpoint:
    source = pretrained_encoder(init_checkpoint, config)

    def init(params):
      merged, report = merge_encoder(params, source, init_checkpoint)
      if jax.process_index() == 0:
        print(report.summary(), flush=True)
      return merged

  return train(config, workdir, data=data, init_params=init)


def sweep(config: ml_collections.ConfigDict, workdir: str, init_checkpoint: str | None = None,
          data=None) -> dict[str, Any]:
  """Runs ``config.sweep.seeds`` x ``config.sweep.learning_rates``; writes sweep.json/.md.

  Returns:
    ``{"metric", "runs": [...], "by_learning_rate": {lr: median}, "best_learning_rate",
    "score"}`` where ``score`` is the best over learning rates of the median over seeds
    of each run's best evaluation.
  """
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
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "sweep.json"), "w") as f:
      json.dump(summary, f, indent=2)
    with open(os.path.join(workdir, "sweep.md"), "w") as f:
      f.write(sweep_table(summary))
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
