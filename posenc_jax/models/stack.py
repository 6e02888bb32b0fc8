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

Per-layer schemes (``ModelConfig.alternate_scheme`` every ``alternate_scheme_interval``-th
layer; NoPE layers, ``nope_layer_interval``, are the alternate scheme ``none``): the composed
terms are the position scheme's, then the alternate scheme's, then the rest (segment terms,
Linformer's shared projection), and each layer takes its scheme's and the rest
(:func:`select_terms`). Unrolled, each layer is simply called with its own; scanned, a flag
per layer is scanned with the terms and ``nn.cond`` picks the call with one or the other, so
one layer body (with its two branches) is still compiled and the parameters are the same.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from posenc_jax.models.config import ModelConfig, ModelConfigError, interval_field
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
  """``layer`` as ``nn.scan``'s body: ``(x, (per_layer, alternate), (shared, counts, *args))
  -> (x, None)``, with ``alternate`` this layer's flag (None: no layer runs the alternate
  scheme) and ``counts`` the position and alternate schemes' numbers of terms
  (:func:`select_terms`)."""

  class Scanned(layer):
    def __call__(self, x, scanned, broadcast):
      (per_layer, alternate), (shared, counts, *args) = scanned, broadcast

      def call(module, x, terms):
        return layer.__call__(module, x, terms, *args)

      def with_scheme(module, x, terms):
        return call(module, x, select_terms(terms, False, counts))

      def with_alternate(module, x, terms):
        return call(module, x, select_terms(terms, True, counts))

      terms = layer_terms(per_layer, shared)
      if alternate is None:
        return call(self, x, terms), None
      return nn.cond(alternate, with_alternate, with_scheme, self, x, terms), None

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


def select_terms(terms: Sequence[Any], alternate: bool, counts: tuple[int, int]) -> list[Any]:
  """A layer's terms out of the composed ``terms``: the position scheme's ``m``, the
  alternate scheme's ``a`` (``counts = (m, a)``), then the rest, which every layer keeps.
  A layer running the alternate scheme (``alternate``) drops the first ``m``, the others
  the ``a`` after them."""
  m, a = counts
  return list(terms[m:]) if alternate else list(terms[:m]) + list(terms[m + a:])


def per_layer_args(config: ModelConfig, count: int, position: SchemeTerms,
                   alternate: SchemeTerms | None) -> dict[str, Any]:
  """:func:`run_stack`'s per-layer arguments for a stack of ``count`` layers whose composed
  terms start with the position scheme's terms ``position`` and the alternate scheme's
  ``alternate`` (None: no alternate scheme is set).

  Raises:
    ModelConfigError: one line, naming the interval field (or ``alternate_scheme``), when
      a layer runs the alternate scheme and either scheme adds an input embedding (it is
      added once, before every layer, so no layer can be without it) or asks for a content
      scale (set on every layer alike).
  """
  flags = config.alternate_layers(count)
  if any(flags):
    field = interval_field(config)
    for owner, terms in ((field, position), ("alternate_scheme", alternate)):
      which = "scheme" if owner == field else "alternate scheme"
      if terms.embedding is not None:
        raise ModelConfigError(f"model.{owner}: the {which} adds input embeddings, which no "
                               f"layer can drop; allowed: 0 with an input-level scheme")
      if terms.content_scale is not None:
        raise ModelConfigError(f"model.{owner}: the {which} sets every layer's content scale to "
                               f"{terms.content_scale}; allowed: 0 with such a scheme")
  counts = (len(position.terms), 0 if alternate is None else len(alternate.terms))
  return {"alternate_layers": flags, "counts": counts}


def run_stack(stack: Sequence[nn.Module] | nn.Module, x: Array, terms: SchemeTerms,
              *args, alternate_layers: Sequence[bool] = (),
              counts: tuple[int, int] = (0, 0)) -> Array:
  """``x`` through every layer of ``stack`` (:func:`layer_stack`), each called with its own
  terms from ``terms`` and ``args``.

  ``alternate_layers`` (one flag per layer, or empty) marks the layers that run the
  alternate scheme; each layer takes its terms by :func:`select_terms` with ``counts``
  (:func:`per_layer_args`).
  """
  if isinstance(stack, Sequence):
    flags = alternate_layers or [False] * len(stack)
    for index, (layer, alternate) in enumerate(zip(stack, flags)):
      x = layer(x, select_terms(terms.for_layer(index), alternate, counts), *args)
    return x
  per_layer, shared = terms.split_layers()
  flags = jnp.asarray(alternate_layers) if any(alternate_layers) else None
  x, _ = stack(x, (per_layer, flags), (shared, counts, *args))
  return x
