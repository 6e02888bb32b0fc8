"""RoPE (Su et al.): q and k rotated pairwise by position-dependent angles, with the
rotate-half layout, partial rotary and context extension (position interpolation,
NTK-aware scaling, YaRN, Llama 3, and the run-time dynamic NTK and LongRoPE)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.schemes.absolute import sinusoid_frequencies
from posenc_jax.schemes.base import (POSITIVE_FLOAT, POSITIVE_INT, Check, Scheme,
                                     is_finite_number, one_of, optional)
from posenc_jax.terms import Rotation, SchemeTerms

Array = jax.Array

LAYOUTS = ("interleaved", "half")
SCALINGS = ("none", "linear", "ntk", "yarn", "llama3", "dynamic", "longrope")
# The scalings whose frequencies depend on the current length (the pass's, see Rope).
RUN_TIME_SCALINGS = ("dynamic", "longrope")
# The scalings that read each scaling hyperparameter; under any other scaling it keeps its
# default.
SCALING_FIELDS = {
    "factor": ("linear", "ntk", "yarn", "llama3", "dynamic"),
    "original_max_len": ("yarn", "llama3", "dynamic", "longrope"),
    "beta_fast": ("yarn",),
    "beta_slow": ("yarn",),
    "attention_factor": ("yarn", "longrope"),
    "low_freq_factor": ("llama3",),
    "high_freq_factor": ("llama3",),
    "short_factor": ("longrope",),
    "long_factor": ("longrope",),
}


def is_factor_list(x) -> bool:
  """A non-empty list (or tuple) of finite positive numbers."""
  return (isinstance(x, Sequence) and not isinstance(x, str) and len(x) > 0
          and all(is_finite_number(v) and v > 0 for v in x))


FACTOR_LIST = Check(is_factor_list, "a list of finite positive numbers")


def rotated_dims(fraction: float, head_dim: int) -> int:
  """``R = round(fraction * D)``, the rotated features of each head."""
  return round(fraction * head_dim)


class Rope(Scheme):
  """Rotates pairs of the first ``R`` features of each head of q and k by ``i theta'_k``.

  ``theta_k = base^(-2k/R)`` for ``k < R/2``, ``R = round(fraction * D)`` (must be
  even); features ``R..D-1`` pass through. ``theta'_k`` is ``theta_k`` rescaled
  for context extension by ``scaling``, with ``s = factor`` and
  ``L = original_max_len``:

  * ``"none"``: ``theta_k``.
  * ``"linear"``: position interpolation (Chen et al. 2023), ``theta_k / s``.
  * ``"ntk"``: NTK-aware scaling (bloc97, 2023; static, not "dynamic"):
    ``base' = base * s^(R / (R - 2))``.
  * ``"yarn"`` (Peng et al. 2023): ``theta'_k = (1 - gamma_k) theta_k / s + gamma_k theta_k``,
    with ``gamma_k`` 1 for dims ``k <= floor(d(beta_fast))``, 0 from
    ``ceil(d(beta_slow))``, linear in ``k`` between, where
    ``d(n) = R ln(L / (2 pi n)) / (2 ln base)`` is the dim whose frequency turns ``n``
    times over ``L`` (the paper's reference code); and cos, sin multiplied by the
    attention factor ``sqrt(1/t)``, default ``0.1 ln(s) + 1``, so the rotated part of
    ``q . k`` scales by its square.
  * ``"llama3"`` (Llama 3.1): the same blend with ``gamma_k = clip((L / lambda_k - a) /
    (b - a), 0, 1)``, ``a = low_freq_factor``, ``b = high_freq_factor``,
    ``lambda_k = 2 pi / theta_k``: wavelengths above ``L / a`` are interpolated, those
    below ``L / b`` kept.
  * ``"dynamic"`` (dynamic NTK, emozilla 2023; Hugging Face's
    ``_compute_dynamic_ntk_parameters``): ``theta_k`` of
    ``base' = base * (s n / L - (s - 1))^(R / (R - 2))`` when the current length ``n``
    exceeds ``L``, of ``base`` otherwise.
  * ``"longrope"`` (Ding et al. 2024, section 3.2; Hugging Face's
    ``_compute_longrope_parameters``): ``theta_k / f_k`` with ``f = long_factor`` when
    ``n > L``, else ``short_factor``; cos and sin multiplied by ``attention_factor``,
    default ``sqrt(1 + ln(S) / ln(L))`` with ``S = max_len / L`` (1 when ``S <= 1``).
    ``factor`` is not read: the ratio ``S`` comes from ``max_len``, as Hugging Face takes it
    from ``max_position_embeddings / original_max_position_embeddings`` (Phi-3).

  The current length ``n`` of a pass is ``length`` without ``position_ids``, and each row's
  largest id + 1 with them (traced under ``jit``: ``[B]`` frequencies). Cached decoding
  builds the terms once for the cache's length (see ``models/transformer.py``), so every
  step rotates with the frequencies of ``n = L_dec``: decoding equals teacher forcing over
  ``L_dec`` tokens and the cached keys stay valid; Hugging Face instead recomputes the
  frequencies from the positions seen so far, leaving earlier cached keys rotated with
  other ones (docs/schemes/rope-scaling.md).

  The names follow Hugging Face's config: ``base`` is ``rope_theta``, ``fraction``
  ``partial_rotary_factor``, ``scaling`` ``rope_scaling["rope_type"]``, and the
  scaling fields its ``rope_scaling`` keys (``original_max_len`` is
  ``original_max_position_embeddings``). Hugging Face always uses the ``"half"``
  layout; its Llama conversion permutes the q/k projections to match it.

  Attributes:
    base: 10000 as in Su et al.
    layout: ``"interleaved"`` pairs ``(x_{2k}, x_{2k+1})`` (Su et al., GPT-J) or
      ``"half"`` pairs ``(x_k, x_{k+R/2})`` (GPT-NeoX, Llama).
    fraction: of the head dim rotated, ``R = round(fraction * D)`` (1: all).
    scaling: one of :data:`SCALINGS`.
    factor: ``s >= 1``, the context extension ratio (linear, ntk, yarn, llama3, dynamic).
    original_max_len: ``L``, the pre-training context (yarn, llama3, dynamic, longrope);
      None: the model's ``max_len`` (Hugging Face falls back to ``max_position_embeddings``).
    beta_fast, beta_slow: YaRN's turn counts bounding the ramp (32, 1).
    attention_factor: the cos/sin multiplier of YaRN and LongRoPE; None: their defaults.
    low_freq_factor, high_freq_factor: Llama 3's wavelength thresholds ``L / factor``
      (1, 4).
    short_factor, long_factor: LongRoPE's ``R/2`` rescale factors (required by it; a list
      is kept as a tuple).
  """

  base: float = 10000.0
  layout: str = "interleaved"
  fraction: float = 1.0
  scaling: str = "none"
  factor: float = 1.0
  original_max_len: int | None = None
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  attention_factor: float | None = None
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  short_factor: Sequence[float] | None = None
  long_factor: Sequence[float] | None = None

  scheme_name = "rope"
  even_dimension = "head_dim"
  hyperparameters = {
      # theta_k = base^(-2k/R) falls with k only for base > 1.
      "base": Check(lambda x: is_finite_number(x) and x > 1, "a finite number > 1"),
      "layout": one_of(*LAYOUTS),
      "fraction": Check(lambda x: is_finite_number(x) and 0 < x <= 1, "a number in (0, 1]"),
      "scaling": one_of(*SCALINGS),
      "factor": Check(lambda x: is_finite_number(x) and x >= 1, "a finite number >= 1"),
      "original_max_len": optional(POSITIVE_INT),
      "beta_fast": POSITIVE_FLOAT,
      "beta_slow": POSITIVE_FLOAT,
      "attention_factor": optional(POSITIVE_FLOAT),
      "low_freq_factor": POSITIVE_FLOAT,
      "high_freq_factor": POSITIVE_FLOAT,
      "short_factor": optional(FACTOR_LIST),
      "long_factor": optional(FACTOR_LIST),
  }

  def __post_init__(self):
    for field in ("short_factor", "long_factor"):  # a tuple keeps the module hashable
      value = getattr(self, field)
      if isinstance(value, list):
        object.__setattr__(self, field, tuple(value))
    super().__post_init__()

  @classmethod
  def joint_problem(cls, values):
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    scaling = values["scaling"]
    for field, scalings in SCALING_FIELDS.items():
      if scaling not in scalings and values[field] != defaults[field]:
        return (f"{field} must stay {defaults[field]!r} with scaling {scaling!r} (it applies to "
                f"scaling {', '.join(repr(s) for s in scalings)}), got {values[field]!r}")
    if values["beta_fast"] <= values["beta_slow"]:
      return f"beta_fast must be > beta_slow ({values['beta_slow']!r}), got {values['beta_fast']!r}"
    if values["high_freq_factor"] <= values["low_freq_factor"]:
      return (f"high_freq_factor must be > low_freq_factor ({values['low_freq_factor']!r}), "
              f"got {values['high_freq_factor']!r}")
    if scaling == "longrope":
      for field in ("short_factor", "long_factor"):
        if values[field] is None:
          return f"{field} must be {FACTOR_LIST.allowed} with scaling 'longrope', got None"
      if values["original_max_len"] == 1:  # the default attention factor divides by ln L
        return "original_max_len must be >= 2 with scaling 'longrope', got 1"
    return None

  @classmethod
  def dimension_problem(cls, dims, values):
    rotated = rotated_dims(values["fraction"], dims["head_dim"])
    # The NTK exponent R / (R - 2) needs R > 2.
    ntk = values["scaling"] in ("ntk", "dynamic")
    least = 4 if ntk else 2
    if rotated % 2 or rotated < least:
      with_ntk = f" with scaling {values['scaling']!r}" if ntk else ""
      return (f"fraction must make the rotated dims, round(fraction * head_dim), an even "
              f"number >= {least}{with_ntk}, got round({values['fraction']!r} * "
              f"{dims['head_dim']}) = {rotated}")
    for field in ("short_factor", "long_factor"):
      if values[field] is not None and len(values[field]) != rotated // 2:
        return (f"{field} must have one factor per rotated pair, R/2 = {rotated // 2}, got "
                f"{len(values[field])}")
    return None

  @property
  def rotated_dim(self) -> int:
    """R, :func:`rotated_dims` of this head."""
    return rotated_dims(self.fraction, self.head_dim)

  @property
  def original_length(self) -> int:
    """``L``: ``original_max_len``, or the model's ``max_len`` when None."""
    return self.max_len if self.original_max_len is None else self.original_max_len

  def extrapolation(self) -> np.ndarray:
    """``[R/2]`` float64 ``gamma_k`` in ``[0, 1]``: 1 keeps ``theta_k`` (extrapolation), 0
    divides it by ``factor`` (interpolation); see the class docstring."""
    rotated, length = self.rotated_dim, self.original_length
    if self.scaling == "linear":
      return np.zeros(rotated // 2)
    if self.scaling == "yarn":
      def dim_turning(turns):  # YaRN's correction dim: theta_d turns `turns` times over L
        return rotated * math.log(length / (2 * math.pi * turns)) / (2 * math.log(self.base))
      low = max(math.floor(dim_turning(self.beta_fast)), 0)
      high = min(math.ceil(dim_turning(self.beta_slow)), rotated - 1)
      span = high - low if high != low else 1e-3  # one dim: a step, as in the reference code
      return 1.0 - np.clip((np.arange(rotated // 2) - low) / span, 0.0, 1.0)
    if self.scaling == "llama3":
      theta = self.base ** (-np.arange(0, rotated, 2) / rotated)
      turns = length * theta / (2 * math.pi)  # L / wavelength
      return np.clip((turns - self.low_freq_factor)
                     / (self.high_freq_factor - self.low_freq_factor), 0.0, 1.0)
    return np.ones(rotated // 2)  # none, ntk

  def frequencies(self, current_length: int | Array | None = None) -> Array:
    """float32 ``theta'_k``, the scaled frequencies: ``[R/2]``, or ``[*S, R/2]`` for an int
    array ``current_length`` of shape ``S`` under a run-time scaling (``dynamic``,
    ``longrope``; None: a pass within ``original_max_len``)."""
    rotated = self.rotated_dim
    base = self.base
    if self.scaling == "ntk":
      base = base * self.factor ** (rotated / (rotated - 2))
    gamma = self.extrapolation()
    blend = jnp.asarray((1.0 - gamma) / self.factor + gamma, jnp.float32)
    theta = sinusoid_frequencies(rotated, base) * blend
    if self.scaling not in RUN_TIME_SCALINGS:
      return theta
    n = jnp.asarray(self.original_length if current_length is None else current_length)
    longer = (n > self.original_length)[..., None]
    if self.scaling == "longrope":
      return theta / jnp.where(longer, jnp.asarray(self.long_factor, jnp.float32),
                               jnp.asarray(self.short_factor, jnp.float32))
    # base'^(-2k/R) = theta_k g^(-2k/(R-2)), g = s n / L - (s - 1): exactly theta_k at g = 1.
    growth = jnp.where(longer, self.factor * n[..., None].astype(jnp.float32)
                       / self.original_length - (self.factor - 1), 1.0)
    return theta * growth ** (-jnp.arange(0, rotated, 2, dtype=jnp.float32) / (rotated - 2))

  def attention_scaling(self) -> float:
    """The multiplier of cos and sin: ``attention_factor`` under YaRN (default
    ``0.1 ln(factor) + 1``) and LongRoPE (default ``sqrt(1 + ln(S) / ln(L))``,
    ``S = max_len / L``, 1 when ``S <= 1``); 1 under every other scaling."""
    if self.scaling not in ("yarn", "longrope"):
      return 1.0
    if self.attention_factor is not None:
      return self.attention_factor
    if self.scaling == "yarn":
      return 0.1 * math.log(self.factor) + 1.0
    ratio = self.max_len / self.original_length
    return 1.0 if ratio <= 1 else math.sqrt(1 + math.log(ratio) / math.log(self.original_length))

  @nn.compact
  def __call__(self, length, segment_ids=None, position_ids=None):
    """Angles ``[1 (layers), L, R/2]``, or ``[1, B, L, R/2]`` at ``position_ids`` (any
    integers: RoPE has no table); the current length is ``length``, or each row's
    largest id + 1."""
    self.check_length(length)
    ids = self.check_position_ids(length, position_ids)
    if ids is None:
      positions, current = jnp.arange(length), length
    else:
      positions, current = ids, jnp.max(ids, axis=-1, keepdims=True) + 1  # [B, 1]
    angles = positions.astype(jnp.float32)[..., None] * self.frequencies(current)
    return SchemeTerms(terms=(Rotation(angles[None], angles[None], self.layout,
                                       self.attention_scaling()),))
