"""The precision policy of attention's matmuls: float32 inputs multiply exactly unless the
caller opts into the backend's faster default."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

PRECISIONS = ("float32", "tensorfloat32")


def dot_precision(precision: str, dtype) -> lax.Precision | None:
  """The ``precision`` of attention's matmuls (the kernels' and the other routes') for
  inputs of ``dtype``.

  ``"float32"``: float32 inputs multiply in full float32 (``Precision.HIGHEST``),
  so every route agrees with a float32 reference to float32 rounding. JAX's
  own default is faster and coarser (TF32 on NVIDIA GPUs from Ampere on,
  bfloat16 passes on TPU); ``"tensorfloat32"`` opts into it. Inputs of 16 bits
  are unaffected (None).
  """
  if precision not in PRECISIONS:
    raise ValueError(f"precision: got {precision!r}; allowed: {', '.join(PRECISIONS)}")
  if jnp.dtype(dtype) != jnp.dtype(jnp.float32) or precision == "tensorfloat32":
    return None
  return lax.Precision.HIGHEST
