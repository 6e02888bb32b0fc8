"""``python -m posenc_jax.evaluate`` and :mod:`posenc_jax.evaluation`: the windows cover every
token once, the scores equal a float64 numpy computation from the model's logits, lengths
past ``max_len`` run or are n/a as each scheme allows, the workdir's checkpoints are never
written, and every bad input is one line.

The workdirs are faked: a tiny model's fresh parameters saved through the trainer's
:class:`~posenc_jax.training.checkpoint.Checkpointer` beside its ``config.json``.
"""

import json
import os
import sys

import flax.linen as nn
import jax
import numpy as np
import pytest
from etils import epath

from posenc_jax import evaluate as evaluate_cli
from posenc_jax.configs import lm as lm_config
from posenc_jax.configs import pretrain as pretrain_config
from posenc_jax.data import unigram
from posenc_jax.data.vocab import CLS_ID
from posenc_jax.evaluation import (EvaluationError, Run, evaluate_workdir, load_run, model_at,
                                   window_arrays, windows)
from posenc_jax.evaluation import report as evaluation_report
from posenc_jax.evaluation import protocols
from posenc_jax.evaluation.runs import token_stream, window_batches
from posenc_jax.models.build import build_model, init_inputs
from posenc_jax.models.transformer import shift_right
from posenc_jax.schemes.absolute import SinusoidalAPE
from posenc_jax.training.checkpoint import Checkpointer
from posenc_jax.training.loop import BestKeeper
from posenc_jax.training.workdir import resolved_config
from tests import forked_cli
from tests.test_remote_workdir import bucket  # noqa: F401 - the fake gs:// fixture

TRAIN_LEN, TOKENS = 16, 300
TINY = dict(d_model=32, num_layers=1, num_heads=2, mlp_dim=64, max_len=TRAIN_LEN)
TRAIN_COUNTS = unigram.train_counts  # the real one: test_the_unigram_of_the_bundled_corpus


@pytest.fixture(autouse=True)
def uniform_train_counts(monkeypatch):
  """Every id seen once in the train split (the unigram's perplexity is then the vocabulary
  size): reading a real train split costs seconds to a minute; one test reads one."""
  monkeypatch.setattr(unigram, "train_counts",
                      lambda objective, task, size: np.ones(size, np.int64))


# ------------------------------------------------------------------------------- windows


@pytest.mark.parametrize("tokens,length,kind,stride", [
    (100, 16, "non_overlapping", None), (96, 16, "non_overlapping", None),
    (5, 16, "non_overlapping", None), (100, 16, "sliding", 4), (100, 16, "sliding", 16),
    (100, 16, "sliding", 5), (10, 16, "sliding", 4), (17, 16, "sliding", 1)])
def test_windows_score_every_token_once_with_closed_form_counts(tokens, length, kind, stride):
  cut = windows(tokens, length, kind, stride)
  stream = np.arange(1, tokens + 1)  # a token's id is its place + 1
  ids, valid, scored = window_arrays(stream, cut)
  assert ids.shape == valid.shape == scored.shape == (len(cut.starts), length)
  expected = (-(-tokens // length) if kind == "non_overlapping"
              else 1 + -(-max(0, tokens - length) // stride))
  assert len(cut.starts) == expected
  assert sorted(ids[scored]) == list(stream)  # every token scored exactly once
  assert np.all(ids[~valid] == 0) and not np.any(scored & ~valid)
  if kind == "sliding":  # past the first window a token sees at least L - S before it
    rows, cols = np.nonzero(scored)
    assert np.all((rows == 0) | (cols >= length - stride))
    assert np.all(scored[1:].sum(1) <= stride)


def test_windows_hold_the_same_tokens_at_every_length():
  stream = np.random.default_rng(0).integers(6, 100, 250)
  for kind, stride in (("non_overlapping", None), ("sliding", 8)):
    scored = []
    for length in (16, 32, 64, 128):
      ids, _, mask = window_arrays(stream, windows(len(stream), length, kind, stride))
      scored.append(ids[mask])
    assert all(np.array_equal(s, stream) for s in scored)  # in stream order, each once


@pytest.mark.parametrize("args,message", [
    ((0, 8), "tokens: got 0"), ((8, 0), "length: got 0"),
    ((8, 4, "overlapping"), "windows: got 'overlapping'"),
    ((8, 4, "non_overlapping", 2), "stride: got 2; allowed only with windows 'sliding'"),
    ((8, 4, "sliding"), "stride: got None"), ((8, 4, "sliding", 5), "stride: got 5")])
def test_windows_refuse_bad_arguments_in_one_line(args, message):
  with pytest.raises(ValueError, match=message):
    windows(*args)


# ------------------------------------------------------------------------------ workdirs


def _config(module, scheme: str, **model):
  config = module.get_config(f"bert_tiny,{scheme}")
  config.model.update(TINY | model)
  config.seq_len, config.batch_size, config.eval_steps = TRAIN_LEN, 4, 2
  return config


def _fake_workdir(path, config, step: int = 3, best: bool = False):
  """``path`` made a workdir of ``config``: fresh parameters saved at ``step``."""
  model = build_model(config.model, config.head)
  params = nn.unbox(jax.jit(model.init)(jax.random.key(1), *init_inputs(model)))["params"]
  path = epath.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  (path / "config.json").write_text(json.dumps(resolved_config(config)))
  checkpointer = Checkpointer(os.fspath(path), save_interval_steps=1, async_save=False)
  checkpointer.save(step, {"params": params}, {"step": step}, force=True)
  checkpointer.close()
  if best:
    keeper = BestKeeper(os.fspath(path), "eval_accuracy")
    keeper.update(step - 1, {"eval_accuracy": 0.5}, params)
    keeper.close()
  return model, params


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
  """A causal-LM RoPE workdir (``max_len`` = the training length), with a ``best/``."""
  path = tmp_path_factory.mktemp("lm_rope")
  model, params = _fake_workdir(path, _config(lm_config, "rope"), best=True)
  return str(path), model, params


@pytest.fixture(scope="module")
def mlm_run(tmp_path_factory):
  """A masked-LM workdir with BERT's learned table of ``2 * TRAIN_LEN`` rows."""
  path = tmp_path_factory.mktemp("mlm_bert")
  model, params = _fake_workdir(path, _config(pretrain_config, "bert",
                                              max_len=2 * TRAIN_LEN))
  return str(path), model, params


def _listing(folder) -> dict[str, tuple[int, int]]:
  return {os.path.relpath(os.path.join(d, f), folder): (os.stat(os.path.join(d, f)).st_size,
                                                         os.stat(os.path.join(d, f)).st_mtime_ns)
          for d, _, files in os.walk(folder) for f in files}


def _log_softmax_loss(logits: np.ndarray, targets: np.ndarray, weights: np.ndarray):
  """Summed float64 cross-entropy, weight and correct predictions."""
  logits = logits.astype(np.float64)
  top = logits.max(-1, keepdims=True)
  log_probs = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
  picked = np.take_along_axis(log_probs, targets[..., None], -1)[..., 0]
  correct = logits.argmax(-1) == targets
  return -(picked * weights).sum(), weights.sum(), (correct * weights).sum()


# ------------------------------------------------------------------------------ scoring


def test_lm_perplexity_equals_numpy_on_the_same_windows(lm_run, tmp_path):
  workdir, model, params = lm_run
  before = _listing(workdir)
  lengths = [TRAIN_LEN, 4 * TRAIN_LEN]
  doc = evaluate_workdir(workdir, "extrapolation", lengths=lengths, tokens=TOKENS,
                         out=str(tmp_path / "eval"))
  sliding = evaluate_workdir(workdir, "extrapolation", lengths=lengths, tokens=TOKENS,
                             windows="sliding", stride=8, batch_size=3)
  assert _listing(workdir) == before  # nothing written in the workdir (out is elsewhere)
  stream = token_stream(load_run(workdir).config, "validation", TOKENS)["targets"]
  assert len(stream) == TOKENS and doc["tokens"] == TOKENS
  for result, kind, stride in ((doc, "non_overlapping", None), (sliding, "sliding", 8)):
    assert (result["windows"], result["stride"], result["train_length"]) == (kind, stride,
                                                                            TRAIN_LEN)
    for row, length in zip(result["rows"], lengths):
      ids, _, scored = window_arrays(stream, windows(TOKENS, length, kind, stride))
      logits = np.asarray(jax.jit(model.apply)({"params": params}, shift_right(ids)))
      loss, weight, correct = _log_softmax_loss(logits, ids, scored.astype(np.float64))
      assert row["scored_tokens"] == weight == TOKENS and row["na"] is None
      np.testing.assert_allclose(row["loss"], loss / weight, rtol=2e-6)
      np.testing.assert_allclose(row["value"], np.exp(loss / weight), rtol=2e-5)
      assert row["accuracy"] == correct / weight
  assert sliding["rows"][0]["loss"] != doc["rows"][0]["loss"]  # more context, another score
  assert doc["unigram"] == pytest.approx(load_run(workdir).config.model.vocab_size)
  saved = json.loads((tmp_path / "eval" / "extrapolation-split=validation,windows=non_overlapping,"
                      f"tokens={TOKENS}.json").read_text())
  assert saved == json.loads(json.dumps(doc))


def test_mlm_loss_equals_numpy_at_the_training_length_and_past_it(mlm_run):
  workdir, model, params = mlm_run
  lengths = [TRAIN_LEN, 2 * TRAIN_LEN]
  doc = evaluate_workdir(workdir, "extrapolation", lengths=lengths, tokens=TOKENS)
  assert (doc["objective"], doc["metric"], doc["mask_seed"]) == ("mlm", "mlm_loss", 0)
  assert doc["settings"] == {"split": "validation", "windows": "non_overlapping",
                             "tokens": TOKENS, "mask_seed": 0}
  assert doc["unigram"] is None and doc["scheme"] == "bert"
  config = load_run(workdir).config
  stream = token_stream(config, "validation", TOKENS)
  masked = stream["mlm_weights"]
  assert abs(masked.mean() - config.mask_rate) < 0.05 and len(masked) == TOKENS
  for row, length in zip(doc["rows"], lengths):
    batch, scored = window_batches(stream, "mlm", length, "non_overlapping", None)
    assert batch["input_ids"].shape[1] == length and np.all(batch["input_ids"][:, 0] == CLS_ID)
    logits = np.asarray(jax.jit(model.apply)({"params": params}, batch["input_ids"],
                                             batch["segment_ids"], batch["mask"]))
    loss, weight, _ = _log_softmax_loss(logits, batch["mlm_targets"], batch["mlm_weights"])
    assert weight == masked.sum() and row["scored_tokens"] == scored == TOKENS
    np.testing.assert_allclose(row["value"], loss / weight, rtol=2e-6)


def test_loss_protocol_is_the_trainers_evaluation_and_extrapolation_agrees(lm_run, tmp_path):
  workdir, _, _ = lm_run
  loss = evaluate_workdir(workdir, "loss", out=str(tmp_path))
  assert set(loss["metrics"]) == {"eval_loss", "eval_accuracy", "eval_perplexity",
                                  "eval_unigram_perplexity"}
  # Every id counted once (the fixture): the unigram's perplexity is the vocabulary size.
  vocab_size = load_run(workdir).model.config.vocab_size
  assert loss["metrics"]["eval_unigram_perplexity"] == pytest.approx(vocab_size, rel=1e-9)
  assert (loss["split"], loss["step"], loss["checkpoint"]) == ("validation", 3, "latest")
  # The trainer's evaluation batches are the stream's first eval_steps * batch_size windows.
  same = evaluate_workdir(workdir, "extrapolation", lengths=[TRAIN_LEN],
                          tokens=2 * 4 * TRAIN_LEN)
  np.testing.assert_allclose(same["rows"][0]["loss"], loss["metrics"]["eval_loss"], rtol=1e-6)
  saved = tmp_path / "loss-split=validation,eval_steps=2.json"  # the run's eval_steps
  assert json.loads(saved.read_text())["metrics"] == loss["metrics"]


# --------------------------------------------------------------------------- extrapolation


def _run(module, scheme: str) -> Run:
  config = _config(module, scheme)
  model = build_model(config.model, config.head)
  params = nn.unbox(jax.jit(model.init)(jax.random.key(0), *init_inputs(model)))["params"]
  return Run("fresh", config, model, params, 0, "latest")


@pytest.mark.parametrize("module,scheme", [(lm_config, "rope"), (lm_config, "alibi"),
                                           (lm_config, "t5"), (pretrain_config, "diet_rel")])
def test_relative_schemes_evaluate_at_four_times_the_training_length(module, scheme):
  run = _run(module, scheme)
  model, reason = model_at(run, 4 * TRAIN_LEN)
  assert model is run.model and reason is None  # max_len bounds no table of theirs
  stream = {"targets": np.arange(6, 6 + 3 * TRAIN_LEN, dtype=np.int32)}
  if run.config.objective == "mlm":
    stream = {"input_ids": stream["targets"], "mlm_targets": stream["targets"],
              "mlm_weights": np.ones(3 * TRAIN_LEN, np.float32)}
  from posenc_jax.evaluation.runs import score  # noqa: PLC0415
  batch, _ = window_batches(stream, run.config.objective, 4 * TRAIN_LEN, "non_overlapping",
                            None)
  sums = score(model, run.params, run.config.objective, batch, 2)
  assert np.isfinite(sums["loss"]) and sums["weight"] == 3 * TRAIN_LEN


@pytest.mark.parametrize("module,scheme,table", [
    (lm_config, "bert", "position_embedding"), (pretrain_config, "tupe_a", "position_embedding"),
    (pretrain_config, "diet_abs", "p_query")])
def test_a_learned_table_past_max_len_is_na_with_the_reason(module, scheme, table):
  model, reason = model_at(_run(module, scheme), 4 * TRAIN_LEN)
  assert model is None
  assert f"exceeds max_len={TRAIN_LEN}" in reason and table in reason
  assert f"trained {TRAIN_LEN} vs {4 * TRAIN_LEN}" in reason


def test_a_fixed_table_sized_by_max_len_is_rebuilt_longer(monkeypatch):
  # A sinusoidal table that refuses lengths past max_len (as a scheme that precomputes it
  # would): same parameters at any max_len, so the model is rebuilt at the longer length.
  monkeypatch.setattr(SinusoidalAPE, "absolute_table", True)
  run = _run(lm_config, "sinusoidal")
  model, reason = model_at(run, 4 * TRAIN_LEN)
  assert reason is None and model.config.max_len == 4 * TRAIN_LEN
  ids = np.arange(6, 6 + 4 * TRAIN_LEN, dtype=np.int32)[None]
  assert np.all(np.isfinite(model.apply({"params": run.params}, ids)))


def test_mlm_extrapolation_reports_na_past_the_table_and_never_crashes(mlm_run, tmp_path):
  workdir, _, _ = mlm_run
  doc = evaluate_workdir(workdir, "extrapolation", lengths=[TRAIN_LEN, 8 * TRAIN_LEN],
                         tokens=64, out=str(tmp_path))
  last = doc["rows"][-1]
  assert last["value"] is None and last["loss"] is None and last["scored_tokens"] == 0
  assert "exceeds max_len=32" in last["na"]
  from posenc_jax.evaluation.report import table  # noqa: PLC0415
  assert f"{8 * TRAIN_LEN}         n/a  scheme 'learned_ape'" in table(doc)


@pytest.mark.parametrize("run_name, need", [("lm_run", 32), ("mlm_run", 31)])
def test_a_length_longer_than_the_tokens_read_is_na_not_a_shorter_window(request, run_name,
                                                                        need):
  """16 tokens at lengths 8 and 32: 8 is scored, 32 would be one 16-token window (the causal
  LM's windows hold L tokens, the masked LM's [CLS] and L - 1), so it is n/a with the reason
  and the tokens that would score it."""
  workdir = request.getfixturevalue(run_name)[0]
  doc = evaluate_workdir(workdir, "extrapolation", lengths=[8, 32], tokens=16)
  scored, longer = doc["rows"]
  assert scored["na"] is None and scored["value"] is not None
  assert longer["value"] is None and longer["scored_tokens"] == 0
  assert longer["na"] == (f"the first 16 tokens of split 'validation' hold no whole window "
                          f"of 32; --tokens of at least {need} scores it")


def test_a_re_evaluation_at_other_lengths_keeps_every_scored_length(lm_run, tmp_path):
  """--lengths=8,16 then --lengths=32 with the same settings: one file holding 8, 16 and 32
  (the later run's rows where both scored a length); another step's file is replaced."""
  workdir = lm_run[0]
  first = evaluate_workdir(workdir, "extrapolation", lengths=[8, 16], tokens=64,
                           out=str(tmp_path))
  second = evaluate_workdir(workdir, "extrapolation", lengths=[16, 32], tokens=64,
                            out=str(tmp_path))
  (path,) = tmp_path.glob("extrapolation-*.json")
  saved = json.loads(path.read_text())
  assert [r["length"] for r in saved["rows"]] == [8, 16, 32] == [
      r["length"] for r in second["rows"]]
  assert saved["rows"][0] == first["rows"][0]
  saved["step"] += 1  # a file of another checkpoint: its lengths are of another model
  path.write_text(json.dumps(saved))
  evaluate_workdir(workdir, "extrapolation", lengths=[32], tokens=64, out=str(tmp_path))
  assert [r["length"] for r in json.loads(path.read_text())["rows"]] == [32]


# ---------------------------------------------------------------- checkpoints and storage


def test_best_and_a_step_restore_and_nothing_is_written_under_checkpoints(lm_run):
  workdir, _, params = lm_run
  before = {name: _listing(os.path.join(workdir, name)) for name in ("checkpoints", "best")}
  best = evaluate_workdir(workdir, "extrapolation", checkpoint="best", lengths=[TRAIN_LEN],
                          tokens=64, out=os.path.join(workdir, "eval"))
  step = evaluate_workdir(workdir, "extrapolation", checkpoint=3, lengths=[TRAIN_LEN],
                          tokens=64)
  assert (best["checkpoint"], best["step"], step["checkpoint"], step["step"]) == ("best", 2,
                                                                                 3, 3)
  assert best["rows"] == step["rows"]  # the same parameters were saved in both
  after = {name: _listing(os.path.join(workdir, name)) for name in ("checkpoints", "best")}
  assert after == before
  assert sorted(os.listdir(os.path.join(workdir, "eval")))[0] == (
      "extrapolation-split=validation,windows=non_overlapping,tokens=64.json")


def test_a_gs_workdir_is_read_and_written_through_epath(bucket, tmp_path):  # noqa: F811
  root, _ = bucket
  _fake_workdir(root / "run", _config(lm_config, "alibi"))
  doc = evaluate_workdir("gs://bucket/run", "extrapolation", lengths=[TRAIN_LEN, 32],
                         tokens=64, out="gs://bucket/run/eval")
  assert doc["workdir"] == "gs://bucket/run"
  saved = json.loads((root / "run" / "eval" / f"{evaluation_report.file_stem(doc)}.json")
                     .read_text())
  assert [r["length"] for r in saved["rows"]] == [TRAIN_LEN, 32]


# ------------------------------------------------------------------------------- the CLI


def _cli(argv, capsys) -> tuple[int, str]:
  """``evaluate.main(argv)``'s exit status and error line: a flag's line is the exit's own
  message (``sys.exit(line)``, status 1, as the absl tools exit), the others are printed."""
  with pytest.raises(SystemExit) as exit_info:
    evaluate_cli.main(argv)
  code = exit_info.value.code
  return (1, code) if isinstance(code, str) else (code, capsys.readouterr().err.strip())


def test_cli_runs_and_prints_the_protocol(lm_run, tmp_path, capsys):
  workdir, _, _ = lm_run
  doc = evaluate_cli.main([f"--workdir={workdir}", "--protocol=extrapolation",
                           f"--lengths={TRAIN_LEN},{2 * TRAIN_LEN}", "--windows=sliding",
                           "--stride=8", "--tokens=64", f"--out={tmp_path}"])
  out = capsys.readouterr().out
  assert "windows sliding, stride 8, the first 64 tokens at every length" in out
  assert f"extrapolation: length {2 * TRAIN_LEN} (2/2)" in out
  path = tmp_path / "extrapolation-split=validation,windows=sliding,stride=8,tokens=64.json"
  assert f"wrote {path}\n" in out and f"wrote {path.with_suffix('.png')}\n" in out
  assert ("unigram perplexity of these tokens (add-one smoothed, counted on 8192 tokens of "
          "split 'train'): 8192.0000") in out
  assert json.loads(path.read_text())["rows"] == doc["rows"]


def test_evaluations_with_other_settings_sit_beside_each_other(lm_run, tmp_path, capsys):
  """The defaults (16384 tokens) no longer replace the file of an experiment's 64 tokens."""
  workdir, _, _ = lm_run
  asked = evaluate_cli.main([f"--workdir={workdir}", "--protocol=extrapolation",
                             f"--lengths={TRAIN_LEN}", "--tokens=64", f"--out={tmp_path}"])
  kept = (tmp_path / f"{evaluation_report.file_stem(asked)}.json").read_text()
  default = evaluate_cli.main([f"--workdir={workdir}", "--protocol=extrapolation",
                               f"--lengths={TRAIN_LEN}", f"--out={tmp_path}"])
  assert default["settings"] == {"split": "validation", "windows": "non_overlapping",
                                 "tokens": 16384}
  assert (tmp_path / f"{evaluation_report.file_stem(asked)}.json").read_text() == kept
  assert sorted(p.name for p in tmp_path.glob("*.json")) == [
      "extrapolation-split=validation,windows=non_overlapping,tokens=16384.json",
      "extrapolation-split=validation,windows=non_overlapping,tokens=64.json"]
  assert "wrote " in capsys.readouterr().out


def test_settings_name_the_options_that_change_the_numbers_with_their_defaults():
  lm, mlm = {"objective": "lm", "eval_steps": 5}, {"objective": "mlm", "eval_steps": 5}
  assert protocols.protocol_settings("extrapolation", lm, tokens=4096, lengths=[8, 16],
                                batch_size=3) == {"split": "validation",
                                                  "windows": "non_overlapping", "tokens": 4096}
  assert protocols.protocol_settings("extrapolation", mlm, windows="sliding", stride=4) == {
      "split": "validation", "windows": "sliding", "stride": 4, "tokens": 16384, "mask_seed": 0}
  assert protocols.protocol_settings("probes", lm) == {"examples": 256, "seed": 1_000_003}
  assert protocols.protocol_settings("loss", lm, split="train") == {"split": "train",
                                                               "eval_steps": 5}
  assert evaluation_report.settings_key({"split": "train[:10%]", "tokens": 64}) == (
      "split=train__10__,tokens=64")


def test_the_unigram_is_add_one_smoothed_over_the_vocabulary():
  # p = (3 + 1, 1 + 1, 0 + 1, 0 + 1) / (4 + 4): tokens 0, 1, 2 have 1/2, 1/4, 1/8: ppl 4.
  assert unigram.unigram_perplexity(np.array([3, 1, 0, 0]), np.array([0, 1, 2])) == (
      pytest.approx(4.0))


def test_the_unigram_of_the_bundled_corpus_counts_its_train_split(tmp_path, monkeypatch):
  """The real train split (3 s: the stdlib corpus), and the corpus hash in the document."""
  from posenc_jax.data import stdlib_corpus  # noqa: PLC0415
  monkeypatch.setattr(unigram, "train_counts", TRAIN_COUNTS)
  config = _config(lm_config, "alibi")
  config.task, config.model.vocab_size = stdlib_corpus.TASK, stdlib_corpus.VOCAB_SIZE
  _fake_workdir(tmp_path, config)
  doc = evaluate_workdir(str(tmp_path), "extrapolation", lengths=[TRAIN_LEN], tokens=TOKENS)
  counts = unigram.train_counts("lm", stdlib_corpus.TASK, stdlib_corpus.VOCAB_SIZE)
  train_bytes = sum(len(d.text.encode()) + 1 for d in stdlib_corpus.documents("train"))
  assert counts.sum() == train_bytes == doc["unigram_train_tokens"]  # bytes and EOS, once
  stream = token_stream(load_run(str(tmp_path)).config, "validation", TOKENS)["targets"]
  assert doc["unigram"] == pytest.approx(unigram.unigram_perplexity(counts, stream))
  assert 2 < doc["unigram"] < 0.5 * stdlib_corpus.VOCAB_SIZE  # far better than uniform
  assert doc["corpus_sha256"] == stdlib_corpus.CONTENT_SHA256 and doc["task"] == config.task
  monkeypatch.setattr(unigram, "UNIGRAM_TOKENS", 1000)  # a web-scale split: its first tokens
  first = TRAIN_COUNTS.__wrapped__("lm", stdlib_corpus.TASK, stdlib_corpus.VOCAB_SIZE)
  assert first.sum() == 1000 and np.all(first <= counts)


def test_without_matplotlib_the_written_file_is_still_told(tmp_path, monkeypatch):
  doc = {"scheme": "rope", "protocol": "probes", "settings": {"examples": 2, "seed": 7},
         "probe": {"name": "copy"}, "examples": 2, "step": 1, "train_length": 16, "rows": []}
  monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
  told = []
  written = evaluation_report.write(doc, str(tmp_path), told.append)
  assert written == [str(tmp_path / "probes-examples=2,seed=7.json")]
  assert told == [evaluation_report.PLOT_HINT, f"wrote {written[0]}"]


def test_cli_errors_are_one_line_naming_the_field(lm_run, mlm_run, tmp_path, capsys):
  lm, mlm = lm_run[0], mlm_run[0]
  (tmp_path / "empty").mkdir()
  no_checkpoints = tmp_path / "no_checkpoints"
  no_checkpoints.mkdir()
  (no_checkpoints / "config.json").write_text((epath.Path(lm) / "config.json").read_text())
  (tmp_path / "file").write_text("")
  cases = [
      ([f"--workdir={lm}", "--protocol=probe"], 1, "evaluate: --protocol: got 'probe'"),
      ([f"--workdir={lm}", "--lengths=64,32"], 1, "evaluate: --lengths: got 64,32; allowed: "
       "increasing"),
      ([f"--workdir={lm}", "--lengths=32,32"], 1, "evaluate: --lengths: got 32,32"),
      ([f"--workdir={lm}", "--lengths=0,32"], 1, "evaluate: --lengths: got 0"),
      ([f"--workdir={lm}", "--checkpoint=last"], 1, "evaluate: --checkpoint: got 'last'"),
      ([f"--workdir={lm}", "--seed=-1"], 1, "evaluate: --seed: got '-1'; allowed: a "
       "non-negative"),
      ([f"--workdir={lm}", "--windows=slide"], 1, "evaluate: --windows: got 'slide'; did you "
       "mean 'sliding'?"),
      ([f"--workdir={lm}", "--workdi=x"], 1, "evaluate: Unknown command line flag 'workdi'. "
       "Did you mean: workdir"),
      ([f"--workdir={lm}", "extra"], 1, "evaluate: unexpected argument 'extra'"),
      ([], 1, "evaluate: --workdir is required"),
      ([f"--workdir={lm}", "--lengths=32"], 1, "evaluate: lengths: not an option of protocol "
       "'loss'"),
      ([f"--workdir={tmp_path / 'empty'}"], 1, "evaluate: workdir: "),
      ([f"--workdir={no_checkpoints}"], 1, "evaluate: workdir: "),
      ([f"--workdir={mlm}", "--checkpoint=best"], 1, "evaluate: checkpoint: 'best' needs"),
      ([f"--workdir={lm}", "--checkpoint=9"], 1, "evaluate: step: 9 is not saved"),
      ([f"--workdir={mlm}", "--protocol=extrapolation", "--windows=sliding", "--stride=4"], 1,
       "evaluate: windows: 'sliding' "),
      ([f"--workdir={lm}", "--protocol=extrapolation", "--mask_seed=1"], 1,
       "evaluate: mask_seed: only for a masked-LM run"),
      ([f"--workdir={lm}", "--protocol=extrapolation", "--windows=sliding"], 1,
       "evaluate: stride: required"),
      ([f"--workdir={lm}", f"--out={tmp_path / 'file' / 'x'}"], 1, "evaluate: out: "),
      ([f"--workdir={lm}", f"--out={lm}/checkpoints/eval"], 1, "evaluate: out: "),
  ]
  for argv, code, start in cases:
    status, err = _cli(argv, capsys)
    assert (status, err.startswith(start), len(err.splitlines())) == (code, True, 1), (argv,
                                                                                      err)
  assert "no config.json" in _cli([f"--workdir={tmp_path / 'empty'}"], capsys)[1]
  assert not (tmp_path / "empty" / "eval").exists()  # nothing made for a refused workdir


def test_a_length_that_cannot_fit_is_one_line_before_anything_is_compiled(lm_run, tmp_path):
  """The issue's command: a length whose forward pass needs far more memory than there is is
  refused at once by its estimate (:func:`posenc_jax.memory.step_memory`), nothing written."""
  out = forked_cli.run(["-m", "posenc_jax.evaluate", f"--workdir={lm_run[0]}",
                        "--protocol=extrapolation", f"--lengths={TRAIN_LEN},1000000000",
                        f"--out={tmp_path}/eval"], cwd=str(tmp_path), timeout=120)
  assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
  line = out.stderr.strip().splitlines()[-1]
  assert line.startswith("evaluate: lengths: got 1000000000; the step needs about "), line
  assert "allowed: a smaller length (at most about " in line
  assert "extrapolation: length" not in out.stdout  # no length ran
  assert not (tmp_path / "eval").exists()  # the folder it made for the results is gone again


@pytest.mark.parametrize("protocol, batch_size, free, field", [
    ("extrapolation", None, 8, "lengths"), ("extrapolation", 64, 64, "batch_size"),
    ("probes", None, 8, "lengths")])
def test_each_length_is_checked_against_the_free_memory_first(tmp_path, monkeypatch, protocol,
                                                              batch_size, free, field):
  """With 8 MiB free, a tiny model's forward pass fits at the training length, not at 1024
  (its [B, H, L, L] attention arrays alone are 8 MiB a row); with 64 MiB, 64 rows of 64
  positions do not (their vocabulary logits alone are 128 MiB), one row does. ``batch_size``
  is named where one row would fit, else the length, each with what fits."""
  from posenc_jax import memory  # noqa: PLC0415

  workdir = tmp_path / "run"
  config = _probe_config("rope") if protocol == "probes" else _config(lm_config, "rope")
  _fake_workdir(workdir, config)
  monkeypatch.setattr(memory, "available", lambda device=None: (free * 2**20, "test memory"))
  length = 1024 if field == "lengths" else 4 * TRAIN_LEN
  with pytest.raises(EvaluationError) as error:
    evaluate_workdir(str(workdir), protocol, lengths=[TRAIN_LEN, length],
                     **({"batch_size": batch_size} if batch_size else {}))
  line = str(error.value)
  assert "\n" not in line and f"more than the {memory.gib(free * 2**20)} of test memory" in line
  if field == "lengths":
    assert line.startswith(f"lengths: got {length}; the step needs about "), line
    assert "allowed: a smaller length (at most about " in line
  else:
    assert line.startswith(f"batch_size: got {batch_size}; the step needs about "), line
    assert "allowed: a smaller batch_size (at most about " in line
    assert f"fit at length {length})" in line


def test_an_unknown_protocol_or_option_is_refused_by_the_api(lm_run):
  with pytest.raises(EvaluationError, match="protocol: got 'probe'.*allowed: loss, "):
    evaluate_workdir(lm_run[0], "probe")
  with pytest.raises(EvaluationError, match="stride: not an option of protocol 'loss'"):
    evaluate_workdir(lm_run[0], "loss", stride=4)


# -------------------------------------------------------------------------------- probes


def _probe_config(scheme: str):
  from posenc_jax.configs import probe as probe_config  # noqa: PLC0415
  config = probe_config.get_config(f"bert_tiny,{scheme},copy")
  config.model.update(TINY)
  config.seq_len, config.batch_size, config.eval_steps = TRAIN_LEN, 4, 2
  config.probe.alphabet = 8
  return config


def test_probes_score_the_held_out_examples_at_each_length(tmp_path):
  from posenc_jax.data import probes  # noqa: PLC0415
  workdir = tmp_path / "probe_alibi"
  config = _probe_config("alibi")
  model, params = _fake_workdir(workdir, config)
  lengths = [TRAIN_LEN, 4 * TRAIN_LEN]
  doc = evaluate_workdir(str(workdir), "probes", lengths=lengths, examples=6, batch_size=4,
                         out=str(workdir / "eval"))
  assert doc["probe"] == probes.describe(probes.config_probe(config))
  assert (doc["seed"], doc["examples"], doc["train_length"]) == (probes.HELD_OUT_SEED, 6,
                                                                 TRAIN_LEN)
  for row, length in zip(doc["rows"], lengths):  # the same numbers as scoring directly
    direct = probes.score(model_at(load_run(str(workdir)), length)[0], params,
                          probes.config_probe(config), length, examples=6,
                          seed=probes.HELD_OUT_SEED, batch_size=4)
    assert row["na"] is None and row["length"] == length
    assert (row["accuracy"], row["token_accuracy"]) == (direct["accuracy"],
                                                        direct["token_accuracy"])
    assert row["chance"] == 8.0 ** -((length - 1) // 2)  # (L - 1) // 2 symbols of 8
  saved = workdir / "eval" / "probes-examples=6,seed=1000003.json"
  assert json.loads(saved.read_text())["rows"] == doc["rows"]
  figure = evaluation_report.plot_probes(doc)
  assert figure.axes[0].get_title().startswith("alibi (step 3): probe copy")
  assert "chance" in [t.get_text() for t in figure.legends[0].get_texts()]


@pytest.mark.parametrize("name, length, expected", [
    ("copy", 9, 32.0 ** -4), ("reverse", 10, 32.0 ** -4), ("mqar", 64, 32.0 ** -8),
    ("passkey", 64, 10.0 ** -5)])
def test_chance_is_guessing_every_answer_token_among_its_symbols(name, length, expected):
  from posenc_jax.data import probes  # noqa: PLC0415
  assert probes.probe(name).chance(length) == expected


def test_probes_past_a_learned_table_are_na_and_other_runs_are_refused(tmp_path, lm_run):
  workdir = tmp_path / "probe_bert"
  _fake_workdir(workdir, _probe_config("bert"))
  doc = evaluate_workdir(str(workdir), "probes", lengths=[TRAIN_LEN, 2 * TRAIN_LEN],
                         examples=2)
  assert doc["rows"][0]["na"] is None and doc["rows"][1]["accuracy"] is None
  assert "max_len" in doc["rows"][1]["na"]
  with pytest.raises(EvaluationError, match="protocol: 'probes' scores synthetic probe"):
    evaluate_workdir(lm_run[0], "probes")


def test_indicators_are_the_analysis_tools_on_the_restored_model_beside_the_papers_row(
    mlm_run, tmp_path, capsys):
  from posenc_jax import analysis  # noqa: PLC0415

  workdir, _, _ = mlm_run
  out = tmp_path / "eval"
  doc = evaluate_cli.main(["--workdir", workdir, "--protocol=indicators", "--examples=6",
                         "--seed=2", f"--out={out}"])
  model = analysis.from_checkpoint(workdir)
  probe = analysis.identical_word_probing(model.encoder, model.variables, model.tokens,
                                          length=TRAIN_LEN, num_words=6, seed=2)
  assert doc["indicators"] == analysis.indicators(probe.attention, probe.special_positions)
  assert (doc["length"], doc["examples"], doc["special_positions"]) == (
      TRAIN_LEN, 6, [0, TRAIN_LEN - 1])
  assert doc["settings"] == {"examples": 6, "seed": 2}
  assert doc["paper_row"] == "BERT-style APE" and doc["paper"]["monotonicity_all"] == 0.2461
  assert json.loads((out / "indicators-examples=6,seed=2.json").read_text()) == doc
  printed = capsys.readouterr().out
  assert "ours: bert" in printed and "paper: BERT-style APE" in printed


def test_indicators_of_a_causal_lm_are_one_line_saying_why(lm_run):
  with pytest.raises(EvaluationError, match=(
      r"^protocol: 'indicators' scores masked-LM pre-training, classification fine-tuning, "
      r"regression fine-tuning, span fine-tuning runs; .* is a causal-LM pre-training run "
      r"\(task 'wordnet_glosses_lm'\), which 'loss', 'extrapolation' scores$")):
    evaluate_workdir(lm_run[0], "indicators", examples=2)


def test_help_lists_every_protocol(capsys):
  with pytest.raises(SystemExit) as exit_info:
    evaluate_cli.parse_args(["--help"])
  text = capsys.readouterr().out
  assert exit_info.value.code == 0 and "\nProtocols (--protocol):\n" in text
  for name in ("loss", "extrapolation", "probes", "indicators"):
    assert f"\n  {name:<14}" in text


def test_parse_args_keeps_no_state_between_command_lines():
  first = evaluate_cli.parse_args(["--workdir=a", "--protocol=extrapolation", "--lengths=8,16",
                                   "--checkpoint=7"])
  assert (first.workdir, first.protocol, first.lengths, first.checkpoint) == (
      "a", "extrapolation", (8, 16), 7)
  second = evaluate_cli.parse_args(["--workdir", "b"])  # absl's two-word form too
  assert (second.workdir, second.protocol, second.lengths, second.checkpoint) == (
      "b", "loss", None, "latest")


def test_the_command_lines_compare_plans_parse_to_their_options():
  """compare runs the evaluate tool as ``--flag=value`` command lines
  (:func:`posenc_jax.comparison.plan.cells`): each parses to the evaluation it stands for."""
  from posenc_jax.comparison import plan  # noqa: PLC0415
  from posenc_jax.configs.compare import EXPERIMENTS, get_config  # noqa: PLC0415

  steps = []
  for experiment in EXPERIMENTS:
    config = get_config(experiment)
    config.evaluate.update(dict(windows="non_overlapping,sliding", stride=64, tokens=4096))
    steps += [s for c in plan.cells(config, "/tmp/root") for s in c.steps if s.evaluation]
  assert {s.evaluation[0] for s in steps} == {"extrapolation", "probes", "indicators"}
  for step in steps:
    args = evaluate_cli.parse_args(list(step.argv[1:]))
    protocol, options = step.evaluation
    assert (args.workdir, args.protocol) == (step.workdir, protocol)
    assert {k: getattr(args, k) for k in options} == options, step.argv


def _flags_section(text: str) -> dict[str, str]:
  """``--help``'s "Flags:" section as ``{name: line}``; every line of it is ``  --name: ...``."""
  section = text.partition("\nFlags:\n")[2].partition("\n\n")[0].splitlines()
  assert section and all(line.startswith("  --") and ": " in line for line in section), section
  return {line.split(":")[0].strip().removeprefix("--"): line for line in section}


def test_compare_and_evaluate_share_the_help_layout_and_the_bad_flag_line(tmp_path):
  """One flag family: ``--help`` is the module's usage first, then "Flags:" with one line per
  flag and its help; a malformed or unknown flag is one line naming it, status 1 for both."""
  from posenc_jax import compare as compare_cli  # noqa: PLC0415

  def run(*argv):
    return forked_cli.run(["-m", *argv], cwd=str(tmp_path), timeout=120)

  helps = {"compare": run("posenc_jax.compare", "--help"),
           "evaluate": run("posenc_jax.evaluate", "--help")}
  for module, proc in zip((compare_cli, evaluate_cli), helps.values()):
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-2000:]
    assert proc.stdout.startswith(f"{module.__doc__.rstrip()}\n\n"), proc.stdout[:300]
  assert {"config", "workdir", "collect", "dry_run"} <= set(_flags_section(
      helps["compare"].stdout))
  listed = _flags_section(helps["evaluate"].stdout)
  assert list(listed) == [name for name, *_ in evaluate_cli.FLAG_SPECS]
  for name, _, default, help_text in evaluate_cli.FLAG_SPECS:
    assert listed[name].startswith(f"  --{name}: {help_text}"), listed[name]
    assert listed[name].endswith(f"(default: {default})") == (default is not None)
  assert helps["evaluate"].stdout.index("\nProtocols (--protocol):\n") < helps[
      "evaluate"].stdout.index("\nFlags:\n")
  for argv, line in [
      (["posenc_jax.compare", "--dry_run=maybe"], "compare: --dry_run=maybe: "),
      (["posenc_jax.compare", "--workdi=x"], "compare: Unknown command line flag 'workdi'. "
       "Did you mean: workdir"),
      (["posenc_jax.evaluate", "--workdir=x", "--lengths=3,2"], "evaluate: --lengths: got 3,2; "
       "allowed: increasing lengths, no repeats"),
      (["posenc_jax.evaluate", "--workdir=x", "--protocol=nope"], "evaluate: --protocol: got "
       "'nope'; allowed: loss, extrapolation, probes"),
      (["posenc_jax.evaluate", "--workdi=x"], "evaluate: Unknown command line flag 'workdi'. "
       "Did you mean: workdir"),
  ]:
    proc = run(*argv)
    assert (proc.returncode, proc.stdout) == (1, ""), (argv, proc.stderr[-2000:])
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(line), (argv, proc.stderr)
  assert not list(tmp_path.iterdir())  # nothing written
