"""Every field a user can type as ``--config.<field>=`` reaches the run, or is one line.

Through the config-parsing API (``cli.flags_parser`` over a fresh ``FlagValues``, as train.py
parses; no training): a scheme's hyperparameters set one by one with their types, for every
scheme config in a config (``model.scheme``, ``model.segment``, any other) and across a change
of ``name`` in either flag order; list fields (``sweep.seeds``) as ``1,2,3`` or ``(1, 2, 3)``;
and the overrides a run would drop without a word (``check_overrides``): a field the
objective does not read, ``sweep.*`` without ``--sweep``, an architecture field that
finetune.py's ``--init_checkpoint`` supplies. Three cases run the tools themselves
(tests/forked_cli.py) for the exit status, the one line and the untouched workdir.
"""

import pathlib
import typing

import pytest
from absl import flags
from ml_collections import config_flags

from posenc_jax import cli
from posenc_jax.models.build import check_head
from posenc_jax.schemes.registry import SCHEMES
from posenc_jax.training.config import TrainConfigError, validate_train_config
from posenc_jax.training.overrides import check_overrides
from tests import forked_cli
from tests.conftest import SCHEME_CONFIGS

ROOT = pathlib.Path(__file__).resolve().parents[1]
PRETRAIN = "configs/pretrain.py:bert_tiny,diet_abs_share"
WORDNET = "configs/finetune_wordnet.py:wordnet_supersense"


def _parse(spec: str, *overrides: str):
  """``--config=<spec> <overrides>`` as train.py parses them: (config, overridden paths)."""
  argv = ["train.py", f"--config={spec}", *overrides]
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=fv, sys_argv=argv)
  cli.flags_parser("train.py", fv=fv)(argv)
  return fv.config, list(fv["config"].override_values)


def _refused(spec: str, *overrides: str) -> str:
  """The one line train.py's flag parsing exits with."""
  with pytest.raises(SystemExit) as exit_info:
    _parse(spec, *overrides)
  line = str(exit_info.value.code)
  assert "\n" not in line and line.startswith("train.py: "), line
  return line.removeprefix("train.py: ")


def _text(value) -> str:
  """``value`` as a user types it after ``--config.<field>=``."""
  return str(value).lower() if isinstance(value, bool) else str(value)


def _other_value(name: str, field: str):
  """A value of ``field`` of scheme ``name`` that is not its default, of its type: the one
  tests/conftest.py's SCHEME_CONFIGS exercise, else one derived from the default."""
  for config in SCHEME_CONFIGS.values():
    if config["name"] == name and field in config:
      value = config[field]
      return tuple(value) if isinstance(value, list) else value
  spec = SCHEMES[name]
  default = spec.values({})[field]
  if isinstance(default, bool):
    return not default
  if isinstance(default, (int, float)):
    return default * 2 + 1
  if isinstance(default, str):
    return next(n for n in spec.module.hyperparameters[field].names if n != default)
  hint = typing.get_type_hints(spec.module)[field]
  kind = next(a for a in typing.get_args(hint) if a is not type(None))
  return {int: 3, float: 0.5}.get(kind, (1.0, 2.0))


@pytest.mark.parametrize("name", sorted(n for n, s in SCHEMES.items() if s.fields))
def test_every_hyperparameter_of_every_scheme_is_settable_alone_with_its_type(name):
  """From the demo's DIET-ABS, ``name=<scheme>`` then each field alone: the scheme config
  holds exactly those values (not the defaults), each of the field's type."""
  slot = "segment" if SCHEMES[name].module.segment_scheme else "scheme"
  values = {f: _other_value(name, f) for f in SCHEMES[name].fields}
  config, _ = _parse(PRETRAIN, f"--config.model.{slot}.name={name}",
                     *(f"--config.model.{slot}.{f}={_text(v)}" for f, v in values.items()))
  got = config.model[slot].to_dict()
  assert got == {"name": name, **values}
  assert {f: type(v) for f, v in got.items()} == {"name": str, **{f: type(v) for f, v in
                                                                   values.items()}}


def test_scheme_fields_set_alone_reach_the_validated_model():
  """``scaling=yarn`` with its ``factor`` (given as an integer, kept a float) on RoPE; a
  bool of TUPE-R; the segment scheme's count: the validated config and model take them."""
  config, _ = _parse("configs/pretrain.py:bert_tiny,rope", "--config.model.scheme.scaling=yarn",
                     "--config.model.scheme.factor=4",
                     "--config.model.scheme.original_max_len=64",
                     "--config.model.segment.num_segments=3")
  cfg = validate_train_config(config)
  assert dict(cfg.scheme) == {"name": "rope", "scaling": "yarn", "factor": 4.0,
                              "original_max_len": 64}
  assert isinstance(cfg.scheme["factor"], float) and cfg.segment["num_segments"] == 3
  config, _ = _parse("configs/pretrain.py:bert_tiny,tupe_r", "--config.model.scheme.cls_buckets")
  assert check_head(config.model, "mlm").scheme["cls_buckets"] is True


@pytest.mark.parametrize("order", ["name first", "field first"])
def test_a_new_scheme_name_starts_that_scheme_afresh_in_either_flag_order(order):
  """DIET-ABS's rank and sharing go with it; RoPE's fields come in, whatever the order."""
  flags_ = ["--config.model.scheme.name=rope", "--config.model.scheme.scaling=yarn"]
  config, _ = _parse(PRETRAIN, *(flags_ if order == "name first" else flags_[::-1]))
  assert config.model.scheme.to_dict() == {"name": "rope", "scaling": "yarn"}
  validate_train_config(config)


def test_the_same_scheme_name_keeps_the_fields_it_has():
  config, _ = _parse(PRETRAIN, "--config.model.scheme.sharing=head",
                     "--config.model.scheme.name=diet_abs")
  assert config.model.scheme.to_dict() == {"name": "diet_abs", "rank": 128, "sharing": "head"}


def test_a_field_the_scheme_lacks_is_one_line_naming_the_schemes_fields():
  line = _refused("configs/pretrain.py:bert_tiny,rope", "--config.model.scheme.rank=3")
  assert line.startswith("config.model.scheme.rank: unknown field; fields of scheme 'rope' "
                         "(config.model.scheme): attention_factor, base,"), line
  line = _refused(PRETRAIN, "--config.model.scheme.name=alibi", "--config.model.scheme.rank=3")
  assert line == ("config.model.scheme.rank: unknown field; fields of scheme 'alibi' "
                  "(config.model.scheme): causal, name, slopes")
  line = _refused(PRETRAIN, "--config.model.segment.sharng=layer")
  assert line == ("config.model.segment.sharng: unknown field; fields of scheme "
                  "'segment_input' (config.model.segment): name, num_segments")
  line = _refused(PRETRAIN, "--config.model.scheme.name=rop", "--config.model.scheme.scaling=yarn")
  assert line.startswith("config.model.scheme.name: scheme 'rop' is unknown; did you mean "
                         "'rope'?; allowed: alibi,"), line
  assert _refused(PRETRAIN, "--config.model.scheme.name=rope",
                  "--config.model.scheme.factor=big") == (
      "--config.model.scheme.factor=big: could not convert string to float: 'big'")


def test_any_scheme_config_in_a_config_takes_its_fields_one_by_one(tmp_path):
  """A scheme config anywhere (a per-layer one, say) is readied the same way; a mapping with
  a name that is no scheme (an optimizer) keeps absl's unknown-field line."""
  path = tmp_path / "nested.py"
  path.write_text("import ml_collections\n\n\ndef get_config():\n  return ml_collections."
                  "ConfigDict({'model': {'layers': {'scheme': {'name': 't5'}}}, "
                  "'optimizer': {'name': 't5x'}})\n")
  config, _ = _parse(str(path), "--config.model.layers.scheme.num_buckets=16",
                     "--config.model.layers.scheme.bidirectional=false")
  assert config.model.layers.scheme.to_dict() == {"name": "t5", "num_buckets": 16,
                                                  "bidirectional": False}
  assert _refused(str(path), "--config.optimizer.lr=1") == (
      "config.optimizer.lr: unknown field; fields of config.optimizer: name")


@pytest.mark.parametrize("text, seeds", [("1,2,3", [1, 2, 3]), ("(1, 2, 3)", [1, 2, 3]),
                                         ("[4]", [4]), ("7", [7]), ("0, 5", [0, 5])])
def test_sweep_lists_take_a_comma_separated_list_or_a_literal(text, seeds):
  config, paths = _parse(WORDNET, f"--config.sweep.seeds={text}",
                         "--config.sweep.learning_rates=1e-3,2e-3")
  assert config.sweep.seeds == seeds and config.sweep.learning_rates == [1e-3, 2e-3]
  assert set(paths) == {"sweep.seeds", "sweep.learning_rates"}
  check_overrides(config, paths, sweep=True)


def test_bad_sweep_elements_are_one_line():
  from posenc_jax.training.finetune import check_finetune  # noqa: PLC0415

  assert _refused(WORDNET, "--config.sweep.seeds=1,,2") == (
      "--config.sweep.seeds=1,,2: '1,,2' has an empty element; allowed: 1,2,3 or (1, 2, 3)")
  assert _refused(WORDNET, "--config.sweep.learning_rates=(1e-3, 2e-3") == (
      "--config.sweep.learning_rates=(1e-3, 2e-3: '(1e-3, 2e-3' is not a list; allowed: 1,2,3 "
      "or (1, 2, 3)")
  for field, text, message in [
      ("seeds", "1,a", "sweep.seeds: got 'a' in [1, 'a']; allowed: non-negative integers"),
      ("seeds", "(0, 1.5)", "sweep.seeds: got 1.5 in [0, 1.5]; allowed: non-negative integers"),
      ("learning_rates", "1e-3,-1",
       "sweep.learning_rates: got -1 in [0.001, -1]; allowed: positive numbers")]:
    config, _ = _parse(WORDNET, f"--config.sweep.{field}={text}")
    with pytest.raises(TrainConfigError) as error:
      check_finetune(config, sweep=True)
    assert str(error.value) == message


def _override_error(spec: str, *overrides: str, **kwargs) -> str | None:
  """``check_overrides``' line for the parsed overrides, or None when it accepts them."""
  config, paths = _parse(spec, *overrides)
  try:
    check_overrides(config, paths, **kwargs)
  except TrainConfigError as e:
    return str(e)
  return None


def test_sweep_fields_without_sweep_are_refused():
  assert _override_error(WORDNET, "--config.sweep.seeds=1,2") == (
      "sweep.seeds: set on the command line, but only finetune.py --sweep reads the sweep "
      "section; add --sweep or drop it")
  assert _override_error(WORDNET, "--config.sweep.learning_rates=1e-3", sweep=True) is None


def test_architecture_fields_that_init_checkpoint_supplies_are_refused():
  """No presets: the checkpoint's config.json gives the architecture, so ``model.d_model``
  (or a scheme field) would be overwritten; named presets are compared with the checkpoint
  by fine-tuning itself, and fields outside the architecture apply."""
  line = _override_error(WORDNET, "--config.model.d_model=64", init_checkpoint="/runs/demo")
  assert line == ("model.d_model: set on the command line, but the config argument names no "
                  "presets, so the model is init_checkpoint's ('/runs/demo', its config.json); "
                  "name the presets in the config argument and set --config.reinitialise=True "
                  "to start what differs from scratch, or drop --config.model.d_model")
  assert _override_error(WORDNET, "--config.model.scheme.rank=8",
                         init_checkpoint="/runs/demo").startswith("model.scheme: set")
  assert _override_error(WORDNET, "--config.model.dropout_rate=0.2",
                         init_checkpoint="/runs/demo") is None
  assert _override_error(f"{WORDNET},bert_tiny,diet_abs_share", "--config.model.d_model=64",
                         init_checkpoint="/runs/demo") is None
  assert _override_error(WORDNET, "--config.model.d_model=64") is None


@pytest.mark.parametrize("spec, overrides, field", [
    ("configs/lm.py", ["--config.mask_rate=0.2"], "mask_rate"),
    ("configs/translate.py", ["--config.mask_rate=0.2"], "mask_rate"),
    (WORDNET, ["--config.data_sharding=stream"], "data_sharding"),
    ("configs/probe.py", ["--config.cache_data=false"], "cache_data"),
    (WORDNET, ["--config.eval_steps=3"], "eval_steps"),
    (WORDNET, ["--config.objective=regression", "--config.label_smoothing=0.1"],
     "label_smoothing"),
    ("configs/translate.py", ["--config.seq_len=64"], "seq_len"),
    (PRETRAIN, ["--config.randomized_positions_eval=plain"], "randomized_positions_eval"),
    (WORDNET, ["--config.optimizer.warmup_steps=100"], "optimizer.warmup_steps"),
    ("configs/lm.py", ["--config.model.pooler=True"], "model.pooler"),
    (PRETRAIN, ["--config.model.share_embeddings=False"], "model.share_embeddings"),
])
def test_fields_the_run_does_not_read_are_refused(spec, overrides, field):
  line = _override_error(spec, *overrides)
  assert line and line.startswith(f"{field}: set on the command line, but this run does not "
                                  "read it: ") and line.endswith(f"; drop --config.{field}")


@pytest.mark.parametrize("spec, overrides", [
    (PRETRAIN, ["--config.mask_rate=0.2", "--config.data_sharding=stream",
                "--config.cache_data=false", "--config.eval_steps=3",
                "--config.label_smoothing=0.1", "--config.seq_len=64"]),
    ("configs/lm.py", ["--config.cache_data=false", "--config.randomized_positions=128",
                       "--config.randomized_positions_eval=plain"]),
    ("configs/translate.py", ["--config.input_len=64", "--config.label_smoothing=0",
                              "--config.eval_steps=3", "--config.model.share_embeddings=False"]),
    (WORDNET, ["--config.optimizer.warmup_fraction=0", "--config.optimizer.warmup_steps=100",
               "--config.label_smoothing=0.1", "--config.model.pooler=True"]),
])
def test_fields_the_run_reads_are_accepted(spec, overrides):
  assert _override_error(spec, *overrides) is None


def test_a_segment_preset_on_the_language_model_is_one_line():
  for preset in ("segment_per_head", " segment_per_head"):
    line = _refused(f"configs/lm.py:bert_tiny,alibi,{preset}")
    assert line == ("config preset: 'segment_per_head' sets model.segment, but the language "
                    "model reads one text stream (no token types, no segment scheme); drop it")
  config, _ = _parse("configs/lm.py:bert_tiny,alibi,no_segment")
  assert config.model.segment is None


@pytest.mark.parametrize("argv, line", [
    (["train.py", "--config=configs/pretrain.py", "--config.model.scheme.name=rope",
      "--config.model.scheme.scalng=yarn"],
     ("train.py: config.model.scheme.scalng: unknown field; did you mean 'scaling'?; fields of "
      "scheme 'rope'")),
    (["train.py", "--config=configs/lm.py", "--config.mask_rate=0.3"],
     "train.py: mask_rate: set on the command line, but this run does not read it"),
    (["finetune.py", f"--config={WORDNET}", "--init_checkpoint={tmp}",
      "--config.model.d_model=64"],
     ("finetune.py: model.d_model: set on the command line, but the config argument names no "
      "presets")),
], ids=["train.py scheme field", "train.py mask_rate on lm", "finetune.py d_model"])
def test_the_tools_exit_with_the_line_before_any_work(argv, line, tmp_path):
  run = tmp_path / "run"
  proc = forked_cli.run([a.format(tmp=tmp_path) for a in argv] + [f"--workdir={run}"],
                        cwd=str(ROOT), timeout=120)
  assert proc.returncode != 0 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr
  assert proc.stderr.strip().splitlines()[-1].startswith(line), proc.stderr[-2000:]
  assert not run.exists() and not proc.stdout

