"""SentencePiece vocabularies with the special pieces masked-LM pre-training needs.

Every vocabulary :func:`train` makes has the same reserved ids, so the model, the data pipeline
and the tests can name them as constants:

    0  <pad>    PAD_ID   (seqio's padding id)
    1  </s>     EOS_ID   (seqio's end of sequence)
    2  <unk>    UNK_ID
    3  [CLS]    CLS_ID   first token of every pre-training sequence
    4  [SEP]    SEP_ID   between packed lines
    5  [MASK]   MASK_ID  the masked-LM replacement
    6 ...       learned pieces (unigram model)

There is no BOS. ``[CLS]``, ``[SEP]`` and ``[MASK]`` are user-defined pieces: SentencePiece
always encodes the literal strings ``"[CLS]"``, ``"[SEP]"``, ``"[MASK]"`` in text as those ids.

Training (:func:`train`, on lines of text) is deterministic: one thread, a fixed random seed,
and at most ``input_sentence_size`` lines (sampled with that seed when the input has more);
the tool ``python -m posenc_jax.train_vocab`` trains from files or a registered task.
``vocabulary(path)`` loads a model as a ``seqio.SentencePieceVocabulary``.
"""

import io
import os
import pathlib
from collections.abc import Iterable

PAD_ID, EOS_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = range(6)
NUM_RESERVED = 6
SPECIAL_PIECES = {"<pad>": PAD_ID, "</s>": EOS_ID, "<unk>": UNK_ID, "[CLS]": CLS_ID,
                  "[SEP]": SEP_ID, "[MASK]": MASK_ID}

BUNDLED_DIR = pathlib.Path(__file__).resolve().parent / "bundled" / "wordnet"
BUNDLED_VOCAB = BUNDLED_DIR / "spm8k.model"


def train(lines: Iterable[str], output: str | os.PathLike, vocab_size: int,
          input_sentence_size: int = 2_000_000, seed: int = 0,
          character_coverage: float = 1.0) -> pathlib.Path:
  """Trains a unigram SentencePiece model on ``lines``; returns the ``<output>.model`` path.

  Args:
    lines: training text, one sentence or paragraph per item (empty ones are skipped).
    output: path prefix; ``<output>.model`` and ``<output>.vocab`` are written.
    vocab_size: pieces in total, the six reserved ones included.
    input_sentence_size: at most this many lines are used (a seeded sample of them if more).
    seed: SentencePiece's random seed (sampling and training).
    character_coverage: fraction of the characters in the text that the alphabet covers; the
      rarest beyond it map to ``<unk>``. 1.0 (every character) suits small alphabets such
      as the ASCII WordNet text; SentencePiece suggests 0.9995 for large ones.
  """
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  output = pathlib.Path(output)
  output.parent.mkdir(parents=True, exist_ok=True)
  spm.set_random_generator_seed(seed)
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=(line for line in lines if line.strip()),
      model_writer=model,
      model_type="unigram",
      vocab_size=vocab_size,
      character_coverage=character_coverage,
      input_sentence_size=input_sentence_size,
      shuffle_input_sentence=True,
      num_threads=1,
      pad_id=PAD_ID, pad_piece="<pad>",
      eos_id=EOS_ID, eos_piece="</s>",
      unk_id=UNK_ID, unk_piece="<unk>",
      bos_id=-1,
      user_defined_symbols=["[CLS]", "[SEP]", "[MASK]"],
      minloglevel=2,
  )
  model_path = output.with_name(output.name + ".model")
  model_path.write_bytes(model.getvalue())
  processor = spm.SentencePieceProcessor(model_proto=model.getvalue())
  check_special_ids(processor)
  with open(output.with_name(output.name + ".vocab"), "w", encoding="utf-8") as f:
    for i in range(processor.get_piece_size()):
      f.write(f"{processor.id_to_piece(i)}\t{processor.get_score(i):g}\n")
  return model_path


def check_special_ids(processor) -> None:
  """Raises ``ValueError`` unless a ``SentencePieceProcessor`` has the reserved ids above."""
  got = {piece: processor.piece_to_id(piece) for piece in SPECIAL_PIECES}
  if got != SPECIAL_PIECES:
    raise ValueError(f"SentencePiece model has special ids {got}; expected {SPECIAL_PIECES}")


def vocabulary(path: str | os.PathLike = BUNDLED_VOCAB):
  """A ``seqio.SentencePieceVocabulary`` (no extra ids) of a model trained by :func:`train`.

  Raises ``ValueError`` if the model lacks the reserved ids of this module's docstring.
  """
  import seqio  # pylint: disable=g-import-not-at-top
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  check_special_ids(spm.SentencePieceProcessor(model_file=str(path)))
  return seqio.SentencePieceVocabulary(str(path))
