"""The command-line front door of train.py, finetune.py and ``python -m posenc_jax.analysis``:
flags are parsed so that every mistake a user can type (an unknown preset, a misspelt
``--config.<field>``, a missing config file, a value of the wrong type) ends in one line
``<prog>: <field>: ...`` and a non-zero exit, never a traceback.

Beyond absl's overrides of the fields a config file sets: each hyperparameter of a configured
scheme can be set alone, ``--config.model.scheme.scaling=yarn``, with its type (the scheme's
default's), and ``--config.model.scheme.name=<scheme>`` starts that scheme afresh whatever
the flags' order (:func:`ready_scheme_fields`, for every scheme config in the config); a list
field takes ``1,2,3`` or ``'(1, 2, 3)'`` (:class:`_ListParser`).

  app.run(main, flags_parser=cli.flags_parser("train.py"))

``flags_parser(prog, help=usage.helper(prog, __doc__, configs=(...)))`` makes ``--help``
print :func:`posenc_jax.usage.help_text`: the usage, the tool's flags, the shipped configs,
the presets and schemes, and the common ``--config.`` fields with their defaults.

Every entry point runs through :func:`run_command` (``cli.run_command(app.run, main, ...)``,
``cli.run_command(main, sys.argv[1:])``): a reader that closes the pipe early (``| head``)
ends the tool quietly, as it does a Unix tool.

Also: :func:`check_output_dir` and :func:`check_output_file`, which tools call on every
path they will write before any work starts, and for ``argparse`` tools
:class:`ArgumentParser` with the types :func:`positive_int` and :func:`one_of`:

  parser = cli.ArgumentParser(prog="bench")
  parser.add_argument("--length", type=cli.positive_int, default=128)
  parser.add_argument("--schemes", type=cli.one_of(SCHEMES, sep=","), default="bert,t5")
"""

from __future__ import annotations

import argparse
import ast
import logging
import os
import re
import signal
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from absl import flags

from posenc_jax.messages import first_line, nearest
# The paths a tool writes: below the core, which this front door opens (re-exported for the tools).
from posenc_jax.paths import (OutputPathError, absolute, check_output_dir,  # noqa: F401
                              check_output_file, is_remote)


def _root(error: BaseException) -> BaseException:
  """The first exception in ``error``'s chain (what the config file itself raised)."""
  seen = []
  while error is not None and error not in seen:
    seen.append(error)
    error = error.__cause__ or error.__context__
  return seen[-1]


def _overrides(argv: Sequence[str], name: str) -> list[tuple[list[str], str | None]]:
  """The ``--<name>.<a>.<b>=<value>`` overrides in ``argv``, in order, as ``([a, b], value)``;
  the value of ``--<name>.<a> <value>`` is the next argument, and None for a flag given
  alone (a boolean: ``--<name>.<a>``, ``--no<name>.<a>``)."""
  found = []
  for i, arg in enumerate(argv):
    match = re.fullmatch(rf"--?(?:no)?{re.escape(name)}\.([^=]+)(?:=(.*))?", arg, re.DOTALL)
    if match:
      value = match[2]
      if value is None and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
        value = argv[i + 1]
      found.append((match[1].split("."), value))
  return found


def _node(config, path: Sequence[str]):
  """The value at ``path`` in ``config``, or None where the path leaves it."""
  node = config
  for key in path:
    if not (hasattr(node, "keys") and key in node):
      return None
    node = node[key]
  return node


def _scheme_of(node) -> str | None:
  """The registered scheme name of ``node`` when it is a scheme config (a mapping whose
  ``name`` is a registered scheme: ``model.scheme``, ``model.segment``, ...), else None."""
  name = node.get("name") if hasattr(node, "keys") and hasattr(node, "get") else None
  if not isinstance(name, str):
    return None
  from posenc_jax.schemes.registry import SCHEMES  # noqa: PLC0415 - flax, only when needed
  return name if name in SCHEMES else None


def _typed_default(scheme: str, field: str) -> Any:
  """The default of hyperparameter ``field`` of ``scheme``, or for a None default a typed
  ``ml_collections`` placeholder (its annotation's type; a sequence: tuple), so that absl
  parses an override of it as the scheme's type."""
  import typing  # noqa: PLC0415

  from ml_collections import config_dict  # noqa: PLC0415

  from posenc_jax.schemes.registry import SCHEMES  # noqa: PLC0415

  spec = SCHEMES[scheme]
  default = spec.values({})[field]
  if default is not None:
    return tuple(default) if isinstance(default, list) else default
  hint = typing.get_type_hints(spec.module)[field]
  kind = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
  kind = typing.get_origin(kind) or kind
  if isinstance(kind, type) and issubclass(kind, Sequence) and kind is not str:
    kind = tuple
  return config_dict.placeholder(kind if isinstance(kind, type) else object)


def ready_scheme_fields(config, argv: Sequence[str], name: str) -> None:
  """Readies every scheme config of ``config`` (:func:`_scheme_of`) for the
  ``--<name>.<path to it>.<field>=`` overrides in ``argv``, so that each documented
  hyperparameter of the scheme can be set alone, with its type:

  * ``.name=<scheme>`` naming another registered scheme starts that scheme afresh
    (``{"name": <scheme>}``: the old scheme's fields go, whatever the order of the flags);
  * each hyperparameter of the (new) scheme that an override sets and the config lacks is
    added with its default (:func:`_typed_default`), which absl then parses the value by.

  A field the scheme does not have is left out: absl refuses it, and
  :func:`_unknown_override` names the scheme's fields."""
  from ml_collections import config_dict  # noqa: PLC0415

  if not isinstance(config, config_dict.ConfigDict):  # a file that failed to load
    return
  overrides = _overrides(argv, name)
  with config.unlocked():
    for path, value in overrides:
      slot = _node(config, path[:-1])
      if path[-1] == "name" and _scheme_of(slot) and _scheme_of({"name": value}) not in (
          None, slot["name"]):
        for key in [k for k in slot if k != "name"]:
          del slot[key]
        slot["name"] = value
    for path, _ in overrides:
      slot = _node(config, path[:-1])
      scheme = _scheme_of(slot)
      if scheme and path[-1] not in slot:
        from posenc_jax.schemes.registry import SCHEMES  # noqa: PLC0415
        if path[-1] in SCHEMES[scheme].fields:
          slot[path[-1]] = _typed_default(scheme, path[-1])


def _unknown_override(config, argv: Sequence[str], name: str) -> str | None:
  """The first ``--<name>.a.b=`` override whose path ``config`` lacks, as an error line; in a
  scheme config, the line names the scheme's fields."""
  for path, _ in _overrides(argv, name):
    node = config
    for depth, key in enumerate(path):
      keys = list(node.keys()) if hasattr(node, "keys") else []
      if key not in keys:
        field = ".".join([name, *path[:depth + 1]])
        where = ".".join([name, *path[:depth]])
        scheme = _scheme_of(node)
        if scheme:
          from posenc_jax.schemes.registry import SCHEMES  # noqa: PLC0415
          named = [v for p, v in _overrides(argv, name) if p == [*path[:depth], "name"]]
          if named and named[-1] != scheme:  # an unknown scheme (a known one was readied)
            return (f"{where}.name: scheme {named[-1]!r} is unknown"
                    f"{nearest(named[-1], SCHEMES)} allowed: {', '.join(sorted(SCHEMES))}")
          keys = ["name", *SCHEMES[scheme].fields]
          where = f"scheme {scheme!r} ({where})"
        return (f"{field}: unknown field{nearest(key, keys)} fields of {where}: "
                f"{', '.join(sorted(map(str, keys))) or 'none'}")
      node = node[key]
  return None


def _given_config(argv: Sequence[str], config_flag: str | None) -> str | None:
  """The value of ``--<config_flag>=`` in ``argv``, if any."""
  if config_flag is None:
    return None
  return next((a.partition("=")[2] for a in argv if a.startswith(f"--{config_flag}=")), None)


def _config_file(argv: Sequence[str], config_flag: str | None):
  """The config file of ``--<config_flag>=`` in ``argv`` without the overrides (its scheme
  configs readied for them: :func:`ready_scheme_fields`), or None when there is none or it
  fails to load."""
  given = _given_config(argv, config_flag)
  if not given:
    return None
  from ml_collections.config_flags import config_flags  # noqa: PLC0415
  try:
    config = config_flags.ConfigFileFlagParser(config_flag, lock_config=False).parse(given)
    config.keys()
  except Exception:  # noqa: BLE001 - a config that fails to load has no defaults to show
    return None
  ready_scheme_fields(config, argv, config_flag)
  return config


def describe_flag_error(error: BaseException, argv: Sequence[str], fv: flags.FlagValues,
                        config_flag: str | None) -> str:
  """One line for an error raised while parsing ``argv``."""
  root = _root(error)
  given = _given_config(argv, config_flag)
  config = _config_file(argv, config_flag)
  if config is not None:
    line = _unknown_override(config, argv, config_flag)
    if line:
      return line
  if isinstance(root, OSError) and "config file" in str(root):
    reason = str(root).strip().splitlines()[-1].strip()
    return f"{config_flag}: {given!r} does not load: {reason}"
  if isinstance(error, flags.Error) and root is not error and "config file" in str(error):
    line = first_line(root)  # raised inside the config file's get_config
    return line if line.startswith(config_flag) else f"{config_flag}: {line}"
  text = first_line(error).removeprefix("flag ")
  reason = first_line(error.__context__) if error.__context__ is not None else ""
  if isinstance(error, flags.IllegalFlagValueError) and reason.startswith("got "):
    # The flag's parser named what was given: ``--<flag>: got ...``, the value said once.
    return f"{text.partition('=')[0]}: {reason}"
  return text


PACKAGED_CONFIGS = os.path.join(os.path.dirname(__file__), "configs")


def config_path(spec: str) -> str:
  """``<path>[:<arg>]`` with ``<path>`` a config file: as given when it exists; else, for
  ``configs/<file>.py``, ``<file>.py`` or ``<file>``, the config shipped in
  ``posenc_jax/configs`` (so they work from any folder after ``pip install``); else as given
  (the loader then names the missing file)."""
  path, colon, arg = spec.partition(":")
  folder, name = os.path.split(path)
  if os.path.isfile(path) or folder not in ("", "configs") or not name:
    return spec
  packaged = os.path.join(PACKAGED_CONFIGS, name if name.endswith(".py") else f"{name}.py")
  return f"{packaged}{colon}{arg}" if os.path.isfile(packaged) else spec


def _with_config_path(argv: Sequence[str], name: str) -> list[str]:
  """``argv`` with the value of ``--<name>=<spec>`` (or ``--<name> <spec>``) resolved by
  :func:`config_path`."""
  out = list(argv)
  for i, arg in enumerate(out):
    if arg.startswith(f"--{name}="):
      out[i] = f"--{name}={config_path(arg.partition('=')[2])}"
    elif arg == f"--{name}" and i + 1 < len(out):
      out[i + 1] = config_path(out[i + 1])
  return out


def define_config(name: str, default: str | None, help_text: str):
  """``config_flags.DEFINE_config_file`` whose default is loaded at parse time, not import
  time (where absl would turn a bad ``--<name>.<field>`` into a traceback): a missing
  ``--<name>=`` is added to ``sys.argv`` before the flag is defined."""
  from ml_collections import config_flags  # noqa: PLC0415

  given = any(a == f"--{name}" or a.startswith(f"--{name}=") for a in sys.argv)
  if default is not None and not given:
    sys.argv.insert(1, f"--{name}={default}")
  return config_flags.DEFINE_config_file(name, None, f"{help_text} (default: {default})")


class _ListParser(flags.ArgumentParser):
  """absl's parser of ``--<config>.<field>=`` for a list field (``sweep.seeds``): a
  comma-separated list (``1,2,3``) or a list or tuple literal (``(1, 2, 3)``), each element a
  Python literal or else a bare string; an empty element or a malformed literal is one
  ``ValueError`` line. The elements' own rules are the config's validation's."""

  def parse(self, argument: Any) -> list:
    if isinstance(argument, (list, tuple)):
      return list(argument)
    text = str(argument).strip()
    if text[:1] in "([":
      try:
        value = ast.literal_eval(text)
      except (SyntaxError, ValueError):
        value = None
      if not isinstance(value, (list, tuple)):
        raise ValueError(f"{text!r} is not a list; allowed: 1,2,3 or (1, 2, 3)")
      return list(value)
    elements = [e.strip() for e in text.split(",")]
    if "" in elements:
      raise ValueError(f"{text!r} has an empty element; allowed: 1,2,3 or (1, 2, 3)")
    return [literal(e) for e in elements]

  def flag_type(self) -> str:
    return "list"


def literal(text: str) -> Any:
  """``text`` as a Python literal (``3``, ``1e-3``, ``'a'``), or as it is (a bare word)."""
  try:
    return ast.literal_eval(text)
  except (SyntaxError, ValueError):
    return text


class _ReadiedConfigParser:
  """A config flag's file parser whose config is readied for the scheme-field overrides in
  ``argv`` (:func:`ready_scheme_fields`) before absl defines a flag for each override."""

  def __init__(self, inner: flags.ArgumentParser, name: str, argv: Sequence[str]):
    self.inner, self.name, self.argv = inner, name, list(argv)

  def parse(self, argument: str):
    config = self.inner.parse(argument)
    ready_scheme_fields(config, self.argv, self.name)
    return config

  def __getattr__(self, attr: str) -> Any:
    return getattr(self.inner, attr)


def _ready_config_flag(fv: flags.FlagValues, name: str, argv: Sequence[str]) -> None:
  """Makes ``fv[name]`` (a config flag) parse its overrides in ``argv`` this module's way: a
  scheme's hyperparameters one by one (:class:`_ReadiedConfigParser`) and list fields
  (:class:`_ListParser`, registered with ``ml_collections`` for ``list``)."""
  from ml_collections.config_flags import config_flags  # noqa: PLC0415

  config_flags.register_flag_parser_for_type(list, _ListParser())
  if name in fv:
    flag = fv[name]
    flag.parser = _ReadiedConfigParser(getattr(flag.parser, "inner", flag.parser), name, argv)


HELP_FLAGS = ("--help", "--helpshort", "-?", "-h")


def flags_parser(prog: str, config_flag: str | None = "config",
                 fv: flags.FlagValues | None = None,
                 help: Callable[[Any, flags.FlagValues], str] | None = None  # noqa: A002
                 ) -> Callable[[list[str]], list[str]]:
  """An absl ``flags_parser``: parses ``argv`` into ``fv`` (default ``flags.FLAGS``) and exits
  with ``<prog>: <one line>`` on any error, including a config that fails to load.

  With ``help``, ``--help`` (``--helpshort``, ``-?``, ``-h``) prints ``help(config, fv)``
  (``config``: the ``--<config_flag>`` given, loaded without its overrides, or None; e.g.
  :func:`posenc_jax.usage.helper`) and exits with status 0; ``--helpfull`` stays absl's
  list of every flag."""
  fv = flags.FLAGS if fv is None else fv

  def parse(argv: list[str]) -> list[str]:
    if config_flag is not None:
      argv = _with_config_path(argv, config_flag)
      _ready_config_flag(fv, config_flag, argv)
    if help is not None and any(a in HELP_FLAGS for a in argv[1:]):
      print(help(_config_file(argv, config_flag), fv))
      sys.exit(0)
    try:
      rest = fv(argv)
      if config_flag is not None and fv[config_flag].value is not None:
        fv[config_flag].value.keys()  # a file that failed to load raises here
    except (flags.Error, AttributeError, KeyError, OSError, ValueError, TypeError) as e:
      sys.exit(f"{prog}: {describe_flag_error(e, argv, fv, config_flag)}")
    return rest

  return parse


# The exit status of a command whose reader closed the pipe (``compare --dry_run | head``):
# 128 + SIGPIPE, what a shell reports for a Unix tool the signal ended (``yes | head``).
CLOSED_PIPE_STATUS = 128 + signal.SIGPIPE


def _open_closed_streams() -> None:
  """A process started with stdout or stderr closed (``>&-``) gets /dev/null there: its
  output goes nowhere, as it asked, and no file the process opens next takes the descriptor
  (a child, a checkpoint or a log would then receive the output)."""
  for fd, name in ((1, "stdout"), (2, "stderr")):
    try:
      os.fstat(fd)
    except OSError:
      null = os.open(os.devnull, os.O_WRONLY)
      if null != fd:
        os.dup2(null, fd)
        os.close(null)
      setattr(sys, name, open(fd, "w", closefd=False))  # noqa: SIM115 - the process's own


def run_command(main: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
  """Runs a command line, ``main(*args, **kwargs)`` (``app.run(main, flags_parser=...)``, or an
  ``argparse`` tool's ``main(argv)``), as Unix tools run: when the reader of its output closes
  the pipe early (``| head``), it ends quietly with :data:`CLOSED_PIPE_STATUS`, no traceback
  and nothing more written; a closed stdout or stderr (``>&-``) is /dev/null. Every entry
  point's ``__main__`` goes through it. Returns what ``main`` returns; its ``SystemExit`` (a
  one-line error, or absl's exit) passes through."""
  _open_closed_streams()
  try:
    try:
      return main(*args, **kwargs)
    finally:
      sys.stdout.flush()  # output still buffered meets a closed pipe here, not at exit
  except BrokenPipeError:
    # Python flushes stdout once more at exit: into /dev/null, so that it says nothing.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    sys.exit(CLOSED_PIPE_STATUS)


def exit_with(prog: str, error: BaseException) -> NoReturn:
  """Ends the process with ``<prog>: <error>`` as its last line on stderr (exit status 1).

  An error whose class sets ``abandon_threads`` (a failed background checkpoint write)
  ends it at once: with several processes, Orbax's save threads would otherwise wait
  minutes for signals that never come before the interpreter may exit (one process
  releases them itself).
  """
  print(f"{prog}: {error}", file=sys.stderr, flush=True)
  sys.stdout.flush()
  if getattr(error, "abandon_threads", False):
    os._exit(1)
  sys.exit(1)


class _OneLineLibraryErrors(logging.Filter):
  """Drops the traceback of Orbax's log records (their message line stays)."""

  def filter(self, record: logging.LogRecord) -> bool:
    if f"{os.sep}orbax{os.sep}" in record.pathname:
      record.exc_info, record.exc_text, record.stack_info = None, None, None
    return True


def quiet_library_tracebacks() -> None:
  """Orbax logs a traceback for each failed background write; entry points keep its one-line
  messages and stop with their own line."""
  logging.getLogger("absl").addFilter(_OneLineLibraryErrors())


class _InapplicableNotices(logging.Filter):
  """Drops library warnings whose advice does not apply to this project's runs: seqio's
  "Using an uncached FunctionDataset for training" (the bundled tasks are in memory, and a
  resumed run restores its input iterator's state, so restarts do not reshuffle)."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not (f"{os.sep}seqio{os.sep}" in record.pathname
                and str(record.msg).startswith("Using an uncached FunctionDataset"))


def quiet_library_notices() -> None:
  """Entry points that read seqio tasks drop its warnings that ask the user for nothing
  (:class:`_InapplicableNotices`); every other warning and error still prints."""
  logging.getLogger("absl").addFilter(_InapplicableNotices())


# TensorFlow's start-up lines that ask nothing of the user (it only feeds input, on the CPU):
# absl's notice that logging is not initialised, INFO lines (oneDNN, "Could not find cuda
# drivers", logged before TF_CPP_MIN_LOG_LEVEL applies) and a failed cuInit on a machine
# without a usable GPU (JAX reports its own devices).
_TF_START_NOISE = re.compile(r"WARNING: All log messages before absl::InitializeLog\(\)|"
                             r"I\d{4} |E\d{4} .*failed call to cuInit")


def start_tensorflow_quietly() -> None:
  """Imports TensorFlow and hides the GPUs from it (its input pipelines run on the CPU and
  leave the accelerators' memory to JAX), with the process's stderr captured meanwhile: the
  captured lines are written back, except TensorFlow's start-up notices (``_TF_START_NOISE``),
  also when starting fails (the error is then raised).

  TensorFlow then logs errors only (``TF_CPP_MIN_LOG_LEVEL=2``, hiding e.g. the warning that
  an iterator of a cached dataset stopped within its first epoch, as every run shorter than
  an epoch does) unless the user chose a level: JAX's import sets 1 where it is unset, so 1
  counts as unset; any other value is kept. Call it before anything imports TensorFlow."""
  if os.environ.get("TF_CPP_MIN_LOG_LEVEL", "1") == "1":
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as captured:
    os.dup2(captured.fileno(), 2)
    try:
      import tensorflow as tf  # noqa: PLC0415

      tf.config.set_visible_devices([], "GPU")
    finally:
      os.dup2(saved, 2)
      os.close(saved)
      captured.seek(0)
      text = captured.read().decode(errors="replace")
      sys.stderr.write("".join(line for line in text.splitlines(keepends=True)
                               if not _TF_START_NOISE.match(line)))
      sys.stderr.flush()


class ArgumentParser(argparse.ArgumentParser):
  """An ``argparse.ArgumentParser`` whose every error is one line ``<prog>: <flag>: ...`` on
  stderr and exit status 2 (no usage block); an unknown flag names the nearest defined one."""

  def parse_args(self, args=None, namespace=None):
    parsed, extra = self.parse_known_args(args, namespace)
    if extra:
      given = extra[0].partition("=")[0]
      if not given.startswith("-"):
        self.error(f"unexpected argument {extra[0]!r}")
      options = sorted(o for a in self._actions for o in a.option_strings if o.startswith("--"))
      self.error(f"{given}: unknown flag{nearest(given, options)} allowed: {', '.join(options)}")
    return parsed

  def error(self, message):
    self.exit(2, f"{self.prog}: {message.removeprefix('argument ')}\n")


def positive_int(text: str) -> int:
  """An ``argparse`` type: an integer > 0; anything else is an error naming what was given."""
  try:
    value = int(text)
  except ValueError:
    value = None
  if value is None or value <= 0:
    given = text if value is not None else repr(text)
    raise argparse.ArgumentTypeError(f"got {given}; allowed: a positive integer")
  return value


def one_of(allowed: Sequence[str], sep: str | None = None) -> Callable[[str], Any]:
  """An ``argparse`` type: a name in ``allowed``, or with ``sep`` a non-empty ``sep``-separated
  list of them (returned as a tuple). An unknown or empty name is an error naming it, the
  nearest allowed name and all of them."""
  allowed = tuple(allowed)

  def parse(text: str) -> Any:
    names = text.split(sep) if sep else [text]
    for name in names:
      if name not in allowed:
        where = f" in {text!r}" if len(names) > 1 else ""
        raise argparse.ArgumentTypeError(f"got {name!r}{where}{nearest(name, allowed)} allowed: "
                                         f"{', '.join(allowed)}")
    return tuple(names) if sep else text

  return parse
