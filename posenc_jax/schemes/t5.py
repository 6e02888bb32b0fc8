"""T5's bucketed relative position bias (Raffel et al.)."""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.schemes.base import BOOL, POSITIVE_INT, SHARING, Scheme, is_int, one_of
from posenc_jax.terms import SchemeTerms, Toeplitz, lookup, offsets, toeplitz_bias

Array = jax.Array


def bucket_problem(num_buckets: int, max_distance: int, bidirectional: bool) -> str | None:
  """Why T5 bucketing cannot take these settings (``"<field> must be ..., got X"``), or None.

  Each direction needs a bucket of its own offsets and one logarithmic bucket, and the
  logarithmic range ``[max_exact, max_distance)`` must be non-empty, ``max_exact`` being
  half a direction's buckets. Bidirectional bucketing splits an even number of buckets.
  """
  if not (is_int(num_buckets) and is_int(max_distance) and max_distance > 0):
    return (f"num_buckets and max_distance must be positive integers, got {num_buckets!r} and "
            f"{max_distance!r}")
  if bidirectional and (num_buckets < 4 or num_buckets % 2):
    return (f"num_buckets must be an even integer >= 4 when bidirectional (half per "
            f"direction), got {num_buckets}")
  if num_buckets < 2:
    return f"num_buckets must be an integer >= 2, got {num_buckets}"
  max_exact = num_buckets // (4 if bidirectional else 2)
  if max_distance <= max_exact:
    return (f"max_distance must exceed the {max_exact} offsets with buckets of their own "
            f"(num_buckets={num_buckets}, bidirectional={bidirectional}), got {max_distance}")
  return None


def relative_position_bucket(relative_position: Array, *, bidirectional: bool = True,
                             num_buckets: int = 32, max_distance: int = 128) -> Array:
  """T5 bucket id of each offset ``r = j - i`` (key minus query position).

  Bidirectional: half the buckets per direction (``r > 0`` in the upper
  half). Within a direction, ``|r| < n/2`` (``n`` the buckets of that
  direction) get their own bucket; larger offsets are binned logarithmically
  up to ``max_distance``, beyond which they share the last bucket. Causal:
  all buckets for ``r <= 0``; ``r > 0`` maps to bucket 0.

  Args:
    relative_position: int array of any shape.

  Returns:
    int32 array of the same shape, values in ``[0, num_buckets)``.

  Raises:
    ValueError: settings :func:`bucket_problem` rejects, in one line.
  """
  problem = bucket_problem(num_buckets, max_distance, bidirectional)
  if problem:
    raise ValueError(f"relative_position_bucket: {problem}")
  n = -relative_position.astype(jnp.int32)
  bucket = jnp.zeros_like(n)
  if bidirectional:
    num_buckets //= 2
    bucket = bucket + (n < 0).astype(jnp.int32) * num_buckets
    n = jnp.abs(n)
  else:
    n = jnp.maximum(n, 0)
  max_exact = num_buckets // 2
  # float32 eps keeps exact powers (n = max_exact * ratio^k) on their bucket.
  log_ratio = jnp.log(n.astype(jnp.float32) / max_exact + np.finfo(np.float32).eps)
  large = max_exact + (log_ratio / math.log(max_distance / max_exact)
                       * (num_buckets - max_exact)).astype(jnp.int32)
  large = jnp.minimum(large, num_buckets - 1)
  return bucket + jnp.where(n < max_exact, n, large)


@dataclasses.dataclass(frozen=True)
class BucketedOffsets:
  """T5's offset function: ``b_h[bucket(j - i)]`` from a ``[..., num_buckets]`` table.

  Called as ``(table [..., n], rel [N]) -> [..., N]`` (see
  :class:`posenc_jax.terms.Toeplitz`).
  """

  max_distance: int = 128
  bidirectional: bool = True

  def __call__(self, table: Array, rel: Array) -> Array:
    buckets = relative_position_bucket(rel, bidirectional=self.bidirectional,
                                       num_buckets=table.shape[-1],
                                       max_distance=self.max_distance)
    return lookup(table, buckets)


def t5_bias(table: Array, q_len: int, k_len: int, *, bidirectional: bool,
            max_distance: int) -> Array:
  """Bucketed bias from a per-bucket table ``[H, num_buckets]``: ``[H, Lq, Lk]``."""
  offset_fn = BucketedOffsets(max_distance, bidirectional)
  values = offset_fn(table, offsets(q_len, k_len))
  return toeplitz_bias(values, q_len, k_len)[0]


class T5Bias(Scheme):
  """``T[h,i,j] = b_h[bucket(j - i)]``.

  Attributes:
    num_buckets: buckets in all (half per direction when bidirectional).
    max_distance: offsets at or beyond this share the last bucket.
    bidirectional: False for decoder self-attention (causal bucketing).
    sharing: ``layer`` (T5's default: one table for all layers) or ``none``.
  """

  num_buckets: int = 32
  max_distance: int = 128
  bidirectional: bool = True
  sharing: str = "layer"

  scheme_name = "t5"
  hyperparameters = {"num_buckets": POSITIVE_INT, "max_distance": POSITIVE_INT,
                     "bidirectional": BOOL, "sharing": one_of(*SHARING)}

  @classmethod
  def joint_problem(cls, values):
    return bucket_problem(values["num_buckets"], values["max_distance"], values["bidirectional"])

  @nn.compact
  def __call__(self, length, segment_ids=None):
    self.check_length(length)
    layers, heads = self.sharing_dims(self.sharing)
    table = self.logical_param("relative_bias", nn.initializers.normal(0.02),
                               (layers, heads, self.num_buckets), ("layers", "heads", "buckets"))
    offset_fn = BucketedOffsets(self.max_distance, self.bidirectional)
    return SchemeTerms(terms=(Toeplitz(table, offset_fn),))
