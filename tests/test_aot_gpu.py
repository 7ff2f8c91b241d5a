"""XLA:GPU on this CPU machine (experiments/aot.py's GPU path), no GPU needed.

A deviceless CUDA topology of 2 H100s (``aot.gpu_devices``: XLA's H100 description, the
installed CUDA runtime and cuDNN versions) gives the devices; a tiny bf16 model's update and
sampler are compiled by XLA:GPU for them (nothing runs) and the optimised HLO is checked for
cuDNN's fused attention, which ``model.attention_impl="auto"`` resolves to on GPUs. Skipped,
with the reason, when the CUDA plugin (the ``[gpu_aot]`` extra) is not installed.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from experiments import aot
from tests.test_aot import tiny_dapo

pytestmark = pytest.mark.skipif(bool(aot.cuda_plugin_missing()), reason=aot.cuda_plugin_missing())


@pytest.fixture(scope="module")
def gpu_result():
    config = tiny_dapo()  # bf16 compute, 1024-style odd sequence length (16 + 16 - 1 = 31)
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 1, -1, 1
    return aot.compile_steps(config, devices=aot.gpu_devices("h100-2"), logprobs=False)


def test_gpu_topology_devices_while_the_default_backend_stays_the_cpu():
    devices = aot.gpu_devices("h100-2")
    assert len(devices) == 2 and {d.platform for d in devices} == {"gpu"}
    assert devices[0].device_kind == "NVIDIA H100 80GB HBM3"
    assert aot.chip_of_device(devices[0].device_kind) is aot.CHIPS["h100"]
    assert jax.devices()[0].platform == "cpu"
    nodes = aot.gpu_devices("h200-16")  # two 8-GPU nodes: one process per host
    assert len(nodes) == 16 and len({d.process_index for d in nodes}) == 2
    assert aot.chip_of_device(nodes[0].device_kind) is aot.CHIPS["h200"]


@pytest.mark.slow
def test_update_and_sampler_compile_for_gpu_with_cudnn_attention(gpu_result):
    r = gpu_result
    assert r["platform"] == "gpu" and r["devices"] == 2
    assert r["attention_impl"] == "cudnn"  # "auto" on GPUs with bf16 activations
    assert set(r["steps"]) == {"update", "sampler"}
    # the update's forward and backward (remat: forward, recomputed forward, backward) and the
    # sampler's prefill (one per layer, unrolled) hold cuDNN's fused attention
    assert r["steps"]["update"]["cudnn_fmha_calls"] >= 2
    assert r["steps"]["sampler"]["cudnn_fmha_calls"] >= 1
    for name, s in r["steps"].items():
        assert s["argument"] > 0 and s["output"] > 0 and s["temp"] >= 0, name
        assert s["peak"] >= s["total"] > 0, name
    assert r["steps"]["update"]["alias"] > 0.9 * r["state_bytes"]  # the donated state


def test_cudnn_call_count_tells_the_fused_kernel_from_xla_attention():
    devices = aot.gpu_devices("h100-2")
    mesh = Mesh(devices, ("x",))
    q = jax.ShapeDtypeStruct(
        (2, 256, 4, 64), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec("x"))
    )
    counts = {}
    for impl in ("cudnn", "xla"):
        f = jax.jit(
            lambda q, impl=impl: jax.nn.dot_product_attention(
                q, q, q, is_causal=True, implementation=impl
            )
        )
        compiled, _ = aot._compile_for(f, q, platform="gpu")
        counts[impl] = aot.cudnn_attention_calls(compiled.as_text())
    assert counts == {"cudnn": 1, "xla": 0}


def test_target_config_carries_the_installed_library_versions():
    from experiments import _gpu_specs as gpu_specs

    text = gpu_specs.target_config("b200")
    v = gpu_specs.library_versions()
    assert f"dnn_version_info {{ major: {v['cudnn'][0]} minor: {v['cudnn'][1]}" in text
    assert "cuda_compute_capability { major: 10 minor: 0 }" in text
    assert 'device_description_str: "NVIDIA B200"' in text
