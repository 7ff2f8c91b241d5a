"""The channels between two process groups (grpo_jax/weight_channel.py).

Two processes x 2 CPU devices under one `jax.distributed` job (tests/weight_channel_worker.py,
run once per module): process 0 (training group) publishes versions 3 and 7 of a params tree
over JAX's transfer engine; process 1 (generation group) receives each into its own layout,
fetches version 3 again by number, and streams three rollout batches back. The bytes received
must equal the bytes sent, leaf for leaf, with the version carried.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from processes import finish, free_port

from grpo_jax import weight_channel

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "weight_channel_worker.py")


def _run_pair(out, timeout=120, *, processes=2, mode=()):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, str(port), str(pid), str(out), *mode],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for pid in range(processes)
    ]
    return finish(procs, timeout)


def _load(path):
    with np.load(path) as f:
        return [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """One run of the two processes; their output directory."""
    out = tmp_path_factory.mktemp("channel")
    (rc0, out0), (rc1, out1) = _run_pair(out)
    assert rc0 == rc1 == 0, f"{out0[-3000:]}\n---\n{out1[-3000:]}"
    (out / "log0.txt").write_text(out0)
    (out / "log1.txt").write_text(out1)
    return out


def test_two_process_groups_receive_the_published_bytes_and_versions(pair):
    out0, out1 = (pair / "log0.txt").read_text(), (pair / "log1.txt").read_text()
    # only the published versions arrive (no version 4, 5, 6 was ever published)
    assert sorted(
        f for f in os.listdir(pair) if f.endswith(".npz") and not f.startswith(("batch_", "model_"))
    ) == [
        "received_3.npz",
        "received_7.npz",
        "refetched_3.npz",
        "sent_3.npz",
        "sent_7.npz",
    ]
    for sent_name, received_name in [
        ("sent_3", "received_3"),
        ("sent_7", "received_7"),
        ("sent_3", "refetched_3"),  # the older version fetched by number after 7 was published
    ]:
        sent, received = _load(pair / f"{sent_name}.npz"), _load(pair / f"{received_name}.npz")
        assert len(sent) == len(received) == 6
        for i, (a, b) in enumerate(zip(sent, received)):
            assert a.nbytes > 0 and a.tobytes() == b.tobytes(), f"{received_name} leaf {i}"
    # the update changed every leaf, so a stale copy could not pass as version 7
    for a, b in zip(_load(pair / "sent_3.npz"), _load(pair / "sent_7.npz")):
        assert a.tobytes() != b.tobytes()
    assert "repeat version refused: weight channel: version 3 is not newer than 3" in out0
    assert "served 3" in out0  # one pull per answered request, none for versions not asked for
    assert "old version refused: 'weight channel grpo_jax/channels/policy: version 2" in out1
    assert "wrong tree refused" in out1 and "differs from the expected one" in out1


def test_the_arithmetic_models_parameters_arrive_byte_for_byte(pair):
    """The tiny decoder's nnx.State (13 leaves), received against its abstract init's tree."""
    sent, received = _load(pair / "model_sent_1.npz"), _load(pair / "model_received_1.npz")
    assert len(sent) == len(received) == 13
    assert all(a.tobytes() == b.tobytes() for a, b in zip(sent, received))
    assert sum(a.nbytes for a in sent) == 4 * 312_064  # every float32 parameter of the model


def test_rollout_batches_arrive_in_order_once_with_their_versions(pair):
    names = ("batch_received_1_v3.npz", "batch_received_2_v7.npz", "batch_received_3_v7.npz")
    assert sorted(f for f in os.listdir(pair) if f.startswith("batch_received_")) == list(names)
    for name in names:
        sent = _load(pair / name.replace("received", "sent"))
        received = _load(pair / name)
        assert len(sent) == len(received) == 3
        assert all(a.tobytes() == b.tobytes() for a, b in zip(sent, received)), name
    first, second = _load(pair / names[0]), _load(pair / names[1])
    assert first[0].tobytes() != second[0].tobytes()  # distinct batches, so order is checked


def test_a_two_process_training_group_publishes_its_rows_to_a_third_process(tmp_path):
    """Training group = processes 0 and 1 (an update with a collective across both), generation
    group = process 2 (its own program); each trainer publishes the rows it holds."""
    outs = _run_pair(tmp_path, processes=3, mode=("groups",))
    assert all(rc == 0 for rc, _ in outs), "\n---\n".join(out[-3000:] for _, out in outs)
    full = np.arange(32, dtype=np.float32).reshape(8, 4)
    expected = full * 2 / np.float32(full.sum())  # the global sum: 496
    assembled = np.load(tmp_path / "assembled.npy")
    np.testing.assert_allclose(assembled, expected, rtol=1e-6)
    assert "from process 0: version 1" in outs[2][1] and "from process 1: version 1" in outs[2][1]


def test_wire_layout_splits_the_first_axis_where_it_divides():
    devices = jax.local_devices()[:1]
    tree = {"a": jnp.zeros((4, 3), jnp.bfloat16), "s": jnp.float32(1.0)}
    layout = weight_channel.wire_layout(tree, devices)
    assert layout["a"].shape == (4, 3) and layout["a"].dtype == jnp.bfloat16
    assert layout["s"].sharding.device_set == {devices[0]}
    if jax.local_device_count() >= 2:  # the test session's 8 virtual CPU devices
        two = jax.local_devices()[:2]
        layout = weight_channel.wire_layout({"a": tree["a"], "odd": jnp.zeros((3, 2))}, two)
        assert layout["a"].sharding.spec == jax.sharding.PartitionSpec("wire")
        assert layout["odd"].sharding.device_set == {two[0]}


def test_signature_names_structure_shapes_and_dtypes():
    base = {"w": jax.ShapeDtypeStruct((2, 3), jnp.float32)}
    sig = weight_channel.signature(base)
    assert sig == weight_channel.signature({"w": jnp.zeros((2, 3), jnp.float32)})
    assert sig != weight_channel.signature({"w": jax.ShapeDtypeStruct((3, 2), jnp.float32)})
    assert sig != weight_channel.signature({"w": jax.ShapeDtypeStruct((2, 3), jnp.bfloat16)})
    assert sig != weight_channel.signature({"v": jax.ShapeDtypeStruct((2, 3), jnp.float32)})


def test_outside_a_distributed_job_the_channel_says_so():
    with pytest.raises(RuntimeError, match="jax.distributed.initialize has not run"):
        weight_channel.WeightPublisher("x")
