"""Parameter counts from a model's real initialisation (``jax.eval_shape``: no memory spent).

  python -m posenc_jax.params --config=configs/model.py:bert_base,diet_abs_share
  python -m posenc_jax.params --config=configs/model.py:bert_tiny,t5 --config.model.num_layers=4
  python -m posenc_jax.params --table diet6

The first form prints JSON: the total and a per-module breakdown (layers
``layers_0 .. layers_{N-1}`` summed as ``layers_*``); a train config
(``--config=configs/pretrain.py:bert_base,rope --config.seq_len=4096``) adds ``step_memory``,
the estimate of one device's training step at its ``batch_size`` and ``seq_len``
(:mod:`posenc_jax.training.memory`, by part, in bytes) beside the memory free for it.
``--table diet6`` prints DIET Table 6 (Chen et al. 2021) beside the counts of our models.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections import defaultdict
from typing import Any

import jax

from posenc_jax import cli
from posenc_jax.models.build import abstract_params, build_model
from posenc_jax.models.scan import layout_for
from posenc_jax.presets import preset_config


def count(params: Any) -> int:
  """Number of scalars in a parameter tree (arrays or ShapeDtypeStructs)."""
  return sum(math.prod(x.shape) for x in jax.tree.leaves(params))


def breakdown(params: Any, depth: int = 2) -> dict[str, int]:
  """Counts per module path of ``depth`` levels; ``layers_<i>`` merged into ``layers_*``
  (scanned layers too: they are counted as unrolled)."""
  params = jax.eval_shape(lambda tree: layout_for(tree, False), params)
  totals: dict[str, int] = defaultdict(int)
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    keys = [re.sub(r"_\d+$", "_*", str(p.key)) for p in path[:-1]][:depth]
    totals["/".join(keys) or str(path[-1].key)] += math.prod(leaf.shape)
  return dict(sorted(totals.items()))


def model_counts(config) -> dict[str, Any]:
  """``{"total": n, "modules": {...}}`` for a ConfigDict with ``model`` and ``head``."""
  params = abstract_params(build_model(config.model, config.get("head", "mlm"),
                                       num_labels=config.get("num_labels", 2)))
  return {"total": count(params), "modules": breakdown(params)}


# DIET Table 6: (row, scheme preset, English (GLUE) M, multilingual (XTREME) M, must match).
DIET6 = [
    ("Devlin et al. (input APE)", "bert", 110.1, 178.9, True),
    ("Shaw et al.", "shaw", 112.9, 181.7, False),
    ("DIET-REL", "diet_rel", 109.9, 178.7, True),
    ("DIET-REL (share)", "diet_rel_share", 109.7, 178.5, True),
    ("DIET-ABS (d_p=128)", "diet_abs", 128.6, 197.4, True),
    ("DIET-ABS (d_p=128, share)", "diet_abs_share", 111.3, 180.1, True),
]
DIET6_SIZES = ("bert_base", "bert_base_multilingual")


def diet6_rows() -> list[dict[str, Any]]:
  """Each row of DIET Table 6 with our counts (BERT-base + MLM head + pooler).

  A row matches when our count rounded to 0.1M is the paper's figure.
  """
  rows = []
  for label, scheme, english, multilingual, must_match in DIET6:
    row = {"model": label, "preset": scheme, "must_match": must_match}
    for size, paper, column in zip(DIET6_SIZES, (english, multilingual),
                                   ("english", "multilingual")):
      ours = model_counts(preset_config(f"{size},{scheme}"))["total"]
      row[column] = {"paper_m": paper, "ours": ours, "ours_m": round(ours / 1e6, 1),
                     "matches": round(ours / 1e6, 1) == paper}
    rows.append(row)
  return rows


def format_diet6(rows: list[dict[str, Any]]) -> str:
  lines = ["DIET Table 6: parameters (M), paper vs posenc-jax (BERT-base, MLM head, pooler; "
           "English vocab 30,522, multilingual 120,000)",
           f"{'model':<28}{'paper EN':>9}{'ours EN':>9}{'paper ML':>10}{'ours ML':>9}  status"]
  for row in rows:
    en, ml = row["english"], row["multilingual"]
    if row["must_match"]:
      status = "match" if en["matches"] and ml["matches"] else "MISMATCH"
    else:
      status = "reported (the paper does not give Shaw's choices)"
    lines.append(f"{row['model']:<28}{en['paper_m']:>9.1f}{en['ours_m']:>9.1f}"
                 f"{ml['paper_m']:>10.1f}{ml['ours_m']:>9.1f}  {status}")
  return "\n".join(lines)


def step_memory(config) -> dict[str, Any]:
  """``{"bytes", "parts", "summary", "free_bytes", "free"}``: the estimated memory of one
  device's training step of the train config ``config`` (the batch split over the mesh's
  ``data`` axis) and the memory free for it (:func:`posenc_jax.memory.available`)."""
  from posenc_jax import memory  # noqa: PLC0415
  from posenc_jax.training import mesh as mesh_lib  # noqa: PLC0415
  from posenc_jax.training.config import validate_train_config  # noqa: PLC0415
  from posenc_jax.training.memory import train_memory  # noqa: PLC0415

  cfg = validate_train_config(config)
  mesh = mesh_lib.make_mesh(config.mesh.shape, config.mesh.axes)
  estimate = train_memory(config, cfg, mesh.shape["data"])
  free, where = memory.available()
  return {"bytes": estimate.total, "parts": dict(estimate.parts), "summary": str(estimate),
          "free_bytes": free, "free": where}


def main(argv: list[str]) -> None:
  """Prints the counts of ``--config`` or the table of ``--table``; a bad flag (or preset) is one
  line ``params: ...`` and exit status 1, before any model is built."""
  from absl import flags  # noqa: PLC0415
  from ml_collections import config_flags  # noqa: PLC0415

  from posenc_jax.models import ModelConfigError  # noqa: PLC0415
  from posenc_jax.route_table import RouteTableError  # noqa: PLC0415
  from posenc_jax.training.config import TrainConfigError  # noqa: PLC0415
  from posenc_jax.training.mesh import MeshConfigError  # noqa: PLC0415
  from posenc_jax.training.optim import OptimizerConfigError  # noqa: PLC0415

  fv = flags.FlagValues()  # fresh, so main can run more than once in a process
  config_flag = config_flags.DEFINE_config_file("config", None, "configs/<file>.py:<presets>",
                                                flag_values=fv, sys_argv=argv)
  table = flags.DEFINE_enum("table", None, ["diet6"], "print a paper's table beside ours",
                            flag_values=fv)
  rest = cli.flags_parser("params", fv=fv)(argv)
  if rest[1:]:
    raise SystemExit(f"params: unexpected argument {rest[1]!r} (flags only: --config, --table)")
  if table.value is not None and config_flag.value is not None:
    raise SystemExit(f"params: table: got {table.value!r} and a config; give one: "
                     "--config=configs/<file>.py:<presets> or --table diet6")
  if table.value == "diet6":
    rows = diet6_rows()
    print(format_diet6(rows))
    print(json.dumps(rows))
    return
  if config_flag.value is None:
    raise SystemExit("params: give --config=configs/<file>.py:<presets> or --table diet6")
  config = config_flag.value
  try:
    counts = model_counts(config)
    if "batch_size" in config and "seq_len" in config:  # a train config: its step too
      counts["step_memory"] = step_memory(config)
  except (ModelConfigError, TrainConfigError, MeshConfigError, OptimizerConfigError,
          RouteTableError) as e:
    raise SystemExit(f"params: {e}") from None
  print(json.dumps(counts, indent=2))


if __name__ == "__main__":
  cli.run_command(main, sys.argv)
