"""The bias form: :class:`Bias`, an additive logit bias held whole, ``[H|1, Lq, Lk]``
(batch-free) or ``[B|1, H|1, Lq, Lk]`` (per example), which the fused route takes as its bias
input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from posenc_jax.terms.protocol import (FusedPart, Term, axis_problem, batch_problem, rank_problem,
                                       slice_rows)

Array = jax.Array


def _as_4d_bias(value: Array) -> Array:
  """``[H, Lq, Lk]`` -> ``[1, H, Lq, Lk]``; ``[B, H, Lq, Lk]`` unchanged."""
  return value[None] if value.ndim == 3 else value


@struct.dataclass
class Bias(Term):
  """Additive logit bias.

  Attributes:
    value: ``[H|1, Lq, Lk]`` (batch-free, e.g. DIET-REL, T5, ALiBi) or
      ``[B|1, H|1, Lq, Lk]`` (per example); a query axis of 1 is the same row for every
      query.
  """

  value: Array

  def shape_problem(self, q_shape, k_shape):
    shape = jnp.shape(self.value)
    return (rank_problem("value", shape, (3, 4), "[H|1, Lq|1, Lk] or [B|1, H|1, Lq|1, Lk]")
            or axis_problem("value", shape, -1, "keys", k_shape[1], "k has")
            or axis_problem("value", shape, -2, "queries", q_shape[1], "q has", broadcast=True)
            or axis_problem("value", shape, -3, "heads", q_shape[2], "q has", broadcast=True)
            or batch_problem("value", shape, q_shape[0]))

  def logits(self, q, scale):
    del q, scale
    return _as_4d_bias(self.value)

  def fused_form(self):
    return self._form(entry="bias")

  def fused(self, q, scale):
    del q, scale
    return FusedPart(bias=_as_4d_bias(self.value))

  def slice_queries(self, start, size):
    return self.replace(value=slice_rows(self.value, start, size, -2))
