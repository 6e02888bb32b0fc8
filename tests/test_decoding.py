"""Incremental decoding: query slicing of every term form, the attention KV cache,
greedy and beam search (beam 1 = greedy, sorted scores, a hand-checked case)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

from posenc_jax import MultiHeadAttention, attend
from posenc_jax.models.decoding import (beam_search, decoder_step, greedy_search,
                                        greedy_translate, init_cache, length_penalty,
                                        repeat_beams, translate)
from posenc_jax.models.transformer import shift_right
from posenc_jax.schemes.diet import ClippedOffsets
from posenc_jax.schemes.t5 import BucketedOffsets
from posenc_jax.terms import (Bias, Factored, InputEmbedding, QKShift, QueryRelative, Rotation, Term,
                              Toeplitz)
from tests.conftest import BATCH, DIMS, LENGTH, SCHEME_CONFIGS, init_scheme, padding_mask, qkv
from tests.test_transformer import init_model, inputs

TOL = dict(rtol=1e-5, atol=1e-5)
# Cached steps reduce over differently shaped (fused) arrays than the full pass;
# with N(0, 1) scheme parameters the logits are large and rounding grows a little.
STEP_TOL = dict(rtol=1e-4, atol=1e-5)
H, D = DIMS["num_heads"], DIMS["head_dim"]
START, SIZE = 3, 4  # the query rows [3, 7) of LENGTH = 10


def normal(seed, shape):
  return jax.random.normal(jax.random.key(seed), shape)


# --- slice_queries of each term form -------------------------------------------------------

def rows(x, axis=-2):
  return jax.lax.slice_in_dim(x, START, START + SIZE, axis=axis % x.ndim)


@pytest.mark.parametrize("term", [
    Bias(normal(0, (H, LENGTH, LENGTH))),
    Bias(normal(0, (BATCH, H, LENGTH, LENGTH))),
    Bias(normal(0, (1, H, 1, LENGTH))),  # broadcast over queries
    Factored(normal(1, (LENGTH, H, 3)), normal(2, (LENGTH, 1, 3))),
    Factored(normal(1, (BATCH, LENGTH, H, 3)), normal(2, (BATCH, LENGTH, H, 3))),
    Factored(normal(1, (LENGTH, H, 3)), normal(2, (5, H, 3))),  # Linformer: 5 key rows
    Toeplitz(normal(4, (H, 7)), ClippedOffsets(3)).with_key_length(LENGTH),
    Toeplitz(normal(4, (1, 8)), BucketedOffsets(5, bidirectional=False), zero_first=True,
             k_len=LENGTH),
], ids=["bias", "bias_batch", "bias_broadcast", "factored", "factored_batch", "factored_lk",
        "toeplitz", "toeplitz_reset"])
def test_sliced_logits_are_rows_of_full_logits(term):
  q = normal(3, (BATCH, LENGTH, H, D))
  full = term.logits(q, 0.5)
  full = jnp.broadcast_to(full, full.shape[:2] + (LENGTH, full.shape[-1]))
  sliced = term.slice_queries(START, SIZE).logits(rows(q, 1), 0.5)
  sliced = jnp.broadcast_to(sliced, full.shape[:2] + (SIZE, full.shape[-1]))
  np.testing.assert_allclose(sliced, rows(full), **TOL)
  fused = term.slice_queries(START, SIZE).fused(rows(q, 1), 0.5)
  if fused.q_extra is not None:  # factored: the fused route's q side is sliced too
    np.testing.assert_allclose(fused.q_extra, rows(term.fused(q, 0.5).q_extra, -3))


@pytest.mark.parametrize("value", [False, True])
@pytest.mark.parametrize("heads_table", [False, True])
def test_query_relative_slice_has_absolute_query_positions(value, heads_table):
  shape = (H, 5, D) if heads_table else (5, D)  # clip 2: offsets beyond +-2 share rows
  term = QueryRelative(normal(0, shape), normal(1, shape) if value else None, clip=2)
  q = normal(3, (BATCH, LENGTH, H, D))
  sliced = term.slice_queries(START, SIZE).with_key_length(LENGTH)
  full_logits = term.logits(q, 0.5)
  logits = sliced.logits(rows(q, 1), 0.5)
  assert logits.shape == (BATCH, H, SIZE, LENGTH)
  np.testing.assert_allclose(logits, rows(full_logits), **TOL)
  if value:
    probs = jax.nn.softmax(full_logits, axis=-1)
    np.testing.assert_allclose(sliced.value_output(rows(probs)),
                               rows(term.value_output(probs), 1), **TOL)
  # Slicing twice adds the offsets.
  twice = term.slice_queries(1, 6).slice_queries(START - 1, SIZE).with_key_length(LENGTH)
  np.testing.assert_allclose(twice.logits(rows(q, 1), 0.5), logits, **TOL)


@pytest.mark.parametrize("term", [
    Rotation(normal(0, (LENGTH, D // 2)), normal(1, (LENGTH, D // 2))),
    QKShift(normal(0, (LENGTH, H, D)), normal(1, (LENGTH, H, D))),
], ids=["rotation", "qk_shift"])
def test_sliced_qk_transform_is_rows_of_full_transform(term):
  q, k, _ = qkv()
  full_q, full_k = term.transform_qk(q, k)
  sliced_q, sliced_k = term.slice_queries(START, SIZE).transform_qk(rows(q, 1), k)
  np.testing.assert_allclose(sliced_q, rows(full_q, 1), **TOL)
  np.testing.assert_array_equal(sliced_k, full_k)  # keys keep their positions


def test_input_embedding_and_traced_start():
  emb = InputEmbedding(normal(0, (LENGTH, 6)))
  sliced = jax.jit(lambda e, s: e.slice_queries(s, 1).value)(emb, jnp.int32(START))
  np.testing.assert_array_equal(sliced, emb.value[START:START + 1])


def test_base_term_slices_only_when_it_holds_no_arrays():
  assert Term().slice_queries(START, SIZE) is not None

  @struct.dataclass
  class Unsliceable(Term):
    table: jax.Array

  with pytest.raises(NotImplementedError, match="Unsliceable"):
    Unsliceable(jnp.ones((LENGTH, 2))).slice_queries(START, SIZE)


# Schemes with attention terms, one per form and option (per-layer, head-shared,
# batched, value term, content scale, q/k transforms). The input-level ones
# and the model-level list of test_transformer.py decode through the whole
# model there.
ATTENTION_SCHEMES = ["shaw_value", "t5_causal_per_layer", "diet_abs_head", "tupe_a_tie_cls",
                     "bert_ad", "segment_per_head", "alibi_causal", "rope"]
# The fused route too (Pallas kernel for the full pass, materialised Toeplitz rows per step).
FUSED_SCHEMES = ["t5_causal_per_layer", "alibi_causal", "diet_rel", "tupe_r", "diet_abs_head"]


@pytest.mark.parametrize("name,route", [(n, "auto") for n in ATTENTION_SCHEMES]
                         + [(n, "fused") for n in FUSED_SCHEMES])
def test_scheme_terms_slice_and_kv_cache(name, route):
  """(1) Attention of sliced query rows (the SchemeTerms sliced with their layer
  axis, start traced) equals the same rows of the full attention. (2) One
  cached MultiHeadAttention step per position equals causal attention over the
  whole sequence."""
  _, _, st = init_scheme(SCHEME_CONFIGS[name])
  q, k, v = qkv()
  mask = padding_mask()
  layer = 1
  sliced = jax.jit(lambda st, s: st.slice_queries(s, SIZE))(st, jnp.int32(START))
  full = attend(q, k, v, st.for_layer(layer), mask=mask, scale=st.content_scale, route=route)
  part = attend(rows(q, 1), k, v, sliced.for_layer(layer), mask=mask, scale=st.content_scale,
                route=route)
  np.testing.assert_allclose(part, rows(full, 1), **TOL)

  terms = st.for_layer(layer)
  mha = MultiHeadAttention(H, D, route=route)
  x = normal(7, (BATCH, LENGTH, DIMS["d_model"]))
  init = functools.partial(mha.init, causal=True, scale=st.content_scale)
  shapes = jax.eval_shape(init, jax.random.key(0), x, terms)["params"]
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda s: jnp.asarray(0.3 * rng.standard_normal(s.shape), s.dtype),
                        shapes)

  @jax.jit
  def run(x):
    apply = functools.partial(mha.apply, scale=st.content_scale, mutable=["cache"])
    full, _ = apply({"params": params}, x, terms, causal=True)
    # The first decode call creates the (empty) cache and otherwise runs as usual.
    first, variables = apply({"params": params}, x, terms, causal=True, decode=True)

    def step(cache, x_t):
      y, variables = apply({"params": params, "cache": cache}, x_t[:, None], terms, decode=True)
      return variables["cache"], y[:, 0]

    cache, ys = jax.lax.scan(step, variables["cache"], x.transpose(1, 0, 2))
    return full, first, cache, ys.transpose(1, 0, 2)

  full, first, cache, steps = run(x)
  np.testing.assert_allclose(first, full, **TOL)
  assert cache["cached_key"].shape == (BATCH, LENGTH, H, D)
  assert int(cache["cache_index"]) == LENGTH
  np.testing.assert_allclose(steps, full, **STEP_TOL)


def test_cross_attention_refuses_decode():
  mha = MultiHeadAttention(H, D)
  x = jnp.ones((1, 2, 8))
  with pytest.raises(ValueError, match="decode"):
    mha.init(jax.random.key(0), x, context=x, decode=True)


# --- searches on a hand-checkable model ----------------------------------------------------

BOS, EOS, A, B = 0, 1, 2, 3
# Next-token probabilities given the previous token (BOS, EOS, A, B); BOS/pad
# is never produced. Greedy follows A forever (0.5, then 0.36 each step);
# the best finished sequences are B EOS (0.4 * 0.9 = 0.36) and A B EOS
# (0.5 * 0.34 * 0.9 = 0.153), both beating A EOS (0.15).
MARKOV = np.array([
    [0.0, 0.1, 0.5, 0.4],
    [0.0, 1.0, 0.0, 0.0],
    [0.0, 0.3, 0.36, 0.34],
    [0.0, 0.9, 0.05, 0.05],
])


def markov_step(ids, cache):
  """``tokens_to_logits`` of the chain above; the cache counts the steps per row,
  so a wrong beam reordering of the cache would show in the count."""
  log_probs = jnp.log(jnp.maximum(jnp.asarray(MARKOV, jnp.float32), 1e-30))
  return log_probs[ids[:, 0]], {"steps": cache["steps"] + 1, "index": cache["index"] + 1}


def markov_cache(rows_):
  return {"steps": jnp.zeros((rows_,), jnp.int32), "index": jnp.array(0, jnp.int32)}


def test_beam_search_hand_checked():
  length, k = 6, 2
  tokens, scores = jax.jit(functools.partial(
      beam_search, markov_step, batch_size=1, max_decode_len=length, beam_size=k, alpha=0.0,
      eos_id=EOS))(markov_cache(k))
  np.testing.assert_array_equal(tokens[0], [[B, EOS, 0, 0, 0, 0], [A, B, EOS, 0, 0, 0]])
  np.testing.assert_allclose(scores[0], np.log([0.36, 0.5 * 0.34 * 0.9]), rtol=1e-6)
  greedy, log_prob = greedy_search(markov_step, markov_cache(1), 1, length, eos_id=EOS)
  np.testing.assert_array_equal(greedy[0], [A] * length)  # never ends
  np.testing.assert_allclose(log_prob[0], np.log(0.5 * 0.36 ** (length - 1)), rtol=1e-6)


def test_beam_search_length_penalty_hand_checked():
  """alpha = 0.6: scores are log p / ((5 + |y|) / 6)^0.6. A EOS (0.15) is
  never finished: it ranks below the K = 2 best extensions at its step."""
  tokens, scores = beam_search(markov_step, markov_cache(2), 1, 6, beam_size=2, alpha=0.6,
                               eos_id=EOS)
  np.testing.assert_array_equal(tokens[0], [[B, EOS, 0, 0, 0, 0], [A, B, EOS, 0, 0, 0]])
  np.testing.assert_allclose(scores[0], [np.log(0.36) / (7 / 6) ** 0.6,
                                         np.log(0.153) / (8 / 6) ** 0.6], rtol=1e-6)


def test_beam_search_without_eos_returns_alive_beams():
  """A chain that never ends: the row returns its alive beams, scored at full length."""
  never_end = np.array([[0.0, 0.0, 0.6, 0.4],   # from BOS
                        [0.0, 1.0, 0.0, 0.0],   # (EOS)
                        [0.0, 0.0, 0.7, 0.3],   # from A
                        [0.0, 0.0, 0.2, 0.8]])  # from B

  def step(ids, cache):
    return jnp.log(jnp.maximum(jnp.asarray(never_end, jnp.float32), 1e-30))[ids[:, 0]], cache

  tokens, scores = beam_search(step, {}, 1, 3, beam_size=2, alpha=0.6, eos_id=EOS)
  # The two most likely of the 8 paths: A A A (0.294) and B B B (0.256).
  np.testing.assert_array_equal(tokens[0], [[A, A, A], [B, B, B]])
  np.testing.assert_allclose(scores[0], np.log([0.294, 0.256]) / (8 / 6) ** 0.6, rtol=1e-5)


def test_length_penalty():
  np.testing.assert_allclose(length_penalty(7, 0.6), (12 / 6) ** 0.6, rtol=1e-6)
  assert float(length_penalty(3, 0.0)) == 1.0


# --- searches on a real EncoderDecoder ------------------------------------------------------

MAX_DECODE, EOS_AFTER, EOS_BONUS = 6, 5, 2.0


@functools.lru_cache(maxsize=None)
def translation_model():
  """A small random T5-bias model and a source batch."""
  model, params = init_model({"name": "t5", "num_buckets": 8}, seed=1, std=0.3,
                             share_embeddings=False)
  params["output"]["bias"] = jnp.zeros_like(params["output"]["bias"])
  src, src_mask, _ = inputs(seed=3)
  return model, params, src, src_mask


def eos_bonus(prev_ids, logits):
  """Random tiny models rarely end; this adds ``EOS_BONUS`` to the EOS logit after
  token ``EOS_AFTER`` so that some sequences end mid-way (applied identically
  in the searches and in teacher forcing)."""
  return logits.at[..., EOS].add(EOS_BONUS * (prev_ids == EOS_AFTER))


def search_step(model, params, encoded, src_mask):
  step = decoder_step(model, params, encoded, src_mask)

  def tokens_to_logits(ids, cache):
    logits, cache = step(ids, cache)
    return eos_bonus(ids[:, 0], logits), cache

  return tokens_to_logits


@functools.lru_cache(maxsize=None)
def searched(beam_size, alpha=0.6):
  """Greedy (``beam_size`` 0) or beam-search output for the source batch."""
  model, params, src, src_mask = translation_model()

  @jax.jit
  def run(params, src, src_mask):
    encoded = model.apply({"params": params}, src, src_mask, method=model.encode)
    if beam_size == 0:
      cache = init_cache(model, params, encoded, src_mask, MAX_DECODE)
      return greedy_search(search_step(model, params, encoded, src_mask), cache, src.shape[0],
                           MAX_DECODE, eos_id=EOS)
    encoded = repeat_beams(encoded, beam_size)
    src_mask = repeat_beams(src_mask, beam_size)
    cache = init_cache(model, params, encoded, src_mask, MAX_DECODE)
    return beam_search(search_step(model, params, encoded, src_mask), cache, src.shape[0],
                       MAX_DECODE, beam_size=beam_size, alpha=alpha, eos_id=EOS)

  return jax.device_get(run(params, src, src_mask))


def teacher_forced(tokens, src, src_mask):
  """Per-token log-probabilities of ``tokens`` ``[N, L]`` by teacher forcing, the
  argmax tokens, and the lengths (up to and with the first EOS)."""
  model, params, _, _ = translation_model()
  inputs_ = shift_right(jnp.asarray(tokens), BOS)
  logits = eos_bonus(inputs_, model.apply({"params": params}, src, inputs_, src_mask))
  log_probs = jax.nn.log_softmax(logits)
  token_lp = jnp.take_along_axis(log_probs, jnp.asarray(tokens)[..., None], -1)[..., 0]
  ended_before = jnp.cumsum(tokens == EOS, axis=1) - (tokens == EOS)
  live = ended_before == 0
  return (np.asarray(jnp.sum(jnp.where(live, token_lp, 0.0), axis=1)),
          np.asarray(jnp.argmax(log_probs, -1)), np.asarray(jnp.sum(live, axis=1)))


def test_greedy_takes_the_argmax_of_teacher_forcing():
  _, _, src, src_mask = translation_model()
  tokens, log_probs = searched(0)
  expected, argmax, lengths = teacher_forced(tokens, src, src_mask)
  # One row ends mid-way, the other runs to the end.
  assert sorted(lengths.tolist()) == [2, MAX_DECODE] and tokens[lengths.argmin(), 1] == EOS
  for row, n in enumerate(lengths):
    np.testing.assert_array_equal(tokens[row, :n], argmax[row, :n])
    assert np.all(tokens[row, n:] == 0)  # pad after EOS
  np.testing.assert_allclose(log_probs, expected, **TOL)


def test_beam_one_equals_greedy():
  """alpha = 0 (with a length penalty, beam 1 may rightly prefer a longer path)."""
  greedy_tokens, greedy_log_probs = searched(0)
  tokens, scores = searched(1, alpha=0.0)
  np.testing.assert_array_equal(tokens[:, 0], greedy_tokens)
  np.testing.assert_allclose(scores[:, 0], greedy_log_probs, **TOL)


def test_beams_are_sorted_and_scored_by_teacher_forcing():
  """Each returned beam's score is its teacher-forced log-probability over the
  GNMT penalty of its length, and scores are sorted: checks that the cache
  follows the beams it is reordered with."""
  k = 3
  tokens, scores = searched(k)
  _, _, src, src_mask = translation_model()
  assert tokens.shape == (src.shape[0], k, MAX_DECODE)
  assert np.all(np.diff(scores, axis=1) <= 0)
  log_probs, _, lengths = teacher_forced(tokens.reshape(-1, MAX_DECODE), repeat_beams(src, k),
                                         repeat_beams(src_mask, k))
  expected = (log_probs / np.asarray(length_penalty(lengths, 0.6))).reshape(scores.shape)
  np.testing.assert_allclose(scores, expected, **TOL)
  for row in tokens:
    assert len({tuple(t) for t in row}) == k  # distinct beams
  # Some beam was reordered: its first token is not the best first token.
  assert len({int(t) for t in tokens[:, :, 0].ravel()}) > 1


def test_translate_wrappers():
  """greedy_translate and translate (beam 1, alpha 0) agree on the plain model."""
  model, params, src, src_mask = translation_model()

  @jax.jit
  def run(params):
    greedy = greedy_translate(model, params, src, src_mask, max_decode_len=4, eos_id=EOS)
    beam = translate(model, params, src, src_mask, max_decode_len=4, beam_size=1, alpha=0.0,
                     eos_id=EOS)
    return greedy, beam

  (greedy_tokens, greedy_lp), (tokens, scores) = run(params)
  assert tokens.shape == (src.shape[0], 1, 4)
  np.testing.assert_array_equal(tokens[:, 0], greedy_tokens)
  np.testing.assert_allclose(scores[:, 0], greedy_lp, **TOL)
