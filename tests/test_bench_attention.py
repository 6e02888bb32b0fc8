"""``python -m posenc_jax.benchmarks.routes``: the side-by-side kernel table (issue 14).

On CPU the Pallas kernels interpret and cuDNN is absent, so the run here is tiny
(B=1, L=32, H=2, D=16, one repeat) and checks the table's shape: every kernel a row,
cuDNN rows ``n/a``, the ratios to the XLA fallback baseline, the JSON the same numbers.
What a GPU would reject at trace time is checked by lowering each kernel's forward and
backward pass for CUDA (stubs answer as an H100, as in test_accelerator_lowering.py).
"""

import importlib.machinery
import json
import pathlib
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.cudnn import fused_attention_stablehlo
from jax._src.pallas.triton import gpu_info

from posenc_jax import attention, route_table
from posenc_jax.benchmarks import routes as bench
from posenc_jax.kernels import blocks

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHAPE = dict(batch=1, length=32, heads=2, head_dim=16)
ARGS = ["--batch", "1", "--length", "32", "--heads", "2", "--head_dim", "16", "--repeats", "1"]
NAMES = [kernel.name for kernel in bench.ATTENTION_KERNELS]
# Rows that do not run in this float32 CPU run, and why.
NOT_HERE = {"cudnn no bias": "backend cpu has no cuDNN", "cudnn bias": "backend cpu has no cuDNN",
            **dict.fromkeys((route_table.HOPPER_ROW, bench.HOPPER_ONE_ROW,
                             route_table.HOPPER_BOTH_ROW,
                             *(bench.CLOSED_HOPPER_ROW.format(form)
                               for form, _, _ in bench.CLOSED_FORMS)),
                            "takes bfloat16/float16 and head dims padded to multiples of 64 "
                            "within shared memory; got float32, D=16"),
            **{kernel.name: bench.tokamax_unsupported()
               for kernel in bench.ATTENTION_KERNELS if kernel.family == "tokamax"}}


def _table(stdout: str) -> dict[str, list[str]]:
  """The markdown table's rows: kernel name -> its cells after the name."""
  lines = [line for line in stdout.splitlines() if line.startswith("| ")][1:]  # no title row
  return {cells[0]: cells[1:] for cells in
          ([c.strip() for c in line.strip().strip("|").split("|")] for line in lines)}


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("bench") / "attention.json"
  proc = subprocess.run([sys.executable, "-m", bench.__name__, *ARGS, "--json", str(out)],
                        cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout, json.loads(out.read_text())


def test_every_kernel_is_a_row_and_cudnn_is_na_on_cpu(cpu_run):
  stdout, _ = cpu_run
  table = _table(stdout)
  assert list(table) == NAMES
  assert "ratio to: xla no bias (cudnn no bias: n/a, backend cpu has no cuDNN)" in stdout
  for name, cells in table.items():
    if name.endswith(" channels"):  # causal only, and on a GPU in bfloat16
      assert cells[1].startswith("n/a (attend plans route fused: kernel"), cells
      continue
    if name in NOT_HERE:
      assert cells[1] == f"n/a ({NOT_HERE[name]})" and not any(cells[2:]), cells
      continue
    numbers = [float(c) for c in cells[1:]]  # fwd ms, TFLOP/s, ratio; fwd+bwd the same
    assert len(numbers) == 6 and all(x > 0 for x in numbers), (name, cells)
  assert table["xla no bias"][3] == table["xla no bias"][6] == "1.00"
  assert table["pallas toeplitz"][0] == "offsets [H, 2L-1]"
  assert table["xla bias"][0] == "materialised [1, H, L, L]"


def test_json_holds_the_table(cpu_run):
  stdout, saved = cpu_run
  table = _table(stdout)
  assert saved["mode"] == "attention" and saved["backend"] == "cpu"
  assert {k: saved[k] for k in SHAPE} == SHAPE and saved["dtype"] == "float32"
  assert saved["causal"] is False and saved["ratio_to"] == "xla no bias"
  assert saved["flops"] == {"fwd": 4.0 * 1 * 2 * 32 * 32 * 16, "fwd_bwd": 14.0 * 2 * 32 * 32 * 16}
  assert [row["kernel"] for row in saved["rows"]] == NAMES
  plans = {row["kernel"]: row["plan"] for row in saved["rows"]}
  assert plans["pallas toeplitz band"] is plans[bench.HOPPER_ONE_ROW] is None  # kernel variants
  assert plans["pallas toeplitz"].startswith("route fused: kernel, q/k width 16 | term Toeplitz: "
                                             "kernel | kernel: Triton gather tiles")
  assert plans["xla bias"].startswith("route reference: reference, q/k width 16 | term "
                                      "Toeplitz: logits")
  for row in saved["rows"]:
    cells = table[row["kernel"]]
    assert row["bias"] == cells[0]
    for mode, at in (("fwd", 1), ("fwd_bwd", 4)):
      if row["kernel"].endswith(" channels"):  # n/a here: see the test above
        assert row[f"{mode}_ms"] is None and row[f"{mode}_na"].startswith("attend plans")
        continue
      if row["kernel"] in NOT_HERE:
        assert row[f"{mode}_ms"] is None and row[f"{mode}_na"] == NOT_HERE[row["kernel"]]
        continue
      assert row[f"{mode}_na"] is None and row[f"{mode}_calls"] >= 1
      assert f"{row[f'{mode}_ms']:.3f}" == cells[at]
      assert f"{row[f'{mode}_tflops']:.3g}" == cells[at + 1]
      assert f"{row[f'{mode}_ratio']:.2f}" == cells[at + 2]
      flops = saved["flops"][mode]
      assert row[f"{mode}_tflops"] == pytest.approx(flops / (row[f"{mode}_ms"] / 1e3) / 1e12)


def test_flops_follow_flash_attention():
  full = bench.attention_flops(2, 128, 12, 64, causal=False)
  assert full == {"fwd": 4.0 * 2 * 12 * 128 * 128 * 64, "fwd_bwd": 3.5 * full["fwd"]}
  half = bench.attention_flops(2, 128, 12, 64, causal=True)
  assert half == {"fwd": full["fwd"] / 2, "fwd_bwd": full["fwd_bwd"] / 2}


def test_a_kernel_that_fails_is_a_row_not_a_crash(monkeypatch, capsys, tmp_path):
  """A kernel that raises while compiling (here: every Pallas row, the kernel variants' direct
  calls and attend's) is ``n/a (<reason>)``."""

  def broken(*args, **kwargs):
    raise ValueError("no kernel today\nsecond line | dropped")

  monkeypatch.setattr(bench, "relative_flash_attention", broken)
  monkeypatch.setattr(attention, "relative_flash_attention", broken)
  rows = bench.main([*ARGS, "--json", str(tmp_path / "out.json")])
  table = _table(capsys.readouterr().out)
  for name in ("pallas toeplitz", "pallas toeplitz dropout", "pallas no bias"):
    assert table[name][1:] == ["n/a (ValueError: no kernel today)"] + [""] * 5
  assert float(table["xla bias"][1]) > 0
  assert [r["kernel"] for r in rows] == NAMES
  assert rows[0]["fwd_na"] == rows[0]["fwd_bwd_na"] == "ValueError: no kernel today"


@pytest.fixture
def like_h100(monkeypatch):
  """JAX's backend reads "gpu"; cuDNN and Pallas' Triton lowering answer as for an H100."""
  h100 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
  monkeypatch.setattr(gpu_info, "get_gpu_info", lambda: h100)
  monkeypatch.setattr(blocks, "gpu_compute_capability", lambda: "9.0")
  monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 91000)
  monkeypatch.setattr(fused_attention_stablehlo, "check_compute_capability", lambda cap: True)
  monkeypatch.setattr(fused_attention_stablehlo, "is_cuda_compute_capability_equal",
                      lambda cap: cap == "9.0")
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_every_kernel_lowers_for_gpu(like_h100, causal):
  """Each row's forward+backward step lowers for CUDA in bfloat16, each kernel on its own
  implementation (cuDNN's custom call, Pallas' Triton kernels, plain XLA)."""
  qkv = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)
  offsets = jax.ShapeDtypeStruct((2, 255), jnp.float32)
  rng = jax.random.key(0)
  for kernel in bench.ATTENTION_KERNELS:
    f, reason = bench.attention_kernel(kernel, qkv, causal=causal, rng=rng)
    if kernel.family == "channels" and not causal:  # separable only under the causal mask
      assert reason.startswith("attend plans route fused: kernel"), (kernel.name, reason)
      continue
    if kernel.family == "tokamax":  # traced on a GPU only: test_the_tokamax_rows_...
      continue
    assert reason is None, (kernel.name, reason)
    text = (jax.jit(bench.forward_backward(f)).trace(qkv, qkv, qkv, offsets, qkv)
            .lower(lowering_platforms=("cuda",)).as_text())
    assert ("__cudnn$fmha" in text) == (kernel.family in ("cudnn", "channels")), kernel.name
    assert ("mosaic_gpu" in text) == ("hopper" in (kernel.forward, kernel.backward)), kernel.name
    assert ("__gpu$xla.gpu.triton" in text) == (kernel.family == "pallas"
                                                and kernel.backward != "hopper"), kernel.name


def test_the_tokamax_rows_call_it_with_the_xla_rows_bias(monkeypatch):
  """The tokamax rows (issue 51: a maintained base kernel against cuDNN and ours) pass q, k,
  v and the materialised offset bias as the XLA bias row attends with them: a stand-in
  package computing plain attention gives that row's output and offset-vector gradient.
  Without the package, or off a GPU, each row says why it cannot run."""
  calls = []

  def dot_product_attention(q, k, v, *, bias, is_causal, implementation):
    calls.append(implementation)
    return jax.nn.dot_product_attention(q, k, v, bias=bias, is_causal=is_causal)

  stand_in = types.ModuleType("tokamax")
  stand_in.__spec__ = importlib.machinery.ModuleSpec("tokamax", loader=None)
  stand_in.dot_product_attention = dot_product_attention
  monkeypatch.setitem(sys.modules, "tokamax", stand_in)
  keys = jax.random.split(jax.random.key(0), 5)
  q, k, v, do = (jax.random.normal(key, (2, 16, 2, 8)) for key in keys[:4])
  ob = jax.random.normal(keys[4], (2, 31))
  rows = {kernel.name: kernel for kernel in bench.ATTENTION_KERNELS}
  for causal in (False, True):
    want, _ = bench.attention_kernel(rows["xla bias"], q, causal=causal, rng=keys[0])
    got, _ = bench.attention_kernel(rows["tokamax triton bias"], q, causal=causal, rng=keys[0])
    (w, dw), (g, dg) = (bench.forward_backward(f)(q, k, v, ob, do) for f in (want, got))
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    for a, b in zip(dg, dw, strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  plain, _ = bench.attention_kernel(rows["tokamax mosaic no bias"], q, causal=False, rng=keys[0])
  np.testing.assert_allclose(plain(q, k, v, ob), jax.nn.dot_product_attention(q, k, v),
                             rtol=1e-6)
  assert calls[-1] == "mosaic" and "triton" in calls
  assert bench.tokamax_unsupported() == "tokamax's kernels run on GPUs only; backend cpu"
  monkeypatch.setattr(bench.importlib.util, "find_spec", lambda name: None)
  assert bench.tokamax_unsupported().startswith("tokamax is not installed (pip install tokamax")


def test_the_hopper_row_needs_a_hopper_gpu(like_h100, monkeypatch):
  qkv = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)
  hopper = next(k for k in bench.ATTENTION_KERNELS if k.name == route_table.HOPPER_ROW)
  monkeypatch.setattr(blocks, "gpu_compute_capability", lambda: "8.0")
  _, reason = bench.attention_kernel(hopper, qkv, causal=False, rng=jax.random.key(0))
  assert reason == "Mosaic GPU wgmma needs compute capability 9.x; this device: 8.0"


def test_the_band_row_is_na_on_a_tpu(monkeypatch):
  qkv = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)
  band = next(k for k in bench.ATTENTION_KERNELS if k.tiles == "band")
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  _, reason = bench.attention_kernel(band, qkv, causal=False, rng=jax.random.key(0))
  assert reason == "band tiles are the Triton kernels' (GPU); a TPU builds roll tiles"


def test_a_row_whose_plan_is_not_its_own_is_na(monkeypatch):
  """On a TPU, bias-free self-attention over 128 positions plans splash attention: the
  "pallas no bias" row says so rather than time splash under its name."""
  qkv = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)
  rng = jax.random.key(0)
  row = next(k for k in bench.ATTENTION_KERNELS if k.name == "pallas no bias")
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  _, reason = bench.attention_kernel(row, qkv, causal=False, rng=rng)
  assert reason == ("attend plans route fused: splash, q/k width 64; route table: no points "
                    "for this device (the default ways)")


def test_cudnn_in_float32_is_na_with_its_reason(like_h100):
  qkv = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.float32)
  kernels = {kernel.name: kernel for kernel in bench.ATTENTION_KERNELS}
  _, reason = bench.attention_kernel(kernels["cudnn no bias"], qkv, causal=False,
                                     rng=jax.random.key(0))
  assert reason == "dtype float32 (cuDNN flash attention takes bfloat16/float16)"


BAD = [
    (["--heads", "0"], f"{bench.PROG}: --heads: got 0; allowed: a positive integer"),
    (["--head_dim", "-3"], f"{bench.PROG}: --head_dim: got -3; allowed: a positive integer"),
    (["--head_dim", "x"], f"{bench.PROG}: --head_dim: got 'x'; allowed: a positive integer"),
    (["--length", "0"], f"{bench.PROG}: --length: got 0; allowed: a positive integer"),
    (["--dtype", "float16"], f"{bench.PROG}: --dtype: got 'float16'"),
    (["--route", "fused"], f"{bench.PROG}: --route: unknown flag"),
    (["--schemes", "t5"], f"{bench.PROG}: --schemes: unknown flag"),
    (["--head_dm", "3"], f"{bench.PROG}: --head_dm: unknown flag; did you mean '--head_dim'?"),
    (["--json", "{dir}"], f"{bench.PROG}: --json: '{{dir}}' is a directory, not a file"),
    (["--json", "{file}/out.json"], f"{bench.PROG}: --json: '{{file}}' cannot be created"),
]


@pytest.mark.parametrize("argv, line", BAD, ids=[" ".join(argv) for argv, _ in BAD])
def test_bad_flag_is_one_line_before_any_work(argv, line, tmp_path, capsys):
  (tmp_path / "dir").mkdir()
  (tmp_path / "file").write_text("not a directory\n")
  places = {"dir": str(tmp_path / "dir"), "file": str(tmp_path / "file")}
  before = sorted(tmp_path.rglob("*"))
  with pytest.raises(SystemExit) as stop:
    bench.main([a.format(**places) for a in argv])
  captured = capsys.readouterr()
  assert stop.value.code == 2
  assert captured.out == ""  # nothing ran: the header comes after the checks
  assert len(captured.err.strip().splitlines()) == 1
  assert captured.err.startswith(line.format(**places)), captured.err
  assert sorted(tmp_path.rglob("*")) == before
