"""The two attention routes agree (values and gradients) for every scheme."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posenc_jax import Factored, attend
from posenc_jax.terms import Bias
from tests.conftest import SCHEME_CONFIGS, init_scheme, padding_mask, qkv

TOL = dict(rtol=2e-5, atol=2e-5)


def assert_grads_close(got, want):
  """Gradients of two routes: float32 summation order differs (flash kernel vs softmax), so
  the absolute tolerance scales with each array's largest entry."""
  jax.tree.map(lambda a, b: np.testing.assert_allclose(
      a, b, rtol=TOL["rtol"], atol=TOL["atol"] * max(1.0, float(np.abs(b).max()))), got, want)


def _loss_fn(route, causal, scale):
  def loss(q, k, v, terms):
    out = attend(q, k, v, terms, mask=padding_mask(), causal=causal, scale=scale, route=route)
    return jnp.sum(jnp.sin(out))
  return loss


@pytest.mark.parametrize("causal", [False, True])
def test_fused_route_matches_reference(scheme_name, causal):
  _, _, st = init_scheme(SCHEME_CONFIGS[scheme_name])
  q, k, v = qkv()
  for layer in range(2):
    terms = st.for_layer(layer)
    if not all(t.fusable for t in terms):
      with pytest.raises(ValueError, match="route"):
        attend(q, k, v, terms, route="fused")
      continue
    args = (q, k, v, terms)
    ref, ref_grads = jax.value_and_grad(_loss_fn("reference", causal, st.content_scale),
                                        argnums=(0, 1, 2, 3))(*args)
    fus, fus_grads = jax.value_and_grad(_loss_fn("fused", causal, st.content_scale),
                                        argnums=(0, 1, 2, 3))(*args)
    np.testing.assert_allclose(fus, ref, **TOL)
    assert_grads_close(fus_grads, ref_grads)


@pytest.mark.parametrize("name", ["diet_rel", "diet_abs", "tupe_r", "rope", "dense_bias"])
def test_fused_route_runs_the_reference_routes_dropout(name):
  """With attention dropout the fused route (the Pallas kernel, in interpret mode; the
  reference for a dense per-example bias) draws the reference route's mask: values and
  gradients agree."""
  if name == "dense_bias":
    terms, scale = [Bias(jax.random.normal(jax.random.key(5), (2, 4, 10, 10)))], None
  else:
    _, _, st = init_scheme(SCHEME_CONFIGS[name])
    terms, scale = st.for_layer(0), st.content_scale
  q, k, v = qkv()

  def loss(route):
    def f(q, k, v):
      out = attend(q, k, v, terms, mask=padding_mask(), scale=scale, route=route,
                   dropout_rate=0.2, dropout_rng=jax.random.key(3))
      return jnp.sum(jnp.sin(out))
    return jax.value_and_grad(f, argnums=(0, 1, 2))(q, k, v)

  (ref, ref_grads), (fus, fus_grads) = loss("reference"), loss("fused")
  np.testing.assert_allclose(fus, ref, **TOL)
  assert_grads_close(fus_grads, ref_grads)
  deterministic = attend(q, k, v, terms, mask=padding_mask(), scale=scale, route="fused")
  assert not np.allclose(attend(q, k, v, terms, mask=padding_mask(), scale=scale,
                                route="fused", dropout_rate=0.2,
                                dropout_rng=jax.random.key(3)), deterministic)


def test_reference_route_equals_explicit_softmax():
  """Reference route against a plain numpy float64 computation with a bias and a mask."""
  q, k, v = qkv()
  bias = jax.random.normal(jax.random.key(5), (4, 10, 10))
  mask = padding_mask()
  out = attend(q, k, v, [Bias(bias)], mask=mask, route="reference")
  qn, kn, vn, bn, mn = (np.asarray(x, np.float64) for x in (q, k, v, bias, mask))
  logits = np.einsum("bihd,bjhd->bhij", qn, kn) / np.sqrt(8) + bn[None]
  logits = np.where(mn[:, None, None, :] > 0, logits, -np.inf)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  np.testing.assert_allclose(out, np.einsum("bhij,bjhd->bihd", probs, vn), rtol=1e-5, atol=1e-6)


def test_masked_keys_get_no_weight():
  q, k, v = qkv()
  mask = padding_mask()
  out = attend(q, k, v, mask=mask)
  # Changing padded values must not change any output.
  v2 = v.at[1, 7:].set(100.0)
  np.testing.assert_allclose(attend(q, k, v2, mask=mask), out, rtol=1e-6)


@pytest.mark.parametrize("name", ["diet_abs", "diet_abs_share", "diet_abs_head", "tupe_a",
                                  "segment_per_head"])
def test_factored_equals_materialised(name):
  """U V^T through the fused concat route equals the materialised bias (values and grads)."""
  _, _, st = init_scheme(SCHEME_CONFIGS[name])
  q, k, v = qkv()
  factored = [t for t in st.for_layer(1) if isinstance(t, Factored)]
  assert factored

  def loss(terms, route):
    out = attend(q, k, v, terms, mask=padding_mask(), scale=st.content_scale, route=route)
    return jnp.sum(out ** 2)

  def via_factored(terms):
    return loss(terms, "fused")

  def via_bias(terms):
    return loss([t.materialise() for t in terms], "reference")

  a, ga = jax.value_and_grad(via_factored)(factored)
  b, gb = jax.value_and_grad(via_bias)(factored)
  np.testing.assert_allclose(a, b, **TOL)
  assert_grads_close(ga, gb)


def test_unknown_route_is_rejected():
  q, k, v = qkv()
  with pytest.raises(ValueError, match="attend: route: got 'flash'; allowed: auto, reference"):
    attend(q, k, v, route="flash")


def _intermediate_shapes(jaxpr):
  """Shapes of every value computed in ``jaxpr``, sub-jaxprs included."""
  for eqn in jaxpr.eqns:
    yield from (tuple(v.aval.shape) for v in eqn.outvars)
    for param in eqn.params.values():
      inner = getattr(param, "jaxpr", param)
      if hasattr(inner, "eqns"):
        yield from _intermediate_shapes(inner)


def _positional_lxl_tensors(name, length=13, batch=3, route="fused"):
  """``[.., L, L]`` values without the batch axis (so not the kernel's own logits)."""
  module, params, _ = init_scheme(SCHEME_CONFIGS[name], length=length)
  q = jnp.ones((batch, length, 4, 8))

  def run(params, q):
    st = module.apply(params, length)
    return jnp.sum(attend(q, q, q, st.for_layer(0), scale=st.content_scale, route=route))

  jaxpr = jax.make_jaxpr(jax.value_and_grad(run, argnums=(0, 1)))(params, q).jaxpr
  return [s for s in _intermediate_shapes(jaxpr) if s[-2:] == (length, length) and batch not in s]


@pytest.mark.parametrize("name", ["diet_abs", "diet_abs_share", "tupe_a", "rope", "bert_ad",
                                  "diet_rel", "t5", "alibi", "tupe_r"])
def test_fused_route_builds_no_positional_lxl_tensor(name):
  """Forward and backward: factored terms fold into q/k, Toeplitz terms stay [H, 2L - 1]."""
  assert _positional_lxl_tensors(name) == []


def test_reference_route_does_build_the_lxl_tensor():
  """Control for the test above: the reference route's [H, L, L] T5 bias is found."""
  assert _positional_lxl_tensors("t5", route="reference")


def test_auto_route_per_device():
  from posenc_jax.route_plan import choose_route
  from posenc_jax.terms import QueryRelative
  shaw_value = QueryRelative(jnp.zeros((7, 8)), value_table=jnp.zeros((7, 8)),
                             clip=3).fused_form()
  assert choose_route("auto", [], backend="cpu") == "reference"
  assert choose_route("auto", [], backend="gpu") == "fused"
  assert choose_route("auto", [], backend="tpu") == "fused"
  assert choose_route("auto", [shaw_value], backend="gpu") == "reference"
  assert choose_route("fused", [], backend="cpu") == "fused"


def test_cudnn_fallback_reasons():
  from posenc_jax.route_plan import cudnn_unsupported
  diet_abs = (8, 512, 12, 64 + 128)  # head dim 64 with rank 128 folded in
  fits = dict(backend="gpu", compute_capability=9.0, has_bias=False)
  assert cudnn_unsupported(diet_abs, diet_abs, jnp.bfloat16, **fits) is None
  assert "backend cpu" in cudnn_unsupported(diet_abs, diet_abs, jnp.bfloat16,
                                            **{**fits, "backend": "cpu"})
  assert "dtype float32" in cudnn_unsupported(diet_abs, diet_abs, jnp.float32, **fits)
  assert "at most 128" in cudnn_unsupported(diet_abs, diet_abs, jnp.float16,
                                            **{**fits, "compute_capability": 8.0})
  tupe = (8, 512, 12, 64 + 66)
  assert "multiple of 8" in cudnn_unsupported(tupe, tupe, jnp.bfloat16, **fits)
  odd = (8, 511, 12, 64)
  assert "odd lengths" in cudnn_unsupported(odd, odd, jnp.bfloat16, **{**fits, "has_bias": True})
  assert cudnn_unsupported(odd, odd, jnp.bfloat16, **fits) is None


@pytest.mark.parametrize("name,causal", [("diet_abs", False), ("rope", True), ("t5", False),
                                         ("tupe_r", True)])
def test_tpu_fused_route_matches_reference(name, causal):
  """The TPU form of the fused route, in interpret mode (splash attention for bias-free
  attention, the kernel's roll tiles for Toeplitz terms) against the reference route,
  gradients included."""
  from posenc_jax import route_plan, route_table
  from posenc_jax.attention import _execute, _reference
  _, _, st = init_scheme(SCHEME_CONFIGS[name], length=128, max_len=128)
  q, k, v = qkv(length=128)
  mask = jnp.arange(128)[None, :] < jnp.array([[128], [90]])
  terms = [t.with_key_length(128) for t in st.for_layer(0)]
  scale = st.content_scale or 1 / np.sqrt(8)

  def loss(fn, q, k, v):
    for t in terms:
      q, k = t.transform_qk(q, k)
    return jnp.sum(jnp.sin(fn(q, k, v)))

  tpu_plan = lambda q, k, v: route_plan.plan_for(  # noqa: E731
      q, k, v, terms, mask=mask, causal=causal, route="fused", implementation="xla",
      device=route_plan.Device("tpu", "TPU v5 lite"), table=route_table.RouteTable())
  tpu = lambda q, k, v: _execute(tpu_plan(q, k, v), q, k, v, terms, mask, causal,  # noqa: E731
                                 scale, segment_ids=None, precision="float32",
                                 dropout_rate=0.0, seed=None)
  ref = lambda q, k, v: _reference(q, k, v, terms, mask, causal, scale)  # noqa: E731
  kernels = str(jax.make_jaxpr(tpu)(q, k, v))
  assert ("splash" in kernels) == (name in ("diet_abs", "rope"))
  assert ("relative_flash" in kernels) == (name in ("t5", "tupe_r"))
  got, got_grads = jax.value_and_grad(functools.partial(loss, tpu), argnums=(0, 1, 2))(q, k, v)
  want, want_grads = jax.value_and_grad(functools.partial(loss, ref), argnums=(0, 1, 2))(q, k, v)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for a, b in zip(got_grads, want_grads):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(b).max())))


@pytest.mark.parametrize("name", ["diet_rel", "diet_abs", "none"])
def test_segment_ids_equal_an_explicit_mask(name):
  """Packed sequences: segment ids (with a padding mask) through the reference route and the
  fused route (the kernel, interpret mode) equal the same-segment mask given explicitly."""
  length = 12
  _, _, st = init_scheme(SCHEME_CONFIGS[name], length=length)
  terms = st.for_layer(0)
  q, k, v = qkv(batch=1, length=length)
  segments = jnp.array([[0] * 5 + [1] * 7])
  padding = jnp.arange(length)[None] < 11
  same = (segments[0][:, None] == segments[0][None, :]) & padding[0][None, :]
  explicit = attend(q, k, v, terms, mask=same[None, None], scale=st.content_scale,
                    route="reference")
  for route in ("reference", "fused"):
    got = attend(q, k, v, terms, mask=padding, segment_ids=segments, scale=st.content_scale,
                 route=route)
    np.testing.assert_allclose(got, explicit, rtol=2e-5, atol=2e-5, err_msg=route)
  with pytest.raises(ValueError, match=r"segment_ids: got shape \(1, 11\)"):
    attend(q, k, v, terms, segment_ids=segments[:, :11])
