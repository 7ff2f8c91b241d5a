"""Training diagnostics per arm from the final runs' metrics rows and per-step placements
(``ids``/``bins``/``n`` ``[steps, P]``) with the true per-prompt success rates ``p``."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence

import numpy as np

from experiments.compare.plan import algorithm
from experiments.compare.statistics import true_wse

# strata of the true success rate p: p = 0, (0, 0.1], (0.1, 0.3], (0.3, 0.7], (0.7, 1), p = 1
P_STRATA_EDGES = (0.1, 0.3, 0.7)
P_STRATA_LABELS = ("p=0", "(0,0.1]", "(0.1,0.3]", "(0.3,0.7]", "(0.7,1)", "p=1")
_WSE_KEYS = ("wse", "wse_uniform", "wse_bins", "wse_bins_uniform", "informative")


def load_oracle(path: str, num_prompts: int, problems: Sequence[str] | None = None) -> np.ndarray:
    """Per-sample success rates of the RL pool from an oracle JSON (format: package docstring).

    Returns: ``[num_prompts]`` float, NaN where the file has no entry.

    Raises:
      ValueError: no ``"p"`` mapping, a value outside [0, 1], an id outside the pool, or a
        ``"problems"`` entry that differs from the RL pool's problem (``problems`` given).
    """
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or not isinstance(data.get("p"), dict):
        raise ValueError(f"{path}: expected a JSON object with a 'p' mapping (prompt id -> p)")
    p = np.full(int(num_prompts), np.nan)
    for key, val in data["p"].items():
        i = int(key)
        if not 0 <= i < num_prompts:
            raise ValueError(f"{path}: prompt id {i} outside the RL pool (0 .. {num_prompts - 1})")
        v = float(val)
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"{path}: p[{i}] = {v} is not in [0, 1]")
        p[i] = v
    if problems is not None:
        for key, text in (data.get("problems") or {}).items():
            i = int(key)
            if i < len(problems) and str(text) != str(problems[i]):
                raise ValueError(
                    f"{path}: prompt id {i} is {text!r} in the oracle file but {problems[i]!r} in "
                    "the RL pool (another config_arg or data seed?)"
                )
    return p


# ----------------------------------------------------------------------------- closed forms


def p_stratum(p) -> np.ndarray:
    """Stratum index (0 .. 5, `P_STRATA_LABELS`) of each true success rate; -1 for NaN."""
    p = np.asarray(p, np.float64)
    out = 1 + np.searchsorted(np.asarray(P_STRATA_EDGES), p, side="left")  # (0, 0.1] -> 1, ...
    out = np.where(p >= 1.0, len(P_STRATA_LABELS) - 1, out)
    out = np.where(p <= 0.0, 0, out)
    return np.where(np.isfinite(p), out, -1)


def rollouts_by_stratum(ids, n, p) -> np.ndarray:
    """Mean rollouts per prompt by true-success stratum, pooled over steps and prompts.

    Args: ids, n ``[T, P]`` (prompt ids, rollouts per prompt); p ``[num_prompts]`` (NaN =
      unknown: left out). Returns: ``[6]`` float, NaN for an empty stratum.
    """
    st = p_stratum(np.asarray(p, np.float64)[np.asarray(ids, np.int64)]).ravel()
    n = np.asarray(n, np.float64).ravel()
    k = len(P_STRATA_LABELS)
    ok = st >= 0
    cnt = np.bincount(st[ok], minlength=k)
    tot = np.bincount(st[ok], weights=n[ok], minlength=k)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(cnt > 0, tot / np.maximum(cnt, 1), np.nan)


def expected_informative(ids, n, p, n_bar: float) -> tuple[np.ndarray, np.ndarray]:
    """Expected informative groups per step ``sum_i 1 - p_i^n_i - (1 - p_i)^n_i`` under the
    allocation and under ``n_i = n_bar``: two ``[T]`` arrays (prompts with unknown p left out)."""
    pi = np.asarray(p, np.float64)[np.asarray(ids, np.int64)]
    n = np.asarray(n, np.float64)
    ok = np.isfinite(pi)
    pi = np.where(ok, pi, 0.0)
    f = lambda m: np.where(ok, 1 - pi**m - (1 - pi) ** m, 0.0).sum(-1)
    return f(n), f(np.full(n.shape, float(n_bar)))


def controller_data_share(bins, num_bins: int) -> float:
    """Share of steps whose batch had at least one prompt that was not unseen (``bins <
    num_bins``): the steps on which the controller had data. NaN without placements."""
    bins = np.asarray(bins)
    if bins.size == 0:
        return float("nan")
    return float(np.mean((bins < int(num_bins)).any(-1)))


def rows_values(rows, key) -> np.ndarray:
    """``[len(rows)]`` float of a scalar metric (NaN where absent or not a number)."""
    out = []
    for r in rows:
        with contextlib.suppress(TypeError, ValueError):
            out.append(float(r[key]) if key in r else float("nan"))
    return np.asarray(out, float)


def measured_informative(rows) -> np.ndarray:
    """Informative groups per step from the rows: ``advantages/num_groups`` minus
    ``advantages/num_zero_std_groups``."""
    return rows_values(rows, "advantages/num_groups") - rows_values(
        rows, "advantages/num_zero_std_groups"
    )


def _nanmean(x) -> float:
    x = np.asarray(x, float)
    return float(np.nanmean(x)) if np.isfinite(x).any() else float("nan")


def _ratio(a, b) -> float:
    return float(a / b) if np.isfinite(a) and np.isfinite(b) and b > 0 else float("nan")


# ----------------------------------------------------------------------------- per arm


def _wse_totals(by_seed: dict, p_for_seed) -> tuple[dict, dict]:
    """Sums over the (seed, step) pairs with a known p of `true_wse`'s values, the per-seed
    series of the true WSE and its ratio, and the pooled stratum means of n."""
    tot = dict.fromkeys(_WSE_KEYS + ("informative_uniform",), 0.0)
    tot.update(counted=0, known=[], strata_n=np.zeros(6), strata_cnt=np.zeros(6))
    series = {"wse_true": [], "wse_true_ratio": []}
    for s in sorted(by_seed):
        job, p = by_seed[s], p_for_seed(s)
        ids = np.asarray(job.get("ids", np.zeros((0, 0))))
        if p is None or ids.size == 0:
            continue
        per = [
            true_wse(ids[t], job["bins"][t], job["n"][t], p, job["n_bar"]) for t in range(len(ids))
        ]
        series["wse_true"].append([x["wse"] for x in per])
        series["wse_true_ratio"].append([_ratio(x["wse"], x["wse_uniform"]) for x in per])
        for x in per:
            if np.isfinite(x["wse"]):
                tot["counted"] += 1
                for k in _WSE_KEYS + ("informative_uniform",):
                    tot[k] += x[k]
                tot["known"].append(x["known"] / ids.shape[1])
        st = p_stratum(np.asarray(p, float)[np.asarray(ids, np.int64)]).ravel()
        ok = st >= 0
        tot["strata_n"] += np.bincount(st[ok], np.asarray(job["n"], float).ravel()[ok], 6)
        tot["strata_cnt"] += np.bincount(st[ok], minlength=6)
    return tot, series


def _true_p_diagnostics(tot: dict, n_bar: float) -> dict:
    """The true-p columns from `_wse_totals` (empty when no step had a known p)."""
    c = tot["counted"]
    if not c:
        return {}
    with np.errstate(invalid="ignore", divide="ignore"):
        strata = np.where(tot["strata_cnt"] > 0, tot["strata_n"] / tot["strata_cnt"], np.nan)
    return {
        "wse_true": tot["wse"] / c,
        "wse_true_uniform": tot["wse_uniform"] / c,
        "wse_true_ratio": _ratio(tot["wse"], tot["wse_uniform"]),
        "wse_bins_ratio": _ratio(tot["wse_bins"], tot["wse_bins_uniform"]),
        "expected_informative": tot["informative"] / c,
        "expected_informative_uniform": tot["informative_uniform"] / c,
        "expected_informative_ratio": _ratio(tot["informative"], tot["informative_uniform"]),
        "oracle_coverage": float(np.mean(tot["known"])),
        "rollouts_by_stratum": strata.tolist(),
        "stratum_share": (tot["strata_cnt"] / max(tot["strata_cnt"].sum(), 1)).tolist(),
        "n_bar": float(n_bar),
    }


def _controller_diagnostics(method: str, rows: list) -> dict:
    """Prompt-GDRO's weight ratio / ESS / cap, Rollout-GDRO's proxy WSE ratio, from the rows."""
    d = {}
    if algorithm(method) == "rollout_gdro":
        v = rows_values(rows, "rollout_gdro/wse")
        u = rows_values(rows, "rollout_gdro/wse_uniform")
        ok = np.isfinite(v) & np.isfinite(u)
        if ok.any() and u[ok].sum() > 0:
            d["wse_proxy_ratio"] = float(v[ok].sum() / u[ok].sum())
    if algorithm(method) == "prompt_gdro":
        d["weight_ratio"] = _nanmean(rows_values(rows, "gdro/weight_ratio"))
        d["weight_ess"] = _nanmean(rows_values(rows, "gdro/weight_ess"))
        d["weight_cap_bound"] = _nanmean(rows_values(rows, "gdro/weight_cap_bound"))
    return d


def _pad(series: dict) -> dict:
    """Per-seed series padded with NaN to a rectangle."""
    out = {}
    for k, v in series.items():
        if v:
            width = max(len(x) for x in v)
            out[k] = [list(x) + [np.nan] * (width - len(x)) for x in v]
    return out


def arm_diagnostics(method: str, by_seed: dict, p_for_seed) -> dict:
    """One arm's diagnostics over its final runs (``by_seed``: seed -> job; means over steps
    and seeds): measured / expected informative groups, true WSE vs uniform, rollouts per
    prompt by true-p stratum, the share of steps where the controller had data, the
    controller's own diagnostics and per-seed ``series`` for the figures.

    ``p_for_seed(seed)`` -> ``[num_prompts]`` true success rates or None.
    """
    rows = [r for s in by_seed for r in by_seed[s]["rows"]]
    ng = rows_values(rows, "advantages/num_groups")
    info = measured_informative(rows)
    d = {
        "train_pass_rate": _nanmean(rows_values(rows, "pass_rate")),
        "informative_groups": _nanmean(info),
        "informative_share": _nanmean(info / np.maximum(ng, 1)),
        "sample_weight_max": _nanmean(rows_values(rows, "sample_weight_max")),
    }
    shares = [
        controller_data_share(j["bins"], j["num_bins"])
        for j in by_seed.values()
        if np.asarray(j.get("bins", [])).size and "num_bins" in j
    ]
    d["controller_data_share"] = _nanmean(shares) if shares else float("nan")
    tot, series = _wse_totals(by_seed, p_for_seed)
    n_bar = next(iter(by_seed.values()))["n_bar"]
    d.update(_true_p_diagnostics(tot, n_bar))
    d.update(_controller_diagnostics(method, rows))
    series["informative"] = [
        measured_informative(by_seed[s]["rows"]).tolist() for s in sorted(by_seed)
    ]
    d["series"] = _pad(series)
    return d


def diagnostics(runs: dict, p_for_seed) -> dict:
    """method -> `arm_diagnostics` of its final runs (``runs``: method -> seed -> job)."""
    return {m: arm_diagnostics(m, by_seed, p_for_seed) for m, by_seed in runs.items()}
