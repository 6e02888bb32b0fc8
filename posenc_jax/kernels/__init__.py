"""Pallas kernels for positional-encoding attention."""

from posenc_jax.kernels.relative_flash import relative_flash_attention

__all__ = ["relative_flash_attention"]
