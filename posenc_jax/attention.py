"""Multi-head attention over a list of logit terms, by two exact routes.

* ``route="reference"`` materialises ``A = c q.k^T + sum_t T_t``, masks,
  softmaxes in float32 and mixes the values. Every term form runs here.
* ``route="fused"`` never builds an ``[Lq, Lk]`` positional tensor where the
  term's form allows it: q/k transforms (RoPE, BERT-A^d) rewrite q and k,
  factored terms (DIET-ABS, TUPE-A, per-head segments of rank r) are folded
  into q/k by concatenation along the head dim, and Toeplitz terms (DIET-REL,
  T5, ALiBi, TUPE-R's relative part) go to the Pallas flash kernel
  (:func:`posenc_jax.kernels.relative_flash_attention`) as one ``[H, Lq+Lk-1]``
  vector whose tiles the kernel builds in place. Bias-free attention runs on cuDNN
  on GPU and on splash attention on TPU where they fit; dense terms (Shaw's
  query-dependent term, CoPE's term of q and k, per-example biases) go to
  :func:`jax.nn.dot_product_attention` as a bias. A separable term ``r_i + s_j`` (the
  forgetting gates) goes to the Pallas kernel as its two vectors, added in float32; under a
  causal mask in bfloat16 on a GPU, where it is ``s_j`` up to a row constant (causal ALiBi
  too), ``s`` folds into q/k channels and cuDNN runs without a bias
  (:mod:`posenc_jax.terms.channels`).
* ``route="auto"`` (the default): the fused route on GPU and TPU, the reference route
  on CPU and where a term cannot fuse.

Which of these runs, and how each term enters, is decided in one place: :func:`attend`
checks its arguments (:func:`check_arguments`: static shapes, at trace time, one
ValueError line naming the first that does not fit), asks
:func:`posenc_jax.route_plan.plan` once, and executes the plan it gets
(``print(route_plan.plan_for(q, k, v, terms))`` shows it). The routes agree to float32
rounding, gradients included (tested, the Pallas kernel in interpret mode); attention
dropout draws the same mask on both (a counter-based hash, inside the kernel on the
fused route).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from posenc_jax import route_plan
from posenc_jax.kernels import relative_flash_attention
from posenc_jax.kernels.dropout import dropout_multipliers, dropout_seed
from posenc_jax.kernels.precision import dot_precision
from posenc_jax.messages import nearest
from posenc_jax.schemes.base import is_finite_number, is_int
from posenc_jax.terms import SchemeTerms, Term, key_channels, toeplitz_bias

Array = jax.Array
Route = Literal["auto", "reference", "fused"]


def _is_float_dtype(dtype: Any) -> bool:
  try:
    return jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
  except TypeError:
    return False


def _shape(name: str, x: Any, layout: str) -> tuple[int, ...]:
  """``x``'s static shape; one ValueError line naming ``name`` if ``x`` is not an array."""
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise ValueError(f"attend: {name}: got {type(x).__name__}; expected an array {layout}")
  return tuple(x.shape)


def _one_of(name: str, value: Any, allowed: Sequence[Any]) -> None:
  if value not in allowed:
    hint = nearest(value, [str(a) for a in allowed]) if isinstance(value, str) else ";"
    raise ValueError(f"attend: {name}: got {value!r}{hint} allowed: "
                     f"{', '.join(str(a) for a in allowed)}")


def check_mask(mask: Array | None, batch: int, heads: int, q_len: int, k_len: int) -> None:
  """Raises one ValueError line unless ``mask`` is None, ``[B, Lk]`` or 4-D broadcastable to
  ``[B, H, Lq, Lk]`` (each axis full or 1)."""
  if mask is None:
    return
  shape = _shape("mask", mask, "[B, Lk] or [B|1, H|1, Lq|1, Lk|1]")
  full = (batch, heads, q_len, k_len)
  if shape == (batch, k_len) or (len(shape) == 4 and all(s in (1, f) for s, f in zip(shape, full))):
    return
  raise ValueError(f"attend: mask: got shape {shape}; expected [B, Lk] = {(batch, k_len)} or "
                   f"4-D broadcastable to [B, H, Lq, Lk] = {full}")


def check_arguments(q: Array, k: Array, v: Array, terms: Sequence[Term], *,
                    mask: Array | None = None, causal: bool = False,
                    scale: float | None = None, route: str = "auto",
                    implementation: str | None = None, dropout_rate: float = 0.0,
                    dropout_rng: Array | None = None,
                    segment_ids: Array | None = None) -> None:
  """Raises one ValueError line ``attend: <argument>: ...`` for the first argument of
  :func:`attend` (same names and meanings) that does not fit, else returns None.

  Only static facts are read (types, shapes, dtypes, Python values), so the check
  costs nothing at run time; values inside traced arrays (token ids, mask entries)
  are not checked. ``precision`` is checked by :func:`dot_precision`.
  """
  q_shape = _shape("q", q, "[B, Lq, H, D]")
  k_shape = _shape("k", k, "[B, Lk, H, D]")
  v_shape = _shape("v", v, "[B, Lk, H, D]")
  for name, x, shape, layout in (("q", q, q_shape, "[B, Lq, H, D]"),
                                 ("k", k, k_shape, "[B, Lk, H, D]"),
                                 ("v", v, v_shape, "[B, Lk, H, D]")):
    if len(shape) != 4:
      raise ValueError(f"attend: {name}: got shape {shape}; expected {layout}")
    if not _is_float_dtype(x.dtype):
      raise ValueError(f"attend: {name}: got dtype {x.dtype}; expected a floating dtype")
  batch, q_len, heads, _ = q_shape
  if k_shape[0] != batch or k_shape[2:] != q_shape[2:]:
    raise ValueError(f"attend: k: got shape {k_shape} for q {q_shape}; expected [B, Lk, H, D] "
                     "with q's B, H and D")
  if v_shape != k_shape:
    raise ValueError(f"attend: v: got shape {v_shape}; expected k's {k_shape}")
  if isinstance(terms, (Term, SchemeTerms)) or not isinstance(terms, Sequence):
    raise ValueError(f"attend: terms: got a {type(terms).__name__}; expected a sequence of "
                     "Terms (SchemeTerms.for_layer(layer) gives one layer's)")
  for index, term in enumerate(terms):
    if not isinstance(term, Term):
      raise ValueError(f"attend: terms[{index}]: got a {type(term).__name__}; expected a Term")
    problem = term.shape_problem(q_shape, k_shape)
    if problem:
      raise ValueError(f"attend: terms[{index}] ({type(term).__name__}): {problem}")
  check_mask(mask, batch, heads, q_len, k_shape[1])
  if not isinstance(causal, (bool, np.bool_)):
    raise ValueError(f"attend: causal: got {causal!r}; allowed: True or False")
  if scale is not None and not (is_finite_number(scale) and scale > 0):
    raise ValueError(f"attend: scale: got {scale!r}; allowed: a finite positive number, or "
                     "None for 1 / sqrt(D)")
  _one_of("route", route, route_plan.ROUTES)
  _one_of("implementation", implementation, (None, *route_plan.IMPLEMENTATIONS))
  if not (is_finite_number(dropout_rate) and 0 <= dropout_rate < 1):
    raise ValueError(f"attend: dropout_rate: got {dropout_rate!r}; allowed: a number in [0, 1)")
  if dropout_rng is not None and not (
      hasattr(dropout_rng, "dtype") and (jax.dtypes.issubdtype(dropout_rng.dtype,
                                                               jax.dtypes.prng_key)
                                         or dropout_rng.dtype == jnp.uint32)):
    raise ValueError(f"attend: dropout_rng: got {type(dropout_rng).__name__} "
                     f"{getattr(dropout_rng, 'dtype', '')}; allowed: a PRNG key or None")
  if segment_ids is not None:
    seg_shape = _shape("segment_ids", segment_ids, "[B, L]")
    if seg_shape != (batch, q_len) or k_shape[1] != q_len:
      raise ValueError(f"attend: segment_ids: got shape {seg_shape} for {q_len} queries and "
                       f"{k_shape[1]} keys; expected [B, L] = {(batch, q_len)} "
                       "(self-attention)")


def _mask_4d(mask: Array | None, causal: bool, q_len: int, k_len: int,
             segment_ids: Array | None = None) -> Array | None:
  """Padding mask ``[B, Lk]`` (or ``[B|1, H|1, Lq, Lk]``), causality and same-segment
  (``segment_ids`` ``[B, L]``, self-attention) as one 4-D bool."""
  if mask is not None:
    mask = mask[:, None, None, :] if mask.ndim == 2 else mask
    mask = mask.astype(bool)
  if causal:
    tril = jnp.tril(jnp.ones((q_len, k_len), bool))[None, None]
    mask = tril if mask is None else jnp.logical_and(mask, tril)
  if segment_ids is not None:
    same = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    mask = same if mask is None else jnp.logical_and(mask, same)
  return mask


def _reference(q, k, v, terms, mask, causal, scale, dropout_rate=0.0, seed=None,
               segment_ids=None, precision="float32"):
  dot = dot_precision(precision, q.dtype)
  logits = jnp.einsum("bihd,bjhd->bhij", q, k, precision=dot) * scale
  for term in terms:
    extra = term.logits(q, scale)
    if extra is not None:
      logits = logits + extra.astype(logits.dtype)
  mask = _mask_4d(mask, causal, q.shape[1], k.shape[1], segment_ids)
  logits = logits.astype(jnp.float32)
  if mask is not None:
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits, axis=-1)
  if seed is not None:
    probs = probs * dropout_multipliers(seed, probs.shape, dropout_rate)
  probs = probs.astype(v.dtype)
  out = jnp.einsum("bhij,bjhd->bihd", probs, v, precision=dot)
  for term in terms:
    extra = term.value_output(probs)
    if extra is not None:
      out = out + extra.astype(out.dtype)
  return out


def _kernel(kernel: route_plan.KernelPlan, q, k, v, offsets, closed, rows, cols, mask, causal,
            scale, segment_ids, precision, dropout_rate, seed):
  """The Pallas kernel with the plan's settings; ``offsets``: the Toeplitz vectors;
  ``closed``: the closed-form term's part (entry ``registers``) or None; ``rows``, ``cols``:
  the separable terms' vectors."""
  return relative_flash_attention(
      q, k, v, sum(offsets) if offsets else None,
      offset_fn=closed.offset_fn if closed else None,
      offset_params=closed.offset_params if closed else None,
      row_bias=sum(rows) if rows else None,
      col_bias=sum(cols) if cols else None, mask=mask, q_segment_ids=segment_ids,
      kv_segment_ids=segment_ids, causal=causal, scale=scale, zero_first=kernel.zero_first,
      tiles=kernel.tiles, blocks=kernel.blocks,
      precision=precision, dropout_rate=dropout_rate if kernel.dropout else 0.0,
      dropout_seed=seed if kernel.dropout else None, forward=kernel.forward,
      backward=kernel.backward)


def _execute(plan: route_plan.Plan, q, k, v, terms, mask, causal, scale, *, segment_ids,
             precision, dropout_rate, seed):
  """Runs ``plan`` (:func:`posenc_jax.route_plan.plan`) on q/k ``[B, L, H, D]`` (after the
  q/k transforms) and v; returns ``[B, Lq, H, D]``."""
  if plan.runner == "reference":
    return _reference(q, k, v, terms, mask, causal, scale, dropout_rate, seed, segment_ids,
                      precision)
  q_parts, k_parts, dense, offsets, zero_first, rows, cols = [q], [k], [], [], [], [], []
  key_vectors, closed = [], None
  for term, entry in zip(terms, plan.entries):
    if entry == "table":
      dense.append(term.logits(q, scale))
    elif entry == "channels":
      key_vectors.append(term.key_vector(k.shape[1]))
    elif entry != "transform":
      part = term.fused(q, scale)
      if entry == "bias":
        dense.append(part.bias)
      elif entry == "fold":
        batch = q.shape[0]
        q_parts.append(jnp.broadcast_to(part.q_extra, (batch,) + part.q_extra.shape[1:]))
        k_parts.append(jnp.broadcast_to(part.k_extra, (batch,) + part.k_extra.shape[1:]))
      elif entry == "vectors":
        rows.append(part.row)
        cols.append(part.col)
      elif entry == "broadcast":
        dense.append(part.row[..., :, None] + part.col[..., None, :])
      elif entry == "registers":  # the closed form, evaluated in the kernel's tiles
        closed = part
      else:  # "kernel", "offsets": the Toeplitz vector, in the tiles or materialised
        offsets.append(part.offset_bias)
        zero_first.append(part.zero_first)
  if key_vectors:  # separable under the causal mask: s_j folded into q/k channels
    part = key_channels(sum(key_vectors[1:], key_vectors[0]), q.shape[1], scale, q.dtype)
    for parts, extra, x in ((q_parts, part.q_extra, q), (k_parts, part.k_extra, k)):
      parts.append(jnp.broadcast_to(extra, x.shape[:3] + extra.shape[-1:]))
  head_dim = v.shape[-1]
  q = jnp.concatenate(q_parts, axis=-1)
  k = jnp.concatenate(k_parts, axis=-1)
  if q.shape[-1] < plan.qk_dim:  # zero columns change no product; cuDNN wants multiples of 8
    widen = [(0, 0)] * 3 + [(0, plan.qk_dim - q.shape[-1])]
    q, k = jnp.pad(q, widen), jnp.pad(k, widen)
  q_len, k_len = q.shape[1], k.shape[1]
  if plan.runner == "splash":
    return _splash(q, k, v, mask, causal, scale, segment_ids)
  kernel = lambda: _kernel(plan.kernel, q, k, v, offsets, closed, rows, cols,  # noqa: E731
                           mask, causal, scale, segment_ids, precision, dropout_rate, seed)
  if plan.runner == "kernel":
    return kernel()
  dense += [toeplitz_bias(o, q_len, k_len, z) for o, z in zip(offsets, zero_first)]
  bias = sum(dense[1:], dense[0]).astype(q.dtype) if dense else None
  # dot_product_attention wants v shaped like k: zero-pad, then slice off.
  v_wide = jnp.pad(v, [(0, 0)] * 3 + [(0, k.shape[-1] - head_dim)])

  def dot_product_attention(mask_4d=None, kv_lengths=None):
    with jax.default_matmul_precision(precision):
      out = jax.nn.dot_product_attention(
          q, k, v_wide, bias=bias, mask=mask_4d, scale=scale, is_causal=causal,
          key_value_seq_lengths=kv_lengths, implementation=plan.implementation)
    return out[..., :head_dim]

  mask_4d = _mask_4d(mask, False, q_len, k_len, segment_ids)
  if plan.mask in (None, "mask"):
    return dot_product_attention(mask_4d)
  # cuDNN checks at trace time that a mask (turned into a bias) spans [Lq, Lk].
  full = lambda: dot_product_attention(  # noqa: E731
      jnp.broadcast_to(mask_4d, mask_4d.shape[:2] + (q_len, k_len)))
  if plan.mask == "full":
    return full()
  # A key mask that keeps a prefix of every row (right padding, the usual case) goes as
  # sequence lengths, with no [Lq, Lk] array; any other key mask takes the plan's fallback.
  lengths = jnp.sum(mask.astype(jnp.int32), axis=-1)
  is_prefix = jnp.all((jnp.arange(k_len)[None, :] < lengths[:, None]) == mask.astype(bool))
  return lax.cond(is_prefix & jnp.all(lengths > 0),
                  lambda: dot_product_attention(kv_lengths=lengths),
                  kernel if plan.mask == "lengths or kernel" else full)


def _splash(q, k, v, mask, causal, scale, segment_ids=None):
  """TPU splash attention (no additive bias): q pre-scaled, padding as kv segment ids.

  q/k ``[B, L, H, Dk]`` (terms folded in), v ``[B, L, H, D]``; returns
  ``[B, L, H, D]``. Interpret mode on CPU (tests).
  """
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
  batch, length, heads, _ = q.shape
  shape = (length, length)
  pattern = masks.CausalMask(shape) if causal else masks.FullMask(shape)
  kernel = splash.make_splash_mha(masks.MultiHeadMask([pattern] * heads), head_shards=1,
                                  q_seq_shards=1, interpret=jax.default_backend() == "cpu")
  q_segments = (jnp.zeros((batch, length), jnp.int32) if segment_ids is None
                else segment_ids.astype(jnp.int32))
  kv_segments = q_segments if mask is None else jnp.where(mask.astype(bool), q_segments, -1)
  heads_major = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
  out = jax.vmap(lambda q, k, v, qs, ks: kernel(q, k, v, segment_ids=splash.SegmentIds(qs, ks)))(
      heads_major(q * jnp.asarray(scale, q.dtype)), heads_major(k), heads_major(v), q_segments,
      kv_segments)
  return heads_major(out)


def attend(
    q: Array,
    k: Array,
    v: Array,
    terms: Sequence[Term] = (),
    *,
    mask: Array | None = None,
    causal: bool = False,
    scale: float | None = None,
    route: Route = "auto",
    implementation: Literal["xla", "cudnn"] | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    segment_ids: Array | None = None,
    precision: str = "float32",
) -> Array:
  """Attention with positional/segment logit terms.

  Args:
    q: ``[B, Lq, H, D]`` queries.
    k: ``[B, Lk, H, D]`` keys.
    v: ``[B, Lk, H, D]`` values.
    terms: attention terms of one layer (:meth:`SchemeTerms.for_layer`).
    mask: ``[B, Lk]`` padding mask (True = attend) or a bool mask
      broadcastable to ``[B, H, Lq, Lk]``.
    causal: also mask keys after the query (decoder self-attention).
    scale: content scale ``c``; None gives ``1 / sqrt(D)``.
    route: ``"reference"``, ``"fused"`` or ``"auto"`` (see the module docstring).
    implementation: for :func:`jax.nn.dot_product_attention` on the fused
      route: ``"xla"``, ``"cudnn"``, or None to use cuDNN where
      :func:`posenc_jax.route_plan.cudnn_unsupported` allows.
    dropout_rate: attention-probability dropout (BERT's
      ``attention_probs_dropout_prob``); active only with a ``dropout_rng``. The
      mask is a hash of (seed, batch, head, query, key)
      (:mod:`posenc_jax.kernels.dropout`), the same on the reference route and
      in the Pallas kernel, which the fused route then runs (cuDNN and splash
      attention are skipped; what the kernel cannot take runs the reference).
    dropout_rng: PRNG key for the dropout; None means deterministic.
    segment_ids: ``[B, L]`` int segment of each position for packed
      sequences (self-attention, ``Lq == Lk``): a query attends only keys of
      its own segment. The kernels take it natively; elsewhere it joins the
      mask.
    precision: ``"float32"`` (default): float32 inputs multiply in full
      float32 on every route, so routes and devices agree to float32
      rounding; ``"tensorfloat32"`` opts into JAX's faster default (TF32 on
      NVIDIA GPUs, bfloat16 passes on TPU). See :func:`dot_precision`.

  Returns:
    ``[B, Lq, H, D]``.

  Raises:
    ValueError: one line naming the first argument that does not fit
      (:func:`check_arguments`), before any route runs.
  """
  check_arguments(q, k, v, terms, mask=mask, causal=causal, scale=scale, route=route,
                  implementation=implementation, dropout_rate=dropout_rate,
                  dropout_rng=dropout_rng, segment_ids=segment_ids)
  dot_precision(precision, q.dtype)  # a bad name fails here, on every route
  scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
  terms = [term.with_key_length(k.shape[1]) for term in terms]
  for term in terms:
    q, k = term.transform_qk(q, k)
  terms = [term.with_keys(k) for term in terms]
  seed = dropout_seed(dropout_rng) if dropout_rate > 0.0 and dropout_rng is not None else None
  plan = route_plan.plan_for(q, k, v, terms, mask=mask, causal=causal, dropout=seed is not None,
                             segment_ids=segment_ids, route=route,
                             implementation=implementation, precision=precision)
  return _execute(plan, q, k, v, terms, mask, causal, scale, segment_ids=segment_ids,
                  precision=precision, dropout_rate=dropout_rate, seed=seed)


def head_projection(module, name: str) -> nn.DenseGeneral:
  """``[.., d] -> [.., H, D]``: the query/key/value projection of ``module``.

  ``module`` provides ``num_heads``, ``head_dim``, ``dtype`` and ``kernel_init``
  (:class:`MultiHeadAttention` and the Linformer layer share these pieces);
  logical axes ``(embed, heads, kv)``.
  """
  return nn.DenseGeneral(
      (module.num_heads, module.head_dim), dtype=module.dtype, name=name,
      kernel_init=nn.with_logical_partitioning(module.kernel_init, ("embed", "heads", "kv")),
      bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("heads", "kv")))


def output_projection(module, features: int, name: str = "out") -> nn.DenseGeneral:
  """``[.., H, D] -> [.., features]``: the output projection of ``module`` (see above)."""
  return nn.DenseGeneral(
      features, axis=(-2, -1), dtype=module.dtype, name=name,
      kernel_init=nn.with_logical_partitioning(module.kernel_init, ("heads", "kv", "embed")),
      bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)))


class MultiHeadAttention(nn.Module):
  """Multi-head self- or cross-attention whose logits take a list of terms.

  Attributes:
    num_heads: H.
    head_dim: D; the output projection maps ``H * D`` back to the input width.
    route: see :func:`attend`.
    dtype: compute dtype (parameters stay float32).
    dropout_rate: attention-probability dropout (needs a ``dropout`` rng
      when ``deterministic`` is False).
    precision: float32 matmul precision, see :func:`attend`.

  Incremental decoding (``decode=True``, self-attention only) keeps a KV
  cache in the ``cache`` collection, as flax's ``decode`` pattern does:

    cached_key, cached_value  ``[B, L_dec, H, D]``  raw projections (before
                                                    any term's q/k transform)
    cache_index               int32 scalar, the next position to write
    key_state_<n>             ``[B, L_dec, ...]``   term ``n``'s :meth:`Term.key_state`
                                                    (the forgetting gates' ``log f``), for
                                                    a term that has one

  The first ``decode=True`` call (made with the full-length input, e.g. by
  ``init``) only creates the cache and otherwise runs as usual. Each later
  call takes one position ``x`` ``[B, 1, d]``: it writes k/v at
  ``cache_index``, attends the query against every cached key with the keys
  ``<= cache_index`` unmasked, and slices the terms with
  ``slice_queries(cache_index, 1)``. The terms must be built for the full
  decode length ``L_dec``, so the keys keep their absolute positions (RoPE
  and BERT-A^d transform every cached key by its own position each step).
  """

  num_heads: int
  head_dim: int
  route: Route = "auto"
  dtype: jnp.dtype = jnp.float32
  dropout_rate: float = 0.0
  precision: str = "float32"
  kernel_init: nn.initializers.Initializer = nn.initializers.normal(0.02)

  def __post_init__(self):
    # route, dropout_rate and precision are checked by attend, on every call.
    for field in ("num_heads", "head_dim"):
      value = getattr(self, field)
      if not is_int(value) or value < 1:
        raise ValueError(f"MultiHeadAttention: {field}: got {value!r}; allowed: a positive "
                         "integer")
    if not _is_float_dtype(self.dtype):
      raise ValueError(f"MultiHeadAttention: dtype: got {self.dtype!r}; allowed: a floating "
                       "dtype")
    super().__post_init__()

  @nn.compact
  def __call__(self, x: Array, terms: Sequence[Term] = (), *, context: Array | None = None,
               mask: Array | None = None, causal: bool = False,
               scale: float | None = None, deterministic: bool = True,
               decode: bool = False, segment_ids: Array | None = None) -> Array:
    """Args: ``x`` ``[B, Lq, d]``; ``context`` ``[B, Lk, d']`` (None: ``x``).

    ``decode``: one incremental-decoding step (see the class docstring); a
    ``mask`` is then ``[B, L_dec]`` over the cache positions, ``causal`` is
    implied. ``segment_ids``: ``[B, L]`` packed sequences (self-attention, not with
    ``decode``): a query attends only keys of its own segment (see :func:`attend`).

    Returns ``[B, Lq, d]``. The other arguments are checked by :func:`attend`.
    """
    if jnp.ndim(x) != 3:
      raise ValueError(f"MultiHeadAttention: x: got shape {jnp.shape(x)}; expected [B, Lq, d]")
    if context is not None and (jnp.ndim(context) != 3 or context.shape[0] != x.shape[0]):
      raise ValueError(f"MultiHeadAttention: context: got shape {jnp.shape(context)}; expected "
                       f"[B, Lk, d'] with x's B = {x.shape[0]}")
    if decode and context is not None:
      raise ValueError("decode: the KV cache is for self-attention; cross-attention "
                       "(context given) recomputes its keys")
    if decode and segment_ids is not None:
      raise ValueError("decode: a decoding step takes no packed segment_ids")
    context = x if context is None else context
    # Terms computed from the layer input (the forgetting gates) take it here.
    terms = [term.with_inputs(x, segment_ids) for term in terms]
    dense = lambda name: head_projection(self, name)  # noqa: E731
    q, k, v = dense("query")(x), dense("key")(context), dense("value")(context)
    if decode:
      k, v, terms, mask, causal = self._decode_step(q, k, v, terms, mask, causal)
    dropout_rng = None
    if not deterministic and self.dropout_rate > 0.0:
      dropout_rng = self.make_rng("dropout")
    out = attend(q, k, v, terms, mask=mask, causal=causal, scale=scale, route=self.route,
                 dropout_rate=self.dropout_rate, dropout_rng=dropout_rng,
                 segment_ids=segment_ids, precision=self.precision)
    return output_projection(self, x.shape[-1])(out)

  def _decode_step(self, q, k, v, terms, mask, causal):
    """Writes this step's k/v into the cache; returns what :func:`attend` needs.

    Returns ``(k, v, terms, mask, causal)``: on the first (cache-creating)
    call the inputs unchanged; afterwards the full cache ``[B, L_dec, H, D]``,
    the terms' row at ``cache_index`` (a term with a key state over every cached key's),
    the mask of keys ``<= cache_index`` and ``causal=False`` (the mask already is causal).
    """
    initialized = self.has_variable("cache", "cached_key")
    cached_key = self.variable("cache", "cached_key", jnp.zeros, k.shape, k.dtype)
    cached_value = self.variable("cache", "cached_value", jnp.zeros, v.shape, v.dtype)
    cache_index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
    states = [(n, term.key_state()) for n, term in enumerate(terms)]
    cached_states = {n: self.variable("cache", f"key_state_{n}", jnp.zeros, state.shape,
                                      state.dtype)
                     for n, state in states if state is not None}
    if not initialized:
      return k, v, terms, mask, causal
    batch, length, heads, _ = cached_key.value.shape
    if q.shape[:2] != (batch, 1):
      raise ValueError(f"decode: a step takes x [B, 1, d] with the cache's B = {batch}; got "
                       f"B, L = {q.shape[:2]}")
    check_mask(mask, batch, heads, 1, length)
    index = cache_index.value
    k = jax.lax.dynamic_update_slice(cached_key.value, k.astype(cached_key.value.dtype),
                                     (0, index, 0, 0))
    v = jax.lax.dynamic_update_slice(cached_value.value, v.astype(cached_value.value.dtype),
                                     (0, index, 0, 0))
    cached_key.value, cached_value.value = k, v
    terms = list(terms)
    for n, cached in cached_states.items():
      step = terms[n].key_state()
      cached.value = jax.lax.dynamic_update_slice(
          cached.value, step.astype(cached.value.dtype), (0, index) + (0,) * (step.ndim - 2))
      terms[n] = terms[n].with_key_state(cached.value)
    cache_index.value = index + 1
    step_mask = (jnp.arange(length) <= index)[None, None, None, :]  # [1, 1, 1, L_dec]
    mask = step_mask if mask is None else jnp.logical_and(_mask_4d(mask, False, 1, length),
                                                          step_mask)
    terms = [term.slice_queries(index, 1) for term in terms]
    return k, v, terms, mask, False
