"""PNG pictures of the analysis: positional attention per head, probing maps, position-vector
similarity, rank histograms.

matplotlib is imported inside each function (``import posenc_jax.analysis``
stays light) and drawn with the Agg canvas on a standalone ``Figure``, so
pyplot's global state and backend are never touched (safe in notebooks and
headless runs). Every function returns the ``Figure`` and, given ``path``,
writes a PNG there. Matrices are drawn with the query position ``i`` down
the rows and the key position ``j`` along the columns, as in the papers.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

DPI = 110


def _figure(width: float, height: float):
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
  from matplotlib.figure import Figure  # noqa: PLC0415
  fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
  FigureCanvasAgg(fig)
  return fig


def _save(fig, path: str | os.PathLike | None):
  if path is not None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=DPI)
  return fig


def length_axis(ax, lengths: Sequence[int]) -> None:
  """``ax``'s x axis for sequence lengths: log2, one plain tick per length and no others."""
  from matplotlib.ticker import NullLocator  # noqa: PLC0415

  ax.set_xscale("log", base=2)
  ax.set_xticks(list(lengths), [str(n) for n in lengths])
  ax.xaxis.set_minor_locator(NullLocator())


def _heatmap(fig, ax, matrix: np.ndarray, *, title: str, cbar_label: str, cmap: str,
             xlabel: str = "key position j", ylabel: str = "query position i",
             extent_positions: Sequence[float] | None = None, vmin=None, vmax=None,
             robust: bool = False) -> None:
  """One heatmap with its colour bar; ``robust`` clips the colour scale at the 99th
  percentile (so a dominant diagonal does not hide the rest), marked on the bar."""
  extend = "neither"
  if robust and vmax is None:
    vmax = float(np.percentile(matrix, 99))
    if vmax < float(np.max(matrix)):
      extend = "max"
      cbar_label += " (clipped at p99)"
  extent = None
  if extent_positions is not None:
    lo, hi = extent_positions[0] - 0.5, extent_positions[-1] + 0.5
    extent = (lo, hi, hi, lo)
  image = ax.imshow(matrix, cmap=cmap, interpolation="nearest", aspect="equal", extent=extent,
                    vmin=vmin, vmax=vmax)
  ax.set_title(title, fontsize=9)
  ax.set_xlabel(xlabel, fontsize=8)
  ax.set_ylabel(ylabel, fontsize=8)
  ax.tick_params(labelsize=7)
  bar = fig.colorbar(image, ax=ax, fraction=0.046, pad=0.03, extend=extend)
  bar.set_label(cbar_label, fontsize=8)
  bar.ax.tick_params(labelsize=7)


def _grid(n: int) -> tuple[int, int]:
  cols = min(n, 4)
  return math.ceil(n / cols), cols


def plot_positional_attention(values: Any, path: str | os.PathLike | None = None, *,
                              title: str = "Positional attention per head",
                              max_positions: int = 128, layer: int = 0, causal: bool = False):
  """TUPE Fig. 5 style: each head's content-free positional logits ``[H, L, L]``.

  Args:
    values: ``[H, L, L]`` array or a :class:`~posenc_jax.analysis.probing.PositionalAttention`.
    path: PNG to write (None: only return the figure).
    title: the figure title (the model's name belongs in it).
    max_positions: show the first positions only (the papers show 128).
    layer: the layer, for the panel titles.
    causal: a causal model's term: future positions (``j > i``) masked, blank.
  """
  kind = getattr(values, "kind", None)
  values = np.asarray(getattr(values, "values", values))[:, :max_positions, :max_positions]
  if causal:
    values = np.where(np.tril(np.ones(values.shape[1:], bool)), values, np.nan)
    kind = ", ".join(k for k in (kind, "causal, future masked") if k)
  heads = values.shape[0]
  rows, cols = _grid(heads)
  fig = _figure(3.1 * cols, 2.8 * rows + 0.4)
  axes = np.atleast_1d(fig.subplots(rows, cols)).reshape(-1)
  for h in range(heads):
    _heatmap(fig, axes[h], values[h], title=f"layer {layer}, head {h}", cmap="viridis",
             cbar_label="positional logit")
  for ax in axes[heads:]:
    ax.set_axis_off()
  fig.suptitle(title + (f" ({kind})" if kind else ""), fontsize=11)
  return _save(fig, path)


def plot_probing(attention: Any, path: str | os.PathLike | None = None, *,
                 title: str = "Identical-word probing", max_positions: int = 128,
                 per_head: bool = False, robust: bool = True):
  """Wang et al. Fig. 2: first-layer attention on ``[CLS] w .. w [SEP]``, averaged over words.

  Args:
    attention: ``[L, L]`` array or a :class:`~posenc_jax.analysis.probing.ProbingResult`.
    path: PNG to write.
    title: the figure title.
    max_positions: first positions shown.
    per_head: also draw each head (needs a ``ProbingResult``).
    robust: clip the colour scale at the 99th percentile (the self-attention diagonal of a
      trained model otherwise takes the whole scale); the colour bar says so.
  """
  heads = np.asarray(attention.per_head) if per_head and hasattr(attention, "per_head") else None
  layer = getattr(attention, "layer", 0)
  mean = np.asarray(getattr(attention, "attention", attention))[:max_positions, :max_positions]
  panels = [("mean over heads", mean)]
  if heads is not None:
    panels += [(f"head {h}", heads[h][:max_positions, :max_positions]) for h in range(len(heads))]
  rows, cols = _grid(len(panels))
  size = 4.2 if len(panels) == 1 else 3.1
  fig = _figure(size * cols + 0.3, (size - 0.3) * rows + 0.4)
  axes = np.atleast_1d(fig.subplots(rows, cols)).reshape(-1)
  for ax, (name, matrix) in zip(axes, panels):
    _heatmap(fig, ax, matrix, title=f"layer {layer} attention, {name}", cmap="Blues",
             cbar_label="attention probability", robust=robust)
  for ax in axes[len(panels):]:
    ax.set_axis_off()
  fig.suptitle(title, fontsize=11)
  return _save(fig, path)


def plot_position_similarity(vectors: Any, path: str | os.PathLike | None = None, *,
                             title: str = "Position vectors", max_positions: int = 128):
  """Wang et al. Fig. 1: dot products and cosine similarities of position vectors.

  Args:
    vectors: a :class:`~posenc_jax.analysis.probing.PositionVectors` (or an ``[N, dim]`` array
      of absolute positions).
    path: PNG to write.
    title: the figure title.
    max_positions: first rows shown (absolute positions only).
  """
  axis = getattr(vectors, "axis", "position")
  source = getattr(vectors, "source", "")
  v = np.asarray(getattr(vectors, "vectors", vectors), np.float64)
  positions = np.asarray(getattr(vectors, "positions", None) if hasattr(vectors, "positions")
                         else np.arange(len(v)))
  if axis == "position":
    v, positions = v[:max_positions], positions[:max_positions]
  dot = v @ v.T
  norms = np.linalg.norm(v, axis=1)
  cosine = dot / np.maximum(norms[:, None] * norms[None, :], 1e-30)
  fig = _figure(8.8, 4.3)
  axes = fig.subplots(1, 2)
  labels = dict(xlabel=f"{axis}", ylabel=f"{axis}", extent_positions=positions)
  _heatmap(fig, axes[0], dot, title="dot product", cmap="viridis", cbar_label="<p_a, p_b>",
           **labels)
  _heatmap(fig, axes[1], cosine, title="cosine similarity", cmap="RdBu_r", vmin=-1.0, vmax=1.0,
           cbar_label="cos(p_a, p_b)", **labels)
  fig.suptitle(f"{title}: {source}" if source else title, fontsize=11)
  return _save(fig, path)


def plot_rank_histogram(ranks: Mapping[str, Any], path: str | os.PathLike | None = None, *,
                        title: str = "Rank of per-head attention logits",
                        head_dim: int | None = None, length: int | None = None,
                        rtol: float | None = None):
  """DIET Fig. 2/8: histogram of numerical ranks, one colour per model or quantity.

  Args:
    ranks: label -> ranks (any shape; flattened).
    path: PNG to write.
    title: the figure title.
    head_dim: draws Theorem 1's cap ``d_h`` for an input APE.
    length: the sequence length (the largest possible rank), for the axis.
    rtol: the rank tolerance, stated on the axis label.
  """
  fig = _figure(6.2, 3.8)
  ax = fig.subplots()
  values = {k: np.asarray(v).reshape(-1) for k, v in ranks.items()}
  top = max([int(v.max()) for v in values.values() if v.size] + [length or 0, head_dim or 0])
  bins = np.arange(-0.5, top + 1.5, max(1, (top + 1) // 64))
  for label, v in values.items():
    ax.hist(v, bins=bins, alpha=0.6, label=f"{label} (n={v.size})")
  if head_dim is not None:
    ax.axvline(head_dim, color="k", linestyle="--", linewidth=1, label=f"d_h = {head_dim}")
  tol = f", singular values > {rtol:g} s_max" if rtol is not None else ""
  ax.set_xlabel(f"numerical rank{tol}", fontsize=9)
  ax.set_ylabel("count (heads x examples)", fontsize=9)
  ax.set_xlim(-0.5, top + 1.5)
  ax.legend(fontsize=8)
  ax.set_title(title, fontsize=11)
  return _save(fig, path)
