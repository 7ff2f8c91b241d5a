"""Scores and statistics: per-problem pass@k / mean@k, the paired bootstrap of relative gains
(pooled or over a level mix), the validation-only lr choice, the true WSE of one step."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from experiments.compare.plan import METRICS, PASS_K, split_heldout

# strata of the warm start's per-problem success (share of its samples correct; each seed has its
# own warm start): never solved, rarely, sometimes, mostly
START_EDGES = (0.0, 0.1, 0.3)
START_LABELS = ("0", "(0, 0.1]", "(0.1, 0.3]", "> 0.3")
_NAN_KEYS = ("gain", "lo", "hi", "p_le_0", "diff", "diff_lo", "diff_hi", "d_z", "d_z_lo", "d_z_hi")


def per_problem_scores(
    correct, metric: str = "pass_at_k", last: int = 0, pass_k: int = PASS_K
) -> np.ndarray:
    """Per-problem scores from sample correctness.

    Args:
      correct: ``[S, N, n]`` or ``[S, T, N, n]`` (T evaluations) bool / 0-1, n samples each.
      metric: ``pass_at_k`` (unbiased pass@``min(pass_k, n)``, `grpo_jax.metrics.pass_at_k`;
        with n = k it is 1[any sample correct]) or ``mean_at_k`` (share of correct samples).
      last: with ``[S, T, N, n]``, average the last ``last`` evaluations (0 = all).
      pass_k: the k of pass@k.

    Returns: ``[S, N]`` float64.

    Raises:
      ValueError: another shape or metric.
    """
    from grpo_jax.metrics import pass_at_k

    c = np.asarray(correct)
    if c.ndim == 4:
        c = c[:, -last:] if last else c
    elif c.ndim != 3:
        raise ValueError(f"correct must be [S, N, k] or [S, T, N, k]; got shape {c.shape}")
    n = c.shape[-1]
    if metric == "pass_at_k":
        s = np.asarray(pass_at_k(n, c.astype(bool).sum(-1), min(int(pass_k), n)), np.float64)
    elif metric == "mean_at_k":
        s = c.astype(np.float64).mean(-1)
    else:
        raise ValueError(f"metric {metric!r}: choose from {METRICS}")
    return s.mean(1) if s.ndim == 3 else s


def _level_mix(scores, levels, weights, counts=None) -> np.ndarray:
    """Per-seed level-mix means of ``scores [S, N]``: ``sum_l w_l mean_l / sum_l w_l`` over the
    levels present. With ``counts [B, N]`` (bootstrap multiplicities) -> ``[S, B]``."""
    from grpo_jax.data.arithmetic import mix_mean

    if counts is None:
        present = [int(l) for l in np.unique(levels)]
        return np.array(
            [mix_mean({l: row[levels == l].mean() for l in present}, weights) for row in scores]
        )
    num = np.zeros((scores.shape[0], counts.shape[0]))
    den = np.zeros(counts.shape[0])
    for l, w in weights.items():
        m = counts * (levels == int(l))  # [B, N]
        cnt = m.sum(1)
        if w <= 0 or not cnt.any():
            continue
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = scores @ m.T / cnt  # [S, B]
        num += float(w) * np.nan_to_num(mean)
        den += float(w) * (cnt > 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return num / den


def paired_bootstrap(
    scores_m,
    scores_base,
    *,
    n_boot: int = 2000,
    seed: int = 0,
    level: float = 0.95,
    levels=None,
    level_weights: Mapping | None = None,
) -> dict:
    """Paired bootstrap of a method against a baseline from per-problem scores ``[S, N]``.

    Each replicate resamples seeds and, independently, problems (with replacement), and applies
    the *same* draw to both methods (shared warm starts, evaluation keys and problems: paired).
    The statistic is the mean over problems, or with ``levels [N]`` and ``level_weights``
    ({level: w}) the level mix ``sum_l w_l mean_l / sum_l w_l`` (`grpo_jax.data.arithmetic.
    mix_mean`), per seed, then the mean over seeds.

    Returns:
      ``gain`` = stat(method) / stat(base) - 1 with ``lo``/``hi`` (percentile interval) and
      ``p_le_0`` (share of replicates with gain <= 0); ``diff`` = stat(method) - stat(base) with
      ``diff_lo``/``diff_hi``; ``d_z`` = mean / std (ddof 1) of the per-seed differences (NaN
      with one seed) with ``d_z_lo``/``d_z_hi``; ``mean``, ``base``; ``n_seeds``, ``n_problems``.

    Raises:
      ValueError: shape mismatch or a zero baseline.
    """
    a = np.asarray(scores_m, np.float64)
    b = np.asarray(scores_base, np.float64)
    if a.shape != b.shape or a.ndim != 2:
        raise ValueError(f"scores must both be [S, N]; got shapes {a.shape}, {b.shape}")
    mixed = levels is not None and level_weights is not None
    if mixed:
        levels = np.asarray(levels)
        a_seed, b_seed = _level_mix(a, levels, level_weights), _level_mix(b, levels, level_weights)
        a_mean, b_mean = float(a_seed.mean()), float(b_seed.mean())
    else:
        a_seed, b_seed, a_mean, b_mean = a.mean(1), b.mean(1), float(a.mean()), float(b.mean())
    if b_mean == 0:
        raise ValueError("baseline score is 0: the relative gain is undefined")
    s, n = a.shape
    rng = np.random.default_rng(seed)
    si = rng.integers(0, s, size=(n_boot, s))
    ni = rng.integers(0, n, size=(n_boot, n))
    cols = np.arange(n_boot)[:, None]
    if mixed:  # per seed, the replicate's level mix over its resampled problems: [S, n_boot]
        counts = np.zeros((n_boot, n))
        np.add.at(counts, (np.arange(n_boot)[:, None], ni), 1.0)
        ar, br = (_level_mix(x, levels, level_weights, counts) for x in (a, b))
    else:  # per seed, the mean over each replicate's resampled problems: [S, n_boot]
        ar, br = a[:, ni].mean(-1), b[:, ni].mean(-1)
    am, bm = ar[si, cols], br[si, cols]  # [n_boot, S]: the resampled seeds
    return _summarise(am, bm, a_seed, b_seed, a_mean, b_mean, level, n)


def _summarise(am, bm, a_seed, b_seed, a_mean, b_mean, level, n) -> dict:
    """`paired_bootstrap`'s dict from the replicates ``[n_boot, S]`` and the point estimates."""
    s = len(a_seed)
    alpha = (1 - level) / 2
    q = lambda x: (float(np.quantile(x, alpha)), float(np.quantile(x, 1 - alpha)))
    with np.errstate(divide="ignore", invalid="ignore"):
        g = am.mean(1) / bm.mean(1) - 1.0
        d = am - bm
        dz = d.mean(1) / d.std(1, ddof=1) if s > 1 else np.full(len(am), np.nan)
    g = g[np.isfinite(g)]
    dz = dz[np.isfinite(dz)]
    per_seed = a_seed - b_seed
    sd = per_seed.std(ddof=1) if s > 1 else float("nan")
    if s > 1 and sd > 0:
        d_z = float(per_seed.mean() / sd)
    elif s > 1 and per_seed.mean() == 0:
        d_z = 0.0
    else:
        d_z = float("nan")
    out = {
        "gain": float(a_mean / b_mean - 1.0),
        "p_le_0": float(np.mean(g <= 0)) if g.size else float("nan"),
        "diff": float(a_mean - b_mean),
        "d_z": d_z,
        "mean": a_mean,
        "base": b_mean,
        "n_seeds": int(s),
        "n_problems": int(n),
    }
    out["lo"], out["hi"] = q(g) if g.size else (float("nan"),) * 2
    out["diff_lo"], out["diff_hi"] = q(d.mean(1))
    out["d_z_lo"], out["d_z_hi"] = q(dz) if dz.size else (float("nan"),) * 2
    return out


def safe_bootstrap(a, b, **kw) -> dict:
    """`paired_bootstrap`, or the same keys as NaN (plus ``undefined``) when the baseline's
    score is 0 (the relative gain is undefined; the report shows a dash)."""
    try:
        return paired_bootstrap(a, b, **kw)
    except ValueError as e:
        out = dict.fromkeys(_NAN_KEYS, float("nan"))
        out.update(undefined=str(e), mean=float(np.mean(a)), base=float(np.mean(b)))
        return out


def bootstrap_relative_gain(
    correct_m,
    correct_base,
    *,
    metric: str = "pass_at_k",
    last: int = 0,
    n_boot: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> dict:
    """Relative pass@k (or mean@k) gain of a method over a baseline with a paired bootstrap
    interval, from sample correctness ``[S, N, k]`` (or ``[S, T, N, k]``, the last ``last``
    evaluations averaged per problem): `per_problem_scores` then `paired_bootstrap`.

    Raises:
      ValueError: shape mismatch or an all-zero baseline.
    """
    a = np.asarray(correct_m)
    b = np.asarray(correct_base)
    if a.shape != b.shape or a.ndim not in (3, 4):
        raise ValueError(
            f"correct arrays must both be [S, N, k] or [S, T, N, k]; got {a.shape}, {b.shape}"
        )
    return paired_bootstrap(
        per_problem_scores(a, metric, last),
        per_problem_scores(b, metric, last),
        n_boot=n_boot,
        seed=seed,
        level=level,
    )


def select_lr(
    sweep: dict, val_idx, *, metric: str = "pass_at_k", last: int = 0
) -> tuple[float, dict]:
    """The learning rate with the highest mean validation score.

    Args:
      sweep: lr -> correct ``[S, T, N, k]`` (or ``[S, N, k]``) over the *whole* held-out set;
        only the columns ``val_idx`` are read (the test half never influences the choice).
      val_idx: validation problem indices (``split_heldout(N)[0]``).
      metric, last: see `per_problem_scores`.

    Returns: (chosen lr, {lr: mean validation score}); ties go to the first lr of ``sweep``.

    Raises:
      ValueError: an empty sweep.
    """
    if not sweep:
        raise ValueError("empty learning-rate sweep")
    val_idx = np.asarray(val_idx)
    scores = {}
    for lr, c in sweep.items():
        c = np.asarray(c)
        scores[lr] = float(per_problem_scores(c[..., val_idx, :], metric, last).mean())
    best = max(scores.values())
    chosen = next(lr for lr, s in scores.items() if s == best)
    return chosen, scores


def choose_lrs(sweep: dict, num_eval: int, sweep_seeds, metric: str, last: int) -> dict:
    """method -> (chosen lr, rounded validation score, {lr: validation score}) from the sweep
    jobs ``sweep[method][lr][seed]``; reads only the validation half (`split_heldout`)."""
    val_idx, _ = split_heldout(num_eval)
    out = {}
    for m, by_lr in sweep.items():
        arrays = {
            lr: np.stack([np.asarray(by_lr[lr][s]["correct"]) for s in sweep_seeds]) for lr in by_lr
        }
        lr, sc = select_lr(arrays, val_idx, metric=metric, last=last)
        out[m] = (lr, f"{sc[lr]:.3f}", sc)
    return out


def metric_table(scores: dict, levels: np.ndarray) -> dict:
    """{metric: [S, N]} -> {"overall"|level: {metric: (mean, std over seeds)}}."""
    out = {}
    groups = {"overall": np.ones(levels.shape, bool)}
    groups.update({str(int(l)): levels == l for l in np.unique(levels)})
    for name, m in groups.items():
        out[name] = {}
        for metric, s in scores.items():
            per_seed = s[:, m].mean(-1)
            sd = float(per_seed.std(ddof=1)) if len(per_seed) > 1 else 0.0
            out[name][metric] = (float(per_seed.mean()), sd)
    return out


def true_wse(ids, bins, n, p, n_bar: float) -> dict:
    """True-variance diagnostics of one step's allocation (spec s.4/s.7).

    Args:
      ids, bins, n: ``[P]`` prompt ids, bins (``B`` = unseen: its own group) and rollouts per
        prompt of the step.
      p: ``[num_prompts]`` true per-sample success rates (NaN = unknown: left out).
      n_bar: the uniform allocation's rollouts per prompt.

    Returns: ``wse`` = the per-prompt `grpo_jax.metrics.weighted_standard_error`
      ``mean_i sqrt(p_i (1 - p_i)) / sqrt(n_i)``; ``wse_uniform`` (every ``n_i = n_bar``);
      ``wse_bins`` / ``wse_bins_uniform``: the stratum-averaged form over the controller's bins
      (``mean_i sigma_{b(i)} / sqrt(n_i)``, ``sigma_b^2`` the bin's mean ``p (1 - p)``; Jensen
      inflates it, kept out of the headline); ``informative`` = expected informative groups
      ``sum_i 1 - p_i^n_i - (1 - p_i)^n_i``; ``informative_uniform``; ``known`` = prompts with a
      known ``p``. NaN values when no prompt has a known ``p``.
    """
    from grpo_jax.metrics import weighted_standard_error

    ids, bins = np.asarray(ids, np.int64), np.asarray(bins, np.int64)
    n = np.asarray(n, np.float64)
    pi = np.asarray(p, np.float64)[ids]
    ok = np.isfinite(pi)
    keys = ("wse", "wse_uniform", "wse_bins", "wse_bins_uniform", "informative")
    if not ok.any():
        return dict.fromkeys(keys + ("informative_uniform",), float("nan")) | {"known": 0}
    bins, n, pi = bins[ok], n[ok], pi[ok]
    uniform = np.full(n.shape, float(n_bar))
    groups = bins.max() + 1
    cnt = np.bincount(bins, minlength=groups)
    sig = np.sqrt(np.bincount(bins, weights=pi * (1 - pi), minlength=groups) / np.maximum(cnt, 1))
    s = sig[bins]
    inf = lambda m: float(np.sum(1 - pi**m - (1 - pi) ** m))
    return {
        "wse": weighted_standard_error(n, pi),
        "wse_uniform": weighted_standard_error(uniform, pi),
        "wse_bins": float(np.mean(s / np.sqrt(n))),
        "wse_bins_uniform": float(np.mean(s / np.sqrt(n_bar))),
        "informative": inf(n),
        "informative_uniform": inf(uniform),
        "known": int(ok.sum()),
    }


def first_reach(x, values, target: float) -> float:
    """``x[t]`` at the first evaluation ``t`` with ``values[t] >= target`` (no interpolation
    between evaluations: a conservative count); NaN when no evaluation reaches it.

    Args:
      x: ``[T]`` cumulative compute at each evaluation (tokens, rollouts, CPU seconds).
      values: ``[T]`` the metric at each evaluation.
    """
    x, values = np.asarray(x, np.float64), np.asarray(values, np.float64)
    hit = np.flatnonzero(values >= target - 1e-12)
    return float(x[hit[0]]) if hit.size else float("nan")


def compute_to_grpo_level(runs: Mapping, num_eval: int, pass_k: int = PASS_K) -> dict:
    """Per arm, the generated tokens, rollouts and CPU seconds each seed's run needed to reach
    GRPO's *final* validation pass@k on the same seed (`first_reach` over its evaluations).

    Args:
      runs: method -> seed -> job (``correct [T, N, k]``, ``eval_tokens`` / ``eval_rollouts`` /
        ``eval_cpu_seconds`` ``[T]``, ``generated_tokens``, ``rollouts``); ``"grpo"`` is the
        baseline. Jobs without ``eval_tokens`` (written before token budgets) are left out.
      num_eval: held-out problems (validation = `split_heldout`'s first half).

    Returns:
      method -> {"seeds": [...], "target": [S] GRPO's final validation pass@k, "tokens" /
      "rollouts" / "cpu_seconds": [S] (NaN = never reached), "reached": share of seeds,
      "median_tokens": median over the seeds that reached it (NaN if none), "budget_tokens" /
      "budget_rollouts": mean over seeds of the run's totals}.
    """
    val, _ = split_heldout(num_eval)

    def curve(job) -> np.ndarray:  # [T] validation pass@k
        return per_problem_scores(np.asarray(job["correct"])[:, val], pass_k=pass_k).mean(-1)

    out = {}
    for method, by_seed in runs.items():
        seeds = [s for s in by_seed if s in runs["grpo"] and "eval_tokens" in by_seed[s]]
        target = [float(curve(runs["grpo"][s])[-1]) for s in seeds]
        res = {"seeds": seeds, "target": target}
        for key in ("tokens", "rollouts", "cpu_seconds"):
            res[key] = [
                first_reach(by_seed[s][f"eval_{key}"], curve(by_seed[s]), t)
                for s, t in zip(seeds, target)
            ]
        tok = np.asarray(res["tokens"], np.float64)
        res["reached"] = float(np.isfinite(tok).mean()) if seeds else float("nan")
        res["median_tokens"] = (
            float(np.median(tok[np.isfinite(tok)])) if np.isfinite(tok).any() else float("nan")
        )
        for key, field in (("budget_tokens", "generated_tokens"), ("budget_rollouts", "rollouts")):
            vals = [float(by_seed[s][field]) for s in seeds]
            res[key] = float(np.mean(vals)) if vals else float("nan")
        out[method] = res
    return out


def holm(pvalues: Mapping, alpha: float = 0.025) -> dict:
    """Holm's step-down procedure (Holm 1979): sort the m p-values ascending and reject the
    i-th smallest (i = 1..m) while every p_(j), j <= i, is <= alpha / (m - j + 1); it controls the
    family-wise error rate at ``alpha``. A NaN p-value is never rejected and still counts in m.

    Args:
      pvalues: name -> p-value (here the one-sided bootstrap ``p_le_0``, so ``alpha = 0.025``
        matches a two-sided 95% interval for a single arm).

    Returns: name -> rejected (bool).
    """
    names = list(pvalues)
    p = np.asarray([pvalues[n] for n in names], np.float64)
    m = len(names)
    order = np.argsort(np.where(np.isfinite(p), p, np.inf), kind="stable")
    out = dict.fromkeys(names, False)
    for i, j in enumerate(order):
        if not (np.isfinite(p[j]) and p[j] <= alpha / (m - i)):
            break
        out[names[j]] = True
    return out


def start_stratum(rate) -> np.ndarray:
    """The `START_LABELS` index of each warm-start success ``rate`` (any shape, int, same shape):
    0 exactly -> 0; (0, 0.1] -> 1; (0.1, 0.3] -> 2; above 0.3 -> 3."""
    rate = np.asarray(rate, np.float64)
    return np.where(rate <= 0, 0, np.searchsorted(START_EDGES[1:], rate, side="left") + 1)


def gains_by_start(
    scores_m, scores_base, start_rate, *, n_boot: int = 2000, seed: int = 0, level: float = 0.95
) -> dict:
    """Relative gain of a method over a baseline within strata of the starting model's success.

    The stratum of problem i in seed s is `start_stratum` of ``start_rate[s, i]``, the share of
    that seed's warm-start samples that solved it (each seed has its own warm start, so the
    strata differ per seed). The statistic is ``sum(method) / sum(base) - 1`` over the stratum's
    (seed, problem) cells. The interval is a paired percentile bootstrap: each replicate
    resamples seeds and, independently, problems with replacement, the same draw for both
    methods (as `paired_bootstrap`).

    Args:
      scores_m, scores_base: ``[S, N]`` float per-problem scores (e.g. test pass@8).
      start_rate: ``[S, N]`` float in [0, 1], the warm start's share of correct samples.
      n_boot, seed, level: bootstrap replicates, its seed, the interval's coverage.

    Returns:
      ``{"share": {label: share of the S x N cells}, label: {"method", "base" (mean scores over
      the stratum's cells), "gain", "lo", "hi"} or None (an empty stratum)}`` over
      `START_LABELS`; ``gain`` is NaN when the stratum's baseline sums to 0.

    Raises:
      ValueError: shapes differ or are not ``[S, N]``.
    """
    a, b = np.asarray(scores_m, np.float64), np.asarray(scores_base, np.float64)
    strata = start_stratum(start_rate)
    if not (a.shape == b.shape == strata.shape) or a.ndim != 2:
        raise ValueError(f"need three [S, N] arrays; got {a.shape}, {b.shape}, {strata.shape}")
    s, n = a.shape
    rng = np.random.default_rng(seed)
    si = rng.integers(0, s, size=(n_boot, s))
    counts = np.zeros((n_boot, n))
    np.add.at(counts, (np.arange(n_boot)[:, None], rng.integers(0, n, size=(n_boot, n))), 1.0)
    cols = np.arange(n_boot)[:, None]
    q = (1 - level) / 2
    out = {"share": {}}
    for i, lab in enumerate(START_LABELS):
        mask = strata == i
        out["share"][lab] = float(mask.mean())
        if not mask.any():
            out[lab] = None
            continue
        am, bm = a * mask, b * mask  # cells outside the stratum count 0
        num = (am @ counts.T)[si, cols].sum(1)  # [n_boot]: resampled problems, then seeds
        den = (bm @ counts.T)[si, cols].sum(1)
        with np.errstate(invalid="ignore", divide="ignore"):
            reps = num / den - 1
        reps = reps[np.isfinite(reps)]
        lo, hi = np.quantile(reps, [q, 1 - q]) if reps.size else (np.nan, np.nan)
        gain = am.sum() / bm.sum() - 1 if bm.sum() > 0 else np.nan
        out[lab] = {
            "method": float(am.sum() / mask.sum()),
            "base": float(bm.sum() / mask.sum()),
            "gain": float(gain),
            "lo": float(lo),
            "hi": float(hi),
        }
    return out
