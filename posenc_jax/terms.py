"""Attention-logit terms: the one public notion every scheme produces.

Every positional or segment scheme ends up in the attention logits

    A[b, h, i, j] = c * q_i . k_j + sum_t T_t[b, h, i, j]

(see ``shared/spec/SCHEMES.md``). A term keeps its *form* explicit, because
the form decides which attention route can run it without materialising an
``[Lq, Lk]`` tensor:

=================  ==========================================  ==============
form               class                                       fused route
=================  ==========================================  ==============
bias               :class:`Bias` ``[H,Lq,Lk]`` / ``[B,H,Lq,Lk]``  bias input
relative (i - j)   :class:`Toeplitz` (DIET-REL, T5, ALiBi)     in-kernel bias
factored (U V^T)   :class:`Factored`                           concat to q/k
query-dependent    :class:`QueryRelative` (Shaw)               bias from q
q and k dependent  :class:`ContextualPositions` (CoPE)         bias from q, k
separable r_i+s_j  :class:`ForgettingGates` (FoX)              in-kernel rows
q/k transform      :class:`Rotation` (RoPE), :class:`QKShift`  transform q/k
input-level        :class:`InputEmbedding`                     (not attention)
=================  ==========================================  ==============

Terms are pytrees (``flax.struct`` dataclasses), so they pass through
``jax.jit``, ``jax.grad`` and ``nn.scan``. Array layouts follow
``jax.nn.dot_product_attention``: q/k/v are ``[B, L, H, D]``.

Each attention term implements the same small protocol, used by
:mod:`posenc_jax.attention` without knowing which paper the term came from:

* ``transform_qk(q, k) -> (q, k)``: rewrite q and k before anything else.
* ``logits(q, scale) -> [B|1, H|1, Lq, Lk] | None``: the materialised term.
* ``fused(q, scale) -> FusedPart``: what the fused route needs instead.
* ``fused_form() -> TermForm``: how that part enters the fused route, from static
  attributes alone (what the route plan, :mod:`posenc_jax.route_plan`, asks).
* ``value_output(probs) -> [B, Lq, H, D] | None``: an extra contribution to
  the attention output (Shaw's value term).
* ``slice_queries(start, size) -> Term``: the same term restricted to query
  rows ``[start, start + size)``, keys unchanged (incremental decoding: the
  term is built once for the whole decode length and each step takes its
  row, so keys keep their absolute positions). ``start`` may be traced.
* ``with_key_length(k_len) -> Term``: tells a term whose arrays carry no key
  axis (Shaw's, which holds only an offset table) how many keys the
  attention has; :func:`posenc_jax.attend` calls it. Others return self.
* ``with_keys(k) -> Term``: hands the keys (after every q/k transform) to a term whose
  logits read them (CoPE's gates ``sigmoid(q_i . k_t)``); :func:`posenc_jax.attend` calls
  it. Others return self.
* ``with_inputs(x, segment_ids) -> Term``: hands the attention layer's input ``x``
  ``[B, L, d]`` (and its packed ``segment_ids`` ``[B, L]`` or None) to a term computed
  from it (the forgetting gates ``sigmoid(w^T x_t + b)``);
  :class:`posenc_jax.attention.MultiHeadAttention` calls it. Others return self.
* ``key_state() -> [B, Lk, ...] | None`` and ``with_key_state(state) -> Term``: what
  incremental decoding keeps of each key besides k and v (the forgetting gates' ``log f``),
  cached by :class:`~posenc_jax.attention.MultiHeadAttention` and handed back for every
  cached key. None and self for the others.
* ``shape_problem(q_shape, k_shape) -> str | None``: why the term's arrays do
  not fit attention over q ``[B, Lq, H, D]`` and k ``[B, Lk, H, D]`` (static
  shapes, checked by :func:`posenc_jax.attend` at trace time), or None.

Slicing counts the query axis from the end of each array (``-2`` for
``[.., Lq, Lk]``, ``-3`` for ``[.., Lq, H, r]``), so it works on a term of
one layer and on a :class:`SchemeTerms` term with its leading layer axis.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class FusedPart:
  """What a term contributes to the fused route.

  Attributes:
    bias: ``[B|1, H|1, Lq, Lk]`` added to the logits by the kernel, or None.
    q_extra: ``[B|1, Lq, H, r]`` concatenated to q along the head dim.
    k_extra: ``[B|1, Lk, H, r]`` concatenated to k along the head dim.
    offset_bias: ``[H|1, Lq + Lk - 1]`` Toeplitz bias, one value per offset
      ``j - i`` (:func:`offsets`), built into the tiles by
      the flash kernel; :func:`toeplitz_bias` materialises it.
    zero_first: the offset bias is zero in row 0 and column 0 (TUPE-R).
    row, col: ``[B|1, H|1, Lq]`` and ``[B|1, H|1, Lk]`` float32, a separable term
      ``r_i + s_j`` that the flash kernel adds to each tile in float32.
  """

  bias: Array | None = None
  q_extra: Array | None = None
  k_extra: Array | None = None
  offset_bias: Array | None = None
  zero_first: bool = False
  row: Array | None = None
  col: Array | None = None


@dataclasses.dataclass(frozen=True)
class TermForm:
  """How a term enters the fused route, read from its static attributes alone (no array is
  computed): what :func:`posenc_jax.route_plan.plan` asks of each term.

  Attributes:
    name: the term's class name; ``fusable``: False where the fused route cannot run it
      exactly (:attr:`Term.fusable`).
    entry: ``"none"`` (nothing left to add: q/k transforms run before routing), ``"fold"``
      (``rank`` columns concatenated to q and k), ``"toeplitz"`` (one ``[H|1, Lq + Lk - 1]``
      offset vector whose tiles the kernel builds), ``"separable"`` (a row and a column
      vector per example and head, ``r_i + s_j``, added in the kernel's tiles) or ``"bias"``
      (a dense ``[B|1, H|1, Lq, Lk]`` bias); :meth:`Term.fused` returns the matching arrays.
    table_form: ``"toeplitz"`` or ``"factored"`` where the term is the same for every example,
      so that :mod:`posenc_jax.route_table` may have it materialised once per call as a bias
      instead; else None.
    rank: columns folded into q and k (``entry == "fold"``).
    zero_first: the Toeplitz vector is zero in row 0 and column 0 (TUPE-R's [CLS] reset).
  """

  name: str
  fusable: bool = True
  entry: str = "none"
  table_form: str | None = None
  rank: int = 0
  zero_first: bool = False


class Term:
  """Base of the attention terms: identity in every part of the protocol."""

  # False when the fused route cannot run the term exactly.
  fusable = True

  def fused_form(self) -> TermForm:
    """How :meth:`fused`'s part enters the fused route (:class:`TermForm`)."""
    return self._form()

  def _form(self, **form: Any) -> TermForm:
    return TermForm(name=type(self).__name__, fusable=self.fusable, **form)

  def transform_qk(self, q: Array, k: Array) -> tuple[Array, Array]:
    return q, k

  def logits(self, q: Array, scale: float) -> Array | None:
    del q, scale
    return None

  def fused(self, q: Array, scale: float) -> FusedPart:
    del q, scale
    return FusedPart()

  def value_output(self, probs: Array) -> Array | None:
    del probs
    return None

  def slice_queries(self, start: int | Array, size: int) -> Term:
    """The term restricted to query rows ``[start, start + size)``.

    The base term is the identity and has no query axis, so it is its own
    slice. A subclass that holds arrays must say where its query axis is:
    returning ``self`` there would silently keep every row, so this raises.
    """
    del start, size
    if any(hasattr(leaf, "shape") for leaf in jax.tree.leaves(self) if leaf is not self):
      raise NotImplementedError(f"{type(self).__name__} holds arrays but does not implement "
                                "slice_queries; it cannot be used for incremental decoding")
    return self

  def with_key_length(self, k_len: int) -> Term:
    """The term for attention over ``k_len`` keys (only length-free terms need it)."""
    del k_len
    return self

  def with_keys(self, k: Array) -> Term:
    """The term for attention over keys ``k`` ``[B, Lk, H, D]``, after the q/k transforms
    (only terms whose logits read the keys need it)."""
    del k
    return self

  def with_inputs(self, x: Array, segment_ids: Array | None = None) -> Term:
    """The term for the attention layer whose input is ``x`` ``[B, L, d]`` (packed
    sequences: ``segment_ids`` ``[B, L]``); only terms computed from it need it."""
    del x, segment_ids
    return self

  def key_state(self) -> Array | None:
    """``[B, Lk, ...]``: what a decoding step keeps of each key besides k and v, or None."""
    return None

  def with_key_state(self, state: Array) -> Term:
    """The term over the cached keys, ``state`` ``[B, L_dec, ...]`` (:meth:`key_state`'s
    values of every cached key)."""
    del state
    return self

  def shape_problem(self, q_shape: Sequence[int], k_shape: Sequence[int]) -> str | None:
    """Why the term does not fit q ``[B, Lq, H, D]`` and k ``[B, Lk, H, D]``, or None.

    One clause naming the term's array and both sizes, e.g. ``"table [8, 15] has 8
    heads, but q has 12"``. The base term holds no arrays and fits any attention.
    """
    del q_shape, k_shape
    return None


def _axis_problem(name: str, shape: Sequence[int], axis: int, noun: str, want: int,
                  source: str, broadcast: bool = False) -> str | None:
  """``"<name> [..] has <n> <noun>, but <source> <want>"`` when axis ``axis`` of ``shape`` is
  not ``want`` (nor 1, with ``broadcast``), else None."""
  got = shape[axis]
  if got == want or (broadcast and got == 1):
    return None
  return f"{name} {list(shape)} has {got} {noun}, but {source} {want}"


def _rank_problem(name: str, shape: Sequence[int], ranks: Sequence[int],
                  layout: str) -> str | None:
  """``"<name> is [..]; expected <layout>"`` unless ``shape`` has one of ``ranks`` axes."""
  return None if len(shape) in ranks else f"{name} is {list(shape)}; expected {layout}"


def _batch_problem(name: str, shape: Sequence[int], batch: int) -> str | None:
  """A 4-D ``[B|1, ...]`` array whose leading axis is neither q's batch nor 1."""
  if len(shape) < 4:
    return None
  return _axis_problem(name, shape, 0, "examples", batch, "q has", broadcast=True)


def slice_rows(x: Array, start: int | Array, size: int, axis: int) -> Array:
  """``size`` entries of ``x`` from ``start`` along ``axis`` (negative: from the end).

  A size-1 axis is a broadcast axis (the same value for every query row) and
  is returned whole. ``start`` may be traced; as with
  :func:`jax.lax.dynamic_slice`, a start past ``dim - size`` is clamped.
  """
  axis = axis % x.ndim
  if x.shape[axis] == 1:
    return x
  return lax.dynamic_slice_in_dim(x, start, size, axis)


def _as_4d_bias(value: Array) -> Array:
  """``[H, Lq, Lk]`` -> ``[1, H, Lq, Lk]``; ``[B, H, Lq, Lk]`` unchanged."""
  return value[None] if value.ndim == 3 else value


@struct.dataclass
class Bias(Term):
  """Additive logit bias.

  Attributes:
    value: ``[H|1, Lq, Lk]`` (batch-free, e.g. DIET-REL, T5, ALiBi) or
      ``[B|1, H|1, Lq, Lk]`` (per example); a query axis of 1 is the same row for every
      query.
  """

  value: Array

  def shape_problem(self, q_shape, k_shape):
    shape = jnp.shape(self.value)
    return (_rank_problem("value", shape, (3, 4), "[H|1, Lq|1, Lk] or [B|1, H|1, Lq|1, Lk]")
            or _axis_problem("value", shape, -1, "keys", k_shape[1], "k has")
            or _axis_problem("value", shape, -2, "queries", q_shape[1], "q has", broadcast=True)
            or _axis_problem("value", shape, -3, "heads", q_shape[2], "q has", broadcast=True)
            or _batch_problem("value", shape, q_shape[0]))

  def logits(self, q, scale):
    del q, scale
    return _as_4d_bias(self.value)

  def fused_form(self):
    return self._form(entry="bias")

  def fused(self, q, scale):
    del q, scale
    return FusedPart(bias=_as_4d_bias(self.value))

  def slice_queries(self, start, size):
    return self.replace(value=slice_rows(self.value, start, size, -2))


@struct.dataclass
class Factored(Term):
  """Low-rank term ``T[b, h, i, j] = sum_r u[b, i, h, r] v[b, j, h, r]``.

  Attributes:
    u: ``[Lq, H|1, r]`` (batch-free) or ``[B, Lq, H|1, r]``.
    v: ``[Lk, H|1, r]`` (batch-free) or ``[B, Lk, H|1, r]``.

  The fused route is exact: with content scale ``c``,
  ``(q ++ u / c) . (k ++ v) * c = c q.k + u.v``.
  """

  u: Array
  v: Array

  def shape_problem(self, q_shape, k_shape):
    u, v = jnp.shape(self.u), jnp.shape(self.v)
    layout = "[L, H|1, r] or [B|1, L, H|1, r]"
    problem = _rank_problem("u", u, (3, 4), layout) or _rank_problem("v", v, (3, 4), layout)
    if problem:
      return problem
    if u[-1] != v[-1]:
      return f"u {list(u)} has rank {u[-1]}, but v {list(v)} has {v[-1]}"
    heads = q_shape[2]
    return (_axis_problem("u", u, -3, "queries", q_shape[1], "q has")
            or _axis_problem("v", v, -3, "keys", k_shape[1], "k has")
            or _axis_problem("u", u, -2, "heads", heads, "q has", broadcast=True)
            or _axis_problem("v", v, -2, "heads", heads, "q has", broadcast=True)
            or _batch_problem("u", u, q_shape[0]) or _batch_problem("v", v, q_shape[0]))

  def _uv4(self) -> tuple[Array, Array]:
    u = self.u[None] if self.u.ndim == 3 else self.u
    v = self.v[None] if self.v.ndim == 3 else self.v
    return u, v

  def materialise(self) -> Bias:
    """The same term as a ``[B|1, H|1, Lq, Lk]`` :class:`Bias`."""
    u, v = self._uv4()
    return Bias(jnp.einsum("bihr,bjhr->bhij", u, v))

  def logits(self, q, scale):
    return self.materialise().logits(q, scale)

  def fused_form(self):
    batch_free = all(x.ndim == 3 or x.shape[0] == 1 for x in (self.u, self.v))
    return self._form(entry="fold", table_form="factored" if batch_free else None,
                      rank=self.u.shape[-1])

  def fused(self, q, scale):
    u, v = self._uv4()
    heads = q.shape[2]
    u = jnp.broadcast_to(u, u.shape[:2] + (heads, u.shape[3]))
    v = jnp.broadcast_to(v, v.shape[:2] + (heads, v.shape[3]))
    return FusedPart(q_extra=(u / scale).astype(q.dtype), k_extra=v.astype(q.dtype))

  def slice_queries(self, start, size):
    return self.replace(u=slice_rows(self.u, start, size, -3))


def relative_offsets(q_len: int, k_len: int, q_offset: int | Array = 0) -> Array:
  """``[Lq, Lk]`` int32 matrix of ``j - i`` (key position minus query position)."""
  i = jnp.arange(q_len, dtype=jnp.int32)[:, None] + q_offset
  j = jnp.arange(k_len, dtype=jnp.int32)[None, :]
  return j - i


def offsets(q_len: int, k_len: int) -> Array:
  """``[Lq + Lk - 1]`` int32 offsets ``rel = j - i``, from ``-(Lq - 1)`` to ``Lk - 1``.

  Entry ``o`` is ``rel = o - (Lq - 1)``: the layout of a Toeplitz term's
  per-offset values (:meth:`Toeplitz.offset_values`).
  """
  return jnp.arange(-(q_len - 1), k_len, dtype=jnp.int32)


def skew_offsets(x: Array) -> Array:
  """Per-offset rows -> the ``[Lq, Lk]`` matrix they describe (Music Transformer's skewing).

  Args:
    x: ``[..., Lq, Lq + Lk - 1]``; column ``o`` of row ``i`` holds offset
      ``j - i = o - (Lq - 1)`` (the layout of :func:`offsets`).

  Returns:
    ``[..., Lq, Lk]`` with ``out[..., i, j] = x[..., i, j - i + Lq - 1]``.

  Only pad, reshape and slice, so its autodiff transpose is slice, reshape
  and pad again: no gather, and no scatter in the backward pass.
  """
  *batch, q_len, width = x.shape
  # With one zero appended per row, row i starts i entries later in rows of
  # ``width``; dropping the first Lq - 1 entries then moves its column
  # j - i + Lq - 1 to column j.
  x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, 1)])
  flat = x.reshape(*batch, q_len * (width + 1))[..., q_len - 1:q_len - 1 + q_len * width]
  return flat.reshape(*batch, q_len, width)[..., :width - q_len + 1]


def toeplitz_bias(offset_bias: Array, q_len: int, k_len: int, zero_first: bool = False,
                  q_offset: int | Array = 0) -> Array:
  """``[H|1, Lq + Lk - 1]`` per-offset values -> the ``[1, H|1, Lq, Lk]`` bias they describe.

  Entry ``o`` of ``offset_bias`` holds local offset ``j - i = o - (Lq - 1)``;
  ``zero_first`` zeroes the row of absolute query position 0 (query row
  ``i`` sits at ``i + q_offset``) and key column 0. Built by
  :func:`skew_offsets`, so its gradient is a sum, not a scatter-add.
  """
  shape = offset_bias.shape[:-1] + (q_len, q_len + k_len - 1)
  bias = skew_offsets(jnp.broadcast_to(offset_bias[..., None, :], shape))
  if zero_first:
    rows = jnp.arange(q_len) + q_offset != 0
    bias = bias * (rows[:, None] & (jnp.arange(k_len) != 0)[None, :])
  return bias[None]


def lookup(table: Array, index: Array) -> Array:
  """``table[..., index]`` for a small table, as a one-hot contraction.

  Args:
    table: ``[..., R]``.
    index: int ``[N]`` in ``[0, R)`` (may be traced).

  Returns:
    ``[..., N]``, exactly the table's entries. Its gradient is a matmul,
    where ``jnp.take``'s is a scatter-add with colliding indices.
  """
  one_hot = jax.nn.one_hot(index, table.shape[-1], dtype=table.dtype)
  return jnp.einsum("...r,nr->...n", table, one_hot, precision=lax.Precision.HIGHEST)


def lookup_rows(table: Array, ids: Array, axis: int = 0) -> Array:
  """``jnp.take(table, ids, axis)`` for position ids, as a one-hot contraction.

  Args:
    table: ``[..., M, ...]`` with ``M`` rows along ``axis``.
    ids: int ``[B, L]`` in ``[0, M)`` (may be traced; an id outside it reads a row of
      zeros).

  Returns:
    ``table`` with ``axis`` replaced by ``[B, L]``, exactly the table's rows. Its gradient
    is a matmul, where ``jnp.take``'s is a scatter-add (see :func:`lookup`).
  """
  axis = axis % table.ndim
  one_hot = jax.nn.one_hot(ids, table.shape[axis], dtype=table.dtype)  # [B, L, M]
  rows = jnp.tensordot(one_hot, table, axes=((2,), (axis,)), precision=lax.Precision.HIGHEST)
  return jnp.moveaxis(rows, (0, 1), (axis, axis + 1))  # [B, L, ...] -> the table's layout


def id_offsets(position_ids: Array) -> Array:
  """``[B, Lq, Lk]`` int32 offsets ``position_ids[b, j] - position_ids[b, i]`` of ``[B, L]``
  ids (self-attention): :func:`relative_offsets` for per-token positions."""
  ids = position_ids.astype(jnp.int32)
  return ids[:, None, :] - ids[:, :, None]


def toeplitz_bias_at(offset_values: Array, position_ids: Array, zero_first: bool = False
                     ) -> Array:
  """A Toeplitz term at per-token positions: ``[B, H|1, L, L]`` with entry ``(b, h, i, j)``
  the value of offset ``position_ids[b, j] - position_ids[b, i]``.

  Args:
    offset_values: ``[H|1, 2M - 1]`` values of offsets ``-(M - 1) .. M - 1`` (the layout of
      :func:`offsets` for ``Lq = Lk = M``).
    position_ids: int ``[B, L]`` in ``[0, M)`` (an id outside it gets a bias of 0).
    zero_first: zero the rows and columns of tokens at position 0 (TUPE-R's [CLS] reset).

  Returns:
    ``O T O^T`` with ``T`` the ``[H, M, M]`` Toeplitz matrix (:func:`toeplitz_bias`) and
    ``O`` the ``[B, L, M]`` one-hot positions: exact (one non-zero product per entry) and,
    like :func:`lookup`, free of gathers and scatters in both passes.
  """
  num_positions = (offset_values.shape[-1] + 1) // 2
  table = toeplitz_bias(offset_values, num_positions, num_positions)[0]  # [H, M, M]
  one_hot = jax.nn.one_hot(position_ids, num_positions, dtype=offset_values.dtype)
  bias = jnp.einsum("bia,hac,bjc->bhij", one_hot, table, one_hot,
                    precision=lax.Precision.HIGHEST)
  if zero_first:
    kept = position_ids != 0
    bias = bias * (kept[:, None, :, None] & kept[:, None, None, :])
  return bias


def _ids_problem(position_ids: Array | None, q_shape: Sequence[int],
                 k_shape: Sequence[int]) -> str | None:
  """Per-token positions must be ``[B, L]`` for self-attention over q ``[B, L, ..]``."""
  if position_ids is None:
    return None
  shape = tuple(jnp.shape(position_ids))
  want = (q_shape[0], q_shape[1])
  if shape != want or k_shape[1] != q_shape[1]:
    return (f"position_ids {list(shape)} need self-attention with [B, L] = {list(want)}, "
            f"got {q_shape[1]} queries and {k_shape[1]} keys")
  return None


@struct.dataclass
class Toeplitz(Term):
  """Relative bias ``T[h, i, j] = f(table_h, j - i)``: a function of the offset only.

  DIET-REL (clipped offsets), T5 (buckets), ALiBi (slope times distance) and
  TUPE-R's relative part take this form. ``Lq + Lk - 1`` offsets describe the
  whole term, so the fused route hands the flash kernel that vector
  (:meth:`offset_values`) and never builds ``[H, Lq, Lk]``.

  Attributes:
    table: ``[H|1, R]`` per-head parameters (a layer axis in front inside
      :class:`SchemeTerms`).
    offset_fn: ``(table [..., R], rel int32 [N]) -> [..., N]``, the bias of
      each offset ``rel = j - i``; a hashable callable (static), defined by
      the scheme.
    zero_first: zero row 0 and column 0 (TUPE-R inside the [CLS] reset).
    q_offset: absolute position of query row 0 (int scalar, may be traced);
      None means 0. :meth:`slice_queries` sets it for decoding.
    k_len: number of keys; None means ``Lq``. Set by :func:`posenc_jax.attend`.
    position_ids: optional int ``[B, L]`` per-token positions (packed sequences); the
      offset is then ``position_ids[b, j] - position_ids[b, i]``, and the term is a dense
      per-example bias (:func:`toeplitz_bias_at`), so the flash kernel's in-tile bias
      applies only without ids. ``zero_first`` then zeroes tokens at position 0.
    num_positions: ``M``, with ids in ``[0, M)``; set with ``position_ids``.
  """

  table: Array
  offset_fn: Any = struct.field(pytree_node=False)
  zero_first: bool = struct.field(pytree_node=False, default=False)
  q_offset: Array | int | None = None
  k_len: int | None = struct.field(pytree_node=False, default=None)
  position_ids: Array | None = None
  num_positions: int | None = struct.field(pytree_node=False, default=None)

  def with_key_length(self, k_len):
    return self.replace(k_len=k_len)

  def shape_problem(self, q_shape, k_shape):
    shape = jnp.shape(self.table)  # the term is a function of the offset alone
    return (_rank_problem("table", shape, (2,), "[H|1, R] (SchemeTerms.for_layer drops the "
                          "layer axis)")
            or _axis_problem("table", shape, 0, "heads", q_shape[2], "q has", broadcast=True)
            or _ids_problem(self.position_ids, q_shape, k_shape))

  def slice_queries(self, start, size):
    del size  # the table has no query axis
    if self.position_ids is not None:
      raise NotImplementedError("Toeplitz with position_ids: incremental decoding counts "
                                "positions by step; build the term without ids")
    offset = start if self.q_offset is None else self.q_offset + start
    return self.replace(q_offset=jnp.asarray(offset, jnp.int32))

  def _lengths(self, q: Array) -> tuple[int, int]:
    q_len = q.shape[1]
    return q_len, q_len if self.k_len is None else self.k_len

  def offset_values(self, q_len: int, k_len: int) -> Array:
    """``[H|1, Lq + Lk - 1]``: the bias of local offsets ``-(Lq - 1) .. Lk - 1``."""
    q_offset = 0 if self.q_offset is None else self.q_offset
    return self.offset_fn(self.table, offsets(q_len, k_len) - q_offset)

  def materialise(self, q_len: int, k_len: int) -> Bias:
    """The same term as a ``[1, H|1, Lq, Lk]`` :class:`Bias` (``[B, H|1, L, L]`` with
    ``position_ids``)."""
    if self.position_ids is not None:
      values = self.offset_fn(self.table, offsets(self.num_positions, self.num_positions))
      return Bias(toeplitz_bias_at(values, self.position_ids, self.zero_first))
    q_offset = 0 if self.q_offset is None else self.q_offset
    return Bias(toeplitz_bias(self.offset_values(q_len, k_len), q_len, k_len, self.zero_first,
                              q_offset))

  def logits(self, q, scale):
    return self.materialise(*self._lengths(q)).logits(q, scale)

  def fused_form(self):
    if self.q_offset is not None or self.position_ids is not None:
      return self._form(entry="bias")
    return self._form(entry="toeplitz", table_form="toeplitz", zero_first=self.zero_first)

  def fused(self, q, scale):
    if self.q_offset is not None or self.position_ids is not None:
      # A decoding step (the kernel counts rows from 0) or per-token positions: dense.
      return self.materialise(*self._lengths(q)).fused(q, scale)
    return FusedPart(offset_bias=self.offset_values(*self._lengths(q)),
                     zero_first=self.zero_first)


@struct.dataclass
class QueryRelative(Term):
  """Shaw et al.'s query-dependent term, ``T[b,h,i,j] = c q_i . a^K_{clip(j-i)}``.

  Attributes:
    key_table: ``[2t+1, D]`` (shared by heads) or ``[H, 2t+1, D]``; row
      ``r + t`` holds offset ``r = j - i``.
    value_table: optional table of the same shape; adds
      ``sum_j alpha_ij a^V_{clip(j-i)}`` to the output (reference route only).
    q_offset: position of query row 0 (int scalar, may be traced); None
      means 0. :meth:`slice_queries` sets it, so a decoding step's single
      query sits at its absolute position.
    clip: ``t``, the largest offset with its own row.
    k_len: number of keys; None means ``Lq`` (self-attention over the
      query positions). :func:`posenc_jax.attend` sets it from ``k`` via
      :meth:`with_key_length`.

  Keys sit at positions ``0..Lk-1`` and queries at
  ``q_offset..q_offset+Lq-1`` of the same sequence (self-attention).

  With ``position_ids`` (optional int ``[B, L]``, self-attention; a leading layer axis
  of 1 inside :class:`SchemeTerms`) the offset is ``position_ids[b, j] -
  position_ids[b, i]`` instead, spread by a one-hot contraction ``[B, L, L, 2t+1]``
  (still no gather or scatter) rather than the skew.
  """

  key_table: Array
  value_table: Array | None = None
  q_offset: Array | int | None = None
  clip: int = struct.field(pytree_node=False, default=16)
  k_len: int | None = struct.field(pytree_node=False, default=None)
  position_ids: Array | None = None

  @property
  def fusable(self):
    return self.value_table is None

  def slice_queries(self, start, size):
    del size  # the table has no query axis; the rows are the queries given to logits
    if self.position_ids is not None:
      raise NotImplementedError("QueryRelative with position_ids: incremental decoding "
                                "counts positions by step; build the term without ids")
    offset = start if self.q_offset is None else self.q_offset + start
    return self.replace(q_offset=jnp.asarray(offset, jnp.int32))

  def with_key_length(self, k_len):
    return self.replace(k_len=k_len)

  def shape_problem(self, q_shape, k_shape):
    if not isinstance(self.clip, numbers.Integral) or self.clip < 0:
      return f"clip is {self.clip!r}; expected an integer >= 0"
    _, _, heads, dim = q_shape
    for name, table in (("key_table", self.key_table), ("value_table", self.value_table)):
      if table is None:
        continue
      shape = jnp.shape(table)
      problem = (_rank_problem(name, shape, (2, 3), "[2t+1, D] or [H|1, 2t+1, D]")
                 or _axis_problem(name, shape, -2, "rows", 2 * self.clip + 1,
                                  f"clip={self.clip} needs 2 clip + 1 =")
                 or _axis_problem(name, shape, -1, "features", dim, "q has")
                 or (len(shape) == 3 and _axis_problem(name, shape, 0, "heads", heads, "q has",
                                                       broadcast=True)))
      if problem:
        return problem
    return _ids_problem(self.position_ids, q_shape, k_shape)

  def _k_len(self, q_len: int) -> int:
    return q_len if self.k_len is None else self.k_len

  @staticmethod
  def _per_head(table: Array, heads: int) -> Array:
    return table if table.ndim == 3 else jnp.broadcast_to(table, (heads,) + table.shape)

  def _spread(self, per_offset: Array, k_len: int) -> Array:
    """``[B, H, Lq, 2t+1]`` values per clipped offset -> ``[B, H, Lq, Lk]``.

    Entry ``(i, j)`` is column ``clip(j - i - q_offset) + t``. Linear, and
    built from slices, broadcasts, a concatenation and :func:`skew_offsets`,
    so neither it nor its transpose (:meth:`value_output`) gathers or scatters.
    """
    if self.position_ids is not None:  # per-token positions: a one-hot of clip(j - i) + t
      columns = jnp.clip(id_offsets(self.position_ids), -self.clip, self.clip) + self.clip
      one_hot = jax.nn.one_hot(columns, 2 * self.clip + 1, dtype=per_offset.dtype)
      return jnp.einsum("bhir,bijr->bhij", per_offset, one_hot,
                        precision=lax.Precision.HIGHEST)
    q_len = per_offset.shape[-2]
    width = q_len + k_len - 1
    q_offset = 0 if self.q_offset is None else self.q_offset
    if isinstance(q_offset, int):
      full = _clipped_columns(per_offset, self.clip, -(q_len - 1) - q_offset, width)
    else:  # traced (decoding): the columns of every shift, then the shift
      wide = _clipped_columns(per_offset, self.clip, -(self.clip + width),
                              2 * (self.clip + width) + 1)
      # Shifts past either end take the saturated columns only: clamping keeps it exact.
      start = jnp.clip(width + self.clip - (q_len - 1) - q_offset, 0, 2 * self.clip + 1 + width)
      full = lax.dynamic_slice_in_dim(wide, start, width, axis=-1)
    return skew_offsets(full)

  def logits(self, q, scale):
    heads = q.shape[2]
    table = self._per_head(self.key_table, heads).astype(q.dtype)
    # q . a_r for every offset r, then spread to r = clip(j - i) per (i, j).
    per_offset = jnp.einsum("bihd,hrd->bhir", q, table) * scale
    return self._spread(per_offset, self._k_len(q.shape[1]))

  def fused_form(self):
    return self._form(entry="bias")

  def fused(self, q, scale):
    if not self.fusable:
      raise ValueError("QueryRelative with a value_table has no fused route; "
                       "use route='reference'")
    return FusedPart(bias=self.logits(q, scale))

  def value_output(self, probs):
    if self.value_table is None:
      return None
    b, heads, q_len, k_len = probs.shape
    # The attention weights summed per clipped offset: the transpose of the spreading.
    per_offset = jax.ShapeDtypeStruct((b, heads, q_len, 2 * self.clip + 1), probs.dtype)
    spread_t = jax.linear_transpose(lambda x: self._spread(x, k_len), per_offset)
    (weights,) = spread_t(probs)
    table = self._per_head(self.value_table, heads).astype(probs.dtype)
    return jnp.einsum("bhir,hrd->bihd", weights, table)


def _clipped_columns(x: Array, clip: int, first: int, width: int) -> Array:
  """``[..., 2t+1]`` values of offsets ``-t..t`` -> ``[..., width]`` of offsets
  ``first..first + width - 1``, clipped to ``[-t, t]`` (static ``first``).

  Offsets below ``-t`` repeat column 0 and offsets above ``t`` column ``2t``:
  a broadcast, the slice of the columns in range, a broadcast.
  """
  below = min(max(-clip - first, 0), width)
  above = min(max(first + width - 1 - clip, 0), width)
  start = max(first, -clip) + clip
  parts = [jnp.broadcast_to(x[..., :1], x.shape[:-1] + (below,)),
           x[..., start:start + width - below - above],
           jnp.broadcast_to(x[..., -1:], x.shape[:-1] + (above,))]
  return jnp.concatenate([p for p in parts if p.shape[-1]], axis=-1)


def contextual_positions(gates: Array, q_offset: int | Array = 0) -> Array:
  """CoPE's positions ``p_ij = sum_{t=j..i} g_it`` (Golovneva et al. 2024, eq. 4).

  Args:
    gates: ``[..., Lq, Lk]`` gate values ``g_it`` in ``[0, 1]``.
    q_offset: key index of query row 0 (queries at ``q_offset .. q_offset + Lq - 1``, keys
      at ``0 .. Lk - 1``); may be traced.

  Returns:
    ``[..., Lq, Lk]`` in float32 at least (a bfloat16 sum would lose whole counts past 256):
    the gates of keys ``j .. i`` summed (a reverse cumulative sum over the keys, gates after
    the query dropped), 0 for keys after the query.
  """
  i = jnp.arange(gates.shape[-2])[:, None] + q_offset
  t = jnp.arange(gates.shape[-1])[None, :]
  gates = jnp.where(t <= i, gates.astype(jnp.promote_types(gates.dtype, jnp.float32)), 0.0)
  return jnp.flip(jnp.cumsum(jnp.flip(gates, -1), axis=-1), -1)


@struct.dataclass
class ContextualPositions(Term):
  """CoPE (Golovneva et al. 2024, section 3): a position counted from the content.

  With gates ``g_it = sigmoid(c q_i . k_t)`` (``c`` the content scale), positions
  ``p_ij = sum_{t=j..i} g_it`` (:func:`contextual_positions`) clipped at ``npos - 1``, and
  ``f = p - floor(p)``,

      T[b, h, i, j] = (1 - f) q_i . e[floor(p)] + f q_i . e[floor(p) + 1].

  Causal: keys after the query (``j > i``, which the causal mask removes) get ``p = 0``.
  Dense and data-dependent (it reads q and k): a ``[B, H, Lq, Lk]`` bias on either route.

  Attributes:
    table: ``e``, ``[npos, D]``, shared by the heads (a layer axis in front inside
      :class:`SchemeTerms`).
    q_offset: key index of query row 0 (int scalar, may be traced); None means 0.
      :meth:`slice_queries` sets it, so a decoding step counts the gates of the keys up to
      its own position only.
    keys: ``[B, Lk, H, D]``, set by :func:`posenc_jax.attend` through :meth:`with_keys`.
  """

  table: Array
  q_offset: Array | int | None = None
  keys: Array | None = None

  def with_keys(self, k):
    return self.replace(keys=k)

  def slice_queries(self, start, size):
    del size  # the table has no query axis; the rows are the queries given to logits
    offset = start if self.q_offset is None else self.q_offset + start
    return self.replace(q_offset=jnp.asarray(offset, jnp.int32))

  def shape_problem(self, q_shape, k_shape):
    shape = jnp.shape(self.table)
    return (_rank_problem("table", shape, (2,), "[npos, D] (SchemeTerms.for_layer drops the "
                          "layer axis)")
            or _axis_problem("table", shape, -1, "features", q_shape[3], "q has"))

  def logits(self, q, scale):
    if self.keys is None:
      raise ValueError("ContextualPositions: keys are unset; attend sets them (with_keys(k))")
    dot = functools.partial(jnp.einsum, precision=lax.Precision.HIGHEST,
                            preferred_element_type=jnp.promote_types(q.dtype, jnp.float32))
    gates = jax.nn.sigmoid(dot("bihd,bjhd->bhij", q, self.keys) * scale)
    q_offset = 0 if self.q_offset is None else self.q_offset
    last = self.table.shape[0] - 1
    positions = jnp.minimum(contextual_positions(gates, q_offset), last)
    floor = jnp.floor(positions)
    frac = positions - floor  # the gradient to the gates flows through f
    per_row = dot("bihd,rd->bhir", q, self.table)  # q_i . e[r] for every row r
    lower = floor.astype(jnp.int32)
    at = lambda rows: jnp.take_along_axis(per_row, rows, axis=-1)  # noqa: E731
    # At p = npos - 1, f = 0: the upper row is clipped too and weighs nothing.
    return (1 - frac) * at(lower) + frac * at(jnp.minimum(lower + 1, last))

  def fused_form(self):
    return self._form(entry="bias")

  def fused(self, q, scale):
    return FusedPart(bias=self.logits(q, scale))


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
    problem = (_rank_problem("weight", weight, (2,), "[d, H] (SchemeTerms.for_layer drops the "
                             "layer axis)")
               or _axis_problem("weight", weight, 1, "heads", heads, "q has")
               or _rank_problem("bias", bias, (1,), "[H]")
               or _axis_problem("bias", bias, 0, "heads", heads, "q has"))
    if problem or self.log_gates is None:
      return problem
    gates = jnp.shape(self.log_gates)
    problem = (_rank_problem("log_gates", gates, (3,), "[B, Lk, H]")
               or _axis_problem("log_gates", gates, 0, "examples", batch, "q has")
               or _axis_problem("log_gates", gates, 1, "keys", k_shape[1], "k has")
               or _axis_problem("log_gates", gates, 2, "heads", heads, "q has"))
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

  def fused_form(self):
    return self._form(entry="separable")

  def fused(self, q, scale):
    del scale
    rows, cols = self.vectors(q.shape[1])
    return FusedPart(row=rows, col=cols)


def rotate_pairs(x: Array, angles: Array, layout: str = "interleaved",
                 attention_factor: float = 1.0, scale: Array | None = None) -> Array:
  """Rotates pairs among the first ``R = 2 * angles.shape[-1]`` features of ``x``.

  Pair ``k`` turns by ``angles[..., k]``; features ``R..D-1`` pass through
  unchanged (partial rotary, as in GPT-NeoX and GPT-J). The two layouts of
  the pairs, equal up to a permutation of the first ``R`` features:

  * ``"interleaved"``: ``(x_{2k}, x_{2k+1})`` (Su et al.'s RoFormer, GPT-J).
  * ``"half"``: ``(x_k, x_{k+R/2})``, "rotate half" (GPT-NeoX, Llama, Hugging Face).

  Args:
    x: ``[B, L, H, D]``.
    angles: ``[L, R/2]`` with ``R <= D``, or ``[B, L, R/2]`` (per-token positions).
    layout: ``"interleaved"`` or ``"half"``.
    attention_factor: multiplies cos and sin, so the rotated features are scaled by it
      (YaRN's attention factor; the pass-through features are not, as in Hugging Face).
    scale: optional ``[L, R/2]`` or ``[B, L, R/2]``, multiplies both features of pair ``k``
      at each position (xPos); None: 1. Multiplied into cos and sin in their float32
      before the cast to ``x``'s dtype.

  Returns:
    ``[B, L, H, D]``.
  """
  width = 2 * angles.shape[-1]
  angles = angles[..., None, :]  # [B|.., L, 1 (heads), R/2]
  factor = attention_factor if scale is None else attention_factor * scale[..., None, :]
  cos = (factor * jnp.cos(angles)).astype(x.dtype)
  sin = (factor * jnp.sin(angles)).astype(x.dtype)
  # Pair k as [.., R/2, 2] (interleaved) or [.., 2, R/2] (half), its two members on `axis`.
  axis, pairs = (-2, (2, width // 2)) if layout == "half" else (-1, (width // 2, 2))
  rotated, rest = x[..., :width], x[..., width:]
  paired = rotated.reshape(x.shape[:-1] + pairs)
  first, second = (lax.index_in_dim(paired, i, axis, keepdims=False) for i in (0, 1))
  rotated = jnp.stack([first * cos - second * sin, first * sin + second * cos], axis=axis)
  return jnp.concatenate([rotated.reshape(x.shape[:-1] + (width,)), rest], axis=-1)


@struct.dataclass
class Rotation(Term):
  """RoPE: q and k rotated by their positions' angles (:func:`rotate_pairs`); with
  ``q_scale`` and ``k_scale``, xPos: each pair also scaled by its position's factor.

  Attributes:
    q_angles: ``[Lq, R/2]``, ``i * theta_k`` for query position ``i``; the first
      ``R <= D`` features of each head are rotated, the rest pass through. ``[B, Lq, R/2]``
      for per-token positions (packed sequences).
    k_angles: ``[Lk, R/2]`` or ``[B, Lk, R/2]``.
    layout: ``"interleaved"`` (pairs ``(2k, 2k+1)``, Su et al.) or ``"half"``
      (pairs ``(k, k + R/2)``, GPT-NeoX).
    attention_factor: multiplies cos and sin, i.e. scales the rotated features of q and
      of k (YaRN's attention temperature: their logits scale by its square).
    q_scale: optional ``[Lq, R/2]`` or ``[B, Lq, R/2]`` (the layout of ``q_angles``), the
      factor of both features of pair ``k`` at each query position (xPos's
      ``zeta_k^(n / gamma)``, :mod:`posenc_jax.schemes.xpos`); None: 1.
    k_scale: optional ``[Lk, R/2]`` or ``[B, Lk, R/2]``, the same for the keys.
  """

  q_angles: Array
  k_angles: Array
  layout: str = struct.field(pytree_node=False, default="interleaved")
  attention_factor: float = struct.field(pytree_node=False, default=1.0)
  q_scale: Array | None = None
  k_scale: Array | None = None

  def shape_problem(self, q_shape, k_shape):
    dim = q_shape[3]
    if dim % 2:
      return f"rotates pairs of features, but q has an odd head dim {dim}"
    if self.layout not in ("interleaved", "half"):
      return f"layout is {self.layout!r}; expected 'interleaved' or 'half'"
    for name, angles, length, source in (("q_angles", self.q_angles, q_shape[1], "q has"),
                                         ("k_angles", self.k_angles, k_shape[1], "k has")):
      shape = jnp.shape(angles)
      problem = (_rank_problem(name, shape, (2, 3), "[L, R/2] or [B|1, L, R/2]")
                 or _axis_problem(name, shape, -2, "positions", length, source)
                 or (len(shape) == 3 and _axis_problem(name, shape, 0, "examples", q_shape[0],
                                                       "q has", broadcast=True)))
      if problem:
        return problem
    q_angles, k_angles = jnp.shape(self.q_angles), jnp.shape(self.k_angles)
    if q_angles[-1] > dim // 2:
      return (f"q_angles {list(q_angles)} has {q_angles[-1]} angles, but q's head dim {dim} has "
              f"only {dim // 2} pairs")
    return (_axis_problem("k_angles", k_angles, -1, "angles", q_angles[-1], "q_angles has")
            or self._scale_problem(q_shape, k_shape))

  def _scale_problem(self, q_shape, k_shape) -> str | None:
    """Why ``q_scale`` or ``k_scale`` does not fit the angles' positions and pairs, or None."""
    pairs = jnp.shape(self.q_angles)[-1]
    for name, scale, length, source in (("q_scale", self.q_scale, q_shape[1], "q has"),
                                        ("k_scale", self.k_scale, k_shape[1], "k has")):
      if scale is None:
        continue
      shape = jnp.shape(scale)
      problem = (_rank_problem(name, shape, (2, 3), "[L, R/2] or [B|1, L, R/2]")
                 or _axis_problem(name, shape, -2, "positions", length, source)
                 or _axis_problem(name, shape, -1, "pairs", pairs, "q_angles has")
                 or (len(shape) == 3 and _axis_problem(name, shape, 0, "examples", q_shape[0],
                                                       "q has", broadcast=True)))
      if problem:
        return problem
    return None

  def transform_qk(self, q, k):
    return (rotate_pairs(q, self.q_angles, self.layout, self.attention_factor, self.q_scale),
            rotate_pairs(k, self.k_angles, self.layout, self.attention_factor, self.k_scale))

  def slice_queries(self, start, size):
    q_scale = None if self.q_scale is None else slice_rows(self.q_scale, start, size, -2)
    return self.replace(q_angles=slice_rows(self.q_angles, start, size, -2), q_scale=q_scale)


@struct.dataclass
class QKShift(Term):
  """Adds position projections to q and k: ``q_i + a_i``, ``k_j + b_j``.

  ``(q_i + a_i) . (k_j + b_j)`` is the sum of the four word/position terms
  of TUPE's BERT-A^d ablation.

  Attributes:
    q_shift: ``[Lq, H, D]``, or ``[B, Lq, H, D]`` (per-token positions).
    k_shift: ``[Lk, H, D]``, or ``[B, Lk, H, D]``.
  """

  q_shift: Array
  k_shift: Array

  def shape_problem(self, q_shape, k_shape):
    for name, shift, want, source in (("q_shift", self.q_shift, q_shape, "q"),
                                      ("k_shift", self.k_shift, k_shape, "k")):
      shape = tuple(jnp.shape(shift))
      if shape != tuple(want[1:]) and not (len(shape) == 4 and shape[1:] == tuple(want[1:])
                                           and shape[0] in (1, want[0])):
        return (f"{name} is {list(shape)}; expected [L, H, D] = {list(want[1:])} "
                f"(or [B|1, L, H, D]) from {source}")
    return None

  def transform_qk(self, q, k):
    return q + self.q_shift.astype(q.dtype), k + self.k_shift.astype(k.dtype)

  def slice_queries(self, start, size):
    return self.replace(q_shift=slice_rows(self.q_shift, start, size, -3))


@struct.dataclass
class InputEmbedding:
  """Input-level term added to the token embeddings before the first layer.

  Attributes:
    value: ``[L, d]`` (batch-free) or ``[B, L, d]``.
  """

  value: Array

  def slice_queries(self, start: int | Array, size: int) -> InputEmbedding:
    """Positions ``[start, start + size)`` (a decoding step's input row)."""
    return self.replace(value=slice_rows(self.value, start, size, -2))


def _is_shared(x: Array) -> bool:
  """A term leaf shared by all layers: a scalar (QueryRelative.q_offset) or a leading
  layer axis of 1."""
  return jnp.ndim(x) == 0 or x.shape[0] == 1


def _shared(x: Array) -> Array:
  """A shared leaf's value for one layer (its layer axis of 1 dropped); None stays None."""
  return x if x is None or jnp.ndim(x) == 0 else x[0]


def layer_terms(per_layer: tuple[Any, ...], shared: tuple[Any, ...]) -> list[Term]:
  """One layer's terms inside a scan from :meth:`SchemeTerms.split_layers`'s halves:
  ``per_layer`` already sliced to the layer, ``shared`` as split."""
  return list(jax.tree.map(lambda own, common: _shared(common) if own is None else own,
                           per_layer, shared, is_leaf=lambda x: x is None))


@struct.dataclass
class SchemeTerms:
  """Everything one scheme contributes to a forward pass.

  Attributes:
    embedding: optional :class:`InputEmbedding`.
    terms: attention terms; every array leaf carries a leading layer axis of
      size ``num_layers`` (one value per layer) or 1 (one value shared by all
      layers, computed once per forward pass).
    content_scale: the scale ``c`` of ``q . k`` the scheme asks for, or None
      for the usual ``1 / sqrt(D)``.
  """

  embedding: InputEmbedding | None = None
  terms: tuple[Any, ...] = ()
  content_scale: float | None = struct.field(pytree_node=False, default=None)

  def num_layers(self) -> int:
    """The leading layer axis of the per-layer terms (1 when every term is shared)."""
    return max((jnp.shape(x)[0] for x in jax.tree.leaves(self.terms) if jnp.ndim(x)),
               default=1)

  def for_layer(self, layer: int) -> list[Term]:
    """The terms of layer ``layer`` (shared terms are reused, not recomputed).

    Raises a one-line ValueError unless ``layer`` is an integer ``>= 0`` and, when a term
    has one value per layer, below their number (shared terms fit any layer).
    """
    layers = self.num_layers()
    if not isinstance(layer, numbers.Integral) or layer < 0 or (layers > 1 and layer >= layers):
      allowed = f"an integer in [0, {layers})" if layers > 1 else "an integer >= 0"
      raise ValueError(f"SchemeTerms.for_layer: got layer {layer!r}; allowed: {allowed}")
    return [jax.tree.map(lambda x: _shared(x) if _is_shared(x) else x[layer], t)
            for t in self.terms]

  def split_layers(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """``(per_layer, shared)`` for a scan over the layers (``nn.scan``).

    Both have the structure of ``terms``: ``per_layer`` holds the leaves with one value
    per layer (leading axis ``num_layers()``, scanned over) and None for the rest;
    ``shared`` the leaves shared by all layers (leading axis 1, or scalars; broadcast
    once) and None for the rest. :func:`layer_terms` joins one layer's slice back.
    """
    per_layer = jax.tree.map(lambda x: None if _is_shared(x) else x, self.terms)
    shared = jax.tree.map(lambda x: x if _is_shared(x) else None, self.terms)
    return per_layer, shared

  def slice_queries(self, start: int | Array, size: int) -> SchemeTerms:
    """Every term (and the input embedding) restricted to query rows ``[start, start + size)``.

    Used by incremental decoding: the terms are built once for the whole
    decode length, so a step's query keeps its absolute position and the
    keys keep theirs.
    """
    embedding = None if self.embedding is None else self.embedding.slice_queries(start, size)
    terms = tuple(t.slice_queries(start, size) for t in self.terms)
    return self.replace(embedding=embedding, terms=terms)

  def embed(self, x: Array) -> Array:
    """Adds the input-level term (if any) to embeddings ``x`` ``[B, L, d]``.

    The embedding's value is ``[L, d]`` or ``[B|1, L, d]``; other shapes raise one
    ValueError line.
    """
    if self.embedding is None:
      return x
    value = self.embedding.value
    if (jnp.ndim(x) != 3 or jnp.ndim(value) not in (2, 3) or value.shape[-2:] != x.shape[1:]
        or (value.ndim == 3 and value.shape[0] not in (1, x.shape[0]))):
      raise ValueError(f"SchemeTerms.embed: embedding.value is {list(jnp.shape(value))}, but x "
                       f"is {list(jnp.shape(x))}; expected [L, d] or [B|1, L, d] for x [B, L, d]")
    return x + value.astype(x.dtype)

  def __add__(self, other: SchemeTerms) -> SchemeTerms:
    """Composes two schemes' terms (e.g. a position and a segment scheme)."""
    scales = {s for s in (self.content_scale, other.content_scale) if s is not None}
    if len(scales) > 1:
      raise ValueError(f"content_scale: schemes ask for different content scales {sorted(scales)}")
    if self.embedding is None or other.embedding is None:
      embedding = self.embedding or other.embedding
    else:
      embedding = InputEmbedding(self.embedding.value + other.embedding.value)
    return SchemeTerms(embedding, self.terms + other.terms, scales.pop() if scales else None)

