"""Encoder-decoder translation training with teacher forcing.

The config lives in the package, posenc_jax/configs/translate.py (its docstring lists the
argument); this file keeps ``--config=configs/translate.py`` working from a clone.
"""

from posenc_jax.configs.translate import get_config  # noqa: F401
