"""Linformer attention (Wang et al. 2020) and DIET-ABS-LIN (DIET eq. 4)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posenc_jax import Factored, MultiHeadAttention, SchemeConfigError, build_scheme
from posenc_jax.models import BertEncoder, BertForMaskedLM, ModelConfigError, model_config
from posenc_jax.models.linformer import LinformerProjection, LinformerSelfAttention

B, L, D_MODEL, HEADS, HEAD_DIM, MAX_LEN, K = 2, 10, 16, 2, 8, 12, 4
BASE = dict(vocab_size=50, d_model=D_MODEL, num_layers=2, num_heads=HEADS, mlp_dim=32,
            max_len=MAX_LEN, dropout_rate=0.0, attention_dropout_rate=0.0,
            attention="linformer", linformer_k=K)
TOL = dict(rtol=1e-4, atol=1e-5)


def key(seed):
  """A PRNG key whose random ops compile fast on CPU (threefry's dominate this file's time)."""
  return jax.random.key(seed, impl="unsafe_rbg")


def config(**changes):
  return model_config(BASE | changes)


def scaled_random(tree, seed=0, scale=0.3):
  """Every leaf replaced by ``scale * N(0, 1)`` (no zero biases, no trivial projections)."""
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(key(seed), len(leaves))
  return treedef.unflatten([scale * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])


def inputs(seed=1):
  x = jax.random.normal(key(seed), (B, L, D_MODEL))
  mask = jnp.arange(L)[None, :] < jnp.array([[L], [L - 3]])  # row 1: last 3 padded
  return x, mask


def init_layer(cfg, x, terms=()):
  layer = LinformerSelfAttention(cfg)
  params = nn.unbox(jax.jit(layer.init)(key(0), x, terms))["params"]
  return layer, scaled_random(params)


def numpy_linformer(p, x, mask, e, f, u=None, v=None, scale=None, compress_first=True):
  """float64 Linformer self-attention, written out: zero padding, E/F, projections, softmax.

  ``compress_first``: the reference's order (Linformer's released code), ``K' = (E X) W_K +
  b_K``; False: ``E (X W_K + b_K)``, which scales the bias by E's row sums.
  """
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
  x = np.asarray(x, np.float64)
  length = x.shape[1]
  keep = np.asarray(mask, bool)[:, :, None]

  def project(name, inputs):
    return np.einsum("bld,dhk->blhk", inputs, p[name]["kernel"]) + p[name]["bias"]

  def compressed(name, table):
    """Padded tokens take no part: zero rows of X, or of X W + b."""
    table = np.asarray(table, np.float64)[:, :length]
    if compress_first:
      return project(name, np.einsum("rj,bjd->brd", table, np.where(keep, x, 0.0)))
    return np.einsum("rj,bjhd->brhd", table, np.where(keep[..., None], project(name, x), 0.0))

  q = project("query", x)
  k_proj, v_proj = compressed("key", e), compressed("value", f)
  scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
  logits = np.einsum("bihd,brhd->bhir", q, k_proj) * scale  # [B, H, L, k]
  if u is not None:
    logits = logits + np.einsum("ihr,jhr->hij", np.asarray(u, np.float64),
                                np.asarray(v, np.float64))[None]
  logits = logits - logits.max(-1, keepdims=True)
  probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  out = np.einsum("bhir,brhd->bihd", probs, v_proj)
  return np.einsum("bihd,hde->bie", out, p["out"]["kernel"]) + p["out"]["bias"]


# (a) Linformer attention against a float64 reference, with padding.

@pytest.mark.parametrize("route", ["reference", "fused"])
@pytest.mark.parametrize("sharing", ["none", "kv"])
def test_linformer_matches_numpy_reference(route, sharing):
  cfg = config(route=route, linformer_sharing=sharing)
  x, mask = inputs()
  uv = jax.random.normal(key(5), (L, HEADS, 3)), jax.random.normal(key(6), (K, HEADS, 3))
  term = Factored(*uv)  # a DIET-ABS-LIN-shaped [L, k] term
  layer, params = init_layer(cfg, x, [term])
  assert params["E"].shape == (K, MAX_LEN)
  assert ("F" in params) == (sharing == "none")
  f = params["F"] if sharing == "none" else params["E"]
  got = layer.apply({"params": params}, x, [term], mask=mask, scale=0.4)
  want = numpy_linformer(params, x, mask, params["E"], f, *uv, scale=0.4)
  np.testing.assert_allclose(got, want, **TOL)


def test_biases_follow_the_reference_order():
  """Non-zero key/value biases: the layer is the reference's ``(E X) W_K + b_K``, far from
  ``E (X W_K + b_K)``; with zero key/value biases the two orders are the same model."""
  cfg = config()
  x, mask = inputs()
  layer, params = init_layer(cfg, x)
  e, f = params["E"], params["F"]
  got = layer.apply({"params": params}, x, mask=mask)
  np.testing.assert_allclose(got, numpy_linformer(params, x, mask, e, f), **TOL)
  other_order = numpy_linformer(params, x, mask, e, f, compress_first=False)
  assert np.abs(np.asarray(got) - other_order).max() > 0.1
  zero = params | {n: params[n] | {"bias": jnp.zeros_like(params[n]["bias"])}
                   for n in ("key", "value")}
  got = layer.apply({"params": zero}, x, mask=mask)
  np.testing.assert_allclose(got, numpy_linformer(zero, x, mask, e, f, compress_first=False),
                             **TOL)


def test_padded_tokens_do_not_change_unpadded_outputs():
  cfg = config()
  x, mask = inputs()
  layer, params = init_layer(cfg, x)
  noise = jax.random.normal(key(9), x.shape) * 5.0
  x_changed = jnp.where(mask[..., None], x, noise)  # new values at padded tokens only
  before = layer.apply({"params": params}, x, mask=mask)
  after = layer.apply({"params": params}, x_changed, mask=mask)
  np.testing.assert_allclose(after[0], before[0], **TOL)
  np.testing.assert_allclose(after[1, :L - 3], before[1, :L - 3], **TOL)
  # Without the mask the padded rows are projected like any other and the outputs move.
  unmasked = layer.apply({"params": params}, x_changed)
  assert not np.allclose(unmasked[1, :L - 3], before[1, :L - 3], atol=1e-3)


# (b) k = L with E = F = identity is full attention.

@pytest.mark.parametrize("sharing", ["none", "kv", "layer"])
def test_identity_projection_is_full_attention(sharing):
  cfg = config(linformer_k=L, linformer_sharing=sharing)
  x, _ = inputs()
  eye = jnp.eye(L, MAX_LEN)  # [k, L_max]; E[:, :L] = I_L
  shared = [LinformerProjection(eye[:, :L])] if sharing == "layer" else []
  term = Factored(jax.random.normal(key(3), (L, HEADS, 2)),
                  jax.random.normal(key(4), (L, HEADS, 2)))
  layer, params = init_layer(cfg, x, [term] + shared)
  params |= {name: eye for name in ("E", "F") if name in params}
  got = layer.apply({"params": params}, x, [term] + shared)
  full = MultiHeadAttention(HEADS, HEAD_DIM)
  qkvo = {n: params[n] for n in ("query", "key", "value", "out")}
  want = full.apply({"params": qkvo}, x, [term])
  np.testing.assert_allclose(got, want, **TOL)
  np.testing.assert_allclose(got, numpy_linformer(params, x, jnp.ones((B, L)), eye, eye,
                                                  term.u, term.v), **TOL)


def test_layer_sharing_needs_the_shared_projection():
  cfg = config(linformer_sharing="layer")
  x, _ = inputs()
  with pytest.raises(ValueError, match="linformer_sharing='layer' needs the encoder's shared E"):
    LinformerSelfAttention(cfg).init(key(0), x)
  with pytest.raises(ValueError, match="keeps E, F in each layer"):
    LinformerSelfAttention(config()).init(key(0), x,
                                          [LinformerProjection(jnp.ones((K, L)))])


# (c) DIET-ABS-LIN's term is P_Q[:L] P_K^T, [L, k] per head.

@pytest.mark.parametrize("sharing,layers,heads", [("none", 2, HEADS), ("layer", 1, HEADS),
                                                  ("head", 2, 1)])
def test_diet_abs_lin_term_is_pq_pk_transpose(sharing, layers, heads):
  scheme = build_scheme({"name": "diet_abs_lin", "rank": 3, "k": K, "sharing": sharing},
                        num_layers=2, num_heads=HEADS, head_dim=HEAD_DIM, d_model=D_MODEL,
                        max_len=MAX_LEN)
  params = scaled_random(nn.unbox(scheme.init(key(0), L)), scale=1.0)
  p_q, p_k = (np.asarray(params["params"][n], np.float64) for n in ("p_query", "p_key"))
  assert p_q.shape == (layers, MAX_LEN, heads, 3) and p_k.shape == (layers, K, heads, 3)
  st = jax.jit(scheme.apply, static_argnums=1)(params, L)
  assert st.embedding is None  # no input position table
  values = [np.asarray(st.for_layer(layer)[0].materialise().value) for layer in range(2)]
  for layer, value in enumerate(values):
    assert value.shape == (1, heads, L, K)
    pick = 0 if layers == 1 else layer
    for h in range(heads):
      np.testing.assert_allclose(value[0, h], p_q[pick, :L, h] @ p_k[pick, :, h].T, **TOL)
  assert np.allclose(values[0], values[1]) == (sharing == "layer")


def test_diet_abs_lin_fields_are_validated():
  with pytest.raises(SchemeConfigError, match="scheme 'diet_abs_lin': sharing must be one of"):
    build_scheme({"name": "diet_abs_lin", "sharing": "kv"}, num_layers=2, num_heads=2,
                 head_dim=8, d_model=16)
  with pytest.raises(SchemeConfigError, match="scheme 'diet_abs_lin': k must be a positive"):
    build_scheme({"name": "diet_abs_lin", "k": 0}, num_layers=2, num_heads=2, head_dim=8,
                 d_model=16)


# (d) Parameter counts against closed forms.

def param_shapes(cfg, model=BertEncoder):
  ids = jnp.zeros((B, L), jnp.int32)
  return jax.eval_shape(lambda rng: model(cfg).init(rng, ids), key(0))["params"]


def count(tree):
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def bert_count(cfg, position):
  """Closed-form BERT encoder parameters with ``position`` scheme parameters, no Linformer."""
  d, hd, f, n = cfg.d_model, cfg.num_heads * cfg.dim_per_head, cfg.mlp_dim, cfg.num_layers
  attention = 4 * d * hd + 3 * hd + d  # q, k, v, out kernels and biases
  layer = attention + 2 * d * f + f + d + 2 * 2 * d  # mlp, two LayerNorms
  embeddings = cfg.vocab_size * d + position + 2 * d + 2 * d  # tokens, position, segment, LN
  return embeddings + n * layer + d * d + d  # pooler


@pytest.mark.parametrize("sharing,tables", [("none", 2 * 2), ("kv", 2), ("layer", 1)])
def test_parameter_counts_per_linformer_sharing(sharing, tables):
  cfg = config(linformer_sharing=sharing)
  shapes = nn.unbox(param_shapes(cfg))
  assert count(shapes) == bert_count(cfg, MAX_LEN * D_MODEL) + tables * K * MAX_LEN
  full = nn.unbox(param_shapes(cfg.replace(attention="full")))
  assert count(shapes) - count(full) == tables * K * MAX_LEN
  projections = {"/".join(str(p.key) for p in path): x.shape
                 for path, x in jax.tree_util.tree_flatten_with_path(shapes)[0]
                 if path[-1].key in ("E", "F")}
  layers = (2, K, MAX_LEN)  # scanned: one table per layer on the leading axis
  expected = {"none": {"layers/attention/E": layers, "layers/attention/F": layers},
              "kv": {"layers/attention/E": layers},
              "layer": {"linformer/E": (K, MAX_LEN)}}[sharing]
  assert projections == expected


def test_projection_logical_axes():
  specs = nn.get_partition_spec(param_shapes(config(linformer_sharing="kv")))
  assert tuple(specs["layers"]["attention"]["E"]) == ("layers", "linformer_k", "abspos")
  specs = nn.get_partition_spec(param_shapes(config(linformer_sharing="layer")))
  assert tuple(specs["linformer"]["E"]) == ("linformer_k", "abspos")


@pytest.mark.parametrize("sharing,layers,heads", [("none", 2, HEADS), ("layer", 1, HEADS),
                                                  ("head", 2, 1)])
def test_diet_abs_lin_bert_parameter_count(sharing, layers, heads):
  cfg = config(scheme={"name": "diet_abs_lin", "rank": 3, "k": K, "sharing": sharing},
               linformer_sharing="layer")
  position = layers * heads * (MAX_LEN + K) * 3  # P_Q and P_K, no input table
  assert count(nn.unbox(param_shapes(cfg))) == bert_count(cfg, position) + K * MAX_LEN


def test_layer_sharing_equals_per_layer_tables_set_equal():
  """One shared E = F is the same model as per-layer E = F ('kv') holding that table."""
  x = jax.random.randint(key(2), (B, L), 0, 50)
  _, mask = inputs()
  shared_cfg = config(linformer_sharing="layer")

  @jax.jit
  def both(rng):
    shared = scaled_random(nn.unbox(BertEncoder(shared_cfg).init(rng, x)))
    per_layer = {k: v for k, v in shared["params"].items() if k != "linformer"}
    e = jnp.broadcast_to(shared["params"]["linformer"]["E"], (2, K, MAX_LEN))  # both layers
    per_layer["layers"] = {**per_layer["layers"],
                           "attention": {**per_layer["layers"]["attention"], "E": e}}
    got = BertEncoder(shared_cfg).apply(shared, x, mask=mask)[0]
    want = BertEncoder(shared_cfg.replace(linformer_sharing="kv")).apply(
        {"params": per_layer}, x, mask=mask)[0]
    return got, want

  np.testing.assert_allclose(*both(key(0)), **TOL)


# (e) Config errors: one line naming the field.

@pytest.mark.parametrize("changes,message", [
    (dict(scheme={"name": "diet_rel"}), "model.scheme: 'diet_rel' has attention terms over the L "
                                        "key positions, which attention='linformer' projects"),
    (dict(scheme={"name": "rope"}), "model.scheme: 'rope' has attention terms"),
    (dict(scheme=[{"name": "learned_ape"}, {"name": "shaw"}]), "model.scheme: 'shaw'"),
    (dict(segment={"name": "segment_per_head"}), "model.segment: 'segment_per_head'"),
    (dict(scheme={"name": "diet_abs_lin", "k": 8}),
     r"model.scheme: diet_abs_lin k=8 must equal model.linformer_k=4"),
    (dict(scheme={"name": "diet_abs_lin"}),  # k's default, 128
     r"model.scheme: diet_abs_lin k=128 must equal model.linformer_k=4"),
    (dict(scheme={"name": "diet_abs_lin", "k": K}, attention="full"),
     "model.scheme: 'diet_abs_lin' needs attention='linformer'"),
    (dict(scheme={"name": "diet_abs_lin", "k": K}, num_decoder_layers=2),
     "model.scheme: 'diet_abs_lin' has no decoder form"),
    (dict(linformer_sharing="head"), "model.linformer_sharing: got 'head'"),
])
def test_config_errors_are_one_line_naming_the_field(changes, message):
  with pytest.raises(ModelConfigError, match=message) as info:
    config(**changes)
  assert "\n" not in str(info.value)


def test_allowed_linformer_configs():
  for scheme in ({"name": "learned_ape"}, {"name": "sinusoidal_ape"}, {"name": "none"},
                 {"name": "diet_abs_lin", "k": K, "sharing": "layer"}):
    assert config(scheme=scheme, segment={"name": "segment_input"}).attention == "linformer"


# (f) A masked LM with Linformer and DIET-ABS-LIN trains.

def test_masked_lm_with_diet_abs_lin_forward_and_backward():
  cfg = config(scheme={"name": "diet_abs_lin", "k": K}, linformer_sharing="layer",
               dropout_rate=0.1, attention_dropout_rate=0.1)
  model = BertForMaskedLM(cfg)
  ids = jax.random.randint(key(2), (B, L), 0, 50)
  _, mask = inputs()

  def loss(params):
    logits = model.apply({"params": params}, ids, mask=mask, deterministic=False,
                         rngs={"dropout": key(7)})
    return -jnp.mean(jax.nn.log_softmax(logits)[..., 0] * mask), logits.shape

  @jax.jit
  def init_and_grad(rng):  # one compilation for init, forward and backward
    params = model.init(rng, ids, mask=mask)["params"]
    return jax.value_and_grad(loss, has_aux=True)(params)

  (value, shape), grads = init_and_grad(key(0))
  assert shape == (B, L, 50)
  grads = nn.unbox(grads)
  assert np.isfinite(value)
  assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
  bert = grads["bert"]
  e_grad = bert["linformer"]["E"]  # the one E = F, reached through every layer's terms
  for g in (e_grad, bert["position"]["p_query"], bert["position"]["p_key"]):
    assert np.abs(g).max() > 0
  # Positions beyond L get no gradient: E is sliced to E[:, :L].
  np.testing.assert_array_equal(e_grad[:, L:], 0.0)
