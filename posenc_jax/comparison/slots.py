"""Where the cells of one host run at once (``compare --parallel=N``): the host's devices split
evenly into N slots, each the variables (and, on CPUs, the cores) its cell's processes get.

* GPU: ``CUDA_VISIBLE_DEVICES`` (the ids of ``$CUDA_VISIBLE_DEVICES`` if set, else those
  ``nvidia-smi`` lists).
* TPU VM: the chips of ``/dev/accel*`` (``/dev/vfio/<n>`` on newer VMs), each slot a process
  of its own: ``TPU_VISIBLE_CHIPS`` (and the older ``TPU_VISIBLE_DEVICES``),
  ``TPU_CHIPS_PER_PROCESS_BOUNDS`` for its 1, 2, 4 or 8 chips, ``TPU_PROCESS_BOUNDS=1,1,1`` and
  a port of its own (``TPU_PROCESS_PORT``, ``TPU_MESH_CONTROLLER_*``), libtpu's recipe for
  processes that do not communicate.
* CPU: the cores this process may run on (``os.sched_getaffinity``), each slot a CPU set its
  processes are pinned to.

Nothing here imports JAX: the parent must not take a device its cells need.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence

PLATFORMS = ("gpu", "tpu", "cpu")
# A slot's chips -> TPU_CHIPS_PER_PROCESS_BOUNDS (x, y, z of the chips it holds).
TPU_BOUNDS = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,4,1"}
TPU_PORT = 8476  # the first slot's port; the others count up from it


class SlotError(ValueError):
  """A ``--parallel`` the host cannot give (one line naming the flag)."""


@dataclasses.dataclass(frozen=True)
class Slot:
  """One place a cell runs.

  Attributes:
    name: what it holds, for the progress lines (``GPU 0,1``, ``TPU chips 2,3``, ``CPUs 0-7``).
    env: the variables its processes get on top of this process's.
    cpus: the cores its processes are pinned to (CPU slots), else None.
  """

  name: str
  env: Mapping[str, str] = dataclasses.field(default_factory=dict)
  cpus: tuple[int, ...] | None = None


def _gpu_ids() -> list[str]:
  visible = os.environ.get("CUDA_VISIBLE_DEVICES")
  if visible is not None:
    return [i.strip() for i in visible.split(",") if i.strip()]
  if not shutil.which("nvidia-smi"):
    return []
  try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
  except (OSError, subprocess.SubprocessError):
    return []
  return [line.strip() for line in out.splitlines() if line.strip()]


def _tpu_chips() -> list[str]:
  chips = sorted(glob.glob("/dev/accel*")) or sorted(
      p for p in glob.glob("/dev/vfio/*") if re.fullmatch(r"\d+", os.path.basename(p)))
  return [str(i) for i in range(len(chips))]


def host_devices() -> tuple[str, list[str]]:
  """``(platform, device ids)`` of this host: its GPUs, else its TPU chips, else its CPUs."""
  gpus = _gpu_ids()
  if gpus:
    return "gpu", gpus
  chips = _tpu_chips()
  if chips:
    return "tpu", chips
  return "cpu", [str(c) for c in sorted(os.sched_getaffinity(0))]


def _ranges(ids: Sequence[str]) -> str:
  """``0-3,6`` for ids 0, 1, 2, 3, 6."""
  numbers, parts = sorted(int(i) for i in ids), []
  start = prev = numbers[0]
  for n in numbers[1:] + [None]:
    if n is not None and n == prev + 1:
      prev = n
      continue
    parts.append(f"{start}-{prev}" if prev > start else f"{start}")
    if n is not None:
      start = prev = n
  return ",".join(parts)


def split(parallel: str | int, platform: str, devices: Sequence[str]) -> list[Slot]:
  """``parallel`` slots (``auto``: one per device) over ``devices`` of ``platform``, split
  evenly (the first slots take one more where they do not divide).

  Raises:
    SlotError: ``parallel`` not a positive integer or ``auto``, more slots than devices, or a
      TPU slot of a chip count libtpu's bounds do not describe (:data:`TPU_BOUNDS`).
  """
  if platform not in PLATFORMS:
    raise SlotError(f"parallel: platform {platform!r}; allowed: {', '.join(PLATFORMS)}")
  if not devices:
    raise SlotError(f"parallel: this host has no {platform} devices to split")
  text = str(parallel).strip()
  if text == "auto":
    count = len(devices)
  elif re.fullmatch(r"\d+", text) and int(text) > 0:
    count = int(text)
  else:
    raise SlotError(f"parallel: got {parallel!r}; allowed: a positive integer or auto")
  if count > len(devices):
    raise SlotError(f"parallel: got {count}; allowed: at most {len(devices)}, this host's "
                    f"{platform} devices ({_ranges(devices) if platform == 'cpu' else ','.join(devices)})")
  base, extra = divmod(len(devices), count)
  slots, start = [], 0
  for index in range(count):
    chunk = list(devices[start:start + base + (index < extra)])
    start += len(chunk)
    slots.append(_slot(index, platform, chunk))
  return slots


def _slot(index: int, platform: str, chunk: list[str]) -> Slot:
  ids = ",".join(chunk)
  if platform == "gpu":
    return Slot(f"GPU {ids}", {"CUDA_VISIBLE_DEVICES": ids})
  if platform == "tpu":
    if len(chunk) not in TPU_BOUNDS:
      raise SlotError(f"parallel: a slot of {len(chunk)} TPU chips; allowed: "
                      f"{', '.join(map(str, TPU_BOUNDS))} chips a slot (pick --parallel so "
                      "that the chips divide into those)")
    port = str(TPU_PORT + index)
    return Slot(f"TPU chips {ids}", {
        "TPU_VISIBLE_CHIPS": ids, "TPU_VISIBLE_DEVICES": ids,
        "TPU_CHIPS_PER_PROCESS_BOUNDS": TPU_BOUNDS[len(chunk)], "TPU_PROCESS_BOUNDS": "1,1,1",
        "TPU_PROCESS_PORT": port, "TPU_MESH_CONTROLLER_ADDRESS": f"localhost:{port}",
        "TPU_MESH_CONTROLLER_PORT": port})
  cpus = tuple(int(c) for c in chunk)
  return Slot(f"CPUs {_ranges(chunk)}", {}, cpus)


def slots(parallel: str | int) -> list[Slot]:
  """:func:`split` over this host's devices (:func:`host_devices`)."""
  return split(parallel, *host_devices())
