"""Property indicators (Wang et al. 2021, App. B) on constructed matrices with known answers."""

import numpy as np
import pytest

from posenc_jax.analysis import (PAPER_TABLE2, TABLE2_COLUMNS, aiv, db, drop_positions,
                                 format_table2, indicators, opr, opr_sequence, paper_row, sd)
from posenc_jax.analysis.indicators import paper_setup_differences



def toeplitz(column, row=None):
  """``T[i, j] = column[i - j]`` below the diagonal and ``row[j - i]`` above it."""
  row = column if row is None else row
  n = len(column)
  offset = np.arange(n)[None, :] - np.arange(n)[:, None]  # j - i
  return np.where(offset >= 0, np.asarray(row)[np.abs(offset)], np.asarray(column)[np.abs(offset)])


def distance_matrix(n, f):
  i = np.arange(n)
  return f(np.abs(i[:, None] - i[None, :]).astype(float))


# ---------------------------------------------------------------- translation invariance (AIV)


def test_toeplitz_matrix_has_aiv_zero():
  rng = np.random.default_rng(0)
  a = toeplitz(rng.uniform(0.1, 1.0, 12), rng.uniform(0.1, 1.0, 12))  # asymmetric Toeplitz
  assert aiv(a) == pytest.approx(0.0, abs=1e-12)
  assert aiv(a, exclude=(0, -1)) == pytest.approx(0.0, abs=1e-12)


def test_aiv_closed_form_on_a_3x3_matrix():
  # Offsets: 0 -> {1,5,9} var 32/3; +-1 -> {2,6},{4,8} var 4; +-2 single entries var 0.
  # (32/3 * 3 + 4 * 2 + 4 * 2) / 9 = 16/3; Var(1..9) = 20/3; AIV = 0.8.
  a = np.arange(1, 10, dtype=float).reshape(3, 3)
  assert aiv(a) == pytest.approx(0.8)


def test_aiv_without_special_tokens_drops_their_rows_and_columns():
  a = toeplitz(np.linspace(1.0, 0.2, 10))
  a[0, :] = np.linspace(5.0, 3.0, 10)  # a [CLS]-like row and column break invariance
  a[:, 0] = 4.0
  assert aiv(a) > 0.1
  assert aiv(a, exclude=(0,)) == pytest.approx(0.0, abs=1e-12)
  assert drop_positions(a, (0, -1)).shape == (8, 8)


def test_aiv_of_random_matrix_is_near_one():
  # Offsets do not explain the variance of i.i.d. entries.
  a = np.random.default_rng(1).uniform(size=(64, 64))
  assert aiv(a) == pytest.approx(1.0, abs=0.05)


# ------------------------------------------------------------------------ symmetry (SD)


def test_symmetric_matrix_has_sd_zero():
  b = np.random.default_rng(2).uniform(size=(9, 9))
  assert sd(b + b.T) == 0.0


def test_sd_closed_form():
  assert sd(np.array([[0.0, 1.0], [3.0, 0.0]])) == pytest.approx(2.0)
  # Pairs (0,1): |1-4| = 3, (0,2): |2-7| = 5, (1,2): |6-8| = 2; mean over 3 pairs.
  a = np.array([[1.0, 1.0, 2.0], [4.0, 1.0, 6.0], [7.0, 8.0, 1.0]])
  assert sd(a) == pytest.approx(10.0 / 3.0)


# ---------------------------------------------------------------------- monotonicity (OPR)


def test_opr_of_sequences():
  assert opr_sequence([3, 2, 1]) == 0.0
  assert opr_sequence([1, 2, 3]) == 1.0
  assert opr_sequence([1, 3, 2]) == pytest.approx(2 / 3)
  assert opr_sequence([2, 2, 2]) == 0.0  # ties are not increasing: sign(0) = 0


def test_rows_decreasing_away_from_diagonal_give_opr_zero_and_reverse_one():
  decreasing = distance_matrix(20, lambda d: np.exp(-0.3 * d))
  increasing = distance_matrix(20, lambda d: 1.0 + d)
  assert opr(decreasing) == 0.0
  assert opr(decreasing, k=5) == 0.0
  assert opr(increasing) == 1.0
  assert opr(increasing, k=5) == 1.0


def test_random_matrix_gives_opr_near_half():
  a = np.random.default_rng(3).uniform(size=(64, 64))
  assert opr(a) == pytest.approx(0.5, abs=0.02)
  assert opr(a, k=20) == pytest.approx(0.5, abs=0.03)


def test_opr_closed_form_with_length_weights():
  # Sequences: row 0 fwd (3,1,2) OPR 1/3 (len 3); row 1 fwd (3,1), bwd (3,1) OPR 0 (len 2);
  # row 2 bwd (3,1,2) OPR 1/3 (len 3); single-element sequences have no pairs and are left out.
  a = np.array([[3.0, 1.0, 2.0], [1.0, 3.0, 1.0], [2.0, 1.0, 3.0]])
  assert opr(a) == pytest.approx((1 / 3 * 3 + 1 / 3 * 3) / (3 + 2 + 2 + 3))


def test_opr_first_k_only_looks_at_the_first_k_elements():
  # Decreasing for offsets < 5, then rising again: monotone locally, not globally.
  a = distance_matrix(30, lambda d: np.where(d < 5, 10.0 - d, d))
  assert opr(a, k=5) == 0.0
  assert opr(a) > 0.3


# ------------------------------------------------------------------- direction balance (DB)


def test_db_is_lower_over_upper_mass_within_the_offset():
  n, l = 12, 3
  offset = np.arange(n)[:, None] - np.arange(n)[None, :]  # i - j
  a = np.ones((n, n))
  a[(offset > 0) & (offset <= l)] = 3.0  # keys preceding the query, within l
  a[(offset < 0) & (offset >= -l)] = 1.0  # keys following the query, within l
  a[np.abs(offset) > l] = 100.0  # outside the range: ignored
  assert db(a, l) == pytest.approx(3.0)
  assert db(a.T, l) == pytest.approx(1.0 / 3.0)
  # Unequal counts: all of offset 1 below the diagonal, nothing above but offset 2.
  b = np.zeros((4, 4))
  b[1, 0] = b[2, 1] = b[3, 2] = 1.0  # lower mass 3
  b[0, 2] = b[1, 3] = 0.5  # upper mass 1
  assert db(b, 2) == pytest.approx(3.0)
  assert db(b, 1) == float("inf")


def test_db_of_a_symmetric_matrix_is_one():
  assert db(distance_matrix(16, lambda d: 1.0 / (1.0 + d)), 20) == pytest.approx(1.0)


# ------------------------------------------------------------------- indicators and table


def test_indicators_of_an_ideal_matrix():
  a = distance_matrix(16, lambda d: np.exp(-d))
  values = indicators(a, (0, 15))
  assert set(TABLE2_COLUMNS) <= set(values)
  assert values["monotonicity_all"] == 0.0
  assert values["translation_invariance_with_cls"] == pytest.approx(0.0, abs=1e-12)
  assert values["symmetry"] == 0.0
  assert values["direction_balance"] == pytest.approx(1.0)


# Wang et al. App. E: RPE shared by heads and layers, truncated to [-64, 64]; eq. 5: on the
# keys and the values.
PAPER_SHAW = {"name": "shaw", "clip": 64, "value": True, "sharing": "layer"}


def test_paper_table2_matches_the_spec_and_rows_map_to_schemes():
  # shared/spec/RESULTS.md section 4 (Wang et al. Table 2), copied so that the tests need no
  # file outside the repository.
  assert PAPER_TABLE2["BERT-style APE"] == (0.2461, 0.0208, 0.5030, 0.0143, 0.0012, 1.1940)
  assert PAPER_TABLE2["fully-learnable RPE"] == (0.1576, 0.0048, 0.1178, 0.0007, 0.0007, 1.1930)
  assert len(PAPER_TABLE2) == 13
  assert paper_row({"name": "learned_ape"}) == "BERT-style APE"
  assert paper_row({"name": "sinusoidal_ape", "learnable": True}) == "learnable sin. APE"
  assert paper_row(({"name": "learned_ape"}, PAPER_SHAW)) == \
      "BERT-style APE + fully-learnable RPE"
  assert paper_row({"name": "diet_abs"}) is None


@pytest.mark.parametrize("scheme, row, differences", [
    (PAPER_SHAW, "fully-learnable RPE", []),
    ({"name": "shaw"}, None, ["shaw clip=16 (paper: 64)", "shaw value=False (paper: True)",
                              "shaw sharing='none' (paper: 'layer')"]),
    (PAPER_SHAW | {"sharing": "none"}, None, ["shaw sharing='none' (paper: 'layer')"]),
    ({"name": "sinusoidal_rpe"}, "fixed sin. RPE", []),  # the defaults are the paper's
    ({"name": "sinusoidal_rpe", "learnable": True}, "learnable sin. RPE", []),
    ({"name": "sinusoidal_rpe", "value": False}, None,
     ["sinusoidal_rpe value=False (paper: True)"]),
    ({"name": "sinusoidal_rpe", "clip": 16}, None, ["sinusoidal_rpe clip=16 (paper: 64)"]),
    (({"name": "sinusoidal_ape", "learnable": True}, {"name": "sinusoidal_rpe"}),
     "learnable sin. APE + fixed sin. RPE", []),
    (({"name": "learned_ape"}, {"name": "shaw", "clip": 64, "value": True}), None,
     ["shaw sharing='none' (paper: 'layer')"]),
    ({"name": "learned_ape"}, "BERT-style APE", []),
])
def test_paper_rows_name_only_the_papers_setup(scheme, row, differences):
  """A Table 2 row is named only for a config of the paper's setup; any other config has no
  row, and the differences say why."""
  assert paper_setup_differences(scheme) == differences
  assert paper_row(scheme) == row


def test_table2_puts_ours_beside_the_paper_row():
  values = dict.fromkeys(TABLE2_COLUMNS, 0.5) | {"direction_balance": 1.25}
  table = format_table2([{"label": "my run", "indicators": values,
                          "paper_row": "BERT-style APE"}], paper=False)
  lines = table.splitlines()
  ours = next(i for i, line in enumerate(lines) if line.startswith("ours: my run"))
  assert lines[ours + 1].startswith("paper: BERT-style APE")
  assert lines[ours].split()[-6:] == ["0.5000"] * 5 + ["1.2500"]
  assert lines[ours + 1].split()[-6:] == ["0.2461", "0.0208", "0.5030", "0.0143", "0.0012",
                                          "1.1940"]
  assert "learnable sin. APE + learnable sin. RPE" in format_table2([], paper=True)
