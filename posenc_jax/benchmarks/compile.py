"""Seconds to compile each scheme's BERT, with unrolled and with scanned layers.

  python -m posenc_jax.benchmarks.compile [--size tiny,base] [--schemes bert,...]
      [--length 128] [--batch 8] [--dtype float32|bfloat16] [--route auto] [--repeats 1]
      [--json out.json]

It times compilation (trace, lower and compile from abstract inputs; nothing runs): for each
size and scheme the masked-LM BERT's train step and inference pass
(:mod:`posenc_jax.benchmarks.model_steps`) with unrolled layers and with scanned ones
(``model.scan_layers``), and the ratio, e.g. BERT-tiny and BERT-base in one run::

  python -m posenc_jax.benchmarks.compile --size tiny,base --length 128 --batch 8

Every flag is checked (and the ``--json`` path made) before anything compiles; a bad one is one
line ``posenc_jax.benchmarks.compile: --<flag>: got ...; allowed: ...``.
"""

from __future__ import annotations

import json
import time

import jax

from posenc_jax import cli
from posenc_jax.benchmarks import flags
from posenc_jax.benchmarks.model_steps import BASELINE, BERT_SIZES, model_steps
from posenc_jax.models import model_config
from posenc_jax.presets import POSITION_PRESETS, preset_config

PROG = "posenc_jax.benchmarks.compile"


def compile_seconds(size: str, scheme: str, *, batch: int, length: int, dtype: str,
                    route: str = "auto", scan_layers: bool = True) -> dict[str, float]:
  """Seconds to trace, lower and compile the model's train step and its inference pass,
  from abstract inputs (nothing is initialised or run): ``{"train_s", "infer_s"}``."""
  _, train, infer, init = model_steps(size, scheme, batch=batch, length=length, dtype=dtype,
                                      route=route, scan_layers=scan_layers)
  params, opt_state = jax.eval_shape(init)
  jax.clear_caches()  # nothing traced for an earlier model is reused
  out = {}
  for name, fn, inputs in (("train_s", train, (params, opt_state)), ("infer_s", infer, (params,))):
    start = time.perf_counter()
    jax.jit(fn).lower(*inputs).compile()
    out[name] = time.perf_counter() - start
  return out


def compile_table(args) -> list[dict]:
  """Per size and scheme, the compile seconds of unrolled and scanned layers
  (``model.scan_layers``) and their ratio, each the median of ``--repeats`` compiles made
  alternately."""
  print(f"device: {jax.devices()[0].device_kind}; trace + lower + compile of the MLM BERT's "
        f"train step (fwd+bwd+AdamW) and inference pass, B={args.batch} L={args.length} "
        f"{args.dtype}, route {args.route}; median of {args.repeats}, unrolled and scanned "
        "layers compiled alternately")
  print(f"{'size':<6}{'scheme':<16}{'layers':>7}{'train unrolled s':>18}{'scanned s':>11}"
        f"{'x faster':>9}{'infer unrolled s':>18}{'scanned s':>11}{'x faster':>9}")
  dims = dict(batch=args.batch, length=args.length, dtype=args.dtype, route=args.route)
  rows = []
  for size in args.size:
    for scheme in args.schemes:
      rounds = [[compile_seconds(size, scheme, scan_layers=scan, **dims) for scan in (False, True)]
                for _ in range(args.repeats)]
      median = lambda values: sorted(values)[len(values) // 2]  # noqa: E731
      row = {"size": size, "scheme": scheme,
             "layers": model_config(preset_config(BERT_SIZES[size]).model).num_layers}
      for part in ("train_s", "infer_s"):
        unrolled = median([r[0][part] for r in rounds])
        scanned = median([r[1][part] for r in rounds])
        row |= {f"{part}_unrolled": unrolled, f"{part}_scanned": scanned,
                f"{part}_speedup": unrolled / scanned}
      rows.append(row)
      print(f"{size:<6}{scheme:<16}{row['layers']:>7}{row['train_s_unrolled']:>18.2f}"
            f"{row['train_s_scanned']:>11.2f}{row['train_s_speedup']:>9.2f}"
            f"{row['infer_s_unrolled']:>18.2f}{row['infer_s_scanned']:>11.2f}"
            f"{row['infer_s_speedup']:>9.2f}", flush=True)
  return rows


def parse_args(argv=None):
  """The flags of ``argv``, checked (and the ``--json`` path made) before anything compiles;
  a bad one exits with one line ``<prog>: --<flag>: got ...; allowed: ...``."""
  parser = cli.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
  parser.add_argument("--size", type=cli.one_of(BERT_SIZES, sep=","), default=("tiny",),
                      help=f"comma-separated BERT sizes: {', '.join(BERT_SIZES)} (default tiny)")
  flags.add_model_flags(parser)
  parser.add_argument("--repeats", type=cli.positive_int, default=1,
                      help="compiles of each model, the median is reported (default 1)")
  parser.add_argument("--schemes", type=cli.one_of(POSITION_PRESETS, sep=","),
                      default=(BASELINE,),
                      help=f"comma-separated scheme presets: {', '.join(POSITION_PRESETS)} "
                      f"(default {BASELINE})")
  parser.add_argument("--json", default=None, help="also write the rows to this file")
  return flags.parse_checked(parser, argv)


def main(argv=None):
  args = parse_args(argv)
  document = {"device": jax.devices()[0].device_kind, "batch": args.batch,
              "length": args.length, "dtype": args.dtype, "route": args.route,
              "rows": compile_table(args)}
  if args.json:
    with open(args.json, "w") as f:
      json.dump(document, f, indent=2)
  return document["rows"]


if __name__ == "__main__":
  cli.run_command(main)
