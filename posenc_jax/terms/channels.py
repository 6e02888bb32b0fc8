"""A key vector folded into q/k channels: how a bias separable under a causal mask runs on a
bias-free attention kernel (cuDNN) at that kernel's speed.

Under a causal mask a term ``r_i + s_j`` (causal ALiBi: ``m (j - i)``; FoX's forget gates:
``c_i - c_j``) is ``s_j`` up to a row constant, and a row constant drops out of the softmax
(FlashBias, Wu et al. 2025, fold such biases the same way). ``s_j`` enters as extra channels
of q and k: each query gets ones, each key ``s_j / c`` (``c`` the content scale, which the
kernel applies to the whole product), so that ``c (q . k)`` gains exactly ``s_j``; its
gradient comes back through dK, the slopes' and the gates' with it.

In bfloat16 ``s_j / c`` (up to ``m L / c``: 32,768 for ``m = 0.5``, ``L = 8192``, ``c = 1/8``)
is not exact in 8 bits of mantissa, so it is split into :data:`CHANNELS` ``bfloat16`` parts
``s' = h_1 + h_2 + h_3``, each the rounding of what the ones before it leave
(:func:`split`). Each rounding leaves at most ``2^-9`` of its argument, so the parts hold
``s'`` to ``2^-27 |s'|``; the kernel's float32 accumulation of the products adds at most
``2^-24`` of the largest partial sum. The bound :func:`error_bound` states, and the tests
check, is ``|s - c (h_1 + h_2 + h_3)| <= 2^-22 max_j |s_j - s_mid|`` after centering (the
vector's midrange ``s_mid``, a constant per example and head, is subtracted first: it drops out
of the softmax too and halves the magnitude the rounding is relative to).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from posenc_jax.terms.protocol import FusedPart

Array = jax.Array

CHANNELS = {"bfloat16": 3, "float16": 3, "float32": 1}  # parts of s / c per compute dtype
ERROR_BITS = 22  # error_bound's exponent: the split's 2^-27 and float32's accumulation, padded


def channel_count(dtype) -> int:
  """How many channels :func:`key_channels` adds to q and k in ``dtype``."""
  return CHANNELS[jnp.dtype(dtype).name]


def split(x: Array, dtype, count: int) -> list[Array]:
  """``count`` arrays of ``dtype`` whose float32 sum is ``x`` (float32) to the dtype's
  rounding of the last remainder: each the rounding of what the ones before it leave. The
  first carries ``x``'s gradient (the others are constants: their sum with it is ``x``)."""
  parts, rest = [], x
  for index in range(count):
    part = lax.stop_gradient(rest).astype(dtype)
    rest = rest - part.astype(jnp.float32)
    # Straight through: the first part's value is its rounding, its gradient x's.
    parts.append((x + lax.stop_gradient(part.astype(jnp.float32) - x)).astype(dtype)
                 if index == 0 else part)
  return parts


def center(s: Array) -> Array:
  """``s`` ``[B|1, H|1, Lk]`` less its midrange along the keys (a constant per example and
  head, without gradient: it drops out of the softmax)."""
  mid = (jnp.max(s, axis=-1, keepdims=True) + jnp.min(s, axis=-1, keepdims=True)) / 2
  return s - lax.stop_gradient(mid)


def error_bound(s: Array) -> Array:
  """The largest difference between ``s`` ``[..., Lk]`` and what :func:`key_channels` makes of
  it once centred: ``2^-ERROR_BITS max_j |s_j - s_mid|`` per example and head, ``[..., 1]``."""
  centred = center(s.astype(jnp.float32))
  return jnp.max(jnp.abs(centred), axis=-1, keepdims=True) * 2.0 ** -ERROR_BITS


def key_channels(s: Array, q_len: int, scale: float, dtype) -> FusedPart:
  """The q and k channels that add ``s`` ``[B|1, H|1, Lk]`` (float32) to every query row's
  logits under the content scale ``scale`` (module docstring).

  Returns:
    :class:`FusedPart` with ``q_extra`` ones ``[1, Lq, H|1, n]`` and ``k_extra``
    ``[B|1, Lk, H|1, n]`` (``n`` = :func:`channel_count`), both in ``dtype``.
  """
  count = channel_count(dtype)
  parts = split(center(s.astype(jnp.float32)) / scale, dtype, count)
  k_extra = jnp.stack([jnp.swapaxes(p, 1, 2) for p in parts], axis=-1)  # [B|1, Lk, H|1, n]
  q_extra = jnp.ones((1, q_len, s.shape[1], count), dtype)
  return FusedPart(q_extra=q_extra, k_extra=k_extra)
