"""experiments/memory.py: analytic PPO / GRPO memory breakdown and XLA's compiled figure."""

import json
import re

import jax
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments import memory
from grpo_jax.models import transformer
from grpo_jax.models.config import PRESETS

TINY = PRESETS["tiny"]  # E 64, F 128, L 2, H 4, K 2, D 16, V 128, tied, QK-norm
# Hand count for tiny: attention 64*4*16*2 + 64*2*16*2 + 2*16 (q/k norm) = 12320; layer
# 12320 + 3*64*128 + 2*64 = 37024; 2 layers + tied embedding 128*64 + final norm 64.
TINY_P = 2 * 37024 + 128 * 64 + 64  # 82304
TINY_PC = TINY_P + 64 + 1  # + value head [E] + bias


def _count(cls, cfg):
    abstract = nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0)))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.split(abstract, nnx.Param)[1]))


def test_parameter_counts_match_the_models():
    assert TINY.num_params == TINY_P
    assert memory.critic_num_params(TINY) == TINY_PC == _count(transformer.CriticModel, TINY)
    untied = TINY.replace(tie_word_embeddings=False)  # the critic has no lm_head
    assert memory.critic_num_params(untied) == _count(transformer.CriticModel, untied)
    assert _count(transformer.Transformer, untied) == untied.num_params == TINY_P + 128 * 64


def test_analytic_breakdown_hand_computed():
    r = memory.analytic_breakdown(TINY, batch_rollouts=2, prompt_len=4, completion_len=4)
    P, Pc = TINY_P, TINY_PC
    assert r["grpo"] == {
        "actor_weights": 4 * P,
        "actor_grads": 4 * P,
        "actor_adam": 8 * P,
        "reference_weights": 4 * P,
        "activations": 67984,
        "kv_cache": 4112,
    }
    assert r["ppo"]["critic_weights"] == 4 * Pc and r["ppo"]["critic_grads"] == 4 * Pc
    assert r["ppo"]["critic_adam"] == 8 * Pc
    # activations (no remat), T = 7, N = 14, a = 2: S_lin = 28 * (256 + 256 + 64 + 384) = 26880,
    # S_att = 2*4*49*6 = 2352, logits 2*14*128*2 = 7168 -> 2*(26880 + 2352) + 2352 + 7168 = 67984.
    # KV cache: 2 * L2 * R2 * S8 * K2 * D16 * 2 bytes + R*S mask bytes = 4096 + 16.
    assert r["grpo_total"] == 20 * P + 67984
    assert r["ppo_total"] == 20 * P + 16 * Pc + 67984
    assert r["saved_fraction"] == pytest.approx(16 * Pc / (20 * P + 16 * Pc + 67984))
    assert r["state_only"]["saved_fraction"] == pytest.approx(16 * Pc / (20 * P + 16 * Pc))
    remat = memory.analytic_breakdown(
        TINY.replace(remat=True), batch_rollouts=2, prompt_len=4, completion_len=4
    )
    # remat: L N E a + S_lin + 2 S_att + logits = 3584 + 26880 + 4704 + 7168
    assert remat["grpo"]["activations"] == 42336


def test_seed_figure_is_state_only_arithmetic():
    # 7.0B params, a critic as large as the actor: 7 * 36 = 252 GB vs 7 * 20 = 140 GB, 44.4%.
    cfg = PRESETS["qwen3-8b"]
    r = memory.analytic_breakdown(cfg, batch_rollouts=2, prompt_len=8, completion_len=8)
    P, Pc = cfg.num_params, memory.critic_num_params(cfg)
    assert r["state_only"]["ppo"] == 20 * P + 16 * Pc and r["state_only"]["grpo"] == 20 * P
    tied = memory.analytic_breakdown(
        PRESETS["qwen3-4b"], batch_rollouts=2, prompt_len=8, completion_len=8
    )
    assert tied["state_only"]["saved_fraction"] == pytest.approx(16 / 36, abs=1e-6)


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 64), lp=st.integers(1, 4096), lc=st.integers(1, 4096), remat=st.booleans())
def test_ppo_minus_grpo_is_the_critic_state(b, lp, lc, remat):
    cfg = PRESETS["smollm2-135m"].replace(remat=remat)
    r = memory.analytic_breakdown(cfg, batch_rollouts=b, prompt_len=lp, completion_len=lc)
    assert r["ppo_total"] - r["grpo_total"] == 16 * memory.critic_num_params(cfg)
    longer = memory.analytic_breakdown(cfg, batch_rollouts=b, prompt_len=lp, completion_len=lc + 64)
    assert longer["grpo_total"] > r["grpo_total"] and longer["saved_fraction"] < r["saved_fraction"]
    assert 0 < r["saved_fraction"] <= r["state_only"]["saved_fraction"]


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match="batch_rollouts"):
        memory.analytic_breakdown(TINY, batch_rollouts=0, prompt_len=4, completion_len=4)
    with pytest.raises(ValueError, match="batch_rollouts"):
        memory.compiled_memory(TINY, batch_rollouts=1, prompt_len=4, completion_len=4)
    with pytest.raises(ValueError, match="not a preset"):
        memory.model_config_from_arg("no-such-model")


def test_model_config_from_hf_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(PRESETS["qwen3-1.7b"].to_hf_config()))
    cfg = memory.model_config_from_arg(str(tmp_path), dtype="bfloat16", remat=True)
    assert cfg == PRESETS["qwen3-1.7b"].replace(dtype="bfloat16", remat=True)


def test_plot_bars_writes_png(tmp_path):
    r = memory.analytic_breakdown(TINY, batch_rollouts=2, prompt_len=4, completion_len=4)
    assert re.fullmatch(r"PPO [\d.]+ MB, GRPO [\d.]+ MB, saved 4[0-4]%", memory.headline(r))
    fig = memory.plot_bars(r, str(tmp_path / "one.png"))
    assert fig.axes[0].get_title().startswith("PPO ")
    r["measured"] = {"ppo_total": 2 * r["ppo_total"], "grpo_total": r["ppo_total"]}
    assert memory.headline(r).endswith("saved 50%")
    fig2 = memory.plot_bars({"a": r, "b": r}, str(tmp_path / "two.png"))
    assert len(fig2.axes) == 2
    plt.close(fig)
    plt.close(fig2)
    for name in ("one.png", "two.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:4] == b"\x89PNG" and len(data) < 200_000


@pytest.mark.slow
def test_compiled_ppo_exceeds_grpo_by_the_critic_state():
    # XLA's compiled peak (compile only) of the real jitted programs at tiny size: PPO holds the
    # critic's weights + grads + two Adam moments (float32: 4 + 4 + 8 bytes/param) on top of GRPO.
    m = memory.compiled_memory(TINY, batch_rollouts=4, prompt_len=8, completion_len=8)
    critic_state = TINY_PC * (4 + 4 + 8)
    assert m["ppo_total"] - m["grpo_total"] >= critic_state
    grpo, ppo = m["grpo"], m["ppo"]
    # resident state = weights + mu + nu (+ a few scalars: step, rng, skips, Adam counts)
    assert 0 <= grpo["resident"]["state"] - 12 * TINY_P < 64
    assert 0 <= ppo["resident"]["state"] - 12 * (TINY_P + TINY_PC) < 64
    assert grpo["resident"]["reference"] == ppo["resident"]["reference"] == 4 * TINY_P
    # the update donates the state: its outputs reuse the state's buffers
    assert grpo["phases"]["update"]["alias"] >= 12 * TINY_P
    assert set(ppo["phases"]) == {"reference_logprobs", "ppo_advantages", "update"}
    assert (
        m["ppo_total"]
        == ppo["peak"]
        == sum(ppo["resident"].values())
        + max(d["temp"] + d["output"] - d["alias"] for d in ppo["phases"].values())
    )


def test_reward_model_term_is_its_frozen_weights():
    rm = TINY.replace(num_layers=1, hidden_size=32, head_dim=8, intermediate_size=48)
    rm_p = memory.reward_model_num_params(rm)
    # the trunk (tied: the embedding once, no lm_head) + the one-label score head [E]
    assert rm_p == rm.num_params + 32
    untied = rm.replace(tie_word_embeddings=False)
    assert memory.reward_model_num_params(untied) == rm_p
    sizes = dict(batch_rollouts=2, prompt_len=4, completion_len=4)
    base = memory.analytic_breakdown(TINY, **sizes)
    r = memory.analytic_breakdown(TINY, **sizes, reward_model=rm)
    assert "reward_model_weights" not in base["grpo"]
    for algo in ("ppo", "grpo"):
        assert r[algo]["reward_model_weights"] == rm_p * 4  # float32 weights
        assert r["state_only"][algo] == base["state_only"][algo] + rm_p * 4
    assert r["grpo"]["reward_model_activations"] == memory.reward_model_activation_bytes(
        rm, **sizes, activation_bytes=4
    )
    bf16 = rm.replace(param_dtype="bfloat16", dtype="bfloat16")
    half = memory.analytic_breakdown(TINY, **sizes, reward_model=bf16)
    assert half["grpo"]["reward_model_weights"] == rm_p * 2
    assert "reward model weights" in memory.component_rows({"tiny": r})[0]


@pytest.mark.slow
def test_compiled_memory_counts_the_reward_model():
    rm = TINY.replace(num_layers=1)
    m = memory.compiled_memory(
        TINY,
        batch_rollouts=4,
        prompt_len=8,
        completion_len=8,
        algorithms=("grpo",),
        reward_model=rm,
    )["grpo"]
    assert m["resident"]["reward_model"] == 4 * memory.reward_model_num_params(rm)
    phase = m["phases"]["reward_model_score"]
    assert phase["argument"] >= m["resident"]["reward_model"] and phase["temp"] > 0
    assert m["peak"] >= sum(m["resident"].values()) + phase["extra"]
