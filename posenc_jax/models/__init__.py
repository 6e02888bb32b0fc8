"""Models built from the scheme library: BERT encoders and heads, Linformer, and the
encoder-decoder translation Transformer."""

from posenc_jax.models.bert import (BertEncoder, BertForMaskedLM, BertForQuestionAnswering,
                                    BertForSequenceClassification, MaskedLMHead)
from posenc_jax.models.config import ModelConfig, ModelConfigError, model_config
from posenc_jax.models.decoding import beam_search, greedy_search, greedy_translate, translate
from posenc_jax.models.linformer import LinformerSelfAttention
from posenc_jax.models.transformer import EncoderDecoder, shift_right

__all__ = [
    "BertEncoder", "BertForMaskedLM", "BertForQuestionAnswering", "BertForSequenceClassification",
    "EncoderDecoder", "LinformerSelfAttention", "MaskedLMHead", "ModelConfig", "ModelConfigError",
    "beam_search", "greedy_search", "greedy_translate", "model_config", "shift_right", "translate",
]
