"""Per-token position ids ``[B, L]`` (packed sequences) for every scheme.

Without ids every scheme's terms are the batch-free ones of positions ``0..L-1``; with
``position_ids = arange(L)`` in every row they are the same values (both routes). A packed
row (two sequences, ids restarting at the second, ``packed_segment_ids`` 1 and 2) encodes
each sequence as it encodes alone. Relative terms depend on id differences only; absolute
tables are read at the ids (float64 references); the backward pass with ids holds no
scatter; bad ids are one-line errors.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import posenc_jax as pe
from posenc_jax.models import BertEncoder, CausalLM, model_config
from posenc_jax.schemes.base import SchemeConfigError
from tests.conftest import DIMS, SCHEME_CONFIGS, random_params

B, L = 2, 10
VOCAB = 20
SEGMENT_SCHEMES = {"segment_input", "segment_per_head"}
# Schemes whose logits depend on positions only through j - i (RoPE: up to rounding).
RELATIVE = {"shaw", "shaw_value", "sinusoidal_rpe", "sinusoidal_rpe_learnable", "t5",
            "t5_causal_per_layer", "diet_rel", "diet_rel_clip_head", "alibi", "alibi_causal",
            "rope"}
CAUSAL = {"t5_causal_per_layer", "alibi_causal"}


def qkv(batch=B, length=L):
  keys = jax.random.split(jax.random.key(1), 3)
  return [jax.random.normal(key, (batch, length, DIMS["num_heads"], DIMS["head_dim"]))
          for key in keys]


def scheme_terms(name, position_ids, length=L, batch=B):
  """The scheme's terms (random N(0, 1) parameters) at ``position_ids`` (None: none)."""
  scheme = pe.build_scheme(SCHEME_CONFIGS[name], **DIMS)
  segments = jnp.zeros((batch, length), jnp.int32).at[:, length // 2:].set(1)
  variables = random_params(scheme.init(jax.random.key(0), length, segments))
  return scheme.apply(variables, length, segments, position_ids)


def attention(terms, route, layer=1, causal=False):
  q, k, v = qkv()
  return pe.attend(q, k, v, terms.for_layer(layer), scale=terms.content_scale, route=route,
                   causal=causal)


def routes(terms):
  """Both routes, less the fused one where it would interpret the Pallas kernel on CPU
  (Toeplitz terms without ids; test_attention.py covers that kernel)."""
  fused = all(t.fusable and not isinstance(t, pe.terms.Toeplitz) for t in terms.for_layer(0))
  return ["reference"] + (["fused"] if fused else [])


@pytest.mark.parametrize("name", sorted(SCHEME_CONFIGS))
def test_arange_ids_equal_no_ids(name):
  """``position_ids = arange(L)`` in every row gives the terms of no ids, on both routes."""
  plain = scheme_terms(name, None)
  ids = scheme_terms(name, jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L)))
  x = jnp.zeros((B, L, DIMS["d_model"]))
  np.testing.assert_array_equal(plain.embed(x), ids.embed(x))
  for route in routes(plain):
    np.testing.assert_allclose(attention(ids, route), attention(plain, route), atol=1e-6,
                               err_msg=route)


@pytest.mark.parametrize("name", sorted(RELATIVE))
def test_relative_terms_depend_on_id_differences_only(name):
  """Shifting every id by a constant (a different one per row) changes no output."""
  shifted = jnp.arange(L, dtype=jnp.int32)[None] + jnp.array([[3], [5]], jnp.int32)
  plain, moved = scheme_terms(name, None), scheme_terms(name, shifted)
  causal = name in CAUSAL
  for route in routes(plain):
    np.testing.assert_allclose(attention(moved, route, causal=causal),
                               attention(plain, route, causal=causal), atol=2e-6,
                               err_msg=route)


def test_absolute_tables_are_read_at_the_ids():
  """Learned APE and DIET-ABS read their tables' rows at the ids (float64 references)."""
  ids = jnp.array([[0, 1, 2, 3, 0, 1, 2, 3, 4, 15], [7, 7, 0, 9, 2, 11, 3, 4, 5, 6]],
                  jnp.int32)
  scheme = pe.build_scheme(SCHEME_CONFIGS["learned_ape"], **DIMS)
  variables = nn.unbox(random_params(scheme.init(jax.random.key(0), L)))
  table = np.asarray(variables["params"]["position_embedding"], np.float64)
  np.testing.assert_allclose(scheme.apply(variables, L, None, ids).embedding.value,
                             table[np.asarray(ids)], rtol=1e-6)

  scheme = pe.build_scheme(SCHEME_CONFIGS["diet_abs"], **DIMS)
  variables = nn.unbox(random_params(scheme.init(jax.random.key(0), L)))
  p_q, p_k = (np.asarray(variables["params"][n], np.float64) for n in ("p_query", "p_key"))
  term = scheme.apply(variables, L, None, ids).for_layer(1)[0]
  rows = np.asarray(ids)
  expected = np.einsum("bihr,bjhr->bhij", p_q[1][rows], p_k[1][rows])  # [B, H, L, L]
  np.testing.assert_allclose(term.materialise().value, expected, rtol=1e-5, atol=1e-6)


def encoder_config(name, route="reference"):
  cfg = SCHEME_CONFIGS[name]
  scheme, segment = ({"name": "none"}, cfg) if name in SEGMENT_SCHEMES else (cfg, None)
  return model_config(vocab_size=VOCAB, d_model=DIMS["d_model"], num_layers=1,
                      num_heads=DIMS["num_heads"], mlp_dim=32, max_len=DIMS["max_len"],
                      scheme=scheme, segment=segment, dtype="float32", route=route)


# Two sequences of 6 and 4 tokens, and the row packing them.
FIRST = jnp.array([[2, 5, 7, 3, 9, 4]], jnp.int32)
SECOND = jnp.array([[2, 8, 6, 11]], jnp.int32)
PACKED = jnp.concatenate([FIRST, SECOND], axis=1)
PACKED_POSITIONS = jnp.array([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3]], jnp.int32)
PACKED_SEGMENTS = jnp.array([[1, 1, 1, 1, 1, 1, 2, 2, 2, 2]], jnp.int32)


def packed_and_alone(model, params, apply):
  packed = apply(params, PACKED, position_ids=PACKED_POSITIONS,
                 packed_segment_ids=PACKED_SEGMENTS)
  return packed, jnp.concatenate([apply(params, FIRST), apply(params, SECOND)], axis=1)


def attend_alone_and_packed(name, route):
  """One layer's attention output (plus input embedding) on the packed row, and on each
  sequence alone concatenated."""
  outputs = []
  for start, ids, positions, segments in ((0, PACKED, PACKED_POSITIONS, PACKED_SEGMENTS),
                                          (0, FIRST, None, None), (6, SECOND, None, None)):
    length = ids.shape[1]
    q, k, v = (x[:1, start:start + length] for x in qkv())
    terms = scheme_terms(name, positions, length=length, batch=1)
    out = pe.attend(q, k, v, terms.for_layer(1), scale=terms.content_scale, route=route,
                    segment_ids=segments, causal=name in CAUSAL)
    outputs.append((out, terms.embed(jnp.zeros((1, length, DIMS["d_model"])))))
  (packed, packed_x), *alone = outputs
  return packed, packed_x, jnp.concatenate([o for o, _ in alone], 1), jnp.concatenate(
      [x for _, x in alone], 1)


@pytest.mark.parametrize("name", sorted(SCHEME_CONFIGS))
def test_packed_attention_equals_each_sequence_alone(name):
  """Terms at restarting ids with packed segments give, at each sequence's tokens, the
  attention output and input embedding of that sequence alone (reference route)."""
  if name in SEGMENT_SCHEMES:
    pytest.skip("segment schemes read token types, not positions (same terms either way)")
  packed, packed_x, alone, alone_x = attend_alone_and_packed(name, "reference")
  np.testing.assert_allclose(packed, alone, atol=1e-5)
  np.testing.assert_allclose(packed_x, alone_x, atol=1e-6)


@pytest.mark.parametrize("name", ["diet_abs", "tupe_r", "rope", "bert_ad", "diet_rel"])
def test_packed_attention_on_the_fused_route(name):
  packed, _, alone, _ = attend_alone_and_packed(name, "fused")
  np.testing.assert_allclose(packed, alone, atol=1e-5)


@pytest.mark.parametrize("name", ["tupe_r", "segment_per_head", "shaw_value"])
def test_packed_row_encodes_each_sequence_as_alone(name):
  """BertEncoder on a packed row equals it on each sequence alone, at that sequence's tokens."""
  model = BertEncoder(encoder_config(name))
  params = random_params(model.init(jax.random.key(0), PACKED), seed=1)
  hidden = jax.jit(lambda p, i, **kw: model.apply(p, i, **kw)[0])
  packed, alone = packed_and_alone(model, params, hidden)
  np.testing.assert_allclose(packed, alone, atol=1e-5)


@pytest.mark.parametrize("name", ["alibi_causal", "learned_ape"])
def test_packed_causal_lm_predicts_each_document_as_alone(name):
  cfg = model_config(vocab_size=VOCAB, d_model=DIMS["d_model"], num_layers=2,
                     num_heads=DIMS["num_heads"], mlp_dim=32, max_len=DIMS["max_len"],
                     scheme=SCHEME_CONFIGS[name], segment=None, pooler=False, dtype="float32")
  model = CausalLM(cfg)
  params = random_params(model.init(jax.random.key(0), PACKED), seed=1)
  packed, alone = packed_and_alone(model, params, jax.jit(model.apply))
  np.testing.assert_allclose(packed, alone, rtol=1e-5, atol=1e-4)  # logits ~ 10


def scatters_and_gradient(name):
  """The lowered backward pass of a scheme's attention with ids, and its gradient."""
  scheme = pe.build_scheme(SCHEME_CONFIGS[name], **DIMS)
  variables = scheme.init(jax.random.key(0), L)
  ids = PACKED_POSITIONS.repeat(B, axis=0)
  q, k, v = qkv()

  def loss(variables, q):
    terms = scheme.apply(variables, L, None, ids)
    embedded = terms.embed(jnp.zeros((B, L, DIMS["d_model"])))
    attended = pe.attend(q, k, v, terms.for_layer(0), scale=terms.content_scale,
                         segment_ids=PACKED_SEGMENTS.repeat(B, axis=0), route="reference")
    return jnp.sum(embedded ** 2) + jnp.sum(attended ** 2)

  grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
  text = grad.lower(variables, q).as_text()
  return text.count("stablehlo.scatter") + text.count("stablehlo.gather"), grad(variables, q)


@pytest.mark.parametrize("name", ["diet_abs", "tupe_r", "shaw_value", "rope", "learned_ape"])
def test_backward_with_ids_is_finite_and_scatter_free(name):
  count, grads = scatters_and_gradient(name)
  assert count == 0
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
  assert all(bool(jnp.any(g != 0)) for g in jax.tree.leaves(grads[0]))  # RoPE: none


@pytest.mark.parametrize("ids, message", [
    (jnp.zeros((B, L - 1), jnp.int32), r"position_ids has shape \(2, 9\); expected \[B, L\]"),
    (jnp.zeros((B, L), jnp.float32), "position_ids has dtype float32; expected integer"),
    (jnp.full((B, L), 16, jnp.int32), r"position_ids must lie in \[0, 16\), got \[16, 16\]"),
    (jnp.full((B, L), -1, jnp.int32), r"position_ids must lie in \[0, 16\)"),
])
def test_scheme_rejects_bad_position_ids_in_one_line(ids, message):
  scheme = pe.build_scheme({"name": "diet_abs"}, **DIMS)
  variables = scheme.init(jax.random.key(0), L)
  with pytest.raises(SchemeConfigError, match=message) as error:
    scheme.apply(variables, L, None, ids)
  assert "\n" not in str(error.value)


@pytest.mark.parametrize("field, value, message", [
    ("position_ids", jnp.zeros((1, 9), jnp.int32),
     r"BertEncoder: position_ids: got shape \(1, 9\); expected \[B, L\] = \(1, 10\)"),
    ("position_ids", jnp.zeros((1, 10), jnp.float32),
     "BertEncoder: position_ids: got dtype float32; expected"),
    ("packed_segment_ids", jnp.zeros((2, 10), jnp.int32),
     r"BertEncoder: packed_segment_ids: got shape \(2, 10\)"),
    ("packed_segment_ids", jnp.ones((1, 10), jnp.float32),
     "BertEncoder: packed_segment_ids: got dtype float32; expected"),
])
def test_models_reject_bad_ids_in_one_line(field, value, message):
  model = BertEncoder(encoder_config("learned_ape"))
  with pytest.raises(ValueError, match=message) as error:
    model.init(jax.random.key(0), PACKED, **{field: value})
  assert "\n" not in str(error.value)


def test_cached_decoding_takes_no_ids():
  cfg = model_config(vocab_size=VOCAB, d_model=DIMS["d_model"], num_layers=1,
                     num_heads=DIMS["num_heads"], mlp_dim=32, max_len=DIMS["max_len"],
                     scheme={"name": "rope"}, segment=None, pooler=False)
  model = CausalLM(cfg)
  with pytest.raises(ValueError, match="cached decoding counts positions by step"):
    model.init(jax.random.key(0), PACKED, method=model.decode, decode=True,
               position_ids=PACKED_POSITIONS)


def test_mlm_objective_passes_the_packing_features():
  """The MLM objective hands ``position_ids``/``packed_segment_ids`` to the model."""
  from posenc_jax.models import BertForMaskedLM
  from posenc_jax.training.objectives import mlm_objective
  model = BertForMaskedLM(encoder_config("learned_ape"))
  params = model.init(jax.random.key(0), PACKED)["params"]
  weights = jnp.zeros(PACKED.shape, jnp.float32).at[:, 7].set(1.0)
  batch = dict(input_ids=PACKED, segment_ids=jnp.zeros_like(PACKED), mask=PACKED > 0,
               mlm_targets=PACKED, mlm_weights=weights)
  packed = dict(batch, position_ids=PACKED_POSITIONS, packed_segment_ids=PACKED_SEGMENTS)
  loss, _ = mlm_objective(model, params, batch, None)
  packed_loss, _ = mlm_objective(model, params, packed, None)
  second = dict(input_ids=SECOND, segment_ids=jnp.zeros_like(SECOND), mask=SECOND > 0,
                mlm_targets=SECOND, mlm_weights=weights[:, 6:])
  alone_loss, _ = mlm_objective(model, params, second, None)
  np.testing.assert_allclose(packed_loss, alone_loss, rtol=1e-5)
  assert not np.isclose(loss, packed_loss)
