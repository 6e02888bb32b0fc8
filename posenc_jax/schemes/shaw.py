"""Shaw et al.'s query-dependent relative scheme, and Wang et al.'s fixed and
learnable sinusoidal RPE (Shaw's key term with a sinusoidal table)."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from posenc_jax.schemes.absolute import sinusoid, sinusoid_param
from posenc_jax.schemes.base import BOOL, NON_NEGATIVE_INT, Scheme, one_of
from posenc_jax.terms import QueryRelative, SchemeTerms


class ShawRPE(Scheme):
  """``T[b,h,i,j] = c q_i . a^K_{clip(j-i, -t, t)}``; one table per layer shared by heads.

  Attributes:
    clip: t; offsets beyond +-t share the end rows. Table ``[2t+1, D]``.
    value: also add Shaw's value term ``sum_j alpha_ij a^V_{clip(j-i)}``.
    sharing: ``none`` (a table per layer) or ``layer`` (one for all layers).
  """

  clip: int = 16
  value: bool = False
  sharing: str = "none"

  scheme_name = "shaw"
  hyperparameters = {"clip": NON_NEGATIVE_INT, "value": BOOL, "sharing": one_of("none", "layer")}

  @nn.compact
  def __call__(self, length, segment_ids=None):
    self.check_length(length)
    layers, _ = self.sharing_dims(self.sharing)
    shape = (layers, 2 * self.clip + 1, self.head_dim)
    axes = ("layers", "relpos", "kv")
    init = nn.initializers.normal(0.02)
    key_table = self.logical_param("key_table", init, shape, axes)
    value_table = self.logical_param("value_table", init, shape, axes) if self.value else None
    return SchemeTerms(terms=(QueryRelative(key_table, value_table, clip=self.clip),))


class SinusoidalRPE(Scheme):
  """Shaw's key term with ``a^K_r = sinusoid(r)`` over ``D`` dims, shared by heads and layers.

  Attributes:
    learnable: train the ``D / 2`` frequencies.
    clip: offsets truncated to ``[-clip, clip]`` (Wang et al.: 64).
  """

  learnable: bool = False
  clip: int = 64

  scheme_name = "sinusoidal_rpe"
  even_dimension = "head_dim"
  hyperparameters = {"learnable": BOOL, "clip": NON_NEGATIVE_INT}

  @nn.compact
  def __call__(self, length, segment_ids=None):
    self.check_length(length)
    freqs = sinusoid_param(self, self.head_dim, self.learnable)
    table = sinusoid(jnp.arange(-self.clip, self.clip + 1), freqs)
    return SchemeTerms(terms=(QueryRelative(table[None], None, clip=self.clip),))
