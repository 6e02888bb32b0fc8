"""The evaluation protocols, run on a trained workdir's model restored read-only
(:mod:`posenc_jax.evaluation.runs`).

``evaluate_workdir(workdir, protocol, ...)`` restores the newest good checkpoint (or
``best/``, or a step), builds the model from the workdir's ``config.json``, runs one protocol
of :data:`PROTOCOLS` and returns its JSON document (and, given ``out``, writes it there with
a plot: :mod:`posenc_jax.evaluation.report`). Nothing is ever written under
``<workdir>/checkpoints`` or ``<workdir>/best``.

Protocols (each a function ``(run, *, progress, **options) -> document``; a new one is one
entry of :data:`PROTOCOLS`):

* ``loss``: the objective's metrics on a split, as the trainer's periodic evaluation
  computes them (``eval_loss``, ``eval_accuracy``; for a pre-training run ``eval_perplexity``
  and ``eval_unigram_perplexity``, the unigram reference of the same tokens), and
  for fine-tuned runs the task's own metrics (:func:`~posenc_jax.training.loop.task_evaluation`).
* ``extrapolation``: causal-LM perplexity or masked-LM loss at several evaluation lengths, on
  the same first ``tokens`` tokens of the split's stream at every length
  (:mod:`posenc_jax.evaluation.windows`). The causal-LM stream is the task's lines joined with
  EOS, exactly as :func:`posenc_jax.data.causal_lm.packed_epoch` packs them; the masked-LM
  stream is the lines joined with [SEP] as :func:`posenc_jax.data.preprocessors.pack_lines`
  packs them, corrupted once as a whole by :func:`~posenc_jax.data.preprocessors.bert_mask`
  with a fixed seed, and each window is [CLS] and ``L - 1`` stream tokens. A length the model
  cannot reach is a row with ``value`` None and the reason in ``na``.
  A causal LM's document also holds ``unigram``: the perplexity, on the same tokens, of the
  add-one smoothed unigram model of the task's ``train`` split (a reference no scheme should
  need a position for), and ``corpus_sha256`` for the bundled corpus
  (:mod:`posenc_jax.data.stdlib_corpus`).
* ``indicators``: Wang et al.'s property indicators (their Table 2) of an encoder run, from
  identical-word probing of its first layer at its training length, beside the paper's row
  for its scheme (:func:`indicators_protocol`).
* ``probes``: a synthetic-probe run's (:mod:`posenc_jax.data.probes`) accuracy on its probe at
  several lengths, the same held-out examples for every run, and at each length the
  accuracy of chance (:meth:`~posenc_jax.data.probes.Probe.chance`).

Every document holds ``settings``: the options that change its numbers (:data:`SETTINGS`,
defaults filled in by :func:`protocol_settings`); lengths are not among them. Its file is
``<out>/<protocol>-<settings>.json`` (:func:`posenc_jax.evaluation.report.settings_key`), so
that evaluations with other settings sit beside it instead of replacing it.
"""


from __future__ import annotations

import inspect
import itertools
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import ml_collections
from etils import epath

from posenc_jax import presets, route_table
from posenc_jax.data import probes, randomized_positions, unigram
from posenc_jax.evaluation.runs import (DEFAULT_TOKENS, MASK_SEED, EvaluationError, Run,
                                        check_lengths, check_memory, check_windows, load_run,
                                        model_at, quiet, rows_per_step, score, token_stream,
                                        window_batches)
from posenc_jax.messages import first_line
from posenc_jax.models.config import model_config
from posenc_jax.training.objectives import PRETRAINING


def loss_protocol(run: Run, *, split: str = "validation", eval_steps: int | None = None,
                  progress: Callable[[str], None] = quiet) -> dict[str, Any]:
  """The objective's metrics on ``split`` over ``eval_steps`` batches (default the run's),
  as the trainer's evaluation computes them, and for fine-tuned runs the task's metrics."""
  from posenc_jax.training.input_pipeline import check_data_config, make_batches  # noqa: PLC0415
  from posenc_jax.training.loop import (evaluate, make_eval_step,  # noqa: PLC0415
                                        task_evaluation, unigram_reference)

  config = ml_collections.ConfigDict(run.config.to_dict())
  settings = protocol_settings("loss", config, split=split, eval_steps=eval_steps)
  config.eval_steps = settings["eval_steps"]
  config.eval_split = split
  check_data_config(config)
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  batches = make_batches(config, split, 0)
  if config.objective in PRETRAINING or config.objective == "translation":
    batches = itertools.islice(batches, config.eval_steps)  # the train split is endless
  total = config.eval_steps if config.objective in PRETRAINING else None

  def counted(items: Iterator) -> Iterator:
    every = max(1, total // 4) if total else 50
    for i, batch in enumerate(items, 1):
      if i % every == 0:
        progress(f"loss: batch {i}{f'/{total}' if total else ''} of split {split!r}")
      yield batch

  metrics = evaluate(jax.jit(make_eval_step(run.model, config)), run.params,
                     counted(batches), device, perplexity=config.objective in PRETRAINING,
                     reference=unigram_reference(config))
  if not metrics:
    raise EvaluationError(f"split: {split!r} of task {config.task!r} gave no batch")
  progress("loss: task metrics" if config.objective not in PRETRAINING else "loss: done")
  metrics |= task_evaluation(config, run.model, run.params, make_batches)
  return {"protocol": "loss", "workdir": run.workdir, "step": run.step,
          "checkpoint": run.checkpoint, "objective": config.objective, "settings": settings,
          "split": split, "metrics": {k: float(v) for k, v in metrics.items()}}


def extrapolation_protocol(run: Run, *, split: str = "validation",
                           lengths: Sequence[int] | None = None,
                           windows: str = "non_overlapping",
                           stride: int | None = None, tokens: int = DEFAULT_TOKENS,
                           batch_size: int | None = None, mask_seed: int | None = None,
                           progress: Callable[[str], None] = quiet) -> dict[str, Any]:
  """Perplexity (causal LM) or masked-LM loss at each of ``lengths`` (default 1, 2, 4 and 8
  times the training length) over the first ``tokens`` tokens of ``split``, cut into
  ``windows`` (``non_overlapping``, or ``sliding`` with ``stride``, causal LM only);
  ``batch_size`` windows per step (default: the training batch's tokens per step);
  ``mask_seed`` (masked LM only) the stream's masking seed (default :data:`MASK_SEED`).
  A length the model cannot reach, or longer than the tokens read (no whole window of it),
  is a row with ``value`` None and the reason in ``na``.
  A causal LM's document has ``unigram``: the perplexity of those tokens under the add-one
  smoothed unigram of the ``train`` split (:func:`~posenc_jax.data.unigram.train_counts`), and the train tokens it
  counted (``unigram_train_tokens``); a masked LM's None."""
  config = run.config
  settings = protocol_settings("extrapolation", config, split=split, windows=windows,
                               stride=stride, tokens=tokens, mask_seed=mask_seed)
  name = config.objective
  if windows == "sliding" and name != "lm":
    raise EvaluationError("windows: 'sliding' scores a token with the context before it, "
                          f"for a causal LM (objective lm); this run's objective is {name!r}")
  if mask_seed is not None and name != "mlm":
    raise EvaluationError("mask_seed: only for a masked-LM run (objective mlm); this run's "
                          f"objective is {name!r}")
  train_length = config.seq_len
  lengths = check_lengths(lengths or [train_length * k for k in (1, 2, 4, 8)])
  check_windows(windows, stride, lengths)
  if int(tokens) != tokens or tokens < 1:
    raise EvaluationError(f"tokens: got {tokens!r}; allowed: a positive integer")
  if batch_size is not None and (int(batch_size) != batch_size or batch_size < 1):
    raise EvaluationError(f"batch_size: got {batch_size!r}; allowed: a positive integer")
  check_memory(run, lengths, batch_size)
  progress(f"extrapolation: reading the first {tokens} tokens of split {split!r} of "
           f"{config.task!r}")
  stream = token_stream(config, split, tokens, settings.get("mask_seed", MASK_SEED))
  tokens = len(next(iter(stream.values())))
  unigram_ppl = counted = None
  if name == "lm":
    progress(f"extrapolation: counting the tokens of split 'train' of {config.task!r} (the "
             "unigram reference)")
    counts = unigram.train_counts(name, config.task, model_config(config.model).vocab_size)
    unigram_ppl, counted = unigram.unigram_perplexity(counts, stream["targets"]), int(counts.sum())
  rows = []
  for index, length in enumerate(lengths, 1):
    start = time.perf_counter()
    model, reason = model_at(run, length)
    need = length - 1 if name == "mlm" else length  # a masked-LM window is [CLS] + L - 1
    if model is not None and tokens < need:  # no whole window: it would score fewer tokens
      model, reason = None, (f"the first {tokens} tokens of split {split!r} hold no whole "
                             f"window of {length}; --tokens of at least {need} scores it")
    row = {"length": length, "value": None, "loss": None, "accuracy": None,
           "scored_tokens": 0, "na": reason}
    if model is not None:
      batch, scored = window_batches(stream, name, length, windows, stride)
      sums = score(model, run.params, name, batch, rows_per_step(run, length, batch_size),
                   lambda text, length=length: progress(f"extrapolation: length {length} "
                                                        f"({index}/{len(lengths)}): {text}"))
      weight = max(sums["weight"], 1.0)
      loss = sums["loss"] / weight
      row |= {"value": math.exp(min(loss, 700.0)) if name == "lm" else loss, "loss": loss,
              "accuracy": sums["correct"] / weight, "scored_tokens": scored}
    rows.append(row)
    value = "n/a" if row["value"] is None else f"{row['value']:.4g}"
    progress(f"extrapolation: length {length} ({index}/{len(lengths)}): {value} "
             f"({time.perf_counter() - start:.1f} s)")
  from posenc_jax.data import stdlib_corpus  # noqa: PLC0415
  return {"protocol": "extrapolation", "workdir": run.workdir, "step": run.step,
          "checkpoint": run.checkpoint, "objective": name, "settings": settings,
          "metric": "perplexity" if name == "lm" else "mlm_loss", "task": config.task,
          "corpus_sha256": stdlib_corpus.content_sha256()
          if config.task == stdlib_corpus.TASK else None, "split": split,
          "train_length": train_length, "windows": windows, "stride": stride,
          "tokens": tokens, "mask_seed": settings.get("mask_seed"), "unigram": unigram_ppl,
          "unigram_train_tokens": counted, "rows": rows}


def probes_protocol(run: Run, *, lengths: Sequence[int] | None = None, examples: int = 256,
                    seed: int = probes.HELD_OUT_SEED, batch_size: int | None = None,
                    progress: Callable[[str], None] = quiet) -> dict[str, Any]:
  """Accuracy of a synthetic-probe run on its own probe at each of ``lengths`` (default 1,
  2, 4 and 8 times the training length). The run's task is ``probe:<name>``
  (:mod:`posenc_jax.data.probes`); the examples are ``0 .. examples - 1`` of ``seed``
  (default the held-out seed the trainer evaluates on), the same examples for every run;
  ``batch_size`` examples per step (default: the training batch's tokens per step). A length
  the scheme cannot reach, or too short for the probe, is ``n/a`` with the reason. Each row
  has ``chance``: the accuracy of guessing (:meth:`~posenc_jax.data.probes.Probe.chance`)."""
  config = run.config
  spec = probes.config_probe(config)
  train_length = config.seq_len
  randomized = randomized_positions.evaluated_range(config)  # as the trainer evaluates
  lengths = check_lengths(lengths or [train_length * k for k in (1, 2, 4, 8)])
  check_memory(run, lengths, batch_size, most_rows=examples)  # probes.score's rows
  settings = protocol_settings("probes", config, examples=examples, seed=seed)
  rows = []
  for index, length in enumerate(lengths, 1):
    start = time.perf_counter()
    model, reason = model_at(run, length)
    row = {"length": length, "accuracy": None, "token_accuracy": None, "chance": None,
           "na": reason}
    try:
      row["chance"] = spec.chance(length)
    except probes.ProbeError as e:
      model, row["na"] = None, row["na"] or first_line(e)
    if model is not None and randomized is not None and length > randomized:
      model, row["na"] = None, (f"trained on randomized positions from [0, {randomized}), "
                                f"fewer than {length}")
    if model is not None:
      result = probes.score(model, run.params, spec, length, examples=examples, seed=seed,
                            batch_size=rows_per_step(run, length, batch_size),
                            randomized_positions=randomized)
      row |= {k: v for k, v in result.items() if k in ("accuracy", "token_accuracy",
                                                       "by_depth")}
    rows.append(row)
    value = "n/a" if row["accuracy"] is None else f"{row['accuracy']:.4g}"
    progress(f"probes: length {length} ({index}/{len(lengths)}): accuracy {value} "
             f"({time.perf_counter() - start:.1f} s)")
  return {"protocol": "probes", "workdir": run.workdir, "step": run.step,
          "checkpoint": run.checkpoint, "objective": config.objective, "settings": settings,
          "task": config.task, "probe": probes.describe(spec), "train_length": train_length,
          "positions": "plain" if randomized is None else "randomized",
          "randomized_positions": randomized, "examples": examples, "seed": seed, "rows": rows}


def indicators_protocol(run: Run, *, examples: int = 300, seed: int = 0,
                        progress: Callable[[str], None] = quiet) -> dict[str, Any]:
  """Wang et al.'s property indicators of an encoder run (their Table 2): identical-word
  probing of the first layer at the run's training length (at most ``max_len``),
  ``examples`` words drawn with ``seed`` (the paper: 300), monotonicity over every offset and
  the first 20, translation invariance with and without [CLS], symmetry and direction
  balance within 20 (:mod:`posenc_jax.analysis.indicators`), beside the paper's row for the
  run's scheme where one has its setup (``paper_row``, ``paper``; else
  ``paper_setup_differences`` says what differs). A masked LM or a fine-tuned BERT; a causal
  LM or an encoder-decoder is one line (identical-word probing reads attention to both sides
  of each position)."""
  from posenc_jax import analysis  # noqa: PLC0415
  from posenc_jax.analysis.loading import check_model, loaded  # noqa: PLC0415

  cfg = model_config(run.config.model)
  head = run.config.get("head", "mlm")
  try:
    check_model(cfg, head, "indicators")
    model = loaded(cfg, head, run.params, f"checkpoint:{run.workdir}@{run.step}", run.step)
    length = min(int(run.config.seq_len), cfg.max_len)
    probe = analysis.identical_word_probing(model.encoder, model.variables, model.tokens,
                                            length=length, num_words=examples, seed=seed)
  except analysis.AnalysisError as e:
    raise EvaluationError(f"protocol: 'indicators': {e}") from None
  values = analysis.indicators(probe.attention, probe.special_positions)  # the paper's 20
  row = analysis.paper_row(cfg.scheme)
  progress(f"indicators: {len(probe.words)} words at length {length}, layer {probe.layer}")
  return {"protocol": "indicators", "workdir": run.workdir, "step": run.step,
          "checkpoint": run.checkpoint, "objective": run.config.objective,
          "settings": protocol_settings("indicators", run.config, examples=examples, seed=seed),
          "length": length, "layer": probe.layer, "examples": len(probe.words),
          "special_positions": list(probe.special_positions), "indicators": values,
          "paper_row": row,
          "paper": dict(zip(analysis.TABLE2_COLUMNS, analysis.PAPER_TABLE2[row])) if row
          else None, "paper_setup_differences": analysis.paper_setup_differences(cfg.scheme)}


PROTOCOLS: dict[str, Callable[..., dict[str, Any]]] = {
    "loss": loss_protocol,
    "extrapolation": extrapolation_protocol,
    "probes": probes_protocol,
    "indicators": indicators_protocol,
}


# The kinds of run (:func:`run_kind`) each protocol scores; any other is one line.
RUN_KINDS: dict[str, tuple[str, ...]] = {
    "loss": ("mlm", "lm", "probe", "classification", "regression", "span", "translation"),
    "extrapolation": ("mlm", "lm"),
    "probes": ("probe",),
    "indicators": ("mlm", "classification", "regression", "span"),
}
KIND_WORDS = {"mlm": "masked-LM pre-training", "lm": "causal-LM pre-training",
              "probe": f"synthetic probe (task {probes.TASK_PREFIX}<name>)",
              "classification": "classification fine-tuning",
              "regression": "regression fine-tuning", "span": "span fine-tuning",
              "translation": "translation (encoder-decoder)"}


def run_kind(config: Mapping[str, Any]) -> str:
  """The kind of run a train config describes: ``probe`` for a synthetic-probe task, else its
  objective (``mlm``, ``lm``, ``classification``, ``regression``, ``span``, ``translation``)."""
  return "probe" if probes.is_probe(config.get("task") or "") else config.get("objective")


def check_run_kind(protocol: str, run: Run) -> None:
  """``protocol`` scores ``run``'s kind (:data:`RUN_KINDS`), else one line naming both and the
  protocols that score it."""
  kind = run_kind(run.config)
  if kind not in RUN_KINDS[protocol]:
    fitting = [p for p, kinds in RUN_KINDS.items() if kind in kinds]
    raise EvaluationError(
        f"protocol: {protocol!r} scores {', '.join(KIND_WORDS[k] for k in RUN_KINDS[protocol])}"
        f" runs; {run.workdir} is a {KIND_WORDS.get(kind, repr(kind))} run (task "
        f"{run.config.get('task')!r}), which {', '.join(map(repr, fitting)) or 'no protocol'} "
        "scores")


# The options of each protocol that change its numbers: its documents' ``settings``.


SETTINGS: dict[str, tuple[str, ...]] = {
    "loss": ("split", "eval_steps"),
    "extrapolation": ("split", "windows", "stride", "tokens", "mask_seed"),
    "probes": ("examples", "seed"),
    "indicators": ("examples", "seed"),
}


def protocol_settings(protocol: str, config: Mapping[str, Any], **options) -> dict[str, Any]:
  """The :data:`SETTINGS` of ``protocol`` for a run of train config ``config`` asked for
  ``options`` (its keywords; others are ignored): an option not given (or None) is the
  protocol's default, ``eval_steps`` the run's and ``mask_seed`` a masked LM's
  :data:`MASK_SEED`; one that does not apply (``stride`` of non-overlapping windows,
  ``mask_seed`` of a causal LM) is left out. In :data:`SETTINGS` order."""
  params = inspect.signature(PROTOCOLS[protocol]).parameters
  fallback = {"eval_steps": config.get("eval_steps"),
              "mask_seed": MASK_SEED if config.get("objective") == "mlm" else None}
  chosen = {}
  for name in SETTINGS[protocol]:
    value = options.get(name)
    value = params[name].default if value is None else value
    value = fallback.get(name) if value is None else value
    if value is not None:
      chosen[name] = value
  return chosen


def protocol_options(protocol: str) -> list[str]:
  """The keyword options of ``protocol`` (its function's, ``progress`` aside)."""
  params = inspect.signature(PROTOCOLS[protocol]).parameters
  return [p for p in params if params[p].kind == inspect.Parameter.KEYWORD_ONLY
          and p != "progress"]


def check_protocol(protocol: str, options: dict[str, Any]) -> None:
  """``protocol`` is known and takes every one of ``options`` (one line naming the first
  that is not)."""
  from posenc_jax.messages import nearest  # noqa: PLC0415
  if protocol not in PROTOCOLS:
    raise EvaluationError(f"protocol: got {protocol!r}{nearest(protocol, list(PROTOCOLS))} "
                          f"allowed: {', '.join(PROTOCOLS)}")
  allowed = protocol_options(protocol)
  for option in options:
    if option not in allowed:
      raise EvaluationError(f"{option}: not an option of protocol {protocol!r} (its options: "
                            f"{', '.join(allowed)})")


def evaluate_workdir(workdir: str, protocol: str = "loss", *, checkpoint: str | int = "latest",
                     out: str | None = None, progress: Callable[[str], None] | None = None,
                     **options) -> dict[str, Any]:
  """Runs ``protocol`` on ``workdir``'s model and returns its document (module docstring);
  given ``out`` (e.g. ``<workdir>/eval``), also writes ``<out>/<protocol>-<settings>.json``
  and, where it makes sense, the PNG beside it (:func:`posenc_jax.evaluation.report.write`).
  The document's ``scheme`` names the run's scheme preset
  (:func:`posenc_jax.presets.scheme_name`).

  Args:
    workdir: a train.py or finetune.py workdir (local or a URI such as ``gs://...``).
    protocol: a name in :data:`PROTOCOLS`.
    checkpoint: ``"latest"``, ``"best"`` or a saved step.
    out: the folder to write into (checked, and created, once the run is restored, before
      the protocol runs; removed again, if it was made and is still empty, when the protocol
      refuses, e.g. a length whose step would not fit in memory); never inside ``<workdir>/checkpoints`` or ``<workdir>/best``.
    progress: called with one line per stage (None: silent).
    options: the protocol's keyword options (:func:`protocol_options`).

  Raises:
    EvaluationError and the trainer's one-line errors (``USER_ERRORS``).
  """
  from posenc_jax.evaluation import report  # noqa: PLC0415

  check_protocol(protocol, options)
  route_table.points()  # a bad $POSENC_JAX_ROUTE_TABLE is one line before any work
  run = load_run(workdir, checkpoint)
  check_run_kind(protocol, run)
  made = None  # the folder check_out created, removed again if the protocol refuses
  if out is not None:
    existed = epath.Path(out).exists()
    out = report.check_out(out, run.workdir)
    made = None if existed else epath.Path(out)
  try:
    document = {"scheme": presets.scheme_name(run.config.model.to_dict()),
                **PROTOCOLS[protocol](run, progress=progress or quiet, **options)}
  except BaseException:
    if made is not None and made.is_dir() and not any(made.iterdir()):
      made.rmdir()
    raise
  if out is not None:
    report.write(document, out, progress=progress or quiet)
  return document
