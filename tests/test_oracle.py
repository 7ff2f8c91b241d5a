"""Tests for experiments/oracle.py: closed forms, the greedy oracle, true WSE, the simulation."""

import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments import oracle


def test_informative_prob_closed_form():
    assert oracle.informative_prob(0.5, 2) == pytest.approx(0.5)
    assert oracle.informative_prob(0.1, 4) == pytest.approx(1 - 0.1**4 - 0.9**4)  # 0.3438
    assert oracle.informative_prob(0.1, 4) == pytest.approx(0.3438)
    np.testing.assert_allclose(oracle.informative_prob([0.0, 1.0, 0.3], [8, 8, 1]), [0, 0, 0])
    np.testing.assert_allclose(
        oracle.informative_prob(0.25, np.array([2, 3])), [2 * 0.25 * 0.75, 1 - 0.25**3 - 0.75**3]
    )


def _objective(p, n):
    return float(oracle.informative_prob(np.asarray(p), np.asarray(n)).sum())


def test_oracle_allocation_hand_example():
    # p = 0 gains nothing from rollouts: it keeps n_min, the p = 0.5 prompt takes the rest
    np.testing.assert_array_equal(oracle.oracle_allocation([0.0, 0.5], 8, 2, 6), [2, 6])
    # p = (0.05, 0.5), 9 rollouts in [2, 8], 5 above n_min. Marginal gains: p = 0.5: 1/4, 1/8,
    # 1/16, 1/32, 1/64 (rollouts 3..7); p = 0.05: 3rd 0.1425 - 0.095 = 0.0475, 4th
    # 0.18549 - 0.1425 = 0.0430. The five largest: 1/4, 1/8, 1/16, 0.0475, 0.0430 -> n = (4, 5)
    f = oracle.informative_prob(0.05, np.array([2, 3, 4]))
    np.testing.assert_allclose(np.diff(f), [0.0475, 0.0430], atol=5e-5)
    np.testing.assert_array_equal(oracle.oracle_allocation([0.05, 0.5], 9, 2, 8), [4, 5])


@pytest.mark.parametrize("seed", range(6))
def test_oracle_allocation_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    p = rng.choice([0.0, 0.02, 0.1, 0.3, 0.5, 0.8, 1.0], size=4)
    n_min, n_max, total = 2, 6, int(rng.integers(8, 25))
    n = oracle.oracle_allocation(p, total, n_min, n_max)
    assert n.sum() == total and n.min() >= n_min and n.max() <= n_max
    best = max(
        _objective(p, c)
        for c in itertools.product(range(n_min, n_max + 1), repeat=4)
        if sum(c) == total
    )
    assert _objective(p, n) == pytest.approx(best, abs=1e-12)


def test_oracle_allocation_at_least_uniform_and_budget():
    rng = np.random.default_rng(0)
    p = rng.beta(0.5, 2.0, size=64)
    n = oracle.oracle_allocation(p, 64 * 4, 2, 12)
    assert n.sum() == 256 and n.min() >= 2 and n.max() <= 12
    assert _objective(p, n) >= _objective(p, np.full(64, 4))
    with pytest.raises(ValueError, match="outside"):
        oracle.oracle_allocation(p, 64 * 13, 2, 12)


def test_true_wse_hand_example():
    p = np.array([0.5, 0.5, 0.1, 0.9])
    n = np.array([4, 4, 2, 8])
    # per prompt: sigma 0.5, 0.5, 0.3, 0.3 over sqrt(n) 2, 2, sqrt 2, sqrt 8, then the mean
    expected = (0.5 / 2 + 0.5 / 2 + 0.3 / np.sqrt(2) + 0.3 / np.sqrt(8)) / 4
    assert oracle.true_wse(p, n) == pytest.approx(expected)  # 0.20455
    assert oracle.true_wse(p, n) == pytest.approx(0.20455, abs=1e-5)
    # per prompt, not per stratum (the stratum-averaged one gave (0.5 + 0.4975) / 2 / 2 = 0.2494
    # here): {0.5, 0.55} with n 2 and 6 -> (0.5 / sqrt 2 + sqrt(0.2475) / sqrt 6) / 2
    assert oracle.true_wse([0.5, 0.55], [2, 6]) == pytest.approx(
        (0.5 / np.sqrt(2) + np.sqrt(0.55 * 0.45) / np.sqrt(6)) / 2
    )
    assert oracle.true_wse([0.5, 0.55], [2, 6]) == pytest.approx(0.27833, abs=1e-5)
    # weights: a weighted mean over prompts; all weight on the p = 0.1 prompt
    assert oracle.true_wse(p, n, weights=[0, 0, 1, 0]) == pytest.approx(0.3 / np.sqrt(2))
    assert np.isnan(oracle.true_wse(p, n, weights=[0, 0, 0, 0]))
    assert oracle.true_wse([0.0, 1.0], [4, 4]) == 0.0


def test_kish_ess():
    assert oracle.kish_ess([1, 1, 1, 1]) == pytest.approx(4)
    assert oracle.kish_ess([1, 0]) == pytest.approx(1)
    assert oracle.kish_ess([2, 1, 1]) == pytest.approx(16 / 6)
    assert oracle.kish_ess([]) == 0.0


def test_simulate_closed_form():
    """Pool = the batch (every prompt drawn each step), so the expected values are exact."""
    p = np.array([0.0, 0.0, 0.3, 0.3])
    sim = oracle.simulate(p, prompts_per_step=4, n_bar=4, steps=3, n_min=2, n_max=12)
    uni = 2 * (1 - 0.3**4 - 0.7**4)
    orc = 2 * (1 - 0.3**6 - 0.7**6)  # the p = 0 prompts keep 2, the others take 6 each
    np.testing.assert_allclose(sim["uniform"]["informative"], uni)
    np.testing.assert_allclose(sim["prompt_gdro"]["informative"], uni)
    np.testing.assert_allclose(sim["oracle"]["informative"], orc)
    wse_u = 0.5 * np.sqrt(0.21) / 2  # bin of p = 0 has sigma 0
    np.testing.assert_allclose(sim["uniform"]["wse"], wse_u)
    np.testing.assert_allclose(sim["oracle"]["wse"], 0.5 * np.sqrt(0.21) / np.sqrt(6))
    # sqrt: step 0 all unseen (n_bar each); later bins from the classifier, budget exact
    assert sim["sqrt"]["informative"][0] == pytest.approx(uni)
    assert np.all(sim["sqrt"]["informative"] <= orc + 1e-12)
    s = oracle.summarise(sim)
    assert s["oracle_gain"] == pytest.approx(orc / uni - 1)
    assert s["uniform"]["informative_gain"] == 0.0
    np.testing.assert_allclose(sim["frontier_share_drawn"], 0.5)


def test_simulate_sqrt_moves_rollouts_to_uncertain_prompts():
    """After a few visits the sqrt rule gives p(1-p)-large prompts more than n_bar."""
    p = np.array([0.0] * 8 + [0.5] * 8)
    sim = oracle.simulate(p, prompts_per_step=16, n_bar=4, steps=6, n_min=2, n_max=12)
    assert sim["sqrt"]["informative"][-1] > sim["uniform"]["informative"][-1] + 0.5
    assert np.all(np.diff(sim["uniform"]["informative"]) == 0)


@pytest.mark.slow
def test_oracle_cli_toy(tmp_path):
    res = oracle.main(
        [
            "--config=configs/arithmetic.py:grpo,frontier,smoke",
            f"--out={tmp_path}",
            "--num_samples=4",
            "--max_prompts=16",
            "--sim_steps=3",
            "--set=mesh.num_devices=1",
            f"--subset_out={tmp_path}/subset",
            "--subset_train=2",
            "--subset_eval=1",
        ]
    )
    assert (tmp_path / "oracle.md").exists()
    assert (tmp_path / "oracle" / "success_hist.png").stat().st_size > 1000
    data = json.loads((tmp_path / "oracle.json").read_text())
    assert len(data["p"]) == 16 and 0 <= data["frontier_share"] <= 1
    assert all(x * 4 == round(x * 4) for x in data["p"])  # fractions of 4 samples
    assert data["setup"]["P"] == 8 and "separate SFT pool" in data["setup"]["sft_pool"]
    s = res["summary"]
    assert s["oracle"]["informative"] >= s["uniform"]["informative"] - 1e-9
    assert "Oracle gain" in (tmp_path / "oracle.md").read_text()
    rows = [json.loads(x) for x in open(tmp_path / "subset" / "train.jsonl")]
    assert len(rows) == 2 and data["subset"]["train"] == 2 and data["subset"]["eval"] == 1
    assert all(r["oracle_p"] in data["p"] and r["problem"] and r["answer"] for r in rows)
    assert "Pre-checked subset" in (tmp_path / "oracle.md").read_text()


def test_select_subset_hand_example():
    # frontier rows: 2, 3, 4, 5 (p in [0.02, 0.5]); outside: 0, 1, 6, 7
    p = np.array([0.0, 0.0, 0.1, 0.2, 0.3, 0.5, 0.9, 1.0])
    tr, ev = oracle.select_subset(p, num_train=4, num_eval=2, frontier_share=0.5, seed=0)
    assert tr.size == 4 and ev.size == 2 and not set(tr) & set(ev)
    inside = lambda idx: int(np.sum((p[idx] >= 0.02) & (p[idx] <= 0.5)))
    assert inside(np.concatenate([tr, ev])) == 3  # round(0.5 * 6)
    assert inside(ev) == 1 and inside(tr) == 2  # split in proportion: round(3 * 2 / 6)
    # frontier share 1 with only 4 frontier rows: all 4, the other 2 from outside
    tr, ev = oracle.select_subset(p, 5, 1, frontier_share=1.0)
    assert inside(np.concatenate([tr, ev])) == 4


@given(
    st.lists(st.sampled_from([0.0, 0.01, 0.1, 0.4, 0.7, 1.0]), min_size=1, max_size=60),
    st.integers(0, 30),
    st.integers(0, 30),
    st.floats(0, 1),
    st.integers(0, 3),
)
@settings(max_examples=60, deadline=None)
def test_select_subset_sizes_disjoint_and_share(p, num_train, num_eval, share, seed):
    p = np.array(p)
    n = num_train + num_eval
    inside = (p >= 0.02) & (p <= 0.5)
    k = min(round(share * n), int(inside.sum()))
    if n - k > int((~inside).sum()):
        with pytest.raises(oracle.SubsetError, match="too few"):
            oracle.select_subset(p, num_train, num_eval, share, seed)
        return
    tr, ev = oracle.select_subset(p, num_train, num_eval, share, seed)
    both = np.concatenate([tr, ev])
    assert tr.size == num_train and ev.size == num_eval
    assert np.unique(both).size == n  # disjoint, no repeats
    assert int(inside[both].sum()) == k


def test_write_subset_reads_back_as_a_custom_table(tmp_path):
    from configs import common
    from grpo_jax.data import from_config as data_from_config

    examples = [{"problem": f"{i}+1", "answer": str(i + 1), "level": 1} for i in range(10)]
    p = np.array([0.0, 0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 1.0, 0.0, 0.25])
    info = oracle.write_subset(examples, p, str(tmp_path), num_train=4, num_eval=2, seed=1)
    assert info["train"] == 4 and info["eval"] == 2 and info["frontier_share"] == 0.5
    c = common.base_config()
    c.data.name = "custom"
    c.data.path = str(tmp_path)  # train.jsonl by the directory layout
    c.data.prompt_column, c.data.answer_column = "problem", "answer"
    c.data.level_column = "oracle_stratum"
    rows = data_from_config.load_examples(c, "custom", "train")
    assert len(rows) == 4
    for r in rows:
        i = int(r["problem"].split("+")[0])
        assert r["answer"] == str(i + 1) and r["oracle_p"] == p[i]
        want = 0 if p[i] == 0 else 1 if p[i] < 0.02 else 2 if p[i] <= 0.5 else 3 if p[i] < 1 else 4
        assert r["level"] == want  # the stratum, through level_column
    ev = [json.loads(line) for line in open(tmp_path / "test.jsonl")]
    assert len(ev) == 2 and not {e["problem"] for e in ev} & {r["problem"] for r in rows}


def test_oracle_cli_rejects_a_bad_subset_before_sampling(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        oracle.main(["--config=configs/arithmetic.py:grpo,frontier,smoke",
                     f"--subset_out={tmp_path}/s", "--subset_train=4",
                     "--subset_frontier_share=1.5"])  # fmt: skip
    assert e.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: subset:") and "1.5" in line
    assert not (tmp_path / "s").exists()
