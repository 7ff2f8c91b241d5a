"""The evaluation protocol: k samples per problem, mean@k, unbiased pass@k, maj@k.

Paper protocol by default (gdro.md section 5): 8 samples at temperature 0.6, top-p 0.8,
top-k 20; mean@k per benchmark, pass@k per benchmark and pooled. Results are reported per
dataset, per difficulty level (where a dataset has one) and pooled.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

import jax
import numpy as np

from grpo_jax import metrics as metrics_lib
from grpo_jax import sampling, sharding
from grpo_jax import transfer as xfer
from grpo_jax.data import datasets
from grpo_jax.data.templates import encode_prompts, prompt_of
from grpo_jax.envs import episodes
from grpo_jax.envs import from_config as envs_from_config


def _summarise(correct: np.ndarray, answers: list[list[str]] | None, k: int) -> dict:
    """correct [N, k] bool -> {mean_at_1, mean_at_k, pass_at_1, pass_at_k, maj_at_k, n}."""
    n = np.full((correct.shape[0],), k)
    c = correct.sum(axis=1)
    out = {
        "num_problems": int(correct.shape[0]),
        "mean_at_1": float(correct.mean()) if correct.size else 0.0,
        f"mean_at_{k}": float(np.asarray(metrics_lib.mean_at_k(correct)).mean())
        if correct.size
        else 0.0,
        "pass_at_1": float(np.mean(metrics_lib.pass_at_k(n, c, 1))) if correct.size else 0.0,
        f"pass_at_{k}": float(np.mean(metrics_lib.pass_at_k(n, c, k))) if correct.size else 0.0,
    }
    if answers is not None and correct.size:
        out[f"maj_at_{k}"] = float(np.mean(metrics_lib.maj_at_k(answers, correct.tolist())))
    return out


def _answer(extract, completion: str):
    """A hashable normalised answer (None: no answer; it does not vote in maj@k)."""
    a = extract(completion)
    if a is None:
        return None
    a = " ".join(str(a).split())
    return a or None


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """What `evaluate_policy` measured.

    Attributes:
      summary: ``{"mean_at_1", "pass_at_k", ..., "per_level": {level: {...}},
        "num_overlong_prompts"}`` (floats: fractions of problems in [0, 1]).
      correct: [N, k] bool, sample s of problem i was correct (examples in the given order).
      levels: [N] int, each problem's difficulty level (-1: none).
    """

    summary: dict
    correct: np.ndarray
    levels: np.ndarray


def evaluate_policy(
    graphdef,
    params,
    examples: list[dict],
    *,
    tokenizer,
    reward_fn,
    sampling_config: sampling.SamplingConfig,
    render: Callable[[str | list], str],  # templates.prompt_of(example) -> prompt text
    prompt_len: int,
    k: int,
    batch_size: int,
    rng: jax.Array,
    extract: Callable[[str], str] | None = None,
    progress: bool = False,
    mesh=None,
    desc: str = "eval",
    environment=None,
    turn_tokens: int = 0,
) -> EvalResult:
    """Samples ``k`` completions per problem and scores them.

    Args:
      graphdef, params: the policy (``nnx.split`` graph and pure-dict parameters).
      examples: dicts with ``problem``, ``answer`` (or ``answers``) and optional ``level``.
      batch_size: rollouts per generation call; rounded down to a multiple of ``k``; the last
        call is padded, so every call has the same shape (one compilation).
      extract: maps a completion to a normalised final answer for maj@k (None: the reward
        function's own ``extract`` if it has one, else no maj@k; answers that come back None
        do not vote).
      mesh: the device mesh the sampler's activations are pinned to (None: left to XLA).
      desc: the progress bar's label.
      environment: a multi-turn `grpo_jax.envs.Environment`: each sample is an episode
        (`envs.episodes.run_episodes`, ``sampling_config.max_new_tokens`` tokens in all, turns of
        at most ``turn_tokens`` (0 = all of them)), scored on `Environment.final_text`.

    Returns:
      the `EvalResult`: the summary and the per-problem correctness it was computed from.
    """
    # evaluation scores correctness with the verifier alone (a reward model's wrapper keeps it)
    reward_fn = getattr(reward_fn, "verifier", reward_fn)
    if extract is None:
        extract = getattr(reward_fn, "extract", None)
    texts = [render(prompt_of(ex)) for ex in examples]
    # overlong prompts are cut from the left (the question's end and the template stay) and counted
    tokens, mask, _, overlong = encode_prompts(
        tokenizer, texts, prompt_len, "truncate", return_overlong=True
    )
    per_call = max(batch_size // k, 1)
    num = len(examples)
    correct = np.zeros((num, k), bool)
    answers = [[""] * k for _ in range(num)]
    iterator = range(0, num, per_call)
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(iterator, desc=desc, total=(num + per_call - 1) // per_call)
    if mesh is None:
        generate, put = sampling.generate, jax.numpy.asarray
    else:
        generate = sharding.under_mesh(mesh, sampling.generate)
        put = lambda x: xfer.to_device(mesh, x)
    turn_config = envs_from_config.turn_sampling(
        sampling_config, tokenizer, environment, turn_tokens
    )
    for start in iterator:
        idx = np.arange(start, start + per_call)
        idx = np.where(idx < num, idx, 0)  # pad the last call with problem 0 (discarded)
        rows = np.repeat(idx, k)
        rng, key = jax.random.split(rng)
        if environment is None:
            out = generate(
                graphdef, params, put(tokens[rows]), put(mask[rows]), key, sampling_config
            )
            completions = xfer.decode_completions(
                tokenizer, *xfer.to_host((out.completion_tokens, out.lengths))
            )
        else:
            completions = _episode_texts(
                lambda t, m, key, caps: generate(
                    graphdef, params, put(t), put(m), key, turn_config, put(caps)
                ),
                tokenizer,
                environment,
                tokens[rows],
                mask[rows],
                [examples[r] for r in rows],
                key,
                sampling_config.max_new_tokens,
                turn_config.max_new_tokens,
            )
        golds = [examples[r].get("answers", examples[r]["answer"]) for r in rows]
        if getattr(reward_fn, "takes_examples", False):  # your reward reads row fields
            _, ok, _ = reward_fn(completions, golds, examples=[examples[r] for r in rows])
        else:
            _, ok, _ = reward_fn(completions, golds)
        ok = np.asarray(ok, bool).reshape(per_call, k)
        for j, r in enumerate(idx[: min(per_call, num - start)]):
            correct[r] = ok[j]
            if extract is not None:
                answers[r] = [_answer(extract, completions[j * k + s]) for s in range(k)]
    result = _summarise(correct, answers if extract is not None else None, k)
    result["num_overlong_prompts"] = int(overlong.sum())
    levels = np.asarray([int(ex.get("level", -1)) for ex in examples])
    by_level = collections.defaultdict(list)
    for i, lvl in enumerate(levels):
        by_level[int(lvl)].append(i)
    if len(by_level) > 1 or -1 not in by_level:
        result["per_level"] = {
            str(lvl): _summarise(correct[ix], None, k) for lvl, ix in sorted(by_level.items())
        }
    return EvalResult(summary=result, correct=correct, levels=levels)


def _episode_texts(generate, tokenizer, env, tokens, mask, examples, key, budget, turn):
    ep = episodes.run_episodes(
        generate, tokenizer, env, tokens, mask, examples, key, budget=budget, turn_tokens=turn
    )
    return list(ep.texts)


def evaluate_sets(exp, params, rng: jax.Array) -> dict[str, EvalResult]:
    """`evaluate_policy` on each of the experiment's held-out sets: ``{name: EvalResult}``.

    One key per set, split from ``rng`` in the sets' order (the training run's evaluation).
    """
    cfg = exp.run.eval
    out = {}
    for name, examples in exp.pool.eval_sets.items():
        rng, key = jax.random.split(rng)
        out[name] = evaluate_policy(
            exp.graphdef,
            params,
            examples,
            tokenizer=exp.tokenizer,
            reward_fn=exp.eval_reward_fns[name],
            sampling_config=exp.eval_sampling,
            render=exp.render,
            prompt_len=exp.prompt_len,
            k=cfg.num_samples,
            batch_size=cfg.batch_size,
            rng=key,
            mesh=exp.mesh,
            progress=exp.run.logging.progress_bar and jax.process_index() == 0,
            desc=name,
            environment=exp.environment,
            turn_tokens=exp.run.env.turn_tokens,
        )
    return out


def pooled_summary(summaries: dict[str, dict], keys) -> dict:
    """Problem-weighted mean of per-dataset summaries (= the mean over all their problems).

    ``keys``: the metrics to pool; one missing from any dataset (e.g. maj@k without an answer
    extractor) is left out. Also returns ``num_problems`` (the total).
    """
    rs = list(summaries.values())
    total = sum(r["num_problems"] for r in rs)
    pooled = {
        key: sum(r[key] * r["num_problems"] for r in rs) / (total or 1)
        for key in keys
        if rs and all(key in r for r in rs)
    }
    return {**pooled, "num_problems": total}


def evaluate(exp, params, rng: jax.Array) -> dict:
    """Evaluates ``params`` on the experiment's held-out sets; pooled + per dataset."""
    k = exp.run.eval.num_samples
    per_dataset = {n: r.summary for n, r in evaluate_sets(exp, params, rng).items()}
    pooled = pooled_summary(per_dataset, ["mean_at_1", f"pass_at_{k}", "pass_at_1", f"maj_at_{k}"])
    del pooled["num_problems"]
    return {**pooled, "per_dataset": per_dataset}


# Benchmark suites: name -> datasets (`grpo_jax.data.datasets` names), in table order.
SUITES: dict[str, tuple[str, ...]] = {
    "math": ("math500", "aime24", "aime25", "amc23", "gsm8k"),
}


def resolve_datasets(suite: str = "", names=()) -> tuple[str, ...]:
    """The datasets of ``suite`` (a `SUITES` key) or the given ``names``; () when neither.

    Raises:
      ValueError: both given, an unknown suite, or a name `grpo_jax.data.datasets` does not know
        (a one-line message listing the choices).
    """
    names = tuple(n.strip() for n in names if n.strip())
    if suite and names:
        raise ValueError("pass --suite or --datasets, not both")
    if suite:
        if suite not in SUITES:
            raise ValueError(f"unknown suite {suite!r}; suites: {', '.join(SUITES)}")
        return SUITES[suite]
    unknown = [n for n in names if n not in datasets.NAMES]
    if unknown:
        raise ValueError(
            f"unknown dataset(s) {', '.join(unknown)}; known: {', '.join(datasets.NAMES)}"
        )
    return names


def per_problem_scores(correct: np.ndarray, k: int) -> dict[str, np.ndarray]:
    """``{"mean_at_k": [N], "pass_at_k": [N]}`` float64 per-problem scores of a ``[N, k]`` bool
    matrix (keys spelt with the number, e.g. ``pass_at_8``): mean@k is the fraction of correct
    samples, pass@k the unbiased estimate of Chen et al. 2021 (`metrics.pass_at_k`); a
    benchmark's score is their mean over problems."""
    c = np.asarray(correct, bool).reshape(-1, k)
    return {
        f"mean_at_{k}": metrics_lib.mean_at_k(c) if c.size else np.zeros(0),
        f"pass_at_{k}": np.asarray(
            metrics_lib.pass_at_k(np.full(c.shape[0], k), c.sum(axis=1), k), np.float64
        ).reshape(-1),
    }


def confidence_intervals(
    results: dict[str, EvalResult],
    k: int,
    *,
    confidence: float = 0.95,
    num_resamples: int = 10_000,
    seed: int = 0,
) -> dict:
    """Percentile-bootstrap CIs (Efron; `metrics.bootstrap_ci`) of mean@k and pass@k.

    Per dataset: the problems are resampled. Pooled (problem-weighted, as `pooled_summary`):
    stratified, each dataset's problems resampled within it, so every replicate keeps the
    suite's composition. The per-problem scores come from ``EvalResult.correct`` ([N, k] bool).
    Where every per-problem score is 0 or 1 (pass@k with k samples per problem, and mean@1),
    the benchmark's score is a binomial proportion of problems and the interval is the exact
    Clopper-Pearson one (Clopper & Pearson 1934; beta quantiles): monotone in the number solved
    and not zero-width at 0 or N solved (0 of N: ``[0, 1 - (alpha/2)^(1/N)]``). Other scores
    (mean@k, k > 1) take the bootstrap, which resamples problems only (not the samples within
    a problem): all-equal scores give it a zero-width interval.

    Returns:
      ``{"per_dataset": {name: {metric: [low, high]}}, "pooled": {metric: [low, high]}}`` with
      metric ``mean_at_{k}`` and ``pass_at_{k}``; floats in [0, 1].
    """
    kw = dict(confidence=confidence, num_resamples=num_resamples, seed=seed)
    scores = {name: per_problem_scores(r.correct, k) for name, r in results.items()}
    metrics = (f"mean_at_{k}", f"pass_at_{k}")

    def interval(values, strata=None) -> list[float]:
        exact = metrics_lib.clopper_pearson(values, confidence)
        if exact is not None:
            return exact
        return list(metrics_lib.bootstrap_ci(values, strata=strata, **kw))

    per_dataset = {name: {m: interval(s[m]) for m in metrics} for name, s in scores.items()}
    strata = np.concatenate([np.full(len(r.correct), i) for i, r in enumerate(results.values())])
    pooled = {m: interval(np.concatenate([s[m] for s in scores.values()]), strata) for m in metrics}
    return {"per_dataset": per_dataset, "pooled": pooled}


def format_summary(summary: dict) -> str:
    """A small text table of before/after evaluation."""
    before, after = summary["eval_before"], summary["eval_after"]
    keys = [k for k in before if isinstance(before[k], float)]
    lines = [
        f"algorithm={summary['algorithm']} steps={summary['steps']} "
        f"wall_seconds={summary['wall_seconds']:.1f}",
        f"{'metric':<14}{'before':>10}{'after':>10}{'delta':>10}",
    ]
    for k in keys:
        lines.append(f"{k:<14}{before[k]:>10.4f}{after[k]:>10.4f}{after[k] - before[k]:>+10.4f}")
    for name, res in after.get("per_dataset", {}).items():
        for lvl, r in res.get("per_level", {}).items():
            b = before["per_dataset"][name]["per_level"][lvl]["mean_at_1"]
            lines.append(f"{name}/level {lvl:<5} mean_at_1 {b:>8.4f} -> {r['mean_at_1']:.4f}")
    return "\n".join(lines)
