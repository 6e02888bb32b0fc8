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

NoPE layers (``ModelConfig.nope_layer_interval``) drop the position scheme's terms, which
come first in the composed terms, and keep the rest (segment terms, Linformer's shared
projection). Unrolled, each layer is simply called with fewer terms; scanned, a flag per
layer is scanned with the terms and ``nn.cond`` picks the call with or without them, so
one layer body (with its two branches) is still compiled and the parameters are the same.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from posenc_jax.models.config import ModelConfig, ModelConfigError
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
  """``layer`` as ``nn.scan``'s body: ``(x, (per_layer, nope), (shared, dropped, *args)) ->
  (x, None)``, with ``nope`` this layer's NoPE flag (None: no layer is NoPE) and ``dropped``
  the number of leading terms a NoPE layer drops."""

  class Scanned(layer):
    def __call__(self, x, scanned, broadcast):
      (per_layer, nope), (shared, dropped, *args) = scanned, broadcast

      def call(module, x, terms):
        return layer.__call__(module, x, terms, *args)

      def without_position(module, x, terms):
        return call(module, x, terms[dropped:])

      terms = layer_terms(per_layer, shared)
      if nope is None:
        return call(self, x, terms), None
      return nn.cond(nope, without_position, call, self, x, terms), None

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


def nope_args(config: ModelConfig, count: int, position: SchemeTerms) -> dict[str, Any]:
  """:func:`run_stack`'s NoPE arguments for a stack of ``count`` layers whose composed terms
  start with the position scheme's terms ``position``.

  Raises:
    ModelConfigError: one line when ``config.nope_layer_interval`` is set and the scheme adds
      an input embedding (it is added once, before every layer, so no layer can drop it) or
      asks for a content scale (a NoPE layer attends over ``q . k / sqrt(D)``).
  """
  nope_layers = config.nope_layers(count)
  if any(nope_layers) and position.embedding is not None:
    raise ModelConfigError("model.nope_layer_interval: the scheme adds input embeddings, which "
                           "no layer can drop; allowed: 0 with an input-level scheme")
  if any(nope_layers) and position.content_scale is not None:
    raise ModelConfigError(f"model.nope_layer_interval: the scheme sets every layer's content "
                           f"scale to {position.content_scale}; allowed: 0 with such a scheme")
  return {"nope_layers": nope_layers, "position_terms": len(position.terms)}


def run_stack(stack: Sequence[nn.Module] | nn.Module, x: Array, terms: SchemeTerms,
              *args, nope_layers: Sequence[bool] = (), position_terms: int = 0) -> Array:
  """``x`` through every layer of ``stack`` (:func:`layer_stack`), each called with its own
  terms from ``terms`` and ``args``.

  ``nope_layers`` (one flag per layer, or empty) marks the NoPE layers, which drop the
  first ``position_terms`` of ``terms.terms`` (:func:`nope_args`).
  """
  if isinstance(stack, Sequence):
    for index, (layer, nope) in enumerate(zip(stack, nope_layers or [False] * len(stack))):
      own = terms.for_layer(index)
      x = layer(x, own[position_terms:] if nope else own, *args)
    return x
  per_layer, shared = terms.split_layers()
  nope = jnp.asarray(nope_layers) if any(nope_layers) else None
  x, _ = stack(x, (per_layer, nope), (shared, position_terms, *args))
  return x
