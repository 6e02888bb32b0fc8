"""A model alone: size, position scheme and modifiers, by preset name.

  python -m posenc_jax.params --config=configs/model.py:bert_base,diet_abs_share
  python -m posenc_jax.params --config=configs/model.py:bert_small,tupe_r,segment_per_head \
      --config.model.max_len=128

The argument is ``<size>[,<scheme>...]``: sizes bert_tiny, bert_demo, bert_small,
bert_base, bert_base_multilingual, transformer_base, transformer_big; schemes
named after the papers' rows (bert, shaw, t5, tupe_a, tupe_r, diet_rel,
diet_rel_share, diet_abs, diet_abs_share, linformer, diet_abs_lin, alibi,
rope, ...) and modifiers (segment_per_head, no_segment, pre_ln, bf16). See
``posenc_jax/presets.py`` for the full list.
"""

from posenc_jax.presets import preset_config


def get_config(arg="bert_base,bert"):
  return preset_config(arg)
