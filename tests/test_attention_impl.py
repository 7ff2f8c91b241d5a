"""The attention cores (`grpo_jax.models.attention`, `model.attention_impl`): the blockwise
online-softmax kernel and the Pallas splash kernel (interpreted on the CPU) against the einsum
reference, alone and inside the model (`steps.completion_logprobs`, per row and shared
prompt, with LoRA, under remat, with KV caches); the config wiring; and the TPU compiler's
temporary memory of the update with splash vs einsum (libtpu, no TPU needed)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_jax import steps
from grpo_jax.errors import ConfigError
from grpo_jax.models import attention as A
from grpo_jax.models import config as model_config_lib
from grpo_jax.models import get_preset, transformer

F32_TOL = 1e-5


def _qkv(B, T, S, H, K, D, dtype=jnp.float32, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.normal(size=s) * scale, dtype)
    return f(B, T, H, D), f(B, S, K, D), f(B, S, K, D)


def _left_padded(B, S, pads):
    return jnp.asarray(np.arange(S)[None] >= np.asarray(pads)[:, None])


def _grads(fn, q, k, v, w):
    return jax.grad(lambda q, k, v: (fn(q, k, v).astype(jnp.float32) * w).sum(), (0, 1, 2))(q, k, v)


def _check(mask, q, k, v, tol, **kw):
    """blockwise == einsum on every row with a visible key: values and d/dq, d/dk, d/dv (the
    cotangent is zero on fully masked rows, which no real token reads); finite everywhere."""
    T = q.shape[1]
    dense = mask.dense(T)
    rows = dense.any(-1)  # [B, T]
    w = jnp.asarray(np.random.default_rng(9).normal(size=q.shape), jnp.float32)
    w = w * rows[..., None, None]

    @jax.jit  # one program per case, as the model runs it (eagerly: ~140 tiny compiles)
    def both(q, k, v, w):
        ref = A.einsum_attention(q, k, v, dense)
        out = A.blockwise_attention(q, k, v, mask, **kw)
        g_ref = _grads(lambda q, k, v: A.einsum_attention(q, k, v, dense), q, k, v, w)
        g = _grads(lambda q, k, v: A.blockwise_attention(q, k, v, mask, **kw), q, k, v, w)
        return ref, out, g_ref, g

    ref, out, g_ref, g = both(q, k, v, w)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert bool(jnp.isfinite(out.astype(jnp.float32)).all())
    diff = jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32)).max((-1, -2))
    assert float(jnp.where(rows, diff, 0).max()) <= tol
    for a, b, name in zip(g_ref, g, "qkv"):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        assert bool(jnp.isfinite(b).all()), name
        scale = max(1.0, float(jnp.abs(a).max()))
        assert float(jnp.abs(a - b).max()) <= tol * scale, (name, float(jnp.abs(a - b).max()))


# ----------------------------------------------------------------------------- the kernel


@pytest.mark.parametrize(
    "T,blocks",
    [(37, (512, 512)), (37, (8, 8)), (37, (16, 8)), (37, (8, 24)), (64, (16, 16))],
)
def test_blockwise_matches_einsum_left_padded_causal_gqa_odd_lengths(T, blocks):
    q, k, v = _qkv(3, T, T, 4, 2, 16)  # GQA: 4 query heads over 2 kv heads
    mask = A.Mask(_left_padded(3, T, [0, 5, T - 1]), offset=0)
    _check(mask, q, k, v, F32_TOL, block_q=blocks[0], block_k=blocks[1])


@pytest.mark.slow
@settings(max_examples=8, deadline=None)
@given(
    T=st.integers(1, 40),
    extra=st.integers(0, 9),
    pad=st.integers(0, 12),
    bq=st.sampled_from([4, 8, 512]),
    bk=st.sampled_from([4, 8, 512]),
    causal=st.booleans(),
)
def test_blockwise_matches_einsum_property(T, extra, pad, bq, bk, causal):
    """Random lengths (S = T + extra keys before the queries, a cache's layout), left padding,
    tile sizes and causal / non-causal masks."""
    S = T + extra
    q, k, v = _qkv(2, T, S, 4, 2, 8, seed=T * 31 + extra)
    mask = A.Mask(_left_padded(2, S, [0, min(pad, S)]), offset=extra if causal else None)
    _check(mask, q, k, v, F32_TOL, block_q=bq, block_k=bk)


def test_blockwise_bfloat16_close_to_einsum():
    q, k, v = _qkv(2, 45, 45, 4, 2, 16, dtype=jnp.bfloat16)
    mask = A.Mask(_left_padded(2, 45, [0, 7]), offset=0)
    _check(mask, q, k, v, 3e-2, block_q=16, block_k=16)


def test_blockwise_traced_cache_offset_matches_einsum():
    """A KV cache's prefill: queries at slots q_start + t over S cache slots (q_start traced)."""
    q, k, v = _qkv(2, 9, 30, 4, 2, 16)
    km = _left_padded(2, 30, [0, 3])

    @jax.jit
    def run(q_start):
        mask = A.Mask(km, q_start=q_start)
        return A.blockwise_attention(q, k, v, mask, block_q=4, block_k=8), mask.dense(9)

    out, dense = run(jnp.int32(6))
    ref = A.einsum_attention(q, k, v, dense)
    np.testing.assert_allclose(out, ref, atol=F32_TOL)


def test_blockwise_kv_layout_bksd_equals_bskd():
    q, k, v = _qkv(2, 20, 20, 4, 2, 16)
    mask = A.Mask(_left_padded(2, 20, [0, 4]))
    a = A.blockwise_attention(q, k, v, mask, block_q=8, block_k=8)
    b = A.blockwise_attention(
        q, k.swapaxes(1, 2), v.swapaxes(1, 2), mask, "bksd", block_q=8, block_k=8
    )
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_fully_masked_rows_are_finite_with_finite_gradients():
    """Rows with no visible key (all keys padding): output 0, lse _NEG_INF, and gradients
    finite (no NaN) even with a non-zero cotangent on those rows."""
    q, k, v = _qkv(2, 12, 12, 4, 2, 8)
    km = jnp.asarray(np.stack([np.zeros(12, bool), np.arange(12) >= 5]))  # row 0: all padding
    mask = A.Mask(km, offset=0)
    with_lse = jax.jit(
        lambda q: A.blockwise_attention(q, k, v, mask, block_q=4, block_k=4, return_lse=True)
    )
    o, lse = with_lse(q)
    assert bool(jnp.isfinite(o).all()) and bool(jnp.isfinite(lse).all())
    np.testing.assert_array_equal(o[0], 0.0)
    np.testing.assert_array_equal(o[1, :5], 0.0)  # the left-padding queries of row 1
    assert float(lse[0].max()) <= A._NEG_INF / 2
    w = jnp.ones_like(q)
    attend = lambda q, k, v: A.blockwise_attention(q, k, v, mask, block_q=4, block_k=4)
    for g in jax.jit(lambda q, k, v: _grads(attend, q, k, v, w))(q, k, v):
        assert bool(jnp.isfinite(g).all())
    g_lse = jax.jit(jax.grad(lambda q: with_lse(q)[1].sum()))(q)
    assert bool(jnp.isfinite(g_lse).all())


def test_lse_merge_equals_attention_over_concatenated_keys():
    """`attend_shared_prefix` (blockwise: two partial attentions merged by their log-sum-exps,
    with gradients through lse) == the einsum over [prompt keys, own completion keys]."""
    P, G, Lp, Lc, H, K, D = 2, 3, 11, 9, 4, 2, 16
    R = P * G
    rng = np.random.default_rng(3)
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
    qc, kp, vp, kc, vc = (
        f(R, Lc, H, D),
        f(P, Lp, K, D),
        f(P, Lp, K, D),
        f(R, Lc, K, D),
        f(R, Lc, K, D),
    )
    pm = _left_padded(P, Lp, [0, 4])
    cm = jnp.asarray(np.arange(Lc)[None] < rng.integers(1, Lc + 1, (R, 1)))

    def reference(qc, kp, vp, kc, vc):
        rep = lambda x: jnp.repeat(x, G, axis=0)
        keys, values = jnp.concatenate([rep(kp), kc], 1), jnp.concatenate([rep(vp), vc], 1)
        mask = A.Mask(jnp.concatenate([rep(pm), cm], 1), offset=Lp)
        return A.einsum_attention(qc, keys, values, mask.dense(Lc))

    def merged(qc, kp, vp, kc, vc):
        return A.attend_shared_prefix(qc, kp, vp, pm, kc, vc, cm, "blockwise")

    args = (qc, kp, vp, kc, vc)
    merged, reference = jax.jit(merged), jax.jit(reference)  # one program each, not ~100 eager
    np.testing.assert_allclose(merged(*args), reference(*args), atol=F32_TOL)
    w = f(R, Lc, H, D)
    grads = lambda fn: jax.jit(jax.grad(lambda *a: (fn(*a) * w).sum(), tuple(range(5))))
    loss = lambda fn: grads(fn)(*args)
    for a, b in zip(loss(reference), loss(merged)):
        np.testing.assert_allclose(a, b, atol=F32_TOL)


# ----------------------------------------------------------------------------- the model


def _model_case(impl, group, lora_rank=0, remat=False, seed=0):
    cfg = get_preset("tiny").replace(
        attention_impl=impl, lora_rank=lora_rank, remat=remat, num_layers=2
    )
    graphdef, params = transformer.random_params(cfg, seed, stddev=0.2)
    if lora_rank:  # non-zero B so that the adapters act
        params = jax.tree_util.tree_map_with_path(
            lambda p, x: x + 0.1 if "lora_b" in jax.tree_util.keystr(p) else x, params
        )
    return graphdef, params


def _batch(vocab, R, G, Lp, Lc, seed=1):
    rng = np.random.default_rng(seed)
    prompt = np.repeat(rng.integers(1, vocab, (R // G, Lp)), G, 0)
    toks = np.concatenate([prompt, rng.integers(1, vocab, (R, Lc))], 1)
    pm = np.arange(Lp)[None] >= rng.integers(0, Lp // 2, (R // G, 1))  # left padding
    cm = np.arange(Lc)[None] < rng.integers(1, Lc + 1, (R, 1))  # right padding (EOS)
    mask = np.concatenate([np.repeat(pm, G, 0), cm], 1)
    return jnp.asarray(toks), jnp.asarray(mask), jnp.asarray(cm, jnp.float32)


def _logprobs_and_grad(impl, group, Lp, toks, mask, cm, **kw):
    graphdef, params = _model_case(impl, group, **kw)
    adv = jnp.linspace(-1.0, 1.0, toks.shape[0])[:, None]

    def loss(p):
        lp = steps.completion_logprobs(graphdef, p, toks, mask, Lp, 1.0, group)
        return -(jnp.exp(lp - jax.lax.stop_gradient(lp)) * adv * cm).sum(), lp

    (_, lp), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return lp, g


def _assert_same(a, b, cm, tol=F32_TOL, grad_tol=None):
    (lp_a, g_a), (lp_b, g_b) = a, b
    grad_tol = tol if grad_tol is None else grad_tol
    np.testing.assert_allclose(lp_a * cm, lp_b * cm, atol=tol)  # on the scored positions
    assert jax.tree.structure(g_a) == jax.tree.structure(g_b)
    for x, y in zip(jax.tree.leaves(g_a), jax.tree.leaves(g_b)):
        np.testing.assert_allclose(x, y, atol=grad_tol * max(1.0, float(jnp.abs(x).max())))
    assert any(float(jnp.abs(x).max()) > 0 for x in jax.tree.leaves(g_a))


@pytest.mark.parametrize(
    "group,lora_rank,remat", [(1, 0, False), (4, 0, False), (4, 2, False), (1, 2, True)]
)
def test_model_logprobs_and_gradients_blockwise_equal_einsum(group, lora_rank, remat):
    """`completion_logprobs` and the gradient of a policy-gradient loss: per row (group 1) and
    with the shared-prompt forward (group 4), with LoRA adapters on q/k/v/o and the MLP, and
    under model.remat; GQA 4:2, left-padded prompts, right-padded completions."""
    R, Lp, Lc = 8, 13, 11
    cfg = get_preset("tiny")
    toks, mask, cm = _batch(cfg.vocab_size, R, 4, Lp, Lc)
    kw = dict(lora_rank=lora_rank, remat=remat)
    ref = _logprobs_and_grad("einsum", group, Lp, toks, mask, cm, **kw)
    new = _logprobs_and_grad("blockwise", group, Lp, toks, mask, cm, **kw)
    # float32 gradients of entries ~8 through two softmax orders: 3e-5 of the largest entry
    # (measured up to 3.2e-5 at LLVM -O0, tests/conftest.py); a masking error is O(1)
    _assert_same(ref, new, cm, grad_tol=5e-5)


def test_model_kv_cache_prefill_and_decode_blockwise_equal_einsum():
    """Prefill through a KVCache and a DecodeCache (T > 1: blockwise with the cache's traced
    write index) and one decode step (always the einsum)."""
    B, Lp = 2, 9
    toks = jax.random.randint(jax.random.key(0), (B, Lp + 1), 1, 100)
    pm = _left_padded(B, Lp + 1, [0, 3])
    pos = transformer.positions_from_mask(pm)
    from flax import nnx

    outs = {}
    for impl in ("einsum", "blockwise"):
        g, p = _model_case(impl, 1)
        cfg = nnx.merge(g, p).config
        res = []
        for init in (transformer.init_cache, transformer.init_decode_cache):

            @jax.jit  # as the sampler runs it (eagerly: ~120 op-by-op compiles per case)
            def prefill_and_decode(p, cache, g=g):
                model = nnx.merge(g, p)
                lg1, cache = model(toks[:, :Lp], pos[:, :Lp], pm[:, :Lp], cache=cache)
                lg2, _ = model(toks[:, Lp:], pos[:, Lp:], pm[:, Lp:], cache=cache)
                return lg1, lg2

            res.append(prefill_and_decode(p, init(cfg, B, Lp + 4)))
        outs[impl] = res
    rows = pm[:, :Lp]  # real prompt positions
    for (a1, a2), (b1, b2) in zip(outs["einsum"], outs["blockwise"]):
        np.testing.assert_allclose(a1 * rows[..., None], b1 * rows[..., None], atol=F32_TOL)
        np.testing.assert_allclose(a2, b2, atol=F32_TOL)


def test_prefill_into_a_fresh_cache_gives_the_fused_kernels_a_static_mask(monkeypatch):
    """The samplers' prefill (T prompt tokens, ``attend_len=T``: written at slot 0) hands the
    attention a static causal mask, so splash / cuDNN run it (they take no traced offset); a
    write at a traced index into a longer cache keeps the blockwise kernel. Logits equal
    the einsum model's either way."""
    B, Lp = 2, 9
    toks = jax.random.randint(jax.random.key(1), (B, Lp), 1, 100)
    pm = _left_padded(B, Lp, [0, 3])
    pos = transformer.positions_from_mask(pm)
    seen = []
    attend = A.attend
    monkeypatch.setattr(
        A,
        "attend",
        lambda q, k, v, mask, *a, **kw: seen.append(mask.static) or attend(q, k, v, mask, *a, **kw),
    )
    from flax import nnx

    logits = {}
    for impl in ("einsum", "blockwise"):
        model = nnx.merge(*_model_case(impl, 1))
        for attend_len in (Lp, None):
            cache = transformer.init_decode_cache(model.config, B, Lp + 4)
            out, _ = model(toks, pos, pm, cache=cache, attend_len=attend_len)
            logits[impl, attend_len] = out
    layers = get_preset("tiny").num_layers
    assert seen == [True] * layers + [False] * layers  # blockwise: static at Lp, traced at Lp + 4
    for attend_len in (Lp, None):
        a, b = logits["einsum", attend_len], logits["blockwise", attend_len]
        np.testing.assert_allclose(a * pm[..., None], b * pm[..., None], atol=F32_TOL)


# ----------------------------------------------------------------------------- splash (TPU)


def _splash_interpret(monkeypatch):
    monkeypatch.setattr(
        A, "splash_attention", functools.partial(A.splash_attention, interpret=True)
    )


@pytest.mark.slow
def test_splash_kernel_interpreted_matches_einsum():
    """The Pallas splash kernel in interpret mode (CPU) == the einsum reference: left padding
    + causal (segment ids + CausalMask), a causal offset, no causal mask; GQA 4:2; odd
    lengths padded to 128 inside; values and gradients."""
    q, k, v = _qkv(2, 37, 37, 4, 2, 16)
    km = _left_padded(2, 37, [0, 5])
    for mask, T in ((A.Mask(km), 37), (A.Mask(km, offset=None), 37), (A.Mask(km, offset=5), 20)):
        dense = mask.dense(T)
        rows = dense.any(-1)
        qt = q[:, :T]
        ref = jax.jit(A.einsum_attention)(qt, k, v, dense)
        out = jax.jit(lambda q, k, v, mask=mask: A.splash_attention(q, k, v, mask, interpret=True))(
            qt, k, v
        )
        diff = jnp.abs(out - ref).max((-1, -2))
        assert float(jnp.where(rows, diff, 0).max()) <= F32_TOL
        assert bool(jnp.isfinite(out).all())
    mask = A.Mask(km)
    dense = mask.dense(37)
    w = jnp.asarray(np.random.default_rng(2).normal(size=q.shape), jnp.float32)
    w = w * dense.any(-1)[..., None, None]
    g_ref = jax.jit(lambda q, k, v: _grads(lambda *a: A.einsum_attention(*a, dense), q, k, v, w))
    g = jax.jit(
        lambda q, k, v: _grads(lambda *a: A.splash_attention(*a, mask, interpret=True), q, k, v, w)
    )
    for a, b in zip(g_ref(q, k, v), g(q, k, v)):
        np.testing.assert_allclose(a, b, atol=F32_TOL)


@pytest.mark.slow
@pytest.mark.parametrize("group", [1, 4])
def test_model_with_splash_interpreted_equals_einsum(monkeypatch, group):
    """The whole model with attention_impl="splash" (kernel interpreted on the CPU): log-probs
    and gradients equal the einsum model's, per row and with the shared-prompt forward (keys
    [prompt, completion] concatenated per row, CausalMask(offset=Lp))."""
    _splash_interpret(monkeypatch)
    R, Lp, Lc = 4, 10, 7
    toks, mask, cm = _batch(get_preset("tiny").vocab_size, R, 4, Lp, Lc)
    ref = _logprobs_and_grad("einsum", group, Lp, toks, mask, cm)
    new = _logprobs_and_grad("splash", group, Lp, toks, mask, cm)
    _assert_same(ref, new, cm)


# ----------------------------------------------------------------------------- config wiring


def test_resolve_impl_by_platform_and_config_validation():
    assert A.resolve_impl("auto", "bfloat16", "tpu") == "splash"
    assert A.resolve_impl("auto", "bfloat16", "gpu") == "cudnn"
    assert A.resolve_impl("auto", "float32", "gpu") == "blockwise"
    assert A.resolve_impl("auto", "float32", "cpu") == A.CPU_DEFAULT
    assert A.CPU_DEFAULT in ("einsum", "blockwise")
    assert A.resolve_impl("blockwise", "float32", "tpu") == "blockwise"
    assert A.IMPLS == model_config_lib.ATTENTION_IMPLS
    from grpo_jax import config_utils

    assert config_utils.ATTENTION_IMPLS == A.IMPLS
    with pytest.raises(ValueError, match="attention_impl"):
        get_preset("tiny", attention_impl="flashy")
    with pytest.raises(ValueError, match="cudnn"):
        get_preset("tiny", attention_impl="cudnn")  # float32
    get_preset("tiny", attention_impl="cudnn", dtype="bfloat16")


def test_config_attention_impl_reaches_the_model_and_is_validated():
    from configs import arithmetic
    from grpo_jax import config_utils, experiment

    c = arithmetic.get_config("grpo,smoke")
    c.mesh.num_devices = 1
    assert c.model.attention_impl == "auto"
    exp = experiment.build_experiment(c, with_data=False)
    assert exp.model_config.attention_impl == A.CPU_DEFAULT  # "auto" resolved for the CPU
    c.model.attention_impl = "blockwise"
    exp = experiment.build_experiment(c, with_data=False)
    assert exp.model_config.attention_impl == "blockwise"
    # the config check's copy of the choices (config_utils does not import the model package)
    assert config_utils.ATTENTION_IMPLS == A.IMPLS
    c.model.attention_impl = "nope"
    with pytest.raises(ConfigError, match="attention_impl"):
        config_utils.validate(c)
    # switching the core of a run is allowed on resume (same attention up to rounding)
    assert not config_utils.config_changes(
        {"model": {"attention_impl": "einsum"}}, {"model": {"attention_impl": "blockwise"}}
    )


# ----------------------------------------------------------------------------- TPU compiler


def _tpu_update_memory(impl, Lp, Lc):
    from experiments import aot
    from tests.test_aot import tiny_dapo

    config = tiny_dapo()
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 1, -1, 1
    config.data.max_prompt_tokens, config.rollout.max_new_tokens = Lp, Lc
    config.model.attention_impl = impl
    r = aot.compile_steps(config, devices=aot.tpu_devices("v5e-4"), sampler="none", logprobs=False)
    return r["steps"]["update"]


def _libtpu_missing():
    from experiments import aot

    return aot.libtpu_missing()


@pytest.mark.slow
@pytest.mark.skipif(bool(_libtpu_missing()), reason=_libtpu_missing() or "libtpu present")
def test_tpu_update_compiles_with_splash_and_its_temp_memory_has_no_t_by_t_term(monkeypatch):
    """The update of a tiny model (tests/test_aot.tiny_dapo: bfloat16, remat, v5e:2x2 with the
    rows over fsdp) compiled by libtpu with attention_impl="splash" (the Pallas kernel, under
    shard_map; the kernel is traced for every layer call) and with "einsum", at 2,048 prompt +
    2,048 completion tokens: one layer's completion scores [rows, heads, Lc, Lp + Lc] float32
    are 4 x 4 x 2048 x 4096 x 4 B = 512 MiB per device. The einsum update's temporaries exceed
    that (measured 1.67 GB); the splash update's stay under half of it (measured 190 MB). At
    512 + 512 tokens the TPU compiler keeps the einsum's temporaries small (6.4 MB, less than
    the kernel's 20.8 MB): the fused kernel pays off at long rows, which is what this checks.
    The numbers at 2,048 and 5,120 tokens: docs/architecture.md."""
    # another process may hold libtpu's lock file (only the compiler is used here)
    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    calls = []
    splash = A.splash_attention
    monkeypatch.setattr(A, "splash_attention", lambda *a, **k: calls.append(1) or splash(*a, **k))
    Lp, Lc = 2048, 2048
    einsum = _tpu_update_memory("einsum", Lp, Lc)
    assert not calls
    fused = _tpu_update_memory("splash", Lp, Lc)
    assert calls  # the kernel, not a fallback
    scores = 4 * 4 * Lc * (Lp + Lc) * 4  # one layer's completion scores, float32, per device
    assert einsum["temp"] > scores, (einsum["temp"], scores)
    assert fused["temp"] < scores / 2, (fused["temp"], scores)
    assert fused["temp"] < einsum["temp"] / 4, (fused["temp"], einsum["temp"])
