"""The relative (``i - j``) form: :class:`Toeplitz`, a bias that depends on the offset
``j - i`` alone, given by a ``[H|1, R]`` table and the scheme's ``offset_fn`` (DIET-REL, T5,
ALiBi, KERPLE, TUPE-R). The fused route hands the flash kernel its ``[H|1, Lq + Lk - 1]``
offset vector and never builds ``[H, Lq, Lk]``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from posenc_jax.terms.bias import Bias
from posenc_jax.terms.offset_tables import offsets, toeplitz_bias, toeplitz_bias_at
from posenc_jax.terms.protocol import FusedPart, Term, axis_problem, ids_problem, rank_problem

Array = jax.Array


@struct.dataclass
class Toeplitz(Term):
  """Relative bias ``T[h, i, j] = f(table_h, j - i)``: a function of the offset only.

  DIET-REL (clipped offsets), T5 (buckets), ALiBi (slope times distance) and
  TUPE-R's relative part take this form. ``Lq + Lk - 1`` offsets describe the
  whole term, so the fused route hands the flash kernel that vector
  (:meth:`offset_values`) and never builds ``[H, Lq, Lk]``.

  Attributes:
    table: ``[H|1, R]`` per-head parameters (a layer axis in front inside
      :class:`SchemeTerms`).
    offset_fn: ``(table [..., R], rel int32 [N]) -> [..., N]``, the bias of
      each offset ``rel = j - i``; a hashable callable (static), defined by
      the scheme. One with a method ``closed(params, rel)``, the same bias from the table's
      ``R`` columns as a tuple of arrays broadcastable against ``rel`` (any shape), and a
      name ``closed_form`` (the route table's key for its cost), is a closed form that the
      kernel evaluates in its tiles (:class:`~posenc_jax.terms.protocol.TermForm`'s
      ``closed``); one with ``closed`` alone (T5's buckets) runs in the tiles only where a
      caller asks ``relative_flash_attention`` for it.
    zero_first: zero row 0 and column 0 (TUPE-R inside the [CLS] reset).
    q_offset: absolute position of query row 0 (int scalar, may be traced);
      None means 0. :meth:`slice_queries` sets it for decoding.
    k_len: number of keys; None means ``Lq``. Set by :func:`posenc_jax.attend`.
    position_ids: optional int ``[B, L]`` per-token positions (packed sequences); the
      offset is then ``position_ids[b, j] - position_ids[b, i]``, and the term is a dense
      per-example bias (:func:`toeplitz_bias_at`), so the flash kernel's in-tile bias
      applies only without ids. ``zero_first`` then zeroes tokens at position 0.
    num_positions: ``M``, with ids in ``[0, M)``; set with ``position_ids``.
  """

  table: Array
  offset_fn: Any = struct.field(pytree_node=False)
  zero_first: bool = struct.field(pytree_node=False, default=False)
  q_offset: Array | int | None = None
  k_len: int | None = struct.field(pytree_node=False, default=None)
  position_ids: Array | None = None
  num_positions: int | None = struct.field(pytree_node=False, default=None)

  def with_key_length(self, k_len):
    return self.replace(k_len=k_len)

  def shape_problem(self, q_shape, k_shape):
    shape = jnp.shape(self.table)  # the term is a function of the offset alone
    return (rank_problem("table", shape, (2,), "[H|1, R] (SchemeTerms.for_layer drops the "
                          "layer axis)")
            or axis_problem("table", shape, 0, "heads", q_shape[2], "q has", broadcast=True)
            or ids_problem(self.position_ids, q_shape, k_shape))

  def slice_queries(self, start, size):
    del size  # the table has no query axis
    if self.position_ids is not None:
      raise NotImplementedError("Toeplitz with position_ids: incremental decoding counts "
                                "positions by step; build the term without ids")
    offset = start if self.q_offset is None else self.q_offset + start
    return self.replace(q_offset=jnp.asarray(offset, jnp.int32))

  def _lengths(self, q: Array) -> tuple[int, int]:
    q_len = q.shape[1]
    return q_len, q_len if self.k_len is None else self.k_len

  def offset_values(self, q_len: int, k_len: int) -> Array:
    """``[H|1, Lq + Lk - 1]``: the bias of local offsets ``-(Lq - 1) .. Lk - 1``."""
    q_offset = 0 if self.q_offset is None else self.q_offset
    return self.offset_fn(self.table, offsets(q_len, k_len) - q_offset)

  def materialise(self, q_len: int, k_len: int) -> Bias:
    """The same term as a ``[1, H|1, Lq, Lk]`` :class:`Bias` (``[B, H|1, L, L]`` with
    ``position_ids``)."""
    if self.position_ids is not None:
      values = self.offset_fn(self.table, offsets(self.num_positions, self.num_positions))
      return Bias(toeplitz_bias_at(values, self.position_ids, self.zero_first))
    q_offset = 0 if self.q_offset is None else self.q_offset
    return Bias(toeplitz_bias(self.offset_values(q_len, k_len), q_len, k_len, self.zero_first,
                              q_offset))

  def logits(self, q, scale):
    return self.materialise(*self._lengths(q)).logits(q, scale)

  def key_vector(self, k_len):
    """``m_h p_j`` ``[B|1, H|1, Lk]`` for an offset function linear on the causal half,
    ``f(j - i) = m_h (j - i)`` for ``j <= i`` (its ``causal_slope(table)`` gives ``m``
    ``[H|1]``; ALiBi in either form), ``p`` the keys' positions (``position_ids``, else
    ``0 .. Lk - 1``: a decoding step's query offset moves only the rows)."""
    slope = self.offset_fn.causal_slope(self.table).astype(jnp.float32)
    positions = (jnp.arange(k_len)[None] if self.position_ids is None
                 else self.position_ids).astype(jnp.float32)
    return slope[None, :, None] * positions[:, None, :]

  def fused_form(self):
    separable = hasattr(self.offset_fn, "causal_slope") and not self.zero_first
    if self.q_offset is not None or self.position_ids is not None:
      return self._form(entry="bias", causal_separable=separable)
    return self._form(entry="toeplitz", table_form="toeplitz", zero_first=self.zero_first,
                      closed=getattr(self.offset_fn, "closed_form", None),
                      causal_separable=separable)

  def fused(self, q, scale):
    if self.q_offset is not None or self.position_ids is not None:
      # A decoding step (the kernel counts rows from 0) or per-token positions: dense.
      return self.materialise(*self._lengths(q)).fused(q, scale)
    closed = self.fused_form().closed  # the plan picks the vector or the closed form
    return FusedPart(offset_bias=self.offset_values(*self._lengths(q)),
                     zero_first=self.zero_first, offset_fn=self.offset_fn if closed else None,
                     offset_params=self.table if closed else None)
