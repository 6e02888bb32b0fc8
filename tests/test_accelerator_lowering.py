"""Every preset's jitted training step lowers for GPU and TPU, without an accelerator.

What only an accelerator would reject is checked here by lowering for it:
``jax.jit(step).trace(...).lower(lowering_platforms=(platform,))`` runs every
trace-time check of the route ``auto`` picks on that platform (cuDNN's layout
checks, Pallas' Triton and Mosaic lowering), in bfloat16 with a padding mask.
Stubs, inside these tests only, stand in for the device: JAX's default backend
reads as the target platform (so the library routes as it would there), the
GPU's compute capability reads 9.0, and cuDNN's installed-version and
compute-capability queries answer as an H100 with cuDNN 9.10 would (on a machine
without CUDA, JAX refuses the cuDNN path at that check, before the layout checks
this test is for), as does the GPU query of Pallas' Triton lowering.
"""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import linen as nn
from jax._src.cudnn import fused_attention_stablehlo
from jax._src.pallas.triton import gpu_info

from posenc_jax import route_table
from posenc_jax.attention import attend
from posenc_jax.kernels import blocks
from posenc_jax.models import model_config
from posenc_jax.models.build import build_model
from posenc_jax.presets import preset_config
from posenc_jax.training.config import base_train_config
from posenc_jax.training.loop import TrainState, make_train_step
from posenc_jax.training.optim import make_optimizer

BATCH, LENGTH = 2, 128
ENCODER_PRESETS = ("bert", "shaw", "t5", "tupe_a", "tupe_r", "bert_ad", "diet_rel",
                   "diet_rel_share", "diet_abs", "diet_abs_share", "segment_per_head", "alibi",
                   "rope", "linformer", "diet_abs_lin", "kerple_log", "kerple_power", "fire",
                   "xpos", "rope_dynamic", "rope,nope_every_2")
# Causal-only schemes (encoders refuse them): the language model's training step.
LM_PRESETS = ("cope", "fox")
TRANSLATION_PRESETS = ("transformer_base", "transformer_base,t5", "transformer_base,diet_rel",
                       "transformer_base,alibi")
# Lowered-text markers of the kernels each route calls.
CUDNN, TRITON, MOSAIC = "__cudnn$fmha", "__gpu$xla.gpu.triton", "tpu_custom_call"


@pytest.fixture
def on_platform(monkeypatch):
  """``on_platform(name)``: the library sees backend ``name`` ("gpu", "tpu"); cuDNN and Pallas
  lower as for an H100.

  (Pallas alone can be told its target by an abstract mesh's device, as
  ``tests/test_relative_flash.py`` does; cuDNN's custom calls refuse an abstract mesh, so a
  step holding both gets the H100's answers from stubs.)
  """

  def use(name):
    # The default ways: this host's kind has no route-table points, and with the H100's
    # compute capability it would read the H100's (route_table.RouteTable.whose).
    monkeypatch.setattr(route_table, "points", lambda: [])
    h100 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    monkeypatch.setattr(gpu_info, "get_gpu_info", lambda: h100)
    monkeypatch.setattr(blocks, "gpu_compute_capability", lambda: "9.0")
    monkeypatch.setattr(jax, "default_backend", lambda: name)
    monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(fused_attention_stablehlo, "check_compute_capability", lambda cap: True)
    monkeypatch.setattr(fused_attention_stablehlo, "is_cuda_compute_capability_equal",
                        lambda cap: cap == "9.0")

  return use


def _train_config(preset: str, head: str | None = None, **model_overrides
                  ) -> ml_collections.ConfigDict:
  config = base_train_config()
  config.total_steps = config.optimizer.warmup_steps * 10
  preset_cfg = preset_config(preset)
  config.head = head or preset_cfg.head
  config.objective = {"translation": "translation", "lm": "lm"}.get(config.head, "mlm")
  model = preset_cfg.model.to_dict()
  if config.head == "lm":
    model.update(segment=None)
  if config.head == "translation":  # transformer_base at test size
    model.update(vocab_size=512, d_model=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                 mlp_dim=128, max_len=LENGTH)
  model.update(dtype="bfloat16", **model_overrides)
  config.model = ml_collections.ConfigDict(model, type_safe=False)
  return config


def _abstract_batch(objective: str) -> dict[str, jax.ShapeDtypeStruct]:
  ids = jax.ShapeDtypeStruct((BATCH, LENGTH), jnp.int32)
  if objective == "translation":
    return {"inputs": ids, "targets": ids}
  if objective == "lm":
    return {"targets": ids}
  weights = jax.ShapeDtypeStruct((BATCH, LENGTH), jnp.float32)
  return {"input_ids": ids, "segment_ids": ids, "mask": ids, "mlm_targets": ids,
          "mlm_weights": weights}


def lowered_train_step(config: ml_collections.ConfigDict, platform: str) -> str:
  """The text of ``train.py``'s jitted training step for ``config``, lowered for ``platform``."""
  model = build_model(config.model, config.head)
  tx, schedule = make_optimizer(config.optimizer, config.total_steps)
  batch = _abstract_batch(config.objective)
  concrete = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), batch)
  inputs = ((concrete["inputs"], concrete["targets"], concrete["inputs"] > 0)
            if config.objective == "translation" else (concrete["targets"],)
            if config.objective == "lm" else
            (concrete["input_ids"], concrete["segment_ids"], concrete["mask"]))

  def init(rng):
    params = nn.unbox(model.init(rng, *inputs))["params"]
    return TrainState.create(apply_fn=model.apply, params=params, tx=tx)

  state = jax.eval_shape(init, jax.random.key(0))
  rng = jax.eval_shape(lambda: jax.random.key(0))
  step = jax.jit(make_train_step(model, config, schedule), donate_argnums=(0,))
  return step.trace(state, batch, rng).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
@pytest.mark.parametrize("preset", ENCODER_PRESETS + TRANSLATION_PRESETS + LM_PRESETS)
def test_training_step_lowers_in_bfloat16(on_platform, platform, preset):
  """No attention dropout (as the bench, fine-tuning evaluation and decoding run): the
  fused route wherever ``auto`` takes it on that platform."""
  on_platform(platform)
  name = preset if preset.startswith("transformer") else f"bert_tiny,{preset}"
  head = "lm" if preset in LM_PRESETS else None
  text = lowered_train_step(_train_config(name, head, attention_dropout_rate=0.0),
                            "cuda" if platform == "gpu" else "tpu")
  assert "stablehlo" in text or "HloModule" in text


@pytest.mark.parametrize("preset, kernel", [("bert", CUDNN), ("tupe_a", CUDNN),
                                            ("rope", CUDNN), ("diet_rel", TRITON),
                                            ("tupe_r", TRITON), ("alibi", TRITON),
                                            ("kerple_log", TRITON), ("fire", CUDNN),
                                            ("xpos", CUDNN)])
def test_gpu_training_step_takes_the_fused_kernels(on_platform, preset, kernel):
  """bf16 with a padding mask on GPU: bias-free attention (folded terms included) on cuDNN,
  Toeplitz terms in the Triton kernel, forward and backward."""
  on_platform("gpu")
  text = lowered_train_step(_train_config(f"bert_tiny,{preset}", attention_dropout_rate=0.0),
                            "cuda")
  assert text.count(kernel) >= 2  # the scanned layer's body: forward and backward


@pytest.mark.parametrize("scan_layers, layers", [(False, 2), (True, 1)])
def test_every_layer_takes_the_kernel_in_either_layout(on_platform, scan_layers, layers):
  """Unrolled, each of the 2 layers calls the kernel; scanned, the one loop body does."""
  on_platform("gpu")
  text = lowered_train_step(_train_config("bert_tiny,diet_rel", attention_dropout_rate=0.0,
                                          scan_layers=scan_layers), "cuda")
  assert text.count(TRITON) == layers * 3  # forward, dq, dk/dv


def test_forgetting_gates_take_the_pallas_kernel_on_tpu(on_platform):
  """The language model's bf16 step with forgetting gates on a TPU: the row and column vectors
  go to the Pallas kernel (forward, dq with the rows' gradient, dk/dv with the columns')."""
  on_platform("tpu")
  text = lowered_train_step(_train_config("bert_tiny,fox", "lm", attention_dropout_rate=0.0),
                            "tpu")
  assert text.count(MOSAIC) >= 3


@pytest.mark.parametrize("preset", ["fox", "alibi"])
def test_causal_separable_terms_fold_into_channels_for_cudnn(on_platform, preset):
  """The language model's bf16 step with forget gates or causal ALiBi on a GPU: the key
  vector folds into q/k channels and cuDNN runs forward and backward without a bias; no
  Triton kernel is left."""
  on_platform("gpu")
  text = lowered_train_step(_train_config(f"bert_tiny,{preset}", "lm",
                                          attention_dropout_rate=0.0), "cuda")
  assert text.count(CUDNN) >= 2 and TRITON not in text


def test_tpu_training_step_takes_the_pallas_kernels(on_platform):
  on_platform("tpu")
  text = lowered_train_step(_train_config("bert_tiny,diet_rel", attention_dropout_rate=0.0),
                            "tpu")
  assert text.count(MOSAIC) >= 3  # the scanned layer's body: forward, dq, dk/dv


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
@pytest.mark.parametrize("preset", ["bert", "diet_abs", "shaw"])
def test_default_training_step_lowers(on_platform, platform, preset):
  """``train.py``'s defaults (attention dropout 0.1) lower, the dropout inside the Pallas
  kernel on the fused route (Shaw's query-dependent term: the reference route)."""
  on_platform(platform)
  text = lowered_train_step(_train_config(f"bert_tiny,{preset}"),
                            "cuda" if platform == "gpu" else "tpu")
  kernels = text.count(TRITON if platform == "gpu" else MOSAIC)
  assert kernels == 0 if preset == "shaw" else kernels >= 3  # scanned body: fwd, dq, dk/dv


def _padding_mask_attention(mask_kind: str):
  """A function of (q, k, v) attending in bf16 over a padding mask of ``mask_kind``."""
  keep = np.arange(LENGTH)[None] < np.array([[LENGTH], [LENGTH - 9]])
  mask = {"key": keep, "4d": keep[:, None, None, :]}[mask_kind]
  return lambda q, k, v: attend(q, k, v, mask=jnp.asarray(mask), route="fused")


@pytest.mark.parametrize("mask_kind", ["key", "4d"])
def test_cudnn_takes_padding_masks(on_platform, mask_kind):
  """Failure 1 on the H100: a ``[B, 1, 1, L]`` mask handed to cuDNN raised "Bias must have
  same seq length as QKV" at trace time; key masks now go as sequence lengths (or, if not a
  prefix, to the kernel), 4-D masks broadcast to ``[B, 1, Lq, Lk]``."""
  on_platform("gpu")
  shape = jax.ShapeDtypeStruct((BATCH, LENGTH, 4, 64), jnp.bfloat16)
  f = _padding_mask_attention(mask_kind)
  loss = lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32))  # noqa: E731
  text = (jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(shape, shape, shape)
          .lower(lowering_platforms=("cuda",)).as_text())
  assert text.count(CUDNN) >= 2


@pytest.mark.parametrize("keep", [[128, 119], [128, 0]], ids=["prefix", "empty-row"])
def test_key_mask_runs_exactly_with_or_without_a_prefix(keep):
  """The run-time choice between sequence lengths and the kernel gives the reference's values
  for prefix and non-prefix masks (CPU: the fused route runs the kernel in interpret mode)."""
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal((BATCH, LENGTH, 2, 16)), jnp.float32)
             for _ in range(3))
  prefix = np.arange(LENGTH)[None] < np.array(keep)[:, None]
  scattered = prefix & (np.arange(LENGTH)[None] % 3 != 1)
  for mask in (prefix, scattered):
    mask = jnp.asarray(mask)
    fused = attend(q, k, v, mask=mask, route="fused")
    reference = attend(q, k, v, mask=mask, route="reference")
    rows = np.asarray(mask).any(-1)  # a row with no key: the kernel gives zeros
    np.testing.assert_allclose(np.asarray(fused)[rows], np.asarray(reference)[rows], atol=2e-5)


def test_float32_attention_is_exact_unless_tf32_is_asked_for():
  """``precision``: float32 matmuls in attention are HIGHEST unless "tensorfloat32"."""
  q = jnp.ones((1, 8, 2, 16), jnp.float32)
  exact = str(jax.make_jaxpr(lambda q: attend(q, q, q, route="reference"))(q))
  fast = str(jax.make_jaxpr(
      lambda q: attend(q, q, q, route="reference", precision="tensorfloat32"))(q))
  assert exact.count("precision=(Precision.HIGHEST, Precision.HIGHEST)") == 2
  assert "HIGHEST" not in fast
  with pytest.raises(ValueError, match="precision: got 'tf32'"):
    attend(q, q, q, precision="tf32")
  bf16 = str(jax.make_jaxpr(lambda q: attend(q, q, q, route="reference"))(q.astype(jnp.bfloat16)))
  assert "HIGHEST" not in bf16


def test_model_config_names_a_bad_attention_precision():
  from posenc_jax.models import ModelConfigError
  with pytest.raises(ModelConfigError, match="model.attention_precision: got 'tf32'"):
    model_config(attention_precision="tf32")

