"""Evaluation of trained workdirs (``python -m posenc_jax.evaluate``), as a library.

  from posenc_jax import evaluation
  doc = evaluation.evaluate_workdir("/tmp/run", "extrapolation", lengths=[64, 128, 256],
                                    out="/tmp/run/eval")
  doc["rows"][-1]["value"]          # perplexity (causal LM) or masked-LM loss at 256
  doc["unigram"]                    # a unigram model's perplexity on the same tokens
  # written: /tmp/run/eval/extrapolation-split=validation,windows=non_overlapping,tokens=16384.json

Protocols (:data:`PROTOCOLS`): ``loss``, ``extrapolation``, ``probes`` and ``indicators``
(:mod:`posenc_jax.evaluation.protocols`); the restored run and what the protocols share:
:mod:`posenc_jax.evaluation.runs`; windows: :mod:`posenc_jax.evaluation.windows`; files and
tables: :mod:`posenc_jax.evaluation.report`.
"""

from posenc_jax.evaluation.protocols import PROTOCOLS, evaluate_workdir, protocol_options
from posenc_jax.evaluation.runs import EvaluationError, Run, load_run, model_at
from posenc_jax.evaluation.windows import WINDOWS, Windows, window_arrays, windows

__all__ = ["PROTOCOLS", "WINDOWS", "EvaluationError", "Run", "Windows", "evaluate_workdir",
           "load_run", "model_at", "protocol_options", "window_arrays", "windows"]
