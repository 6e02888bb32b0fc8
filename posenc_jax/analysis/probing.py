"""Attention of one encoder layer, identical-word probing and the content-free positional term.

The attention probabilities are recomputed from the model's own forward pass
without any hook in the model: :func:`layer_attention` runs
:class:`~posenc_jax.models.BertEncoder` with ``capture_intermediates`` on the
layer's ``query``/``key``/``value`` projections, skips the layers after it
(``nn.intercept_methods`` returns their input unchanged, so only the layers
up to the probed one cost anything), takes the scheme's terms from
``BertEncoder.terms`` and forms the logits exactly as the reference route of
:func:`posenc_jax.attend` does (q/k transforms, ``c q.k``, every term's
``logits``). A test checks that these probabilities, mixed with the captured
values and projected, reproduce the layer's captured output for every scheme.

Identical-word probing (Wang et al. 2021, Sec. 4.2): sequences
``[CLS] w w .. w [SEP]`` of one random word ``w``; the first layer's
probabilities averaged over heads and words depend only on the positional
machinery.

Positional attention (DIET Fig. 2/8, TUPE Fig. 5): the content-free term of
each head, ``c P W_Q^h (P W_K^h)^T`` for an input position table ``P``
(query/key kernels only, no bias or LayerNorm, as DIET writes it) plus every
term that does not depend on the content (``Bias``, ``Factored``, and
``QKShift`` with zero content, i.e. BERT-A^d's position-position term).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from posenc_jax.models.config import MATRIX_ATTENTIONS
from posenc_jax.models.scan import layout_for
from posenc_jax.models.stack import select_terms
from posenc_jax.terms import Bias, Factored, QKShift, QueryRelative, SchemeTerms, Toeplitz

Array = jax.Array

SPECIAL_LAYOUTS = ("cls_sep", "cls", "none")


class AnalysisError(ValueError):
  """The analysis cannot run on this model or input (one line naming the reason)."""


@dataclasses.dataclass(frozen=True)
class ProbeTokens:
  """Token ids probing needs from a vocabulary.

  Attributes:
    cls_id: ``[CLS]`` (None: the vocabulary has none).
    sep_id: ``[SEP]``.
    word_ids: ``[N]`` candidate words (no special or reserved pieces).
  """

  cls_id: int | None
  sep_id: int | None
  word_ids: np.ndarray


def bundled_tokens(vocab_size: int) -> ProbeTokens:
  """The reserved ids of this library's SentencePiece vocabularies (:mod:`posenc_jax.data.vocab`):
  ``[CLS]`` 3, ``[SEP]`` 4, words from 6 up to ``vocab_size - 1``."""
  from posenc_jax.data.vocab import CLS_ID, NUM_RESERVED, SEP_ID  # noqa: PLC0415 - stdlib only
  return ProbeTokens(CLS_ID, SEP_ID, np.arange(NUM_RESERVED, vocab_size))


def wordpiece_tokens(vocab_txt: str | pathlib.Path) -> ProbeTokens:
  """``[CLS]``, ``[SEP]`` and whole-word pieces (no ``[...]``, no ``##``) of a WordPiece
  ``vocab.txt`` (one token a line, id = line number)."""
  with open(vocab_txt, encoding="utf-8") as f:
    vocab = [line.rstrip("\n") for line in f]
  index = {tok: i for i, tok in enumerate(vocab)}
  words = [i for i, tok in enumerate(vocab)
           if tok and not (tok.startswith("[") and tok.endswith("]")) and not tok.startswith("##")]
  return ProbeTokens(index.get("[CLS]"), index.get("[SEP]"), np.asarray(words))


def special_positions(length: int, special: str = "cls_sep") -> tuple[int, ...]:
  """Positions of the special tokens in a probing sequence of ``length``."""
  if special not in SPECIAL_LAYOUTS:
    raise AnalysisError(f"special: got {special!r}; allowed: {', '.join(SPECIAL_LAYOUTS)}")
  return {"cls_sep": (0, length - 1), "cls": (0,), "none": ()}[special]


def place_special_tokens(ids: np.ndarray, tokens: ProbeTokens, special: str = "cls_sep"
                         ) -> np.ndarray:
  """A copy of ``ids`` ``[N, L]`` with ``[CLS]`` first and ``[SEP]`` last (as ``special`` says)."""
  ids = np.array(ids, np.int32)
  special_positions(ids.shape[1], special)  # checks the layout
  missing_cls = special != "none" and tokens.cls_id is None
  if missing_cls or (special == "cls_sep" and tokens.sep_id is None):
    raise AnalysisError("special: the vocabulary has no [CLS]/[SEP]; use special='none'")
  if special in ("cls_sep", "cls"):
    ids[:, 0] = tokens.cls_id
  if special == "cls_sep":
    ids[:, -1] = tokens.sep_id
  return ids


def identical_word_ids(words: Sequence[int], length: int, tokens: ProbeTokens,
                       special: str = "cls_sep") -> np.ndarray:
  """``[N, length]`` int32: each row one word repeated, with the special tokens around it."""
  ids = np.repeat(np.asarray(words, np.int32)[:, None], length, axis=1)
  return place_special_tokens(ids, tokens, special)


def _check_model(encoder, layer: int) -> None:
  cfg = encoder.config
  if cfg.attention not in MATRIX_ATTENTIONS:
    raise AnalysisError(f"model.attention: {cfg.attention!r} attends over projected keys, "
                        "not an [L, L] matrix; probing needs attention='full'")
  if not 0 <= layer < cfg.num_layers:
    raise AnalysisError(f"layer: got {layer}; allowed: 0..{cfg.num_layers - 1}")


def _layer_index(module: nn.Module) -> int | None:
  path = module.path
  if len(path) == 1 and path[0].startswith("layers_"):
    return int(path[0][len("layers_"):])
  return None


def term_logits(q: Array, k: Array, terms: Sequence[Any], scale: float) -> Array:
  """``[B|1, H, Lq, Lk]`` float32 logits of ``q``, ``k`` ``[B, L, H, D]`` and one layer's
  terms, as :func:`posenc_jax.attend`'s reference route forms them (before masking)."""
  q, k = q.astype(jnp.float32), k.astype(jnp.float32)
  terms = [t.with_key_length(k.shape[1]) for t in terms]
  for term in terms:
    q, k = term.transform_qk(q, k)
  logits = jnp.einsum("bihd,bjhd->bhij", q, k) * scale
  for term in terms:
    extra = term.logits(q, scale)
    if extra is not None:
      logits = logits + extra.astype(jnp.float32)
  return logits


@dataclasses.dataclass
class LayerAttention:
  """One layer's attention on a batch.

  Attributes:
    logits: ``[B, H, L, L]`` float32, before masking.
    probs: ``[B, H, L, L]`` softmax over keys (padding keys get 0).
    q, k, v: the layer's projections ``[B, L, H, D]`` (before term transforms).
    output: the attention module's output ``[B, L, d]`` (for checks).
    terms: the layer's terms; scale: the content scale ``c``.
  """

  logits: Array
  probs: Array
  q: Array
  k: Array
  v: Array
  output: Array
  terms: list[Any]
  scale: float


def layer_runner(encoder, layer: int = 0):
  """A jitted ``run(variables, input_ids, segment_ids, mask) -> LayerAttention`` for ``layer``.

  Build it once and call it on many batches (it compiles once per shape).
  """
  _check_model(encoder, layer)
  # Intercepted layer by layer: the encoder unrolled, scanned parameters split.
  encoder = encoder.clone(config=encoder.config.replace(scan_layers=False))
  target = (f"layers_{layer}", "attention")

  def capture(module, method_name):
    return method_name == "__call__" and tuple(module.path[:2]) == target

  def skip_later_layers(next_fun, args, kwargs, context):
    index = _layer_index(context.module)
    if context.method_name == "__call__" and index is not None and index > layer:
      return args[0]  # the layer's input x, unchanged: later layers cost nothing
    return next_fun(*args, **kwargs)

  def forward(module, input_ids, segment_ids, mask):
    module(input_ids, segment_ids, mask)
    terms, per_layer = module.terms(input_ids.shape[1], segment_ids)
    own = select_terms(terms.for_layer(layer), per_layer["alternate_layers"][layer],
                       per_layer["counts"])  # the alternate scheme's on its layers
    return own, terms.content_scale

  @jax.jit
  def run(variables, input_ids, segment_ids, mask):
    variables = {**variables, "params": layout_for(variables["params"], scan_layers=False)}
    with nn.intercept_methods(skip_later_layers):
      (layer_terms, scale), state = encoder.apply(
          variables, input_ids, segment_ids, mask, method=forward,
          capture_intermediates=capture, mutable=["intermediates"])
    captured = state["intermediates"][target[0]][target[1]]
    q, k, v = (captured[name]["__call__"][0] for name in ("query", "key", "value"))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    logits = term_logits(q, k, layer_terms, scale)
    logits = jnp.broadcast_to(logits, (q.shape[0],) + logits.shape[1:])
    masked = jnp.where(mask[:, None, None, :], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(masked, axis=-1)
    return LayerAttention(logits, probs, q, k, v, captured["__call__"][0], layer_terms, scale)

  def call(variables, input_ids, segment_ids=None, mask=None) -> LayerAttention:
    input_ids = jnp.asarray(input_ids, jnp.int32)
    segment_ids = jnp.zeros_like(input_ids) if segment_ids is None else jnp.asarray(segment_ids)
    mask = jnp.ones(input_ids.shape, bool) if mask is None else jnp.asarray(mask).astype(bool)
    return run(variables, input_ids, segment_ids, mask)

  return call


# LayerAttention travels out of jit: register it as a pytree (terms and scale as children).
jax.tree_util.register_pytree_node(
    LayerAttention,
    lambda a: ((a.logits, a.probs, a.q, a.k, a.v, a.output, a.terms, a.scale), None),
    lambda _, children: LayerAttention(*children))


def layer_attention(encoder, variables, input_ids, segment_ids=None, mask=None, *,
                    layer: int = 0) -> LayerAttention:
  """Logits and probabilities of ``layer`` on a batch ``input_ids`` ``[B, L]``."""
  return layer_runner(encoder, layer)(variables, input_ids, segment_ids, mask)


@dataclasses.dataclass
class ProbingResult:
  """Identical-word probing of one layer.

  Attributes:
    attention: ``[L, L]`` probabilities averaged over heads and words.
    per_head: ``[H, L, L]`` averaged over words.
    special_positions: positions of [CLS]/[SEP] in the probing sequences.
    words: the word ids used.
    layer: the probed layer.
  """

  attention: np.ndarray
  per_head: np.ndarray
  special_positions: tuple[int, ...]
  words: np.ndarray
  layer: int

  @property
  def length(self) -> int:
    return self.attention.shape[0]


def default_length(encoder, length: int | None = None) -> int:
  """``length`` or the papers' 128 positions, capped at the model's ``max_len``."""
  max_len = encoder.config.max_len
  if length is None:
    return min(128, max_len)
  if not 2 <= length <= max_len:
    raise AnalysisError(f"length: got {length}; allowed: 2..{max_len} (the model's max_len)")
  return length


def identical_word_probing(encoder, variables, tokens: ProbeTokens, *, length: int | None = None,
                           num_words: int = 300, batch_size: int = 50, seed: int = 0,
                           layer: int = 0, special: str = "cls_sep") -> ProbingResult:
  """Wang et al.'s identical-word probing: ``layer``'s attention on ``[CLS] w .. w [SEP]``.

  Args:
    encoder: a :class:`~posenc_jax.models.BertEncoder`.
    variables: ``{'params': ...}`` of the encoder.
    tokens: the vocabulary's special ids and candidate words.
    length: sequence length L (default 128, capped at ``max_len``).
    num_words: random words averaged over (the paper: 300); all candidates if fewer.
    batch_size: sequences per forward pass.
    seed: word sampling seed.
    layer: the probed layer (the paper: the first, 0).
    special: ``cls_sep`` (BERT's ``[CLS] .. [SEP]``), ``cls`` or ``none``.
  """
  length = default_length(encoder, length)
  positions = special_positions(length, special)
  candidates = np.asarray(tokens.word_ids)
  if candidates.size == 0:
    raise AnalysisError("tokens: no candidate words to probe with")
  rng = np.random.default_rng(seed)
  words = rng.choice(candidates, size=min(num_words, candidates.size), replace=False)
  ids = identical_word_ids(words, length, tokens, special)
  run = layer_runner(encoder, layer)
  total = None
  for start in range(0, len(ids), batch_size):
    chunk = ids[start:start + batch_size]
    if len(chunk) < batch_size and start > 0:  # keep one compiled shape: pad with repeats
      chunk = np.concatenate([chunk, ids[:batch_size - len(chunk)]])
      weight = np.zeros(batch_size)
      weight[:len(ids) - start] = 1.0
    else:
      weight = np.ones(len(chunk))
    probs = np.asarray(run(variables, chunk).probs, np.float64)
    summed = np.einsum("b,bhij->hij", weight, probs)
    total = summed if total is None else total + summed
  per_head = total / len(ids)
  return ProbingResult(per_head.mean(axis=0), per_head, positions, words, layer)


@dataclasses.dataclass
class PositionalAttention:
  """The content-free positional logits of each head of one layer.

  Attributes:
    values: ``[H, L, L]`` float32.
    kind: ``input`` (``c P W_Q W_K^T P^T`` of an input table), ``term``
      (content-free attention terms), ``input+term``, or ``none`` (the scheme
      has no content-free term: RoPE, Shaw, no position; values are zero).
    parts: the names of what was summed.
  """

  values: np.ndarray
  kind: str
  parts: tuple[str, ...]


def _position_terms(encoder, variables, length: int) -> SchemeTerms:
  """The position scheme's terms alone (no segment scheme), computed under jit."""
  segment_ids = jnp.zeros((1, length), jnp.int32)
  return jax.jit(lambda v: encoder.apply(v, length, segment_ids,
                                         method=lambda m, n, s: m.position(n, s)))(variables)


def _unboxed_params(variables) -> Any:
  return nn.unbox(variables["params"])


def positional_attention(encoder, variables, *, length: int | None = None,
                         layer: int = 0) -> PositionalAttention:
  """Each head's content-free positional logits in ``layer`` (DIET Fig. 2/8, TUPE Fig. 5).

  Input APE: ``c (P W_Q^h)(P W_K^h)^T`` with the layer's query/key kernels
  (layer 0 only: deeper layers do not see ``P`` directly). DIET-ABS: ``P_Q^h
  P_K^{hT}``; DIET-REL, T5, ALiBi: the bias; TUPE: the untied term with the
  [CLS] reset (and TUPE-R's bias); BERT-A^d: ``c (P U_Q)(P U_K)^T``.
  """
  _check_model(encoder, layer)
  length = default_length(encoder, length)
  # Which parts exist is decided from the terms' types, traced without computing anything.
  terms = jax.eval_shape(lambda v: _position_terms(encoder, v, length), variables)
  has_input = terms.embedding is not None and layer == 0
  free = [type(t).__name__ for t in terms.terms if isinstance(t, (Bias, Factored, QKShift, Toeplitz))]
  values = jax.jit(functools.partial(_positional_values, encoder, length=length,
                                     layer=layer))(variables)
  parts = (["input: c P W_Q W_K^T P^T"] if has_input else []) + free
  kind = "+".join(k for k, on in (("input", has_input), ("term", bool(free))) if on) or "none"
  return PositionalAttention(np.asarray(values), kind, tuple(parts))


def _positional_values(encoder, variables, *, length: int, layer: int) -> Array:
  """``[H, L, L]``: the input part (layer 0) plus the content-free terms (see above)."""
  cfg = encoder.config
  heads, head_dim = cfg.num_heads, cfg.dim_per_head
  segment_ids = jnp.zeros((1, length), jnp.int32)
  terms = encoder.apply(variables, length, segment_ids, method=lambda m, n, s: m.position(n, s))
  scale = 1.0 / math.sqrt(head_dim) if terms.content_scale is None else terms.content_scale
  values = jnp.zeros((heads, length, length), jnp.float32)
  if terms.embedding is not None and layer == 0:
    attn = layout_for(_unboxed_params(variables), False)[f"layers_{layer}"]["attention"]
    p = jnp.asarray(terms.embedding.value, jnp.float32)
    if p.ndim == 3:
      p = p[0]
    pq = jnp.einsum("ld,dhk->hlk", p, jnp.asarray(attn["query"]["kernel"], jnp.float32))
    pk = jnp.einsum("ld,dhk->hlk", p, jnp.asarray(attn["key"]["kernel"], jnp.float32))
    values = values + scale * jnp.einsum("hik,hjk->hij", pq, pk)
  free = [t for t in terms.for_layer(layer) if isinstance(t, (Bias, Factored, QKShift, Toeplitz))]
  if free:
    zeros = jnp.zeros((1, length, heads, head_dim), jnp.float32)
    logits = term_logits(zeros, zeros, free, scale)
    values = values + jnp.broadcast_to(logits[0], values.shape)
  return values


@dataclasses.dataclass
class PositionVectors:
  """Position vectors whose dot products Wang et al. Fig. 1 shows.

  Attributes:
    vectors: ``[N, dim]``.
    positions: ``[N]`` absolute positions or relative offsets.
    axis: ``position`` or ``offset``.
    source: where they came from.
  """

  vectors: np.ndarray
  positions: np.ndarray
  axis: str
  source: str


def position_vectors(encoder, variables, *, length: int | None = None,
                     layer: int = 0) -> PositionVectors | None:
  """The model's position vectors, or None for schemes without any (no position, ALiBi, RoPE,
  biases).

  Input tables (learned or sinusoidal APE: ``p_i``); TUPE/BERT-A^d's table
  ``p_i`` (before its LayerNorm); DIET-ABS's ``P_Q`` of ``layer`` (heads
  concatenated); Shaw's and the sinusoidal RPE's key table ``a^K_r`` over
  offsets ``r = -t..t`` (of ``layer``).
  """
  length = default_length(encoder, length)
  terms = _position_terms(encoder, variables, length)
  params = _unboxed_params(variables).get("position", {})
  if terms.embedding is not None:
    p = np.asarray(terms.embedding.value)
    return PositionVectors(p[0] if p.ndim == 3 else p, np.arange(length), "position",
                           "input position embedding p_i")
  if "positions" in params:  # TUPE, BERT-A^d
    table = np.asarray(params["positions"]["position_embedding"])[:length]
    return PositionVectors(table, np.arange(length), "position", "untied position embedding p_i")
  if "p_query" in params:  # DIET-ABS
    p_q = np.asarray(params["p_query"])
    p_q = p_q[0 if p_q.shape[0] == 1 else layer, :length]
    return PositionVectors(p_q.reshape(length, -1), np.arange(length), "position",
                           "DIET-ABS P_Q (heads concatenated)")
  for term in terms.for_layer(layer):
    if isinstance(term, QueryRelative):
      table = np.asarray(term.key_table)
      table = table if table.ndim == 2 else table[0]  # [H, 2t+1, D]: head 0
      return PositionVectors(table, np.arange(-term.clip, term.clip + 1), "offset",
                             "relative key table a^K_r")
  return None
