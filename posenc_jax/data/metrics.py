"""Evaluation metrics as the papers report them, with seqio's ``(targets, predictions)`` signature.

Every function takes the references first and the model outputs second (equal lengths, at
least one example; anything else is a ``ValueError``) and returns a dict of Python floats:

    accuracy           {"accuracy"}              percent of exact label matches
    matthews_corr      {"matthews_corr"}         Matthews correlation x 100 (CoLA)
    f1                 {"f1"}                    binary F1 x 100, positive class 1
    accuracy_and_f1    {"accuracy", "f1"}        MRPC, QQP
    pearson_spearman   {"pearson", "spearman"}   correlations x 100 (STS-B)
    bleu               {"bleu"}                  SacreBLEU corpus BLEU (0-100) on detokenised text

**Scale**: everything is on the 0-100 scale of the GLUE leaderboard, the GLUE/XTREME papers,
BERT, DIET and TUPE (an accuracy of 0.845 is reported as 84.5, an MCC of 0.52 as 52.0); BLEU
is SacreBLEU's own 0-100 score. No function rounds.

**Degenerate cases** follow the reference implementations the tests compare against
(scikit-learn 1.9, SciPy 1.17, SacreBLEU 2.6):

- ``matthews_corr`` is 0 when its denominator is 0, i.e. when the targets or the
  predictions hold one class only (``sklearn.metrics.matthews_corrcoef``); so a constant
  predictor scores exactly 0, CoLA's majority baseline.
- ``f1`` is 0 when there is no positive target and no positive prediction
  (``sklearn.metrics.f1_score``'s default ``zero_division``), and 0 when there is no true
  positive.
- ``pearson``/``spearman`` are NaN when either side is constant (``scipy.stats.pearsonr``,
  ``spearmanr``) and, unlike SciPy's ``pearsonr`` (which raises), NaN for a single example.
  Spearman is the Pearson correlation of average ranks (ties share their mean rank).
- ``bleu``: an empty prediction string is a sentence with no n-grams (its length still
  counts in the brevity penalty); a corpus of empty predictions scores 0.

Multi-class ``matthews_corr`` uses the general (Gorodkin) form, as scikit-learn does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

PERCENT = 100.0


def _pair(targets: Sequence[Any], predictions: Sequence[Any], dtype=None
          ) -> tuple[np.ndarray, np.ndarray]:
  """1-D arrays of equal, non-zero length (``ValueError`` otherwise)."""
  t = np.asarray(targets, dtype=dtype).reshape(-1)
  p = np.asarray(predictions, dtype=dtype).reshape(-1)
  if t.shape != p.shape:
    raise ValueError(f"targets and predictions differ in length: {t.size} vs {p.size}")
  if t.size == 0:
    raise ValueError("no examples: targets and predictions are empty")
  return t, p


def accuracy(targets: Sequence[Any], predictions: Sequence[Any]) -> dict[str, float]:
  """``{"accuracy"}``: percent of predictions equal to their target."""
  t, p = _pair(targets, predictions)
  return {"accuracy": PERCENT * float(np.mean(t == p))}


def matthews_corr(targets: Sequence[Any], predictions: Sequence[Any]) -> dict[str, float]:
  """``{"matthews_corr"}``: Matthews correlation coefficient x 100 (CoLA's metric).

  For ``K`` classes with confusion matrix ``C`` (rows targets), ``t = C.sum(1)``,
  ``p = C.sum(0)``, ``c = trace(C)``, ``s = C.sum()``::

      MCC = (c s - t.p) / sqrt((s^2 - p.p) (s^2 - t.t))

  (the binary ``(TP TN - FP FN) / sqrt(...)`` for ``K = 2``), 0 if the denominator is 0.
  """
  t, p = _pair(targets, predictions)
  classes, codes = np.unique(np.concatenate([t, p]), return_inverse=True)
  k = classes.size
  confusion = np.zeros((k, k), np.float64)
  np.add.at(confusion, (codes[:t.size], codes[t.size:]), 1.0)
  true_counts, pred_counts = confusion.sum(1), confusion.sum(0)
  correct, total = np.trace(confusion), confusion.sum()
  numerator = correct * total - pred_counts @ true_counts
  denominator = (total ** 2 - pred_counts @ pred_counts) * (total ** 2 - true_counts @ true_counts)
  if denominator == 0:
    return {"matthews_corr": 0.0}
  return {"matthews_corr": PERCENT * float(numerator / math.sqrt(denominator))}


def f1(targets: Sequence[Any], predictions: Sequence[Any]) -> dict[str, float]:
  """``{"f1"}``: binary F1 x 100 of the positive class 1 (labels are 0/1), i.e.
  ``2 TP / (2 TP + FP + FN)``; 0 when that denominator is 0 (no positives anywhere)."""
  t, p = _pair(targets, predictions)
  t, p = t == 1, p == 1
  tp = float(np.sum(t & p))
  denominator = 2 * tp + float(np.sum(~t & p)) + float(np.sum(t & ~p))
  return {"f1": PERCENT * 2 * tp / denominator if denominator else 0.0}


def accuracy_and_f1(targets: Sequence[Any], predictions: Sequence[Any]) -> dict[str, float]:
  """``{"accuracy", "f1"}`` (MRPC and QQP, reported as F1/accuracy)."""
  return accuracy(targets, predictions) | f1(targets, predictions)


def _average_ranks(x: np.ndarray) -> np.ndarray:
  """Ranks 1..n, tied values sharing the mean of their ranks (SciPy's ``rankdata``)."""
  order = np.argsort(x, kind="stable")
  sorted_x = x[order]
  starts = np.flatnonzero(np.concatenate([[True], sorted_x[1:] != sorted_x[:-1]]))
  ends = np.concatenate([starts[1:], [x.size]])           # tie group [start, end)
  mean_rank = (starts + ends + 1) / 2.0                   # mean of ranks start+1 .. end
  ranks = np.empty(x.size, np.float64)
  ranks[order] = np.repeat(mean_rank, ends - starts)
  return ranks


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
  """Pearson's r; NaN for fewer than 2 examples or a constant side."""
  if x.size < 2:
    return math.nan
  x, y = x - x.mean(), y - y.mean()
  norm = math.sqrt(float(x @ x) * float(y @ y))
  if norm == 0:
    return math.nan
  return float(np.clip((x @ y) / norm, -1.0, 1.0))


def pearson_spearman(targets: Sequence[float], predictions: Sequence[float]
                     ) -> dict[str, float]:
  """``{"pearson", "spearman"}`` x 100 (STS-B's metrics; module docstring for NaN cases)."""
  t, p = _pair(targets, predictions, np.float64)
  return {"pearson": PERCENT * _pearson(t, p),
          "spearman": PERCENT * _pearson(_average_ranks(t), _average_ranks(p))}


def _text(x: Any) -> str:
  return x.decode("utf-8") if isinstance(x, bytes) else str(x)


def bleu(targets: Sequence[str], predictions: Sequence[str]) -> dict[str, float]:
  """``{"bleu"}``: ``sacrebleu.corpus_bleu(predictions, [targets]).score``.

  SacreBLEU's defaults, the setting WMT papers (and DIET) report: one reference per
  sentence, 13a tokenisation, mixed case, exponential smoothing; its signature is
  ``nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0``. Inputs are detokenised
  sentences (``str`` or UTF-8 ``bytes``), one reference per prediction; for WMT pass the
  raw reference text (``targets_pretokenized``), not a tokenise/detokenise round trip.
  """
  if len(targets) != len(predictions):
    raise ValueError(f"targets and predictions differ in length: {len(targets)} vs "
                     f"{len(predictions)}")
  if not len(targets):
    raise ValueError("no examples: targets and predictions are empty")
  import sacrebleu  # noqa: PLC0415  (the data extra)
  score = sacrebleu.corpus_bleu([_text(p) for p in predictions], [[_text(t) for t in targets]])
  return {"bleu": float(score.score)}
