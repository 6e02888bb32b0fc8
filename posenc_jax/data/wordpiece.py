"""BERT WordPiece vocabularies (a ``vocab.txt``) behind seqio's ``Vocabulary`` interface.

``WordPieceVocabulary(path, lower_case=True)`` reads a BERT ``vocab.txt`` (one token a line,
id = line number, e.g. ``posenc_jax.convert.hf_bert.vocab_path(model_dir)`` of an imported
checkpoint) and tokenises as BERT does, in TensorFlow with ``tensorflow_text.BertTokenizer``
(``encode_tf``/``decode_tf``, what seqio's preprocessors call) and in pure Python
(``encode``/``decode``) with the same rules, so the two paths give the same ids:

1. (``lower_case``) Unicode NFKC case folding (``"Straße"`` -> ``"strasse"``, ``"ﬁ"`` ->
   ``"fi"``, default-ignorable characters such as U+00AD and U+200B removed), NFD, and
   removal of combining marks (category Mn: accents);
2. control and format characters (categories Cc, Cf) become spaces;
3. words are split at ASCII whitespace (``\\t \\n \\f \\r`` and space; other Unicode spaces
   split only after the NFKC folding of step 1 maps them to a space), and every punctuation
   character (category P, or ASCII ``!-/ :-@ [-` {-~``) and CJK ideograph is a word of its own;
4. each word becomes the greedy longest-match-first WordPiece split (continuations carry
   ``##``); a word longer than ``max_bytes_per_word`` UTF-8 bytes, or with a part that no
   piece matches, becomes ``[UNK]``.

The two paths agree on every character assigned in Python's Unicode database (15.1 on
Python 3.13; the tests sweep all 149,878 of them); characters assigned in later Unicode
versions, which TensorFlow's ICU/RE2 tables may know, can differ.

The special tokens are looked up by name: ``[PAD]`` must be id 0 (seqio's padding id; BERT
vocabularies have it there), and ``[UNK]``, ``[CLS]``, ``[SEP]``, ``[MASK]`` must exist
(``unk_id``, ``cls_id``, ``sep_id``, ``mask_id``; 100, 101, 102, 103 in BERT's English
vocabularies). BERT has no end-of-sequence token, so ``eos_id`` is None: features over this
vocabulary take ``add_eos=False``. Literal ``"[CLS]"`` in text is tokenised as ``[``,
``cls``, ``]`` (special tokens are added by id, never parsed from text).

Decoding drops ``[PAD]``, joins the tokens with spaces and glues ``##`` continuations to
the preceding token: ``decode(encode("Hello, world!"))`` is ``"hello , world !"``. Like
BERT's, the tokenisation does not round-trip exactly (case, accents, spacing).
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import unicodedata
from collections.abc import Iterable, Sequence

import seqio
import tensorflow as tf

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
SUFFIX = "##"

# Unicode Default_Ignorable_Code_Point (DerivedCoreProperties.txt): NFKC case folding maps
# these to nothing. Inclusive ranges.
_DEFAULT_IGNORABLE = (
    (0x00AD, 0x00AD), (0x034F, 0x034F), (0x061C, 0x061C), (0x115F, 0x1160),
    (0x17B4, 0x17B5), (0x180B, 0x180F), (0x200B, 0x200F), (0x202A, 0x202E),
    (0x2060, 0x206F), (0x3164, 0x3164), (0xFE00, 0xFE0F), (0xFEFF, 0xFEFF),
    (0xFFA0, 0xFFA0), (0xFFF0, 0xFFF8), (0x1BCA0, 0x1BCA3), (0x1D173, 0x1D17A),
    (0xE0000, 0xE0FFF),
)
# The ideograph blocks tensorflow_text's BERT tokenizer splits into single characters.
_CJK = (
    (0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
    (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F),
)
_ASCII_PUNCT = ((0x21, 0x2F), (0x3A, 0x40), (0x5B, 0x60), (0x7B, 0x7E))
_WHITESPACE = frozenset("\t\n\f\r ")


def _in(ranges, code: int) -> bool:
  return any(lo <= code <= hi for lo, hi in ranges)


def _is_split_char(ch: str) -> bool:
  """Punctuation or CJK ideograph: a word of its own."""
  code = ord(ch)
  return (_in(_ASCII_PUNCT, code) or unicodedata.category(ch).startswith("P")
          or _in(_CJK, code))


def lower_case(text: str) -> str:
  """NFKC case folding, NFD, combining marks (Mn) removed (step 1 of the module docstring)."""
  text = "".join(ch for ch in text if not _in(_DEFAULT_IGNORABLE, ord(ch)))
  text = unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", text).casefold())
  text = unicodedata.normalize("NFD", text)
  return "".join(ch for ch in text if unicodedata.category(ch) != "Mn")


def basic_tokenize(text: str, lower: bool) -> list[str]:
  """Steps 1-3 of the module docstring: the words WordPiece splits."""
  if lower:
    text = lower_case(text)
  words, current = [], []
  for ch in text:
    if unicodedata.category(ch) in ("Cc", "Cf"):
      ch = " "
    if ch in _WHITESPACE or _is_split_char(ch):
      if current:
        words.append("".join(current))
        current = []
      if ch not in _WHITESPACE:
        words.append(ch)
    else:
      current.append(ch)
  if current:
    words.append("".join(current))
  return words


def read_vocab(path: str | os.PathLike) -> list[str]:
  """The tokens of a ``vocab.txt``, one a line (the line without its ``\\n``), in id order."""
  with tf.io.gfile.GFile(str(path), "rb") as f:
    lines = f.read().decode("utf-8").split("\n")
  if lines and lines[-1] == "":
    lines.pop()
  return lines


class WordPieceVocabulary(seqio.Vocabulary):
  """A BERT ``vocab.txt`` as a ``seqio.Vocabulary`` (module docstring for the rules).

  Args:
    vocab_file: the ``vocab.txt`` (a local path or anything ``tf.io.gfile`` reads).
    lower_case: lower-case and strip accents first (uncased BERT models; their
      ``tokenizer_config.json`` has ``"do_lower_case": true``).
    max_bytes_per_word: longer words become ``[UNK]`` (tensorflow_text's default).
  """

  def __init__(self, vocab_file: str | os.PathLike, lower_case: bool = True,
               max_bytes_per_word: int = 100):
    self._vocab_file = str(vocab_file)
    self._lower_case = bool(lower_case)
    self._max_bytes_per_word = int(max_bytes_per_word)
    self._tokens = read_vocab(vocab_file)
    self._ids = {}
    for i, token in enumerate(self._tokens):
      if token in self._ids:
        raise ValueError(f"{self._vocab_file}: token {token!r} on lines {self._ids[token] + 1} "
                         f"and {i + 1}")
      self._ids[token] = i
    missing = [t for t in SPECIAL_TOKENS if t not in self._ids]
    if missing:
      raise ValueError(f"{self._vocab_file}: no {', '.join(missing)} token")
    if self._ids["[PAD]"] != seqio.vocabularies.PAD_ID:
      raise ValueError(f"{self._vocab_file}: [PAD] is id {self._ids['[PAD]']}; seqio needs "
                       f"id {seqio.vocabularies.PAD_ID}")
    self._max_chars = max(len(t[len(SUFFIX):] if t.startswith(SUFFIX) else t)
                          for t in self._tokens)
    super().__init__(extra_ids=0)

  # --- ids ---------------------------------------------------------------------------------

  @property
  def tokens(self) -> Sequence[str]:
    """The vocabulary, in id order."""
    return tuple(self._tokens)

  @property
  def vocab_file(self) -> str:
    return self._vocab_file

  @property
  def lower_case(self) -> bool:
    return self._lower_case

  def token_to_id(self, token: str) -> int:
    """The id of a token (``KeyError`` if absent)."""
    return self._ids[token]

  @property
  def eos_id(self) -> None:
    return None

  @property
  def bos_id(self) -> None:
    return None

  @property
  def unk_id(self) -> int:
    return self._ids["[UNK]"]

  @property
  def cls_id(self) -> int:
    return self._ids["[CLS]"]

  @property
  def sep_id(self) -> int:
    return self._ids["[SEP]"]

  @property
  def mask_id(self) -> int:
    return self._ids["[MASK]"]

  @property
  def _base_vocab_size(self) -> int:
    return len(self._tokens)

  # --- Python path -------------------------------------------------------------------------

  def _wordpiece(self, word: str) -> list[int]:
    if len(word.encode("utf-8")) > self._max_bytes_per_word:
      return [self.unk_id]
    pieces, start = [], 0
    while start < len(word):
      for end in range(min(len(word), start + self._max_chars), start, -1):
        piece = word[start:end] if start == 0 else SUFFIX + word[start:end]
        if piece in self._ids:
          pieces.append(self._ids[piece])
          start = end
          break
      else:
        return [self.unk_id]
    return pieces

  def _encode(self, s: str | bytes) -> list[int]:
    if isinstance(s, bytes):
      s = s.decode("utf-8")
    return [i for word in basic_tokenize(s, self._lower_case) for i in self._wordpiece(word)]

  def _decode(self, ids: Iterable[int]) -> str:
    size = len(self._tokens)
    tokens = [self._tokens[i] if 0 <= i < size else "[UNK]"
              for i in (int(i) for i in ids) if i != self.pad_id]
    return " ".join(tokens).replace(" " + SUFFIX, "").strip(" ")

  # --- TensorFlow path ---------------------------------------------------------------------

  def tf_tokenizer(self):
    """A fresh ``tensorflow_text.BertTokenizer`` over this vocabulary (per call, as seqio
    does for SentencePiece, so each graph owns its lookup table)."""
    import tensorflow_text as tf_text  # noqa: PLC0415
    table = tf.lookup.StaticVocabularyTable(
        tf.lookup.KeyValueTensorInitializer(
            tf.constant(self._tokens, tf.string),
            tf.range(len(self._tokens), dtype=tf.int64)),
        num_oov_buckets=1)
    return tf_text.BertTokenizer(
        table, suffix_indicator=SUFFIX, max_bytes_per_word=self._max_bytes_per_word,
        token_out_type=tf.int64, unknown_token="[UNK]",
        lower_case=self._lower_case)

  def _encode_tf(self, s: tf.Tensor) -> tf.Tensor | tf.RaggedTensor:
    """A string scalar -> int32 ``[n]``; a string tensor -> int32 ragged ``[..., (n)]``."""
    s = tf.convert_to_tensor(s, tf.string)
    tokenizer = self.tf_tokenizer()
    if s.shape.rank == 0:
      return tf.cast(tokenizer.tokenize(tf.reshape(s, [1])).flat_values, tf.int32)
    return tf.cast(tokenizer.tokenize(s).merge_dims(-2, -1), tf.int32)

  def _decode_tf(self, ids: tf.Tensor | tf.RaggedTensor) -> tf.Tensor:
    """int ``[n]`` -> string scalar; ``[B, n]`` (dense or ragged) -> string ``[B]``."""
    if isinstance(ids, tf.RaggedTensor):
      rows = tf.ragged.boolean_mask(ids, ids != self.pad_id)
      scalar = False
    else:
      ids = tf.convert_to_tensor(ids)
      scalar = ids.shape.rank == 1
      rows = tf.ragged.boolean_mask(ids[None] if scalar else ids,
                                    (ids[None] if scalar else ids) != self.pad_id)
    words = self.tf_tokenizer().detokenize(tf.cast(rows, tf.int64))
    text = tf.strings.reduce_join(words, axis=-1, separator=" ")
    return text[0] if scalar else text

  # --- identity ----------------------------------------------------------------------------

  def __eq__(self, other) -> bool:
    return (isinstance(other, WordPieceVocabulary) and self._tokens == other._tokens
            and self._lower_case == other._lower_case
            and self._max_bytes_per_word == other._max_bytes_per_word)

  def __hash__(self) -> int:
    return hash((tuple(self._tokens), self._lower_case, self._max_bytes_per_word))

  def __str__(self) -> str:
    digest = hashlib.md5("\n".join(self._tokens).encode("utf-8")).hexdigest()
    return (f"WordPieceVocabulary(file={self._vocab_file}, size={len(self._tokens)}, "
            f"lower_case={self._lower_case}, md5={digest})")


def from_hf_checkpoint(model_dir: str | os.PathLike) -> WordPieceVocabulary:
  """The ``vocab.txt`` of a Hugging Face BERT folder, lower-cased as its
  ``tokenizer_config.json`` says (``do_lower_case``, default True as in BERT)."""
  import json  # noqa: PLC0415
  model_dir = pathlib.Path(model_dir)
  config_path = model_dir / "tokenizer_config.json"
  config = json.loads(config_path.read_text()) if config_path.is_file() else {}
  return WordPieceVocabulary(model_dir / "vocab.txt",
                             lower_case=config.get("do_lower_case", True))
