"""The experiments of ``python -m posenc_jax.compare``: glue_table, extrapolation, synthetic.

The config lives in the package, posenc_jax/configs/compare.py (its docstring lists the
experiments and fields); this file keeps ``--config=configs/compare.py`` working from a clone.
"""

from posenc_jax.configs.compare import get_config  # noqa: F401
