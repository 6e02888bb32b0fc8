"""Config -> model: the one place that maps a ``head`` name to a model class."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from posenc_jax.messages import nearest
from posenc_jax.models.bert import (BertEncoder, BertForMaskedLM, BertForQuestionAnswering,
                                    BertForSequenceClassification)
from posenc_jax.models.config import (HEADS, ModelConfig, ModelConfigError,
                                      check_bidirectional_form, model_config)
from posenc_jax.schemes.base import is_int

BERT_MODELS = {"mlm": BertForMaskedLM, "encoder": BertEncoder, "span": BertForQuestionAnswering}


def check_head(model: Any, head: str) -> ModelConfig:
  """The validated config of ``model`` (ConfigDict, dict or :class:`ModelConfig`), after
  checking that ``head`` can run it.

  Raises one :class:`ModelConfigError` line for an unknown head (with the nearest name), an
  invalid config, or a config the head cannot run (decoder layers or a causal-only scheme
  under a BERT head; see :func:`~posenc_jax.models.transformer.check_translation_config` and
  :func:`~posenc_jax.models.decoder_lm.check_lm_config`). Builds nothing: the train
  config's validation calls it before anything is written.
  """
  cfg = model if isinstance(model, ModelConfig) else model_config(model)
  if head not in HEADS:
    raise ModelConfigError(f"head: got {head!r}{nearest(str(head), HEADS)} allowed: "
                           f"{', '.join(HEADS)}")
  if head == "translation":
    from posenc_jax.models.transformer import check_translation_config  # noqa: PLC0415
    check_translation_config(cfg)
  elif head == "lm":
    from posenc_jax.models.decoder_lm import check_lm_config  # noqa: PLC0415
    check_lm_config(cfg)
  elif cfg.num_decoder_layers:
    raise ModelConfigError(f"model.num_decoder_layers: got {cfg.num_decoder_layers}; allowed: 0 "
                           f"for head {head!r} (only 'translation' has a decoder)")
  else:
    check_bidirectional_form(cfg, "BERT encoder")
  return cfg


def build_model(model: Any, head: str = "mlm", *, num_labels: int = 2) -> nn.Module:
  """The model for ``head`` (``mlm``, ``encoder``, ``classification``, ``span``,
  ``translation``, ``lm``) from a model config (ConfigDict, dict or :class:`ModelConfig`).

  ``num_labels`` is the classification head's. Raises one :class:`ModelConfigError` line as
  :func:`check_head` says.
  """
  cfg = check_head(model, head)
  if head == "translation":
    from posenc_jax.models.transformer import EncoderDecoder  # noqa: PLC0415
    return EncoderDecoder(cfg)
  if head == "lm":
    from posenc_jax.models.decoder_lm import CausalLM  # noqa: PLC0415
    return CausalLM(cfg)
  if head == "classification":
    return BertForSequenceClassification(cfg, num_labels=num_labels)
  return BERT_MODELS[head](cfg)


def init_inputs(model: nn.Module, length: int = 8, batch: int = 1) -> tuple[jax.Array, ...]:
  """Placeholder int inputs ``[batch, length]`` (clipped to max_len) to initialise ``model``."""
  for name, value in (("length", length), ("batch", batch)):
    if not is_int(value) or value < 1:
      raise ValueError(f"init_inputs: {name}: got {value!r}; allowed: a positive integer")
  length = min(length, model.config.max_len)
  ids = jnp.ones((batch, length), jnp.int32)
  if model.config.num_decoder_layers:
    return ids, ids
  return (ids,)


def abstract_params(model: nn.Module) -> Any:
  """The model's parameters as ``jax.ShapeDtypeStruct`` leaves (no memory spent)."""
  variables = jax.eval_shape(model.init, jax.random.key(0), *init_inputs(model))
  return nn.unbox(variables["params"])
