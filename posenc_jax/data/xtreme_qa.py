"""XTREME question answering as seqio tasks: SQuAD v1.1 to train, XQuAD, MLQA, TyDiQA-GoldP.

Importing this module registers (again: no error) these tasks, all from TFDS 4.9.10
builders (``tfds_name`` below; each yields ``id``, ``title``, ``context``, ``question``,
``answers: {text, answer_start}``):

    task                    TFDS                   splits (task: TFDS)                 metric
    squad_v1                squad/v1.1:3.0.0       train, validation                   SQuAD
    xquad_<lang>            xquad/<lang>:3.0.0     test                                SQuAD
    mlqa_<lang>             mlqa/<lang>:1.0.0      validation, test                    MLQA <lang>
    tydiqa_goldp_<lang>     tydi_qa/goldp:3.0.0    validation: validation-<lang>       SQuAD
    tydiqa_goldp            tydi_qa/goldp:3.0.0    train, validation (all languages)   SQuAD

    xquad_<lang>          ar de el en es hi ru th tr vi zh   (11; the XQuAD test set)
    mlqa_<lang>           ar de en es hi vi zh               (7; context and question in the
                                                              same language, XTREME's setting)
    tydiqa_goldp_<lang>   ar bn en fi id ko ru sw te         (9)

XTREME's zero-shot protocol trains on ``squad_v1`` ``train`` and evaluates on the others.
The metric is SQuAD v1.1's exact match and F1 except for MLQA, which uses MLQA's own
per-language normalisation (``squad_metrics`` has the rules).

Every example becomes one or more span features (``qa.featurize``: windows with a document
stride), so ``get_dataset`` yields features, not examples::

    import seqio
    from posenc_jax.data import xtreme_qa  # registers
    ds = seqio.get_mixture_or_task("xquad_de").get_dataset(
        {"input_ids": 384}, split="test", shuffle=False)

Each element (``L`` = ``sequence_length["input_ids"]``):

    input_ids, segment_ids, mask   int32 [L]   [CLS] question [SEP] window [SEP] (``qa``)
    start_positions, end_positions int32 []    answer tokens in this window, else 0 ([CLS])
    example_index                  int32 []    the example's position in the split's stream
                                               (source order with ``shuffle=False``)
    token_offsets                  int32 [L, 2] context character offsets, -1 elsewhere
    max_context                    int32 [L]
    example_id, context            string []   for post-processing

The first six are the task's ``output_features``; the last four are the bookkeeping
``predict_answers`` needs and pass through seqio unchanged. Evaluation::

    features, start, end = ...        # all features of the split and the model's logits
    predictions = predict_answers(features, start, end)     # {id: answer text}
    metrics = evaluate("xquad_de", "test", predictions)     # {"exact_match", "f1"}

``doc_stride`` 128 and ``max_query_len`` 64 (XTREME's values) are fixed at registration;
``register_qa_task`` registers variants with others, or with another tokenizer.
"""

import functools
from collections.abc import Mapping, Sequence

import numpy as np
import seqio
import tensorflow as tf

from posenc_jax.data import qa
from posenc_jax.data import squad_metrics
from posenc_jax.data import vocab as vocab_lib
from posenc_jax.data.tasks import register

XQUAD_LANGUAGES = ("ar", "de", "el", "en", "es", "hi", "ru", "th", "tr", "vi", "zh")
MLQA_LANGUAGES = squad_metrics.MLQA_LANGUAGES
TYDIQA_LANGUAGES = ("ar", "bn", "en", "fi", "id", "ko", "ru", "sw", "te")
TFDS_SQUAD = "squad/v1.1:3.0.0"
TFDS_XQUAD = "xquad/{lang}:3.0.0"
TFDS_MLQA = "mlqa/{lang}:1.0.0"
TFDS_TYDIQA = "tydi_qa/goldp:3.0.0"

OUTPUT_KEYS = ("input_ids", "segment_ids", "mask", "start_positions", "end_positions",
               "example_index")
BOOKKEEPING_KEYS = ("token_offsets", "max_context", "example_id", "context")


def output_features(vocabulary: seqio.Vocabulary) -> dict[str, seqio.Feature]:
  """The six int32 features; ``input_ids`` carries ``vocabulary`` (no EOS)."""
  plain = seqio.PassThroughVocabulary(size=0)
  rank1 = dict(dtype=tf.int32, add_eos=False, rank=1)
  rank0 = dict(dtype=tf.int32, add_eos=False, rank=0)
  return {"input_ids": seqio.Feature(vocabulary, **rank1),
          "segment_ids": seqio.Feature(plain, **rank1),
          "mask": seqio.Feature(plain, **rank1),
          "start_positions": seqio.Feature(plain, **rank0),
          "end_positions": seqio.Feature(plain, **rank0),
          "example_index": seqio.Feature(plain, **rank0)}


def _tokenizer_for(vocabulary: seqio.Vocabulary) -> qa.Tokenizer:
  if isinstance(vocabulary, seqio.SentencePieceVocabulary):
    return qa.sentencepiece_tokenizer(vocabulary.sp_model)
  raise ValueError(f"no tokenizer with offsets for {type(vocabulary).__name__}; "
                   "pass tokenizer= to span_features")


def span_features(dataset: tf.data.Dataset, sequence_length: Mapping[str, int] | None,
                  output_features: Mapping[str, seqio.Feature], *,
                  tokenizer: qa.Tokenizer | None = None,
                  doc_stride: int = qa.DEFAULT_DOC_STRIDE,
                  max_query_len: int = qa.DEFAULT_MAX_QUERY_LEN) -> tf.data.Dataset:
  """seqio preprocessor: SQuAD-style examples -> span features (module docstring).

  Args:
    dataset: TFDS ``squadlike`` examples.
    sequence_length: must give ``input_ids``, the feature length ``L``.
    output_features: the task's; the tokenizer defaults to ``input_ids``' SentencePiece
      vocabulary.
    tokenizer: a ``qa.Tokenizer`` to use instead.
    doc_stride, max_query_len: as in ``qa.featurize``.
  """
  if not sequence_length or not sequence_length.get("input_ids"):
    raise ValueError("QA span features need sequence_length['input_ids'] (L)")
  length = int(sequence_length["input_ids"])
  if tokenizer is None:
    tokenizer = _tokenizer_for(output_features["input_ids"].vocabulary)
  settings = dict(max_seq_len=length, doc_stride=doc_stride, max_query_len=max_query_len)
  qa.featurize(tokenizer, "", "", **settings)   # fails here, not in tf.data, on bad settings

  def featurize(question, context, texts, starts):
    answers = [(t.decode("utf-8"), int(s)) for t, s in zip(texts, starts)]
    out = qa.featurize(tokenizer, question.decode("utf-8"), context.decode("utf-8"), answers,
                       **settings)
    return [out[k] for k in qa.FEATURE_KEYS]

  def to_windows(index, ex):
    arrays = tf.numpy_function(
        featurize, [ex["question"], ex["context"], ex["answers"]["text"],
                    ex["answers"]["answer_start"]],
        [tf.int32] * len(qa.FEATURE_KEYS), stateful=False)
    out = dict(zip(qa.FEATURE_KEYS, arrays))
    for key in ("input_ids", "segment_ids", "mask", "max_context"):
      out[key] = tf.ensure_shape(out[key], [None, length])
    out["token_offsets"] = tf.ensure_shape(out["token_offsets"], [None, length, 2])
    for key in ("start_positions", "end_positions"):
      out[key] = tf.ensure_shape(out[key], [None])
    n = tf.shape(out["input_ids"])[0]
    out["example_index"] = tf.fill([n], tf.cast(index, tf.int32))
    out["example_id"] = tf.fill([n], ex["id"])
    out["context"] = tf.fill([n], ex["context"])
    return out

  return dataset.enumerate().map(to_windows, num_parallel_calls=tf.data.AUTOTUNE,
                                 deterministic=True).unbatch()


def register_qa_task(name: str, tfds_name: str, splits: Sequence[str] | Mapping[str, str],
                     metric_fn, *, vocabulary: seqio.Vocabulary | None = None,
                     tokenizer: qa.Tokenizer | None = None,
                     doc_stride: int = qa.DEFAULT_DOC_STRIDE,
                     max_query_len: int = qa.DEFAULT_MAX_QUERY_LEN) -> seqio.Task:
  """Registers one span-QA task over a TFDS ``squadlike`` builder (no error if it exists).

  ``vocabulary`` defaults to the bundled ``spm8k``; ``tokenizer`` (with offsets) defaults to
  the vocabulary's SentencePiece model.
  """
  vocabulary = vocabulary or vocab_lib.vocabulary(vocab_lib.BUNDLED_VOCAB)
  return register(
      name,
      source=seqio.TfdsDataSource(tfds_name, splits=splits),
      preprocessors=[functools.partial(span_features, tokenizer=tokenizer,
                                       doc_stride=doc_stride, max_query_len=max_query_len)],
      output_features=output_features(vocabulary),
      metric_fns=[metric_fn],
      shuffle_buffer_size=10_000,
  )


def register_all() -> list[str]:
  """Registers the tasks of the module docstring; returns their names."""
  tasks = [("squad_v1", TFDS_SQUAD, ("train", "validation"), squad_metrics.squad)]
  tasks += [(f"xquad_{lang}", TFDS_XQUAD.format(lang=lang), ("test",), squad_metrics.squad)
            for lang in XQUAD_LANGUAGES]
  tasks += [(f"mlqa_{lang}", TFDS_MLQA.format(lang=lang), ("validation", "test"),
             functools.partial(squad_metrics.mlqa, lang=lang)) for lang in MLQA_LANGUAGES]
  tasks += [(f"tydiqa_goldp_{lang}", TFDS_TYDIQA, {"validation": f"validation-{lang}"},
             squad_metrics.squad) for lang in TYDIQA_LANGUAGES]
  tasks += [("tydiqa_goldp", TFDS_TYDIQA, ("train", "validation"), squad_metrics.squad)]
  vocabulary = vocab_lib.vocabulary(vocab_lib.BUNDLED_VOCAB)
  for name, tfds_name, splits, metric_fn in tasks:
    register_qa_task(name, tfds_name, splits, metric_fn, vocabulary=vocabulary)
  return [name for name, *_ in tasks]


TASK_NAMES = tuple(register_all())


# --------------------------------------------------------------------------------- evaluation

predict_answers = qa.predict_answers


def gold_answers(task_name: str, split: str) -> dict[str, list[str]]:
  """``{example id: gold answer texts}`` of a registered QA task's split (its raw source)."""
  task = seqio.get_mixture_or_task(task_name)
  golds = {}
  for ex in task.source.get_dataset(split=split, shuffle=False).as_numpy_iterator():
    golds[ex["id"].decode("utf-8")] = [t.decode("utf-8") for t in ex["answers"]["text"]]
  return golds


def evaluate(task_name: str, split: str, predictions: Mapping[str, str],
             golds: Mapping[str, Sequence[str]] | None = None) -> dict[str, float]:
  """The task's metric (``{"exact_match", "f1"}``, percent) of ``{id: text}`` predictions.

  ``golds`` defaults to ``gold_answers(task_name, split)``.
  """
  task = seqio.get_mixture_or_task(task_name)
  golds = gold_answers(task_name, split) if golds is None else golds
  metrics = {}
  for metric_fn in task.predict_metric_fns:
    metrics.update(metric_fn(golds, predictions))
  return metrics


def evaluate_logits(task_name: str, split: str, features: Mapping[str, np.ndarray],
                    start_logits: np.ndarray, end_logits: np.ndarray, **kwargs
                    ) -> dict[str, float]:
  """``evaluate`` of ``predict_answers(features, start_logits, end_logits, **kwargs)``."""
  return evaluate(task_name, split, predict_answers(features, start_logits, end_logits,
                                                    **kwargs))
