"""The pipeline estimate's arithmetic (`experiments.pipeline_estimate`) on small cases worked
out by hand."""

import numpy as np
import pytest

from experiments import pipeline_estimate as pe

RATES = pe.Rates(hbm_Bps=1.0, link_Bps=1.0, flops=1.0)


def test_a_call_reads_the_params_the_live_prefixes_and_the_filled_slots():
    # 2 shards of one group of 2 rows each: shard 0 lengths (3, 1), shard 1 (2, 2)
    m = pe.DecodeModel(param_bytes=100, kv_slot_bytes=1, prompt_len=10, group_size=2, data=2)
    out = pe.call_seconds(m, [3, 1, 2, 2], RATES)
    # step 1: shard 0 reads 100 + 10 + 1 (one live row, 1 slot); shard 1 100 + 10 + 2 = 112
    # step 2: shard 0 100 + 10 + 2 (row 0, 2 slots) = 112; shard 1 has ended: 100
    assert out["steps"] == 2 and out["tokens"] == 8
    assert out["seconds"] == pytest.approx(224)
    assert out["reads"] == pytest.approx({"params": 100, "prefix": 10, "completion": 2})
    # compute-bound steps (2 rows x 60 FLOPs = 120 > 112 bytes), 2 link bytes per step, and
    # a prefill of 5 FLOPs per group (2 groups)
    m = pe.DecodeModel(
        100, 1, 10, 2, 2, link_bytes_per_row=1, flops_per_row=60, prefill_flops_per_group=5
    )
    out = pe.call_seconds(m, [3, 1, 2, 2], RATES)
    assert out["seconds"] == pytest.approx(2 * (120 + 2) + 10)
    assert out["prefill_seconds"] == pytest.approx(10)
    with pytest.raises(ValueError, match="whole groups"):
        pe.call_seconds(m, [3, 1, 2], RATES)


def test_generation_sums_its_calls_each_waiting_for_its_longest_row():
    m = pe.DecodeModel(param_bytes=10, kv_slot_bytes=0, prompt_len=0, group_size=1, data=1)
    out = pe.generation_seconds(m, [5, 1, 2, 2], 2, RATES)
    # call 1 runs 4 decode steps (its longest row, 5), call 2 one: 10 bytes each
    assert out["calls"] == 2 and out["steps"] == 5
    assert out["seconds"] == pytest.approx(50)


def test_lengths_scale_to_the_budget_and_truncated_rows_stay_truncated():
    np.testing.assert_array_equal(pe.scale_lengths([100, 512, 1], 512, 4096), [800, 4096, 8])
    d = pe.draw_lengths([1, 2, 3], 10, seed=0)
    assert d.shape == (10,) and set(d) <= {1, 2, 3}


def test_step_and_split():
    assert pe.step_seconds(10, 4, 1) == {"synchronous": 15, "k1": 11}
    best = pe.split_step(8, lambda g: 64 / g, lambda c: 32 / c, lambda g: 0.0)
    assert (best["generate_chips"], best["step"]) == (4, 16)  # g = 4: max(16, 8)
    best = pe.split_step(8, lambda g: 64 / g, lambda c: None if c == 4 else 32 / c, lambda g: 1.0)
    assert (best["generate_chips"], best["step"]) == (2, 33)  # g = 2: max(32, 5.3) + 1
    assert pe.split_step(8, lambda g: None, lambda c: 1.0, lambda g: 0.0) is None


def test_the_xla_decode_reads_every_row_up_to_its_bucket():
    # 2 rows of 2 prompt slots, 3 new tokens, one attention bucket: both decode steps read
    # 2 completion slots per row (the cache grows to Lp + Lc - 1 = 4 slots at once), the
    # prompt slots of every row (dense) or of each group once (prefix-shared, G = 2)
    m = pe.DecodeModel(param_bytes=10, kv_slot_bytes=1, prompt_len=2, group_size=2, data=1)
    dense = pe.sampler_call_seconds(m, [3, 3], RATES, new_tokens=3, cache="dense", buckets=1)
    assert dense["steps"] == 2 and dense["seconds"] == pytest.approx(2 * (10 + 4 + 4))
    shared = pe.sampler_call_seconds(
        m, [3, 3], RATES, new_tokens=3, cache="prefix_shared", buckets=1
    )
    assert shared["seconds"] == pytest.approx(2 * (10 + 2 + 4))
    # exact reads: 1 then 2 filled slots per row, the prefix once per group
    assert pe.call_seconds(m, [3, 3], RATES)["seconds"] == pytest.approx(
        (10 + 2 + 2) + (10 + 2 + 4)
    )


def test_the_built_paged_kernel_reads_the_prompt_once_per_group_and_skips_finished_rows():
    # one group of G = 2 rows, prompts of 2 slots, 3 new tokens, rows of 3 and 2 tokens. Pages
    # and kernel blocks of 1 slot: step 1 reads the group's prompt once (2 slots) and 1 own
    # slot per row; step 2 (row 1 finished) the prompt and row 0's 2 slots: 14 + 14 bytes,
    # as exact reads; a prompt read once per row would be 16 + 14
    m = pe.DecodeModel(param_bytes=10, kv_slot_bytes=1, prompt_len=2, group_size=2, data=1)
    kw = dict(new_tokens=3, cache="paged")
    out = pe.sampler_call_seconds(m, [3, 2], RATES, **kw, page_size=1, compute_tokens=1)
    assert out["steps"] == 2 and out["seconds"] == pytest.approx(28)
    assert out["reads"] == pytest.approx({"params": 10, "prefix": 2, "completion": 2})
    assert pe.call_seconds(m, [3, 2], RATES)["seconds"] == pytest.approx(28)
    # pages and blocks of 4 slots: no full prompt page (the 2 prompt tokens are each row's
    # partial page), each live row reads its one page: 10 + 2 x 4 and 10 + 4
    out = pe.sampler_call_seconds(m, [3, 2], RATES, **kw, page_size=4, compute_tokens=4)
    assert out["seconds"] == pytest.approx(32)
    assert out["reads"] == pytest.approx({"params": 10, "prefix": 3, "completion": 3})


def test_the_headline_is_the_chips_built_decode():
    from experiments import aot

    assert pe.built_decode(aot.CHIPS["v5p"]) == "paged"  # the Pallas TPU kernel
    assert pe.built_decode(aot.CHIPS["h100"]) == "xla_prefix_shared"
