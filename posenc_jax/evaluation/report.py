"""What an evaluation leaves behind: ``<out>/<protocol>-<settings>.json`` (the settings
key, :func:`settings_key`: e.g. ``extrapolation-split=validation,windows=non_overlapping,
tokens=4096.json``), a console table, and for ``extrapolation`` and ``probes`` a PNG of the
curve beside it, titled by the run's scheme (matplotlib, the ``analysis`` extra; without it
the plot is skipped with one line). Evaluations with other settings sit beside each other;
one with the same settings replaces the file, keeping the lengths an earlier evaluation of
the same step scored and this one does not (:func:`merged_rows`). Files go through
``etils.epath``, so ``gs://`` folders work.
"""

from __future__ import annotations

import io
import json
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from etils import epath

from posenc_jax import foreign
from posenc_jax.paths import OutputPathError, absolute, check_output_dir, write_atomic

PROTECTED = ("checkpoints", "best")  # a workdir's folders an evaluation never writes into
PLOT_HINT = 'the plot needs matplotlib: pip install "posenc-jax[analysis]"'


def check_out(out: str, workdir: str) -> str:
  """``out`` (absolute, or a URI), created and writable, outside ``<workdir>/checkpoints``
  and ``<workdir>/best``; else one :class:`~posenc_jax.cli.OutputPathError` line naming
  ``out``."""
  out = absolute(out)
  for name in PROTECTED:
    protected = os.path.join(absolute(workdir), name)
    if out == protected or out.startswith(protected.rstrip("/") + "/"):
      raise OutputPathError(f"out: {out!r} is inside {protected!r}, which an evaluation "
                            "never writes into; pick another folder")
  return check_output_dir("out", out)


def settings_key(settings: Mapping[str, Any]) -> str:
  """``name=value,...`` of ``settings`` in their order, each value's characters other than
  letters, digits and ``._-`` as ``_``: the file name's part that tells evaluations apart."""
  return ",".join(f"{name}={re.sub(r'[^A-Za-z0-9._-]', '_', str(value))}"
                  for name, value in settings.items())


def file_stem(document: Mapping[str, Any]) -> str:
  """``<protocol>-<settings key>``: the name of the document's files without the suffix."""
  return f"{document['protocol']}-{settings_key(document['settings'])}"


def table(document: dict[str, Any]) -> str:
  """The document as console lines: a header stating the protocol, then one row per
  metric (``loss``) or per length (``extrapolation``, ``probes``), or Wang et al.'s Table 2
  layout (``indicators``)."""
  head = (f"{document['protocol']}: {document['workdir']} step {document['step']} "
          f"(checkpoint {document['checkpoint']}), objective {document['objective']}")
  if document["protocol"] == "loss":
    width = max(map(len, document["metrics"]), default=0)
    return "\n".join([f"{head}, split {document['split']}"] + [
        f"  {name:<{width}}  {value:.6g}" for name, value in document["metrics"].items()])
  if document["protocol"] == "indicators":
    from posenc_jax.analysis.indicators import format_table2  # noqa: PLC0415
    differences = document["paper_setup_differences"]
    return "\n".join([
        f"{head}, {document['examples']} identical-word sequences of length "
        f"{document['length']}, layer {document['layer']}",
        format_table2([{"label": document["scheme"], "indicators": document["indicators"],
                        "paper_row": document["paper_row"]}], paper=False),
        *([f"not Wang et al.'s Table 2 setup: {'; '.join(differences)}"] if differences
          else [])])
  if document["protocol"] == "probes":
    probe = ", ".join(f"{k}={v}" for k, v in document["probe"].items() if k != "name")
    return _length_table([
        f"{head}, probe {document['probe']['name']} ({probe})",
        f"  {document['examples']} examples of seed {document['seed']} at every length, "
        f"trained at length {document['train_length']}; chance: the accuracy of guessing "
        "each answer token among the answers' symbols"], document["rows"], [
        ("accuracy", "accuracy", 8, ".4f"), ("token accuracy", "token_accuracy", 14, ".4f"),
        ("chance", "chance", 9, ".3g")])
  stride = f", stride {document['stride']}" if document["stride"] is not None else ""
  unigram = ([f"  unigram perplexity of these tokens (add-one smoothed, counted on "
              f"{document['unigram_train_tokens']} tokens of split 'train'): "
              f"{document['unigram']:.4f}"] if document["unigram"] is not None else [])
  return _length_table([
      f"{head}, split {document['split']}",
      f"  windows {document['windows']}{stride}, the first {document['tokens']} tokens "
      f"at every length, trained at length {document['train_length']}", *unigram],
      document["rows"], [
      (document["metric"], "value", 10, ".4f"), ("loss", "loss", 8, ".4f"),
      ("accuracy", "accuracy", 8, ".4f"), ("scored", "scored_tokens", 7, "d")])


def _length_table(heading: list[str], rows: list[dict[str, Any]],
                  columns: list[tuple[str, str, int, str]]) -> str:
  """``heading``, a title line, then one line per row: its length and each of ``columns``
  (``(title, key, width, format)``), or ``n/a`` and the reason where the first is None."""
  lines = heading + ["  " + "  ".join([f"{'length':>7}"] + [f"{t:>{w}}" for t, _, w, _ in
                                                             columns])]
  for row in rows:
    _, first, width, _ = columns[0]
    if row[first] is None:
      lines.append(f"  {row['length']:>7}  {'n/a':>{width}}  {row['na']}")
    else:
      lines.append("  " + "  ".join([f"{row['length']:>7}"] + [
          f"{row[k]:>{w}{f}}" for _, k, w, f in columns]))
  return "\n".join(lines)


def _length_plot(document: dict[str, Any], key: str, ylabel: str, title: str,
                 reference: tuple[str, list[float | None]]):
  """``row[key]`` against the evaluation length (log2 axis, a tick at each length), the
  training length marked and ``reference`` (its label and a value per row) drawn dashed:
  a matplotlib ``Figure`` titled by the run's scheme."""
  from posenc_jax.analysis.plots import _figure, length_axis  # noqa: PLC0415 - matplotlib

  fig = _figure(5.5, 3.5)
  ax = fig.add_subplot()
  rows = [r for r in document["rows"] if r[key] is not None]
  ax.plot([r["length"] for r in rows], [r[key] for r in rows], marker="o",
          label=document["scheme"])
  label, values = reference
  points = [(r["length"], v) for r, v in zip(document["rows"], values) if v is not None]
  if points:
    ax.plot(*zip(*points), color="black", linestyle="--", linewidth=1, label=label)
  ax.axvline(document["train_length"], color="grey", linestyle=":", linewidth=1,
             label=f"training length {document['train_length']}")
  length_axis(ax, [r["length"] for r in document["rows"]])
  ax.set_xlabel("evaluation length (tokens)")
  ax.set_ylabel(ylabel)
  ax.set_title(f"{document['scheme']} (step {document['step']}): {title}", fontsize=9)
  fig.legend(loc="outside right upper", fontsize=7)
  return fig


def plot_extrapolation(document: dict[str, Any]):
  """The metric against the evaluation length, the unigram's level dashed: a Figure."""
  stride = f", stride {document['stride']}" if document["stride"] is not None else ""
  return _length_plot(document, "value", document["metric"],
                      f"{document['windows']}{stride}, {document['tokens']} tokens",
                      ("unigram (train split)", [document["unigram"]] * len(document["rows"])))


def plot_probes(document: dict[str, Any]):
  """The probe's accuracy against the evaluation length, chance dashed: a Figure."""
  return _length_plot(document, "accuracy", "accuracy (whole answers)",
                      f"probe {document['probe']['name']}, {document['examples']} examples",
                      ("chance", [r["chance"] for r in document["rows"]]))


PLOTS: dict[str, Callable[[dict[str, Any]], Any]] = {"extrapolation": plot_extrapolation,
                                                     "probes": plot_probes}


def merged_rows(document: dict[str, Any], path: epath.Path) -> list[dict[str, Any]]:
  """``document``'s rows, and those of the file at ``path`` at the lengths it does not score
  when that file is an evaluation of the same checkpoint step (a re-evaluation at other
  lengths adds to it, never drops a scored length), in increasing length; a file of another
  step, or one that does not read, is replaced."""
  if document["protocol"] not in PLOTS or not path.exists():
    return document["rows"]
  try:
    kept = foreign.loads(path.read_text())
    same = (kept.get("step") == document["step"] and kept.get("settings") ==
            document["settings"] and isinstance(kept.get("rows"), list))
    rows = {row["length"]: row for row in kept["rows"]} if same else {}
  except (OSError, ValueError, TypeError, KeyError, AttributeError):
    rows = {}
  rows |= {row["length"]: row for row in document["rows"]}
  return [rows[length] for length in sorted(rows)]


def write(document: dict[str, Any], out: str,
          progress: Callable[[str], None] = lambda message: None) -> list[str]:
  """Writes ``<out>/<protocol>-<settings>.json`` (:func:`file_stem`) and, for a protocol of
  :data:`PLOTS` with matplotlib installed, the PNG of the same name; returns the paths
  written, each told to ``progress``. An extrapolation or probes file of the same step
  already there keeps the lengths this evaluation does not score (:func:`merged_rows`):
  ``document``'s rows become the file's."""
  folder = epath.Path(out)
  folder.mkdir(parents=True, exist_ok=True)
  path = folder / f"{file_stem(document)}.json"
  if "rows" in document:
    document["rows"] = merged_rows(document, path)
  write_atomic(path, json.dumps(document, indent=2) + "\n")
  written = [os.fspath(path)]
  figure = None
  if document["protocol"] in PLOTS:
    try:
      figure = PLOTS[document["protocol"]](document)
    except ImportError:
      progress(PLOT_HINT)
  if figure is not None:
    png = io.BytesIO()
    figure.savefig(png, format="png")
    picture = folder / f"{file_stem(document)}.png"
    write_atomic(picture, png.getvalue())
    written.append(os.fspath(picture))
  for item in written:
    progress(f"wrote {item}")
  return written
