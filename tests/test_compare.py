"""experiments/compare.py: the bootstrap against closed forms, and a toy end-to-end run."""

import json

import numpy as np
import pytest

from experiments import compare


def _correct(pass_rates, n=40, k=8, seeds=3, seed=0):
    """[S, N, k] where problem i has all k samples correct iff i < pass_rate * N."""
    out = np.zeros((seeds, n, k), bool)
    for s, p in enumerate(pass_rates):
        out[s, : int(round(p * n))] = True
    return out


def test_bootstrap_point_estimate_is_the_ratio_of_means():
    base = _correct([0.5, 0.5, 0.25])  # mean pass@8 = 1.25 / 3
    meth = _correct([0.75, 0.5, 0.5])  # mean pass@8 = 1.75 / 3
    g = compare.bootstrap_relative_gain(meth, base, n_boot=300)
    assert g["gain"] == pytest.approx(1.75 / 1.25 - 1)
    assert g["lo"] <= g["gain"] <= g["hi"]


def test_bootstrap_identical_methods_have_a_degenerate_interval_at_zero():
    rng = np.random.default_rng(1)
    c = rng.random((3, 30, 8)) < 0.3
    g = compare.bootstrap_relative_gain(c, c.copy(), n_boot=200)
    assert g["gain"] == 0 and g["lo"] == 0 and g["hi"] == 0


def test_bootstrap_is_paired_over_problems():
    # the method solves exactly the baseline's problems plus one: every paired replicate has
    # gain >= 0, whereas an unpaired bootstrap would often give negative values
    base = _correct([0.5, 0.5, 0.5])
    meth = base.copy()
    meth[:, 20] = True
    g = compare.bootstrap_relative_gain(meth, base, n_boot=300)
    assert g["lo"] >= 0 and g["p_le_0"] < 0.5


def test_bootstrap_rejects_bad_input():
    with pytest.raises(ValueError, match="baseline"):
        compare.bootstrap_relative_gain(np.ones((2, 3, 8), bool), np.zeros((2, 3, 8), bool))
    with pytest.raises(ValueError, match="shape|S, N, k"):
        compare.bootstrap_relative_gain(np.ones((2, 3, 8), bool), np.ones((2, 4, 8), bool))


def test_method_config_sets_the_variant_and_keeps_the_budget():
    a = compare.method_config("prompt_gdro_rs", 3, config_arg="heavy_tailed,smoke", rl_prompts=100)
    b = compare.method_config(
        "rollout_gdro_sqrt", 3, config_arg="heavy_tailed,smoke", rl_prompts=100
    )
    assert (a.algorithm.name, a.gdro.prompt.apply, a.seed) == ("prompt_gdro", "resample", 3)
    assert (b.algorithm.name, b.gdro.rollout.allocator) == ("rollout_gdro", "sqrt")
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
    with pytest.raises(ValueError, match="method"):
        compare.method_config("dpo", 0)


@pytest.mark.slow
def test_toy_comparison_writes_report_json_and_figures(tmp_path):
    methods = ("grpo", "prompt_gdro_aw", "rollout_gdro_sqrt")
    res = compare.run_comparison(
        str(tmp_path),
        seeds=(0,),
        methods=methods,
        config_arg="heavy_tailed,smoke",
        steps=2,
        rl_prompts=64,
        workers=1,
        n_boot=100,
        jax_cache=str(tmp_path / "jax_cache"),
        command="TOY",
    )
    report = (tmp_path / "gdro_vs_grpo.md").read_text()
    for section in (
        "Regenerate: `TOY`",
        "## Headline",
        "## Per difficulty level",
        "## Curriculum and allocation",
        "Weighted standard-error proxy",
        "## Does this support the paper?",
        "Total wall time",
        "bootstrap",
    ):
        assert section in report, section
    for name in (
        "heatmap_data_share",
        "heatmap_prompt_gdro_q",
        "heatmap_rollouts_per_prompt",
        "wse_proxy",
        "pass_at_8",
        "train_curves",
    ):
        png = tmp_path / "gdro_vs_grpo" / f"{name}.png"
        assert png.read_bytes()[:4] == b"\x89PNG", name
        assert f"gdro_vs_grpo/{name}.png" in report
    data = json.loads((tmp_path / "gdro_vs_grpo.json").read_text())
    assert set(data["gains"]) == {"prompt_gdro_aw", "rollout_gdro_sqrt"}
    assert data["k"] == 8
    # equal compute: same rollouts and steps for every method
    rollouts = {m: data["compute"][m]["rollouts"] for m in methods}
    assert len(set(rollouts.values())) == 1 and rollouts["grpo"] == 2 * 8 * 4
    for m in ("before",) + methods:
        for group, t in data["tables"][m].items():
            p, m8 = t["pass_at_k"][0], t["mean_at_k"][0]
            assert 0 <= m8 <= p <= 1, (m, group)  # mean@8 <= pass@8
    assert set(data["tables"]["grpo"]) == {"overall", "1", "2", "3", "4", "5"}
    for m in methods:
        assert data["per_run"][m]["0"]["eval"]["num_problems"] == 16
    rows = [
        json.loads(l)
        for l in (tmp_path / "gdro_vs_grpo" / "runs" / "rollout_gdro_sqrt_s0.jsonl")
        .read_text()
        .splitlines()
    ]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # Rollout-GDRO keeps the budget R = P * n_bar
        *counts, unseen = r["bin_counts"]  # last: never-seen prompts (in bin 0 in paper mode)
        assert unseen == 0
        assert float(np.dot(counts, r["rollout_gdro/n_b"])) == pytest.approx(8 * 4)
    assert res["wall_seconds"] > 0
    # the report is rebuilt from the saved per-job files without running anything
    (tmp_path / "gdro_vs_grpo.md").unlink()
    again = compare.run_comparison(
        str(tmp_path),
        seeds=(0,),
        methods=methods,
        config_arg="heavy_tailed,smoke",
        steps=2,
        rl_prompts=64,
        n_boot=100,
        command="TOY",
        report_only=True,
    )
    assert 0 < again["wall_seconds"] <= res["wall_seconds"]  # the original run's, from wall.json
    assert again["gains"]["rollout_gdro_sqrt"]["gain"] == res["gains"]["rollout_gdro_sqrt"]["gain"]
    assert "## Headline" in (tmp_path / "gdro_vs_grpo.md").read_text()
