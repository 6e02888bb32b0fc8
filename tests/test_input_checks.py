"""Bad input to the Python API is one line naming the argument, the value and the range
(issue 32, items 4 and 5): token and segment ids (and masked positions) outside their
tables in every model's ``__call__`` (concrete ids; traced ones cost nothing and are not
read), ``generate``'s and ``translate``'s arguments, and ``save_hf_bert``'s files and its
``hf`` extra."""

import functools
import os
import pathlib
import sys
import tomllib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posenc_jax.convert import ConversionError, load_hf_bert, save_hf_bert
from posenc_jax.ids import check_id_values
from posenc_jax.models import (BertEncoder, BertForMaskedLM, CausalLM, generate, greedy_translate,
                               model_config, translate)
from tests.test_hf_bert import hf_tensors, tiny_hf_config, write_checkpoint
from tests.test_lm import VOCAB as LM_VOCAB
from tests.test_lm import init_lm
from tests.test_transformer import VOCAB as MT_VOCAB
from tests.test_transformer import init_model, inputs

ROOT = pathlib.Path(__file__).parent.parent
KEY = jax.random.key(0)


def one_line(error_type, message, call):
  """``call()`` raises ``error_type`` with exactly ``message``, one line."""
  with pytest.raises(error_type) as info:
    call()
  assert str(info.value) == message and "\n" not in message


# --- the helper --------------------------------------------------------------------------------


@pytest.mark.parametrize("ids, message", [
    (5, "o: n: got id 5; allowed: [0, vocab_size=5)"),
    (-1, "o: n: got id -1; allowed: [0, vocab_size=5)"),
    (np.array([[0, 4], [-2, 1]]), "o: n: got id -2; allowed: [0, vocab_size=5)"),
    (jnp.array([[1, 7], [-3, 0]]), "o: n: got id 7; allowed: [0, vocab_size=5)"),  # the high
    (np.int64(2**40), f"o: n: got id {2**40}; allowed: [0, vocab_size=5)"),
    (1.5, "o: n: got 1.5 of float64; expected integer ids"),
    (True, "o: n: got True of bool; expected integer ids"),
    (jnp.ones((2, 3)), "o: n: got shape (2, 3) of float32; expected integer ids"),
])
def test_check_id_values_names_the_id_and_the_range(ids, message):
  one_line(ValueError, message, lambda: check_id_values("o", "n", ids, 5, "vocab_size"))


def test_check_id_values_passes_ids_in_range_and_costs_nothing_when_traced():
  for ids in (None, 0, 4, np.zeros((0, 3), np.int32), jnp.array([[0, 4]])):
    check_id_values("o", "n", ids, 5, "vocab_size")

  def checked(x):
    check_id_values("o", "n", x, 5, "vocab_size")
    return x

  bad = jnp.array([[9, -1]])
  np.testing.assert_array_equal(jax.jit(checked)(bad), bad)  # traced: not read
  assert not jax.make_jaxpr(checked)(bad).eqns  # and nothing added to the program


# --- token and segment ids of the models -------------------------------------------------------

BERT = dict(vocab_size=50, d_model=16, num_layers=1, num_heads=2, mlp_dim=32, max_len=16,
            scheme={"name": "learned_ape"}, segment={"name": "segment_input"})
IDS = np.array([[2, 5, 7, 3]])


def bert_init(model_cls, input_ids, segment_ids=None, **fields):
  return lambda: model_cls(model_config(BERT | fields)).init(KEY, input_ids, segment_ids)


@functools.cache
def mt():
  return init_model()


@functools.cache
def lm():
  return init_lm({"name": "alibi"})


def mt_apply(src, tgt):
  model, params = mt()
  return lambda: model.apply({"params": params}, src, tgt)


@pytest.mark.parametrize("call, message", [
    (bert_init(BertEncoder, IDS.copy() + 47), ("BertEncoder: input_ids: got id 54; allowed: "
     "[0, vocab_size=50)")),
    (bert_init(BertForMaskedLM, -IDS), ("BertEncoder: input_ids: got id -7; allowed: "
     "[0, vocab_size=50)")),
    (bert_init(BertEncoder, jnp.asarray(IDS), jnp.array([[0, 0, 1, 2]])),
     "scheme 'segment_input': segment_ids: got id 2; allowed: [0, num_segments=2)"),
    (bert_init(BertEncoder, IDS, np.array([[0, -1, 1, 1]]),
               segment={"name": "segment_per_head", "num_segments": 3}),
     "scheme 'segment_per_head': segment_ids: got id -1; allowed: [0, num_segments=3)"),
    (lambda: mt_apply(inputs()[0].at[1, 2].set(MT_VOCAB), inputs()[2])(),
     f"Encoder: src_ids: got id {MT_VOCAB}; allowed: [0, vocab_size={MT_VOCAB})"),
    (lambda: mt_apply(inputs()[0], inputs()[2].at[0, 1].set(-4))(),
     f"Decoder: tgt_ids: got id -4; allowed: [0, vocab_size={MT_VOCAB})"),
    (lambda: lm()[0].apply({"params": lm()[1]}, jnp.array([[1, 2, 999]])),
     f"Decoder: tgt_ids: got id 999; allowed: [0, vocab_size={LM_VOCAB})"),
    (lambda: BertForMaskedLM(model_config(BERT)).init(KEY, IDS,
                                                      masked_positions=np.array([[0, 4]])),
     "BertForMaskedLM: masked_positions: got id 4; allowed: [0, L=4)"),
], ids=["bert_high", "mlm_negative", "segment_input", "segment_per_head", "encoder_decoder_src",
        "encoder_decoder_tgt", "causal_lm", "masked_positions"])
def test_concrete_ids_outside_their_table_are_one_line(call, message):
  one_line(ValueError, message, call)


def test_traced_ids_are_not_read_and_embed_as_nan():
  """The documented limit: under jit an id outside the vocabulary is not seen, its logits
  are NaN; the ids in range give the eager logits."""
  model, params = lm()
  ids = jnp.array([[1, 2, 3], [4, LM_VOCAB + 5, 6]])
  logits = jax.jit(lambda i: model.apply({"params": params}, i))(ids)
  assert np.isnan(logits[1, 1:]).all()  # the bad input and every later position
  np.testing.assert_allclose(logits[0], model.apply({"params": params}, ids[:1])[0], atol=1e-5)


# --- generate and translate --------------------------------------------------------------------

PROMPT = jnp.array([[2, 3, 4], [5, 6, 7]])


def lm_generate(prompt=PROMPT, **kwargs):
  return lambda: generate(*lm(), prompt, **({"max_new_tokens": 2} | kwargs))


V = f"vocab_size={LM_VOCAB}"
RNG = jax.random.key(1)


@pytest.mark.parametrize("call, message", [
    (lm_generate(PROMPT.at[0, 1].set(999)), f"generate: prompt: got id 999; allowed: [0, {V})"),
    (lm_generate(PROMPT.at[1, 0].set(-1)), f"generate: prompt: got id -1; allowed: [0, {V})"),
    (lm_generate(bos_id=LM_VOCAB), f"generate: bos_id: got id {LM_VOCAB}; allowed: [0, {V})"),
    (lm_generate(eos_id=-2), f"generate: eos_id: got id -2; allowed: [0, {V})"),
    (lm_generate(eos_id=50), f"generate: eos_id: got id 50; allowed: [0, {V})"),
    (lm_generate(PROMPT[0]), ("generate: prompt: got shape (3,) of int32; expected [B, L] "
     "integer ids")),
    (lm_generate(PROMPT[None]), ("generate: prompt: got shape (1, 2, 3) of int32; expected "
     "[B, L] integer ids")),
    (lm_generate(PROMPT * 1.0), ("generate: prompt: got shape (2, 3) of float32; expected "
     "[B, L] integer ids")),
    (lm_generate(jnp.zeros((0, 3), jnp.int32)), ("generate: prompt: got shape (0, 3); expected "
     "[B, P] with B >= 1 rows")),
    (lm_generate([[2, 3], [4]]), ("generate: prompt: got a ragged nested list; expected [B, P] "
     "integer ids")),
    (lm_generate(max_new_tokens=-3), ("generate: max_new_tokens: got -3; allowed: a positive "
     "integer")),
    (lm_generate(max_new_tokens=2.0), ("generate: max_new_tokens: got 2.0; allowed: a positive "
     "integer")),
    (lm_generate(rng=RNG, temperature=-0.5), ("generate: temperature: got -0.5; allowed: a "
     "finite positive number")),
    (lm_generate(rng=RNG, temperature=float("nan")), ("generate: temperature: got nan; "
     "allowed: a finite positive number")),
    (lm_generate(rng=RNG, top_k=-1), (f"generate: top_k: got -1; allowed: an integer in [0, "
     f"{V}] (0: every token)")),
    (lm_generate(temperature=0.5), ("generate: temperature, top_k: got 0.5, 0 without rng; they "
     "shape sampling only: pass rng=jax.random.key(seed) to sample")),
    (lm_generate(top_k=3), ("generate: temperature, top_k: got 1.0, 3 without rng; they shape "
     "sampling only: pass rng=jax.random.key(seed) to sample")),
    (lm_generate(rng=0), ("generate: rng: got int of shape (); allowed: None (greedy) or one "
     "PRNG key (jax.random.key(seed))")),
    (lm_generate(rng=jax.random.split(RNG, 2)), ("generate: rng: got key<fry> of shape (2,); "
     "allowed: None (greedy) or one PRNG key (jax.random.key(seed))")),
    (lm_generate(pad_id="pad"), "generate: pad_id: got 'pad'; allowed: an integer"),
    (lambda: jax.jit(lambda p: generate(*lm(), p, max_new_tokens=2, bos_id=99))(PROMPT),
     f"generate: bos_id: got id 99; allowed: [0, {V})"),  # static arguments under jit
    (lambda: greedy_translate(*mt(), inputs()[0], max_decode_len=0),
     "greedy_translate: max_decode_len: got 0; allowed: a positive integer"),
    (lambda: greedy_translate(*mt(), inputs()[0], max_decode_len=3, eos_id=MT_VOCAB),
     f"greedy_translate: eos_id: got id {MT_VOCAB}; allowed: [0, vocab_size={MT_VOCAB})"),
    (lambda: translate(*mt(), inputs()[0], max_decode_len=3, beam_size=0),
     "translate: beam_size: got 0; allowed: a positive integer"),
    (lambda: translate(*mt(), inputs()[0], max_decode_len=3, alpha=-0.6),
     "translate: alpha: got -0.6; allowed: a finite number >= 0"),
    (lambda: translate(*mt(), inputs()[0], max_decode_len=3, bos_id=-1),
     f"translate: bos_id: got id -1; allowed: [0, vocab_size={MT_VOCAB})"),
    (lambda: translate(*mt(), inputs()[0].at[0, 0].set(-7), max_decode_len=3),
     f"Encoder: src_ids: got id -7; allowed: [0, vocab_size={MT_VOCAB})"),
])
def test_decoding_arguments_are_one_line(call, message):
  one_line(ValueError, message, call)


@pytest.mark.parametrize("make, wiring, message", [
    (lambda: BertForMaskedLM(model_config(BERT)), generate,
     "generate: model: got BertForMaskedLM; allowed: CausalLM (decoded by generate)"),
    (lambda: mt()[0], generate,
     "generate: model: got EncoderDecoder; allowed: CausalLM (decoded by generate)"),
    (lambda: lm()[0], translate, ("translate: model: got CausalLM; allowed: EncoderDecoder "
     "(decoded by translate and greedy_translate)")),
])
def test_a_model_of_another_kind_is_one_line(make, wiring, message):
  kwargs = {"max_new_tokens": 2} if wiring is generate else {"max_decode_len": 2}
  one_line(TypeError, message, lambda: wiring(make(), {}, PROMPT, **kwargs))


def test_a_list_prompt_with_no_end_token_and_a_negative_pad_id_generate():
  """What the checks allow still runs: a nested-list prompt, ``eos_id=None`` (every row gets
  every token) and any integer ``pad_id``."""
  model, params = lm()
  tokens, log_probs = generate(model, params, [[2, 3, 4]], max_new_tokens=3, eos_id=None,
                               pad_id=-1)
  assert tokens.shape == (1, 3) and ((tokens >= 0) & (tokens < LM_VOCAB)).all()
  assert np.isfinite(log_probs).all()
  assert isinstance(model, CausalLM)


# --- export ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bert_export(tmp_path_factory):
  """``(config, variables, vocab.txt)`` of a tiny imported checkpoint."""
  hf = tiny_hf_config()
  source = write_checkpoint(tmp_path_factory.mktemp("hf") / "source", hf, hf_tensors(hf))
  config, variables, _ = load_hf_bert(source)
  return config, variables, source / "vocab.txt"


def unwritable(tmp_path):
  """A folder no file can be created in (root writes through permission bits)."""
  if os.geteuid() == 0:
    return pathlib.Path("/proc/self")
  folder = tmp_path / "ro"
  folder.mkdir(mode=0o555)
  return folder


def listing(folder):
  return sorted(str(p) for p in folder.rglob("*"))


@pytest.mark.parametrize("case", ["out_is_file", "out_under_file", "out_unwritable",
                                  "out_unwritable_sub", "file_blocks_write", "vocab_missing",
                                  "vocab_is_folder", "vocab_not_utf8"])
def test_export_paths_are_one_conversion_error_line(tmp_path, bert_export, case):
  config, variables, vocab = bert_export
  (tmp_path / "file").write_text("a file\n")
  (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00bad\n")
  (tmp_path / "blocked" / "config.json").mkdir(parents=True)  # a folder where a file goes
  out = tmp_path / "out"
  out, vocab_txt, pattern = {
      "out_is_file": (tmp_path / "file", vocab, (r"out_dir: '.*file' cannot be created: '.*file'"
                      r" is a file")),
      "out_under_file": (tmp_path / "file" / "out", vocab, (r"out_dir: '.*file/out' cannot be "
                         r"created: '.*file' is a file")),
      "out_unwritable": (unwritable(tmp_path), vocab, r"out_dir: '.*' is not writable"),
      "out_unwritable_sub": (unwritable(tmp_path) / "out", vocab, (r"out_dir: '.*out' cannot be "
                             r"created: (Permission denied|No such file or directory)")),
      "file_blocks_write": (tmp_path / "blocked", vocab, (r"out_dir: '.*blocked' cannot be "
                            r"written: \[Errno 21\] Is a directory: '.*config.json'")),
      "vocab_missing": (out, tmp_path / "none.txt", (r"vocab_txt: .*none.txt cannot be read: No "
                        r"such file or directory")),
      "vocab_is_folder": (out, tmp_path, r"vocab_txt: .* cannot be read: Is a directory"),
      "vocab_not_utf8": (out, tmp_path / "binary.txt", (r"vocab_txt: .*binary.txt is not UTF-8 "
                         r"text")),
  }[case]
  before = listing(tmp_path)
  with pytest.raises(ConversionError, match=f"^{pattern}$") as info:
    save_hf_bert(out, config, variables, vocab_txt)
  assert "\n" not in str(info.value)
  assert listing(tmp_path) == before  # nothing written, no folder left behind


def test_without_safetensors_import_and_export_name_the_extra(tmp_path, bert_export,
                                                              monkeypatch):
  config, variables, vocab = bert_export
  monkeypatch.setitem(sys.modules, "safetensors", None)
  monkeypatch.setitem(sys.modules, "safetensors.numpy", None)
  message = ('safetensors: not installed; the Hugging Face import and export need it: '
             'pip install "posenc-jax[hf]"')
  one_line(ConversionError, message, lambda: save_hf_bert(tmp_path / "out", config, variables,
                                                          vocab))
  one_line(ConversionError, message, lambda: load_hf_bert(vocab.parent))
  assert not (tmp_path / "out").exists()


def test_the_extra_the_error_names_installs_safetensors():
  """The ``hf`` extra holds safetensors and the extras whose tools read checkpoints include
  it; the README names it where it mentions the export."""
  extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
      "optional-dependencies"]
  assert [r for r in extras["hf"] if r.startswith("safetensors")] == ["safetensors>=0.8.0,<0.9"]
  for extra in ("train", "analysis"):
    assert any(r.startswith("posenc-jax[") and "hf" in r.split("[")[1] for r in extras[extra])
  assert not any(r.startswith("safetensors") for name in ("train", "analysis", "test")
                 for r in extras[name])  # one place
  readme = (ROOT / "README.md").read_text()
  assert "import and export (the `hf` extra" in readme
