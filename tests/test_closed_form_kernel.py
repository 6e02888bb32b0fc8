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
from posenc_jax.schemes.t5 import BucketedOffsets, relative_position_bucket
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
  if name == "t5":  # Raffel et al.: the head's entry of the offset's bucket
    return jnp.asarray(params)[:, _t5_buckets(j - i)]
  return -p[:, 0] * dist ** p[:, 1]  # kerple_power: -r1 |i - j|^r2


def _t5_buckets(rel):
  """The T5 buckets of ``rel`` (int array) for FUNCTIONS["t5"]'s settings."""
  fn = FUNCTIONS["t5"]
  return np.asarray(relative_position_bucket(rel, bidirectional=fn.bidirectional,
                                             num_buckets=T5_BUCKETS,
                                             max_distance=fn.max_distance))


# T5 with 8 buckets up to distance 20: own buckets, log buckets and the last one within the
# tests' lengths.
T5_BUCKETS = 8
FUNCTIONS = {"alibi": LinearDistance(False), "alibi_causal": LinearDistance(True),
             "kerple_log": KernelDistance("log"), "kerple_power": KernelDistance("power"),
             "t5": BucketedOffsets(max_distance=20)}


def _params(name, heads=H):
  if name.startswith("alibi"):
    return alibi_slopes(heads)[:, None]  # [H, 1]
  if name == "t5":
    return jax.random.normal(jax.random.PRNGKey(3), (heads, T5_BUCKETS))
  r = jax.random.uniform(jax.random.PRNGKey(3), (heads, 2), minval=0.2, maxval=1.5)
  return r


def _bias64_reset(name, params, lq, lk, zero_first):
  """:func:`_bias64`, its row 0 and column 0 zeroed with ``zero_first``."""
  bias = _bias64(name, params, lq, lk)
  if zero_first:
    bias = bias * ((np.arange(lq) != 0)[:, None] & (np.arange(lk) != 0)[None, :])
  return bias


def _reference64(q, k, v, params, name, *, causal, keep, zero_first):
  """Attention with the closed-form bias, all in float64 (differentiable in every input)."""
  return _attention64(q, k, v, _bias64_reset(name, params, q.shape[1], k.shape[1], zero_first),
                      causal=causal, keep=keep)


def _attention64(q, k, v, bias, *, causal, keep):
  """Softmax attention with the materialised ``bias [H, Lq, Lk]``, in the inputs' dtype."""
  lq, lk = q.shape[1], k.shape[1]
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
  with pytest.raises(ValueError, match=r"^forward: 'hopper' takes bfloat16/float16 .*float32"):
    relative_flash_attention(q, k, v, offset_fn=LinearDistance(), offset_params=slopes,
                             forward="hopper")


# ---------------------------------------------------------------------------
# The Hopper passes (Mosaic GPU, interpreted on the CPU): the closed form in their tiles, the
# parameters' gradient from the per-diagonal sums of dS pulled back through it.

BF16_TOL = 2e-2  # bfloat16 operands of the products, float32 accumulation


def _check_hopper(name, *, b=1, lq=100, lk=100, causal=False, zero_first=False, mask=False,
                  segments=False, shared=False):
  """Both Hopper passes with the closed form against the float64 reference on the same
  (bfloat16-rounded) inputs, and against the Triton tiles' closed form, whose products
  round the same operands; the parameters' gradient too."""
  q, k, v, cot = _inputs(b, lq, lk, d=64)
  q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
  params = _params(name, 1 if shared else H)
  keep, extra = None, {}
  if mask:
    keys = jnp.arange(lk)[None, :] < jnp.array([[lk], [lk - 29]])[:b]
    keep, extra["mask"] = np.asarray(keys)[:, None, None, :], keys
  if segments:
    ids = jnp.broadcast_to(jnp.arange(lq) * 3 // lq, (b, lq))
    same = np.asarray(ids)[:, :, None] == np.asarray(ids)[:, None, :]
    keep = same[:, None] if keep is None else keep & same[:, None]
    extra.update(q_segment_ids=ids, kv_segment_ids=ids)

  def run(passes):
    def f(q, k, v, params):
      out = relative_flash_attention(q, k, v, offset_fn=FUNCTIONS[name], offset_params=params,
                                     causal=causal, zero_first=zero_first, block_q=64,
                                     block_k=64, forward=passes, backward=passes, **extra)
      return out.astype(jnp.float32)
    out, pullback = jax.vjp(jax.jit(f), q, k, v, params)
    return [np.asarray(x, np.float32) for x in (out, *pullback(cot))]

  hopper, tiles = run("hopper"), run("tiles")
  with jax.enable_x64(True):
    f64 = [jnp.asarray(np.asarray(x, np.float32), jnp.float64) for x in (q, k, v, params, cot)]
    want, pullback = jax.vjp(lambda *a: _reference64(*a, name, causal=causal, keep=keep,
                                                     zero_first=zero_first), *f64[:4])
    want = [np.asarray(want), *(np.asarray(g) for g in pullback(f64[4]))]
  for label, got, ref, triton in zip(("out", "dq", "dk", "dv"), hopper, want, tiles):
    scale = max(np.abs(ref).max(), 1e-3)
    np.testing.assert_allclose(got, ref, atol=BF16_TOL * scale, rtol=BF16_TOL, err_msg=label)
    # Closer to the Triton tiles (same rounded operands) than either is to float64, on average.
    assert np.abs(got - triton).mean() <= 2e-3 * max(np.abs(ref).mean(), 1e-3), label
  # The parameters' gradient sums dS times d bias / d params over every logit, terms that
  # cancel (KERPLE's power form: |i - j|^r2 log |i - j| up to 4.5e3 a logit) and carry the
  # rounding of the bf16 operands, output and cotangent: as close to float64 as the Triton
  # tiles' closed form gets on the same inputs (test_closed_gradient_against_the_derivatives
  # checks the pullback itself in float64).
  got, ref, triton = hopper[4], want[4], tiles[4]
  assert np.all(np.abs(got - ref) <= 1.5 * np.abs(triton - ref) + BF16_TOL * np.abs(ref) + 1e-3), (
      got, triton, ref)
  assert np.abs(hopper[4]).max() > 1e-2  # the parameters' gradient is not vacuous
  return hopper


def _derivatives64(name, params, rel):
  """``[H, R, N]`` float64 d bias / d params of each head at offsets ``rel`` ``[N]``, the
  papers' formulas differentiated by hand."""
  d = np.abs(rel).astype(np.float64)[None, :]
  p = np.asarray(params, np.float64)
  if name == "alibi":
    return -np.broadcast_to(d, (p.shape[0], d.shape[1]))[:, None, :]
  if name == "t5":  # one-hot: the offset's bucket
    one_hot = (_t5_buckets(rel)[None, :] == np.arange(T5_BUCKETS)[:, None]).astype(np.float64)
    return np.broadcast_to(one_hot, (p.shape[0], *one_hot.shape))
  r1, r2 = p[:, 0:1], p[:, 1:2]
  if name == "kerple_log":
    return np.stack([-np.log1p(r2 * d), -r1 * d / (1 + r2 * d)], axis=1)
  logs = np.log(np.where(d > 0, d, 1.0))  # d^r2 log d is 0 at d = 0
  return np.stack([-d ** r2, -r1 * d ** r2 * logs], axis=1)


@pytest.mark.parametrize("buckets, max_distance, bidirectional", [
    (32, 128, True), (32, 128, False), (8, 20, True), (10, 160, False)])
def test_t5_closed_form_equals_the_bucket_lookup(buckets, max_distance, bidirectional):
  """T5's gather-free form (the first entry plus the step of every bucket start reached) is
  the table's entry at the offset's bucket, at every offset to 400 either way."""
  fn = BucketedOffsets(max_distance=max_distance, bidirectional=bidirectional)
  table = jax.random.normal(jax.random.PRNGKey(1), (H, buckets))
  rel = jnp.arange(-400, 401)
  got = fn.closed(tuple(table[:, b:b + 1] for b in range(buckets)), rel[None, :])
  np.testing.assert_allclose(got, fn(table, rel), atol=1e-6)
  with pytest.raises(ValueError, match=r"^BucketedOffsets.closed: num_buckets must be an even"):
    fn.closed(tuple(table[:, b:b + 1] for b in range(3)), rel) if bidirectional else (
        BucketedOffsets(bidirectional=True).closed((table[:, :1],) * 3, rel))


@pytest.mark.parametrize("name", ["alibi", "kerple_log", "kerple_power", "t5"])
def test_closed_gradient_against_the_derivatives(name):
  """The Hopper backward's last step: the offset vector's gradient ``[H, Lq + Lk - 1]``
  pulled back through the closed form is ``sum_o d_o d closed(o - (Lq - 1)) / d params``,
  zero in the parameters' padding."""
  from posenc_jax.kernels.hopper_mosaic import closed_gradient  # noqa: PLC0415

  q_len, k_len = 128, 192
  params = np.asarray(_params(name, H))
  width = params.shape[1]
  padded_width = width + 2  # the kernel's parameters are padded to R_p
  padded = np.pad(params, ((0, 0), (0, padded_width - width)))[:, None, :]  # [H, 1, R_p]
  d_offsets = np.asarray(jax.random.normal(jax.random.PRNGKey(7), (H, q_len + k_len - 1)))
  got = np.asarray(closed_gradient(FUNCTIONS[name], jnp.asarray(padded), width,
                                   jnp.asarray(d_offsets), q_len))
  rel = np.arange(q_len + k_len - 1) - (q_len - 1)
  want = np.einsum("hrn,hn->hr", _derivatives64(name, params, rel), d_offsets)
  assert got.shape == (H, 1, padded_width) and np.all(got[:, 0, width:] == 0)
  np.testing.assert_allclose(got[:, 0, :width], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("name", ["alibi", "kerple_log", "kerple_power", "t5"])
def test_hopper_passes_against_float64_with_padding(name):
  """Odd length (padded to 128: two query blocks, the forward's two warpgroups), a key mask
  leaving 29 keys of the second example out."""
  _check_hopper(name, b=2, mask=True)


def test_hopper_passes_causal_packed_with_the_cls_reset():
  _check_hopper("kerple_log", lq=128, lk=128, causal=True, zero_first=True, segments=True)


def test_hopper_passes_cross_lengths_with_shared_parameters():
  """64 queries against 160 keys (padded 192): the offsets run from -63 to 159; one set of
  parameters for both heads gets their summed gradient."""
  _check_hopper("kerple_power", lq=64, lk=160, zero_first=True, shared=True)


@pytest.mark.parametrize("name", ["alibi", "kerple_log", "kerple_power", "t5"])
def test_hopper_passes_with_a_closed_form_lower_for_cuda(name):
  """Forward and backward on Mosaic GPU with the closed form in the tiles: the four kernels,
  no Triton, and the heads' parameters in place of a band (no ``[H, 64, N]`` operand)."""
  from tests.test_hopper_flash import MOSAIC_GPU  # noqa: PLC0415

  length = 256

  def loss(q, k, v, params):
    out = relative_flash_attention(q, k, v, offset_fn=FUNCTIONS[name], offset_params=params,
                                   mask=jnp.ones((2, length), bool), zero_first=True,
                                   block_q=64, block_k=64, forward="hopper", backward="hopper",
                                   interpret=False)
    return jnp.sum(out.astype(jnp.float32))

  shapes = [jax.ShapeDtypeStruct((2, length, H, 64), jnp.bfloat16)] * 3
  width = _params(name).shape[1]
  shapes.append(jax.ShapeDtypeStruct((H, width), jnp.float32))
  text = _lowered(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)), shapes, "cuda")
  assert MOSAIC_GPU in text and TRITON not in text
  for kernel in ("fwd", "dq", "dkv", "dbias"):
    assert f"relative_flash_{kernel}_hopper" in text, kernel
  # The kernels' bias operand is the heads' parameters, a row of 64 each: [H, R, 64].
  assert f"tensor<{H}x{width}x64xf32>" in text


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
