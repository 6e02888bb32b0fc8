"""SQuAD v1.1 and MLQA exact match / F1 against values worked out by hand from the scripts."""

import functools

import pytest

from posenc_jax.data import squad_metrics as sm
from posenc_jax.data.squad_metrics import exact_match_score as em
from posenc_jax.data.squad_metrics import f1_score as f1


@pytest.mark.parametrize("text, normalised", [
    ("The  Quick, brown fox!", "quick brown fox"),
    ("An apple a day", "apple day"),
    ("theater of another anthem", "theater of another anthem"),   # articles only as words
    ("A-team", "ateam"),                         # punctuation goes before articles
    ("U.S.A.\t(1889)\n", "usa 1889"),
    ("“Paris”", "“paris”"),                      # curly quotes are not ASCII punctuation
    ("¿Dónde?", "¿dónde"),
    ("", ""),
    ("The", ""),
])
def test_squad_normalisation(text, normalised):
  assert sm.normalize_answer(text) == normalised


def test_squad_exact_match_and_f1_hand_values():
  assert em("the cat sat on the mat", "A cat sat on a mat.") == 1.0
  assert f1("the cat sat on the mat", "A cat sat on a mat.") == 1.0
  assert em("cat sat", "cat sat on mat") == 0.0
  assert f1("cat sat", "cat sat on mat") == pytest.approx(2 / 3)   # P 1, R 1/2
  assert f1("cat cat cat", "cat") == pytest.approx(0.5)            # P 1/3, R 1 (bag counts)
  assert f1("on mat cat sat", "cat sat on mat") == 1.0             # order is ignored
  assert f1("Denver Broncos win", "the Denver Broncos") == pytest.approx(0.8)  # P 2/3, R 1


def test_squad_edge_cases():
  assert em("", "Paris") == 0.0 and f1("", "Paris") == 0.0          # empty prediction
  assert em("", "The") == 1.0 and f1("", "The") == 0.0              # both normalise to ""
  assert em("", "") == 1.0 and f1("", "") == 0.0                    # v1.1: no shared token
  assert em("the", "a") == 1.0 and f1("the", "a") == 0.0
  assert f1("Paris", "") == 0.0
  with pytest.raises(ValueError, match="no gold answer"):
    sm.max_over_golds(f1, "x", [])


def test_max_over_gold_answers():
  golds = ["Denver Broncos", "the Broncos", "Broncos team"]
  assert sm.max_over_golds(em, "Broncos", golds) == 1.0             # "the Broncos"
  assert sm.max_over_golds(f1, "Denver", golds) == pytest.approx(2 / 3)
  assert sm.max_over_golds(em, "Denver", golds) == 0.0
  assert sm.max_over_golds(f1, "Broncos team win", golds) == pytest.approx(0.8)


def test_evaluate_averages_over_gold_questions_in_percent():
  golds = {"q1": ["Paris"], "q2": ["cat sat on mat", "dog"], "q3": ["Rome"]}
  predictions = {"q1": "paris.", "q2": "cat sat", "extra": "ignored"}   # q3 unanswered
  got = sm.evaluate(golds, predictions)
  assert got["exact_match"] == pytest.approx(100 / 3)
  assert got["f1"] == pytest.approx(100 * (1 + 2 / 3) / 3)
  assert sm.squad(golds, predictions) == got
  # Aligned sequences work too (the seqio metric-fn form).
  aligned = sm.squad([["Paris"], ["cat sat on mat", "dog"]], ["paris.", "cat sat"])
  assert aligned == {"exact_match": 50.0, "f1": pytest.approx(100 * (1 + 2 / 3) / 2)}
  with pytest.raises(ValueError, match="2 targets but 1 predictions"):
    sm.squad([["a"], ["b"]], ["a"])


# ------------------------------------------------------------------------------------- MLQA


@pytest.mark.parametrize("lang, text, normalised", [
    ("en", "The “Paris” agreement", "paris agreement"),      # Unicode punctuation removed
    ("en", "price: $5 + tax", "price 5 tax"),                # ASCII symbols count too
    ("es", "¿Dónde está la casa?", "dónde está casa"),
    ("es", "El gato y los perros", "gato y perros"),
    ("es", "Las Palmas, unas islas", "palmas islas"),
    ("es", "elefante lazo", "elefante lazo"),                # whole words only
    ("de", "Die Hauptstadt der Bundesrepublik", "hauptstadt bundesrepublik"),
    ("de", "ein Dasein, eines Tages", "dasein tages"),
    ("vi", "những con mèo của tôi", "con mèo tôi"),
    ("hi", "The river गंगा", "the river गंगा"),               # no articles for hi
    ("ar", "القاهرة", "قاهرة"),
    ("ar", "مالك", "م ك"),                                    # the script drops ال anywhere
    ("zh", "2008年北京奥运会。", "2008 年 北 京 奥 运 会"),
    ("zh", "北京 Olympic Games", "北 京 olympic games"),
    ("zh", "the 北京", "the 北 京"),                           # no articles for zh
])
def test_mlqa_normalisation(lang, text, normalised):
  assert sm.mlqa_normalize_answer(text, lang) == normalised


def test_mixed_segmentation():
  assert sm.mixed_segmentation("ab 北京,cd  e") == ["ab", "北", "京", ",", "cd", "e"]
  assert sm.mixed_segmentation("") == []


def test_mlqa_scores_differ_from_squad_where_the_rules_differ():
  # es: "el" is an article for MLQA only.
  assert em("El gato negro", "gato negro", "es") == 1.0
  assert em("El gato negro", "gato negro") == 0.0
  assert f1("El gato negro", "gato negro") == pytest.approx(0.8)      # P 2/3, R 1
  # de: "die", "der" are articles.
  assert em("die Hauptstadt der Schweiz", "Hauptstadt Schweiz", "de") == 1.0
  assert f1("die Hauptstadt der Schweiz", "Hauptstadt Schweiz") == pytest.approx(2 / 3)
  # zh: characters are tokens, so a partial answer gets partial F1.
  assert f1("北京", "北京大学", "zh") == pytest.approx(2 / 3)          # P 1, R 1/2
  assert f1("北京", "北京大学") == 0.0
  assert em("北京。", "北京", "zh") == 1.0 and em("北京。", "北京") == 0.0
  # en: curly quotes are punctuation for MLQA only.
  assert em("“Paris”", "Paris", "en") == 1.0 and em("“Paris”", "Paris") == 0.0
  # Edge cases behave as in SQuAD v1.1.
  assert em("", "la", "es") == 1.0 and f1("", "la", "es") == 0.0
  assert f1("", "gato", "es") == 0.0


def test_mlqa_metric_fn_and_unknown_language():
  golds = {"a": ["la casa"], "b": ["el perro", "perro grande"]}
  predictions = {"a": "Casa", "b": "un perro"}
  assert sm.mlqa(golds, predictions, lang="es") == {"exact_match": 100.0, "f1": 100.0}
  squad = sm.squad(golds, predictions)
  assert squad["exact_match"] == 0.0
  # a: P 1, R 1/2 -> 2/3; b: "un perro" shares one of two tokens with either gold -> 1/2.
  assert squad["f1"] == pytest.approx(100 * (2 / 3 + 1 / 2) / 2)
  bound = functools.partial(sm.mlqa, lang="es")
  assert bound(golds, predictions)["f1"] == 100.0
  with pytest.raises(ValueError, match="MLQA language"):
    sm.mlqa_normalize_answer("x", "el")
  with pytest.raises(ValueError, match="MLQA language"):
    sm.evaluate({"a": ["x"]}, {"a": "x"}, lang="th")
