"""Transformer building blocks shared by the BERT encoder, the translation model and the
causal language model.

:class:`EncoderLayer` serves both encoders; :class:`DecoderLayer` is the
translation decoder's (causal self-attention with an optional KV cache,
cross-attention, feed-forward) and, without cross-attention, the language model's.

Every parameter carries logical axis names (``embed``, ``heads``, ``kv``,
``mlp``, ``vocab``) for mesh sharding; compute runs in ``config.dtype`` with
float32 parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax

from posenc_jax.attention import MultiHeadAttention
from posenc_jax.models.config import ModelConfig
from posenc_jax.models.linformer import LinformerSelfAttention
from posenc_jax.terms import Term

Array = jax.Array

INIT = nn.initializers.normal(0.02)  # BERT's truncated-normal scale, as plain normal

ACTIVATION_FNS = {
    "gelu": lambda x: nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: nn.gelu(x, approximate=True),
    "relu": nn.relu,
}


def dense(features: int, axes: tuple[str, str], config: ModelConfig,
          name: str | None = None) -> nn.Dense:
  """A Dense layer ``[.., in] -> [.., features]`` with logical axes ``axes`` on its kernel."""
  return nn.Dense(features, dtype=config.compute_dtype, name=name,
                  kernel_init=nn.with_logical_partitioning(INIT, axes),
                  bias_init=nn.with_logical_partitioning(nn.initializers.zeros, axes[1:]))


def layer_norm(config: ModelConfig, name: str | None = None) -> nn.LayerNorm:
  return nn.LayerNorm(epsilon=config.layer_norm_eps, dtype=config.compute_dtype, name=name,
                      scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
                      bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)))


def token_embedding(config: ModelConfig, name: str | None = None,
                    init: nn.initializers.Initializer = INIT) -> nn.Embed:
  """The ``[V, d]`` word-embedding table (also the tied output projection)."""
  return nn.Embed(config.vocab_size, config.d_model, dtype=config.compute_dtype, name=name,
                  embedding_init=nn.with_logical_partitioning(init, ("vocab", "embed")))


class FeedForward(nn.Module):
  """``wo(act(wi(x)))``: ``[B, L, d] -> [B, L, F] -> [B, L, d]``."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x: Array, deterministic: bool = True) -> Array:
    cfg = self.config
    h = ACTIVATION_FNS[cfg.activation](dense(cfg.mlp_dim, ("embed", "mlp"), cfg, "wi")(x))
    h = nn.Dropout(cfg.dropout_rate)(h, deterministic=deterministic)
    return dense(cfg.d_model, ("mlp", "embed"), cfg, "wo")(h)


def self_attention(config: ModelConfig, name: str | None = None) -> nn.Module:
  """The self-attention module the config asks for (full or Linformer)."""
  if config.attention == "linformer":
    return LinformerSelfAttention(config, name=name)
  return full_attention(config, name)


def full_attention(config: ModelConfig, name: str | None = None) -> MultiHeadAttention:
  """Full multi-head attention (decoder self-attention and cross-attention)."""
  return MultiHeadAttention(config.num_heads, config.dim_per_head, route=config.route,
                            dtype=config.compute_dtype,
                            dropout_rate=config.attention_dropout_rate,
                            precision=config.attention_precision, name=name)


def residual(config: ModelConfig, norm: nn.LayerNorm, dropout: nn.Dropout, sublayer, x: Array,
             deterministic: bool) -> Array:
  """One sublayer with its residual and LayerNorm, post-LN (BERT) or pre-LN.

  post-LN: ``LN(x + dropout(f(x)))``; pre-LN: ``x + dropout(f(LN(x)))``.
  """
  y = sublayer(norm(x) if config.pre_ln else x)
  y = dropout(y, deterministic=deterministic)
  return x + y if config.pre_ln else norm(x + y)


class EncoderLayer(nn.Module):
  """Self-attention with the scheme's terms, then the feed-forward block.

  Parameters: ``attention``, ``attention_norm``, ``mlp``, ``mlp_norm``.
  """

  config: ModelConfig
  static_argnums = (4, 5)  # scale, deterministic (argument 0 is the module)

  def setup(self):
    self.attention = self_attention(self.config)
    self.attention_norm = layer_norm(self.config)
    self.mlp = FeedForward(self.config)
    self.mlp_norm = layer_norm(self.config)
    self.dropout = nn.Dropout(self.config.dropout_rate)

  def __call__(self, x: Array, terms: Sequence[Term], mask: Array | None,
               scale: float | None, deterministic: bool = True,
               segment_ids: Array | None = None) -> Array:
    """Args: ``x`` ``[B, L, d]``, ``mask`` ``[B, L]`` (True = token), ``segment_ids``
    ``[B, L]`` packed sequences (attention stays within a segment) or None. Returns
    ``[B, L, d]``."""
    extra = {} if segment_ids is None else {"segment_ids": segment_ids}  # Linformer has none
    attend = lambda y: self.attention(y, terms, mask=mask, scale=scale,  # noqa: E731
                                      deterministic=deterministic, **extra)
    x = residual(self.config, self.attention_norm, self.dropout, attend, x, deterministic)
    return residual(self.config, self.mlp_norm, self.dropout,
                    lambda y: self.mlp(y, deterministic), x, deterministic)


class DecoderLayer(nn.Module):
  """Causal self-attention with the scheme's terms, content-only cross-attention, feed-forward.

  Parameters: ``self_attention``, ``self_attention_norm``, ``cross_attention``,
  ``cross_attention_norm``, ``mlp``, ``mlp_norm``; a decoder-only model (``encoded`` None)
  has no ``cross_attention`` or ``cross_attention_norm``.
  """

  config: ModelConfig
  static_argnums = (6, 7, 8)  # scale, decode, deterministic (argument 0 is the module)

  def setup(self):
    self.self_attention = full_attention(self.config)
    self.self_attention_norm = layer_norm(self.config)
    self.cross_attention = full_attention(self.config)
    self.cross_attention_norm = layer_norm(self.config)
    self.mlp = FeedForward(self.config)
    self.mlp_norm = layer_norm(self.config)
    self.dropout = nn.Dropout(self.config.dropout_rate)

  def __call__(self, x: Array, terms: Sequence[Term], encoded: Array | None, mask: Array | None,
               encoded_mask: Array | None, scale: float | None, decode: bool = False,
               deterministic: bool = True, segment_ids: Array | None = None) -> Array:
    """One decoder layer.

    Args:
      x: ``[B, Lt, d]`` (``[B, 1, d]`` in a decoding step).
      terms: this layer's self-attention terms (for the full decode length
        when ``decode``).
      encoded: ``[B, Ls, d]`` encoder output, or None for a decoder-only model (no
        cross-attention).
      mask: ``[B, Lt]`` target padding mask or None (causality is added).
      encoded_mask: ``[B, Ls]`` source padding mask or None.
      scale: the scheme's content scale for the self-attention (None: ``1/sqrt(D)``).
      decode: one incremental step with the self-attention KV cache.
      deterministic: False enables dropout.
      segment_ids: ``[B, Lt]`` packed sequences (self-attention stays within a segment)
        or None; not with ``decode``.

    Returns:
      ``[B, Lt, d]``.
    """
    cfg = self.config

    def attend_self(y):
      return self.self_attention(y, terms, mask=mask, causal=True, scale=scale,
                                 deterministic=deterministic, decode=decode,
                                 segment_ids=segment_ids)

    def attend_source(y):
      return self.cross_attention(y, context=encoded, mask=encoded_mask,
                                  deterministic=deterministic)

    x = residual(cfg, self.self_attention_norm, self.dropout, attend_self, x, deterministic)
    if encoded is not None:
      x = residual(cfg, self.cross_attention_norm, self.dropout, attend_source, x, deterministic)
    return residual(cfg, self.mlp_norm, self.dropout, lambda y: self.mlp(y, deterministic), x,
                    deterministic)
