"""What every scheme module shares: model dimensions, sharing, parameters.

A scheme is a ``flax.linen`` module created once per model (outside the
layers). Called once per forward pass, it returns
:class:`~posenc_jax.terms.SchemeTerms`: its input-level embedding and its
attention terms for every layer, where terms shared by all layers are
computed once and reused.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.messages import nearest
from posenc_jax.terms import SchemeTerms

Array = jax.Array

# DIET's sharing vocabulary: separate per layer and head; one set per head
# shared by all layers; one set per layer shared by all heads.
SHARING = ("none", "layer", "head")
# The model dimensions every scheme is built with.
DIMENSIONS = ("num_layers", "num_heads", "head_dim", "d_model", "max_len")


class SchemeConfigError(ValueError):
  """A scheme config names an unknown scheme or field, or an invalid value."""


@dataclasses.dataclass(frozen=True)
class Check:
  """A hyperparameter's rule: ``test(value)``, the words for what is allowed, and the
  allowed names (for a typo's nearest suggestion) when the value is a name."""

  test: Callable[[Any], bool]
  allowed: str
  names: Sequence[str] = ()

  def enforce(self, scheme: str, field: str, value: Any) -> None:
    """Raises one :class:`SchemeConfigError` line unless ``value`` passes."""
    if not self.test(value):
      hint = nearest(value, self.names).rstrip(";") if isinstance(value, str) else ""
      raise SchemeConfigError(f"scheme {scheme!r}: {field} must be {self.allowed}, "
                              f"got {value!r}{hint}")


def is_int(x: Any) -> bool:
  return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_finite_number(x: Any) -> bool:
  return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


POSITIVE_INT = Check(lambda x: is_int(x) and x > 0, "a positive integer")
NON_NEGATIVE_INT = Check(lambda x: is_int(x) and x >= 0, "an integer >= 0")
POSITIVE_FLOAT = Check(lambda x: is_finite_number(x) and x > 0, "a finite positive number")
NON_NEGATIVE_FLOAT = Check(lambda x: is_finite_number(x) and x >= 0, "a finite number >= 0")
BOOL = Check(lambda x: isinstance(x, bool), "true or false")


class GridBytes(NamedTuple):
  """Bytes per query-key pair that a scheme's own computation holds besides its terms'
  values: the ``[.., L, Lk]`` arrays it computes on the way (CoPE's gates and positions,
  FIRE's MLP over the offsets), what :func:`posenc_jax.memory.step_memory` adds for it.

  Attributes:
    kept: per example and layer, what the backward pass reads, held from the layer's
      forward pass to its backward under ``remat="none"`` (recomputed in the backward
      under the other policies, so held with ``working`` there).
    kept_dots: the part of ``kept`` that is matmul outputs (what ``remat="dots"`` keeps).
    working: per example, what the layer being differentiated holds besides ``kept``.
    forward: per example, what a layer holds in a forward pass without gradients.
    batch_free: once for every example and layer, held through a training step (arrays the
      scheme computes before the layers run).
    batch_free_forward: the same in a forward pass.
  """

  kept: int = 0
  kept_dots: int = 0
  working: int = 0
  forward: int = 0
  batch_free: int = 0
  batch_free_forward: int = 0


def shared_sizes(sharing: str, num_layers: int, num_heads: int) -> tuple[int, int]:
  """(layers, heads) axis sizes of a table under ``sharing`` (:data:`SHARING`)."""
  return (1 if sharing == "layer" else num_layers), (1 if sharing == "head" else num_heads)


def one_of(*values: str) -> Check:
  return Check(lambda x: x in values, "one of " + ", ".join(repr(v) for v in values), values)


def optional(check: Check) -> Check:
  return Check(lambda x: x is None or check.test(x), check.allowed + " or None", check.names)


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
  # Hyperparameter -> its rule (the registry's fields, less a registration's fixed ones).
  hyperparameters: ClassVar[Mapping[str, Check]] = {}
  # The hyperparameters of the decoder (causal) form, set over the config's.
  causal_fields: ClassVar[Mapping[str, Any]] = {}
  # A segment scheme (``model.segment``): it reads ``segment_ids`` in ``[0, num_segments)``.
  segment_scheme = False
  # Defined for causal attention only (CoPE: its positions count the keys up to the query),
  # with no bidirectional form: refused in a bidirectional stack, the BERT encoder and the
  # encoder-decoder's encoder (:func:`posenc_jax.models.config.check_bidirectional_form`).
  causal_only = False
  # Its terms fit Linformer's projected keys: input-level, or a key side of ``k`` rows.
  # Relative, query-dependent, rotary and ``[L, L]`` absolute terms index the key
  # positions that the projection removes.
  fits_linformer = False

  def __post_init__(self):
    self.check_config(self.scheme_name, {f: getattr(self, f) for f in DIMENSIONS},
                      {f: getattr(self, f) for f in self.hyperparameters})
    super().__post_init__()

  @classmethod
  def check_config(cls, scheme: str, dims: Mapping[str, int], values: Mapping[str, Any]) -> None:
    """Raises one :class:`SchemeConfigError` line for the first invalid model dimension or
    hyperparameter: what creating the module checks, without creating it.

    Args:
      scheme: the registry name, for the message.
      dims: the model's :data:`DIMENSIONS`.
      values: every hyperparameter of ``cls`` (defaults filled in).
    """
    for field in DIMENSIONS:
      POSITIVE_INT.enforce(scheme, field, dims[field])
    cls.check_hyperparameters(scheme, values)
    field = cls.even_dimension
    if field is not None and dims[field] % 2:
      raise SchemeConfigError(f"scheme {scheme!r}: {field} must be even, got {dims[field]}")
    problem = cls.dimension_problem(dims, values)
    if problem:
      raise SchemeConfigError(f"scheme {scheme!r}: {problem}")

  @classmethod
  def check_hyperparameters(cls, scheme: str, values: Mapping[str, Any]) -> None:
    """Raises one :class:`SchemeConfigError` line for the first invalid value.

    Args:
      scheme: the registry name, for the message.
      values: every hyperparameter of ``cls`` (defaults filled in).
    """
    for field, check in cls.hyperparameters.items():
      check.enforce(scheme, field, values[field])
    problem = cls.joint_problem(values)
    if problem:
      raise SchemeConfigError(f"scheme {scheme!r}: {problem}")

  @classmethod
  def joint_problem(cls, values: Mapping[str, Any]) -> str | None:
    """What makes valid single values invalid together (``"<field> must be ..., got X"``),
    or None; ``values`` as in :meth:`check_hyperparameters`."""
    del values
    return None

  @classmethod
  def dimension_problem(cls, dims: Mapping[str, int], values: Mapping[str, Any]) -> str | None:
    """What makes valid hyperparameters invalid at the model's dimensions, or None; ``dims``
    and ``values`` as in :meth:`check_config`."""
    del dims, values
    return None

  @classmethod
  def projected_keys(cls, values: Mapping[str, Any]) -> int | None:
    """Linformer's ``k`` when the key side of the scheme's terms has ``k`` rows (the
    projected keys), so the model must run Linformer with that ``k``; None otherwise.
    ``values`` as in :meth:`check_hyperparameters`."""
    del values
    return None

  @classmethod
  def folded_rank(cls, values: Mapping[str, Any], head_dim: int) -> int:
    """``r``: the width the fused route concatenates to each head's q and k for the
    scheme's factored terms (0: none); ``values`` as in :meth:`check_hyperparameters`,
    ``head_dim`` D."""
    del values, head_dim
    return 0

  @classmethod
  def layer_flops(cls, values: Mapping[str, Any], dims: Mapping[str, int], length: int) -> int:
    """Forward matmul FLOPs of one example that each self-attention layer over ``length``
    tokens spends on the scheme's terms besides ``Q K^T`` over the folded rank (Shaw's
    query-offset products); ``values`` and ``dims`` as in :meth:`check_config`."""
    del values, dims, length
    return 0

  @classmethod
  def input_flops(cls, values: Mapping[str, Any], dims: Mapping[str, int], length: int) -> int:
    """Forward matmul FLOPs of one example of ``length`` tokens that the scheme itself
    spends once per pass (the segment schemes' one-hot contractions; batch-free work,
    done once whatever the batch, is not counted); ``values`` and ``dims`` as in
    :meth:`check_config`."""
    del values, dims, length
    return 0

  @classmethod
  def grid_bytes(cls, values: Mapping[str, Any], dims: Mapping[str, int]) -> GridBytes:
    """What the scheme's own computation holds per query-key pair (:class:`GridBytes`)
    besides its terms' values (which the estimate counts from the route plan, as it
    materialises them); ``values`` and ``dims`` as in :meth:`check_config`."""
    del values, dims
    return GridBytes()

  def check_length(self, length: int) -> None:
    """Raises one :class:`SchemeConfigError` line unless ``length`` is a positive integer
    (at most ``max_len`` for a scheme with an absolute table)."""
    if not is_int(length) or length < 1:
      raise SchemeConfigError(f"scheme {self.scheme_name!r}: length must be a positive "
                              f"integer, got {length!r}")
    if self.absolute_table and length > self.max_len:
      raise SchemeConfigError(
          f"scheme {self.scheme_name!r}: sequence length {length} exceeds max_len={self.max_len}"
          " (the absolute position table's size)")

  def check_position_ids(self, length: int, position_ids: Array | None,
                         bound: int | None = None) -> Array | None:
    """``position_ids`` as int32 ``[B, L]``, or None; one :class:`SchemeConfigError` line
    for a wrong shape or a non-integer dtype, or (concrete ids only) an id outside
    ``[0, bound)``. Under ``jax.jit`` the ids are traced and their values unchecked: an
    id at or past ``bound`` reads a row of zeros (the one-hot lookups find no row)."""
    if position_ids is None:
      return None
    name = self.scheme_name
    shape, dtype = jnp.shape(position_ids), jnp.result_type(position_ids)
    if len(shape) != 2 or shape[1] != length:
      raise SchemeConfigError(f"scheme {name!r}: position_ids has shape {shape}; expected "
                              f"[B, L] with L = {length}")
    if not jnp.issubdtype(dtype, jnp.integer):
      raise SchemeConfigError(f"scheme {name!r}: position_ids has dtype {dtype}; expected "
                              "integer positions")
    if bound is not None and not isinstance(position_ids, jax.core.Tracer):
      ids = np.asarray(position_ids)
      if ids.size and (ids.min() < 0 or ids.max() >= bound):
        raise SchemeConfigError(
            f"scheme {name!r}: position_ids must lie in [0, {bound}), got "
            f"[{ids.min()}, {ids.max()}] (max_len={self.max_len} positions)")
    return jnp.asarray(position_ids, jnp.int32)

  def toeplitz_positions(self, length: int, position_ids: Array | None) -> dict[str, Any]:
    """The :class:`~posenc_jax.terms.Toeplitz` fields for per-token positions: ``{}``
    without ids (the batch-free term, which the flash kernel runs), else the checked ids
    ``[1 (layers), B, L]`` and ``num_positions`` ``M = max(max_len, L)``, the range
    ``[0, M)`` the ids must lie in."""
    num_positions = max(self.max_len, length)
    ids = self.check_position_ids(length, position_ids, num_positions)
    return {} if ids is None else {"position_ids": ids[None], "num_positions": num_positions}

  def __call__(self, length: int, segment_ids: Array | None = None,
               position_ids: Array | None = None) -> SchemeTerms:
    """Terms for a self-attention pass over ``length`` positions.

    Args:
      length: L.
      segment_ids: optional ``[B, L]`` int token types (segment schemes).
      position_ids: optional ``[B, L]`` int position of each token (packed sequences
        restart them per sequence); None means ``arange(L)`` in every row and gives the
        batch-free terms. Absolute schemes read their tables' rows at the ids, relative
        ones take offsets ``position_ids[b, j] - position_ids[b, i]``; segment schemes
        ignore them. See :meth:`check_position_ids` for the allowed values.

    Returns:
      :class:`SchemeTerms` whose arrays carry a leading layer axis of size
      ``num_layers`` (per-layer) or 1 (shared).
    """
    raise NotImplementedError

  def sharing_dims(self, sharing: str) -> tuple[int, int]:
    """(layers, heads) axis sizes of a table under ``sharing``."""
    return shared_sizes(sharing, self.num_layers, self.num_heads)

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
  def __call__(self, length, segment_ids=None, position_ids=None):
    total = SchemeTerms()
    for scheme in self.schemes:
      total = total + scheme(length, segment_ids, position_ids)
    return total


class NoPosition(Scheme):
  """No positional information (a bag-of-words baseline)."""

  scheme_name = "none"
  fits_linformer = True

  @nn.compact
  def __call__(self, length, segment_ids=None, position_ids=None):
    self.check_length(length)
    self.check_position_ids(length, position_ids)
    return SchemeTerms()
