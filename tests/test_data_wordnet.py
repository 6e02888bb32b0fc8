"""The bundled WordNet corpus, its SentencePiece vocabulary and the ``wordnet_glosses`` task."""

import gzip
import hashlib
import importlib
import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
WORDNET = REPO / "posenc_jax" / "data" / "bundled" / "wordnet"
SCRIPT = REPO / "scripts" / "make_wordnet_corpus.py"
SYNSETS_IN_WORDNET_3_0 = 117_659          # 82,115 nouns, 13,767 verbs, 18,156 adj., 3,621 adv.
DOG_GLOSS = ("a member of the genus Canis (probably descended from the common wolf) that has "
             "been domesticated by man since prehistoric times; occurs in many breeds; "
             '"the dog barked all night"')
CAR_LINE = ("car, auto, automobile, machine, motorcar: a motor vehicle with four wheels; usually "
            'propelled by an internal combustion engine; "he needs a car to get to work"')


def _script():
  spec = importlib.util.spec_from_file_location("make_wordnet_corpus", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _lines(name):
  with gzip.open(WORDNET / name, "rt", encoding="utf-8") as f:
    return f.read().splitlines()


@pytest.fixture(scope="module")
def corpus():
  heldout = [json.loads(line) for line in _lines("synsets_heldout.jsonl.gz")]
  return _lines("pretrain_train.txt.gz"), _lines("pretrain_validation.txt.gz"), heldout


def test_bundled_files_exist_and_are_small():
  sizes = {p.name: p.stat().st_size for p in WORDNET.iterdir()}
  assert set(sizes) >= {"pretrain_train.txt.gz", "pretrain_validation.txt.gz",
                        "synsets_heldout.jsonl.gz", "LICENSE", "README.md", "spm8k.model"}
  assert sum(sizes.values()) < 8_000_000
  assert 100_000 < sizes["spm8k.model"] < 1_000_000
  assert "WordNet 3.0 Copyright 2006 by Princeton University" in (WORDNET / "LICENSE").read_text()


def test_readme_hashes_match_the_files():
  readme = (WORDNET / "README.md").read_text()
  for name in ("pretrain_train.txt.gz", "pretrain_validation.txt.gz",
               "synsets_heldout.jsonl.gz", "LICENSE", "spm8k.model"):
    assert hashlib.sha256((WORDNET / name).read_bytes()).hexdigest() in readme, name


def test_corpus_is_real_wordnet_text(corpus):
  train, validation, heldout = corpus
  assert train[0] == ("entity: that which is perceived or known or inferred to have its own "
                      "distinct existence (living or nonliving)")
  assert CAR_LINE in train
  dog = next(r for r in heldout if r["key"] == "n02084071")      # the dog synset is held out
  assert dog["words"] == ["dog", "domestic dog", "Canis familiaris"]
  assert dog["gloss"] == DOG_GLOSS and dog["examples"] == ["the dog barked all night"]
  assert dog["lexname"] == "noun.animal" and dog["pos"] == "n"
  assert dog["hypernyms"] == [2083346, 1317541]    # canine, domestic animal
  assert not any("domesticated by man since prehistoric times" in line
                 for line in train + validation)


def test_every_synset_is_in_exactly_one_place(corpus):
  train, validation, heldout = corpus
  assert (len(train), len(validation), len(heldout)) == (99_477, 5_997, 11_907)
  dropped = 278                                      # definition identical to a held-out one
  assert len(train) + len(validation) + len(heldout) + dropped == SYNSETS_IN_WORDNET_3_0
  assert not set(train) & set(validation)
  assert len(set(r["key"] for r in heldout)) == len(heldout)


def test_split_is_the_stable_hash_rule(corpus):
  script = _script()
  *_, heldout = corpus
  for record in heldout:
    key = record["key"]
    assert key == f"{record['pos']}{record['offset']:08d}"
    digest = hashlib.sha256(key.encode()).digest()
    assert int.from_bytes(digest[:8], "big") % 1000 < 100
    assert script.split_of(key) == "heldout"
  assert script.bucket("n02084071") == 14                       # pinned: never reshuffles
  assert abs(len(heldout) / SYNSETS_IN_WORDNET_3_0 - 0.10) < 0.005


def test_heldout_synsets_never_in_pretraining_text(corpus):
  train, validation, heldout = corpus
  script = _script()
  pretrain_definitions = {script.split_gloss(line.split(": ", 1)[1])[0]
                          for line in train + validation}
  pretrain = set(train) | set(validation)
  lexnames = set(script.LEXNAMES)
  assert len(lexnames) == 45
  for record in heldout:
    assert script.pretrain_line(record) not in pretrain
    assert record["definition"] not in pretrain_definitions
    assert record["lexname"] in lexnames and record["pos"] in "nvar"
    assert record["lexname"].split(".")[0] == {"n": "noun", "v": "verb", "a": "adj",
                                               "r": "adv"}[record["pos"]]
    assert all(isinstance(o, int) for o in record["hypernyms"] + record["instance_hypernyms"])


def test_split_gloss():
  split_gloss = _script().split_gloss
  assert split_gloss('a dog; "the dog barked"; "a good dog"') == (
      "a dog", ["the dog barked", "a good dog"])
  assert split_gloss('one; two; "ex; with semicolon"') == ("one; two", ["ex; with semicolon"])


@pytest.mark.skipif(not pathlib.Path("/usr/share/wordnet/data.noun").exists(),
                    reason="needs the Debian package wordnet-base")
def test_extraction_is_byte_reproducible(tmp_path):
  subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--skip_vocab"],
                 check=True, capture_output=True)
  for name in ("pretrain_train.txt.gz", "pretrain_validation.txt.gz",
               "synsets_heldout.jsonl.gz", "LICENSE"):
    assert (tmp_path / name).read_bytes() == (WORDNET / name).read_bytes(), name


def test_import_posenc_jax_loads_no_tensorflow():
  """Nor does the trainer's loop (a run on given batches, ``train(..., data=...)``, never
  loads it; a seqio task's pipeline does, when the run reads it)."""
  code = ("import sys, posenc_jax; "
          "assert 'tensorflow' not in sys.modules and 'posenc_jax.data' not in sys.modules; "
          "import posenc_jax.training.loop; "
          "assert 'tensorflow' not in sys.modules and 'seqio' not in sys.modules")
  subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# ---- vocabulary ----

def test_bundled_vocab_special_ids_and_round_trip(corpus):
  import sentencepiece as spm
  from posenc_jax.data import vocab
  processor = spm.SentencePieceProcessor(model_file=str(vocab.BUNDLED_VOCAB))
  assert processor.get_piece_size() == 8192
  assert [processor.id_to_piece(i) for i in range(6)] == [
      "<pad>", "</s>", "<unk>", "[CLS]", "[SEP]", "[MASK]"]
  assert (vocab.PAD_ID, vocab.EOS_ID, vocab.UNK_ID, vocab.CLS_ID, vocab.SEP_ID,
          vocab.MASK_ID) == (0, 1, 2, 3, 4, 5)
  assert processor.bos_id() == -1
  *_, heldout = corpus
  for text in [DOG_GLOSS] + [r["gloss"] for r in heldout[:200]]:     # text it never saw
    ids = processor.encode(text)
    assert vocab.UNK_ID not in ids and processor.decode(ids) == text
  assert processor.encode("[MASK]") == [processor.piece_to_id("▁"), vocab.MASK_ID]


def test_seqio_vocabulary():
  from posenc_jax.data import vocab
  v = vocab.vocabulary()
  assert v.vocab_size == 8192 and v.pad_id == 0 and v.eos_id == 1 and v.unk_id == 2
  ids = v.encode("a motor vehicle with four wheels")
  assert v.decode(ids) == "a motor vehicle with four wheels"
  assert v.decode_tf(v.encode_tf("a dog")).numpy().decode() == "a dog"


def test_vocab_training_is_deterministic(tmp_path):
  from posenc_jax import train_vocab
  from posenc_jax.data import vocab
  small = tmp_path / "small.txt.gz"
  with gzip.open(small, "wt", encoding="utf-8") as f:
    f.write("\n".join(_lines("pretrain_validation.txt.gz")[:2000]) + "\n")
  for name in "ab":
    train_vocab.main([f"--files={small}", "--vocab_size=400", f"--output={tmp_path}/{name}"])
  assert (tmp_path / "a.model").read_bytes() == (tmp_path / "b.model").read_bytes()
  v = vocab.vocabulary(tmp_path / "a.model")
  assert v.vocab_size == 400
  assert v.decode(v.encode("a dog; a cat")) == "a dog; a cat"
  assert (tmp_path / "a.vocab").read_text().splitlines()[5] == "[MASK]\t0"


def test_vocab_reads_the_raw_text_of_a_task():
  from posenc_jax import train_vocab
  assert list(train_vocab.read_task_text("wordnet_glosses", "validation", "text")) == _lines(
      "pretrain_validation.txt.gz")


def test_vocabulary_rejects_a_model_without_the_special_ids(tmp_path):
  import sentencepiece as spm
  from posenc_jax.data import vocab
  lines = _lines("pretrain_validation.txt.gz")[:1000]
  spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(tmp_path / "m"),
                                 vocab_size=200, minloglevel=2)
  with pytest.raises(ValueError, match="special ids"):
    vocab.vocabulary(tmp_path / "m.model")


# ---- seqio task ----

def test_wordnet_glosses_task():
  import seqio
  from posenc_jax.data import tasks, vocab
  importlib.reload(tasks)                           # registering again does not raise
  task = seqio.get_mixture_or_task("wordnet_glosses")
  assert set(task.splits) == {"train", "validation"}
  ds = task.get_dataset({"text": 128}, split="train", shuffle=False)
  first = next(ds.as_numpy_iterator())
  assert first["text"].dtype.name == "int32" and len(first["text"]) <= 128
  assert vocab.vocabulary().decode(first["text"].tolist()).startswith("entity: that which is")
  assert first["text"][-1] != vocab.EOS_ID
  untrimmed, trimmed = ([len(x["text"]) for x in task.get_dataset(
      length, split="validation", shuffle=False).as_numpy_iterator()]
                        for length in (None, {"text": 16}))
  assert len(untrimmed) == len(trimmed) == 5_997
  assert max(untrimmed) > 16 and max(trimmed) == 16
