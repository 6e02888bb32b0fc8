"""The bundled long-document corpus: the Python 3.13.0 standard library's source, as bytes.

Real, long, license-clean documents for length extrapolation (Press et al. 2022 score a
model at up to 16x its training length, which needs documents longer than that, not
unrelated lines packed together). Each document is one ``.py`` file of CPython 3.13.0's
``Lib/`` (PSF License Agreement, ``bundled/stdlib/LICENSE``), code and docstrings as written:

    files          275 (every ``.py`` of at least 4,096 bytes outside ``test*``, ``idlelib``,
                   ``encodings``, ``pydoc_data``, ``turtledemo``, ``ensurepip``, ``unittest``,
                   ``venv``, ``lib2to3`` and ``site-packages``)
    bytes          7,881,894 (the tokens: one per byte)
    median file    16,242 bytes
    split          a stable hash of the path (first 8 bytes of SHA-256, modulo 1000): below 50
                   ``validation`` (about 5%), the rest ``train``

The file ``bundled/stdlib/stdlib_py313.jsonl.xz`` holds one JSON object per line,
``{"path", "split", "text"}``, in path order; its decompressed content has the SHA-256
:data:`CONTENT_SHA256`, checked on every read. ``scripts/make_stdlib_corpus.py`` rebuilds it,
byte-identical, from a Python 3.13.0 installation.

Tokens are UTF-8 bytes through ``seqio.ByteVocabulary`` (ids 0 pad, 1 EOS, 2 unk, byte
``b`` is ``b + 3``: :data:`VOCAB_SIZE` ids), which a tiny model learns from in minutes and
which no vocabulary choice can bias between schemes. The causal-LM task ``python_stdlib_lm``
(:mod:`posenc_jax.data.causal_lm`) packs the documents ``doc_1 EOS doc_2 EOS ...``.

This module reads the corpus with the standard library only (no TensorFlow)::

    docs = documents("validation")                 # [Document(path, split, text), ...]
    content_sha256()                               # the pinned hash, after checking it
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import lzma
import pathlib

CORPUS_DIR = pathlib.Path(__file__).resolve().parent / "bundled" / "stdlib"
CORPUS_FILE = CORPUS_DIR / "stdlib_py313.jsonl.xz"
# SHA-256 of the decompressed JSON lines: the corpus every published table was measured on.
CONTENT_SHA256 = "60056cf508adc28c2fc699b4a6d2b06c32d210c148e5e753e02ed8ec90aaf080"
SPLITS = ("train", "validation")
VALIDATION_BUCKETS = 50  # of 1000: about 5% of the files
# seqio.ByteVocabulary(): 3 special ids (pad, EOS, unk) and the 256 bytes.
VOCAB_SIZE = 259
TASK = "python_stdlib_lm"


class CorpusError(ValueError):
  """The corpus file is missing, damaged or not the pinned one (one line naming the file)."""


@dataclasses.dataclass(frozen=True)
class Document:
  """One source file: ``path`` relative to ``Lib/``, its ``split`` and its ``text``."""

  path: str
  split: str
  text: str


def split_of(path: str) -> str:
  """The fixed split of a file: ``validation`` when the first 8 bytes of SHA-256 of its path,
  modulo 1000, are below :data:`VALIDATION_BUCKETS`; else ``train``."""
  bucket = int.from_bytes(hashlib.sha256(path.encode()).digest()[:8], "big") % 1000
  return "validation" if bucket < VALIDATION_BUCKETS else "train"


def _content(path: pathlib.Path) -> bytes:
  """The decompressed corpus file, or one :class:`CorpusError` line naming it."""
  try:
    return lzma.decompress(path.read_bytes())
  except FileNotFoundError:
    raise CorpusError(f"corpus: {path} is missing (reinstall posenc-jax, or rebuild it with "
                      "scripts/make_stdlib_corpus.py)") from None
  except (OSError, lzma.LZMAError) as e:
    raise CorpusError(f"corpus: {path} is damaged ({e}); reinstall posenc-jax") from None


def content_sha256(path: str | pathlib.Path | None = None,
                   expected: str | None = CONTENT_SHA256) -> str:
  """The SHA-256 of the corpus file's decompressed content (``path``, default
  :data:`CORPUS_FILE`), after checking it equals ``expected`` (None: not checked)."""
  return _read(str(path or CORPUS_FILE), expected)[0]


def documents(split: str, path: str | pathlib.Path | None = None,
              expected: str | None = CONTENT_SHA256) -> list[Document]:
  """The documents of ``split`` (``train`` or ``validation``) of the corpus file ``path``
  (default :data:`CORPUS_FILE`), in path order.

  Raises:
    CorpusError: one line naming the file (missing, damaged, another hash) or the split.
  """
  if split not in SPLITS:
    raise CorpusError(f"split: got {split!r}; allowed: {', '.join(SPLITS)}")
  return [d for d in _read(str(path or CORPUS_FILE), expected)[1] if d.split == split]


@functools.lru_cache(maxsize=4)
def _read(path: str, expected: str | None) -> tuple[str, tuple[Document, ...]]:
  content = _content(pathlib.Path(path))
  digest = hashlib.sha256(content).hexdigest()
  if expected is not None and digest != expected:
    raise CorpusError(f"corpus: {path} has content SHA-256 {digest[:16]}..., not the pinned "
                      f"{expected[:16]}...; reinstall posenc-jax")
  docs = []
  for number, line in enumerate(content.decode("utf-8").splitlines(), 1):
    try:
      record = json.loads(line)
      doc = Document(str(record["path"]), str(record["split"]), str(record["text"]))
    except (ValueError, KeyError, TypeError) as e:
      raise CorpusError(f"corpus: {path} line {number} is no corpus record ({e})") from None
    if doc.split != split_of(doc.path):
      raise CorpusError(f"corpus: {path} line {number}: {doc.path} is in split {doc.split!r}, "
                        f"its hash says {split_of(doc.path)!r}")
    docs.append(doc)
  return digest, tuple(docs)
