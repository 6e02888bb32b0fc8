"""Fine-tuning on GLUE, XTREME and the bundled WordNet tasks:
``python -m posenc_jax.finetune --config=... --workdir=... [--init_checkpoint=...]
[--sweep]`` (or ``python finetune.py ...`` in a clone). Importing this module defines its
command-line flags.

  python finetune.py --config=configs/finetune_wordnet.py:wordnet_supersense \\
      --init_checkpoint=/tmp/posenc_demo --workdir=/tmp/posenc_supersense
  python finetune.py --config=configs/finetune_glue.py:glue_rte,bert_base,diet_abs_share \\
      --init_checkpoint=/data/runs/diet_abs --workdir=/data/ft/rte --sweep

``--init_checkpoint`` is a train.py workdir or a Hugging Face BERT folder.
``--sweep`` runs ``config.sweep.seeds`` x ``config.sweep.learning_rates`` (each
``--config.sweep.seeds=0,1,2`` or ``='(0, 1, 2)'``) and writes the median-of-best table
(sweep.json, sweep.md) as DIET reports it. A ``--config.`` field the run would not read
is refused (:func:`posenc_jax.training.overrides.check_overrides`): ``sweep.*`` without
``--sweep``, and a ``model.`` architecture field when ``--init_checkpoint`` supplies the
model (no presets in the config argument).
"""

import sys

from absl import app, flags, logging

from posenc_jax import allocator, cli, usage

# The configs/ files it takes, listed by --help.
CONFIGS = ("finetune_glue", "finetune_wordnet", "finetune_xtreme")

_CONFIG = cli.define_config("config", None, "configs/<file>.py:<task>[,...]")
_WORKDIR = flags.DEFINE_string("workdir", None, "checkpoints, metrics and the best model")
_INIT = flags.DEFINE_string("init_checkpoint", None, "train.py workdir or Hugging Face folder")
_SWEEP = flags.DEFINE_bool("sweep", False, "seeds x learning rates, median of best")


def main(argv):
  del argv
  if not _WORKDIR.value or _CONFIG.value is None:
    sys.exit("finetune.py: --config and --workdir are required")
  logging.set_verbosity(logging.WARNING)
  cli.quiet_library_tracebacks()
  cli.quiet_library_notices()
  allocator.keep_freed_buffers()
  cli.start_tensorflow_quietly()
  from posenc_jax.training.overrides import check_overrides  # noqa: PLC0415
  from posenc_jax.training.errors import USER_ERRORS  # noqa: PLC0415
  from posenc_jax.training.finetune import finetune, sweep, sweep_table  # noqa: PLC0415

  try:
    check_overrides(_CONFIG.value, flags.FLAGS["config"].override_values,
                    init_checkpoint=_INIT.value, sweep=_SWEEP.value)
    if _SWEEP.value:
      print(sweep_table(sweep(_CONFIG.value, _WORKDIR.value, _INIT.value)))
    else:
      result = finetune(_CONFIG.value, _WORKDIR.value, _INIT.value)
      print(f"best {result['best']}")
  except USER_ERRORS as e:
    cli.exit_with("finetune.py", e)


def run() -> None:
  """The command line (``python -m posenc_jax.finetune``, or the repository's ``finetune.py``)."""
  cli.run_command(app.run, main, flags_parser=cli.flags_parser("finetune.py", help=usage.helper(
      "finetune.py", __doc__, configs=CONFIGS)))


if __name__ == "__main__":
  run()
