"""Closed-form values and properties of each scheme's terms."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posenc_jax import attend, build_scheme
from posenc_jax.schemes import alibi_slopes, relative_position_bucket
from posenc_jax.schemes.absolute import sinusoid
from tests.conftest import (DIMS, LENGTH, SCHEME_CONFIGS, attention_float64, init_scheme,
                            padding_mask, qkv, segment_ids)

# Queries only set the length for length-free terms (Toeplitz); no term here reads their values.
Q = jnp.zeros((1, LENGTH, DIMS["num_heads"], DIMS["head_dim"]))


def bias_of(name, layer=0, **dims):
  """The first term of a scheme, materialised: ``[B|1, H, L, L]``."""
  _, params, st = init_scheme(SCHEME_CONFIGS[name], **dims)
  term = st.for_layer(layer)[0]
  return np.asarray(term.logits(Q, 1.0)), params


def assert_toeplitz(matrix, atol=0.0):
  """Constant along every diagonal of the last two axes (exactly, unless ``atol``)."""
  n = matrix.shape[-1]
  for offset in range(-n + 1, n):
    diag = np.diagonal(matrix, offset, axis1=-2, axis2=-1)
    np.testing.assert_allclose(diag, np.broadcast_to(diag[..., :1], diag.shape), rtol=0,
                               atol=atol)


@pytest.mark.parametrize("name", ["diet_rel", "diet_rel_clip_head", "t5", "t5_causal_per_layer",
                                  "alibi", "alibi_causal"])
def test_relative_biases_are_toeplitz(name):
  bias, _ = bias_of(name)
  assert bias.shape[-2:] == (LENGTH, LENGTH)
  assert_toeplitz(bias)
  assert np.ptp(bias) > 0  # not trivially constant


def test_diet_rel_reads_the_table_at_clipped_i_minus_j():
  bias, params = bias_of("diet_rel_clip_head", layer=1)
  table = np.asarray(params["params"]["relative_bias"].value)[1, 0]  # [2t+1], t = 3
  for i, j in [(0, 0), (5, 3), (3, 5), (9, 0), (0, 9), (4, 1), (1, 4)]:
    assert bias[0, 0, i, j] == table[np.clip(i - j, -3, 3) + 3]


# (offset r = j - i, bidirectional bucket, causal bucket) for 32 buckets, max distance 128,
# worked out by hand from the formula. Bidirectional: 16 per direction, exact below 8,
# then 8 + floor(log(|r|/8) / log(16) * 8), capped at 15; r > 0 adds 16. Causal: n = max(-r, 0),
# exact below 16, then 16 + floor(log(n/16) / log(8) * 16), capped at 31.
T5_BUCKETS = [
    (0, 0, 0), (-1, 1, 1), (1, 17, 0), (-7, 7, 7), (7, 23, 0), (-8, 8, 8), (8, 24, 0),
    (-12, 9, 12), (-15, 9, 15), (-16, 10, 16), (16, 26, 0), (-31, 11, 21), (-32, 12, 21),
    (-63, 13, 26), (-64, 14, 26), (-127, 15, 31), (-128, 15, 31), (128, 31, 0),
    (-1000, 15, 31), (1000, 31, 0),
]


@pytest.mark.parametrize("r,bidirectional_bucket,causal_bucket", T5_BUCKETS)
def test_t5_bucket_ids(r, bidirectional_bucket, causal_bucket):
  r = jnp.array(r)
  assert int(relative_position_bucket(r, bidirectional=True)) == bidirectional_bucket
  assert int(relative_position_bucket(r, bidirectional=False)) == causal_bucket


def test_alibi_slopes_and_values():
  np.testing.assert_allclose(alibi_slopes(8), [2.0 ** -k for k in range(1, 9)], rtol=1e-7)
  np.testing.assert_allclose(alibi_slopes(4), [0.25, 1 / 16, 1 / 64, 1 / 256], rtol=1e-7)
  bias, _ = bias_of("alibi")
  assert bias[0, 0, 2, 7] == pytest.approx(-0.25 * 5)
  assert bias[0, 0, 7, 2] == pytest.approx(-0.25 * 5)
  causal, _ = bias_of("alibi_causal")
  assert causal[0, 1, 7, 2] == pytest.approx(-(2.0 ** -4) * 5)
  assert causal[0, 1, 2, 7] == 0.0


def test_rope_logits_depend_only_on_offset():
  """q at i and k at j give the same logit as q at i+s and k at j+s."""
  _, _, st = init_scheme(SCHEME_CONFIGS["rope"], length=12)
  rotation = st.for_layer(0)[0]
  vec_q, vec_k = jax.random.normal(jax.random.key(3), (2, 8))
  q = jnp.broadcast_to(vec_q, (1, 12, 1, 8))
  k = jnp.broadcast_to(vec_k, (1, 12, 1, 8))
  rq, rk = rotation.transform_qk(q, k)
  logits = np.asarray(jnp.einsum("bihd,bjhd->ij", rq, rk))
  assert_toeplitz(logits, atol=1e-5)  # cos/sin of large angles round differently
  assert np.ptp(logits) > 1e-1
  # Rotation keeps norms.
  np.testing.assert_allclose(jnp.linalg.norm(rq, axis=-1), jnp.linalg.norm(q, axis=-1), rtol=1e-5)


def test_rope_rotates_pairs_by_i_theta():
  _, _, st = init_scheme(SCHEME_CONFIGS["rope"])
  q = jnp.zeros((1, LENGTH, 1, 8)).at[..., 2].set(1.0)  # unit vector in pair k = 1
  rq, _ = st.for_layer(0)[0].transform_qk(q, q)
  theta = 10000.0 ** (-2 / 8)
  for i in (0, 1, 5):
    np.testing.assert_allclose(rq[0, i, 0, 2:4], [math.cos(i * theta), math.sin(i * theta)],
                               atol=1e-6)


def test_sinusoid_closed_form():
  freqs = 10000.0 ** (-jnp.arange(0, 6, 2) / 6)
  table = np.asarray(sinusoid(jnp.array([0, 3, -2]), freqs))
  assert table.shape == (3, 6)
  np.testing.assert_allclose(table[0], [0, 1, 0, 1, 0, 1], atol=1e-7)
  np.testing.assert_allclose(table[1, 2:4], [math.sin(3 * 10000 ** (-2 / 6)),
                                             math.cos(3 * 10000 ** (-2 / 6))], rtol=1e-6)
  np.testing.assert_allclose(table[2, 0:2], [math.sin(-2), math.cos(-2)], rtol=1e-6)


def test_sinusoidal_ape_is_the_input_term():
  _, _, st = init_scheme(SCHEME_CONFIGS["sinusoidal_ape"])
  x = jnp.zeros((2, LENGTH, DIMS["d_model"]))
  np.testing.assert_allclose(st.embed(x)[1, 4, :2], [math.sin(4), math.cos(4)], rtol=1e-6)
  assert not st.terms


def vaswani_table(positions, d_model, frequencies=None):
  """Vaswani et al. (sec. 3.5) in float64, one entry at a time: ``PE(pos, 2i) = sin(pos w_i)``,
  ``PE(pos, 2i + 1) = cos(pos w_i)`` with ``w_i = 1 / 10000^(2i / d_model)`` (the spec's
  interleaved layout), or the given ``[d_model / 2]`` frequencies. Returns ``[N, d_model]``."""
  if frequencies is None:
    frequencies = [1.0 / 10000.0 ** (2 * i / d_model) for i in range(d_model // 2)]
  table = np.zeros((len(positions), d_model))
  for n, pos in enumerate(positions):
    for i, w in enumerate(frequencies):
      table[n, 2 * i] = math.sin(pos * float(w))
      table[n, 2 * i + 1] = math.cos(pos * float(w))
  return table


# float32 rounding of an angle pos * w_i (< 16 rad here: about 1e-6) and of sin/cos.
SINUSOID_ATOL = 4e-6


def test_sinusoidal_ape_equals_the_float64_table_at_every_frequency():
  _, _, st = init_scheme(SCHEME_CONFIGS["sinusoidal_ape"], length=16)
  got = np.asarray(st.embed(jnp.zeros((1, 16, DIMS["d_model"])))[0])
  np.testing.assert_allclose(got, vaswani_table(range(16), DIMS["d_model"]), rtol=0,
                             atol=SINUSOID_ATOL)


@pytest.mark.parametrize("learnable", [False, True])
def test_sinusoidal_ape_amplitude_scales_the_float64_table(learnable):
  """``amplitude`` multiplies Vaswani's table (fixed or at its initial frequencies)."""
  d = DIMS["d_model"]
  amplitude = 1 / np.sqrt(d)
  module = build_scheme({"name": "sinusoidal_ape", "learnable": learnable,
                         "amplitude": float(amplitude)}, **DIMS)
  variables = module.init(jax.random.key(0), 16)
  got = np.asarray(module.apply(variables, 16).embed(jnp.zeros((1, 16, d)))[0])
  np.testing.assert_allclose(got, amplitude * vaswani_table(range(16), d), rtol=0,
                             atol=amplitude * SINUSOID_ATOL)


def test_learnable_sinusoidal_ape_starts_at_the_table_and_reads_its_frequencies():
  """At init (Wang et al.: the fixed frequencies, trainable) the embedding is Vaswani's table;
  with other frequencies it is the same formula at those."""
  module = build_scheme(SCHEME_CONFIGS["sinusoidal_ape_learnable"], **DIMS)
  variables = module.init(jax.random.key(0), 16)
  freqs = np.asarray(variables["params"]["frequencies"].value, np.float64)
  d = DIMS["d_model"]
  np.testing.assert_allclose(freqs, [10000.0 ** (-2 * i / d) for i in range(d // 2)], rtol=1e-6)
  x = jnp.zeros((1, 16, d))
  np.testing.assert_allclose(module.apply(variables, 16).embed(x)[0], vaswani_table(range(16), d),
                             rtol=0, atol=SINUSOID_ATOL)
  trained = jax.random.uniform(jax.random.key(1), (d // 2,), minval=0.01, maxval=1.0)
  variables = {"params": {"frequencies": variables["params"]["frequencies"].replace_boxed(
      trained)}}
  np.testing.assert_allclose(module.apply(variables, 16).embed(x)[0],
                             vaswani_table(range(16), d, np.asarray(trained)),
                             rtol=0, atol=SINUSOID_ATOL)


@pytest.mark.parametrize("name", ["shaw", "sinusoidal_rpe"])
def test_shaw_key_term_against_loop(name):
  """``T[b,h,i,j] = c q_i . a_{clip(j - i)}``, computed one entry at a time."""
  _, _, st = init_scheme(SCHEME_CONFIGS[name])
  term = st.for_layer(1)[0]
  q, _, _ = qkv()
  got = np.asarray(term.logits(q, 0.5))
  table = np.asarray(term.key_table)
  clip = term.clip
  for b, h, i, j in [(0, 0, 0, 9), (1, 3, 9, 0), (0, 2, 4, 5), (1, 1, 6, 6), (0, 1, 2, 8)]:
    expected = 0.5 * np.dot(np.asarray(q[b, i, h]), table[np.clip(j - i, -clip, clip) + clip])
    np.testing.assert_allclose(got[b, h, i, j], expected, rtol=1e-5)


def test_shaw_value_term_against_loop():
  _, _, st = init_scheme(SCHEME_CONFIGS["shaw_value"])
  term = st.for_layer(0)[0]
  probs = jax.nn.softmax(jax.random.normal(jax.random.key(2), (2, 4, LENGTH, LENGTH)), -1)
  got = np.asarray(term.value_output(probs))
  table = np.asarray(term.value_table)
  for b, h, i in [(0, 0, 0), (1, 2, 5), (0, 3, 9)]:
    expected = sum(float(probs[b, h, i, j]) * table[np.clip(j - i, -3, 3) + 3]
                   for j in range(LENGTH))
    np.testing.assert_allclose(got[b, i, h], expected, rtol=1e-5, atol=1e-6)


def tupe_reference(params, length, relative):
  """TUPE-A/R's positional term written directly from eqs. 9-11 (no factoring), in float64
  numpy: the reference does not depend on how XLA compiles the float32 path."""
  p = jax.tree.map(lambda x: np.asarray(x, np.float64), nn.meta.unbox(params["params"]))
  positions = p["positions"]
  table = positions["position_embedding"][:length]

  def ln(x):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return ((x - mean) / np.sqrt(var + 1e-5) * positions["norm"]["scale"]
            + positions["norm"]["bias"])

  def proj(x, name):
    return np.einsum("nd,dhk->nhk", ln(x), positions[name]["kernel"]) + positions[name]["bias"]

  scale = 1 / math.sqrt(2 * DIMS["head_dim"])
  v = np.einsum("ihk,jhk->hij", proj(table, "pos_query"), proj(table, "pos_key")) * scale
  if relative:
    buckets = np.asarray(relative_position_bucket(
        jnp.arange(length)[None] - jnp.arange(length)[:, None], num_buckets=8, max_distance=6))
    v = v + p["relative_bias"][:, buckets]
  cls = p["cls_positions"]
  theta = np.sum(proj(cls, "pos_query") * proj(cls, "pos_key"), -1) * scale  # [2, H]
  v[:, :, 0] = theta[1][:, None]  # column first, then the row (reference code)
  v[:, 0, :] = theta[0][:, None]
  return v


@pytest.mark.parametrize("name", ["tupe_a", "tupe_r"])
def test_tupe_term_matches_equations(name):
  _, params, st = init_scheme(SCHEME_CONFIGS[name])
  total = sum(t.logits(Q, 1.0) for t in st.for_layer(0))[0]
  expected = tupe_reference(params, LENGTH, relative=name == "tupe_r")
  np.testing.assert_allclose(total, expected, rtol=1e-5, atol=1e-5)
  assert st.content_scale == pytest.approx(1 / math.sqrt(16))


@pytest.mark.parametrize("name", ["tupe_a", "tupe_r"])
def test_tupe_reset_row_and_column(name):
  _, _, st = init_scheme(SCHEME_CONFIGS[name])
  v = np.asarray(sum(t.logits(Q, 1.0) for t in st.for_layer(0))[0])
  for h in range(4):
    theta_1, theta_2 = v[h, 0, 0], v[h, 1, 0]
    np.testing.assert_allclose(v[h, 0, :], theta_1, rtol=1e-6)  # row 0, [0, 0] included
    np.testing.assert_allclose(v[h, 1:, 0], theta_2, rtol=1e-6)
    assert theta_1 != theta_2
    assert np.ptp(v[h, 1:, 1:]) > 0
  tied, _ = bias_of("tupe_a_tie_cls")
  assert np.ptp(tied[0, 0, 0, :]) > 0  # no reset: row 0 varies


def test_bert_ad_is_the_four_term_sum():
  """BERT-A^d: (q + a)(k + b) / sqrt(4D) = the four word/position terms."""
  _, _, st = init_scheme(SCHEME_CONFIGS["bert_ad"])
  shift = st.for_layer(0)[0]
  q, k, v = qkv()
  a, b = shift.q_shift, shift.k_shift
  c = 1 / math.sqrt(4 * 8)
  assert st.content_scale == pytest.approx(c)
  logits = c * (jnp.einsum("bihd,bjhd->bhij", q, k) + jnp.einsum("bihd,jhd->bhij", q, b)
                + jnp.einsum("ihd,bjhd->bhij", a, k) + jnp.einsum("ihd,jhd->hij", a, b)[None])
  expected = jnp.einsum("bhij,bjhd->bihd", jax.nn.softmax(logits, -1), v)
  np.testing.assert_allclose(attend(q, k, v, [shift], scale=c), expected, rtol=1e-5, atol=1e-5)


def test_bert_ad_equals_float64_transcription():
  """BERT-A^d from its parameters in float64 (TUPE's ablation, spec): q_i + LN(p_i) U_Q and
  k_j + LN(p_j) U_K (U with bias, LayerNorm eps 1e-5, shared by the layers), logits over
  sqrt(4 D), softmax, values."""
  _, params, st = init_scheme(SCHEME_CONFIGS["bert_ad"])
  p = jax.tree.map(lambda x: np.asarray(x, np.float64), nn.unbox(params)["params"]["positions"])
  table = p["position_embedding"][:LENGTH]  # [L, d]
  mean, var = table.mean(-1, keepdims=True), table.var(-1, keepdims=True)
  normed = (table - mean) / np.sqrt(var + 1e-5) * p["norm"]["scale"] + p["norm"]["bias"]
  a, b = (np.einsum("id,dhk->ihk", normed, p[name]["kernel"]) + p[name]["bias"]
          for name in ("pos_query", "pos_key"))  # [L, H, D]
  q, k, v = qkv()
  scale = 1 / math.sqrt(4 * DIMS["head_dim"])
  expected = attention_float64(np.asarray(q) + a, np.asarray(k) + b, v, scale,
                               keep=padding_mask()[:, None, None])
  assert st.content_scale == pytest.approx(scale)
  for layer in range(DIMS["num_layers"]):
    shift = st.for_layer(layer)[0]
    np.testing.assert_allclose(shift.q_shift, a, rtol=1e-5, atol=1e-5)  # [L, H, D]
    np.testing.assert_allclose(shift.k_shift, b, rtol=1e-5, atol=1e-5)
    got = attend(q, k, v, [shift], mask=padding_mask(), scale=st.content_scale,
                 route="reference")
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_segment_per_head_reads_the_table():
  _, params, st = init_scheme(SCHEME_CONFIGS["segment_per_head"])
  bias = np.asarray(st.for_layer(1)[0].logits(Q, 1.0))  # [B, H, L, L]
  table = np.asarray(params["params"]["segment_bias"].value)[1]  # [H, 3, 3]
  seg = np.asarray(segment_ids())
  for b, h, i, j in [(0, 0, 0, 9), (1, 2, 1, 6), (1, 3, 8, 2), (0, 1, 4, 5)]:
    np.testing.assert_allclose(bias[b, h, i, j], table[h, seg[b, i], seg[b, j]], rtol=1e-6)


def test_segment_input_adds_the_token_type_row():
  _, params, st = init_scheme(SCHEME_CONFIGS["segment_input"])
  table = params["params"]["segment_embedding"].value
  x = jnp.zeros((2, LENGTH, DIMS["d_model"]))
  out = st.embed(x)
  np.testing.assert_allclose(out[1, 2], table[0], rtol=1e-6)
  np.testing.assert_allclose(out[1, 3], table[1], rtol=1e-6)


def test_learned_ape_adds_table_rows():
  _, params, st = init_scheme(SCHEME_CONFIGS["learned_ape"])
  table = params["params"]["position_embedding"].value
  np.testing.assert_allclose(st.embed(jnp.zeros((1, LENGTH, 32)))[0], table[:LENGTH], rtol=1e-6)


@pytest.mark.parametrize("init_std", [0.02, 0.5, 0.0])
def test_learned_ape_table_starts_at_init_std(init_std):
  module = build_scheme({"name": "learned_ape", "init_std": init_std}, **DIMS)
  params = module.init(jax.random.key(0), LENGTH, segment_ids())
  table = np.asarray(params["params"]["position_embedding"].value)
  assert table.std() == pytest.approx(init_std, rel=0.05, abs=0.0)


def test_every_scheme_jits_and_differentiates(scheme_name):
  """jit + grad through scheme and attention; finite values and some gradient signal.

  The embedding enters through fixed random weights, not ``sum(x ** 2)``: a sinusoid row's
  ``sum(sin^2 + cos^2)`` does not depend on its frequencies, so the learnable sinusoids'
  gradient would be zero but for rounding."""
  module, params, _ = init_scheme(SCHEME_CONFIGS[scheme_name])
  q, k, v = qkv()
  seg = segment_ids()
  weights = jax.random.normal(jax.random.key(1), (2, LENGTH, DIMS["d_model"]))

  @jax.jit
  def loss(params, q):
    st = module.apply(params, LENGTH, seg)
    x = st.embed(jnp.zeros((2, LENGTH, DIMS["d_model"])))
    total = jnp.sum(x * weights)
    for layer in range(DIMS["num_layers"]):
      total += jnp.sum(attend(q, k, v, st.for_layer(layer), scale=st.content_scale) ** 2)
    return total

  value, (g_params, g_q) = jax.value_and_grad(loss, argnums=(0, 1))(params, q)
  assert np.isfinite(value)
  for g in jax.tree.leaves((g_params, g_q)):
    assert np.all(np.isfinite(g))
  if jax.tree.leaves(g_params):
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(g_params)) > 0
