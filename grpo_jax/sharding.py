"""Sharding in one place: the device mesh and the logical-axis rules.

Every parameter carries logical axis names (``vocab``, ``embed``, ``mlp``, ``heads``,
``kv_heads``, ``head_dim``, ``norm``; see ``grpo_jax.models.transformer``). ``RULES`` maps
them to mesh axes: FSDP over ``embed``, tensor parallelism over ``heads``/``mlp``/``vocab``.
Batches shard their leading (rollout) axis over ``("data", "fsdp")``. A dimension that does
not divide over its mesh axes stays replicated, so the same rules serve a tiny test model and
an 8B model.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis name -> mesh axis (or tuple of mesh axes, or None = replicated)
RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("norm", None),
)


def make_mesh(shape: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds the ``("data", "fsdp", "tensor")`` mesh.

    Args:
      shape: mesh axis sizes, e.g. ``{"data": 2, "fsdp": 2, "tensor": 2}``; a size of -1 for
        one axis takes the remaining devices.
      devices: the devices to use (default: all of ``jax.devices()``).

    Returns:
      A ``jax.sharding.Mesh`` with axes ``MESH_AXES``.

    Raises:
      ValueError: unknown axis names, or a product of sizes that does not equal the number of
        devices (the message names ``config.mesh`` and the device count).
    """
    devices = list(jax.devices() if devices is None else devices)
    unknown = set(shape) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"config.mesh has unknown axes {sorted(unknown)}; valid axes: {MESH_AXES}")
    sizes = [int(shape.get(a, 1)) for a in MESH_AXES]
    if sizes.count(-1) > 1:
        raise ValueError("config.mesh: at most one axis may be -1")
    if -1 in sizes:
        rest = math.prod(s for s in sizes if s != -1)
        sizes[sizes.index(-1)] = len(devices) // max(rest, 1)
    if math.prod(sizes) != len(devices):
        raise ValueError(
            f"config.mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices but "
            f"{len(devices)} are available; set config.mesh.data/fsdp/tensor so their product is "
            f"{len(devices)} (or -1 for one axis)."
        )
    return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES)


def _axis_size(mesh: Mesh, axes) -> int:
    if axes is None:
        return 1
    if isinstance(axes, str):
        axes = (axes,)
    return math.prod(mesh.shape[a] for a in axes)


def logical_to_spec(
    logical: Sequence[str | None],
    shape: Sequence[int],
    mesh: Mesh,
    rules: Sequence[tuple[str, Any]] = RULES,
) -> PartitionSpec:
    """Maps one array's logical axis names to a ``PartitionSpec`` on ``mesh``.

    A dimension is sharded only when its size divides by the mesh axes' size and those mesh
    axes are not already used by an earlier dimension; otherwise it is replicated.
    """
    table = dict(rules)
    used: set[str] = set()
    out = []
    for name, dim in zip(logical, shape):
        axes = table.get(name) if name is not None else None
        flat = (axes,) if isinstance(axes, str) else tuple(axes or ())
        flat = tuple(a for a in flat if a in mesh.shape and mesh.shape[a] > 1)
        if not flat or used & set(flat) or dim % _axis_size(mesh, flat) != 0:
            out.append(None)
            continue
        used |= set(flat)
        out.append(flat[0] if len(flat) == 1 else flat)
    return PartitionSpec(*out)


def param_shardings(
    abstract_params: Any, mesh: Mesh, rules: Sequence[tuple[str, Any]] = RULES
) -> Any:
    """``NamedSharding`` for every leaf of an ``nnx.State`` of (abstract) parameters.

    Args:
      abstract_params: the ``nnx.State`` from ``nnx.split`` (arrays or ``ShapeDtypeStruct``);
        variables annotated with ``nnx.with_partitioning`` carry their logical names.
      mesh: the device mesh.

    Returns:
      A nested dict (the state's ``to_pure_dict()`` structure) of ``NamedSharding``.
    """

    def one(v):
        value = v.get_value() if isinstance(v, nnx.Variable) else v
        meta = v.get_metadata() if isinstance(v, nnx.Variable) else {}
        logical = meta.get("out_sharding") or meta.get("sharding") or (None,) * len(value.shape)
        spec = logical_to_spec(tuple(logical), value.shape, mesh, rules)
        sharding = NamedSharding(mesh, spec)
        return v.replace(sharding) if isinstance(v, nnx.Variable) else sharding

    tree = jax.tree.map(one, abstract_params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return tree.to_pure_dict() if isinstance(tree, nnx.State) else tree


def batch_sharding(mesh: Mesh, ndim: int = 1) -> NamedSharding:
    """Sharding of a batch array whose leading (rollout) axis splits over ``data`` x ``fsdp``."""
    return NamedSharding(mesh, PartitionSpec(("data", "fsdp"), *([None] * (ndim - 1))))


def constrain_batch(x: jax.Array) -> jax.Array:
    """Pins an activation's leading (batch) axis to ``("data", "fsdp")`` of the mesh in context.

    Called on every decoder layer's input ``[B, T, E]``. Without it XLA's sharding propagation
    may lay the activations out like the FSDP-sharded embedding (hidden axis over ``fsdp``) and
    keep the whole batch on every device: at Qwen3-8B x 256 rollouts x 5,120 tokens that is
    1.5 TB per device instead of ~70 GB (``reports/aot.md``).

    The mesh comes from the abstract-mesh context that ``under_mesh`` sets around every jitted
    entry point of ``grpo_jax.train``; with no mesh in context (a notebook calling the model
    directly), a mesh without ``data``/``fsdp`` axes, a batch of one shard, or a batch that does
    not divide by the shard count, ``x`` is returned unchanged.

    Args:
      x: ``[B, ...]`` any dtype.
    Returns:
      ``x`` with a sharding constraint (same shape, dtype and values).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not {"data", "fsdp"} <= set(mesh.axis_names):
        return x
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    if shards == 1 or x.shape[0] % shards:
        return x
    return jax.lax.with_sharding_constraint(x, PartitionSpec(("data", "fsdp")))


def under_mesh(mesh: Mesh, fn: Callable) -> Callable:
    """``fn`` run with ``mesh`` as the abstract-mesh context (so ``constrain_batch`` sees it).

    Works both around a function that is then jitted (the context is set while it is traced)
    and around a call of an already-jitted function; jit caches per context, so the constrained
    and unconstrained programs never mix.
    """

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args, **kwargs)

    return wrapped


def replicated(mesh: Mesh) -> NamedSharding:
    """A fully replicated sharding on ``mesh``."""
    return NamedSharding(mesh, PartitionSpec())


def batch_divisor(mesh: Mesh) -> int:
    """The number of shards of the batch axis: rollout counts must be multiples of it."""
    return mesh.shape["data"] * mesh.shape["fsdp"]
