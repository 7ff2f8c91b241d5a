"""GRPO vs Prompt-GDRO vs Rollout-GDRO: a powered, equal-compute comparison with a learning-rate
sweep chosen on a validation split.

  python -m experiments.compare --out=reports                      # the default (~65 min, 2 CPUs)
  python -m experiments.compare --out=reports --estimate_only      # time one job, print estimate
  python -m experiments.compare --out=reports --config_arg=frontier --oracle_json=oracle.json
  python -m experiments.compare --out=/tmp/c --config_arg=heavy_tailed,smoke --seeds=2 \
      --sweep_seeds=1 --lrs=1e-4,3e-4 --steps=4 --eval_every=2   # a toy run

Protocol (every number of the report comes from it):

1. **Methods** (``METHODS``, extensible: name -> (algorithm, ``config.gdro`` overrides)): GRPO,
   Prompt-GDRO (``advantage_weight``, ``resample``), Rollout-GDRO (``bandit``, ``sqrt``), from
   ``configs/arithmetic.py:<algorithm>,<--config_arg>`` with the *corrected* controller defaults
   (``docs/gdro.md``); ``--paper_gdro`` switches every controller to the paper's setting (and
   the failure-rate loss signal, as the first report did).
2. **Paired seeds.** Every method of a seed starts RL from the same supervised warm start
   (computed once per seed on the config's full training set) and is evaluated with the same
   keys (``fold_in(PRNGKey(seed + 7), step)``), so differences between methods are paired.
3. **Validation / test split.** The held-out problems are split by their index in the held-out
   list (which the task generator shuffles over levels): even index -> validation, odd ->
   test (``split_heldout``). Deterministic, disjoint, about half of every level in each.
4. **Learning-rate sweep** (``--lrs``, default 3e-5, 1e-4, 3e-4) per method on the sweep seeds
   (``--sweep_seeds``: an integer N = the *first N* of the final seeds, a prefix; a comma list =
   those seeds, which may be disjoint from the final ones). Each method's lr is the one with the
   highest mean *validation* score (``--select_metric``, pass@8 by default) over the sweep seeds
   and the last ``--last_evals`` evaluations (``select_lr``: it reads the validation columns
   only; ties go to the first lr of ``--lrs``). Sweep runs whose seed is a final seed are reused
   as that seed's final run at the chosen lr (same config, same seed: a rerun would repeat it).
5. **Final runs**: every final seed (``--seeds``, default 10) at the chosen lr; all reported
   numbers are on the **test half only**, each the mean of the last ``--last_evals``
   evaluations (evaluations every ``--eval_every`` RL steps and at the last step).
6. **Statistics**: paired bootstrap (``paired_bootstrap``) over seeds and test problems of the
   relative pass@8 and mean@8 gain vs GRPO, the absolute difference and the paired effect size
   d_z (mean per-seed difference / its std), each with a 95% percentile interval.
7. **Equal compute**: every method draws P prompts and generates ``R = P * n_bar`` rollouts per
   step (Rollout-GDRO redistributes the same R; shapes are static) for the same number of steps
   and updates; the report prints the measured rollouts, generated tokens and updates.
8. **Diagnostics**: the *true* weighted standard error ``WSE = sum_b qhat_b sigma_b / sqrt(n_b)``
   (spec s.4/s.7) with ``sigma_b^2`` the bin's mean of ``p_i (1 - p_i)`` from true per-prompt
   success rates ``p_i`` (not the allocator's proxy), for the allocation used and for the
   uniform one; the expected number of informative groups ``sum_i 1 - p_i^n_i - (1-p_i)^n_i``
   and the measured one per step; Prompt-GDRO's weight ESS over informative rollouts and the
   share of steps where the weight cap binds (``gdro/weight_ess``, ``gdro/weight_cap_bound``);
   step x bin heatmaps of data share, weight q and rollouts per prompt.

True success rates ``p_i``: ``--oracle_json=PATH``, a JSON object written by
``experiments/oracle.py`` (or by hand)::

    {"p": {"<prompt id>": p, ...},            # required: per-sample success in [0, 1]
     "problems": {"<prompt id>": "3+4", ...},  # optional: checked against the RL pool
     ...}                                      # any other keys (samples, model, ...) are kept

where ``<prompt id>`` is the RL training prompt's ``"id"`` (its index in the training list of
``configs/arithmetic.py:<algorithm>,<--config_arg>``, the ids the curriculum uses; with
``--rl_prompts=N`` the pool is ids ``0 .. N-1``); missing ids are left out of the diagnostic.
Without it, ``p_i`` is estimated here from ``--oracle_samples`` samples per RL prompt (training
sampling settings) of each seed's warm-start model (``0`` = skip the diagnostic); either way
``p_i`` is fixed over training (the warm start's), which the report says.

Wall time: ``--estimate_only`` times one warm start and one RL job in this process and prints
the extrapolated total; a normal run prints the same estimate after its first RL job (warning
when it exceeds ``--budget_minutes``) and the total at the end.

Writes into ``--out``: ``gdro_vs_grpo.md`` (the report), ``gdro_vs_grpo.json`` (every number),
``gdro_vs_grpo/*.png`` and ``gdro_vs_grpo/runs/`` (per job: ``<method>_lr<lr>_s<seed>.jsonl``
metrics rows, ``.npz`` per-problem evaluations and placements, ``.json`` metadata; ``warm_s<seed>``
for the warm starts), from which ``--report_only`` rebuilds the report.

Library entry points: ``run_comparison(...) -> dict``, ``split_heldout``, ``select_lr``,
``paired_bootstrap``, ``bootstrap_relative_gain``, ``true_wse``, ``load_oracle``,
``evaluate_per_problem``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import sys
import time
import warnings
from collections.abc import Sequence

import numpy as np

# method name -> (algorithm, config.gdro overrides as "<section>.<field>": value)
METHODS: dict[str, tuple[str, dict]] = {
    "grpo": ("grpo", {}),
    "prompt_gdro_aw": ("prompt_gdro", {"prompt.apply": "advantage_weight"}),
    "prompt_gdro_rs": ("prompt_gdro", {"prompt.apply": "resample"}),
    "rollout_gdro_bandit": ("rollout_gdro", {"rollout.allocator": "bandit"}),
    "rollout_gdro_sqrt": ("rollout_gdro", {"rollout.allocator": "sqrt"}),
}
LABELS = {
    "grpo": "GRPO",
    "prompt_gdro_aw": "Prompt-GDRO (advantage_weight)",
    "prompt_gdro_rs": "Prompt-GDRO (resample)",
    "rollout_gdro_bandit": "Rollout-GDRO (bandit)",
    "rollout_gdro_sqrt": "Rollout-GDRO (sqrt)",
}
PAPER = "+10.6% (Prompt-GDRO) / +10.1% (Rollout-GDRO) relative pass@8 over GRPO on Qwen3-Base"
REPORT_NAME = "gdro_vs_grpo"
DEFAULT_LRS = (3e-5, 1e-4, 3e-4)
DEFAULT_CONFIG = "configs/arithmetic.py"
METRICS = ("pass_at_k", "mean_at_k")
PASS_K = 8  # the paper's pass@8, estimated from all evaluation samples (Chen et al. 2021)


def label(method: str) -> str:
    return LABELS.get(method, method)


# ----------------------------------------------------------------------------- configs


def method_config(
    method: str,
    seed: int,
    *,
    config_arg: str = "heavy_tailed",
    steps: int = 0,
    rl_prompts: int = 0,
    lr: float | None = None,
    paper_gdro: bool = False,
    prompts_per_step: int = 0,
):
    """The ``configs/arithmetic.py:<algo>,<config_arg>`` config of ``method`` for one seed
    (another config file with ``config_arg = "<file.py>:<argument>"``).

    Args:
      method: a key of ``METHODS``.
      seed: ``config.seed`` (init, data order, sampling).
      config_arg: the config argument after the algorithm (``heavy_tailed``, ``frontier``, ...)
        of ``configs/arithmetic.py``, or ``"<file.py>:<argument>"`` for another config file
        whose ``get_config`` takes ``"<algorithm>[,<argument>]"`` (``--config``).
      steps: RL steps (0 = the config's).
      rl_prompts: ``config.data.max_train_examples`` (0 = all training problems).
      lr: ``config.optimizer.learning_rate`` (None = the config's).
      paper_gdro: the paper's controllers (``common.paper_gdro``) with the failure-rate loss
        signal (the setting of the first report); default: the corrected defaults.
      prompts_per_step: ``config.rollout.prompts_per_step`` (0 = the config's).

    Raises:
      ValueError: unknown method.
    """
    from configs import common

    if method not in METHODS:
        raise ValueError(f"method {method!r}: choose from {list(METHODS)}")
    algo, gdro = METHODS[method]
    path, arg = split_config_arg(config_arg)
    c = load_config_module(path).get_config(f"{algo},{arg}" if arg else algo)
    c.seed = int(seed)
    if steps:
        c.steps = int(steps)
    if prompts_per_step:
        c.rollout.prompts_per_step = int(prompts_per_step)
    if lr is not None:
        c.optimizer.learning_rate = float(lr)
    c.data.max_train_examples = int(rl_prompts)
    if paper_gdro:
        # the paper's GDRO (mode="paper") with the failure-rate loss signal: the surrogate is ~0
        # at ratio 1 with one update per batch (docs/gdro.md)
        common.paper_gdro(c)
        c.gdro.prompt.signal = c.gdro.rollout.signal = "failure_rate"
    for k, v in gdro.items():
        section, field = k.split(".")
        c.gdro[section][field] = v
    c.mesh.num_devices = 1  # one CPU device per process (tests force 8 virtual ones)
    c.logging.progress_bar = False
    c.logging.tensorboard = False
    return c


def split_config_arg(config_arg: str) -> tuple[str, str]:
    """``"<file.py>:<argument>"`` -> (file, argument); a bare argument -> (`DEFAULT_CONFIG`, it)."""
    head, sep, tail = (config_arg or "").partition(":")
    if head.endswith(".py"):
        return head, tail
    if sep:
        raise ValueError(f"config_arg {config_arg!r}: expected '<file.py>:<argument>'")
    return DEFAULT_CONFIG, config_arg or ""


def load_config_module(path: str):
    """The config module at ``path`` (relative to the working directory or to the repository)."""
    import importlib.util

    full = path
    if not os.path.isabs(full) and not os.path.exists(full):
        full = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), path)
    if not os.path.exists(full):
        raise FileNotFoundError(f"--config {path}: no such file")
    name = "grpo_jax_compare_config_" + os.path.splitext(os.path.basename(full))[0]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, full)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules[name] = mod
    return mod


def eval_steps(steps: int, every: int) -> list[int]:
    """The RL steps after which a run is evaluated: every ``every`` steps and the last one."""
    steps = int(steps)
    out = list(range(every, steps, every)) if every and every > 0 else []
    return out + [steps]


# ----------------------------------------------------------------------------- evaluation


class _RecordingReward:
    """Wraps a reward function and keeps the ``correct`` array of every call (in call order)."""

    def __init__(self, fn):
        self.fn = fn
        self.calls: list[np.ndarray] = []

    def __call__(self, completions, golds):
        out = self.fn(completions, golds)
        self.calls.append(np.asarray(out[1], bool))
        return out


def evaluate_per_problem(
    exp, params, rng, *, examples=None, reward_fn=None, sampling=None, k: int = 0
) -> tuple[dict, np.ndarray, np.ndarray]:
    """``evaluation.evaluate_policy`` keeping per-problem results (the same key split as
    ``evaluation.evaluate``). Default: the experiment's first held-out set with the evaluation
    protocol; ``examples`` / ``reward_fn`` / ``sampling`` / ``k`` override (e.g. the RL pool at
    the training sampling settings, for success-rate estimates).

    Returns:
      (summary dict of ``evaluate_policy``, correct ``[N, k]`` bool, levels ``[N]`` int).

    Raises:
      RuntimeError: when the per-problem matrix does not reproduce the library's pass@k / mean@1.
    """
    import jax

    from grpo_jax import evaluation

    cfg = exp.config.eval
    k = int(k or cfg.num_samples)
    name, held_out = next(iter(exp.eval_sets.items()))
    if examples is None:
        examples = held_out
    rec = _RecordingReward(reward_fn or exp.eval_reward_fns[name])
    _, key = jax.random.split(rng)
    summary = evaluation.evaluate_policy(
        exp.graphdef,
        params,
        examples,
        tokenizer=exp.tokenizer,
        reward_fn=rec,
        sampling_config=sampling or exp.eval_sampling,
        render=exp.render,
        prompt_len=exp.prompt_len,
        k=k,
        batch_size=cfg.batch_size,
        rng=key,
        mesh=exp.mesh,
    )
    num = len(examples)
    per_call = max(cfg.batch_size // k, 1)
    correct = np.zeros((num, k), bool)
    for j, ok in enumerate(rec.calls):
        start = j * per_call
        valid = min(per_call, num - start)
        correct[start : start + valid] = ok.reshape(per_call, k)[:valid]
    levels = np.asarray([int(ex.get("level", -1)) for ex in examples])
    if (
        abs(correct.mean() - summary["mean_at_1"]) > 1e-6
        or abs(correct.any(1).mean() - summary[f"pass_at_{k}"]) > 1e-6
    ):
        raise RuntimeError("per-problem evaluation does not match evaluation.evaluate_policy")
    return summary, correct, levels


def _eval_key(seed: int, step: int):
    """The evaluation key of (seed, step): the same for every method and lr (paired)."""
    import jax

    return jax.random.fold_in(jax.random.PRNGKey(int(seed) + 7), int(step))


def split_heldout(num: int) -> tuple[np.ndarray, np.ndarray]:
    """(validation, test) indices into the held-out list: even index -> validation, odd ->
    test. The arithmetic generator shuffles the held-out list over levels, so each half holds
    about half of every level. Deterministic and disjoint; together they cover ``range(num)``."""
    idx = np.arange(int(num))
    return idx[0::2], idx[1::2]


# ----------------------------------------------------------------------------- true success rates


def load_oracle(path: str, num_prompts: int, problems: Sequence[str] | None = None) -> np.ndarray:
    """Per-sample success rates of the RL pool from an oracle JSON (format: module docstring).

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


def true_wse(ids, bins, n, p, n_bar: float) -> dict:
    """True-variance diagnostics of one step's allocation (spec s.4/s.7).

    Args:
      ids, bins, n: ``[P]`` prompt ids, bins (``B`` = unseen: its own group) and rollouts per
        prompt of the step.
      p: ``[num_prompts]`` true per-sample success rates (NaN = unknown: left out).
      n_bar: the uniform allocation's rollouts per prompt.

    Returns: ``wse`` = ``sum_b qhat_b sigma_b / sqrt(n_b)`` (as
      ``gdro.rollout_gdro.weighted_standard_error``: ``mean_i sigma_{b(i)} / sqrt(n_i)``) with
      ``sigma_b^2`` = the bin's mean of ``p_i (1 - p_i)`` over the controller's bins;
      ``wse_uniform`` (same prompts and bins, every ``n_i = n_bar``); ``wse_p_strata`` /
      ``wse_p_strata_uniform``: the same with strata = bins of the *true* p
      (`experiments.oracle.true_wse`, the oracle pre-check's definition); ``informative`` = expected informative groups
      ``sum_i 1 - p_i^n_i - (1 - p_i)^n_i``; ``informative_uniform``; ``known`` = prompts with a
      known ``p``. NaN values when no prompt has a known ``p``.
    """
    ids, bins = np.asarray(ids, np.int64), np.asarray(bins, np.int64)
    n = np.asarray(n, np.float64)
    pi = np.asarray(p, np.float64)[ids]
    ok = np.isfinite(pi)
    nan = float("nan")
    if not ok.any():
        return dict(
            wse=nan,
            wse_uniform=nan,
            wse_p_strata=nan,
            wse_p_strata_uniform=nan,
            informative=nan,
            informative_uniform=nan,
            known=0,
        )
    ids, bins, n, pi = ids[ok], bins[ok], n[ok], pi[ok]
    var = pi * (1 - pi)
    groups = bins.max() + 1
    cnt = np.bincount(bins, minlength=groups)
    sig = np.sqrt(np.bincount(bins, weights=var, minlength=groups) / np.maximum(cnt, 1))
    s = sig[bins]
    inf = lambda m: float(np.sum(1 - pi**m - (1 - pi) ** m))
    from experiments.oracle import true_wse as strata_wse  # strata = true-p bins

    return {
        "wse": float(np.mean(s / np.sqrt(n))),
        "wse_uniform": float(np.mean(s / np.sqrt(n_bar))),
        "wse_p_strata": float(strata_wse(pi, n)),
        "wse_p_strata_uniform": float(strata_wse(pi, np.full(n.shape, float(n_bar)))),
        "informative": inf(n),
        "informative_uniform": inf(np.full(n.shape, float(n_bar))),
        "known": int(ok.sum()),
    }


# ----------------------------------------------------------------------------- jobs


class _RecordingCurriculum:
    """Delegates to the experiment's curriculum and keeps each ``allocate`` result's prompt ids,
    bins and rollouts per prompt (the placements the true-WSE diagnostic needs)."""

    def __init__(self, inner):
        self._inner = inner
        self.calls: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def allocate(self, state, ids):
        pl = self._inner.allocate(state, ids)
        ids = np.asarray(ids, np.int32)
        n = np.bincount(np.asarray(pl.segment_ids), minlength=len(ids)).astype(np.int32)
        self.calls.append((ids, np.asarray(pl.bins, np.int32), n))
        return pl


def warm_start_job(
    seed: int,
    config_arg: str,
    paper_gdro: bool = False,
    oracle_samples: int = 0,
    rl_prompts: int = 0,
) -> dict:
    """SFT warm start (on the config's full training set) + "before" evaluation of one seed;
    with ``oracle_samples`` > 0 also the warm-start model's success rate on each of the first
    ``rl_prompts`` training problems (the RL pool) from that many samples at the training
    sampling settings."""
    from grpo_jax import steps as steps_lib
    from grpo_jax import transfer
    from grpo_jax.experiment import build_experiment

    t0 = time.perf_counter()
    cfg = method_config("grpo", seed, config_arg=config_arg, paper_gdro=paper_gdro)
    exp = build_experiment(cfg)
    oracle_p = np.zeros(0)
    pool: list[str] = []
    try:
        state = steps_lib.init_train_state(exp)
        params, sft = steps_lib.supervised_warmstart(exp, state.params)
        summary, correct, levels = evaluate_per_problem(exp, params, _eval_key(seed, 0))
        if oracle_samples > 0:
            pool_ex = exp.examples[: rl_prompts or len(exp.examples)]
            pool = [ex["problem"] for ex in pool_ex]
            _, ok, _ = evaluate_per_problem(
                exp,
                params,
                _eval_key(seed, 2**30),  # a key no evaluation uses
                examples=pool_ex,
                reward_fn=exp.reward_fn,
                sampling=exp.train_sampling,
                k=oracle_samples,
            )
            oracle_p = ok.mean(1)
    finally:
        exp.close()
    return {
        "seed": seed,
        "params": transfer.to_host(params),
        "sft": sft,
        "eval": summary,
        "correct": correct,
        "levels": levels,
        "oracle_p": oracle_p,
        "oracle_problems": pool,
        "seconds": time.perf_counter() - t0,
    }


def rl_job(
    method: str,
    seed: int,
    params,
    *,
    lr: float,
    config_arg: str = "heavy_tailed",
    steps: int = 0,
    rl_prompts: int = 512,
    paper_gdro: bool = False,
    prompts_per_step: int = 0,
    eval_every: int = 0,
    runs_dir: str | None = None,
) -> dict:
    """RL from the seed's warm-start ``params`` with ``method`` at learning rate ``lr``,
    evaluated on the whole held-out set after each step of ``eval_steps(steps, eval_every)``.

    Returns the job dict (``correct [T, N, k]``, ``eval_steps [T]``, per-step placements
    ``ids``/``bins``/``n`` ``[steps, P]`` (empty when a step allocated more than once), rows,
    compute counts); writes the rows to ``runs_dir/<job name>.jsonl`` (if given).
    """
    import jax

    from grpo_jax import steps as steps_lib  # `steps` is the argument (RL steps)
    from grpo_jax import train, writers
    from grpo_jax.experiment import build_experiment

    t0 = time.perf_counter()
    cfg = method_config(
        method,
        seed,
        config_arg=config_arg,
        steps=steps,
        rl_prompts=rl_prompts,
        lr=lr,
        paper_gdro=paper_gdro,
        prompts_per_step=prompts_per_step,
    )
    exp = build_experiment(cfg)
    rec = _RecordingCurriculum(exp.curriculum)
    rexp = dataclasses.replace(exp, curriculum=rec)
    when = eval_steps(cfg.steps, eval_every)
    rows, evals, summaries, placements = [], [], [], []
    eval_seconds = 0.0
    try:
        source = rexp.make_source()
        params = jax.tree.map(lambda x: jax.numpy.asarray(x), params)
        run, _ = steps_lib.init_run(rexp, params=params)
        fns = steps_lib.make_steps(rexp)
        while int(run.train.step) < cfg.steps:
            rec.calls.clear()
            run, row = train.rl_step(rexp, fns, run, source)
            step = int(run.train.step)
            rows.append(writers.to_jsonable({"step": step, **row}))
            placements.append(rec.calls[0] if len(rec.calls) == 1 else None)
            if step in when:
                te = time.perf_counter()
                summary, correct, levels = evaluate_per_problem(
                    rexp, run.train.params, _eval_key(seed, step)
                )
                eval_seconds += time.perf_counter() - te
                evals.append(correct)
                summaries.append({"step": step, **summary})
        pool = [ex["problem"] for ex in exp.examples]
    finally:
        exp.close()
    name = job_name(method, lr, seed)
    if runs_dir:
        os.makedirs(runs_dir, exist_ok=True)
        with open(os.path.join(runs_dir, f"{name}.jsonl"), "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    if placements and all(p is not None for p in placements):
        ids, bins, n = (np.stack([p[j] for p in placements]) for j in range(3))
    else:
        ids = bins = n = np.zeros((0, 0), np.int32)
    R = cfg.rollout.prompts_per_step * cfg.rollout.rollouts_per_prompt
    per_step = int(cfg.algorithm.num_iterations) * (R // int(exp.mini_batch_size))
    return {
        "method": method,
        "seed": seed,
        "lr": float(lr),
        "rows": rows,
        "eval": summaries[-1],
        "eval_summaries": summaries,
        "eval_steps": np.asarray(when),
        "correct": np.stack(evals),
        "levels": levels,
        "ids": ids,
        "bins": bins,
        "n": n,
        "seconds": time.perf_counter() - t0,
        "eval_seconds": eval_seconds,
        "num_prompt_ids": exp.curriculum.num_prompts,
        "num_bins": int(exp.num_bins),
        "n_bar": int(cfg.rollout.rollouts_per_prompt),
        "rollouts_per_step": R,
        "rollouts": R * len(rows),
        "generated_tokens": int(sum(r["generated_tokens"] for r in rows)),
        "updates": per_step * len(rows) - int(sum(r.get("skipped_updates", 0) for r in rows)),
        "pool_problems": pool if len(pool) <= 4096 else [],  # checked against an oracle file
    }


def job_name(method: str | None, lr: float | None, seed: int) -> str:
    return f"warm_s{seed}" if method is None else f"{method}_lr{float(lr):.3g}_s{seed}"


def enable_compilation_cache(cache_dir: str) -> None:
    """JAX's persistent compilation cache in ``cache_dir`` ("" = leave JAX's setting): every job
    rebuilds the same jitted functions, and the cache turns ~20 s of XLA compiles per job into
    about one."""
    if not cache_dir:
        return
    import jax

    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _worker_init(cache_dir: str = ""):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    enable_compilation_cache(cache_dir)


def _call(fn_args):
    fn, args, kwargs = fn_args
    return fn(*args, **kwargs)


# ----------------------------------------------------------------------------- statistics


def pass_at_k_unbiased(num_correct, n: int, k: int) -> np.ndarray:
    """Unbiased pass@k from ``n`` samples with ``num_correct`` correct (Chen et al. 2021, Eq. 1):
    ``1 - C(n - c, k) / C(n, k)``, exact via integer binomials.

    Args:
      num_correct: int array, values in ``0..n``.
      n, k: samples per problem and the k of pass@k (``1 <= k <= n``).

    Returns: float64 array shaped like ``num_correct``.

    Raises:
      ValueError: ``k`` outside ``1..n``.
    """
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n = {n} samples")
    table = np.array([1.0 - math.comb(n - c, k) / math.comb(n, k) for c in range(n + 1)])
    return table[np.asarray(num_correct, np.int64)]


def per_problem_scores(
    correct, metric: str = "pass_at_k", last: int = 0, pass_k: int = PASS_K
) -> np.ndarray:
    """Per-problem scores from sample correctness.

    Args:
      correct: ``[S, N, n]`` or ``[S, T, N, n]`` (T evaluations) bool / 0-1, n samples each.
      metric: ``pass_at_k`` (unbiased pass@``min(pass_k, n)`` of Chen et al. 2021 from the n
        samples; with n = k it is 1[any sample correct]) or ``mean_at_k`` (share of correct
        samples: the unbiased mean@k for every k).
      last: with ``[S, T, N, n]``, average the last ``last`` evaluations (0 = all).
      pass_k: the k of pass@k.

    Returns: ``[S, N]`` float64.

    Raises:
      ValueError: another shape or metric.
    """
    c = np.asarray(correct)
    if c.ndim == 4:
        c = c[:, -last:] if last else c
    elif c.ndim != 3:
        raise ValueError(f"correct must be [S, N, k] or [S, T, N, k]; got shape {c.shape}")
    n = c.shape[-1]
    if metric == "pass_at_k":
        s = pass_at_k_unbiased(c.astype(bool).sum(-1), n, min(int(pass_k), n))
    elif metric == "mean_at_k":
        s = c.astype(np.float64).mean(-1)
    else:
        raise ValueError(f"metric {metric!r}: choose from {METRICS}")
    return s.mean(1) if s.ndim == 3 else s


def paired_bootstrap(
    scores_m, scores_base, *, n_boot: int = 2000, seed: int = 0, level: float = 0.95
) -> dict:
    """Paired bootstrap of a method against a baseline from per-problem scores ``[S, N]``.

    Each replicate resamples seeds (with replacement) and, independently, problems (with
    replacement), and applies the *same* draw to both methods (they share each seed's warm start,
    evaluation keys and problems: a paired design).

    Returns:
      ``gain`` = mean(method) / mean(base) - 1 with ``lo``/``hi`` (percentile interval) and
      ``p_le_0`` (share of replicates with gain <= 0); ``diff`` = mean(method) - mean(base)
      with ``diff_lo``/``diff_hi``; ``d_z`` = mean / std (ddof 1) of the per-seed differences
      (paired effect size; NaN with one seed) with ``d_z_lo``/``d_z_hi``; ``mean``, ``base``;
      ``n_seeds``, ``n_problems``.

    Raises:
      ValueError: shape mismatch or an all-zero baseline.
    """
    a = np.asarray(scores_m, np.float64)
    b = np.asarray(scores_base, np.float64)
    if a.shape != b.shape or a.ndim != 2:
        raise ValueError(f"scores must both be [S, N]; got shapes {a.shape}, {b.shape}")
    if b.mean() == 0:
        raise ValueError("baseline score is 0: the relative gain is undefined")
    s, n = a.shape
    rng = np.random.default_rng(seed)
    si = rng.integers(0, s, size=(n_boot, s))
    ni = rng.integers(0, n, size=(n_boot, n))
    cols = np.arange(n_boot)[:, None]
    # per seed, the mean over each replicate's resampled problems: [S, n_boot]
    ar, br = a[:, ni].mean(-1), b[:, ni].mean(-1)
    am, bm = ar[si, cols], br[si, cols]  # [n_boot, S]: the resampled seeds
    alpha = (1 - level) / 2
    q = lambda x: (float(np.quantile(x, alpha)), float(np.quantile(x, 1 - alpha)))
    with np.errstate(divide="ignore", invalid="ignore"):
        g = am.mean(1) / bm.mean(1) - 1.0
        d = am - bm
        dz = d.mean(1) / d.std(1, ddof=1) if s > 1 else np.full(n_boot, np.nan)
    g = g[np.isfinite(g)]
    dz = dz[np.isfinite(dz)]
    per_seed = a.mean(1) - b.mean(1)
    sd = per_seed.std(ddof=1) if s > 1 else float("nan")
    if s > 1 and sd > 0:
        d_z = float(per_seed.mean() / sd)
    elif s > 1 and per_seed.mean() == 0:
        d_z = 0.0
    else:
        d_z = float("nan")
    out = {
        "gain": float(a.mean() / b.mean() - 1.0),
        "p_le_0": float(np.mean(g <= 0)) if g.size else float("nan"),
        "diff": float(a.mean() - b.mean()),
        "d_z": d_z,
        "mean": float(a.mean()),
        "base": float(b.mean()),
        "n_seeds": int(s),
        "n_problems": int(n),
    }
    out["lo"], out["hi"] = q(g) if g.size else (float("nan"),) * 2
    out["diff_lo"], out["diff_hi"] = q(d.mean(1))
    out["d_z_lo"], out["d_z_hi"] = q(dz) if dz.size else (float("nan"),) * 2
    return out


def _safe_bootstrap(a, b, **kw) -> dict:
    """``paired_bootstrap``, or the same keys as NaN (plus ``undefined``) when the baseline's
    score is 0 (the relative gain is undefined; the report shows a dash)."""
    try:
        return paired_bootstrap(a, b, **kw)
    except ValueError as e:
        keys = ("gain", "lo", "hi", "p_le_0", "diff", "diff_lo", "diff_hi", "d_z", "d_z_lo")
        out = dict.fromkeys(keys + ("d_z_hi",), float("nan"))
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
    evaluations averaged per problem): ``per_problem_scores`` then ``paired_bootstrap`` (see
    both). ``gain = mean score(method) / mean score(base) - 1``, means over seeds and problems.

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
      metric, last: see ``per_problem_scores``.

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


def estimate_wall(
    warm_seconds: float, job_seconds: float, n_warm: int, n_jobs: int, workers: int
) -> float:
    """Wall seconds of ``n_warm`` warm starts then ``n_jobs`` RL jobs on ``workers`` processes,
    each taking the measured time (jobs run in waves of ``workers``)."""
    w = max(int(workers), 1)
    return math.ceil(n_warm / w) * warm_seconds + math.ceil(n_jobs / w) * job_seconds


def _metric_table(scores: dict, levels: np.ndarray) -> dict:
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


# ----------------------------------------------------------------------------- figures


def _mean_rows(rows_per_seed: Sequence[list], key: str) -> list[dict]:
    """Per-step mean over seeds of a list-valued metric -> rows for ``report.heatmap``."""
    by_step: dict[int, list] = {}
    for rows in rows_per_seed:
        for r in rows:
            if isinstance(r.get(key), list):
                by_step.setdefault(r["step"], []).append(np.asarray(r[key], float))
    return [
        {"step": s, key: np.nanmean(np.stack(v), 0).tolist()} for s, v in sorted(by_step.items())
    ]


def _series(rows_per_seed, key):
    steps = sorted({r["step"] for rows in rows_per_seed for r in rows if key in r})
    vals = np.full((len(rows_per_seed), len(steps)), np.nan)
    pos = {s: i for i, s in enumerate(steps)}
    for j, rows in enumerate(rows_per_seed):
        for r in rows:
            if key in r:
                with contextlib.suppress(TypeError, ValueError):
                    vals[j, pos[r["step"]]] = float(r[key])
    return np.asarray(steps), vals


def _smooth(y, w):
    if w <= 1 or len(y) < w:
        return y
    k = np.ones(w) / w
    return np.convolve(np.nan_to_num(y, nan=np.nanmean(y)), k, mode="valid")


def make_figures(results: dict, fig_dir: str) -> dict[str, str]:
    """Writes the PNGs (final runs at the chosen lr; evaluations on the test half); returns
    {name: path}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from experiments import report

    os.makedirs(fig_dir, exist_ok=True)
    paths = {}
    runs = results["runs"]
    methods = list(runs)
    rows = {m: [runs[m][s]["rows"] for s in sorted(runs[m])] for m in methods}

    def save(fig, name):
        path = os.path.join(fig_dir, name)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths[name[:-4]] = path

    # data share per bin, every method
    fig, axes = plt.subplots(1, len(methods), figsize=(4.2 * len(methods), 3.6), squeeze=False)
    for ax, m in zip(axes[0], methods):
        report.heatmap(
            ax, _mean_rows(rows[m], "gdro/bin_share"), "gdro/bin_share", f"{label(m)}\nshare/bin"
        )
    save(fig, "heatmap_data_share.png")
    pg = [m for m in methods if METHODS[m][0] == "prompt_gdro"]
    if pg:  # Prompt-GDRO weight / sampling distribution q
        fig, axes = plt.subplots(1, len(pg), figsize=(5 * len(pg), 3.6), squeeze=False)
        for ax, m in zip(axes[0], pg):
            resample = METHODS[m][1].get("prompt.apply") == "resample"
            what = "sampling distribution q" if resample else "weight q"
            report.heatmap(ax, _mean_rows(rows[m], "gdro/q"), "gdro/q", f"{label(m)}\n{what}")
        save(fig, "heatmap_prompt_gdro_q.png")
    rg = [m for m in methods if METHODS[m][0] == "rollout_gdro"]
    if rg:  # Rollout-GDRO rollouts per prompt
        fig, axes = plt.subplots(1, len(rg), figsize=(5 * len(rg), 3.6), squeeze=False)
        for ax, m in zip(axes[0], rg):
            report.heatmap(
                ax,
                _mean_rows(rows[m], "rollout_gdro/n_b"),
                "rollout_gdro/n_b",
                f"{label(m)}\nrollouts per prompt n_b",
            )
        save(fig, "heatmap_rollouts_per_prompt.png")
    # true WSE, its ratio to uniform, informative groups per step
    diag = results["diagnostics"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 3.8))
    for m in methods:
        series = diag[m].get("series", {})
        for ax, key in zip(axes, ("wse_true", "wse_true_ratio", "informative")):
            v = np.asarray(series.get(key, []), float)
            if v.size and np.isfinite(v).any():
                st = np.arange(1, v.shape[1] + 1)
                w = max(1, len(st) // 20)
                ax.plot(st[w - 1 :], _smooth(np.nanmean(v, 0), w), label=label(m))
    titles = (
        "true WSE = sum_b qhat_b sigma_b / sqrt(n_b) (sigma from p_i)",
        "true WSE / uniform allocation (same batches)",
        "informative groups per step (measured)",
    )
    for ax, t in zip(axes, titles):
        ax.set_title(t, fontsize=9)
        ax.set_xlabel("step")
        if ax.lines:
            ax.legend(fontsize=7)
    axes[1].axhline(1.0, color="k", lw=0.8)
    save(fig, "wse_true.png")
    # training curves
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
    for ax, key in zip(axes, ["reward_mean", "pass_rate", "advantages/num_zero_std_groups"]):
        for m in methods:
            st, v = _series(rows[m], key)
            if len(st):
                w = max(1, len(st) // 15)
                ax.plot(st[w - 1 :], _smooth(np.nanmean(v, 0), w), label=label(m))
        ax.set_title(f"train {key} (mean over seeds, smoothed)", fontsize=9)
        ax.set_xlabel("step")
    if axes[0].lines:
        axes[0].legend(fontsize=7)
    save(fig, "train_curves.png")
    # held-out (test half) evaluations over training
    curves = results["eval_curves"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    for ax, metric in zip(axes, METRICS):
        for m in methods:
            st = [0] + list(curves[m]["steps"])
            y = [curves["before"][metric]] + list(curves[m][metric])
            ax.plot(st, 100 * np.asarray(y), marker="o", ms=3, label=label(m))
        pk = results.get("pass_k", results["k"])
        ax.set_title(f"test {metric.replace('_at_k', '@')}{pk} (mean over seeds)")
        ax.set_xlabel("step")
        ax.set_ylabel("%")
    axes[0].legend(fontsize=7)
    save(fig, "eval_curves.png")
    # learning-rate sweep on the validation half
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for m in methods:
        sc = results["sweep"][m]["scores"]
        lrs = [float(x) for x in sc]
        ax.plot(lrs, [100 * v for v in sc.values()], marker="o", label=label(m))
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel(f"validation {results['setup']['select_metric']} (%)")
    ax.set_title("lr sweep (sweep seeds, validation half)", fontsize=9)
    ax.legend(fontsize=7)
    save(fig, "lr_sweep.png")
    # headline bar chart: test pass@8 per level
    fig, ax = plt.subplots(figsize=(9, 3.6))
    tab = results["tables"]
    groups = list(tab["before"].keys())
    width = 0.8 / (len(methods) + 1)
    for i, m in enumerate(["before"] + methods):
        mean = [tab[m][g]["pass_at_k"][0] for g in groups]
        std = [tab[m][g]["pass_at_k"][1] for g in groups]
        ax.bar(
            np.arange(len(groups)) + i * width,
            mean,
            width,
            yerr=std,
            capsize=2,
            label="before RL (SFT)" if m == "before" else label(m),
        )
    ax.set_xticks(np.arange(len(groups)) + 0.4 - width / 2)
    ax.set_xticklabels([g if g == "overall" else f"level {g}" for g in groups])
    ax.set_ylabel(f"test pass@{results.get('pass_k', results['k'])}")
    ax.legend(fontsize=7, ncol=3)
    save(fig, "pass_at_8.png")
    return paths


# ----------------------------------------------------------------------------- diagnostics


def _rows_values(rows, key) -> np.ndarray:
    out = []
    for r in rows:
        with contextlib.suppress(TypeError, ValueError):
            out.append(float(r[key]) if key in r else float("nan"))
    return np.asarray(out, float)


def _diagnostics(runs: dict, p_for_seed) -> dict:
    """Per-method training diagnostics over the final runs (means over steps and seeds).

    ``p_for_seed(seed)`` -> ``[num_prompts]`` true success rates or None.
    """
    out = {}
    for m, by_seed in runs.items():
        rows = [r for s in by_seed for r in by_seed[s]["rows"]]
        ng = _rows_values(rows, "advantages/num_groups")
        nz = _rows_values(rows, "advantages/num_zero_std_groups")
        d = {
            "train_pass_rate": float(np.nanmean(_rows_values(rows, "pass_rate"))),
            "informative_groups": float(np.nanmean(ng - nz)),
            "informative_share": float(np.nanmean((ng - nz) / np.maximum(ng, 1))),
            "sample_weight_max": float(np.nanmean(_rows_values(rows, "sample_weight_max"))),
        }
        series = {"informative": [], "wse_true": [], "wse_true_ratio": []}
        tot = dict.fromkeys(
            (
                "wse",
                "wse_uniform",
                "wse_p_strata",
                "wse_p_strata_uniform",
                "informative",
                "informative_uniform",
            ),
            0.0,
        )
        known, counted = [], 0
        for s in sorted(by_seed):
            job = by_seed[s]
            r_ng = _rows_values(job["rows"], "advantages/num_groups")
            r_nz = _rows_values(job["rows"], "advantages/num_zero_std_groups")
            series["informative"].append((r_ng - r_nz).tolist())
            p = p_for_seed(s)
            ids = np.asarray(job.get("ids", np.zeros((0, 0))))
            if p is None or ids.size == 0:
                continue
            per = [
                true_wse(ids[t], job["bins"][t], job["n"][t], p, job["n_bar"])
                for t in range(ids.shape[0])
            ]
            series["wse_true"].append([x["wse"] for x in per])
            series["wse_true_ratio"].append(
                [x["wse"] / x["wse_uniform"] if x["wse_uniform"] > 0 else np.nan for x in per]
            )
            for x in per:
                if np.isfinite(x["wse"]):
                    counted += 1
                    for k_ in tot:
                        tot[k_] += x[k_]
                    known.append(x["known"] / ids.shape[1])
        if counted:
            d["wse_true"] = tot["wse"] / counted
            d["wse_true_uniform"] = tot["wse_uniform"] / counted
            d["wse_true_ratio"] = tot["wse"] / tot["wse_uniform"] if tot["wse_uniform"] else np.nan
            d["wse_p_strata_ratio"] = (
                tot["wse_p_strata"] / tot["wse_p_strata_uniform"]
                if tot["wse_p_strata_uniform"]
                else np.nan
            )
            d["expected_informative"] = tot["informative"] / counted
            d["expected_informative_uniform"] = tot["informative_uniform"] / counted
            d["oracle_coverage"] = float(np.mean(known))
        if METHODS[m][0] == "rollout_gdro":
            v, u = (
                _rows_values(rows, "rollout_gdro/wse"),
                _rows_values(rows, "rollout_gdro/wse_uniform"),
            )
            ok = np.isfinite(v) & np.isfinite(u)
            if ok.any() and u[ok].sum() > 0:
                d["wse_proxy_ratio"] = float(v[ok].sum() / u[ok].sum())
        if METHODS[m][0] == "prompt_gdro":
            ess = _rows_values(rows, "gdro/weight_ess")
            cap = _rows_values(rows, "gdro/weight_cap_bound")
            d["weight_ess"] = float(np.nanmean(ess)) if np.isfinite(ess).any() else np.nan
            d["weight_cap_bound"] = float(np.nanmean(cap)) if np.isfinite(cap).any() else np.nan
        # pad the per-seed series to a rectangle (runs have the same number of steps)
        for k_, v in series.items():
            if v:
                width = max(len(x) for x in v)
                d.setdefault("series", {})[k_] = [list(x) + [np.nan] * (width - len(x)) for x in v]
        out[m] = d
    return out


def _curriculum_text(runs) -> str:
    lines = []
    for m in runs:
        share = [
            np.nanmean(
                [
                    r["gdro/bin_share"]
                    for r in runs[m][s]["rows"]
                    if isinstance(r.get("gdro/bin_share"), list)
                ],
                0,
            )
            for s in runs[m]
            if any(isinstance(r.get("gdro/bin_share"), list) for r in runs[m][s]["rows"])
        ]
        unseen = np.nanmean(
            [_rows_values(runs[m][s]["rows"], "gdro/unseen_share").mean() for s in runs[m]]
        )
        if share:
            share = np.stack(share).mean(0)
            lines.append(
                f"- {label(m)}: mean rollout share in bin 0 (hardest seen) {100 * share[0]:.0f}%, "
                f"in bins >= 5 {100 * share[5:].sum():.0f}%"
                + (f", unseen prompts {100 * unseen:.0f}%." if np.isfinite(unseen) else ".")
            )
        if METHODS[m][0] == "prompt_gdro":
            q = [
                r["gdro/q"]
                for s in runs[m]
                for r in runs[m][s]["rows"]
                if isinstance(r.get("gdro/q"), list)
            ]
            if q:
                q = np.asarray(q, float)
                lines.append(
                    f"  q: mean max weight {np.nanmax(q, 1).mean():.2f} on bin "
                    f"{int(np.bincount(np.nanargmax(q, 1)).argmax())} (most often)."
                )
        if METHODS[m][0] == "rollout_gdro":
            nb = [
                r["rollout_gdro/n_b"]
                for s in runs[m]
                for r in runs[m][s]["rows"]
                if isinstance(r.get("rollout_gdro/n_b"), list)
            ]
            if nb:
                nb = np.asarray(nb, float)
                present = (nb > 0).sum(0)
                mean_nb = np.where(
                    present > 0, np.where(nb > 0, nb, 0).sum(0) / np.maximum(present, 1), np.nan
                )
                lines.append(
                    "  mean rollouts per prompt by bin (steps where the bin is present): "
                    + ", ".join("—" if not np.isfinite(x) else f"{x:.1f}" for x in mean_nb)
                    + "."
                )
    return "\n".join(lines)


def _fmt(x, spec=".3f", pct=False):
    if x is None or not np.isfinite(x):
        return "—"
    return f"{100 * x:{spec}}" if pct else f"{x:{spec}}"


def _diagnostics_table(results) -> str:
    diag, runs = results["diagnostics"], results["runs"]
    L = [
        "| method | train pass rate | informative groups / step (measured) | expected informative "
        "groups (true p; uniform) | true WSE | true WSE / uniform | true WSE / uniform, "
        "true-p strata | proxy WSE / uniform | weight ESS (informative) | steps with the weight "
        "cap binding |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in runs:
        d = diag[m]
        P = results["setup"]["prompts_per_step"]
        L.append(
            f"| {label(m)} | {_fmt(d['train_pass_rate'], '.0f', True)}% | "
            f"{_fmt(d['informative_groups'], '.1f')} of {P} | "
            f"{_fmt(d.get('expected_informative'), '.1f')} ({_fmt(d.get('expected_informative_uniform'), '.1f')}) | "
            f"{_fmt(d.get('wse_true'), '.4f')} | {_fmt(d.get('wse_true_ratio'), '.3f')} | "
            f"{_fmt(d.get('wse_p_strata_ratio'), '.3f')} | "
            f"{_fmt(d.get('wse_proxy_ratio'), '.3f')} | {_fmt(d.get('weight_ess'), '.2f')} | "
            + (
                f"{_fmt(d.get('weight_cap_bound'), '.0f', True)}% |"
                if np.isfinite(d.get("weight_cap_bound", np.nan))
                else "— |"
            )
        )
    return "\n".join(L)


def _ci(g, key="gain", unit="%", spec="+.1f"):
    """``g[key] [lo, hi]``; ``unit`` "%" or "pp" scales by 100, "" does not."""
    lo = g.get("lo" if key == "gain" else f"{key}_lo")
    hi = g.get("hi" if key == "gain" else f"{key}_hi")
    if g.get(key) is None or not np.isfinite(g[key]):
        return "—"
    f = lambda x: _fmt(x, spec, bool(unit))
    return f"{f(g[key])}{unit} [{f(lo)}, {f(hi)}]"


def _verdict(results) -> str:
    gains = results["gains"]
    if not gains:
        return "Only GRPO was run: no comparison."
    sig = lambda g: (
        "undefined: GRPO scores 0"
        if not np.isfinite(g["gain"])
        else "above 0"
        if g["lo"] > 0
        else "below 0"
        if g["hi"] < 0
        else "not distinguishable from 0"
    )
    parts = [
        f"{label(m)}: pass@8 {_ci(g['pass_at_k'])} ({sig(g['pass_at_k'])}), mean@8 "
        f"{_ci(g['mean_at_k'])} ({sig(g['mean_at_k'])})"
        for m, g in gains.items()
    ]
    pos = [m for m, g in gains.items() if g["pass_at_k"]["lo"] > 0]
    neg = [m for m, g in gains.items() if g["pass_at_k"]["hi"] < 0]
    families = {METHODS[m][0] for m in gains}
    pos_families = {METHODS[m][0] for m in pos}
    if pos and pos_families == families:
        head = (
            "Yes: every GDRO family tested has a variant whose relative pass@8 gain over GRPO has "
            "a 95% bootstrap interval above zero (" + ", ".join(label(m) for m in pos) + ")."
        )
    elif pos:
        head = (
            "Partly: only " + ", ".join(label(m) for m in pos) + " shows a relative pass@8 gain "
            "over GRPO whose 95% bootstrap interval lies above zero."
        )
    elif all(not np.isfinite(g["pass_at_k"]["gain"]) for g in gains.values()):
        head = "Undecided: GRPO scores 0 on the test half, so no relative gain is defined."
    else:
        head = (
            "No: no GDRO variant shows a relative pass@8 gain over GRPO whose 95% bootstrap "
            "interval excludes zero."
        )
    if neg:
        head += " Significantly worse than GRPO: " + ", ".join(label(m) for m in neg) + "."
    s = results["setup"]
    cpath, carg = split_config_arg(s["config_arg"])
    where = (
        f"tiny character-level transformer, arithmetic `{carg}`"
        if cpath == DEFAULT_CONFIG
        else f"`{cpath}` `{carg}`"
    )
    return (
        f"**{head}**\n\nPaper: {PAPER}. Here ({where}, {s['steps']} RL steps, {len(s['seeds'])} paired seeds, lr chosen "
        "per method on the validation half, test half reported): "
        + "; ".join(parts)
        + ". This is a small CPU-scale proxy of the paper's setting (model scale, task and "
        "training length differ), so it tests whether the mechanism helps at this scale rather "
        "than the paper's numbers."
    )


# ----------------------------------------------------------------------------- report


def _pm(x):
    m, s = x
    return f"{100 * m:.1f} ± {100 * s:.1f}"


def write_report(results: dict, out_dir: str, figs: dict, command: str) -> str:
    n_samples = results["k"]
    k = results.get("pass_k", n_samples)
    tab, gains, s = results["tables"], results["gains"], results["setup"]
    methods = list(results["runs"])
    rel = lambda p: os.path.relpath(p, out_dir)
    cpath, carg = split_config_arg(s["config_arg"])
    task = f"{cpath}:<algo>" + (f",{carg}" if carg else "")
    L = [f"# GDRO vs GRPO at equal compute (`{task}`)\n"]
    L.append(f"Regenerate: `{command}`\n")
    L.append(
        f"Generated {results['date']} by `experiments/compare.py`; total wall time "
        f"**{results['wall_seconds'] / 60:.1f} min** on {results['cpus']} CPU core(s), "
        f"{results['workers']} worker process(es).\n"
    )
    L.append("## Setup\n")
    L.append(
        f"- Task: `{task}`; GDRO controllers: "
        + (
            "the **paper's** setting (`--paper_gdro`, failure-rate signal)."
            if s["paper_gdro"]
            else "the **corrected** defaults (`docs/gdro.md`)."
        )
    )
    L.append(
        f"- Paired seeds: {s['seeds']}. Every method of a seed starts RL from the same supervised "
        + (
            f"warm start ({s['sft_steps']} SFT steps on the separate warm-start pool of "
            f"{s['num_sft']} problems, disjoint from the RL pool and the held-out set)"
            if s.get("num_sft")
            else f"warm start ({s['sft_steps']} SFT steps on the config's {s['num_train']} "
            "training problems)"
            if s["sft_steps"]
            else "starting point (no warm start: sft.steps = 0)"
        )
        + " and is evaluated with the same sampling keys."
    )
    L.append(
        f"- Held-out split ({s['num_eval']} problems): even index in the held-out list -> "
        f"validation ({s['num_val']}), odd -> test ({s['num_test']}); the list is shuffled over "
        "levels. The lr is chosen on validation only; every number below is on the **test** half."
    )
    L.append(
        f"- Learning-rate sweep: {', '.join(f'{x:g}' for x in s['lrs'])} per method on seeds "
        f"{s['sweep_seeds']} ({s['sweep_mode']}); choice = highest mean validation "
        f"{s['select_metric'].replace('_at_k', '@')}{k} over those seeds and the last "
        f"{s['last_evals']} evaluations. Final runs: every seed at the chosen lr"
        + (" (the sweep runs of the sweep seeds at that lr are reused)." if s["reuse"] else ".")
    )
    L.append(
        f"- RL: {s['steps']} steps x {s['prompts_per_step']} prompts x {s['rollouts_per_prompt']} "
        f"rollouts (mean) = {s['rollouts_per_step']} rollouts per step for every method "
        "(Rollout-GDRO redistributes the same R). RL prompt pool: the first "
        f"{s['rl_prompts']} training problems ({s['visits_per_prompt']:.1f} visits per prompt on "
        "average; the online classifier bins a prompt by its past visits, so it needs repeats)."
    )
    L.append(
        f"- Evaluation: after steps {s['eval_steps']}, {n_samples} samples per held-out problem "
        "(temperature 0.6, top-p 0.8, top-k 20); a run's score is the mean of its last "
        f"{s['last_evals']} evaluations (steps {s['eval_steps'][-s['last_evals'] :]}). "
        f"pass@{k} = the unbiased estimate (Chen et al. 2021) from the {n_samples} samples of the "
        f"chance that one of {k} samples is correct; mean@{k} = mean accuracy of the samples.\n"
    )
    L.append("## Learning-rate sweep (validation half, sweep seeds)\n")
    lrs = s["lrs"]
    L.append("| method | " + " | ".join(f"lr {x:g}" for x in lrs) + " | chosen |")
    L.append("|---|" + "---|" * (len(lrs) + 1))
    for m in methods:
        sw = results["sweep"][m]
        cells = [
            (lambda v, x: f"**{v}**" if x == sw["chosen"] else v)(
                f"{100 * sw['scores'][f'{x:.3g}']:.1f}", x
            )
            for x in lrs
        ]
        L.append(f"| {label(m)} | " + " | ".join(cells) + f" | {sw['chosen']:g} |")
    L.append(f"\n![lr sweep]({rel(figs['lr_sweep'])})\n")
    L.append(f"## Headline: test pass@{k} and mean@{k} (%, mean ± std over seeds)\n")
    L.append(
        f"| method | lr | pass@{k} | mean@{k} | relative pass@{k} gain vs GRPO (95% CI) | "
        f"relative mean@{k} gain (95% CI) | d_z pass@{k} (95% CI) | d_z mean@{k} (95% CI) |"
    )
    L.append("|---|---|---|---|---|---|---|---|")
    for m in ["before"] + methods:
        g = gains.get(m)
        lr = "—" if m == "before" else f"{results['sweep'][m]['chosen']:g}"
        name = "before RL (SFT warm start)" if m == "before" else label(m)
        cells = (
            ["—"] * 4
            if g is None
            else [
                _ci(g["pass_at_k"]),
                _ci(g["mean_at_k"]),
                _ci(g["pass_at_k"], "d_z", "", "+.2f"),
                _ci(g["mean_at_k"], "d_z", "", "+.2f"),
            ]
        )
        L.append(
            f"| {name} | {lr} | {_pm(tab[m]['overall']['pass_at_k'])} | "
            f"{_pm(tab[m]['overall']['mean_at_k'])} | " + " | ".join(cells) + " |"
        )
    L.append("")
    L.append(
        f"Paired bootstrap ({results['n_boot']} replicates) over seeds and test problems: each "
        "replicate resamples the seeds and, independently, the test problems with replacement, "
        "applies the same draw to the method and to GRPO and recomputes mean(method) / "
        "mean(GRPO) - 1; intervals are 2.5-97.5% percentiles. d_z = mean / std of the per-seed "
        "differences (paired effect size; |d_z| ~ 0.2 small, 0.5 medium, 0.8 large), its "
        "interval from the same replicates. Absolute differences (percentage points): "
        + "; ".join(
            f"{label(m)} pass@{k} {_ci(g['pass_at_k'], 'diff', 'pp')} / mean@{k} "
            f"{_ci(g['mean_at_k'], 'diff', 'pp')}"
            for m, g in gains.items()
        )
        + ".\n"
    )
    L.append(f"![test pass@8 per level]({rel(figs['pass_at_8'])})\n")
    L.append(f"![evaluation curves]({rel(figs['eval_curves'])})\n")
    L.append("## Equal compute (per run, mean over seeds)\n")
    L.append("| method | RL steps | rollouts | generated completion tokens | optimizer updates |")
    L.append("|---|---|---|---|---|")
    for m in methods:
        c = results["compute"][m]
        L.append(
            f"| {label(m)} | {c['steps']:.0f} | {c['rollouts']:.0f} | "
            f"{c['generated_tokens']:.0f} | {c['updates']:.0f} |"
        )
    L.append("")
    L.append("## Per difficulty level (test half)\n")
    levels = [g for g in tab["before"] if g != "overall"]
    for metric, title in [("pass_at_k", f"pass@{k}"), ("mean_at_k", f"mean@{k}")]:
        L.append(f"**{title}** (%, mean ± std over seeds)\n")
        L.append("| method | " + " | ".join(f"level {l}" for l in levels) + " |")
        L.append("|---|" + "---|" * len(levels))
        for m in ["before"] + methods:
            name = "before RL" if m == "before" else label(m)
            L.append(f"| {name} | " + " | ".join(_pm(tab[m][l][metric]) for l in levels) + " |")
        L.append("")
    gl = results["gains_by_level"]
    L.append(f"**Relative pass@{k} gain vs GRPO per level** (%, paired bootstrap 95% CI)\n")
    L.append("| method | " + " | ".join(f"level {l}" for l in levels) + " |")
    L.append("|---|" + "---|" * len(levels))
    for m in gl:
        cells = [
            "— (GRPO 0)" if gl[m].get(l) is None else _ci(gl[m][l], spec="+.0f") for l in levels
        ]
        L.append(f"| {label(m)} | " + " | ".join(cells) + " |")
    L.append("")
    L.append("## Curriculum and allocation\n")
    L.append(
        "Step x bin heatmaps of the final runs, mean over seeds (bin 0 = hardest; "
        + (
            "never-seen prompts are in bin 0, the paper's classifier).\n"
            if s["paper_gdro"]
            else "never-seen prompts are outside the bins, the corrected classifier).\n"
        )
    )
    for name in ["heatmap_data_share", "heatmap_prompt_gdro_q", "heatmap_rollouts_per_prompt"]:
        if name in figs:
            L.append(f"![{name}]({rel(figs[name])})\n")
    L.append(results["curriculum_text"] + "\n")
    L.append("## Variance diagnostics\n")
    L.append(results["oracle_text"] + "\n")
    L.append(results["diagnostics_text"] + "\n")
    L.append(
        "True WSE = sum_b qhat_b sigma_b / sqrt(n_b) over the step's prompts (qhat_b = prompt "
        "share of bin b, unseen prompts a group of their own, sigma_b^2 = mean of p_i (1 - p_i) "
        "over the bin's prompts, n_b = rollouts per prompt), mean over steps and seeds; '/ "
        "uniform' = the same batches with n_bar rollouts per prompt (1 for methods that do not "
        "reallocate). 'true-p strata': the oracle pre-check's definition (`experiments.oracle."
        "true_wse`): the bins are those of the true p_i (the classifier's edges), sigma_b = mean "
        "of sqrt(p_i (1 - p_i)), n_b = the bin's mean rollouts per prompt; it does not depend on "
        "the controller's own (noisy, few-visit) bins. Expected informative groups = "
        "sum_i 1 - p_i^n_i - (1 - p_i)^n_i. The proxy "
        "is the allocator's own `rollout_gdro/wse` (circular, spec s.7). Weight ESS = Kish "
        "effective sample size fraction of the advantage weights over informative rollouts.\n"
    )
    L.append(f"![true WSE]({rel(figs['wse_true'])})\n")
    L.append(f"![training curves]({rel(figs['train_curves'])})\n")
    L.append("## Does this support the paper?\n")
    L.append(results["verdict"] + "\n")
    notes = os.path.join(out_dir, REPORT_NAME, "notes.md")
    if os.path.exists(notes):
        with open(notes) as f:
            L.append("## Observations (written by hand after the run; `" + rel(notes) + "`)\n")
            L.append(f.read().strip() + "\n")
    t = results["timing"]
    L.append("## Timing\n")
    L.append("| job | count | seconds per job (mean) |")
    L.append("|---|---|---|")
    L.append(f"| SFT warm start + before-eval | {t['n_warm']} | {t['warm_start']:.0f} |")
    for m in methods:
        L.append(f"| {m} (RL + evaluations) | {t['n_jobs'][m]} | {t['rl'][m]:.0f} |")
    L.append(
        f"\nTotal wall time: {results['wall_seconds']:.0f} s "
        f"({results['wall_seconds'] / 60:.1f} min); estimated before the run: "
        + (
            f"{results['estimate_seconds'] / 60:.1f} min."
            if results.get("estimate_seconds")
            else "—."
        )
        + "\n"
    )
    text = "\n".join(L)
    path = os.path.join(out_dir, f"{REPORT_NAME}.md")
    with open(path, "w") as f:
        f.write(text)
    return path


# ----------------------------------------------------------------------------- driver

_ARRAYS = ("correct", "levels", "eval_steps", "ids", "bins", "n", "oracle_p")


def _save_job(runs_dir: str, r: dict) -> None:
    """Per-job results next to the metrics rows, so the report can be rebuilt (``--report_only``)."""
    from grpo_jax import writers

    name = job_name(r.get("method"), r.get("lr"), r["seed"])
    np.savez_compressed(
        os.path.join(runs_dir, f"{name}.npz"), **{k: np.asarray(r[k]) for k in _ARRAYS if k in r}
    )
    meta = {k: v for k, v in r.items() if k not in ("params", "rows") + _ARRAYS}
    with open(os.path.join(runs_dir, f"{name}.json"), "w") as f:
        json.dump(writers.to_jsonable(meta), f, indent=1, sort_keys=True)


def _load_job(runs_dir: str, method: str | None, lr: float | None, seed: int) -> dict:
    from grpo_jax import writers

    name = job_name(method, lr, seed)
    with open(os.path.join(runs_dir, f"{name}.json")) as f:
        r = json.load(f)
    with np.load(os.path.join(runs_dir, f"{name}.npz")) as z:
        r.update({k: z[k] for k in z.files})
    if method:
        path = os.path.join(runs_dir, f"{name}.jsonl")
        if os.path.exists(path):
            r["rows"] = writers.read_jsonl(path)
        else:  # a committed run: the rows gzipped (`gzip runs/*.jsonl`)
            import gzip

            with gzip.open(path + ".gz", "rt") as f:
                r["rows"] = [json.loads(line) for line in f if line.strip()]
    return r


def _parse_seeds(spec, default_count: int = 10) -> list[int]:
    """``10`` -> seeds 0..9; ``"3,5"`` or ``"5,"`` -> those seeds; a sequence -> as given."""
    if spec is None:
        return list(range(default_count))
    if isinstance(spec, int):
        return list(range(spec))
    if isinstance(spec, str):
        parts = [p for p in spec.split(",") if p.strip()]
        if "," not in spec:
            return list(range(int(spec)))
        return [int(p) for p in parts]
    return [int(s) for s in spec]


def plan_jobs(
    seeds: Sequence[int], sweep_seeds, methods: Sequence[str], lrs: Sequence[float]
) -> dict:
    """The sweep and final seeds and the job counts.

    ``sweep_seeds``: an int N = the first N of ``seeds`` (prefix; their sweep runs at the chosen
    lr are reused as final runs), or explicit seeds (those also in ``seeds`` are reused).

    Returns: {"seeds", "sweep_seeds", "mode", "n_sweep", "n_final", "n_warm", "warm_seeds"}.
    """
    seeds = [int(s) for s in seeds]
    if isinstance(sweep_seeds, int):
        if not 1 <= sweep_seeds <= len(seeds):
            raise ValueError(f"sweep_seeds={sweep_seeds} must be in 1..{len(seeds)}")
        sw, mode = seeds[:sweep_seeds], "the first seeds of the final ones (prefix)"
    else:
        sw = [int(s) for s in sweep_seeds]
        if not sw:
            raise ValueError("sweep_seeds must not be empty")
        inter = set(sw) & set(seeds)
        mode = (
            "disjoint from the final seeds"
            if not inter
            else f"{len(inter)} of them also final seeds"
        )
    extra = [s for s in seeds if s not in sw]
    warm = list(dict.fromkeys(list(sw) + seeds))
    return {
        "seeds": seeds,
        "sweep_seeds": sw,
        "final_only_seeds": extra,
        "mode": mode,
        "n_sweep": len(methods) * len(lrs) * len(sw),
        "n_final": len(methods) * len(extra),
        "n_warm": len(warm),
        "warm_seeds": warm,
    }


def run_comparison(
    out_dir: str,
    *,
    seeds: Sequence[int] | int = 10,
    sweep_seeds: Sequence[int] | int = 3,
    lrs: Sequence[float] = DEFAULT_LRS,
    methods: Sequence[str] = tuple(METHODS),
    config_arg: str = "heavy_tailed",
    paper_gdro: bool = False,
    steps: int = 80,
    prompts_per_step: int = 0,
    rl_prompts: int = 512,
    eval_every: int = 20,
    last_evals: int = 3,
    select_metric: str = "pass_at_k",
    oracle_json: str = "",
    oracle_samples: int = 16,
    workers: int = 1,
    n_boot: int = 2000,
    jax_cache: str = "",
    budget_minutes: float = 90.0,
    command: str = "",
    report_only: bool = False,
) -> dict:
    """Sweep -> lr selection on validation -> final seeds -> report on test (module docstring).

    Writes ``gdro_vs_grpo.md``, ``gdro_vs_grpo.json`` and ``gdro_vs_grpo/`` into ``out_dir``;
    returns the results dict (``runs``: the final jobs, method -> seed -> job).

    Raises:
      ValueError: no GRPO baseline, unknown method or metric, bad seeds / lrs / last_evals.
    """
    wall0 = time.perf_counter()
    methods = list(methods)
    if "grpo" not in methods:
        raise ValueError("methods must include 'grpo' (the baseline of the relative gain)")
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"method {m!r}: choose from {list(METHODS)}")
    if select_metric not in METRICS:
        raise ValueError(f"select_metric {select_metric!r}: choose from {METRICS}")
    lrs = [float(x) for x in lrs]
    if not lrs or len({f"{x:.3g}" for x in lrs}) != len(lrs):
        raise ValueError(f"lrs must be non-empty and distinct (to 3 digits); got {lrs}")
    seeds = _parse_seeds(seeds)
    if not seeds:
        raise ValueError("seeds must not be empty")
    plan = plan_jobs(seeds, sweep_seeds, methods, lrs)
    cfg0 = method_config(
        "grpo",
        seeds[0],
        config_arg=config_arg,
        steps=steps,
        rl_prompts=rl_prompts,
        paper_gdro=paper_gdro,
        prompts_per_step=prompts_per_step,
    )
    when = eval_steps(cfg0.steps, eval_every)
    if not 1 <= last_evals <= len(when):
        raise ValueError(f"last_evals={last_evals} must be in 1..{len(when)} (evals at {when})")
    if oracle_json and rl_prompts:  # fail now, not after the runs
        load_oracle(oracle_json, rl_prompts)
    fig_dir = os.path.join(out_dir, REPORT_NAME)
    runs_dir = os.path.join(fig_dir, "runs")
    os.makedirs(runs_dir, exist_ok=True)
    k = int(cfg0.eval.num_samples)
    n_rl = plan["n_sweep"] + plan["n_final"]

    def log(msg):
        print(f"[compare {time.perf_counter() - wall0:7.1f}s] {msg}", flush=True)

    log(
        f"{len(methods)} methods x {len(lrs)} lrs x {len(plan['sweep_seeds'])} sweep seeds "
        f"= {plan['n_sweep']} sweep jobs, + {plan['n_final']} final jobs, "
        f"{plan['n_warm']} warm starts, {workers} worker(s)"
    )
    job_kw = dict(
        config_arg=config_arg,
        steps=steps,
        rl_prompts=rl_prompts,
        paper_gdro=paper_gdro,
        prompts_per_step=prompts_per_step,
        eval_every=eval_every,
        runs_dir=runs_dir,
    )
    want_oracle = 0 if oracle_json else int(oracle_samples)
    estimate = None
    if report_only:
        warm = {s: _load_job(runs_dir, None, None, s) for s in plan["warm_seeds"]}
        sweep = {
            m: {lr: {s: _load_job(runs_dir, m, lr, s) for s in plan["sweep_seeds"]} for lr in lrs}
            for m in methods
        }
        with open(os.path.join(runs_dir, "wall.json")) as f:
            wall = json.load(f)
        wall_prev, estimate = wall["wall_seconds"], wall.get("estimate_seconds")
    else:
        wall_prev = None
        if workers > 1:
            import multiprocessing as mp

            pool = mp.get_context("spawn").Pool(
                workers, initializer=_worker_init, initargs=(jax_cache,)
            )
            imap = lambda jobs: pool.imap_unordered(_call, jobs)
        else:
            enable_compilation_cache(jax_cache)
            pool = None
            imap = lambda jobs: map(_call, jobs)
        done = {"rl": 0}

        def note_rl(r):
            nonlocal estimate
            done["rl"] += 1
            _save_job(runs_dir, r)
            log(
                f"[{done['rl']}/{n_rl}] {r['method']} lr {r['lr']:g} seed {r['seed']}: "
                f"{r['seconds']:.0f}s, last eval pass@{k} {r['eval'][f'pass_at_{k}']:.3f}"
            )
            if estimate is None:
                elapsed = time.perf_counter() - wall0
                estimate = elapsed + estimate_wall(0, r["seconds"], 0, n_rl - 1, workers)
                log(
                    f"ESTIMATE: total wall ~{estimate / 60:.0f} min (elapsed {elapsed / 60:.1f} "
                    f"min + {n_rl - 1} RL jobs x {r['seconds']:.0f}s / {workers} workers; the "
                    "first job includes compiles)"
                )
                if estimate > 60 * budget_minutes:
                    log(
                        f"WARNING: the estimate exceeds the {budget_minutes:.0f}-min budget "
                        "(fewer --steps, --seeds or --lrs, or more --workers)"
                    )

        try:
            warm = {}
            warm_jobs = [
                (warm_start_job, (s, config_arg, paper_gdro, want_oracle, rl_prompts), {})
                for s in plan["warm_seeds"]
            ]
            for r in imap(warm_jobs):
                warm[r["seed"]] = r
                _save_job(runs_dir, r)
                log(
                    f"seed {r['seed']}: warm start {r['seconds']:.0f}s, before pass@{k} "
                    f"{r['eval'][f'pass_at_{k}']:.3f}"
                )
            sweep = {m: {lr: {} for lr in lrs} for m in methods}
            jobs = [
                (rl_job, (m, s, warm[s]["params"]), dict(lr=lr, **job_kw))
                for s in plan["sweep_seeds"]
                for lr in lrs
                for m in methods
            ]
            for r in imap(jobs):
                sweep[r["method"]][r["lr"]][r["seed"]] = r
                note_rl(r)
            chosen = _choose(sweep, warm, plan, select_metric, last_evals)
            for m in methods:
                log(f"{m}: chosen lr {chosen[m][0]:g} (validation {chosen[m][1]})")
            finals = {m: {} for m in methods}
            jobs = [
                (rl_job, (m, s, warm[s]["params"]), dict(lr=chosen[m][0], **job_kw))
                for s in plan["final_only_seeds"]
                for m in methods
            ]
            for r in imap(jobs):
                finals[r["method"]][r["seed"]] = r
                note_rl(r)
        finally:
            if pool is not None:
                pool.close()
                pool.join()
        with open(os.path.join(runs_dir, "wall.json"), "w") as f:
            json.dump(
                {
                    "wall_seconds": time.perf_counter() - wall0,
                    "workers": workers,
                    "estimate_seconds": estimate,
                },
                f,
            )
    chosen = _choose(sweep, warm, plan, select_metric, last_evals)
    runs: dict[str, dict[int, dict]] = {}
    for m in methods:
        lr = chosen[m][0]
        runs[m] = {}
        for s in seeds:
            if s in plan["sweep_seeds"]:
                runs[m][s] = sweep[m][lr][s]
            elif report_only:
                runs[m][s] = _load_job(runs_dir, m, lr, s)
            else:
                runs[m][s] = finals[m][s]

    # ---- the true success rates of the RL pool
    pool_problems = next(
        (
            runs[m][s].get("pool_problems")
            for m in methods
            for s in seeds
            if runs[m][s].get("pool_problems")
        ),
        None,
    )
    num_prompts = int(runs["grpo"][seeds[0]]["num_prompt_ids"])
    if oracle_json:
        p_global = load_oracle(oracle_json, num_prompts, pool_problems)
        p_for_seed = lambda s: p_global
        oracle_text = (
            f"True success rates p_i: `{oracle_json}` ({int(np.isfinite(p_global).sum())} of "
            f"{num_prompts} RL prompts), fixed over training."
        )
    elif want_oracle:
        mismatch = [
            s
            for s in seeds
            if pool_problems
            and list(warm[s].get("oracle_problems", []))
            != list(pool_problems)[: len(warm[s].get("oracle_problems", []))]
        ]
        p_for_seed = lambda s: None if s in mismatch else np.asarray(warm[s]["oracle_p"], float)
        oracle_text = (
            f"True success rates p_i: estimated here, {want_oracle} samples per RL prompt at the "
            "training sampling settings from each seed's warm-start model (not from the "
            "rollouts the allocator sees); they are the warm start's rates, fixed over training, "
            f"and each carries binomial noise (sd <= {0.5 / math.sqrt(want_oracle):.2f}). Pass "
            "`--oracle_json` (experiments/oracle.py) for better estimates."
        ) + (
            f" Seeds {mismatch}: the estimated prompts differ from the RL pool, left out."
            if mismatch
            else ""
        )
    else:
        p_for_seed = lambda s: None
        oracle_text = (
            "True success rates p_i: not available (`--oracle_samples=0` and no "
            "`--oracle_json`), so the true-WSE and expected-informative columns are empty."
        )

    # ---- test-half statistics
    levels_all = np.asarray(warm[seeds[0]]["levels"])
    val_idx, test_idx = split_heldout(len(levels_all))
    levels = levels_all[test_idx]
    correct_test = {
        m: np.stack([np.asarray(runs[m][s]["correct"])[:, test_idx] for s in seeds])
        for m in methods
    }
    before = np.stack([np.asarray(warm[s]["correct"])[test_idx] for s in seeds])
    scores = {
        m: {mt: per_problem_scores(c, mt, last_evals) for mt in METRICS}
        for m, c in correct_test.items()
    }
    scores["before"] = {mt: per_problem_scores(before, mt) for mt in METRICS}
    tables = {m: _metric_table(sc, levels) for m, sc in scores.items()}
    gains, gains_by_level = {}, {}
    for m in methods:
        if m == "grpo":
            continue
        gains[m] = {
            mt: _safe_bootstrap(scores[m][mt], scores["grpo"][mt], n_boot=n_boot) for mt in METRICS
        }
        gains_by_level[m] = {}
        for l in np.unique(levels):
            sel = levels == l
            try:
                gains_by_level[m][str(int(l))] = paired_bootstrap(
                    scores[m]["pass_at_k"][:, sel],
                    scores["grpo"]["pass_at_k"][:, sel],
                    n_boot=min(n_boot, 500),
                )
            except ValueError:
                gains_by_level[m][str(int(l))] = None
    eval_curves = {"before": {mt: float(per_problem_scores(before, mt).mean()) for mt in METRICS}}
    for m in methods:
        c = correct_test[m]  # [S, T, N, k]
        eval_curves[m] = {
            "steps": [int(x) for x in runs[m][seeds[0]]["eval_steps"]],
            **{
                mt: [float(per_problem_scores(c[:, t], mt).mean()) for t in range(c.shape[1])]
                for mt in METRICS
            },
        }
    n_steps = cfg0.steps
    results = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpus": os.cpu_count(),
        "workers": workers,
        "k": k,
        "pass_k": min(PASS_K, k),
        "n_boot": n_boot,
        "setup": {
            "config_arg": config_arg,
            "paper_gdro": bool(paper_gdro),
            "seeds": seeds,
            "sweep_seeds": plan["sweep_seeds"],
            "sweep_mode": plan["mode"],
            "reuse": any(s in seeds for s in plan["sweep_seeds"]),
            "lrs": lrs,
            "select_metric": select_metric,
            "last_evals": last_evals,
            "eval_steps": when,
            "steps": n_steps,
            "prompts_per_step": cfg0.rollout.prompts_per_step,
            "rollouts_per_prompt": cfg0.rollout.rollouts_per_prompt,
            "rollouts_per_step": cfg0.rollout.prompts_per_step * cfg0.rollout.rollouts_per_prompt,
            "rl_prompts": num_prompts,
            "num_train": cfg0.data.arithmetic.num_train,
            "num_sft": int(cfg0.data.arithmetic.get("num_sft", 0) or 0),
            "num_eval": int(len(levels_all)),
            "num_val": int(len(val_idx)),
            "num_test": int(len(test_idx)),
            "split": "even held-out index -> validation, odd -> test",
            "sft_steps": cfg0.sft.steps,
            "visits_per_prompt": n_steps * cfg0.rollout.prompts_per_step / num_prompts,
            "oracle_json": oracle_json,
            "oracle_samples": want_oracle,
            "python": platform.python_version(),
        },
        "sweep": {
            m: {
                "chosen": chosen[m][0],
                "scores": {f"{lr:.3g}": v for lr, v in chosen[m][2].items()},
            }
            for m in methods
        },
        "runs": runs,
        "tables": tables,
        "gains": gains,
        "gains_by_level": gains_by_level,
        "eval_curves": eval_curves,
        "compute": {
            m: {
                key: float(np.mean([runs[m][s][key] for s in seeds]))
                for key in ("rollouts", "generated_tokens", "updates")
            }
            | {"steps": float(np.mean([len(runs[m][s]["rows"]) for s in seeds]))}
            for m in methods
        },
        "timing": {
            "n_warm": plan["n_warm"],
            "warm_start": float(np.mean([w["seconds"] for w in warm.values()])),
            "n_jobs": {
                m: len(lrs) * len(plan["sweep_seeds"]) + len(plan["final_only_seeds"])
                for m in methods
            },
            "rl": {
                m: float(
                    np.mean(
                        [j["seconds"] for lr in lrs for j in sweep[m][lr].values()]
                        + [runs[m][s]["seconds"] for s in plan["final_only_seeds"]]
                    )
                )
                for m in methods
            },
        },
        "estimate_seconds": estimate,
        "oracle_text": oracle_text,
    }
    with warnings.catch_warnings():  # nanmean of all-NaN diagnostics (e.g. no informative rollout)
        warnings.simplefilter("ignore", RuntimeWarning)
        results["diagnostics"] = _diagnostics(runs, p_for_seed)
        results["curriculum_text"] = _curriculum_text(runs)
        results["diagnostics_text"] = _diagnostics_table(results)
        results["verdict"] = _verdict(results)
        figs = make_figures(results, fig_dir)
    results["wall_seconds"] = wall_prev if wall_prev is not None else time.perf_counter() - wall0
    results["figures"] = {n: os.path.relpath(p, out_dir) for n, p in figs.items()}
    report_path = write_report(results, out_dir, figs, command or "python -m experiments.compare")
    slim = {k_: v for k_, v in results.items() if k_ != "runs"}
    slim["diagnostics"] = {
        m: {k_: v for k_, v in d.items() if k_ != "series"}
        for m, d in results["diagnostics"].items()
    }
    slim["per_run"] = {
        m: {
            str(s): {
                "lr": runs[m][s]["lr"],
                "eval_summaries": runs[m][s]["eval_summaries"],
                "seconds": runs[m][s]["seconds"],
            }
            for s in seeds
        }
        for m in methods
    }
    slim["before"] = {str(s): {"eval": warm[s]["eval"], "sft": warm[s]["sft"]} for s in seeds}
    from grpo_jax import writers

    with open(os.path.join(out_dir, f"{REPORT_NAME}.json"), "w") as f:
        json.dump(writers.to_jsonable(slim), f, indent=1, sort_keys=True)
    log(
        f"wrote {report_path}; TOTAL wall {results['wall_seconds'] / 60:.1f} min"
        + (f" (estimated {estimate / 60:.1f} min)" if estimate else "")
    )
    return results


def _choose(sweep, warm, plan, metric, last) -> dict:
    """method -> (chosen lr, rounded validation score, {lr: validation score}); reads only the
    validation half (``split_heldout``) of the sweep runs."""
    num = len(np.asarray(warm[plan["warm_seeds"][0]]["levels"]))
    val_idx, _ = split_heldout(num)
    out = {}
    for m, by_lr in sweep.items():
        arrays = {
            lr: np.stack([np.asarray(by_lr[lr][s]["correct"]) for s in plan["sweep_seeds"]])
            for lr in by_lr
        }
        lr, sc = select_lr(arrays, val_idx, metric=metric, last=last)
        out[m] = (lr, f"{sc[lr]:.3f}", sc)
    return out


def estimate_only(
    *,
    seeds,
    sweep_seeds,
    lrs,
    methods,
    workers: int,
    jax_cache: str = "",
    **job_kw,
) -> float:
    """Times one warm start and one GRPO RL job (first lr) in this process and returns the
    extrapolated wall seconds of the whole comparison (``estimate_wall``)."""
    enable_compilation_cache(jax_cache)
    seeds = _parse_seeds(seeds)
    plan = plan_jobs(seeds, sweep_seeds, methods, lrs)
    w = warm_start_job(
        seeds[0],
        job_kw["config_arg"],
        job_kw["paper_gdro"],
        job_kw.pop("oracle_samples"),
        job_kw["rl_prompts"],
    )
    r = rl_job("grpo", seeds[0], w["params"], lr=float(lrs[0]), **job_kw)
    n_rl = plan["n_sweep"] + plan["n_final"]
    est = estimate_wall(w["seconds"], r["seconds"], plan["n_warm"], n_rl, workers)
    print(
        f"ESTIMATE: {est / 60:.1f} min = ceil({plan['n_warm']} warm starts / {workers}) x "
        f"{w['seconds']:.0f}s + ceil({n_rl} RL jobs / {workers}) x {r['seconds']:.0f}s "
        f"(one job each, timed alone in this process)",
        flush=True,
    )
    return est


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="reports", help="output directory")
    ap.add_argument(
        "--seeds", default="10", help="final paired seeds: N (= 0..N-1) or a list '3,5' / '5,'"
    )
    ap.add_argument(
        "--sweep_seeds",
        default="3",
        help="lr-sweep seeds: N = the first N final seeds (prefix), or an explicit list",
    )
    ap.add_argument("--lrs", default=",".join(f"{x:g}" for x in DEFAULT_LRS), help="lr sweep")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument(
        "--config", default=DEFAULT_CONFIG, help="config file; get_config('<algo>,<config_arg>')"
    )
    ap.add_argument("--config_arg", default="heavy_tailed", help="config argument after algo")
    ap.add_argument("--paper_gdro", action="store_true", help="the paper's GDRO controllers")
    ap.add_argument("--steps", type=int, default=80, help="RL steps (0 = the config's)")
    ap.add_argument("--prompts_per_step", type=int, default=0, help="P (0 = the config's)")
    ap.add_argument("--rl_prompts", type=int, default=512, help="RL pool: the first N problems")
    ap.add_argument("--eval_every", type=int, default=20, help="evaluate every N RL steps")
    ap.add_argument("--last_evals", type=int, default=3, help="score = mean of the last N evals")
    ap.add_argument("--select_metric", default="pass_at_k", choices=METRICS)
    ap.add_argument("--oracle_json", default="", help='{"p": {"<prompt id>": p}} (docstring)')
    ap.add_argument(
        "--oracle_samples",
        type=int,
        default=16,
        help="without --oracle_json: samples per RL prompt to estimate p (0 = skip)",
    )
    ap.add_argument("--workers", type=int, default=2, help="processes")
    ap.add_argument("--n_boot", type=int, default=2000, help="bootstrap replicates")
    ap.add_argument("--budget_minutes", type=float, default=90.0, help="warn above this")
    ap.add_argument(
        "--jax_cache",
        default="/tmp/grpo_jax_compare_cache",
        help="JAX persistent compilation cache directory ('' = off)",
    )
    ap.add_argument("--estimate_only", action="store_true", help="time one job, print, exit")
    ap.add_argument(
        "--report_only",
        action="store_true",
        help="rebuild the report from the per-job files of an earlier run in --out",
    )
    args = ap.parse_args(argv)
    sweep = args.sweep_seeds
    sweep_seeds = _parse_seeds(sweep) if "," in sweep else int(sweep)
    lrs = [float(x) for x in args.lrs.split(",") if x.strip()]
    methods = [m for m in args.methods.split(",") if m.strip()]
    given = sys.argv[1:] if argv is None else list(argv)
    skip = ("--report_only", "--estimate_only")
    command = "python -m experiments.compare " + " ".join(a for a in given if a not in skip)
    config_arg = args.config_arg
    if args.config != DEFAULT_CONFIG:
        config_arg = f"{args.config}:{config_arg}"
    job_kw = dict(
        config_arg=config_arg,
        steps=args.steps,
        rl_prompts=args.rl_prompts,
        paper_gdro=args.paper_gdro,
        prompts_per_step=args.prompts_per_step,
        eval_every=args.eval_every,
    )
    if args.estimate_only:
        estimate_only(
            seeds=args.seeds,
            sweep_seeds=sweep_seeds,
            lrs=lrs,
            methods=methods,
            workers=args.workers,
            jax_cache=args.jax_cache,
            oracle_samples=0 if args.oracle_json else args.oracle_samples,
            **job_kw,
        )
        return
    job_kw.pop("eval_every")
    run_comparison(
        args.out,
        seeds=args.seeds,
        sweep_seeds=sweep_seeds,
        lrs=lrs,
        methods=methods,
        eval_every=args.eval_every,
        last_evals=args.last_evals,
        select_metric=args.select_metric,
        oracle_json=args.oracle_json,
        oracle_samples=args.oracle_samples,
        workers=args.workers,
        n_boot=args.n_boot,
        jax_cache=args.jax_cache,
        budget_minutes=args.budget_minutes,
        command=command.strip(),
        report_only=args.report_only,
        **job_kw,
    )


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
