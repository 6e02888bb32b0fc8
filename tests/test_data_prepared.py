"""TFDS datasets a run reads must be prepared first, unless the run is asked to prepare them.

Nothing downloads many gigabytes unasked: a task whose TFDS dataset is missing from TFDS's
data folder is one line naming the dataset, the folder and how to prepare it, before anything
is built or written (``prepare_data`` opts into TFDS's own download in the run). The builders
are imported for real (what TFDS imports to prepare them comes with the install), and the
at-scale corpora give batches under ``tfds.testing.mock_data``.
"""

import os
import pathlib

import pytest

from posenc_jax.training.config import TrainConfigError
from tests import forked_cli, tfds_mock

tfds = pytest.importorskip("tensorflow_datasets")
seqio = pytest.importorskip("seqio")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _tfds_names() -> list[str]:
  """Every TFDS dataset a registered task reads (name with config and version)."""
  import posenc_jax.tasks  # noqa: F401, PLC0415 - registers every task
  from posenc_jax.data import tasks  # noqa: PLC0415

  names = {s.tfds_dataset.name for t in seqio.TaskRegistry.names()
           for s in tasks.tfds_sources(seqio.get_mixture_or_task(t))}
  return sorted(n for n in names if n)


def test_every_tfds_builder_imports_what_preparing_it_needs():
  """Each dataset's builder class loads, with the code path and checksums TFDS reads before it
  downloads (TFDS 4.9.10 imports importlib_resources there without listing it: without it
  pg19 failed with ModuleNotFoundError once the download began)."""
  names = _tfds_names()
  assert {"pg19:0.1.1", "c4/en:3.1.0"} <= set(names), names
  for name in names:
    builder_cls = type(tfds.builder(name))
    assert builder_cls.code_path is not None, name
    assert builder_cls.url_infos is not None or name.startswith(("pg19", "wikipedia",
                                                                  "wiki40b")), name


def _config(task: str, **fields):
  from posenc_jax.configs.lm import get_config  # noqa: PLC0415

  config = get_config("bert_tiny,rope,pg19")
  config.task = task
  for field, value in fields.items():
    config[field] = value
  return config


@pytest.mark.parametrize("task, dataset, beam", [("pg19_lm", "pg19:0.1.1", False),
                                                 ("c4_en_lm", "c4/en:3.1.0", True)])
def test_a_missing_dataset_is_one_line_naming_it_and_how_to_prepare_it(tmp_path, monkeypatch,
                                                                       task, dataset, beam):
  from posenc_jax.training.input_pipeline import check_data_config  # noqa: PLC0415

  monkeypatch.setattr(tfds.core.constants, "DATA_DIR", str(tmp_path))
  with pytest.raises(TrainConfigError) as raised:
    check_data_config(_config(task))
  line = str(raised.value)
  assert "\n" not in line
  assert line.startswith(f"task: {task!r} reads the TFDS dataset {dataset!r}, which is not "
                         f"prepared in {tmp_path} ")
  assert f"`tfds build {dataset} --data_dir={tmp_path}`" in line
  assert "--config.prepare_data=true" in line and "nothing was downloaded" in line
  assert ("Apache Beam pipeline" in line) == beam
  assert list(tmp_path.iterdir()) == []  # looking made no folder


def test_a_prepared_dataset_and_the_opt_in_pass(tmp_path, monkeypatch):
  """A folder holding the dataset's info is prepared; ``prepare_data`` skips the check (the
  run then reads through TFDS's download, mocked here: no network)."""
  from posenc_jax.training.input_pipeline import check_data_config  # noqa: PLC0415

  monkeypatch.setattr(tfds.core.constants, "DATA_DIR", str(tmp_path))
  with pytest.raises(TrainConfigError):
    check_data_config(_config("pg19_lm"))
  check_data_config(_config("pg19_lm", prepare_data=True))
  builder = tfds.builder("pg19:0.1.1")
  pathlib.Path(builder.data_dir).mkdir(parents=True)
  builder.info.write_to_directory(builder.data_dir)
  check_data_config(_config("pg19_lm"))


def test_the_corpora_at_scale_give_batches_under_mock_data():
  """With the opt-in, pg19 and C4 runs read TFDS (mocked offline: random documents from each
  builder's features, :mod:`tests.tfds_mock`) and pack them into the trainer's batches."""
  import numpy as np  # noqa: PLC0415

  from posenc_jax.training.input_pipeline import check_data_config, make_batches  # noqa: PLC0415

  with tfds_mock.mock_tfds(num_examples=8):
    for task in ("pg19_lm", "c4_en_lm"):
      config = _config(task, prepare_data=True, seq_len=32, batch_size=2, cache_data="false")
      check_data_config(config)
      batch = next(iter(make_batches(config, "train", 0)))
      assert batch["targets"].shape == (2, 32) and batch["targets"].dtype == np.int32, task


def test_train_py_refuses_an_unprepared_corpus_in_one_line(tmp_path):
  """The tool's line, before a workdir is made (TFDS's default data folder holds no PG-19 on a
  test machine)."""
  if tfds.builder("pg19:0.1.1").is_prepared():
    pytest.skip("PG-19 is prepared on this machine")
  workdir = tmp_path / "run"
  proc = forked_cli.run(["train.py", "--config=configs/lm.py:bert_tiny,rope,pg19",
                         f"--workdir={workdir}"], cwd=str(ROOT), timeout=120)
  assert proc.returncode == 1, proc.stderr
  lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("train.py:")]
  assert len(lines) == 1 and "'pg19:0.1.1', which is not prepared" in lines[0], proc.stderr
  assert "Traceback" not in proc.stderr and "Downloading" not in proc.stderr + proc.stdout
  assert not os.path.exists(workdir)
