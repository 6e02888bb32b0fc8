"""The encoder-decoder Transformer: cached decoding equals teacher forcing for every
scheme, padding and causality invariances, closed-form parameter counts."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posenc_jax.models import ModelConfigError, model_config
from posenc_jax.models.decoding import init_cache
from posenc_jax.models.scan import layout_for
from posenc_jax.models.transformer import EncoderDecoder, causal_variant, shift_right

VOCAB, D_MODEL, HEADS, MLP, MAX_LEN = 11, 16, 2, 24, 16
BATCH, SRC_LEN, TGT_LEN = 2, 7, 6

# Schemes run through the whole model, with hyperparameters that exercise
# clipping and log-binning within TGT_LEN positions. Shaw's value term,
# sinusoidal RPE and BERT-A^d decode too: test_decoding.py checks them (and
# every other scheme) at the attention layer, which is cheaper.
DECODE_SCHEMES = {
    "none": {"name": "none"},
    "learned_ape": {"name": "learned_ape"},
    "sinusoidal_ape": {"name": "sinusoidal_ape", "learnable": True},
    "shaw": {"name": "shaw", "clip": 2},
    "t5": {"name": "t5", "num_buckets": 8, "max_distance": 5},
    "diet_rel": {"name": "diet_rel", "clip": 3},
    "diet_abs": {"name": "diet_abs", "rank": 5},
    "diet_abs_share": {"name": "diet_abs", "rank": 5, "sharing": "layer"},
    "alibi": {"name": "alibi"},
    "rope": {"name": "rope"},
    "tupe_a": {"name": "tupe_a"},
    "tupe_r": {"name": "tupe_r", "num_buckets": 8, "max_distance": 5},
    "ape_plus_t5": ({"name": "learned_ape"}, {"name": "t5", "num_buckets": 8}),
}


def tiny_config(scheme=None, **overrides):
  return model_config(dict(
      vocab_size=VOCAB, d_model=D_MODEL, num_layers=1, num_decoder_layers=2, num_heads=HEADS,
      mlp_dim=MLP, max_len=MAX_LEN, dropout_rate=0.0, attention_dropout_rate=0.0,
      layer_norm_eps=1e-6, activation="relu", segment=None, pooler=False,
      scheme=scheme or {"name": "sinusoidal_ape"}) | overrides)


def inputs(seed=0):
  """Source ids with row 1 padded after 4 tokens, its mask, decoder inputs."""
  k1, k2 = jax.random.split(jax.random.key(seed))
  src = jax.random.randint(k1, (BATCH, SRC_LEN), 2, VOCAB)
  src_mask = jnp.arange(SRC_LEN)[None, :] < jnp.array([[SRC_LEN], [4]])
  tgt = shift_right(jax.random.randint(k2, (BATCH, TGT_LEN), 2, VOCAB))
  return jnp.where(src_mask, src, 0), src_mask, tgt


def redraw(tree, seed, std):
  """Every leaf (array or shape) drawn N(0, std^2) with numpy (no per-shape compiles)."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: jnp.asarray(std * rng.standard_normal(x.shape), x.dtype), tree)


def init_model(scheme=None, seed=0, std=0.5, **overrides):
  """(model, params) with every parameter drawn N(0, std^2) and the position
  schemes' N(0, 1). The 0.02 init would leave attention nearly uniform and the
  positional terms nearly zero, so a wrong position would hardly show.

  The values are drawn for the unrolled layers and then laid out as the model's config
  says, so scanned and unrolled models get the same weights."""
  config = tiny_config(scheme, **overrides)
  unrolled = EncoderDecoder(config.replace(scan_layers=False))
  src, src_mask, tgt = inputs()
  shapes = nn.unbox(jax.eval_shape(unrolled.init, jax.random.key(0), src, tgt, src_mask)["params"])
  params = redraw(shapes, seed, std)
  for stack in ("encoder", "decoder"):
    if "position" in params[stack]:
      params[stack]["position"] = redraw(shapes[stack]["position"], seed + 1, 1.0)
  return EncoderDecoder(config), layout_for(params, config.scan_layers)


def incremental_logits(model, params, src, src_mask, tgt):
  """Logits ``[B, L, V]`` from one cached decoding step per position.

  One jitted step, compiled once per model (eager steps would dispatch every operation of
  every position: 2.4x the CPU over this file's decoding tests).
  """
  encoded = model.apply({"params": params}, src, src_mask, method=model.encode)
  cache = init_cache(model, params, encoded, src_mask, tgt.shape[1])
  logits = []
  decode = jax.jit(lambda params, cache, encoded, src_mask, token: model.apply(
      {"params": params, "cache": cache}, encoded, src_mask, token, decode=True,
      method=model.decode, mutable=["cache"]))
  for t in range(tgt.shape[1]):
    step, variables = decode(params, cache, encoded, src_mask, tgt[:, t:t + 1])
    cache = variables["cache"]
    logits.append(step[:, 0])
  return jnp.stack(logits, axis=1)


@pytest.mark.parametrize("name", sorted(DECODE_SCHEMES))
def test_cached_decoding_equals_teacher_forcing(name):
  model, params = init_model(DECODE_SCHEMES[name])
  src, src_mask, tgt = inputs()
  full = model.apply({"params": params}, src, tgt, src_mask)
  steps = incremental_logits(model, params, src, src_mask, tgt)
  assert full.shape == steps.shape == (BATCH, TGT_LEN, VOCAB)
  np.testing.assert_allclose(steps, full, rtol=1e-5, atol=1e-5)


def test_cached_decoding_pre_ln_unshared_embeddings():
  """The other layout: pre-LN (final norms), separate embeddings and output layer."""
  model, params = init_model({"name": "diet_rel", "clip": 3}, pre_ln=True, share_embeddings=False)
  src, src_mask, tgt = inputs()
  np.testing.assert_allclose(incremental_logits(model, params, src, src_mask, tgt),
                             model.apply({"params": params}, src, tgt, src_mask),
                             rtol=1e-5, atol=1e-5)


def test_decoding_sees_target_positions():
  """Not vacuous: with one decoder layer and no position scheme, the last
  position's logits are the same for any order of the earlier inputs; with
  RoPE, swapping two of them changes the logits."""
  src, src_mask, tgt = inputs()
  swapped = tgt.at[:, [1, 2]].set(tgt[:, [2, 1]])
  model, params = init_model({"name": "rope"}, num_decoder_layers=1)
  a = model.apply({"params": params}, src, tgt, src_mask)[:, -1]
  b = model.apply({"params": params}, src, swapped, src_mask)[:, -1]
  assert np.abs(np.asarray(a - b)).max() > 1e-2
  model, params = init_model({"name": "none"}, num_decoder_layers=1)
  a = model.apply({"params": params}, src, tgt, src_mask)[:, -1]
  b = model.apply({"params": params}, src, swapped, src_mask)[:, -1]
  np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["learned_ape", "tupe_r", "shaw"])
def test_source_padding_does_not_change_outputs(name):
  """Extra padded source positions change neither the real positions' encoding
  nor any decoder logit."""
  model, params = init_model(DECODE_SCHEMES[name])
  src, src_mask, tgt = inputs()
  pad = 5
  src_long = jnp.pad(src, ((0, 0), (0, pad)), constant_values=7)  # garbage under the mask
  mask_long = jnp.pad(src_mask, ((0, 0), (0, pad)))
  enc = model.apply({"params": params}, src, src_mask, method=model.encode)
  enc_long = model.apply({"params": params}, src_long, mask_long, method=model.encode)
  np.testing.assert_allclose(np.where(src_mask[..., None], enc_long[:, :SRC_LEN], 0),
                             np.where(src_mask[..., None], enc, 0), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(model.apply({"params": params}, src_long, tgt, mask_long),
                             model.apply({"params": params}, src, tgt, src_mask),
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["alibi", "diet_abs", "rope"])
def test_decoder_is_causal(name):
  """Changing the decoder input at position t leaves the logits before t unchanged
  (and changes those from t on)."""
  model, params = init_model(DECODE_SCHEMES[name])
  src, src_mask, tgt = inputs()
  t = 3
  changed = tgt.at[:, t].set((tgt[:, t] + 1) % VOCAB)
  a = model.apply({"params": params}, src, tgt, src_mask)
  b = model.apply({"params": params}, src, changed, src_mask)
  np.testing.assert_allclose(b[:, :t], a[:, :t], rtol=1e-6, atol=1e-6)
  assert np.abs(np.asarray(b[:, t:] - a[:, t:])).max() > 1e-4


def test_causal_variant():
  assert causal_variant({"name": "t5", "num_buckets": 8}) == {"name": "t5", "num_buckets": 8,
                                                              "bidirectional": False}
  assert causal_variant({"name": "alibi"}) == {"name": "alibi", "causal": True}
  assert causal_variant(({"name": "rope"}, {"name": "t5", "bidirectional": True})) == (
      {"name": "rope"}, {"name": "t5", "bidirectional": False})


def test_shift_right():
  np.testing.assert_array_equal(shift_right(jnp.array([[5, 6, 7]]), bos_id=0), [[0, 5, 6]])


def _closed_form_count(share, pre_ln, layers=2, decoder_layers=2, v=VOCAB, d=D_MODEL, f=MLP):
  attention = 4 * d * d + 3 * d + d          # q, k, v, out kernels; q/k/v biases [H, D]; out bias
  norm = 2 * d
  mlp = d * f + f + f * d + d
  encoder = layers * (attention + 2 * norm + mlp) + (norm if pre_ln else 0)
  decoder = decoder_layers * (2 * attention + 3 * norm + mlp) + (norm if pre_ln else 0)
  embeddings = v * d if share else 2 * v * d + d * v + v
  return embeddings + encoder + decoder


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("pre_ln", [False, True])
def test_parameter_count_closed_form(share, pre_ln):
  model = EncoderDecoder(tiny_config({"name": "sinusoidal_ape"}, share_embeddings=share,
                                     pre_ln=pre_ln, num_layers=2, num_decoder_layers=3))
  src, src_mask, tgt = inputs()
  params = jax.eval_shape(model.init, jax.random.key(0), src, tgt, src_mask)["params"]
  count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nn.unbox(params)))
  assert count == _closed_form_count(share, pre_ln, decoder_layers=3)
  names = set(params)
  assert names == ({"shared_embed", "encoder", "decoder"} if share else
                   {"source_embed", "target_embed", "output", "encoder", "decoder"})


def test_every_parameter_has_logical_axes():
  model = EncoderDecoder(tiny_config({"name": "diet_abs"}, share_embeddings=False))
  src, src_mask, tgt = inputs()
  params = jax.eval_shape(model.init, jax.random.key(0), src, tgt, src_mask)["params"]
  boxed = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
  assert boxed and all(isinstance(x, nn.LogicallyPartitioned) for x in boxed)
  assert all(len(x.names) == len(x.value.shape) for x in boxed)


@pytest.mark.parametrize("overrides,field", [
    (dict(segment={"name": "segment_input"}), "model.segment"),
    (dict(num_decoder_layers=0), "model.num_decoder_layers"),
    (dict(attention="linformer", linformer_k=4), "model.attention"),
])
def test_invalid_translation_configs(overrides, field):
  with pytest.raises(ModelConfigError, match=field):
    EncoderDecoder(tiny_config(**overrides))
