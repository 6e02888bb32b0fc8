"""Exact match and F1 of extractive QA, as the SQuAD v1.1 and MLQA evaluation scripts compute them.

Both scripts score a prediction against each gold answer and keep the best; a split's score
is the mean over its gold questions, times 100 (a question without a prediction scores 0):

    exact match   normalise(prediction) == normalise(gold)
    F1            bag-of-tokens F1 of normalise(prediction).split() and normalise(gold).split();
                  0 when they share no token (so an empty prediction scores 0)

The normalisation is where the two differ. Rules per benchmark and language:

    SQuAD v1.1 (``normalize_answer``; used for SQuAD, XQuAD and TyDiQA-GoldP, whose XTREME
    evaluation runs the SQuAD v1.1 script):
      1. lower-case;
      2. delete ASCII punctuation (``string.punctuation``);
      3. replace the English articles ``a``, ``an``, ``the`` (whole words) by a space;
      4. split on whitespace and join with single spaces.

    MLQA (``mlqa_normalize_answer(text, lang)``; ``lang`` one of ``MLQA_LANGUAGES``):
      1. lower-case;
      2. delete every punctuation character: Unicode general category ``P*`` (``«``, ``¿``,
         ``、``, ``。``, curly quotes, ...) and also the ASCII ``string.punctuation`` symbols
         (``$ + < = > ^ ` | ~`` are category ``S*`` but count as punctuation here);
      3. replace articles (whole words, ``MLQA_ARTICLES``) by a space:
           en  a an the
           es  un una unos unas el la los las
           de  ein eine einen einem eines einer der die das den dem des
           vi  của là cái chiếc những
           ar  every occurrence of the string ``ال`` (even inside a word: the script's
               pattern has no word boundary)
           hi, zh  none;
      4. tokenise and join with single spaces: whitespace split for en, es, de, vi, ar, hi;
         for zh "mixed segmentation": each CJK character U+4E00..U+9FA5 (and each punctuation
         character) is a token of its own, the text between them is split on whitespace.
         F1 then counts zh tokens, i.e. mostly single characters.

Edge cases, as in the v1.1 script (the SQuAD v2 script differs and is not used here): an
empty prediction against a gold that normalises to the empty string (e.g. gold ``"The"``)
has exact match 1 but F1 0; a question with no gold answer is an error.
"""

import collections
import re
import string
import unicodedata
from collections.abc import Callable, Mapping, Sequence

MLQA_LANGUAGES = ("ar", "de", "en", "es", "hi", "vi", "zh")
WHITESPACE_LANGUAGES = ("ar", "de", "en", "es", "hi", "vi")
MIXED_SEGMENTATION_LANGUAGES = ("zh",)
MLQA_ARTICLES = {
    "en": ("a", "an", "the"),
    "es": ("un", "una", "unos", "unas", "el", "la", "los", "las"),
    "de": ("ein", "eine", "einen", "einem", "eines", "einer", "der", "die", "das", "den",
           "dem", "des"),
    "vi": ("của", "là", "cái", "chiếc", "những"),
    "hi": (),
    "zh": (),
}
ARABIC_ARTICLE = "ال"

_ASCII_PUNCTUATION = frozenset(string.punctuation)
_SQUAD_ARTICLES = re.compile(r"\b(a|an|the)\b")
_MLQA_ARTICLES = {lang: re.compile(r"\b(" + "|".join(words) + r")\b")
                  for lang, words in MLQA_ARTICLES.items() if words}
_CJK = re.compile("[\u4e00-\u9fa5]")


# ----------------------------------------------------------------------------- normalisation


def normalize_answer(text: str) -> str:
  """SQuAD v1.1: lower-case, drop ASCII punctuation and a/an/the, collapse whitespace."""
  text = "".join(ch for ch in text.lower() if ch not in _ASCII_PUNCTUATION)
  return " ".join(_SQUAD_ARTICLES.sub(" ", text).split())


def is_mlqa_punctuation(ch: str) -> bool:
  """MLQA's punctuation set: Unicode category ``P*`` or ASCII ``string.punctuation``."""
  return ch in _ASCII_PUNCTUATION or unicodedata.category(ch).startswith("P")


def mixed_segmentation(text: str) -> list[str]:
  """MLQA's zh tokens: CJK characters and punctuation alone, whitespace split in between."""
  tokens, pending = [], []
  for ch in text:
    if _CJK.match(ch) or is_mlqa_punctuation(ch):
      tokens.extend("".join(pending).split())
      pending = []
      tokens.append(ch)
    else:
      pending.append(ch)
  tokens.extend("".join(pending).split())
  return tokens


def _check_language(lang: str) -> None:
  if lang not in MLQA_LANGUAGES:
    raise ValueError(f"MLQA language: got {lang!r}; allowed: {', '.join(MLQA_LANGUAGES)}")


def mlqa_normalize_answer(text: str, lang: str) -> str:
  """MLQA's per-language normalisation (module docstring, rules 1-4)."""
  _check_language(lang)
  text = "".join(ch for ch in text.lower() if not is_mlqa_punctuation(ch))
  if lang == "ar":
    text = text.replace(ARABIC_ARTICLE, " ")
  elif lang in _MLQA_ARTICLES:
    text = _MLQA_ARTICLES[lang].sub(" ", text)
  tokens = mixed_segmentation(text) if lang in MIXED_SEGMENTATION_LANGUAGES else text.split()
  return " ".join(t for t in tokens if t.strip())


def normalizer(lang: str | None = None) -> Callable[[str], str]:
  """SQuAD v1.1's normalisation for ``lang=None``, else MLQA's for ``lang``."""
  if lang is None:
    return normalize_answer
  _check_language(lang)
  return lambda text: mlqa_normalize_answer(text, lang)


# ------------------------------------------------------------------------------------ scores


def exact_match_score(prediction: str, gold: str, lang: str | None = None) -> float:
  """1.0 if the normalised strings are equal, else 0.0."""
  normalize = normalizer(lang)
  return float(normalize(prediction) == normalize(gold))


def f1_score(prediction: str, gold: str, lang: str | None = None) -> float:
  """Token-bag F1 of the normalised strings; 0.0 when no token is shared."""
  normalize = normalizer(lang)
  predicted, expected = normalize(prediction).split(), normalize(gold).split()
  common = collections.Counter(predicted) & collections.Counter(expected)
  same = sum(common.values())
  if same == 0:
    return 0.0
  precision, recall = same / len(predicted), same / len(expected)
  return 2 * precision * recall / (precision + recall)


def max_over_golds(score_fn: Callable[..., float], prediction: str, golds: Sequence[str],
                   lang: str | None = None) -> float:
  """The best ``score_fn(prediction, gold, lang)`` over the gold answers (at least one)."""
  if isinstance(golds, str):
    raise TypeError("golds: expected a sequence of answer strings, got one string")
  if not golds:
    raise ValueError("a question with no gold answer cannot be scored")
  return max(score_fn(prediction, gold, lang) for gold in golds)


def evaluate(golds: Mapping[str, Sequence[str]], predictions: Mapping[str, str],
             lang: str | None = None) -> dict[str, float]:
  """``{"exact_match", "f1"}`` in percent, averaged over the questions of ``golds``.

  Args:
    golds: question id -> its gold answer texts.
    predictions: question id -> predicted answer text; a missing id scores 0, ids not in
      ``golds`` are ignored.
    lang: ``None`` for SQuAD v1.1's normalisation, else an MLQA language.
  """
  if not golds:
    raise ValueError("no gold questions to evaluate")
  normalizer(lang)   # validates lang before the loop
  em = f1 = 0.0
  for qid, answers in golds.items():
    if qid not in predictions:
      continue
    em += max_over_golds(exact_match_score, predictions[qid], answers, lang)
    f1 += max_over_golds(f1_score, predictions[qid], answers, lang)
  return {"exact_match": 100.0 * em / len(golds), "f1": 100.0 * f1 / len(golds)}


def _as_mappings(targets, predictions):
  """Mappings by id, or aligned sequences turned into mappings by position."""
  if isinstance(targets, Mapping):
    if not isinstance(predictions, Mapping):
      raise TypeError("targets is a mapping by id, so predictions must be one too")
    return targets, predictions
  targets, predictions = list(targets), list(predictions)
  if len(targets) != len(predictions):
    raise ValueError(f"{len(targets)} targets but {len(predictions)} predictions")
  return dict(enumerate(targets)), dict(enumerate(predictions))


def squad(targets, predictions) -> dict[str, float]:
  """seqio metric fn: SQuAD v1.1 ``{"exact_match", "f1"}`` (percent).

  ``targets`` and ``predictions`` are either mappings by question id (gold answer lists,
  predicted texts) or aligned sequences of them.
  """
  return evaluate(*_as_mappings(targets, predictions))


def mlqa(targets, predictions, *, lang: str) -> dict[str, float]:
  """seqio metric fn (bind ``lang`` with ``functools.partial``): MLQA's ``squad`` for ``lang``."""
  return evaluate(*_as_mappings(targets, predictions), lang=lang)
