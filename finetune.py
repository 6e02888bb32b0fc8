"""Fine-tuning on GLUE, XTREME and the bundled WordNet tasks: the same command line as ``python -m posenc_jax.finetune``
(see posenc_jax/finetune.py for the flags and examples)."""

from posenc_jax.finetune import run

if __name__ == "__main__":
  run()
