"""The shipped experiments of ``configs/compare.py``: their variants validate and plan, and
``--dry_run`` prints each variant's command lines (the GPU variant included) without running.
The experiments themselves are measured (docs/results/), never run here."""

import json
import pathlib

import pytest

from posenc_jax.comparison import plan
from posenc_jax.configs.compare import EXPERIMENTS, VARIANTS, get_config
from posenc_jax.configs.lm import get_config as lm_config
from posenc_jax.training.config import validate_train_config
from tests import forked_cli
from tests.test_compare import fake_run


def _train_config(config, cell: plan.Cell):
  """The train.py config a cell's first step asks for: its spec with the experiment's
  ``train`` fields (which the step passes as ``--config.<field>=`` overrides)."""
  spec = next(a for a in cell.steps[0].argv if a.startswith("--config="))
  assert spec.startswith("--config=configs/lm.py:")
  train = lm_config(spec.partition(":")[2])
  train.update(config.train.to_dict())
  assert f"--config.seq_len={train.seq_len}" in cell.steps[0].argv
  return train


@pytest.mark.parametrize("variant", ["", *VARIANTS])
def test_extrapolation_variants_plan_and_their_train_configs_validate(variant):
  config = get_config("extrapolation" + (f",{variant}" if variant else ""))
  cells = plan.cells(config, "/root")
  checked = plan.check(config)
  assert len(cells) == len(checked["schemes"]) * len(checked["seeds"])
  lengths = checked["lengths"]
  train = _train_config(config, cells[0])
  validate_train_config(train)
  assert train.task == "python_stdlib_lm" and train.model.vocab_size == 259
  assert lengths[0] == train.seq_len  # the first column is 1x
  if variant in ("", "all", "gpu"):
    assert len(checked["seeds"]) >= 3 and lengths[-1] == 16 * train.seq_len
  if variant == "all":
    assert set(checked["schemes"]) >= {"bert", "sinusoidal", "rope", "t5", "alibi", "kerple_log",
                                       "fire", "xpos", "fox", "cope", "diet_rel", "none"}
  if variant == "gpu":
    assert train.model.max_len >= train.seq_len == 512 and cells[0].size == "bert_small"


@pytest.mark.parametrize("variant", ["", *VARIANTS])
def test_synthetic_variants_plan_and_their_train_configs_validate(variant):
  """Kazemnejad et al.'s setting: trained on every copy length up to the training length,
  scored from 1x to 2x; the train.py config each cell asks for validates, its probe and
  model fields included."""
  from posenc_jax.configs.probe import get_config as probe_config  # noqa: PLC0415

  config = get_config("synthetic" + (f",{variant}" if variant else ""))
  cells = plan.cells(config, "/root")
  checked = plan.check(config)
  assert len(cells) == len(checked["schemes"]) * len(checked["seeds"])
  spec = next(a for a in cells[0].steps[0].argv if a.startswith("--config="))
  train = probe_config(spec.partition(":")[2])
  train.update(config.train.to_dict())
  validate_train_config(train)
  assert train.probe.min_symbols == 1 and train.model.max_len >= checked["lengths"][-1]
  assert checked["lengths"][0] == train.seq_len and checked["lengths"][-1] == 2 * train.seq_len - 1
  if variant != "quick":
    assert len(checked["seeds"]) >= 3
  if variant in ("all", "gpu"):
    assert set(checked["schemes"]) == {"none", "t5", "alibi", "rope", "bert"}
    assert checked["tasks"] == ["copy", "reverse"]

def _validated_steps(cell: plan.Cell):
  """The train configs of a cell's training steps, resolved as train.py and finetune.py
  resolve them (spec and the step's overrides), each validated."""
  from posenc_jax.comparison.estimate import _resolved  # noqa: PLC0415
  configs = [_resolved(step) for step in cell.steps if step.evaluation is None]
  for config in configs:
    validate_train_config(config)
  return configs


@pytest.mark.parametrize("variant", ["", *VARIANTS])
def test_pretrain_finetune_variants_plan_and_their_configs_validate(variant):
  """The seeds' experiment: every variant plans, each cell pre-trains then fine-tunes every
  task, and every config a step asks for validates (the accelerator variants' GLUE and SQuAD
  configs under TFDS's mock data: nothing is read)."""
  import tensorflow_datasets as tfds  # noqa: PLC0415
  config = get_config("pretrain_finetune" + (f",{variant}" if variant else ""))
  checked = plan.check(config)
  cells = plan.cells(config, "/root")
  assert len(cells) == len(checked["schemes"]) * len(checked["seeds"])
  with tfds.testing.mock_data(num_examples=4):
    pretrain, *finetunes = _validated_steps(cells[0])
  assert pretrain.objective == "mlm" and len(finetunes) == len(checked["tasks"])
  assert [f.task for f in finetunes] == checked["tasks"]
  if variant != "quick":
    assert len(checked["seeds"]) >= 3 and config.cost.enabled
  if variant == "":
    assert checked["schemes"] == ["bert", "tupe_a", "diet_abs_share", "diet_rel", "t5", "none"]
    assert pretrain.task == "wordnet_glosses" and "wordnet_order" in checked["tasks"]
  if variant == "all":
    assert set(checked["schemes"]) >= {
        "bert", "sinusoidal", "shaw", "sinusoidal_rpe", "t5", "tupe_a", "tupe_r", "bert_ad",
        "diet_rel", "diet_rel_share", "diet_abs", "diet_abs_share", "diet_abs_rank64_share",
        "diet_abs_share_head",
        "linformer", "diet_abs_lin", "rope", "alibi", "none"}
  if variant in ("gpu", "tpu"):
    assert config.device == variant and cells[0].size == "bert_small"
    assert pretrain.task == "wikipedia_en" and "squad_v1" in checked["tasks"]
    assert {f.objective for f in finetunes} == {"classification", "regression", "span"}


def test_glue_table_is_the_pretrain_finetune_experiment():
  assert get_config("glue_table,quick") == get_config("pretrain_finetune,quick")


def test_the_estimate_is_each_steps_flops_at_the_measured_rate():
  """A cell's estimate, recomputed from its steps' configs: total_steps x FLOPs per step /
  the device's FLOP/s + start-up, the fine-tuning runs on the pre-trained model."""
  from posenc_jax.comparison import estimate  # noqa: PLC0415
  from posenc_jax.models.config import model_config  # noqa: PLC0415
  from posenc_jax.training.config import max_predictions  # noqa: PLC0415
  from posenc_jax.training.metrics import train_flops_per_step  # noqa: PLC0415
  config = get_config("pretrain_finetune,quick")
  config.schemes = "diet_abs_share"
  (cell,) = plan.cells(config, "/root")
  pretrain, finetune = _validated_steps(cell)
  device = estimate.CPU
  expected = sum(
      c.total_steps * train_flops_per_step(model_config(pretrain.model), c.batch_size,
                                           c.seq_len, predictions_per_seq=max_predictions(c),
                                           head=c.head, num_labels=c.get("num_labels", 2))
      / device.flops_per_s + device.startup_s for c in (pretrain, finetune))
  assert estimate.cell_seconds(cell, device) == pytest.approx(expected, rel=1e-9)
  assert finetune.total_steps == config.finetune.total_steps and finetune.head == "classification"
  line = estimate.summary_line([cell] * 3, "cpu")
  assert line.startswith(f"# estimated {3 * expected / 3600:.2f} device-hours of training on "
                         "2 CPU cores for 3 cells") and device.source in line


def test_an_unknown_experiment_or_variant_is_one_line():
  with pytest.raises(ValueError, match=r"^config argument: variant 'quik' is unknown; did you "
                     r"mean 'quick'\?"):
    get_config("extrapolation,quik")
  with pytest.raises(ValueError, match=r"^config argument: experiment 'extrapolaton'"):
    get_config("extrapolaton,quick")
  assert set(EXPERIMENTS) == {"pretrain_finetune", "extrapolation", "synthetic"}


def test_the_gpu_variant_dry_runs_without_running(tmp_path):
  out = forked_cli.run(["-m", "posenc_jax.compare", "--config=configs/compare.py:extrapolation,gpu",
                        f"--workdir={tmp_path}/root", "--dry_run"],
                       cwd=str(pathlib.Path(__file__).resolve().parents[1]), timeout=60)
  assert out.returncode == 0, out.stderr
  lines = out.stdout.splitlines()
  assert lines[0] == "# sinusoidal/seed0"
  assert sum(line.startswith("# ") and "/seed" in line for line in lines) == 12
  assert any("configs/lm.py:bert_small,alibi,stdlib" in line and "--config.seq_len=512" in line
             for line in lines)
  assert any("--lengths=512,1024,2048,4096,8192" in line for line in lines)
  assert lines[-1].startswith("# estimated ") and "on one NVIDIA H200 for 12 cells" in lines[-1]
  assert not (tmp_path / "root").exists()


def test_each_window_kind_is_one_evaluate_step_and_stride_goes_with_sliding():
  config = get_config("extrapolation,quick")
  config.evaluate.update(dict(windows="non_overlapping,sliding", stride=64))
  (cell, *_) = plan.cells(config, "/root")
  evaluations = [step.evaluation for step in cell.steps[1:]]
  assert evaluations == [("extrapolation", {"tokens": 8192, "windows": "non_overlapping"}),
                         ("extrapolation", {"tokens": 8192, "stride": 64, "windows": "sliding"})]
  assert {"--tokens=8192", "--stride=64", "--windows=sliding"} <= set(cell.steps[2].argv)
  assert "--stride=64" not in cell.steps[1].argv
  config.evaluate.stride = None
  with pytest.raises(plan.PlanError, match=r"^evaluate.stride: required with evaluate.windows "
                     "'sliding'"):
    plan.cells(config, "/root")
  config.evaluate.windows = "sliding,overlap"
  with pytest.raises(plan.PlanError, match=r"^evaluate.windows: 'overlap' is unknown"):
    plan.cells(config, "/root")


def _fake_evaluation(step):
  """The file the evaluate step ``step`` writes into its (causal-LM) workdir, empty."""
  from posenc_jax.evaluation.protocols import protocol_settings  # noqa: PLC0415
  from posenc_jax.evaluation.report import settings_key  # noqa: PLC0415

  protocol, options = step.evaluation
  settings = protocol_settings(protocol, {"objective": "lm"}, **options)
  folder = pathlib.Path(step.workdir) / "eval"
  folder.mkdir(exist_ok=True)
  (folder / f"{protocol}-{settings_key(settings)}.json").write_text("{}")


def test_a_finished_cell_runs_only_the_evaluations_it_lacks(tmp_path, monkeypatch):
  """A grid rerun with another window kind evaluates the trained runs again, nothing else."""
  from posenc_jax.comparison import run

  config = get_config("extrapolation,quick")
  config.schemes = "alibi"
  config.train.total_steps = 300  # as the fake run records
  ran = []
  monkeypatch.setattr(run, "cell_records", lambda cell: [])  # the tables are not at issue
  monkeypatch.setattr(run, "keep_final_params", lambda cell, prefix, say: None)

  def fake(cell, log):  # writes what train.py and each evaluate step would
    log.write_text("fake\n")
    for step in cell.steps:
      ran.append(step.name)
      workdir = tmp_path / "alibi/seed0/train"
      if step.evaluation is None:
        fake_run(workdir, "alibi", 0, task="python_stdlib_lm", objective="lm")
        continue
      _fake_evaluation(step)

  cells = plan.cells(config, str(tmp_path))
  run.run_grid(cells, fake, say=lambda line: None)
  assert ran == ["train", "evaluate extrapolation"]
  run.run_grid(cells, fake, say=lambda line: None)  # nothing lacks: nothing runs
  assert ran == ["train", "evaluate extrapolation"]
  config.evaluate.update(dict(windows="non_overlapping,sliding", stride=128))
  lines = []
  run.run_grid(plan.cells(config, str(tmp_path)), fake, say=lines.append)
  assert ran[2:] == ["evaluate extrapolation (sliding)"]
  assert lines == [f"[1/1] alibi/seed0: finished before; running its 1 new step(s), output "
                   f"in {tmp_path}/alibi/seed0/log.txt", "[1/1] alibi/seed0: done in 0 s",
                   "compare: 1 cells, 1 finished, 0 failed, in 0.0 min"]


def test_a_training_setting_changed_on_a_finished_grid_runs_its_steps_again(tmp_path,
                                                                           monkeypatch):
  """total_steps raised from 20 to 30 on a finished grid had retrained nothing (results.json
  said 30, results.md 'Trained 20 steps'): the training step runs again (train.py resumes to
  30) with its evaluations; a setting a run cannot change runs it too, so train.py refuses it
  in one line naming the setting."""
  from posenc_jax.comparison import run

  config = get_config("extrapolation")
  config.schemes, config.seeds = "alibi", "0"
  config.train.total_steps = 20
  monkeypatch.setattr(run, "cell_records", lambda cell: [])
  monkeypatch.setattr(run, "keep_final_params", lambda cell, prefix, say: None)
  ran = []

  def fake(cell, log):
    log.write_text("fake\n")
    for step in cell.steps:
      ran.append(step.name)
      workdir = pathlib.Path(step.workdir)
      if step.evaluation is None:
        fake_run(workdir, "alibi", 0, task="python_stdlib_lm", objective="lm", step=step)
        continue
      _fake_evaluation(step)

  run.run_grid(plan.cells(config, str(tmp_path)), fake, say=lambda line: None)
  (cell,) = plan.cells(config, str(tmp_path))
  assert run.missing_steps(cell) == [] and ran == ["train", "evaluate extrapolation"]
  config.train.total_steps = 30
  (cell,) = plan.cells(config, str(tmp_path))
  assert run.changed_settings(cell.steps[0]) == ["total_steps: 20 -> 30"]
  assert [s.name for s in run.missing_steps(cell)] == ["train", "evaluate extrapolation"]
  run.run_grid([cell], fake, say=lambda line: None)
  assert ran[2:] == ["train", "evaluate extrapolation"] and run.missing_steps(cell) == []
  saved = pathlib.Path(cell.steps[0].workdir) / "config.json"
  saved.write_text(json.dumps(json.loads(saved.read_text()) | {
      "optimizer": {"learning_rate": 0.0003}}))
  config.train.optimizer = {"learning_rate": 0.5}
  (cell,) = plan.cells(config, str(tmp_path))
  assert run.changed_settings(cell.steps[0]) == ["optimizer.learning_rate: 0.0003 -> 0.5"]


def test_a_task_added_to_a_finished_grid_trains_and_evaluates_only_the_new_task(tmp_path,
                                                                                monkeypatch):
  """synthetic on copy, then on copy and reverse: the second run trains reverse alone; a
  kill inside the new training leaves a run that is not at its end, which runs again."""
  from posenc_jax.comparison import run

  config = get_config("synthetic")
  config.schemes, config.seeds = "none", "0"
  ran, kill = [], []
  monkeypatch.setattr(run, "cell_records", lambda cell: [])
  monkeypatch.setattr(run, "keep_final_params", lambda cell, prefix, say: None)

  def fake(cell, log):
    log.write_text("fake\n")
    for step in cell.steps:
      ran.append(f"{step.name} {pathlib.Path(step.workdir).name}")
      workdir = pathlib.Path(step.workdir)
      if step.evaluation is None:
        if kill:  # killed before its final step was saved
          workdir.mkdir(parents=True)
          (workdir / "config.json").write_text(json.dumps(
              {"model": {}, "total_steps": int(step.overrides()["total_steps"])}))
          raise run.CellFailed("train exited -15: killed")
        fake_run(workdir, "none", 0, task=f"probe:{workdir.name}", objective="lm", step=step)
        continue
      _fake_evaluation(step)

  run.run_grid(plan.cells(config, str(tmp_path)), fake, say=lambda line: None)
  assert ran == ["train copy copy", "evaluate probes copy"]
  config.tasks = "copy,reverse"
  kill.append(True)
  _, failed = run.run_grid(plan.cells(config, str(tmp_path)), fake, say=lambda line: None)
  assert ran[2:] == ["train reverse reverse"] and len(failed) == 1
  kill.clear()
  run.run_grid(plan.cells(config, str(tmp_path)), fake, say=lambda line: None)
  assert ran[3:] == ["train reverse reverse", "evaluate probes reverse"]
  run.run_grid(plan.cells(config, str(tmp_path)), fake, say=lambda line: None)
  assert len(ran) == 5  # all there: nothing runs


def test_help_shows_the_experiments_own_fields_variants_and_how_to_strengthen_it():
  repo = str(pathlib.Path(__file__).resolve().parents[1])
  for spec in ("extrapolation,gpu", "synthetic"):
    out = forked_cli.run(["-m", "posenc_jax.compare", f"--config=configs/compare.py:{spec}",
                          "--help"], cwd=repo, timeout=60)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert "variants: quick, all, gpu" in out.stdout and "Stronger experiments:" in out.stdout
    assert "--config.train.total_steps=" in out.stdout and "--config.optimizer" not in out.stdout
  assert "--config.lengths=512,1024,2048,4096,8192" in forked_cli.run(
      ["-m", "posenc_jax.compare", "--config=configs/compare.py:extrapolation,gpu", "--help"],
      cwd=repo, timeout=60).stdout


def test_a_probe_budget_is_raised_from_the_command_line():
  config = get_config("synthetic")
  config.train.total_steps = 3000  # the field exists: --config.train.total_steps=3000 parses
  (cell,) = plan.cells(config, "/root")[:1]
  assert "--config.total_steps=3000" in cell.steps[0].argv
