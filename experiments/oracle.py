"""Oracle pre-check of a testbed: is there a frontier, and how much could allocation gain?

  python -m experiments.oracle --config=configs/arithmetic.py:grpo,frontier --out=reports
  python -m experiments.oracle --config=configs/arithmetic.py:grpo,frontier,smoke --out=/tmp/o \\
      --num_samples=8 --max_prompts=64 --sim_steps=5          # toy size (tests)

1. Warm start (`warm_start`): the config's supervised warm start, on the separate SFT pool when
   ``data.arithmetic.num_sft > 0`` (an experiment built with ``train_pool="sft"``), so the RL
   pool is never seen in SFT.
2. True success (`estimate_success`): ``--num_samples`` (64) completions per RL prompt at the
   training sampling settings (``config.rollout``: temperature, top-k/p); ``p_i`` = fraction
   correct. Reported: share of prompts with ``p_i`` in ``[0.02, 0.5]`` (the frontier; the
   testbed needs >= 40%), a histogram, per-difficulty means.
3. Simulation (`simulate`) with these ``p_i`` as the truth: each step draws ``P`` prompts
   uniformly without replacement, Bernoulli rewards; budget ``R = P * n_bar`` rollouts per step
   for every method:

   - ``uniform``: ``n_bar`` each (GRPO).
   - ``prompt_gdro``: ``n_bar`` each, advantages weighted by `grpo_jax.gdro` Prompt-GDRO
     (corrected mode, failure-rate signal, online corrected classifier): the same informative
     groups as uniform, reported as *effective* informative groups (Kish ESS of the informative
     groups' weights).
   - ``sqrt``: `grpo_jax.gdro.allocate` with ``allocator="sqrt"``, from the online corrected
     classifier's bins and ``bin_success`` (per-sample success over the last ``H`` visits;
     unseen prompts get ``n_bar``): exact budget ``R``.
   - ``oracle``: `oracle_allocation` on the true ``p_i`` (maximises expected informative groups
     under the same ``R``; an upper bound no controller reaches).

   Per step: expected informative groups ``sum_i 1 - p_i^n_i - (1-p_i)^n_i`` (`informative_prob`)
   and the true weighted standard error `true_wse`. Oracle gain = mean oracle informative groups
   per step / uniform's - 1 (the testbed needs >= 25%).

Writes ``--out/oracle.md`` (numbers, commands, machine, wall time), ``--out/oracle.json`` and
``--out/oracle/*.png`` (histogram of ``p_i``, per-step curves).

Library: `informative_prob`, `oracle_allocation`, `true_wse`, `kish_ess`, `simulate`,
`warm_start`, `estimate_success`, `run_oracle`.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence

import numpy as np

from grpo_jax import cli

FRONTIER = (0.02, 0.5)  # per-sample success band counted as the frontier
EASY = 0.7  # per-sample success from which a prompt counts as easy (the paper-shaped pool)
METHODS = ("uniform", "prompt_gdro", "sqrt", "oracle")


# ----------------------------------------------------------------------------- closed forms


def informative_prob(p, n):
    """Probability that a group of ``n`` Bernoulli(``p``) rewards is not all equal:
    ``1 - p^n - (1-p)^n`` (float64, broadcast over ``p`` [...] and ``n`` [...]; 0 for n <= 1)."""
    p = np.asarray(p, np.float64)
    n = np.asarray(n, np.float64)
    return np.where(n >= 2, 1.0 - p**n - (1.0 - p) ** n, 0.0)


def oracle_allocation(p, total: int, n_min: int, n_max: int) -> np.ndarray:
    """Rollouts per prompt maximising expected informative groups under an exact budget.

    ``max sum_i f_i(n_i)``, ``f_i(n) = 1 - p_i^n - (1-p_i)^n``, s.t. ``sum_i n_i = total``,
    ``n_min <= n_i <= n_max``. ``f_i`` is concave in ``n`` (``p^n + (1-p)^n`` is a sum of convex
    functions), so greedy marginal gains from ``n_min`` are optimal. Ties go to the lower index.

    Args:
      p: [P] true per-sample success rates in [0, 1]. total: budget R in [P n_min, P n_max].
    Returns:
      [P] int64 rollout counts summing to ``total``.
    Raises:
      ValueError: infeasible budget.
    """
    p = np.asarray(p, np.float64)
    num = p.size
    if not num * n_min <= total <= num * n_max:
        raise ValueError(f"total {total} outside [{num * n_min}, {num * n_max}] for P={num}")
    n = np.full(num, n_min, np.int64)
    # marginal gain of rollout k (k = n_min+1..n_max) for every prompt; a concave f makes each
    # row non-increasing, so taking the largest gains overall is the greedy choice
    k = np.arange(n_min + 1, n_max + 1)
    gains = informative_prob(p[:, None], k[None]) - informative_prob(p[:, None], k[None] - 1)
    extra = total - num * n_min
    if extra:
        flat = -gains.ravel()
        order = np.lexsort(
            (np.tile(np.arange(k.size), num), np.repeat(np.arange(num), k.size), flat)
        )
        np.add.at(n, order[:extra] // k.size, 1)
    return n


def true_wse(p, n, weights=None) -> float:
    """True weighted standard error of a step's allocation (spec s.4 and s.7): the per-prompt
    `grpo_jax.metrics.weighted_standard_error` from the *true* ``p_i`` (estimated from many
    samples, not from the allocator's own proxy: spec s.7), ``mean_i w_i sqrt(p_i (1 - p_i)) /
    sqrt(n_i)`` over the step's prompts (``weights`` [P]: e.g. Prompt-GDRO's per-prompt weights).

    Args: p [P] float, n [P] int (>= 1), weights optional [P] float >= 0.
    Returns: float (NaN when the weights sum to 0).
    """
    from grpo_jax.metrics import weighted_standard_error

    if weights is not None and not np.sum(weights) > 0:
        return float("nan")
    return weighted_standard_error(n, p, weights)


def kish_ess(weights) -> float:
    """Kish effective sample size ``(sum w)^2 / sum w^2`` of non-negative weights (0 if none)."""
    w = np.asarray(weights, np.float64)
    s2 = float((w**2).sum())
    return float(w.sum() ** 2 / s2) if s2 > 0 else 0.0


# ----------------------------------------------------------------------------- simulation


def simulate(
    p,
    *,
    prompts_per_step: int,
    n_bar: int,
    steps: int,
    seed: int = 0,
    n_min: int = 2,
    n_max: int = 12,
    classifier: dict | None = None,
    prompt: dict | None = None,
    rollout: dict | None = None,
) -> dict:
    """Per-step informative groups and true WSE of the four allocations (module docstring).

    Args:
      p: [N] true per-sample success of every pool prompt (prompt id = index).
      prompts_per_step: P (distinct prompts drawn uniformly per step); n_bar: mean group size.
      steps: simulated steps; seed: numpy seed of the draws and Bernoulli rewards.
      n_min, n_max: group-size bounds of the sqrt and oracle allocations.
      classifier, prompt, rollout: extra fields of the `grpo_jax.gdro` configs (corrected mode).
    Returns:
      ``{method: {"informative": [steps] expected informative groups, "effective": [steps]
      (Prompt-GDRO: Kish ESS of its weights over the realised informative groups; others: the
      realised informative groups), "wse": [steps], "uniform_wse": [steps]}}`` plus
      ``"frontier_share_drawn"`` [steps] (share of drawn prompts in the frontier band).
    """
    import jax
    import jax.numpy as jnp

    from grpo_jax import gdro

    p = np.asarray(p, np.float64)
    N, P, R = p.size, prompts_per_step, prompts_per_step * n_bar
    # the curricula's own hysteresis: 0.03 for Prompt-GDRO, 0 for Rollout-GDRO (spec s.1)
    ccfgs = {
        m: gdro.ClassifierConfig(**{"delta": d, **(classifier or {})})
        for m, d in (("prompt_gdro", 0.03), ("sqrt", 0.0))
    }
    ccfg = ccfgs["sqrt"]
    pcfg = gdro.PromptGDROConfig(**(prompt or {}))
    rcfg = gdro.RolloutGDROConfig(
        **{"allocator": "sqrt", "n_min": n_min, "n_max": n_max, "n_bar": n_bar, **(rollout or {})}
    )
    B = len(ccfg.edges) + 1
    # one online classifier per method that feeds back (sqrt, prompt_gdro): their visits differ
    cstate = {m: gdro.classifier_init(c, N) for m, c in ccfgs.items()}
    pstate = gdro.prompt_gdro_init(pcfg, B)
    rstate = gdro.rollout_gdro_init(rcfg, B)
    rng = np.random.default_rng(seed)
    out = {m: {"informative": [], "effective": [], "wse": []} for m in METHODS}
    drawn_frontier = []

    def rewards_for(pi, counts):
        seg = np.repeat(np.arange(P), counts)
        return seg, rng.random(seg.size) < pi[seg]

    def informative_groups(seg, correct):
        hits = np.bincount(seg, weights=correct, minlength=P)
        sizes = np.bincount(seg, minlength=P)
        return (hits > 0) & (hits < sizes)

    for _ in range(steps):
        ids = np.sort(rng.choice(N, size=P, replace=False))
        pi = p[ids]
        drawn_frontier.append(float(np.mean((pi >= FRONTIER[0]) & (pi <= FRONTIER[1]))))
        jids = jnp.asarray(ids, jnp.int32)

        # uniform
        n_u = np.full(P, n_bar)
        seg, correct = rewards_for(pi, n_u)
        out["uniform"]["informative"].append(float(informative_prob(pi, n_u).sum()))
        out["uniform"]["effective"].append(float(informative_groups(seg, correct).sum()))
        out["uniform"]["wse"].append(true_wse(pi, n_u))

        # Prompt-GDRO: uniform groups, weighted advantages
        pc = ccfgs["prompt_gdro"]
        bins = gdro.classify(pc, cstate["prompt_gdro"], jids)
        seg, correct = rewards_for(pi, n_u)
        info = informative_groups(seg, correct)
        rbins = jnp.asarray(np.asarray(bins)[seg])
        adv = jnp.asarray(np.where(info[seg], 1.0, 0.0), jnp.float32)  # only non-zero-ness is read
        w = np.asarray(gdro.prompt_gdro_weights(pcfg, pstate, rbins, advantages=adv))
        wp = np.bincount(seg, weights=w, minlength=P) / n_bar  # per-prompt weight
        signal = gdro.loss_signal(pcfg, correct=jnp.asarray(correct))
        rewards = jnp.asarray(np.where(correct, 1.0, -1.0), jnp.float32)
        pstate, _ = gdro.prompt_gdro_update(
            pcfg, pstate, rbins, signal, rewards=rewards, advantages=adv
        )
        cstate["prompt_gdro"] = gdro.classifier_update(
            pc,
            cstate["prompt_gdro"],
            jids,
            gdro.visit_outcome(pc, jnp.asarray(correct), jnp.asarray(seg), P),
        )
        out["prompt_gdro"]["informative"].append(float(informative_prob(pi, n_u).sum()))
        out["prompt_gdro"]["effective"].append(kish_ess(wp[info]))
        out["prompt_gdro"]["wse"].append(true_wse(pi, n_u, weights=wp))

        # sqrt rule from the online classifier
        bins = gdro.classify(ccfg, cstate["sqrt"], jids)
        success = gdro.bin_success(ccfg, cstate["sqrt"], jids, bins, B)
        alloc = gdro.allocate(rcfg, rstate, np.asarray(bins), success, prompt_ids=ids)
        n_s = np.asarray(alloc.rollouts_per_prompt)
        assert n_s.sum() == R
        seg, correct = rewards_for(pi, n_s)
        cstate["sqrt"] = gdro.classifier_update(
            ccfg,
            cstate["sqrt"],
            jids,
            gdro.visit_outcome(ccfg, jnp.asarray(correct), jnp.asarray(seg), P),
        )
        out["sqrt"]["informative"].append(float(informative_prob(pi, n_s).sum()))
        out["sqrt"]["effective"].append(float(informative_groups(seg, correct).sum()))
        out["sqrt"]["wse"].append(true_wse(pi, n_s))

        # oracle
        n_o = oracle_allocation(pi, R, n_min, n_max)
        seg, correct = rewards_for(pi, n_o)
        out["oracle"]["informative"].append(float(informative_prob(pi, n_o).sum()))
        out["oracle"]["effective"].append(float(informative_groups(seg, correct).sum()))
        out["oracle"]["wse"].append(true_wse(pi, n_o))
    del jax
    res = {m: {k: np.asarray(v) for k, v in d.items()} for m, d in out.items()}
    res["frontier_share_drawn"] = np.asarray(drawn_frontier)
    return res


def summarise(sim: dict) -> dict:
    """Means over steps of `simulate`'s output and the gains over uniform."""
    u = sim["uniform"]
    s = {}
    for m in METHODS:
        d = sim[m]
        s[m] = {
            "informative": float(d["informative"].mean()),
            "effective": float(d["effective"].mean()),
            "wse": float(d["wse"].mean()),
            "informative_gain": float(
                d["informative"].mean() / max(u["informative"].mean(), 1e-12) - 1
            ),
            "wse_ratio": float(d["wse"].mean() / max(u["wse"].mean(), 1e-12)),
        }
    s["oracle_gain"] = s["oracle"]["informative_gain"]
    return s


# ----------------------------------------------------------------------------- model side


def warm_start(config):
    """The config's supervised warm start: (params, sft metrics).

    On the separate SFT pool when ``config.data.arithmetic.num_sft > 0`` (an experiment built with
    ``train_pool="sft"``: the RL pool is never seen), else on the training pool
    (`grpo_jax.steps.init_run`). Start RL with ``steps.init_run(exp, params=params)``.
    """
    from grpo_jax import experiment, steps

    cfg = copy.deepcopy(config)
    arith = cfg.data.get("arithmetic", {})
    if cfg.data.name == "arithmetic" and arith.get("num_sft", 0) > 0:
        with cfg.unlocked():
            cfg.data.arithmetic.train_pool = "sft"
    exp = experiment.build_experiment(cfg)
    try:
        run, sft = steps.init_run(exp)
        return run.train.params, sft
    finally:
        exp.close()


def estimate_success(exp, params, num_samples: int, seed: int = 0, batch_size: int = 1024):
    """Per-sample success of every training-pool prompt of ``exp`` under its training sampling.

    Args:
      exp: built experiment; params: policy parameters; num_samples: completions per prompt.
      seed: sampling key; batch_size: rollouts per sampler call (rounded to whole prompts).
    Returns:
      [N] float64 fraction of the ``num_samples`` completions that are correct.
    """
    import jax

    from grpo_jax import steps
    from grpo_jax import transfer as xfer

    fns = steps.make_steps(exp)
    N = len(exp.pool.examples)
    per = max(1, batch_size // num_samples)  # prompts per call (fixed shape: one compile)
    hits = np.zeros(N)
    key = jax.random.PRNGKey(seed)
    with exp.mesh_context():
        for start in range(0, N, per):
            ids = np.arange(start, start + per) % N  # the last call wraps (same shape)
            rows = np.repeat(ids, num_samples)
            key, k = jax.random.split(key)
            ro = fns.generate(
                params,
                xfer.to_device(exp.mesh, exp.pool.tokens[rows]),
                xfer.to_device(exp.mesh, exp.pool.mask[rows]),
                k,
            )
            comp, lengths = xfer.to_host((ro.completion_tokens, ro.lengths))
            texts = xfer.decode_completions(exp.tokenizer, comp, lengths)
            verifier = getattr(exp.reward_fn, "verifier", exp.reward_fn)  # correctness only
            _, correct, _ = verifier(texts, [exp.pool.golds[r] for r in rows])
            c = np.asarray(correct, np.float64).reshape(per, num_samples).sum(1)
            valid = np.arange(start, start + per) < N
            hits[ids[valid]] = c[valid]
    return hits / num_samples


# ----------------------------------------------------------------------------- pre-checked subset


class SubsetError(ValueError):
    """The pool cannot give the subset asked for (`select_subset`)."""


def select_subset(
    p: np.ndarray, num_train: int, num_eval: int, frontier_share: float = 0.5, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Row indices of a testbed drawn from a pool with oracle success rates ``p``.

    ``k = min(round(frontier_share * n), #frontier)`` of the ``n = num_train + num_eval`` rows
    come from the frontier (``p`` in `FRONTIER`), the other ``n - k`` uniformly from the rest
    (keeping the pool's own mix of unsolved and solved prompts); the frontier rows are split
    between train and eval in proportion, so both halves have the same share. Seeded.

    Args:
      p: [N] float per-sample success per pool row; num_train, num_eval: rows wanted (>= 0).
      frontier_share: wanted share of frontier rows in [0, 1].
    Returns:
      (train [num_train] int64, eval [num_eval] int64) disjoint row indices, each sorted.
    Raises:
      SubsetError: (a ValueError) more rows wanted than the pool holds (after the frontier is
        used up), a negative size or a share outside [0, 1].
    """
    p = np.asarray(p, np.float64)
    n = int(num_train) + int(num_eval)
    if not 0.0 <= frontier_share <= 1.0 or min(num_train, num_eval) < 0:
        raise SubsetError(
            f"subset: want rows >= 0 and a frontier share in [0, 1], got {num_train} + "
            f"{num_eval} rows at {frontier_share}"
        )
    inside = np.flatnonzero((p >= FRONTIER[0]) & (p <= FRONTIER[1]))
    outside = np.flatnonzero(~((p >= FRONTIER[0]) & (p <= FRONTIER[1])))
    k = min(int(round(frontier_share * n)), inside.size)
    if n - k > outside.size:
        raise SubsetError(
            f"subset: the pool has {p.size} rows ({inside.size} in the frontier): too few for "
            f"{num_train} + {num_eval} rows at frontier share {frontier_share}"
        )
    rng = np.random.default_rng(seed)
    f = rng.permutation(inside)[:k]
    o = rng.permutation(outside)[: n - k]
    kf = int(round(k * num_eval / n)) if n else 0
    ev = np.concatenate([f[:kf], o[: num_eval - kf]])
    tr = np.concatenate([f[kf:], o[num_eval - kf :]])
    return np.sort(tr), np.sort(ev)


def write_subset(
    examples: Sequence[dict],
    p: np.ndarray,
    out_dir: str,
    num_train: int,
    num_eval: int,
    frontier_share: float = 0.5,
    seed: int = 0,
) -> dict:
    """Writes ``out_dir/train.jsonl`` and ``out_dir/test.jsonl`` (the directory layout that
    ``data.path`` reads: split "train", ``data.eval_split`` "test"): the `select_subset` rows
    of ``examples`` (every field kept) with ``oracle_p`` (the row's estimated success) and
    ``oracle_stratum`` (0: p = 0, 1: below the frontier, 2: frontier, 3: above, 4: p = 1)
    added. Read back with ``data.name = "custom"``, ``data.path = out_dir`` (docs/byo.md);
    ``data.level_column = "oracle_stratum"`` reports per stratum. Files are written
    atomically. Returns {"train": n, "eval": n, "frontier_share": realised share}."""
    tr, ev = select_subset(p, num_train, num_eval, frontier_share, seed)
    p = np.asarray(p, np.float64)
    stratum = np.select([p == 0, p < FRONTIER[0], p <= FRONTIER[1], p < 1], [0, 1, 2, 3], default=4)
    os.makedirs(out_dir, exist_ok=True)
    for name, idx in (("train", tr), ("test", ev)):
        path = os.path.join(out_dir, f"{name}.jsonl")
        with open(path + ".tmp", "w") as f:
            for i in idx:
                row = {k: v for k, v in dict(examples[i]).items() if not k.startswith("_")}
                row.update(oracle_p=float(p[i]), oracle_stratum=int(stratum[i]))
                f.write(json.dumps(row, default=_json_default) + "\n")
        os.replace(path + ".tmp", path)
    both = np.concatenate([tr, ev])
    return {
        "train": int(tr.size),
        "eval": int(ev.size),
        "frontier_share": float(np.mean(stratum[both] == 2)) if both.size else 0.0,
    }


def _json_default(x):
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"not JSON-serialisable: {type(x).__name__}")


# ----------------------------------------------------------------------------- report


def _machine() -> dict:
    import jax

    def sh(cmd):
        try:
            return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()
        except OSError:
            return ""

    return {
        "nproc": sh("nproc"),
        "cpu": sh("lscpu | grep 'Model name'").replace("Model name:", "").strip(),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "backend": jax.default_backend(),
    }


def _plots(out_dir: str, p: np.ndarray, levels: np.ndarray, sim: dict) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(1, 2, figsize=(11, 3.8))
    ax[0].hist(p, bins=np.linspace(0, 1, 33), color="tab:blue", edgecolor="white")
    for x in FRONTIER:
        ax[0].axvline(x, color="tab:red", ls="--", lw=1)
    inside = np.mean((p >= FRONTIER[0]) & (p <= FRONTIER[1]))
    ax[0].set(
        xlabel="per-sample success p_i (warm start)",
        ylabel="RL prompts",
        title=f"{inside:.0%} of {p.size} prompts in [{FRONTIER[0]}, {FRONTIER[1]}]",
    )
    lv = np.unique(levels)
    ax[1].boxplot([p[levels == x] for x in lv], tick_labels=[str(x) for x in lv])
    ax[1].set(xlabel="difficulty d", ylabel="p_i", title="success by difficulty")
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "success_hist.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(1, 2, figsize=(11, 3.8))
    for m in METHODS:
        ax[0].plot(sim[m]["informative"], label=m)
        ax[1].plot(sim[m]["wse"], label=m)
    ax[0].set(xlabel="simulated step", ylabel="expected informative groups")
    ax[1].set(xlabel="simulated step", ylabel="true WSE")
    ax[0].legend()
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "simulation.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def _report(res: dict, out: str) -> str:
    s, cfg, m = res["summary"], res["setup"], res["machine"]
    L = [
        "# Oracle pre-check of the frontier testbed",
        "",
        f"Command: `{res['command']}`",
        "",
        f"Machine: {m['nproc']} CPU cores ({m['cpu']}), jax {m['jax']} ({m['backend']}), "
        f"Python {m['python']}. Wall time {res['timing']['total_s']:.0f} s (warm start "
        f"{res['timing']['warm_start_s']:.0f} s, success estimate "
        f"{res['timing']['estimate_s']:.0f} s, simulation {res['timing']['simulate_s']:.0f} s).",
        "",
        "## Setup",
        "",
        f"- Config `{cfg['config']}`: {cfg['num_prompts']} RL prompts, difficulties "
        f"{cfg['levels']}, P = {cfg['P']} prompts x n_bar = {cfg['n_bar']} "
        f"(R = {cfg['P'] * cfg['n_bar']}) per step, {cfg['steps']} RL steps -> every prompt "
        f"drawn {cfg['P'] * cfg['steps'] / cfg['num_prompts']:.1f} times; warm start "
        f"{cfg['sft_steps']} SFT steps on {cfg['sft_pool']}.",
        f"- True success p_i: {cfg['num_samples']} samples per RL prompt at the training sampling "
        f"(temperature {cfg['temperature']}).",
        f"- Simulation: {cfg['sim_steps']} steps, P prompts drawn uniformly per step, "
        f"Bernoulli(p_i) rewards, n in [{cfg['n_min']}, {cfg['n_max']}], exact budget R.",
        "",
        "## Frontier",
        "",
        f"**{res['frontier_share']:.1%}** of RL prompts have p_i in [{FRONTIER[0]}, "
        f"{FRONTIER[1]}] (needed >= 40%). p = 0: {res['share_zero']:.1%}, p = 1: "
        f"{res['share_one']:.1%}, mean p {res['mean_p']:.3f}; easy (p >= {EASY}): "
        f"{res.get('share_easy', float('nan')):.1%}, hard (p < {FRONTIER[0]}): "
        f"{res.get('share_hard', float('nan')):.1%}.",
        "",
        "| d | prompts | mean p | share in frontier | share p=0 | share p=1 |",
        "|---|---|---|---|---|---|",
    ]
    for row in res["per_level"]:
        L.append(
            f"| {row['level']} | {row['count']} | {row['mean_p']:.3f} | {row['frontier']:.1%} "
            f"| {row['zero']:.1%} | {row['one']:.1%} |"
        )
    L += [
        "",
        "![histogram](oracle/success_hist.png)",
        "",
        "## Simulated allocations (means over steps)",
        "",
        "Informative = expected groups with unequal rewards, sum_i 1 - p_i^n_i - (1-p_i)^n_i. "
        "Effective = realised informative groups (Prompt-GDRO: Kish ESS of its weights over "
        "them). WSE = mean_i w_i sqrt(p_i (1 - p_i)) / sqrt(n_i) per prompt from the true p "
        "(`true_wse`, `grpo_jax.metrics.weighted_standard_error`).",
        "",
        "| method | informative / step | vs uniform | effective / step | true WSE | WSE / uniform |",
        "|---|---|---|---|---|---|",
    ]
    for name in METHODS:
        d = s[name]
        L.append(
            f"| {name} | {d['informative']:.2f} | {d['informative_gain']:+.1%} | "
            f"{d['effective']:.2f} | {d['wse']:.4f} | {d['wse_ratio']:.3f} |"
        )
    L += [
        "",
        f"**Oracle gain: {s['oracle_gain']:+.1%}** informative groups per step over uniform "
        "(needed >= 25%).",
        "",
        "![simulation](oracle/simulation.png)",
        "",
    ]
    if res.get("subset"):
        sub = res["subset"]
        L += [
            "## Pre-checked subset",
            "",
            f"`{sub['path']}`: {sub['train']} training + {sub['eval']} held-out rows, "
            f"{sub['frontier_share']:.1%} in the frontier (`select_subset`; read with "
            f"`data.name=custom`, `data.path={sub['path']}`).",
            "",
        ]
    if res.get("tries"):
        L += ["## Tuning tries", ""] + [f"- {t}" for t in res["tries"]] + [""]
    text = "\n".join(L)
    with open(os.path.join(out, "oracle.md"), "w") as f:
        f.write(text)
    return text


def run_oracle(
    config,
    out: str,
    *,
    num_samples: int = 64,
    max_prompts: int = 0,
    sim_steps: int = 0,
    seed: int = 0,
    command: str = "",
    tries: Sequence[str] = (),
    subset: dict | None = None,
) -> dict:
    """Warm start, true success, simulation, report. Returns the result dict (also
    ``out/oracle.json``). ``subset``: keyword arguments of `write_subset` (``out_dir``,
    ``num_train``, ``num_eval``, ``frontier_share``) to also write a pre-checked testbed."""
    from grpo_jax import experiment

    t0 = time.perf_counter()
    params, sft = warm_start(config)
    t1 = time.perf_counter()
    cfg = copy.deepcopy(config)
    if max_prompts:
        with cfg.unlocked():
            cfg.data.max_train_examples = max_prompts
    exp = experiment.build_experiment(cfg)
    try:
        p = estimate_success(exp, params, num_samples, seed=seed)
        levels = np.asarray(exp.pool.levels)
        examples = list(exp.pool.examples)
    finally:
        exp.close()
    t2 = time.perf_counter()
    P, n_bar = config.rollout.prompts_per_step, config.rollout.rollouts_per_prompt
    P = min(P, p.size)
    g = config.gdro
    sim = simulate(
        p,
        prompts_per_step=P,
        n_bar=n_bar,
        steps=sim_steps or config.steps,
        seed=seed,
        n_min=g.rollout.n_min,
        n_max=g.rollout.n_max,
        classifier={"edges": tuple(g.classifier.edges), "history": g.classifier.history},
        rollout={"v_floor": g.rollout.v_floor},
    )
    t3 = time.perf_counter()
    arith = config.data.get("arithmetic", {})
    inside = (p >= FRONTIER[0]) & (p <= FRONTIER[1])
    res = {
        "command": command,
        "setup": {
            "config": command.split("--config=")[-1].split()[0] if "--config=" in command else "",
            "num_prompts": int(p.size),
            "levels": sorted({int(x) for x in levels}),
            "P": P,
            "n_bar": n_bar,
            "steps": config.steps,
            "sim_steps": sim_steps or config.steps,
            "num_samples": num_samples,
            "temperature": config.rollout.temperature,
            "n_min": g.rollout.n_min,
            "n_max": g.rollout.n_max,
            "sft_steps": config.sft.steps,
            "sft_pool": (
                f"the separate SFT pool ({arith.get('num_sft')} problems, disjoint from RL)"
                if arith.get("num_sft", 0)
                else "the RL pool"
            ),
        },
        "sft": sft,
        "frontier_share": float(inside.mean()),
        "share_zero": float(np.mean(p == 0)),
        "share_one": float(np.mean(p == 1)),
        "share_easy": float(np.mean(p >= EASY)),
        "share_hard": float(np.mean(p < FRONTIER[0])),
        "mean_p": float(p.mean()),
        "per_level": [
            {
                "level": int(x),
                "count": int((levels == x).sum()),
                "mean_p": float(p[levels == x].mean()),
                "frontier": float(inside[levels == x].mean()),
                "zero": float(np.mean(p[levels == x] == 0)),
                "one": float(np.mean(p[levels == x] == 1)),
            }
            for x in np.unique(levels)
        ],
        "summary": summarise(sim),
        "p": p.tolist(),
        "levels_per_prompt": levels.tolist(),
        "machine": _machine(),
        "tries": list(tries),
        "subset": None,
    }
    os.makedirs(out, exist_ok=True)
    _plots(os.path.join(out, "oracle"), p, levels, sim)
    res["timing"] = {
        "warm_start_s": t1 - t0,
        "estimate_s": t2 - t1,
        "simulate_s": t3 - t2,
        "total_s": time.perf_counter() - t0,
    }
    _report(res, out)
    with open(os.path.join(out, "oracle.json"), "w") as f:
        json.dump(res, f, indent=1)
    if subset:  # after oracle.json: a bad size loses no estimate
        res["subset"] = {
            **write_subset(examples, p, seed=seed, **subset),
            "path": subset["out_dir"],
        }
        _report(res, out)
        with open(os.path.join(out, "oracle.json"), "w") as f:
            json.dump(res, f, indent=1)
    return res


@cli.entry_point
def main(argv: Sequence[str] | None = None) -> dict:
    ap = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/arithmetic.py:grpo,frontier")
    ap.add_argument("--out", default="reports")
    ap.add_argument("--num_samples", type=int, default=64, help="samples per RL prompt")
    ap.add_argument("--max_prompts", type=int, default=0, help="first N RL prompts (0 = all)")
    ap.add_argument("--sim_steps", type=int, default=0, help="simulated steps (0 = config.steps)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tries", action="append", default=[], help="tuning notes for the report")
    ap.add_argument("--set", action="append", default=[], help="config override key=value")
    ap.add_argument("--subset_out", default="", help="write a pre-checked testbed to this dir")
    ap.add_argument("--subset_train", type=int, default=0, help="its training rows")
    ap.add_argument("--subset_eval", type=int, default=0, help="its held-out rows")
    ap.add_argument("--subset_frontier_share", type=float, default=0.5, help="frontier share")
    args = ap.parse_args(argv)
    from ml_collections.config_flags import config_flags as cf

    path, _, arg = args.config.partition(":")
    try:
        module = cf._LoadConfigModule("config", path)
    except OSError:
        raise cli.UsageError(
            f"--config={args.config}: cannot load {path} (no such file?)"
        ) from None
    config = module.get_config(*([arg] if arg else []))
    for kv in args.set:
        key, _, value = kv.partition("=")
        node = config
        *parents, leaf = key.split(".")
        try:
            for k in parents:
                node = node[k]
            old = node[leaf]
        except (KeyError, AttributeError):
            raise cli.UsageError(f"--set {kv}: no config key {key}") from None
        node[leaf] = type(old)(json.loads(value)) if old is not None else json.loads(value)
    given = sys.argv[1:] if argv is None else list(argv)
    command = "python -m experiments.oracle " + " ".join(
        a for a in given if not a.startswith("--tries")
    )
    if args.subset_out:  # the cheap checks before the expensive estimate
        select_subset(np.zeros(0), 0, 0, args.subset_frontier_share)
        if args.subset_train < 0 or args.subset_eval < 0 or not args.subset_train:
            raise SubsetError("subset: --subset_train must be > 0 and --subset_eval >= 0")
    try:
        res = run_oracle(
            config,
            args.out,
            num_samples=args.num_samples,
            max_prompts=args.max_prompts,
            sim_steps=args.sim_steps,
            seed=args.seed,
            command=command,
            tries=args.tries,
            subset=dict(
                out_dir=args.subset_out,
                num_train=args.subset_train,
                num_eval=args.subset_eval,
                frontier_share=args.subset_frontier_share,
            )
            if args.subset_out
            else None,
        )
    except SubsetError as e:  # oracle.json / oracle.md are written by then
        raise SubsetError(f"{e} (the estimate is kept in {args.out}/oracle.json)") from None
    s = res["summary"]
    if res.get("subset"):
        sub = res["subset"]
        print(f"subset: {sub['train']} + {sub['eval']} rows -> {sub['path']}")
    print(
        f"frontier share {res['frontier_share']:.1%} (>= 40% needed); oracle gain "
        f"{s['oracle_gain']:+.1%} (>= 25% needed); sqrt {s['sqrt']['informative_gain']:+.1%}; "
        f"wall {res['timing']['total_s']:.0f} s -> {os.path.join(args.out, 'oracle.md')}"
    )
    return res


if __name__ == "__main__":
    main()
