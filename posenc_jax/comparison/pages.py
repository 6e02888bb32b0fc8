"""``results.md``, ``results.json`` and the plots of a comparison: the tables of
:mod:`~posenc_jax.comparison.report` rendered with what each measured above it, the cost
columns beside the first table, the property indicators and the failed cells below."""

from __future__ import annotations

import io
import json
import re
import statistics
from collections.abc import Callable
from typing import Any

from etils import epath

from posenc_jax.comparison import plan
from posenc_jax.comparison.collect import CURVES
from posenc_jax.comparison.plots import PLOTS
from posenc_jax.comparison.report import MIN_SEEDS_SEPARATED, number_text
from posenc_jax.paths import write_atomic

NO_PLOTS = 'no plots (matplotlib missing): pip install "posenc-jax[analysis]"'
NEAR_ZERO = 1e-4  # a chance accuracy below this reads "~0 (<the number>)"


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


def _step(value: float) -> str:
  return f"{value:.10g}"


def _text(cell: dict[str, Any] | None, number: Callable[[float], str] = number_text) -> str:
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
    return (f"did not learn ({number_text(statistics.median(scores))} vs chance "
            f"{number_text(table['reference']['values'][column])})")
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
  return f"~0 ({value:.1e})" if chance and value < NEAR_ZERO else number_text(value)


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
  targets = ", ".join(f"{label}'s {number_text(loss)}" for label, loss in table["targets"].items()
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
    return (f"ppl {number_text(final) if final is not None else 'n/a'} at step "
            f"{_step(row['final_step']['median'])}, unigram "
            f"{number_text(table['reference']['values']['perplexity'])}")
  median = (row["in_distribution"] or {}).get("median")
  short = ("ppl" if table["metric"] == "perplexity" else  # a probe is judged on whole answers
           "accuracy" if table["protocol"] == "probes" else table["metric"])
  said = f"{short} {number_text(median)}" if median is not None else f"no {short}"
  return f"{said} at {table['base']}"


def _row(table: dict[str, Any], row: dict[str, Any]) -> tuple[list[str], list[str]]:
  """``(texts under the seed columns, texts under the other columns)`` of a row."""
  if table["protocol"] == "finetune":
    seeds = max((len(c["seeds"]) for c in row["cells"].values() if c), default=0)
    texts = [_score_text(table, row, c) for c in table["columns"]]
    if "average" in row:
      texts.append("-" if row["average"] is None else number_text(row["average"]))
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
    wall = (f" This invocation ran them {made['slots']} at a time in "
            f"{made['wall_seconds'] / 60:.1f} min of wall time." if made.get("slots", 1) > 1
            else "")
    lines += [f"Made by `{made['command']}` on {made['date']}, on {made['machine']}; the cells "
              f"and the cost took {made['seconds'] / 60:.1f} min in all (each one's processes, "
              f"run in sequence).{wall}", ""]
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
