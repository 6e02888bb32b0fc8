"""What ``compare --dry_run --format=F`` prints: the grid's work for a scheduler. A format is a
function ``(cells, groups, task_command, estimate) -> text``, one entry of :data:`FORMATS`; a
new one needs nothing outside this module.

* ``lines``: every cell's command lines (``# <cell>`` before each), then the estimate.
* ``slurm``: a Slurm batch script, one array task per group of cells that must run in order
  (:func:`posenc_jax.comparison.plan.groups`: a cell alone, or with the cells that fine-tune
  its pre-trained model). Each task runs ``task_command`` (the same compare command with
  ``--task=$SLURM_ARRAY_TASK_ID``), which runs its cells exactly as the local run does, into
  the same folders, and is resumable: submit the script again and finished cells are not
  rerun. ``--collect`` with the same ``--config`` and ``--workdir`` builds the tables once the
  array has ended (the script's last lines say how).
"""

from __future__ import annotations

import shlex
from collections.abc import Callable

from posenc_jax.comparison.plan import Cell


def lines(cells: list[Cell], groups: list[list[int]], task_command: list[str],
          estimate: str) -> str:
  """Every cell's command lines, then the estimate line."""
  del groups, task_command
  out = []
  for cell in cells:
    out.append(f"# {cell.name}")
    out += [shlex.join(step.command()) for step in cell.steps]
  return "\n".join([*out, estimate])


def slurm(cells: list[Cell], groups: list[list[int]], task_command: list[str],
          estimate: str) -> str:
  """A Slurm array script (module docstring)."""
  collect = [a for a in task_command if not a.startswith("--task=")]
  collect.insert(collect.index("posenc_jax.compare") + 1, "--collect")
  tasks = [f"#   {index}: {', '.join(cells[i].name for i in group)}"
           for index, group in enumerate(groups)]
  return "\n".join([
      "#!/bin/bash",
      "#SBATCH --job-name=posenc-compare",
      f"#SBATCH --array=0-{len(groups) - 1}",
      "#SBATCH --output=slurm-%A_%a.out",
      "# Add what your cluster needs (partition, --gres=gpu:1, --time, --mem) as #SBATCH lines.",
      "#",
      "# Each array task runs one group of cells, in order, into the folders a local run uses:",
      *tasks,
      f"# {estimate.lstrip('# ')}",
      "#",
      "# Submit, then build the tables once every task has ended (resubmit to resume):",
      "#   job=$(sbatch --parsable THIS_SCRIPT)",
      f"#   sbatch --dependency=afterany:$job --wrap={shlex.quote(shlex.join(collect))}",
      "set -euo pipefail",
      f"cd {shlex.quote(_cwd())}",
      shlex.join(task_command).replace("'--task=$SLURM_ARRAY_TASK_ID'",
                                       '"--task=$SLURM_ARRAY_TASK_ID"'),
      ""])


def _cwd() -> str:
  import os  # noqa: PLC0415
  return os.getcwd()


FORMATS: dict[str, Callable[[list[Cell], list[list[int]], list[str], str], str]] = {
    "lines": lines, "slurm": slurm}
