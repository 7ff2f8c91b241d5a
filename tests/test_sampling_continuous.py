"""Continuous batching (`sampling.generate_continuous`): the same tokens as the static sampler at
temperature 0, the same logits for the same prefix at temperature 1, per-request budgets, and a
full decode batch while requests are pending."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from grpo_jax.models import get_preset, positions_from_mask
from grpo_jax.models.transformer import random_params
from grpo_jax.sampling import SamplingConfig, generate, generate_continuous

CFG = get_preset("tiny", vocab_size=32, tie_word_embeddings=False)
G, P = random_params(CFG, 0, stddev=0.2)  # peaky, prompt-dependent distributions
EOS = 3


def _prompts(n, width=7, seed=0):
    rng = np.random.default_rng(seed)
    toks = np.zeros((n, width), np.int32)
    mask = np.zeros((n, width), bool)
    for i in range(n):
        length = int(rng.integers(2, width + 1))
        toks[i, width - length :] = rng.integers(4, 32, length)
        mask[i, width - length :] = True
    return jnp.asarray(toks), jnp.asarray(mask)


@jax.jit
def _forward_logprobs(params, tokens, mask, temperature):
    logits, _ = nnx.merge(G, params)(tokens, positions_from_mask(mask), mask)
    lp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    return jnp.take_along_axis(lp[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]


@pytest.mark.parametrize("num_slots,group", [(1, 1), (4, 1), (5, 1), (8, 4), (24, 1)])
def test_greedy_tokens_equal_the_static_sampler(num_slots, group):
    toks, mask = _prompts(6)
    toks, mask = jnp.repeat(toks, 4, axis=0), jnp.repeat(mask, 4, axis=0)  # 24 rows, groups of 4
    cfg = SamplingConfig(
        max_new_tokens=12, temperature=0.0, eos_ids=(EOS,), prompt_group_size=group
    )
    lengths = jnp.asarray(np.random.default_rng(1).integers(1, 13, 24), jnp.int32)
    ref = generate(G, P, toks, mask, jax.random.key(0), cfg, max_lengths=lengths)
    out, st = generate_continuous(
        G, P, toks, mask, jax.random.key(0), cfg, num_slots=num_slots, max_lengths=lengths
    )
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_array_equal(out.completion_mask, ref.completion_mask)
    np.testing.assert_array_equal(out.lengths, ref.lengths)
    np.testing.assert_array_equal(out.truncated, ref.truncated)
    np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5)
    assert int(np.max(out.lengths)) <= 12 and np.all(np.asarray(out.lengths) <= np.asarray(lengths))
    # bookkeeping: every decoded token of every request is one active slot-step
    decoded = int(np.sum(np.maximum(np.asarray(out.lengths) - 1, 0)))
    assert int(st.active_slot_steps) == decoded
    assert int(st.refills) == max(0, int(np.sum(np.asarray(out.lengths) > 1)) - num_slots)


def test_sampled_logprobs_are_the_models_for_the_same_prefix():
    toks, mask = _prompts(64, seed=3)
    cfg = SamplingConfig(max_new_tokens=10, temperature=1.0, eos_ids=(EOS,))
    out, _ = generate_continuous(G, P, toks, mask, jax.random.key(7), cfg, num_slots=8)
    full_mask = jnp.concatenate([mask, out.completion_mask > 0], axis=1)
    lp = _forward_logprobs(P, out.tokens, full_mask, 1.0)[:, toks.shape[1] - 1 :]
    m = np.asarray(out.completion_mask) > 0
    np.testing.assert_allclose(np.asarray(out.logprobs)[m], np.asarray(lp)[m], atol=2e-5)
    assert m.sum() > 64 * 2  # it did decode


def test_same_distribution_as_the_static_sampler_at_temperature_one():
    # one prompt, many requests: the first two completion tokens, static vs continuous
    toks, mask = _prompts(1, seed=5)
    n = 3000
    toks, mask = jnp.repeat(toks, n, axis=0), jnp.repeat(mask, n, axis=0)
    cfg = SamplingConfig(max_new_tokens=2, temperature=1.0, eos_ids=())
    a = generate(G, P, toks, mask, jax.random.key(1), cfg)
    b, _ = generate_continuous(G, P, toks, mask, jax.random.key(2), cfg, num_slots=64)
    for j in range(2):
        ca = np.bincount(np.asarray(a.completion_tokens[:, j]), minlength=32)
        cb = np.bincount(np.asarray(b.completion_tokens[:, j]), minlength=32)
        keep = (ca + cb) > 0
        assert stats.chi2_contingency(np.stack([ca[keep], cb[keep]]))[1] > 1e-3
    # and the test can fail: another temperature is told apart
    hot = SamplingConfig(max_new_tokens=2, temperature=2.0, eos_ids=())
    c, _ = generate_continuous(G, P, toks, mask, jax.random.key(3), hot, num_slots=64)
    cc = np.bincount(np.asarray(c.completion_tokens[:, 1]), minlength=32)
    ca = np.bincount(np.asarray(a.completion_tokens[:, 1]), minlength=32)
    keep = (ca + cc) > 0
    assert stats.chi2_contingency(np.stack([ca[keep], cc[keep]]))[1] < 1e-6


def test_long_tailed_budgets_keep_the_slots_busy():
    toks, mask = _prompts(256, seed=9)
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.lognormal(2.0, 0.9, 256).astype(np.int32) + 1, 64)
    cfg = SamplingConfig(max_new_tokens=64, temperature=1.0, eos_ids=())  # no EOS: budgets end
    out, st = generate_continuous(
        G, P, toks, mask, jax.random.key(0), cfg, num_slots=16, max_lengths=lengths
    )
    np.testing.assert_array_equal(out.lengths, lengths)
    assert bool(np.all(out.truncated))
    # static batches of 16 would run sum over batches of the longest = far more slot-steps
    assert float(st.utilisation) >= 0.9
    static_steps = sum(int(lengths[i : i + 16].max()) - 1 for i in range(0, 256, 16))
    assert int(st.iterations) < static_steps


def test_bad_arguments():
    toks, mask = _prompts(4)
    cfg = SamplingConfig(max_new_tokens=4)
    with pytest.raises(ValueError, match="num_slots"):
        generate_continuous(G, P, toks, mask, jax.random.key(0), cfg, num_slots=0)
    with pytest.raises(ValueError, match="max_lengths"):
        generate_continuous(
            G, P, toks, mask, jax.random.key(0), cfg, num_slots=2, max_lengths=jnp.ones(3)
        )
    with pytest.raises(ValueError, match="multiple"):
        generate_continuous(
            G,
            P,
            toks,
            mask,
            jax.random.key(0),
            SamplingConfig(max_new_tokens=4, prompt_group_size=3),
            num_slots=2,
        )


def test_decode_loops_do_not_copy_the_slot_cache():
    from test_sampling_hlo import CFG as HCFG
    from test_sampling_hlo import IN_PLACE, LC, LP, decode_cache_traffic

    from grpo_jax.sampling import _generate_continuous

    g, p = random_params(HCFG, 0)
    requests, slots = 12, 6  # decode widths 6, 3, 1
    toks = jnp.ones((requests, LP), jnp.int32)
    mask = jnp.ones((requests, LP), bool)
    sc = SamplingConfig(max_new_tokens=LC, temperature=1.0)
    lengths = jnp.full((requests,), LC, jnp.int32)
    hlo = (
        _generate_continuous.lower(g, p, toks, mask, jax.random.key(0), lengths, sc, slots)
        .compile()
        .as_text()
    )
    for width in (6, 3):
        counts = decode_cache_traffic(
            hlo,
            rows=width,
            token_rows=requests,
            kv_heads=HCFG.num_kv_heads,
            head_dim=HCFG.head_dim,
            prompt_len=LP,
            slots=LP + LC,
            layers=HCFG.num_layers,
        )
        bad = {op: n for op, n in counts.items() if op.removeprefix("whole:") not in IN_PLACE}
        assert not bad, (width, dict(counts))
        assert not counts.get("whole:concatenate") and not counts.get("whole:broadcast"), counts


def test_training_and_evaluation_run_on_continuous_batching(tmp_path):
    from configs import arithmetic
    from grpo_jax import train, writers

    c = arithmetic.get_config("rollout_gdro,smoke")  # uneven group sizes: one row per request
    c.mesh.num_devices = 1
    c.logging.tensorboard = False
    c.steps = 2
    c.rollout.decode_slots = 8
    summary = train.train_and_evaluate(c, str(tmp_path))
    rows = writers.read_jsonl(str(tmp_path / "metrics.jsonl"))
    util = [r["decode_utilisation"] for r in rows if "decode_utilisation" in r]
    assert len(util) == 2 and all(0 < u <= 1 for u in util)
    assert 0 <= summary["eval_after"]["mean_at_1"] <= 1
