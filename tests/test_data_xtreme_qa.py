"""The XTREME QA seqio tasks under ``tfds.testing.mock_data`` (no download), and evaluation.

Two offline mocks: ``MockPolicy.USE_CODE`` random examples (builders' features from their
code; all four builders mock without metadata files), and ``as_dataset_fn`` with fixed
SQuAD-style examples, which also records which builder, config, version and split a task
reads. Mocked builders have no split sizes, so seqio's in-memory caching check
(``num_input_examples``) cannot run: ``get_dataset(..., try_in_mem_cache=False)``.
"""

import functools

import jax
import numpy as np
import pytest
import seqio
import tensorflow as tf
import tensorflow_datasets as tfds

from posenc_jax.data import qa, squad_metrics, xtreme_qa
from posenc_jax.data.vocab import CLS_ID, SEP_ID
from posenc_jax.models import BertForQuestionAnswering, model_config

L = 128
EXPECTED_SOURCES = {
    "squad_v1": ("squad", "v1.1", "3.0.0", {"train": "train", "validation": "validation"}),
    **{f"xquad_{lang}": ("xquad", lang, "3.0.0", {"test": "test"})
       for lang in ("ar", "de", "el", "en", "es", "hi", "ru", "th", "tr", "vi", "zh")},
    **{f"mlqa_{lang}": ("mlqa", lang, "1.0.0", {"validation": "validation", "test": "test"})
       for lang in ("ar", "de", "en", "es", "hi", "vi", "zh")},
    **{f"tydiqa_goldp_{lang}": ("tydi_qa", "goldp", "3.0.0",
                                {"validation": f"validation-{lang}"})
       for lang in ("ar", "bn", "en", "fi", "id", "ko", "ru", "sw", "te")},
    "tydiqa_goldp": ("tydi_qa", "goldp", "3.0.0", {"train": "train", "validation": "validation"}),
}

EIFFEL = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the tower "
    "from 1887 to 1889. Locally nicknamed \"La dame de fer\" (French for \"Iron Lady\"), it was "
    "constructed as the centrepiece of the 1889 World's Fair, and to crown the centennial "
    "anniversary of the French Revolution. Although initially criticised by some of France's "
    "leading artists and intellectuals for its design, it has since become a global cultural "
    "icon of France and one of the most recognisable structures in the world. The tower "
    "received 5,889,000 visitors in 2022. The Eiffel Tower is the most visited monument with "
    "an entrance fee in the world: 6.91 million people ascended it in 2015. It was designated "
    "a monument historique in 1964, and was named part of a UNESCO World Heritage Site "
    "(\"Paris, Banks of the Seine\") in 1991. The tower is 330 metres (1,083 ft) tall, about "
    "the same height as an 81-storey building, and the tallest structure in Paris.")
EXAMPLES = [
    dict(id="eiffel-height", question="How tall is the tower?", context=EIFFEL,
         answers=["330 metres (1,083 ft)"]),
    dict(id="es-gato", question="¿Dónde duerme el gato?",
         context="El gato negro duerme en la casa de María, cerca del río.",
         answers=["en la casa de María", "la casa de María"]),
    dict(id="de-bern", question="Was ist die Hauptstadt der Schweiz?",
         context="Die Hauptstadt der Schweiz ist Bern, nicht Zürich.", answers=["Bern"]),
]
SIGNATURE = dict(
    id=tf.TensorSpec([], tf.string), title=tf.TensorSpec([], tf.string),
    context=tf.TensorSpec([], tf.string), question=tf.TensorSpec([], tf.string),
    answers=dict(text=tf.TensorSpec([None], tf.string),
                 answer_start=tf.TensorSpec([None], tf.int32)))


def _tfds_example(ex):
  return dict(id=ex["id"], title="", context=ex["context"], question=ex["question"],
              answers=dict(text=ex["answers"],
                           answer_start=[ex["context"].index(a) for a in ex["answers"]]))


def examples_dataset(examples):
  """``examples`` (dicts of id, question, context, answers) as a TFDS SQuAD-format dataset."""
  return tf.data.Dataset.from_generator(lambda: (_tfds_example(ex) for ex in examples),
                                        output_signature=SIGNATURE)


def fixed_mock(calls):
  """``mock_data`` serving ``EXAMPLES`` from every builder; appends what was read to calls."""
  def as_dataset(self, split, decoders=None, read_config=None, **kwargs):
    del decoders, read_config, kwargs
    calls.append((self.name, self.builder_config.name, str(self.version), str(split)))
    return examples_dataset(EXAMPLES)
  return tfds.testing.mock_data(as_dataset_fn=as_dataset, policy=tfds.testing.MockPolicy.USE_CODE)


def random_mock():
  return tfds.testing.mock_data(num_examples=3, policy=tfds.testing.MockPolicy.USE_CODE)


def features(name, split, batch_size=64):
  """All features of a task's split, as one numpy batch (call under a mock)."""
  ds = seqio.get_mixture_or_task(name).get_dataset(
      {"input_ids": L}, split=split, shuffle=False, try_in_mem_cache=False)
  batches = list(ds.batch(batch_size).as_numpy_iterator())
  return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def check_batch(batch):
  """Keys, shapes, dtypes and the [CLS] q [SEP] c [SEP] layout of a batch of features."""
  n = len(batch["input_ids"])
  assert n > 0
  expected = {"input_ids": ((n, L), np.int32), "segment_ids": ((n, L), np.int32),
              "mask": ((n, L), np.int32), "start_positions": ((n,), np.int32),
              "end_positions": ((n,), np.int32), "example_index": ((n,), np.int32),
              "token_offsets": ((n, L, 2), np.int32), "max_context": ((n, L), np.int32),
              "example_id": ((n,), np.object_), "context": ((n,), np.object_)}
  assert {k: (v.shape, v.dtype) for k, v in batch.items()} == expected
  for row in range(n):
    ids, seg, mask = batch["input_ids"][row], batch["segment_ids"][row], batch["mask"][row]
    real = int(mask.sum())
    first_sep = int(np.argmax(ids == SEP_ID))
    assert ids[0] == CLS_ID and ids[real - 1] == SEP_ID and 0 < first_sep < real - 1
    assert mask.tolist() == [1] * real + [0] * (L - real) and np.all(ids[real:] == 0)
    assert seg.tolist() == [0] * (first_sep + 1) + [1] * (real - first_sep - 1) + [0] * (L - real)
    context_tokens = batch["token_offsets"][row, :, 0] >= 0
    assert context_tokens.tolist() == ([False] * (first_sep + 1) + [True] * (real - first_sep - 2)
                                       + [False] * (L - real + 1))
    start, end = batch["start_positions"][row], batch["end_positions"][row]
    assert (start, end) == (0, 0) or (context_tokens[start] and start <= end
                                      and context_tokens[end])
  assert np.all(np.diff(batch["example_index"]) >= 0) and batch["example_index"][0] == 0


# ------------------------------------------------------------------------------ registration


def test_task_names():
  assert set(xtreme_qa.TASK_NAMES) == set(EXPECTED_SOURCES) and len(xtreme_qa.TASK_NAMES) == 29
  for name in xtreme_qa.TASK_NAMES:
    task = seqio.get_mixture_or_task(name)
    assert set(task.output_features) == set(xtreme_qa.OUTPUT_KEYS)
    assert task.output_features["input_ids"].vocabulary.vocab_size == 8192


def test_registration_is_idempotent():
  tasks = {name: seqio.get_mixture_or_task(name) for name in xtreme_qa.TASK_NAMES}
  assert tuple(xtreme_qa.register_all()) == xtreme_qa.TASK_NAMES
  assert all(seqio.get_mixture_or_task(name) is task for name, task in tasks.items())


@pytest.mark.parametrize("name", sorted(EXPECTED_SOURCES))
def test_every_task_reads_its_builder_and_yields_features(name):
  builder, config, version, splits = EXPECTED_SOURCES[name]
  task = seqio.get_mixture_or_task(name)
  assert sorted(task.splits) == sorted(splits)
  calls = []
  with fixed_mock(calls):
    for split in splits:
      batch = features(name, split)
      check_batch(batch)
      assert sorted(set(batch["example_index"])) == [0, 1, 2]
      assert [x.decode() for x in dict.fromkeys(batch["example_id"])] == [
          ex["id"] for ex in EXAMPLES]
  assert calls == [(builder, config, version, tfds_split) for tfds_split in splits.values()]


def test_every_task_yields_batches_of_random_mock_examples():
  """Random strings with unaligned answers (``MockPolicy.USE_CODE``) still give features."""
  with random_mock():
    for name in xtreme_qa.TASK_NAMES:
      for split in seqio.get_mixture_or_task(name).splits:
        check_batch(features(name, split, batch_size=4))


def test_metric_fns_per_benchmark():
  golds, predictions = {"q": ["en la casa"]}, {"q": "la casa"}
  for name in xtreme_qa.TASK_NAMES:
    [metric_fn] = seqio.get_mixture_or_task(name).predict_metric_fns
    if name.startswith("mlqa_"):
      assert metric_fn.keywords == {"lang": name.split("_")[1]}
    else:
      assert metric_fn is squad_metrics.squad
  # es articles: "en la casa" vs "la casa" is "en casa" vs "casa" for MLQA.
  assert xtreme_qa.evaluate("mlqa_es", "test", predictions, golds)["f1"] == pytest.approx(
      100 * 2 / 3)
  assert xtreme_qa.evaluate("xquad_es", "test", predictions, golds)["f1"] == pytest.approx(80.0)


# -------------------------------------------------------------------------------- evaluation


def _ideal_logits(batch):
  """Start/end peaks at each gold answer's first/last token in every window (a perfect model)."""
  answers = {ex["id"]: (ex["context"].index(ex["answers"][0]), len(ex["answers"][0]))
             for ex in EXAMPLES}
  start, end = np.zeros(batch["max_context"].shape), np.zeros(batch["max_context"].shape)
  for row, qid in enumerate(batch["example_id"]):
    begin, length = answers[qid.decode()]
    b, e = batch["token_offsets"][row, :, 0], batch["token_offsets"][row, :, 1]
    start[row] = 10.0 * ((b <= begin) & (begin < e))
    end[row] = 10.0 * ((b <= begin + length - 1) & (begin + length - 1 < e))
  return start, end


def test_gold_positions_and_end_to_end_evaluation():
  with fixed_mock([]):
    batch = features("squad_v1", "validation")
    golds = xtreme_qa.gold_answers("squad_v1", "validation")
    assert golds == {ex["id"]: ex["answers"] for ex in EXAMPLES}
    # The long context needs several windows (L 128, max query 64, stride 128) ...
    windows = batch["example_id"] == b"eiffel-height"
    assert windows.sum() >= 3
    # ... and the answer's gold positions are set only in the one window that holds it.
    with_answer = np.flatnonzero(batch["start_positions"] > 0)
    assert len(with_answer) == len(EXAMPLES)
    for row in with_answer:
      context = batch["context"][row].decode()
      text = qa.span_text(context, batch["token_offsets"][row], batch["start_positions"][row],
                          batch["end_positions"][row])
      assert text == golds[batch["example_id"][row].decode()][0]
    assert batch["example_index"][with_answer[0]] == 0 and with_answer[0] > 0
    # A perfect model scores 100; post-processing works from all features at once.
    predictions = xtreme_qa.predict_answers(batch, *_ideal_logits(batch))
    assert predictions == {ex["id"]: ex["answers"][0] for ex in EXAMPLES}
    assert xtreme_qa.evaluate("squad_v1", "validation", predictions) == {
        "exact_match": 100.0, "f1": 100.0}
    wrong = dict(predictions, **{"de-bern": "Zürich"})
    assert xtreme_qa.evaluate_logits("squad_v1", "validation", batch,
                                     *_ideal_logits(batch))["f1"] == 100.0
    assert xtreme_qa.evaluate("squad_v1", "validation", wrong) == pytest.approx(
        {"exact_match": 200 / 3, "f1": 200 / 3})


def test_batches_feed_bert_for_question_answering():
  cfg = model_config(dict(vocab_size=8192, d_model=32, num_layers=1, num_heads=2, mlp_dim=32,
                          max_len=L))
  model = BertForQuestionAnswering(cfg)
  with fixed_mock([]):
    batch = features("mlqa_es", "test")
  inputs = [batch[k] for k in ("input_ids", "segment_ids", "mask")]
  variables = model.init(jax.random.key(0), *inputs)
  start, end = jax.jit(functools.partial(model.apply, variables))(*inputs)
  assert start.shape == end.shape == batch["input_ids"].shape
  predictions = xtreme_qa.predict_answers(batch, np.asarray(start), np.asarray(end))
  contexts = {ex["id"]: ex["context"] for ex in EXAMPLES}
  assert set(predictions) == set(contexts)
  assert all(text in contexts[qid] for qid, text in predictions.items())
  metrics = xtreme_qa.evaluate("mlqa_es", "test", predictions, {k: [v] for k, v in
                                                                 contexts.items()})
  assert set(metrics) == {"exact_match", "f1"} and 0.0 <= metrics["f1"] <= 100.0
