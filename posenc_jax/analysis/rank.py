"""Numerical rank of attention logits and of the positional attention (DIET Fig. 2 and Fig. 8).

DIET's Theorem 1: with an input APE, each head's logits ``c (X W_Q)(X W_K)^T``
have rank at most ``D`` (the head width), and so has the positional
attention ``P W_Q W_K^T P^T``; DIET-ABS's ``P_Q P_K^T`` reaches its
constructed rank ``d_p`` (up to ``L``), and adds up to ``d_p`` to the
logits' rank.

The rank is numerical: the number of singular values above
``rtol * s_max`` (computed in float64 from float32 matrices). The default
:data:`DEFAULT_RTOL` = 1e-4 sits well above float32 rounding (about
``1e-7 * sqrt(L)`` relative) and below the singular values of the
constructed matrices the tests use.

A causal language model (``causal=True``, its positional view from
:mod:`~posenc_jax.analysis.loading`) gets the positional ranks only: of the scheme's
causal-form term over the whole ``[L, L]`` before the causal mask (DIET ranks logits
before masking too; the mask is not a finite matrix), so Theorem 1's cap reads the same.
The per-head logits need the model's layers run, which the analysis does for BERT only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from posenc_jax.analysis.probing import (ProbeTokens, default_length, layer_runner,
                                         place_special_tokens, positional_attention)

DEFAULT_RTOL = 1e-4


def numerical_rank(matrices: Any, rtol: float = DEFAULT_RTOL) -> np.ndarray:
  """Rank of each ``[.., M, N]`` matrix: singular values ``> rtol * s_max`` (0 for a zero matrix).

  Returns an int array of the leading shape (a 0-d array for one matrix).
  """
  m = np.asarray(matrices, np.float64)
  if m.ndim < 2:
    raise ValueError(f"numerical_rank: expected [.., M, N] matrices, got shape {m.shape}")
  s = np.linalg.svd(m, compute_uv=False)
  s_max = s[..., :1]
  return np.sum((s > rtol * s_max) & (s > 0), axis=-1)


def random_batch(tokens: ProbeTokens, batch: int, length: int, *, seed: int = 0,
                 special: str = "cls_sep") -> np.ndarray:
  """``[batch, length]`` int32 ids: random words with the special tokens of a BERT input."""
  rng = np.random.default_rng(seed)
  ids = rng.choice(np.asarray(tokens.word_ids), size=(batch, length))
  return place_special_tokens(ids, tokens, special)


def logit_ranks(encoder, variables, input_ids, segment_ids=None, *, layer: int = 0,
                rtol: float = DEFAULT_RTOL) -> np.ndarray:
  """``[B, H]`` numerical ranks of each head's ``[L, L]`` logits in ``layer`` on a batch."""
  attention = layer_runner(encoder, layer)(variables, input_ids, segment_ids)
  return numerical_rank(np.asarray(attention.logits), rtol)


def positional_ranks(encoder, variables, *, length: int | None = None, layer: int = 0,
                     rtol: float = DEFAULT_RTOL) -> tuple[np.ndarray, str]:
  """``[H]`` numerical ranks of each head's content-free positional attention, and its kind
  (see :func:`~posenc_jax.analysis.probing.positional_attention`)."""
  positional = positional_attention(encoder, variables, length=length, layer=layer)
  return numerical_rank(positional.values, rtol), positional.kind


def _summary(ranks: np.ndarray) -> dict[str, float]:
  ranks = np.asarray(ranks)
  return {"min": int(ranks.min()), "max": int(ranks.max()), "mean": float(ranks.mean())}


CAUSAL_LOGITS = ("not computed: the per-head logits need the model's layers run, which the "
                 "analysis does for a BERT encoder only")


def rank_report(encoder, variables, tokens: ProbeTokens, *, batch_size: int = 8,
                length: int | None = None, layer: int = 0, rtol: float = DEFAULT_RTOL,
                seed: int = 0, causal: bool = False) -> dict[str, Any]:
  """JSON-ready ranks: per-head logits on a random batch and the positional attention.

  Keys: ``rtol``, ``length``, ``layer``, ``head_dim`` (Theorem 1's cap for an
  input APE), ``logits`` (``ranks`` ``[B][H]`` and their min/max/mean; with ``causal``,
  the line :data:`CAUSAL_LOGITS`), ``positional`` (``kind``, ``ranks`` ``[H]``, summary;
  with ``causal`` also ``mask``; absent when the scheme has no content-free term).
  """
  length = default_length(encoder, length)
  report = {"rtol": rtol, "length": length, "layer": layer,
            "head_dim": encoder.config.dim_per_head, "num_heads": encoder.config.num_heads}
  if causal:
    report["logits"] = CAUSAL_LOGITS
  else:
    ids = random_batch(tokens, batch_size, length, seed=seed)
    logits = logit_ranks(encoder, variables, ids, layer=layer, rtol=rtol)
    report["logits"] = {"ranks": logits.tolist(), **_summary(logits)}
  positional, kind = positional_ranks(encoder, variables, length=length, layer=layer, rtol=rtol)
  if kind != "none":
    report["positional"] = {"kind": kind, "ranks": positional.tolist(), **_summary(positional)}
    if causal:
      report["positional"]["mask"] = ("causal; ranks of the scheme's causal-form term over "
                                      "the whole [L, L], before the mask")
  return report
