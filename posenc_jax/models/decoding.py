"""Greedy, sampling and beam search over a KV-cached decoder.

The searches are model-agnostic: they drive a ``tokens_to_logits`` function

    tokens_to_logits(ids [N, 1] int32, cache) -> (logits [N, V], new cache)

that runs one decoding step, with a fixed ``max_decode_len`` and
:func:`jax.lax.while_loop` (they stop early once every sequence is done, and
run under :func:`jax.jit`). :func:`translate` and :func:`greedy_translate`
wire them to an :class:`~posenc_jax.models.transformer.EncoderDecoder`,
:func:`generate` to a :class:`~posenc_jax.models.decoder_lm.CausalLM` (a prompt, then greedy
or sampled continuations).

Conventions: decoding starts from ``bos_id`` (0, the pad id, as in the flax
WMT example); outputs are ``[.., max_decode_len]`` tokens without the BOS,
ending with ``eos_id`` when the sequence finished, and ``pad_id`` after it.

Inputs: the model wirings (:func:`translate`, :func:`greedy_translate`, :func:`generate`)
check their arguments first, each bad one one ValueError line naming it: the model's class,
lengths, ``bos_id`` and ``eos_id`` in ``[0, vocab_size)``, and the sampling and beam
settings; the source or prompt ids are checked against the vocabulary when they are
concrete (:func:`posenc_jax.ids.check_id_values`). Under :func:`jax.jit` the ids are traced
and cannot be read: an id outside the vocabulary then embeds as NaN, so the log-probabilities
are NaN and the argmax is token 0. The searches themselves take ids as they come.
Beam scores use the GNMT length penalty (Wu et al. 2016)
``log p(y) / ((5 + |y|) / 6)^alpha`` with ``|y|`` counting the EOS, as in
the T5X and flax WMT decoders; DIET's translation runs used beam 10 and
``alpha = 0.6``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax import memory
from posenc_jax.ids import check_id_values
from posenc_jax.models.decoder_lm import CausalLM
from posenc_jax.models.inputs import check_token_ids
from posenc_jax.models.stack import SCANNED
from posenc_jax.models.transformer import EncoderDecoder
from posenc_jax.schemes.base import is_finite_number, is_int

Array = jax.Array
Cache = Any
TokensToLogits = Callable[[Array, Cache], tuple[Array, Cache]]

# A large finite negative log-probability: -inf would give nan in inf - inf.
NEG_INF = -1.0e7


def length_penalty(length: Array | int, alpha: float) -> Array:
  """GNMT length penalty ``((5 + length) / 6) ** alpha``."""
  return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


# ---------------------------------------------------------------------------
# Greedy search.


class _GreedyState(NamedTuple):
  step: Array         # int32 scalar: the position being filled
  last: Array         # [B] the previous token (the next step's input)
  tokens: Array       # [B, L] decoded tokens
  log_probs: Array    # [B] summed log-probabilities
  finished: Array     # [B] bool, EOS emitted
  cache: Cache


def greedy_search(tokens_to_logits: TokensToLogits, cache: Cache, batch_size: int,
                  max_decode_len: int, *, bos_id: int | Array = 0, eos_id: int | None = 1,
                  pad_id: int = 0) -> tuple[Array, Array]:
  """Takes the most likely token at every step.

  Args:
    tokens_to_logits: one decoding step, ``([B, 1], cache) -> ([B, V], cache)``.
    cache: the decoder cache for batch ``B`` (e.g. :func:`init_cache`).
    batch_size: B.
    max_decode_len: L, the number of steps at most.
    bos_id: the first step's input, one id or ``[B]`` (a prompt's last tokens).
    eos_id: the end token, or None: no end (every row runs ``L`` steps).
    pad_id: the padding token, written after EOS.

  Returns:
    ``tokens`` ``[B, L]`` int32 (pad after EOS) and ``log_probs`` ``[B]``,
    the sum of the chosen tokens' log-probabilities up to and with EOS.
  """
  return _token_search(tokens_to_logits, cache, batch_size, max_decode_len,
                       lambda log_probs, step: jnp.argmax(log_probs, axis=-1), bos_id=bos_id,
                       eos_id=eos_id, pad_id=pad_id)


def sample_search(tokens_to_logits: TokensToLogits, cache: Cache, batch_size: int,
                  max_decode_len: int, rng: Array, *, temperature: float = 1.0,
                  top_k: int = 0, bos_id: int | Array = 0, eos_id: int | None = 1,
                  pad_id: int = 0) -> tuple[Array, Array]:
  """Draws every token from the model's distribution, sharpened or flattened.

  Step ``t`` draws from ``softmax(log p / temperature)`` restricted to the ``top_k`` most
  likely tokens (0: all), with the key ``fold_in(rng, t)``.

  Args:
    tokens_to_logits, cache, batch_size, max_decode_len, bos_id, eos_id, pad_id: as
      :func:`greedy_search`'s.
    rng: a PRNG key.
    temperature: a positive number (1: the model's own distribution).
    top_k: draw among this many most likely tokens (0: among all).

  Returns:
    ``tokens`` ``[B, L]`` int32 (pad after EOS) and ``log_probs`` ``[B]``, the chosen tokens'
    summed log-probabilities under the model (without temperature or top-k).
  """

  def choose(log_probs: Array, step: Array) -> Array:
    logits = log_probs / temperature
    if top_k:
      kth = jax.lax.top_k(log_probs, top_k)[0][..., -1:]
      logits = jnp.where(log_probs >= kth, logits, -jnp.inf)
    return jax.random.categorical(jax.random.fold_in(rng, step), logits, axis=-1)

  return _token_search(tokens_to_logits, cache, batch_size, max_decode_len, choose,
                       bos_id=bos_id, eos_id=eos_id, pad_id=pad_id)


def _token_search(tokens_to_logits: TokensToLogits, cache: Cache, batch_size: int,
                  max_decode_len: int, choose: Callable[[Array, Array], Array], *,
                  bos_id: int | Array, eos_id: int | None, pad_id: int
                  ) -> tuple[Array, Array]:
  """One sequence per row, each step's token ``choose(log_probs [B, V], step) -> [B]``
  (:func:`greedy_search`, :func:`sample_search`)."""
  state = _GreedyState(
      step=jnp.array(0, jnp.int32), last=jnp.full((batch_size,), bos_id, jnp.int32),
      tokens=jnp.full((batch_size, max_decode_len), pad_id, jnp.int32),
      log_probs=jnp.zeros((batch_size,), jnp.float32),
      finished=jnp.zeros((batch_size,), bool), cache=cache)

  def cond(s: _GreedyState) -> Array:
    return (s.step < max_decode_len) & ~jnp.all(s.finished)

  def body(s: _GreedyState) -> _GreedyState:
    logits, cache = tokens_to_logits(s.last[:, None], s.cache)
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    token = choose(log_probs, s.step).astype(jnp.int32)
    token_log_prob = jnp.take_along_axis(log_probs, token[:, None], axis=-1)[:, 0]
    token = jnp.where(s.finished, pad_id, token)
    total = s.log_probs + jnp.where(s.finished, 0.0, token_log_prob)
    tokens = jax.lax.dynamic_update_slice(s.tokens, token[:, None], (0, s.step))
    finished = s.finished if eos_id is None else s.finished | (token == eos_id)
    return _GreedyState(s.step + 1, token, tokens, total, finished, cache)

  state = jax.lax.while_loop(cond, body, state)
  return state.tokens, state.log_probs


# ---------------------------------------------------------------------------
# Beam search.


def repeat_beams(x: Array, beam_size: int) -> Array:
  """``[B, ...]`` -> ``[B * K, ...]``, row ``b * K + k`` a copy of row ``b``."""
  return jnp.repeat(x, beam_size, axis=0)


def _gather_beams(x: Array, indices: Array) -> Array:
  """``x`` ``[B, K, ...]``, ``indices`` ``[B, K']`` -> ``[B, K', ...]``."""
  index = indices.reshape(indices.shape + (1,) * (x.ndim - 2))
  return jnp.take_along_axis(x, index, axis=1)


def _gather_cache(cache: Cache, indices: Array) -> Cache:
  """Reorders the ``[B * K, ...]`` leaves of a cache by beam ``indices`` ``[B, K]``.

  Leaves of scanned layers (under ``layers``) are ``[N, B * K, ...]``. Cache indices
  (scalars, ``[N]`` when scanned) are the same for every beam and kept.
  """
  batch, beams = indices.shape

  def gather(path, x):
    axis = 1 if any(getattr(key, "key", None) == SCANNED for key in path) else 0
    if x.ndim <= axis:
      return x
    x = x.reshape(x.shape[:axis] + (batch, -1) + x.shape[axis + 1:])
    x = jax.vmap(_gather_beams, in_axes=(0, None))(x, indices) if axis else _gather_beams(
        x, indices)
    return x.reshape(x.shape[:axis] + (batch * beams,) + x.shape[axis + 2:])

  return jax.tree_util.tree_map_with_path(gather, cache)


class _BeamState(NamedTuple):
  step: Array              # int32 scalar: the position being filled
  alive_tokens: Array      # [B, K, L]
  alive_last: Array        # [B, K] the last token of each alive beam
  alive_log_probs: Array   # [B, K], sorted descending
  finished_tokens: Array   # [B, K, L]
  finished_scores: Array   # [B, K] length-penalised, sorted descending
  finished_flags: Array    # [B, K] bool, the slot holds a finished sequence
  cache: Cache             # leaves [B * K, ...]


def beam_search(tokens_to_logits: TokensToLogits, cache: Cache, batch_size: int,
                max_decode_len: int, *, beam_size: int = 4, alpha: float = 0.6,
                bos_id: int = 0, eos_id: int = 1, pad_id: int = 0) -> tuple[Array, Array]:
  """Beam search with the GNMT length penalty.

  Every step extends the ``K`` alive beams by every token and takes the
  ``2K`` best extensions (so that ``K`` of them are not EOS). Those among the
  first ``K`` that end in EOS join the finished set, scored
  ``log p / length_penalty``; an EOS extension ranked below ``K`` is dropped,
  as in fairseq, since a ``K``-wide search would not have kept it (with
  ``K = 1`` and ``alpha = 0`` this makes beam search exactly greedy search).
  The ``K`` best extensions that do not end stay alive. The search stops at
  ``max_decode_len`` or when,
  in every batch row, ``K`` sequences have finished and the best alive beam
  cannot beat the worst of them even at the longest length (for
  ``alpha >= 0`` its log-probability can only fall and its penalty is at
  most ``length_penalty(max_decode_len)``). Beams still alive at
  ``max_decode_len`` end there without EOS (truncated, as fairseq does) and
  compete with the finished ones, scored at that length; so every row returns
  ``K`` sequences, also when none ended (a score of ``NEG_INF`` only marks an
  empty slot, when fewer than ``K`` sequences are possible at all).

  Args:
    tokens_to_logits: one decoding step, ``([B*K, 1], cache) -> ([B*K, V], cache)``;
      row ``b * K + k`` is beam ``k`` of example ``b``.
    cache: the decoder cache for batch ``B*K`` (rows as above; see
      :func:`repeat_beams`), e.g. :func:`init_cache` of a repeated encoding.
    batch_size: B.
    max_decode_len: L.
    beam_size: K.
    alpha: length-penalty exponent (>= 0; 0 ranks by log-probability).
    bos_id, eos_id, pad_id: start, end and padding tokens.

  Returns:
    ``tokens`` ``[B, K, L]`` int32 (pad after EOS) and ``scores`` ``[B, K]``,
    best first.
  """
  k, length = beam_size, max_decode_len
  # Beam 0 starts alive; the copies start dead so the first step does not
  # return K identical beams.
  alive_log_probs = jnp.where(jnp.arange(k) == 0, 0.0, NEG_INF)
  state = _BeamState(
      step=jnp.array(0, jnp.int32),
      alive_tokens=jnp.full((batch_size, k, length), pad_id, jnp.int32),
      alive_last=jnp.full((batch_size, k), bos_id, jnp.int32),
      alive_log_probs=jnp.broadcast_to(alive_log_probs, (batch_size, k)).astype(jnp.float32),
      finished_tokens=jnp.full((batch_size, k, length), pad_id, jnp.int32),
      finished_scores=jnp.full((batch_size, k), NEG_INF, jnp.float32),
      finished_flags=jnp.zeros((batch_size, k), bool), cache=cache)

  def cond(s: _BeamState) -> Array:
    best_alive = s.alive_log_probs[:, 0] / length_penalty(length, alpha)
    worst_finished = jnp.min(jnp.where(s.finished_flags, s.finished_scores, NEG_INF), axis=1)
    done = jnp.all(worst_finished > best_alive)
    return (s.step < length) & ~done

  def body(s: _BeamState) -> _BeamState:
    logits, cache = tokens_to_logits(s.alive_last.reshape(batch_size * k, 1), s.cache)
    vocab = logits.shape[-1]
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    candidates = s.alive_log_probs[:, :, None] + log_probs.reshape(batch_size, k, vocab)
    # The 2K best extensions of all beams.
    top_log_probs, flat = jax.lax.top_k(candidates.reshape(batch_size, k * vocab), 2 * k)
    top_beams, top_tokens = flat // vocab, (flat % vocab).astype(jnp.int32)
    top_seqs = _gather_beams(s.alive_tokens, top_beams)
    top_seqs = jnp.where(jnp.arange(length) == s.step, top_tokens[..., None], top_seqs)
    is_eos = top_tokens == eos_id
    finishes = is_eos & (jnp.arange(2 * k) < k)  # EOS within the K best

    # Alive: the K best extensions that did not end.
    alive_log_probs, keep = jax.lax.top_k(jnp.where(is_eos, NEG_INF, top_log_probs), k)
    alive_tokens = _gather_beams(top_seqs, keep)
    alive_last = _gather_beams(top_tokens, keep)
    cache = _gather_cache(cache, _gather_beams(top_beams, keep))

    # Finished: merge the new finished extensions into the K best so far.
    scores = jnp.where(finishes, top_log_probs / length_penalty(s.step + 1, alpha), NEG_INF)
    all_scores = jnp.concatenate([s.finished_scores, scores], axis=1)
    all_flags = jnp.concatenate([s.finished_flags, finishes], axis=1)
    all_seqs = jnp.concatenate([s.finished_tokens, top_seqs], axis=1)
    finished_scores, best = jax.lax.top_k(jnp.where(all_flags, all_scores, NEG_INF), k)
    return _BeamState(s.step + 1, alive_tokens, alive_last, alive_log_probs,
                      _gather_beams(all_seqs, best), finished_scores,
                      _gather_beams(all_flags, best), cache)

  s = jax.lax.while_loop(cond, body, state)
  # Beams alive at max_decode_len end there (truncated) and compete with the
  # finished ones. After an early stop they cannot win (see the docstring),
  # so this changes only rows that ran to the end.
  all_scores = jnp.concatenate(
      [jnp.where(s.finished_flags, s.finished_scores, NEG_INF),
       s.alive_log_probs / length_penalty(length, alpha)], axis=1)
  scores, best = jax.lax.top_k(all_scores, k)
  tokens = _gather_beams(jnp.concatenate([s.finished_tokens, s.alive_tokens], axis=1), best)
  return tokens, scores


# ---------------------------------------------------------------------------
# Model wiring: a model's ``decode`` method takes ``(*context, ids, decode=True)``, where
# ``context`` is ``(encoded, src_mask)`` for an EncoderDecoder and nothing for a CausalLM.


def _empty_cache(model: nn.Module, params: Any, context: tuple[Any, ...], batch: int,
                 max_decode_len: int) -> Cache:
  """Traces one ``decode=True`` call of the full length (``jax.eval_shape``: no compute)
  and fills every leaf with zeros, which is the initial cache (keys, values and indices
  all 0)."""
  dummy = jnp.zeros((batch, max_decode_len), jnp.int32)

  def create(params, context):
    _, variables = model.apply({"params": params}, *context, dummy, decode=True,
                               method=model.decode, mutable=["cache"])
    return variables["cache"]

  shapes = jax.eval_shape(create, params, context)
  return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)


def _step(model: nn.Module, params: Any, context: tuple[Any, ...]) -> TokensToLogits:
  """``tokens_to_logits`` of ``model.decode`` with ``context`` (see above)."""

  def tokens_to_logits(ids: Array, cache: Cache) -> tuple[Array, Cache]:
    logits, variables = model.apply({"params": params, "cache": cache}, *context, ids,
                                    decode=True, method=model.decode, mutable=["cache"])
    return logits[:, -1], variables["cache"]

  return tokens_to_logits


# ---------------------------------------------------------------------------
# The checks of the model wirings' arguments.


def _check_decoding(owner: str, model: nn.Module, kind: type, length_name: str, length: int,
                    bos_id: int, eos_id: int | None, pad_id: int, *,
                    eos_optional: bool = False) -> None:
  """One TypeError line ``<owner>: model: ...`` unless ``model`` is a ``kind``; one ValueError
  line ``<owner>: <argument>: got ...; allowed: ...`` unless ``length`` is a positive
  integer, ``bos_id`` and ``eos_id`` (or None if ``eos_optional``) ids in ``[0, vocab_size)``
  (or traced), and ``pad_id`` an integer."""
  if not isinstance(model, kind):
    wiring = "generate" if kind is CausalLM else "translate and greedy_translate"
    raise TypeError(f"{owner}: model: got {type(model).__name__}; allowed: {kind.__name__} "
                    f"(decoded by {wiring})")
  if not is_int(length) or length < 1:
    raise ValueError(f"{owner}: {length_name}: got {length!r}; allowed: a positive integer")
  vocab = model.config.vocab_size
  check_id_values(owner, "bos_id", bos_id, vocab, "vocab_size")
  if eos_id is not None or not eos_optional:
    check_id_values(owner, "eos_id", eos_id, vocab, "vocab_size")
  if not (is_int(pad_id) or isinstance(pad_id, jax.core.Tracer)):
    raise ValueError(f"{owner}: pad_id: got {pad_id!r}; allowed: an integer")


def _is_key(rng: Any) -> bool:
  """Whether ``rng`` is one PRNG key: a typed key array ``[]`` or a raw ``uint32[2]``."""
  dtype = getattr(rng, "dtype", None)
  if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    return jnp.shape(rng) == ()
  return dtype == jnp.uint32 and jnp.shape(rng) == (2,)


# ---------------------------------------------------------------------------
# The EncoderDecoder wiring.


def init_cache(model: nn.Module, params: Any, encoded: Array, src_mask: Array | None,
               max_decode_len: int) -> Cache:
  """An empty decoder cache for ``encoded``'s batch and ``max_decode_len`` positions."""
  return _empty_cache(model, params, (encoded, src_mask), encoded.shape[0], max_decode_len)


def decoder_step(model: nn.Module, params: Any, encoded: Array,
                 src_mask: Array | None) -> TokensToLogits:
  """``tokens_to_logits`` for :func:`greedy_search` / :func:`beam_search` from a model.

  Args:
    model: an :class:`~posenc_jax.models.transformer.EncoderDecoder`.
    params: its parameters.
    encoded: ``[N, Ls, d]`` encoder output (``N = B*K`` for beam search).
    src_mask: ``[N, Ls]`` or None.
  """
  return _step(model, params, (encoded, src_mask))


def greedy_translate(model: nn.Module, params: Any, src_ids: Array,
                     src_mask: Array | None = None, *, max_decode_len: int, bos_id: int = 0,
                     eos_id: int = 1, pad_id: int = 0) -> tuple[Array, Array]:
  """Greedy decoding of ``src_ids`` ``[B, Ls]``: ``tokens`` ``[B, L]``, ``log_probs`` ``[B]``.

  The arguments are checked as :func:`translate`'s (one line each)."""
  _check_decoding("greedy_translate", model, EncoderDecoder, "max_decode_len", max_decode_len,
                  bos_id, eos_id, pad_id)
  encoded = model.apply({"params": params}, src_ids, src_mask, method=model.encode)
  cache = init_cache(model, params, encoded, src_mask, max_decode_len)
  return greedy_search(decoder_step(model, params, encoded, src_mask), cache, src_ids.shape[0],
                       max_decode_len, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id)


def translate(model: nn.Module, params: Any, src_ids: Array, src_mask: Array | None = None, *,
              max_decode_len: int, beam_size: int = 4, alpha: float = 0.6, bos_id: int = 0,
              eos_id: int = 1, pad_id: int = 0) -> tuple[Array, Array]:
  """Beam-search decoding of ``src_ids`` ``[B, Ls]``.

  Returns:
    ``tokens`` ``[B, K, L]`` and ``scores`` ``[B, K]``, best first
    (``tokens[:, 0]`` is the translation).

  Raises:
    TypeError: one line for a model that is not an
      :class:`~posenc_jax.models.transformer.EncoderDecoder`.
    ValueError: one line naming the argument: ``max_decode_len`` or
      ``beam_size`` not a positive integer, ``alpha`` not a finite number >= 0, ``bos_id``
      or ``eos_id`` outside ``[0, vocab_size)``, ``pad_id`` not an integer, or concrete
      ``src_ids`` outside the vocabulary (traced ones, under :func:`jax.jit`, are not read).
  """
  _check_decoding("translate", model, EncoderDecoder, "max_decode_len", max_decode_len, bos_id,
                  eos_id, pad_id)
  if not is_int(beam_size) or beam_size < 1:
    raise ValueError(f"translate: beam_size: got {beam_size!r}; allowed: a positive integer")
  if not (is_finite_number(alpha) and alpha >= 0):
    raise ValueError(f"translate: alpha: got {alpha!r}; allowed: a finite number >= 0")
  encoded = model.apply({"params": params}, src_ids, src_mask, method=model.encode)
  encoded = repeat_beams(encoded, beam_size)
  src_mask = None if src_mask is None else repeat_beams(src_mask, beam_size)
  cache = init_cache(model, params, encoded, src_mask, max_decode_len)
  return beam_search(decoder_step(model, params, encoded, src_mask), cache, src_ids.shape[0],
                     max_decode_len, beam_size=beam_size, alpha=alpha, bos_id=bos_id,
                     eos_id=eos_id, pad_id=pad_id)


# ---------------------------------------------------------------------------
# The CausalLM wiring.


def generate(model: nn.Module, params: Any, prompt: Array, *, max_new_tokens: int,
             rng: Array | None = None, temperature: float = 1.0, top_k: int = 0,
             bos_id: int = 0, eos_id: int | None = 1, pad_id: int = 0
             ) -> tuple[Array, Array]:
  """Continues ``prompt`` with a :class:`~posenc_jax.models.decoder_lm.CausalLM`: greedy, or
  sampled with ``rng`` (:func:`sample_search`'s ``temperature`` and ``top_k``).

  The model reads ``[bos, prompt..., new tokens...]`` (its training inputs are the targets
  shifted right behind ``bos_id``). The cache covers ``P + max_new_tokens`` positions
  (every input but the last new token): the prompt fills it one cached step at a time,
  each exactly the teacher-forced pass's row, then the search continues from the prompt's
  last token (from ``bos_id`` when the prompt is empty). Works under :func:`jax.jit` with
  ``max_new_tokens`` (and ``temperature``, ``top_k``) static.

  Args:
    model: a :class:`~posenc_jax.models.decoder_lm.CausalLM`.
    params: its parameters (in the layer layout of the model's config).
    prompt: ``[B, P]`` int ids in ``[0, vocab_size)``, ``P >= 0`` (``[B, 0]``: start from
      ``bos_id`` alone), no padding.
    max_new_tokens: N, the tokens to generate at most (a positive integer).
    rng: None for greedy decoding; a PRNG key (``jax.random.key``) to sample.
    temperature, top_k: sampling only (see :func:`sample_search`); greedy decoding takes
      them at their defaults, 1.0 and 0.
    bos_id, eos_id: start and end tokens in ``[0, vocab_size)``; ``eos_id=None``: no end
      token (every row gets N tokens).
    pad_id: the padding token written after EOS (any integer).

  Returns:
    ``tokens`` ``[B, N]`` int32 (pad after EOS) and ``log_probs`` ``[B]``, the new tokens'
    summed log-probabilities up to and with EOS.

  Raises:
    TypeError: one line for a model that is not a ``CausalLM``.
    ValueError: one line naming an argument that does not fit: a prompt not ``[B, P]``
      integer ids with ``B >= 1`` or (when concrete) holding an id outside
      ``[0, vocab_size)``, and any other argument outside the range above (an absolute
      scheme's table shorter than ``P + N`` positions is named by the scheme).
      Under :func:`jax.jit` a traced prompt is not read: an id outside the vocabulary then
      gives NaN log-probabilities and token 0.
  """
  _check_decoding("generate", model, CausalLM, "max_new_tokens", max_new_tokens, bos_id,
                  eos_id, pad_id, eos_optional=True)
  vocab = model.config.vocab_size
  if isinstance(prompt, (list, tuple)):
    try:
      prompt = np.asarray(prompt)
    except ValueError:
      raise ValueError("generate: prompt: got a ragged nested list; expected [B, P] integer "
                       "ids") from None
  batch, length = check_token_ids("generate", "prompt", prompt, vocab_size=vocab)
  if batch < 1:
    raise ValueError(f"generate: prompt: got shape {jnp.shape(prompt)}; expected [B, P] with "
                     "B >= 1 rows")
  if rng is not None and not _is_key(rng):
    kind = getattr(rng, "dtype", type(rng).__name__)
    raise ValueError(f"generate: rng: got {kind} of shape {jnp.shape(rng)}; "
                     "allowed: None (greedy) or one PRNG key (jax.random.key(seed))")
  if not (is_finite_number(temperature) and temperature > 0):
    raise ValueError(f"generate: temperature: got {temperature!r}; allowed: a finite positive "
                     "number")
  if not (is_int(top_k) and 0 <= top_k <= vocab):
    raise ValueError(f"generate: top_k: got {top_k!r}; allowed: an integer in [0, "
                     f"vocab_size={vocab}] (0: every token)")
  if rng is None and (temperature != 1.0 or top_k != 0):
    raise ValueError(f"generate: temperature, top_k: got {temperature!r}, {top_k!r} without "
                     "rng; they shape sampling only: pass rng=jax.random.key(seed) to sample")
  memory.check_decoding("generate", model.config, params, batch, length, max_new_tokens)
  inputs = jnp.concatenate([jnp.full((batch, 1), bos_id, jnp.int32),
                            jnp.asarray(prompt, jnp.int32)], axis=1)
  step = _step(model, params, ())
  cache = _empty_cache(model, params, (), batch, length + max_new_tokens)
  cache, _ = jax.lax.scan(lambda cache, ids: (step(ids[:, None], cache)[1], None), cache,
                          inputs[:, :-1].T)
  last = inputs[:, -1]
  if rng is None:
    return greedy_search(step, cache, batch, max_new_tokens, bos_id=last, eos_id=eos_id,
                         pad_id=pad_id)
  return sample_search(step, cache, batch, max_new_tokens, rng, temperature=temperature,
                       top_k=top_k, bos_id=last, eos_id=eos_id, pad_id=pad_id)
