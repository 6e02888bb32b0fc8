"""Checks of a model's token inputs, each ``[B, L]``: ids, masks and the ids that go with
them, one ValueError line ``<owner>: <name>: ...`` for a wrong shape or dtype, or for a
concrete token id outside the vocabulary (:func:`posenc_jax.ids.check_id_values`: traced ids
are not read); and the padding mask as bools."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from posenc_jax.ids import check_id_values

Array = jax.Array


def check_token_ids(owner: str, name: str, ids: Array, batch: int | None = None,
                    vocab_size: int | None = None) -> tuple[int, int]:
  """``(B, L)`` of ``ids`` ``[B, L]`` (integer dtype; ``batch`` examples if given; concrete
  ids in ``[0, vocab_size)`` if given, see :func:`~posenc_jax.ids.check_id_values`), or one
  ValueError line ``<owner>: <name>: ...``."""
  shape, dtype = jnp.shape(ids), jnp.result_type(ids)
  if len(shape) != 2 or not jnp.issubdtype(dtype, jnp.integer):
    raise ValueError(f"{owner}: {name}: got shape {shape} of {dtype}; expected [B, L] "
                     "integer ids")
  if batch is not None and shape[0] != batch:
    raise ValueError(f"{owner}: {name}: got shape {shape}; expected B = {batch} examples")
  if vocab_size is not None:
    check_id_values(owner, name, ids, vocab_size, "vocab_size")
  return shape


def check_like(owner: str, name: str, x: Array | None, shape: tuple[int, int]) -> None:
  """One ValueError line unless ``x`` (segment ids, a padding mask) is None or ``[B, L]`` =
  ``shape``, that of the ids or inputs it goes with."""
  if x is not None and tuple(jnp.shape(x)) != tuple(shape):
    raise ValueError(f"{owner}: {name}: got shape {jnp.shape(x)}; expected [B, L] = "
                     f"{tuple(shape)}")


def check_ids_like(owner: str, name: str, x: Array | None, shape: tuple[int, int]) -> None:
  """:func:`check_like` for integer ids that go with the inputs (position ids, packed
  segment ids): one ValueError line for a wrong shape or a non-integer dtype."""
  check_like(owner, name, x, shape)
  if x is not None and not jnp.issubdtype(jnp.result_type(x), jnp.integer):
    raise ValueError(f"{owner}: {name}: got dtype {jnp.result_type(x)}; expected [B, L] "
                     "integer ids")


def as_mask(mask: Array | None, shape: tuple[int, int]) -> Array:
  """``[B, L]`` bool padding mask (True = token); None means no padding."""
  return jnp.ones(shape, bool) if mask is None else mask.astype(bool)
