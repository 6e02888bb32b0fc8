"""Converts parameter trees between unrolled and scanned layer stacks, exactly.

An unrolled stack (``ModelConfig.scan_layers=False``) keeps layer ``i`` under
``layers_{i}``; a scanned one keeps all ``N`` under ``layers`` with a leading axis of size
``N`` (:mod:`posenc_jax.models.stack`). Every stack in a tree is converted: BERT's, and
the encoder-decoder's ``encoder/`` and ``decoder/``. Leaves are arrays (as checkpoints
hold them), ``jax.ShapeDtypeStruct`` (under ``jax.eval_shape``) or logical-axis boxes
(``nn.Partitioned``, as ``init`` returns them), whose names gain or lose ``layers``.

Checkpoints, the Hugging Face import and the analysis tools go through
:func:`match_layout`, so a checkpoint of either layout loads into a model of either.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from posenc_jax.models.stack import SCANNED

_UNROLLED = re.compile(rf"{SCANNED}_(\d+)")


def _unrolled_indices(tree: Mapping[str, Any]) -> list[int]:
  return sorted(int(m.group(1)) for key in tree if (m := _UNROLLED.fullmatch(str(key))))


def _is_box(x: Any) -> bool:
  return isinstance(x, nn.Partitioned)


def _stack(*xs: Any) -> Any:
  """One leaf ``[N, ...]`` from the layers' leaves ``[...]`` (boxes named ``layers`` first)."""
  if not _is_box(xs[0]):
    return jnp.stack(xs)
  return xs[0].replace(value=jnp.stack([x.value for x in xs]),
                       names=(SCANNED,) + tuple(xs[0].names))


def _take(x: Any, i: int) -> Any:
  """Layer ``i`` of a stacked leaf ``[N, ...]`` (a box loses its leading ``layers`` name)."""
  if not _is_box(x):
    return x[i]
  return x.replace(value=x.value[i], names=tuple(x.names)[1:])


def is_scanned(params: Any) -> bool:
  """True when ``params`` holds a scanned stack (a ``layers`` subtree) anywhere."""
  if not isinstance(params, Mapping):
    return False
  return SCANNED in params or any(is_scanned(v) for v in params.values())


def scan_params(params: Any) -> Any:
  """``params`` with every unrolled stack ``layers_0 .. layers_{N-1}`` stacked into
  ``layers`` (leaves ``[N, ...]``); the rest unchanged.

  Raises:
    ValueError: a stack whose layers are not numbered ``0 .. N-1``, or differ in shape.
  """
  if not isinstance(params, Mapping):
    return params
  indices = _unrolled_indices(params)
  out = {k: scan_params(v) for k, v in params.items() if not _UNROLLED.fullmatch(str(k))}
  if indices:
    if indices != list(range(len(indices))):
      raise ValueError(f"scan_params: layers numbered {indices}; expected 0 .. "
                       f"{len(indices) - 1}")
    layers = [params[f"{SCANNED}_{i}"] for i in indices]
    if len({jax.tree.structure(layer) for layer in layers}) > 1:
      raise ValueError("scan_params: the layers hold different parameters")
    out[SCANNED] = jax.tree.map(_stack, *layers, is_leaf=_is_box)
  return out


def unscan_params(params: Any) -> Any:
  """``params`` with every scanned stack ``layers`` (leaves ``[N, ...]``) split into
  ``layers_0 .. layers_{N-1}``; the rest unchanged."""
  if not isinstance(params, Mapping):
    return params
  out = {k: unscan_params(v) for k, v in params.items() if k != SCANNED}
  if SCANNED in params:
    stacked = params[SCANNED]
    count = jax.tree.leaves(nn.meta.unbox(stacked))[0].shape[0]
    for i in range(count):
      out[f"{SCANNED}_{i}"] = jax.tree.map(lambda x, i=i: _take(x, i), stacked, is_leaf=_is_box)
  return out


def layout_for(params: Any, scan_layers: bool) -> Any:
  """``params`` in the layout ``ModelConfig.scan_layers`` asks for."""
  if is_scanned(params) == scan_layers:
    return params
  return scan_params(params) if scan_layers else unscan_params(params)


def match_layout(params: Any, like: Any) -> Any:
  """``params`` in the layout (scanned or unrolled) of the tree ``like``."""
  return layout_for(params, is_scanned(like))
