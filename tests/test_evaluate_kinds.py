"""Every evaluation protocol on every kind of run: a document where the protocol scores that
kind (:data:`~posenc_jax.evaluation.protocols.RUN_KINDS`), else one line naming the protocol,
what it scores, the run's kind and the protocols that do score it (before anything is read
or written)."""

import json
import os

import jax
import numpy as np
import pytest
from etils import epath
from flax import linen as nn

from tests.conftest import require

seqio = require("seqio")
tf = require("tensorflow")

from posenc_jax.evaluation import EvaluationError, evaluate_workdir  # noqa: E402
from posenc_jax.evaluation.protocols import PROTOCOLS, RUN_KINDS, run_kind  # noqa: E402
from posenc_jax.models.build import build_model, init_inputs  # noqa: E402
from posenc_jax.training.checkpoint import Checkpointer  # noqa: E402
from posenc_jax.training.workdir import resolved_config  # noqa: E402

L = 16
TINY = dict(d_model=32, num_layers=1, num_heads=2, mlp_dim=64, max_len=L)
KINDS = ("mlm", "lm", "probe", "classification", "translation")
# What a scored kind is run with here (small: one compile each).
OPTIONS = {"loss": dict(eval_steps=1), "extrapolation": dict(lengths=[L], tokens=64),
           "probes": dict(lengths=[L], examples=2), "indicators": dict(examples=4)}


@pytest.fixture(scope="module")
def translation_task(tmp_path_factory):
  """A translation task over a local tsv file (12 pairs in train and validation)."""
  from posenc_jax.data import tasks, vocab  # noqa: PLC0415

  path = tmp_path_factory.mktemp("tsv") / "pairs.tsv"
  words = "the cat sat on a mat while dogs ran far away".split()
  rng = np.random.default_rng(0)
  path.write_text("".join(f"{' '.join(rng.choice(words, 3))}\t{' '.join(rng.choice(words, 4))}\n"
                          for _ in range(12)))
  feature = seqio.Feature(vocab.vocabulary(), add_eos=True, dtype=tf.int32)

  def pairs(ds):
    def split(line):
      parts = tf.strings.split(line, "\t")
      return {"inputs": parts[0], "targets": parts[1]}
    return ds.map(split)

  name = "kinds_test_translation"
  seqio.TaskRegistry.remove(name)
  tasks.register(name, source=seqio.TextLineDataSource({"train": str(path),
                                                        "validation": str(path)}),
                 preprocessors=[pairs, seqio.preprocessors.tokenize,
                                seqio.preprocessors.append_eos_after_trim],
                 output_features={"inputs": feature, "targets": feature}, shuffle_buffer_size=4)
  return name


def _config(kind: str, translation_task: str):
  from posenc_jax.configs import (finetune_wordnet, lm, pretrain, probe,  # noqa: PLC0415
                                  translate)

  config = {"mlm": lambda: pretrain.get_config("bert_tiny,rope"),
            "lm": lambda: lm.get_config("bert_tiny,rope"),
            "probe": lambda: probe.get_config("bert_tiny,rope,copy"),
            "classification": lambda: finetune_wordnet.get_config("wordnet_order"),
            "translation": lambda: translate.get_config("transformer_base,rope")}[kind]()
  config.model.update(TINY)
  config.batch_size, config.eval_steps = 4, 1
  if kind == "translation":
    config.update(dict(task=translation_task, input_len=L, target_len=L))
  else:
    config.seq_len = L
  if kind == "probe":
    config.probe.alphabet = 8
  return config


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory, translation_task):
  """A workdir of each kind: fresh parameters saved at step 3."""
  out = {}
  for kind in KINDS:
    config = _config(kind, translation_task)
    assert run_kind(config) == kind
    model = build_model(config.model, config.head, num_labels=config.get("num_labels", 2))
    params = nn.unbox(jax.jit(model.init)(jax.random.key(1), *init_inputs(model)))["params"]
    path = epath.Path(tmp_path_factory.mktemp(kind))
    (path / "config.json").write_text(json.dumps(resolved_config(config)))
    checkpointer = Checkpointer(os.fspath(path), save_interval_steps=1, async_save=False)
    checkpointer.save(3, {"params": params}, {"step": 3}, force=True)
    checkpointer.close()
    out[kind] = str(path)
  return out


def test_every_protocol_names_the_kinds_it_scores():
  assert set(RUN_KINDS) == set(PROTOCOLS)
  assert all(set(kinds) <= {*KINDS, "regression", "span"} for kinds in RUN_KINDS.values())
  assert all(any(kind in kinds for kinds in RUN_KINDS.values()) for kind in KINDS)


# Scored here: the pairs test_evaluate.py does not score (it runs the others).
SCORED = [("loss", "probe"), ("loss", "translation"), ("indicators", "classification")]
REFUSED = [(p, k) for p in PROTOCOLS for k in KINDS if k not in RUN_KINDS[p]]


@pytest.mark.parametrize("protocol, kind", SCORED)
def test_a_protocol_scores_the_kinds_it_names(workdirs, protocol, kind, tmp_path):
  assert kind in RUN_KINDS[protocol]
  out = tmp_path / "eval"
  doc = evaluate_workdir(workdirs[kind], protocol, out=str(out), **OPTIONS[protocol])
  assert doc["protocol"] == protocol and doc["step"] == 3
  assert [p.name.split("-")[0] for p in out.iterdir()] == [protocol]


@pytest.mark.parametrize("protocol, kind", REFUSED)
def test_a_protocol_refuses_another_kind_in_one_line(workdirs, protocol, kind, tmp_path):
  out = tmp_path / "eval"
  with pytest.raises(EvaluationError) as raised:
    evaluate_workdir(workdirs[kind], protocol, out=str(out), **OPTIONS[protocol])
  line = str(raised.value)
  assert "\n" not in line and line.startswith(f"protocol: {protocol!r} scores "), line
  assert f"{workdirs[kind]} is a " in line
  scoring = [p for p, kinds in RUN_KINDS.items() if kind in kinds]
  assert line.endswith(f"which {', '.join(map(repr, scoring))} scores"), line
  assert not out.exists()
