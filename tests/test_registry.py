"""Schemes from plain configs; one clear error line per invalid setting."""

import jax
import jax.numpy as jnp
import ml_collections
import pytest

from posenc_jax import SCHEMES, SchemeConfigError, build_scheme
from posenc_jax.schemes import DietAbs
from tests.conftest import DIMS, segment_ids


def build(config, **dims):
  return build_scheme(config, **{**DIMS, **dims})


def test_config_dict_and_plain_dict_build_the_same_scheme():
  plain = build({"name": "diet_abs", "rank": 128, "sharing": "layer"})
  config = ml_collections.ConfigDict({"name": "diet_abs", "rank": 128, "sharing": "layer"})
  from_config = build(config)
  assert isinstance(plain, DietAbs) and isinstance(from_config, DietAbs)
  assert (plain.rank, plain.sharing) == (from_config.rank, from_config.sharing) == (128, "layer")


@pytest.mark.parametrize("config,message", [
    ({"name": "diet_abz"}, "scheme name 'diet_abz' is unknown; did you mean 'diet_abs'?; allowed: "
                           "alibi, bert_ad, cope, diet_abs"),
    ({}, "scheme name None is unknown; allowed: "),
    ({"name": "diet_abs", "rnak": 4}, "scheme 'diet_abs': unknown field 'rnak'; did you mean "
                                      "'rank'?; allowed fields: content_scale, rank, sharing"),
    ({"name": "diet_abs", "rank": 0}, "scheme 'diet_abs': rank must be a positive integer or None, got 0"),
    ({"name": "diet_abs", "rank": -3}, "rank must be a positive integer or None, got -3"),
    ({"name": "diet_abs", "rank": 2.5}, "rank must be a positive integer or None, got 2.5"),
    ({"name": "diet_abs", "rank": True}, "rank must be a positive integer or None, got True"),
    ({"name": "diet_abs", "sharing": "all"},
     "scheme 'diet_abs': sharing must be one of 'none', 'layer', 'head', got 'all'"),
    ({"name": "diet_abs", "content_scale": 0.0}, "content_scale must be a finite positive number or None"),
    ({"name": "diet_rel", "clip": -1}, "scheme 'diet_rel': clip must be an integer >= 0 or None, got -1"),
    ({"name": "diet_rel", "sharing": "layers"}, "sharing must be one of 'none', 'layer', 'head'"),
    ({"name": "shaw", "clip": -2}, "scheme 'shaw': clip must be an integer >= 0, got -2"),
    ({"name": "shaw", "sharing": "head"}, "scheme 'shaw': sharing must be one of 'none', 'layer'"),
    ({"name": "shaw", "value": "yes"}, "scheme 'shaw': value must be true or false, got 'yes'"),
    ({"name": "sinusoidal_rpe", "clip": -1}, "clip must be an integer >= 0"),
    ({"name": "t5", "num_buckets": 0}, "scheme 't5': num_buckets must be a positive integer"),
    ({"name": "t5", "sharing": "x"}, "scheme 't5': sharing must be one of"),
    ({"name": "tupe_a", "untie_cls": 1}, "scheme 'tupe_a': untie_cls must be true or false, got 1"),
    ({"name": "tupe_r", "max_distance": 0}, "scheme 'tupe_r': max_distance must be a positive integer"),
    ({"name": "segment_per_head", "num_segments": 0}, "num_segments must be a positive integer"),
    ({"name": "alibi", "causal": None}, "scheme 'alibi': causal must be true or false, got None"),
    ({"name": "rope", "base": -1.0}, "scheme 'rope': base must be a finite number > 1, got -1.0"),
    ({"name": "learned_ape", "max_len": 4}, "scheme 'learned_ape': unknown field 'max_len'; "
                                            "allowed fields: init_std"),
    ({"name": "learned_ape", "init_std": -0.02},
     "scheme 'learned_ape': init_std must be a finite number >= 0, got -0.02"),
    ({"name": "sinusoidal_ape", "amplitude": 0.0},
     "scheme 'sinusoidal_ape': amplitude must be a finite positive number, got 0.0"),
    ("diet_abs", "scheme config must be a mapping with a 'name', got 'diet_abs'"),
    ({"name": "fire", "mlp_width": 0}, "scheme 'fire': mlp_width must be a positive integer, got 0"),
    ({"name": "fire", "init_c": 0.0},
     "scheme 'fire': init_c must be a finite positive number, got 0.0"),
    ({"name": "fire", "init_L": -512.0},
     "scheme 'fire': init_L must be a finite positive number, got -512.0"),
    ({"name": "fire", "eps": float("nan")},
     "scheme 'fire': eps must be a finite positive number, got nan"),
    ({"name": "fire", "causal": "yes"}, "scheme 'fire': causal must be true or false, got 'yes'"),
    ({"name": "fire", "sharing": "head"},
     "scheme 'fire': sharing must be one of 'none', 'layer', got 'head'"),
    ({"name": "cope", "npos_max": 0},
     "scheme 'cope': npos_max must be a positive integer or None, got 0"),
    ({"name": "cope", "npos_max": 2.5},
     "scheme 'cope': npos_max must be a positive integer or None, got 2.5"),
    ({"name": "cope", "sharing": "head"},
     "scheme 'cope': sharing must be one of 'none', 'layer', got 'head'"),
])
def test_invalid_configs_raise_one_clear_line(config, message):
  with pytest.raises(SchemeConfigError) as error:
    build(config)
  assert message in str(error.value)
  assert "\n" not in str(error.value)


@pytest.mark.parametrize("dims,message", [
    ({"num_heads": 0}, "num_heads must be a positive integer, got 0"),
    ({"max_len": -1}, "max_len must be a positive integer, got -1"),
])
def test_invalid_model_dimensions(dims, message):
  with pytest.raises(SchemeConfigError, match=message):
    build({"name": "t5"}, **dims)


@pytest.mark.parametrize("name,dims,message", [
    ("rope", {"head_dim": 7}, "scheme 'rope': head_dim must be even, got 7"),
    ("sinusoidal_rpe", {"head_dim": 5}, "scheme 'sinusoidal_rpe': head_dim must be even, got 5"),
    ("sinusoidal_ape", {"d_model": 33}, "scheme 'sinusoidal_ape': d_model must be even, got 33"),
])
def test_odd_dimensions_for_paired_schemes(name, dims, message):
  with pytest.raises(SchemeConfigError, match=message):
    build({"name": name}, **dims)


@pytest.mark.parametrize("name", ["learned_ape", "diet_abs", "tupe_a", "tupe_r", "bert_ad"])
def test_length_longer_than_the_absolute_table(name):
  scheme = build({"name": name})
  with pytest.raises(SchemeConfigError, match=rf"scheme '{name}': sequence length 17 exceeds "
                                              r"max_len=16"):
    scheme.init(jax.random.key(0), 17)


@pytest.mark.parametrize("name", ["diet_rel", "t5", "alibi", "rope", "shaw", "sinusoidal_ape"])
def test_relative_schemes_take_any_length(name):
  scheme = build({"name": name})
  variables = scheme.init(jax.random.key(0), 40)
  assert jax.tree.leaves(scheme.apply(variables, 40).terms) or name == "sinusoidal_ape"


@pytest.mark.parametrize("name", ["segment_input", "segment_per_head"])
def test_segment_schemes_need_segment_ids(name):
  with pytest.raises(SchemeConfigError, match=f"scheme '{name}': segment_ids are required"):
    build({"name": name}).init(jax.random.key(0), 10)


def test_every_registered_name_builds():
  for name in SCHEMES:
    scheme = build({"name": name})
    assert scheme.init(jax.random.key(0), 10, segment_ids()) is not None


def test_composition_adds_embeddings_and_concatenates_terms():
  both = build([{"name": "learned_ape"}, {"name": "segment_input"}, {"name": "alibi"},
                {"name": "segment_per_head", "sharing": "layer"}])
  variables = both.init(jax.random.key(0), 10, segment_ids())
  st = both.apply(variables, 10, segment_ids())
  params = variables["params"]
  expected = (params["schemes_0"]["position_embedding"].value[:10][None]
              + params["schemes_1"]["segment_embedding"].value[segment_ids()])
  assert jnp.allclose(st.embed(jnp.zeros((2, 10, 32))), expected)
  assert len(st.for_layer(0)) == 2


def test_conflicting_content_scales_are_rejected():
  both = build([{"name": "tupe_a"}, {"name": "bert_ad"}])
  with pytest.raises(ValueError, match="content_scale: schemes ask for different content scales"):
    both.init(jax.random.key(0), 10)
