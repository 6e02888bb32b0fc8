"""Attention step time of every scheme, as ratios against no positional term.

  python -m posenc_jax.bench [--batch 8 --length 128 --heads 8 --head_dim 64]

For each scheme it times a jitted forward + backward of one attention layer
(scheme terms computed inside the step, as in training) by the reference
and the fused route, and prints milliseconds and the ratio to the ``none``
baseline, timed alternately with it in the same run so that load drifts
cancel. Compilation is excluded.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from posenc_jax.attention import attend
from posenc_jax.schemes import build_scheme

BENCH_SCHEMES = {
    "none": {"name": "none"},
    "learned_ape": {"name": "learned_ape"},
    "shaw": {"name": "shaw"},
    "t5": {"name": "t5"},
    "diet_rel": {"name": "diet_rel"},
    "diet_abs": {"name": "diet_abs"},
    "diet_abs_share": {"name": "diet_abs", "sharing": "layer"},
    "tupe_a": {"name": "tupe_a"},
    "tupe_r": {"name": "tupe_r"},
    "segment_per_head": {"name": "segment_per_head"},
    "alibi": {"name": "alibi"},
    "rope": {"name": "rope"},
}


def compiled_step(config, route, *, batch, length, heads, head_dim):
  """A compiled forward+backward step taking no arguments, or None if the route cannot run it."""
  scheme = build_scheme(config, num_layers=1, num_heads=heads, head_dim=head_dim,
                        d_model=heads * head_dim, max_len=length)
  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(key, (batch, length, heads, head_dim)) for key in keys)
  segments = (jnp.arange(length)[None] >= length // 2).astype(jnp.int32).repeat(batch, 0)
  params = scheme.init(jax.random.key(1), length, segments)
  mask = jnp.ones((batch, length), bool)

  def loss(params, q, k, v):
    st = scheme.apply(params, length, segments)
    out = attend(q, k, v, st.for_layer(0), mask=mask, scale=st.content_scale, route=route)
    return jnp.mean(out ** 2)

  step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
  try:
    jax.block_until_ready(step(params, q, k, v))
  except ValueError:
    return None
  return lambda: jax.block_until_ready(step(params, q, k, v))


def _seconds(step):
  start = time.perf_counter()
  step()
  return time.perf_counter() - start


def timed_against(step, baseline, repeats):
  """Median seconds of ``step`` and of ``baseline``, timed alternately (so load drifts cancel)."""
  pairs = [(_seconds(step), _seconds(baseline)) for _ in range(repeats)]
  median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
  return median([a for a, _ in pairs]), median([b for _, b in pairs])


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--length", type=int, default=128)
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--head_dim", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--schemes", default=",".join(BENCH_SCHEMES))
  args = parser.parse_args(argv)
  dims = dict(batch=args.batch, length=args.length, heads=args.heads, head_dim=args.head_dim)
  print(f"device: {jax.devices()[0].device_kind}; B={args.batch} L={args.length} "
        f"H={args.heads} D={args.head_dim}; one attention layer, forward+backward; "
        f"median of {args.repeats}, each timed alternately with the baseline")
  baseline = {route: compiled_step(BENCH_SCHEMES["none"], route, **dims)
              for route in ("reference", "fused")}
  print(f"{'scheme':<18}{'reference ms':>14}{'x none':>8}{'fused ms':>10}{'x none':>8}")
  for name in args.schemes.split(","):
    row = f"{name:<18}"
    for route, width in (("reference", 14), ("fused", 10)):
      step = compiled_step(BENCH_SCHEMES[name], route, **dims)
      if step is None:
        row += f"{'n/a':>{width}}{'':>8}"
        continue
      seconds, base = timed_against(step, baseline[route], args.repeats)
      row += f"{seconds * 1e3:>{width}.2f}{seconds / base:>8.2f}"
    print(row, flush=True)


if __name__ == "__main__":
  main()
