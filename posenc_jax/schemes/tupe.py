"""TUPE (Ke et al. 2021): untied positional correlations, the [CLS] reset,
and the BERT-A^d ablation.

TUPE-A (eq. 10)::

  v_ij = (LN(p_i) U_Q) . (LN(p_j) U_K) / sqrt(2 D)

with ``U_Q, U_K`` (with bias) shared by all layers, so the term is computed
once per forward pass. The reset (eq. 9) sets row 0 to ``theta_1`` and
column 0 of the other rows to ``theta_2``. Both stay in factored form: with
``u_0 = v_0 = 0`` the reset adds the rank-2 correction
``u_extra_i = [theta_1 e0(i), theta_2 (1 - e0(i))]``, ``v_extra_j = [1, e0(j)]``.
TUPE-R (eq. 11) adds a T5 bias, per head and shared by all layers, inside
the reset (its row 0 and column 0 are zeroed). The reference code
(guolinke/TUPE, ``TransformerSentenceEncoder.__init__``) instead points row 0
and column 0 of that bias at two more learned buckets per head:
[CLS]-to-others (row 0, ``[0, 0]`` included) and others-to-[CLS] (column 0
of the other rows). ``cls_buckets=True`` takes that form; the two values add
to ``theta_1`` and ``theta_2`` in the factored correction above, so the
relative part stays a Toeplitz term with row 0 and column 0 zeroed (the
flash kernel runs it) and the folded q/k keep their width.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from posenc_jax.schemes.base import BOOL, POSITIVE_INT, Scheme
from posenc_jax.schemes.t5 import BucketedOffsets, bucket_problem
from posenc_jax.terms import Factored, QKShift, SchemeTerms, Toeplitz, lookup_rows

Array = jax.Array


class UntiedPositions(nn.Module):
  """``LN(p) U_Q`` and ``LN(p) U_K`` per head, for TUPE and BERT-A^d.

  Attributes:
    num_heads, head_dim, d_model, max_len: as in :class:`Scheme`.
  """

  num_heads: int
  head_dim: int
  d_model: int
  max_len: int

  def setup(self):
    self.position_embedding = self.param(
        "position_embedding",
        nn.with_logical_partitioning(nn.initializers.normal(0.02), ("abspos", "embed")),
        (self.max_len, self.d_model))
    self.norm = nn.LayerNorm(epsilon=1e-5, scale_init=nn.with_logical_partitioning(
        nn.initializers.ones, ("embed",)), bias_init=nn.with_logical_partitioning(
            nn.initializers.zeros, ("embed",)))
    self.query, self.key = (nn.DenseGeneral(
        (self.num_heads, self.head_dim), name=name,
        kernel_init=nn.with_logical_partitioning(nn.initializers.normal(0.02),
                                                 ("embed", "heads", "kv")),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("heads", "kv")))
                            for name in ("pos_query", "pos_key"))

  def __call__(self, p: Array) -> tuple[Array, Array]:
    """Args: ``p`` ``[N, d]`` position vectors. Returns two ``[N, H, D]``."""
    p = self.norm(p)
    return self.query(p), self.key(p)

  def positions(self, length: int, position_ids: Array | None = None
                ) -> tuple[Array, Array]:
    """``LN(p_i) U_Q`` and ``LN(p_i) U_K`` for ``i < length``, each ``[L, H, D]``; at
    ``position_ids`` ``[B, L]`` (rows read by :func:`lookup_rows`), each ``[B, L, H, D]``."""
    if position_ids is None:
      return self(self.position_embedding[:length])
    return self(lookup_rows(self.position_embedding, position_ids))


class Tupe(Scheme):
  """TUPE-A, TUPE-R and the TUPE-A^tie-cls ablation.

  Attributes:
    relative: add the T5 bias (TUPE-R).
    untie_cls: apply the [CLS] reset (False: TUPE-A^tie-cls).
    num_buckets, max_distance: TUPE-R's T5 bucketing (bidirectional); unused by TUPE-A.
    cls_buckets: TUPE-R's reset in the reference code's form: row 0 and column 0 of the
      relative bias hold two learned values per head, ``cls_relative_bias`` ``[2, H]``
      (row 0: [CLS]-to-others, row 1: others-to-[CLS]; shared by all layers), instead of
      eq. 11's zeros. Needs ``relative`` and ``untie_cls``. Default False (eq. 11, and
      the parameters of checkpoints saved without it).
  """

  relative: bool = False
  untie_cls: bool = True
  num_buckets: int = 32
  max_distance: int = 128
  cls_buckets: bool = False

  @property
  def scheme_name(self):
    return "tupe_r" if self.relative else "tupe_a"

  absolute_table = True
  hyperparameters = {"relative": BOOL, "untie_cls": BOOL, "num_buckets": POSITIVE_INT,
                     "max_distance": POSITIVE_INT, "cls_buckets": BOOL}

  @classmethod
  def joint_problem(cls, values):
    if values["cls_buckets"] and not (values["relative"] and values["untie_cls"]):
      return ("cls_buckets must be false unless relative and untie_cls are true (its buckets "
              "fill row 0 and column 0 of the [CLS] reset's relative bias), got "
              f"relative={values['relative']}, untie_cls={values['untie_cls']}")
    if not values["relative"]:
      return None
    return bucket_problem(values["num_buckets"], values["max_distance"], bidirectional=True)

  @classmethod
  def folded_rank(cls, values, head_dim):
    """D, and 2 more for the [CLS] reset's correction."""
    return head_dim + (2 if values["untie_cls"] else 0)

  @nn.compact
  def __call__(self, length, segment_ids=None, position_ids=None):
    """With ``position_ids`` the [CLS] reset applies to every token at position 0 (each
    packed sequence's first token), and the relative part is a dense per-example bias."""
    self.check_length(length)
    ids = self.check_position_ids(length, position_ids, self.max_len)
    scale = 1.0 / math.sqrt(2 * self.head_dim)
    untied = UntiedPositions(self.num_heads, self.head_dim, self.d_model, self.max_len,
                             name="positions")
    u, v = untied.positions(length, ids)  # [L, H, D] or [B, L, H, D]
    u = u * scale
    terms = []
    if self.untie_cls:
      cls = self.logical_param("cls_positions", nn.initializers.normal(0.02),
                               (2, self.d_model), ("cls", "embed"))
      theta_q, theta_k = untied(cls)
      theta = jnp.sum(theta_q * theta_k, axis=-1) * scale  # [2, H]
      if self.cls_buckets:  # [CLS]-to-others and others-to-[CLS] buckets, [2, H]
        theta = theta + self.logical_param("cls_relative_bias", nn.initializers.normal(0.02),
                                           (2, self.num_heads), ("cls", "heads"))
      positions = jnp.arange(length) if ids is None else ids
      first = (positions == 0).astype(u.dtype)[..., None]  # e0, [L, 1] or [B, L, 1]
      u_extra = jnp.stack([theta[0] * first, theta[1] * (1 - first)], axis=-1)
      u_extra = jnp.broadcast_to(u_extra, u.shape[:-1] + (2,))
      v_extra = jnp.broadcast_to(jnp.stack([jnp.ones_like(first), first], axis=-1),
                                 u_extra.shape)
      u = jnp.concatenate([u * (1 - first)[..., None], u_extra], axis=-1)
      v = jnp.concatenate([v * (1 - first)[..., None], v_extra], axis=-1)
    terms.append(Factored(u[None], v[None]))
    if self.relative:
      table = self.logical_param("relative_bias", nn.initializers.normal(0.02),
                                 (self.num_heads, self.num_buckets), ("heads", "buckets"))
      terms.append(Toeplitz(table[None], BucketedOffsets(self.max_distance, bidirectional=True),
                            zero_first=self.untie_cls,
                            **self.toeplitz_positions(length, position_ids)))
    return SchemeTerms(terms=tuple(terms), content_scale=scale)


class BertAd(Scheme):
  """TUPE's BERT-A^d ablation: the four word/position terms with their own projections.

  ``alpha_ij = ((x_i W_Q + LN(p_i) U_Q) . (x_j W_K + LN(p_j) U_K)) / sqrt(4 D)``,
  i.e. q and k shifted by the projected positions (a q/k transform, so every
  kernel runs it). Positions enter only through ``U_Q, U_K`` (shared by all
  layers, as in TUPE); the input carries no position table, so BERT-A^d
  differs from TUPE-A^tie-cls only by the two word-position cross terms,
  which is the comparison the ablation makes.
  """

  scheme_name = "bert_ad"
  absolute_table = True

  @nn.compact
  def __call__(self, length, segment_ids=None, position_ids=None):
    self.check_length(length)
    ids = self.check_position_ids(length, position_ids, self.max_len)
    untied = UntiedPositions(self.num_heads, self.head_dim, self.d_model, self.max_len,
                             name="positions")
    q_shift, k_shift = untied.positions(length, ids)
    return SchemeTerms(terms=(QKShift(q_shift[None], k_shift[None]),),
                       content_scale=1.0 / math.sqrt(4 * self.head_dim))
