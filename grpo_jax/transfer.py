"""Host <-> device crossings and token decoding: the one place a step leaves the device.

Every process holds the same *global* host batch (the prompt pipeline is deterministic and
identical on all hosts); `to_device` lets each process supply the shards its devices own, and
`to_host` gathers a (possibly multi-host) global array back to every process.
"""

from __future__ import annotations

import contextlib

import jax
import numpy as np

from grpo_jax import sharding


def to_device(mesh, x) -> jax.Array:
    """A global host array -> a global device array sharded over the mesh's batch axes.

    Args:
      mesh: the run's ``jax.sharding.Mesh``.
      x: array-like [R, ...]; R divisible by the mesh's data x fsdp size.
    """
    x = np.asarray(x)
    sh = sharding.batch_sharding(mesh, x.ndim)
    shards = [  # explicit per-device puts of this process's shards (multi-host: its own rows)
        jax.device_put(x[index], device)
        for device, index in sh.addressable_devices_indices_map(x.shape).items()
    ]
    return jax.make_array_from_single_device_arrays(x.shape, sh, shards)


def put(tree):
    """Host (numpy) arrays, or a pytree of them -> arrays on the default device, unsharded:
    the curriculum's small per-step inputs ([P], [R], [B]) for its controllers' jitted math."""
    return jax.device_put(tree)


def replicate(mesh, tree):
    """Host (numpy) arrays, or a pytree of them -> arrays replicated over the mesh (every
    process passes the same values): the packed update's plans (`packing.MicroBatches`)."""
    return jax.device_put(tree, sharding.replicated(mesh))


@contextlib.contextmanager
def controllers():
    """The GDRO controllers' own crossings: their pure functions (`grpo_jax.gdro`) take numpy or
    device arrays and return host diagnostics, so small [P] / [R] / [B] arrays move both ways
    inside them. The curricula call them under this context (it allows implicit transfers even
    under ``jax.transfer_guard("disallow")``); nothing of the step's [R, L]-sized data does."""
    with jax.transfer_guard("allow"):
        yield


def to_host(tree):
    """A global (possibly multi-host) array, or a pytree of them, -> numpy on every process.

    One batched ``jax.device_get`` when every array is addressable from this process (single
    host); otherwise each array that is not is gathered from all processes.
    """
    leaves = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
    if jax.process_count() == 1 or all(x.is_fully_addressable for x in leaves):
        return jax.tree.map(np.asarray, jax.device_get(tree))
    from jax.experimental import multihost_utils

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    return jax.tree.map(one, tree)


def decode(tokenizer, ids) -> str:
    """Token ids -> text, end-of-sequence ids dropped.

    Args:
      tokenizer: anything with ``decode(list[int]) -> str`` and ``eos_ids``.
      ids: int sequence [L] (a completion up to its length).
    """
    eos = {int(i) for i in tokenizer.eos_ids}
    return tokenizer.decode([int(i) for i in ids if int(i) not in eos])


def decode_completions(tokenizer, completion_tokens, lengths) -> list[str]:
    """Decodes each row of ``completion_tokens`` [R, Lc] int32 up to ``lengths`` [R] int32."""
    return [decode(tokenizer, completion_tokens[i, : lengths[i]]) for i in range(len(lengths))]
