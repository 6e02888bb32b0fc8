"""Causal language modelling: a decoder-only Transformer trained on next-token prediction.

The config lives in the package, posenc_jax/configs/lm.py (its docstring lists the argument);
this file keeps ``--config=configs/lm.py`` working from a clone.
"""

from posenc_jax.configs.lm import get_config  # noqa: F401
