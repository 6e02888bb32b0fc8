"""Pallas kernels for positional-encoding attention."""

from posenc_jax.kernels.relative_flash import offsets, relative_flash_attention

__all__ = ["offsets", "relative_flash_attention"]
