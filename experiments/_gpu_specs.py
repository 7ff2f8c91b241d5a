"""XLA:GPU target descriptions of the GPUs ``experiments.aot`` compiles for without a GPU (a
module of ``experiments.aot``, not a command: hence the underscore).

A deviceless GPU compile needs a ``stream_executor.GpuTargetConfigProto`` in text form: what a
real device would report (SM count, memory size and bandwidth, compute capability, ...) plus
the CUDA runtime and cuDNN versions the compiler may assume. The device figures below are the
ones XLA itself keeps for these GPUs, in openxla/xla ``xla/backends/gpu/target_config/specs/``
(formerly ``xla/tools/hlo_opt/gpu_specs/``): ``h100_sxm.txtpb`` (commit 0774019d97e7),
``h200.txtpb`` (4336d12e0706), ``b200.txtpb`` (300ec95ab85f). Only the ``gpu_device_info``
fields every XLA release since 2024 parses are kept. The runtime and cuDNN versions are the
installed plugin's (``nvidia-cuda-runtime-cu12``, ``nvidia-cudnn-cu12``), so the compiler
plans for the libraries that would run the program.
"""

from __future__ import annotations

import importlib.metadata

_SPEC_URL = (
    "https://github.com/openxla/xla/blob/{commit}/xla/backends/gpu/target_config/specs/{file}"
)

# Common to the Hopper and Blackwell parts (identical in the three files).
_COMMON = {
    "threads_per_block_limit": 1024,
    "threads_per_warp": 32,
    "shared_memory_per_block": 49152,
    "shared_memory_per_core": 233472,
    "threads_per_core_limit": 2048,
    "fpus_per_core": 128,
    "block_dim_limit_x": 2147483647,
    "block_dim_limit_y": 65535,
    "block_dim_limit_z": 65535,
    "shared_memory_per_block_optin": 232448,
    "registers_per_core_limit": 65536,
    "registers_per_block_limit": 65536,
}

# chip key (experiments.aot.CHIPS) -> (device_description_str, gpu_device_info fields, source)
DEVICES = {
    "h100": (
        "NVIDIA H100 80GB HBM3",
        {
            **_COMMON,
            "core_count": 132,
            "memory_bandwidth": 3352320000000,
            "l2_cache_size": 52428800,
            "clock_rate_ghz": 1.98,
            "device_memory_size": 84942979072,
            "compute_capability": (9, 0),
        },
        _SPEC_URL.format(commit="0774019d97e77dc433ce97604295f6fc0f5b3b65", file="h100_sxm.txtpb"),
    ),
    "h200": (
        "NVIDIA H200 141GB HBM3e",
        {
            **_COMMON,
            "core_count": 132,
            "memory_bandwidth": 4800000000000,
            "l2_cache_size": 52428800,
            "clock_rate_ghz": 1.98,
            "device_memory_size": 151397597184,
            "compute_capability": (9, 0),
        },
        _SPEC_URL.format(commit="4336d12e0706168f6a382ddb231f3a83853b0657", file="h200.txtpb"),
    ),
    "b200": (
        "NVIDIA B200",
        {
            **_COMMON,
            "core_count": 148,
            "memory_bandwidth": 7672320000000,
            "l2_cache_size": 132644864,
            "clock_rate_ghz": 1.965,
            "device_memory_size": 191514411008,
            "compute_capability": (10, 0),
        },
        _SPEC_URL.format(commit="300ec95ab85fa9f40af388054f7d43707407cb52", file="b200.txtpb"),
    ),
}


def _version(package: str, parts: int) -> tuple[int, ...]:
    v = importlib.metadata.version(package).split(".")
    return tuple(int(x) for x in v[:parts])


def library_versions() -> dict:
    """The installed CUDA runtime and cuDNN versions, as (major, minor[, patch]).

    Raises:
      importlib.metadata.PackageNotFoundError: the CUDA 12 plugin's libraries are not installed.
    """
    return {
        "cuda_runtime": _version("nvidia-cuda-runtime-cu12", 2),
        "cudnn": _version("nvidia-cudnn-cu12", 3),
    }


def target_config(chip: str) -> str:
    """The ``GpuTargetConfigProto`` text of ``chip`` ("h100" | "h200" | "b200") for
    ``jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...)``.

    Raises:
      KeyError: a chip without a device description here.
    """
    name, info, _ = DEVICES[chip]
    fields = []
    for key, value in info.items():
        if key == "compute_capability":
            fields.append(f"cuda_compute_capability {{ major: {value[0]} minor: {value[1]} }}")
        else:
            fields.append(f"{key}: {value}")
    v = library_versions()
    rt, dnn = v["cuda_runtime"], v["cudnn"]
    return (
        "gpu_device_info {\n  "
        + "\n  ".join(fields)
        + "\n}\n"
        + 'platform_name: "CUDA"\n'
        + f"runtime_version {{ major: {rt[0]} minor: {rt[1]} }}\n"
        + f"dnn_version_info {{ major: {dnn[0]} minor: {dnn[1]} patch: {dnn[2]} }}\n"
        + f'device_description_str: "{name}"\n'
    )
