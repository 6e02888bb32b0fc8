"""Runs a few training steps of a tiny BERT and saves losses and parameters (for subprocess tests).

  python tests/drivers/train_driver.py --out=/tmp/x.npz --workdir=/tmp/w --mesh=4,2 [--steps=6]
      [--devices=8] [--coordinator=localhost:1234 --num_processes=2 --process_id=0]
      [--step_sleep=0.0] [--nan_at=-1] [--save_delay=0.0] [--hold_in_first_compile=FILE]

Data is synthetic and deterministic in (seed, step): the global batch of a
step is the same whatever the mesh or the number of hosts; each host takes
its rows. Set XLA flags before JAX is imported, hence a separate process.
"""

import argparse
import os
import sys
import time


def parse():
  p = argparse.ArgumentParser()
  p.add_argument("--out", required=True)
  p.add_argument("--workdir", required=True)
  p.add_argument("--mesh", default="-1,1")
  p.add_argument("--steps", type=int, default=6)
  p.add_argument("--devices", type=int, default=1)
  p.add_argument("--coordinator", default=None)
  p.add_argument("--num_processes", type=int, default=1)
  p.add_argument("--process_id", type=int, default=0)
  p.add_argument("--step_sleep", type=float, default=0.0)
  p.add_argument("--nan_at", type=int, default=-1)
  p.add_argument("--checkpoint_every", type=int, default=2)
  p.add_argument("--accum", type=int, default=1)
  p.add_argument("--translation", action="store_true", help="a reversal task, encoder-decoder")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--rank", type=int, default=8, help="DIET-ABS rank (another model: another rank)")
  p.add_argument("--save_delay", type=float, default=0.0,
                 help="seconds each checkpoint stays half-written (a window to kill it in)")
  p.add_argument("--hold_in_first_compile", default=None,
                 help="a file to create when JAX traces the train step (the first step's "
                      "compile), which then waits there to be killed")
  return p.parse_args()


ARGS = parse()
FLAGS = os.environ.get("XLA_FLAGS", "")  # the tests' own (tests/conftest.py)
os.environ["XLA_FLAGS"] = f"{FLAGS} --xla_force_host_platform_device_count={ARGS.devices}".strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402

if ARGS.coordinator:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(ARGS.coordinator, num_processes=ARGS.num_processes,
                             process_id=ARGS.process_id)

import flax.linen as nn  # noqa: E402

from posenc_jax import cli  # noqa: E402
from posenc_jax.presets import preset_config  # noqa: E402
from posenc_jax.training.config import base_train_config  # noqa: E402
from posenc_jax.training.loop import train  # noqa: E402
from posenc_jax.training.errors import USER_ERRORS  # noqa: E402
from posenc_jax.training.signals import TrainingInterrupted  # noqa: E402

VOCAB, LENGTH, BATCH = 64, 16, ARGS.batch


def config():
  c = base_train_config()
  c.update(preset_config("bert_tiny,diet_abs_share"))
  c.model.update(dict(vocab_size=VOCAB, d_model=32, num_heads=4, mlp_dim=64, max_len=LENGTH,
                      dropout_rate=0.0, attention_dropout_rate=0.0))
  c.model.scheme = dict(name="diet_abs", rank=ARGS.rank, sharing="layer")
  c.update(dict(seq_len=LENGTH, batch_size=BATCH, max_predictions_per_seq=LENGTH,
                total_steps=ARGS.steps, log_every=1,
                eval_every=0, checkpoint_every=ARGS.checkpoint_every, grad_accum_steps=ARGS.accum,
                async_checkpointing=True))
  c.mesh.shape = tuple(int(s) for s in ARGS.mesh.split(","))
  c.optimizer.update(dict(learning_rate=3e-3, warmup_steps=2))
  if ARGS.translation:
    c.model = preset_config("transformer_base,t5").model
    c.model.update(dict(vocab_size=VOCAB, d_model=64, num_heads=4, mlp_dim=128, max_len=LENGTH,
                        num_layers=2, num_decoder_layers=2, dropout_rate=0.0))
    c.optimizer.update(dict(learning_rate=1e-3, warmup_steps=20, schedule="constant"))
    c.update(dict(objective="translation", head="translation", input_len=LENGTH,
                  target_len=LENGTH, label_smoothing=0.1, max_predictions_per_seq=None))
  return c


def reversal(rng):
  """Source: random ids and EOS (1); target: the ids reversed and EOS; 0-padded to LENGTH."""
  lengths = rng.integers(3, LENGTH - 1, BATCH)
  inputs = np.zeros((BATCH, LENGTH), np.int32)
  targets = np.zeros((BATCH, LENGTH), np.int32)
  for row, n in enumerate(lengths):
    ids = rng.integers(6, VOCAB, n)
    inputs[row, :n + 1] = np.append(ids, 1)
    targets[row, :n + 1] = np.append(ids[::-1], 1)
  return {"inputs": inputs, "targets": targets}


def synthetic(config, split, start_step, shard_id=0, num_shards=1):
  """Global batch of step s from seed s; this host's rows."""
  step = start_step
  while True:
    rng = np.random.default_rng(1000 + step)
    if ARGS.translation:
      rows = slice(shard_id * BATCH // num_shards, (shard_id + 1) * BATCH // num_shards)
      yield {k: v[rows] for k, v in reversal(rng).items()}
      step += 1
      continue
    ids = rng.integers(6, VOCAB, (BATCH, LENGTH)).astype(np.int32)
    weights = (rng.random((BATCH, LENGTH)) < 0.3).astype(np.float32)
    if step == ARGS.nan_at:
      weights[:] = np.nan  # poisons the loss
    batch = {"input_ids": np.where(weights > 0, 5, ids), "segment_ids": np.zeros_like(ids),
             "mask": np.ones_like(ids), "mlm_targets": ids * (weights > 0),
             "mlm_weights": weights}
    rows = slice(shard_id * BATCH // num_shards, (shard_id + 1) * BATCH // num_shards)
    yield {k: v[rows] for k, v in batch.items()}
    step += 1
    if ARGS.step_sleep:
      time.sleep(ARGS.step_sleep)


def slow_saves(seconds):
  """Each checkpoint's JSON item waits ``seconds`` before it is written, while the step's
  temporary directory exists."""
  import asyncio  # noqa: PLC0415

  import orbax.checkpoint as ocp  # noqa: PLC0415
  write = ocp.JsonCheckpointHandler.async_save

  async def delayed(self, *args, **kwargs):
    await asyncio.sleep(seconds)
    return await write(self, *args, **kwargs)
  ocp.JsonCheckpointHandler.async_save = delayed


def hold_in_first_compile(marker):
  """The loop's train step, when JAX traces it for the first step's compile, creates
  ``marker`` and waits to be killed (for 300 s at most; then the process exits with 4)."""
  from posenc_jax.training import loop  # noqa: PLC0415
  make = loop.make_train_step

  def held(*args, **kwargs):
    make(*args, **kwargs)

    def step(*step_args):
      with open(marker, "w"):
        pass
      time.sleep(300)
      os._exit(4)
    return step
  loop.make_train_step = held


def main():
  cli.quiet_library_tracebacks()
  if ARGS.save_delay:
    slow_saves(ARGS.save_delay)
  if ARGS.hold_in_first_compile:
    hold_in_first_compile(ARGS.hold_in_first_compile)
  try:
    result = train(config(), ARGS.workdir, data=synthetic)
  except TrainingInterrupted as e:
    print(e, flush=True)
    return 3
  except USER_ERRORS as e:  # as train.py reports them
    cli.exit_with("train_driver", e)
  params = jax.tree.map(lambda x: np.asarray(jax.device_get(
      jax.experimental.multihost_utils.process_allgather(x, tiled=True))),
                        nn.unbox(result["state"].params))
  flat = {"/".join(str(getattr(k, "key", k)) for k in path): v
          for path, v in jax.tree_util.tree_leaves_with_path(params)}
  losses = np.array([h["loss"] for h in result["history"]])
  steps = np.array([h["step"] for h in result["history"]])
  if jax.process_index() == 0:
    np.savez(ARGS.out, losses=losses, steps=steps, **flat)


if __name__ == "__main__":
  import jax.experimental.multihost_utils  # noqa: F401
  sys.exit(main())
