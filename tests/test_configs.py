"""Every config file builds a valid train config for its documented arguments."""

import importlib
import importlib.util
import pathlib

import pytest

from posenc_jax.cli import config_path
from posenc_jax.models.build import abstract_params, build_model
from posenc_jax.training.config import validate_train_config

ROOT = pathlib.Path(__file__).parent.parent


def get_config(name, arg):
  return importlib.import_module(f"posenc_jax.configs.{name}").get_config(arg)


@pytest.mark.parametrize("name,arg,expect", [
    ("pretrain", "bert_tiny,diet_abs_share", dict(objective="mlm", total_steps=500)),
    ("pretrain", "bert_base,diet_abs_share,diet_protocol",
     dict(batch_size=4096, total_steps=500_000, seq_len=128)),
    ("pretrain", "bert_base,tupe_r,tupe_protocol", dict(batch_size=256, seq_len=512)),
    ("translate", "transformer_base,diet_rel", dict(objective="translation",
                                                     label_smoothing=0.1)),
    ("translate", "transformer_big,t5,diet_protocol", dict(total_steps=250_000)),
    ("finetune_glue", "glue_cola", dict(best_metric="task_matthews_corr", num_labels=2)),
    ("finetune_glue", "glue_stsb", dict(objective="regression", num_labels=1)),
    ("finetune_glue", "glue_mnli,bert_small,diet_rel", dict(num_labels=3)),
    ("finetune_xtreme", "xnli_de", dict(task="xnli_train", eval_task="xnli_de")),
    ("finetune_xtreme", "mlqa_zh", dict(task="squad_v1", objective="span", seq_len=384)),
    ("finetune_wordnet", "wordnet_hypernym", dict(num_labels=2)),
])
def test_config_files_validate(name, arg, expect):
  config = get_config(name, arg)
  validate_train_config(config)
  for key, value in expect.items():
    assert config[key] == value, key
  if config.objective == "mlm" and "diet" in arg:
    assert config.optimizer.name == ("lamb" if "diet_protocol" in arg else "adamw")


def test_pair_tasks_get_per_head_segments_and_the_model_builds():
  config = get_config("finetune_glue", "glue_rte,bert_tiny,diet_abs_share")
  assert config.model.segment.to_dict() == {"name": "segment_per_head"}
  params = abstract_params(build_model(config.model, config.head, num_labels=config.num_labels))
  assert "segment_bias" in params["bert"]["segment"]
  single = get_config("finetune_glue", "glue_sst2,bert_tiny")
  # Single sentences keep the preset's segments.
  assert single.model.segment.to_dict() == {"name": "segment_input"}


def test_unknown_task_is_one_line():
  with pytest.raises(ValueError, match="task 'glue_nope' is unknown"):
    get_config("finetune_glue", "glue_nope")


PACKAGED = sorted(p.stem for p in (ROOT / "posenc_jax" / "configs").glob("[a-z]*.py"))


@pytest.mark.parametrize("name", PACKAGED)
def test_the_repository_configs_are_the_packaged_ones(name):
  """``configs/<name>.py`` in a clone re-exports the packaged config's ``get_config``."""
  spec = importlib.util.spec_from_file_location(f"thin_{name}", ROOT / "configs" / f"{name}.py")
  thin = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(thin)
  assert thin.get_config is importlib.import_module(f"posenc_jax.configs.{name}").get_config


def test_config_paths_resolve_to_the_packaged_configs(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  packaged = str(ROOT / "posenc_jax" / "configs" / "pretrain.py")
  for spec in ("configs/pretrain.py", "pretrain.py", "pretrain"):
    assert config_path(spec) == packaged
    assert config_path(f"{spec}:bert_tiny,t5") == f"{packaged}:bert_tiny,t5"
  for missing in ("configs/nope.py:x", "/elsewhere/pretrain.py", "my/pretrain.py:x"):
    assert config_path(missing) == missing  # the loader names the file
  (tmp_path / "pretrain.py").write_text("def get_config(arg=None):\n  return {}\n")
  assert config_path("pretrain.py:x") == "pretrain.py:x"  # a file of the user's comes first
