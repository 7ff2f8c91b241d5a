"""The packed update (`config.algorithm.pack_sequences`): the reference / old-log-prob pass, the
loss and its gradients on packed token buffers equal the padded ones for every loss
aggregation mode with ragged rows, the step's mini-batches are the padded update's, and no row is
ever dropped silently."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax import experiment, losses, packing, steps, train, writers
from grpo_jax.errors import ConfigError
from grpo_jax.state import Batch
from tests.test_train import smoke_config


def _ragged_batch(exp, seed=0):
    """R rows with prompts of 1..Lp tokens, completions of 0..Lc (one full, one empty), a
    masked-out span inside one completion (a tool's output), off-policy old log-probs, a
    reference and the sampler's log-probs. Returns (batch, host attention mask)."""
    R, Lp, Lc = exp.batching.rollouts_per_step, exp.prompt_len, exp.max_new_tokens
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, exp.tokenizer.vocab_size, (R, Lp + Lc)).astype(np.int32)
    pl, cl = rng.integers(1, Lp + 1, R), rng.integers(0, Lc + 1, R)
    cl[0], cl[1] = Lc, 0
    cols = np.arange(Lp + Lc)[None]
    attn = ((cols >= Lp - pl[:, None]) & (cols < Lp)) | ((cols >= Lp) & (cols < Lp + cl[:, None]))
    cm = (np.arange(Lc)[None] < cl[:, None]).astype(np.float32)
    cm[2, 1:3] = 0.0
    near = lambda: jnp.asarray(rng.normal(size=(R, Lc)).astype(np.float32) * 0.1 - 2.0)
    batch = Batch(
        tokens=jnp.asarray(tokens),
        attention_mask=jnp.asarray(attn),
        completion_mask=jnp.asarray(cm),
        advantages=jnp.asarray(rng.normal(size=R).astype(np.float32)),
        sample_weights=jnp.asarray(rng.uniform(0.5, 2.0, R).astype(np.float32)),
        old_logprobs=near(),
        ref_logprobs=near(),
        sampler_logprobs=near(),
    )
    return batch, attn


@pytest.fixture(scope="module")
def built():
    exp = experiment.build_experiment(
        smoke_config(
            "grpo",
            **{
                "algorithm.num_iterations": 2,
                "algorithm.mini_batch_size": 16,
                "algorithm.pack_sequences": True,
                "algorithm.micro_batch_tokens": 64,  # at most 3 buffers of T = 21 per micro
            },
        )
    )
    yield exp, steps.make_steps(exp), steps.init_train_state(exp)
    exp.close()


def _with_loss(exp, **loss_fields):
    alg = exp.run.algorithm
    alg = dataclasses.replace(alg, loss=dataclasses.replace(alg.loss, **loss_fields))
    return dataclasses.replace(exp, run=dataclasses.replace(exp.run, algorithm=alg))


def test_packed_logprob_pass_equals_the_padded_pass(built):
    exp, fns, state = built
    batch, attn = _ragged_batch(exp)
    want = np.asarray(fns.logprobs(state.params, batch.tokens, batch.attention_mask))
    plan = steps.packed_logprob_plan(exp, attn)
    # fewer model rows than padded rows: the point of packing
    assert plan.segment_ids.shape[0] * plan.segment_ids.shape[1] < attn.shape[0]
    got = np.asarray(fns.logprobs(state.params, batch.tokens, batch.attention_mask, plan))
    lengths = attn[:, exp.prompt_len :].sum(axis=1)
    real = np.arange(exp.max_new_tokens)[None] < lengths[:, None]
    np.testing.assert_allclose(got[real], want[real], rtol=0, atol=1e-6)
    assert np.isfinite(got).all()


@pytest.mark.parametrize("mode", losses.LOSS_AGG_MODES)
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_packed_loss_and_gradients_equal_the_padded_ones(built, mode, ratio_level):
    """Ragged rows, several packed micro-batches (a small token budget), KL, TIS, sample
    weights: loss, gradients, per-rollout losses and token-mean diagnostics within 1e-6 of the
    padded one-pass computation."""
    exp, _, state = built
    e = _with_loss(exp, loss_agg_mode=mode, ratio_level=ratio_level, kl_coef=0.05, tis_cap=2.0)
    grads = jax.jit(steps.policy_gradients(e))
    batch, attn = _ragged_batch(exp, seed=1)
    mb = exp.batching.mini_batch_size  # one mini-batch: the padded side is one pass
    batch, attn = jax.tree.map(lambda x: x[:mb], batch), attn[:mb]
    T = attn.shape[1] - 1
    scored = (exp.prompt_len - 1, attn[:, exp.prompt_len :].sum(axis=1))
    micro = packing.micro_batches(*packing.spans(attn), T, 2, scored=scored)
    assert micro.num_micro > 1  # the accumulation over packed micro-batches is exercised
    loss0, aux0, g0 = grads(state.params, batch)
    loss1, aux1, g1 = grads(state.params, batch, micro)
    assert abs(float(loss1) - float(loss0)) <= 1e-6 * max(1.0, abs(float(loss0)))
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-6)
    assert max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(g0)) > 1e-3  # not trivial
    for k in ("per_rollout_loss", "pg_loss", "clip_fraction", "approx_kl", "ratio_mean", "kl"):
        np.testing.assert_allclose(np.asarray(aux1[k]), np.asarray(aux0[k]), rtol=1e-5, atol=1e-6)
    assert float(aux1["num_tokens"]) == float((batch.completion_mask > 0).sum())


def test_packed_train_step_equals_the_padded_step(built):
    """Two passes of two shuffled mini-batches: the host plan reads the same shuffle as the
    device (`Steps.minibatch_order`), so the packed step trains on the same rows."""
    exp, fns, state = built
    batch, attn = _ragged_batch(exp, seed=2)
    key = jax.random.PRNGKey(7)
    rows = np.asarray(fns.minibatch_order(key))
    assert rows.shape == (2, 2, 16) and sorted(rows[0].ravel()) == list(range(32))
    plan = steps.packed_step_plan(exp, attn, rows)
    copy = lambda s: jax.tree.map(jnp.copy, s)  # train donates its state
    s0, m0 = fns.train(copy(state), batch, key)
    s1, m1 = fns.train(copy(state), batch, key, plan)
    for k in ("loss", "grad_norm", "clip_fraction", "approx_kl"):
        np.testing.assert_allclose(float(m1[k]), float(m0[k]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m1["per_rollout_loss"], m0["per_rollout_loss"], atol=1e-6)
    for a, b in zip(jax.tree.leaves(s0.params), jax.tree.leaves(s1.params)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)


def test_no_row_is_dropped_or_doubled_silently():
    attn = np.zeros((4, 9), bool)
    for r, (s, n) in enumerate([(0, 8), (3, 2), (5, 3), (1, 1)]):
        attn[r, s : s + n] = True
    with pytest.raises(ValueError, match="pass 0's mini-batches do not hold each of 4 rows once"):
        packing.step_plan(attn, [[[0, 1], [2, 2]]], 8, 1)  # row 3 dropped, row 2 twice
    with pytest.raises(ValueError, match="row 0 has 8 tokens, more than buffer_len=7"):
        packing.micro_batches(*packing.spans(attn), 7, 1)
    gap = attn.copy()
    gap[2, 6] = False  # a hole inside row 2's span
    with pytest.raises(ValueError, match="row 2's real tokens are not one contiguous span"):
        packing.spans(gap)
    with pytest.raises(ValueError, match=r"need 2 buffers and 8 scored positions in one, more"):
        packing.micro_batches(*packing.spans(attn), 8, 1, shape=(1, 1))
    plan = packing.step_plan(attn, [[[0, 1], [2, 3]], [[3, 0], [2, 1]]], 8, 1)
    assert plan.micro.segment_ids.shape == (2, 2, 2, 1, 8)  # [passes, mini-batches, M, k, T]
    assert int((plan.micro.segment_ids > 0).sum()) == 2 * 8 + 2 * 6  # 2 passes x (8+2+3+1)


def test_micro_batches_and_scored_slots_by_hand():
    """Rows of 3, 5, 3, 4, 1 tokens, T = 8, one buffer per micro-batch: first-fit decreasing
    puts rows 1 (at 0) and 0 (at 5) in buffer 0, rows 3 (at 0), 2 (at 4) and 4 (at 7) in
    buffer 1. Each row's scored positions (the last ``count`` of its span) become LM-head slots
    of its buffer, rows in order, written to output columns 0 .. count - 1."""
    starts, lengths, count = [2, 0, 1, 0, 3], [3, 5, 3, 4, 1], [2, 3, 0, 1, 1]
    first = [s + n - c for s, n, c in zip(starts, lengths, count)]
    m = packing.micro_batches(starts, lengths, 8, 1, scored=(first, count))
    assert m.segment_ids.shape == (2, 1, 8) and m.micro_of.tolist() == [0, 0, 1, 1, 1]
    assert m.src_row[:, 0].tolist() == [[1] * 5 + [0] * 3, [3] * 4 + [2] * 3 + [4]]
    assert m.head_slot.shape == (2, 1, 6)  # 5 scored slots in buffer 0: bucket 6
    assert m.head_slot[:, 0].tolist() == [[6, 7, 2, 3, 4, 0], [3, 7, 0, 0, 0, 0]]
    assert m.head_row[:, 0].tolist() == [[0, 0, 1, 1, 1, 5], [3, 4, 5, 5, 5, 5]]  # 5: unused
    assert m.head_col[:, 0].tolist() == [[0, 1, 0, 1, 2, 0], [0, 0, 0, 0, 0, 0]]
    with pytest.raises(ValueError, match=r"row 0's scored positions \[4, 6\) lie outside"):
        packing.micro_batches(starts, lengths, 8, 1, scored=([4] * 5, [2] * 5))


def test_a_pass_never_computes_more_buffers_than_the_padded_one():
    """k is a most: a micro-batch holds the buffers its rows need (bucketed, a multiple of the
    shards); more micro-batches than the rows could fill are never made; the LM head's slots
    per buffer never exceed the buffer."""
    # 32 rows of 3 tokens, T = 8, k = 32: 16 buffers would be padded's 32 rows at most
    m = packing.micro_batches(np.zeros(32, int), np.full(32, 3), 8, 32, multiple=4)
    assert m.segment_ids.shape == (1, 16, 8)  # two rows a buffer: 16 buffers, not 32
    m = packing.micro_batches(np.zeros(32, int), np.full(32, 3), 8, 32, multiple=6)
    assert m.segment_ids.shape == (1, 18, 8)  # 16 rounded up to a multiple of 6
    # 20 rows that each fill a buffer, k = 4: 5 micro-batches (the bucket 6 would add an empty one)
    m = packing.micro_batches(np.zeros(20, int), np.full(20, 8), 8, 4)
    assert m.segment_ids.shape == (5, 4, 8)
    # the head's slots are capped at T: 3 rows of 2 tokens whose both positions are scored
    m = packing.micro_batches([0, 0, 0], [2, 2, 2], 7, 1)  # one buffer: 6 scored slots <= 7
    assert m.head_slot.shape == (1, 1, 6)
    m = packing.micro_batches([0] * 7, [1] * 7, 7, 1)  # 7 scored slots: bucket 8, capped at 7
    assert m.head_slot.shape == (1, 1, 7)


def test_packing_config_is_checked():
    with pytest.raises(ConfigError, match="pack_sequences and shared_prompt_forward"):
        experiment.build_experiment(
            smoke_config(
                **{"algorithm.pack_sequences": True, "algorithm.shared_prompt_forward": True}
            )
        )
    with pytest.raises(ConfigError, match="micro_batch_tokens=-1 must be >= 0"):
        experiment.build_experiment(smoke_config(**{"algorithm.micro_batch_tokens": -1}))
    with pytest.raises(ConfigError, match="micro_batch_tokens is read only with"):
        experiment.build_experiment(smoke_config(**{"algorithm.micro_batch_tokens": 64}))


@pytest.mark.slow
def test_packed_run_matches_the_padded_run(tmp_path):
    """Two RL steps end to end (off-policy mini-batches, KL): the same samples and, within float
    rounding, the same losses and gradient norms packed as padded. A format bonus for a digit
    0-4 gives the rewards a spread: with every reward equal (the untrained model's) the only
    gradient is rounding noise, which Adam scales to a full step in one layout and not in the
    other (seen on an AVX2-only CPU: grad norm 1.9e-7 padded, 0 packed)."""
    rows = {}
    for pack in (False, True):
        cfg = smoke_config(
            "grpo",
            steps=2,
            **{
                "algorithm.pack_sequences": pack,
                "algorithm.micro_batch_tokens": 64 if pack else 0,
                "algorithm.mini_batch_size": 16,
                "algorithm.kl_coef": 0.01,
                "reward.format_reward": 0.5,
                "reward.format_pattern": "[0-4]",
            },
        )
        train.train_and_evaluate(cfg, str(tmp_path / str(pack)))
        rows[pack] = [
            r
            for r in writers.read_jsonl(str(tmp_path / str(pack) / "metrics.jsonl"))
            if "loss" in r
        ]
    assert len(rows[True]) == len(rows[False]) == 2
    assert all(r["advantage_abs_mean"] > 0.1 for r in rows[False])  # a real gradient
    for a, b in zip(rows[True], rows[False]):
        assert a["reward_mean"] == b["reward_mean"]
        for k in ("loss", "grad_norm", "kl", "clip_fraction"):
            np.testing.assert_allclose(a[k], b[k], rtol=1e-4, atol=1e-6)


def test_the_packed_update_compiles_sharded_over_eight_devices():
    """`experiments.aot` compiles the packed update and log-prob pass over a data x fsdp mesh
    of 8 (whole buffers per shard) at about the padded programs' memory per device."""
    from experiments import aot
    from tests.test_aot import tiny_dapo

    assert len(jax.devices()) >= 8
    padded = aot.compile_steps(tiny_dapo("8b,grpo"), sampler="none")
    c = tiny_dapo("8b,grpo")
    c.algorithm.pack_sequences = True
    packed = aot.compile_steps(c, sampler="none")
    for name in ("update", "logprobs"):
        assert "packed: 16 buffers of 31 tokens" in packed["steps"][name]["what"]
        assert packed["steps"][name]["total"] < 1.5 * padded["steps"][name]["total"]
