"""Pre-training, translation and causal-LM training: ``python -m posenc_jax.train
--config=... --workdir=...`` (or ``python train.py ...`` in a clone). Importing this module
defines its command-line flags.

  python -m posenc_jax.train --workdir=/tmp/posenc_demo   # configs/pretrain.py, the demo
  python train.py --config=configs/pretrain.py --workdir=/tmp/posenc_demo
  python train.py --config=configs/pretrain.py:bert_base,diet_rel,tupe_protocol \\
      --config.batch_size=512 --workdir=/data/runs/diet_rel
  python train.py --config=configs/lm.py:bert_tiny,alibi --workdir=/tmp/posenc_lm
  python train.py --config=configs/lm.py:bert_tiny,rope --config.model.scheme.scaling=yarn \\
      --config.model.scheme.factor=4 --workdir=/tmp/posenc_lm_yarn

A ``--config.`` field the run would not read (``mask_rate`` on a language model, say) is
refused in one line (:func:`posenc_jax.training.overrides.check_overrides`).

Multi-host: on TPU pods ``jax.distributed`` initialises itself; on GPU
clusters pass ``--coordinator_address``, ``--num_processes`` and
``--process_id`` (or set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
JAX_PROCESS_ID). Each host feeds its own shard of the global batch.
"""

import os
import sys

from absl import app, flags, logging

from posenc_jax import allocator, cli, usage

# The configs/ files it takes, listed by --help.
CONFIGS = ("pretrain", "lm", "translate", "probe")

_CONFIG = cli.define_config("config", "configs/pretrain.py", "configs/<file>.py[:<presets>]")
_WORKDIR = flags.DEFINE_string("workdir", None, "checkpoints, metrics and events go here")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "processes in the job")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "this process's index")


def initialise_distributed() -> None:
  import jax  # noqa: PLC0415

  address = _COORDINATOR.value or os.environ.get("JAX_COORDINATOR_ADDRESS")
  if address:
    num = _NUM_PROCESSES.value or int(os.environ["JAX_NUM_PROCESSES"])
    pid = _PROCESS_ID.value if _PROCESS_ID.value is not None else int(
        os.environ["JAX_PROCESS_ID"])
    jax.distributed.initialize(address, num_processes=num, process_id=pid)
  elif os.environ.get("TPU_WORKER_HOSTNAMES") or os.environ.get("CLOUD_TPU_TASK_ID"):
    jax.distributed.initialize()  # TPU pod slice: everything from the environment


def main(argv):
  del argv
  if not _WORKDIR.value:
    sys.exit("train.py: --workdir is required")
  logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO
  cli.quiet_library_tracebacks()
  cli.quiet_library_notices()
  allocator.keep_freed_buffers()
  from posenc_jax.training.input_pipeline import reads_tensorflow  # noqa: PLC0415

  if reads_tensorflow(_CONFIG.value.get("task", "")):
    cli.start_tensorflow_quietly()
  initialise_distributed()
  from posenc_jax.training.overrides import check_overrides  # noqa: PLC0415
  from posenc_jax.training.errors import USER_ERRORS  # noqa: PLC0415
  from posenc_jax.training.loop import train  # noqa: PLC0415

  try:
    check_overrides(_CONFIG.value, flags.FLAGS["config"].override_values)
    train(_CONFIG.value, _WORKDIR.value)
  except USER_ERRORS as e:
    cli.exit_with("train.py", e)


def run() -> None:
  """The command line (``python -m posenc_jax.train``, or the repository's ``train.py``)."""
  cli.run_command(app.run, main, flags_parser=cli.flags_parser("train.py", help=usage.helper(
      "train.py", __doc__, configs=CONFIGS)))


if __name__ == "__main__":
  run()
