"""XTREME zero-shot fine-tuning (DIET's multilingual protocol): train on English, evaluate
in every language.

  python finetune.py --config=configs/finetune_xtreme.py:xnli_de,bert_base_multilingual,diet_abs \
      --init_checkpoint=/data/runs/ml_diet_abs --workdir=/data/ft/xnli_de
  python finetune.py --config=configs/finetune_xtreme.py:xquad_es,bert_base_multilingual,diet_rel \
      --init_checkpoint=/data/runs/ml_diet_rel --workdir=/data/ft/xquad_es

The argument is ``<target>[,<size>,<scheme>...]``: ``xnli_<lang>`` trains on
MNLI English (``xnli_train``); ``xquad_<lang>``, ``mlqa_<lang>`` and
``tydiqa_goldp_<lang>`` train on SQuAD v1.1 (``squad_v1``) with span
features (seq 384, document stride 128, query 64) and report F1/EM of the
decoded answers in the target language. With no presets the model is
``--init_checkpoint``'s (without a checkpoint bert_base_multilingual,bert).
"""

from posenc_jax.configs.finetune_glue import finetune_config, squad_config
from posenc_jax.messages import nearest

EVAL_SPLIT = {"xnli": "test", "xquad": "test", "mlqa": "test", "tydiqa": "validation"}


def get_config(arg="xnli_en"):
  names = arg.split(",")
  target = names[0]
  family = target.split("_")[0]
  if family not in EVAL_SPLIT:
    guesses = [f"{name}_{target.partition('_')[2]}" for name in EVAL_SPLIT]
    raise ValueError(f"config argument: target {target!r} is unknown{nearest(target, guesses)} "
                     "allowed: xnli_<lang>, xquad_<lang>, mlqa_<lang>, tydiqa_goldp_<lang>")
  presets, default = names[1:], ["bert_base_multilingual", "bert"]
  if family == "xnli":  # 392,702 MNLI pairs, 2 epochs at batch 32
    config = finetune_config("xnli_train", presets, default, num_labels=3, regression=False, pair=True,
                             best_metric="task_accuracy", total_steps=24_544,
                             per_head_segments=True)
  else:
    config = squad_config(presets, default)
  config.eval_task = target
  config.eval_split = EVAL_SPLIT[family]
  return config
