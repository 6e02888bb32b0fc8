"""KERPLE (Chi et al., NeurIPS 2022): a learned kernel of the distance per head.

The paper's two practical variants of its conditionally positive definite kernels of
``|i - j|`` (its power and logarithmic KERPLE), each with two learned scalars per head,
``r1, r2 > 0``:

* logarithmic: ``b(i, j) = -r1 log(1 + r2 |i - j|)``;
* power: ``b(i, j) = -r1 |i - j|^r2`` with ``r2 <= 2`` (ALiBi is ``r2 = 1``).

The bias is a function of ``i - j`` alone, so it is a :class:`~posenc_jax.terms.Toeplitz`
term: the fused route hands the flash kernel its ``[H, Lq + Lk - 1]`` offset vector, and
the gradient to ``r1, r2`` flows through that vector.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from posenc_jax.schemes.base import SHARING, Scheme, one_of
from posenc_jax.terms import SchemeTerms, Toeplitz

Array = jax.Array

FORMS = ("log", "power")
# The reference code's bounds: ``r1, r2 >= EPS``, and ``r2 <= POWER_MAX`` in the power form.
EPS = 1e-2
POWER_MAX = 2.0
# form -> (r1, r2) initial ranges: ``r ~ U[0, scale)`` per head, then bounded as above
# (``ParallelKerpleLog``: ``bias_p = 2 U``, ``bias_a = U``; ``ParallelKerplePower``:
# ``bias_a = U``, ``bias_p = 2 U``).
INIT_SCALES = {"log": (2.0, 1.0), "power": (1.0, 2.0)}


def bounded(raw: Array, low: float, high: float | None = None) -> Array:
  """``clip(raw, low, high)`` in value, the identity in gradient (straight through).

  The reference code clamps the parameters themselves before each forward pass (a projected
  gradient step). A module cannot rewrite its parameters, so the clamp is applied to what
  the bias reads: the values are the reference's, and a parameter past a bound still gets
  the gradient at the bound (a plain ``clip`` would give it none and freeze it there).
  """
  frozen = jax.lax.stop_gradient
  return frozen(jnp.clip(raw, low, high)) + (raw - frozen(raw))  # exactly the clip's value


@dataclasses.dataclass(frozen=True)
class KernelDistance:
  """KERPLE's offset function: ``-r1 log(1 + r2 |rel|)`` or ``-r1 |rel|^r2``.

  Called as ``(table [..., 2], rel [N]) -> [..., N]`` with ``table[..., 0] = r1`` and
  ``table[..., 1] = r2`` (see :class:`posenc_jax.terms.Toeplitz`). ``rel = j - i``; the
  kernel is symmetric, and the reference code's causal ``tril`` only zeroes entries
  ``j > i`` that the causal mask removes, so one form serves encoders and decoders.
  """

  form: str = "log"

  @property
  def closed_form(self) -> str:
    """The closed form's name in the route table (:class:`posenc_jax.route_table.Point`'s
    ``closed_ms``): ``kerple_log`` or ``kerple_power``."""
    return f"kerple_{self.form}"

  def closed(self, params: tuple[Array, Array], rel: Array) -> Array:
    """The bias from ``params = (r1, r2)`` (broadcastable against ``rel``, any shape): what
    the kernel evaluates in its tiles."""
    r1, r2 = params
    distance = jnp.abs(rel).astype(r1.dtype)
    if self.form == "log":
      return -r1 * jnp.log1p(r2 * distance)
    return -r1 * jnp.power(distance, r2)

  def __call__(self, table: Array, rel: Array) -> Array:
    return self.closed((table[..., 0:1], table[..., 1:2]), rel)


class Kerple(Scheme):
  """``T[h,i,j] = -r1_h log(1 + r2_h |i - j|)`` (log) or ``-r1_h |i - j|^r2_h`` (power).

  Parameters ``r1``, ``r2`` ``[layers, heads]`` (layers 1 and heads 1 as ``sharing``
  says), initialised as the reference code (:data:`INIT_SCALES`) and read through
  :func:`bounded`: ``[EPS, inf)``, the power form's ``r2`` ``[EPS, 2]``.

  Attributes:
    form: ``log`` or ``power`` (registered as ``kerple_log`` and ``kerple_power``).
    sharing: ``layer`` (the reference code: one module for all layers), ``none`` or
      ``head``.
  """

  form: str = "log"
  sharing: str = "layer"

  hyperparameters = {"form": one_of(*FORMS), "sharing": one_of(*SHARING)}

  @property
  def scheme_name(self):
    return f"kerple_{self.form}" if self.form in FORMS else "kerple"

  @nn.compact
  def __call__(self, length, segment_ids=None, position_ids=None):
    self.check_length(length)  # the term is built for any length
    positions = self.toeplitz_positions(length, position_ids)
    shape = self.sharing_dims(self.sharing)
    r1_scale, r2_scale = INIT_SCALES[self.form]
    r1 = self.logical_param("r1", nn.initializers.uniform(r1_scale), shape, ("layers", "heads"))
    r2 = self.logical_param("r2", nn.initializers.uniform(r2_scale), shape, ("layers", "heads"))
    r2_max = POWER_MAX if self.form == "power" else None
    table = jnp.stack([bounded(r1, EPS), bounded(r2, EPS, r2_max)], axis=-1)  # [layers, H, 2]
    return SchemeTerms(terms=(Toeplitz(table, KernelDistance(self.form), **positions),))
