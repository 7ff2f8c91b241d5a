"""The jobs of a comparison (warm starts, RL runs), their per-job files and the worker pool.

A job's files in ``<out>/gdro_vs_grpo/runs/``: ``<name>.json`` (metadata, its ``settings``),
``<name>.npz`` (per-problem evaluations, placements) and, for RL jobs, ``<name>.jsonl`` (or a
committed ``.jsonl.gz``: the metrics rows). Each is written atomically (temp file +
``os.replace``), the ``.json`` last, so a killed run leaves complete jobs or none.
"""

from __future__ import annotations

import gzip
import json
import os
import pickle
import time
from collections.abc import Callable, Iterable

import numpy as np

from experiments.compare.plan import METHODS, eval_steps, job_name, method_config

ARRAYS = (
    "correct",
    "levels",
    "eval_steps",
    "eval_tokens",
    "eval_rollouts",
    "ids",
    "bins",
    "n",
    "oracle_p",
)
# a token-budget run may take up to this many times the config's steps to spend its budget
MAX_STEP_FACTOR = 4
PARAMS_SUFFIX = "_params.pkl"  # a warm start's parameters (host numpy pytree; for resume)


class SettingsMismatch(ValueError):
    """A job file recorded other settings than the current command's."""


# ----------------------------------------------------------------------------- evaluation


def evaluate_per_problem(
    exp, params, rng, *, examples=None, reward_fn=None, sampling=None, k: int = 0
) -> tuple[dict, np.ndarray, np.ndarray]:
    """``evaluation.evaluate_policy`` keeping per-problem results (the same key split as
    ``evaluation.evaluate``). Default: the experiment's first held-out set with the evaluation
    protocol; ``examples`` / ``reward_fn`` / ``sampling`` / ``k`` override (e.g. the RL pool at
    the training sampling settings, for success-rate estimates).

    Returns:
      (summary dict of ``evaluate_policy``, correct ``[N, k]`` bool, levels ``[N]`` int).
    """
    import jax

    from grpo_jax import evaluation

    cfg = exp.run.eval
    k = int(k or cfg.num_samples)
    name, held_out = next(iter(exp.pool.eval_sets.items()))
    if examples is None:
        examples = held_out
    _, key = jax.random.split(rng)
    result = evaluation.evaluate_policy(
        exp.graphdef,
        params,
        examples,
        tokenizer=exp.tokenizer,
        reward_fn=reward_fn or exp.eval_reward_fns[name],
        sampling_config=sampling or exp.eval_sampling,
        render=exp.render,
        prompt_len=exp.prompt_len,
        k=k,
        batch_size=cfg.batch_size,
        rng=key,
        mesh=exp.mesh,
    )
    return result.summary, result.correct, result.levels


def eval_key(seed: int, step: int):
    """The evaluation key of (seed, step): the same for every method and lr (paired)."""
    import jax

    return jax.random.fold_in(jax.random.PRNGKey(int(seed) + 7), int(step))


# ----------------------------------------------------------------------------- jobs


def warm_settings(config_arg, paper_gdro, oracle_samples, rl_prompts) -> dict:
    """What a warm start's results depend on (recorded in its ``.json``, checked on resume)."""
    return {
        "config_arg": config_arg,
        "paper_gdro": bool(paper_gdro),
        "oracle_samples": int(oracle_samples),
        "rl_prompts": int(rl_prompts) if oracle_samples else 0,
    }


def rl_settings(
    method,
    lr,
    *,
    config_arg,
    steps,
    rl_prompts,
    paper_gdro,
    prompts_per_step,
    eval_every,
    token_budget=0,
) -> dict:
    """What an RL job's results depend on (recorded in its ``.json``, checked on resume)."""
    return {
        "token_budget": int(token_budget),
        "method": method,
        "algorithm": METHODS[method][0],
        "overrides": dict(METHODS[method][1]),
        "lr": float(lr),
        "config_arg": config_arg,
        "steps": int(steps),
        "rl_prompts": int(rl_prompts),
        "paper_gdro": bool(paper_gdro),
        "prompts_per_step": int(prompts_per_step),
        "eval_every": int(eval_every),
    }


def token_checkpoints(budget: int, num_evals: int) -> list[int]:
    """The cumulative generated-token counts after which a token-budget run is evaluated:
    ``round(budget * j / num_evals)`` for ``j = 1 .. num_evals`` (the last is the budget)."""
    if budget <= 0 or num_evals < 1:
        raise ValueError(
            f"token_checkpoints: budget {budget} and num_evals {num_evals} must be > 0"
        )
    return [int(round(budget * j / num_evals)) for j in range(1, num_evals + 1)]


class Budget:
    """When a run is evaluated and when it stops: after the scheduled steps ``when`` (step
    mode, ``token_budget = 0``), or (token mode) at the first step whose cumulative generated
    tokens reach each of `token_checkpoints`, stopping at the budget. Counts the run's
    generated tokens, rollouts and CPU seconds (``time.process_time``, evaluation excluded)."""

    def __init__(self, when: list[int], token_budget: int = 0, cap: int = 0):
        self.token_budget, self.cap = int(token_budget), int(cap)
        self.when = list(when)
        self.marks = token_checkpoints(self.token_budget, len(when)) if self.token_budget else []
        self.tokens = self.rollouts = 0
        self.cpu0, self.eval_cpu = time.process_time(), 0.0

    def add(self, row: dict) -> None:
        """Counts one step's metrics row (``generated_tokens``, ``generated_rollouts``)."""
        self.tokens += int(row["generated_tokens"])
        self.rollouts += int(row["generated_rollouts"])

    def evaluations_now(self, step: int) -> int:
        """How many evaluation records this step gets: 0 or 1 in step mode; in token mode one
        per token mark passed (each consumed), and at the step cap ``cap`` every mark left (the
        run could not spend its budget; the same evaluation fills them, so every run has
        ``len(when)`` records)."""
        if not self.token_budget:
            return int(step in self.when)
        due = 0
        while self.marks and (self.tokens >= self.marks[0] or step >= self.cap > 0):
            self.marks.pop(0)
            due += 1
        return due

    def done(self) -> bool:
        """Whether a token-budget run has spent its budget (never in step mode)."""
        return bool(self.token_budget) and self.tokens >= self.token_budget

    def cpu_seconds(self) -> float:
        """CPU seconds of the run so far, evaluation excluded."""
        return time.process_time() - self.cpu0 - self.eval_cpu


def warm_start_job(
    seed: int,
    config_arg: str,
    paper_gdro: bool = False,
    oracle_samples: int = 0,
    rl_prompts: int = 0,
) -> dict:
    """SFT warm start (on the config's training or SFT pool) + "before" evaluation of one seed;
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
        summary, correct, levels = evaluate_per_problem(exp, params, eval_key(seed, 0))
        if oracle_samples > 0:
            pool_ex = exp.pool.examples[: rl_prompts or len(exp.pool.examples)]
            pool = [ex["problem"] for ex in pool_ex]
            _, ok, _ = evaluate_per_problem(
                exp,
                params,
                eval_key(seed, 2**30),  # a key no evaluation uses
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
        "settings": warm_settings(config_arg, paper_gdro, oracle_samples, rl_prompts),
    }


def _placement(result) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """A step's (prompt ids [P], bins [P], rollouts per prompt [P]) int32 of its trained batch
    (`train.StepResult`: the only round, or the kept groups when several rounds were drawn);
    None when the step did not say which prompts it trained on."""
    if len(result.rounds) == 1:
        ids, placement = result.rounds[0]
    elif result.batch_ids is not None:
        ids, placement = result.batch_ids, result.outcome.placement
    else:
        return None
    n = np.bincount(placement.segment_ids, minlength=len(ids)).astype(np.int32)
    return np.asarray(ids, np.int32), np.asarray(placement.bins, np.int32), n


def _placements(placements) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-step (ids, bins, n) -> three ``[steps, P]`` arrays (empty when a step allocated more
    than once or not at all)."""
    if placements and all(p is not None for p in placements):
        return tuple(np.stack([p[j] for p in placements]) for j in range(3))
    empty = np.zeros((0, 0), np.int32)
    return empty, empty, empty


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
    token_budget: int = 0,
) -> dict:
    """RL from the seed's warm-start ``params`` with ``method`` at learning rate ``lr``,
    evaluated on the whole held-out set after each step of ``eval_steps(steps, eval_every)``;
    with ``token_budget`` > 0 the run instead goes on until it has generated that many tokens
    (at most `MAX_STEP_FACTOR` x the steps), evaluated at as many evenly spaced token counts
    (`Budget`), so arms that discard or add rollouts get the same generation compute. The j-th
    evaluation's key is ``eval_key(seed, eval_steps(steps, eval_every)[j])`` in both modes, so
    every arm of a seed is evaluated with the same keys.

    Returns the job dict: ``correct [T, N, k]``; per evaluation ``eval_steps``, cumulative
    ``eval_tokens`` / ``eval_rollouts`` (generated, every sampling round) and
    ``eval_cpu_seconds`` ``[T]``; per-step placements ``ids``/``bins``/``n`` ``[steps, P]``;
    metrics ``rows``; the run's totals (``generated_tokens``, ``rollouts``, ``cpu_seconds``,
    ``budget_spent``); ``settings``.
    """
    import jax

    from grpo_jax import steps as steps_lib  # `steps` is the argument (RL steps)
    from grpo_jax import train, writers
    from grpo_jax.experiment import build_experiment

    t0 = time.perf_counter()
    kw = dict(
        config_arg=config_arg,
        steps=steps,
        rl_prompts=rl_prompts,
        paper_gdro=paper_gdro,
        prompts_per_step=prompts_per_step,
    )
    cfg = method_config(method, seed, lr=lr, **kw)
    when = eval_steps(cfg.steps, eval_every)
    if token_budget:  # the steps are a cap; the budget in generated tokens ends the run
        cfg.steps = int(cfg.steps) * MAX_STEP_FACTOR
    budget = Budget(when, token_budget, cap=cfg.steps)
    exp = build_experiment(cfg)
    rows, evals, summaries, placements, counts = [], [], [], [], []
    acc = {"levels": None}

    def record(result) -> bool:  # the row, the placement, the due evaluations; True = stop
        step = int(result.run.train.step)
        rows.append(writers.to_jsonable({"step": step, **result.row}))
        budget.add(result.row)
        placements.append(_placement(result))
        due = budget.evaluations_now(step)
        if due:
            te, ce = time.perf_counter(), time.process_time()
            # keyed by the evaluation's scheduled step (token mode: the same for every arm)
            nominal = when[min(len(evals), len(when) - 1)]
            summary, correct, levels = evaluate_per_problem(
                exp, result.run.train.params, eval_key(seed, nominal)
            )
            acc["eval_seconds"] = acc.get("eval_seconds", 0.0) + time.perf_counter() - te
            budget.eval_cpu += time.process_time() - ce
            acc["levels"] = levels
            for _ in range(due):
                evals.append(correct)
                summaries.append({"step": step, **summary})
                counts.append((step, budget.tokens, budget.rollouts, budget.cpu_seconds()))
        return budget.done()

    try:
        params = jax.tree.map(lambda x: jax.numpy.asarray(x), params)
        run, _ = steps_lib.init_run(exp, params=params)
        fns = steps_lib.make_steps(exp)
        train.run_steps(exp, fns, run, exp.make_source(), until=cfg.steps, hooks=(record,))
        pool = [ex["problem"] for ex in exp.pool.examples]
    finally:
        exp.close()
    eval_seconds, levels = acc.get("eval_seconds", 0.0), acc["levels"]
    ids, bins, n = _placements(placements)
    R = cfg.rollout.prompts_per_step * cfg.rollout.rollouts_per_prompt
    per_step = int(cfg.algorithm.num_iterations) * (R // int(exp.batching.mini_batch_size))
    counts = np.asarray(counts, np.float64).reshape(-1, 4)
    return {
        "method": method,
        "seed": seed,
        "lr": float(lr),
        "rows": rows,
        "eval": summaries[-1],
        "eval_summaries": summaries,
        "eval_steps": counts[:, 0].astype(np.int64),
        "eval_tokens": counts[:, 1].astype(np.int64),
        "eval_rollouts": counts[:, 2].astype(np.int64),
        "eval_cpu_seconds": counts[:, 3].tolist(),  # a timing: in the .json, not the .npz
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
        "rollouts": budget.rollouts,
        "generated_tokens": budget.tokens,
        "budget_spent": bool(budget.done()) if token_budget else None,
        "cpu_seconds": budget.cpu_seconds(),
        "updates": per_step * len(rows) - int(sum(r.get("skipped_updates", 0) for r in rows)),
        "pool_problems": pool if len(pool) <= 4096 else [],  # checked against an oracle file
        "settings": rl_settings(method, lr, eval_every=eval_every, token_budget=token_budget, **kw),
    }


# ----------------------------------------------------------------------------- job files


def _atomic_write(path: str, write: Callable[[str], None]) -> None:
    """``write(tmp)`` then ``os.replace(tmp, path)``: readers see the old file or the new one."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _write_text(path: str, text: str) -> None:
    def write(tmp):
        with open(tmp, "w") as f:
            f.write(text)

    _atomic_write(path, write)


def save_job(runs_dir: str, r: dict, *, save_params: bool = True) -> None:
    """A job's files (module docstring), each atomic, the ``.json`` last; a warm start's
    parameters too (``warm_s<seed>_params.npz``, so a resumed run need not redo it)."""
    from grpo_jax import writers

    os.makedirs(runs_dir, exist_ok=True)
    name = job_name(r.get("method"), r.get("lr"), r["seed"])
    base = os.path.join(runs_dir, name)
    if r.get("method") and "rows" in r:
        _write_text(base + ".jsonl", "".join(json.dumps(row) + "\n" for row in r["rows"]))
    _save_npz(base + ".npz", {k: np.asarray(r[k]) for k in ARRAYS if k in r})
    if save_params and r.get("method") is None and "params" in r:
        _atomic_write(base + PARAMS_SUFFIX, lambda tmp: _pickle(tmp, r["params"]))
    meta = {k: v for k, v in r.items() if k not in ("params", "rows") + ARRAYS}
    _write_text(base + ".json", json.dumps(writers.to_jsonable(meta), indent=1, sort_keys=True))


def _pickle(path: str, obj) -> None:
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=pickle.HIGHEST_PROTOCOL)


def _save_npz(path: str, arrays: dict) -> None:
    def write(tmp):
        with open(tmp, "wb") as f:  # a file object: a bare path would get ".npz" appended
            np.savez_compressed(f, **arrays)

    _atomic_write(path, write)


def load_params(runs_dir: str, seed: int):
    """A warm start's saved parameters (`save_job`), or None when there is no file."""
    path = os.path.join(runs_dir, job_name(None, None, seed) + PARAMS_SUFFIX)
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return pickle.load(f)


def rows_path(runs_dir: str, name: str) -> str | None:
    """The job's metrics rows file (``.jsonl``, else a committed ``.jsonl.gz``), or None."""
    for path in (
        os.path.join(runs_dir, f"{name}.jsonl"),
        os.path.join(runs_dir, f"{name}.jsonl.gz"),
    ):
        if os.path.exists(path):
            return path
    return None


def job_complete(runs_dir: str, method: str | None, lr: float | None, seed: int) -> bool:
    """Whether the job's ``.json`` + ``.npz`` (+ rows for an RL job) exist."""
    name = job_name(method, lr, seed)
    base = os.path.join(runs_dir, name)
    if not (os.path.exists(base + ".json") and os.path.exists(base + ".npz")):
        return False
    return method is None or rows_path(runs_dir, name) is not None


def check_settings(path: str, recorded: dict | None, expected: dict) -> None:
    """Raises `SettingsMismatch` naming ``path`` and the first differing field (files written
    before settings were recorded pass unchecked)."""
    if recorded is None:
        return
    for key, want in expected.items():
        if key in recorded and _norm(recorded[key]) != _norm(want):
            raise SettingsMismatch(
                f"{path}: recorded {key}={recorded[key]!r} but this command has {key}={want!r} "
                "(use another --out, or delete the file to rerun the job)"
            )


def _norm(x):
    return json.loads(json.dumps(x))  # tuples -> lists, numpy scalars -> numbers


def load_job(
    runs_dir: str, method: str | None, lr: float | None, seed: int, expected: dict | None = None
) -> dict:
    """A job from its files; with ``expected`` settings, `check_settings` first.

    Raises:
      FileNotFoundError: a missing file. SettingsMismatch: see `check_settings`.
    """
    from grpo_jax import writers

    name = job_name(method, lr, seed)
    path = os.path.join(runs_dir, f"{name}.json")
    with open(path) as f:
        r = json.load(f)
    if expected is not None:
        check_settings(path, r.get("settings"), expected)
    with np.load(os.path.join(runs_dir, f"{name}.npz")) as z:
        r.update({k: z[k] for k in z.files})
    if method:
        rows = rows_path(runs_dir, name)
        if rows is None:
            raise FileNotFoundError(f"{os.path.join(runs_dir, name)}.jsonl: no such file")
        if rows.endswith(".gz"):  # a committed run: the rows gzipped (`gzip runs/*.jsonl`)
            with gzip.open(rows, "rt") as f:
                r["rows"] = [json.loads(line) for line in f if line.strip()]
        else:
            r["rows"] = writers.read_jsonl(rows)
    return r


# ----------------------------------------------------------------------------- workers


def enable_compilation_cache(cache_dir: str) -> None:
    """JAX's persistent compilation cache in ``cache_dir`` ("" = leave JAX's setting): every job
    rebuilds the same jitted functions, and the cache turns ~20 s of XLA compiles per job into
    about one. The workers share it, so it gets a size cap (16 GiB unless one is set), which turns
    on JAX's file lock around each read and write (uncapped, entries are written in place)."""
    if not cache_dir:
        return
    import jax

    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if jax.config.jax_compilation_cache_max_size < 0:
        jax.config.update("jax_compilation_cache_max_size", 16 * 2**30)


def _worker_init(cache_dir: str = ""):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    enable_compilation_cache(cache_dir)


def _call(fn_args):
    fn, args, kwargs = fn_args
    return fn(*args, **kwargs)


class Runner:
    """Runs ``(fn, args, kwargs)`` jobs in this process (``workers`` <= 1) or in a spawn pool,
    launching no new job once ``deadline`` (a ``time.perf_counter()`` value) has passed."""

    def __init__(self, workers: int, jax_cache: str = "", deadline: float | None = None):
        self.workers, self.deadline = max(int(workers), 1), deadline
        self.pool = None
        if self.workers > 1:
            import multiprocessing as mp

            self.pool = mp.get_context("spawn").Pool(
                self.workers, initializer=_worker_init, initargs=(jax_cache,)
            )
        else:
            enable_compilation_cache(jax_cache)

    def expired(self) -> bool:
        return self.deadline is not None and time.perf_counter() >= self.deadline

    def run(self, jobs: Iterable, on_done: Callable[[dict], None]) -> int:
        """Calls ``on_done(result)`` as each job finishes (any order); returns how many jobs
        were not launched because the deadline passed."""
        pending = list(jobs)
        if self.pool is None:
            while pending and not self.expired():
                on_done(_call(pending.pop(0)))
            return len(pending)
        in_flight: list = []
        while pending or in_flight:
            while pending and len(in_flight) < self.workers and not self.expired():
                in_flight.append(self.pool.apply_async(_call, (pending.pop(0),)))
            if not in_flight:
                break
            ready = [a for a in in_flight if a.ready()]
            if not ready:
                in_flight[0].wait(0.5)
                continue
            for a in ready:
                in_flight.remove(a)
                on_done(a.get())
        return len(pending)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool.join()
