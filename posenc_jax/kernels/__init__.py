"""Pallas kernels for positional-encoding attention."""

from posenc_jax.kernels.blocks import KernelBlocks, kernel_blocks, kernel_memory, memory_budget
from posenc_jax.kernels.relative_flash import relative_flash_attention

__all__ = ["KernelBlocks", "kernel_blocks", "kernel_memory", "memory_budget",
           "relative_flash_attention"]
