"""Compile-only proof that a config fits its target chips: nothing is allocated.

    python -m experiments.aot --config=configs/dapo_qwen3.py:8b,rollout_gdro --topology=v5p-128

    python -m experiments.aot --config=configs/dapo_qwen3.py:8b,rollout_gdro --topology=h100-8

lowers and compiles, on a mesh of the target's devices as its compiler sees them (below: a
TPU slice or GPU nodes described without the hardware, or virtual CPU devices), with
``jax.ShapeDtypeStruct`` inputs carrying the real shardings (``grpo_jax.sharding`` rules):

  update     ``steps.make_steps(exp).update``: one mini-batch AdamW update (the jitted, donated
             program the step's ``train`` loop runs once per mini-batch), at
             ``config.algorithm.mini_batch_size`` rollouts;
  sampler    ``grpo_jax.sampling.generate`` (prefill + the KV-cache decode loop) for the step's
             R = prompts_per_step x rollouts_per_prompt rows (continuous batching when
             ``rollout.decode_slots`` > 0); ``--sampler=decode`` compiles one
             prefill call and one decode call on the full-size cache instead;
  logprobs   ``steps.make_steps(exp).logprobs``: the reference / old log-prob pass over the whole
             R-row batch, as ``rl_step`` calls it (one mini-batch of rows at a time, inside the
             jitted program; only when kl_coef > 0 or the batch is reused).

It prints, per device, ``compiled.memory_analysis()``'s argument / output / temporary bytes,
adds what stays resident in device memory without being an argument of that step (the
optimizer state while sampling, the frozen reference parameters while updating), and compares
the peak with the chip's memory (``CHIPS``). Exit status 1, with a message saying what to
change, when the config does not fit; 0 when it does.

Three compilers (``choose_compiler``):

  TPU slices (v5e-8, v5p-128, v6e-256, ... ``TPU_TOPOLOGIES``; ``--num_slices=2`` for two
  slices over DCN), when libtpu is installed (``pip install -e ".[tpu_aot]"``): the mesh is made
  of the slice's devices from ``jax.experimental.topologies`` and every program is compiled by
  the real TPU compiler (as MaxText's ``train_compile.py`` does; no TPU needed, JAX's default
  backend stays the CPU). Its memory_analysis and cost_analysis per device are reported, with a
  roofline time per chip (``roofline``: peak bf16 FLOP/s and HBM bandwidth of ``CHIPS``), an
  estimated RL step time and MFU: all "compiled for TPU, not run" (``_run_compiled``).
  GPU nodes (h100-8, h200-8, h100-16, h100-64, h200-64, b200-8: ``gpu_devices``), when the CUDA
  plugin is installed (``pip install -e ".[gpu_aot]"``): the same with XLA:GPU, deviceless,
  from XLA's own description of the chip (``experiments/_gpu_specs.py``); ``model.attention_impl``
  resolves to cuDNN's fused attention for the GPUs and the number of cuDNN attention calls in
  each optimised program is reported. XLA:GPU gives no cost analysis without a GPU (the
  roofline counts FLOPs analytically) and autotunes nothing: "compiled for GPU, not run".
  ``--compiler=cpu`` (and TPU slices without libtpu): XLA's CPU compiler on virtual CPU
  devices. The partitioning (what each device holds) is the real one; the temporaries are the
  CPU compiler's buffer assignment, which fuses and schedules differently (and uses the einsum
  attention); kept for machines without libtpu and to reproduce the older tables.

``--sweep=reports/aot.md`` runs the three Qwen3 sizes x grpo / prompt_gdro / rollout_gdro,
each in its own subprocess, and appends the markdown table (and the JSON rows to
``reports/aot.jsonl``). Other layouts and batches: ``--mesh=data,fsdp,tensor``,
``--mini_batch=N``, ``--micro_batch=N`` (gradient accumulation), ``--generate_batch=N`` (rows
per sampler call), any ``--config.x=y``. The CPU compile uses fast-codegen options (``_FAST_CPU_COMPILE``); on a quiet core the 8B check takes
13-30 s for 8-256 devices. Results: ``reports/aot.md``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import time

from grpo_jax import cli  # no JAX: main sets XLA_FLAGS before JAX starts

GiB = 1024**3


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    memory_bytes: int
    source: str
    cores_per_chip: int = 1  # TPU v4/v5p names count TensorCores: v5p-8 is 4 chips (4 JAX devices)
    bandwidth_Bps: float = 0.0  # published HBM bandwidth per chip, bytes/s (same source page)
    device_kinds: tuple[str, ...] = ()  # jax.Device.device_kind strings of this chip
    peak_bf16_flops: float = 0.0  # published peak dense bf16 FLOP/s per chip (same source page)
    interconnect: str = ""  # the chip-to-chip link inside a node / slice, as published
    # chip-to-chip bandwidth per chip, one direction, bytes/s (same source; 0 = not given):
    # what the reshard and tensor-parallel collectives of `experiments.pipeline_estimate` use
    link_Bps: float = 0.0


# Memory per chip, as published. TPU figures are what JAX can allocate (the v5p page: 96 GiB
# physical, 95 GiB after the runtime's reservation). GPU figures are the datasheets' decimal GB;
# JAX preallocates XLA_PYTHON_CLIENT_MEM_FRACTION (default 0.75) of it: set 0.95 for big runs.
CHIPS = {
    "v4": Chip(
        "TPU v4",
        32 * GiB,
        "https://cloud.google.com/tpu/docs/v4 (32 GiB HBM2, 1,200 GBps, 275 bf16 TFLOPs per chip)",
        2,
        1200e9,
        ("TPU v4",),
        275e12,
    ),
    "v5e": Chip(
        "TPU v5e",
        16 * GiB,
        "https://cloud.google.com/tpu/docs/v5e (16 GiB HBM2, 819 GBps, 197 bf16 TFLOPs per chip)",
        1,
        819e9,
        ("TPU v5 lite", "TPU v5e"),
        197e12,
    ),
    "v5p": Chip(
        "TPU v5p",
        95 * GiB,
        "https://cloud.google.com/tpu/docs/v5p (95 GiB HBM2e, 2,765 GBps, 459 bf16 TFLOPs per "
        "chip; interchip interconnect 4,800 Gbps per chip)",
        2,
        2765e9,
        ("TPU v5p", "TPU v5"),
        459e12,
        "ICI, 3D torus, 4,800 Gbps per chip",
        600e9,  # 4,800 Gbps, all of a chip's ICI links together
    ),
    "v6e": Chip(
        "TPU v6e",
        32 * GiB,
        "https://cloud.google.com/tpu/docs/v6e (32 GiB HBM, 1,640 GBps, 918 bf16 TFLOPs per chip)",
        1,
        1640e9,
        ("TPU v6 lite", "TPU v6e"),
        918e12,
    ),
    "h100": Chip(
        "NVIDIA H100 SXM",
        80 * 10**9,
        "https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM: 80 GB HBM3, 3.35 TB/s, "
        "1,979 bf16 TFLOPS with sparsity = 989 dense, NVLink 900 GB/s)",
        1,
        3.35e12,
        ("NVIDIA H100 80GB HBM3", "NVIDIA H100"),
        989e12,
        "NVLink 4, 900 GB/s per GPU (bidirectional), 8 per node over NVSwitch",
        450e9,  # one direction
    ),
    "h200": Chip(
        "NVIDIA H200 SXM",
        141 * 10**9,
        "https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM: 141 GB HBM3e, 4.8 TB/s, "
        "1,979 bf16 TFLOPS with sparsity = 989 dense, NVLink 900 GB/s)",
        1,
        4.8e12,
        ("NVIDIA H200", "NVIDIA H200 141GB HBM3e"),
        989e12,
        "NVLink 4, 900 GB/s per GPU (bidirectional), 8 per node over NVSwitch",
    ),
    "b200": Chip(
        "NVIDIA B200",
        180 * 10**9,
        "https://www.nvidia.com/en-us/data-center/dgx-b200/ and .../data-center/hgx/ (8 x B200: "
        "1,440 GB HBM3e = 180 GB per GPU, 64 TB/s = 8 TB/s per GPU; HGX B200 36 PFLOPS bf16 "
        "with sparsity = 2,250 dense TFLOPS per GPU; NVLink 1.8 TB/s per GPU)",
        1,
        8.0e12,
        ("NVIDIA B200",),
        2250e12,
        "NVLink 5, 1.8 TB/s per GPU (bidirectional), 8 per node over NVSwitch",
    ),
    "a100-40": Chip(
        "NVIDIA A100 40GB",
        40 * 10**9,
        "https://www.nvidia.com/en-us/data-center/a100/ (40 GB HBM2, 1,555 GB/s, 312 bf16 TFLOPS)",
        1,
        1555e9,
        ("NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB"),
        312e12,
    ),
    "a100-80": Chip(
        "NVIDIA A100 80GB",
        80 * 10**9,
        "https://www.nvidia.com/en-us/data-center/a100/ (80 GB HBM2e, 2,039 GB/s SXM, 312 bf16 TFLOPS)",
        1,
        2039e9,
        ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe"),
        312e12,
    ),
}


def chip_of_device(device_kind: str) -> Chip | None:
    """The `CHIPS` entry of a ``jax.Device.device_kind`` (None for a CPU or an unknown chip)."""
    kind = device_kind.strip().lower()
    for chip in CHIPS.values():
        if any(kind == k.lower() for k in chip.device_kinds):
            return chip
    for chip in CHIPS.values():  # a longer kind string of the same chip ("... 80GB HBM3 ...")
        if any(kind.startswith(k.lower()) for k in chip.device_kinds):
            return chip
    return None


def parse_topology(topology: str) -> tuple[Chip, int]:
    """``v5p-64`` (TensorCores for v4/v5p, chips for v5e/v6e), ``v5litepod-16``, ``8xh100``,
    ``h100x8``, ``a100-80x4`` -> (chip, number of JAX devices).

    Raises:
      ValueError: an unknown chip or a malformed count, listing the accepted forms.
    """
    t = topology.strip().lower().replace("v5litepod", "v5e")
    m = re.fullmatch(r"(v4|v5e|v5p|v6e)-(\d+)", t)
    if m:
        chip = CHIPS[m.group(1)]
        n = int(m.group(2))
        if n % chip.cores_per_chip:
            raise ValueError(
                f"--topology={topology}: {m.group(1)} counts TensorCores ({chip.cores_per_chip} per chip)"
            )
        return chip, n // chip.cores_per_chip
    m = re.fullmatch(r"(h100|h200|b200)-(\d+)", t)
    if m:  # GPU nodes for the XLA:GPU compiler (GPU_TOPOLOGIES)
        return CHIPS[m.group(1)], int(m.group(2))
    m = re.fullmatch(r"(\d+)x([a-z0-9-]+)", t) or re.fullmatch(r"([a-z0-9-]+?)x(\d+)", t)
    if m:
        count, name = (m.group(1), m.group(2)) if m.group(1).isdigit() else (m.group(2), m.group(1))
        if name in CHIPS and not name.startswith(("v4", "v5", "v6")):
            return CHIPS[name], int(count)
    raise ValueError(
        f"--topology={topology!r}: expected e.g. v5p-8 (4 chips), v4-32, v5e-16, v6e-8, "
        f"h100-8, h200-64, b200-8, 8xa100-80; chips: {sorted(CHIPS)}"
    )


# ----------------------------------------------------------------------------- TPU compiler

# Slice name -> the topology string of jax.experimental.topologies (chips as AxB or AxBxC).
TPU_TOPOLOGIES = {
    "v5e-4": "v5e:2x2",
    "v5e-8": "v5e:2x4",
    "v5e-16": "v5e:4x4",
    "v5e-64": "v5e:8x8",
    "v5e-256": "v5e:16x16",
    "v5p-8": "v5p:2x2x1",
    "v5p-16": "v5p:2x2x2",
    "v5p-32": "v5p:2x2x4",
    "v5p-64": "v5p:4x4x2",
    "v5p-128": "v5p:4x4x4",
    "v5p-256": "v5p:4x4x8",
    "v5p-512": "v5p:8x8x4",
    "v6e-4": "v6e:2x2",
    "v6e-8": "v6e:2x4",
    "v6e-16": "v6e:4x4",
    "v6e-64": "v6e:8x8",
    "v6e-256": "v6e:16x16",
}


def libtpu_missing() -> str:
    """Why the TPU compiler cannot run here ("" when it can): libtpu is the optional extra
    ``pip install -e ".[tpu_aot]"``; no TPU is needed."""
    import importlib.util

    if importlib.util.find_spec("libtpu") is None:
        return 'libtpu is not installed (pip install -e ".[tpu_aot]"; no TPU needed)'
    return ""


def tpu_topology_name(topology: str) -> str:
    """``v5p-128`` -> ``v5p:4x4x4`` (also accepts the ``v5e:2x2`` form itself)."""
    t = topology.strip().lower().replace("v5litepod", "v5e")
    if ":" in t:
        return t
    if t not in TPU_TOPOLOGIES:
        raise ValueError(
            f"--topology={topology}: no TPU topology known for it; known: {sorted(TPU_TOPOLOGIES)}"
            " (or give the topology itself, e.g. v5p:4x4x8)"
        )
    return TPU_TOPOLOGIES[t]


def tpu_devices(topology: str, num_slices: int = 1) -> list:
    """The devices of a TPU slice (``num_slices`` > 1: a multi-slice job over DCN), from
    libtpu's topology description: no TPU is needed, and JAX's default backend stays the CPU.
    Programs whose mesh is made of these devices are compiled by the real TPU compiler
    (MaxText's ``train_compile.py`` does the same). libtpu's one-process-per-host lock is
    lifted (``ALLOW_MULTIPLE_LIBTPU_LOAD``): compiling touches no chip, so several compiling
    processes (parallel tests, a sweep) may coexist."""
    from jax.experimental import topologies

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

    kwargs = {"num_slices": num_slices} if num_slices > 1 else {}
    desc = topologies.get_topology_desc(
        topology_name=tpu_topology_name(topology), platform="tpu", **kwargs
    )
    return list(desc.devices)


# ----------------------------------------------------------------------------- GPU compiler

GPUS_PER_NODE = 8  # HGX / DGX H100, H200, B200 nodes


def cuda_plugin_missing() -> str:
    """Why the XLA:GPU compiler cannot run here ("" when it can): the CUDA 12 plugin is the
    optional extra ``pip install -e ".[gpu_aot]"`` (about 3 GB); no GPU is needed."""
    import importlib.util

    try:
        found = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:  # no jax_plugins namespace at all
        found = False
    if not found:
        return 'the CUDA plugin is not installed (pip install -e ".[gpu_aot]"; no GPU needed)'
    return ""


def is_gpu_topology(topology: str) -> bool:
    """Whether ``topology`` names GPUs (``h100-8``, ``8xh100``, ...) rather than a TPU slice."""
    try:
        return parse_topology(topology)[0].name.startswith("NVIDIA")
    except ValueError:
        return False


def gpu_topology_name(count: int) -> str:
    """``jax.experimental.topologies``' CUDA topology of ``count`` GPUs, "partitions x hosts x
    devices per host": up to one node of ``GPUS_PER_NODE`` -> ``1x1xcount``, more -> whole
    nodes (64 -> ``1x8x8``).

    Raises:
      ValueError: a count above one node that is not a multiple of ``GPUS_PER_NODE``.
    """
    if count <= GPUS_PER_NODE:
        return f"1x1x{count}"
    if count % GPUS_PER_NODE:
        raise ValueError(f"{count} GPUs: more than one node must be whole nodes of {GPUS_PER_NODE}")
    return f"1x{count // GPUS_PER_NODE}x{GPUS_PER_NODE}"


def gpu_devices(topology: str) -> list:
    """The devices of ``topology`` (``h100-8``, ``h200-64``, ``b200-8``, ``h100-2``) as XLA:GPU
    sees them, from a deviceless CUDA topology description (``experiments._gpu_specs``: XLA's
    own device description of the chip, the installed CUDA runtime and cuDNN versions). No GPU
    is needed and JAX's default backend must stay the CPU (``JAX_PLATFORMS=cpu``; without it the
    plugin looks for a driver and fails); programs whose mesh is made of these devices are
    compiled by XLA:GPU.

    Raises:
      ValueError: a topology that is not a GPU with a device description.
      RuntimeError: the CUDA plugin is not installed.
    """
    from jax.experimental import topologies

    from experiments import _gpu_specs as gpu_specs

    chip, count = parse_topology(topology)
    key = next(k for k, c in CHIPS.items() if c is chip)
    if key not in gpu_specs.DEVICES:
        raise ValueError(
            f"--topology={topology}: no XLA:GPU device description for {chip.name}; "
            f"known: {sorted(gpu_specs.DEVICES)}"
        )
    if cuda_plugin_missing():
        raise RuntimeError(cuda_plugin_missing())
    desc = topologies.get_topology_desc(
        platform="cuda",
        target_config=gpu_specs.target_config(key),
        topology=gpu_topology_name(count),
    )
    return list(desc.devices)


def _calls_per_step(result: dict, name: str) -> int:
    b = result["batch"]
    return {
        "update": b["R"] // b["mini_batch"],
        "sampler": b["R"] // b["generate_batch"],
        "prefill": b["R"] // b["generate_batch"],
        "decode": b["R"] // b["generate_batch"] * b["new_tokens"],
        "logprobs": 1,
        "reshard": 1,
    }[name]


def _model_flops(result: dict, name: str, rows: int) -> float:
    """Matmul FLOPs of one call, all devices (2 N per token forward, 6 N forward + backward;
    attention's T^2 term and remat's recomputation left out, as MFU conventionally counts)."""
    b, n = result["batch"], result["params"]
    T = b["prompt_tokens"] + b["new_tokens"]
    if name == "reshard":
        return 0.0
    per_token = {"update": 6, "sampler": 2, "logprobs": 2, "prefill": 2, "decode": 2}[name]
    tokens = {"prefill": b["prompt_tokens"], "decode": 1}.get(name, T)
    return per_token * n * rows * tokens


# MaxText's published training MFU per TPU generation (pre-training, bf16, the dense model
# closest in size to Qwen3-1.7B-8B that each table lists), the calibration of
# `roofline`'s "MaxText-calibrated" estimate: the update and log-prob passes at this MFU, the
# sampler (memory-bound decode, which MaxText's training tables do not cover) at its roofline.
MAXTEXT_MFU = {
    "TPU v6e": (
        0.4546,
        "Llama 3.1 8B, v6e-256, SL 8192",
        "https://github.com/AI-Hypercomputer/maxtext/blob/main/docs/reference/models/tiering.md",
    ),
    "TPU v5p": (
        0.7147,
        "32B dense, v5p-128 (the smallest v5p model listed; older full-causal FLOP count)",
        "https://github.com/AI-Hypercomputer/maxtext/blob/main/MaxText/configs/v5p/README.md",
    ),
    "TPU v5e": (
        0.6110,
        "16B dense, v5e-256 (the smallest v5e model listed)",
        "https://github.com/AI-Hypercomputer/maxtext/blob/main/MaxText/configs/v5e/README.md",
    ),
}


def roofline(result: dict, chip: Chip) -> dict:
    """Roofline time per chip of each compiled step and of one RL step, and the MFU.

    Per call and device: ``max(flops / peak_bf16, bytes / hbm_bandwidth)``, with flops the larger
    of the compiler's count and the model FLOPs / devices, bytes the compiler's count, and for
    the sampler at least its decode loop's reads (every new token reads the bf16 parameters and
    the rows' KV cache; XLA counts the loop body once). Communication is not modelled. A lower
    bound on the time of a program that was compiled, not run.
    """
    dev = result["devices"]
    out, step_s, model_total = {}, 0.0, 0.0
    for name, s in result["steps"].items():
        model = _model_flops(result, name, s["rows"])
        flops = max(s.get("flops", 0.0), model / dev)
        nbytes = s.get("bytes", 0.0)
        if name == "sampler":  # rows decoded `slots` at a time (continuous batching), longest
            b = result["batch"]  # case: every row runs to max_new_tokens
            slots = b.get("decode_slots") or s["rows"]
            gen = result.get("generation_layout")  # its parameter shard, else the whole model
            param_reads = gen["param_bytes"] if gen else 2 * result["params"]
            decode_reads = (
                b["new_tokens"]
                * (s["rows"] / slots)
                * (param_reads + slots * result["kv_bytes_per_row"] / dev)
            )
            nbytes = max(nbytes, decode_reads)
        t = max(flops / chip.peak_bf16_flops, nbytes / chip.bandwidth_Bps)
        calls = _calls_per_step(result, name)
        out[name] = {
            "calls": calls,
            "flops": flops,
            "bytes": nbytes,
            "model_flops": model,
            "seconds_per_call": t,
            "bound": "compute"
            if flops / chip.peak_bf16_flops >= nbytes / chip.bandwidth_Bps
            else "memory",
        }
        step_s += calls * t
        model_total += calls * model
    mfu = model_total / (step_s * dev * chip.peak_bf16_flops) if step_s else 0.0
    est = {"steps": out, "step_seconds": step_s, "mfu": mfu}
    if chip.name in MAXTEXT_MFU:  # the training-like passes at MaxText's published MFU
        ref_mfu = MAXTEXT_MFU[chip.name][0]
        cal = sum(
            x["calls"]
            * (
                x["seconds_per_call"]
                if name in ("sampler", "prefill", "decode")
                else max(
                    x["seconds_per_call"], x["model_flops"] / (dev * chip.peak_bf16_flops * ref_mfu)
                )
            )
            for name, x in out.items()
        )
        est["maxtext_step_seconds"] = cal
        est["maxtext_mfu"] = model_total / (cal * dev * chip.peak_bf16_flops) if cal else 0.0
    return est


def format_roofline(result: dict, chip: Chip) -> str:
    """``roofline``'s table as printed: per step the FLOPs and bytes per device it used (the
    larger of the compiler's and the analytic count), seconds per call and per RL step."""
    r = roofline(result, chip)
    done = f"compiled for {result.get('platform', 'tpu').upper()}, not run"
    lines = [
        f"roofline per chip ({chip.name}: {chip.peak_bf16_flops / 1e12:.0f} bf16 TFLOP/s, "
        f"{chip.bandwidth_Bps / 1e9:.0f} GB/s HBM; {done}):",
        f"{'step':<10}{'TFLOP/dev':>11}{'GB/dev':>9}{'s/call':>9}{'calls':>7}{'s/step':>9}  bound",
    ]
    for name, x in r["steps"].items():
        lines.append(
            f"{name:<10}{x['flops'] / 1e12:>11.2f}{x['bytes'] / 1e9:>9.1f}"
            f"{x['seconds_per_call']:>9.3f}{x['calls']:>7}{x['calls'] * x['seconds_per_call']:>9.2f}"
            f"  {x['bound']}"
        )
    lines.append(
        f"estimated RL step {r['step_seconds']:.1f} s, MFU {r['mfu']:.0%} (roofline: "
        f"no communication, no overlap losses; {done})"
    )
    if "maxtext_step_seconds" in r:
        ref_mfu, what, _ = MAXTEXT_MFU[chip.name]
        lines.append(
            f"MaxText-calibrated RL step {r['maxtext_step_seconds']:.1f} s, MFU "
            f"{r['maxtext_mfu']:.0%} (update and log-prob passes at MaxText's published "
            f"{ref_mfu:.1%} MFU on {chip.name}, {what}; sampler at its roofline)"
        )
    return "\n".join(lines)


def _bytes_per_device(tree) -> int:
    """Per-device bytes of a pytree of ShapeDtypeStruct/arrays with shardings (largest shard)."""
    import jax

    total = 0
    for x in jax.tree.leaves(tree):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            continue  # static leaves (Python numbers of a sampling config)
        shape = (
            x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        )
        total += math.prod(shape) * x.dtype.itemsize
    return total


def _memory(compiled) -> dict:
    m = compiled.memory_analysis()
    if m is None:
        raise RuntimeError("this backend's compiled.memory_analysis() returned None")
    out = {
        "argument": int(m.argument_size_in_bytes),
        "output": int(m.output_size_in_bytes),
        "temp": int(m.temp_size_in_bytes),
        "alias": int(m.alias_size_in_bytes),
        "code": int(m.generated_code_size_in_bytes),
    }
    out["total"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
    return out


# On the CPU stand-in only the buffer assignment matters, not the speed of the generated code:
# skip LLVM's optimisation passes (the memory figures are the same, the compile is much shorter).
_FAST_CPU_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _exhausted(message: str, argument_bytes: int) -> dict:
    """A step entry for a program the TPU compiler refused for lack of HBM: its temporaries as
    the compiler states them ("... HLO temporaries (100.10G) exceeds available HBM (95.74G)",
    G = GiB), the inputs' bytes per device as the arguments, no cost figures; ``oom`` keeps the
    compiler's line."""
    m = re.search(r"temporaries \(([\d.]+)([KMGT])\)", message)
    scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    temp = int(float(m.group(1)) * scale[m.group(2)]) if m else 0
    line = next((x for x in message.splitlines() if "RESOURCE_EXHAUSTED" in x), message)
    return {
        "argument": int(argument_bytes),
        "output": 0,
        "temp": temp,
        "alias": 0,
        "code": 0,
        "total": int(argument_bytes) + temp,
        "lower_s": 0.0,
        "compile_s": 0.0,
        "flops": 0.0,
        "bytes": 0.0,
        "oom": line.strip()[:300],
    }


def _cost(compiled) -> dict:
    """The compiler's FLOP and byte counts per device (``compiled.cost_analysis()``); zeros
    when the backend gives none. XLA counts a ``while`` loop's body once: for the sampler's
    decode loop (and scanned layers, where the compiler does not unroll them) these are lower
    bounds, which is why the roofline also uses the analytic model FLOPs (``_model_flops``)."""
    c = compiled.cost_analysis()
    if isinstance(c, (list, tuple)):
        c = c[0] if c else {}
    c = c or {}
    return {"flops": float(c.get("flops", 0.0)), "bytes": float(c.get("bytes accessed", 0.0))}


def cudnn_attention_calls(hlo_text: str) -> int:
    """The number of cuDNN fused-attention custom calls (``__cudnn$fmha...``: forward and
    backward) in an optimised HLO module's text."""
    return len(re.findall(r'custom_call_target="__cudnn\$fmha', hlo_text))


def _compile_for(fn, *args, mesh=None, platform="cpu", **kwargs):
    """Lowers (with ``mesh`` as the abstract-mesh context, as ``sharding.under_mesh`` sets it in
    training) and compiles ``fn`` for ``platform`` (the mesh's devices: virtual CPUs, or a TPU
    topology's devices, compiled by libtpu); returns (compiled, {"lower_s", "compile_s"})."""
    import jax

    t0 = time.perf_counter()
    if mesh is None:
        lowered = fn.lower(*args, **kwargs)
    else:
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            lowered = fn.lower(*args, **kwargs)
    t1 = time.perf_counter()
    cpu = platform == "cpu"
    compiled = lowered.compile(compiler_options=_FAST_CPU_COMPILE) if cpu else lowered.compile()
    t2 = time.perf_counter()
    return compiled, {"lower_s": round(t1 - t0, 1), "compile_s": round(t2 - t1, 1)}


def _abstract_packed_plan(exp, rows: int, length: int, replicated):
    """(an abstract `packing.MicroBatches` of ``rows`` rows of ``length`` tokens, its label)
    when the run packs (``algorithm.pack_sequences``; else (None, "")): k buffers of
    T = length - 1 tokens per micro-batch, as many micro-batches as rows filling a buffer each
    would need (the count is only the scan's length), the LM head on Lc slots per buffer (one
    full-length completion), replicated as `Steps.train` takes it."""
    import jax
    import jax.numpy as jnp

    from grpo_jax import packing, steps

    if not exp.batching.pack_sequences:
        return None, ""
    T, k = steps.packing_shape(exp, length)
    M, H = packing.num_buckets(-(-rows // k)), exp.max_new_tokens
    i32 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=replicated)
    plan = packing.MicroBatches(*[i32((M, k, T))] * 4, *[i32((M, k, H))] * 3, i32((rows,)))
    return plan, f"packed: {k} buffers of {T} tokens per forward/backward, LM head on {H} each"


def compile_steps(
    config,
    *,
    sampler: str = "full",
    update: bool = True,
    logprobs: bool = True,
    devices=None,
) -> dict:
    """Lowers and compiles the update, sampler and log-prob steps of ``config`` abstractly.

    Uses the current JAX devices (``config.mesh`` must match them, as in a real run). Nothing is
    allocated: every input is a ``jax.ShapeDtypeStruct`` with its sharding.

    Args:
      config: an experiment ConfigDict (``configs/*.py``); ``model.hf_checkpoint`` / ``gguf_path``
        are ignored (the preset's architecture is compiled).
      sampler: "full" (``sampling.generate``: prefill + while-loop decode), "decode" (one prefill
        call and one decode call on the full-size KV cache) or "none".
      update, logprobs: whether to compile the update and the log-prob pass.
      devices: the mesh's devices (default ``jax.devices()``); ``tpu_devices(...)`` compiles
        with the TPU compiler for a slice that is not here.

    Returns:
      ``{"mesh", "batch", "params", "state_bytes", "ref_bytes", "steps": {name: {memory..., lower_s,
      compile_s, resident_extra, peak}}, "peak"}``; bytes are per device.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from grpo_jax import algorithms, generation_layout, sampling, sharding
    from grpo_jax import state as state_lib
    from grpo_jax import steps as steps_lib
    from grpo_jax.experiment import build_experiment
    from grpo_jax.models import transformer

    config = config.copy_and_resolve_references()
    config.model.hf_checkpoint = ""
    config.model.gguf_path = ""
    exp = build_experiment(config, with_data=False, devices=devices)
    gen_layout = generation_layout.for_experiment(exp)  # the sampler's (mesh, shardings)
    state = exp.abstract_state  # ShapeDtypeStructs with the run's shardings
    fns = steps_lib.make_steps(exp)
    mesh = exp.mesh
    platform = mesh.devices.flat[0].platform

    def _compile(fn, *args, **kwargs):
        """memory_analysis + times + cost_analysis of one program, or `_exhausted`'s entry when
        the TPU compiler itself finds that the program does not fit the chip's memory."""
        try:
            compiled, times = _compile_for(fn, *args, platform=platform, **kwargs)
        except jax.errors.JaxRuntimeError as e:
            if platform == "cpu" or "RESOURCE_EXHAUSTED" not in str(e):
                raise
            return _exhausted(str(e), _bytes_per_device(args))
        info = {**_memory(compiled), **times, **_cost(compiled)}
        if platform == "gpu":  # which attention XLA:GPU emitted (the cuDNN fused kernel or not)
            info["cudnn_fmha_calls"] = cudnn_attention_calls(compiled.as_text())
        return info

    P, n_bar = config.rollout.prompts_per_step, config.rollout.rollouts_per_prompt
    R, mb = P * n_bar, exp.batching.mini_batch_size
    Lp, Lc = exp.prompt_len, exp.max_new_tokens

    def batched(shape, dtype):
        return jax.ShapeDtypeStruct(
            shape, jnp.dtype(dtype), sharding=sharding.batch_sharding(mesh, len(shape))
        )

    repl = NamedSharding(mesh, PartitionSpec())
    state_bytes = _bytes_per_device(state)
    params_bytes = _bytes_per_device(state.params)
    needs_ref = config.algorithm.kl_coef > 0
    ref_bytes = params_bytes if needs_ref else 0  # the frozen reference: a copy of the parameters
    steps = {}

    # 1. the update (one mini-batch).
    lc_shape = (mb, Lc)
    per_token = exp.learner.per_token_advantages  # PPO: per-token advantages and critic targets
    fields = dict(
        tokens=batched((mb, Lp + Lc), "int32"),
        attention_mask=batched((mb, Lp + Lc), "bool"),
        completion_mask=batched(lc_shape, "float32"),
        advantages=batched(lc_shape if per_token else (mb,), "float32"),
        sample_weights=batched((mb,), "float32"),
        old_logprobs=batched(lc_shape, "float32"),
        ref_logprobs=batched(lc_shape, "float32"),
        sampler_logprobs=batched(lc_shape, "float32"),
    )
    if per_token:
        batch = algorithms.PPOBatch(
            **fields, returns=batched(lc_shape, "float32"), old_values=batched(lc_shape, "float32")
        )
    else:
        batch = state_lib.Batch(**fields)

    if update:
        micro_plan, packed_what = _abstract_packed_plan(exp, mb, Lp + Lc, repl)
        info = _compile(fns.update, state, batch, micro_plan)
        per_pass = packed_what or f"{exp.batching.micro_batch_size} per forward/backward" * (
            exp.batching.micro_batch_size < mb
        )
        steps["update"] = {
            **info,
            "resident_extra": ref_bytes,
            "rows": mb,
            "what": f"update, {mb} rollouts x {Lp}+{Lc} tokens{', ' * bool(per_pass)}{per_pass}",
        }

    # 2. the sampler (G = generate_batch_size rows per call, R / G calls; Lp + Lc cache slots).
    G = exp.batching.generate_batch_size
    rng = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=repl)
    not_args = state_bytes - params_bytes + ref_bytes  # optimizer state, reference: resident
    slots = exp.train_sampling.decode_slots
    if sampler == "full" and slots:  # continuous batching: `slots` decode rows refilled
        info = _compile(
            sampling._generate_continuous,
            exp.graphdef,
            state.params,
            batched((G, Lp), "int32"),
            batched((G, Lp), "bool"),
            rng,
            batched((G,), "int32"),
            exp.train_sampling,
            slots,
            mesh=mesh,
        )
        steps["sampler"] = {
            **info,
            "resident_extra": not_args,
            "rows": G,
            "what": f"generate, continuous batching: {G} rows per call ({R // G} calls) through "
            f"{slots} decode slots, {Lp}+{Lc}-slot KV cache",
        }
    elif sampler == "full":
        steps.update(_compile_full_sampler(exp, gen_layout, _compile, state, ref_bytes, not_args))
    elif sampler == "decode":
        mc = exp.model_config
        cache_shape = (mc.num_layers, G, Lp + Lc, mc.num_kv_heads, mc.head_dim)
        kv_sharding = NamedSharding(mesh, PartitionSpec(None, ("data", "fsdp")))
        cache = transformer.KVCache(
            k=jax.ShapeDtypeStruct(cache_shape, jnp.dtype(mc.dtype), sharding=kv_sharding),
            v=jax.ShapeDtypeStruct(cache_shape, jnp.dtype(mc.dtype), sharding=kv_sharding),
            key_mask=batched((G, Lp + Lc), "bool"),
            index=jax.ShapeDtypeStruct((), jnp.int32, sharding=repl),
        )
        graphdef = exp.graphdef

        def call(params, tokens, positions, mask, cache):
            model = nnx.merge(graphdef, params)
            hidden, cache = model(tokens, positions, mask, cache=cache, return_hidden=True)
            return model.logits(hidden[:, -1]), cache

        call = jax.jit(call, donate_argnums=4)
        for name, T in (("prefill", Lp), ("decode", 1)):
            info = _compile(
                call,
                state.params,
                batched((G, T), "int32"),
                batched((G, T), "int32"),
                batched((G, T), "bool"),
                cache,
                mesh=mesh,
            )
            steps[name] = {
                **info,
                "resident_extra": not_args,
                "rows": G,
                "what": f"{name} call, {G} rows x {T} tokens on the {Lp}+{Lc}-slot KV cache",
            }

    # 3. reference / old log-probs over the whole batch (rl_step calls it on all R rows).
    if logprobs and (needs_ref or not exp.batching.on_policy):
        rows = R
        micro_plan, packed_what = _abstract_packed_plan(exp, rows, Lp + Lc, repl)
        info = _compile(
            fns.logprobs,
            state.params,
            batched((rows, Lp + Lc), "int32"),
            batched((rows, Lp + Lc), "bool"),
            micro_plan,
        )
        # resident while it runs: the whole state plus the reference, minus the parameters passed in
        steps["logprobs"] = {
            **info,
            "resident_extra": state_bytes + ref_bytes - params_bytes,
            "rows": rows,
            "what": f"reference/old log-probs, {rows} rows x {Lp}+{Lc} tokens, "
            + (packed_what or f"{exp.batching.micro_batch_size} rows at a time"),
        }
    for s in steps.values():
        s["peak"] = s["total"] + s["resident_extra"]
    return {
        "generation_layout": _generation_record(gen_layout, state, exp.model_config.dtype),
        "mesh": dict(mesh.shape),
        "devices": mesh.size,
        "platform": platform,
        "device_kind": mesh.devices.flat[0].device_kind,
        "attention_impl": exp.model_config.attention_impl,
        "batch": {
            "R": R,
            "mini_batch": mb,
            "micro_batch": exp.batching.micro_batch_size,
            "generate_batch": exp.batching.generate_batch_size,
            "decode_slots": slots,
            "prompt_tokens": Lp,
            "new_tokens": Lc,
        },
        "params": exp.model_config.num_params,
        "kv_bytes_per_row": 2
        * exp.model_config.num_layers
        * (Lp + Lc)
        * exp.model_config.num_kv_heads
        * exp.model_config.head_dim
        * jnp.dtype(exp.model_config.dtype).itemsize,
        "state_bytes": state_bytes,
        "params_bytes": params_bytes,
        "ref_bytes": ref_bytes,
        "steps": steps,
        "peak": max(s["peak"] for s in steps.values()),
    }


def _compile_full_sampler(exp, gen_layout, compile_fn, state, ref_bytes: int, not_args: int):
    """The static sampler (`sampling._generate`, prefill + while-loop decode) on the training
    mesh, or in the generation layout when one is configured (`_compile_generation_layout`)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from grpo_jax import sampling, sharding

    if gen_layout[0] is not None:
        return _compile_generation_layout(exp, gen_layout, compile_fn, state, ref_bytes)
    mesh, Lp, Lc = exp.mesh, exp.prompt_len, exp.max_new_tokens
    G, R = exp.batching.generate_batch_size, exp.batching.rollouts_per_step

    def batched(shape, dtype):
        return jax.ShapeDtypeStruct(
            shape, jnp.dtype(dtype), sharding=sharding.batch_sharding(mesh, len(shape))
        )

    rng = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=NamedSharding(mesh, PartitionSpec()))
    info = compile_fn(
        sampling._generate,
        exp.graphdef,
        state.params,
        batched((G, Lp), "int32"),
        batched((G, Lp), "bool"),
        rng,
        exp.train_sampling,
        mesh=mesh,
    )
    return {
        "sampler": {
            **info,
            "resident_extra": not_args,
            "rows": G,
            "what": f"generate, {G} rows per call ({R // G} calls), {Lp}+{Lc}-slot KV cache",
        }
    }


def _generation_record(gen_layout, state, dtype) -> dict | None:
    """The generation layout's name and parameter bytes per device (None without one)."""

    if gen_layout[0] is None:
        return None
    gmesh, gsh = gen_layout
    return {
        "layout": f"{gmesh.shape['data']}x{gmesh.shape['tensor']}",
        "param_bytes": _bytes_per_device(_generation_params(gen_layout, state, dtype)),
    }


def _generation_params(gen_layout, state, dtype):
    """The sampler's parameters (abstract) in the generation layout: the training ones cast
    to the compute ``dtype`` (`generation_layout.reshard_program`) with its shardings."""
    import jax

    from grpo_jax import generation_layout

    shapes = jax.eval_shape(generation_layout.reshard_program(gen_layout[1], dtype), state.params)
    return jax.tree.map(
        lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes, gen_layout[1]
    )


def _compile_generation_layout(exp, gen_layout, compile_fn, state, ref_bytes: int) -> dict:
    """The sampler compiled in the generation layout (``gen_layout``: its mesh and parameter
    shardings, `generation_layout.for_experiment`; rows over its data axis; the parameters in
    the compute dtype) and the reshard into it (`generation_layout.reshard_program`, from the
    training shardings).
    Resident beside each: the whole training state and the reference (the training
    parameters stay where they are; the generation copy is an argument / output)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from grpo_jax import generation_layout, sampling, sharding

    gmesh, gsh = gen_layout
    Lp, Lc = exp.prompt_len, exp.max_new_tokens
    G, R = exp.batching.generate_batch_size, exp.batching.rollouts_per_step
    state_bytes = _bytes_per_device(state)
    gparams = _generation_params(gen_layout, state, exp.model_config.dtype)

    def rows(shape, dtype):
        return jax.ShapeDtypeStruct(
            shape, jnp.dtype(dtype), sharding=sharding.batch_sharding(gmesh, len(shape))
        )

    rng = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=NamedSharding(gmesh, PartitionSpec()))
    layout = f"{gmesh.shape['data']} x {gmesh.shape['tensor']}"
    sampler = compile_fn(
        sampling._generate,
        exp.graphdef,
        gparams,
        rows((G, Lp), "int32"),
        rows((G, Lp), "bool"),
        rng,
        exp.train_sampling,
        mesh=gmesh,
    )
    reshard = compile_fn(
        generation_layout.reshard_program(gsh, exp.model_config.dtype), state.params
    )
    return {
        "sampler": {
            **sampler,
            "resident_extra": state_bytes + ref_bytes,
            "rows": G,
            "what": f"generate in the generation layout (data x tensor {layout}), {G} rows per "
            f"call ({R // G} calls), {Lp}+{Lc}-slot KV cache",
        },
        "reshard": {
            **reshard,
            "resident_extra": state_bytes - _bytes_per_device(state.params) + ref_bytes,
            "rows": 0,
            "what": f"reshard: the parameters from the training layout to data x tensor {layout}",
        },
    }


def verdict(peak: int, chip: Chip, headroom: float) -> str:
    usable = chip.memory_bytes * headroom
    if peak <= usable:
        return "fits"
    return "does not fit"


def fits_on(peak: int, headroom: float) -> str:
    """The chips of ``CHIPS`` whose usable memory holds ``peak`` bytes per device."""
    return ", ".join(
        c.name.replace("NVIDIA ", "").replace(" SXM", "")
        for c in CHIPS.values()
        if peak <= c.memory_bytes * headroom
    )


def advice(result: dict) -> str:
    """What to change when a step does not fit (from which step is the largest)."""
    worst = max(result["steps"], key=lambda k: result["steps"][k]["peak"])
    tips = {
        "update": "accumulate gradients over smaller micro-batches (--micro_batch / "
        "config.algorithm.micro_batch_size), shard more "
        "(config.mesh.fsdp / a bigger slice), or shorten rollout.max_new_tokens",
        "sampler": "generate fewer rows per call (--generate_batch / config.rollout.generate_batch_size) "
        "or over more chips; the KV "
        "cache is layers x rows x (prompt + new tokens) x kv_heads x head_dim",
        "prefill": "the prefill: fewer rows per sampler call (--generate_batch) or more chips",
        "decode": "the KV cache: fewer rows per sampler call (--generate_batch) or more chips",
        "logprobs": "the reference/old log-prob pass (one mini-batch of rows at a time): lower "
        "config.algorithm.mini_batch_size, or use more chips",
    }
    return f"largest step: {worst} ({result['steps'][worst]['what']}); {tips[worst]}"


def _fmt(b: int) -> str:
    return f"{b / GiB:.1f}"


def format_result(result: dict, chip: Chip, headroom: float, label: str = "") -> str:
    lines = [
        f"{label} mesh {result['mesh']} ({result['devices']} x {chip.name}, "
        f"{_fmt(chip.memory_bytes)} GiB each); {result['params'] / 1e9:.2f}B params; "
        f"state {_fmt(result['state_bytes'])} GiB/device (+ reference {_fmt(result['ref_bytes'])} GiB)",
        f"{'step':<10}{'args':>8}{'out':>8}{'temp':>8}{'alias':>8}{'total':>8}{'+resident':>10}"
        f"{'peak':>8}  compile   (GiB per device)",
    ]
    for name, s in result["steps"].items():
        lines.append(
            f"{name:<10}{_fmt(s['argument']):>8}{_fmt(s['output']):>8}{_fmt(s['temp']):>8}"
            f"{_fmt(s['alias']):>8}{_fmt(s['total']):>8}{_fmt(s['resident_extra']):>10}"
            f"{_fmt(s['peak']):>8}  {s['lower_s'] + s['compile_s']:.0f} s   {s['what']}"
            + (" [the TPU compiler: out of HBM; temp as it states it]" if s.get("oom") else "")
        )
    v = verdict(result["peak"], chip, headroom)
    lines.append(
        f"peak {_fmt(result['peak'])} GiB vs {_fmt(chip.memory_bytes * headroom)} GiB usable "
        f"({headroom:.0%} of {_fmt(chip.memory_bytes)}): {v}"
    )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- CLI

_DEFAULT_TOPOLOGY = "v5p-8"
SWEEP_SIZES = ("1.7b", "4b", "8b")
SWEEP_ALGORITHMS = ("grpo", "prompt_gdro", "rollout_gdro")


def _early_device_count(argv) -> int | None:
    """The virtual device count from --topology / --devices, read before JAX starts (None: the
    devices come from a TPU or GPU topology description, not from virtual CPUs)."""

    def value(name):
        for i, a in enumerate(argv):
            if a.startswith(f"--{name}="):
                return a.split("=", 1)[1]
            if a == f"--{name}" and i + 1 < len(argv):
                return argv[i + 1]
        return None

    if value("sweep") or value("tpu_table") or value("gpu_table"):
        return None  # each config runs in its own subprocess; a table compiles nothing
    topology = value("topology") or _DEFAULT_TOPOLOGY
    try:
        if choose_compiler(topology, value("compiler") or "auto") != "cpu":
            return None
    except cli.UsageError:
        return None  # said once the flags are parsed (an unknown flag is named first)
    if value("devices"):
        return int(value("devices"))
    return parse_topology(topology)[1]


def choose_compiler(topology: str, compiler: str) -> str:
    """ "tpu" | "gpu" | "cpu" for ``--compiler`` (auto: the real compiler of the topology's chip,
    libtpu for TPU slices and XLA:GPU for GPUs, when its plugin is installed).

    The XLA:CPU stand-in on virtual devices ("cpu") is kept for two reasons only: a TPU slice
    on a machine without libtpu (its partitioning is the real one), and an explicit
    ``--compiler=cpu`` to reproduce the older CPU tables of ``reports/aot.md``. For GPUs it is
    no longer chosen by itself: without the CUDA plugin the script exits saying how to install
    it, because XLA:CPU's fusion, layout and memory plan (and its einsum attention) are nothing
    like XLA:GPU's.

    Raises:
      cli.UsageError: a compiler that does not match the topology, or a missing plugin.
    """
    gpu = is_gpu_topology(topology)
    if compiler == "cpu":
        return "cpu"
    if compiler == "tpu" or (compiler == "auto" and not gpu):
        if gpu:
            raise cli.UsageError(f"--compiler=tpu: --topology={topology} is not a TPU slice")
        missing = libtpu_missing()
        if compiler == "tpu" and missing:
            raise cli.UsageError(f"--compiler=tpu: {missing}")
        return "cpu" if missing else "tpu"
    if not gpu:
        raise cli.UsageError(f"--compiler=gpu: --topology={topology} is not a GPU topology")
    missing = cuda_plugin_missing()
    if missing:
        raise cli.UsageError(
            f"--topology={topology}: XLA:GPU compiles it without a GPU, but {missing}; "
            "--compiler=cpu gives the older XLA:CPU stand-in"
        )
    return "gpu"


def _set_virtual_devices(n: int) -> None:
    flags = re.sub(
        r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")
    )
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    os.environ["JAX_PLATFORMS"] = "cpu"


@cli.entry_point
def main(argv=None):
    argv = list(sys.argv if argv is None else argv)
    n = _early_device_count(argv[1:])
    if n:
        _set_virtual_devices(n)  # before JAX creates its CPU client
    else:
        os.environ["JAX_PLATFORMS"] = "cpu"  # TPU path: the default backend stays the CPU
    from absl import flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", "configs/dapo_qwen3.py:8b,grpo", "Experiment config.")
    flags.DEFINE_string(
        "topology",
        _DEFAULT_TOPOLOGY,
        "Target: v5p-8 (4 chips), v5p-64, v4-32, v5e-16, v6e-8, h100-8, h200-64, b200-8, ...",
    )
    flags.DEFINE_integer("devices", 0, "Virtual devices (default: the topology's chips).")
    flags.DEFINE_enum(
        "compiler",
        "auto",
        ["auto", "tpu", "gpu", "cpu"],
        "tpu: the real TPU compiler (libtpu, no TPU needed) on the slice's devices; gpu: "
        "XLA:GPU (the CUDA plugin, no GPU needed) on the node(s)' devices; cpu: the XLA:CPU "
        "stand-in on virtual devices; auto: the real compiler of the chip when its plugin is "
        "installed (choose_compiler).",
    )
    flags.DEFINE_integer("num_slices", 1, "TPU slices (multi-slice over DCN; TPU compiler only).")
    flags.DEFINE_string(
        "mesh", "", "data,fsdp,tensor override, e.g. 1,-1,1 or 1,4,2 (default: the config's)."
    )
    flags.DEFINE_integer(
        "mini_batch", 0, "Rollouts per gradient step (config.algorithm.mini_batch_size)."
    )
    flags.DEFINE_integer(
        "micro_batch",
        0,
        "Rollouts per forward/backward, gradients accumulated (config.algorithm.micro_batch_size).",
    )
    flags.DEFINE_integer(
        "generate_batch", 0, "Rollouts per sampler call (config.rollout.generate_batch_size)."
    )
    flags.DEFINE_enum("sampler", "full", ["full", "decode", "none"], "How to compile the sampler.")
    flags.DEFINE_list(
        "skip",
        [],
        "Programs not to compile: update, logprobs (e.g. when only the sampler in a generation "
        "layout, --config.rollout.generation_layout=8x8, is new).",
    )
    flags.DEFINE_float("headroom", 0.95, "Fraction of the chip's memory the peak may use.")
    flags.DEFINE_string("json_out", "", "Write the result as JSON here.")
    flags.DEFINE_string(
        "sweep", "", "Write a markdown report of 3 sizes x 3 algorithms here (subprocesses)."
    )
    flags.DEFINE_string("sweep_sizes", ",".join(SWEEP_SIZES), "Sizes for --sweep.")
    flags.DEFINE_string("sweep_algorithms", ",".join(SWEEP_ALGORITHMS), "Algorithms for --sweep.")
    flags.DEFINE_integer("timeout_s", 3600, "Per-config timeout for --sweep subprocesses.")
    flags.DEFINE_string(
        "tpu_table",
        "",
        "Print the markdown table of these TPU-compiled results (comma-separated --json_out "
        "files and --sweep .jsonl files) and exit; compiles nothing.",
    )
    flags.DEFINE_string(
        "gpu_table", "", "The same for XLA:GPU-compiled results (peaks per GPU, cuDNN attention)."
    )
    cli.run_absl(lambda _: _run(flags.FLAGS), argv=argv)


def _read_records(paths: str) -> list[dict]:
    records = []
    for path in paths.split(","):
        with open(path) as f:
            records += (
                [json.loads(line) for line in f if line.strip()]
                if path.endswith(".jsonl")
                else [json.load(f)]
            )
    return records


def _run(FLAGS):
    if FLAGS.tpu_table or FLAGS.gpu_table:
        table = tpu_table if FLAGS.tpu_table else gpu_table
        print(table(_read_records(FLAGS.tpu_table or FLAGS.gpu_table)), end="")
        return None
    chip, count = parse_topology(FLAGS.topology)
    if FLAGS.sweep:
        return _sweep(FLAGS, chip)
    config = FLAGS.config
    if FLAGS.mesh:
        parts = [int(p) for p in FLAGS.mesh.split(",")]
        if len(parts) != 3:
            raise cli.UsageError(f"--mesh={FLAGS.mesh}: expected data,fsdp,tensor")
        config.mesh.data, config.mesh.fsdp, config.mesh.tensor = parts
    if FLAGS.mini_batch:
        config.algorithm.mini_batch_size = FLAGS.mini_batch
    if FLAGS.micro_batch:
        config.algorithm.micro_batch_size = FLAGS.micro_batch
    if FLAGS.generate_batch:
        config.rollout.generate_batch_size = FLAGS.generate_batch
    import jax

    from grpo_jax import config_utils

    compiler = choose_compiler(FLAGS.topology, FLAGS.compiler)
    if compiler != "cpu":
        return _run_compiled(FLAGS, config, chip, compiler)
    if len(jax.devices()) != (FLAGS.devices or count):
        raise cli.UsageError(
            f"JAX sees {len(jax.devices())} devices, the topology needs {FLAGS.devices or count}: "
            "run as a fresh process (XLA_FLAGS is set before JAX starts)"
        )
    config_utils.validate(config)  # a ConfigError: one `error:` line, exit 2 (cli.run_absl)
    result = compile_steps(config, sampler=FLAGS.sampler)
    result.update(
        topology=FLAGS.topology,
        chip=chip.name,
        chip_bytes=chip.memory_bytes,
        headroom=FLAGS.headroom,
        verdict=verdict(result["peak"], chip, FLAGS.headroom),
        sampler_mode=FLAGS.sampler,
    )
    print(format_result(result, chip, FLAGS.headroom, label=FLAGS.topology), flush=True)
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(result, f, indent=2)
    if result["verdict"] != "fits":
        print(
            f"error: does not fit on {FLAGS.topology} ({chip.name}): peak {_fmt(result['peak'])} GiB per "
            f"device > {_fmt(chip.memory_bytes * FLAGS.headroom)} GiB usable. {advice(result)}",
            file=sys.stderr,
        )
        sys.exit(1)


_COMPILER_LABELS = {
    "tpu": ("TPU compiler (libtpu)", "tpu (libtpu; compiled for TPU, not run)"),
    "gpu": ("XLA:GPU (CUDA plugin, deviceless)", "gpu (XLA:GPU; compiled for GPU, not run)"),
}


def _run_compiled(FLAGS, config, chip, compiler: str):
    """``_run`` with a real compiler: the mesh is made of the topology's devices (libtpu's
    slice description, or XLA:GPU's deviceless CUDA topology), every program is compiled for
    them, and the roofline estimate is added. Nothing runs: every figure is "compiled for
    TPU/GPU, not run"."""
    from grpo_jax import config_utils

    if FLAGS.num_slices > 1 and compiler != "tpu":
        raise cli.UsageError("--num_slices: TPU slices only (GPU nodes: --topology=h100-64)")
    if FLAGS.num_slices > 1 and config.mesh.data % FLAGS.num_slices:
        raise cli.UsageError(
            f"--num_slices={FLAGS.num_slices}: the mesh's data axis ({config.mesh.data}) must be "
            "a multiple of the slice count, so that only data parallelism crosses the slower "
            f"links between slices (e.g. --mesh={FLAGS.num_slices},-1,1: FSDP within a slice)"
        )
    if compiler == "tpu":
        devices = tpu_devices(FLAGS.topology, FLAGS.num_slices)
    else:
        devices = gpu_devices(FLAGS.topology)
    label = f"{FLAGS.topology}{f' x {FLAGS.num_slices} slices' if FLAGS.num_slices > 1 else ''}"
    banner, tag = _COMPILER_LABELS[compiler]
    config_utils.validate(config)  # a ConfigError: one `error:` line, exit 2 (cli.run_absl)
    result = compile_steps(
        config,
        sampler=FLAGS.sampler,
        devices=devices,
        update="update" not in FLAGS.skip,
        logprobs="logprobs" not in FLAGS.skip,
    )
    est = roofline(result, chip)
    result.update(
        topology=label,
        compiler=tag,
        chip=chip.name,
        chip_bytes=chip.memory_bytes,
        headroom=FLAGS.headroom,
        verdict=verdict(result["peak"], chip, FLAGS.headroom),
        sampler_mode=FLAGS.sampler,
        roofline=est,
    )
    print(f"{banner}, {len(devices)} x {result['device_kind']}: compiled, not run")
    if compiler == "gpu":
        print(_gpu_attention_line(result))
    print(format_result(result, chip, FLAGS.headroom, label=label), flush=True)
    print(format_roofline(result, chip), flush=True)
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(result, f, indent=2)
    if result["verdict"] != "fits":
        print(
            f"error: does not fit on {label} ({chip.name}, {banner}): peak "
            f"{_fmt(result['peak'])} GiB per device > {_fmt(chip.memory_bytes * FLAGS.headroom)} "
            f"GiB usable. {advice(result)}",
            file=sys.stderr,
        )
        sys.exit(1)


def _sweep(FLAGS, chip):
    """One subprocess per (size, algorithm); collects the JSON results into a markdown table."""
    import tempfile

    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.sweep)), exist_ok=True)
    rows = []
    for size in FLAGS.sweep_sizes.split(","):
        for algo in FLAGS.sweep_algorithms.split(","):
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
                path = f.name
            cmd = [
                sys.executable,
                "-m",
                "experiments.aot",
                f"--config=configs/dapo_qwen3.py:{size},{algo}",
                f"--topology={FLAGS.topology}",
                f"--sampler={FLAGS.sampler}",
                f"--headroom={FLAGS.headroom}",
                f"--json_out={path}",
            ]
            cmd += [f"--mesh={FLAGS.mesh}"] if FLAGS.mesh else []
            cmd += [f"--mini_batch={FLAGS.mini_batch}"] if FLAGS.mini_batch else []
            cmd += [f"--micro_batch={FLAGS.micro_batch}"] if FLAGS.micro_batch else []
            cmd += [f"--generate_batch={FLAGS.generate_batch}"] if FLAGS.generate_batch else []
            cmd += [f"--devices={FLAGS.devices}"] if FLAGS.devices else []
            cmd += [f"--compiler={FLAGS.compiler}", f"--num_slices={FLAGS.num_slices}"]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=FLAGS.timeout_s)
            wall = time.perf_counter() - t0
            print(
                proc.stdout,
                proc.stderr[-2000:] if proc.returncode not in (0, 1) else "",
                flush=True,
            )
            result = None
            if os.path.getsize(path):
                with open(path) as f:
                    result = json.load(f)
            os.remove(path)
            rows.append(
                (size, algo, result, wall, proc.returncode, proc.stderr.strip().splitlines()[-1:])
            )
            if result is not None:
                with open(os.path.splitext(FLAGS.sweep)[0] + ".jsonl", "a") as f:
                    f.write(
                        json.dumps(
                            {"size": size, "algorithm": algo, "wall_s": round(wall, 1), **result}
                        )
                        + "\n"
                    )
    with open(FLAGS.sweep, "a") as f:
        f.write(_markdown(rows, chip, FLAGS))
    print(f"appended to {FLAGS.sweep}")


def _size_label(params: int) -> str:
    """Qwen3-1.7B / 4B / 8B by parameter count (within 5%), else the count itself."""
    sizes = {"1.7B": 1.72e9, "4B": 4.02e9, "8B": 8.19e9}
    near = min(sizes, key=lambda k: abs(sizes[k] - params))
    return (
        near if abs(sizes[near] - params) <= 0.05 * sizes[near] else f"{params / 1e9:.2f}B params"
    )


def _table_cells(r: dict) -> dict:
    """The cells shared by ``tpu_table`` and ``gpu_table`` for one compiled result."""
    b, st = r["batch"], r["steps"]
    algo = r.get("algorithm") or ("prompt_gdro" if b["R"] > 1024 else "rollout_gdro")
    algo = "grpo / rollout_gdro" if algo in ("grpo", "rollout_gdro") else algo
    sampler = st.get("sampler") or st.get("decode")
    settings = []
    if b.get("micro_batch") and b["micro_batch"] < b["mini_batch"]:
        settings.append(f"micro {b['micro_batch']}")
    calls = b["R"] // b["generate_batch"]
    settings.append(f"{calls} sampler call{'s' if calls > 1 else ''} of {b['generate_batch']}")
    if b.get("decode_slots"):
        settings[-1] += f" through {b['decode_slots']} decode slots"
    peaks = " / ".join(
        _fmt(x["peak"]) if x else "-" for x in (st["update"], sampler, st.get("logprobs"))
    )
    return {
        "key": (r["params"], algo, r["devices"], r["topology"]),
        "size": _size_label(r["params"]),
        "algo": algo,
        "settings": ", ".join(settings),
        "peaks": peaks,
        "verdict": f"{r['verdict']}, peak {_fmt(r['peak'])}",
    }


def tpu_table(records: list[dict]) -> str:
    """A markdown table of TPU-compiled results (``--json_out`` files or ``--sweep``'s .jsonl
    lines): model x algorithm x slice -> peaks per device, verdict, the roofline step time and
    MFU, and the MaxText-calibrated step (`roofline`, recomputed from the recorded counts).
    GRPO and Rollout-GDRO compile the same programs (R fixed; only segment ids move), so one
    row stands for both; Prompt-GDRO's rows are R = 2 x 1024."""
    by_name = {c.name: c for c in CHIPS.values()}
    out = [
        "| model | algorithm | slice (chips) | settings | update / sampler / log-prob peak "
        "(GiB per device) | verdict | roofline s per RL step (MFU) | MaxText-calibrated s (MFU) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    keyed = []
    for r in records:
        c, est = _table_cells(r), roofline(r, by_name[r["chip"]])
        cal = (
            f"{est['maxtext_step_seconds']:.1f} ({est['maxtext_mfu']:.0%})"
            if "maxtext_step_seconds" in est
            else "-"
        )
        keyed.append(
            (
                c["key"],
                f"| {c['size']} | {c['algo']} | {r['topology']} ({r['devices']}) | "
                f"{c['settings']} | {c['peaks']} | {c['verdict']} | {est['step_seconds']:.1f} "
                f"({est['mfu']:.0%}) | {cal} |",
            )
        )
    return "\n".join(out + [row for _, row in sorted(keyed)]) + "\n"


def gpu_table(records: list[dict]) -> str:
    """A markdown table of XLA:GPU-compiled results: model x algorithm x GPUs -> peaks per GPU,
    verdict, the attention XLA:GPU emitted (cuDNN fused-attention calls per program) and the
    roofline step (compiled for GPU, not run; no communication)."""
    by_name = {c.name: c for c in CHIPS.values()}
    out = [
        "| model | algorithm | GPUs | settings (mesh data x fsdp x tensor) | update / sampler / "
        "log-prob peak (GiB per GPU) "
        "| verdict | attention (cuDNN calls: update / sampler / log-prob) | roofline s per RL "
        "step (MFU) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    keyed = []
    for r in records:
        chip = by_name[r["chip"]]
        c, est = _table_cells(r), roofline(r, chip)
        gpus = f"{r['topology']} ({r['devices']} x {chip.name.replace('NVIDIA ', '')})"
        m = r.get("mesh", {})
        mesh = f"mesh {m['data']} x {m['fsdp']} x {m['tensor']}, " if m else ""
        keyed.append(
            (
                (*c["key"], mesh),
                f"| {c['size']} | {c['algo']} | {gpus} | {mesh}{c['settings']} | {c['peaks']} | "
                f"{c['verdict']} | {_attention_cell(r)} | {est['step_seconds']:.1f} "
                f"({est['mfu']:.0%}) |",
            )
        )
    return "\n".join(out + [row for _, row in sorted(keyed)]) + "\n"


def _attention_cell(r: dict) -> str:
    st = r["steps"]
    counts = " / ".join(
        str(st[k].get("cudnn_fmha_calls", "-")) if k in st else "-"
        for k in ("update", "sampler", "logprobs")
    )
    return f"{r.get('attention_impl', '?')} ({counts})"


def _gpu_attention_line(result: dict) -> str:
    """What attention the GPU programs hold: ``model.attention_impl`` as resolved for the
    mesh's GPUs and the cuDNN fused-attention custom calls XLA:GPU emitted per program."""
    impl = result["attention_impl"]
    calls = {k: s.get("cudnn_fmha_calls", 0) for k, s in result["steps"].items()}
    line = (
        f"attention: model.attention_impl resolved to {impl!r} for these GPUs; cuDNN "
        f"fused-attention calls in the optimised HLO: "
        + ", ".join(f"{k} {n}" for k, n in calls.items())
    )
    if impl == "cudnn" and not any(calls.values()):
        line += " (none: the programs fell back to XLA attention)"
    return line


def _markdown(rows, chip, FLAGS) -> str:
    out = [
        f"\n### {FLAGS.topology} ({chip.name}, {_fmt(chip.memory_bytes)} GiB per chip)"
        f"{', mesh ' + FLAGS.mesh if FLAGS.mesh else ''}\n",
        "| size | algorithm | mesh (data, fsdp, tensor) | batch | state + ref | update peak | sampler peak | "
        f"logprobs peak | peak | on {chip.name} | fits on (same count, {FLAGS.headroom:.0%} usable) | "
        "compile s (update / sampler / logprobs) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size, algo, r, wall, rc, err in rows:
        if r is None:
            out.append(
                f"| {size} | {algo} | | | | | | | | compile failed (rc {rc}): {' '.join(err)[:120]} | | {wall:.0f} |"
            )
            continue
        s = r["steps"]
        sampler = s.get("sampler") or s.get("decode")
        mesh = ", ".join(str(r["mesh"][k]) for k in ("data", "fsdp", "tensor"))
        b = r["batch"]

        def cell(x):
            return _fmt(x["peak"]) if x else "-"

        def secs(x):
            return f"{x['lower_s'] + x['compile_s']:.0f}" if x else "-"

        extra = "".join(
            f", {name}={b[key]}"
            for name, key in (("micro", "micro_batch"), ("gen", "generate_batch"))
            if b.get(key) and b[key] < (b["mini_batch"] if key == "micro_batch" else b["R"])
        )
        out.append(
            f"| {size} | {algo} | {mesh} | R={b['R']}, mb={b['mini_batch']}{extra}, {b['prompt_tokens']}+"
            f"{b['new_tokens']} tok | {_fmt(r['state_bytes'])} + ref {_fmt(r['ref_bytes'])} | "
            f"{cell(s['update'])} | {cell(sampler)} | {cell(s.get('logprobs'))} | {_fmt(r['peak'])} | "
            f"{r['verdict']} | {fits_on(r['peak'], FLAGS.headroom) or 'none'} | "
            f"{secs(s['update'])} / {secs(sampler)} / {secs(s.get('logprobs'))} |"
        )
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
