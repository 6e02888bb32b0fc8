"""Measured crossovers of the fused route: when a batch-free term is cheaper materialised.

The fused route (:func:`posenc_jax.attend`) can run two term forms two ways:

* ``toeplitz`` (DIET-REL, T5, ALiBi, TUPE-R's relative part): the Pallas kernel builds
  each tile from the ``[H, Lq+Lk-1]`` offset vector (the default), or the term is
  materialised once per call as ``[1, H, Lq, Lk]`` and given to
  :func:`jax.nn.dot_product_attention` as a bias (cuDNN where it fits).
* ``factored`` (DIET-ABS, TUPE-A, per-head segments) of rank ``r``: folded into q/k, so
  every ``q.k`` is ``D + r`` wide (the default), or materialised as a ``[1, H, Lq, Lk]``
  bias with ``q.k`` ``D`` wide.

Which is faster depends on the device, the length and the rank: on an H100 a
materialised bias for cuDNN can beat the kernel at short lengths, never at long ones
(``../shared/gpu/RESULTS-2026-11-23.md``). So the choice is read from measurements,
not a rule. A point is one ``python -m posenc_jax.benchmarks.routes`` run: forward+backward
milliseconds of both ways at one shape, on one device kind and dtype. For a call the
route takes the way that was faster at the nearest point of its device kind, dtype and
form (nearest in ``log2`` length, and for factored terms in ``log2`` folded width ``D +
r``); with no point it keeps the default. A device kind without points of its own reads
those of a kind of the same compute capability (each point records its device's): an
``NVIDIA GH200 480GB`` takes the ``NVIDIA H100 80GB HBM3``'s, both 9.0, until it has its own
(:meth:`RouteTable.whose`; ``print(plan)`` names the kind whose points it read). Only
batch-free terms qualify (per-example terms, position ids and decoding steps stay as they
are), and only without attention dropout or packed segments (which the kernel takes and
cuDNN does not).

Points come from the packaged ``route_table.json`` (measured figures only: an H100 in
bfloat16 at L = 512 and 16384, 2026-11-25, and an H200 at L = 512 and 8192 with the closed
forms' times, 2026-11-28), overlaid by the file that
``$POSENC_JAX_ROUTE_TABLE`` names (a point of the same device, dtype, form and shape
replaces the packaged one; a file that is missing or malformed is one
:class:`RouteTableError` line naming the variable and the file, which the tools print before
any work). Fill that file on your device with::

  POSENC_JAX_ROUTE_TABLE=~/routes.json  # in the environment of training too
  python -m posenc_jax.benchmarks.routes --dtype bfloat16 --batch 32 --length 512 \\
      --rank 128 --route_table ~/routes.json
  python -m posenc_jax.benchmarks.routes --dtype bfloat16 --batch 1 --length 16384 \\
      --rank 128 --route_table ~/routes.json

A :class:`RouteTable` is a value: the points and the ways forced over them. The route plan
(:func:`posenc_jax.route_plan.plan`) is given one and reads nothing else;
:func:`posenc_jax.attend` hands it :func:`current` (read once per call, at trace time).
:func:`using` sets the table inside a ``with`` block and :func:`forced` forces ways over the
current one (the routes benchmark times each way with it; tests use it to run each way on
any device).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import json
import math
import os
import pathlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import jax

from posenc_jax.kernels.blocks import gpu_compute_capability
from posenc_jax import foreign
from posenc_jax.paths import write_atomic

FORMS = ("toeplitz", "factored")
FORMAT = 1
ENV = "POSENC_JAX_ROUTE_TABLE"
PACKAGED = pathlib.Path(__file__).with_name("route_table.json")
# The benchmarks.routes rows a point compares, per form: (default way, materialised ways in order
# of preference: the first that ran is the one the route would take).
BENCH_ROWS = {"toeplitz": ("pallas toeplitz", ("cudnn bias", "xla bias")),
              "factored": ("fused factored folded", ("fused factored materialised",))}
# The benchmarks.routes rows of the Toeplitz kernel with the Hopper forward, and with the Hopper
# forward and backward: the faster that ran is a third way.
HOPPER_ROW = "pallas toeplitz hopper fwd"
HOPPER_BOTH_ROW = "pallas toeplitz hopper"
HOPPER_WAYS = (False, True, "both")  # forced(hopper=...): Triton, Hopper forward, both passes
# The benchmarks.routes row of each closed form in the Triton tiles (``CLOSED_ROW.format(name)``,
# ``name`` an offset function's ``closed_form``): a fourth way, for that closed form alone.
CLOSED_ROW = "pallas {} closed"


class RouteTableError(ValueError):
  """The file ``$POSENC_JAX_ROUTE_TABLE`` names is missing or is no route table: one line
  naming the variable and the file."""


class Point(NamedTuple):
  """One measured shape: forward+backward ms of the default way and of the materialised one.

  ``rank`` is 0 for Toeplitz terms. ``source`` says where the figures come from.
  ``hopper_ms``: Toeplitz only, where measured: the kernel with its Hopper forward
  (:mod:`posenc_jax.kernels.hopper_flash`), and with ``hopper_backward`` its Hopper backward
  too (whichever of the two was faster), else None. ``closed_ms``: Toeplitz only, ``(name,
  ms)`` pairs of the closed forms measured in the Triton tiles (``alibi``, ``kerple_log``: an
  offset function's ``closed_form``; a JSON object in the file), a way for that closed form
  alone. ``compute_capability``: the device's CUDA compute capability (``"9.0"``), None
  where it has none or it was not recorded.
  """

  device: str
  dtype: str
  form: str
  batch: int
  length: int
  heads: int
  head_dim: int
  rank: int
  default_ms: float
  materialised_ms: float
  source: str = ""
  hopper_ms: float | None = None
  hopper_backward: bool = False
  compute_capability: str | None = None
  closed_ms: tuple[tuple[str, float], ...] = ()

  @property
  def key(self) -> tuple:
    return self[:8]

  def fastest(self, closed: str | None = None) -> str:
    """The fastest way: ``default``, ``materialised``, ``hopper``, or ``closed`` where the
    term is the closed form named ``closed`` and this point measured it."""
    ways = {"default": self.default_ms, "materialised": self.materialised_ms,
            "hopper": self.hopper_ms, "closed": dict(self.closed_ms).get(closed)}
    return min((ms, way) for way, ms in ways.items() if ms is not None)[1]


_POSITIVE_INTS = ("batch", "length", "heads", "head_dim")


def parse_point(entry: Any, where: str) -> Point:
  """A :class:`Point` from its JSON object; one ValueError line naming ``where`` and the
  field otherwise."""
  if not isinstance(entry, Mapping):
    raise ValueError(f"{where}: got {type(entry).__name__}; expected an object")
  missing = [f for f in Point._fields if f not in entry and f not in Point._field_defaults]
  unknown = sorted(set(entry) - set(Point._fields))
  if missing or unknown:
    raise ValueError(f"{where}: {'missing ' + ', '.join(missing) if missing else ''}"
                     f"{'; ' if missing and unknown else ''}"
                     f"{'unknown field ' + ', '.join(unknown) if unknown else ''}")
  for field in ("device", "dtype", "source", "compute_capability"):
    value = entry.get(field, "")
    if not isinstance(value, str) and not (field == "compute_capability" and value is None):
      raise ValueError(f"{where}.{field}: got {value!r}; expected a string")
  if entry["form"] not in FORMS:
    raise ValueError(f"{where}.form: got {entry['form']!r}; allowed: {', '.join(FORMS)}")
  for field in (*_POSITIVE_INTS, "rank"):
    value = entry[field]
    if not isinstance(value, int) or isinstance(value, bool) or value < (field != "rank"):
      raise ValueError(f"{where}.{field}: got {value!r}; expected a "
                       f"{'positive' if field != 'rank' else 'non-negative'} integer")
  if not isinstance(entry.get("hopper_backward", False), bool) or (
      entry.get("hopper_backward") and entry.get("hopper_ms") is None):
    raise ValueError(f"{where}.hopper_backward: got {entry['hopper_backward']!r}; expected "
                     "true or false, true only with hopper_ms")
  if entry.get("hopper_ms") is not None and entry["form"] != "toeplitz":
    raise ValueError(f"{where}.hopper_ms: got {entry['hopper_ms']!r} for a {entry['form']} "
                     "term; only toeplitz terms have a Hopper way")
  closed = entry.get("closed_ms", {})
  if not isinstance(closed, Mapping) or closed and entry["form"] != "toeplitz":
    raise ValueError(f"{where}.closed_ms: got {closed!r}; expected an object of closed forms' "
                     "ms (alibi, kerple_log...), for a toeplitz term only")
  for field, value in (("default_ms", entry.get("default_ms")),
                       ("materialised_ms", entry.get("materialised_ms")),
                       ("hopper_ms", entry.get("hopper_ms")),
                       *((f"closed_ms.{name}", ms) for name, ms in closed.items())):
    if field == "hopper_ms" and value is None:
      continue
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (
        math.isfinite(value) and value > 0):
      raise ValueError(f"{where}.{field}: got {value!r}; expected a positive number of ms")
  return Point(**{**entry, "closed_ms": tuple(sorted(closed.items()))})


def read(path: str | os.PathLike) -> list[Point]:
  """The points of a table file (``{"format": 1, "points": [...]}``); a missing file has
  none. A malformed one is one ValueError line naming the file and the field."""
  path = pathlib.Path(path).expanduser()
  if not path.exists():
    return []
  try:
    document = foreign.loads(path.read_text())
  except (OSError, ValueError) as e:
    raise ValueError(f"route table {path}: not readable JSON ({e})") from None
  if not isinstance(document, Mapping) or document.get("format") != FORMAT:
    raise ValueError(f"route table {path}: expected an object with \"format\": {FORMAT}")
  entries = document.get("points")
  if not isinstance(entries, list):
    raise ValueError(f"route table {path}: points: expected a list")
  return [parse_point(entry, f"route table {path}: points[{i}]")
          for i, entry in enumerate(entries)]


def merged(points: Iterable[Point], overlay: Iterable[Point]) -> list[Point]:
  """``points`` with each point of ``overlay`` replacing the one of the same key (device,
  dtype, form and shape) or added."""
  table = {p.key: p for p in points}
  table.update((p.key, p) for p in overlay)
  return list(table.values())


def write(path: str | os.PathLike, points: Iterable[Point]) -> list[Point]:
  """Adds ``points`` to the table file at ``path`` (created if missing; same keys
  replaced), written atomically; returns the file's points."""
  path = pathlib.Path(path).expanduser()
  table = merged(read(path), points)
  document = {"format": FORMAT, "points": [
      {f: dict(x) if f == "closed_ms" else x for f, x in p._asdict().items()
       if not (f in ("hopper_ms", "compute_capability") and x is None
               or f in ("hopper_backward", "closed_ms") and not x)}
      for p in sorted(table, key=lambda p: p.key)]}
  write_atomic(path, json.dumps(document, indent=2) + "\n")
  return table


_LOADED: dict[tuple, list[Point]] = {}


def _stamp(path: pathlib.Path) -> tuple:
  try:
    stat = path.stat()
    return (str(path), stat.st_mtime_ns, stat.st_size)
  except OSError:
    return (str(path), None, None)


def _read_environment(path: pathlib.Path) -> list[Point]:
  """The points of the file ``$POSENC_JAX_ROUTE_TABLE`` names, which must exist."""
  if not path.is_file():
    what = "is a folder" if path.is_dir() else "does not exist"
    raise RouteTableError(f"{ENV}: {path} {what}; allowed: a route table file (python -m "
                          f"posenc_jax.benchmarks.routes ... --route_table {path} makes one), "
                          "or the variable unset for the packaged points")
  try:
    return read(path)
  except ValueError as e:
    raise RouteTableError(f"{ENV}: {e}") from None


def points() -> list[Point]:
  """The packaged points overlaid by ``$POSENC_JAX_ROUTE_TABLE``'s (re-read when either
  file changes). Entry points call it before any work, so that a bad file stops them first.

  Raises:
    RouteTableError: the variable names a file that does not exist, or a malformed one.
  """
  files = [PACKAGED] + ([pathlib.Path(os.environ[ENV]).expanduser()]
                        if os.environ.get(ENV) else [])
  stamp = tuple(_stamp(f) for f in files)
  if stamp not in _LOADED:
    table = read(PACKAGED)
    for f in files[1:]:
      table = merged(table, _read_environment(f))
    _LOADED.clear()
    _LOADED[stamp] = table
  return _LOADED[stamp]


def _check_ways(ways: Mapping[str, Any]) -> None:
  allowed = (*FORMS, "hopper")
  unknown = sorted(set(ways) - set(allowed))
  if unknown:
    raise ValueError(f"route_table.forced: {', '.join(unknown)}: allowed: {', '.join(allowed)}")
  if ways.get("hopper") not in (None, *HOPPER_WAYS):
    raise ValueError(f"route_table.forced: hopper: got {ways['hopper']!r}; allowed: None, "
                     "False, True, 'both'")


@dataclasses.dataclass(frozen=True)
class RouteTable:
  """The measured points a route plan reads (:func:`posenc_jax.route_plan.plan`), and the
  ways forced over them: a value, passed to the plan, never consulted behind its back.

  Attributes:
    points: the :class:`Point` s.
    forced: ``(name, way)`` pairs that override the points: ``toeplitz`` / ``factored``
      True materialises that form, False keeps the default way; ``hopper`` False, True or
      ``"both"`` (:data:`HOPPER_WAYS`) runs the Toeplitz kernel's passes on Triton, its
      forward on the Hopper kernel, or both passes there.
  """

  points: tuple[Point, ...] = ()
  forced: tuple[tuple[str, bool | str], ...] = ()

  def forcing(self, **ways: bool | str | None) -> RouteTable:
    """This table with ``ways`` forced over it (None: ask the points again)."""
    _check_ways(ways)
    merged_ways = {**dict(self.forced), **ways}
    return dataclasses.replace(
        self, forced=tuple((k, w) for k, w in merged_ways.items() if w is not None))

  def whose(self, device: str, compute_capability: str | None = None) -> str | None:
    """The device kind whose points ``device`` (a kind) reads: its own where it has any,
    else, given its ``compute_capability``, the kind with the most points among those of
    the same compute capability (a tie: the first by name); None where there is none."""
    counts = collections.Counter(p.device for p in self.points)
    if device in counts or compute_capability is None:
      return device if device in counts else None
    same = {p.device for p in self.points if p.compute_capability == compute_capability}
    return min(same, key=lambda kind: (-counts[kind], kind), default=None)

  def nearest(self, form: str, *, dtype: str, length: float, head_dim: int, device: str,
              rank: int = 0, compute_capability: str | None = None) -> Point | None:
    """The point of the device kind that ``device`` reads (:meth:`whose`), dtype and form
    nearest to the shape (``log2`` length, plus ``log2`` folded width for factored terms; a
    tie goes to the longer length), or None. Arguments as :meth:`materialise`'s."""
    device = self.whose(device, compute_capability)
    same = [p for p in self.points if (p.device, p.dtype, p.form) == (device, dtype, form)]
    if not same:
      return None

    def distance(p: Point) -> tuple[float, int]:
      d = abs(math.log2(p.length / length))
      if form == "factored":
        d += abs(math.log2((p.head_dim + p.rank) / (head_dim + rank)))
      return d, -p.length

    return min(same, key=distance)

  def materialise(self, form: str, *, dtype: str, length: float, head_dim: int, device: str,
                  rank: int = 0, compute_capability: str | None = None,
                  closed: str | None = None) -> bool:
    """Whether the fused route materialises a batch-free ``form`` term at this shape.

    Args:
      form: ``toeplitz`` or ``factored``.
      dtype: the compute dtype's name (``bfloat16``...).
      length: ``sqrt(Lq Lk)``.
      head_dim: D before folding; ``rank``: the factored term's ``r`` (0 for Toeplitz).
      device: the device kind (``NVIDIA H100 80GB HBM3``...); ``compute_capability``: its
        CUDA compute capability (``"9.0"``; None: none), whose points it reads without
        points of its own (:meth:`whose`).
      closed: the name of the closed form the tiles would evaluate for this term (its
        measured cost is then a way too: :meth:`Point.fastest`), else None.

    Returns:
      The forced way where ``form`` is forced, else that of the nearest point of the same
      device (or the kind it reads), dtype and form, else False.
    """
    way = dict(self.forced).get(form)
    if way is not None:
      return way
    point = self.nearest(form, dtype=dtype, length=length, head_dim=head_dim, rank=rank,
                         device=device, compute_capability=compute_capability)
    return point is not None and point.fastest(closed) == "materialised"

  def hopper_way(self, *, dtype: str, length: float, head_dim: int, device: str,
                 compute_capability: str | None = None,
                 closed: str | None = None) -> bool | str:
    """Which passes of the fused route's Toeplitz kernel run on Hopper kernels: False
    (none), True (the forward) or ``"both"`` (forward and backward). The forced ``hopper``
    way, else the Hopper way of the nearest Toeplitz point (as :meth:`materialise`, with
    the closed form ``closed`` as a way where it measured it) where it was the fastest way,
    else False."""
    way = dict(self.forced).get("hopper")
    if way is not None:
      return way
    point = self.nearest("toeplitz", dtype=dtype, length=length, head_dim=head_dim,
                         device=device, compute_capability=compute_capability)
    if point is None or point.fastest(closed) != "hopper":
      return False
    return "both" if point.hopper_backward else True


_ACTIVE: contextvars.ContextVar[RouteTable | None] = contextvars.ContextVar(
    "posenc_jax_route_table", default=None)


def current() -> RouteTable:
  """The table :func:`posenc_jax.attend` hands its route plan: the one :func:`using` (or
  :func:`forced`) set around the call, else :func:`points` (packaged, overlaid by
  ``$POSENC_JAX_ROUTE_TABLE``'s). Read once per call, when the call is traced."""
  active = _ACTIVE.get()
  return RouteTable(tuple(points())) if active is None else active


@contextlib.contextmanager
def using(table: RouteTable) -> Iterator[None]:
  """Inside the block, :func:`current` is ``table``. It applies when a function is traced:
  a function jitted (or traced) before the block keeps the route it was traced with."""
  token = _ACTIVE.set(table)
  try:
    yield
  finally:
    _ACTIVE.reset(token)


@contextlib.contextmanager
def forced(**ways: bool | str | None) -> Iterator[None]:
  """Inside the block, the current table with ``ways`` forced over it
  (:meth:`RouteTable.forcing`: ``toeplitz=`` / ``factored=`` True materialises that form,
  False keeps the default way, None asks the table; ``hopper=`` True runs the Toeplitz
  kernel's Hopper forward where it fits, ``"both"`` its Hopper forward and backward, False
  the Triton ones). Blocks nest; like :func:`using`, it applies at trace time."""
  _check_ways(ways)
  with using(current().forcing(**ways)):
    yield


def device_kind() -> str:
  """The first device's kind, e.g. ``NVIDIA H100 80GB HBM3`` (what points are keyed by)."""
  return jax.devices()[0].device_kind


def _asked(table: Iterable[Point] | None) -> RouteTable:
  """:func:`current`, or the given points under the current forced ways."""
  active = current()
  return active if table is None else dataclasses.replace(active, points=tuple(table))


def _device(device: str | None, compute_capability: str | None) -> dict[str, str | None]:
  """``device`` and ``compute_capability`` as given, or this device's where ``device`` is
  None."""
  if device is None:
    return {"device": device_kind(), "compute_capability":
            gpu_compute_capability() if jax.default_backend() == "gpu" else None}
  return {"device": device, "compute_capability": compute_capability}


def materialise(form: str, *, dtype: str, length: float, head_dim: int, rank: int = 0,
                device: str | None = None, compute_capability: str | None = None,
                closed: str | None = None, table: Iterable[Point] | None = None) -> bool:
  """:meth:`RouteTable.materialise` of the :func:`current` table (``table``: these points
  instead, under the current forced ways) on ``device`` of ``compute_capability`` (None:
  this device, :func:`device_kind`)."""
  return _asked(table).materialise(form, dtype=dtype, length=length, head_dim=head_dim,
                                   rank=rank, closed=closed,
                                   **_device(device, compute_capability))


def hopper_way(*, dtype: str, length: float, head_dim: int, device: str | None = None,
               compute_capability: str | None = None, closed: str | None = None,
               table: Iterable[Point] | None = None) -> bool | str:
  """:meth:`RouteTable.hopper_way` of the :func:`current` table, as :func:`materialise`."""
  return _asked(table).hopper_way(dtype=dtype, length=length, head_dim=head_dim,
                                  closed=closed, **_device(device, compute_capability))


def points_from_attention(document: Mapping[str, Any], source: str = "") -> tuple[
    list[Point], list[str]]:
  """The points one ``benchmarks.routes`` JSON document measured, and for each form it
  could not, a line saying why (a row that did not run)."""
  rows = {row["kernel"]: row for row in document["rows"]}
  prefix, suffix = CLOSED_ROW.split("{}")
  found, missing = [], []
  for form, (default, materialised) in BENCH_ROWS.items():
    if form == "factored" and not document.get("rank"):
      continue
    ran = lambda name: name in rows and rows[name].get("fwd_bwd_ms") is not None  # noqa: E731
    way = next((name for name in materialised if ran(name)), None)
    if not ran(default) or way is None:
      why = [f"{name}: {rows[name].get('fwd_bwd_na') if name in rows else 'not timed'}"
             for name in (default, *materialised) if not ran(name)]
      missing.append(f"{form}: no point ({'; '.join(why)})")
      continue
    # The faster Hopper row that ran: (ms, whether its backward is the Hopper one).
    hopper = min(((rows[name]["fwd_bwd_ms"], both)
                  for name, both in ((HOPPER_ROW, False), (HOPPER_BOTH_ROW, True))
                  if form == "toeplitz" and ran(name)), default=(None, False))
    closed = [(name[len(prefix):-len(suffix)], rows[name]["fwd_bwd_ms"]) for name in rows
              if form == "toeplitz" and name.startswith(prefix) and name.endswith(suffix)
              and ran(name)]
    found.append(Point(device=document["device"], dtype=document["dtype"], form=form,
                       batch=document["batch"], length=document["length"],
                       heads=document["heads"], head_dim=document["head_dim"],
                       rank=document.get("rank", 0) if form == "factored" else 0,
                       default_ms=rows[default]["fwd_bwd_ms"],
                       materialised_ms=rows[way]["fwd_bwd_ms"], hopper_ms=hopper[0],
                       hopper_backward=hopper[1], closed_ms=tuple(sorted(closed)),
                       compute_capability=document.get("compute_capability"),
                       source=source or f"bench --attention ({way})"))
  return found, missing
