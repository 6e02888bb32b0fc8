"""scripts/gpu_session.py, the measurement plan for a Hopper GPU: its bench commands pass the
bench's own flag checks, its kernel tests select the compiled value tests, and a phase keeps
to its time budget and still prints its summary last."""

import importlib
import pathlib
import subprocess
import sys

import pytest

from posenc_jax.benchmarks import routes

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_session  # noqa: E402


@pytest.mark.parametrize("phase", gpu_session.PHASES)
def test_every_bench_command_passes_the_bench_flag_checks(phase, tmp_path):
  benches = [(importlib.import_module(argv[2]), argv[3:])
             for _, argv in gpu_session.commands(phase, str(tmp_path / "routes.json"))
             if argv[2].startswith("posenc_jax.benchmarks.")]
  assert benches
  for bench, argv in benches:
    args = bench.parse_args(argv)
    assert args.dtype == "bfloat16" and (bench is routes or args.size in ("base", ("base",)))
  if phase == "kernels":
    assert [bench.parse_args(a).length for bench, a in benches] == list(gpu_session.LENGTHS)


def test_the_kernel_tests_are_the_compiled_value_tests():
  proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p",
                         "no:cacheprovider", *gpu_session.KERNEL_TESTS], cwd=ROOT,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-2000:]
  ids = [line for line in proc.stdout.splitlines() if "::" in line]
  assert any("test_forward_matches_the_float32_reference" in i for i in ids)
  assert any("test_hopper_flash.py::test_gradients_through_the_triton_backward" in i
             for i in ids)
  assert not any("lower" in i for i in ids) and len(ids) > 100


def test_the_kernel_tests_leave_interpret_mode_to_the_backend():
  """On the GPU they must compile: a test that forced ``interpret=True`` ran Pallas' interpreter
  there instead, and one such case took over 150 s on an H100 (2026-11-25) and stopped the
  phase at its budget."""
  for path in gpu_session.KERNEL_TESTS[:2]:
    text = (ROOT / path).read_text()
    assert "interpret=True" not in text.replace(" ", ""), path


def test_a_phase_keeps_to_its_budget_and_prints_its_summary_last(tmp_path, monkeypatch,
                                                                  capsys):
  steps = [("quick", [sys.executable, "-c", "print('| row | 1 |')"]),
           ("slow", [sys.executable, "-c", "import time; time.sleep(30)"]),
           ("late", [sys.executable, "-c", "print('never')"])]
  monkeypatch.setattr(gpu_session, "commands", lambda phase, routes, **options: steps)
  monkeypatch.setattr(gpu_session, "WHEELS", tmp_path / "no_wheels")
  routes = tmp_path / "gpu" / "routes.json"
  code = gpu_session.run("kernels", tmp_path / "out", str(routes), budget=3.0)
  text = capsys.readouterr().out
  assert code == 1 and routes.parent.is_dir()
  summary = text[text.index("== kernels: summary"):].splitlines()
  assert summary[1].startswith("quick: exit 0,")
  assert summary[2].startswith("slow: exit stopped at the budget,")
  assert summary[3] == "late: skipped (budget of 3 s spent)"
  assert summary[4] == f"route table: no file at {routes} (the packaged table alone)"
  assert "== quick\n| row | 1 |" in text and not (tmp_path / "out" / "late.log").exists()
