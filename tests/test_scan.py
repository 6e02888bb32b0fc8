"""Scanned layer stacks (``model.scan_layers``): the same model as unrolled layers, converted
exactly between the two layouts, and loadable from checkpoints of either."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posenc_jax.models import model_config
from posenc_jax.models.build import build_model
from posenc_jax.models.decoding import beam_search, decoder_step, init_cache, repeat_beams
from posenc_jax.models.scan import is_scanned, layout_for, match_layout, scan_params, unscan_params
from posenc_jax.training.checkpoint import Checkpointer, CheckpointError, restore_params

TINY = dict(vocab_size=40, d_model=16, num_layers=3, num_heads=2, mlp_dim=24, max_len=16,
            dropout_rate=0.0, attention_dropout_rate=0.0, route="reference")
TOL = dict(rtol=1e-5, atol=1e-5)


def redrawn(tree, seed=0, std=0.3):
  """Every leaf of ``tree`` N(0, std^2): the 0.02 init would hide a layer mix-up."""
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return treedef.unflatten([std * jax.random.normal(k, x.shape, x.dtype)
                            for k, x in zip(keys, leaves)])


def both_layouts(fields, head="mlm", ids=None):
  """``(unrolled model, scanned model, unrolled params, scanned params)``, same values."""
  cfg = model_config(**TINY, **fields)
  unrolled = build_model(cfg.replace(scan_layers=False), head)
  scanned = build_model(cfg, head)
  params = redrawn(nn.unbox(unrolled.init(jax.random.key(0), *ids)["params"]))
  return unrolled, scanned, params, scan_params(params)


IDS = jax.random.randint(jax.random.key(1), (2, 12), 0, 40)
MASK = jnp.arange(12)[None, :] < jnp.array([[12], [7]])


@pytest.mark.parametrize("fields", [
    dict(scheme={"name": "diet_rel"}),                                   # per-layer Toeplitz
    dict(scheme={"name": "diet_rel", "sharing": "layer"}),               # one shared table
    dict(scheme={"name": "t5"}, segment={"name": "segment_per_head"}),  # shared + per-layer
    dict(scheme={"name": "diet_abs", "rank": 4}, segment=None),         # per-layer factored
    dict(scheme={"name": "tupe_r"}),
    dict(scheme={"name": "shaw", "clip": 3, "value": True}),
    dict(scheme={"name": "rope"}, pre_ln=True),
    dict(scheme={"name": "alibi"}, remat="full"),
    dict(attention="linformer", linformer_k=6, linformer_sharing="layer",
         scheme={"name": "diet_abs_lin", "k": 6, "rank": 3}),
    dict(attention="linformer", linformer_k=6, linformer_sharing="none"),
])
def test_scanned_encoder_equals_unrolled(fields):
  """Same logits and the same gradients (converted back) from the same weights."""
  unrolled, scanned, params, stacked = both_layouts(fields, ids=(IDS,))
  assert jax.tree.structure(stacked) == jax.tree.structure(
      nn.unbox(jax.eval_shape(scanned.init, jax.random.key(0), IDS)["params"]))

  def loss(model, p):
    logits = model.apply({"params": p}, IDS, mask=MASK)
    return jnp.sum(jnp.sin(logits)), logits

  (value, logits), grads = jax.value_and_grad(lambda p: loss(unrolled, p), has_aux=True)(params)
  (value_s, logits_s), grads_s = jax.value_and_grad(lambda p: loss(scanned, p),
                                                    has_aux=True)(stacked)
  np.testing.assert_allclose(logits_s, logits, **TOL)
  np.testing.assert_allclose(value_s, value, rtol=1e-5)
  # Absolute tolerance from the largest gradient of all: a leaf whose exact gradient is zero
  # (Linformer's key bias, added to every compressed key alike) holds only rounding noise.
  scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads))
  for path, g in jax.tree_util.tree_leaves_with_path(unscan_params(grads_s)):
    want = dict(jax.tree_util.tree_leaves_with_path(grads))[path]
    np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-5 * scale + 1e-7,
                               err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("scheme", [{"name": "diet_rel"}, {"name": "rope"},
                                    {"name": "learned_ape"}])
def test_scanned_decoder_caches_and_searches_like_unrolled(scheme):
  """Teacher forcing, the KV cache (one [N, B, L, H, D] array per projection) and a beam
  search, whose reordering gathers the cache along its batch axis (axis 1 when scanned)."""
  fields = dict(num_decoder_layers=2, segment=None, pooler=False, scheme=scheme)
  src, tgt = IDS, jnp.roll(IDS, 1, axis=1)
  unrolled, scanned, params, stacked = both_layouts(fields, "translation", ids=(src, tgt, MASK))
  want = unrolled.apply({"params": params}, src, tgt, MASK)
  np.testing.assert_allclose(scanned.apply({"params": stacked}, src, tgt, MASK), want, **TOL)

  def search(model, p):
    encoded = repeat_beams(model.apply({"params": p}, src, MASK, method=model.encode), 2)
    mask = repeat_beams(MASK, 2)
    cache = init_cache(model, p, encoded, mask, 6)
    return cache, beam_search(decoder_step(model, p, encoded, mask), cache, 2, 6, beam_size=2,
                              eos_id=1)

  cache, (tokens, scores) = jax.jit(lambda p: search(unrolled, p))(params)
  cache_s, (tokens_s, scores_s) = jax.jit(lambda p: search(scanned, p))(stacked)
  key = cache_s["decoder"]["layers"]["self_attention"]["cached_key"]
  assert key.shape == (2, 4, 6, 2, 8)  # [N, B * K, L_dec, H, D]
  assert cache["decoder"]["layers_1"]["self_attention"]["cached_key"].shape == key.shape[1:]
  np.testing.assert_array_equal(tokens_s, tokens)
  np.testing.assert_allclose(scores_s, scores, **TOL)


def test_conversion_is_exact_and_keeps_logical_axes():
  cfg = model_config(**TINY)
  boxed = build_model(cfg.replace(scan_layers=False), "mlm").init(jax.random.key(0), IDS)
  stacked = scan_params(boxed["params"])
  query = stacked["bert"]["layers"]["attention"]["query"]["kernel"]
  assert query.names == ("layers", "embed", "heads", "kv") and query.value.shape == (3, 16, 2, 8)
  expected = build_model(cfg, "mlm").init(jax.random.key(0), IDS)["params"]
  assert jax.tree.map(lambda x: x.names, stacked, is_leaf=lambda x: hasattr(x, "names")) == \
      jax.tree.map(lambda x: x.names, expected, is_leaf=lambda x: hasattr(x, "names"))
  back = unscan_params(stacked)
  assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)),
                                   nn.unbox(back), nn.unbox(boxed["params"])))
  assert is_scanned(stacked) and not is_scanned(back)
  assert match_layout(back, stacked) is not back and layout_for(back, False) is back


def test_conversion_refuses_gaps_and_unlike_layers():
  layer = {"w": jnp.ones((2,))}
  with pytest.raises(ValueError, match=r"layers numbered \[0, 2\]; expected 0 .. 1"):
    scan_params({"layers_0": layer, "layers_2": layer})
  with pytest.raises(ValueError, match="the layers hold different parameters"):
    scan_params({"layers_0": layer, "layers_1": {"v": jnp.ones((2,))}})


@pytest.mark.parametrize("saved_scanned", [False, True])
def test_checkpoints_restore_into_either_layout(tmp_path, saved_scanned):
  """A checkpoint of one layout restores into a model of the other (init_checkpoint and the
  analysis tools go through restore_params); another model is still refused."""
  cfg = model_config(**TINY)
  params = nn.unbox(build_model(cfg.replace(scan_layers=False), "mlm").init(
      jax.random.key(0), IDS)["params"])
  saved = scan_params(params) if saved_scanned else params
  checkpointer = Checkpointer(str(tmp_path), save_interval_steps=1, async_save=False)
  checkpointer.save(1, {"params": saved}, {"position": 0}, force=True)
  checkpointer.close()
  for scan in (False, True):
    model = build_model(cfg.replace(scan_layers=scan), "mlm")
    abstract = nn.unbox(jax.eval_shape(model.init, jax.random.key(0), IDS)["params"])
    step, restored = restore_params(str(tmp_path), abstract)
    assert step == 1 and jax.tree.structure(restored) == jax.tree.structure(abstract)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(layout_for(params, scan))):
      np.testing.assert_array_equal(got, want)
  other = build_model(cfg.replace(num_layers=2), "mlm")
  with pytest.raises(CheckpointError, match="does not hold the config's model"):
    restore_params(str(tmp_path), nn.unbox(jax.eval_shape(other.init, jax.random.key(0),
                                                          IDS)["params"]))
