"""Cells every notebook shares: the install cell and the figure helper."""

INSTALL = '''\
# Install: pip-installs posenc-jax with its `train` and `analysis` extras from SOURCE (and, on a
# GPU or TPU runtime, JAX's plugin). Skipped when posenc_jax is already importable (a clone with
# `pip install -e ".[test]"`, a second run of this cell, or the tests).
import importlib
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys

# Where posenc-jax comes from: its git repository ("git+https://<host>/<owner>/posenc-jax.git",
# "@<tag or commit>" appended to pin it) or a folder holding a clone. Set POSENC_JAX_SOURCE or
# edit this line (colab/README.md).
SOURCE = os.environ.get("POSENC_JAX_SOURCE", "git+https://github.com/<owner>/posenc-jax.git")

if importlib.util.find_spec("posenc_jax") is None:
  if "<owner>" in SOURCE:
    raise SystemExit("set SOURCE (or POSENC_JAX_SOURCE) to posenc-jax's git URL or a clone")
  extras = "train,analysis"
  if shutil.which("nvidia-smi"):
    extras += ",cuda12"
  elif pathlib.Path("/dev/accel0").exists() or "TPU_ACCELERATOR_TYPE" in os.environ:
    extras += ",tpu"
  folder = pathlib.Path(SOURCE).expanduser()
  requirement = (f"{folder.resolve()}[{extras}]" if folder.is_dir()
                 else f"posenc-jax[{extras}] @ {SOURCE}")
  subprocess.run([sys.executable, "-m", "pip", "install", "-q", requirement], check=True)
  importlib.invalidate_caches()  # the new package is importable without a restart

import posenc_jax

print("posenc_jax from", pathlib.Path(posenc_jax.__file__).parent)
'''

SHOW = '''\
import io

from IPython.display import Image, display


def show(fig):
  """Displays a matplotlib Figure inline as a PNG.

  The analysis plots draw off-screen on their own Figure (no pyplot state), so
  the same code runs in Colab, Jupyter and headless.
  """
  buffer = io.BytesIO()
  fig.savefig(buffer, format="png")
  display(Image(buffer.getvalue()))
'''
