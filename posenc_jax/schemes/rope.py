"""RoPE (Su et al.): q and k rotated pairwise by position-dependent angles."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from posenc_jax.schemes.absolute import sinusoid_frequencies
from posenc_jax.schemes.base import Check, Scheme, is_finite_number
from posenc_jax.terms import Rotation, SchemeTerms


class Rope(Scheme):
  """Rotates each pair ``(q_{2k}, q_{2k+1})`` by ``i theta_k``, ``theta_k = base^(-2k/D)``.

  Attributes:
    base: 10000 as in Su et al.
  """

  base: float = 10000.0

  scheme_name = "rope"
  even_dimension = "head_dim"
  # theta_k = base^(-2k/D) falls with k only for base > 1.
  hyperparameters = {"base": Check(lambda x: is_finite_number(x) and x > 1, "a finite number > 1")}

  @nn.compact
  def __call__(self, length, segment_ids=None):
    self.check_length(length)
    theta = sinusoid_frequencies(self.head_dim, self.base)
    angles = jnp.arange(length, dtype=jnp.float32)[:, None] * theta[None, :]
    return SchemeTerms(terms=(Rotation(angles[None], angles[None]),))
