"""The decoder-only causal language model with any position scheme.

Design:

* **Layers.** ``config.num_layers`` :class:`~posenc_jax.models.layers.DecoderLayer` without
  cross-attention: causal self-attention, then the feed-forward block; post-LN by default,
  pre-LN (``config.pre_ln``) with a final LayerNorm. ``num_decoder_layers`` counts an
  encoder-decoder's decoder and must be 0 here (there is no encoder).
* **The stack is the translation model's decoder** (:class:`~posenc_jax.models.transformer.
  Decoder` with no encoder): the scheme from ``config.scheme`` is built in its causal form
  (T5 unidirectional, ALiBi causal, the others as they are), called once per forward pass;
  input-level schemes (learned or sinusoidal APE) add their table to the embeddings;
  ``config.alternate_scheme`` (causal form too) replaces it on every N-th layer, and
  ``config.nope_layer_interval`` takes it off every N-th layer (NoPE). The KV
  cache and the decoding step are the decoder's too, so cached decoding equals teacher
  forcing for every scheme (``tests/test_lm.py``).
* **Embeddings and output.** As in the translation model (tensor2tensor): the table is
  initialised N(0, d^-1/2), the lookup scaled by ``sqrt(d)``, and the logits are ``h E^T``
  with the same table (``share_embeddings=True``, the default; tied as in GPT-2 and T5's
  decoder-only models). ``share_embeddings=False`` gives a separate output Dense ``[d, V]``
  with bias.
* **Inputs** are the targets shifted right (:func:`~posenc_jax.models.transformer.
  shift_right`, BOS = 0, the pad id), as in T5's decoder-only LM; the objective is
  :func:`posenc_jax.training.objectives.lm_objective`, generation
  :func:`posenc_jax.models.decoding.generate`.
* **Full attention, no segments** (``attention='full'``, ``segment=None``): the cache holds
  keys by position, and a text stream has one segment.

Parameter layout::

  embed/embedding                       [V, d]
  output/{kernel [d, V], bias [V]}      (share_embeddings=False)
  decoder/position/...                  the causal form's parameters
  decoder/alternate_position/...        the alternate scheme's causal form's (when set)
  decoder/layers_{i}/{self_attention,self_attention_norm,mlp,mlp_norm}/...
  decoder/final_norm                    (pre-LN only)

With ``config.scan_layers`` (the default) the ``layers_{i}`` subtrees (and cache entries)
are one ``layers`` subtree with a leading ``[N]`` axis (:mod:`posenc_jax.models.stack`).

Cache layout (``decode=True``)::

  decoder/cache_index                   int32 scalar, the next position
  decoder/layers_{i}/self_attention/{cached_key,cached_value}  [B, L_dec, H, D]
  decoder/layers_{i}/self_attention/cache_index                int32 scalar
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from posenc_jax.models.config import ModelConfig, ModelConfigError, check_causal_form
from posenc_jax.models.layers import dense, token_embedding
from posenc_jax.models.transformer import Decoder, embedding_init

Array = jax.Array


def check_lm_config(config: ModelConfig) -> None:
  """Raises one :class:`ModelConfigError` line for a config the language model cannot run."""
  if config.num_decoder_layers:
    raise ModelConfigError(f"model.num_decoder_layers: got {config.num_decoder_layers}; "
                           "allowed: 0 for the language model (head 'lm'), which counts its "
                           "layers in model.num_layers")
  if config.segment is not None:
    raise ModelConfigError(f"model.segment: the language model has no segment scheme; set "
                           f"segment=None, got {dict(config.segment)!r}")
  if config.attention != "full":
    raise ModelConfigError(f"model.attention: the language model runs full attention (its "
                           f"cache keeps keys by position), got {config.attention!r}")
  check_causal_form(config, config.num_layers, "language model")


class CausalLM(nn.Module):
  """A decoder-only Transformer language model with any position scheme.

  Attributes:
    config: a validated :class:`ModelConfig` with ``num_decoder_layers=0``,
      ``segment=None`` and ``attention='full'``.
  """

  config: ModelConfig

  def __post_init__(self):
    check_lm_config(self.config)
    super().__post_init__()

  def setup(self):
    cfg = self.config
    self.embed = token_embedding(cfg, init=embedding_init(cfg))
    if not cfg.share_embeddings:
      self.output = dense(cfg.vocab_size, ("embed", "vocab"), cfg)
    self.decoder = Decoder(cfg, embed=self.embed, num_layers=cfg.num_layers)

  def decode(self, ids: Array, mask: Array | None = None, *, decode: bool = False,
             deterministic: bool = True, position_ids: Array | None = None,
             packed_segment_ids: Array | None = None) -> Array:
    """Next-token logits ``[B, L, V]`` (float32) for inputs ``ids`` ``[B, L]``.

    Args:
      ids: the inputs, targets shifted right; ``[B, 1]`` in a decoding step.
      mask: ``[B, L]`` padding mask (True at tokens) or None; None in a decoding step.
      decode: use the KV cache (apply with ``mutable=["cache"]``): the first call (``ids``
        of the full decode length ``L_dec``) creates it, each later call takes the next
        position (see :func:`posenc_jax.models.decoding.generate`).
      deterministic: False enables dropout (needs a ``dropout`` rng).
      position_ids: ``[B, L]`` int position of each input (None: ``0..L-1``), e.g.
        restarting per packed document; not with ``decode``.
      packed_segment_ids: ``[B, L]`` int document id of each input (None: one stream per
        row); attention stays within a document. Not with ``decode``.

    Raises:
      ValueError: one line naming an input of the wrong shape or dtype, or a concrete
        token id outside ``[0, vocab_size)`` (traced ids, under :func:`jax.jit`, cannot be
        read: :mod:`posenc_jax.ids`).
    """
    h = self.decoder(None, None, ids, mask, decode=decode, deterministic=deterministic,
                     position_ids=position_ids, packed_segment_ids=packed_segment_ids)
    logits = self.embed.attend(h) if self.config.share_embeddings else self.output(h)
    return logits.astype(jnp.float32)

  def __call__(self, ids: Array, mask: Array | None = None, *,
               deterministic: bool = True, position_ids: Array | None = None,
               packed_segment_ids: Array | None = None) -> Array:
    """Teacher forcing: logits ``[B, L, V]`` (float32) for ``ids`` ``[B, L]`` (see
    :meth:`decode`)."""
    return self.decode(ids, mask, deterministic=deterministic, position_ids=position_ids,
                       packed_segment_ids=packed_segment_ids)
