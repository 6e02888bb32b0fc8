"""The step benchmark's models (posenc_jax/benchmarks/model_steps.py): a causal-only scheme
(CoPE, the forgetting gates) is timed on the causal LM, against the baseline on the same model,
in ``python -m posenc_jax.benchmarks.steps`` and in compare's cost column."""

import json
import time

import jax
import numpy as np
import pytest

from posenc_jax import memory, presets
from posenc_jax.benchmarks import model_steps, steps
from posenc_jax.comparison import cost, plan
from posenc_jax.configs.compare import get_config
from posenc_jax.schemes import SCHEMES
from posenc_jax.training.config import max_predictions

# bert_tiny shrunk for the tests: what every benchmark --size tiny model is built from.
TINY = dict(vocab_size=64, d_model=32, num_layers=1, num_heads=2, mlp_dim=64, max_len=16)
DIMS = dict(batch=2, length=8, dtype="float32")


@pytest.fixture
def tiny(monkeypatch):
  monkeypatch.setitem(presets.SIZES, "bert_tiny", TINY)


def test_the_model_is_the_lm_exactly_when_a_scheme_is_causal_only(monkeypatch):
  assert [model_steps.model_of(s) for s in ("bert", "none", "rope", "alibi", "cope", "fox")] == [
      "mlm", "mlm", "mlm", "mlm", "lm", "lm"]
  assert model_steps.model_of("rope", "cope") == model_steps.model_of("cope", "bert") == "lm"
  monkeypatch.setattr(SCHEMES["rope"].module, "causal_only", True)  # the class's fact decides
  assert model_steps.model_of("rope") == "lm"


def test_a_causal_only_scheme_builds_the_lm_and_its_train_step_runs(tiny):
  cfg, train, infer, init = model_steps.model_steps("tiny", "cope", **DIMS)
  assert cfg.scheme["name"] == "cope" and cfg.segment is None and cfg.d_model == 32
  params, opt_state = jax.jit(init)()
  assert "decoder" in params and "bert" not in params  # CausalLM's tree, not BERT's
  new, _ = jax.jit(train)(params, opt_state)
  leaves = jax.tree.leaves(new)
  assert all(np.isfinite(x).all() for x in leaves)  # a finite loss gives finite gradients
  assert any(not np.array_equal(a, b) for a, b in zip(leaves, jax.tree.leaves(params)))
  assert infer(new).shape == (2, 8, 64)


def test_the_baseline_builds_on_the_lm_too(tiny):
  """``bert`` (learned APE) has a causal form: the LM rows' baseline is that LM."""
  cfg, _, infer, init = model_steps.model_steps("tiny", "bert", head="lm", **DIMS)
  params, _ = jax.eval_shape(init)
  assert cfg.scheme["name"] == "learned_ape" and "decoder" in params
  assert jax.eval_shape(infer, params).shape == (2, 8, 64)


# The planned MiB each fake compiled train step reports.
FAKE_PEAK_MIB = {"bert": 1, "rope": 2, "fox": 3, "cope": 7}


def fake_compiled(built, timed_steps=None):
  """compiled_steps without compiling: the config, steps that sleep 1 ms, and the planned
  bytes of :data:`FAKE_PEAK_MIB`; each call's ``step`` (which train step) goes to
  ``timed_steps``."""
  def compiled(size, scheme, *, head=None, step="every_token", **dims):
    built.append((scheme, head))
    if timed_steps is not None:
      timed_steps.append(step)
    cfg = model_steps.model_steps(size, scheme, head=head, **dims)[0]
    return (lambda: time.sleep(1e-3)), (lambda: time.sleep(1e-3)), cfg, {
        "train_s": 0.0, "infer_s": 0.0, "train_bytes": FAKE_PEAK_MIB.get(scheme, 1) * 2**20}
  return compiled


def test_each_row_is_timed_against_the_baseline_on_its_own_model(tiny, monkeypatch, tmp_path,
                                                                 capsys):
  built, timed_steps = [], []
  monkeypatch.setattr(steps, "compiled_steps", fake_compiled(built, timed_steps))
  rows = steps.main(["--batch", "2", "--length", "8", "--repeats", "1", "--schemes",
                     "cope,rope,bert,fox", "--json", str(tmp_path / "rows.json")])
  assert built == [("bert", "lm"), ("cope", "lm"), ("bert", "mlm"), ("rope", "mlm"),
                   ("fox", "lm")]  # each (scheme, model) compiled once
  assert set(timed_steps) == {"trainer"}  # train.py's own step by default
  assert [(r["scheme"], r["model"]) for r in rows] == [("cope", "lm"), ("rope", "mlm"),
                                                       ("bert", "mlm"), ("fox", "lm")]
  saved = json.loads((tmp_path / "rows.json").read_text())["rows"]
  assert [r["model"] for r in saved] == ["lm", "mlm", "mlm", "lm"]
  table = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[2:]}
  assert table["cope"][-1] == "lm" and table["rope"][-1] == "mlm"
  # Each row's own peak (its compiled step's), not the process's so far: fox's after cope's.
  assert [r["peak_bytes"] for r in rows] == [7 * 2**20, 2 * 2**20, 2**20, 3 * 2**20]
  assert [table[s][6] for s in ("cope", "rope", "bert", "fox")] == ["7", "2", "1", "3"]
  assert "cope" in steps.DEFAULT_SCHEMES and "fox" in steps.DEFAULT_SCHEMES


def test_cost_times_cope_and_fox_on_the_lm_beside_an_mlm_baseline(tiny, monkeypatch):
  config = get_config("glue_table")
  built = []
  monkeypatch.setattr(model_steps, "compiled_steps", fake_compiled(built))
  monkeypatch.setattr(cost, "peak_bytes", lambda size, scheme, *, head, **dims: {
      "mlm": 100, "lm": 200}[head] + (50 if scheme == "fox" else 0))
  config.cost.update(dict(batch=2, repeats=1))
  out = cost.measure("bert_tiny", ["bert", "rope", "cope", "fox"], "bert", config.cost, [8])
  assert built == [("bert", "mlm"), ("rope", "mlm"), ("bert", "lm"), ("cope", "lm"),
                   ("fox", "lm")]
  rows = out["rows"]
  assert [rows[s]["model"] for s in ("bert", "rope", "cope", "fox")] == ["mlm", "mlm", "lm", "lm"]
  assert rows["cope"]["lengths"]["8"]["memory_ratio"] == 1.0
  assert rows["fox"]["lengths"]["8"]["memory_ratio"] == 1.25
  assert "causal LM for cope, fox" in out["note"] and set(out["noise"]) == {"8"}


def test_an_lm_experiment_costs_the_lm_it_trains_at_both_lengths(tiny, monkeypatch, tmp_path):
  """Every row on the causal LM with the corpus's vocabulary, at the training length and the
  longest evaluated one with the same tokens per step, and the baseline against itself."""
  from posenc_jax import compare  # noqa: PLC0415

  config = get_config("extrapolation")
  checked = plan.check(config)
  assert compare.cost_lengths(config, checked) == [128, 2048]
  built, dims_seen = [], []

  def compiled(size, scheme, *, head=None, **dims):
    dims_seen.append((dims["batch"], dims["length"], dims["corpus"]))
    return fake_compiled(built)(size, scheme, head=head, **dims)

  monkeypatch.setattr(model_steps, "compiled_steps", compiled)
  monkeypatch.setattr(cost, "peak_bytes", lambda size, scheme, **dims: 100)
  config.cost.update(dict(batch=4, repeats=3, lengths="8,32"))
  out = compare.measure_cost(config, str(tmp_path), say=lambda line: None)
  assert built == [("sinusoidal", "lm"), ("rope", "lm"), ("t5", "lm"), ("alibi", "lm")] * 2
  assert sorted(set(dims_seen)) == [(1, 32, "stdlib"), (4, 8, "stdlib")]
  row = out["rows"]["rope"]["lengths"]["32"]
  assert row["memory_ratio"] == 1.0 and set(row["train_ratio"]) == {"median", "min", "max"}
  assert set(out["noise"]) == {"8", "32"} and out["lengths"] == [8, 32]
  assert "the causal LM the experiment trains (stdlib)" in out["note"]
  assert json.loads((tmp_path / "cost.json").read_text()) == out  # kept for reruns
  assert compare.measure_cost(config, str(tmp_path), say=lambda line: None) == out
  assert len(built) == 8  # the kept table, not timed again


def test_peak_bytes_of_the_lm_train_step(tiny):
  assert cost.peak_bytes("tiny", "fox", **DIMS) > 0


def test_a_row_reports_the_peak_xla_plans_for_its_own_step(tiny):
  """The bench's peak column: the compiled train step's plan, the same as compiling that
  step anew, so a row after CoPE's shows its own (not the process's running peak)."""
  dims = dict(DIMS, length=64)
  cope = model_steps.compiled_steps("tiny", "cope", **dims)[3]["train_bytes"]
  fox = model_steps.compiled_steps("tiny", "fox", **dims)[3]["train_bytes"]
  _, train, _, init = model_steps.model_steps("tiny", "fox", **dims)
  assert fox == memory.planned_bytes(
      jax.jit(train).lower(*jax.eval_shape(init)).compile().memory_analysis())
  assert fox == cost.peak_bytes("tiny", "fox", **dims)
  assert cope > 2 * fox  # CoPE's [B, H, L, L] gates and positions


def test_the_trainer_step_runs_at_tiny_size_and_prints_its_rows(tiny, tmp_path, capsys):
  """The default ``--step trainer``: train.py's step and eval step, compiled and run, on the
  masked LM and (fox) the causal LM, each row with its own planned peak and the trainer's
  estimate of the same step."""
  rows = steps.main(["--batch", "2", "--length", "16", "--repeats", "1", "--schemes",
                     "bert,alibi,fox", "--json", str(tmp_path / "rows.json")])
  out = capsys.readouterr().out
  assert "step trainer: train = train.py's step" in out.splitlines()[0]
  table = {line.split()[0]: line.split() for line in out.splitlines()[2:]}
  assert set(table) == {"bert", "alibi", "fox"} and table["fox"][-1] == "lm"
  assert [r["model"] for r in rows] == ["mlm", "mlm", "lm"]
  assert all(r["train_ms"] > 0 and r["infer_ms"] > 0 and r["peak_bytes"] > 0
             and r["estimated_bytes"] > 0 for r in rows)
  assert json.loads((tmp_path / "rows.json").read_text())["step"] == "trainer"


@pytest.fixture
def tiny_vocab(monkeypatch):
  """bert_tiny shrunk, with a vocabulary (72) that no other dimension shares, so the logits'
  shape names them alone."""
  monkeypatch.setitem(presets.SIZES, "bert_tiny", dict(TINY, vocab_size=72))


def test_the_trainer_step_computes_logits_at_the_masked_positions_only(tiny_vocab):
  """train.py's step (the bench's ``trainer``) is the config's: logits [B, P, V] at its
  ``max_predictions`` positions (P = 6 of L = 16 at the demo's mask rate 0.4), the state donated, layers
  scanned; the ``every_token`` step's logits are [B, L, V]."""
  dims = dict(batch=2, length=16, dtype="float32")
  config, cfg, train, infer, args = model_steps.trainer_steps("tiny", "bert", **dims)
  assert max_predictions(config) == 6 and cfg.scan_layers and cfg.vocab_size == 72
  lowered = train.lower(*args)
  text = lowered.as_text()
  assert "tensor<2x6x72xf32>" in text and "2x16x72x" not in text
  state, batch, _ = lowered.args_info[0]  # ((state, batch, rng), kwargs)
  assert all(info.donated for info in jax.tree.leaves(state))  # as train() jits it
  assert not any(info.donated for info in jax.tree.leaves(batch))
  assert infer(args[0].params, args[1])["weight"] == 2 * 6  # eval: the masked positions
  _, every, _, init = model_steps.model_steps("tiny", "bert", **dims)
  assert "tensor<2x16x72xf32>" in jax.jit(every).lower(*jax.eval_shape(init)).as_text()


def test_a_bad_step_is_one_line(capsys):
  with pytest.raises(SystemExit) as exit_info:
    steps.parse_args(["--step", "everytoken"])
  lines = capsys.readouterr().err.splitlines()
  assert exit_info.value.code == 2 and len(lines) == 1
  assert lines[0].startswith("posenc_jax.benchmarks.steps: --step: got 'everytoken'")
  assert lines[0].endswith("allowed: trainer, every_token")
