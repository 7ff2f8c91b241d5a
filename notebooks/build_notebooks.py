"""Regenerates the notebooks in this folder (stored without outputs).

  python notebooks/build_notebooks.py

Each notebook is written from the cell sources below with nbformat: no outputs, no execution
counts. tests/test_notebooks.py executes them top to bottom.
"""

from __future__ import annotations

import os
import textwrap

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = os.path.dirname(os.path.abspath(__file__))

# Placeholder: the GitHub organisation (or user) that hosts the repository.
REPO_URL = "https://github.com/YOUR_ORG/grpo_jax"

INSTALL_MD = f"""\
**Setup.** In Colab the next cell installs the package from the repository,
`{REPO_URL}`. `YOUR_ORG` is a placeholder: replace it with the organisation or user that
hosts your copy. Locally it finds the repository root (the folder holding `setup.py` and `grpo_jax/`)
from the working directory and puts it on `sys.path`, so the notebook runs from a checkout
without installing anything."""

INSTALL_CODE = f"""\
import os
import sys

if "google.colab" in sys.modules:
    %pip install -q "git+{REPO_URL}"
else:
    # Local checkout: the repository root is the working directory or one of its parents.
    _d = os.path.abspath(os.getcwd())
    while _d != os.path.dirname(_d) and not (
            os.path.isfile(os.path.join(_d, "setup.py")) and os.path.isdir(os.path.join(_d, "grpo_jax"))):
        _d = os.path.dirname(_d)
    if os.path.isdir(os.path.join(_d, "grpo_jax")) and _d not in sys.path:
        sys.path.insert(0, _d)

import grpo_jax  # noqa: F401  (fails here, early, if neither worked)
print("grpo_jax from", os.path.dirname(grpo_jax.__file__))"""


def md(src: str):
    return new_markdown_cell(textwrap.dedent(src).strip("\n"))


def code(src: str):
    return new_code_cell(textwrap.dedent(src).strip("\n"))


def notebook(prefix: str, cells) -> nbformat.NotebookNode:
    for i, cell in enumerate(cells):
        cell.id = f"{prefix}-{i:02d}"  # stable ids: regenerating gives no spurious diff
    nb = new_notebook(cells=cells)
    nb.metadata = {
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
        "language_info": {"name": "python"},
        "colab": {"provenance": []},
    }
    return nb


# ----------------------------------------------------------------------------------------------
# 01: GRPO in pictures
# ----------------------------------------------------------------------------------------------

NB01 = [
    md("""
    # GRPO in pictures

    Group Relative Policy Optimization (Shao et al. 2024, *DeepSeekMath*, arXiv 2402.03300) drops
    PPO's critic: it samples a **group** of answers to the same prompt, scores them with a
    verifier, and uses each answer's reward relative to its group as the advantage. This notebook
    draws the three ideas with the library's own pure functions:

    1. group-relative advantages (`grpo_jax.advantages.compute`);
    2. the clipped objective with clip-higher (`grpo_jax.losses.policy_loss`);
    3. why dropping the critic matters for memory (`experiments.memory`).

    Runs on a CPU in well under a minute.
    """),
    md(INSTALL_MD),
    code(INSTALL_CODE),
    code("""
    import jax
    import jax.numpy as jnp
    import matplotlib.pyplot as plt
    import numpy as np

    from grpo_jax import advantages, losses
    """),
    md("""
    ## 1. One prompt, a group of answers

    A prompt, `G = 8` sampled answers, and a binary verifier reward (1 = the final answer is
    right). GRPO's advantage is the reward standardised within the group
    (DeepSeekMath Sec. 4.1.2):

    $$A_i = \\frac{r_i - \\operatorname{mean}(r)}{\\operatorname{std}(r) + \\varepsilon}$$

    Answers above the group mean get a positive advantage (their tokens are **reinforced**),
    answers below it a negative one (**suppressed**). All rollouts live on one flat axis; the
    `segment_ids` say which prompt each row belongs to (here all rows belong to prompt 0).
    """),
    code("""
    prompt = "What is 17 * 23?"
    answers = ["391", "391", "381", "401", "391", "17*23=391", "I think 400", "39"]
    rewards = np.array([1, 1, 0, 0, 1, 1, 0, 0], np.float32)        # verifier: 1 = correct
    G = len(answers)
    segment_ids = np.zeros(G, np.int32)                              # one group: prompt 0

    adv, stats = advantages.compute(rewards, segment_ids, num_segments=1)  # GRPO defaults
    adv = np.asarray(adv)

    mean, std = rewards.mean(), rewards.std(ddof=1)                  # unbiased std, as verl/TRL
    print(f"prompt: {prompt!r}   group mean {mean:.3f}   group std {std:.3f}")
    for a, r, A in zip(answers, rewards, adv):
        print(f"  {a:>14s}  reward {r:.0f}  advantage {A:+.3f}")
    np.testing.assert_allclose(adv, (rewards - mean) / (std + 1e-6), rtol=1e-5)
    print("matches (r - mean) / (std + eps):", True, "| sum of advantages:", float(adv.sum()))
    """),
    code("""
    fig, (ax_r, ax_a) = plt.subplots(1, 2, figsize=(11, 3.6))
    x = np.arange(G)
    ax_r.bar(x, rewards, color="0.6")
    ax_r.axhline(mean, color="k", ls="--", label=f"group mean {mean:.2f}")
    ax_r.errorbar(G, mean, yerr=std, fmt="o", color="k", capsize=5, label=f"mean ± std ({std:.2f})")
    ax_r.set(title="rewards of the group", xticks=x, xticklabels=answers, ylabel="reward",
             xlim=(-0.6, G + 0.6))
    ax_r.tick_params(axis="x", rotation=45)
    ax_r.legend(loc="lower right", fontsize=8)

    colors = np.where(adv > 0, "tab:green", np.where(adv < 0, "tab:red", "0.6"))
    ax_a.bar(x, adv, color=colors)
    ax_a.axhline(0, color="k", lw=1)
    ax_a.set(title="advantages: reinforced (above) vs suppressed (below)", xticks=x,
             xticklabels=answers, ylabel="advantage A")
    ax_a.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    plt.show()
    """),
    md("""
    ### A flat group gives no signal

    If every answer gets the same reward — all right (too easy) or all wrong (too hard) — every
    answer sits exactly at the group mean: all advantages are 0 and the prompt contributes no
    gradient. The function reports such groups in `stats["num_zero_std_groups"]`. Below, three
    prompts in one batch (groups may differ in size): a mixed group, an all-correct group and an
    all-wrong group.
    """),
    code("""
    batch_rewards = np.array([1, 0, 0, 1, 0,   1, 1, 1, 1,   0, 0, 0, 0, 0, 0], np.float32)
    batch_segments = np.array([0] * 5 + [1] * 4 + [2] * 6, np.int32)
    batch_adv, batch_stats = advantages.compute(batch_rewards, batch_segments, num_segments=3)
    batch_adv = np.asarray(batch_adv)
    print("groups with no signal (all rewards equal):", int(batch_stats["num_zero_std_groups"]))

    fig, ax = plt.subplots(figsize=(10, 3))
    colors = np.where(batch_adv > 0, "tab:green", np.where(batch_adv < 0, "tab:red", "0.6"))
    ax.bar(np.arange(len(batch_adv)), batch_adv, color=colors)
    ax.axhline(0, color="k", lw=1)
    for g, label in enumerate(["mixed: signal", "all correct: A = 0", "all wrong: A = 0"]):
        rows = np.flatnonzero(batch_segments == g)
        ax.axvspan(rows[0] - 0.5, rows[-1] + 0.5, color=f"C{g}", alpha=0.08)
        ax.text(rows.mean(), 1.3, label, ha="center", fontsize=9)
    ax.set(ylim=(-1.6, 1.6), xlabel="rollout (flat axis)", ylabel="advantage",
           title="three prompts in one batch")
    plt.show()
    assert np.all(batch_adv[batch_segments > 0] == 0.0)
    """),
    md("""
    ## 2. The clipped objective, with clip-higher

    Each token of an answer is updated through the probability ratio
    $\\rho = \\pi_\\theta(y_t) / \\pi_{\\text{old}}(y_t)$. PPO's clipped surrogate (Schulman et al.
    2017, Eq. 7) maximises

    $$\\min\\big(\\rho A,\\ \\operatorname{clip}(\\rho, 1 - \\varepsilon_{low}, 1 + \\varepsilon_{high}) A\\big)$$

    so once the ratio has moved far enough *in the direction the advantage asks for* the
    objective goes flat and the gradient is zero: no single batch can push the policy too far.
    DAPO (Yu et al. 2025, arXiv 2503.14476) raises only the upper bound,
    `epsilon_high = 0.28 > epsilon_low = 0.2` (**clip-higher**), so rare good tokens
    (`A > 0`, small `π_old`) can grow more before they are clipped, which keeps entropy up.

    We evaluate `losses.policy_loss` on a grid of ratios — one row per ratio, one token each,
    `old_logprobs = 0`, `logprobs = log ρ` — and read each row's clipped surrogate from
    `aux["per_rollout_loss"]` (the loss is the negative objective). The gradient with respect
    to the log-prob comes from `jax.grad` of the same function.
    """),
    code("""
    # A grid that avoids the clip boundaries themselves (there the two branches tie).
    ratios = (0.5 + 0.0025 * (np.arange(440) + 0.5)).astype(np.float32)
    log_ratio = jnp.log(ratios)[:, None]                  # [R, 1]: one token per row
    mask = jnp.ones_like(log_ratio)

    def surrogate(A, eps_low, eps_high):
        def total(lp):
            loss, aux = losses.policy_loss(
                lp, jnp.zeros_like(lp), jnp.full((lp.shape[0],), A, jnp.float32), mask,
                losses.PolicyLossConfig(epsilon_low=eps_low, epsilon_high=eps_high,
                                        loss_agg_mode="seq-mean-token-sum"))
            return loss * lp.shape[0], aux               # sum over rows: per-row gradients
        (_, aux), grad = jax.value_and_grad(total, has_aux=True)(log_ratio)
        return -np.asarray(aux["per_rollout_loss"]), -np.asarray(grad[:, 0])

    fig, axes = plt.subplots(2, 2, figsize=(11, 6.5), sharex=True)
    for col, A in enumerate([1.0, -1.0]):
        for (lo, hi), style in [((0.2, 0.2), dict(ls="--", color="0.5", label="symmetric 0.2 / 0.2")),
                                ((0.2, 0.28), dict(color="C0" if A > 0 else "C3",
                                                   label="clip-higher 0.2 / 0.28"))]:
            obj, grad = surrogate(A, lo, hi)
            axes[0, col].plot(ratios, obj, **style)
            axes[1, col].plot(ratios, grad, **style)
        axes[0, col].plot(ratios, A * ratios, color="k", lw=0.6, alpha=0.4, label="unclipped ρA")
        for row in range(2):
            ax = axes[row, col]
            ax.axvline(1 - 0.2, color="0.7", lw=0.8)
            ax.axvline(1 + 0.28, color="0.7", lw=0.8)
            ax.axvline(1.0, color="0.85", lw=0.8)
        axes[0, col].set_title(f"A = {A:+.0f}: objective min(ρA, clip(ρ)A)")
        axes[1, col].set_title(f"A = {A:+.0f}: d objective / d log π  (0 = clipped)")
        axes[1, col].set_xlabel("ratio ρ = π / π_old")
        axes[0, col].legend(fontsize=8)
    fig.tight_layout()
    plt.show()

    obj_hi, grad_hi = surrogate(1.0, 0.2, 0.28)
    print(f"A > 0: the gradient is zero from ρ = {ratios[np.argmax(grad_hi == 0)]:.4f} up "
          "(1 + epsilon_high = 1.28)")
    obj_lo, grad_lo = surrogate(-1.0, 0.2, 0.28)
    print(f"A < 0: the gradient is zero from ρ = {ratios[np.flatnonzero(grad_lo == 0).max()]:.4f} "
          "down (1 - epsilon_low = 0.8)")
    """),
    md("""
    Read the plots: for `A > 0` (a good answer) the objective rises with `ρ` until
    `1 + epsilon_high`, then it is flat; for `A < 0` (a bad answer) it rises as `ρ` falls, until
    `1 - epsilon_low`. On the *other* side of 1 there is no clip: a token whose ratio moved the
    wrong way always gets the full gradient back.

    ## 3. Memory: PPO vs GRPO

    PPO trains a critic (a value model usually as large as the policy) with its own gradients
    and optimiser state, and keeps its activations for the value loss; GRPO replaces it with the
    group baseline above. Pick a model size (in Colab the fields below are a form: a drop-down,
    numbers and a checkbox) and compare the analytic memory of one training step on one device.
    The numbers come from `experiments.memory.analytic_breakdown` and are drawn by
    `experiments.memory.plot_bars`: the state (weights, gradients, two Adam moments, the frozen
    reference) plus the larger of the update's activations and the rollouts' KV cache.

    The critic roughly doubles the trained state (weights + gradients + Adam: 16 bytes per
    parameter in float32), so on the state alone GRPO saves about 44%. Activations are the same
    for both and grow with the batch: without rematerialisation (`REMAT = False`) or with many
    rollouts per update they dominate and the relative saving shrinks.
    `python -m experiments.memory` also compiles both steps with XLA and reports the measured
    peak beside this estimate.
    """),
    code("""
    MODEL = "qwen3-8b"  # @param ["smollm2-135m", "qwen3-1.7b", "qwen3-4b", "qwen3-8b"]
    BATCH_ROLLOUTS = 8  # @param {type:"integer"}
    PROMPT_LEN = 1024  # @param {type:"integer"}
    COMPLETION_LEN = 4096  # @param {type:"integer"}
    REMAT = True  # @param {type:"boolean"}

    from experiments import memory

    # The paper's run precision (configs/dapo_qwen3.py): float32 master weights, bfloat16 compute.
    model_config = memory.model_config_from_arg(MODEL, param_dtype="float32", dtype="bfloat16",
                                                remat=REMAT)
    result = memory.analytic_breakdown(model_config, batch_rollouts=BATCH_ROLLOUTS,
                                       prompt_len=PROMPT_LEN, completion_len=COMPLETION_LEN)
    fig, ax = plt.subplots(figsize=(7, 4))
    memory.plot_bars(result, ax=ax)
    ax.set_title(f"{MODEL} ({result['num_params'] / 1e9:.2f}B parameters), {BATCH_ROLLOUTS} "
                 f"rollouts of {PROMPT_LEN}+{COMPLETION_LEN} tokens\\n" + memory.headline(result),
                 fontsize=9)
    plt.show()
    print(memory.headline(result))
    print(f"weights + gradients + Adam + reference only: saved "
          f"{result['state_only']['saved_fraction']:.0%} (the critic is as large as the policy)")
    """),
]


# ----------------------------------------------------------------------------------------------
# 02: GDRO controllers
# ----------------------------------------------------------------------------------------------

NB02 = [
    md("""
    # The GDRO controllers, without a model

    GRPO spends the same effort on every prompt. On a dataset with **heavy-tailed difficulty**
    (many hard prompts, a long easy head) most groups are flat — all wrong or all right — and
    carry no signal. The GDRO controllers of Panaganti et al. (arXiv 2601.19280) react to the
    difficulty the policy *currently* sees:

    * an online **classifier** bins each prompt by its recent success rate (bin 0 = hardest);
    * **Prompt-GDRO** (the data adversary) keeps an exponential-weights score per bin and
      up-weights the advantages of the bins where the loss is high;
    * **Rollout-GDRO** (the compute adversary) moves rollouts between bins at a fixed mean
      budget `n̄` per prompt, so the generation batch never changes shape.

    Everything below uses `grpo_jax.gdro` and `experiments/simulate_gdro.py` with simulated
    prompts (Bernoulli success rates): no model, no data, a few seconds on a CPU.
    """),
    md(INSTALL_MD),
    code(INSTALL_CODE),
    code("""
    import jax.numpy as jnp
    import matplotlib.pyplot as plt
    import numpy as np

    from experiments import simulate_gdro
    from grpo_jax import gdro
    """),
    md("""
    ## Simulated prompts with heavy-tailed difficulty

    `simulate_gdro.initial_success_rates` draws each prompt's true per-rollout success rate `p`
    from a mix: 50% hard (Beta(0.3, 4)), 30% middle (Beta(2, 2)), 20% easy (Beta(4, 0.5)).

    The hand-written loops below run the controllers as the paper specifies them
    (`mode="paper"` on each config); the library's default, `mode="corrected"`, departs from the
    paper in a few documented places (docs/gdro.md), and `simulate_gdro.simulate` at the end
    uses it.

    What the classifier measures is not `p` itself: each **visit** of a prompt stores one number,
    in paper mode `1[any of its rollouts is correct]` (paper Eq. 10), and `p_hat` is the mean over
    the last `H = 50` visits. With `n̄ = 4` rollouts per visit that estimates
    `1 - (1 - p)^4`, so a prompt with `p = 0.5` already sits near the top (0.94). The
    bins (edges 0.1 … 0.9, vertical lines) are over this visit success rate.
    """),
    code("""
    NUM_PROMPTS, P, N_BAR, STEPS = 300, 32, 4, 60
    rng = np.random.default_rng(0)
    p_true = simulate_gdro.initial_success_rates(NUM_PROMPTS, rng)

    ccfg = gdro.ClassifierConfig(delta=0.03, mode="paper")  # the paper's: 10 bins, H = 50
    B = ccfg.num_bins
    visit_rate = 1.0 - (1.0 - p_true) ** N_BAR           # P(any of n_bar rollouts correct)
    true_bins = np.searchsorted(np.asarray(ccfg.edges), visit_rate, side="right")

    fig, axes = plt.subplots(1, 2, figsize=(12, 3))
    axes[0].hist(p_true, bins=40, color="C0")
    axes[0].set(xlabel="true per-rollout success rate p", ylabel="prompts",
                title="heavy-tailed difficulty")
    axes[1].hist(visit_rate, bins=40, color="C1")
    for e in ccfg.edges:
        axes[1].axvline(e, color="0.6", lw=0.8)
    axes[1].set(xlabel=f"1 - (1 - p)^{N_BAR}", ylabel="prompts",
                title="what a visit measures: any of n̄ rollouts correct")
    fig.tight_layout()
    plt.show()
    print("prompts per true bin (0 = hardest):", np.bincount(true_bins, minlength=B).tolist())
    """),
    md("""
    ## The classifier's bins over time, and Prompt-GDRO's scores and weights

    One loop in the trainer's order (see `grpo_jax/gdro/__init__.py`): draw `P` prompts,
    `classify` them from their **past** visits, give each `n̄` rollouts
    (`fixed_allocation`), compute the Prompt-GDRO advantage weights from the scores so far,
    sample the rewards, then update Prompt-GDRO (loss signal: the failure rate `1 - correct`) and
    record the visit in the classifier. The policy does not learn here, so the true rates stay
    fixed and we can watch the estimates converge.

    Never-seen prompts start in bin 0 (`unseen_bin`), so early on bin 0 is crowded; as visits
    accumulate, prompts spread to their true bins (a prompt moves only when its estimate
    crosses an edge by the hysteresis margin `delta = 0.03`).
    """),
    code("""
    pcfg = gdro.PromptGDROConfig(signal="failure_rate", mode="paper")
    cstate = gdro.classifier_init(ccfg, NUM_PROMPTS)
    pstate = gdro.prompt_gdro_init(pcfg, B)
    all_ids = jnp.arange(NUM_PROMPTS, dtype=jnp.int32)
    tracked = [int(np.argmin(np.abs(visit_rate - t))) for t in (0.03, 0.25, 0.5, 0.75, 0.97)]

    dataset_bins, scores, qs, weights = [], [], [], []
    for t in range(STEPS):
        ids = rng.choice(NUM_PROMPTS, size=P, replace=False).astype(np.int32)
        ids = np.concatenate([np.asarray(tracked, np.int32),
                              ids[~np.isin(ids, tracked)][: P - len(tracked)]])
        bins = np.asarray(gdro.classify(ccfg, cstate, jnp.asarray(ids)))       # past visits only
        alloc = gdro.fixed_allocation(bins, N_BAR, B)                          # n_bar each
        seg = np.asarray(alloc.segment_ids)
        rollout_bins = jnp.asarray(bins[seg])
        w = np.asarray(gdro.prompt_gdro_weights(pcfg, pstate, rollout_bins))  # multiplies A
        correct = rng.random(P * N_BAR) < p_true[ids][seg]
        signal = gdro.loss_signal(pcfg, correct=correct)                       # 1 - correct
        pstate, diag = gdro.prompt_gdro_update(pcfg, pstate, rollout_bins, signal)
        cstate = gdro.classifier_update(ccfg, cstate, jnp.asarray(ids), gdro.visit_outcome(
            ccfg, jnp.asarray(correct), jnp.asarray(seg), P))

        dataset_bins.append(np.asarray(gdro.classify(ccfg, cstate, all_ids)))
        scores.append(np.asarray(pstate.score))
        qs.append(diag["gdro/q"])
        cnt = np.bincount(bins[seg], minlength=B)
        weights.append(np.where(cnt > 0, np.bincount(bins[seg], weights=w, minlength=B)
                                / np.maximum(cnt, 1), np.nan))
    dataset_bins, scores, qs, weights = map(np.asarray, (dataset_bins, scores, qs, weights))
    print("total rollouts per step:", P * N_BAR, "| final weights have mean",
          float(np.mean(w)), "over the batch's rollouts")
    """),
    code("""
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.6))
    share = np.stack([np.bincount(b, minlength=B) for b in dataset_bins]) / NUM_PROMPTS
    im = axes[0].imshow(share.T, aspect="auto", origin="lower", cmap="viridis",
                        interpolation="nearest")
    axes[0].set(xlabel="step", ylabel="bin (0 = hardest)",
                title="share of the dataset in each bin (classifier)")
    fig.colorbar(im, ax=axes[0])
    for i, pid in enumerate(tracked):
        axes[1].step(np.arange(STEPS), dataset_bins[:, pid] + 0.06 * i, where="post",
                     label=f"prompt {pid}: p = {p_true[pid]:.2f}, true bin {true_bins[pid]}")
    axes[1].set(xlabel="step", ylabel="bin", yticks=range(B),
                title="bins of five prompts over time")
    axes[1].legend(fontsize=7, loc="center right")
    fig.tight_layout()
    plt.show()
    agree = np.mean(dataset_bins[-1] == true_bins)
    print(f"after {STEPS} steps {agree:.0%} of the prompts sit in their true bin "
          f"(each prompt was visited about {STEPS * P / NUM_PROMPTS:.0f} times)")
    """),
    md("""
    **Prompt-GDRO.** Each step, each bin's mean loss signal is divided by the bin's share of the
    batch's rollouts (debiasing, Eq. 12) and folded into an EMA score `S_b` (Eq. 13). The weights
    are `q = (1 - γ) softmax(η S) + γ / B_active` over the bins present (Eq. 14-15), and each
    rollout's advantage is multiplied by `w_i = q_{b(i)} R / Σ q` (mean 1, capped at
    `weight_cap = 15`; Eq. 16).

    The debiasing divides by the share, so a bin with few prompts but a high failure rate gets a
    large score, while the crowded hardest bin (bin 0, half the dataset) and the all-correct top
    bin get small ones: the weight goes to the sparse middle-hard bins, where groups are mixed
    and carry signal. With the failure rate as the signal and `η = 0.65` the softmax is sharp,
    so the weights of the leading bin often reach the cap.
    """),
    code("""
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.6))
    for b in range(B):
        axes[0].plot(scores[:, b], label=f"bin {b}", color=plt.cm.viridis(b / (B - 1)))
    axes[0].set(xlabel="step", ylabel="S_b", title="Prompt-GDRO scores (EMA, debiased)")
    axes[0].legend(fontsize=6, ncol=2)
    im = axes[1].imshow(qs.T, aspect="auto", origin="lower", cmap="magma",
                        interpolation="nearest")
    axes[1].set(xlabel="step", ylabel="bin", title="bin weights q (used that step)")
    fig.colorbar(im, ax=axes[1])
    last = np.nanmean(weights[-10:], axis=0)
    axes[2].bar(np.arange(B), np.nan_to_num(last), color=plt.cm.viridis(np.arange(B) / (B - 1)))
    axes[2].axhline(1.0, color="k", lw=0.8, ls="--")
    axes[2].set(xlabel="bin (0 = hardest)", ylabel="mean weight",
                title="advantage weight per rollout (last 10 steps)")
    fig.tight_layout()
    plt.show()
    """),
    md("""
    ## Rollout-GDRO: moving rollouts at a fixed budget

    One batch, allocated three ways. Every allocation gives each prompt between `n_min = 2` and
    `n_max = 12` rollouts and exactly `R = P·n̄` in total.

    * `fixed_allocation`: `n̄` each (GRPO).
    * `sqrt` (closed form, Thm 4.2): `n_b ∝ sqrt(p_b (1 - p_b) + v_floor)` from the classifier's
      bin success rate — the Neyman rule that minimises the weighted standard error
      `Σ_b share_b σ_b / sqrt(n_b)`: more rollouts where the reward is most uncertain.
    * `bandit` (the paper's controller, Eq. 20-21): per bin, an exponential-weights learner over
      the arms `{2 … 12}`, a price `μ` on rollouts (dual ascent keeps the mean at `n̄`), and a
      dynamic programme that picks the most likely arms with an exact budget. Fresh learners are
      uniform, so before any feedback it returns `n̄` everywhere.
    """),
    code("""
    ids = rng.choice(NUM_PROMPTS, size=P, replace=False).astype(np.int32)
    bins = np.asarray(gdro.classify(ccfg, cstate, jnp.asarray(ids)))
    succ = np.asarray(gdro.bin_success(ccfg, cstate, jnp.asarray(ids), jnp.asarray(bins), B))
    allocs = {"uniform (GRPO)": gdro.fixed_allocation(bins, N_BAR, B)}
    for name in ("sqrt", "bandit"):
        rcfg = gdro.RolloutGDROConfig(allocator=name, n_bar=N_BAR, signal="failure_rate",
                                      mode="paper")
        allocs[name] = gdro.allocate(rcfg, gdro.rollout_gdro_init(rcfg, B), bins, succ,
                                     prompt_ids=ids)

    fig, ax = plt.subplots(figsize=(9, 3.4))
    present = np.bincount(bins, minlength=B) > 0
    for k, (name, a) in enumerate(allocs.items()):
        n = np.asarray(a.rollouts_per_prompt)
        assert n.sum() == P * N_BAR and n.min() >= 2 and n.max() <= 12
        ax.bar(np.arange(B)[present] + (k - 1) * 0.27, np.asarray(a.bin_rollouts)[present],
               width=0.27, label=f"{name}: {n.sum()} rollouts")
    ax.axhline(N_BAR, color="k", lw=0.8, ls="--")
    ax.set(xlabel="bin (0 = hardest)", ylabel="rollouts per prompt", xticks=range(B),
           title="one batch, three allocations, same budget")
    ax.legend(fontsize=8)
    plt.show()
    print("bin success rates the sqrt rule saw:", np.round(succ[present], 2).tolist())
    """),
    md("""
    ## The controllers over time, and the heatmaps

    `simulate_gdro.simulate(allocator, steps, seed, ...)` runs the whole loop with a toy learner:
    a prompt whose group has both right and wrong answers (a non-zero GRPO signal) raises its
    success logit in proportion to its rollouts and advantage weight. It returns per-step arrays
    (step × bin heatmaps and scalar traces). Small sizes here; the command-line version
    (`python -m experiments.simulate_gdro`) runs 300 steps on 2000 prompts.
    """),
    code("""
    SIM = dict(steps=100, seed=0, num_prompts=400, prompts_per_step=32, n_bar=N_BAR)
    runs = {name: simulate_gdro.simulate(name, **SIM) for name in simulate_gdro.ALLOCATORS}

    fig, axes = plt.subplots(1, 3, figsize=(15, 3.4))
    for name, res in runs.items():
        axes[0].plot(res["total_rollouts"], label=name, lw=3 if name == "uniform" else 1.5)
        axes[2].plot(res["mean_success"], label=name)
    axes[1].plot(runs["rollout_bandit"]["mu"], color="C2")
    axes[0].set(xlabel="step", ylabel="rollouts", ylim=(0, 1.5 * SIM["prompts_per_step"] * N_BAR),
                title="budget kept: rollouts per step (R = P·n̄)")
    axes[1].set(xlabel="step", ylabel="μ", title="bandit: price of a rollout (dual ascent)")
    axes[2].set(xlabel="step", ylabel="mean true success", title="toy learner: dataset success rate")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    plt.show()
    for name, res in runs.items():
        assert np.all(res["total_rollouts"] == SIM["prompts_per_step"] * N_BAR), name
    """),
    code("""
    def heatmap(ax, arr, title, cmap="viridis"):
        im = ax.imshow(np.asarray(arr, np.float32).T, aspect="auto", origin="lower",
                       interpolation="nearest", cmap=cmap)
        ax.set(xlabel="step", ylabel="bin (0 = hardest)", title=title)
        plt.colorbar(im, ax=ax)

    fig, axes = plt.subplots(2, 2, figsize=(13, 6.5))
    heatmap(axes[0, 0], runs["uniform"]["share"], "uniform: prompt share per bin")
    heatmap(axes[0, 1], runs["prompt_gdro"]["weight"], "prompt_gdro: mean advantage weight", "magma")
    heatmap(axes[1, 0], runs["rollout_bandit"]["rollouts"], "rollout_bandit: rollouts per prompt", "cividis")
    heatmap(axes[1, 1], runs["rollout_sqrt"]["rollouts"], "rollout_sqrt: rollouts per prompt", "cividis")
    fig.tight_layout()
    plt.show()
    """),
    code("""
    print(f"{'allocator':16s} {'WSE/uniform':>11s} {'(proxy)':>8s} {'mean p':>7s} {'hard p':>7s} {'R/step':>7s}")
    for name, res in runs.items():
        s = simulate_gdro.summarize(res)
        print(f"{name:16s} {s['wse_ratio_true']:11.3f} {s['wse_ratio_proxy']:8.3f} "
              f"{s['final_mean_success']:7.3f} {s['final_hard_success']:7.3f} "
              f"{s['rollouts_per_step']:7.0f}")
    """),
    md("""
    In the heatmaps white means the bin held no prompt that step. `WSE/uniform` is the weighted
    standard error of the allocation divided by that of the uniform allocation of the same
    batches, with the true `σ_b` (and, in brackets, the paper's proxy from the classifier's
    estimates, which is what the `sqrt` rule minimises). Small, short runs like this one are noisy; see
    `experiments/simulate_gdro.py` for the full-size comparison.
    """),
]


# ----------------------------------------------------------------------------------------------
# 03: train the tiny default
# ----------------------------------------------------------------------------------------------

NB03 = [
    md("""
    # Train the tiny default for a few steps

    The embedded default (`configs/arithmetic.py`) is a tiny character-level transformer that
    learns arithmetic: a short supervised warm start teaches the answer format, then GRPO. Here
    it runs from the library API — `train.train_and_evaluate(config, workdir)` — shrunk so the
    cell finishes in a minute or two on a CPU.

    With so few steps expect little or no gain: after this short warm start the model solves only
    a few percent of the problems, so most groups are all wrong and carry no GRPO signal (see
    notebook 01). The full run (`python -m experiments.run --config=configs/arithmetic.py:grpo`:
    the config's own warm-start and RL steps, printed below) takes a few minutes on 2 cores.
    The `CONFIG` field picks another algorithm, or `grpo,heavy_tailed`: a mix with many easy
    problems, where the short warm start already gets a share right and the few RL steps have
    more to work with.
    """),
    md(INSTALL_MD),
    code(INSTALL_CODE),
    code("""
    import os
    import tempfile

    import matplotlib.pyplot as plt
    import numpy as np

    from configs import arithmetic
    from grpo_jax import train, writers

    CONFIG = "grpo"  # @param ["grpo", "grpo,heavy_tailed", "prompt_gdro", "rollout_gdro", "ppo"]

    config = arithmetic.get_config(CONFIG)
    full = arithmetic.get_config(CONFIG)     # the full run's settings, printed for comparison
    config.sft.steps = 100                   # supervised warm start
    config.steps = 12                        # RL steps
    config.rollout.prompts_per_step = 16     # P
    config.rollout.rollouts_per_prompt = 8   # group size
    config.eval.max_examples = 64            # held-out problems, 8 samples each
    config.checkpoint.every_steps = config.steps
    config.logging.tensorboard = False
    config.logging.progress_bar = False
    config.mesh.num_devices = 1              # one device is plenty for this model

    print(f"warm start {config.sft.steps} steps (full run {full.sft.steps}), "
          f"RL {config.steps} steps (full run {full.steps}), "
          f"P = {config.rollout.prompts_per_step} (full run {full.rollout.prompts_per_step})")
    workdir = tempfile.mkdtemp(prefix="grpo_tiny_")
    print("workdir:", workdir)
    """),
    code("""
    summary = train.train_and_evaluate(config, workdir)
    """),
    md("""
    ## Reward and pass rate per step

    `metrics.jsonl` holds one row per RL step (plus a row with the evaluation before training).
    `reward_mean` is the mean reward of the step's rollouts (±1 per answer with the paper's
    `reward_scale = "pm1"`), `pass_rate` the fraction of correct rollouts.
    """),
    code("""
    rows = [r for r in writers.read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "reward_mean" in r]
    steps = [r["step"] for r in rows]

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.4))
    axes[0].plot(steps, [r["reward_mean"] for r in rows], marker="o")
    axes[0].set(xlabel="RL step", ylabel="mean reward", title="reward")
    axes[1].plot(steps, [r["pass_rate"] for r in rows], marker="o", color="C2")
    axes[1].set(xlabel="RL step", ylabel="fraction correct", title="pass rate of the rollouts")
    fig.tight_layout()
    plt.show()
    """),
    md("""
    ## Before / after on the held-out problems

    The returned summary holds the evaluation before RL (after the warm start) and after it:
    `k = 8` samples per problem at temperature 0.6, `mean_at_1` (mean accuracy of a sample),
    `pass_at_1` and `pass_at_8` (unbiased estimator of Chen et al. 2021).
    """),
    code("""
    k = config.eval.num_samples
    keys = ["mean_at_1", "pass_at_1", f"pass_at_{k}"]
    before = [summary["eval_before"][key] for key in keys]
    after = [summary["eval_after"][key] for key in keys]

    fig, ax = plt.subplots(figsize=(7, 3.4))
    x = np.arange(len(keys))
    ax.bar(x - 0.2, before, width=0.4, label="before RL")
    ax.bar(x + 0.2, after, width=0.4, label=f"after {summary['steps']} RL steps")
    ax.set(xticks=x, xticklabels=keys, ylabel="accuracy",
           title=f"held-out arithmetic ({config.eval.max_examples} problems)")
    ax.legend()
    plt.show()
    for key, b, a in zip(keys, before, after):
        print(f"{key:10s} {b:.4f} -> {a:.4f}")
    print(f"wall time of train_and_evaluate: {summary['wall_seconds']:.0f} s")
    """),
]


NOTEBOOKS = {
    "01_grpo_in_pictures.ipynb": NB01,
    "02_gdro_controllers.ipynb": NB02,
    "03_train_tiny.ipynb": NB03,
}


def build(name: str) -> str:
    """The stored text (nbformat JSON, no outputs) of notebook ``name``."""
    nb = notebook(name[:2], NOTEBOOKS[name])
    nbformat.validate(nb)
    return nbformat.writes(nb) + "\n"


def main():
    for name in NOTEBOOKS:
        path = os.path.join(HERE, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(build(name))
        print("wrote", path)


if __name__ == "__main__":
    main()
