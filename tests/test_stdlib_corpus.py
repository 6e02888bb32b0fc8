"""The bundled long-document corpus (the Python standard library's source) and its task."""

import hashlib
import importlib.util
import json
import lzma
import pathlib
import statistics

import numpy as np
import pytest

from posenc_jax.data import stdlib_corpus as corpus

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "make_stdlib_corpus.py"


def test_the_pinned_content_is_what_the_package_ships():
  content = lzma.decompress(corpus.CORPUS_FILE.read_bytes())
  assert hashlib.sha256(content).hexdigest() == corpus.CONTENT_SHA256
  assert corpus.content_sha256() == corpus.CONTENT_SHA256
  assert corpus.CORPUS_FILE.stat().st_size < 10 * 2**20
  licence = (corpus.CORPUS_DIR / "LICENSE").read_text()
  assert "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2" in licence
  assert corpus.CONTENT_SHA256 in (corpus.CORPUS_DIR / "README.md").read_text()


def test_size_and_document_lengths_fill_sixteen_times_the_training_length():
  train, validation = corpus.documents("train"), corpus.documents("validation")
  sizes = [len(d.text.encode()) for d in train + validation]
  assert sum(sizes) >= 5_000_000  # tokens: one per byte
  assert statistics.median(sizes) >= 4096
  assert min(sizes) >= 4096
  assert sum(len(d.text.encode()) for d in validation) >= 16 * 128 * 64  # 64 windows of 16x128


def test_the_split_is_fixed_disjoint_and_follows_the_path_hash():
  train, validation = corpus.documents("train"), corpus.documents("validation")
  assert (len(train), len(validation)) == (258, 17)
  paths = [d.path for d in train + validation]
  assert len(set(paths)) == len(paths)
  assert [d.path for d in train] == sorted(d.path for d in train)
  assert {d.split for d in train} == {"train"} and {d.split for d in validation} == {"validation"}
  for doc in train[:20] + validation:
    bucket = int.from_bytes(hashlib.sha256(doc.path.encode()).digest()[:8], "big") % 1000
    assert (bucket < 50) == (doc.split == "validation")
  assert "argparse.py" in [d.path for d in train + validation]


def test_reading_is_deterministic():
  first = corpus.documents("validation")
  corpus._read.cache_clear()
  assert corpus.documents("validation") == first


def _write(path, records):
  path.write_bytes(lzma.compress("".join(json.dumps(r) + "\n" for r in records).encode()))
  return path


@pytest.mark.parametrize("damage, message", [
    ("missing", "is missing"),
    ("truncated", "is damaged"),
    ("other content", "not the pinned"),
])
def test_a_missing_damaged_or_other_corpus_is_one_line_naming_the_file(tmp_path, damage, message):
  path = tmp_path / "corpus.jsonl.xz"
  if damage == "truncated":
    path.write_bytes(corpus.CORPUS_FILE.read_bytes()[:1000])
  elif damage == "other content":
    _write(path, [{"path": "a.py", "split": corpus.split_of("a.py"), "text": "x = 1\n"}])
  with pytest.raises(corpus.CorpusError) as error:
    corpus.documents("train", path)
  text = str(error.value)
  assert "\n" not in text and str(path) in text and message in text


def test_foreign_records_and_splits_are_one_line(tmp_path):
  path = _write(tmp_path / "c.xz", [{"path": "a.py", "text": "x"}])
  with pytest.raises(corpus.CorpusError, match=r"line 1 is no corpus record"):
    corpus.documents("train", path, expected=None)
  wrong = "validation" if corpus.split_of("a.py") == "train" else "train"
  path = _write(tmp_path / "d.xz", [{"path": "a.py", "split": wrong, "text": "x"}])
  with pytest.raises(corpus.CorpusError, match=r"a.py is in split"):
    corpus.documents("train", path, expected=None)
  with pytest.raises(corpus.CorpusError, match=r"^split: got 'test'; allowed: train, validation$"):
    corpus.documents("test")


def test_the_build_script_keeps_long_library_files_only(tmp_path):
  spec = importlib.util.spec_from_file_location("make_stdlib_corpus", SCRIPT)
  script = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(script)
  long, short = "x = 1\n" * 1000, "x = 1\n"
  for path, text in [("argparse.py", long), ("abc.py", short), ("email/parser.py", long),
                     ("test/test_x.py", long), ("tests/t.py", long), ("encodings/cp1.py", long),
                     ("idlelib/a.py", long), ("config-3.13-x86_64-linux-gnu/b.py", long),
                     ("notes.txt", long)]:
    (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / path).write_text(text)
  assert script.source_files(tmp_path) == ["argparse.py", "email/parser.py"]


def test_the_task_packs_the_documents_as_bytes_with_eos():
  import seqio

  from posenc_jax.data import causal_lm  # noqa: F401 - registers the task

  task = seqio.get_mixture_or_task(corpus.TASK)
  assert task.output_features["targets"].vocabulary.vocab_size == corpus.VOCAB_SIZE
  first = corpus.documents("validation")[0].text.encode()
  examples = list(causal_lm.packed_epoch(corpus.TASK, "validation", 256).take(2)
                  .as_numpy_iterator())
  stream = np.concatenate([e["targets"] for e in examples])
  assert stream.shape == (512,)
  np.testing.assert_array_equal(stream[:512], np.frombuffer(first[:512], np.uint8) + 3)
  second = corpus.documents("validation")[1].text.encode()
  whole = np.concatenate([e["targets"] for e in causal_lm.packed_epoch(
      corpus.TASK, "validation", 1024).as_numpy_iterator()])
  boundary = len(first)
  assert whole[boundary] == 1  # EOS after the first document
  np.testing.assert_array_equal(whole[boundary + 1:boundary + 65],
                                np.frombuffer(second[:64], np.uint8) + 3)
  tokens = sum(len(d.text.encode()) + 1 for d in corpus.documents("validation"))
  assert causal_lm.epoch_length(corpus.TASK, "validation", 1024) == -(-tokens // 1024)


@pytest.mark.parametrize("task, key", [("pg19_lm", "book_text"), ("c4_en_lm", "text")])
def test_tfds_corpora_pack_whole_documents_as_bytes(task, key):
  """PG-19 and C4 as causal-LM tasks, under ``tfds.testing.mock_data`` (offline)."""
  import seqio
  import tensorflow as tf

  from posenc_jax.data import causal_lm
  from tests import tfds_mock

  texts = ["first book, long enough", "second"]

  def documents(builder, split, *args, **kwargs):
    return tf.data.Dataset.from_tensor_slices({key: texts})

  with tfds_mock.mock_tfds(2, documents):
    packed = list(causal_lm.packed_epoch(task, "validation", 16).as_numpy_iterator())
  stream = np.concatenate([e["targets"] for e in packed])
  expected = np.concatenate([np.frombuffer(texts[0].encode(), np.uint8) + 3, [1],
                             np.frombuffer(texts[1].encode(), np.uint8) + 3, [1]])
  np.testing.assert_array_equal(stream[:len(expected)], expected)
  assert not stream[len(expected):].any()  # the last example's padding
  assert seqio.get_mixture_or_task(task).output_features["targets"].vocabulary.vocab_size == 259


def test_a_damaged_corpus_stops_training_in_one_user_error_line(tmp_path, monkeypatch):
  """What train.py (and evaluate) check before compiling meets the corpus's CorpusError, one
  of the errors the tools print as one line."""
  from posenc_jax.configs.lm import get_config
  from posenc_jax.data import causal_lm  # noqa: F401 - registers the task
  from posenc_jax.training.errors import USER_ERRORS
  from posenc_jax.training.input_pipeline import check_examples

  damaged = tmp_path / "stdlib_py313.jsonl.xz"
  damaged.write_bytes(corpus.CORPUS_FILE.read_bytes()[:5000])
  monkeypatch.setattr(corpus, "CORPUS_FILE", damaged)
  corpus._read.cache_clear()
  try:
    with pytest.raises(USER_ERRORS) as error:
      check_examples(get_config("bert_tiny,rope,stdlib"))
  finally:
    corpus._read.cache_clear()
  assert isinstance(error.value, corpus.CorpusError)
  assert str(error.value).startswith(f"corpus: {damaged} is damaged") and "\n" not in str(
      error.value)
