"""The seqio task registry: importing this module registers every task of posenc_jax.

Configs name tasks; the trainer imports this module and asks seqio for them::

    import seqio
    import posenc_jax.tasks  # noqa: F401 (needs the ``data`` extra)
    seqio.get_mixture_or_task("glue_rte")

Families (one module each in :mod:`posenc_jax.data`): ``tasks`` (the bundled
``wordnet_glosses`` corpus), ``causal_lm`` (``wordnet_glosses_lm``, the same text for
causal LM), ``wordnet_tasks`` (``wordnet_supersense``, ``wordnet_hypernym``),
``pretraining`` (``wikipedia_en``, ``c4_en``, ``wiki40b_<lang>``), ``glue`` (GLUE and
XNLI), ``xtreme_qa`` (SQuAD v1.1, XQuAD, MLQA, TyDiQA-GoldP), ``wmt`` (WMT18).
"""

import seqio

from posenc_jax.data import (causal_lm, glue, pretraining, tasks, wmt,  # noqa: F401
                             wordnet_tasks, xtreme_qa)


def register_wordpiece(vocab: str) -> str:
  """Registers the fine-tuning tasks (GLUE, XNLI, the WordNet tasks) again over a WordPiece
  vocabulary and returns their name suffix (``glue_rte`` -> ``glue_rte<suffix>``).

  Args:
    vocab: a BERT ``vocab.txt``, or a Hugging Face folder holding one (its
      ``tokenizer_config.json`` says whether to lower-case).

  The suffix, ``_wp_<8 hex digits>``, is a digest of the vocabulary's tokens and casing, so
  the same vocabulary gets the same task names in every run (a resumed run finds its tasks).
  """
  import hashlib  # noqa: PLC0415
  import pathlib  # noqa: PLC0415

  from posenc_jax.data import wordpiece  # noqa: PLC0415

  path = pathlib.Path(vocab)
  vocabulary = (wordpiece.from_hf_checkpoint(path) if path.is_dir()
                else wordpiece.WordPieceVocabulary(path))
  digest = hashlib.md5(("\n".join(vocabulary.tokens) + f"\n{vocabulary.lower_case}").encode())
  suffix = f"_wp_{digest.hexdigest()[:8]}"
  if f"wordnet_supersense{suffix}" not in seqio.TaskRegistry.names():
    glue.register_classification_tasks(vocabulary, suffix)
    wordnet_tasks.register_wordnet_tasks(vocabulary, suffix)
  return suffix
