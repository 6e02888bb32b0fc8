"""The papers' facts on the library's modules: TUPE eq. 6, DIET Theorems 1 and 2."""

import math

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax import MultiHeadAttention, QKShift, attend, build_scheme
from posenc_jax.analysis import logit_ranks, random_batch, term_logits
from posenc_jax.schemes.tupe import UntiedPositions
from tests.conftest import random_params
from tests.test_analysis_rank import LENGTH as RANK_LENGTH
from tests.test_analysis_rank import random_model

L, D_MODEL, H, D_HEAD = 24, 48, 2, 8


def _projections(attn, params, x):
  """The q and k ``[B, L, H, D]`` that the library's ``attn`` forms from ``x`` ``[B, L, d]``."""
  _, state = attn.apply(params, x, capture_intermediates=True, mutable=["intermediates"])
  captured = state["intermediates"]
  return captured["query"]["__call__"][0], captured["key"]["__call__"][0]


def test_tupe_eq6_input_added_attention_is_four_terms():
  """Eq. 6: with ``x = w + p`` (learned APE's input term), the logits ``c (x W_Q)(x W_K)^T``
  of the library's attention are the word-word, word-position, position-word and
  position-position correlations, each from the same attention's projections of ``w`` or
  ``p`` alone (its projection biases are zero at init; eq. 6 has none). The QKShift term
  runs the sum as attention."""
  kw, ka, kp, kv = jax.random.split(jax.random.key(0), 4)
  ape = build_scheme({"name": "learned_ape"}, num_layers=1, num_heads=H, head_dim=D_HEAD,
                     d_model=D_MODEL, max_len=L)
  terms = ape.apply(random_params(ape.init(ka, L)), L)
  w = jax.random.normal(kw, (1, L, D_MODEL))
  p = terms.embedding.value[None]
  attn = MultiHeadAttention(num_heads=H, head_dim=D_HEAD)
  params = attn.init(kp, w)
  c = 1 / math.sqrt(D_HEAD)
  added = term_logits(*_projections(attn, params, terms.embed(w)), [], c)
  (q_w, k_w), (q_p, k_p) = _projections(attn, params, w), _projections(attn, params, p)
  four = [term_logits(q, k, [], c) for q in (q_w, q_p) for k in (k_w, k_p)]
  np.testing.assert_allclose(added, sum(four), rtol=1e-5, atol=1e-6)
  assert min(float(jnp.abs(t).max()) for t in four) > 1e-3  # no term is trivially zero
  # As attention: word-only q/k plus the shift by the projected positions.
  v = jax.random.normal(kv, (1, L, H, D_HEAD))
  via_term = attend(q_w, k_w, v, [QKShift(q_p[0], k_p[0])])
  direct = attend(q_w + q_p, k_w + k_p, v)
  np.testing.assert_allclose(via_term, direct, rtol=1e-5, atol=1e-5)


def test_tupe_a_positional_term_is_eq6_position_term_untied():
  """TUPE-A keeps eq. 6's position-position term with projections of its own: the library's
  TUPE-A^tie-cls term is what an attention with query/key ``U_Q, U_K`` (TUPE's, with their
  biases) forms from ``LN(p)``, at TUPE's scale ``1 / sqrt(2 D)``."""
  tupe = build_scheme({"name": "tupe_a", "untie_cls": False}, num_layers=1, num_heads=H,
                      head_dim=D_HEAD, d_model=D_MODEL, max_len=L)
  params = random_params(tupe.init(jax.random.key(1), L), seed=1)
  (term,) = tupe.apply(params, L).for_layer(0)
  positions = params["params"]["positions"]
  normed = UntiedPositions(H, D_HEAD, D_MODEL, L).apply(
      {"params": positions}, method=lambda m: m.norm(m.position_embedding))
  attn = MultiHeadAttention(num_heads=H, head_dim=D_HEAD)
  shapes = attn.init(jax.random.key(2), normed[None])["params"]
  untied = {**shapes, "query": positions["pos_query"], "key": positions["pos_key"]}
  q, k = _projections(attn, {"params": untied}, normed[None])
  expected = term_logits(q, k, [], 1 / math.sqrt(2 * D_HEAD))
  np.testing.assert_allclose(term.logits(None, 1.0), expected, rtol=1e-5, atol=1e-4)


def test_diet_theorem1_input_ape_logits_have_rank_at_most_dh():
  """A BERT layer with learned APE: each head's logits on a batch have rank <= d_h < L (the
  positions enter the layer through its input, projected by W_Q, W_K); random inputs
  reach d_h."""
  model = random_model({"name": "learned_ape"})
  ids = random_batch(model.tokens, 3, RANK_LENGTH, seed=1)
  d_h = model.config.dim_per_head
  assert d_h < RANK_LENGTH
  ranks = logit_ranks(model.encoder, model.variables, ids)  # [B, H]
  assert ranks.shape == (3, model.config.num_heads) and (ranks == d_h).all()


def test_diet_theorem1_diet_abs_reaches_dh_plus_dp():
  """A BERT layer with DIET-ABS of rank d_p: content (rank <= d_h) plus P_Q P_K^T (rank
  d_p) has rank <= d_h + d_p < L, and random inputs reach it: beyond input APE's cap."""
  d_p = 8
  model = random_model({"name": "diet_abs", "rank": d_p})
  ids = random_batch(model.tokens, 3, RANK_LENGTH, seed=1)
  d_h = model.config.dim_per_head
  assert d_h + d_p < RANK_LENGTH
  ranks = logit_ranks(model.encoder, model.variables, ids)  # [B, H]
  assert ranks.shape == (3, model.config.num_heads) and (ranks == d_h + d_p).all()


def test_diet_theorem2_equal_gradients_for_tokens_and_positions():
  """With x = w + p at the input, dLoss/dw equals dLoss/dp (the library's learned APE)."""
  ape = build_scheme({"name": "learned_ape"}, num_layers=1, num_heads=2, head_dim=4,
                     d_model=8, max_len=L)
  attn = MultiHeadAttention(num_heads=2, head_dim=4)
  words = jax.random.normal(jax.random.key(4), (1, L, 8))
  ape_params = ape.init(jax.random.key(5), L)
  attn_params = attn.init(jax.random.key(6), words)

  def loss(words, ape_params):
    x = ape.apply(ape_params, L).embed(words)
    return jnp.sum(jnp.tanh(attn.apply(attn_params, x)))

  g_words, g_ape = jax.grad(loss, argnums=(0, 1))(words, ape_params)
  g_table = g_ape["params"]["position_embedding"].value
  np.testing.assert_allclose(g_words[0], g_table[:L], rtol=1e-6)
  assert float(jnp.abs(g_words).max()) > 0
