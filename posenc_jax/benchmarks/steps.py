"""Each scheme's cost in a whole model, train and inference steps as time ratios.

  python -m posenc_jax.benchmarks.steps [--size tiny|small|base] [--length 128] [--batch 8]
      [--schemes bert,diet_abs,diet_rel,...] [--baseline bert] [--route auto]
      [--dtype float32|bfloat16] [--step trainer|every_token] [--model auto|lm|mlm]
      [--repeats 10] [--json out.json]

For every scheme preset (``posenc_jax.presets.SCHEME_PRESETS``) it builds the
masked-LM BERT of the given size, or the causal language model of that size for a
causal-only scheme (CoPE, the forgetting gates: no encoder form) and its baseline
(:func:`posenc_jax.benchmarks.model_steps.model_of`; the ``model`` column: ``mlm`` or
``lm``; ``--model lm`` builds the causal LM for every row, where ALiBi is causal), compiles a training step and an inference step, and times both
after warm-up as the median of ``--repeats`` runs, each timed alternately with the
baseline on the same model (default ``bert``: Devlin et al.'s input table; ``--baseline none``
compares against the same attention with no positional term) so that load
drifts cancel. ``--step`` picks the steps:

- ``trainer`` (the default): the step ``train.py`` runs for ``configs/pretrain.py`` (the
  masked LM) or ``configs/lm.py`` (the causal LM) at that size, with ``--batch`` rows of
  ``--length`` tokens (:func:`posenc_jax.benchmarks.model_steps.trainer_steps`): the
  trainer's own jitted step (``training.loop.jit_train_step``: the config's AdamW with
  clipping, weight-decay mask and schedule, the masked LM's logits at the config's
  ``max_predictions`` positions per row, e.g. 77 at L=512, the state donated, layers scanned
  as the config says), on one device; inference is the trainer's eval step (the same loss,
  no gradients).
- ``every_token``: the benchmark's own AdamW step with logits at every token (the masked
  LM's loss at 15% of them; :func:`~posenc_jax.benchmarks.model_steps.model_steps`), and the
  forward pass (logits ``[B, L, vocab]``) as inference.

``--route`` sets the attention route of every model
(``reference``, ``fused``, ``auto``; see :mod:`posenc_jax.attention`), e.g.
``--route fused --baseline none --schemes diet_rel`` measures the Pallas
Toeplitz kernel against itself without a bias.
It prints milliseconds, the ratio to the baseline, tokens/s, the row's own peak memory (what
XLA plans for its compiled train step, on every backend:
:func:`posenc_jax.memory.planned_bytes`) beside the estimate of that same train step
(:func:`posenc_jax.memory.step_memory`, what the trainer checks before
compiling: for ``trainer`` the trainer's own, ``training.memory.TrainMemory``, without the
input pipeline's host buffers), MFU (analytic FLOPs of the step timed over the device's peak)
on accelerators, and the seconds of the first train step and inference pass (compile and one
run); ``--json`` writes the same rows. A scheme that is also the baseline is compiled once
per model.

Attention alone: :mod:`posenc_jax.benchmarks.routes`; compile seconds:
:mod:`posenc_jax.benchmarks.compile`. Compilation is excluded. Every flag is checked (and the
``--json`` path made) before anything compiles; a bad one is one line
``posenc_jax.benchmarks.steps: --<flag>: got ...; allowed: ...``.
"""

from __future__ import annotations

import json

import jax
import ml_collections
import optax

from posenc_jax import cli, memory
from posenc_jax.benchmarks import flags
from posenc_jax.benchmarks.model_steps import (BASELINE, BERT_SIZES, STEPS, compiled_steps,
                                               model_of, train_config)
from posenc_jax.benchmarks.timing import timed_against
from posenc_jax.models.build import abstract_params, build_model
from posenc_jax.models.config import causal_variant
from posenc_jax.presets import POSITION_PRESETS
from posenc_jax.training.config import max_predictions
from posenc_jax.training.memory import TrainMemory
from posenc_jax.training.metrics import peak_flops, train_flops_per_step

PROG = "posenc_jax.benchmarks.steps"
DEFAULT_SCHEMES = ("bert", "shaw", "t5", "tupe_a", "tupe_r", "diet_rel", "diet_rel_share",
                   "diet_abs", "diet_abs_share", "alibi", "rope", "kerple_log", "fire", "xpos",
                   "cope", "fox")
MODELS = ("auto", "lm", "mlm")  # --model: the model every row builds (auto: model_of)


def estimated_memory(cfg, batch: int, length: int, head: str = "mlm",
                     config: ml_collections.ConfigDict | None = None) -> int:
  """Bytes :func:`posenc_jax.memory.step_memory` estimates for the benchmark's train step
  of the model ``head``: with the trainer's train ``config`` (``--step trainer``,
  :func:`~posenc_jax.benchmarks.model_steps.train_config`), the trainer's own estimate of it
  (:class:`~posenc_jax.training.memory.TrainMemory`, the MLM logits at its positions) without
  the input pipeline's host buffers; else the ``every_token`` step
  (:func:`~posenc_jax.benchmarks.model_steps.model_steps`: AdamW, logits at every token; the
  language model attends causally with the causal form)."""
  if config is not None:
    return TrainMemory(config, cfg, 1).step(batch, length, host_buffers=False).total
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
  parser.add_argument("--step", type=cli.one_of(STEPS), default=STEPS[0],
                      help="train step timed: 'trainer', train.py's own for configs/pretrain.py "
                      "(configs/lm.py for the causal LM; MLM logits at the config's masked "
                      "positions, state donated, layers scanned as configured; inference its "
                      "eval step), or 'every_token', AdamW with logits at every token "
                      f"(inference the forward pass) (default {STEPS[0]})")
  parser.add_argument("--repeats", type=cli.positive_int, default=10,
                      help="timed runs of each step, the median is reported (default 10)")
  parser.add_argument("--schemes", type=cli.one_of(POSITION_PRESETS, sep=","),
                      default=DEFAULT_SCHEMES,
                      help=f"comma-separated scheme presets: {', '.join(POSITION_PRESETS)} "
                      f"(default {','.join(DEFAULT_SCHEMES)})")
  parser.add_argument("--baseline", type=cli.one_of(POSITION_PRESETS), default=BASELINE,
                      help=f"scheme preset to divide by (default {BASELINE})")
  parser.add_argument("--model", type=cli.one_of(MODELS), default=MODELS[0],
                      help="auto: the masked-LM BERT, the causal LM for a causal-only scheme "
                      "and its baseline; lm: the causal LM for every row (causal ALiBi, T5's "
                      "unidirectional buckets); mlm: BERT for every row (default auto)")
  parser.add_argument("--json", default=None, help="also write the rows to this file")
  return flags.parse_checked(parser, argv)


def main(argv=None):
  args = parse_args(argv)
  dims = dict(batch=args.batch, length=args.length, dtype=args.dtype, route=args.route)
  tokens = args.batch * args.length
  peak = peak_flops(dtype=args.dtype)
  trainer = args.step == "trainer"
  what = ("train = train.py's step (configs/pretrain.py, lm: configs/lm.py; MLM logits at the "
          "masked positions, state donated), infer = its eval step" if trainer else
          "train = fwd+bwd+AdamW, logits at every token, infer = fwd")
  print(f"device: {jax.devices()[0].device_kind}; BERT-{args.size} dims, B={args.batch} "
        f"L={args.length} {args.dtype}, route {args.route}; median of {args.repeats}, each "
        f"timed alternately with the '{args.baseline}' baseline on the same model (mlm: "
        f"masked-LM BERT, lm: causal LM); step {args.step}: {what}")
  compiled = {}

  def steps(scheme, head):  # the baseline's row times it against itself, compiled once
    if (scheme, head) not in compiled:
      compiled[scheme, head] = compiled_steps(args.size, scheme, head=head, step=args.step,
                                              **dims)
    return compiled[scheme, head]

  ratio = f"x {args.baseline}"[:8]
  print(f"{'scheme':<16}{'train ms':>10}{ratio:>8}{'infer ms':>10}{ratio:>8}"
        f"{'tokens/s':>11}{'peak MB':>9}{'est MB':>8}{'MFU':>7}{'compile s':>11}{'model':>6}")
  rows = []
  for scheme in args.schemes:
    head = model_of(scheme, args.baseline) if args.model == "auto" else args.model
    base_train, base_infer, _, _ = steps(args.baseline, head)
    train, infer, cfg, first = steps(scheme, head)
    train_s, train_base = timed_against(train, base_train, args.repeats)
    infer_s, infer_base = timed_against(infer, base_infer, args.repeats)
    config = train_config(args.size, scheme, head=head, **dims) if trainer else None
    flops = train_flops_per_step(  # the step timed: the trainer's MLM logits at P positions
        cfg, args.batch, args.length, head=head,
        predictions_per_seq=max_predictions(config) if trainer else None)
    peak_bytes = first["train_bytes"]
    estimate = estimated_memory(cfg, args.batch, args.length, head, config)
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
                 "baseline": args.baseline, "step": args.step, **dims, "rows": rows}, f,
                indent=2)
  return rows


if __name__ == "__main__":
  cli.run_command(main)
