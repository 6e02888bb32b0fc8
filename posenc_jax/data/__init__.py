"""Data: the bundled WordNet corpus, SentencePiece vocabularies, seqio tasks, MLM and
causal-LM pipelines.

Needs the ``data`` extra (seqio, TensorFlow, tensorflow-text, sentencepiece). Importing this
package imports nothing heavy, and ``import posenc_jax`` never imports it; the submodules
load TensorFlow/seqio when they are imported (``tasks``, ``preprocessors``) or called
(``vocab``):

    vocab           reserved ids (pad 0, eos 1, unk 2, [CLS] 3, [SEP] 4, [MASK] 5),
                    ``train(lines, ...)``, ``vocabulary(path)`` (the trainer's command line,
                    which reads registered tasks too: ``python -m posenc_jax.train_vocab``)
    tasks           ``register`` helpers and the ``wordnet_glosses`` corpus task
    wordnet_tasks   ``wordnet_supersense``, ``wordnet_hypernym`` (held-out synsets)
    pretraining     ``wikipedia_en``, ``c4_en``, ``wiki40b_<lang>``
    glue            GLUE and XNLI tasks, ``encode_classification`` (BERT inputs)
    xtreme_qa       SQuAD v1.1, XQuAD, MLQA, TyDiQA-GoldP span tasks
    qa              span features (document stride) and answers from logits
    wmt             WMT18 translation tasks
    metrics         GLUE/BLEU metrics as the papers report them (0-100)
    squad_metrics   SQuAD F1/EM and MLQA's per-language variant
    wordpiece       BERT ``vocab.txt`` as a seqio Vocabulary
    preprocessors   full-sentence packing, BERT masking, ``mlm_dataset`` for the trainer
    causal_lm       ``wordnet_glosses_lm`` (packed ``targets``), ``lm_dataset`` for the trainer
    probes          synthetic probes generated on the fly (copy/reverse, MQAR, passkey),
                    task ``probe:<name>`` for the trainer, ``score`` per length
    randomized_positions  training position ids as sorted random subsets of ``[0, N)``
                    (Ruoss et al., 2023), counter-based in seed, step and row (numpy only)
    bundled/        the corpus files, their licence and the bundled vocabulary

``import posenc_jax.tasks`` registers every family.
"""

# Sequences per shuffled block of the pre-training pipelines (``preprocessors.mlm_dataset``,
# ``causal_lm.lm_dataset``): their default, and the host buffer the trainer's memory
# estimate counts (:func:`posenc_jax.training.memory.input_buffers`).
SHUFFLE_BLOCK = 16_384
