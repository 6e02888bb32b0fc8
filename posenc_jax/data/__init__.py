"""Data: the bundled WordNet corpus, SentencePiece vocabularies, seqio tasks, MLM pipeline.

Needs the ``data`` extra (seqio, TensorFlow, tensorflow-text, sentencepiece). Importing this
package imports nothing heavy, and ``import posenc_jax`` never imports it; the submodules
load TensorFlow/seqio when they are imported (``tasks``, ``preprocessors``) or called
(``vocab``):

    vocab           reserved ids (pad 0, eos 1, unk 2, [CLS] 3, [SEP] 4, [MASK] 5), the
                    vocabulary trainer ``python -m posenc_jax.data.vocab``, ``vocabulary(path)``
    tasks           seqio task registrations (``wordnet_glosses``); importing registers them
    preprocessors   full-sentence packing, BERT masking, ``mlm_dataset`` for the trainer
    bundled/        the corpus files, their licence and the bundled vocabulary
"""
