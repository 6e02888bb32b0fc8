"""Segment (token type) encodings: BERT's input table, or DIET's per-head
``S_h[seg(i), seg(j)]`` (eq. 2)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from posenc_jax.ids import check_id_values
from posenc_jax.schemes.base import (POSITIVE_INT, SHARING, Scheme, SchemeConfigError, one_of,
                                     shared_sizes)
from posenc_jax.terms import Factored, InputEmbedding, SchemeTerms

Array = jax.Array


def _one_hot_segments(scheme: Scheme, length: int, segment_ids: Array | None,
                      num_segments: int) -> Array:
  """``[B, L, n_seg]`` one-hot of ``segment_ids`` ``[B, L]`` (``L = length``)."""
  scheme.check_length(length)
  if segment_ids is None:
    raise SchemeConfigError(f"scheme {scheme.scheme_name!r}: segment_ids are required")
  if jnp.ndim(segment_ids) != 2 or jnp.shape(segment_ids)[1] != length:
    raise SchemeConfigError(f"scheme {scheme.scheme_name!r}: segment_ids has shape "
                            f"{jnp.shape(segment_ids)}; expected [B, L] with L = {length}")
  check_id_values(f"scheme {scheme.scheme_name!r}", "segment_ids", segment_ids, num_segments,
                  "num_segments")
  return jax.nn.one_hot(segment_ids, num_segments, dtype=jnp.float32)


class SegmentInput(Scheme):
  """BERT's token-type table ``[n_seg, d]`` added to the token embeddings.

  Attributes:
    num_segments: token types (2 in BERT).
  """

  num_segments: int = 2

  scheme_name = "segment_input"
  hyperparameters = {"num_segments": POSITIVE_INT}
  segment_scheme = True
  fits_linformer = True

  @classmethod
  def input_flops(cls, values, dims, length):
    """The one-hot segments times the table, ``[L, n_seg] x [n_seg, d]``."""
    return 2 * length * values["num_segments"] * dims["d_model"]

  @nn.compact
  def __call__(self, length, segment_ids=None, position_ids=None):
    del position_ids  # segments carry no positions
    one_hot = _one_hot_segments(self, length, segment_ids, self.num_segments)
    table = self.logical_param("segment_embedding", nn.initializers.normal(0.02),
                               (self.num_segments, self.d_model), ("segments", "embed"))
    return SchemeTerms(embedding=InputEmbedding(one_hot @ table))


class SegmentPerHead(Scheme):
  """``T[b,h,i,j] = S_h[seg(i), seg(j)]``, a factored term of rank ``n_seg``.

  ``u = onehot(seg_i) S_h`` ``[B, L, H, n_seg]``, ``v = onehot(seg_j)``.

  Attributes:
    num_segments: token types.
    sharing: ``none`` (a table per layer and head), ``layer`` or ``head``.
  """

  num_segments: int = 2
  sharing: str = "none"

  scheme_name = "segment_per_head"
  hyperparameters = {"num_segments": POSITIVE_INT, "sharing": one_of(*SHARING)}
  segment_scheme = True

  @classmethod
  def folded_rank(cls, values, head_dim):
    return values["num_segments"]

  @classmethod
  def input_flops(cls, values, dims, length):
    """``u``: the one-hot segments times each table (layers x heads, fewer when shared),
    ``[L, n_seg] x [n_seg, n_seg]``."""
    layers, heads = shared_sizes(values["sharing"], dims["num_layers"], dims["num_heads"])
    return 2 * length * values["num_segments"] ** 2 * layers * heads

  @nn.compact
  def __call__(self, length, segment_ids=None, position_ids=None):
    del position_ids  # segments carry no positions
    one_hot = _one_hot_segments(self, length, segment_ids, self.num_segments)
    layers, heads = self.sharing_dims(self.sharing)
    n = self.num_segments
    table = self.logical_param("segment_bias", nn.initializers.normal(0.02), (layers, heads, n, n),
                               ("layers", "heads", "query_segments", "key_segments"))
    u = jnp.einsum("bis,lhst->lbiht", one_hot, table)
    v = one_hot[None, :, :, None, :]
    return SchemeTerms(terms=(Factored(u, v),))
