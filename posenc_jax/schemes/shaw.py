"""Shaw et al.'s query-dependent relative scheme, and Wang et al.'s fixed and
learnable sinusoidal RPE (their eq. 5 with a sinusoidal table: Shaw's key and
value terms, one table for both)."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from posenc_jax.schemes.absolute import sinusoid, sinusoid_param
from posenc_jax.schemes.base import BOOL, NON_NEGATIVE_INT, Scheme, one_of
from posenc_jax.terms import QueryRelative, SchemeTerms


class QueryOffsetScheme(Scheme):
  """A scheme whose term is one :class:`QueryRelative` over the offsets clipped to
  ``[-clip, clip]``, with a value table too when ``value`` (both hyperparameters)."""

  @classmethod
  def layer_flops(cls, values, dims, length):
    """Each query times the ``2 clip + 1`` offset rows, ``2 H L (2 clip + 1) D``; twice with
    the value table."""
    rows = (2 * values["clip"] + 1) * (2 if values["value"] else 1)
    return 2 * dims["num_heads"] * length * rows * dims["head_dim"]


class ShawRPE(QueryOffsetScheme):
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
  def __call__(self, length, segment_ids=None, position_ids=None):
    self.check_length(length)
    ids = self.check_position_ids(length, position_ids)  # offsets are clipped: any integer
    layers, _ = self.sharing_dims(self.sharing)
    shape = (layers, 2 * self.clip + 1, self.head_dim)
    axes = ("layers", "relpos", "kv")
    init = nn.initializers.normal(0.02)
    key_table = self.logical_param("key_table", init, shape, axes)
    value_table = self.logical_param("value_table", init, shape, axes) if self.value else None
    return SchemeTerms(terms=(QueryRelative(key_table, value_table, clip=self.clip,
                                            position_ids=None if ids is None else ids[None]),))


class SinusoidalRPE(QueryOffsetScheme):
  """Wang et al.'s eq. 5 with ``P_r = sinusoid(r)`` over ``D`` dims, shared by heads and layers.

  The key term ``T[b,h,i,j] = c q_i . P_{clip(j-i)}`` and, with ``value``, the value
  term ``out_i += sum_j alpha_ij P_{clip(j-i)}`` (eq. 5 adds ``P`` to keys and values,
  as NEZHA's functional relative encoding does), one table ``[2 clip + 1, D]`` for both.

  Attributes:
    learnable: train the ``D / 2`` frequencies (shared by the key and value terms).
    clip: offsets truncated to ``[-clip, clip]`` (Wang et al.: 64).
    value: add the value term (the paper's eq. 5). False keeps the key term alone,
      which the fused route runs; the value term needs the reference route.
  """

  learnable: bool = False
  clip: int = 64
  value: bool = True

  scheme_name = "sinusoidal_rpe"
  even_dimension = "head_dim"
  hyperparameters = {"learnable": BOOL, "clip": NON_NEGATIVE_INT, "value": BOOL}

  @nn.compact
  def __call__(self, length, segment_ids=None, position_ids=None):
    self.check_length(length)
    ids = self.check_position_ids(length, position_ids)
    freqs = sinusoid_param(self, self.head_dim, self.learnable)
    table = sinusoid(jnp.arange(-self.clip, self.clip + 1), freqs)[None]  # [1, 2 clip + 1, D]
    return SchemeTerms(terms=(QueryRelative(table, table if self.value else None,
                                            clip=self.clip,
                                            position_ids=None if ids is None else ids[None]),))
