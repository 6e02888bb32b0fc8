"""Property indicators of a position-wise attention matrix (Wang et al. 2021, Appendix B).

All functions take an ``[L, L]`` matrix ``A`` of positive attention values
(row ``i`` = query position, column ``j`` = key position), usually the
identical-word probing matrix of :mod:`posenc_jax.analysis.probing`, and
return Python floats computed in float64 with numpy. Smaller is better for
all but direction balance (1 = balanced).

* :func:`aiv` translation invariance, average in-group variance over offsets
  ``j - i``, divided by ``Var(A)``.
* :func:`opr` monotonicity, ordered pair ratio of the forward and backward
  sequences from the diagonal (0: strictly decreasing away from the diagonal,
  1: increasing, about 0.5: random).
* :func:`sd` symmetry, mean ``|A[i,j] - A[j,i]|`` over ``i < j``.
* :func:`db` direction balance within offset ``l``.

Direction convention (checked against the paper's text, Sec. 4.2.2 and
App. B): ``DB_l = sum_{0 < i-j <= l} A[i,j] / sum_{0 < j-i <= l} A[i,j]``,
the lower triangle (keys *preceding* the query) over the upper one, so
``DB > 1`` means the model attends more to preceding tokens, as the paper
reads its Table 2 ("all PEs generally attend more to preceding tokens").

Conventions where the paper is silent: variances are population variances
(``ddof=0``); AIV is 0 when ``Var(A) = 0`` (a constant matrix is perfectly
translation invariant); sequences of one element (no pairs) are left out of
OPR; tied pairs count as not increasing (``sign(0) = 0``, as in the paper).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from posenc_jax.schemes.registry import SCHEMES

# Wang et al. Table 2: (monotonicity all offsets, first 20 offsets, translation invariance
# w/ [CLS], w/o [CLS], symmetry, direction balance). Paper Table 2 (ICLR 2021).
TABLE2_COLUMNS = ("monotonicity_all", "monotonicity_first_k", "translation_invariance_with_cls",
                  "translation_invariance_without_cls", "symmetry", "direction_balance")
PAPER_TABLE2: dict[str, tuple[float, ...]] = {
    "BERT without PE": (0.5430, 0.1393, 0.9497, 0.9939, 0.0005, 1.0136),
    "BERT-style APE": (0.2461, 0.0208, 0.5030, 0.0143, 0.0012, 1.1940),
    "fixed sin. APE": (0.1937, 0.0190, 0.2552, 0.2143, 0.0010, 1.0266),
    "learnable sin. APE": (0.1936, 0.0237, 0.0653, 0.0378, 0.0004, 1.0281),
    "fully-learnable RPE": (0.1576, 0.0048, 0.1178, 0.0007, 0.0007, 1.1930),
    "fixed sin. RPE": (0.1273, 0.0054, 0.0924, 0.0020, 0.0007, 1.1565),
    "learnable sin. RPE": (0.3157, 0.0057, 0.1397, 0.0038, 0.0014, 1.3223),
    "BERT-style APE + fully-learnable RPE": (0.1993, 0.0071, 0.2601, 0.0059, 0.0009, 1.1971),
    "BERT-style APE + fixed sin. RPE": (0.1579, 0.0143, 0.1376, 0.0072, 0.0007, 1.1302),
    "BERT-style APE + learnable sin. RPE": (0.2364, 0.0158, 0.2334, 0.0088, 0.0014, 1.3804),
    "learnable sin. APE + fully-learnable RPE": (0.1248, 0.0065, 0.0487, 0.0238, 0.0007, 1.1196),
    "learnable sin. APE + fixed sin. RPE": (0.0746, 0.0040, 0.0243, 0.0168, 0.0007, 1.0773),
    "learnable sin. APE + learnable sin. RPE": (0.1796, 0.0052, 0.0399, 0.0252, 0.0027, 1.6722),
}


def _square(a: Any) -> np.ndarray:
  a = np.asarray(a, np.float64)
  if a.ndim != 2 or a.shape[0] != a.shape[1]:
    raise ValueError(f"attention matrix: expected a square [L, L] array, got shape {a.shape}")
  return a


def drop_positions(a: Any, positions: Sequence[int]) -> np.ndarray:
  """``A`` without the rows and columns ``positions`` (e.g. [CLS] and [SEP]); negatives count
  from the end."""
  a = _square(a)
  n = a.shape[0]
  drop = {p % n for p in positions}
  keep = np.array([i for i in range(n) if i not in drop], dtype=int)
  return a[np.ix_(keep, keep)]


def aiv(a: Any, exclude: Sequence[int] = ()) -> float:
  """Average in-group variance over offsets, normalised by ``Var(A)`` (translation invariance).

  ``AIV = [sum_l Var(tau(l)) |tau(l)| / sum_l |tau(l)|] / Var(A)`` with
  ``tau(l) = {A[i, j] : j - i = l}``. A Toeplitz matrix gives 0.

  Args:
    a: ``[L, L]``.
    exclude: positions whose rows and columns are removed first (the paper's
      "w/o [CLS]" column removes [CLS] and [SEP]).
  """
  a = drop_positions(a, exclude) if exclude else _square(a)
  n = a.shape[0]
  total = a.var()
  if n < 2 or total == 0.0:
    return 0.0
  weighted = 0.0
  for offset in range(-(n - 1), n):
    group = np.diagonal(a, offset)  # A[i, i + offset]
    weighted += group.var() * group.size
  return float(weighted / a.size / total)


def _increasing_fraction(seqs: np.ndarray, lengths: np.ndarray) -> tuple[float, float]:
  """Sum over sequences of ``OPR(S) |S|`` and of ``|S|``, for sequences of 2+ elements.

  Args:
    seqs: ``[N, K]`` rows padded past their length.
    lengths: ``[N]`` valid elements per row.
  """
  k = seqs.shape[1]
  idx = np.arange(k)
  later = idx[None, :, None] > idx[None, None, :]  # [1, K(a), K(b)]: a > b
  chunk = max(1, (1 << 23) // (k * k))  # bounds the [chunk, K, K] pair arrays
  num = den = 0.0
  for start in range(0, seqs.shape[0], chunk):
    s, n = seqs[start:start + chunk], lengths[start:start + chunk]
    valid = idx[None, :] < n[:, None]  # [N, K]
    pair_valid = valid[:, :, None] & valid[:, None, :] & later
    increasing = (s[:, :, None] > s[:, None, :]) & pair_valid  # s_a > s_b with a > b
    keep = n >= 2
    ratio = increasing.sum(axis=(1, 2))[keep] / pair_valid.sum(axis=(1, 2))[keep]
    num += float((ratio * n[keep]).sum())
    den += float(n[keep].sum())
  return num, den


def opr_sequence(s: Sequence[float]) -> float:
  """``OPR(S) = sum_{a != b} sign((s_a - s_b)(a - b)) / (m^2 - m)``: 0 decreasing, 1 increasing."""
  s = np.asarray(s, np.float64)
  if s.size < 2:
    raise ValueError("opr_sequence: a sequence needs at least 2 elements")
  num, den = _increasing_fraction(s[None], np.array([s.size]))
  return num / den


def opr(a: Any, k: int | None = None) -> float:
  """Ordered pair ratio over the ``2L`` sequences from the diagonal (monotonicity).

  Row ``i`` gives ``S_{i,+} = (A[i,i], A[i,i+1], .., A[i,L-1])`` and
  ``S_{i,-} = (A[i,i], A[i,i-1], .., A[i,0])``; the result is the
  length-weighted mean of their OPRs.

  Args:
    a: ``[L, L]``.
    k: use only the first ``k`` elements of each sequence ("first k offsets";
      the paper reports k = 20); None uses all.
  """
  a = _square(a)
  n = a.shape[0]
  width = n if k is None else max(1, min(k, n))
  rows = np.arange(n)[:, None]
  steps = np.arange(width)[None, :]
  forward_cols = rows + steps
  backward_cols = rows - steps
  forward = a[rows, np.clip(forward_cols, 0, n - 1)]
  backward = a[rows, np.clip(backward_cols, 0, n - 1)]
  forward_len = np.minimum(n - np.arange(n), width)
  backward_len = np.minimum(np.arange(n) + 1, width)
  num_f, den_f = _increasing_fraction(forward, forward_len)
  num_b, den_b = _increasing_fraction(backward, backward_len)
  den = den_f + den_b
  return float((num_f + num_b) / den) if den else 0.0


def sd(a: Any) -> float:
  """Symmetrical discrepancy ``sum_{i<j} |A[i,j] - A[j,i]| / (L (L-1) / 2)`` (symmetry)."""
  a = _square(a)
  n = a.shape[0]
  if n < 2:
    return 0.0
  upper = np.triu_indices(n, 1)
  return float(np.abs(a[upper] - a.T[upper]).sum() / (n * (n - 1) / 2))


def db(a: Any, l: int = 20) -> float:  # noqa: E741 - the paper's name for the offset range
  """Direction balance within offset ``l``: preceding-key mass over succeeding-key mass.

  ``DB_l = sum_{0 < i-j <= l} A[i,j] / sum_{0 < j-i <= l} A[i,j]`` (lower over
  upper triangle); > 1 means more attention to preceding tokens.
  """
  a = _square(a)
  n = a.shape[0]
  offset = np.arange(n)[:, None] - np.arange(n)[None, :]  # i - j
  lower = a[(offset > 0) & (offset <= l)].sum()
  upper = a[(offset < 0) & (offset >= -l)].sum()
  if upper == 0.0:
    return float("inf") if lower > 0 else 1.0
  return float(lower / upper)


def indicators(a: Any, special_positions: Sequence[int] = (), *, k: int = 20,
               l: int = 20) -> dict[str, float]:  # noqa: E741
  """Every Table 2 indicator of ``A``, plus the other ones without special tokens.

  Args:
    a: ``[L, L]`` probing matrix.
    special_positions: positions of [CLS] and [SEP] (removed for the
      ``*_without_cls`` values).
    k: offsets of "monotonicity (first k offsets)".
    l: offset range of direction balance.

  Returns:
    The six :data:`TABLE2_COLUMNS` (monotonicity, symmetry and direction
    balance on the whole matrix, as the paper's table) and
    ``monotonicity_all_without_cls``, ``monotonicity_first_k_without_cls``,
    ``symmetry_without_cls``, ``direction_balance_without_cls``, and
    ``relative_spread_without_cls`` (std / mean of the entries: near 0 means a
    uniform, bag-of-words matrix whose other indicators only measure rounding).
  """
  a = _square(a)
  inner = drop_positions(a, special_positions) if special_positions else a
  return {
      "monotonicity_all": opr(a),
      "monotonicity_first_k": opr(a, k),
      "translation_invariance_with_cls": aiv(a),
      "translation_invariance_without_cls": aiv(inner),
      "symmetry": sd(a),
      "direction_balance": db(a, l),
      "monotonicity_all_without_cls": opr(inner),
      "monotonicity_first_k_without_cls": opr(inner, k),
      "symmetry_without_cls": sd(inner),
      "direction_balance_without_cls": db(inner, l),
      "relative_spread_without_cls": float(inner.std() / inner.mean()) if inner.mean() else 0.0,
  }


# Our scheme configs -> Wang et al.'s row names (single schemes; pairs are joined with " + ").
_SINGLE_ROWS = {
    ("none", False): "BERT without PE",
    ("learned_ape", False): "BERT-style APE",
    ("sinusoidal_ape", False): "fixed sin. APE",
    ("sinusoidal_ape", True): "learnable sin. APE",
    ("shaw", False): "fully-learnable RPE",
    ("sinusoidal_rpe", False): "fixed sin. RPE",
    ("sinusoidal_rpe", True): "learnable sin. RPE",
}
# Wang et al.'s setup behind the RPE rows (App. E: "we share RPE in different heads and
# layers", truncated to [-64, 64]; eq. 5 adds the RPE to the keys and the values). Shaw's
# table is always shared by the heads; the sinusoidal one is a function of the offset alone,
# shared by heads and layers by construction.
PAPER_SETUP: dict[str, dict[str, Any]] = {
    "shaw": {"clip": 64, "value": True, "sharing": "layer"},
    "sinusoidal_rpe": {"clip": 64, "value": True},
}


def _parts(scheme: Any) -> tuple[dict[str, Any], ...]:
  return tuple(dict(p) for p in (scheme if isinstance(scheme, (tuple, list)) else (scheme,)))


def paper_setup_differences(scheme: Any) -> list[str]:
  """How a scheme config (a mapping or a tuple of them) departs from the setup of Wang et
  al.'s Table 2 (:data:`PAPER_SETUP`), the registry's defaults filled in.

  Returns:
    One ``"<name> <field>=<ours> (paper: <theirs>)"`` per differing field; empty when the
    config is the paper's setup (always for the APE rows).
  """
  differences = []
  for part in _parts(scheme):
    name = part.pop("name")
    setup = PAPER_SETUP.get(name, {})
    values = SCHEMES[name].values(part) if setup else {}
    differences += [f"{name} {field}={values[field]!r} (paper: {paper!r})"
                    for field, paper in setup.items() if values[field] != paper]
  return differences


def paper_row(scheme: Any) -> str | None:
  """The Table 2 row of a scheme config (a mapping or a tuple of two), or None if no row has
  its setup.

  ``learned_ape`` is "BERT-style APE", ``shaw`` "fully-learnable RPE",
  ``sinusoidal_ape``/``sinusoidal_rpe`` the fixed or learnable sinusoidal rows. The RPE rows
  need the paper's setup (:func:`paper_setup_differences` lists what differs): ``shaw`` with
  ``clip=64, value=True, sharing='layer'`` (its defaults, clip 16 per layer without the
  value term, have no row), ``sinusoidal_rpe`` with ``clip=64, value=True`` (its defaults).
  """
  if paper_setup_differences(scheme):
    return None
  names = []
  for part in _parts(scheme):
    key = (part["name"], bool(part.get("learnable", False)))
    if key not in _SINGLE_ROWS:
      return None
    names.append(_SINGLE_ROWS[key])
  row = " + ".join(names)
  return row if row in PAPER_TABLE2 else None


def format_table2(ours: Sequence[dict[str, Any]], *, paper: bool = True, k: int = 20) -> str:
  """Our indicators in the layout of Wang et al. Table 2, each beside the paper's matching row.

  Args:
    ours: dicts with ``label``, ``indicators`` (from :func:`indicators`) and
      optionally ``paper_row`` (a key of :data:`PAPER_TABLE2`).
    paper: append the paper's full table.
    k: the "first k offsets" of the header.
  """
  name_width = max([44] + [len(str(r["label"])) + 8 for r in ours])
  header = (f"{'PEs':<{name_width}}{'monotonicity':>24}{'translation invariance':>26}"
            f"{'symmetry':>10}{'direction':>11}\n"
            f"{'':<{name_width}}{'all offsets':>12}{f'first {k}':>12}{'w/ [CLS]':>13}"
            f"{'w/o [CLS]':>13}{'':>10}{'balance':>11}")
  rule = "-" * (name_width + 81)

  def line(name, values):
    widths = (12, 12, 13, 13, 10, 11)
    return f"{name:<{name_width}}" + "".join(f"{v:>{w}.4f}" for v, w in zip(values, widths))

  lines = ["Property indicators of identical-word probing (Wang et al. 2021, Table 2 layout)",
           header, rule]
  for row in ours:
    lines.append(line(f"ours: {row['label']}",
                      [row["indicators"][c] for c in TABLE2_COLUMNS]))
    if row.get("paper_row") in PAPER_TABLE2:
      lines.append(line(f"paper: {row['paper_row']}", PAPER_TABLE2[row["paper_row"]]))
  if paper:
    lines.append(rule)
    lines.append("Wang et al. (2021) Table 2 (BERT-base, trained):")
    for name, values in PAPER_TABLE2.items():
      lines.append(line(name, values))
  return "\n".join(lines)
