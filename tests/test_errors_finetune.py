"""Fine-tuning refuses what would otherwise go wrong silently or late, with one line naming the
field and the value given: the config's fine-tuning fields (checked before anything is built),
an ``init_checkpoint`` whose encoder does not fit the model, a broken Hugging Face folder, and
the same through ``finetune.py`` (one line, non-zero exit, no traceback). The positive controls
show that the legitimate differences (a fresh head, per-head segments, a swapped-in position
scheme, no pooler) still load every other encoder parameter, and that every shipped
fine-tuning config passes."""

import importlib
import json
import pathlib
import re

import jax
import numpy as np
import pytest
import seqio

from posenc_jax.convert import ConversionError
from posenc_jax.models import model_config
from posenc_jax.models.build import abstract_params, build_model
from posenc_jax.training import finetune as finetune_lib
from posenc_jax.training.config import TrainConfigError
from posenc_jax.training.workdir import ARCHITECTURE, resolved_config, resolved_model
from tests import forked_cli
from tests.test_evaluate import _fake_workdir
from tests.test_hf_bert import hf_tensors, tiny_hf_config, write_checkpoint

ROOT = pathlib.Path(__file__).parent.parent
TINY = dict(vocab_size=50, d_model=32, num_layers=2, num_heads=4, mlp_dim=48, max_len=16)
DELETE = object()


def get_config(name, arg):
  return importlib.import_module(f"posenc_jax.configs.{name}").get_config(arg)


def wordnet_config(changes):
  """``finetune_wordnet.py:wordnet_supersense`` with ``{"a.b": value or DELETE}`` applied."""
  config = get_config("finetune_wordnet", "wordnet_supersense")
  for path, value in changes.items():
    *parents, leaf = path.split(".")
    node = config
    for key in parents:
      node = node[key]
    if value is DELETE:
      del node[leaf]
    else:
      node[leaf] = value
  return config


def params(head="classification", **changes):
  """A tiny model's parameters (``head`` ``encoder``: the encoder alone), filled with 7."""
  model = build_model(model_config(TINY | changes), head, num_labels=3)
  return jax.tree.map(lambda x: np.full(x.shape, 7.0, x.dtype), abstract_params(model))


def truncate(path):
  path.write_bytes(path.read_bytes()[:200])


def hf_folder(root, break_it=None):
  """A tiny Hugging Face BERT folder (``break_it(folder)`` applied)."""
  hf = tiny_hf_config()
  folder = write_checkpoint(root / "hf", hf, hf_tensors(hf))
  if break_it:
    break_it(folder)
  return folder


def rewrite_config(text):
  return lambda folder: (folder / "config.json").write_text(text)


def without_vocabulary(break_it):
  """``break_it`` and the folder's ``vocab.txt`` removed (what a vocabulary check would ask
  for first)."""
  return lambda folder: (break_it(folder), (folder / "vocab.txt").unlink())


def drop_field(field):
  return rewrite_config(json.dumps({k: v for k, v in tiny_hf_config().items() if k != field}))


def wrong_shape(folder):
  hf = tiny_hf_config()
  tensors = hf_tensors(hf)
  tensors["bert.encoder.layer.1.intermediate.dense.weight"] = np.zeros((16, 32), np.float32)
  write_checkpoint(folder, hf, tensors)


FT = ["finetune.py", "--config=configs/finetune_wordnet.py:wordnet_supersense",
      "--workdir={tmp}/ft"]

# (id, kind, setup, expected start of the one line). Kinds: "config" (check_finetune of
# wordnet_config(setup)), "sweep" (the same with sweep=True), "merge" (merge_encoder of
# setup() = (target, source): a model's parameters, the encoder's in a checkpoint; ``params()``
# as a source is a whole model, not an encoder), "hf" (pretrained_encoder of a Hugging Face
# folder broken by ``setup``), "cli" (finetune.py with these arguments, or (arguments,
# breaker) for a Hugging Face folder {hf}; {tmp}: the test's folder).
CASES = [
    ("num_labels_vs_task", "config", {"num_labels": 2},
     "num_labels: got 2; the task 'wordnet_supersense' has 45 labels"),
    ("num_labels_zero", "config", {"num_labels": 0},
     "num_labels: got 0; allowed: a positive integer"),
    ("task_typo", "config", {"task": "wordnet_supersence"},
     "task: 'wordnet_supersence' is not a registered task; did you mean 'wordnet_supersense'?;"),
    ("task_without_labels", "config", {"task": "wordnet_glosses"},
     "objective: got 'classification'; the task 'wordnet_glosses' (task) fits none"),
    ("task_without_train_split", "config", {"task": "xnli_de", "num_labels": 3},
     "task: 'xnli_de' has no 'train' split (splits: validation, test)"),
    ("objective_regression_on_classes", "config", {"objective": "regression"},
     "objective: got 'regression'; the task 'wordnet_supersense' (task) has class labels: use "
     "'classification'"),
    ("objective_mlm", "config", {"objective": "mlm", "head": "mlm"},
     "objective: got 'mlm'; allowed for fine-tuning: classification, regression, span"),
    ("eval_task_typo", "config", {"eval_task": "wordnet_hypernim"},
     "eval_task: 'wordnet_hypernim' is not a registered task; did you mean 'wordnet_hypernym'?;"),
    ("num_labels_vs_eval_task", "config", {"eval_task": "wordnet_hypernym"},
     "num_labels: got 45; the task 'wordnet_hypernym' has 2 labels"),
    ("eval_split_typo", "config", {"eval_split": "validaton"},
     "eval_split: got 'validaton'; did you mean 'validation'?; the task 'wordnet_supersense' has "
     "train, validation, test"),
    ("best_metric_typo", "config", {"best_metric": "task_acuracy"},
     "best_metric: got 'task_acuracy'; did you mean 'task_accuracy'?; the evaluation reports "
     "eval_loss, eval_accuracy, task_accuracy"),
    ("best_metric_loss", "config", {"best_metric": "eval_loss"},
     "best_metric: got 'eval_loss'; the best evaluation is the highest score"),
    ("best_metric_never_evaluated", "config", {"eval_every": 0},
     "eval_every: got 0; best_metric 'task_accuracy' needs evaluations"),
    ("sweep_missing", "sweep", {"sweep": DELETE}, "sweep: the config has no sweep section"),
    ("sweep_no_seeds", "sweep", {"sweep.seeds": []},
     "sweep.seeds: got []; allowed: a non-empty list of non-negative integers"),
    ("sweep_seed_twice", "sweep", {"sweep.seeds": [0, 1, 0]},
     "sweep.seeds: 0 appears twice in [0, 1, 0]"),
    ("sweep_negative_learning_rate", "sweep", {"sweep.learning_rates": [1e-3, -1e-3]},
     "sweep.learning_rates: got -0.001 in [0.001, -0.001]; allowed: positive numbers"),
    ("sweep_without_best_metric", "sweep", {"best_metric": None}, "best_metric: unset"),
    ("encoder_wider", "merge", lambda: (params(), params("encoder", d_model=64)),
     "init_checkpoint: 'pretrained' does not fit the model: bert/embed_norm/bias has shape (64,) "
     "in the checkpoint, (32,) in the model; the pre-trained model has d_model=64 (model.d_model "
     "is 32)"),
    ("encoder_other_vocabulary", "merge", lambda: (params(), params("encoder", vocab_size=60)),
     "init_checkpoint: 'pretrained' does not fit the model: bert/token_embed/embedding has shape "
     "(60, 32) in the checkpoint, (50, 32) in the model; the pre-trained model has vocab_size=60 "
     "(model.vocab_size is 50)"),
    ("encoder_fewer_layers", "merge", lambda: (params(num_layers=3), params("encoder")),
     "init_checkpoint: 'pretrained' does not fit the model: bert/layers/attention/key/bias has "
     "shape (2, 4, 8) in the checkpoint, (3, 4, 8) in the model; the pre-trained model has "
     "num_layers=2 (model.num_layers is 3)"),
    ("encoder_more_layers", "merge", lambda: (params(), params("encoder", num_layers=3)),
     "init_checkpoint: 'pretrained' does not fit the model: bert/layers/attention/key/bias has "
     "shape (3, 4, 8) in the checkpoint, (2, 4, 8) in the model; the pre-trained model has "
     "num_layers=3 (model.num_layers is 2)"),
    ("encoder_not_bert", "merge", lambda: (params(), params()),
     "init_checkpoint: 'pretrained' does not fit the model: bert/embed_norm/bias is in the "
     "model, not in the checkpoint"),
    ("hf_config_not_json", "hf", rewrite_config("{'hidden_size': 16,"),
     "init_checkpoint: {hf}/config.json: not JSON: Expecting property name enclosed in double "
     "quotes"),
    ("hf_config_not_an_object", "hf", rewrite_config("[1, 2]"),
     "init_checkpoint: {hf}/config.json: not a JSON object but a list"),
    ("hf_config_missing_field", "hf", drop_field("hidden_size"),
     "init_checkpoint: {hf}: config.json hidden_size: missing"),
    ("hf_config_wrong_type", "hf", rewrite_config(json.dumps(tiny_hf_config(
        hidden_dropout_prob="high"))),
     "init_checkpoint: {hf}: config.json hidden_dropout_prob: got 'high'; expected a number"),
    ("hf_weights_missing", "hf", lambda folder: (folder / "model.safetensors").unlink(),
     "init_checkpoint: {hf}: no model.safetensors"),
    ("hf_weights_truncated", "hf", lambda folder: truncate(folder / "model.safetensors"),
     "init_checkpoint: {hf}/model.safetensors: not a readable safetensors file: Error while "
     "deserializing header"),
    ("hf_weights_wrong_shape", "hf", wrong_shape,
     "init_checkpoint: {hf}/model.safetensors: layers_1/mlp/wi/kernel: checkpoint tensor "
     "encoder.layer.1.intermediate.dense.weight has shape (16, 32), expected (32, 16)"),
    ("cli_config_argument_typo", "cli",
     ["finetune.py", "--config=configs/finetune_wordnet.py:wordnet_supersence",
      "--workdir={tmp}/ft"],
     "finetune.py: config argument: task 'wordnet_supersence' is unknown; did you mean "
     "'wordnet_supersense'?;"),
    ("cli_sweep_without_section", "cli",
     ["finetune.py", "--config=configs/pretrain.py", "--workdir={tmp}/ft", "--sweep"],
     "finetune.py: sweep: the config has no sweep section"),
    ("cli_init_checkpoint_missing", "cli", FT + ["--init_checkpoint={tmp}/nowhere"],
     "finetune.py: init_checkpoint: '{tmp}/nowhere' does not exist"),
    ("cli_hf_config_not_json", "cli",
     (FT + ["--init_checkpoint={hf}"], rewrite_config("{'hidden_size': 16,")),
     "finetune.py: init_checkpoint: {hf}/config.json: not JSON"),
    ("cli_init_checkpoint_is_a_file", "cli", (FT + ["--init_checkpoint={hf}/vocab.txt"], None),
     "finetune.py: init_checkpoint: '{hf}/vocab.txt' is a file; allowed: a train.py workdir "
     "(with checkpoints/) or a Hugging Face BERT folder"),
    ("cli_hf_config_empty", "cli",
     (FT + ["--init_checkpoint={hf}"], without_vocabulary(rewrite_config(""))),
     "finetune.py: init_checkpoint: {hf}/config.json: empty; expected the model's JSON object"),
    ("cli_hf_config_torn", "cli",
     (FT + ["--init_checkpoint={hf}"], without_vocabulary(rewrite_config('{"hidden_si'))),
     "finetune.py: init_checkpoint: {hf}/config.json: not JSON: Unterminated string"),
    ("cli_hf_model_is_not_the_presets", "cli",
     ([FT[0], FT[1] + ",bert_tiny,diet_abs_share", *FT[2:], "--init_checkpoint={hf}"], None),
     "finetune.py: model.vocab_size: 40 in init_checkpoint, 8192 here (and 5 more): the presets "
     "'bert_tiny,diet_abs_share' are not the pre-trained model; drop them"),
    ("cli_hf_model_too_short_for_the_task", "cli", (FT + ["--init_checkpoint={hf}"], None),
     "finetune.py: seq_len: 64 exceeds model.max_len=20, the length scheme 'learned_ape' covers"),
    ("cli_hf_encoder_does_not_fit", "cli",
     ([FT[0], FT[1] + ",bert_tiny,diet_abs_share", *FT[2:], "--init_checkpoint={hf}",
       "--config.reinitialise=True"], None),
     "finetune.py: init_checkpoint: '{hf}' does not fit the model: bert/embed_norm/bias has "
     "shape (16,) in the checkpoint, (128,) in the model; the pre-trained model has "
     "vocab_size=40 (model.vocab_size is 8192), d_model=16 (model.d_model is 128), num_heads=4 "
     "(model.num_heads is 2), mlp_dim=32 (model.mlp_dim is 512)"),
]


def run_case(kind, setup, tmp_path, hf):
  """The one line the case ends with."""
  if kind in ("config", "sweep"):
    with pytest.raises(TrainConfigError) as info:
      finetune_lib.check_finetune(wordnet_config(setup), sweep=kind == "sweep")
  elif kind == "merge":
    with pytest.raises(TrainConfigError) as info:
      finetune_lib.merge_encoder(*setup(), "pretrained")
  elif kind == "hf":
    with pytest.raises(ConversionError) as info:
      finetune_lib.pretrained_encoder(str(hf))
  else:
    run = forked_cli.run([a.format(tmp=tmp_path, hf=hf) for a in setup], cwd=str(ROOT),
                         timeout=300)
    assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr[-3000:]
    lines = [line for line in run.stderr.splitlines() if line.startswith("finetune.py")]
    assert len(lines) == 1, run.stderr[-3000:]
    return lines[0]
  return str(info.value)


@pytest.mark.parametrize("kind, setup, expected", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_one_line_naming_the_field(kind, setup, expected, tmp_path):
  hf = None
  if kind == "hf":
    hf = hf_folder(tmp_path, setup)
  elif kind == "cli" and isinstance(setup, tuple):
    setup, break_it = setup
    hf = hf_folder(tmp_path, break_it)
  line = run_case(kind, setup, tmp_path, hf)
  assert "\n" not in line
  assert line.startswith(expected.format(tmp=tmp_path, hf=hf)), line


# --- positive controls ------------------------------------------------------------------------

@pytest.mark.parametrize("changes, fresh, unused", [
    (dict(segment={"name": "segment_per_head"}), ["bert/segment/segment_bias"],
     ["segment/segment_embedding"]),
    (dict(scheme={"name": "diet_abs", "rank": 4}), ["bert/position/p_key", "bert/position/p_query"],
     ["position/position_embedding"]),
    (dict(scheme={"name": "t5"}), ["bert/position/relative_bias"], ["position/position_embedding"]),
])
def test_legitimate_differences_load_every_other_encoder_parameter(changes, fresh, unused):
  source = params("encoder", scheme={"name": "learned_ape"})
  target = params(**changes)
  merged, report = finetune_lib.merge_encoder(target, source, "pretrained")
  encoder = [f"bert/{p}" for p in finetune_lib.traverse_util.flatten_dict(target["bert"], sep="/")]
  assert sorted(report.fresh) == sorted(fresh + ["classifier/bias", "classifier/kernel"])
  assert sorted(report.loaded) == sorted(set(encoder) - set(fresh))
  assert report.unused == unused
  assert np.all(merged["bert"]["layers"]["mlp"]["wo"]["kernel"] == 7.0)


def test_a_checkpoint_without_pooler_leaves_it_fresh():
  source = params("encoder", pooler=False)
  _, report = finetune_lib.merge_encoder(params(), source, "pretrained")
  assert sorted(report.fresh) == ["bert/pooler/bias", "bert/pooler/kernel", "classifier/bias",
                                  "classifier/kernel"]
  assert not report.unused


def test_hugging_face_folder_into_another_scheme_with_per_head_segments(tmp_path):
  folder = hf_folder(tmp_path)
  source = finetune_lib.pretrained_encoder(str(folder))
  target = params(vocab_size=40, d_model=16, mlp_dim=32, max_len=20,
                  scheme={"name": "diet_abs", "rank": 4}, segment={"name": "segment_per_head"})
  _, report = finetune_lib.merge_encoder(target, source, str(folder))
  fresh = ["bert/position/p_key", "bert/position/p_query", "bert/segment/segment_bias",
           "classifier/bias", "classifier/kernel"]
  assert sorted(report.fresh) == fresh
  assert report.unused == ["position/position_embedding", "segment/segment_embedding"]
  encoder = [f"bert/{p}" for p in finetune_lib.traverse_util.flatten_dict(target["bert"], sep="/")]
  assert sorted(report.loaded) == sorted(set(encoder) - set(fresh))
  assert len(report.loaded) == 21  # 16 of the (scanned) layers, embedding and its norm, pooler


@pytest.mark.parametrize("name, arg", [
    ("finetune_wordnet", "wordnet_supersense"), ("finetune_wordnet", "wordnet_hypernym"),
    ("finetune_glue", "glue_stsb,bert_tiny"), ("finetune_glue", "glue_mrpc,bert_tiny"),
    ("finetune_xtreme", "xnli_de,bert_tiny"), ("finetune_xtreme", "mlqa_zh,bert_small"),
])
def test_shipped_configs_pass(name, arg):
  finetune_lib.check_finetune(get_config(name, arg), sweep=True)


def _pretrained_workdir(tmp_path, presets: str) -> str:
  """A train.py workdir's ``config.json`` (the run's resolved config) and ``checkpoints/``."""
  workdir = tmp_path / "pre"
  (workdir / "checkpoints").mkdir(parents=True)
  pre = get_config("pretrain", presets)
  (workdir / "config.json").write_text(json.dumps(resolved_config(pre)))
  return str(workdir)


def test_no_presets_fine_tune_the_checkpoint_model(tmp_path):
  """``wordnet_supersense`` names no presets: the architecture is the checkpoint's (here
  bert_tiny with T5 buckets, not the default DIET-ABS), the rest the fine-tuning config's."""
  workdir = _pretrained_workdir(tmp_path, "bert_tiny,t5")
  config = get_config("finetune_wordnet", "wordnet_supersense")
  assert config.presets is None and config.model.scheme["name"] == "diet_abs"
  finetune_lib.adopt_checkpoint_model(config, workdir)
  saved = json.loads((tmp_path / "pre" / "config.json").read_text())["model"]
  ours = resolved_model(config.model)
  assert all(ours[f] == saved[f] for f in ARCHITECTURE)
  assert ours["scheme"]["name"] == "t5" and ours["dropout_rate"] == 0.1  # the config's own


def test_a_language_model_checkpoint_is_named_with_its_decoder_layers(tmp_path):
  """A causal LM's workdir (configs/lm.py) holds no encoder: one line saying so, with its real
  layer count (not "num_layers=0"), before anything is built; the same from its parameters
  when its config.json is gone."""
  workdir = tmp_path / "lm"
  _fake_workdir(workdir, get_config("lm", "bert_tiny,rope"))
  expected = (f"init_checkpoint: '{workdir}' holds a causal language model (decoder-only, 2 "
              "decoder layers), not a BERT encoder; fine-tune from a masked-LM train.py workdir")
  run = forked_cli.run([*FT[:2], f"--workdir={tmp_path}/ft", f"--init_checkpoint={workdir}"],
                       cwd=str(ROOT), timeout=300)
  lines = [line for line in run.stderr.splitlines() if line.startswith("finetune.py")]
  assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
  assert len(lines) == 1 and lines[0].startswith(f"finetune.py: {expected}"), run.stderr[-3000:]
  assert not (tmp_path / "ft").exists()
  (workdir / "config.json").unlink()
  with pytest.raises(TrainConfigError, match=f"^{re.escape(expected)}"):
    finetune_lib.pretrained_encoder(str(workdir))


@pytest.mark.parametrize("presets, message", [
    ("bert_tiny,alibi", "model.scheme: {'name': 't5'"),
    ("bert_small,t5", "model.vocab_size: 8192 in init_checkpoint, 30522 here (and 5 more)"),
])
def test_named_presets_that_are_not_the_checkpoint_model_are_one_line(tmp_path, presets,
                                                                      message):
  workdir = _pretrained_workdir(tmp_path, "bert_tiny,t5")
  config = get_config("finetune_wordnet", f"wordnet_supersense,{presets}")
  with pytest.raises(TrainConfigError) as error:
    finetune_lib.adopt_checkpoint_model(config, workdir)
  line = str(error.value)
  assert line.startswith(message) and "\n" not in line, line
  assert f"the presets '{presets}' are not the pre-trained model" in line
  assert "--config.reinitialise=True" in line
  config.reinitialise = True
  finetune_lib.adopt_checkpoint_model(config, workdir)  # what differs starts from scratch
  assert resolved_model(config.model)["scheme"]["name"] == presets.split(",")[1]


def test_matching_presets_and_hugging_face_folders(tmp_path):
  workdir = _pretrained_workdir(tmp_path, "bert_tiny,diet_abs_share")
  config = get_config("finetune_wordnet", "wordnet_supersense,bert_tiny,diet_abs_share")
  finetune_lib.adopt_checkpoint_model(config, workdir)  # the same model: nothing to say
  folder = hf_folder(tmp_path)
  config = get_config("finetune_wordnet", "wordnet_supersense")
  finetune_lib.adopt_checkpoint_model(config, str(folder))
  hf = json.loads((folder / "config.json").read_text())
  assert (config.model.vocab_size, config.model.d_model, config.model.num_layers) == (
      hf["vocab_size"], hf["hidden_size"], hf["num_hidden_layers"])
  assert config.model.scheme["name"] == "learned_ape"
  with pytest.raises(TrainConfigError, match="^model.vocab_size: 40 in init_checkpoint"):
    finetune_lib.adopt_checkpoint_model(
        get_config("finetune_wordnet", "wordnet_supersense,bert_tiny,t5"), str(folder))


def test_a_hugging_face_checkpoint_tokenises_with_its_own_vocabulary(tmp_path):
  """No config.vocab: the folder's vocab.txt; the tasks are registered over it and the
  config's task names follow; the same vocabulary always gets the same names."""
  folder = hf_folder(tmp_path)
  config = get_config("finetune_wordnet", "wordnet_supersense")
  finetune_lib.use_vocabulary(config, str(folder))
  assert config.task.startswith("wordnet_supersense_wp_") and config.vocab == str(folder)
  task = seqio.get_mixture_or_task(config.task)
  vocabulary = task.output_features["input_ids"].vocabulary
  assert vocabulary.vocab_size == 40 and list(vocabulary.tokens)[:2] == ["[PAD]", "[UNK]"]
  again = get_config("finetune_wordnet", "wordnet_supersense")
  again.vocab = str(folder / "vocab.txt")
  finetune_lib.use_vocabulary(again, str(folder))
  assert again.task == config.task


@pytest.mark.parametrize("case, message", [
    ("other_vocab", "vocab: '{tmp}/other.txt' is not the vocabulary of init_checkpoint"),
    ("hf_without_vocab", "vocab: unset, and init_checkpoint '{hf}' has no vocab.txt"),
    ("workdir_with_vocab", "vocab: '{tmp}/other.txt', but init_checkpoint '{tmp}/pre' was "
                           "trained with 'the bundled SentencePiece vocabulary'"),
    ("missing_vocab", "vocab: '{tmp}/nope.txt' is neither a vocab.txt nor a folder"),
])
def test_a_vocabulary_that_is_not_the_checkpoint_s_is_one_line(tmp_path, case, message):
  folder = hf_folder(tmp_path)
  (tmp_path / "other.txt").write_text("\n".join(
      ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "other"]) + "\n")
  config = get_config("finetune_wordnet", "wordnet_supersense")
  init = str(folder)
  if case == "other_vocab":
    config.vocab = str(tmp_path / "other.txt")
  elif case == "hf_without_vocab":
    (folder / "vocab.txt").unlink()
  elif case == "workdir_with_vocab":
    init = _pretrained_workdir(tmp_path, "bert_tiny,diet_abs_share")
    config.vocab = str(tmp_path / "other.txt")
  else:
    init = None
    config.vocab = str(tmp_path / "nope.txt")
  with pytest.raises(TrainConfigError) as error:
    finetune_lib.use_vocabulary(config, init)
  assert str(error.value).startswith(message.format(tmp=tmp_path, hf=folder)), str(error.value)
