"""Span features with a document stride, and post-processing back to the exact answer text."""

import re

import numpy as np
import pytest

from posenc_jax.data import qa
from posenc_jax.data.vocab import CLS_ID, PAD_ID, SEP_ID

EIFFEL = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
          "It is named after the engineer Gustave Eiffel, whose company designed and built the "
          "tower from 1887 to 1889 as the centerpiece of the 1889 World's Fair.")
QUESTION = "Who designed the tower?"


@pytest.fixture(scope="module")
def tok():
  return qa.sentencepiece_tokenizer()


def gold_logits(features, peak=10.0):
  """Start/end logits peaking at each window's gold positions (at [CLS] where it has none)."""
  n, length = features["input_ids"].shape
  start, end = np.zeros((n, length)), np.zeros((n, length))
  start[np.arange(n), features["start_positions"]] = peak
  end[np.arange(n), features["end_positions"]] = peak
  return start, end


def ideal_logits(features, begin, end, peak=10.0):
  """What a perfect model outputs for characters ``[begin, end)``: in every window, a start
  peak at the token holding ``begin`` and an end peak at the one holding ``end - 1``."""
  b, e = features["token_offsets"][..., 0], features["token_offsets"][..., 1]
  return (peak * ((b <= begin) & (begin < e)), peak * ((b <= end - 1) & (end - 1 < e)))


def decode(features, context, start, end, qid="q", **kwargs):
  n = features["input_ids"].shape[0]
  bookkeeping = dict(example_id=np.array([qid.encode()] * n), context=np.array([context] * n),
                     token_offsets=features["token_offsets"], max_context=features["max_context"])
  return qa.predict_answers(bookkeeping, start, end, **kwargs)[qid]


def round_trip(tok, context, answer, start=None, **settings):
  """Features of ``answer``; the text its gold positions give in every window that has them;
  and the text post-processing decodes from a perfect model's logits."""
  start = context.index(answer) if start is None else start
  features = qa.featurize(tok, QUESTION, context, [(answer, start)], **settings)
  from_positions = {
      qa.span_text(context, features["token_offsets"][w], s, e)
      for w, (s, e) in enumerate(zip(features["start_positions"], features["end_positions"]))
      if s > 0}
  decoded = decode(features, context, *ideal_logits(features, start, start + len(answer)))
  return features, from_positions, decoded


# ------------------------------------------------------------------------------ tokenisation


@pytest.mark.parametrize("text", [
    EIFFEL,
    "  double  spaces\tand\ttabs\n",
    "U.S.A.  (1889)\tZürich, São Paulo — “quoted” 東京 ﬁne",
    "",
])
def test_sentencepiece_offsets_are_characters_of_the_original_text(tok, text):
  ids, offsets = tok.tokenize(text)
  assert ids == tok.processor.encode(text)
  assert len(offsets) == len(ids)
  # Offsets ascend without overlap, exclude whitespace, and cover every other character.
  flat = [x for span in offsets for x in span]
  assert flat == sorted(flat) and all(0 <= b <= e <= len(text) for b, e in offsets)
  assert all(not text[b:e][:1].isspace() and not text[b:e][-1:].isspace() for b, e in offsets)
  assert "".join(text[b:e] for b, e in offsets) == re.sub(r"\s", "", text)


def test_sentencepiece_offsets_of_non_ascii_pieces(tok):
  text = "Zürich 東京 ﬁne"
  ids, offsets = tok.tokenize(text)
  pieces = [text[b:e] for b, e in offsets if b < e]
  assert "ü" in pieces and "東京" in pieces    # unknown to the ASCII WordNet model
  assert ids[[text[b:e] for b, e in offsets].index("ü")] == 2      # <unk>
  assert pieces[-1] == "ﬁne"                   # NFKC makes it "fine"; offsets keep the ligature


# ----------------------------------------------------------------------------------- windows


@pytest.mark.parametrize("args, expected", [
    ((10, 4, 2), [(0, 4), (2, 4), (4, 4), (6, 4)]),
    ((10, 4, 3), [(0, 4), (3, 4), (6, 4)]),
    ((10, 4, 8), [(0, 4), (4, 4), (8, 2)]),   # stride capped at the window length
    ((11, 4, 3), [(0, 4), (3, 4), (6, 4), (9, 2)]),
    ((3, 4, 2), [(0, 3)]),
    ((0, 4, 2), [(0, 0)]),
])
def test_windows(args, expected):
  assert qa.windows(*args) == expected


def test_max_context_window():
  spans = qa.windows(10, 4, 2)           # (0-3), (2-5), (4-7), (6-9)
  # Position 3: window 0 gives min(3, 0) = 0, window 1 min(1, 2) = 1 -> window 1.
  assert [qa.max_context_window(spans, p) for p in range(10)] == [0, 0, 0, 1, 1, 2, 2, 3, 3, 3]
  # Ties (equal context) go to the first window.
  assert qa.max_context_window([(0, 4), (2, 4)], 2) == 0


# ---------------------------------------------------------------------------------- features


def test_feature_layout(tok):
  settings = dict(max_seq_len=32, doc_stride=8, max_query_len=8)
  f = qa.featurize(tok, QUESTION, EIFFEL, **settings)
  query = tok.tokenize(QUESTION)[0]
  context, offsets = tok.tokenize(EIFFEL)
  spans = qa.windows(len(context), 32 - len(query) - 3, 8)
  assert f["input_ids"].shape == (len(spans), 32) and len(spans) > 3
  assert {k: v.dtype for k, v in f.items()} == {k: np.dtype(np.int32) for k in qa.FEATURE_KEYS}
  first = len(query) + 2
  for w, (start, length) in enumerate(spans):
    ids = f["input_ids"][w]
    expected = [CLS_ID, *query, SEP_ID, *context[start:start + length], SEP_ID]
    assert list(ids[:len(expected)]) == expected and np.all(ids[len(expected):] == PAD_ID)
    assert list(f["segment_ids"][w]) == ([0] * first + [1] * (length + 1)
                                         + [0] * (32 - len(expected)))
    assert list(f["mask"][w]) == [1] * len(expected) + [0] * (32 - len(expected))
    np.testing.assert_array_equal(f["token_offsets"][w, first:first + length],
                                  offsets[start:start + length])
    assert np.all(np.delete(f["token_offsets"][w], np.s_[first:first + length], 0) == -1)
  # Every context token is max-context in exactly one window.
  assert int(f["max_context"].sum()) == len(context)
  assert np.all(f["start_positions"] == 0) and np.all(f["end_positions"] == 0)   # no answer


def test_question_is_cut_at_max_query_len(tok):
  question = "one two three four five six seven eight nine ten"
  f = qa.featurize(tok, question, "short context", max_seq_len=24, max_query_len=4)
  assert list(f["input_ids"][0, :6]) == [CLS_ID, *tok.tokenize(question)[0][:4], SEP_ID]
  assert f["segment_ids"][0, 5] == 0 and f["segment_ids"][0, 6] == 1
  with pytest.raises(ValueError, match="leaves no context token"):
    qa.featurize(tok, question, "x", max_seq_len=7, max_query_len=4)


def test_empty_context_gives_one_window_and_empty_answer(tok):
  f = qa.featurize(tok, QUESTION, "", [("x", 0)], max_seq_len=16, max_query_len=8)
  assert f["input_ids"].shape == (1, 16) and f["segment_ids"][0].sum() == 1   # the last [SEP]
  assert decode(f, "", *gold_logits(f)) == ""


def test_invalid_answers_give_cls_positions(tok):
  ctx = "Paris is the capital of France."
  for answers in ([("Lyon", 0)], [("Paris", 40)], [("", 0)], [("aris", 0)], []):
    f = qa.featurize(tok, QUESTION, ctx, answers, max_seq_len=32, max_query_len=8)
    assert f["start_positions"].tolist() == [0] and f["end_positions"].tolist() == [0]
  # The first valid answer is used.
  f = qa.featurize(tok, QUESTION, ctx, [("Lyon", 0), ("France", 24)], max_seq_len=32,
                   max_query_len=8)
  assert decode(f, ctx, *gold_logits(f)) == "France"


# ---------------------------------------------------------------------- gold spans round trip


def test_answer_across_the_doc_stride_boundary(tok):
  """The answer starts at window 0's last token and ends past it: only window 1 holds it."""
  settings = dict(max_seq_len=32, doc_stride=20, max_query_len=8)
  answer = "Champ de Mars"
  f, from_positions, decoded = round_trip(tok, EIFFEL, answer, **settings)
  first = len(tok.tokenize(QUESTION)[0]) + 2
  context, offsets = tok.tokenize(EIFFEL)
  spans = qa.windows(len(context), 32 - first - 1, 20)
  assert spans[:2] == [(0, 23), (20, 23)]
  # Precondition: window 0 holds the answer's first token only.
  begin, end = EIFFEL.index(answer), EIFFEL.index(answer) + len(answer)
  last0 = f["token_offsets"][0, first + spans[0][1] - 1]
  assert last0[0] == begin and last0[1] < end
  assert f["start_positions"].tolist()[:1] + f["start_positions"].tolist()[2:] == [0] * (
      len(spans) - 1)
  assert f["start_positions"][1] == first + 2 and f["end_positions"][1] > f["start_positions"][1]
  assert from_positions == {answer} and decoded == answer


def test_answer_in_the_overlap_of_two_windows(tok):
  settings = dict(max_seq_len=32, doc_stride=8, max_query_len=8)
  f, from_positions, decoded = round_trip(tok, EIFFEL, "Gustave Eiffel", **settings)
  assert (f["start_positions"] > 0).sum() >= 2
  assert from_positions == {"Gustave Eiffel"} and decoded == "Gustave Eiffel"


@pytest.mark.parametrize("context, answer", [
    ("Born in  Zürich,\tshe moved to São Paulo in 1990.", "São Paulo"),
    ("Born in  Zürich,\tshe moved to São Paulo in 1990.", "Zürich"),
    ("The U.S.A. joined in 1917 (officially).", "U.S.A."),
    ("The U.S.A. joined in 1917 (officially).", "(officially)."),
    ("He said “quoted text” twice.", "“quoted text”"),
    ("Spaces   inside  the answer\nspan.", "inside  the answer\nspan"),
    ("東京 is the capital; ﬁne print.", "東京"),
    ("東京 is the capital; ﬁne print.", "ﬁne print"),
])
def test_unusual_spacing_and_punctuation_round_trip(tok, context, answer):
  for settings in (dict(max_seq_len=64, max_query_len=16),      # one window
                   dict(max_seq_len=24, doc_stride=3, max_query_len=8)):   # many windows
    _, from_positions, decoded = round_trip(tok, context, answer, **settings)
    assert from_positions == {answer} and decoded == answer


def test_every_token_aligned_span_round_trips(tok):
  """All spans of up to 4 tokens of a context cut in many windows decode to their text."""
  settings = dict(max_seq_len=24, doc_stride=5, max_query_len=8)
  _, offsets = tok.tokenize(EIFFEL)
  real = [i for i, (b, e) in enumerate(offsets) if b < e]
  checked = 0
  for a, i in enumerate(real):
    for j in real[a:a + 4]:
      text = EIFFEL[offsets[i][0]:offsets[j][1]]
      _, from_positions, decoded = round_trip(tok, EIFFEL, text, start=offsets[i][0],
                                              **settings)
      assert from_positions == {text} and decoded == text
      checked += 1
  assert checked > 200


def test_answer_starting_inside_a_token_maps_to_the_covering_tokens(tok):
  ctx = "It opened in (1889) to the public."
  assert "(18" in [ctx[b:e] for b, e in tok.tokenize(ctx)[1]]    # "(18" is one piece
  _, from_positions, decoded = round_trip(tok, ctx, "1889", max_seq_len=32, max_query_len=8)
  assert from_positions == {"(1889"} and decoded == "(1889"


# ------------------------------------------------------------------------ post-processing rules


def _toy_features():
  """One window: [CLS] q q [SEP] c0..c4 [SEP] pad, context token k covering chars 2k..2k+1."""
  offsets = np.full((1, 12, 2), -1, np.int32)
  offsets[0, 4:9] = [(2 * k, 2 * k + 1) for k in range(5)]
  max_context = np.zeros((1, 12), np.int32)
  max_context[0, 4:9] = 1
  return offsets, max_context


def test_best_span_rules():
  offsets, max_context = _toy_features()
  start, end = np.full((1, 12), -5.0), np.full((1, 12), -5.0)
  start[0, [1, 6]] = [9.0, 3.0]           # the question token 1 is not eligible
  end[0, [5, 7, 10]] = [8.0, 2.0, 9.0]    # end 5 < start 6; 10 is padding
  span = qa.best_span(start, end, offsets, max_context)
  assert (span.feature, span.start, span.end, span.score) == (0, 6, 7, 5.0)
  # At most one token: (6, 6) scores -2, (5, 5) scores 3.
  span = qa.best_span(start, end, offsets, max_context, max_answer_len=1)
  assert (span.start, span.end, span.score) == (5, 5, 3.0)
  # A start whose window is not its max-context one is skipped; ties go to the earlier start.
  max_context[0, 6] = 0
  span = qa.best_span(start, end, offsets, max_context)
  assert (span.start, span.end, span.score) == (4, 5, 3.0)
  # No eligible token at all: no span, the empty answer.
  assert qa.best_span(start, end, offsets, np.zeros_like(max_context)) is None
  feats = dict(example_id=np.array(["a"]), context=np.array(["a b c d e"]),
               token_offsets=offsets, max_context=np.zeros_like(max_context))
  assert qa.predict_answers(feats, start, end) == {"a": ""}


def test_best_span_n_best_limits_candidates():
  offsets, max_context = _toy_features()
  start, end = np.full((1, 12), -5.0), np.full((1, 12), -5.0)
  start[0, [6, 4]] = [5.0, 4.0]
  end[0, [4, 7]] = [5.0, 3.0]
  span = qa.best_span(start, end, offsets, max_context, n_best=2)
  assert (span.start, span.end, span.score) == (4, 4, 9.0)
  # With one candidate each, start 6 and end 4 make no valid span.
  assert qa.best_span(start, end, offsets, max_context, n_best=1) is None
  # Across features the best score wins and the text comes from that feature's offsets
  # (feature 1 is a later window: its token 4 is the context's last word, "e").
  later = offsets.copy()
  later[0, 4] = (8, 9)
  two = dict(example_id=np.array(["x", "x"]), context=np.array(["a b c d e"] * 2),
             token_offsets=np.concatenate([offsets, later]),
             max_context=np.concatenate([max_context, max_context]))
  start2, end2 = np.concatenate([start, start - 1.0]), np.concatenate([end, end + 3.0])
  span = qa.best_span(start2, end2, two["token_offsets"], two["max_context"])
  assert (span.feature, span.start, span.end, span.score) == (1, 4, 4, 11.0)
  assert qa.predict_answers(two, start2, end2) == {"x": "e"}


def test_predict_answers_groups_features_by_example(tok):
  settings = dict(max_seq_len=24, doc_stride=6, max_query_len=8)
  ctx_b = "Rome is the capital of Italy, on the Tiber."
  fa = qa.featurize(tok, QUESTION, EIFFEL, [("Gustave Eiffel", EIFFEL.index("Gustave"))],
                    **settings)
  fb = qa.featurize(tok, QUESTION, ctx_b, [("Tiber", ctx_b.index("Tiber"))], **settings)
  sa, ea = gold_logits(fa)
  sb, eb = gold_logits(fb)
  na, nb = len(sa), len(sb)
  # Interleave the two examples' features: grouping is by id, not by order.
  order = np.argsort(np.r_[np.arange(na), np.arange(nb) + 0.5])
  feats = {k: np.concatenate([fa[k], fb[k]])[order] for k in ("token_offsets", "max_context")}
  feats["example_id"] = np.array([b"a"] * na + [b"b"] * nb)[order]
  feats["context"] = np.array([EIFFEL.encode()] * na + [ctx_b.encode()] * nb)[order]
  got = qa.predict_answers(feats, np.concatenate([sa, sb])[order],
                           np.concatenate([ea, eb])[order])
  assert got == {"a": "Gustave Eiffel", "b": "Tiber"}


class WhitespaceTokenizer:
  """A stand-in for a WordPiece tokenizer: one id per whitespace-separated word."""

  cls_id, sep_id, pad_id = 101, 102, 0

  def __init__(self):
    self.vocab = {}

  def tokenize(self, text):
    spans = [m.span() for m in re.finditer(r"\S+", text)]
    ids = [self.vocab.setdefault(text[b:e], 1000 + len(self.vocab)) for b, e in spans]
    return ids, spans


def test_another_tokenizer_plugs_in():
  tok = WhitespaceTokenizer()
  ctx = "alpha beta gamma delta epsilon zeta eta theta iota kappa"
  f, from_positions, decoded = round_trip(tok, ctx, "eta theta", max_seq_len=10, doc_stride=2,
                                         max_query_len=3)
  assert from_positions == {"eta theta"} and decoded == "eta theta"
  query = tok.tokenize(QUESTION)[0][:3]
  alpha, beta = tok.vocab["alpha"], tok.vocab["beta"]
  assert f["input_ids"][0].tolist()[:7] == [101, *query, 102, alpha, beta]
  assert f["segment_ids"][0].tolist() == [0] * 5 + [1] * 5
