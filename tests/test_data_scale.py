"""Training input at scale: resuming from the saved iterator state (exact, constant cost; for
pre-training, causal LM, translation and fine-tuning; a pipeline with Python state resumes
by the step), source-level sharding (disjoint, covering, 1/N of the reading per host), the
cache switch, the train loop resuming through the Orbax checkpoint, and the input
benchmark."""

import json
import os

import numpy as np
import pytest
import seqio
import tensorflow as tf

from posenc_jax.benchmarks import pipeline as bench
from posenc_jax.data import causal_lm
from posenc_jax.data import preprocessors as pp
from posenc_jax.training.input_pipeline import InputIterator

L, BATCH, BLOCK = 16, 4, 8


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """4 gzip files of 60 lines, and a text-lines task over them with a line counter."""
  files = bench.write_corpus(tmp_path_factory.mktemp("corpus"), 4, 60)
  _, counter = bench.register_counted("scale_test_corpus", {"train": files})
  return "scale_test_corpus", files, counter


@pytest.fixture(scope="module")
def lm_task(corpus):
  _, files, _ = corpus
  vocabulary = seqio.get_mixture_or_task("wordnet_glosses").output_features["text"].vocabulary
  causal_lm.register_causal_lm("scale_test_corpus_lm", {"train": files}, vocabulary)
  return "scale_test_corpus_lm"


def _mlm(task, **kw):
  return pp.mlm_dataset(task, "train", L, BATCH, seed=3, shuffle_block=BLOCK, **kw)


def _equal(a, b):
  return set(a) == set(b) and all((a[k] == b[k]).all() for k in a)


def _resumed(make, step, tmp_path, count=3):
  """``count`` batches after restoring, into a fresh iterator, the state saved after
  ``step`` batches; ``make()`` gives a dataset or an :class:`InputIterator`."""
  iterator = lambda: make() if isinstance(make(), InputIterator) else InputIterator(make())  # noqa: E731
  it = iterator()
  for _ in range(step):
    next(it)
  prefix = str(tmp_path / f"state_{step}" / "iterator")
  it.save_state(prefix)
  fresh = iterator()
  fresh.restore_state(prefix)
  return [next(fresh) for _ in range(count)]


@pytest.mark.parametrize("objective", ["mlm", "lm"])
@pytest.mark.parametrize("cache", [False, True])
def test_restored_iterator_continues_exactly_across_epochs(corpus, lm_task, tmp_path,
                                                           objective, cache):
  task, _, _ = corpus
  if objective == "mlm":
    make = lambda: _mlm(task, cache=cache)  # noqa: E731
  else:
    make = lambda: causal_lm.lm_dataset(lm_task, "train", L, BATCH, seed=3,  # noqa: E731
                                        shuffle_block=BLOCK, cache=cache)
  n = (pp.epoch_length(task, "train", L) if objective == "mlm"
       else causal_lm.epoch_length(lm_task, "train", L))
  boundary = n // BATCH                                   # the batch holding epoch 1's start
  steps = [0, 3, boundary, boundary + 1, 2 * boundary + 2]
  full = [b for _, b in zip(range(steps[-1] + 3), InputIterator(make()))]
  for step in steps:
    for x, y in zip(full[step:step + 3], _resumed(make, step, tmp_path), strict=True):
      assert _equal(x, y), (objective, step)


@pytest.fixture(scope="module")
def long_corpus(tmp_path_factory):
  """One file of 6,000 lines (packing reads 1,024 lines at a time, so a resume by the step
  number reads more chunks the later the step)."""
  files = bench.write_corpus(tmp_path_factory.mktemp("long"), 1, 6000, seed=1)
  _, counter = bench.register_counted("scale_test_long", {"train": files})
  return "scale_test_long", counter


def test_resume_cost_does_not_grow_with_the_step(long_corpus, tmp_path):
  """Lines read from the source to give the first batch after resuming at step s: bounded
  (one packing chunk and read-ahead) from the saved state at any s, growing with s by the
  step number (``start_step``)."""
  task, counter = long_corpus
  pp.epoch_length(task, "train", L)              # counted once per process, not per resume
  options = tf.data.Options()       # the counter is state outside the pipeline: not saved
  options.experimental_external_state_policy = tf.data.experimental.ExternalStatePolicy.IGNORE
  make = lambda **kw: _mlm(task, cache=False, **kw).with_options(options)  # noqa: E731
  from_state, from_step = {}, {}
  for step in (10, 1000):                        # both inside epoch 0 (about 2,000 batches)
    it = InputIterator(make())
    for _ in range(step):
      next(it)
    prefix = str(tmp_path / f"cost_{step}" / "iterator")
    it.save_state(prefix)
    expected = next(it)
    fresh = InputIterator(make())
    counter.assign(0)
    fresh.restore_state(prefix)
    assert _equal(next(fresh), expected)
    from_state[step] = int(counter.numpy())
    counter.assign(0)
    assert _equal(next(InputIterator(make(start_step=step))), expected)
    from_step[step] = int(counter.numpy())
  assert max(from_state.values()) <= 2 * 1024, (from_state, from_step)
  assert from_step[1000] >= from_step[10] + 2 * 1024, (from_state, from_step)


@pytest.mark.parametrize("num_shards", [2, 3, 4, 8])
def test_source_shards_are_disjoint_cover_the_source_and_split_the_reading(corpus, num_shards):
  task, files, counter = corpus
  seqio_task = seqio.get_mixture_or_task(task)
  all_lines = sorted(ex["text_pretokenized"] for ex in seqio_task.get_dataset(
      None, split="train", shuffle=False).as_numpy_iterator())
  shards, reads = [], []
  for k in range(num_shards):
    counter.assign(0)
    shards.append([ex["text_pretokenized"] for ex in seqio_task.get_dataset(
        None, split="train", shuffle=False, shard_info=pp.shard_info(k, num_shards))
        .as_numpy_iterator()])
    reads.append(int(counter.numpy()))
  assert sorted(line for s in shards for line in s) == all_lines        # disjoint, covering
  if num_shards <= len(files):       # whole files per host: each reads only its files' lines
    per_file = len(all_lines) // len(files)
    assert reads == [per_file * len(files[k::num_shards]) for k in range(num_shards)]
    assert sum(reads) == len(all_lines)
  else:                              # fewer files than hosts: every host reads, keeps 1/N
    assert reads == [len(all_lines)] * num_shards
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_source_sharded_masked_lm_covers_an_epoch_and_one_host_is_unchanged(corpus):
  task, _, _ = corpus
  for sharding in ("source", "stream"):  # one host: the same batches in both modes
    a = [b for _, b in zip(range(5), _mlm(task, sharding=sharding).as_numpy_iterator())]
    b = [b for _, b in zip(range(5), _mlm(task).as_numpy_iterator())]
    assert all(_equal(x, y) for x, y in zip(a, b, strict=True))
  real = {}
  for n in (1, 2, 4):
    tokens = []
    for k in range(n):
      for batch in _mlm(task, shard_id=k, num_shards=n, sharding="source", repeat=False,
                        drop_remainder=False).as_numpy_iterator():
        original = np.where(batch["mlm_weights"] > 0, batch["mlm_targets"], batch["input_ids"])
        tokens += original[batch["mask"] > 0].tolist()
    real[n] = sorted(t for t in tokens if t >= 6)     # the text's pieces, every line once
  assert real[1] == real[2] == real[4]
  hosts = [next(_mlm(task, shard_id=k, num_shards=2, sharding="source").as_numpy_iterator())
           for k in (0, 1)]
  assert not (hosts[0]["mlm_weights"] == hosts[1]["mlm_weights"]).all()  # own mask seeds


def test_cache_auto_caches_small_sources_only(corpus, tmp_path):
  task, _, _ = corpus
  assert pp.auto_cache(task, "train") and pp.auto_cache("wordnet_glosses", "train")
  big = tmp_path / "big.txt"
  with open(big, "wb") as f:
    f.truncate(pp.CACHE_AUTO_MAX_BYTES + 2**20)  # sparse: its size, no disk or reading
  bench.register_counted("scale_test_big", {"train": str(big)})
  assert not pp.auto_cache("scale_test_big", "train")
  assert pp.auto_cache("scale_test_big", "train", num_shards=2)  # half per host
  assert pp.resolve_cache(True, "scale_test_big", "train", 1) is True
  assert pp.resolve_cache("auto", "scale_test_big", "train", 1) is False
  with pytest.raises(ValueError, match=r"^cache: got 'yes'; allowed: true, false or 'auto'$"):
    pp.resolve_cache("yes", task, "train", 1)
  with pytest.raises(ValueError, match=r"^sharding: got 'host'"):
    _mlm(task, sharding="host")


def test_train_config_data_fields_are_validated():
  from posenc_jax.configs.pretrain import get_config  # noqa: PLC0415
  from posenc_jax.training.config import (TrainConfigError, cache_data,  # noqa: PLC0415
                                          validate_train_config)

  config = get_config("bert_tiny,diet_abs_share")
  assert (config.data_sharding, cache_data(config)) == ("source", "auto")
  for text, value in (("true", True), ("FALSE", False), ("auto", "auto")):
    config.cache_data = text
    assert cache_data(config) == value
  config.cache_data = "sometimes"
  with pytest.raises(TrainConfigError, match=r"^cache_data: got 'sometimes'; allowed: auto, "):
    validate_train_config(config)
  config.cache_data = "auto"
  config.data_sharding = "files"
  with pytest.raises(TrainConfigError, match=r"^data_sharding: got 'files'; allowed: "):
    validate_train_config(config)


def test_the_train_loop_resumes_from_the_saved_input_state(corpus, tmp_path, monkeypatch):
  """3 steps, then a rerun to 6 in the same workdir (a constant learning rate: the schedule
  does not depend on total_steps): the rerun restores the iterator state of
  checkpoint 3 (the pipeline built at step 0, never at start_step 3) and ends as the
  uninterrupted 6-step run."""
  from posenc_jax.configs.pretrain import get_config  # noqa: PLC0415
  from posenc_jax.training import input_pipeline  # noqa: PLC0415
  from posenc_jax.training.checkpoint import restore_params  # noqa: PLC0415
  from posenc_jax.training.loop import train  # noqa: PLC0415

  task, _, _ = corpus
  monkeypatch.setattr(pp, "mlm_dataset", _with_block(pp.mlm_dataset))
  built = []
  make = input_pipeline.make_batches

  def recording(config, split, start_step, **host):
    built.append((split, start_step))
    return make(config, split, start_step, **host)

  def config(steps):
    c = get_config("bert_tiny,diet_abs_share")
    c.model.update(dict(d_model=32, num_heads=2, mlp_dim=64, num_layers=1, max_len=L,
                        dropout_rate=0.0, attention_dropout_rate=0.0))
    c.update(dict(task=task, seq_len=L, batch_size=BATCH, total_steps=steps, log_every=1,
                  eval_every=0, checkpoint_every=3, compilation_cache_dir="",
                  async_checkpointing=False))
    c.optimizer.update(dict(learning_rate=1e-3, warmup_steps=0, schedule="constant"))
    return c

  whole = train(config(6), str(tmp_path / "whole"), data=recording)
  train(config(3), str(tmp_path / "split"), data=recording)
  saved = tmp_path / "split" / "checkpoints" / "3" / "input" / "process_0-of-1"
  assert (saved / "iterator.index").exists()
  built.clear()
  resumed = train(config(6), str(tmp_path / "split"), data=recording)
  assert ("train", 3) not in built and built.count(("train", 0)) == 2  # init batch, restored
  losses = {h["step"]: h["loss"] for h in whole["history"]}
  assert [h["step"] for h in resumed["history"]] == [4, 5, 6]
  for h in resumed["history"]:
    assert h["loss"] == losses[h["step"]], h["step"]
  for a, b in zip(*(tf.nest.flatten(r["state"].params) for r in (whole, resumed)), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert restore_params(str(tmp_path / "split"))[0] == 6  # read-only readers skip the item


def _with_block(fn):
  def call(*args, **kw):
    return fn(*args, **kw | {"shuffle_block": BLOCK})
  return call


def test_bench_runs_and_shows_source_sharding_splitting_the_work(tmp_path, capsys):
  out = tmp_path / "bench.json"
  assert bench.main(["--source=mock", "--hosts=2", "--seq_len=16", "--batch_size=4",
                     "--shuffle_block=8", "--mock_files=2", "--mock_lines=40",
                     f"--json={out}"]) == 0
  rows = json.loads(out.read_text())
  assert "examples/s" in capsys.readouterr().out
  by = {(r["sharding"], r["hosts"], r["host"]): r for r in rows}
  assert by["source", 1, 0]["lines_read"] == 80
  assert [by["source", 2, k]["lines_ratio"] for k in (0, 1)] == [0.5, 0.5]
  assert [by["stream", 2, k]["lines_ratio"] for k in (0, 1)] == [1.0, 1.0]
  assert sum(by["source", 2, k]["examples"] for k in (0, 1)) >= by["source", 1, 0]["examples"]


@pytest.mark.parametrize("argv, message", [
    (["--hosts=0"], "--hosts: got 0; allowed: a positive integer"),
    (["--source=web"], "--source: got 'web'"),
    (["--hosts=3", "--batch_size=32"], "--batch_size: got 32; allowed: a multiple of --hosts=3"),
])
def test_bench_bad_flags_are_one_line(argv, message, capsys):
  with pytest.raises(SystemExit) as e:
    bench.main(argv)
  err = capsys.readouterr().err
  assert e.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_register_counted_counts_lines(tmp_path):
  files = bench.write_corpus(tmp_path, 1, 7)
  task, counter = bench.register_counted("scale_test_tiny", {"train": files})
  lines = list(task.get_dataset(None, split="train", shuffle=False).as_numpy_iterator())
  assert len(lines) == 7 and int(counter.numpy()) == 7
  assert os.path.basename(files[0]).startswith("part-00000-of-00001")


def _two_processes(tmp_path, name, files, steps):
  """Runs the data-scale driver as 2 processes joined by jax.distributed; returns the losses
  process 0 logged, ``{step: loss}``, and both processes' output."""
  import pathlib  # noqa: PLC0415
  import socket  # noqa: PLC0415
  import subprocess  # noqa: PLC0415
  import sys  # noqa: PLC0415

  root = pathlib.Path(__file__).parent.parent
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  out = tmp_path / f"{name}_{steps}.json"
  procs = [subprocess.Popen(
      [sys.executable, str(root / "tests" / "drivers" / "data_scale_driver.py"),
       f"--workdir={tmp_path / name}", f"--out={out}", f"--files={','.join(files)}",
       f"--steps={steps}", f"--coordinator=localhost:{port}", "--num_processes=2",
       f"--process_id={i}"], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      text=True) for i in range(2)]
  outputs = [p.communicate(timeout=600)[0] for p in procs]
  assert all(p.returncode == 0 for p in procs), outputs[0][-3000:] + outputs[1][-3000:]
  return {int(k): v for k, v in json.loads(out.read_text()).items()}, "".join(outputs)


def test_two_processes_resume_from_their_own_input_states(corpus, tmp_path):
  """Two processes, source-sharded (2 files each): a run stopped after its step-3 checkpoint
  and rerun to 6 restores each process's own iterator state and gives the uninterrupted run's
  losses. The stopped run is the uninterrupted one's workdir without its step-6 checkpoint
  (what a kill between the two saves leaves), so the job runs twice instead of three times."""
  import shutil  # noqa: PLC0415

  _, files, _ = corpus
  whole, _ = _two_processes(tmp_path, "whole", files, 6)
  shutil.copytree(tmp_path / "whole", tmp_path / "split")
  shutil.rmtree(tmp_path / "split" / "checkpoints" / "6")
  assert sorted(os.listdir(tmp_path / "split" / "checkpoints")) == ["3"]
  for k in (0, 1):
    assert (tmp_path / "split" / "checkpoints" / "3" / "input" / f"process_{k}-of-2" /
            "iterator.index").exists()
  resumed, output = _two_processes(tmp_path, "split", files, 6)
  for k in (0, 1):
    assert f"process {k}: input state of step 3 restored: True" in output, output[-3000:]
  assert sorted(resumed) == [4, 5, 6]
  assert all(resumed[s] == whole[s] for s in resumed), (resumed, whole)


def test_a_workdir_from_before_data_sharding_resumes_as_the_stream():
  """A config.json written before ``data_sharding`` existed recorded a global-stream run:
  resuming it with ``stream`` is allowed, with ``source`` it is one differing field."""
  from posenc_jax.training.workdir import differences  # noqa: PLC0415

  assert differences({"seed": 0}, {"seed": 0, "data_sharding": "stream"}) == []
  assert differences({"seed": 0}, {"seed": 0, "data_sharding": "source"}) == [
      "data_sharding: 'stream' there, 'source' here"]
  assert differences({"seed": 0}, {"seed": 0}) == []


# Translation and fine-tuning training batches resume from their saved state too.

TSV_LINES = 30


@pytest.fixture(scope="module")
def translation_task(tmp_path_factory):
  """A translation task over a local tsv file (``source<TAB>target``, 30 pairs): the same
  tokenising and EOS steps as the WMT18 tasks, from files instead of TFDS."""
  from posenc_jax.data import tasks, vocab  # noqa: PLC0415

  path = tmp_path_factory.mktemp("tsv") / "pairs.tsv"
  rng = np.random.default_rng(0)
  words = "the cat sat on a mat while dogs ran far away".split()
  path.write_text("".join(f"{' '.join(rng.choice(words, 4))}\t{' '.join(rng.choice(words, 5))}\n"
                          for _ in range(TSV_LINES)))
  vocabulary = vocab.vocabulary()
  feature = seqio.Feature(vocabulary, add_eos=True, dtype=tf.int32)

  def pairs(ds):
    def split(line):
      parts = tf.strings.split(line, "\t")
      return {"inputs": parts[0], "targets": parts[1]}
    return ds.map(split)

  def generated(split, shuffle_files, seed=None):  # the same lines through Python
    del split, shuffle_files, seed
    lines = path.read_text().splitlines()
    return tf.data.Dataset.from_generator(lambda: iter(lines),
                                          output_signature=tf.TensorSpec((), tf.string))

  sources = {"scale_test_translation": seqio.TextLineDataSource({"train": str(path)}),
             "scale_test_translation_py": seqio.FunctionDataSource(generated, ["train"])}
  for name, source in sources.items():
    seqio.TaskRegistry.remove(name)
    tasks.register(name, source=source,
                   preprocessors=[pairs, seqio.preprocessors.tokenize,
                                  seqio.preprocessors.append_eos_after_trim],
                   output_features={"inputs": feature, "targets": feature},
                   shuffle_buffer_size=16)
  return "scale_test_translation"


def _training_config(objective, translation_task):
  from posenc_jax.configs import finetune_wordnet, translate  # noqa: PLC0415

  if objective == "translation":
    config = translate.get_config("transformer_base")
    config.update(dict(task=translation_task, input_len=L, target_len=L))
  else:
    config = finetune_wordnet.get_config("wordnet_supersense")
    config.seq_len = L
  config.batch_size = BATCH
  return config


@pytest.mark.parametrize("objective", ["translation", "classification"])
def test_translation_and_fine_tuning_batches_resume_from_their_state(objective,
                                                                      translation_task,
                                                                      tmp_path):
  """The restored iterator continues as the uninterrupted one and as the pipeline rebuilt
  at the step (the fallback): translation at step 0, 3, the epoch boundary (30 pairs in
  batches of 4) and past it; fine-tuning (a large split, each pipeline filling its shuffle
  buffer first) at 0 and 5."""
  from posenc_jax.training.input_pipeline import make_batches  # noqa: PLC0415

  config = _training_config(objective, translation_task)
  assert config.objective == objective
  make = lambda start=0: make_batches(config, "train", start)  # noqa: E731
  steps = ([0, 3, TSV_LINES // BATCH, TSV_LINES // BATCH + 1, 2 * TSV_LINES // BATCH + 2]
           if objective == "translation" else [0, 5])
  full = [b for _, b in zip(range(steps[-1] + 3), make())]
  assert isinstance(make(), InputIterator)
  for step in steps:
    resumed = _resumed(make, step, tmp_path)
    rebuilt = [b for _, b in zip(range(3), make(step))]
    for x, y, z in zip(full[step:step + 3], resumed, rebuilt, strict=True):
      assert _equal(x, y) and _equal(x, z), (objective, step)


def test_a_pipeline_with_python_state_resumes_by_the_step(translation_task, tmp_path, caplog):
  """A source read through a Python generator (as ``tfds.testing.mock_data`` and some TFDS
  builders read), which tf.data cannot save: the first save writes nothing and says so in
  one line, checkpoints leave the input out, and the pipeline rebuilt at the step gives
  the uninterrupted batches."""
  from posenc_jax.training.checkpoint import Checkpointer  # noqa: PLC0415
  from posenc_jax.training.input_pipeline import make_batches  # noqa: PLC0415

  config = _training_config("translation", translation_task + "_py")
  it = make_batches(config, "train", 0)
  full = [next(it) for _ in range(6)]
  with caplog.at_level("WARNING"):
    it.save_state(str(tmp_path / "state" / "iterator"))
  assert not it.checkpointable and not list((tmp_path / "state").glob("iterator*"))
  said = [r.getMessage() for r in caplog.records if "cannot save its position" in r.getMessage()]
  assert len(said) == 1 and "\n" not in said[0] and "PyFunc is stateful" in said[0], said
  checkpointer = Checkpointer(str(tmp_path / "run"), save_interval_steps=1, async_save=False)
  assert checkpointer.save(3, {"w": np.zeros(2)}, {"step": 3}, input_iterator=it)
  checkpointer.manager.wait_until_finished()
  assert not (tmp_path / "run" / "checkpoints" / "3" / "input").exists()
  assert not checkpointer.restore_input(3, make_batches(config, "train", 0))
  rebuilt = make_batches(config, "train", 3)
  assert all(_equal(x, next(rebuilt)) for x in full[3:])
