"""Three real downstream tasks from WordNet 3.0, on synsets held out of the pre-training text.

Labels come from WordNet itself; every example is built from
``bundled/wordnet/synsets_heldout.jsonl.gz`` (synsets whose text never
appears in ``wordnet_glosses``), split by a stable hash of the synset key
into train (80%), validation (10%) and test (10%):

    wordnet_supersense  single gloss -> its lexicographer file (the supersense,
                        45 classes: noun.animal, verb.motion, adj.all, ...).
    wordnet_hypernym    gloss pair (A, B) -> 1 if B is a hypernym of A, else 0.
                        Positives are every held-out (A, hypernym(A)) pair with both
                        synsets held out; each has one negative (A, C), C a held-out
                        synset of A's part of speech that is not a hypernym of A,
                        picked by a stable hash. Balanced: the majority baseline is 50%.
    wordnet_order       single gloss -> 1 if its words are in WordNet's order, 0 if it was
                        cut in two at a word boundary and its parts swapped ("the pair in
                        the wrong order"). Every definition of at least ``ORDER_MIN_WORDS``
                        words appears twice in its split, as written and cut where a stable
                        hash picks. Both have the same tokens, so a model without position
                        scores exactly 50%: the control row.

Features as GLUE's (:func:`posenc_jax.data.glue.encode_classification`, fixed
length ``L`` = ``sequence_length["input_ids"]``): ``input_ids`` = [CLS] a [SEP]
(b [SEP]), ``segment_ids`` (0 for the first part, 1 for the second), ``mask``,
``label`` (int32). Importing registers both tasks.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import pathlib

import seqio
import tensorflow as tf

from posenc_jax.data import vocab as vocab_lib
from posenc_jax.data.glue import encode_classification
from posenc_jax.data.metrics import accuracy, accuracy_and_f1
from posenc_jax.data.stdlib_corpus import CorpusError
from posenc_jax.data.tasks import register

HELDOUT = vocab_lib.BUNDLED_DIR / "synsets_heldout.jsonl.gz"
# SHA-256 of the held-out file as bundled (its README's table): every task's examples.
HELDOUT_SHA256 = "6c1735efca0757eed54c1785e993c9e35586b3663793a569726e23f4aef7bf6e"
SPLITS = ("train", "validation", "test")
# Examples come in WordNet's file order (grouped by part of speech and supersense): the
# buffer holds a whole split so that training batches are a uniform shuffle.
SHUFFLE_BUFFER = 20_000

# The 45 lexicographer files of WordNet 3.0, in file-number order.
LEXNAMES = (
    "adj.all", "adj.pert", "adv.all", "noun.Tops", "noun.act", "noun.animal", "noun.artifact",
    "noun.attribute", "noun.body", "noun.cognition", "noun.communication", "noun.event",
    "noun.feeling", "noun.food", "noun.group", "noun.location", "noun.motive", "noun.object",
    "noun.person", "noun.phenomenon", "noun.plant", "noun.possession", "noun.process",
    "noun.quantity", "noun.relation", "noun.shape", "noun.state", "noun.substance", "noun.time",
    "verb.body", "verb.change", "verb.cognition", "verb.communication", "verb.competition",
    "verb.consumption", "verb.contact", "verb.creation", "verb.emotion", "verb.motion",
    "verb.perception", "verb.possession", "verb.social", "verb.stative", "verb.weather",
    "adj.ppl",
)


def _bucket(text: str) -> int:
  """A stable number in [0, 1000) from ``text`` (SHA-256), for splits and sampling."""
  return int(hashlib.sha256(text.encode()).hexdigest(), 16) % 1000


def split_of(key: str) -> str:
  bucket = _bucket("split:" + key)
  return "train" if bucket < 800 else "validation" if bucket < 900 else "test"


def heldout_synsets() -> tuple[dict, ...]:
  """The held-out synset records of :data:`HELDOUT`, read once per process.

  Raises:
    CorpusError: one line naming the file: missing, damaged, or not the bundled one.
  """
  return _read_heldout(str(HELDOUT))


@functools.lru_cache(maxsize=2)
def _read_heldout(path: str) -> tuple[dict, ...]:
  try:
    data = pathlib.Path(path).read_bytes()
  except FileNotFoundError:
    raise CorpusError(f"corpus: {path} is missing (reinstall posenc-jax, or rebuild it with "
                      "scripts/make_wordnet_corpus.py)") from None
  except OSError as e:
    raise CorpusError(f"corpus: {path} is unreadable ({e.strerror or e})") from None
  digest = hashlib.sha256(data).hexdigest()
  if digest != HELDOUT_SHA256:
    raise CorpusError(f"corpus: {path} is damaged or not the bundled file (SHA-256 "
                      f"{digest[:16]}..., not the pinned {HELDOUT_SHA256[:16]}...); "
                      "reinstall posenc-jax")
  return tuple(json.loads(line) for line in gzip.decompress(data).decode("utf-8").splitlines())


def supersense_examples(split: str) -> list[tuple[str, int]]:
  """``(definition, lexname id)`` of the held-out synsets in ``split``, in file order."""
  return [(r["definition"], LEXNAMES.index(r["lexname"])) for r in heldout_synsets()
          if split_of(r["key"]) == split]


def hypernym_examples(split: str) -> list[tuple[str, str, int]]:
  """``(definition A, definition B, is B a hypernym of A)``; A's key decides the split."""
  records = heldout_synsets()
  by_key = {r["key"]: r for r in records}
  by_pos: dict[str, list[dict]] = {}
  for r in records:
    by_pos.setdefault(r["pos"], []).append(r)
  examples = []
  for r in records:
    if split_of(r["key"]) != split:
      continue
    hypernyms = {f"{r['pos']}{h:08d}" for h in r["hypernyms"] + r["instance_hypernyms"]}
    for key in sorted(hypernyms & by_key.keys()):
      examples.append((r["definition"], by_key[key]["definition"], 1))
      pool = [c for c in by_pos[r["pos"]] if c["key"] not in hypernyms | {r["key"]}]
      negative = pool[int(hashlib.sha256(f"neg:{r['key']}:{key}".encode()).hexdigest(), 16)
                      % len(pool)]
      examples.append((r["definition"], negative["definition"], 0))
  return examples


ORDER_MIN_WORDS = 4  # each half of the cut gets two words at least


def rotated(words: list[str], key: str) -> list[str]:
  """``words`` cut in two at a word boundary a stable hash of ``key`` picks (each part at
  least two words long) and the parts swapped: ``b c d a``-style orders a reader notices at
  the start, the seam and the end (``[]`` if shorter than :data:`ORDER_MIN_WORDS`)."""
  cuts = range(2, len(words) - 1)
  if not cuts:
    return []
  cut = cuts[int(hashlib.sha256(f"order:{key}".encode()).hexdigest(), 16) % len(cuts)]
  return words[cut:] + words[:cut]


def order_examples(split: str) -> list[tuple[str, int]]:
  """``(text, is the order WordNet's)``: each held-out definition of ``split`` with at least
  :data:`ORDER_MIN_WORDS` words, as written (1) and then cut in two with its parts swapped
  (0, :func:`rotated`), in file order; a definition several synsets share is in
  the split of the first only, so no text is in two splits. Words are split at whitespace and joined with
  one space, so both texts tokenise to the same pieces."""
  examples, seen = [], set()
  for r in heldout_synsets():
    words = r["definition"].split()
    text = " ".join(words)
    if text in seen:  # a definition two synsets share: its first synset's split only
      continue
    seen.add(text)
    if split_of(r["key"]) != split or len(words) < ORDER_MIN_WORDS:
      continue
    other = rotated(words, r["key"])
    if other:
      examples += [(text, 1), (" ".join(other), 0)]
  return examples


def _source(examples_fn, columns: tuple[str, ...]) -> seqio.FunctionDataSource:
  def dataset_fn(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
    del shuffle_files, seed  # one small file: seqio's example shuffling suffices
    rows = list(zip(*examples_fn(split)))
    return tf.data.Dataset.from_tensor_slices(
        {name: tf.constant(list(values)) for name, values in zip(columns, rows)})
  return seqio.FunctionDataSource(dataset_fn, splits=SPLITS)


def _output_features(vocabulary: seqio.Vocabulary, num_labels: int) -> dict[str, seqio.Feature]:
  """Token features over ``vocabulary``; ``label``'s vocabulary has ``num_labels`` ids (the
  label count fine-tuning checks ``num_labels`` against, as GLUE's)."""
  ids = seqio.PassThroughVocabulary(size=vocabulary.vocab_size)
  return {"input_ids": seqio.Feature(vocabulary, add_eos=False, dtype=tf.int32),
          "segment_ids": seqio.Feature(ids, add_eos=False, dtype=tf.int32),
          "mask": seqio.Feature(ids, add_eos=False, dtype=tf.int32),
          "label": seqio.Feature(seqio.PassThroughVocabulary(size=num_labels), add_eos=False,
                                 dtype=tf.int32, rank=0)}


def register_wordnet_tasks(vocabulary: seqio.Vocabulary | None = None, suffix: str = "") -> None:
  """Registers ``wordnet_supersense<suffix>``, ``wordnet_hypernym<suffix>`` and
  ``wordnet_order<suffix>``."""
  vocabulary = vocabulary or vocab_lib.vocabulary()
  register(f"wordnet_supersense{suffix}",
           source=_source(supersense_examples, ("a", "label")),
           preprocessors=[functools.partial(encode_classification, text_keys=("a",))],
           output_features=_output_features(vocabulary, len(LEXNAMES)), metric_fns=[accuracy],
           shuffle_buffer_size=SHUFFLE_BUFFER)
  register(f"wordnet_hypernym{suffix}",
           source=_source(hypernym_examples, ("a", "b", "label")),
           preprocessors=[functools.partial(encode_classification, text_keys=("a", "b"))],
           output_features=_output_features(vocabulary, 2), metric_fns=[accuracy_and_f1],
           shuffle_buffer_size=SHUFFLE_BUFFER)
  register(f"wordnet_order{suffix}",
           source=_source(order_examples, ("a", "label")),
           preprocessors=[functools.partial(encode_classification, text_keys=("a",))],
           output_features=_output_features(vocabulary, 2), metric_fns=[accuracy],
           shuffle_buffer_size=SHUFFLE_BUFFER)


# num_labels and whether inputs are sentence pairs, for the fine-tuning configs.
TASK_INFO = {
    "wordnet_supersense": dict(num_labels=len(LEXNAMES), pair=False, metric="accuracy"),
    "wordnet_hypernym": dict(num_labels=2, pair=True, metric="accuracy"),
    "wordnet_order": dict(num_labels=2, pair=False, metric="accuracy"),
}

register_wordnet_tasks()
