"""xPos (Sun et al., ACL 2023) against a float64 numpy transcription of the reference
implementation (microsoft/torchscale's ``XPOS``, its training and its incremental decoding
form), the relative property, the float32 range its docstring states, the Rotation term's
scales, errors, and the generic checks (cached decoding, shifted ids)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posenc_jax import Rotation, SchemeConfigError, attend, build_scheme
from tests import test_decoding, test_position_ids
from tests.conftest import DIMS
from tests.test_schemes import assert_toeplitz

D = 8
WIDE = dict(DIMS, head_dim=D, d_model=4 * D)
LENGTH = 12
NAME = "xpos_half_partial"  # tests/conftest.py's SCHEME_CONFIGS entry


def rotation(config=None, length=LENGTH, position_ids=None, **dims):
  """The scheme's Rotation term (one layer)."""
  scheme = build_scheme({"name": "xpos", **(config or {})}, **(WIDE | dims))
  return scheme.apply({}, length, None, position_ids).for_layer(0)[0]


def random_qk(length=LENGTH, batch=2, seed=1):
  keys = jax.random.split(jax.random.key(seed))
  return tuple(jax.random.normal(key, (batch, length, 3, D)) for key in keys)


def logits64(q, k):
  """``q . k`` per head, ``[B, H, Lq, Lk]``, in float64."""
  return np.einsum("bihd,bjhd->bhij", np.asarray(q, np.float64), np.asarray(k, np.float64))


def reference_xpos(x, offset=0, downscale=False, scale_base=512.0):
  """torchscale's ``XPOS(head_dim, scale_base)(x, offset, downscale)`` in float64 numpy:
  the rows of ``x`` ``[B, L, H, D]`` are the last ``L`` of a sequence of ``L + offset``
  positions; their angles are RoPE's at ``0 .. L + offset - 1``, their scales
  ``zeta^(p / scale_base)`` at the positions ``p`` counted from ``-(L + offset) // 2``
  (Python's floor), inverted for keys (``downscale``)."""
  x = np.asarray(x, np.float64)
  length, dim = x.shape[1], x.shape[-1]
  total = length + offset
  zeta = (np.arange(0, dim, 2) + 0.4 * dim) / (1.4 * dim)
  first = -total // 2
  scale = zeta[None, :] ** (np.arange(first, first + total)[:, None] / scale_base)
  inv_freq = 1.0 / 10000 ** (np.arange(dim // 2) / (dim // 2))
  angles = np.arange(total)[:, None] * inv_freq[None, :]
  sin, cos, scale = (a[-length:] for a in (np.sin(angles), np.cos(angles), scale))
  if downscale:
    scale = 1.0 / scale
  # Each pair's factor on both of its features, (x_2k, x_2k+1) -> (-x_2k+1, x_2k).
  cos, sin = (np.repeat(a * scale, 2, axis=-1)[None, :, None, :] for a in (cos, sin))
  turned = np.stack([-x[..., 1::2], x[..., 0::2]], axis=-1).reshape(x.shape)
  return x * cos + turned * sin


# --- the reference implementation -------------------------------------------------------------

@pytest.mark.parametrize("scale_base", [512.0, 4.0])
def test_transform_matches_reference(scale_base):
  """q and k transformed as torchscale's XPOS does in training (offset 0): the default
  scale base 512 and a small one, where the scales reach 3.5^(6/4) = 6.5."""
  term = rotation({"scale_base": scale_base})
  q, k = random_qk()
  ours_q, ours_k = term.transform_qk(q, k)
  np.testing.assert_allclose(ours_q, reference_xpos(q, scale_base=scale_base), rtol=2e-6,
                             atol=2e-6)
  np.testing.assert_allclose(ours_k, reference_xpos(k, downscale=True, scale_base=scale_base),
                             rtol=2e-6, atol=2e-6)


def test_decoding_steps_give_the_reference_logits():
  """torchscale's incremental decoding recentres each step on the keys seen so far (keys
  at offset 0 over t + 1 positions, the query at offset t); a step here keeps the centre of
  the whole decode length. Other q and k, the same logits."""
  scale_base = 4.0
  term = rotation({"scale_base": scale_base})
  q, k = random_qk()
  for t in range(LENGTH):
    ours_q, ours_k = term.slice_queries(t, 1).transform_qk(q[:, t:t + 1], k)
    ref_q = reference_xpos(q[:, t:t + 1], offset=t, scale_base=scale_base)
    ref_k = reference_xpos(k[:, :t + 1], downscale=True, scale_base=scale_base)
    np.testing.assert_allclose(logits64(ours_q, ours_k)[..., :t + 1], logits64(ref_q, ref_k),
                               rtol=1e-5, atol=1e-5)


def test_default_is_the_reference_setting():
  module = build_scheme({"name": "xpos"}, **WIDE)
  assert module.init(jax.random.key(0), LENGTH) == {}
  assert (module.scale_base, module.base, module.layout, module.fraction) == (
      512.0, 10000.0, "interleaved", 1.0)
  term = rotation()
  # The reference's scales: the first pair's zeta 0.4 / 1.4 at positions -6 .. 5.
  np.testing.assert_allclose(term.q_scale[:, 0], (2 / 7) ** (np.arange(-6, 6) / 512), rtol=1e-6)
  rope = build_scheme({"name": "rope"}, **WIDE).apply({}, LENGTH).for_layer(0)[0]
  np.testing.assert_array_equal(term.q_angles, rope.q_angles)  # RoPE's angles, bit for bit


# --- the relative property ------------------------------------------------------------------

def test_logits_depend_on_the_offset_only():
  """The same q vector at every position and the same k vector at every position: logit
  (n, m) is a function of n - m (Toeplitz), and it is not RoPE's (the decay is there)."""
  config = {"layout": "half", "fraction": 0.5, "scale_base": 4.0}
  vec_q, vec_k = jax.random.normal(jax.random.key(3), (2, D))
  q = jnp.broadcast_to(vec_q, (1, LENGTH, 1, D))
  k = jnp.broadcast_to(vec_k, (1, LENGTH, 1, D))
  matrix = logits64(*rotation(config).transform_qk(q, k))[0, 0]
  assert_toeplitz(matrix, atol=1e-5)
  rope = build_scheme({"name": "rope", "layout": "half", "fraction": 0.5}, **WIDE)
  plain = logits64(*rope.apply({}, LENGTH).for_layer(0)[0].transform_qk(q, k))[0, 0]
  assert np.abs(matrix - plain).max() > 1e-1


@pytest.mark.parametrize("shift", [0, 5])
def test_shifting_both_positions_keeps_the_logits(shift):
  """q and k at positions 0..L-1, and at shift..shift+L-1 of a longer sequence (another
  centre, other angles): the same logits, computed in float64 from the transformed q, k."""
  config = {"layout": "half", "fraction": 0.5, "scale_base": 4.0}
  q, k = random_qk()
  plain = logits64(*rotation(config).transform_qk(q, k))
  longer = LENGTH + 2 * shift + 3  # the centre moves by shift + 2

  def place(x):
    return jnp.zeros((2, longer, 3, D)).at[:, shift:shift + LENGTH].set(x)

  moved_q, moved_k = rotation(config, length=longer).transform_qk(place(q), place(k))
  rows = slice(shift, shift + LENGTH)
  np.testing.assert_allclose(logits64(moved_q[:, rows], moved_k[:, rows]), plain, rtol=1e-5,
                             atol=1e-5)


def test_position_ids_are_centred_per_row():
  """Each row's ids centred on the middle of their span: ids 0..L-1 give the scales of no ids
  bit for bit, ids 3..L+2 the same scales and angles 3 turns further."""
  ids = jnp.arange(LENGTH, dtype=jnp.int32)[None] + jnp.array([[0], [3]], jnp.int32)
  plain, moved = rotation(), rotation(position_ids=ids)
  assert moved.q_scale.shape == (2, LENGTH, D // 2)
  for row in range(2):
    np.testing.assert_array_equal(moved.q_scale[row], plain.q_scale)
    np.testing.assert_array_equal(moved.k_scale[row], plain.k_scale)
  np.testing.assert_allclose(moved.q_angles[1], rotation(length=LENGTH + 3).q_angles[3:],
                             rtol=1e-6)


# --- the float32 range the docstring states -------------------------------------------------

def test_scales_stay_normal_up_to_the_stated_length():
  """Default scale base 512: the extreme scales 3.5^(+-ceil(L/2) / 512) stay normal float32
  (and bfloat16) at L = 71,388; the largest overflows from L = 72,521."""
  tiny, huge = np.finfo(np.float32).tiny, np.finfo(np.float32).max
  assert math.ceil(71388 / 2) * math.log(3.5) / 512 <= -math.log(tiny)
  assert math.ceil(72521 / 2) * math.log(3.5) / 512 > math.log(huge)
  term = rotation(length=71388)
  for scale in (term.q_scale, term.k_scale, term.q_scale.astype(jnp.bfloat16)):
    assert bool(jnp.all(jnp.isfinite(scale))) and float(jnp.min(scale)) >= tiny
  assert not bool(jnp.all(jnp.isfinite(rotation(length=72521).q_scale)))


# --- the term's scales and the errors -------------------------------------------------------

def test_sliced_scaled_rotation_is_rows_of_the_full_one():
  """tests/test_decoding.py's query-slicing check on a Rotation with scales."""
  length, dim = test_decoding.LENGTH, test_decoding.D
  term = Rotation(test_decoding.normal(0, (length, dim // 2)),
                  test_decoding.normal(1, (length, dim // 2)),
                  q_scale=jnp.exp(test_decoding.normal(2, (length, dim // 2))),
                  k_scale=jnp.exp(test_decoding.normal(3, (length, dim // 2))))
  test_decoding.test_sliced_qk_transform_is_rows_of_full_transform(term)


@pytest.mark.parametrize("q_scale,k_scale,message", [
    (jnp.ones((LENGTH,)), None, "q_scale is [12]; expected [L, R/2] or [B|1, L, R/2]"),
    (jnp.ones((LENGTH - 1, 4)), None, "q_scale [11, 4] has 11 positions, but q has 12"),
    (None, jnp.ones((LENGTH, 3)), "k_scale [12, 3] has 3 pairs, but q_angles has 4"),
    (jnp.ones((3, LENGTH, 4)), None, "q_scale [3, 12, 4] has 3 examples, but q has 2"),
])
def test_rotation_scale_errors(q_scale, k_scale, message):
  term = Rotation(jnp.ones((LENGTH, 4)), jnp.ones((LENGTH, 4)), q_scale=q_scale,
                  k_scale=k_scale)
  q, k = random_qk()
  with pytest.raises(ValueError) as error:
    attend(q, k, k, [term])
  assert str(error.value) == f"attend: terms[0] (Rotation): {message}"


@pytest.mark.parametrize("config,dims,message", [
    (dict(scale_base=0), {}, "scale_base must be a finite positive number, got 0"),
    (dict(scale_base=-512.0), {}, "scale_base must be a finite positive number, got -512.0"),
    (dict(scale_base=float("inf")), {}, "scale_base must be a finite positive number, got inf"),
    (dict(scale_base="512"), {}, "scale_base must be a finite positive number, got '512'"),
    (dict(scale_base=True), {}, "scale_base must be a finite positive number, got True"),
    (dict(scaling="yarn"), {}, "unknown field 'scaling'"),
    (dict(base=1.0), {}, "base must be a finite number > 1, got 1.0"),
    (dict(layout="neox"), {}, "layout must be one of 'interleaved', 'half', got 'neox'"),
    (dict(fraction=0.3), {"head_dim": 10, "d_model": 40},
     "fraction must make the rotated dims, round(fraction * head_dim), an even number >= 2, "
     "got round(0.3 * 10) = 3"),
    ({}, {"head_dim": 7}, "head_dim must be even, got 7"),
])
def test_invalid_configs_raise_one_line(config, dims, message):
  with pytest.raises(SchemeConfigError) as error:
    build_scheme({"name": "xpos", **config}, **(WIDE | dims))
  assert str(error.value).startswith("scheme 'xpos': ")
  assert message in str(error.value)
  assert "\n" not in str(error.value)


# --- the generic checks on SCHEME_CONFIGS[NAME] -------------------------------------------

def test_cached_attention_steps_equal_teacher_forcing():
  """tests/test_decoding.py's check: sliced query rows equal rows of the full attention, and
  one cached MultiHeadAttention step per position equals causal attention."""
  test_decoding.test_scheme_terms_slice_and_kv_cache(NAME, "auto")


def test_relative_in_the_ids():
  """tests/test_position_ids.py's check for relative schemes: ids shifted per row."""
  test_position_ids.test_relative_terms_depend_on_id_differences_only(NAME)

