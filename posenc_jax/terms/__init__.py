"""Attention-logit terms: the one public notion every scheme produces.

Every positional or segment scheme ends up in the attention logits

    A[b, h, i, j] = c * q_i . k_j + sum_t T_t[b, h, i, j]

(see ``shared/spec/SCHEMES.md``). A term keeps its *form* explicit, because
the form decides which attention route can run it without materialising an
``[Lq, Lk]`` tensor. Each form is one file of this package:

=================  ==========================================  ===============  =================
form               class                                       fused route      file
=================  ==========================================  ===============  =================
bias               :class:`Bias` ``[H,Lq,Lk]`` /               bias input       bias.py
                   ``[B,H,Lq,Lk]``
relative (i - j)   :class:`Toeplitz` (DIET-REL, T5, ALiBi)     in-kernel bias   toeplitz.py
factored (U V^T)   :class:`Factored`                           concat to q/k    factored.py
query-dependent    :class:`QueryRelative` (Shaw)               bias from q      query_relative.py
q and k dependent  :class:`ContextualPositions` (CoPE)         bias from q, k   contextual.py
separable r_i+s_j  :class:`ForgettingGates` (FoX)              in-kernel rows   forgetting.py
q/k transform      :class:`Rotation` (RoPE), :class:`QKShift`  transform q/k    qk_transform.py
input-level        :class:`InputEmbedding`                     (not attention)  embedding.py
=================  ==========================================  ===============  =================

Terms are pytrees (``flax.struct`` dataclasses), so they pass through
``jax.jit``, ``jax.grad`` and ``nn.scan``. Array layouts follow
``jax.nn.dot_product_attention``: q/k/v are ``[B, L, H, D]``.

Each attention term implements the same small protocol, used by
:mod:`posenc_jax.attention` without knowing which paper the term came from:

* ``transform_qk(q, k) -> (q, k)``: rewrite q and k before anything else.
* ``logits(q, scale) -> [B|1, H|1, Lq, Lk] | None``: the materialised term.
* ``fused(q, scale) -> FusedPart``: what the fused route needs instead.
* ``fused_form() -> TermForm``: how that part enters the fused route, from static
  attributes alone (what the route plan, :mod:`posenc_jax.route_plan`, asks).
* ``key_vector(k_len) -> [B|1, H|1, Lk]``: ``s`` of a term that is ``r_i + s_j`` under a
  causal mask (its form's ``causal_separable``: causal ALiBi, the forgetting gates), which
  the fused route may fold into q/k channels and run on cuDNN (``channels.py``).
* ``value_output(probs) -> [B, Lq, H, D] | None``: an extra contribution to
  the attention output (Shaw's value term).
* ``slice_queries(start, size) -> Term``: the same term restricted to query
  rows ``[start, start + size)``, keys unchanged (incremental decoding: the
  term is built once for the whole decode length and each step takes its
  row, so keys keep their absolute positions). ``start`` may be traced.
* ``with_key_length(k_len) -> Term``: tells a term whose arrays carry no key
  axis (Shaw's, which holds only an offset table) how many keys the
  attention has; :func:`posenc_jax.attend` calls it. Others return self.
* ``with_keys(k) -> Term``: hands the keys (after every q/k transform) to a term whose
  logits read them (CoPE's gates ``sigmoid(q_i . k_t)``); :func:`posenc_jax.attend` calls
  it. Others return self.
* ``with_inputs(x, segment_ids) -> Term``: hands the attention layer's input ``x``
  ``[B, L, d]`` (and its packed ``segment_ids`` ``[B, L]`` or None) to a term computed
  from it (the forgetting gates ``sigmoid(w^T x_t + b)``);
  :class:`posenc_jax.attention.MultiHeadAttention` calls it. Others return self.
* ``key_state() -> [B, Lk, ...] | None`` and ``with_key_state(state) -> Term``: what
  incremental decoding keeps of each key besides k and v (the forgetting gates' ``log f``),
  cached by :class:`~posenc_jax.attention.MultiHeadAttention` and handed back for every
  cached key. None and self for the others.
* ``shape_problem(q_shape, k_shape) -> str | None``: why the term's arrays do
  not fit attention over q ``[B, Lq, H, D]`` and k ``[B, Lk, H, D]`` (static
  shapes, checked by :func:`posenc_jax.attend` at trace time), or None.

The protocol (with :class:`FusedPart`, :class:`TermForm` and the shape checks the forms
share) is ``protocol.py``; the offsets ``j - i`` and the tables read at them are
``offset_tables.py``; :class:`SchemeTerms`, which carries one scheme's terms and their layer
axis, is ``scheme_terms.py``; a key vector folded into q/k channels (split in parts exact
enough for bfloat16) is ``channels.py``.

Slicing counts the query axis from the end of each array (``-2`` for
``[.., Lq, Lk]``, ``-3`` for ``[.., Lq, H, r]``), so it works on a term of
one layer and on a :class:`SchemeTerms` term with its leading layer axis.
"""

from posenc_jax.terms.bias import Bias
from posenc_jax.terms.channels import key_channels
from posenc_jax.terms.contextual import ContextualPositions, contextual_positions
from posenc_jax.terms.embedding import InputEmbedding
from posenc_jax.terms.factored import Factored
from posenc_jax.terms.forgetting import ForgettingGates, segment_cumsum
from posenc_jax.terms.offset_tables import (id_offsets, lookup, lookup_rows, offsets,
                                            relative_offsets, skew_offsets, toeplitz_bias,
                                            toeplitz_bias_at)
from posenc_jax.terms.protocol import FusedPart, Term, TermForm, slice_rows
from posenc_jax.terms.qk_transform import QKShift, Rotation, rotate_pairs
from posenc_jax.terms.query_relative import QueryRelative
from posenc_jax.terms.scheme_terms import SchemeTerms, layer_terms
from posenc_jax.terms.toeplitz import Toeplitz

__all__ = [
    "Bias", "ContextualPositions", "Factored", "ForgettingGates", "FusedPart", "InputEmbedding",
    "QKShift", "QueryRelative", "Rotation", "SchemeTerms", "Term", "TermForm", "Toeplitz",
    "contextual_positions", "id_offsets", "key_channels", "layer_terms", "lookup", "lookup_rows", "offsets",
    "relative_offsets", "rotate_pairs", "segment_cumsum", "skew_offsets", "slice_rows",
    "toeplitz_bias", "toeplitz_bias_at",
]
