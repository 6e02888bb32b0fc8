"""Config -> model: the one place that maps a ``head`` name to a model class."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from posenc_jax.models.bert import (BertEncoder, BertForMaskedLM, BertForQuestionAnswering,
                                    BertForSequenceClassification)
from posenc_jax.models.config import ModelConfig, ModelConfigError, model_config

HEADS = ("mlm", "encoder", "classification", "span", "translation")


def build_model(model: Any, head: str = "mlm", *, num_labels: int = 2) -> nn.Module:
  """The model for ``head`` (``mlm``, ``encoder``, ``classification``, ``span``,
  ``translation``) from a model config (ConfigDict, dict or :class:`ModelConfig`)."""
  cfg = model if isinstance(model, ModelConfig) else model_config(model)
  if head == "mlm":
    return BertForMaskedLM(cfg)
  if head == "encoder":
    return BertEncoder(cfg)
  if head == "classification":
    return BertForSequenceClassification(cfg, num_labels=num_labels)
  if head == "span":
    return BertForQuestionAnswering(cfg)
  if head == "translation":
    from posenc_jax.models.transformer import EncoderDecoder  # noqa: PLC0415
    return EncoderDecoder(cfg)
  raise ModelConfigError(f"head: got {head!r}; allowed: {', '.join(HEADS)}")


def init_inputs(model: nn.Module, length: int = 8, batch: int = 1) -> tuple[jax.Array, ...]:
  """Placeholder int inputs ``[batch, length]`` (clipped to max_len) to initialise ``model``."""
  length = min(length, model.config.max_len)
  ids = jnp.ones((batch, length), jnp.int32)
  if model.config.num_decoder_layers:
    return ids, ids
  return (ids,)


def abstract_params(model: nn.Module) -> Any:
  """The model's parameters as ``jax.ShapeDtypeStruct`` leaves (no memory spent)."""
  variables = jax.eval_shape(model.init, jax.random.key(0), *init_inputs(model))
  return nn.unbox(variables["params"])
