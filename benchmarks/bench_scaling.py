"""How the GRPO step time scales with group size G, completion length Lc and prompts per step P.

  python benchmarks/bench_scaling.py                          # reports/scaling.{json,md,png}
  python benchmarks/bench_scaling.py --smoke                  # 2 values per factor, 1 timed step
  python benchmarks/bench_scaling.py --P=16 --Gs=4,8 --Lcs=64,256 --Ps= --out=/tmp/scaling.json

One factor at a time around a base point (default P = 8 prompts, G = 4 rollouts per prompt,
Lc = 32 completion tokens; R = P x G rollouts), the other two held at the base. Every point is
a real `grpo_jax.train.rl_step` of ``--config`` (default the embedded arithmetic task, its
character tokenizer and prompts) with the model widened by ``--model`` (default 4 layers, width
384, 6.3M parameters; random initialisation, no warm start), with ``kl_coef = --kl_coef`` (so the
reference log-prob pass runs) and EOS disabled (every completion has exactly Lc tokens: the
lengths are what the axis says; checked). Every point is built and given ``--warmup`` untimed
steps (compilation) first; then ``--steps`` rounds each time one step of every point (the order
reversed every other round), so a change in the load of a shared machine over the run falls
on all points alike instead of on a few. Reported per point: the median of the step's phase timers ``time/*``
(``step`` = their sum; ``generate`` = sampling + the completions' transfer to the host;
``reference`` = advantages + the reference (and, off-policy, old) log-prob pass;
``update`` = the gradient step(s); ``other`` = prompts, reward and controllers).

Per factor, the log-log slope of step (and each phase's) time vs the factor (least squares
over its values): 1 = linear, 0 = flat (fixed cost), 2 = quadratic. The base point is measured
once and shared by the three sweeps. Output: ``--out`` (JSON: every point's timings with the
machine: CPU model, cores, jax / flax versions, load average, date), the same name with
``.md`` (one table per factor) and ``.png`` (log-log, one panel per factor).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_step import cpu_model, load_config

FACTORS = {"G": "group size G", "Lc": "completion length Lc", "P": "prompts per step P"}
PHASES = ("generate", "reference", "update")
# 6.3M parameters: a step of the base point takes ~1 s on 2 CPU cores (the arithmetic config's
# own 0.3M-parameter model takes ~0.08 s, mostly fixed per-step costs)
DEFAULT_MODEL = (
    "hidden_size=384,intermediate_size=1024,num_layers=4,num_heads=6,num_kv_heads=2,head_dim=64"
)


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _value(s: str):
    for cast in (int, float):
        try:
            return cast(s)
        except ValueError:
            pass
    return s


class Point:
    """One (P, G, Lc) point: its experiment, compiled steps and run state (EOS disabled)."""

    def __init__(self, args, P: int, G: int, Lc: int):
        import dataclasses

        from grpo_jax import steps
        from grpo_jax.experiment import build_experiment

        c = load_config(args.config)
        c.rollout.prompts_per_step = P
        c.rollout.rollouts_per_prompt = G
        c.rollout.max_new_tokens = Lc
        c.algorithm.kl_coef = args.kl_coef
        c.eval.datasets = ()  # no held-out set is evaluated
        c.logging.progress_bar = False
        for kv in [x for x in args.model.split(",") if x]:
            k, _, v = kv.partition("=")
            c.model.overrides[k.strip()] = _value(v.strip())
        exp = build_experiment(c)
        # EOS disabled: every completion runs to Lc tokens
        self.exp = dataclasses.replace(
            exp, train_sampling=dataclasses.replace(exp.train_sampling, eos_ids=())
        )
        self.P, self.G, self.Lc = P, G, Lc
        self.run, _ = steps.init_run(self.exp, warm_start=False)  # RL from the initialisation
        self.fns = steps.make_steps(self.exp)
        self.source = self.exp.make_source()
        self.rows, self.loads = [], []

    def step(self) -> dict:
        from grpo_jax import train

        rows = []
        self.run, _ = train.run_steps(  # one step: the points' timed steps are interleaved
            self.exp,
            self.fns,
            self.run,
            self.source,
            until=int(self.run.train.step) + 1,
            hooks=(lambda result: rows.append(result.row),),
        )
        row = rows[0]
        if row["completion_length"] != self.Lc:
            raise RuntimeError(f"completion length {row['completion_length']} != Lc {self.Lc}")
        return row

    def warm_up(self, n: int) -> None:
        t0 = time.perf_counter()
        for _ in range(n):
            self.step()
        self.warmup_s = time.perf_counter() - t0

    def timed_step(self) -> None:
        self.rows.append(self.step())
        self.loads.append(os.getloadavg()[0])

    def summary(self) -> dict:
        """Median step and phase times of the timed steps."""
        import jax

        rows = self.rows
        keys = sorted(k for k in rows[0] if k.startswith("time/"))
        for r in rows:  # per step, then the median (a sum of medians is not the median's split)
            r["time/other"] = r["time/step"] - sum(r.get(f"time/{p}", 0.0) for p in PHASES)
        keys.append("time/other")
        return {
            "P": self.P,
            "G": self.G,
            "Lc": self.Lc,
            "R": self.P * self.G,
            "prompt_len": self.exp.prompt_len,
            "params": int(sum(x.size for x in jax.tree.leaves(self.run.train.params))),
            "median_s": {k[5:]: statistics.median(r[k] for r in rows) for k in keys},
            "step_s_each": [r["time/step"] for r in rows],
            "phase_s_each": {k[5:]: [r[k] for r in rows] for k in keys},
            "warmup_s": self.warmup_s,
            "generated_tokens": rows[-1]["generated_tokens"],
            "loadavg_1min": self.loads,
        }


def _pt(base: dict, f: str, v: int) -> tuple[int, int, int]:
    pt = dict(base, **{f: v})
    return pt["P"], pt["G"], pt["Lc"]


def slope(xs, ys) -> float:
    """Least-squares slope of log y vs log x."""
    import numpy as np

    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/arithmetic.py:grpo")
    ap.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="model overrides of --config, key=value,... ('' = the config's own model)",
    )
    ap.add_argument("--P", type=int, default=8, help="base prompts per step")
    ap.add_argument("--G", type=int, default=4, help="base group size (rollouts per prompt)")
    ap.add_argument("--Lc", type=int, default=32, help="base completion length")
    ap.add_argument("--Gs", default="2,4,8,16", help="group sizes swept ('' = not swept)")
    ap.add_argument("--Lcs", default="16,32,64,128", help="completion lengths swept")
    ap.add_argument("--Ps", default="4,8,16,32", help="prompts per step swept")
    ap.add_argument("--kl_coef", type=float, default=0.001, help="> 0: the reference pass runs")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per point (compile)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per point (rounds)")
    ap.add_argument("--smoke", action="store_true", help="2 values per factor, 1 timed step")
    ap.add_argument("--out", default="", help="JSON path (default reports/scaling.json)")
    args = ap.parse_args(argv)
    sweeps = {"G": _ints(args.Gs), "Lc": _ints(args.Lcs), "P": _ints(args.Ps)}
    if args.smoke:
        sweeps = {k: v[:2] for k, v in sweeps.items()}
        args.steps = 1
    out = args.out or ("/tmp/scaling_smoke.json" if args.smoke else "reports/scaling.json")

    import flax
    import jax

    base = {"P": args.P, "G": args.G, "Lc": args.Lc}
    t_all = time.perf_counter()
    keys = {}  # (P, G, Lc) of every sweep's points, in sweep order (the base point once)
    for f, values in sweeps.items():
        for v in values:
            keys.setdefault(_pt(base, f, v), None)
    points = {}
    try:
        for key in keys:  # build and compile every point first ...
            points[key] = Point(args, *key)
            points[key].warm_up(args.warmup)
            print(
                f"P={key[0]:3d} G={key[1]:3d} Lc={key[2]:4d}: warm-up {points[key].warmup_s:.1f}s",
                flush=True,
            )
        # ... then time them in rounds, one step of each point per round (alternating order),
        # so that a change of the machine's load over the run falls on every point alike
        for r in range(args.steps):
            for key in list(keys) if r % 2 == 0 else list(keys)[::-1]:
                points[key].timed_step()
    finally:
        for pt in points.values():
            pt.exp.close()
    summaries = {k: pt.summary() for k, pt in points.items()}
    for key, sm in summaries.items():
        m = sm["median_s"]
        print(
            f"P={key[0]:3d} G={key[1]:3d} Lc={key[2]:4d}: step {m['step']:.3f}s "
            + " ".join(f"{p} {m.get(p, 0.0):.3f}s" for p in PHASES),
            flush=True,
        )
    results = {}
    for f, values in sweeps.items():
        if values:
            results[f] = [summaries[_pt(base, f, v)] for v in values]
    slopes = {}
    for f, pts in results.items():
        if len(pts) >= 2:
            xs = [p[f] for p in pts]
            slopes[f] = {
                ph: slope(xs, [max(p["median_s"].get(ph, 0.0), 1e-9) for p in pts])
                for ph in ("step", *PHASES)
            }
    if len(results.get("Lc", [])) >= 2:  # vs the sequence length T = Lp + Lc the update sees
        pts = results["Lc"]
        xs = [p["prompt_len"] + p["Lc"] for p in pts]
        slopes["T"] = {
            ph: slope(xs, [max(p["median_s"].get(ph, 0.0), 1e-9) for p in pts])
            for ph in ("step", *PHASES)
        }
    res = {
        "settings": dict(vars(args)),
        "base": base,
        "sweeps": sweeps,
        "results": results,
        "slopes": slopes,
        "wall_s": time.perf_counter() - t_all,
        "machine": {
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "backend": jax.default_backend(),
            "device": str(jax.devices()[0].device_kind),
            "jax": jax.__version__,
            "flax": flax.__version__,
            "python": platform.python_version(),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
        },
    }
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    stem = os.path.splitext(out)[0]
    with open(stem + ".md", "w") as f:
        f.write(markdown(res, argv))
    plot(res, stem + ".png")
    print(f"wrote {out}, {stem}.md, {stem}.png ({res['wall_s']:.0f}s)")
    return res


def markdown(res: dict, argv=None) -> str:
    """The report of one run (``--out`` with ``.md``)."""
    a, b, m = res["settings"], res["base"], res["machine"]
    cmd = " ".join(
        ["python benchmarks/bench_scaling.py", *(sys.argv[1:] if argv is None else argv)]
    )
    any_pt = next(iter(res["results"].values()))[0]
    lines = [
        "# GRPO step time vs group size, completion length and prompts per step\n",
        f"Command: `{cmd}` ({res['wall_s']:.0f} s wall).\n",
        f"Machine: {m['cpu']}, {m['cores']} CPU core(s), backend {m['backend']}; jax {m['jax']}, "
        f"flax {m['flax']}; {m['date']}. Config `{a['config']}`"
        + (f" with model overrides `{a['model']}`" if a["model"] else "")
        + f" ({any_pt['params'] / 1e6:.2f}M parameters, random initialisation, prompts padded "
        f"to {any_pt['prompt_len']} tokens), kl_coef {a['kl_coef']} (the reference pass runs), "
        f"EOS disabled (every completion exactly Lc tokens). Base point P = {b['P']}, "
        f"G = {b['G']}, Lc = {b['Lc']} (R = P x G rollouts); one factor varied at a time. "
        f"Per point: {a['warmup']} warm-up step(s) (compilation), then the median of "
        f"{a['steps']} timed `grpo_jax.train.rl_step` calls, per phase (`time/*`); the timed "
        f"steps run in rounds of one step per point (order reversed every other round), so a "
        f"drift in the machine's load falls on every point alike.\n",
    ]
    for f, pts in res["results"].items():
        lines += [
            f"## {FACTORS[f]}\n",
            f"| {f} | R | step s | generate s | reference s | update s | other s |",
            "|---|---|---|---|---|---|---|",
        ]
        for p in pts:
            t = p["median_s"]
            lines.append(
                f"| {p[f]} | {p['R']} | {t['step']:.3f} | {t.get('generate', 0):.3f} | "
                f"{t.get('reference', 0):.3f} | {t.get('update', 0):.3f} | {t['other']:.3f} |"
            )
        s = res["slopes"].get(f)
        if s:
            lines.append(
                f"| log-log slope | | {s['step']:.2f} | {s['generate']:.2f} | "
                f"{s['reference']:.2f} | {s['update']:.2f} | |"
            )
        s = res["slopes"].get("T") if f == "Lc" else None
        if s:
            lines.append(
                f"| slope vs T = Lp + Lc | | {s['step']:.2f} | {s['generate']:.2f} | "
                f"{s['reference']:.2f} | {s['update']:.2f} | |"
            )
        lines.append("")
    lines.append(
        "Slope: least-squares slope of log(time) vs log(factor) over the table's rows; 1 = "
        "time proportional to the factor, 0 = a fixed cost (overhead, or a batch too small to "
        "occupy the machine), between = sublinear (a fixed part, or batching amortising it), "
        "2 = quadratic (e.g. attention over the sequence). The prompt (Lp tokens) is a fixed "
        "part of every sequence, so the Lc table also gives the slope vs the whole sequence "
        "length T = Lp + Lc. Step = generate + reference + update + other, each column the "
        "median over the timed steps (so the columns need not add up to the step's median); "
        "generate = sampling (prefill + Lc decode steps) and the completions' transfer; "
        "reference = advantages and the reference model's log-prob pass; update = the policy "
        "gradient step; other = drawing prompts, the reward and the controllers. "
        "The base point is measured once and appears in all three tables.\n"
    )
    loads = [x for pts in res["results"].values() for p in pts for x in p["loadavg_1min"]]
    lines.append(
        f"The machine was shared: 1-minute load average {min(loads):.1f}-{max(loads):.1f} on "
        f"{m['cores']} cores around the points (`loadavg_1min` per point in the JSON), so "
        "absolute times carry the other processes' load.\n"
    )
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    """Log-log step and phase times vs each factor (one panel per factor)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    facs = list(res["results"])
    fig, axes = plt.subplots(1, len(facs), figsize=(4.2 * len(facs), 3.8), squeeze=False)
    for ax, f in zip(axes[0], facs):
        pts = res["results"][f]
        xs = [p[f] for p in pts]
        for ph, style in (("step", "k-o"), ("generate", "C0--s"), ("reference", "C1--^")):
            ys = [max(p["median_s"].get(ph, 0.0), 1e-6) for p in pts]
            s = res["slopes"].get(f, {}).get(ph)
            ax.plot(xs, ys, style, label=f"{ph}" + (f" (slope {s:.2f})" if s is not None else ""))
        ys = [max(p["median_s"].get("update", 0.0), 1e-6) for p in pts]
        s = res["slopes"].get(f, {}).get("update")
        ax.plot(xs, ys, "C2--v", label="update" + (f" (slope {s:.2f})" if s is not None else ""))
        y0 = pts[0]["median_s"]["step"]
        ax.plot(xs, [y0 * x / xs[0] for x in xs], ":", color="grey", label="slope 1")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel(FACTORS[f])
        ax.set_ylabel("seconds (median)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    b = res["base"]
    fig.suptitle(
        f"GRPO step time, base P={b['P']} G={b['G']} Lc={b['Lc']} ({res['machine']['cpu']}, "
        f"{res['machine']['cores']} cores)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
