"""One process of a multi-process pre-training run on text files, through the real input
pipeline (source sharding, iterator state in the checkpoints); writes the losses it logged
and prints whether each process restored its input state.

  python tests/drivers/data_scale_driver.py --workdir=/tmp/w --out=/tmp/losses.json \
      --files=a.txt.gz,b.txt.gz --steps=6 --coordinator=localhost:1234 --num_processes=2 \
      --process_id=0
"""

import argparse
import json

import jax


def parse():
  p = argparse.ArgumentParser()
  p.add_argument("--workdir", required=True)
  p.add_argument("--out", required=True)
  p.add_argument("--files", required=True)
  p.add_argument("--steps", type=int, default=6)
  p.add_argument("--coordinator", required=True)
  p.add_argument("--num_processes", type=int, default=2)
  p.add_argument("--process_id", type=int, default=0)
  return p.parse_args()


def main():
  args = parse()
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(args.coordinator, num_processes=args.num_processes,
                             process_id=args.process_id)
  import functools  # noqa: PLC0415

  from posenc_jax.configs.pretrain import get_config  # noqa: PLC0415
  from posenc_jax.data import preprocessors, tasks, vocab  # noqa: PLC0415
  from posenc_jax.training import checkpoint  # noqa: PLC0415
  from posenc_jax.training.loop import train  # noqa: PLC0415

  restore_input = checkpoint.Checkpointer.restore_input

  def reported(self, step, iterator):
    restored = restore_input(self, step, iterator)
    print(f"process {jax.process_index()}: input state of step {step} restored: {restored}",
          flush=True)
    return restored
  checkpoint.Checkpointer.restore_input = reported

  tasks.register_text_lines("driver_corpus", {"train": args.files.split(",")},
                            vocab.vocabulary(vocab.BUNDLED_VOCAB))
  preprocessors.mlm_dataset = functools.partial(preprocessors.mlm_dataset, shuffle_block=8)
  c = get_config("bert_tiny,diet_abs_share")
  c.model.update(dict(d_model=32, num_heads=2, mlp_dim=64, num_layers=1, max_len=16,
                      dropout_rate=0.0, attention_dropout_rate=0.0))
  c.update(dict(task="driver_corpus", seq_len=16, batch_size=4, total_steps=args.steps,
                log_every=1, eval_every=0, checkpoint_every=3, compilation_cache_dir="",
                async_checkpointing=False))
  c.optimizer.update(dict(learning_rate=1e-3, warmup_steps=0, schedule="constant"))
  result = train(c, args.workdir)
  if jax.process_index() == 0:
    with open(args.out, "w") as f:
      json.dump({str(h["step"]): h["loss"] for h in result["history"]}, f)


if __name__ == "__main__":
  main()
