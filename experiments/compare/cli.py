"""``python -m experiments.compare``: the argparse front end and `run_comparison`, the
orchestration (plan -> resume scan -> warm starts -> sweep -> lr choice -> final runs ->
statistics -> figures and report)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time
import warnings

import numpy as np

from experiments.compare import diagnostics as diag_lib
from experiments.compare import jobs as jobs_lib
from experiments.compare import report as report_lib
from experiments.compare.plan import (
    DEFAULT_CONFIG,
    DEFAULT_LRS,
    EXTRA_PASS_K,
    MECHANISM_METHODS,
    METHODS,
    METRICS,
    PASS_K,
    REPORT_NAME,
    ComparisonPlan,
    estimate_wall,
    eval_steps,
    method_config,
    ordered_methods,
    parse_level_weights,
    parse_seeds,
    plan_jobs,
    split_heldout,
)
from experiments.compare.statistics import (
    choose_lrs,
    compute_to_grpo_level,
    gains_by_start,
    metric_table,
    paired_bootstrap,
    per_problem_scores,
    safe_bootstrap,
)
from grpo_jax import cli
from grpo_jax.data.arithmetic import ArithmeticConfig


@dataclasses.dataclass
class _Ctx:
    """One comparison's settings, plan and paths (built by `_context`)."""

    out_dir: str
    runs_dir: str
    fig_dir: str
    methods: list
    lrs: list
    seeds: list
    plan: dict  # the job plan (`plan_jobs`)
    cfg0: object
    when: list
    k: int
    job_kw: dict  # rl_job keywords except lr
    want_oracle: int
    study: ComparisonPlan
    workers: int
    jax_cache: str
    budget_minutes: float
    max_minutes: float
    wall0: float

    def log(self, msg):
        print(f"[compare {time.perf_counter() - self.wall0:7.1f}s] {msg}", flush=True)

    def warm_expected(self) -> dict:
        kw = self.job_kw
        return jobs_lib.warm_settings(
            kw["config_arg"], kw["paper_gdro"], self.want_oracle, kw["rl_prompts"]
        )

    def rl_expected(self, method, lr) -> dict:
        return jobs_lib.rl_settings(method, lr, **self.job_kw)


def _context(
    study: ComparisonPlan, out_dir: str, *, workers, jax_cache, budget_minutes, max_minutes
) -> _Ctx:
    """Validates the plan and plans the jobs.

    Raises:
      ValueError: no GRPO baseline, unknown method or metric, bad seeds / lrs / last_evals.
    """
    wall0 = time.perf_counter()
    methods = ordered_methods(list(study.methods))
    if study.select_metric not in METRICS:
        raise ValueError(f"select_metric {study.select_metric!r}: choose from {METRICS}")
    lrs = [float(x) for x in study.lrs]
    if not lrs or len({f"{x:.3g}" for x in lrs}) != len(lrs):
        raise ValueError(f"lrs must be non-empty and distinct (to 3 digits); got {lrs}")
    seeds = parse_seeds(study.seeds)
    if not seeds:
        raise ValueError("seeds must not be empty")
    plan = plan_jobs(seeds, study.sweep_seeds, methods, lrs)
    job_kw = study.job_settings()
    if job_kw["token_budget"] < 0:
        raise ValueError(f"token_budget={job_kw['token_budget']} must be >= 0 (0 = steps)")
    not_config = ("eval_every", "token_budget")
    cfg0 = method_config(
        "grpo", seeds[0], **{k: v for k, v in job_kw.items() if k not in not_config}
    )
    when = eval_steps(cfg0.steps, job_kw["eval_every"])
    last = study.last_evals
    if not 1 <= last <= len(when):
        raise ValueError(f"last_evals={last} must be in 1..{len(when)} (evals at {when})")
    if study.oracle_json and job_kw["rl_prompts"]:  # fail now, not after the runs
        diag_lib.load_oracle(study.oracle_json, job_kw["rl_prompts"])
    fig_dir = os.path.join(out_dir, REPORT_NAME)
    return _Ctx(
        out_dir=out_dir,
        runs_dir=os.path.join(fig_dir, "runs"),
        fig_dir=fig_dir,
        methods=methods,
        lrs=lrs,
        seeds=seeds,
        plan=plan,
        cfg0=cfg0,
        when=when,
        k=int(cfg0.eval.num_samples),
        job_kw=job_kw,
        want_oracle=0 if study.oracle_json else int(study.oracle_samples),
        study=study,
        workers=workers,
        jax_cache=jax_cache,
        budget_minutes=budget_minutes,
        max_minutes=max_minutes,
        wall0=wall0,
    )


# ----------------------------------------------------------------------------- job store


class _Store:
    """The job files of ``ctx.runs_dir``: which jobs are done (files complete, settings checked:
    `jobs.SettingsMismatch` otherwise), loading, and the jobs finished in this session."""

    def __init__(self, ctx: _Ctx):
        self.ctx = ctx
        self.params: dict[int, object] = {}  # warm-start params of this session
        self.ran = 0

    def expected(self, method, lr):
        return self.ctx.warm_expected() if method is None else self.ctx.rl_expected(method, lr)

    def done(self, method, lr, seed) -> bool:
        d = self.ctx.runs_dir
        if not jobs_lib.job_complete(d, method, lr, seed):
            return False
        path = os.path.join(d, jobs_lib.job_name(method, lr, seed) + ".json")
        with open(path) as f:
            jobs_lib.check_settings(path, json.load(f).get("settings"), self.expected(method, lr))
        return True

    def load(self, method, lr, seed) -> dict:
        return jobs_lib.load_job(self.ctx.runs_dir, method, lr, seed, self.expected(method, lr))

    def seconds(self, method, lr, seed) -> float:
        with open(
            os.path.join(self.ctx.runs_dir, jobs_lib.job_name(method, lr, seed) + ".json")
        ) as f:
            return float(json.load(f).get("seconds", float("nan")))

    def warm_params(self, seed):
        if seed not in self.params:
            self.params[seed] = jobs_lib.load_params(self.ctx.runs_dir, seed)
        return self.params[seed]

    def save(self, r: dict) -> None:
        jobs_lib.save_job(self.ctx.runs_dir, r)
        self.ran += 1
        if r.get("method") is None:
            self.params[r["seed"]] = r["params"]


def _sweep_jobs(ctx):
    return [(m, lr, s) for s in ctx.plan["sweep_seeds"] for lr in ctx.lrs for m in ctx.methods]


def _final_jobs(ctx, chosen):
    return [(m, chosen[m][0], s) for s in ctx.plan["final_only_seeds"] for m in ctx.methods]


def _choose(ctx, store) -> dict | None:
    """The chosen lrs from the sweep files (None while a sweep job is missing)."""
    if not all(store.done(*j) for j in _sweep_jobs(ctx)):
        return None
    sweep = {m: {lr: {} for lr in ctx.lrs} for m in ctx.methods}
    for m, lr, s in _sweep_jobs(ctx):
        sweep[m][lr][s] = store.load(m, lr, s)
    num = len(np.asarray(store.load(None, None, ctx.plan["warm_seeds"][0])["levels"]))
    st = ctx.study
    return choose_lrs(sweep, num, ctx.plan["sweep_seeds"], st.select_metric, st.last_evals)


def _status(ctx, store) -> tuple[int, int, float | None]:
    """(jobs done, jobs remaining, estimated remaining wall seconds or None) from the files."""
    warm = [(None, None, s) for s in ctx.plan["warm_seeds"]]
    rl = _sweep_jobs(ctx)
    chosen = _choose(ctx, store)
    rl_done = [j for j in rl if store.done(*j)]
    if chosen is not None:
        rl_done += [j for j in _final_jobs(ctx, chosen) if store.done(*j)]
    warm_done = [j for j in warm if store.done(*j)]
    n_rl = ctx.plan["n_sweep"] + ctx.plan["n_final"]
    left_warm, left_rl = len(warm) - len(warm_done), n_rl - len(rl_done)
    secs = [store.seconds(*j) for j in rl_done]
    eta = None
    if secs:
        w = [store.seconds(*j) for j in warm_done] or secs
        eta = estimate_wall(np.mean(w), np.mean(secs), left_warm, left_rl, ctx.workers)
    return len(warm_done) + len(rl_done), left_warm + left_rl, eta


# ----------------------------------------------------------------------------- execution


class _Session:
    """Runs the missing jobs of one working session, saving each as it finishes."""

    def __init__(self, ctx: _Ctx, store: _Store, estimate: float | None):
        self.ctx, self.store, self.estimate = ctx, store, estimate
        deadline = ctx.wall0 + 60 * ctx.max_minutes if ctx.max_minutes else None
        self.runner = jobs_lib.Runner(ctx.workers, ctx.jax_cache, deadline)
        self.n_rl = ctx.plan["n_sweep"] + ctx.plan["n_final"]
        self.rl_done = 0

    def note_warm(self, r):
        self.store.save(r)
        self.ctx.log(
            f"seed {r['seed']}: warm start {r['seconds']:.0f}s, before pass@{self.ctx.k} "
            f"{r['eval'][f'pass_at_{self.ctx.k}']:.3f}"
        )

    def note_rl(self, r):
        ctx, k = self.ctx, self.ctx.k
        self.store.save(r)
        self.rl_done += 1
        ctx.log(
            f"[{self.rl_done} this session] {r['method']} lr {r['lr']:g} seed {r['seed']}: "
            f"{r['seconds']:.0f}s, last eval pass@{k} {r['eval'][f'pass_at_{k}']:.3f}"
        )
        if self.estimate is None:
            elapsed = time.perf_counter() - ctx.wall0
            rest = self.n_rl - 1
            self.estimate = elapsed + estimate_wall(0, r["seconds"], 0, rest, ctx.workers)
            ctx.log(
                f"ESTIMATE: total wall ~{self.estimate / 60:.0f} min (elapsed {elapsed / 60:.1f} "
                f"min + {rest} RL jobs x {r['seconds']:.0f}s / {ctx.workers} workers; "
                "the first job includes compiles)"
            )
            if self.estimate > 60 * ctx.budget_minutes:
                ctx.log(
                    f"WARNING: the estimate exceeds the {ctx.budget_minutes:.0f}-min "
                    "budget (fewer --steps, --seeds or --lrs, or more --workers)"
                )

    def warm_starts(self, rl_left) -> int:
        """Missing warm starts, and those whose params a remaining RL job needs but no file
        holds; returns how many were not launched."""
        ctx, st = self.ctx, self.store
        need = {s for _, _, s in rl_left}
        seeds = [
            s
            for s in ctx.plan["warm_seeds"]
            if not st.done(None, None, s) or (s in need and st.warm_params(s) is None)
        ]
        kw = ctx.job_kw
        args = lambda s: (s, kw["config_arg"], kw["paper_gdro"], ctx.want_oracle, kw["rl_prompts"])
        return self.runner.run(
            [(jobs_lib.warm_start_job, args(s), {}) for s in seeds], self.note_warm
        )

    def rl(self, todo) -> int:
        st = self.store
        jobs = [
            (jobs_lib.rl_job, (m, s, st.warm_params(s)), dict(lr=lr, **self.ctx.job_kw))
            for m, lr, s in todo
        ]
        return self.runner.run(jobs, self.note_rl)

    def run(self) -> int:
        """All phases; returns the number of jobs not run (0 = complete)."""
        ctx, st = self.ctx, self.store
        try:
            sweep_left = [j for j in _sweep_jobs(ctx) if not st.done(*j)]
            chosen = _choose(ctx, st)
            finals_left = [j for j in _final_jobs(ctx, chosen) if not st.done(*j)] if chosen else []
            if self.warm_starts(sweep_left + finals_left) or self.rl(sweep_left):
                return _status(ctx, st)[1]
            chosen = _choose(ctx, st)
            for m in ctx.methods:
                ctx.log(f"{m}: chosen lr {chosen[m][0]:g} (validation {chosen[m][1]})")
            finals_left = [j for j in _final_jobs(ctx, chosen) if not st.done(*j)]
            if self.warm_starts(finals_left) or self.rl(finals_left):
                return _status(ctx, st)[1]
            return 0
        finally:
            self.runner.close()


def _wall(ctx, *, session: float | None, estimate) -> tuple[float, float | None]:
    """Accumulated wall seconds and the first estimate, via ``runs/wall.json`` (``session``
    None: read only)."""
    path = os.path.join(ctx.runs_dir, "wall.json")
    prev = {}
    if os.path.exists(path):
        with open(path) as f:
            prev = json.load(f)
    if session is None:
        return float(prev.get("wall_seconds", float("nan"))), prev.get("estimate_seconds")
    total = float(prev.get("wall_seconds", 0.0)) + session
    est = prev.get("estimate_seconds") or estimate
    rec = {"wall_seconds": total, "workers": ctx.workers, "estimate_seconds": est}
    rec["sessions"] = int(prev.get("sessions", 1 if prev else 0)) + 1
    # when and where the jobs ran: the report reads these, so --report_only rebuilds it as is
    rec["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rec["cpus"] = os.cpu_count()
    jobs_lib._write_text(path, json.dumps(rec))
    return total, est


# ----------------------------------------------------------------------------- results


def _load_all(ctx, store) -> tuple[dict, dict, dict, dict]:
    """(warm, sweep, chosen, runs) from the files: warm seed -> job, sweep method -> lr -> seed
    -> job, chosen (`choose_lrs`), runs method -> seed -> final job at the chosen lr."""
    warm = {s: store.load(None, None, s) for s in ctx.plan["warm_seeds"]}
    sweep = {
        m: {lr: {s: store.load(m, lr, s) for s in ctx.plan["sweep_seeds"]} for lr in ctx.lrs}
        for m in ctx.methods
    }
    num = len(np.asarray(warm[ctx.plan["warm_seeds"][0]]["levels"]))
    st = ctx.study
    chosen = choose_lrs(sweep, num, ctx.plan["sweep_seeds"], st.select_metric, st.last_evals)
    runs = {}
    for m in ctx.methods:
        lr = chosen[m][0]
        runs[m] = {
            s: sweep[m][lr][s] if s in ctx.plan["sweep_seeds"] else store.load(m, lr, s)
            for s in ctx.seeds
        }
    return warm, sweep, chosen, runs


def _true_p(ctx, runs, warm) -> tuple:
    """(p_for_seed, oracle text) of the RL pool's true success rates."""
    seeds, methods = ctx.seeds, ctx.methods
    oracle_json, want = ctx.study.oracle_json, ctx.want_oracle
    pool = next(
        (
            runs[m][s]["pool_problems"]
            for m in methods
            for s in seeds
            if runs[m][s].get("pool_problems")
        ),
        None,
    )
    num_prompts = int(runs["grpo"][seeds[0]]["num_prompt_ids"])
    if oracle_json:
        p = diag_lib.load_oracle(oracle_json, num_prompts, pool)
        text = (
            f"True success rates p_i: `{oracle_json}` ({int(np.isfinite(p).sum())} of "
            f"{num_prompts} RL prompts), fixed over training."
        )
        return (lambda s: p), text
    if not want:
        text = (
            "True success rates p_i: not available (`--oracle_samples=0` and no "
            "`--oracle_json`), so the true-WSE and expected-informative columns are empty."
        )
        return (lambda s: None), text
    own = lambda s: list(warm[s].get("oracle_problems", []))
    mismatch = [s for s in seeds if pool and own(s) != list(pool)[: len(own(s))]]
    text = (
        f"True success rates p_i: estimated here, {want} samples per RL prompt at the "
        "training sampling settings from each seed's warm-start model (not from the "
        "rollouts the allocator sees); they are the warm start's rates, fixed over training, "
        f"and each carries binomial noise (sd <= {0.5 / math.sqrt(want):.2f}). Pass "
        "`--oracle_json` (experiments/oracle.py) for better estimates."
    ) + (
        f" Seeds {mismatch}: the estimated prompts differ from the RL pool, left out."
        if mismatch
        else ""
    )
    return (lambda s: None if s in mismatch else np.asarray(warm[s]["oracle_p"], float)), text


def _gains(ctx, scores, levels) -> tuple[dict, dict]:
    """Headline gains (pooled) and per-level pass@k gains vs GRPO."""
    n_boot = ctx.study.n_boot
    gains, by_level = {}, {}
    for m in ctx.methods[1:]:
        gains[m] = {
            mt: safe_bootstrap(scores[m][mt], scores["grpo"][mt], n_boot=n_boot) for mt in METRICS
        }
        by_level[m] = {}
        for l in np.unique(levels):
            sel = levels == l
            try:
                by_level[m][str(int(l))] = paired_bootstrap(
                    scores[m]["pass_at_k"][:, sel],
                    scores["grpo"]["pass_at_k"][:, sel],
                    n_boot=min(n_boot, 500),
                )
            except ValueError:
                by_level[m][str(int(l))] = None
    return gains, by_level


def _gains_by_start(ctx, scores, before) -> dict:
    """pass@k gains vs GRPO by each seed's warm-start success on each test problem (its share
    of correct samples in ``before [S, N, k]``; `statistics.gains_by_start`): ``{"share":
    {label: share of cells}, method: {label: gain or None}}``."""
    rate = np.asarray(before, np.float64).mean(axis=2)  # [S, N]
    n_boot = min(ctx.study.n_boot, 2000)
    out = {}
    for m in ctx.methods[1:]:
        by = gains_by_start(
            scores[m]["pass_at_k"], scores["grpo"]["pass_at_k"], rate, n_boot=n_boot
        )
        out["share"] = by.pop("share")
        out[m] = by
    return out


def _training_weights(cfg, levels) -> dict[int, float] | None:
    """The RL pool's level mix ``{level: weight}`` when the test half's level shares differ from
    it (``,pool``: test uniform over d, RL 0.5 / 0.05 / 0.35 / 0.1), else None (the pooled test
    half already is the training mix: every earlier testbed)."""
    a = ArithmeticConfig(**cfg.data.arithmetic.to_dict())
    w = {int(l): float(x) for l, x in zip(a.levels, a.train_weights())}
    present, counts = np.unique(np.asarray(levels), return_counts=True)
    share = counts / counts.sum()
    if np.allclose(share, [w.get(int(l), 0.0) for l in present], rtol=0, atol=1e-9):
        return None
    return w


def _mix_gains(ctx, correct_test, levels) -> dict:
    """pass@k (k in `EXTRA_PASS_K`, k <= samples) on the training mix and the hard mix
    (``hard_weights``), with paired bootstrap gains vs GRPO (GRPO: its own score only). The
    training mix is the pooled test half, or its per-level means weighted by the RL pool's level
    mix where the two differ (`_training_weights`, recorded as ``train_weights``)."""
    ks = [k for k in EXTRA_PASS_K if k <= ctx.k]
    hw = {int(l): float(w) for l, w in ctx.study.hard_weights.items()}
    tw = _training_weights(ctx.cfg0, levels)
    last, n_boot = ctx.study.last_evals, ctx.study.n_boot
    sc = {
        m: {k: per_problem_scores(c, "pass_at_k", last, pass_k=k) for k in ks}
        for m, c in correct_test.items()
    }
    train = {} if tw is None else {"levels": levels, "level_weights": tw}
    mixes = {"train": train, "hard": {"levels": levels, "level_weights": hw}}
    out = {}
    for m in ctx.methods:
        out[m] = {
            name: {str(k): safe_bootstrap(sc[m][k], sc["grpo"][k], n_boot=n_boot, **kw) for k in ks}
            for name, kw in mixes.items()
        }
    res = {"ks": ks, "hard_weights": hw, "gains": out}
    return res if tw is None else {**res, "train_weights": tw}


def _test_statistics(ctx, runs, warm) -> dict:
    """Tables, gains and curves on the test half."""
    seeds, last = ctx.seeds, ctx.study.last_evals
    levels_all = np.asarray(warm[seeds[0]]["levels"])
    _, test_idx = split_heldout(len(levels_all))
    levels = levels_all[test_idx]
    correct_test = {
        m: np.stack([np.asarray(runs[m][s]["correct"])[:, test_idx] for s in seeds])
        for m in ctx.methods
    }
    before = np.stack([np.asarray(warm[s]["correct"])[test_idx] for s in seeds])
    scores = {
        m: {mt: per_problem_scores(c, mt, last) for mt in METRICS} for m, c in correct_test.items()
    }
    scores["before"] = {mt: per_problem_scores(before, mt) for mt in METRICS}
    gains, by_level = _gains(ctx, scores, levels)
    by_start = _gains_by_start(ctx, scores, before)
    curves = {"before": {mt: float(per_problem_scores(before, mt).mean()) for mt in METRICS}}
    for m, c in correct_test.items():  # [S, T, N, k]
        curves[m] = {"steps": [int(x) for x in runs[m][seeds[0]]["eval_steps"]]}
        for mt in METRICS:
            curves[m][mt] = [
                float(per_problem_scores(c[:, t], mt).mean()) for t in range(c.shape[1])
            ]
    return {
        "tables": {m: metric_table(sc, levels) for m, sc in scores.items()},
        "gains": gains,
        "gains_by_level": by_level,
        "gains_by_start": by_start,
        "mix_gains": _mix_gains(ctx, correct_test, levels),
        "eval_curves": curves,
        "num_eval": len(levels_all),
    }


def _setup(ctx, num_prompts, num_eval) -> dict:
    c, o, plan = ctx.cfg0, ctx.study, ctx.plan
    val_idx, test_idx = split_heldout(num_eval)
    return {
        "config_arg": ctx.job_kw["config_arg"],
        "paper_gdro": bool(ctx.job_kw["paper_gdro"]),
        "methods": {m: list(METHODS[m]) for m in ctx.methods},
        "seeds": ctx.seeds,
        "sweep_seeds": plan["sweep_seeds"],
        "sweep_mode": plan["mode"],
        "reuse": any(s in ctx.seeds for s in plan["sweep_seeds"]),
        "lrs": ctx.lrs,
        "select_metric": o.select_metric,
        "last_evals": o.last_evals,
        "eval_steps": ctx.when,
        "steps": c.steps,
        "prompts_per_step": c.rollout.prompts_per_step,
        "rollouts_per_prompt": c.rollout.rollouts_per_prompt,
        "rollouts_per_step": c.rollout.prompts_per_step * c.rollout.rollouts_per_prompt,
        "rl_prompts": num_prompts,
        "num_train": c.data.arithmetic.num_train,
        "num_sft": int(c.data.arithmetic.get("num_sft", 0) or 0),
        "num_eval": int(num_eval),
        "num_val": int(len(val_idx)),
        "num_test": int(len(test_idx)),
        "split": "even held-out index -> validation, odd -> test",
        "sft_steps": c.sft.steps,
        "visits_per_prompt": c.steps * c.rollout.prompts_per_step / num_prompts,
        "oracle_json": o.oracle_json,
        "oracle_samples": ctx.want_oracle,
        "hard_weights": {str(k): v for k, v in o.hard_weights.items()},
        "python": platform.python_version(),
    }


def _timing(ctx, warm, sweep, runs) -> dict:
    finals = ctx.plan["final_only_seeds"]
    return {
        "n_warm": ctx.plan["n_warm"],
        "warm_start": float(np.mean([w["seconds"] for w in warm.values()])),
        "n_jobs": {
            m: len(ctx.lrs) * len(ctx.plan["sweep_seeds"]) + len(finals) for m in ctx.methods
        },
        "rl": {
            m: float(
                np.mean(
                    [j["seconds"] for lr in ctx.lrs for j in sweep[m][lr].values()]
                    + [runs[m][s]["seconds"] for s in finals]
                )
            )
            for m in ctx.methods
        },
    }


def _compute(ctx, runs) -> dict:
    keys = ("rollouts", "generated_tokens", "updates")
    return {
        m: {key: float(np.mean([runs[m][s][key] for s in ctx.seeds])) for key in keys}
        | {"steps": float(np.mean([len(runs[m][s]["rows"]) for s in ctx.seeds]))}
        | _budget_spent([runs[m][s] for s in ctx.seeds])
        for m in ctx.methods
    }


def _budget_spent(jobs) -> dict:
    """{"budget_spent": share of token-budget runs that spent their budget} ({} in step mode)."""
    flags = [j.get("budget_spent") for j in jobs if j.get("budget_spent") is not None]
    return {"budget_spent": float(np.mean(flags))} if flags else {}


def _results(ctx, warm, sweep, chosen, runs) -> dict:
    """Every number of the report."""
    o = ctx.study
    num_prompts = int(runs["grpo"][ctx.seeds[0]]["num_prompt_ids"])
    stats = _test_statistics(ctx, runs, warm)
    num_eval = stats.pop("num_eval")
    p_for_seed, oracle_text = _true_p(ctx, runs, warm)
    wall_path = os.path.join(ctx.runs_dir, "wall.json")
    record = {}
    if os.path.exists(wall_path):
        with open(wall_path) as f:
            record = json.load(f)
    results = {
        # from runs/wall.json (the last session that ran jobs), so a rebuild is byte for byte
        "date": record.get("date") or time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpus": record.get("cpus") or os.cpu_count(),
        "workers": ctx.workers,
        "k": ctx.k,
        "pass_k": min(PASS_K, ctx.k),
        "n_boot": o.n_boot,
        "setup": _setup(ctx, num_prompts, num_eval),
        "sweep": {
            m: {
                "chosen": chosen[m][0],
                "scores": {f"{lr:.3g}": v for lr, v in chosen[m][2].items()},
            }
            for m in ctx.methods
        },
        "runs": runs,
        **stats,
        "compute": _compute(ctx, runs),
        "compute_to_grpo": compute_to_grpo_level(runs, num_eval, min(PASS_K, ctx.k)),
        "timing": _timing(ctx, warm, sweep, runs),
        "oracle_text": oracle_text,
        "preregistration": _read(o.preregistration),
    }
    with warnings.catch_warnings():  # nanmean of all-NaN diagnostics (e.g. no informative rollout)
        warnings.simplefilter("ignore", RuntimeWarning)
        results["diagnostics"] = diag_lib.diagnostics(runs, p_for_seed)
        results["curriculum_text"] = report_lib.curriculum_text(runs)
        results["diagnostics_text"] = report_lib.diagnostics_table(results)
        results["arm_text"] = report_lib.arm_table(results)
    results["verdict"] = report_lib.verdict(results)
    if o.criterion:
        results["criterion"] = report_lib.criterion(results)
    return results


def _read(path: str) -> str:
    if not path:
        return ""
    with open(path) as f:
        return f.read()


def _write_outputs(ctx, results, warm, command) -> str:
    from grpo_jax import writers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        figs = report_lib.make_figures(results, ctx.fig_dir)
    results["figures"] = {n: os.path.relpath(p, ctx.out_dir) for n, p in figs.items()}
    path = report_lib.write_report(results, ctx.out_dir, figs, command)
    runs = results["runs"]
    slim = {k: v for k, v in results.items() if k != "runs"}
    slim["diagnostics"] = {
        m: {k: v for k, v in d.items() if k != "series"} for m, d in results["diagnostics"].items()
    }
    slim["per_run"] = {
        m: {
            str(s): {k: runs[m][s][k] for k in ("lr", "eval_summaries", "seconds")}
            for s in ctx.seeds
        }
        for m in ctx.methods
    }
    slim["before"] = {str(s): {"eval": warm[s]["eval"], "sft": warm[s]["sft"]} for s in ctx.seeds}
    jobs_lib._write_text(
        os.path.join(ctx.out_dir, f"{REPORT_NAME}.json"),
        json.dumps(writers.to_jsonable(slim), indent=1, sort_keys=True),
    )
    return path


# ----------------------------------------------------------------------------- entry points


def run_comparison(
    plan: ComparisonPlan,
    out_dir: str,
    *,
    workers: int = 1,
    jax_cache: str = "",
    budget_minutes: float = 90.0,
    max_minutes: float = 0.0,
    report_only: bool = False,
    command: str = "",
) -> dict:
    """Sweep -> lr selection on validation -> final seeds -> report on test (package docstring)
    of ``plan``, resuming from the job files in ``<out_dir>/gdro_vs_grpo/runs/``.

    How this session runs it: ``workers`` processes; ``jax_cache``, the JAX persistent
    compilation cache directory ('' = the process's own); a warning when the estimated wall
    exceeds ``budget_minutes``; no new job launched after ``max_minutes`` (0 = no limit);
    ``report_only``: the report from the job files alone; ``command``: the command line the
    report records.

    Writes ``gdro_vs_grpo.md``, ``gdro_vs_grpo.json`` and ``gdro_vs_grpo/`` into ``out_dir``;
    returns the results dict (``runs``: the final jobs, method -> seed -> job), or, when
    ``max_minutes`` stopped the run first, ``{"finished": False, "remaining": N}``.

    Raises:
      ValueError: a bad plan. jobs.SettingsMismatch: a job file of other settings.
      FileNotFoundError: ``report_only`` with a missing job file.
    """
    ctx = _context(
        plan,
        out_dir,
        workers=workers,
        jax_cache=jax_cache,
        budget_minutes=budget_minutes,
        max_minutes=max_minutes,
    )
    os.makedirs(ctx.runs_dir, exist_ok=True)
    store = _Store(ctx)
    p = ctx.plan
    ctx.log(
        f"{len(ctx.methods)} methods x {len(ctx.lrs)} lrs x {len(p['sweep_seeds'])} sweep seeds "
        f"= {p['n_sweep']} sweep jobs, + {p['n_final']} final jobs, {p['n_warm']} warm starts, "
        f"{workers} worker(s)"
    )
    if report_only:
        wall, estimate = _wall(ctx, session=None, estimate=None)
    else:
        done, left, eta = _status(ctx, store)
        ctx.log(
            f"{done} jobs done, {left} remaining; "
            + (
                f"estimated remaining wall ~{eta / 60:.1f} min (from the finished jobs' times)"
                if eta is not None
                else "estimate after the first RL job"
            )
        )
        prev_estimate = _wall(ctx, session=None, estimate=None)[1]
        session = _Session(ctx, store, prev_estimate)
        left = session.run()
        wall, estimate = _wall(
            ctx, session=time.perf_counter() - ctx.wall0, estimate=session.estimate
        )
        if left:
            ctx.log(
                f"stopped after --max_minutes={max_minutes:g}: {left} jobs remain; rerun the same "
                "command to resume"
            )
            return {"finished": False, "remaining": left}
    warm, sweep, chosen, runs = _load_all(ctx, store)
    results = _results(ctx, warm, sweep, chosen, runs)
    results.update(wall_seconds=wall, estimate_seconds=estimate, finished=True)
    path = _write_outputs(ctx, results, warm, command or "python -m experiments.compare")
    for m, ok in results.get("criterion", {}).get("meets", {}).items():
        ctx.log(f"criterion: {m} {'meets the criterion' if ok else 'does not'}")
    ctx.log(
        f"wrote {path}; TOTAL wall {wall / 60:.1f} min"
        + (f" (estimated {estimate / 60:.1f} min)" if estimate else "")
    )
    return results


def estimate_only(study: ComparisonPlan, *, workers: int, jax_cache: str = "") -> float:
    """Times one warm start and one GRPO RL job (first lr) of ``study`` in this process and
    returns the extrapolated wall seconds of the whole comparison (`estimate_wall`)."""
    jobs_lib.enable_compilation_cache(jax_cache)
    seeds = parse_seeds(study.seeds)
    plan = plan_jobs(seeds, study.sweep_seeds, study.methods, study.lrs)
    oracle_samples = 0 if study.oracle_json else study.oracle_samples
    job_kw = study.job_settings()
    w = jobs_lib.warm_start_job(
        seeds[0], job_kw["config_arg"], job_kw["paper_gdro"], oracle_samples, job_kw["rl_prompts"]
    )
    r = jobs_lib.rl_job("grpo", seeds[0], w["params"], lr=float(study.lrs[0]), **job_kw)
    n_rl = plan["n_sweep"] + plan["n_final"]
    est = estimate_wall(w["seconds"], r["seconds"], plan["n_warm"], n_rl, workers)
    print(
        f"ESTIMATE: {est / 60:.1f} min = ceil({plan['n_warm']} warm starts / {workers}) x "
        f"{w['seconds']:.0f}s + ceil({n_rl} RL jobs / {workers}) x {r['seconds']:.0f}s "
        f"(one job each, timed alone in this process)",
        flush=True,
    )
    return est


def _parser() -> argparse.ArgumentParser:
    ap = cli.ArgumentParser(description="GDRO vs GRPO at equal compute (experiments.compare)")
    a = ap.add_argument
    a("--out", default="reports", help="output directory")
    a("--seeds", default="10", help="final paired seeds: N (= 0..N-1) or a list '3,5' / '5,'")
    a("--sweep_seeds", default="3", help="lr-sweep seeds: N = the first N final seeds, or a list")
    a("--lrs", default=",".join(f"{x:g}" for x in DEFAULT_LRS), help="lr sweep")
    a(
        "--methods",
        default=",".join(MECHANISM_METHODS),
        help=f"a subset of {','.join(METHODS)} (default: the mechanism test's arms)",
    )
    a("--config", default=DEFAULT_CONFIG, help="config file; get_config('<algo>,<config_arg>')")
    a("--config_arg", default="heavy_tailed", help="config argument after algo")
    a("--paper_gdro", action="store_true", help="the paper's GDRO controllers")
    a("--steps", type=int, default=80, help="RL steps (0 = the config's)")
    a("--prompts_per_step", type=int, default=0, help="P (0 = the config's)")
    a("--rl_prompts", type=int, default=512, help="RL pool: the first N problems")
    a("--eval_every", type=int, default=20, help="evaluate every N RL steps")
    a(
        "--token_budget",
        type=int,
        default=0,
        help="generated tokens per RL run (0 = --steps steps); evaluations at as many evenly "
        "spaced token counts as --eval_every gives steps",
    )
    a("--last_evals", type=int, default=3, help="score = mean of the last N evals")
    a("--select_metric", default="pass_at_k", choices=METRICS)
    a("--oracle_json", default="", help='{"p": {"<prompt id>": p}} (docstring)')
    a(
        "--oracle_samples",
        type=int,
        default=16,
        help="without --oracle_json: samples per RL prompt to estimate p (0 = skip)",
    )
    a("--workers", type=int, default=2, help="processes")
    a("--n_boot", type=int, default=2000, help="bootstrap replicates")
    a("--budget_minutes", type=float, default=90.0, help="warn above this")
    a(
        "--jax_cache",
        default="/tmp/grpo_jax_compare_cache",
        help="JAX persistent compilation cache directory ('' = off)",
    )
    a("--estimate_only", action="store_true", help="time one job, print, exit")
    a("--report_only", action="store_true", help="rebuild the report from the job files in --out")
    a(
        "--max_minutes",
        type=float,
        default=0.0,
        help="launch no new job after M minutes (0 = no limit); rerun to resume",
    )
    a("--hard_weights", default="2:1,3:2,4:3,5:4", help="level:weight of the hard-weighted mix")
    a("--preregistration", default="", help="markdown file included verbatim near the top")
    a("--criterion", action="store_true", help="evaluate the pre-registered criterion")
    return ap


_NOT_RECORDED = ("--report_only", "--estimate_only", "--max_minutes")


def _command(argv) -> str:
    """The command line to record in the report (without the flags that do not change it)."""
    given, out, skip = list(argv), [], False
    for a in given:
        if skip:
            skip = False
            continue
        if a in _NOT_RECORDED[2:]:
            skip = True
            continue
        if a in _NOT_RECORDED or a.split("=")[0] in _NOT_RECORDED[2:]:
            continue
        out.append(a)
    return ("python -m experiments.compare " + " ".join(out)).strip()


@cli.entry_point
def main(argv=None) -> int:
    """The command line; 0 when done (or stopped by --max_minutes). Bad input (flags, a settings
    mismatch with the job files in --out, a missing file) is one ``error:`` line, exit 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    try:
        sweep_seeds = (
            parse_seeds(args.sweep_seeds) if "," in args.sweep_seeds else int(args.sweep_seeds)
        )
        lrs = [float(x) for x in args.lrs.split(",") if x.strip()]
    except ValueError as e:
        raise cli.UsageError(f"--sweep_seeds={args.sweep_seeds} / --lrs={args.lrs}: {e}") from None
    config_arg = args.config_arg
    if args.config != DEFAULT_CONFIG:
        config_arg = f"{args.config}:{config_arg}"
    plan = ComparisonPlan(
        seeds=args.seeds,
        sweep_seeds=sweep_seeds,
        lrs=lrs,
        methods=[m for m in args.methods.split(",") if m.strip()],
        config_arg=config_arg,
        paper_gdro=args.paper_gdro,
        steps=args.steps,
        prompts_per_step=args.prompts_per_step,
        rl_prompts=args.rl_prompts,
        eval_every=args.eval_every,
        token_budget=args.token_budget,
        last_evals=args.last_evals,
        select_metric=args.select_metric,
        oracle_json=args.oracle_json,
        oracle_samples=args.oracle_samples,
        n_boot=args.n_boot,
        hard_weights=parse_level_weights(args.hard_weights),
        preregistration=args.preregistration,
        criterion=args.criterion,
    )
    if args.estimate_only:
        estimate_only(plan, workers=args.workers, jax_cache=args.jax_cache)
        return 0
    res = run_comparison(
        plan,
        args.out,
        workers=args.workers,
        jax_cache=args.jax_cache,
        budget_minutes=args.budget_minutes,
        max_minutes=args.max_minutes,
        report_only=args.report_only,
        command=_command(argv),
    )
    if not res.get("finished", True):
        print(
            f"compare: {res['remaining']} jobs remain; rerun the same command to resume.",
            flush=True,
        )
    return 0
