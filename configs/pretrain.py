"""Masked-LM pre-training (no NSP, full-sentence packing, 15% masking 80/10/10).

The config lives in the package, posenc_jax/configs/pretrain.py (its docstring lists the
argument); this file keeps ``--config=configs/pretrain.py`` working from a clone.
"""

from posenc_jax.configs.pretrain import get_config  # noqa: F401
