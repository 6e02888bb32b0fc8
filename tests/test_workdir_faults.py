"""Torn, foreign and unwritable files in a workdir, and empty data: a torn last line of
metrics.jsonl is dropped with a warning and the resume ends bit-identical to an
uninterrupted run; anything else is one line naming the file or field, before anything is
compiled or changed (issue 32, items 1, 3 and 7)."""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import seqio

from posenc_jax.data import tasks as tasks_lib
from posenc_jax.presets import preset_config
from posenc_jax.training import finetune, input_pipeline, workdir
from posenc_jax.training.checkpoint import Checkpointer, CheckpointError, check_writable
from posenc_jax.training.config import TrainConfigError, base_train_config
from posenc_jax.training.loop import BestKeeper, train
from posenc_jax.training.metrics import MetricWriter
from posenc_jax.training.workdir import WorkdirError, read_metrics, saved_config, saved_model
from tests import forked_cli

ROOT = pathlib.Path(__file__).parent.parent
VOCAB, LENGTH, BATCH = 64, 8, 2
RECORD = '{"step": 1, "loss": 4.5}\n{"step": 2, "loss": 4.25}\n'


def config(steps=4):
  c = base_train_config()
  c.update(preset_config("bert_tiny,diet_abs_share"))
  c.model.update(dict(vocab_size=VOCAB, d_model=16, num_heads=2, mlp_dim=32, num_layers=1,
                      max_len=LENGTH, dropout_rate=0.0, attention_dropout_rate=0.0))
  c.update(dict(seq_len=LENGTH, batch_size=BATCH, max_predictions_per_seq=LENGTH,
                total_steps=steps, log_every=1, eval_every=0, checkpoint_every=2,
                async_checkpointing=False, compilation_cache_dir=""))
  c.optimizer.update(dict(learning_rate=3e-3, warmup_steps=0, schedule="constant"))
  return c


def synthetic(config, split, start_step, shard_id=0, num_shards=1):
  """MLM batch of step s drawn from seed s (the same whatever the start)."""
  step = start_step
  while True:
    rng = np.random.default_rng(1000 + step)
    ids = rng.integers(6, VOCAB, (BATCH, LENGTH)).astype(np.int32)
    weights = (rng.random((BATCH, LENGTH)) < 0.3).astype(np.float32)
    yield {"input_ids": np.where(weights > 0, 5, ids), "segment_ids": np.zeros_like(ids),
           "mask": np.ones_like(ids), "mlm_targets": ids * (weights > 0),
           "mlm_weights": weights}
    step += 1


def snapshot(path: pathlib.Path) -> dict[str, tuple]:
  return {str(p.relative_to(path)): (p.is_dir(), p.stat().st_size, p.stat().st_mtime_ns)
          for p in sorted(path.rglob("*"))}


# --- 1. Torn and foreign files -----------------------------------------------------------------


@pytest.mark.parametrize("tail", ['{"step": 3, "lo', '{"step": 3, "loss": 4.', '{"st',
                                  '{"step": 3, "loss": 4.\n'])
def test_a_torn_last_line_is_set_apart(tmp_path, tail):
  path = tmp_path / "metrics.jsonl"
  path.write_text(RECORD + tail)
  records, torn = read_metrics(path)
  assert [s for s, _ in records] == [1, 2] and torn == tail.strip()


@pytest.mark.parametrize("content,problem", [
    (b"\x89PNG\r\n\x1a\n\x00\x00", "is not text (byte 0 is 0x89)"),
    (RECORD.encode() + b'{"step": 3, "lo\n{"step": 4, "loss": 1.0}\n',
     "line 3 ('{\"step\": 3, \"lo') is not a record"),
    (b'[1, 2, 3]\n', "line 1 ('[1, 2, 3]') is not a record"),
    (RECORD.encode() + b'{"loss": 1.0}\n', "line 3"),
    (b'{"step": true}\n', "line 1"),
    (RECORD.encode() + b"hello\n", "line 3 ('hello')"),
    (RECORD.encode() + b'{"step": 3, \xff\n', "is not text (byte 63 is 0xff)"),
])
def test_a_foreign_metrics_file_is_one_line_naming_it(tmp_path, content, problem):
  path = tmp_path / "metrics.jsonl"
  path.write_bytes(content)
  with pytest.raises(WorkdirError, match=r"^workdir: .*metrics.jsonl ") as e:
    read_metrics(path)
  assert problem in str(e.value) and "\n" not in str(e.value)
  assert path.read_bytes() == content


def test_empty_and_absent_metrics_files_hold_no_records(tmp_path):
  assert read_metrics(tmp_path / "metrics.jsonl") == ([], None)
  (tmp_path / "metrics.jsonl").write_text("")
  assert read_metrics(tmp_path / "metrics.jsonl") == ([], None)
  (tmp_path / "metrics.jsonl").write_text("\n\n")
  assert read_metrics(tmp_path / "metrics.jsonl") == ([], None)


def test_metrics_folder_is_one_line(tmp_path):
  (tmp_path / "metrics.jsonl").mkdir()
  with pytest.raises(WorkdirError, match=r"metrics.jsonl is a folder, not the file a run"):
    read_metrics(tmp_path / "metrics.jsonl")


@pytest.mark.parametrize("content,problem", [
    ("[1, 2, 3]", "holds a JSON list ([1, 2, 3]), not an object"),
    ("null", "holds a JSON NoneType (null), not an object"),
    ('"str"', "holds a JSON str"),
    ("{}", "holds no 'model' object"),
    ('{"model": [1]}', "holds no 'model' object"),
    ('{"model": {}', "does not read as JSON"),
    ("", "is empty"),
    (" \n", "is empty"),
    ("\x00\xff", "is not text"),
    (None, "is a folder"),
    ("[" * 100_000 + "]" * 100_000, "does not read as JSON (nested too deep; at most 32 levels)"),
    ('{"model": ' + "[" * 40 + "]" * 40 + "}", "(nested 41 levels deep; at most 32)"),
])
def test_a_foreign_config_json_is_one_line_naming_it(tmp_path, content, problem):
  path = tmp_path / "config.json"
  if content is None:
    path.mkdir()
  else:
    path.write_bytes(content.encode("latin-1"))
  for field in ("workdir", "init_checkpoint"):
    with pytest.raises(WorkdirError, match=rf"^{field}: {path} ") as e:
      saved_config(str(tmp_path), field)
    assert problem in str(e.value) and "nothing there was changed" in str(e.value)


def test_a_config_json_value_no_run_writes_is_one_line_in_evaluate(tmp_path):
  """The evaluate tool validates the config.json it builds the model from (a seq_len of
  1e308 was an OverflowError traceback)."""
  from posenc_jax.evaluation import EvaluationError, load_run  # noqa: PLC0415

  config = preset_config("bert_tiny,rope")
  config.update(base_train_config().to_dict() | {"model": config.model.to_dict()})
  data = workdir.resolved_config(config) | {"seq_len": 1e308}
  (tmp_path / "config.json").write_text(json.dumps(data))
  with pytest.raises(EvaluationError) as e:
    load_run(str(tmp_path))
  assert str(e.value) == (f"workdir: {tmp_path}/config.json: seq_len: got 1e+308; allowed: a "
                          "positive integer; not the config a run writes")


def test_init_checkpoint_with_a_foreign_config_json_is_one_line(tmp_path):
  """finetune.py --init_checkpoint reads the workdir's model through saved_model."""
  (tmp_path / "checkpoints").mkdir()
  for content, problem in (("[1, 2, 3]", "JSON list"), ("null", "JSON NoneType"),
                           ('{"model": {"d_model": 8}}', "a model without vocab_size")):
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(WorkdirError, match=rf"^init_checkpoint: .*config.json .*{problem}"):
      finetune.checkpoint_model(str(tmp_path))
  (tmp_path / "config.json").write_text(json.dumps({"model": workdir.resolved_model(
      config().model)}))
  assert saved_model(str(tmp_path))["d_model"] == 16


@pytest.mark.parametrize("name,content", [
    ("metrics.jsonl", b"\x00\x01binary"), ("metrics.jsonl", None),
    ("metrics.jsonl", b'{"step": 1, "lo\n{"step": 2}\n'), ("best.json", b"[1, 2]"),
    ("best.json", b'{"score": "high"}'), ("tensorboard", b"a file")])
def test_claim_refuses_a_foreign_file_and_changes_nothing(tmp_path, name, content):
  c = config()
  c.best_metric = "eval_accuracy"
  workdir.claim(str(tmp_path), c)  # config.json of this config: a resume
  if content is None:
    (tmp_path / name).mkdir()
  else:
    (tmp_path / name).write_bytes(content)
  before = snapshot(tmp_path)
  with pytest.raises(WorkdirError, match=rf"^workdir: {tmp_path / name} "):
    workdir.claim(str(tmp_path), c)
  assert snapshot(tmp_path) == before


def test_a_torn_metrics_line_resumes_bit_identical(tmp_path, caplog):
  """4 steps in one go; its workdir as a kill during step 3's metrics write leaves it
  (checkpoint 2, the records of steps 1-2 and a torn one of step 3), resumed to 4: the torn
  line is dropped with a warning, every step's record appears once, and the parameters and
  every step's loss are the same (max difference 0)."""
  whole = train(config(4), str(tmp_path / "whole"), data=synthetic)
  split = tmp_path / "split"
  shutil.copytree(tmp_path / "whole", split)
  shutil.rmtree(split / "checkpoints" / "4")
  lines = (split / "metrics.jsonl").read_text().splitlines(keepends=True)
  (split / "metrics.jsonl").write_text("".join(lines[:2]) + lines[2][:24])
  resumed = train(config(4), str(split), data=synthetic)
  assert "dropped its last line, torn by a killed write" in caplog.text
  assert [h["step"] for h in resumed["history"]] == [3, 4]
  records = [json.loads(line) for line in (split / "metrics.jsonl").read_text().splitlines()]
  expected = [json.loads(line)
              for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [1, 2, 3, 4]
  for got, want in zip(records, expected, strict=True):
    for key in ("loss", "accuracy", "grad_norm", "learning_rate"):
      assert got[key] == want[key], (got["step"], key)
  leaves = zip(jax.tree.leaves(whole["state"].params), jax.tree.leaves(resumed["state"].params),
               strict=True)
  assert max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in leaves) == 0


# --- 3. Empty data -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def empty_tasks(tmp_path_factory):
  """Text-line tasks: one with an empty train split, one with an empty validation split."""
  folder = tmp_path_factory.mktemp("corpus")
  (folder / "empty.txt").write_text("")
  (folder / "lines.txt").write_text("a gloss of a word\nanother gloss\n")
  vocabulary = seqio.get_mixture_or_task("wordnet_glosses").output_features["text"].vocabulary
  files = {"empty": str(folder / "empty.txt"), "lines": str(folder / "lines.txt")}
  for name, (training, validation) in {"faults_empty_train": ("empty", "lines"),
                                       "faults_empty_validation": ("lines", "empty")}.items():
    if name not in seqio.TaskRegistry.names():
      tasks_lib.register_text_lines(name, {"train": files[training],
                                           "validation": files[validation]}, vocabulary)
  return folder


@pytest.mark.parametrize("task,eval_every,message", [
    ("faults_empty_train", 0, ("task: 'faults_empty_train' has no examples in its 'train' "
                               "split; nothing to train on")),
    ("faults_empty_validation", 5, ("eval_every: 5, but task 'faults_empty_validation' has no "
                                    "examples in its 'validation' split; set "
                                    "--config.eval_every=0 or evaluate on a split with "
                                    "examples")),
])
def test_an_empty_split_is_one_line_before_compiling(empty_tasks, task, eval_every, message):
  c = config()
  c.update(dict(task=task, eval_every=eval_every))
  with pytest.raises(TrainConfigError) as e:
    input_pipeline.check_examples(c)
  assert str(e.value) == message
  if task == "faults_empty_validation":
    c.eval_every = 0
    input_pipeline.check_examples(c)  # no evaluation: its empty split is never read


def test_a_corpus_with_data_passes_and_a_missing_split_is_one_line(empty_tasks):
  c = config()
  c.update(dict(task="wordnet_glosses_lm", objective="lm", head="lm", eval_every=5))
  input_pipeline.check_examples(c)
  c = config()
  c.update(dict(task="faults_empty_validation", eval_every=2, objective="classification",
                eval_split="test"))
  with pytest.raises(TrainConfigError, match=r"^eval_every: 2, but task "
                     r"'faults_empty_validation' has no 'test' split \(splits: train, "
                     r"validation\); set"):
    input_pipeline.check_examples(c)


# --- 7. Read-only and blocked places -----------------------------------------------------------


def test_a_folder_that_cannot_be_written_fails_at_once(tmp_path):
  """A path whose parent is a file (blocked even for root, where chmod is not)."""
  (tmp_path / "file").write_text("")
  with pytest.raises(CheckpointError, match=rf"^best: {tmp_path}/file/best is not writable "
                     r"\(Not a directory\)$"):
    check_writable(str(tmp_path / "file" / "best"), "best")
  check_writable(str(tmp_path / "fine"), "checkpoints")
  assert os.listdir(tmp_path / "fine") == []  # the probe is gone


def test_checkpoint_folders_are_probed_before_the_first_save(tmp_path):
  """checkpoints/ blocked after the start (a file in its place): the first save fails at
  once; best/ blocked: the keeper of the best evaluation refuses to start."""
  checkpointer = Checkpointer(str(tmp_path), save_interval_steps=1, async_save=True)
  (tmp_path / "checkpoints").rmdir()
  (tmp_path / "checkpoints").write_text("")
  with pytest.raises(CheckpointError, match=r"^checkpoints: .* is not writable \(File exists\)$"):
    checkpointer.save(1, {"w": jax.numpy.ones(2)}, {"step": 1}, force=True)
  (tmp_path / "best").write_text("")
  with pytest.raises(CheckpointError, match=rf"^best: {tmp_path}/best is not writable"):
    BestKeeper(str(tmp_path), "eval_accuracy")


def test_unwritable_files_are_refused_by_claim(tmp_path, monkeypatch):
  """os.access says no (what chmod a-w gives a user who is not root): one line naming it."""
  c = config()
  workdir.claim(str(tmp_path), c)
  (tmp_path / "metrics.jsonl").write_text(RECORD)
  (tmp_path / "checkpoints").mkdir()
  before = snapshot(tmp_path)
  real = os.access
  for name in ("metrics.jsonl", "checkpoints"):
    blocked = str(tmp_path / name)
    monkeypatch.setattr(os, "access", lambda p, m, b=blocked: str(p) != b and real(p, m))
    with pytest.raises(WorkdirError, match=rf"^workdir: {blocked} is not writable$"):
      workdir.claim(str(tmp_path), c)
    assert snapshot(tmp_path) == before


def test_a_failed_metrics_write_is_one_line(tmp_path):
  """tensorboard/ cannot be made (a file in its place after the check)."""
  (tmp_path / "tensorboard").write_text("")
  with pytest.raises(WorkdirError, match=rf"^workdir: writing {tmp_path}/tensorboard "
                     r"failed \(Not a directory\)$"):
    MetricWriter(str(tmp_path))


# --- The command lines: one line, no traceback, nothing changed ------------------------------


def _drop_root_override() -> list[str]:
  """A prefix under which root's writes obey file modes (CAP_DAC_OVERRIDE dropped), as a
  user's do; none for a user."""
  if os.geteuid() != 0:
    return []
  if not shutil.which("setpriv"):
    pytest.skip("running as root without setpriv: chmod cannot make a folder read-only")
  caps = "-dac_override,-dac_read_search"
  return ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}"]


def _cli(tmp_path, *args, prefix=(), code=None, config="configs/pretrain.py"):
  """The last stderr line of train.py (``code``: a script that runs it) with ``config`` and
  ``args``, which must exit 1 without a traceback: forked from tests/forked_cli.py's server,
  or under ``prefix`` (the user's capabilities changed) a process of its own."""
  argv = ["train.py", f"--config={config}", f"--workdir={tmp_path / 'run'}", *args]
  if code is not None:
    argv[0] = str(tmp_path / "train_script.py")
    pathlib.Path(argv[0]).write_text(code)
  if prefix:
    proc = subprocess.run([*prefix, sys.executable, *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
  else:
    proc = forked_cli.run(argv, cwd=str(ROOT), timeout=300)
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
  return proc.stderr.strip().splitlines()[-1]


def test_cli_foreign_metrics_file(tmp_path):
  run = tmp_path / "run"
  run.mkdir()
  (run / "metrics.jsonl").write_bytes(b"\xff\xfe not a metrics file")
  before = snapshot(run)
  last = _cli(tmp_path)
  assert last == (f"train.py: workdir: {run}/metrics.jsonl is not text (byte 0 is 0xff), "
                  "not the file a run writes there; move it away (nothing there was changed)")
  assert snapshot(run) == before


def test_cli_empty_corpus(tmp_path, empty_tasks):
  code = ("import sys, seqio; from posenc_jax.data import tasks; import posenc_jax.tasks; "
          "v = seqio.get_mixture_or_task('wordnet_glosses').output_features['text'].vocabulary; "
          f"tasks.register_text_lines('cli_empty', {{'train': '{empty_tasks}/empty.txt'}}, v); "
          "sys.argv = ['train.py'] + sys.argv[1:]; from posenc_jax.train import run; run()")
  last = _cli(tmp_path, "--config.task=cli_empty", "--config.eval_every=0", code=code)
  assert last == ("train.py: task: 'cli_empty' has no examples in its 'train' split; "
                  "nothing to train on")
  assert not (tmp_path / "run").exists()


def test_cli_read_only_checkpoints_folder(tmp_path):
  prefix = _drop_root_override()
  checkpoints = tmp_path / "run" / "checkpoints"
  checkpoints.mkdir(parents=True)
  checkpoints.chmod(0o555)
  try:
    last = _cli(tmp_path, prefix=prefix)
  finally:
    checkpoints.chmod(0o755)
  assert last == f"train.py: workdir: {checkpoints} is not writable"
  assert sorted(os.listdir(tmp_path / "run")) == ["checkpoints"]


def test_cli_checkpoints_folder_made_read_only_mid_run(tmp_path):
  """The folder turns read-only after the first save: the next save is refused in one line
  at once (not after Orbax's 300 s coordination timeout), and the saved step stays."""
  prefix = _drop_root_override()
  checkpoints = tmp_path / "run" / "checkpoints"
  code = ("import os, sys; from posenc_jax.training import checkpoint\n"
          "save = checkpoint.Checkpointer.save\n"
          "def read_only_after_step_2(self, step, *args, **kwargs):\n"
          "  saved = save(self, step, *args, **kwargs)\n"
          "  if saved and step == 2:\n"
          "    self.wait(); os.chmod(self.directory, 0o555)\n"
          "  return saved\n"
          "checkpoint.Checkpointer.save = read_only_after_step_2\n"
          "sys.argv = ['train.py'] + sys.argv[1:]; from posenc_jax.train import run; run()")
  start = time.monotonic()
  try:
    # A probe run: its checkpoints are saved the same way, and it starts without TensorFlow.
    last = _cli(tmp_path, "--config.total_steps=6", "--config.checkpoint_every=2",
                "--config.eval_every=0", "--config.optimizer.warmup_steps=1",
                prefix=prefix, code=code, config="configs/probe.py:bert_tiny,rope,copy")
  finally:
    checkpoints.chmod(0o755)
  assert time.monotonic() - start < 120
  assert last == f"train.py: checkpoints: {checkpoints} is not writable (Permission denied)"
  assert sorted(os.listdir(checkpoints)) == ["2"]


def test_cli_disk_full_at_a_save_is_one_line_and_nothing_after_it(tmp_path):
  """The disk fills while step 2's items are written (here the input iterator's state raises
  what TensorFlow's SaveV2 raises): one line with the reason alone, and no Orbax log, no
  traceback and no "never awaited" warnings for the abandoned items after it."""
  code = ("import sys; from posenc_jax.training import checkpoint\n"
          "def full(self, directory, args):\n"
          "  raise OSError('{{function_node __wrapped__SaveV2_dtypes_2_device_/job:localhost/'\n"
          "                'replica:0/task:0/device:CPU:0}} ' + str(directory) + '/part-0.data; '\n"
          "                'No space left on device [Op:SaveV2]')\n"
          "checkpoint.InputStateHandler.save = full\n"
          "sys.argv = ['train.py'] + sys.argv[1:]; from posenc_jax.train import run; run()")
  argv = [str(tmp_path / "script.py"), "--config=configs/pretrain.py",
          f"--workdir={tmp_path / 'run'}", "--config.total_steps=4", "--config.checkpoint_every=2",
          "--config.eval_every=0", "--config.optimizer.warmup_steps=1"]
  pathlib.Path(argv[0]).write_text(code)
  proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 1, proc.stderr[-3000:]
  checkpoints = tmp_path / "run" / "checkpoints"
  assert proc.stderr.strip().splitlines()[-1] == (
      f"train.py: checkpoints: saving step 2 to {checkpoints} failed (No space left on device)")
  for noise in ("Traceback", "Warning", "_SignalingThread", "E1"):
    assert noise not in proc.stderr, proc.stderr[-3000:]


# --- One process per workdir -------------------------------------------------------------------

HOLD = ("import sys, time; from posenc_jax.paths import hold; hold('workdir', sys.argv[1]); "
        "print('held', flush=True); time.sleep(120)")


def _holder(folder) -> subprocess.Popen:
  """A process that holds ``folder`` (as a running train.py or compare does) until killed."""
  folder.mkdir(parents=True, exist_ok=True)
  proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], cwd=ROOT,
                          stdout=subprocess.PIPE, text=True)
  assert proc.stdout.readline() == "held\n"
  return proc


def test_a_second_process_on_a_held_workdir_is_one_line_naming_the_holder(tmp_path):
  """Two train.py processes on one workdir had both trained (metrics.jsonl held every step
  twice); the second is refused before its first step, and once the first has ended (even by
  kill -9) the workdir is free again."""
  run = tmp_path / "run"
  holder = _holder(run)
  try:
    last = _cli(tmp_path, "--config.total_steps=2", "--config.batch_size=2",
                "--config.seq_len=16", "--config.optimizer.warmup_steps=1")
    assert last == (f"train.py: workdir: {run} is in use by process {holder.pid} (it holds "
                    f"{run}/.lock); wait for it to end or stop it, or use another --workdir "
                    "(nothing there was changed)")
    assert not (run / "metrics.jsonl").exists()
  finally:
    holder.kill()
    holder.wait()
  from posenc_jax.paths import hold  # noqa: PLC0415
  hold("workdir", str(run))  # released by the kernel when its holder died
  hold("workdir", str(run))  # and held again by the same process: a no-op
  assert (run / ".lock").read_text() == f"{os.getpid()}\n"


def test_a_second_compare_on_a_held_root_is_one_line(tmp_path):
  root = tmp_path / "root"
  holder = _holder(root)
  try:
    proc = forked_cli.run(["-m", "posenc_jax.compare", "--config=configs/compare.py:extrapolation",
                           f"--workdir={root}", "--config.schemes=rope", "--config.seeds=0"],
                          cwd=str(ROOT), timeout=120)
  finally:
    holder.kill()
    holder.wait()
  assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert proc.stderr.strip().splitlines()[-1] == (
      f"compare: workdir: {root} is in use by process {holder.pid} (it holds {root}/.lock); "
      "wait for it to end or stop it, or use another --workdir (nothing there was changed)")
  assert sorted(p.name for p in root.iterdir()) == [".lock"]


def test_a_workdir_whose_files_fail_mid_run_is_one_line_and_nothing_after_it(tmp_path):
  """After step 2's checkpoint every file the run holds open in its workdir (metrics.jsonl,
  the TensorBoard events) fails its writes (here /dev/full put in their place, as a disk that
  fills or a workdir made immutable does): one line, then no tensorboardX traceback from its
  thread or exit hook and no 'Exception ignored' for metrics.jsonl."""
  code = ("import os, sys; from posenc_jax.training import checkpoint\n"
          "save = checkpoint.Checkpointer.save\n"
          "def full_after_step_2(self, step, *args, **kwargs):\n"
          "  saved = save(self, step, *args, **kwargs)\n"
          "  if saved and step == 2:\n"
          "    self.wait()\n"
          "    run = os.path.dirname(self.directory)\n"
          "    full = os.open('/dev/full', os.O_WRONLY)\n"
          "    for fd in os.listdir('/proc/self/fd'):\n"
          "      try:\n"
          "        target = os.readlink(f'/proc/self/fd/{fd}')\n"
          "      except OSError:\n"
          "        continue\n"
          "      if target.startswith(run) and '/checkpoints' not in target:\n"
          "        os.dup2(full, int(fd))\n"
          "  return saved\n"
          "checkpoint.Checkpointer.save = full_after_step_2\n"
          "sys.argv = ['train.py'] + sys.argv[1:]; from posenc_jax.train import run; run()")
  script = tmp_path / "script.py"
  script.write_text(code)
  proc = subprocess.run([sys.executable, str(script), "--config=configs/probe.py:bert_tiny,rope,copy",
                         f"--workdir={tmp_path / 'run'}", "--config.total_steps=6",
                         "--config.checkpoint_every=2", "--config.eval_every=0",
                         "--config.optimizer.warmup_steps=1", "--config.log_every=1"],
                        cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1, proc.stderr[-3000:]
  lines = [ln for ln in proc.stderr.strip().splitlines()
           if not ln.startswith(("I0000", "WARNING: All log messages"))]
  assert lines == [f"train.py: workdir: writing {tmp_path}/run/metrics.jsonl failed (No space "
                   "left on device)"], proc.stderr[-3000:]
