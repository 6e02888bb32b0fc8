"""A model alone: size, position scheme and modifiers, by preset name.

The config lives in the package, posenc_jax/configs/model.py (its docstring lists the
argument); this file keeps ``--config=configs/model.py`` working from a clone.
"""

from posenc_jax.configs.model import get_config  # noqa: F401
