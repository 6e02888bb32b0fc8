"""The masked-LM BERT that the step and compile benchmarks (and the comparison's cost) time.

:func:`model_steps` builds one size and scheme preset (``posenc_jax.presets.SCHEME_PRESETS``) as
uncompiled steps on a fixed random batch ``[B, L]``; :func:`compiled_steps` compiles and warms
them up into zero-argument callables for timing.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import optax

from posenc_jax.models import BertForMaskedLM, model_config
from posenc_jax.presets import preset_config
from posenc_jax.training.objectives import weighted_cross_entropy

# The benchmarks' --size names and the size presets they build.
BERT_SIZES = {"tiny": "bert_tiny", "small": "bert_small", "base": "bert_base"}
BASELINE = "bert"


def model_steps(size: str, scheme: str, *, batch: int, length: int, dtype: str,
                route: str = "auto", scan_layers: bool = True):
  """The masked-LM BERT's uncompiled steps: ``(cfg, train, infer, init)``.

  ``train(params, opt_state)`` is one AdamW step on a fixed random batch ``[batch, length]``
  (15% of the tokens weighted), ``infer(params)`` the forward pass (logits ``[batch, length,
  vocab]``), ``init()`` the initial ``(params, opt_state)``.
  """
  cfg = preset_config(f"{BERT_SIZES[size]},{scheme}").model
  cfg = model_config(cfg, max_len=max(length, cfg.get("max_len", 512)), dtype=dtype,
                     dropout_rate=0.0, attention_dropout_rate=0.0, route=route,
                     scan_layers=scan_layers)
  model = BertForMaskedLM(cfg)
  key_ids, key_mask = jax.random.split(jax.random.key(0))
  ids = jax.random.randint(key_ids, (batch, length), 6, cfg.vocab_size)
  segments = jnp.zeros_like(ids)
  mask = jnp.ones_like(ids)
  weights = (jax.random.uniform(key_mask, (batch, length)) < 0.15).astype(jnp.float32)
  tx = optax.adamw(1e-4)

  def loss(p):
    logits = model.apply({"params": p}, ids, segments, mask)
    total, weight, _ = weighted_cross_entropy(logits, ids, weights)
    return total / weight

  def train(p, s):
    grads = jax.grad(loss)(p)
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s

  def init():
    params = model.init(jax.random.key(1), ids, segments, mask)["params"]
    return params, tx.init(params)

  return cfg, train, lambda p: model.apply({"params": p}, ids, segments, mask), init


def compiled_steps(size: str, scheme: str, *, batch: int, length: int, dtype: str,
                   route: str = "auto"):
  """Zero-argument (train step, inference) callables of the compiled model, its config, and
  the seconds of the first train step and inference pass (compile, then one run each)."""
  cfg, train, infer, init = model_steps(size, scheme, batch=batch, length=length, dtype=dtype,
                                        route=route)
  train, infer = jax.jit(train), jax.jit(infer)
  state = list(jax.jit(init)())

  def train_step():
    state[0], state[1] = train(state[0], state[1])
    jax.block_until_ready(state[0])

  def infer_step():
    jax.block_until_ready(infer(state[0]))

  start = time.perf_counter()
  train_step()  # compile and warm up
  first = time.perf_counter()
  infer_step()
  return train_step, infer_step, cfg, {"train_s": first - start,
                                       "infer_s": time.perf_counter() - first}
