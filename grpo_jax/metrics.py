"""Evaluation metrics over sampled answers: unbiased pass@k, mean@k, maj@k (host side, numpy),
the per-prompt weighted standard error of a rollout allocation, and the percentile-bootstrap
confidence interval of a benchmark score (`bootstrap_ci`) and the exact one of a proportion
(`clopper_pearson`).

pass@k, mean@k and maj@k return one value per prompt (`[P]` float64); a benchmark score is their
mean over prompts. Source for pass@k: Chen et al. 2021, *Evaluating Large Language Models
Trained on Code* (arXiv 2107.03374), Eq. 1 and the numerically stable product form of Fig. 3.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

ArrayLike = int | Sequence[int] | np.ndarray


def _as_int_array(x, name: str) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype == bool or not (
        np.issubdtype(a.dtype, np.integer)
        or (
            np.issubdtype(a.dtype, np.floating)
            and np.all(np.isfinite(a))
            and np.all(a == np.round(a))
        )
    ):
        raise ValueError(f"{name} must hold integers, got {a.dtype} values {a.ravel()[:5]}")
    return a.astype(np.int64)


def pass_at_k(n: ArrayLike, c: ArrayLike, k: ArrayLike) -> float | np.ndarray:
    """Unbiased pass@k estimate from `n` samples of which `c` are correct (Chen et al. 2021, Eq. 1).

    `pass@k = 1 - C(n - c, k) / C(n, k)`, computed as `1 - prod_{i = n-c+1}^{n} (1 - k / i)`
    (no large binomials); it is 1 when `n - c < k` and 0 when `c = 0`. Vectorised: `n`, `c`
    and `k` broadcast against each other (e.g. `n [P]`, `c [P]`, scalar `k`).

    Args:
      n: samples per prompt (int or int array, >= 1).
      c: correct samples per prompt (int or int array, `0 <= c <= n`).
      k: the k of pass@k (int or int array, `1 <= k <= n`).

    Returns:
      float64 in `[0, 1]`: a Python float if all inputs are scalars, else an array of the
      broadcast shape.

    Raises:
      ValueError: any `k > n` (the estimate is undefined: fewer samples than k; reporting 1.0
        for a prompt with zero correct samples would be wrong), `k < 1`, `c < 0`, `c > n`,
        `n < 1`, or non-integer inputs.
    """
    n_a, c_a, k_a = (_as_int_array(x, name) for x, name in ((n, "n"), (c, "c"), (k, "k")))
    n_a, c_a, k_a = np.broadcast_arrays(n_a, c_a, k_a)
    if np.any(n_a < 1):
        raise ValueError(f"pass_at_k: n must be >= 1, got min n = {n_a.min()}")
    if np.any(k_a < 1):
        raise ValueError(f"pass_at_k: k must be >= 1, got min k = {k_a.min()}")
    if np.any(k_a > n_a):
        i = np.flatnonzero((k_a > n_a).ravel())[0]
        raise ValueError(
            f"pass_at_k: k = {k_a.ravel()[i]} > n = {n_a.ravel()[i]} samples (unbiased pass@k "
            "needs at least k samples per prompt)"
        )
    if np.any(c_a < 0) or np.any(c_a > n_a):
        raise ValueError("pass_at_k: need 0 <= c <= n for every prompt")
    shape = n_a.shape
    n_f, c_f, k_f = (a.ravel() for a in (n_a, c_a, k_a))
    out = np.ones(n_f.shape, np.float64)
    if n_f.size:
        i = np.arange(1, int(n_f.max()) + 1, dtype=np.float64)[None, :]  # [1, max n]
        in_range = (i > (n_f - c_f)[:, None]) & (i <= n_f[:, None])
        terms = np.where(in_range, 1.0 - k_f[:, None] / i, 1.0)
        prod = np.prod(terms, axis=1)
        out = np.where(n_f - c_f < k_f, 1.0, 1.0 - prod)
    out = out.reshape(shape)
    return float(out) if out.ndim == 0 else out


def mean_at_k(correct) -> np.ndarray:
    """mean@k: per-prompt fraction of correct samples.

    Args:
      correct: `[P, k]` bool/0-1 array (or list of equal-length lists), one row per prompt.

    Returns:
      `[P]` float64 in `[0, 1]`; the benchmark's mean@k is `mean_at_k(correct).mean()`.

    Raises:
      ValueError: not 2-D, `k = 0`, or values other than 0/1.
    """
    a = np.asarray(correct)
    if a.ndim != 2 or a.shape[1] == 0:
        raise ValueError(f"mean_at_k: correct must be [P, k] with k >= 1, got shape {a.shape}")
    if not np.all((a == 0) | (a == 1)):
        raise ValueError("mean_at_k: correct must hold booleans / 0-1 values")
    return a.astype(np.float64).mean(axis=1)


def maj_at_k(
    answers: Sequence[Sequence[Hashable | None]], correct: Sequence[Sequence[bool]]
) -> np.ndarray:
    """maj@k: is the majority-vote answer correct? One value per prompt.

    For each prompt the most frequent answer among its samples wins (ties broken by first
    occurrence); `None` marks a sample without an extracted answer and does not vote (a prompt
    whose samples are all `None` scores 0). The prompt scores 1 if any sample carrying the
    majority answer is marked correct (answers must already be normalised so that equal
    answers compare equal, e.g. the verifier's canonical form).

    Args:
      answers: `[P][k]` hashable normalised answers (or `None`); `k` may differ per prompt.
      correct: `[P][k]` bools aligned with `answers` (the verifier's per-sample verdict).

    Returns:
      `[P]` float64 of 0.0 / 1.0; the benchmark's maj@k is the mean.

    Raises:
      ValueError: `answers` and `correct` differ in length for the batch or any prompt, or a
        prompt has no samples.
    """
    if len(answers) != len(correct):
        raise ValueError(f"maj_at_k: {len(answers)} prompts in answers, {len(correct)} in correct")
    out = np.zeros(len(answers), np.float64)
    for p, (ans, cor) in enumerate(zip(answers, correct)):
        ans, cor = list(ans), [bool(x) for x in cor]
        if len(ans) != len(cor):
            raise ValueError(f"maj_at_k: prompt {p} has {len(ans)} answers, {len(cor)} verdicts")
        if not ans:
            raise ValueError(f"maj_at_k: prompt {p} has no samples")
        counts = {}
        for a in ans:
            if a is not None:
                counts[a] = counts.get(a, 0) + 1  # dict keeps first-occurrence order
        if not counts:
            continue
        best = max(counts.values())
        winner = next(a for a, n in counts.items() if n == best)
        out[p] = float(any(c for a, c in zip(ans, cor) if a == winner))
    return out


def weighted_standard_error(
    rollouts_per_prompt, success=None, weights=None, *, sigma=None
) -> float:
    """Per-prompt weighted standard error of a step's reward estimates (WSE).

    ``WSE = sum_i w_i sqrt(p_i (1 - p_i)) / sqrt(n_i) / sum_i w_i`` (a plain mean without
    ``weights``): the standard error of prompt ``i``'s mean reward from ``n_i`` Bernoulli(``p_i``)
    rollouts, averaged over the step's prompts. Source: Panaganti et al., arXiv 2601.19280, s.4
    (the allocation objective, spec's WSE), evaluated per prompt from the *true* success rates.
    It is not averaged within a stratum before the square root: ``sqrt(mean p(1-p))`` over a
    stratum is >= the mean of the per-prompt ``sqrt`` (Jensen), so a stratified version
    overstates the error of mixed strata.

    Args:
      rollouts_per_prompt: ``[P]`` int or float, ``n_i >= 1``.
      success: ``[P]`` float in ``[0, 1]``, the true per-prompt success rates ``p_i``.
      weights: optional ``[P]`` float ``>= 0`` with a positive sum (e.g. Prompt-GDRO's
        per-prompt weights); None = equal weights.
      sigma: optional ``[P]`` float ``>= 0``, per-prompt reward standard deviations used in
        place of ``sqrt(p_i (1 - p_i))`` (the controllers' diagnostics: a bin's proxy or its
        measured within-group std); give ``success`` or ``sigma``, not both.

    Returns:
      float64 WSE (0.0 for an empty step).

    Raises:
      ValueError: shapes differ or are not 1-D, ``n_i < 1``, ``p_i`` outside ``[0, 1]`` (NaN
        included), negative weights or all-zero weights.
    """
    n = np.asarray(rollouts_per_prompt, np.float64)
    if (success is None) == (sigma is None):
        raise ValueError("weighted_standard_error: give exactly one of success and sigma")
    if sigma is None:
        p = np.asarray(success, np.float64)
        if not np.all((p >= 0) & (p <= 1)):
            raise ValueError("weighted_standard_error: success rates must lie in [0, 1]")
        sd = np.sqrt(p * (1.0 - p))
    else:
        sd = np.asarray(sigma, np.float64)
        if not np.all(sd >= 0):
            raise ValueError("weighted_standard_error: sigma must be >= 0 (no NaN)")
    w = np.ones_like(sd) if weights is None else np.asarray(weights, np.float64)
    if n.ndim != 1 or n.shape != sd.shape or w.shape != sd.shape:
        raise ValueError(
            "weighted_standard_error: rollouts_per_prompt, success or sigma (and weights) must "
            f"be equal [P] arrays; got shapes {n.shape}, {sd.shape}, {w.shape}"
        )
    if not sd.size:
        return 0.0
    if not np.all(n >= 1):
        raise ValueError(f"weighted_standard_error: need n_i >= 1, got min {n.min()}")
    if np.any(w < 0) or not w.sum() > 0:
        raise ValueError("weighted_standard_error: weights must be >= 0 with a positive sum")
    se = sd / np.sqrt(n)
    return float(np.sum(w * se) / np.sum(w))


def bootstrap_ci(
    values,
    *,
    strata=None,
    confidence: float = 0.95,
    num_resamples: int = 10_000,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile-bootstrap confidence interval of a mean over problems (Efron 1979).

    Each of ``num_resamples`` replicates draws the problems with replacement (within each
    stratum, keeping its size, when ``strata`` is given: a suite's pooled score keeps each
    benchmark's problem count) and takes the mean of their ``values``; the interval is the
    ``(1 - confidence) / 2`` and ``(1 + confidence) / 2`` quantiles of the replicate means
    (numpy's default linear interpolation). Source: B. Efron, *Bootstrap methods: another look at
    the jackknife*, Ann. Statist. 7 (1979); the percentile interval of Efron & Tibshirani, *An
    Introduction to the Bootstrap* (1993), ch. 13. Deterministic: the replicates come from
    ``numpy.random.default_rng(seed)`` in fixed chunks, so equal inputs give equal intervals.

    The samples within a problem are not resampled: the interval is over the benchmark's
    problems (the per-problem values already average the k samples), so a constant ``values``
    has the degenerate interval ``(c, c)``: the percentile bootstrap cannot see past a benchmark
    where every problem scored 0 (or 1); for 0/1 scores use `clopper_pearson` (0 of n solved:
    upper bound ``1 - 0.025 ** (1 / n)``, 0.12 for AIME's 30 problems).

    Args:
      values: ``[N]`` float, one value per problem (e.g. `pass_at_k` or `mean_at_k` rows).
      strata: optional ``[N]`` hashable labels (e.g. the benchmark of each problem).
      confidence: the interval's coverage, in ``(0, 1)``.
      num_resamples: bootstrap replicates ``B >= 1``.
      seed: seed of the resampling generator.

    Returns:
      ``(low, high)`` float64; ``(nan, nan)`` for ``N = 0``.

    Raises:
      ValueError: ``values`` not 1-D or not finite, ``strata`` of another length, ``confidence``
        outside ``(0, 1)`` or ``num_resamples < 1``.
    """
    v = np.asarray(values, np.float64)
    if v.ndim != 1 or not np.all(np.isfinite(v)):
        raise ValueError(f"bootstrap_ci: values must be a finite [N] array, got shape {v.shape}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"bootstrap_ci: confidence must lie in (0, 1), got {confidence}")
    if num_resamples < 1:
        raise ValueError(f"bootstrap_ci: num_resamples must be >= 1, got {num_resamples}")
    labels = np.zeros(v.shape, np.int64) if strata is None else np.asarray(strata)
    if labels.shape != v.shape:
        raise ValueError(f"bootstrap_ci: strata shape {labels.shape} != values shape {v.shape}")
    if not v.size:
        return float("nan"), float("nan")
    groups = [v[labels == s] for s in dict.fromkeys(labels.tolist())]  # first-occurrence order
    rng = np.random.default_rng(seed)
    means = np.empty(num_resamples, np.float64)
    chunk = max(1, min(num_resamples, (1 << 22) // v.size))  # bounds the [chunk, N_s] draws
    for start in range(0, num_resamples, chunk):
        b = min(chunk, num_resamples - start)
        total = np.zeros(b, np.float64)
        for g in groups:
            total += g[rng.integers(0, g.size, size=(b, g.size))].sum(axis=1)
        means[start : start + b] = total / v.size
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(means, [alpha, 1.0 - alpha])
    # a mean lies within [min, max]: the clip only removes summation round-off (constant values)
    return float(np.clip(low, v.min(), v.max())), float(np.clip(high, v.min(), v.max()))


def clopper_pearson(values, confidence: float = 0.95) -> list[float] | None:
    """The exact Clopper-Pearson interval (Clopper & Pearson 1934) of the proportion of 1s in
    ``values`` ([N] per-problem scores), when every score is 0 or 1; None otherwise (or N = 0).

    ``[B(alpha/2; x, N - x + 1), B(1 - alpha/2; x + 1, N - x)]`` with ``x`` the number of 1s,
    ``B`` the beta quantile and alpha = 1 - confidence (0 at x = 0, 1 at x = N).
    """
    values = np.asarray(values, np.float64)
    if values.size == 0 or not np.all((values == 0.0) | (values == 1.0)):
        return None
    n, x, alpha = values.size, int(values.sum()), 1.0 - confidence
    import scipy.stats  # noqa: PLC0415 (~1 s of the start of every process importing grpo_jax)

    low = 0.0 if x == 0 else float(scipy.stats.beta.ppf(alpha / 2, x, n - x + 1))
    high = 1.0 if x == n else float(scipy.stats.beta.ppf(1 - alpha / 2, x + 1, n - x))
    return [low, high]
