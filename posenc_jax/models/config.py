"""The model config: one validated, hashable record for every model in the library.

Configs arrive as ``ml_collections.ConfigDict`` (from ``configs/``), plain
dicts, or keyword arguments; :func:`model_config` checks every field and
returns a frozen :class:`ModelConfig` that Flax modules can hold. Bad input
raises one :class:`ModelConfigError` line naming the field, what was given and
what is allowed (the nearest name for a typo), before any model is built: the
schemes are checked against the model's dimensions, the decoder's causal form
included, and causal-only schemes kept out of bidirectional stacks, by asking their classes
(no scheme module is built).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
from flax.core import FrozenDict

from posenc_jax.kernels.precision import PRECISIONS
from posenc_jax.messages import nearest
from posenc_jax.route_plan import ROUTES
from posenc_jax.schemes.base import SchemeConfigError, is_finite_number, is_int
from posenc_jax.schemes.registry import SCHEMES, SchemePart, check_scheme, scheme_parts

ACTIVATIONS = ("gelu", "gelu_tanh", "relu")
DTYPES = ("float32", "bfloat16")
ATTENTIONS = ("full", "linformer")
# The attentions whose weights are an [L, L] matrix over the tokens (what probing reads):
# Linformer's are [L, k], over projected keys.
MATRIX_ATTENTIONS = ("full",)
REMAT = ("none", "dots", "full")
LINFORMER_SHARING = ("none", "kv", "layer")


NO_POSITION = FrozenDict(name="none")  # the alternate scheme of NoPE layers

# The models a config can be built as (:func:`posenc_jax.models.build.build_model`).
HEADS = ("mlm", "encoder", "classification", "span", "translation", "lm")


class ModelConfigError(ValueError):
  """A model config has an unknown field or an invalid value."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Dimensions and choices of a BERT encoder, an encoder-decoder Transformer or a causal LM.

  Defaults are BERT-base (Devlin et al.) with its learned input APE and
  input token types.

  Attributes:
    vocab_size: V.
    d_model: d.
    num_layers: encoder layers (the causal language model's layers: it has no encoder).
    num_heads: H.
    head_dim: D; None gives ``d_model // num_heads``.
    mlp_dim: feed-forward width F.
    max_len: L_max, the positions absolute tables cover.
    dropout_rate: hidden dropout.
    attention_dropout_rate: attention-probability dropout.
    layer_norm_eps: LayerNorm epsilon (BERT: 1e-12).
    pre_ln: LayerNorm before each sublayer (and a final one) instead of after.
    activation: ``gelu`` (exact erf form, as BERT), ``gelu_tanh``, ``relu``.
    dtype: compute dtype; parameters stay float32.
    scheme: position scheme config (registry name and hyperparameters), or a
      tuple of them to compose.
    segment: segment scheme config (``segment_input``, ``segment_per_head``)
      or None for single-segment models.
    pooler: BERT's tanh pooler over [CLS].
    attention: ``full`` or ``linformer`` (Wang et al. 2020).
    linformer_k: Linformer's projected length k.
    linformer_sharing: ``none`` (E, F per layer), ``kv`` (E = F per layer),
      ``layer`` (one E = F for all layers).
    route: attention route (see :func:`posenc_jax.attend`).
    remat: what each layer (encoder or decoder; not in cached decoding steps) keeps for
      the backward pass: ``none`` (everything, the fastest), ``dots`` (matmul outputs,
      recomputing the rest) or ``full`` (only the layer's input; longest sequences and
      largest batches).
    scan_layers: run each stack of layers (encoder, decoder) as one scanned layer
      (``nn.scan``): one layer is compiled, and the parameters carry a leading ``layers``
      axis (``layers/...``); False unrolls them (``layers_0/..``, ``layers_1/..``, ...).
      :mod:`posenc_jax.models.scan` converts between the two.
    attention_precision: matmul precision of attention in float32:
      ``float32`` (exact, the default) or ``tensorfloat32`` (JAX's faster
      default: TF32 on NVIDIA GPUs); see :func:`posenc_jax.attend`.
    num_decoder_layers: decoder layers of an encoder-decoder model (0: none; the causal
      language model, decoder-only, counts its layers in ``num_layers``).
    share_embeddings: encoder-decoder: one table for source, target and the
      output projection; language model: the output projection is the token table.
    alternate_scheme: the position scheme config (or a tuple of them to compose) that
      replaces ``scheme`` on every ``alternate_scheme_interval``-th layer of each stack, e.g.
      RoPE with base 1e6 on Gemma 3's global layers and base 1e4 on the others. Its
      parameters are ``alternate_position/...`` beside ``position/...``. ``{"name":
      "none"}`` (the default) with an interval gives NoPE layers.
    alternate_scheme_interval: N: layer ``i`` (0-based) of each stack with ``(i + 1) % N ==
      0`` runs ``alternate_scheme`` (MaxText's ``nope_layer_interval`` convention, Hugging
      Face's ``no_rope_layer_interval`` and Gemma 3's ``sliding_window_pattern``); 0 (the
      default) runs ``scheme`` on every layer. See :meth:`alternate`.
    nope_layer_interval: N: the shorthand for ``alternate_scheme={"name": "none"}`` at
      interval N (MaxText's name): every N-th layer attends over ``q . k`` alone (NoPE;
      Llama 4 and SmolLM3 use N = 4 with RoPE); 0 (the default) is off.
  """

  vocab_size: int = 30522
  d_model: int = 768
  num_layers: int = 12
  num_heads: int = 12
  head_dim: int | None = None
  mlp_dim: int = 3072
  max_len: int = 512
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.1
  layer_norm_eps: float = 1e-12
  pre_ln: bool = False
  activation: str = "gelu"
  dtype: str = "float32"
  scheme: Any = FrozenDict(name="learned_ape")
  segment: Any = FrozenDict(name="segment_input")
  pooler: bool = True
  attention: str = "full"
  linformer_k: int = 128
  linformer_sharing: str = "none"
  route: str = "auto"
  remat: str = "none"
  scan_layers: bool = True
  attention_precision: str = "float32"
  num_decoder_layers: int = 0
  share_embeddings: bool = True
  nope_layer_interval: int = 0
  alternate_scheme: Any = FrozenDict(name="none")
  alternate_scheme_interval: int = 0

  @property
  def dim_per_head(self) -> int:
    return self.d_model // self.num_heads if self.head_dim is None else self.head_dim

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  def alternate(self) -> tuple[Any, int]:
    """``(config, N)``: the scheme that replaces ``scheme`` on every N-th layer and N, 0 when
    every layer runs ``scheme``; ``nope_layer_interval`` N gives ``({"name": "none"}, N)``."""
    if self.nope_layer_interval:
      return NO_POSITION, self.nope_layer_interval
    return self.alternate_scheme, self.alternate_scheme_interval

  def alternate_layers(self, num_layers: int) -> tuple[bool, ...]:
    """For each of a stack's ``num_layers`` layers, True where it runs the alternate scheme:
    layer ``i`` (0-based) with ``(i + 1) % N == 0``, as MaxText's ``determine_is_nope_layer``
    (``layers/llama4.py``); all False when N is 0 (:meth:`alternate`)."""
    _, n = self.alternate()
    return tuple(n > 0 and (i + 1) % n == 0 for i in range(num_layers))

  def replace(self, **changes) -> ModelConfig:
    """A validated copy with ``changes``."""
    return model_config(dataclasses.asdict(self) | changes)

  def to_dict(self) -> dict[str, Any]:
    return {f.name: _thaw(getattr(self, f.name)) for f in dataclasses.fields(self)}


FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}


def _freeze(value):
  """dicts -> FrozenDict, lists -> tuples (so the config is hashable)."""
  if hasattr(value, "to_dict"):
    value = value.to_dict()
  if isinstance(value, Mapping):
    return FrozenDict({k: _freeze(v) for k, v in value.items()})
  if isinstance(value, Sequence) and not isinstance(value, str):
    return tuple(_freeze(v) for v in value)
  return value


def _thaw(value):
  if isinstance(value, Mapping):
    return {k: _thaw(v) for k, v in value.items()}
  if isinstance(value, tuple):
    return [_thaw(v) for v in value]
  return value


def causal_variant(scheme: Any) -> Any:
  """The decoder form of a scheme config: each scheme's
  :attr:`~posenc_jax.schemes.Scheme.causal_fields` set (T5 unidirectional, ALiBi causal),
  others unchanged.

  Args:
    scheme: ``{"name": ..., **hyperparameters}`` (a registered name) or a tuple of them.

  Returns:
    The same config(s) as plain dicts, with the causal fields set.
  """
  if isinstance(scheme, (tuple, list)):
    return tuple(causal_variant(s) for s in scheme)
  scheme = dict(scheme)
  return scheme | SCHEMES[scheme["name"]].module.causal_fields


def scheme_dims(config: ModelConfig, num_layers: int | None = None) -> dict[str, int]:
  """The model dimensions a scheme is built with."""
  return dict(num_layers=config.num_layers if num_layers is None else num_layers,
              num_heads=config.num_heads, head_dim=config.dim_per_head, d_model=config.d_model,
              max_len=config.max_len)


def _check(field: str, ok: bool, value: Any, allowed: str) -> None:
  if not ok:
    raise ModelConfigError(f"model.{field}: got {value!r}; allowed: {allowed}")


def _check_name(field: str, value: Any, allowed: Sequence[str]) -> None:
  """``model.<field>: got 'x'; did you mean 'y'?; allowed: ...`` unless ``value`` is allowed."""
  if value not in allowed:
    hint = nearest(value, allowed) if isinstance(value, str) else ";"
    raise ModelConfigError(f"model.{field}: got {value!r}{hint} allowed: {', '.join(allowed)}")


def model_config(config: Any = None, **overrides) -> ModelConfig:
  """Validates a model config (ConfigDict, dict or keywords) into a :class:`ModelConfig`.

  Raises:
    ModelConfigError: one line ``model.<field>: got X; allowed: ...`` for the first invalid
      field or combination of fields.
  """
  if hasattr(config, "to_dict"):
    config = config.to_dict()
  if config is not None and not isinstance(config, Mapping):
    raise ModelConfigError(f"model: got {config!r}; allowed: a ModelConfig, dict or ConfigDict "
                           "of its fields")
  values = dict(config or {}) | overrides
  for field in values:
    if field not in FIELDS:
      raise ModelConfigError(f"model.{field}: unknown field{nearest(field, sorted(FIELDS))} "
                             f"allowed fields: {', '.join(sorted(FIELDS))}")
  cfg = ModelConfig(**{k: _freeze(v) for k, v in values.items()})
  for field in ("vocab_size", "d_model", "num_layers", "num_heads", "mlp_dim", "max_len",
                "linformer_k"):
    value = getattr(cfg, field)
    _check(field, is_int(value) and value > 0, value, "a positive integer")
  _check("num_decoder_layers", is_int(cfg.num_decoder_layers) and cfg.num_decoder_layers >= 0,
         cfg.num_decoder_layers, "an integer >= 0")
  if cfg.head_dim is None:
    _check("num_heads", cfg.d_model % cfg.num_heads == 0, cfg.num_heads,
           f"a divisor of d_model={cfg.d_model} (or set head_dim)")
  else:
    _check("head_dim", is_int(cfg.head_dim) and cfg.head_dim > 0, cfg.head_dim,
           "a positive integer or None")
  for field in ("dropout_rate", "attention_dropout_rate"):
    value = getattr(cfg, field)
    _check(field, is_finite_number(value) and 0 <= value < 1, value, "a number in [0, 1)")
  _check("layer_norm_eps", isinstance(cfg.layer_norm_eps, float)
         and is_finite_number(cfg.layer_norm_eps) and cfg.layer_norm_eps > 0, cfg.layer_norm_eps,
         "a finite positive float")
  for field, allowed in (("activation", ACTIVATIONS), ("dtype", DTYPES),
                         ("attention", ATTENTIONS), ("linformer_sharing", LINFORMER_SHARING),
                         ("route", ROUTES), ("remat", REMAT),
                         ("attention_precision", PRECISIONS)):
    _check_name(field, getattr(cfg, field), allowed)
  for field in ("pre_ln", "pooler", "share_embeddings", "scan_layers"):
    _check(field, isinstance(getattr(cfg, field), bool), getattr(cfg, field), "true or false")
  if cfg.attention == "linformer":
    _check("linformer_k", cfg.linformer_k <= cfg.max_len, cfg.linformer_k,
           f"at most max_len={cfg.max_len} (E projects the L <= max_len keys to k rows)")
  _check_intervals(cfg)
  parts = {field: _check_scheme(cfg, field, form) for field, form in position_schemes(cfg)}
  if cfg.segment is not None:
    parts["segment"] = _check_scheme(cfg, "segment", cfg.segment)
  for field, checked in parts.items():
    _check_linformer(cfg, field, checked)
  if "alternate_scheme" in parts:
    _check_distinct(cfg, parts["scheme"], parts["alternate_scheme"])
  return cfg


def interval_field(cfg: ModelConfig) -> str:
  """The field that set the alternate layers: ``nope_layer_interval`` (its shorthand) or
  ``alternate_scheme_interval``."""
  return "nope_layer_interval" if cfg.nope_layer_interval else "alternate_scheme_interval"


def position_schemes(cfg: ModelConfig) -> list[tuple[str, Any]]:
  """``(field, config)`` of each position scheme some layer runs: ``scheme``, and
  ``alternate_scheme`` (``{"name": "none"}`` for NoPE layers) when its interval is set."""
  alternate, interval = cfg.alternate()
  return [("scheme", cfg.scheme)] + ([("alternate_scheme", alternate)] if interval else [])


def _check_intervals(cfg: ModelConfig) -> None:
  """Each interval is 0 or a period in ``[2, n]`` for the shortest stack's ``n`` layers (1
  would put every layer on the alternate scheme: set ``scheme`` to it); at most one is set;
  an alternate scheme other than ``none`` has ``alternate_scheme_interval`` set."""
  stacks = [n for n in (cfg.num_layers, cfg.num_decoder_layers) if n]
  for field in ("nope_layer_interval", "alternate_scheme_interval"):
    interval = getattr(cfg, field)
    ok = is_int(interval) and (interval == 0 or 2 <= interval <= min(stacks))
    _check(field, ok, interval, f"0 (off) or an integer in [2, {min(stacks)}] (the layers of "
           "the shortest stack; every N-th layer runs the alternate scheme)")
  named = _freeze(cfg.alternate_scheme) != NO_POSITION
  if cfg.nope_layer_interval and (cfg.alternate_scheme_interval or named):
    raise ModelConfigError(
        f"model.nope_layer_interval: got {cfg.nope_layer_interval} with an alternate scheme "
        "set; allowed: 0 with alternate_scheme and alternate_scheme_interval (it is their "
        "shorthand for alternate_scheme {'name': 'none'})")
  if named and not cfg.nope_layer_interval and not cfg.alternate_scheme_interval:
    raise ModelConfigError(
        f"model.alternate_scheme: got {_thaw(cfg.alternate_scheme)!r} with "
        "alternate_scheme_interval 0 (off); allowed: an interval in [2, "
        f"{min(stacks)}] with it, or {{'name': 'none'}}")


def _check_distinct(cfg: ModelConfig, scheme: tuple[SchemePart, ...],
                    alternate: tuple[SchemePart, ...]) -> None:
  """One line when the alternate scheme is ``scheme`` itself (every layer would run it)."""
  def form(parts):
    return [(part.name, dict(part.values)) for part in parts]
  if form(scheme) == form(alternate):
    field = interval_field(cfg)
    names = ", ".join(repr(part.name) for part in scheme)
    raise ModelConfigError(
        f"model.{field}: got {getattr(cfg, field)}, but the alternate scheme is model.scheme "
        f"({names}) itself, so every layer would run it; allowed: 0, or another scheme")


def _checked_parts(cfg: ModelConfig, field: str, label: str, form: Any,
                   num_layers: int) -> tuple[SchemePart, ...]:
  """The parts of the scheme config ``form`` checked at the model's dimensions with
  ``num_layers`` layers; one :class:`ModelConfigError` line ``model.<field>: <label><why>``
  for the first that does not fit."""
  try:
    return check_scheme(form, **scheme_dims(cfg, num_layers))
  except SchemeConfigError as e:
    raise ModelConfigError(f"model.{field}: {label}{e}") from None


def check_causal_form(cfg: ModelConfig, num_layers: int, owner: str = "decoder") -> None:
  """One :class:`ModelConfigError` line unless the causal form (:func:`causal_variant`) of
  ``cfg.scheme`` (and of the alternate scheme when set) fits a causal stack of
  ``num_layers`` layers (``owner`` names it in the message)."""
  for field, form in position_schemes(cfg):
    _checked_parts(cfg, field, f"{owner} (causal form): ", causal_variant(form), num_layers)


def check_bidirectional_form(cfg: ModelConfig, owner: str = "encoder") -> None:
  """One :class:`ModelConfigError` line, naming ``model.scheme`` (or
  ``model.alternate_scheme``), when a part of it is
  :attr:`~posenc_jax.schemes.Scheme.causal_only` (CoPE) and so has no form for a
  bidirectional stack: the BERT encoder, or the encoder-decoder's encoder (``owner`` names
  it in the message)."""
  for field, form in position_schemes(cfg):
    for part in scheme_parts(form):
      if part.module.causal_only:
        raise ModelConfigError(
            f"model.{field}: got {part.name!r} in the {owner}, a bidirectional stack, but it "
            f"is defined for causal attention only; allowed there: any position scheme but "
            f"{_registered('causal_only')} (those run in decoders and the language model)")


def _registered(fact: str) -> str:
  """The registered names whose module class has ``fact`` true, comma-separated."""
  return ", ".join(name for name, spec in SCHEMES.items() if getattr(spec.module, fact))


def _check_scheme(cfg: ModelConfig, field: str, config: Any) -> tuple[SchemePart, ...]:
  """The parts of ``config`` after checking that they fit the model's dimensions (and, for
  the scheme of a model with a decoder, so does its causal form and the alternate's), each a
  segment scheme exactly when ``field`` is ``segment``."""
  parts = _checked_parts(cfg, field, "", config, cfg.num_layers)
  if field == "scheme" and cfg.num_decoder_layers:
    check_causal_form(cfg, cfg.num_decoder_layers)
    check_bidirectional_form(cfg, "encoder-decoder's encoder")
  for part in parts:
    if field == "segment" and not part.module.segment_scheme:
      raise ModelConfigError(f"model.segment: got {part.name!r}; allowed: "
                             f"{_registered('segment_scheme')} or None")
    if field != "segment" and part.module.segment_scheme:
      raise ModelConfigError(f"model.{field}: got {part.name!r}, a segment scheme; allowed: a "
                             "position scheme (segment schemes go in model.segment)")
  return parts


def _check_linformer(cfg: ModelConfig, field: str, parts: tuple[SchemePart, ...]) -> None:
  """Linformer takes only schemes whose terms fit its projected keys; a scheme whose key side
  has ``k`` projected rows (DIET-ABS-LIN) needs Linformer with that ``k``."""
  for part in parts:
    name = part.name
    if cfg.attention == "linformer" and not part.module.fits_linformer:
      raise ModelConfigError(
          f"model.{field}: {name!r} has attention terms over the L key positions, which "
          f"attention='linformer' projects away; allowed with linformer: "
          f"{_registered('fits_linformer')}")
    k = part.module.projected_keys(part.values)
    if k is None:
      continue
    if cfg.attention != "linformer":
      raise ModelConfigError(f"model.{field}: {name!r} needs attention='linformer' "
                             f"(its key side has linformer_k rows), got {cfg.attention!r}")
    if k != cfg.linformer_k:
      raise ModelConfigError(f"model.{field}: {name} k={k} must equal "
                             f"model.linformer_k={cfg.linformer_k}")
    if cfg.num_decoder_layers:
      raise ModelConfigError(f"model.{field}: {name!r} has no decoder form (decoder "
                             "self-attention is full); set num_decoder_layers=0")
