"""Fine-tuning on the bundled WordNet tasks (real text, offline, CPU-sized).

  python train.py --config=configs/pretrain.py --workdir=/tmp/posenc_demo
  python finetune.py --config=configs/finetune_wordnet.py:wordnet_supersense \
      --init_checkpoint=/tmp/posenc_demo --workdir=/tmp/posenc_supersense

The argument is ``<task>[,<size>,<scheme>...][,no_per_head_segments]``:
``wordnet_supersense`` (gloss -> one of 45 supersenses),
``wordnet_hypernym`` (gloss pair -> is the second a hypernym of the first) or
``wordnet_order`` (gloss -> is it as written, or cut in two with its halves swapped).
With no presets the model is the pre-trained one (``--init_checkpoint``'s
``config.json``; without a checkpoint, the bundled pre-training demo's); named
presets must match it (``--config.reinitialise=True`` starts what differs from
scratch). Pair tasks switch on per-head segment terms (DIET).
"""

from posenc_jax.configs.finetune_glue import finetune_config, parse_argument

# chance: the validation accuracy (0-100) of always answering the majority class;
# learning_rate: the peak rate measured to learn it from bert_tiny (the sweep tries half and
# twice it too). At 1e-3, wordnet_order's classifier collapses to one class for every scheme.
# dropout_rate: 0.1 where the default 600 steps of 32 go over the train split more than once
# (supersense 9,572 examples: 2 epochs; hypernym 1,580: 12); none on wordnet_order (17,514
# examples: 1.1 epochs, and 0.37 in compare's 200 steps), where no example is seen twice
# to overfit and dropout only slows learning: the pre-trained learned-APE model reached
# 68.6% dev accuracy in 200 steps without it, 56.3% with 0.1 (whose random bits also cost
# 35% of the CPU step), while no position stays at 50.0% either way.
TASKS = {"wordnet_supersense": dict(num_labels=45, pair=False, chance=11.1301,
                                    learning_rate=1e-3, dropout_rate=0.1),
         "wordnet_hypernym": dict(num_labels=2, pair=True, chance=50.0, learning_rate=1e-3,
                                  dropout_rate=0.1),
         "wordnet_order": dict(num_labels=2, pair=False, chance=50.0, learning_rate=3e-4,
                               dropout_rate=0.0)}


def get_config(arg="wordnet_supersense"):
  task, presets, per_head_segments = parse_argument(arg, TASKS)
  config = finetune_config(task, presets, ["bert_demo", "diet_abs_share"],
                           num_labels=TASKS[task]["num_labels"], regression=False,
                           pair=TASKS[task]["pair"], best_metric="task_accuracy",
                           total_steps=600, per_head_segments=per_head_segments)
  config.chance_score = TASKS[task]["chance"]
  config.seq_len = 64
  config.log_every = 50
  config.eval_every = 200
  config.checkpoint_every = 200
  config.model.dropout_rate = TASKS[task]["dropout_rate"]
  config.model.attention_dropout_rate = 0.0
  rate = TASKS[task]["learning_rate"]
  config.optimizer.learning_rate = rate
  config.sweep.learning_rates = [rate / 2, rate, 2 * rate]
  return config
