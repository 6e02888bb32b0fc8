"""BERT encoder and heads: closed-form parameter counts, DIET Table 6, masking, heads, errors."""

import json
import math
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import erf

from posenc_jax.models import (BertEncoder, BertForMaskedLM, BertForQuestionAnswering,
                               BertForSequenceClassification, ModelConfigError, model_config)
from posenc_jax.models.build import abstract_params, build_model
from posenc_jax.models.layers import FeedForward
from posenc_jax.params import breakdown, count, diet6_rows
from posenc_jax.presets import SCHEME_PRESETS, preset_config
from posenc_jax.schemes import SCHEMES

TINY = dict(vocab_size=50, d_model=32, num_layers=2, num_heads=4, mlp_dim=48, max_len=16)


def closed_form(v, d, n, h, f, max_len, *, position=0, segment=0, pooler=True, mlm=True):
  """BERT parameters: embeddings + LayerNorm, N layers, pooler, MLM head (tied decoder)."""
  per_layer = 4 * (d * d + d) + (d * f + f) + (f * d + d) + 2 * 2 * d
  total = v * d + position + segment + 2 * d + n * per_layer
  total += (d * d + d) if pooler else 0
  total += (d * d + d + 2 * d + v) if mlm else 0
  return total


def n_params(model_cfg, head="mlm", **kw):
  return count(abstract_params(build_model(model_cfg, head, **kw)))


@pytest.mark.parametrize("scheme,segment,expected_position,expected_segment", [
    ({"name": "learned_ape"}, {"name": "segment_input"}, 16 * 32, 2 * 32),
    ({"name": "none"}, None, 0, 0),
    ({"name": "sinusoidal_ape"}, {"name": "segment_input"}, 0, 2 * 32),
    ({"name": "sinusoidal_ape", "learnable": True}, None, 16, 0),
    ({"name": "diet_rel"}, None, 2 * 4 * 31, 0),                       # layers x heads x (2L-1)
    ({"name": "diet_rel", "sharing": "layer"}, None, 4 * 31, 0),
    ({"name": "diet_rel", "sharing": "head", "clip": 3}, None, 2 * 7, 0),
    ({"name": "diet_abs", "rank": 5}, None, 2 * 2 * 16 * 4 * 5, 0),      # P_Q, P_K per layer/head
    ({"name": "diet_abs", "rank": 5, "sharing": "layer"}, None, 2 * 16 * 4 * 5, 0),
    ({"name": "t5"}, None, 4 * 32, 0),                                  # shared by layers
    ({"name": "shaw", "clip": 3}, None, 2 * 7 * 8, 0),                  # per layer, [2t+1, D]
    ({"name": "shaw", "clip": 3, "value": True}, None, 2 * 2 * 7 * 8, 0),
    ({"name": "alibi"}, {"name": "segment_per_head"}, 0, 2 * 4 * 2 * 2),
    ({"name": "rope"}, {"name": "segment_per_head", "sharing": "layer"}, 0, 4 * 2 * 2),
    # TUPE-A: table [L, d], LN(2d), U_Q, U_K with bias (d x d + d each), two [CLS] vectors.
    ({"name": "tupe_a"}, None, 16 * 32 + 2 * 32 + 2 * (32 * 32 + 32) + 2 * 32, 0),
    ({"name": "tupe_r"}, None, 16 * 32 + 2 * 32 + 2 * (32 * 32 + 32) + 2 * 32 + 4 * 32, 0),
])
def test_parameter_counts_match_closed_form(scheme, segment, expected_position, expected_segment):
  cfg = model_config(TINY, scheme=scheme, segment=segment)
  expected = closed_form(50, 32, 2, 4, 48, 16, position=expected_position,
                         segment=expected_segment)
  assert n_params(cfg) == expected


def test_counts_of_heads_and_options():
  base = dict(TINY, segment=None)
  enc = closed_form(50, 32, 2, 4, 48, 16, position=16 * 32, mlm=False)
  assert n_params(model_config(base), "encoder") == enc
  assert n_params(model_config(base, pooler=False), "encoder") == enc - (32 * 32 + 32)
  assert n_params(model_config(base), "classification", num_labels=3) == enc + 32 * 3 + 3
  assert n_params(model_config(base), "span") == enc + 32 * 2 + 2
  # Pre-LN moves the embedding LayerNorm to a final LayerNorm: same count.
  assert n_params(model_config(base, pre_ln=True)) == n_params(model_config(base))


def test_bert_base_breakdown():
  params = abstract_params(build_model(model_config(), "mlm"))
  modules = breakdown(params)
  assert modules["bert/token_embed"] == 30522 * 768
  assert modules["bert/position"] == 512 * 768
  assert modules["bert/layers_*"] == 12 * 7087872
  assert count(params) == 110_104_890  # RESULTS.md section 1


def test_diet_table6_rows_match_the_paper():
  rows = {row["preset"]: row for row in diet6_rows()}
  for preset in ("bert", "diet_rel", "diet_rel_share", "diet_abs", "diet_abs_share"):
    for column in ("english", "multilingual"):
      cell = rows[preset][column]
      assert cell["matches"], (preset, column, cell)
  assert rows["bert"]["multilingual"]["ours"] == 178_913_472
  assert rows["diet_abs_share"]["english"]["ours"] == 111_284_538


def test_params_cli_prints_json_and_table():
  out = subprocess.run([sys.executable, "-m", "posenc_jax.params",
                        "--config=configs/model.py:bert_tiny,diet_rel_share",
                        "--config.model.num_layers=3"], capture_output=True, text=True, check=True)
  result = json.loads(out.stdout)
  assert result["modules"]["bert/position"] == 2 * (2 * 128 - 1)  # heads x (2 L_max - 1)
  assert result["total"] == sum(result["modules"].values())
  table = subprocess.run([sys.executable, "-m", "posenc_jax.params", "--table", "diet6"],
                         capture_output=True, text=True, check=True).stdout
  assert table.count("match") >= 5 and "MISMATCH" not in table
  bad = subprocess.run([sys.executable, "-m", "posenc_jax.params",
                        "--config=configs/model.py:bert_tiny,diet_rell"],
                       capture_output=True, text=True)
  assert bad.returncode != 0 and "'diet_rell' is unknown" in bad.stderr


# Every scheme preset except Linformer's (its keys are projected: tested separately) and the
# causal-only schemes', which the encoder refuses.
MASKABLE = sorted(n for n, p in SCHEME_PRESETS.items()
                  if "scheme" in p and p.get("attention") != "linformer"
                  and not SCHEMES[p["scheme"]["name"]].module.causal_only)


@pytest.mark.parametrize("preset", MASKABLE)
def test_padding_does_not_change_unpadded_outputs(preset):
  """A padded batch row equals the same tokens run alone, unpadded; pad ids don't matter."""
  cfg = preset_config(f"bert_tiny,{preset}").model
  cfg = model_config(cfg, vocab_size=50, d_model=32, num_heads=4, mlp_dim=48, max_len=16)
  model = BertEncoder(cfg)
  ids = jax.random.randint(jax.random.key(0), (2, 12), 1, 50)
  segments = (jnp.arange(12) >= 5).astype(jnp.int32)[None].repeat(2, 0)
  mask = jnp.arange(12)[None] < jnp.array([[12], [7]])
  variables = jax.jit(model.init)(jax.random.key(1), ids, segments, mask)
  apply = jax.jit(model.apply)
  hidden, pooled = apply(variables, ids, segments, mask)
  other_pads = ids.at[1, 7:].set(3)
  hidden2, _ = apply(variables, other_pads, segments, mask)
  np.testing.assert_allclose(hidden2[1, :7], hidden[1, :7], atol=1e-5)
  alone, alone_pooled = apply(variables, ids[1:, :7], segments[1:, :7])
  np.testing.assert_allclose(hidden[1, :7], alone[0], atol=1e-5)
  np.testing.assert_allclose(pooled[1], alone_pooled[0], atol=1e-5)
  assert np.abs(np.asarray(hidden[0] - hidden[1])).max() > 1e-3  # rows really differ


def test_positions_matter_and_no_position_is_a_bag_of_words():
  ids = jnp.array([[5, 6, 7, 8]])
  perm = jnp.array([[5, 8, 7, 6]])
  for scheme, invariant in (({"name": "none"}, True), ({"name": "diet_rel"}, False)):
    model = BertEncoder(model_config(TINY, scheme=scheme, segment=None))
    variables = model.init(jax.random.key(0), ids)
    a, _ = model.apply(variables, ids)
    b, _ = model.apply(variables, perm)
    same = np.allclose(a[0, 1], b[0, 1], atol=1e-5)  # token 6 at position 1 vs 3
    swapped = np.allclose(a[0, 1], b[0, 3], atol=1e-5)
    assert swapped == invariant and not same


def test_exact_gelu_feed_forward():
  cfg = model_config(TINY)
  ffn = FeedForward(cfg)
  x = jax.random.normal(jax.random.key(0), (1, 3, 32))
  variables = ffn.init(jax.random.key(1), x)
  p = nn.unbox(variables["params"])
  h = np.asarray(x, np.float64) @ np.asarray(p["wi"]["kernel"], np.float64) + np.asarray(
      p["wi"]["bias"])
  h = 0.5 * h * (1 + erf(h / math.sqrt(2)))
  expected = h @ np.asarray(p["wo"]["kernel"], np.float64) + np.asarray(p["wo"]["bias"])
  np.testing.assert_allclose(ffn.apply(variables, x), expected, rtol=1e-5, atol=1e-5)


def test_mlm_decoder_is_tied_to_the_word_embeddings():
  model = BertForMaskedLM(model_config(TINY))
  ids = jnp.array([[1, 2, 3, 4]])
  variables = model.init(jax.random.key(0), ids)
  assert "decoder" not in variables["params"]["mlm"]
  grads = jax.grad(lambda v: model.apply(v, ids)[0, 0, 7])(variables)
  # Logit 7 reaches the embedding row 7, which token ids 1..4 never read.
  assert np.abs(np.asarray(nn.unbox(grads["params"]["bert"]["token_embed"]["embedding"])[7])
                ).max() > 0
  positions = jnp.array([[1, 3]])
  picked = model.apply(variables, ids, masked_positions=positions)
  full = model.apply(variables, ids)
  np.testing.assert_allclose(picked[0], full[0, jnp.array([1, 3])], rtol=1e-6)


def test_heads_shapes_and_span_padding():
  ids = jnp.array([[1, 2, 3, 4, 0], [1, 5, 6, 0, 0]])
  mask = ids != 0
  cfg = model_config(TINY)
  for model, check in (
      (BertForSequenceClassification(cfg, num_labels=3), lambda y: y.shape == (2, 3)),
      (BertForSequenceClassification(cfg, num_labels=1), lambda y: y.shape == (2,)),
  ):
    v = model.init(jax.random.key(0), ids, None, mask)
    assert check(model.apply(v, ids, None, mask))
  qa = BertForQuestionAnswering(cfg)
  v = qa.init(jax.random.key(0), ids, None, mask)
  start, end = qa.apply(v, ids, None, mask)
  assert start.shape == end.shape == (2, 5)
  assert np.all(np.asarray(jax.nn.softmax(start)[~np.asarray(mask)]) == 0)


def test_dropout_only_when_not_deterministic():
  model = BertForMaskedLM(model_config(TINY, dropout_rate=0.5, attention_dropout_rate=0.5))
  ids = jnp.array([[1, 2, 3, 4]])
  v = model.init(jax.random.key(0), ids)
  np.testing.assert_array_equal(model.apply(v, ids), model.apply(v, ids))
  a = model.apply(v, ids, deterministic=False, rngs={"dropout": jax.random.key(1)})
  b = model.apply(v, ids, deterministic=False, rngs={"dropout": jax.random.key(2)})
  assert np.abs(np.asarray(a - b)).max() > 1e-3


def test_bfloat16_compute_keeps_float32_params():
  cfg32 = model_config(TINY, scheme={"name": "diet_abs", "rank": 4})
  model16 = BertForMaskedLM(cfg32.replace(dtype="bfloat16"))
  model32 = BertForMaskedLM(cfg32)
  ids = jnp.array([[1, 2, 3, 4, 5]])
  v = model32.init(jax.random.key(0), ids)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nn.unbox(v)))
  out16 = model16.apply(v, ids)
  out32 = model32.apply(v, ids)
  assert out16.dtype == jnp.float32  # logits in float32
  # bf16 keeps 8 significant bits: each rounding is off by up to 2^-9 relative, a short chain
  # of them about 2^-8. Through 2 layers and the MLM head the measured worst error is 1.2-1.5
  # x 2^-8 of the largest logit (0.0019-0.0023 at max |logit| 0.32-0.44, init seeds 0-3), so
  # the bound is 4 x 2^-8 of it (about 0.007 here). Below 2^-16 the model did not run in bf16
  # (float32 alone differs by reordering, about 1e-7).
  largest = float(np.abs(out32).max())
  error = float(np.abs(out16 - out32).max())
  assert 2 ** -16 * largest < error < 4 * 2 ** -8 * largest, (error, largest)


@pytest.mark.parametrize("overrides,field", [
    (dict(num_heads=5), "model.num_heads"),
    (dict(dtype="float16"), "model.dtype"),
    (dict(scheme={"name": "diet_abz"}), "model.scheme"),
    (dict(scheme={"name": "diet_abs", "rank": 0}), "model.scheme"),
    (dict(activation="swish"), "model.activation"),
    (dict(dropout_rate=1.5), "model.dropout_rate"),
    (dict(d_modle=4), "model.d_modle"),
])
def test_bad_model_config_is_one_line_naming_the_field(overrides, field):
  with pytest.raises(ModelConfigError) as e:
    model_config(TINY, **overrides)
  assert str(e.value).startswith(field) and "\n" not in str(e.value)


def test_bad_preset_and_pooler():
  with pytest.raises(ModelConfigError, match="'bert_huge' is not a model size"):
    preset_config("bert_huge,bert")
  with pytest.raises(ModelConfigError, match="model.pooler"):
    BertForSequenceClassification(model_config(TINY, pooler=False)).init(
        jax.random.key(0), jnp.ones((1, 4), jnp.int32))
  with pytest.raises(ModelConfigError, match="head: got 'mlmm'; did you mean 'mlm'"):
    build_model(model_config(TINY), "mlmm")


def _shapes_and_dtypes(tree):
  return jax.tree.structure(tree), [(x.shape, x.dtype) for x in jax.tree.leaves(tree)]


def _mlm_loss(cfg, params=None):
  """(loss, params): ``params`` initialised unless given, and then checked to be this model's
  tree (structure, shapes, dtypes) by an abstract init."""
  model = BertForMaskedLM(cfg)
  ids = jax.random.randint(jax.random.key(0), (2, 13), 6, 50)
  mask = jnp.ones_like(ids).at[1, 9:].set(0)
  if params is None:
    params = model.init(jax.random.key(1), ids, jnp.zeros_like(ids), mask)["params"]
  else:
    shapes = jax.eval_shape(model.init, jax.random.key(1), ids, jnp.zeros_like(ids), mask)
    assert _shapes_and_dtypes(shapes["params"]) == _shapes_and_dtypes(params)

  def loss(p):
    logits = model.apply({"params": p}, ids, jnp.zeros_like(ids), mask)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 7])

  return loss, params


@pytest.mark.parametrize("scheme", [{"name": "diet_rel"}, {"name": "t5"}, {"name": "tupe_r"},
                                    {"name": "alibi"}, {"name": "diet_abs", "rank": 4}])
def test_fused_route_trains_like_the_reference(scheme):
  """Whole model, loss and every parameter gradient: fused (Pallas, interpret) vs reference."""
  grads, params = {}, None
  for route in ("reference", "fused"):  # one initialisation (the same key), both routes' trees
    loss, params = _mlm_loss(model_config(TINY, scheme=scheme, route=route), params)
    grads[route] = jax.value_and_grad(loss)(params)
  (ref_loss, ref), (fused_loss, fused) = grads["reference"], grads["fused"]
  np.testing.assert_allclose(fused_loss, ref_loss, rtol=1e-5)
  for path, g in jax.tree_util.tree_leaves_with_path(ref):
    got = dict(jax.tree_util.tree_leaves_with_path(fused))[path]
    np.testing.assert_allclose(got, g, rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(g).max())),
                               err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("scheme", ["diet_rel", "t5", "diet_abs"])
def test_fused_training_step_holds_no_length_squared_array(scheme):
  """Long sequences: the fused route's whole training step (forward and backward) has no
  array with two length axes (positional or content), which the reference route has."""
  length = 1024
  cfg = dict(TINY, max_len=length)

  def arrays_with_two_length_axes(route):
    model = BertForMaskedLM(model_config(cfg, scheme={"name": scheme}, route=route))
    ids = jnp.ones((1, length), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), ids, ids, ids)["params"]
    loss = lambda p: jnp.mean(model.apply({"params": p}, ids, ids, ids))  # noqa: E731
    jaxpr = jax.make_jaxpr(jax.grad(loss))(params).jaxpr
    return [s for s in _shapes(jaxpr) if list(s).count(length) >= 2]

  assert arrays_with_two_length_axes("fused") == []
  assert arrays_with_two_length_axes("reference")  # control


def _shapes(jaxpr):
  for eqn in jaxpr.eqns:
    yield from (tuple(getattr(v.aval, "shape", ())) for v in eqn.outvars)
    for param in eqn.params.values():
      inner = getattr(param, "jaxpr", param)
      if hasattr(inner, "eqns"):
        yield from _shapes(inner)


@pytest.mark.parametrize("preset, policies", [("bert_tiny,diet_rel", ("full",)),
                                              ("transformer_base,t5", ("dots", "full"))])
def test_remat_policies_keep_parameters_values_and_gradients(preset, policies):
  """``model.remat`` ``dots`` and ``full`` recompute in the backward pass: the same parameter
  tree (checkpoints interchange), loss and gradients (dropout on) as ``none``."""
  results, params = {}, None
  for remat in ("none", *policies):
    cfg = preset_config(preset).model
    cfg.update(dict(vocab_size=50, d_model=32, num_heads=4, mlp_dim=64, max_len=16,
                    num_layers=2, remat=remat))
    translation = preset.startswith("transformer")
    if translation:
      cfg.num_decoder_layers = 1
    model = build_model(cfg, "translation" if translation else "mlm")
    ids = jnp.asarray(np.random.default_rng(0).integers(3, 50, (2, 16)), jnp.int32)
    args = (ids, ids, ids > 0) if translation else (ids,)
    # Each policy's tree (structure, shapes, dtypes) from an abstract init (0.4 s against an
    # eager init's 4-9 s); the values are initialised once, from ``none``'s model.
    shapes = jax.eval_shape(model.init, jax.random.key(0), *args)["params"]
    if params is None:
      params = model.init(jax.random.key(0), *args)["params"]

    def loss(p, model=model, args=args):
      out = model.apply({"params": p}, *args, deterministic=False,
                        rngs={"dropout": jax.random.key(1)})
      return jnp.sum(jnp.sin(out))
    results[remat] = (jax.tree.structure(shapes), jax.tree.leaves(shapes),
                      *jax.jit(jax.value_and_grad(loss))(params))
  tree, leaves, value, grads = results["none"]
  assert tree == jax.tree.structure(params)
  for remat in policies:
    other_tree, other_leaves, other_value, other_grads = results[remat]
    assert other_tree == tree and other_leaves == leaves
    np.testing.assert_allclose(other_value, value, rtol=1e-5)
    # As one vector: a leaf whose gradient is ~0 (1e-11) would measure only rounding.
    flat, other = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])
                   for g in (grads, other_grads))
    np.testing.assert_allclose(other, flat, rtol=0, atol=1e-5 * np.abs(flat).max())
