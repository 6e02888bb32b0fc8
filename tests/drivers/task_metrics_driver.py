"""Task metrics of tiny fixed-seed models through ``loop.task_evaluation`` (subprocess tests).

  python tests/drivers/task_metrics_driver.py --out=/tmp/x.json [--devices=4]
      [--coordinator=localhost:1234 --num_processes=2 --process_id=0]

GLUE accuracy/F1 (glue_mrpc) and MCC (glue_cola) on 13 fixed examples (batches of 4, the
last padded with ``weight`` 0 rows), SQuAD F1/EM (squad_v1 under a fixed TFDS mock: 3
questions, an odd number of windows) and BLEU (wmt18_en_de's metric on 6 fixed sources,
beam search). Process 0 writes the metrics and every prediction the metrics were computed
from as JSON. Set XLA flags before JAX is imported, hence a separate process.
"""

import argparse
import functools
import json
import os
import sys


def parse():
  p = argparse.ArgumentParser()
  p.add_argument("--out", required=True)
  p.add_argument("--devices", type=int, default=1)
  p.add_argument("--coordinator", default=None)
  p.add_argument("--num_processes", type=int, default=1)
  p.add_argument("--process_id", type=int, default=0)
  return p.parse_args()


ARGS = parse()
FLAGS = os.environ.get("XLA_FLAGS", "")  # the tests' own (tests/conftest.py)
os.environ["XLA_FLAGS"] = f"{FLAGS} --xla_force_host_platform_device_count={ARGS.devices}".strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402

if ARGS.coordinator:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(ARGS.coordinator, num_processes=ARGS.num_processes,
                             process_id=ARGS.process_id)

import flax.linen as nn  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402

import posenc_jax.tasks  # noqa: E402, F401 - registers the tasks
from posenc_jax.data import xtreme_qa  # noqa: E402
from posenc_jax.models.build import build_model  # noqa: E402
from posenc_jax.presets import preset_config  # noqa: E402
from posenc_jax.training import loop, task_eval  # noqa: E402
from posenc_jax.training import mesh as mesh_lib  # noqa: E402
from tests import tfds_mock  # noqa: E402
from tests.test_data_xtreme_qa import EXAMPLES, examples_dataset  # noqa: E402

BATCH, LENGTH, QA_LENGTH = 4, 16, 128
RECORDED: dict = {}


def record(name, fn):
  """Wraps ``fn`` to keep its arguments (the predictions a metric is computed from)."""
  def wrapped(*args, **kwargs):
    RECORDED.setdefault(name, []).append(args)
    return fn(*args, **kwargs)
  return wrapped


def on_mesh(model, inputs, mesh, seed=0):
  """Fixed-seed parameters, placed on ``mesh`` as training places them (every process holds
  the same values and hands in its devices' shards)."""
  boxed = model.init(jax.random.key(seed), *inputs)["params"]
  shardings = mesh_lib.shardings(boxed, mesh)
  params = jax.device_get(nn.unbox(boxed))
  return jax.tree.map(lambda x, s: jax.make_array_from_callback(
      np.shape(x), s, lambda index, x=np.asarray(x): x[index]), params, shardings)


def classification_data(config, split, start_step, shard_id=0, num_shards=1):
  """13 fixed examples in batches of this host's rows, the last padded (weight 0)."""
  del split, start_step
  rng = np.random.default_rng(7)
  n = 13
  ids = rng.integers(5, 64, (n, LENGTH)).astype(np.int32)
  lengths = rng.integers(4, LENGTH, n)
  mask = (np.arange(LENGTH) < lengths[:, None]).astype(np.int32)
  rows = {"input_ids": ids * mask, "segment_ids": np.zeros_like(ids), "mask": mask,
          "label": rng.integers(0, 2, n).astype(np.int32), "weight": np.ones(n, np.float32)}
  local = config.batch_size // num_shards
  mine = np.arange(n)[shard_id::num_shards]
  for start in range(0, len(mine), local):
    take = mine[start:start + local]
    yield {k: np.concatenate([v[take], np.zeros((local - len(take),) + v.shape[1:], v.dtype)])
           for k, v in rows.items()}


def mlm_batches(shard_id=0, num_shards=1):
  """3 fixed masked-LM evaluation batches, this host's rows of each (a different number of
  masked tokens per row, so each host scores its own count)."""
  rng = np.random.default_rng(5)
  local = BATCH // num_shards
  for _ in range(3):
    ids = rng.integers(5, 256, (BATCH, LENGTH)).astype(np.int32)
    weights = (rng.random((BATCH, LENGTH)) < np.linspace(0.1, 0.6, BATCH)[:, None])
    batch = {"input_ids": ids, "segment_ids": np.zeros_like(ids), "mask": np.ones_like(ids),
             "mlm_targets": ids, "mlm_weights": weights.astype(np.float32)}
    rows = slice(shard_id * local, (shard_id + 1) * local)
    yield {k: v[rows] for k, v in batch.items()}


def translation_data(config, split, start_step, shard_id=0, num_shards=1, references=None):
  """Fixed sources (ids, EOS) and targets (the ids reversed, EOS, or ``references[i]`` and
  EOS for example ``i``), full batches."""
  del split, start_step
  rng = np.random.default_rng(11)
  local = config.batch_size // num_shards
  example = 0
  while True:
    inputs = np.zeros((config.batch_size, LENGTH), np.int32)
    targets = np.zeros_like(inputs)
    for row, n in enumerate(rng.integers(3, LENGTH - 1, config.batch_size)):
      ids = rng.integers(6, 200, n)
      inputs[row, :n + 1] = np.append(ids, 1)
      target = ids[::-1] if references is None else references[example][:LENGTH - 1]
      targets[row, :len(target) + 1] = np.append(target, 1)
      example += 1
    rows = slice(shard_id * local, (shard_id + 1) * local)
    yield {"inputs": inputs[rows], "targets": targets[rows]}


# The XTREME tests' examples, the first with a shorter context (repeated: an odd number of
# windows at QA_LENGTH).
QA_EXAMPLES = [dict(EXAMPLES[0], context=(
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, "
    "France. It is named after the engineer Gustave Eiffel, whose company designed and "
    "built the tower from 1887 to 1889. " * 4
    + "The tower is 330 metres (1,083 ft) tall, the tallest structure in Paris."))] + EXAMPLES[1:]


def qa_dataset(self, split, decoders=None, read_config=None, **kwargs):
  del self, split, decoders, read_config, kwargs
  return examples_dataset(QA_EXAMPLES)


def config(objective, task, **model):
  c = ml_collections.ConfigDict(dict(objective=objective, task=task, batch_size=BATCH,
                                     seq_len=LENGTH, num_labels=2))
  c.model = preset_config("bert_tiny").model
  c.model.update(dict(vocab_size=256, d_model=32, num_heads=4, mlp_dim=64, max_len=LENGTH,
                      num_layers=2, dropout_rate=0.0, attention_dropout_rate=0.0) | model)
  return c


def main():
  mesh = mesh_lib.make_mesh((-1, 1))
  results = {}
  tokens = np.ones((BATCH, LENGTH), np.int32)

  model = build_model(config("classification", "glue_mrpc").model, "classification")
  params = on_mesh(model, (tokens, tokens * 0, tokens), mesh, seed=3)  # predicts both classes
  for task in ("glue_mrpc", "glue_cola"):
    results[task] = loop.task_evaluation(config("classification", task), model, params,
                                         classification_data)

  # The unigram reference of a pre-training evaluation: every host's scored tokens.
  c = config("mlm", "wordnet_glosses")
  c.update(dict(mask_rate=0.4, max_predictions_per_seq=None))
  model = build_model(c.model, "mlm")
  params = on_mesh(model, (tokens, tokens * 0, tokens), mesh)
  log_p = np.log(np.arange(1, 257) / np.arange(1, 257).sum())
  results["unigram"] = loop.evaluate(
      jax.jit(loop.make_eval_step(model, c)), params,
      mlm_batches(jax.process_index(), jax.process_count()), mesh_lib.batch_sharding(mesh),
      perplexity=True, reference=(log_p, "mlm", None))

  c = config("span", "squad_v1", vocab_size=8192, max_len=QA_LENGTH)
  c.seq_len = QA_LENGTH
  model = build_model(c.model, "span")
  qa_tokens = np.ones((BATCH, QA_LENGTH), np.int32)
  params = on_mesh(model, (qa_tokens, qa_tokens * 0, qa_tokens), mesh)
  with tfds_mock.mock_tfds(3, as_dataset_fn=qa_dataset):
    results["squad_v1"] = loop.task_evaluation(c, model, params, None)

  c = config("translation", "wmt18_en_de")
  c.model = preset_config("transformer_base,t5").model
  c.model.update(dict(vocab_size=256, d_model=32, num_heads=4, mlp_dim=64, max_len=LENGTH,
                      num_layers=1, num_decoder_layers=1, dropout_rate=0.0))
  c.decode = dict(eval_batches=2, beam_size=2, max_decode_len=LENGTH, alpha=0.6)
  c.batch_size = 6
  model = build_model(c.model, "translation")
  params = on_mesh(model, (tokens, tokens, tokens > 0), mesh)
  results["wmt18_en_de_random"] = loop.task_evaluation(c, model, params, translation_data)
  # References near the (untrained) model's own outputs, for a BLEU that is not 0: every
  # other one cut short.
  predictions = RECORDED["task_metrics"][-1][1]
  references = [p if i % 2 else p[:max(1, len(p) - 2)] for i, p in enumerate(predictions)]
  results["wmt18_en_de"] = loop.task_evaluation(
      c, model, params, functools.partial(translation_data, references=references))

  def plain(x):
    if isinstance(x, np.ndarray):
      return x.tolist()
    if isinstance(x, (list, tuple)):
      return [plain(v) for v in x]
    if isinstance(x, dict):
      return {str(k): plain(v) for k, v in x.items()}
    return x.item() if isinstance(x, np.generic) else x
  results["recorded"] = plain(RECORDED)
  if jax.process_index() == 0:
    with open(ARGS.out, "w") as f:
      json.dump(results, f)


if __name__ == "__main__":
  task_eval.task_metrics = record("task_metrics", task_eval.task_metrics)
  xtreme_qa.evaluate = record("qa_evaluate", xtreme_qa.evaluate)
  sys.exit(main())
