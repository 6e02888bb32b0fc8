"""Attention dropout from a counter-based hash: ``keep[b, h, i, j]`` is a pure function of
``(seed, b, h, i, j)``, so a kernel regenerates any tile's mask in the forward pass and again
in the backward (no mask is stored), and the reference route draws exactly the same mask.

The hash is MurmurHash3's 32-bit finaliser applied in a chain
``mix(mix(mix(seed + P1 b + P2 h) + i) + j)`` on int32 bit patterns (wrapping
multiplies, logical shifts: the same bits on XLA, Triton and Mosaic). An entry is
kept when its hash, read as an unsigned 32-bit number, is at least
``round(rate * 2^32)``, i.e. with probability ``1 - rate`` (to 2^-32); kept
probabilities are scaled by ``1 / (1 - rate)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Array = jax.Array


def _int32(value: int) -> np.int32:
  """The int32 with the bit pattern of unsigned ``value``."""
  return np.uint32(value).view(np.int32)


_C1, _C2 = _int32(0x85EBCA6B), _int32(0xC2B2AE35)  # MurmurHash3 fmix32
_P1, _P2 = _int32(0x9E3779B1), _int32(0x7FEB352D)  # odd multipliers of batch and head
_SIGN = _int32(0x80000000)


def _mix(x: Array) -> Array:
  x = x ^ lax.shift_right_logical(x, jnp.int32(16))
  x = x * _C1
  x = x ^ lax.shift_right_logical(x, jnp.int32(13))
  x = x * _C2
  return x ^ lax.shift_right_logical(x, jnp.int32(16))


def dropout_multiplier(seed: Array, batch, head, row: Array, col: Array, rate: float) -> Array:
  """``keep / (1 - rate)`` (float32, 0 where dropped) for each ``(batch, head, row, col)``.

  Args:
    seed: int32, broadcastable to the others (a ``[1, 1]`` block inside kernels).
    batch, head: int32 indices (scalars, or arrays broadcastable to ``row``/``col``).
    row, col: int32 query and key positions.
    rate: dropout rate in ``(0, 1)`` (static).
  """
  threshold = int(min(round(rate * 2**32), 2**32 - 1))
  x = _mix(seed + jnp.asarray(batch, jnp.int32) * _P1 + jnp.asarray(head, jnp.int32) * _P2)
  x = _mix(_mix(x + row) + col)
  keep = (x ^ _SIGN) >= _int32(threshold ^ 0x80000000)  # unsigned x >= threshold
  return jnp.where(keep, jnp.float32(1.0 / (1.0 - rate)), jnp.float32(0.0))


def dropout_seed(rng: Array) -> Array:
  """A ``[1, 1]`` int32 seed drawn from a PRNG key (what the kernels and the reference take)."""
  bits = jax.random.bits(rng, (1, 1), jnp.uint32)
  return lax.bitcast_convert_type(bits, jnp.int32)


def dropout_multipliers(seed: Array, shape: tuple[int, int, int, int], rate: float) -> Array:
  """The whole ``[B, H, Lq, Lk]`` multiplier array (the reference route's)."""
  b, h, i, j = (lax.broadcasted_iota(jnp.int32, shape, axis) for axis in range(4))
  return dropout_multiplier(jnp.reshape(seed, ()), b, h, i, j, rate)
