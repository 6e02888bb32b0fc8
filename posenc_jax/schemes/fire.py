"""FIRE (Li et al., ICLR 2024): a learned function of the progressively interpolated distance.

Section 3 of "Functional Interpolation for Relative Positions Improves Long Context
Transformers" (arXiv 2310.04418) gives, for a query at position ``i`` and a key at ``j <= i``,

    b(i, j) = f_theta( psi(i - j) / psi(max(L, i)) ),   psi(x) = log(c x + 1),

with ``f_theta`` an MLP from a scalar to one value per head, and ``c > 0`` and the threshold
``L`` learnt. The paper's PyTorch listing (Appendix; reproduced in mcleish7/arithmetic,
``cramming/architectures/embeddings.py``, class ``FIRE``) fixes what the formula leaves open:
positions count from 0, ``psi`` reads ``log(|c x| + 1)``, the denominator gets ``+ eps``
(``1e-6``), ``L = |L_multiplier * init_L|`` with ``init_L`` fixed (512) and the multiplier
learnt from 1, ``c`` starts at 0.1, and ``f_theta`` is ``Linear(1, 32), ReLU, Linear(32, H)``
with PyTorch's default initialisation. ``docs/schemes/fire.md`` states the sources.

The normaliser reads the query position ``i``, so the bias is not Toeplitz (it is, for
``i < L``): a dense batch-free :class:`~posenc_jax.terms.Bias` ``[H, Lq, Lk]`` (``[B, H, L, L]``
with per-token positions), which the fused route hands to the attention kernel as a bias.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from posenc_jax.schemes.base import (BOOL, POSITIVE_FLOAT, POSITIVE_INT, GridBytes, Scheme,
                                   one_of, shared_sizes)
from posenc_jax.terms import Bias, SchemeTerms

Array = jax.Array

# Sharing modes FIRE takes: an MLP per layer (the listing's one module per attention layer), or
# one for all layers. ``head`` has no meaning: the MLP's output already is one value per head.
FIRE_SHARING = ("none", "layer")


def interpolated_distance(rel: Array, query: Array, c: Array, threshold: Array, eps: float,
                          causal: bool) -> Array:
  """FIRE's MLP input: ``psi(i - j) / (psi(max(L, i)) + eps)``, ``psi(x) = log(|c x| + 1)``.

  Args:
    rel: ``[..., Lq, Lk]`` float ``i - j`` (query position minus key position).
    query: ``[..., Lq, 1]`` float query positions ``i``.
    c, threshold: ``c`` and ``L``, broadcasting against ``rel`` (one per layer).
    eps: added to the normaliser (the listing's ``1e-6``).
    causal: the paper's form, whose ``|i - j|`` also fills ``j > i`` (keys the causal mask
      removes); else ``sign(i - j) psi(i - j)``, the bidirectional extension of FAT5
      (catie-aq/flashT5, ``src/utils/positional_encoding.py``), so later keys get the negated
      input of earlier ones at the same distance.

  Returns:
    ``rel``'s shape broadcast with the parameters': in ``[0, 1]`` for ``0 <= j <= i``.
  """
  distance = jnp.log(jnp.abs(c * rel) + 1)
  if not causal:
    distance = jnp.sign(rel) * distance
  return distance / (jnp.log(jnp.abs(c * jnp.maximum(query, threshold)) + 1) + eps)


def torch_linear_init(fan_in: int):
  """PyTorch's default ``nn.Linear`` initialisation of weights and biases, ``U(-1/sqrt(fan_in),
  1/sqrt(fan_in))``: what the paper's listing gets."""
  bound = fan_in ** -0.5

  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, -bound, bound)

  return init


class Fire(Scheme):
  """``T[h, i, j] = f_theta(psi(i - j) / psi(max(L, i)))_h`` (Li et al., section 3).

  Parameters, each with a leading layer axis (``num_layers``, or 1 when shared):
  ``hidden_kernel``, ``hidden_bias`` ``[layers, W]`` and ``output_kernel`` ``[layers, W, H]``,
  ``output_bias`` ``[layers, H]`` (the MLP ``R -> R^W -> R^H``, ReLU between), ``c`` and
  ``L_multiplier`` ``[layers]`` (``L = |L_multiplier * init_L|``).

  Attributes:
    mlp_width: W, the MLP's hidden width (the listing's 32).
    init_c: ``c`` at initialisation (0.1).
    init_L: the fixed scale of the threshold, ``L`` at initialisation (512).
    eps: added to the normaliser (1e-6).
    causal: the paper's (decoder) form; False: FAT5's signed extension for bidirectional
      attention (:func:`interpolated_distance`). Decoders get ``causal=True``.
    sharing: ``none`` (an MLP, ``c`` and ``L`` per layer) or ``layer`` (one set for all).
  """

  mlp_width: int = 32
  init_c: float = 0.1
  init_L: float = 512.0
  eps: float = 1e-6
  causal: bool = False
  sharing: str = "none"

  scheme_name = "fire"
  hyperparameters = {"mlp_width": POSITIVE_INT, "init_c": POSITIVE_FLOAT,
                     "init_L": POSITIVE_FLOAT, "eps": POSITIVE_FLOAT, "causal": BOOL,
                     "sharing": one_of(*FIRE_SHARING)}
  causal_fields = {"causal": True}

  @classmethod
  def grid_bytes(cls, values, dims):
    """The MLP runs before the layers over every query-key pair, once per layer (once in all
    when shared): its hidden layer ``[layers, .., L, L, W]`` in float32, four of it through a
    train step (the pre-activation and activation that the backward reads, and their
    gradients: measured against XLA's plan of the compiled step on CPU), one in a forward
    pass."""
    layers, _ = shared_sizes(values["sharing"], dims["num_layers"], dims["num_heads"])
    hidden = layers * 4 * values["mlp_width"]
    return GridBytes(batch_free=4 * hidden, batch_free_forward=hidden)

  @nn.compact
  def __call__(self, length, segment_ids=None, position_ids=None):
    self.check_length(length)  # no table: any length
    ids = self.check_position_ids(length, position_ids)
    if ids is None:
      positions = jnp.arange(length, dtype=jnp.float32)  # [L]
    else:
      positions = ids.astype(jnp.float32)  # [B, L]
    query = positions[..., :, None]  # [.., L, 1]
    rel = query - positions[..., None, :]  # [.., L, L]: i - j

    layers, heads = self.sharing_dims(self.sharing)
    width = self.mlp_width
    hidden_init, output_init = torch_linear_init(1), torch_linear_init(width)
    w1 = self.logical_param("hidden_kernel", hidden_init, (layers, width), ("layers", "fire_mlp"))
    b1 = self.logical_param("hidden_bias", hidden_init, (layers, width), ("layers", "fire_mlp"))
    w2 = self.logical_param("output_kernel", output_init, (layers, width, heads),
                            ("layers", "fire_mlp", "heads"))
    b2 = self.logical_param("output_bias", output_init, (layers, heads), ("layers", "heads"))
    c = self.logical_param("c", nn.initializers.constant(self.init_c), (layers,), ("layers",))
    multiplier = self.logical_param("L_multiplier", nn.initializers.ones, (layers,), ("layers",))

    per_layer = (layers,) + (1,) * rel.ndim  # a layer's scalar against [.., L, L]
    x = interpolated_distance(rel, query, c.reshape(per_layer),
                              jnp.abs(multiplier * self.init_L).reshape(per_layer), self.eps,
                              self.causal)  # [layers, .., L, L]
    grid = x.ndim - 1
    hidden = jax.nn.relu(x[..., None] * w1.reshape(per_layer + (width,))
                         + b1.reshape(per_layer + (width,)))  # [layers, .., L, L, W]
    out = jnp.einsum("l...w,lwh->l...h", hidden, w2, precision=lax.Precision.HIGHEST)
    out = out + b2.reshape((layers,) + (1,) * grid + (heads,))
    # [layers, .., L, L, H] -> [layers, .., H, L, L]
    return SchemeTerms(terms=(Bias(jnp.moveaxis(out, -1, -3)),))
