"""Pre-training and translation training: the same command line as ``python -m posenc_jax.train``
(see posenc_jax/train.py for the flags and examples)."""

from posenc_jax.train import run

if __name__ == "__main__":
  run()
