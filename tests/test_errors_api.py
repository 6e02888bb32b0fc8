"""The public Python API rejects a bad argument before anything is compiled, with one line that
names the argument, the value given and what is allowed (the nearest name for a typo): attend
and MultiHeadAttention (shapes checked at trace time, so every route gets the same check), the
term types, the schemes' hyperparameters (from a config or a module built directly), the model
config (fields and combinations of fields) and the model builders. The positive controls show
that nearby valid values still run."""

import math

import jax
import jax.numpy as jnp
import pytest

from posenc_jax import (Bias, Factored, InputEmbedding, MultiHeadAttention, QKShift,
                        QueryRelative, Rotation, SchemeConfigError, SchemeTerms, Toeplitz, attend,
                        build_scheme)
from posenc_jax.models import (BertForMaskedLM, EncoderDecoder, LinformerSelfAttention,
                               ModelConfigError, model_config)
from posenc_jax.models.build import build_model, init_inputs
from posenc_jax.schemes import DietAbs, T5Bias, relative_position_bucket, validate_scheme_config
from posenc_jax.schemes.alibi import LinearDistance

B, LQ, LK, H, D = 2, 5, 6, 4, 8  # Lq != Lk, so a term of the wrong length is caught
DIMS = dict(num_layers=2, num_heads=H, head_dim=D, d_model=16, max_len=16)
TINY = dict(vocab_size=50, d_model=16, num_layers=1, num_heads=2, mlp_dim=32, max_len=16)
SEQ2SEQ = TINY | dict(num_decoder_layers=1, segment=None, pooler=False)
KEY = jax.random.key(0)


def ones(*shape, dtype=jnp.float32):
  return jnp.ones(shape, dtype)


def ids(*shape):
  return jnp.ones(shape, jnp.int32)


Q, KV = ones(B, LQ, H, D), ones(B, LK, H, D)


def toeplitz(heads=H):
  return Toeplitz(ones(heads, 1), LinearDistance())


def attend_with(*terms, q=Q, k=KV, **kwargs):
  return attend(q, k, k, list(terms), **kwargs)


def mha_init(*args, module=None, **kwargs):
  """``MultiHeadAttention(2, 4).init`` traced by eval_shape (no compilation)."""
  module = MultiHeadAttention(2, 4) if module is None else module
  return jax.eval_shape(lambda: module.init(KEY, *args, **kwargs))


def init(module, *args, **kwargs):
  return jax.eval_shape(lambda: module.init(KEY, *args, **kwargs))


def scheme(config, **dims):
  return build_scheme(config, **(DIMS | dims))


def two_layer_terms():
  return SchemeTerms(terms=(Toeplitz(ones(2, H, 1), LinearDistance()),))


CASES = [
    # attend: q, k, v.
    pytest.param(lambda: attend(ones(B, LQ, H), KV, KV), ValueError,
                 r"attend: q: got shape \(2, 5, 4\); expected \[B, Lq, H, D\]", id="q-rank"),
    pytest.param(lambda: attend([[1.0]], KV, KV), ValueError,
                 r"attend: q: got list; expected an array \[B, Lq, H, D\]", id="q-not-array"),
    pytest.param(lambda: attend(ones(B, LQ, H, D, dtype=jnp.int32), KV, KV), ValueError,
                 r"attend: q: got dtype int32; expected a floating dtype", id="q-dtype"),
    pytest.param(lambda: attend(Q, ones(B, LK, 3, D), ones(B, LK, 3, D)), ValueError,
                 r"attend: k: got shape \(2, 6, 3, 8\) for q \(2, 5, 4, 8\); expected "
                 r"\[B, Lk, H, D\] with q's B, H and D", id="k-heads"),
    pytest.param(lambda: attend(Q, KV, ones(B, LK, H, 4)), ValueError,
                 r"attend: v: got shape \(2, 6, 4, 4\); expected k's \(2, 6, 4, 8\)", id="v-dim"),
    # attend: terms.
    pytest.param(lambda: attend(Q, KV, KV, SchemeTerms()), ValueError,
                 r"attend: terms: got a SchemeTerms; expected a sequence of Terms "
                 r"\(SchemeTerms.for_layer", id="terms-scheme-terms"),
    pytest.param(lambda: attend_with(InputEmbedding(ones(LQ, 16))), ValueError,
                 r"attend: terms\[0\]: got a InputEmbedding; expected a Term", id="terms-not-term"),
    pytest.param(lambda: attend_with(toeplitz(3)), ValueError,
                 r"attend: terms\[0\] \(Toeplitz\): table \[3, 1\] has 3 heads, but q has 4",
                 id="toeplitz-heads"),
    pytest.param(lambda: attend_with(toeplitz(3), route="fused"), ValueError,
                 r"attend: terms\[0\] \(Toeplitz\): table \[3, 1\] has 3 heads", id="fused-route"),
    pytest.param(lambda: attend_with(Toeplitz(ones(1, H, 1), LinearDistance())), ValueError,
                 r"attend: terms\[0\] \(Toeplitz\): table is \[1, 4, 1\]; expected \[H\|1, R\]",
                 id="toeplitz-layer-axis"),
    pytest.param(lambda: attend_with(toeplitz(), Bias(ones(H, LQ, LQ))), ValueError,
                 r"attend: terms\[1\] \(Bias\): value \[4, 5, 5\] has 5 keys, but k has 6",
                 id="bias-keys"),
    pytest.param(lambda: attend_with(Bias(ones(H, 7, LK))), ValueError,
                 r"attend: terms\[0\] \(Bias\): value \[4, 7, 6\] has 7 queries, but q has 5",
                 id="bias-queries"),
    pytest.param(lambda: attend_with(Bias(ones(3, H, LQ, LK))), ValueError,
                 r"value \[3, 4, 5, 6\] has 3 examples, but q has 2", id="bias-batch"),
    pytest.param(lambda: attend_with(Factored(ones(LQ, H, 2), ones(LK, H, 3))), ValueError,
                 r"attend: terms\[0\] \(Factored\): u \[5, 4, 2\] has rank 2, but v \[6, 4, 3\] "
                 r"has 3", id="factored-rank"),
    pytest.param(lambda: attend_with(Factored(ones(LQ, H, 2), ones(LQ, H, 2))), ValueError,
                 r"\(Factored\): v \[5, 4, 2\] has 5 keys, but k has 6", id="factored-keys"),
    pytest.param(lambda: attend_with(Factored(ones(LQ, 3, 2), ones(LK, 3, 2))), ValueError,
                 r"\(Factored\): u \[5, 3, 2\] has 3 heads, but q has 4", id="factored-heads"),
    pytest.param(lambda: attend_with(QueryRelative(ones(7, D), clip=2)), ValueError,
                 r"\(QueryRelative\): key_table \[7, 8\] has 7 rows, but clip=2 needs 2 clip \+ 1 "
                 r"= 5", id="shaw-rows"),
    pytest.param(lambda: attend_with(QueryRelative(ones(5, D), ones(5, 4), clip=2)), ValueError,
                 r"\(QueryRelative\): value_table \[5, 4\] has 4 features, but q has 8",
                 id="shaw-value-features"),
    pytest.param(lambda: attend_with(Rotation(ones(LQ, 3), ones(LK, 3)), q=ones(B, LQ, H, 7),
                                     k=ones(B, LK, H, 7)), ValueError,
                 r"\(Rotation\): rotates pairs of features, but q has an odd head dim 7",
                 id="rope-odd-dim"),
    pytest.param(lambda: attend_with(Rotation(ones(LQ, D // 2), ones(LQ, D // 2))), ValueError,
                 r"\(Rotation\): k_angles \[5, 4\] has 5 positions, but k has 6",
                 id="rope-positions"),
    pytest.param(lambda: attend_with(QKShift(ones(LQ, H, D), ones(LK, 2, D))), ValueError,
                 r"\(QKShift\): k_shift is \[6, 2, 8\]; expected \[L, H, D\] = \[6, 4, 8\] "
                 r"\(or \[B\|1, L, H, D\]\) from k",
                 id="qk-shift"),
    # attend: the other arguments.
    pytest.param(lambda: attend_with(mask=ones(B, LQ, dtype=bool)), ValueError,
                 r"attend: mask: got shape \(2, 5\); expected \[B, Lk\] = \(2, 6\) or 4-D "
                 r"broadcastable to \[B, H, Lq, Lk\] = \(2, 4, 5, 6\)", id="mask-2d"),
    pytest.param(lambda: attend_with(mask=ones(B, LQ, LK, dtype=bool)), ValueError,
                 r"attend: mask: got shape \(2, 5, 6\)", id="mask-3d"),
    pytest.param(lambda: attend_with(mask=ones(B, 3, LQ, LK, dtype=bool)), ValueError,
                 r"attend: mask: got shape \(2, 3, 5, 6\)", id="mask-heads"),
    pytest.param(lambda: attend_with(scale=math.inf), ValueError,
                 r"attend: scale: got inf; allowed: a finite positive number", id="scale-inf"),
    pytest.param(lambda: attend_with(scale=0.0), ValueError,
                 r"attend: scale: got 0.0; allowed: a finite positive number", id="scale-zero"),
    pytest.param(lambda: attend_with(route="fuse"), ValueError,
                 r"attend: route: got 'fuse'; did you mean 'fused'\?; allowed: auto, reference, "
                 r"fused", id="route"),
    pytest.param(lambda: attend_with(implementation="cudn"), ValueError,
                 r"attend: implementation: got 'cudn'; did you mean 'cudnn'\?; allowed: None, "
                 r"xla, cudnn", id="implementation"),
    pytest.param(lambda: attend_with(dropout_rate=1.0), ValueError,
                 r"attend: dropout_rate: got 1.0; allowed: a number in \[0, 1\)", id="dropout"),
    pytest.param(lambda: attend_with(dropout_rate=0.1, dropout_rng=ones(2)), ValueError,
                 r"attend: dropout_rng: got ArrayImpl float32; allowed: a PRNG key or None",
                 id="dropout-rng"),
    pytest.param(lambda: attend_with(causal="yes"), ValueError,
                 r"attend: causal: got 'yes'; allowed: True or False", id="causal"),
    pytest.param(lambda: attend_with(segment_ids=ids(B, LQ)), ValueError,
                 r"attend: segment_ids: got shape \(2, 5\) for 5 queries and 6 keys; expected "
                 r"\[B, L\] = \(2, 5\) \(self-attention\)", id="segment-ids-cross"),
    pytest.param(lambda: attend_with(precision="tf32"), ValueError,
                 r"precision: got 'tf32'; allowed: float32, tensorfloat32", id="precision"),
    # MultiHeadAttention.
    pytest.param(lambda: MultiHeadAttention(0, 4), ValueError,
                 r"MultiHeadAttention: num_heads: got 0; allowed: a positive integer",
                 id="mha-heads"),
    pytest.param(lambda: MultiHeadAttention(2, 2.5), ValueError,
                 r"MultiHeadAttention: head_dim: got 2.5; allowed: a positive integer",
                 id="mha-head-dim"),
    pytest.param(lambda: MultiHeadAttention(2, 4, dtype="float8"), ValueError,
                 r"MultiHeadAttention: dtype: got 'float8'; allowed: a floating dtype",
                 id="mha-dtype"),
    pytest.param(lambda: mha_init(ones(B, 16)), ValueError,
                 r"MultiHeadAttention: x: got shape \(2, 16\); expected \[B, Lq, d\]", id="mha-x"),
    pytest.param(lambda: mha_init(ones(B, LQ, 16), context=ones(3, LK, 16)), ValueError,
                 r"MultiHeadAttention: context: got shape \(3, 6, 16\); expected \[B, Lk, d'\] "
                 r"with x's B = 2", id="mha-context"),
    pytest.param(lambda: mha_init(ones(B, LQ, 16), [toeplitz(3)]), ValueError,
                 r"attend: terms\[0\] \(Toeplitz\): table \[3, 1\] has 3 heads, but q has 2",
                 id="mha-terms"),
    # SchemeTerms.
    pytest.param(lambda: two_layer_terms().for_layer(2), ValueError,
                 r"SchemeTerms.for_layer: got layer 2; allowed: an integer in \[0, 2\)",
                 id="for-layer"),
    pytest.param(lambda: SchemeTerms(InputEmbedding(ones(LQ, 16))).embed(ones(B, LK, 16)),
                 ValueError, r"SchemeTerms.embed: embedding.value is \[5, 16\], but x is "
                 r"\[2, 6, 16\]", id="embed"),
    # Schemes: configs, modules built directly, dimensions, calls.
    pytest.param(lambda: validate_scheme_config({"name": "t5", "num_buckets": 1}),
                 SchemeConfigError, r"scheme 't5': num_buckets must be an even integer >= 4 "
                 r"when bidirectional \(half per direction\), got 1", id="t5-one-bucket"),
    pytest.param(lambda: validate_scheme_config({"name": "t5", "num_buckets": 1,
                                                 "bidirectional": False}),
                 SchemeConfigError, r"scheme 't5': num_buckets must be an integer >= 2, got 1",
                 id="t5-causal-one-bucket"),
    pytest.param(lambda: validate_scheme_config({"name": "t5", "max_distance": 8}),
                 SchemeConfigError, r"scheme 't5': max_distance must exceed the 8 offsets with "
                 r"buckets of their own \(num_buckets=32, bidirectional=True\), got 8",
                 id="t5-max-distance"),
    pytest.param(lambda: T5Bias(num_buckets=7), SchemeConfigError,
                 r"scheme 't5': num_buckets must be an even integer >= 4 when bidirectional",
                 id="t5-module-odd"),
    pytest.param(lambda: relative_position_bucket(jnp.arange(3), num_buckets=2,
                                                  max_distance=1, bidirectional=False),
                 ValueError, r"relative_position_bucket: max_distance must exceed the 1 offsets",
                 id="t5-bucket-function"),
    pytest.param(lambda: validate_scheme_config({"name": "tupe_r", "num_buckets": 5}),
                 SchemeConfigError, r"scheme 'tupe_r': num_buckets must be an even integer",
                 id="tupe-r-buckets"),
    pytest.param(lambda: validate_scheme_config({"name": "tupe_a", "num_buckets": 8}),
                 SchemeConfigError, r"scheme 'tupe_a': unknown field 'num_buckets'; allowed "
                 r"fields: untie_cls", id="tupe-a-no-buckets"),
    pytest.param(lambda: validate_scheme_config({"name": "diet_abs", "content_scale": math.inf}),
                 SchemeConfigError, r"scheme 'diet_abs': content_scale must be a finite positive "
                 r"number or None, got inf", id="content-scale-inf"),
    pytest.param(lambda: DietAbs(content_scale=math.nan), SchemeConfigError,
                 r"scheme 'diet_abs': content_scale must be a finite positive number or None, "
                 r"got nan", id="content-scale-nan-module"),
    pytest.param(lambda: DietAbs(rank=0), SchemeConfigError,
                 r"scheme 'diet_abs': rank must be a positive integer or None, got 0",
                 id="diet-abs-module-rank"),
    pytest.param(lambda: validate_scheme_config({"name": "diet_rel", "sharing": "layers"}),
                 SchemeConfigError, r"scheme 'diet_rel': sharing must be one of 'none', 'layer', "
                 r"'head', got 'layers'; did you mean 'layer'\?$", id="sharing-typo"),
    pytest.param(lambda: validate_scheme_config({"name": "rope", "base": 1.0}),
                 SchemeConfigError, r"scheme 'rope': base must be a finite number > 1, got 1.0",
                 id="rope-base"),
    pytest.param(lambda: validate_scheme_config({"name": "sinusoidal_ape", "learnable": "yes"}),
                 SchemeConfigError, r"scheme 'sinusoidal_ape': learnable must be true or false, "
                 r"got 'yes'", id="learnable-flag"),
    pytest.param(lambda: validate_scheme_config({"name": "diet_abs_lin", "k": 0}),
                 SchemeConfigError, r"scheme 'diet_abs_lin': k must be a positive integer, got 0",
                 id="diet-abs-lin-k"),
    pytest.param(lambda: validate_scheme_config({"name": "diet_abz"}), SchemeConfigError,
                 r"scheme name 'diet_abz' is unknown; did you mean 'diet_abs'\?; allowed: alibi",
                 id="scheme-name"),
    pytest.param(lambda: validate_scheme_config({"name": "diet_abs", "rnak": 4}),
                 SchemeConfigError, r"scheme 'diet_abs': unknown field 'rnak'; did you mean "
                 r"'rank'\?; allowed fields: content_scale, rank, sharing", id="scheme-field"),
    pytest.param(lambda: scheme({"name": "alibi"}, num_layers=0), SchemeConfigError,
                 r"scheme 'alibi': num_layers must be a positive integer, got 0",
                 id="scheme-dims"),
    pytest.param(lambda: scheme([]), SchemeConfigError,
                 r"scheme config: got an empty list; allowed: a scheme config or a non-empty list",
                 id="scheme-empty-list"),
    pytest.param(lambda: init(scheme({"name": "learned_ape"}), 0), SchemeConfigError,
                 r"scheme 'learned_ape': length must be a positive integer, got 0",
                 id="scheme-length"),
    pytest.param(lambda: init(scheme({"name": "segment_per_head"}), 4, ids(B, 3)),
                 SchemeConfigError, r"scheme 'segment_per_head': segment_ids has shape \(2, 3\); "
                 r"expected \[B, L\] with L = 4", id="scheme-segment-ids"),
    # model_config: fields.
    pytest.param(lambda: model_config("bert_base"), ModelConfigError,
                 r"model: got 'bert_base'; allowed: a ModelConfig, dict or ConfigDict",
                 id="model-not-mapping"),
    pytest.param(lambda: model_config(TINY, d_modle=8), ModelConfigError,
                 r"model.d_modle: unknown field; did you mean 'd_model'\?; allowed fields: "
                 r"activation", id="model-unknown-field"),
    pytest.param(lambda: model_config(TINY, activation="gelu_tan"), ModelConfigError,
                 r"model.activation: got 'gelu_tan'; did you mean 'gelu_tanh'\?; allowed: gelu, "
                 r"gelu_tanh, relu", id="model-activation"),
    pytest.param(lambda: model_config(TINY, dtype="float16"), ModelConfigError,
                 r"model.dtype: got 'float16'; did you mean 'bfloat16'\?; allowed: float32, "
                 r"bfloat16", id="model-dtype"),
    pytest.param(lambda: model_config(TINY, route="fuse"), ModelConfigError,
                 r"model.route: got 'fuse'; did you mean 'fused'\?; allowed: auto",
                 id="model-route"),
    pytest.param(lambda: model_config(TINY, layer_norm_eps=math.inf), ModelConfigError,
                 r"model.layer_norm_eps: got inf; allowed: a finite positive float",
                 id="model-eps"),
    pytest.param(lambda: model_config(TINY, attention_dropout_rate=math.nan), ModelConfigError,
                 r"model.attention_dropout_rate: got nan; allowed: a number in \[0, 1\)",
                 id="model-dropout-nan"),
    pytest.param(lambda: model_config(TINY, dropout_rate=True), ModelConfigError,
                 r"model.dropout_rate: got True; allowed: a number in \[0, 1\)",
                 id="model-dropout-bool"),
    pytest.param(lambda: model_config(TINY, num_heads=3), ModelConfigError,
                 r"model.num_heads: got 3; allowed: a divisor of d_model=16 \(or set head_dim\)",
                 id="model-heads"),
    pytest.param(lambda: model_config(TINY, head_dim=0), ModelConfigError,
                 r"model.head_dim: got 0; allowed: a positive integer or None",
                 id="model-head-dim"),
    pytest.param(lambda: model_config(TINY, num_decoder_layers=-1), ModelConfigError,
                 r"model.num_decoder_layers: got -1; allowed: an integer >= 0",
                 id="model-decoder-layers"),
    pytest.param(lambda: model_config(TINY, pooler="yes"), ModelConfigError,
                 r"model.pooler: got 'yes'; allowed: true or false", id="model-flag"),
    # model_config: combinations of fields.
    pytest.param(lambda: model_config(TINY, scheme={"name": "rope"}, head_dim=7), ModelConfigError,
                 r"model.scheme: scheme 'rope': head_dim must be even, got 7",
                 id="model-rope-head-dim"),
    pytest.param(lambda: model_config(SEQ2SEQ, scheme={"name": "t5", "max_distance": 12}),
                 ModelConfigError, r"model.scheme: decoder \(causal form\): scheme 't5': "
                 r"max_distance must exceed the 16 offsets .*, got 12", id="model-t5-decoder"),
    pytest.param(lambda: model_config(TINY, segment={"name": "t5"}), ModelConfigError,
                 r"model.segment: got 't5'; allowed: segment_input, segment_per_head or None",
                 id="model-segment"),
    pytest.param(lambda: model_config(TINY, scheme={"name": "segment_input"}), ModelConfigError,
                 r"model.scheme: got 'segment_input', a segment scheme", id="model-scheme-segment"),
    pytest.param(lambda: model_config(TINY, attention="linformer", linformer_k=32),
                 ModelConfigError, r"model.linformer_k: got 32; allowed: at most max_len=16",
                 id="model-linformer-k"),
    pytest.param(lambda: model_config(TINY, scheme=()), ModelConfigError,
                 r"model.scheme: scheme config: got an empty list", id="model-scheme-empty"),
    # Model builders and model inputs.
    pytest.param(lambda: build_model(TINY, "classifcation"), ModelConfigError,
                 r"head: got 'classifcation'; did you mean 'classification'\?; allowed: mlm",
                 id="build-head"),
    pytest.param(lambda: build_model(TINY, "classification", num_labels=0), ModelConfigError,
                 r"num_labels: got 0; allowed: a positive integer \(1: regression\)",
                 id="build-num-labels"),
    pytest.param(lambda: build_model(SEQ2SEQ, "mlm"), ModelConfigError,
                 r"model.num_decoder_layers: got 1; allowed: 0 for head 'mlm'",
                 id="build-bert-decoder"),
    pytest.param(lambda: init_inputs(build_model(TINY), batch=0), ValueError,
                 r"init_inputs: batch: got 0; allowed: a positive integer", id="init-inputs"),
    pytest.param(lambda: init(BertForMaskedLM(model_config(TINY)), ones(B, LQ)), ValueError,
                 r"BertEncoder: input_ids: got shape \(2, 5\) of float32; expected \[B, L\] "
                 r"integer ids", id="bert-input-ids"),
    pytest.param(lambda: init(BertForMaskedLM(model_config(TINY)), ids(B, LQ), ids(B, LK)),
                 ValueError, r"BertEncoder: segment_ids: got shape \(2, 6\); expected \[B, L\] = "
                 r"\(2, 5\)", id="bert-segment-ids"),
    pytest.param(lambda: init(BertForMaskedLM(model_config(TINY)), ids(B, LQ),
                              masked_positions=ids(3, 2)), ValueError,
                 r"BertForMaskedLM: masked_positions: got shape \(3, 2\); expected B = 2",
                 id="bert-masked-positions"),
    pytest.param(lambda: init(EncoderDecoder(model_config(SEQ2SEQ)), ids(B, LQ), ids(3, LQ)),
                 ValueError, r"Decoder: tgt_ids: got shape \(3, 5\); expected B = 2",
                 id="seq2seq-tgt-ids"),
    pytest.param(lambda: init(EncoderDecoder(model_config(SEQ2SEQ)), ids(B, LQ), ids(B, LQ),
                              ones(B, LK, dtype=bool)), ValueError,
                 r"Encoder: src_mask: got shape \(2, 6\); expected \[B, L\] = \(2, 5\)",
                 id="seq2seq-src-mask"),
    pytest.param(lambda: init(LinformerSelfAttention(model_config(TINY, attention="linformer",
                                                                  linformer_k=4)),
                              ones(B, LQ, 16), mask=ones(B, LK, dtype=bool)), ValueError,
                 r"Linformer: mask: got shape \(2, 6\); expected \[B, L\] = \(2, 5\)",
                 id="linformer-mask"),
]


@pytest.mark.parametrize("call,error,message", CASES)
def test_bad_argument_is_one_line_naming_it(call, error, message):
  with pytest.raises(error, match=message) as info:
    call()
  assert "\n" not in str(info.value)


def test_valid_neighbours_of_the_bad_arguments_run():
  """Terms of every form at the right shapes (heads, batch and mask axes of 1 broadcast), a
  finite scale, a key mask, xla and segment ids for self-attention: attention runs."""
  terms = [toeplitz(1), Bias(ones(1, H, 1, LK)), Factored(ones(LQ, 1, 2), ones(B, LK, H, 2)),
           QueryRelative(ones(H, 5, D), clip=2), Rotation(ones(LQ, D // 2), ones(LK, D // 2)),
           QKShift(ones(LQ, H, D), ones(LK, H, D))]
  out = attend_with(*terms, mask=ones(1, 1, LQ, 1, dtype=bool), scale=0.5, route="reference",
                    implementation="xla", causal=True)
  assert out.shape == Q.shape and bool(jnp.all(jnp.isfinite(out)))
  out = attend(Q, Q, Q, [toeplitz()], mask=ones(B, LQ, dtype=bool), segment_ids=ids(B, LQ),
               dropout_rate=0.5, dropout_rng=KEY)
  assert out.shape == Q.shape
  assert jax.tree.leaves(mha_init(ones(B, LQ, 16), context=ones(B, LK, 3)))


def test_valid_neighbours_of_bad_scheme_settings_build():
  for config in ({"name": "t5", "num_buckets": 4, "max_distance": 2},
                 {"name": "t5", "num_buckets": 2, "max_distance": 2, "bidirectional": False},
                 {"name": "tupe_r", "num_buckets": 4, "max_distance": 2},
                 {"name": "tupe_a", "untie_cls": False}, {"name": "rope", "base": 1.5},
                 {"name": "diet_abs", "content_scale": 0.5, "rank": 1, "sharing": "layer"}):
    module = scheme(config)
    terms, _ = jax.eval_shape(lambda m=module: m.init_with_output(KEY, LQ, ids(B, LQ)))
    assert jax.tree.leaves(terms.terms), config
  shared = SchemeTerms(terms=(Toeplitz(ones(1, H, 1), LinearDistance()),))
  assert len(shared.for_layer(11)) == 1  # a term shared by all layers fits any layer
  assert len(two_layer_terms().for_layer(1)) == 1


def test_valid_neighbours_of_bad_model_configs_build():
  model_config(TINY, scheme={"name": "rope"}, head_dim=8)
  model_config(SEQ2SEQ, scheme={"name": "t5", "max_distance": 17})
  model_config(TINY, scheme=({"name": "learned_ape"}, {"name": "alibi"}),
               segment={"name": "segment_per_head"})
  model_config(TINY, attention="linformer", linformer_k=16, dropout_rate=0.0)
  classifier = build_model(TINY, "classification", num_labels=1)
  assert init(classifier, ids(B, LQ), ids(B, LQ), ones(B, LQ, dtype=bool))
  assert init(BertForMaskedLM(model_config(TINY)), ids(B, LQ), masked_positions=ids(B, 2))
