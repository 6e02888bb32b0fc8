"""The GPU measurements of issues 14, 15 and 40 on a Hopper GPU, one phase per device call.

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
- ``issue40``: issue 40's figures in one call (default budget 540 s), in this order: the
  PyTorch anchors, FlexAttention at B=2 L=8192 H=12 D=64 (``.gpu/torch_flex_alibi.py 2 8192
  12 64``) and Hugging Face BERT-base eager and under torch.compile (``.gpu/hf_bert.py 110``);
  attention alone (``benchmarks.routes``, bfloat16, H=12 D=64, every kernel against cuDNN
  without a bias) at B=2 L=8192 and B=32 L=512; whole BERT-small at B=2 L=8192 (``none``,
  ``alibi``, ``kerple_log``, ``fire``, ``fox`` against ``--baseline none``); whole BERT-base
  at B=32 L=512 (``bert``, ``alibi``, ``kerple_log``, ``t5``, ``cope``, ``fire`` against
  ``bert``). The models run the trainer's own step (``benchmarks.steps --step trainer``).
  The anchors are the user's copies of ``../shared/gpu/hf_bert.py`` and
  ``torch_flex_alibi.py`` in the ignored ``.gpu/`` (``../shared/gpu/README.md``); one that is
  absent is skipped with a line saying so, and the phase goes on. The anchors write their
  JSON beside the logs. The device command (carry ``.gpu``)::

      python3 scripts/gpu_session.py issue40

- ``issue51``: the separable causal terms folded into q/k channels for cuDNN
  (``posenc_jax/terms/channels.py``), in one call (default budget 540 s): FlexAttention's
  ALiBi anchor at B=2 L=8192; causal attention alone (``benchmarks.routes --causal``: the
  ``cudnn alibi channels`` and ``cudnn fox channels`` rows against cuDNN without a bias) at
  B=2 L=8192 and B=32 L=512; attention alone without a mask at B=2 L=8192 (the closed
  forms, non-causal ALiBi and KERPLE, in the tiles of both Hopper passes: the ``pallas
  <form> closed hopper`` rows); the causal LMs at BERT-small dims, B=2 L=8192 (``none``,
  ``alibi``, ``fox`` against ``none``, ``benchmarks.steps --model lm``). The targets: the
  channel rows and the LMs at most 1.15x their no-bias baselines::

      python3 scripts/gpu_session.py issue51

The device image has JAX, Flax, Optax, Orbax, chex and pytest but not ml-collections:
put its wheel in the ignored folder ``.gpu/whl`` and carry ``.gpu``
(``../shared/gpu/README.md``)::

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --implementation cp --platform manylinux2014_x86_64 -d .gpu/whl ml-collections==1.1.0

openxla/tokamax (the routes bench's ``tokamax`` rows, issue 51's base-kernel candidate) is
not in the image either; carry its wheel and those of the packages it imports that the image
lacks (about 27 MB; the rows say what is missing where one is)::

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --implementation cp --platform manylinux2014_x86_64 -d .gpu/whl tokamax==0.0.17 \\
        qwix==0.1.8 pydantic==2.14.4 pydantic-core==2.50.5 typing-inspection==0.4.5 \\
        annotated-types==0.8.0 immutabledict==4.3.1 jaxtyping==0.3.11 wadler-lindig==0.1.8 \\
        einshape==1.0 fire==0.7.1 termcolor==3.3.0 six==1.17.0 tqdm==4.70.1 xprof==2.22.1

Each command's output goes to ``OUT/PHASE/NAME.log`` (``--out``, default ``$OUT``), and
the route table to ``OUT/PHASE/routes.json`` (copy it to ``.gpu/routes.json`` here before
the model phases' call); the commands read the route table ``--routes`` through
``$POSENC_JAX_ROUTE_TABLE`` once the file exists (before that, the packaged points alone). No
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
ANCHORS = ROOT / ".gpu"  # the user's copies of ../shared/gpu's PyTorch anchors
SITE = "/tmp/site"  # where the carried wheels are installed on the device machine
TOKENS = 16384  # B L of each attention shape
LENGTHS = (512, 2048, 8192, 16384)
MODEL = ["--size", "base", "--length", "512", "--batch", "32", "--dtype", "bfloat16"]
SCHEMES = {"model_relative": "t5,diet_rel,diet_rel_share,shaw,tupe_r,alibi",
           "model_absolute": "diet_abs,diet_abs_share,tupe_a,rope"}
PHASES = ("kernels", *SCHEMES, "compile", "issue40", "issue51")
BUDGETS = {"issue40": 540.0, "issue51": 540.0}  # seconds; the other phases 570 (the device call's limit: 600)
# Run compiled on the GPU; the tests that only lower for an accelerator already run in CI.
KERNEL_TESTS = ["tests/test_hopper_flash.py", "tests/test_relative_flash.py", "-k", "not lower"]
# Issue 40: the attention shapes (B, L; H=12, D=64) and the whole models (size, L, B, baseline,
# schemes, the baseline's own row first).
ISSUE40_ATTENTION = ((2, 8192), (32, 512))
ISSUE40_MODELS = (("small", 8192, 2, "none", "none,alibi,kerple_log,fire,fox"),
                  ("base", 512, 32, "bert", "bert,alibi,kerple_log,t5,cope,fire"))
# Issue 51: causal attention alone (the channel rows against cuDNN without a bias), then the
# causal LMs of causal ALiBi and FoX against no position, at the same shapes.
ISSUE51_LM = ("small", 8192, 2, "none", "none,alibi,fox")


def absent_script(argv: list[str]) -> str | None:
  """The script ``argv`` runs (``python3 path.py ...``) when it is not there, else None."""
  script = argv[1] if len(argv) > 1 and argv[1].endswith(".py") else None
  return script if script and not os.path.exists(script) else None


def commands(phase: str, routes: str, lengths=LENGTHS,
             schemes: str | None = None) -> list[tuple[str, list[str]]]:
  """``(name, argv)`` of each command of ``phase``: whole argvs, the benchmarks' ``python -m
  posenc_jax.benchmarks.<tool> ...`` (and ``issue40``'s anchors, ``python3 .gpu/<script>.py
  ...``). ``lengths`` are the kernels phase's attention lengths, ``schemes`` a model phase's
  (default its own)."""
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
  if phase == "issue40":  # the anchors first, then attention alone, then the whole models
    return [
        ("torch_flex_alibi", [sys.executable, str(ANCHORS / "torch_flex_alibi.py"),
                              "2", "8192", "12", "64"]),
        ("hf_bert", [sys.executable, str(ANCHORS / "hf_bert.py"), "110"]),
        *[(f"attention_{length}", module + [
            "posenc_jax.benchmarks.routes", "--batch", str(batch), "--length", str(length),
            "--heads", "12", "--head_dim", "64", "--dtype", "bfloat16"])
          for batch, length in ISSUE40_ATTENTION],
        *[(f"model_{size}_{length}", module + [
            "posenc_jax.benchmarks.steps", "--size", size, "--length", str(length), "--batch",
            str(batch), "--dtype", "bfloat16", "--step", "trainer", "--baseline", baseline,
            "--schemes", schemes])
          for size, length, batch, baseline, schemes in ISSUE40_MODELS]]
  if phase == "issue51":  # the anchors, causal attention alone, the causal LMs
    size, length, batch, baseline, schemes = ISSUE51_LM
    return [
        ("torch_flex_alibi", [sys.executable, str(ANCHORS / "torch_flex_alibi.py"),
                              "2", "8192", "12", "64"]),
        *[(f"attention_causal_{length}", module + [
            "posenc_jax.benchmarks.routes", "--batch", str(batch), "--length", str(length),
            "--heads", "12", "--head_dim", "64", "--dtype", "bfloat16", "--causal"])
          for batch, length in ISSUE40_ATTENTION],
        # Non-causal: the closed forms in the Hopper passes' tiles (pallas <form> closed
        # hopper) against the Triton tiles' and the band's.
        ("attention_8192", module + [
            "posenc_jax.benchmarks.routes", "--batch", "2", "--length", "8192", "--heads", "12",
            "--head_dim", "64", "--dtype", "bfloat16"]),
        (f"lm_{size}_{length}", module + [
            "posenc_jax.benchmarks.steps", "--size", size, "--length", str(length), "--batch",
            str(batch), "--dtype", "bfloat16", "--step", "trainer", "--model", "lm",
            "--baseline", baseline, "--schemes", schemes])]
  raise ValueError(f"phase: got {phase!r}; allowed: {', '.join(PHASES)}")


def run(phase: str, out: pathlib.Path, routes: str, budget: float,
        **options) -> int:
  """Runs ``phase``'s commands (``options``: :func:`commands`' ``lengths`` and ``schemes``)
  in turn within ``budget`` seconds; prints the summary. A command's script that is absent
  (an anchor not copied into ``.gpu/``) is skipped with a line saying so. The commands read
  the route table ``routes`` (``$POSENC_JAX_ROUTE_TABLE``) once it exists: the benches
  refuse a variable naming a missing file."""
  env = {k: v for k, v in os.environ.items() if k != "POSENC_JAX_ROUTE_TABLE"}
  env["OUT"] = str(out)  # the anchors write their JSON beside the logs
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
    absent = absent_script(argv)
    if absent or left < 1:
      summary.append(f"{name}: skipped (" + (
          f"{absent} is absent: copy ../shared/gpu/{os.path.basename(absent)} there and carry "
          "its folder, ../shared/gpu/README.md)" if absent else
          f"budget of {budget:.0f} s spent)"))
      failed = True
      continue
    began = time.monotonic()
    tables = dict(POSENC_JAX_ROUTE_TABLE=routes) if os.path.exists(routes) else {}
    with open(log, "w") as f:
      try:
        code = subprocess.run(argv, cwd=ROOT, env=env | tables, stdout=f,
                              stderr=subprocess.STDOUT, timeout=left).returncode
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
  parser.add_argument("--budget", type=float, default=None,
                      help="seconds the phase may take (default 570, issue40 540; the device "
                      "call's limit is 600)")
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
      if absent_script(command):
        print(f"{name}: {absent_script(command)} is absent here", file=sys.stderr)
    return 0
  out = pathlib.Path(args.out or os.environ.get("OUT") or "/tmp") / args.phase
  budget = BUDGETS.get(args.phase, 570.0) if args.budget is None else args.budget
  return run(args.phase, out, args.routes, budget, **options)


if __name__ == "__main__":
  sys.exit(main())
