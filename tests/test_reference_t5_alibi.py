"""T5 buckets and ALiBi slopes against the reference implementations' formulas.

T5: ``_relative_position_bucket`` of mesh-tensorflow (``transformer/transformer_layers.py``)
and flaxformer (``components/relative_position_biases.py``), restated below in pure Python
float64. ALiBi: ``get_slopes`` of ofirpress/attention_with_linear_biases (also BLOOM's,
Hugging Face's and flash-attention's), restated in pure Python.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posenc_jax import build_scheme
from posenc_jax.schemes import SchemeConfigError, alibi_slopes, relative_position_bucket
from posenc_jax.schemes.t5 import t5_bias
from posenc_jax.terms import offsets
from tests.conftest import init_scheme

FLAXFORMER_EPS = float(np.finfo(np.float32).eps)


def reference_bucket(r, bidirectional, num_buckets, max_distance, eps=FLAXFORMER_EPS):
  """The bucket of offset ``r = j - i`` by the reference formula in float64: flaxformer's
  (``eps`` added to ``n / max_exact`` inside the log), mesh-tensorflow's with ``eps=0``."""
  n, first = -r, 0
  if bidirectional:
    num_buckets //= 2
    first = num_buckets if n < 0 else 0
    n = abs(n)
  else:
    n = max(n, 0)
  max_exact = num_buckets // 2
  if n < max_exact:
    return first + n
  log_share = math.log(n / max_exact + eps) / math.log(max_distance / max_exact)
  return first + min(max_exact + int(log_share * (num_buckets - max_exact)), num_buckets - 1)


# (num_buckets, max_distance, bidirectional).
BUCKET_SETTINGS = [
    (32, 128, True), (32, 128, False),  # T5
    # Float32 logs put an exact power one bucket low: |r| = 10, 20, 20 and 20 * 5^k.
    (6, 100, True), (8, 200, True), (4, 200, False), (20, 1000, False),
    (10, 160, False),  # float64 without the eps drops |r| = 10 (an exact power) too
    (8, 6, True), (8, 24, True), (11, 24, False), (8, 5, False),  # this suite's tables
    (4, 3, True), (2, 2, False), (3, 2, False),  # the fewest buckets, the shortest log range
    (128, 1000, False), (64, 4096, True),
    (16, 2**40, True),  # late buckets start past the int32 offsets
]
OFFSETS = np.arange(-3000, 3001, dtype=np.int32)
# Array lengths the offsets are bucketed in (XLA vectorises float code by length).
CHUNKS = [1, 2, 7, 51, 64, 1000]


def expected_buckets(setting):
  return np.array([reference_bucket(int(r), setting[2], *setting[:2]) for r in OFFSETS])


def bucket_fn(setting):
  num_buckets, max_distance, bidirectional = setting
  return lambda rel: relative_position_bucket(rel, bidirectional=bidirectional,
                                              num_buckets=num_buckets, max_distance=max_distance)


@pytest.mark.parametrize("setting", BUCKET_SETTINGS, ids=str)
def test_buckets_equal_the_reference_at_every_array_length(setting):
  expected = expected_buckets(setting)
  bucket = bucket_fn(setting)
  whole = bucket(OFFSETS)
  assert whole.dtype == jnp.int32 and whole.shape == OFFSETS.shape
  np.testing.assert_array_equal(whole, expected)
  np.testing.assert_array_equal(jax.jit(bucket)(OFFSETS), expected)
  for chunk in CHUNKS:
    padded = np.pad(OFFSETS, (0, -len(OFFSETS) % chunk)).reshape(-1, chunk)
    # One chunk at a time, each bucketed as an array of its own length.
    got = jax.lax.map(bucket, padded).reshape(-1)[:len(OFFSETS)]
    np.testing.assert_array_equal(got, expected, err_msg=f"chunks of {chunk}")


@pytest.mark.parametrize("setting", BUCKET_SETTINGS, ids=str)
def test_offset_vectors_and_t5_bias_equal_the_reference(setting):
  num_buckets, max_distance, bidirectional = setting
  expected = expected_buckets(setting)  # at rel - OFFSETS[0]
  # The table holds each bucket's id, so the bias reads back the buckets.
  table = jnp.arange(num_buckets, dtype=jnp.float32)[None]
  for q_len, k_len in [(26, 26), (1, 3001), (3001, 1), (700, 1300)]:
    rel = offsets(q_len, k_len)
    np.testing.assert_array_equal(bucket_fn(setting)(rel), expected[rel - OFFSETS[0]])
    bias = t5_bias(table, q_len, k_len, bidirectional=bidirectional, max_distance=max_distance)
    rel_matrix = np.arange(k_len)[None] - np.arange(q_len)[:, None]
    np.testing.assert_array_equal(bias[0], expected[rel_matrix - OFFSETS[0]])


def test_an_offset_alone_and_in_a_vector_share_its_bucket():
  """The issue's case: 8 buckets, max distance 200, offset -20 (bucket 2 + 1, since
  (20 / 2)^2 = 200 / 2) alone and inside the 51 offsets of a 26-token sequence."""
  alone = relative_position_bucket(jnp.int32(-20), num_buckets=8, max_distance=200)
  inside = relative_position_bucket(offsets(26, 26), num_buckets=8, max_distance=200)
  assert int(alone) == int(inside[25 - 20]) == 3


@pytest.mark.parametrize("setting", BUCKET_SETTINGS, ids=str)
def test_mesh_tensorflow_float64_differs_only_at_exact_powers(setting):
  """Without flaxformer's eps the float64 formula may put ``n = e (D / e)^(k / m)`` one
  bucket low (``e`` the exact buckets of a direction, ``m`` its others); nowhere else."""
  num_buckets, max_distance, bidirectional = setting
  per_direction = num_buckets // 2 if bidirectional else num_buckets
  e = per_direction // 2
  m = per_direction - e
  ours = bucket_fn(setting)(OFFSETS)
  for r, bucket in zip(OFFSETS.tolist(), ours.tolist()):
    mesh_tf = reference_bucket(r, bidirectional, num_buckets, max_distance, eps=0.0)
    if mesh_tf != bucket:
      k = bucket % per_direction - e
      assert mesh_tf == bucket - 1 and abs(r)**m * e**k == max_distance**k * e**m, r


def test_exact_where_either_float64_form_rounds():
  """The buckets are the formula's in real arithmetic: bucket ``e + k`` starts at the
  least ``n`` with ``n^m e^k >= D^k e^m``."""
  # 10 causal buckets, max distance 160: n = 10 has (10/5)^5 = 160/5, so it starts bucket 6.
  assert reference_bucket(-10, False, 10, 160, eps=0.0) == 5
  assert int(relative_position_bucket(jnp.int32(-10), bidirectional=False, num_buckets=10,
                                      max_distance=160)) == 6
  # 58 causal buckets, max distance 282: n = 119 lies 5e-8 of a bucket below bucket 47,
  # which the eps crosses.
  e, m, d = 29, 29, 282
  assert 119**m * e**17 >= d**17 * e**m and 119**m * e**18 < d**18 * e**m
  assert reference_bucket(-119, False, 58, d) == 47
  assert reference_bucket(-119, False, 58, d, eps=0.0) == 46
  assert int(relative_position_bucket(jnp.int32(-119), bidirectional=False, num_buckets=58,
                                      max_distance=d)) == 46


def reference_slopes(num_heads):
  """``get_slopes`` restated: for a power of two ``n``, the ``n`` powers of ``2^(-8/n)``;
  otherwise those of the power of two ``p`` below, then the first ``n - p`` of every other
  slope for ``2p`` heads."""
  def powers(n):
    first = 2 ** (-8 / n)
    return [first ** (h + 1) for h in range(n)]
  if num_heads & (num_heads - 1) == 0:
    return powers(num_heads)
  p = 2 ** math.floor(math.log2(num_heads))
  return powers(p) + reference_slopes(2 * p)[::2][:num_heads - p]


def test_alibi_reference_slopes_for_twelve_heads():
  expected = [2.0 ** -k for k in range(1, 9)] + [2.0 ** -k for k in (0.5, 1.5, 2.5, 3.5)]
  np.testing.assert_allclose(alibi_slopes(12), expected, rtol=1e-7)
  np.testing.assert_allclose(alibi_slopes(12, "reference"), expected, rtol=1e-7)
  np.testing.assert_allclose(alibi_slopes(12, "geometric"),
                             [2.0 ** (-8 * h / 12) for h in range(1, 13)], rtol=1e-7)


@pytest.mark.parametrize("num_heads", [1, 2, 4, 8, 16, 32, 64])
def test_alibi_forms_agree_for_powers_of_two(num_heads):
  slopes = alibi_slopes(num_heads)
  assert slopes.dtype == jnp.float32 and slopes.shape == (num_heads,)
  np.testing.assert_array_equal(slopes, alibi_slopes(num_heads, "geometric"))
  np.testing.assert_allclose(slopes, [2.0 ** (-8 * h / num_heads)
                                      for h in range(1, num_heads + 1)], rtol=1e-7)


@pytest.mark.parametrize("num_heads", [3, 5, 6, 7, 12, 20, 24, 25, 40, 96])
def test_alibi_slopes_equal_get_slopes(num_heads):
  np.testing.assert_allclose(alibi_slopes(num_heads), reference_slopes(num_heads), rtol=1e-7)
  assert not np.allclose(alibi_slopes(num_heads), alibi_slopes(num_heads, "geometric"))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("form", ["reference", "geometric"])
def test_alibi_scheme_uses_the_configured_slopes(form, causal):
  config = {"name": "alibi", "causal": causal} | ({} if form == "reference" else {"slopes": form})
  _, _, st = init_scheme(config, num_heads=12, d_model=96)
  bias = np.asarray(st.for_layer(0)[0].logits(jnp.zeros((1, 10, 12, 8)), 1.0))[0]  # [H, L, L]
  slopes = np.asarray(alibi_slopes(12, form))
  np.testing.assert_allclose(bias[:, 7, 2], -slopes * 5, rtol=1e-6)
  np.testing.assert_allclose(bias[:, 2, 7], 0.0 if causal else -slopes * 5, rtol=1e-6)


def test_unknown_slopes_form_is_one_line():
  with pytest.raises(SchemeConfigError) as err:
    build_scheme({"name": "alibi", "slopes": "bogus"}, num_layers=1, num_heads=12, head_dim=8,
                 d_model=96)
  assert str(err.value) == ("scheme 'alibi': slopes must be one of 'reference', 'geometric', "
                            "got 'bogus'")
  with pytest.raises(ValueError, match=r"^alibi_slopes: form must be one of 'reference', "
                     r"'geometric', got 'paper'$"):
    alibi_slopes(12, "paper")
