"""Every config file builds a valid train config for its documented arguments."""

import dataclasses
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
    ("pretrain", "bert_tiny,diet_abs_share", dict(objective="mlm", total_steps=600,
                                                  mask_rate=0.4)),
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
    ("lm", "bert_tiny,alibi", dict(objective="lm", head="lm", task="wordnet_glosses_lm",
                                   total_steps=500)),
    ("lm", "bert_small,rope,pre_ln", dict(objective="lm", seq_len=64)),
    ("lm", "bert_tiny,t5", dict(head="lm")),
    ("lm", "bert_tiny,rope,stdlib", dict(task="python_stdlib_lm", objective="lm")),
])
def test_config_files_validate(name, arg, expect):
  config = get_config(name, arg)
  validate_train_config(config)
  for key, value in expect.items():
    assert config[key] == value, key
  if arg.endswith("stdlib"):
    assert config.model.vocab_size == 259 and config.model.scheme.name == "rope"
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


# --config.<path>=<text> for every field, and the value it must reach.
MODEL_FIELDS = {
    "vocab_size": ("1000", 1000), "d_model": ("64", 64), "num_layers": ("3", 3),
    "num_heads": ("4", 4), "head_dim": ("32", 32), "mlp_dim": ("96", 96), "max_len": ("96", 96),
    "dropout_rate": ("0.2", 0.2), "attention_dropout_rate": ("0.05", 0.05),
    "layer_norm_eps": ("1e-6", 1e-6), "pre_ln": ("True", True), "activation": ("relu", "relu"),
    "dtype": ("bfloat16", "bfloat16"), "scheme.rank": ("64", 64),
    "segment.name": ("segment_per_head", "segment_per_head"), "pooler": ("False", False),
    "linformer_k": ("64", 64), "linformer_sharing": ("layer", "layer"),
    "route": ("reference", "reference"), "remat": ("full", "full"),
    "scan_layers": ("False", False), "attention_precision": ("tensorfloat32", "tensorfloat32"),
    "num_decoder_layers": ("3", 3), "share_embeddings": ("False", False),
    "attention": ("linformer", "linformer"), "nope_layer_interval": ("2", 2),
    "alternate_scheme_interval": ("2", 2), "alternate_scheme.base": ("500000.0", 500000.0),
}
# The config each field is set in (default: the pre-training demo's presets).
MODEL_SPECS = {"num_decoder_layers": "configs/translate.py:transformer_base,t5",
               "share_embeddings": "configs/translate.py:transformer_base,t5",
               "attention": "configs/pretrain.py:bert_tiny,bert",
               "alternate_scheme.base": "configs/pretrain.py:bert_base,rope,gemma3_global_rope"}
TRAIN_FIELDS = {
    "async_checkpointing": ("False", False), "batch_size": ("16", 16),
    "cache_data": ("false", "false"), "data_sharding": ("stream", "stream"),
    "packed_segments": ("True", True),
    "checkpoint_every": ("70", 70), "compilation_cache_dir": ("/tmp/xla", "/tmp/xla"),
    "eval_every": ("70", 70), "eval_steps": ("3", 3), "grad_accum_steps": ("2", 2),
    "head": ("mlm", "mlm"), "keep_checkpoints": ("2", 2), "label_smoothing": ("0.1", 0.1),
    "log_every": ("5", 5), "mask_rate": ("0.2", 0.2), "max_predictions_per_seq": ("12", 12),
    "mesh.axes": ("('data','tensor')", ("data", "tensor")),
    "mesh.rules": ("(('vocab','tensor'),)", (("vocab", "tensor"),)),
    "mesh.shape": ("(1,1)", (1, 1)), "objective": ("mlm", "mlm"), "optimizer.b1": ("0.8", 0.8),
    "optimizer.b2": ("0.98", 0.98), "optimizer.eps": ("1e-8", 1e-8),
    "optimizer.grad_clip_norm": ("0.5", 0.5), "optimizer.position_lr_scale": ("2.5", 2.5),
    "optimizer.learning_rate": ("0.01", 0.01),
    "optimizer.name": ("lamb", "lamb"), "optimizer.schedule": ("constant", "constant"),
    "optimizer.warmup_fraction": ("0.1", 0.1), "optimizer.warmup_steps": ("0", 0),
    "optimizer.weight_decay": ("0.0", 0.0), "prepare_data": ("True", True),
    "profile_steps": ("2", 2),
    "randomized_positions": ("64", 64), "randomized_positions_eval": ("plain", "plain"),
    "seed": ("3", 3),
    "seq_len": ("48", 48), "task": ("wordnet_glosses", "wordnet_glosses"),
    "total_steps": ("700", 700),
}


def _parsed(spec: str, *overrides: str):
  """``--config=<spec> <overrides>`` as train.py's flags parse them."""
  from absl import flags  # noqa: PLC0415
  from ml_collections import config_flags  # noqa: PLC0415

  from posenc_jax import cli  # noqa: PLC0415

  argv = ["train.py", f"--config={spec}", *overrides]
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=fv, sys_argv=argv)
  cli.flags_parser("train.py", fv=fv)(argv)
  return fv.config


def _leaves(config, prefix=""):
  for key, value in config.items():
    if hasattr(value, "items") and key != "model":
      yield from _leaves(value, f"{prefix}{key}.")
    elif key != "model":
      yield f"{prefix}{key}"


@pytest.mark.parametrize("field", sorted(MODEL_FIELDS))
def test_every_model_field_is_overridable_and_reaches_the_model(field):
  text, value = MODEL_FIELDS[field]
  spec = MODEL_SPECS.get(field, "configs/pretrain.py:bert_tiny,diet_abs_share")
  config = _parsed(spec, f"--config.model.{field}={text}")
  model = build_model(config.model, config.head)
  name, _, key = field.partition(".")
  got = getattr(model.config, name)
  assert (got[key] if key else got) == value


def test_the_model_field_table_covers_every_field():
  from posenc_jax.models import ModelConfig  # noqa: PLC0415

  names = {f.partition(".")[0] for f in MODEL_FIELDS}
  assert names == {f.name for f in dataclasses.fields(ModelConfig)}


def test_every_train_field_is_overridable_and_valid():
  spec = "configs/pretrain.py:bert_tiny,diet_abs_share"
  assert set(_leaves(get_config("pretrain", "bert_tiny,diet_abs_share"))) == set(TRAIN_FIELDS)
  config = _parsed(spec, *(f"--config.{f}={text}" for f, (text, _) in TRAIN_FIELDS.items()))
  for field, (_, value) in TRAIN_FIELDS.items():
    node = config
    for key in field.split("."):
      node = node[key]
    assert node == value, field
  validate_train_config(config)


def test_the_lm_config_has_the_pretraining_fields_and_takes_overrides():
  """``configs/lm.py`` has the pre-training config's fields; each override (but those naming
  the objective and MLM's own) reaches the validated config, and model overrides the LM."""
  assert set(_leaves(get_config("lm", "bert_tiny,rope"))) == set(TRAIN_FIELDS)
  fixed = {"objective", "head", "task", "max_predictions_per_seq", "packed_segments"}
  config = _parsed("configs/lm.py:bert_tiny,rope", "--config.model.num_layers=3",
                   "--config.model.scheme.name=alibi",
                   *(f"--config.{f}={text}" for f, (text, _) in TRAIN_FIELDS.items()
                     if f not in fixed))
  for field, (_, value) in TRAIN_FIELDS.items():
    node = config
    for key in field.split("."):
      node = node[key]
    assert field in fixed or node == value, field
  validate_train_config(config)
  model = build_model(config.model, config.head)
  assert model.config.num_layers == 3 and model.config.scheme["name"] == "alibi"
  assert type(model).__name__ == "CausalLM"


def test_packed_segments_are_the_masked_lm_pipelines():
  from posenc_jax.training.config import TrainConfigError  # noqa: PLC0415

  config = get_config("lm", "bert_tiny,alibi")
  config.packed_segments = True
  with pytest.raises(TrainConfigError) as e:
    validate_train_config(config)
  assert str(e.value).startswith("packed_segments: got True; allowed: false for objective "
                                 "'lm'") and "\n" not in str(e.value)


def test_the_demo_gives_each_scheme_its_calibrated_position_learning_rate():
  """configs/pretrain.py's demo asks DEMO_POSITION_LR_SCALE by the scheme's name; the
  papers' protocols and schemes not measured keep 1."""
  from posenc_jax.configs import pretrain  # noqa: PLC0415
  scales = {s: pretrain.get_config(f"bert_demo,{s}").optimizer.position_lr_scale
            for s in ("t5", "diet_rel", "diet_abs_share", "diet_abs_rank64_share", "bert", "none")}
  assert scales == {"t5": 10.0, "diet_rel": 10.0, "diet_abs_share": 3.0,
                    "diet_abs_rank64_share": 3.0, "bert": 1.0, "none": 1.0}
  assert pretrain.get_config().optimizer.position_lr_scale == 3.0  # the demo's DIET-ABS
  assert pretrain.get_config("bert_base,t5,tupe_protocol").optimizer.position_lr_scale == 1.0
  config = _parsed("configs/pretrain.py:bert_demo,t5", "--config.optimizer.position_lr_scale=2")
  assert config.optimizer.position_lr_scale == 2.0


def test_the_demo_sinusoid_is_quieter_than_vaswanis():
  """The demo's sinusoidal APE (fixed or learnable) has amplitude 1/sqrt(d_model) beside
  BERT's N(0, 0.02) tokens; the papers' protocols keep Vaswani et al.'s 1, and a flag wins."""
  from posenc_jax.configs import pretrain  # noqa: PLC0415
  for preset in ("sinusoidal", "sinusoidal_learnable"):
    config = pretrain.get_config(f"bert_demo,{preset}")
    assert config.model.scheme.amplitude == pytest.approx(128 ** -0.5)
    assert build_model(validate_train_config(config), "mlm") is not None
  assert "amplitude" not in pretrain.get_config("bert_base,sinusoidal,tupe_protocol").model.scheme
  assert "amplitude" not in pretrain.get_config("bert_demo,bert").model.scheme
  config = _parsed("configs/pretrain.py:bert_demo,sinusoidal", "--config.model.scheme.amplitude=1")
  assert config.model.scheme.amplitude == 1.0


def test_wordnet_order_fine_tunes_without_dropout_the_repeated_tasks_with_it():
  """Under about one epoch (wordnet_order) nothing is seen twice to overfit: no dropout; the
  tasks whose 600 steps repeat their train split keep 0.1 (configs/finetune_wordnet.py)."""
  from posenc_jax.configs import finetune_wordnet  # noqa: PLC0415
  rates = {task: finetune_wordnet.get_config(task).model.dropout_rate
           for task in finetune_wordnet.TASKS}
  assert rates == {"wordnet_supersense": 0.1, "wordnet_hypernym": 0.1, "wordnet_order": 0.0}
