"""Runs grpo_jax, TRL and Tunix on the same GRPO workload, one process at a time, and writes
reports/performance.md.

  bash benchmarks/peers/setup_envs.sh                       # once: the peer venvs
  /work/venv/bin/python benchmarks/peers/run_all.py         # full size: 16 x 8, 128 tokens
  /work/venv/bin/python benchmarks/peers/run_all.py --prompts=2 --samples=2 \
      --max_new_tokens=16 --steps=2 --label=tiny            # smoke size

Each round runs the three systems alternately (grpo_jax, TRL, Tunix), each as its own process
(python of its own venv), never two at once; `--rounds=R` repeats that and pools the timed
steps of each system. A watchdog samples each run's resident memory (process tree) every
second and kills a run that goes over `--max_rss_gib` (recorded as such). Results (JSON per
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

HERE = os.path.dirname(os.path.abspath(__file__))
SYSTEMS = ("grpo_jax", "trl", "tunix")
TARGETS = {"trl": 0.5, "tunix": 0.75}  # issue #10: grpo_jax step time <= target x peer's


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


def run_one(system: str, args, out_json: str, log_path: str) -> dict:
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
        "bound is the smaller of the two; target: decode tok/s >= 50% of the bandwidth "
        "bound.",
        "",
    ]
    return lines


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
      sections: [(label, {system: merged result})], largest size first; the notes on unequal
        settings are taken from the first section.
    """
    if isinstance(sections, dict):
        sections = [("", sections)]
    lines = ["# Performance: grpo_jax vs TRL and Tunix (issue #10)", ""]
    if intro:
        lines += [intro, ""]
    if machine:
        lines += [machine, ""]
    for label, merged in sections:
        lines += _table(merged, label)
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
    if not args.report_only:
        subprocess.run(
            [sys.executable, os.path.join(HERE, "prepare.py"), f"--prompts={args.prompts}"],
            check=True,
            cwd=common.REPO,
        )
        for r in range(args.rounds):
            for s in systems:
                run_one(
                    s,
                    args,
                    os.path.join(args.results_dir, f"{tag}_{s}_r{r}.json"),
                    f"/tmp/peers_{tag}_{s}_r{r}.log",
                )
    sections = []
    for t in [tag] + [x for x in args.include.split(",") if x and x != tag]:
        merged = {}
        for s in SYSTEMS:
            files = sorted(glob.glob(os.path.join(args.results_dir, f"{t}_{s}_r*.json")))
            if files:
                merged[s] = merge([json.load(open(f, encoding="utf-8")) for f in files])
        if merged:
            sections.append((t.split("_p")[0], merged))
    size = (
        f"--prompts={args.prompts} --samples={args.samples} "
        f"--max_new_tokens={args.max_new_tokens} --steps={args.steps} --warmup={args.warmup}"
        + (f" --micro_batch={args.micro_batch}" if args.micro_batch else "")
    )
    commands = [
        "bash benchmarks/peers/setup_envs.sh   # venvs under "
        "${GRPO_JAX_PEERS_CACHE:-~/.cache/grpo_jax/peers}",
        f"/work/venv/bin/python benchmarks/peers/run_all.py {size} --rounds={args.rounds} "
        f"--label={args.label}",
        "# one system alone, e.g.:",
        f"/work/venv/bin/python benchmarks/peers/run_grpo_jax.py {size}",
        f"~/.cache/grpo_jax/peers/trl/bin/python benchmarks/peers/run_trl.py {size}",
        f"~/.cache/grpo_jax/peers/tunix/bin/python benchmarks/peers/run_tunix.py {size}",
    ]
    if args.label != "full":
        commands += [
            "# the full size of issue #10 (16 x 8, 128 tokens, 1 warm-up + 3 timed steps):",
            "/work/venv/bin/python benchmarks/peers/run_all.py --label=full",
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
            "/work/venv/bin/python benchmarks/bench_decode.py --out=/tmp/decode.json",
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
