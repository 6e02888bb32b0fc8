"""WMT18 translation tasks: en-de, de-en, en-cs, cs-en, tested on newstest2018.

Importing this module registers (again: no error), over the bundled SentencePiece vocabulary:

    wmt18_en_de  wmt18_de_en   from TFDS ``wmt18_translate/de-en:1.0.0``
    wmt18_en_cs  wmt18_cs_en   from TFDS ``wmt18_translate/cs-en:1.0.0``

``wmt18_<src>_<tgt>`` translates ``src`` into ``tgt``. Splits are TFDS's: ``train`` (the
WMT18 parallel data below), ``validation`` (newstest2017) and ``test`` (newstest2018, the
test set DIET reports). Each example is::

    inputs                 int32 [n]   the source sentence, SentencePiece ids, then EOS (1)
    targets                int32 [m]   the target sentence, then EOS
    inputs_pretokenized    string      the raw source text
    targets_pretokenized   string      the raw reference (what SacreBLEU should score against)

Source and target share one vocabulary (the models tie their embeddings). The bundled one
is an 8k English WordNet model, fine for smoke runs; for real runs train a joint model on
both sides' text (``python -m posenc_jax.train_vocab --files=train.en,train.de
--vocab_size=32000 --character_coverage=0.9999 --output=/data/spm/wmt18_ende``, the text
e.g. written from ``inputs_pretokenized``/``targets_pretokenized``) and register with it::

    wmt.register_wmt18(vocab_lib.vocabulary("/data/spm/wmt18_ende.model"), suffix="_32k")

Sequences are not truncated here: seqio trims ``inputs``/``targets`` to the lengths passed to
``get_dataset`` (EOS is appended after trimming, so it survives). The metric is
``posenc_jax.data.metrics.bleu``: SacreBLEU's corpus BLEU with its default settings on the
detokenised predictions against the raw references.

Source data TFDS needs by hand
------------------------------
``tfds.builder("wmt18_translate/de-en").download_and_prepare()`` downloads everything itself:
Europarl v7, ParaCrawl v1, CommonCrawl, News Commentary v13 and Rapid 2016 for training,
newstest2017 and newstest2018 from the WMT19 ``dev.tgz``.

``wmt18_translate/cs-en`` also trains on **CzEng 1.7**, which cannot be downloaded without
registering at https://ufal.mff.cuni.cz/czeng. Download
CzEng 1.6 in plain-text format, the ten files ``data-plaintext-format.0.tar`` ...
``data-plaintext-format.9.tar``, and place them in TFDS's manual directory,
``<data_dir>/downloads/manual/`` (default ``~/tensorflow_datasets/downloads/manual/``, or
``tfds.download.DownloadConfig(manual_dir=...)``). TFDS filters them to CzEng 1.7 with a
script it fetches itself. Without them preparing cs-en stops with an ``AssertionError``
naming the files and the directory. Its other parts (Europarl v7, ParaCrawl v1,
CommonCrawl, News Commentary v13; newstest2017/2018) are downloaded automatically. (The
URLs are those of TFDS 4.9.10's ``wmt.py``; nothing here was downloaded in testing, which
uses ``tfds.testing.mock_data``.)
"""

from __future__ import annotations

import functools

import seqio
import tensorflow as tf

from posenc_jax.data import metrics
from posenc_jax.data import tasks as tasks_lib
from posenc_jax.data import vocab as vocab_lib

WMT18_VERSION = "1.0.0"
# task language pair (source, target) -> TFDS config of wmt18_translate (always xx-en).
PAIRS = {("en", "de"): "de-en", ("de", "en"): "de-en",
         ("en", "cs"): "cs-en", ("cs", "en"): "cs-en"}
SPLITS = {"train": "train", "validation": "validation", "test": "test"}


def translation_pair(dataset: tf.data.Dataset, source: str, target: str) -> tf.data.Dataset:
  """TFDS ``Translation`` examples ``{lang: text}`` -> ``{"inputs": source, "targets": target}``."""
  return dataset.map(lambda ex: {"inputs": ex[source], "targets": ex[target]},
                     num_parallel_calls=tf.data.AUTOTUNE)


def task_name(source: str, target: str) -> str:
  return f"wmt18_{source}_{target}"


def register_wmt18(vocabulary: seqio.Vocabulary | None = None, suffix: str = "") -> list[str]:
  """Registers ``wmt18_<src>_<tgt><suffix>`` for the four pairs over ``vocabulary`` (default:
  the bundled SentencePiece one; it needs an EOS id); returns the names.

  A name registered before over another vocabulary is a ``ValueError``.
  """
  vocabulary = vocabulary if vocabulary is not None else vocab_lib.vocabulary()
  if vocabulary.eos_id is None:
    raise ValueError(f"{vocabulary}: translation targets need an EOS id")
  names = []
  for (source, target), config in PAIRS.items():
    feature = seqio.Feature(vocabulary, add_eos=True, dtype=tf.int32)
    task = tasks_lib.register(
        task_name(source, target) + suffix,
        source=seqio.TfdsDataSource(tfds_name=f"wmt18_translate/{config}:{WMT18_VERSION}",
                                    splits=dict(SPLITS)),
        preprocessors=[
            functools.partial(translation_pair, source=source, target=target),
            seqio.preprocessors.tokenize,
            seqio.CacheDatasetPlaceholder(),
            seqio.preprocessors.append_eos_after_trim,
        ],
        output_features={"inputs": feature, "targets": feature},
        metric_fns=[metrics.bleu],
        shuffle_buffer_size=100_000,
    )
    for key in ("inputs", "targets"):
      if task.output_features[key].vocabulary != vocabulary:
        raise ValueError(f"task {task.name!r} is registered with another vocabulary; "
                         "register under another suffix")
    names.append(task.name)
  return names


register_wmt18()
