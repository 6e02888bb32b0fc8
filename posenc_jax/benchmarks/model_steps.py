"""The models that the step and compile benchmarks (and the comparison's cost) time.

:func:`model_steps` builds one size and scheme preset (``posenc_jax.presets.SCHEME_PRESETS``) as
uncompiled steps on a fixed random batch ``[B, L]``: the masked-LM BERT (head ``mlm``), or,
where :func:`model_of` says so, the causal language model (head ``lm``, its config as
``configs/lm.py`` builds it) at the same size, with logits at every token.
:func:`trainer_steps` builds instead the step that ``train.py`` runs for that size and scheme
(:func:`train_config`: ``configs/pretrain.py``'s or ``configs/lm.py``'s), the trainer's own.
:func:`compiled_steps` compiles and warms up either (``step``: :data:`STEPS`) into
zero-argument callables for timing.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from posenc_jax import memory
from posenc_jax.configs import lm, pretrain
from posenc_jax.models import model_config
from posenc_jax.models.build import build_model
from posenc_jax.presets import SCHEME_PRESETS
from posenc_jax.schemes.registry import scheme_parts
from posenc_jax.training import loop
from posenc_jax.training import mesh as mesh_lib
from posenc_jax.training.config import max_predictions, most_masked, validate_train_config
from posenc_jax.training.objectives import objective
from posenc_jax.training.optim import make_optimizer

# The benchmarks' --size names and the size presets they build.
BERT_SIZES = {"tiny": "bert_tiny", "demo": "bert_demo", "small": "bert_small", "base": "bert_base"}
BASELINE = "bert"
# The train steps the benchmarks can time: train.py's own (trainer), or the benchmarks' plain
# AdamW step with logits at every token (every_token).
STEPS = ("trainer", "every_token")


def model_of(*schemes: str) -> str:
  """The head the benchmarks build for the position presets ``schemes`` (a row's and its
  baseline's, so that both run on one model): ``lm``, the causal language model, when a
  scheme among them is :attr:`~posenc_jax.schemes.Scheme.causal_only` (the BERT encoder has
  no form of it), else ``mlm``, the masked-LM BERT."""
  parts = [part for name in schemes for part in scheme_parts(SCHEME_PRESETS[name]["scheme"])]
  return "lm" if any(part.module.causal_only for part in parts) else "mlm"


def train_config(size: str, scheme: str, *, batch: int, length: int, dtype: str,
                 route: str = "auto", head: str | None = None,
                 corpus: str | None = None) -> ml_collections.ConfigDict:
  """The train config ``train.py`` runs for ``size`` and ``scheme``: ``configs/pretrain.py``'s
  (head ``mlm``) or ``configs/lm.py``'s (``lm``; None: ``model_of(scheme)``; the vocabulary
  of ``corpus`` when given), with ``batch`` rows of ``length`` tokens (``max_len`` at least
  ``length``), ``dtype`` and the attention ``route``; everything else (optimizer, dropout,
  layers scanned, the MLM head's positions) as the config sets it."""
  head = head or model_of(scheme)
  arg = f"{BERT_SIZES[size]},{scheme}"
  config = (lm.get_config(arg + (f",{corpus}" if corpus else "")) if head == "lm"
            else pretrain.get_config(arg))
  config.batch_size, config.seq_len = batch, length
  config.model.update(dict(max_len=max(length, config.model.get("max_len", 512)), dtype=dtype,
                           route=route))
  return config


def model_steps(size: str, scheme: str, *, batch: int, length: int, dtype: str,
                route: str = "auto", scan_layers: bool = True, head: str | None = None,
                corpus: str | None = None):
  """The uncompiled steps of the model ``head`` (``mlm`` or ``lm``; None: ``model_of(scheme)``)
  of ``size`` with ``scheme``: ``(cfg, train, infer, init)``; the causal LM's vocabulary is
  that of ``corpus`` (a name of ``configs/lm.py``'s ``CORPORA``, e.g. ``stdlib``: bytes) when
  given.

  ``train(params, opt_state)`` is one AdamW step on a fixed random batch ``[batch, length]``
  (the masked LM: the cross-entropy at 15% of the tokens, weighted, logits at every token; the
  causal LM: next-token cross-entropy at every token, :func:`~posenc_jax.training.objectives.
  lm_objective`), ``infer(params)`` the forward pass (logits ``[batch, length, vocab]``),
  ``init()`` the initial ``(params, opt_state)``.
  """
  head = head or model_of(scheme)
  cfg = train_config(size, scheme, batch=batch, length=length, dtype=dtype, route=route,
                     head=head, corpus=corpus).model
  cfg = model_config(cfg, dropout_rate=0.0, attention_dropout_rate=0.0,
                     scan_layers=scan_layers)
  model = build_model(cfg, head)
  key_ids, key_mask = jax.random.split(jax.random.key(0))
  ids = jax.random.randint(key_ids, (batch, length), 6, cfg.vocab_size)
  if head == "lm":
    batch_arrays, inputs = {"targets": ids}, (ids,)
  else:
    weights = (jax.random.uniform(key_mask, (batch, length)) < 0.15).astype(jnp.float32)
    inputs = (ids, jnp.zeros_like(ids), jnp.ones_like(ids))
    batch_arrays = {"input_ids": inputs[0], "segment_ids": inputs[1], "mask": inputs[2],
                    "mlm_targets": ids, "mlm_weights": weights}
  loss_fn = objective(head)
  tx = optax.adamw(1e-4)

  def loss(p):
    total, metrics = loss_fn(model, p, batch_arrays, None)
    return total / metrics["weight"]

  def train(p, s):
    grads = jax.grad(loss)(p)
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s

  def init():
    params = model.init(jax.random.key(1), *inputs)["params"]
    return params, tx.init(params)

  return cfg, train, lambda p: model.apply({"params": p}, *inputs), init


def trainer_batch(config: ml_collections.ConfigDict, vocab_size: int) -> dict[str, np.ndarray]:
  """A fixed random batch of ``config`` (``batch_size`` x ``seq_len``, host numpy) as its
  input pipeline makes them: the causal LM's ``targets``, or the masked LM's features with
  :func:`~posenc_jax.training.config.most_masked` positions of each row masked ([CLS], the
  first, never)."""
  rng = np.random.default_rng(0)
  shape = (config.batch_size, config.seq_len)
  ids = rng.integers(6, vocab_size, shape, dtype=np.int32)
  if config.objective == "lm":
    return {"targets": ids}
  masked = np.argsort(rng.random((shape[0], shape[1] - 1)), axis=1)[:, :most_masked(config)]
  weights = np.zeros(shape, np.float32)
  np.put_along_axis(weights, masked + 1, 1.0, axis=1)
  return {"input_ids": ids, "segment_ids": np.zeros_like(ids), "mask": np.ones_like(ids),
          "mlm_targets": ids, "mlm_weights": weights}


def trainer_steps(size: str, scheme: str, *, batch: int, length: int, dtype: str,
                  route: str = "auto", head: str | None = None, corpus: str | None = None):
  """The steps ``train.py`` runs for :func:`train_config` (same arguments), on one device
  (the first), jitted but not compiled: ``(config, cfg, train, infer, args)``.

  ``train`` is the trainer's own step, :func:`~posenc_jax.training.loop.jit_train_step`: the
  config's optimizer (clipping, weight-decay mask, schedule) and objective (the masked LM's
  logits at ``max_predictions`` positions per row, the causal LM's at every token), the
  state donated, layers scanned as the config says. ``infer(params, batch)`` is its eval step
  (:func:`~posenc_jax.training.loop.make_eval_step`). ``args`` are the step's ``(state,
  batch, rng)``: the initial state (:func:`~posenc_jax.training.loop.init_state`) and a fixed
  random batch (:func:`trainer_batch`) that the trainer's checks accept, placed as it places
  them.
  """
  config = train_config(size, scheme, batch=batch, length=length, dtype=dtype, route=route,
                        head=head, corpus=corpus)
  cfg = validate_train_config(config)
  mesh = mesh_lib.make_mesh(config.mesh.shape, config.mesh.axes, devices=jax.devices()[:1])
  model = build_model(cfg, config.head, num_labels=config.get("num_labels", 2))
  tx, schedule = make_optimizer(config.optimizer, config.total_steps)
  arrays = loop.check_batch(trainer_batch(config, cfg.vocab_size), loop.batch_limits(cfg), 0,
                            max_predictions(config))
  arrays = jax.device_put(arrays, mesh_lib.batch_sharding(mesh))
  state, shardings = loop.init_state(model, tx, arrays, mesh, config, config.seed)
  train = loop.jit_train_step(model, config, schedule, shardings, mesh)
  infer = jax.jit(loop.make_eval_step(model, config))
  return config, cfg, train, infer, (state, arrays, jax.random.key(config.seed + 1))


def compiled_steps(size: str, scheme: str, *, batch: int, length: int, dtype: str,
                   route: str = "auto", head: str | None = None, corpus: str | None = None,
                   step: str = "every_token"):
  """Zero-argument (train step, inference) callables of the compiled model, its config, and
  ``{"train_s", "infer_s", "train_bytes"}``: the seconds of the first train step and inference
  pass (compile, then one run each) and the bytes XLA plans for the compiled train step
  (:func:`posenc_jax.memory.planned_bytes`: this step's own peak, donated state aliased, on
  every backend; None where the backend plans none).

  ``step`` (:data:`STEPS`): ``every_token``, :func:`model_steps` (``head`` as there; inference
  the forward pass), or ``trainer``, :func:`trainer_steps` (inference the trainer's eval step).
  """
  dims = dict(batch=batch, length=length, dtype=dtype, route=route, head=head, corpus=corpus)
  if step == "trainer":
    _, cfg, train, infer, (train_state, inputs, rng) = trainer_steps(size, scheme, **dims)
    state, args = [train_state], (inputs, rng)
    evaluate = lambda: infer(state[0].params, inputs)  # noqa: E731
  else:
    cfg, train, infer, init = model_steps(size, scheme, **dims)
    state, args, train = list(jax.jit(init)()), (), jax.jit(train)
    infer = jax.jit(infer)
    evaluate = lambda: infer(state[0])  # noqa: E731
  start = time.perf_counter()
  train = train.lower(*state, *args).compile()

  def train_step():
    out = train(*state, *args)
    state[:] = out[:1] if step == "trainer" else out  # the trainer's: (state, metrics)
    jax.block_until_ready(state)

  def infer_step():
    jax.block_until_ready(evaluate())

  train_step()  # warm up
  first = time.perf_counter()
  infer_step()
  return train_step, infer_step, cfg, {"train_s": first - start,
                                       "infer_s": time.perf_counter() - first,
                                       "train_bytes": memory.planned_bytes(
                                           train.memory_analysis())}
