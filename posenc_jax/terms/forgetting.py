"""The separable form ``r_i + s_j``: :class:`ForgettingGates`, FoX's forget gates, whose term
``c_i - c_j`` comes from the cumulative log gates ``c`` ``[B, H, L]`` float32
(:func:`segment_cumsum`, restarting at each packed segment); the flash kernel adds it to its
tiles as a row and a column vector."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from posenc_jax.terms.protocol import FusedPart, Term, axis_problem, rank_problem

Array = jax.Array


def segment_cumsum(x: Array, segment_ids: Array | None = None) -> Array:
  """Cumulative sums of ``x`` ``[B, H, L]`` along its last axis, restarting at the first
  token of each packed segment (``segment_ids`` ``[B, L]``: a token whose id differs from
  its left neighbour's starts a segment; None: one segment per row).

  The restart keeps a packed row's sums those of each sequence alone (segments are
  contiguous runs, as packing lays them out), not offset by the gates of the sequences
  before it, which float32 would round.
  """
  if segment_ids is None:
    return jnp.cumsum(x, axis=-1)
  starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                            segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
  starts = jnp.broadcast_to(starts[:, None, :], x.shape)

  def combine(left, right):  # (starts a segment, sum since the last start)
    return left[0] | right[0], jnp.where(right[0], right[1], left[1] + right[1])

  return lax.associative_scan(combine, (starts, x), axis=-1)[1]


@struct.dataclass
class ForgettingGates(Term):
  """Forget gates (Lin et al., ICLR 2025, "Forgetting Transformer"), per head ``h``:

      f_t = sigmoid(w_h . x_t + b_h),     T[b, h, i, j] = sum_{l=j+1..i} log f_l   (j <= i)

  with ``x_t`` the attention layer's input. With ``c = cumsum_t log f_t`` (``[B, H, L]``,
  float32) the term is ``c_i - c_j``: separable, a row vector ``r = c`` and a column vector
  ``s = -c`` (:meth:`vectors`), which the flash kernel adds to its tiles in float32 (``c``
  falls without bound along a sequence: folded into bfloat16 q and k it would cancel).
  Causal only: for ``j > i`` the sum runs backwards, and the causal mask removes those keys.

  Attributes:
    weight: ``w``, ``[d, H]``; ``bias``: ``b``, ``[H]`` (a layer axis in front of each
      inside :class:`SchemeTerms`).
    log_gates: ``log f`` of every key, ``[B, Lk, H]`` float32; set by :meth:`with_inputs`
      (and, decoding, by :meth:`with_key_state` from the cache). None (the term given to
      :func:`posenc_jax.attend` without a layer input): the gates of ``x = 0``,
      ``f = sigmoid(b)`` at every token (FoX's data-independent "bias only" gates).
    segment_ids: ``[B, Lk]`` packed segments or None: ``c`` restarts at each segment's first
      token (:func:`segment_cumsum`).
    q_offset: key index of query row 0 (int scalar, may be traced); None means 0.
      :meth:`slice_queries` sets it for decoding.
    k_len: number of keys (read without ``log_gates``); None means ``Lq``. Set by
      :func:`posenc_jax.attend`.
  """

  weight: Array
  bias: Array
  log_gates: Array | None = None
  segment_ids: Array | None = None
  q_offset: Array | int | None = None
  k_len: int | None = struct.field(pytree_node=False, default=None)

  def with_key_length(self, k_len):
    return self.replace(k_len=k_len)

  def with_inputs(self, x, segment_ids=None):
    logits = jnp.einsum("bld,dh->blh", x.astype(jnp.float32), self.weight.astype(jnp.float32),
                        precision=lax.Precision.HIGHEST) + self.bias.astype(jnp.float32)
    return self.replace(log_gates=jax.nn.log_sigmoid(logits), segment_ids=segment_ids)

  def key_state(self):
    return self.log_gates

  def with_key_state(self, state):
    return self.replace(log_gates=state)

  def slice_queries(self, start, size):
    del size  # the rows are read from the keys' sums at q_offset
    offset = start if self.q_offset is None else self.q_offset + start
    return self.replace(q_offset=jnp.asarray(offset, jnp.int32))

  def shape_problem(self, q_shape, k_shape):
    batch, heads = q_shape[0], q_shape[2]
    weight, bias = jnp.shape(self.weight), jnp.shape(self.bias)
    problem = (rank_problem("weight", weight, (2,), "[d, H] (SchemeTerms.for_layer drops the "
                             "layer axis)")
               or axis_problem("weight", weight, 1, "heads", heads, "q has")
               or rank_problem("bias", bias, (1,), "[H]")
               or axis_problem("bias", bias, 0, "heads", heads, "q has"))
    if problem or self.log_gates is None:
      return problem
    gates = jnp.shape(self.log_gates)
    problem = (rank_problem("log_gates", gates, (3,), "[B, Lk, H]")
               or axis_problem("log_gates", gates, 0, "examples", batch, "q has")
               or axis_problem("log_gates", gates, 1, "keys", k_shape[1], "k has")
               or axis_problem("log_gates", gates, 2, "heads", heads, "q has"))
    if problem or self.segment_ids is None:
      return problem
    if tuple(jnp.shape(self.segment_ids)) != gates[:2]:
      return f"segment_ids {list(jnp.shape(self.segment_ids))} do not match log_gates' [B, Lk]"
    return None

  def vectors(self, q_len: int) -> tuple[Array, Array]:
    """``(r, s)``: ``c`` at the queries ``[B, H, Lq]`` and ``-c`` at the keys ``[B, H, Lk]``,
    float32, so that ``T[b, h, i, j] = r[b, h, i] + s[b, h, j]``."""
    if self.log_gates is None:  # x = 0: f = sigmoid(b) at every key
      k_len = q_len if self.k_len is None else self.k_len
      log_gates = jnp.broadcast_to(jax.nn.log_sigmoid(self.bias.astype(jnp.float32)),
                                   (1, k_len) + self.bias.shape)
    else:
      log_gates = self.log_gates.astype(jnp.float32)
    c = segment_cumsum(jnp.swapaxes(log_gates, 1, 2), self.segment_ids)
    rows = (c[..., :q_len] if self.q_offset is None
            else lax.dynamic_slice_in_dim(c, self.q_offset, q_len, axis=-1))
    return rows, -c

  def logits(self, q, scale):
    del scale
    rows, cols = self.vectors(q.shape[1])
    return rows[..., :, None] + cols[..., None, :]

  def key_vector(self, k_len):
    del k_len  # the gates' keys
    return self.vectors(1)[1]

  def fused_form(self):
    return self._form(entry="separable", causal_separable=True)

  def fused(self, q, scale):
    del scale
    rows, cols = self.vectors(q.shape[1])
    return FusedPart(row=rows, col=cols)
