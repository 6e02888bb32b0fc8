"""KERPLE (Chi et al., NeurIPS 2022) against a float64 transcription of its two kernels, the
properties a wrong formula would break, the reference code's initialisation and bounds
(chijames/KERPLE, ``megatron/mpu/layers.py``), and both attention routes with gradients to
``r1`` and ``r2``."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posenc_jax import attend, build_scheme
from posenc_jax.schemes import Kerple, SchemeConfigError
from tests import test_decoding as decoding
from tests.conftest import DIMS, LENGTH, padding_mask, qkv
from tests.test_attention import _positional_lxl_tensors, assert_grads_close

HEADS = DIMS["num_heads"]
FORMS = ["log", "power"]


def reference_bias(form, r1, r2, positions):
  """``[H, L, L]`` float64 from the paper's two kernels (numpy only, no library helper):
  ``-r1 log(1 + r2 |i - j|)`` and ``-r1 |i - j|^r2`` at the given positions."""
  positions = np.asarray(positions, np.float64)
  distance = np.abs(positions[:, None] - positions[None, :])
  r1 = np.asarray(r1, np.float64)[:, None, None]
  r2 = np.asarray(r2, np.float64)[:, None, None]
  if form == "log":
    return -r1 * np.log(1.0 + r2 * distance)
  return -r1 * distance**r2


def random_r(form, seed):
  """Per-head ``r1, r2`` inside the bounds (``r2 <= 2`` for power), float32."""
  rng = np.random.default_rng(seed)
  r1 = rng.uniform(0.05, 3.0, HEADS)
  r2 = rng.uniform(0.05, 2.0 if form == "power" else 3.0, HEADS)
  return r1.astype(np.float32), r2.astype(np.float32)


def params(r1, r2):
  """``r1, r2`` ``[H]`` as the parameters of a layer-shared scheme (``[1, H]``)."""
  return {"params": {"r1": jnp.asarray(r1)[None], "r2": jnp.asarray(r2)[None]}}


def bias(form, variables, length=LENGTH, position_ids=None):
  """The materialised term: ``[H, L, L]`` (``[B, H, L, L]`` with ids)."""
  module = build_scheme({"name": f"kerple_{form}"}, **DIMS)
  (term,) = module.apply(variables, length, position_ids=position_ids).for_layer(0)
  value = term.materialise(length, length).value
  return value if position_ids is not None else value[0]


@pytest.mark.parametrize("form", FORMS)
def test_bias_equals_the_float64_formula(form):
  for seed in range(3):
    r1, r2 = random_r(form, seed)
    np.testing.assert_allclose(bias(form, params(r1, r2)),
                               reference_bias(form, r1, r2, np.arange(LENGTH)),
                               rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("form", FORMS)
def test_packed_position_ids_read_the_id_distance(form):
  r1, r2 = random_r(form, 3)
  ids = np.array([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])
  got = bias(form, params(r1, r2), position_ids=jnp.asarray(ids, jnp.int32))
  for b in range(2):
    np.testing.assert_allclose(got[b], reference_bias(form, r1, r2, ids[b]), rtol=2e-6,
                               atol=1e-6)


@pytest.mark.parametrize("form", FORMS)
def test_bias_is_toeplitz_zero_on_the_diagonal_and_decreasing_in_distance(form):
  """For random raw parameters (negative and too large ones too: they read the bounds), the
  bias depends on ``i - j`` only, symmetrically, is 0 at ``i = j`` and strictly falls as
  ``|i - j|`` grows."""
  rng = np.random.default_rng(7)
  for _ in range(4):
    raw = rng.normal(0.0, 2.0, (2, HEADS)).astype(np.float32)
    b = np.asarray(bias(form, params(*raw), length=12))
    n = b.shape[-1]
    for offset in range(-n + 1, n):
      diag = np.diagonal(b, offset, axis1=-2, axis2=-1)
      np.testing.assert_array_equal(diag, np.broadcast_to(diag[:, :1], diag.shape))
    np.testing.assert_array_equal(b, np.swapaxes(b, -1, -2))
    np.testing.assert_array_equal(np.diagonal(b, axis1=-2, axis2=-1), 0.0)
    assert np.all(np.diff(b[:, 0, :], axis=-1) < 0)


@pytest.mark.parametrize("form,r1_scale,r2_scale", [("log", 2.0, 1.0), ("power", 1.0, 2.0)])
def test_initialisation_is_the_reference_codes(form, r1_scale, r2_scale):
  """``ParallelKerpleLog``: ``r1 = 2 U``, ``r2 = U``; ``ParallelKerplePower``: ``r1 = U``,
  ``r2 = 2 U``; one value per head shared by all layers."""
  module = build_scheme({"name": f"kerple_{form}"}, **{**DIMS, "num_heads": 512})
  variables = jax.tree.map(np.asarray, nn.unbox(module.init(jax.random.key(0), 4)))["params"]
  for name, scale in (("r1", r1_scale), ("r2", r2_scale)):
    value = variables[name]
    assert value.shape == (1, 512)
    assert 0.0 <= value.min() and value.max() < scale
    assert abs(value.mean() - scale / 2) < 0.1 * scale


@pytest.mark.parametrize("sharing,shape", [("layer", (1, HEADS)), ("none", (2, HEADS)),
                                           ("head", (2, 1))])
def test_sharing_sets_the_parameter_axes(sharing, shape):
  module = build_scheme({"name": "kerple_power", "sharing": sharing}, **DIMS)
  shapes = jax.eval_shape(lambda key: nn.unbox(module.init(key, 4)), jax.random.key(0))
  assert {k: v.shape for k, v in shapes["params"].items()} == {"r1": shape, "r2": shape}


def test_bounds_read_the_reference_clamp_and_pass_the_gradient_through():
  """A raw ``r`` below 0.01 reads 0.01, a power ``r2`` above 2 reads 2 (the reference code
  clamps the parameters to these bounds), and the gradient is the one at the bound."""
  def total(r1, r2):
    return jnp.sum(bias("power", params(r1, r2)))

  outside = (jnp.full(HEADS, -1.0), jnp.full(HEADS, 5.0))
  at_bounds = (jnp.full(HEADS, 0.01), jnp.full(HEADS, 2.0))
  np.testing.assert_array_equal(bias("power", params(*outside)),
                                bias("power", params(*at_bounds)))
  got, want = jax.grad(total, (0, 1))(*outside), jax.grad(total, (0, 1))(*at_bounds)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  assert all(np.all(np.asarray(g) != 0) for g in got)
  ones, fives = np.ones(HEADS), np.full(HEADS, 5.0)  # the log form bounds r2 below only
  np.testing.assert_allclose(bias("log", params(ones, fives)),
                             reference_bias("log", ones, fives, np.arange(LENGTH)), rtol=2e-6)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("causal", [False, True])
def test_fused_route_equals_reference_in_values_and_r_gradients(form, causal):
  """The fused route (the Pallas kernel in interpret mode, fed the offset vector) against the
  reference route's materialised bias: loss and its gradient to ``r1, r2`` and to q, k, v."""
  module = build_scheme({"name": f"kerple_{form}"}, **DIMS)
  q, k, v = qkv()
  variables = params(*random_r(form, 11))

  def loss(route):
    def run(variables, q, k, v):
      (term,) = module.apply(variables, LENGTH).for_layer(0)
      out = attend(q, k, v, [term], mask=padding_mask(), causal=causal, route=route)
      return jnp.sum(jnp.sin(out))
    return jax.value_and_grad(run, argnums=(0, 1, 2, 3))(variables, q, k, v)

  (term,) = module.apply(variables, LENGTH).for_layer(0)
  assert term.fused_form().entry == "toeplitz"
  ref, ref_grads = loss("reference")
  fus, fus_grads = loss("fused")
  np.testing.assert_allclose(fus, ref, rtol=2e-5, atol=2e-5)
  assert all(np.all(np.asarray(g) != 0) for g in jax.tree.leaves(ref_grads[0]))
  assert_grads_close(fus_grads, ref_grads)


def test_fused_route_builds_no_positional_lxl_tensor():
  """Forward and backward, the term stays ``[H, 2L - 1]`` on the fused route."""
  assert _positional_lxl_tensors("kerple_log") == []


@pytest.mark.parametrize("name,route", [("kerple_log", "fused"),
                                        ("kerple_power_per_layer", "auto")])
def test_cached_decoding_equals_teacher_forcing(name, route):
  """test_decoding's check (sliced query rows, then one KV-cached step per position against
  causal attention over the whole sequence) for both forms."""
  decoding.test_scheme_terms_slice_and_kv_cache(name, route)


@pytest.mark.parametrize("config,message", [
    ({"name": "kerple_log", "form": "power"}, "scheme 'kerple_log': unknown field 'form'"),
    ({"name": "kerple_power", "sharing": "all"},
     "scheme 'kerple_power': sharing must be one of 'none', 'layer', 'head', got 'all'"),
    ({"name": "kerple"}, "scheme name 'kerple' is unknown"),
])
def test_invalid_configs_are_one_line_naming_the_field(config, message):
  with pytest.raises(SchemeConfigError, match=message) as error:
    build_scheme(config, **DIMS)
  assert "\n" not in str(error.value)


def test_invalid_form_and_length_are_one_line():
  with pytest.raises(SchemeConfigError,
                     match="scheme 'kerple': form must be one of 'log', 'power', got 'cubic'"):
    Kerple(form="cubic", **DIMS)
  with pytest.raises(SchemeConfigError, match="scheme 'kerple_log': length must be a positive"):
    build_scheme({"name": "kerple_log"}, **DIMS).init(jax.random.key(0), 0)
