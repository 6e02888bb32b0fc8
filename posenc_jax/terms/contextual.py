"""The q- and k-dependent form: :class:`ContextualPositions`, CoPE's position embeddings read
at positions counted by gates ``sigmoid(c q_i . k_t)`` (:func:`contextual_positions`,
``[.., Lq, Lk]``); a dense ``[B, H, Lq, Lk]`` bias on either route."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from posenc_jax.terms.protocol import FusedPart, Term, axis_problem, rank_problem

Array = jax.Array


def contextual_positions(gates: Array, q_offset: int | Array = 0) -> Array:
  """CoPE's positions ``p_ij = sum_{t=j..i} g_it`` (Golovneva et al. 2024, eq. 4).

  Args:
    gates: ``[..., Lq, Lk]`` gate values ``g_it`` in ``[0, 1]``.
    q_offset: key index of query row 0 (queries at ``q_offset .. q_offset + Lq - 1``, keys
      at ``0 .. Lk - 1``); may be traced.

  Returns:
    ``[..., Lq, Lk]`` in float32 at least (a bfloat16 sum would lose whole counts past 256):
    the gates of keys ``j .. i`` summed (a reverse cumulative sum over the keys, gates after
    the query dropped), 0 for keys after the query.
  """
  i = jnp.arange(gates.shape[-2])[:, None] + q_offset
  t = jnp.arange(gates.shape[-1])[None, :]
  gates = jnp.where(t <= i, gates.astype(jnp.promote_types(gates.dtype, jnp.float32)), 0.0)
  return jnp.flip(jnp.cumsum(jnp.flip(gates, -1), axis=-1), -1)


@struct.dataclass
class ContextualPositions(Term):
  """CoPE (Golovneva et al. 2024, section 3): a position counted from the content.

  With gates ``g_it = sigmoid(c q_i . k_t)`` (``c`` the content scale), positions
  ``p_ij = sum_{t=j..i} g_it`` (:func:`contextual_positions`) clipped at ``npos - 1``, and
  ``f = p - floor(p)``,

      T[b, h, i, j] = (1 - f) q_i . e[floor(p)] + f q_i . e[floor(p) + 1].

  Causal: keys after the query (``j > i``, which the causal mask removes) get ``p = 0``.
  Dense and data-dependent (it reads q and k): a ``[B, H, Lq, Lk]`` bias on either route.

  Attributes:
    table: ``e``, ``[npos, D]``, shared by the heads (a layer axis in front inside
      :class:`SchemeTerms`).
    q_offset: key index of query row 0 (int scalar, may be traced); None means 0.
      :meth:`slice_queries` sets it, so a decoding step counts the gates of the keys up to
      its own position only.
    keys: ``[B, Lk, H, D]``, set by :func:`posenc_jax.attend` through :meth:`with_keys`.
  """

  table: Array
  q_offset: Array | int | None = None
  keys: Array | None = None

  def with_keys(self, k):
    return self.replace(keys=k)

  def slice_queries(self, start, size):
    del size  # the table has no query axis; the rows are the queries given to logits
    offset = start if self.q_offset is None else self.q_offset + start
    return self.replace(q_offset=jnp.asarray(offset, jnp.int32))

  def shape_problem(self, q_shape, k_shape):
    shape = jnp.shape(self.table)
    return (rank_problem("table", shape, (2,), "[npos, D] (SchemeTerms.for_layer drops the "
                          "layer axis)")
            or axis_problem("table", shape, -1, "features", q_shape[3], "q has"))

  def logits(self, q, scale):
    if self.keys is None:
      raise ValueError("ContextualPositions: keys are unset; attend sets them (with_keys(k))")
    dot = functools.partial(jnp.einsum, precision=lax.Precision.HIGHEST,
                            preferred_element_type=jnp.promote_types(q.dtype, jnp.float32))
    gates = jax.nn.sigmoid(dot("bihd,bjhd->bhij", q, self.keys) * scale)
    q_offset = 0 if self.q_offset is None else self.q_offset
    last = self.table.shape[0] - 1
    positions = jnp.minimum(contextual_positions(gates, q_offset), last)
    floor = jnp.floor(positions)
    frac = positions - floor  # the gradient to the gates flows through f
    per_row = dot("bihd,rd->bhir", q, self.table)  # q_i . e[r] for every row r
    lower = floor.astype(jnp.int32)
    at = lambda rows: jnp.take_along_axis(per_row, rows, axis=-1)  # noqa: E731
    # At p = npos - 1, f = 0: the upper row is clipped too and weighs nothing.
    return (1 - frac) * at(lower) + frac * at(jnp.minimum(lower + 1, last))

  def fused_form(self):
    return self._form(entry="bias")

  def fused(self, q, scale):
    return FusedPart(bias=self.logits(q, scale))
