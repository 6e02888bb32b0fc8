"""xPos (Sun et al., ACL 2023, "A Length-Extrapolatable Transformer", section 3): RoPE
whose rotated pairs are also scaled, exponentially in the position, so that every logit
decays with the distance ``n - m`` and depends on it alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.schemes.base import POSITIVE_FLOAT
from posenc_jax.schemes.rope import Rope
from posenc_jax.terms import SchemeTerms

Array = jax.Array

# The 0.4 of zeta_k in the paper and in both reference implementations.
ZETA_OFFSET = 0.4


def xpos_zeta(rotated: int) -> np.ndarray:
  """``[R/2]`` float64 ``zeta_k = (2k / R + 0.4) / 1.4``, from ``0.4 / 1.4`` up to below 1."""
  return (np.arange(0, rotated, 2) / rotated + ZETA_OFFSET) / (1.0 + ZETA_OFFSET)


def centred_positions(length: int, position_ids: Array | None) -> Array:
  """``[L]`` positions ``n - c`` with ``c = ceil(L / 2)`` (the reference's centring), or
  ``[B, L]`` at ``position_ids`` with each row's ``c = ceil((min + max + 1) / 2)``, the
  same centre for ids ``0..L-1``; int32."""
  if position_ids is None:
    return jnp.arange(length, dtype=jnp.int32) - (length + 1) // 2
  low = jnp.min(position_ids, axis=-1, keepdims=True)
  high = jnp.max(position_ids, axis=-1, keepdims=True)
  return position_ids - (low + high + 2) // 2


class Xpos(Rope):
  """RoPE (:class:`~posenc_jax.schemes.rope.Rope`'s angles, layout and partial rotary) with
  pair ``k`` of q at position ``n`` scaled by ``zeta_k^(n / gamma)`` and of k at position
  ``m`` by ``zeta_k^(-m / gamma)`` (Sun et al. 2023, section 3), so that logit ``(n, m)``
  of pair ``k`` is RoPE's times ``zeta_k^((n - m) / gamma)``: a function of ``n - m``
  only, decaying as the query moves past the key (``zeta_k < 1``), fastest for the high
  frequencies.

  ``zeta_k = (2k / R + 0.4) / 1.4`` (:func:`xpos_zeta`) over the ``R`` rotated features,
  ``gamma = scale_base``. Positions enter the scales centred, ``n - ceil(L / 2)``, as in
  the reference implementation (microsoft/torchscale ``XPOS``: positions from
  ``-(L // 2)`` rounded down); the centre cancels from every logit, and halves the largest
  exponent. With ``position_ids`` each row is centred on the middle of its ids' span
  (:func:`centred_positions`); cached decoding builds the terms once for the cache's
  length, so every step shares that centre (the reference recentres each step on the
  keys seen so far: other q and k, the same logits).

  Range: the scales lie in ``3.5^(+-ceil(L / 2) / gamma)`` (``1 / zeta_0 = 3.5``; the
  extremes at position 0), computed in float32 and cast to q's dtype. They stay finite and
  normal (at least ``2^-126``) in float32 and bfloat16, which share the exponent range,
  while ``ceil(L / 2) <= 126 ln 2 gamma / ln 3.5``: ``L <= 71,388`` at ``gamma = 512``
  (about ``139 gamma``); from ``L = 72,521`` the largest overflows. float16 (normal from
  ``2^-14``) stays normal up to ``L = 7,932``. Logits of a key at or before the query
  (``n >= m``) only shrink (factor ``<= 1``); a key ``m - n`` positions ahead multiplies
  pair 0 by ``3.5^((m - n) / gamma)``, past float32's range when ``m - n > 36,260`` at
  ``gamma = 512`` (an encoder's logits, or a decoder's masked ones before the mask).

  Causal and bidirectional: xPos is used in decoders (the paper's language models;
  x-transformers allows it only with causal attention), where every attended key is at or
  before the query. The transform itself is the same for an encoder, which this module
  allows: there the keys ahead of a query are scaled up, growing with the distance, not
  decayed, up to ``3.5^(L / gamma)``: large logits that bfloat16 rounds coarsely (on an
  H200, bidirectional bfloat16 outputs at ``L = 4096``, ``gamma = 512`` were off by up to 5
  against float32; causal ones by 0.015 up to ``L = 16,384``; docs/schemes/xpos.md). An
  encoder wants ``L`` of a few ``gamma`` at most. No causal fields.

  Attributes:
    base, layout, fraction: RoPE's (:class:`~posenc_jax.schemes.rope.Rope`).
    scale_base: ``gamma``, 512 in the paper and both reference implementations (torchscale's
      ``xpos_scale_base``, x-transformers' ``rotary_xpos_scale_base``).
  """

  scale_base: float = 512.0

  scheme_name = "xpos"
  hyperparameters = {**Rope.hyperparameters, "scale_base": POSITIVE_FLOAT}

  def scales(self, length: int, position_ids: Array | None = None) -> tuple[Array, Array]:
    """float32 ``(q_scale, k_scale)``, ``zeta_k^(+-(n - c) / gamma)``: ``[L, R/2]``, or
    ``[B, L, R/2]`` at int ``position_ids`` ``[B, L]``."""
    log_zeta = jnp.asarray(np.log(xpos_zeta(self.rotated_dim)), jnp.float32)
    exponent = centred_positions(length, position_ids).astype(jnp.float32)[..., None] * (
        log_zeta / self.scale_base)
    return jnp.exp(exponent), jnp.exp(-exponent)

  def __call__(self, length, segment_ids=None, position_ids=None):
    """RoPE's :class:`~posenc_jax.terms.Rotation` with ``q_scale`` and ``k_scale``
    ``[1 (layers), L, R/2]``, or ``[1, B, L, R/2]`` at ``position_ids``."""
    (rotation,) = super().__call__(length, segment_ids, position_ids).terms
    q_scale, k_scale = self.scales(length, self.check_position_ids(length, position_ids))
    return SchemeTerms(terms=(rotation.replace(q_scale=q_scale[None], k_scale=k_scale[None]),))

