"""Extractive QA spans: features with a document stride, and logits back to answer text.

``featurize(tokenizer, question, context, answers)`` turns one SQuAD-style example into one
or more fixed-length features (BERT's recipe). ``max_seq_len`` is ``L``; with ``q`` question
tokens (at most ``max_query_len``, the rest cut) each window holds up to ``L - q - 3``
context tokens, and successive windows start ``doc_stride`` tokens apart (the last window
ends at the context's end; a context that fits makes one window)::

    input_ids      [CLS] question [SEP] context window [SEP] 0 ...     int32 [n, L]
    segment_ids    0 for [CLS] question [SEP], 1 for the window and its [SEP], 0 padding
    mask           1 at real tokens, 0 padding
    start_positions, end_positions   int32 [n]: the answer's first and last token in the
                   window (both inside it), else 0 ([CLS]) when the answer is not wholly in it
    token_offsets  int32 [n, L, 2]: ``[begin, end)`` character offsets in ``context`` of each
                   context token (whitespace excluded), ``-1`` for every other position
    max_context    int32 [n, L]: 1 where this window gives the token its most context
                   (BERT's ``min(left, right) + 0.01 * window length``, first window on ties)

The answer is the first of ``answers`` (pairs ``(text, answer_start)``, character offsets)
whose span lies inside the context and equals its text; its first token is the one holding
its first character, its last token the one holding its last character.

Post-processing (``best_span``, ``predict_answers``) is BERT's: over all features of an
example take the ``n_best`` highest start and end logits of each, keep pairs of context
tokens with ``start <= end``, at most ``max_answer_len`` tokens long and a start token whose
window is its max-context one, and answer the highest ``start + end`` logit sum. The text is
sliced from the original context by character offsets, so it keeps the context's spacing,
case and punctuation; an answer that starts or ends inside a token comes back as the whole
token. No valid pair gives the empty answer. As in BERT, the max-context rule can lose an
answer whose first token has more context in a window that cannot hold the answer's end;
that needs an answer longer than about ``(window - doc_stride) / 2`` tokens (~94 at
XTREME's 384/128, beyond ``max_answer_len``), so only very small test windows meet it.

Tokenisers are anything with ``cls_id``, ``sep_id``, ``pad_id`` and ``tokenize(text) ->
(ids, offsets)`` with character offsets (``Tokenizer``). ``SentencePieceTokenizer`` wraps a
SentencePiece model (the bundled ``spm8k`` by default); a WordPiece tokenizer with offsets
plugs in the same way.
"""

import dataclasses
import functools
import os
from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np

from posenc_jax.data.vocab import BUNDLED_VOCAB, CLS_ID, PAD_ID, SEP_ID

FEATURE_KEYS = ("input_ids", "segment_ids", "mask", "start_positions", "end_positions",
                "token_offsets", "max_context")
DEFAULT_MAX_SEQ_LEN, DEFAULT_DOC_STRIDE, DEFAULT_MAX_QUERY_LEN = 384, 128, 64
DEFAULT_N_BEST, DEFAULT_MAX_ANSWER_LEN = 20, 30


class Tokenizer(Protocol):
  """What featurisation needs from a tokenizer."""

  cls_id: int
  sep_id: int
  pad_id: int

  def tokenize(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids and, per token, ``[begin, end)`` offsets into ``text`` in characters.

    Offsets exclude surrounding whitespace; a token that stands for no character (e.g. a
    lone word-boundary piece) has ``begin == end``.
    """


def _byte_to_char(text: str) -> list[int]:
  """For each UTF-8 byte offset of ``text`` (and its end), the character index it lies in."""
  table = []
  for i, ch in enumerate(text):
    table.extend([i] * len(ch.encode("utf-8")))
  table.append(len(text))
  return table


def trim_whitespace(text: str, begin: int, end: int) -> tuple[int, int]:
  """``[begin, end)`` without leading and trailing whitespace (``(end, end)`` if all of it)."""
  while begin < end and text[begin].isspace():
    begin += 1
  while end > begin and text[end - 1].isspace():
    end -= 1
  return begin, end


@dataclasses.dataclass(frozen=True, eq=False)
class SentencePieceTokenizer:
  """A SentencePiece model as a ``Tokenizer`` (its pieces' byte spans become characters).

  Attributes:
    model: a ``.model`` path or the serialised model proto (``bytes``).
  """

  model: str | os.PathLike | bytes = BUNDLED_VOCAB
  cls_id: int = CLS_ID
  sep_id: int = SEP_ID
  pad_id: int = PAD_ID

  @functools.cached_property
  def processor(self):
    import sentencepiece as spm  # pylint: disable=g-import-not-at-top
    if isinstance(self.model, bytes):
      return spm.SentencePieceProcessor(model_proto=self.model)
    return spm.SentencePieceProcessor(model_file=str(self.model))

  def tokenize(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    pieces = self.processor.encode(text, return_type="proto").pieces
    ids = [p.id for p in pieces]
    if text.isascii():
      spans = [(p.begin, p.end) for p in pieces]
    else:
      table = _byte_to_char(text)
      spans = [(table[p.begin], table[p.end - 1] + 1 if p.end > p.begin else table[p.begin])
               for p in pieces]
    return ids, [trim_whitespace(text, b, e) for b, e in spans]


@functools.lru_cache(maxsize=8)
def sentencepiece_tokenizer(model: str | bytes = str(BUNDLED_VOCAB)) -> SentencePieceTokenizer:
  """A cached ``SentencePieceTokenizer`` per model path or proto."""
  return SentencePieceTokenizer(model)


# ------------------------------------------------------------------------------ featurisation


def windows(num_tokens: int, window_len: int, doc_stride: int) -> list[tuple[int, int]]:
  """``(start, length)`` of each window over ``num_tokens`` context tokens (BERT's doc spans).

  Windows start ``min(length, doc_stride)`` tokens after the previous one until one reaches
  the end; an empty context has one empty window.
  """
  if window_len < 1 or doc_stride < 1:
    raise ValueError(f"window_len {window_len} and doc_stride {doc_stride} must be >= 1")
  spans, start = [], 0
  while True:
    length = min(window_len, num_tokens - start)
    spans.append((start, length))
    if start + length >= num_tokens:
      return spans
    start += min(length, doc_stride)


def max_context_window(spans: Sequence[tuple[int, int]], position: int) -> int:
  """Index of the window in which ``position`` has the most context (first one on ties)."""
  best, best_score = -1, -1.0
  for i, (start, length) in enumerate(spans):
    if start <= position < start + length:
      score = min(position - start, start + length - 1 - position) + 0.01 * length
      if score > best_score:
        best, best_score = i, score
  return best


def answer_token_span(offsets: Sequence[tuple[int, int]], char_start: int, char_end: int
                      ) -> tuple[int, int] | None:
  """First and last token overlapping characters ``[char_start, char_end)``, or ``None``."""
  hits = [i for i, (b, e) in enumerate(offsets) if b < e and b < char_end and e > char_start]
  return (hits[0], hits[-1]) if hits else None


def _gold_char_span(context: str, answers: Sequence[tuple[str, int]]) -> tuple[int, int] | None:
  for text, start in answers:
    start, end = int(start), int(start) + len(text)
    if text and 0 <= start and end <= len(context) and context[start:end] == text:
      return start, end
  return None


def featurize(tokenizer: Tokenizer, question: str, context: str,
              answers: Sequence[tuple[str, int]] = (), *,
              max_seq_len: int = DEFAULT_MAX_SEQ_LEN, doc_stride: int = DEFAULT_DOC_STRIDE,
              max_query_len: int = DEFAULT_MAX_QUERY_LEN) -> dict[str, np.ndarray]:
  """One example's span features (module docstring), each with a leading axis of windows.

  Args:
    tokenizer: a ``Tokenizer``.
    question, context: the example's strings.
    answers: ``(text, answer_start)`` pairs; the first valid one gives the positions.
    max_seq_len: ``L``, tokens per feature.
    doc_stride: tokens between the starts of successive windows.
    max_query_len: question tokens kept (the rest is cut).

  Returns:
    ``{key: array}`` for ``FEATURE_KEYS``: int32, ``[n, L]`` (``token_offsets`` ``[n, L, 2]``,
    positions ``[n]``), ``n >= 1``.
  """
  if max_seq_len < max_query_len + 4:
    raise ValueError(f"max_seq_len {max_seq_len} leaves no context token after "
                     f"max_query_len {max_query_len} + 3 special tokens")
  query_ids = tokenizer.tokenize(question)[0][:max_query_len]
  context_ids, offsets = tokenizer.tokenize(context)
  window_len = max_seq_len - len(query_ids) - 3
  spans = windows(len(context_ids), window_len, doc_stride)
  gold = _gold_char_span(context, answers)
  gold_tokens = answer_token_span(offsets, *gold) if gold else None

  n, first = len(spans), len(query_ids) + 2       # context starts after [CLS] query [SEP]
  out = {"input_ids": np.full((n, max_seq_len), tokenizer.pad_id, np.int32),
         "segment_ids": np.zeros((n, max_seq_len), np.int32),
         "mask": np.zeros((n, max_seq_len), np.int32),
         "start_positions": np.zeros((n,), np.int32),
         "end_positions": np.zeros((n,), np.int32),
         "token_offsets": np.full((n, max_seq_len, 2), -1, np.int32),
         "max_context": np.zeros((n, max_seq_len), np.int32)}
  for w, (start, length) in enumerate(spans):
    ids = ([tokenizer.cls_id, *query_ids, tokenizer.sep_id, *context_ids[start:start + length],
            tokenizer.sep_id])
    out["input_ids"][w, :len(ids)] = ids
    out["mask"][w, :len(ids)] = 1
    out["segment_ids"][w, first:len(ids)] = 1
    if length:
      out["token_offsets"][w, first:first + length] = offsets[start:start + length]
      out["max_context"][w, first:first + length] = [
          max_context_window(spans, p) == w for p in range(start, start + length)]
    if gold_tokens and start <= gold_tokens[0] and gold_tokens[1] < start + length:
      out["start_positions"][w] = gold_tokens[0] - start + first
      out["end_positions"][w] = gold_tokens[1] - start + first
  return out


# ---------------------------------------------------------------------------- post-processing


@dataclasses.dataclass(frozen=True)
class Span:
  """A candidate answer: feature (window) index, start and end token, logit sum."""

  feature: int
  start: int
  end: int
  score: float


def best_span(start_logits: np.ndarray, end_logits: np.ndarray, token_offsets: np.ndarray,
              max_context: np.ndarray, *, n_best: int = DEFAULT_N_BEST,
              max_answer_len: int = DEFAULT_MAX_ANSWER_LEN) -> Span | None:
  """The best valid span over one example's ``n`` features (module docstring), or ``None``.

  Args:
    start_logits, end_logits: ``[n, L]``.
    token_offsets: ``[n, L, 2]``, ``-1`` outside the context.
    max_context: ``[n, L]``.
    n_best: start and end candidates per feature (highest logits).
    max_answer_len: longest answer in tokens.
  """
  start_logits, end_logits = np.asarray(start_logits), np.asarray(end_logits)
  token_offsets, max_context = np.asarray(token_offsets), np.asarray(max_context)
  best = None
  for f in range(start_logits.shape[0]):
    is_context = token_offsets[f, :, 0] >= 0
    # Stable sorts on the negated logits: ties go to the earlier token.
    starts = np.argsort(-start_logits[f], kind="stable")[:n_best]
    ends = np.argsort(-end_logits[f], kind="stable")[:n_best]
    for s in starts:
      if not (is_context[s] and max_context[f, s]):
        continue
      for e in ends:
        if not is_context[e] or e < s or e - s + 1 > max_answer_len:
          continue
        score = float(start_logits[f, s]) + float(end_logits[f, e])
        if best is None or score > best.score:
          best = Span(f, int(s), int(e), score)
  return best


def span_text(context: str, token_offsets: np.ndarray, start: int, end: int) -> str:
  """Characters of ``context`` from token ``start``'s begin to token ``end``'s end."""
  return context[int(token_offsets[start][0]):int(token_offsets[end][1])]


def _as_str(value) -> str:
  return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def predict_answers(features: Mapping[str, np.ndarray], start_logits: np.ndarray,
                    end_logits: np.ndarray, *, n_best: int = DEFAULT_N_BEST,
                    max_answer_len: int = DEFAULT_MAX_ANSWER_LEN) -> dict[str, str]:
  """``{example id: answer text}`` from the logits of all features of a set of examples.

  Args:
    features: ``[N, ...]`` arrays of ``N`` features (all windows of every example, in any
      order; concatenate the batches): ``example_id`` (str or bytes), ``context`` (the
      example's context, str or bytes), ``token_offsets`` ``[N, L, 2]`` and ``max_context``
      ``[N, L]``; the seqio QA tasks (``xtreme_qa``) yield all four.
    start_logits, end_logits: ``[N, L]``, e.g. ``BertForQuestionAnswering``'s outputs.
    n_best, max_answer_len: as in ``best_span``.
  """
  ids = [_as_str(x) for x in np.asarray(features["example_id"]).reshape(-1)]
  groups: dict[str, list[int]] = {}
  for row, qid in enumerate(ids):
    groups.setdefault(qid, []).append(row)
  offsets, max_context = np.asarray(features["token_offsets"]), np.asarray(features["max_context"])
  start_logits, end_logits = np.asarray(start_logits), np.asarray(end_logits)
  contexts = np.asarray(features["context"]).reshape(-1)
  answers = {}
  for qid, rows in groups.items():
    span = best_span(start_logits[rows], end_logits[rows], offsets[rows], max_context[rows],
                     n_best=n_best, max_answer_len=max_answer_len)
    answers[qid] = ("" if span is None else
                    span_text(_as_str(contexts[rows[0]]), offsets[rows[span.feature]],
                              span.start, span.end))
  return answers
