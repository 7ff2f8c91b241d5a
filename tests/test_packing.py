"""Sequence packing (`grpo_jax.packing`): rows placed whole, none dropped, the round trip exact,
and attention inside a packed buffer equal to each row's own attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_jax import packing


def _rows(lengths, L, seed=0):
    """Starts that put each row's span inside [0, L) (left padding, then the span)."""
    rng = np.random.default_rng(seed)
    return np.array([rng.integers(0, L - n + 1) for n in lengths])


def test_first_fit_decreasing_by_hand():
    # T = 8: rows of 5, 4, 3, 3, 1 -> [5, 3], [4, 3, 1]; two buffers, bucket 2
    p = packing.plan([0, 0, 0, 0, 0], [3, 5, 1, 4, 3], buffer_len=8)
    assert p.num_buffers == 2 and p.num_tokens == 16
    assert p.buffer_of.tolist() == [0, 0, 1, 1, 1] and p.offset.tolist() == [5, 0, 7, 0, 4]
    assert p.segment_ids.tolist() == [[1, 1, 1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 2, 2, 2, 3]]
    assert p.positions.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 0, 1, 2, 0]]
    # buckets 1, 2, 3, 4, 6, 8, 12, ...: five needed buffers compile as six, rounded up to a
    # shard multiple (4 -> 8); three stay three, or four on two shards
    assert packing.plan([0] * 5, [8] * 5, 8).num_buffers == 6
    assert packing.plan([0] * 5, [8] * 5, 8, multiple=4).num_buffers == 8
    assert packing.plan([0] * 3, [8] * 3, 8).num_buffers == 3
    assert packing.plan([0] * 3, [8] * 3, 8, multiple=2).num_buffers == 4
    assert packing.plan([0] * 3, [8] * 3, 8, num_buffers=5).num_buffers == 5
    assert [packing.num_buckets(n) for n in range(1, 14)] == [
        1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16,
    ]  # fmt: skip


def test_bad_plans_are_refused_never_silently_dropped():
    with pytest.raises(ValueError, match="row 1 has 9 tokens, more than buffer_len=8"):
        packing.plan([0, 0], [3, 9], 8)
    with pytest.raises(ValueError, match="need 2 buffers of 8, more than 1"):
        packing.plan([0, 0], [5, 5], 8, num_buffers=1)
    with pytest.raises(ValueError, match=">= 0"):
        packing.plan([0, -1], [1, 1], 8)


_pack = jax.jit(packing.pack)
_unpack = jax.jit(packing.unpack, static_argnums=5)


@settings(max_examples=40, deadline=None)
@given(
    # 16 rows (zero-length ones too), a few buffer lengths: few compiled shapes (B is bucketed)
    lengths=st.lists(st.integers(0, 12), min_size=16, max_size=16),
    T=st.sampled_from([12, 17, 40]),
    seed=st.integers(0, 2**16),
)
def test_property_every_token_once_and_the_round_trip_is_exact(lengths, T, seed):
    L = 16
    starts = _rows(lengths, L, seed)
    p = packing.plan(starts, lengths, T)
    assert p.num_tokens == sum(lengths)  # in == out
    # whole rows, contiguous, positions restarting, segments in order
    for r, n in enumerate(lengths):
        if n == 0:
            assert p.buffer_of[r] == -1
            continue
        b, o = p.buffer_of[r], p.offset[r]
        assert (p.src_row[b, o : o + n] == r).all()
        assert p.positions[b, o : o + n].tolist() == list(range(n))
        assert len(set(p.segment_ids[b, o : o + n].tolist())) == 1
    x = np.random.default_rng(seed).normal(size=(len(lengths), L, 3)).astype(np.float32)
    packed = _pack(x, p.src_row, p.src_col, p.segment_ids)
    back = np.asarray(_unpack(packed, p.buffer_of, p.offset, p.starts, p.lengths, L))
    span = (np.arange(L)[None] >= starts[:, None]) & (
        np.arange(L)[None] < (starts + np.asarray(lengths))[:, None]
    )
    np.testing.assert_array_equal(back, np.where(span[..., None], x, 0.0))
    assert float(np.abs(np.asarray(packed)).sum()) == pytest.approx(
        float(np.abs(x[span]).sum()), rel=1e-5
    )


def _segment_mask(seg):
    """The model's own mask of packed rows (`attention.Mask` with segment ids): [B, T, T]."""
    from grpo_jax.models import attention

    return attention.Mask(seg > 0, segment_ids=seg).dense(seg.shape[1])


def test_packed_attention_equals_each_row_attention_under_jit():
    """Causal attention over a packed buffer with `attention_mask` gives every row what its
    own padded row gives (the same values at the same tokens), and no slot sees another row."""
    lengths, L, T, D = [5, 2, 7, 3, 4], 8, 12, 4
    starts = _rows(lengths, L, 1)
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(len(lengths), L, D)).astype(np.float32) for _ in range(3))
    p = packing.plan(starts, lengths, T)

    def attend(q, k, v, mask):  # [N, S, D], mask [N, S, S]
        s = jnp.einsum("nqd,nkd->nqk", q, k) / jnp.sqrt(D)
        s = jnp.where(mask, s, -1e30)
        return jnp.einsum("nqk,nkd->nqd", jax.nn.softmax(s, -1), v)

    @jax.jit
    def padded(q, k, v, starts, lengths):
        cols = jnp.arange(L)
        real = (cols[None] >= starts[:, None]) & (cols[None] < (starts + lengths)[:, None])
        mask = real[:, None, :] & (cols[None, :, None] >= cols[None, None, :])
        return attend(q, k, v, mask | ~real[:, :, None])  # padding queries: anything finite

    @jax.jit
    def packed(q, k, v, src_row, src_col, seg, buffer_of, offset, starts, lengths):
        qp, kp, vp = (packing.pack(x, src_row, src_col, seg) for x in (q, k, v))
        mask = _segment_mask(seg) | (seg[:, :, None] == 0)
        out = attend(qp, kp, vp, mask)
        return packing.unpack(out, buffer_of, offset, starts, lengths, L)

    want = np.asarray(padded(q, k, v, starts, np.asarray(lengths)))
    got = np.asarray(
        packed(q, k, v, p.src_row, p.src_col, p.segment_ids, p.buffer_of, p.offset, p.starts,
               p.lengths)
    )  # fmt: skip
    span = (np.arange(L)[None] >= starts[:, None]) & (
        np.arange(L)[None] < (starts + np.asarray(lengths))[:, None]
    )
    np.testing.assert_allclose(got[span], want[span], rtol=1e-5, atol=1e-6)
    m = np.asarray(_segment_mask(jnp.asarray(p.segment_ids)))
    for b in range(p.num_buffers):  # no slot sees another row's slot
        seg = p.segment_ids[b]
        assert not (m[b] & (seg[:, None] != seg[None, :])).any()


@pytest.mark.parametrize("impl", ["einsum", "blockwise", "splash"])
def test_attention_with_segment_ids_equals_each_row_alone(impl):
    """The model's attention (`attention.attend`) over packed buffers with `Mask.segment_ids`
    equals each row's causal attention on its own, values and (einsum, blockwise's custom VJP)
    gradients; splash in the Pallas interpreter, values."""
    from grpo_jax.models import attention

    lengths, L, T, H, KVH, D = [5, 2, 7, 3, 4], 8, 12, 4, 2, 8
    starts = _rows(lengths, L, 2)
    p = packing.plan(starts, lengths, T)
    rng = np.random.default_rng(1)
    q = rng.normal(size=(len(lengths), L, H, D)).astype(np.float32)
    k, v = (rng.normal(size=(len(lengths), L, KVH, D)).astype(np.float32) for _ in range(2))
    span = (np.arange(L)[None] >= starts[:, None]) & (
        np.arange(L)[None] < (starts + np.asarray(lengths))[:, None]
    )

    @jax.jit
    def rows(q, k, v, span):  # left/right padded rows, key padding + causal
        return attention.attend(q, k, v, attention.Mask(span), "einsum")

    def packed(q, k, v, src_row, src_col, seg, buffer_of, offset, starts, lengths):
        qp, kp, vp = (packing.pack(x, src_row, src_col, seg) for x in (q, k, v))
        mask = attention.Mask(seg > 0, segment_ids=seg)
        if impl == "splash":
            out = attention.splash_attention(qp, kp, vp, mask, interpret=True)
        elif impl == "blockwise":  # tiles smaller than a row: segments cross tile edges
            out = attention.blockwise_attention(qp, kp, vp, mask, block_q=4, block_k=4)
        else:
            out = attention.attend(qp, kp, vp, mask, impl)
        return packing.unpack(out, buffer_of, offset, starts, lengths, L)

    idx = (p.src_row, p.src_col, p.segment_ids, p.buffer_of, p.offset, p.starts, p.lengths)
    want = np.asarray(rows(q, k, v, span))
    got = np.asarray(jax.jit(packed)(q, k, v, *idx))
    np.testing.assert_allclose(got[span], want[span], rtol=2e-5, atol=2e-5)
    if impl == "splash":
        return
    cot = rng.normal(size=want.shape).astype(np.float32) * span[..., None, None]
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v) * cot)
    g_rows = jax.jit(jax.grad(loss(lambda q, k, v: rows(q, k, v, span)), (0, 1, 2)))
    g_packed = jax.jit(jax.grad(loss(lambda q, k, v: packed(q, k, v, *idx)), (0, 1, 2)))
    for a, b in zip(g_packed(q, k, v), g_rows(q, k, v)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("impl", ["einsum", "blockwise"])
def test_packed_model_forward_and_gradient_equal_the_padded_batch(impl):
    """The transformer on packed buffers (segment ids, positions restarting per row) gives each
    row's logits and the parameters' gradient of a per-token loss that the padded batch gives."""
    from flax import nnx

    from grpo_jax.models import get_preset
    from grpo_jax.models.transformer import positions_from_mask, random_params

    cfg = get_preset("tiny", vocab_size=37, attention_impl=impl)
    graphdef, params = random_params(cfg, 0, stddev=0.2)
    lengths, L, T = [6, 3, 7, 2, 5], 8, 12
    # our layout: left-padded rows (each row's tokens end at L)
    starts = L - np.asarray(lengths)
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, cfg.vocab_size, size=(len(lengths), L)).astype(np.int32)
    mask = np.arange(L)[None] >= starts[:, None]
    w = rng.normal(size=(len(lengths), L, cfg.vocab_size)).astype(np.float32) * mask[..., None]
    p = packing.plan(starts, lengths, T)
    idx = (p.src_row, p.src_col, p.segment_ids, p.buffer_of, p.offset, p.starts, p.lengths)

    def padded(params):
        model = nnx.merge(graphdef, params)
        logits, _ = model(tokens, positions_from_mask(jnp.asarray(mask)), jnp.asarray(mask))
        return logits

    def packed(params):
        src_row, src_col, seg, buffer_of, offset, starts_, lengths_ = idx
        model = nnx.merge(graphdef, params)
        toks = packing.pack(tokens, src_row, src_col, seg)
        logits, _ = model(toks, jnp.asarray(p.positions), seg > 0, segment_ids=jnp.asarray(seg))
        return packing.unpack(logits, buffer_of, offset, starts_, lengths_, L)

    want, got = np.asarray(jax.jit(padded)(params)), np.asarray(jax.jit(packed)(params))
    np.testing.assert_allclose(got[mask], want[mask], rtol=1e-4, atol=1e-5)
    loss = lambda f: lambda params: jnp.sum(f(params) * w)
    g_want = jax.jit(jax.grad(loss(padded)))(params)
    g_got = jax.jit(jax.grad(loss(packed)))(params)
    for a, b in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("chunk", [0, 3])
def test_packed_completion_logprobs_and_policy_gradient_equal_the_padded_pass(chunk):
    """`steps.packed_completion_logprobs`: the completion tokens' log-probs and the gradient of
    a masked per-token loss equal the padded pass (left-padded prompts, right-padded completions
    of ragged lengths), with and without the chunked LM head."""

    from grpo_jax import steps
    from grpo_jax.models import get_preset
    from grpo_jax.models.transformer import random_params

    cfg = get_preset("tiny", vocab_size=37)
    graphdef, params = random_params(cfg, 0, stddev=0.2)
    Lp, Lc, prompt, comp = 6, 5, [6, 2, 4, 3], [5, 1, 3, 4]
    R = len(prompt)
    rng = np.random.default_rng(4)
    tokens = rng.integers(0, cfg.vocab_size, size=(R, Lp + Lc)).astype(np.int32)
    cols = np.arange(Lp + Lc)[None]
    mask = (cols >= Lp - np.asarray(prompt)[:, None]) & (cols < Lp + np.asarray(comp)[:, None])
    cmask = mask[:, Lp:]
    micro = packing.micro_batches(
        *packing.spans(mask), buffer_len=16, buffers_per_micro=1, scored=(Lp - 1, comp)
    )
    assert int((micro.segment_ids > 0).sum()) == int(mask[:, :-1].sum()) and micro.num_micro < R
    w = rng.normal(size=(R, Lc)).astype(np.float32) * cmask

    def padded(params):
        return steps.completion_logprobs(
            graphdef, params, tokens, jnp.asarray(mask), Lp, 0.7, logprob_chunk_size=chunk
        )

    def packed(params, micro):
        return steps.packed_completion_logprobs(
            graphdef, params, tokens, Lp, 0.7, micro, logprob_chunk_size=chunk
        )

    want = np.asarray(jax.jit(padded)(params))
    got = np.asarray(jax.jit(packed)(params, micro))
    np.testing.assert_allclose(got[cmask], want[cmask], rtol=1e-5, atol=1e-5)
    g_want = jax.jit(jax.grad(lambda p: jnp.sum(padded(p) * w)))(params)
    g_got = jax.jit(jax.grad(lambda p, m: jnp.sum(packed(p, m) * w)))(params, micro)
    for a, b in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-5)
