"""The models that the step and compile benchmarks (and the comparison's cost) time.

:func:`model_steps` builds one size and scheme preset (``posenc_jax.presets.SCHEME_PRESETS``) as
uncompiled steps on a fixed random batch ``[B, L]``: the masked-LM BERT (head ``mlm``), or,
where :func:`model_of` says so, the causal language model (head ``lm``, its config as
``configs/lm.py`` builds it) at the same size; :func:`compiled_steps` compiles and warms them
up into zero-argument callables for timing.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import optax

from posenc_jax import memory
from posenc_jax.configs import lm
from posenc_jax.models import model_config
from posenc_jax.models.build import build_model
from posenc_jax.presets import SCHEME_PRESETS, preset_config
from posenc_jax.schemes.registry import scheme_parts
from posenc_jax.training.objectives import objective

# The benchmarks' --size names and the size presets they build.
BERT_SIZES = {"tiny": "bert_tiny", "small": "bert_small", "base": "bert_base"}
BASELINE = "bert"


def model_of(*schemes: str) -> str:
  """The head the benchmarks build for the position presets ``schemes`` (a row's and its
  baseline's, so that both run on one model): ``lm``, the causal language model, when a
  scheme among them is :attr:`~posenc_jax.schemes.Scheme.causal_only` (the BERT encoder has
  no form of it), else ``mlm``, the masked-LM BERT."""
  parts = [part for name in schemes for part in scheme_parts(SCHEME_PRESETS[name]["scheme"])]
  return "lm" if any(part.module.causal_only for part in parts) else "mlm"


def model_steps(size: str, scheme: str, *, batch: int, length: int, dtype: str,
                route: str = "auto", scan_layers: bool = True, head: str | None = None,
                corpus: str | None = None):
  """The uncompiled steps of the model ``head`` (``mlm`` or ``lm``; None: ``model_of(scheme)``)
  of ``size`` with ``scheme``: ``(cfg, train, infer, init)``; the causal LM's vocabulary is
  that of ``corpus`` (a name of ``configs/lm.py``'s ``CORPORA``, e.g. ``stdlib``: bytes) when
  given.

  ``train(params, opt_state)`` is one AdamW step on a fixed random batch ``[batch, length]``
  (the masked LM: the cross-entropy at 15% of the tokens, weighted; the causal LM:
  next-token cross-entropy at every token, :func:`~posenc_jax.training.objectives.
  lm_objective`), ``infer(params)`` the forward pass (logits ``[batch, length, vocab]``),
  ``init()`` the initial ``(params, opt_state)``.
  """
  head = head or model_of(scheme)
  arg = f"{BERT_SIZES[size]},{scheme}"
  cfg = (lm.get_config(arg + (f",{corpus}" if corpus else "")) if head == "lm"
         else preset_config(arg)).model
  cfg = model_config(cfg, max_len=max(length, cfg.get("max_len", 512)), dtype=dtype,
                     dropout_rate=0.0, attention_dropout_rate=0.0, route=route,
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


def compiled_steps(size: str, scheme: str, *, batch: int, length: int, dtype: str,
                   route: str = "auto", head: str | None = None, corpus: str | None = None):
  """Zero-argument (train step, inference) callables of the compiled model (``head`` as in
  :func:`model_steps`), its config, and ``{"train_s", "infer_s", "train_bytes"}``: the
  seconds of the first train step and inference pass (compile, then one run each) and the
  bytes XLA plans for the compiled train step (:func:`posenc_jax.memory.planned_bytes`: this
  step's own peak, on every backend; None where the backend plans none)."""
  cfg, train, infer, init = model_steps(size, scheme, batch=batch, length=length, dtype=dtype,
                                        route=route, head=head, corpus=corpus)
  state = list(jax.jit(init)())
  start = time.perf_counter()
  train, infer = jax.jit(train).lower(*state).compile(), jax.jit(infer)

  def train_step():
    state[0], state[1] = train(state[0], state[1])
    jax.block_until_ready(state[0])

  def infer_step():
    jax.block_until_ready(infer(state[0]))

  train_step()  # warm up
  first = time.perf_counter()
  infer_step()
  return train_step, infer_step, cfg, {"train_s": first - start,
                                       "infer_s": time.perf_counter() - first,
                                       "train_bytes": memory.planned_bytes(
                                           train.memory_analysis())}
