"""Multi-head attention over a list of logit terms, by two exact routes.

* ``route="reference"`` materialises ``A = c q.k^T + sum_t T_t``, masks,
  softmaxes in float32 and mixes the values. Every term form runs here.
* ``route="fused"`` folds factored terms into q/k by concatenation along the
  head dim, applies q/k transforms (RoPE), sums the remaining biases and
  calls :func:`jax.nn.dot_product_attention`, so on GPU it can reach cuDNN
  and never builds an ``[Lq, Lk]`` positional tensor for factored and
  rotation terms.
* ``route="auto"`` picks ``fused`` when every term supports it.

The two routes agree to float32 rounding, gradients included (tested).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from posenc_jax.terms import Term

Array = jax.Array
Route = Literal["auto", "reference", "fused"]
ROUTES = ("auto", "reference", "fused")


def _mask_4d(mask: Array | None, causal: bool, q_len: int, k_len: int) -> Array | None:
  """Padding mask ``[B, Lk]`` (or ``[B|1, H|1, Lq, Lk]``) and causality as one 4-D bool."""
  if mask is not None:
    chex.assert_rank(mask, {2, 4})
    mask = mask[:, None, None, :] if mask.ndim == 2 else mask
    mask = mask.astype(bool)
  if causal:
    tril = jnp.tril(jnp.ones((q_len, k_len), bool))[None, None]
    mask = tril if mask is None else jnp.logical_and(mask, tril)
  return mask


def _reference(q, k, v, terms, mask, causal, scale, dropout_rate=0.0, dropout_rng=None):
  logits = jnp.einsum("bihd,bjhd->bhij", q, k) * scale
  for term in terms:
    extra = term.logits(q, scale)
    if extra is not None:
      logits = logits + extra.astype(logits.dtype)
  mask = _mask_4d(mask, causal, q.shape[1], k.shape[1])
  logits = logits.astype(jnp.float32)
  if mask is not None:
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits, axis=-1)
  if dropout_rate > 0.0 and dropout_rng is not None:
    keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, probs.shape)
    probs = jnp.where(keep, probs / (1.0 - dropout_rate), 0.0)
  probs = probs.astype(v.dtype)
  out = jnp.einsum("bhij,bjhd->bihd", probs, v)
  for term in terms:
    extra = term.value_output(probs)
    if extra is not None:
      out = out + extra.astype(out.dtype)
  return out


def _fused(q, k, v, terms, mask, causal, scale, implementation):
  q_parts, k_parts, bias = [q], [k], None
  for term in terms:
    part = term.fused(q, scale)
    if part.bias is not None:
      bias = part.bias if bias is None else bias + part.bias
    if part.q_extra is not None:
      batch = q.shape[0]
      q_parts.append(jnp.broadcast_to(part.q_extra, (batch,) + part.q_extra.shape[1:]))
      k_parts.append(jnp.broadcast_to(part.k_extra, (batch,) + part.k_extra.shape[1:]))
  head_dim = v.shape[-1]
  q = jnp.concatenate(q_parts, axis=-1)
  k = jnp.concatenate(k_parts, axis=-1)
  # dot_product_attention wants v shaped like k: zero-pad, then slice off.
  v = jnp.pad(v, [(0, 0)] * 3 + [(0, k.shape[-1] - head_dim)])
  if bias is not None:
    bias = bias.astype(q.dtype)
  out = jax.nn.dot_product_attention(
      q, k, v, bias=bias, mask=_mask_4d(mask, False, q.shape[1], k.shape[1]),
      scale=scale, is_causal=causal, implementation=implementation)
  return out[..., :head_dim]


def attend(
    q: Array,
    k: Array,
    v: Array,
    terms: Sequence[Term] = (),
    *,
    mask: Array | None = None,
    causal: bool = False,
    scale: float | None = None,
    route: Route = "auto",
    implementation: Literal["xla", "cudnn"] | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
) -> Array:
  """Attention with positional/segment logit terms.

  Args:
    q: ``[B, Lq, H, D]`` queries.
    k: ``[B, Lk, H, D]`` keys.
    v: ``[B, Lk, H, D]`` values.
    terms: attention terms of one layer (:meth:`SchemeTerms.for_layer`).
    mask: ``[B, Lk]`` padding mask (True = attend) or a bool mask
      broadcastable to ``[B, H, Lq, Lk]``.
    causal: also mask keys after the query (decoder self-attention).
    scale: content scale ``c``; None gives ``1 / sqrt(D)``.
    route: ``"reference"``, ``"fused"`` or ``"auto"`` (fused when possible).
    implementation: passed to :func:`jax.nn.dot_product_attention` on the
      fused route (None lets JAX choose; ``"cudnn"`` on GPU).
    dropout_rate: attention-probability dropout (BERT's
      ``attention_probs_dropout_prob``); active only with a ``dropout_rng``,
      and then only the reference route runs it (``auto`` picks it).
    dropout_rng: PRNG key for the dropout; None means deterministic.

  Returns:
    ``[B, Lq, H, D]``.
  """
  chex.assert_rank([q, k, v], 4)
  chex.assert_equal_shape([k, v])
  chex.assert_equal_shape_prefix([q, k], 1)
  chex.assert_equal_shape_suffix([q, k], 2)
  if route not in ROUTES:
    raise ValueError(f"route: unknown route {route!r}; allowed: {', '.join(ROUTES)}")
  scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
  for term in terms:
    q, k = term.transform_qk(q, k)
  dropout = dropout_rate > 0.0 and dropout_rng is not None
  if route == "auto":
    route = "fused" if all(t.fusable for t in terms) and not dropout else "reference"
  if route == "reference":
    return _reference(q, k, v, terms, mask, causal, scale, dropout_rate, dropout_rng)
  unfusable = [type(t).__name__ for t in terms if not t.fusable]
  if unfusable:
    raise ValueError(f"route: 'fused' cannot run {', '.join(unfusable)}; use route='reference'")
  if dropout:
    raise ValueError("route: 'fused' has no attention dropout; use route='reference' or 'auto'")
  return _fused(q, k, v, terms, mask, causal, scale, implementation)


class MultiHeadAttention(nn.Module):
  """Multi-head self- or cross-attention whose logits take a list of terms.

  Attributes:
    num_heads: H.
    head_dim: D; the output projection maps ``H * D`` back to the input width.
    route: see :func:`attend`.
    dtype: compute dtype (parameters stay float32).
    dropout_rate: attention-probability dropout (needs a ``dropout`` rng
      when ``deterministic`` is False).
  """

  num_heads: int
  head_dim: int
  route: Route = "auto"
  dtype: jnp.dtype = jnp.float32
  dropout_rate: float = 0.0
  kernel_init: nn.initializers.Initializer = nn.initializers.normal(0.02)

  @nn.compact
  def __call__(self, x: Array, terms: Sequence[Term] = (), *, context: Array | None = None,
               mask: Array | None = None, causal: bool = False,
               scale: float | None = None, deterministic: bool = True) -> Array:
    """Args: ``x`` ``[B, Lq, d]``; ``context`` ``[B, Lk, d]`` (None: ``x``).

    Returns ``[B, Lq, d]``.
    """
    context = x if context is None else context
    dense = lambda name: nn.DenseGeneral(  # noqa: E731
        (self.num_heads, self.head_dim), dtype=self.dtype, name=name,
        kernel_init=nn.with_logical_partitioning(self.kernel_init, ("embed", "heads", "kv")),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("heads", "kv")))
    q, k, v = dense("query")(x), dense("key")(context), dense("value")(context)
    dropout_rng = None
    if not deterministic and self.dropout_rate > 0.0:
      dropout_rng = self.make_rng("dropout")
    out = attend(q, k, v, terms, mask=mask, causal=causal, scale=scale, route=self.route,
                 dropout_rate=self.dropout_rate, dropout_rng=dropout_rng)
    return nn.DenseGeneral(
        x.shape[-1], axis=(-2, -1), dtype=self.dtype, name="out",
        kernel_init=nn.with_logical_partitioning(self.kernel_init, ("heads", "kv", "embed")),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)))(out)
