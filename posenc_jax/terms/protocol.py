"""The protocol every attention term implements (:mod:`posenc_jax.terms` lists its parts).

:class:`Term` is the base (identity in every part); :class:`FusedPart` holds what a term gives
the fused route (a ``[B|1, H|1, Lq, Lk]`` bias, ``[B|1, L, H, r]`` columns for q and k, a
``[H|1, Lq + Lk - 1]`` offset vector, ``[B|1, H|1, L]`` row and column vectors) and
:class:`TermForm` how it enters, from static attributes alone. The ``*_problem`` helpers are
the shape checks the forms share (one clause naming the array and both sizes, or None), and
:func:`slice_rows` takes query rows of an array (incremental decoding).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
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
    offset_fn, offset_params: a closed-form Toeplitz term's function and ``[H|1, R]``
      parameters (``offset_bias == offset_fn(offset_params, offsets)``), which the kernel
      evaluates in its tiles instead of reading ``offset_bias``; else None.
    row, col: ``[B|1, H|1, Lq]`` and ``[B|1, H|1, Lk]`` float32, a separable term
      ``r_i + s_j`` that the flash kernel adds to each tile in float32.
  """

  bias: Array | None = None
  q_extra: Array | None = None
  k_extra: Array | None = None
  offset_bias: Array | None = None
  zero_first: bool = False
  offset_fn: Any = None
  offset_params: Array | None = None
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
    closed: the name of a Toeplitz term's closed form (``alibi``, ``kerple_log``...), where
      its offset function is a closed form of the offset and a few parameters per head (it
      has a ``closed`` method and names it ``closed_form``: ALiBi, KERPLE) that the kernel
      can evaluate in its tiles (:class:`FusedPart`'s ``offset_fn``); else None.
    causal_separable: under a causal mask the term is ``r_i + s_j`` on every key it keeps
      (causal ALiBi, the forget gates): a row constant drops out of the softmax, so
      :meth:`Term.key_vector`'s ``s`` alone can be folded into q/k channels
      (:mod:`posenc_jax.terms.channels`).
  """

  name: str
  fusable: bool = True
  entry: str = "none"
  table_form: str | None = None
  rank: int = 0
  zero_first: bool = False
  closed: str | None = None
  causal_separable: bool = False


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

  def key_vector(self, k_len: int) -> Array:
    """``s`` ``[B|1, H|1, Lk]`` float32 of a term whose form is ``causal_separable``: the term
    equals ``r_i + s_j`` wherever ``j <= i``."""
    raise NotImplementedError(f"{type(self).__name__} is not separable under a causal mask")

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


def axis_problem(name: str, shape: Sequence[int], axis: int, noun: str, want: int,
                  source: str, broadcast: bool = False) -> str | None:
  """``"<name> [..] has <n> <noun>, but <source> <want>"`` when axis ``axis`` of ``shape`` is
  not ``want`` (nor 1, with ``broadcast``), else None."""
  got = shape[axis]
  if got == want or (broadcast and got == 1):
    return None
  return f"{name} {list(shape)} has {got} {noun}, but {source} {want}"


def rank_problem(name: str, shape: Sequence[int], ranks: Sequence[int],
                  layout: str) -> str | None:
  """``"<name> is [..]; expected <layout>"`` unless ``shape`` has one of ``ranks`` axes."""
  return None if len(shape) in ranks else f"{name} is {list(shape)}; expected {layout}"


def batch_problem(name: str, shape: Sequence[int], batch: int) -> str | None:
  """A 4-D ``[B|1, ...]`` array whose leading axis is neither q's batch nor 1."""
  if len(shape) < 4:
    return None
  return axis_problem(name, shape, 0, "examples", batch, "q has", broadcast=True)


def ids_problem(position_ids: Array | None, q_shape: Sequence[int],
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
