"""The model-free GDRO simulation (experiments/simulate_gdro.py) at toy size."""

import json

import numpy as np
import pytest

from experiments import simulate_gdro

TOY = dict(num_prompts=60, prompts_per_step=8, n_bar=4)


@pytest.mark.parametrize("allocator", simulate_gdro.ALLOCATORS)
def test_simulate_shapes_and_fixed_budget(allocator):
    res = simulate_gdro.simulate(allocator, steps=6, seed=1, **TOY)
    assert res["share"].shape == (6, 10) and res["wse"].shape == (6,)
    np.testing.assert_array_equal(res["total_rollouts"], 8 * 4)  # same budget every step
    # every prompt is in a bin or (never visited before) in the classifier's unseen state
    np.testing.assert_allclose(res["share"].sum(axis=1) + res["unseen_share"], 1.0, rtol=1e-6)
    assert np.all(np.isfinite(res["mean_success"]))
    present = res["share"] > 0
    assert np.all(np.isfinite(res["rollouts"][present])) and np.all(
        np.isnan(res["rollouts"][~present])
    )
    if allocator == "prompt_gdro":
        np.testing.assert_allclose(res["q"].sum(axis=1)[1:], 1.0, rtol=1e-5)
        assert np.nanmax(res["weight"]) <= 15.0
    if allocator == "uniform":
        np.testing.assert_allclose(res["wse"], res["wse_uniform"])


def test_sqrt_allocator_lowers_the_papers_wse_proxy():
    # Neyman allocation with n_b ∝ sigma_b cannot raise sum_b share_b sigma_b / sqrt(n_b) above
    # the uniform value (Jensen), up to the variance floor and integer rounding.
    res = simulate_gdro.simulate("rollout_sqrt", steps=40, seed=0, **TOY)
    s = simulate_gdro.summarize(res)
    assert s["wse_ratio_proxy"] < 0.97


def test_run_writes_heatmaps_and_summary(tmp_path):
    out = simulate_gdro.run(3, str(tmp_path), 0, ["uniform", "rollout_sqrt"], **TOY)
    assert set(out) == {"uniform", "rollout_sqrt"}
    assert (tmp_path / "rollout_sqrt_rollouts.png").stat().st_size > 0
    assert (tmp_path / "uniform_share.png").read_bytes()[:4] == b"\x89PNG"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["summaries"]["uniform"]["wse_ratio_true"] == pytest.approx(1.0)


def test_unknown_allocator_raises():
    with pytest.raises(ValueError, match="allocator"):
        simulate_gdro.simulate("greedy", steps=1)
