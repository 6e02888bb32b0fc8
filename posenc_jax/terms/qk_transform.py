"""The q/k-transform form: terms that rewrite q and k ``[B, L, H, D]`` before anything else,
:class:`Rotation` (RoPE, and xPos with its scales; :func:`rotate_pairs`) and :class:`QKShift`
(TUPE's BERT-A^d: position projections added to q and k). Nothing is left for the fused route
to add."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from posenc_jax.terms.protocol import Term, axis_problem, rank_problem, slice_rows

Array = jax.Array


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
      problem = (rank_problem(name, shape, (2, 3), "[L, R/2] or [B|1, L, R/2]")
                 or axis_problem(name, shape, -2, "positions", length, source)
                 or (len(shape) == 3 and axis_problem(name, shape, 0, "examples", q_shape[0],
                                                       "q has", broadcast=True)))
      if problem:
        return problem
    q_angles, k_angles = jnp.shape(self.q_angles), jnp.shape(self.k_angles)
    if q_angles[-1] > dim // 2:
      return (f"q_angles {list(q_angles)} has {q_angles[-1]} angles, but q's head dim {dim} has "
              f"only {dim // 2} pairs")
    return (axis_problem("k_angles", k_angles, -1, "angles", q_angles[-1], "q_angles has")
            or self._scale_problem(q_shape, k_shape))

  def _scale_problem(self, q_shape, k_shape) -> str | None:
    """Why ``q_scale`` or ``k_scale`` does not fit the angles' positions and pairs, or None."""
    pairs = jnp.shape(self.q_angles)[-1]
    for name, scale, length, source in (("q_scale", self.q_scale, q_shape[1], "q has"),
                                        ("k_scale", self.k_scale, k_shape[1], "k has")):
      if scale is None:
        continue
      shape = jnp.shape(scale)
      problem = (rank_problem(name, shape, (2, 3), "[L, R/2] or [B|1, L, R/2]")
                 or axis_problem(name, shape, -2, "positions", length, source)
                 or axis_problem(name, shape, -1, "pairs", pairs, "q_angles has")
                 or (len(shape) == 3 and axis_problem(name, shape, 0, "examples", q_shape[0],
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
