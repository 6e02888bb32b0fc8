"""Synthetic probes (copy, reverse, MQAR, passkey): examples deterministic in ``(seed,
index)`` whatever the batch size, host count or resume step; answers right by construction,
decoded by hand; lengths and depths as asked; the weighted causal-LM objective against a
float64 computation; ``score`` against oracle models; a short real training run with
scoring at twice its length; train.py and evaluate on a probe without TensorFlow; one-line
errors."""

import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from posenc_jax.data import probes
from posenc_jax.data.probes import FILLER, FIRST_SYMBOL, KEY_MARKER, SEPARATOR, ProbeError
from posenc_jax.models.transformer import shift_right
from posenc_jax.training.objectives import lm_objective
from tests.test_configs import _parsed
from tests.test_lm import init_lm

NAMES = ("copy", "reverse", "mqar", "passkey")


def _take(iterator, n):
  return [next(iterator) for _ in range(n)]


@pytest.mark.parametrize("name", NAMES)
def test_examples_depend_on_seed_and_index_only(name):
  spec = probes.probe(name)
  by_eight = _take(probes.batches(spec, 40, 8, seed=3), 2)
  by_four = _take(probes.batches(spec, 40, 4, seed=3), 4)
  resumed = next(probes.batches(spec, 40, 4, seed=3, start=2))
  hosts = [next(probes.batches(spec, 40, 8, seed=3, start=1, shard_id=i, num_shards=2))
           for i in range(2)]
  for key in ("targets", "loss_weights"):
    whole = np.concatenate([b[key] for b in by_eight])
    np.testing.assert_array_equal(whole, np.concatenate([b[key] for b in by_four]))
    np.testing.assert_array_equal(resumed[key], whole[8:12])
    np.testing.assert_array_equal(np.concatenate([h[key] for h in hosts]), whole[8:])
  assert by_eight[0]["targets"].dtype == np.int32
  assert by_eight[0]["loss_weights"].dtype == np.float32
  other = next(probes.batches(spec, 40, 8, seed=4))["targets"]
  assert not np.array_equal(other, by_eight[0]["targets"])


@pytest.mark.parametrize("length", [3, 8, 9, 33])
@pytest.mark.parametrize("reverse", [False, True])
def test_copy_and_reverse_decode(length, reverse):
  spec = probes.Copy(alphabet=5, reverse=reverse)
  for index in range(4):
    row = probes.example(spec, length, seed=0, index=index)
    targets, weights = row["targets"], row["loss_weights"]
    n = (length - 1) // 2
    source = list(targets[:n])
    assert all(FIRST_SYMBOL <= t < FIRST_SYMBOL + 5 for t in source)
    assert targets[n] == SEPARATOR
    assert list(targets[n + 1:2 * n + 1]) == (source[::-1] if reverse else source)
    assert list(targets[2 * n + 1:]) == [0] * (length - 2 * n - 1)  # padding
    assert list(np.flatnonzero(weights)) == list(range(n + 1, 2 * n + 1))
    assert set(weights) <= {0.0, 1.0}


def test_copy_with_min_symbols_trains_on_every_instance_length_and_scores_the_longest():
  spec = probes.Copy(alphabet=5, reverse=True, min_symbols=2)
  counts = []
  for index in range(200):
    row = probes.example(spec, 21, seed=0, index=index)
    n = int(np.flatnonzero(row["targets"] == SEPARATOR)[0])
    source = list(row["targets"][:n])
    assert list(row["targets"][n + 1:2 * n + 1]) == source[::-1]
    assert list(row["targets"][2 * n + 1:]) == [0] * (21 - 2 * n - 1)
    assert list(np.flatnonzero(row["loss_weights"])) == list(range(n + 1, 2 * n + 1))
    counts.append(n)
  assert set(counts) == set(range(2, 11))  # uniform over [min_symbols, (L - 1) // 2]
  assert spec.min_length() == 5
  assert spec.scored() == probes.Copy(alphabet=5, reverse=True)
  assert spec.chance(21) == 5.0 ** -10  # chance at the longest instance, as scored
  assert probes.probe(probes.describe(spec)) == spec
  with pytest.raises(ProbeError, match="probe.min_symbols: got 0"):
    probes.Copy(min_symbols=0)


@pytest.mark.parametrize("length", [14, 20, 64])
def test_mqar_values_follow_their_keys(length):
  spec = probes.MQAR(pairs=4, queries=3, keys=6, values=5)
  for index in range(6):
    row = probes.example(spec, length, seed=1, index=index)
    targets, weights = list(row["targets"]), row["loss_weights"]
    pairs = dict(zip(targets[0:8:2], targets[1:8:2]))
    assert len(pairs) == 4  # distinct keys
    assert all(FIRST_SYMBOL <= k < FIRST_SYMBOL + 6 for k in pairs)
    assert all(FIRST_SYMBOL + 6 <= v < FIRST_SYMBOL + 11 for v in pairs.values())
    answers = list(np.flatnonzero(weights))
    assert len(answers) == 3 and set(weights) <= {0.0, 1.0}
    assert len({targets[a - 1] for a in answers}) == 3  # distinct queried keys
    for a in answers:
      assert pairs[targets[a - 1]] == targets[a]
    queried = set(answers) | {a - 1 for a in answers}
    assert all(targets[t] == FILLER for t in range(8, length) if t not in queried)


@pytest.mark.parametrize("length", [13, 40, 97])
def test_passkey_at_the_asked_depth(length):
  spec = probes.Passkey(digits=3, filler_words=4, depth_bins=4)
  filler = length - 8
  for depth in (0.0, 0.3, 0.5, 1.0):
    targets = probes.example(spec, length, seed=2, index=7, depth=depth)["targets"]
    before = round(depth * filler)
    assert targets[before] == KEY_MARKER
    assert targets[-4] == SEPARATOR
    key = list(targets[before + 1:before + 4])
    assert list(targets[-3:]) == key and all(FIRST_SYMBOL <= d < FIRST_SYMBOL + 10 for d in key)
    words = [t for i, t in enumerate(targets[:-4]) if not before <= i < before + 4]
    assert words == [FIRST_SYMBOL + 10 + i % 4 for i in range(filler)]
    assert spec.depths(targets[None])[0] == pytest.approx(before / filler)
  batch = next(probes.batches(spec, length, 8, seed=2))
  np.testing.assert_array_equal(batch["loss_weights"], np.tile([0.0] * (length - 3) + [1.0] * 3,
                                                                (8, 1)))
  bins = spec.depth_bin(spec.depths(batch["targets"]))
  if filler >= 4 * 4:  # every bin holds a filler position: example i falls in bin i % 4
    np.testing.assert_array_equal(bins, np.arange(8) % 4)
  assert spec.bin_names() == ["0.0-0.25", "0.25-0.5", "0.5-0.75", "0.75-1.0"]


def test_descriptions_round_trip_through_json():
  import json  # noqa: PLC0415

  for name in NAMES:
    spec = probes.probe(name, {"alphabet": 7} if name in ("copy", "reverse") else None)
    text = json.dumps(probes.describe(spec))
    assert probes.probe(json.loads(text)) == spec
  assert probes.describe(probes.probe("reverse")) == {"name": "copy", "alphabet": 32,
                                                      "reverse": True, "min_symbols": None}
  assert probes.probe({"name": "mqar", "pairs": 2}, {"queries": 1}) == probes.MQAR(2, 1)


def test_weighted_objective_equals_float64_cross_entropy():
  model, params = init_lm({"name": "alibi"}, vocab_size=40, max_len=24)
  batch = next(probes.batches(probes.probe("copy"), 21, 3, seed=0))
  batch["loss_weights"][0, -5:] = 0.0  # some answer tokens left out
  loss, sums = lm_objective(model, params, batch, None)
  logits = np.asarray(model.apply({"params": params}, shift_right(batch["targets"])),
                      np.float64)
  logp = logits - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1,
                                keepdims=True)) - logits.max(-1, keepdims=True)
  nll = -np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
  w = batch["loss_weights"].astype(np.float64)
  np.testing.assert_allclose(float(loss), np.sum(nll * w), rtol=1e-5)
  assert float(sums["weight"]) == np.sum(w) == 3 * 10 - 5
  right = np.argmax(logits, -1) == batch["targets"]
  assert float(sums["correct"]) == np.sum(right * w)
  # Without loss_weights, every non-padding token counts.
  _, plain = lm_objective(model, params, {"targets": batch["targets"]}, None)
  assert float(plain["weight"]) == np.sum(batch["targets"] > 0) == 3 * 21  # no padding


class _Oracle:
  """A stand-in causal LM whose argmax is ``answer(ids)`` ``[B, L]`` (from the inputs
  ``ids = shift_right(targets)`` only: it cannot see what it predicts)."""

  def __init__(self, answer):
    self.answer = answer

  def apply(self, variables, ids, deterministic=True, position_ids=None):
    del variables, deterministic
    if position_ids is None:
      return jax.nn.one_hot(self.answer(ids), 64)
    return jax.nn.one_hot(self.answer(ids, position_ids), 64)


def test_score_counts_whole_answers_and_depth_bins():
  length, n = 21, 10

  def copy(ids, wrong_last=False):  # target t = target t - n - 1 = input t - n
    out = jnp.roll(ids, -n, axis=1) * 0 + jnp.pad(ids, [(0, 0), (n, 0)])[:, :length]
    return out.at[:, -1].set(0) if wrong_last else out

  right = probes.score(_Oracle(copy), {}, "copy", length, examples=10, seed=0, batch_size=4)
  assert (right["accuracy"], right["token_accuracy"], right["examples"]) == (1.0, 1.0, 10)
  assert right["probe"] == probes.describe(probes.Copy()) and right["length"] == length
  longest = probes.score(_Oracle(copy), {}, probes.Copy(min_symbols=1), length, examples=10,
                         seed=0, batch_size=4)  # scored at the longest instance, n = 10
  assert longest == right
  wrong = probes.score(_Oracle(lambda ids: copy(ids, True)), {}, "copy", length, examples=6,
                       seed=0, batch_size=4)
  assert wrong["accuracy"] == 0.0 and wrong["token_accuracy"] == pytest.approx((n - 1) / n)

  spec = probes.Passkey(digits=3)
  length = 48
  filler = length - 8

  def passkey(ids):  # the digits after the key marker (at input k + 1 .. k + 3), for depth >= 0.4
    k = jnp.argmax(ids == KEY_MARKER, axis=1)
    src = jnp.clip(k[:, None] + 1 + jnp.arange(length) - (length - 3), 0, length - 1)
    deep = (k - 1) / filler >= 0.4
    return jnp.where(deep[:, None], jnp.take_along_axis(ids, src, 1), 0)

  result = probes.score(_Oracle(passkey), {}, spec, length, examples=20, seed=5, batch_size=8)
  assert result["by_depth"] == {"0.0-0.2": 0.0, "0.2-0.4": 0.0, "0.4-0.6": 1.0,
                                "0.6-0.8": 1.0, "0.8-1.0": 1.0}
  assert result["accuracy"] == 0.6


def test_a_model_trained_on_randomized_positions_is_scored_at_its_own_draws():
  """Example i reads the ordered subset of [0, N) drawn for evaluation row i, whatever the
  batch size (Ruoss et al.'s reference code draws them in every forward pass)."""
  from posenc_jax.data import randomized_positions as randomized  # noqa: PLC0415

  length, n, big = 21, 10, 64
  seen = []

  def copy_where_drawn(ids, position_ids):  # copies, and records the ids it was given
    jax.debug.callback(lambda drawn: seen.append(np.asarray(drawn)), position_ids)
    return jnp.pad(ids, [(0, 0), (n, 0)])[:, :length]

  right = probes.score(_Oracle(copy_where_drawn), {}, "copy", length, examples=5, seed=3,
                       batch_size=2, randomized_positions=big)
  assert (right["accuracy"], right["positions"]) == (1.0, "randomized")
  drawn = np.concatenate(seen)[:5]  # the last batch is padded to 2 rows
  expected = randomized.randomized_position_ids((5, length), big, 3, randomized.EVAL, 0)
  np.testing.assert_array_equal(drawn, expected)
  assert np.all(np.diff(drawn, axis=1) > 0) and drawn.max() < big
  assert not np.array_equal(drawn[:, :length], np.broadcast_to(np.arange(length), drawn.shape))
  seen.clear()
  probes.score(_Oracle(copy_where_drawn), {}, "copy", length, examples=5, seed=3,
               batch_size=5, randomized_positions=big)
  np.testing.assert_array_equal(seen[0], expected)
  plain = probes.score(_Oracle(lambda ids: jnp.pad(ids, [(0, 0), (n, 0)])[:, :length]), {},
                       "copy", length, examples=5, seed=3, batch_size=2)
  assert plain["positions"] == "plain"
  with pytest.raises(ProbeError, match=r"^randomized_positions: got 20; allowed: None or an "
                     r"integer >= length=21"):
    probes.score(_Oracle(copy_where_drawn), {}, "copy", length, examples=1, seed=0,
                 batch_size=1, randomized_positions=20)


def _config(name, **probe):
  from posenc_jax.configs.probe import get_config  # noqa: PLC0415

  config = get_config(f"bert_tiny,alibi,{name}")
  config.model.update(dict(d_model=32, mlp_dim=64, num_layers=1, max_len=64))
  config.update(dict(seq_len=24, batch_size=8, total_steps=20, log_every=10, eval_every=20,
                     eval_steps=2, checkpoint_every=20, compilation_cache_dir=""))
  config.probe.update(probe)
  return config


def test_config_and_make_batches_resume_by_step():
  from posenc_jax.training.input_pipeline import check_data_config, make_batches  # noqa: PLC0415

  config = _config("mqar", pairs=3, queries=2)
  assert config.task == "probe:mqar" and config.objective == "lm"
  assert probes.config_probe(config) == probes.MQAR(pairs=3, queries=2)
  check_data_config(config)
  run = _take(make_batches(config, "train", 0), 5)
  resumed = next(make_batches(config, "train", 4))
  np.testing.assert_array_equal(resumed["targets"], run[4]["targets"])
  evals = [list(make_batches(config, "validation", 0)) for _ in range(2)]
  assert len(evals[0]) == 2
  np.testing.assert_array_equal(evals[0][1]["targets"], evals[1][1]["targets"])
  assert not np.array_equal(evals[0][0]["targets"], run[0]["targets"])
  assert _config("reverse").probe.reverse is True
  parsed = _parsed("configs/probe.py:bert_tiny,rope,mqar", "--config.probe.pairs=4",
                   "--config.probe.queries=2")
  assert probes.config_probe(parsed) == probes.MQAR(pairs=4, queries=2)
  assert parsed.model.scheme.name == "rope" and parsed.task == "probe:mqar"


def test_a_probe_trains_and_scores_at_twice_its_length(tmp_path):
  from posenc_jax.models.build import build_model  # noqa: PLC0415
  from posenc_jax.training.loop import train  # noqa: PLC0415

  config = _config("copy", alphabet=8)
  config.optimizer.update(dict(learning_rate=1e-2, warmup_steps=2))
  result = train(config, str(tmp_path / "run"))
  first, last = result["history"][0], result["history"][-1]
  assert last["step"] == 20 and last["loss"] < first["loss"] - 1.0, (first, last)
  assert 0 <= last["eval_accuracy"] <= 1
  model = build_model(config.model, "lm")
  scored = probes.score(model, result["state"].params, probes.config_probe(config), 48,
                        examples=6, seed=9, batch_size=4)
  assert scored["examples"] == 6 and scored["length"] == 48
  assert 0 <= scored["accuracy"] <= scored["token_accuracy"] <= 1


# Runs a module as its command line, then says whether TensorFlow was imported.
_RUN_MODULE = ("import runpy, sys\n"
               "sys.argv = sys.argv[1:]\n"
               "try:\n"
               "  runpy.run_module(sys.argv[0], run_name='__main__')\n"
               "finally:\n"
               "  print('tensorflow imported:', 'tensorflow' in sys.modules)\n")


def test_train_and_evaluate_of_a_probe_never_import_tensorflow(tmp_path):
  """A probe's batches are numpy: its commands skip TensorFlow's seconds of start-up."""
  root, workdir = pathlib.Path(__file__).resolve().parents[1], str(tmp_path / "run")
  commands = [["posenc_jax.train", "--config=configs/probe.py:bert_tiny,none,copy",
               f"--workdir={workdir}", "--config.total_steps=2", "--config.seq_len=21",
               "--config.optimizer.warmup_steps=0", "--config.eval_every=2",
               "--config.checkpoint_every=2"],
              ["posenc_jax.evaluate", f"--workdir={workdir}", "--protocol=probes",
               "--lengths=21", "--examples=4"]]
  for command in commands:
    proc = subprocess.run([sys.executable, "-c", _RUN_MODULE, *command], cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "tensorflow imported: False" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.parametrize("make, message", [
    (lambda: probes.probe("cpy"), "probe: got 'cpy'; did you mean 'copy'?;"),
    (lambda: probes.probe("mqar", {"pair": 3}), "probe.pair: not a parameter of probe 'mqar'"),
    (lambda: probes.probe("mqar", {"pairs": 0}), "probe.pairs: got 0; allowed: a positive"),
    (lambda: probes.MQAR(pairs=4, queries=5), "probe.queries: got 5; allowed: at most pairs=4"),
    (lambda: probes.MQAR(pairs=9, keys=8), "probe.pairs: got 9; allowed: at most keys=8"),
    (lambda: probes.Copy(reverse=1), "probe.reverse: got 1"),
    (lambda: probes.example(probes.MQAR(), 31, 0, 0), "length: got 31; allowed: an integer >= 32"),
    (lambda: probes.example(probes.Copy(), 20, 0, 0, depth=0.5), "depth: got 0.5"),
    (lambda: probes.score(None, {}, "copy", 2, examples=1, seed=0, batch_size=1), "length: got 2"),
    (lambda: probes.score(None, {}, "copy", 8, examples=0, seed=0, batch_size=1),
     "examples: got 0"),
])
def test_bad_values_are_one_line(make, message):
  with pytest.raises(ProbeError) as info:
    make()
  assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("field, value, message", [
    ("task", "probe:cpy", "task: got 'probe:cpy'; did you mean 'probe:copy'?;"),
    ("seq_len", 9, "seq_len: got 9; allowed: an integer >= 13"),
    ("objective", "mlm", "objective: got 'mlm'; allowed: 'lm'"),
    ("probe", ml_collections.ConfigDict({"digits": -1}), "probe.digits: got -1"),
    ("model", None, "model.vocab_size: 12 is smaller than task 'probe:passkey'"),
])
def test_bad_probe_configs_are_one_line(field, value, message):
  from posenc_jax.training.config import TrainConfigError  # noqa: PLC0415
  from posenc_jax.training.input_pipeline import check_data_config  # noqa: PLC0415

  config = _config("passkey")
  if field == "model":
    config.model.vocab_size = 12
  else:
    config[field] = value
  with pytest.raises(TrainConfigError) as info:
    check_data_config(config)
  assert message in str(info.value) and "\n" not in str(info.value)
