"""A stack of Transformer layers, unrolled or scanned (``ModelConfig.scan_layers``).

Unrolled, the stack is ``count`` modules named ``<name>_0 .. <name>_{count-1}``, and XLA
compiles each one. Scanned (as t5x and MaxText do), it is one module ``<name>`` run by
``nn.scan``: XLA compiles one layer, whose parameters (and decoding cache) carry a leading
axis of size ``count`` with the logical axis name ``layers``::

  unrolled: layers_{i}/attention/query/kernel   [d, H, D]
  scanned:  layers/attention/query/kernel       [N, d, H, D]

The same random keys initialise a different tree, so the two are not interchangeable as
they are; :mod:`posenc_jax.models.scan` converts one into the other exactly.

Positional terms follow :class:`~posenc_jax.terms.SchemeTerms`' layer axis: terms with one
value per layer are scanned together with the parameters, terms shared by every layer are
broadcast once (:meth:`~posenc_jax.terms.SchemeTerms.split_layers`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import flax.linen as nn
import jax

from posenc_jax.models.config import ModelConfig
from posenc_jax.terms import SchemeTerms, layer_terms

Array = jax.Array

SCANNED = "layers"  # the scanned stack's module name and its parameters' logical axis


@functools.cache
def rematerialised(layer: type[nn.Module], remat: str, scanned: bool) -> type[nn.Module]:
  """``layer`` rematerialised as ``remat`` (``ModelConfig.remat``) says: ``none`` keeps it,
  ``dots`` saves the matmul outputs, ``full`` nothing but the input; the backward pass
  recomputes the rest.

  The call arguments the layer's ``static_argnums`` names (the content scale,
  ``deterministic``, ``decode``) are static. Under a scan (``scanned``) the loop already
  keeps XLA from merging the recomputation away, so common subexpressions are not
  protected.
  """
  if remat == "none":
    return layer
  policy = jax.checkpoint_policies.dots_saveable if remat == "dots" else None
  return nn.remat(layer, policy=policy, static_argnums=layer.static_argnums,
                  prevent_cse=not scanned)


@functools.cache
def _scan_body(layer: type[nn.Module]) -> type[nn.Module]:
  """``layer`` as ``nn.scan``'s body: ``(x, per_layer, (shared, *args)) -> (x, None)``."""

  class Scanned(layer):
    def __call__(self, x, per_layer, broadcast):
      shared, *args = broadcast
      return super().__call__(x, layer_terms(per_layer, shared), *args), None

  Scanned.__name__ = Scanned.__qualname__ = f"Scanned{layer.__name__}"
  return Scanned


def layer_stack(layer: type[nn.Module], config: ModelConfig, count: int, *,
                remat: bool = True, name: str | None = None) -> list[nn.Module] | nn.Module:
  """``count`` layers of class ``layer``: a list of modules, or one scanned module.

  Args:
    layer: a layer class built as ``layer(config)`` and called as
      ``layer(x, terms, *args)`` -> ``x``, with a ``static_argnums`` class attribute.
    config: the model config (``scan_layers``, ``remat``).
    count: the number of layers.
    remat: rematerialise each layer as ``config.remat`` says.
    name: ``layers``, or None inside ``setup`` (the attribute names the modules).

  Returns:
    What :func:`run_stack` takes.
  """
  cls = rematerialised(layer, config.remat if remat else "none", config.scan_layers)
  if not config.scan_layers:
    return [cls(config, name=None if name is None else f"{name}_{i}") for i in range(count)]
  scanned = nn.scan(_scan_body(cls), variable_axes={"params": 0, "cache": 0},
                    split_rngs={"params": True, "dropout": True},
                    in_axes=(0, nn.broadcast), length=count,
                    metadata_params={nn.PARTITION_NAME: SCANNED})
  return scanned(config, name=name)


def run_stack(stack: Sequence[nn.Module] | nn.Module, x: Array, terms: SchemeTerms,
              *args) -> Array:
  """``x`` through every layer of ``stack`` (:func:`layer_stack`), each called with its own
  terms from ``terms`` and ``args``."""
  if isinstance(stack, Sequence):
    for index, layer in enumerate(stack):
      x = layer(x, terms.for_layer(index), *args)
    return x
  per_layer, shared = terms.split_layers()
  x, _ = stack(x, per_layer, (shared, *args))
  return x
