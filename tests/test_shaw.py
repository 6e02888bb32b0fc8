"""Shaw's relative term and the Toeplitz bias without gather or scatter, and Wang et
al.'s sinusoidal RPE with its value term (eq. 5).

The skewing against a loop, the new formulation against the old gather /
scatter-add one (values and gradients, decoding offsets included), and the
lowered training step of small BERTs, which must scatter only into the
word-embedding table. The sinusoidal RPE against eq. 5 written out in numpy,
on both routes, and decoding against teacher forcing.
"""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posenc_jax import SchemeConfigError, attend, build_scheme
from posenc_jax.route_plan import choose_route
from posenc_jax.models.build import build_model
from posenc_jax.presets import preset_config
from posenc_jax.terms import QueryRelative, relative_offsets, skew_offsets, toeplitz_bias
from posenc_jax.training.config import base_train_config
from posenc_jax.training.loop import TrainState, make_train_step
from posenc_jax.training.optim import make_optimizer
from tests import test_attention, test_decoding
from tests.conftest import DIMS, SCHEME_CONFIGS, init_scheme, padding_mask, qkv

B, H, D = 2, 3, 4
TOL = dict(rtol=1e-5, atol=1e-5)
# (Lq, Lk): square, more keys than queries, fewer, one query (a decoding step), one key.
LENGTHS = [(7, 7), (5, 9), (9, 5), (1, 6), (4, 1)]


def normal(seed, shape):
  return jax.random.normal(jax.random.key(seed), shape)


@pytest.mark.parametrize("q_len,k_len", LENGTHS + [(1, 1)])
def test_skew_offsets_against_loop(q_len, k_len):
  x = np.asarray(normal(0, (2, q_len, q_len + k_len - 1)))
  expected = np.zeros((2, q_len, k_len), np.float32)
  for i in range(q_len):
    for j in range(k_len):
      expected[:, i, j] = x[:, i, j - i + q_len - 1]
  np.testing.assert_array_equal(skew_offsets(jnp.asarray(x)), expected)


def old_index(term, q_len, k_len):
  """``[Lq, Lk]`` table row of each pair, as the old formulation computed it."""
  offset = 0 if term.q_offset is None else term.q_offset
  return jnp.clip(relative_offsets(q_len, k_len, offset), -term.clip, term.clip) + term.clip


def per_head(table):
  return table if table.ndim == 3 else jnp.broadcast_to(table, (H,) + table.shape)


def old_logits(term, q, scale):
  """The old key term: per-offset products, then ``take_along_axis``."""
  q_len, k_len = q.shape[1], term.k_len
  per_offset = jnp.einsum("bihd,hrd->bhir", q, per_head(term.key_table)) * scale
  index = jnp.broadcast_to(old_index(term, q_len, k_len), (B, H, q_len, k_len))
  return jnp.take_along_axis(per_offset, index, axis=-1)


def old_value_output(term, probs):
  """The old value term: weights summed per clipped offset with a scatter-add."""
  q_len, k_len = probs.shape[-2:]
  weights = jnp.zeros((B, H, q_len, 2 * term.clip + 1), probs.dtype)
  index = old_index(term, q_len, k_len)
  weights = weights.at[:, :, jnp.arange(q_len)[:, None], index].add(probs)
  return jnp.einsum("bhir,hrd->bihd", weights, per_head(term.value_table))


def shaw_outputs_and_grads(new, key_table, value_table, q, probs, cotangents, q_offset, clip,
                           k_len):
  """Logits, value output and the gradients of ``<outputs, cotangents>`` w.r.t. the four
  arrays, with the new formulation or the old one."""

  def loss(*arrays):
    term = QueryRelative(*arrays[:2], q_offset=q_offset, clip=clip, k_len=k_len)
    if new:
      outputs = term.logits(arrays[2], 0.5), term.value_output(arrays[3])
    else:
      outputs = old_logits(term, arrays[2], 0.5), old_value_output(term, arrays[3])
    return sum(jnp.sum(x * c) for x, c in zip(outputs, cotangents)), outputs

  grads, outputs = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(key_table, value_table, q,
                                                                     probs)
  return outputs + grads


@pytest.mark.parametrize("q_offset", [None, 3, 40, "traced"])
@pytest.mark.parametrize("clip", [2, 20])
@pytest.mark.parametrize("q_len,k_len", [(5, 9), (9, 5), (1, 6), (4, 1)])
def test_shaw_term_equals_the_gather_formulation(q_len, k_len, clip, q_offset):
  """Values and gradients (tables, q, probs) for clips below and above the lengths, a per-head
  key table and a shared value table; a traced ``q_offset`` (decoding) in range and past
  either end."""
  rows = 2 * clip + 1
  arrays = (normal(0, (H, rows, D)), normal(1, (rows, D)), normal(2, (B, q_len, H, D)),
            jax.nn.softmax(normal(3, (B, H, q_len, k_len)), -1),
            (normal(4, (B, H, q_len, k_len)), normal(5, (B, q_len, H, D))))

  def both(offset):
    return [shaw_outputs_and_grads(new, *arrays, offset, clip, k_len) for new in (True, False)]

  if q_offset == "traced":
    runs = [jax.jit(both)(jnp.int32(offset)) for offset in (-30, 0, 2, 7, 40)]
  else:
    runs = [jax.jit(both, static_argnums=0)(q_offset)]
  for got, expected in runs:
    assert got[0].shape == (B, H, q_len, k_len) and got[1].shape == (B, q_len, H, D)
    for x, y in zip(got, expected):
      np.testing.assert_allclose(x, y, **TOL)


@pytest.mark.parametrize("zero_first,q_offset", [(False, 0), (True, 0), (True, 2),
                                                  (True, "traced")])
@pytest.mark.parametrize("q_len,k_len", LENGTHS)
def test_toeplitz_bias_equals_the_take_formulation(q_len, k_len, zero_first, q_offset):
  """Values and the gradient w.r.t. the per-offset vector."""
  values = normal(0, (H, q_len + k_len - 1))
  cotangent = normal(1, (1, H, q_len, k_len))

  def old(values, offset):
    bias = jnp.take(values, relative_offsets(q_len, k_len) + q_len - 1, axis=-1)
    if zero_first:
      rows = jnp.arange(q_len) + offset != 0
      bias = bias * (rows[:, None] & (jnp.arange(k_len) != 0)[None, :])
    return bias[None]

  def new(values, offset):
    return toeplitz_bias(values, q_len, k_len, zero_first, offset)

  def both(offset):
    return [(fn(values, offset), jax.grad(lambda v: jnp.sum(fn(v, offset) * cotangent))(values))
            for fn in (new, old)]

  if q_offset == "traced":
    runs = [jax.jit(both)(jnp.int32(offset)) for offset in (0, 2)]
  else:
    runs = [jax.jit(both, static_argnums=0)(q_offset)]
  for (bias, grad), (old_bias, old_grad) in runs:
    np.testing.assert_array_equal(bias, old_bias)
    np.testing.assert_allclose(grad, old_grad, **TOL)  # sums in another order


VOCAB, D_MODEL, LENGTH = 96, 32, 12


def lowered_train_step(scheme: str) -> str:
  """StableHLO text of the jitted MLM training step (loss, gradients, AdamW update)."""
  config = preset_config(f"bert_tiny,{scheme}")
  if scheme == "shaw":  # the key and the value term
    config.model.scheme = {"name": "shaw", "clip": 4, "value": True}
  config.model.update(vocab_size=VOCAB, d_model=D_MODEL, mlp_dim=64, max_len=16)
  model = build_model(config.model, "mlm")
  train = base_train_config()
  train.optimizer.warmup_steps = 10
  train.seq_len, train.max_predictions_per_seq = LENGTH, 4  # the MLM head at 4 positions
  tx, schedule = make_optimizer(train.optimizer, train.total_steps)
  ids = jnp.ones((2, LENGTH), jnp.int32)
  batch = dict(input_ids=ids, segment_ids=jnp.zeros_like(ids), mask=ids, mlm_targets=ids,
               mlm_weights=jnp.ones(ids.shape, jnp.float32))
  params = nn.unbox(jax.eval_shape(model.init, jax.random.key(0), ids, ids, ids)["params"])
  state = jax.eval_shape(lambda p: TrainState.create(apply_fn=model.apply, params=p, tx=tx),
                         params)
  step = jax.jit(make_train_step(model, train, schedule))
  return step.lower(state, batch, jax.random.key(1)).as_text()


@pytest.mark.parametrize("scheme", ["shaw", "t5", "diet_rel", "bert"])
def test_training_step_scatters_only_into_the_word_embeddings(scheme):
  """Small-table lookups are one-hot contractions or slices, so their gradients are matmuls;
  only the word-embedding table (``[V, d]``) keeps its gather and scatter-add gradient."""
  text = lowered_train_step(scheme)
  word_embeddings = f"tensor<{VOCAB}x{D_MODEL}xf32>"
  # A scatter's region ends with '}) : (operand types) -> result type'.
  scatters = re.findall(r'"stablehlo\.scatter"\(.*?\}\) : \(.*?\) -> (tensor<[^>]*>)', text,
                        re.DOTALL)
  assert len(scatters) == text.count('"stablehlo.scatter"(')
  assert scatters and set(scatters) == {word_embeddings}
  # Every gather reads the word embeddings (its first operand type).
  gathers = re.findall(r'"stablehlo\.gather"\(.*? : \((tensor<[^>]*>)', text)
  assert len(gathers) == text.count('"stablehlo.gather"(')
  assert set(gathers) == {word_embeddings}


# --- Wang et al.'s sinusoidal RPE: eq. 5, P added to the keys and the values -----------------

# Clip 3 or 4 truncates within the test length of 10; the learnable variants get N(0, 1)
# frequencies from init_scheme.
SINUSOIDAL_RPE = {
    "sinusoidal_rpe_value": {"name": "sinusoidal_rpe", "clip": 4},  # value: the default
    "sinusoidal_rpe_key_only": {"name": "sinusoidal_rpe", "clip": 4, "value": False},
    "sinusoidal_rpe_learnable_value": {"name": "sinusoidal_rpe", "clip": 3, "learnable": True},
    "sinusoidal_rpe_learnable_key_only": {"name": "sinusoidal_rpe", "clip": 3,
                                          "learnable": True, "value": False},
}


def numpy_eq5(q, k, v, mask, freqs, clip, value):
  """Wang et al.'s eq. 5 in float64: ``A_ij = c q_i . (k_j + P_{clip(j-i)})``, masked
  softmax, ``out_i = sum_j a_ij (v_j + P_{clip(j-i)})`` (``P`` on the values only with
  ``value``), with ``P_r = (sin(r w_0), cos(r w_0), sin(r w_1), ...)``."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  length, dim = q.shape[1], q.shape[-1]
  rel = np.clip(np.arange(length)[None, :] - np.arange(length)[:, None], -clip, clip)
  angles = rel[..., None] * np.asarray(freqs, np.float64)  # [L, L, D/2]
  p = np.stack([np.sin(angles), np.cos(angles)], -1).reshape(length, length, dim)
  scale = 1.0 / np.sqrt(dim)
  logits = (np.einsum("bihd,bjhd->bhij", q, k) + np.einsum("bihd,ijd->bhij", q, p)) * scale
  logits = np.where(np.asarray(mask)[:, None, None, :], logits, -np.inf)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  out = np.einsum("bhij,bjhd->bihd", probs, v)
  return out + np.einsum("bhij,ijd->bihd", probs, p) if value else out


@pytest.mark.parametrize("name", sorted(SINUSOIDAL_RPE))
def test_sinusoidal_rpe_is_eq5(name):
  """Both layers' terms (one shared table) against eq. 5 written out, padding included."""
  config = SINUSOIDAL_RPE[name]
  _, params, st = init_scheme(config)
  dim = DIMS["head_dim"]
  freqs = (params["params"]["frequencies"].value if config.get("learnable")
           else 10000.0 ** (-np.arange(0, dim, 2) / dim))
  q, k, v = qkv()
  mask = padding_mask()
  want = numpy_eq5(q, k, v, mask, freqs, config["clip"], config.get("value", True))
  for layer in range(DIMS["num_layers"]):
    got = attend(q, k, v, st.for_layer(layer), mask=mask, route="reference")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(SINUSOIDAL_RPE))
def test_sinusoidal_rpe_routes_and_decoding(name, monkeypatch):
  """The key term alone: fused route = reference (values and gradients); with the value
  term the fused route refuses in one line and ``auto`` takes the reference route. Either
  way, sliced queries and cached decoding steps equal the full (teacher-forced) pass."""
  monkeypatch.setitem(SCHEME_CONFIGS, name, SINUSOIDAL_RPE[name])
  test_attention.test_fused_route_matches_reference(name, causal=True)
  _, _, st = init_scheme(SINUSOIDAL_RPE[name])
  value = SINUSOIDAL_RPE[name].get("value", True)
  forms = [t.fused_form() for t in st.for_layer(0)]
  assert choose_route("auto", forms, backend="gpu") == ("reference" if value else "fused")
  test_decoding.test_scheme_terms_slice_and_kv_cache(name, "auto" if value else "fused")


def test_sinusoidal_rpe_value_field():
  """The paper's value term by default; the field is validated in one line; the parameter
  tree does not depend on it (checkpoints load either way)."""
  def scheme(**fields):
    return build_scheme({"name": "sinusoidal_rpe", **fields}, **DIMS)

  def param_shapes(**fields):
    module = scheme(**fields)
    return jax.eval_shape(lambda rng: module.init(rng, 6), jax.random.key(0))

  assert scheme().value is True
  with pytest.raises(SchemeConfigError) as info:
    scheme(value="yes")
  assert str(info.value) == ("scheme 'sinusoidal_rpe': value must be true or false, "
                             "got 'yes'")
  for learnable in (False, True):
    without, with_value = (param_shapes(learnable=learnable, value=v) for v in (False, True))
    assert jax.tree.structure(without) == jax.tree.structure(with_value)
    assert jax.tree.leaves(without) == jax.tree.leaves(with_value)
