"""The field's pass-rate curricula, registered beside GDRO (the comparison of
reports/gdro_fair_test/): each turns per-prompt pass rates into a sampling decision.

* `DynamicSampling` (DAPO, Yu et al. 2025, arXiv 2503.14476, Eq. 11): after generation, drop
  the groups whose rewards are all equal and sample more rounds until P groups are left.
* `OnlineDifficultyFilter` (Bae et al. 2025, arXiv 2504.03380, "balanced" filtering): after
  generation, keep the groups whose estimated pass rate lies in a band, more rounds as above.
* `LearnabilitySampling` (Foster & Foerster 2025, arXiv 2502.12272; the issue's Tzannetos et al.
  2025): before generation, draw prompts with probability proportional to ``p (1 - p)``.
* `GRESO` (Zheng et al. 2025, arXiv 2506.02177, Alg. 1): before generation, skip a prompt whose
  last ``z`` visits were all zero-variance with probability ``1 - p_e ** z``.

All read the shared online classifier (`grpo_jax.gdro`: every prompt's window of visit success
rates) as their evidence; each has a setting that is GRPO bit for bit (docs/curricula.md lists
the settings, each paper's rule and our deviations).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import flax
import jax.numpy as jnp
import numpy as np

from grpo_jax import gdro
from grpo_jax import transfer as xfer
from grpo_jax.algorithms.base import Curriculum, CurriculumState, StepOutcome
from grpo_jax.gdro.classifier import _config_from_dict


def _window(classifier_config, state: CurriculumState, ids: np.ndarray):
    """(p_hat [n] float64, visits [n] int64) of prompts ``ids`` from the classifier's window."""
    ids = xfer.put(np.asarray(ids, np.int32))
    with xfer.controllers():
        p = gdro.success_estimate(classifier_config, state.classifier, ids)
        count = state.classifier.count[ids]
    p, count = xfer.to_host((p, count))
    return np.asarray(p, np.float64), np.asarray(count, np.int64)


def group_success(correct: np.ndarray, segment_ids: np.ndarray, num_groups: int):
    """(correct count c [P] float64, rollouts n [P] float64) per group from [R] arrays."""
    c = np.bincount(segment_ids, weights=np.asarray(correct, np.float64), minlength=num_groups)
    n = np.bincount(segment_ids, minlength=num_groups).astype(np.float64)
    return c, n


# ----------------------------------------------------------------------------- DAPO


@dataclasses.dataclass(frozen=True)
class DynamicSampling(Curriculum):
    """DAPO dynamic sampling (Yu et al. 2025, Eq. 11: keep groups with ``0 < #correct < G``):
    the base `Curriculum.keep_groups` (rewards not all equal), more rounds of P prompts until P
    such groups (at most ``config.algorithm.dynamic_sampling_max_rounds`` extra rounds; the
    batch is topped up with dropped groups when they run out). The same as
    ``config.algorithm.dynamic_sampling=True`` on GRPO, registered as its own arm."""

    filters_groups = True


# ----------------------------------------------------------------------------- Bae et al.


@dataclasses.dataclass(frozen=True)
class FilterConfig:
    """Online difficulty filtering (``config.curricula.filter``).

    Attributes:
      low, high: the band of estimated pass rates kept, ``0 <= low <= high <= 1`` (Bae et al.:
        0.25 and 0.75, "balanced"). ``low = 0, high = 1`` keeps every group (GRPO).
      estimate: ``"group"`` (the paper: the group's own share correct ``c / n``) or
        ``"window"`` (the classifier's window and this visit pooled: ``(p_hat m + c / n) /
        (m + 1)`` for a prompt with ``m`` stored visits; with n = 4 the group share takes only
        the values 0, 1/4, ..., 1, so the band [0.25, 0.75] is DAPO's rule exactly).

    Raises: ValueError naming the field.
    """

    low: float = 0.25
    high: float = 0.75
    estimate: str = "group"

    def __post_init__(self):
        object.__setattr__(self, "low", float(self.low))
        object.__setattr__(self, "high", float(self.high))
        if not 0.0 <= self.low <= self.high <= 1.0:
            raise ValueError(
                f"FilterConfig: need 0 <= low <= high <= 1; got low={self.low}, high={self.high}"
            )
        if self.estimate not in ("group", "window"):
            raise ValueError(f"FilterConfig.estimate must be group | window; got {self.estimate!r}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FilterConfig:
        return _config_from_dict(cls, d)


def pass_rate_in_band(rate: np.ndarray, low: float, high: float) -> np.ndarray:
    """[P] bool: ``low <= rate <= high`` (closed band, 1e-9 slack for float rates)."""
    rate = np.asarray(rate, np.float64)
    return (rate >= low - 1e-9) & (rate <= high + 1e-9)


@dataclasses.dataclass(frozen=True)
class OnlineDifficultyFilter(Curriculum):
    """Online difficulty filtering (Bae et al. 2025, Sec. 3, "balanced online difficulty
    filtering"): a group is kept when its estimated pass rate is in ``[low, high]``
    (`FilterConfig`); more rounds as in `DynamicSampling`. Deviation: the paper oversamples
    one large batch and fills the next from it; here a round is P prompts (as DAPO's) and a
    batch short of P kept groups after the last round is topped up with filtered ones."""

    filter_config: FilterConfig = FilterConfig()
    filters_groups = True

    @classmethod
    def config_kwargs(cls, run) -> dict:
        return {**super().config_kwargs(run), "filter_config": run.curricula.filter}

    def keep_groups(self, state, ids, rewards, correct, segment_ids) -> np.ndarray:
        del rewards
        c, n = group_success(correct, segment_ids, len(ids))
        rate = c / np.maximum(n, 1.0)
        if self.filter_config.estimate == "window":
            p_hat, m = _window(self.classifier_config, state, ids)
            rate = (p_hat * m + rate) / (m + 1.0)
        return pass_rate_in_band(rate, self.filter_config.low, self.filter_config.high)


# ----------------------------------------------------------------------------- learnability


@dataclasses.dataclass(frozen=True)
class LearnabilityConfig:
    """Learnability sampling (``config.curricula.learnability``).

    Attributes:
      uniform_mix: ``eps`` in ``q = (1 - eps) q_learn + eps / N``, in [0, 1]; 1 = uniform, and
        then the draw is GRPO's own prompt stream (bit for bit).
      unseen_p: the pass rate assumed for a never-visited prompt, in [0, 1] (0.5: the largest
        learnability, so every prompt is tried early).

    Raises: ValueError naming the field.
    """

    uniform_mix: float = 0.0
    unseen_p: float = 0.5

    def __post_init__(self):
        for name in ("uniform_mix", "unseen_p"):
            v = float(getattr(self, name))
            object.__setattr__(self, name, v)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"LearnabilityConfig.{name} must be in [0, 1]; got {v}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LearnabilityConfig:
        return _config_from_dict(cls, d)


def learnability_probs(
    p_hat: np.ndarray, seen: np.ndarray, config: LearnabilityConfig
) -> np.ndarray:
    """Per-prompt draw probabilities ``q [N]`` float64 (a distribution).

    ``l_i = p_i (1 - p_i)`` with ``p_i = p_hat_i`` for seen prompts, ``unseen_p`` otherwise
    (Foster & Foerster 2025, Sec. 3: sampling for learnability, ``p (1 - p)``);
    ``q = (1 - eps) l / sum(l) + eps / N``; when every ``l_i = 0`` the learnability part is
    uniform.

    Args:
      p_hat: [N] float, the classifier's window success estimates; seen: [N] bool.
    """
    p = np.where(np.asarray(seen, bool), np.asarray(p_hat, np.float64), config.unseen_p)
    learn = np.clip(p * (1.0 - p), 0.0, None)
    n = learn.size
    part = learn / learn.sum() if learn.sum() > 0 else np.full(n, 1.0 / n)
    eps = config.uniform_mix
    return (1.0 - eps) * part + eps / n


@dataclasses.dataclass(frozen=True)
class LearnabilitySampling(Curriculum):
    """Learnability sampling: each of the step's P prompts is drawn (with replacement) from the
    pool with probability `learnability_probs` (the classifier's window success rates).
    Deviation: Foster & Foerster keep a buffer of the highest-learnability questions and
    sample from it; we sample the whole pool (no buffer size to tune). ``uniform_mix = 1`` (or
    the first step) takes GRPO's stream."""

    learnability_config: LearnabilityConfig = LearnabilityConfig()

    @classmethod
    def config_kwargs(cls, run) -> dict:
        return {**super().config_kwargs(run), "learnability_config": run.curricula.learnability}

    def draw_probs(self, state: CurriculumState) -> np.ndarray:
        """q [N] float64 over the pool (`learnability_probs` of the classifier's window)."""
        p_hat, count = _window(self.classifier_config, state, np.arange(self.num_prompts))
        return learnability_probs(p_hat, count > 0, self.learnability_config)

    def draw(self, state: CurriculumState, source, step: int) -> list[dict]:
        if step == 0 or self.learnability_config.uniform_mix >= 1.0:
            return source.next()
        # each prompt its own "bin": the source's resumable weighted draw
        return source.next_by_bin(self.draw_probs(state), np.arange(self.num_prompts))


# ----------------------------------------------------------------------------- GRESO


@dataclasses.dataclass(frozen=True)
class GRESOConfig:
    """GRESO's pre-rollout skipping (``config.curricula.greso``).

    Attributes:
      p_init: the exploration probabilities' start, for easy (all-correct) and hard
        (all-wrong) zero-variance prompts alike, in [p_min, 1].
      p_min: their floor, in [0, 1].
      delta: their step per RL step (Alg. 1's ``Delta p``), >= 0.
      target: the wanted share of zero-variance groups of each kind in a batch (Alg. 1's
        ``alpha``, split equally between easy and hard), in [0, 1].
      max_draws: candidate batches of P drawn from the stream per step before the step is
        filled with skipped prompts, >= 1.
      ``p_init = 1, delta = 0`` never skips: GRPO bit for bit.

    Raises: ValueError naming the field.
    """

    p_init: float = 0.5
    p_min: float = 0.05
    delta: float = 0.01
    target: float = 0.125
    max_draws: int = 8

    def __post_init__(self):
        for name in ("p_init", "p_min", "delta", "target"):
            object.__setattr__(self, name, float(getattr(self, name)))
        object.__setattr__(self, "max_draws", int(self.max_draws))
        if not 0.0 <= self.p_min <= self.p_init <= 1.0:
            raise ValueError(
                f"GRESOConfig: need 0 <= p_min <= p_init <= 1; got {self.p_min}, {self.p_init}"
            )
        if self.delta < 0 or not 0.0 <= self.target <= 1.0:
            raise ValueError(
                f"GRESOConfig: need delta >= 0, target in [0, 1]; got {self.delta}, {self.target}"
            )
        if self.max_draws < 1:
            raise ValueError(f"GRESOConfig.max_draws must be >= 1; got {self.max_draws}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GRESOConfig:
        return _config_from_dict(cls, d)


@flax.struct.dataclass
class GRESOState:
    """GRESO's state (a pytree, checkpointed with the run).

    Attributes:
      streak: [N] int32, consecutive zero-variance visits of each prompt (0 after an
        informative one). last_easy: [N] bool, the last zero-variance visit was all correct.
      p_easy, p_hard: [] float32, the exploration probabilities.
    """

    streak: Any
    last_easy: Any
    p_easy: Any
    p_hard: Any


def greso_skip_probs(streak, last_easy, p_easy: float, p_hard: float) -> np.ndarray:
    """[n] float64: ``1 - p_e ** z`` (Zheng et al. 2025, Alg. 1), ``p_e`` = ``p_easy`` for a
    prompt whose last zero-variance visit was all correct, else ``p_hard``; 0 when ``z = 0``."""
    p_e = np.where(np.asarray(last_easy, bool), float(p_easy), float(p_hard))
    return 1.0 - p_e ** np.asarray(streak, np.float64)


def greso_update(
    config: GRESOConfig, state: GRESOState, visits
) -> tuple[GRESOState, dict[str, float]]:
    """GRESO's state after the step's ``visits`` (`algorithms.Visit`, host arrays).

    Per visited prompt: all rollouts correct or all wrong -> ``streak + 1`` and ``last_easy``
    = all correct; otherwise ``streak = 0``. Per kind k (easy, hard), with ``s_k`` the share of
    the step's groups that were zero-variance of that kind: ``p_k - delta`` if ``s_k > target``
    else ``p_k + delta``, clipped to ``[p_min, 1]``. Returns (state, diagnostics).
    """
    streak = np.asarray(state.streak).copy()
    last_easy = np.asarray(state.last_easy).copy()
    easy = hard = groups = 0
    for v in visits:
        c, n = group_success(v.correct, v.segment_ids, len(v.ids))
        all_ok, all_bad = (c == n) & (n > 0), c == 0
        zero = all_ok | all_bad
        streak[v.ids] = np.where(zero, streak[v.ids] + 1, 0)
        last_easy[v.ids] = np.where(zero, all_ok, last_easy[v.ids])
        easy, hard, groups = (
            easy + int(all_ok.sum()),
            hard + int(all_bad.sum()),
            groups + len(v.ids),
        )
    shares = (easy / max(groups, 1), hard / max(groups, 1))
    new_p = [
        float(
            np.clip(p - config.delta if s > config.target else p + config.delta, config.p_min, 1.0)
        )
        for p, s in zip((float(state.p_easy), float(state.p_hard)), shares)
    ]
    new = GRESOState(
        streak=jnp.asarray(streak, jnp.int32),
        last_easy=jnp.asarray(last_easy, bool),
        p_easy=jnp.asarray(new_p[0], jnp.float32),
        p_hard=jnp.asarray(new_p[1], jnp.float32),
    )
    diag = {
        "greso/p_easy": new_p[0],
        "greso/p_hard": new_p[1],
        "greso/zero_variance_easy": shares[0],
        "greso/zero_variance_hard": shares[1],
    }
    return new, diag


@dataclasses.dataclass(frozen=True)
class GRESO(Curriculum):
    """GRESO-style pre-rollout skipping (Zheng et al. 2025, Alg. 1): candidates come from
    GRPO's stream in batches of P; each is skipped with `greso_skip_probs` (a seeded draw per
    step, so a resumed run repeats it) until P are taken; after ``max_draws`` batches the step
    is filled with skipped candidates in stream order. Deviation: GRESO grows its rollout batch
    adaptively to fill a fixed training batch; here P prompts are generated per step and the
    budget is matched in tokens by the comparison (experiments/compare)."""

    greso_config: GRESOConfig = GRESOConfig()
    seed: int = 0

    @classmethod
    def config_kwargs(cls, run) -> dict:
        return {**super().config_kwargs(run), "greso_config": run.curricula.greso, "seed": run.seed}

    def init_controller(self) -> GRESOState:
        p = self.greso_config.p_init
        return GRESOState(
            streak=jnp.zeros((self.num_prompts,), jnp.int32),
            last_easy=jnp.zeros((self.num_prompts,), bool),
            p_easy=jnp.asarray(p, jnp.float32),
            p_hard=jnp.asarray(p, jnp.float32),
        )

    def draw(self, state: CurriculumState, source, step: int) -> list[dict]:
        g = xfer.to_host(state.controller)
        rng = np.random.default_rng([self.seed, 0x6E50, int(step)])
        taken: list[dict] = []
        skipped: list[dict] = []
        for _ in range(self.greso_config.max_draws):
            batch = source.next()
            ids = np.asarray([ex["id"] for ex in batch])
            skip = rng.random(len(ids)) < greso_skip_probs(
                g.streak[ids], g.last_easy[ids], g.p_easy, g.p_hard
            )
            for ex, s in zip(batch, skip):
                (skipped if s else taken).append(ex)
            if len(taken) >= self.prompts_per_step:
                break
        return (taken + skipped)[: self.prompts_per_step]

    def update_controller(self, controller, outcome: StepOutcome):
        return greso_update(self.greso_config, xfer.to_host(controller), outcome.visits)
