"""ALiBi (Press et al.): a fixed linear distance penalty per head."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from posenc_jax.schemes.base import BOOL, Scheme
from posenc_jax.terms import SchemeTerms, Toeplitz

Array = jax.Array


def alibi_slopes(num_heads: int) -> Array:
  """``[H]`` slopes ``m_h = 2^(-8 h / H)``, h = 1..H."""
  return 2.0 ** (-8.0 * jnp.arange(1, num_heads + 1, dtype=jnp.float32) / num_heads)


@dataclasses.dataclass(frozen=True)
class LinearDistance:
  """ALiBi's offset function: ``-m_h |i - j|`` (causal: ``-m_h max(i - j, 0)``).

  Called as ``(slopes [..., 1], rel [N]) -> [..., N]`` (see
  :class:`posenc_jax.terms.Toeplitz`).
  """

  causal: bool = False

  def __call__(self, slopes: Array, rel: Array) -> Array:
    distance = jnp.maximum(-rel, 0) if self.causal else jnp.abs(rel)
    return -slopes * distance.astype(jnp.float32)


class Alibi(Scheme):
  """``T[h,i,j] = -m_h |i - j|`` (symmetric) or ``-m_h (i - j)`` for ``j <= i`` (causal).

  The causal form leaves ``j > i`` at 0: the attention's causal mask removes
  those keys. No parameters.

  Attributes:
    causal: the decoder form.
  """

  causal: bool = False

  scheme_name = "alibi"
  hyperparameters = {"causal": BOOL}

  @nn.compact
  def __call__(self, length, segment_ids=None):
    self.check_length(length)  # the term is built for any length
    slopes = alibi_slopes(self.num_heads)[None, :, None]  # [1 (layers), H, 1]
    return SchemeTerms(terms=(Toeplitz(slopes, LinearDistance(self.causal)),))
