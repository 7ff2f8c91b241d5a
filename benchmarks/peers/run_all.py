"""Runs grpo_jax, TRL and Tunix on the same GRPO workload, one process at a time, and writes
reports/performance.md.

  bash benchmarks/peers/setup_envs.sh                       # once: the peer venvs
  python benchmarks/peers/run_all.py         # full size: 16 x 8, 128 tokens
  python benchmarks/peers/run_all.py --prompts=2 --samples=2 \
      --max_new_tokens=16 --steps=2 --label=tiny            # smoke size

Each round runs the three systems alternately (grpo_jax, TRL, Tunix), each as its own process
(python of its own venv), never two at once; `--rounds=R` repeats that and pools the timed
steps of each system. Before the first system and after the last, `machine_bounds.py`
(grpo_jax's venv, its own process) measures the float32 matmul peak and the read bandwidth;
the report uses the larger of the two measurements of each for the floor of the step
(`floor`). The report's header gives the exact command, each run's start/end time and the load
average at its start (`{tag}_harness.json` keeps the command and the bounds). A watchdog
samples each run's resident memory (process tree) every second and kills a run that goes over
`--max_rss_gib` (recorded as such). Results (JSON per
run) go to `--results_dir`; `--report_only` rewrites the report from the JSON already there.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import shlex
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_step import cpu_info, describe_cpu  # jax-free at import

HERE = os.path.dirname(os.path.abspath(__file__))
SYSTEMS = ("grpo_jax", "trl", "tunix")
TARGETS = {"trl": 0.35, "tunix": 0.3}  # issue #21: grpo_jax step time <= target x peer's


def python_for(system: str) -> str:
    if system == "grpo_jax":
        return sys.executable
    return os.path.join(common.cache_dir(), system, "bin", "python")


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of a process and its descendants (from /proc; 0 once it is gone)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    page = os.sysconf("SC_PAGE_SIZE")
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", encoding="utf-8") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(d))
            rss[int(d)] = int(fields[21]) * page
        except (OSError, IndexError, ValueError):
            continue
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += rss.get(p, 0)
        todo.extend(children.get(p, []))
    return total


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))


def measure_bounds(out_json: str, workload: list[str] = ()) -> dict:
    """The float32 matmul peak and read bandwidth, measured by machine_bounds.py in its own
    process (grpo_jax's venv: `bench_step.matmul_peak`, `bench_decode.read_bandwidth`); with
    the workload's flags, also grpo_jax's step matmuls timed at their shapes."""
    cmd = [python_for("grpo_jax"), os.path.join(HERE, "machine_bounds.py"), f"--out={out_json}"]
    cmd += list(workload)
    print(f"[run_all] machine bounds: {shlex.join(cmd)}", flush=True)
    rc = subprocess.run(cmd, cwd=common.REPO).returncode
    if rc or not os.path.isfile(out_json):
        return {"failed": f"exit code {rc}"}
    with open(out_json, encoding="utf-8") as f:
        return json.load(f)


def run_one(system: str, args, out_json: str, log_path: str, round_index: int = 0) -> dict:
    """Runs one system's process; returns its result (or a failure record)."""
    cmd = [
        python_for(system),
        os.path.join(HERE, f"run_{system}.py"),
        f"--prompts={args.prompts}",
        f"--samples={args.samples}",
        f"--max_new_tokens={args.max_new_tokens}",
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
        f"--seed={args.seed}",
        f"--micro_batch={args.micro_batch}",
        f"--out={out_json}",
    ]
    cmd += shlex.split(getattr(args, f"{system}_args", "") or "")
    print(f"[run_all] {system}: {shlex.join(cmd)}  (log {log_path})", flush=True)
    peak = {"bytes": 0, "killed": False}
    load = list(os.getloadavg())
    t0 = time.time()
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=common.REPO)

        def watch():
            while proc.poll() is None:
                r = tree_rss_bytes(proc.pid)
                peak["bytes"] = max(peak["bytes"], r)
                if r > args.max_rss_gib * 2**30:
                    peak["killed"] = True
                    proc.kill()
                    return
                time.sleep(1.0)

        th = threading.Thread(target=watch, daemon=True)
        th.start()
        rc = proc.wait()
        th.join()
    wall = time.time() - t0
    if rc == 0 and os.path.isfile(out_json):
        with open(out_json, encoding="utf-8") as f:
            result = json.load(f)
    else:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            tail = f.read()[-2000:]
        why = (
            f"killed: resident memory above {args.max_rss_gib} GiB"
            if peak["killed"]
            else f"killed by SIGKILL (the kernel's OOM killer?) at {peak['bytes'] / 2**30:.1f} "
            "GiB last sampled"
            if rc == -9
            else f"exit code {rc}"
        )
        result = {
            "system": system,
            "failed": why,
            "log_tail": tail,
            "steps": [],
            "workload": common.workload(args),
            "peak_rss_bytes": peak["bytes"],
            "notes": [],
        }
        with open(out_json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    result["tree_peak_rss_bytes"] = peak["bytes"]
    result["process_wall_s"] = wall
    result["run"] = {
        "round": round_index,
        "command": shlex.join(cmd),
        "started_utc": _utc(t0),
        "ended_utc": _utc(t0 + wall),
        "loadavg_start": load,
        "loadavg_end": list(os.getloadavg()),
    }
    with open(out_json, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    print(
        f"[run_all] {system}: done in {wall:.0f} s"
        + (f" - FAILED ({result['failed']})" if result.get("failed") else ""),
        flush=True,
    )
    return result


def merge(results: list[dict]) -> dict:
    """Pools the timed steps of several runs of one system (peak RSS = the largest)."""
    ok = [r for r in results if not r.get("failed")]
    base = dict(ok[0] if ok else results[0])
    base["steps"] = [s for r in ok for s in r["steps"]]
    base["peak_rss_bytes"] = max(r.get("peak_rss_bytes", 0) for r in results)
    base["tree_peak_rss_bytes"] = max(r.get("tree_peak_rss_bytes", 0) for r in results)
    base["runs"] = len(results)
    base["run_medians"] = [common.summarize(r)["step_s"] for r in ok]
    base["failures"] = [r["failed"] for r in results if r.get("failed")]
    return base


def _fmt(x: float, digits: int = 2) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _table(merged: dict[str, dict], label: str) -> list[str]:
    rows = {s: common.summarize(r) for s, r in merged.items()}
    ours = rows.get("grpo_jax")
    w = next((r["workload"] for r in merged.values() if r.get("workload")), {})
    lines = [
        f"### Size: {label}",
        "",
        f"{w.get('prompts', '?')} GSM8K prompts x {w.get('samples', '?')} samples, "
        f"{w.get('max_new_tokens', '?')} new tokens, temperature {w.get('temperature', '?')}, "
        f"KL coefficient {w.get('kl_coef', '?')} with a reference model, one update per batch, "
        f"float32; {w.get('warmup', '?')} warm-up step(s) excluded, {w.get('steps', '?')} timed "
        "step(s) per run.",
        "",
        "| system | version | timed steps | median step s | each run's median s "
        "| generate tok/s | update tok/s | peak RSS GiB | grpo_jax step time / this |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in SYSTEMS:
        if s not in merged:
            continue
        r, m = merged[s], rows[s]
        ratio = (ours["step_s"] / m["step_s"]) if ours and m["n"] and ours["n"] else float("nan")
        fail = f" (failed: {'; '.join(r['failures'])})" if r.get("failures") else ""
        each = ", ".join(_fmt(x) for x in r.get("run_medians", [])) or "-"
        lines.append(
            f"| {s}{fail} | {r.get('version', '?')} | {m['n']} | {_fmt(m['step_s'])} | "
            f"{each} | {_fmt(m['generate_tok_s'], 1)} | {_fmt(m['update_tok_s'], 1)} | "
            f"{_fmt(m['peak_rss_gib'])} | {'-' if s == 'grpo_jax' else _fmt(ratio, 3)} |"
        )
    lines += ["", "Targets (grpo_jax median step time / peer's):"]
    for peer, target in TARGETS.items():
        if peer in rows and ours and rows[peer]["n"] and ours["n"]:
            ratio = ours["step_s"] / rows[peer]["step_s"]
            lines.append(
                f"- vs {peer}: {ratio:.3f}x (target <= {target}x): "
                f"**{'met' if ratio <= target else 'not met'}**"
            )
        else:
            lines.append(f"- vs {peer}: no measurement (target <= {target}x)")
    g = merged.get("grpo_jax", {})
    if ours and ours["n"] and g.get("update_flops") and g.get("matmul_peak_flops"):
        achieved = g["update_flops"] / ours["update_s"]
        frac = achieved / g["matmul_peak_flops"]
        lines.append(
            f"- grpo_jax update: {g['update_flops'] / 1e12:.2f} TFLOP of model FLOPs per step "
            f"(6 x layer parameters x positions + LM head on completion positions + "
            f"attention) in {ours['update_s']:.1f} s = {achieved / 1e9:.1f} GFLOP/s = "
            f"{100 * frac:.1f}% of the float32 matmul peak measured in the same run "
            f"({g['matmul_peak_flops'] / 1e9:.1f} GFLOP/s; target >= 50%): "
            f"**{'met' if frac >= 0.5 else 'not met'}**"
        )
    lines += [
        "",
        "Median phase times (s):",
        "",
        "| system | generate | reward | reference | update | other | prompt-0 NLL (nats) |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in SYSTEMS:
        if s not in merged or not rows[s]["n"]:
            continue
        st = merged[s]["steps"]

        def med(k):
            v = sorted(x.get(k, float("nan")) for x in st)
            return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2

        lines.append(
            f"| {s} | {_fmt(med('generate_s'))} | {_fmt(med('reward_s'), 3)} | "
            f"{_fmt(med('reference_s'))} | {_fmt(med('update_s'))} | {_fmt(med('other_s'))} | "
            f"{_fmt(merged[s].get('prompt0_nll', float('nan')), 5)} |"
        )
    return lines + [""]


def _decode_section(d: dict) -> list[str]:
    """Markdown for benchmarks/bench_decode.py's JSON: decode tok/s vs the bandwidth bound."""
    bw = d["read_bandwidth_Bps"]
    lines = [
        "### Decode vs the memory-bandwidth bound (grpo_jax sampler)",
        "",
        f"`benchmarks/bench_decode.py`: SmolLM2-135M float32 ({d['weight_bytes'] / 2**20:.0f} "
        f"MiB of weights, KV {d['kv_bytes_per_position'] / 1024:.1f} KiB per position per row), "
        f"prompt {d['results'][0]['prompt_len']} tokens, decode step time = (t(N) - t(2)) / "
        f"(N - 2) with N = {d['new_tokens']}, EOS off. Read bandwidth measured in the same "
        f"process: {bw['best'] / 1e9:.1f} GB/s (jitted sum {bw['jax_sum'] / 1e9:.1f}, numpy "
        f"{bw['numpy_sum'] / 1e9:.1f}); float32 matmul peak "
        f"{d['matmul_peak_flops'] / 1e9:.1f} GFLOP/s.",
        "",
        "| rows | decode step ms | decode tok/s | bandwidth-bound tok/s | % of bandwidth bound "
        "| compute-bound tok/s | % of compute bound |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in d["results"]:
        lines.append(
            f"| {r['rows']} | {1e3 * r['decode_step_s']:.1f} | {r['decode_tok_s']:.1f} | "
            f"{r['bandwidth_bound_tok_s']:.1f} | "
            f"{100 * r['fraction_of_bandwidth_bound']:.1f}% | "
            f"{r['compute_bound_tok_s']:.1f} | {100 * r['fraction_of_compute_bound']:.1f}% |"
        )
    lines += [
        "",
        "Bandwidth bound = rows x BW / (weights + KV read at the mean position); compute "
        "bound = matmul peak / (2 x matmul parameters) tokens/s at any batch. The machine's decode "
        "bound is the smaller of the two; target (issue #21): decode tok/s at 128 rows >= 50% "
        "of the bandwidth bound, or of the compute bound where compute binds.",
        "",
    ]
    return lines


def floor(
    workload: dict,
    prompt_len: int,
    shape: dict,
    peak: float,
    bandwidth: float,
    shared_prompt: bool = False,
) -> dict:
    """Lower bound (s) of one GRPO step of this workload on this machine.

    Counts the positions TRL and Tunix process: every one of the R = prompts x samples rows
    runs its prompt, left-padded to Lp, and max_new_tokens = Lc completion tokens (T = Lp + Lc - 1
    input positions). With A = 4 x layers x heads x head_dim (attention FLOPs per query-key
    pair), forward(positions, pairs, head positions) = 2 x n_body x positions + 2 x n_head x head
    positions + A x pairs, the formula of run_grpo_jax.py's "update TFLOP" (padded shapes, full
    T x T score matrices):
      update     = 3 x forward(R T, R T^2, R Lc)  / matmul peak   (forward + backward)
      reference  =     forward(R T, R T^2, R Lc)  / matmul peak
      generate   = prefill forward(R Lp, R Lp^2, R) / peak + sum over the Lc - 1 decode steps t of
                   max(R (2 n_body + 2 n_head + A (Lp + t)) / peak,
                       (weight bytes + R x KV bytes per position x (Lp + t)) / bandwidth)
    Reward, the optimizer (~7 parameter-sized reads/writes) and host work are left out.

    shared_prompt=True: the work of grpo_jax's shared prompt forward instead, each group's
    prompt run once (P = prompts groups, R rows): the reference and the update take
    forward(P Lp + R (Lc - 1), P Lp^2 + R (Lc - 1) T, R Lc) (the completion queries score the
    Lp prompt keys and the Lc - 1 completion keys) and the prefill forward(P Lp, P Lp^2, P);
    the decode steps are the same (every row reads its own copy of the prompt's cache).
    """
    P = workload["prompts"]
    R = P * workload["samples"]
    Lp, Lc = prompt_len, workload["max_new_tokens"]
    T = Lp + Lc - 1
    A = 4 * shape["num_layers"] * shape["num_heads"] * shape["head_dim"]

    def forward(positions, pairs, head_positions):
        return 2 * shape["n_body"] * positions + 2 * shape["n_head"] * head_positions + A * pairs

    if shared_prompt:
        ref_flops = forward(P * Lp + R * (Lc - 1), P * Lp * Lp + R * (Lc - 1) * T, R * Lc)
        prefill_flops = forward(P * Lp, P * Lp * Lp, P)
    else:
        ref_flops = forward(R * T, R * T * T, R * Lc)
        prefill_flops = forward(R * Lp, R * Lp * Lp, R)
    update_flops = 3 * ref_flops
    decode_compute = decode_bandwidth = decode_s = 0.0
    for t in range(1, Lc):
        c = R * (2 * shape["n_body"] + 2 * shape["n_head"] + A * (Lp + t)) / peak
        b = (shape["weight_bytes"] + R * shape["kv_bytes_per_position"] * (Lp + t)) / bandwidth
        decode_compute, decode_bandwidth, decode_s = (
            decode_compute + c,
            decode_bandwidth + b,
            decode_s + max(c, b),
        )
    out = {
        "rows": R,
        "prompt_len": Lp,
        "positions_per_row": T,
        "update_flops": update_flops,
        "reference_flops": ref_flops,
        "prefill_flops": prefill_flops,
        "update_s": update_flops / peak,
        "reference_s": ref_flops / peak,
        "prefill_s": prefill_flops / peak,
        "decode_compute_s": decode_compute,
        "decode_bandwidth_s": decode_bandwidth,
        "decode_s": decode_s,
        "matmul_peak_flops": peak,
        "read_bandwidth_Bps": bandwidth,
    }
    out["generate_s"] = out["prefill_s"] + decode_s
    out["step_s"] = out["generate_s"] + out["reference_s"] + out["update_s"]
    return out


def _bounds(harness: dict) -> tuple[float, float] | None:
    """The larger matmul peak and bandwidth of the before/after measurements (None if none)."""
    ms = [harness.get(k) or {} for k in ("bounds_before", "bounds_after")]
    ms = [m for m in ms if m.get("matmul_peak_flops")]
    if not ms:
        return None
    return (
        max(m["matmul_peak_flops"] for m in ms),
        max(m["read_bandwidth_Bps"] for m in ms),
    )


def _floor_section(merged: dict[str, dict], harness: dict) -> list[str]:
    w = next((r["workload"] for r in merged.values() if r.get("workload")), None)
    bounds = _bounds(harness)
    Lp = harness.get("prompt_len") or next(
        (r.get("settings", {}).get("prompt_pad") for r in merged.values() if r.get("settings")),
        None,
    )
    if not (w and bounds and Lp and harness.get("model_shape")):
        return ["Floor: not computed (no machine bounds measured in this run).", ""]
    f = floor(w, Lp, harness["model_shape"], *bounds)
    sh = harness["model_shape"]
    lines = [
        "Machine bounds, measured by `benchmarks/peers/machine_bounds.py` in this run "
        "(`bench_step.matmul_peak`: best of 10 jitted 2048^3 float32 matmuls; "
        "`bench_decode.read_bandwidth`: best of a jitted float32 sum over 1 GiB and numpy's):",
        "",
        "| when | UTC | float32 matmul peak GFLOP/s | read bandwidth GB/s "
        "| load average at start |",
        "|---|---|---|---|---|",
    ]
    for k, name in (
        ("bounds_before", "before the first system"),
        ("bounds_after", "after the last"),
    ):
        m = harness.get(k) or {}
        if m.get("matmul_peak_flops"):
            lines.append(
                f"| {name} | {m.get('started_utc', '?')} | {m['matmul_peak_flops'] / 1e9:.1f} | "
                f"{m['read_bandwidth_Bps'] / 1e9:.1f} | "
                f"{' '.join(f'{x:.2f}' for x in m.get('loadavg_start', []))} |"
            )
        else:
            lines.append(f"| {name} | - | {m.get('failed', 'not measured')} | | |")
    lines += [
        "",
        f"Floor of one step (the larger peak, {bounds[0] / 1e9:.1f} GFLOP/s, and the larger "
        f"bandwidth, {bounds[1] / 1e9:.1f} GB/s): R = {f['rows']} rows, each its prompt "
        f"left-padded to Lp = {f['prompt_len']} plus Lc = {w['max_new_tokens']} completion "
        f"tokens (T = Lp + Lc - 1 = {f['positions_per_row']} positions per row: what TRL and "
        "Tunix process; grpo_jax's shared prompt forward runs each group's prompt once, so it "
        "does less work than this counts), n_body = "
        f"{sh['n_body'] / 1e6:.1f}M layer matmul parameters, n_head = {sh['n_head'] / 1e6:.1f}M "
        f"(LM head), A = 4 x layers x heads x head_dim = "
        f"{4 * sh['num_layers'] * sh['num_heads'] * sh['head_dim']} FLOPs per query-key pair; "
        "forward(positions, pairs, head positions) = 2 n_body positions + 2 n_head head positions "
        "+ A pairs (run_grpo_jax.py's update-FLOP formula):",
        "",
        f"- update = 3 x forward(R T, R T^2, R Lc) = {f['update_flops'] / 1e12:.2f} TFLOP / peak "
        f"= {f['update_s']:.1f} s",
        f"- reference = forward(R T, R T^2, R Lc) = {f['reference_flops'] / 1e12:.2f} TFLOP / peak "
        f"= {f['reference_s']:.1f} s",
        f"- generate = prefill forward(R Lp, R Lp^2, R) / peak ({f['prefill_s']:.1f} s) + the "
        "Lc - 1 decode steps, each max(R (2 n_body + 2 n_head + A (Lp + t)) / peak, (weight "
        "bytes + R x KV bytes per position x (Lp + t)) / bandwidth) "
        f"({f['decode_s']:.1f} s; compute alone {f['decode_compute_s']:.1f} s, bandwidth alone "
        f"{f['decode_bandwidth_s']:.1f} s) = {f['generate_s']:.1f} s",
        f"- **floor = {f['step_s']:.1f} s per step** (reward, optimizer and host work left out)",
    ]
    shared = [s for s in SYSTEMS if _shares_prompt(merged.get(s, {}))]
    fs = floor(w, Lp, sh, *bounds, shared_prompt=True)
    if shared:
        lines.append(
            f"- the work of the shared prompt forward ({', '.join(shared)}: each group's prompt "
            f"runs once; forward(P Lp + R (Lc - 1), P Lp^2 + R (Lc - 1) T, R Lc), P = "
            f"{w['prompts']} groups): update {fs['update_flops'] / 1e12:.2f} TFLOP = "
            f"{fs['update_s']:.1f} s, reference {fs['reference_flops'] / 1e12:.2f} TFLOP = "
            f"{fs['reference_s']:.1f} s, generate {fs['generate_s']:.1f} s (prefill of P rows "
            f"{fs['prefill_s']:.1f} s): **shared-prompt floor = {fs['step_s']:.1f} s per step**; "
            "the last rows of the table below compare such a system with it"
        )
    # it counts the shared prompt's work, for the workload of this run
    mf = _matmul_floor(harness, w, Lp, merged.get("grpo_jax", {})) if shared else None
    if mf:
        ph = {r["phase"]: r["matmul_s"] + r["attention_s_at_peak"] for r in mf["phases"]}
        ph["step"] = sum(ph.values())
        t = mf["total"]
        lines.append(
            "- grpo_jax's own work with this backend's matmul kernels "
            "(`benchmarks/bench_matmul_floor.py`, in machine_bounds.py's process: each distinct "
            "dense matmul of its step, shared prompt and micro-batches as it runs them, timed "
            f"alone at its shape; the faster of the two measurements): {len(mf['dots'])} "
            f"shapes, {t['matmul_flops'] / 1e12:.2f} TFLOP in {t['matmul_s']:.1f} s "
            f"({t['matmul_flops'] / t['matmul_s'] / 1e9:.0f} GFLOP/s; "
            f"{t['matmul_s_at_peak']:.1f} s at the peak) + attention at the peak "
            f"{t['attention_s_at_peak']:.1f} s: **matmul floor = {ph['step']:.1f} s per step** "
            f"(generate {ph['generate']:.1f}, reference {ph['reference']:.1f}, update "
            f"{ph['update']:.1f} s); everything else a step does (attention beyond its FLOPs, "
            "softmax, norms, sampling, layout copies, the optimizer) is the time above it"
        )
    lines += [
        "",
        "| system | median step s | step / floor | generate / its floor | reference / its floor "
        "| update / its floor |",
        "|---|---|---|---|---|---|",
    ]
    for s in SYSTEMS:
        if s not in merged:
            continue
        m = common.summarize(merged[s])
        if not m["n"]:
            lines.append(f"| {s} | n/a | n/a | n/a | n/a | n/a |")
            continue
        lines.append(
            f"| {s} | {_fmt(m['step_s'])} | {_fmt(m['step_s'] / f['step_s'])} | "
            f"{_fmt(m['generate_s'] / f['generate_s'])} | "
            f"{_fmt(m['reference_s'] / f['reference_s'])} | "
            f"{_fmt(m['update_s'] / f['update_s'])} |"
        )
    for s in shared:
        m = common.summarize(merged[s])
        if m["n"]:
            lines.append(
                f"| {s} vs the shared-prompt floor | {_fmt(m['step_s'])} | "
                f"{_fmt(m['step_s'] / fs['step_s'])} | "
                f"{_fmt(m['generate_s'] / fs['generate_s'])} | "
                f"{_fmt(m['reference_s'] / fs['reference_s'])} | "
                f"{_fmt(m['update_s'] / fs['update_s'])} |"
            )
            if mf:
                lines.append(
                    f"| {s} vs the matmul floor | {_fmt(m['step_s'])} | "
                    + " | ".join(
                        _fmt(m[f"{k}_s"] / ph[k]) if ph[k] else "-"
                        for k in ("step", "generate", "reference", "update")
                    )
                    + " |"
                )
    return lines + [""]


def _matmul_floor(harness: dict, workload: dict, prompt_len: int, ours: dict) -> dict | None:
    """The faster of the before/after `bench_matmul_floor` measurements made for this run's
    workload (prompts, samples, Lp, Lc, grpo_jax's micro-batch rows, a reference pass iff
    kl_coef > 0); None if there is none."""
    want = {
        "prompts": workload["prompts"],
        "samples": workload["samples"],
        "prompt_len": prompt_len,
        "max_new_tokens": workload["max_new_tokens"],
        "micro_batch": ours.get("settings", {}).get("micro_batch_rows"),
        "reference": workload["kl_coef"] > 0,
    }
    ms = [(harness.get(k) or {}).get("matmul_floor") for k in ("bounds_before", "bounds_after")]
    ms = [
        m
        for m in ms
        if m
        and m.get("phases")
        and all(v is None or m.get("workload", {}).get(k, v) == v for k, v in want.items())
    ]
    return min(ms, key=lambda m: m["total"]["matmul_s"]) if ms else None


def _shares_prompt(result: dict) -> bool:
    """The run computed each group's prompt once (grpo_jax's shared prompt forward): its
    settings say so (results written before the field existed: its note does)."""
    shared = result.get("settings", {}).get("shared_prompt")
    if shared is not None:
        return bool(shared)
    return any("shared_prompt_forward" in n for n in result.get("notes", []))


SETTINGS_COLUMNS = (
    ("sampler", "sampler"),
    ("cache_len", "sampler KV cache slots per row"),
    ("prompt_pad", "prompts padded to"),
    ("generate_rows", "rows per generate call"),
    ("micro_batch_rows", "micro-batch rows (reference, update)"),
    ("optimizer_steps", "optimizer steps per step"),
    ("remat", "remat / gradient checkpointing"),
    ("dtype", "dtype"),
)


def _settings_section(merged: dict[str, dict]) -> list[str]:
    """One row per system: the settings that make the comparison like for like."""
    lines = [
        "Settings of each system in this run (from each runner's result JSON):",
        "",
        "| system | " + " | ".join(h for _, h in SETTINGS_COLUMNS) + " |",
        "|---|" + "---|" * len(SETTINGS_COLUMNS),
    ]
    caches = []
    for s in SYSTEMS:
        st = merged.get(s, {}).get("settings")
        if not st:
            if s in merged:
                lines.append(f"| {s} | " + " | ".join("?" for _ in SETTINGS_COLUMNS) + " |")
            continue
        lines.append(
            f"| {s} | " + " | ".join(str(st.get(k, "?")) for k, _ in SETTINGS_COLUMNS) + " |"
        )
        caches.append(f"- {s}: {st.get('cache', '?')}")
    return lines + ["", "Sampler caches:", ""] + caches + [""]


def _runs_section(merged: dict[str, dict], harness: dict, runs: list[dict]) -> list[str]:
    lines = []
    if harness.get("command"):
        lines += [
            "Command (one invocation of the harness; each round runs the systems alternately, "
            f"in the order {', '.join(harness.get('systems', SYSTEMS))}; rounds are pooled):",
            "",
            "```",
            harness["command"],
            "```",
            "",
            f"Harness started {harness.get('started_utc', '?')} UTC, ended "
            f"{harness.get('ended_utc', '?')} UTC; machine {harness.get('cpu_count', '?')} CPU "
            f"cores ({describe_cpu(harness.get('cpu', {})) or 'CPU not recorded'}).",
            "",
        ]
    lines += [
        "| round | system | started (UTC) | ended (UTC) | wall s | load average at start "
        "(1/5/15 min) | result |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(runs, key=lambda r: r.get("run", {}).get("started_utc", "")):
        info = r.get("run", {})
        lines.append(
            f"| {info.get('round', '?')} | {r.get('system', '?')} | "
            f"{info.get('started_utc', '?')} | {info.get('ended_utc', '?')} | "
            f"{_fmt(r.get('process_wall_s', float('nan')), 0)} | "
            f"{' '.join(f'{x:.2f}' for x in info.get('loadavg_start', []))} | "
            f"{'FAILED: ' + r['failed'] if r.get('failed') else 'ok'} |"
        )
    return lines + [""]


def render_report(
    sections,
    *,
    commands: list[str],
    machine: str = "",
    profile_notes: str = "",
    intro: str = "",
    extra_notes=(),
    decode: dict | None = None,
) -> str:
    """The markdown of reports/performance.md.

    Args:
      sections: [(label, {system: merged result}[, harness, runs])], largest size first, where
        harness is the `{tag}_harness.json` dict (command, times, machine bounds) and runs the
        unmerged result of every run; the notes on unequal settings are taken from the first
        section.
    """
    if isinstance(sections, dict):
        sections = [("", sections)]
    sections = [tuple(sec) + ({}, [])[len(sec) - 2 :] for sec in sections]
    lines = ["# Performance: grpo_jax vs TRL and Tunix (issues #10, #21)", ""]
    for label, merged, harness, runs in sections:
        if harness or runs:
            lines += [f'## How the size "{label}" was run', ""]
            lines += _runs_section(merged, harness, runs)
    if intro:
        lines += [intro, ""]
    if machine:
        lines += [machine, ""]
    for label, merged, harness, _ in sections:
        lines += _table(merged, label)
        lines += _settings_section(merged)
        lines += _floor_section(merged, harness)
    if decode:
        lines += _decode_section(decode)
    lines += [
        "Definitions: step = wall time of one RL step (generate + reward + reference + "
        "update); generate tok/s = completion tokens actually generated (up to EOS) / "
        "generation time; update tok/s = non-padding tokens of the batch (prompt + "
        "completion) / update time (the gradient step with the optimizer; the reference "
        "pass is the 'reference' column); peak RSS = the process's own peak resident set "
        "(getrusage; the watchdog's process-tree peak is in the JSON). Prompt-0 NLL: mean "
        "next-token NLL of the first prompt under the freshly loaded weights (the same "
        "weights and tokens should give the same value in every implementation).",
        "",
        "## What makes the comparison unequal, and how it was equalised",
        "",
    ]
    first = sections[0][1] if sections else {}
    for s in SYSTEMS:
        if s in first:
            for n in first[s].get("notes", []):
                lines.append(f"- {s}: {n}")
    lines += [f"- {n}" for n in extra_notes]
    if profile_notes:
        lines += ["", "## Profile of grpo_jax's step", "", profile_notes]
    lines += ["", "## Rerun", "", "```"] + list(commands) + ["```", ""]
    return "\n".join(lines)


PROFILE_NOTES_FILE = os.path.join(HERE, "profile_notes.md")


def main(argv=None):
    parser = common.add_workload_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--max_rss_gib", type=float, default=20.0)
    parser.add_argument("--results_dir", default="/tmp/peers")
    parser.add_argument("--report", default=os.path.join(common.REPO, "reports", "performance.md"))
    parser.add_argument("--label", default="full")
    parser.add_argument("--report_only", action="store_true")
    for s in SYSTEMS:
        parser.add_argument(f"--{s}_args", default="", help=f"extra arguments for run_{s}.py")
    parser.add_argument(
        "--decode_json",
        default="",
        help="benchmarks/bench_decode.py --out JSON to add its decode-vs-bandwidth table",
    )
    parser.add_argument(
        "--include",
        default="",
        help="more result sets for the report, by tag (e.g. tiny_p2x2_t16), comma-separated",
    )
    args = parser.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    os.makedirs(args.results_dir, exist_ok=True)
    tag = f"{args.label}_p{args.prompts}x{args.samples}_t{args.max_new_tokens}"
    harness_path = os.path.join(args.results_dir, f"{tag}_harness.json")
    if not args.report_only:
        t0 = time.time()
        harness = {
            "command": shlex.join(
                (["nice", "-n", str(os.nice(0))] if os.nice(0) else [])
                + [sys.executable]
                + (sys.argv if argv is None else [sys.argv[0], *argv])
            ),
            "cwd": os.getcwd(),
            "started_utc": _utc(t0),
            "systems": systems,
            "rounds": args.rounds,
            "cpu_count": os.cpu_count(),
            "cpu": cpu_info(),
            "loadavg_start": list(os.getloadavg()),
        }
        subprocess.run(
            [sys.executable, os.path.join(HERE, "prepare.py"), f"--prompts={args.prompts}"],
            check=True,
            cwd=common.REPO,
        )
        harness["prompt_len"] = max(len(p["ids"]) for p in common.load_prompts(args.prompts))
        harness["model_shape"] = common.model_shape()
        workload = [
            f"--prompts={args.prompts}",
            f"--samples={args.samples}",
            f"--prompt_len={harness['prompt_len']}",
            f"--max_new_tokens={args.max_new_tokens}",
            f"--micro_batch={common.micro_batch_rows(args)}",
            f"--kl_coef={args.kl_coef}",
        ]
        harness["bounds_before"] = measure_bounds(
            os.path.join(args.results_dir, f"{tag}_bounds_before.json"), workload
        )
        for r in range(args.rounds):
            for s in systems:
                run_one(
                    s,
                    args,
                    os.path.join(args.results_dir, f"{tag}_{s}_r{r}.json"),
                    f"/tmp/peers_{tag}_{s}_r{r}.log",
                    round_index=r,
                )
        harness["bounds_after"] = measure_bounds(
            os.path.join(args.results_dir, f"{tag}_bounds_after.json"), workload
        )
        harness["ended_utc"] = _utc(time.time())
        with open(harness_path, "w", encoding="utf-8") as f:
            json.dump(harness, f, indent=1)
    sections = []
    for t in [tag] + [x for x in args.include.split(",") if x and x != tag]:
        merged, runs = {}, []
        for s in SYSTEMS:
            files = sorted(glob.glob(os.path.join(args.results_dir, f"{t}_{s}_r*.json")))
            if t == tag:  # rounds of this size beyond --rounds are left over from an older run
                files = [f for f in files if int(f.rsplit("_r", 1)[1][:-5]) < args.rounds]
            if files:
                loaded = [json.load(open(f, encoding="utf-8")) for f in files]
                runs += loaded
                merged[s] = merge(loaded)
        hpath = os.path.join(args.results_dir, f"{t}_harness.json")
        harness = json.load(open(hpath, encoding="utf-8")) if os.path.isfile(hpath) else {}
        if merged:
            sections.append((t.split("_p")[0], merged, harness, runs))
    size = (
        f"--prompts={args.prompts} --samples={args.samples} "
        f"--max_new_tokens={args.max_new_tokens} --steps={args.steps} --warmup={args.warmup}"
        + (f" --micro_batch={args.micro_batch}" if args.micro_batch else "")
    )
    commands = [
        "bash benchmarks/peers/setup_envs.sh   # venvs under "
        "${GRPO_JAX_PEERS_CACHE:-~/.cache/grpo_jax/peers}",
        f"python benchmarks/peers/run_all.py {size} --rounds={args.rounds} --label={args.label}",
        "# one system alone, e.g.:",
        f"python benchmarks/peers/run_grpo_jax.py {size}",
        f"~/.cache/grpo_jax/peers/trl/bin/python benchmarks/peers/run_trl.py {size}",
        f"~/.cache/grpo_jax/peers/tunix/bin/python benchmarks/peers/run_tunix.py {size}",
    ]
    if args.label != "full":
        commands += [
            "# the full size of issue #10 (16 x 8, 128 tokens, 1 warm-up + 3 timed steps):",
            "python benchmarks/peers/run_all.py --label=full",
        ]
    profile = ""
    if os.path.isfile(PROFILE_NOTES_FILE):
        with open(PROFILE_NOTES_FILE, encoding="utf-8") as f:
            profile = f.read().strip()
    machine = (
        f"Machine: {os.cpu_count()} CPU cores, one system at a time (what else ran during "
        "each measurement is under 'Conditions' above)."
    )
    notes_file = os.path.join(HERE, "report_notes.md")
    intro = open(notes_file, encoding="utf-8").read().strip() if os.path.isfile(notes_file) else ""
    decode = None
    if args.decode_json:
        with open(args.decode_json, encoding="utf-8") as f:
            decode = json.load(f)
        commands += [
            "# decode vs the memory-bandwidth bound:",
            "python benchmarks/bench_decode.py --out=/tmp/decode.json",
        ]
    text = render_report(
        sections,
        commands=commands,
        machine=machine,
        profile_notes=profile,
        intro=intro,
        decode=decode,
    )
    os.makedirs(os.path.dirname(args.report), exist_ok=True)
    with open(args.report, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"[run_all] wrote {args.report}")


if __name__ == "__main__":
    main()
