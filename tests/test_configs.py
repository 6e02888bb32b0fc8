"""Every config file builds a valid train config for its documented arguments."""

import importlib.util
import pathlib

import pytest

from posenc_jax.models.build import abstract_params, build_model
from posenc_jax.training.config import validate_train_config

CONFIGS = pathlib.Path(__file__).parent.parent / "configs"


def get_config(name, arg):
  spec = importlib.util.spec_from_file_location(name, CONFIGS / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


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
