"""One prepared check for the day a GPU is at hand (at most ~8 minutes on one H100 / H200).

    python benchmarks/device_check.py                   # everything; writes JSON + a table
    python benchmarks/device_check.py --dry_run         # what it would run (any machine)
    python benchmarks/device_check.py --phases=identity,attention --out=/tmp/check

Phases, each in its own process with its own time limit (a phase that fails or times out is
recorded and the next one runs; phases left when ``--budget_s`` is spent are skipped):

  identity    the device (kind, count, memory), jax / jaxlib / CUDA plugin / cuDNN versions,
              ``nvidia-smi -L``;
  tests       the GPU-relevant tests on the GPU (attention implementations, chunked log-probs,
              the sampler, model parity), ``-m "not slow"``, with ``JAX_PLATFORMS=cuda,cpu``;
              tests written for tests/conftest.py's 8 virtual CPU devices may fail on 1 GPU:
              the failing ids are recorded, not judged;
  main_job    the README's embedded default (``experiments.run``, arithmetic GRPO), wall time
              and the last step reached within its limit;
  step_smollm2, step_qwen3_06b
              one GRPO step (after one untimed warm-up) of a SmolLM2-135M-shaped and of a
              Qwen3-0.6B-shaped model, random bf16 weights, on the embedded arithmetic task
              (``benchmarks/bench_step.py``): per-phase times, tokens/s, peak device memory;
  decode      decode tokens/s at 64 and 256 rows, SmolLM2-135M shape, bf16
              (``benchmarks/bench_decode.py``);
  attention   cuDNN vs XLA attention (``grpo_jax.models.attention``: "cudnn" against
              "blockwise" and "einsum") on a padded causal batch, outputs and gradients;
  memory      XLA:GPU's deviceless estimate (``experiments.aot`` on this chip's topology of
              one GPU) of the Qwen3-0.6B-shaped step's programs, beside the peak measured by
              ``step_qwen3_06b``.

Writes ``<out>/device_check.json`` (every phase's figures, command, exit status, output tail)
and ``<out>/device_check.md`` (a short table). Commit the JSON with the machine stated.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shlex
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable

# Model shapes with random weights on the embedded arithmetic task (its own small vocabulary):
# the SmolLM2-135M preset, and Qwen/Qwen3-0.6B's layers (config.json: 28 x 1024, 16 query /
# 8 kv heads of 128, MLP 3072) on the Qwen3 family's preset
_SMOLLM2 = ["model.preset=smollm2-135m", "model.overrides={}"]
_QWEN3_06B = [
    "model.preset=qwen3-1.7b",
    "model.overrides.hidden_size=1024",
    "model.overrides.intermediate_size=3072",
    "model.overrides.num_layers=28",
    "model.overrides.num_heads=16",
    "model.overrides.num_kv_heads=8",
    "model.overrides.head_dim=128",
]
_BF16 = ["model.dtype=bfloat16"]
GPU_TESTS = (
    "tests/test_attention_impl.py",
    "tests/test_chunked_logprobs.py",
    "tests/test_sampling.py",
    "tests/test_models.py",
)


def _sets(items) -> list[str]:
    return [f"--set={x}" for x in items]


def plan(out: str) -> dict[str, dict]:
    """Phase name -> {"cmd": argv, "timeout_s", "env": extra environment, "json": the file the
    phase writes (or None)}, in the order they run."""
    gpu = {"JAX_PLATFORMS": "cuda", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}
    step = [PY, "benchmarks/bench_step.py", "--steps=1", "--warmup=1"]
    return {
        "identity": {
            "cmd": [PY, "benchmarks/device_check.py", "--identity_json", f"{out}/identity.json"],
            "timeout_s": 30,
            "env": gpu,
            "json": f"{out}/identity.json",
        },
        "tests": {
            "cmd": [PY, "-m", "pytest", "-q", "-p", "no:xdist", "-m", "not slow", *GPU_TESTS],
            "timeout_s": 90,
            "env": {**gpu, "JAX_PLATFORMS": "cuda,cpu"},  # the GPU by default, the CPU beside it
            "json": None,
        },
        "main_job": {
            "cmd": [
                PY,
                "-m",
                "experiments.run",
                "--config=configs/arithmetic.py:grpo",
                f"--workdir={out}/main_job",
            ],
            "timeout_s": 75,
            "env": gpu,
            "json": None,
        },
        "step_smollm2": {
            "cmd": step + _sets(_SMOLLM2 + _BF16) + [f"--json_out={out}/step_smollm2.json"],
            "timeout_s": 60,
            "env": gpu,
            "json": f"{out}/step_smollm2.json",
        },
        "step_qwen3_06b": {
            "cmd": step + _sets(_QWEN3_06B + _BF16) + [f"--json_out={out}/step_qwen3_06b.json"],
            "timeout_s": 75,
            "env": gpu,
            "json": f"{out}/step_qwen3_06b.json",
        },
        "decode": {
            "cmd": [
                PY,
                "benchmarks/bench_decode.py",
                "--random=smollm2-135m",
                "--dtype=bfloat16",
                "--rows=64,256",
                f"--out={out}/decode.json",
            ],
            "timeout_s": 45,
            "env": gpu,
            "json": f"{out}/decode.json",
        },
        "attention": {
            "cmd": [PY, "benchmarks/device_check.py", "--attention_json", f"{out}/attention.json"],
            "timeout_s": 30,
            "env": gpu,
            "json": f"{out}/attention.json",
        },
        "memory": {
            # the chip's topology is filled in from the identity phase (skipped for a GPU
            # without a device description in experiments/_gpu_specs.py)
            "cmd": [
                PY,
                "-m",
                "experiments.aot",
                "--config=configs/arithmetic.py:grpo",
                *[f"--config.{x}" for x in _QWEN3_06B + _BF16],
                "--topology={chip}-1",
                "--compiler=gpu",
                "--headroom=1.0",
                f"--json_out={out}/memory.json",
            ],
            "timeout_s": 120,
            "env": {},  # experiments.aot sets JAX_PLATFORMS=cpu itself (deviceless)
            "json": f"{out}/memory.json",
        },
    }


def identity(path: str) -> None:
    """The device, its memory and the library versions, as JSON at ``path``."""
    import importlib.metadata

    import jax

    devices = jax.devices()
    info = {
        "backend": jax.default_backend(),
        "devices": len(devices),
        "device_kind": devices[0].device_kind,
        "memory_stats": devices[0].memory_stats() or {},
        "versions": {},
    }
    for pkg in ("jax", "jaxlib", "jax-cuda12-plugin", "nvidia-cudnn-cu12", "flax"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            info["versions"][pkg] = importlib.metadata.version(pkg)
    try:
        smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
        info["nvidia_smi"] = smi.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        info["nvidia_smi"] = ""
    from experiments.aot import CHIPS, chip_of_device

    chip = chip_of_device(devices[0].device_kind)
    info["chip"] = next((k for k, c in CHIPS.items() if c is chip), None)
    _write(path, info)


def attention(path: str) -> None:
    """cuDNN vs the XLA kernels on [4, 1024, 16, 128] bf16 queries over 8 kv heads, left padding
    + causal mask: max |difference| of the outputs (real rows) and of the gradients of a
    weighted sum with respect to q, k, v. JSON at ``path``."""
    import jax
    import jax.numpy as jnp

    from grpo_jax.models import attention as A

    B, T, H, K, D = 4, 1024, 16, 8, 128
    kq, kk, kv, kw = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(kq, (B, T, H, D), jnp.bfloat16)
    k = jax.random.normal(kk, (B, T, K, D), jnp.bfloat16)
    v = jax.random.normal(kv, (B, T, K, D), jnp.bfloat16)
    w = jax.random.normal(kw, (B, T, H, D), jnp.float32)
    pad = jnp.array([0, 17, 300, 1000])  # left padding per row
    key_mask = jnp.arange(T)[None] >= pad[:, None]
    mask = A.Mask(key_mask, offset=0)
    real = key_mask[:, :, None, None]  # rows with at least one visible key

    def loss(impl):
        def f(q, k, v):
            o = A.attend(q, k, v, mask, impl).astype(jnp.float32)
            return jnp.sum(jnp.where(real, o * w, 0.0)), o

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    ref = {impl: loss(impl) for impl in ("cudnn", "blockwise", "einsum")}
    (_, o_c), g_c = ref["cudnn"]
    out = {"shape": [B, T, H, D], "kv_heads": K, "padding": pad.tolist()}
    for impl in ("blockwise", "einsum"):
        (_, o_x), g_x = ref[impl]
        out[impl] = {
            "max_abs_out": float(jnp.max(jnp.where(real, jnp.abs(o_c - o_x), 0.0))),
            "max_abs_grad": [float(jnp.max(jnp.abs(a - b))) for a, b in zip(g_c, g_x)],
            "max_abs_grad_ref": [float(jnp.max(jnp.abs(b))) for b in g_x],
        }
    _write(path, out)


def _write(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, default=str)


def run_phase(name: str, spec: dict, budget_end: float) -> dict:
    """Runs one phase (its limit: the smaller of its own and what is left of the budget)."""
    left = budget_end - time.monotonic()
    if left < 5:
        return {"status": "skipped (budget spent)", "cmd": spec["cmd"]}
    env = {**os.environ, **spec["env"]}
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            spec["cmd"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=min(spec["timeout_s"], left),
        )
        status, rc, tail = ("ok" if proc.returncode == 0 else "failed"), proc.returncode, ""
        tail = (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as e:
        status, rc = "timed out", None
        tail = ((e.stdout or b"") + (e.stderr or b"")).decode(errors="replace")[-3000:]
    rec = {"status": status, "rc": rc, "seconds": round(time.monotonic() - t0, 1)}
    rec.update(cmd=spec["cmd"], output_tail=tail)
    if spec["json"] and os.path.exists(spec["json"]):
        with open(spec["json"]) as f:
            rec["result"] = json.load(f)
    return rec


def _main_job_steps(workdir: str) -> int | None:
    """The last RL step in the main job's metrics.jsonl (None if it wrote none)."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    steps = []
    with open(path) as f:
        for line in f:
            try:
                steps.append(json.loads(line).get("step"))
            except json.JSONDecodeError:
                continue
    steps = [s for s in steps if isinstance(s, int)]
    return max(steps) if steps else None


def table(report: dict) -> str:
    """The short markdown table of a device_check report."""
    ident = report["phases"].get("identity", {}).get("result", {})
    lines = [
        f"device check: {ident.get('devices', '?')} x {ident.get('device_kind', '?')} "
        f"({report['started']}; jax {ident.get('versions', {}).get('jax', '?')})",
        "",
        "| phase | status | s | figures |",
        "|---|---|---|---|",
    ]
    for name, rec in report["phases"].items():
        lines.append(
            f"| {name} | {rec['status']} | {rec.get('seconds', '-')} | {_figures(name, rec)} |"
        )
    return "\n".join(lines) + "\n"


def _figures(name: str, rec: dict) -> str:
    r = rec.get("result") or {}
    if name.startswith("step_") and r:
        peak = r.get("peak_bytes_in_use")
        return (
            f"{r['params'] / 1e6:.0f}M params; generate {r['generate_tokens_per_s']:.0f} tok/s, "
            f"update {r['update_tokens_per_s']:.0f} tok/s"
            + (f"; peak {peak / 2**30:.2f} GiB" if peak else "")
        )
    if name == "decode" and r:
        return json.dumps(r.get("rows", r))[:200]
    if name == "attention" and r:
        return "; ".join(
            f"vs {k}: out {r[k]['max_abs_out']:.3g}, grad {max(r[k]['max_abs_grad']):.3g}"
            for k in ("blockwise", "einsum")
        )
    if name == "memory" and r:
        return f"compiled-for-GPU peak {r['peak'] / 2**30:.2f} GiB (largest program)"
    if name == "main_job":
        return f"last step {rec.get('last_step')}"
    if name == "tests":  # pytest's summary line
        lines = (rec.get("output_tail") or "").strip().splitlines()
        return lines[-1][:150] if lines else ""
    return ""


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="", help="output folder (default reports/device_check/<time>)")
    p.add_argument("--phases", default=",".join(plan("OUT")), help="comma-separated subset")
    p.add_argument("--budget_s", type=float, default=480.0, help="total time limit (seconds)")
    p.add_argument("--dry_run", action="store_true", help="print the plan, run nothing")
    p.add_argument("--identity_json", default="", help=argparse.SUPPRESS)
    p.add_argument("--attention_json", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.identity_json:
        identity(args.identity_json)
        return 0
    if args.attention_json:
        attention(args.attention_json)
        return 0
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = os.path.abspath(args.out or os.path.join(REPO, "reports", "device_check", started))
    phases = plan(out)
    chosen = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = [p for p in chosen if p not in phases]
    if unknown or not chosen:
        print(
            f"error: --phases: unknown {unknown or 'none given'}; known: {list(phases)}",
            file=sys.stderr,
        )
        return 2
    if args.budget_s <= 0:
        print(f"error: --budget_s={args.budget_s}: must be positive", file=sys.stderr)
        return 2
    if os.path.exists(out) and not os.path.isdir(out):
        print(f"error: --out={out} is a file, not a folder", file=sys.stderr)
        return 2
    if args.dry_run:
        print(
            f"would write {out}/device_check.json and device_check.md; budget {args.budget_s:.0f} s"
        )
        for name in chosen:
            spec = phases[name]
            env = " ".join(f"{k}={v}" for k, v in spec["env"].items())
            cmd = shlex.join(spec["cmd"])
            print(f"[{name}] (limit {spec['timeout_s']} s) {env + ' ' if env else ''}{cmd}")
        return 0
    os.makedirs(out, exist_ok=True)
    report = {"started": started, "out": out, "phases": {}}
    budget_end = time.monotonic() + args.budget_s
    for name in chosen:
        spec = phases[name]
        if name == "memory":  # the deviceless compile for this GPU's own XLA description
            from experiments._gpu_specs import DEVICES

            chip = report["phases"].get("identity", {}).get("result", {}).get("chip")
            if chip not in DEVICES:
                report["phases"][name] = {
                    "status": f"skipped (no XLA:GPU device description for chip {chip!r})"
                }
                continue
            spec = {**spec, "cmd": [c.format(chip=chip) for c in spec["cmd"]]}
        rec = run_phase(name, spec, budget_end)
        if name == "main_job":
            rec["last_step"] = _main_job_steps(os.path.join(out, "main_job"))
        report["phases"][name] = rec
        print(f"[{name}] {rec['status']} ({rec.get('seconds', 0)} s)", flush=True)
        _write(os.path.join(out, "device_check.json"), report)
    text = table(report)
    with open(os.path.join(out, "device_check.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
