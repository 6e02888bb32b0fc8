"""Each scheme's cost in a whole model, train and inference steps as time ratios.

  python -m posenc_jax.benchmarks.steps [--size tiny|small|base] [--length 128] [--batch 8]
      [--schemes bert,diet_abs,diet_rel,...] [--baseline bert] [--route auto]
      [--dtype float32|bfloat16] [--repeats 10] [--json out.json]

For every scheme preset (``posenc_jax.presets.SCHEME_PRESETS``) it builds the
masked-LM BERT of the given size, or the causal language model of that size for a
causal-only scheme (CoPE, the forgetting gates: no encoder form) and its baseline
(:func:`posenc_jax.benchmarks.model_steps.model_of`; the ``model`` column: ``mlm`` or
``lm``), compiles a training step (forward, backward, AdamW update; the masked-LM or the
next-token loss) and an inference forward pass, and times both
after warm-up as the median of ``--repeats`` runs, each timed alternately with the
baseline on the same model (default ``bert``: Devlin et al.'s input table; ``--baseline none``
compares against the same attention with no positional term) so that load
drifts cancel. ``--route`` sets the attention route of every model
(``reference``, ``fused``, ``auto``; see :mod:`posenc_jax.attention`), e.g.
``--route fused --baseline none --schemes diet_rel`` measures the Pallas
Toeplitz kernel against itself without a bias.
It prints milliseconds, the ratio to the baseline, tokens/s, the row's own peak memory (what
XLA plans for its compiled train step, on every backend:
:func:`posenc_jax.memory.planned_bytes`) beside the estimate of the train step
(:func:`posenc_jax.memory.step_memory`, what the trainer checks before
compiling), MFU (analytic FLOPs over the device's peak) on accelerators, and the
seconds of the first train step and inference pass (compile and one run, layers
scanned); ``--json`` writes the same rows. A scheme that is also the baseline is compiled once
per model.

Attention alone: :mod:`posenc_jax.benchmarks.routes`; compile seconds:
:mod:`posenc_jax.benchmarks.compile`. Compilation is excluded. Every flag is checked (and the
``--json`` path made) before anything compiles; a bad one is one line
``posenc_jax.benchmarks.steps: --<flag>: got ...; allowed: ...``.
"""

from __future__ import annotations

import json

import jax
import optax

from posenc_jax import cli, memory
from posenc_jax.benchmarks import flags
from posenc_jax.benchmarks.model_steps import BASELINE, BERT_SIZES, compiled_steps, model_of
from posenc_jax.benchmarks.timing import timed_against
from posenc_jax.models.build import abstract_params, build_model
from posenc_jax.models.config import causal_variant
from posenc_jax.presets import POSITION_PRESETS
from posenc_jax.training.metrics import peak_flops, train_flops_per_step

PROG = "posenc_jax.benchmarks.steps"
DEFAULT_SCHEMES = ("bert", "shaw", "t5", "tupe_a", "tupe_r", "diet_rel", "diet_rel_share",
                   "diet_abs", "diet_abs_share", "alibi", "rope", "kerple_log", "fire", "xpos",
                   "cope", "fox")


def estimated_memory(cfg, batch: int, length: int, head: str = "mlm") -> int:
  """Bytes :func:`posenc_jax.memory.step_memory` estimates for the benchmark's train step
  of the model ``head`` (:func:`~posenc_jax.benchmarks.model_steps.model_steps`: AdamW,
  logits at every token; the language model attends causally with the causal form)."""
  params = abstract_params(build_model(cfg, head))
  opt_state = jax.eval_shape(optax.adamw(1e-4).init, params)
  causal = head == "lm"
  return memory.step_memory(cfg, batch=batch, length=length, params=params,
                            opt_state=opt_state, input_bytes=4 * batch * length * 4,
                            scheme=causal_variant(cfg.scheme) if causal else None,
                            causal=causal).total


def parse_args(argv=None):
  """The flags of ``argv``, checked (and the ``--json`` path made) before anything compiles;
  a bad one exits with one line ``<prog>: --<flag>: got ...; allowed: ...``."""
  parser = cli.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
  parser.add_argument("--size", type=cli.one_of(BERT_SIZES), default="tiny",
                      help=f"BERT size: {', '.join(BERT_SIZES)} (default tiny)")
  flags.add_model_flags(parser)
  parser.add_argument("--repeats", type=cli.positive_int, default=10,
                      help="timed runs of each step, the median is reported (default 10)")
  parser.add_argument("--schemes", type=cli.one_of(POSITION_PRESETS, sep=","),
                      default=DEFAULT_SCHEMES,
                      help=f"comma-separated scheme presets: {', '.join(POSITION_PRESETS)} "
                      f"(default {','.join(DEFAULT_SCHEMES)})")
  parser.add_argument("--baseline", type=cli.one_of(POSITION_PRESETS), default=BASELINE,
                      help=f"scheme preset to divide by (default {BASELINE})")
  parser.add_argument("--json", default=None, help="also write the rows to this file")
  return flags.parse_checked(parser, argv)


def main(argv=None):
  args = parse_args(argv)
  dims = dict(batch=args.batch, length=args.length, dtype=args.dtype, route=args.route)
  tokens = args.batch * args.length
  peak = peak_flops(dtype=args.dtype)
  print(f"device: {jax.devices()[0].device_kind}; BERT-{args.size} dims, B={args.batch} "
        f"L={args.length} {args.dtype}, route {args.route}; median of {args.repeats}, each "
        f"timed alternately with the '{args.baseline}' baseline on the same model (mlm: "
        f"masked-LM BERT, lm: causal LM); train = fwd+bwd+AdamW, infer = fwd")
  compiled = {}

  def steps(scheme, head):  # the baseline's row times it against itself, compiled once
    if (scheme, head) not in compiled:
      compiled[scheme, head] = compiled_steps(args.size, scheme, head=head, **dims)
    return compiled[scheme, head]

  ratio = f"x {args.baseline}"[:8]
  print(f"{'scheme':<16}{'train ms':>10}{ratio:>8}{'infer ms':>10}{ratio:>8}"
        f"{'tokens/s':>11}{'peak MB':>9}{'est MB':>8}{'MFU':>7}{'compile s':>11}{'model':>6}")
  rows = []
  for scheme in args.schemes:
    head = model_of(scheme, args.baseline)
    base_train, base_infer, _, _ = steps(args.baseline, head)
    train, infer, cfg, first = steps(scheme, head)
    train_s, train_base = timed_against(train, base_train, args.repeats)
    infer_s, infer_base = timed_against(infer, base_infer, args.repeats)
    flops = train_flops_per_step(cfg, args.batch, args.length, head=head)  # logits everywhere
    peak_bytes = first["train_bytes"]
    estimate = estimated_memory(cfg, args.batch, args.length, head)
    row = {"scheme": scheme, "model": head, "train_ms": 1e3 * train_s,
           "train_ratio": train_s / train_base,
           "infer_ms": 1e3 * infer_s, "infer_ratio": infer_s / infer_base,
           "tokens_per_s": tokens / train_s, "peak_bytes": peak_bytes,
           "estimated_bytes": estimate,
           "mfu": flops / train_s / peak if peak else None,
           "first_train_s": first["train_s"], "first_infer_s": first["infer_s"]}
    rows.append(row)
    mem = (f"{peak_bytes / 2**20:>9.0f}" if peak_bytes else f"{'n/a':>9}") + \
        f"{estimate / 2**20:>8.0f}"
    mfu = f"{row['mfu']:>7.1%}" if row["mfu"] is not None else f"{'n/a':>7}"
    print(f"{scheme:<16}{row['train_ms']:>10.2f}{row['train_ratio']:>8.2f}"
          f"{row['infer_ms']:>10.2f}{row['infer_ratio']:>8.2f}{row['tokens_per_s']:>11.0f}"
          f"{mem}{mfu}{row['first_train_s'] + row['first_infer_s']:>11.1f}{head:>6}",
          flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"device": jax.devices()[0].device_kind, "size": args.size,
                 "baseline": args.baseline, **dims, "rows": rows}, f, indent=2)
  return rows


if __name__ == "__main__":
  cli.run_command(main)
