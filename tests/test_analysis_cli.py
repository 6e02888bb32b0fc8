"""``python -m posenc_jax.analysis``: fresh bert_tiny models and a train.py-style checkpoint."""

import json
import pathlib
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from matplotlib import image as mpimg

from posenc_jax import params as params_tool
from posenc_jax.analysis import (TABLE2_COLUMNS, AnalysisError, from_checkpoint, from_config,
                                 numerical_rank, position_vectors, positional_attention,
                                 read_config)
from posenc_jax.analysis.__main__ import main
from posenc_jax.models.build import build_model
from posenc_jax.training.checkpoint import Checkpointer
from posenc_jax.training.loop import TrainState
from posenc_jax.training.optim import make_optimizer
from posenc_jax.training.workdir import claim

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUN_CONFIG = "configs/pretrain.py:bert_tiny,diet_abs_share"
LM_CONFIG = "configs/lm.py:bert_tiny,bert"  # learned input APE
# Small settings; each command takes only the flags it reads.
FAST_PROBE = ["--num_words=6", "--length=32", "--batch_size=6"]
FAST_RANK = ["--length=32", "--rank_batch=2"]
FAST = FAST_PROBE + ["--rank_batch=2"]  # plots reads both


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
  monkeypatch.chdir(ROOT)  # config paths are relative to the repository


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  """A train.py checkpoint at step 5, written by train.py's own Checkpointer."""
  path = tmp_path_factory.mktemp("run")
  config = read_config(str(ROOT / RUN_CONFIG))
  claim(str(path), config)  # config.json, as train.py records it
  model = build_model(config.model, config.head)
  variables = jax.jit(model.init)(jax.random.key(3), jnp.ones((1, 8), jnp.int32))
  tx, _ = make_optimizer(config.optimizer, config.total_steps)
  # As train.py's init_state: unboxed parameters, optimizer state beside them.
  state = TrainState.create(apply_fn=model.apply, params=nn.unbox(variables["params"]), tx=tx)
  checkpointer = Checkpointer(str(path), save_interval_steps=1, async_save=False)
  checkpointer.save(5, state, {"step": 5}, force=True, input_iterator=_InputState())
  checkpointer.close()
  return path, state.params


@pytest.fixture(scope="module")
def lm_workdir(tmp_path_factory):
  """A causal LM's train.py checkpoint at step 2 (learned APE: the positional term reads
  the decoder's table and its first layer's self-attention kernels)."""
  path = tmp_path_factory.mktemp("lm_run")
  config = read_config(str(ROOT / LM_CONFIG))
  claim(str(path), config)
  model = build_model(config.model, config.head)
  variables = jax.jit(model.init)(jax.random.key(4), jnp.ones((1, 8), jnp.int32))
  tx, _ = make_optimizer(config.optimizer, config.total_steps)
  state = TrainState.create(apply_fn=model.apply, params=nn.unbox(variables["params"]), tx=tx)
  checkpointer = Checkpointer(str(path), save_interval_steps=1, async_save=False)
  checkpointer.save(2, state, {"step": 2}, force=True)
  checkpointer.close()
  return path, state.params


class _InputState:
  """An input iterator's state, saved beside the model as train.py saves its pipeline's."""

  def save_state(self, prefix):
    pathlib.Path(prefix + ".index").write_text("position 5")


def run(argv, capsys):
  """``main`` in this process; returns (stdout lines, the JSON of the last line)."""
  assert main(["analysis"] + argv) == 0
  lines = capsys.readouterr().out.strip().splitlines()
  return lines, json.loads(lines[-1])


def assert_picture(path):
  path = pathlib.Path(path)
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  pixels = mpimg.imread(path)
  assert pixels.shape[0] > 200 and pixels.shape[1] > 200
  colours = np.unique(pixels.reshape(-1, pixels.shape[-1]).round(3), axis=0)
  assert len(colours) > 50  # a heatmap with a colour bar, not a blank canvas
  assert pixels[..., :3].std() > 0.05


def test_checkpoint_restores_the_saved_parameters(workdir, caplog):
  """Only the parameters are read, and Orbax does not warn about the input state left unread
  (its warnings about anything else still show)."""
  path, saved = workdir
  assert (path / "checkpoints" / "5" / "input").is_dir()
  with caplog.at_level("WARNING"):
    model = from_checkpoint(str(path), RUN_CONFIG)
  assert "could not be restored" not in caplog.text
  assert model.step == 5 and model.source.endswith("@5")
  saved_leaves, saved_tree = jax.tree.flatten(saved["bert"])
  loaded_leaves, loaded_tree = jax.tree.flatten(model.variables["params"])
  assert saved_tree == loaded_tree
  for a, b in zip(saved_leaves, loaded_leaves):
    np.testing.assert_array_equal(a, b)


def test_the_run_config_comes_from_the_workdir(workdir):
  """Without a config the model is the one the run's config.json records; a config of
  another model is one line."""
  path, saved = workdir
  model = from_checkpoint(str(path))
  assert model.config == from_checkpoint(str(path), RUN_CONFIG).config
  jax.tree.map(np.testing.assert_array_equal, model.variables["params"], saved["bert"])
  other = RUN_CONFIG.replace("diet_abs_share", "alibi")
  with pytest.raises(AnalysisError, match=r"^config: model.scheme: .* in the workdir, .* here: "
                                          r"not the model the run trained; drop --config"):
    from_checkpoint(str(path), other)


def test_plots_of_a_checkpoint(workdir, tmp_path, capsys):
  path, _ = workdir
  _, result = run(["plots", f"--workdir={path}", f"--out_dir={tmp_path}"] + FAST, capsys)
  names = sorted(pathlib.Path(f).name for f in result["files"])
  assert names == ["position_similarity.png", "positional_attention.png", "probing.png",
                   "rank_histogram.png"]
  assert result["model"]["step"] == 5 and result["skipped"] == {}
  for f in result["files"]:
    assert_picture(f)


def test_indicators_table_and_json(tmp_path, capsys):
  out = tmp_path / "indicators.json"
  assert main(["analysis", "indicators", "--config=configs/model.py:bert_tiny,bert",
               f"--out={out}"] + FAST_PROBE) == 0
  lines = capsys.readouterr().out.strip().splitlines()
  result = json.loads(out.read_text())
  assert result["paper_row"] == "BERT-style APE"
  assert result["paper"]["direction_balance"] == 1.1940
  assert result["probing"] == {"length": 32, "layer": 0, "num_words": 6,
                               "special_positions": [0, 31]}
  ours = next(i for i, line in enumerate(lines) if line.startswith("ours: "))
  assert "bert_tiny,bert" in lines[ours] and lines[ours + 1].startswith("paper: BERT-style APE")
  printed = [float(x) for x in lines[ours].split()[-6:]]
  np.testing.assert_allclose(printed, [result["indicators"][c] for c in TABLE2_COLUMNS],
                             atol=5e-5)
  assert any(line.startswith("learnable sin. APE + learnable sin. RPE") for line in lines)
  assert result["paper_setup_differences"] == []


def test_indicators_name_how_a_setup_differs_from_the_paper(tmp_path, capsys):
  """Shaw's defaults (clip 16, per layer, no value table) are not Table 2's setup: no paper
  row, and the table says which fields differ."""
  out = tmp_path / "indicators.json"
  assert main(["analysis", "indicators", "--config=configs/model.py:bert_tiny,shaw",
               f"--out={out}"] + FAST_PROBE) == 0
  lines = capsys.readouterr().out.strip().splitlines()
  result = json.loads(out.read_text())
  assert result["paper_row"] is None and result["paper"] is None
  assert "shaw clip=16 (paper: 64)" in result["paper_setup_differences"]
  assert any(line.startswith("not Wang et al.'s Table 2 setup: shaw clip=16 (paper: 64)")
             for line in lines)


def test_probe_writes_maps_and_per_head_json(tmp_path, capsys):
  _, result = run(["probe", "--config=configs/model.py:bert_tiny,alibi", "--per_head",
                   f"--out_dir={tmp_path}"] + FAST_PROBE, capsys)
  attention = np.asarray(result["probing"]["attention"])
  assert attention.shape == (32, 32)
  np.testing.assert_allclose(attention.sum(-1), 1.0, rtol=1e-4)
  assert np.asarray(result["probing"]["per_head"]).shape == (2, 32, 32)
  assert result["positional"]["kind"] == "term"
  assert np.asarray(result["positional"]["values"]).shape == (2, 32, 32)
  for f in result["files"]:
    assert_picture(f)


def test_rank_command_line_on_the_checkpoint(workdir, tmp_path):
  path, _ = workdir
  out = tmp_path / "rank.json"
  proc = subprocess.run([sys.executable, "-m", "posenc_jax.analysis", "rank",
                         f"--config={RUN_CONFIG}", f"--workdir={path}", f"--out={out}",
                         f"--out_dir={tmp_path}"] + FAST_RANK, cwd=ROOT, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  report = json.loads(out.read_text())["rank"]
  assert report["head_dim"] == 64 and report["length"] == 32
  assert np.asarray(report["logits"]["ranks"]).shape == (2, 2)
  assert report["positional"]["kind"] == "term"
  assert report["positional"]["ranks"] == [32, 32]  # DIET-ABS d_p = 128 >= L: full rank
  assert_picture(tmp_path / "rank_histogram.png")


def test_params_table(monkeypatch, capsys):
  monkeypatch.setattr(params_tool, "DIET6", params_tool.DIET6[:1])  # one row keeps it quick
  lines, result = run(["params", "--config=configs/model.py:bert_tiny,alibi"], capsys)
  assert lines[0].startswith("DIET Table 6")
  assert lines[2].startswith("Devlin et al. (input APE)") and lines[2].endswith("match")
  assert result["diet_table6"][0]["english"]["ours_m"] == 110.1
  expected = params_tool.model_counts(read_config("configs/model.py:bert_tiny,alibi"))["total"]
  assert result["model"]["total"] == expected
  assert f"{expected:,} parameters" in lines[-2]


def test_errors_are_one_line(workdir, tmp_path):
  path, _ = workdir
  with pytest.raises(SystemExit, match="command: got none; allowed: one of probe"):
    main(["analysis", "--config=configs/model.py:bert_tiny,bert"])
  with pytest.raises(SystemExit, match="checkpoints"):
    main(["analysis", "rank", f"--config={RUN_CONFIG}", f"--workdir={tmp_path}"])
  with pytest.raises(SystemExit, match="model.scheme: .* in the workdir, .*learned_ape.* here"):
    main(["analysis", "rank", "--config=configs/pretrain.py:bert_tiny,bert", f"--workdir={path}"])
  with pytest.raises(SystemExit, match="out_dir"):
    main(["analysis", "plots", "--config=configs/model.py:bert_tiny,bert"])
  for foreign in ("[1, 2, 3]", "null", '{"model": 3}', '{"seed": 0'):  # the trainer's one line
    bad = tmp_path / f"foreign_{len(foreign)}"
    bad.mkdir()
    (bad / "config.json").write_text(foreign)
    with pytest.raises(SystemExit, match=r"^analysis rank: workdir: .*config\.json") as e:
      main(["analysis", "rank", f"--workdir={bad}"])
    assert "\n" not in str(e.value)


def test_the_default_length_is_the_runs(workdir, capsys):
  """With a workdir the probing length defaults to the run's seq_len (the demo's 64), not
  128; a fresh model keeps min(128, max_len)."""
  path, _ = workdir
  seq_len = json.loads((path / "config.json").read_text())["seq_len"]
  assert seq_len == 64
  _, result = run(["probe", f"--workdir={path}", "--num_words=4", "--batch_size=4"], capsys)
  assert result["probing"]["length"] == seq_len
  _, result = run(["probe", "--config=configs/model.py:bert_tiny,alibi", "--num_words=4",
                   "--batch_size=4"], capsys)
  assert result["probing"]["length"] == 128


def test_probing_a_language_model_workdir_is_one_line_before_any_work(tmp_path):
  """Probing (and the indicators computed from it) reads attention to both sides of each
  position: a causal LM has none after it; nor a logits batch for rank. No checkpoint is
  read."""
  config = read_config("configs/lm.py:bert_tiny,alibi")
  claim(str(tmp_path), config)  # its config.json only
  for command in ("probe", "indicators"):
    with pytest.raises(SystemExit) as e:
      main(["analysis", command, f"--workdir={tmp_path}"])
    assert str(e.value) == (
        f"analysis {command}: model: a decoder-only causal language model (head 'lm'); "
        f"{command}: identical-word probing (Wang et al.) needs attention to both sides of "
        "each position, which causal attention lacks; rank and plots analyse its positional "
        "term")
  with pytest.raises(SystemExit, match=r"^analysis rank: rank_batch: got 2, which a causal "
                                       r"language model's rank does not read"):
    main(["analysis", "rank", f"--workdir={tmp_path}", "--rank_batch=2"])


def test_a_language_model_checkpoint_gives_the_decoders_positional_term(lm_workdir):
  """The LM's positional term is c (P W_Q^h)(P W_K^h)^T of its decoder's table and first
  self-attention layer, and its position vectors are that table."""
  path, saved = lm_workdir
  model = from_checkpoint(str(path))
  assert model.causal and model.describe()["mask"] == "causal" and model.step == 2
  decoder = saved["decoder"]
  table = np.asarray(decoder["position"]["position_embedding"][:16], np.float64)
  attention = decoder["layers"]["self_attention"]
  pq = np.einsum("ld,dhk->hlk", table, np.asarray(attention["query"]["kernel"][0]))
  pk = np.einsum("ld,dhk->hlk", table, np.asarray(attention["key"]["kernel"][0]))
  expected = np.einsum("hik,hjk->hij", pq, pk) / np.sqrt(pq.shape[-1])
  positional = positional_attention(model.encoder, model.variables, length=16)
  assert positional.kind == "input"
  np.testing.assert_allclose(positional.values, expected, rtol=1e-4, atol=1e-7)
  vectors = position_vectors(model.encoder, model.variables, length=16)
  np.testing.assert_array_equal(vectors.vectors, table.astype(np.float32))


def test_rank_and_plots_of_a_language_model_checkpoint(lm_workdir, tmp_path, capsys):
  """rank: the positional ranks of the decoder's term at the run's seq_len, the logits a
  line; plots: the term (future masked), position vectors and ranks, probing skipped."""
  path, _ = lm_workdir
  seq_len = json.loads((path / "config.json").read_text())["seq_len"]
  _, result = run(["rank", f"--workdir={path}"], capsys)
  report = result["rank"]
  assert report["length"] == seq_len and result["model"]["mask"] == "causal"
  assert report["logits"].startswith("not computed: the per-head logits need the model's layers")
  assert "causal" in report["positional"]["mask"]
  model = from_checkpoint(str(path))
  values = positional_attention(model.encoder, model.variables, length=seq_len).values
  assert report["positional"]["ranks"] == numerical_rank(values).tolist()
  assert max(report["positional"]["ranks"]) <= report["head_dim"]  # DIET Theorem 1
  _, result = run(["plots", f"--workdir={path}", f"--out_dir={tmp_path}", "--length=16"],
                  capsys)
  names = [pathlib.Path(f).name for f in result["files"]]
  assert names == ["positional_attention.png", "position_similarity.png", "rank_histogram.png"]
  assert result["skipped"] == {"probing.png": "identical-word probing (Wang et al.) needs "
                               "attention to both sides of each position, which causal "
                               "attention lacks"}
  for f in result["files"]:
    assert_picture(f)


def test_a_language_models_alibi_is_the_causal_form(capsys):
  """ALiBi in an LM is -m_h (i - j) for j <= i and 0 after (the decoder's form), not the
  encoder's -m_h |i - j|: the values and the ranks the command prints are the causal
  form's (rank L - 1: its first row is 0), not the symmetric one's (full rank)."""
  offsets = np.arange(16)[:, None] - np.arange(16)[None, :]
  slopes = 2.0 ** -np.array([4.0, 8.0])[:, None, None]  # H = 2: 2^(-8h/H)
  causal = -slopes * np.maximum(offsets, 0)
  model = from_config("configs/lm.py:bert_tiny,alibi")
  values = positional_attention(model.encoder, model.variables, length=16).values
  np.testing.assert_allclose(values, causal, rtol=1e-6)
  _, result = run(["rank", "--config=configs/lm.py:bert_tiny,alibi", "--length=16"], capsys)
  assert result["rank"]["positional"]["ranks"] == numerical_rank(causal).tolist() == [15, 15]
  assert numerical_rank(-slopes * np.abs(offsets)).tolist() == [16, 16]


def test_plots_of_a_language_model_without_a_positional_term(tmp_path, capsys):
  """RoPE has no content-free term and the LM no logits ranks: every picture is skipped,
  each with its reason."""
  _, result = run(["plots", "--config=configs/lm.py:bert_tiny,rope", "--length=8",
                   f"--out_dir={tmp_path}"], capsys)
  assert result["files"] == [] and list(tmp_path.iterdir()) == []
  assert sorted(result["skipped"]) == ["position_similarity.png", "positional_attention.png",
                                       "probing.png", "rank_histogram.png"]
  assert result["skipped"]["rank_histogram.png"].startswith("no ranks to draw: a causal")


def test_pictures_without_matplotlib_say_what_to_install(monkeypatch, tmp_path):
  monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
  with pytest.raises(SystemExit, match=r'^analysis plots: out_dir: the pictures need matplotlib: '
                                       r'pip install "posenc-jax\[analysis\]"$'):
    main(["analysis", "plots", "--config=configs/model.py:bert_tiny,bert",
          f"--out_dir={tmp_path}"])


def test_help_lists_the_flags_configs_presets_and_model_fields(capsys):
  assert main(["analysis", "--help"]) == 0
  out = capsys.readouterr().out
  assert out.startswith("Command line: ``python -m posenc_jax.analysis <command>")
  assert "--length: sequence length (default: a workdir's seq_len" in out
  assert "configs/model.py" in out and "bert_tiny" in out and "diet_abs_share" in out
  assert "--config.model.scheme={'name': 'learned_ape'}" in out
  assert "--config.total_steps" not in out  # the analysis trains nothing
