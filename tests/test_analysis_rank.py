"""Numerical rank (DIET Theorem 1, Fig. 2/8): input APE is capped at d_h, DIET-ABS is not."""

import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posenc_jax.analysis import (DEFAULT_RTOL, bundled_tokens, logit_ranks, numerical_rank,
                                 positional_attention, positional_ranks, random_batch,
                                 rank_report)
from posenc_jax.models import BertEncoder, model_config

LENGTH = 32  # > d_h = 16, so the cap is visible


def test_numerical_rank_of_constructed_matrices():
  rng = np.random.default_rng(0)
  for r in (1, 5, 17):
    m = rng.normal(size=(40, r)) @ rng.normal(size=(r, 30))
    assert numerical_rank(m) == r
  assert numerical_rank(np.eye(12)) == 12
  assert numerical_rank(np.zeros((6, 6))) == 0
  batch = np.stack([np.diag([1.0, 1.0, 0.0]), np.diag([1.0, 0.0, 0.0])])
  assert numerical_rank(batch).tolist() == [2, 1]


def test_numerical_rank_tolerance_is_relative_to_the_largest_singular_value():
  m = np.diag([10.0, 1e-2, 1e-6])
  assert numerical_rank(m, rtol=1e-4) == 2
  assert numerical_rank(m, rtol=1e-2) == 1
  assert numerical_rank(1e-8 * m, rtol=1e-4) == 2  # scale does not matter
  assert DEFAULT_RTOL == 1e-4


def random_model(scheme, seed=0):
  """One layer, d_h = 16 < L = 32, N(0, 1) parameters drawn by numpy (nothing to compile)."""
  cfg = model_config(vocab_size=64, d_model=32, num_layers=1, num_heads=2, mlp_dim=64,
                     max_len=LENGTH, scheme=scheme)
  encoder = BertEncoder(cfg)
  abstract = jax.eval_shape(encoder.init, jax.random.key(0), jnp.ones((1, 8), jnp.int32))
  rng = np.random.default_rng(seed)
  params = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32),
                        nn.unbox(abstract["params"]))
  return types.SimpleNamespace(encoder=encoder, variables={"params": params}, config=cfg,
                               tokens=bundled_tokens(64))


@pytest.fixture(scope="module")
def ape():
  return random_model({"name": "learned_ape"})


def test_input_ape_positional_attention_rank_is_at_most_head_dim(ape):
  d_h = ape.config.dim_per_head
  ranks, kind = positional_ranks(ape.encoder, ape.variables, length=LENGTH)
  assert kind == "input"
  assert ranks.shape == (ape.config.num_heads,)
  assert (ranks <= d_h).all()
  assert (ranks == d_h).all()  # a random table reaches the cap, no more


def test_input_ape_logit_rank_is_at_most_head_dim(ape):
  ids = random_batch(ape.tokens, 4, LENGTH, seed=0)
  ranks = logit_ranks(ape.encoder, ape.variables, ids)
  assert ranks.shape == (4, ape.config.num_heads)
  assert (ranks <= ape.config.dim_per_head).all()
  assert (ranks == ape.config.dim_per_head).all()


def test_diet_abs_reaches_its_constructed_rank():
  d_p = 24  # between d_h = 16 and L = 32
  model = random_model({"name": "diet_abs", "rank": d_p})
  ranks, kind = positional_ranks(model.encoder, model.variables, length=LENGTH)
  assert kind == "term"
  assert ranks.tolist() == [d_p, d_p]
  ids = random_batch(model.tokens, 2, LENGTH, seed=0)
  # Content (rank <= 16) plus P_Q P_K^T (rank 24): beyond Theorem 1's cap for input APE.
  assert (logit_ranks(model.encoder, model.variables, ids) > model.config.dim_per_head).all()
  # The positional term is P_Q P_K^T itself.
  params = model.variables["params"]["position"]
  expected = np.einsum("lhr,mhr->hlm", params["p_query"][0], params["p_key"][0])
  np.testing.assert_allclose(positional_attention(model.encoder, model.variables).values,
                             expected, rtol=1e-4, atol=1e-4)
  small = random_model({"name": "diet_abs", "rank": 5, "sharing": "layer"})
  assert positional_ranks(small.encoder, small.variables)[0].tolist() == [5, 5]


def test_rank_report(ape):
  report = rank_report(ape.encoder, ape.variables, ape.tokens, batch_size=2)
  assert report["rtol"] == DEFAULT_RTOL and report["head_dim"] == 16
  assert report["length"] == LENGTH
  assert np.asarray(report["logits"]["ranks"]).shape == (2, 2)
  assert report["logits"]["max"] <= 16
  assert report["positional"] == {"kind": "input", "ranks": [16, 16], "min": 16, "max": 16,
                                  "mean": 16.0}
  none = random_model({"name": "none"})
  assert "positional" not in rank_report(none.encoder, none.variables, none.tokens,
                                         batch_size=1)
