"""Layer attention, identical-word probing and the content-free positional term."""

import functools
import math
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posenc_jax.analysis import (AnalysisError, bundled_tokens, identical_word_ids,
                                 identical_word_probing, indicators, layer_runner, opr,
                                 position_vectors, positional_attention, wordpiece_tokens)
from posenc_jax.models import BertEncoder, model_config
from posenc_jax.models.scan import layout_for
from posenc_jax.schemes import alibi_slopes
from tests.conftest import minilm_dir

SMALL = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, mlp_dim=64, max_len=16)

# Every term form, composed into three models: input table, query-relative with values,
# bias, factored, rotation, DIET's per-head segments (pre-LN); factored + bias with the
# [CLS] reset; q/k shift.
FORMS = {
    "ape_shaw_t5_diet_rope": dict(
        scheme=({"name": "learned_ape"}, {"name": "shaw", "clip": 3, "value": True},
                {"name": "t5", "num_buckets": 8, "max_distance": 6},
                {"name": "diet_abs", "rank": 5}, {"name": "rope"}),
        segment={"name": "segment_per_head"}, pre_ln=True),
    "tupe_r": dict(scheme={"name": "tupe_r", "num_buckets": 8, "max_distance": 6}),
    "bert_ad_alibi": dict(scheme=({"name": "bert_ad"}, {"name": "alibi"})),
}


def random_model(fields, seed=0, scale=0.5, **dims):
  """A small encoder with N(0, scale^2) parameters drawn by numpy (shapes from
  ``jax.eval_shape``: nothing to compile), so every term matters."""
  cfg = model_config(SMALL | dims | fields)
  encoder = BertEncoder(cfg)
  abstract = jax.eval_shape(encoder.init, jax.random.key(0), jnp.ones((1, 8), jnp.int32))
  rng = np.random.default_rng(seed)
  params = jax.tree.map(lambda x: jnp.asarray(scale * rng.normal(size=x.shape), jnp.float32),
                        nn.unbox(abstract["params"]))
  return encoder, {"params": params}


@functools.lru_cache(maxsize=None)
def model(scheme, scale=0.05):
  """A one-layer encoder over 64 positions with ``scheme``, shared by this file's tests."""
  encoder, variables = random_model({"scheme": {"name": scheme}}, scale=scale, num_layers=1,
                                    max_len=64)
  return types.SimpleNamespace(encoder=encoder, variables=variables,
                               tokens=bundled_tokens(SMALL["vocab_size"]))


def batch(length=12, seed=3):
  rng = np.random.default_rng(seed)
  ids = rng.integers(6, SMALL["vocab_size"], size=(2, length))
  segments = (np.arange(length)[None, :] >= np.array([[6], [4]])).astype(np.int32)
  mask = np.arange(length)[None, :] < np.array([[length], [length - 3]])
  return ids, segments, mask


@pytest.mark.parametrize("form", sorted(FORMS))
def test_recomputed_probabilities_reproduce_the_layer_output(form):
  """probs @ v (+ Shaw's value term), projected, is the attention module's own output."""
  encoder, variables = random_model(FORMS[form])
  ids, segments, mask = batch()
  for layer in (0,) if form != "tupe_r" else (0, 1):
    att = layer_runner(encoder, layer)(variables, ids, segments, mask)
    np.testing.assert_allclose(np.asarray(att.probs).sum(-1), 1.0, rtol=1e-5)
    assert float(jnp.abs(att.probs * ~mask[:, None, None, :]).max()) == 0.0
    out = jnp.einsum("bhij,bjhd->bihd", att.probs, att.v)
    for term in att.terms:
      extra = term.with_key_length(ids.shape[1]).value_output(att.probs)
      if extra is not None:
        out = out + extra
    w = layout_for(variables["params"], False)[f"layers_{layer}"]["attention"]["out"]
    out = jnp.einsum("bihd,hde->bie", out, w["kernel"]) + w["bias"]
    np.testing.assert_allclose(out, att.output, rtol=2e-4, atol=2e-5)


def test_skipping_later_layers_leaves_the_probed_layer_unchanged():
  encoder, variables = random_model(FORMS["tupe_r"])
  ids, segments, mask = batch()
  att = layer_runner(encoder, 1)(variables, ids, segments, mask)

  def capture(module, name):
    return name == "__call__" and tuple(module.path) == ("layers_1", "attention")

  unrolled = encoder.clone(config=encoder.config.replace(scan_layers=False))  # per-layer paths
  variables = {"params": layout_for(variables["params"], False)}
  _, state = jax.jit(lambda v: unrolled.apply(v, ids, segments, mask, capture_intermediates=capture,
                                              mutable=["intermediates"]))(variables)
  full = state["intermediates"]["layers_1"]["attention"]["__call__"][0]
  np.testing.assert_allclose(att.output, full, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def no_position():
  return model("none")


def test_no_position_model_probes_as_a_bag_of_words(no_position):
  m = no_position
  plain = identical_word_probing(m.encoder, m.variables, m.tokens, length=24, num_words=12,
                                 batch_size=5, special="none")
  np.testing.assert_allclose(plain.attention, 1.0 / 24, rtol=1e-5)
  probe = identical_word_probing(m.encoder, m.variables, m.tokens, length=24, num_words=12,
                                 batch_size=5)
  assert probe.special_positions == (0, 23)
  words = probe.attention[1:-1, 1:-1]
  np.testing.assert_allclose(words, words[0, 0], rtol=1e-5)  # every word position alike
  np.testing.assert_allclose(probe.attention[1:-1], np.broadcast_to(
      probe.attention[1], (22, 24)), rtol=1e-5)  # every word query attends alike
  assert indicators(probe.attention, probe.special_positions)[
      "relative_spread_without_cls"] < 1e-5
  np.testing.assert_allclose(probe.per_head.mean(0), probe.attention, rtol=1e-6)


def test_alibi_probing_is_monotone_and_learned_ape_is_not():
  alibi = model("alibi")
  probe = identical_word_probing(alibi.encoder, alibi.variables, alibi.tokens, length=48,
                                 num_words=16)
  assert opr(probe.attention) == 0.0
  assert opr(probe.attention, k=20) == 0.0
  inner = probe.attention[1:-1, 1:-1]
  for row in (0, 10, 23):  # strictly decreasing away from the diagonal, both directions
    assert (np.diff(inner[row, row:]) < 0).all() and (np.diff(inner[row, :row + 1]) > 0).all()
  ape = model("learned_ape")
  random = identical_word_probing(ape.encoder, ape.variables, ape.tokens, length=48,
                                  num_words=16)
  assert 0.3 < opr(random.attention) < 0.7  # an untrained table has no order


def test_probing_averages_over_sampled_words(no_position):
  m = no_position
  a = identical_word_probing(m.encoder, m.variables, m.tokens, length=8, num_words=7,
                             batch_size=3, seed=4)
  assert len(set(a.words.tolist())) == 7 and a.words.min() >= 6
  runner = layer_runner(m.encoder, 0)
  ids = identical_word_ids(a.words, 8, m.tokens)
  direct = np.asarray(runner(m.variables, ids).probs).mean(axis=(0, 1))
  np.testing.assert_allclose(a.attention, direct, rtol=1e-5)


def test_positional_term_closed_forms():
  ape = model("learned_ape")
  pos = positional_attention(ape.encoder, ape.variables, length=16)
  params = layout_for(ape.variables["params"], False)
  p = params["position"]["position_embedding"][:16]
  wq = params["layers_0"]["attention"]["query"]["kernel"]
  wk = params["layers_0"]["attention"]["key"]["kernel"]
  expected = np.einsum("id,dhk,jc,chk->hij", p, wq, p, wk) / math.sqrt(8)
  assert pos.kind == "input"
  np.testing.assert_allclose(pos.values, expected, rtol=1e-4, atol=1e-8)

  alibi = model("alibi")
  pos = positional_attention(alibi.encoder, alibi.variables, length=10)
  distance = np.abs(np.arange(10)[:, None] - np.arange(10)[None, :])
  np.testing.assert_allclose(pos.values, -np.asarray(alibi_slopes(4))[:, None, None] * distance,
                             rtol=1e-6)
  for name in ("rope", "shaw", "none"):
    m = model(name)
    pos = positional_attention(m.encoder, m.variables, length=10)
    assert pos.kind == "none" and not pos.values.any()
  tupe = model("tupe_a")
  pos = positional_attention(tupe.encoder, tupe.variables, length=10)
  assert pos.kind == "term" and pos.values.shape == (4, 10, 10)
  # TUPE's reset: row 0 is theta_1 and column 0 (below it) theta_2, per head.
  assert np.ptp(pos.values[:, 0, :], axis=1).max() < 1e-6
  assert np.ptp(pos.values[:, 1:, 0], axis=1).max() < 1e-6


def test_position_vectors():
  ape = model("learned_ape")
  vec = position_vectors(ape.encoder, ape.variables, length=20)
  np.testing.assert_array_equal(vec.vectors,
                                ape.variables["params"]["position"]["position_embedding"][:20])
  shaw = model("shaw")
  vec = position_vectors(shaw.encoder, shaw.variables)
  assert vec.axis == "offset" and vec.positions.tolist() == list(range(-16, 17))
  assert vec.vectors.shape == (33, 8)
  alibi = model("alibi")
  assert position_vectors(alibi.encoder, alibi.variables) is None


def test_tokens_and_errors(tmp_path):
  vocab = tmp_path / "vocab.txt"
  vocab.write_text("[PAD]\n[unused0]\n[CLS]\n[SEP]\nthe\n##s\ncat\n")
  tokens = wordpiece_tokens(vocab)
  assert (tokens.cls_id, tokens.sep_id, tokens.word_ids.tolist()) == (2, 3, [4, 6])
  ids = identical_word_ids([4, 6], 5, tokens)
  assert ids.tolist() == [[2, 4, 4, 4, 3], [2, 6, 6, 6, 3]]
  assert bundled_tokens(10).word_ids.tolist() == [6, 7, 8, 9]
  encoder = BertEncoder(model_config(SMALL))  # the checks come before any computation
  with pytest.raises(AnalysisError, match="layer"):
    layer_runner(encoder, 2)
  with pytest.raises(AnalysisError, match="max_len"):
    identical_word_probing(encoder, None, tokens, length=17)
  linformer = BertEncoder(model_config(SMALL | {"attention": "linformer", "linformer_k": 4}))
  with pytest.raises(AnalysisError, match="linformer"):
    layer_runner(linformer, 0)


def test_pretrained_minilm_probing():
  from posenc_jax.analysis import from_hf
  m = from_hf(minilm_dir())
  assert (m.tokens.cls_id, m.tokens.sep_id) == (101, 102)
  probe = identical_word_probing(m.encoder, m.variables, m.tokens, length=32, num_words=8)
  values = indicators(probe.attention, probe.special_positions)
  # A trained BERT: local attention, better than an untrained table (about 0.5) and
  # more translation invariant without the special tokens than with them.
  assert values["monotonicity_first_k"] < 0.3
  assert values["translation_invariance_without_cls"] < values["translation_invariance_with_cls"]
