"""NoPE layers (``model.nope_layer_interval``, MaxText's name and convention): which layers
drop the position scheme, a layer's attention against an independent float64 transcription
(the NoPE layer over plain ``q . k / sqrt(D)``, the others rotated), scanned equal to
unrolled for BERT, the encoder-decoder and the language model (values and gradients),
cached decoding equal to teacher forcing, and the one-line refusals."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posenc_jax.models import ModelConfigError, model_config
from posenc_jax.models.build import build_model
from posenc_jax.models.scan import layout_for
from tests.test_lm import cached_logits, init_lm, token_ids
from tests.test_transformer import redraw

TOL = dict(rtol=1e-5, atol=1e-5)
IDS = jax.random.randint(jax.random.key(7), (2, 6), 1, 20)


def tiny(**fields):
  return model_config(dict(
      vocab_size=20, d_model=16, num_layers=4, num_heads=2, mlp_dim=24, max_len=16,
      dropout_rate=0.0, attention_dropout_rate=0.0, layer_norm_eps=1e-6, segment=None,
      pooler=False, scheme={"name": "rope"}, nope_layer_interval=4) | fields)


def both_layouts(cfg, head, *args):
  """``(unrolled, scanned, unrolled params, scanned params)``, the same N(0, 0.5^2) values."""
  unrolled = build_model(cfg.replace(scan_layers=False), head)
  scanned = build_model(cfg.replace(scan_layers=True), head)
  params = redraw(nn.unbox(jax.eval_shape(unrolled.init, jax.random.key(0), *args)["params"]),
                  0, 0.5)
  return unrolled, scanned, params, layout_for(params, True)


def test_nope_layers_are_maxtexts():
  """Layer ``i`` (0-based) is NoPE when ``(i + 1) % N == 0`` (MaxText's
  ``determine_is_nope_layer``): the last of every N layers."""
  assert tiny().alternate_layers(8) == (False, False, False, True) * 2
  assert tiny(nope_layer_interval=3).alternate_layers(4) == (False, False, True, False)
  assert tiny(nope_layer_interval=0).alternate_layers(4) == (False,) * 4


def rope64(x, pos):
  """Su et al.'s RoPE in float64: pair ``(2k, 2k+1)`` of ``x`` ``[L, H, D]`` turned by
  ``pos * 10000^(-2k/D)``."""
  dim = x.shape[-1]
  angle = pos[:, None, None] * 10000.0 ** (-np.arange(0, dim, 2) / dim)
  even, odd = x[..., 0::2], x[..., 1::2]
  out = np.empty_like(x)
  out[..., 0::2] = even * np.cos(angle) - odd * np.sin(angle)
  out[..., 1::2] = even * np.sin(angle) + odd * np.cos(angle)
  return out


def attention64(p, x, rotate, segment_bias):
  """One example's self-attention ``[L, d] -> [L, d]`` in float64 from the layer's
  parameters: softmax(q . k / sqrt(D) + segment_bias) v, q and k rotated when ``rotate``;
  ``segment_bias`` ``[H, L, L]``."""
  f = lambda name: {k: np.asarray(v, np.float64) for k, v in p[name].items()}  # noqa: E731
  q, k, v = (np.einsum("ld,dhe->lhe", x, f(n)["kernel"]) + f(n)["bias"]
             for n in ("query", "key", "value"))
  if rotate:
    pos = np.arange(x.shape[0], dtype=np.float64)
    q, k = rope64(q, pos), rope64(k, pos)
  logits = np.einsum("ihe,jhe->hij", q, k) / np.sqrt(q.shape[-1]) + segment_bias
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  out = np.einsum("hij,jhe->ihe", probs, v)
  return np.einsum("ihe,hed->id", out, f("out")["kernel"]) + f("out")["bias"]


def test_the_nope_layer_attends_without_rotation():
  """BERT, 4 layers, RoPE and per-head segment terms, interval 4: each layer's attention
  output (captured) equals the float64 transcription from its captured input, rotated on
  layers 0-2 and plain on 3, with the segment term ``S_h[seg_i, seg_j]`` on every layer (it
  is not a position); the rotated transcription misses layer 3, the plain one layer 0."""
  segments = jnp.array([[0, 0, 0, 1, 1, 1], [0, 1, 1, 0, 0, 1]])
  cfg = tiny(segment={"name": "segment_per_head"})
  unrolled, _, params, _ = both_layouts(cfg, "mlm", IDS, segments)
  _, state = unrolled.apply({"params": params}, IDS, segments, capture_intermediates=True,
                            mutable=["intermediates"])
  seen = state["intermediates"]["bert"]
  inputs = [seen["embed_norm"]["__call__"][0]] + [seen[f"layers_{i}"]["__call__"][0]
                                                   for i in range(3)]
  table = np.asarray(params["bert"]["segment"]["segment_bias"], np.float64)  # [N, H, 2, 2]
  for layer, x in enumerate(inputs):
    got = np.asarray(seen[f"layers_{layer}"]["attention"]["__call__"][0])
    p = params["bert"][f"layers_{layer}"]["attention"]
    for b, seg in enumerate(np.asarray(segments)):
      x64, bias = np.asarray(x[b], np.float64), table[layer][:, seg[:, None], seg[None, :]]
      np.testing.assert_allclose(got[b], attention64(p, x64, layer != 3, bias), **TOL)
      assert np.abs(got[b] - attention64(p, x64, layer == 3, bias)).max() > 1e-3


@pytest.mark.parametrize("head", ["mlm", "translation", "lm"])
def test_scanned_equals_unrolled(head):
  """The scanned stack (``nn.cond`` on the scanned NoPE flag) gives the unrolled values and
  gradients. BERT: 4 layers, interval 4, remat on (the branches run under ``nn.remat``);
  the translation model (NoPE in both stacks) and the language model: 2 layers, interval 2."""
  cfg = tiny(remat="full") if head == "mlm" else tiny(num_layers=2, nope_layer_interval=2)
  if head == "translation":
    cfg = cfg.replace(num_decoder_layers=2)
  args = (IDS, IDS[:, ::-1]) if head == "translation" else (IDS,)
  unrolled, scanned, params, stacked = both_layouts(cfg, head, *args)
  loss = lambda model, p: jnp.sum(jnp.sin(model.apply({"params": p}, *args)))  # noqa: E731
  want, grads = jax.value_and_grad(lambda p: loss(unrolled, p))(params)
  got, grads_s = jax.value_and_grad(lambda p: loss(scanned, p))(stacked)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for g, g_s in zip(jax.tree.leaves(layout_for(grads, True)), jax.tree.leaves(grads_s)):
    np.testing.assert_allclose(g_s, g, **TOL)


def test_nope_changes_only_what_it_should():
  """With interval 2 over 2 layers the model differs from plain RoPE (layer 1 loses its
  rotation) and is still not a bag of tokens (layer 0 keeps it)."""
  ids = token_ids(5)
  swapped = ids.at[:, [1, 2]].set(ids[:, [2, 1]])
  model, params = init_lm({"name": "rope"}, nope_layer_interval=2)
  rope = model.clone(config=model.config.replace(nope_layer_interval=0))
  forced = model.apply({"params": params}, ids)
  assert np.abs(np.asarray(forced - rope.apply({"params": params}, ids))).max() > 1e-3
  assert np.abs(np.asarray(forced - model.apply({"params": params}, swapped))[:, -1]).max() > 1e-3


@pytest.mark.parametrize("scanned", [True, False])
def test_cached_decoding_equals_teacher_forcing(scanned):
  """The language model with a NoPE layer (2 layers, interval 2: layer 1): one cached step
  per position gives the teacher-forced logits, in either layout."""
  ids = token_ids(6)
  model, params = init_lm({"name": "rope"}, nope_layer_interval=2, scan_layers=scanned)
  np.testing.assert_allclose(cached_logits(model, params, ids),
                             model.apply({"params": params}, ids), **TOL)


@pytest.mark.parametrize("fields, message", [
    ({"nope_layer_interval": 1}, "model.nope_layer_interval: got 1; allowed: 0 (off) or an "
                                 "integer in [2, 4]"),
    ({"nope_layer_interval": 5}, "model.nope_layer_interval: got 5; allowed: 0 (off) or an "
                                 "integer in [2, 4]"),
    ({"nope_layer_interval": -1}, "model.nope_layer_interval: got -1;"),
    ({"nope_layer_interval": True}, "model.nope_layer_interval: got True;"),
    ({"nope_layer_interval": 4, "num_decoder_layers": 3},
     "model.nope_layer_interval: got 4; allowed: 0 (off) or an integer in [2, 3]"),
    ({"scheme": {"name": "none"}}, "model.nope_layer_interval: got 4, but the alternate scheme "
                                   "is model.scheme ('none') itself"),
])
def test_bad_configs_are_one_line(fields, message):
  with pytest.raises(ModelConfigError) as e:
    tiny(**fields)
  assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.parametrize("scheme, message", [
    ({"name": "learned_ape"}, "model.nope_layer_interval: the scheme adds input embeddings"),
    ({"name": "tupe_a"}, "model.nope_layer_interval: the scheme sets every layer's content "
                         "scale"),
])
def test_input_level_and_scaled_schemes_are_refused(scheme, message):
  """An input embedding is added before every layer and a content scale set on every layer,
  so no NoPE layer could be free of them: refused in one line when the model is built."""
  model = build_model(tiny(scheme=scheme), "mlm")
  with pytest.raises(ModelConfigError) as e:
    jax.eval_shape(model.init, jax.random.key(0), IDS)
  assert str(e.value).startswith(message) and "\n" not in str(e.value)
