"""The comparison's figures and its markdown report (``gdro_vs_grpo.md``)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence

import numpy as np

from experiments.compare.diagnostics import P_STRATA_LABELS, rows_values
from experiments.compare.plan import (
    DEFAULT_CONFIG,
    METRICS,
    PAPER,
    REPORT_NAME,
    algorithm,
    label,
    overrides,
    split_config_arg,
)

PREREG_TITLE = "## Pre-registered protocol and criterion"

# ----------------------------------------------------------------------------- figures


def _mean_rows(rows_per_seed: Sequence[list], key: str) -> list[dict]:
    """Per-step mean over seeds of a list-valued metric -> rows for ``report.heatmap``."""
    by_step: dict[int, list] = {}
    for rows in rows_per_seed:
        for r in rows:
            if isinstance(r.get(key), list):
                by_step.setdefault(r["step"], []).append(np.asarray(r[key], float))
    return [
        {"step": s, key: np.nanmean(np.stack(v), 0).tolist()} for s, v in sorted(by_step.items())
    ]


def _series(rows_per_seed, key):
    steps = sorted({r["step"] for rows in rows_per_seed for r in rows if key in r})
    vals = np.full((len(rows_per_seed), len(steps)), np.nan)
    pos = {s: i for i, s in enumerate(steps)}
    for j, rows in enumerate(rows_per_seed):
        for r in rows:
            if key in r:
                with contextlib.suppress(TypeError, ValueError):
                    vals[j, pos[r["step"]]] = float(r[key])
    return np.asarray(steps), vals


def _smooth(y, w):
    if w <= 1 or len(y) < w:
        return y
    k = np.ones(w) / w
    return np.convolve(np.nan_to_num(y, nan=np.nanmean(y)), k, mode="valid")


class _Figures:
    """Writes the PNGs into ``fig_dir``; ``paths``: {name: path}."""

    def __init__(self, results: dict, fig_dir: str):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        self.plt, self.results, self.fig_dir, self.paths = plt, results, fig_dir, {}
        self.methods = list(results["runs"])
        runs = results["runs"]
        self.rows = {m: [runs[m][s]["rows"] for s in sorted(runs[m])] for m in self.methods}
        os.makedirs(fig_dir, exist_ok=True)

    def save(self, fig, name):
        path = os.path.join(self.fig_dir, name)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        self.plt.close(fig)
        self.paths[name[:-4]] = path

    def heatmap_row(self, methods, key, title, name):
        from experiments import report

        if not methods:
            return
        fig, axes = self.plt.subplots(
            1, len(methods), figsize=(4.6 * len(methods), 3.6), squeeze=False
        )
        for ax, m in zip(axes[0], methods):
            report.heatmap(ax, _mean_rows(self.rows[m], key), key, f"{label(m)}\n{title(m)}")
        self.save(fig, name)

    def heatmaps(self):
        ms = self.methods
        self.heatmap_row(ms, "gdro/bin_share", lambda m: "share/bin", "heatmap_data_share.png")
        pg = [m for m in ms if algorithm(m) == "prompt_gdro"]
        resample = lambda m: overrides(m).get("gdro.prompt.apply") == "resample"
        what = lambda m: "sampling distribution q" if resample(m) else "weight q"
        self.heatmap_row(pg, "gdro/q", what, "heatmap_prompt_gdro_q.png")
        rg = [m for m in ms if algorithm(m) == "rollout_gdro"]
        self.heatmap_row(
            rg,
            "rollout_gdro/n_b",
            lambda m: "rollouts per prompt n_b",
            "heatmap_rollouts_per_prompt.png",
        )

    def wse(self):
        diag = self.results["diagnostics"]
        fig, axes = self.plt.subplots(1, 3, figsize=(16, 3.8))
        for m in self.methods:
            series = diag[m].get("series", {})
            for ax, key in zip(axes, ("wse_true", "wse_true_ratio", "informative")):
                v = np.asarray(series.get(key, []), float)
                if v.size and np.isfinite(v).any():
                    st = np.arange(1, v.shape[1] + 1)
                    w = max(1, len(st) // 20)
                    ax.plot(st[w - 1 :], _smooth(np.nanmean(v, 0), w), label=label(m))
        titles = (
            "true WSE = mean_i sqrt(p_i (1 - p_i)) / sqrt(n_i)",
            "true WSE / uniform allocation (same batches)",
            "informative groups per step (measured)",
        )
        for ax, t in zip(axes, titles):
            ax.set_title(t, fontsize=9)
            ax.set_xlabel("step")
            if ax.lines:
                ax.legend(fontsize=7)
        axes[1].axhline(1.0, color="k", lw=0.8)
        self.save(fig, "wse_true.png")

    def train_curves(self):
        fig, axes = self.plt.subplots(1, 3, figsize=(14, 3.6))
        for ax, key in zip(axes, ["reward_mean", "pass_rate", "advantages/num_zero_std_groups"]):
            for m in self.methods:
                st, v = _series(self.rows[m], key)
                if len(st):
                    w = max(1, len(st) // 15)
                    ax.plot(st[w - 1 :], _smooth(np.nanmean(v, 0), w), label=label(m))
            ax.set_title(f"train {key} (mean over seeds, smoothed)", fontsize=9)
            ax.set_xlabel("step")
        if axes[0].lines:
            axes[0].legend(fontsize=7)
        self.save(fig, "train_curves.png")

    def eval_curves(self):
        curves, pk = self.results["eval_curves"], self.results["pass_k"]
        fig, axes = self.plt.subplots(1, 2, figsize=(11, 3.6))
        for ax, metric in zip(axes, METRICS):
            for m in self.methods:
                st = [0] + list(curves[m]["steps"])
                y = [curves["before"][metric]] + list(curves[m][metric])
                ax.plot(st, 100 * np.asarray(y), marker="o", ms=3, label=label(m))
            ax.set_title(f"test {metric.replace('_at_k', '@')}{pk} (mean over seeds)")
            ax.set_xlabel("step")
            ax.set_ylabel("%")
        axes[0].legend(fontsize=7)
        self.save(fig, "eval_curves.png")

    def lr_sweep(self):
        fig, ax = self.plt.subplots(figsize=(6, 3.6))
        for m in self.methods:
            sc = self.results["sweep"][m]["scores"]
            ax.plot(
                [float(x) for x in sc], [100 * v for v in sc.values()], marker="o", label=label(m)
            )
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_ylabel(f"validation {self.results['setup']['select_metric']} (%)")
        ax.set_title("lr sweep (sweep seeds, validation half)", fontsize=9)
        ax.legend(fontsize=7)
        self.save(fig, "lr_sweep.png")

    def pass_bars(self):
        fig, ax = self.plt.subplots(figsize=(9, 3.6))
        tab = self.results["tables"]
        groups = list(tab["before"].keys())
        width = 0.8 / (len(self.methods) + 1)
        for i, m in enumerate(["before"] + self.methods):
            mean = [tab[m][g]["pass_at_k"][0] for g in groups]
            std = [tab[m][g]["pass_at_k"][1] for g in groups]
            name = "before RL (SFT)" if m == "before" else label(m)
            x = np.arange(len(groups)) + i * width
            ax.bar(x, mean, width, yerr=std, capsize=2, label=name)
        ax.set_xticks(np.arange(len(groups)) + 0.4 - width / 2)
        ax.set_xticklabels([g if g == "overall" else f"level {g}" for g in groups])
        ax.set_ylabel(f"test pass@{self.results['pass_k']}")
        ax.legend(fontsize=7, ncol=3)
        self.save(fig, "pass_at_8.png")


def make_figures(results: dict, fig_dir: str) -> dict[str, str]:
    """Writes the PNGs (final runs at the chosen lr; evaluations on the test half); returns
    {name: path}."""
    f = _Figures(results, fig_dir)
    for draw in (f.heatmaps, f.wse, f.train_curves, f.eval_curves, f.lr_sweep, f.pass_bars):
        draw()
    return f.paths


# ----------------------------------------------------------------------------- formatting


def _fmt(x, spec=".3f", pct=False):
    if x is None or not np.isfinite(x):
        return "—"
    return f"{100 * x:{spec}}" if pct else f"{x:{spec}}"


def _ci(g, key="gain", unit="%", spec="+.1f"):
    """``g[key] [lo, hi]``; ``unit`` "%" or "pp" scales by 100, "" does not."""
    lo = g.get("lo" if key == "gain" else f"{key}_lo")
    hi = g.get("hi" if key == "gain" else f"{key}_hi")
    if g.get(key) is None or not np.isfinite(g[key]):
        return "—"
    f = lambda x: _fmt(x, spec, bool(unit))
    return f"{f(g[key])}{unit} [{f(lo)}, {f(hi)}]"


def _pm(x):
    m, s = x
    return f"{100 * m:.1f} ± {100 * s:.1f}"


# ----------------------------------------------------------------------------- text blocks


def _mean_list(runs_m, key) -> np.ndarray | None:
    """Mean over seeds of the per-seed mean over steps of a list-valued metric."""
    per_seed = [
        np.nanmean([r[key] for r in job["rows"] if isinstance(r.get(key), list)], 0)
        for job in runs_m.values()
        if any(isinstance(r.get(key), list) for r in job["rows"])
    ]
    return np.stack(per_seed).mean(0) if per_seed else None


def _list_values(runs_m, key) -> np.ndarray | None:
    v = [r[key] for job in runs_m.values() for r in job["rows"] if isinstance(r.get(key), list)]
    return np.asarray(v, float) if v else None


def _curriculum_lines(m: str, runs_m: dict) -> list[str]:
    lines = []
    share = _mean_list(runs_m, "gdro/bin_share")
    unseen = np.nanmean(
        [rows_values(j["rows"], "gdro/unseen_share").mean() for j in runs_m.values()]
    )
    if share is not None:
        lines.append(
            f"- {label(m)}: mean rollout share in bin 0 (hardest seen) {100 * share[0]:.0f}%, "
            f"in bins >= 5 {100 * share[5:].sum():.0f}%"
            + (f", unseen prompts {100 * unseen:.0f}%." if np.isfinite(unseen) else ".")
        )
    q = _list_values(runs_m, "gdro/q") if algorithm(m) == "prompt_gdro" else None
    if q is not None:
        lines.append(
            f"  q: mean max weight {np.nanmax(q, 1).mean():.2f} on bin "
            f"{int(np.bincount(np.nanargmax(q, 1)).argmax())} (most often)."
        )
    nb = _list_values(runs_m, "rollout_gdro/n_b") if algorithm(m) == "rollout_gdro" else None
    if nb is not None:
        present = (nb > 0).sum(0)
        mean_nb = np.where(
            present > 0, np.where(nb > 0, nb, 0).sum(0) / np.maximum(present, 1), np.nan
        )
        lines.append(
            "  mean rollouts per prompt by bin (steps where the bin is present): "
            + ", ".join("—" if not np.isfinite(x) else f"{x:.1f}" for x in mean_nb)
            + "."
        )
    return lines


def curriculum_text(runs) -> str:
    return "\n".join(line for m in runs for line in _curriculum_lines(m, runs[m]))


def diagnostics_table(results) -> str:
    """The variance-diagnostics table (true WSE per prompt, from true p)."""
    diag, P = results["diagnostics"], results["setup"]["prompts_per_step"]
    L = [
        "| method | train pass rate | informative groups / step (measured) | expected informative "
        "groups (true p; uniform) | true WSE | true WSE / uniform | proxy WSE / uniform | "
        "weight ESS (informative) | steps with the weight cap binding |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m in results["runs"]:
        d = diag[m]
        cap = d.get("weight_cap_bound", np.nan)
        L.append(
            f"| {label(m)} | {_fmt(d['train_pass_rate'], '.0f', True)}% | "
            f"{_fmt(d['informative_groups'], '.1f')} of {P} | "
            f"{_fmt(d.get('expected_informative'), '.1f')} "
            f"({_fmt(d.get('expected_informative_uniform'), '.1f')}) | "
            f"{_fmt(d.get('wse_true'), '.4f')} | {_fmt(d.get('wse_true_ratio'), '.3f')} | "
            f"{_fmt(d.get('wse_proxy_ratio'), '.3f')} | {_fmt(d.get('weight_ess'), '.2f')} | "
            + (f"{_fmt(cap, '.0f', True)}% |" if np.isfinite(cap) else "— |")
        )
    return "\n".join(L)


def arm_table(results) -> str:
    """Per-arm diagnostics: controller data, weights, informative groups, WSE, n by stratum."""
    diag = results["diagnostics"]
    L = [
        "| method | steps with controller data | weight max/min ratio | weight ESS | informative "
        "groups / step: measured; expected / uniform | true WSE / uniform | rollouts per "
        "prompt by true p: " + ", ".join(P_STRATA_LABELS) + " |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in results["runs"]:
        d = diag[m]
        strata = d.get("rollouts_by_stratum")
        n_cells = "—" if strata is None else " / ".join(_fmt(x, ".2f") for x in strata)
        L.append(
            f"| {label(m)} | {_fmt(d.get('controller_data_share'), '.0f', True)}% | "
            f"{_fmt(d.get('weight_ratio'), '.2f')} | {_fmt(d.get('weight_ess'), '.2f')} | "
            f"{_fmt(d.get('informative_groups'), '.1f')}; "
            f"{_fmt(d.get('expected_informative_ratio'), '.3f')} | "
            f"{_fmt(d.get('wse_true_ratio'), '.3f')} | {n_cells} |"
        )
    share = next((d["stratum_share"] for d in diag.values() if "stratum_share" in d), None)
    n_bar = next((d["n_bar"] for d in diag.values() if "n_bar" in d), None)
    if share is not None:
        L.append(
            f"\nUniform allocation: {n_bar:g} rollouts per prompt in every stratum. Share of the "
            "drawn prompts per stratum (first arm): "
            + ", ".join(f"{lab} {100 * s:.0f}%" for lab, s in zip(P_STRATA_LABELS, share))
            + "."
        )
    return "\n".join(L)


def _sig(g) -> str:
    if not np.isfinite(g["gain"]):
        return "undefined: GRPO scores 0"
    return "above 0" if g["lo"] > 0 else "below 0" if g["hi"] < 0 else "not distinguishable from 0"


def _verdict_head(gains) -> str:
    pos = [m for m, g in gains.items() if g["pass_at_k"]["lo"] > 0]
    neg = [m for m, g in gains.items() if g["pass_at_k"]["hi"] < 0]
    families = {algorithm(m) for m in gains}
    if pos and {algorithm(m) for m in pos} == families:
        head = (
            "In direction: every GDRO family tested has a variant whose relative pass@8 gain over "
            "GRPO has a 95% bootstrap interval above zero ("
            + ", ".join(label(m) for m in pos)
            + ")."
        )
    elif pos:
        head = (
            "Partly: only " + ", ".join(label(m) for m in pos) + " shows a relative pass@8 gain "
            "over GRPO whose 95% bootstrap interval lies above zero."
        )
    elif all(not np.isfinite(g["pass_at_k"]["gain"]) for g in gains.values()):
        head = "Undecided: GRPO scores 0 on the test half, so no relative gain is defined."
    else:
        head = (
            "No: no GDRO variant shows a relative pass@8 gain over GRPO whose 95% bootstrap "
            "interval excludes zero."
        )
    if pos and all(gains[m]["pass_at_k"]["hi"] < PAPER_GAIN for m in pos):
        head += f" Every such interval lies below the paper's +{PAPER_GAIN:.0%}."
    if neg:
        head += " Significantly worse than GRPO: " + ", ".join(label(m) for m in neg) + "."
    return head


def verdict(results) -> str:
    gains = results["gains"]
    if not gains:
        return "Only GRPO was run: no comparison."
    parts = [
        f"{label(m)}: pass@8 {_ci(g['pass_at_k'])} ({_sig(g['pass_at_k'])}), mean@8 "
        f"{_ci(g['mean_at_k'])} ({_sig(g['mean_at_k'])})"
        for m, g in gains.items()
    ]
    s = results["setup"]
    cpath, carg = split_config_arg(s["config_arg"])
    where = (
        f"tiny character-level transformer, arithmetic `{carg}`"
        if cpath == DEFAULT_CONFIG
        else f"`{cpath}` `{carg}`"
    )
    return (
        f"**{_verdict_head(gains)}**\n\nPaper: {PAPER}. Here ({where}, {s['steps']} RL steps, "
        f"{len(s['seeds'])} paired seeds, lr chosen per method on the validation half, test half "
        "reported): "
        + "; ".join(parts)
        + ". This is a small CPU-scale proxy of the paper's setting (model scale, task and "
        "training length differ), so it tests whether the mechanism helps at this scale rather "
        "than the paper's numbers."
    )


PAPER_GAIN = 0.10  # the paper's relative pass@8 gain (Table 1: +10.6% / +10.1%)


def criterion(results) -> dict:
    """The pre-registered criterion (reports/gdro_mechanism/preregistration.md): per arm,
    ``meets`` = the 95% CI lower bound of the relative test pass@8 gain vs GRPO is above 0
    (the paper's direction); ``size`` = it meets that and the CI's upper bound reaches
    ``PAPER_GAIN`` (the paper's size is not excluded); ``supports`` = some arm meets it;
    ``supports_size`` = some arm has ``size``; ``best`` = the arm with the highest gain;
    ``meets_holm`` = the arm's one-sided bootstrap p-value (``p_le_0``, the share of replicates
    with gain <= 0) is rejected by Holm's step-down over all arms at 0.025 (`statistics.holm`;
    reports/gdro_fair_test/preregistration.md)."""
    from experiments.compare.statistics import holm

    gains = {m: g["pass_at_k"] for m, g in results["gains"].items()}
    meets = {m: bool(np.isfinite(g["lo"]) and g["lo"] > 0) for m, g in gains.items()}
    meets_holm = holm({m: g.get("p_le_0", float("nan")) for m, g in gains.items()}, 0.025)
    size = {m: meets[m] and bool(g["hi"] >= PAPER_GAIN) for m, g in gains.items()}
    finite = {m: g["gain"] for m, g in gains.items() if np.isfinite(g["gain"])}
    best = max(finite, key=finite.get) if finite else None
    return {
        "meets": meets,
        "size": size,
        "supports": any(meets.values()),
        "supports_size": any(size.values()),
        "best": best,
        "meets_holm": meets_holm,
    }


def criterion_sentence(results) -> str:
    c, k = results["criterion"], results["pass_k"]
    if c["best"] is None:
        return (
            f"No GDRO arm has a defined relative pass@{k} gain: the criterion cannot be evaluated."
        )
    g = results["gains"][c["best"]]["pass_at_k"]
    if c["supports"] and c.get("supports_size"):
        head = "supports the paper's +10% claim"
    elif c["supports"]:
        head = "supports the direction of the paper's claim, not its size"
    else:
        head = "does not support the paper's claim"
    why = (
        f"at least one GDRO arm's 95% CI of the relative test pass@{k} gain vs GRPO lies above 0"
        if c["supports"]
        else f"no GDRO arm's 95% CI of the relative test pass@{k} gain vs GRPO lies above 0"
    )
    size = ""
    if c["supports"]:
        size = (
            " and the paper's size (+10%) is within an interval that lies above 0"
            if c.get("supports_size")
            else "; the paper's size (+10%) is excluded by every such interval"
        )
        met = sum(bool(v) for v in c["meets"].values())
        size += (
            f"; {met} of {len(c['meets'])} arms met the criterion (95% each, no multiplicity "
            "correction)"
        )
        if "meets_holm" in c:
            held = sum(bool(v) for v in c["meets_holm"].values())
            size += f", {held} after Holm's step-down over the {len(c['meets'])} arms"
    return f"**This result {head}**: {why}{size} (best arm: {label(c['best'])}, {_ci(g)})."


# ----------------------------------------------------------------------------- sections


def _section_head(r, command) -> list[str]:
    s = r["setup"]
    cpath, carg = split_config_arg(s["config_arg"])
    task = f"{cpath}:<algo>" + (f",{carg}" if carg else "")
    L = [f"# GDRO vs GRPO at equal compute (`{task}`)\n", f"Regenerate: `{command}`\n"]
    L.append(
        f"Generated {r['date']} by `python -m experiments.compare`; total wall time "
        f"**{r['wall_seconds'] / 60:.1f} min** on {r['cpus']} CPU core(s), "
        f"{r['workers']} worker process(es).\n"
    )
    if r.get("preregistration"):
        L += [PREREG_TITLE + "\n", r["preregistration"].strip() + "\n"]
    return L


def _warm_text(s) -> str:
    if s.get("num_sft"):
        return (
            f"warm start ({s['sft_steps']} SFT steps on the separate warm-start pool of "
            f"{s['num_sft']} problems, disjoint from the RL pool and the held-out set)"
        )
    if s["sft_steps"]:
        return (
            f"warm start ({s['sft_steps']} SFT steps on the config's {s['num_train']} training "
            "problems)"
        )
    return "starting point (no warm start: sft.steps = 0)"


def _section_setup(r) -> list[str]:
    s, n_samples, k = r["setup"], r["k"], r["pass_k"]
    cpath, carg = split_config_arg(s["config_arg"])
    task = f"{cpath}:<algo>" + (f",{carg}" if carg else "")
    ctl = (
        "the **paper's** setting (`--paper_gdro`, failure-rate signal)."
        if s["paper_gdro"]
        else "the **corrected** defaults (`docs/gdro.md`)."
    )
    return [
        "## Setup\n",
        f"- Task: `{task}`; GDRO controllers: {ctl}",
        f"- Paired seeds: {s['seeds']}. Every method of a seed starts RL from the same supervised "
        f"{_warm_text(s)} and is evaluated with the same sampling keys.",
        f"- Held-out split ({s['num_eval']} problems): even index in the held-out list -> "
        f"validation ({s['num_val']}), odd -> test ({s['num_test']}); the list is shuffled over "
        "levels. The lr is chosen on validation only; every number below is on the **test** half.",
        f"- Learning-rate sweep: {', '.join(f'{x:g}' for x in s['lrs'])} per method on seeds "
        f"{s['sweep_seeds']} ({s['sweep_mode']}); choice = highest mean validation "
        f"{s['select_metric'].replace('_at_k', '@')}{k} over those seeds and the last "
        f"{s['last_evals']} evaluations. Final runs: every seed at the chosen lr"
        + (" (the sweep runs of the sweep seeds at that lr are reused)." if s["reuse"] else "."),
        f"- RL: {s['steps']} steps x {s['prompts_per_step']} prompts x {s['rollouts_per_prompt']} "
        f"rollouts (mean) = {s['rollouts_per_step']} rollouts per step for every method "
        "(Rollout-GDRO redistributes the same R). RL prompt pool: the first "
        f"{s['rl_prompts']} training problems ({s['visits_per_prompt']:.1f} visits per prompt on "
        "average; the online classifier bins a prompt by its past visits, so it needs repeats).",
        f"- Evaluation: after steps {s['eval_steps']}, {n_samples} samples per held-out problem "
        "(temperature 0.6, top-p 0.8, top-k 20); a run's score is the mean of its last "
        f"{s['last_evals']} evaluations (steps {s['eval_steps'][-s['last_evals'] :]}). "
        f"pass@{k} = the unbiased estimate (Chen et al. 2021) from the {n_samples} samples of the "
        f"chance that one of {k} samples is correct; mean@{k} = mean accuracy of the samples.\n",
    ]


def _section_sweep(r, rel) -> list[str]:
    lrs = r["setup"]["lrs"]
    L = ["## Learning-rate sweep (validation half, sweep seeds)\n"]
    L.append("| method | " + " | ".join(f"lr {x:g}" for x in lrs) + " | chosen |")
    L.append("|---|" + "---|" * (len(lrs) + 1))
    edge = []
    for m in r["runs"]:
        sw = r["sweep"][m]
        cells = [f"{100 * sw['scores'][f'{x:.3g}']:.1f}" for x in lrs]
        cells = [f"**{c}**" if x == sw["chosen"] else c for c, x in zip(cells, lrs)]
        at_edge = sw["chosen"] in (min(lrs), max(lrs))
        edge += [label(m)] if at_edge else []
        chosen = f"{sw['chosen']:g}" + (" (edge)" if at_edge else "")
        L.append(f"| {label(m)} | " + " | ".join(cells) + f" | {chosen} |")
    L.append(
        "\n"
        + (
            f"At an edge of the grid (not bracketed: a better lr may lie beyond it): "
            f"{', '.join(edge)}.\n"
            if edge
            else "Every chosen lr is inside the grid (bracketed by a worse lr on each side).\n"
        )
    )
    L.append(f"\n![lr sweep]({rel(r['figs']['lr_sweep'])})\n")
    return L


def _headline_row(r, m) -> str:
    g, tab = r["gains"].get(m), r["tables"]
    lr = "—" if m == "before" else f"{r['sweep'][m]['chosen']:g}"
    name = "before RL (SFT warm start)" if m == "before" else label(m)
    cells = (
        ["—"] * 4
        if g is None
        else [
            _ci(g["pass_at_k"]),
            _ci(g["mean_at_k"]),
            _ci(g["pass_at_k"], "d_z", "", "+.2f"),
            _ci(g["mean_at_k"], "d_z", "", "+.2f"),
        ]
    )
    return (
        f"| {name} | {lr} | {_pm(tab[m]['overall']['pass_at_k'])} | "
        f"{_pm(tab[m]['overall']['mean_at_k'])} | " + " | ".join(cells) + " |"
    )


def _section_headline(r, rel) -> list[str]:
    k = r["pass_k"]
    L = [f"## Headline: test pass@{k} and mean@{k} (%, mean ± std over seeds)\n"]
    if r.get("criterion"):
        L.append(criterion_sentence(r) + "\n")
    L.append(
        f"| method | lr | pass@{k} | mean@{k} | relative pass@{k} gain vs GRPO (95% CI) | "
        f"relative mean@{k} gain (95% CI) | d_z pass@{k} (95% CI) | d_z mean@{k} (95% CI) |"
    )
    L.append("|---|---|---|---|---|---|---|---|")
    L += [_headline_row(r, m) for m in ["before"] + list(r["runs"])]
    L.append("")
    diffs = "; ".join(
        f"{label(m)} pass@{k} {_ci(g['pass_at_k'], 'diff', 'pp')} / mean@{k} "
        f"{_ci(g['mean_at_k'], 'diff', 'pp')}"
        for m, g in r["gains"].items()
    )
    L.append(
        f"Paired bootstrap ({r['n_boot']} replicates) over seeds and test problems: each "
        "replicate resamples the seeds and, independently, the test problems with replacement, "
        "applies the same draw to the method and to GRPO and recomputes mean(method) / "
        "mean(GRPO) - 1; intervals are 2.5-97.5% percentiles. d_z = mean / std of the per-seed "
        "differences (paired effect size; |d_z| ~ 0.2 small, 0.5 medium, 0.8 large), its "
        f"interval from the same replicates. Absolute differences (percentage points): {diffs}.\n"
    )
    L.append(f"![test pass@8 per level]({rel(r['figs']['pass_at_8'])})\n")
    L.append(f"![evaluation curves]({rel(r['figs']['eval_curves'])})\n")
    return L


def _section_criterion(r) -> list[str]:
    if not r.get("criterion"):
        return []
    k = r["pass_k"]
    L = [f"## Criterion: 95% CI lower bound of the relative test pass@{k} gain vs GRPO above 0\n"]
    for m, ok in r["criterion"]["meets"].items():
        g = r["gains"][m]["pass_at_k"]
        L.append(f"- {label(m)}: {_ci(g)}: {'meets the criterion' if ok else 'does not'}.")
    return L + [""]


def _section_mixes(r) -> list[str]:
    mix = r.get("mix_gains")
    if not mix:
        return []
    ks, hw = mix["ks"], mix["hard_weights"]
    weights = ", ".join(f"level {l}: {w:g}" for l, w in hw.items())
    cols = [(name, kk) for name in ("train", "hard") for kk in ks]
    head = {"train": "training mix", "hard": "hard mix"}
    tw = mix.get("train_weights")
    train = (
        "Training mix = pooled over the test problems (their level mix is the training one)"
        if tw is None
        else "Training mix = per-level means combined with the RL pool's level weights "
        + ", ".join(f"level {l}: {w:g}" for l, w in tw.items())
        + " (the test half's level mix differs from it, so the pooled headline above is not "
        "the training mix)"
    )
    L = [
        "## pass@k on the training mix and a hard-weighted mix (test half)\n",
        "Each cell: score (%, mean over seeds) / relative gain vs GRPO [paired bootstrap 95% CI]. "
        f"{train}; hard mix = per-level means combined with weights {weights} (`mix_mean`). "
        f"pass@k unbiased from the {r['k']} samples (k <= samples only).\n",
        "| method | " + " | ".join(f"{head[n]} pass@{kk}" for n, kk in cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    for m in r["runs"]:
        cells = []
        for n, kk in cols:
            g = mix["gains"][m][n][str(kk)]
            cells.append(
                f"{100 * g['mean']:.1f}" + ("" if m == "grpo" else f" / {_ci(g, spec='+.1f')}")
            )
        L.append(f"| {label(m)} | " + " | ".join(cells) + " |")
    return L + [""]


def _section_compute(r) -> list[str]:
    L = ["## Equal compute (per run, mean over seeds)\n"]
    L.append("| method | RL steps | rollouts | generated completion tokens | optimizer updates |")
    L.append("|---|---|---|---|---|")
    for m in r["runs"]:
        c = r["compute"][m]
        L.append(
            f"| {label(m)} | {c['steps']:.0f} | {c['rollouts']:.0f} | "
            f"{c['generated_tokens']:.0f} | {c['updates']:.0f} |"
        )
    return L + [""]


def _finite_median(x) -> float | None:
    x = np.asarray(x, np.float64)
    return float(np.median(x[np.isfinite(x)])) if np.isfinite(x).any() else None


def _section_compute_to_grpo(r) -> list[str]:
    """Tokens / rollouts / CPU seconds to reach GRPO's final validation pass@k (token-budget
    runs only: jobs that record ``eval_tokens``)."""
    c = r.get("compute_to_grpo") or {}
    if not any(v["seeds"] for v in c.values()):
        return []
    k = r["pass_k"]
    L = [
        f"## Compute to reach GRPO's final validation pass@{k} (per seed, first evaluation at "
        "or above it)\n",
        "| method | tokens used (mean) | rollouts used (mean) | seeds reaching | median tokens "
        "to reach | median rollouts to reach |",
        "|---|---|---|---|---|---|",
    ]
    spent = {m: r["compute"][m].get("budget_spent") for m in c if m in r.get("compute", {})}
    short = [f"{label(m)} ({x:.0%})" for m, x in spent.items() if x is not None and x < 1]
    for m, v in c.items():
        L.append(
            f"| {label(m)} | {v['budget_tokens']:.0f} | {v['budget_rollouts']:.0f} | "
            f"{v['reached']:.0%} | {_fmt(v['median_tokens'], '.0f')} | "
            f"{_fmt(_finite_median(v['rollouts']), '.0f')} |"
        )
    L.append("\nCPU seconds to reach it: in the Timing section (a clock measure).")
    L.append(
        "Every run spent its token budget."
        if not short
        else "Runs that hit the step cap before spending the budget (share of runs that spent "
        "it): " + ", ".join(short) + "."
    )
    return L + [""]


def _section_by_start(r) -> list[str]:
    """Relative test pass@k gains by each seed's warm-start success on each test problem."""
    b = r.get("gains_by_start")
    if not b or "share" not in b:
        return []
    labels = list(b["share"])
    k = r["pass_k"]
    L = [
        f"## Relative test pass@{k} gain by the warm start's success on the problem\n",
        "Stratum = the share of the seed's own warm-start samples that solved the test problem "
        "(each seed has its own warm start); the header gives the stratum's share of the "
        "(seed, problem) cells. Gain = the method's summed scores over the stratum's cells / "
        "GRPO's - 1, paired bootstrap over seeds and problems.\n",
        "| method | " + " | ".join(f"{lab} ({b['share'][lab]:.0%})" for lab in labels) + " |",
        "|---|" + "---|" * len(labels),
    ]
    for m, by in b.items():
        if m == "share":
            continue
        cells = [
            f"{100 * by[lab]['gain']:+.1f}% [{100 * by[lab]['lo']:+.1f}, {100 * by[lab]['hi']:+.1f}]"
            if by[lab]
            else "—"
            for lab in labels
        ]
        L.append(f"| {label(m)} | " + " | ".join(cells) + " |")
    return L + [""]


def _section_levels(r) -> list[str]:
    tab, k, methods = r["tables"], r["pass_k"], list(r["runs"])
    levels = [g for g in tab["before"] if g != "overall"]
    head = "| method | " + " | ".join(f"level {l}" for l in levels) + " |"
    rule = "|---|" + "---|" * len(levels)
    L = ["## Per difficulty level (test half)\n"]
    for metric, title in [("pass_at_k", f"pass@{k}"), ("mean_at_k", f"mean@{k}")]:
        L += [f"**{title}** (%, mean ± std over seeds)\n", head, rule]
        for m in ["before"] + methods:
            name = "before RL" if m == "before" else label(m)
            L.append(f"| {name} | " + " | ".join(_pm(tab[m][l][metric]) for l in levels) + " |")
        L.append("")
    gl = r["gains_by_level"]
    L += [
        f"**Relative pass@{k} gain vs GRPO per level** (%, paired bootstrap 95% CI)\n",
        head,
        rule,
    ]
    for m in gl:
        cells = [
            "— (GRPO 0)" if gl[m].get(l) is None else _ci(gl[m][l], spec="+.0f") for l in levels
        ]
        L.append(f"| {label(m)} | " + " | ".join(cells) + " |")
    return L + [""]


def _section_curriculum(r, rel) -> list[str]:
    where = (
        "never-seen prompts are in bin 0, the paper's classifier).\n"
        if r["setup"]["paper_gdro"]
        else "never-seen prompts are outside the bins, the corrected classifier).\n"
    )
    L = [
        "## Curriculum and allocation\n",
        "Step x bin heatmaps of the final runs, mean over seeds (bin 0 = hardest; " + where,
    ]
    for name in ["heatmap_data_share", "heatmap_prompt_gdro_q", "heatmap_rollouts_per_prompt"]:
        if name in r["figs"]:
            L.append(f"![{name}]({rel(r['figs'][name])})\n")
    return L + [r["curriculum_text"] + "\n"]


WSE_PROSE = (
    "True WSE = mean_i sqrt(p_i (1 - p_i)) / sqrt(n_i) over the step's prompts "
    "(`grpo_jax.metrics.weighted_standard_error`, per prompt from the true p_i, n_i = its "
    "rollouts), mean over steps and seeds; '/ uniform' = the same batches with n_bar rollouts "
    "per prompt (1 for methods that do not reallocate). (A stratum-averaged form, sqrt of a "
    "bin's mean p (1 - p), overstates the error of mixed bins by Jensen's inequality; it is kept "
    "out of this table, as `wse_bins_ratio` in the JSON.) Expected informative groups = "
    "sum_i 1 - p_i^n_i - (1 - p_i)^n_i. The proxy is the allocator's own `rollout_gdro/wse` "
    "(circular, spec s.7). Weight ESS = Kish effective sample size fraction of the advantage "
    "weights over informative rollouts."
)
ARM_PROSE = (
    "Per arm: steps with controller data = share of steps whose batch held at least one prompt "
    "the classifier had seen (bin < number of bins); weight max/min ratio = mean over steps of "
    "`gdro/weight_ratio` over informative rollouts (— when not logged); informative groups: "
    "measured per step (`advantages/num_groups` - `advantages/num_zero_std_groups`) and the "
    "expected count under the true p divided by the same with n_bar rollouts per prompt; "
    "rollouts per prompt: mean n_i over the steps' prompts in each stratum of the true p."
)


def _section_variance(r, rel) -> list[str]:
    return [
        "## Variance diagnostics\n",
        r["oracle_text"] + "\n",
        r["diagnostics_text"] + "\n",
        WSE_PROSE + "\n",
        "### Per-arm diagnostics\n",
        r["arm_text"] + "\n",
        ARM_PROSE + "\n",
        f"![true WSE]({rel(r['figs']['wse_true'])})\n",
        f"![training curves]({rel(r['figs']['train_curves'])})\n",
    ]


def _section_end(r, out_dir, rel) -> list[str]:
    L = ["## Does this support the paper?\n", r["verdict"] + "\n"]
    notes = os.path.join(out_dir, REPORT_NAME, "notes.md")
    if os.path.exists(notes):
        with open(notes) as f:
            L.append("## Observations (written by hand after the run; `" + rel(notes) + "`)\n")
            L.append(f.read().strip() + "\n")
    t = r["timing"]
    L += ["## Timing\n", "| job | count | seconds per job (mean) |", "|---|---|---|"]
    L.append(f"| SFT warm start + before-eval | {t['n_warm']} | {t['warm_start']:.0f} |")
    for m in r["runs"]:
        L.append(f"| {m} (RL + evaluations) | {t['n_jobs'][m]} | {t['rl'][m]:.0f} |")
    c = r.get("compute_to_grpo") or {}
    if any(v["seeds"] for v in c.values()):
        cpu = ", ".join(
            f"{label(m)} {_fmt(_finite_median(v['cpu_seconds']), '.0f')}" for m, v in c.items()
        )
        L.append(
            f"\nCPU seconds (evaluation excluded) to reach GRPO's final validation pass@"
            f"{r['pass_k']}, median over the seeds that reach it: {cpu}."
        )
    est = r.get("estimate_seconds")
    L.append(
        f"\nTotal wall time: {r['wall_seconds']:.0f} s ({r['wall_seconds'] / 60:.1f} min); "
        "estimated before the run: " + (f"{est / 60:.1f} min." if est else "—.") + "\n"
    )
    return L


def write_report(results: dict, out_dir: str, figs: dict, command: str) -> str:
    """Writes ``<out_dir>/gdro_vs_grpo.md``; returns its path."""
    r = dict(results, figs=figs)
    rel = lambda p: os.path.relpath(p, out_dir)
    L = _section_head(r, command)
    L += _section_setup(r) + _section_sweep(r, rel) + _section_headline(r, rel)
    L += _section_criterion(r) + _section_mixes(r) + _section_compute(r)
    L += _section_compute_to_grpo(r) + _section_levels(r) + _section_by_start(r)
    L += _section_curriculum(r, rel) + _section_variance(r, rel) + _section_end(r, out_dir, rel)
    path = os.path.join(out_dir, f"{REPORT_NAME}.md")
    with open(path, "w") as f:
        f.write("\n".join(L))
    return path
