"""The fused route's measured crossovers (posenc_jax.route_table, issue 14).

The choice rule (nearest point per device kind, dtype and form), the table file (one-line
errors, atomic merge), each way's equality with the reference route (values and
gradients), where it applies (batch-free terms, no dropout or packed segments), the bench
writing a point that ``attend`` then follows, and the training step lowering for CUDA with
the materialised bias on cuDNN.
"""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posenc_jax import Factored, attend, route_table
from posenc_jax.route_table import Point
from tests import forked_cli
from tests.conftest import SCHEME_CONFIGS, init_scheme, padding_mask, qkv
from tests.test_accelerator_lowering import (CUDNN, TRITON, _train_config,  # noqa: F401
                                             lowered_train_step, on_platform)
from tests.test_attention import TOL, _intermediate_shapes, assert_grads_close

ROOT = pathlib.Path(__file__).resolve().parents[1]


def point(length, default_ms, materialised_ms, form="toeplitz", rank=0, device="H100",
          dtype="bfloat16", head_dim=64):
  return Point(device=device, dtype=dtype, form=form, batch=8, length=length, heads=12,
               head_dim=head_dim, rank=rank, default_ms=default_ms,
               materialised_ms=materialised_ms, source="test")


# Materialised wins at 512, the kernel at 4096 and 16384 (as measured on the H100 in
# RESULTS-2026-11-23 at 512 and 16384).
TABLE = [point(512, 1.61, 1.01), point(4096, 10.0, 12.0), point(16384, 34.7, 43.5),
         point(512, 1.0, 2.0, device="A100"), point(512, 1.0, 0.5, dtype="float32"),
         point(512, 2.0, 1.0, form="factored", rank=128),
         point(512, 1.0, 2.0, form="factored", rank=8)]


@pytest.mark.parametrize("length, want", [(128, True), (512, True), (1024, True),
                                          (1500, False), (2048, False), (4096, False),
                                          (100_000, False)])
def test_nearest_measured_length_decides(length, want):
  """log2 distance: 1024 is 1 from 512 and 2 from 4096; 1500 is nearer 4096."""
  assert route_table.materialise("toeplitz", dtype="bfloat16", length=length, head_dim=64,
                                 device="H100", table=TABLE) is want


def test_a_tie_goes_to_the_longer_length():
  table = [point(512, 2.0, 1.0), point(2048, 1.0, 2.0)]
  assert not route_table.materialise("toeplitz", dtype="bfloat16", length=1024, head_dim=64,
                                     device="H100", table=table)


def test_device_dtype_and_form_select_their_own_points():
  ask = lambda **kw: route_table.materialise(  # noqa: E731
      **{"form": "toeplitz", "dtype": "bfloat16", "length": 512, "head_dim": 64,
         "device": "H100", "table": TABLE, **kw})
  assert ask() and not ask(device="A100") and ask(dtype="float32")
  assert not ask(device="TPU v5 lite") and not ask(dtype="float16")  # no point: default way
  assert not route_table.materialise("toeplitz", dtype="bfloat16", length=512, head_dim=64,
                                     device="H100", table=[])


@pytest.mark.parametrize("rank, want", [(128, True), (96, True), (8, False), (16, False)])
def test_factored_points_are_nearest_in_folded_width(rank, want):
  """Widths 64 + rank: 160 is nearer 192 than 72; 80 nearer 72."""
  assert route_table.materialise("factored", dtype="bfloat16", length=512, head_dim=64,
                                 rank=rank, device="H100", table=TABLE) is want


def test_forced_overrides_the_table_and_nests():
  args = dict(dtype="bfloat16", length=512, head_dim=64, device="H100", table=TABLE)
  with route_table.forced(toeplitz=False):
    assert not route_table.materialise("toeplitz", **args)
    with route_table.forced(factored=True):
      assert not route_table.materialise("toeplitz", **args)
      assert route_table.materialise("factored", **args, rank=8)
    assert not route_table.materialise("factored", **args, rank=8)
  assert route_table.materialise("toeplitz", **args)
  with pytest.raises(ValueError, match="route_table.forced: toeplits: allowed: toeplitz"):
    with route_table.forced(toeplits=True):
      pass


def test_the_packaged_table_is_valid_and_measured():
  points = route_table.read(route_table.PACKAGED)
  assert all(p.source for p in points)  # every figure says where it was measured
  assert len({p.key for p in points}) == len(points)


def test_write_merges_by_key_atomically(tmp_path):
  path = tmp_path / "routes.json"
  route_table.write(path, [point(512, 1.0, 2.0), point(1024, 1.0, 2.0)])
  table = route_table.write(path, [point(512, 3.0, 2.0), point(512, 1.0, 2.0, device="A100")])
  assert sorted(table) == sorted(route_table.read(path)) and len(table) == 3
  assert next(p for p in table if p.key == point(512, 0, 0).key).default_ms == 3.0
  assert [p.name for p in tmp_path.iterdir()] == ["routes.json"]


def _table_file(tmp_path, entry=None, document=None):
  path = tmp_path / "routes.json"
  if document is None:
    fields = {f: x for f, x in point(512, 1.0, 2.0)._asdict().items() if f != "closed_ms"}
    document = {"format": 1, "points": [{**fields, **(entry or {})}]}
  path.write_text(document if isinstance(document, str) else json.dumps(document))
  return path


@pytest.mark.parametrize("entry, document, message", [
    (None, "{not json", "not readable JSON"),
    (None, {"points": []}, 'expected an object with "format": 1'),
    (None, {"format": 1, "points": {}}, "points: expected a list"),
    ({"form": "dense"}, None, r"points\[0\].form: got 'dense'; allowed: toeplitz, factored"),
    ({"length": 0}, None, r"points\[0\].length: got 0; expected a positive integer"),
    ({"rank": -1}, None, r"points\[0\].rank: got -1; expected a non-negative integer"),
    ({"batch": True}, None, r"points\[0\].batch: got True"),
    ({"default_ms": float("nan")}, None, r"points\[0\].default_ms: got nan"),
    ({"materialised_ms": "1"}, None, r"points\[0\].materialised_ms: got '1'"),
    ({"device": 3}, None, r"points\[0\].device: got 3; expected a string"),
    ({"lenght": 3}, None, r"points\[0\]: unknown field lenght"),
    ({"hopper_ms": 0}, None, r"points\[0\].hopper_ms: got 0; expected a positive number"),
    ({"form": "factored", "hopper_ms": 1.0}, None,
     r"points\[0\].hopper_ms: got 1.0 for a factored term; only toeplitz terms"),
    ({"hopper_backward": True}, None,
     r"points\[0\].hopper_backward: got True; expected true or false, true only with "
     r"hopper_ms"),
    ({"hopper_ms": 1.0, "hopper_backward": 1}, None,
     r"points\[0\].hopper_backward: got 1; expected true or false"),
    ({"closed_ms": {"alibi": 0}}, None,
     r"points\[0\].closed_ms.alibi: got 0; expected a positive number of ms"),
    ({"closed_ms": [["alibi", 1.0]]}, None,
     r"points\[0\].closed_ms: got \[\['alibi', 1.0\]\]; expected an object of closed forms'"),
    ({"form": "factored", "closed_ms": {"alibi": 1.0}}, None,
     r"points\[0\].closed_ms: got \{'alibi': 1.0\}; .* for a toeplitz term only"),
])
def test_a_malformed_table_is_one_line(tmp_path, entry, document, message):
  path = _table_file(tmp_path, entry, document)
  with pytest.raises(ValueError, match=message) as info:
    route_table.read(path)
  assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_a_missing_field_is_named(tmp_path):
  entry = point(512, 1.0, 2.0)._asdict()
  del entry["heads"]
  path = _table_file(tmp_path, document={"format": 1, "points": [entry]})
  with pytest.raises(ValueError, match=r"points\[0\]: missing heads$"):
    route_table.read(path)


def test_the_environment_file_overlays_the_packaged_table(tmp_path, monkeypatch):
  path = tmp_path / "routes.json"
  monkeypatch.setenv(route_table.ENV, str(path))
  ask = lambda: route_table.materialise("toeplitz", dtype="float32", length=16,  # noqa: E731
                                        head_dim=8, device="cpu")
  with pytest.raises(route_table.RouteTableError, match=(
      rf"^POSENC_JAX_ROUTE_TABLE: {path} does not exist; allowed: a route table file")):
    ask()  # a typo in the path is not taken for "no points"
  route_table.write(path, [point(16, 2.0, 1.0, device="cpu", dtype="float32", head_dim=8)])
  assert ask()  # re-read when the file changes
  route_table.write(path, [point(16, 1.0, 2.0, device="cpu", dtype="float32", head_dim=8)])
  assert not ask()


@pytest.mark.parametrize("text, problem", [
    ('{"format": 1, "points": [', "route table {path}: not readable JSON (Expecting value"),
    (None, "{path} does not exist; allowed: a route table file (python -m "
           "posenc_jax.benchmarks.routes ... --route_table {path} makes one), or the variable "
           "unset for the packaged points")])
def test_a_bad_environment_file_stops_train_py_in_one_line(tmp_path, text, problem):
  """A malformed file, or a path that does not exist, named by ``$POSENC_JAX_ROUTE_TABLE``:
  train.py's one line names the variable and the file, before any work."""
  path = tmp_path / "routes.json"
  if text is not None:
    path.write_text(text)
  proc = forked_cli.run(["train.py", "--config=configs/lm.py:bert_tiny,alibi",
                         f"--workdir={tmp_path}/run"], cwd=str(ROOT), timeout=120,
                        env={route_table.ENV: str(path)})
  assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert proc.stderr.strip().splitlines()[-1].startswith(
      f"train.py: POSENC_JAX_ROUTE_TABLE: {problem.format(path=path)}"), proc.stderr[-3000:]
  assert proc.stdout == "" and not (tmp_path / "run").exists()


@pytest.mark.parametrize("tool", ["steps", "routes", "compile", "pipeline"])
def test_a_bad_environment_file_stops_each_benchmark_in_one_line(tmp_path, tool):
  """The benchmarks say it as train.py does, before anything compiles."""
  path = tmp_path / "missing.json"
  proc = forked_cli.run(["-m", f"posenc_jax.benchmarks.{tool}"], cwd=str(ROOT), timeout=120,
                        env={route_table.ENV: str(path)})
  assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert proc.stderr.strip().splitlines()[-1].startswith(
      f"posenc_jax.benchmarks.{tool}: POSENC_JAX_ROUTE_TABLE: {path} does not exist"), (
          proc.stderr[-3000:])


# Each way equals the reference route; the kernel is gone where the table materialises.

TOEPLITZ = ["diet_rel", "t5", "alibi", "tupe_r"]
FACTORED = ["diet_abs", "diet_abs_share", "tupe_a"]


def _pallas_calls(f, *args) -> int:
  return str(jax.make_jaxpr(f)(*args)).count("pallas_call")


@pytest.mark.parametrize("name", TOEPLITZ + FACTORED)
@pytest.mark.parametrize("causal", [False, True])
def test_materialised_way_equals_the_reference(name, causal):
  form = "toeplitz" if name in TOEPLITZ else "factored"
  _, _, st = init_scheme(SCHEME_CONFIGS[name])
  q, k, v = qkv()
  terms = st.for_layer(1)

  def loss(route):
    def f(q, k, v, terms):
      out = attend(q, k, v, terms, mask=padding_mask(), causal=causal, scale=st.content_scale,
                   route=route)
      return jnp.sum(jnp.sin(out))
    return jax.value_and_grad(f, argnums=(0, 1, 2, 3))

  want, want_grads = loss("reference")(q, k, v, terms)
  with route_table.forced(**{form: True}):
    got, got_grads = loss("fused")(q, k, v, terms)
    assert _pallas_calls(loss("fused"), q, k, v, terms) == 0
  with route_table.forced(**{form: False}):
    assert _pallas_calls(loss("fused"), q, k, v, terms) >= 2  # forward and backward kernels
  np.testing.assert_allclose(got, want, **TOL)
  assert_grads_close(got_grads, want_grads)


def test_factored_materialised_keeps_the_head_dim():
  """Folded, q and k are D + r wide (8 + 5, padded to 16); materialised, D wide beside an
  ``[1, H, L, L]`` bias."""
  q, k, v = qkv()
  u, w = (jax.random.normal(key, (q.shape[1], 4, 5)) for key in jax.random.split(jax.random.key(3)))

  def shapes():  # a new function each time: JAX caches traces by function
    f = lambda q: attend(q, k, v, [Factored(u, w)], route="fused")  # noqa: E731
    return set(_intermediate_shapes(jax.make_jaxpr(f)(q).jaxpr))

  with route_table.forced(factored=False):
    assert (2, 10, 4, 16) in shapes() and (1, 4, 10, 10) not in shapes()
  with route_table.forced(factored=True):
    assert (2, 10, 4, 16) not in shapes() and (1, 4, 10, 10) in shapes()


def test_not_with_dropout_packed_segments_or_per_example_terms():
  """The kernel draws the dropout mask and takes segment ids; a per-example factored term
  has no batch-free bias to share. The table is not asked there."""
  _, _, st = init_scheme(SCHEME_CONFIGS["diet_rel"])
  q, k, v = qkv()
  terms = st.for_layer(0)
  segments = jnp.array([[0] * 5 + [1] * 5, [0] * 10])
  with route_table.forced(toeplitz=True, factored=True):
    assert _pallas_calls(lambda q: attend(q, k, v, terms, route="fused", dropout_rate=0.1,
                                          dropout_rng=jax.random.key(0)), q) == 1
    assert _pallas_calls(lambda q: attend(q, k, v, terms, route="fused",
                                          segment_ids=segments), q) == 1
    u = jax.random.normal(jax.random.key(4), q.shape[:3] + (3,))  # [B, L, H, r]
    assert _pallas_calls(lambda q: attend(q, k, v, [Factored(u, u)], route="fused"), q) == 1


def test_the_bench_writes_a_point_that_attend_follows(tmp_path, monkeypatch):
  """On CPU the Pallas kernel interprets, so the materialised bias wins: the bench records
  that, and with the file in the environment the fused route materialises."""
  path = tmp_path / "routes.json"
  proc = subprocess.run(
      [sys.executable, "-m", "posenc_jax.benchmarks.routes", "--batch", "1", "--length", "32",
       "--heads", "2", "--head_dim", "16", "--repeats", "1", "--rank", "8",
       "--route_table", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  points = {p.form: p for p in route_table.read(path)}
  assert set(points) == {"toeplitz", "factored"}
  for form, p in points.items():
    assert (p.device, p.dtype, p.length, p.heads, p.head_dim) == ("cpu", "float32", 32, 2, 16)
    assert p.rank == (8 if form == "factored" else 0)
    way = p.fastest()
    assert (f"route table {path}: {form} at L=32{' rank 8' if p.rank else ''} on cpu float32: "
            f"default {p.default_ms:.3f} ms, materialised {p.materialised_ms:.3f} ms -> {way}"
            ) in proc.stdout
  assert points["toeplitz"].source == "bench --attention (xla bias)"  # cuDNN: n/a on CPU
  _, _, st = init_scheme(SCHEME_CONFIGS["diet_rel"], length=32, num_heads=2, head_dim=16)
  q = jnp.ones((1, 32, 2, 16))
  u = jnp.ones((32, 2, 8))
  fused = lambda terms: _pallas_calls(  # noqa: E731
      lambda q: attend(q, q, q, terms, route="fused"), q)
  assert fused(st.for_layer(0)) == fused([Factored(u, u)]) == 1  # no table: the kernel
  monkeypatch.setenv(route_table.ENV, str(path))
  assert fused(st.for_layer(0)) == (0 if points["toeplitz"].fastest() == "materialised" else 1)
  assert fused([Factored(u, u)]) == (0 if points["factored"].fastest() == "materialised" else 1)


def test_a_bad_route_table_file_stops_the_bench_before_any_work(tmp_path):
  path = _table_file(tmp_path, {"form": "dense"})
  proc = subprocess.run([sys.executable, "-m", "posenc_jax.benchmarks.routes",
                         "--route_table", str(path)], cwd=ROOT, capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 2 and proc.stdout == ""
  assert proc.stderr.strip().splitlines() == [
      f"posenc_jax.benchmarks.routes: --route_table: route table {path}: points[0].form: got "
      "'dense'; allowed: toeplitz, factored"]
  proc = subprocess.run([sys.executable, "-m", "posenc_jax.benchmarks.steps", "--route_table",
                         str(path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2 and "--route_table: unknown flag" in proc.stderr


@pytest.mark.parametrize("preset, form", [("diet_rel", "toeplitz"), ("alibi", "toeplitz"),
                                          ("diet_abs", "factored"), ("tupe_a", "factored")])
def test_gpu_training_step_puts_the_materialised_bias_on_cudnn(on_platform, preset, form):  # noqa: F811
  """bf16 with a padding mask, lowered for CUDA: materialised, the term is a bias of
  cuDNN's (its gradient from cuDNN's backward pass) and no Triton kernel is left."""
  on_platform("gpu")
  config = _train_config(f"bert_tiny,{preset}", attention_dropout_rate=0.0)
  with route_table.forced(**{form: True}):
    text = lowered_train_step(config, "cuda")
  assert text.count(CUDNN) >= 2 and TRITON not in text


def test_the_hopper_way_is_taken_where_it_was_fastest(tmp_path):
  """A Toeplitz point's third way: the kernel with its Hopper forward (and backward, where
  that was the faster Hopper row). It is chosen only where its time is the smallest; points
  without it keep the two-way choice; the file keeps it, and leaves it out where
  unmeasured."""
  table = [point(512, 1.0, 0.9)._replace(hopper_ms=0.8), point(16384, 30.0, 40.0)._replace(
      hopper_ms=20.0, hopper_backward=True), point(2048, 5.0, 6.0)]
  ask = lambda length, **kw: (  # noqa: E731
      route_table.hopper_way(dtype="bfloat16", length=length, head_dim=64, device="H100",
                             table=table),
      route_table.materialise("toeplitz", dtype="bfloat16", length=length, head_dim=64,
                              device="H100", table=table))
  assert ask(512) == (True, False)  # hopper 0.8 beats materialised 0.9
  assert ask(16384) == ("both", False)
  assert ask(2048) == (False, False)  # no hopper figure there
  assert route_table.hopper_way(dtype="bfloat16", length=512, head_dim=64, device="A100",
                                table=table) is False
  with route_table.forced(hopper=False):
    assert ask(512)[0] is False
  with route_table.forced(hopper="both"):
    assert ask(2048)[0] == "both"
  with pytest.raises(ValueError, match=r"^route_table.forced: hopper: got 'yes'; allowed: "
                                       r"None, False, True, 'both'$"):
    with route_table.forced(hopper="yes"):
      pass
  with pytest.raises(ValueError, match="route_table.forced: hoper: allowed: toeplitz, "
                     "factored, hopper"):
    with route_table.forced(hoper=True):
      pass
  path = tmp_path / "routes.json"
  route_table.write(path, table)
  assert sorted(route_table.read(path)) == sorted(table)
  document = json.loads(path.read_text())
  assert [("hopper_ms" in p) for p in document["points"]] == [True, False, True]
  assert [("hopper_backward" in p) for p in document["points"]] == [False, False, True]


def test_a_device_without_points_reads_a_kind_of_the_same_compute_capability(tmp_path):
  """An H200 takes the H100's points (9.0 both) until it has its own; among several kinds of
  its compute capability, the one with the most points (a tie: the first by name); a kind
  of another compute capability, or none given, reads none. Each point keeps its device's
  compute capability in the file, left out where unknown."""
  hopper = lambda length, ms, device="H100": point(  # noqa: E731
      length, ms, 1.0, device=device)._replace(compute_capability="9.0")
  table = route_table.RouteTable((hopper(512, 2.0), hopper(4096, 2.0),
                                  point(512, 1.0, 2.0, device="A100")._replace(
                                      compute_capability="8.0")))
  assert [table.whose(kind, cc) for kind, cc in (
      ("H100", "9.0"), ("H200", "9.0"), ("H200", None), ("L4", "8.9"), ("A100", "8.0"),
      ("A10", "8.0"))] == ["H100", "H100", None, None, "A100", "A100"]
  ask = lambda device, cc, table=table: route_table.materialise(  # noqa: E731
      "toeplitz", dtype="bfloat16", length=512, head_dim=64, device=device,
      compute_capability=cc, table=table.points)
  assert ask("H200", "9.0") and not ask("H200", None) and not ask("L4", "8.9")
  assert route_table.hopper_way(dtype="bfloat16", length=512, head_dim=64, device="H200",
                                compute_capability="9.0",
                                table=[hopper(512, 2.0)._replace(hopper_ms=0.5)]) is True
  own = table.points + (point(512, 1.0, 2.0, device="H200")._replace(compute_capability="9.0"),)
  assert not ask("H200", "9.0", route_table.RouteTable(own))  # its own point: the kernel
  more = route_table.RouteTable((hopper(512, 2.0, "GH200"), hopper(512, 1.0, "H800"),
                                 hopper(4096, 1.0, "H800")))
  assert more.whose("H200", "9.0") == "H800"
  tied = route_table.RouteTable((hopper(512, 2.0, "H800"), hopper(512, 1.0, "GH200")))
  assert tied.whose("H200", "9.0") == "GH200"
  path = tmp_path / "routes.json"
  route_table.write(path, [hopper(512, 2.0), point(1024, 1.0, 2.0)])
  assert [p.get("compute_capability") for p in json.loads(path.read_text())["points"]] == [
      "9.0", None]
  assert {p.compute_capability for p in route_table.read(path)} == {"9.0", None}
  assert {p.compute_capability for p in route_table.read(route_table.PACKAGED)} == {"9.0"}
  with pytest.raises(ValueError, match=r"points\[0\].compute_capability: got 9.0; expected a "
                     "string"):
    route_table.read(_table_file(tmp_path, {"compute_capability": 9.0}))


def test_the_bench_rows_give_the_hopper_figure():
  rows = [{"kernel": name, "fwd_bwd_ms": ms} for name, ms in
          (("pallas toeplitz", 2.0), (route_table.HOPPER_ROW, 1.5), ("xla bias", 3.0))]
  document = {"device": "H100", "dtype": "bfloat16", "batch": 1, "length": 512, "heads": 12,
              "head_dim": 64, "rows": rows}
  (found,), _ = route_table.points_from_attention(document)
  assert (found.default_ms, found.materialised_ms, found.hopper_ms) == (2.0, 3.0, 1.5)
  assert found.fastest() == "hopper" and not found.hopper_backward
  assert found.compute_capability is None  # not recorded by the run
  (found,), _ = route_table.points_from_attention({**document, "compute_capability": "9.0"})
  assert found.compute_capability == "9.0"
  rows.append({"kernel": route_table.HOPPER_BOTH_ROW, "fwd_bwd_ms": 1.2})  # both passes
  (found,), _ = route_table.points_from_attention(document)
  assert (found.hopper_ms, found.hopper_backward) == (1.2, True)
  rows[1]["fwd_bwd_ms"] = rows[-1]["fwd_bwd_ms"] = None  # not run (not a Hopper GPU)
  (found,), _ = route_table.points_from_attention(document)
  assert found.hopper_ms is None and found.fastest() == "default"


def test_a_closed_form_measured_in_the_tiles_is_a_way_for_that_form_alone(tmp_path):
  """The bench's closed-form rows (``pallas alibi closed``...) become the point's
  ``closed_ms``; a closed form measured faster than every other way keeps its term out of
  the Hopper passes and of materialising, for that closed form only; one not measured, or
  measured slower, leaves the choice as before. The file keeps them as an object."""
  rows = [{"kernel": name, "fwd_bwd_ms": ms} for name, ms in (
      ("pallas toeplitz", 18.2), (route_table.HOPPER_BOTH_ROW, 11.1), ("cudnn bias", 13.7),
      (route_table.CLOSED_ROW.format("alibi"), 7.9),
      (route_table.CLOSED_ROW.format("kerple_log"), 12.6), ("pallas no bias", 6.9))]
  rows.append({"kernel": route_table.CLOSED_ROW.format("kerple_power"), "fwd_bwd_ms": None})
  document = {"device": "H200", "dtype": "bfloat16", "batch": 2, "length": 8192, "heads": 12,
              "head_dim": 64, "rows": rows}
  (found,), _ = route_table.points_from_attention(document)
  assert found.closed_ms == (("alibi", 7.9), ("kerple_log", 12.6))
  assert [found.fastest(name) for name in (None, "alibi", "kerple_log", "kerple_power")] == [
      "hopper", "closed", "hopper", "hopper"]
  ask = lambda closed: (  # noqa: E731
      route_table.hopper_way(dtype="bfloat16", length=8192, head_dim=64, device="H200",
                             closed=closed, table=[found]),
      route_table.materialise("toeplitz", dtype="bfloat16", length=8192, head_dim=64,
                              device="H200", closed=closed, table=[found]))
  assert ask("alibi") == (False, False) and ask("kerple_log") == ("both", False)
  assert ask(None) == ask("kerple_power") == ("both", False)
  cheaper_bias = found._replace(materialised_ms=7.0)  # materialised beats the closed form
  assert route_table.materialise("toeplitz", dtype="bfloat16", length=8192, head_dim=64,
                                 device="H200", closed="alibi", table=[cheaper_bias])
  path = tmp_path / "routes.json"
  route_table.write(path, [found, point(512, 1.0, 2.0)])
  assert [p.get("closed_ms") for p in json.loads(path.read_text())["points"]] == [
      None, {"alibi": 7.9, "kerple_log": 12.6}]  # sorted by device: H100, H200
  assert sorted(route_table.read(path)) == sorted([found, point(512, 1.0, 2.0)])


def test_the_fused_route_runs_the_hopper_kernels_where_the_table_says():
  """bfloat16 DIET-REL on the fused route, with a padding mask: forced to the Hopper forward,
  then to the Hopper forward and backward (Mosaic GPU, interpreted on CPU), it equals the
  Triton kernels, gradients included."""
  _, _, st = init_scheme(SCHEME_CONFIGS["diet_rel"], length=64, num_heads=2, head_dim=64)
  q, k, v = (x.astype(jnp.bfloat16) for x in qkv(batch=2, length=64, heads=2, head_dim=64))
  terms = st.for_layer(0)
  mask = jnp.arange(64)[None, :] < jnp.array([[64], [50]])

  def run(hopper):
    def f(q, k, v):
      out = attend(q, k, v, terms, mask=mask, scale=st.content_scale, route="fused")
      return jnp.sum(out.astype(jnp.float32) ** 2), out
    step = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)
    with route_table.forced(hopper=hopper):
      text = str(jax.make_jaxpr(step)(q, k, v))
      (_, out), grads = step(q, k, v)
    return [f"relative_flash_{name}_hopper" in text for name in ("fwd", "dq")], out, grads

  plain_used, plain, plain_grads = run(False)
  assert plain_used == [False, False]
  for hopper, used_now in ((True, [True, False]), ("both", [True, True])):
    used, out, grads = run(hopper)
    assert used == used_now, hopper
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(plain, np.float32),
                               atol=1e-2)
    for got, want in zip(grads, plain_grads):
      np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                 atol=2e-2, rtol=2e-2)
