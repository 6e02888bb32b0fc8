"""Input-level absolute schemes: learned APE (Devlin et al.), sinusoidal APE
(Vaswani et al.; learnable frequencies as in Wang et al.)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from posenc_jax.schemes.base import BOOL, NON_NEGATIVE_FLOAT, POSITIVE_FLOAT, Scheme
from posenc_jax.terms import InputEmbedding, SchemeTerms, lookup_rows

Array = jax.Array


def sinusoid_frequencies(dim: int, base: float = 10000.0) -> Array:
  """``[dim / 2]`` frequencies ``w_k = base^(-2k / dim)``."""
  return base ** (-jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)


def sinusoid(positions: Array, frequencies: Array) -> Array:
  """Interleaved sinusoid: ``p[.., 2k] = sin(pos w_k)``, ``p[.., 2k+1] = cos(pos w_k)``.

  Args:
    positions: ``[N]`` (may be negative: signed offsets), or ``[B, L]`` position ids.
    frequencies: ``[d / 2]``.

  Returns:
    ``[N, d]`` (``[B, L, d]``) float32.
  """
  angles = positions.astype(jnp.float32)[..., None] * frequencies
  return jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1).reshape(positions.shape + (-1,))


def sinusoid_param(module: Scheme, dim: int, learnable: bool) -> Array:
  """Fixed frequencies, or a ``[dim / 2]`` parameter initialised to them."""
  if not learnable:
    return sinusoid_frequencies(dim)
  return module.logical_param("frequencies", lambda key, shape: sinusoid_frequencies(dim),
                              (dim // 2,), ("freq",))


class LearnedAPE(Scheme):
  """``x_i = w_i + p_i`` with ``p`` an ``[L_max, d]`` table, init ``N(0, init_std^2)``.

  Attributes:
    init_std: the table's initial standard deviation (BERT's 0.02; 0 starts from no
      position at all).
  """

  init_std: float = 0.02

  scheme_name = "learned_ape"
  absolute_table = True
  fits_linformer = True
  hyperparameters = {"init_std": NON_NEGATIVE_FLOAT}

  @nn.compact
  def __call__(self, length, segment_ids=None, position_ids=None):
    self.check_length(length)
    ids = self.check_position_ids(length, position_ids, self.max_len)
    table = self.logical_param("position_embedding", nn.initializers.normal(self.init_std),
                               (self.max_len, self.d_model), ("abspos", "embed"))
    rows = table[:length] if ids is None else lookup_rows(table, ids)  # [L, d] or [B, L, d]
    return SchemeTerms(embedding=InputEmbedding(rows))


class SinusoidalAPE(Scheme):
  """``x_i = w_i + amplitude * sinusoid(i)``; frequencies fixed or trainable (Wang et al.).

  Attributes:
    learnable: train the ``d / 2`` frequencies (initialised to the fixed ones).
    amplitude: the sinusoid's scale (1: Vaswani et al.'s; its RMS is ``amplitude / sqrt(2)``).
      Vaswani et al. add it to token embeddings of RMS 1 (``N(0, 1/d)`` times ``sqrt(d)``).
      Beside BERT's unscaled ``N(0, 0.02)`` token table it is 35 times louder than every
      token, and the LayerNorm after the sum leaves the tokens a thousandth of the variance
      (docs/results/pretrain-calibration-cpu.md measures what the masked LM learns at other
      amplitudes).
  """

  learnable: bool = False
  amplitude: float = 1.0

  scheme_name = "sinusoidal_ape"
  even_dimension = "d_model"
  fits_linformer = True
  hyperparameters = {"learnable": BOOL, "amplitude": POSITIVE_FLOAT}

  @nn.compact
  def __call__(self, length, segment_ids=None, position_ids=None):
    self.check_length(length)
    ids = self.check_position_ids(length, position_ids)  # any integer: no table
    freqs = sinusoid_param(self, self.d_model, self.learnable)
    positions = jnp.arange(length) if ids is None else ids
    return SchemeTerms(embedding=InputEmbedding(self.amplitude * sinusoid(positions, freqs)))
