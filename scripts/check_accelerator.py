"""Every preset on the device at hand: each route's loss and gradients against a float32 reference.

    python scripts/check_accelerator.py [--presets bert,shaw,...] [--dtypes float32,bfloat16]
        [--routes auto,fused,reference] [--length 256] [--json out.json]

For each preset (a small BERT, or a small encoder-decoder for ``transformer_base*``) and
dtype, one masked-LM (or translation) loss and its parameter gradients are computed through
every route on a batch with right padding and, in a second example, padding inside the row
(the mask is not a prefix), and compared with the reference route in float32 at full
float32 matmul precision: the relative L2 error of the loss and of all parameter gradients
together (one vector: some leaves, such as the key projection's bias, have a gradient of
zero in exact arithmetic, so a per-leaf ratio would measure rounding noise). It prints a table and exits non-zero when a run crashes or an error
exceeds its bound (loss: bfloat16 1e-2, float32 1e-5 or 1e-3 with ``--tf32``; gradients ten
times that). ``transformer_base+t5`` names a size and a scheme in ``--presets``. Meant for GPUs
and TPUs (CPU works, slowly: Pallas runs in interpret mode there).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.models import model_config
from posenc_jax.models.build import build_model
from posenc_jax.presets import preset_config
from posenc_jax.training.objectives import objective

PRESETS = ("bert", "shaw", "t5", "tupe_a", "tupe_r", "bert_ad", "diet_rel", "diet_rel_share",
           "diet_abs", "diet_abs_share", "segment_per_head", "alibi", "rope", "linformer",
           "diet_abs_lin", "transformer_base", "transformer_base,t5")
SMALL = dict(vocab_size=1024, d_model=256, num_layers=2, num_heads=4, mlp_dim=512,
             dropout_rate=0.0, attention_dropout_rate=0.0)


def _setup(preset: str, length: int, batch: int):
  """(config dict, head, batch arrays) of a small model of ``preset``."""
  size = "transformer_base" if preset.startswith("transformer") else "bert_small"
  rest = preset.split(",", 1)[1:] if size == "transformer_base" else [preset]
  cfg = preset_config(",".join([size] + rest))
  model = cfg.model.to_dict()
  model.update(SMALL, max_len=length)
  if cfg.head == "translation":
    model.update(num_decoder_layers=2)
  if model.get("attention") == "linformer":
    model["linformer_k"] = 64
    if model["scheme"]["name"] == "diet_abs_lin":
      model["scheme"] = dict(model["scheme"], k=64)
  rng = np.random.default_rng(0)
  ids = rng.integers(5, SMALL["vocab_size"], (batch, length)).astype(np.int32)
  lengths = np.array([length] + [length - 7 * (b + 1) for b in range(batch - 1)])
  mask = np.arange(length)[None] < lengths[:, None]
  mask[-1, length // 3: length // 3 + 5] = False  # not a prefix
  if cfg.head == "translation":
    data = {"inputs": np.where(mask, ids, 0), "targets": np.where(mask, ids[:, ::-1], 0)}
  else:
    segments = (np.arange(length)[None] >= lengths[:, None] // 2).astype(np.int32)
    data = {"input_ids": ids, "segment_ids": segments, "mask": mask.astype(np.int32),
            "mlm_targets": ids, "mlm_weights": (rng.random((batch, length)) < 0.15) * mask}
  return model, cfg.head, {k: jnp.asarray(v) for k, v in data.items()}


def loss_and_grads(model_dict, head, data, dtype, route, precision):
  model = build_model(model_config(model_dict, dtype=dtype, route=route,
                                   attention_precision=precision), head)
  objective_name = "translation" if head == "translation" else "mlm"
  loss_fn = objective(objective_name)
  inputs = ((data["inputs"], data["targets"], data["inputs"] > 0) if head == "translation"
            else (data["input_ids"], data["segment_ids"], data["mask"]))
  params = model.init(jax.random.key(1), *inputs)["params"]

  @jax.jit
  def run(p):
    (loss, sums), grads = jax.value_and_grad(
        lambda p: loss_fn(model, p, data, None), has_aux=True)(p)
    return loss / sums["weight"], grads

  return run(params)


def rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--presets", default=",".join(p.replace(",", "+") for p in PRESETS))
  parser.add_argument("--dtypes", default="float32,bfloat16")
  parser.add_argument("--routes", default="auto,fused,reference")
  parser.add_argument("--length", type=int, default=256)
  parser.add_argument("--batch", type=int, default=3)
  parser.add_argument("--tf32", action="store_true", help="float32 attention in TF32")
  parser.add_argument("--json")
  args = parser.parse_args(argv)
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
  rows, failed = [], False
  for preset in args.presets.split(","):
    preset = preset.replace("+", ",")  # transformer_base+t5: a size and a scheme
    model, head, data = _setup(preset, args.length, args.batch)
    with jax.default_matmul_precision("float32"):
      ref_loss, ref_grads = loss_and_grads(model, head, data, "float32", "reference", "float32")
    for dtype in args.dtypes.split(","):
      for route in args.routes.split(","):
        row = {"preset": preset, "dtype": dtype, "route": route}
        start = time.perf_counter()
        try:
          loss, grads = loss_and_grads(model, head, data, dtype, route,
                                       "tensorfloat32" if args.tf32 else "float32")
          row["loss"] = rel(loss, ref_loss)
          row["grads"] = rel(*(np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])
                               for g in (grads, ref_grads)))
          bound = 1e-2 if dtype == "bfloat16" else (1e-3 if args.tf32 else 1e-5)
          row["ok"] = bool(row["loss"] <= bound and row["grads"] <= 10 * bound
                           and np.isfinite(row["grads"]))
        except Exception as e:  # noqa: BLE001 - every failure is a row of the table
          row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
          row["ok"] = False
        row["s"] = round(time.perf_counter() - start, 1)
        failed |= not row["ok"]
        rows.append(row)
        print(json.dumps(row), flush=True)
  print(f"\n{'preset':<22}{'dtype':<10}{'route':<11}{'loss':>9}{'grads':>9}  ok")
  for r in rows:
    if "error" in r:
      print(f"{r['preset']:<22}{r['dtype']:<10}{r['route']:<11} ERROR {r['error'][:80]}")
    else:
      print(f"{r['preset']:<22}{r['dtype']:<10}{r['route']:<11}{r['loss']:9.1e}{r['grads']:9.1e}"
            f"  {'ok' if r['ok'] else 'FAIL'}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
