"""T5's bucketed relative position bias (Raffel et al.)."""

from __future__ import annotations

import dataclasses
import functools

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


@functools.lru_cache(maxsize=None)
def bucket_starts(num_buckets: int, max_distance: int) -> tuple[int, ...]:
  """The smallest distance ``n >= 0`` in each bucket ``1 .. num_buckets - 1`` of one direction.

  With ``e = num_buckets // 2`` (``max_exact``) and ``m = num_buckets - e``, T5's
  formula puts ``n < e`` in bucket ``n`` and ``n >= e`` in bucket
  ``min(e + floor(m log(n / e) / log(max_distance / e)), num_buckets - 1)``, so bucket
  ``e + k`` (``0 < k < m``) starts at the smallest ``n`` with
  ``n^m e^k >= max_distance^k e^m``: an integer inequality, solved exactly by bisection
  on ``[e, max_distance]``. That is the formula in real arithmetic; float logs round
  instead. XLA's float32 log (vectorised or not, by array length) puts some exact powers
  ``n = e (max_distance / e)^(k / m)`` one bucket low, flaxformer's ``+ float32 eps``
  being below float32's spacing once ``n / e >= 2``. In float64, mesh-tensorflow's form
  (no eps) drops some exact powers too (10 causal buckets, max distance 160, ``n = 10``),
  and flaxformer's eps lifts a distance lying within ``1e-7`` below a start one bucket
  high (58 causal buckets, max distance 282, ``n = 119``). Starts past the int32 range
  are left out: no int32 offset reaches them.

  Args:
    num_buckets: the buckets of one direction (half of them when bidirectional).
    max_distance: distances from here on share the last bucket.

  Returns:
    ``num_buckets - 1`` (fewer past int32) increasing starts; bucket ``b`` of distance
    ``n`` is the number of starts ``<= n``.
  """
  max_exact = num_buckets // 2
  m = num_buckets - max_exact
  starts = list(range(1, max_exact + 1))
  for k in range(1, m):
    lo, hi = max_exact, max_distance
    while lo < hi:
      mid = (lo + hi) // 2
      if mid**m * max_exact**k >= max_distance**k * max_exact**m:
        hi = mid
      else:
        lo = mid + 1
    starts.append(lo)
  return tuple(s for s in starts if s <= np.iinfo(np.int32).max)


def relative_position_bucket(relative_position: Array, *, bidirectional: bool = True,
                             num_buckets: int = 32, max_distance: int = 128) -> Array:
  """T5 bucket id of each offset ``r = j - i`` (key minus query position).

  Bidirectional: half the buckets per direction (``r > 0`` in the upper
  half). Within a direction, ``|r| < n/2`` (``n`` the buckets of that
  direction) get their own bucket; larger offsets are binned logarithmically
  up to ``max_distance``, beyond which they share the last bucket. Causal:
  all buckets for ``r <= 0``; ``r > 0`` maps to bucket 0.

  The buckets are mesh-tensorflow's and flaxformer's ``_relative_position_bucket``
  in exact arithmetic: integer bucket starts (:func:`bucket_starts`) found once when
  traced, then a count of the starts each distance reaches (comparisons and a sum,
  no float log, no gather), so an offset's bucket never depends on the array around it.

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
  n = -jnp.asarray(relative_position, jnp.int32)  # the distance back to the key
  if bidirectional:
    num_buckets //= 2
    direction = (n < 0).astype(jnp.int32) * num_buckets
    n = jnp.abs(n)
  else:
    direction = 0  # a later key (n < 0) reaches no start: bucket 0
  starts = np.array(bucket_starts(num_buckets, max_distance), np.int32)
  return direction + jnp.sum(n[..., None] >= starts, axis=-1, dtype=jnp.int32)


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

  def closed(self, params: tuple[Array, ...], rel: Array) -> Array:
    """The same bias without a gather, from ``params``: the head's ``num_buckets`` entries
    (each broadcastable against ``rel``, any shape). A bucket is the count of bucket starts
    a distance reaches (:func:`relative_position_bucket`), so its entry is the first one plus
    the step ``b[k] - b[k - 1]`` of every start ``k`` reached: a comparison and a select per
    start. What a kernel can evaluate in its tiles (``relative_flash_attention``'s
    ``offset_fn``, the Hopper passes included); it names no ``closed_form``, so the route plan
    keeps T5 on the offset vector until the route table has measured this form faster."""
    problem = bucket_problem(len(params), self.max_distance, self.bidirectional)
    if problem:
      raise ValueError(f"BucketedOffsets.closed: {problem}")
    n = -jnp.asarray(rel, jnp.int32)  # the distance back to the key

    def steps(entries, distance):
      starts = bucket_starts(len(entries), self.max_distance)
      value = entries[0]
      for k, start in enumerate(starts, 1):
        value = value + jnp.where(distance >= start, entries[k] - entries[k - 1], 0.0)
      return value

    if not self.bidirectional:  # a later key (n < 0) reaches no start: bucket 0
      return steps(params, jnp.maximum(n, 0))
    half = len(params) // 2
    return jnp.where(n < 0, steps(params[half:], -n), steps(params[:half], n))


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
  causal_fields = {"bidirectional": False}

  @classmethod
  def joint_problem(cls, values):
    return bucket_problem(values["num_buckets"], values["max_distance"], values["bidirectional"])

  @nn.compact
  def __call__(self, length, segment_ids=None, position_ids=None):
    self.check_length(length)
    positions = self.toeplitz_positions(length, position_ids)
    layers, heads = self.sharing_dims(self.sharing)
    table = self.logical_param("relative_bias", nn.initializers.normal(0.02),
                               (layers, heads, self.num_buckets), ("layers", "heads", "buckets"))
    offset_fn = BucketedOffsets(self.max_distance, self.bidirectional)
    return SchemeTerms(terms=(Toeplitz(table, offset_fn, **positions),))
