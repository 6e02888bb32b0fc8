"""Per-layer schemes (``model.alternate_scheme`` every ``alternate_scheme_interval``-th layer;
``nope_layer_interval`` is its shorthand for scheme ``none``): the parameter tree, the terms
each layer receives against the schemes built alone, scanned equal to unrolled, the
encoder-decoder and the language model (cached decoding equal to teacher forcing), the
preset, and the one-line refusals. NoPE layers themselves: ``tests/test_nope.py``."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posenc_jax.attention import MultiHeadAttention
from posenc_jax.models import BertEncoder, ModelConfigError, model_config
from posenc_jax.models.build import build_model, check_head
from posenc_jax.models.scan import layout_for
from posenc_jax.nnx import to_nnx
from posenc_jax.presets import preset_config
from posenc_jax.schemes import build_scheme
from posenc_jax.training.config import (TrainConfigError, base_train_config,
                                        validate_train_config)
from posenc_jax.training.metrics import train_flops_per_step
from tests.test_configs import _parsed
from tests.test_lm import cached_logits, init_lm, token_ids
from tests.test_nope import IDS, TOL, both_layouts, tiny

ROPE = {"name": "rope"}
# Per-layer tables (sharing none): layer 3 must read row 3 of the alternate's table.
T5 = {"name": "t5", "num_buckets": 8, "max_distance": 6, "sharing": "none"}
SEGMENTS = jnp.array([[0, 0, 0, 1, 1, 1], [0, 1, 1, 0, 0, 1]])


def alternating(**fields):
  """4 layers: RoPE on layers 0-2, T5 on layer 3 (and ``fields``)."""
  return tiny(**{"nope_layer_interval": 0, "alternate_scheme": T5,
                 "alternate_scheme_interval": 4, **fields})


def abstract_params(cfg, head="mlm", *args):
  return nn.unbox(jax.eval_shape(build_model(cfg, head).init, jax.random.key(0),
                                 *(args or (IDS,)))["params"])


def shapes(tree):
  return jax.tree.map(lambda x: x.shape, tree)


def test_the_tree_holds_each_schemes_parameters_and_nothing_else_changes():
  """``alternate_position`` holds T5's per-layer table as T5 alone would; the rest of the
  tree is RoPE's model's; NoPE layers add no parameters (the alternate ``none`` has none)."""
  tree = abstract_params(alternating(scan_layers=False))["bert"]
  alone = abstract_params(tiny(nope_layer_interval=0, scheme=T5, scan_layers=False))["bert"]
  rope = abstract_params(tiny(nope_layer_interval=0, scan_layers=False))["bert"]
  assert shapes(tree["alternate_position"]) == shapes(alone["position"])
  assert shapes(tree["alternate_position"])["relative_bias"][0] == 4  # per layer
  assert shapes({k: v for k, v in tree.items() if k != "alternate_position"}) == shapes(rope)
  assert shapes(abstract_params(tiny(scan_layers=False))) == shapes(
      abstract_params(tiny(nope_layer_interval=0, scan_layers=False)))


def captured_terms(cfg, params, segments):
  """The terms each layer's attention receives: ``{layer: [Term, ...]}`` (unrolled BERT)."""
  seen = {}

  def capture(next_fun, args, kwargs, context):
    if isinstance(context.module, MultiHeadAttention) and context.method_name == "__call__":
      seen[int(context.module.path[-2].rsplit("_", 1)[1])] = args[1]
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(capture):
    build_model(cfg, "mlm").apply({"params": params}, IDS, segments)
  return seen


def test_each_layer_receives_its_schemes_terms():
  """RoPE on layers 0-2 and T5 on layer 3, each layer's terms equal those of its scheme
  built alone on the model's parameters (T5's layer-3 row of the alternate table), followed
  by the per-head segment terms, which every layer keeps; RoPE's rotation is not on layer 3
  and T5's bias on no other."""
  cfg = alternating(scan_layers=False, segment={"name": "segment_per_head"})
  params = jax.tree.map(lambda x: jax.random.normal(jax.random.key(x.size), x.shape),
                        abstract_params(cfg, "mlm", IDS, SEGMENTS))
  bert = params["bert"]
  dims = dict(num_layers=4, num_heads=2, head_dim=8, d_model=16, max_len=16)
  length = IDS.shape[1]
  rope = build_scheme(ROPE, **dims).apply({}, length)
  t5 = build_scheme(T5, **dims).apply({"params": bert["alternate_position"]}, length)
  segment = build_scheme({"name": "segment_per_head"}, **dims).apply(
      {"params": bert["segment"]}, length, SEGMENTS)
  seen = captured_terms(cfg, params, SEGMENTS)
  for layer in range(4):
    own = (t5 if layer == 3 else rope).for_layer(layer)
    expected = own + segment.for_layer(layer)
    got = seen[layer]
    assert [type(t) for t in got] == [type(t) for t in expected], layer
    jax.tree.map(np.testing.assert_array_equal, list(got), expected)
  own_row, other_row = (np.asarray(t5.for_layer(i)[0].table) for i in (3, 2))
  assert np.abs(own_row - other_row).max() > 1e-3  # the layer's own row, not another's


def test_scanned_equals_unrolled_with_gradients():
  """The scanned stack's ``nn.cond`` between the two schemes' terms gives the unrolled
  values and gradients (BERT, 2 layers: DIET-REL on layer 0, T5 on layer 1, both with
  per-layer tables; under remat: ``tests/test_nope.py``)."""
  cfg = alternating(scheme={"name": "diet_rel", "clip": 3}, num_layers=2,
                    alternate_scheme_interval=2)
  unrolled, scanned, params, stacked = both_layouts(cfg, "mlm", IDS)
  loss = lambda model, p: jnp.sum(jnp.sin(model.apply({"params": p}, IDS)))  # noqa: E731
  want, grads = jax.value_and_grad(lambda p: loss(unrolled, p))(params)
  got, grads_s = jax.value_and_grad(lambda p: loss(scanned, p))(stacked)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for g, g_s in zip(jax.tree.leaves(layout_for(grads, True)), jax.tree.leaves(grads_s)):
    np.testing.assert_allclose(g_s, g, **TOL)
  assert np.abs(np.asarray(grads["bert"]["alternate_position"]["relative_bias"])
                ).max() > 0  # the alternate's table is trained


def test_encoder_decoder_builds_the_causal_alternate_in_the_decoder():
  """Translation, 2 + 2 layers, RoPE with T5 on layer 1 of each stack (traced, not
  compiled): each stack has its own ``alternate_position`` table, the encoder's T5 is
  bidirectional and the decoder's its unidirectional form."""
  cfg = tiny(num_layers=2, num_decoder_layers=2, nope_layer_interval=0, alternate_scheme=T5,
             alternate_scheme_interval=2)
  model = build_model(cfg, "translation")
  seen = {}

  def record(next_fun, args, kwargs, context):
    module = context.module
    if module.name in ("position", "alternate_position") and context.method_name == "__call__":
      seen[module.path] = getattr(module, "bidirectional", "rope")
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(record):
    params = jax.eval_shape(model.init, jax.random.key(0), IDS, IDS)["params"]
    logits = jax.eval_shape(model.apply, {"params": params}, IDS, IDS)
  assert seen == {("encoder", "position"): "rope", ("encoder", "alternate_position"): True,
                  ("decoder", "position"): "rope", ("decoder", "alternate_position"): False}
  for stack in ("encoder", "decoder"):
    assert nn.unbox(params[stack]["alternate_position"])["relative_bias"].shape[0] == 2
  assert logits.shape == (*IDS.shape, 20)


def test_language_model_decodes_as_it_is_teacher_forced():
  """Scanned, RoPE on layer 0 and causal ALiBi on layer 1: one cached step per position
  gives the teacher-forced logits, which differ from RoPE alone."""
  ids = token_ids(6, length=4)
  model, params = init_lm(ROPE, alternate_scheme={"name": "alibi"},
                          alternate_scheme_interval=2)
  forced = model.apply({"params": params}, ids)
  np.testing.assert_allclose(cached_logits(model, params, ids), forced, **TOL)
  rope = model.clone(config=model.config.replace(alternate_scheme={"name": "none"},
                                                 alternate_scheme_interval=0))
  assert np.abs(np.asarray(forced - rope.apply({"params": params}, ids))).max() > 1e-3


def test_gemma3_preset_puts_the_long_base_on_every_sixth_layer():
  """``gemma3_global_rope`` on BERT-base's 12 layers: layers 5 and 11 run RoPE with base
  1e6, the others the ``rope`` preset's base 1e4."""
  cfg = model_config(preset_config("bert_base,rope,gemma3_global_rope").model)
  assert cfg.alternate_layers(12) == ((False,) * 5 + (True,)) * 2
  assert cfg.alternate() == ({"name": "rope", "base": 1e6}, 6)
  assert cfg.scheme["name"] == "rope" and "base" not in cfg.scheme


def test_the_alternate_is_set_from_the_command_line():
  """``--config.model.alternate_scheme.<field>`` as for ``model.scheme``: a new name, then
  its hyperparameters with their types, and the interval."""
  config = _parsed("configs/pretrain.py:bert_small,rope",
                   "--config.model.alternate_scheme.name=rope",
                   "--config.model.alternate_scheme.base=1000000",
                   "--config.model.alternate_scheme_interval=4")
  cfg = check_head(config.model, config.head)
  assert cfg.alternate() == ({"name": "rope", "base": 1e6}, 4)
  assert cfg.alternate_layers(4) == (False, False, False, True)


@pytest.mark.parametrize("fields, message", [
    ({"alternate_scheme_interval": 4}, "model.nope_layer_interval: got 4 with an alternate "
                                       "scheme set; allowed: 0 with alternate_scheme"),
    ({"alternate_scheme": T5}, "model.nope_layer_interval: got 4 with an alternate scheme set"),
    ({"nope_layer_interval": 0, "alternate_scheme": T5},
     "model.alternate_scheme: got {'name': 't5', 'num_buckets': 8, 'max_distance': 6, "
     "'sharing': 'none'} with alternate_scheme_interval 0 (off); allowed: an interval in "
     "[2, 4] with it, or {'name': 'none'}"),
    ({"nope_layer_interval": 0, "alternate_scheme_interval": 5},
     "model.alternate_scheme_interval: got 5; allowed: 0 (off) or an integer in [2, 4]"),
    ({"nope_layer_interval": 0, "alternate_scheme_interval": 1},
     "model.alternate_scheme_interval: got 1; allowed: 0 (off) or an integer in [2, 4]"),
    ({"nope_layer_interval": 0, "alternate_scheme_interval": 2, "alternate_scheme": ROPE},
     "model.alternate_scheme_interval: got 2, but the alternate scheme is model.scheme "
     "('rope') itself"),
    ({"nope_layer_interval": 0, "alternate_scheme_interval": 2,
      "alternate_scheme": {"name": "segment_per_head"}},
     "model.alternate_scheme: got 'segment_per_head', a segment scheme"),
    ({"nope_layer_interval": 0, "alternate_scheme_interval": 2,
      "alternate_scheme": {"name": "t5", "num_buckets": 3}},
     "model.alternate_scheme: scheme 't5': num_buckets must be an even integer >= 4"),
    ({"nope_layer_interval": 0, "alternate_scheme_interval": 2,
      "alternate_scheme": {"name": "t5", "num_buckets": 4, "max_distance": 2},
      "num_decoder_layers": 2},
     "model.alternate_scheme: decoder (causal form): scheme 't5': max_distance must exceed"),
    ({"nope_layer_interval": 0, "alternate_scheme_interval": 2,
      "alternate_scheme": {"name": "cope"}, "num_decoder_layers": 2},
     "model.alternate_scheme: got 'cope' in the encoder-decoder's encoder, a bidirectional "
     "stack"),
    ({"nope_layer_interval": 0, "alternate_scheme_interval": 2, "attention": "linformer",
      "linformer_k": 4, "scheme": {"name": "none"}, "alternate_scheme": ROPE},
     "model.alternate_scheme: 'rope' has attention terms over the L key positions"),
], ids=["both-intervals", "nope-with-alternate", "alternate-off", "too-long", "one", "same",
        "segment", "bad-field", "causal-form", "cope-encoder", "linformer"])
def test_bad_configs_are_one_line(fields, message):
  with pytest.raises(ModelConfigError) as e:
    tiny(**fields)
  assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.parametrize("fields, message", [
    ({"alternate_scheme": {"name": "learned_ape"}},
     "model.alternate_scheme: the alternate scheme adds input embeddings"),
    ({"alternate_scheme": {"name": "tupe_a"}},
     "model.alternate_scheme: the alternate scheme sets every layer's content scale"),
    ({"scheme": {"name": "sinusoidal_ape"}},
     "model.alternate_scheme_interval: the scheme adds input embeddings"),
])
def test_input_level_and_scaled_schemes_are_refused_when_built(fields, message):
  model = build_model(alternating(**fields), "mlm")
  with pytest.raises(ModelConfigError) as e:
    jax.eval_shape(model.init, jax.random.key(0), IDS)
  assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_cope_as_the_alternate_runs_in_the_language_model_not_in_bert():
  cfg = tiny(num_layers=2, nope_layer_interval=0, alternate_scheme={"name": "cope"},
             alternate_scheme_interval=2)
  build_model(cfg, "lm")
  with pytest.raises(ModelConfigError) as e:
    build_model(cfg, "mlm")
  assert str(e.value).startswith("model.alternate_scheme: got 'cope' in the BERT encoder")


def test_bert_with_an_alternate_scheme_runs_under_nnx():
  """``to_nnx`` carries ``alternate_position`` and gives linen's outputs on its parameters."""
  cfg = alternating(num_layers=2, alternate_scheme_interval=2)
  encoder = to_nnx(BertEncoder(cfg), IDS, rngs=nnx.Rngs(0))
  params = nnx.to_pure_dict(nnx.state(encoder, nnx.Param))
  assert "alternate_position" in params
  jax.tree.map(np.testing.assert_array_equal, encoder(IDS),
               BertEncoder(cfg).apply({"params": params}, IDS))


@pytest.mark.parametrize("head", ["mlm", "lm", "translation"])
def test_flops_charge_each_layer_its_own_scheme(head):
  """Over 2 layers with Shaw's terms (query-offset products) on one and none on the other,
  the training FLOPs are the mean of the all-Shaw and the all-none models' (the same
  layers, input work and head either way)."""
  fields = {"nope_layer_interval": 0, "num_layers": 2, "num_decoder_layers": 0}
  if head == "translation":
    fields["num_decoder_layers"] = 2
  shaw, none = {"name": "shaw", "clip": 3}, {"name": "none"}
  flops = {name: train_flops_per_step(tiny(**(fields | config)), 2, 6, head=head)
           for name, config in (
               ("shaw", {"scheme": shaw}), ("none", {"scheme": none}),
               ("mixed", {"scheme": shaw, "alternate_scheme": none,
                          "alternate_scheme_interval": 2}),
               ("nope", {"scheme": shaw, "nope_layer_interval": 2}))}
  assert flops["shaw"] > flops["none"]
  assert flops["mixed"] == flops["nope"] == (flops["shaw"] + flops["none"]) // 2


def test_an_alternate_absolute_table_bounds_the_training_length():
  """DIET-ABS (a table of max_len positions) as the alternate: seq_len past max_len is
  refused when the train config is validated, naming it, as for model.scheme."""
  train = base_train_config()
  train.model = tiny(nope_layer_interval=0, alternate_scheme={"name": "diet_abs", "rank": 4},
                     alternate_scheme_interval=2).to_dict()
  train.seq_len, train.optimizer.warmup_steps = 17, 10
  with pytest.raises(TrainConfigError) as e:
    validate_train_config(train)
  assert str(e.value).startswith("seq_len: 17 exceeds model.max_len=16, the length scheme "
                                 "'diet_abs' covers")
