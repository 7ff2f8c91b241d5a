"""Compute matching by generated tokens in experiments/compare (hand-computed values)."""

import math

import numpy as np
import pytest

from experiments.compare import jobs, statistics


def test_token_checkpoints_are_even_and_end_at_the_budget():
    assert jobs.token_checkpoints(1000, 4) == [250, 500, 750, 1000]
    with pytest.raises(ValueError):
        jobs.token_checkpoints(0, 4)


def _row(tokens, rollouts=8):
    return {"generated_tokens": tokens, "generated_rollouts": rollouts}


def test_budget_token_mode_evaluates_at_marks_and_stops_at_the_budget():
    b = jobs.Budget(when=[2, 4], token_budget=1000, cap=16)  # marks 500, 1000
    seen = []
    for step in range(1, 5):
        b.add(_row(300, rollouts=8 if step != 3 else 24))  # step 3 sampled three rounds
        seen.append((b.evaluations_now(step), b.done()))
    assert seen == [(0, False), (1, False), (0, False), (1, True)]
    assert (b.tokens, b.rollouts) == (1200, 48)


def test_budget_at_the_step_cap_fills_every_mark_left():
    b = jobs.Budget(when=[2, 4], token_budget=10_000, cap=3)
    counts = []
    for step in range(1, 4):
        b.add(_row(100))
        counts.append(b.evaluations_now(step))
    assert counts == [0, 0, 2] and not b.done()


def test_budget_step_mode_is_the_schedule():
    b = jobs.Budget(when=[2, 4])
    assert [b.evaluations_now(s) for s in (1, 2, 3, 4)] == [0, 1, 0, 1]
    b.add(_row(10**9))
    assert not b.done()


def test_first_reach_by_hand():
    assert statistics.first_reach([10, 20, 30], [0.1, 0.3, 0.5], 0.3) == 20
    assert math.isnan(statistics.first_reach([10, 20, 30], [0.1, 0.3, 0.5], 0.6))


def _job(val_solved_per_eval, tokens, cpu):
    """4 held-out problems (validation: 0 and 2), 2 samples; ``val_solved_per_eval[t]`` lists
    the validation problems solved (both samples) at evaluation t."""
    correct = np.zeros((len(tokens), 4, 2), bool)
    for t, solved in enumerate(val_solved_per_eval):
        correct[t, solved] = True
    correct[:, 1] = True  # a test problem: must not count
    return {
        "correct": correct,
        "eval_tokens": np.asarray(tokens),
        "eval_rollouts": np.asarray(tokens) // 10,
        "eval_cpu_seconds": np.asarray(cpu, float),
        "generated_tokens": tokens[-1],
        "rollouts": tokens[-1] // 10,
    }


def test_compute_to_grpo_level_by_hand():
    """Seed 0: GRPO ends at validation pass@2 = 0.5 (problem 0 of {0, 2}); the arm reaches 0.5
    at its first evaluation (100 tokens, 7 CPU s). Seed 1: GRPO ends at 1.0; the arm never gets
    there."""
    runs = {
        "grpo": {
            0: _job([[], [0]], [120, 240], [5, 10]),
            1: _job([[0], [0, 2]], [110, 230], [4, 9]),
        },
        "dapo": {
            0: _job([[2], [0, 2]], [100, 260], [7, 14]),
            1: _job([[], [2]], [130, 250], [6, 12]),
        },
    }
    out = statistics.compute_to_grpo_level(runs, num_eval=4, pass_k=2)
    assert out["grpo"]["target"] == [0.5, 1.0] and out["dapo"]["target"] == [0.5, 1.0]
    assert out["grpo"]["tokens"] == [240.0, 230.0]  # GRPO reaches its own level at its end
    assert out["dapo"]["tokens"][0] == 100.0 and math.isnan(out["dapo"]["tokens"][1])
    assert out["dapo"]["cpu_seconds"][0] == 7.0 and out["dapo"]["rollouts"][0] == 10.0
    assert out["dapo"]["reached"] == 0.5 and out["dapo"]["median_tokens"] == 100.0
    assert out["dapo"]["budget_tokens"] == 255.0 and out["grpo"]["budget_rollouts"] == 23.5
    # a job written before token budgets (no eval_tokens) is left out
    del runs["dapo"][1]["eval_tokens"]
    assert statistics.compute_to_grpo_level(runs, num_eval=4, pass_k=2)["dapo"]["seeds"] == [0]


@pytest.mark.slow
def test_rl_job_runs_to_the_token_budget_and_records_compute_per_evaluation():
    """DAPO (extra rounds) on the smoke testbed with a 300-token budget and two evaluations:
    it stops at the first step at or past the budget, evaluates at >= 150 and >= 300 tokens,
    and counts every round's rollouts."""
    cfg_arg = "heavy_tailed,smoke"
    w = jobs.warm_start_job(0, cfg_arg)
    kw = dict(config_arg=cfg_arg, steps=2, rl_prompts=100, eval_every=1)
    r = jobs.rl_job("dapo", 0, w["params"], lr=1e-4, token_budget=300, **kw)
    rows = r["rows"]
    assert r["budget_spent"] and r["generated_tokens"] >= 300
    assert sum(x["generated_tokens"] for x in rows[:-1]) < 300  # stopped at the first step past it
    assert r["generated_tokens"] == sum(x["generated_tokens"] for x in rows)
    assert r["rollouts"] == sum(x["generated_rollouts"] for x in rows) >= 32 * len(rows)
    tok = r["eval_tokens"]
    assert len(tok) == 2 and 150 <= tok[0] <= tok[1] == r["generated_tokens"]
    assert r["correct"].shape[0] == 2 and r["eval_steps"][-1] == len(rows)
    assert np.all(np.diff(r["eval_cpu_seconds"]) >= 0) and r["settings"]["token_budget"] == 300
    # the trained batches' placements are kept also for steps that drew several rounds
    assert any(x["dynamic_sampling/rounds"] > 1 for x in rows)
    assert r["ids"].shape == (len(rows), 8) and np.all(r["n"] == 4)


def test_holm_step_down_by_hand():
    """m = 4 at alpha 0.05: thresholds 0.0125, 0.0167, 0.025, 0.05 for the sorted p-values
    0.01, 0.015, 0.03, 0.04: the first two are rejected, the third fails (0.03 > 0.025) and
    stops the procedure, so 0.04 is kept though it is below 0.05."""
    p = {"a": 0.03, "b": 0.01, "c": 0.04, "d": 0.015}
    assert statistics.holm(p, 0.05) == {"a": False, "b": True, "c": False, "d": True}
    # a NaN is never rejected but counts in m (here m = 2: 0.03 > 0.05 / 2 fails)
    assert statistics.holm({"a": 0.03, "b": float("nan")}, 0.05) == {"a": False, "b": False}
    assert statistics.holm({"a": 0.03}, 0.05) == {"a": True}


def test_start_strata_by_hand():
    rates = [0.0, 0.01, 0.1, 0.1001, 0.3, 0.31, 1.0]
    np.testing.assert_array_equal(statistics.start_stratum(rates), [0, 1, 1, 2, 2, 3, 3])
    assert len(statistics.START_LABELS) == 4
