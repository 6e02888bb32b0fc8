"""compare's cells at once on one host (``--parallel``): the slots each cell's processes get on
GPUs, TPU chips and CPUs, the grid run through them, and two real cells on two cores giving
the sequential run's numbers."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
import sys
import threading
import time

import pytest

from posenc_jax.comparison import plan, run, slots
from posenc_jax.configs.compare import get_config
from tests.test_compare import fake_glue_cell, glue_config

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_gpus_split_evenly_into_visible_device_lists():
  got = slots.split(3, "gpu", ["0", "1", "2", "3", "4", "5", "6", "7"])
  assert [(s.name, dict(s.env), s.cpus) for s in got] == [
      ("GPU 0,1,2", {"CUDA_VISIBLE_DEVICES": "0,1,2"}, None),
      ("GPU 3,4,5", {"CUDA_VISIBLE_DEVICES": "3,4,5"}, None),
      ("GPU 6,7", {"CUDA_VISIBLE_DEVICES": "6,7"}, None)]
  assert [s.env["CUDA_VISIBLE_DEVICES"] for s in slots.split("auto", "gpu", ["2", "5"])] == [
      "2", "5"]


def test_tpu_chips_become_processes_of_their_own():
  one, two = slots.split(2, "tpu", ["0", "1", "2", "3"])
  assert dict(one.env) == {
      "TPU_VISIBLE_CHIPS": "0,1", "TPU_VISIBLE_DEVICES": "0,1",
      "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,2,1", "TPU_PROCESS_BOUNDS": "1,1,1",
      "TPU_PROCESS_PORT": "8476", "TPU_MESH_CONTROLLER_ADDRESS": "localhost:8476",
      "TPU_MESH_CONTROLLER_PORT": "8476"}
  assert two.env["TPU_VISIBLE_CHIPS"] == "2,3" and two.env["TPU_PROCESS_PORT"] == "8477"
  each = slots.split("auto", "tpu", [str(i) for i in range(8)])
  assert [s.env["TPU_CHIPS_PER_PROCESS_BOUNDS"] for s in each] == ["1,1,1"] * 8
  assert len({s.env["TPU_PROCESS_PORT"] for s in each}) == 8


@pytest.mark.parametrize("experiment, parallel", [
    ("pretrain_finetune", "auto"), ("pretrain_finetune,quick", "auto"),
    ("pretrain_finetune,all", "auto"), ("pretrain_finetune,gpu", "1"),
    ("pretrain_finetune,tpu", "1"), ("extrapolation", "1"), ("synthetic", "1")])
def test_the_cpu_pretrain_finetune_grids_run_a_cell_a_core(experiment, parallel):
  """The CPU grids of the encoder experiment run one cell a core (its page's wall time);
  the accelerator grids give every device to one cell, and the LM grids keep their pages'
  one-at-a-time runs."""
  assert get_config(experiment).parallel == parallel


def test_cpus_become_cpu_sets():
  got = slots.split(2, "cpu", ["0", "1", "2", "3", "4"])
  assert [(s.name, s.cpus, dict(s.env)) for s in got] == [
      ("CPUs 0-2", (0, 1, 2), {}), ("CPUs 3-4", (3, 4), {})]


@pytest.mark.parametrize("parallel, platform, devices, message", [
    ("3", "gpu", ["0", "1"], "parallel: got 3; allowed: at most 2, this host's gpu devices (0,1)"),
    ("0", "cpu", ["0"], "parallel: got '0'; allowed: a positive integer or auto"),
    ("two", "cpu", ["0"], "parallel: got 'two'; allowed: a positive integer or auto"),
    ("3", "tpu", ["0", "1", "2", "3", "4", "5", "6", "7", "8"],
     "parallel: a slot of 3 TPU chips; allowed: 1, 2, 4, 8 chips a slot"),
])
def test_a_parallel_the_host_cannot_give_is_one_line(parallel, platform, devices, message):
  with pytest.raises(slots.SlotError) as error:
    slots.split(parallel, platform, devices)
  assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_the_host_is_read_without_jax(monkeypatch):
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
  assert slots.host_devices() == ("gpu", ["1", "3"])
  monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
  monkeypatch.setattr(slots.shutil, "which", lambda name: None)
  monkeypatch.setattr(slots, "_tpu_chips", lambda: [])
  platform, cpus = slots.host_devices()
  assert platform == "cpu" and cpus == [str(c) for c in sorted(os.sched_getaffinity(0))]


def test_cells_run_at_once_each_on_a_slot_of_its_own_and_come_back_in_order(tmp_path):
  cells = plan.cells(glue_config(), str(tmp_path))  # 2 schemes x 3 seeds
  two = [slots.Slot("A", {"X": "a"}), slots.Slot("B", {"X": "b"})]
  using, overlap, lock = {}, [], threading.Lock()

  def runner(cell, log, slot):
    with lock:
      assert slot.name not in using.values(), "a slot held by two cells"
      using[cell.name] = slot.name
      overlap.append(len(using))
    time.sleep(0.2)
    if cell.name == "bert/seed1":
      with lock:
        del using[cell.name]
      raise run.CellFailed("train exited 1: loss became NaN")
    fake_glue_cell(cell, log)
    with lock:
      del using[cell.name]

  lines = []
  records, failed = run.run_grid(cells, runner, lines.append, slots=two)
  assert max(overlap) == 2  # two cells ran at once
  assert [f["cell"] for f in failed] == ["bert/seed1"]
  names = [f"{r['scheme']}/seed{r['seed']}" for r in records]
  assert names == sorted(names, key=[c.name for c in cells].index)  # the cells' order
  assert sum(" on A," in line or " on B," in line for line in lines) == 6
  assert lines[-1].startswith("compare: 6 cells, 5 finished, 1 failed, in ")
  assert lines[-1].endswith("on 2 slots (A; B)")


def test_the_heartbeat_names_the_running_cells_and_an_eta(tmp_path):
  cells = plan.cells(glue_config(), str(tmp_path))[:3]

  def slow(cell, log):
    time.sleep(1.3)
    fake_glue_cell(cell, log)

  lines = []
  run.run_grid(cells, slow, lines.append, heartbeat_s=1.0)
  beats = [line for line in lines if line.startswith("compare: ") and "cells done" in line]
  assert beats and "running bert/seed" in beats[0]
  assert any("ETA" in line for line in beats[1:]), beats


def test_two_real_cells_on_two_cores_give_the_sequential_numbers(tmp_path):
  """Two tiny pre-trainings (train.py subprocesses) one after the other, then at once on a
  core each: the same held-out curves to the last digit (XLA's CPU arithmetic does not depend
  on the cores it is given here)."""
  if len(os.sched_getaffinity(0)) < 2:
    pytest.skip("needs 2 cores")
  config = get_config("pretrain_finetune,quick")
  config.update(dict(schemes="diet_rel", seeds="0,1", pretrain_seeds=""))
  config.train.update(dict(total_steps=3, seq_len=16, batch_size=4, eval_steps=1, log_every=1,
                           eval_every=1, checkpoint_every=3, optimizer=dict(warmup_steps=1)))
  config.train.model = dict(d_model=32, num_heads=2, mlp_dim=64, num_layers=1, max_len=16)

  def grid(root, chosen):
    cells = [dataclasses.replace(c, steps=c.steps[:1])  # the pre-training alone
             for c in plan.cells(config, str(root))]
    records, failed = run.run_grid(cells, say=lambda line: None, slots=chosen)
    assert not failed, failed
    return [(r["seed"], r["curve"]) for r in records]

  sequential = grid(tmp_path / "one", None)
  pinned = slots.split(2, "cpu", [str(c) for c in sorted(os.sched_getaffinity(0))[:2]])
  assert grid(tmp_path / "two", pinned) == sequential
  assert [seed for seed, _ in sequential] == [0, 1] and all(len(c) == 3 for _, c in sequential)


def test_a_pinned_step_runs_on_its_slots_cores_alone():
  import subprocess  # noqa: PLC0415
  cpu = sorted(os.sched_getaffinity(0))[-1]
  out = subprocess.run(run.launched(["sh", "-c", "grep Cpus_allowed_list /proc/self/status"],
                                    (cpu,)), capture_output=True, text=True, check=True).stdout
  assert out.split()[-1] == str(cpu)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGHUP])
def test_a_step_dies_with_the_compare_that_started_it(signum):
  """kill -9 or SIGHUP to compare had left its train.py running (a rerun then trained the
  same workdir beside it): each step gets SIGTERM when its parent dies."""
  import subprocess  # noqa: PLC0415

  parent = subprocess.Popen([sys.executable, "-c", (
      "import subprocess, sys, time; from posenc_jax.comparison import run; "
      "child = subprocess.Popen(run.launched(['sleep', '120'])); "
      "print(child.pid, flush=True); time.sleep(120)")], stdout=subprocess.PIPE, text=True)
  child = int(parent.stdout.readline())
  assert os.path.exists(f"/proc/{child}")
  parent.send_signal(signum)
  parent.wait(timeout=30)
  for _ in range(100):  # the child is reaped by init once SIGTERM ends it
    if not os.path.exists(f"/proc/{child}") or "Z" in _state(child):
      break
    time.sleep(0.1)
  else:
    os.kill(child, signal.SIGKILL)
    pytest.fail(f"step {child} outlived its parent")


def _state(pid: int) -> str:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0]
  except FileNotFoundError:
    return "gone"


def test_cells_that_fine_tune_a_cells_model_run_after_it_on_its_slot(tmp_path):
  """pretrain_seeds 0: seeds 1 and 2 fine-tune seed 0's model, so a scheme's three cells are
  one group, in order, on one slot."""
  config = get_config("pretrain_finetune")
  config.schemes = "bert,diet_abs_share"
  cells = plan.cells(config, str(tmp_path))
  assert plan.groups(cells) == [[0, 1, 2], [3, 4, 5]]
  order, lock = [], threading.Lock()

  def runner(cell, log, slot):
    with lock:
      order.append((cell.name, slot.name))
    fake_glue_cell(cell, log)

  run.run_grid(cells, runner, lambda line: None,
               slots=[slots.Slot("A"), slots.Slot("B")])
  for scheme in ("bert", "diet_abs_share"):
    mine = [(n, s) for n, s in order if n.startswith(scheme + "/")]
    assert [n for n, _ in mine] == [f"{scheme}/seed{k}" for k in range(3)]
    assert len({s for _, s in mine}) == 1


TINY_GRID = ["--config=configs/compare.py:extrapolation,quick", "--config.schemes=rope",
             "--config.seeds=0,1", "--config.lengths=16,32", "--config.evaluate.tokens=64",
             "--config.train.total_steps=2", "--config.train.seq_len=16",
             "--config.train.batch_size=4", "--config.train.log_every=1",
             "--config.train.eval_every=2", "--config.train.checkpoint_every=2",
             "--config.train.optimizer.warmup_steps=1", "--config.cost.enabled=false"]


def test_a_slurm_array_task_runs_its_cell_as_the_local_run_would(tmp_path):
  """``--dry_run --format=slurm`` is a bash script (``bash -n``) with one array task per cell
  here; index 1 run locally trains and evaluates cell rope/seed1, alone, into the folder the
  local run uses, with the local run's command lines."""
  import subprocess  # noqa: PLC0415

  from tests import forked_cli  # noqa: PLC0415

  root = tmp_path / "root"
  made = forked_cli.run(["-m", "posenc_jax.compare", *TINY_GRID, f"--workdir={root}",
                         "--dry_run", "--format=slurm"], cwd=str(ROOT), timeout=120)
  assert made.returncode == 0, made.stderr[-2000:]
  script = tmp_path / "grid.sbatch"
  script.write_text(made.stdout)
  assert "#SBATCH --array=0-1" in made.stdout and "#   1: rope/seed1" in made.stdout
  assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
  done = subprocess.run(["bash", str(script)], env={**os.environ, "SLURM_ARRAY_TASK_ID": "1"},
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
  assert (root / "rope/seed1/cell.json").exists() and not (root / "rope/seed0").exists()
  config = get_config("extrapolation,quick")
  config.update(dict(schemes="rope", seeds="0,1", lengths="16,32"))
  config.evaluate.tokens = 64
  config.cost.enabled = False
  config.train.update(dict(total_steps=2, seq_len=16, batch_size=4, log_every=1, eval_every=2,
                           checkpoint_every=2, optimizer=dict(warmup_steps=1)))
  (cell,) = [c for c in plan.cells(config, str(root)) if c.name == "rope/seed1"]
  ran = [line[2:] for line in (root / "rope/seed1/log.txt").read_text().splitlines()
         if line.startswith("$ ")]
  assert ran == [" ".join(step.command()) for step in cell.steps]


@pytest.mark.parametrize("flag, line", [
    ("--format=slurmm", "compare: --format: got 'slurmm'; did you mean 'slurm'?; allowed: "
     "lines, slurm"),
    ("--task=7", "compare: --task: got 7; allowed: 0..1 (the grid's tasks)"),
    ("--parallel=99", "compare: parallel: got 99; allowed: at most"),
    ("--config.parallel=99", "compare: parallel: got 99; allowed: at most"),  # the field's
])
def test_a_bad_format_task_or_parallel_is_one_line(flag, line, tmp_path):
  from tests import forked_cli  # noqa: PLC0415
  done = forked_cli.run(["-m", "posenc_jax.compare", *TINY_GRID, f"--workdir={tmp_path / 'r'}",
                         flag, *(["--dry_run"] if "format" in flag else [])],
                        cwd=str(ROOT), timeout=120)
  assert done.returncode == 1 and done.stderr.strip().splitlines()[-1].startswith(line), (
      done.stderr[-1000:])
  assert "Traceback" not in done.stderr and not (tmp_path / "r").exists()


def test_sigterm_reaches_every_running_step_and_no_further_cell_starts(tmp_path):
  """Two cells run at once (steps that note SIGTERM and exit as a trainer that saved would);
  SIGTERM to compare reaches both, the third cell never starts, and once both have stopped
  the grid raises StepInterrupted (the same command resumes)."""
  import signal  # noqa: PLC0415
  import sys  # noqa: PLC0415

  cells = plan.cells(glue_config(), str(tmp_path))[:3]
  started = []
  script = ("import pathlib, signal, sys, time\n"
            "out = pathlib.Path(sys.argv[1])\n"
            "def stop(signum, frame):\n"
            "  out.write_text('saved at SIGTERM'); sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, stop)\n"
            "out.write_text('running')\n"
            "time.sleep(60)\n")

  def runner(cell, log, slot):
    started.append(cell.name)
    note = tmp_path / f"{cell.name.replace('/', '_')}.txt"
    with log.open("a") as out:
      status = run.subprocess_status([sys.executable, "-c", script, str(note)], out, slot)
    raise run.CellFailed(f"exited {status}")  # not reached: the signal raises first

  def send_once_both_run():
    for _ in range(300):
      if len(list(tmp_path.glob("*.txt"))) == 2 and all(
          p.read_text() == "running" for p in tmp_path.glob("*.txt")):
        break
      time.sleep(0.1)
    os.kill(os.getpid(), signal.SIGTERM)

  threading.Thread(target=send_once_both_run, daemon=True).start()
  previous = signal.getsignal(signal.SIGTERM)
  with pytest.raises(run.StepInterrupted) as stopped:
    run.run_grid(cells, runner, lambda line: None,
                 slots=[slots.Slot("A"), slots.Slot("B")])
  assert stopped.value.signum == signal.SIGTERM and stopped.value.status == 0
  assert sorted(started) == ["bert/seed0", "bert/seed1"]  # bert/seed2 never started
  assert sorted(p.read_text() for p in tmp_path.glob("*.txt")) == ["saved at SIGTERM"] * 2
  assert signal.getsignal(signal.SIGTERM) == previous  # compare's handler is gone again
