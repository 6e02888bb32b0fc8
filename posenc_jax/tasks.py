"""The seqio task registry: importing this module registers every task of posenc_jax.

Configs name tasks; the trainer imports this module and asks seqio for them::

    import seqio
    import posenc_jax.tasks  # noqa: F401 (needs the ``data`` extra)
    seqio.get_mixture_or_task("glue_rte")

Families (one module each in :mod:`posenc_jax.data`): ``tasks`` (the bundled
``wordnet_glosses`` corpus), ``wordnet_tasks`` (``wordnet_supersense``,
``wordnet_hypernym``), ``pretraining`` (``wikipedia_en``, ``c4_en``,
``wiki40b_<lang>``), ``glue`` (GLUE and XNLI), ``xtreme_qa`` (SQuAD v1.1,
XQuAD, MLQA, TyDiQA-GoldP), ``wmt`` (WMT18).
"""

from posenc_jax.data import glue, pretraining, tasks, wmt, wordnet_tasks, xtreme_qa  # noqa: F401
