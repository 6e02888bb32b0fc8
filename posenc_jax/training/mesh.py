"""The device mesh and the logical-axis rules that shard parameters and activations.

Every parameter carries logical axis names (``embed``, ``heads``, ``kv``,
``mlp``, ``vocab``, position-table axes ...). One table of rules maps them
to mesh axes (t5x style): the batch over ``data``; heads, MLP width and
vocabulary over ``model``; small position tables and everything else
replicated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "model")

LOGICAL_AXIS_RULES: tuple[tuple[str, str | None], ...] = (
    ("batch", "data"),
    ("vocab", "model"),
    ("heads", "model"),
    ("mlp", "model"),
    ("embed", None),
    ("kv", None),
    ("length", None),
)


class MeshConfigError(ValueError):
  """The mesh does not fit the devices, or the batch does not fit the mesh."""


def mesh_shape(shape: Sequence[int], num_devices: int) -> tuple[int, ...]:
  """Resolves one ``-1`` ("the rest") in ``shape`` and checks it uses all devices."""
  shape = tuple(int(s) for s in shape)
  if shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
    raise MeshConfigError(f"mesh.shape: {shape} must be positive sizes with at most one -1")
  known = math.prod(s for s in shape if s != -1)
  if num_devices % known:
    raise MeshConfigError(f"mesh.shape: {shape} does not divide the {num_devices} devices")
  shape = tuple(num_devices // known if s == -1 else s for s in shape)
  if math.prod(shape) != num_devices:
    raise MeshConfigError(f"mesh.shape: {shape} uses {math.prod(shape)} of the "
                          f"{num_devices} devices; use -1 for the rest")
  return shape


def make_mesh(shape: Sequence[int] = (-1, 1), axis_names: Sequence[str] = MESH_AXES,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A mesh over all (global) devices, e.g. ``(-1, 1)``: data parallel."""
  devices = jax.devices() if devices is None else list(devices)
  if len(shape) != len(axis_names):
    raise MeshConfigError(f"mesh.shape: {tuple(shape)} needs one size per axis "
                          f"{tuple(axis_names)}")
  shape = mesh_shape(shape, len(devices))
  return Mesh(np.asarray(devices).reshape(shape), tuple(axis_names))


def check_mesh_config(mesh_config: Any) -> None:
  """``mesh.axes`` are distinct and include ``data`` (the batch axis), ``mesh.shape`` has one
  size per axis, and every mesh axis the rules name exists."""
  axes = tuple(mesh_config.axes)
  if len(set(axes)) != len(axes) or "data" not in axes:
    raise MeshConfigError(f"mesh.axes: got {axes}; allowed: distinct names including 'data' "
                          "(the batch is sharded over it)")
  if len(tuple(mesh_config.shape)) != len(axes):
    raise MeshConfigError(f"mesh.shape: {tuple(mesh_config.shape)} needs one size per axis "
                          f"{axes}")
  for logical, target in rules(mesh_config):
    for name in target if isinstance(target, (tuple, list)) else (target,):
      if name is not None and name not in axes:
        raise MeshConfigError(f"mesh.rules: ({logical!r}, {target!r}) names mesh axis "
                              f"{name!r}, not in mesh.axes={axes}")


def check_batch(batch_size: int, mesh: Mesh, field: str = "batch_size") -> None:
  """The global batch must split evenly over the ``data`` axis and over the hosts."""
  data = mesh.shape["data"]
  if batch_size % data:
    raise MeshConfigError(f"{field}: {batch_size} is not divisible by the data axis ({data})")
  if batch_size % jax.process_count():
    raise MeshConfigError(f"{field}: {batch_size} is not divisible by the "
                          f"{jax.process_count()} hosts")


def rules(mesh_config: Any) -> tuple[tuple[str, Any], ...]:
  """``mesh_config.rules`` (pairs of logical axis, mesh axis) or the default table."""
  custom = mesh_config.get("rules") if hasattr(mesh_config, "get") else None
  return tuple(tuple(r) for r in custom) if custom else LOGICAL_AXIS_RULES


def shardings(abstract_boxed: Any, mesh: Mesh,
              rules: Sequence[tuple[str, Any]] = LOGICAL_AXIS_RULES) -> Any:
  """NamedShardings for a tree whose leaves may be ``nn.Partitioned`` boxes
  (unannotated leaves are replicated)."""
  specs = nn.get_partition_spec(abstract_boxed)
  return nn.logical_to_mesh_sharding(specs, mesh, rules)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Inputs ``[B, ...]``: the batch over ``data``, replicated over ``model``."""
  return NamedSharding(mesh, PartitionSpec("data"))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())
