"""Scheme names (as in the papers) -> modules, with validated hyperparameters.

A scheme is chosen by a plain config, a dict or an ``ml_collections``
``ConfigDict``::

  {"name": "diet_abs", "rank": 128, "sharing": "layer"}

Unknown names, unknown fields and invalid values raise one
:class:`SchemeConfigError` line naming the field and what is allowed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from posenc_jax.schemes.absolute import LearnedAPE, SinusoidalAPE
from posenc_jax.schemes.alibi import Alibi
from posenc_jax.schemes.base import SHARING, Composite, NoPosition, Scheme, SchemeConfigError
from posenc_jax.schemes.diet import DietAbs, DietRel
from posenc_jax.schemes.linformer import DietAbsLin
from posenc_jax.schemes.rope import Rope
from posenc_jax.schemes.segment import SegmentInput, SegmentPerHead
from posenc_jax.schemes.shaw import ShawRPE, SinusoidalRPE
from posenc_jax.schemes.t5 import T5Bias
from posenc_jax.schemes.tupe import BertAd, Tupe


@dataclasses.dataclass(frozen=True)
class Check:
  """A hyperparameter's rule: ``test(value)`` and the words for what is allowed."""

  test: Callable[[Any], bool]
  allowed: str


def _is_int(x):
  return isinstance(x, int) and not isinstance(x, bool)


POSITIVE_INT = Check(lambda x: _is_int(x) and x > 0, "a positive integer")
NON_NEGATIVE_INT = Check(lambda x: _is_int(x) and x >= 0, "an integer >= 0")
POSITIVE_FLOAT = Check(lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0,
                       "a positive number")
BOOL = Check(lambda x: isinstance(x, bool), "true or false")


def one_of(*values: str) -> Check:
  return Check(lambda x: x in values, "one of " + ", ".join(repr(v) for v in values))


def optional(check: Check) -> Check:
  return Check(lambda x: x is None or check.test(x), check.allowed + " or None")


@dataclasses.dataclass(frozen=True)
class SchemeSpec:
  """A registered scheme: module class, fixed settings, checked hyperparameters."""

  module: type[Scheme]
  fields: Mapping[str, Check]
  fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)


_TUPE_FIELDS = {"untie_cls": BOOL, "num_buckets": POSITIVE_INT, "max_distance": POSITIVE_INT}

SCHEMES: dict[str, SchemeSpec] = {
    "none": SchemeSpec(NoPosition, {}),
    "learned_ape": SchemeSpec(LearnedAPE, {}),
    "sinusoidal_ape": SchemeSpec(SinusoidalAPE, {"learnable": BOOL}),
    "shaw": SchemeSpec(ShawRPE, {"clip": NON_NEGATIVE_INT, "value": BOOL,
                                 "sharing": one_of("none", "layer")}),
    "sinusoidal_rpe": SchemeSpec(SinusoidalRPE, {"learnable": BOOL, "clip": NON_NEGATIVE_INT}),
    "t5": SchemeSpec(T5Bias, {"num_buckets": POSITIVE_INT, "max_distance": POSITIVE_INT,
                              "bidirectional": BOOL, "sharing": one_of(*SHARING)}),
    "diet_rel": SchemeSpec(DietRel, {"clip": optional(NON_NEGATIVE_INT),
                                     "sharing": one_of(*SHARING)}),
    "diet_abs": SchemeSpec(DietAbs, {"rank": optional(POSITIVE_INT), "sharing": one_of(*SHARING),
                                     "content_scale": optional(POSITIVE_FLOAT)}),
    "diet_abs_lin": SchemeSpec(DietAbsLin, {"rank": optional(POSITIVE_INT), "k": POSITIVE_INT,
                                            "sharing": one_of(*SHARING)}),
    "tupe_a": SchemeSpec(Tupe, _TUPE_FIELDS, {"relative": False}),
    "tupe_r": SchemeSpec(Tupe, _TUPE_FIELDS, {"relative": True}),
    "bert_ad": SchemeSpec(BertAd, {}),
    "segment_input": SchemeSpec(SegmentInput, {"num_segments": POSITIVE_INT}),
    "segment_per_head": SchemeSpec(SegmentPerHead, {"num_segments": POSITIVE_INT,
                                                    "sharing": one_of(*SHARING)}),
    "alibi": SchemeSpec(Alibi, {"causal": BOOL}),
    "rope": SchemeSpec(Rope, {"base": POSITIVE_FLOAT}),
}

_DIMENSIONS = ("num_layers", "num_heads", "head_dim", "d_model", "max_len")


def _as_dict(config: Any) -> dict[str, Any]:
  if hasattr(config, "to_dict"):  # ml_collections.ConfigDict
    config = config.to_dict()
  if not isinstance(config, Mapping):
    raise SchemeConfigError(f"scheme config must be a mapping with a 'name', got {config!r}")
  return dict(config)


def validate_scheme_config(config: Any) -> tuple[SchemeSpec, dict[str, Any]]:
  """Checks a scheme config; returns its spec and hyperparameters."""
  config = _as_dict(config)
  name = config.pop("name", None)
  if name not in SCHEMES:
    raise SchemeConfigError(f"scheme name {name!r} is unknown; allowed: {', '.join(sorted(SCHEMES))}")
  spec = SCHEMES[name]
  for field, value in config.items():
    if field not in spec.fields:
      allowed = ", ".join(sorted(spec.fields)) or "none"
      raise SchemeConfigError(f"scheme {name!r}: unknown field {field!r}; allowed fields: {allowed}")
    check = spec.fields[field]
    if not check.test(value):
      raise SchemeConfigError(f"scheme {name!r}: {field} must be {check.allowed}, got {value!r}")
  return spec, config


def build_scheme(config: Any, *, num_layers: int, num_heads: int, head_dim: int, d_model: int,
                 max_len: int = 512, name: str | None = None) -> Scheme:
  """A scheme module from its config and the model's dimensions.

  Args:
    config: ``{"name": ..., **hyperparameters}`` (dict or ConfigDict), or a
      sequence of them to compose (e.g. a position and a segment scheme).
    num_layers, num_heads, head_dim, d_model, max_len: the model's.
    name: flax module name.

  Returns:
    A :class:`Scheme`; ``scheme.init(rng, length, segment_ids)`` and
    ``scheme.apply(params, length, segment_ids)`` give :class:`SchemeTerms`.
  """
  dims = dict(num_layers=num_layers, num_heads=num_heads, head_dim=head_dim, d_model=d_model,
              max_len=max_len)
  for field in _DIMENSIONS:
    if not POSITIVE_INT.test(dims[field]):
      raise SchemeConfigError(f"{field} must be a positive integer, got {dims[field]!r}")
  if isinstance(config, Sequence) and not isinstance(config, str):
    parts = [build_scheme(c, **dims) for c in config]
    return Composite(schemes=parts, name=name, **dims)
  spec, hyper = validate_scheme_config(config)
  module = spec.module(**dims, **spec.fixed, **hyper, name=name)
  _check_even_dimension(module)
  return module


def _check_even_dimension(module: Scheme) -> None:
  field = module.even_dimension
  if field is not None and getattr(module, field) % 2:
    raise SchemeConfigError(f"scheme {module.scheme_name!r}: {field} must be even, "
                            f"got {getattr(module, field)}")
