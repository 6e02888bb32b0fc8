"""scripts/gpu_session.py, the measurement plan for a Hopper GPU: its bench commands pass the
bench's own flag checks, its kernel tests select the compiled value tests, and a phase keeps
to its time budget and still prints its summary last."""

import importlib
import pathlib
import subprocess
import sys

import pytest

from posenc_jax.benchmarks import routes, steps

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
    assert args.dtype == "bfloat16" and (bench is routes or args.size in ("base", ("base",))
                                         or phase in ("issue40", "issue51"))  # BERT-small, 8k
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


def test_issue40_lists_the_anchors_first_then_its_shapes(capsys):
  assert gpu_session.main(["issue40", "--dry_run"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert [line.split()[0] for line in lines] == [
      "torch_flex_alibi", "hf_bert", "attention_8192", "attention_512", "model_small_8192",
      "model_base_512"]
  assert lines[0].endswith("/.gpu/torch_flex_alibi.py 2 8192 12 64")
  assert lines[1].endswith("/.gpu/hf_bert.py 110")
  argvs = [argv for _, argv in gpu_session.commands("issue40", "routes.json")]
  attention = [routes.parse_args(argv[3:]) for argv in argvs[2:4]]
  assert [(a.batch, a.length, a.heads, a.head_dim, a.dtype) for a in attention] == [
      (2, 8192, 12, 64, "bfloat16"), (32, 512, 12, 64, "bfloat16")]
  models = [steps.parse_args(argv[3:]) for argv in argvs[4:]]
  assert [(m.size, m.length, m.batch, m.dtype, m.step, m.baseline) for m in models] == [
      ("small", 8192, 2, "bfloat16", "trainer", "none"),
      ("base", 512, 32, "bfloat16", "trainer", "bert")]
  assert models[0].schemes == ("none", "alibi", "kerple_log", "fire", "fox")
  assert models[1].schemes == ("bert", "alibi", "kerple_log", "t5", "cope", "fire")


def test_issue51_times_the_channel_rows_causal_and_the_causal_lms(capsys):
  assert gpu_session.main(["issue51", "--dry_run"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert [line.split()[0] for line in lines] == [
      "torch_flex_alibi", "attention_causal_8192", "attention_causal_512", "attention_8192",
      "lm_small_8192"]
  argvs = [argv for _, argv in gpu_session.commands("issue51", "routes.json")]
  attention = [routes.parse_args(argv[3:]) for argv in argvs[1:4]]
  assert [(a.batch, a.length, a.causal, a.dtype) for a in attention] == [
      (2, 8192, True, "bfloat16"), (32, 512, True, "bfloat16"), (2, 8192, False, "bfloat16")]
  lm = steps.parse_args(argvs[4][3:])
  assert (lm.size, lm.length, lm.batch, lm.model, lm.baseline, lm.schemes) == (
      "small", 8192, 2, "lm", "none", ("none", "alibi", "fox"))
  names = [k.name for k in routes.ATTENTION_KERNELS]
  assert "cudnn alibi channels" in names and "cudnn fox channels" in names
  assert {"pallas alibi closed hopper", "pallas kerple_log closed hopper",
          "pallas kerple_power closed hopper", "pallas t5 closed hopper"} <= set(names)


def test_issue40_keeps_to_9_minutes_by_default(tmp_path, monkeypatch):
  budgets = []
  monkeypatch.setattr(gpu_session, "run", lambda phase, out, routes, budget, **options:
                      budgets.append((phase, budget)) or 0)
  for phase in ("issue40", "compile"):
    gpu_session.main([phase, "--out", str(tmp_path)])
  gpu_session.main(["issue40", "--out", str(tmp_path), "--budget", "100"])
  assert budgets == [("issue40", 540.0), ("compile", 570.0), ("issue40", 100.0)]


def test_an_absent_anchor_is_skipped_with_a_line_saying_so(tmp_path, monkeypatch, capsys):
  anchors = tmp_path / "gpu"
  anchors.mkdir()
  (anchors / "hf_bert.py").write_text("import os, sys; print('| hf |', sys.argv[1], "
                                      "os.environ['OUT'], '|')")
  monkeypatch.setattr(gpu_session, "ANCHORS", anchors)
  monkeypatch.setattr(gpu_session, "WHEELS", tmp_path / "no_wheels")
  both = gpu_session.commands("issue40", "routes.json")[:2]
  monkeypatch.setattr(gpu_session, "commands", lambda phase, routes, **options: both)
  out = tmp_path / "out"
  code = gpu_session.run("issue40", out, str(tmp_path / "routes.json"), budget=60.0)
  text = capsys.readouterr().out
  summary = text[text.index("== issue40: summary"):].splitlines()
  assert code == 1
  assert summary[1] == (f"torch_flex_alibi: skipped ({anchors}/torch_flex_alibi.py is absent: "
                        "copy ../shared/gpu/torch_flex_alibi.py there and carry its folder, "
                        "../shared/gpu/README.md)")
  assert summary[2].startswith("hf_bert: exit 0,")
  assert f"== hf_bert\n| hf | 110 {out} |" in text  # the anchors write beside the logs


def test_the_commands_read_the_route_table_once_it_exists(tmp_path, monkeypatch, capsys):
  """The benches refuse a $POSENC_JAX_ROUTE_TABLE naming a missing file, so a phase names it
  only once the table is there (the kernels phase's first bench makes it)."""
  routes = tmp_path / "routes.json"
  show = [sys.executable, "-c",
          "import os; print('|', os.environ.get('POSENC_JAX_ROUTE_TABLE'), '|')"]
  make = [sys.executable, "-c", f"open({str(routes)!r}, 'w').write('{{\"points\": []}}')"]
  monkeypatch.setattr(gpu_session, "commands", lambda phase, routes, **options: [
      ("before", show), ("make", make), ("after", show)])
  monkeypatch.setattr(gpu_session, "WHEELS", tmp_path / "no_wheels")
  monkeypatch.setenv("POSENC_JAX_ROUTE_TABLE", str(tmp_path / "missing.json"))
  assert gpu_session.run("kernels", tmp_path / "out", str(routes), budget=60.0) == 0
  text = capsys.readouterr().out
  assert "== before\n| None |" in text and f"== after\n| {routes} |" in text
