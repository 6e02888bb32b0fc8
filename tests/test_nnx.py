"""Every scheme and BERT under Flax NNX (posenc_jax.nnx.to_nnx): the same outputs and
gradients as linen on the same parameters, and a jitted optax step."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from posenc_jax import SCHEMES, build_scheme
from posenc_jax.models import BertEncoder, model_config
from posenc_jax.nnx import to_nnx
from tests.conftest import DIMS, LENGTH, SCHEME_CONFIGS, segment_ids

# Every registered name, with the options tests.conftest exercises where it has them.
CONFIGS = {**{name: {"name": name} for name in SCHEMES}, **SCHEME_CONFIGS}


def _linen_params(module: nnx.Module):
  """The bridged module's parameters as a linen ``params`` tree (unboxed arrays)."""
  return nnx.to_pure_dict(nnx.state(module, nnx.Param))


def _loss(terms) -> jax.Array:
  """A scalar that depends on every array the scheme returns."""
  return sum((jnp.sum(jnp.sin(x)) for x in jax.tree.leaves(terms) if jnp.ndim(x)),
             jnp.zeros(()))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_scheme_runs_under_nnx_as_under_linen(name):
  linen = build_scheme(CONFIGS[name], **DIMS)
  scheme = to_nnx(linen, LENGTH, segment_ids(), rngs=nnx.Rngs(3))
  params = _linen_params(scheme)
  if "params" in nn.unbox(linen.init(jax.random.key(0), LENGTH, segment_ids())):
    assert params, name  # a scheme with parameters has them under NNX too

  ours = scheme(LENGTH, segment_ids())
  theirs = linen.apply({"params": params}, LENGTH, segment_ids())
  jax.tree.map(np.testing.assert_array_equal, ours, theirs)

  grads = nnx.grad(lambda m: _loss(m(LENGTH, segment_ids())))(scheme)
  expected = jax.grad(lambda p: _loss(linen.apply({"params": p}, LENGTH, segment_ids())))(
      params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6),
               nnx.to_pure_dict(grads), expected)


def _train_step(*inputs):
  """A jitted optimiser step of ``_loss`` on the module's outputs for ``inputs`` (closed
  over: a scheme's length is static)."""
  @nnx.jit
  def step(model, optimizer):
    def loss(m):
      return _loss(m(*inputs))
    value, grads = nnx.value_and_grad(loss)(model)
    optimizer.update(model, grads)
    return value
  return step


@pytest.mark.parametrize("name", ["diet_abs_share", "t5", "learned_ape", "tupe_r"])
def test_a_jitted_optax_step_moves_the_scheme(name):
  scheme = to_nnx(build_scheme(CONFIGS[name], **DIMS), LENGTH, segment_ids())
  before = _linen_params(scheme)
  optimizer = nnx.Optimizer(scheme, optax.sgd(0.1), wrt=nnx.Param)
  first = _train_step(LENGTH, segment_ids())(scheme, optimizer)
  after = _linen_params(scheme)
  assert np.isfinite(first)
  assert any(not np.array_equal(a, b)
             for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))


@pytest.mark.parametrize("scan_layers", [True, False])
def test_bert_encoder_under_nnx(scan_layers):
  """Init, apply (with dropout from the module's rngs), grad and a jitted AdamW step; the
  parameters keep their logical axis names for sharding."""
  cfg = model_config(vocab_size=64, d_model=32, num_layers=2, num_heads=4, mlp_dim=48,
                     max_len=16, scheme={"name": "diet_rel"}, scan_layers=scan_layers)
  ids = jnp.arange(2 * LENGTH, dtype=jnp.int32).reshape(2, LENGTH) % 64
  mask = jnp.ones_like(ids)
  encoder = to_nnx(BertEncoder(cfg), ids, segment_ids(), mask, rngs=nnx.Rngs(0, dropout=1))
  params = _linen_params(encoder)
  hidden, pooled = encoder(ids, segment_ids(), mask)
  jax.tree.map(np.testing.assert_array_equal, (hidden, pooled),
               BertEncoder(cfg).apply({"params": params}, ids, segment_ids(), mask))
  dropped, _ = encoder(ids, segment_ids(), mask, deterministic=False)
  assert not np.allclose(dropped, hidden)

  specs = jax.tree.leaves(nnx.get_partition_spec(nnx.state(encoder, nnx.Param)),
                          is_leaf=lambda x: isinstance(x, nnx.Variable))
  assert all(spec.get_value() for spec in specs)  # every parameter names its axes
  if scan_layers:
    assert any(spec.get_value()[0] == "layers" for spec in specs)

  optimizer = nnx.Optimizer(encoder, optax.adamw(1e-2), wrt=nnx.Param)
  step = _train_step(ids, segment_ids(), mask)
  losses = [float(step(encoder, optimizer)) for _ in range(3)]
  assert losses[-1] < losses[0]
