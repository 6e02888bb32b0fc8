"""Models built from the scheme library: BERT encoders and heads, Linformer, the
encoder-decoder translation Transformer and the decoder-only causal language model."""

from posenc_jax.models.bert import (BertEncoder, BertForMaskedLM, BertForQuestionAnswering,
                                    BertForSequenceClassification, MaskedLMHead)
from posenc_jax.models.config import ModelConfig, ModelConfigError, model_config
from posenc_jax.models.decoder_lm import CausalLM
from posenc_jax.models.decoding import (beam_search, generate, greedy_search, greedy_translate,
                                        sample_search, translate)
from posenc_jax.models.linformer import LinformerSelfAttention
from posenc_jax.models.transformer import EncoderDecoder, shift_right

__all__ = [
    "BertEncoder", "BertForMaskedLM", "BertForQuestionAnswering", "BertForSequenceClassification",
    "CausalLM", "EncoderDecoder", "LinformerSelfAttention", "MaskedLMHead", "ModelConfig",
    "ModelConfigError", "beam_search", "generate", "greedy_search", "greedy_translate",
    "model_config", "sample_search", "shift_right", "translate",
]
