"""The encoder-decoder translation Transformer (Vaswani et al.) with any position scheme.

Design:

* **Layers.** ``config.num_layers`` :class:`EncoderLayer` and
  ``config.num_decoder_layers`` :class:`DecoderLayer`; post-LN by default
  (``config.pre_ln`` for pre-LN, which adds a final LayerNorm to each stack);
  ``config.activation`` in the feed-forward block (Vaswani: ``relu``).
* **Embeddings.** Vaswani et al. multiply the embeddings by ``sqrt(d)`` and
  share one table between source, target and the output projection. As in
  tensor2tensor, the table is initialised N(0, d^-1/2), the input lookup is
  scaled by ``sqrt(d)`` (unit-variance inputs) and the output logits are
  ``h E^T`` unscaled (unit-variance logits for a LayerNormed ``h``). With
  ``share_embeddings=False`` the source and target get their own tables
  (same init and scaling) and the output a Dense layer ``[d, V]`` with bias.
* **Positions.** The scheme from ``config.scheme`` is built twice, for the
  encoder self-attention and for the decoder self-attention (separate
  parameters), and called once per forward pass. The decoder gets the causal
  variant automatically: T5 with ``bidirectional=False``, ALiBi with
  ``causal=True``; the other schemes run under the causal mask as they are.
  Input-level schemes (learned or sinusoidal APE) add their table to the
  embeddings. With ``config.alternate_scheme`` (and its interval N) every N-th
  layer of each stack runs a second scheme instead, built beside the first
  (causal in the decoder); ``config.nope_layer_interval`` N leaves those layers
  with no positional term (NoPE).
* **Cross-attention is content only**: no positional term. Its keys are
  encoder states, which already carry the source positions, and a relative
  offset between a target and a source position has no meaning across two
  languages (Vaswani et al., Shaw et al. and T5 add nothing there either).
* **No segment scheme**: translation inputs are single sequences
  (``config.segment`` must be None).
* **Incremental decoding** (``decode=True``): the decoder self-attention
  keeps a KV cache (see :class:`~posenc_jax.attention.MultiHeadAttention`).
  A step builds the scheme's terms for the whole decode length ``L_dec``
  (the cache's length) and takes the current row with ``slice_queries``, so
  every scheme sees the same positions as in the teacher-forced pass and the
  two agree to float32 rounding. This costs the full ``[L_dec, L_dec]``
  bias per step for bias-form schemes; it keeps a single code path.
  Cross-attention recomputes its keys from ``encoded`` each step.

Parameter layout::

  shared_embed/embedding                [V, d]   (share_embeddings)
  source_embed/embedding, target_embed/embedding  [V, d]   (not shared)
  output/{kernel [d, V], bias [V]}               (not shared)
  encoder/position/...                  the scheme's parameters
  encoder/alternate_position/...        the alternate scheme's (when its interval is set)
  encoder/layers_{i}/attention/{query,key,value,out}/..., attention_norm, mlp, mlp_norm
  encoder/final_norm                    (pre-LN only)
  decoder/position/...                  the causal variant's parameters
  decoder/alternate_position/...        the alternate scheme's causal variant's
  decoder/layers_{i}/{self_attention,cross_attention}/{query,key,value,out}/...
  decoder/layers_{i}/{self_attention_norm,cross_attention_norm,mlp,mlp_norm}/...
  decoder/final_norm                    (pre-LN only)

With ``config.scan_layers`` (the default) each stack's ``layers_{i}`` subtrees (and cache
entries) are one ``layers`` subtree with a leading ``[N]`` axis
(:mod:`posenc_jax.models.stack`).

Cache layout (``decode=True``)::

  decoder/cache_index                   int32 scalar, the next target position
  decoder/layers_{i}/self_attention/{cached_key,cached_value}  [B, L_dec, H, D]
  decoder/layers_{i}/self_attention/cache_index                int32 scalar
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from posenc_jax.models.config import ModelConfig, ModelConfigError, causal_variant, scheme_dims
from posenc_jax.models.inputs import as_mask, check_ids_like, check_like, check_token_ids
from posenc_jax.models.layers import (DecoderLayer, EncoderLayer, dense, layer_norm,
                                      token_embedding)
from posenc_jax.models.stack import layer_stack, per_layer_args, run_stack
from posenc_jax.schemes import build_scheme
from posenc_jax.terms import SchemeTerms

Array = jax.Array


def shift_right(ids: Array, bos_id: int = 0) -> Array:
  """Decoder inputs from targets: ``[B, L]`` -> ``[bos, t_0, .., t_{L-2}]``."""
  return jnp.pad(ids, ((0, 0), (1, 0)), constant_values=bos_id)[:, :-1]


def check_translation_config(config: ModelConfig) -> None:
  """Raises one :class:`ModelConfigError` line for a config the translation model cannot run."""
  if config.segment is not None:
    raise ModelConfigError(f"model.segment: the translation model has no segment scheme; "
                           f"set segment=None, got {dict(config.segment)!r}")
  if config.num_decoder_layers < 1:
    raise ModelConfigError("model.num_decoder_layers: the translation model needs at least one "
                           f"decoder layer, got {config.num_decoder_layers}")
  if config.attention != "full":
    raise ModelConfigError(f"model.attention: the translation model runs full attention (the "
                           f"decoder caches keys by position), got {config.attention!r}")


def embedding_init(config: ModelConfig) -> nn.initializers.Initializer:
  """tensor2tensor's N(0, d^-1/2) token table (inputs scaled by sqrt(d), logits unscaled)."""
  return nn.initializers.normal(config.d_model ** -0.5)


def alternate_scheme(config: ModelConfig, causal: bool,
                     num_layers: int | None = None) -> nn.Module | None:
  """The alternate scheme's module (``alternate_position``; its causal form for a decoder),
  built for a stack of ``num_layers`` (None: ``config.num_layers``), or None when no layer
  runs it. Call inside a compact ``__call__``."""
  form, interval = config.alternate()
  if not interval:
    return None
  form = causal_variant(form) if causal else form
  return build_scheme(form, **scheme_dims(config, num_layers), name="alternate_position")


def stack_terms(config: ModelConfig, num_layers: int, position: nn.Module,
                alternate: nn.Module | None, length: int, position_ids: Array | None = None
                ) -> tuple[SchemeTerms, dict]:
  """The terms of a stack of ``num_layers`` layers over ``length`` positions (the position
  scheme's, then the alternate scheme's) and :func:`~posenc_jax.models.stack.run_stack`'s
  per-layer arguments."""
  own = position(length, None, position_ids)
  other = None if alternate is None else alternate(length, None, position_ids)
  return own + (other or SchemeTerms()), per_layer_args(config, num_layers, own, other)


class Encoder(nn.Module):
  """Scaled token embeddings, the scheme's terms, N encoder layers.

  Attributes:
    config: a validated :class:`ModelConfig`.
    embed: the source token embedding (shared or not; owned by the parent).
  """

  config: ModelConfig
  embed: nn.Module

  @nn.compact
  def __call__(self, src_ids: Array, src_mask: Array | None = None, *,
               deterministic: bool = True) -> Array:
    """``src_ids`` ``[B, Ls]``, ``src_mask`` ``[B, Ls]`` (True = token) -> ``[B, Ls, d]``.

    Inputs of the wrong shape or dtype, and concrete ids outside ``[0, vocab_size)``, raise
    one ValueError line naming them (traced ids, under :func:`jax.jit`, cannot be read).
    """
    cfg = self.config
    position = build_scheme(cfg.scheme, **scheme_dims(cfg), name="position")
    batch, length = check_token_ids("Encoder", "src_ids", src_ids, vocab_size=cfg.vocab_size)
    check_like("Encoder", "src_mask", src_mask, (batch, length))
    mask = as_mask(src_mask, (batch, length))
    terms, per_layer = stack_terms(cfg, cfg.num_layers, position, alternate_scheme(cfg, False),
                                   length)
    x = self.embed(src_ids).astype(jnp.float32) * math.sqrt(cfg.d_model)
    x = terms.embed(x)
    x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic).astype(cfg.compute_dtype)
    layers = layer_stack(EncoderLayer, cfg, cfg.num_layers, name="layers")
    x = run_stack(layers, x, terms, mask, terms.content_scale, deterministic, **per_layer)
    if cfg.pre_ln:
      x = layer_norm(cfg, "final_norm")(x)
    return x


class Decoder(nn.Module):
  """Scaled target embeddings, the causal scheme's terms, N decoder layers.

  Without ``encoded`` it is a decoder-only stack (no cross-attention): the causal language
  model's (:class:`~posenc_jax.models.decoder_lm.CausalLM`).

  Attributes:
    config: a validated :class:`ModelConfig`.
    embed: the target token embedding (shared or not; owned by the parent).
    num_layers: N (the encoder-decoder's ``num_decoder_layers``, the language model's
      ``num_layers``).
  """

  config: ModelConfig
  embed: nn.Module
  num_layers: int

  def _decode_length(self) -> int | None:
    """``L_dec`` from the first layer's KV cache (or the scanned layers'), or None before
    the cache exists."""
    cache = self.variables.get("cache", {})
    layer = cache.get("layers_0", cache.get("layers", {})).get("self_attention", {})
    # [B, L_dec, H, D], with the layers axis in front when scanned.
    return layer["cached_key"].shape[-3] if "cached_key" in layer else None

  @nn.compact
  def __call__(self, encoded: Array | None, src_mask: Array | None, tgt_ids: Array,
               tgt_mask: Array | None = None, *, decode: bool = False,
               deterministic: bool = True, position_ids: Array | None = None,
               packed_segment_ids: Array | None = None) -> Array:
    """Decoder hidden states.

    Args:
      encoded: ``[B, Ls, d]`` encoder output, or None (decoder-only: no cross-attention).
      src_mask: ``[B, Ls]`` source padding mask or None (None without ``encoded``).
      tgt_ids: ``[B, Lt]`` decoder inputs (targets shifted right); ``[B, 1]``
        in a decoding step.
      tgt_mask: ``[B, Lt]`` target padding mask or None (must be None in a
        decoding step).
      decode: use the KV cache (the first call creates it from ``tgt_ids``'s
        length; later calls each take one position).
      deterministic: False enables dropout.
      position_ids: ``[B, Lt]`` int position of each target token (None: ``0..Lt-1``);
        teacher forcing only (a decoding step counts positions by its cache index).
      packed_segment_ids: ``[B, Lt]`` int packed-sequence id of each target token (None:
        one sequence per row); self-attention stays within a sequence. Teacher forcing
        only.

    Returns:
      ``[B, Lt, d]``.

    Raises:
      ValueError: one line naming an input of the wrong shape or dtype, or a concrete
        token id outside ``[0, vocab_size)`` (traced ids, under :func:`jax.jit`, cannot be
        read: :mod:`posenc_jax.ids`).
    """
    cfg = self.config
    if encoded is None:
      batch, length = check_token_ids("Decoder", "tgt_ids", tgt_ids, vocab_size=cfg.vocab_size)
      if src_mask is not None:
        raise ValueError(f"Decoder: src_mask: got shape {jnp.shape(src_mask)}; expected None "
                         "without encoded (a decoder-only model has no source)")
    else:
      if jnp.ndim(encoded) != 3 or encoded.shape[-1] != cfg.d_model:
        raise ValueError(f"Decoder: encoded: got shape {jnp.shape(encoded)}; expected "
                         f"[B, Ls, d] with d = {cfg.d_model}")
      batch, length = check_token_ids("Decoder", "tgt_ids", tgt_ids, encoded.shape[0],
                                      cfg.vocab_size)
      check_like("Decoder", "src_mask", src_mask, encoded.shape[:2])
    check_like("Decoder", "tgt_mask", tgt_mask, (batch, length))
    check_ids_like("Decoder", "position_ids", position_ids, (batch, length))
    check_ids_like("Decoder", "packed_segment_ids", packed_segment_ids, (batch, length))
    if decode and (position_ids is not None or packed_segment_ids is not None):
      raise ValueError("Decoder: position_ids, packed_segment_ids: cached decoding counts "
                       "positions by step; pass them only without decode")
    position = build_scheme(causal_variant(cfg.scheme), **scheme_dims(cfg, self.num_layers),
                            name="position")
    alternate = alternate_scheme(cfg, True, self.num_layers)
    step = decode and self._decode_length() is not None
    x = self.embed(tgt_ids).astype(jnp.float32) * math.sqrt(cfg.d_model)
    if step:
      if tgt_mask is not None:
        raise ValueError("tgt_mask: a decoding step takes no target mask")
      length = self._decode_length()
    terms, per_layer = stack_terms(cfg, self.num_layers, position, alternate, length,
                                   position_ids)
    if decode:
      cache_index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
    if step:
      # This step's input row of an input-level scheme (APE); the layers
      # slice their own terms at their cache index.
      x = terms.slice_queries(cache_index.value, 1).embed(x)
      cache_index.value = cache_index.value + 1
    else:
      x = terms.embed(x)
    x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic).astype(cfg.compute_dtype)
    layers = layer_stack(DecoderLayer, cfg, self.num_layers, remat=not decode, name="layers")
    x = run_stack(layers, x, terms, encoded, tgt_mask, src_mask, terms.content_scale, decode,
                  deterministic, packed_segment_ids, **per_layer)
    if cfg.pre_ln:
      x = layer_norm(cfg, "final_norm")(x)
    return x


class EncoderDecoder(nn.Module):
  """Vaswani et al.'s translation Transformer with any position scheme.

  Attributes:
    config: a validated :class:`ModelConfig` with ``num_decoder_layers > 0``,
      ``segment=None`` and ``attention='full'``.
  """

  config: ModelConfig

  def __post_init__(self):
    check_translation_config(self.config)
    super().__post_init__()

  def setup(self):
    cfg = self.config
    init = embedding_init(cfg)
    if cfg.share_embeddings:
      self.shared_embed = token_embedding(cfg, init=init)
      source, target = self.shared_embed, self.shared_embed
    else:
      self.source_embed = token_embedding(cfg, init=init)
      self.target_embed = token_embedding(cfg, init=init)
      self.output = dense(cfg.vocab_size, ("embed", "vocab"), cfg)
      source, target = self.source_embed, self.target_embed
    self.encoder = Encoder(cfg, embed=source)
    self.decoder = Decoder(cfg, embed=target, num_layers=cfg.num_decoder_layers)

  def encode(self, src_ids: Array, src_mask: Array | None = None, *,
             deterministic: bool = True) -> Array:
    """``src_ids`` ``[B, Ls]`` (``src_mask`` True at tokens) -> encoded ``[B, Ls, d]``."""
    return self.encoder(src_ids, src_mask, deterministic=deterministic)

  def decode(self, encoded: Array, src_mask: Array | None, tgt_ids: Array,
             tgt_mask: Array | None = None, *, decode: bool = False,
             deterministic: bool = True) -> Array:
    """Output logits ``[B, Lt, V]`` (float32) for decoder inputs ``tgt_ids`` ``[B, Lt]``.

    With ``decode=True`` apply with ``mutable=["cache"]``: the first call
    (``tgt_ids`` of the full decode length ``L_dec``) creates the cache, each
    later call takes ``tgt_ids`` ``[B, 1]`` at the next position. See
    :func:`posenc_jax.models.decoding.init_cache`.
    """
    h = self.decoder(encoded, src_mask, tgt_ids, tgt_mask, decode=decode,
                     deterministic=deterministic)
    if self.config.share_embeddings:
      logits = self.shared_embed.attend(h)
    else:
      logits = self.output(h)
    return logits.astype(jnp.float32)

  def __call__(self, src_ids: Array, tgt_ids: Array, src_mask: Array | None = None,
               tgt_mask: Array | None = None, *, deterministic: bool = True) -> Array:
    """Teacher forcing: logits ``[B, Lt, V]`` (float32).

    Args:
      src_ids: ``[B, Ls]`` source ids.
      tgt_ids: ``[B, Lt]`` decoder inputs, the targets shifted right
        (:func:`shift_right`).
      src_mask, tgt_mask: ``[B, Ls]``, ``[B, Lt]`` padding masks (True at
        tokens) or None.
      deterministic: False enables dropout (needs a ``dropout`` rng).
    """
    encoded = self.encode(src_ids, src_mask, deterministic=deterministic)
    return self.decode(encoded, src_mask, tgt_ids, tgt_mask, deterministic=deterministic)

