"""Scheme names (as in the papers) -> modules, with validated hyperparameters.

A scheme is chosen by a plain config, a dict or an ``ml_collections``
``ConfigDict``::

  {"name": "diet_abs", "rank": 128, "sharing": "layer"}

Unknown names, unknown fields and invalid values raise one
:class:`SchemeConfigError` line naming the field and what is allowed.
A validated config is a :class:`SchemePart` (a sequence composes several);
the facts about it (its causal form, segment and Linformer fit, folded rank,
FLOPs) are its module class's, asked without building the module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from posenc_jax.messages import nearest
from posenc_jax.schemes.absolute import LearnedAPE, SinusoidalAPE
from posenc_jax.schemes.alibi import Alibi
from posenc_jax.schemes.base import Composite, NoPosition, Scheme, SchemeConfigError
from posenc_jax.schemes.cope import Cope
from posenc_jax.schemes.diet import DietAbs, DietRel
from posenc_jax.schemes.fire import Fire
from posenc_jax.schemes.forgetting import Fox
from posenc_jax.schemes.kerple import Kerple
from posenc_jax.schemes.linformer import DietAbsLin
from posenc_jax.schemes.rope import Rope
from posenc_jax.schemes.segment import SegmentInput, SegmentPerHead
from posenc_jax.schemes.shaw import ShawRPE, SinusoidalRPE
from posenc_jax.schemes.t5 import T5Bias
from posenc_jax.schemes.tupe import BertAd, Tupe
from posenc_jax.schemes.xpos import Xpos


@dataclasses.dataclass(frozen=True)
class SchemeSpec:
  """A registered scheme: its module class, fixed settings, and the hyperparameters a
  config may set (None: every one of the module's :attr:`~Scheme.hyperparameters` not
  fixed). Each field's rule is the module's."""

  module: type[Scheme]
  fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  settable: Sequence[str] | None = None

  @property
  def fields(self) -> tuple[str, ...]:
    if self.settable is not None:
      return tuple(self.settable)
    return tuple(f for f in self.module.hyperparameters if f not in self.fixed)

  def values(self, hyper: Mapping[str, Any]) -> dict[str, Any]:
    """Every hyperparameter of the module: its default, then ``fixed``, then ``hyper``."""
    defaults = {f.name: f.default for f in dataclasses.fields(self.module)}
    return {f: defaults[f] for f in self.module.hyperparameters} | dict(self.fixed) | dict(hyper)


@dataclasses.dataclass(frozen=True)
class SchemePart:
  """One validated scheme config: its registry name, module class and every hyperparameter
  (defaults, then the registration's fixed settings, then the config's)."""

  name: str
  module: type[Scheme]
  values: Mapping[str, Any]


SCHEMES: dict[str, SchemeSpec] = {
    "none": SchemeSpec(NoPosition),
    "learned_ape": SchemeSpec(LearnedAPE),
    "sinusoidal_ape": SchemeSpec(SinusoidalAPE),
    "shaw": SchemeSpec(ShawRPE),
    "sinusoidal_rpe": SchemeSpec(SinusoidalRPE),
    "t5": SchemeSpec(T5Bias),
    "diet_rel": SchemeSpec(DietRel),
    "diet_abs": SchemeSpec(DietAbs),
    "diet_abs_lin": SchemeSpec(DietAbsLin),
    # TUPE-A has no relative bias, so no buckets to set.
    "tupe_a": SchemeSpec(Tupe, {"relative": False}, ("untie_cls",)),
    "tupe_r": SchemeSpec(Tupe, {"relative": True}),
    "bert_ad": SchemeSpec(BertAd),
    "segment_input": SchemeSpec(SegmentInput),
    "segment_per_head": SchemeSpec(SegmentPerHead),
    "alibi": SchemeSpec(Alibi),
    "rope": SchemeSpec(Rope),
    # RoPE's scalings stay off: the paper and its reference code scale no frequency.
    "xpos": SchemeSpec(Xpos, settable=("base", "layout", "fraction", "scale_base")),
    "fire": SchemeSpec(Fire),
    "kerple_log": SchemeSpec(Kerple, {"form": "log"}),
    "kerple_power": SchemeSpec(Kerple, {"form": "power"}),
    "cope": SchemeSpec(Cope),
    "fox": SchemeSpec(Fox),
}


def _as_dict(config: Any) -> dict[str, Any]:
  if hasattr(config, "to_dict"):  # ml_collections.ConfigDict
    config = config.to_dict()
  if not isinstance(config, Mapping):
    raise SchemeConfigError(f"scheme config must be a mapping with a 'name', got {config!r}")
  return dict(config)


def validate_scheme_config(config: Any) -> SchemePart:
  """Checks a scheme config ``{"name": ..., **hyperparameters}``.

  Raises one :class:`SchemeConfigError` line for an unknown name or field (with the
  nearest allowed one) or an invalid value, alone or with the others (T5's buckets).
  """
  config = _as_dict(config)
  name = config.pop("name", None)
  if name not in SCHEMES:
    hint = nearest(name, SCHEMES) if isinstance(name, str) else ";"
    raise SchemeConfigError(f"scheme name {name!r} is unknown{hint} "
                            f"allowed: {', '.join(sorted(SCHEMES))}")
  spec = SCHEMES[name]
  for field in config:
    if field not in spec.fields:
      raise SchemeConfigError(f"scheme {name!r}: unknown field {field!r}"
                              f"{nearest(field, spec.fields)} allowed fields: "
                              f"{', '.join(sorted(spec.fields)) or 'none'}")
  values = spec.values(config)
  spec.module.check_hyperparameters(name, values)
  return SchemePart(name, spec.module, values)


def scheme_parts(config: Any) -> tuple[SchemePart, ...]:
  """The validated parts of a scheme config, or of a sequence of them to compose.

  Raises one :class:`SchemeConfigError` line as :func:`validate_scheme_config` does, or for
  an empty sequence.
  """
  if isinstance(config, Sequence) and not isinstance(config, str):
    if not config:
      raise SchemeConfigError("scheme config: got an empty list; allowed: a scheme config or a "
                              "non-empty list of them")
    return tuple(part for c in config for part in scheme_parts(c))
  return (validate_scheme_config(config),)


def check_scheme(config: Any, *, num_layers: int, num_heads: int, head_dim: int, d_model: int,
                 max_len: int = 512) -> tuple[SchemePart, ...]:
  """The parts of ``config`` (:func:`scheme_parts`), checked at the model's dimensions as
  :func:`build_scheme` checks them, without building a module.

  Raises one :class:`SchemeConfigError` line for the first invalid config or dimension.
  """
  dims = dict(num_layers=num_layers, num_heads=num_heads, head_dim=head_dim, d_model=d_model,
              max_len=max_len)
  parts = scheme_parts(config)
  for part in parts:
    part.module.check_config(part.name, dims, part.values)
  return parts


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

  Raises:
    SchemeConfigError: one line for an invalid config or dimension (the module checks
      its values when it is created, so a module built directly is checked too).
  """
  dims = dict(num_layers=num_layers, num_heads=num_heads, head_dim=head_dim, d_model=d_model,
              max_len=max_len)
  if isinstance(config, Sequence) and not isinstance(config, str):
    scheme_parts(config)  # one line for an empty list or any invalid part
    return Composite(schemes=[build_scheme(c, **dims) for c in config], name=name, **dims)
  part = validate_scheme_config(config)
  return part.module(**dims, **part.values, name=name)
