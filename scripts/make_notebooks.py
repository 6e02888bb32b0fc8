"""Writes colab/*.ipynb from the cell sources in scripts/notebooks/ (outputs cleared,
deterministic ids).

  python scripts/make_notebooks.py           # (re)write colab/*.ipynb
  python scripts/make_notebooks.py --check   # exit 1 if a committed notebook differs

The notebooks are reviewed there, as Python strings (one module per notebook, the shared
cells in notebooks/cells.py); the .ipynb files are this script's output
(tests/test_notebooks.py checks they are up to date and runs them headless with their small
settings).
"""

from __future__ import annotations

import pathlib
import sys

import nbformat

from notebooks.compare_schemes import COMPARE
from notebooks.quickstart import QUICKSTART
from notebooks.schemes_tour import TOUR

COLAB = pathlib.Path(__file__).resolve().parent.parent / "colab"

NOTEBOOKS = {"quickstart.ipynb": QUICKSTART, "schemes_tour.ipynb": TOUR,
             "compare_schemes.ipynb": COMPARE}


def build(cells: list[tuple[str, str]], stem: str) -> nbformat.NotebookNode:
  """A notebook of ``cells`` with ids ``<stem>-NN`` and no outputs."""
  nb = nbformat.v4.new_notebook()
  nb.metadata = {
      "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
      "language_info": {"name": "python"},
      "colab": {"provenance": []},
  }
  new = {"markdown": nbformat.v4.new_markdown_cell, "code": nbformat.v4.new_code_cell}
  for i, (kind, source) in enumerate(cells):
    cell = new[kind](source.rstrip("\n"))
    cell.id = f"{stem}-{i:02d}"
    nb.cells.append(cell)
  nbformat.validate(nb)
  return nb


def render(name: str) -> str:
  return nbformat.writes(build(NOTEBOOKS[name], pathlib.Path(name).stem.replace("_", "-")),
                         version=4) + "\n"


def main(argv: list[str]) -> int:
  check = "--check" in argv
  stale = []
  for name in NOTEBOOKS:
    path = COLAB / name
    text = render(name)
    if check:
      if not path.exists() or path.read_text(encoding="utf-8") != text:
        stale.append(name)
    else:
      path.parent.mkdir(parents=True, exist_ok=True)
      path.write_text(text, encoding="utf-8")
      print(f"wrote {path}")
  if stale:
    print(f"out of date: {', '.join(stale)} (run python scripts/make_notebooks.py)")
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
