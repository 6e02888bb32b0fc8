"""The factored form: :class:`Factored`, a low-rank term ``u . v`` with ``u`` ``[B|.., Lq,
H|1, r]`` and ``v`` ``[B|.., Lk, H|1, r]`` (DIET-ABS, TUPE's absolute part, segment terms),
which the fused route folds into q and k as ``r`` more columns: exact, no ``[Lq, Lk]`` array."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from posenc_jax.terms.bias import Bias
from posenc_jax.terms.protocol import (FusedPart, Term, axis_problem, batch_problem, rank_problem,
                                       slice_rows)

Array = jax.Array


@struct.dataclass
class Factored(Term):
  """Low-rank term ``T[b, h, i, j] = sum_r u[b, i, h, r] v[b, j, h, r]``.

  Attributes:
    u: ``[Lq, H|1, r]`` (batch-free) or ``[B, Lq, H|1, r]``.
    v: ``[Lk, H|1, r]`` (batch-free) or ``[B, Lk, H|1, r]``.

  The fused route is exact: with content scale ``c``,
  ``(q ++ u / c) . (k ++ v) * c = c q.k + u.v``.
  """

  u: Array
  v: Array

  def shape_problem(self, q_shape, k_shape):
    u, v = jnp.shape(self.u), jnp.shape(self.v)
    layout = "[L, H|1, r] or [B|1, L, H|1, r]"
    problem = rank_problem("u", u, (3, 4), layout) or rank_problem("v", v, (3, 4), layout)
    if problem:
      return problem
    if u[-1] != v[-1]:
      return f"u {list(u)} has rank {u[-1]}, but v {list(v)} has {v[-1]}"
    heads = q_shape[2]
    return (axis_problem("u", u, -3, "queries", q_shape[1], "q has")
            or axis_problem("v", v, -3, "keys", k_shape[1], "k has")
            or axis_problem("u", u, -2, "heads", heads, "q has", broadcast=True)
            or axis_problem("v", v, -2, "heads", heads, "q has", broadcast=True)
            or batch_problem("u", u, q_shape[0]) or batch_problem("v", v, q_shape[0]))

  def _uv4(self) -> tuple[Array, Array]:
    u = self.u[None] if self.u.ndim == 3 else self.u
    v = self.v[None] if self.v.ndim == 3 else self.v
    return u, v

  def materialise(self) -> Bias:
    """The same term as a ``[B|1, H|1, Lq, Lk]`` :class:`Bias`."""
    u, v = self._uv4()
    return Bias(jnp.einsum("bihr,bjhr->bhij", u, v))

  def logits(self, q, scale):
    return self.materialise().logits(q, scale)

  def fused_form(self):
    batch_free = all(x.ndim == 3 or x.shape[0] == 1 for x in (self.u, self.v))
    return self._form(entry="fold", table_form="factored" if batch_free else None,
                      rank=self.u.shape[-1])

  def fused(self, q, scale):
    u, v = self._uv4()
    heads = q.shape[2]
    u = jnp.broadcast_to(u, u.shape[:2] + (heads, u.shape[3]))
    v = jnp.broadcast_to(v, v.shape[:2] + (heads, v.shape[3]))
    return FusedPart(q_extra=(u / scale).astype(q.dtype), k_extra=v.astype(q.dtype))

  def slice_queries(self, start, size):
    return self.replace(u=slice_rows(self.u, start, size, -3))
