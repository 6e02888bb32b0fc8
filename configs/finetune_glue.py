"""GLUE fine-tuning as DIET did (batch 32, warm-up 10%, an LR sweep, median over 5 seeds).

The config lives in the package, posenc_jax/configs/finetune_glue.py (its docstring lists the
argument); this file keeps ``--config=configs/finetune_glue.py`` working from a clone.
"""

from posenc_jax.configs.finetune_glue import get_config  # noqa: F401
