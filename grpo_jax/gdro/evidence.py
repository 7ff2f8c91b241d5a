"""Per-prompt evidence and its shrunken success estimate (Rollout-GDRO ``allocator="shrunk"``).

Why: the classifier's bins rest on a few visits of 2-12 samples, and the square-root rule on a
bin's estimated ``p ~ 0`` reads "not solved yet" as "no variance", so it starves the prompts that
are rarely but truly solvable (reports/gdro_first_run/gdro_vs_grpo.md). Here each prompt keeps its
own (decayed) success and trial counts; a Beta prior fitted to the pool shrinks them (empirical
Bayes, method of moments with the binomial noise removed: e.g. Efron, *Large-Scale Inference*,
2010, ch. 1; Robbins 1956), and the allocation maximises an expectation under each prompt's
posterior ``Beta(a + s_i, b + t_i - s_i)``:

* ``objective="informative"``: the expected number of informative groups
  ``sum_i E[1 - p_i^n_i - (1 - p_i)^n_i]`` (a group with both a success and a failure has a
  non-zero group-relative advantage, the only kind that carries a GRPO gradient);
* ``objective="variance"``: the integer Neyman problem ``min sum_i v_i / n_i`` with
  ``v_i = E[p_i (1 - p_i)] + v_floor`` (Panaganti et al., arXiv 2601.19280, Thm 4.2, per
  prompt): its continuous solution is the square-root rule ``n_i ∝ sqrt(v_i)``.

Both are separable and concave in ``n_i`` (each ``n -> E[1 - p^n - (1-p)^n]`` is a mixture of
concave sequences; ``-v/n`` is concave), so taking the largest marginal gains one rollout at a
time (``greedy_allocation``) is exactly optimal under the box ``[lower_i, n_max]`` and the exact
budget ``sum_i n_i = R`` (Gross 1956; Ibaraki & Katoh, *Resource Allocation Problems*, 1988,
ch. 4). All functions are host numpy (the allocation is host bookkeeping).
"""

from __future__ import annotations

import numpy as np

#: bounds on the fitted prior's strength a + b (pseudo-trials)
MIN_STRENGTH, MAX_STRENGTH = 0.5, 100.0


def fit_beta_prior(
    successes, trials, *, strength: float | None = None, min_trials: float = 1.0
) -> tuple[float, float]:
    """Beta prior ``(a, b)`` of the per-prompt success rate fitted to the pool by moments.

    Over the prompts with ``trials >= min_trials``: ``m = sum s / sum t``; the between-prompt
    variance ``v = var_i(s_i / t_i) - m (1 - m) mean_i(1 / t_i)`` (observed spread less the
    binomial noise), floored at 1e-6; strength ``k = m (1 - m) / v - 1`` clipped to
    ``[MIN_STRENGTH, MAX_STRENGTH]`` (or ``strength`` if given); ``a = m k``, ``b = (1 - m) k``.
    ``m`` is clipped to ``[1e-3, 1 - 1e-3]``. Fewer than two such prompts: ``Beta(1, 1)`` (or
    mean 1/2 with the given strength).

    Args:
      successes, trials: ``[N]`` float (decayed counts), ``0 <= successes <= trials``.
      strength: fixed ``a + b`` (None = fitted).
      min_trials: prompts with less evidence are left out of the fit.

    Returns:
      ``(a, b)``, both > 0.
    """
    s = np.asarray(successes, np.float64)
    t = np.asarray(trials, np.float64)
    m_ok = t >= max(float(min_trials), 1e-9)
    if m_ok.sum() < 2:
        k = 2.0 if strength is None else float(strength)
        return 0.5 * k, 0.5 * k
    s, t = s[m_ok], t[m_ok]
    m = float(np.clip(s.sum() / t.sum(), 1e-3, 1 - 1e-3))
    if strength is None:
        v = float(np.var(s / t) - m * (1 - m) * np.mean(1.0 / t))
        k = m * (1 - m) / max(v, 1e-6) - 1.0
        k = float(np.clip(k, MIN_STRENGTH, MAX_STRENGTH))
    else:
        k = float(strength)
    return m * k, (1 - m) * k


def posterior(successes, trials, prior: tuple[float, float]) -> tuple[np.ndarray, np.ndarray]:
    """Posterior ``Beta(a_i, b_i)`` parameters ``([P], [P])`` float64: ``a + s_i``,
    ``b + t_i - s_i``."""
    s = np.asarray(successes, np.float64)
    t = np.asarray(trials, np.float64)
    a, b = prior
    return a + s, b + np.maximum(t - s, 0.0)


def expected_variance(a, b) -> np.ndarray:
    """``E[p (1 - p)]`` under ``Beta(a, b)``: ``a b / ((a + b)(a + b + 1))``, ``[P]`` float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return a * b / ((a + b) * (a + b + 1.0))


def _moments(a, b, n_max: int) -> tuple[np.ndarray, np.ndarray]:
    """``E[p^n]`` and ``E[(1 - p)^n]`` for ``n = 0 .. n_max`` under ``Beta(a_i, b_i)``:
    ``prod_{j < n} (a + j) / (a + b + j)``; ``[P, n_max + 1]`` float64 each."""
    a = np.asarray(a, np.float64)[:, None]
    b = np.asarray(b, np.float64)[:, None]
    j = np.arange(n_max, dtype=np.float64)[None, :]
    one = np.ones((a.shape[0], 1))
    ep = np.concatenate([one, np.cumprod((a + j) / (a + b + j), axis=1)], axis=1)
    eq = np.concatenate([one, np.cumprod((b + j) / (a + b + j), axis=1)], axis=1)
    return ep, eq


def expected_informative(a, b, n) -> np.ndarray:
    """``E[1 - p^n - (1 - p)^n]`` under ``Beta(a_i, b_i)`` for integer ``n_i >= 1``: the chance
    that prompt ``i``'s group of ``n_i`` holds both a success and a failure; ``[P]`` float64."""
    n = np.asarray(n, np.int64)
    ep, eq = _moments(a, b, int(n.max()) if n.size else 0)
    rows = np.arange(n.size)
    return 1.0 - ep[rows, n] - eq[rows, n]


def marginal_gains(a, b, n_max: int, *, objective: str, v_floor: float = 0.0) -> np.ndarray:
    """``[P, n_max]`` float64: the gain of a prompt's ``(n + 1)``-th rollout, column ``n``.

    ``"informative"``: ``E[p^n (1 - p) + (1 - p)^n p]`` (the increase of the expected
    informative-group indicator from ``n`` to ``n + 1``); ``"variance"``:
    ``v / (n (n + 1))`` with ``v = E[p (1 - p)] + v_floor`` (the decrease of ``v / n``; column 0
    is +inf: a prompt's first rollout is never the marginal choice). Non-increasing along ``n``.

    Raises:
      ValueError: unknown objective.
    """
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    if objective == "informative":
        ep, eq = _moments(a, b, n_max)
        n = np.arange(n_max, dtype=np.float64)[None, :]
        s = (a + b)[:, None] + n
        # E[p^n (1-p)] = E[p^n] b / (a + b + n);  E[(1-p)^n p] = E[(1-p)^n] a / (a + b + n)
        return ep[:, :n_max] * b[:, None] / s + eq[:, :n_max] * a[:, None] / s
    if objective == "variance":
        v = expected_variance(a, b)[:, None] + float(v_floor)
        n = np.arange(n_max, dtype=np.float64)[None, :]
        with np.errstate(divide="ignore"):
            return np.where(n > 0, v / np.maximum(n * (n + 1), 1.0), np.inf) * np.ones_like(v)
    raise ValueError(f"objective must be 'informative' or 'variance'; got {objective!r}")


def greedy_allocation(gains, lower, upper: int, total: int, tie_key) -> np.ndarray:
    """Integer ``n [P]`` int32 maximising ``sum_i sum_{k < n_i} gains[i, k]`` subject to
    ``lower_i <= n_i <= upper`` and ``sum_i n_i = total`` (exact for gains non-increasing in
    ``k``): every prompt starts at ``lower_i`` and the ``total - sum(lower)`` largest remaining
    gains are taken; equal gains go to the smaller ``k``, then to the smaller ``tie_key``.

    Args:
      gains: ``[P, K]`` float, ``K >= upper``; column ``k`` = gain of the ``(k + 1)``-th rollout.
      lower: ``[P]`` int; upper: int; total: int; tie_key: ``[P]`` int (stable prompt ids).

    Raises:
      ValueError: ``total`` outside ``[sum(lower), P * upper]``.
    """
    g = np.asarray(gains, np.float64)
    lo = np.asarray(lower, np.int64)
    num = lo.size
    extra = int(total) - int(lo.sum())
    if extra < 0 or int(total) > num * int(upper):
        raise ValueError(
            f"total {total} outside [sum(lower), P * upper] = [{int(lo.sum())}, {num * upper}]"
        )
    k = np.arange(int(upper))[None, :]
    eligible = (k >= lo[:, None]) & np.ones((num, 1), bool)
    rows = np.broadcast_to(np.arange(num)[:, None], eligible.shape)[eligible]
    cols = np.broadcast_to(k, eligible.shape)[eligible]
    key = np.asarray(tie_key, np.int64)[rows]
    order = np.lexsort((key, cols, -g[rows, cols]))[:extra]
    return (lo + np.bincount(rows[order], minlength=num)).astype(np.int32)


__all__ = [
    "fit_beta_prior",
    "posterior",
    "expected_variance",
    "expected_informative",
    "marginal_gains",
    "greedy_allocation",
]
