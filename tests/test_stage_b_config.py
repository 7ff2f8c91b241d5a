"""configs/qwen3_frontier.py (Stage B of the GDRO mechanism test) reads the oracle's subset."""

import numpy as np
import pytest

from experiments import oracle
from experiments.compare import plan
from grpo_jax.data import from_config as data_from_config


@pytest.fixture
def subset(tmp_path, monkeypatch):
    rows = [{"problem": f"What is {i} + 1?", "answer": str(i + 1), "id": i} for i in range(30)]
    p = np.linspace(0.0, 1.0, 30)
    oracle.write_subset(rows, p, str(tmp_path / "subset"), num_train=12, num_eval=6)
    monkeypatch.setenv("GRPO_JAX_STAGE_B_DATA", str(tmp_path / "subset"))
    monkeypatch.setenv("GRPO_JAX_QWEN3_BASE", str(tmp_path / "no_checkpoint"))
    return p


@pytest.mark.parametrize("method", ["grpo", "prompt_gdro_eta5", "rollout_gdro_shrunk"])
def test_compare_builds_the_stage_b_arms(subset, method):
    c = plan.method_config(method, 0, config_arg="configs/qwen3_frontier.py:1.7b", lr=3e-6)
    assert c.model.preset == "qwen3-1.7b" and c.model.hf_checkpoint.endswith("no_checkpoint")
    assert c.algorithm.kl_coef == 0.001 and c.algorithm.epsilon_high == 0.28  # the paper's
    assert c.optimizer.learning_rate == 3e-6
    visits = c.steps * c.rollout.prompts_per_step / 1024
    assert visits >= 15  # the testbed rule: >= 15 visits per prompt of a 1,024-prompt pool
    assert c.rollout.rollouts_per_prompt * c.rollout.prompts_per_step > c.algorithm.mini_batch_size


def test_the_subset_loads_with_its_strata_as_levels(subset):
    from configs import qwen3_frontier

    c = qwen3_frontier.get_config("grpo")
    rows = data_from_config.load_examples(c, "custom", "train")
    held = data_from_config.load_examples(c, "custom", "test")
    assert len(rows) == 12 and len(held) == 6
    assert {r["level"] for r in rows} <= {0, 1, 2, 3, 4}
    assert sum(r["level"] == 2 for r in rows + held) == 9  # half of 18 in the frontier
    assert not {r["problem"] for r in rows} & {r["problem"] for r in held}
