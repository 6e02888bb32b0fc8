"""Linformer self-attention (Wang et al. 2020): keys and values projected along the sequence.

The layer input ``X`` ``[L, d]`` is projected along the sequence first, then
by each head's key and value projections (biases ``b_K``, ``b_V`` ``[D]``)::

  K' = (E[:, :L] X) W_K + b_K,   V' = (F[:, :L] X) W_V + b_V,   E, F [k, L_max]
  head = softmax(c Q K'^T + sum_t T_t) V'          (logits [L, k])

so attention costs ``O(L k)`` instead of ``O(L^2)``. This is the order of
Linformer's released code (fairseq ``examples/linformer``: ``compress_k`` on
the input, then ``k_proj``), so each projected key gets the bias once.
Projecting ``K = X W_K + b_K`` instead, ``E K = (E X) W_K + (E 1) b_K``, would
scale the bias by ``E``'s row sums: the same model only with zero biases. Rows
of ``X`` at padding tokens are zeroed before the projection; the projected
keys then need no mask. Positional terms must have ``k`` key rows
(DIET-ABS-LIN); relative and query-dependent terms have no meaning here (a
projected key has no position) and :func:`~posenc_jax.models.model_config`
rejects them.

Sharing (``config.linformer_sharing``; the paper's "headwise" sharing is
always on, one ``E``/``F`` for all heads of a layer):

=========  =====================================  ===============================
sharing    parameters                             where
=========  =====================================  ===============================
``none``   ``E``, ``F`` ``[k, L_max]`` per layer  ``layers_i/attention/{E,F}``
``kv``     ``E = F`` ``[k, L_max]`` per layer     ``layers_i/attention/E``
``layer``  one ``E = F`` ``[k, L_max]``           ``linformer/E`` of the encoder
=========  =====================================  ===============================

Under ``layer`` sharing the encoder owns a :class:`SharedProjection` module
and hands ``E[:, :L]`` to every layer as a :class:`LinformerProjection`
entry of the layer's terms (computed once per forward pass, like a
layer-shared scheme term), so the layer keeps the call signature of
:class:`~posenc_jax.attention.MultiHeadAttention`.

Initialisation: Glorot (xavier) uniform over ``[k, L_max]``,
``U(+-sqrt(6 / (k + L_max)))``, the family of initialisers Linformer's
released code uses for its projections (it may add a gain). A row of ``E X``
is then a random combination of the ``L`` token vectors with weights of
variance ``2 / (k + L_max)``: for ``L`` near ``L_max`` its variance stays of
the order of one token's, so the logits start at the scale of full
attention's.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from posenc_jax.attention import attend, head_projection, output_projection
from posenc_jax.models.config import ModelConfig
from posenc_jax.models.inputs import check_like
from posenc_jax.terms import SchemeTerms, Term

Array = jax.Array

PROJECTION_AXES = ("linformer_k", "abspos")
PROJECTION_INIT = nn.initializers.xavier_uniform()
KERNEL_INIT = nn.initializers.normal(0.02)  # q/k/v/out, as MultiHeadAttention


def projection_param(module: nn.Module, name: str, config: ModelConfig) -> Array:
  """A Linformer projection table ``[k, L_max]`` with logical axes (linformer_k, abspos)."""
  return module.param(name, nn.with_logical_partitioning(PROJECTION_INIT, PROJECTION_AXES),
                      (config.linformer_k, config.max_len))


def _check_length(config: ModelConfig, length: int) -> None:
  if length > config.max_len:
    raise ValueError(f"Linformer: sequence length {length} exceeds max_len={config.max_len} "
                     f"(E and F are [linformer_k, max_len] = [{config.linformer_k}, "
                     f"{config.max_len}])")


@struct.dataclass
class LinformerProjection:
  """The layer-shared projection ``E = F`` handed to each layer in its terms.

  Not a :class:`~posenc_jax.terms.Term`: only :class:`LinformerSelfAttention`
  knows it, and full attention fails loudly if it ever receives one.

  Attributes:
    e: ``[k, L]`` (``E[:, :L]``); in :class:`~posenc_jax.terms.SchemeTerms`
      it carries a leading layer axis of size 1, ``[1, k, L]``.
  """

  e: Array


class SharedProjection(nn.Module):
  """Owner of the single ``E = F`` of ``linformer_sharing='layer'`` (one per encoder).

  Parameter: ``E`` ``[k, L_max]``, axes (linformer_k, abspos).
  """

  config: ModelConfig

  @nn.compact
  def __call__(self, length: int) -> SchemeTerms:
    """:class:`SchemeTerms` with one :class:`LinformerProjection` ``[1, k, L]`` for all layers."""
    _check_length(self.config, length)
    e = projection_param(self, "E", self.config)
    return SchemeTerms(terms=(LinformerProjection(e[None, :, :length]),))


def shared_projection(config: ModelConfig, name: str | None = None) -> nn.Module | None:
  """The encoder's :class:`SharedProjection` if the config shares E across layers, else None."""
  if config.attention == "linformer" and config.linformer_sharing == "layer":
    return SharedProjection(config, name=name)
  return None


class LinformerSelfAttention(nn.Module):
  """Multi-head self-attention with Linformer's sequence projections of keys and values.

  Parameters: ``query``, ``key``, ``value`` (kernel ``[d, H, D]``, bias
  ``[H, D]``) and ``out`` (kernel ``[H, D, d]``, bias ``[d]``), as in
  :class:`~posenc_jax.attention.MultiHeadAttention`, plus ``E`` (and ``F``
  under ``none`` sharing), ``[k, L_max]``; none under ``layer`` sharing.

  Attributes:
    config: ``num_heads``, ``dim_per_head``, ``linformer_k``,
      ``linformer_sharing``, ``max_len``, ``route``, ``dtype`` and
      ``attention_dropout_rate`` are used.
  """

  config: ModelConfig

  @property
  def kernel_init(self) -> nn.initializers.Initializer:
    return KERNEL_INIT

  @property
  def num_heads(self) -> int:
    return self.config.num_heads

  @property
  def head_dim(self) -> int:
    return self.config.dim_per_head

  @property
  def dtype(self):
    return self.config.compute_dtype

  def _projections(self, shared: list[LinformerProjection], length: int) -> tuple[Array, Array]:
    """``E[:, :L]`` and ``F[:, :L]``, each ``[k, L]``."""
    sharing = self.config.linformer_sharing
    if sharing == "layer":
      if len(shared) != 1:
        raise ValueError("Linformer: linformer_sharing='layer' needs the encoder's shared E "
                         f"among the terms (one LinformerProjection), got {len(shared)}")
      e = f = shared[0].e
      if e.shape != (self.config.linformer_k, length):
        raise ValueError(f"Linformer: the shared E is {list(e.shape)}; expected "
                         f"[linformer_k, L] = {[self.config.linformer_k, length]}")
    else:
      if shared:
        raise ValueError(f"Linformer: linformer_sharing={sharing!r} keeps E, F in each layer; "
                         "got a shared LinformerProjection in the terms")
      e = projection_param(self, "E", self.config)[:, :length]
      f = e if sharing == "kv" else projection_param(self, "F", self.config)[:, :length]
    return e, f

  @nn.compact
  def __call__(self, x: Array, terms: Sequence[Term | LinformerProjection] = (), *,
               mask: Array | None = None, scale: float | None = None,
               deterministic: bool = True) -> Array:
    """Self-attention over projected keys and values.

    Args:
      x: ``[B, L, d]``, ``L <= max_len``.
      terms: the layer's terms; each positional term has ``k`` key rows
        (e.g. DIET-ABS-LIN's ``[L, k]``). Under ``layer`` sharing also the
        encoder's :class:`LinformerProjection`.
      mask: ``[B, L]`` padding mask (True = token); rows of ``x`` at padded
        tokens are zeroed before the sequence projection.
      scale: content scale ``c``; None gives ``1 / sqrt(D)``.
      deterministic: False enables attention dropout (``dropout`` rng).

    Returns:
      ``[B, L, d]``.
    """
    cfg = self.config
    if jnp.ndim(x) != 3:
      raise ValueError(f"Linformer: x: got shape {jnp.shape(x)}; expected [B, L, d]")
    batch, length, _ = x.shape
    _check_length(cfg, length)
    check_like("Linformer", "mask", mask, (batch, length))
    shared = [t for t in terms if isinstance(t, LinformerProjection)]
    terms = [t for t in terms if not isinstance(t, LinformerProjection)]
    e, f = self._projections(shared, length)
    q = head_projection(self, "query")(x)
    tokens = x if mask is None else jnp.where(mask.astype(bool)[:, :, None], x, 0)

    def compress(p):  # [k, L] -> p X [B, k, d]
      return jnp.einsum("rj,bjd->brd", p.astype(self.dtype), tokens.astype(self.dtype))

    ex = compress(e)
    fx = ex if f is e else compress(f)  # E = F ('kv', 'layer'): one projection
    k, v = head_projection(self, "key")(ex), head_projection(self, "value")(fx)  # [B, k, H, D]
    dropout_rng = None
    if not deterministic and cfg.attention_dropout_rate > 0.0:
      dropout_rng = self.make_rng("dropout")
    out = attend(q, k, v, terms, scale=scale, route=cfg.route,
                 dropout_rate=cfg.attention_dropout_rate, dropout_rng=dropout_rng,
                 precision=cfg.attention_precision)
    return output_projection(self, x.shape[-1])(out)
