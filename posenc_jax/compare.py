r"""A grid of schemes x seeds (x sizes) run through train.py, finetune.py and the evaluate
tool, and the papers' tables built from the runs:

  python -m posenc_jax.compare --config=configs/compare.py:extrapolation --workdir=/tmp/cmp
  python -m posenc_jax.compare --config=configs/compare.py:pretrain_finetune --workdir=/tmp/pf \
      --config.seeds=0,1,2,3,4 --dry_run            # the command lines, nothing run
  python -m posenc_jax.compare --collect --workdir=/tmp/table gs://bucket/runs/*
  python -m posenc_jax.compare --collect --config=configs/compare.py:pretrain_finetune \
      --workdir=/tmp/pf                             # the table again from ROOT's cells

Each cell runs in ``ROOT/<scheme>/seed<k>`` (see :mod:`posenc_jax.comparison.plan`) as
subprocesses whose output goes to ``ROOT/<scheme>/seed<k>/log.txt`` (each command line, its
output and, once it succeeds, ``# <step>: <seconds> s``); one progress line per cell. A
finished cell (``cell.json``) is not rerun (a task or an evaluation added to the experiment
since runs alone) and an unfinished one resumes, so a killed compare is restarted
with the same command; SIGTERM or Ctrl-C goes to the running step too (train.py saves the
step it is at), and compare stops with the step's status; a failed cell is reported and the
others go on (exit status 1 at the end). A cell keeps what its evaluation needs: while it trains,
one checkpoint (enough to resume it), and once finished, its final parameters only, without
the optimizer state (``--config.keep=all``: every checkpoint train.py keeps). Then
``ROOT/results.json`` (every run's numbers and the tables), ``ROOT/results.md`` (median
(min-max) over seeds per scheme and task or length, cost beside it) and PNG curves are
written. ``--collect [DIR...]`` builds the same from
workdirs made elsewhere (a cluster; ``gs://`` works), written into ``--workdir``; without
``--config`` it keeps the experiment (title, row order, evaluation settings) of the
``results.json`` already there. A table holds the runs evaluated with one set of settings
(the experiment's, given one): runs that differ are one error line and nothing is written.
A compare ROOT's ``cost.json`` (in ``--workdir`` or a folder given) is shown beside them.
``--dry_run`` prints each cell's commands, to submit to a scheduler, and writes nothing.
``--dry_run --format=slurm`` prints a Slurm job-array script instead (one task per group of
cells that run in order; ``--task=K`` runs task K: :mod:`posenc_jax.comparison.formats`).
``--parallel=N`` (``auto``: one per GPU, TPU chip or CPU core; default: the experiment's
``parallel``, ``auto`` for the CPU pre-train/fine-tune grids) runs N cells at once on this
host, the devices split evenly between them (``CUDA_VISIBLE_DEVICES``, the TPU runtime's
visible chips, a CPU set: :mod:`posenc_jax.comparison.slots`); everything above holds, and
the cost is timed after the cells, alone.
"""

import json
import shlex
import sys
import time

from absl import app, flags, logging

from posenc_jax import allocator, cli, messages
from posenc_jax import usage as usage_lib
from posenc_jax.paths import hold

_CONFIG = cli.define_config("config", None, "configs/compare.py:<experiment>")
_WORKDIR = flags.DEFINE_string("workdir", None, "ROOT: the cells' folders and the results")
_COLLECT = flags.DEFINE_bool("collect", False, "build the tables from the workdirs given as "
                             "arguments (default: ROOT's cells), running nothing")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "print each cell's command lines, run nothing")
_FORMAT = flags.DEFINE_string("format", "lines", "with --dry_run: lines (each cell's "
                              "commands) or slurm (a job-array batch script)")
_TASK = flags.DEFINE_integer("task", None, "run only task K of the grid (a job array's index: "
                             "a cell, with the cells that fine-tune its model), no cost, no "
                             "tables", lower_bound=0)
_PARALLEL = flags.DEFINE_string("parallel", None, "cells at once on this host: N, or auto (one "
                                "per GPU, TPU chip or CPU core); the devices split evenly "
                                "between them (default: the experiment's parallel field)")
PROG = "compare"
COST_FILE = "cost.json"
RESULTS_FILE = "results.json"


def summarise(records, failed, config=None, cost=None):
  """``results.json``'s document: the runs' records, the failed cells, the tables (of the
  evaluations with the experiment's settings, given ``config``), the corpus hash they
  carry (``corpus_sha256``, or None) and the property indicators of the runs scored with
  them (:func:`~posenc_jax.comparison.report.indicator_rows`).

  Raises:
    CollectError: runs of one table that differ (:func:`posenc_jax.comparison.report.tables`).
  """
  from posenc_jax.comparison import plan, report  # noqa: PLC0415

  checked = plan.check(config) if config is not None else {"schemes": [], "tasks": []}
  tables = report.tables(records, checked["schemes"], checked["tasks"],
                         config.protocol if config is not None else None,
                         plan.evaluate_options(config) if config is not None else None,
                         baseline=checked.get("baseline"))
  return {"experiment": config.experiment if config is not None else None,
          "config": config.to_dict() if config is not None else None,
          "records": records, "failed": failed, "cost": cost,
          "corpus_sha256": report.corpus(tables), "tables": tables,
          "indicators": report.indicator_rows(records, checked["schemes"])}


def machine() -> str:
  """This machine in words: its CPU (model and cores) and JAX's devices."""
  import os  # noqa: PLC0415
  import platform  # noqa: PLC0415

  import jax  # noqa: PLC0415

  model = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      model = next((line.partition(":")[2].strip() for line in f
                    if line.startswith("model name")), model)
  except OSError:
    pass
  kinds = sorted({d.device_kind for d in jax.devices()})
  return (f"{os.cpu_count()} CPU cores ({model}); JAX {jax.__version__} on "
          f"{jax.default_backend()} ({len(jax.devices())} x {', '.join(kinds)})")


def provenance(folders: list[str], command: str, wall_seconds: float | None = None,
               slots: int = 1) -> dict:
  """``results.json``'s ``provenance``: the command, the machine, the date (UTC) and
  ``seconds``: the cells' own times (each ``cell.json`` at most three folders under
  ``folders``: its processes, summed) and the cost's, i.e. the grid's wall time run in
  sequence. A compare that ran cells adds ``wall_seconds``, its own invocation's wall time
  (cells and cost; a resumed grid's earlier invocations not counted), and ``slots``, the
  cells it ran at once. A file whose ``seconds`` is no number is one ``CollectError`` line
  naming it (:func:`posenc_jax.comparison.collect.recorded_seconds`)."""
  import datetime  # noqa: PLC0415

  from etils import epath  # noqa: PLC0415

  from posenc_jax.comparison import collect, run  # noqa: PLC0415

  seconds = 0.0
  for folder in folders:
    for pattern in (run.MARKER, f"*/{run.MARKER}", f"*/*/{run.MARKER}", f"*/*/*/{run.MARKER}"):
      for marker in epath.Path(folder).glob(pattern):
        seconds += collect.recorded_seconds(marker)
    cost_file = epath.Path(folder) / COST_FILE
    if cost_file.exists():
      seconds += collect.recorded_seconds(cost_file)
  made = {"command": command, "machine": machine(), "seconds": round(seconds, 1),
          "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")}
  if wall_seconds is not None:
    made.update(wall_seconds=round(wall_seconds, 1), slots=slots)
  return made


def cost_lengths(config, checked) -> list[int]:
  """The lengths the cost is timed at: ``cost.lengths``, else the training length (the
  experiment's ``train.seq_len``, else 128) and, for a curve experiment, the longest
  evaluated length."""
  from posenc_jax.comparison import plan  # noqa: PLC0415

  if config.cost.get("lengths"):
    return plan.integers(config.cost, "lengths", positive=True)
  train = int(config.train.get("seq_len") or 128)
  longest = max(checked["lengths"], default=train)
  return [train] if longest <= train else [train, longest]


def measure_cost(config, root: str, say=None):
  """The cost rows of ``config`` (:func:`posenc_jax.comparison.cost.measure`), kept in
  ``ROOT/cost.json`` for reruns; None when ``config.cost.enabled`` is off."""
  from etils import epath  # noqa: PLC0415

  from posenc_jax.comparison import collect, cost, plan, run  # noqa: PLC0415
  from posenc_jax.paths import write_atomic  # noqa: PLC0415
  from posenc_jax.configs.lm import CORPORA  # noqa: PLC0415

  say = say or run.progress
  if not config.cost.enabled:
    return None
  path = epath.Path(root) / COST_FILE
  checked = plan.check(config)
  # A modifier (rope+randomized_positions) changes the data, not the step: one row a scheme.
  schemes = list(dict.fromkeys(plan.scheme_of(row) for row in checked["schemes"]))
  checked |= {"schemes": schemes, "baseline": plan.scheme_of(checked["baseline"])}
  lm = checked["protocol"] in ("extrapolation", "probes")
  spec = str(config.train_config).partition(":")[2].split(",")  # <size>,<scheme>[,<corpus>]
  corpus = next((name for name in spec if name in CORPORA), None) if lm else None
  asked = dict(baseline=checked["baseline"], size=checked["sizes"][0], batch=config.cost.batch,
               lengths=cost_lengths(config, checked), dtype=config.cost.dtype,
               model="lm" if lm else "auto")
  if path.exists():
    kept = collect.read_cost(path)
    if sorted(kept["rows"]) == sorted(checked["schemes"]) and all(
        kept.get(k) == v for k, v in asked.items()):
      return kept
  say(f"cost: timing {', '.join(checked['schemes'])} against {checked['baseline']} at "
      f"{', '.join(map(str, asked['lengths']))}")
  start = time.perf_counter()
  try:
    rows = cost.measure(checked["sizes"][0], checked["schemes"], checked["baseline"],
                        config.cost, asked["lengths"], lm=lm, corpus=corpus)
  except Exception as e:  # noqa: BLE001 - the tables are written without cost
    return {"baseline": checked["baseline"], "rows": {},
            "note": f"Cost: not measured: {messages.first_line(e)}"}
  rows["seconds"] = time.perf_counter() - start
  write_atomic(path, json.dumps(rows, indent=2))
  return rows


def compare(config, root: str, run_cell=None, say=None, command: str | None = None,
            slots=None):
  """Runs ``config``'s grid under ``root`` (:func:`posenc_jax.comparison.run.run_grid`;
  ``run_cell`` defaults to the subprocesses; ``slots``: cells at once, each on its slot's
  devices), measures the cost (after every cell, alone), writes the results; returns the
  summary."""
  from posenc_jax.comparison import pages, plan, run  # noqa: PLC0415

  say = say or run.progress
  cells = plan.cells(config, root)
  start = time.perf_counter()
  records, failed = run.run_grid(cells, run_cell or run.run_steps, say, slots=slots)
  summary = summarise(records, failed, config, measure_cost(config, root, say))
  summary["provenance"] = provenance(
      [root], command or f"posenc_jax.compare.compare(config, {root!r})",
      wall_seconds=time.perf_counter() - start, slots=max(len(slots or ()), 1))
  for path in pages.write(root, summary):
    say(f"wrote {path}")
  return summary


def _command() -> str:
  """This process's command line, as typed."""
  return shlex.join(["python", "-m", "posenc_jax.compare", *sys.argv[1:]])


def _task_command() -> list[str]:
  """This command line as one job-array task runs it: without ``--dry_run`` and ``--format``,
  with ``--task=$SLURM_ARRAY_TASK_ID``."""
  keep = [a for a in sys.argv[1:] if not a.startswith(("--dry_run", "--nodry_run", "--format",
                                                       "--task", "--parallel"))]
  return [sys.executable, "-m", "posenc_jax.compare", *keep, "--task=$SLURM_ARRAY_TASK_ID"]


def run_task(cells, task: int, run_cell=None, say=None) -> None:
  """Runs task ``task`` of the grid (:func:`posenc_jax.comparison.plan.groups`: a cell, with
  the cells that fine-tune its pre-trained model, in order) as the local run would, into the
  same folders; one line naming the task when it is out of range, exit status 1 when a cell
  failed."""
  from posenc_jax.comparison import plan, run  # noqa: PLC0415

  ordered = plan.groups(cells)
  if task >= len(ordered):
    sys.exit(f"{PROG}: --task: got {task}; allowed: 0..{len(ordered) - 1} (the grid's tasks)")
  _, failed = run.run_grid([cells[i] for i in ordered[task]], run_cell or run.run_steps,
                           say or run.progress)
  if failed:
    cli.exit_with(PROG, f"task {task}: {len(failed)} cell(s) failed: "
                  + ", ".join(f["cell"] for f in failed))


def main(argv):
  from etils import epath  # noqa: PLC0415

  from posenc_jax.comparison import (collect, estimate, formats, pages, plan, run,  # noqa: PLC0415
                                     slots)

  logging.set_verbosity(logging.WARNING)  # JAX's backend lines before the cost is timed
  allocator.keep_freed_buffers()  # the cost's steps, timed here
  folders, config, root = argv[1:], _CONFIG.value, _WORKDIR.value
  if folders and not _COLLECT.value:
    sys.exit(f"{PROG}: unexpected arguments {' '.join(folders)}; folders to read go after "
             "--collect")
  if not root:
    sys.exit(f"{PROG}: --workdir: required (the cells' folders and the results go there)")
  root = cli.absolute(root)
  try:
    if _COLLECT.value:
      records = collect.collect(folders or [root])
      if config is None:  # a re-collect keeps the experiment of ROOT's results
        config = collect.kept_experiment(epath.Path(root) / RESULTS_FILE)
      kept = [p for p in (epath.Path(f) / COST_FILE for f in [root, *folders]) if p.exists()]
      summary = summarise(records, [], config, collect.read_cost(kept[0]) if kept else None)
      summary["provenance"] = provenance(folders or [root], _command())
      cli.check_output_dir("workdir", root)  # nothing made before the tables build
      for path in pages.write(root, summary):
        print(f"wrote {path}")
    else:
      if config is None:
        sys.exit(f"{PROG}: --config: required, e.g. configs/compare.py:extrapolation")
      cells = plan.cells(config, root)
      if _FORMAT.value not in formats.FORMATS:
        hint = messages.nearest(_FORMAT.value, list(formats.FORMATS))
        sys.exit(f"{PROG}: --format: got {_FORMAT.value!r}{hint} allowed: "
                 f"{', '.join(formats.FORMATS)}")
      if _DRY_RUN.value:
        print(formats.FORMATS[_FORMAT.value](
            cells, plan.groups(cells), _task_command(),
            estimate.summary_line(cells, config.get("device", "cpu"))))
        return
      if _TASK.value is not None:
        run_task(cells, _TASK.value)
        return
      parallel = _PARALLEL.value or str(config.get("parallel", "1"))
      chosen = slots.slots(parallel) if parallel != "1" else None
      cli.check_output_dir("workdir", root)
      hold("workdir", root)  # one compare per ROOT (a grid's --task=K runs share it)
      summary = compare(config, root, command=_command(), slots=chosen)
  except (plan.PlanError, collect.CollectError, cli.OutputPathError, slots.SlotError) as e:
    cli.exit_with(PROG, e)
  except run.StepInterrupted as e:  # the step saved and stopped; so does compare
    print(f"{PROG}: {e}", file=sys.stderr, flush=True)
    sys.exit(e.status or 128 + e.signum)
  print(pages.markdown(summary))
  if summary["failed"]:
    cli.exit_with(PROG, f"{len(summary['failed'])} cell(s) failed: "
                  + ", ".join(f["cell"] for f in summary["failed"]))


# The experiment's fields that --help shows, with the values of the experiment given.
FIELDS = (
    ("schemes", "the rows: position presets, comma-separated (add one: --config.schemes=...); "
     "<scheme>+randomized_positions trains on randomized positions"),
    ("randomized_positions", "N of the +randomized_positions rows: ids drawn from [0, N)"),
    ("seeds", "seeds per scheme; the tables show the median and the range"),
    ("sizes", "model size presets"),
    ("tasks", "fine-tuning tasks or probes"),
    ("lengths", "evaluation lengths; the first is the training length"),
    ("train.total_steps", "training steps of every run (raise it for stronger models)"),
    ("train.seq_len", "training length"),
    ("train.batch_size", "sequences per step"),
    ("train.optimizer.learning_rate", "peak learning rate"),
    ("train_config", "the train.py config of a cell ({size}, {scheme} filled in)"),
    ("evaluate.windows", "non_overlapping, sliding, or both comma-separated"),
    ("evaluate.stride", "tokens each sliding window scores"),
    ("evaluate.tokens", "validation tokens scored at every length"),
    ("cost.enabled", "time each scheme's train step against the baseline"),
    ("cost.lengths", "the lengths timed (empty: training and longest evaluated)"),
    ("keep", "what a cell keeps: params (one checkpoint while it trains, then its final "
     "parameters only, no optimizer state) or all (every checkpoint train.py keeps)"),
)
STRONGER = """\
Stronger experiments: raise --config.seeds (5 or more seeds make ranges that can separate),
--config.train.total_steps and --config.sizes=bert_small (models that use position more),
--config.evaluate.tokens (a scoring sample the seeds' spread dominates), and add
--config.evaluate.windows=non_overlapping,sliding --config.evaluate.stride=<L>. A scheme joins
with --config.schemes=<presets>. On a GPU or TPU (pip install -e ".[train,cuda13]" or
".[train,tpu]"), run the same command, or the ',gpu' variant; on a cluster, --dry_run prints
each cell's commands for your scheduler and --collect --config=... --workdir=OUT DIR... builds
the tables from the workdirs it made."""


def usage() -> str:
  """``--help``'s opening: this module's docstring, the experiments and variants shipped and
  how to make an experiment stronger."""
  from posenc_jax.configs.compare import EXPERIMENTS, VARIANTS  # noqa: PLC0415
  return (f"{__doc__.rstrip()}\n\nExperiments (--config=configs/compare.py:<experiment>"
          f"[,<variant>]): {', '.join(EXPERIMENTS)}; variants: {', '.join(VARIANTS)} (the "
          f"experiments and variants: python -c \"import posenc_jax.configs.compare as c; "
          f"help(c)\", or docs/evaluation.md)\n\n{STRONGER}")


def _default_experiment():
  from posenc_jax.configs.compare import get_config  # noqa: PLC0415
  return get_config()


def helper():
  """``--help``'s text function (:func:`posenc_jax.usage.helper`): the experiment's fields
  with the values of the experiment given (default: ``extrapolation``)."""
  return usage_lib.helper(PROG, usage(), configs=("compare",), fields=FIELDS,
                          default=_default_experiment)


def run() -> None:
  """The command line, ``python -m posenc_jax.compare``."""
  cli.run_command(app.run, main, flags_parser=cli.flags_parser(PROG, help=helper()))


if __name__ == "__main__":
  run()
