"""Synthetic probes of position: copy/reverse, multi-query associative recall, passkey.

Trained at one length and scored at longer ones (Ruoss et al. 2023; Kazemnejad et al. 2023;
Zoology's MQAR; Mohtashami & Jaggi 2023), generated on the fly from ``(seed, index)``: example
``i`` is the same whatever the batch size, the host count or the step a run resumed at.

An example of length ``L`` is ``{"targets": int32 [L], "loss_weights": float32 [L]}`` for the
causal LM (:func:`posenc_jax.training.objectives.lm_objective`): 0 pads the end of a shorter
example, and the weights are 1 exactly on the answer tokens. Ids (all far below any model's
vocabulary, :meth:`Probe.vocab_size`): 0 padding, :data:`SEPARATOR`, :data:`KEY_MARKER`,
:data:`FILLER`, then each probe's alphabet from :data:`FIRST_SYMBOL`::

    copy     x_1 .. x_n SEP x_1 .. x_n [0]    n = (L - 1) // 2 symbols of ``alphabet``, or
             with ``min_symbols`` set, n drawn uniformly in [min_symbols, (L - 1) // 2] per
             example, the rest padding (training on every instance length up to L, as
             Kazemnejad et al. 2023); (reverse=True: the answer is x_n .. x_1); answer: the
             n tokens after SEP
    mqar     k_1 v_1 .. k_P v_P, then Q queries "k v" (distinct keys of the P pairs) at random
             places in FILLER tokens up to L (Zoology's layout); keys and values from
             disjoint alphabets; answer: the value after each query key
    passkey  filler words w_1 .. w_W repeated, with "KEY d_1 .. d_D" inserted at a depth,
             then "SEP d_1 .. d_D" ending the row; answer: the D digits after SEP. The depth
             is the fraction of the filler before the key (0: first, 1: just before SEP);
             example ``i`` draws it uniformly in bin ``i % depth_bins``

Names: ``copy``, ``reverse`` (copy with ``reverse=True``), ``mqar``, ``passkey``.
``probe(name_or_spec)`` gives the parameters (a dataclass per probe; ``describe`` gives them
as JSON), ``example``/``batches`` the data, ``score`` a model's accuracy at a length (greedy
argmax under teacher forcing; passkey also per depth bin). Training: the task
``probe:<name>`` of ``configs/probe.py``.
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import numpy as np

from posenc_jax.messages import nearest
from posenc_jax.training.config import TrainConfigError

SEPARATOR = 1  # copy: between the sequence and its copy; passkey: the question marker
KEY_MARKER = 2  # passkey: before the hidden key
FILLER = 3  # mqar: the tokens around the queries
FIRST_SYMBOL = 4  # each probe's alphabet starts here
TASK_PREFIX = "probe:"  # config.task of a probe: probe:<name>
HELD_OUT_SEED = 1_000_003  # the training config's evaluation batches use this seed


def is_probe(task: str) -> bool:
  """Whether ``task`` (a train config's ``task``) names a probe, whose batches this module
  generates with numpy (every other task is read through seqio)."""
  return str(task).startswith(TASK_PREFIX)


class ProbeError(TrainConfigError):
  """An invalid probe name, parameter or length."""


def _positive(spec, *fields: str) -> None:
  for field in fields:
    value = getattr(spec, field)
    if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
      raise ProbeError(f"probe.{field}: got {value!r}; allowed: a positive integer")


@dataclasses.dataclass(frozen=True)
class Probe(abc.ABC):
  """A probe's parameters; subclasses fill rows and say which lengths they fit."""

  name: ClassVar[str]

  @abc.abstractmethod
  def min_length(self) -> int:
    """The shortest row that holds the probe's structure."""

  @abc.abstractmethod
  def vocab_size(self) -> int:
    """One more than the largest id the probe emits."""

  @abc.abstractmethod
  def fill(self, targets: np.ndarray, weights: np.ndarray, rng: np.random.Generator,
           index: int, depth: float | None) -> None:
    """Writes example ``index`` into the zeroed rows ``targets`` and ``weights`` ``[L]``
    (``depth``: the passkey's, None to draw it)."""

  @abc.abstractmethod
  def answer_symbols(self) -> int:
    """``k``: the symbols each answer token is drawn from, uniformly."""

  def chance(self, length: int) -> float:
    """The whole-answer accuracy at ``length`` (as :func:`score` runs it) of a guess that knows
    the answer's symbols and length but not the row: ``k ** -n`` for its ``n`` answer tokens.

    Raises:
      ProbeError: ``length`` too short for the probe.
    """
    answer = int(example(self.scored(), length, 0, 0)["loss_weights"].sum())
    return float(self.answer_symbols()) ** -answer

  def scored(self) -> Probe:
    """The probe as :func:`score` runs it at a length: each row the longest instance that
    the length holds (a probe trained on shorter instances too is scored at the longest)."""
    return self

  def check_length(self, length: int, field: str = "length") -> None:
    if not (isinstance(length, int) and length >= self.min_length()):
      raise ProbeError(f"{field}: got {length!r}; allowed: an integer >= {self.min_length()} "
                       f"for {describe(self)}")


@dataclasses.dataclass(frozen=True)
class Copy(Probe):
  """``alphabet`` symbols; ``reverse``: answer the sequence backwards; ``min_symbols``: None
  (every row ``(L - 1) // 2`` symbols) or the fewest symbols a row draws."""

  name: ClassVar[str] = "copy"
  alphabet: int = 32
  reverse: bool = False
  min_symbols: int | None = None

  def __post_init__(self):
    _positive(self, "alphabet")
    if not isinstance(self.reverse, bool):
      raise ProbeError(f"probe.reverse: got {self.reverse!r}; allowed: true or false")
    if self.min_symbols is not None:
      _positive(self, "min_symbols")

  def scored(self) -> Probe:
    return dataclasses.replace(self, min_symbols=None)

  def min_length(self) -> int:
    return 2 * (self.min_symbols or 1) + 1

  def vocab_size(self) -> int:
    return FIRST_SYMBOL + self.alphabet

  def answer_symbols(self) -> int:
    return self.alphabet

  def fill(self, targets, weights, rng, index, depth):
    del index, depth
    n = (len(targets) - 1) // 2
    if self.min_symbols is not None:
      n = int(rng.integers(self.min_symbols, n + 1))
    symbols = FIRST_SYMBOL + rng.integers(0, self.alphabet, n)
    targets[:n] = symbols
    targets[n] = SEPARATOR
    targets[n + 1:2 * n + 1] = symbols[::-1] if self.reverse else symbols
    weights[n + 1:2 * n + 1] = 1.0


@dataclasses.dataclass(frozen=True)
class MQAR(Probe):
  """``pairs`` key-value pairs (distinct keys of ``keys``, values of ``values``), then
  ``queries`` of their keys, each followed by its value."""

  name: ClassVar[str] = "mqar"
  pairs: int = 8
  queries: int = 8
  keys: int = 32
  values: int = 32

  def __post_init__(self):
    _positive(self, "pairs", "queries", "keys", "values")
    if self.pairs > self.keys:
      raise ProbeError(f"probe.pairs: got {self.pairs}; allowed: at most keys={self.keys} "
                       "(the keys of a row are distinct)")
    if self.queries > self.pairs:
      raise ProbeError(f"probe.queries: got {self.queries}; allowed: at most "
                       f"pairs={self.pairs}")

  def min_length(self) -> int:
    return 2 * (self.pairs + self.queries)

  def vocab_size(self) -> int:
    return FIRST_SYMBOL + self.keys + self.values

  def answer_symbols(self) -> int:
    return self.values

  def fill(self, targets, weights, rng, index, depth):
    del index, depth
    length, context = len(targets), 2 * self.pairs
    keys = FIRST_SYMBOL + rng.choice(self.keys, self.pairs, replace=False)
    values = FIRST_SYMBOL + self.keys + rng.integers(0, self.values, self.pairs)
    targets[0:context:2], targets[1:context:2] = keys, values
    asked = rng.choice(self.pairs, self.queries, replace=False)
    # Query j starts at context + 2j + g_j, with gaps g_1 <= .. <= g_Q of filler before it.
    free = length - context - 2 * self.queries
    gaps = np.sort(rng.choice(free + self.queries, self.queries, replace=False)
                   ) - np.arange(self.queries)
    starts = context + 2 * np.arange(self.queries) + gaps
    targets[context:] = FILLER
    targets[starts], targets[starts + 1] = keys[asked], values[asked]
    weights[starts + 1] = 1.0


@dataclasses.dataclass(frozen=True)
class Passkey(Probe):
  """A ``digits``-digit passkey in filler text of ``filler_words`` repeated words; example
  ``i`` hides it in depth bin ``i % depth_bins``."""

  name: ClassVar[str] = "passkey"
  digits: int = 5
  filler_words: int = 5
  depth_bins: int = 5

  def __post_init__(self):
    _positive(self, "digits", "filler_words", "depth_bins")

  def min_length(self) -> int:
    return 2 * (self.digits + 1) + 1

  def vocab_size(self) -> int:
    return FIRST_SYMBOL + 10 + self.filler_words

  def answer_symbols(self) -> int:
    return 10  # digits

  def filler(self, length: int) -> int:
    """The filler tokens of a row of ``length``."""
    return length - 2 * (self.digits + 1)

  def fill(self, targets, weights, rng, index, depth):
    length, block, filler = len(targets), self.digits + 1, self.filler(len(targets))
    if depth is None:  # filler tokens before the key: uniform over those of the bin
      b = index % self.depth_bins
      low = -(-b * filler // self.depth_bins)
      high = filler if b == self.depth_bins - 1 else -(-(b + 1) * filler // self.depth_bins) - 1
      before = int(rng.integers(low, max(low, high) + 1))  # an empty bin: its lower edge
    else:
      before = round(depth * filler)
    key = FIRST_SYMBOL + rng.integers(0, 10, self.digits)
    words = FIRST_SYMBOL + 10 + np.arange(filler) % self.filler_words
    targets[:before] = words[:before]
    targets[before] = KEY_MARKER
    targets[before + 1:before + block] = key
    targets[before + block:length - block] = words[before:]
    targets[length - block] = SEPARATOR
    targets[length - self.digits:] = key
    weights[length - self.digits:] = 1.0

  def depths(self, targets: np.ndarray) -> np.ndarray:
    """``[B]`` depth of the key in each row of ``targets`` ``[B, L]``."""
    return np.argmax(targets == KEY_MARKER, axis=-1) / self.filler(targets.shape[-1])

  def depth_bin(self, depth: np.ndarray) -> np.ndarray:
    return np.minimum((depth * self.depth_bins).astype(int), self.depth_bins - 1)

  def bin_names(self) -> list[str]:
    """``"0.0-0.2"``, ..: the depth bins' edges (3 decimals at most)."""
    edges = [round(float(e), 3) for e in np.linspace(0, 1, self.depth_bins + 1)]
    return [f"{lo}-{hi}" for lo, hi in zip(edges[:-1], edges[1:])]


# Name -> (probe class, parameters the name sets).
PROBES: dict[str, tuple[type[Probe], dict[str, Any]]] = {
    "copy": (Copy, {}), "reverse": (Copy, {"reverse": True}), "mqar": (MQAR, {}),
    "passkey": (Passkey, {})}


def probe(name_or_spec: str | Probe | Mapping[str, Any],
          params: Mapping[str, Any] | None = None, field: str = "probe") -> Probe:
  """The probe of a name (``copy``, ``reverse``, ``mqar``, ``passkey``), of a
  :func:`describe` dict, or ``name_or_spec`` itself; ``params`` override its parameters.

  Raises:
    ProbeError: one line naming ``field`` (an unknown name) or ``probe.<parameter>``.
  """
  if isinstance(name_or_spec, Probe):
    name_or_spec = describe(name_or_spec)
  if isinstance(name_or_spec, Mapping):
    params = {k: v for k, v in name_or_spec.items() if k != "name"} | dict(params or {})
    name_or_spec = name_or_spec.get("name")
  if name_or_spec not in PROBES:
    raise ProbeError(f"{field}: got {name_or_spec!r}{nearest(name_or_spec, list(PROBES))} "
                     f"allowed: {', '.join(PROBES)}")
  cls, preset = PROBES[name_or_spec]
  allowed = [f.name for f in dataclasses.fields(cls)]
  for key in params or {}:
    if key not in allowed:
      raise ProbeError(f"probe.{key}: not a parameter of probe {name_or_spec!r}"
                       f"{nearest(key, allowed)} allowed: {', '.join(allowed)}")
  return cls(**(preset | dict(params or {})))


def describe(spec: Probe) -> dict[str, Any]:
  """``{"name": ..., <parameter>: value, ...}`` (JSON; :func:`probe` reads it back)."""
  return {"name": spec.name, **dataclasses.asdict(spec)}


def example(spec: Probe, length: int, seed: int, index: int,
            depth: float | None = None) -> dict[str, np.ndarray]:
  """Example ``index`` of ``spec`` at ``length`` for ``seed``: ``targets`` int32 ``[L]`` and
  ``loss_weights`` float32 ``[L]``; ``depth`` in [0, 1] places a passkey (None: drawn)."""
  spec.check_length(length)
  if depth is not None and not (isinstance(spec, Passkey) and 0 <= depth <= 1):
    raise ProbeError(f"depth: got {depth!r}; allowed: None, or a number in [0, 1] for probe "
                     "'passkey'")
  row = {"targets": np.zeros(length, np.int32), "loss_weights": np.zeros(length, np.float32)}
  spec.fill(row["targets"], row["loss_weights"], np.random.default_rng([seed, index]), index,
            depth)
  return row


def batches(spec: Probe, length: int, batch_size: int, seed: int, start: int = 0,
            shard_id: int = 0, num_shards: int = 1) -> Iterator[dict[str, np.ndarray]]:
  """Endless batches ``start, start + 1, ..`` of ``batch_size`` examples (``[B, L]`` each):
  batch ``b`` holds examples ``b * B .. (b + 1) * B - 1``, of which this host takes its
  ``batch_size / num_shards`` consecutive rows."""
  spec.check_length(length)
  local = batch_size // num_shards
  for step in itertools.count(start):
    first = step * batch_size + shard_id * local
    rows = [example(spec, length, seed, i) for i in range(first, first + local)]
    yield {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def config_probe(config) -> Probe:
  """The probe of a train config: task ``probe:<name>``, parameters ``config.probe``."""
  name = config.task[len(TASK_PREFIX):] if is_probe(config.task) else None
  if name not in PROBES:
    tasks = [TASK_PREFIX + n for n in PROBES]
    raise ProbeError(f"task: got {config.task!r}{nearest(config.task, tasks)} allowed: "
                     f"{', '.join(tasks)}")
  return probe(name, dict(config.get("probe") or {}))


def score(model, params, name_or_spec: str | Probe | Mapping[str, Any], length: int, *,
          examples: int, seed: int, batch_size: int,
          randomized_positions: int | None = None) -> dict[str, Any]:
  """Accuracy of a causal LM (``build_model(cfg, "lm")``, ``cfg.max_len >= length``) on
  examples ``0 .. examples - 1`` of a probe at ``length``, by greedy argmax under teacher
  forcing. ``randomized_positions``: ``N`` of a model trained with randomized positions
  (Ruoss et al. 2023), which then reads example ``i`` at the ordered random subset of
  ``[0, N)`` drawn for row ``i`` of evaluation batch 0
  (:func:`~posenc_jax.data.randomized_positions.randomized_position_ids`), as the reference
  code evaluates; None: positions ``0 .. L - 1``.

  Returns ``{"probe": describe(spec), "length", "examples", "positions": "plain" or
  "randomized", "accuracy": fraction of
  examples with every answer token right, "token_accuracy": fraction of answer tokens
  right}``, and for passkey ``"by_depth": {"0.0-0.2": accuracy, ..}`` (None for an empty bin).
  """
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  from posenc_jax.models.transformer import shift_right  # noqa: PLC0415

  spec = probe(name_or_spec).scored()
  spec.check_length(length)
  for field, value in (("examples", examples), ("batch_size", batch_size)):
    if not (isinstance(value, int) and value > 0):
      raise ProbeError(f"{field}: got {value!r}; allowed: a positive integer")
  if randomized_positions is not None and not (isinstance(randomized_positions, int)
                                                and randomized_positions >= length):
    raise ProbeError(f"randomized_positions: got {randomized_positions!r}; allowed: None or an "
                     f"integer >= length={length} (the ids are drawn from [0, N))")
  from posenc_jax.data import randomized_positions as randomized  # noqa: PLC0415

  predict = jax.jit(lambda p, t, ids: jnp.argmax(
      model.apply({"params": p}, shift_right(t), deterministic=True, position_ids=ids), -1))
  batch_size = min(batch_size, examples)
  right, tokens, correct, rows = [], 0.0, 0.0, []
  for first in range(0, examples, batch_size):
    count = min(batch_size, examples - first)
    batch = [example(spec, length, seed, i) for i in range(first, first + count)]
    targets = np.stack([r["targets"] for r in batch])
    weights = np.stack([r["loss_weights"] for r in batch])
    padded = np.pad(targets, [(0, batch_size - count), (0, 0)])  # one compiled shape
    ids = None if randomized_positions is None else randomized.randomized_position_ids(
        padded.shape, randomized_positions, seed, randomized.EVAL, step=0, row_offset=first)
    hits = (np.asarray(predict(params, padded, ids))[:count] == targets) * weights
    tokens += weights.sum()
    correct += hits.sum()
    right.append(hits.sum(-1) == weights.sum(-1))
    rows.append(targets)
  right = np.concatenate(right)
  result = {"probe": describe(spec), "length": length, "examples": examples,
            "positions": "plain" if randomized_positions is None else "randomized",
            "accuracy": float(right.mean()), "token_accuracy": float(correct / tokens)}
  if isinstance(spec, Passkey):
    bins = spec.depth_bin(spec.depths(np.concatenate(rows)))
    result["by_depth"] = {name: float(right[bins == b].mean()) if np.any(bins == b) else None
                          for b, name in enumerate(spec.bin_names())}
  return result
