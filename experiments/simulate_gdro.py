"""Model-free simulation of the GDRO controllers at a fixed rollout budget.

No model and no data: a dataset of prompts with Bernoulli success rates drawn from a
heavy-tailed mix (many hard prompts, a middle, an easy head). Each step draws ``P`` prompts
uniformly, classifies them with the online classifier, allocates ``R = P * n_bar`` rollouts,
samples rewards, and "trains": a prompt whose group has both correct and wrong rollouts (a
non-zero GRPO signal) raises its success logit by ``lr * w * n / n_bar`` (``w`` = its Prompt-GDRO
advantage weight, ``n`` = its rollouts), so success rates rise with the rollouts a prompt
receives. The controllers get the failure rate as their loss signal (there is no surrogate loss
without a model).

Allocators compared at the same budget: ``uniform`` (GRPO), ``prompt_gdro`` (advantage weights),
``rollout_bandit`` and ``rollout_sqrt`` (Rollout-GDRO). For each step we record the weighted
standard-error proxy ``WSE = sum_b share_b sigma_b / sqrt(n_b)`` of the allocation used and of the
uniform allocation of the same batch, with the *true* ``sigma_b^2`` = mean over the bin's prompts
of ``p_i (1 - p_i)`` (the paper reports 22-37% lower WSE for Rollout-GDRO than uniform).

  python experiments/simulate_gdro.py --steps 300 --out_dir /tmp/simulate_gdro --seed 0

Writes ``<out_dir>/<allocator>_<quantity>.png`` heatmaps (step x bin: prompt share, Prompt-GDRO
weight, rollouts per prompt, mean reward), ``summary.json``, and prints a table.
Reuse from notebooks: ``simulate(allocator, steps, seed) -> dict of numpy arrays``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax.numpy as jnp
import numpy as np

from grpo_jax import cli, gdro

ALLOCATORS = ("uniform", "prompt_gdro", "rollout_bandit", "rollout_sqrt")


def initial_success_rates(num_prompts: int, rng: np.random.Generator) -> np.ndarray:
    """Heavy-tailed mix of per-prompt success rates: 50% hard (Beta(0.3, 4)), 30% middle
    (Beta(2, 2)), 20% easy (Beta(4, 0.5)); clipped to [1e-3, 1 - 1e-3]."""
    kind = rng.choice(3, size=num_prompts, p=[0.5, 0.3, 0.2])
    a = np.array([0.3, 2.0, 4.0])[kind]
    b = np.array([4.0, 2.0, 0.5])[kind]
    return np.clip(rng.beta(a, b), 1e-3, 1 - 1e-3)


def _per_bin(bins: np.ndarray, num_bins: int, weights=None) -> np.ndarray:
    """Per-bin sums of ``weights`` (counts without), [num_bins]; never-seen prompts (bin
    ``num_bins``, the classifier's unseen marker) are left out."""
    return np.bincount(bins, weights=weights, minlength=num_bins + 1)[:num_bins]


def _bin_sigma_true(p: np.ndarray, bins: np.ndarray, num_bins: int) -> np.ndarray:
    cnt = _per_bin(bins, num_bins)
    return np.sqrt(_per_bin(bins, num_bins, p * (1 - p)) / np.maximum(cnt, 1))


def simulate(
    allocator: str,
    steps: int = 300,
    seed: int = 0,
    *,
    num_prompts: int = 2000,
    prompts_per_step: int = 64,
    n_bar: int = 4,
    lr: float = 0.05,
    history: int = 50,
) -> dict[str, np.ndarray]:
    """Runs one allocator; returns per-step arrays (``T = steps``, ``B = 10`` bins).

    Returns:
      dict with ``share [T, B]`` (prompt share per bin), ``q [T, B]`` (Prompt-GDRO weights; zeros
      otherwise), ``weight [T, B]`` (mean advantage weight per bin; 1 when not Prompt-GDRO),
      ``rollouts [T, B]`` (mean rollouts per prompt per bin), ``bin_reward [T, B]`` (the three
      NaN where the bin is absent that step), ``wse [T]`` / ``wse_uniform [T]`` (true-sigma WSE of the allocation and of
      the uniform allocation), ``wse_proxy [T]`` / ``wse_proxy_uniform [T]`` (the paper's proxy:
      ``sigma_b^2 = p_hat_b (1 - p_hat_b)`` from the classifier's bin success rate, as the
      controller sees it), ``wse_pooled [T]`` / ``wse_pooled_uniform [T]`` (pooled within-group
      std of the sampled rewards), ``mu [T]``, ``mean_success [T]`` (dataset mean
      true success rate), ``hard_success [T]`` (mean over the initially hardest 25% of prompts),
      ``total_rollouts [T]``, ``unseen_share [T]`` (share of the step's prompts never visited
      before: the classifier's unseen marker, outside ``share``'s bins; 0 in paper mode).
    """
    if allocator not in ALLOCATORS:
        raise ValueError(f"allocator must be one of {ALLOCATORS}; got {allocator!r}")
    rng = np.random.default_rng(seed)
    p0 = initial_success_rates(num_prompts, rng)
    logit = np.log(p0 / (1 - p0))
    hard = np.argsort(p0)[: num_prompts // 4]
    ccfg = gdro.ClassifierConfig(history=history, delta=0.03 if allocator == "prompt_gdro" else 0.0)
    b = ccfg.num_bins
    cstate = gdro.classifier_init(ccfg, num_prompts)
    pcfg = gdro.PromptGDROConfig(signal="failure_rate")
    pstate = gdro.prompt_gdro_init(pcfg, b)
    rcfg = gdro.RolloutGDROConfig(
        allocator="sqrt" if allocator == "rollout_sqrt" else "bandit",
        n_bar=n_bar,
        signal="failure_rate",
    )
    rstate = gdro.rollout_gdro_init(rcfg, b)
    P, R = prompts_per_step, prompts_per_step * n_bar

    out = {k: np.zeros((steps, b), np.float32) for k in ("share", "q")}
    for k in ("weight", "rollouts", "bin_reward"):
        out[k] = np.full((steps, b), np.nan, np.float32)
    for k in (
        "wse",
        "wse_uniform",
        "wse_proxy",
        "wse_proxy_uniform",
        "wse_pooled",
        "wse_pooled_uniform",
        "mu",
        "mean_success",
        "hard_success",
        "total_rollouts",
        "unseen_share",
    ):
        out[k] = np.zeros((steps,), np.float32)

    for t in range(steps):
        ids = rng.choice(num_prompts, size=P, replace=False).astype(np.int32)
        jids = jnp.asarray(ids)
        bins = np.asarray(gdro.classify(ccfg, cstate, jids))
        succ = np.asarray(gdro.bin_success(ccfg, cstate, jids, bins, b))
        if allocator.startswith("rollout"):
            alloc = gdro.allocate(rcfg, rstate, bins, succ, prompt_ids=ids)
        else:
            alloc = gdro.fixed_allocation(bins, n_bar, b)
        n = np.asarray(alloc.rollouts_per_prompt)
        seg = np.asarray(alloc.segment_ids)
        rbins = bins[seg]
        if allocator == "prompt_gdro":
            q = np.asarray(gdro.prompt_gdro_q(pcfg, pstate, jnp.asarray(rbins)))
            w_roll = np.asarray(gdro.prompt_gdro_weights(pcfg, pstate, jnp.asarray(rbins)))
        else:
            q, w_roll = np.zeros(b, np.float32), np.ones(R, np.float32)

        p = 1.0 / (1.0 + np.exp(-logit[ids]))
        correct = rng.random(R) < p[seg]
        rewards = correct.astype(np.float32)
        c = np.bincount(seg, weights=correct, minlength=P)
        mixed = (c > 0) & (c < n)
        w_prompt = np.bincount(seg, weights=w_roll, minlength=P) / n
        logit[ids] += lr * w_prompt * (n / n_bar) * mixed  # rates rise with rollouts

        signal = 1.0 - rewards  # failure_rate
        if allocator == "prompt_gdro":
            pstate, _ = gdro.prompt_gdro_update(
                pcfg, pstate, jnp.asarray(rbins), jnp.asarray(signal)
            )
        if allocator.startswith("rollout"):
            rstate, rdiag = gdro.rollout_gdro_update(
                rcfg, rstate, alloc, bins, signal, rewards, bin_success=succ
            )
        else:
            rdiag = gdro.rollout_gdro_diagnostics(
                rcfg, rstate, alloc, rewards=rewards, bin_success=succ
            )
        cstate = gdro.classifier_update(
            ccfg, cstate, jids, gdro.visit_outcome(ccfg, jnp.asarray(correct), jnp.asarray(seg), P)
        )

        cnt = _per_bin(bins, b)
        sigma = _bin_sigma_true(p, bins, b)
        share = cnt / P
        mean_n = np.asarray(alloc.bin_rollouts)
        present = cnt > 0
        out["share"][t] = share
        out["q"][t] = q
        out["weight"][t] = np.where(
            present,
            _per_bin(rbins, b, w_roll) / np.maximum(_per_bin(rbins, b), 1),
            np.nan,
        )
        out["rollouts"][t] = np.where(present, mean_n, np.nan)
        out["bin_reward"][t] = rdiag["gdro/bin_reward"]
        out["wse"][t] = gdro.rollout_gdro.weighted_standard_error(n, bins, sigma)
        out["wse_uniform"][t] = gdro.rollout_gdro.weighted_standard_error(
            np.full(P, n_bar), bins, sigma
        )
        out["wse_proxy"][t] = rdiag["rollout_gdro/wse"]
        out["wse_proxy_uniform"][t] = rdiag["rollout_gdro/wse_uniform"]
        out["wse_pooled"][t] = rdiag["rollout_gdro/wse_pooled"]
        out["wse_pooled_uniform"][t] = rdiag["rollout_gdro/wse_pooled_uniform"]
        out["mu"][t] = float(np.asarray(rstate.mu))
        p_all = 1.0 / (1.0 + np.exp(-logit))
        out["mean_success"][t] = p_all.mean()
        out["hard_success"][t] = p_all[hard].mean()
        out["total_rollouts"][t] = n.sum()
        out["unseen_share"][t] = np.mean(bins == b)
    return out


def summarize(res: dict[str, np.ndarray]) -> dict[str, float]:
    """Scalar summary: WSE / uniform-WSE (ratio of the step sums) for the true sigma, the paper's
    proxy and the pooled reward std; final success rates. Steps without a WSE (NaN: no prompt of
    the step had been seen before, so none is in a bin) are left out of both sums."""

    def ratio(a, u):
        return float(np.nansum(res[a]) / max(float(np.nansum(res[u])), 1e-12))

    return {
        "wse_ratio_true": ratio("wse", "wse_uniform"),
        "wse_ratio_proxy": ratio("wse_proxy", "wse_proxy_uniform"),
        "wse_ratio_pooled": ratio("wse_pooled", "wse_pooled_uniform"),
        "final_mean_success": float(res["mean_success"][-1]),
        "final_hard_success": float(res["hard_success"][-1]),
        "rollouts_per_step": float(res["total_rollouts"].mean()),
        "final_mu": float(res["mu"][-1]),
    }


def heatmap(arr: np.ndarray, title: str, path: str) -> None:
    """Step x bin heatmap (bins on the y axis, 0 = hardest at the bottom) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.2))
    im = ax.imshow(
        np.asarray(arr, np.float32).T,
        aspect="auto",
        origin="lower",
        interpolation="nearest",
        cmap="viridis",
    )
    ax.set_xlabel("step")
    ax.set_ylabel("bin (0 = hardest)")
    ax.set_title(title)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


QUANTITIES = {
    "share": "prompt share",
    "weight": "mean advantage weight",
    "rollouts": "rollouts per prompt",
    "bin_reward": "mean reward",
}


def run(
    steps: int, out_dir: str, seed: int, allocators: Sequence[str] = ALLOCATORS, **kwargs
) -> dict[str, dict[str, float]]:
    """Simulates every allocator, writes heatmaps and summary.json, returns the summaries."""
    os.makedirs(out_dir, exist_ok=True)
    summaries = {}
    for name in allocators:
        t0 = time.perf_counter()
        res = simulate(name, steps, seed, **kwargs)
        summaries[name] = summarize(res) | {"seconds": time.perf_counter() - t0}
        for key, label in QUANTITIES.items():
            if key == "weight" and name != "prompt_gdro":
                continue
            if key == "rollouts" and not name.startswith("rollout"):
                continue
            heatmap(res[key], f"{name}: {label}", os.path.join(out_dir, f"{name}_{key}.png"))
        np.savez_compressed(os.path.join(out_dir, f"{name}.npz"), **res)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump({"steps": steps, "seed": seed, "summaries": summaries}, f, indent=2)
    return summaries


@cli.entry_point
def main(argv=None):
    ap = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=cli.positive_int, default=300)
    ap.add_argument("--out_dir", default="/tmp/simulate_gdro")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--allocators", default=",".join(ALLOCATORS))
    ap.add_argument("--prompts_per_step", type=cli.positive_int, default=64)
    ap.add_argument("--num_prompts", type=cli.positive_int, default=2000)
    args = ap.parse_args(argv)
    unknown = [a for a in args.allocators.split(",") if a not in ALLOCATORS]
    if unknown:
        raise cli.UsageError(
            f"--allocators: unknown {unknown}; choose from {', '.join(ALLOCATORS)}"
        )
    summaries = run(
        args.steps,
        args.out_dir,
        args.seed,
        args.allocators.split(","),
        prompts_per_step=args.prompts_per_step,
        num_prompts=args.num_prompts,
    )
    print(
        "WSE of each allocator / WSE of the uniform allocation of the same batches "
        "(true sigma | paper's proxy from the classifier | pooled reward std)"
    )
    print(
        f"{'allocator':16s} {'true':>6s} {'proxy':>6s} {'pooled':>6s} {'mean p':>7s} "
        f"{'hard p':>7s} {'R/step':>7s} {'mu':>7s} {'s':>5s}"
    )
    for name, s in summaries.items():
        print(
            f"{name:16s} {s['wse_ratio_true']:6.3f} {s['wse_ratio_proxy']:6.3f} "
            f"{s['wse_ratio_pooled']:6.3f} "
            f"{s['final_mean_success']:7.3f} {s['final_hard_success']:7.3f} "
            f"{s['rollouts_per_step']:7.0f} {s['final_mu']:7.3f} {s['seconds']:5.1f}"
        )
    print(f"heatmaps and summary.json in {args.out_dir}")


if __name__ == "__main__":
    main()
