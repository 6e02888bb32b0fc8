"""Separable causal terms folded into q/k channels (posenc_jax/terms/channels.py): the split's
error bound, values and gradients against float64 through the plan's cuDNN route (run by XLA
on CPU), and the plan that sends causal ALiBi and FoX there on an H100 and an H200."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posenc_jax import attention, route_plan, route_table
from posenc_jax.schemes.alibi import LinearDistance, alibi_slopes
from posenc_jax.terms import ForgettingGates, Toeplitz, channels, key_channels, segment_cumsum
from posenc_jax.terms.channels import ERROR_BITS, center, error_bound, split
from tests.conftest import attention_float64

B, L, H, D, WIDTH = 2, 48, 4, 16, 8
SCALE = D ** -0.5
H100 = route_plan.Device("gpu", "NVIDIA H100 80GB HBM3", "9.0")
H200 = route_plan.Device("gpu", "NVIDIA H200", "9.0")


def _ramps(length: int) -> np.ndarray:
  """``[2, 4, L]`` key vectors as the two terms make them at ``length``: ALiBi's ``m j`` for
  the steepest slopes, and FoX's ``-c_j`` of gates near 0.9 with noise."""
  alibi = np.asarray(alibi_slopes(4))[:, None] * np.arange(length)
  rng = np.random.default_rng(0)
  log_gates = np.log(rng.uniform(0.8, 0.99, (4, length)))
  return np.stack([alibi, -np.cumsum(log_gates, axis=-1)]).astype(np.float32)


@pytest.mark.parametrize("length", [512, 8192])
def test_the_bfloat16_channels_hold_the_vector_within_the_stated_bound(length):
  s = jnp.asarray(_ramps(length))
  part = key_channels(s, 1, SCALE, jnp.bfloat16)
  channels = np.asarray(part.k_extra, np.float64)  # [2, L, 4, 3]
  assert part.k_extra.dtype == jnp.bfloat16 and channels.shape == (2, length, 4, 3)
  assert np.all(np.asarray(part.q_extra) == 1)
  got = SCALE * np.swapaxes(channels.sum(-1), 1, 2)  # what c (q . k) adds
  want = np.asarray(center(s), np.float64)
  error = np.abs(got - want).max(-1, keepdims=True)
  bound = np.asarray(error_bound(s))
  assert np.all(error <= bound), (error.max(), bound.max())
  # One bfloat16 channel is far outside it: the split is what makes the bound.
  one = SCALE * np.asarray((want / SCALE).astype(jnp.bfloat16), np.float64)
  assert np.abs(one - want).max() > 1000 * bound.max()
  assert bound.max() == pytest.approx(np.abs(want).max() * 2.0 ** -ERROR_BITS)


def test_the_split_passes_the_whole_gradient_through_its_first_part():
  x = jnp.asarray([3.14159, -2.5e4, 7e-3], jnp.float32)
  grad = jax.grad(lambda x: sum(p.astype(jnp.float32).sum() for p in split(x, jnp.bfloat16, 3)))
  np.testing.assert_array_equal(grad(x), np.ones(3))


RNG = np.random.default_rng(3)
GATE_WEIGHT = RNG.normal(0, 0.3, (WIDTH, H)).astype(np.float32)
GATE_BIAS = RNG.normal(2.0, 0.5, (H,)).astype(np.float32)


def _alibi(causal: bool, slopes=None, position_ids=None):
  slopes = alibi_slopes(H)[:, None] if slopes is None else slopes
  return Toeplitz(slopes, LinearDistance(causal), position_ids=position_ids,
                  num_positions=None if position_ids is None else L)


def _fox(x, weight=GATE_WEIGHT, segment_ids=None):
  return ForgettingGates(jnp.asarray(weight), jnp.asarray(GATE_BIAS)).with_inputs(x, segment_ids)


def _bias_reference(case, table, x, position_ids, segment_ids):
  """The term ``[B|1, H, L, L]`` from its formula, in the dtype of ``table`` (float64 under
  ``enable_x64``): ALiBi ``-m (p_i - p_j)``; FoX ``c_i - c_j`` with ``c`` the cumulative
  ``log sigmoid(x w + b)`` of each packed segment (on ``j <= i``; the causal mask removes the
  rest)."""
  if case.startswith("alibi"):
    m = table[:, 0]
    pos = (jnp.arange(L)[None] if position_ids is None else position_ids).astype(m.dtype)
    return -m[None, :, None, None] * (pos[:, None, :, None] - pos[:, None, None, :])
  log_f = jax.nn.log_sigmoid(jnp.einsum("bld,dh->bhl", x, table)
                             + jnp.asarray(GATE_BIAS, table.dtype)[:, None])
  c = segment_cumsum(log_f, segment_ids)
  return c[..., :, None] - c[..., None, :]


def _keep(mask, segment_ids):
  keep = np.tril(np.ones((L, L), bool))[None, None]
  if mask is not None:
    keep = keep & np.asarray(mask, bool)[:, None, None, :]
  if segment_ids is not None:
    ids = np.asarray(segment_ids)
    keep = keep & (ids[:, None, :, None] == ids[:, None, None, :])
  return keep


def _folded(term, q, k, v, mask, segment_ids):
  """attend's executor on the plan an H100 gets in bfloat16 (channels for cuDNN), run by XLA
  in float32 on CPU (one channel: exact to float32), the mask as a 4-D mask."""
  plan = route_plan.plan(q.shape, k.shape, v.shape, "bfloat16", [term.fused_form()],
                         causal=True, mask="key" if mask is not None else "none", device=H100,
                         table=route_table.RouteTable())
  assert (plan.runner, plan.implementation, plan.entries, plan.qk_dim) == (
      "dot_product_attention", "cudnn", ("channels",), 24)  # 16 + 3, padded to 8
  forced = dataclasses.replace(plan, implementation="xla", kernel=None,
                               mask="mask" if mask is not None or segment_ids is not None
                               else None)
  return attention._execute(forced, q, k, v, [term.with_key_length(L)], mask, True, SCALE,  # noqa: SLF001
                            segment_ids=segment_ids, precision="float32", dropout_rate=0.0,
                            seed=None)


CASES = ["alibi", "alibi_symmetric_form", "alibi_position_ids", "fox", "fox_padding",
         "fox_packed"]


@pytest.mark.parametrize("case", CASES)
def test_folded_values_and_gradients_equal_float64(case):
  """Output and the gradients of q, k, v, the slopes (ALiBi's table) or the gates' weight and
  the layer input (FoX) against the formula's in float64, with a key mask, packed segments
  or per-token positions."""
  rng = np.random.default_rng(1)
  q, k, v = (jnp.asarray(rng.normal(size=(B, L, H, D)), jnp.float32) for _ in range(3))
  x = jnp.asarray(rng.normal(size=(B, L, WIDTH)), jnp.float32)
  mask = segment_ids = position_ids = None
  if case == "fox_padding":
    mask = jnp.asarray(np.arange(L)[None] < np.array([[L], [L - 11]]))
  if case == "fox_packed":
    segment_ids = jnp.asarray(np.repeat([[0, 1, 2], [0, 0, 1]], [20, 20, 8], axis=1), jnp.int32)
  if case == "alibi_position_ids":  # two packed sequences, each counted from 0
    position_ids = jnp.asarray(np.concatenate([np.arange(30), np.arange(18)])[None]
                               .repeat(B, 0), jnp.int32)
    segment_ids = jnp.asarray(np.repeat([[0, 1]], [30, 18], axis=1).repeat(B, 0), jnp.int32)
  alibi = case.startswith("alibi")
  table = alibi_slopes(H)[:, None] if alibi else jnp.asarray(GATE_WEIGHT)
  weights = np.cos(np.arange(D))
  keep = _keep(mask, segment_ids)

  def loss(q, k, v, table, x):
    term = (_alibi(case != "alibi_symmetric_form", table, position_ids) if alibi
            else _fox(x, table, segment_ids))
    return jnp.sum(_folded(term, q, k, v, mask, segment_ids) * weights.astype(np.float32))

  def loss64(q, k, v, table, x):
    logits = (SCALE * jnp.einsum("bihd,bjhd->bhij", q, k)
              + _bias_reference(case, table, x, position_ids, segment_ids))
    probs = jax.nn.softmax(jnp.where(keep, logits, -jnp.inf), axis=-1)
    return jnp.sum(jnp.einsum("bhij,bjhd->bihd", probs, v) * weights)

  args = (q, k, v, table, x)
  got_loss, got = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))(*args)
  with jax.enable_x64(True):
    args64 = [jnp.asarray(np.asarray(a), jnp.float64) for a in args]
    want_loss, want = jax.value_and_grad(loss64, argnums=(0, 1, 2, 3, 4))(*args64)
    want = [np.asarray(w) for w in want]
  assert float(got_loss) == pytest.approx(float(want_loss), rel=1e-5, abs=1e-4)
  for name, g, w in zip(("q", "k", "v", "table", "x"), got, want):
    np.testing.assert_allclose(g, w, atol=5e-5, rtol=1e-4, err_msg=name)


def test_the_folded_route_in_bfloat16_stays_near_float64_where_one_channel_would_not(
    monkeypatch):
  """At 256 keys with slopes up to 1.075 the centred key vector reaches 137 (548 over the
  content scale, where bfloat16's spacing is 4): one channel is off by up to half a logit.
  The three channels keep the bfloat16 output within bfloat16's own rounding."""
  length = 256
  rng = np.random.default_rng(2)
  q, k, v = (jnp.asarray(rng.normal(size=(1, length, H, D)), jnp.bfloat16) for _ in range(3))
  term = Toeplitz(alibi_slopes(H)[:, None] * 4.3, LinearDistance(True))
  plan = route_plan.plan(q.shape, k.shape, v.shape, "bfloat16", [term.fused_form()],
                         causal=True, device=H100, table=route_table.RouteTable())
  forced = dataclasses.replace(plan, implementation="xla", kernel=None)
  run = lambda: attention._execute(forced, q, k, v, [term.with_key_length(length)], None,  # noqa: E731,SLF001
                                   True, SCALE, segment_ids=None, precision="float32",
                                   dropout_rate=0.0, seed=None)
  m = np.asarray(term.table, np.float64)[:, 0]
  pos = np.arange(length, dtype=np.float64)
  bias = -m[None, :, None, None] * (pos[:, None] - pos[None, :])[None, None]
  want = attention_float64(q, k, v, SCALE, bias, np.tril(np.ones((length, length), bool)))
  error = np.abs(np.asarray(run(), np.float64) - want).max()
  assert error < 0.03, error
  monkeypatch.setitem(channels.CHANNELS, "bfloat16", 1)
  worse = np.abs(np.asarray(run(), np.float64) - want).max()
  assert worse > 3 * error, (worse, error)


@pytest.mark.parametrize("device", [H100, H200], ids=["H100", "H200"])
@pytest.mark.parametrize("length", [512, 8192])
@pytest.mark.parametrize("scheme", ["alibi", "fox"])
def test_the_plan_folds_causal_alibi_and_fox_into_channels_for_cudnn(device, length, scheme):
  """With the shipped route table's points: causal ALiBi and FoX go to cuDNN with 3 channels
  (64 + 3, padded to 72); not without the causal mask, with packed segments or dropout, in
  float32, or on a TPU."""
  term = _alibi(True) if scheme == "alibi" else _fox(jnp.zeros((1, length, WIDTH)))
  forms = [term.fused_form()]
  shape = (2, length, 12, 64)
  table = route_table.RouteTable(route_table.points())

  def plan(**kw):
    args = dict(dtype="bfloat16", causal=True, mask="key", device=device) | kw
    return route_plan.plan(shape, shape, shape, args.pop("dtype"), forms, table=table, **args)

  folded = plan()
  assert (folded.runner, folded.implementation, folded.entries, folded.qk_dim) == (
      "dot_product_attention", "cudnn", ("channels",), 72), str(folded)
  for other in (plan(segments=True), plan(dropout=True), plan(dtype="float32"),
                plan(device=route_plan.Device("tpu", "TPU v5 lite"))):
    assert "channels" not in other.entries, str(other)
  if scheme == "alibi":
    assert "channels" not in plan(causal=False).entries
