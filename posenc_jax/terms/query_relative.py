"""The query-dependent form: :class:`QueryRelative`, Shaw et al.'s ``c q_i . a^K_{clip(j -
i)}`` from a ``[H|.., 2t+1, D]`` key table (and an optional value table whose rows add to the
output), spread to ``[B, H, Lq, Lk]`` without a gather; a dense bias on the fused route."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from posenc_jax.terms.offset_tables import id_offsets, skew_offsets
from posenc_jax.terms.protocol import FusedPart, Term, axis_problem, ids_problem, rank_problem

Array = jax.Array


@struct.dataclass
class QueryRelative(Term):
  """Shaw et al.'s query-dependent term, ``T[b,h,i,j] = c q_i . a^K_{clip(j-i)}``.

  Attributes:
    key_table: ``[2t+1, D]`` (shared by heads) or ``[H, 2t+1, D]``; row
      ``r + t`` holds offset ``r = j - i``.
    value_table: optional table of the same shape; adds
      ``sum_j alpha_ij a^V_{clip(j-i)}`` to the output (reference route only).
    q_offset: position of query row 0 (int scalar, may be traced); None
      means 0. :meth:`slice_queries` sets it, so a decoding step's single
      query sits at its absolute position.
    clip: ``t``, the largest offset with its own row.
    k_len: number of keys; None means ``Lq`` (self-attention over the
      query positions). :func:`posenc_jax.attend` sets it from ``k`` via
      :meth:`with_key_length`.

  Keys sit at positions ``0..Lk-1`` and queries at
  ``q_offset..q_offset+Lq-1`` of the same sequence (self-attention).

  With ``position_ids`` (optional int ``[B, L]``, self-attention; a leading layer axis
  of 1 inside :class:`SchemeTerms`) the offset is ``position_ids[b, j] -
  position_ids[b, i]`` instead, spread by a one-hot contraction ``[B, L, L, 2t+1]``
  (still no gather or scatter) rather than the skew.
  """

  key_table: Array
  value_table: Array | None = None
  q_offset: Array | int | None = None
  clip: int = struct.field(pytree_node=False, default=16)
  k_len: int | None = struct.field(pytree_node=False, default=None)
  position_ids: Array | None = None

  @property
  def fusable(self):
    return self.value_table is None

  def slice_queries(self, start, size):
    del size  # the table has no query axis; the rows are the queries given to logits
    if self.position_ids is not None:
      raise NotImplementedError("QueryRelative with position_ids: incremental decoding "
                                "counts positions by step; build the term without ids")
    offset = start if self.q_offset is None else self.q_offset + start
    return self.replace(q_offset=jnp.asarray(offset, jnp.int32))

  def with_key_length(self, k_len):
    return self.replace(k_len=k_len)

  def shape_problem(self, q_shape, k_shape):
    if not isinstance(self.clip, numbers.Integral) or self.clip < 0:
      return f"clip is {self.clip!r}; expected an integer >= 0"
    _, _, heads, dim = q_shape
    for name, table in (("key_table", self.key_table), ("value_table", self.value_table)):
      if table is None:
        continue
      shape = jnp.shape(table)
      problem = (rank_problem(name, shape, (2, 3), "[2t+1, D] or [H|1, 2t+1, D]")
                 or axis_problem(name, shape, -2, "rows", 2 * self.clip + 1,
                                  f"clip={self.clip} needs 2 clip + 1 =")
                 or axis_problem(name, shape, -1, "features", dim, "q has")
                 or (len(shape) == 3 and axis_problem(name, shape, 0, "heads", heads, "q has",
                                                       broadcast=True)))
      if problem:
        return problem
    return ids_problem(self.position_ids, q_shape, k_shape)

  def _k_len(self, q_len: int) -> int:
    return q_len if self.k_len is None else self.k_len

  @staticmethod
  def _per_head(table: Array, heads: int) -> Array:
    return table if table.ndim == 3 else jnp.broadcast_to(table, (heads,) + table.shape)

  def _spread(self, per_offset: Array, k_len: int) -> Array:
    """``[B, H, Lq, 2t+1]`` values per clipped offset -> ``[B, H, Lq, Lk]``.

    Entry ``(i, j)`` is column ``clip(j - i - q_offset) + t``. Linear, and
    built from slices, broadcasts, a concatenation and :func:`skew_offsets`,
    so neither it nor its transpose (:meth:`value_output`) gathers or scatters.
    """
    if self.position_ids is not None:  # per-token positions: a one-hot of clip(j - i) + t
      columns = jnp.clip(id_offsets(self.position_ids), -self.clip, self.clip) + self.clip
      one_hot = jax.nn.one_hot(columns, 2 * self.clip + 1, dtype=per_offset.dtype)
      return jnp.einsum("bhir,bijr->bhij", per_offset, one_hot,
                        precision=lax.Precision.HIGHEST)
    q_len = per_offset.shape[-2]
    width = q_len + k_len - 1
    q_offset = 0 if self.q_offset is None else self.q_offset
    if isinstance(q_offset, int):
      full = _clipped_columns(per_offset, self.clip, -(q_len - 1) - q_offset, width)
    else:  # traced (decoding): the columns of every shift, then the shift
      wide = _clipped_columns(per_offset, self.clip, -(self.clip + width),
                              2 * (self.clip + width) + 1)
      # Shifts past either end take the saturated columns only: clamping keeps it exact.
      start = jnp.clip(width + self.clip - (q_len - 1) - q_offset, 0, 2 * self.clip + 1 + width)
      full = lax.dynamic_slice_in_dim(wide, start, width, axis=-1)
    return skew_offsets(full)

  def logits(self, q, scale):
    heads = q.shape[2]
    table = self._per_head(self.key_table, heads).astype(q.dtype)
    # q . a_r for every offset r, then spread to r = clip(j - i) per (i, j).
    per_offset = jnp.einsum("bihd,hrd->bhir", q, table) * scale
    return self._spread(per_offset, self._k_len(q.shape[1]))

  def fused_form(self):
    return self._form(entry="bias")

  def fused(self, q, scale):
    if not self.fusable:
      raise ValueError("QueryRelative with a value_table has no fused route; "
                       "use route='reference'")
    return FusedPart(bias=self.logits(q, scale))

  def value_output(self, probs):
    if self.value_table is None:
      return None
    b, heads, q_len, k_len = probs.shape
    # The attention weights summed per clipped offset: the transpose of the spreading.
    per_offset = jax.ShapeDtypeStruct((b, heads, q_len, 2 * self.clip + 1), probs.dtype)
    spread_t = jax.linear_transpose(lambda x: self._spread(x, k_len), per_offset)
    (weights,) = spread_t(probs)
    table = self._per_head(self.value_table, heads).astype(probs.dtype)
    return jnp.einsum("bhir,hrd->bihd", weights, table)


def _clipped_columns(x: Array, clip: int, first: int, width: int) -> Array:
  """``[..., 2t+1]`` values of offsets ``-t..t`` -> ``[..., width]`` of offsets
  ``first..first + width - 1``, clipped to ``[-t, t]`` (static ``first``).

  Offsets below ``-t`` repeat column 0 and offsets above ``t`` column ``2t``:
  a broadcast, the slice of the columns in range, a broadcast.
  """
  below = min(max(-clip - first, 0), width)
  above = min(max(first + width - 1 - clip, 0), width)
  start = max(first, -clip) + clip
  parts = [jnp.broadcast_to(x[..., :1], x.shape[:-1] + (below,)),
           x[..., start:start + width - below - above],
           jnp.broadcast_to(x[..., -1:], x.shape[:-1] + (above,))]
  return jnp.concatenate([p for p in parts if p.shape[-1]], axis=-1)
