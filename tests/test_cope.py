"""CoPE (Golovneva et al. 2024): the term against a float64 transcription of the paper's
eqs. 3-6, its positions non-decreasing in the distance, gradients to the table and through
the gates, one-line errors, and cached decoding on the attention step and the language model
(the other generic checks run on conftest's entries ``cope`` and ``cope_shared``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from posenc_jax import attend, build_scheme
from posenc_jax.terms import ContextualPositions, contextual_positions
from tests import test_decoding, test_lm
from tests.conftest import DIMS

B, L, H, D, NPOS = 2, 7, 3, 4, 4  # NPOS < L: far keys are clipped at the last row


def draw(seed, *shape, dtype=np.float64):
  return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def cope_logits_float64(q, k, e, scale):
  """Eqs. 3-6 in loops: ``[B, H, L, L]`` for the keys ``j <= i`` (NaN above the diagonal)."""
  batch, length, heads, _ = q.shape
  last = e.shape[0] - 1
  out = np.full((batch, heads, length, length), np.nan)
  for b in range(batch):
    for h in range(heads):
      for i in range(length):
        gates = [1 / (1 + np.exp(-scale * q[b, i, h] @ k[b, t, h])) for t in range(length)]
        for j in range(i + 1):
          p = min(sum(gates[j:i + 1]), last)
          low = int(np.floor(p))
          f = p - low
          out[b, h, i, j] = ((1 - f) * q[b, i, h] @ e[low]
                             + f * q[b, i, h] @ e[min(low + 1, last)])
  return out


def test_term_equals_float64_transcription():
  q, k, e = draw(0, B, L, H, D), draw(1, B, L, H, D), draw(2, NPOS, D)
  k[:, :3] *= 3  # some gates near 0 and 1
  scale = 0.7
  want = cope_logits_float64(q, k, e, scale)
  term = ContextualPositions(jnp.asarray(e, jnp.float32)).with_keys(jnp.asarray(k, jnp.float32))
  got = np.asarray(term.logits(jnp.asarray(q, jnp.float32), scale))
  causal = np.tril(np.ones((L, L), bool))
  np.testing.assert_allclose(got[..., causal], want[..., causal], rtol=1e-5, atol=1e-5)


def test_attention_adds_the_term_to_scaled_content_logits():
  """attend hands the term its keys: causal attention equals softmax(c q.k + T) v in float64."""
  q, k, v, e = draw(3, B, L, H, D), draw(4, B, L, H, D), draw(5, B, L, H, D), draw(6, NPOS, D)
  scale = D ** -0.5
  logits = np.einsum("bihd,bjhd->bhij", q, k) * scale + cope_logits_float64(q, k, e, scale)
  logits = np.where(np.tril(np.ones((L, L), bool)), logits, -np.inf)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  want = np.einsum("bhij,bjhd->bihd", probs / probs.sum(-1, keepdims=True), v)
  f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
  for route in ("reference", "fused"):
    got = attend(f32(q), f32(k), f32(v), [ContextualPositions(f32(e))], causal=True, route=route)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_positions_grow_with_the_distance():
  """With ``e[r] = r u`` the interpolated term is ``p_ij q_i . u``, so it reads back the
  positions: ``p_ii = g_ii`` in (0, 1), non-increasing in ``j`` (non-decreasing in the
  distance ``i - j``), at most ``i - j + 1``, clipped at ``npos - 1``; gates of 1 give
  ``i - j + 1``, the token count."""
  q, k = draw(7, B, L, H, D, dtype=np.float32), draw(8, B, L, H, D, dtype=np.float32)
  npos = 6
  u = draw(9, D, dtype=np.float32)
  table = jnp.arange(npos, dtype=jnp.float32)[:, None] * u
  term = ContextualPositions(table).with_keys(jnp.asarray(k))
  p = np.asarray(term.logits(jnp.asarray(q), 0.5)) / np.einsum("bihd,d->bhi", q, u)[..., None]
  gates = jax.nn.sigmoid(0.5 * jnp.einsum("bihd,bjhd->bhij", q, k))
  expected = np.minimum(np.asarray(contextual_positions(gates)), npos - 1)
  np.testing.assert_allclose(p, expected, rtol=1e-4, atol=1e-4)
  diagonal = np.diagonal(p, axis1=-2, axis2=-1)
  assert np.all((diagonal > 0) & (diagonal < 1))
  distance = np.arange(L)[:, None] - np.arange(L)[None, :]
  causal = distance >= 0
  assert np.all(np.diff(np.where(causal, p, 0.0), axis=-1)[..., causal[:, 1:]] <= 1e-5)
  assert np.all(p[..., causal] <= (distance + 1)[causal] + 1e-5)
  ones = np.asarray(contextual_positions(jnp.ones((L, L))))
  np.testing.assert_array_equal(ones, np.where(causal, distance + 1, 0))


def test_gradients_to_the_table_and_through_the_gates_match_finite_differences():
  """The term's gradients to q, k (through the gates, its only path to the keys) and the
  table against central differences in float64; the reference route's (softmax in float32)
  finite and non-zero."""
  q, k, v = (jnp.asarray(draw(s, 1, 4, 2, 3, dtype=np.float32)) for s in (10, 11, 12))
  e = jnp.asarray(draw(13, 3, 3, dtype=np.float32))
  loss = lambda q, k, e: jnp.sum(  # noqa: E731
      attend(q, k, v, [ContextualPositions(e)], causal=True, route="reference") * v)
  grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, e)
  assert all(bool(jnp.all(jnp.isfinite(g))) and float(jnp.abs(g).max()) > 0 for g in grads)
  with jax.enable_x64(True):
    weights = jnp.asarray(draw(14, 1, 2, 4, 4))
    term_sum = lambda q, k, e: jnp.sum(  # noqa: E731
        ContextualPositions(e).with_keys(k).logits(q, 0.8) * weights)
    check_grads(term_sum, tuple(x.astype(jnp.float64) for x in (q, k, e)), order=1,
                modes=["rev"], eps=1e-6, atol=1e-6, rtol=1e-6)



def test_bad_table_and_missing_keys_raise_one_line():
  q = jnp.ones((1, 3, 2, 4))
  with pytest.raises(ValueError, match=r"^attend: terms\[0\] \(ContextualPositions\): table "
                                       r"\[5, 3\] has 3 features, but q has 4$"):
    attend(q, q, q, [ContextualPositions(jnp.ones((5, 3)))])
  with pytest.raises(ValueError, match=r"^ContextualPositions: keys are unset; attend sets them"):
    ContextualPositions(jnp.ones((5, 4))).logits(q, 1.0)


def test_table_starts_at_zero_with_npos_rows():
  for config, shape in (({"name": "cope"}, (2, DIMS["max_len"] + 1, DIMS["head_dim"])),
                        ({"name": "cope", "npos_max": 5, "sharing": "layer"},
                         (1, 5, DIMS["head_dim"]))):
    params = build_scheme(config, **DIMS).init(jax.random.key(0), 6)["params"]
    table = jax.tree.leaves(params)[0]
    assert table.shape == shape and not np.any(table)


# --- decoding (a step counts the gates of the keys up to its own position) ---------------

@pytest.mark.parametrize("route", ["auto", "fused"])
def test_cached_attention_step_equals_the_full_pass(route):
  test_decoding.test_scheme_terms_slice_and_kv_cache("cope", route)


def test_language_model_decodes_as_it_is_teacher_forced(monkeypatch):
  """tests/test_lm.py's check: one cached step per position equals the teacher-forced
  logits, scanned and unrolled, to float32 rounding (1e-5) on every backend.

  The matmuls run in full float32 (``jax.default_matmul_precision("float32")``; the CPU's
  default already). A GPU's default for float32 is TF32 on Ampere and later: inputs rounded
  to 10-bit mantissas (2^-11 ~ 4.9e-4 relative). The decoding step and the teacher-forced
  pass multiply different shapes, which cuBLAS reduces in different orders, so an input that
  differs in its last float32 bit can round to a different TF32 value; CoPE's gates and
  unscaled table term carry that into the logits (13/182 off by up to 6.9e-4 on an H200). A
  tolerance that admits TF32 would admit a wrong position by a fraction of a gate too;
  in float32 the two orders agree to float32 rounding, as on CPU."""
  monkeypatch.setitem(test_lm.SCHEMES, "cope", {"name": "cope", "npos_max": 5})
  with jax.default_matmul_precision("float32"):
    test_lm.test_cached_decoding_equals_teacher_forcing_in_both_layouts("cope")
