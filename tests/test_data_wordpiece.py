"""``WordPieceVocabulary``: BERT's tokenisation through seqio's interface, Python == TF."""

import pickle
import sys
import unicodedata

import numpy as np
import pytest

from tests.conftest import minilm_dir, require

tf = require("tensorflow")
seqio = require("seqio")
require("tensorflow_text")

from posenc_jax.data import wordpiece  # noqa: E402
from posenc_jax.data.wordpiece import WordPieceVocabulary  # noqa: E402

SMALL_VOCAB = ["[PAD]", "[unused0]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "hello", "world",
               "##s", ",", "!", ".", "un", "##aff", "##able", "a", "##b", "##c", "cafe", "日",
               "本", "strasse", "fine", "'", "s", "$", "5", "Hello", "##ly", "x", "##x"]
TRICKY = [
    "", "   ", "Hello, worlds!", "unaffable", "The cafe's fine.", "Café NAÏVE Straße ﬁne",
    "日本", "a\u3000b a\u00a0b a\u2028b", "ab\u00adc a\u200bb", "tab\there\nnew\rline\fx",
    "$5 [CLS] [MASK] ##s", "x" * 100 + " " + "x" * 101, "é" * 50 + " " + "é" * 51,
    "\u00b4 \u02c6 \u0301a", "unknownword helloly", "Ａｂｃ ① Ⅻ ㎒ ǅ İ", "a\x00b\x1fc\x7fd",
    "\U0001F600 smile", "ﬀ", "\u0600\u061c\ufeff\u034fz",
]


@pytest.fixture(scope="module")
def small_vocab_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("wp") / "vocab.txt"
  path.write_text("\n".join(SMALL_VOCAB) + "\n", encoding="utf-8")
  return path


@pytest.fixture(scope="module")
def small(small_vocab_file):
  return WordPieceVocabulary(small_vocab_file, lower_case=True)




def _ids(small_vocab, *tokens):
  return [SMALL_VOCAB.index(t) for t in tokens]


def test_special_ids_are_looked_up_by_name(small):
  assert (small.pad_id, small.unk_id, small.cls_id, small.sep_id, small.mask_id) == (0, 2, 3, 4, 5)
  assert small.eos_id is None and small.bos_id is None
  assert small.vocab_size == len(SMALL_VOCAB) and small.tokens[7] == "hello"


def test_known_tokenisations(small):
  assert small.encode("Hello, worlds!") == _ids(small, "hello", ",", "world", "##s", "!")
  assert small.encode("unaffable") == _ids(small, "un", "##aff", "##able")
  # accents stripped, NFKC folding ("ß" -> "ss", "ﬁ" -> "fi"), punctuation split off.
  assert small.encode("Café Straße ﬁne.") == _ids(small, "cafe", "strasse", "fine", ".")
  assert small.encode("abc") == _ids(small, "a", "##b", "##c")
  assert small.encode("日本") == _ids(small, "日", "本")            # CJK: one word each
  assert small.encode("unknownword") == [small.unk_id]               # no piece matches
  assert small.encode("abz") == [small.unk_id]                       # whole word, not "a ##b [UNK]"
  assert small.encode("x" * 100) == _ids(small, "x") + _ids(small, "##x") * 99
  assert small.encode("x" * 101) == [small.unk_id]                   # > 100 bytes
  assert small.encode("[CLS]") == [small.unk_id, small.unk_id, small.unk_id]  # "[", "cls", "]"
  cased = WordPieceVocabulary(small.vocab_file, lower_case=False)
  assert cased.encode("Hello hello") == _ids(small, "Hello", "hello")
  assert cased.encode("Café") == [small.unk_id]


@pytest.mark.parametrize("lower", [True, False])
def test_python_and_tensorflow_paths_agree(small_vocab_file, lower):
  vocab = WordPieceVocabulary(small_vocab_file, lower_case=lower)
  batch = vocab.encode_tf(tf.constant(TRICKY)).to_list()
  for text, from_batch in zip(TRICKY, batch):
    python = vocab.encode(text)
    scalar = vocab.encode_tf(tf.constant(text))
    assert scalar.dtype == tf.int32 and scalar.shape.rank == 1
    assert python == scalar.numpy().tolist() == from_batch, text


def test_decode_python_and_tensorflow_agree(small):
  ids = _ids(small, "hello", ",", "world", "##s", "!") + [0, 0]
  assert small.decode(ids) == "hello , worlds !"
  assert small.decode_tf(tf.constant(ids)).numpy().decode() == "hello , worlds !"
  batch = tf.constant([ids, _ids(small, "un", "##aff", "##able") + [0] * 4])
  assert [s.decode() for s in small.decode_tf(batch).numpy()] == ["hello , worlds !",
                                                                  "unaffable"]
  ragged = tf.ragged.constant([ids[:3], [], _ids(small, "##s", "a")])
  assert [s.decode() for s in small.decode_tf(ragged).numpy()] == ["hello , world", "",
                                                                   "##s a"]
  assert small.decode([]) == small.decode_tf(tf.constant([], tf.int32)).numpy().decode() == ""
  # seqio maps ids beyond the vocabulary to [UNK] (both paths).
  assert small.decode([7, 1000]) == "hello [UNK]"
  assert small.decode_tf(tf.constant([7, 1000])).numpy().decode() == "hello [UNK]"


def test_bad_vocabularies_are_rejected(tmp_path):
  def write(tokens):
    path = tmp_path / f"v{len(list(tmp_path.iterdir()))}.txt"
    path.write_text("\n".join(tokens) + "\n", encoding="utf-8")
    return path

  with pytest.raises(ValueError, match=r"\[MASK\]"):
    WordPieceVocabulary(write([t for t in SMALL_VOCAB if t != "[MASK]"]))
  with pytest.raises(ValueError, match=r"\[PAD\] is id 1"):
    WordPieceVocabulary(write(["[unused9]"] + SMALL_VOCAB))
  with pytest.raises(ValueError, match="'hello' on lines 8 and 33"):
    WordPieceVocabulary(write(SMALL_VOCAB + ["hello"]))


def test_is_a_seqio_vocabulary(small, small_vocab_file):
  assert isinstance(small, seqio.Vocabulary)
  assert small == WordPieceVocabulary(small_vocab_file) != WordPieceVocabulary(
      small_vocab_file, lower_case=False)
  assert pickle.loads(pickle.dumps(small)) == small
  features = {"text": seqio.Feature(small, add_eos=False, dtype=tf.int32)}
  ds = tf.data.Dataset.from_tensor_slices({"text": ["Hello, worlds!", "the cafe"]})
  out = list(seqio.preprocessors.tokenize(ds, features).as_numpy_iterator())
  assert [o["text"].tolist() for o in out] == [small.encode("Hello, worlds!"),
                                                small.encode("the cafe")]
  assert out[0]["text_pretokenized"] == b"Hello, worlds!"


def _sweep_characters():
  """Every character assigned in Python's Unicode database except private use (category
  Co): 149,878 code points on Python 3.13 (Unicode 15.1)."""
  return [chr(c) for c in range(sys.maxunicode + 1)
          if unicodedata.category(chr(c)) not in ("Cn", "Co", "Cs")]


@pytest.mark.parametrize("lower", [True, False])
def test_basic_tokenizer_matches_tensorflow_text_on_every_assigned_character(lower):
  from tensorflow_text.python.ops.bert_tokenizer import BasicTokenizer  # noqa: PLC0415
  chars = _sweep_characters()
  strings = [f"a{ch}b" for ch in chars]
  tf_words = BasicTokenizer(lower_case=lower).tokenize(tf.constant(strings)).to_list()
  mismatches = [(hex(ord(ch)), [w.decode() for w in words])
                for ch, s, words in zip(chars, strings, tf_words)
                if wordpiece.basic_tokenize(s, lower) != [w.decode() for w in words]]
  assert not mismatches, mismatches[:20]


def test_real_bert_vocabulary():
  model_dir = minilm_dir()
  vocab = wordpiece.from_hf_checkpoint(model_dir)
  assert vocab.lower_case and vocab.vocab_size == 30522
  assert (vocab.pad_id, vocab.unk_id, vocab.cls_id, vocab.sep_id, vocab.mask_id) == (
      0, 100, 101, 102, 103)
  assert vocab.encode("Hello, world!") == [7592, 1010, 2088, 999]
  sentences = TRICKY + [
      "The quick brown fox jumps over the lazy dog.",
      "Der schnelle braune Fuchs springt über den faulen Hund.",
      "Příliš žluťoučký kůň úpěl ďábelské ódy.",
      "東京は日本の首都です。", "Привет, мир!", "مرحبا بالعالم", "transformers' positional encodings",
  ]
  batch = vocab.encode_tf(tf.constant(sentences)).to_list()
  for text, from_tf in zip(sentences, batch):
    ids = vocab.encode(text)
    assert ids == from_tf, text
    assert vocab.decode(ids) == vocab.decode_tf(tf.constant(ids, tf.int32)).numpy().decode()
  assert vocab.decode(vocab.encode("Transformers use positional encodings!")) == (
      "transformers use positional encodings !")
  assert np.all(np.array(vocab.encode(" ".join(sentences))) < vocab.vocab_size)
