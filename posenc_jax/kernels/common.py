"""Constants that the Triton/Mosaic kernels (:mod:`posenc_jax.kernels.relative_flash`) and the
Hopper kernels (:mod:`posenc_jax.kernels.hopper_flash`) share."""

# Finite "minus infinity" for masked logits (avoids inf - inf); an empty query row gets
# lse = -NEG, so that exp(s - lse) = 0 in the backward pass.
NEG = -1e30

# Shared memory one program (one block of the grid) may use, the opt-in maximum per block, by
# CUDA compute capability.
SMEM_BYTES = {"8.0": 166912, "8.6": 101376, "8.7": 166912, "8.9": 101376, "9.0": 227 * 1024,
              "10.0": 232448, "12.0": 101376}
