"""The sampler's own parameter layout: a ``data x tensor`` mesh over the training devices.

Training shards the parameters FSDP-style (``embed`` over ``fsdp``), so a sampler run in that
layout all-gathers and reads the whole model on every device for every decoded token. A
generation layout views the same devices, in the same order, as a mesh
``(data, fsdp=1, tensor)``: the `sharding.RULES` then put ``heads`` / ``kv_heads`` / ``mlp`` /
``vocab`` over ``tensor`` (Megatron-style tensor parallelism) and the rows over ``data``;
``tensor = 1`` replicates the model (the small-model choice). The parameters are resharded
into it once per sampling round (`reshard`) and the sampler runs under its mesh
(`steps.make_steps`); ``config.rollout.generation_layout`` chooses it (`for_experiment`).

`plan` picks the layout for a model, a device count and a sampler call: every ``data x tensor``
split of the devices is a candidate, its memory per device is the compiled sampler program's
where the caller compiled it (``compiled_bytes``) and otherwise the analytic `decode_costs`,
and the fastest candidate that fits wins.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, Mesh

from grpo_jax import sampling, sharding
from grpo_jax.errors import ConfigError
from grpo_jax.models import from_config as model_lib

TRAINING = "training"  # config value: sample in the training layout (today's behaviour)
AUTO = "auto"  # config value: the layout `plan` picks


@dataclasses.dataclass(frozen=True)
class Layout:
    """A generation layout: ``data`` row shards x ``tensor`` tensor-parallel shards."""

    data: int
    tensor: int

    @property
    def name(self) -> str:
        return f"{self.data}x{self.tensor}"

    @classmethod
    def parse(cls, spec: str) -> Layout:
        """``"DxT"`` (e.g. ``"2x4"``: 2 row shards x 4 tensor shards) -> Layout.
        Raises ValueError on anything else."""
        parts = str(spec).lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
            raise ValueError(
                f"a generation layout is 'training', 'auto' or 'DxT' (data x tensor, e.g. "
                f"'2x4'), got {spec!r}"
            )
        return cls(int(parts[0]), int(parts[1]))


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What `plan` ranks by: HBM bandwidth, chip-to-chip bandwidth per device (bytes/s), peak
    FLOP/s and usable memory per device (bytes). The defaults rank by bytes alone (equal
    bandwidths, no compute bound, no memory limit): the CPU's choice."""

    hbm_Bps: float = 1.0
    link_Bps: float = 1.0
    flops: float = math.inf
    memory_bytes: float = math.inf


def mesh_for(layout: Layout, training_mesh: Mesh) -> Mesh:
    """The generation mesh: ``training_mesh``'s devices in the same order, shaped
    ``(layout.data, 1, layout.tensor)`` with axes `sharding.MESH_AXES` (the same device order
    keeps one device assignment, so arrays move between the two meshes by ``device_put``).
    Raises ValueError when ``data x tensor`` is not the device count."""
    devices = np.asarray(training_mesh.devices).reshape(-1)
    if layout.data * layout.tensor != devices.size:
        raise ValueError(
            f"generation layout {layout.name} needs {layout.data * layout.tensor} devices, the "
            f"training mesh has {devices.size}"
        )
    return Mesh(devices.reshape(layout.data, 1, layout.tensor), sharding.MESH_AXES)


def param_shardings(abstract_params, mesh: Mesh):
    """The parameters' ``NamedSharding`` on a generation mesh (`sharding.param_shardings`)."""
    return sharding.param_shardings(abstract_params, mesh)


def reshard(params, shardings, dtype=None):
    """``params`` moved to ``shardings`` (the generation layout's; a copy).

    Args: params: a pytree of ``jax.Array`` (the training parameters); shardings: the same
    structure of ``NamedSharding`` (`param_shardings`); dtype: None (values unchanged), or the
    model's compute dtype: floating leaves wider than it are cast first (half the bytes moved
    and read for float32 master weights under bfloat16 compute). The model casts every
    parameter to its compute dtype where it uses it (`models.transformer`), so the sampler
    computes the same values either way."""
    if dtype is None:
        return jax.device_put(params, shardings)
    return reshard_program(shardings, dtype)(params)


def reshard_program(shardings, dtype):
    """The jitted reshard of `reshard` with a ``dtype``: ``params -> params`` cast and laid
    out as ``shardings`` (one program per shardings and dtype; `experiments.aot` compiles it)."""
    leaves, treedef = jax.tree.flatten(shardings)
    return _cast_and_move(treedef, tuple(leaves), jnp.dtype(dtype))


@functools.lru_cache(maxsize=8)
def _cast_and_move(treedef, shardings_leaves, dtype):
    shardings = jax.tree.unflatten(treedef, shardings_leaves)

    def cast(params):
        return jax.tree.map(
            lambda x: (
                x.astype(dtype)
                if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize > dtype.itemsize
                else x
            ),
            params,
        )

    return jax.jit(cast, out_shardings=shardings)


def _param_bytes(abstract_params, layout: Layout) -> int:
    """Bytes of the largest shard of every parameter on one device of ``layout``."""
    mesh = AbstractMesh((layout.data, 1, layout.tensor), sharding.MESH_AXES)
    total = 0

    def one(v):
        nonlocal total
        value = v.get_value() if isinstance(v, nnx.Variable) else v
        meta = v.get_metadata() if isinstance(v, nnx.Variable) else {}
        logical = meta.get("out_sharding") or meta.get("sharding") or (None,) * len(value.shape)
        spec = sharding.logical_to_spec(tuple(logical), value.shape, mesh)
        split = dict(mesh.shape)
        shape = [
            d // math.prod(split[x] for x in ((a,) if isinstance(a, str) else a or ()))
            for d, a in zip(value.shape, tuple(spec) + (None,) * len(value.shape))
        ]
        total += math.prod(shape) * np.dtype(value.dtype).itemsize
        return v

    jax.tree.map(one, abstract_params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return total


def decode_costs(
    layout: Layout, model_config, abstract_params, *, rows: int, slots: int, dtype=None
) -> dict:
    """Analytic per-device costs of one decode step of a sampler call in ``layout``.

    With t = ``layout.tensor``, d = ``layout.data``, E the hidden size, L the layers, V the
    vocabulary and ``kv`` = `sampling.kv_bytes_per_slot` (keys and values of one slot, all
    layers):
      params:   the parameter bytes one device holds and reads (`_param_bytes`),
      kv:       rows / d x slots x kv / t_kv (t_kv = t when it divides the kv heads, else 1:
                the rules then replicate them), the dense cache every step reads,
      link:     bytes each device sends per step: 2 all-reduces per layer (attention and MLP
                outputs) of [rows / d, E] at 2 (t - 1) / t (ring) and the sampled logits'
                all-gather [rows / d, V] float32 at (t - 1) / t; 0 for t = 1,
      flops:    2 x params x rows / (d t) (the matmuls, N = params' element count).
    Returns {"params", "kv", "link", "flops", "memory"} (bytes; memory = params + kv).
    Raises ValueError: rows not divisible by ``layout.data``.
    """
    if rows % layout.data:
        raise ValueError(f"{rows} rows do not divide over layout {layout.name}'s data shards")
    t, r = layout.tensor, rows // layout.data
    item = jnp.dtype(dtype or model_config.dtype).itemsize
    kv_shards = t if model_config.num_kv_heads % t == 0 else 1
    params = _param_bytes(abstract_params, layout)
    kv = r * slots * sampling.kv_bytes_per_slot(model_config, dtype) / kv_shards
    ring = (t - 1) / t
    link = ring * r * (2 * 2 * model_config.num_layers * model_config.hidden_size * item)
    link += ring * r * model_config.vocab_size * 4
    flops = 2 * model_config.num_params * r / t
    return {"params": params, "kv": kv, "link": link, "flops": flops, "memory": params + kv}


def step_seconds(costs: dict, hw: Hardware) -> float:
    """Roofline seconds of one decode step: max(reads / HBM, flops / peak) + link bytes / link
    bandwidth (the tensor-parallel collectives, not overlapped)."""
    reads = (costs["params"] + costs["kv"]) / hw.hbm_Bps
    return max(reads, costs["flops"] / hw.flops) + costs["link"] / hw.link_Bps


@dataclasses.dataclass(frozen=True)
class Choice:
    """`plan`'s answer: the layout and every candidate's figures (name -> {memory (bytes per
    device, compiled where given), seconds (per decode step), fits})."""

    layout: Layout
    candidates: dict


def candidates(n_devices: int, rows: int) -> list[Layout]:
    """Every ``data x tensor = n_devices`` split whose data shards divide ``rows``."""
    return [
        Layout(n_devices // t, t)
        for t in range(1, n_devices + 1)
        if n_devices % t == 0 and rows % (n_devices // t) == 0
    ]


def plan(
    model_config,
    abstract_params,
    n_devices: int,
    *,
    rows: int,
    slots: int,
    resident_bytes: float = 0.0,
    hardware: Hardware = Hardware(),
    compiled_bytes: Callable[[Layout], float | None] | None = None,
) -> Choice:
    """The fastest generation layout that fits (ties: the smaller tensor size).

    Args:
      model_config: the model's `ModelConfig`; abstract_params: its ``nnx.State`` of
        parameters (shapes and logical names; arrays or ``ShapeDtypeStruct``).
      n_devices: the devices of the training mesh.
      rows, slots: one sampler call's rows and KV-cache slots (prompt + completion budget).
      resident_bytes: per device, what stays resident while the sampler runs (the training
        state and reference).
      hardware: bandwidths, FLOP/s and usable memory per device (`Hardware`).
      compiled_bytes: optional ``layout -> bytes per device`` of the compiled sampler program
        (None for a layout not compiled); used instead of the analytic memory where given.
    Returns: `Choice`. Raises ValueError when no candidate fits (the message lists them).
    """
    table = {}
    for lay in candidates(n_devices, rows):
        costs = decode_costs(lay, model_config, abstract_params, rows=rows, slots=slots)
        compiled = compiled_bytes(lay) if compiled_bytes is not None else None
        memory = (compiled if compiled is not None else costs["memory"]) + resident_bytes
        table[lay.name] = {
            "layout": lay,
            "memory": memory,
            "seconds": step_seconds(costs, hardware),
            "fits": memory <= hardware.memory_bytes,
            "compiled": compiled is not None,
        }
    fitting = [x for x in table.values() if x["fits"]]
    if not fitting:
        listed = ", ".join(f"{k}: {v['memory'] / 2**30:.1f} GiB" for k, v in table.items())
        raise ValueError(
            f"no generation layout fits {hardware.memory_bytes / 2**30:.1f} GiB per device "
            f"({listed})"
        )
    best = min(fitting, key=lambda x: (x["seconds"], x["layout"].tensor))
    return Choice(best["layout"], {k: {**v, "layout": v["layout"].name} for k, v in table.items()})


def resolve(
    spec: str, model_config, abstract_params, training_mesh: Mesh, *, rows, slots, resident
):
    """The generation mesh and parameter shardings of a config value (None, None for
    "training"): "auto" asks `plan` for one sampler call of ``rows`` rows and ``slots`` cache
    slots, beside the ``resident`` pytree (the sharded abstract train state), with the devices'
    memory limit where they report one; "DxT" is that layout.
    Raises ValueError: a bad spec, a layout whose data shards do not divide ``rows`` or whose
    size is not the device count, or no layout that fits."""
    if spec == TRAINING:
        return None, None
    if spec == AUTO:
        try:
            stats = training_mesh.devices.flat[0].memory_stats() or {}
        except Exception:  # a device with no memory statistics (an abstract TPU topology)
            stats = {}
        hw = Hardware(memory_bytes=stats.get("bytes_limit", math.inf))
        resident_bytes = sum(
            math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
            for x in jax.tree.leaves(resident)
            if getattr(x, "sharding", None) is not None
        )
        layout = plan(
            model_config,
            abstract_params,
            training_mesh.size,
            rows=rows,
            slots=slots,
            resident_bytes=resident_bytes,
            hardware=hw,
        ).layout
    else:
        layout = Layout.parse(spec)
    if rows % layout.data:
        raise ValueError(
            f"layout {layout.name}: {rows} rows per sampler call do not divide over "
            f"{layout.data} data shards"
        )
    mesh = mesh_for(layout, training_mesh)
    return mesh, param_shardings(abstract_params, mesh)


def for_experiment(exp):
    """(generation mesh, parameter shardings) of an `Experiment`'s
    ``config.rollout.generation_layout`` (`resolve`; (None, None) in the training layout).
    Raises ConfigError naming the field."""
    spec = str(exp.run.rollout.generation_layout)
    try:
        return resolve(
            spec,
            exp.model_config,
            nnx.split(model_lib.abstract_model(exp.model_config), nnx.Param)[1],
            exp.mesh,
            rows=exp.batching.generate_batch_size,
            slots=exp.prompt_len + exp.max_new_tokens,
            resident=exp.abstract_state,
        )
    except ValueError as e:
        raise ConfigError(f"config.rollout.generation_layout={spec!r}: {e}") from None
