"""The masked-LM input pipeline: full-sentence packing, BERT masking, ``mlm_dataset``.

``mlm_dataset(task, split, seq_len, batch_size, seed, ...)`` is what the pre-training loop
calls. Each element is a dict of ``[batch_size, seq_len]`` tensors (``as_numpy_iterator()``
gives numpy):

    input_ids     int32    [CLS] first, lines separated by [SEP], some tokens masked
    segment_ids   int32    zeros (no next-sentence prediction)
    mask          int32    1 at real tokens; all ones except in a padded last sequence
    mlm_targets   int32    the original id at selected positions, 0 elsewhere
    mlm_weights   float32  1 at selected positions, 0 elsewhere

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
5. ``ds.shard(num_shards, shard_id)`` on that stream: host ``k`` keeps positions
   ``k, k + num_shards, ...``, so hosts are disjoint, and the union of their step-``s``
   batches is exactly the step-``s`` batch of one host with ``num_shards * batch_size``;
6. ``bert_mask`` with the stateless seed ``(seed, e)`` folded with ``i``: a sequence's masks
   depend only on the seed, its epoch and its place in the epoch, never on the host or on
   where reading started;
7. ``batch(batch_size)``.

Steps 3-5 (and the resume below) are :func:`packed_stream`'s, which the causal-LM pipeline
(:func:`posenc_jax.data.causal_lm.lm_dataset`) shares.

Everything is a function of the arguments, so the same call gives the same batches.
Resuming at step ``s``: ``mlm_dataset(..., start_step=s)`` gives what the uninterrupted
dataset gives from its step ``s`` on. It starts at epoch ``s * batch_size * num_shards // N``
(counting ``N`` costs one pass over the split, done once per process and task) and skips the
remainder before masking, so skipped sequences are only packed, never masked or batched.
(``mlm_dataset(...).skip(s)`` gives the same batches too, but masks and batches every
skipped sequence.) Saving the ``tf.data`` iterator with ``tf.train.Checkpoint(iterator=it)``
also works, but its state holds buffered elements (the in-memory cache included) and ties a
checkpoint to the pipeline's structure; ``start_step`` needs nothing but the step number.
"""

import functools
from collections.abc import Callable

import seqio
import tensorflow as tf

from posenc_jax.data import tasks as _tasks  # noqa: F401  (registers the tasks)
from posenc_jax.data.vocab import CLS_ID, MASK_ID, NUM_RESERVED, SEP_ID

MLM_FEATURES = ("input_ids", "segment_ids", "mask", "mlm_targets", "mlm_weights")


def pack_lines(dataset: tf.data.Dataset, seq_len: int, feature: str = "text",
               lines_per_chunk: int = 1024, *, separator: int = SEP_ID,
               start: int | None = CLS_ID) -> tf.data.Dataset:
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

  Returns:
    ``{"input_ids": int32 [L], "mask": int32 [L]}``: ``input_ids[0]`` is ``start``, then the
    next ``L - 1`` tokens of ``line_1 [SEP] line_2 [SEP] ...`` (without a ``start``: the next
    ``L``); the last sequence is padded with 0 where ``mask`` is 0 (every other sequence has
    ``mask`` all ones).
  """
  head = [] if start is None else [start]
  if seq_len < len(head) + 1:
    what = "[CLS] and one token" if start == CLS_ID else "the start token and one token"
    raise ValueError(f"seq_len: got {seq_len}; allowed: at least {len(head) + 1}" +
                     (f" ({what})" if head else ""))
  body = seq_len - len(head)
  lines = dataset.map(lambda ex: tf.concat([tf.cast(ex[feature], tf.int32), [separator]], 0))
  chunks = lines.ragged_batch(lines_per_chunk).map(lambda r: (r.flat_values, False))
  # One empty final chunk flagged ``True`` flushes the remainder as a padded sequence.
  chunks = chunks.concatenate(tf.data.Dataset.from_tensors((tf.zeros([0], tf.int32), True)))

  def step(carry, chunk):
    tokens, last = chunk
    stream = tf.concat([carry, tokens], 0)
    n = tf.size(stream) // body
    full = tf.reshape(stream[:n * body], [n, body])
    rest = stream[n * body:]
    flush = tf.cast(last & (tf.size(rest) > 0), tf.int32)       # 0 or 1 padded sequence
    padded = tf.pad(rest, [[0, body - tf.size(rest)]])[None, :flush * body]
    padded = tf.reshape(padded, [flush, body])
    ids = tf.concat([full, padded], 0)
    mask = tf.concat([tf.ones_like(full),
                      tf.cast(tf.range(body)[None, :] < tf.size(rest), tf.int32)[:flush]], 0)
    return rest, (ids, mask)

  packed = chunks.scan(tf.zeros([0], tf.int32), step).unbatch()
  return packed.map(lambda ids, mask: {
      "input_ids": tf.ensure_shape(tf.concat([tf.constant(head, tf.int32), ids], 0), [seq_len]),
      "mask": tf.ensure_shape(tf.concat([tf.ones([len(head)], tf.int32), mask], 0), [seq_len]),
  })


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
    (module docstring).
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
  }


def packed_epoch(task_name: str, split: str, seq_len: int, feature: str = "text"):
  """One epoch of ``pack_lines`` over a task's split, in source order (no masking)."""
  task = seqio.get_mixture_or_task(task_name)
  lines = task.get_dataset(None, split=split, shuffle=False, num_epochs=1, use_cached=False)
  return pack_lines(lines, seq_len, feature)


def count(dataset: tf.data.Dataset) -> int:
  """The number of elements of a finite dataset (one pass)."""
  return int(dataset.reduce(tf.constant(0, tf.int64), lambda n, _: n + 1).numpy())


@functools.lru_cache(maxsize=None)
def epoch_length(task_name: str, split: str, seq_len: int, feature: str = "text") -> int:
  """``N``: packed sequences per epoch (one pass over the split; cached per process)."""
  return count(packed_epoch(task_name, split, seq_len, feature))


def packed_stream(packed: tf.data.Dataset, epoch_size: Callable[[], int], batch_size: int,
                  seed: int, *, shard_id: int = 0, num_shards: int = 1, repeat: bool = True,
                  shuffle: bool | None = None, start_step: int = 0, shuffle_block: int = 16_384,
                  cache: bool = True) -> tf.data.Dataset:
  """Steps 3-5 of the module docstring: this host's share of the stream of epochs.

  Args:
    packed: one epoch of fixed-length examples (dicts of ``[L]`` tensors), in source order.
    epoch_size: returns ``N``, the examples of an epoch (called only to resume).
    batch_size: examples per batch on this host (to turn ``start_step`` into positions).
    seed: the seed of shuffling.
    shard_id, num_shards, repeat, shuffle, start_step, shuffle_block, cache: as
      :func:`mlm_dataset`'s.

  Returns:
    ``(e, i, x)`` elements: example ``x`` at position ``i`` of epoch ``e``.
  """
  if not 0 <= shard_id < num_shards:
    raise ValueError(f"shard_id: got {shard_id}; allowed: 0 <= shard_id < num_shards={num_shards}")
  shuffle = repeat if shuffle is None else shuffle
  if cache:
    packed = packed.cache()
  shuffle_base = tf.random.experimental.stateless_fold_in(tf.constant([seed, 0], tf.int64), 0)

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

  skip = start_step * batch_size * num_shards            # global stream positions
  first_epoch = 0
  if repeat and skip:
    first_epoch, skip = divmod(skip, epoch_size())
  epochs = (tf.data.Dataset.counter(first_epoch) if repeat
            else tf.data.Dataset.range(1))
  return epochs.flat_map(epoch).skip(skip).shard(num_shards, shard_id)


def mlm_dataset(task_name: str, split: str, seq_len: int, batch_size: int, seed: int,
                shard_id: int = 0, num_shards: int = 1, repeat: bool = True,
                shuffle: bool | None = None, start_step: int = 0, feature: str = "text",
                shuffle_block: int = 16_384, drop_remainder: bool = True,
                cache: bool = True, mask_rate: float = 0.15) -> tf.data.Dataset:
  """Batches of masked-LM examples of a seqio task (module docstring: order, seeds, resume).

  Args:
    task_name: a registered seqio task with a tokenised ``feature`` (``wordnet_glosses``).
    split: the task split.
    seq_len: ``L``, tokens per sequence, [CLS] included.
    batch_size: sequences per batch on this host.
    seed: the seed of shuffling and masking.
    shard_id, num_shards: this host's shard of the global stream (``jax.process_index()``,
      ``jax.process_count()``).
    repeat: endless epochs (each shuffled and masked anew) if True, else one epoch.
    shuffle: block-shuffle each epoch; default ``repeat`` (train shuffled, eval in order).
    start_step: batches of this host to skip (resume after ``start_step`` steps).
    feature: the task's token feature.
    shuffle_block: sequences per shuffled block.
    drop_remainder: drop a last partial batch (only with ``repeat=False``), keeping shapes
      static.
    cache: keep the packed epoch in memory after its first pass, so later epochs skip
      tokenising and packing (``N * L * 8`` bytes: 21 MB for WordNet's train split at
      ``L = 128``); False for corpora that do not fit.
    mask_rate: fraction of maskable tokens selected for prediction (:func:`bert_mask`).

  Returns:
    ``tf.data.Dataset`` of dicts of ``[batch_size, L]`` tensors (``MLM_FEATURES``).
  """
  task = seqio.get_mixture_or_task(task_name)
  vocab_size = task.output_features[feature].vocabulary.vocab_size
  ds = packed_stream(packed_epoch(task_name, split, seq_len, feature),
                     lambda: epoch_length(task_name, split, seq_len, feature), batch_size, seed,
                     shard_id=shard_id, num_shards=num_shards, repeat=repeat, shuffle=shuffle,
                     start_step=start_step, shuffle_block=shuffle_block, cache=cache)
  mask_base = tf.random.experimental.stateless_fold_in(tf.constant([seed, 0], tf.int64), 1)

  def corrupt(e, i, x):
    seed_e = tf.random.experimental.stateless_fold_in(mask_base, e)
    return bert_mask(x, tf.random.experimental.stateless_fold_in(seed_e, i), vocab_size,
                     mask_rate)

  ds = ds.map(corrupt, num_parallel_calls=tf.data.AUTOTUNE)
  ds = ds.batch(batch_size, drop_remainder=drop_remainder or repeat)
  return ds.prefetch(tf.data.AUTOTUNE)
