"""The ``--help`` text of the command-line tools: what a tool does, its flags, the configs it
takes, the presets and position schemes, and the ``--config.`` fields most runs set with the
defaults of the config given::

  app.run(main, flags_parser=cli.flags_parser(
      "train.py", help=usage.helper("train.py", __doc__, configs=("pretrain", "lm"))))

Kept apart from :mod:`posenc_jax.cli`, which the library's lowest modules import: this one
reads the presets, the scheme registry and the train config, above them.
"""

from __future__ import annotations

import ast
import functools
import os
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

from absl import flags

from posenc_jax import presets
from posenc_jax.cli import PACKAGED_CONFIGS
from posenc_jax.schemes import SCHEMES
from posenc_jax.training.config import base_train_config

# The ``--config.`` fields most runs set, with what each means (shown by :func:`help_text`).
COMMON_FIELDS = (
    ("total_steps", "training steps"),
    ("batch_size", "examples per step (global)"),
    ("seq_len", "tokens per example"),
    ("optimizer.learning_rate", "peak learning rate"),
    ("optimizer.warmup_steps", "linear warm-up steps"),
    ("log_every", "steps between console lines"),
    ("eval_every", "steps between evaluations (0: none)"),
    ("eval_steps", "batches per evaluation"),
    ("checkpoint_every", "steps between checkpoints"),
    ("seed", "initialisation and data seed"),
    ("task", "seqio task"),
    ("model.scheme", "position scheme, e.g. \"{'name': 'alibi'}\""),
    ("model.route", "attention kernel (auto picks per backend and length)"),
    ("model.dtype", "compute dtype (float32, bfloat16)"),
    ("model.max_len", "longest position the model covers"),
    ("mesh.shape", "(data, model) devices; -1 takes the rest"),
)



def _first_sentence(path: str) -> str:
  """The first sentence of the module docstring of the Python file ``path`` ("" if none)."""
  with open(path) as f:
    doc = ast.get_docstring(ast.parse(f.read())) or ""
  paragraph = " ".join(doc.strip().split("\n\n")[0].split())
  return paragraph.partition(". ")[0].removesuffix(".") + "." if paragraph else ""


def _field(config, path: str):
  """``config``'s value at the dotted ``path``, or ``KeyError``."""
  for key in path.split("."):
    if not hasattr(config, "keys") or key not in config.keys():
      raise KeyError(path)
    config = config[key]
  return config


def help_text(prog: str, usage: str, *, configs: Sequence[str] | None = None, config=None,
              fv: flags.FlagValues | None = None,
              fields: Sequence[tuple[str, str]] = COMMON_FIELDS,
              default: Callable[[], Any] = base_train_config) -> str:
  """The ``--help`` text of a command-line tool, for absl and ``argparse`` tools alike.

  Args:
    prog: the tool's name as typed (``train.py``, ``python -m posenc_jax.evaluate``).
    usage: what the tool does and how it is called (its module docstring), printed first.
    configs: the names (``pretrain``, ``lm``) of the shipped ``posenc_jax/configs`` files the
      tool takes, listed with their docstrings' first sentences; None lists them all, ``()`` none
      (nor the presets and fields).
    config: a loaded config (``ConfigDict``) whose values of ``fields`` are shown as the
      defaults; None: those of ``default()``.
    fv: the absl flags whose non-absl flags are listed (``flags.FLAGS``); None lists none.
    fields: the ``--config.`` fields shown, ``(dotted path, meaning)`` (default
      :data:`COMMON_FIELDS`, the train config's); those the config lacks are left out.
    default: the config whose values are shown when ``config`` is None.

  Returns:
    ``usage``, the tool's flags, the configs, the presets (model sizes, position schemes,
    modifiers) and the registered schemes, the common ``--config.`` fields with their
    defaults, and (where absl's ``--helpfull`` is defined) that it lists every flag.
  """
  lines = [usage.strip("\n"), ""]
  if fv is not None:
    lines.append("Flags:")
    for module, module_flags in fv.flags_by_module_dict().items():
      if not module.startswith("absl."):
        lines += [f"  --{f.name}: {f.help}" + (f" (default: {f.default})" if f.default not in
                                               (None, False) else "") for f in module_flags]
    lines.append("")
  if configs != ():
    names = sorted(n[:-3] for n in os.listdir(PACKAGED_CONFIGS)
                   if n.endswith(".py") and not n.startswith("_"))
    shown = [n for n in names if configs is None or n in configs]
    width = max(map(len, shown), default=0) + 13
    lines.append("Configs (--config=configs/<file>.py[:<arguments>]):")
    lines += [f"  {f'configs/{n}.py':<{width}}"
              f"{_first_sentence(os.path.join(PACKAGED_CONFIGS, f'{n}.py'))}" for n in shown]
    modifiers = [n for n in presets.SCHEME_PRESETS if n not in presets.POSITION_PRESETS]
    wrap = functools.partial(textwrap.wrap, width=96, subsequent_indent=" " * 13)
    lines += ["", "Presets (arguments: one size, then schemes and modifiers, applied in order):",
              *wrap(f"  sizes:     {', '.join(presets.SIZES)}"),
              *wrap(f"  schemes:   {', '.join(presets.POSITION_PRESETS)}"),
              *wrap(f"  modifiers: {', '.join(modifiers)}"),
              "", "Position schemes (--config.model.scheme.name=...):",
              *textwrap.wrap(", ".join(SCHEMES), width=96, initial_indent="  ",
                             subsequent_indent="  "), ""]
    config = default() if config is None else config
    shown_fields = []
    for path, meaning in fields:
      try:
        value = _field(config, path)
      except KeyError:
        continue
      shown_fields.append((f"--config.{path}={dict(value) if hasattr(value, 'keys') else value}",
                           meaning))
    if shown_fields:
      width = min(max(len(f) for f, _ in shown_fields), 40)  # a long value does not push on
      lines.append("Common fields (--config.<field>=<value>; the value shown is this config's):")
      lines += [f"  {f:<{width}}  {meaning}" for f, meaning in shown_fields]
      lines.append("")
  if fv is not None and "helpfull" in fv:
    lines.append(f"{prog} --helpfull lists every flag, including absl's.")
  return "\n".join(lines).strip("\n")


def helper(prog: str, usage: str, *, configs: Sequence[str] | None = None,
           fields: Sequence[tuple[str, str]] = COMMON_FIELDS,
           default: Callable[[], Any] = base_train_config
           ) -> Callable[[Any, flags.FlagValues], str]:
  """``cli.flags_parser``'s ``help``: :func:`help_text` of ``prog`` with the config given on
  its command line (or None: ``default()``), its flags and ``fields``."""
  return lambda config, fv: help_text(prog, usage, configs=configs, config=config, fv=fv,
                                      fields=fields, default=default)
