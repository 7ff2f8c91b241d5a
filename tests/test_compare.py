"""experiments/compare: the validation/test split, lr selection (never from test results), the
paired bootstrap (pooled and over a level mix) on hand-made inputs, the diagnostics and the
true WSE by hand, the oracle file, the report from hand-made job files, the criterion and the
pre-registration, resume (settings checks, --max_minutes, a resumed toy run equal to an
uninterrupted one) and a toy end-to-end run (sweep -> selection -> final seeds -> report)."""

import dataclasses
import json

import numpy as np
import pytest

from experiments import compare
from grpo_jax import metrics


def _correct(pass_rates, n=40, k=8, seeds=3):
    """[S, N, k] where problem i has all k samples correct iff i < pass_rate * N."""
    out = np.zeros((seeds, n, k), bool)
    for s, p in enumerate(pass_rates):
        out[s, : int(round(p * n))] = True
    return out


# ----------------------------------------------------------------------------- split


def test_split_heldout_is_disjoint_deterministic_and_covers():
    for n in (0, 1, 16, 199, 200):
        val, test = compare.split_heldout(n)
        again = compare.split_heldout(n)
        assert np.array_equal(val, again[0]) and np.array_equal(test, again[1])
        assert not set(val) & set(test)
        assert sorted(set(val) | set(test)) == list(range(n))
        assert all(i % 2 == 0 for i in val) and all(i % 2 == 1 for i in test)
        assert abs(len(val) - len(test)) <= 1


# ----------------------------------------------------------------------------- selection


def _sweep_with(val_best, test_best, lrs=(3e-5, 1e-4, 3e-4), s=3, t=2, n=20, k=8):
    """lr -> [S, T, N, k]: ``val_best`` solves every validation problem, the others half;
    ``test_best`` solves every test problem, the others none."""
    val, test = compare.split_heldout(n)
    out = {}
    for lr in lrs:
        c = np.zeros((s, t, n, k), bool)
        c[:, :, val[: len(val) // 2]] = True
        if lr == val_best:
            c[:, :, val] = True
        if lr == test_best:
            c[:, :, test] = True
        out[lr] = c
    return out


def test_select_lr_picks_the_validation_best():
    val, _ = compare.split_heldout(20)
    lr, scores = compare.select_lr(_sweep_with(1e-4, 1e-4), val)
    assert lr == 1e-4 and scores[1e-4] == 1.0 and scores[3e-5] == 0.5


def test_select_lr_never_reads_the_test_half():
    val, _ = compare.split_heldout(20)
    for metric in compare.METRICS:
        clean, _ = compare.select_lr(_sweep_with(3e-4, None), val, metric=metric)
        # poison: another lr is perfect on the test half (and would win on the whole set)
        poisoned = _sweep_with(3e-4, 3e-5)
        whole = {lr: c.mean() for lr, c in poisoned.items()}
        assert max(whole, key=whole.get) == 3e-5
        lr, scores = compare.select_lr(poisoned, val, metric=metric)
        assert lr == clean == 3e-4
        # and arbitrary garbage in the test columns changes nothing
        rng = np.random.default_rng(0)
        _, test = compare.split_heldout(20)
        for c in poisoned.values():
            c[:, :, test] = rng.random(c[:, :, test].shape) < 0.5
        assert compare.select_lr(poisoned, val, metric=metric) == (lr, scores)


def test_select_lr_uses_the_last_evaluations_and_breaks_ties_by_order():
    val, _ = compare.split_heldout(10)
    a = np.zeros((1, 3, 10, 8), bool)
    b = np.zeros((1, 3, 10, 8), bool)
    a[:, 0] = True  # best early, then nothing
    b[:, 1:, val[:2]] = True  # modest in the last two evaluations
    assert compare.select_lr({1.0: a, 2.0: b}, val, last=2)[0] == 2.0
    assert compare.select_lr({1.0: a, 2.0: b}, val, last=3)[0] == 1.0
    assert compare.select_lr({1.0: b, 2.0: b.copy()}, val)[0] == 1.0
    with pytest.raises(ValueError, match="empty"):
        compare.select_lr({}, val)


# ----------------------------------------------------------------------------- statistics


def test_bootstrap_point_estimate_is_the_ratio_of_means():
    base = _correct([0.5, 0.5, 0.25])  # mean pass@8 = 1.25 / 3
    meth = _correct([0.75, 0.5, 0.5])  # mean pass@8 = 1.75 / 3
    g = compare.bootstrap_relative_gain(meth, base, n_boot=300)
    assert g["gain"] == pytest.approx(1.75 / 1.25 - 1)
    assert g["diff"] == pytest.approx((1.75 - 1.25) / 3)
    assert g["lo"] <= g["gain"] <= g["hi"]
    assert g["diff_lo"] <= g["diff"] <= g["diff_hi"]
    # per-seed differences 0.25, 0, 0.25: d_z = mean / std
    d = np.array([0.25, 0.0, 0.25])
    assert g["d_z"] == pytest.approx(d.mean() / d.std(ddof=1))


def test_bootstrap_mean_at_k_and_evaluation_averaging():
    rng = np.random.default_rng(3)
    base = rng.random((4, 30, 8)) < 0.3
    meth = base.copy()
    meth[:, :, 0] = True  # one more correct sample on every problem
    g = compare.bootstrap_relative_gain(meth, base, metric="mean_at_k", n_boot=200)
    assert g["gain"] == pytest.approx(meth.mean() / base.mean() - 1)
    assert g["lo"] > 0 and g["p_le_0"] == 0
    # [S, T, N, k]: the score is the mean over the last `last` evaluations
    four = np.stack([np.zeros_like(base), base, base], 1)  # T = 3, the first all wrong
    assert compare.per_problem_scores(four, "mean_at_k", last=2) == pytest.approx(
        compare.per_problem_scores(base, "mean_at_k")
    )
    assert compare.per_problem_scores(four, "pass_at_k").mean() == pytest.approx(
        base.any(-1).mean() * 2 / 3
    )
    with pytest.raises(ValueError, match="metric"):
        compare.per_problem_scores(base, "maj_at_k")


def test_pass_at_8_is_the_unbiased_estimator_from_more_samples():
    # Chen et al. 2021: 1 - C(n - c, k) / C(n, k); by hand for n = 10, k = 8
    got = metrics.pass_at_k(10, np.array([0, 1, 2, 3, 10]), 8)
    assert got == pytest.approx([0.0, 1 - 9 / 45, 1 - 1 / 45, 1.0, 1.0])  # C(9,8)=9, C(10,8)=45
    # from 32 samples: the mean over the C(32, 8) subsets of 1[any correct], by simulation
    rng = np.random.default_rng(0)
    row = rng.random(32) < 0.1
    sub = np.array([row[rng.choice(32, 8, replace=False)].any() for _ in range(20000)])
    est = compare.per_problem_scores(row[None, None, :], "pass_at_k")[0, 0]
    assert est == pytest.approx(sub.mean(), abs=0.015)
    # with n = k it is 1[any correct]; with fewer samples than k it is pass@n
    eight = rng.random((2, 5, 8)) < 0.3
    assert compare.per_problem_scores(eight, "pass_at_k") == pytest.approx(
        eight.any(-1).astype(float)
    )
    four = eight[..., :4]
    assert compare.per_problem_scores(four, "pass_at_k") == pytest.approx(
        four.any(-1).astype(float)
    )
    with pytest.raises(ValueError, match="k = 9 > n = 8"):
        metrics.pass_at_k(8, np.array([1]), 9)
    assert not hasattr(compare, "pass_at_k_unbiased")  # one definition: grpo_jax.metrics


def test_bootstrap_identical_methods_have_a_degenerate_interval_at_zero():
    rng = np.random.default_rng(1)
    c = rng.random((3, 30, 8)) < 0.3
    g = compare.bootstrap_relative_gain(c, c.copy(), n_boot=200)
    assert g["gain"] == 0 and g["lo"] == 0 and g["hi"] == 0
    assert g["diff"] == 0 and g["d_z"] == 0


def test_bootstrap_is_paired_over_problems():
    # the method solves exactly the baseline's problems plus one: every paired replicate has
    # gain >= 0, whereas an unpaired bootstrap would often give negative values
    base = _correct([0.5, 0.5, 0.5])
    meth = base.copy()
    meth[:, 20] = True
    g = compare.bootstrap_relative_gain(meth, base, n_boot=300)
    assert g["lo"] >= 0 and g["p_le_0"] < 0.5 and g["diff_lo"] >= 0


def test_bootstrap_one_seed_has_no_effect_size():
    g = compare.paired_bootstrap(np.array([[1.0, 0.0, 1.0]]), np.array([[1.0, 0.0, 0.0]]))
    assert g["gain"] == pytest.approx(1.0) and np.isnan(g["d_z"])
    assert g["n_seeds"] == 1 and g["n_problems"] == 3


def test_bootstrap_rejects_bad_input():
    with pytest.raises(ValueError, match="baseline"):
        compare.bootstrap_relative_gain(np.ones((2, 3, 8), bool), np.zeros((2, 3, 8), bool))
    with pytest.raises(ValueError, match="shape|S, N, k"):
        compare.bootstrap_relative_gain(np.ones((2, 3, 8), bool), np.ones((2, 4, 8), bool))
    with pytest.raises(ValueError, match="S, N"):
        compare.paired_bootstrap(np.ones(3), np.ones(3))


# ----------------------------------------------------------------------------- true WSE, oracle


def test_true_wse_uniform_allocation_has_ratio_one_and_sqrt_rule_lowers_it():
    p = np.array([0.5, 0.5, 0.02, 0.02, np.nan])
    ids, bins = np.array([0, 1, 2, 3]), np.array([0, 0, 1, 1])
    u = compare.true_wse(ids, bins, [4, 4, 4, 4], p, 4)
    assert u["wse"] == pytest.approx(u["wse_uniform"])
    sig = np.sqrt([0.25, 0.25, 0.0196, 0.0196])
    assert u["wse"] == pytest.approx(np.mean(sig / 2))
    assert u["informative"] == pytest.approx(2 * (1 - 2 * 0.5**4) + 2 * (1 - 0.02**4 - 0.98**4))
    # more rollouts to the high-variance bin (same total): lower true WSE
    a = compare.true_wse(ids, bins, [6, 6, 2, 2], p, 4)
    assert a["wse"] < a["wse_uniform"] == pytest.approx(u["wse"])
    # unknown p: left out; none known: NaN
    b = compare.true_wse(np.array([0, 4]), np.array([0, 1]), [4, 4], p, 4)
    assert b["known"] == 1 and b["wse"] == pytest.approx(0.5 / 2)
    assert np.isnan(compare.true_wse(np.array([4]), np.array([0]), [4], p, 4)["wse"])


def test_load_oracle_format_and_checks(tmp_path):
    path = tmp_path / "oracle.json"
    path.write_text(json.dumps({"p": {"0": 0.25, "2": 1.0}, "problems": {"0": "1+2"}, "k": 64}))
    p = compare.load_oracle(str(path), 4, ["1+2", "3+4", "5+6", "7+8"])
    assert p[0] == 0.25 and p[2] == 1.0 and np.isnan(p[1]) and np.isnan(p[3])
    with pytest.raises(ValueError, match="RL pool"):
        compare.load_oracle(str(path), 4, ["9+9", "3+4", "5+6", "7+8"])
    with pytest.raises(ValueError, match="outside"):
        compare.load_oracle(str(path), 2)
    path.write_text(json.dumps({"p": {"0": 1.5}}))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        compare.load_oracle(str(path), 4)
    path.write_text(json.dumps({"0": 0.5}))
    with pytest.raises(ValueError, match="'p'"):
        compare.load_oracle(str(path), 4)


# ----------------------------------------------------------------------------- planning, config


def test_eval_steps_plan_and_estimate():
    assert compare.eval_steps(80, 20) == [20, 40, 60, 80]
    assert compare.eval_steps(50, 20) == [20, 40, 50]
    assert compare.eval_steps(5, 0) == [5]
    plan = compare.plan_jobs(range(10), 3, list(compare.METHODS)[:5], compare.DEFAULT_LRS)
    assert plan["sweep_seeds"] == [0, 1, 2] and plan["final_only_seeds"] == list(range(3, 10))
    assert (plan["n_sweep"], plan["n_final"], plan["n_warm"]) == (45, 35, 10)
    disjoint = compare.plan_jobs([0, 1], [7, 8], ["grpo"], [1e-4, 3e-4])
    assert disjoint["n_final"] == 2 and disjoint["n_warm"] == 4 and "disjoint" in disjoint["mode"]
    with pytest.raises(ValueError, match="sweep_seeds"):
        compare.plan_jobs([0, 1], 3, ["grpo"], [1e-4])
    assert compare.estimate_wall(60, 100, 10, 80, 2) == 5 * 60 + 40 * 100
    assert compare._parse_seeds("10") == list(range(10))
    assert compare._parse_seeds("5,") == [5] and compare._parse_seeds("3,4") == [3, 4]


def test_method_config_corrected_by_default_paper_on_request_and_budget():
    a = compare.method_config("prompt_gdro_rs", 3, config_arg="heavy_tailed,smoke", rl_prompts=100)
    b = compare.method_config(
        "rollout_gdro_sqrt", 3, config_arg="heavy_tailed,smoke", rl_prompts=100, lr=3e-4
    )
    assert (a.algorithm.name, a.gdro.prompt.apply, a.seed) == ("prompt_gdro", "resample", 3)
    assert (b.algorithm.name, b.gdro.rollout.allocator) == ("rollout_gdro", "sqrt")
    assert b.optimizer.learning_rate == 3e-4
    for section in ("classifier", "prompt", "rollout"):
        assert a.gdro[section].mode == "corrected"
    p = compare.method_config("prompt_gdro_aw", 0, config_arg="heavy_tailed,smoke", paper_gdro=True)
    assert p.gdro.prompt.mode == p.gdro.classifier.mode == "paper"
    assert p.gdro.prompt.signal == "failure_rate"
    for key in (
        "steps",
        "rollout.prompts_per_step",
        "rollout.rollouts_per_prompt",
        "eval.num_samples",
        "data.max_train_examples",
    ):
        get = lambda c: eval("c." + key)
        assert get(a) == get(b)
    assert a.data.arithmetic.heavy_tailed
    assert (
        compare.method_config("grpo", 0, config_arg="smoke", prompts_per_step=4).rollout[
            "prompts_per_step"
        ]
        == 4
    )
    with pytest.raises(ValueError, match="method"):
        compare.method_config("dpo", 0)


# ----------------------------------------------------------------------------- report from files


def _fake_runs(runs_dir, *, methods, lrs, seeds, val_best, test_best, n=16, k=8, steps=2):
    """Hand-made job files: method m at lr solves validation problems iff lr == val_best[m] and
    test problems iff lr == test_best[m] (the poison), plus half of each half otherwise."""
    from grpo_jax import writers

    rng = np.random.default_rng(0)
    val, test = compare.split_heldout(n)
    levels = np.arange(n) % 5 + 1
    P, nbar = 8, 4
    for s in seeds:
        warm = np.zeros((n, k), bool)
        warm[: n // 4] = True
        compare._save_job(
            runs_dir,
            {
                "seed": s,
                "eval": {"pass_at_8": 0.25},
                "sft": {},
                "seconds": 1.0,
                "correct": warm,
                "levels": levels,
                "oracle_p": np.zeros(0),
            },
        )
        for m in methods:
            for lr in lrs:
                c = np.zeros((2, n, k), bool)
                c[:, val[: len(val) // 2]] = True
                c[:, test[: len(test) // 2], :4] = True
                if lr == val_best[m]:
                    c[:, val] = True
                if lr == test_best[m]:
                    c[:, test] = True
                if m != "grpo":  # the method solves one more test problem's samples
                    c[:, test[-1], :2] = True
                ids = np.stack([rng.choice(32, P, replace=False) for _ in range(steps)])
                bins = np.stack([np.arange(P) % 3 for _ in range(steps)])
                alloc = [6, 2, 4] if m.startswith("rollout") else [4, 4, 4]
                nn = np.asarray(alloc)[bins]
                rows = [
                    {
                        "step": t + 1,
                        "generated_tokens": 100,
                        "pass_rate": 0.5,
                        "skipped_updates": 0,
                        "advantages/num_groups": P,
                        "advantages/num_zero_std_groups": 3,
                        "gdro/bin_share": [0.5, 0.5] + [0.0] * 8,
                        "gdro/q": [0.6, 0.4] + [0.0] * 8,
                        "gdro/weight_ess": 0.8,
                        "gdro/weight_cap_bound": t % 2,
                        "rollout_gdro/n_b": [6.0, 2.0] + [0.0] * 8,
                        "rollout_gdro/wse": 0.9,
                        "rollout_gdro/wse_uniform": 1.0,
                    }
                    for t in range(steps)
                ]
                name = compare.job_name(m, lr, s)
                with open(runs_dir / f"{name}.jsonl", "w") as f:
                    for r in rows:
                        f.write(json.dumps(writers.to_jsonable(r)) + "\n")
                compare._save_job(
                    runs_dir,
                    {
                        "method": m,
                        "seed": s,
                        "lr": lr,
                        "rows": rows,
                        "eval": {"pass_at_8": float(c[-1].any(-1).mean())},
                        "eval_summaries": [],
                        "correct": c,
                        "levels": levels,
                        "eval_steps": np.array([1, 2]),
                        "eval_tokens": np.array([100, 200]),
                        "eval_rollouts": np.array([32, 64]),
                        "eval_cpu_seconds": np.array([1.0, 2.0]),
                        "budget_spent": True,
                        "ids": ids,
                        "bins": bins,
                        "n": nn,
                        "seconds": 2.0,
                        "num_prompt_ids": 32,
                        "n_bar": nbar,
                        "rollouts": P * nbar * steps,
                        "generated_tokens": 100 * steps,
                        "updates": steps,
                        "pool_problems": [],
                    },
                )
    with open(runs_dir / "wall.json", "w") as f:
        json.dump(
            {
                "wall_seconds": 12.0,
                "workers": 1,
                "estimate_seconds": 10.0,
                "date": "2026-01-02 03:04 UTC",
                "cpus": 2,
            },
            f,
        )


def test_report_only_rebuilds_the_report_byte_for_byte(tmp_path):
    """The date and core count come from runs/wall.json (the session that ran the jobs), so
    two rebuilds from the same job files are identical, whenever they run."""
    import time

    methods, lrs, seeds = ("grpo", "rollout_gdro_sqrt"), (1e-4, 1e-3), (0, 1)
    runs_dir = tmp_path / "gdro_vs_grpo" / "runs"
    best = {"grpo": 1e-3, "rollout_gdro_sqrt": 1e-4}
    _fake_runs(runs_dir, methods=methods, lrs=lrs, seeds=seeds, val_best=best, test_best=best)
    plan = compare.ComparisonPlan(
        seeds=list(seeds),
        sweep_seeds=2,
        lrs=lrs,
        methods=methods,
        config_arg="heavy_tailed,smoke",
        steps=2,
        eval_every=1,
        last_evals=2,
        oracle_samples=0,
        n_boot=50,
    )
    out = []
    for _ in range(2):
        compare.run_comparison(plan, str(tmp_path), command="FAKE", report_only=True)
        out.append([(tmp_path / f).read_bytes() for f in ("gdro_vs_grpo.md", "gdro_vs_grpo.json")])
        time.sleep(0.01)
    assert out[0] == out[1] and b"Generated 2026-01-02 03:04 UTC" in out[0][0]


def test_report_from_hand_made_jobs_chooses_on_validation_and_reports_test(tmp_path):
    methods, lrs, seeds = ("grpo", "rollout_gdro_sqrt"), (1e-4, 1e-3), (0, 1, 2)
    runs_dir = tmp_path / "gdro_vs_grpo" / "runs"
    runs_dir.mkdir(parents=True)
    # poison: the test-best lr is the other one for both methods
    val_best = {"grpo": 1e-3, "rollout_gdro_sqrt": 1e-4}
    test_best = {"grpo": 1e-4, "rollout_gdro_sqrt": 1e-3}
    _fake_runs(
        runs_dir, methods=methods, lrs=lrs, seeds=seeds, val_best=val_best, test_best=test_best
    )
    oracle = tmp_path / "oracle.json"
    oracle.write_text(json.dumps({"p": {str(i): 0.5 if i % 3 == 0 else 0.1 for i in range(32)}}))
    plan = compare.ComparisonPlan(
        seeds=list(seeds),
        sweep_seeds=2,
        lrs=lrs,
        methods=methods,
        config_arg="heavy_tailed,smoke",
        steps=2,
        eval_every=1,
        last_evals=2,
        oracle_json=str(oracle),
        n_boot=200,
    )
    res = compare.run_comparison(plan, str(tmp_path), command="FAKE", report_only=True)
    assert {m: res["sweep"][m]["chosen"] for m in methods} == val_best
    assert res["setup"]["sweep_seeds"] == [0, 1] and res["setup"]["reuse"]
    # the headline is the chosen lr's test half: GRPO at 1e-3 (not test-best) solves half of
    # the test problems (pass) with 4 of 8 samples
    _, test = compare.split_heldout(16)
    assert res["tables"]["grpo"]["overall"]["pass_at_k"][0] == pytest.approx(4 / len(test))
    g = res["gains"]["rollout_gdro_sqrt"]["pass_at_k"]  # one more test problem solved
    assert g["gain"] == pytest.approx(1 / 4) and g["n_problems"] == len(test)
    d = res["diagnostics"]
    assert d["grpo"]["wse_true_ratio"] == pytest.approx(1.0)
    assert d["rollout_gdro_sqrt"]["wse_true_ratio"] != pytest.approx(1.0)
    assert d["rollout_gdro_sqrt"]["wse_proxy_ratio"] == pytest.approx(0.9)
    assert d["grpo"]["informative_groups"] == 5
    assert res["compute"]["grpo"] == res["compute"]["rollout_gdro_sqrt"]
    # the warm start solves problems 0-3 (every sample): test problems 1 and 3 in the top
    # stratum, the other six never solved; nothing in between
    assert res["compute_to_grpo"]["grpo"]["reached"] == 1.0  # its own final level
    assert res["compute"]["grpo"]["budget_spent"] == 1.0
    bs = res["gains_by_start"]
    assert bs["share"] == {"0": 0.75, "(0, 0.1]": 0.0, "(0.1, 0.3]": 0.0, "> 0.3": 0.25}
    assert bs["rollout_gdro_sqrt"]["(0, 0.1]"] is None
    assert set(bs["rollout_gdro_sqrt"]["0"]) == {"method", "base", "gain", "lo", "hi"}
    report = (tmp_path / "gdro_vs_grpo.md").read_text()
    for section in (
        "## Relative test pass@8 gain by the warm start's success",
        "## Compute to reach GRPO's final validation pass@8",
        "Every run spent its token budget.",
        "Regenerate: `FAKE`",
        "## Learning-rate sweep",
        # a two-lr grid brackets nothing (the pre-registrations' rule: extend it)
        "At an edge of the grid (not bracketed: a better lr may lie beyond it): GRPO, "
        "Rollout-GDRO (sqrt).",
        "## Headline: test",
        "## Equal compute",
        "## Variance diagnostics",
        "## Does this support the paper?",
        "Total wall time: 12 s",
        "estimated before the run: 0.2 min",
    ):
        assert section in report, section
    data = json.loads((tmp_path / "gdro_vs_grpo.json").read_text())
    assert data["sweep"]["grpo"]["chosen"] == 1e-3
    assert set(data["gains"]) == {"rollout_gdro_sqrt"}
    # more poison in the test half of every sweep run changes neither the choice nor, for the
    # seeds outside the sweep, anything else
    for m in methods:
        for lr in lrs:
            for s in (0, 1):
                path = runs_dir / f"{compare.job_name(m, lr, s)}.npz"
                z = dict(np.load(path))
                z["correct"][:, test] = lr != val_best[m]
                np.savez_compressed(path, **z)
    again = compare.run_comparison(plan, str(tmp_path), command="FAKE", report_only=True)
    assert {m: again["sweep"][m]["chosen"] for m in methods} == val_best
    assert again["sweep"]["grpo"]["scores"] == res["sweep"]["grpo"]["scores"]


def test_the_sweep_section_names_the_arms_chosen_at_an_edge_of_the_grid():
    from experiments.compare import report

    lrs = [1e-6, 3e-6, 1e-5]
    scores = {"grpo": (0.60, 0.62, 0.65), "rollout_gdro_sqrt": (0.60, 0.64, 0.61)}
    r = {
        "setup": {"lrs": lrs},
        "runs": {m: {} for m in scores},
        "sweep": {
            m: {
                "scores": {f"{x:.3g}": v for x, v in zip(lrs, vs)},
                "chosen": lrs[vs.index(max(vs))],
            }
            for m, vs in scores.items()
        },
        "figs": {"lr_sweep": "lr_sweep.png"},
    }
    text = "\n".join(report._section_sweep(r, lambda p: p))
    assert "| GRPO | 60.0 | 62.0 | **65.0** | 1e-05 (edge) |" in text
    assert "| Rollout-GDRO (sqrt) | 60.0 | **64.0** | 61.0 | 3e-06 |" in text
    assert "not bracketed: a better lr may lie beyond it): GRPO.\n" in text
    scores["grpo"] = (0.60, 0.66, 0.65)
    r["sweep"]["grpo"]["scores"]["3e-06"], r["sweep"]["grpo"]["chosen"] = 0.66, 3e-6
    text = "\n".join(report._section_sweep(r, lambda p: p))
    assert "(edge)" not in text and "Every chosen lr is inside the grid" in text


# ----------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_toy_comparison_sweep_selection_final_report(tmp_path):
    methods = ("grpo", "prompt_gdro_aw", "rollout_gdro_sqrt")
    plan = compare.ComparisonPlan(
        seeds=2,
        sweep_seeds=1,
        lrs=(1e-4, 1e-3),
        methods=methods,
        config_arg="heavy_tailed,smoke",
        steps=2,
        eval_every=1,
        last_evals=2,
        rl_prompts=64,
        oracle_samples=2,
        n_boot=100,
    )
    # jax_cache "": the session's (conftest.py); a path would repoint this process's cache
    res = compare.run_comparison(plan, str(tmp_path), workers=1, jax_cache="", command="TOY")
    report = (tmp_path / "gdro_vs_grpo.md").read_text()
    for section in (
        "Regenerate: `TOY`",
        "## Learning-rate sweep",
        "## Headline",
        "## Equal compute",
        "## Per difficulty level",
        "## Curriculum and allocation",
        "## Variance diagnostics",
        "## Does this support the paper?",
        "Total wall time",
    ):
        assert section in report, section
    for name in (
        "heatmap_data_share",
        "heatmap_prompt_gdro_q",
        "heatmap_rollouts_per_prompt",
        "wse_true",
        "eval_curves",
        "lr_sweep",
        "pass_at_8",
        "train_curves",
    ):
        png = tmp_path / "gdro_vs_grpo" / f"{name}.png"
        assert png.read_bytes()[:4] == b"\x89PNG", name
        assert f"gdro_vs_grpo/{name}.png" in report
    data = json.loads((tmp_path / "gdro_vs_grpo.json").read_text())
    assert set(data["gains"]) == {"prompt_gdro_aw", "rollout_gdro_sqrt"}
    assert data["k"] == 8 and data["setup"]["num_test"] == 8 and data["setup"]["num_val"] == 8
    for m in methods:
        assert data["sweep"][m]["chosen"] in (1e-4, 1e-3)
        assert set(data["sweep"][m]["scores"]) == {"0.0001", "0.001"}
        assert data["timing"]["n_jobs"][m] == 3  # 2 sweep + 1 final
        for s in ("0", "1"):
            assert data["per_run"][m][s]["lr"] == data["sweep"][m]["chosen"]
            assert [e["step"] for e in data["per_run"][m][s]["eval_summaries"]] == [1, 2]
    # equal compute: the same rollouts, tokens budget and updates for every method
    comp = data["compute"]
    assert {comp[m]["rollouts"] for m in methods} == {2 * 8 * 4}
    assert {comp[m]["updates"] for m in methods} == {2}
    for m in ("before",) + methods:
        for group, t in data["tables"][m].items():
            p, m8 = t["pass_at_k"][0], t["mean_at_k"][0]
            assert 0 <= m8 <= p <= 1, (m, group)
    # the diagnostics the controllers log, and the true WSE from the warm-start estimate
    assert "weight_ess" in data["diagnostics"]["prompt_gdro_aw"]
    assert "weight_cap_bound" in data["diagnostics"]["prompt_gdro_aw"]
    assert "wse_true" in data["diagnostics"]["grpo"]
    rows = [
        json.loads(l)
        for l in (tmp_path / "gdro_vs_grpo" / "runs" / "rollout_gdro_sqrt_lr0.0001_s1.jsonl")
        .read_text()
        .splitlines()
    ]
    if data["sweep"]["rollout_gdro_sqrt"]["chosen"] == 1e-4:
        assert [r["step"] for r in rows] == [1, 2]
    z = np.load(tmp_path / "gdro_vs_grpo" / "runs" / "rollout_gdro_sqrt_lr0.001_s0.npz")
    assert z["correct"].shape == (2, 16, 8) and z["n"].shape == (2, 8)
    assert (z["n"].sum(1) == 8 * 4).all()  # Rollout-GDRO keeps the budget R = P * n_bar
    assert res["wall_seconds"] > 0
    # the report is rebuilt from the saved per-job files without running anything
    (tmp_path / "gdro_vs_grpo.md").unlink()
    again = compare.run_comparison(plan, str(tmp_path), command="TOY", report_only=True)
    assert again["wall_seconds"] == pytest.approx(res["wall_seconds"], rel=0.05)
    assert again["sweep"] == res["sweep"]
    assert "## Headline" in (tmp_path / "gdro_vs_grpo.md").read_text()


# ----------------------------------------------------------------------------- level mixes


def test_paired_bootstrap_level_mix_by_hand():
    from grpo_jax.data.arithmetic import mix_mean

    levels = np.array([2, 2, 3, 3])
    a = np.array([[1.0, 0.0, 1.0, 1.0]])
    b = np.array([[1.0, 0.0, 0.0, 1.0]])
    w = {2: 1.0, 3: 2.0}
    g = compare.paired_bootstrap(a, b, n_boot=300, levels=levels, level_weights=w)
    # method: (1 * 0.5 + 2 * 1.0) / 3 = 5/6; base: (1 * 0.5 + 2 * 0.5) / 3 = 1/2
    assert g["mean"] == pytest.approx(5 / 6) and g["base"] == pytest.approx(1 / 2)
    assert g["mean"] == pytest.approx(mix_mean({2: 0.5, 3: 1.0}, w))
    assert g["gain"] == pytest.approx((5 / 6) / (1 / 2) - 1) and g["diff"] == pytest.approx(1 / 3)
    assert g["lo"] <= g["gain"] <= g["hi"]
    # equal weights on equal-sized levels: the pooled mean, and the same point estimates
    pooled = compare.paired_bootstrap(a, b, n_boot=300)
    mixed = compare.paired_bootstrap(a, b, n_boot=300, levels=levels, level_weights={2: 1, 3: 1})
    assert mixed["gain"] == pytest.approx(pooled["gain"]) == pytest.approx(3 / 2 - 1)
    # identical arms: a degenerate interval at 0
    same = compare.paired_bootstrap(a, a.copy(), n_boot=100, levels=levels, level_weights=w)
    assert same["gain"] == same["lo"] == same["hi"] == 0


def test_training_mix_is_the_rl_pools_level_mix_when_the_test_half_is_uniform():
    from types import SimpleNamespace

    from configs import arithmetic as arith_cfg
    from experiments.compare import cli as compare_cli

    uniform = np.repeat([2, 3, 4, 5], 3)  # the test half: equal counts per d
    # `,pool`: RL mix 0.5 / 0.05 / 0.35 / 0.1 over d = 2..5 differs from the uniform test half
    pool = arith_cfg.get_config("grpo,pool")
    tw = compare_cli._training_weights(pool, uniform)
    assert tw == pytest.approx({2: 0.5, 3: 0.05, 4: 0.35, 5: 0.1})
    # `,long`: uniform RL mix over the same d: the pooled test half is the training mix
    assert compare_cli._training_weights(arith_cfg.get_config("grpo,long"), uniform) is None
    # the train column is then the weighted per-level mean, by hand: per-level means of one seed,
    # one evaluation, one sample: d2 1.0, d3 0.0, d4 2/3, d5 1/3 (method); GRPO all 1/3 except d2
    a = np.array([1, 1, 1, 0, 0, 0, 1, 1, 0, 1, 0, 0], float)
    b = np.array([0, 1, 0, 0, 1, 0, 1, 0, 0, 0, 0, 1], float)
    ctx = SimpleNamespace(
        k=1,
        cfg0=pool,
        methods=["grpo", "m"],
        study=SimpleNamespace(hard_weights={5: 1.0}, last_evals=1, n_boot=50),
    )
    correct = {"grpo": b[None, None, :, None], "m": a[None, None, :, None]}
    mix = compare_cli._mix_gains(ctx, correct, uniform)
    assert mix["train_weights"] == pytest.approx(tw)
    want_m = 0.5 * 1 + 0.05 * 0 + 0.35 * 2 / 3 + 0.1 * 1 / 3
    want_b = 0.5 * 1 / 3 + 0.05 * 1 / 3 + 0.35 * 1 / 3 + 0.1 * 1 / 3
    got = mix["gains"]["m"]["train"]["1"]
    assert got["mean"] == pytest.approx(want_m) and got["base"] == pytest.approx(want_b)
    assert mix["gains"]["m"]["hard"]["1"]["mean"] == pytest.approx(1 / 3)  # d = 5 only
    # a testbed whose test half is the training mix keeps the pooled mean and no new key
    ctx.cfg0 = arith_cfg.get_config("grpo,long")
    pooled = compare_cli._mix_gains(ctx, correct, uniform)
    assert "train_weights" not in pooled
    assert pooled["gains"]["m"]["train"]["1"]["mean"] == pytest.approx(a.mean())


def test_per_problem_pass_at_1_and_32():
    rng = np.random.default_rng(2)
    c = rng.random((2, 5, 32)) < 0.2
    assert compare.per_problem_scores(c, "pass_at_k", pass_k=1) == pytest.approx(c.mean(-1))
    assert compare.per_problem_scores(c, "pass_at_k", pass_k=32) == pytest.approx(
        c.any(-1).astype(float)
    )
    one = np.zeros((1, 1, 32), bool)
    one[..., :2] = True  # 2 of 32 correct: pass@8 = 1 - C(30, 8) / C(32, 8) = 1 - 0.5685...
    expected = 1 - (24 * 23) / (32 * 31)  # C(30,8)/C(32,8) = (24*23)/(32*31)
    assert compare.per_problem_scores(one, "pass_at_k")[0, 0] == pytest.approx(expected)


def test_parse_level_weights_and_method_order():
    assert compare.parse_level_weights("2:1,3:2,4:3,5:4") == compare.HARD_WEIGHTS
    with pytest.raises(ValueError, match="level:weight"):
        compare.parse_level_weights("2=1")
    from experiments.compare import plan

    assert plan.ordered_methods(["rollout_gdro_sqrt", "grpo"]) == ["grpo", "rollout_gdro_sqrt"]
    with pytest.raises(ValueError, match="grpo"):
        plan.ordered_methods(["rollout_gdro_sqrt"])


def test_method_overrides_are_dotted_config_paths():
    from grpo_jax import algorithms

    for algo, over in compare.METHODS.values():
        assert algo in algorithms.names() and algo != "ppo"
        assert all(k.count(".") >= 1 for k in over)
    c = compare.method_config("grpo", 0, config_arg="heavy_tailed,smoke")
    compare.apply_overrides(c, {"gdro.prompt.eta": 2.0, "algorithm.mini_batch_size": 8})
    assert c.gdro.prompt.eta == 2.0 and c.algorithm.mini_batch_size == 8
    with pytest.raises(ValueError, match="no field 'nope'"):
        compare.apply_overrides(c, {"gdro.prompt.nope": 1})


# ----------------------------------------------------------------------------- diagnostics


def test_p_strata_and_rollouts_by_stratum_by_hand():
    p = [0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.8, 1.0, np.nan]
    assert compare.p_stratum(p).tolist() == [0, 1, 1, 2, 2, 3, 3, 4, 5, -1]
    assert compare.P_STRATA_EDGES == (0.1, 0.3, 0.7) and len(compare.P_STRATA_LABELS) == 6
    # step 0: ids 0 (p=0, n 2), 1 (p=.05, n 4), 2 (p=.5, n 6); step 1: 2 (n 8), 3 (p=1, n 4),
    # 4 (unknown p: left out)
    pool = np.array([0.0, 0.05, 0.5, 1.0, np.nan])
    got = compare.rollouts_by_stratum([[0, 1, 2], [2, 3, 4]], [[2, 4, 6], [8, 4, 4]], pool)
    np.testing.assert_allclose(got, [2, 4, np.nan, 7, np.nan, 4])


def test_expected_informative_and_controller_data_by_hand():
    exp, uni = compare.expected_informative([[0, 1]], [[2, 4]], np.array([0.5, 0.1]), 3)
    # p .5, n 2: 1 - .25 - .25 = .5; p .1, n 4: 1 - .0001 - .6561 = .3438
    assert exp == pytest.approx([0.8438]) and uni == pytest.approx([0.75 + 0.27])
    bins = np.array([[10, 10], [3, 10], [10, 10], [0, 1]])  # 10 bins: 10 = unseen
    assert compare.controller_data_share(bins, 10) == 0.5
    assert np.isnan(compare.controller_data_share(np.zeros((0, 0)), 10))
    rows = [
        {"advantages/num_groups": 8, "advantages/num_zero_std_groups": 3},
        {"advantages/num_groups": 8, "advantages/num_zero_std_groups": 8},
    ]
    assert compare.measured_informative(rows).tolist() == [5.0, 0.0]


def test_per_prompt_true_wse_vs_uniform_by_hand():
    p = np.array([0.5, 0.1])
    r = compare.true_wse([0, 1], [0, 0], [6, 2], p, 4)
    assert r["wse"] == pytest.approx((0.5 / np.sqrt(6) + 0.3 / np.sqrt(2)) / 2)  # 0.20813
    assert r["wse_uniform"] == pytest.approx((0.5 / 2 + 0.3 / 2) / 2)  # 0.2
    assert r["wse"] / r["wse_uniform"] == pytest.approx(1.04064, abs=1e-5)
    # the stratum-averaged form (one bin: sigma = sqrt(mean p(1-p)) = sqrt(.17)) is larger
    assert r["wse_bins_uniform"] == pytest.approx(np.sqrt(0.17) / 2)  # 0.2062 > 0.2
    assert r["wse_bins_uniform"] > r["wse_uniform"]


def _tiny_job(rows, **kw):
    job = {
        "ids": np.array([[0, 1], [0, 1]]),
        "bins": np.array([[10, 10], [0, 10]]),
        "n": np.array([[6, 2], [4, 4]]),
        "n_bar": 4,
        "num_bins": 10,
        "rows": rows,
    }
    return job | kw


def test_arm_diagnostics_by_hand():
    p = np.array([0.5, 0.1])
    rows = [
        {"step": 1, "pass_rate": 0.2, "advantages/num_groups": 2,
         "advantages/num_zero_std_groups": 1, "gdro/weight_ratio": 2.0, "gdro/weight_ess": 0.9},
        {"step": 2, "pass_rate": 0.4, "advantages/num_groups": 2,
         "advantages/num_zero_std_groups": 0, "gdro/weight_ratio": 4.0, "gdro/weight_ess": 0.7},
    ]  # fmt: skip
    d = compare.arm_diagnostics("prompt_gdro_aw", {0: _tiny_job(rows)}, lambda s: p)
    assert d["weight_ratio"] == pytest.approx(3.0) and d["weight_ess"] == pytest.approx(0.8)
    assert d["informative_groups"] == pytest.approx(1.5)
    assert d["controller_data_share"] == pytest.approx(0.5)  # step 2 has a seen prompt
    w0 = (0.5 / np.sqrt(6) + 0.3 / np.sqrt(2)) / 2  # step 1: n (6, 2)
    assert d["wse_true_ratio"] == pytest.approx((w0 + 0.2) / (0.2 + 0.2))
    f = lambda q, n: 1 - q**n - (1 - q) ** n
    expected = f(0.5, 6) + f(0.1, 2) + f(0.5, 4) + f(0.1, 4)
    assert d["expected_informative_ratio"] == pytest.approx(
        expected / (2 * (f(0.5, 4) + f(0.1, 4)))
    )
    # strata of p: 0.5 -> (0.3, 0.7] with n 6, 4; 0.1 -> (0, 0.1] with n 2, 4
    np.testing.assert_allclose(d["rollouts_by_stratum"], [np.nan, 3, np.nan, 5, np.nan, np.nan])
    # without the controller's weight_ratio key: NaN (the report shows a dash)
    bare = [{k: v for k, v in r.items() if k != "gdro/weight_ratio"} for r in rows]
    assert np.isnan(
        compare.arm_diagnostics("prompt_gdro_aw", {0: _tiny_job(bare)}, lambda s: p)["weight_ratio"]
    )
    g = compare.arm_diagnostics("grpo", {0: _tiny_job(rows)}, lambda s: None)
    assert "weight_ratio" not in g and "wse_true_ratio" not in g


def test_criterion_and_the_sentence():
    from experiments.compare import report

    gains = {
        "prompt_gdro_aw": {"pass_at_k": {"gain": 0.05, "lo": 0.01, "hi": 0.10}},
        "rollout_gdro_sqrt": {"pass_at_k": {"gain": 0.02, "lo": -0.01, "hi": 0.04}},
    }
    res = {"gains": gains, "pass_k": 8}
    c = report.criterion(res)
    assert c == {
        "meets": {"prompt_gdro_aw": True, "rollout_gdro_sqrt": False},
        "size": {"prompt_gdro_aw": True, "rollout_gdro_sqrt": False},  # hi = +10% reaches it
        "supports": True,
        "supports_size": True,
        "best": "prompt_gdro_aw",
        "meets_holm": {"prompt_gdro_aw": False, "rollout_gdro_sqrt": False},  # no p_le_0 given
    }
    res["criterion"] = c
    s = report.criterion_sentence(res)
    assert "supports the paper's +10% claim" in s and "+5.0% [+1.0, +10.0]" in s
    assert "size (+10%) is within" in s
    gains["prompt_gdro_aw"]["pass_at_k"]["hi"] = 0.08  # above 0, but +10% excluded
    res["criterion"] = report.criterion(res)
    assert not res["criterion"]["supports_size"] and res["criterion"]["supports"]
    s = report.criterion_sentence(res)
    assert (
        "excluded by every such interval" in s
        and "direction of the paper's claim, not its size" in s
    )
    assert "1 of 2 arms met the criterion" in s and "0 after Holm's step-down over the 2" in s
    gains["prompt_gdro_aw"]["pass_at_k"]["lo"] = -0.02
    res["criterion"] = report.criterion(res)
    assert "does not support the paper's claim" in report.criterion_sentence(res)


# ----------------------------------------------------------------------------- resume


def _fake_report_kw(tmp_path):
    methods, lrs, seeds = ("grpo", "rollout_gdro_sqrt"), (1e-4, 1e-3), (0, 1, 2)
    runs_dir = tmp_path / "gdro_vs_grpo" / "runs"
    runs_dir.mkdir(parents=True)
    best = {"grpo": 1e-3, "rollout_gdro_sqrt": 1e-4}
    _fake_runs(runs_dir, methods=methods, lrs=lrs, seeds=seeds, val_best=best, test_best=best)
    argv = [
        f"--out={tmp_path}",
        "--seeds=0,1,2",
        "--sweep_seeds=2",
        "--lrs=1e-4,1e-3",
        "--methods=grpo,rollout_gdro_sqrt",
        "--config_arg=heavy_tailed,smoke",
        "--steps=2",
        "--eval_every=1",
        "--last_evals=2",
        "--oracle_samples=0",
        "--n_boot=50",
        "--report_only",
    ]
    return runs_dir, argv


def test_preregistration_and_criterion_in_the_report(tmp_path, capsys):
    _, argv = _fake_report_kw(tmp_path)
    prereg = tmp_path / "prereg.md"
    prereg.write_text("Primary endpoint: relative test pass@8.\n\n- 20 seeds, fixed in advance.\n")
    assert compare.main(argv + [f"--preregistration={prereg}", "--criterion"]) == 0
    report = (tmp_path / "gdro_vs_grpo.md").read_text()
    head = report.index("## Pre-registered protocol and criterion")
    assert head < report.index("## Setup")
    assert prereg.read_text().strip() in report  # verbatim
    assert "--report_only" not in report and "--preregistration" in report
    # one plain sentence at the top of the results, and the per-arm criterion
    top = report.index("## Headline")
    assert "the paper's claim" in report[top : top + 600]
    assert "Rollout-GDRO (sqrt): " in report and (
        "meets the criterion" in report or ": does not." in report
    )
    data = json.loads((tmp_path / "gdro_vs_grpo.json").read_text())
    assert set(data["criterion"]["meets"]) == {"rollout_gdro_sqrt"}
    mix = data["mix_gains"]
    assert mix["ks"] == [1, 8]  # 8 samples: no pass@32
    pooled = mix["gains"]["rollout_gdro_sqrt"]["train"]["8"]
    assert pooled["gain"] == pytest.approx(data["gains"]["rollout_gdro_sqrt"]["pass_at_k"]["gain"])
    assert "hard mix pass@8" in report


def test_mismatched_settings_one_line_and_nonzero_exit(tmp_path, capsys):
    runs_dir, argv = _fake_report_kw(tmp_path)
    assert compare.main(argv) == 0  # files without recorded settings: accepted
    path = runs_dir / f"{compare.job_name('grpo', 1e-4, 1)}.json"
    meta = json.loads(path.read_text())
    meta["settings"] = {
        "method": "grpo",
        "lr": 1e-4,
        "steps": 3,
        "config_arg": "heavy_tailed,smoke",
    }
    path.write_text(json.dumps(meta))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        compare.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and "steps=3" in err[0] and "steps=2" in err[0]
    # the method's overrides are recorded and checked too
    meta["settings"] = {"steps": 2, "overrides": {"gdro.prompt.apply": "resample"}}
    path.write_text(json.dumps(meta))
    with pytest.raises(compare.SettingsMismatch, match="overrides"):
        plan = compare.ComparisonPlan(
            seeds=[0, 1, 2], sweep_seeds=2, lrs=(1e-4, 1e-3),
            methods=("grpo", "rollout_gdro_sqrt"), config_arg="heavy_tailed,smoke", steps=2,
            eval_every=1, last_evals=2, oracle_samples=0, n_boot=50,
        )  # fmt: skip
        compare.run_comparison(plan, str(tmp_path), report_only=True)
    # through `python -m`: the same line, no traceback
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "experiments.compare", *argv], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "overrides" in proc.stderr


def test_runner_stops_launching_at_the_deadline(monkeypatch):
    from experiments.compare import jobs

    clock = {"t": 0.0}
    monkeypatch.setattr(jobs.time, "perf_counter", lambda: clock["t"])

    def job(i):
        clock["t"] += 1.0  # each job takes one "second"
        return {"i": i}

    done = []
    runner = jobs.Runner(1, deadline=2.5)
    left = runner.run([(job, (i,), {}) for i in range(5)], lambda r: done.append(r["i"]))
    assert done == [0, 1, 2] and left == 2  # launched at t = 0, 1, 2; not at t = 3


def test_the_command_line_builds_the_plan_from_its_flags(tmp_path, monkeypatch):
    """Each flag sets the `ComparisonPlan` field of its name (the others keep the plan's
    defaults); the session's flags go to `run_comparison` beside it."""
    from experiments.compare import cli

    seen = {}
    monkeypatch.setattr(
        cli, "run_comparison", lambda plan, out, **kw: seen.update(plan=plan, out=out, **kw) or {}
    )
    recorded = [
        f"--out={tmp_path}",
        "--seeds=3,5",
        "--sweep_seeds=1",
        "--lrs=1e-4,1e-3",
        "--methods=grpo,rollout_gdro_sqrt",
        "--config_arg=heavy_tailed,smoke",
        "--paper_gdro",
        "--steps=2",
        "--eval_every=1",
        "--last_evals=2",
        "--oracle_samples=0",
        "--n_boot=50",
        "--hard_weights=2:1,5:3",
        "--criterion",
        "--workers=3",
    ]
    assert compare.main([*recorded, "--max_minutes=5", "--report_only"]) == 0
    assert seen.pop("plan") == compare.ComparisonPlan(
        seeds="3,5",
        sweep_seeds=1,
        lrs=[1e-4, 1e-3],
        methods=["grpo", "rollout_gdro_sqrt"],
        config_arg="heavy_tailed,smoke",
        paper_gdro=True,
        steps=2,
        eval_every=1,
        last_evals=2,
        oracle_samples=0,
        n_boot=50,
        hard_weights={2: 1.0, 5: 3.0},
        criterion=True,
    )
    assert seen == dict(
        out=str(tmp_path),
        workers=3,
        jax_cache="/tmp/grpo_jax_compare_cache",
        budget_minutes=90.0,
        max_minutes=5.0,
        report_only=True,
        command="python -m experiments.compare " + " ".join(recorded),
    )


def test_max_minutes_exits_zero_and_says_how_many_remain(tmp_path, capsys):
    argv = [
        f"--out={tmp_path}",
        "--seeds=1",
        "--sweep_seeds=1",
        "--lrs=1e-4",
        "--methods=grpo",
        "--config_arg=heavy_tailed,smoke",
        "--steps=2",
        "--eval_every=0",
        "--last_evals=1",
        "--workers=1",
        "--jax_cache=",
        "--max_minutes=1e-9",  # already past when the first job would start
    ]
    assert compare.main(argv) == 0
    out = capsys.readouterr().out
    assert "0 jobs done, 2 remaining" in out
    assert "2 jobs remain; rerun the same command to resume" in out
    assert not (tmp_path / "gdro_vs_grpo.md").exists()


def _masked(text: str) -> str:
    """The report without the lines that depend on the clock (date, wall time, job seconds)."""
    keep = []
    for line in text.split("## Timing")[0].splitlines():
        if not line.startswith("Generated "):
            keep.append(line)
    return "\n".join(keep)


@pytest.mark.slow
def test_resume_skips_finished_jobs_and_matches_an_uninterrupted_run(tmp_path, capsys):
    full = compare.ComparisonPlan(
        seeds=2,
        sweep_seeds=1,
        lrs=(1e-4, 1e-3),
        methods=("grpo", "rollout_gdro_sqrt"),
        config_arg="heavy_tailed,smoke",
        steps=4,
        eval_every=2,
        last_evals=2,
        rl_prompts=64,
        oracle_samples=2,
        n_boot=100,
    )
    # jax_cache "": the session's (conftest.py); a path would repoint this process's cache
    kw = dict(command="TOY", workers=1, jax_cache="")
    ref = compare.run_comparison(full, str(tmp_path / "ref"), **kw)
    # session 1: a subset (one lr, one seed) of the same jobs
    out = tmp_path / "resumed"
    subset = dataclasses.replace(full, seeds=1, lrs=(1e-4,))
    compare.run_comparison(subset, str(out), **kw)
    runs = out / "gdro_vs_grpo" / "runs"
    first = {p.name: p.stat().st_mtime_ns for p in runs.iterdir() if p.name != "wall.json"}
    assert "warm_s0_params.pkl" in first and "grpo_lr0.0001_s0.jsonl" in first
    capsys.readouterr()
    # session 2: the whole plan; the finished jobs are loaded, not rerun
    res = compare.run_comparison(full, str(out), **kw)
    log = capsys.readouterr().out
    assert "3 jobs done, 5 remaining" in log  # warm s0 + 2 sweep jobs done of 2 + 4 + 2
    assert log.count("this session]") == 4  # 2 sweep jobs at 1e-3 + 2 final jobs (seed 1)
    assert "seed 0: warm start" not in log  # its params came from warm_s0_params.pkl
    for name, mtime in first.items():
        assert (runs / name).stat().st_mtime_ns == mtime, name
    same = lambda x, y: (
        json.dumps(x, sort_keys=True, default=str) == json.dumps(y, sort_keys=True, default=str)
    )  # NaN-safe
    for key in ("sweep", "gains", "tables", "mix_gains", "compute"):
        assert same(res[key], ref[key]), key
    # every job's results equal the uninterrupted run's (resumed jobs ran from saved params)
    ref_runs = tmp_path / "ref" / "gdro_vs_grpo" / "runs"
    clock = ("time/", "tokens_per_s", "reward/seconds")
    for npz in sorted(ref_runs.glob("*.npz")):
        a, b = np.load(npz), np.load(runs / npz.name)
        for k in a.files:
            np.testing.assert_array_equal(a[k], b[k], err_msg=f"{npz.name} {k}")
        rows = npz.with_suffix(".jsonl")
        if rows.exists():
            strip = lambda p: [
                {k: v for k, v in json.loads(l).items() if not k.startswith(clock)}
                for l in p.read_text().splitlines()
            ]
            assert same(strip(rows), strip(runs / rows.name)), rows.name
    a = (out / "gdro_vs_grpo.md").read_text()
    b = (tmp_path / "ref" / "gdro_vs_grpo.md").read_text()
    assert _masked(a) == _masked(b)
    # a third run has nothing left to do
    compare.run_comparison(full, str(out), **kw)
    assert "8 jobs done, 0 remaining" in capsys.readouterr().out
