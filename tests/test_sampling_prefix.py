"""The prefix-shared decode cache (``SamplingConfig.decode_cache="prefix_shared"``): the same
rollouts as the dense cache, one prompt block per group, refused with continuous batching, and
the analytic decode reads (`sampling.decode_read_bytes`) against hand-computed values.

Reference: the dense decode (itself checked against a full-recompute decoder in
tests/test_sampling_decode.py), with the same key: tokens must match exactly and log-probs to
float rounding (the prefix-shared attention output is a sum of two products, not one).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpo_jax import config_schema, config_utils, experiment, sharding
from grpo_jax.config_schema import base_config
from grpo_jax.errors import ConfigError
from grpo_jax.models import get_preset
from grpo_jax.models.transformer import (
    DECODE_CACHES,
    PrefixDecodeCache,
    init_decode_cache,
    random_params,
)
from grpo_jax.sampling import SamplingConfig, decode_read_bytes, generate

CFG = get_preset("tiny", vocab_size=600, num_layers=2, tie_word_embeddings=False)
GD, PARAMS = random_params(CFG, 1, stddev=0.2)
# ragged prompt lengths 2, 5, 7, 3, left-padded to 7
PROMPTS = [[5, 6], [1, 2, 3, 4, 9], [3, 4, 5, 6, 7, 8, 9], [11, 12, 13]]


def _left_pad(prompts, width):
    toks = np.zeros((len(prompts), width), np.int32)
    mask = np.zeros((len(prompts), width), bool)
    for i, p in enumerate(prompts):
        toks[i, width - len(p) :] = p
        mask[i, width - len(p) :] = True
    return jnp.asarray(toks), jnp.asarray(mask)


@pytest.mark.parametrize(
    "temperature,top_k,top_p,group,buckets,budgets",
    [
        (0.0, 0, 1.0, 4, 8, False),  # greedy, groups of 4
        (1.0, 0, 1.0, 4, 8, False),  # sampled, same key
        (0.8, 5, 0.9, 2, 1, True),  # truncated sampling, one bucket, per-row budgets
        # no groups: a prompt block per row (slow: ~20-35 s on 2 busy cores, as each case)
        pytest.param(1.0, 0, 1.0, 1, 8, True, marks=pytest.mark.slow),
    ],
)
def test_prefix_shared_decode_equals_dense(temperature, top_k, top_p, group, buckets, budgets):
    prompts = [p for p in PROMPTS for _ in range(group)]
    toks, mask = _left_pad(prompts, 7)
    dense = SamplingConfig(
        max_new_tokens=40,  # 39 decode steps: 3 attention buckets (the cache grows twice)
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_ids=(7, 21),
        prompt_group_size=group,
        attention_buckets=buckets,
    )
    shared = dataclasses.replace(dense, decode_cache="prefix_shared")
    R = len(prompts)
    lengths = (
        jnp.asarray(np.random.default_rng(3).integers(1, 41, R), jnp.int32) if budgets else None
    )
    _assert_same_rollouts(GD, PARAMS, toks, mask, dense, shared, lengths, group, atol=2e-5)


def _assert_same_rollouts(graphdef, params, toks, mask, dense, shared, lengths, group, atol):
    ref = generate(graphdef, params, toks, mask, jax.random.key(5), dense, max_lengths=lengths)
    out = generate(graphdef, params, toks, mask, jax.random.key(5), shared, max_lengths=lengths)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_array_equal(out.completion_mask, ref.completion_mask)
    np.testing.assert_array_equal(out.lengths, ref.lengths)
    np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=atol)
    # the comparison is not vacuous: rows of different lengths, sampled rows differ
    assert len(set(np.asarray(ref.lengths).tolist())) > 1
    if dense.temperature > 0:  # more distinct rows than prompts (rows of one group differ)
        distinct = len({tuple(r) for r in np.asarray(ref.completion_tokens).tolist()})
        assert distinct > (len(PROMPTS) if group > 1 else 1)


@pytest.mark.slow  # ~35 s on 2 busy cores
def test_prefix_shared_decode_equals_dense_in_bfloat16():
    # bfloat16 weights and cache: the two partial products are summed in float32 and rounded
    # once (a bfloat16 sum of bfloat16 partials changed the sampled tokens)
    cfg = CFG.replace(dtype="bfloat16", param_dtype="bfloat16")
    graphdef, params = random_params(cfg, 1, stddev=0.2)
    toks, mask = _left_pad([p for p in PROMPTS for _ in range(2)], 7)
    dense = SamplingConfig(max_new_tokens=24, eos_ids=(7, 21), prompt_group_size=2)
    shared = dataclasses.replace(dense, decode_cache="prefix_shared")
    lengths = jnp.asarray(np.random.default_rng(4).integers(1, 25, 8), jnp.int32)
    _assert_same_rollouts(graphdef, params, toks, mask, dense, shared, lengths, 2, atol=1e-2)


def test_prefix_cache_holds_one_prompt_block_per_group():
    P, G, Lp = 3, 4, 7
    K, D = CFG.num_kv_heads, CFG.head_dim
    prompt = init_decode_cache(CFG, P, Lp).replace(index=jnp.asarray(Lp, jnp.int32))
    cache = PrefixDecodeCache.from_prefill(prompt, P * G, Lp + 5)
    assert len(cache.prefix_k) == CFG.num_layers
    assert cache.prefix_k[0].shape == (P, K, Lp, D)  # once per group, not P * G times
    assert cache.k[0].shape == (P * G, K, 5, D)  # each row's own completion slots
    assert int(cache.index) == 0
    grown = cache.grow(Lp + 9)
    assert grown.k[0].shape == (P * G, K, 9, D) and grown.prefix_k[0] is cache.prefix_k[0]
    with pytest.raises(ValueError, match="completion slots"):
        grown.grow(Lp + 5)
    dense = DECODE_CACHES["dense"].from_prefill(prompt.grow(Lp + 5), P * G, Lp + 5)
    assert dense.k[0].shape == (P * G, K, Lp + 5, D)  # G copies of each prompt


def test_prefix_shared_refuses_continuous_batching_and_unknown_layouts():
    with pytest.raises(ValueError, match="static batching"):
        SamplingConfig(max_new_tokens=4, decode_slots=4, decode_cache="prefix_shared")
    with pytest.raises(ValueError, match="decode_cache must be one of"):
        SamplingConfig(max_new_tokens=4, decode_cache="bogus")
    assert tuple(DECODE_CACHES) == config_utils.DECODE_CACHES
    c = base_config()
    c.rollout.decode_cache = "prefix_shared"
    config_utils.validate(c)  # static batching: accepted
    c.rollout.decode_slots = 8
    with pytest.raises(ConfigError, match="decode_slots=0"):
        config_utils.validate(c)
    c.rollout.decode_slots, c.rollout.decode_cache = 0, "bogus"
    with pytest.raises(ConfigError, match="rollout.decode_cache='bogus'"):
        config_utils.validate(c)


def test_decode_read_bytes_by_hand():
    # 1000 parameter bytes, 10 KV bytes per slot (all layers, keys and values), 8 rows in groups
    # of 4, 5-slot prompts, 3 new tokens: decode steps 1 and 2 need 5 + 1 and 5 + 2 slots
    kw = dict(param_bytes=1000, kv_bytes_per_slot=10, rows=8, group_size=4, prompt_len=5)
    # one attention bucket: both steps read 2 completion slots per row. Dense, per step:
    # 1000 + 8 rows x 5 prompt slots x 10 + 8 x 2 x 10 = 1560 bytes for 8 tokens
    dense = decode_read_bytes(**kw, new_tokens=3, layout="dense", buckets=1)
    assert dense == {"params": 125.0, "prefix": 50.0, "completion": 20.0, "total": 195.0}
    # prefix-shared, per step: 1000 + 2 groups x 5 x 10 + 8 x 2 x 10 = 1260 bytes for 8 tokens
    shared = decode_read_bytes(**kw, new_tokens=3, layout="prefix_shared", buckets=1)
    assert shared == {"params": 125.0, "prefix": 12.5, "completion": 20.0, "total": 157.5}
    # exactly the filled slots (buckets=None): 1 then 2 completion slots, 1.5 on average
    exact = decode_read_bytes(**kw, new_tokens=3, layout="prefix_shared", buckets=None)
    assert exact == {"params": 125.0, "prefix": 12.5, "completion": 15.0, "total": 152.5}
    exact = decode_read_bytes(**kw, new_tokens=3, layout="dense", buckets=None)
    assert exact == {"params": 125.0, "prefix": 50.0, "completion": 15.0, "total": 190.0}
    # the sampler's own buckets: Lp 5, Lc 40, 8 buckets -> chunks ending at 13, 26, 39
    # completion slots (13 steps each); mean over the 39 steps = (13 + 26 + 39) / 3 = 26
    long = decode_read_bytes(**kw, new_tokens=40, layout="prefix_shared")
    assert long["completion"] == pytest.approx(260.0)
    # measured lengths 3, 1, 2, 2 | 3, 3, 1, 1: the loop still runs 2 steps over all 8 rows
    # (1560 / 1260 bytes each, as above) but decodes 2 + 0 + 1 + 1 + 2 + 2 + 0 + 0 = 8 tokens
    lengths = [3, 1, 2, 2, 3, 3, 1, 1]
    dense = decode_read_bytes(**kw, new_tokens=3, layout="dense", buckets=1, lengths=lengths)
    assert dense == {"params": 250.0, "prefix": 100.0, "completion": 40.0, "total": 390.0}
    shared = decode_read_bytes(**kw, new_tokens=3, layout="prefix_shared", lengths=lengths)
    assert shared == {"params": 250.0, "prefix": 25.0, "completion": 40.0, "total": 315.0}
    with pytest.raises(ValueError, match="lengths"):
        decode_read_bytes(**kw, new_tokens=3, lengths=[4] * 8)
    with pytest.raises(ValueError, match="no decode step"):
        decode_read_bytes(**kw, new_tokens=3, lengths=[1] * 8)
    with pytest.raises(ValueError, match="group_size"):
        decode_read_bytes(**{**kw, "group_size": 3}, new_tokens=3, layout="dense")
    with pytest.raises(ValueError, match="layout"):
        decode_read_bytes(**kw, new_tokens=3, layout="bogus")


def test_prefix_shared_decode_on_a_data_fsdp_mesh():
    # 4 groups of 2 rows over a 2 x 2 data x fsdp mesh (rows pinned to it per layer by
    # `sharding.constrain_batch`): the rollouts of the unsharded dense decode
    devices = jax.devices()
    if len(devices) < 4:
        pytest.skip("needs 4 devices (conftest sets 8 virtual CPU devices)")
    mesh = Mesh(np.asarray(devices[:4]).reshape(2, 2), ("data", "fsdp"))
    toks, mask = _left_pad([p for p in PROMPTS for _ in range(2)], 7)
    cfg = SamplingConfig(max_new_tokens=6, temperature=0.0, prompt_group_size=2)
    ref = generate(GD, PARAMS, toks, mask, jax.random.key(0), cfg)
    rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    params = jax.device_put(PARAMS, NamedSharding(mesh, PartitionSpec()))
    run = sharding.under_mesh(mesh, generate)
    out = run(
        GD,
        params,
        jax.device_put(toks, rows),
        jax.device_put(mask, rows),
        jax.random.key(0),
        dataclasses.replace(cfg, decode_cache="prefix_shared"),
    )
    np.testing.assert_array_equal(out.completion_tokens, ref.completion_tokens)
    np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=2e-5)
    assert len(out.completion_tokens.sharding.device_set) == 4


def test_run_config_reaches_both_samplers():
    c = base_config()
    c.rollout.decode_cache = "prefix_shared"
    train, evaluation = experiment._sampling_configs(config_schema.typed(c), None, 4)
    assert (train.decode_cache, evaluation.decode_cache) == ("prefix_shared", "prefix_shared")
    assert train.prompt_group_size == 4
    assert (
        experiment._sampling_configs(config_schema.typed(base_config()), None, 1)[0].decode_cache
        == "dense"
    )


@pytest.mark.slow  # ~100 s on 2 busy cores: two runs' steps compiled
def test_rl_steps_with_the_prefix_shared_cache_equal_the_dense_ones():
    # two RL steps of the smoke default with each group's prompt computed once: the rollouts
    # (texts of the logged samples, lengths, rewards) are those of the dense decode, the losses
    # equal up to float rounding (without a warm start most rewards are -1: the rollouts carry
    # the comparison)
    from test_train import smoke_config

    from grpo_jax import steps, train
    from grpo_jax.experiment import build_experiment

    rows = {}
    for cache in ("dense", "prefix_shared"):
        cfg = smoke_config(
            "grpo", **{"algorithm.shared_prompt_forward": True, "rollout.decode_cache": cache}
        )
        exp = build_experiment(cfg)
        try:
            assert exp.train_sampling.decode_cache == cache
            assert exp.train_sampling.prompt_group_size == cfg.rollout.rollouts_per_prompt
            run, _ = steps.init_run(exp, warm_start=False)
            fns, source = steps.make_steps(exp), exp.make_source()
            rows[cache] = []
            for _ in range(2):
                result = train.rl_step(exp, fns, run, source)
                run = result.run
                rows[cache].append(result.row)
        finally:
            exp.close()
    for a, b in zip(rows["dense"], rows["prefix_shared"], strict=True):
        for key in ("reward_mean", "completion_length", "truncated_fraction", "generated_tokens"):
            assert a[key] == b[key], key
        assert [x["completion"] for x in a["samples"]] == [x["completion"] for x in b["samples"]]
        assert len({x["completion"] for x in a["samples"]}) > 1
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
