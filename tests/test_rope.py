"""RoPE's layouts, partial rotary and context extension against float64 numpy references
written from the papers (Su et al.; Chen et al. 2023; bloc97's NTK-aware scaling; Peng et
al. 2023, YaRN; Llama 3.1), and the same treatment as every scheme: registry errors, both
attention routes, cached decoding."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posenc_jax import Rotation, SchemeConfigError, attend, build_scheme
from posenc_jax.schemes.absolute import sinusoid_frequencies
from tests import test_attention, test_decoding
from tests.conftest import DIMS, SCHEME_CONFIGS
from tests.test_schemes import assert_toeplitz

D = 32  # 16 frequencies: enough for YaRN's and Llama 3's ramps to have all three regions
WIDE = dict(DIMS, head_dim=D, d_model=4 * D)
LENGTH = 40

# Every scaling, with an original context that puts frequencies on both sides of the ramps.
SCALED = {
    "linear": dict(scaling="linear", factor=4.0),
    "ntk": dict(scaling="ntk", factor=4.0),
    "yarn": dict(scaling="yarn", factor=4.0, original_max_len=4096),
    "yarn_attention_factor": dict(scaling="yarn", factor=8.0, original_max_len=2048,
                                  beta_fast=16.0, beta_slow=2.0, attention_factor=1.5),
    "llama3": dict(scaling="llama3", factor=8.0, original_max_len=8192, base=500000.0),
    "llama3_factors": dict(scaling="llama3", factor=2.0, original_max_len=1024,
                           low_freq_factor=2.0, high_freq_factor=16.0),
}


def build(config, **dims):
  return build_scheme({"name": "rope", **config}, **(WIDE | dims))


def rotation(config, length=LENGTH, **dims):
  """The scheme's Rotation term (one layer) over ``length`` positions."""
  return build(config, **dims).apply({}, length).for_layer(0)[0]


def random_qk(length=LENGTH, head_dim=D, seed=1):
  keys = jax.random.split(jax.random.key(seed))
  return tuple(jax.random.normal(key, (2, length, 3, head_dim)) for key in keys)


def logits(q, k):
  return np.asarray(jnp.einsum("bihd,bjhd->bhij", q, k))


# --- float64 references ---------------------------------------------------------------------

def reference_frequencies(rotated, base=10000.0, scaling="none", factor=1.0,
                          original_max_len=None, beta_fast=32.0, beta_slow=1.0,
                          low_freq_factor=1.0, high_freq_factor=4.0, **_):
  """``[R/2]`` scaled frequencies and the weights ``gamma`` of the unscaled ones."""
  pair = np.arange(rotated // 2)
  if scaling == "ntk":  # a larger base stretches low frequencies most, the highest not at all
    base = base * factor ** (rotated / (rotated - 2))
  theta = base ** (-2.0 * pair / rotated)
  gamma = np.full(theta.shape, 0.0 if scaling == "linear" else 1.0)
  if scaling == "yarn":
    # The fractional pair index whose frequency makes n whole turns in the original
    # context: L theta_d / (2 pi) = n. The reference code floors the fast bound, ceils
    # the slow one and interpolates linearly in the index between them.
    def index_of(n):
      return rotated / 2 * math.log(original_max_len / (2 * math.pi * n)) / math.log(base)
    fast = max(math.floor(index_of(beta_fast)), 0)
    slow = min(math.ceil(index_of(beta_slow)), rotated - 1)
    gamma = np.array([1.0 if d <= fast else 0.0 if d >= slow else (slow - d) / (slow - fast)
                      for d in pair])
  elif scaling == "llama3":
    wavelength = 2 * math.pi / theta
    for d, length in enumerate(wavelength):
      if length < original_max_len / high_freq_factor:  # high frequency: kept
        gamma[d] = 1.0
      elif length > original_max_len / low_freq_factor:  # low frequency: interpolated
        gamma[d] = 0.0
      else:
        gamma[d] = ((original_max_len / length - low_freq_factor)
                    / (high_freq_factor - low_freq_factor))
  return gamma * theta + (1.0 - gamma) * theta / factor, gamma


def reference_attention_factor(config):
  if config.get("scaling") != "yarn":
    return 1.0
  return config.get("attention_factor") or 0.1 * math.log(config["factor"]) + 1.0


def reference_rotate(x, angles, layout, attention_factor=1.0):
  """Each pair as a complex number ``a + ib`` times ``attention_factor * e^{i angle}``."""
  x = np.asarray(x, np.float64)
  rotated = 2 * angles.shape[-1]
  head, rest = x[..., :rotated], x[..., rotated:]
  if layout == "interleaved":
    z = head[..., 0::2] + 1j * head[..., 1::2]
  else:
    z = head[..., :rotated // 2] + 1j * head[..., rotated // 2:]
  z = z * attention_factor * np.exp(1j * angles)[None, :, None, :]
  if layout == "interleaved":
    head = np.stack([z.real, z.imag], axis=-1).reshape(head.shape)
  else:
    head = np.concatenate([z.real, z.imag], axis=-1)
  return np.concatenate([head, rest], axis=-1)


def half_order(rotated, dim):
  """Feature order taking an interleaved vector to the half layout: half dims ``k`` and
  ``k + R/2`` are interleaved dims ``2k`` and ``2k + 1``; the pass-through stays."""
  return np.concatenate([np.arange(0, rotated, 2), np.arange(1, rotated, 2),
                         np.arange(rotated, dim)])


# --- the default ----------------------------------------------------------------------------

def test_default_is_su_et_al_and_parameter_free():
  module = build({})
  assert module.init(jax.random.key(0), LENGTH) == {}
  term = rotation({})
  assert (term.layout, term.attention_factor) == ("interleaved", 1.0)
  # Bit for bit the angles i * theta_k of the scheme before layouts and scaling existed.
  np.testing.assert_array_equal(
      term.q_angles, jnp.arange(LENGTH, dtype=jnp.float32)[:, None] * sinusoid_frequencies(D))
  np.testing.assert_array_equal(term.k_angles, term.q_angles)


# --- frequencies and rotations against the references ---------------------------------------

@pytest.mark.parametrize("name", ["none", *SCALED])
@pytest.mark.parametrize("layout,fraction", [("interleaved", 1.0), ("half", 0.75)])
def test_rotation_matches_reference(name, layout, fraction):
  config = dict(SCALED.get(name, {}), layout=layout, fraction=fraction)
  module = build(config)
  rotated = round(fraction * D)
  assert module.rotated_dim == rotated
  want, gamma = reference_frequencies(rotated, **config)
  np.testing.assert_allclose(module.frequencies(), want, rtol=2e-6)
  if config.get("scaling") in ("yarn", "llama3"):  # the config reaches every region of the ramp
    assert gamma.max() == 1.0 and gamma.min() == 0.0
    assert np.any((gamma > 0) & (gamma < 1))
  term = rotation(config)
  factor = reference_attention_factor(config)
  assert term.attention_factor == pytest.approx(factor, rel=1e-12)
  q, k = random_qk()
  rq, rk = term.transform_qk(q, k)
  angles = np.arange(LENGTH)[:, None] * want[None, :]
  np.testing.assert_allclose(rq, reference_rotate(q, angles, layout, factor), atol=2e-5)
  np.testing.assert_allclose(rk, reference_rotate(k, angles, layout, factor), atol=2e-5)


def test_published_yarn_and_llama3_settings():
  """YaRN's ramp bounds turn counts as the paper states: every kept frequency turns at least
  beta_fast times over the original context, every interpolated one at most beta_slow
  times. Llama 3.1 8B (base 500000, factor 8, context 8192, factors 1 and 4): the
  highest frequency is kept, the lowest divided by 8."""
  module = build(SCALED["yarn"])
  gamma = module.extrapolation()
  theta = 10000.0 ** (-np.arange(0, D, 2) / D)
  turns = 4096 * theta / (2 * math.pi)
  assert np.all(turns[gamma == 1] >= 32) and np.all(turns[gamma == 0] <= 1)
  assert module.attention_scaling() == pytest.approx(0.1 * math.log(4) + 1)
  llama = build(dict(scaling="llama3", factor=8.0, original_max_len=8192, base=500000.0),
                head_dim=128, d_model=512)
  theta = 500000.0 ** (-np.arange(0, 128, 2) / 128)
  freqs = np.asarray(llama.frequencies())
  assert freqs[0] == pytest.approx(theta[0]) and freqs[-1] == pytest.approx(theta[-1] / 8)


def test_yarn_attention_factor_scales_the_logits_by_its_square():
  """The default attention factor 0.1 ln(s) + 1 multiplies cos and sin, so q and k are each
  scaled by it (Hugging Face's convention): the logits by its square."""
  config = SCALED["yarn"]
  q, k = random_qk()
  scaled = logits(*rotation(config).transform_qk(q, k))
  plain = logits(*rotation(dict(config, attention_factor=1.0)).transform_qk(q, k))
  np.testing.assert_allclose(scaled, (0.1 * math.log(4.0) + 1) ** 2 * plain, rtol=1e-5, atol=1e-5)


# --- layouts, partial rotary, the relative property -----------------------------------------

@pytest.mark.parametrize("config", [{}, dict(fraction=0.5, **SCALED["yarn"])],
                         ids=["full", "partial_yarn"])
def test_layouts_agree_after_permuting_head_dims(config):
  """Interleaved dims (2k, 2k+1) are half-layout dims (k, k + R/2): rotating permuted q and k
  in the half layout gives the permuted rotation, and the same logits q . k."""
  order = half_order(round(config.get("fraction", 1.0) * D), D)
  q, k = random_qk()
  iq, ik = rotation(dict(config, layout="interleaved")).transform_qk(q, k)
  hq, hk = rotation(dict(config, layout="half")).transform_qk(q[..., order], k[..., order])
  np.testing.assert_allclose(hq, iq[..., order], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(hk, ik[..., order], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(logits(hq, hk), logits(iq, ik), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_partial_rotary_passes_the_rest_through(layout):
  """fraction 0.25: the first 8 dims are rotated exactly as a full RoPE of head dim 8 (theta_k
  = base^(-2k/8)), the other 24 pass through unchanged."""
  q, k = random_qk()
  pq, pk = rotation(dict(layout=layout, fraction=0.25)).transform_qk(q, k)
  fq, fk = rotation(dict(layout=layout), head_dim=8, d_model=32).transform_qk(q[..., :8],
                                                                             k[..., :8])
  np.testing.assert_array_equal(pq[..., 8:], q[..., 8:])
  np.testing.assert_array_equal(pk[..., 8:], k[..., 8:])
  np.testing.assert_allclose(pq[..., :8], fq, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(pk[..., :8], fk, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["none", *SCALED])
def test_logits_depend_only_on_the_offset(name):
  """The same q at every position and the same k at every position: logit (i, j) is a
  function of i - j alone, for every scaling (and either layout, partial or not)."""
  config = dict(SCALED.get(name, {}), layout="half", fraction=0.5)
  vec_q, vec_k = jax.random.normal(jax.random.key(3), (2, D))
  q = jnp.broadcast_to(vec_q, (1, LENGTH, 1, D))
  k = jnp.broadcast_to(vec_k, (1, LENGTH, 1, D))
  matrix = logits(*rotation(config).transform_qk(q, k))[0, 0]
  assert_toeplitz(matrix, atol=2e-4)  # cos/sin of angles up to ~40 round differently
  assert np.ptp(matrix) > 1e-1


# --- errors ---------------------------------------------------------------------------------

@pytest.mark.parametrize("config,dims,message", [
    (dict(layout="neox"), {}, "layout must be one of 'interleaved', 'half', got 'neox'"),
    (dict(fraction=0), {}, "fraction must be a number in (0, 1], got 0"),
    (dict(fraction=1.5), {}, "fraction must be a number in (0, 1], got 1.5"),
    (dict(scaling="yarm"), {}, "scaling must be one of 'none', 'linear', 'ntk', 'yarn', 'llama3', "
                               "'dynamic', 'longrope', got 'yarm'; did you mean 'yarn'?"),
    (dict(scaling="linear", factor=0.5), {}, "factor must be a finite number >= 1, got 0.5"),
    (dict(factor=2.0), {}, "factor must stay 1.0 with scaling 'none' (it applies to scaling "
                           "'linear', 'ntk', 'yarn', 'llama3', 'dynamic'), got 2.0"),
    (dict(beta_fast=16.0), {}, "beta_fast must stay 32.0 with scaling 'none' (it applies to "
                               "scaling 'yarn'), got 16.0"),
    (dict(scaling="linear", factor=2.0, original_max_len=512), {},
     "original_max_len must stay None with scaling 'linear' (it applies to scaling 'yarn', "
     "'llama3', 'dynamic', 'longrope'), got 512"),
    (dict(scaling="yarn", high_freq_factor=8.0), {},
     "high_freq_factor must stay 4.0 with scaling 'yarn' (it applies to scaling 'llama3'), "
     "got 8.0"),
    (dict(scaling="yarn", original_max_len=0), {},
     "original_max_len must be a positive integer or None, got 0"),
    (dict(scaling="yarn", beta_fast=1.0), {}, "beta_fast must be > beta_slow (1.0), got 1.0"),
    (dict(scaling="llama3", low_freq_factor=4.0), {},
     "high_freq_factor must be > low_freq_factor (4.0), got 4.0"),
    (dict(fraction=0.3), {"head_dim": 10, "d_model": 40},
     "fraction must make the rotated dims, round(fraction * head_dim), an even number >= 2, "
     "got round(0.3 * 10) = 3"),
    (dict(fraction=0.01), {}, "an even number >= 2, got round(0.01 * 32) = 0"),
    (dict(fraction=0.0625, scaling="ntk", factor=2.0), {},
     "an even number >= 4 with scaling 'ntk', got round(0.0625 * 32) = 2"),
    ({}, {"head_dim": 7}, "head_dim must be even, got 7"),
])
def test_invalid_configs_raise_one_line(config, dims, message):
  with pytest.raises(SchemeConfigError) as error:
    build(config, **dims)
  assert str(error.value).startswith("scheme 'rope': ")
  assert message in str(error.value)
  assert "\n" not in str(error.value)


@pytest.mark.parametrize("term,message", [
    (Rotation(jnp.ones((LENGTH, 4)), jnp.ones((LENGTH, 4)), layout="neox"),
     "layout is 'neox'; expected 'interleaved' or 'half'"),
    (Rotation(jnp.ones((LENGTH, 17)), jnp.ones((LENGTH, 17))),
     "q_angles [40, 17] has 17 angles, but q's head dim 32 has only 16 pairs"),
    (Rotation(jnp.ones((LENGTH, 4)), jnp.ones((LENGTH, 6))),
     "k_angles [40, 6] has 6 angles, but q_angles has 4"),
])
def test_rotation_term_errors(term, message):
  q, k = random_qk()
  with pytest.raises(ValueError) as error:
    attend(q, k, k, [term])
  assert str(error.value) == f"attend: terms[0] (Rotation): {message}"


# --- both attention routes and cached decoding (the generic tests, on new configs) ----------

# Half layout, partial rotary and YaRN (its ramp and attention factor) at once.
NAME = "rope_half_partial_yarn"
CONFIG = {"name": "rope", "layout": "half", "fraction": 0.5, "scaling": "yarn", "factor": 4.0,
          "original_max_len": 8}


@pytest.fixture
def registered(monkeypatch):
  """CONFIG in the shared table of scheme configs, under NAME."""
  monkeypatch.setitem(SCHEME_CONFIGS, NAME, CONFIG)


@pytest.mark.usefixtures("registered")
@pytest.mark.parametrize("causal", [False, True])
def test_fused_route_matches_reference(causal):
  """tests/test_attention.py's check (values and gradients of both routes) on CONFIG."""
  test_attention.test_fused_route_matches_reference(NAME, causal)


@pytest.mark.usefixtures("registered")
def test_cached_decoding_equals_teacher_forcing():
  """tests/test_decoding.py's check on CONFIG: sliced query rows equal rows of the full
  attention, and one cached step per position equals causal attention over the sequence."""
  test_decoding.test_scheme_terms_slice_and_kv_cache(NAME, "auto")
