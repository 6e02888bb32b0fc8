"""CoPE (Golovneva et al. 2024): contextual positions, counted by gates on the content.

Section 3 of "Contextual Position Encoding: Learning to Count What's Important" (arXiv
2405.18719) gives, for a query ``i`` and a key ``j <= i``, gates ``g_ij = sigmoid(q_i . k_j)``
(eq. 3), the position ``p_ij = sum_{t=j..i} g_it`` (eq. 4), and the term
``q_i . e[p_ij]`` with ``e[p]`` interpolated between the rows of a learned table ``e``:
``(1 - f) e[floor(p)] + f e[floor(p) + 1]``, ``f = p - floor(p)`` (eq. 5-6). The paper's
listing (and facebookresearch/RAM, ``projects/cope/src/cope/context_position.py``) fixes what
the text leaves open: the gates read the *scaled* content logits, ``sigmoid(q_i . k_j /
sqrt(D))``; ``p`` is clipped at ``npos - 1``; the table ``[npos, D]`` starts at zero and is
shared by the heads of a layer; ``npos`` defaults to the block size + 1. The position term
is added unscaled, as in the listing. ``docs/schemes/cope.md`` states the sources.

The term reads q and k (:class:`~posenc_jax.terms.ContextualPositions`): a dense
``[B, H, L, L]`` bias on both routes. A decoder scheme: the positions count the keys up to
the query, so keys after it (the causal mask removes them) sit at ``p = 0``; bidirectional
stacks refuse it (:attr:`~posenc_jax.schemes.base.Scheme.causal_only`).
"""

from __future__ import annotations

import flax.linen as nn

from posenc_jax.schemes.base import POSITIVE_INT, GridBytes, Scheme, one_of, optional
from posenc_jax.terms import ContextualPositions, SchemeTerms


class Cope(Scheme):
  """``T[b, h, i, j] = q_i . e[p_ij]``, ``p_ij = sum_{t=j..i} sigmoid(c q_i . k_t)``.

  Parameters: ``table`` ``[layers, npos, D]`` (``layers`` = ``num_layers``, or 1 when
  shared), zeros at initialisation (the reference code's).

  Attributes:
    npos_max: ``npos``, the table's rows; positions are clipped at ``npos - 1``. None:
      ``max_len + 1`` (the reference code's block size + 1: no clipping up to ``max_len``).
    sharing: ``none`` (a table per layer, the paper's) or ``layer`` (one for all layers, the
      reference code's ``--cope-shared``).
  """

  npos_max: int | None = None
  sharing: str = "none"

  scheme_name = "cope"
  causal_only = True  # the paper's positions count keys j..i only: no encoder form
  hyperparameters = {"npos_max": optional(POSITIVE_INT), "sharing": one_of("none", "layer")}

  def num_positions(self) -> int:
    """``npos``: the table's rows."""
    return self.max_len + 1 if self.npos_max is None else self.npos_max

  @classmethod
  def layer_flops(cls, values, dims, length):
    """Each query times the ``npos`` table rows, ``2 H L npos D``, and the gates' own
    ``q . k`` (the term computes it again), ``2 H L^2 D``."""
    npos = dims["max_len"] + 1 if values["npos_max"] is None else values["npos_max"]
    return 2 * dims["num_heads"] * length * (npos + length) * dims["head_dim"]

  @classmethod
  def grid_bytes(cls, values, dims):
    """Arrays ``[B, H, L, L]`` of float32 or int32 the term computes (measured against XLA's
    plan of the compiled train step on CPU): the backward keeps 8 (the gates, the positions,
    their floor and fraction, the two rows' indices and values), 2 of them matmul outputs
    (the gates' logits, the rows ``q . e``); differentiating a layer holds 12 more (their
    gradients, the gathers' scatter indices), and a forward pass 2."""
    del values
    return GridBytes(kept=8 * 4 * dims["num_heads"], kept_dots=2 * 4 * dims["num_heads"],
                     working=12 * 4 * dims["num_heads"], forward=2 * 4 * dims["num_heads"])

  @nn.compact
  def __call__(self, length, segment_ids=None, position_ids=None):
    self.check_length(length)  # positions are counted, not read: any length
    self.check_position_ids(length, position_ids)  # packed rows: segment_ids mask the rest
    layers, _ = self.sharing_dims(self.sharing)
    table = self.logical_param("table", nn.initializers.zeros,
                               (layers, self.num_positions(), self.head_dim),
                               ("layers", "relpos", "kv"))
    return SchemeTerms(terms=(ContextualPositions(table),))
