"""Causal language modelling: a decoder-only Transformer trained on next-token prediction.

  python train.py --config=configs/lm.py --workdir=/tmp/posenc_lm
  python train.py --config=configs/lm.py:bert_tiny,rope --workdir=/tmp/posenc_lm_rope

The argument is ``<size>[,<scheme>...][,<corpus>]`` (sizes and schemes as in
``configs/model.py``; a size's ``num_layers`` are the model's layers, and the encoder-decoder
sizes, which have ``num_decoder_layers``, do not apply). The scheme runs in its causal form
(T5 unidirectional, ALiBi causal, the others as they are). The default is the bundled demo:
a ``bert_tiny``-sized ALiBi model on the WordNet glosses (task ``wordnet_glosses_lm``, the MLM
demo's text and SentencePiece vocabulary), with the MLM demo's schedule; minutes on a laptop
CPU. The corpus ``stdlib`` trains on the bundled long documents instead (task
``python_stdlib_lm``: the Python standard library's source, one token per byte, with the
model's ``vocab_size`` set to the 259 byte ids; :mod:`posenc_jax.data.stdlib_corpus`), e.g.
``configs/lm.py:bert_tiny,rope,stdlib``; ``pg19`` and ``c4`` name the same experiment at
scale (tasks ``pg19_lm``, ``c4_en_lm``: TFDS corpora in bytes, prepared first). A preset that
sets a segment scheme (``segment_per_head``) is refused: the language model has none.
``posenc_jax.models.generate`` continues prompts with a trained model.
"""

from posenc_jax.configs.pretrain import LM_DEMO
from posenc_jax.data import stdlib_corpus
from posenc_jax.models.config import ModelConfigError
from posenc_jax.presets import SCHEME_PRESETS, preset_config
from posenc_jax.training.config import base_train_config


# Corpora by name: the task and the vocabulary size the model needs for it (all in bytes).
CORPORA = {"stdlib": dict(task=stdlib_corpus.TASK, vocab_size=stdlib_corpus.VOCAB_SIZE),
           "pg19": dict(task="pg19_lm", vocab_size=stdlib_corpus.VOCAB_SIZE),
           "c4": dict(task="c4_en_lm", vocab_size=stdlib_corpus.VOCAB_SIZE)}


def get_config(arg="bert_tiny,alibi"):
  names = [n.strip() for n in arg.split(",")]
  corpus = CORPORA.get(names[-1]) if len(names) > 1 else None
  arg = ",".join(names[:-1] if corpus else names)
  for name in arg.split(",")[1:]:
    if SCHEME_PRESETS.get(name.strip(), {}).get("segment"):
      raise ModelConfigError(f"config preset: {name.strip()!r} sets model.segment, but the "
                             "language model reads one text stream (no token types, no "
                             "segment scheme); drop it")
  config = base_train_config()
  config.update(preset_config(arg))
  config.objective = "lm"
  config.head = "lm"
  config.task = "wordnet_glosses_lm"
  for key, value in LM_DEMO.items():
    if key == "optimizer":
      config.optimizer.update(value)
    else:
      config[key] = value
  if corpus:
    config.task = corpus["task"]
    config.model.vocab_size = corpus["vocab_size"]
  config.model.segment = None  # one text stream, no token types
  config.model.pooler = False
  config.model.dropout_rate = 0.0
  config.model.attention_dropout_rate = 0.0
  return config
