"""Sampler: distribution statistics, truncation rules, EOS/masks, batching, log-probs, sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from scipy import stats

from grpo_jax.models import get_preset, positions_from_mask
from grpo_jax.models.transformer import random_params
from grpo_jax.sampling import Rollouts, SamplingConfig, _generate, generate, sample_logits

CFG = get_preset("tiny", vocab_size=32, tie_word_embeddings=False)
G, P = random_params(CFG, 0, stddev=0.2)  # stddev 0.2: peaky, prompt-dependent distributions

# three prompts of lengths 2, 5, 7, left-padded to 7 (pad id 0)
PROMPTS = [[5, 6], [1, 2, 3, 4, 9], [3, 4, 5, 6, 7, 8, 9]]


def _left_pad(prompts, width, pad=0):
    toks = np.full((len(prompts), width), pad, np.int32)
    mask = np.zeros((len(prompts), width), bool)
    for i, p in enumerate(prompts):
        toks[i, width - len(p) :] = p
        mask[i, width - len(p) :] = True
    return jnp.asarray(toks), jnp.asarray(mask)


@jax.jit
def _forward(params, tokens, mask):
    logits, _ = nnx.merge(G, params)(tokens, positions_from_mask(mask), mask)
    return logits.astype(jnp.float32)


def _chi2_pvalue(counts, probs):
    """Pearson chi-square goodness of fit, pooling cells with expected count < 5."""
    n = counts.sum()
    expected = probs * n
    order = np.argsort(expected)
    small = order[np.cumsum(expected[order]) < 5]
    keep = np.setdiff1d(np.arange(len(probs)), small)
    obs = np.append(counts[keep], counts[small].sum())
    exp = np.append(expected[keep], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


# ----------------------------------------------------------------- sample_logits (one step)
PROBS4 = np.array([0.5, 0.3, 0.15, 0.05])


def _draw(logits, config, n=20000, seed=0):
    logits = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (n, len(logits)))
    tok, lp = jax.jit(sample_logits, static_argnums=2)(logits, jax.random.key(seed), config)
    return np.asarray(tok), np.asarray(lp)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sample_frequencies_match_softmax(temperature):
    logits = np.array([1.0, 0.0, -1.0, 2.0, 0.5, -3.0])
    tok, lp = _draw(logits, SamplingConfig(max_new_tokens=1, temperature=temperature))
    probs = np.exp(logits / temperature) / np.exp(logits / temperature).sum()
    counts = np.bincount(tok, minlength=6)
    assert _chi2_pvalue(counts, probs) > 1e-3
    # logprob = log_softmax(logits / T)[token]
    np.testing.assert_allclose(lp, np.log(probs)[tok], rtol=1e-5)
    # a wrong temperature is detected by the same test (the test can fail)
    wrong = np.exp(logits) / np.exp(logits).sum()
    if temperature != 1.0:
        assert _chi2_pvalue(counts, wrong) < 1e-6


@pytest.mark.parametrize(
    "top_p,support",
    [
        (0.0, [0]),
        (0.4, [0]),
        (0.6, [0, 1]),
        (0.79, [0, 1]),
        (0.81, [0, 1, 2]),
        (0.9, [0, 1, 2]),
        (0.97, [0, 1, 2, 3]),
    ],
)
def test_top_p_keeps_the_crossing_token(top_p, support):
    logits = np.log(PROBS4)[[2, 0, 3, 1]]  # shuffled: the sampler must sort
    perm = np.array([2, 0, 3, 1])  # position j holds PROBS4[perm[j]]
    tok, lp = _draw(logits, SamplingConfig(max_new_tokens=1, top_p=top_p))
    rank = perm[tok]  # rank of the sampled token in PROBS4 order
    assert sorted(set(rank.tolist())) == support
    kept = PROBS4[support] / PROBS4[support].sum()
    if len(support) > 1:
        assert _chi2_pvalue(np.bincount(rank, minlength=4)[support], kept) > 1e-3
    # logprobs are of the untruncated distribution
    np.testing.assert_allclose(lp, np.log(PROBS4[rank]), rtol=1e-5)


def test_top_k_keeps_exactly_k_and_composes_with_top_p():
    logits = np.array([0.3, 2.0, -1.0, 1.5, 0.0, 1.0, -2.0, 0.9])
    order = np.argsort(-logits)
    for k in (1, 3, 5):
        tok, _ = _draw(logits, SamplingConfig(max_new_tokens=1, top_k=k))
        assert set(tok.tolist()) == set(order[:k].tolist())
        p = np.exp(logits[order[:k]]) / np.exp(logits[order[:k]]).sum()
        if k > 1:
            assert _chi2_pvalue(np.bincount(tok, minlength=8)[order[:k]], p) > 1e-3
    # top-k 5, then top-p 0.6 on the renormalised top-5 distribution
    p5 = np.exp(logits[order[:5]]) / np.exp(logits[order[:5]]).sum()
    n_keep = int(np.sum(np.cumsum(p5) - p5 < 0.6))
    tok, _ = _draw(logits, SamplingConfig(max_new_tokens=1, top_k=5, top_p=0.6))
    assert set(tok.tolist()) == set(order[:n_keep].tolist())


@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    top_k=st.integers(0, 8),
    top_p=st.floats(0.0, 1.0),
    temperature=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
)
def test_sampled_token_always_in_reference_kept_set(seed, top_k, top_p, temperature):
    logits = np.random.default_rng(seed).normal(0, 2, (4, 8)).astype(np.float32)
    cfg = SamplingConfig(max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p)
    tok, lp = sample_logits(jnp.asarray(logits), jax.random.key(seed), cfg)
    t = temperature if temperature > 0 else 1.0
    logp = logits / t - np.log(np.exp(logits / t).sum(-1, keepdims=True))
    for r in range(4):
        order = np.argsort(-logits[r], kind="stable")
        if temperature == 0:
            kept = order[:1]
        else:
            kept = order[:top_k] if 0 < top_k < 8 else order
            p = np.exp(logp[r, kept] - logp[r, kept].max())
            p /= p.sum()
            kept = kept[: max(1, int(np.sum(np.cumsum(p) - p < top_p)))] if top_p < 1 else kept
        assert int(tok[r]) in kept.tolist()
        np.testing.assert_allclose(lp[r], logp[r, tok[r]], rtol=1e-4, atol=1e-5)


def test_sampling_config_validation():
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(max_new_tokens=4, temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(max_new_tokens=4, top_p=1.5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingConfig(max_new_tokens=0)
    hash(SamplingConfig(max_new_tokens=4, eos_ids=[1, 2]))  # static jit argument


# ----------------------------------------------------------------- generate (end to end)
def test_generate_first_token_frequencies_match_model_softmax():
    R = 4000
    toks, mask = _left_pad([[1, 2, 3, 4, 9]] * R, 5)
    out = generate(G, P, toks, mask, jax.random.key(3), SamplingConfig(max_new_tokens=1))
    probs = np.asarray(jax.nn.softmax(_forward(P, toks[:1], mask[:1])[0, -1]))
    counts = np.bincount(np.asarray(out.completion_tokens[:, 0]), minlength=CFG.vocab_size)
    assert _chi2_pvalue(counts, probs) > 1e-3
    # and not the softmax of another prompt's next-token distribution
    other = np.asarray(jax.nn.softmax(_forward(P, toks[:1, 1:], mask[:1, 1:])[0, -1]))
    assert _chi2_pvalue(counts, other) < 1e-6


def test_batched_greedy_equals_each_prompt_alone():
    cfg = SamplingConfig(max_new_tokens=8, temperature=0.0)
    toks, mask = _left_pad(PROMPTS, 7)
    batched = generate(G, P, toks, mask, jax.random.key(0), cfg)
    assert batched.tokens.shape == (3, 15) and batched.completion_tokens.shape == (3, 8)
    for i, p in enumerate(PROMPTS[:2]):  # (the third prompt has no padding)
        alone = generate(
            G, P, jnp.asarray([p], jnp.int32), jnp.ones((1, len(p)), bool), jax.random.key(0), cfg
        )
        np.testing.assert_array_equal(batched.completion_tokens[i], alone.completion_tokens[0])
        np.testing.assert_allclose(batched.logprobs[i], alone.logprobs[0], atol=1e-5)
    # greedy = argmax of a full forward pass over prompt + completion at every step
    full_mask = jnp.concatenate([mask, jnp.ones((3, 8), bool)], axis=1)
    logits = _forward(P, batched.tokens, full_mask)
    np.testing.assert_array_equal(jnp.argmax(logits[:, 6:-1], -1), batched.completion_tokens)
    assert len({tuple(r) for r in np.asarray(batched.completion_tokens).tolist()}) == 3


def test_prefill_once_per_group_gives_the_same_rollouts():
    # rows in groups of 4 identical prompts: prefilling one row per group and copying its cache
    # samples the same tokens (same keys) with the same log-probs as prefilling every row
    toks, mask = _left_pad(PROMPTS, 7)
    toks, mask = jnp.repeat(toks, 4, axis=0), jnp.repeat(mask, 4, axis=0)
    plain = SamplingConfig(max_new_tokens=6, temperature=1.0, eos_ids=(3,))
    shared = SamplingConfig(max_new_tokens=6, temperature=1.0, eos_ids=(3,), prompt_group_size=4)
    a = generate(G, P, toks, mask, jax.random.key(7), plain)
    b = generate(G, P, toks, mask, jax.random.key(7), shared)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.completion_mask, b.completion_mask)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert len({tuple(r) for r in np.asarray(b.completion_tokens).tolist()}) > 3  # rows differ
    with pytest.raises(ValueError, match="prompt_group_size"):
        generate(G, P, toks[:10], mask[:10], jax.random.key(7), shared)
    with pytest.raises(ValueError, match="prompt_group_size"):
        SamplingConfig(max_new_tokens=6, prompt_group_size=0)


def _token_logprobs(logits, tokens, temperature):
    try:
        from grpo_jax.logprobs import token_logprobs

        return token_logprobs(logits, tokens, temperature)
    except ImportError:
        lp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32) / temperature, -1)
        return jnp.take_along_axis(lp, tokens[:, 1:, None], -1)[..., 0]


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.8, 5, 0.9), (0.0, 0, 1.0)])
def test_logprobs_equal_full_forward_recomputation(temperature, top_k, top_p):
    toks, mask = _left_pad(PROMPTS * 2, 7)
    cfg = SamplingConfig(
        max_new_tokens=8, temperature=temperature, top_k=top_k, top_p=top_p, eos_ids=(2, 7)
    )
    out = generate(G, P, toks, mask, jax.random.key(1), cfg)
    full_mask = jnp.concatenate([mask, out.completion_mask > 0], axis=1)
    logits = _forward(P, out.tokens, full_mask)
    ref = _token_logprobs(logits, out.tokens, temperature or 1.0)[:, 6:]
    m = np.asarray(out.completion_mask)
    np.testing.assert_allclose(np.asarray(out.logprobs) * m, np.asarray(ref) * m, atol=2e-4)
    assert np.all(np.asarray(out.logprobs)[m == 0] == 0)


def test_eos_masks_lengths_and_truncation():
    toks, mask = _left_pad(PROMPTS, 7)
    free = generate(
        G, P, toks, mask, jax.random.key(0), SamplingConfig(max_new_tokens=8, temperature=0.0)
    )
    ct = np.asarray(free.completion_tokens)
    assert np.all(np.asarray(free.truncated)) and np.all(np.asarray(free.lengths) == 8)
    np.testing.assert_array_equal(free.completion_mask, np.ones((3, 8)))
    # EOS ids: row 0's 3rd token and row 1's 5th; row 2 must not contain either
    e0, e1 = int(ct[0, 2]), int(ct[1, 4])
    eos = tuple(e for e in (e0, e1))
    pad = 31
    out = generate(
        G,
        P,
        toks,
        mask,
        jax.random.key(0),
        SamplingConfig(max_new_tokens=8, temperature=0.0, eos_ids=eos, pad_id=pad),
    )
    for r in range(3):
        hits = [j for j in range(8) if ct[r, j] in eos]
        length = hits[0] + 1 if hits else 8
        assert int(out.lengths[r]) == length
        assert bool(out.truncated[r]) == (not hits)
        np.testing.assert_array_equal(out.completion_tokens[r, :length], ct[r, :length])
        assert np.all(np.asarray(out.completion_tokens[r, length:]) == pad)
        np.testing.assert_array_equal(out.completion_mask[r], [1.0] * length + [0.0] * (8 - length))
        np.testing.assert_array_equal(out.tokens[r, 7:], out.completion_tokens[r])
    np.testing.assert_array_equal(out.tokens[:, :7], toks)
    assert out.completion_mask.dtype == jnp.float32 and out.lengths.dtype == jnp.int32


def test_no_recompilation_across_steps():
    cfg = SamplingConfig(max_new_tokens=4, temperature=1.0, eos_ids=(2,))
    toks, mask = _left_pad(PROMPTS, 7)
    generate(G, P, toks, mask, jax.random.key(0), cfg)
    n = _generate._cache_size()
    toks2, mask2 = _left_pad([[3], [4, 5, 6], [7, 8]], 7)
    P2 = jax.tree.map(lambda x: x * 1.01, P)
    out = generate(G, P2, toks2, mask2, jax.random.key(1), cfg)
    assert _generate._cache_size() == n
    assert isinstance(out, Rollouts)


def test_sharded_batch_matches_unsharded():
    devices = jax.devices()
    if len(devices) < 4:
        pytest.skip("needs 4 devices (conftest sets 8 virtual CPU devices)")
    mesh = Mesh(np.asarray(devices[:4]), ("data",))
    toks, mask = _left_pad(PROMPTS + [[9, 8, 7]], 7)
    cfg = SamplingConfig(max_new_tokens=5, temperature=0.0)
    ref = generate(G, P, toks, mask, jax.random.key(0), cfg)
    batch = NamedSharding(mesh, PartitionSpec("data"))
    params = jax.device_put(P, NamedSharding(mesh, PartitionSpec()))
    out = generate(
        G, params, jax.device_put(toks, batch), jax.device_put(mask, batch), jax.random.key(0), cfg
    )
    np.testing.assert_array_equal(out.completion_tokens, ref.completion_tokens)
    assert len(out.completion_tokens.sharding.device_set) == 4
