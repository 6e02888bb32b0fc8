"""Parameter shapes, counts and axis names per sharing mode; shared terms are reused."""

import json
import pathlib

import flax.linen as nn
import jax
import numpy as np
import pytest

from posenc_jax import build_scheme
from tests.conftest import DIMS, SCHEME_CONFIGS, init_scheme, segment_ids

GOLDEN = pathlib.Path(__file__).parent / "golden" / "scheme_params.json"
LAYERS, HEADS, D_HEAD, MAX_LEN = DIMS["num_layers"], DIMS["num_heads"], DIMS["head_dim"], DIMS["max_len"]


def param_count(config):
  module = build_scheme(config, **DIMS)
  shapes = jax.eval_shape(lambda key: module.init(key, 10, segment_ids()), jax.random.key(0))
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))


@pytest.mark.parametrize("sharing,layers,heads", [("none", LAYERS, HEADS), ("layer", 1, HEADS),
                                                  ("head", LAYERS, 1)])
def test_parameter_counts_per_sharing_mode(sharing, layers, heads):
  assert param_count({"name": "diet_rel", "sharing": sharing}) == layers * heads * (2 * MAX_LEN - 1)
  assert param_count({"name": "diet_rel", "clip": 3, "sharing": sharing}) == layers * heads * 7
  assert param_count({"name": "diet_abs", "rank": 5, "sharing": sharing}) == (
      2 * layers * heads * MAX_LEN * 5)
  assert param_count({"name": "diet_abs", "sharing": sharing}) == 2 * layers * heads * MAX_LEN * D_HEAD
  assert param_count({"name": "segment_per_head", "sharing": sharing}) == layers * heads * 4
  assert param_count({"name": "t5", "sharing": sharing}) == layers * heads * 32


@pytest.mark.parametrize("sharing,layers", [("none", LAYERS), ("layer", 1)])
def test_shaw_counts(sharing, layers):
  assert param_count({"name": "shaw", "sharing": sharing}) == layers * 33 * D_HEAD
  assert param_count({"name": "shaw", "value": True, "sharing": sharing}) == 2 * layers * 33 * D_HEAD


def test_tupe_counts():
  d = DIMS["d_model"]
  projections = 2 * (d * d + d)  # U_Q, U_K with bias, shared by all layers
  tupe_a = MAX_LEN * d + 2 * d + projections + 2 * d  # table, LN, U, p_theta
  assert param_count({"name": "tupe_a"}) == tupe_a
  assert param_count({"name": "tupe_a", "untie_cls": False}) == tupe_a - 2 * d
  assert param_count({"name": "tupe_r"}) == tupe_a + HEADS * 32


@pytest.mark.parametrize("name", ["diet_abs_share", "t5", "tupe_a", "tupe_r", "alibi", "rope",
                                  "sinusoidal_rpe", "bert_ad"])
def test_layer_shared_terms_are_computed_once_and_identical(name):
  _, _, st = init_scheme(SCHEME_CONFIGS[name])
  for leaf in jax.tree.leaves(st.terms):
    assert leaf.shape[0] == 1  # one value for all layers
  for a, b in zip(jax.tree.leaves(st.for_layer(0)), jax.tree.leaves(st.for_layer(1))):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", ["diet_abs", "diet_rel", "shaw", "t5_causal_per_layer",
                                  "segment_per_head", "diet_rel_clip_head"])
def test_per_layer_terms_differ_between_layers(name):
  _, _, st = init_scheme(SCHEME_CONFIGS[name])
  first, second = (jax.tree.leaves(st.for_layer(i)) for i in (0, 1))
  assert any(not np.array_equal(a, b) for a, b in zip(first, second))


def describe_params(name):
  module = build_scheme(SCHEME_CONFIGS[name], **DIMS)
  boxed = jax.eval_shape(lambda key: module.init(key, 10, segment_ids()), jax.random.key(0))
  specs = nn.get_partition_spec(boxed)
  flat_shapes = {"/".join(str(k.key) for k in path): list(x.shape)
                 for path, x in jax.tree_util.tree_flatten_with_path(nn.unbox(boxed))[0]}
  flat_axes = {"/".join(str(k.key) for k in path): list(spec)
               for path, spec in jax.tree_util.tree_flatten_with_path(
                   specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))[0]}
  return {path: {"shape": flat_shapes[path], "axes": flat_axes[path]} for path in flat_shapes}


def test_parameter_shapes_and_logical_axes_match_golden():
  """Every parameter has logical axis names (one per dimension), pinned in a golden file."""
  got = {name: describe_params(name) for name in sorted(SCHEME_CONFIGS)}
  for params in got.values():
    for entry in params.values():
      assert len(entry["axes"]) == len(entry["shape"]) and all(entry["axes"])
  assert got == json.loads(GOLDEN.read_text())
