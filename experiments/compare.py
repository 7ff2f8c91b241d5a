"""GRPO vs Prompt-GDRO vs Rollout-GDRO at equal compute on the heavy-tailed arithmetic task.

  python -m experiments.compare --out=reports            # the full comparison (~40 min, 2 CPU cores)
  python -m experiments.compare --out=/tmp/c --config_arg=heavy_tailed,smoke --seeds=1 --steps=3

Five methods (``METHODS``): GRPO, Prompt-GDRO (``advantage_weight`` and ``resample``) and
Rollout-GDRO (``bandit`` and ``sqrt`` allocators), each from ``configs/arithmetic.py:<algo>,<arg>``
and run for every seed. Equal compute: every method draws ``P = prompts_per_step`` prompts and
generates ``R = P * rollouts_per_prompt`` rollouts per step (Rollout-GDRO redistributes the same
``R``; the shapes are static, so ``R`` cannot differ) for the same number of steps, and is
evaluated with the config's protocol (``eval.num_samples`` = 8 samples per held-out problem at
temperature 0.6 / top-p 0.8 / top-k 20, the same evaluation key for every method of a seed).

Cost control: the supervised warm start depends only on the seed, so it is computed once per
seed (on the config's full training set) and every method starts RL from the same parameters;
the "before" evaluation is done once per seed too. ``--rl_prompts=N`` (default 512) restricts RL to the first N
training problems (the train list is shuffled, so they keep the heavy-tailed mix): with the
config's 20,000 problems and 64 prompts per step a 100-step run visits no prompt twice, so the
online classifier (which bins prompts by their *past* visits, never-seen prompts in bin 0) would
put every prompt in bin 0 and both GDRO variants would reduce to GRPO. ``--workers=2`` runs the
(seed, method) jobs in two spawned processes.

Writes into ``--out``: ``gdro_vs_grpo.md`` (the report), ``gdro_vs_grpo.json`` (every number),
``gdro_vs_grpo/*.png`` (curriculum heatmaps, WSE proxy, training curves) and
``gdro_vs_grpo/runs/<method>_s<seed>.jsonl`` (the per-step metrics rows of ``train.rl_step``).

Library entry points: ``run_comparison(...) -> dict``, ``bootstrap_relative_gain(...)``,
``evaluate_per_problem(exp, params, rng)``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
from collections.abc import Sequence

import numpy as np

# method name -> (algorithm, config.gdro overrides as "<section>.<field>": value)
METHODS: dict[str, tuple[str, dict]] = {
    "grpo": ("grpo", {}),
    "prompt_gdro_aw": ("prompt_gdro", {"prompt.apply": "advantage_weight"}),
    "prompt_gdro_rs": ("prompt_gdro", {"prompt.apply": "resample"}),
    "rollout_gdro_bandit": ("rollout_gdro", {"rollout.allocator": "bandit"}),
    "rollout_gdro_sqrt": ("rollout_gdro", {"rollout.allocator": "sqrt"}),
}
LABELS = {
    "grpo": "GRPO",
    "prompt_gdro_aw": "Prompt-GDRO (advantage_weight)",
    "prompt_gdro_rs": "Prompt-GDRO (resample)",
    "rollout_gdro_bandit": "Rollout-GDRO (bandit)",
    "rollout_gdro_sqrt": "Rollout-GDRO (sqrt)",
}
PAPER = "+10.6% (Prompt-GDRO) / +10.1% (Rollout-GDRO) relative pass@8 over GRPO on Qwen3-Base"
REPORT_NAME = "gdro_vs_grpo"


# ----------------------------------------------------------------------------- configs


def method_config(
    method: str, seed: int, *, config_arg: str = "heavy_tailed", steps: int = 0, rl_prompts: int = 0
):
    """The ``configs/arithmetic.py:<algo>,<config_arg>`` config of ``method`` for one seed.

    Args:
      method: a key of ``METHODS``.
      seed: ``config.seed`` (init, data order, sampling).
      config_arg: the config argument after the algorithm (``heavy_tailed``, ``heavy_tailed,smoke``).
      steps: RL steps (0 = the config's).
      rl_prompts: ``config.data.max_train_examples`` (0 = all training problems).

    Raises:
      ValueError: unknown method.
    """
    from configs import arithmetic, common

    if method not in METHODS:
        raise ValueError(f"method {method!r}: choose from {list(METHODS)}")
    algo, gdro = METHODS[method]
    c = arithmetic.get_config(f"{algo},{config_arg}")
    c.seed = int(seed)
    if steps:
        c.steps = int(steps)
    c.data.max_train_examples = int(rl_prompts)
    # the report's controllers (reports/gdro_vs_grpo.md): the paper's GDRO (mode="paper", as
    # before the corrected defaults) with the failure-rate loss signal (the surrogate is ~0 at
    # ratio 1 with one update per batch, docs/gdro.md)
    common.paper_gdro(c)
    c.gdro.prompt.signal = c.gdro.rollout.signal = "failure_rate"
    for k, v in gdro.items():
        section, field = k.split(".")
        c.gdro[section][field] = v
    c.mesh.num_devices = 1  # one CPU device per process (tests force 8 virtual ones)
    c.logging.progress_bar = False
    c.logging.tensorboard = False
    return c


# ----------------------------------------------------------------------------- evaluation


class _RecordingReward:
    """Wraps a reward function and keeps the ``correct`` array of every call (in call order)."""

    def __init__(self, fn):
        self.fn = fn
        self.calls: list[np.ndarray] = []

    def __call__(self, completions, golds):
        out = self.fn(completions, golds)
        self.calls.append(np.asarray(out[1], bool))
        return out


def evaluate_per_problem(exp, params, rng) -> tuple[dict, np.ndarray, np.ndarray]:
    """``evaluation.evaluate_policy`` on the experiment's first held-out set, keeping per-problem
    results (the same key split as ``evaluation.evaluate``).

    Returns:
      (summary dict of ``evaluate_policy``, correct ``[N, k]`` bool, levels ``[N]`` int).

    Raises:
      RuntimeError: when the per-problem matrix does not reproduce the library's pass@k / mean@1.
    """
    import jax

    from grpo_jax import evaluation

    cfg = exp.config.eval
    k = int(cfg.num_samples)
    name, examples = next(iter(exp.eval_sets.items()))
    rec = _RecordingReward(exp.eval_reward_fns[name])
    _, key = jax.random.split(rng)
    summary = evaluation.evaluate_policy(
        exp.graphdef,
        params,
        examples,
        tokenizer=exp.tokenizer,
        reward_fn=rec,
        sampling_config=exp.eval_sampling,
        render=exp.render,
        prompt_len=exp.prompt_len,
        k=k,
        batch_size=cfg.batch_size,
        rng=key,
        mesh=exp.mesh,
    )
    num = len(examples)
    per_call = max(cfg.batch_size // k, 1)
    correct = np.zeros((num, k), bool)
    for j, ok in enumerate(rec.calls):
        start = j * per_call
        valid = min(per_call, num - start)
        correct[start : start + valid] = ok.reshape(per_call, k)[:valid]
    levels = np.asarray([int(ex.get("level", -1)) for ex in examples])
    if (
        abs(correct.mean() - summary["mean_at_1"]) > 1e-6
        or abs(correct.any(1).mean() - summary[f"pass_at_{k}"]) > 1e-6
    ):
        raise RuntimeError("per-problem evaluation does not match evaluation.evaluate_policy")
    return summary, correct, levels


# ----------------------------------------------------------------------------- jobs


def warm_start_job(seed: int, config_arg: str) -> dict:
    """SFT warm start + "before" evaluation of one seed (on the config's full training set)."""
    import jax

    from grpo_jax import steps as steps_lib
    from grpo_jax import transfer
    from grpo_jax.experiment import build_experiment

    t0 = time.perf_counter()
    cfg = method_config("grpo", seed, config_arg=config_arg)
    exp = build_experiment(cfg)
    try:
        state = steps_lib.init_train_state(exp)
        params, sft = steps_lib.supervised_warmstart(exp, state.params)
        summary, correct, levels = evaluate_per_problem(exp, params, jax.random.PRNGKey(seed + 7))
    finally:
        exp.close()
    return {
        "seed": seed,
        "params": transfer.to_host(params),
        "sft": sft,
        "eval": summary,
        "correct": correct,
        "levels": levels,
        "seconds": time.perf_counter() - t0,
    }


def rl_job(
    method: str,
    seed: int,
    params,
    config_arg: str,
    steps: int,
    rl_prompts: int,
    runs_dir: str | None,
) -> dict:
    """RL from the seed's warm-start ``params`` with ``method``; evaluates after the last step.

    Writes the ``rl_step`` metrics rows to ``runs_dir/<method>_s<seed>.jsonl`` (if given).
    """
    import jax

    from grpo_jax import steps as steps_lib  # `steps` is the argument (RL steps)
    from grpo_jax import train, writers
    from grpo_jax.experiment import build_experiment

    t0 = time.perf_counter()
    cfg = method_config(method, seed, config_arg=config_arg, steps=steps, rl_prompts=rl_prompts)
    exp = build_experiment(cfg)
    rows = []
    try:
        source = exp.make_source()
        params = jax.tree.map(lambda x: jax.numpy.asarray(x), params)
        run, _ = steps_lib.init_run(exp, params=params)
        fns = steps_lib.make_steps(exp)
        while int(run.train.step) < cfg.steps:
            run, row = train.rl_step(exp, fns, run, source)
            row = writers.to_jsonable({"step": int(run.train.step), **row})
            rows.append(row)
        rl_seconds = time.perf_counter() - t0
        summary, correct, levels = evaluate_per_problem(
            exp, run.train.params, jax.random.PRNGKey(seed + 7)
        )
    finally:
        exp.close()
    if runs_dir:
        os.makedirs(runs_dir, exist_ok=True)
        with open(os.path.join(runs_dir, f"{method}_s{seed}.jsonl"), "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return {
        "method": method,
        "seed": seed,
        "rows": rows,
        "eval": summary,
        "correct": correct,
        "levels": levels,
        "rl_seconds": rl_seconds,
        "seconds": time.perf_counter() - t0,
        "num_prompt_ids": exp.curriculum.num_prompts,
        "rollouts_per_step": cfg.rollout.prompts_per_step * cfg.rollout.rollouts_per_prompt,
    }


def enable_compilation_cache(cache_dir: str) -> None:
    """JAX's persistent compilation cache in ``cache_dir`` ("" = leave JAX's setting): every job
    rebuilds the same jitted functions, and the cache turns ~25 s of XLA compiles per job into
    a few seconds."""
    if not cache_dir:
        return
    import jax

    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _worker_init(cache_dir: str = ""):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    enable_compilation_cache(cache_dir)


def _call(fn_args):
    fn, args = fn_args
    return fn(*args)


# ----------------------------------------------------------------------------- statistics


def bootstrap_relative_gain(
    correct_m: np.ndarray,
    correct_base: np.ndarray,
    *,
    n_boot: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> dict:
    """Relative pass@k gain of a method over a baseline, with a paired bootstrap interval.

    ``gain = mean pass@k(method) / mean pass@k(base) - 1``, means over seeds and problems. Each
    bootstrap replicate resamples seeds (with replacement) and, independently, held-out problems
    (with replacement), and uses the *same* draws for both methods (the methods share each seed's
    warm start and the held-out problems: a paired design). pass@k with n = k samples is
    ``1[any of the k samples is correct]`` (the unbiased estimator of Chen et al. 2021 at n = k).

    Args:
      correct_m, correct_base: ``[S, N, k]`` bool, sample correctness per seed, problem, sample.
      n_boot: bootstrap replicates.
      level: two-sided percentile interval level.

    Returns:
      ``{"gain", "lo", "hi", "p_le_0"}`` (``p_le_0``: bootstrap share of replicates with gain <= 0).

    Raises:
      ValueError: shape mismatch or an all-zero baseline.
    """
    a = np.asarray(correct_m, bool).any(-1).astype(np.float64)  # [S, N] pass@k per problem
    b = np.asarray(correct_base, bool).any(-1).astype(np.float64)
    if a.shape != b.shape or a.ndim != 2:
        raise ValueError(
            f"correct arrays must both be [S, N, k]; got {correct_m.shape}, {correct_base.shape}"
        )
    if b.mean() == 0:
        raise ValueError("baseline pass@k is 0: the relative gain is undefined")
    s, n = a.shape
    rng = np.random.default_rng(seed)
    si = rng.integers(0, s, size=(n_boot, s))
    ni = rng.integers(0, n, size=(n_boot, n))
    # mean over the resampled (seed, problem) grid = mean over seeds of the mean over problems
    am = np.stack([a[si[r]][:, ni[r]].mean() for r in range(n_boot)])
    bm = np.stack([b[si[r]][:, ni[r]].mean() for r in range(n_boot)])
    with np.errstate(divide="ignore", invalid="ignore"):
        g = am / bm - 1.0
    g = g[np.isfinite(g)]
    alpha = (1 - level) / 2
    return {
        "gain": float(a.mean() / b.mean() - 1.0),
        "lo": float(np.quantile(g, alpha)),
        "hi": float(np.quantile(g, 1 - alpha)),
        "p_le_0": float(np.mean(g <= 0)),
    }


def _metric_table(correct: np.ndarray, levels: np.ndarray) -> dict:
    """``[S, N, k]`` -> {"overall"|level: {"pass_at_k": (mean, std), "mean_at_k": (mean, std)}}."""
    out = {}
    groups = {"overall": np.ones(levels.shape, bool)}
    groups.update({str(int(l)): levels == l for l in np.unique(levels)})
    for name, m in groups.items():
        p = correct[:, m].any(-1).mean(-1)  # [S]
        mk = correct[:, m].mean((-1, -2))  # [S]
        out[name] = {
            "pass_at_k": (float(p.mean()), float(p.std(ddof=1)) if len(p) > 1 else 0.0),
            "mean_at_k": (float(mk.mean()), float(mk.std(ddof=1)) if len(mk) > 1 else 0.0),
        }
    return out


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


def make_figures(results: dict, fig_dir: str) -> dict[str, str]:
    """Writes the PNGs; returns {name: path}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from experiments import report

    os.makedirs(fig_dir, exist_ok=True)
    paths = {}
    methods = list(results["runs"])
    rows = {m: [results["runs"][m][s]["rows"] for s in sorted(results["runs"][m])] for m in methods}

    def save(fig, name):
        path = os.path.join(fig_dir, name)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths[name[:-4]] = path

    # data share per bin, every method
    fig, axes = plt.subplots(1, len(methods), figsize=(4.2 * len(methods), 3.6), squeeze=False)
    for ax, m in zip(axes[0], methods):
        report.heatmap(
            ax,
            _mean_rows(rows[m], "gdro/bin_share"),
            "gdro/bin_share",
            f"{LABELS[m]}\nrollout share per bin",
        )
    save(fig, "heatmap_data_share.png")
    # Prompt-GDRO weight q
    pg = [m for m in methods if METHODS[m][0] == "prompt_gdro"]
    if pg:
        fig, axes = plt.subplots(1, len(pg), figsize=(5 * len(pg), 3.6), squeeze=False)
        for ax, m in zip(axes[0], pg):
            what = (
                "sampling distribution q"
                if METHODS[m][1].get("apply") == "resample"
                else "weight q"
            )
            report.heatmap(
                ax, _mean_rows(rows[m], "gdro/q"), "gdro/q", f"{LABELS[m]}\n{what} per bin"
            )
        save(fig, "heatmap_prompt_gdro_q.png")
    # Rollout-GDRO rollouts per prompt
    rg = [m for m in methods if METHODS[m][0] == "rollout_gdro"]
    if rg:
        fig, axes = plt.subplots(1, len(rg), figsize=(5 * len(rg), 3.6), squeeze=False)
        for ax, m in zip(axes[0], rg):
            report.heatmap(
                ax,
                _mean_rows(rows[m], "rollout_gdro/n_b"),
                "rollout_gdro/n_b",
                f"{LABELS[m]}\nrollouts per prompt n_b",
            )
        save(fig, "heatmap_rollouts_per_prompt.png")
        # weighted standard-error proxy vs uniform allocation
        fig, axes = plt.subplots(1, 3, figsize=(16, 3.8))
        ax = axes[2]
        for m in rg:
            for key, ls in (("wse", "-"), ("wse_pooled", ":")):
                steps, v = _series(rows[m], f"rollout_gdro/{key}")
                _, u = _series(rows[m], f"rollout_gdro/{key}_uniform")
                with np.errstate(invalid="ignore", divide="ignore"):
                    ratio = np.nanmean(v, 0) / np.nanmean(u, 0)
                w = max(1, len(steps) // 20)
                ax.plot(steps[w - 1 :], _smooth(ratio, w), ls=ls, label=f"{LABELS[m]}, {key}")
        ax.axhline(1.0, color="k", lw=0.8, label="uniform allocation (GRPO)")
        ax.set_xlabel("step")
        ax.set_ylabel("WSE / WSE(uniform)")
        ax.set_title("ratio to uniform (same batches)", fontsize=9)
        ax.legend(fontsize=7)
        for ax, (key, title) in zip(
            axes,
            [
                ("wse", "paper's proxy (sigma_b^2 = p_b(1-p_b), classifier)"),
                ("wse_pooled", "pooled within-group reward std"),
            ],
        ):
            for m in rg:
                steps, v = _series(rows[m], f"rollout_gdro/{key}")
                _, u = _series(rows[m], f"rollout_gdro/{key}_uniform")
                w = max(1, len(steps) // 20)
                ax.plot(steps[w - 1 :], _smooth(np.nanmean(v, 0), w), label=LABELS[m])
                ax.plot(
                    steps[w - 1 :],
                    _smooth(np.nanmean(u, 0), w),
                    ls="--",
                    label=f"uniform (same batches as {LABELS[m].split('(')[1][:-1]})",
                )
            ax.set_xlabel("step")
            ax.set_ylabel("WSE = sum_b share_b sigma_b / sqrt(n_b)")
            ax.set_title(title, fontsize=9)
            ax.legend(fontsize=7)
        save(fig, "wse_proxy.png")
    # training curves
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
    for ax, key in zip(axes, ["reward_mean", "pass_rate/level_1", "pass_rate/level_5"]):
        for m in methods:
            steps, v = _series(rows[m], key)
            if len(steps):
                w = max(1, len(steps) // 15)
                ax.plot(steps[w - 1 :], _smooth(np.nanmean(v, 0), w), label=LABELS[m])
        ax.set_title(f"train {key} (mean over seeds, smoothed)", fontsize=9)
        ax.set_xlabel("step")
    axes[0].legend(fontsize=7)
    save(fig, "train_curves.png")
    # headline bar chart: pass@8 per level
    fig, ax = plt.subplots(figsize=(9, 3.6))
    tab = results["tables"]
    groups = list(tab["before"].keys())
    width = 0.8 / (len(methods) + 1)
    for i, m in enumerate(["before"] + methods):
        mean = [tab[m][g]["pass_at_k"][0] for g in groups]
        std = [tab[m][g]["pass_at_k"][1] for g in groups]
        ax.bar(
            np.arange(len(groups)) + i * width,
            mean,
            width,
            yerr=std,
            capsize=2,
            label="before RL (SFT)" if m == "before" else LABELS[m],
        )
    ax.set_xticks(np.arange(len(groups)) + 0.4 - width / 2)
    ax.set_xticklabels([g if g == "overall" else f"level {g}" for g in groups])
    ax.set_ylabel(f"held-out pass@{results['k']}")
    ax.legend(fontsize=7, ncol=3)
    save(fig, "pass_at_8.png")
    return paths


# ----------------------------------------------------------------------------- report


def _pm(x, pct=True):
    m, s = x
    return f"{100 * m:.1f} ± {100 * s:.1f}" if pct else f"{m:.3f} ± {s:.3f}"


def write_report(results: dict, out_dir: str, figs: dict, command: str) -> str:
    k = results["k"]
    tab, gains = results["tables"], results["gains"]
    methods = list(results["runs"])
    rel = lambda p: os.path.relpath(p, out_dir)
    L = []
    L.append("# GDRO vs GRPO at equal compute (heavy-tailed arithmetic)\n")
    L.append(f"Regenerate: `{command}`\n")
    L.append(
        f"Generated {results['date']} by `experiments/compare.py`; total wall time "
        f"**{results['wall_seconds'] / 60:.1f} min** on {results['cpus']} CPU core(s), "
        f"{results['workers']} worker process(es).\n"
    )
    s = results["setup"]
    L.append("## Setup\n")
    L.append(
        f"- Task: `configs/arithmetic.py:<algo>,{s['config_arg']}` (levels 1-5, heavy-tailed "
        f"train mix, held-out set uniform over levels: {s['num_eval']} problems)."
    )
    L.append(
        f"- Seeds: {s['seeds']}. Every method of a seed starts RL from the same supervised warm "
        f"start ({s['sft_steps']} SFT steps on the config's {s['num_train']} training problems), "
        "computed once per seed; the 'before' row is that warm start."
    )
    L.append(
        f"- RL: {s['steps']} steps x {s['prompts_per_step']} prompts x {s['rollouts_per_prompt']} "
        f"rollouts (mean) = {s['rollouts_per_step']} rollouts per step for **every** method "
        f"({s['steps'] * s['rollouts_per_step']} rollouts and {s['steps']} updates per run; "
        "Rollout-GDRO redistributes the same R over prompts). RL prompt pool: the first "
        f"{s['rl_prompts'] or s['num_train']} training problems "
        f"({s['visits_per_prompt']:.1f} visits per prompt on average), so that the online "
        "classifier, which bins a prompt by its past visits (never-seen prompts in bin 0), sees "
        f"prompts again: with the config's full pool ({s['num_train']} problems) a "
        f"{s['steps']}-step run draws {s['steps'] * s['prompts_per_step']} prompts without "
        f"replacement ({s['steps'] * s['prompts_per_step'] / s['num_train']:.2f} visits per "
        "prompt), so nearly every prompt is classified as unseen (bin 0) and both GDRO variants "
        "reduce to GRPO."
    )
    L.append(
        "- Generated completion tokens per run (mean over seeds): "
        + ", ".join(f"{m} {results['compute'][m]['generated_tokens']:.0f}" for m in methods)
        + "."
    )
    L.append(
        f"- Evaluation: {k} samples per held-out problem (temperature 0.6, top-p 0.8, top-k 20), "
        "same sampling key for every method of a seed. pass@8 = share of problems with at "
        "least one correct sample; mean@8 = mean accuracy over the 8 samples (= mean@1)."
    )
    L.append(
        f"- GDRO settings: loss signal `{s['signal']}`, bins by any-correct pass rate "
        "(10 bins, bin 0 = hardest/unseen), Rollout-GDRO n in "
        f"[{s['n_min']}, {s['n_max']}].\n"
    )
    L.append("## Headline: held-out pass@8 and mean@8 (%, mean ± std over seeds)\n")
    L.append(f"| method | pass@{k} | mean@{k} | relative pass@{k} gain vs GRPO (95% CI) |")
    L.append("|---|---|---|---|")
    for m in ["before"] + methods:
        name = "before RL (SFT warm start)" if m == "before" else LABELS[m]
        g = gains.get(m)
        gtxt = (
            "—"
            if g is None
            else f"{100 * g['gain']:+.1f}% [{100 * g['lo']:+.1f}, {100 * g['hi']:+.1f}]"
        )
        L.append(
            f"| {name} | {_pm(tab[m]['overall']['pass_at_k'])} | "
            f"{_pm(tab[m]['overall']['mean_at_k'])} | {gtxt} |"
        )
    L.append("")
    L.append(
        f"Confidence intervals: paired bootstrap ({results['n_boot']} replicates) over seeds and "
        "held-out problems: each replicate resamples the seeds with replacement and, "
        "independently, the held-out problems with replacement, applies the same draw to the "
        "method and to GRPO, and recomputes (mean pass@8 of the method / mean pass@8 of GRPO - "
        "1); the interval is the 2.5-97.5% percentile range.\n"
    )
    L.append(f"![pass@8 per level]({rel(figs['pass_at_8'])})\n")
    L.append("## Per difficulty level\n")
    levels = [g for g in tab["before"] if g != "overall"]
    for metric, title in [("pass_at_k", f"pass@{k}"), ("mean_at_k", f"mean@{k}")]:
        L.append(f"**{title}** (%, mean ± std over seeds)\n")
        L.append("| method | " + " | ".join(f"level {l}" for l in levels) + " |")
        L.append("|---|" + "---|" * len(levels))
        for m in ["before"] + methods:
            name = "before RL" if m == "before" else LABELS[m]
            L.append(f"| {name} | " + " | ".join(_pm(tab[m][l][metric]) for l in levels) + " |")
        L.append("")
    gl = results["gains_by_level"]
    L.append(
        f"**Relative pass@{k} gain vs GRPO per level** (%, paired bootstrap 95% CI as above)\n"
    )
    L.append("| method | " + " | ".join(f"level {l}" for l in levels) + " |")
    L.append("|---|" + "---|" * len(levels))
    for m in gl:
        cells = []
        for l in levels:
            g = gl[m].get(l)
            cells.append(
                "— (GRPO 0)"
                if g is None
                else f"{100 * g['gain']:+.0f} [{100 * g['lo']:+.0f}, {100 * g['hi']:+.0f}]"
            )
        L.append(f"| {LABELS[m]} | " + " | ".join(cells) + " |")
    L.append("")
    L.append("## Curriculum and allocation\n")
    L.append("Step x bin heatmaps, mean over seeds (bin 0 = hardest, also never-seen prompts).\n")
    for name in ["heatmap_data_share", "heatmap_prompt_gdro_q", "heatmap_rollouts_per_prompt"]:
        if name in figs:
            L.append(f"![{name}]({rel(figs[name])})\n")
    L.append(results["curriculum_text"] + "\n")
    L.append(
        "Training diagnostics (means over steps and seeds; a group with zero reward std gives no "
        "GRPO gradient; the top-q bin is the bin Prompt-GDRO weights most at that step):\n"
    )
    L.append(results["diagnostics_text"] + "\n")
    if "wse_proxy" in figs:
        L.append("### Weighted standard-error proxy\n")
        L.append(f"![wse]({rel(figs['wse_proxy'])})\n")
        L.append(results["wse_text"] + "\n")
    L.append(f"![training curves]({rel(figs['train_curves'])})\n")
    L.append("## Does this support the paper?\n")
    L.append(results["verdict"] + "\n")
    notes = os.path.join(out_dir, REPORT_NAME, "notes.md")
    if os.path.exists(notes):
        with open(notes) as f:
            L.append("## Observations (written by hand after the run; `" + rel(notes) + "`)\n")
            L.append(f.read().strip() + "\n")
    L.append("## Timing\n")
    L.append("| job | seconds (mean over seeds) |")
    L.append("|---|---|")
    L.append(f"| SFT warm start + before-eval | {results['timing']['warm_start']:.0f} |")
    for m in methods:
        L.append(f"| {m} (RL + eval) | {results['timing'][m]:.0f} |")
    L.append(
        f"\nTotal wall time: {results['wall_seconds']:.0f} s "
        f"({results['wall_seconds'] / 60:.1f} min).\n"
    )
    text = "\n".join(L)
    path = os.path.join(out_dir, f"{REPORT_NAME}.md")
    with open(path, "w") as f:
        f.write(text)
    return path


def _curriculum_text(results) -> tuple[str, str]:
    runs = results["runs"]
    lines = []
    for m in runs:
        share = np.stack(
            [
                np.nanmean(
                    [
                        r["gdro/bin_share"]
                        for r in runs[m][s]["rows"]
                        if isinstance(r.get("gdro/bin_share"), list)
                    ],
                    0,
                )
                for s in runs[m]
            ]
        )
        share = share.mean(0)
        lines.append(
            f"- {LABELS[m]}: mean rollout share in bin 0 (hardest/unseen) "
            f"{100 * share[0]:.0f}%, in bins >= 5 {100 * share[5:].sum():.0f}%."
        )
        if METHODS[m][0] == "prompt_gdro":
            q = [
                r["gdro/q"]
                for s in runs[m]
                for r in runs[m][s]["rows"]
                if isinstance(r.get("gdro/q"), list)
            ]
            if q:
                q = np.asarray(q, float)
                lines.append(
                    f"  q: mean max weight {q.max(1).mean():.2f} on bin "
                    f"{int(np.bincount(q.argmax(1)).argmax())} (most often); final-step q = "
                    + ", ".join(f"{x:.2f}" for x in q[-1])
                    + "."
                )
        if METHODS[m][0] == "rollout_gdro":
            nb = [
                r["rollout_gdro/n_b"]
                for s in runs[m]
                for r in runs[m][s]["rows"]
                if isinstance(r.get("rollout_gdro/n_b"), list)
            ]
            nb = np.asarray(nb, float)
            present = (nb > 0).sum(0)
            mean_nb = np.where(
                present > 0, np.where(nb > 0, nb, 0).sum(0) / np.maximum(present, 1), np.nan
            )
            lines.append(
                "  mean rollouts per prompt by bin (steps where the bin is present): "
                + ", ".join("—" if not np.isfinite(x) else f"{x:.1f}" for x in mean_nb)
                + "."
            )
    wse = []
    for m in runs:
        if METHODS[m][0] != "rollout_gdro":
            continue
        for key in ("wse", "wse_pooled"):
            v = np.asarray(
                [
                    float(r.get(f"rollout_gdro/{key}", "nan"))
                    for s in runs[m]
                    for r in runs[m][s]["rows"]
                ]
            )
            u = np.asarray(
                [
                    float(r.get(f"rollout_gdro/{key}_uniform", "nan"))
                    for s in runs[m]
                    for r in runs[m][s]["rows"]
                ]
            )
            ok = np.isfinite(v) & np.isfinite(u)
            if not ok.any() or u[ok].sum() <= 0:
                wse.append(f"- {LABELS[m]}: {key}: undefined (no bin with 0 < p_b < 1 yet).")
                continue
            ratio = v[ok].sum() / u[ok].sum()
            wse.append(
                f"- {LABELS[m]}: {key} / uniform = {ratio:.3f} ({100 * abs(1 - ratio):.1f}% "
                f"{'lower' if ratio <= 1 else 'higher'} than uniform; summed over steps and seeds)."
            )
            results["wse_ratio"].setdefault(m, {})[key] = float(ratio)
    wse_text = (
        "WSE = sum_b share_b sigma_b / sqrt(n_b) for the allocation actually used and for the "
        "uniform allocation (n_bar per prompt) of the same batches. The paper reports 22-37% "
        "lower WSE for Rollout-GDRO than uniform.\n\n" + "\n".join(wse)
    )
    return "\n".join(lines), wse_text


def _diagnostics_table(results) -> str:
    """Per-method training diagnostics (means over steps and seeds) as a markdown table."""
    runs = results["runs"]
    cap = results["setup"].get("weight_cap", 15.0)
    L = [
        "| method | train pass rate | groups with zero reward std | max advantage weight | "
        "steps at the weight cap | rollout share of the top-q bin |",
        "|---|---|---|---|---|---|",
    ]
    for m in runs:
        rows = [r for s in runs[m] for r in runs[m][s]["rows"]]
        f = lambda key, rows=rows: np.asarray([float(r.get(key, "nan")) for r in rows])
        zero = f("advantages/num_zero_std_groups") / np.maximum(f("advantages/num_groups"), 1)
        wmax = f("sample_weight_max")
        top = "—"
        qs = [
            (r["gdro/q"], r["gdro/bin_share"])
            for r in rows
            if isinstance(r.get("gdro/q"), list) and isinstance(r.get("gdro/bin_share"), list)
        ]
        if qs:
            top = f"{100 * np.mean([sh[int(np.argmax(q))] for q, sh in qs]):.0f}%"
        L.append(
            f"| {LABELS[m]} | {100 * np.nanmean(f('pass_rate')):.0f}% | {100 * np.nanmean(zero):.0f}% | "
            f"{np.nanmean(wmax):.1f} | {100 * np.mean(wmax >= cap - 1e-3):.0f}% | {top} |"
        )
    return "\n".join(L)


def _verdict(results) -> str:
    gains = results["gains"]
    parts = []
    for m, g in gains.items():
        sig = (
            "significantly above 0"
            if g["lo"] > 0
            else "significantly below 0"
            if g["hi"] < 0
            else "not distinguishable from 0"
        )
        parts.append(
            f"{LABELS[m]}: {100 * g['gain']:+.1f}% [{100 * g['lo']:+.1f}, {100 * g['hi']:+.1f}] "
            f"({sig})"
        )
    pos = [m for m, g in gains.items() if g["lo"] > 0]
    neg = [m for m, g in gains.items() if g["hi"] < 0]
    if pos:
        head = (
            "Partly. Methods whose 95% interval lies above zero: "
            + ", ".join(LABELS[m] for m in pos)
            + "."
        )
    else:
        head = (
            "No. In this setting no GDRO variant shows a relative pass@8 gain over GRPO whose 95% "
            "bootstrap interval excludes zero."
        )
    if neg:
        head += (
            " Significantly *worse* than GRPO (interval below zero): "
            + ", ".join(LABELS[m] for m in neg)
            + "."
        )
    return (
        f"Paper: {PAPER}. Here (tiny character-level transformer, arithmetic, "
        f"{results['setup']['steps']} RL steps, {len(results['setup']['seeds'])} seeds): "
        + "; ".join(parts)
        + f".\n\n**{head}** This is a small CPU-scale proxy of the paper's "
        "setting (different model scale, task and training length), so it neither confirms nor "
        "refutes the paper's numbers; it tests whether the mechanism helps at this scale."
    )


# ----------------------------------------------------------------------------- driver


def _save_job(runs_dir: str, r: dict) -> None:
    """Per-job results next to the metrics rows, so the report can be rebuilt (``--report_only``)."""
    name = f"{r['method']}_s{r['seed']}" if "method" in r else f"before_s{r['seed']}"
    np.savez_compressed(
        os.path.join(runs_dir, f"eval_{name}.npz"), correct=r["correct"], levels=r["levels"]
    )
    meta = {k: v for k, v in r.items() if k not in ("params", "rows", "correct", "levels")}
    from grpo_jax import writers

    with open(os.path.join(runs_dir, f"meta_{name}.json"), "w") as f:
        json.dump(writers.to_jsonable(meta), f, indent=1, sort_keys=True)


def _load_job(runs_dir: str, method: str | None, seed: int) -> dict:
    from grpo_jax import writers

    name = f"{method}_s{seed}" if method else f"before_s{seed}"
    with open(os.path.join(runs_dir, f"meta_{name}.json")) as f:
        r = json.load(f)
    z = np.load(os.path.join(runs_dir, f"eval_{name}.npz"))
    r["correct"], r["levels"] = z["correct"], z["levels"]
    if method:
        r["rows"] = writers.read_jsonl(os.path.join(runs_dir, f"{name}.jsonl"))
    return r


def run_comparison(
    out_dir: str,
    *,
    seeds: Sequence[int] = (0, 1, 2),
    methods: Sequence[str] = tuple(METHODS),
    config_arg: str = "heavy_tailed",
    steps: int = 0,
    rl_prompts: int = 512,
    workers: int = 1,
    n_boot: int = 2000,
    jax_cache: str = "",
    command: str = "",
    report_only: bool = False,
) -> dict:
    """Runs every (seed, method), writes the report, JSON and PNGs; returns the results dict.

    Args:
      out_dir: where ``gdro_vs_grpo.md``, ``gdro_vs_grpo.json`` and ``gdro_vs_grpo/`` go.
      seeds, methods: what to run (``methods`` must include ``"grpo"``, the baseline).
      config_arg, steps, rl_prompts: see ``method_config``.
      workers: processes (1 = in this process; >1 = spawned ``multiprocessing`` pool).
      n_boot: bootstrap replicates.
      jax_cache: persistent compilation cache directory ("" = JAX's own setting).
      report_only: rebuild the report from the saved per-job files of an earlier run (the wall
        time reported is then the earlier run's).

    Raises:
      ValueError: no GRPO baseline, unknown method, or no seeds.
    """
    wall0 = time.perf_counter()
    methods = list(methods)
    if "grpo" not in methods:
        raise ValueError("methods must include 'grpo' (the baseline of the relative gain)")
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"method {m!r}: choose from {list(METHODS)}")
    if not seeds:
        raise ValueError("seeds must not be empty")
    seeds = [int(s) for s in seeds]
    fig_dir = os.path.join(out_dir, REPORT_NAME)
    runs_dir = os.path.join(fig_dir, "runs")
    os.makedirs(runs_dir, exist_ok=True)
    cfg0 = method_config(
        "grpo", seeds[0], config_arg=config_arg, steps=steps, rl_prompts=rl_prompts
    )

    def log(msg):
        print(f"[compare {time.perf_counter() - wall0:7.1f}s] {msg}", flush=True)

    k = int(cfg0.eval.num_samples)
    if report_only:
        warm = {s: _load_job(runs_dir, None, s) for s in seeds}
        runs = {m: {s: _load_job(runs_dir, m, s) for s in seeds} for m in methods}
        with open(os.path.join(runs_dir, "wall.json")) as f:
            wall_prev = json.load(f)["wall_seconds"]
    else:
        wall_prev = None
        if workers > 1:
            import multiprocessing as mp

            pool = mp.get_context("spawn").Pool(
                workers, initializer=_worker_init, initargs=(jax_cache,)
            )
            imap = lambda jobs: pool.imap_unordered(_call, jobs)
        else:
            enable_compilation_cache(jax_cache)
            pool = None
            imap = lambda jobs: map(_call, jobs)
        try:
            warm = {}
            for r in imap([(warm_start_job, (s, config_arg)) for s in seeds]):
                warm[r["seed"]] = r
                _save_job(runs_dir, r)
                log(
                    f"seed {r['seed']}: warm start {r['seconds']:.0f}s, before pass@{k} "
                    f"{r['eval'][f'pass_at_{k}']:.3f}"
                )
            jobs = [
                (rl_job, (m, s, warm[s]["params"], config_arg, steps, rl_prompts, runs_dir))
                for s in seeds
                for m in methods
            ]
            runs: dict[str, dict[int, dict]] = {m: {} for m in methods}
            for r in imap(jobs):
                runs[r["method"]][r["seed"]] = r
                _save_job(runs_dir, r)
                log(
                    f"{r['method']} seed {r['seed']}: {r['seconds']:.0f}s, pass@{k} "
                    f"{r['eval'][f'pass_at_{k}']:.3f}, mean@1 {r['eval']['mean_at_1']:.3f}"
                )
        finally:
            if pool is not None:
                pool.close()
                pool.join()
        with open(os.path.join(runs_dir, "wall.json"), "w") as f:
            json.dump({"wall_seconds": time.perf_counter() - wall0, "workers": workers}, f)

    levels = warm[seeds[0]]["levels"]
    correct = {"before": np.stack([warm[s]["correct"] for s in seeds])}
    for m in methods:
        correct[m] = np.stack([runs[m][s]["correct"] for s in seeds])
    tables = {m: _metric_table(c, levels) for m, c in correct.items()}
    gains = {
        m: bootstrap_relative_gain(correct[m], correct["grpo"], n_boot=n_boot)
        for m in methods
        if m != "grpo"
    }
    gains_by_level = {}
    for m in gains:
        gains_by_level[m] = {}
        for l in np.unique(levels):
            sel = levels == l
            try:
                gains_by_level[m][str(int(l))] = bootstrap_relative_gain(
                    correct[m][:, sel], correct["grpo"][:, sel], n_boot=min(n_boot, 500)
                )
            except ValueError:
                gains_by_level[m][str(int(l))] = None
    rl_prompts_eff = runs["grpo"][seeds[0]]["num_prompt_ids"]
    total_steps = cfg0.steps
    results = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpus": os.cpu_count(),
        "workers": workers,
        "k": k,
        "n_boot": n_boot,
        "setup": {
            "config_arg": config_arg,
            "seeds": seeds,
            "steps": total_steps,
            "prompts_per_step": cfg0.rollout.prompts_per_step,
            "rollouts_per_prompt": cfg0.rollout.rollouts_per_prompt,
            "rollouts_per_step": cfg0.rollout.prompts_per_step * cfg0.rollout.rollouts_per_prompt,
            "rl_prompts": rl_prompts_eff,
            "num_train": cfg0.data.arithmetic.num_train,
            "num_eval": int(len(levels)),
            "sft_steps": cfg0.sft.steps,
            "visits_per_prompt": total_steps * cfg0.rollout.prompts_per_step / rl_prompts_eff,
            "signal": cfg0.gdro.prompt.signal,
            "weight_cap": cfg0.gdro.prompt.weight_cap,
            "n_min": cfg0.gdro.rollout.n_min,
            "n_max": cfg0.gdro.rollout.n_max,
            "python": platform.python_version(),
        },
        "runs": runs,
        "tables": tables,
        "gains": gains,
        "gains_by_level": gains_by_level,
        "wse_ratio": {},
        "compute": {
            m: {
                "generated_tokens": float(
                    np.mean([sum(r["generated_tokens"] for r in runs[m][s]["rows"]) for s in seeds])
                ),
                "rollouts": float(
                    np.mean(
                        [len(runs[m][s]["rows"]) * runs[m][s]["rollouts_per_step"] for s in seeds]
                    )
                ),
                "steps": float(np.mean([len(runs[m][s]["rows"]) for s in seeds])),
            }
            for m in methods
        },
        "timing": {
            "warm_start": float(np.mean([warm[s]["seconds"] for s in seeds])),
            **{m: float(np.mean([runs[m][s]["seconds"] for s in seeds])) for m in methods},
        },
    }
    results["curriculum_text"], results["wse_text"] = _curriculum_text(results)
    results["diagnostics_text"] = _diagnostics_table(results)
    results["verdict"] = _verdict(results)
    figs = make_figures(results, fig_dir)
    results["wall_seconds"] = wall_prev if wall_prev is not None else time.perf_counter() - wall0
    results["figures"] = {n: os.path.relpath(p, out_dir) for n, p in figs.items()}
    report_path = write_report(results, out_dir, figs, command or "python -m experiments.compare")
    slim = {k_: v for k_, v in results.items() if k_ != "runs"}
    slim["per_run"] = {
        m: {str(s): {"eval": runs[m][s]["eval"], "seconds": runs[m][s]["seconds"]} for s in seeds}
        for m in methods
    }
    slim["before"] = {str(s): {"eval": warm[s]["eval"], "sft": warm[s]["sft"]} for s in seeds}
    from grpo_jax import writers

    with open(os.path.join(out_dir, f"{REPORT_NAME}.json"), "w") as f:
        json.dump(writers.to_jsonable(slim), f, indent=1, sort_keys=True)
    log(f"wrote {report_path} (wall {results['wall_seconds']:.0f}s)")
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="reports", help="output directory")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument(
        "--config_arg",
        default="heavy_tailed",
        help="configs/arithmetic.py argument after the algorithm",
    )
    ap.add_argument("--steps", type=int, default=0, help="RL steps (0 = the config's)")
    ap.add_argument(
        "--rl_prompts",
        type=int,
        default=512,
        help="RL prompt pool: the first N training problems (0 = all)",
    )
    ap.add_argument("--workers", type=int, default=2, help="processes")
    ap.add_argument("--n_boot", type=int, default=2000, help="bootstrap replicates")
    ap.add_argument(
        "--jax_cache",
        default="/tmp/grpo_jax_compare_cache",
        help="JAX persistent compilation cache directory ('' = off)",
    )
    ap.add_argument(
        "--report_only",
        action="store_true",
        help="rebuild the report from the per-job files of an earlier run in --out",
    )
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    given = sys.argv[1:] if argv is None else list(argv)
    command = "python -m experiments.compare " + " ".join(a for a in given if a != "--report_only")
    run_comparison(
        args.out,
        seeds=seeds,
        methods=args.methods.split(","),
        config_arg=args.config_arg,
        steps=args.steps,
        rl_prompts=args.rl_prompts,
        workers=args.workers,
        n_boot=args.n_boot,
        jax_cache=args.jax_cache,
        command=command.strip(),
        report_only=args.report_only,
    )


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
