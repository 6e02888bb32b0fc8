"""The route plan (posenc_jax.route_plan): one pure function decides how attention runs.

Pinned here: for a table of representative schemes and shapes, the plan chosen on CPU, on a
GPU of compute capability 9.0 and 8.0, and on TPU (what the routing chose before the plan
existed, recorded call by call with the runners stubbed); each term's static form against
the arrays its fused part holds; the plan printed; and ``attend`` following the plan it
prints.
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from posenc_jax import attend, route_plan, route_table
from posenc_jax.route_plan import Device
from posenc_jax.route_table import Point
from tests.conftest import SCHEME_CONFIGS, init_scheme

H100 = Device("gpu", "NVIDIA H100 80GB HBM3", "9.0")
H200 = Device("gpu", "NVIDIA H200", "9.0")
A100 = Device("gpu", "NVIDIA A100-SXM4-80GB", "8.0")
TPU = Device("tpu", "TPU v5 lite")
CPU = Device("cpu", "cpu")
DEVICES = {"H100": H100, "A100": A100, "TPU": TPU, "CPU": CPU}
HEADS = 4


def _forms(scheme: str, length: int, head_dim: int, batch: int = 2):
  _, _, st = init_scheme(SCHEME_CONFIGS[scheme], length=length, num_heads=HEADS,
                         head_dim=head_dim, max_len=max(length, 16), d_model=HEADS * head_dim)
  return [t.with_key_length(length).fused_form() for t in st.for_layer(0)]


def _summary(plan: route_plan.Plan) -> str:
  """The decisions of a plan in one line: runner, implementation, mask, q/k width, entries,
  and the kernel's tiles, passes and blocks where it runs."""
  parts = [plan.runner, plan.implementation or "-", plan.mask or "-", str(plan.qk_dim),
           "+".join(plan.entries) or "-"]
  if plan.kernel is not None:
    k, b = plan.kernel, plan.kernel.blocks
    parts.append(f"{k.tiles}/{k.forward}/{k.backward}/{b.block_q}x{b.block_k}/"
                 f"{b.qk_dim}/{b.v_dim}/{b.num_warps}/{b.num_stages}")
  return " ".join(parts)


# (scheme, dtype, length, head_dim, mask, options, device, forced ways) -> the plan's summary:
# runner, implementation, mask, q/k width, entries, kernel tiles/forward/backward/blocks/padded
# head dims/warps/stages. Checked when recorded against the routing before the plan (commit
# f9958eb's attend, the runners stubbed to record their arguments): the same calls.
PINNED = [
    ('none', 'bfloat16', 512, 64, 'key', {}, 'CPU', {},
     'reference - - 64 -'),
    ('none', 'bfloat16', 512, 64, 'key', {}, 'H100', {},
     'dot_product_attention cudnn lengths or kernel 64 - gather/tiles/tiles/64x64/64/64/4/2'),
    ('none', 'bfloat16', 512, 64, 'key', {}, 'A100', {},
     'dot_product_attention cudnn lengths or kernel 64 - gather/tiles/tiles/64x64/64/64/4/2'),
    ('none', 'bfloat16', 512, 64, 'key', {}, 'TPU', {},
     'splash - - 64 -'),
    ('diet_rel', 'bfloat16', 512, 64, 'key', {}, 'CPU', {},
     'reference - - 64 logits'),
    ('diet_rel', 'bfloat16', 512, 64, 'key', {}, 'H100', {},
     'kernel - - 64 kernel gather/tiles/tiles/64x64/64/64/4/2'),
    ('diet_rel', 'bfloat16', 512, 64, 'key', {}, 'A100', {},
     'kernel - - 64 kernel gather/tiles/tiles/64x64/64/64/4/2'),
    ('diet_rel', 'bfloat16', 512, 64, 'key', {}, 'TPU', {},
     'kernel - - 64 kernel roll/tiles/tiles/256x256/64/64/None/None'),
    ('diet_rel', 'bfloat16', 512, 64, 'key', {}, 'CPU', {'hopper': 'both'},
     'reference - - 64 logits'),
    ('diet_rel', 'bfloat16', 512, 64, 'key', {}, 'H100', {'hopper': 'both'},
     'kernel - - 64 kernel gather/hopper/hopper/64x64/64/64/4/2'),
    ('diet_rel', 'bfloat16', 512, 64, 'key', {}, 'A100', {'hopper': 'both'},
     'kernel - - 64 kernel gather/hopper/hopper/64x64/64/64/4/2'),
    ('diet_rel', 'bfloat16', 512, 64, 'key', {}, 'TPU', {'hopper': 'both'},
     'kernel - - 64 kernel roll/tiles/tiles/256x256/64/64/None/None'),
    ('diet_rel', 'bfloat16', 512, 64, 'key', {}, 'CPU', {'toeplitz': True},
     'reference - - 64 logits'),
    ('diet_rel', 'bfloat16', 512, 64, 'key', {}, 'H100', {'toeplitz': True},
     'dot_product_attention cudnn lengths or full 64 table'),
    ('diet_rel', 'bfloat16', 512, 64, 'key', {}, 'A100', {'toeplitz': True},
     'dot_product_attention cudnn lengths or full 64 table'),
    ('diet_rel', 'bfloat16', 512, 64, 'key', {}, 'TPU', {'toeplitz': True},
     'dot_product_attention xla mask 64 table'),
    ('diet_rel', 'bfloat16', 16384, 64, 'key', {}, 'CPU', {'hopper': True},
     'reference - - 64 logits'),
    ('diet_rel', 'bfloat16', 16384, 64, 'key', {}, 'H100', {'hopper': True},
     'kernel - - 64 kernel gather/hopper/tiles/64x64/64/64/4/2'),
    ('diet_rel', 'bfloat16', 16384, 64, 'key', {}, 'A100', {'hopper': True},
     'kernel - - 64 kernel gather/hopper/tiles/64x64/64/64/4/2'),
    ('diet_rel', 'bfloat16', 16384, 64, 'key', {}, 'TPU', {'hopper': True},
     'kernel - - 64 kernel roll/tiles/tiles/128x128/64/64/None/None'),
    ('t5', 'float32', 128, 64, 'none', {'causal': True}, 'CPU', {},
     'reference - - 64 logits'),
    ('t5', 'float32', 128, 64, 'none', {'causal': True}, 'H100', {},
     'kernel - - 64 kernel gather/tiles/tiles/64x64/64/64/4/2'),
    ('t5', 'float32', 128, 64, 'none', {'causal': True}, 'A100', {},
     'kernel - - 64 kernel gather/tiles/tiles/64x64/64/64/4/2'),
    ('t5', 'float32', 128, 64, 'none', {'causal': True}, 'TPU', {},
     'kernel - - 64 kernel roll/tiles/tiles/128x128/64/64/None/None'),
    ('alibi', 'bfloat16', 512, 64, 'key', {'dropout': True}, 'CPU', {'toeplitz': True},
     'reference - - 64 logits'),
    ('alibi', 'bfloat16', 512, 64, 'key', {'dropout': True}, 'H100', {'toeplitz': True},
     'kernel - - 64 registers gather/tiles/tiles/64x64/64/64/4/2'),
    ('alibi', 'bfloat16', 512, 64, 'key', {'dropout': True}, 'A100', {'toeplitz': True},
     'kernel - - 64 registers gather/tiles/tiles/64x64/64/64/4/2'),
    ('alibi', 'bfloat16', 512, 64, 'key', {'dropout': True}, 'TPU', {'toeplitz': True},
     'kernel - - 64 kernel roll/tiles/tiles/256x256/64/64/None/None'),
    ('tupe_r', 'bfloat16', 512, 64, 'key', {}, 'CPU', {},
     'reference - - 64 logits+logits'),
    ('tupe_r', 'bfloat16', 512, 64, 'key', {}, 'H100', {},
     'kernel - - 136 fold+kernel gather/tiles/tiles/64x64/256/64/4/2'),
    ('tupe_r', 'bfloat16', 512, 64, 'key', {}, 'A100', {},
     'kernel - - 136 fold+kernel gather/tiles/tiles/64x32/256/64/4/2'),
    ('tupe_r', 'bfloat16', 512, 64, 'key', {}, 'TPU', {},
     'kernel - - 136 fold+kernel roll/tiles/tiles/256x256/256/64/None/None'),
    ('diet_abs', 'bfloat16', 512, 64, 'key', {}, 'CPU', {},
     'reference - - 64 logits'),
    ('diet_abs', 'bfloat16', 512, 64, 'key', {}, 'H100', {},
     'dot_product_attention cudnn lengths or kernel 72 fold gather/tiles/tiles/64x64/128/64/4/2'),
    ('diet_abs', 'bfloat16', 512, 64, 'key', {}, 'A100', {},
     'dot_product_attention cudnn lengths or kernel 72 fold gather/tiles/tiles/64x64/128/64/4/2'),
    ('diet_abs', 'bfloat16', 512, 64, 'key', {}, 'TPU', {},
     'splash - - 72 fold'),
    ('diet_abs', 'bfloat16', 512, 64, 'key', {}, 'CPU', {'factored': True},
     'reference - - 64 logits'),
    ('diet_abs', 'bfloat16', 512, 64, 'key', {}, 'H100', {'factored': True},
     'dot_product_attention cudnn lengths or full 64 table'),
    ('diet_abs', 'bfloat16', 512, 64, 'key', {}, 'A100', {'factored': True},
     'dot_product_attention cudnn lengths or full 64 table'),
    ('diet_abs', 'bfloat16', 512, 64, 'key', {}, 'TPU', {'factored': True},
     'dot_product_attention xla mask 64 table'),
    ('diet_abs', 'bfloat16', 512, 64, 'key', {'segments': True}, 'CPU', {},
     'reference - - 64 logits'),
    ('diet_abs', 'bfloat16', 512, 64, 'key', {'segments': True}, 'H100', {},
     'kernel - - 72 fold gather/tiles/tiles/64x64/128/64/4/2'),
    ('diet_abs', 'bfloat16', 512, 64, 'key', {'segments': True}, 'A100', {},
     'kernel - - 72 fold gather/tiles/tiles/64x64/128/64/4/2'),
    ('diet_abs', 'bfloat16', 512, 64, 'key', {'segments': True}, 'TPU', {},
     'splash - - 72 fold'),
    ('tupe_a', 'bfloat16', 512, 40, 'key', {}, 'CPU', {},
     'reference - - 40 logits'),
    ('tupe_a', 'bfloat16', 512, 40, 'key', {}, 'H100', {},
     'dot_product_attention cudnn lengths or kernel 88 fold gather/tiles/tiles/64x64/128/64/4/2'),
    ('tupe_a', 'bfloat16', 512, 40, 'key', {}, 'A100', {},
     'dot_product_attention cudnn lengths or kernel 88 fold gather/tiles/tiles/64x64/128/64/4/2'),
    ('tupe_a', 'bfloat16', 512, 40, 'key', {}, 'TPU', {},
     'splash - - 88 fold'),
    ('shaw', 'bfloat16', 512, 64, 'key', {}, 'CPU', {},
     'reference - - 64 logits'),
    ('shaw', 'bfloat16', 512, 64, 'key', {}, 'H100', {},
     'dot_product_attention cudnn lengths or full 64 bias'),
    ('shaw', 'bfloat16', 512, 64, 'key', {}, 'A100', {},
     'dot_product_attention cudnn lengths or full 64 bias'),
    ('shaw', 'bfloat16', 512, 64, 'key', {}, 'TPU', {},
     'dot_product_attention xla mask 64 bias'),
    ('shaw', 'bfloat16', 512, 64, 'full', {}, 'CPU', {},
     'reference - - 64 logits'),
    ('shaw', 'bfloat16', 512, 64, 'full', {}, 'H100', {},
     'dot_product_attention cudnn full 64 bias'),
    ('shaw', 'bfloat16', 512, 64, 'full', {}, 'A100', {},
     'dot_product_attention cudnn full 64 bias'),
    ('shaw', 'bfloat16', 512, 64, 'full', {}, 'TPU', {},
     'dot_product_attention xla mask 64 bias'),
    ('rope', 'bfloat16', 256, 128, 'none', {'causal': True}, 'CPU', {},
     'reference - - 128 logits'),
    ('rope', 'bfloat16', 256, 128, 'none', {'causal': True}, 'H100', {},
     'dot_product_attention cudnn - 128 transform'),
    ('rope', 'bfloat16', 256, 128, 'none', {'causal': True}, 'A100', {},
     'dot_product_attention cudnn - 128 transform'),
    ('rope', 'bfloat16', 256, 128, 'none', {'causal': True}, 'TPU', {},
     'splash - - 128 transform'),
    ('segment_per_head', 'float32', 64, 64, 'key', {'dropout': True}, 'CPU', {},
     'reference - - 64 logits'),
    ('segment_per_head', 'float32', 64, 64, 'key', {'dropout': True}, 'H100', {},
     'kernel - - 72 fold gather/tiles/tiles/64x64/128/64/4/2'),
    ('segment_per_head', 'float32', 64, 64, 'key', {'dropout': True}, 'A100', {},
     'kernel - - 72 fold gather/tiles/tiles/64x64/128/64/4/2'),
    ('segment_per_head', 'float32', 64, 64, 'key', {'dropout': True}, 'TPU', {},
     'kernel - - 72 fold roll/tiles/tiles/128x128/128/64/None/None'),
]


@pytest.mark.parametrize("scheme, dtype, length, head_dim, mask, options, device, forced, want",
                         PINNED)
def test_the_plan_chosen_is_pinned(scheme, dtype, length, head_dim, mask, options, device,
                                   forced, want):
  shape = (2, length, HEADS, head_dim)
  table = route_table.RouteTable().forcing(**forced)
  plan = route_plan.plan(shape, shape, shape, dtype, _forms(scheme, length, head_dim),
                         mask=mask, device=DEVICES[device], table=table, **options)
  assert _summary(plan) == want


@pytest.mark.parametrize("scheme", sorted(SCHEME_CONFIGS))
def test_each_form_says_what_its_fused_part_holds(scheme):
  """``fused_form`` reads static attributes only; it must agree with the arrays ``fused``
  returns, for every scheme's terms."""
  length, head_dim = 16, 8
  _, _, st = init_scheme(SCHEME_CONFIGS[scheme], length=length)
  q = jnp.ones((2, length, HEADS, head_dim))
  for term in st.for_layer(0):
    term = term.with_key_length(length).with_keys(q)  # as attend: lengths, then keys
    form = term.fused_form()
    assert form.name == type(term).__name__ and form.fusable == term.fusable
    if not term.fusable:
      continue
    part = term.fused(q, 0.5)
    assert (part.bias is not None) == (form.entry == "bias")
    assert (part.q_extra is not None) == (form.entry == "fold")
    assert (part.offset_bias is not None) == (form.entry == "toeplitz")
    assert form.rank == (part.q_extra.shape[-1] if part.q_extra is not None else 0)
    assert form.zero_first == part.zero_first
    if form.table_form == "factored":  # batch-free: one row for every example
      assert part.q_extra.shape[0] == 1


def test_the_table_decides_only_through_the_plan_arguments():
  """The same call planned with two tables: the one whose point says materialise gets the
  term as a bias (cuDNN), the empty one the kernel; nothing global is read."""
  forms = _forms("diet_rel", 512, 64)
  shape = (8, 512, HEADS, 64)
  point = Point(device=H100.kind, dtype="bfloat16", form="toeplitz", batch=8, length=512,
                heads=HEADS, head_dim=64, rank=0, default_ms=2.0, materialised_ms=1.0)
  ask = lambda table: route_plan.plan(shape, shape, shape, "bfloat16", forms,  # noqa: E731
                                      mask="key", device=H100, table=table)
  materialised, kernel = ask(route_table.RouteTable((point,))), ask(route_table.RouteTable())
  assert (materialised.runner, materialised.entries, materialised.implementation) == (
      "dot_product_attention", ("table",), "cudnn")
  assert (kernel.runner, kernel.entries) == ("kernel", ("kernel",))
  with route_table.forced(toeplitz=True):  # a context does not reach a plan given its table
    assert ask(route_table.RouteTable()).runner == "kernel"


# The packaged H100 points against each device: (scheme, length) -> its plan's summary on
# the H100 and an H200 without points of its own (compute capability 9.0 both), and on an
# A100 (8.0: none).
PACKAGED_PLANS = [
    ("diet_abs", 512, "dot_product_attention cudnn lengths or full 64 table",
     "dot_product_attention cudnn lengths or kernel 72 fold gather/tiles/tiles/64x64/128/64/4/2"),
    ("diet_abs", 16384,
     "dot_product_attention cudnn lengths or kernel 72 fold gather/tiles/tiles/64x64/128/64/4/2",
     "dot_product_attention cudnn lengths or kernel 72 fold gather/tiles/tiles/64x64/128/64/4/2"),
    ("diet_rel", 512, "dot_product_attention cudnn lengths or full 64 table",
     "kernel - - 64 kernel gather/tiles/tiles/64x64/64/64/4/2"),
    ("diet_rel", 16384, "kernel - - 64 kernel gather/hopper/hopper/64x64/64/64/4/2",
     "kernel - - 64 kernel gather/tiles/tiles/64x64/64/64/4/2"),
    # ALiBi's closed form: the vector where the H100's points have the Hopper passes faster
    # (they did not measure the closed form), evaluated in the Triton tiles where there are
    # no points (the A100).
    ("alibi", 16384, "kernel - - 64 kernel gather/hopper/hopper/64x64/64/64/4/2",
     "kernel - - 64 registers gather/tiles/tiles/64x64/64/64/4/2"),
]


def _packaged(device: str | None = None) -> route_table.RouteTable:
  """The packaged points (``device``'s alone where given)."""
  return route_table.RouteTable(tuple(p for p in route_table.read(route_table.PACKAGED)
                                      if device in (None, p.device)))


@pytest.mark.parametrize("scheme, length, hopper, a100", PACKAGED_PLANS)
def test_an_h200_plans_with_the_h100s_points_until_it_has_its_own(scheme, length, hopper, a100):
  """An H200 without points of its own reads the H100's, of the same compute capability
  (materialised at 512, the Hopper passes at 16384), and its plan says whose they are; an
  A100 keeps the default ways; once the H200 has a point of its own, only its own count."""
  table = _packaged(H100.kind)
  shape = (2, length, HEADS, 64)
  ask = lambda device, table=table: route_plan.plan(  # noqa: E731
      shape, shape, shape, "bfloat16", _forms(scheme, length, 64), mask="key", device=device,
      table=table)
  assert (_summary(ask(H100)), _summary(ask(H200)), _summary(ask(A100))) == (hopper, hopper,
                                                                            a100)
  lines = str(ask(H200)).splitlines()
  assert "  route table: NVIDIA H100 80GB HBM3's points" in lines
  assert ("  because NVIDIA H200 has no route-table points of its own: it reads NVIDIA H100 "
          "80GB HBM3's, of the same compute capability 9.0") in lines
  assert "  route table: NVIDIA H100 80GB HBM3's points" in str(ask(H100)).splitlines()
  assert "route table: no points for this device (the default ways)" in str(ask(A100))
  own = Point(device=H200.kind, dtype="float32", form="toeplitz", batch=1, length=64,
              heads=HEADS, head_dim=64, rank=0, default_ms=1.0, materialised_ms=2.0,
              compute_capability="9.0")
  with_own = dataclasses.replace(table, points=(*table.points, own))
  # Its own points have none in bfloat16: the default ways, as with no table.
  assert _summary(ask(H200, with_own)) == _summary(ask(H200, route_table.RouteTable()))
  assert "  route table: NVIDIA H200's points" in str(ask(H200, with_own)).splitlines()


# The packaged H200 points (docs/results/h200-2026-11-28.md): (scheme, length) -> its plan's
# summary on the H200. At 512 every term is materialised for cuDNN; at 8k ALiBi's closed form
# stays in the Triton tiles (7.96 ms against the Hopper passes' 11.07), KERPLE's log form and
# the other Toeplitz terms take the Hopper passes, and DIET-ABS folds.
H200_PLANS = [
    ("alibi", 512, "dot_product_attention cudnn lengths or full 64 table"),
    ("kerple_log", 512, "dot_product_attention cudnn lengths or full 64 table"),
    ("diet_abs", 512, "dot_product_attention cudnn lengths or full 64 table"),
    ("alibi", 8192, "kernel - - 64 registers gather/tiles/tiles/64x64/64/64/4/2"),
    ("kerple_log", 8192, "kernel - - 64 kernel gather/hopper/hopper/64x64/64/64/4/2"),
    ("t5", 8192, "kernel - - 64 kernel gather/hopper/hopper/64x64/64/64/4/2"),
    ("diet_abs", 8192,
     "dot_product_attention cudnn lengths or kernel 72 fold gather/tiles/tiles/64x64/128/64/4/2"),
]


@pytest.mark.parametrize("scheme, length, summary", H200_PLANS)
def test_the_h200_plans_with_its_own_points(scheme, length, summary):
  shape = (2, length, HEADS, 64)
  plan = route_plan.plan(shape, shape, shape, "bfloat16", _forms(scheme, length, 64),
                         mask="key", device=H200, table=_packaged())
  assert _summary(plan) == summary
  assert "  route table: NVIDIA H200's points" in str(plan).splitlines()


def test_the_plan_prints_what_runs_and_why():
  forms = _forms("t5", 512, 64)
  shape = (8, 512, HEADS, 64)
  text = str(route_plan.plan(shape, shape, shape, "bfloat16", forms, mask="key", device=H100,
                             table=route_table.RouteTable().forcing(hopper="both")))
  assert text.splitlines()[:3] == [
      "route fused: kernel, q/k width 64",
      "  term Toeplitz: kernel",
      ("  kernel: forward Hopper, backward Hopper; blocks 64x64, head dims 64/64, 4 warps, "
       "2 stages; offset bias")]
  reference = str(route_plan.plan(shape, shape, shape, "float32", forms, device=CPU,
                                  table=route_table.RouteTable()))
  assert reference.splitlines()[0] == "route reference: reference, q/k width 64"
  assert "auto on CPU" in reference


def test_attend_runs_the_plan_it_prints():
  """On CPU with route='fused', the plan_for of attend's arguments names the kernel, and the
  traced call holds the Pallas kernel; with a dense Shaw term, dot_product_attention."""
  for scheme, runner, kernel_calls in (("diet_rel", "kernel", 1), ("shaw", "dot_product_attention",
                                                                    0)):
    _, _, st = init_scheme(SCHEME_CONFIGS[scheme], length=16)
    terms = [t.with_key_length(16) for t in st.for_layer(0)]
    q = jnp.ones((2, 16, HEADS, 8))
    plan = route_plan.plan_for(q, q, q, terms, route="fused")
    assert plan.runner == runner
    jaxpr = str(jax.make_jaxpr(lambda q, terms=terms: attend(q, q, q, terms, route="fused"))(q))
    assert jaxpr.count("pallas_call") == kernel_calls
