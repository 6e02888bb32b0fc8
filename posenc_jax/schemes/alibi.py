"""ALiBi (Press et al.): a fixed linear distance penalty per head."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.schemes.base import BOOL, Scheme, one_of
from posenc_jax.terms import SchemeTerms, Toeplitz

Array = jax.Array


SLOPE_FORMS = ("reference", "geometric")


def alibi_slopes(num_heads: int, form: str = "reference") -> Array:
  """``[H]`` float32 slopes ``m_h``, steepest first.

  ``geometric``: ``m_h = 2^(-8 h / H)``, h = 1..H, the paper's text (Press et al.,
  section 3). ``reference``: ``get_slopes`` of the ALiBi authors' code
  (ofirpress/attention_with_linear_biases), also BLOOM's, Hugging Face's and
  flash-attention's. It equals ``geometric`` when H is a power of two; otherwise, with
  ``p`` the largest power of two below H, it takes the ``p`` geometric slopes for ``p``
  heads, then every other geometric slope for ``2p`` heads, ``2^(-4 (2i - 1) / p)``,
  i = 1..H-p (H = 12: ``2^-1 .. 2^-8, 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5``).

  Raises:
    ValueError: ``form`` not in :data:`SLOPE_FORMS`, in one line.
  """
  if form not in SLOPE_FORMS:
    raise ValueError(f"alibi_slopes: form must be one of {', '.join(map(repr, SLOPE_FORMS))}, "
                     f"got {form!r}")
  if form == "geometric":
    exponents = np.arange(1, num_heads + 1) * 8 / num_heads
  else:
    p = 1 << (num_heads.bit_length() - 1)
    exponents = np.concatenate([np.arange(1, p + 1) * 8 / p,
                                np.arange(1, 2 * (num_heads - p), 2) * 4 / p])
  return jnp.asarray(2.0 ** -exponents, jnp.float32)


@dataclasses.dataclass(frozen=True)
class LinearDistance:
  """ALiBi's offset function: ``-m_h |i - j|`` (causal: ``-m_h max(i - j, 0)``).

  Called as ``(slopes [..., 1], rel [N]) -> [..., N]`` (see
  :class:`posenc_jax.terms.Toeplitz`).
  """

  causal: bool = False

  @property
  def closed_form(self) -> str:
    """The closed form's name in the route table (:class:`posenc_jax.route_table.Point`'s
    ``closed_ms``): the causal form costs the same."""
    return "alibi"

  def closed(self, params: tuple[Array], rel: Array) -> Array:
    """The bias from ``params = (m,)`` (broadcastable against ``rel``, any shape): what the
    kernel evaluates in its tiles."""
    (slopes,) = params
    distance = jnp.maximum(-rel, 0) if self.causal else jnp.abs(rel)
    return -slopes * distance.astype(jnp.float32)

  def causal_slope(self, slopes: Array) -> Array:
    """``m`` ``[H|1]`` of ``slopes`` ``[H|1, 1]``: on the causal half (``rel = j - i <= 0``)
    both forms are ``m (j - i)``, separable (:meth:`posenc_jax.terms.Toeplitz.key_vector`)."""
    return slopes[..., 0]

  def __call__(self, slopes: Array, rel: Array) -> Array:
    return self.closed((slopes,), rel)


class Alibi(Scheme):
  """``T[h,i,j] = -m_h |i - j|`` (symmetric) or ``-m_h (i - j)`` for ``j <= i`` (causal).

  The causal form leaves ``j > i`` at 0: the attention's causal mask removes
  those keys. No parameters.

  Attributes:
    causal: the decoder form.
    slopes: ``reference`` (the ALiBi authors' code) or ``geometric`` (the paper's
      ``2^(-8 h / H)``); they differ only when H is not a power of two
      (:func:`alibi_slopes`).
  """

  causal: bool = False
  slopes: str = "reference"

  scheme_name = "alibi"
  hyperparameters = {"causal": BOOL, "slopes": one_of(*SLOPE_FORMS)}
  causal_fields = {"causal": True}

  @nn.compact
  def __call__(self, length, segment_ids=None, position_ids=None):
    self.check_length(length)  # the term is built for any length
    positions = self.toeplitz_positions(length, position_ids)
    slopes = alibi_slopes(self.num_heads, self.slopes)[None, :, None]  # [1 (layers), H, 1]
    return SchemeTerms(terms=(Toeplitz(slopes, LinearDistance(self.causal), **positions),))
