"""Forgetting gates (Lin et al., ICLR 2025, "Forgetting Transformer: Softmax Attention with a
Forget Gate", FoX): a data-dependent, ALiBi-like decay of the attention logits.

Each attention layer has a forget gate per head computed from its input ``x_t`` (the hidden
state that also feeds q, k and v), ``f_t = sigmoid(w_h . x_t + b_h)``, and adds to the
logit of query ``i`` and key ``j <= i`` the log of the gates in between,
``sum_{l=j+1..i} log f_l = c_i - c_j`` with ``c = cumsum log f`` (the paper's eq. 6-7; no
other position information: FoX is otherwise NoPE). The authors' code
(zhixuan-lin/forgetting-transformer, ``ForgettingAttentionLayer`` with ``fgate_type="full"``)
fixes what the text leaves open, and this module follows it: one ``Linear(d_model, H)`` with
a bias per layer, weights ``N(0, 0.02)`` and bias zeros (``fgate_bias_init`` is for the
data-independent variants only), ``log f`` taken in float32 and cached for decoding.
``docs/schemes/forgetting.md`` states the sources.

The term (:class:`~posenc_jax.terms.ForgettingGates`) is separable, ``r_i + s_j`` with
``r = c`` and ``s = -c``: the fused route hands the flash kernel the two vectors, which it
adds to each tile in float32. A decoder scheme: refused in bidirectional stacks.
"""

from __future__ import annotations

import flax.linen as nn

from posenc_jax.schemes.base import Scheme, one_of
from posenc_jax.terms import ForgettingGates, SchemeTerms

INIT_STD = 0.02  # the reference layer's initializer_range


class Fox(Scheme):
  """``T[b, h, i, j] = sum_{l=j+1..i} log sigmoid(w_h . x_l + b_h)`` for ``j <= i``.

  Parameters: ``weight`` ``[layers, d_model, H]`` (``N(0, 0.02)``) and ``bias``
  ``[layers, H]`` (zeros), ``layers`` = ``num_layers``, or 1 when shared. The gates read
  each attention layer's input, handed to the term by
  :class:`~posenc_jax.attention.MultiHeadAttention` (:meth:`~posenc_jax.terms.Term.with_inputs`).

  Attributes:
    sharing: ``none`` (a gate projection per layer, the paper's) or ``layer`` (one for all
      layers).
  """

  sharing: str = "none"

  scheme_name = "fox"
  causal_only = True  # the sum runs over the keys up to the query: no encoder form
  hyperparameters = {"sharing": one_of("none", "layer")}

  @classmethod
  def layer_flops(cls, values, dims, length):
    """The gate projection, ``2 L d H``."""
    del values
    return 2 * length * dims["d_model"] * dims["num_heads"]

  @nn.compact
  def __call__(self, length, segment_ids=None, position_ids=None):
    self.check_length(length)  # the gates count no positions: any length
    self.check_position_ids(length, position_ids)  # packed rows: c restarts per segment
    layers, _ = self.sharing_dims(self.sharing)
    weight = self.logical_param("weight", nn.initializers.normal(INIT_STD),
                                (layers, self.d_model, self.num_heads),
                                ("layers", "embed", "heads"))
    bias = self.logical_param("bias", nn.initializers.zeros, (layers, self.num_heads),
                              ("layers", "heads"))
    return SchemeTerms(terms=(ForgettingGates(weight, bias),))
