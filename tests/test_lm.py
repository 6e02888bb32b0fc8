"""The decoder-only causal language model: cached decoding equals teacher forcing for several
schemes in both layer layouts, the attention routes agree, the objective against a direct
computation, generation against step-by-step argmax, one-line errors, and a short run of the
real training loop on the bundled corpus (``configs/lm.py``)."""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posenc_jax.models import CausalLM, ModelConfigError, generate, model_config
from posenc_jax.models.build import build_model
from posenc_jax.models.scan import layout_for
from posenc_jax.models.transformer import shift_right
from posenc_jax.training.metrics import train_flops_per_step
from posenc_jax.training.objectives import lm_objective
from tests.test_metrics import _forward_dot_flops
from tests.test_transformer import redraw

VOCAB, BATCH, LENGTH = 13, 2, 7
TOL = dict(rtol=1e-5, atol=1e-5)

# One scheme per form the causal stack builds: Toeplitz biases (T5 unidirectional, DIET-REL,
# ALiBi causal), a q/k rotation (RoPE), a factored term (DIET-ABS) and input-level APEs.
SCHEMES = {
    "alibi": {"name": "alibi"},
    "rope": {"name": "rope"},
    "t5": {"name": "t5", "num_buckets": 8, "max_distance": 5},
    "diet_rel": {"name": "diet_rel", "clip": 3},
    "diet_abs": {"name": "diet_abs", "rank": 4},
    "learned_ape": {"name": "learned_ape"},
    "sinusoidal_ape": {"name": "sinusoidal_ape", "learnable": True},
}


def tiny_config(scheme, **overrides):
  return model_config(dict(
      vocab_size=VOCAB, d_model=16, num_layers=2, num_heads=2, mlp_dim=24, max_len=16,
      dropout_rate=0.0, attention_dropout_rate=0.0, layer_norm_eps=1e-6, segment=None,
      pooler=False, scheme=scheme) | overrides)


def init_lm(scheme, seed=0, std=0.5, **overrides):
  """``(model, params)``, every parameter N(0, std^2) and the scheme's N(0, 1) (as
  ``tests/test_transformer.py``'s ``init_model``): drawn for unrolled layers, then laid out
  as the config says, so both layouts get the same weights."""
  config = tiny_config(scheme, **overrides)
  unrolled = CausalLM(config.replace(scan_layers=False))
  shapes = nn.unbox(jax.eval_shape(unrolled.init, jax.random.key(0),
                                   jnp.ones((1, LENGTH), jnp.int32))["params"])
  params = redraw(shapes, seed, std)
  if "position" in params["decoder"]:
    params["decoder"]["position"] = redraw(shapes["decoder"]["position"], seed + 1, 1.0)
  return CausalLM(config), layout_for(params, config.scan_layers)


def token_ids(seed=0, batch=BATCH, length=LENGTH):
  return jax.random.randint(jax.random.key(seed), (batch, length), 2, VOCAB)


def cached_logits(model, params, ids):
  """Logits ``[B, L, V]`` from one cached step per position (one jitted step, compiled once
  per model)."""
  dummy = jnp.zeros(ids.shape, jnp.int32)
  _, variables = jax.eval_shape(lambda: model.apply({"params": params}, dummy, decode=True,
                                                    method=model.decode, mutable=["cache"]))
  cache = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), variables["cache"])
  decode = jax.jit(lambda params, cache, token: model.apply(
      {"params": params, "cache": cache}, token, decode=True, method=model.decode,
      mutable=["cache"]))
  steps = []
  for t in range(ids.shape[1]):
    logits, variables = decode(params, cache, ids[:, t:t + 1])
    cache = variables["cache"]
    steps.append(logits[:, 0])
  return jnp.stack(steps, axis=1)


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_cached_decoding_equals_teacher_forcing_in_both_layouts(name):
  ids = token_ids()
  full = None
  for scanned in (True, False):
    model, params = init_lm(SCHEMES[name], scan_layers=scanned)
    forced = model.apply({"params": params}, ids)
    assert forced.shape == (BATCH, LENGTH, VOCAB) and forced.dtype == jnp.float32
    if full is None:
      full = forced
    np.testing.assert_allclose(forced, full, **TOL)  # the layouts are the same model
    np.testing.assert_allclose(cached_logits(model, params, ids), full, **TOL)


def test_pre_ln_untied_output_decodes_and_has_its_own_layout():
  model, params = init_lm(SCHEMES["t5"], pre_ln=True, share_embeddings=False)
  assert set(params) == {"embed", "output", "decoder"}
  assert "final_norm" in params["decoder"] and "position" in params["decoder"]
  layer = params["decoder"]["layers"]
  assert set(layer) == {"self_attention", "self_attention_norm", "mlp", "mlp_norm"}
  ids = token_ids(1)
  np.testing.assert_allclose(cached_logits(model, params, ids),
                             model.apply({"params": params}, ids), **TOL)


def test_the_model_is_causal_and_sees_positions():
  """Changing token t leaves the logits before t alone; with RoPE swapping two earlier tokens
  changes the last logits, with no scheme it does not (one layer: a bag of tokens)."""
  ids = token_ids(2)
  model, params = init_lm(SCHEMES["alibi"])
  changed = ids.at[:, 4].set((ids[:, 4] + 1) % VOCAB)
  a, b = model.apply({"params": params}, ids), model.apply({"params": params}, changed)
  np.testing.assert_allclose(b[:, :4], a[:, :4], rtol=1e-6, atol=1e-6)
  assert np.abs(np.asarray(b[:, 4:] - a[:, 4:])).max() > 1e-3
  swapped = ids.at[:, [1, 2]].set(ids[:, [2, 1]])
  for scheme, moves in (({"name": "rope"}, True), ({"name": "none"}, False)):
    model, params = init_lm(scheme, num_layers=1)
    a = model.apply({"params": params}, ids)[:, -1]
    b = model.apply({"params": params}, swapped)[:, -1]
    assert (np.abs(np.asarray(a - b)).max() > 1e-3) == moves


@pytest.mark.parametrize("name", ["alibi", "t5", "diet_rel", "rope", "diet_abs"])
def test_reference_and_fused_routes_agree(name):
  """The fused route (Toeplitz terms in the Pallas kernel, interpreted on CPU; RoPE's rotation
  and DIET-ABS's fold into q/k) equals the reference route, with the cache too for ALiBi."""
  ids = token_ids(3)
  reference, params = init_lm(SCHEMES[name], route="reference")
  fused = CausalLM(reference.config.replace(route="fused"))
  expected = reference.apply({"params": params}, ids)
  np.testing.assert_allclose(fused.apply({"params": params}, ids), expected, **TOL)
  if name == "alibi":
    np.testing.assert_allclose(cached_logits(fused, params, ids), expected, **TOL)


def test_objective_equals_a_direct_computation():
  """Summed next-token cross-entropy over the real tokens, weights and correct counts; a
  padded row scores as its unpadded tokens alone."""
  model, params = init_lm(SCHEMES["rope"])
  targets = np.array(token_ids(4))
  targets[1, 5:] = 0  # row 1: five tokens, then padding
  loss, sums = lm_objective(model, params, {"targets": jnp.asarray(targets)}, None)
  logits = np.asarray(model.apply({"params": params}, shift_right(jnp.asarray(targets))),
                      np.float64)
  log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  real = targets > 0
  picked = np.take_along_axis(log_probs, targets[..., None], -1)[..., 0]
  np.testing.assert_allclose(loss, -picked[real].sum(), rtol=1e-5)
  assert float(sums["weight"]) == real.sum() == BATCH * LENGTH - 2
  assert float(sums["correct"]) == (logits.argmax(-1) == targets)[real].sum()
  rows = [lm_objective(model, params, {"targets": jnp.asarray(row)}, None)[0]
          for row in (targets[:1], targets[1:, :5])]
  np.testing.assert_allclose(sum(rows), loss, rtol=1e-5)
  smoothed, _ = lm_objective(model, params, {"targets": jnp.asarray(targets)}, None, 0.1)
  assert float(smoothed) != float(loss)


@pytest.mark.parametrize("scanned", [True, False])
def test_generation_is_the_argmax_of_teacher_forcing(scanned):
  """Greedy tokens after a prompt are the argmax of the teacher-forced logits at every new
  position, and their log-probabilities sum to what teacher forcing gives; sampling with
  ``top_k=1`` is greedy; sampling is reproducible per key."""
  model, params = init_lm(SCHEMES["alibi"], std=0.3, scan_layers=scanned)
  prompt, new = token_ids(5, length=3), 5
  tokens, log_probs = jax.jit(lambda p: generate(model, params, p, max_new_tokens=new,
                                                 eos_id=None))(prompt)
  assert tokens.shape == (BATCH, new) and tokens.dtype == jnp.int32
  sequence = jnp.concatenate([prompt, tokens], axis=1)
  forced = jax.nn.log_softmax(model.apply({"params": params}, shift_right(sequence)))[:, 3:]
  np.testing.assert_array_equal(tokens, jnp.argmax(forced, -1))
  np.testing.assert_allclose(log_probs, jnp.take_along_axis(forced, tokens[..., None], -1)
                             .sum((1, 2)), **TOL)
  sample = jax.jit(lambda rng, top_k: generate(model, params, prompt, max_new_tokens=new,
                                                rng=rng, temperature=2.0, top_k=top_k,
                                                eos_id=None)[0], static_argnums=1)
  np.testing.assert_array_equal(sample(jax.random.key(0), 1), tokens)
  np.testing.assert_array_equal(sample(jax.random.key(1), 0), sample(jax.random.key(1), 0))
  assert not all(np.array_equal(sample(jax.random.key(s), 0), tokens) for s in (1, 2, 3))


def test_generation_from_an_empty_prompt_stops_at_eos():
  """An empty prompt starts from BOS; a row that emits EOS is padded after it."""
  model, params = init_lm(SCHEMES["learned_ape"], std=0.3)
  empty = jnp.zeros((BATCH, 0), jnp.int32)
  tokens, _ = generate(model, params, empty, max_new_tokens=6, eos_id=None)
  forced = model.apply({"params": params}, shift_right(tokens))
  np.testing.assert_array_equal(tokens, jnp.argmax(forced, -1))
  eos = int(tokens[0, 1])  # call the second token EOS: the row ends there
  ended, _ = generate(model, params, empty, max_new_tokens=6, eos_id=eos)
  first = int(np.argmax(np.asarray(ended[0]) == eos))
  assert first <= 1 and (np.asarray(ended[0, first + 1:]) == 0).all()


@pytest.mark.parametrize("make,message", [
    (lambda: CausalLM(tiny_config({"name": "alibi"}, num_decoder_layers=2)),
     "model.num_decoder_layers: got 2; allowed: 0 for the language model"),
    (lambda: CausalLM(tiny_config({"name": "alibi"}, segment={"name": "segment_input"})),
     "model.segment: the language model has no segment scheme"),
    (lambda: build_model(tiny_config({"name": "learned_ape"}, attention="linformer",
                                     linformer_k=4), "lm"),
     "model.attention: the language model runs full attention"),
    (lambda: build_model(tiny_config({"name": "alibi"}), "lmm"), "head: got 'lmm'; did you mean"),
    (lambda: generate(*init_lm({"name": "alibi"}), token_ids(), max_new_tokens=0),
     "generate: max_new_tokens: got 0; allowed: a positive integer"),
    (lambda: generate(*init_lm({"name": "alibi"}), token_ids().astype(jnp.float32),
                      max_new_tokens=2), "generate: prompt: got shape (2, 7) of float32"),
    (lambda: generate(*init_lm({"name": "alibi"}), token_ids(), max_new_tokens=2,
                      rng=jax.random.key(0), temperature=0.0), "generate: temperature: got 0.0"),
    (lambda: generate(*init_lm({"name": "alibi"}), token_ids(), max_new_tokens=2,
                      rng=jax.random.key(0), top_k=VOCAB + 1), "generate: top_k: got 14"),
    (lambda: generate(*init_lm({"name": "learned_ape"}), token_ids(), max_new_tokens=10),
     "sequence length 17 exceeds max_len=16"),
])
def test_bad_values_are_one_line(make, message):
  with pytest.raises(ValueError) as e:
    make()
  assert message in str(e.value) and "\n" not in str(e.value)
  assert isinstance(e.value, ModelConfigError) == message.startswith(("model.", "head"))


def test_the_analysis_reads_a_language_models_positional_term():
  """The analysis tools load a causal LM as its positional view (rank and plots) in the
  scheme's causal form; identical-word probing is refused with one line."""
  from posenc_jax.analysis import AnalysisError, from_config  # noqa: PLC0415
  from posenc_jax.analysis.loading import check_model  # noqa: PLC0415

  model = from_config("configs/lm.py:bert_tiny,alibi")
  assert model.causal and model.encoder.config.scheme["causal"] is True
  with pytest.raises(AnalysisError) as e:
    check_model(model.config, "lm", "probe")
  assert "decoder-only causal language model" in str(e.value) and "\n" not in str(e.value)


def test_flop_count_matches_the_jaxpr():
  """``train_flops_per_step(head='lm')`` against the matmuls the model runs: the reference
  route computes every (query, key) pair and masks half, the count takes half."""
  cfg = tiny_config({"name": "sinusoidal_ape"}, route="reference", vocab_size=50)
  ids = jax.ShapeDtypeStruct((2, 12), jnp.int32)
  ran = _forward_dot_flops(build_model(cfg, "lm"), ids)
  masked_half = 2 * 2 * (2 * 2 * 12 * 12 * 8 * 2 // 2)  # 2 layers, B = 2, H = 2, D = 8
  assert train_flops_per_step(cfg, 2, 12, head="lm") == 3 * (ran - masked_half)


def test_training_on_the_bundled_corpus(tmp_path, monkeypatch, capsys):
  """``configs/lm.py`` through the real loop and input pipeline, shortened: the loss falls,
  the evaluation reports perplexity, a checkpoint is written, and the trained model
  generates. (Shuffle blocks of 256 sequences instead of 16,384, so the first batch does
  not wait for 16,384 packed sequences.)"""
  import seqio  # noqa: PLC0415

  from posenc_jax.configs.lm import get_config  # noqa: PLC0415
  from posenc_jax.data import causal_lm  # noqa: PLC0415
  from posenc_jax.training.loop import train  # noqa: PLC0415

  monkeypatch.setattr(causal_lm, "lm_dataset",
                      functools.partial(causal_lm.lm_dataset, shuffle_block=256))

  config = get_config("bert_tiny,alibi")
  config.model.update(dict(d_model=64, mlp_dim=128, num_layers=1, max_len=16))
  config.update(dict(seq_len=16, batch_size=16, total_steps=30, log_every=10, eval_every=30,
                     eval_steps=2, checkpoint_every=30, compilation_cache_dir=""))
  config.optimizer.update(dict(learning_rate=3e-3, warmup_steps=5))
  result = train(config, str(tmp_path / "run"))
  history = result["history"]
  first, last = history[0], history[-1]
  assert last["step"] == 30 and last["loss"] < first["loss"] - 1.0, (first, last)
  assert last["eval_perplexity"] == pytest.approx(math.exp(last["eval_loss"]), rel=1e-6)
  # The unigram reference: the same scored tokens under the train split's add-one counts.
  from posenc_jax.data import unigram  # noqa: PLC0415
  from posenc_jax.training.input_pipeline import make_batches  # noqa: PLC0415
  log_p = unigram.log_probs(unigram.train_counts("lm", config.task, config.model.vocab_size))
  scored = [(b["targets"], b.get("loss_weights", b["targets"] > 0))
            for b in make_batches(config, "validation", 0)]
  nll = -sum(float((log_p[t] * w).sum()) for t, w in scored) / sum(float(w.sum())
                                                                 for _, w in scored)
  assert last["eval_unigram_perplexity"] == pytest.approx(math.exp(nll), rel=1e-9)
  out = capsys.readouterr().out.splitlines()
  assert (f"eval at step 30: loss {last['eval_loss']:.4f} ppl {last['eval_perplexity']:.1f} "
          f"(unigram {last['eval_unigram_perplexity']:.1f}) acc {last['eval_accuracy']:.3f}"
          ) in out
  assert out[-1].endswith(f"; eval perplexity {last['eval_perplexity']:.1f} against the "
                          f"unigram's {last['eval_unigram_perplexity']:.1f} ("
                          f"{last['eval_perplexity'] / last['eval_unigram_perplexity']:.2f}x) "
                          "at step 30")
  assert (tmp_path / "run" / "checkpoints" / "30").is_dir()
  model = build_model(config.model, "lm")
  params = result["state"].params
  vocabulary = seqio.get_mixture_or_task(config.task).output_features["targets"].vocabulary
  prompt = jnp.asarray([vocabulary.encode("physical entity:")], jnp.int32)
  tokens, _ = generate(model, params, prompt, max_new_tokens=8)
  forced = model.apply({"params": params}, shift_right(jnp.concatenate([prompt, tokens], 1)))
  np.testing.assert_array_equal(tokens, jnp.argmax(forced[:, prompt.shape[1]:], -1))


# --- the task and the input pipeline --------------------------------------------------------

TASK, SPLIT, L = "wordnet_glosses_lm", "validation", 128


def _take(ds, n):
  return [b["targets"] for _, b in zip(range(n), ds.as_numpy_iterator())]


def test_the_task_packs_the_glosses_with_eos():
  """Packed examples are the lines' stream ``line EOS line EOS ...`` in exactly ``L``-token
  pieces, only the last padded; the lines are the MLM task's, same vocabulary."""
  import seqio  # noqa: PLC0415

  import posenc_jax.tasks  # noqa: F401, PLC0415
  from posenc_jax.data import causal_lm  # noqa: PLC0415
  from posenc_jax.data.vocab import EOS_ID  # noqa: PLC0415

  task, text = seqio.get_mixture_or_task(TASK), seqio.get_mixture_or_task("wordnet_glosses")
  assert task.output_features["targets"].vocabulary == text.output_features["text"].vocabulary
  lines = [x["text"] for x in text.get_dataset(None, split=SPLIT, shuffle=False)
           .as_numpy_iterator()]
  unpacked = [x["targets"] for x in task.get_dataset(None, split=SPLIT, shuffle=False)
              .as_numpy_iterator()]
  assert all((u[:-1] == t).all() and u[-1] == EOS_ID for t, u in zip(lines, unpacked,
                                                                       strict=True))
  stream = np.concatenate(unpacked)
  packed = np.stack(_take(causal_lm.packed_epoch(TASK, SPLIT, L), 10**6))
  assert packed.shape == (-(-len(stream) // L), L) == (causal_lm.epoch_length(TASK, SPLIT, L), L)
  assert (packed[:-1] > 0).all()
  np.testing.assert_array_equal(packed.ravel()[:len(stream)], stream)
  assert (packed.ravel()[len(stream):] == 0).all()


def test_lm_dataset_resumes_across_an_epoch_boundary():
  """A run resumed at step s sees what an uninterrupted one sees from s on."""
  from posenc_jax.data import causal_lm  # noqa: PLC0415

  per_epoch, rest = divmod(causal_lm.epoch_length(TASK, SPLIT, L), 8)
  assert rest  # batch per_epoch holds the end of epoch 0 and the start of epoch 1
  full = _take(causal_lm.lm_dataset(TASK, SPLIT, L, 8, seed=3), per_epoch + 3)
  for start in (per_epoch, per_epoch + 1):
    resumed = _take(causal_lm.lm_dataset(TASK, SPLIT, L, 8, seed=3, start_step=start),
                    per_epoch + 3 - start)
    for x, y in zip(full[start:], resumed, strict=True):
      np.testing.assert_array_equal(x, y)


def test_lm_dataset_shards_and_evaluation_batches():
  """Two hosts' batches interleave into one host's; the trainer's evaluation batches are the
  split in order."""
  from posenc_jax.configs.lm import get_config  # noqa: PLC0415
  from posenc_jax.data import causal_lm  # noqa: PLC0415
  from posenc_jax.training.input_pipeline import make_batches  # noqa: PLC0415

  full = _take(causal_lm.lm_dataset(TASK, SPLIT, L, 8, seed=3), 2)
  shards = [_take(causal_lm.lm_dataset(TASK, SPLIT, L, 4, seed=3, shard_id=k, num_shards=2), 2)
            for k in (0, 1)]
  for step in range(2):
    np.testing.assert_array_equal(shards[0][step], full[step][0::2])
    np.testing.assert_array_equal(shards[1][step], full[step][1::2])
  config = get_config()
  config.update(dict(seq_len=L, batch_size=8, eval_steps=3))
  evaluation = [b["targets"] for b in make_batches(config, "validation", 0)]
  ordered = _take(causal_lm.packed_epoch(TASK, SPLIT, L).batch(8), 3)
  assert len(evaluation) == 3 and all((a == b).all() for a, b in zip(evaluation, ordered))
