"""MFU that can be trusted: the peak table against real ``device_kind`` strings, the analytic
FLOP count against hand counts and against the matmuls in the model's own jaxpr."""

import math
import time
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posenc_jax.models import model_config
from posenc_jax.models.build import abstract_params, build_model
from posenc_jax.training import metrics
from posenc_jax.training.metrics import (PEAK_FLOPS, Throughput, peak_flops, peak_flops_for_kind,
                                         train_flops_per_step)

# --- The peak table -----------------------------------------------------------------------------

# device_kind strings as JAX reports them. TPUs: every string jax/_src/tpu_info.py
# ``chip_version_from_device_kind`` accepts (the test below asks the installed JAX too).
# GPUs: CUDA device names (cudaGetDeviceProperties().name, what nvidia-smi prints), as JAX's
# GPU tests and the cloud GPU catalogues (RunPod's gpuTypeIds) spell them.
REAL_TPU_KINDS = {"TPU v2", "TPU v3", "TPU v4", "TPU v4 lite", "TPU v5 lite", "TPU v5e",
                  "TPU v5", "TPU v5p", "TPU v6 lite", "TPU v6e", "TPU7x"}
REAL_GPU_KINDS = {"NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-80GB", "NVIDIA A100-PCIE-40GB",
                  "NVIDIA A100 80GB PCIe", "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe",
                  "NVIDIA H100 NVL", "NVIDIA GH200 480GB", "NVIDIA H200", "NVIDIA H200 NVL",
                  "NVIDIA B200"}

# Vendor figures per chip (bf16, dense) and TensorCores per chip, from the Cloud TPU pages;
# a JAX device is one TensorCore except on the megacore chips v4 and v5p (the whole chip).
TPU_CHIPS = {  # kind: (bf16 per chip, TensorCores per chip, TensorCores per JAX device)
    "TPU v2": (45e12, 2, 1), "TPU v3": (123e12, 2, 1), "TPU v4": (275e12, 2, 2),
    "TPU v4 lite": (137e12, 1, 1), "TPU v5 lite": (197e12, 1, 1), "TPU v5e": (197e12, 1, 1),
    "TPU v5": (459e12, 2, 2), "TPU v5p": (459e12, 2, 2), "TPU v6 lite": (918e12, 1, 1),
    "TPU v6e": (918e12, 1, 1), "TPU7x": (2307e12, 2, 1),
}


def test_every_key_is_a_real_device_kind():
  assert set(PEAK_FLOPS) == REAL_TPU_KINDS | REAL_GPU_KINDS
  tpu_info = pytest.importorskip("jax._src.tpu_info")
  for kind in REAL_TPU_KINDS:  # the installed JAX knows each TPU string
    assert tpu_info.chip_version_from_device_kind(kind) is not None, kind


def test_tpu_peaks_are_per_jax_device():
  for kind, (chip, cores, per_device) in TPU_CHIPS.items():
    assert peak_flops_for_kind(kind) == pytest.approx(chip / cores * per_device), kind
  tpu_info = pytest.importorskip("jax._src.tpu_info")
  for kind, (_, cores, per_device) in TPU_CHIPS.items():  # the layout JAX itself describes
    chip = tpu_info.chip_version_from_device_kind(kind)
    assert chip.num_physical_tensor_cores_per_chip == cores, kind
    assert (per_device == 2) == chip.supports_megacore, kind


def test_issue_15_cases():
  assert peak_flops_for_kind("TPU v5") == 459e12  # v5p reports "TPU v5"
  assert peak_flops_for_kind("TPU v3") == 61.5e12  # one TensorCore, not the chip's 123
  assert peak_flops_for_kind("TPU v6 lite") == 918e12
  assert peak_flops_for_kind("NVIDIA H200") == 989.5e12
  assert peak_flops_for_kind("NVIDIA B200") == 2250e12
  assert peak_flops_for_kind("NVIDIA H100 80GB HBM3") == 989.4e12
  assert peak_flops_for_kind("NVIDIA H100 PCIe") == 756e12


def test_float32_peaks():
  assert peak_flops_for_kind("NVIDIA H100 80GB HBM3", "float32") == 494.7e12  # TF32
  assert peak_flops_for_kind("NVIDIA A100-SXM4-40GB", jnp.float32) == 156e12
  assert peak_flops_for_kind("TPU v5 lite", "float32") == 197e12  # one bf16 pass
  for kind, (bf16, fp32) in PEAK_FLOPS.items():  # the bf16 default never overstates MFU
    assert bf16 >= fp32 > 0, kind


def test_unknown_kinds_get_no_peak():
  for kind in ("cpu", "TPU v9", "TPU7", "NVIDIA H100", "NVIDIA H200 SXM 141GB",
               "Tesla V100-SXM2-16GB", "NVIDIA GeForce RTX 4090", "NVIDIA A1000", "NVIDIA A100X",
               "NVIDIA A100-SXM4-40GB MIG 1g.5gb", "NVIDIA H100 80GB HBM3 MIG 3g.40gb", ""):
    assert peak_flops_for_kind(kind) is None, kind
  assert peak_flops_for_kind("NVIDIA H200", "float16") is None
  assert peak_flops_for_kind("NVIDIA H200", "int8") is None


def test_prefix_rules():
  assert peak_flops_for_kind("NVIDIA A100-SXM-80GB") == 312e12
  assert peak_flops_for_kind("NVIDIA A100 40GB PCIe") == 312e12
  assert peak_flops_for_kind("NVIDIA GH200 120GB") == 989.5e12
  assert peak_flops_for_kind("NVIDIA GH200 144G HBM3e", "float32") == 494.5e12


def test_megacore_split_mode():
  assert peak_flops_for_kind("TPU v4", num_cores=2) == 275e12
  assert peak_flops_for_kind("TPU v4", num_cores=1) == 137.5e12
  assert peak_flops_for_kind("TPU v5", num_cores=1) == 229.5e12
  assert peak_flops_for_kind("TPU v3", num_cores=1) == 61.5e12


def test_peak_flops_reads_the_device():
  device = types.SimpleNamespace(device_kind="TPU v5", num_cores=1)
  assert peak_flops(device) == 229.5e12
  gpu = types.SimpleNamespace(device_kind="NVIDIA H200")
  assert peak_flops(gpu, "float32") == 494.5e12
  assert peak_flops(jax.devices("cpu")[0]) is None


def test_throughput_mfu(monkeypatch):
  devices = [types.SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3")] * 4
  monkeypatch.setattr(metrics.jax, "devices", lambda: devices)
  monkeypatch.setattr(metrics.jax, "device_count", lambda: len(devices))
  clock = iter([10.0, 12.0])
  monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
  rates = Throughput(100, 1000, 1e15, dtype="bfloat16")
  rates.start(0)
  out = rates.report(10)  # 10 steps in 2 s
  assert out["steps_per_s"] == 5.0 and out["tokens_per_s_per_device"] == 1250.0
  assert out["mfu"] == pytest.approx(1e15 * 5.0 / (4 * 989.4e12))
  float32 = Throughput(100, 1000, 1e15, dtype="float32").peak()
  assert float32 == pytest.approx(4 * 494.7e12)


def test_throughput_omits_mfu_on_unknown_devices(monkeypatch):
  devices = [types.SimpleNamespace(device_kind="TPU v5"), types.SimpleNamespace(device_kind="cpu")]
  monkeypatch.setattr(metrics.jax, "devices", lambda: devices)
  monkeypatch.setattr(metrics.jax, "device_count", lambda: len(devices))
  rates = Throughput(100, 1000, 1e15)
  rates.start(0)
  assert "mfu" not in rates.report(5) and rates.peak() is None


# --- The FLOP count ------------------------------------------------------------------------------


def test_bert_base_hand_count():
  """BERT-base (V = 30522, d = 768, 12 layers, H = 12, D = 64, F = 3072), L = 512, B = 32,
  MLM logits at every position. Per example, forward, 2 FLOPs per multiply-add."""
  per_layer = (
      2_415_919_104     # q, k, v, o projections: 4 x 2 L d (H D) = 4 x 2 x 512 x 768 x 768
      + 4_831_838_208   # MLP in and out:         2 x 2 L d F     = 2 x 2 x 512 x 768 x 3072
      + 402_653_184     # Q K^T:                  2 H L^2 D       = 2 x 12 x 512^2 x 64
      + 402_653_184)    # P V:                    2 H L^2 D       = 2 x 12 x 512^2 x 64
  assert per_layer == 8_053_063_680
  forward = (
      12 * per_layer    # 12 layers                                                = 96_636_764_160
      + 1_572_864       # token types: one-hot [L, 2] x [2, d] = 2 x 512 x 2 x 768
      + 603_979_776     # MLM transform: 2 L d^2           = 2 x 512 x 768^2
      + 24_003_477_504) # tied decoder:  2 L d V           = 2 x 512 x 768 x 30522
  assert forward == 121_245_794_304
  train = 3 * 32 * forward  # backward = 2 x forward; B = 32
  assert train == 11_639_596_253_184
  cfg = model_config()  # the defaults are BERT-base
  assert train_flops_per_step(cfg, 32, 512) == train
  assert train_flops_per_step(cfg.to_dict(), 32, 512, head="mlm") == train


def test_predictions_per_seq_removes_the_head_at_unmasked_positions():
  cfg = model_config()
  full = train_flops_per_step(cfg, 32, 512)
  masked = train_flops_per_step(cfg, 32, 512, predictions_per_seq=80)
  # The head at 512 - 80 = 432 positions fewer: (2 d^2 + 2 d V) = 1_179_648 + 46_881_792
  # per position, 3 x B = 96 times; the one-hot selection of 80 of 512 hidden states adds
  # 2 P L d = 2 x 80 x 512 x 768 = 62_914_560 per example.
  assert full - masked == 3 * 32 * (432 * (1_179_648 + 46_881_792) - 62_914_560)
  assert full - masked == 1_987_164_241_920
  assert masked == 9_652_432_011_264
  # Selecting all 512 positions is the full head plus the selection's matmul.
  every = train_flops_per_step(cfg, 32, 512, predictions_per_seq=512)
  assert every - full == 3 * 32 * 2 * 512 * 512 * 768


def _per_layer_attention_extra(cfg, batch, length, rank=0, rows=0):
  """Training FLOPs that ``rank`` folded dims and ``rows`` query-offset rows add to the model."""
  heads, dim = cfg.num_heads, cfg.dim_per_head
  return 3 * batch * cfg.num_layers * (2 * heads * length * length * rank
                                       + 2 * heads * length * rows * dim)


@pytest.mark.parametrize("scheme, rank, rows", [
    ({"name": "diet_abs", "rank": 128, "sharing": "layer"}, 128, 0),
    ({"name": "diet_abs"}, 64, 0),                         # d_p defaults to D
    ({"name": "tupe_a"}, 64 + 2, 0),                       # D, plus the [CLS] reset's 2
    ({"name": "tupe_a", "untie_cls": False}, 64, 0),
    ({"name": "tupe_r"}, 64 + 2, 0),
    ({"name": "shaw", "clip": 16}, 0, 33),                 # 2t + 1 offsets
    ({"name": "shaw", "clip": 16, "value": True}, 0, 66),  # and as many for the value table
    ({"name": "sinusoidal_rpe"}, 0, 258),                  # clip 64, key and value terms
    ({"name": "t5"}, 0, 0), ({"name": "alibi"}, 0, 0), ({"name": "rope"}, 0, 0),
    ({"name": "diet_rel"}, 0, 0), ({"name": "bert_ad"}, 0, 0), ({"name": "none"}, 0, 0),
])
def test_positional_terms(scheme, rank, rows):
  base = model_config(scheme={"name": "learned_ape"})
  cfg = base.replace(scheme=scheme)
  extra = train_flops_per_step(cfg, 8, 128) - train_flops_per_step(base, 8, 128)
  assert extra == _per_layer_attention_extra(cfg, 8, 128, rank, rows)


def test_per_head_segments_fold_their_rank():
  base = model_config(segment=None)
  cfg = base.replace(segment={"name": "segment_per_head", "num_segments": 3})
  extra = train_flops_per_step(cfg, 4, 64) - train_flops_per_step(base, 4, 64)
  # Rank 3 folded into q/k, and u = onehot [L, 3] x S [3, 3] for 12 layers x 12 heads.
  u = 3 * 4 * 2 * 64 * 3 * 3 * 12 * 12
  assert extra == _per_layer_attention_extra(cfg, 4, 64, rank=3) + u
  with_input = base.replace(segment={"name": "segment_input"})  # 2 L n_seg d per example
  assert train_flops_per_step(with_input, 4, 64) - train_flops_per_step(base, 4, 64) == (
      3 * 4 * 2 * 64 * 2 * 768)


def test_linformer_hand_count():
  cfg = model_config(attention="linformer", linformer_k=32, max_len=256, num_layers=2,
                     scheme={"name": "diet_abs_lin", "k": 32, "rank": 16}, segment=None)
  length, k, d, hd, heads, dim = 256, 32, 768, 768, 12, 64
  layer = (2 * 2 * length * d * hd           # q, o projections
           + 2 * 2 * k * d * hd              # k, v projections of the k compressed rows
           + 2 * 2 * k * length * d          # E X and F X along the sequence
           + 2 * heads * length * k * (dim + 16)  # Q K'^T over D plus the folded rank
           + 2 * heads * length * k * dim    # P V'
           + 2 * 2 * length * d * 3072)      # MLP
  head = length * (2 * d * d + 2 * d * 30522)
  assert train_flops_per_step(cfg, 2, length) == 3 * 2 * (2 * layer + head)


def test_encoder_decoder_hand_count():
  """Transformer-base sizes (d = 512, H = 8, D = 64, F = 2048, 6 + 6 layers, V = 32000),
  source 200 and target 150 tokens, B = 8."""
  cfg = model_config(vocab_size=32000, d_model=512, num_heads=8, mlp_dim=2048, num_layers=6,
                     num_decoder_layers=6, scheme={"name": "sinusoidal_ape"}, segment=None,
                     pooler=False)
  ls, lt = 200, 150
  encoder_layer = (
      4 * 2 * ls * 512 * 512          # q, k, v, o:   419_430_400
      + 2 * 2 * ls * 512 * 2048       # MLP:          838_860_800
      + 2 * 8 * ls * ls * 64 * 2)     # QK^T and PV:   81_920_000
  decoder_layer = (
      4 * 2 * lt * 512 * 512          # self q, k, v, o:                         314_572_800
      + 2 * 8 * lt * lt * 64 * 2 // 2  # causal self QK^T and PV, half the pairs:  23_040_000
      + 2 * 2 * lt * 512 * 512        # cross q and o over the targets:          157_286_400
      + 2 * 2 * ls * 512 * 512        # cross k and v over the sources:          209_715_200
      + 2 * 8 * lt * ls * 64 * 2      # cross QK^T and PV:                        61_440_000
      + 2 * 2 * lt * 512 * 2048)      # MLP:                                     629_145_600
  output = 2 * lt * 512 * 32000       # logits against the shared table:      4_915_200_000
  assert encoder_layer == 1_340_211_200 and decoder_layer == 1_395_200_000
  forward = 6 * encoder_layer + 6 * decoder_layer + output
  assert train_flops_per_step(cfg, 8, ls, target_length=lt) == 3 * 8 * forward
  assert train_flops_per_step(cfg, 8, ls, target_length=lt, head="translation") == (
      3 * 8 * forward)
  unshared = cfg.replace(share_embeddings=False)  # a Dense [d, V]: the same matmul
  assert train_flops_per_step(unshared, 8, ls, target_length=lt) == 3 * 8 * forward


def test_fine_tuning_heads():
  cfg = model_config(num_layers=1)
  encoder = train_flops_per_step(cfg, 4, 128) - 3 * 4 * 128 * (2 * 768 * 768 + 2 * 768 * 30522)
  assert train_flops_per_step(cfg, 4, 128, head="classification", num_labels=3) == (
      encoder + 3 * 4 * (2 * 768 * 768 + 2 * 768 * 3))
  assert train_flops_per_step(cfg, 4, 128, head="span") == encoder + 3 * 4 * 128 * 2 * 768 * 2
  assert train_flops_per_step(cfg, 4, 128, head="encoder") == encoder + 3 * 4 * 2 * 768 * 768


@pytest.mark.parametrize("kwargs, field", [
    (dict(head="decoder"), "head"),
    (dict(head="translation"), "head"),
    (dict(predictions_per_seq=129), "predictions_per_seq"),
    (dict(predictions_per_seq=0), "predictions_per_seq"),
    (dict(predictions_per_seq=10, head="span"), "predictions_per_seq"),
    (dict(target_length=64), "target_length"),
    (dict(num_labels=0, head="classification"), "num_labels"),
])
def test_bad_arguments_raise_one_line(kwargs, field):
  with pytest.raises(ValueError, match=f"^train_flops_per_step: {field}: got") as e:
    train_flops_per_step(model_config(num_layers=1), 4, 128, **kwargs)
  assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match="batch: got 0"):
    train_flops_per_step(model_config(num_layers=1), 0, 128)
  with pytest.raises(ValueError, match="head: got 'mlm'"):
    train_flops_per_step(model_config(num_decoder_layers=1, segment=None), 4, 128, head="mlm")


# --- Against the matmuls the model runs ----------------------------------------------------------


def _dot_flops(jaxpr) -> int:
  """2 x multiply-adds of every dot_general in ``jaxpr`` and its sub-jaxprs, a scan's body
  (the scanned layers) once per iteration."""
  total = 0
  for eqn in jaxpr.eqns:
    assert eqn.primitive.name != "while", "a loop of unknown trip count"
    if eqn.primitive.name == "scan":
      total += eqn.params["length"] * _dot_flops(eqn.params["jaxpr"])
      continue
    if eqn.primitive.name == "dot_general":
      lhs, rhs = (v.aval.shape for v in eqn.invars)
      (_, rhs_contract), (_, rhs_batch) = eqn.params["dimension_numbers"]
      free = [n for i, n in enumerate(rhs) if i not in rhs_contract and i not in rhs_batch]
      total += 2 * math.prod(lhs) * math.prod(free)
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if hasattr(sub, "eqns"):  # a (closed) jaxpr: jit, custom_jvp, remat bodies
          total += _dot_flops(sub)
  return total


def _forward_dot_flops(model, *inputs, **keywords) -> int:
  """Matmul FLOPs of ``model``'s forward pass on abstract ``inputs`` and ``keywords``."""
  apply = lambda p, a, k: model.apply({"params": p}, *a, **k)  # noqa: E731
  return _dot_flops(jax.make_jaxpr(apply)(abstract_params(model), inputs, keywords))


TINY = dict(vocab_size=50, d_model=16, num_layers=2, num_heads=2, mlp_dim=24, max_len=32,
            route="reference", dropout_rate=0.0, attention_dropout_rate=0.0)


@pytest.mark.parametrize("fields, batch", [
    (dict(pooler=False), 3),
    (dict(pooler=False, segment=None, scheme={"name": "shaw", "clip": 3, "value": True}), 3),
    # The reference route materialises a batch-free factored term once per layer; with one
    # example that is the fused route's per-example fold.
    (dict(pooler=False, segment=None, scheme={"name": "diet_abs", "rank": 5}), 1),
    (dict(pooler=False, segment={"name": "segment_per_head", "num_segments": 2},
          scheme={"name": "rope"}), 1),
    (dict(pooler=False, segment=None, attention="linformer", linformer_k=8,
          scheme={"name": "diet_abs_lin", "k": 8, "rank": 3}), 1),
])
def test_mlm_count_matches_the_jaxpr(fields, batch):
  cfg = model_config(**TINY, **fields)
  model = build_model(cfg, "mlm")
  ids = jax.ShapeDtypeStruct((batch, 20), jnp.int32)
  assert train_flops_per_step(cfg, batch, 20) == 3 * _forward_dot_flops(model, ids, ids, ids)
  positions = jax.ShapeDtypeStruct((batch, 6), jnp.int32)
  got = _forward_dot_flops(model, ids, ids, ids, masked_positions=positions)
  assert train_flops_per_step(cfg, batch, 20, predictions_per_seq=6) == 3 * got


def test_fine_tuning_counts_match_the_jaxpr():
  cfg = model_config(**TINY)
  ids = jax.ShapeDtypeStruct((3, 20), jnp.int32)
  model = build_model(cfg, "classification", num_labels=3)
  assert train_flops_per_step(cfg, 3, 20, head="classification", num_labels=3) == (
      3 * _forward_dot_flops(model, ids, ids, ids))
  span = build_model(cfg.replace(pooler=False), "span")
  assert train_flops_per_step(cfg.replace(pooler=False), 3, 20, head="span") == (
      3 * _forward_dot_flops(span, ids, ids, ids))


def test_encoder_decoder_count_matches_the_jaxpr():
  cfg = model_config(**{**TINY, "num_decoder_layers": 3, "segment": None, "pooler": False,
                        "scheme": {"name": "sinusoidal_ape"}})
  model = build_model(cfg, "translation")
  src, tgt = jax.ShapeDtypeStruct((2, 20), jnp.int32), jax.ShapeDtypeStruct((2, 12), jnp.int32)
  ran = _forward_dot_flops(model, src, tgt)
  # The reference route computes every (query, key) pair of the causal self-attention and
  # masks half; the count takes half: 2 x 2 H Lt^2 D / 2 fewer per decoder layer and example.
  masked_half = 3 * 2 * (2 * 2 * 12 * 12 * 8 * 2 // 2)  # 3 decoder layers, B = 2
  assert train_flops_per_step(cfg, 2, 20, target_length=12) == 3 * (ran - masked_half)


def test_no_warning_for_the_new_call():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert np.isfinite(train_flops_per_step(model_config(num_layers=1), 2, 16))
