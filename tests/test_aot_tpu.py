"""The real TPU compiler on this CPU machine (experiments/aot.py's TPU path).

libtpu's topology description gives a v5e:2x2 slice's devices without a TPU; a tiny model's
update, sampler and log-prob pass are compiled for them by libtpu (nothing runs) and the
compiler's memory and cost analyses are checked. Skipped, with the reason, when libtpu (the
``[tpu_aot]`` extra) is not installed.
"""

import pytest

from experiments import aot
from tests.test_aot import tiny_dapo

pytestmark = pytest.mark.skipif(bool(aot.libtpu_missing()), reason=aot.libtpu_missing())


@pytest.fixture(scope="module")
def tpu_result():
    devices = aot.tpu_devices("v5e-4")
    assert len(devices) == 4 and devices[0].platform == "tpu"
    config = tiny_dapo()
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 1, -1, 1
    return aot.compile_steps(config, devices=devices)


def test_topology_devices_are_tpu_while_the_default_backend_is_not():
    import jax

    devices = aot.tpu_devices("v5e-4")
    assert {d.device_kind for d in devices} == {"TPU v5 lite"}
    assert aot.chip_of_device(devices[0].device_kind) is aot.CHIPS["v5e"]
    assert jax.devices()[0].platform == "cpu"  # nothing was moved to a TPU backend
    assert len(aot.tpu_devices("v5e-4", num_slices=2)) == 8


def test_update_sampler_and_logprobs_compile_for_tpu_with_analyses(tpu_result):
    assert tpu_result["platform"] == "tpu" and tpu_result["devices"] == 4
    assert set(tpu_result["steps"]) == {"update", "sampler", "logprobs"}
    for name, s in tpu_result["steps"].items():
        assert s["argument"] > 0 and s["output"] > 0, name
        assert s["temp"] >= 0 and s["peak"] >= s["total"] > 0, name
        assert s["flops"] > 0 and s["bytes"] > 0, name
    # the update donates the state: the TPU compiler aliases it into the output
    assert tpu_result["steps"]["update"]["alias"] > 0


def test_roofline_estimate_is_positive_and_below_peak(tpu_result):
    r = aot.roofline(tpu_result, aot.CHIPS["v5e"])
    assert r["step_seconds"] > 0 and 0 < r["mfu"] <= 1
    assert set(r["steps"]) == set(tpu_result["steps"])
    assert "compiled for TPU, not run" in aot.format_roofline(tpu_result, aot.CHIPS["v5e"])


def test_tpu_topology_names():
    assert aot.tpu_topology_name("v5p-128") == "v5p:4x4x4"
    assert aot.tpu_topology_name("v5litepod-8") == "v5e:2x4"
    assert aot.tpu_topology_name("v6e:4x8") == "v6e:4x8"
    with pytest.raises(ValueError, match="known"):
        aot.tpu_topology_name("v5p-6")
    for chip in ("v4", "v5e", "v5p", "v6e"):
        assert aot.CHIPS[chip].peak_bf16_flops > 0 and aot.CHIPS[chip].bandwidth_Bps > 0


def test_a_program_the_tpu_compiler_refuses_is_reported_as_not_fitting():
    """libtpu raises RESOURCE_EXHAUSTED at compile time for a program whose temporaries exceed
    the chip's HBM; compile_steps records it (temp as the compiler states it) instead of dying."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = aot.tpu_devices("v5e-4")
    mesh = Mesh(devices[:1], ("x",))
    x = jax.ShapeDtypeStruct(
        (1 << 16, 1 << 15), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec())
    )
    # the [2^16, 2^16] float32 product (16 GiB) must exist whole for the sort
    big = jax.jit(lambda a: jnp.sort(jnp.exp(a) @ jnp.exp(a).T, axis=0)[0])
    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED") as e:
        aot._compile_for(big, x, platform="tpu")
    entry = aot._exhausted(str(e.value), aot._bytes_per_device((x, 3.0)))
    assert entry["argument"] == (1 << 33)  # the 8 GiB input; the Python float is static
    assert entry["temp"] > aot.CHIPS["v5e"].memory_bytes  # more than the chip's 16 GiB
    assert (
        entry["total"] == entry["argument"] + entry["temp"] and "RESOURCE_EXHAUSTED" in entry["oom"]
    )
    assert aot.verdict(entry["total"], aot.CHIPS["v5e"], 0.95) == "does not fit"


def test_exhausted_parses_the_compilers_line():
    msg = (
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
        "temporaries (100.10G) exceeds available HBM (95.74G)."
    )
    entry = aot._exhausted("jax.errors.JaxRuntimeError: " + msg, 5 * 2**30)
    assert entry["temp"] == int(100.10 * 2**30) and entry["total"] == entry["temp"] + 5 * 2**30
    assert entry["flops"] == 0.0 and entry["oom"].endswith("(95.74G).")
