"""What every scheme module shares: model dimensions, sharing, parameters.

A scheme is a ``flax.linen`` module created once per model (outside the
layers). Called once per forward pass, it returns
:class:`~posenc_jax.terms.SchemeTerms`: its input-level embedding and its
attention terms for every layer, where terms shared by all layers are
computed once and reused.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax

from posenc_jax.terms import SchemeTerms

Array = jax.Array

# DIET's sharing vocabulary: separate per layer and head; one set per head
# shared by all layers; one set per layer shared by all heads.
SHARING = ("none", "layer", "head")


class SchemeConfigError(ValueError):
  """A scheme config names an unknown scheme or field, or an invalid value."""


class Scheme(nn.Module):
  """Base of every scheme module.

  Attributes:
    num_layers: attention layers that receive the terms.
    num_heads: H.
    head_dim: D (``d_model / H`` in BERT).
    d_model: model width d (input-level tables).
    max_len: L_max, the longest sequence an absolute table covers.
  """

  num_layers: int = 1
  num_heads: int = 1
  head_dim: int = 64
  d_model: int = 64
  max_len: int = 512

  # Registry name, used in error messages (set by each subclass).
  scheme_name = "scheme"
  # True when the scheme owns an absolute table of max_len positions.
  absolute_table = False
  # A model dimension that must be even (pairs of sin/cos or rotations).
  even_dimension = None

  def check_length(self, length: int) -> None:
    if self.absolute_table and length > self.max_len:
      raise SchemeConfigError(
          f"scheme {self.scheme_name!r}: sequence length {length} exceeds max_len={self.max_len}"
          " (the absolute position table's size)")

  def __call__(self, length: int, segment_ids: Array | None = None) -> SchemeTerms:
    """Terms for a self-attention pass over ``length`` positions.

    Args:
      length: L.
      segment_ids: optional ``[B, L]`` int token types (segment schemes).

    Returns:
      :class:`SchemeTerms` whose arrays carry a leading layer axis of size
      ``num_layers`` (per-layer) or 1 (shared).
    """
    raise NotImplementedError

  def sharing_dims(self, sharing: str) -> tuple[int, int]:
    """(layers, heads) axis sizes of a table under ``sharing``."""
    layers = 1 if sharing == "layer" else self.num_layers
    heads = 1 if sharing == "head" else self.num_heads
    return layers, heads

  def logical_param(self, name: str, init, shape: Sequence[int], axes: Sequence[str]) -> Array:
    """A parameter annotated with logical axis names (for mesh sharding)."""
    return self.param(name, nn.with_logical_partitioning(init, tuple(axes)), tuple(shape))


class Composite(Scheme):
  """Several schemes composed: embeddings and terms add up.

  Attributes:
    schemes: the parts (e.g. a position scheme and a segment scheme).
  """

  schemes: Sequence[Scheme] = ()

  @nn.compact
  def __call__(self, length, segment_ids=None):
    total = SchemeTerms()
    for scheme in self.schemes:
      total = total + scheme(length, segment_ids)
    return total


class NoPosition(Scheme):
  """No positional information (a bag-of-words baseline)."""

  scheme_name = "none"

  @nn.compact
  def __call__(self, length, segment_ids=None):
    return SchemeTerms()
