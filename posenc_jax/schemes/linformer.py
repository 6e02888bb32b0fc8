"""DIET-ABS-LIN (Chen et al. 2021, eq. 4): DIET-ABS for Linformer attention.

Linformer (Wang et al. 2020) projects the layer input ``X`` along the
sequence before the key projection, ``K' = (E X) W_K + b_K`` with ``E``
``[k, L]`` (:mod:`posenc_jax.models.linformer`), so the logits are ``[L, k]``
and a key row no longer stands for one position. DIET-ABS-LIN keeps a
per-head absolute term whose key side lives in the projected space (DIET
writes no bias)::

  A^h = c q^h (E X W_K^h + b_K^h)^T + P_Q^h P_K^{hT},   P_Q^h [L_max, d_p],  P_K^h [k, d_p]

The term is input-independent (shared by the batch) and factored, so the
fused route folds it into q/k as DIET-ABS does. The scheme has no input
position table; it needs ``attention='linformer'`` with ``linformer_k == k``
(checked by :func:`posenc_jax.models.model_config`).
"""

from __future__ import annotations

import flax.linen as nn

from posenc_jax.schemes.base import POSITIVE_INT, SHARING, Scheme, one_of, optional
from posenc_jax.schemes.diet import position_rank
from posenc_jax.terms import Factored, SchemeTerms, lookup_rows


class DietAbsLin(Scheme):
  """``T[h, i, r] = (P_Q^h[:L] P_K^{hT})_{ir}``: a ``[L, k]`` term per head.

  Parameters (``layers`` is 1 under ``layer`` sharing, ``heads`` is 1 under
  ``head`` sharing):

    p_query  ``[layers, L_max, heads, d_p]``  axes (layers, abspos, heads, rank)
    p_key    ``[layers, k, heads, d_p]``      axes (layers, linformer_k, heads, rank)

  Attributes:
    rank: d_p; None gives D (the head width).
    k: Linformer's projected key length (must equal ``model.linformer_k``).
      DIET's tables label it ``d``: "DIET-ABSLIN (d=32)" is ``k = 32``.
    sharing: ``none`` (per layer and head), ``layer`` or ``head``.
  """

  rank: int | None = None
  k: int = 128
  sharing: str = "none"

  scheme_name = "diet_abs_lin"
  absolute_table = True
  fits_linformer = True
  hyperparameters = {"rank": optional(POSITIVE_INT), "k": POSITIVE_INT,
                     "sharing": one_of(*SHARING)}

  @classmethod
  def projected_keys(cls, values):
    return values["k"]

  @classmethod
  def folded_rank(cls, values, head_dim):
    return position_rank(values["rank"], head_dim)

  @nn.compact
  def __call__(self, length, segment_ids=None, position_ids=None):
    """One :class:`Factored` term.

    Its ``u`` is ``[layers, L, heads, d_p]`` and its ``v`` ``[layers, k, heads, d_p]``.
    """
    self.check_length(length)
    ids = self.check_position_ids(length, position_ids, self.max_len)
    rank = position_rank(self.rank, self.head_dim)
    layers, heads = self.sharing_dims(self.sharing)
    init = nn.initializers.normal(0.02)
    p_q = self.logical_param("p_query", init, (layers, self.max_len, heads, rank),
                             ("layers", "abspos", "heads", "rank"))
    p_k = self.logical_param("p_key", init, (layers, self.k, heads, rank),
                             ("layers", "linformer_k", "heads", "rank"))
    u = p_q[:, :length] if ids is None else lookup_rows(p_q, ids, axis=1)
    # With ids u is [layers, B, L, heads, d_p]; v keeps the projected keys' k rows (the
    # batch broadcasts over them).
    return SchemeTerms(terms=(Factored(u, p_k if ids is None else p_k[:, None]),))
