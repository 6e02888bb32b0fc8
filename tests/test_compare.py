"""python -m posenc_jax.compare: the median-over-seeds tables, collecting workdirs (local and
``gs://``), dry runs, resuming a killed grid, failed cells and the one-line errors.

Cells are faked (a runner that writes the files train.py, finetune.py and the evaluate tool
write: config.json, best.json, eval/*.json), except in the one end-to-end grid.
"""

import dataclasses
import importlib.util
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import ml_collections
import pytest
from absl import flags
from etils import epath

from posenc_jax import compare as compare_cli
from posenc_jax.cli import literal
from posenc_jax.comparison import collect, pages, plan, plots, report, run
from posenc_jax.configs.compare import get_config
from posenc_jax.evaluation import report as evaluation_report
from posenc_jax.presets import preset_config
from posenc_jax.training import checkpoint as checkpoint_lib
from posenc_jax.training.workdir import resolved_model
from tests import forked_cli
from tests.test_checkpoint import _assert_params_only, _trained
from tests.test_remote_workdir import bucket  # noqa: F401 - the fake gs:// fixture

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Each (scheme, seed, task)'s best dev score; bert's supersense seeds: 0.5, 0.7, 0.6.
SCORES = {("bert", 0): (0.5, 0.8), ("bert", 1): (0.7, 0.9), ("bert", 2): (0.6, 0.85),
          ("diet_abs_share", 0): (0.55, 0.9), ("diet_abs_share", 1): (0.65, 0.7),
          ("diet_abs_share", 2): (0.6, 0.8)}
TASKS = ("wordnet_supersense", "wordnet_hypernym")


def fake_run(folder, scheme, seed, *, task, objective, best=None, evals=(), total_steps=300,
             final_step=True, step=None):
  """A workdir as train.py / finetune.py / evaluate leave it: config.json (with the settings
  of the compare ``step`` that made it, where given), its final step's folder under
  checkpoints/ (empty; ``final_step``), best.json, eval/<protocol>-<settings>.json for each
  document of ``evals``."""
  folder.mkdir(parents=True, exist_ok=True)
  settings = {k: literal(v) for k, v in step.overrides().items()} if step else {}
  total_steps = settings.get("total_steps", total_steps)
  if final_step:
    (folder / "checkpoints" / str(total_steps)).mkdir(parents=True, exist_ok=True)
  model = resolved_model(preset_config(f"bert_tiny,{scheme}").model)
  config = {"model": model, "seed": seed, "task": task, "objective": objective,
            "total_steps": total_steps,
            "best_metric": "task_accuracy" if best is not None else None}
  for field, value in settings.items():
    *parents, name = field.split(".")
    node = config
    for parent in parents:
      node = node.setdefault(parent, {})
    node[name] = value
  (folder / "config.json").write_text(json.dumps(config))
  if best is not None:
    (folder / "best.json").write_text(json.dumps({"step": 50, "metric": "task_accuracy",
                                                  "score": best}))
  for doc in evals:
    (folder / "eval").mkdir(exist_ok=True)
    (folder / "eval" / f"{evaluation_report.file_stem(doc)}.json").write_text(json.dumps(doc))


# An indicators document (the evaluate tool's, its default settings) of a pre-trained model.
INDICATORS = {"protocol": "indicators", "settings": {"examples": 300, "seed": 0}, "step": 300,
              "length": 64, "examples": 300, "paper_row": None,
              "indicators": {"monotonicity_all": 0.3, "monotonicity_first_k": 0.1,
                             "translation_invariance_with_cls": 0.2,
                             "translation_invariance_without_cls": 0.1, "symmetry": 0.01,
                             "direction_balance": 1.1}}


def fake_glue_cell(cell, log):
  """A runner: the cell's pre-training (with its indicators) and fine-tuning workdirs, scores
  from SCORES."""
  log.write_text("fake\n")
  fake_run(log.parent / "train", cell.scheme, cell.seed, task="wordnet_glosses",
           objective="mlm", evals=[INDICATORS])
  for task, score in zip(TASKS, SCORES[(cell.scheme, cell.seed)]):
    fake_run(log.parent / task, cell.scheme, cell.seed, task=task, objective="classification",
             best=score)


def glue_config(**fields):
  """The pre-train -> fine-tune experiment on the fake cells' grid: two schemes, TASKS,
  every seed pre-training its own model (as the fake cells do)."""
  config = get_config("glue_table")
  config.cost.enabled = False
  config.update(dict(schemes="bert,diet_abs_share", tasks=",".join(TASKS), pretrain_seeds="")
                | fields)
  config.train.total_steps = config.finetune.total_steps = 300  # as the fake runs record
  return config


def test_spread_is_the_median_and_range_over_seeds():
  assert report.spread([0.5, 0.7, 0.6]) == {"median": 0.6, "min": 0.5, "max": 0.7, "n": 3}


def test_table_has_a_row_per_scheme_a_column_per_task_and_the_average(tmp_path):
  summary = compare_cli.compare(glue_config(), str(tmp_path), fake_glue_cell, say=lambda s: None)
  (table,) = summary["tables"]
  assert table["columns"] == list(TASKS)
  assert [r["label"] for r in table["rows"]] == ["bert", "diet_abs_share"]
  lines = (tmp_path / "results.md").read_text().splitlines()
  assert "| scheme | seeds | wordnet_supersense | wordnet_hypernym | average |" in lines
  assert "- Fine-tuned 300 steps; model d_model 128, 2 layers, 2 heads; seeds 0, 1, 2." in lines
  assert "| bert | 3 | 0.6000 (0.5000-0.7000) | 0.8500 (0.8000-0.9000) | 0.7250 |" in lines
  assert ("| diet_abs_share | 3 | 0.6000 (0.5500-0.6500) | 0.8000 (0.7000-0.9000) | 0.7000 |"
          in lines)
  saved = json.loads((tmp_path / "results.json").read_text())
  assert saved["tables"] == summary["tables"] and len(saved["records"]) == 6 * 3


EXTRAPOLATION = {"protocol": "extrapolation", "metric": "perplexity", "train_length": 32,
                 "settings": {"split": "validation", "windows": "non_overlapping",
                              "tokens": 4096},
                 "split": "validation", "windows": "non_overlapping", "stride": None,
                 "tokens": 4096, "unigram": 100.0, "unigram_train_tokens": 250_000,
                 "corpus_sha256": None,
                 "rows": [{"length": 32, "value": 20.0, "na": None},
                          {"length": 64, "value": 25.0, "na": None},
                          {"length": 128, "value": None, "na": "exceeds max_len"}]}


def extrapolation(values=(20.0, 25.0, None), **fields):
  """An extrapolation document of EXTRAPOLATION's lengths with ``values`` and ``fields``."""
  doc = json.loads(json.dumps(EXTRAPOLATION)) | fields
  for row, value in zip(doc["rows"], values):
    row["value"] = value
  if "tokens" in fields:
    doc["settings"]["tokens"] = fields["tokens"]
  return doc


def lm_runs(root, scheme_values, **fields):
  """``root/<scheme>/seed<k>/train`` workdirs, one per seed's values of ``scheme_values``."""
  for scheme, per_seed in scheme_values.items():
    for seed, values in enumerate(per_seed):
      fake_run(root / scheme / f"seed{seed}" / "train", scheme, seed,
               task="wordnet_glosses_lm", objective="lm",
               evals=[extrapolation(values, **fields)])


def test_extrapolation_table_shows_1x_then_ratios_per_seed_and_the_unigram(tmp_path):
  lm_runs(tmp_path, {"bert": [(20.0, 25.0, None), (22.0, 27.0, None)]})
  summary = compare_cli.summarise(collect.collect([str(tmp_path)]), [])
  text = pages.markdown(summary)
  assert "| scheme | seeds | learned | 32 (1x) | 64 (2x) | 128 (4x) |" in text
  assert "| unigram (reference) | | | 100.0 | | |" in text
  # 64: 25/20 = 1.25 and 27/22 = 1.2273 per seed, then their median and range.
  assert "| bert | 2 | 2/2 | 21.0000 (20.0000-22.0000) | 1.2386 (1.2273-1.2500) | n/a |" in text
  assert "n/a: bert at 128: exceeds max_len" in text
  (table,) = summary["tables"]
  assert table["rows"][0]["values"]["64"]["seeds"] == {"0": 25.0, "1": 27.0}  # raw numbers
  assert table["rows"][0]["values"]["64"]["median"] == 26.0
  written = pages.write(str(tmp_path / "out"), summary)
  assert (tmp_path / "out" / "extrapolation.png").stat().st_size > 1000, written


def test_results_md_states_what_each_table_measured(tmp_path):
  sha = "60056cf508adc28c2fc699b4a6d2b06c32d210c148e5e753e02ed8ec90aaf080"
  lm_runs(tmp_path, {"rope": [(20.0, 25.0, None)] * 3}, corpus_sha256=sha)
  summary = compare_cli.summarise(collect.collect([str(tmp_path)]), [])
  lines = pages.markdown(summary).splitlines()
  assert summary["corpus_sha256"] == sha
  assert (f"- Task wordnet_glosses_lm (corpus SHA-256 {sha}), split validation: windows "
          "non_overlapping, the first 4096 tokens scored at every length.") in lines
  assert ("- Trained 300 steps at length 32; model d_model 128, 2 layers, 2 heads; seeds 0, 1, "
          "2.") in lines
  assert ("- Unigram (reference): the perplexity of the same tokens under add-one smoothed "
          "counts of 250000 tokens of split 'train'.") in lines
  assert (f"- Learned: perplexity at the training length (32) at most "
          f"{report.LEARNED_PERPLEXITY} x the unigram's (50.0000); a seed that did not learn is "
          "left out of its row's median and range.") in lines
  assert json.loads(json.dumps(summary))["tables"][0]["about"]["corpus_sha256"] == sha


def test_a_seed_at_the_unigram_level_did_not_learn(tmp_path):
  # rope's seed 1 scores the unigram's perplexity at 1x: left out of rope's numbers; no seed
  # of alibi learned: its row reads so, with its in-distribution median.
  lm_runs(tmp_path, {"rope": [(20.0, 30.0, None), (100.0, 100.0, None)],
                     "alibi": [(100.0, 110.0, None), (60.0, 70.0, None)]})
  config = get_config("extrapolation")
  config.update(dict(schemes="rope,alibi", seeds="0,1"))
  config.evaluate.tokens = 4096
  summary = compare_cli.summarise(collect.collect([str(tmp_path)]), [], config)
  text = pages.markdown(summary)
  assert "| rope | 2 | 1/2 | 20.0000 | 1.5000 | n/a |" in text
  assert "| alibi | 2 | 0/2 | did not learn (ppl 80.0000 at 32) | | |" in text
  assert "n/a: alibi at 128: exceeds max_len" in text  # what it cannot reach, learned or not
  rope, alibi = summary["tables"][0]["rows"]
  assert (rope["learned"], alibi["learned"]) == ([0], [])
  png = plots.plot(summary["tables"][0])
  assert "alibi: did not learn" in [t.get_text() for t in png.legends[0].get_texts()]


@pytest.mark.parametrize("fields, why, rows", [
    (dict(rows=[{"length": 64, "value": 25.0, "na": None}]), "no evaluation at the training "
     "length", ["| unigram (reference) | | | 100.0 |", "| rope | 1 | - | 25.0000 |"]),
    (dict(metric="mlm_loss", unigram=None), "no unigram reference",
     ["| rope | 1 | - | 20.0000 | 25.0000 | n/a |"]),
])
def test_a_table_that_cannot_judge_learning_says_so_and_shows_values(tmp_path, fields, why,
                                                                        rows):
  lm_runs(tmp_path, {"rope": [(20.0, 25.0, None)]})
  _rewrite(_eval_file(tmp_path / "rope" / "seed0" / "train"), lambda d: d.update(fields))
  lines = pages.markdown(compare_cli.summarise(collect.collect([str(tmp_path)]), []))
  lines = lines.splitlines()
  assert f"- Learned: not judged ({why})." in lines
  assert any(line.startswith("- Unigram (reference)") for line in lines) == (len(rows) == 2)
  assert [line for line in lines if line.startswith("| ") and "scheme" not in line] == rows
  assert any(line.startswith("- Shown: ") and line.endswith("over the seeds.") for line in lines)


def test_probe_tables_are_one_per_probe_with_accuracy_per_length_and_chance(tmp_path):
  for scheme, accuracy in (("rope", 0.9), ("alibi", 0.5)):
    for probe in ("copy", "reverse"):
      doc = {"protocol": "probes", "train_length": 64, "settings": {"examples": 256,
                                                                   "seed": 1000003},
             "examples": 256, "seed": 1000003, "probe": {"name": "copy", "alphabet": 32,
                                                         "reverse": probe == "reverse"},
             "rows": [{"length": 64, "accuracy": accuracy, "token_accuracy": 0.99,
                       "chance": 32.0 ** -31, "na": None},
                      {"length": 128, "accuracy": 0.1, "token_accuracy": 0.4,
                       "chance": 32.0 ** -63, "na": None}]}
      fake_run(tmp_path / scheme / "seed0" / probe, scheme, 0, task=f"probe:{probe}",
               objective="lm", evals=[doc])
  config = get_config("synthetic")
  config.update(dict(tasks="copy,reverse", schemes="rope,alibi"))
  summary = compare_cli.summarise(collect.collect([str(tmp_path)]), [], config)
  assert [(t["title"], [r["label"] for r in t["rows"]]) for t in summary["tables"]] == [
      ("probe copy", ["rope", "alibi"]), ("probe copy (answer tokens)", ["rope", "alibi"]),
      ("probe reverse", ["rope", "alibi"]), ("probe reverse (answer tokens)", ["rope", "alibi"])]
  text = pages.markdown(summary)
  assert "| chance (reference) | | | ~0 (2.2e-47) | ~0 (1.5e-95) |" in text
  assert "| rope | 1 | 1/1 | 0.9000 | 0.1000 |" in text
  # Answer tokens: chance is one symbol of 32; who learned is still judged on whole answers.
  assert "| chance (reference) | | | 0.0312 | 0.0312 |" in text
  assert "| rope | 1 | 1/1 | 0.9900 | 0.4000 |" in text
  assert text.count("| alibi | 1 | 0/1 | did not learn (accuracy 0.5000 at 64) | |") == 4
  assert (f"- Learned: whole-answer accuracy at the training length (64) at least "
          f"{report.LEARNED_ACCURACY};" in text)
  assert {p.name for p in map(epath.Path, pages.write(str(tmp_path / "out"), summary))} == {
      "results.json", "results.md", "probe_copy.png", "probe_reverse.png",
      "probe_copy_answer_tokens.png", "probe_reverse_answer_tokens.png"}


def test_a_modified_row_trains_its_scheme_with_the_modifier_and_collects_as_its_own_row(
    tmp_path):
  config = get_config("synthetic")
  config.update(dict(schemes="rope,rope+randomized_positions", seeds="0",
                     randomized_positions=256))
  plain, randomized = plan.cells(config, str(tmp_path))
  assert (plain.name, randomized.name) == ("rope/seed0", "rope+randomized_positions/seed0")
  for cell in (plain, randomized):
    assert f"--config=configs/probe.py:bert_tiny,rope,{config.tasks}" in cell.steps[0].argv
  assert "--config.randomized_positions=256" in randomized.steps[0].argv
  assert not any("randomized" in a for a in plain.steps[0].argv)
  doc = {"protocol": "probes", "train_length": 21, "settings": {"examples": 256,
                                                               "seed": 1000003},
         "examples": 256, "seed": 1000003, "probe": {"name": "copy"},
         "rows": [{"length": 21, "accuracy": 1.0, "token_accuracy": 1.0, "chance": 0.0,
                   "na": None}]}
  for cell in (plain, randomized):
    fake_run(tmp_path / cell.name / "copy", "rope", 0, task="probe:copy", objective="lm",
             evals=[doc])
  _rewrite(tmp_path / randomized.name / "copy" / "config.json",
           lambda d: d.update(randomized_positions=256))
  records = collect.collect([str(tmp_path)])
  assert sorted(r["scheme"] for r in records) == ["rope", "rope+randomized_positions"]
  summary = compare_cli.summarise(records, [], config)
  assert [r["label"] for r in summary["tables"][0]["rows"]] == [
      "rope", "rope+randomized_positions"]


def test_a_model_modifier_row_pretrains_with_that_preset_and_collects_as_its_own_row(
    tmp_path):
  """``diet_abs_share+segment_per_head``: the preset joins the config spec (DIET's per-head
  segments against the plain row's input segments), and the runs' models name the rows."""
  config = get_config("pretrain_finetune")
  config.update(dict(schemes="diet_abs_share,diet_abs_share+segment_per_head", seeds="0",
                     tasks="wordnet_hypernym"))
  plain, per_head = plan.cells(config, str(tmp_path))
  assert per_head.name == "diet_abs_share+segment_per_head/seed0"
  assert ("--config=configs/pretrain.py:bert_demo,diet_abs_share,segment_per_head"
          in per_head.steps[0].argv)
  assert "--config=configs/pretrain.py:bert_demo,diet_abs_share" in plain.steps[0].argv
  assert not any("segment_per_head" in a for a in plain.steps[0].argv + per_head.steps[0].argv
                 if a.startswith("--config."))
  for cell in (plain, per_head):
    fake_run(tmp_path / cell.name / "wordnet_hypernym", "diet_abs_share", 0,
             task="wordnet_hypernym", objective="classification", best=60.0)
  _rewrite(tmp_path / per_head.name / "wordnet_hypernym" / "config.json",
           lambda d: d["model"].update(segment={"name": "segment_per_head", "num_segments": 2,
                                                "sharing": "none"}))
  records = collect.collect([str(tmp_path)])
  assert sorted(r["scheme"] for r in records) == [
      "diet_abs_share", "diet_abs_share+segment_per_head"]
  assert plan.row_name("rope", {"model": {"segment": None}}) == "rope"


def test_runs_evaluated_with_different_settings_are_never_mixed(tmp_path):
  lm_runs(tmp_path / "a", {"rope": [(20.0, 25.0, None)]})
  lm_runs(tmp_path / "b", {"alibi": [(20.0, 25.0, None)]}, tokens=16384)
  records = collect.collect([str(tmp_path)])
  with pytest.raises(collect.CollectError, match=(
      rf"^collect: runs of one extrapolation table \(wordnet_glosses_lm\) were evaluated with "
      rf"different settings: {tmp_path}/a/rope/seed0/train has tokens=4096, "
      rf"{tmp_path}/b/alibi/seed0/train has tokens=16384; ")):
    compare_cli.summarise(records, [])
  # The experiment asks for tokens=4096: a run with other settings only is named.
  config = get_config("extrapolation")
  config.evaluate.tokens = 4096
  with pytest.raises(collect.CollectError, match=(
      rf"^collect: {tmp_path}/b/alibi/seed0/train: no extrapolation evaluation with the "
      r"experiment's settings split=validation,windows=non_overlapping,tokens=4096 \(it has: "
      r"split=validation,windows=non_overlapping,tokens=16384\)")):
    compare_cli.summarise(records, [], config)
  # Given both, the experiment's are the ones in its table; without it, one table each.
  lm_runs(tmp_path / "b", {"alibi": [(30.0, 60.0, None)]})
  lm_runs(tmp_path / "a", {"rope": [(40.0, 40.0, None)]}, tokens=16384)
  records = collect.collect([str(tmp_path)])
  (table,) = compare_cli.summarise(records, [], config)["tables"]
  assert [(r["label"], r["cells"]["64"]["median"]) for r in table["rows"]] == [
      ("rope", 1.25), ("alibi", 2.0)]
  assert [t["title"] for t in compare_cli.summarise(records, [])["tables"]] == [
      "length extrapolation (wordnet_glosses_lm; split validation, windows non_overlapping, "
      "tokens 16384)", "length extrapolation (wordnet_glosses_lm; split validation, windows "
      "non_overlapping, tokens 4096)"]


def test_a_rerun_reads_finished_cells_from_their_workdirs_again(tmp_path):
  """A cell evaluated again after it finished (the experiment's settings) counts."""
  config = get_config("extrapolation")
  config.update(dict(schemes="rope,alibi", seeds="0"))
  config.evaluate.tokens = 4096
  config.cost.enabled = False

  def lm_cell(cell, log):
    log.write_text("fake\n")
    fake_run(log.parent / "train", cell.scheme, cell.seed, task="wordnet_glosses_lm",
             objective="lm", evals=[extrapolation()])

  compare_cli.compare(config, str(tmp_path), lm_cell, say=lambda s: None)
  fake_run(tmp_path / "rope" / "seed0" / "train", "rope", 0, task="wordnet_glosses_lm",
           objective="lm", evals=[extrapolation((10.0, 30.0, None))])
  ran = []
  summary = compare_cli.compare(config, str(tmp_path), lambda cell, log: ran.append(cell),
                                say=lambda s: None)
  assert not ran
  assert [(r["label"], r["cells"]["64"]["median"]) for r in summary["tables"][0]["rows"]] == [
      ("rope", 3.0), ("alibi", 1.25)]


def test_a_finished_cell_keeps_its_final_params_only_unless_told_to_keep_all(tmp_path):
  """A cell trains keeping one checkpoint and, once finished, keeps its final parameters
  only; ``keep=all`` keeps what train.py keeps, until a run with the default finds the
  cell finished (as after a compare killed between cell.json and the compaction)."""
  config = get_config("extrapolation")
  config.update(dict(schemes="rope", seeds="0"))
  config.evaluate.tokens = 4096
  config.cost.enabled = False
  config.train.total_steps = 2  # as the fake run records
  saved = {}

  def trained_cell(cell, log):  # train.py's checkpoints (tiny, with an optimizer state)
    log.write_text("fake\n")
    fake_run(log.parent / "train", cell.scheme, cell.seed, task="wordnet_glosses_lm",
             objective="lm", evals=[extrapolation()], total_steps=2, final_step=False)
    saved[cell.folder] = _trained(log.parent / "train")

  (cell,) = plan.cells(config, str(tmp_path / "params"))
  assert cell.steps[0].params_only and cell.steps[0].argv[-1] == "--config.keep_checkpoints=1"
  summary = compare_cli.compare(config, str(tmp_path / "params"), trained_cell,
                                say=lambda s: None)
  _assert_params_only(tmp_path / "params/rope/seed0/train", saved[cell.folder])
  assert summary["tables"][0]["rows"][0]["label"] == "rope"  # collected as before

  config.keep = "all"
  (cell,) = plan.cells(config, str(tmp_path / "all"))
  assert not cell.steps[0].params_only and "--config.keep_checkpoints=1" not in cell.steps[0].argv
  compare_cli.compare(config, str(tmp_path / "all"), trained_cell, say=lambda s: None)
  workdir = tmp_path / "all/rope/seed0/train"
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["1", "2"]
  assert not checkpoint_lib.params_only_step(str(workdir), 2)
  config.keep = "params"
  lines = []
  compare_cli.compare(config, str(tmp_path / "all"), trained_cell, say=lines.append)
  assert "finished before" in lines[0] and not lines[1].startswith("[1/1]")
  _assert_params_only(workdir, saved[cell.folder])

  shutil.rmtree(workdir / "checkpoints/2")  # no step left: one line, the cell still finished
  lines = []
  summary = compare_cli.compare(config, str(tmp_path / "all"), trained_cell, say=lines.append)
  assert lines[1].startswith("[1/1] rope/seed0: its checkpoints stay whole: workdir: ")
  assert "holds no complete checkpoint" in lines[1] and not summary["failed"]


def test_a_cell_evaluating_an_older_step_keeps_its_checkpoints():
  config = get_config("extrapolation")
  config.evaluate.checkpoint = "100"
  with pytest.raises(plan.PlanError, match=r"^evaluate.checkpoint: step 100 is not kept: a "
                                           r"cell keeps its final checkpoint only"):
    plan.cells(config, "/tmp/unused")
  config.keep = "all"
  assert plan.cells(config, "/tmp/unused")


def test_the_extrapolation_png_tells_a_dozen_schemes_apart(tmp_path):
  schemes = ["bert", "sinusoidal", "rope", "alibi", "t5", "diet_rel", "kerple_log", "fire",
             "xpos", "cope", "fox", "nope", "shaw"]
  schemes = [s for s in schemes if s in plan.POSITION_PRESETS]
  assert len(schemes) >= 12
  lm_runs(tmp_path, {s: [(20.0 + i, 25.0, 30.0 + i), (22.0 + i, 26.0, 31.0 + i)]
                     for i, s in enumerate(schemes)})
  (table,) = compare_cli.summarise(collect.collect([str(tmp_path)]), [])["tables"]
  figure = plots.plot(table)
  (ax,) = figure.axes
  curves = [line for line in ax.get_lines() if line.get_label() in {
      f"{s} (2/2 seeds)" for s in schemes}]
  assert len(curves) == len(schemes)
  assert len({(str(line.get_color()), line.get_marker()) for line in curves}) == len(schemes)
  assert len(ax.collections) == len(schemes)  # a min-max band per scheme
  assert figure.legends and not ax.get_legend()  # the legend beside the axes, not on them
  labels = [t.get_text() for t in figure.legends[0].get_texts()]
  assert "unigram (train split)" in labels and "training length 32" in labels
  assert [t.get_text() for t in ax.get_xticklabels()] == ["32", "64", "128"]
  assert ax.get_xlabel() and ax.get_ylabel().startswith("perplexity")


def test_collect_from_copied_workdirs_and_a_gs_bucket_gives_the_same_table(
    tmp_path, bucket):  # noqa: F811 - the fixture
  root, _ = bucket
  summary = compare_cli.compare(glue_config(), str(tmp_path / "grid"), fake_glue_cell,
                                say=lambda s: None)
  shutil.copytree(tmp_path / "grid", tmp_path / "copied")
  shutil.copytree(tmp_path / "grid", root / "runs")
  local = compare_cli.summarise(collect.collect([str(tmp_path / "copied")]), [], glue_config())
  remote = compare_cli.summarise(collect.collect(["gs://bucket/runs"]), [], glue_config())
  assert local["tables"] == remote["tables"] == summary["tables"]
  assert remote["records"][0]["workdir"].startswith("gs://bucket/runs/")


def test_dry_run_prints_every_command_and_writes_nothing(tmp_path):
  out = forked_cli.run(["-m", "posenc_jax.compare", "--config=configs/compare.py:glue_table",
                        f"--workdir={tmp_path}/grid", "--dry_run", "--config.seeds=0,1",
                        "--config.schemes=bert,diet_abs_share"],
                       cwd=str(tmp_path), timeout=60)
  assert out.returncode == 0, out.stderr
  lines = out.stdout.splitlines()
  assert [line for line in lines if line.startswith("# ") and "/seed" in line] == [
      "# bert/seed0", "# bert/seed1", "# diet_abs_share/seed0", "# diet_abs_share/seed1"]
  assert sum("-m posenc_jax.train" in line for line in lines) == 2  # pretrain_seeds: 0
  assert sum("-m posenc_jax.finetune" in line for line in lines) == 4  # wordnet_order
  seed1 = lines[lines.index("# bert/seed1") + 1]
  assert "-m posenc_jax.finetune" in seed1
  assert f"--init_checkpoint={tmp_path}/grid/bert/seed0/train" in seed1
  assert lines[-1].startswith("# estimated ") and "on 2 CPU cores for 4 cells" in lines[-1]
  assert not (tmp_path / "grid").exists()


def test_pretrain_seeds_pretrain_once_and_the_other_seeds_fine_tune_that_model():
  """DIET's and TUPE's protocol: one pre-training per scheme, fine-tuned with every seed."""
  config = get_config("pretrain_finetune")
  config.schemes, config.seeds, config.pretrain_seeds = "bert,none", "3,1,2", "1"
  config.tasks = "wordnet_order,wordnet_hypernym"
  cells = plan.cells(config, "/r")
  assert [(c.name, [s.name for s in c.steps]) for c in cells] == [
      (f"{row}/seed{seed}", (["train", "evaluate indicators"] if seed == 1 else []) + [
          "finetune wordnet_order", "finetune wordnet_hypernym"])
      for row in ("bert", "none") for seed in (3, 1, 2)]
  for cell in cells:
    for step in cell.steps[-2:]:
      assert f"--init_checkpoint=/r/{cell.scheme}/seed1/train" in step.argv
      assert f"--config.seed={cell.seed}" in step.argv
  train = next(s for s in cells[1].steps if s.name == "train")
  assert train.workdir == "/r/bert/seed1/train" and "--config.seed=1" in train.argv
  config.pretrain_seeds = ""  # every seed pre-trains its own
  assert all(c.steps[0].name == "train" and c.steps[2].argv[2] ==
             f"--init_checkpoint={c.folder}/train" for c in plan.cells(config, "/r"))


def test_a_task_can_have_its_own_budget_and_rows():
  """``finetune_by_task.<task>`` overrides ``finetune`` for that task alone;
  ``task_schemes.<task>`` names the rows fine-tuned on it (the others skip it)."""
  config = get_config("pretrain_finetune")
  config.schemes, config.seeds = "bert,diet_abs_share,none", "0,1"
  config.tasks = "wordnet_order,wordnet_hypernym"
  config.task_schemes.wordnet_hypernym = "diet_abs_share,bert"
  config.finetune_by_task.wordnet_hypernym = ml_collections.ConfigDict(dict(
      total_steps=600, checkpoint_every=600))
  steps = {c.name: {s.name: s.overrides() for s in c.steps} for c in plan.cells(config, "/r")}
  for name, by_step in steps.items():
    assert by_step["finetune wordnet_order"]["total_steps"] == "200"
    assert by_step["finetune wordnet_order"]["eval_every"] == "100"
    if name.startswith("none/"):
      assert "finetune wordnet_hypernym" not in by_step
    else:
      hypernym = by_step["finetune wordnet_hypernym"]
      assert (hypernym["total_steps"], hypernym["checkpoint_every"]) == ("600", "600")
      assert hypernym["eval_every"] == "100"  # finetune's, not overridden
      assert hypernym["seed"] == name[-1]


@pytest.mark.parametrize("field, value, expected", [
    ("finetune_by_task", ml_collections.ConfigDict(dict(wordnet_hypernim=dict(total_steps=9))),
     "finetune_by_task: task 'wordnet_hypernim' is not among the tasks; did you mean "
     "'wordnet_hypernym'?"),
    ("task_schemes", ml_collections.ConfigDict(dict(wordnet_hypernym="bert,diet_abs_shared")),
     "task_schemes.wordnet_hypernym: 'diet_abs_shared' is not among the schemes; did you mean "
     "'diet_abs_share'?"),
    ("task_schemes", ml_collections.ConfigDict(dict(wordnet_hypernym=" ")),
     "task_schemes.wordnet_hypernym: empty"),
])
def test_bad_per_task_fields_are_one_line(field, value, expected):
  config = get_config("pretrain_finetune")
  config.schemes, config.tasks = "bert,diet_abs_share", "wordnet_order,wordnet_hypernym"
  config[field] = value
  with pytest.raises(plan.PlanError, match="^" + re.escape(expected)):
    plan.cells(config, "/tmp/unused")


@pytest.mark.parametrize("experiment, value, expected", [
    ("pretrain_finetune", "4", "pretrain_seeds: 4 is not among the seeds (0, 1, 2)"),
    ("pretrain_finetune", "0,x", "pretrain_seeds: got '0,x'; allowed: comma-separated"),
    ("extrapolation", "0", "pretrain_seeds: got '0' for the extrapolation protocol"),
])
def test_bad_pretrain_seeds_are_one_line(experiment, value, expected):
  config = get_config(experiment)
  config.seeds, config.pretrain_seeds = "0,1,2", value
  with pytest.raises(plan.PlanError, match="^" + re.escape(expected)):
    plan.cells(config, "/tmp/unused")


def test_a_killed_grid_resumes_without_rerunning_finished_cells(tmp_path):
  compare_cli.compare(glue_config(), str(tmp_path / "whole"), fake_glue_cell, say=lambda s: None)

  class Killed(Exception):
    pass

  ran = []

  def dies_after_two(cell, log):
    if len(ran) == 2:
      raise Killed
    ran.append(cell.name)
    fake_glue_cell(cell, log)

  with pytest.raises(Killed):
    compare_cli.compare(glue_config(), str(tmp_path / "resumed"), dies_after_two,
                        say=lambda s: None)
  again, lines = [], []
  compare_cli.compare(glue_config(), str(tmp_path / "resumed"),
                      lambda cell, log: (again.append(cell.name), fake_glue_cell(cell, log)),
                      say=lines.append)
  assert ran == ["bert/seed0", "bert/seed1"]
  assert again == ["bert/seed2", "diet_abs_share/seed0", "diet_abs_share/seed1",
                   "diet_abs_share/seed2"]
  assert "not rerun" in lines[0] and lines[0].startswith("[1/6] bert/seed0")
  def tables(name):  # provenance holds wall times and the date, which differ run to run
    summary = json.loads((tmp_path / name / "results.json").read_text().replace(
        str(tmp_path / name), "ROOT"))
    assert set(summary.pop("provenance")) == {"command", "machine", "seconds", "date",
                                              "wall_seconds", "slots"}
    return summary

  assert tables("resumed") == tables("whole")


def test_a_failed_cell_is_reported_and_the_others_finish(tmp_path):
  def one_fails(cell, log):
    if cell.name == "bert/seed1":
      raise run.CellFailed("train exited 1: train.py: loss became NaN")
    fake_glue_cell(cell, log)

  lines = []
  summary = compare_cli.compare(glue_config(), str(tmp_path), one_fails, say=lines.append)
  assert summary["failed"] == [{"cell": "bert/seed1", "reason": "train exited 1: train.py: loss "
                                "became NaN", "log": str(tmp_path / "bert/seed1/log.txt")}]
  assert any(line.startswith("[2/6] bert/seed1: FAILED: train exited 1") for line in lines)
  assert summary["tables"][0]["rows"][0]["cells"]["wordnet_supersense"]["n"] == 2
  assert "Failed cells (not in the tables): bert/seed1" in (tmp_path / "results.md").read_text()
  assert not (tmp_path / "bert/seed1/cell.json").exists()  # a rerun tries it again


def test_randomized_positions_short_of_the_longest_evaluated_length_is_one_line():
  """N = 48 with lengths up to 64 had trained, scored and tabled the row without a word."""
  config = get_config("synthetic")
  config.update(dict(schemes="rope,rope+randomized_positions", randomized_positions=48,
                     lengths="32,64"))
  with pytest.raises(plan.PlanError, match=re.escape(
      "randomized_positions: got 48; allowed: at least the longest evaluated length (64): a "
      "randomized row's position ids are drawn from [0, N)")):
    plan.cells(config, "/tmp/unused")
  config.randomized_positions = 64
  assert plan.cells(config, "/tmp/unused")


def test_a_config_spec_fills_only_its_named_fields():
  assert plan.fill_spec("train_config", "configs/lm.py:{size},{scheme},x{{y}}", size="S",
                        scheme="R", task="") == "configs/lm.py:S,R,x{y}"


def test_the_log_gives_each_step_that_succeeded_its_seconds(tmp_path):
  """After each command's output, ``# <step>: <seconds> s``: where a cell's time went."""
  cell = plan.cells(get_config("pretrain_finetune,quick"), str(tmp_path))[0]

  def launch(command, out):
    out.write(f"ran {command[2]}\n")
    time.sleep(0.05)
    return 0

  log = epath.Path(tmp_path / "log.txt")
  run.run_steps(cell, log, launch)
  lines = log.read_text().splitlines()
  assert [line.split(":")[0] for line in lines if line.startswith("# ")] == [
      f"# {step.name}" for step in cell.steps] == ["# train", "# evaluate indicators",
                                                   "# finetune wordnet_order"]
  for line in lines:
    if line.startswith("# "):
      seconds = float(line.split(": ")[1].removesuffix(" s"))
      assert 0.05 <= seconds < 5
  assert lines[1].startswith("ran ") and lines[2].startswith("# train: ")


def test_a_failing_step_is_its_status_and_last_line_and_the_log_holds_its_output(tmp_path):
  config = get_config("extrapolation")
  config.update(dict(schemes="alibi", seeds="0"))
  config.train.seq_lenn = 16  # train.py refuses the field
  (cell,) = plan.cells(config, str(tmp_path))
  log = tmp_path / "log.txt"
  with pytest.raises(run.CellFailed, match=r"^train exited 1: train.py: config.seq_lenn: unknown "
                     "field; did you mean 'seq_len'"):
    run.run_steps(cell, epath.Path(log))
  assert log.read_text().startswith(f"$ {sys.executable} -m posenc_jax.train --config=configs/")


@pytest.mark.parametrize("field, value, expected", [
    ("schemes", "bert,rop", "schemes: 'rop' is unknown; did you mean 'rope'?"),
    ("lengths", "64,32", "lengths: got '64,32'; allowed: increasing lengths"),
    ("lengths", "0,32", "lengths: got '0,32'; allowed: comma-separated positive integers"),
    ("seeds", "0,0", "seeds: got '0,0'; each value once"),
    ("baseline", "shaw", "baseline: 'shaw' is not among the schemes"),
    ("sizes", "bert_huge", "sizes: 'bert_huge' is unknown"),
    ("schemes", "rope+randomized", "schemes: modifier 'randomized' of 'rope+randomized' is "
     "unknown; did you mean 'randomized_positions'?"),
    ("schemes", "rope+segment_per_hed", "schemes: modifier 'segment_per_hed' of "
     "'rope+segment_per_hed' is unknown; did you mean 'segment_per_head'?; allowed: "
     "randomized_positions, segment_per_head"),
    ("schemes", "rope+randomized_positions", "randomized_positions: unset, but row "
     "'rope+randomized_positions' needs its value"),
    ("keep", "param", "keep: got 'param'; did you mean 'params'?; allowed: params, all"),
    ("train_config", "configs/lm.py:{0},{scheme}", "train_config: {0} in "
     "'configs/lm.py:{0},{scheme}' is not a field it can name; allowed fields: {size}, "
     "{scheme}, {task}"),
    ("train_config", "configs/lm.py:{size},{scheme", "train_config: 'configs/lm.py:{size},"
     "{scheme' is not a config spec (expected '}' before end of string); allowed fields: "),
    ("train_config", "configs/lm.py:{scheme.__class__.__mro__}", "train_config: "
     "{scheme.__class__.__mro__} in 'configs/lm.py:{scheme.__class__.__mro__}' is not a field "
     "it can name"),
    ("train_config", "configs/lm.py:{size!r},{scheme:>9}", "train_config: {size!r} in "),
])
def test_bad_experiment_fields_are_one_line_naming_the_field(field, value, expected):
  config = get_config("extrapolation")
  config[field] = value
  with pytest.raises(plan.PlanError, match="^" + re.escape(expected)):
    plan.cells(config, "/tmp/unused")


def _rewrite(path, change):
  """``path``'s JSON changed by ``change(data)``."""
  data = json.loads(path.read_text())
  change(data)
  path.write_text(json.dumps(data))


def _eval_file(workdir):
  (path,) = (workdir / "eval").glob("*.json")
  return path


@pytest.mark.parametrize("file, change, expected", [
    ("best.json", lambda d: d.update(score="high"),
     "best.json: score: got 'high'; expected a finite number within ±1e12"),
    ("best.json", lambda d: d.pop("metric"), "best.json: metric: missing; expected a string"),
    ("eval", lambda d: d.pop("rows"), ".json: rows: missing; expected a list"),
    ("eval", lambda d: d.pop("settings"), ".json: settings: missing; expected a JSON object"),
    ("eval", lambda d: d["rows"][1].update(value="25"),
     ".json: rows[1].value: got '25'; expected a finite number within ±1e12 or null"),
    ("config.json", lambda d: d.update(seed="zero"),
     "config.json: seed: got 'zero'; expected an integer within ±2**53"),
])
def test_bad_foreign_input_is_one_line_naming_the_file_and_field(tmp_path, file, change,
                                                                 expected):
  workdir = tmp_path / "run"
  fake_run(workdir, "rope", 0, task="wordnet_glosses_lm", objective="lm", best=0.5,
           evals=[EXTRAPOLATION])
  path = _eval_file(workdir) if file == "eval" else workdir / file
  _rewrite(path, change)
  with pytest.raises(collect.CollectError) as error:
    collect.collect([str(tmp_path)])
  assert str(error.value).startswith(f"collect: {workdir}/"), error.value
  assert str(error.value).endswith(expected) and "\n" not in str(error.value)


@pytest.mark.parametrize("change, expected", [
    (lambda d: d["probe"].update(alphabet=0),
     ".json: probe.alphabet: got 0; allowed: a positive integer"),
    (lambda d: d["probe"].update(digits=4), ".json: probe.digits: not a parameter of probe "
     "'copy'; allowed: alphabet, reverse, min_symbols"),
    (lambda d: d["rows"][0].pop("token_accuracy"),
     ".json: rows[0].token_accuracy: missing; expected a finite number within ±1e12"),
])
def test_a_foreign_probe_document_is_one_line_naming_the_file_and_field(tmp_path, change,
                                                                        expected):
  workdir = tmp_path / "run"
  doc = {"protocol": "probes", "train_length": 21, "settings": {"examples": 8, "seed": 1},
         "examples": 8, "seed": 1, "probe": {"name": "copy", "alphabet": 100},
         "rows": [{"length": 21, "accuracy": 1.0, "token_accuracy": 1.0, "chance": 0.0,
                   "na": None}]}
  change(doc)
  fake_run(workdir, "rope", 0, task="probe:copy", objective="lm", evals=[doc])
  with pytest.raises(collect.CollectError) as error:
    collect.collect([str(tmp_path)])
  assert str(error.value).startswith(f"collect: {workdir}/"), error.value
  assert str(error.value).endswith(expected) and "\n" not in str(error.value)

def test_a_foreign_cost_or_results_file_is_one_line_naming_it(tmp_path):
  cost = tmp_path / "cost.json"
  cost.write_text(json.dumps({"baseline": "bert", "rows": {"rope": {
      "model": "lm", "lengths": {"32": {"train_ratio": "fast", "memory_ratio": 1.0}}}}}))
  with pytest.raises(collect.CollectError, match=(
      rf"^collect: {cost}: rows.rope.lengths.32.train_ratio: got 'fast'; expected a JSON "
      "object$")):
    collect.read_cost(epath.Path(cost))
  results = tmp_path / "results.json"
  config = get_config("extrapolation").to_dict() | {"schemes": "rope,rop"}
  results.write_text(json.dumps({"config": config}))
  with pytest.raises(collect.CollectError, match=rf"^collect: {results}: config.schemes: 'rop' "):
    collect.kept_experiment(epath.Path(results))


def _replace(path, data):
  path.write_text(json.dumps(data))


def _failed_collect(tmp_path, root):
  """``compare --collect`` of ``root`` into ``tmp_path/out`` (forked), which must exit 1
  without a traceback."""
  out = forked_cli.run(["-m", "posenc_jax.compare", "--collect", f"--workdir={tmp_path}/out",
                        str(root)], cwd=str(tmp_path), timeout=60)
  assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
  return out


@pytest.mark.parametrize("file, change, expected", [
    ("bert/seed0/wordnet_supersense/best.json", lambda p: _rewrite(p, lambda d: d.update(
        score="high")), "score: got 'high'; expected a finite number within ±1e12"),
    ("bert/seed0/cell.json", lambda p: _rewrite(p, lambda d: d.update(seconds="long")),
     "seconds: got 'long'; expected a finite number within ±1e12"),
    ("bert/seed0/cell.json", lambda p: _replace(p, [1, 2]),
     "the file holds list; expected a JSON object"),
    ("cost.json", lambda p: _replace(p, {"baseline": "bert", "rows": {}, "seconds": None}),
     "seconds: got None; expected a finite number within ±1e12"),
    ("bert/seed1/train/config.json", lambda p: _rewrite(p, lambda d: d["model"].update(
        scheme="bert")), "model.scheme: got 'bert'; expected a JSON object"),
    ("bert/seed1/train/config.json", lambda p: _rewrite(p, lambda d: d["model"].update(
        scheme=[{"name": 3}])), "model.scheme[0].name: got 3; expected a string"),
])
def test_collect_of_a_foreign_file_is_one_line_naming_it_and_writes_nothing(tmp_path, file,
                                                                            change, expected):
  """Every file --collect reads of a compare ROOT is foreign input: the cells' best.json and
  config.json, their cell.json (the seconds they took), the ROOT's cost.json."""
  root = tmp_path / "root"
  compare_cli.compare(glue_config(), str(root), fake_glue_cell, say=lambda s: None)
  change(root / file)
  out = _failed_collect(tmp_path, root)
  assert out.stderr.strip().splitlines()[-1] == f"compare: collect: {root / file}: {expected}"
  assert not (tmp_path / "out").exists()


DEEP = "[" * 100_000 + "]" * 100_000  # Python's parser recursed past its limit on it


@pytest.mark.parametrize("file, change, expected", [
    ("cost.json", lambda p: p.write_text(DEEP), "does not read as JSON (nested too deep; at "
     "most 32 levels)"),
    ("bert/seed0/cell.json", lambda p: p.write_text('{"seconds": ' + "[" * 40 + "]" * 40 + "}"),
     "does not read as JSON (nested 41 levels deep; at most 32)"),
    ("bert/seed1/train/config.json", lambda p: p.write_text(DEEP),
     "does not read as JSON (nested too deep; at most 32 levels), not the file a run writes "
     "there; move it away (nothing there was changed)"),
])
def test_collect_of_a_file_nested_too_deep_is_one_line_and_writes_nothing(tmp_path, file,
                                                                          change, expected):
  root = tmp_path / "root"
  compare_cli.compare(glue_config(), str(root), fake_glue_cell, say=lambda s: None)
  change(root / file)
  out = _failed_collect(tmp_path, root)
  lines = [ln for ln in out.stderr.strip().splitlines() if ln.startswith("compare:")]
  assert len(lines) == 1, out.stderr
  line = lines[0]
  assert line.startswith("compare: collect: ") and f"{root / file} {expected}" in line, line
  assert line.endswith(expected), line
  assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("change, expected", [
    (lambda d: d["rows"][1].update(length=10**30),
     "rows[1].length: got 1000000000000000000000000000000; expected a positive integer at "
     "most 2**31"),
    (lambda d: d["rows"][1].update(value=1e308),
     "rows[1].value: got 1e+308; expected a finite number within ±1e12 or null"),
    (lambda d: d.update(tokens=0), "tokens: got 0; expected a positive integer at most 2**31"),
])
def test_an_evaluation_number_out_of_range_is_one_line_before_anything_is_written(
    tmp_path, change, expected):
  """A length of 10**30 or a value of 1e308 had written results.json and results.md, then
  failed in the plot."""
  root = tmp_path / "runs"
  workdir = root / "run"
  fake_run(workdir, "rope", 0, task="wordnet_glosses_lm", objective="lm", best=0.5,
           evals=[EXTRAPOLATION])
  _rewrite(_eval_file(workdir), change)
  out = _failed_collect(tmp_path, root)
  lines = [ln for ln in out.stderr.strip().splitlines() if ln.startswith("compare:")]
  assert len(lines) == 1, out.stderr
  line = lines[0]
  assert line == f"compare: collect: {_eval_file(workdir)}: {expected}", line
  assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name, value, expected", [
    ("protocol", {}, "config.protocol: got {}; allowed: finetune, extrapolation, probes"),
    ("seeds", {"a": 1}, "config.seeds: got a: 1; allowed: comma-separated non-negative "),
])
def test_a_kept_experiment_field_given_an_object_is_one_line(tmp_path, name, value, expected):
  """A field of results.json's experiment holding an object (a config shows it over several
  lines) is still one line."""
  results = tmp_path / "results.json"
  results.write_text(json.dumps({"config": get_config("extrapolation").to_dict() | {
      name: value}}))
  with pytest.raises(collect.CollectError) as error:
    collect.kept_experiment(epath.Path(results))
  assert str(error.value).startswith(f"collect: {results}: {expected}"), str(error.value)
  assert "\n" not in str(error.value)


def test_collect_that_fails_writes_nothing_not_even_the_workdir(tmp_path):
  lm_runs(tmp_path / "runs", {"rope": [(20.0, 25.0, None)]})
  lm_runs(tmp_path / "runs" / "more", {"alibi": [(20.0, 25.0, None)]}, tokens=16384)
  out = forked_cli.run(["-m", "posenc_jax.compare", "--collect", f"--workdir={tmp_path}/out",
                        str(tmp_path / "runs")], cwd=str(tmp_path), timeout=60)
  assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
  assert out.stderr.strip().splitlines()[-1].startswith(
      "compare: collect: runs of one extrapolation table (wordnet_glosses_lm) were evaluated "
      f"with different settings: {tmp_path}/runs/more/alibi/seed0/train has tokens=16384, ")
  assert not (tmp_path / "out").exists()


def test_a_recollect_without_config_keeps_the_experiment_title_and_row_order(tmp_path):
  lm_runs(tmp_path, {"rope": [(20.0, 25.0, None)], "alibi": [(20.0, 26.0, None)]})
  config = get_config("extrapolation")
  config.update(dict(schemes="rope,alibi", seeds="0"))
  config.evaluate.tokens = 4096
  pages.write(str(tmp_path), compare_cli.summarise(collect.collect([str(tmp_path)]), [],
                                                    config))
  out = forked_cli.run(["-m", "posenc_jax.compare", "--collect", f"--workdir={tmp_path}"],
                       cwd=str(tmp_path), timeout=60)
  assert out.returncode == 0, out.stderr
  text = (tmp_path / "results.md").read_text()
  assert text.startswith("# extrapolation\n")
  assert text.index("| rope |") < text.index("| alibi |")
  assert json.loads((tmp_path / "results.json").read_text())["config"] == config.to_dict()


def test_collect_of_a_folder_that_holds_no_workdir_names_it(tmp_path):
  (tmp_path / "empty").mkdir()
  with pytest.raises(collect.CollectError, match=f"^collect: '{tmp_path}/empty' holds no "):
    collect.collect([str(tmp_path / "empty")])
  with pytest.raises(collect.CollectError, match="does not exist"):
    collect.collect([str(tmp_path / "missing")])


def test_collect_reads_metrics_and_config_as_the_trainer_does(tmp_path):
  """The best score from metrics.jsonl leaves a torn last line out (a run killed mid-write);
  a foreign metrics line or config.json is the trainer's one line, as a CollectError."""
  run_dir = epath.Path(tmp_path)
  (run_dir / "metrics.jsonl").write_text('{"step": 2, "acc": 0.5}\n{"step": 4, "acc": 0.7}\n'
                                         '{"step": 6, "ac')
  assert collect.best_score(run_dir, "acc") == {"step": 4, "metric": "acc", "score": 0.7}
  (run_dir / "metrics.jsonl").write_text('{"step": 2, "acc": 0.5}\n[1, 2]\n')
  with pytest.raises(collect.CollectError, match=r"^collect: workdir: .*metrics\.jsonl.* line 2"):
    collect.best_score(run_dir, "acc")
  (run_dir / "config.json").write_text("[1, 2, 3]")
  with pytest.raises(collect.CollectError, match=r"^collect: workdir: .*config\.json"):
    collect.read_run(run_dir)


@pytest.mark.parametrize("args, expected", [
    (["--config=configs/compare.py:extrapolaton"],
     "compare: config argument: experiment 'extrapolaton' is unknown; did you mean "
     "'extrapolation'?"),
    (["--config=configs/compare.py:extrapolation", "--config.schemes=bert,alibbi"],
     "compare: schemes: 'alibbi' is unknown; did you mean 'alibi'?"),
    (["--config=configs/compare.py:extrapolation", "--workdir=afile/root"],
     "compare: workdir: "),
    (["--collect", "empty"], "compare: collect: "),
])
def test_command_line_errors_are_one_line_and_write_nothing(tmp_path, args, expected):
  (tmp_path / "afile").write_text("")
  (tmp_path / "empty").mkdir()
  args = args if any(a.startswith("--workdir") for a in args) else [*args, "--workdir=out"]
  out = forked_cli.run(["-m", "posenc_jax.compare", *args], cwd=str(tmp_path), timeout=60)
  assert out.returncode != 0
  assert out.stderr.strip().splitlines()[-1].startswith(expected), out.stderr
  assert "Traceback" not in out.stderr, out.stderr
  assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "empty"]


@pytest.mark.skipif(not os.environ.get("POSENC_JAX_COMPARE_E2E"), reason="a real grid: 1.5-4 "
                    "minutes on 2 cores; set POSENC_JAX_COMPARE_E2E=1 to run it")
def test_a_real_grid_of_two_schemes_and_two_seeds_trains_collects_and_costs(tmp_path):
  """train.py (a few steps of a one-layer LM), then the evaluate tool's extrapolation where
  it is installed, the cost, and the same table from --collect."""
  config = get_config("extrapolation")
  config.update(dict(schemes="alibi,rope", seeds="0,1", lengths="16,32"))
  config.train.update(dict(total_steps=2, seq_len=16, log_every=1, eval_every=2,
                           checkpoint_every=2, optimizer=dict(warmup_steps=1)))
  config.train.batch_size = 4
  config.train.eval_steps = 1
  config.train.model = dict(d_model=32, num_heads=2, mlp_dim=64, num_layers=1)
  config.evaluate.tokens = 64
  config.cost.update(dict(batch=2, lengths="16,32", repeats=1))
  evaluates = importlib.util.find_spec("posenc_jax.evaluate") is not None

  def forked(command, out):  # the tools' own code, forked from a server that imported JAX
    done = forked_cli.run(command[1:], cwd=str(tmp_path), timeout=300)
    out.write(done.stdout + done.stderr)
    return done.returncode

  def runner(cell, log):
    run.run_steps(cell if evaluates else dataclasses.replace(cell, steps=cell.steps[:1]), log,
                  forked)

  lines = []
  summary = compare_cli.compare(config, str(tmp_path), runner, say=lines.append)
  assert not summary["failed"], summary["failed"]
  assert [(r["scheme"], r["seed"], r["objective"]) for r in summary["records"]] == [
      ("alibi", 0, "lm"), ("alibi", 1, "lm"), ("rope", 0, "lm"), ("rope", 1, "lm")]
  assert "$ " in (tmp_path / "rope/seed1/log.txt").read_text()
  for scheme, seed in (("alibi", 0), ("rope", 1)):  # trained with one checkpoint, then compacted
    workdir = tmp_path / scheme / f"seed{seed}" / "train"
    assert [p.name for p in (workdir / "checkpoints").iterdir()] == ["2"]
    assert checkpoint_lib.params_only_step(str(workdir), 2)
  cost = summary["cost"]["rows"]
  assert cost["alibi"]["lengths"]["16"]["memory_ratio"] == 1.0
  assert cost["rope"]["lengths"]["32"]["train_ratio"]["median"] > 0
  assert cost["rope"]["lengths"]["32"]["infer_ratio"]["median"] > 0
  assert cost["alibi"]["lengths"]["16"]["infer_ratio"]["median"] > 0
  assert {"16", "32"} == set(summary["cost"]["noise"])
  collected = collect.collect([str(tmp_path)])
  assert [(r["scheme"], r["seed"]) for r in collected] == [
      (r["scheme"], r["seed"]) for r in summary["records"]]  # labels read from config.json
  assert compare_cli.summarise(collected, [], config)["tables"] == summary["tables"]
  if evaluates:
    (table,) = summary["tables"]
    assert table["columns"] == ["16", "32"] and [r["label"] for r in table["rows"]] == [
        "alibi", "rope"]


def test_without_matplotlib_one_line_says_how_and_the_tables_are_written(tmp_path, monkeypatch,
                                                                         capsys):
  fake_run(tmp_path / "runs" / "bert" / "seed0" / "train", "bert", 0, task="wordnet_glosses_lm",
           objective="lm", evals=[EXTRAPOLATION])
  summary = compare_cli.summarise(collect.collect([str(tmp_path / "runs")]), [])
  monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
  written = pages.write(str(tmp_path / "out"), summary)
  assert [epath.Path(p).name for p in written] == ["results.json", "results.md"]
  assert capsys.readouterr().out == ('compare: no plots (matplotlib missing): pip install '
                                     '"posenc-jax[analysis]"\n')


def test_help_lists_the_experiments_configs_and_presets(capsys):
  from posenc_jax import cli  # noqa: PLC0415
  from posenc_jax.configs.compare import EXPERIMENTS  # noqa: PLC0415
  parse = cli.flags_parser(compare_cli.PROG, fv=flags.FlagValues(), help=compare_cli.helper())
  with pytest.raises(SystemExit) as exit_info:
    parse(["compare", "--help"])
  text = capsys.readouterr().out
  assert exit_info.value.code == 0
  assert (f"Experiments (--config=configs/compare.py:<experiment>[,<variant>]): "
          f"{', '.join(EXPERIMENTS)}; variants: ") in text
  assert "--config.schemes=sinusoidal,rope,t5,alibi" in text  # the default experiment's
  assert "--config.total_steps" not in text  # train.py's fields are not compare's
  assert "configs/compare.py" in text and "alibi" in text and "configs/pretrain.py" not in text


def test_cost_columns_show_each_length_with_the_rounds_range_and_the_noise(tmp_path):
  lm_runs(tmp_path, {"rope": [(20.0, 25.0, None)] * 3, "alibi": [(21.0, 21.0, None)] * 3})
  ratio = {"median": 1.1, "min": 1.0, "max": 1.3}
  cost = {"baseline": "rope", "lengths": [32, 64], "note": "Cost: ...",
          "noise": {"32": {"median": 1.0, "min": 0.9, "max": 1.2},
                    "64": {"median": 1.0, "min": 0.95, "max": 1.05}},
          "rows": {"rope": {"model": "lm", "lengths": {
                       "32": {"train_ratio": ratio, "memory_ratio": 1.0},
                       "64": {"train_ratio": ratio, "memory_ratio": 1.0}}},
                   "alibi": {"na": "at length 64: no"}}}
  text = pages.markdown(compare_cli.summarise(collect.collect([str(tmp_path)]), [], cost=cost))
  head = next(line for line in text.splitlines() if line.startswith("| scheme |"))
  assert head.endswith("| step time at 32 (x rope) | step time at 64 (x rope) | peak memory at "
                       "64 (x rope) |")
  assert next(line for line in text.splitlines() if line.startswith("| rope |")).endswith(
      "| 1.10 (1.00-1.30) | 1.10 (1.00-1.30) | 1.00 |")
  assert next(line for line in text.splitlines() if line.startswith("| alibi |")).endswith(
      "| n/a | n/a | n/a |")
  assert ("Timing noise, rope timed against itself: 1.00 (0.90-1.20) at 32, 1.00 (0.95-1.05) "
          "at 64.") in text


def test_inference_columns_follow_the_step_times_where_the_cost_timed_it(tmp_path):
  lm_runs(tmp_path, {"rope": [(20.0, 25.0, None)] * 3, "alibi": [(21.0, 21.0, None)] * 3})
  train = {"median": 1.1, "min": 1.0, "max": 1.3}
  infer = {"median": 0.9, "min": 0.8, "max": 1.0}
  cost = {"baseline": "rope", "lengths": [32, 64], "note": "Cost: ...", "rows": {
      "rope": {"model": "lm", "lengths": {
          n: {"train_ratio": train, "infer_ratio": infer, "memory_ratio": 1.0}
          for n in ("32", "64")}},
      "alibi": {"model": "lm", "lengths": {
          "32": {"train_ratio": train, "infer_ratio": infer, "memory_ratio": 1.2}}}}}
  text = pages.markdown(compare_cli.summarise(collect.collect([str(tmp_path)]), [], cost=cost))
  head = next(line for line in text.splitlines() if line.startswith("| scheme |"))
  assert head.endswith("| step time at 32 (x rope) | step time at 64 (x rope) | inference at 32 "
                       "(x rope) | inference at 64 (x rope) | peak memory at 64 (x rope) |")
  assert next(line for line in text.splitlines() if line.startswith("| alibi |")).endswith(
      "| 1.10 (1.00-1.30) | n/a | 0.90 (0.80-1.00) | n/a | n/a |")
  path = tmp_path / "cost.json"
  cost["rows"]["alibi"]["lengths"]["32"]["infer_ratio"] = {"median": "fast"}
  path.write_text(json.dumps(cost))
  with pytest.raises(collect.CollectError, match=(
      rf"^collect: {path}: rows.alibi.lengths.32.infer_ratio.median: got 'fast'; expected a "
      "finite number within ±1e12$")):
    collect.read_cost(epath.Path(path))


def test_only_rows_whose_seed_ranges_do_not_overlap_are_worded_as_separated(tmp_path):
  # Ratios at 64 (2x) per seed: alibi 1.0/1.05, kerple 1.02/1.04 (overlap alibi's), rope
  # 1.5/1.6, sinusoidal 1.55/2.0 (overlaps rope's); t5's second seed did not learn, so its
  # first seed alone (1.2) has no range to separate.
  lm_runs(tmp_path, {"alibi": [(20.0, 20.0, None), (20.0, 21.0, None)],
                     "kerple_log": [(50.0, 51.0, None), (50.0, 52.0, None)],
                     "rope": [(20.0, 30.0, None), (20.0, 32.0, None)],
                     "sinusoidal": [(20.0, 31.0, None), (20.0, 40.0, None)],
                     "t5": [(20.0, 24.0, None), (100.0, 100.0, None)]})
  summary = compare_cli.summarise(collect.collect([str(tmp_path)]), [])
  (table,) = summary["tables"]
  assert table["separated"] is None  # the longest column (128) is n/a for every row
  records = collect.collect([str(tmp_path)])
  for record in records:  # score only up to 64: the longest column is 64
    for doc in record["eval"].values():
      doc["rows"] = doc["rows"][:2]
  (table,) = compare_cli.summarise(records, [])["tables"]
  # t5, with one seed that learned, has no range: it is not placed.
  assert table["separated"] == {"column": "64", "groups": [["alibi", "kerple_log"],
                                                           ["rope", "sinusoidal"]]}
  assert ("Separated at 64 (2x) (the ratio to 1x; rows with 2 or more seeds, in groups whose "
          "seed ranges do not overlap, best first, no order claimed within a group): {alibi, "
          "kerple_log} < {rope, sinusoidal}.") in pages.markdown(compare_cli.summarise(records,
                                                                                      []))


def test_results_say_which_command_made_them_where_and_in_how_long(tmp_path):
  summary = compare_cli.compare(glue_config(), str(tmp_path), fake_glue_cell,
                                say=lambda line: None, command="python -m posenc_jax.compare x")
  made = summary["provenance"]
  cells = [json.loads(p.read_text())["seconds"] for p in tmp_path.glob("*/seed*/cell.json")]
  assert len(cells) == 6 and made["seconds"] == round(sum(cells), 1)
  assert made["command"] == "python -m posenc_jax.compare x" and "CPU cores" in made["machine"]
  assert made["slots"] == 1 and 0 < made["wall_seconds"] < 600
  text = (tmp_path / "results.md").read_text()
  assert f"Made by `python -m posenc_jax.compare x` on {made['date']}, on {made['machine']}" in text
  assert "at a time" not in text  # one at a time: the cells' sum is the wall time
  assert json.loads((tmp_path / "results.json").read_text())["provenance"] == made
  # Cells at once: the sum of their processes' times is not the wall time; the page says both.
  two = pages.markdown({**summary, "provenance": {**made, "slots": 2, "wall_seconds": 90.0}})
  assert "This invocation ran them 2 at a time in 1.5 min of wall time." in two


def test_sigterm_to_compare_reaches_the_running_step_which_stops_and_leaves_its_cell_unfinished(
    tmp_path, monkeypatch):
  """SIGTERM (or Ctrl-C) to compare goes to the step it is running (train.py saves its step
  and exits), and compare stops with it: the child is gone and the cell gets no cell.json,
  so the same command resumes it."""
  saved, ready = tmp_path / "saved", tmp_path / "ready"
  script = ("import pathlib, signal, sys, time\n"
            "def stop(signum, frame):\n"
            f"  pathlib.Path({str(saved)!r}).write_text('saved')\n"
            "  sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, stop)\n"
            f"pathlib.Path({str(ready)!r}).write_text('')\n"
            "time.sleep(60)\n")
  (tmp_path / "stepper.py").write_text(script)  # python -m stepper: a step that waits
  monkeypatch.setenv("PYTHONPATH", str(tmp_path))
  workdir = str(tmp_path / "rope/seed0/train")
  cell = plan.Cell("bert_tiny", "rope", 0, str(tmp_path / "rope/seed0"), (
      plan.Step("train", workdir, ("stepper", f"--workdir={workdir}")),))
  (tmp_path / "rope/seed0").mkdir(parents=True)

  def terminate_when_ready():
    while not ready.exists():
      time.sleep(0.02)
    os.kill(os.getpid(), signal.SIGTERM)

  before = signal.getsignal(signal.SIGTERM)
  threading.Thread(target=terminate_when_ready, daemon=True).start()
  start = time.perf_counter()
  with pytest.raises(run.StepInterrupted, match=r"^stopped by SIGTERM: the running step got it "
                     r"and exited 0 \(stepper --workdir=.*/rope/seed0/train\); the same "
                     r"command resumes$") as info:
    run.run_grid([cell], say=lambda line: None)
  assert time.perf_counter() - start < 30  # not the child's 60 s sleep
  assert (info.value.signum, info.value.status) == (signal.SIGTERM, 0)
  assert saved.read_text() == "saved"  # the step got the signal and stopped on it
  assert signal.getsignal(signal.SIGTERM) is before
  assert not (tmp_path / "rope/seed0" / run.MARKER).exists()  # a rerun runs the cell again


def _processes_naming(text: str) -> list[str]:
  """The command lines of the running processes that contain ``text``."""
  found = []
  for cmdline in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
    try:
      line = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:  # the process ended while we looked
      continue
    if text in line:
      found.append(line)
  return found


def test_sigterm_to_a_real_grid_stops_train_py_and_the_same_command_resumes_to_the_same_results(
    tmp_path):
  """End to end with train.py and evaluate: SIGTERM to compare while its cell trains leaves no
  process behind, compare exits with the step's status and one line, and the same command
  then finishes the grid with the results.json of a grid that was never stopped."""
  def command(root):
    return [sys.executable, "-m", "posenc_jax.compare", "--config=configs/compare.py:synthetic",
            f"--workdir={root}", "--config.schemes=rope", "--config.seeds=0",
            "--config.lengths=21", "--config.train.total_steps=300",
            "--config.train.batch_size=8", "--config.train.log_every=50",
            "--config.train.model.num_layers=1"]

  whole = subprocess.run(command(tmp_path / "whole"), cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
  assert whole.returncode == 0, whole.stderr[-3000:]
  root = tmp_path / "stopped"
  log = root / "rope" / "seed0" / "log.txt"
  proc = subprocess.Popen(command(root), cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  deadline = time.monotonic() + 300
  while not (log.exists() and re.search(r"^step 50/300", log.read_text(), re.M)):
    assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
    time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)
  _, stderr = proc.communicate(timeout=120)
  assert proc.returncode != 0
  assert stderr.strip().splitlines()[-1].startswith("compare: stopped by SIGTERM: the running "
                                                     "step got it and exited"), stderr[-3000:]
  assert "Traceback" not in stderr
  assert not _processes_naming(str(root))  # train.py is gone, not training on
  assert not (root / "rope" / "seed0" / run.MARKER).exists()
  again = subprocess.run(command(root), cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert again.returncode == 0, again.stderr[-3000:]

  def tables(folder):  # provenance holds wall times and the date, which differ run to run
    summary = json.loads((folder / "results.json").read_text().replace(str(folder), "ROOT"))
    summary.pop("provenance")
    return summary

  assert tables(root) == tables(tmp_path / "whole")


def test_a_run_of_no_size_preset_is_named_by_its_own_dimensions(tmp_path):
  """A 4 x 64 synthetic-probe model is no size preset: its record says d64L4, not bert_base
  (whose preset names no dimension of its own: the defaults, 12 x 768)."""
  folder = tmp_path / "rope" / "seed0" / "copy"
  fake_run(folder, "rope", 0, task="probe:copy", objective="lm")
  _rewrite(folder / "config.json", lambda config: config["model"].update(
      d_model=64, num_layers=4, num_heads=4, mlp_dim=256))
  (record,) = collect.collect([str(tmp_path)])
  assert record["size"] == "d64L4"
  fake_run(tmp_path / "b" / "seed0" / "train", "rope", 0, task="wordnet_glosses", objective="mlm")
  _rewrite(tmp_path / "b" / "seed0" / "train" / "config.json", lambda config: config[
      "model"].update(d_model=768, num_layers=12, num_heads=12, mlp_dim=3072))
  sizes = sorted(r["size"] for r in collect.collect([str(tmp_path)]))
  assert sizes == ["bert_base", "d64L4"]
