"""Pallas kernels for positional-encoding attention."""

from posenc_jax.kernels.relative_flash import (alibi_coef, diet_rel_index, relative_flash_attention,
                                               t5_index)

__all__ = ["alibi_coef", "diet_rel_index", "relative_flash_attention", "t5_index"]
