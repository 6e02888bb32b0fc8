"""Synthetic probes of position: a causal LM trained on copy, reverse, MQAR or passkey.

  python train.py --config=configs/probe.py --workdir=/tmp/probe_copy
  python train.py --config=configs/probe.py:bert_tiny,rope,mqar --workdir=/tmp/probe_mqar \\
      --config.probe.pairs=4 --config.probe.queries=4

The argument is ``<size>[,<scheme>...][,<probe>]`` (sizes and schemes as in
``configs/lm.py``; the probe one of ``copy``, ``reverse``, ``mqar``, ``passkey``, default
``copy``; a name that is neither is one line listing the probes and the presets). It sets
``task = "probe:<name>"`` and ``probe``, the probe's parameters
(:mod:`posenc_jax.data.probes`: ``alphabet``, ``reverse``, ``min_symbols``; ``pairs``, ``queries``, ``keys``,
``values``; ``digits``, ``filler_words``, ``depth_bins``), each overridable with
``--config.probe.<parameter>=...``. The default trains a ``bert_tiny``-sized RoPE model
(vocabulary 128) on copy at ``seq_len`` 32 for 1000 steps of 32 examples, with
``configs/lm.py``'s optimizer, in about two minutes on 2 CPU cores: it leaves its loss
plateau (chance, log 32) after 250-450 steps and then copies every held-out example (at
32; not at 64). ALiBi's two heads stay near chance there (1500 steps post-LN, 1000
pre-LN, measured). Evaluation
reports the answer tokens' accuracy on held-out examples at ``seq_len``;
``python -m posenc_jax.evaluate --workdir=... --protocol=probes --lengths=32,64,128`` (or
``posenc_jax.data.probes.score``) scores a trained model at other lengths.
"""

import ml_collections

from posenc_jax.configs.lm import CORPORA
from posenc_jax.configs.lm import get_config as lm_config
from posenc_jax.data.probes import PROBES, TASK_PREFIX, describe, probe
from posenc_jax.messages import nearest
from posenc_jax.models.config import ModelConfigError
from posenc_jax.presets import SCHEME_PRESETS

SETTINGS = dict(total_steps=1000, batch_size=32, seq_len=32, log_every=50, eval_every=100,
                eval_steps=4, checkpoint_every=200)


def check_names(names: list[str]) -> None:
  """Raises one :class:`ModelConfigError` line for a name after the size that is neither a
  probe nor a scheme preset (nor a corpus, which ``configs/lm.py`` takes), naming both the
  probes and the schemes allowed."""
  for name in names[1:]:
    if name not in PROBES and name not in SCHEME_PRESETS and name not in CORPORA:
      raise ModelConfigError(
          f"config preset: {name!r} is unknown{nearest(name, [*PROBES, *SCHEME_PRESETS])} "
          f"allowed: a probe ({', '.join(PROBES)}) or a scheme or modifier preset "
          f"({', '.join(SCHEME_PRESETS)})")


def get_config(arg="bert_tiny,rope,copy"):
  names = [n.strip() for n in arg.split(",")]
  check_names(names)
  chosen = [n for n in names if n in PROBES] or ["copy"]
  config = lm_config(",".join(n for n in names if n not in PROBES))
  config.task = TASK_PREFIX + chosen[-1]
  params = describe(probe(chosen[-1]))
  del params["name"]
  # An unset optional parameter (copy's min_symbols) is a typed placeholder, so that
  # --config.probe.<parameter>=N parses; the probes' optional parameters are integers.
  config.probe = ml_collections.ConfigDict(
      {k: ml_collections.config_dict.placeholder(int) if v is None else v
       for k, v in params.items()})
  config.update(SETTINGS)
  config.model.vocab_size = 128  # the probes' ids are far fewer; a small softmax is faster
  return config
