"""GLUE fine-tuning as DIET did: batch 32, warm-up 10%, LR in {1e-5, 2e-5, 3e-5, 4e-5},
5 seeds, the best checkpoint of each run, median over seeds (``--sweep``).

  python finetune.py --config=configs/finetune_glue.py:glue_rte,bert_base,diet_abs_share \
      --init_checkpoint=/data/runs/diet_abs_share --workdir=/data/ft/rte --sweep

The argument is ``<task>[,<size>,<scheme>...][,no_per_head_segments]`` (``squad_v1``:
SQuAD v1.1 span prediction). With
no presets the model is ``--init_checkpoint``'s (its ``config.json``; without a
checkpoint bert_base,bert); named presets must match it
(``--config.reinitialise=True`` starts what differs from scratch). Sentence
pair tasks switch on per-head segment terms (DIET eq. 2), initialised fresh.
Epochs: 10 on the small tasks (CoLA, MRPC, STS-B, RTE, WNLI), 5 on the rest
(DIET: "5 or 10 epochs").
"""

from ml_collections import config_dict

from posenc_jax.messages import nearest
from posenc_jax.presets import preset_config
from posenc_jax.training.config import base_train_config

# Training examples (GLUE train splits) and epochs.
TRAIN_SIZE = {"glue_cola": 8551, "glue_sst2": 67349, "glue_mrpc": 3668, "glue_qqp": 363846,
              "glue_stsb": 5749, "glue_mnli": 392702, "glue_qnli": 104743, "glue_rte": 2490,
              "glue_wnli": 635}
SMALL = ("glue_cola", "glue_mrpc", "glue_stsb", "glue_rte", "glue_wnli")


def finetune_config(task: str, presets: list[str], default: list[str], *, num_labels: int,
                    regression: bool, pair: bool, best_metric: str, total_steps: int,
                    per_head_segments: bool):
  """The shared fine-tuning config (GLUE, XNLI and the bundled tasks).

  ``presets`` are the ones the config argument names (the model is built from ``default``
  when there are none). ``config.presets`` records them: None means "the pre-trained
  model's architecture", which ``--init_checkpoint`` then supplies (its ``config.json``);
  named presets must match it unless ``config.reinitialise`` is set.
  """
  config = base_train_config()
  config.update(preset_config(",".join(presets or default)))
  config.presets = config_dict.placeholder(str)
  if presets:
    config.presets = ",".join(presets)
  config.reinitialise = False
  # A WordPiece vocab.txt (or a folder holding one) to tokenise with; None: a Hugging Face
  # init_checkpoint's own vocab.txt, else the bundled SentencePiece vocabulary.
  config.vocab = config_dict.placeholder(str)
  config.task = task
  config.objective = "regression" if regression else "classification"
  config.head = "classification"
  config.num_labels = 1 if regression else num_labels
  if pair and per_head_segments:
    config.model.segment = {"name": "segment_per_head"}
  config.seq_len = 128
  config.batch_size = 32
  config.total_steps = total_steps
  config.log_every = 100
  config.eval_every = max(total_steps // 10, 1)
  config.checkpoint_every = config.eval_every
  config.keep_checkpoints = 1
  config.best_metric = best_metric
  # The best_metric score of always answering the majority class (None: not stated); compare
  # reads a run at most LEARNED_MARGIN above it as one that did not learn.
  config.chance_score = config_dict.placeholder(float)
  config.eval_task = config_dict.placeholder(str)  # unset: evaluate on the task itself
  config.eval_split = config_dict.placeholder(str)  # unset: 'validation'
  config.optimizer.update(dict(name="adamw", learning_rate=2e-5, warmup_steps=0,
                               warmup_fraction=0.1, weight_decay=0.01, grad_clip_norm=1.0))
  config.sweep = dict(seeds=[0, 1, 2, 3, 4], learning_rates=[1e-5, 2e-5, 3e-5, 4e-5])
  return config


def parse_argument(arg: str, tasks) -> tuple[str, list[str], bool]:
  """``<task>[,<preset>...][,no_per_head_segments]`` -> the task (one of ``tasks``, else one
  ValueError line with the nearest name), the presets, and whether per-head segments stay."""
  names = arg.split(",")
  task = names[0]
  if task not in tasks:
    raise ValueError(f"config argument: task {task!r} is unknown{nearest(task, tasks)} "
                     f"allowed: {', '.join(sorted(tasks))}")
  presets = [n for n in names[1:] if n != "no_per_head_segments"]
  return task, presets, "no_per_head_segments" not in names


def squad_config(presets: list[str], default: list[str]):
  """SQuAD v1.1 span prediction (Wang et al. Table 4; DIET's XTREME QA source): 87,599
  questions, 2 epochs at batch 32, seq 384, LR 3e-5, F1 of the decoded answers."""
  config = finetune_config("squad_v1", presets, default, num_labels=2, regression=False,
                           pair=True, best_metric="task_f1", total_steps=5_475,
                           per_head_segments=True)
  config.objective = "span"
  config.head = "span"
  config.seq_len = 384
  config.optimizer.learning_rate = 3e-5
  return config


def get_config(arg="glue_rte"):
  from posenc_jax.data.glue import TASK_INFO  # noqa: PLC0415 - needs the data extra

  if arg.split(",")[0] == "squad_v1":  # the span task beside GLUE (compare's accelerator grid)
    return squad_config(parse_argument(arg, {"squad_v1"})[1], ["bert_base", "bert"])
  task, presets, per_head_segments = parse_argument(arg, TASK_INFO)
  info = TASK_INFO[task]
  epochs = 10 if task in SMALL else 5
  steps = epochs * TRAIN_SIZE.get(task, TRAIN_SIZE["glue_mnli"]) // 32
  return finetune_config(task, presets, ["bert_base", "bert"], num_labels=info.num_labels,
                         regression=info.regression, pair=info.is_pair,
                         best_metric=f"task_{info.score_metrics[0]}", total_steps=steps,
                         per_head_segments=per_head_segments)
