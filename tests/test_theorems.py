"""The papers' facts: TUPE eq. 6, DIET Theorems 1 and 2."""

import math

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax import MultiHeadAttention, QKShift, attend, build_scheme
from tests.conftest import random_params

L, D_MODEL, D_HEAD = 24, 48, 8


def _rank(matrix, rtol=1e-6):
  s = np.linalg.svd(np.asarray(matrix, np.float64), compute_uv=False)
  return int(np.sum(s > rtol * s[0]))


def test_tupe_eq6_input_added_attention_is_four_terms():
  """((w+p)W_Q)((w+p)W_K)^T = ww + wp + pw + pp, and the library's QKShift term runs it."""
  kw, kp, kq, kk, kv = jax.random.split(jax.random.key(0), 5)
  w = jax.random.normal(kw, (1, L, D_MODEL))
  p = jax.random.normal(kp, (L, D_MODEL))
  w_q = jax.random.normal(kq, (D_MODEL, 1, D_HEAD)) / math.sqrt(D_MODEL)
  w_k = jax.random.normal(kk, (D_MODEL, 1, D_HEAD)) / math.sqrt(D_MODEL)
  proj = lambda x, m: jnp.einsum("...ld,dhk->...lhk", x, m)  # noqa: E731
  added = jnp.einsum("bihk,bjhk->bij", proj(w + p, w_q), proj(w + p, w_k))
  four = (jnp.einsum("bihk,bjhk->bij", proj(w, w_q), proj(w, w_k))
          + jnp.einsum("bihk,jhk->bij", proj(w, w_q), proj(p, w_k))
          + jnp.einsum("ihk,bjhk->bij", proj(p, w_q), proj(w, w_k))
          + jnp.einsum("ihk,jhk->ij", proj(p, w_q), proj(p, w_k))[None])
  np.testing.assert_allclose(added, four, rtol=1e-4, atol=1e-4)
  # As attention: word-only q/k plus the shift by the projected positions.
  v = jax.random.normal(kv, (1, L, 1, D_HEAD))
  via_term = attend(proj(w, w_q), proj(w, w_k), v, [QKShift(proj(p, w_q), proj(p, w_k))])
  direct = attend(proj(w + p, w_q), proj(w + p, w_k), v)
  np.testing.assert_allclose(via_term, direct, rtol=1e-5, atol=1e-5)


def _content_and_positions(seed):
  kx, kp, kq, kk = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(kx, (L, D_MODEL))
  p = jax.random.normal(kp, (L, D_MODEL))
  w_q = jax.random.normal(kq, (D_MODEL, D_HEAD))
  w_k = jax.random.normal(kk, (D_MODEL, D_HEAD))
  return x, p, w_q, w_k


def test_diet_theorem1_input_added_logits_have_rank_at_most_dh():
  x, p, w_q, w_k = _content_and_positions(1)
  logits = (x + p) @ w_q @ w_k.T @ (x + p).T
  assert _rank(logits) == D_HEAD  # <= d_h, and generic inputs reach it


def test_diet_theorem1_diet_abs_reaches_dh_plus_dp():
  """Content logits plus the library's DIET-ABS term: rank min(d_h + d_p, L)."""
  x, _, w_q, w_k = _content_and_positions(2)
  content = (x @ w_q) @ (x @ w_k).T
  for rank in (5, 12, 20):
    scheme = build_scheme({"name": "diet_abs", "rank": rank}, num_layers=1, num_heads=1,
                          head_dim=D_HEAD, d_model=D_MODEL, max_len=L)
    params = random_params(scheme.init(jax.random.key(3), L), seed=rank)
    term = scheme.apply(params, L).for_layer(0)[0]
    positional = term.logits(None, 1.0)[0, 0]
    assert _rank(positional) == rank
    assert _rank(content + positional) == min(D_HEAD + rank, L)


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
