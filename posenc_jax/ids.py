"""Whether integer ids lie in the table they index: the one value check of token, segment and
decoding ids that the models, the schemes and the searches call.

Values are read only where they are concrete (numpy, Python, an eager ``jax.Array``). Under
:func:`jax.jit`, :func:`jax.eval_shape` or a ``jax.lax`` loop the ids are tracers: the check
costs nothing there and cannot see them, and an id outside the table embeds as NaN (a token
id: the logits are NaN) or as a row of zeros (a segment id). Check such data before it
enters the compiled function, as the trainer checks every batch on the host. This module
imports nothing of the package, so anything may import it.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def check_id_values(owner: str, name: str, ids: Any, bound: int, bound_name: str) -> None:
  """One ValueError line ``<owner>: <name>: got id <i>; allowed: [0, <bound_name>=<bound>)``
  for integer ids (a scalar or an array of any shape) outside ``[0, bound)``, or
  ``... expected integer ids`` for another dtype; nothing for None, traced ids or an array
  spread over several hosts (not read)."""
  if ids is None or isinstance(ids, jax.core.Tracer) or (
      isinstance(ids, jax.Array) and not ids.is_fully_addressable):
    return
  values = np.asarray(ids)
  if not np.issubdtype(values.dtype, np.integer):
    shown = repr(ids) if values.ndim == 0 else f"shape {values.shape}"
    raise ValueError(f"{owner}: {name}: got {shown} of {values.dtype}; expected integer ids")
  if values.size and (values.min() < 0 or values.max() >= bound):
    bad = values.max() if values.max() >= bound else values.min()
    raise ValueError(f"{owner}: {name}: got id {bad}; allowed: [0, {bound_name}={bound})")
