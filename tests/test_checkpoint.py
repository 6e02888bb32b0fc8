"""Checkpoint integrity and workdir ownership: fingerprints, every kind of damage skipped
(moved aside by training, left in place by read-only readers), the damaged step saved again
without a collision, and the config.json guard."""

import json
import pathlib
import re
import shutil
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import pytest

from posenc_jax.presets import preset_config
from posenc_jax.training import checkpoint as checkpoint_lib
from posenc_jax.training import params_only
from posenc_jax.training import workdir as workdir_lib
from posenc_jax.training.checkpoint import (Checkpointer, CheckpointError, damage, fingerprints,
                                            restore_params)
from posenc_jax.training.config import TrainConfigError, base_train_config
from tests.test_remote_workdir import bucket  # noqa: F401 - the fake gs:// fixture


def _state(value: float) -> dict:
  return {"params": {"w": jnp.arange(12.0, dtype=jnp.float32).reshape(3, 4) * value,
                     "b": jnp.full((4,), value, jnp.bfloat16)},
          "step": jnp.int32(value)}


def _abstract(state):
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), state)


def test_fingerprints_change_with_any_element_or_order():
  base = fingerprints(_state(1.0))
  assert set(base) == {"params/w", "params/b", "step"} and all(r[2] == 1 for r in base.values())
  changed = _state(1.0)
  changed["params"]["w"] = changed["params"]["w"].at[2, 3].add(1e-6)
  assert fingerprints(changed)["params/w"][0] != base["params/w"][0]
  swapped = _state(1.0)
  swapped["params"]["w"] = swapped["params"]["w"][:, ::-1]
  assert fingerprints(swapped)["params/w"][0] == base["params/w"][0]  # same words, moved
  assert fingerprints(swapped)["params/w"][1] != base["params/w"][1]
  nan = _state(1.0)
  nan["params"]["b"] = nan["params"]["b"].at[0].set(jnp.nan)
  assert fingerprints(nan)["params/b"][2] == 0
  assert damage(nan["params"], base, prefix="params/").startswith("non-finite values in params/b")
  assert damage(changed["params"], base, prefix="params/") == "checksum mismatch in params/w"
  assert damage(_state(1.0)["params"], base, prefix="params/") is None


def test_fingerprints_do_not_depend_on_sharding():
  """Integer sums are exact: an array sharded over 8 devices gives the same fingerprint."""
  code = """
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from posenc_jax.training.checkpoint import fingerprints
x = np.random.default_rng(0).normal(size=(16, 24)).astype(np.float32)
mesh = jax.make_mesh((4, 2), ("a", "b"))
sharded = jax.device_put(x, NamedSharding(mesh, P("a", "b")))
print(fingerprints({"x": x}) == fingerprints({"x": sharded}), len(sharded.sharding.device_set))
"""
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8",
                             "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"})
  assert proc.stdout.split() == ["True", "8"], proc.stderr[-2000:]


def _data_files(step_dir: pathlib.Path) -> list[pathlib.Path]:
  """The files holding the state's array bytes (OCDBT data files, in ``d/`` folders)."""
  files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
  assert files
  return files


def _largest_data_file(step_dir: pathlib.Path) -> pathlib.Path:
  return max(_data_files(step_dir), key=lambda p: p.stat().st_size)


def _truncate(step_dir):
  path = _largest_data_file(step_dir)
  path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


def _overwrite(step_dir):
  path = _largest_data_file(step_dir)
  data = bytearray(path.read_bytes())
  data[len(data) // 2:len(data) // 2 + 32] = bytes(32)
  path.write_bytes(bytes(data))


def _delete_data(step_dir):
  for path in _data_files(step_dir):
    path.unlink()


def _delete_metadata(step_dir):
  """The JSON item (data position and fingerprints) and the state's tree metadata."""
  (step_dir / "data" / "metadata").unlink()
  (step_dir / "state" / "_METADATA").unlink()


def _wrong_checksum(step_dir):
  """Silent corruption the storage layer cannot see: the arrays read back, but differ from
  what was saved (here: the recorded fingerprint is changed instead)."""
  path = step_dir / "data" / "metadata"
  data = json.loads(path.read_text())
  data["fingerprints"]["params/w"][0] += 1
  path.write_text(json.dumps(data))


DAMAGE = {"truncated": _truncate, "overwritten": _overwrite, "data_deleted": _delete_data,
          "metadata_deleted": _delete_metadata, "checksum_mismatch": _wrong_checksum,
          "non_finite": None}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_newest_checkpoint_is_skipped_and_its_step_saved_again(tmp_path, kind):
  checkpointer = Checkpointer(str(tmp_path), save_interval_steps=1, async_save=False)
  checkpointer.save(1, _state(1.0), {"step": 1}, force=True)
  newest = _state(2.0)
  if kind == "non_finite":  # saved as such (training never saves one; a disk could)
    newest["params"]["w"] = newest["params"]["w"].at[0, 0].set(jnp.inf)
  checkpointer.save(2, newest, {"step": 2}, force=True)
  checkpointer.close()
  if DAMAGE[kind]:
    DAMAGE[kind](tmp_path / "checkpoints" / "2")

  # A read-only reader skips step 2 and leaves it where it is.
  step, params = restore_params(str(tmp_path), _state(0.0)["params"])
  assert step == 1 and float(params["w"][1, 1]) == 5.0
  assert (tmp_path / "checkpoints" / "2").is_dir()

  # Training moves it aside, resumes from 1, and saves step 2 again.
  checkpointer = Checkpointer(str(tmp_path), save_interval_steps=1, async_save=False)
  step, state, data = checkpointer.restore_latest(_abstract(_state(0.0)))
  assert (step, data) == (1, {"step": 1}) and checkpointer.last_saved == 1
  assert (tmp_path / "damaged_checkpoints" / "2").is_dir()
  assert checkpointer.save(2, _state(3.0), {"step": 2}, force=True)
  checkpointer.close()
  step, params = restore_params(str(tmp_path), _state(0.0)["params"])
  assert step == 2 and float(params["w"][1, 1]) == 15.0


def test_after_a_restore_asyncio_drops_only_abandoned_tasks_errors(tmp_path):
  """A failed restore's other reads are asyncio tasks whose errors nobody retrieves: asyncio
  logs each with its traceback when it is collected, at any later time. From the first
  restore on, those records are dropped; any other asyncio record still shows."""
  import logging  # noqa: PLC0415

  checkpointer = Checkpointer(str(tmp_path), save_interval_steps=1, async_save=False)
  assert checkpointer.restore_latest(_abstract(_state(0.0))) is None  # nothing saved yet
  record = lambda message: logging.LogRecord(  # noqa: E731
      "asyncio", logging.ERROR, __file__, 0, message, None, None)
  asyncio_log = logging.getLogger("asyncio")
  assert not asyncio_log.filter(record("Task exception was never retrieved\nfuture: <Task>"))
  assert not asyncio_log.filter(record("Future exception was never retrieved\nfuture: <F>"))
  assert asyncio_log.filter(record("Executing <Task> took 0.5 seconds"))
  checkpointer.close()


def test_a_checkpoint_without_its_data_files_is_skipped_quietly(tmp_path):
  """In a process of its own (as training restarts): the skipped step is one short warning
  (TensorStore's spec dump cut), and the failed restore's reads that complete after Orbax
  closed its event loop print no tracebacks."""
  code = f"""
import pathlib, shutil, jax, jax.numpy as jnp
from posenc_jax.training.checkpoint import Checkpointer
state = {{f"w{{i}}": jnp.full((64, 64), float(i)) for i in range(24)}}
checkpointer = Checkpointer({str(tmp_path)!r}, save_interval_steps=1, async_save=False)
for step in (1, 2):
  checkpointer.save(step, state, {{"step": step}}, force=True)
checkpointer.close()
for folder in pathlib.Path({str(tmp_path)!r}, "checkpoints", "2", "state").rglob("d"):
  shutil.rmtree(folder)
checkpointer = Checkpointer({str(tmp_path)!r}, save_interval_steps=1, async_save=False)
abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
print("restored", checkpointer.restore_latest(abstract)[0])
checkpointer.close()
"""
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"}, timeout=300)
  assert proc.stdout.split() == ["restored", "1"], proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
  [warning] = [line for line in proc.stderr.splitlines() if "is damaged" in line]
  assert "NOT_FOUND" in warning and "tensorstore_spec" not in warning and len(warning) < 600


def test_only_a_restore_that_failed_in_its_reads_collects_garbage(tmp_path, monkeypatch):
  """A full collection (for Orbax's never-awaited reads) costs seconds in a large process: a
  step whose data files are gone collects once; a checksum mismatch, read whole, does not.
  The same for the read-only reader (restore_params) and the training run (restore_latest)."""
  collections = []
  monkeypatch.setattr(checkpoint_lib.gc, "collect", lambda *a: collections.append(a))
  checkpointer = Checkpointer(str(tmp_path), save_interval_steps=1, async_save=False)
  for step in (1, 2, 3):
    checkpointer.save(step, _state(float(step)), {"step": step}, force=True)
  checkpointer.close()
  _wrong_checksum(tmp_path / "checkpoints" / "3")
  assert restore_params(str(tmp_path))[0] == 2 and not collections
  for folder in (tmp_path / "checkpoints" / "2" / "state").rglob("d"):
    shutil.rmtree(folder)
  assert restore_params(str(tmp_path))[0] == 1 and len(collections) == 1
  collections.clear()
  checkpointer = Checkpointer(str(tmp_path), save_interval_steps=1, async_save=False)
  assert checkpointer.restore_latest(_abstract(_state(0.0)))[0] == 1
  checkpointer.close()
  assert len(collections) == 1  # step 2's missing files; step 3's mismatch collects nothing


def test_no_good_checkpoint_is_one_line_naming_the_field(tmp_path):
  checkpointer = Checkpointer(str(tmp_path), save_interval_steps=1, async_save=False)
  checkpointer.save(1, _state(1.0), {"step": 1}, force=True)
  checkpointer.close()
  _wrong_checksum(tmp_path / "checkpoints" / "1")
  with pytest.raises(CheckpointError, match=r"^init_checkpoint: no checkpoint in .* restores: "
                                            r"step 1: checksum mismatch in params/w$"):
    restore_params(str(tmp_path), field="init_checkpoint")
  with pytest.raises(CheckpointError, match="^workdir: .* has no checkpoints/ folder"):
    restore_params(str(tmp_path / "nowhere"))


def test_an_unwritable_checkpoint_folder_is_refused_at_once(tmp_path):
  (tmp_path / "checkpoints").write_text("a file where the folder should be")
  with pytest.raises(CheckpointError, match="^checkpoints: .* is not writable"):
    Checkpointer(str(tmp_path), save_interval_steps=1)


def test_a_failed_background_save_is_one_error_at_close(tmp_path):
  """The last save of a run fails in the background (after the folder's probe passed, as a
  remote store may fail): closing says so in one line, and releases Orbax's writer threads
  that waited for the folders the save never made (else they hold the interpreter's exit
  for 300 s). In a process of its own, as a run: nothing is printed after it (no warnings
  for the save's abandoned coroutines at exit)."""
  code = f"""
import shutil, threading, time, jax.numpy as jnp
from orbax.checkpoint._src.futures import future
from posenc_jax.training import checkpoint
root = {str(tmp_path)!r}
state = lambda v: {{"params": {{"w": jnp.full((3, 4), v)}}, "step": jnp.int32(v)}}
before = set(threading.enumerate())
checkpointer = checkpoint.Checkpointer(root, save_interval_steps=1)
checkpointer.save(1, state(1.0), {{"step": 1}}, force=True)
checkpointer.wait()
shutil.move(root + "/checkpoints", root + "/moved")
open(root + "/checkpoints", "w").write("no longer a folder")
checkpoint.check_writable = lambda directory, field: None
checkpointer.save(2, state(2.0), {{"step": 2}}, force=True)
try:
  checkpointer.close()
except checkpoint.BackgroundSaveError as e:
  print(e)
deadline = time.monotonic() + 30
while (writers := [t for t in set(threading.enumerate()) - before
                   if isinstance(t, future._SignalingThread)]) and time.monotonic() < deadline:
  time.sleep(0.1)
print("writers left", len(writers))
"""
  start = time.monotonic()
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"}, timeout=300)
  assert time.monotonic() - start < 120  # not Orbax's 300 s coordination timeout
  lines = proc.stdout.splitlines()
  assert re.match(r"^checkpoints: a save to .* failed \(.*\); stopping: no complete "
                  r"checkpoint is left", lines[0]), proc.stdout + proc.stderr[-3000:]
  assert lines[1:] == ["writers left 0"]
  for noise in ("never awaited", "Traceback"):
    assert noise not in proc.stderr, proc.stderr[-3000:]


def _config(rank=8, total_steps=10) -> ml_collections.ConfigDict:
  config = base_train_config()
  config.update(preset_config("bert_tiny,diet_abs"))
  config.model.scheme.rank = rank
  config.total_steps = total_steps
  return config


def test_workdir_is_claimed_by_one_config(tmp_path):
  workdir = str(tmp_path / "run")
  workdir_lib.claim(workdir, _config())
  saved = json.loads((tmp_path / "run" / "config.json").read_text())
  assert saved["model"]["scheme"] == {"name": "diet_abs", "rank": 8}
  assert saved["model"]["head_dim"] is None  # resolved: defaults written out
  workdir_lib.claim(workdir, _config(total_steps=20))  # a longer run of the same model
  assert json.loads((tmp_path / "run" / "config.json").read_text())["total_steps"] == 20
  before = (tmp_path / "run" / "config.json").read_text()
  with pytest.raises(TrainConfigError, match=r"^workdir: .* holds a run of another config: "
                                             r"model\.scheme\.rank: 8 there, 4 here; use a new"):
    workdir_lib.claim(workdir, _config(rank=4))
  assert (tmp_path / "run" / "config.json").read_text() == before


def test_checkpoints_without_a_config_are_not_adopted(tmp_path):
  (tmp_path / "checkpoints" / "10").mkdir(parents=True)
  with pytest.raises(TrainConfigError, match="holds checkpoints but no config.json"):
    workdir_lib.claim(str(tmp_path), _config())
  assert not (tmp_path / "config.json").exists()
  shutil.rmtree(tmp_path / "checkpoints")
  (tmp_path / "parent_is_a_file").write_text("")
  with pytest.raises(TrainConfigError, match="^workdir: .* cannot be created: .* is a file"):
    workdir_lib.claim(str(tmp_path / "parent_is_a_file" / "run"), _config())


def _trainer_state(value: float) -> dict:
  """:func:`_state` with an optimizer state (Adam's two moments), as the trainer saves."""
  return _state(value) | {"opt_state": {"mu": jnp.full((3, 4), 0.5 * value),
                                        "nu": jnp.full((3, 4), 0.25 * value)}}


def _trained(workdir, steps=(1, 2)) -> dict:
  """Checkpoints of a run with an optimizer state (the parameters of the last step
  returned, on the host)."""
  checkpointer = Checkpointer(str(workdir), save_interval_steps=1, async_save=False)
  for step in steps:
    state = _trainer_state(float(step))
    checkpointer.save(step, state, {"step": step}, force=True)
  checkpointer.close()
  return jax.device_get(state["params"])


def _size(folder: pathlib.Path) -> int:
  return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _assert_params_only(workdir, params, step=2):
  """``workdir`` holds one checkpoint, ``step``, of ``params`` alone (no optimizer state, no
  input state), bit for bit, marked so."""
  assert [p.name for p in (workdir / "checkpoints").iterdir()] == [str(step)]
  assert not (workdir / params_only.SWAP).exists()
  manager = checkpoint_lib._open(str(workdir), "workdir")  # noqa: SLF001
  metadata = manager.item_metadata(step)["state"]
  manager.close()
  assert set(metadata.tree) == {"params"}
  assert not (workdir / "checkpoints" / str(step) / "input").exists()
  assert checkpoint_lib.params_only_step(str(workdir), step)
  saved, restored = restore_params(str(workdir))  # fingerprints verified
  assert saved == step and jax.tree.map(lambda a, b: (a.dtype, a.tobytes()) == (
      b.dtype, b.tobytes()), jax.device_get(restored), params) == {"b": True, "w": True}


def test_keep_params_only_keeps_the_final_params_bit_exact_and_nothing_else(tmp_path):
  params = _trained(tmp_path)
  before = _size(tmp_path / "checkpoints" / "2")
  assert params_only.keep_params_only(str(tmp_path)) == 2
  _assert_params_only(tmp_path, params)
  assert _size(tmp_path / "checkpoints" / "2") < before
  assert set(json.loads((tmp_path / "checkpoints/2/data/metadata").read_text())[
      "fingerprints"]) == {"params/w", "params/b"}  # the optimizer state's are gone too
  assert params_only.keep_params_only(str(tmp_path)) == 2  # already compact: left as is
  _assert_params_only(tmp_path, params)
  assert params_only.keep_params_only(str(tmp_path / "nothing_saved")) is None

  # Training refuses to resume from it, in one line, and leaves it where it is.
  checkpointer = Checkpointer(str(tmp_path), save_interval_steps=1, async_save=False)
  with pytest.raises(CheckpointError, match=r"^checkpoints: step 2 in .* holds the parameters "
                                            r"only .* training cannot resume from it; train in"):
    checkpointer.restore_latest(_abstract(_trainer_state(0.0)))
  checkpointer.close()
  _assert_params_only(tmp_path, params)


def test_keep_params_only_leaves_an_object_store_whole(bucket):
  root, _ = bucket
  (root / "run" / "checkpoints" / "2").mkdir(parents=True)
  with pytest.raises(CheckpointError, match=r"^workdir: gs://bucket/run is in an object store, "
                                            r"which moves a folder file by file: its "
                                            r"checkpoints are left whole"):
    params_only.keep_params_only("gs://bucket/run")
  assert params_only.keep_params_only("gs://bucket/nothing_saved") is None


class Killed(BaseException):
  """A kill, simulated: nothing in the code under test catches it."""


def _write_fails(monkeypatch, tmp_path):
  async def no_space(self, *args, **kwargs):
    raise OSError(28, "No space left on device")
  for handler in (checkpoint_lib.ocp.PyTreeCheckpointHandler,
                  checkpoint_lib.ocp.JsonCheckpointHandler):  # no write left in flight
    monkeypatch.setattr(handler, "async_save", no_space)
  with pytest.raises(CheckpointError, match=r"^workdir: writing the parameters of step 2 to "
                                            r".*checkpoints.swap failed \(.*No space left on "
                                            r"device\); .*checkpoints is left whole$"):
    params_only.keep_params_only(str(tmp_path))


def _killed_writing(monkeypatch, tmp_path):
  """Orbax's half-written step, as a kill leaves it (a folder named as temporary)."""
  del monkeypatch
  half = tmp_path / params_only.SWAP / "2.orbax-checkpoint-tmp-123"
  shutil.copytree(tmp_path / "checkpoints" / "2", half)
  _truncate(half)


def _killed_after_the_swap(monkeypatch, tmp_path):
  swap_in = params_only._swap_in  # noqa: SLF001

  def then_killed(new, live):
    swap_in(new, live)
    raise Killed
  monkeypatch.setattr(params_only, "_swap_in", then_killed)
  with pytest.raises(Killed):
    params_only.keep_params_only(str(tmp_path))
  assert (tmp_path / params_only.SWAP / "2" / "state").is_dir()  # the old step, whole


def _killed_between_renames(monkeypatch, tmp_path):
  """Where the file system cannot exchange two folders in one step."""
  monkeypatch.setattr(params_only, "_exchange", lambda a, b: False)
  rename, live = pathlib.Path.rename, tmp_path / "checkpoints" / "2"

  def killed_moving_in(self, target):  # after the old step moved out
    if pathlib.Path(target) == live:
      raise Killed
    return rename(self, target)
  monkeypatch.setattr(type(checkpoint_lib.epath.Path(tmp_path)), "rename", killed_moving_in)
  with pytest.raises(Killed):
    params_only.keep_params_only(str(tmp_path))
  monkeypatch.undo()
  assert not (tmp_path / "checkpoints" / "2").exists()  # the one moment without it ...
  assert (tmp_path / params_only.SWAP / "2" / "state").is_dir()  # ... the new step whole


@pytest.mark.parametrize("failure", [_write_fails, _killed_writing, _killed_after_the_swap,
                                     _killed_between_renames])
def test_keep_params_only_stopped_anywhere_leaves_a_checkpoint_the_next_call_finishes(
    tmp_path, monkeypatch, failure):
  params = _trained(tmp_path)
  failure(monkeypatch, tmp_path)
  monkeypatch.undo()
  if failure is not _killed_between_renames:  # ... which the next call ends
    step, restored = restore_params(str(tmp_path))
    assert step == 2 and float(restored["w"][1, 1]) == float(params["w"][1, 1])
  if failure in (_write_fails, _killed_writing):  # the old step, optimizer state and all
    checkpointer = Checkpointer(str(tmp_path), save_interval_steps=1, async_save=False)
    assert checkpointer.restore_latest(_abstract(_trainer_state(0.0)))[0] == 2
    checkpointer.close()
  assert params_only.keep_params_only(str(tmp_path)) == 2
  _assert_params_only(tmp_path, params)
