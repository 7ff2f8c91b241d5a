"""Per-phase time of one RL step, tokens/s, and the update's achieved FLOP/s vs the matmul peak.

  python benchmarks/bench_step.py                       # embedded default (arithmetic, tiny model)
  python benchmarks/bench_step.py --config=configs/gsm8k_smollm2.py:smoke --steps=3
  python benchmarks/bench_step.py --set model.preset=smollm2-135m --set model.dtype=bfloat16 \
      --json_out=step.json                           # another model shape, results as JSON

Warm-up steps (compilation) are excluded. The float32 matmul peak is measured in the same
process (a jitted 2048x2048 matmul, best of several), so the ratio is hardware-independent.
Model FLOPs of the update: 6 x parameters x tokens (forward + backward, Kaplan et al. 2020)
plus attention (12 x layers x heads x head_dim x T^2 per row, fwd + bwd), per gradient step.
"""

import argparse
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def matmul_peak(n: int = 2048, repeats: int = 10, dtype: str = "float32") -> float:
    """Best-of matmul FLOP/s of an [n, n] x [n, n] product in ``dtype`` on the default device."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32).astype(dtype)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def cpu_info(cpuinfo: str | None = None) -> dict:
    """The first CPU of ``/proc/cpuinfo`` (or of the given text): model name, family, model and
    its widest SIMD ({} where unreadable). VMs of one machine kind can be different CPU
    generations (AMD family 25 model 17 = Zen 4, 26 = Zen 5), and the peers' step-time ratios
    differ between them, so the harness records which one it ran on."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                cpuinfo = f.read()
        except OSError:
            return {}
    fields = {}
    for line in cpuinfo.split("\n\n")[0].splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    if not fields:
        return {}
    flags = set(fields.get("flags", "").split())
    simd = next((f for f in ("avx512f", "avx2", "sse4_2", "asimd") if f in flags), "")
    return {
        "model_name": fields.get("model name", ""),
        "family": fields.get("cpu family", ""),
        "model": fields.get("model", ""),
        "simd": simd,
    }


def describe_cpu(cpu: dict) -> str:
    """``cpu_info()`` as one phrase: "AMD EPYC, family 25 model 17, avx512f" ("" if empty)."""
    if not cpu:
        return ""
    parts = [cpu.get("model_name", "")]
    if cpu.get("family") or cpu.get("model"):
        parts.append(f"family {cpu.get('family', '?')} model {cpu.get('model', '?')}")
    parts.append(cpu.get("simd", ""))
    return ", ".join(p for p in parts if p)


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (``platform.processor()`` elsewhere)."""
    return cpu_info().get("model_name") or platform.processor() or platform.machine()


def load_config(spec: str):
    import importlib.util

    path, _, arg = spec.partition(":")
    mod_spec = importlib.util.spec_from_file_location("bench_config", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod.get_config(arg) if arg else mod.get_config()


def apply_overrides(config, assignments) -> None:
    """``["model.preset=smollm2-135m", "rollout.max_new_tokens=32", "model.overrides={}"]`` set
    on the ConfigDict in place; values are Python literals where they parse as one, else
    strings.

    Raises:
      SystemExit: an assignment without "=" or a key the config does not have.
    """
    import ast

    for a in assignments:
        key, sep, raw = a.partition("=")
        if not sep:
            raise SystemExit(f"--set {a!r}: expected KEY=VALUE, e.g. model.dtype=bfloat16")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        *path, last = key.split(".")
        node = config
        for part in path:
            if part not in node:
                raise SystemExit(f"--set {a!r}: the config has no {key!r}")
            node = node[part]
        if last not in node and path[-1:] != ["overrides"]:
            raise SystemExit(f"--set {a!r}: the config has no {key!r}")
        node[last] = value


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/arithmetic.py:grpo")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps (compilation)")
    parser.add_argument(
        "--set", action="append", default=[], help="KEY=VALUE config override (repeatable)"
    )
    parser.add_argument("--json_out", default="", help="also write the figures here as JSON")
    args = parser.parse_args()

    import jax

    from grpo_jax import steps, train
    from grpo_jax.experiment import build_experiment

    config = load_config(args.config)
    apply_overrides(config, args.set)
    config.logging.progress_bar = False
    exp = build_experiment(config)
    run, _ = steps.init_run(exp, warm_start=False)  # RL from the initialisation (no SFT)
    fns = steps.make_steps(exp)
    source = exp.make_source()
    rows = []

    def keep(result) -> None:  # the timed steps' rows
        if int(result.run.train.step) > args.warmup:
            rows.append(result.row)

    until = args.warmup + args.steps
    run, _ = train.run_steps(exp, fns, run, source, until=until, hooks=(keep,))
    peak = matmul_peak()

    mc = exp.model_config
    n_params = sum(x.size for x in jax.tree.leaves(run.train.params))
    R = config.rollout.prompts_per_step * config.rollout.rollouts_per_prompt
    T = exp.prompt_len + exp.max_new_tokens - 1
    updates_per_step = config.algorithm.num_iterations * (R // exp.batching.mini_batch_size)
    flops_per_row = 6 * n_params * T + 12 * mc.num_layers * mc.num_heads * mc.head_dim * T * T
    update_flops = flops_per_row * R * config.algorithm.num_iterations
    phases = sorted(k for k in rows[0] if k.startswith("time/"))
    med = {k: statistics.median(r[k] for r in rows) for k in phases}
    gen_tokens = statistics.median(r["generated_tokens"] for r in rows)
    print(
        f"config {args.config}: {n_params / 1e6:.2f}M parameters, R={R} rollouts, "
        f"T={T} positions, {updates_per_step} gradient step(s) per RL step, {args.steps} timed steps"
    )
    print(f"{'phase':<22}{'median s':>10}")
    for k in phases:
        print(f"{k:<22}{med[k]:>10.4f}")
    print(f"generate tokens/s (completion tokens)   {gen_tokens / med['time/generate']:.0f}")
    print(
        f"update tokens/s (prompt+completion)     {R * T * config.algorithm.num_iterations / med['time/update']:.0f}"
    )
    achieved = update_flops / med["time/update"]
    print(f"update achieved model FLOP/s            {achieved / 1e9:.2f} GFLOP/s")
    print(f"float32 matmul peak (2048^3, same run)  {peak / 1e9:.2f} GFLOP/s")
    print(f"update / peak                           {100 * achieved / peak:.1f}%")
    stats = jax.devices()[0].memory_stats() or {}  # None on a CPU
    if stats:
        print(
            f"peak device memory (process)            {stats['peak_bytes_in_use'] / 2**30:.2f} GiB"
        )
    if args.json_out:
        import json

        with open(args.json_out, "w") as f:
            json.dump(
                {
                    "config": args.config,
                    "set": args.set,
                    "device_kind": jax.devices()[0].device_kind,
                    "params": int(n_params),
                    "R": R,
                    "positions": T,
                    "median_s": med,
                    "generate_tokens_per_s": gen_tokens / med["time/generate"],
                    "update_tokens_per_s": R
                    * T
                    * config.algorithm.num_iterations
                    / med["time/update"],
                    "update_flops_per_s": achieved,
                    "matmul_peak_flops_per_s": peak,
                    "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
                },
                f,
                indent=2,
            )
    exp.close()


if __name__ == "__main__":
    main()
