"""The input-level form: :class:`InputEmbedding`, ``[L, d]`` or ``[B, L, d]`` added to the
token embeddings before the first layer (absolute positions, segment embeddings); not an
attention term."""

from __future__ import annotations

import jax
from flax import struct

from posenc_jax.terms.protocol import slice_rows

Array = jax.Array


@struct.dataclass
class InputEmbedding:
  """Input-level term added to the token embeddings before the first layer.

  Attributes:
    value: ``[L, d]`` (batch-free) or ``[B, L, d]``.
  """

  value: Array

  def slice_queries(self, start: int | Array, size: int) -> InputEmbedding:
    """Positions ``[start, start + size)`` (a decoding step's input row)."""
    return self.replace(value=slice_rows(self.value, start, size, -2))
