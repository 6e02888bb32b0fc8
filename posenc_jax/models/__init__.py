"""Models built from the scheme library: BERT encoders and heads, Linformer, and the
encoder-decoder translation Transformer."""

from posenc_jax.models.bert import (BertEncoder, BertForMaskedLM, BertForQuestionAnswering,
                                    BertForSequenceClassification, MaskedLMHead)
from posenc_jax.models.config import ModelConfig, ModelConfigError, model_config

__all__ = [
    "BertEncoder", "BertForMaskedLM", "BertForQuestionAnswering", "BertForSequenceClassification",
    "MaskedLMHead", "ModelConfig", "ModelConfigError", "model_config",
]
