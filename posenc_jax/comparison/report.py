"""The papers' tables from run records (:mod:`~posenc_jax.comparison.collect`): per row
(scheme) and column (task or evaluation length) the median over seeds, with the range.

* Best dev score (DIET Tables 2-9, TUPE Table 2): per task, the median over seeds of each
  run's best evaluation over checkpoints (``best.json``), and the average of the medians.
* Length extrapolation (Press et al.): per evaluation length, the median over seeds of the
  evaluate tool's value (perplexity); ``n/a`` where a scheme cannot reach the length.
* Probes: per probe and length, the median accuracy.
* Cost (DIET Table 1), beside the first table: step time and peak memory relative to the
  baseline scheme (:mod:`~posenc_jax.comparison.cost`).
"""

from __future__ import annotations

import io
import json
import os
import statistics
from collections.abc import Sequence
from typing import Any

from etils import epath

FINETUNE_OBJECTIVES = ("classification", "regression", "span")
NO_PLOTS = 'no plots (matplotlib missing): pip install "posenc-jax[analysis]"'


def spread(values: Sequence[float]) -> dict[str, float]:
  """``{"median", "min", "max", "n"}`` of ``values`` (the seeds' scores of one table cell)."""
  return {"median": statistics.median(values), "min": min(values), "max": max(values),
          "n": len(values)}


def _label(record: dict[str, Any], sizes: set[str]) -> str:
  return record["scheme"] if len(sizes) == 1 else f"{record['size']},{record['scheme']}"


def _cell(values: dict[int, float | None], reasons: list[str]) -> dict[str, Any] | None:
  """A table cell: the spread of the seeds' numbers, the numbers by seed, and where no seed
  has one, the reason (``na``); None where no run reported it."""
  numbers = [v for v in values.values() if v is not None]
  if not values:
    return None
  cell = spread(numbers) if numbers else {"na": reasons[0] if reasons else "no value"}
  return cell | {"seeds": {str(s): v for s, v in sorted(values.items())}}


def _table(title: str, metric: str, columns: list[str],
           entries: dict[str, dict[str, dict[int, Any]]], order: list[str],
           reasons: dict[tuple[str, str], list[str]], average: bool) -> dict[str, Any]:
  """``entries[row][column][seed] = value`` as a table; rows in ``order``."""
  rows = []
  for label in order:
    if label not in entries:
      continue
    cells = {c: _cell(entries[label].get(c, {}), reasons.get((label, c), [])) for c in columns}
    medians = [cells[c]["median"] for c in columns if cells[c] and "median" in cells[c]]
    row = {"label": label, "cells": cells}
    if average:
      row["average"] = statistics.mean(medians) if len(medians) == len(columns) else None
    rows.append(row)
  return {"title": title, "metric": metric, "columns": columns, "rows": rows}


def _ordered(names: set[str], first: Sequence[str]) -> list[str]:
  return [n for n in first if n in names] + sorted(names - set(first))


def tables(records: list[dict[str, Any]], schemes: Sequence[str] = (),
           tasks: Sequence[str] = ()) -> list[dict[str, Any]]:
  """The tables the records hold: best dev scores of fine-tuning runs, extrapolation and
  probe curves. Rows follow ``schemes`` and task columns ``tasks`` (then any others, sorted)."""
  sizes = {r["size"] for r in records}
  labels = sorted({_label(r, sizes) for r in records})
  order = [lb for s in schemes for lb in labels if lb.rsplit(",", 1)[-1] == s]
  order += [lb for lb in labels if lb not in order]
  out = []
  dev = [r for r in records if r["objective"] in FINETUNE_OBJECTIVES and r["best"]]
  if dev:
    entries = {}
    for r in dev:
      entries.setdefault(_label(r, sizes), {}).setdefault(r["task"], {})[r["seed"]] = (
          r["best"]["score"])
    metrics = sorted({r["best"]["metric"] for r in dev})
    columns = _ordered({r["task"] for r in dev}, tasks)
    out.append(_table("best dev score", "/".join(metrics), columns, entries, order, {}, True))
  curves = {}  # (protocol, task) -> records
  for r in records:
    for protocol in ("extrapolation", "probes"):
      if protocol in r["eval"]:
        task = r["task"] if protocol == "probes" else ""
        curves.setdefault((protocol, task), []).append(r)
  for (protocol, task), group in sorted(curves.items()):
    entries, reasons, lengths, metric = {}, {}, set(), "accuracy"
    for r in group:
      doc = r["eval"][protocol]
      metric = doc.get("metric", metric)
      key = "accuracy" if protocol == "probes" else "value"
      for row in doc["rows"]:
        column = str(row["length"])
        lengths.add(row["length"])
        entries.setdefault(_label(r, sizes), {}).setdefault(column, {})[r["seed"]] = row[key]
        if row.get("na"):
          reasons.setdefault((_label(r, sizes), column), []).append(row["na"])
    title = ("length extrapolation" if protocol == "extrapolation"
             else f"probe {task.rpartition(':')[2]}")
    train = sorted({r["eval"][protocol].get("train_length") for r in group} - {None})
    table = _table(title, metric, [str(n) for n in sorted(lengths)], entries, order, reasons,
                   False)
    table["train_length"] = train[0] if len(train) == 1 else None
    out.append(table)
  return out


def _number(value: float) -> str:
  return f"{value:.4f}" if abs(value) < 100 else f"{value:.1f}"


def _text(cell: dict[str, Any] | None) -> str:
  if cell is None:
    return "-"
  if "na" in cell:
    return "n/a"
  if cell["n"] == 1:
    return _number(cell["median"])
  return f"{_number(cell['median'])} ({_number(cell['min'])}-{_number(cell['max'])})"


def markdown(summary: dict[str, Any]) -> str:
  """``results.md``: each table with one row per scheme, cost columns beside the first."""
  cost = summary.get("cost") or {}
  base = cost.get("baseline")
  lines = [f"# {summary.get('experiment') or 'comparison'}", ""]
  for index, table in enumerate(summary["tables"]):
    with_cost = index == 0 and cost.get("rows")
    train = table.get("train_length")
    heads = [f"{c} ({int(c) / train:g}x)" if train else c for c in table["columns"]]
    heads += ["average"] if table["rows"] and "average" in table["rows"][0] else []
    heads += [f"step time (x {base})", f"peak memory (x {base})"] if with_cost else []
    lines += [f"## {table['title']}: {table['metric']}, median (min-max) over seeds", "",
              "| scheme | seeds | " + " | ".join(heads) + " |", "|---|---|" + "---|" * len(heads)]
    for row in table["rows"]:
      seeds = max((c["n"] for c in row["cells"].values() if c and "n" in c), default=0)
      texts = [_text(row["cells"][c]) for c in table["columns"]]
      if "average" in row:
        texts.append("-" if row["average"] is None else _number(row["average"]))
      if with_cost:
        mine = cost["rows"].get(row["label"].rsplit(",", 1)[-1], {})
        texts += [f"{mine[k]:.2f}" if mine.get(k) is not None else "n/a"
                  for k in ("train_ratio", "memory_ratio")]
      lines.append(f"| {row['label']} | {seeds} | " + " | ".join(texts) + " |")
    notes = sorted({f"{row['label']} at {c}: {row['cells'][c]['na']}" for row in table["rows"]
                    for c in table["columns"] if row["cells"][c] and "na" in row["cells"][c]})
    lines += [""] + [f"n/a: {n}" for n in notes] + ([""] if notes else [])
  if cost.get("note"):
    lines += [cost["note"], ""]
  failed = summary.get("failed") or []
  if failed:
    lines += ["Failed cells (not in the tables): " + "; ".join(
        f"{f['cell']} ({f['reason']})" for f in failed), ""]
  return "\n".join(lines)


def write_atomic(path: epath.Path, data: str | bytes) -> None:
  """Writes ``path`` through a temporary file renamed over it: a reader sees all or nothing."""
  tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
  if isinstance(data, bytes):
    tmp.write_bytes(data)
  else:
    tmp.write_text(data)
  tmp.replace(path)


def plot(table: dict[str, Any]):
  """The table's curves (one line per scheme: median over seeds per length) as a Figure."""
  from posenc_jax.analysis.plots import _figure  # noqa: PLC0415 - matplotlib, optional

  fig = _figure(6, 4)
  ax = fig.add_subplot()
  for row in table["rows"]:
    points = [(int(c), row["cells"][c]["median"]) for c in table["columns"]
              if row["cells"][c] and "median" in row["cells"][c]]
    if points:
      ax.plot(*zip(*points), marker="o", label=row["label"])
  ax.set_xscale("log", base=2)
  ax.set_xticks([int(c) for c in table["columns"]], table["columns"])
  if table["metric"] == "perplexity":
    ax.set_yscale("log")
  if table.get("train_length"):
    ax.axvline(table["train_length"], color="grey", linestyle=":", label="training length")
  ax.set_xlabel("evaluation length (tokens)")
  ax.set_ylabel(f"{table['metric']} (median over seeds)")
  ax.set_title(table["title"])
  ax.legend(fontsize=8)
  return fig


def write(root: str, summary: dict[str, Any]) -> list[str]:
  """Writes ``results.json``, ``results.md`` and a PNG per curve table into ``root``;
  returns the paths written (without matplotlib, the PNGs are skipped with one line)."""
  folder = epath.Path(root)
  folder.mkdir(parents=True, exist_ok=True)
  write_atomic(folder / "results.json", json.dumps(summary, indent=2, sort_keys=True))
  write_atomic(folder / "results.md", markdown(summary))
  written = [str(folder / "results.json"), str(folder / "results.md")]
  curves = [t for t in summary["tables"] if t["title"] != "best dev score"]
  try:
    import matplotlib  # noqa: F401, PLC0415
  except ImportError:
    if curves:
      print(f"compare: {NO_PLOTS}", flush=True)
    return written
  for table in curves:
    buffer = io.BytesIO()
    plot(table).savefig(buffer, format="png")
    path = folder / (table["title"].removeprefix("length ").replace(" ", "_") + ".png")
    write_atomic(path, buffer.getvalue())
    written.append(str(path))
  return written
