"""Task metrics in multi-process jobs: two processes joined by jax.distributed (CPU
collectives, 2 devices each) compute the same GLUE accuracy/F1/MCC, SQuAD F1/EM and BLEU,
from the same predictions, as one process with 4 devices (tests/drivers/task_metrics_driver.py:
13 classification examples in batches of 4, 5 QA windows, 6 translations per batch, none
divisible by the processes or the devices)."""

import json
import subprocess
import sys

import pytest

from tests.test_training import ROOT, _free_port

DRIVER = str(ROOT / "tests" / "drivers" / "task_metrics_driver.py")


def _driver(out, *args):
  return subprocess.Popen([sys.executable, DRIVER, f"--out={out}", *args], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_two_processes_compute_the_task_metrics_of_one(tmp_path):
  address = f"localhost:{_free_port()}"
  procs = [_driver(tmp_path / "one.json", "--devices=4")]
  procs += [_driver(tmp_path / "two.json", "--devices=2", f"--coordinator={address}",
                    "--num_processes=2", f"--process_id={i}") for i in range(2)]
  outputs = [p.communicate(timeout=600)[0] for p in procs]
  assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outputs)
  one = json.loads((tmp_path / "one.json").read_text())
  two = json.loads((tmp_path / "two.json").read_text())
  assert set(one["glue_mrpc"]) == {"task_accuracy", "task_f1"}
  assert set(one["glue_cola"]) == {"task_matthews_corr"}
  assert set(one["squad_v1"]) == {"task_exact_match", "task_f1"}
  assert one["wmt18_en_de"]["task_bleu"] > 10  # references near the model's outputs
  [(_, _, predictions)] = one["recorded"]["qa_evaluate"]
  assert set(predictions) == {"eiffel-height", "es-gato", "de-bern"}
  [_, predictions, labels] = one["recorded"]["task_metrics"][0]
  assert len(predictions) == len(labels) == 13 and len(set(predictions)) == 2
  # A pre-training evaluation's unigram reference sums every host's scored tokens (float32
  # across hosts), as its loss does.
  one_host, two_hosts = one.pop("unigram"), two.pop("unigram")
  unigram = {k: (one_host[k], two_hosts[k])
             for k in ("eval_loss", "eval_perplexity", "eval_unigram_perplexity")}
  for name, (a, b) in unigram.items():
    assert b == pytest.approx(a, rel=1e-5), name
  assert unigram["eval_unigram_perplexity"][0] > 1
  assert two == one  # the metrics, and every prediction and reference they came from


def test_every_host_gets_as_many_evaluation_batches():
  """Fine-tuning evaluation over 2 hosts with 5 examples: each host pads its shard to 3 rows
  (weight 0), so both run 2 steps of the collective evaluation; together their real rows
  are the one-host evaluation's, each once."""
  import ml_collections  # noqa: PLC0415

  import posenc_jax.tasks  # noqa: F401, PLC0415 - registers the tasks
  from posenc_jax.training.input_pipeline import make_batches  # noqa: PLC0415
  from tests import tfds_mock  # noqa: PLC0415

  config = ml_collections.ConfigDict(dict(objective="classification", task="glue_mrpc",
                                          batch_size=4, seq_len=16, seed=0))
  with tfds_mock.mock_tfds(5):
    hosts = [list(make_batches(config, "validation", 0, k, 2)) for k in range(2)]
    [one] = [list(make_batches(config, "validation", 0, 0, 1))]

  def real_rows(batches):
    return sorted(tuple(row) for b in batches for row, w in zip(b["input_ids"], b["weight"])
                  if w > 0)

  assert [len(h) for h in hosts] == [2, 2]
  assert all(b["input_ids"].shape == (2, 16) for h in hosts for b in h)
  assert sum(b["weight"].sum() for h in hosts for b in h) == 5
  assert real_rows(hosts[0] + hosts[1]) == real_rows(one)
