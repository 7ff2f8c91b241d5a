"""The KV-cache decoder against an independent reference, and the one-uniform-per-row draw.

Reference: a naive decoder that runs the model on the whole prefix (no cache) at every step
and samples with the same `sample_logits` and the same key schedule as `generate`, so tokens
must match exactly and log-probs to float rounding, across several attention buckets and with
group-shared prompt prefill.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from grpo_jax.models import get_preset, positions_from_mask
from grpo_jax.models.transformer import random_params
from grpo_jax.sampling import SamplingConfig, decode_buckets, generate, sample_logits

# vocabulary of 600: the inverse-CDF draw spans three 256-token blocks (the last one padded)
CFG = get_preset("tiny", vocab_size=600, num_layers=2, tie_word_embeddings=False)
GD, PARAMS = random_params(CFG, 1, stddev=0.2)
PROMPTS = [[5, 6], [1, 2, 3, 4, 9], [3, 4, 5, 6, 7, 8, 9], [11, 12, 13]]


def _left_pad(prompts, width):
    toks = np.zeros((len(prompts), width), np.int32)
    mask = np.zeros((len(prompts), width), bool)
    for i, p in enumerate(prompts):
        toks[i, width - len(p) :] = p
        mask[i, width - len(p) :] = True
    return jnp.asarray(toks), jnp.asarray(mask)


@jax.jit
def _last_logits(params, tokens, mask, col):
    logits, _ = nnx.merge(GD, params)(tokens, positions_from_mask(mask), mask)
    return jax.lax.dynamic_index_in_dim(logits, col, 1, keepdims=False).astype(jnp.float32)


def naive_generate(params, prompt_tokens, prompt_mask, rng, config):
    """Full recompute decoding: (completion_tokens [R, Lc], logprobs [R, Lc]) as numpy."""
    R, Lp = prompt_tokens.shape
    Lc = config.max_new_tokens
    tokens = jnp.concatenate([prompt_tokens, jnp.zeros((R, Lc), jnp.int32)], axis=1)
    mask = jnp.concatenate([prompt_mask, jnp.ones((R, Lc), bool)], axis=1)
    eos = np.asarray(config.eos_ids if config.eos_ids else (-1,))
    step = jax.jit(lambda lg, k: sample_logits(lg, k, config))
    out_t = np.full((R, Lc), config.pad_id, np.int32)
    out_lp = np.zeros((R, Lc), np.float32)
    done = np.zeros(R, bool)
    for i in range(Lc):
        rng, key = jax.random.split(rng)
        tok, lp = step(_last_logits(params, tokens, mask, Lp - 1 + i), key)
        tok, lp = np.asarray(tok), np.asarray(lp)
        out_t[:, i] = np.where(done, config.pad_id, tok)
        out_lp[:, i] = np.where(done, 0.0, lp)
        done |= np.isin(out_t[:, i], eos) & ~done
        tokens = tokens.at[:, Lp + i].set(jnp.asarray(out_t[:, i]))
    return out_t, out_lp


@pytest.mark.parametrize(
    "temperature,top_k,top_p,group",
    [(0.0, 0, 1.0, 1), (1.0, 0, 1.0, 1), (0.8, 5, 0.9, 1), (1.0, 0, 0.7, 4), (0.0, 0, 1.0, 4)],
)
def test_cached_decode_matches_full_recompute(temperature, top_k, top_p, group):
    Lc = 40  # 39 decode steps: 3 attention buckets
    assert len(decode_buckets(7, Lc, 8)) == 3
    prompts = [p for p in PROMPTS for _ in range(group)]
    toks, mask = _left_pad(prompts, 7)
    cfg = SamplingConfig(
        max_new_tokens=Lc,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_ids=(7, 21),
        pad_id=0,
        prompt_group_size=group,
    )
    out = generate(GD, PARAMS, toks, mask, jax.random.key(5), cfg)
    ref_t, ref_lp = naive_generate(PARAMS, toks, mask, jax.random.key(5), cfg)
    np.testing.assert_array_equal(np.asarray(out.completion_tokens), ref_t)
    np.testing.assert_allclose(np.asarray(out.logprobs), ref_lp, atol=1e-5)
    # one bucket (every step reads all slots) gives the same rollouts
    one = generate(
        GD,
        PARAMS,
        toks,
        mask,
        jax.random.key(5),
        SamplingConfig(**{**cfg.__dict__, "attention_buckets": 1}),
    )
    np.testing.assert_array_equal(one.completion_tokens, out.completion_tokens)
    np.testing.assert_allclose(one.logprobs, out.logprobs, atol=1e-5)
    if temperature > 0:  # rows really are sampled (not all equal)
        assert len({tuple(r) for r in ref_t.tolist()}) > 1


def test_decode_buckets_cover_every_step():
    for Lp, Lc, n in [(7, 40, 8), (3, 2, 8), (10, 1000, 8), (5, 17, 1), (4, 100, 3)]:
        ends = decode_buckets(Lp, Lc, n)
        assert len(ends) <= n and list(ends) == sorted(set(ends))
        assert ends[-1] == Lp + Lc - 1  # the last step's need, never more
        assert all(e - Lp >= 1 for e in ends)


def test_inverse_cdf_draw_matches_softmax_across_blocks():
    V, n = 700, 40000
    logits = np.random.default_rng(0).normal(0, 1.5, V).astype(np.float32)
    logits[::97] += 4.0  # a few heavy tokens spread over all blocks
    x = jnp.broadcast_to(jnp.asarray(logits), (n, V))
    tok, lp = jax.jit(sample_logits, static_argnums=2)(
        x, jax.random.key(2), SamplingConfig(max_new_tokens=1)
    )
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    counts = np.bincount(np.asarray(tok), minlength=V)
    heavy = probs > 5 / n
    obs = np.append(counts[heavy], counts[~heavy].sum())
    exp = np.append(probs[heavy], probs[~heavy].sum()).astype(np.float64)
    exp *= obs.sum() / exp.sum()
    assert stats.chisquare(obs, exp).pvalue > 1e-3
    np.testing.assert_allclose(np.asarray(lp), np.log(probs)[np.asarray(tok)], rtol=1e-4)


def test_no_vocabulary_sized_random_bits():
    R, V = 8, 700
    for cfg in (
        SamplingConfig(max_new_tokens=1),
        SamplingConfig(max_new_tokens=1, top_p=0.9),
        SamplingConfig(max_new_tokens=1, top_k=50, top_p=0.9),
    ):
        jaxpr = jax.make_jaxpr(lambda lg, k, c=cfg: sample_logits(lg, k, c))(
            jnp.zeros((R, V)), jax.random.key(0)
        )
        bits = [line for line in str(jaxpr).splitlines() if "random_bits" in line]
        assert bits and all(f"shape=({R},)" in line for line in bits), (cfg, bits)
