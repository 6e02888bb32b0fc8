"""The measured tables under docs/results/ are what their results.json says: each results.md
is rebuilt from the results.json beside it (as ``compare`` wrote both), so no number in a
results page is typed by hand."""

import json
import pathlib

import pytest

from posenc_jax.comparison import pages

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "results"
PAGES = sorted(RESULTS.glob("**/results.json"))


def test_there_are_measured_pages():
  assert PAGES, f"no results.json under {RESULTS}"


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.parent.relative_to(RESULTS)))
def test_each_results_md_is_rebuilt_from_its_results_json(path):
  summary = json.loads(path.read_text())
  assert (path.parent / "results.md").read_text() == pages.markdown(summary)
  assert summary["provenance"]["command"].startswith("python -m posenc_jax.compare")
  for table in summary["tables"]:
    if table["protocol"] == "extrapolation" and table["about"]["task"] == "python_stdlib_lm":
      from posenc_jax.data import stdlib_corpus  # noqa: PLC0415
      assert table["about"]["corpus_sha256"] == stdlib_corpus.CONTENT_SHA256


def test_the_readme_tables_are_results_pages_own():
  """Each table the README shows (between ``<!-- results: PAGE -->`` and
  ``<!-- /results -->``): its lines are those of the results.md it names, with its command
  and wall time."""
  readme = (RESULTS.parents[1] / "README.md").read_text()
  starts = [i for i in range(len(readme)) if readme.startswith("<!-- results: ", i)]
  assert starts
  for start in starts:
    source = readme[start + len("<!-- results: "):readme.index(" -->", start)]
    block = readme[readme.index("\n", start) + 1:readme.index("<!-- /results -->", start)]
    table = [line for line in block.splitlines() if line.startswith("|")]
    page = (RESULTS.parents[1] / source).read_text().splitlines()
    assert len(table) > 4 and all(line in page for line in table), source
    summary = json.loads((RESULTS.parents[1] / source).with_suffix(".json").read_text())
    command = summary["provenance"]["command"]
    assert command.partition(" --workdir=")[0] in block, source  # its ROOT shortened
    assert f"{summary['provenance']['seconds'] / 60:.0f} min" in block, source
