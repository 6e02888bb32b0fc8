"""XTREME zero-shot fine-tuning (DIET's multilingual protocol).

The config lives in the package, posenc_jax/configs/finetune_xtreme.py (its docstring lists the
argument); this file keeps ``--config=configs/finetune_xtreme.py`` working from a clone.
"""

from posenc_jax.configs.finetune_xtreme import get_config  # noqa: F401
