"""Every posenc-jax module in Flax NNX, through Flax's linen-to-NNX bridge.

posenc-jax's parameters carry logical axis names (``nn.with_logical_partitioning``). NNX's
eager sharding would place each one on a mesh as it is created, and without a mesh in
context refuses them ("An auto mesh context or metadata is required"). :func:`to_nnx`
creates the parameters with eager sharding off; the names stay on every ``nnx.Param``
(``nnx.get_partition_spec`` reads them), so a model can still be sharded by the user::

  scheme = to_nnx(pe.build_scheme({"name": "diet_abs", "rank": 16}, **dims), length)
  terms = scheme(length)                        # SchemeTerms, as from linen's apply
  optimizer = nnx.Optimizer(scheme, optax.adamw(1e-3), wrt=nnx.Param)
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
from flax import nnx


def to_nnx(module: nn.Module, *args: Any, rngs: nnx.Rngs | int = 0,
           **kwargs: Any) -> nnx.Module:
  """``module`` as an initialised NNX module.

  Args:
    module: any linen module (a scheme from :func:`posenc_jax.build_scheme`, a model from
      :mod:`posenc_jax.models`, a layer).
    *args, **kwargs: example inputs of ``module.__call__``; they fix the parameters' shapes
      (for a scheme: the length ``L`` and, where it takes them, ``[B, L]`` segment ids).
    rngs: ``nnx.Rngs`` (or a seed) for the parameters' initialisers; its ``dropout``
      stream, if any, feeds dropout when the module runs with ``deterministic=False``.

  Returns:
    The NNX module; calling it runs ``module.__call__`` on its parameters, with the same
    arguments and results.
  """
  if isinstance(rngs, int):
    rngs = nnx.Rngs(rngs)
  with nnx.use_eager_sharding(False):
    wrapped = nnx.bridge.ToNNX(module, rngs=rngs)
    nnx.bridge.lazy_init(wrapped, *args, **kwargs)
  return wrapped
