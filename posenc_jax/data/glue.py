"""GLUE and XNLI sentence(-pair) classification tasks for fine-tuning BERT encoders.

Importing this module registers (again: no error), over the bundled SentencePiece vocabulary
``posenc_jax.data.vocab.vocabulary()``:

    glue_cola glue_sst2 glue_mrpc glue_qqp glue_stsb glue_mnli glue_qnli glue_rte glue_wnli
    glue_ax                            from TFDS ``glue/<config>:2.0.0``
    xnli_ar xnli_bg xnli_de xnli_el xnli_en xnli_es xnli_fr xnli_hi xnli_ru xnli_sw xnli_th
    xnli_tr xnli_ur xnli_vi xnli_zh    from TFDS ``xnli:1.1.0``, evaluation only
    xnli_train                         MNLI English (``glue/mnli``), the zero-shot training set

``register_classification_tasks(vocabulary, suffix)`` registers the same tasks over another
vocabulary, e.g. an imported BERT's WordPiece one::

    from posenc_jax.data import glue, wordpiece
    wp = wordpiece.from_hf_checkpoint(model_dir)
    glue.register_classification_tasks(wp, suffix="_wp")        # glue_cola_wp, xnli_de_wp, ...

Splits are TFDS's: ``train``, ``validation``, ``test`` (GLUE test labels are hidden: -1);
``glue_mnli`` has ``train``, ``validation_matched``, ``validation_mismatched`` (also as
``validation``: matched), ``test_matched``, ``test_mismatched``; ``glue_ax`` only ``test``
(the diagnostic set, labels hidden, predicted by an MNLI model and scored by the GLUE server
with R3, i.e. 3-class Matthews correlation); ``xnli_<lang>`` have ``validation`` and ``test``
(2,490 and 5,010 examples per language); ``xnli_train`` has ``train`` (MNLI train) and
``validation`` (MNLI validation matched). XNLI's TFDS examples hold all 15 languages at
once; ``xnli_<lang>`` keeps the premise and hypothesis of its language. XNLI and MNLI share
the label ids (0 entailment, 1 neutral, 2 contradiction), so an MNLI model is evaluated on
every ``xnli_<lang>`` test split unchanged (zero-shot cross-lingual transfer, XTREME).

Every example, padded to the length ``L`` asked for with ``get_dataset({"input_ids": L})``
(``DEFAULT_MAX_LEN`` when none is given):

    input_ids     int32 [L]   [CLS] a [SEP] for one sentence, [CLS] a [SEP] b [SEP] for a pair,
                              then 0 (padding)
    segment_ids   int32 [L]   0 on [CLS] a [SEP], 1 on b [SEP], 0 on padding (token types
                              for input-level or per-head segment encodings)
    mask          int32 [L]   1 on real tokens, 0 on padding
    label         int32 []    class id (float32 similarity 0-5 for glue_stsb)
    idx           int32 []    the example's index in its TFDS split (GLUE only: the id of
                              GLUE's test submission files)

Texts too long are truncated as BERT does: one sentence to ``L - 2`` tokens; a pair
longest-first (tokens are taken off the end of the longer one, of ``b`` on a tie, until
``L - 3`` remain).

Metrics (``posenc_jax.data.metrics``, 0-100 scale), as the papers report them: CoLA and AX
Matthews correlation, MRPC and QQP F1 and accuracy, STS-B Pearson and Spearman, the others
accuracy. ``TASK_INFO`` has what fine-tuning configs need (labels, regression, metrics, the
metrics averaged into the task's GLUE score); ``task_score`` averages them and
``majority_baseline`` scores the constant most-frequent-label predictor.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import seqio
import tensorflow as tf

from posenc_jax.data import metrics
from posenc_jax.data import tasks as tasks_lib
from posenc_jax.data import vocab as vocab_lib

DEFAULT_MAX_LEN = 128
GLUE_VERSION = "2.0.0"
XNLI_VERSION = "1.1.0"
XNLI_LANGUAGES = ("ar", "bg", "de", "el", "en", "es", "fr", "hi", "ru", "sw", "th", "tr",
                  "ur", "vi", "zh")
NLI_LABELS = ("entailment", "neutral", "contradiction")
TOKEN_FEATURES = ("input_ids", "segment_ids", "mask")

_STANDARD_SPLITS = {"train": "train", "validation": "validation", "test": "test"}


@dataclasses.dataclass(frozen=True)
class TaskInfo:
  """What a fine-tuning config needs to know about a classification task.

  Attributes:
    tfds_name: the TFDS dataset (``name/config:version``).
    splits: task split -> TFDS split.
    text_keys: the TFDS text feature(s): one for single sentences, two for pairs (a, b).
    num_labels: classes (1 for regression).
    regression: the label is a float score (STS-B) rather than a class id.
    label_names: class names in id order (empty for regression).
    metrics: the names in the metric functions' output.
    score_metrics: the metrics averaged into the task's single GLUE/XTREME number.
    eval_splits: the labelled splits to evaluate on.
  """
  tfds_name: str
  splits: Mapping[str, str]
  text_keys: tuple[str, ...]
  num_labels: int
  regression: bool
  label_names: tuple[str, ...]
  metrics: tuple[str, ...]
  score_metrics: tuple[str, ...]
  eval_splits: tuple[str, ...]
  metric_fns: tuple[Callable, ...] = dataclasses.field(repr=False, default=())

  @property
  def is_pair(self) -> bool:
    return len(self.text_keys) == 2


def _glue(config, text_keys, label_names, metric_fns, metric_names, score_metrics=None,
          splits=None, eval_splits=("validation",)):
  return TaskInfo(
      tfds_name=f"glue/{config}:{GLUE_VERSION}", splits=dict(splits or _STANDARD_SPLITS),
      text_keys=tuple(text_keys), num_labels=max(1, len(label_names)),
      regression=not label_names, label_names=tuple(label_names),
      metrics=tuple(metric_names), score_metrics=tuple(score_metrics or metric_names),
      eval_splits=tuple(eval_splits), metric_fns=tuple(metric_fns))


_MNLI_SPLITS = {"train": "train", "validation": "validation_matched",
                "validation_matched": "validation_matched",
                "validation_mismatched": "validation_mismatched",
                "test_matched": "test_matched", "test_mismatched": "test_mismatched"}

TASK_INFO: dict[str, TaskInfo] = {
    "glue_cola": _glue("cola", ["sentence"], ["unacceptable", "acceptable"],
                       [metrics.matthews_corr], ["matthews_corr"]),
    "glue_sst2": _glue("sst2", ["sentence"], ["negative", "positive"],
                       [metrics.accuracy], ["accuracy"]),
    "glue_mrpc": _glue("mrpc", ["sentence1", "sentence2"], ["not_equivalent", "equivalent"],
                       [metrics.accuracy_and_f1], ["f1", "accuracy"]),
    "glue_qqp": _glue("qqp", ["question1", "question2"], ["not_duplicate", "duplicate"],
                      [metrics.accuracy_and_f1], ["f1", "accuracy"]),
    "glue_stsb": _glue("stsb", ["sentence1", "sentence2"], [],
                       [metrics.pearson_spearman], ["pearson", "spearman"]),
    "glue_mnli": _glue("mnli", ["premise", "hypothesis"], NLI_LABELS, [metrics.accuracy],
                       ["accuracy"], splits=_MNLI_SPLITS,
                       eval_splits=("validation_matched", "validation_mismatched")),
    "glue_qnli": _glue("qnli", ["question", "sentence"], ["entailment", "not_entailment"],
                       [metrics.accuracy], ["accuracy"]),
    "glue_rte": _glue("rte", ["sentence1", "sentence2"], ["entailment", "not_entailment"],
                      [metrics.accuracy], ["accuracy"]),
    "glue_wnli": _glue("wnli", ["sentence1", "sentence2"], ["not_entailment", "entailment"],
                       [metrics.accuracy], ["accuracy"]),
    "glue_ax": _glue("ax", ["premise", "hypothesis"], NLI_LABELS, [metrics.matthews_corr],
                     ["matthews_corr"], splits={"test": "test"}, eval_splits=()),
    "xnli_train": _glue("mnli", ["premise", "hypothesis"], NLI_LABELS, [metrics.accuracy],
                        ["accuracy"], splits={"train": "train",
                                              "validation": "validation_matched"}),
}
for _lang in XNLI_LANGUAGES:
  TASK_INFO[f"xnli_{_lang}"] = TaskInfo(
      tfds_name=f"xnli:{XNLI_VERSION}", splits={"validation": "validation", "test": "test"},
      text_keys=("premise", "hypothesis"), num_labels=3, regression=False,
      label_names=NLI_LABELS, metrics=("accuracy",), score_metrics=("accuracy",),
      eval_splits=("validation", "test"), metric_fns=(metrics.accuracy,))
del _lang

# Registered task name (suffix included) -> its ``TASK_INFO`` key.
_BASE_NAME: dict[str, str] = {}

GLUE_TASKS = tuple(name for name in TASK_INFO if name.startswith("glue_"))
XNLI_TASKS = tuple(name for name in TASK_INFO if name.startswith("xnli_"))


def special_ids(vocabulary: seqio.Vocabulary) -> tuple[int, int]:
  """``([CLS], [SEP])`` ids of a vocabulary: the WordPiece ``cls_id``/``sep_id``, or the
  ``[CLS]``/``[SEP]`` pieces of a SentencePiece model (``posenc_jax.data.vocab``)."""
  if hasattr(vocabulary, "cls_id") and hasattr(vocabulary, "sep_id"):
    return int(vocabulary.cls_id), int(vocabulary.sep_id)
  if isinstance(vocabulary, seqio.SentencePieceVocabulary):
    ids = tuple(vocabulary.tokenizer.piece_to_id(p) for p in ("[CLS]", "[SEP]"))
    if vocabulary.unk_id in ids:
      raise ValueError(f"{vocabulary}: no [CLS]/[SEP] pieces (train it with "
                       "posenc_jax.data.vocab)")
    return ids
  raise ValueError(f"{vocabulary}: cannot find [CLS]/[SEP] ids (need cls_id and sep_id)")


def pair_lengths(len_a: tf.Tensor, len_b: tf.Tensor, budget: int) -> tuple[tf.Tensor, tf.Tensor]:
  """Lengths kept by BERT's longest-first truncation of a pair to ``budget`` tokens.

  Equal to repeatedly dropping the last token of the longer text (of ``b`` on a tie) while
  ``len_a + len_b > budget``: the shorter text is kept whole if it fits in its half
  (``a``: ``ceil(budget / 2)``, ``b``: ``floor(budget / 2)``), else both are cut to
  their halves.
  """
  half_a = (budget + 1) // 2
  keep_a = tf.minimum(len_a, tf.maximum(half_a, budget - len_b))
  fits = len_a + len_b <= budget
  return tf.where(fits, len_a, keep_a), tf.where(fits, len_b, budget - keep_a)


def _max_len(sequence_length: Mapping[str, int | None] | None, default: int) -> int:
  lengths = set()
  if sequence_length:
    lengths = {sequence_length.get(k) for k in TOKEN_FEATURES} - {None}
  if len(lengths) > 1:
    raise ValueError(f"sequence_length: {dict(sequence_length)}; input_ids, segment_ids and "
                     "mask must have the same length")
  return lengths.pop() if lengths else default


def encode_classification(dataset: tf.data.Dataset, sequence_length=None, output_features=None,
                          *, text_keys: Sequence[str], regression: bool = False,
                          default_max_len: int = DEFAULT_MAX_LEN,
                          keep: Sequence[str] = ()) -> tf.data.Dataset:
  """A seqio preprocessor: text (``text_keys``: one or two) and ``label`` -> BERT features.

  Tokenises with ``output_features["input_ids"].vocabulary`` (module docstring: layout,
  truncation); ``keep`` names int features copied through as int32 scalars (``idx``).
  """
  vocabulary = output_features["input_ids"].vocabulary
  cls_id, sep_id = special_ids(vocabulary)
  max_len = _max_len(sequence_length, default_max_len)
  pair = len(text_keys) == 2
  if len(text_keys) not in (1, 2) or max_len < (3 if pair else 2):
    raise ValueError(f"text_keys {text_keys} with max_len {max_len}: need one or two texts "
                     "and room for [CLS] and the [SEP]s")

  def encode(ex):
    a = tf.cast(vocabulary.encode_tf(ex[text_keys[0]]), tf.int32)
    if pair:
      b = tf.cast(vocabulary.encode_tf(ex[text_keys[1]]), tf.int32)
      keep_a, keep_b = pair_lengths(tf.size(a), tf.size(b), max_len - 3)
      a, b = a[:keep_a], b[:keep_b]
      ids = tf.concat([[cls_id], a, [sep_id], b, [sep_id]], 0)
      segments = tf.concat([tf.zeros([keep_a + 2], tf.int32), tf.ones([keep_b + 1], tf.int32)], 0)
    else:
      a = a[:max_len - 2]
      ids = tf.concat([[cls_id], a, [sep_id]], 0)
      segments = tf.zeros_like(ids)
    pad = [[0, max_len - tf.size(ids)]]
    out = {
        "input_ids": tf.ensure_shape(tf.pad(ids, pad), [max_len]),
        "segment_ids": tf.ensure_shape(tf.pad(segments, pad), [max_len]),
        "mask": tf.ensure_shape(tf.pad(tf.ones_like(ids), pad), [max_len]),
        "label": tf.cast(ex["label"], tf.float32 if regression else tf.int32),
    }
    out.update({k: tf.cast(ex[k], tf.int32) for k in keep})
    return out

  return dataset.map(encode, num_parallel_calls=tf.data.AUTOTUNE)


def select_xnli_language(dataset: tf.data.Dataset, language: str) -> tf.data.Dataset:
  """XNLI examples (all languages) -> ``{"premise", "hypothesis", "label"}`` in ``language``.

  The premise is a ``Translation`` (a string per language), the hypothesis a
  ``TranslationVariableLanguages`` (parallel ``language``/``translation`` lists); an example
  whose hypothesis lacks ``language`` (or has it twice) is an error.
  """
  if language not in XNLI_LANGUAGES:
    raise ValueError(f"language: got {language!r}; allowed: {', '.join(XNLI_LANGUAGES)}")

  def select(ex):
    hypothesis = ex["hypothesis"]
    match = tf.boolean_mask(hypothesis["translation"], hypothesis["language"] == language)
    check = tf.debugging.assert_equal(
        tf.size(match), 1, message=f"XNLI example without exactly one {language} hypothesis")
    with tf.control_dependencies([check]):
      return {"premise": ex["premise"][language], "hypothesis": tf.identity(match[0]),
              "label": ex["label"]}

  return dataset.map(select, num_parallel_calls=tf.data.AUTOTUNE)


def output_features(vocabulary: seqio.Vocabulary, info: TaskInfo, with_idx: bool
                    ) -> dict[str, seqio.Feature]:
  """The task's seqio features: token features over ``vocabulary``, scalar ``label`` (and
  ``idx``)."""
  binary = seqio.PassThroughVocabulary(size=2)
  features = {
      "input_ids": seqio.Feature(vocabulary, add_eos=False, dtype=tf.int32),
      "segment_ids": seqio.Feature(binary, add_eos=False, dtype=tf.int32),
      "mask": seqio.Feature(binary, add_eos=False, dtype=tf.int32),
      "label": seqio.Feature(seqio.PassThroughVocabulary(size=info.num_labels), add_eos=False,
                             dtype=tf.float32 if info.regression else tf.int32, rank=0),
  }
  if with_idx:
    features["idx"] = seqio.Feature(seqio.PassThroughVocabulary(size=0), add_eos=False,
                                    dtype=tf.int32, rank=0)
  return features


def _register_one(name: str, info: TaskInfo, vocabulary: seqio.Vocabulary,
                  max_len: int) -> seqio.Task:
  xnli_language = name.removeprefix("xnli_") if info.tfds_name.startswith("xnli") else None
  preprocessors = []
  if xnli_language:
    preprocessors.append(functools.partial(select_xnli_language, language=xnli_language))
  keep = () if xnli_language else ("idx",)
  preprocessors.append(functools.partial(
      encode_classification, text_keys=info.text_keys, regression=info.regression,
      default_max_len=max_len, keep=keep))
  return tasks_lib.register(
      name,
      source=seqio.TfdsDataSource(tfds_name=info.tfds_name, splits=dict(info.splits)),
      preprocessors=preprocessors,
      output_features=output_features(vocabulary, info, with_idx=not xnli_language),
      metric_fns=list(info.metric_fns),
      shuffle_buffer_size=10_000,
  )


def register_classification_tasks(vocabulary: seqio.Vocabulary | None = None, suffix: str = "",
                                  max_len: int = DEFAULT_MAX_LEN,
                                  names: Sequence[str] | None = None) -> list[str]:
  """Registers the GLUE and XNLI tasks (``names``: a subset of ``TASK_INFO``) as
  ``<name><suffix>`` over ``vocabulary`` (default: the bundled SentencePiece one); returns
  the registered names.

  ``max_len`` is the length when ``get_dataset`` is given no ``input_ids`` length. A name
  registered before over another vocabulary is a ``ValueError`` (choose another suffix).
  """
  vocabulary = vocabulary if vocabulary is not None else vocab_lib.vocabulary()
  registered = []
  for name in names if names is not None else TASK_INFO:
    task = _register_one(name + suffix, TASK_INFO[name], vocabulary, max_len)
    existing = task.output_features["input_ids"].vocabulary
    if existing != vocabulary:
      raise ValueError(f"task {name + suffix!r} is registered with vocabulary {existing}, "
                       f"not {vocabulary}; register under another suffix")
    _BASE_NAME[task.name] = name
    registered.append(task.name)
  return registered


def task_score(name: str, scores: Mapping[str, float]) -> float:
  """The task's single GLUE/XTREME number: the mean of its ``score_metrics`` in ``scores``
  (e.g. MRPC (F1 + accuracy) / 2, STS-B (Pearson + Spearman) / 2). ``name`` may carry a
  registration suffix."""
  info = _info(name)
  return float(np.mean([scores[m] for m in info.score_metrics]))


def _info(name: str) -> TaskInfo:
  if name not in _BASE_NAME:
    raise KeyError(f"{name!r} is not a registered GLUE/XNLI task ({', '.join(_BASE_NAME)})")
  return TASK_INFO[_BASE_NAME[name]]


def majority_baseline(name: str, split: str, train_split: str = "train") -> dict[str, float]:
  """The task's metrics for always predicting the most frequent ``train_split`` label (the
  train mean for STS-B, whose correlations are then NaN) on ``split``.

  Reads both splits (labels only, no tokenising beyond seqio's pipeline).
  """
  info = _info(name)
  task = seqio.get_mixture_or_task(name)

  def labels(s):
    ds = task.get_dataset(None, split=s, shuffle=False, num_epochs=1)
    return np.array([ex["label"] for ex in ds.map(lambda x: {"label": x["label"]})
                     .as_numpy_iterator()])

  train, target = labels(train_split), labels(split)
  if info.regression:
    constant = float(np.mean(train))
  else:
    values, counts = np.unique(train, return_counts=True)
    constant = values[np.argmax(counts)]
  predictions = np.full(target.shape, constant, dtype=target.dtype)
  scores = {}
  for fn in info.metric_fns:
    scores |= fn(target, predictions)
  return scores


register_classification_tasks()
