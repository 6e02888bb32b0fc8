"""RoPE's run-time scalings, ``dynamic`` (dynamic NTK) and ``longrope`` (Ding et al. 2024),
against float64 numpy transcriptions of Hugging Face's ``_compute_dynamic_ntk_parameters`` and
``_compute_longrope_parameters`` with random settings; their properties (dynamic is plain RoPE
up to ``original_max_len`` and its base grows beyond; LongRoPE with unit factors is plain
RoPE); the current length (the pass's ``length``, or each row's largest id + 1); cached
decoding past ``original_max_len`` equal to teacher forcing at the cache's length; one-line
errors; lists through dict, ``ConfigDict`` and model configs."""

import functools
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from posenc_jax import build_scheme
from posenc_jax.models import model_config
from tests import test_decoding, test_rope
from tests.conftest import DIMS
from tests.test_lm import init_lm, token_ids
from tests.test_rope import random_qk, reference_rotate

D = 16  # R/2 = 8 pairs
WIDE = dict(DIMS, head_dim=D, d_model=4 * D, max_len=64)


def build(config, **dims):
  return build_scheme({"name": "rope", **config}, **(WIDE | dims))


def rotation(config, length, position_ids=None, **dims):
  return build(config, **dims).apply({}, length, None, position_ids).for_layer(0)[0]


# --- float64 transcriptions of Hugging Face's formulas --------------------------------------

def hf_dynamic(base, dim, original_max_len, factor, seq_len):
  """``[dim/2]`` inverse frequencies of dynamic NTK at the current length ``seq_len``."""
  seq_len = max(seq_len, original_max_len)
  base = base * ((factor * seq_len / original_max_len) - (factor - 1)) ** (dim / (dim - 2))
  return 1.0 / base ** (np.arange(0, dim, 2) / dim)


def hf_longrope(base, dim, short_factor, long_factor, max_len, original_max_len, seq_len,
                attention_factor=None):
  """(``[dim/2]`` inverse frequencies, attention factor) of LongRoPE at ``seq_len``, with
  Phi-3's ``factor = max_position_embeddings / original_max_position_embeddings``."""
  factor = max_len / original_max_len
  if attention_factor is None:
    attention_factor = (1.0 if factor <= 1.0
                        else math.sqrt(1 + math.log(factor) / math.log(original_max_len)))
  ext = np.asarray(long_factor if seq_len > original_max_len else short_factor, np.float64)
  return 1.0 / (ext * base ** (np.arange(0, dim, 2) / dim)), attention_factor


def random_dynamic(seed):
  rng = np.random.default_rng(seed)
  return dict(scaling="dynamic", base=float(rng.uniform(100.0, 1e6)),
              factor=float(rng.uniform(1.0, 8.0)), original_max_len=int(rng.integers(4, 24)))


def random_longrope(seed, attention_factor=None):
  rng = np.random.default_rng(seed)
  return dict(scaling="longrope", base=float(rng.uniform(100.0, 1e6)),
              short_factor=rng.uniform(0.5, 2.0, D // 2).tolist(),
              long_factor=rng.uniform(1.0, 40.0, D // 2).tolist(),
              original_max_len=int(rng.integers(4, 24)), attention_factor=attention_factor)


@pytest.mark.parametrize("seed", range(2))
def test_dynamic_matches_hugging_face(seed):
  """Frequencies and rotated q, k at current lengths below, at and above ``original_max_len``
  (the pass's ``length``)."""
  config = random_dynamic(seed)
  original = config["original_max_len"]
  q, k = random_qk(length=64, head_dim=D)
  for length in (original - 1, original, original + 1, 2 * original + 3):
    want = hf_dynamic(config["base"], D, original, config["factor"], length)
    np.testing.assert_allclose(build(config).frequencies(length), want, rtol=3e-6)
    term = rotation(config, length)
    assert term.attention_factor == 1.0
    angles = np.arange(length)[:, None] * want
    rq, rk = term.transform_qk(q[:, :length], k[:, :length])
    np.testing.assert_allclose(rq, reference_rotate(q[:, :length], angles, "interleaved"),
                               atol=2e-5)
    np.testing.assert_allclose(rk, reference_rotate(k[:, :length], angles, "interleaved"),
                               atol=2e-5)


@pytest.mark.parametrize("seed,attention_factor", [(0, None), (1, None), (2, 0.7)])
def test_longrope_matches_hugging_face(seed, attention_factor):
  config = random_longrope(seed, attention_factor)
  original = config["original_max_len"]
  q, k = random_qk(length=64, head_dim=D)
  for length in (original, original + 1, 40):
    want, factor = hf_longrope(config["base"], D, config["short_factor"],
                               config["long_factor"], WIDE["max_len"], original, length,
                               attention_factor)
    np.testing.assert_allclose(build(config).frequencies(length), want, rtol=2e-6)
    term = rotation(dict(config, layout="half"), length)
    assert term.attention_factor == pytest.approx(factor, rel=1e-12)
    angles = np.arange(length)[:, None] * want
    rq, rk = term.transform_qk(q[:, :length], k[:, :length])
    np.testing.assert_allclose(rq, reference_rotate(q[:, :length], angles, "half", factor),
                               atol=3e-5)
    np.testing.assert_allclose(rk, reference_rotate(k[:, :length], angles, "half", factor),
                               atol=3e-5)


def test_longrope_default_attention_factor_of_phi3_mini_128k():
  """Phi-3-mini-128k: 4096 -> 131072 positions, ``sqrt(1 + ln 32 / ln 4096)``; a model whose
  ``max_len`` is its original context gets 1."""
  ones = [1.0] * (D // 2)
  config = dict(scaling="longrope", short_factor=ones, long_factor=ones, original_max_len=4096)
  assert build(config, max_len=131072).attention_scaling() == pytest.approx(
      math.sqrt(1 + math.log(32) / math.log(4096)))
  assert build(dict(config, original_max_len=None)).attention_scaling() == 1.0


# --- properties -----------------------------------------------------------------------------

def test_dynamic_is_plain_rope_up_to_the_original_length_and_its_base_grows_beyond():
  """Bit for bit the unscaled angles while ``n <= original_max_len``; beyond it the highest
  frequency stays and every other one falls strictly as ``n`` grows: ``base'`` grows
  monotonically (``theta'_k = base'^(-2k/R)``)."""
  config = dict(scaling="dynamic", factor=4.0, original_max_len=12)
  for length in (1, 7, 12):
    np.testing.assert_array_equal(rotation(config, length).q_angles,
                                  rotation({}, length).q_angles)
  module = build(config)
  freqs = np.stack([np.asarray(module.frequencies(n)) for n in range(12, 40)])
  np.testing.assert_array_equal(freqs[:, 0], freqs[0, 0])
  assert np.all(np.diff(freqs[:, 1:], axis=0) < 0)
  # The effective base, recovered in float64 from the lowest frequency, grows from base.
  rotated = D
  bases = freqs[:, -1].astype(np.float64) ** (-rotated / (rotated - 2))
  assert bases[0] == pytest.approx(10000.0, rel=1e-5) and np.all(np.diff(bases) > 0)


def test_longrope_with_unit_factors_is_plain_rope():
  """All factors 1 and attention factor 1: plain RoPE below and above ``original_max_len``."""
  ones = [1.0] * (D // 2)
  config = dict(scaling="longrope", short_factor=ones, long_factor=ones, original_max_len=8,
                attention_factor=1.0)
  for length in (5, 8, 30):
    term, plain = rotation(config, length), rotation({}, length)
    np.testing.assert_array_equal(term.q_angles, plain.q_angles)
    np.testing.assert_array_equal(term.k_angles, plain.k_angles)
    assert term.attention_factor == plain.attention_factor == 1.0


# --- the current length with position ids ---------------------------------------------------

@pytest.mark.parametrize("config", [dict(scaling="dynamic", factor=3.0, original_max_len=8),
                                    random_longrope(3) | dict(original_max_len=8)],
                         ids=["dynamic", "longrope"])
def test_current_length_with_position_ids_is_each_rows_largest_id_plus_one(config):
  """Row 0 counts 0..11 (n = 12 > 8: scaled), row 1 restarts at 6 (n = 6: unscaled), and
  each row's angles are those of a pass of length n alone: the rows do not see each other.
  ``arange`` ids give the terms of no ids; traced ids (jit) the same as concrete ones."""
  ids = jnp.array([np.arange(12), [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]], jnp.int32)
  term = rotation(config, 12, ids)
  traced = jax.jit(lambda i: build(config).apply({}, 12, None, i))(ids).for_layer(0)[0]
  np.testing.assert_array_equal(traced.q_angles, term.q_angles)
  np.testing.assert_allclose(term.q_angles[0], rotation(config, 12).q_angles, rtol=1e-6)
  alone = rotation(config, 6).q_angles
  np.testing.assert_allclose(term.q_angles[1], np.concatenate([alone, alone]), rtol=1e-6)
  assert not np.allclose(rotation(config, 12).q_angles[:6], alone)  # the scaling is on
  arange = rotation(config, 12, jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (2, 12)))
  np.testing.assert_array_equal(arange.q_angles, jnp.broadcast_to(rotation(config, 12).q_angles,
                                                                  arange.q_angles.shape))


# --- cached decoding ------------------------------------------------------------------------

LM_DYNAMIC = {"name": "rope", "scaling": "dynamic", "factor": 4.0, "original_max_len": 4}


def test_cached_decoding_past_the_original_length_equals_teacher_forcing():
  """A language model decoding 7 > original_max_len = 4 tokens: every cached step rotates with
  the frequencies of the cache's length (n = 7), so the steps equal the teacher-forced pass
  over the 7 tokens. Not Hugging Face's behaviour: a teacher-forced prefix of 4 tokens (n = 4,
  unscaled) gives other logits, as would HF's per-step frequencies."""
  ids = token_ids()
  model, params = init_lm(LM_DYNAMIC)
  forced = jax.jit(model.apply)({"params": params}, ids)
  _, variables = jax.eval_shape(functools.partial(model.apply, decode=True, method=model.decode,
                                                  mutable=["cache"]), {"params": params}, ids)
  cache = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), variables["cache"])
  step = jax.jit(functools.partial(model.apply, decode=True, method=model.decode,
                                   mutable=["cache"]))
  steps = []
  for t in range(ids.shape[1]):  # one compile for the 7 steps
    logits, variables = step({"params": params, "cache": cache}, ids[:, t:t + 1])
    cache = variables["cache"]
    steps.append(logits[:, 0])
  np.testing.assert_allclose(jnp.stack(steps, axis=1), forced, rtol=1e-5, atol=1e-5)
  prefix = jax.jit(model.apply)({"params": params}, ids[:, :4])
  assert np.abs(prefix - forced[:, :4]).max() > 1e-3


@pytest.mark.parametrize("name", ["rope_dynamic", "rope_longrope"])
def test_cached_attention_steps_equal_teacher_forcing(name):
  """tests/test_decoding.py's check at the attention layer (LENGTH 10 > original_max_len 8)."""
  test_decoding.test_scheme_terms_slice_and_kv_cache(name, "auto")


# --- configs and errors ---------------------------------------------------------------------

def test_lists_come_through_dicts_config_dicts_and_model_configs():
  """A list (dict config), a ConfigDict's list and a model config's tuple build the same
  hashable module."""
  config = {"name": "rope", **random_longrope(4)}
  modules = [build_scheme(config, **WIDE),
             build_scheme(ml_collections.ConfigDict(config), **WIDE),
             build_scheme(model_config(vocab_size=8, d_model=64, num_layers=1, num_heads=4,
                                       max_len=64, scheme=config, segment=None).scheme,
                          **WIDE)]
  for module in modules:
    assert module.short_factor == tuple(config["short_factor"])
    assert hash(module) == hash(modules[0])
    np.testing.assert_array_equal(module.frequencies(40), modules[0].frequencies(40))


FACTORS = [1.0] * (D // 2)
LONGROPE = dict(scaling="longrope", short_factor=FACTORS, long_factor=FACTORS)


@pytest.mark.parametrize("config,message", [
    (dict(scaling="longrope", long_factor=FACTORS),
     "short_factor must be a list of finite positive numbers with scaling 'longrope', got None"),
    (dict(scaling="longrope", short_factor=FACTORS),
     "long_factor must be a list of finite positive numbers with scaling 'longrope', got None"),
    (dict(LONGROPE, short_factor=[1.0, 0.0]),
     "short_factor must be a list of finite positive numbers or None, got [1.0, 0.0]"),
    (dict(LONGROPE, long_factor=[1.0, float("nan")]),
     "long_factor must be a list of finite positive numbers or None, got [1.0, nan]"),
    (dict(LONGROPE, long_factor="1.0"),
     "long_factor must be a list of finite positive numbers or None, got '1.0'"),
    (dict(LONGROPE, long_factor=[]),
     "long_factor must be a list of finite positive numbers or None, got []"),
    (dict(LONGROPE, long_factor=[1.0, True]),
     "long_factor must be a list of finite positive numbers or None, got [1.0, True]"),
    (dict(LONGROPE, short_factor=[1.0] * 7),
     "short_factor must have one factor per rotated pair, R/2 = 8, got 7"),
    (dict(LONGROPE, fraction=0.5),
     "short_factor must have one factor per rotated pair, R/2 = 4, got 8"),
    (dict(LONGROPE, original_max_len=1),
     "original_max_len must be >= 2 with scaling 'longrope', got 1"),
    (dict(LONGROPE, factor=2.0),
     "factor must stay 1.0 with scaling 'longrope' (it applies to scaling 'linear', 'ntk', "
     "'yarn', 'llama3', 'dynamic'), got 2.0"),
    (dict(scaling="dynamic", factor=2.0, short_factor=FACTORS),
     "short_factor must stay None with scaling 'dynamic' (it applies to scaling 'longrope'), "
     "got [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]"),
    (dict(scaling="dynamic", attention_factor=1.5),
     "attention_factor must stay None with scaling 'dynamic' (it applies to scaling 'yarn', "
     "'longrope'), got 1.5"),
    (dict(scaling="dynamic", factor=0.5), "factor must be a finite number >= 1, got 0.5"),
    (dict(scaling="dynamic", original_max_len=0),
     "original_max_len must be a positive integer or None, got 0"),
    (dict(scaling="dynamic", fraction=0.125),
     "an even number >= 4 with scaling 'dynamic', got round(0.125 * 16) = 2"),
])
def test_invalid_configs_raise_one_line(config, message):
  """tests/test_rope.py's check (one line, naming the field) at head dim 16: R/2 = 8."""
  test_rope.test_invalid_configs_raise_one_line(config, dict(head_dim=D, d_model=4 * D), message)
