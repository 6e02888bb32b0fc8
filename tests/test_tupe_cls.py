"""TUPE-R's [CLS] reset in the reference code's form (``cls_buckets``): the reference's
bucket matrix, the default's parameters, both routes, cached decoding, one-line errors."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posenc_jax import attend, build_scheme
from posenc_jax.schemes import SchemeConfigError, Tupe, relative_position_bucket
from posenc_jax.schemes import validate_scheme_config
from posenc_jax.terms import Factored, Toeplitz
from tests import test_attention, test_decoding
from tests.conftest import DIMS, LENGTH, SCHEME_CONFIGS, init_scheme, qkv
from tests.test_schemes import Q, tupe_reference
from tests.test_sharing import GOLDEN, describe_params, param_count

NAME = "tupe_r_cls_buckets"
CONFIG = {**SCHEME_CONFIGS["tupe_r"], "cls_buckets": True}
NUM_BUCKETS, MAX_DISTANCE = CONFIG["num_buckets"], CONFIG["max_distance"]
H, D = DIMS["num_heads"], DIMS["head_dim"]


@pytest.fixture
def registered(monkeypatch):
  """CONFIG as a ``SCHEME_CONFIGS`` entry, for the suite's scheme-wide checks."""
  monkeypatch.setitem(SCHEME_CONFIGS, NAME, CONFIG)
  return NAME


def reference_relative_bias(table, cls_table, length):
  """``[H, L, L]``: guolinke/TUPE's ``get_rel_pos_bias`` after its [CLS] edit of ``rp_bucket``.

  The reference's ``[num_buckets + 1, H]`` table is the library's ``relative_bias``
  (transposed) with entry ``num_buckets // 2`` (a bucket T5's bidirectional bucketing
  never produces) holding [CLS]-to-others and an appended entry ``num_buckets`` holding
  others-to-[CLS]; column 0 takes the latter, then row 0 the former.
  """
  rel = np.arange(length)[None, :] - np.arange(length)[:, None]
  rp_bucket = np.array(relative_position_bucket(jnp.asarray(rel), num_buckets=NUM_BUCKETS,
                                                max_distance=MAX_DISTANCE))
  rp_bucket[:, 0] = NUM_BUCKETS
  rp_bucket[0, :] = NUM_BUCKETS // 2
  weight = np.concatenate([np.asarray(table).T, np.asarray(cls_table)[1:]])
  weight[NUM_BUCKETS // 2] = cls_table[0]
  return weight[rp_bucket].transpose(2, 0, 1)


def test_bucket_of_row_0_is_unused_by_bidirectional_bucketing():
  rel = jnp.arange(-4 * MAX_DISTANCE, 4 * MAX_DISTANCE)
  buckets = relative_position_bucket(rel, num_buckets=NUM_BUCKETS, max_distance=MAX_DISTANCE)
  assert set(np.asarray(buckets).tolist()) == set(range(NUM_BUCKETS)) - {NUM_BUCKETS // 2}


def test_term_equals_the_reference_code():
  """Absolute part reset (column, then row), plus the relative bias with [CLS] buckets."""
  _, params, st = init_scheme(CONFIG)
  p = params["params"]
  factored, toeplitz = st.for_layer(0)
  total = np.asarray(factored.logits(Q, 1.0) + toeplitz.logits(Q, 1.0))[0]
  expected = (np.asarray(tupe_reference(params, LENGTH, relative=False))
              + reference_relative_bias(p["relative_bias"].value, p["cls_relative_bias"].value,
                                        LENGTH))
  np.testing.assert_allclose(total, expected, rtol=1e-5, atol=1e-4)  # entries up to ~50
  for h in range(H):
    assert np.ptp(total[h, 0]) == pytest.approx(0, abs=1e-5)  # row 0 constant, [0, 0] included
    assert np.ptp(total[h, 1:, 0]) == pytest.approx(0, abs=1e-5)
  # The buckets ride in the reset's rank-2 correction: the relative part stays a Toeplitz
  # term with row 0 and column 0 zeroed (the flash kernel's), the folded width D + 2.
  assert isinstance(factored, Factored) and factored.u.shape[-1] == D + 2
  assert isinstance(toeplitz, Toeplitz) and toeplitz.zero_first


def test_default_is_eq_11_with_the_same_parameters():
  """Without ``cls_relative_bias`` the default's parameters are TUPE-R's as before, and
  the reference form with zero buckets is the default."""
  module, params, _ = init_scheme(CONFIG)
  rest = {k: v for k, v in params["params"].items() if k != "cls_relative_bias"}
  default = build_scheme(SCHEME_CONFIGS["tupe_r"], **DIMS)
  zeros = jnp.zeros((2, H))
  got = module.apply({"params": {**rest, "cls_relative_bias": zeros}}, LENGTH).for_layer(0)
  want = default.apply({"params": rest}, LENGTH).for_layer(0)
  np.testing.assert_array_equal(sum(t.logits(Q, 1.0) for t in got),
                                sum(t.logits(Q, 1.0) for t in want))
  assert param_count(CONFIG) == param_count(SCHEME_CONFIGS["tupe_r"]) + 2 * H


def test_parameters_and_logical_axes(registered):
  golden = json.loads(GOLDEN.read_text())["tupe_r"]
  assert describe_params(registered) == {
      **golden, "params/cls_relative_bias": {"shape": [2, H], "axes": ["cls", "heads"]}}


@pytest.mark.parametrize("causal", [False, True])
def test_fused_route_matches_reference(registered, causal):
  test_attention.test_fused_route_matches_reference(registered, causal)


def test_fused_route_runs_the_kernel_and_builds_no_positional_lxl_tensor(registered):
  _, _, st = init_scheme(CONFIG)
  q, k, v = qkv()
  jaxpr = jax.make_jaxpr(lambda q, k, v: attend(q, k, v, st.for_layer(0), route="fused",
                                                scale=st.content_scale))(q, k, v)
  assert "relative_flash" in str(jaxpr)
  test_attention.test_fused_route_builds_no_positional_lxl_tensor(registered)


@pytest.mark.parametrize("route", ["auto", "fused"])
def test_cached_decoding_equals_teacher_forcing(registered, route):
  test_decoding.test_scheme_terms_slice_and_kv_cache(registered, route)


RESET = ("cls_buckets must be false unless relative and untie_cls are true (its buckets fill "
         "row 0 and column 0 of the [CLS] reset's relative bias), got ")


@pytest.mark.parametrize("make,message", [
    (lambda: validate_scheme_config({"name": "tupe_r", "cls_buckets": True, "untie_cls": False}),
     f"scheme 'tupe_r': {RESET}relative=True, untie_cls=False"),
    (lambda: Tupe(relative=False, cls_buckets=True),
     f"scheme 'tupe_a': {RESET}relative=False, untie_cls=True"),
    (lambda: validate_scheme_config({"name": "tupe_r", "cls_buckets": 1}),
     "scheme 'tupe_r': cls_buckets must be true or false, got 1"),
    (lambda: validate_scheme_config({"name": "tupe_a", "cls_buckets": True}),
     "scheme 'tupe_a': unknown field 'cls_buckets'"),
], ids=["tied-cls", "tupe-a-module", "not-bool", "tupe-a-field"])
def test_invalid_settings_raise_one_line(make, message):
  with pytest.raises(SchemeConfigError) as error:
    make()
  assert str(error.value).startswith(message)
  assert "\n" not in str(error.value)
