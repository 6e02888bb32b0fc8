"""The trainer's one-pass evaluation of a fine-tuning run (the loss pass's outputs are the
task's predictions) equals the two passes it replaces: the loss and accuracy, and the task's
metrics from a separate prediction pass."""

import jax
import ml_collections
import numpy as np
import pytest

import posenc_jax.tasks  # noqa: F401 - registers the tasks
from posenc_jax.models.build import build_model
from posenc_jax.presets import preset_config
from posenc_jax.training import loop

BATCH, LENGTH = 4, 16


def _config(objective, task):
  c = ml_collections.ConfigDict(dict(objective=objective, task=task, batch_size=BATCH,
                                     seq_len=LENGTH,
                                     num_labels=1 if objective == "regression" else 2))
  c.model = preset_config("bert_tiny,t5").model
  c.model.update(dict(vocab_size=64, d_model=32, num_heads=4, mlp_dim=64, max_len=LENGTH,
                      num_layers=2, dropout_rate=0.0, attention_dropout_rate=0.0))
  return c


def _data(objective):
  """13 rows in batches of 4, the last padded with 3 ``weight`` 0 rows."""
  rng = np.random.default_rng(0)
  rows = 13
  ids = rng.integers(6, 64, (16, LENGTH)).astype(np.int32)
  labels = (rng.random(16) if objective == "regression" else rng.integers(0, 2, 16))
  weight = (np.arange(16) < rows).astype(np.float32)

  def data(config, split, start_step, shard_id=0, num_shards=1):
    for i in range(0, 16, BATCH):
      yield {"input_ids": ids[i:i + BATCH], "segment_ids": np.zeros((BATCH, LENGTH), np.int32),
             "mask": np.ones((BATCH, LENGTH), np.int32),
             "label": labels[i:i + BATCH].astype(
                 np.float32 if objective == "regression" else np.int32),
             "weight": weight[i:i + BATCH]}

  return data


@pytest.mark.parametrize("objective,task", [("classification", "glue_mrpc"),
                                            ("regression", "glue_stsb")])
def test_one_pass_equals_the_loss_pass_and_the_prediction_pass(objective, task):
  config = _config(objective, task)
  model = build_model(config.model, "classification", num_labels=config.num_labels)
  tokens = np.ones((BATCH, LENGTH), np.int32)
  params = model.init(jax.random.key(3), tokens, tokens * 0, tokens)["params"]
  data = _data(objective)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])

  two = loop.evaluate(jax.jit(loop.make_eval_step(model, config)), params,
                      data(config, "validation", 0), device)
  two |= loop.task_evaluation(config, model, params, data)
  outputs = []
  one = loop.evaluate(jax.jit(loop.make_eval_step(model, config, outputs=True)), params,
                      data(config, "validation", 0), device, outputs=outputs)
  one |= loop.task_evaluation(config, model, params, None, outputs=outputs)

  assert len(outputs) == 4 and set(one) == set(two) and any(k.startswith("task_") for k in one)
  for key in two:
    assert one[key] == pytest.approx(two[key], rel=1e-6, abs=1e-6), key
