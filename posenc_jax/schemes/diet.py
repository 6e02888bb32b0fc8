"""DIET (Chen et al. 2021): decoupled per-head position terms.

* DIET-REL: one learned scalar per head per clipped offset, no log-binning.
* DIET-ABS: ``P_Q^h P_K^{hT}``, a factored term of rank ``d_p``.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from posenc_jax.schemes.base import (NON_NEGATIVE_INT, POSITIVE_FLOAT, POSITIVE_INT, SHARING,
                                    Scheme, one_of, optional)
from posenc_jax.terms import Factored, SchemeTerms, Toeplitz, lookup, lookup_rows


@dataclasses.dataclass(frozen=True)
class ClippedOffsets:
  """DIET-REL's offset function: ``R_h[clip(i - j, -t, t)]`` from a ``[..., 2t + 1]`` table.

  Called as ``(table [..., 2t + 1], rel [N]) -> [..., N]`` with ``rel = j - i``
  (see :class:`posenc_jax.terms.Toeplitz`).
  """

  clip: int

  def __call__(self, table: jax.Array, rel: jax.Array) -> jax.Array:
    return lookup(table, jnp.clip(-rel, -self.clip, self.clip) + self.clip)


def position_rank(rank: int | None, head_dim: int) -> int:
  """``d_p``, the rank of DIET-ABS's position tables: ``rank``, or D (``head_dim``) for None."""
  return head_dim if rank is None else rank


class DietRel(Scheme):
  """``T[h,i,j] = R_h[clip(i - j, -t, t)]``.

  Attributes:
    clip: t; None gives ``max_len - 1`` (a ``2 L_max - 1`` table per head,
      which reproduces DIET Table 6).
    sharing: ``none`` (paper default), ``layer`` or ``head``.
  """

  clip: int | None = None
  sharing: str = "none"

  scheme_name = "diet_rel"
  hyperparameters = {"clip": optional(NON_NEGATIVE_INT), "sharing": one_of(*SHARING)}

  @nn.compact
  def __call__(self, length, segment_ids=None, position_ids=None):
    self.check_length(length)
    positions = self.toeplitz_positions(length, position_ids)
    clip = self.max_len - 1 if self.clip is None else self.clip
    layers, heads = self.sharing_dims(self.sharing)
    table = self.logical_param("relative_bias", nn.initializers.normal(0.02),
                               (layers, heads, 2 * clip + 1), ("layers", "heads", "relpos"))
    return SchemeTerms(terms=(Toeplitz(table, ClippedOffsets(clip), **positions),))


class DietAbs(Scheme):
  """``T[h,i,j] = (P_Q^h P_K^{hT})_{ij}``, ``P_Q^h, P_K^h`` each ``[L_max, d_p]``.

  The input position embedding is removed; the term is input-independent
  and, under ``layer`` sharing, computed once per forward pass.

  Attributes:
    rank: d_p; None gives D (the head width).
    sharing: ``none``, ``layer`` (the paper's best with d_p = 128) or ``head``.
    content_scale: scale of ``q . k``; None gives ``1 / sqrt(D)`` (DIET writes
      ``1 / sqrt(d)``).
  """

  rank: int | None = None
  sharing: str = "none"
  content_scale: float | None = None

  scheme_name = "diet_abs"
  absolute_table = True
  hyperparameters = {"rank": optional(POSITIVE_INT), "sharing": one_of(*SHARING),
                     "content_scale": optional(POSITIVE_FLOAT)}

  @classmethod
  def folded_rank(cls, values, head_dim):
    return position_rank(values["rank"], head_dim)

  @nn.compact
  def __call__(self, length, segment_ids=None, position_ids=None):
    self.check_length(length)
    ids = self.check_position_ids(length, position_ids, self.max_len)
    rank = position_rank(self.rank, self.head_dim)
    layers, heads = self.sharing_dims(self.sharing)
    shape = (layers, self.max_len, heads, rank)
    axes = ("layers", "abspos", "heads", "rank")
    init = nn.initializers.normal(0.02)
    p_q = self.logical_param("p_query", init, shape, axes)
    p_k = self.logical_param("p_key", init, shape, axes)
    if ids is None:
      u, v = p_q[:, :length], p_k[:, :length]  # [layers, L, heads, rank]
    else:  # rows at the ids: [layers, B, L, heads, rank]
      u, v = lookup_rows(p_q, ids, axis=1), lookup_rows(p_k, ids, axis=1)
    return SchemeTerms(terms=(Factored(u, v),),
                       content_scale=self.content_scale)
