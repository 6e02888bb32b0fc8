"""``posenc_jax.data.metrics`` against scikit-learn, SciPy and SacreBLEU on fixed cases."""

import math
import warnings

import numpy as np
import pytest

from tests.conftest import require

sklearn_metrics = require("sklearn.metrics")
scipy_stats = require("scipy.stats")
sacrebleu = require("sacrebleu")

from posenc_jax.data import metrics  # noqa: E402

RNG = np.random.default_rng(0)
BINARY_CASES = {
    "random": (RNG.integers(0, 2, 200), RNG.integers(0, 2, 200)),
    "perfect": ([0, 1, 1, 0, 1], [0, 1, 1, 0, 1]),
    "inverse": ([0, 1, 1, 0, 1], [1, 0, 0, 1, 0]),
    "all_one_class": ([1, 1, 1, 1], [1, 1, 1, 1]),
    "all_zero_class": ([0, 0, 0], [0, 0, 0]),
    "constant_prediction": ([0, 1, 1, 0, 1], [1, 1, 1, 1, 1]),
    "constant_zero_prediction": ([0, 1, 1, 0, 1], [0, 0, 0, 0, 0]),
    "constant_target": ([0, 0, 0, 0], [0, 1, 0, 1]),
    "no_true_positive": ([1, 1, 0, 0], [0, 0, 1, 1]),
    "single": ([1], [0]),
}
MULTICLASS_CASES = {
    "random3": (RNG.integers(0, 3, 300), RNG.integers(0, 3, 300)),
    "skewed": ([0, 0, 0, 0, 1, 2, 2], [0, 0, 1, 0, 1, 2, 0]),
    "missing_class": ([0, 1, 2, 2], [0, 1, 1, 1]),
    "strings": (["e", "n", "c", "c", "e"], ["e", "c", "c", "c", "n"]),
}


def _quiet(fn, *args, **kwargs):
  """scikit-learn and SciPy warn on the degenerate cases; the values are what we compare."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    return fn(*args, **kwargs)


@pytest.mark.parametrize("case", sorted(BINARY_CASES) + sorted(MULTICLASS_CASES))
def test_accuracy_equals_sklearn_in_percent(case):
  t, p = {**BINARY_CASES, **MULTICLASS_CASES}[case]
  got = metrics.accuracy(t, p)
  assert set(got) == {"accuracy"} and isinstance(got["accuracy"], float)
  assert got["accuracy"] == pytest.approx(100 * sklearn_metrics.accuracy_score(t, p), abs=1e-12)


@pytest.mark.parametrize("case", sorted(BINARY_CASES) + sorted(MULTICLASS_CASES))
def test_matthews_corr_equals_sklearn(case):
  t, p = {**BINARY_CASES, **MULTICLASS_CASES}[case]
  expected = 100 * _quiet(sklearn_metrics.matthews_corrcoef, t, p)
  assert metrics.matthews_corr(t, p)["matthews_corr"] == pytest.approx(expected, abs=1e-9)


def test_matthews_corr_closed_values():
  assert metrics.matthews_corr([0, 1, 1, 0], [0, 1, 1, 0])["matthews_corr"] == 100.0
  assert metrics.matthews_corr([0, 1, 1, 0], [1, 0, 0, 1])["matthews_corr"] == -100.0
  # A constant predictor (CoLA's majority baseline) and a one-class set score exactly 0.
  assert metrics.matthews_corr([0, 1, 1, 0, 1], [1] * 5)["matthews_corr"] == 0.0
  assert metrics.matthews_corr([1, 1, 1], [1, 1, 1])["matthews_corr"] == 0.0
  # TP=2, TN=1, FP=1, FN=1: (2 - 1) / sqrt(3 * 3 * 2 * 2) = 1/6.
  assert metrics.matthews_corr([1, 1, 1, 0, 0], [1, 1, 0, 1, 0])["matthews_corr"] == (
      pytest.approx(100 / 6))


@pytest.mark.parametrize("case", sorted(BINARY_CASES))
def test_f1_equals_sklearn_binary_positive_class_1(case):
  t, p = BINARY_CASES[case]
  expected = 100 * _quiet(sklearn_metrics.f1_score, t, p, pos_label=1, average="binary")
  assert metrics.f1(t, p)["f1"] == pytest.approx(expected, abs=1e-9)


def test_f1_degenerate_cases_are_zero():
  assert metrics.f1([0, 0, 0], [0, 0, 0])["f1"] == 0.0      # no positives anywhere
  assert metrics.f1([1, 1, 0], [0, 0, 0])["f1"] == 0.0      # empty positive prediction
  assert metrics.f1([1, 0], [0, 1])["f1"] == 0.0            # no true positive
  assert metrics.f1([1, 1, 0, 0], [1, 0, 1, 0])["f1"] == pytest.approx(50.0)


@pytest.mark.parametrize("case", ["random", "constant_prediction", "all_zero_class"])
def test_accuracy_and_f1(case):
  t, p = BINARY_CASES[case]
  got = metrics.accuracy_and_f1(t, p)
  assert got == {**metrics.accuracy(t, p), **metrics.f1(t, p)}


CORRELATION_CASES = {
    "random": (RNG.uniform(0, 5, 100), RNG.uniform(0, 5, 100)),
    "correlated": (np.arange(50) / 10.0, np.arange(50) / 10.0 + RNG.normal(0, 0.5, 50)),
    "ties": ([0.0, 1.0, 1.0, 2.0, 3.0, 3.0, 3.0, 5.0], [0.5, 0.5, 1.0, 4.0, 2.0, 2.0, 3.0, 1.0]),
    "negative": ([1.0, 2.0, 3.0, 4.0], [4.0, 3.5, 1.0, 0.0]),
    "two": ([1.0, 2.0], [0.0, 7.0]),
    "nonlinear_monotone": (np.arange(1, 20, dtype=float), np.exp(np.arange(1, 20))),
}


@pytest.mark.parametrize("case", sorted(CORRELATION_CASES))
def test_pearson_spearman_equal_scipy(case):
  t, p = CORRELATION_CASES[case]
  got = metrics.pearson_spearman(t, p)
  assert got["pearson"] == pytest.approx(100 * scipy_stats.pearsonr(t, p).statistic, abs=1e-9)
  assert got["spearman"] == pytest.approx(100 * scipy_stats.spearmanr(t, p).statistic, abs=1e-9)


def test_pearson_spearman_degenerate_cases_are_nan_like_scipy():
  constant = metrics.pearson_spearman([1.0, 2.0, 3.0], [2.5, 2.5, 2.5])
  assert math.isnan(constant["pearson"]) and math.isnan(constant["spearman"])
  assert math.isnan(_quiet(scipy_stats.pearsonr, [1.0, 2.0, 3.0], [2.5, 2.5, 2.5]).statistic)
  assert math.isnan(_quiet(scipy_stats.spearmanr, [1.0, 2.0, 3.0], [2.5, 2.5, 2.5]).statistic)
  single = metrics.pearson_spearman([1.0], [2.0])      # SciPy's pearsonr raises here
  assert math.isnan(single["pearson"]) and math.isnan(single["spearman"])
  assert metrics.pearson_spearman([1, 2, 3], [10, 20, 30]) == {"pearson": 100.0,
                                                               "spearman": 100.0}


BLEU_REFERENCES = [
    "The cat sat on the mat.",
    "Es regnet heute in Berlin, sagte der Sprecher.",
    "A quick brown fox jumps over the lazy dog!",
    "Prague is the capital of the Czech Republic.",
]
BLEU_PREDICTIONS = [
    "The cat sat on a mat.",
    "Heute regnet es in Berlin, sagte der Sprecher.",
    "A fast brown fox jumped over the lazy dog!",
    "Prague is the capital of Czechia.",
]


def test_bleu_equals_sacrebleu_defaults():
  expected = sacrebleu.corpus_bleu(BLEU_PREDICTIONS, [BLEU_REFERENCES]).score
  got = metrics.bleu(BLEU_REFERENCES, BLEU_PREDICTIONS)
  assert set(got) == {"bleu"} and got["bleu"] == pytest.approx(expected, abs=1e-12)
  assert 10 < got["bleu"] < 90
  # the default signature: 13a tokenisation, mixed case, exponential smoothing.
  assert sacrebleu.BLEU().corpus_score(BLEU_PREDICTIONS, [BLEU_REFERENCES]).score == expected


def test_bleu_edge_cases():
  assert metrics.bleu(BLEU_REFERENCES, BLEU_REFERENCES)["bleu"] == pytest.approx(100.0)
  with_empty = BLEU_PREDICTIONS[:2] + ["", BLEU_PREDICTIONS[3]]
  assert metrics.bleu(BLEU_REFERENCES, with_empty)["bleu"] == pytest.approx(
      sacrebleu.corpus_bleu(with_empty, [BLEU_REFERENCES]).score, abs=1e-12)
  assert metrics.bleu(BLEU_REFERENCES, [""] * 4)["bleu"] == 0.0
  as_bytes = [s.encode() for s in BLEU_PREDICTIONS]
  assert metrics.bleu([s.encode() for s in BLEU_REFERENCES], as_bytes) == metrics.bleu(
      BLEU_REFERENCES, BLEU_PREDICTIONS)
  # Case matters (mixed case) and detokenised punctuation is split by 13a.
  assert metrics.bleu(["Hello, world"], ["hello, world"])["bleu"] < 100
  assert metrics.bleu(["Hello, world !"], ["Hello, world!"])["bleu"] == pytest.approx(100.0)


@pytest.mark.parametrize("fn", [metrics.accuracy, metrics.matthews_corr, metrics.f1,
                                metrics.accuracy_and_f1, metrics.pearson_spearman, metrics.bleu])
def test_length_mismatch_and_empty_input_are_errors(fn):
  with pytest.raises(ValueError, match="differ in length"):
    fn(["1", "0"], ["1"]) if fn is metrics.bleu else fn([1, 0], [1])
  with pytest.raises(ValueError, match="no examples"):
    fn([], [])
