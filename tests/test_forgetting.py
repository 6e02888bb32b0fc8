"""Forgetting gates (Lin et al., ICLR 2025, FoX) against a float64 transcription of the
paper's formula, its properties, the separable term in the Pallas kernel (interpret mode)
against the reference route in values and gradients to the gate parameters, packed rows,
bfloat16 inputs with large cumulative sums, the route plan, and cached decoding."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posenc_jax import attend, build_scheme, route_plan, route_table
from posenc_jax.kernels import relative_flash_attention
from posenc_jax.models import model_config
from posenc_jax.models.build import check_head
from posenc_jax.models.config import ModelConfigError
from posenc_jax.schemes import SchemeConfigError
from posenc_jax.terms import ForgettingGates, TermForm
from tests import test_decoding as decoding
from tests import test_lm
from tests.conftest import DIMS, attention_float64, padding_mask, qkv
from tests.test_attention import assert_grads_close

B, L, H, D, WIDTH = 2, 16, DIMS["num_heads"], DIMS["head_dim"], DIMS["d_model"]
TOL = dict(rtol=2e-5, atol=2e-5)


def gate_params(seed=0):
  """Random ``w`` ``[d, H]`` and ``b`` ``[H]`` (gates well inside (0, 1)), float32."""
  rng = np.random.default_rng(seed)
  return (rng.normal(0, 0.3, (WIDTH, H)).astype(np.float32),
          rng.normal(1.0, 1.0, H).astype(np.float32))


def inputs(seed=1, length=L):
  return jax.random.normal(jax.random.key(seed), (B, length, WIDTH))


def reference_bias(w, b, x):
  """``[B, H, L, L]`` float64 from the paper (numpy only): ``f_t = sigmoid(w_h . x_t + b_h)``,
  entry ``(i, j)`` the sum of ``log f_l`` over ``l = j+1..i`` for ``j <= i`` (0 above)."""
  x, w, b = (np.asarray(a, np.float64) for a in (x, w, b))
  log_f = np.log(1.0 / (1.0 + np.exp(-(np.einsum("bld,dh->bhl", x, w) + b[:, None]))))
  length = x.shape[1]
  bias = np.zeros(log_f.shape[:2] + (length, length))
  for i in range(length):
    for j in range(i + 1):
      bias[:, :, i, j] = log_f[:, :, j + 1:i + 1].sum(-1)
  return bias


def term(w, b, x, segment_ids=None):
  """The scheme's layer-0 term with ``w``, ``b`` as its parameters, given the layer input."""
  module = build_scheme({"name": "fox", "sharing": "layer"}, **DIMS)
  variables = {"params": {"weight": jnp.asarray(w)[None], "bias": jnp.asarray(b)[None]}}
  (t,) = module.apply(variables, x.shape[1]).for_layer(0)
  return t.with_inputs(x, segment_ids)


def test_term_and_attention_equal_the_float64_formula():
  w, b = gate_params()
  x = inputs()
  want = reference_bias(w, b, x)
  causal = np.tril(np.ones((L, L), bool))
  q, k, v = qkv(length=L)

  @jax.jit
  def run(x):
    t = term(w, b, x)
    return t.logits(q, 1.0), attend(q, k, v, [t], causal=True, route="reference")

  got, out = run(x)
  np.testing.assert_allclose(np.where(causal, got, 0.0), want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out, attention_float64(q, k, v, D**-0.5, want, causal), **TOL)


def test_diagonal_is_zero_and_the_bias_falls_with_the_distance():
  """``b(i, i) = 0`` and ``b(i, j - 1) <= b(i, j)`` for ``j <= i`` (each step adds a
  ``log f < 0``); a wrong sign or an off-by-one in the sum's range breaks one of them."""
  w, b = gate_params(3)
  bias = np.asarray(jax.jit(lambda x: term(w, b, x).logits(jnp.zeros((B, L, H, D)), 1.0))(
      inputs(4)))
  np.testing.assert_array_equal(np.diagonal(bias, axis1=-2, axis2=-1), 0.0)
  steps = bias[..., :, 1:] - bias[..., :, :-1]  # b(i, j) - b(i, j - 1)
  below = np.tril(np.ones((L, L - 1), bool), 0)  # j = 1..i
  assert np.all(steps[..., below] > 0)


def test_initialisation_is_the_reference_codes():
  """zhixuan-lin/forgetting-transformer's ``fgate_proj``: ``N(0, 0.02)`` weights, zero bias,
  one per layer by default."""
  module = build_scheme({"name": "fox"}, **{**DIMS, "d_model": 256})
  params = nn.unbox(module.init(jax.random.key(0), L)["params"])
  assert params["weight"].shape == (DIMS["num_layers"], 256, H)
  np.testing.assert_allclose(np.std(params["weight"]), 0.02, rtol=0.1)
  np.testing.assert_array_equal(params["bias"], 0.0)


def test_fused_route_equals_reference_in_values_and_gradients():
  """The Pallas kernel (interpret mode, two 16-row blocks) adds ``r_i + s_j`` in its tiles
  and returns ``dr = sum_j dS``, ``ds = sum_i dS``: values and gradients to q, k, v, ``w``,
  ``b`` and ``x`` equal the reference route's, with packed segments in row 0 and padding in
  row 1."""
  w, b = gate_params(5)
  x = inputs(6, 24)
  q, k, v = qkv(length=24)
  ids = jnp.array([[1] * 10 + [2] * 14, [1] * 24])
  kwargs = {"segment_ids": ids, "mask": padding_mask(length=24)}

  def loss(route):
    def f(q, k, v, w, b, x):
      t = term(w, b, x, ids)
      return jnp.sum(jnp.sin(attend(q, k, v, [t], causal=True, route=route, **kwargs)))
    return jax.jit(jax.value_and_grad(f, argnums=range(6)))(q, k, v, jnp.asarray(w),
                                                            jnp.asarray(b), x)

  (ref, ref_grads), (fus, fus_grads) = loss("reference"), loss("fused")
  np.testing.assert_allclose(fus, ref, **TOL)
  assert_grads_close(fus_grads, ref_grads)
  assert float(jnp.abs(fus_grads[3]).max()) > 1e-3  # the gates are learnt through the kernel


def test_a_packed_row_has_each_sequences_vectors():
  """The cumulative sums restart at each segment: a packed row's ``r`` and ``s`` over each
  sequence's tokens are that sequence's alone, not offset by the gates before it (so its
  attention, whose segment mask keeps only those blocks, is each sequence's alone); float32
  sums in another order."""
  w, b = gate_params(7)
  x = inputs(8, L)[:1]
  ids = jnp.array([[1] * 9 + [2] * 7])
  vectors = lambda x, ids=None: term(w, b, x, ids).vectors(x.shape[1])  # noqa: E731
  rows, cols = jax.jit(vectors)(x, ids)
  for part in (slice(0, 9), slice(9, L)):
    alone = jax.jit(vectors)(x[:, part])
    np.testing.assert_allclose(rows[..., part], alone[0], rtol=1e-6, atol=2e-6)
    np.testing.assert_allclose(cols[..., part], alone[1], rtol=1e-6, atol=2e-6)


def test_bfloat16_inputs_keep_the_vectors_in_float32():
  """``c`` near -1e4 (one tiny first gate, which enters no sum): the kernel, given bfloat16
  q, k, v, adds ``r_i + s_j = c_i - c_j`` in float32 and matches the float32 reference to
  bfloat16 rounding; the same vectors rounded to bfloat16 first (spacing 64 there) do not."""
  q, k, v = (a.astype(jnp.bfloat16) for a in qkv(length=L))
  steps = jax.nn.log_sigmoid(jax.random.normal(jax.random.key(9), (B, H, L)) + 1.0)
  c = jnp.cumsum(steps.at[..., 0].set(-1e4), axis=-1)
  f32 = [a.astype(jnp.float32) for a in (q, k, v)]
  want = attention_float64(*f32, D**-0.5, c[..., :, None] - c[..., None, :],
                           np.tril(np.ones((L, L), bool)))
  run = jax.jit(lambda r, s: relative_flash_attention(q, k, v, row_bias=r, col_bias=s,
                                                      causal=True, block_q=16, block_k=16))
  np.testing.assert_allclose(run(c, -c).astype(jnp.float32), want, atol=3e-2)
  rounded = c.astype(jnp.bfloat16)
  assert np.abs(run(rounded, -rounded).astype(jnp.float32) - want).max() > 0.2


FORMS = [TermForm("ForgettingGates", entry="separable", causal_separable=True)]
SHAPE = (2, 512, 4, 64)


@pytest.mark.parametrize("device,mask,want", [
    # Packed segments (cuDNN takes no segment ids): the kernel takes the two vectors; the
    # Hopper passes decline them.
    (route_plan.Device("gpu", "NVIDIA H100 80GB HBM3", "9.0"), "segments",
     ("kernel", ("vectors",), "tiles", True)),
    # Without packed segments, the key vector folds into q/k channels for cuDNN.
    (route_plan.Device("gpu", "NVIDIA H100 80GB HBM3", "9.0"), "key",
     ("dot_product_attention", ("channels",), "tiles", False)),
    # No splash attention on TPU: it takes no bias.
    (route_plan.Device("tpu", "TPU v5 lite"), "none", ("kernel", ("vectors",), "tiles", True)),
    # A 4-D mask: the kernel cannot run, dot_product_attention takes r_i + s_j as a bias.
    (route_plan.Device("gpu", "NVIDIA H100 80GB HBM3", "9.0"), "full",
     ("dot_product_attention", ("broadcast",), None, None)),
])
def test_the_plan_sends_separable_terms_to_the_kernel(device, mask, want):
  assert FORMS == [term(*gate_params(), inputs()).fused_form()]
  segments = mask == "segments"
  plan = route_plan.plan(SHAPE, SHAPE, SHAPE, "bfloat16", FORMS,
                         mask="key" if segments else mask, causal=True, segments=segments,
                         device=device, table=route_table.RouteTable())
  kernel = plan.kernel
  got = (plan.runner, plan.entries, kernel and kernel.forward,
         kernel and kernel.separable and kernel.backward == "tiles")
  assert got == want


def test_the_hopper_kernels_decline_a_separable_term():
  q = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="^forward: 'hopper' takes no row_bias or col_bias"):
    relative_flash_attention(q, q, q, row_bias=jnp.zeros((1, 1, 64)), forward="hopper")


def test_cached_decoding_equals_teacher_forcing():
  """tests/test_decoding.py's check (slicing, then one cached MultiHeadAttention step per
  position, whose log gates go to the cache, against the whole sequence)."""
  decoding.test_scheme_terms_slice_and_kv_cache("fox", "auto")


def test_language_model_decodes_as_it_is_teacher_forced(monkeypatch):
  """tests/test_lm.py's check: one cached step per position equals the teacher-forced
  logits, scanned and unrolled layers."""
  monkeypatch.setitem(test_lm.SCHEMES, "fox", {"name": "fox"})
  test_lm.test_cached_decoding_equals_teacher_forcing_in_both_layouts("fox")


def test_errors_are_one_line_naming_the_field():
  with pytest.raises(SchemeConfigError, match="^scheme 'fox': sharing must be one of 'none', "
                     "'layer', got 'head'$"):
    build_scheme({"name": "fox", "sharing": "head"}, **DIMS)
  bad = ForgettingGates(jnp.zeros((WIDTH, H + 1)), jnp.zeros(H + 1))
  q = jnp.zeros((B, L, H, D))
  with pytest.raises(ValueError, match=r"^attend: terms\[0\] \(ForgettingGates\): weight "
                     r"\[32, 5\] has 5 heads, but q has 4$"):
    attend(q, q, q, [bad], causal=True)


def test_bidirectional_stacks_refuse_it():
  """Causal only: the language model takes it, the BERT encoder refuses it in one line."""
  cfg = model_config(vocab_size=100, d_model=32, num_layers=2, num_heads=4, mlp_dim=64,
                     max_len=64, segment=None, scheme={"name": "fox"})
  check_head(cfg, "lm")
  with pytest.raises(ModelConfigError, match="^model.scheme: got 'fox' in the BERT encoder, a "
                     "bidirectional stack") as e:
    check_head(cfg, "mlm")
  assert "\n" not in str(e.value)
