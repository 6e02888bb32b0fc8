"""Closed-form Toeplitz biases evaluated in the kernel's tiles (ALiBi, KERPLE log and power):
values and gradients (q, k, v and the per-head parameters) in interpret mode against a float64
transcription of the papers' formulas, with padding, packing, causal masks, the [CLS] reset
and cross lengths; the route plan's ``registers`` entry; the Triton lowering, which carries
the heads' parameters and no offset vector."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posenc_jax import route_plan, route_table
from posenc_jax.attention import attend
from posenc_jax.kernels import relative_flash_attention
from posenc_jax.schemes.alibi import LinearDistance, alibi_slopes
from posenc_jax.schemes.kerple import KernelDistance
from posenc_jax.terms import Toeplitz
from tests.test_relative_flash import TRITON, _inputs, _lowered

H = 2
TOL = 1e-4


def _bias64(name, params, lq, lk):
  """``[H, Lq, Lk]`` float64 bias from the papers' formulas; ``params`` ``[H|1, R]``."""
  i, j = np.arange(lq)[:, None], np.arange(lk)[None, :]
  dist = jnp.asarray(np.abs(i - j), jnp.float64)
  p = params[:, :, None, None]  # [H|1, R, 1, 1]
  if name == "alibi":  # Press et al.: -m_h |i - j|
    return -p[:, 0] * dist
  if name == "alibi_causal":  # -m_h (i - j) for j <= i; j > i is masked anyway
    return -p[:, 0] * jnp.asarray(np.maximum(i - j, 0), jnp.float64)
  if name == "kerple_log":  # Chi et al. (2022), eq. 9: -r1 log(1 + r2 |i - j|)
    return -p[:, 0] * jnp.log1p(p[:, 1] * dist)
  return -p[:, 0] * dist ** p[:, 1]  # kerple_power: -r1 |i - j|^r2


FUNCTIONS = {"alibi": LinearDistance(False), "alibi_causal": LinearDistance(True),
             "kerple_log": KernelDistance("log"), "kerple_power": KernelDistance("power")}


def _params(name, heads=H):
  if name.startswith("alibi"):
    return alibi_slopes(heads)[:, None]  # [H, 1]
  r = jax.random.uniform(jax.random.PRNGKey(3), (heads, 2), minval=0.2, maxval=1.5)
  return r


def _reference64(q, k, v, params, name, *, causal, keep, zero_first):
  """Attention with the closed-form bias, all in float64 (differentiable in every input)."""
  lq, lk = q.shape[1], k.shape[1]
  bias = _bias64(name, params, lq, lk)
  if zero_first:
    bias = bias * ((np.arange(lq) != 0)[:, None] & (np.arange(lk) != 0)[None, :])
  logits = jnp.einsum("bihd,bjhd->bhij", q, k) / np.sqrt(q.shape[-1]) + bias[None]
  allowed = np.ones((q.shape[0], 1, lq, lk), bool) if keep is None else keep
  if causal:
    allowed = allowed & (np.arange(lk)[None, :] <= np.arange(lq)[:, None])
  logits = jnp.where(allowed, logits, -jnp.inf)
  probs = jax.nn.softmax(logits, axis=-1)
  probs = jnp.where(jnp.any(allowed, -1, keepdims=True), probs, 0.0)  # empty rows: zeros
  return jnp.einsum("bhij,bjhd->bihd", probs, v)


def _check(name, *, b=2, lq=37, lk=37, causal=False, zero_first=False, mask=None,
           segments=None, shared=False, **kw):
  q, k, v, cot = _inputs(b, lq, lk)
  params = _params(name, 1 if shared else H)
  keep, extra = None, dict(kw)
  if mask is not None:
    keep = np.asarray(mask)[:, None, None, :]
    extra["mask"] = mask
  if segments is not None:
    same = np.asarray(segments)[:, :, None] == np.asarray(segments)[:, None, :]
    keep = same[:, None] if keep is None else keep & same[:, None]
    extra.update(q_segment_ids=segments, kv_segment_ids=segments)

  def kernel(q, k, v, params):
    return relative_flash_attention(q, k, v, offset_fn=FUNCTIONS[name], offset_params=params,
                                    causal=causal, zero_first=zero_first, block_q=16,
                                    block_k=16, **extra)

  got, pullback = jax.vjp(jax.jit(kernel), q, k, v, params)
  got_grads = pullback(cot)
  with jax.enable_x64(True):
    f64 = [jnp.asarray(np.asarray(x), jnp.float64) for x in (q, k, v, params, cot)]
    want, pullback = jax.vjp(lambda *a: _reference64(*a, name, causal=causal, keep=keep,
                                                     zero_first=zero_first), *f64[:4])
    want_grads = [np.asarray(g) for g in pullback(f64[4])]
    want = np.asarray(want)
  np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL)
  for label, g, w in zip(("q", "k", "v", "params"), got_grads, want_grads):
    np.testing.assert_allclose(g, w, atol=TOL, rtol=TOL, err_msg=f"d{label}")


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_values_and_gradients_against_float64_with_padding(name):
  mask = jnp.arange(37)[None, :] < jnp.array([[37], [30]])
  _check(name, causal=name == "alibi_causal", mask=mask)


@pytest.mark.parametrize("name", ["alibi_causal", "kerple_log"])
def test_packed_sequences_causal(name):
  segments = jnp.array([[0] * 20 + [1] * 17, [0] * 9 + [1] * 28])
  _check(name, causal=True, segments=segments)


def test_cls_reset_and_cross_lengths_kerple_power():
  _check("kerple_power", lq=21, lk=45, zero_first=True)


def test_parameters_shared_by_every_head_get_the_summed_gradient():
  _check("kerple_log", shared=True)


def test_band_tiles_read_no_band_for_a_closed_form():
  """``tiles='band'`` has no vector to band: the closed form is evaluated the same way."""
  _check("alibi", tiles="band")


def test_argument_errors():
  q, k, v, _ = _inputs(1, 8, 8)
  slopes = alibi_slopes(H)[:, None]
  with pytest.raises(ValueError, match=r"^offset_fn, offset_params: give both"):
    relative_flash_attention(q, k, v, offset_fn=LinearDistance())
  with pytest.raises(ValueError, match=r"^offset_fn, offset_params: .*not with offset_bias"):
    relative_flash_attention(q, k, v, jnp.zeros((H, 15)), offset_fn=LinearDistance(),
                             offset_params=slopes)
  with pytest.raises(ValueError, match=r"^offset_params: got shape \(3, 1\); expected \[2 or 1"):
    relative_flash_attention(q, k, v, offset_fn=LinearDistance(),
                             offset_params=jnp.ones((3, 1)))
  with pytest.raises(ValueError, match=r"^forward: 'hopper' takes no closed-form offset_fn"):
    relative_flash_attention(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16),
                             v.astype(jnp.bfloat16), offset_fn=LinearDistance(),
                             offset_params=slopes, forward="hopper")


# ---------------------------------------------------------------------------
# The scheme declares its form; the plan takes it.

GPU = route_plan.Device("gpu", "NVIDIA H100 80GB HBM3", "9.0")
SHAPE = (2, 1024, 12, 64)


def _forms(*offset_fns):
  return [Toeplitz(jnp.ones((12, 2)), fn).fused_form() for fn in offset_fns]


def test_closed_forms_are_declared_by_their_offset_function():
  from posenc_jax.schemes.t5 import BucketedOffsets  # noqa: PLC0415

  assert [f.closed for f in _forms(LinearDistance(True), KernelDistance("power"))] == [
      "alibi", "kerple_power"]
  assert not _forms(BucketedOffsets())[0].closed


def test_the_plan_puts_a_lone_closed_form_in_registers():
  plan = route_plan.plan(SHAPE, SHAPE, SHAPE, "bfloat16", _forms(LinearDistance()),
                         mask="key", device=GPU, table=route_table.RouteTable())
  assert plan.runner == "kernel" and plan.entries == ("registers",)
  assert plan.kernel.closed and (plan.kernel.forward, plan.kernel.backward) == ("tiles",) * 2
  assert "closed-form bias" in str(plan) and "evaluate it from its parameters" in str(plan)


def test_where_the_table_has_the_hopper_passes_faster_the_vector_goes_to_them():
  table = route_table.RouteTable().forcing(hopper="both")
  plan = route_plan.plan(SHAPE, SHAPE, SHAPE, "bfloat16", _forms(KernelDistance()),
                         mask="key", device=GPU, table=table)
  assert plan.entries == ("kernel",) and not plan.kernel.closed
  assert (plan.kernel.forward, plan.kernel.backward) == ("hopper", "hopper")
  assert "Hopper passes (which read the offset vector) measured faster" in str(plan)


def test_a_closed_form_measured_faster_than_the_hopper_passes_stays_in_the_tiles():
  """An H200 point measured at 8k (docs/results/h200-2026-11-28.md): ALiBi's closed form
  (7.94 ms) beats the Hopper passes (11.07 ms) and stays in the tiles; KERPLE's (12.60 ms)
  does not, and its vector goes to the Hopper passes; KERPLE's power form, not measured,
  follows the Hopper passes as before."""
  h200 = route_plan.Device("gpu", "NVIDIA H200", "9.0")
  point = route_table.Point(
      device="NVIDIA H200", dtype="bfloat16", form="toeplitz", batch=2, length=8192,
      heads=12, head_dim=64, rank=0, default_ms=18.15, materialised_ms=13.71,
      hopper_ms=11.07, hopper_backward=True, compute_capability="9.0",
      closed_ms=(("alibi", 7.94), ("kerple_log", 12.60)))
  table = route_table.RouteTable((point,))
  shape = (2, 8192, 12, 64)
  plans = {fn.closed_form: route_plan.plan(shape, shape, shape, "bfloat16", _forms(fn),
                                           mask="key", device=h200, table=table)
           for fn in (LinearDistance(), KernelDistance("log"), KernelDistance("power"))}
  assert plans["alibi"].entries == ("registers",) and plans["alibi"].kernel.closed
  assert plans["alibi"].kernel.forward == "tiles"
  for name in ("kerple_log", "kerple_power"):
    assert plans[name].entries == ("kernel",) and not plans[name].kernel.closed
    assert (plans[name].kernel.forward, plans[name].kernel.backward) == ("hopper", "hopper")


@pytest.mark.parametrize("device, forms, entries", [
    (GPU, (LinearDistance(), KernelDistance()), ("kernel", "kernel")),  # one vector, summed
    (route_plan.Device("tpu", "TPU v5 lite"), (LinearDistance(),), ("kernel",)),  # roll tiles
])
def test_closed_forms_take_the_vector_with_another_toeplitz_term_or_on_tpu(device, forms,
                                                                            entries):
  plan = route_plan.plan(SHAPE, SHAPE, SHAPE, "bfloat16", _forms(*forms), mask="key",
                         device=device, table=route_table.RouteTable())
  assert plan.entries == entries and not plan.kernel.closed


def test_attend_runs_the_closed_form_through_the_fused_route():
  """ALiBi's term through attend(route='fused') (the kernel, interpret mode) equals the
  reference route, values and the slopes' gradient."""
  q, k, v, cot = _inputs(2, 24, 24)
  mask = jnp.arange(24)[None, :] < jnp.array([[24], [19]])

  def run(route, slopes):
    term = Toeplitz(slopes, LinearDistance(True))
    return attend(q, k, v, (term,), mask=mask, causal=True, route=route)

  slopes = alibi_slopes(H)[:, None]
  got, got_pull = jax.vjp(lambda s: run("fused", s), slopes)
  want, want_pull = jax.vjp(lambda s: run("reference", s), slopes)
  np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL)
  np.testing.assert_allclose(got_pull(cot)[0], want_pull(cot)[0], atol=TOL, rtol=TOL)


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_lowers_for_triton_with_parameters_and_no_offset_vector(name):
  """Forward and backward lower through Pallas' Triton backend; the kernels' bias operand is
  the heads' ``[H, 1, R]`` parameters, and no ``[H, 1, Loff]`` vector is built."""
  length, width = 200, _params(name).shape[1]

  def loss(q, k, v, params):
    out = relative_flash_attention(q, k, v, offset_fn=FUNCTIONS[name], offset_params=params,
                                   mask=jnp.ones((2, length), bool),
                                   causal=name == "alibi_causal", interpret=False)
    return jnp.sum(out.astype(jnp.float32))

  shapes = [jax.ShapeDtypeStruct((2, length, H, 64), jnp.bfloat16)] * 3
  shapes.append(jax.ShapeDtypeStruct((H, width), jnp.float32))
  text = _lowered(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)), shapes, "cuda")
  assert text.count(TRITON) == 3  # forward, dq (+ the parameters' gradient), dk/dv
  assert f"tensor<{H}x1x{width}xf32>" in text
  assert not any(f"tensor<{H}x1x{n}xf32>" in text for n in (512, 1024))  # Loff_p at L=200
