"""What the tools print: the evaluation line, ``--help``, TensorFlow's start-up notices
dropped while its errors still print, and nothing more once the reader of the output has
gone (``| head``)."""

import concurrent.futures
import os
import pathlib
import subprocess
import sys
import types

import pytest

from posenc_jax import cli
from posenc_jax.training.metrics import eval_line

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_eval_line_shows_loss_perplexity_accuracy_and_task_metrics():
  scalars = {"loss": 7.0, "eval_loss": 6.81234, "eval_perplexity": 908.34,
             "eval_accuracy": 0.0521, "task_f1": 81.2, "task_bleu": 12.4}
  assert eval_line(100, scalars) == ("eval at step 100: loss 6.8123 ppl 908.3 acc 0.052 | "
                                     "task bleu 12.40 f1 81.20")
  assert eval_line(3, {"eval_loss": 2.0, "eval_accuracy": 0.5}) == (
      "eval at step 3: loss 2.0000 acc 0.500")
  assert eval_line(5, {"loss": 7.0, "accuracy": 0.1}) is None  # no evaluation at this step


def test_train_help_lists_configs_presets_and_the_given_configs_defaults():
  proc = subprocess.run([sys.executable, "train.py", "--config=configs/lm.py", "--help"],
                        cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  out = proc.stdout
  assert "python train.py --config=configs/pretrain.py --workdir=" in out  # the usage
  assert "--workdir: checkpoints, metrics and events go here" in out
  assert "configs/lm.py" in out and "Causal language modelling" in out
  assert "configs/finetune_glue.py" not in out  # finetune.py's
  assert "bert_tiny" in out and "diet_abs_share" in out and "rope" in out
  lines = out.splitlines()
  assert any(line.split()[:1] == ["--config.task=wordnet_glosses_lm"] for line in lines)
  assert any(line.strip().startswith("--config.total_steps=500 ") for line in lines)
  assert any(line.strip().startswith("--config.model.route=auto ") for line in lines)
  assert "train.py --helpfull lists every flag" in out


def test_finetune_help_lists_its_configs_and_helpfull_stays_absls():
  proc = subprocess.run([sys.executable, "finetune.py", "-h"], cwd=ROOT, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  out = proc.stdout
  assert out.startswith("Fine-tuning on GLUE, XTREME and the bundled WordNet tasks")
  assert "configs/finetune_wordnet.py" in out and "configs/pretrain.py" not in out
  assert "--config.batch_size=32 " in out  # base_train_config's: no --config given
  proc = subprocess.run([sys.executable, "-m", "posenc_jax.finetune", "--helpfull"], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 1, proc.stderr[-2000:]  # absl's status after its help
  assert "--init_checkpoint" in proc.stdout and "absl.logging:" in proc.stdout


def _fake_tensorflow(monkeypatch, stderr: bytes, error: Exception | None = None):
  def set_visible_devices(devices, kind):
    assert devices == [] and kind == "GPU"
    os.write(2, stderr)
    if error is not None:
      raise error

  fake = types.SimpleNamespace(config=types.SimpleNamespace(
      set_visible_devices=set_visible_devices))
  monkeypatch.setitem(sys.modules, "tensorflow", fake)


NOISE = (b"WARNING: All log messages before absl::InitializeLog() is called are written to "
         b"STDERR\nI0000 00:00:1.2 1 port.cc:153] oneDNN custom operations are on.\n"
         b"E0000 00:00:1.3 1 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA "
         b"error: Failed call to cuInit: UNKNOWN ERROR (303)\n")


def test_tensorflow_start_notices_are_dropped_and_other_lines_kept(monkeypatch, capfd):
  _fake_tensorflow(monkeypatch, NOISE + b"E0000 00:00:1.4 1 x.cc:1] a real failure\n")
  cli.start_tensorflow_quietly()
  err = capfd.readouterr().err
  assert err == "E0000 00:00:1.4 1 x.cc:1] a real failure\n"


@pytest.mark.parametrize("given,level", [(None, "2"), ("1", "2"), ("0", "0"), ("3", "3")])
def test_tensorflow_logs_errors_only_unless_the_user_chose_a_level(monkeypatch, capfd, given,
                                                                   level):
  """JAX's import sets TF_CPP_MIN_LOG_LEVEL=1 where it is unset: 1 counts as unset."""
  if given is None:
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
  else:
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", given)
  _fake_tensorflow(monkeypatch, b"")
  cli.start_tensorflow_quietly()
  assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == level


def test_an_error_starting_tensorflow_prints_and_raises(monkeypatch, capfd):
  _fake_tensorflow(monkeypatch, NOISE + b"F0000 fatal: no such op\n", RuntimeError("no op"))
  with pytest.raises(RuntimeError, match="no op"):
    cli.start_tensorflow_quietly()
  assert capfd.readouterr().err == "F0000 fatal: no such op\n"


def test_the_real_tensorflow_starts_without_its_notices():
  proc = subprocess.run([sys.executable, "-c", "from posenc_jax import cli; "
                         "cli.start_tensorflow_quietly(); import tensorflow as tf; "
                         "print(tf.config.get_visible_devices('GPU'))"],
                        cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.strip() == "[]" and proc.stderr == ""


# Each command's output into a pipe whose reader has gone (``| head`` that has its lines):
# the command that prints a lot, and one of each kind of entry point (absl's app.run, absl
# flags parsed by main, argparse).
CLOSED_PIPE_COMMANDS = [
    ["-m", "posenc_jax.compare", "--config=configs/compare.py:extrapolation", "--workdir=cmp",
     "--dry_run"],
    ["train.py", "--help"],
    ["-m", "posenc_jax.evaluate", "--help"],
    ["-m", "posenc_jax.params", "--table=diet6"],
    ["-m", "posenc_jax.benchmarks.steps", "--help"],
]


def _into_a_closed_pipe(argv: list[str], cwd: pathlib.Path) -> tuple[int, str]:
  """``python *argv | <a reader that closed at once>``: the exit status and stderr."""
  with subprocess.Popen([sys.executable, *argv], cwd=cwd, stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True) as proc:
    proc.stdout.close()  # the reader goes before the command writes
    err = proc.stderr.read()
    return proc.wait(timeout=120), err


def test_every_command_ends_quietly_when_its_reader_closes_the_pipe(tmp_path):
  for name in ("configs", "train.py"):
    os.symlink(ROOT / name, tmp_path / name)  # run from a folder it may write into
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    results = list(pool.map(lambda argv: _into_a_closed_pipe(argv, tmp_path),
                            CLOSED_PIPE_COMMANDS))
  for argv, (status, err) in zip(CLOSED_PIPE_COMMANDS, results):
    # argparse's --help drops its own failed write and exits 0; the others 141, as Unix tools.
    assert status in (cli.CLOSED_PIPE_STATUS, 0) and err == "", (argv, status, err[-2000:])
  assert results[0][0] == cli.CLOSED_PIPE_STATUS
  assert sorted(p.name for p in tmp_path.iterdir()) == ["configs", "train.py"]  # nothing run


def test_every_entry_point_runs_through_run_command():
  """Each module that runs as a command (``if __name__ == "__main__":``) does so through
  :func:`posenc_jax.cli.run_command`, the one place that handles a closed pipe."""
  mains = [path for path in sorted((ROOT / "posenc_jax").rglob("*.py"))
           if 'if __name__ == "__main__":' in path.read_text()]
  assert len(mains) >= 10
  for path in mains:
    block = path.read_text().rpartition('if __name__ == "__main__":')[2]
    assert "cli.run_command(" in block or block.strip() == "run()", path
    if block.strip() == "run()":  # the absl tools' run() calls it
      assert "cli.run_command(app.run, main" in path.read_text(), path


def _with_closed_output(argv: list[str], cwd: pathlib.Path, fd: int) -> tuple[int, str]:
  """``python *argv 1>&-`` (``fd`` 1) or ``2>&-`` (2): the exit status and the other stream."""
  proc = subprocess.run(["sh", "-c", f'exec "$0" "$@" {fd}>&-', sys.executable, *argv],
                        cwd=cwd, capture_output=True, text=True, timeout=120)
  return proc.returncode, proc.stderr if fd == 1 else proc.stdout


def test_a_command_started_with_its_output_closed_runs_as_with_dev_null(tmp_path):
  """``>&-`` (stdout closed at start) was AttributeError: 'NoneType' object has no attribute
  'flush'; the dry run now plans, and an error still reaches stderr when stdout is closed."""
  for name in ("configs", "train.py"):
    os.symlink(ROOT / name, tmp_path / name)
  dry_run = ["-m", "posenc_jax.compare", "--config=configs/compare.py:extrapolation",
             "--workdir=cmp", "--dry_run"]
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    planned, refused = pool.map(lambda case: _with_closed_output(*case), [
        (dry_run, tmp_path, 1),
        (["-m", "posenc_jax.evaluate", f"--workdir={tmp_path}/none"], tmp_path, 1)])
  assert planned == (0, ""), planned
  assert refused[0] == 1 and refused[1].strip().splitlines()[-1].startswith(
      "evaluate: workdir: "), refused
  status, out = _with_closed_output(["-m", "posenc_jax.params", "--table=diet6"], tmp_path, 2)
  assert status == 0 and "DIET" in out


@pytest.mark.parametrize("after", [0.4, 3.0])
def test_ctrl_c_anywhere_in_a_command_is_one_line(tmp_path, after):
  """SIGINT while the package or the data stack is being imported (or while the model
  compiles) had printed a KeyboardInterrupt traceback into a compare cell's log.txt."""
  import signal  # noqa: PLC0415
  import time  # noqa: PLC0415

  proc = subprocess.Popen([sys.executable, "train.py", "--config=configs/lm.py:bert_tiny,rope",
                           f"--workdir={tmp_path}/run", "--config.total_steps=100000"],
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  time.sleep(after)
  proc.send_signal(signal.SIGINT)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode != 0 and "Traceback" not in err, err[-3000:]
  last = err.strip().splitlines()[-1]
  assert last.endswith("interrupted (SIGINT); run the same command to resume (a training run "
                       "resumes from its last checkpoint)") or last.startswith(
                           "train.py: stopped by SIGINT"), err[-3000:]


def test_the_interrupt_hook_is_only_a_command_lines():
  """A library user's process keeps Python's own hook."""
  proc = subprocess.run([sys.executable, "-c", "import sys, posenc_jax; "
                         "print(sys.excepthook is sys.__excepthook__)"],
                        cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.stdout.strip() == "True", proc.stderr[-2000:]


def _as_train_py(body: str) -> subprocess.CompletedProcess:
  """Runs ``body`` in a process that imports posenc_jax as train.py's does (its
  ``sys.argv[0]``), after ``import gc, os, signal, sys, time``."""
  code = ("import gc, os, signal, sys, time\n"
          "sys.argv = ['train.py']  # a command line's process\n"
          "import posenc_jax\n" + body)
  return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                        timeout=120)


def test_a_ctrl_c_that_a_c_extension_turned_into_an_import_error_is_one_line():
  """SIGINT 0.4 s into train.py landed in numpy's C initialisation (CI, 2026-11-29): numpy
  printed the KeyboardInterrupt through the hook and raised ImportError, and jaxlib chained
  its own, so the one line came with an ImportError traceback. Done here as numpy does it."""
  proc = _as_train_py(
      "try:\n"
      "  try:\n"
      "    os.kill(os.getpid(), signal.SIGINT)\n"
      "    signal.pause()\n"
      "  except KeyboardInterrupt:\n"
      "    sys.excepthook(*sys.exc_info())  # PyErr_Print in the extension's init\n"
      "    raise ImportError('numpy._core.multiarray failed to import') from None\n"
      "except ImportError as error:\n"
      "  raise ImportError('Encountered an error while initializing the extension.') "
      "from error\n")
  assert proc.returncode == 1 and proc.stderr.splitlines() == [
      "train.py: interrupted (SIGINT); run the same command to resume (a training run resumes "
      "from its last checkpoint)"], proc.stderr[-3000:]


def test_a_ctrl_c_during_a_garbage_collection_callback_is_not_lost():
  """JAX's gc callback swallowed the KeyboardInterrupt of a SIGINT that arrived while it ran
  ('Exception ignored in: <function _xla_gc_callback>'), and train.py trained on; the signal
  is sent again once the collection is over."""
  proc = _as_train_py(
      "hit = []\n"
      "def callback(phase, info):\n"
      "  if phase == 'start' and not hit:\n"
      "    hit.append(1)\n"
      "    os.kill(os.getpid(), signal.SIGINT)\n"
      "    time.sleep(0.01)\n"
      "gc.callbacks.insert(0, callback)\n"
      "try:\n"
      "  gc.collect()\n"
      "  time.sleep(5)\n"
      "  print('lost')\n"
      "except KeyboardInterrupt:\n"
      "  print('interrupted')\n")
  assert proc.stdout.strip() == "interrupted", proc.stdout + proc.stderr[-2000:]
  assert "Exception ignored" not in proc.stderr
