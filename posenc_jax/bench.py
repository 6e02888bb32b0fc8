"""Each scheme's cost in a whole BERT, as ratios against the input-APE baseline of the same run.

  python -m posenc_jax.bench [--size tiny|small|base] [--length 128] [--batch 8]
      [--schemes bert,diet_abs,diet_rel,...] [--baseline bert] [--route auto]
      [--dtype float32|bfloat16] [--repeats 10] [--json out.json]

For every scheme preset (``posenc_jax.presets.SCHEMES``) it builds the
masked-LM BERT of the given size, compiles a training step (forward,
backward, AdamW update) and an inference forward pass, and times both after
warm-up as the median of ``--repeats`` runs, each timed alternately with the
baseline (default ``bert``: Devlin et al.'s input table; ``--baseline none``
compares against the same attention with no positional term) so that load
drifts cancel. ``--route`` sets the attention route of every model
(``reference``, ``fused``, ``auto``; see :mod:`posenc_jax.attention`), e.g.
``--route fused --baseline none --schemes diet_rel`` measures the Pallas
Toeplitz kernel against itself without a bias.
It prints milliseconds, the ratio to the baseline, tokens/s, peak device
memory where the device reports it, and MFU (analytic FLOPs over the
device's peak) on accelerators; ``--json`` writes the same rows.
Compilation is excluded. Every flag is checked (and the ``--json`` path made) before
anything compiles; a bad one is one line ``bench: --<flag>: got ...; allowed: ...``.
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import optax

from posenc_jax import cli
from posenc_jax.attention import ROUTES
from posenc_jax.models import BertForMaskedLM, model_config
from posenc_jax.models.config import DTYPES
from posenc_jax.presets import SCHEMES, preset_config
from posenc_jax.training.metrics import peak_flops, train_flops_per_step
from posenc_jax.training.objectives import weighted_cross_entropy

SIZES = {"tiny": "bert_tiny", "small": "bert_small", "base": "bert_base"}
DEFAULT_SCHEMES = ("bert", "shaw", "t5", "tupe_a", "tupe_r", "diet_rel", "diet_rel_share",
                   "diet_abs", "diet_abs_share", "alibi", "rope")
BASELINE = "bert"
# Presets that set a position scheme (not the modifiers: segment_per_head, pre_ln, bf16, ...).
POSITION_SCHEMES = tuple(name for name, preset in SCHEMES.items() if "scheme" in preset)


def compiled_steps(size: str, scheme: str, *, batch: int, length: int, dtype: str,
                   route: str = "auto"):
  """Zero-argument (train step, inference) callables of the compiled model, and its config."""
  cfg = preset_config(f"{SIZES[size]},{scheme}").model
  cfg = model_config(cfg, max_len=max(length, cfg.get("max_len", 512)), dtype=dtype,
                     dropout_rate=0.0, attention_dropout_rate=0.0, route=route)
  model = BertForMaskedLM(cfg)
  key_ids, key_mask = jax.random.split(jax.random.key(0))
  ids = jax.random.randint(key_ids, (batch, length), 6, cfg.vocab_size)
  segments = jnp.zeros_like(ids)
  mask = jnp.ones_like(ids)
  weights = (jax.random.uniform(key_mask, (batch, length)) < 0.15).astype(jnp.float32)
  params = jax.jit(model.init)(jax.random.key(1), ids, segments, mask)["params"]
  tx = optax.adamw(1e-4)
  opt_state = jax.jit(tx.init)(params)

  def loss(p):
    logits = model.apply({"params": p}, ids, segments, mask)
    total, weight, _ = weighted_cross_entropy(logits, ids, weights)
    return total / weight

  @jax.jit
  def train(p, s):
    grads = jax.grad(loss)(p)
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s

  infer = jax.jit(lambda p: model.apply({"params": p}, ids, segments, mask))
  state = [params, opt_state]

  def train_step():
    state[0], state[1] = train(state[0], state[1])
    jax.block_until_ready(state[0])

  def infer_step():
    jax.block_until_ready(infer(state[0]))

  train_step()  # compile and warm up
  infer_step()
  return train_step, infer_step, cfg, sum(x.size for x in jax.tree.leaves(params))


def _seconds(step) -> float:
  start = time.perf_counter()
  step()
  return time.perf_counter() - start


def timed_against(step, baseline, repeats: int) -> tuple[float, float]:
  """Median seconds of ``step`` and of ``baseline``, timed alternately (so load drifts cancel)."""
  pairs = [(_seconds(step), _seconds(baseline)) for _ in range(repeats)]
  median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
  return median([a for a, _ in pairs]), median([b for _, b in pairs])


def peak_memory() -> int | None:
  """Peak bytes in use on the first device, where the backend reports it (GPU, TPU)."""
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


def main(argv=None):
  parser = cli.ArgumentParser(prog="bench", description=__doc__.splitlines()[0])
  parser.add_argument("--size", type=cli.one_of(SIZES), default="tiny",
                      help=f"BERT size: {', '.join(SIZES)}")
  parser.add_argument("--length", type=cli.positive_int, default=128, help="tokens per example")
  parser.add_argument("--batch", type=cli.positive_int, default=8, help="examples per step")
  parser.add_argument("--dtype", type=cli.one_of(DTYPES), default="float32",
                      help=f"compute dtype: {', '.join(DTYPES)}")
  parser.add_argument("--repeats", type=cli.positive_int, default=10,
                      help="timed runs of each step (the median is reported)")
  parser.add_argument("--schemes", type=cli.one_of(POSITION_SCHEMES, sep=","),
                      default=",".join(DEFAULT_SCHEMES),
                      help=f"comma-separated scheme presets: {', '.join(POSITION_SCHEMES)}")
  parser.add_argument("--baseline", type=cli.one_of(POSITION_SCHEMES), default=BASELINE,
                      help="scheme preset to divide by")
  parser.add_argument("--route", type=cli.one_of(ROUTES), default="auto",
                      help=f"attention route: {', '.join(ROUTES)}")
  parser.add_argument("--json", default=None, help="also write the rows to this file")
  args = parser.parse_args(argv)
  if args.json is not None:
    try:  # before anything compiles, so no timing is lost to a bad path
      cli.check_output_file("--json", args.json)
    except cli.OutputPathError as e:
      parser.error(str(e))
  dims = dict(batch=args.batch, length=args.length, dtype=args.dtype, route=args.route)
  tokens = args.batch * args.length
  peak = peak_flops()
  print(f"device: {jax.devices()[0].device_kind}; BERT-{args.size}, B={args.batch} "
        f"L={args.length} {args.dtype}, route {args.route}; median of {args.repeats}, each "
        f"timed alternately with the '{args.baseline}' baseline; train = fwd+bwd+AdamW, "
        f"infer = fwd")
  base_train, base_infer, _, _ = compiled_steps(args.size, args.baseline, **dims)
  ratio = f"x {args.baseline}"[:8]
  print(f"{'scheme':<16}{'train ms':>10}{ratio:>8}{'infer ms':>10}{ratio:>8}"
        f"{'tokens/s':>11}{'peak MB':>9}{'MFU':>7}")
  rows = []
  for scheme in args.schemes:
    train, infer, cfg, num_params = compiled_steps(args.size, scheme, **dims)
    train_s, train_base = timed_against(train, base_train, args.repeats)
    infer_s, infer_base = timed_against(infer, base_infer, args.repeats)
    flops = train_flops_per_step(num_params, tokens, cfg.num_layers, args.length, cfg.d_model)
    memory = peak_memory()
    row = {"scheme": scheme, "train_ms": 1e3 * train_s, "train_ratio": train_s / train_base,
           "infer_ms": 1e3 * infer_s, "infer_ratio": infer_s / infer_base,
           "tokens_per_s": tokens / train_s, "peak_bytes": memory,
           "mfu": flops / train_s / peak if peak else None}
    rows.append(row)
    mem = f"{memory / 2**20:>9.0f}" if memory else f"{'n/a':>9}"
    mfu = f"{row['mfu']:>7.1%}" if row["mfu"] is not None else f"{'n/a':>7}"
    print(f"{scheme:<16}{row['train_ms']:>10.2f}{row['train_ratio']:>8.2f}"
          f"{row['infer_ms']:>10.2f}{row['infer_ratio']:>8.2f}{row['tokens_per_s']:>11.0f}"
          f"{mem}{mfu}", flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"device": jax.devices()[0].device_kind, "size": args.size,
                 "baseline": args.baseline, **dims, "rows": rows}, f, indent=2)
  return rows


if __name__ == "__main__":
  main()
