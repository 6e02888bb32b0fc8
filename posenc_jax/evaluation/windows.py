"""Evaluation windows: one token stream cut into model inputs of one length, each token
scored exactly once (Press et al., "Train Short, Test Long", section 4).

Two ways to cut ``N`` tokens into windows of ``L`` tokens:

* ``non_overlapping`` (the paper's main tables): windows ``[kL, (k+1)L)``, ``ceil(N / L)`` of
  them, every token scored in its window; a token's context is what precedes it there (the
  first token of a window has none).
* ``sliding`` with stride ``S`` (``0 < S <= L``): window ``k`` is ``[kS, kS + L)``; the first
  scores all its ``L`` tokens, every later one only its last ``S``, so a token past the
  first window is scored once with at least ``L - S`` tokens of context.
  ``1 + ceil(max(0, N - L) / S)`` windows (``S = L`` is ``non_overlapping``).

The last window may run past the stream: its missing tail is padding, never scored.

  cut = windows(1000, 128, "sliding", stride=64)
  ids, valid, scored = window_arrays(stream, cut)   # [W, 128] each
"""

from __future__ import annotations

import dataclasses

import numpy as np

WINDOWS = ("non_overlapping", "sliding")


@dataclasses.dataclass(frozen=True)
class Windows:
  """Where the windows of one length lie in a stream.

  Attributes:
    tokens: ``N``, the stream's length.
    length: ``L``, tokens per window.
    starts: int64 ``[W]``, the stream position of each window's first token.
    scored_from: int64 ``[W]``, the offset in each window of its first scored token.
  """

  tokens: int
  length: int
  starts: np.ndarray
  scored_from: np.ndarray


def windows(tokens: int, length: int, kind: str = "non_overlapping",
            stride: int | None = None) -> Windows:
  """The windows of ``length`` tokens over a stream of ``tokens`` (module docstring).

  Raises:
    ValueError: one line naming ``tokens``, ``length``, ``windows`` or ``stride``.
  """
  for name, value in (("tokens", tokens), ("length", length)):
    if int(value) != value or value < 1:
      raise ValueError(f"{name}: got {value!r}; allowed: a positive integer")
  if kind not in WINDOWS:
    raise ValueError(f"windows: got {kind!r}; allowed: {', '.join(WINDOWS)}")
  if kind == "non_overlapping":
    if stride is not None:
      raise ValueError(f"stride: got {stride}; allowed only with windows 'sliding'")
    starts = np.arange(0, tokens, length, dtype=np.int64)
    return Windows(tokens, length, starts, np.zeros_like(starts))
  if stride is None or int(stride) != stride or not 0 < stride <= length:
    raise ValueError(f"stride: got {stride!r}; allowed with windows 'sliding': an integer in "
                     f"[1, {length}] (the window length)")
  count = 1 + -(-max(0, tokens - length) // stride)
  starts = np.arange(count, dtype=np.int64) * stride
  scored_from = np.where(starts == 0, 0, length - stride).astype(np.int64)
  return Windows(tokens, length, starts, scored_from)


def window_arrays(stream: np.ndarray, cut: Windows, pad: int = 0
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """``(ids, valid, scored)``, each ``[W, L]``: the tokens of ``stream`` ``[N]`` in each
  window of ``cut`` (``pad`` past the stream's end), whether a place holds a stream token,
  and whether it is scored there (each stream token is scored in exactly one window)."""
  if len(stream) != cut.tokens:
    raise ValueError(f"stream: has {len(stream)} tokens; the windows cut {cut.tokens}")
  index = cut.starts[:, None] + np.arange(cut.length)
  valid = index < cut.tokens
  ids = np.where(valid, np.asarray(stream)[np.minimum(index, cut.tokens - 1)], pad)
  scored = valid & (np.arange(cut.length) >= cut.scored_from[:, None])
  return ids, valid, scored
