"""What one scheme contributes to a forward pass: :class:`SchemeTerms`, an optional
:class:`~posenc_jax.terms.InputEmbedding` and attention terms whose array leaves carry a
leading layer axis (``num_layers``, or 1 for a value every layer shares), and
:func:`layer_terms`, which joins one layer's terms back inside a scan."""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from posenc_jax.terms.embedding import InputEmbedding
from posenc_jax.terms.protocol import Term

Array = jax.Array


def _is_shared(x: Array) -> bool:
  """A term leaf shared by all layers: a scalar (QueryRelative.q_offset) or a leading
  layer axis of 1."""
  return jnp.ndim(x) == 0 or x.shape[0] == 1


def _shared(x: Array) -> Array:
  """A shared leaf's value for one layer (its layer axis of 1 dropped); None stays None."""
  return x if x is None or jnp.ndim(x) == 0 else x[0]


def layer_terms(per_layer: tuple[Any, ...], shared: tuple[Any, ...]) -> list[Term]:
  """One layer's terms inside a scan from :meth:`SchemeTerms.split_layers`'s halves:
  ``per_layer`` already sliced to the layer, ``shared`` as split."""
  return list(jax.tree.map(lambda own, common: _shared(common) if own is None else own,
                           per_layer, shared, is_leaf=lambda x: x is None))


@struct.dataclass
class SchemeTerms:
  """Everything one scheme contributes to a forward pass.

  Attributes:
    embedding: optional :class:`InputEmbedding`.
    terms: attention terms; every array leaf carries a leading layer axis of
      size ``num_layers`` (one value per layer) or 1 (one value shared by all
      layers, computed once per forward pass).
    content_scale: the scale ``c`` of ``q . k`` the scheme asks for, or None
      for the usual ``1 / sqrt(D)``.
  """

  embedding: InputEmbedding | None = None
  terms: tuple[Any, ...] = ()
  content_scale: float | None = struct.field(pytree_node=False, default=None)

  def num_layers(self) -> int:
    """The leading layer axis of the per-layer terms (1 when every term is shared)."""
    return max((jnp.shape(x)[0] for x in jax.tree.leaves(self.terms) if jnp.ndim(x)),
               default=1)

  def for_layer(self, layer: int) -> list[Term]:
    """The terms of layer ``layer`` (shared terms are reused, not recomputed).

    Raises a one-line ValueError unless ``layer`` is an integer ``>= 0`` and, when a term
    has one value per layer, below their number (shared terms fit any layer).
    """
    layers = self.num_layers()
    if not isinstance(layer, numbers.Integral) or layer < 0 or (layers > 1 and layer >= layers):
      allowed = f"an integer in [0, {layers})" if layers > 1 else "an integer >= 0"
      raise ValueError(f"SchemeTerms.for_layer: got layer {layer!r}; allowed: {allowed}")
    return [jax.tree.map(lambda x: _shared(x) if _is_shared(x) else x[layer], t)
            for t in self.terms]

  def split_layers(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """``(per_layer, shared)`` for a scan over the layers (``nn.scan``).

    Both have the structure of ``terms``: ``per_layer`` holds the leaves with one value
    per layer (leading axis ``num_layers()``, scanned over) and None for the rest;
    ``shared`` the leaves shared by all layers (leading axis 1, or scalars; broadcast
    once) and None for the rest. :func:`layer_terms` joins one layer's slice back.
    """
    per_layer = jax.tree.map(lambda x: None if _is_shared(x) else x, self.terms)
    shared = jax.tree.map(lambda x: x if _is_shared(x) else None, self.terms)
    return per_layer, shared

  def slice_queries(self, start: int | Array, size: int) -> SchemeTerms:
    """Every term (and the input embedding) restricted to query rows ``[start, start + size)``.

    Used by incremental decoding: the terms are built once for the whole
    decode length, so a step's query keeps its absolute position and the
    keys keep theirs.
    """
    embedding = None if self.embedding is None else self.embedding.slice_queries(start, size)
    terms = tuple(t.slice_queries(start, size) for t in self.terms)
    return self.replace(embedding=embedding, terms=terms)

  def embed(self, x: Array) -> Array:
    """Adds the input-level term (if any) to embeddings ``x`` ``[B, L, d]``.

    The embedding's value is ``[L, d]`` or ``[B|1, L, d]``; other shapes raise one
    ValueError line.
    """
    if self.embedding is None:
      return x
    value = self.embedding.value
    if (jnp.ndim(x) != 3 or jnp.ndim(value) not in (2, 3) or value.shape[-2:] != x.shape[1:]
        or (value.ndim == 3 and value.shape[0] not in (1, x.shape[0]))):
      raise ValueError(f"SchemeTerms.embed: embedding.value is {list(jnp.shape(value))}, but x "
                       f"is {list(jnp.shape(x))}; expected [L, d] or [B|1, L, d] for x [B, L, d]")
    return x + value.astype(x.dtype)

  def __add__(self, other: SchemeTerms) -> SchemeTerms:
    """Composes two schemes' terms (e.g. a position and a segment scheme)."""
    scales = {s for s in (self.content_scale, other.content_scale) if s is not None}
    if len(scales) > 1:
      raise ValueError(f"content_scale: schemes ask for different content scales {sorted(scales)}")
    if self.embedding is None or other.embedding is None:
      embedding = self.embedding or other.embedding
    else:
      embedding = InputEmbedding(self.embedding.value + other.embedding.value)
    return SchemeTerms(embedding, self.terms + other.terms, scales.pop() if scales else None)
