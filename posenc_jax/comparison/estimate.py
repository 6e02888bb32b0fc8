"""The device time of a grid before it runs: what ``compare --dry_run`` prints.

Each training step of a cell (pre-training, fine-tuning, a probe's or an LM's training) is
resolved to its train config (the config spec with the experiment's overrides), and costs
``total_steps x FLOPs per step / FLOP/s + start-up``: FLOPs per step are
:func:`~posenc_jax.training.metrics.train_flops_per_step` of its model, batch and length;
the FLOP/s and the start-up are the ones measured on a device kind and committed
(:data:`MEASURED`, each with its source). Evaluation steps, the cost measurement and the
host's input pipeline are left out: the figure is the training's, a lower bound where a
grid evaluates long sequences.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Sequence
import ml_collections

from posenc_jax.cli import config_path, literal
from posenc_jax.comparison.plan import Cell, Step
from posenc_jax.models.config import model_config
from posenc_jax.training.config import max_predictions
from posenc_jax.training.metrics import train_flops_per_step


@dataclasses.dataclass(frozen=True)
class Measured:
  """A device kind's measured training rate: ``flops_per_s`` (matmul FLOP/s the trainer's
  step reached), ``startup_s`` (a train.py or finetune.py process before its first step:
  imports, input pipeline, compile) and where both were measured."""

  device: str
  flops_per_s: float
  startup_s: float
  source: str


# bert_tiny's masked-LM step of the demo before 2026-11-28 (32 x 64, 15% masking, MLP 512: 7.70
# GFLOP) at 7.0 steps/s, and 25 s from the command to its first step, on 2 idle AMD EPYC cores.
CPU = Measured("2 CPU cores", 7.0 * 7.70e9, 25.0,
               "bert_tiny's masked-LM step on 2 AMD EPYC cores "
               "(docs/results/pretrain-calibration-cpu.md)")
# BERT-base's masked-LM step at B=32 L=512 in bfloat16: 46.84 ms (20.8% MFU).
H200 = Measured("one NVIDIA H200", 0.208 * 989e12, 60.0,
                "the trainer's BERT-base step on an H200, docs/results/h200-2026-11-28.md")
# No TPU step has been measured by the project: the H200's rate stands in for one chip.
MEASURED = {"cpu": CPU, "gpu": H200, "tpu": dataclasses.replace(
    H200, device="one TPU chip (no TPU measured: an H200's rate)")}


def _load(spec: str) -> ml_collections.ConfigDict:
  """The config a spec ``<file>[:<arg>]`` names (a packaged one by :func:`config_path`)."""
  path, _, arg = config_path(spec).partition(":")
  module_spec = importlib.util.spec_from_file_location("_estimated_config", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg) if arg else module.get_config()


def _resolved(step: Step) -> ml_collections.ConfigDict:
  """The train config of a train.py or finetune.py step: its ``--config=`` spec with the
  step's ``--config.<field>=`` flags applied."""
  config = _load(next(a.partition("=")[2] for a in step.argv if a.startswith("--config=")))
  config.update_from_flattened_dict({path: literal(text)
                                     for path, text in step.overrides().items()})
  return config


def _seconds(config: ml_collections.ConfigDict, model: ml_collections.ConfigDict,
             device: Measured) -> float:
  flops = train_flops_per_step(model_config(model), config.batch_size, config.seq_len,
                               predictions_per_seq=max_predictions(config), head=config.head,
                               num_labels=config.get("num_labels", 2))
  return config.total_steps * flops / device.flops_per_s + device.startup_s


def cell_seconds(cell: Cell, device: Measured) -> float:
  """The seconds of a cell's training steps on ``device``: each step's ``total_steps`` of
  :func:`train_flops_per_step` and its start-up; a fine-tuning step runs the model of the
  cell's pre-training (as finetune.py does from ``--init_checkpoint``)."""
  total, pretrained = 0.0, None
  for step in cell.steps:
    if step.evaluation is not None:
      continue
    config = _resolved(step)
    fine_tuning = step.argv[0] == "posenc_jax.finetune"
    model = pretrained.model if fine_tuning and pretrained is not None else config.model
    pretrained = pretrained if fine_tuning else config
    total += _seconds(config, model, device)
  return total


def summary_line(cells: Sequence[Cell], kind: str) -> str:
  """``# estimated 0.42 device-hours on 2 CPU cores (...)``: the grid's training time on the
  device kind ``kind`` (``cpu``, ``gpu`` or ``tpu``) and where its rate comes from."""
  device = MEASURED[kind]
  hours = sum(cell_seconds(cell, device) for cell in cells) / 3600
  return (f"# estimated {hours:.2f} device-hours of training on {device.device} for "
          f"{len(cells)} cells (FLOPs per step at the rate of {device.source}; evaluations "
          "not counted)")
