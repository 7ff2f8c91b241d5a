"""The paged decode cache (``SamplingConfig.decode_cache="paged"``): the same rollouts as the
dense cache for ragged prompts and groups, the page layout and page table against a
hand-built case, the Pallas TPU kernel (in JAX's TPU interpreter) against the XLA path, the
analytic page reads (`sampling.decode_read_bytes(layout="paged")`) by hand, and the sampler
with the Pallas kernel compiled for a TPU by libtpu (nothing runs).

Reference for the rollouts: the dense decode (itself checked against a full-recompute decoder
in tests/test_sampling_decode.py), with the same key: tokens must match exactly and log-probs
to float rounding (the paged attention output is a sum of two products, not one).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_sampling_prefix import CFG, GD, PARAMS, PROMPTS, _assert_same_rollouts, _left_pad

from grpo_jax import config_schema, config_utils, experiment
from grpo_jax.config_schema import base_config
from grpo_jax.errors import ConfigError
from grpo_jax.models import attention
from grpo_jax.models.paged_cache import PagedDecodeCache
from grpo_jax.models.transformer import DecodeCache, random_params
from grpo_jax.sampling import SamplingConfig, decode_read_bytes


@pytest.mark.parametrize(
    "temperature,top_k,top_p,group,page_size,budgets",
    [
        # greedy, groups of 4, pages of 4 (prompts 2, 5, 7, 3: full pages 0 or 1, partial ones)
        (0.0, 0, 1.0, 4, 4, False),
        # sampled with one key, groups of 2, pages of 3, per-row budgets
        (1.0, 0, 1.0, 2, 3, True),
        # truncated sampling, no groups, one page larger than every prompt (no shared page;
        # slow: ~30 s on 2 busy cores, as each case)
        pytest.param(0.8, 5, 0.9, 1, 16, True, marks=pytest.mark.slow),
    ],
)
def test_paged_decode_equals_dense(temperature, top_k, top_p, group, page_size, budgets):
    prompts = [p for p in PROMPTS for _ in range(group)]
    toks, mask = _left_pad(prompts, 7)
    dense = SamplingConfig(
        max_new_tokens=40,  # 39 decode steps: 3 attention buckets (the own pages grow twice)
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_ids=(7, 21),
        prompt_group_size=group,
    )
    paged = dataclasses.replace(dense, decode_cache="paged", page_size=page_size)
    lengths = (
        jnp.asarray(np.random.default_rng(3).integers(1, 41, len(prompts)), jnp.int32)
        if budgets
        else None
    )
    _assert_same_rollouts(GD, PARAMS, toks, mask, dense, paged, lengths, group, atol=2e-5)


@pytest.mark.slow  # ~35 s on 2 busy cores
def test_paged_decode_equals_dense_in_bfloat16():
    # bfloat16 weights and pages: the two partial value products are summed in float32 and
    # rounded once, as the prefix-shared decode's
    cfg = CFG.replace(dtype="bfloat16", param_dtype="bfloat16")
    graphdef, params = random_params(cfg, 1, stddev=0.2)
    toks, mask = _left_pad([p for p in PROMPTS for _ in range(2)], 7)
    dense = SamplingConfig(max_new_tokens=24, eos_ids=(7, 21), prompt_group_size=2)
    paged = dataclasses.replace(dense, decode_cache="paged", page_size=4)
    lengths = jnp.asarray(np.random.default_rng(4).integers(1, 25, 8), jnp.int32)
    _assert_same_rollouts(graphdef, params, toks, mask, dense, paged, lengths, 2, atol=1e-2)


def _prompt_cache(lengths, Lp, K=1, D=1):
    """A prefill `DecodeCache` of len(lengths) left-padded prompts whose key at slot s of row
    p is 100 p + s (values: minus that), so every page slot says where it came from."""
    P = len(lengths)
    s = np.arange(Lp)
    k = (100 * np.arange(P)[:, None] + s[None]).astype(np.float32)
    k = np.broadcast_to(k[:, None, :, None], (P, K, Lp, D))
    mask = s[None] >= Lp - np.asarray(lengths)[:, None]
    return DecodeCache(
        k=(jnp.asarray(k),),
        v=(jnp.asarray(-k),),
        key_mask=jnp.asarray(mask),
        index=jnp.asarray(Lp, jnp.int32),
    )


def test_page_layout_and_table_by_hand():
    # 2 groups of 2 rows, Lp 7, pages of 3: prompt 0 has 5 tokens (slots 2..6), prompt 1 has
    # 3 (slots 4..6); fp = 7 // 3 = 2 shared pages per group; 4 completion slots to attend:
    # own pages ceil((3 - 1 + 4) / 3) = 2 per row, so 2 + 2 x 2 = 6 pages per group
    cache = PagedDecodeCache.from_prefill(_prompt_cache([5, 3], 7), rows=4, slots=11, page_size=3)
    k = np.asarray(cache.k[0])[0, :, :, :, 0]  # [P, 6 pages, 3 slots]
    assert k.shape == (2, 6, 3) and cache.shared_pages == 2 and cache.own_pages == 2
    np.testing.assert_array_equal(cache.prefix_len, [5, 3])
    # group 0: its 5 tokens left-aligned, 2, 3, 4 | 5, 6 (page 1 is partial: 5 // 3 = 1 full)
    np.testing.assert_array_equal(k[0, 0], [2, 3, 4])
    # each row's first own page holds the partial page's tokens 5, 6 (copied), then empty
    for row_page in (2, 4):
        np.testing.assert_array_equal(k[0, row_page], [5, 6, 0])
        np.testing.assert_array_equal(k[0, row_page + 1], [0, 0, 0])
    # group 1: 3 tokens = one full page 104, 105, 106; the rows' own pages start empty
    np.testing.assert_array_equal(k[1, 0], [104, 105, 106])
    np.testing.assert_array_equal(k[1, 2], [0, 0, 0])
    np.testing.assert_array_equal(np.asarray(cache.v[0])[0, 1, 0, :, 0], [-104, -105, -106])
    # row r's pages in sequence order (flattened over groups: group 1 starts at page 6):
    # row 0: shared 0, own 2, 3; row 1: shared 0, own 4, 5; rows 2, 3: shared 6, own 8, 9 / 10, 11
    table = attention.paged_table(cache.prefix_len, 4, 2, 6, 3)
    np.testing.assert_array_equal(
        table, [[0, 2, 3, 3], [0, 4, 5, 5], [6, 8, 9, 9], [6, 10, 11, 11]]
    )
    # writing a completion token: row 0 at own slot 5 % 3 + 0 = 2 of its first own page;
    # row 2 (prompt 3 tokens) at own slot 0 of page 2 of group 1
    new = jnp.arange(1, 5, dtype=jnp.float32).reshape(4, 1, 1, 1) * 1000
    k = np.asarray(cache.put(cache.k[0], new))[0, :, :, :, 0]
    np.testing.assert_array_equal(k[0, 2], [5, 6, 1000])
    np.testing.assert_array_equal(k[0, 4], [5, 6, 2000])
    np.testing.assert_array_equal(k[1, 2], [3000, 0, 0])
    np.testing.assert_array_equal(cache.own_len(), [3, 3, 1, 1])
    # growing to 14 slots: 3 own pages per row, the old ones kept in place per row
    grown = cache.grow(14)
    g = np.asarray(grown.k[0])[0, :, :, :, 0]
    assert g.shape == (2, 8, 3) and grown.own_pages == 3
    np.testing.assert_array_equal(g[0, 2:8:3], [[5, 6, 0], [5, 6, 0]])
    with pytest.raises(ValueError, match="own pages"):
        grown.grow(11)


def _random_paged_layer(seed, P=2, G=2, K=2, D=128, Lp=13, ps=4, prompt_lengths=(10, 3)):
    """A `PagedDecodeCache` with two completion tokens written (values bfloat16-exact, so the
    TPU interpreter's bfloat16 matmul passes lose nothing on the products)."""
    keys = jax.random.split(jax.random.key(seed), 6)
    bf = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)
    mask = np.arange(Lp)[None] >= Lp - np.asarray(prompt_lengths)[:, None]
    prompt = DecodeCache(
        k=(bf(jax.random.normal(keys[0], (P, K, Lp, D))),),
        v=(bf(jax.random.normal(keys[1], (P, K, Lp, D))),),
        key_mask=jnp.asarray(mask),
        index=jnp.asarray(Lp, jnp.int32),
    )
    cache = PagedDecodeCache.from_prefill(prompt, P * G, Lp + 6, page_size=ps)
    for i in range(2):
        new = bf(jax.random.normal(keys[2 + i], (P * G, 1, K, D)))
        cache = cache.replace(
            k=(cache.put(cache.k[0], new),), v=(cache.put(cache.v[0], -new),), index=cache.index + 1
        )
    q = bf(jax.random.normal(keys[5], (P * G, 1, 2 * K, D)) * D**-0.5)
    # the step attends after writing its token: own_len counts the last written one
    return q, cache, cache.replace(index=cache.index - 1).own_len()


def test_xla_paged_kernel_equals_softmax_over_each_rows_sequence():
    # the XLA path against an independent gather: each row's keys in sequence order from
    # `paged_table`, its first prompt + 2 slots visible, softmax over them
    q, cache, own_len = _random_paged_layer(0, D=8)
    out = attention.paged_decode_xla(
        q, cache.k[0], cache.v[0], cache.prefix_len, own_len, cache.shared_pages
    )
    K, P, ppg, ps, D = cache.k[0].shape
    table = np.asarray(attention.paged_table(cache.prefix_len, 4, cache.shared_pages, ppg, ps))
    ks = np.asarray(cache.k[0]).reshape(K, P * ppg, ps, D)
    vs = np.asarray(cache.v[0]).reshape(K, P * ppg, ps, D)
    for r, n in enumerate(np.repeat(np.asarray(cache.prefix_len), 2)):
        kr = ks[:, table[r]].reshape(K, -1, D)[:, : n + 2]  # [K, n + 2, D]
        vr = vs[:, table[r]].reshape(K, -1, D)[:, : n + 2]
        qr = np.asarray(q[r, 0]).reshape(K, 2, D)
        s = np.einsum("kgd,ksd->kgs", qr, kr) * D**-0.5
        p = np.exp(s - s.max(-1, keepdims=True))
        ref = np.einsum("kgs,ksd->kgd", p / p.sum(-1, keepdims=True), vr).reshape(-1, D)
        np.testing.assert_allclose(out[r, 0], ref, atol=1e-5)


@pytest.mark.parametrize("group,prompt_lengths", [(2, (10, 3)), (4, (13, 2))])
def test_pallas_tpu_kernel_in_interpret_mode_equals_the_xla_path(group, prompt_lengths):
    # JAX's Pallas TPU paged-attention kernel run by the TPU interpreter on the CPU (~5 s);
    # head_dim 128 (the kernel's lane tiling); ragged prompts over pages of 4; groups of 2 and
    # 4 (the prefix call's query block: 4 and 8 rows of the kv head's queries); the rows not
    # live (finished) may differ but stay finite
    q, cache, own_len = _random_paged_layer(1, G=group, prompt_lengths=prompt_lengths)
    args = (q, cache.k[0], cache.v[0], cache.prefix_len, own_len, cache.shared_pages)
    ref = attention.paged_decode_xla(*args)
    out = attention.paged_decode_pallas_tpu(*args, interpret=True)
    np.testing.assert_allclose(out, ref, atol=1e-4)
    live = jnp.arange(q.shape[0]) % 3 != 1
    live = live.at[:group].set(False)  # group 0 has no live row: it reads no prefix
    out = attention.paged_decode_pallas_tpu(*args, live=live, interpret=True)
    np.testing.assert_allclose(out[live], ref[live], atol=1e-4)
    assert np.isfinite(np.asarray(out)).all()
    assert attention.paged_kernel("splash") == "pallas_tpu"
    assert attention.paged_kernel("einsum") == attention.paged_kernel("cudnn") == "xla"


def test_pallas_kernel_reads_each_groups_prompt_once_and_only_live_rows(monkeypatch):
    # what the two kernel calls are asked to read: the prefix call one sequence per GROUP (its
    # G rows' queries together) of its full shared pages, 0 keys for a group with no live row;
    # the own call one sequence per row of its own_len slots, 0 for a row not live
    calls = []
    real = attention._pallas_paged_lse

    def spy(q, k_pages, v_pages, lengths, table, interpret=False):
        calls.append((q.shape, np.asarray(lengths), np.asarray(table)))
        return real(q, k_pages, v_pages, lengths, table, interpret)

    monkeypatch.setattr(attention, "_pallas_paged_lse", spy)
    q, cache, own_len = _random_paged_layer(2, G=2, prompt_lengths=(10, 3))  # pages of 4
    live = jnp.asarray([True, False, False, False])  # group 1 has no live row
    attention.paged_decode_pallas_tpu(
        q,
        cache.k[0],
        cache.v[0],
        cache.prefix_len,
        own_len,
        cache.shared_pages,
        live=live,
        interpret=True,
    )
    (own_q, own_lengths, own_table), (pre_q, pre_lengths, pre_table) = calls
    # 2 kv heads, 2 groups; prompt budget 13 over pages of 4: 3 shared pages per group, then 3
    # own pages per row (9 per group)
    K, P, ppg, ps, D = cache.k[0].shape
    assert (K, P, ppg, ps) == (2, 2, 9, 4)
    # rows x 4 heads; groups x (2 kv heads x G rows x 2 heads each)
    assert own_q == (4, 4, D) and pre_q == (2, 8, D)
    np.testing.assert_array_equal(own_lengths, [4, 0, 0, 0])  # 10 % 4 + 2 completion slots
    # row 1: group 0's pages 6-8, the table padded with its last page to the kernel's block
    # (128 keys: 32 pages of 4)
    assert own_table.shape == (4, 32) and pre_table.shape == (2, 32)
    np.testing.assert_array_equal(own_table[1], [6, 7] + [8] * 30)
    np.testing.assert_array_equal(pre_lengths, [8, 0])  # group 0: 2 full pages; group 1: none
    np.testing.assert_array_equal(pre_table, [[0, 1] + [2] * 30, [9, 10] + [11] * 30])


def test_sampler_with_the_pallas_kernel_in_interpret_mode_equals_dense(monkeypatch):
    # the whole paged sampler with the Pallas TPU kernel (TPU interpreter) in its decode loop,
    # finished rows skipped, against the dense decode, greedy: the same tokens; log-probs to
    # the interpreter's rounding (its float32 matmuls take bfloat16 passes, as a TPU's default
    # precision: ~1e-2 here; a wrong key read would move them by O(1))
    import functools

    kernel = functools.partial(attention.paged_decode_pallas_tpu, interpret=True)
    monkeypatch.setitem(attention.PAGED_DECODE_KERNELS, "interpreted", kernel)
    monkeypatch.setitem(attention.PAGED_KERNEL_OF_IMPL, "einsum", "interpreted")
    assert attention.paged_kernel("einsum") == "interpreted"
    toks, mask = _left_pad([p for p in PROMPTS for _ in range(2)], 7)
    dense = SamplingConfig(max_new_tokens=12, eos_ids=(7, 21), prompt_group_size=2, temperature=0.0)
    paged = dataclasses.replace(dense, decode_cache="paged", page_size=4)
    lengths = jnp.asarray([3, 12, 1, 7, 12, 5, 9, 2], jnp.int32)
    _assert_same_rollouts(GD, PARAMS, toks, mask, dense, paged, lengths, 2, atol=3e-2)


def test_decode_read_bytes_paged_by_hand():
    # 1000 parameter bytes, 10 KV bytes per slot, 8 rows in groups of 4, prompt budget 5,
    # 3 new tokens (decode steps 1 and 2), pages of 4 read one page per kernel block; prompts
    # of 5 tokens (group 0) and 2 (group 1). Per step while live: group 0 its 1 full page once
    # (4 slots), group 1 none; rows 0-3 own slots 1 + i -> 1 page (4 slots, 1 of them prompt),
    # rows 4-7 own slots 2 + i -> 1 page (2 of them prompt).
    kw = dict(param_bytes=1000, kv_bytes_per_slot=10, rows=8, group_size=4, prompt_len=5)
    kw |= dict(new_tokens=3, layout="paged", page_size=4, compute_tokens=4)
    prompts = [5] * 4 + [2] * 4
    # every row to 3 tokens: per step prefix 4 + 4 x 1 + 4 x 2 = 16 slots, own completion
    # 4 x 3 + 4 x 2 = 20; 2 steps, 16 tokens decoded
    paged = decode_read_bytes(**kw, prompt_lengths=prompts)
    assert paged == {"params": 125.0, "prefix": 20.0, "completion": 25.0, "total": 170.0}
    # group 1 ends after 2 tokens: it reads nothing at step 2 (prefix 8, completion 12 then);
    # 12 tokens decoded
    paged = decode_read_bytes(**kw, prompt_lengths=prompts, lengths=[3] * 4 + [2] * 4)
    assert paged["params"] == pytest.approx(2000 / 12)
    assert paged["prefix"] == pytest.approx(240 / 12)
    assert paged["completion"] == pytest.approx(320 / 12)
    # the kernel's default block (128 keys = 32 pages of 4): 128 slots a row and step
    rounded = decode_read_bytes(**(kw | {"compute_tokens": None}), prompt_lengths=prompts)
    assert rounded["completion"] == pytest.approx(2 * (4 * 127 + 4 * 126) * 10 / 16)
    # pages and blocks of 1 slot read exactly the filled ones, the prompt once per group:
    # the prefix-shared formula of a ragged kernel
    exact = decode_read_bytes(**(kw | {"page_size": 1, "compute_tokens": 1}))
    kw_xla = {k: v for k, v in kw.items() if k not in ("layout", "page_size", "compute_tokens")}
    ragged = decode_read_bytes(**kw_xla, layout="prefix_shared", buckets=None)
    assert exact == pytest.approx(ragged)
    with pytest.raises(ValueError, match="prompt_lengths"):
        decode_read_bytes(**kw, prompt_lengths=[6] * 8)
    with pytest.raises(ValueError, match="page_size"):
        decode_read_bytes(**(kw | {"page_size": 0}))


def test_paged_config_is_validated_and_reaches_both_samplers():
    c = base_config()
    c.rollout.decode_cache, c.rollout.page_size = "paged", 8
    config_utils.validate(c)
    train, evaluation = experiment._sampling_configs(config_schema.typed(c), None, 4)
    assert (train.decode_cache, evaluation.decode_cache) == ("paged", "paged")
    assert (train.page_size, evaluation.page_size) == (8, 8)
    c.rollout.page_size = 0
    with pytest.raises(ConfigError, match="rollout.page_size"):
        config_utils.validate(c)
    c.rollout.page_size, c.rollout.decode_slots = 8, 4
    with pytest.raises(ConfigError, match="decode_slots=0"):
        config_utils.validate(c)
    with pytest.raises(ValueError, match="static batching"):
        SamplingConfig(max_new_tokens=4, decode_slots=4, decode_cache="paged")
    with pytest.raises(ValueError, match="page_size"):
        SamplingConfig(max_new_tokens=4, decode_cache="paged", page_size=0)


@pytest.mark.slow  # ~20-40 s: libtpu compiles the sampler
@pytest.mark.parametrize("axes", [("data",), ("data", "tensor")])
def test_sampler_with_paged_cache_and_pallas_kernel_compiles_for_tpu(axes):
    # the whole sampler (prefill + decode loops) with the paged cache, attention_impl splash
    # (prefill: splash kernel; decode: the Pallas paged kernel), rows over the 4 chips of a
    # v5e:2x2 topology, or rows over 2 and kv heads over 2 (each chip's kernel then sees its
    # own heads), compiled by the real TPU compiler; nothing runs
    import re

    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from experiments import aot
    from grpo_jax import sampling
    from grpo_jax.models import get_preset
    from grpo_jax.models.transformer import Transformer

    if aot.libtpu_missing():
        pytest.skip(aot.libtpu_missing())
    mesh = Mesh(np.asarray(aot.tpu_devices("v5e-4")).reshape({1: (4,), 2: (2, 2)}[len(axes)]), axes)
    cfg = get_preset(
        "tiny",
        vocab_size=512,
        num_layers=2,
        head_dim=128,
        dtype="bfloat16",
        param_dtype="bfloat16",
        attention_impl="splash",
    )
    graphdef, abstract = nnx.split(
        nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))), nnx.Param
    )
    repl = NamedSharding(mesh, PartitionSpec())
    rows = NamedSharding(mesh, PartitionSpec("data"))
    spec = lambda shape, dtype, s=repl: jax.ShapeDtypeStruct(shape, dtype, sharding=s)
    params = jax.tree.map(lambda x: spec(x.shape, x.dtype), abstract)
    sc = SamplingConfig(max_new_tokens=32, prompt_group_size=2, decode_cache="paged")
    compiled, _ = aot._compile_for(
        sampling._generate,
        graphdef,
        params,
        spec((8, 32), jnp.int32, rows),
        spec((8, 32), jnp.bool_, rows),
        spec((2,), jnp.uint32),
        sc,
        mesh=mesh,
        platform="tpu",
    )
    hlo = compiled.as_text()
    kernels = re.findall(r'custom_call_target="tpu_custom_call"[^\n]*?op_name="([^"]+)"', hlo)
    # the decode loop runs the kernel per chip on its own rows (`attention._sharded`), twice per
    # layer in each decode chunk's loop: the group's shared prompt pages once, then each row's
    # own pages
    decode = [k for k in kernels if "while/body/shard_map" in k and "paged_attention_lse" in k]
    chunks = len(sampling.decode_buckets(32, 32, sc.attention_buckets))
    assert len(decode) == 2 * cfg.num_layers * chunks, kernels


def test_paged_decode_on_a_data_fsdp_mesh():
    # 4 groups of 2 rows over a 2 x 2 data x fsdp mesh: the rollouts of the unsharded dense
    # decode, and the pages stay sharded with the rows
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from grpo_jax import sharding
    from grpo_jax.sampling import generate

    devices = jax.devices()
    if len(devices) < 4:
        pytest.skip("needs 4 devices (conftest sets 8 virtual CPU devices)")
    mesh = Mesh(np.asarray(devices[:4]).reshape(2, 2), ("data", "fsdp"))
    toks, mask = _left_pad([p for p in PROMPTS for _ in range(2)], 7)
    cfg = SamplingConfig(max_new_tokens=6, temperature=0.0, prompt_group_size=2)
    ref = generate(GD, PARAMS, toks, mask, jax.random.key(0), cfg)
    rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    params = jax.device_put(PARAMS, NamedSharding(mesh, PartitionSpec()))
    out = sharding.under_mesh(mesh, generate)(
        GD,
        params,
        jax.device_put(toks, rows),
        jax.device_put(mask, rows),
        jax.random.key(0),
        dataclasses.replace(cfg, decode_cache="paged", page_size=2),
    )
    np.testing.assert_array_equal(out.completion_tokens, ref.completion_tokens)
    np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=2e-5)
    assert len(out.completion_tokens.sharding.device_set) == 4
