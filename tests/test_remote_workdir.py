"""A ``gs://`` workdir: everything a run writes goes through ``etils.epath`` to the bucket.

The bucket is a fake: epath's backend for ``gs://`` maps ``gs://bucket/...`` onto a local
folder, and Orbax (whose array data goes through TensorStore's own GCS
driver, which cannot be faked offline) is handed the local folder of the URI it is given,
which the test records.
"""

import json
import os
import pathlib

import numpy as np
import orbax.checkpoint as ocp
import pytest
from etils import epath
from etils.epath import backend, gpath

from posenc_jax.presets import preset_config
from posenc_jax.training.checkpoint import restore_params
from posenc_jax.training.config import base_train_config
from posenc_jax.training.finetune import is_train_workdir
from posenc_jax.training.loop import train

VOCAB, LENGTH, BATCH = 64, 16, 4


class _Bucket(backend._OsPathBackend):  # noqa: SLF001 - the os backend, paths translated
  """epath's backend for ``gs://bucket/...``: the same calls on a local folder."""

  def __init__(self, root: pathlib.Path):
    self.root = root

  def local(self, path) -> str:
    path = os.fspath(path)
    return str(self.root / path[len("gs://bucket/"):]) if path.startswith("gs://bucket") else path

  def remote(self, path) -> str:
    return "gs://bucket/" + os.path.relpath(os.fspath(path), self.root)

  def open(self, path, mode):
    return super().open(self.local(path), mode)

  def exists(self, path):
    return super().exists(self.local(path))

  def isdir(self, path):
    return super().isdir(self.local(path))

  def listdir(self, path):
    return super().listdir(self.local(path))

  def glob(self, path):
    return [self.remote(p) for p in super().glob(self.local(path))]

  def walk(self, top, **kwargs):
    for folder, dirs, files in super().walk(self.local(top), **kwargs):
      yield self.remote(folder), dirs, files

  def makedirs(self, path, **kwargs):
    return super().makedirs(self.local(path), **kwargs)

  def mkdir(self, path, **kwargs):
    return super().mkdir(self.local(path), **kwargs)

  def rmtree(self, path):
    return super().rmtree(self.local(path))

  def remove(self, path):
    return super().remove(self.local(path))

  def rename(self, path, dst):
    return super().rename(self.local(path), self.local(dst))

  def replace(self, path, dst):
    return super().replace(self.local(path), self.local(dst))

  def copy(self, path, dst, **kwargs):
    return super().copy(self.local(path), self.local(dst), **kwargs)

  def stat(self, path):
    return super().stat(self.local(path))


@pytest.fixture
def bucket(tmp_path, monkeypatch):
  """``gs://bucket/...`` is ``<tmp>/bucket/...`` for epath; returns (that folder, the URIs
  Orbax's managers were opened on)."""
  root = tmp_path / "bucket"
  root.mkdir()
  fake = _Bucket(root)
  monkeypatch.setitem(gpath._PREFIX_TO_BACKEND, "gs", fake)  # noqa: SLF001
  # With TensorFlow installed epath sends gs:// to tf.io.gfile, past that table.
  monkeypatch.setattr(gpath, "_is_tf_installed", lambda: False)
  opened = []
  manager = ocp.CheckpointManager

  def recording_manager(directory, *args, **kwargs):
    opened.append(os.fspath(directory))
    return manager(fake.local(directory), *args, **kwargs)

  monkeypatch.setattr(ocp, "CheckpointManager", recording_manager)
  monkeypatch.chdir(tmp_path)
  return root, opened


def _config(steps: int):
  c = base_train_config()
  c.update(preset_config("bert_tiny,diet_abs_share"))
  c.model.update(dict(vocab_size=VOCAB, d_model=32, num_heads=4, mlp_dim=64, max_len=LENGTH,
                      dropout_rate=0.0, attention_dropout_rate=0.0))
  c.update(dict(seq_len=LENGTH, batch_size=BATCH, max_predictions_per_seq=LENGTH,
                total_steps=steps, log_every=1, eval_every=0, checkpoint_every=2,
                compilation_cache_dir=""))
  c.optimizer.update(dict(learning_rate=1e-3, warmup_steps=1))
  return c


def _data(config, split, start_step, shard_id=0, num_shards=1):
  step = start_step
  while True:
    rng = np.random.default_rng(step)
    ids = rng.integers(6, VOCAB, (BATCH, LENGTH)).astype(np.int32)
    weights = (rng.random((BATCH, LENGTH)) < 0.3).astype(np.float32)
    yield {"input_ids": np.where(weights > 0, 5, ids), "segment_ids": np.zeros_like(ids),
           "mask": np.ones_like(ids), "mlm_targets": ids * (weights > 0), "mlm_weights": weights}
    step += 1


def test_a_gs_workdir_receives_config_metrics_events_and_checkpoints(bucket, tmp_path):
  root, opened = bucket
  train(_config(4), "gs://bucket/run", data=_data)
  run = root / "run"
  assert opened == ["gs://bucket/run/checkpoints"]  # the URI itself, not a local 'gs:' folder
  assert json.loads((run / "config.json").read_text())["total_steps"] == 4
  steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
  assert steps == [1, 2, 3, 4]
  events = list((run / "tensorboard").glob("events.out.tfevents.*"))
  assert events and events[0].stat().st_size > 100
  assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "4"]
  assert not (tmp_path / "gs:").exists()
  assert is_train_workdir("gs://bucket/run") and not is_train_workdir("gs://bucket/none")

  # A longer run resumes there: the config check, the restore and the metrics all read the
  # bucket; each step is logged once.
  train(_config(6), "gs://bucket/run", data=_data)
  steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
  assert steps == [1, 2, 3, 4, 5, 6]

  # --init_checkpoint (fine-tuning, analysis) reads the same bucket.
  step, params = restore_params("gs://bucket/run", field="init_checkpoint")
  assert step == 6 and "bert" in params and opened[-1] == "gs://bucket/run/checkpoints"


def test_remote_output_folders_are_created_through_epath(bucket):
  from posenc_jax.cli import absolute, check_output_dir  # noqa: PLC0415

  root, _ = bucket
  assert check_output_dir("workdir", "gs://bucket/a/b") == "gs://bucket/a/b"
  assert (root / "a" / "b").is_dir() and epath.Path("gs://bucket/a/b").is_dir()
  assert absolute("gs://bucket/x") == "gs://bucket/x"
  assert absolute("x") == str(pathlib.Path("x").absolute())
