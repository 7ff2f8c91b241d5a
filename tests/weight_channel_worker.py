"""One process of tests/test_weight_channel.py: process 0 trains (publishes), process 1 generates.

Usage: python tests/weight_channel_worker.py PORT PROCESS_ID OUT_DIR
Each process has 2 local CPU devices. Process 0 publishes version 3 of a params tree of several
dtypes/shapes (held in a training layout different from the wire layout), deletes its own
arrays, then publishes version 7 after an "update"; process 1 receives both into a replicated
generation layout. Each side writes the bytes it sent / received to OUT_DIR as .npz files of
uint8 views, with the version in the file name, so the test compares them byte for byte.
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from grpo_jax import distributed, weight_channel

NAME = "policy"


def make_params(seed: int):
    """A tree of several dtypes/shapes on the host (numpy)."""
    rng = np.random.default_rng(seed)
    return {
        "embed": rng.standard_normal((6, 4)).astype(jnp.bfloat16),  # splits over 2 wire devices
        "blocks": [
            {"w": rng.standard_normal((4, 6)).astype(np.float32), "b": np.float32(rng.random())},
            {"w": rng.standard_normal((3, 5)).astype(jnp.bfloat16)},  # 3 rows: whole on one
        ],
        "count": rng.integers(-(2**31), 2**31 - 1, size=(8,), dtype=np.int32),
        "mask": rng.random((2, 2, 3)) < 0.5,
    }


def save(path, tree):
    leaves = jax.tree.leaves(tree)
    np.savez(path, *[np.ascontiguousarray(np.asarray(x)).view(np.uint8) for x in leaves])


def train_side(out):
    devices = jax.local_devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("fsdp",))

    def layout(x):  # matrices split along their last axis (unlike the wire layout), vectors
        if x.ndim == 2 and x.shape[1] % 2 == 0:  # along their first (like it: may alias)
            return NamedSharding(mesh, PartitionSpec(None, "fsdp"))
        return NamedSharding(mesh, PartitionSpec("fsdp") if x.ndim == 1 else PartitionSpec())

    pub = weight_channel.WeightPublisher(NAME, wire_devices=2, host="127.0.0.1")
    params = jax.tree.map(lambda x: jax.device_put(x, layout(np.asarray(x))), make_params(0))
    pub.publish(params, version=3)
    save(os.path.join(out, "sent_3.npz"), params)
    try:
        pub.publish(params, version=3)
    except ValueError as e:
        print("repeat version refused:", e, flush=True)
    # the next training step donates the old params: the channel must hold its own copy
    updated = jax.tree.map(lambda x: x + 1 if x.dtype != jnp.bool_ else ~x, params)
    jax.tree.map(lambda x: x.delete(), params)
    weight_channel.coordination_client().key_value_set("test/deleted_3", "1")
    weight_channel.coordination_client().blocking_key_value_get("test/received_3", 60_000)
    pub.publish(updated, version=7)
    save(os.path.join(out, "sent_7.npz"), updated)
    weight_channel.coordination_client().blocking_key_value_get("test/done", 60_000)
    pub.close()
    print("served", pub.served, flush=True)


def generate_side(out):
    like = jax.eval_shape(lambda: jax.tree.map(jnp.asarray, make_params(0)))
    sub = weight_channel.WeightSubscriber(NAME, like, wire_devices=2, host="127.0.0.1")
    gen = NamedSharding(jax.sharding.Mesh(np.array(jax.local_devices()), ("tp",)), PartitionSpec())
    shardings = jax.tree.map(lambda _: gen, like)
    weight_channel.coordination_client().blocking_key_value_get("test/deleted_3", 60_000)
    version, params = sub.latest(shardings)
    assert all(x.sharding == gen for x in jax.tree.leaves(params)), "not in the generation layout"
    save(os.path.join(out, f"received_{version}.npz"), params)
    weight_channel.coordination_client().key_value_set("test/received_3", "1")
    sub.wait_for_version(7)
    version, params = sub.latest(shardings)
    save(os.path.join(out, f"received_{version}.npz"), params)
    wrong = dict(like, embed=jax.ShapeDtypeStruct((6, 4), jnp.float32))
    try:
        weight_channel.WeightSubscriber(NAME, wrong, wire_devices=2, host="127.0.0.1").latest()
    except ValueError as e:
        print("wrong tree refused:", e, flush=True)
    weight_channel.coordination_client().key_value_set("test/done", "1")


def main():
    port, pid, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    distributed.initialize("on", f"localhost:{port}", 2, pid, timeout_s=60)
    (train_side if pid == 0 else generate_side)(out)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
