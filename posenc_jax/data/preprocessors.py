"""The masked-LM input pipeline: full-sentence packing, BERT masking, ``mlm_dataset``.

``mlm_dataset(task, split, seq_len, batch_size, seed, ...)`` is what the pre-training loop
calls. Each element is a dict of ``[batch_size, seq_len]`` tensors (``as_numpy_iterator()``
gives numpy):

    input_ids     int32    [CLS] first, lines separated by [SEP], some tokens masked
    segment_ids   int32    zeros (no next-sentence prediction)
    mask          int32    1 at real tokens; all ones except in a padded last sequence
    mlm_targets   int32    the original id at selected positions, 0 elsewhere
    mlm_weights   float32  1 at selected positions, 0 elsewhere

and with ``segments=True`` (each line its own packed segment, as T5 packs; the default
lets attention cross the lines, RoBERTa's FULL-SENTENCES):

    packed_segment_ids  int32  1, 2, ... per piece of a line in the row ([CLS] in the
                               first, each [SEP] in its line's), 0 at padding
    position_ids        int32  the place in the piece, from 0 (0 at padding)

The pipeline, one epoch at a time (epoch ``e`` = 0, 1, ...):

1. the task's tokenised lines in source order (``seqio`` ``get_dataset``, no shuffle);
2. ``pack_lines``: each line followed by [SEP], all concatenated, cut into pieces of
   ``seq_len - 1`` tokens, each prefixed by [CLS]; a line longer than a sequence continues
   in the next one, and only the epoch's last sequence is padded (``cache``: kept in memory
   after the first epoch);
3. (``shuffle``) a block shuffle: blocks of ``shuffle_block`` consecutive sequences are
   permuted by ``stateless_shuffle`` with a seed from ``(seed, e, block)``;
4. the epochs are concatenated (``repeat``) into one global stream; element ``i`` of epoch
   ``e`` has the global stream position ``e * N + i`` (``N`` sequences per epoch);
5. ``sharding="stream"``: ``ds.shard(num_shards, shard_id)`` on that stream: host ``k``
   keeps positions ``k, k + num_shards, ...``, so hosts are disjoint, and the union of their
   step-``s`` batches is exactly the step-``s`` batch of one host with
   ``num_shards * batch_size``; but every host reads, packs and shuffles the whole stream;
6. ``bert_mask`` with the stateless seed ``(seed, e)`` folded with ``i``: a sequence's masks
   depend only on the seed, its epoch and its place in the epoch, never on the host or on
   where reading started;
7. ``batch(batch_size)``.

``sharding="source"`` (what the trainer uses, ``config.data_sharding``) moves the host split
to step 1: host ``k`` asks seqio for its part of the split,
``shard_info=seqio.ShardInfo(k, num_shards)`` (whole files when the split has at least
``num_shards`` files, else every ``num_shards``-th line before tokenisation), and packs,
shuffles and masks only that, so ``N`` hosts each do ``1/N`` of the work. Its own stream
(epochs of its own length ``N_k``) replaces steps 4-5, and with ``num_shards > 1`` the
shuffle and mask seeds are also folded with ``k`` (hosts do not repeat each other's random
numbers). Hosts stay disjoint and together cover the split each epoch; the union of their
batches is no longer one host's batch. With one host both modes are the same pipeline.

``cache`` (step 2) is a bool, or ``"auto"``: cache when the host's share of the split's
source is under ``CACHE_AUTO_MAX_BYTES`` (:func:`auto_cache`), so a large corpus streams from
its files every epoch with a host-memory footprint independent of its size.

Steps 3-5 (and the resume below) are :func:`packed_stream`'s, which the causal-LM pipeline
(:func:`posenc_jax.data.causal_lm.lm_dataset`) shares.

Everything is a function of the arguments, so the same call gives the same batches.
Resuming at step ``s``, two ways:

* the iterator's state: ``tf.train.Checkpoint(iterator=it)`` written after ``s`` batches and
  read into a fresh iterator of the same call continues with exactly batch ``s``, at a cost
  independent of ``s`` (every op here, seqio's file reading and tokenising included, saves
  its position). The state holds the elements buffered at that moment: the shuffle block
  being filled (up to ``shuffle_block * L * 8`` bytes: 16 MB at the defaults and
  ``L = 128``), the packing loop's carry and current chunk of ``lines_per_chunk`` lines,
  seqio's file-reading buffers, the prefetched batches, and, with ``cache`` on, the cached
  part of the epoch (``N * L * 8`` bytes once filled: 21 MB for WordNet's train split at
  ``L = 128``). The trainer saves it in every checkpoint
  (:mod:`posenc_jax.training.checkpoint`).
* ``mlm_dataset(..., start_step=s)`` (the fallback: checkpoints without an iterator state,
  or another number of hosts) gives what the uninterrupted dataset gives from its step
  ``s`` on. It starts at epoch ``s * batch_size * num_shards // N`` (``stream``; ``source``:
  ``s * batch_size // N_k``; counting ``N`` costs one pass over the split, done once per
  process and task) and skips the remainder before masking, so skipped sequences are only
  packed, never masked or batched, but reading and packing them costs time proportional to
  the position in the epoch.
"""

import functools
from collections.abc import Callable

import seqio
import tensorflow as tf

from posenc_jax.data import SHUFFLE_BLOCK
from posenc_jax.data import tasks as _tasks  # registers the tasks; source sizes
from posenc_jax.data.vocab import CLS_ID, MASK_ID, NUM_RESERVED, SEP_ID

MLM_FEATURES = ("input_ids", "segment_ids", "mask", "mlm_targets", "mlm_weights")
SEGMENT_FEATURES = ("position_ids", "packed_segment_ids")  # packed segments (pack_lines)
SHARDINGS = ("stream", "source")
# ``cache="auto"`` caches a packed epoch whose host share of source files (bytes as stored)
# is under this. The cache holds 8 bytes per token (input_ids and mask, int32): about 2x
# plain text and 6x gzipped text (WordNet: 3.3 MB of gzip -> 21 MB at L = 128), so at most
# about 1.6 GB of host memory.
CACHE_AUTO_MAX_BYTES = 256 * 2**20


def pack_lines(dataset: tf.data.Dataset, seq_len: int, feature: str = "text",
               lines_per_chunk: int = 1024, *, separator: int = SEP_ID,
               start: int | None = CLS_ID, segments: bool = False) -> tf.data.Dataset:
  """Full-sentence packing of tokenised lines into sequences of exactly ``seq_len`` tokens.

  Args:
    dataset: examples ``{feature: int32 [n]}`` (one tokenised line each, no [CLS]/[SEP]).
    seq_len: ``L``, tokens per output sequence, ``start`` included (at least 2 with a
      ``start`` token, else at least 1).
    feature: the token feature of ``dataset``.
    lines_per_chunk: lines concatenated per step of the packing loop (speed only; the
      output does not depend on it).
    separator: the id after every line (masked-LM: [SEP]; causal LM: EOS).
    start: the id every sequence begins with (masked-LM: [CLS]), or None for none.
    segments: also give each sequence's packed segments (below).

  Returns:
    ``{"input_ids": int32 [L], "mask": int32 [L]}``: ``input_ids[0]`` is ``start``, then the
    next ``L - 1`` tokens of ``line_1 [SEP] line_2 [SEP] ...`` (without a ``start``: the next
    ``L``); the last sequence is padded with 0 where ``mask`` is 0 (every other sequence has
    ``mask`` all ones). With ``segments``, also ``packed_segment_ids`` int32 ``[L]``: 1, 2,
    ... for the pieces of lines in the sequence, in order (``start`` in the first piece, each
    line's separator in its line's piece; 0 at padding), and ``position_ids`` int32 ``[L]``:
    each token's place in its piece, counted from 0 (0 at padding). The tokens are the same
    with or without ``segments``.
  """
  head = [] if start is None else [start]
  if seq_len < len(head) + 1:
    what = "[CLS] and one token" if start == CLS_ID else "the start token and one token"
    raise ValueError(f"seq_len: got {seq_len}; allowed: at least {len(head) + 1}" +
                     (f" ({what})" if head else ""))
  body = seq_len - len(head)
  width = 2 if segments else 1  # columns of the stream: token ids (and line numbers)

  def line(number, ex):
    """``[n + 1, width]``: the line's tokens and separator (and its number, from 1)."""
    tokens = tf.concat([tf.cast(ex[feature], tf.int32), [separator]], 0)
    columns = [tokens] + [tf.fill(tf.shape(tokens), tf.cast(number % 2**30, tf.int32) + 1)
                          ] * segments
    return tf.stack(columns, axis=1)

  lines = dataset.enumerate().map(line)
  chunks = lines.ragged_batch(lines_per_chunk).map(lambda r: (r.flat_values, False))
  # One empty final chunk flagged ``True`` flushes the remainder as a padded sequence.
  chunks = chunks.concatenate(
      tf.data.Dataset.from_tensors((tf.zeros([0, width], tf.int32), True)))

  def step(carry, chunk):
    tokens, last = chunk
    stream = tf.concat([carry, tokens], 0)                        # [n, width]
    size = tf.shape(stream)[0]
    n = size // body
    full = tf.reshape(stream[:n * body], [n, body, width])
    rest = stream[n * body:]
    left = size - n * body
    flush = tf.cast(last & (left > 0), tf.int32)                  # 0 or 1 padded sequence
    padded = tf.pad(rest, [[0, body - left], [0, 0]])[None, :flush * body]
    padded = tf.reshape(padded, [flush, body, width])
    ids = tf.concat([full, padded], 0)
    mask = tf.concat([tf.ones([n, body], tf.int32),
                      tf.cast(tf.range(body)[None, :] < left, tf.int32)[:flush]], 0)
    return rest, (ids, mask)

  def sequence(ids, mask):
    """``[body, width]`` ids and ``[body]`` mask -> the output dict, ``start`` prepended (in
    the first piece)."""
    if head:
      ids = tf.concat([tf.concat([tf.constant(head, tf.int32), ids[0, 1:]], 0)[None], ids], 0)
      mask = tf.concat([[1], mask], 0)
    out = {"input_ids": tf.ensure_shape(ids[:, 0], [seq_len]),
           "mask": tf.ensure_shape(mask, [seq_len])}
    if segments:
      out |= _pieces(ids[:, 1], mask)
    return out

  packed = chunks.scan(tf.zeros([0, width], tf.int32), step).unbatch()
  return packed.map(sequence)


def _pieces(lines: tf.Tensor, mask: tf.Tensor) -> dict[str, tf.Tensor]:
  """``packed_segment_ids`` (1, 2, ... per run of equal line numbers) and ``position_ids``
  (the place in the run) of one packed sequence, both 0 where ``mask`` is 0: ``[L]`` each."""
  length = tf.shape(lines)[0]
  starts = tf.concat([[True], lines[1:] != lines[:-1]], 0)
  run = tf.cumsum(tf.cast(starts, tf.int32)) - 1
  index = tf.range(length)
  first = tf.math.unsorted_segment_min(index, run, length)
  return {"packed_segment_ids": (run + 1) * mask,
          "position_ids": (index - tf.gather(first, run)) * mask}


def bert_mask(example: dict, seed: tf.Tensor, vocab_size: int, mask_rate: float = 0.15,
              mask_token_rate: float = 0.8, random_token_rate: float = 0.1) -> dict:
  """BERT's masked-LM corruption of one packed sequence, deterministic given ``seed``.

  Candidates are the real tokens (``mask`` 1) that are not reserved ids (< ``NUM_RESERVED``:
  pad, eos, unk, [CLS], [SEP], [MASK]). Exactly ``max(1, round(mask_rate * c))`` of the
  ``c`` candidates are selected (none if ``c`` is 0), uniformly. A selected token becomes
  [MASK] with probability ``mask_token_rate``, a uniform random learned piece (ids
  ``NUM_RESERVED .. vocab_size - 1``) with ``random_token_rate``, else stays.

  Args:
    example: ``{"input_ids": int32 [L], "mask": int32 [L]}`` (``pack_lines`` output).
    seed: stateless seed, int64 ``[2]``.
    vocab_size: the vocabulary size (random replacements are below it).

  Returns:
    ``{"input_ids", "segment_ids", "mask", "mlm_targets", "mlm_weights"}``, each ``[L]``
    (module docstring), and ``example``'s ``SEGMENT_FEATURES`` as they are.
  """
  ids, mask = example["input_ids"], example["mask"]
  length = tf.shape(ids)[0]
  candidate = (mask > 0) & (ids >= NUM_RESERVED)
  num_candidates = tf.reduce_sum(tf.cast(candidate, tf.int32))
  num_selected = tf.where(
      num_candidates > 0,
      tf.maximum(1, tf.cast(tf.round(mask_rate * tf.cast(num_candidates, tf.float32)), tf.int32)),
      0)
  select_seed, action_seed, token_seed = tf.unstack(
      tf.random.experimental.stateless_split(seed, 3))
  scores = tf.where(candidate, tf.random.stateless_uniform([length], select_seed), 2.0)
  rank = tf.math.invert_permutation(tf.argsort(scores, stable=True))
  selected = rank < num_selected               # the num_selected lowest-scoring candidates
  action = tf.random.stateless_uniform([length], action_seed)
  random_ids = tf.random.stateless_uniform([length], token_seed, minval=NUM_RESERVED,
                                           maxval=vocab_size, dtype=tf.int32)
  corrupted = tf.where(action < mask_token_rate, MASK_ID,
                       tf.where(action < mask_token_rate + random_token_rate, random_ids, ids))
  return {
      "input_ids": tf.where(selected, corrupted, ids),
      "segment_ids": tf.zeros_like(ids),
      "mask": mask,
      "mlm_targets": tf.where(selected, ids, 0),
      "mlm_weights": tf.cast(selected, tf.float32),
  } | {k: example[k] for k in SEGMENT_FEATURES if k in example}


def shard_info(shard_id: int = 0, num_shards: int = 1) -> seqio.ShardInfo | None:
  """seqio's ``ShardInfo`` of host ``shard_id`` of ``num_shards`` (None for one host: the
  whole split, exactly as without sharding)."""
  check_shard(shard_id, num_shards)
  return seqio.ShardInfo(shard_id, num_shards) if num_shards > 1 else None


def check_shard(shard_id: int, num_shards: int, sharding: str = "stream") -> None:
  """One-line ``ValueError`` for a shard outside ``[0, num_shards)`` or an unknown mode."""
  if sharding not in SHARDINGS:
    raise ValueError(f"sharding: got {sharding!r}; allowed: {', '.join(SHARDINGS)}")
  if not 0 <= shard_id < num_shards:
    raise ValueError(f"shard_id: got {shard_id}; allowed: 0 <= shard_id < num_shards={num_shards}")


def packed_epoch(task_name: str, split: str, seq_len: int, feature: str = "text",
                 shard_id: int = 0, num_shards: int = 1, segments: bool = False):
  """One epoch of ``pack_lines`` over a task's split (or host ``shard_id``'s part of it,
  module docstring), in source order (no masking); ``segments`` as ``pack_lines``'s."""
  task = seqio.get_mixture_or_task(task_name)
  lines = task.get_dataset(None, split=split, shuffle=False, num_epochs=1, use_cached=False,
                           shard_info=shard_info(shard_id, num_shards))
  return pack_lines(lines, seq_len, feature, segments=segments)


def count(dataset: tf.data.Dataset) -> int:
  """The number of elements of a finite dataset (one pass)."""
  return int(dataset.reduce(tf.constant(0, tf.int64), lambda n, _: n + 1).numpy())


def epoch_length(task_name: str, split: str, seq_len: int, feature: str = "text",
                 shard_id: int = 0, num_shards: int = 1) -> int:
  """``N``: packed sequences per epoch (one pass over the split, or over host ``shard_id``'s
  part of it; cached per process)."""
  return _epoch_length(task_name, split, seq_len, feature, shard_id, num_shards)


@functools.lru_cache(maxsize=None)
def _epoch_length(*args) -> int:
  return count(packed_epoch(*args))


def auto_cache(task_name: str, split: str, num_shards: int = 1,
               max_bytes: int = CACHE_AUTO_MAX_BYTES) -> bool:
  """``cache="auto"``'s decision: True when a host's share of the split's source
  (:func:`posenc_jax.data.tasks.source_bytes` divided by ``num_shards``) is known and under
  ``max_bytes``; an unknown size streams."""
  size = _tasks.source_bytes(seqio.get_mixture_or_task(task_name), split)
  return size is not None and size / num_shards < max_bytes


def resolve_cache(cache: bool | str, task_name: str, split: str, num_shards: int) -> bool:
  """``cache`` as a bool (``"auto"``: :func:`auto_cache`); one-line ``ValueError`` otherwise."""
  if cache == "auto":
    return auto_cache(task_name, split, num_shards)
  if not isinstance(cache, bool):
    raise ValueError(f"cache: got {cache!r}; allowed: true, false or 'auto'")
  return cache


def root_seed(seed: int, shard_id: int = 0, num_shards: int = 1,
              sharding: str = "stream") -> tf.Tensor:
  """The stateless seed (int64 ``[2]``) the shuffle (folded with 0) and mask (folded with 1)
  seeds derive from: ``[seed, 0]``, or for ``source`` sharding over several hosts that seed
  folded with 2 and the host (module docstring)."""
  base = tf.constant([seed, 0], tf.int64)
  if sharding == "source" and num_shards > 1:
    fold = tf.random.experimental.stateless_fold_in
    base = fold(fold(base, 2), shard_id)
  return base


def packed_stream(packed: tf.data.Dataset, epoch_size: Callable[[], int], batch_size: int,
                  seed: int, *, shard_id: int = 0, num_shards: int = 1, repeat: bool = True,
                  shuffle: bool | None = None, start_step: int = 0,
                  shuffle_block: int = SHUFFLE_BLOCK, cache: bool = True,
                  sharding: str = "stream") -> tf.data.Dataset:
  """Steps 3-5 of the module docstring: this host's share of the stream of epochs.

  Args:
    packed: one epoch of fixed-length examples (dicts of ``[L]`` tensors), in source order:
      the whole split (``stream``) or this host's part of it (``source``).
    epoch_size: returns ``N`` (``source``: ``N_k``), the examples of ``packed`` (called only
      to resume from ``start_step``).
    batch_size: examples per batch on this host (to turn ``start_step`` into positions).
    seed: the seed of shuffling.
    shard_id, num_shards, repeat, shuffle, start_step, shuffle_block, cache, sharding: as
      :func:`mlm_dataset`'s (``cache`` a bool here).

  Returns:
    ``(e, i, x)`` elements: example ``x`` at position ``i`` of epoch ``e``.
  """
  check_shard(shard_id, num_shards, sharding)
  shuffle = repeat if shuffle is None else shuffle
  if cache:
    packed = packed.cache()
  shuffle_base = tf.random.experimental.stateless_fold_in(
      root_seed(seed, shard_id, num_shards, sharding), 0)

  def epoch(e):
    """(e, position in epoch, example) for every packed sequence of epoch ``e``."""
    ds = packed
    if shuffle:
      epoch_seed = tf.random.experimental.stateless_fold_in(shuffle_base, e)
      def permute(block, x):
        block_seed = tf.random.experimental.stateless_fold_in(epoch_seed, block)
        rows = tf.shape(next(iter(x.values())))[0]
        order = tf.random.experimental.stateless_shuffle(tf.range(rows), block_seed)
        return {k: tf.gather(v, order) for k, v in x.items()}
      ds = ds.batch(shuffle_block).enumerate().map(permute).unbatch()
    return ds.enumerate().map(lambda i, x: (e, i, x))

  hosts = num_shards if sharding == "stream" else 1    # streams sharded after packing
  skip = start_step * batch_size * hosts                # positions in the packed stream
  first_epoch = 0
  if repeat and skip:
    first_epoch, skip = divmod(skip, epoch_size())
  epochs = (tf.data.Dataset.counter(first_epoch) if repeat
            else tf.data.Dataset.range(1))
  stream = epochs.flat_map(epoch).skip(skip)
  return stream.shard(num_shards, shard_id) if hosts > 1 else stream


def mlm_dataset(task_name: str, split: str, seq_len: int, batch_size: int, seed: int,
                shard_id: int = 0, num_shards: int = 1, repeat: bool = True,
                shuffle: bool | None = None, start_step: int = 0, feature: str = "text",
                shuffle_block: int = SHUFFLE_BLOCK, drop_remainder: bool = True,
                cache: bool | str = True, mask_rate: float = 0.15,
                sharding: str = "stream", segments: bool = False) -> tf.data.Dataset:
  """Batches of masked-LM examples of a seqio task (module docstring: order, seeds, resume).

  Args:
    task_name: a registered seqio task with a tokenised ``feature`` (``wordnet_glosses``).
    split: the task split.
    seq_len: ``L``, tokens per sequence, [CLS] included.
    batch_size: sequences per batch on this host.
    seed: the seed of shuffling and masking.
    shard_id, num_shards: this host (``jax.process_index()``, ``jax.process_count()``).
    repeat: endless epochs (each shuffled and masked anew) if True, else one epoch.
    shuffle: block-shuffle each epoch; default ``repeat`` (train shuffled, eval in order).
    start_step: batches of this host to skip (resume after ``start_step`` steps).
    feature: the task's token feature.
    shuffle_block: sequences per shuffled block.
    drop_remainder: drop a last partial batch (only with ``repeat=False``), keeping shapes
      static.
    cache: keep the packed epoch in memory after its first pass, so later epochs skip
      tokenising and packing (``N * L * 8`` bytes: 21 MB for WordNet's train split at
      ``L = 128``); False for corpora that do not fit; ``"auto"``: :func:`auto_cache`.
    mask_rate: fraction of maskable tokens selected for prediction (:func:`bert_mask`).
    sharding: ``"stream"`` (every host packs the global stream and keeps its positions) or
      ``"source"`` (every host reads and packs only its part of the split); module
      docstring.
    segments: each line is its own packed segment: the batches also hold
      ``position_ids`` (restarting at 0 in every piece of a line) and
      ``packed_segment_ids`` (:func:`pack_lines`), which the model uses to keep attention
      within a piece and positions per piece; tokens, masks and targets are unchanged.

  Returns:
    ``tf.data.Dataset`` of dicts of ``[batch_size, L]`` tensors (``MLM_FEATURES``, and with
    ``segments`` ``SEGMENT_FEATURES``).
  """
  task = seqio.get_mixture_or_task(task_name)
  vocab_size = task.output_features[feature].vocabulary.vocab_size
  check_shard(shard_id, num_shards, sharding)
  part = (shard_id, num_shards) if sharding == "source" else (0, 1)
  ds = packed_stream(packed_epoch(task_name, split, seq_len, feature, *part, segments),
                     lambda: epoch_length(task_name, split, seq_len, feature, *part),
                     batch_size, seed, shard_id=shard_id, num_shards=num_shards, repeat=repeat,
                     shuffle=shuffle, start_step=start_step, shuffle_block=shuffle_block,
                     cache=resolve_cache(cache, task_name, split, part[1]), sharding=sharding)
  mask_base = tf.random.experimental.stateless_fold_in(
      root_seed(seed, shard_id, num_shards, sharding), 1)

  def corrupt(e, i, x):
    seed_e = tf.random.experimental.stateless_fold_in(mask_base, e)
    return bert_mask(x, tf.random.experimental.stateless_fold_in(seed_e, i), vocab_size,
                     mask_rate)

  ds = ds.map(corrupt, num_parallel_calls=tf.data.AUTOTUNE)
  ds = ds.batch(batch_size, drop_remainder=drop_remainder or repeat)
  return ds.prefetch(tf.data.AUTOTUNE)
