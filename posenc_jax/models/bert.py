"""BERT (Devlin et al.) with any positional and segment scheme, and its heads.

The scheme is built once per model from ``config.scheme`` and called once
per forward pass; each layer gets its own (or the shared) terms, and every N-th layer
the alternate scheme's instead of the scheme's (``config.alternate_scheme``; NoPE layers,
``config.nope_layer_interval``, get none). Parameter layout of :class:`BertEncoder`::

  token_embed/embedding               [V, d]
  position/...                        the scheme's parameters
  alternate_position/...              the alternate scheme's (when its interval is set)
  segment/...                         the segment scheme's parameters
  embed_norm/{scale,bias}             [d]      (post-LN only)
  layers_{i}/attention/{query,key,value}/{kernel [d, H, D], bias [H, D]}
  layers_{i}/attention/out/{kernel [H, D, d], bias [d]}
  layers_{i}/attention/{E,F}          [k, L_max] (Linformer; E only if sharing='kv')
  linformer/E                         [k, L_max] (Linformer, sharing='layer')
  layers_{i}/{attention_norm,mlp_norm}/{scale,bias}
  layers_{i}/mlp/wi/{kernel [d, F], bias [F]}, mlp/wo/{kernel [F, d], bias [d]}
  final_norm/{scale,bias}             [d]      (pre-LN only)
  pooler/{kernel [d, d], bias [d]}              (config.pooler)

With ``config.scan_layers`` (the default) the ``layers_{i}`` subtrees are one ``layers``
subtree whose leaves carry a leading ``[N]`` axis (:mod:`posenc_jax.models.stack`).

The heads wrap the encoder as ``bert/...``.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from posenc_jax.ids import check_id_values
from posenc_jax.models.config import (ModelConfig, ModelConfigError, check_bidirectional_form,
                                      scheme_dims)
from posenc_jax.models.inputs import as_mask, check_ids_like, check_like, check_token_ids
from posenc_jax.models.layers import (ACTIVATION_FNS, EncoderLayer, dense, layer_norm,
                                      token_embedding)
from posenc_jax.models.linformer import shared_projection
from posenc_jax.models.stack import layer_stack, per_layer_args, run_stack
from posenc_jax.schemes import build_scheme
from posenc_jax.schemes.base import is_int
from posenc_jax.terms import SchemeTerms

Array = jax.Array


class BertEncoder(nn.Module):
  """Embeddings, the scheme's terms, N encoder layers and the pooler.

  Attributes:
    config: a validated :class:`ModelConfig`; a causal-only scheme (CoPE) raises one
      :class:`ModelConfigError` line when the encoder is created.
  """

  config: ModelConfig

  def __post_init__(self):
    check_bidirectional_form(self.config, "BERT encoder")
    super().__post_init__()

  def setup(self):
    cfg = self.config
    self.token_embed = token_embedding(cfg)
    self.position = build_scheme(cfg.scheme, **scheme_dims(cfg))
    alternate, interval = cfg.alternate()
    if interval:
      self.alternate_position = build_scheme(alternate, **scheme_dims(cfg))
    if cfg.segment is not None:
      self.segment = build_scheme(cfg.segment, **scheme_dims(cfg))
    self.linformer = shared_projection(cfg)  # None unless linformer_sharing='layer'
    if cfg.pre_ln:
      self.final_norm = layer_norm(cfg)
    else:
      self.embed_norm = layer_norm(cfg)
    self.dropout = nn.Dropout(cfg.dropout_rate)
    self.layers = layer_stack(EncoderLayer, cfg, cfg.num_layers)
    if cfg.pooler:
      self.pooler = dense(cfg.d_model, ("embed", "mlp"), cfg)

  def terms(self, length: int, segment_ids: Array,
            position_ids: Array | None = None) -> tuple[SchemeTerms, dict[str, Any]]:
    """The terms of one forward pass and :func:`~posenc_jax.models.stack.run_stack`'s
    per-layer arguments: the position scheme's terms, the alternate scheme's, then the
    segment scheme's (layer ``i`` takes
    ``select_terms(terms.for_layer(i), args["alternate_layers"][i], args["counts"])``, see
    :func:`~posenc_jax.models.stack.select_terms`).

    ``position_ids`` ``[B, L]`` (None: ``0..L-1`` in every row) go to the position
    schemes. Under Linformer's ``layer`` sharing the terms also carry the shared ``E``.
    """
    position = self.position(length, segment_ids, position_ids)
    alternate = (self.alternate_position(length, segment_ids, position_ids)
                 if self.config.alternate()[1] else None)
    terms = position + (alternate or SchemeTerms()) + self.context_terms(length, segment_ids)
    return terms, per_layer_args(self.config, self.config.num_layers, position, alternate)

  def context_terms(self, length: int, segment_ids: Array) -> SchemeTerms:
    """The terms after the position schemes', which every layer keeps: the segment scheme's
    and, under Linformer's ``layer`` sharing, the shared ``E``."""
    terms = SchemeTerms()
    if self.config.segment is not None:
      terms = terms + self.segment(length, segment_ids)
    if self.linformer is not None:
      terms = terms + self.linformer(length)
    return terms

  def __call__(self, input_ids: Array, segment_ids: Array | None = None,
               mask: Array | None = None, *, deterministic: bool = True,
               position_ids: Array | None = None, packed_segment_ids: Array | None = None
               ) -> tuple[Array, Array | None]:
    """Encodes a batch.

    Args:
      input_ids: ``[B, L]`` int token ids.
      segment_ids: ``[B, L]`` int token types (None: all 0).
      mask: ``[B, L]`` padding mask, True (or 1) at real tokens (None: no padding).
      deterministic: False enables dropout (needs a ``dropout`` rng).
      position_ids: ``[B, L]`` int position of each token (None: ``0..L-1``); packed
        sequences restart them per sequence (see :meth:`posenc_jax.schemes.base.Scheme.
        __call__`).
      packed_segment_ids: ``[B, L]`` int packed-sequence id of each token (None: one
        sequence per row); attention stays within a sequence. Not with Linformer.

    Returns:
      ``hidden`` ``[B, L, d]`` and the pooled [CLS] vector ``[B, d]`` (None
      without a pooler).

    Raises:
      ValueError: one line naming an input of the wrong shape or dtype, or a concrete
        token id outside ``[0, vocab_size)`` (traced ids, under :func:`jax.jit`, cannot be
        read: :mod:`posenc_jax.ids`).
    """
    cfg = self.config
    batch, length = check_token_ids("BertEncoder", "input_ids", input_ids,
                                    vocab_size=cfg.vocab_size)
    check_like("BertEncoder", "segment_ids", segment_ids, (batch, length))
    check_like("BertEncoder", "mask", mask, (batch, length))
    check_ids_like("BertEncoder", "position_ids", position_ids, (batch, length))
    check_ids_like("BertEncoder", "packed_segment_ids", packed_segment_ids, (batch, length))
    if packed_segment_ids is not None and cfg.attention == "linformer":
      raise ValueError("BertEncoder: packed_segment_ids: Linformer projects the whole "
                       "sequence and cannot keep packed sequences apart; got attention "
                       "'linformer'")
    segment_ids = jnp.zeros_like(input_ids) if segment_ids is None else segment_ids
    mask = as_mask(mask, (batch, length))
    terms, per_layer = self.terms(length, segment_ids, position_ids)
    x = terms.embed(self.token_embed(input_ids).astype(jnp.float32))
    if not cfg.pre_ln:
      x = self.embed_norm(x)
    x = self.dropout(x, deterministic=deterministic).astype(cfg.compute_dtype)
    x = run_stack(self.layers, x, terms, mask, terms.content_scale, deterministic,
                  packed_segment_ids, **per_layer)
    if cfg.pre_ln:
      x = self.final_norm(x)
    pooled = jnp.tanh(self.pooler(x[:, 0])) if cfg.pooler else None
    return x, pooled

  def attend_tokens(self, h: Array) -> Array:
    """Logits against the word embeddings (the tied decoder): ``[.., d] -> [.., V]``."""
    return self.token_embed.attend(h)


class MaskedLMHead(nn.Module):
  """BERT's MLM head: dense + activation + LayerNorm, tied decoder, output bias.

  Parameters: ``transform/{kernel,bias}``, ``norm/{scale,bias}``, ``bias`` ``[V]``.
  """

  config: ModelConfig

  @nn.compact
  def __call__(self, h: Array, encoder: BertEncoder) -> Array:
    """``h`` ``[.., d]`` -> logits ``[.., V]`` (float32)."""
    cfg = self.config
    h = ACTIVATION_FNS[cfg.activation](dense(cfg.d_model, ("embed", "mlp"), cfg, "transform")(h))
    h = layer_norm(cfg, "norm")(h)
    bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, ("vocab",)),
                      (cfg.vocab_size,))
    return encoder.attend_tokens(h).astype(jnp.float32) + bias


class BertForMaskedLM(nn.Module):
  """Masked-LM pre-training model (no NSP, as DIET and RoBERTa)."""

  config: ModelConfig

  def setup(self):
    self.bert = BertEncoder(self.config)
    self.mlm = MaskedLMHead(self.config)

  def __call__(self, input_ids, segment_ids=None, mask=None, *, masked_positions=None,
               deterministic=True, position_ids=None, packed_segment_ids=None) -> Array:
    """Logits ``[B, L, V]``, or ``[B, P, V]`` at ``masked_positions`` ``[B, P]``
    (``position_ids``, ``packed_segment_ids``: see :meth:`BertEncoder.__call__`)."""
    hidden, _ = self.bert(input_ids, segment_ids, mask, deterministic=deterministic,
                          position_ids=position_ids, packed_segment_ids=packed_segment_ids)
    if masked_positions is not None:
      check_token_ids("BertForMaskedLM", "masked_positions", masked_positions,
                      hidden.shape[0])
      check_id_values("BertForMaskedLM", "masked_positions", masked_positions,
                      hidden.shape[1], "L")
      # A one-hot contraction, not a gather: its gradient is a matmul, not a scatter-add
      # (exact: one non-zero term per output, multiplied at full precision).
      select = jax.nn.one_hot(masked_positions, hidden.shape[1], dtype=hidden.dtype)
      hidden = jnp.einsum("bpl,bld->bpd", select, hidden, precision=lax.Precision.HIGHEST)
    return self.mlm(hidden, self.bert)


class BertForSequenceClassification(nn.Module):
  """Classification (``num_labels`` > 1) or regression (``num_labels`` = 1) on the pooled [CLS].

  Attributes:
    config: the encoder's config.
    num_labels: classes, or 1 for regression (STS-B).

  Raises ModelConfigError when created without a pooler or with a ``num_labels`` that is
  not a positive integer.
  """

  config: ModelConfig
  num_labels: int = 2

  def __post_init__(self):
    if not self.config.pooler:
      raise ModelConfigError("model.pooler: BertForSequenceClassification classifies the "
                             "pooled [CLS]; set pooler=True")
    if not is_int(self.num_labels) or self.num_labels < 1:
      raise ModelConfigError(f"num_labels: got {self.num_labels!r}; allowed: a positive integer "
                             "(1: regression)")
    super().__post_init__()

  def setup(self):
    self.bert = BertEncoder(self.config)
    self.dropout = nn.Dropout(self.config.dropout_rate)
    self.classifier = dense(self.num_labels, ("embed", "labels"), self.config)

  def __call__(self, input_ids, segment_ids=None, mask=None, *, deterministic=True,
               position_ids=None, packed_segment_ids=None) -> Array:
    """Logits ``[B, num_labels]`` (float32); for regression ``[B]`` (``position_ids``,
    ``packed_segment_ids``: see :meth:`BertEncoder.__call__`; the pooled token is row 0's)."""
    _, pooled = self.bert(input_ids, segment_ids, mask, deterministic=deterministic,
                          position_ids=position_ids, packed_segment_ids=packed_segment_ids)
    logits = self.classifier(self.dropout(pooled, deterministic=deterministic))
    logits = logits.astype(jnp.float32)
    return logits[:, 0] if self.num_labels == 1 else logits


class BertForQuestionAnswering(nn.Module):
  """Span prediction: start and end logits per token (SQuAD, XQuAD, MLQA, TyDiQA)."""

  config: ModelConfig

  def setup(self):
    self.bert = BertEncoder(self.config)
    self.qa_outputs = dense(2, ("embed", "labels"), self.config)

  def __call__(self, input_ids, segment_ids=None, mask=None, *, deterministic=True,
               position_ids=None, packed_segment_ids=None) -> tuple[Array, Array]:
    """``start_logits``, ``end_logits``, each ``[B, L]`` float32; padding gets a large negative
    (``position_ids``, ``packed_segment_ids``: see :meth:`BertEncoder.__call__`)."""
    hidden, _ = self.bert(input_ids, segment_ids, mask, deterministic=deterministic,
                          position_ids=position_ids, packed_segment_ids=packed_segment_ids)
    logits = self.qa_outputs(hidden).astype(jnp.float32)
    mask = as_mask(mask, input_ids.shape)
    logits = jnp.where(mask[..., None], logits, jnp.finfo(jnp.float32).min)
    return logits[..., 0], logits[..., 1]
