"""Issues 14 and 15's measurements on a Hopper GPU, one phase per device call.

    python3 scripts/gpu_session.py PHASE [--out DIR] [--routes FILE] [--budget SECONDS]
    python3 scripts/gpu_session.py PHASE --dry_run     # print the phase's commands

Phases (each fits the device tool's 10-minute call):

- ``kernels``: ``benchmarks.routes`` in bfloat16 at L = 512, 2048, 8192 and 16384
  (``B L = 16384`` tokens; ``--lengths`` picks some), with the DIET-ABS rank 128 rows,
  adding every point to the route table ``--routes``, then the Hopper and Triton kernels
  compiled on the GPU against their float32 references (``tests/test_hopper_flash.py``,
  ``tests/test_relative_flash.py``, without the lowering-only tests) in what is left of the
  budget (the table first: it is what the package ships; the tests print each case's name,
  so a run stopped at the budget still says which cases passed).
- ``model_relative``, ``model_absolute``: whole BERT-base, L=512, B=32, bfloat16, each
  scheme against the input-APE baseline, with the route table (the relative schemes, then
  the absolute and rotary ones; ``--schemes`` picks others), with each model's compile
  seconds and the baseline's MFU.
- ``compile``: compile seconds of BERT-base with unrolled and scanned layers.

The device image has JAX, Flax, Optax, Orbax, chex and pytest but not ml-collections:
put its wheel in the ignored folder ``.gpu/whl`` and carry ``.gpu``
(``../shared/gpu/README.md``)::

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --implementation cp --platform manylinux2014_x86_64 -d .gpu/whl ml-collections==1.1.0

Each command's output goes to ``OUT/PHASE/NAME.log`` (``--out``, default ``$OUT``), and
the route table to ``OUT/PHASE/routes.json`` (copy it to ``.gpu/routes.json`` here before
the model phases' call); no
command starts once ``--budget`` seconds have passed, and each one is stopped at the
budget, so the summary (each command's exit status and seconds, then the tables the
benches printed) is always the last thing printed. Exits 1 if any command failed or was
skipped.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".gpu" / "whl"
SITE = "/tmp/site"  # where the carried wheels are installed on the device machine
TOKENS = 16384  # B L of each attention shape
LENGTHS = (512, 2048, 8192, 16384)
MODEL = ["--size", "base", "--length", "512", "--batch", "32", "--dtype", "bfloat16"]
SCHEMES = {"model_relative": "t5,diet_rel,diet_rel_share,shaw,tupe_r,alibi",
           "model_absolute": "diet_abs,diet_abs_share,tupe_a,rope"}
PHASES = ("kernels", *SCHEMES, "compile")
# Run compiled on the GPU; the tests that only lower for an accelerator already run in CI.
KERNEL_TESTS = ["tests/test_hopper_flash.py", "tests/test_relative_flash.py", "-k", "not lower"]


def commands(phase: str, routes: str, lengths=LENGTHS,
             schemes: str | None = None) -> list[tuple[str, list[str]]]:
  """``(name, argv)`` of each command of ``phase``: whole argvs, the benchmarks' ``python -m
  posenc_jax.benchmarks.<tool> ...``. ``lengths`` are the kernels phase's attention lengths,
  ``schemes`` a model phase's (default its own)."""
  module = [sys.executable, "-m"]
  if phase == "kernels":
    return [(f"attention_{length}", module + [
        "posenc_jax.benchmarks.routes", "--batch", str(TOKENS // length), "--length", str(length),
        "--dtype", "bfloat16", "--rank", "128", "--route_table", routes])
        for length in lengths] + [
        ("kernel_tests", [sys.executable, "-m", "pytest", "-v", "-n", "0", "-p",
                          "no:cacheprovider", *KERNEL_TESTS])]
  if phase in SCHEMES:
    return [(phase, module + ["posenc_jax.benchmarks.steps", *MODEL, "--schemes",
                              schemes or SCHEMES[phase]])]
  if phase == "compile":
    return [("compile", module + ["posenc_jax.benchmarks.compile", *MODEL])]
  raise ValueError(f"phase: got {phase!r}; allowed: {', '.join(PHASES)}")


def run(phase: str, out: pathlib.Path, routes: str, budget: float,
        **options) -> int:
  """Runs ``phase``'s commands (``options``: :func:`commands`' ``lengths`` and ``schemes``)
  in turn within ``budget`` seconds; prints the summary."""
  env = dict(os.environ, POSENC_JAX_ROUTE_TABLE=routes)
  wheels = sorted(glob.glob(str(WHEELS / "*.whl")))
  if wheels:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--target", SITE, *wheels], check=True)
    env["PYTHONPATH"] = os.pathsep.join([SITE, str(ROOT), env.get("PYTHONPATH", "")])
  out.mkdir(parents=True, exist_ok=True)
  pathlib.Path(routes).parent.mkdir(parents=True, exist_ok=True)
  start, summary, failed = time.monotonic(), [], False
  steps = commands(phase, routes, **options)
  for name, argv in steps:
    left = budget - (time.monotonic() - start)
    log = out / f"{name}.log"
    if left < 1:
      summary.append(f"{name}: skipped (budget of {budget:.0f} s spent)")
      failed = True
      continue
    began = time.monotonic()
    with open(log, "w") as f:
      try:
        code = subprocess.run(argv, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                              timeout=left).returncode
      except subprocess.TimeoutExpired:
        code = "stopped at the budget"
    failed |= code != 0
    summary.append(f"{name}: exit {code}, {time.monotonic() - began:.0f} s, log {log}")
  if os.path.exists(routes):  # back with the call's files, for the next phase to carry
    shutil.copy(routes, out / "routes.json")
    with open(routes) as f:
      summary.append(f"route table: {len(json.load(f).get('points', []))} points in {routes}")
  else:  # a model phase without it times the packaged table's routes alone: say so
    summary.append(f"route table: no file at {routes} (the packaged table alone)")
  print(f"== {phase}: summary", *summary, sep="\n")
  for name, _ in steps:
    log = out / f"{name}.log"
    if log.exists():  # each command's markdown table, else its last lines
      lines = log.read_text(errors="replace").splitlines()
      table = [line for line in lines if line.startswith(("|", "route table"))]
      print(f"== {name}", *table or lines[-25:], sep="\n")
  return 1 if failed else 0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("phase", choices=PHASES)
  parser.add_argument("--out", default=None, help="log folder (default $OUT, else /tmp)")
  parser.add_argument("--routes", default=str(ROOT / ".gpu" / "routes.json"),
                      help="route table the attention benches add to and the models read")
  parser.add_argument("--budget", type=float, default=570.0,
                      help="seconds the phase may take (the device call's limit is 600)")
  parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)),
                      help="kernels: comma-separated attention lengths, each dividing "
                      f"{TOKENS}")
  parser.add_argument("--schemes", default=None,
                      help="model phases: comma-separated scheme presets (default the phase's)")
  parser.add_argument("--dry_run", action="store_true", help="print the commands only")
  args = parser.parse_args(argv)
  try:
    lengths = tuple(int(n) for n in args.lengths.split(","))
  except ValueError:
    lengths = ()
  if not lengths or any(n <= 0 or TOKENS % n for n in lengths):
    parser.error(f"--lengths: got {args.lengths!r}; allowed: positive divisors of {TOKENS}")
  options = {"lengths": lengths, "schemes": args.schemes}
  if args.dry_run:
    for name, command in commands(args.phase, args.routes, **options):
      print(name, " ".join(command))
    return 0
  out = pathlib.Path(args.out or os.environ.get("OUT") or "/tmp") / args.phase
  return run(args.phase, out, args.routes, args.budget, **options)


if __name__ == "__main__":
  sys.exit(main())
