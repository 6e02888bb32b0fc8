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
Rendered by :mod:`~posenc_jax.comparison.pages` (``results.md`` states above each table what
it measured: task, settings, training steps, model, seeds and the criterion).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from typing import Any

from posenc_jax.comparison.collect import CollectError, evaluations
from posenc_jax.data import probes

FINETUNE_OBJECTIVES = ("classification", "regression", "span")
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
                 f"the unigram's ({number_text(limit)})") if limit is not None else None
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
               f"({number_text(limit)})") if limit is not None else None
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
      table["title"] += f" ({table['task']}; {settings_text(table['settings'])})"
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


def settings_text(settings: dict[str, Any]) -> str:
  return ", ".join(f"{k} {v}" for k, v in settings.items())


def number_text(value: float) -> str:
  """A table's number: four decimals, one from 100 on."""
  return f"{value:.4f}" if abs(value) < 100 else f"{value:.1f}"
