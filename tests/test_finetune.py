"""Fine-tuning: the bundled WordNet tasks, starting from a pre-trained encoder, the sweep
statistic, and a short run that beats the majority class."""

import collections
import gzip
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import seqio

from posenc_jax.data import wordnet_tasks
from posenc_jax.data.vocab import BUNDLED_DIR, CLS_ID, SEP_ID
from posenc_jax.models import BertForSequenceClassification, model_config
from posenc_jax.training import finetune as finetune_lib
from tests.conftest import optimised_env



def _pretraining_definitions():
  """The gloss of every pre-training line ("lemmas: gloss"), examples cut off."""
  definitions = set()
  for name in ("pretrain_train.txt.gz", "pretrain_validation.txt.gz"):
    with gzip.open(BUNDLED_DIR / name, "rt") as f:
      for line in f:
        gloss = line.rstrip("\n").partition(": ")[2]
        definitions.add(gloss.split('; "')[0].split(' "')[0].strip())
  return definitions


def test_bundled_tasks_are_disjoint_from_pretraining_and_split_deterministically():
  seen = _pretraining_definitions()
  assert len(seen) > 90_000
  splits = {s: wordnet_tasks.supersense_examples(s) for s in wordnet_tasks.SPLITS}
  sizes = {s: len(v) for s, v in splits.items()}
  assert sum(sizes.values()) == len(wordnet_tasks.heldout_synsets())
  assert 0.75 < sizes["train"] / sum(sizes.values()) < 0.85
  for split in ("validation", "test"):
    assert not {definition for definition, _ in splits[split]} & seen
  keys = {s: {r["key"] for r in wordnet_tasks.heldout_synsets()
              if wordnet_tasks.split_of(r["key"]) == s} for s in wordnet_tasks.SPLITS}
  assert not keys["train"] & keys["test"] and not keys["train"] & keys["validation"]
  assert wordnet_tasks.supersense_examples("test") == splits["test"]


def test_hypernym_pairs_are_balanced_and_true_to_wordnet():
  examples = wordnet_tasks.hypernym_examples("train")
  labels = collections.Counter(label for _, _, label in examples)
  assert labels[0] == labels[1] > 300
  by_definition = {r["definition"]: r for r in wordnet_tasks.heldout_synsets()}
  for a, b, label in examples[:100]:
    ra, rb = by_definition[a], by_definition[b]
    is_hypernym = rb["offset"] in ra["hypernyms"] + ra["instance_hypernyms"]
    assert is_hypernym == bool(label) and ra["pos"] == rb["pos"]


def test_order_pairs_are_a_gloss_and_its_halves_swapped_balanced_and_deterministic():
  """Each definition twice, as written (1) and cut in two with its parts swapped (0): the
  same tokens, so only word order tells the labels apart."""
  examples = {s: wordnet_tasks.order_examples(s) for s in wordnet_tasks.SPLITS}
  vocabulary = seqio.get_mixture_or_task("wordnet_order").output_features[
      "input_ids"].vocabulary
  cuts = collections.Counter()
  for split, rows in examples.items():
    assert len(rows) > 2000 and [label for _, label in rows] == [1, 0] * (len(rows) // 2)
    for (text, _), (other, _) in zip(rows[::2], rows[1::2]):
      a, b = text.split(), other.split()
      (cut,) = [c for c in range(2, len(a) - 1) if b == a[c:] + a[:c]][:1]
      cuts[cut / len(a) < 0.5] += 1
      assert len(a) >= wordnet_tasks.ORDER_MIN_WORDS and " ".join(a) == text
    for text, other in zip([t for t, _ in rows[:200:2]], [t for t, _ in rows[1:200:2]]):
      assert sorted(vocabulary.encode(text)) == sorted(vocabulary.encode(other))
  assert min(cuts.values()) > 0.3 * sum(cuts.values())  # cuts in both halves of a gloss
  # The split is the synsets' (as the other tasks'), and a second build is identical.
  first_key = {}
  for r in wordnet_tasks.heldout_synsets():
    first_key.setdefault(" ".join(r["definition"].split()), r["key"])
  for split, rows in examples.items():
    assert {wordnet_tasks.split_of(first_key[t]) for t, _ in rows[::2]} == {split}
  texts = [{t for t, _ in rows} for rows in examples.values()]
  assert not (texts[0] & texts[1] or texts[0] & texts[2] or texts[1] & texts[2])
  assert wordnet_tasks.order_examples("validation") == examples["validation"]
  assert wordnet_tasks.rotated(["a", "b", "c"], "k") == []  # too short to cut in two pairs


def test_each_tasks_chance_score_is_its_majority_class_on_validation():
  from posenc_jax.configs import finetune_wordnet  # noqa: PLC0415
  examples = {"wordnet_supersense": wordnet_tasks.supersense_examples,
              "wordnet_hypernym": wordnet_tasks.hypernym_examples,
              "wordnet_order": wordnet_tasks.order_examples}
  assert set(examples) == set(finetune_wordnet.TASKS) == set(wordnet_tasks.TASK_INFO)
  for task, build in examples.items():
    labels = collections.Counter(example[-1] for example in build("validation"))
    majority = 100 * labels.most_common(1)[0][1] / sum(labels.values())
    assert finetune_wordnet.get_config(task).chance_score == pytest.approx(majority, abs=1e-4)


@pytest.mark.parametrize("damage, message", [("missing", "is missing"),
                                             ("truncated", "is damaged or not the bundled"),
                                             ("other", "is damaged or not the bundled")])
def test_a_missing_or_damaged_heldout_file_is_one_line_naming_it(tmp_path, monkeypatch, damage,
                                                                 message):
  from posenc_jax.configs import finetune_wordnet  # noqa: PLC0415
  from posenc_jax.data.stdlib_corpus import CorpusError  # noqa: PLC0415
  from posenc_jax.training.errors import USER_ERRORS  # noqa: PLC0415
  from posenc_jax.training.input_pipeline import check_examples  # noqa: PLC0415
  path = tmp_path / "synsets_heldout.jsonl.gz"
  if damage == "truncated":
    path.write_bytes(wordnet_tasks.HELDOUT.read_bytes()[:5000])
  elif damage == "other":
    path.write_bytes(gzip.compress(b'{"key": "n00000001"}\n'))
  monkeypatch.setattr(wordnet_tasks, "HELDOUT", path)
  with pytest.raises(USER_ERRORS) as error:
    check_examples(finetune_wordnet.get_config("wordnet_order"))
  text = str(error.value)
  assert isinstance(error.value, CorpusError)
  assert "\n" not in text and text.startswith(f"corpus: {path} ") and message in text


@pytest.mark.parametrize("task,pair", [("wordnet_supersense", False), ("wordnet_hypernym", True),
                                       ("wordnet_order", False)])
def test_bundled_task_features(task, pair):
  ds = seqio.get_mixture_or_task(task).get_dataset(
      {"input_ids": 32, "segment_ids": 32, "mask": 32}, split="validation", shuffle=False)
  for example in ds.take(20).as_numpy_iterator():
    ids, segments, mask = example["input_ids"], example["segment_ids"], example["mask"]
    assert ids.shape == segments.shape == mask.shape == (32,) and ids.dtype == np.int32
    n = int(mask.sum())
    assert ids[0] == CLS_ID and ids[n - 1] == SEP_ID and np.all(ids[n:] == 0)
    assert np.all(mask[:n] == 1)
    assert (segments.max() == 1) == pair and np.all(segments[n:] == 0)
    if pair:
      first_sep = int(np.argmax(ids == SEP_ID))
      assert np.all(segments[:first_sep + 1] == 0) and np.all(segments[first_sep + 1:n] == 1)
    assert 0 <= example["label"] < wordnet_tasks.TASK_INFO[task]["num_labels"]


def test_merge_encoder_copies_matching_parameters_only():
  cfg = model_config(vocab_size=50, d_model=32, num_layers=2, num_heads=4, mlp_dim=48,
                     max_len=16, segment={"name": "segment_per_head"})
  model = BertForSequenceClassification(cfg, num_labels=3)
  ids = jnp.ones((1, 8), jnp.int32)
  target = jax.device_get(jax.tree.map(lambda x: x, model.init(jax.random.key(0), ids)))
  import flax.linen as nn
  target = nn.unbox(target["params"])
  source = jax.tree.map(lambda x: np.full(x.shape, 7.0, np.float32), target["bert"])
  source.pop("segment")
  source["segment"] = {"segment_embedding": np.zeros((2, 32), np.float32)}  # input segments
  merged, report = finetune_lib.merge_encoder(target, source, "pretrained")
  assert np.all(merged["bert"]["layers"]["mlp"]["wi"]["kernel"] == 7.0)
  np.testing.assert_array_equal(merged["classifier"]["kernel"], target["classifier"]["kernel"])
  assert "bert/segment/segment_bias" in report.fresh and "classifier/kernel" in report.fresh
  assert report.unused == ["segment/segment_embedding"]


def test_sweep_reports_the_median_over_seeds_of_the_best_learning_rate(monkeypatch, tmp_path):
  scores = {(1e-5, 0): 50.0, (1e-5, 1): 70.0, (1e-5, 2): 60.0,
            (2e-5, 0): 65.0, (2e-5, 1): 90.0, (2e-5, 2): 64.0}

  def fake_finetune(config, workdir, init_checkpoint=None, data=None):
    score = scores[(config.optimizer.learning_rate, config.seed)]
    return {"best": {"step": 10, "metric": "task_accuracy", "score": score}}

  monkeypatch.setattr(finetune_lib, "finetune", fake_finetune)
  from posenc_jax.configs import finetune_wordnet
  config = finetune_wordnet.get_config("wordnet_supersense")
  config.sweep.learning_rates = [1e-5, 2e-5]
  config.sweep.seeds = [0, 1, 2]
  summary = finetune_lib.sweep(config, str(tmp_path))
  assert summary["by_learning_rate"] == {"1e-05": 60.0, "2e-05": 65.0}
  assert summary["best_learning_rate"] == 2e-5 and summary["score"] == 65.0
  table = (tmp_path / "sweep.md").read_text()
  assert "| 2e-05 | 65.0000 | 90.0000 | 64.0000 | 65.0000 |" in table
  assert json.loads((tmp_path / "sweep.json").read_text())["score"] == 65.0


def test_pretrain_then_finetune_beats_the_majority_class(tmp_path):
  """``python -m posenc_jax.train`` (a few steps) -> ``python -m posenc_jax.finetune`` from
  its checkpoint on wordnet_supersense, run outside the repository as after ``pip install``
  (the packaged configs, by path or by name)."""
  pre = subprocess.run([sys.executable, "-m", "posenc_jax.train", "--config=configs/pretrain.py",
                        f"--workdir={tmp_path / 'pre'}", "--config.total_steps=10",
                        "--config.checkpoint_every=10", "--config.eval_every=0",
                        "--config.optimizer.warmup_steps=2", "--config.seq_len=32"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       env=optimised_env())
  assert pre.returncode == 0, pre.stderr[-3000:]
  ft = subprocess.run([sys.executable, "-m", "posenc_jax.finetune",
                       "--config=finetune_wordnet:wordnet_supersense",
                       f"--init_checkpoint={tmp_path / 'pre'}", f"--workdir={tmp_path / 'ft'}",
                       # One evaluation, glosses cut at 32 tokens, as the pre-training's rows:
                       # 22.0 against the majority class's 11.1 (147 -> 87 s of CPU for the
                       # two commands, against 64 tokens and 2 evaluations).
                       "--config.total_steps=300", "--config.eval_every=300",
                       "--config.seq_len=32"],
                      cwd=tmp_path, capture_output=True, text=True, timeout=900,
                      env=optimised_env())
  assert ft.returncode == 0, ft.stderr[-3000:]
  assert "encoder parameters loaded" in ft.stdout
  labels = [label for _, label in wordnet_tasks.supersense_examples("validation")]
  majority = collections.Counter(labels).most_common(1)[0][1] / len(labels)
  best = json.loads((tmp_path / "ft" / "best.json").read_text())
  assert best["metric"] == "task_accuracy"
  assert best["score"] > 100 * majority + 5, (best, majority)
  assert any((tmp_path / "ft" / "best").iterdir())


def test_a_hugging_face_bert_fine_tunes_with_its_own_wordpiece_vocabulary(tmp_path):
  """finetune() from a Hugging Face folder: the task is tokenised with its vocab.txt (the
  registered task's vocabulary is that WordPiece one; ids stay below its 40 tokens), the
  model is the checkpoint's, and the run records the vocabulary in its config.json."""
  from posenc_jax.configs import finetune_wordnet  # noqa: PLC0415
  from tests.test_errors_finetune import hf_folder  # noqa: PLC0415

  folder = hf_folder(tmp_path)
  config = finetune_wordnet.get_config("wordnet_supersense")
  config.update(dict(seq_len=16, batch_size=4, total_steps=2, eval_every=2, eval_steps=1,
                     checkpoint_every=2, log_every=1))
  config.optimizer.warmup_steps = 0
  result = finetune_lib.finetune(config, str(tmp_path / "ft"), str(folder))
  saved = json.loads((tmp_path / "ft" / "config.json").read_text())
  assert saved["vocab"] == str(folder) and saved["task"].startswith("wordnet_supersense_wp_")
  assert saved["model"]["vocab_size"] == 40 and saved["model"]["scheme"]["name"] == "learned_ape"
  vocabulary = seqio.get_mixture_or_task(saved["task"]).output_features["input_ids"].vocabulary
  assert vocabulary.vocab_size == 40
  ids = vocabulary.encode("the cat")  # the bundled glosses through BERT's WordPiece rules
  assert ids and max(ids) < 40
  assert result["best"]["metric"] == "task_accuracy"
