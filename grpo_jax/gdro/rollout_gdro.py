"""Rollout-GDRO: the compute adversary (rollouts per prompt under a fixed mean budget).

Source: Panaganti et al., arXiv 2601.19280 (2026), Eq. 17-21 and Thm 4.2; spec:
shared/spec/gdro.md s.3 and s.4.

Every prompt gets ``n_i`` in ``{n_min .. n_max}`` rollouts, prompts of one bin alike (up to the
integer rounding below), with exactly ``R = P * n_bar`` rollouts per step, so the generation batch
is always ``[R, ...]`` and only ``segment_ids`` (rollout row -> prompt, sorted, contiguous)
changes. Two allocators (``RolloutGDROConfig.allocator``):

``sqrt`` (closed form, jittable). ``v_b = p_b (1 - p_b) + v_floor`` from the classifier's bin
success rate; the Neyman rule ``n_b* = n_bar sqrt(v_b) / sum_j share_j sqrt(v_j)`` (Thm 4.2),
with bounds handled by water-filling (``n_b = clip(c sqrt(v_b), n_min, n_max)``, ``c`` set so the
budget holds). Integers: each prompt gets ``floor(n_b*)`` or ``ceil(n_b*)`` by largest remainder,
so the sum is exact and every prompt is within 1 of its bin's continuous value. (An integer per
*bin* with an exact sum does not always exist: bins of 3 and 5 prompts and ``R = 32``.)

``bandit`` (the paper's controller, Eq. 20-21; the dynamic programme runs on the host in numpy).
Each bin has an exponential-weights learner over the arms ``a in {n_min .. n_max}`` whose loss
for arm ``a`` is the bandit loss ``ell_b(a) + mu a``:
``p_b(a) = (1 - gamma) softmax(-eta (s_b + mu a))(a) + gamma / K``, where ``s_b(a)`` is the EMA of
the feedback ``ell_b`` observed when arm ``a`` was chosen
(``s <- ema_decay s + (1 - ema_decay) ell_b``). The allocation maximises
``sum_b N_b log p_b(a_b)`` (default, ``count_weighted_dp``; paper: ``sum_b log p_b(a_b)``)
subject to ``sum_b N_b a_b = R`` exactly (DP over bins x running total); exact ties go to the
allocation nearest ``n_bar`` (a secondary term worth < 1e-6 nats).

Feedback (``feedback``). Paper (``"loss"``): ``ell_b = -J_b`` = the bin's mean loss signal. It
does not depend on the arm in expectation, so the arms cannot learn anything about ``n``
(spec s.7). Default (``"variance"``): ``ell_b(a) = mean_{i in b} (s_i^2 + v_floor) / n_i``, with
``s_i^2`` the unbiased (n - 1) within-group variance of prompt ``i``'s rewards: the estimated
variance of the bin's group-mean estimate with ``a`` rollouts per prompt. ``E[s_i^2] =
sigma_i^2`` for every ``n_i >= 2``, so ``E[ell_b(a)] = (sigma_b^2 + v_floor) / a``: it falls with
``a`` at the rate of the variance it removes. With the count-weighted DP and ``gamma -> 0``,
``sum_b N_b log p_b(a_b) = -eta sum_b N_b (s_b(a_b) + mu a_b) + const`` and the price term
``mu sum_b N_b a_b = mu R`` is the same for every feasible allocation, so the DP minimises
``sum_b N_b (sigma_b^2 + v_floor) / a_b`` under the exact budget: the integer Neyman problem
whose continuous solution is the square-root rule ``a_b ∝ sqrt(sigma_b^2 + v_floor)`` (Thm 4.2),
i.e. the ``sqrt`` allocator's target with the bin's measured reward variance in place of
``p (1 - p)`` (for 0/1 rewards the two agree in expectation; ``v_floor`` is in reward-variance
units). (The alternative "fraction of informative groups", ``1 - p^a - (1 - p)^a``, was
rejected: its marginal gain is largest for p near 0 or 1, the opposite of the square-root rule.)
Arms never tried keep score 0, below every observed loss (losses are >= 0): optimistic, so the
DP explores them. Without count weighting the price enters as ``mu sum_b a_b`` and a shared
price tilt hands large arms to small bins (spec s.7).

Unseen prompts (bin marker ``B``, see ``classifier``) get ``n_bar`` rollouts each (no
information: the uniform allocation); the seen bins share the rest of the budget. (With a budget
``total`` other than ``P n_bar`` their count is moved towards ``n_bar`` only as far as keeps the
seen bins feasible.)

Dual ascent. The price follows ``mu <- mu + alpha_mu (n_hat - n_bar)`` with
``n_hat = sum_b share_b E_{p_b}[a]``, the learners' expected mean arm. If no exact solution
exists (only possible with a ``total`` other than ``P * n_bar``), fallback: ``n_min`` each, the
rest in proportion to the bin weight ``E_{p_b}[a] - n_min``, capped at ``n_max``, exact-sum
rounding per prompt.

Readings we take (documented because the spec leaves them open):
* Sign: scores are *losses*, so the learner uses ``softmax(-eta .)``. With ``softmax(+eta .)`` a
  rising price ``mu`` would make large arms *more* likely and the dual ascent would diverge.
* The price term ``mu a`` is known for every arm (full information), so it enters every arm's
  loss at decision time with the current ``mu``; only ``-J_b`` is bandit feedback stored in the
  chosen arm's score. Folding ``mu a`` into the chosen arm's EMA only (the literal reading) lets
  never-chosen large arms keep score 0 and dominate: in a 300-step test ``mu`` ran to 81 and
  ``E[a]`` to 9.5 against ``n_bar = 4``. With the price on all arms ``E[a] -> n_bar``.
* ``n_hat`` is the learners' expected arm, not the realised mean (the realised mean equals
  ``n_bar`` whenever the DP succeeds, which would freeze ``mu``: the patch's defect).
* ``ema_decay`` is the weight on the old score (TF/flax convention).
* The state is updated from the allocation actually used and the bins of the current prompts
  (the patch overwrote its state before the update and reused the previous batch's labels).

``mode="paper"`` sets ``feedback="loss"``, ``count_weighted_dp=False`` and
``signal="surrogate_loss"``; an explicitly given field wins over the mode. ``n_bar`` is the run
config's rollouts per prompt (paper: 4).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import metrics
from grpo_jax.gdro import evidence
from grpo_jax.gdro.classifier import _config_from_dict, _resolve_mode
from grpo_jax.gdro.prompt_gdro import SIGNALS, _entropy, prompt_gdro_diagnostics

ALLOCATORS = ("bandit", "sqrt", "shrunk")
FEEDBACKS = ("variance", "loss")
OBJECTIVES = ("informative", "variance")


@dataclasses.dataclass(frozen=True)
class RolloutGDROConfig:
    """Static configuration of Rollout-GDRO (hashable: a jit static arg).

    Attributes:
      allocator: ``"bandit"`` (paper), ``"sqrt"`` (closed-form Neyman rule on the bins' success
        rates) or ``"shrunk"`` (per prompt, from its own counts shrunk toward a Beta prior
        fitted to the pool: ``grpo_jax.gdro.evidence``).
      n_min: fewest rollouts per prompt, >= 2 (a single rollout has no group baseline). Default 2.
      n_max: most rollouts per prompt, >= n_min. Default 12.
      n_bar: mean rollouts per prompt (integer in [n_min, n_max]); ``R = P * n_bar``. Default 4.
      eta: bandit step size (0.65), > 0.
      gamma: bandit uniform mixing over arms (0.01), in [0, 1].
      ema_decay: weight of the old arm score in its EMA (0.4), in [0, 1).
      alpha_mu: dual-ascent step of the price ``mu`` (0.05), >= 0.
      mu_0: initial price (0.0).
      v_floor: variance floor added to ``p (1 - p)`` (``sqrt``) and to the within-group reward
        variance (``feedback="variance"``) (0.01), > 0.
      signal: loss signal for ``feedback="loss"``, ``"failure_rate"`` (default) or
        ``"surrogate_loss"`` (paper) (see prompt_gdro). None: from ``mode``.
      feedback: bandit feedback, ``"variance"`` (default: estimated variance per prompt,
        ``(s^2 + v_floor) / n``, depends on the arm) or ``"loss"`` (paper: the bin's mean loss
        signal). None: from ``mode``.
      count_weighted_dp: the DP maximises ``sum_b N_b log p_b(a_b)`` (default True) instead of
        ``sum_b log p_b(a_b)`` (paper False). None: from ``mode``.
      objective: ``shrunk`` only: ``"informative"`` (default: maximise the expected number of
        informative groups under each prompt's posterior) or ``"variance"`` (the integer Neyman
        rule ``min sum_i (E[p_i (1 - p_i)] + v_floor) / n_i``).
      evidence_decay: ``shrunk`` only: a visited prompt's counts are multiplied by this before
        the visit's successes and trials are added (0.8: evidence ~5 visits old weighs a third;
        the policy moves), in (0, 1].
      min_trials: ``shrunk`` only: prompts whose (decayed) trials are below this keep at least
        ``n_bar`` rollouts (little evidence: no reason to take rollouts away) (8.0), >= 0.
      prior_strength: ``shrunk`` only: fixed ``a + b`` of the Beta prior; 0 (default) = fitted
        by moments (``evidence.fit_beta_prior``; None is read as 0).
      mode: ``"corrected"`` (default) or ``"paper"``: the value of every switch left at None.

    Raises:
      ValueError naming the field: ``n_min < 2``, ``n_max < n_min``, ``n_bar`` not an integer in
      ``[n_min, n_max]``, unknown allocator / signal / feedback / mode, out-of-range step sizes.
    """

    allocator: str = "bandit"
    n_min: int = 2
    n_max: int = 12
    n_bar: int = 4
    eta: float = 0.65
    gamma: float = 0.01
    ema_decay: float = 0.4
    alpha_mu: float = 0.05
    mu_0: float = 0.0
    v_floor: float = 0.01
    signal: str | None = None
    feedback: str | None = None
    count_weighted_dp: bool | None = None
    objective: str = "informative"
    evidence_decay: float = 0.8
    min_trials: float = 8.0
    prior_strength: float = 0.0
    mode: str = "corrected"

    def __post_init__(self):
        _resolve_mode(
            self,
            {
                "signal": ("failure_rate", "surrogate_loss"),
                "feedback": ("variance", "loss"),
                "count_weighted_dp": (True, False),
            },
        )
        object.__setattr__(self, "count_weighted_dp", bool(self.count_weighted_dp))
        for name in ("n_min", "n_max", "n_bar"):
            v = getattr(self, name)
            if isinstance(v, bool) or not float(v).is_integer():
                raise ValueError(f"RolloutGDROConfig.{name} must be an integer; got {v!r}")
            object.__setattr__(self, name, int(v))
        for name in ("eta", "gamma", "ema_decay", "alpha_mu", "mu_0", "v_floor"):
            object.__setattr__(self, name, float(getattr(self, name)))
        for name in ("evidence_decay", "min_trials"):
            object.__setattr__(self, name, float(getattr(self, name)))
        object.__setattr__(self, "prior_strength", float(self.prior_strength or 0.0))
        self.validate()

    def validate(self) -> None:
        for name, choices in (
            ("allocator", ALLOCATORS),
            ("signal", SIGNALS),
            ("feedback", FEEDBACKS),
            ("objective", OBJECTIVES),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(
                    f"RolloutGDROConfig.{name} must be one of {choices}; "
                    f"got {getattr(self, name)!r}"
                )
        if self.n_min < 2:
            raise ValueError(
                f"RolloutGDROConfig.n_min must be >= 2 (a singleton group has no "
                f"baseline); got {self.n_min}"
            )
        if self.n_max < self.n_min:
            raise ValueError(
                f"RolloutGDROConfig.n_max must be >= n_min={self.n_min}; got {self.n_max}"
            )
        if not self.n_min <= self.n_bar <= self.n_max:
            raise ValueError(
                f"RolloutGDROConfig.n_bar must be in [n_min, n_max] = "
                f"[{self.n_min}, {self.n_max}]; got {self.n_bar}"
            )
        if not self.eta > 0:
            raise ValueError(f"RolloutGDROConfig.eta must be > 0; got {self.eta}")
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"RolloutGDROConfig.gamma must be in [0, 1]; got {self.gamma}")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"RolloutGDROConfig.ema_decay must be in [0, 1); got {self.ema_decay}")
        if not self.alpha_mu >= 0:
            raise ValueError(f"RolloutGDROConfig.alpha_mu must be >= 0; got {self.alpha_mu}")
        if not self.v_floor > 0:
            raise ValueError(f"RolloutGDROConfig.v_floor must be > 0; got {self.v_floor}")
        if not 0.0 < self.evidence_decay <= 1.0:
            raise ValueError(
                f"RolloutGDROConfig.evidence_decay must be in (0, 1]; got {self.evidence_decay}"
            )
        if not self.min_trials >= 0:
            raise ValueError(f"RolloutGDROConfig.min_trials must be >= 0; got {self.min_trials}")
        if not self.prior_strength >= 0:
            raise ValueError(
                f"RolloutGDROConfig.prior_strength must be >= 0 (0 = fitted); got "
                f"{self.prior_strength}"
            )

    @property
    def arms(self) -> np.ndarray:
        """``[K]`` int, the arms ``n_min .. n_max``."""
        return np.arange(self.n_min, self.n_max + 1)

    @property
    def num_arms(self) -> int:
        return self.n_max - self.n_min + 1

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RolloutGDROConfig:
        """Builds from a mapping (dict / ml_collections.ConfigDict); unknown keys raise ValueError."""
        return _config_from_dict(cls, d)


@flax.struct.dataclass
class RolloutGDROState:
    """Rollout-GDRO state (a pytree; checkpoints with Orbax).

    Attributes:
      scores: ``[B, K]`` float32, EMA of the bandit feedback (``feedback``: the variance per
        prompt or the bin's mean loss signal) per bin and arm, updated for the chosen arm only
        (``K = n_max - n_min + 1``).
      mu: ``[]`` float32, the compute price.
      step: ``[]`` int32, number of updates.
      successes, trials: ``[N]`` float32, every prompt's decayed correct and total rollouts
        (updated for ``allocator="shrunk"`` only; ``N = 1`` when no pool size was given).
    """

    scores: jax.Array
    mu: jax.Array
    step: jax.Array
    successes: jax.Array
    trials: jax.Array


@flax.struct.dataclass
class Allocation:
    """Rollouts of one step (host numpy arrays: the allocation is host bookkeeping; it reaches
    the device only inside the batch, as the advantages' segment ids).

    Attributes:
      rollouts_per_prompt: ``[P]`` int32, each in ``[n_min, n_max]``, summing to ``R``.
      segment_ids: ``[R]`` int32, rollout row -> prompt position, sorted, contiguous groups.
      prompt_bins: ``[P]`` int32 in ``[0, B]``, the bins the allocation was computed for (this
        step's prompts; ``B`` = unseen).
      arm: ``[B]`` int32, the bin's arm (its rounded mean ``n`` for ``sqrt``/fallback), -1 if absent.
      bin_rollouts: ``[B]`` float32, mean rollouts per prompt of the bin, 0 if absent (unseen
        prompts are in no bin).
      fallback: ``[]`` bool, the bandit used the proportional fallback.
    """

    rollouts_per_prompt: np.ndarray
    segment_ids: np.ndarray
    prompt_bins: np.ndarray
    arm: np.ndarray
    bin_rollouts: np.ndarray
    fallback: np.ndarray


def rollout_gdro_init(
    config: RolloutGDROConfig, num_bins: int, num_prompts: int = 0
) -> RolloutGDROState:
    """Zero arm scores (uniform learners), ``mu = mu_0`` for ``num_bins`` bins, and zero
    evidence for ``num_prompts`` prompts (required by ``allocator="shrunk"``; ignored otherwise).

    Raises:
      ValueError: ``num_bins < 1``, or ``allocator="shrunk"`` with ``num_prompts < 1``.
    """
    if int(num_bins) < 1:
        raise ValueError(f"num_bins must be >= 1; got {num_bins}")
    n = int(num_prompts)
    if config.allocator == "shrunk" and n < 1:
        raise ValueError(f"allocator='shrunk' needs num_prompts >= 1; got {num_prompts}")
    return RolloutGDROState(
        scores=jnp.zeros((int(num_bins), config.num_arms), jnp.float32),
        mu=jnp.asarray(config.mu_0, jnp.float32),
        step=jnp.zeros((), jnp.int32),
        successes=jnp.zeros((max(n, 1),), jnp.float32),  # Orbax saves no zero-size arrays
        trials=jnp.zeros((max(n, 1),), jnp.float32),
    )


def evidence_update(
    config: RolloutGDROConfig, state: RolloutGDROState, prompt_ids, correct, segment_ids
) -> RolloutGDROState:
    """Adds one visit's rollouts to the visited prompts' counts (host numpy; ``shrunk`` only,
    a no-op otherwise): ``s <- decay s + correct``, ``t <- decay t + rollouts``; a prompt id
    that occurs twice in the visit is decayed once and takes both groups.

    Args:
      prompt_ids: ``[P]`` int dataset ids of the visit's prompts; correct: ``[R]`` bool;
      segment_ids: ``[R]`` int, rollout -> position in ``prompt_ids``.
    """
    if config.allocator != "shrunk":
        return state
    ids = np.asarray(prompt_ids, np.int64)
    seg = np.asarray(segment_ids, np.int64)
    c = np.asarray(correct, np.float64)
    s = np.asarray(state.successes, np.float64).copy()
    t = np.asarray(state.trials, np.float64).copy()
    uniq = np.unique(ids)
    s[uniq] *= config.evidence_decay
    t[uniq] *= config.evidence_decay
    np.add.at(s, ids[seg], c)
    np.add.at(t, ids[seg], 1.0)
    return state.replace(successes=jnp.asarray(s, jnp.float32), trials=jnp.asarray(t, jnp.float32))


def shrunk_posterior(config: RolloutGDROConfig, state: RolloutGDROState, prompt_ids):
    """``(prior (a, b), a_i [P], b_i [P])``: the pool's fitted Beta prior and the posterior of
    each of ``prompt_ids`` (``evidence.fit_beta_prior`` over every prompt with >= 1 trial)."""
    s = np.asarray(state.successes, np.float64)
    t = np.asarray(state.trials, np.float64)
    prior = evidence.fit_beta_prior(s, t, strength=config.prior_strength or None)
    ids = np.asarray(prompt_ids, np.int64)
    a, b = evidence.posterior(s[ids], t[ids], prior)
    return prior, a, b


def arm_probs(config: RolloutGDROConfig, state: RolloutGDROState) -> np.ndarray:
    """``[B, K]`` float64 arm probabilities ``(1 - gamma) softmax(-eta (s_b + mu a)) + gamma / K``."""
    s = -config.eta * (
        np.asarray(state.scores, np.float64)
        + float(np.asarray(state.mu)) * config.arms[None, :].astype(np.float64)
    )
    s = s - s.max(axis=1, keepdims=True)
    soft = np.exp(s) / np.exp(s).sum(axis=1, keepdims=True)
    return (1.0 - config.gamma) * soft + config.gamma / config.num_arms


# ----------------------------------------------------------------------------- integer helpers


@functools.partial(jax.jit, static_argnames=("lo", "hi"))
def _waterfill(base, slope, counts, total, lo: int, hi: int):
    """``x_b = clip(base_b + c slope_b, lo, hi)`` with ``c >= 0`` s.t. ``sum_b N_b x_b = total``."""
    base, slope = jnp.asarray(base, jnp.float32), jnp.asarray(slope, jnp.float32)
    counts = jnp.asarray(counts, jnp.float32)
    total = jnp.asarray(total, jnp.float32)
    pos = (slope > 0) & (counts > 0)
    c_hi = jnp.max(jnp.where(pos, (hi - base) / jnp.where(pos, slope, 1.0), 0.0))
    c_hi = jnp.maximum(c_hi, 0.0)

    def f(c):
        return jnp.sum(counts * jnp.clip(base + c * slope, lo, hi))

    def body(_, bounds):
        a, b = bounds
        m = 0.5 * (a + b)
        return jnp.where(f(m) < total, m, a), jnp.where(f(m) < total, b, m)

    _, c = jax.lax.fori_loop(0, 64, body, (jnp.zeros((), jnp.float32), c_hi))
    return jnp.clip(base + c * slope, lo, hi)


@functools.partial(jax.jit, static_argnames=("lo", "hi"))
def round_to_budget(x: jax.Array, total, tie_key: jax.Array, lo: int, hi: int) -> jax.Array:
    """Integers ``[P]`` int32 in ``[lo, hi]``, each ``floor(x_i)`` or ``ceil(x_i)``, summing to
    ``total`` (largest remainder; equal remainders broken by ascending ``tie_key``).

    Requires ``sum(clip(x, lo, hi))`` within ~1 of ``total`` (true for the water-filled targets).

    Args:
      x: ``[P]`` float targets; total: int budget; tie_key: ``[P]`` int (stable prompt ids).
    """
    x = jnp.clip(jnp.asarray(x, jnp.float32), lo, hi)
    f = jnp.floor(x)
    frac = x - f
    fi = f.astype(jnp.int32)
    k = jnp.asarray(total, jnp.int32) - jnp.sum(fi)
    key = jnp.asarray(tie_key)
    up_order = jnp.lexsort((key, -frac, fi >= hi))  # eligible first, largest remainder
    down_order = jnp.lexsort((key, frac, fi <= lo))  # eligible first, smallest remainder
    rank_up = jnp.argsort(up_order)
    rank_down = jnp.argsort(down_order)
    add = (rank_up < k) & (fi < hi)
    sub = (rank_down < -k) & (fi > lo)
    return (fi + add.astype(jnp.int32) - sub.astype(jnp.int32)).astype(jnp.int32)


def _finish(
    n: np.ndarray,
    prompt_bins: np.ndarray,
    num_bins: int,
    total: int,
    arm: np.ndarray | None,
    fallback: bool,
) -> Allocation:
    n = np.asarray(n, np.int32)
    bins = np.asarray(prompt_bins, np.int32)
    if int(n.sum()) != total:
        raise AssertionError(f"allocation sums to {int(n.sum())}, expected {total}")
    count = np.bincount(bins, minlength=num_bins)[:num_bins]
    mean_n = np.bincount(bins, weights=n, minlength=num_bins)[:num_bins] / np.maximum(count, 1)
    if arm is None:
        arm = np.where(count > 0, np.rint(mean_n), -1)
    seg = np.repeat(np.arange(len(n), dtype=np.int32), n)
    return Allocation(
        rollouts_per_prompt=n,
        segment_ids=seg,
        prompt_bins=bins,
        arm=np.asarray(arm, np.int32),
        bin_rollouts=np.asarray(mean_n, np.float32),
        fallback=np.asarray(bool(fallback)),
    )


def fixed_allocation(prompt_bins, n: int, num_bins: int) -> Allocation:
    """The uniform allocation: ``n`` rollouts for every prompt (GRPO, Prompt-GDRO).

    Args:
      prompt_bins: ``[P]`` int in ``[0, num_bins]`` (``num_bins`` = unseen); n: group size.
    """
    bins = np.asarray(prompt_bins, np.int32)
    return _finish(
        np.full(bins.shape, int(n), np.int32), bins, num_bins, int(n) * len(bins), None, False
    )


# ----------------------------------------------------------------------------- allocators


def solve_arms_dp(
    log_probs: np.ndarray, counts: np.ndarray, arms: np.ndarray, total: int, n_bar: float
) -> np.ndarray | None:
    """Exact-budget arm choice: ``argmax sum_b log_probs[b, k_b]`` s.t. ``sum_b counts_b arms[k_b]
    = total`` (dynamic programme over bins x running total, O(B K total) on the host).

    Exact ties go to the allocation nearest ``n_bar`` (secondary term < 1e-6 nats in total), then
    to the smaller arm. Bins with ``counts_b = 0`` are skipped (returned as -1).

    Args:
      log_probs: ``[B, K]`` float64; counts: ``[B]`` int prompts per bin; arms: ``[K]`` int
        increasing; total: budget ``R``; n_bar: target mean for tie-breaking.

    Returns:
      ``[B]`` int arm indices (-1 for empty bins), or None when no exact solution exists.
    """
    counts = np.asarray(counts, np.int64)
    arms = np.asarray(arms, np.int64)
    live = np.flatnonzero(counts > 0)
    steps = arms - arms[0]
    rd = int(total) - int(counts.sum()) * int(arms[0])
    if rd < 0:
        return None
    k_num = len(arms)
    eps = 1e-6 / (1.0 + float(total) * float(steps[-1]) ** 2)
    value = np.full(rd + 1, -np.inf)
    value[0] = 0.0
    choices = np.zeros((len(live), rd + 1), np.int16)
    cand = np.empty((k_num, rd + 1))
    for j, b in enumerate(live):
        score = np.asarray(log_probs[b], np.float64) - eps * counts[b] * (arms - float(n_bar)) ** 2
        cand.fill(-np.inf)
        for k in range(k_num):
            shift = int(counts[b] * steps[k])
            if shift <= rd:
                cand[k, shift:] = value[: rd + 1 - shift] + score[k]
        choices[j] = np.argmax(cand, axis=0)
        value = cand[choices[j], np.arange(rd + 1)]
    if not np.isfinite(value[rd]):
        return None
    out = np.full(len(counts), -1, np.int64)
    t = rd
    for j in range(len(live) - 1, -1, -1):
        k = int(choices[j, t])
        out[live[j]] = k
        t -= int(counts[live[j]] * steps[k])
    assert t == 0
    return out


def _budget(config: RolloutGDROConfig, num_prompts: int, total: int | None) -> int:
    r = num_prompts * config.n_bar if total is None else int(total)
    if not num_prompts * config.n_min <= r <= num_prompts * config.n_max:
        raise ValueError(
            f"total rollouts {r} is outside [P*n_min, P*n_max] = "
            f"[{num_prompts * config.n_min}, {num_prompts * config.n_max}] for P={num_prompts}"
        )
    return r


def sqrt_targets(config: RolloutGDROConfig, counts, bin_success, total=None) -> jax.Array:
    """Continuous Neyman allocation ``[B]`` float32 under the bounds (water-filled) with
    ``sum_b counts_b n_b = total`` (default ``sum(counts) n_bar``). Thm 4.2: ``n_b ∝ sqrt(v_b)``,
    ``v_b = p_b (1 - p_b) + v_floor``; without binding bounds
    ``n_b = n_bar sqrt(v_b) / sum_j share_j sqrt(v_j)``."""
    p = jnp.clip(jnp.asarray(bin_success, jnp.float32), 0.0, 1.0)
    v = p * (1.0 - p) + config.v_floor
    counts = jnp.asarray(counts, jnp.float32)
    total = jnp.sum(counts) * config.n_bar if total is None else total
    return _waterfill(
        jnp.zeros_like(v), jnp.sqrt(v), counts, total, lo=config.n_min, hi=config.n_max
    )


def _unseen_target(config: RolloutGDROConfig, n_seen, n_unseen, total):
    """Rollouts per unseen prompt: ``n_bar``, moved only as far as keeps the seen prompts'
    budget ``total - n_unseen t`` within ``[n_seen n_min, n_seen n_max]`` (``n_bar`` exactly when
    ``total = P n_bar``). Works on numpy and jax scalars."""
    nu = jnp.maximum(jnp.asarray(n_unseen, jnp.float32), 1.0)
    lo = (total - n_seen * config.n_max) / nu
    hi = (total - n_seen * config.n_min) / nu
    t = jnp.clip(jnp.clip(float(config.n_bar), lo, hi), config.n_min, config.n_max)
    return jnp.where(jnp.asarray(n_unseen) > 0, t, float(config.n_bar))


@functools.partial(jax.jit, static_argnames=("config", "num_bins"))
def sqrt_allocation(
    config: RolloutGDROConfig,
    prompt_bins: jax.Array,
    bin_success: jax.Array,
    tie_key: jax.Array,
    num_bins: int,
    total=None,
) -> jax.Array:
    """Jittable ``sqrt`` allocator: rollouts per prompt ``[P]`` int32 in ``[n_min, n_max]``,
    each ``floor`` or ``ceil`` of its bin's ``sqrt_targets``, summing to ``total``
    (default ``P * n_bar``) exactly for every feasible ``total`` in ``[P n_min, P n_max]``.

    Unseen prompts (bin ``num_bins``) target ``n_bar`` (see ``_unseen_target``); the seen bins
    share the rest.

    Args:
      prompt_bins: ``[P]`` int32 bins in ``[0, num_bins]``; bin_success: ``[B]`` float success
        rate per bin (``classifier.bin_success``); tie_key: ``[P]`` int (prompt ids) for rounding
        ties; num_bins: ``B`` (static); total: optional int budget (traced).
    """
    bins = jnp.asarray(prompt_bins, jnp.int32)
    total = bins.shape[0] * config.n_bar if total is None else total
    counts = jax.ops.segment_sum(jnp.ones(bins.shape, jnp.float32), bins, num_bins)
    n_seen = jnp.sum(counts)
    n_unseen = bins.shape[0] - n_seen
    t_u = _unseen_target(config, n_seen, n_unseen, total)
    x = sqrt_targets(config, counts, bin_success, total - n_unseen * t_u)
    x = jnp.where(bins < num_bins, x[jnp.clip(bins, 0, num_bins - 1)], t_u)
    return round_to_budget(x, total, tie_key, lo=config.n_min, hi=config.n_max)


def shrunk_allocation(
    config: RolloutGDROConfig, state: RolloutGDROState, prompt_ids, total: int | None = None
) -> np.ndarray:
    """``shrunk`` allocator: rollouts per prompt ``[P]`` int32, exactly optimal for
    ``config.objective`` under each prompt's posterior (``evidence.greedy_allocation``), every
    prompt in ``[n_min, n_max]``, prompts with ``trials < min_trials`` (incl. unseen ones) at
    least ``n_bar``, summing to ``total`` (default ``P * n_bar``) exactly.

    Args:
      prompt_ids: ``[P]`` int dataset ids (index ``state.successes``; ties go to the smaller id).
    """
    ids = np.asarray(prompt_ids, np.int64)
    total = ids.size * config.n_bar if total is None else int(total)
    _, a, b = shrunk_posterior(config, state, ids)
    gains = evidence.marginal_gains(
        a, b, config.n_max, objective=config.objective, v_floor=config.v_floor
    )
    little = np.asarray(state.trials, np.float64)[ids] < config.min_trials
    lower = np.where(little, max(config.n_min, min(config.n_bar, total // ids.size)), config.n_min)
    return evidence.greedy_allocation(gains, lower, config.n_max, total, ids)


def allocate(
    config: RolloutGDROConfig,
    state: RolloutGDROState,
    prompt_bins,
    bin_success=None,
    *,
    prompt_ids=None,
    total: int | None = None,
) -> Allocation:
    """Rollouts per prompt for this step's prompts (Eq. 17-21).

    Unseen prompts (bin ``B``) get ``n_bar`` each; the seen bins share the rest of ``R``.

    Args:
      config: ``RolloutGDROConfig``.
      state: ``RolloutGDROState`` (``B = state.scores.shape[0]``).
      prompt_bins: ``[P]`` int bins of *this step's* prompts (``classify``), in ``[0, B]``.
      bin_success: ``[B]`` float per-bin success rate, required by ``sqrt``
        (``classifier.bin_success``).
      prompt_ids: optional ``[P]`` int stable ids, used to break rounding ties so that the
        allocation of a prompt does not depend on its position in the batch (default: position).
      total: budget ``R`` (default ``P * n_bar``; other values are for tests and give the fallback
        when infeasible).

    Returns:
      ``Allocation`` with exactly ``R`` rollouts, every prompt in ``[n_min, n_max]``.

    Raises:
      ValueError: bins outside ``[0, B]``, ``bin_success`` missing for ``sqrt``, or ``total``
        outside ``[P n_min, P n_max]``.
    """
    bins = np.asarray(prompt_bins, np.int64)
    num_bins = int(state.scores.shape[0])
    if bins.ndim != 1 or bins.size == 0:
        raise ValueError(f"prompt_bins must be a non-empty [P] array; got shape {bins.shape}")
    if bins.min() < 0 or bins.max() > num_bins:
        raise ValueError(
            f"prompt_bins must lie in [0, {num_bins}] ({num_bins} = unseen); "
            f"got [{bins.min()}, {bins.max()}]"
        )
    num = bins.size
    r = _budget(config, num, total)
    key = (np.arange(num) if prompt_ids is None else np.asarray(prompt_ids)).astype(np.int32)
    seen = bins < num_bins
    counts = np.bincount(bins[seen], minlength=num_bins)
    n_unseen = int(num - seen.sum())

    if config.allocator == "shrunk":
        if prompt_ids is None:
            raise ValueError("allocator='shrunk' needs prompt_ids [P] (dataset ids)")
        return _finish(shrunk_allocation(config, state, key, r), bins, num_bins, r, None, False)

    if config.allocator == "sqrt":
        if bin_success is None:
            raise ValueError("allocator='sqrt' needs bin_success [B] (classifier.bin_success)")
        n = sqrt_allocation(
            config,
            jnp.asarray(bins, jnp.int32),
            jnp.asarray(bin_success),
            jnp.asarray(key),
            num_bins,
            r,
        )
        return _finish(np.asarray(n), bins, num_bins, r, None, False)

    probs = arm_probs(config, state)
    arms = config.arms
    t_u = float(_unseen_target(config, int(seen.sum()), n_unseen, r))
    choice = None
    if float(t_u).is_integer():
        logp = np.log(probs)
        if config.count_weighted_dp:  # sum_b N_b log p_b(a_b)
            logp = logp * counts[:, None]
        choice = solve_arms_dp(logp, counts, arms, r - n_unseen * int(t_u), config.n_bar)
    if choice is not None:
        arm = np.where(choice >= 0, arms[np.maximum(choice, 0)], -1)
        n = np.where(seen, arm[np.minimum(bins, num_bins - 1)], int(t_u))
        return _finish(n, bins, num_bins, r, arm, False)
    weight = probs @ arms - config.n_min + 1e-6  # bin weight E_p[a] - n_min
    x = _waterfill(
        np.full(num_bins, config.n_min, np.float32),
        weight,
        counts,
        r - n_unseen * t_u,
        lo=config.n_min,
        hi=config.n_max,
    )
    x = jnp.where(jnp.asarray(seen), jnp.asarray(x)[np.minimum(bins, num_bins - 1)], t_u)
    n = round_to_budget(x, r, jnp.asarray(key), lo=config.n_min, hi=config.n_max)
    return _finish(np.asarray(n), bins, num_bins, r, None, True)


# ----------------------------------------------------------------------------- update


@functools.partial(jax.jit, static_argnames="config")
def _update(
    config: RolloutGDROConfig,
    state: RolloutGDROState,
    rollout_bins,
    signal,
    arm,
    prompt_count,
    prompt_bins=None,
    rewards=None,
    segment_ids=None,
):
    b, k_num = state.scores.shape
    if config.feedback == "loss":  # paper: -J_b = the bin's mean loss signal
        bins = jnp.asarray(rollout_bins, jnp.int32)
        cnt = jax.ops.segment_sum(jnp.ones(bins.shape, jnp.float32), bins, b)
        feedback = jax.ops.segment_sum(jnp.asarray(signal, jnp.float32), bins, b) / jnp.maximum(
            cnt, 1.0
        )
    else:  # variance per prompt of the group mean, (s_i^2 + v_floor) / n_i, mean over the bin
        pb = jnp.asarray(prompt_bins, jnp.int32)
        num = pb.shape[0]
        seg = jnp.asarray(segment_ids, jnp.int32)
        r = jnp.asarray(rewards, jnp.float32)
        n = jax.ops.segment_sum(jnp.ones(seg.shape, jnp.float32), seg, num)
        mean = jax.ops.segment_sum(r, seg, num) / jnp.maximum(n, 1.0)
        ss = jax.ops.segment_sum((r - mean[seg]) ** 2, seg, num)
        var = jnp.where(n >= 2, ss / jnp.maximum(n - 1.0, 1.0), 0.0)
        per_prompt = (var + config.v_floor) / jnp.maximum(n, 1.0)
        cnt = prompt_count
        feedback = jax.ops.segment_sum(per_prompt, pb, b) / jnp.maximum(cnt, 1.0)
    present = (cnt > 0) & (arm >= 0)
    idx = jnp.clip(arm - config.n_min, 0, k_num - 1)
    old = state.scores[jnp.arange(b), idx]
    new_s = config.ema_decay * old + (1.0 - config.ema_decay) * feedback
    scores = state.scores.at[jnp.arange(b), idx].set(jnp.where(present, new_s, old))
    arms = jnp.arange(config.n_min, config.n_max + 1, dtype=jnp.float32)
    logits = -config.eta * (state.scores + state.mu * arms)  # the learners that allocated
    probs = (1.0 - config.gamma) * jax.nn.softmax(logits, axis=1) + config.gamma / k_num
    share = prompt_count / jnp.maximum(jnp.sum(prompt_count), 1.0)
    n_hat = jnp.sum(share * (probs @ arms))
    mu = state.mu + config.alpha_mu * (n_hat - config.n_bar)
    return state.replace(scores=scores, mu=mu.astype(jnp.float32), step=state.step + 1)


def rollout_gdro_update(
    config: RolloutGDROConfig,
    state: RolloutGDROState,
    allocation: Allocation,
    prompt_bins,
    loss_signal,
    rewards=None,
    segment_ids=None,
    *,
    bin_success=None,
    prompt_ids=None,
) -> tuple[RolloutGDROState, dict[str, Any]]:
    """Bandit update after the step (Eq. 20-21); returns ``(state, diagnostics)``.

    The chosen arm of every present (seen) bin takes the EMA of the feedback (``feedback``:
    ``mean_{i in b} (s_i^2 + v_floor) / n_i`` from the rewards, or the paper's ``-J_b`` = the
    bin's mean loss signal); ``mu`` takes a dual-ascent step with the learners that made this
    allocation. With ``allocator="sqrt"`` only ``step`` advances (scores and ``mu`` are the
    bandit's). Diagnostics: ``rollout_gdro_diagnostics``.

    Args:
      allocation: the ``Allocation`` used this step.
      prompt_bins: ``[P]`` int, this step's prompt bins (must equal ``allocation.prompt_bins``).
      loss_signal: ``[R]`` float, per-rollout loss signal (``loss_signal()``), detached; used by
        ``feedback="loss"`` only (pass anything of shape ``[R]`` otherwise).
      rewards: ``[R]`` float, required by ``feedback="variance"`` (bandit); else optional, for
        the per-bin reward and the WSE diagnostics.
      segment_ids: optional ``[R]``; must equal ``allocation.segment_ids`` if given.
      bin_success: optional ``[B]`` float, the per-bin success rate given to ``allocate`` (for the
        paper's WSE proxy; pass it for every allocator).
      prompt_ids: optional ``[P]`` int, the step's dataset ids; with ``allocator="shrunk"`` the
        diagnostics add the prior (``rollout_gdro/prior_mean``, ``prior_strength``) and the
        expected informative groups under the posteriors that made the allocation, for it and
        for ``n_bar`` each (``rollout_gdro/expected_informative``, ``..._uniform``). The counts
        themselves are added by ``evidence_update`` (per visit), not here.

    Raises:
      ValueError when ``prompt_bins`` / ``segment_ids`` are not the allocation's own, or
      ``rewards`` is missing for the bandit with ``feedback="variance"``.
    """
    bins = np.asarray(prompt_bins, np.int32)
    seg = np.asarray(allocation.segment_ids)
    if not np.array_equal(bins, np.asarray(allocation.prompt_bins)):
        raise ValueError("prompt_bins differ from the bins the allocation was computed for")
    if segment_ids is not None and not np.array_equal(np.asarray(segment_ids), seg):
        raise ValueError("segment_ids differ from allocation.segment_ids")
    b = int(state.scores.shape[0])
    if config.allocator == "bandit":
        count = jnp.asarray(np.bincount(bins, minlength=b)[:b], jnp.float32)
        if config.feedback == "loss":
            new = _update(
                config,
                state,
                jnp.asarray(bins[seg]),
                jnp.asarray(loss_signal),
                jnp.asarray(allocation.arm),
                count,
            )
        else:
            if rewards is None:
                raise ValueError("feedback='variance' needs rewards [R]")
            new = _update(
                config,
                state,
                None,
                None,
                jnp.asarray(allocation.arm),
                count,
                jnp.asarray(bins),
                jnp.asarray(rewards, jnp.float32),
                jnp.asarray(seg),
            )
    else:
        new = state.replace(step=state.step + 1)
    diag = rollout_gdro_diagnostics(
        config, new, allocation, rewards=rewards, bin_success=bin_success
    )
    if config.allocator == "shrunk" and prompt_ids is not None:
        (pa, pb), a, b_ = shrunk_posterior(config, state, prompt_ids)
        n = np.asarray(allocation.rollouts_per_prompt)
        diag["rollout_gdro/prior_mean"] = pa / (pa + pb)
        diag["rollout_gdro/prior_strength"] = pa + pb
        diag["rollout_gdro/expected_informative"] = float(
            evidence.expected_informative(a, b_, n).sum()
        )
        diag["rollout_gdro/expected_informative_uniform"] = float(
            evidence.expected_informative(a, b_, np.full(n.shape, config.n_bar)).sum()
        )
    return new, diag


def pooled_bin_std(rewards, segment_ids, prompt_bins, num_bins: int) -> np.ndarray:
    """``[B]`` float64: ``sqrt`` of the mean over a bin's prompts of the unbiased within-group
    reward variance (groups of >= 2 rollouts); NaN for absent bins; unseen prompts (bin ``B``)
    left out."""
    r = np.asarray(rewards, np.float64)
    seg = np.asarray(segment_ids, np.int64)
    bins = np.asarray(prompt_bins, np.int64)
    num = len(bins)
    n = np.bincount(seg, minlength=num).astype(np.float64)
    mean = np.bincount(seg, weights=r, minlength=num) / np.maximum(n, 1)
    ss = np.bincount(seg, weights=(r - mean[seg]) ** 2, minlength=num)
    var = np.where(n >= 2, ss / np.maximum(n - 1, 1), 0.0)
    cnt = np.bincount(bins, minlength=num_bins)[:num_bins]
    tot = np.bincount(bins, weights=var, minlength=num_bins)[:num_bins]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(cnt > 0, np.sqrt(tot / cnt), np.nan)


def weighted_standard_error(rollouts_per_prompt, prompt_bins, bin_sigma) -> float:
    """WSE proxy ``sum_b share_b sigma_b / sqrt(n_b)`` (spec s.4), per prompt:
    ``mean_i sigma_{b(i)} / sqrt(n_i)`` over the seen prompts (bins ``< len(bin_sigma)``; NaN if
    none); ``grpo_jax.metrics.weighted_standard_error`` with each prompt's bin sigma."""
    sigma = np.asarray(bin_sigma, np.float64)
    bins = np.asarray(prompt_bins)
    m = bins < len(sigma)
    if not m.any():
        return float("nan")
    n = np.asarray(rollouts_per_prompt, np.float64)[m]
    return metrics.weighted_standard_error(n, sigma=np.nan_to_num(sigma[bins[m]]))


def rollout_gdro_diagnostics(
    config: RolloutGDROConfig,
    state: RolloutGDROState,
    allocation: Allocation,
    *,
    rewards=None,
    bin_success=None,
) -> dict[str, Any]:
    """Per-step diagnostics (spec s.4) as host numpy.

    Keys: ``rollout_gdro/n_b [B]`` (mean rollouts per prompt of the bin, 0 if absent),
    ``rollout_gdro/prompt_share [B]``, ``rollout_gdro/budget_share [B]`` (``N_b n_b / R``),
    ``rollout_gdro/unseen_prompt_share``, ``rollout_gdro/unseen_budget_share`` (unseen prompts:
    in no bin, left out of the WSE),
    ``rollout_gdro/alloc_entropy`` (of the budget share, nats), ``rollout_gdro/mu``,
    ``rollout_gdro/fallback``. With ``bin_success`` (the classifier's per-bin success rate, the
    paper's proxy ``sigma_b = sqrt(p_b (1 - p_b))``): ``rollout_gdro/wse``,
    ``rollout_gdro/wse_uniform`` (same batch, all prompts at ``n_bar``), ``rollout_gdro/wse_ratio``.
    With ``rewards``: the same three as ``rollout_gdro/wse_pooled*`` with ``sigma_b`` the pooled
    within-group reward std (``pooled_bin_std``). Plus the ``gdro/`` keys of
    ``prompt_gdro_diagnostics`` over the rollouts (bin share of rollouts, ``gdro/bin_reward``, ...).
    """
    b = int(state.scores.shape[0])
    n = np.asarray(allocation.rollouts_per_prompt, np.int64)
    bins = np.asarray(allocation.prompt_bins, np.int64)
    seg = np.asarray(allocation.segment_ids, np.int64)
    r_total = max(int(n.sum()), 1)
    all_budget = np.bincount(bins, weights=n, minlength=b) / r_total
    budget = all_budget[:b]
    prompts = np.bincount(bins, minlength=b) / len(bins)
    out: dict[str, Any] = {
        "rollout_gdro/n_b": np.asarray(allocation.bin_rollouts, np.float32),
        "rollout_gdro/prompt_share": prompts[:b].astype(np.float32),
        "rollout_gdro/unseen_prompt_share": float(prompts[b:].sum()),
        "rollout_gdro/unseen_budget_share": float(all_budget[b:].sum()),
        "rollout_gdro/budget_share": budget.astype(np.float32),
        "rollout_gdro/alloc_entropy": _entropy(budget),
        "rollout_gdro/mu": float(np.asarray(state.mu)),
        "rollout_gdro/fallback": int(bool(np.asarray(allocation.fallback))),
    }
    sigmas = {}
    if bin_success is not None:  # the paper's proxy: sigma_b^2 = p_b (1 - p_b)
        p = np.clip(np.asarray(bin_success, np.float64), 0, 1)
        sigmas["wse"] = np.sqrt(p * (1 - p))
    if rewards is not None:  # pooled within-group reward std
        sigmas["wse_pooled"] = pooled_bin_std(rewards, seg, bins, b)
    for name, sigma in sigmas.items():
        wse = weighted_standard_error(n, bins, sigma)
        wse_u = weighted_standard_error(np.full(n.shape, config.n_bar), bins, sigma)
        out[f"rollout_gdro/{name}"] = wse
        out[f"rollout_gdro/{name}_uniform"] = wse_u
        out[f"rollout_gdro/{name}_ratio"] = wse / wse_u if wse_u > 0 else float("nan")
    out.update(prompt_gdro_diagnostics(b, bins[seg], rewards=rewards))
    return out


__all__ = [
    "RolloutGDROConfig",
    "RolloutGDROState",
    "Allocation",
    "rollout_gdro_init",
    "evidence_update",
    "shrunk_allocation",
    "shrunk_posterior",
    "allocate",
    "arm_probs",
    "solve_arms_dp",
    "sqrt_allocation",
    "sqrt_targets",
    "round_to_budget",
    "fixed_allocation",
    "rollout_gdro_update",
    "rollout_gdro_diagnostics",
    "pooled_bin_std",
    "weighted_standard_error",
    "ALLOCATORS",
    "FEEDBACKS",
    "OBJECTIVES",
]
