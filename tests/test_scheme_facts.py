"""The facts a scheme class answers without a module: its causal form, segment and Linformer
fit, folded rank and FLOPs. The expected values are what the name-keyed tables of
``models/config.py`` and ``training/metrics.py`` said before the classes held them."""

import re

import pytest

from posenc_jax.models import BertEncoder
from posenc_jax.models.build import check_head
from posenc_jax.models.config import ModelConfigError, causal_variant, model_config, scheme_dims
from posenc_jax.schemes import SCHEMES, Scheme, build_scheme
from posenc_jax.schemes.registry import scheme_parts
from posenc_jax.training.config import (absolute_table_schemes, base_train_config,
                                        validate_train_config)
from posenc_jax.training.loop import batch_limits
from posenc_jax.training.metrics import train_flops_per_step

# name: (causal fields, segment scheme, fits Linformer), as CAUSAL_FIELDS, SEGMENT_SCHEMES
# and LINFORMER_SCHEMES said.
REGISTERED = {
    "none": ({}, False, True),
    "learned_ape": ({}, False, True),
    "sinusoidal_ape": ({}, False, True),
    "shaw": ({}, False, False),
    "sinusoidal_rpe": ({}, False, False),
    "t5": ({"bidirectional": False}, False, False),
    "diet_rel": ({}, False, False),
    "diet_abs": ({}, False, False),
    "diet_abs_lin": ({}, False, True),
    "tupe_a": ({}, False, False),
    "tupe_r": ({}, False, False),
    "bert_ad": ({}, False, False),
    "segment_input": ({}, True, True),
    "segment_per_head": ({}, True, False),
    "alibi": ({"causal": True}, False, False),
    "rope": ({}, False, False),
    "fire": ({"causal": True}, False, False),
    "kerple_log": ({}, False, False),
    "kerple_power": ({}, False, False),
    "xpos": ({}, False, False),
    "cope": ({}, False, False),
    "fox": ({}, False, False),
}

MODEL = dict(vocab_size=100, d_model=32, num_layers=2, num_heads=4, mlp_dim=64, max_len=64,
             segment=None)
BATCH, LENGTH, TARGET, DECODER_LAYERS = 2, 10, 7, 3

# (config, folded rank, Shaw's offset rows, segment-table FLOPs at LENGTH, train FLOPs per step
# of the MLM model, of the encoder-decoder with DECODER_LAYERS, of the causal LM), as the old
# _folded_rank, _relative_rows, _segment_tables and train_flops_per_step gave them for MODEL.
FLOPS = [
    ({"name": "none"}, 0, 0, 0, 2626560, 5923968, 2426880),
    ({"name": "learned_ape"}, 0, 0, 0, 2626560, 5923968, 2426880),
    ({"name": "sinusoidal_ape"}, 0, 0, 0, 2626560, 5923968, 2426880),
    ({"name": "shaw"}, 0, 33, 0, 2880000, 6443520, 2680320),
    ({"name": "shaw", "clip": 3, "value": True}, 0, 14, 0, 2734080, 6144384, 2534400),
    ({"name": "sinusoidal_rpe"}, 0, 258, 0, 4608000, 9985920, 4408320),
    ({"name": "sinusoidal_rpe", "clip": 4, "value": False}, 0, 9, 0, 2695680, 6065664, 2496000),
    ({"name": "t5"}, 0, 0, 0, 2626560, 5923968, 2426880),
    ({"name": "t5", "num_buckets": 8, "max_distance": 6}, 0, 0, 0, 2626560, 5923968, 2426880),
    ({"name": "diet_rel"}, 0, 0, 0, 2626560, 5923968, 2426880),
    ({"name": "diet_abs"}, 8, 0, 0, 2703360, 6028992, 2465280),
    ({"name": "diet_abs", "rank": 5}, 5, 0, 0, 2674560, 5989608, 2450880),
    ({"name": "diet_abs_lin", "k": 16}, 8, 0, 0, 3382272, None, None),
    ({"name": "diet_abs_lin", "rank": 3, "k": 16}, 3, 0, 0, 3305472, None, None),
    ({"name": "tupe_a"}, 10, 0, 0, 2722560, 6055248, 2474880),
    ({"name": "tupe_a", "untie_cls": False}, 8, 0, 0, 2703360, 6028992, 2465280),
    ({"name": "tupe_r"}, 10, 0, 0, 2722560, 6055248, 2474880),
    ({"name": "tupe_r", "untie_cls": False}, 8, 0, 0, 2703360, 6028992, 2465280),
    ({"name": "bert_ad"}, 0, 0, 0, 2626560, 5923968, 2426880),
    ({"name": "segment_input"}, 0, 0, 1280, 2634240, None, None),
    ({"name": "segment_input", "num_segments": 3}, 0, 0, 1920, 2638080, None, None),
    ({"name": "segment_per_head"}, 2, 0, 640, 2649600, None, None),
    ({"name": "segment_per_head", "num_segments": 3, "sharing": "layer"}, 3, 0, 720, 2659680,
     None, None),
    ({"name": "segment_per_head", "num_segments": 4, "sharing": "head"}, 4, 0, 640, 2668800,
     None, None),
    ({"name": "alibi"}, 0, 0, 0, 2626560, 5923968, 2426880),
    ({"name": "rope"}, 0, 0, 0, 2626560, 5923968, 2426880),
]
# The old absolute_table_schemes: the schemes that own a table of max_len positions.
ABSOLUTE = {"learned_ape", "diet_abs", "diet_abs_lin", "tupe_a", "tupe_r", "bert_ad"}


def model_fields(config):
  """MODEL with ``config`` as its scheme (or its segment), Linformer for DIET-ABS-LIN."""
  fields = dict(MODEL)
  if REGISTERED[config["name"]][1]:
    fields |= {"scheme": {"name": "none"}, "segment": config}
  else:
    fields["scheme"] = config
  if config["name"] == "diet_abs_lin":
    fields |= {"attention": "linformer", "linformer_k": config["k"]}
  return fields


def test_every_registered_scheme_has_its_facts():
  assert set(SCHEMES) == set(REGISTERED)
  for name, (causal, segment, linformer) in REGISTERED.items():
    module = SCHEMES[name].module
    assert (dict(module.causal_fields), module.segment_scheme, module.fits_linformer) == (
        causal, segment, linformer), name
    assert causal_variant({"name": name}) == {"name": name} | causal


def test_only_diet_abs_lin_has_projected_keys():
  for name, spec in SCHEMES.items():
    (part,) = scheme_parts({"name": name})
    expected = part.values["k"] if name == "diet_abs_lin" else None
    assert spec.module.projected_keys(part.values) == expected


@pytest.mark.parametrize("config,rank,rows,tables,mlm,translation,lm", FLOPS,
                         ids=[str(i) for i in range(len(FLOPS))])
def test_flops_facts_equal_the_old_tables(config, rank, rows, tables, mlm, translation, lm):
  cfg = model_config(model_fields(config))
  dims = scheme_dims(cfg)
  (part,) = scheme_parts(config)
  assert part.module.folded_rank(part.values, cfg.dim_per_head) == rank
  heads, head_dim = cfg.num_heads, cfg.dim_per_head
  assert part.module.layer_flops(part.values, dims, LENGTH) == 2 * heads * LENGTH * rows * head_dim
  assert part.module.input_flops(part.values, dims, LENGTH) == tables
  assert train_flops_per_step(cfg, BATCH, LENGTH) == mlm
  if translation is not None:
    assert train_flops_per_step(cfg.replace(num_decoder_layers=DECODER_LAYERS), BATCH, LENGTH,
                                target_length=TARGET) == translation
    assert train_flops_per_step(cfg, BATCH, LENGTH, head="lm") == lm


@pytest.mark.parametrize("config", [c for c, *_ in FLOPS], ids=[str(i) for i in range(len(FLOPS))])
def test_absolute_tables_and_segment_limits(config):
  cfg = model_config(model_fields(config))
  segment = REGISTERED[config["name"]][1]
  expected = [config["name"]] if config["name"] in ABSOLUTE else []
  assert absolute_table_schemes(cfg) == ([] if segment else expected)
  limits = batch_limits(cfg)
  if segment:
    n = config.get("num_segments", 2)
    assert limits["segment_ids"] == (n, f"model.segment num_segments={n}")
  else:
    assert "segment_ids" not in limits


@pytest.fixture
def no_scheme_modules(monkeypatch):
  """Creating any scheme module raises."""
  def refuse(self):
    raise AssertionError(f"a {type(self).__name__} module was built")
  monkeypatch.setattr(Scheme, "__post_init__", refuse)
  with pytest.raises(AssertionError, match="module was built"):
    build_scheme({"name": "rope"}, **scheme_dims(model_config(MODEL)))


@pytest.mark.parametrize("config", [c for c, *_ in FLOPS], ids=[str(i) for i in range(len(FLOPS))])
def test_validation_and_counts_build_no_scheme_module(no_scheme_modules, config):
  fields = model_fields(config)
  cfg = model_config(fields)
  batch_limits(cfg)
  train_flops_per_step(cfg, BATCH, LENGTH)
  train = base_train_config()
  train.update(model=fields, seq_len=LENGTH)
  train.optimizer.warmup_steps = 10
  assert validate_train_config(train) == cfg
  if not REGISTERED[config["name"]][1] and config["name"] != "diet_abs_lin":
    decoder = model_config(fields, num_decoder_layers=DECODER_LAYERS)
    check_head(decoder, "translation")
    check_head(cfg, "lm")
    train_flops_per_step(decoder, BATCH, LENGTH, target_length=TARGET)


@pytest.mark.parametrize("fields,message", [
    (dict(scheme={"name": "rope", "fraction": 0.25}, head_dim=4),
     "model.scheme: scheme 'rope': fraction must make the rotated dims"),
    (dict(scheme={"name": "sinusoidal_rpe"}, head_dim=5),
     "model.scheme: scheme 'sinusoidal_rpe': head_dim must be even, got 5"),
    (dict(scheme={"name": "t5", "num_buckets": 3}),
     "model.scheme: scheme 't5': num_buckets must be an even integer >= 4"),
    (dict(scheme={"name": "t5", "num_buckets": 4, "max_distance": 2}, num_decoder_layers=1),
     "model.scheme: decoder (causal form): scheme 't5': max_distance must exceed"),
], ids=["rope-rotated", "even-head-dim", "t5-bidirectional", "t5-causal-form"])
def test_dimension_checks_need_no_module(no_scheme_modules, fields, message):
  with pytest.raises(ModelConfigError, match="^" + re.escape(message)):
    model_config(MODEL | fields)


@pytest.mark.parametrize("scheme", [{"name": "cope"}, [{"name": "rope"}, {"name": "cope"}]],
                         ids=["cope", "composed"])
def test_causal_only_schemes_are_refused_in_bidirectional_stacks(no_scheme_modules, scheme):
  """CoPE, a causal-only scheme, runs in the language model and the encoder-decoder's
  decoder; the BERT encoder (as a head or created) and the encoder-decoder's encoder refuse it
  in one line naming ``model.scheme``, before any scheme module is built."""
  assert SCHEMES["cope"].module.causal_only and not SCHEMES["rope"].module.causal_only
  cfg = model_config(MODEL, scheme=scheme)
  check_head(cfg, "lm")
  refusals = {"BERT encoder": (lambda: check_head(cfg, "mlm"), lambda: BertEncoder(cfg)),
              "encoder-decoder's encoder": (lambda: cfg.replace(num_decoder_layers=1),)}
  for owner, makers in refusals.items():
    for make in makers:
      with pytest.raises(ModelConfigError) as e:
        make()
      assert str(e.value).startswith(f"model.scheme: got 'cope' in the {owner}, a "
                                     "bidirectional stack") and "\n" not in str(e.value)
