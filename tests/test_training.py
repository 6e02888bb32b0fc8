"""train.py and the loop: sharding, multi-host, resume after SIGKILL, NaN stop, config errors,
the default run learning, and the pieces (schedule, decay mask, loss, accumulation)."""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from posenc_jax.presets import preset_config
from posenc_jax.training.config import TrainConfigError, base_train_config, validate_train_config
from posenc_jax.training.mesh import MeshConfigError, mesh_shape
from posenc_jax.training.objectives import weighted_cross_entropy
from posenc_jax.training.optim import decay_mask, make_optimizer, position_mask
from posenc_jax.training.signals import StopSignals
from tests import forked_cli
from tests.conftest import optimised_env

ROOT = pathlib.Path(__file__).parent.parent
DRIVER = str(ROOT / "tests" / "drivers" / "train_driver.py")


def run_driver(tmp_path, name, *args, check=True, env=None, **popen):
  out = tmp_path / f"{name}.npz"
  cmd = [sys.executable, DRIVER, f"--out={out}", f"--workdir={tmp_path / name}", *args]
  if popen:
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
  if check:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return (np.load(out) if out.exists() else None), proc


def assert_same_run(a, b, atol=1e-5):
  """Same parameters, and the same loss at every step ``a`` logged (a resumed run logs a tail)."""
  steps = list(b["steps"])
  assert len(a["steps"]) and set(a["steps"]) <= set(steps)
  expected = b["losses"][[steps.index(s) for s in a["steps"]]]
  np.testing.assert_allclose(a["losses"], expected, rtol=0, atol=atol)
  params = [k for k in a.files if k not in ("steps", "losses")]
  assert params and set(params) == set(b.files) - {"steps", "losses"}
  for key in params:
    np.testing.assert_allclose(a[key], b[key], rtol=0, atol=atol, err_msg=key)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """One device, 8 steps."""
  tmp = tmp_path_factory.mktemp("reference")
  result, _ = run_driver(tmp, "single", "--steps=8", "--devices=1")
  return result


@pytest.mark.parametrize("mesh", ["8,1", "4,2", "2,4"])
def test_sharded_equals_single_device(tmp_path, reference, mesh):
  result, proc = run_driver(tmp_path, "sharded", f"--mesh={mesh}", "--devices=8", "--steps=8")
  assert "mesh {'data': %s, 'model': %s}" % tuple(mesh.split(",")) in proc.stdout
  assert_same_run(result, reference)


def test_gradient_accumulation_equals_the_full_batch(tmp_path, reference):
  result, _ = run_driver(tmp_path, "accum", "--accum=2", "--steps=8")
  assert_same_run(result, reference)


def _free_port():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_two_hosts_match_one(tmp_path, reference):
  """Two processes joined by jax.distributed (CPU collectives), 4 devices each, mesh (4, 2)."""
  address = f"localhost:{_free_port()}"
  procs = [run_driver(tmp_path, "multihost", "--mesh=4,2", "--devices=4", "--steps=8",
                      f"--coordinator={address}", "--num_processes=2", f"--process_id={i}",
                      popen=True) for i in range(2)]
  outputs = [p.communicate(timeout=300)[0] for p in procs]
  assert all(p.returncode == 0 for p in procs), outputs[0][-3000:] + outputs[1][-3000:]
  assert "on 8 devices" in outputs[0]
  assert "step 8/8" not in outputs[1]  # only host 0 prints
  assert_same_run(np.load(tmp_path / "multihost.npz"), reference)


def _wait_for(proc, ready, what, timeout=240):
  deadline = time.time() + timeout
  while not ready():
    assert proc.poll() is None, proc.stdout.read()[-3000:]
    assert time.time() < deadline, f"timed out waiting for {what}"
    time.sleep(0.02)


def _steps(checkpoints: pathlib.Path) -> list[str]:
  return sorted(p.name for p in checkpoints.iterdir()) if checkpoints.exists() else []


@pytest.mark.parametrize("moment", ["compiling", "writing_checkpoint", "between_checkpoints"])
def test_resume_after_sigkill_is_bit_identical(tmp_path, reference, moment):
  """SIGKILL during the first compile (the driver holds the train step's trace until it is
  killed), while checkpoint 4 is half-written, or after it: the rerun resumes from the newest
  complete checkpoint and ends bit-identical, every step's loss once in metrics.jsonl."""
  workdir = tmp_path / "killed"
  checkpoints = workdir / "checkpoints"
  compiling = tmp_path / "compiling"
  args = ["--steps=8", "--step_sleep=0.2"]
  if moment == "writing_checkpoint":
    args.append("--save_delay=3")
  if moment == "compiling":
    args.append(f"--hold_in_first_compile={compiling}")
  proc = run_driver(tmp_path, "killed", *args, popen=True)
  if moment == "compiling":
    _wait_for(proc, compiling.exists, "the first compile")
    assert (workdir / "config.json").exists()
  elif moment == "writing_checkpoint":
    _wait_for(proc, lambda: "4.orbax-checkpoint-tmp" in _steps(checkpoints), "a half-written 4")
  else:
    _wait_for(proc, lambda: "4" in _steps(checkpoints), "checkpoint 4")
  proc.send_signal(signal.SIGKILL)
  proc.communicate()  # waits, and closes its stdout pipe
  left = [name for name in _steps(checkpoints) if name.isdigit()]
  if moment == "compiling":
    assert left == []
  else:
    assert left[:2] == (["2"] if moment == "writing_checkpoint" else ["2", "4"])[:2]
    assert moment != "writing_checkpoint" or left == ["2"]
  assert not (tmp_path / "killed.npz").exists()
  result, resumed = run_driver(tmp_path, "killed", "--steps=8")
  start = int(left[-1]) if left else 0
  assert f"from step {start}" in resumed.stdout
  assert_same_run(result, reference, atol=0)
  lines = (workdir / "metrics.jsonl").read_text().splitlines()
  steps = [json.loads(line)["step"] for line in lines]
  assert steps == list(range(1, 9))  # the killed run's steps after its checkpoint appear once


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stop_signals_are_recorded_not_fatal(sig):
  """Inside StopSignals, SIGTERM and SIGINT only record the request (the loop then saves and
  stops: the end-to-end test below); outside, the previous handlers are back."""
  previous = signal.getsignal(sig)
  with StopSignals() as stop:
    os.kill(os.getpid(), sig)
    assert stop.agreed() == sig
  assert signal.getsignal(sig) == previous


def test_sigterm_saves_the_current_step_and_resumes_exactly(tmp_path, reference,
                                                            sig=signal.SIGTERM):
  """A signal mid-run: the step in flight finishes, is saved (no periodic checkpoint is due),
  the run stops with one line, and the restart continues from that step."""
  workdir = tmp_path / "stopped"
  proc = run_driver(tmp_path, "stopped", "--steps=8", "--step_sleep=0.4",
                    "--checkpoint_every=100", popen=True)
  metrics = workdir / "metrics.jsonl"
  deadline = time.time() + 240
  while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
    assert proc.poll() is None, proc.stdout.read()[-3000:]
    assert time.time() < deadline
    time.sleep(0.05)
  proc.send_signal(sig)
  out = proc.communicate(timeout=120)[0]
  assert proc.returncode == 3, out[-3000:]
  assert "Traceback" not in out
  line = next(x for x in out.splitlines() if x.startswith("stopped by"))
  assert line.startswith(f"stopped by {sig.name} after step ")
  step = int(line.split("after step ")[1].split(":")[0])
  assert 3 <= step < 8 and (workdir / "checkpoints" / str(step)).exists()
  assert not (tmp_path / "stopped.npz").exists()
  result, resumed = run_driver(tmp_path, "stopped", "--steps=8", "--checkpoint_every=100")
  assert f"from step {step}" in resumed.stdout
  assert_same_run(result, reference, atol=0)
  steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
  assert steps == list(range(1, 9))


def test_nan_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
  _, proc = run_driver(tmp_path, "nan", "--steps=8", "--nan_at=4", "--checkpoint_every=2",
                       check=False)
  assert proc.returncode != 0
  last_line = (proc.stdout + proc.stderr).strip().splitlines()[-1]
  assert "NaN/Inf by step 5" in last_line and "last good checkpoint is step 4" in last_line
  checkpoints = sorted(int(p.name) for p in (tmp_path / "nan" / "checkpoints").iterdir()
                       if p.name.isdigit())
  assert checkpoints[-1] == 4


def _snapshot(path: pathlib.Path) -> dict[str, tuple[int, int]]:
  return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns)
          for p in sorted(path.rglob("*"))}


def test_another_models_workdir_is_refused_and_left_untouched(tmp_path):
  run_driver(tmp_path, "mine", "--steps=4")
  before = _snapshot(tmp_path / "mine")
  _, proc = run_driver(tmp_path, "mine", "--steps=6", "--rank=4", check=False)
  assert proc.returncode == 1 and "Traceback" not in proc.stdout + proc.stderr
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("train_driver: workdir: ") and "model.scheme.rank: 8 there, 4 here" in last
  assert _snapshot(tmp_path / "mine") == before


def test_damaged_newest_checkpoint_is_moved_aside_and_the_rerun_is_bit_identical(tmp_path,
                                                                                 reference):
  """Bytes of checkpoint 8's arrays overwritten: the rerun warns, moves it to
  damaged_checkpoints/, resumes from 6 and saves 8 afresh (no collision), ending as the
  uninterrupted run did."""
  run_driver(tmp_path, "damaged", "--steps=8")
  checkpoints = tmp_path / "damaged" / "checkpoints"
  largest = max((p for p in (checkpoints / "8" / "state").rglob("*") if p.is_file()),
                key=lambda p: p.stat().st_size)
  data = bytearray(largest.read_bytes())
  data[len(data) // 2:len(data) // 2 + 64] = bytes(64)
  largest.write_bytes(bytes(data))
  result, rerun = run_driver(tmp_path, "damaged", "--steps=8")
  assert "checkpoint 8 is damaged" in rerun.stderr and "from step 6" in rerun.stdout
  assert_same_run(result, reference, atol=0)
  assert (tmp_path / "damaged" / "damaged_checkpoints" / "8").is_dir()
  assert (checkpoints / "8").is_dir()


def test_a_failed_background_save_stops_the_run_with_one_line(tmp_path):
  """checkpoints/ replaced by a file mid-run (no write can succeed, even as root)."""
  workdir = tmp_path / "blocked"
  proc = run_driver(tmp_path, "blocked", "--steps=40", "--step_sleep=0.1", popen=True)
  _wait_for(proc, lambda: "2" in _steps(workdir / "checkpoints"), "checkpoint 2")
  moved = tmp_path / "moved_checkpoints"
  (workdir / "checkpoints").rename(moved)
  (workdir / "checkpoints").write_text("not a folder")
  out = proc.communicate(timeout=120)[0]
  assert proc.returncode == 1 and "Traceback" not in out, out[-3000:]
  last = out.strip().splitlines()[-1]
  assert last.startswith("train_driver: checkpoints: ") and "failed" in last
  assert (moved / "2").is_dir()


def _train_argv(tmp_path, *overrides):
  return ["train.py", "--config=configs/pretrain.py", f"--workdir={tmp_path / 'run'}",
          *overrides]


def _train_cli(tmp_path, *overrides, timeout=600, env=None):
  return subprocess.run([sys.executable, *_train_argv(tmp_path, *overrides)], cwd=ROOT,
                        capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("overrides,message", [
    (["--config.mesh.shape=(3,1)"], "mesh.shape: (3, 1) does not divide the 1 devices"),
    (["--config.batch_size=10", "--config.grad_accum_steps=4"],
     "batch_size: got 10; allowed: a multiple of grad_accum_steps=4"),
    (["--config.seq_len=512"], "seq_len: 512 exceeds model.max_len=128, the length scheme "
                               "'diet_abs' covers"),
    (["--config.model.num_heads=3"], "model.num_heads: got 3"),
    (["--config.optimizer.name=sgd"], "optimizer.name: got 'sgd'"),
    (["--config.task=glue_nope"], "task: 'glue_nope' is not a registered seqio task"),
])
def test_bad_config_fails_before_compiling_with_one_line(tmp_path, overrides, message):
  proc = forked_cli.run(_train_argv(tmp_path, *overrides), cwd=str(ROOT), timeout=120)
  assert proc.returncode != 0
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("train.py: ") and message in last, proc.stderr[-2000:]
  assert not (tmp_path / "run" / "checkpoints").exists() or not any(
      (tmp_path / "run" / "checkpoints").iterdir())


def test_default_run_learns(tmp_path):
  """The bundled default, shortened: MLM loss falls clearly; checkpoints, metrics, events,
  the compilation cache and a profile of two steps."""
  proc = _train_cli(tmp_path, "--config.total_steps=80", "--config.log_every=10",
                    "--config.eval_every=80", "--config.checkpoint_every=40",
                    "--config.optimizer.warmup_steps=10", "--config.profile_steps=2",
                    f"--config.compilation_cache_dir={tmp_path / 'xla'}", env=optimised_env())
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "first loss" in proc.stdout and "step 80/80" in proc.stdout
  assert "eval at step 80: loss " in proc.stdout  # the evaluation, on the console too
  for notice in ("cuInit", "absl::InitializeLog", "I0000", "uncached FunctionDataset",
                 "cache_dataset_ops"):
    assert notice not in proc.stderr, proc.stderr[-3000:]  # nothing a user can act on
  records = [json.loads(line)
             for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  first, last = records[0], records[-1]
  assert first["step"] == 1 and last["step"] == 80
  assert last["loss"] < first["loss"] - 1.0, (first["loss"], last["loss"])
  assert {"steps_per_s", "tokens_per_s", "tokens_per_s_per_device", "eta_s", "compile_s",
          "learning_rate", "grad_norm", "accuracy", "eval_loss", "eval_perplexity",
          "eval_unigram_perplexity"} <= set(last)
  # The unigram reference beside the perplexity, on the eval line and in the summary: the
  # bundled corpus's 8k pieces give a unigram perplexity in the hundreds.
  assert 300 < last["eval_unigram_perplexity"] < 3000
  assert f"(unigram {last['eval_unigram_perplexity']:.1f})" in proc.stdout
  assert f"against the unigram's {last['eval_unigram_perplexity']:.1f}" in proc.stdout
  assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()
                if p.name.isdigit()) == ["40", "80"]
  assert any((tmp_path / "run" / "tensorboard").iterdir())
  assert "profile of steps 3-4" in proc.stdout
  assert list((tmp_path / "run" / "tensorboard" / "plugins" / "profile").glob("*/*.xplane.pb"))
  assert any(p.name.startswith("jit_step") for p in (tmp_path / "xla").iterdir())


def test_the_unigram_reference_scores_the_tokens_the_loss_scores():
  """A masked LM's reference scores the masked tokens its head reads (the first
  ``predictions`` of a row), a causal LM's the weighted targets; the summary names it."""
  from posenc_jax.training.loop import scored_targets, summary_line  # noqa: PLC0415
  batch = {"mlm_targets": np.array([[7, 8, 9, 10], [11, 12, 13, 14]]),
           "mlm_weights": np.array([[1, 0, 1, 1], [0, 1, 0, 0]], np.float32)}
  targets, weights = scored_targets(batch, "mlm", predictions=2)
  np.testing.assert_array_equal(weights, [[1, 0, 1, 0], [0, 1, 0, 0]])
  assert targets is batch["mlm_targets"]
  _, weights = scored_targets(batch, "mlm")  # every masked position
  np.testing.assert_array_equal(weights, batch["mlm_weights"])
  lm = {"targets": np.array([[5, 6, 0]])}
  np.testing.assert_array_equal(scored_targets(lm, "lm")[1], [[1, 1, 0]])
  history = [{"step": 1, "loss": 9.0}, {"step": 50, "loss": 6.0, "eval_perplexity": 300.0,
                                         "eval_unigram_perplexity": 1000.0}]
  assert summary_line(history) == ("first loss 9.0000 (step 1), last loss 6.0000 (step 50); "
                                   "eval perplexity 300.0 against the unigram's 1000.0 "
                                   "(0.30x) at step 50")
  assert summary_line(history[:1]).endswith("last loss 9.0000 (step 1)")


def test_learning_rate_schedule_and_decay_mask():
  opt = ml_collections.ConfigDict(dict(
      name="adamw", learning_rate=1e-3, warmup_steps=10, warmup_fraction=0.0, schedule="linear",
      b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.01, grad_clip_norm=1.0,
      position_lr_scale=1.0))
  _, schedule = make_optimizer(opt, total_steps=110)
  assert float(schedule(0)) == 0.0
  assert float(schedule(5)) == pytest.approx(5e-4)
  assert float(schedule(10)) == pytest.approx(1e-3)
  assert float(schedule(60)) == pytest.approx(5e-4)
  assert float(schedule(110)) == pytest.approx(0.0, abs=1e-12)
  opt.warmup_fraction = 0.025
  _, schedule = make_optimizer(opt, total_steps=400)
  assert float(schedule(10)) == pytest.approx(1e-3)  # 2.5% of 400
  mask = decay_mask({"dense": {"kernel": 1, "bias": 2}, "norm": {"scale": 3, "bias": 4}})
  assert mask == {"dense": {"kernel": True, "bias": False}, "norm": {"scale": False,
                                                                     "bias": False}}


@pytest.mark.parametrize("preset,head", [
    ("bert_tiny,bert", "mlm"), ("bert_tiny,tupe_r", "mlm"), ("bert_tiny,diet_abs", "mlm"),
    ("bert_tiny,none", "mlm"), ("transformer_base,t5", "translation"),
    ("bert_tiny,t5", "lm")])
def test_position_mask_is_the_schemes_parameters(preset, head):
  """The mask holds exactly the leaves of the scheme modules (every model's ``position``),
  counted against the scheme built alone; nothing of the attention or the embeddings."""
  from posenc_jax.models.build import build_model, init_inputs
  from posenc_jax.models.config import scheme_dims
  from posenc_jax.schemes import build_scheme
  cfg = preset_config(preset).model
  if head == "lm":
    cfg.segment = None
  model = build_model(cfg, head)
  params = jax.eval_shape(model.init, jax.random.key(0), *init_inputs(model))["params"]
  marked = [leaf for leaf, on in zip(jax.tree.leaves(params), jax.tree.leaves(position_mask(
      params))) if on]
  stacks = 2 if head == "translation" else 1  # the encoder's scheme and the decoder's
  alone = build_scheme(cfg.scheme, **scheme_dims(model.config))
  alone_params = jax.eval_shape(lambda: alone.init(jax.random.key(0), 8)).get("params", {})
  assert len(marked) == stacks * len(jax.tree.leaves(alone_params))
  assert position_mask({"token_embed": {"embedding": 0}, "layers": {"query": {"kernel": 0}}}
                       ) == {"token_embed": {"embedding": False},
                             "layers": {"query": {"kernel": False}}}


def test_position_lr_scale_multiplies_the_schemes_steps_alone():
  """One AdamW step with ``position_lr_scale`` k moves each positional parameter k times as
  far as k = 1 (the step and its decoupled decay), and every other parameter the same."""
  from posenc_jax.training.optim import default_optimizer_config
  params = {"bert": {"position": {"relative_bias": jnp.full((2, 3), 0.5)},
                     "layers": {"kernel": jnp.full((3,), 0.5), "bias": jnp.full((3,), 0.5)}}}
  grads = jax.tree.map(lambda x: jnp.linspace(-1.0, 2.0, x.size).reshape(x.shape), params)
  moved = {}
  for k in (1.0, 7.0):
    opt = default_optimizer_config()
    opt.update(dict(learning_rate=1e-2, warmup_steps=0, schedule="constant",
                    position_lr_scale=k))
    tx, _ = make_optimizer(opt, total_steps=10)
    updates, _ = tx.update(grads, tx.init(params), params)
    moved[k] = updates
  np.testing.assert_allclose(moved[7.0]["bert"]["position"]["relative_bias"],
                             7.0 * moved[1.0]["bert"]["position"]["relative_bias"], rtol=1e-6)
  assert np.abs(moved[1.0]["bert"]["position"]["relative_bias"]).min() > 0
  for name in ("kernel", "bias"):
    np.testing.assert_array_equal(moved[7.0]["bert"]["layers"][name],
                                  moved[1.0]["bert"]["layers"][name])


def test_mlm_head_at_masked_positions_only_keeps_loss_and_gradients():
  """``max_predictions_per_seq``: the vocabulary projection at P positions per row gives the
  loss, accuracy and gradients of projecting every position."""
  from posenc_jax.models.build import build_model
  from posenc_jax.presets import preset_config
  from posenc_jax.training.objectives import masked_positions, objective
  cfg = preset_config("bert_tiny,diet_rel").model
  cfg.update(dict(vocab_size=50, d_model=32, num_heads=4, mlp_dim=64, max_len=24))
  model = build_model(cfg, "mlm")
  rng = np.random.default_rng(0)
  ids = rng.integers(6, 50, (3, 24)).astype(np.int32)
  weights = np.zeros((3, 24), np.float32)
  for row, count in enumerate([4, 1, 0]):
    weights[row, rng.choice(np.arange(1, 24), count, replace=False)] = 1.0
  batch = {"input_ids": ids, "segment_ids": np.zeros_like(ids), "mask": np.ones_like(ids),
           "mlm_targets": ids * (weights > 0), "mlm_weights": weights}
  params = model.init(jax.random.key(0), ids)["params"]
  results = [jax.value_and_grad(lambda p, f=objective("mlm", predictions): f(model, p, batch,
                                                                            None), has_aux=True)(
      params) for predictions in (None, 4)]
  (loss, sums), grads = results[0]
  (loss_p, sums_p), grads_p = results[1]
  np.testing.assert_allclose(loss_p, loss, rtol=1e-6)
  assert sums_p["weight"] == sums["weight"] == 5 and sums_p["correct"] == sums["correct"]
  # atol: entries near 0 are sums that cancel, 2e-7 apart in another summation order (jax
  # 0.11.2); the largest entry of a typical leaf is about 0.1.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads_p,
               grads)
  positions = np.asarray(masked_positions(jnp.asarray(weights), 4))
  assert (np.sort(positions[0]) == np.flatnonzero(weights[0])).all()


def test_max_predictions_per_seq_must_cover_every_masked_position():
  config = base_train_config()
  config.update(preset_config("bert_tiny,diet_abs"))
  config.seq_len, config.max_predictions_per_seq = 128, 19
  config.optimizer.warmup_steps = 100
  with pytest.raises(TrainConfigError, match=r"max_predictions_per_seq: got 19; allowed: 0, "
                                             r"or an integer in \[20, seq_len=128\]"):
    validate_train_config(config)
  config.max_predictions_per_seq = 20
  validate_train_config(config)


def test_weighted_cross_entropy_against_numpy():
  logits = jax.random.normal(jax.random.key(0), (3, 5, 7))
  targets = jax.random.randint(jax.random.key(1), (3, 5), 0, 7)
  weights = (jnp.arange(15).reshape(3, 5) % 3 == 0).astype(jnp.float32)
  x = np.asarray(logits, np.float64)
  logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
  nll = -np.take_along_axis(logp, np.asarray(targets)[..., None], -1)[..., 0]
  loss, weight, correct = weighted_cross_entropy(logits, targets, weights)
  assert float(weight) == 5
  np.testing.assert_allclose(loss, (nll * np.asarray(weights)).sum(), rtol=1e-5)
  expected_correct = ((x.argmax(-1) == np.asarray(targets)) * np.asarray(weights)).sum()
  assert float(correct) == expected_correct
  # Label smoothing: cross-entropy against the smoothed target minus its entropy.
  eps = 0.1
  soft = np.full((3, 5, 7), eps / 6)
  np.put_along_axis(soft, np.asarray(targets)[..., None], 1 - eps, -1)
  kl = (soft * (np.log(soft) - logp)).sum(-1)
  smoothed, _, _ = weighted_cross_entropy(logits, targets, weights, 0.1)
  np.testing.assert_allclose(smoothed, (kl * np.asarray(weights)).sum(), rtol=1e-5)


def test_mesh_shape_resolution_and_validation():
  assert mesh_shape((-1, 2), 8) == (4, 2)
  assert mesh_shape((2, -1), 8) == (2, 4)
  with pytest.raises(MeshConfigError, match=r"mesh.shape: \(3, -1\) does not divide the 8"):
    mesh_shape((3, -1), 8)
  with pytest.raises(MeshConfigError, match="uses 4 of the 8 devices"):
    mesh_shape((2, 2), 8)
  with pytest.raises(MeshConfigError, match="at most one -1"):
    mesh_shape((-1, -1), 8)


def test_translation_config_checks_lengths():
  config = base_train_config()
  config.update(dict(objective="translation", head="mlm"))
  with pytest.raises(TrainConfigError, match="head: got 'mlm'; allowed: 'translation'"):
    validate_train_config(config)


def test_translation_training_learns_a_reversal_task(tmp_path):
  """Teacher-forced encoder-decoder training through the loop: past the unigram plateau."""
  result, proc = run_driver(tmp_path, "translation", "--translation", "--steps=500", "--batch=64",
                            "--checkpoint_every=500", env=optimised_env())
  losses = result["losses"]
  assert losses[0] > 6.0 and losses[-1] < 2.6, losses[[0, -1]]
  assert "last loss" in proc.stdout


def test_decode_batches_cut_at_eos():
  from posenc_jax.training.task_eval import _cut
  np.testing.assert_array_equal(_cut(np.array([7, 8, 1, 9, 0]), 1), [7, 8])
  np.testing.assert_array_equal(_cut(np.array([7, 0, 8, 0]), 1), [7, 8])
