"""Analysis of any BERT model: identical-word probing, property indicators, rank, pictures.

Works on a fresh model, a train.py checkpoint or an imported Hugging Face
BERT (:mod:`~posenc_jax.analysis.loading`); on a causal language model, the
positional term, its rank and position vectors (``LoadedModel.causal``). ``shared/spec/ANALYSIS.md``
gives the formulas::

  from posenc_jax import analysis
  model = analysis.from_config("bert_tiny,alibi")
  probe = analysis.identical_word_probing(model.encoder, model.variables, model.tokens)
  analysis.indicators(probe.attention, probe.special_positions)   # Wang et al. Table 2
  analysis.rank_report(model.encoder, model.variables, model.tokens)  # DIET Fig. 2/8
  analysis.plots.plot_probing(probe, "probing.png")                 # matplotlib, lazily

The command line: ``python -m posenc_jax.analysis {probe,indicators,rank,plots,params}``
(see :mod:`posenc_jax.analysis.__main__`). ``import posenc_jax.analysis``
does not import matplotlib; ``analysis.plots`` does, on first use.
"""

from __future__ import annotations

import importlib

from posenc_jax.analysis.indicators import (PAPER_TABLE2, TABLE2_COLUMNS, aiv, db,
                                            drop_positions, format_table2, indicators, opr,
                                            opr_sequence, paper_row,
                                            paper_setup_differences, sd)
from posenc_jax.analysis.loading import (LoadedModel, checkpoint_steps, from_checkpoint,
                                         from_config, from_hf, load, read_config, restore_params)
from posenc_jax.analysis.probing import (AnalysisError, LayerAttention, PositionalAttention,
                                         PositionVectors, ProbeTokens, ProbingResult,
                                         bundled_tokens, identical_word_ids,
                                         identical_word_probing, layer_attention, layer_runner,
                                         position_vectors, positional_attention,
                                         special_positions, term_logits, wordpiece_tokens)
from posenc_jax.analysis.rank import (DEFAULT_RTOL, logit_ranks, numerical_rank,
                                      positional_ranks, random_batch, rank_report)

__all__ = [
    "DEFAULT_RTOL", "PAPER_TABLE2", "TABLE2_COLUMNS", "AnalysisError", "LayerAttention",
    "LoadedModel", "PositionVectors", "PositionalAttention", "ProbeTokens", "ProbingResult",
    "aiv", "bundled_tokens", "checkpoint_steps", "db", "drop_positions", "format_table2",
    "from_checkpoint", "from_config", "from_hf", "identical_word_ids", "identical_word_probing",
    "indicators", "layer_attention", "layer_runner", "load", "logit_ranks", "numerical_rank",
    "opr", "opr_sequence", "paper_row", "paper_setup_differences", "plots", "position_vectors",
    "positional_attention", "positional_ranks", "random_batch", "rank_report", "read_config", "restore_params", "sd",
    "special_positions", "term_logits", "wordpiece_tokens",
]


def __getattr__(name):
  if name == "plots":  # matplotlib only when pictures are asked for
    return importlib.import_module("posenc_jax.analysis.plots")
  raise AttributeError(f"module 'posenc_jax.analysis' has no attribute {name!r}")
