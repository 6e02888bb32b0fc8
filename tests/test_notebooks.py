"""The colab/ notebooks run top to bottom, headless, with their small settings.

Each notebook is executed by nbclient in a kernel started with this test's own
interpreter (``sys.executable``): a kernel spec written to a temporary
``JUPYTER_PATH`` folder under a name no other spec uses, so neither a user's
``python3`` spec nor the environment's decides which Python runs the cells.
``POSENC_NOTEBOOK_SMALL=1`` (inherited by the kernel) selects the quick settings.
"""

import base64
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from tests.conftest import optimised_env, require

nbformat = require("nbformat")
nbclient = require("nbclient")
require("ipykernel")
require("matplotlib")

ROOT = pathlib.Path(__file__).resolve().parent.parent
COLAB = ROOT / "colab"
NOTEBOOKS = ("quickstart.ipynb", "schemes_tour.ipynb", "compare_schemes.ipynb")
KERNEL = "posenc-notebook-test"


@pytest.fixture
def kernel(tmp_path, monkeypatch):
  """A kernel spec running ipykernel with this interpreter; returns its name."""
  spec_dir = tmp_path / "jupyter" / "kernels" / KERNEL
  spec_dir.mkdir(parents=True)
  (spec_dir / "kernel.json").write_text(json.dumps({
      "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      "display_name": f"posenc-jax tests ({sys.executable})",
      "language": "python",
  }))
  monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
  monkeypatch.setenv("POSENC_NOTEBOOK_SMALL", "1")
  monkeypatch.setenv("POSENC_NOTEBOOK_WORKDIR", str(tmp_path / "workdir"))
  monkeypatch.setenv("MPLBACKEND", "Agg")
  return KERNEL


def _outputs(nb, output_type=None):
  for cell in nb.cells:
    if cell.cell_type == "code":
      for output in cell.get("outputs", []):
        if output_type is None or output.output_type == output_type:
          yield cell, output


def _text(nb) -> str:
  return "".join(o.get("text", "") for _, o in _outputs(nb, "stream"))


def _pngs(nb) -> list[bytes]:
  return [base64.b64decode(o.data["image/png"]) for _, o in _outputs(nb)
          if "image/png" in o.get("data", {})]


def _execute(name: str, kernel_name: str, cwd: pathlib.Path):
  nb = nbformat.read(COLAB / name, as_version=4)
  client = nbclient.NotebookClient(nb, kernel_name=kernel_name, timeout=600,
                                   resources={"metadata": {"path": str(cwd)}})
  client.execute()  # raises CellExecutionError on the first failing cell
  return nb


def _check_common(nb):
  errors = [o for _, o in _outputs(nb, "error")]
  assert not errors, errors
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert all(c.execution_count for c in code), "a code cell did not run"
  text = _text(nb)
  assert "devices: [" in text  # the settings cell prints jax.devices()
  # The install cell found this checkout's package (pip skipped): the kernel runs our Python.
  assert f"posenc_jax from {ROOT / 'posenc_jax'}" in text
  for png in _pngs(nb):
    assert png.startswith(b"\x89PNG"), png[:8]


def test_quickstart_runs(kernel, tmp_path, monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", optimised_env()["XLA_FLAGS"])  # it trains: 60 -> 49 s at -O3
  nb = _execute("quickstart.ipynb", kernel, tmp_path)
  _check_common(nb)
  text = _text(nb)
  assert "SMALL = True | steps: 30" in text
  assert "step 30/30" in text and "first loss" in text  # trained through train()
  assert "Property indicators of identical-word probing" in text
  assert (tmp_path / "workdir" / "checkpoints").is_dir()
  # Loss curve, probing (with and without [CLS]/[SEP]), positional attention, position vectors.
  assert len(_pngs(nb)) == 5
  probing_cell = next(c for c in nb.cells if "identical_word_probing(" in c.source)
  assert any("image/png" in o.get("data", {}) for o in probing_cell.outputs)


def test_schemes_tour_runs(kernel, tmp_path):
  nb = _execute("schemes_tour.ipynb", kernel, tmp_path)
  _check_common(nb)
  text = _text(nb)
  for name in ("learned_ape", "t5", "diet_rel", "diet_abs", "tupe_a", "alibi", "rope"):
    assert f"\n{name} " in f"\n{text}", name
  assert "skipped diet_abs_lin" in text and "skipped segment_per_head" in text
  assert "DIET Table 6" in text and "MISMATCH" not in text
  # The positional grid, the probing grid, the rank histogram, the singular values.
  assert len(_pngs(nb)) == 4


def test_compare_schemes_runs(kernel, tmp_path):
  nb = _execute("compare_schemes.ipynb", kernel, tmp_path)
  _check_common(nb)
  text = _text(nb)
  assert "SMALL = True | schemes: bert,alibi | steps: 20 | trained at 16" in text
  assert "| alibi | 1 |" in text and "| bert | 1 |" in text  # one row per scheme
  assert "n/a: bert at 256" in text  # the learned table cannot reach 256
  assert "alibi at 64: perplexity" in text and "with sliding windows (stride 8)" in text
  results = json.loads((tmp_path / "workdir" / "results.json").read_text())
  assert not results["failed"] and results["cost"]["rows"]
  assert len(_pngs(nb)) == 1  # the extrapolation curves


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_committed_without_outputs(name):
  nb = nbformat.read(COLAB / name, as_version=4)
  nbformat.validate(nb)
  for cell in nb.cells:
    if cell.cell_type == "code":
      assert cell.outputs == [] and cell.execution_count is None, cell.id
  first_code = next(c for c in nb.cells if c.cell_type == "code")
  assert "find_spec(\"posenc_jax\")" in first_code.source  # the install cell comes first


def test_notebooks_match_their_generator():
  out = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_notebooks.py"), "--check"],
                       capture_output=True, text=True, env=os.environ.copy())
  assert out.returncode == 0, out.stdout + out.stderr


def _fresh_python(tmp_path: pathlib.Path) -> tuple[pathlib.Path, dict[str, str]]:
  """A new virtual environment's Python without posenc_jax, and an environment for it: the
  dependencies come from this test's environment (a ``.pth`` line), pip installs offline
  (``--no-deps``, ``--no-index``, no build isolation)."""
  import site  # noqa: PLC0415
  import sysconfig  # noqa: PLC0415

  env_dir = tmp_path / "venv"
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
  python = env_dir / "bin" / "python"
  purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path("
                            "'purelib'))"], capture_output=True, text=True, check=True)
  ours = sysconfig.get_path("purelib")
  assert ours in site.getsitepackages()
  (pathlib.Path(purelib.stdout.strip()) / "test_dependencies.pth").write_text(ours + "\n")
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  # PIP_NO_BUILD_ISOLATION reads inverted: "0" turns build isolation off.
  env.update(PIP_NO_DEPS="1", PIP_NO_INDEX="1", PIP_NO_BUILD_ISOLATION="0",
             PIP_DISABLE_PIP_VERSION_CHECK="1")
  return python, env


def test_install_cell_installs_from_a_clone_in_a_fresh_environment(tmp_path):
  """The notebooks' first code cell (the same in each), run by a fresh environment's Python
  with ``POSENC_JAX_SOURCE`` a local clone, installs the package so that it imports at once
  and its packaged configs run from any folder; with the placeholder source it stops with
  advice."""
  python, env = _fresh_python(tmp_path)
  cells = {next(c.source for c in nbformat.read(COLAB / name, as_version=4).cells
                if c.cell_type == "code") for name in NOTEBOOKS}
  assert len(cells) == 1
  cell = cells.pop()
  unset = subprocess.run([str(python), "-c", cell], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
  assert unset.returncode != 0 and "set SOURCE (or POSENC_JAX_SOURCE)" in unset.stderr

  clone = tmp_path / "clone"
  shutil.copytree(ROOT, clone, ignore=shutil.ignore_patterns(
      ".git", ".venv", "__pycache__", "*.egg-info", "build", "colab", "tests", "scripts"))
  run = subprocess.run([str(python), "-c", cell], cwd=tmp_path, capture_output=True, text=True,
                       env={**env, "POSENC_JAX_SOURCE": str(clone)}, timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  installed = subprocess.run([str(python), "-c", "import posenc_jax; print(posenc_jax.__file__)"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
  package = pathlib.Path(installed.stdout.strip()).parent
  assert f"posenc_jax from {package}" in run.stdout
  assert package.is_relative_to(tmp_path / "venv")
  assert (package / "configs" / "pretrain.py").is_file()
  params = subprocess.run([str(python), "-m", "posenc_jax.params", "--config=model:bert_tiny,t5"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  assert params.returncode == 0 and '"total"' in params.stdout, params.stderr[-2000:]
