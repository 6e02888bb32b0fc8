"""FIRE (Li et al., ICLR 2024): the bias against a float64 transcription of the paper's
formula and listing, its dependence on the query position through the normaliser alone, the
listing's initialisation, one-line errors, and the generic route and decoding checks on the
causal form (the decoder's) in the language model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posenc_jax import build_scheme
from posenc_jax.models.config import causal_variant
from posenc_jax.schemes.fire import interpolated_distance
from tests import test_decoding, test_lm
from tests.conftest import DIMS

H, W = DIMS["num_heads"], 3
LAYERS = DIMS["num_layers"]


def build(**hyper):
  return build_scheme({"name": "fire", "mlp_width": W, "init_L": 4.0} | hyper, **DIMS)


def random_fire_params(seed, layers=LAYERS, init_L=4.0):
  """N(0, 1) MLP weights, ``c`` of either sign in ``0.05 .. 2`` in size (``psi`` reads
  ``|c x|``) and multipliers giving thresholds ``L`` in ``1.5 .. 7`` (``init_L = 4``)."""
  rng = np.random.default_rng(seed)
  c = rng.uniform(0.05, 2.0, layers) * rng.choice([-1.0, 1.0], layers)
  params = {"hidden_kernel": rng.standard_normal((layers, W)),
            "hidden_bias": rng.standard_normal((layers, W)),
            "output_kernel": rng.standard_normal((layers, W, H)),
            "output_bias": rng.standard_normal((layers, H)),
            "c": c, "L_multiplier": rng.uniform(1.5, 7.0, layers) / init_L}
  return {"params": {k: jnp.asarray(v, jnp.float32) for k, v in params.items()}}


def fire_float64(params, positions, causal, init_L=4.0, eps=1e-6):
  """``[layers, H, L, L]``: Li et al. section 3, ``f(psi(i - j) / psi(max(L, i)))`` with
  ``psi(x) = log(|c x| + 1)``, ``L = |L_multiplier init_L|`` and ``eps`` on the normaliser (the
  paper's listing), ``psi`` signed for a later key when not causal (FAT5); one entry at a time
  in float64."""
  p = {k: np.asarray(v, np.float64) for k, v in params["params"].items()}
  pos = np.asarray(positions, np.float64)
  n = len(pos)
  out = np.zeros((len(p["c"]), H, n, n))
  for layer in range(len(p["c"])):
    c, threshold = p["c"][layer], abs(p["L_multiplier"][layer] * init_L)
    for i in range(n):
      for j in range(n):
        r = pos[i] - pos[j]
        distance = np.log(abs(c * r) + 1.0) * (1.0 if causal else np.sign(r))
        x = distance / (np.log(abs(c * max(threshold, pos[i])) + 1.0) + eps)
        hidden = np.maximum(x * p["hidden_kernel"][layer] + p["hidden_bias"][layer], 0.0)
        out[layer, :, i, j] = hidden @ p["output_kernel"][layer] + p["output_bias"][layer]
  return out


@pytest.mark.parametrize("causal", [True, False])
def test_bias_equals_float64_transcription(causal):
  """Both forms, at ``arange`` positions and at per-token ids (a restart and a gap), against
  the transcription; the rows cross ``L`` (2 and 7 of 9 positions)."""
  scheme, length = build(causal=causal), 9
  variables = random_fire_params(0)
  (term,) = scheme.apply(variables, length).terms
  np.testing.assert_allclose(term.value, fire_float64(variables, np.arange(length), causal),
                             rtol=2e-5, atol=2e-5)
  ids = np.array([[0, 1, 2, 3, 0, 1, 2, 3, 4], [5, 6, 9, 12, 13, 14, 20, 21, 30]])
  (term,) = scheme.apply(variables, length, None, jnp.asarray(ids, jnp.int32)).terms
  assert term.value.shape == (LAYERS, 2, H, length, length)
  for b in range(2):
    np.testing.assert_allclose(term.value[:, b], fire_float64(variables, ids[b], causal),
                               rtol=2e-5, atol=2e-5)


def test_query_position_enters_through_the_normaliser_only():
  """With an increasing MLP (positive weights, zero biases), ``b(i, i - r)`` for a fixed
  ``r >= 1`` is constant over the rows ``i < L`` (the Toeplitz block) and strictly falls
  with ``i`` beyond (``psi(i)`` grows); ``b(i, i)`` is ``f(0)`` on every row."""
  scheme, length, threshold = build(causal=True, sharing="layer"), 12, 5.0
  variables = {"params": {"hidden_kernel": jnp.ones((1, W)), "hidden_bias": jnp.zeros((1, W)),
                          "output_kernel": jnp.ones((1, W, H)), "output_bias": jnp.zeros((1, H)),
                          "c": jnp.array([0.3]), "L_multiplier": jnp.array([threshold / 4.0])}}
  (term,) = scheme.apply(variables, length).terms
  bias = np.asarray(term.value[0, 0], np.float64)  # [L, L], head 0
  np.testing.assert_allclose(np.diagonal(bias), 0.0, atol=1e-7)
  for r in range(1, length):
    diagonal = np.array([bias[i, i - r] for i in range(r, length)])
    below = diagonal[:max(int(threshold) - r, 0)]  # rows i < L
    np.testing.assert_allclose(below, below[:1].repeat(len(below)), rtol=1e-6)
    above = diagonal[max(int(threshold) - r, 0):]  # rows i >= L
    assert np.all(np.diff(above) < 0), r


def test_shifting_ids_changes_the_bias_only_past_the_threshold():
  """Below ``L`` the bias reads ``i - j`` alone (ids shifted by 3 give the same bias); with a
  threshold below the ids it reads the query position too."""
  length, scheme = 6, build()
  shifted = jnp.arange(length, dtype=jnp.int32)[None] + 3
  for threshold, same in ((64.0, True), (2.0, False)):
    variables = random_fire_params(1)
    variables["params"]["L_multiplier"] = jnp.full((LAYERS,), threshold / 4.0)
    plain = scheme.apply(variables, length).terms[0].value
    moved = scheme.apply(variables, length, None, shifted).terms[0].value[:, 0]
    assert np.allclose(moved, plain, rtol=1e-6, atol=1e-6) == same


def test_interpolated_distance_of_earlier_keys_lies_in_zero_one():
  """``psi(i - j) / psi(max(L, i))`` for ``0 <= j <= i`` at any ``c`` and ``L``: the bounded
  input that lets the MLP interpolate to unseen lengths (section 3)."""
  pos = jnp.arange(40.0)
  rel, query = pos[:, None] - pos[None, :], pos[:, None]
  for c, threshold in ((0.1, 512.0), (3.0, 5.0), (0.01, 1.0)):
    x = interpolated_distance(rel, query, c, threshold, 1e-6, True)
    lower = np.tril(np.ones((40, 40), bool))
    assert np.all((x[lower] >= 0) & (x[lower] <= 1))
    signed = interpolated_distance(rel, query, c, threshold, 1e-6, False)
    np.testing.assert_array_equal(signed, jnp.where(lower, x, -x))


@pytest.mark.parametrize("sharing,layers", [("none", LAYERS), ("layer", 1)])
def test_initialisation_is_the_listings(sharing, layers):
  """``c = 0.1``, the multiplier 1 (so ``L = init_L = 512``), the MLP ``1 -> 32 -> H`` with
  PyTorch's ``nn.Linear`` default ``U(+-1/sqrt(fan_in))``."""
  scheme = build_scheme({"name": "fire", "sharing": sharing}, **DIMS)
  params = jax.tree.map(np.asarray, scheme.init(jax.random.key(0), 5)["params"])
  params = {k: getattr(v, "value", v) for k, v in params.items()}
  shapes = {k: v.shape for k, v in params.items()}
  assert shapes == {"hidden_kernel": (layers, 32), "hidden_bias": (layers, 32),
                    "output_kernel": (layers, 32, H), "output_bias": (layers, H),
                    "c": (layers,), "L_multiplier": (layers,)}
  np.testing.assert_array_equal(params["c"], np.float32(0.1))
  np.testing.assert_array_equal(params["L_multiplier"], 1.0)
  for name, bound in (("hidden_kernel", 1.0), ("hidden_bias", 1.0),
                      ("output_kernel", 32 ** -0.5), ("output_bias", 32 ** -0.5)):
    x = params[name]
    assert np.all(np.abs(x) <= bound) and np.abs(x).max() > bound / 2, name
  if layers > 1:
    assert not np.array_equal(params["hidden_kernel"][0], params["hidden_kernel"][1])


def test_decoders_take_the_causal_form():
  assert causal_variant({"name": "fire"}) == {"name": "fire", "causal": True}



# --- decoding on the causal form (the other generic checks run on conftest's entries) ---

@pytest.mark.parametrize("route", ["auto", "fused"])
def test_cached_attention_step_equals_the_full_pass(route):
  test_decoding.test_scheme_terms_slice_and_kv_cache("fire_causal_shared", route)


def test_language_model_decodes_as_it_is_teacher_forced(monkeypatch):
  """tests/test_lm.py's check: the decoder builds the causal form (per layer) and one cached
  step per position equals the teacher-forced logits, scanned and unrolled."""
  monkeypatch.setitem(test_lm.SCHEMES, "fire", {"name": "fire", "mlp_width": 4, "init_L": 3.0})
  test_lm.test_cached_decoding_equals_teacher_forcing_in_both_layouts("fire")

