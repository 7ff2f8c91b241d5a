"""Multi-turn episodes (grpo_jax/envs, issue 44): a scripted sampler and environment give
episodes equal to hand-built ones, the loss mask covers exactly the policy's tokens, and the
real sampler's turns equal direct sampler calls on the hand-built contexts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax import envs, sampling
from grpo_jax.envs.episodes import run_episodes, stop_token_ids
from grpo_jax.envs.tools import calculate
from grpo_jax.models import get_preset
from grpo_jax.models.tokenizer import CharTokenizer
from grpo_jax.models.transformer import random_params

TOK = CharTokenizer()
EOS = "\x00"  # stands for the end-of-text token in the scripts below


def _ids(text: str) -> list[int]:
    return [TOK.eos_id if c == EOS else TOK.encode(c)[0] for c in text]


class ScriptedSampler:
    """Plays each row's scripted turns (at most 6 tokens each), checking the context it is given is the prompt, the
    earlier turns and the observations, left-padded to the fixed width."""

    def __init__(self, prompts, scripts, observations, width):
        self.prompts, self.scripts, self.obs, self.width = prompts, scripts, observations, width
        self.turn, self.calls = 0, []

    def __call__(self, tokens, mask, key, max_lengths):
        tokens, mask = np.asarray(tokens), np.asarray(mask)
        assert tokens.shape == mask.shape == (len(self.prompts), self.width)
        T = 6
        out = np.zeros((len(self.prompts), T), np.int32)
        lens = np.zeros(len(self.prompts), np.int32)
        for i, script in enumerate(self.scripts):
            if self.turn >= len(script):
                continue
            before = "".join(s + o for s, o in zip(script[: self.turn], self.obs[i]))
            want = _ids(self.prompts[i] + before)
            assert tokens[i][mask[i]].tolist() == want, (i, self.turn)
            ids = _ids(script[self.turn])[: int(max_lengths[i])]
            out[i, : len(ids)], lens[i] = ids, len(ids)
        self.calls.append(max_lengths.tolist())
        self.turn += 1
        lp = -0.5 * (out > 0)
        return sampling.Rollouts(
            tokens=None,
            completion_tokens=out,
            completion_mask=(np.arange(T)[None] < lens[:, None]).astype(np.float32),
            logprobs=lp * (np.arange(T)[None] < lens[:, None]),
            lengths=lens,
            truncated=np.zeros(len(lens), bool),
        )


def _prompts(texts, width):
    ids = [_ids(t) for t in texts]
    tokens = np.zeros((len(ids), width), np.int32)
    mask = np.zeros((len(ids), width), bool)
    for i, r in enumerate(ids):
        tokens[i, width - len(r) :], mask[i, width - len(r) :] = r, True
    return tokens, mask


def test_scripted_episodes_equal_hand_built_ones_and_the_loss_mask_is_the_policys_tokens():
    prompts = ["2+3=", "7=", "9*9=", "1+1="]
    # per row: the policy's turns (the sampler's output)
    scripts = [["(2+3)", "5" + EOS], ["7" + EOS], ["(9*9)", "(81)"], ["(1+1)", "22"]]
    obs = [["=5"], [], ["=81"], ["=2"]]
    budget, Lp = 12, 5
    tokens, mask = _prompts(prompts, Lp)
    sampler = ScriptedSampler(prompts, scripts, obs, Lp + budget)
    env = envs.make_environment("calculator", max_turns=2)
    ep = run_episodes(
        sampler, TOK, env, tokens, mask, [{}] * 4, jax.random.key(0), budget=budget, turn_tokens=6
    )
    # hand-built: turn 1 | observation | turn 2, policy tokens marked P, observations O
    rows = [
        ("(2+3)", "=5", "5" + EOS),
        ("7" + EOS, "", ""),
        ("(9*9)", "=81", "(81)"),
        ("(1+1)", "=2", "22"),
    ]
    for i, (t1, o, t2) in enumerate(rows):
        want = _ids(t1 + o + t2)
        n = len(want)
        assert ep.completion_tokens[i, :n].tolist() == want
        assert (ep.completion_tokens[i, n:] == TOK.pad_id).all()
        assert ep.policy_mask[i].tolist() == [1.0] * len(t1) + [0.0] * len(o) + [1.0] * len(t2) + [
            0.0
        ] * (budget - n)
        assert ep.present_mask[i].tolist() == [1.0] * n + [0.0] * (budget - n)
        assert ep.logprobs[i].tolist() == [-0.5] * len(t1) + [0.0] * len(o) + [-0.5] * len(t2) + [
            0.0
        ] * (budget - n)
        assert ep.lengths[i] == n
    assert ep.turns.tolist() == [2, 1, 2, 2]
    assert ep.tool_calls.tolist() == [1, 0, 1, 1]
    # ended with end of text: rows 0, 1; row 2 stopped for a tool on its last turn; row 3 ran out
    assert ep.truncated.tolist() == [False, False, True, True]
    assert ep.texts == ("5", "7", "(81)", "22")  # the last policy turn is what is scored
    # each turn's budget: min(turn tokens, what the episode has left)
    assert sampler.calls == [[6, 6, 6, 6], [5, 6, 4, 5]]


def test_the_episode_budget_cuts_turns_and_observations():
    prompts, scripts, obs = ["5*5="], [["(5*5)", "25" + EOS]], [["=25"]]
    tokens, mask = _prompts(prompts, 4)
    sampler = ScriptedSampler(prompts, scripts, obs, 4 + 7)
    env = envs.make_environment("calculator", max_turns=3)
    ep = run_episodes(
        sampler, TOK, env, tokens, mask, [{}], jax.random.key(0), budget=7, turn_tokens=6
    )
    assert ep.completion_tokens[0].tolist() == _ids("(5*5)=2")  # the observation cut at 7 tokens
    assert ep.policy_mask[0].tolist() == [1.0] * 5 + [0.0] * 2
    assert ep.truncated.tolist() == [True] and ep.turns.tolist() == [1]


def test_a_stop_string_must_be_one_token():
    class Bad(envs.Environment):
        stop_strings = ("</calc>",)

    with pytest.raises(ValueError, match="'</calc>' is 7 tokens"):
        stop_token_ids(TOK, Bad())
    assert stop_token_ids(TOK, envs.make_environment("calculator")) == (TOK.encode(")")[0],)


def test_unknown_environment_is_one_line():
    with pytest.raises(ValueError, match="not a registered environment"):
        envs.make_environment("nope")


def test_the_calculator_evaluates_integer_arithmetic_only():
    assert [calculate(x) for x in ("123+456", "2*3-4", " 7 ", "-3*3")] == ["579", "2", "7", "-9"]
    assert {calculate(x) for x in ("1/2", "__import__('os')", "2**10", "9" * 30 + "*2", "(")} == {
        "error"
    }


def test_the_python_environment_runs_the_turns_code_in_the_sandbox():
    env = envs.make_environment("python", cpu_seconds=1, wall_seconds=5)
    step = env.step(None, "let me compute\n```python\nprint(6 * 7)\n```\n")
    assert step.observation == "```output\n42\n```\n" and not step.done
    crash = env.step(None, "```python\n1/0\n```\n")
    assert crash.observation == "```output\nZeroDivisionError: division by zero\n```\n"


def test_real_sampler_turns_equal_direct_calls_on_the_hand_built_contexts():
    """The engine on the tiny model's sampler (greedy): turn 2 of every row equals one sampler
    call on the prompt + turn 1 + observation, built by hand."""
    cfg = get_preset("tiny", vocab_size=TOK.vocab_size, tie_word_embeddings=False)
    graphdef, params = random_params(cfg, 3, stddev=0.2)  # seed 3: half the rows call the tool
    env = envs.make_environment("calculator", max_turns=2)
    stops = stop_token_ids(TOK, env)
    sc = sampling.SamplingConfig(
        max_new_tokens=5, temperature=0.0, eos_ids=(TOK.eos_id, *stops), pad_id=0
    )

    def generate(tokens, mask, key, max_lengths):
        return sampling.generate(
            graphdef, params, jnp.asarray(tokens), jnp.asarray(mask), key, sc, max_lengths
        )

    prompts = ["12+3=", "4*5=", "99-1="]
    tokens, mask = _prompts(prompts, 6)
    key = jax.random.key(1)
    ep = run_episodes(generate, TOK, env, tokens, mask, [{}] * 3, key, budget=12, turn_tokens=5)
    first = generate(
        *_prompts(prompts, 6 + 12), jax.random.fold_in(key, 0), np.full(3, 5, np.int32)
    )
    for i, p in enumerate(prompts):
        n1 = int(first.lengths[i])
        t1 = [int(x) for x in np.asarray(first.completion_tokens[i, :n1])]
        assert ep.completion_tokens[i, :n1].tolist() == t1
        if t1[-1] not in stops:
            assert ep.turns[i] == 1
            continue
        o = _ids(envs.make_environment("calculator").step(None, TOK.decode(t1)).observation)
        ctx = _ids(p) + t1 + o
        room = 12 - n1 - len(o)
        second = generate(
            *_prompts([TOK.decode(ctx)], 18),
            jax.random.fold_in(key, 1),
            np.full(1, min(5, room), np.int32),
        )
        n2 = int(second.lengths[0])
        assert (
            ep.completion_tokens[i, n1 + len(o) : n1 + len(o) + n2].tolist()
            == np.asarray(second.completion_tokens[0, :n2]).tolist()
        )


def test_a_training_step_trains_on_the_policys_tokens_and_attends_to_the_observations():
    """config.env.name: the step's rollouts are episodes; the batch's loss mask is the policy's
    tokens (observations excluded), its attention mask the prompt and every episode token;
    the metrics row counts turns and tool calls."""
    from configs import arithmetic
    from grpo_jax import steps, train
    from grpo_jax.experiment import build_experiment

    c = arithmetic.get_config("grpo,smoke")
    c.mesh.num_devices = 1
    c.logging.tensorboard = False
    c.sft.steps = 0
    c.rollout.max_new_tokens, c.env.name, c.env.turn_tokens = 12, "calculator", 6
    exp = build_experiment(c)
    try:
        assert exp.turn_sampling.max_new_tokens == 6
        assert exp.turn_sampling.eos_ids == (TOK.eos_id, TOK.encode(")")[0])
        run, _ = steps.init_run(exp, warm_start=False)
        params = jax.tree.map(lambda x: x * 8.0, run.train.params)  # peaky: some turns stop at ")"
        run = run.replace(train=run.train.replace(params=params))
        fns = steps.make_steps(exp)
        rd = train.sample_round(exp, fns, run, exp.make_source(), jax.random.key(5))
        ro = rd.rollouts
        present, policy = np.asarray(ro.completion_mask), np.asarray(ro.loss_mask)
        assert rd.env_stats["tool_calls"] > 0 and (policy <= present).all()
        assert (policy < present).any()  # some observation tokens are attended, not trained
        attention, loss = fns.masks(rd.prompt_mask, ro.completion_mask, ro.truncated, ro.loss_mask)
        np.testing.assert_array_equal(np.asarray(loss), policy)
        np.testing.assert_array_equal(
            np.asarray(attention), np.concatenate([np.asarray(rd.prompt_mask), present > 0], 1)
        )
        batch = train._batch(exp, fns, run, rd)[0]
        np.testing.assert_array_equal(np.asarray(batch.completion_mask), policy)
        row = train._metrics_row(
            exp, [rd], rd, {"skipped_updates": 0}, _summary(), {}, {"generate": 1.0}
        )
        assert row["env/tool_calls_mean"] == rd.env_stats["tool_calls"] / len(rd.rows)
    finally:
        exp.close()


def _summary():
    return {
        "truncated_fraction": 0.0,
        "entropy": 1.0,
        "advantage_abs_mean": 0.0,
        "sample_weight_max": 1.0,
        "consecutive_skips": 0,
        "advantages": {},
    }


def test_the_warm_start_learns_the_calculators_demonstration_but_not_its_output():
    from configs import arithmetic
    from grpo_jax.experiment import build_experiment

    c = arithmetic.get_config("grpo,calculator,smoke")
    c.mesh.num_devices = 1
    exp = build_experiment(c)
    try:
        tokens, mask, target = exp.sft_data()
        Lp = exp.prompt_len
        ex = exp.pool.examples[0]
        value = calculate(ex["problem"])
        text = f"({ex['problem']})={value}{ex['answer']}"
        n = len(text) + 1
        assert tokens[0, Lp : Lp + n].tolist() == _ids(text + EOS)
        call = len(ex["problem"]) + 2
        want = [1.0] * call + [0.0] * (1 + len(value)) + [1.0] * (len(str(ex["answer"])) + 1)
        assert target[0, Lp : Lp + n].tolist() == want
        assert mask[0, Lp : Lp + n].all() and not target[0, :Lp].any()
    finally:
        exp.close()
