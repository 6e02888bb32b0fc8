"""python -m posenc_jax.compare's finetune protocol, judged: the pre-training table (held-out
perplexity against the unigram's, steps to the baseline's final loss) and its loss curves,
and fine-tuning seeds no better than the majority class. Workdirs are faked as
tests/test_compare.py fakes them, with the ``metrics.jsonl`` a pre-training run writes."""

import json
import math
import sys

import pytest

from posenc_jax import compare as compare_cli
from posenc_jax.comparison import collect, plots, report
from tests.test_compare import _rewrite, fake_run

UNIGRAM = 1000.0  # the unigram's perplexity of the held-out masked tokens
# Each seed's held-out loss at steps 100, 200, 300; bert's final losses' median is 5.2.
LOSSES = {"bert": [(6.0, 5.5, 5.0), (6.1, 5.6, 5.2), (6.2, 5.8, 5.4)],
          "rope": [(5.5, 5.1, 4.9), (5.2, 5.0, 4.8), (5.9, 5.3, 5.0)]}


def pretraining_run(root, scheme, seed, losses, every=100, unigram=UNIGRAM):
  """``root/<scheme>/seed<k>/train``: a masked-LM run whose metrics.jsonl has a training line
  and then an evaluation (``losses``, in turn) every ``every`` steps."""
  folder = root / scheme / f"seed{seed}" / "train"
  fake_run(folder, scheme, seed, task="wordnet_glosses", objective="mlm",
           total_steps=every * len(losses))
  lines = []
  for index, loss in enumerate(losses, 1):
    lines += [{"step": index * every - every // 2, "loss": loss + 0.5},
              {"step": index * every, "loss": loss + 0.1, "eval_loss": loss,
               "eval_perplexity": math.exp(loss), "eval_unigram_perplexity": unigram}]
  (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
  return folder


def finetuning_run(root, scheme, seed, task, score, chance):
  """``root/<scheme>/seed<k>/<task>``: a fine-tuning run whose best dev score is ``score``
  and whose config carries its task's ``chance_score``."""
  folder = root / scheme / f"seed{seed}" / task
  fake_run(folder, scheme, seed, task=task, objective="classification", best=score)
  _rewrite(folder / "config.json", lambda config: config.update(chance_score=chance))
  return folder


def grid(root, losses=LOSSES):
  for scheme, per_seed in losses.items():
    for seed, values in enumerate(per_seed):
      pretraining_run(root, scheme, seed, values)


def pretraining_table(summary):
  (table,) = [t for t in summary["tables"] if t["protocol"] == "pretrain"]
  return table


def rows(text):
  return [line for line in text.splitlines() if line.startswith("| ") and "scheme" not in line]


def test_a_pretraining_run_s_record_holds_its_held_out_curve(tmp_path):
  workdir = pretraining_run(tmp_path, "bert", 0, (6.0, 5.0))
  (record,) = collect.collect([str(tmp_path)])
  assert record["curve"] == [  # the training lines (no eval_loss) left out
      {"step": 100, "eval_loss": 6.0, "eval_perplexity": math.exp(6.0),
       "eval_unigram_perplexity": UNIGRAM},
      {"step": 200, "eval_loss": 5.0, "eval_perplexity": math.exp(5.0),
       "eval_unigram_perplexity": UNIGRAM}]
  assert record["chance_score"] is None
  (workdir / "metrics.jsonl").write_text('{"step": 5, "eval_loss": 7.0}\n')  # an older run
  (record,) = collect.collect([str(tmp_path)])
  assert record["curve"] == [{"step": 5, "eval_loss": 7.0, "eval_perplexity": None,
                              "eval_unigram_perplexity": None}]


def test_pretraining_table_shows_perplexity_ratio_and_steps_to_the_baseline_s_final_loss(
    tmp_path):
  grid(tmp_path)
  summary = compare_cli.summarise(collect.collect([str(tmp_path)]), [])
  table = pretraining_table(summary)
  assert table["baseline"] == "bert" and table["targets"] == {"bert": 5.2}
  bert, rope = table["rows"]
  assert bert["cells"]["perplexity"]["median"] == pytest.approx(math.exp(5.2))
  assert rope["cells"]["ratio to unigram"]["median"] == pytest.approx(math.exp(4.9) / UNIGRAM)
  # bert's seeds reach 5.2 at 300, 300 and never; rope's at 200, 100 (5.2 <= 5.2) and 300.
  assert bert["cells"]["steps to baseline"]["seeds"] == {"0": 300, "1": 300, "2": None}
  assert rope["cells"]["steps to baseline"]["seeds"] == {"0": 200, "1": 100, "2": 300}
  text = report.markdown(summary)
  assert "## pre-training: held-out masked-LM perplexity, median (min-max) over seeds" in text
  assert ("| scheme | seeds | learned | perplexity | ratio to unigram | steps to baseline |"
          in text)
  assert rows(text) == [
      "| unigram (reference) | | | 1000.0 | | |",
      "| bert | 3 | 3/3 | 181.3 (148.4-221.4) | 0.1813 (0.1484-0.2214) | 300 (300-300); 1/3 "
      "not reached |",
      "| rope | 3 | 3/3 | 134.3 (121.5-148.4) | 0.1343 (0.1215-0.1484) | 200 (100-300) |"]
  lines = text.splitlines()
  assert ("- Learned: final perplexity at most 0.5 x the unigram's (500.0); a seed that did not "
          "learn is left out of its row's median and range.") in lines
  assert any(line.startswith("- Shown: ") and "(bert's 5.2000)" in line for line in lines)
  assert "- Pre-trained 300 steps; model d_model 128, 2 layers, 2 heads; seeds 0, 1, 2." in lines
  # Another baseline, given: rope's median final loss 4.9, which no seed of bert reaches.
  tables = report.tables(collect.collect([str(tmp_path)]), ["bert", "rope"], baseline="rope")
  assert tables[0]["targets"] == {"rope": 4.9}
  assert [row.rsplit(" | ", 1)[1] for row in rows(report.markdown({"tables": tables}))[1:]] == [
      "not reached |", "300 (300-300); 1/3 not reached |"]


def test_a_seed_above_half_the_unigram_s_perplexity_did_not_learn(tmp_path):
  # bert's seed 1 stopped at step 100 with perplexity 700 > 500: left out of bert's numbers
  # and of the baseline's final loss; rope, one step at perplexity 600, did not learn.
  pretraining_run(tmp_path, "bert", 0, (6.0, 5.0))
  pretraining_run(tmp_path, "bert", 1, (math.log(700.0),))
  pretraining_run(tmp_path, "rope", 0, (math.log(600.0),), every=1)
  summary = compare_cli.summarise(collect.collect([str(tmp_path)]), [])
  table = pretraining_table(summary)
  assert [row["learned"] for row in table["rows"]] == [[0], []]
  assert table["targets"] == {"bert": 5.0}
  assert rows(report.markdown(summary)) == [
      "| unigram (reference) | | | 1000.0 | | |",
      "| bert | 2 | 1/2 | 148.4 | 0.1484 | 200 |",
      "| rope | 1 | 0/1 | did not learn (ppl 600.0 at step 1, unigram 1000.0) | | |"]
  (ax,) = plots.plot_pretraining(table).axes
  lines = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
  assert lines["bert (1/2 seeds)"] == [6.0, 5.0]  # seed 1's loss at 100 left out
  assert lines["rope: did not learn"] == [pytest.approx(math.log(600.0))]  # drawn all the same


def test_the_curves_plot_shows_each_scheme_s_median_loss_and_the_unigram_s(tmp_path,
                                                                          monkeypatch, capsys):
  grid(tmp_path)
  summary = compare_cli.summarise(collect.collect([str(tmp_path)]), [])
  written = report.write(str(tmp_path / "out"), summary)
  assert str(tmp_path / "out" / "pre-training.png") in written
  assert (tmp_path / "out" / "pre-training.png").stat().st_size > 1000
  (ax,) = plots.plot_pretraining(pretraining_table(summary)).axes
  lines = {line.get_label(): line for line in ax.get_lines()}
  assert list(lines["bert (3/3 seeds)"].get_xdata()) == [100, 200, 300]
  assert list(lines["bert (3/3 seeds)"].get_ydata()) == [6.1, 5.6, 5.2]  # medians per step
  assert list(lines["unigram (train split)"].get_ydata()) == [math.log(UNIGRAM)] * 2
  assert lines["unigram (train split)"].get_linestyle() == "--"
  assert "step" in ax.get_xlabel() and "held-out masked-LM loss" in ax.get_ylabel()
  monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
  assert [p.rsplit("/", 1)[1] for p in report.write(str(tmp_path / "none"), summary)] == [
      "results.json", "results.md"]
  assert capsys.readouterr().out == f"compare: {report.NO_PLOTS}\n"


def test_a_fine_tuning_seed_not_above_the_majority_class_did_not_learn(tmp_path):
  # hypernym (chance 50): bert's seeds 52 and 55 are not above 50 + 5; diet_abs_share's none.
  scores = {"bert": {"wordnet_supersense": (40.0, 45.0, 50.0),
                     "wordnet_hypernym": (52.0, 55.0, 58.0)},
            "diet_abs_share": {"wordnet_supersense": (30.0, 35.0, 40.0),
                               "wordnet_hypernym": (50.0, 51.0, 53.0)}}
  chance = {"wordnet_supersense": 11.1, "wordnet_hypernym": 50.0}
  for scheme, by_task in scores.items():
    for task, per_seed in by_task.items():
      for seed, score in enumerate(per_seed):
        finetuning_run(tmp_path, scheme, seed, task, score, chance[task])
  summary = compare_cli.summarise(collect.collect([str(tmp_path)]), [])
  (table,) = summary["tables"]
  assert table["reference"] == {"label": "majority class", "values": chance}
  assert [row["learned"]["wordnet_hypernym"] for row in table["rows"]] == [[2], []]
  text = report.markdown(summary)
  assert ("| scheme | seeds | wordnet_hypernym | wordnet_supersense | average |"
          in text.splitlines())
  assert rows(text) == [
      "| majority class (reference) | | 50.0000 | 11.1000 | |",
      "| bert | 3 | 58.0000; 1/3 learned | 45.0000 (40.0000-50.0000) | 51.5000 |",
      "| diet_abs_share | 3 | did not learn (51.0000 vs chance 50.0000) | 35.0000 "
      "(30.0000-40.0000) | - |"]
  assert ("- Learned: best dev score above the majority class's by more than 5 points; a seed "
          "that did not learn is left out of its cell's median and range.") in text.splitlines()


@pytest.mark.parametrize("file, line, expected", [
    ("metrics.jsonl", {"step": 200, "eval_loss": "low"},
     "metrics.jsonl: step 200: eval_loss: got 'low'; expected a finite number"),
    ("metrics.jsonl", {"step": 200, "eval_loss": 5.0, "eval_unigram_perplexity": None},
     "metrics.jsonl: step 200: eval_unigram_perplexity: got None; expected a finite number"),
    ("config.json", {"chance_score": "half"},
     "config.json: chance_score: got 'half'; expected a finite number or null"),
])
def test_a_foreign_metrics_or_chance_value_is_one_line_naming_the_file_and_field(
    tmp_path, file, line, expected):
  workdir = pretraining_run(tmp_path, "bert", 0, (6.0,))
  if file == "metrics.jsonl":
    with (workdir / file).open("a") as metrics:
      metrics.write(json.dumps(line) + "\n")
  else:
    _rewrite(workdir / file, lambda config: config.update(line))
  with pytest.raises(collect.CollectError) as error:
    collect.collect([str(tmp_path)])
  assert str(error.value) == f"collect: {workdir}/{expected}"


def test_runs_of_one_pretraining_table_must_agree_on_the_unigram(tmp_path):
  pretraining_run(tmp_path, "bert", 0, (5.0,))
  pretraining_run(tmp_path, "rope", 0, (5.0,), unigram=900.0)
  with pytest.raises(collect.CollectError, match=(
      r"^collect: runs of one table \(pre-training\) differ in eval_unigram_perplexity: "
      rf"{tmp_path}/bert/seed0/train has 1000.0, {tmp_path}/rope/seed0/train has 900.0$")):
    compare_cli.summarise(collect.collect([str(tmp_path)]), [])


def test_results_md_is_rebuilt_from_results_json(tmp_path):
  grid(tmp_path / "runs")
  pretraining_run(tmp_path / "runs", "diet_abs_share", 0, (math.log(600.0),))
  for scheme, score in (("bert", 58.0), ("diet_abs_share", 51.0)):
    finetuning_run(tmp_path / "runs", scheme, 0, "wordnet_hypernym", score, 50.0)
  summary = compare_cli.summarise(collect.collect([str(tmp_path / "runs")]), [])
  assert [t["protocol"] for t in summary["tables"]] == ["finetune", "pretrain"]
  report.write(str(tmp_path / "out"), summary)
  text = (tmp_path / "out" / "results.md").read_text()
  assert "did not learn (ppl 600.0 at step 100" in text and "vs chance 50.0000)" in text
  assert report.markdown(json.loads((tmp_path / "out" / "results.json").read_text())) == text
