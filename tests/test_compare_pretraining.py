"""python -m posenc_jax.compare's finetune protocol, judged: the pre-training table (held-out
perplexity against the unigram's, steps to the baseline's final loss) and its loss curves,
and fine-tuning seeds no better than the majority class. Workdirs are faked as
tests/test_compare.py fakes them, with the ``metrics.jsonl`` a pre-training run writes."""

import json
import math
import sys

import pytest

from posenc_jax import compare as compare_cli
from posenc_jax.comparison import collect, pages, plots, report
from tests.test_compare import INDICATORS, _rewrite, fake_run

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
  text = pages.markdown(summary)
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
  assert [row.rsplit(" | ", 1)[1] for row in rows(pages.markdown({"tables": tables}))[1:]] == [
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
  assert rows(pages.markdown(summary)) == [
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
  written = pages.write(str(tmp_path / "out"), summary)
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
  assert [p.rsplit("/", 1)[1] for p in pages.write(str(tmp_path / "none"), summary)] == [
      "results.json", "results.md"]
  assert capsys.readouterr().out == f"compare: {pages.NO_PLOTS}\n"


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
  text = pages.markdown(summary)
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
     "metrics.jsonl: step 200: eval_loss: got 'low'; expected a finite number within ±1e12"),
    ("metrics.jsonl", {"step": 200, "eval_loss": 5.0, "eval_unigram_perplexity": None},
     "metrics.jsonl: step 200: eval_unigram_perplexity: got None; expected a finite number within ±1e12"),
    ("config.json", {"chance_score": "half"},
     "config.json: chance_score: got 'half'; expected a finite number within ±1e12 or null"),
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
  pages.write(str(tmp_path / "out"), summary)
  text = (tmp_path / "out" / "results.md").read_text()
  assert "did not learn (ppl 600.0 at step 100" in text and "vs chance 50.0000)" in text
  assert pages.markdown(json.loads((tmp_path / "out" / "results.json").read_text())) == text


def indicators_doc(values, paper_row):
  """An ``indicators`` document as the evaluate tool writes it, with these Table 2 values."""
  from posenc_jax.analysis.indicators import TABLE2_COLUMNS  # noqa: PLC0415
  return INDICATORS | {"paper_row": paper_row, "indicators": dict(zip(TABLE2_COLUMNS, values))}


def test_the_pretrained_models_indicators_sit_beside_the_papers_rows(tmp_path):
  for scheme, values, paper_row in (("rope", (0.5,) * 6, None),
                                    ("bert", (0.1, 0.2, 0.3, 0.4, 0.5, 1.25), "BERT-style APE")):
    folder = pretraining_run(tmp_path / "runs", scheme, 0, (5.0,))
    (folder / "eval").mkdir()
    (folder / "eval" / "indicators-examples=300,seed=0.json").write_text(
        json.dumps(indicators_doc(values, paper_row)))
  summary = compare_cli.summarise(collect.collect([str(tmp_path / "runs")]), [])
  assert [(r["label"], r["paper_row"]) for r in summary["indicators"]] == [
      ("bert", "BERT-style APE"), ("rope", None)]
  pages.write(str(tmp_path / "out"), summary)
  text = (tmp_path / "out" / "results.md").read_text()
  section = text.partition("## Property indicators")[2]
  assert rows(section)[1:4] == [
      "| bert (seed 0, step 300) | 0.1000 | 0.2000 | 0.3000 | 0.4000 | 0.5000 | 1.2500 |",
      "| Wang et al.: BERT-style APE | 0.2461 | 0.0208 | 0.5030 | 0.0143 | 0.0012 | 1.1940 |",
      "| rope (seed 0, step 300) | 0.5000 | 0.5000 | 0.5000 | 0.5000 | 0.5000 | 0.5000 |"]
  assert "300 words at length 64" in section
  assert pages.markdown(json.loads((tmp_path / "out" / "results.json").read_text())) == text


def test_a_foreign_indicators_value_is_one_line_naming_the_file_and_field(tmp_path):
  folder = pretraining_run(tmp_path, "bert", 0, (5.0,))
  (folder / "eval").mkdir()
  doc = indicators_doc((0.1,) * 6, None)
  doc["indicators"]["symmetry"] = "flat"
  path = folder / "eval" / "indicators-examples=300,seed=0.json"
  path.write_text(json.dumps(doc))
  with pytest.raises(collect.CollectError) as error:
    collect.collect([str(tmp_path)])
  assert str(error.value) == (f"collect: {path}: indicators.symmetry: got 'flat'; expected a "
                              "finite number within ±1e12")


def test_each_pretraining_of_the_finetune_protocol_is_scored_with_the_indicators():
  from posenc_jax.comparison import plan  # noqa: PLC0415
  from posenc_jax.configs.compare import get_config  # noqa: PLC0415

  cells = plan.cells(get_config("pretrain_finetune"), "/r")
  for cell in cells:
    names = [step.name for step in cell.steps]
    pretrains = cell.seed == 0  # pretrain_seeds 0: the other seeds fine-tune seed 0's model
    assert names == (["train", "evaluate indicators"] if pretrains else []) + [
        "finetune wordnet_order"], (cell.name, names)
    if pretrains:
      step = cell.steps[1]
      assert step.workdir == f"/r/{cell.scheme}/seed0/train"
      assert step.argv == ("posenc_jax.evaluate", f"--workdir={step.workdir}",
                           "--protocol=indicators")
  for experiment in ("extrapolation", "synthetic"):
    assert not [s for c in plan.cells(get_config(experiment), "/r") for s in c.steps
                if s.name == "evaluate indicators"]
  # Linformer's attention is over projected keys, with no [L, L] matrix to probe: the all
  # grid's Linformer rows pre-train and fine-tune without it (the evaluate tool refused it,
  # and the cell failed after its pre-training).
  probed = {cell.scheme: "evaluate indicators" in [step.name for step in cell.steps]
            for cell in plan.cells(get_config("pretrain_finetune,all"), "/r") if cell.seed == 0}
  assert [row for row, has in probed.items() if not has] == ["linformer", "diet_abs_lin"]
  assert probed["diet_abs_share+segment_per_head"] and probed["rope"]


def test_a_tiny_real_grid_pretrains_scores_indicators_and_fine_tunes(tmp_path):
  """train.py, the evaluate tool's indicators and finetune.py (forked from a server that
  imported JAX), at a few steps of a one-layer model: the pre-training table with its curve,
  the indicators and the fine-tuning table, and the same from --collect."""
  from posenc_jax.comparison import run  # noqa: PLC0415
  from posenc_jax.configs.compare import get_config  # noqa: PLC0415
  from tests import forked_cli  # noqa: PLC0415

  config = get_config("pretrain_finetune,quick")  # DIET-REL and none, one seed
  config.schemes = "diet_rel"
  config.train.update(dict(total_steps=2, seq_len=16, batch_size=4, eval_steps=1, log_every=1,
                           eval_every=1, checkpoint_every=2, optimizer=dict(warmup_steps=1)))
  config.train.model = dict(d_model=32, num_heads=2, mlp_dim=64, num_layers=1, max_len=16)
  config.finetune.update(dict(total_steps=2, batch_size=4, seq_len=16, log_every=1,
                              eval_every=1, checkpoint_every=2))

  def forked(command, out):
    done = forked_cli.run(command[1:], cwd=str(tmp_path), timeout=300)
    out.write(done.stdout + done.stderr)
    return done.returncode

  summary = compare_cli.compare(config, str(tmp_path / "grid"),
                                lambda cell, log: run.run_steps(cell, log, forked),
                                say=lambda line: None)
  assert not summary["failed"], summary["failed"]
  finetune, pretrain = summary["tables"]
  assert (finetune["protocol"], pretrain["protocol"]) == ("finetune", "pretrain")
  assert [r["label"] for r in finetune["rows"] + pretrain["rows"]] == ["diet_rel"] * 2
  (curve,) = [r["curve"] for r in summary["records"] if r["curve"]]
  assert [point["step"] for point in curve] == [1, 2]
  (indicators,) = summary["indicators"]
  assert (indicators["label"], indicators["seed"], indicators["length"]) == ("diet_rel", 0, 16)
  again = compare_cli.summarise(collect.collect([str(tmp_path / "grid")]), [], config)
  assert (again["tables"], again["indicators"]) == (summary["tables"], summary["indicators"])
