"""The papers' tables from run records (:mod:`~posenc_jax.comparison.collect`): per row
(scheme) and column (task or evaluation length) the median over seeds, with the range.

* Best dev score (DIET Tables 2-9, TUPE Table 2): per task, the median over seeds of each
  run's best evaluation over checkpoints (``best.json``), and the average of the medians; a
  majority-class row as the reference where the runs carry their task's ``chance_score``.
* Pre-training (TUPE Fig. 4): per scheme the masked LM's final held-out perplexity, its ratio
  to the unigram's (the reference), and the steps each seed took to reach the baseline
  scheme's final loss; a PNG of the held-out loss against step.
* Length extrapolation (Press et al.): the perplexity at the training length (1x), then at
  each longer length the ratio ppl(kL)/ppl(L) of each seed, median over seeds; ``n/a`` where
  a scheme cannot reach the length; a unigram row as the reference. A masked LM's loss, or a
  table without the training length, is shown as measured.
* Probes: per probe and length, the median accuracy of whole answers, then of answer tokens
  (where partial length generalisation shows); a chance row as the reference.
* Cost (DIET Table 1), beside the first table: step time and peak memory relative to the
  baseline scheme (:mod:`~posenc_jax.comparison.cost`).

One table per protocol, task and evaluation settings (:func:`posenc_jax.comparison.collect
.evaluations`): runs evaluated differently are never mixed. A seed that did not learn
(:data:`LEARNED_PERPLEXITY`, :data:`LEARNED_ACCURACY`, judged at the training length or, in
pre-training, at the final evaluation; :data:`LEARNED_MARGIN` over the majority class when
fine-tuned) is left out of its row's (a fine-tuning cell's) median and range; a row (cell) none
of whose seeds learned reads "did not learn".
``results.md`` states above each table what it measured: task, settings, training steps,
model, seeds and the criterion.
"""

from __future__ import annotations

import io
import json
import os
import re
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from etils import epath

from posenc_jax.comparison import plan
from posenc_jax.comparison.collect import CURVES, CollectError, evaluations
from posenc_jax.comparison.plots import PLOTS
from posenc_jax.data import probes

FINETUNE_OBJECTIVES = ("classification", "regression", "span")
NO_PLOTS = 'no plots (matplotlib missing): pip install "posenc-jax[analysis]"'
# A seed that did not learn, judged at the training length (the table's 1x column): a causal
# LM whose perplexity there is above this fraction of the unigram's, a probe run whose
# accuracy there is below this.
LEARNED_PERPLEXITY = 0.5
LEARNED_ACCURACY = 0.9
# A fine-tuning seed that did not learn: its best dev score not above its task's majority-class
# score (``chance_score``) by more than this, on the 0-100 scale of the scores.
LEARNED_MARGIN = 5.0
# A pre-training table's columns (:func:`_pretraining`).
PRETRAINING_COLUMNS = ("perplexity", "ratio to unigram", "steps to baseline")
NEAR_ZERO = 1e-4  # a chance accuracy below this reads "~0 (<the number>)"
MIN_SEEDS_SEPARATED = 2  # one seed's number has no range to separate


def spread(values: Sequence[float]) -> dict[str, float]:
  """``{"median", "min", "max", "n"}`` of ``values`` (the seeds' scores of one table cell)."""
  return {"median": statistics.median(values), "min": min(values), "max": max(values),
          "n": len(values)}


def _label(record: dict[str, Any], sizes: set[str]) -> str:
  return record["scheme"] if len(sizes) == 1 else f"{record['size']},{record['scheme']}"


def _cell(values: dict[int, float | None], reasons: list[str],
          counted: Sequence[int] | None = None) -> dict[str, Any] | None:
  """A table cell: the spread of the numbers of the seeds of ``counted`` (default every
  seed), every seed's number (``seeds``), and where none counted has one, the reason
  (``na``); None where no run reported it."""
  numbers = [v for s, v in values.items() if v is not None and (counted is None or s in counted)]
  if not values:
    return None
  cell = spread(numbers) if numbers else {"na": reasons[0] if reasons else "no value"}
  return cell | {"seeds": {str(s): v for s, v in sorted(values.items())}}


def _table(title: str, metric: str, columns: list[str],
           entries: dict[str, dict[str, dict[int, Any]]], order: list[str],
           learned: dict[tuple[str, str], list[int]], average: bool) -> dict[str, Any]:
  """``entries[row][column][seed] = value`` as a table; rows in ``order``. A judged cell (a
  key of ``learned``) counts the seeds ``learned[(row, column)]`` lists (its row's
  ``learned[column]``), and reads "did not learn" where there are none; others every seed."""
  rows = []
  for label in order:
    if label not in entries:
      continue
    judged = {c: learned[(label, c)] for c in columns if (label, c) in learned}
    cells = {c: _cell(entries[label].get(c, {}), ["did not learn"] if c in judged else [],
                      judged.get(c)) for c in columns}
    medians = [cells[c]["median"] for c in columns if cells[c] and "median" in cells[c]]
    row = {"label": label, "cells": cells, "learned": judged}
    if average:
      row["average"] = statistics.mean(medians) if len(medians) == len(columns) else None
    rows.append(row)
  return {"title": title, "metric": metric, "columns": columns, "rows": rows}


def _ordered(names: set[str], first: Sequence[str]) -> list[str]:
  return [n for n in first if n in names] + sorted(names - set(first))


def _agreed(values: list[tuple[str, Any]], what: str, table: str) -> Any:
  """The one value of ``values`` (``[(workdir, value)]``), else one :class:`CollectError` line
  naming two workdirs that differ."""
  workdir, first = values[0]
  for other, value in values[1:]:
    if value != first:
      raise CollectError(f"collect: runs of one table ({table}) differ in {what}: {workdir} "
                         f"has {first!r}, {other} has {value!r}")
  return first


def _runs(records: list[dict[str, Any]]) -> dict[str, list]:
  """What a table's runs were: their distinct ``steps``, ``model`` dimensions and seeds."""
  models = {json.dumps(r["model"], sort_keys=True): r["model"] for r in records}
  return {"steps": sorted({r["steps"] for r in records if r["steps"] is not None}),
          "model": [models[k] for k in sorted(models)],
          "seeds": sorted({r["seed"] for r in records})}


def _learned(protocol: str, value: float | None, limit: float) -> bool:
  """Whether a seed's value at the training length (a pre-training run's: at its final
  evaluation) shows it learned: a perplexity at most ``limit`` (:data:`LEARNED_PERPLEXITY` x
  the unigram's), a probe's accuracy at least ``limit`` (:data:`LEARNED_ACCURACY`)."""
  return value is not None and (value >= limit if protocol == "probes" else value <= limit)


def _curve(protocol: str, task: str, settings: dict[str, Any],
           members: list[tuple[dict, dict]], order: list[str], sizes: set[str],
           answer_tokens: bool = False) -> dict[str, Any]:
  """The table of one protocol, task and settings from its ``(record, document)`` pairs;
  for probes, ``answer_tokens``: the fraction of answer tokens right (chance: one symbol
  guessed), where partial length generalisation shows, instead of whole answers. Whether a
  probe seed learned is judged by its whole answers either way."""
  name = f"{protocol} of {task}"
  runs = [(r["workdir"], d) for r, d in members]
  train = _agreed([(w, d["train_length"]) for w, d in runs], "train_length", name)
  key = ("value" if protocol == "extrapolation" else
         "token_accuracy" if answer_tokens else "accuracy")
  metric = _agreed([(w, d["metric"]) for w, d in runs], "metric", name) if (
      protocol == "extrapolation") else key.replace("_", " ")
  entries, judged, reasons, references = {}, {}, {}, {}
  for record, doc in members:
    label = _label(record, sizes)
    for row in doc["rows"]:
      column = str(row["length"])
      entries.setdefault(label, {}).setdefault(column, {})[record["seed"]] = row[key]
      judged.setdefault(label, {}).setdefault(column, {})[record["seed"]] = row[
          "accuracy" if protocol == "probes" else key]
      if row["na"]:
        reasons.setdefault((label, column), []).append(row["na"])
      if protocol == "probes":
        chance = (1 / probes.probe(doc["probe"]).answer_symbols() if answer_tokens
                  else row["chance"])
        references.setdefault(column, []).append((record["workdir"], chance))
  columns = [str(n) for n in sorted({int(c) for cells in entries.values() for c in cells})]
  base = str(train) if str(train) in columns else None
  about = {"task": task, **settings}
  if protocol == "extrapolation":
    unigram = _agreed([(w, d["unigram"]) for w, d in runs], "unigram", name)
    about |= {k: _agreed([(w, d[k]) for w, d in runs], k, name)
              for k in ("tokens", "corpus_sha256", "unigram_train_tokens")}
    reference = {"label": "unigram", "values": {c: unigram for c in columns}} if (
        unigram is not None) else None
    limit = LEARNED_PERPLEXITY * unigram if metric == "perplexity" and unigram is not None else (
        None)
    criterion = (f"perplexity at the training length ({base}) at most {LEARNED_PERPLEXITY} x "
                 f"the unigram's ({_number(limit)})") if limit is not None else None
  else:
    about["probe"] = _agreed([(w, d["probe"]) for w, d in runs], "probe", name)
    reference = {"label": "chance", "values": {
        c: _agreed(references[c], f"chance at {c}", name) for c in columns}}
    limit = LEARNED_ACCURACY
    criterion = (f"whole-answer accuracy at the training length ({base}) at least "
                 f"{LEARNED_ACCURACY}")
  if base is None:
    limit = criterion = None
  ratios = protocol == "extrapolation" and metric == "perplexity" and base is not None
  rows = []
  for label in [lb for lb in order if lb in entries]:
    by_column = entries[label]
    seeds = sorted({s for values in by_column.values() for s in values})
    at_base = judged[label].get(base, {}) if base else {}
    learned = seeds if limit is None else [s for s in seeds
                                           if _learned(protocol, at_base.get(s), limit)]
    values = {c: _cell(by_column.get(c, {}), reasons.get((label, c), []), learned)
              for c in columns}
    cells = dict(values)
    if ratios:
      for c in columns:
        if c != base and by_column.get(c):
          cells[c] = _cell({s: v / at_base[s] if v is not None and at_base.get(s) else None
                            for s, v in by_column[c].items()}, reasons.get((label, c), []),
                           learned)
    unreached = {c: reasons[(label, c)][0] for c in columns if (label, c) in reasons
                 and all(v is None for v in by_column.get(c, {}).values())}
    rows.append({"label": label, "seeds": seeds, "learned": learned, "cells": cells,
                 "values": values, "in_distribution": _cell(at_base, []) if base else None,
                 "na": unreached})
  title = ("length extrapolation" if protocol == "extrapolation"
           else f"probe {task.rpartition(':')[2]}" + (" (answer tokens)" if answer_tokens else ""))
  table = {"title": title, "protocol": protocol, "task": task, "settings": settings,
           "metric": metric, "columns": columns, "train_length": train, "base": base,
           "ratios": ratios, "criterion": criterion, "reference": reference,
           "about": about | _runs([r for r, _ in members]), "rows": rows}
  return table | {"separated": separated(table)}


def separated(table: dict[str, Any]) -> dict[str, Any] | None:
  """The rows with at least :data:`MIN_SEEDS_SEPARATED` seeds that learned, at the table's
  longest length, in groups whose seed ranges do not overlap: ``{"column", "groups": [[label, ...], ...]}``, best first (lowest perplexity
  or ratio; highest accuracy), every member of a group strictly better than every member of
  the next in every seed; None with fewer than two such rows. Within a group no order is
  claimed: this is where a direction may be worded as a finding."""
  column = table["columns"][-1] if table["columns"] else None
  cells = [(row["label"], row["cells"].get(column)) for row in table["rows"] if row["learned"]]
  cells = [(label, cell) for label, cell in cells
           if cell and "median" in cell and cell["n"] >= MIN_SEEDS_SEPARATED]
  if len(cells) < 2:
    return None
  higher = table["protocol"] == "probes"
  cells.sort(key=lambda item: -item[1]["median"] if higher else item[1]["median"])
  groups, start = [], 0
  for split in range(1, len(cells)):
    ahead, behind = cells[:split], cells[split:]
    if (min(c["min"] for _, c in ahead) > max(c["max"] for _, c in behind) if higher else
        max(c["max"] for _, c in ahead) < min(c["min"] for _, c in behind)):
      groups.append([label for label, _ in cells[start:split]])
      start = split
  groups.append([label for label, _ in cells[start:]])
  return {"column": column, "groups": groups}


def _separated_text(table: dict[str, Any]) -> list[str]:
  """The line under a curve table that words its separations (:func:`separated`)."""
  found = table.get("separated")
  if not found:
    return []
  column = found["column"]
  at = f"{column} ({int(column) / table['train_length']:.3g}x)" if table["train_length"] else column
  what = ("the ratio to 1x" if table["ratios"] else table["metric"])
  if len(found["groups"]) == 1:
    return [f"Separated at {at}: no row's seed range stands apart from the others' ({what}); "
            "no ordering of these schemes is a finding here.", ""]
  order = " > ".join if table["protocol"] == "probes" else " < ".join
  return [f"Separated at {at} ({what}; rows with {MIN_SEEDS_SEPARATED} or more seeds, in groups "
          "whose seed ranges do not overlap, best first, no order claimed within a group): "
          + order("{" + ", ".join(group) + "}" for group in found["groups"]) + ".", ""]


def _finetune(dev: list[dict[str, Any]], order: list[str], sizes: set[str],
              tasks: Sequence[str]) -> dict[str, Any]:
  """The best dev score table of the fine-tuning records ``dev``; a task whose runs carry a
  ``chance_score`` (they must agree) is judged: a seed whose best score is not above it by
  more than :data:`LEARNED_MARGIN` did not learn, and the scores are the ``reference`` row
  (majority class)."""
  entries = {}
  for r in dev:
    entries.setdefault(_label(r, sizes), {}).setdefault(r["task"], {})[r["seed"]] = (
        r["best"]["score"])
  metrics = sorted({r["best"]["metric"] for r in dev})
  columns = _ordered({r["task"] for r in dev}, tasks)
  chance = {c: _agreed([(r["workdir"], r["chance_score"]) for r in dev if r["task"] == c],
                       "chance_score", f"best dev score of {c}") for c in columns}
  limits = {c: value + LEARNED_MARGIN for c, value in chance.items() if value is not None}
  learned = {(label, c): [s for s, score in sorted(by_task[c].items()) if score > limits[c]]
             for label, by_task in entries.items() for c in by_task if c in limits}
  table = _table("best dev score", "/".join(metrics), columns, entries, order, learned, True)
  return table | {"protocol": "finetune", "about": _runs(dev),
                  "reference": {"label": "majority class", "values": chance} if limits else None,
                  "criterion": (f"best dev score above the majority class's by more than "
                                f"{LEARNED_MARGIN:g} points") if limits else None}


def _reached(curve: list[dict[str, Any]], loss: float) -> int | None:
  """The first evaluated step of ``curve`` whose held-out loss is at most ``loss`` (None
  where none is)."""
  return next((point["step"] for point in curve if point["eval_loss"] <= loss), None)


def _pretraining(title: str, members: list[dict[str, Any]], order: list[str], sizes: set[str],
                 baseline: str | None) -> dict[str, Any]:
  """The pre-training table of ``members`` (records of one task, each with an eval
  ``curve``), a row per scheme: at the final evaluation the held-out ``perplexity`` and its
  ``ratio to unigram`` (the ``reference``), and the ``steps to baseline``: each seed's first
  evaluated step whose loss is at most its size's baseline row's final loss (``targets``:
  ``{baseline row: the median of its counted seeds' final losses, None where none learned}``;
  TUPE Fig. 4), None where it never is. Medians and ranges are over the seeds that learned (a
  final perplexity at most :data:`LEARNED_PERPLEXITY` x the unigram's; every seed without a
  unigram). A row's ``loss`` is the spread at each evaluated step (of every seed where none
  learned), ``final`` and ``final_step`` those of every seed's final evaluation."""
  runs, size = {}, {}  # row -> {seed: record}, row -> its size
  for r in members:
    runs.setdefault(_label(r, sizes), {})[r["seed"]] = r
    size[_label(r, sizes)] = r["size"]
  labels = [lb for lb in order if lb in runs]
  unigram = _agreed([(r["workdir"], r["curve"][-1]["eval_unigram_perplexity"]) for r in members],
                    "eval_unigram_perplexity", title)
  limit = LEARNED_PERPLEXITY * unigram if unigram is not None else None
  learned = {label: [s for s, r in sorted(seeds.items()) if limit is None or _learned(
      "pretrain", r["curve"][-1]["eval_perplexity"], limit)] for label, seeds in runs.items()}
  scheme = baseline or labels[0].rsplit(",", 1)[-1]
  base = {label: _label({"size": size[label], "scheme": scheme}, sizes) for label in labels}
  targets = {b: statistics.median([runs[b][s]["curve"][-1]["eval_loss"] for s in learned[b]])
             if learned.get(b) else None for b in sorted(set(base.values()))}
  rows = []
  for label in labels:
    seeds, counted, target = runs[label], learned[label], targets[base[label]]
    final = {s: r["curve"][-1] for s, r in seeds.items()}
    ppl = {s: point["eval_perplexity"] for s, point in final.items()}
    cells = {"perplexity": _cell(ppl, [], counted),
             "ratio to unigram": _cell({s: v / unigram if v is not None else None
                                        for s, v in ppl.items()}, [], counted)
             if unigram else None,
             "steps to baseline": _cell({s: _reached(r["curve"], target)
                                         for s, r in seeds.items()}, ["not reached"], counted)
             if target is not None else None}
    by_step = {s: {point["step"]: point["eval_loss"] for point in seeds[s]["curve"]}
               for s in counted or sorted(seeds)}
    steps = sorted({step for losses in by_step.values() for step in losses})
    rows.append({"label": label, "seeds": sorted(seeds), "learned": counted, "cells": cells,
                 "final": _cell(ppl, []),
                 "final_step": _cell({s: point["step"] for s, point in final.items()}, []),
                 "loss": {str(step): _cell({s: losses[step] for s, losses in by_step.items()
                                            if step in losses}, []) for step in steps}})
  criterion = (f"final perplexity at most {LEARNED_PERPLEXITY} x the unigram's "
               f"({_number(limit)})") if limit is not None else None
  return {"title": title, "protocol": "pretrain", "task": members[0]["task"],
          "metric": "held-out masked-LM perplexity", "columns": list(PRETRAINING_COLUMNS),
          "baseline": scheme, "targets": targets, "criterion": criterion,
          "reference": {"label": "unigram", "values": {"perplexity": unigram}} if (
              unigram is not None) else None,
          "about": {"task": members[0]["task"]} | _runs(members), "rows": rows}


def row_order(records: list[dict[str, Any]], schemes: Sequence[str] = ()) -> list[str]:
  """The records' row labels (``<scheme>``, or ``<size>,<scheme>`` with several sizes) in the
  order of ``schemes``, then any others, sorted."""
  sizes = {r["size"] for r in records}
  labels = sorted({_label(r, sizes) for r in records})
  order = [lb for s in schemes for lb in labels if lb.rsplit(",", 1)[-1] == s]
  return order + [lb for lb in labels if lb not in order]


def indicator_rows(records: list[dict[str, Any]], schemes: Sequence[str] = ()
                   ) -> list[dict[str, Any]]:
  """Wang et al.'s property indicators of every run the evaluate tool scored with
  ``indicators`` (the pre-trained models of the fine-tuning protocol), rows in the order of
  :func:`row_order`, then seed: ``[{"label", "seed", "step", "length", "examples",
  "indicators", "paper_row"}]`` (one per run and settings)."""
  from posenc_jax.analysis.indicators import TABLE2_COLUMNS  # noqa: PLC0415

  sizes = {r["size"] for r in records}
  order = row_order(records, schemes)
  rows = [{"label": _label(r, sizes), "seed": r["seed"], "step": doc["step"],
           "length": doc["length"], "examples": doc["examples"],
           "indicators": {c: doc["indicators"][c] for c in TABLE2_COLUMNS},
           "paper_row": doc["paper_row"]}
          for r in records for doc in r["eval"].values() if doc["protocol"] == "indicators"]
  return sorted(rows, key=lambda row: (order.index(row["label"]), row["seed"]))


def _indicators_markdown(rows: list[dict[str, Any]]) -> list[str]:
  """The indicators' section of ``results.md``: one line per pre-trained model, each followed
  by Wang et al.'s row for its scheme where the paper has one."""
  from posenc_jax.analysis.indicators import PAPER_TABLE2, TABLE2_COLUMNS  # noqa: PLC0415

  words = sorted({(row["examples"], row["length"]) for row in rows})
  heads = ["monotonicity (all offsets)", "monotonicity (first 20)",
           "translation invariance w/ [CLS]", "w/o [CLS]", "symmetry", "direction balance"]
  lines = ["## Property indicators of the pre-trained models (Wang et al. Table 2 layout)", "",
           "Identical-word probing of each model's first layer (" + "; ".join(
               f"{n} words at length {length}" for n, length in words) + "; `python -m "
           "posenc_jax.evaluate --protocol=indicators`), beside Wang et al.'s row for the same "
           "scheme where the paper has one (their models: BERT-base, pre-trained at full "
           "scale).", "", _line(["model", *heads]), "|---|" + "---|" * len(heads)]
  for row in rows:
    lines.append(_line([f"{row['label']} (seed {row['seed']}, step {row['step']})",
                        *(f"{row['indicators'][c]:.4f}" for c in TABLE2_COLUMNS)]))
    if row["paper_row"] in PAPER_TABLE2:
      lines.append(_line([f"Wang et al.: {row['paper_row']}",
                          *(f"{v:.4f}" for v in PAPER_TABLE2[row["paper_row"]])]))
  return lines + [""]


def tables(records: list[dict[str, Any]], schemes: Sequence[str] = (),
           tasks: Sequence[str] = (), protocol: str | None = None,
           evaluate: list[dict[str, Any]] | None = None,
           baseline: str | None = None) -> list[dict[str, Any]]:
  """The tables the records hold: best dev scores of fine-tuning runs, pre-training (one per
  pre-training task, of the runs with an eval ``curve``; steps to ``baseline``'s final loss,
  default ``schemes[0]``, else the first row), extrapolation and probe curves, one per
  protocol, task and evaluation settings (an experiment's ``protocol`` and its evaluations'
  options, :func:`~posenc_jax.comparison.plan.evaluate_options`: the settings it asks for;
  :func:`~posenc_jax.comparison.collect.evaluations`). Rows follow ``schemes`` and task
  columns ``tasks`` (then any others, sorted).

  Raises:
    CollectError: runs of one table evaluated with different settings, or differing in
      what the table states (training length, unigram, chance, corpus), named.
  """
  sizes = {r["size"] for r in records}
  order = row_order(records, schemes)
  dev = [r for r in records if r["objective"] in FINETUNE_OBJECTIVES and r["best"]]
  out = [_finetune(dev, order, sizes, tasks)] if dev else []
  pretrained = [r for r in records if r["curve"]]
  names = sorted({r["task"] for r in pretrained})
  out += [_pretraining("pre-training" + (f" ({task})" if len(names) > 1 else ""),
                       [r for r in pretrained if r["task"] == task], order, sizes,
                       baseline or (schemes[0] if schemes else None)) for task in names]
  curves = [_curve(name, task, members[0][1]["settings"], members, order, sizes, tokens)
            for (name, task, _), members in evaluations(records, protocol, evaluate).items()
            for tokens in ((False, True) if name == "probes" else (False,))]
  titles = [t["title"] for t in curves]
  for table in curves:  # several tables of one probe or protocol: told apart in the title
    if titles.count(table["title"]) > 1:
      table["title"] += f" ({table['task']}; {_settings_text(table['settings'])})"
  return out + curves


def corpus(tables_: list[dict[str, Any]]) -> str | None:
  """The corpus SHA-256 the tables' evaluations carry (None without one).

  Raises:
    CollectError: tables scored on different corpora, named.
  """
  hashes = {t["about"]["corpus_sha256"]: t["title"] for t in tables_
            if t["about"].get("corpus_sha256")}
  if len(hashes) > 1:
    raise CollectError("collect: the tables were scored on different corpora: " + ", ".join(
        f"{title} on {sha}" for sha, title in hashes.items()))
  return next(iter(hashes), None)


def _settings_text(settings: dict[str, Any]) -> str:
  return ", ".join(f"{k} {v}" for k, v in settings.items())


def _number(value: float) -> str:
  return f"{value:.4f}" if abs(value) < 100 else f"{value:.1f}"


def _step(value: float) -> str:
  return f"{value:.10g}"


def _text(cell: dict[str, Any] | None, number: Callable[[float], str] = _number) -> str:
  if cell is None:
    return "-"
  if "na" in cell:
    return "n/a"
  if cell["n"] == 1:
    return number(cell["median"])
  return f"{number(cell['median'])} ({number(cell['min'])}-{number(cell['max'])})"


def _score_text(table: dict[str, Any], row: dict[str, Any], column: str) -> str:
  """A best dev score cell: where judged, the seeds that learned out of all where some did
  not, or "did not learn" with the seeds' median and the chance score where none did."""
  cell, learned = row["cells"][column], row.get("learned", {}).get(column)
  if cell is None or learned is None:
    return _text(cell)
  scores = list(cell["seeds"].values())
  if not learned:
    return (f"did not learn ({_number(statistics.median(scores))} vs chance "
            f"{_number(table['reference']['values'][column])})")
  return _text(cell) + (f"; {len(learned)}/{len(scores)} learned" if len(learned) < len(scores)
                        else "")


def _steps_text(cell: dict[str, Any] | None, learned: list[int]) -> str:
  """A steps-to-baseline cell: the median (min-max) over the seeds of ``learned`` that reached
  the baseline's loss, then how many did not ("not reached" where none did)."""
  if cell is None:
    return "-"
  missed = sum(cell["seeds"][str(s)] is None for s in learned)
  if missed == len(learned):
    return "not reached"
  return _text(cell, _step) + (f"; {missed}/{len(learned)} not reached" if missed else "")


def _reference_text(value: float | None, chance: bool) -> str:
  if value is None:
    return ""
  return f"~0 ({value:.1e})" if chance and value < NEAR_ZERO else _number(value)


def _count(number: int | None, noun: str) -> str:
  return f"{number} {noun}" + ("" if number == 1 else "s")


def _about(table: dict[str, Any]) -> list[str]:
  """The lines above a table that say what it measured."""
  about, lines = table["about"], []
  curve = table["protocol"] in CURVES
  if curve:
    what = f"- Task {about['task']}"
    if about.get("corpus_sha256"):
      what += f" (corpus SHA-256 {about['corpus_sha256']})"
    if table["protocol"] == "extrapolation":
      stride = f", stride {about['stride']}" if "stride" in about else ""
      masks = f", masking seed {about['mask_seed']}" if "mask_seed" in about else ""
      what += (f", split {about['split']}: windows {about['windows']}{stride}, the first "
               f"{about['tokens']} tokens scored at every length{masks}")
    else:
      # In key order: results.json is written with sorted keys, and results.md is rebuilt from it.
      probe = ", ".join(f"{k}={v}" for k, v in sorted(about["probe"].items()) if k != "name")
      what += (f" ({probe}): {about['examples']} examples of seed {about['seed']} at every "
               "length")
    lines.append(what + ".")
  elif table["protocol"] == "pretrain":
    lines.append(f"- Task {about['task']}: the masked tokens of the held-out evaluations during "
                 "training (metrics.jsonl).")
  model = "; ".join(f"d_model {m['d_model']}, {_count(m['num_layers'], 'layer')}, "
                    f"{_count(m['num_heads'], 'head')}" for m in about["model"])
  steps = ", ".join(map(str, about["steps"])) or "an unknown number of"
  trained = (f"Trained {steps} steps at length {table['train_length']}" if curve else
             f"Pre-trained {steps} steps" if table["protocol"] == "pretrain" else
             f"Fine-tuned {steps} steps")
  lines.append(f"- {trained}; model {model}; seeds {', '.join(map(str, about['seeds']))}.")
  if table["protocol"] == "finetune":
    return lines + _finetune_about(table)
  if table["protocol"] == "pretrain":
    return lines + _pretraining_about(table)
  if table["reference"] and about.get("unigram_train_tokens"):
    lines.append("- Unigram (reference): the perplexity of the same tokens under add-one "
                 f"smoothed counts of {about['unigram_train_tokens']} tokens of split 'train'.")
  lines.append(_learned_line(table, "no evaluation at the training length"
                             if table["base"] is None else "no unigram reference"))
  over = "median (min-max) over the seeds" + (" that learned" if table["criterion"] else "")
  if table["ratios"]:
    lines.append(f"- Shown: {table['metric']} at {table['base']} (1x), then at each longer "
                 f"length ppl(kL)/ppl(L), computed per seed; {over}. The perplexities "
                 "themselves are in results.json.")
  else:
    lines.append(f"- Shown: {table['metric']}, {over}" + (
        ("; chance: one answer token guessed among the symbols answers are made of."
         if table["metric"] == "token accuracy" else
         "; chance: each answer token guessed among the symbols answers are made of.")
        if table["protocol"] == "probes" else "."))
  return lines


def _learned_line(table: dict[str, Any], unjudged: str, of: str = "row") -> str:
  """The line above a table that states its criterion of learning (why not, ``unjudged``,
  where it has none); a seed that did not learn leaves the median of its ``of``."""
  if not table.get("criterion"):
    return f"- Learned: not judged ({unjudged})."
  return (f"- Learned: {table['criterion']}; a seed that did not learn is left out of its "
          f"{of}'s median and range.")


def _finetune_about(table: dict[str, Any]) -> list[str]:
  """The lines above a best dev score table on its majority-class reference, where judged."""
  if not table.get("criterion"):
    return []
  return ["- Majority class (reference): the best dev score of always predicting the most "
          "frequent class (the runs' chance_score).", _learned_line(table, "", of="cell")]


def _pretraining_about(table: dict[str, Any]) -> list[str]:
  """The lines above a pre-training table after what it trained: reference, criterion and
  what each column shows."""
  lines = []
  if table["reference"]:
    lines.append("- Unigram (reference): the perplexity of the same held-out masked tokens "
                 "under add-one smoothed counts of the train split (eval_unigram_perplexity).")
  lines.append(_learned_line(table, "no unigram reference"))
  learned = " that learned" if table["criterion"] else ""
  targets = ", ".join(f"{label}'s {_number(loss)}" for label, loss in table["targets"].items()
                      if loss is not None) or f"none: no seed of {table['baseline']} learned"
  return lines + [
      "- Shown: the final evaluation's perplexity and its ratio to the unigram's, per seed; "
      "steps to baseline (TUPE Fig. 4): the first evaluated step at which a seed's held-out "
      f"loss is at most the median final loss of the baseline's seeds{learned} ({targets}), "
      f"then how many seeds never reached it; median (min-max) over the seeds{learned}."]


def _reference_row(table: dict[str, Any]) -> list[str]:
  """The texts of a table's reference row under its columns ([] without one)."""
  reference = table.get("reference")
  if not reference:
    return []
  chance = table["protocol"] == "probes"
  return [_reference_text(reference["values"].get(c), chance)
          if not table.get("ratios") or c == table["base"] else "" for c in table["columns"]]


def _line(cells: list[str]) -> str:
  """A markdown table line of ``cells`` (an empty one as ``| |``)."""
  return "|" + "|".join(f" {cell} " if cell else " " for cell in cells) + "|"


def _texts(table: dict[str, Any], row: dict[str, Any]) -> list[str]:
  """The texts of a curve or pre-training row that shows numbers, under its columns."""
  if table["protocol"] != "pretrain":
    return [_text(row["cells"][c]) for c in table["columns"]]
  cells = row["cells"]
  return [_text(cells["perplexity"]), _text(cells["ratio to unigram"]),
          _steps_text(cells["steps to baseline"], row["learned"])]


def _unlearned(table: dict[str, Any], row: dict[str, Any]) -> str:
  """What a row none of whose seeds learned reached, in its "did not learn (...)"."""
  if table["protocol"] == "pretrain":
    final = row["final"].get("median")
    return (f"ppl {_number(final) if final is not None else 'n/a'} at step "
            f"{_step(row['final_step']['median'])}, unigram "
            f"{_number(table['reference']['values']['perplexity'])}")
  median = (row["in_distribution"] or {}).get("median")
  short = ("ppl" if table["metric"] == "perplexity" else  # a probe is judged on whole answers
           "accuracy" if table["protocol"] == "probes" else table["metric"])
  said = f"{short} {_number(median)}" if median is not None else f"no {short}"
  return f"{said} at {table['base']}"


def _row(table: dict[str, Any], row: dict[str, Any]) -> tuple[list[str], list[str]]:
  """``(texts under the seed columns, texts under the other columns)`` of a row."""
  if table["protocol"] == "finetune":
    seeds = max((len(c["seeds"]) for c in row["cells"].values() if c), default=0)
    texts = [_score_text(table, row, c) for c in table["columns"]]
    if "average" in row:
      texts.append("-" if row["average"] is None else _number(row["average"]))
    return [str(seeds)], texts
  counts = [str(len(row["seeds"]))]
  if not table["criterion"]:
    return counts + ["-"], _texts(table, row)
  counts.append(f"{len(row['learned'])}/{len(row['seeds'])}")
  if row["learned"]:
    return counts, _texts(table, row)
  return counts, [f"did not learn ({_unlearned(table, row)})"] + [""] * (
      len(table["columns"]) - 1)


def _ratio_text(ratio: dict[str, float]) -> str:
  return f"{ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f})"


def _timed(cost: dict[str, Any]) -> list[str]:
  """The steps a cost table timed: ``train``, and ``infer`` where it timed inference too (a
  page measured before 2026-11-29 did not)."""
  rows = (cost.get("rows") or {}).values()
  return ["train"] + (["infer"] if any("infer_ratio" in at for row in rows
                                       for at in (row.get("lengths") or {}).values()) else [])


def _cost_heads(cost: dict[str, Any], lengths: list[str]) -> list[str]:
  """The cost columns' headers (:func:`_cost_texts`'s cells)."""
  base = cost.get("baseline")
  names = {"train": "step time", "infer": "inference"}
  return ([f"{names[kind]} at {n} (x {base})" for kind in _timed(cost) for n in lengths]
          + ([f"peak memory at {lengths[-1]} (x {base})"] if lengths else []))


def _cost_texts(cost: dict[str, Any], row: dict[str, Any], lengths: list[str]) -> list[str]:
  """A scheme's cost cells: the train step's time ratio at each length (then the inference's,
  where timed), the memory ratio at the longest (``n/a`` where not measured)."""
  at = row.get("lengths") or {}
  texts = [_ratio_text(at[n][f"{kind}_ratio"]) if n in at else "n/a"
           for kind in _timed(cost) for n in lengths]
  memory = (at.get(lengths[-1]) or {}).get("memory_ratio")
  return texts + [f"{memory:.2f}" if memory is not None else "n/a"]


def markdown(summary: dict[str, Any]) -> str:
  """``results.md``: each table with one row per scheme (and a curve's reference row), what
  it measured above it, cost columns beside the first."""
  cost = summary.get("cost") or {}
  base = cost.get("baseline")
  lines = [f"# {summary.get('experiment') or 'comparison'}", ""]
  made = summary.get("provenance")
  if made:
    lines += [f"Made by `{made['command']}` on {made['date']}, on {made['machine']}; the cells "
              f"and the cost took {made['seconds'] / 60:.1f} min in all (each one's processes, "
              "run in sequence).", ""]
  for index, table in enumerate(summary["tables"]):
    with_cost = index == 0 and cost.get("rows")
    curve = table["protocol"] in CURVES
    train = table.get("train_length")
    heads = [f"{c} ({int(c) / train:.3g}x)" if train else c for c in table["columns"]]
    heads += ["average"] if table["rows"] and "average" in table["rows"][0] else []
    cost_lengths = [str(n) for n in cost.get("lengths") or []] if with_cost else []
    heads += _cost_heads(cost, cost_lengths) if cost_lengths else []
    seeds = ["seeds"] if table["protocol"] == "finetune" else ["seeds", "learned"]
    what = table["metric"] if curve else f"{table['metric']}, median (min-max) over seeds"
    lines += [f"## {table['title']}: {what}", "", *_about(table), "",
              _line(["scheme", *seeds, *heads]), "|---|" + "---|" * (len(heads) + len(seeds))]
    reference = _reference_row(table)
    if reference:
      lines.append(_line([f"{table['reference']['label']} (reference)", *[""] * len(seeds),
                          *reference] + [""] * (len(heads) - len(reference))))
    for row in table["rows"]:
      counts, texts = _row(table, row)
      if cost_lengths:
        texts += _cost_texts(cost, cost["rows"].get(plan.scheme_of(row["label"].rsplit(",", 1)[-1]),
                                              {}),
                             cost_lengths)
      lines.append(_line([row["label"], *counts, *texts]))
    notes = sorted({f"{row['label']} at {c}: {reason}" for row in table["rows"] if curve
                    for c, reason in row["na"].items()})
    lines += [""] + [f"n/a: {n}" for n in notes] + ([""] if notes else [])
    lines += _separated_text(table) if curve else []
  if summary.get("indicators"):
    lines += _indicators_markdown(summary["indicators"])
  if cost.get("note"):
    lines += [cost["note"], ""]
  if cost.get("noise"):
    lines += [f"Timing noise, {base} timed against itself: " + ", ".join(
        f"{_ratio_text(r)} at {n}" for n, r in cost["noise"].items()) + ".", ""]
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


def _png_name(title: str) -> str:
  return re.sub(r"[^A-Za-z0-9._=,-]+", "_", title.removeprefix("length ")).strip("_") + ".png"


def write(root: str, summary: dict[str, Any]) -> list[str]:
  """Writes ``results.json``, ``results.md`` and a PNG per curve or pre-training table
  (:data:`~posenc_jax.comparison.plots.PLOTS`) into ``root``; returns the paths written (without matplotlib, the PNGs are
  skipped with one line)."""
  text = markdown(summary)
  folder = epath.Path(root)
  folder.mkdir(parents=True, exist_ok=True)
  write_atomic(folder / "results.json", json.dumps(summary, indent=2, sort_keys=True))
  write_atomic(folder / "results.md", text)
  written = [str(folder / "results.json"), str(folder / "results.md")]
  plotted = [t for t in summary["tables"] if t["protocol"] in PLOTS]
  try:
    import matplotlib  # noqa: F401, PLC0415
  except ImportError:
    if plotted:
      print(f"compare: {NO_PLOTS}", flush=True)
    return written
  for table in plotted:
    buffer = io.BytesIO()
    PLOTS[table["protocol"]](table).savefig(buffer, format="png")
    path = folder / _png_name(table["title"])
    write_atomic(path, buffer.getvalue())
    written.append(str(path))
  return written
