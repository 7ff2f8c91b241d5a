"""Group-relative advantages over segment ids (GRPO, Dr. GRPO, RLOO).

A *group* is the set of rollouts of one prompt. Rollouts live on one flat axis `[R]` and
`segment_ids [R]` maps each row to its prompt, so groups may differ in size (Rollout-GDRO
moves rollouts between prompts from step to step) without changing any array shape: all group
statistics are segment sums (`jax.ops.segment_sum` with a static `num_segments`), never a
`[P, G]` reshape, and a jitted caller never recompiles as the allocation moves.

Sources: Shao et al. 2024, *DeepSeekMath* (arXiv 2402.03300), Sec. 4.1.2 (outcome supervision,
`A = (r - mean) / std`); Liu et al. 2025, *Dr. GRPO* (arXiv 2503.20783), Eq. 3 (no std);
Ahmadian et al. 2024, *Back to Basics* (RLOO, leave-one-out baseline, Eq. 4); TRL's
`GRPOConfig.scale_rewards` (`"group" | "batch" | "none"`: group mean, batch std); Yu et al.
2025, *DAPO* (arXiv 2503.14476), Eq. 13 (soft overlong punishment).
"""

from __future__ import annotations

import dataclasses
import operator

import chex
import jax
import jax.numpy as jnp
import numpy as np

ESTIMATORS = ("grpo", "dr_grpo", "rloo")
STD_KINDS = ("unbiased", "population")
SCALES = ("group", "batch", "none")
_DEFAULT_SCALE = {"grpo": "group", "dr_grpo": "none", "rloo": "none"}
NONFINITE_MODES = ("raise", "mask")
# the AdvantageConfig fields `config.algorithm` holds (the others are the caller's choice)
CONFIG_FIELDS = ("estimator", "std", "advantage_clip", "scale_rewards")


def _is_traced(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def _check_finite_eagerly(rewards, segment_ids, num_segments: int) -> None:
    """Raise ValueError if a grouped row of concrete `rewards` is NaN or inf (no-op if traced)."""
    if _is_traced(rewards):
        return
    r = np.asarray(rewards)
    bad = ~np.isfinite(r)
    if not _is_traced(segment_ids):
        s = np.asarray(segment_ids)
        bad &= (s >= 0) & (s < num_segments)
    if bad.any():
        rows = np.flatnonzero(bad)
        raise ValueError(
            f"rewards: {rows.size} non-finite value(s) (NaN/inf) at rows {rows[:10].tolist()}"
            f"{' ...' if rows.size > 10 else ''} (values {r[rows[:5]].tolist()}). A non-finite "
            "reward is an input error (broken verifier?). Pass nonfinite='mask' to drop such rows "
            "from their group (advantage 0, counted in stats['num_nonfinite_rewards'])."
        )


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
    """The options of `compute` (frozen, hashable). The one home of these fields' defaults:
    `config.algorithm` is generated from them (`grpo_jax.config_schema`), same names.

    estimator: "grpo" | "dr_grpo" | "rloo". std: "unbiased" | "population". eps: >= 0, added
    to the standard deviation. advantage_clip: > 0, advantages clipped to [-c, c]; 0 (default; None
    too) = off, as in TRL and verl, so `compute`'s guarantees below hold; the GDRO paper's
    +-5 is `configs/dapo_qwen3.py`'s (under group scaling `|A| <= (n - 1) / sqrt(n)`: a cap
    of 5 binds only groups of 27 or more). scale_rewards: None (the estimator's
    own: "group" for grpo, "none" otherwise) | "group" | "batch" | "none" (TRL's name).
    nonfinite: "raise" | "mask" (see `compute`).

    Raises:
      ValueError: in `__post_init__`, one line "field=value ..." for a bad choice or range.
    """

    estimator: str = "grpo"
    std: str = "unbiased"
    eps: float = 1e-6
    advantage_clip: float | None = 0.0
    scale_rewards: str | None = None
    nonfinite: str = "raise"

    def __post_init__(self):
        for name, choices in (
            ("estimator", ESTIMATORS),
            ("std", STD_KINDS),
            ("nonfinite", NONFINITE_MODES),
            ("scale_rewards", (None, *SCALES)),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {choices}")
        if not _is_traced(self.eps) and not float(self.eps) >= 0:
            raise ValueError(f"eps={self.eps!r} must be >= 0")
        c = self.advantage_clip
        if c is not None and not _is_traced(c) and not float(c) >= 0:
            raise ValueError(f"advantage_clip={c!r} must be >= 0 (0 turns it off)")

    @property
    def resolved_scale(self) -> str:
        """`scale_rewards`, or the estimator's own when None."""
        s = self.scale_rewards
        return _DEFAULT_SCALE[self.estimator] if s is None else s

    @classmethod
    def from_config(cls, algorithm, **overrides) -> AdvantageConfig:
        """From a `config.algorithm` section (the fields it has of `estimator`, `std`,
        `advantage_clip`, `scale_rewards`), then `overrides`. Raises ValueError naming the
        field."""
        kw = {k: algorithm[k] for k in CONFIG_FIELDS if k in algorithm}
        try:
            return cls(**{**kw, **overrides})
        except ValueError as e:
            raise ValueError(str(e)) from None


def _checked_inputs(rewards, segment_ids, num_segments, cfg: AdvantageConfig):
    """`compute`'s argument checks: (rewards, segment_ids as arrays, num_segments as int)."""
    try:
        num_segments = operator.index(num_segments)
    except TypeError:
        raise ValueError(
            f"num_segments must be a static Python int (jit: mark it static), got "
            f"{type(num_segments).__name__}"
        ) from None
    if num_segments < 1:
        raise ValueError(f"num_segments must be >= 1, got {num_segments}")
    rewards = jnp.asarray(rewards)
    segment_ids = jnp.asarray(segment_ids)
    chex.assert_rank([rewards, segment_ids], 1)
    chex.assert_equal_shape([rewards, segment_ids])
    chex.assert_type(segment_ids, int)
    if cfg.nonfinite == "raise":
        _check_finite_eagerly(rewards, segment_ids, num_segments)
    return rewards, segment_ids, num_segments


def compute(
    rewards: chex.Array,
    segment_ids: chex.Array,
    num_segments: int,
    cfg: AdvantageConfig = AdvantageConfig(),
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Group-relative advantages, one scalar per rollout.

    Per group `g` (rows with `segment_ids == g`), with `n` members, mean `m` and standard
    deviation `s`:

    - `"grpo"` (DeepSeekMath Sec. 4.1.2): `A = (r - m) / (s + eps)`; `s` is the unbiased
      (`n - 1`, as verl/TRL) or the population (`n`) standard deviation (`std`).
    - `"dr_grpo"` (Dr. GRPO Eq. 3): `A = r - m`.
    - `"rloo"` (RLOO Eq. 4): `A = r - mean of the other n - 1 members = n / (n - 1) * (r - m)`.

    `scale_rewards` overrides the division of the centred advantage `c` (`r - m` for grpo/dr_grpo,
    the leave-one-out difference for rloo): `"group"`: `A = c / (s_g + eps)` (the group's
    std); `"batch"`: `A = c / (s_B + eps)` with `s_B` the std (`std` kind) of the raw rewards
    of *all* grouped finite rows of the batch (TRL `scale_rewards="batch"`: group mean, batch
    std); `"none"`: `A = c` (Dr. GRPO). `None` (default) keeps each estimator's own: `"group"`
    for grpo, `"none"` for dr_grpo and rloo. So `estimator="grpo", scale_rewards="batch"` is TRL's
    batch scaling and `estimator="grpo", scale_rewards="none"` equals `"dr_grpo"`. `s_B` is a batch
    statistic: compute it on the whole batch (all prompts' groups), not per micro-batch.

    Then, with `advantage_clip = c > 0`, `A <- clip(A, -c, c)`. Guarantees:

    - A group whose (finite) rewards are all exactly equal gives `A = 0` for all its members
      (decided by `max == min`, so float round-off in the mean cannot produce `±1e-3`-sized
      noise after division by `s + eps`).
    - A group with one member gives `A = 0` (counted in `num_singleton_groups`).
    - Rows whose segment id is outside `[0, num_segments)` (e.g. `-1` padding) get `A = 0` and
      do not enter any group's statistics.
    - For `grpo` with group scaling `|A| <= sqrt(n)`; for every estimator and scale `A` sums to
      zero within each group.

    Non-finite rewards (NaN, ±inf) in grouped rows:

    - `nonfinite="raise"` (default) raises `ValueError` **eagerly**, i.e. only when `rewards`
      is a concrete array. Under `jax.jit`/`vmap`/`grad` the values are traced and the check
      cannot run; the function then behaves exactly like `"mask"` (it never propagates NaN).
      Jitted callers should pass `nonfinite="mask"` explicitly and log
      `stats["num_nonfinite_rewards"]`.
    - `nonfinite="mask"`: such a row gets `A = 0`, is excluded from its group's statistics
      (the group is computed from its remaining members) and is counted. NaN never spreads to
      other rows or groups (values are replaced with `jnp.where` before any sum).

    Args:
      rewards: `[R]` rewards, any real dtype (cast to float32), one per rollout.
      segment_ids: `[R]` integer group (prompt) index per rollout, in `[0, num_segments)`;
        other values mark padding rows.
      num_segments: static Python int, number of groups `P` (upper bound on segment ids).
      cfg: `AdvantageConfig`: `estimator`, `std` (used by group and batch scaling), `eps`,
        `advantage_clip`, `nonfinite`, `scale_rewards` (each as above).

    Returns:
      `(advantages, stats)`: `advantages [R]` float32; `stats` a dict of scalar jnp arrays:
      `num_groups` (int32, groups with >= 1 finite member), `num_singleton_groups` (int32),
      `num_zero_std_groups` (int32, groups with >= 2 members, all rewards equal),
      `num_nonfinite_rewards` (int32, grouped rows with NaN/inf reward),
      `num_padding_rows` (int32, rows with an out-of-range segment id),
      `num_clipped` (int32, rows whose advantage was clipped).

    Raises:
      ValueError: bad `num_segments`, or a non-finite reward with `nonfinite="raise"` and concrete inputs.
      AssertionError: (chex) wrong ranks/shapes/dtypes of `rewards` or `segment_ids`.
    """
    estimator, std, eps, clip = cfg.estimator, cfg.std, cfg.eps, cfg.advantage_clip
    scale = cfg.resolved_scale
    rewards, segment_ids, num_segments = _checked_inputs(rewards, segment_ids, num_segments, cfg)
    r = rewards.astype(jnp.float32)
    in_group = (segment_ids >= 0) & (segment_ids < num_segments)
    finite = jnp.isfinite(r)
    ok = in_group & finite
    # Bucket `num_segments` collects everything that is not in a group; it is dropped below.
    seg = jnp.where(ok, segment_ids, num_segments).astype(jnp.int32)
    nseg = num_segments + 1

    def seg_sum(x):
        return jax.ops.segment_sum(x, seg, num_segments=nseg)[:num_segments]

    x = jnp.where(ok, r, 0.0)
    n = seg_sum(ok.astype(jnp.float32))  # [P] members
    mean = seg_sum(x) / jnp.maximum(n, 1.0)
    seg_c = jnp.minimum(seg, num_segments - 1)  # safe gather index
    centered = jnp.where(ok, x - mean[seg_c], 0.0)  # two-pass: no cancellation
    # All-equal test by max == min (exact), independent of round-off in the mean.
    gmax = jax.ops.segment_max(jnp.where(ok, r, -jnp.inf), seg, num_segments=nseg)[:num_segments]
    gmin = jax.ops.segment_min(jnp.where(ok, r, jnp.inf), seg, num_segments=nseg)[:num_segments]
    informative = (n >= 2) & (gmax > gmin)  # [P]

    if estimator == "rloo":  # r - mean(others) = n/(n-1) (r - mean)
        loo = n / jnp.maximum(n - 1.0, 1.0)
        adv = centered * loo[seg_c]
    else:  # grpo, dr_grpo
        adv = centered
    ddof = 1.0 if std == "unbiased" else 0.0
    if scale == "group":
        var = seg_sum(centered * centered) / jnp.maximum(n - ddof, 1.0)
        adv = adv / (jnp.sqrt(var)[seg_c] + eps)
    elif scale == "batch":
        n_b = jnp.sum(ok).astype(jnp.float32)
        c_b = jnp.where(ok, x - jnp.sum(x) / jnp.maximum(n_b, 1.0), 0.0)
        var_b = jnp.sum(c_b * c_b) / jnp.maximum(n_b - ddof, 1.0)
        adv = adv / (jnp.sqrt(var_b) + eps)

    keep = ok & informative[seg_c]
    adv = jnp.where(keep, adv, 0.0)
    if _is_traced(clip) or clip:  # 0 / None = off
        num_clipped = jnp.sum(jnp.abs(adv) > clip).astype(jnp.int32)
        adv = jnp.clip(adv, -clip, clip)
    else:
        num_clipped = jnp.zeros((), jnp.int32)

    return adv.astype(jnp.float32), _stats(n, gmax > gmin, in_group, finite, num_clipped)


def _stats(n, unequal, in_group, finite, num_clipped) -> dict[str, jax.Array]:
    """`compute`'s int32 counts from the group sizes n [P], unequal-rewards flags [P] and the
    row masks in_group / finite [R]."""
    count = lambda x: jnp.sum(x).astype(jnp.int32)
    return {
        "num_groups": count(n >= 1),
        "num_singleton_groups": count(n == 1),
        "num_zero_std_groups": count((n >= 2) & ~unequal),
        "num_nonfinite_rewards": count(in_group & ~finite),
        "num_padding_rows": count(~in_group),
        "num_clipped": num_clipped,
    }


def overlong_penalty(
    lengths: chex.Array, max_len: int, cache_len: int, factor: float = 1.0
) -> jax.Array:
    """DAPO soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, Eq. 13), added to rewards.

    With `L` = `lengths`, `L_max` = `max_len`, `L_cache` = `cache_len`:
    `R_len = 0` if `L <= L_max - L_cache`; `((L_max - L_cache) - L) / L_cache` if
    `L_max - L_cache < L <= L_max` (linear from 0 down to -1 at `L = L_max`); `-1` if
    `L > L_max`. Returns `factor * R_len`. DAPO uses `L_max` = the generation limit (20,480)
    and `L_cache = 4,096`; a completion cut at the limit (`L = L_max`) gets `-factor`.

    Args:
      lengths: `[R]` int or float, completion lengths in tokens (e.g. `completion_mask.sum(1)`).
      max_len: `L_max`, int > 0.
      cache_len: `L_cache`, int with `0 < cache_len <= max_len`.
      factor: scale of the penalty (float; 1 in DAPO).

    Returns:
      `[R]` float32 penalties in `[-factor, 0]` (for `factor >= 0`).

    Raises:
      ValueError: `max_len <= 0` or `cache_len` outside `(0, max_len]` (concrete values).
      AssertionError: (chex) `lengths` not rank 1.
    """
    if not _is_traced(max_len) and not max_len > 0:
        raise ValueError(f"max_len must be > 0, got {max_len}")
    if not _is_traced(cache_len) and not (
        cache_len > 0 and (_is_traced(max_len) or cache_len <= max_len)
    ):
        raise ValueError(f"cache_len must be in (0, max_len = {max_len}], got {cache_len}")
    lengths = jnp.asarray(lengths)
    chex.assert_rank(lengths, 1)
    length = lengths.astype(jnp.float32)
    l_max = jnp.asarray(max_len, jnp.float32)
    l_cache = jnp.asarray(cache_len, jnp.float32)
    soft = (l_max - l_cache - length) / l_cache
    pen = jnp.where(length <= l_max - l_cache, 0.0, jnp.where(length <= l_max, soft, -1.0))
    return (factor * pen).astype(jnp.float32)
