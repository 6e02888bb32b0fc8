"""Named model sizes and scheme presets (the papers' rows), combinable by name.

``preset_config("bert_base,diet_abs_share")`` gives an ``ml_collections``
``ConfigDict`` with ``model`` (every :class:`~posenc_jax.models.ModelConfig`
field) and ``head`` (which model to build). One size preset comes first;
scheme and modifier presets follow and are applied in order. Config files
in ``configs/`` call this; ``--config.model.<field>=...`` overrides any field.
:func:`scheme_name` and :func:`size_name` read the presets back from a resolved model
config (the rows of compare's tables, the ``scheme`` of an evaluation).
"""

from __future__ import annotations

from typing import Any

import ml_collections

from posenc_jax.messages import nearest
from posenc_jax.models.config import ModelConfig, ModelConfigError

# Model sizes. Unset fields keep the ModelConfig defaults (BERT-base).
SIZES: dict[str, dict] = {
    # Runs in seconds on a CPU.
    "bert_tiny": dict(vocab_size=8192, d_model=128, num_layers=2, num_heads=2, mlp_dim=512,
                      max_len=128),
    # The bundled masked-LM demo's model (configs/pretrain.py): bert_tiny with its MLP halved,
    # the steps it buys on a CPU worth more than the width (docs/results/pretrain-calibration-cpu.md).
    "bert_demo": dict(vocab_size=8192, d_model=128, num_layers=2, num_heads=2, mlp_dim=256,
                      max_len=128),
    # DIET Table 1's BERT-small: 4 layers, 512 wide, 8 heads.
    "bert_small": dict(d_model=512, num_layers=4, num_heads=8, mlp_dim=2048),
    "bert_base": dict(),
    # DIET's multilingual (XTREME) models: SentencePiece vocabulary of 120k.
    "bert_base_multilingual": dict(vocab_size=120000),
    # Vaswani et al. base and big, shared source/target vocabulary.
    "transformer_base": dict(vocab_size=32000, d_model=512, num_layers=6, num_decoder_layers=6,
                             num_heads=8, mlp_dim=2048, max_len=256, activation="relu",
                             layer_norm_eps=1e-6, attention_dropout_rate=0.0,
                             scheme={"name": "sinusoidal_ape"}, segment=None, pooler=False),
    "transformer_big": dict(vocab_size=32000, d_model=1024, num_layers=6, num_decoder_layers=6,
                            num_heads=16, mlp_dim=4096, max_len=256, activation="relu",
                            layer_norm_eps=1e-6, dropout_rate=0.3, attention_dropout_rate=0.0,
                            scheme={"name": "sinusoidal_ape"}, segment=None, pooler=False),
}

LINFORMER_K = 32  # DIET Tables 2-3 label Linformer rows by k: 32 and 256.

# Position schemes named after the papers' rows, plus modifiers.
SCHEME_PRESETS: dict[str, dict] = {
    "bert": dict(scheme={"name": "learned_ape"}),
    "none": dict(scheme={"name": "none"}),
    "sinusoidal": dict(scheme={"name": "sinusoidal_ape"}),
    "sinusoidal_learnable": dict(scheme={"name": "sinusoidal_ape", "learnable": True}),
    "shaw": dict(scheme={"name": "shaw"}),
    "sinusoidal_rpe": dict(scheme={"name": "sinusoidal_rpe"}),
    "t5": dict(scheme={"name": "t5"}),
    "tupe_a": dict(scheme={"name": "tupe_a"}),
    "tupe_a_tie_cls": dict(scheme={"name": "tupe_a", "untie_cls": False}),
    "tupe_r": dict(scheme={"name": "tupe_r"}),
    "bert_ad": dict(scheme={"name": "bert_ad"}),
    "diet_rel": dict(scheme={"name": "diet_rel"}),
    "diet_rel_share": dict(scheme={"name": "diet_rel", "sharing": "layer"}),
    "diet_abs": dict(scheme={"name": "diet_abs", "rank": 128}),
    "diet_abs_share": dict(scheme={"name": "diet_abs", "rank": 128, "sharing": "layer"}),
    # DIET Table 5's ablations of DIET-ABS: rank 64 (layer-wise sharing), head-wise sharing.
    "diet_abs_rank64_share": dict(scheme={"name": "diet_abs", "rank": 64, "sharing": "layer"}),
    "diet_abs_share_head": dict(scheme={"name": "diet_abs", "rank": 128, "sharing": "head"}),
    "linformer": dict(scheme={"name": "learned_ape"}, attention="linformer",
                      linformer_k=LINFORMER_K),
    "diet_abs_lin": dict(scheme={"name": "diet_abs_lin", "k": LINFORMER_K}, attention="linformer",
                         linformer_k=LINFORMER_K),
    "alibi": dict(scheme={"name": "alibi"}),
    "rope": dict(scheme={"name": "rope"}),
    "kerple_log": dict(scheme={"name": "kerple_log"}),
    "kerple_power": dict(scheme={"name": "kerple_power"}),
    "fire": dict(scheme={"name": "fire"}),
    "xpos": dict(scheme={"name": "xpos"}),
    # Dynamic NTK: the original length is the model's max_len, so it turns on past it.
    "rope_dynamic": dict(scheme={"name": "rope", "scaling": "dynamic", "factor": 2.0}),
    "cope": dict(scheme={"name": "cope"}),
    "fox": dict(scheme={"name": "fox"}),
    # Modifiers.
    # NoPE layers: the position scheme's terms off every 4th layer (Llama 4, SmolLM3; MaxText's
    # nope_layer_interval), or every 2nd (models of 2 or 3 layers).
    "nope_every_4": dict(nope_layer_interval=4),
    "nope_every_2": dict(nope_layer_interval=2),
    # Gemma 3's RoPE bases (Gemma Team 2025; Hugging Face Gemma3TextConfig: rope_theta 1e6 on
    # the global layers, rope_local_base_freq 1e4 on the others, sliding_window_pattern 6):
    # with `rope` (base 1e4), every 6th layer takes base 1e6. The local layers' sliding window
    # is not modelled.
    "gemma3_global_rope": dict(alternate_scheme={"name": "rope", "base": 1e6},
                               alternate_scheme_interval=6),
    "segment_per_head": dict(segment={"name": "segment_per_head"}),
    "no_segment": dict(segment=None),
    "pre_ln": dict(pre_ln=True),
    "bf16": dict(dtype="bfloat16"),
}
# The presets that set a position scheme (not the modifiers: segment_per_head, pre_ln, ...).
POSITION_PRESETS = tuple(name for name, preset in SCHEME_PRESETS.items() if "scheme" in preset)


def default_head(size: str) -> str:
  return "translation" if size.startswith("transformer") else "mlm"


def preset_config(arg: str = "bert_base,bert") -> ml_collections.ConfigDict:
  """``"<size>[,<scheme or modifier>...]"`` -> ConfigDict(model=..., head=...).

  Raises:
    ModelConfigError: one line naming an unknown preset and the allowed ones.
  """
  names = [n.strip() for n in arg.split(",") if n.strip()]
  if not names or names[0] not in SIZES:
    given = names[0] if names else arg
    raise ModelConfigError(f"config preset: {given!r} is not a model size{nearest(given, SIZES)} "
                           f"allowed: {', '.join(SIZES)}")
  model = ModelConfig().to_dict() | SIZES[names[0]]  # every field, so any can be overridden
  for name in names[1:]:
    if name not in SCHEME_PRESETS:
      raise ModelConfigError(f"config preset: {name!r} is unknown{nearest(name, SCHEME_PRESETS)} "
                             f"allowed: {', '.join(SCHEME_PRESETS)}")
    model.update(SCHEME_PRESETS[name])
  config = ml_collections.ConfigDict()
  # Fields that may be None or change type (a scheme dict) stay unlocked-typed.
  # A None field (head_dim) becomes a typed placeholder, so ``--config.model.head_dim=64`` parses.
  placeholders = {"head_dim": int}
  model = {k: ml_collections.config_dict.placeholder(placeholders[k]) if v is None and
           k in placeholders else v for k, v in model.items()}
  config.model = ml_collections.ConfigDict(model, type_safe=False)
  config.head = default_head(names[0])
  return config


def preset_name(model: dict[str, Any], presets: dict[str, dict], default: str) -> str:
  """The name of the preset of ``presets`` whose every field ``model`` has (a scheme's given
  fields included), the one with the most fields if several do; else ``default``."""
  def fits(preset):
    for key, value in preset.items():
      have = model.get(key)
      if isinstance(value, dict):
        if not isinstance(have, dict) or any(have.get(k) != v for k, v in value.items()):
          return False
      elif have != value:
        return False
    return True

  def fields(preset):
    return sum(len(v) if isinstance(v, dict) else 1 for v in preset.values())

  matches = [name for name, preset in presets.items() if fits(preset)]
  return max(matches, key=lambda n: fields(presets[n])) if matches else default


def scheme_name(model: dict[str, Any]) -> str:
  """The scheme preset (``rope``, ``bert``, ...) whose fields ``model`` (a resolved model
  config) has, else the name of its scheme (of schemes composed: their names, by commas)."""
  scheme = model.get("scheme")
  parts = scheme if isinstance(scheme, list) else [scheme]
  names = ",".join(str(part.get("name")) for part in parts if isinstance(part, dict))
  return preset_name(model, {n: SCHEME_PRESETS[n] for n in POSITION_PRESETS}, names)


def size_name(model: dict[str, Any]) -> str:
  """The size preset (``bert_tiny``, ...) whose dimensions ``model`` has, else
  ``d<d_model>L<num_layers>``."""
  defaults = ModelConfig().to_dict()  # bert_base names no dimension: it is the defaults'
  presets = {n: {k: {**defaults, **p}[k] for k in ("d_model", "num_layers", "num_heads",
                                                   "mlp_dim")}
             for n, p in SIZES.items()}
  return preset_name(model, presets, f"d{model.get('d_model')}L{model.get('num_layers')}")
