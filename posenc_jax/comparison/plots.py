"""The figures of compare's tables (:mod:`posenc_jax.comparison.report`): a curve table
(extrapolation, probes) against the evaluation length, a pre-training table against the
training step; one colour and marker per scheme, the seeds' range shaded. matplotlib is
imported when a figure is drawn (the ``analysis`` extra)."""

from __future__ import annotations

import math
from typing import Any

MARKERS = "osD^vP*Xh<>p"  # with tab20's colours: a distinct pair for up to 60 schemes


def styles(count: int) -> list[tuple[Any, str]]:
  """``count`` (colour, marker) pairs, all distinct up to 60: tab20's colours (the dark ones
  first) with :data:`MARKERS`."""
  from matplotlib import colormaps  # noqa: PLC0415

  colours = colormaps["tab20"].colors
  colours = colours[0::2] + colours[1::2]
  return [(colours[i % len(colours)], MARKERS[i % len(MARKERS)]) for i in range(count)]


def plot(table: dict[str, Any]):
  """A curve table as a Figure: per scheme the median over the seeds that learned at each
  length, their min-max range shaded, a colour and marker of its own; the reference (unigram
  or chance) dashed, the training length dotted, the legend beside the axes."""
  from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: PLC0415

  from posenc_jax.analysis.plots import _figure, length_axis  # noqa: PLC0415 - matplotlib

  fig = _figure(7.5, 4.2)
  ax = fig.add_subplot()
  for row, (colour, marker) in zip(table["rows"], styles(len(table["rows"]))):
    if table["criterion"] and not row["learned"]:
      ax.plot([], [], " ", label=f"{row['label']}: did not learn")
      continue
    points = [(int(c), row["values"][c]) for c in table["columns"]
              if row["values"][c] and "median" in row["values"][c]]
    if points:
      x = [n for n, _ in points]
      ax.plot(x, [c["median"] for _, c in points], color=colour, marker=marker,
              label=f"{row['label']} ({len(row['learned'])}/{len(row['seeds'])} seeds)")
      ax.fill_between(x, [c["min"] for _, c in points], [c["max"] for _, c in points],
                      color=colour, alpha=0.15, linewidth=0)
  reference = table["reference"]
  if reference:
    points = [(int(c), v) for c, v in reference["values"].items() if v is not None]
    ax.plot(*zip(*points), color="black", linestyle="--", linewidth=1,
            label="unigram (train split)" if reference["label"] == "unigram" else "chance")
  ax.axvline(table["train_length"], color="grey", linestyle=":",
             label=f"training length {table['train_length']}")
  length_axis(ax, [int(c) for c in table["columns"]])
  if table["metric"] == "perplexity":
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
  elif table["metric"] in ("accuracy", "token accuracy"):
    ax.set_ylim(-0.02, 1.02)
  ax.set_xlabel("evaluation length (tokens)")
  ax.set_ylabel(f"{table['metric']}\n(median over the seeds that learned; band: min-max)",
                fontsize=9)
  ax.set_title(table["title"] + (f": {table['task']}" if table["protocol"] == "extrapolation"
                                 else ""), fontsize=10)
  fig.legend(loc="outside right upper", fontsize=8)
  return fig


def plot_pretraining(table: dict[str, Any]):
  """A pre-training table as a Figure: per scheme the held-out masked-LM loss against step,
  median over the seeds that learned with their min-max range shaded (every seed's, dotted,
  where none learned), a colour and marker of its own; the unigram's loss dashed."""
  from posenc_jax.analysis.plots import _figure  # noqa: PLC0415 - matplotlib

  fig = _figure(7.5, 4.2)
  ax = fig.add_subplot()
  for row, (colour, marker) in zip(table["rows"], styles(len(table["rows"]))):
    points = sorted((int(step), cell) for step, cell in row["loss"].items())
    x = [step for step, _ in points]
    unlearned = bool(table["criterion"]) and not row["learned"]
    ax.plot(x, [c["median"] for _, c in points], color=colour, marker=marker, markersize=4,
            linestyle=":" if unlearned else "-",
            label=f"{row['label']}: did not learn" if unlearned else
            f"{row['label']} ({len(row['learned'])}/{len(row['seeds'])} seeds)")
    ax.fill_between(x, [c["min"] for _, c in points], [c["max"] for _, c in points],
                    color=colour, alpha=0.15, linewidth=0)
  if table["reference"]:
    ax.axhline(math.log(table["reference"]["values"]["perplexity"]), color="black",
               linestyle="--", linewidth=1, label="unigram (train split)")
  ax.set_xlabel("training step")
  ax.set_ylabel("held-out masked-LM loss (nats)\n(median over the seeds that learned; band: "
                "min-max)", fontsize=9)
  ax.set_title(f"{table['title']}: {table['task']}", fontsize=10)
  fig.legend(loc="outside right upper", fontsize=8)
  return fig


PLOTS = {"extrapolation": plot, "probes": plot, "pretrain": plot_pretraining}  # by protocol
