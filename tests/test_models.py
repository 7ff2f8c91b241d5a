"""Decoder model: presets, parameter layout, KV cache, padding, dtypes, remat, critic."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax.models import (
    PRESETS,
    CriticModel,
    ModelConfig,
    Transformer,
    get_preset,
    init_cache,
    positions_from_mask,
)
from grpo_jax.models.transformer import (
    apply_rope,
    random_params,
    rms_norm,
    swiglu,
    tied_logits,
)

LOGICAL = {"vocab", "embed", "mlp", "heads", "kv_heads", "head_dim", "norm", None}

# GQA 4:2, QK-norm, untied, q/k/v bias: every optional branch on.
FULL = get_preset("tiny", tie_word_embeddings=False, qkv_bias=True, vocab_size=61)


def _model(cfg=FULL, seed=0, scale=1.0):
    """Random Transformer from a host-side init (compiling an init program is slow on CPU);
    scale > 1 gives peaky, position-sensitive logits."""
    return nnx.merge(*random_params(cfg, seed, stddev=0.02 * scale))


def _jit(model):
    """model.__call__ under jax.jit (eager calls dispatch op by op)."""
    g, p = nnx.split(model, nnx.Param)

    @jax.jit
    def call(params, tokens, positions, mask=None, cache=None):
        out, new_cache = nnx.merge(g, params)(tokens, positions, mask, cache=cache)
        return out, new_cache

    return lambda *a, **k: call(p, *a, **k)


def test_presets_and_param_counts():
    # Published totals: SmolLM2-135M 134,515,008; Qwen3-8B 8,190,735,360.
    assert get_preset("smollm2-135m").num_params == 134_515_008
    assert get_preset("qwen3-8b").num_params == 8_190_735_360
    for name, cfg in PRESETS.items():
        abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
        n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
        assert n == cfg.num_params, name
    q = get_preset("qwen3-1.7b")
    assert (
        q.hidden_size,
        q.intermediate_size,
        q.num_layers,
        q.num_heads,
        q.num_kv_heads,
        q.head_dim,
        q.vocab_size,
        q.rope_theta,
        q.tie_word_embeddings,
        q.qk_norm,
    ) == (2048, 6144, 28, 16, 8, 128, 151936, 1e6, True, True)
    assert get_preset("tiny", num_layers=3).num_layers == 3
    hash(get_preset("tiny"))  # static jit argument


def test_bad_preset_and_config_errors():
    with pytest.raises(ValueError, match="available: .*qwen3-8b"):
        get_preset("gpt5")
    with pytest.raises(ValueError, match="num_kv_heads"):
        get_preset("tiny", num_kv_heads=3)
    with pytest.raises(ValueError, match="dtype"):
        get_preset("tiny", dtype="float64")
    with pytest.raises(ValueError, match="unsupported HF model_type"):
        ModelConfig.from_hf_config({"model_type": "gpt2"})
    with pytest.raises(ValueError, match="rope_scaling"):
        ModelConfig.from_hf_config(
            {
                "model_type": "llama",
                "vocab_size": 8,
                "hidden_size": 8,
                "intermediate_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "rope_scaling": {"rope_type": "llama3", "factor": 8.0},
            }
        )


def test_from_hf_config_roundtrip():
    for cfg in (
        PRESETS["smollm2-135m"],
        PRESETS["qwen3-8b"],
        FULL.replace(family="qwen2", qk_norm=False),
    ):
        assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg
    # transformers>=5 writes rope_theta under rope_parameters
    d = PRESETS["smollm2-135m"].to_hf_config()
    d["rope_parameters"] = {"rope_theta": d.pop("rope_theta"), "rope_type": "default"}
    assert ModelConfig.from_hf_config(d).rope_theta == 1e5


def test_param_logical_axes_cover_every_dim():
    model = nnx.eval_shape(lambda: Transformer(FULL, rngs=nnx.Rngs(0)))  # module initialisers
    _, params = nnx.split(model, nnx.Param)
    rest = nnx.split(model, nnx.Param, ...)[2]
    assert not jax.tree.leaves(rest)  # no non-Param state: split(model, nnx.Param) is complete
    n = 0
    for path, var in nnx.to_flat_state(params):
        axes = var.get_metadata()["out_sharding"]
        assert len(axes) == len(var.shape), path
        assert set(axes) <= LOGICAL, path
        n += 1
    assert n == 17  # embed, final_norm, lm_head, 2 norms, q/k/v/o, 3 biases, 2 qk norms, 3 mlp
    spec = nnx.get_partition_spec(params)
    assert tuple(spec["model"]["layers"]["attn"]["q_proj"].get_value()) == (
        None,
        "embed",
        "heads",
        "head_dim",
    )
    assert tuple(spec["model"]["embed"].get_value()) == ("vocab", "embed")


def test_rms_norm_and_rope_closed_forms():
    x = jnp.array([[3.0, 4.0]])
    np.testing.assert_allclose(
        rms_norm(x, jnp.array([1.0, 2.0]), 0.0), [[3 / np.sqrt(12.5), 8 / np.sqrt(12.5)]], rtol=1e-6
    )
    # RoPE with D=2: a plain rotation by position * theta^0 = position radians.
    v = jnp.array([1.0, 0.0]).reshape(1, 1, 1, 2)
    out = apply_rope(v, jnp.array([[2]]), 10000.0)
    np.testing.assert_allclose(out.reshape(2), [np.cos(2.0), np.sin(2.0)], atol=1e-6)
    # relative: <rope(q, m), rope(k, n)> depends only on m - n
    q = jax.random.normal(jax.random.key(0), (1, 1, 1, 8))
    k = jax.random.normal(jax.random.key(1), (1, 1, 1, 8))
    dot = lambda m, n: jnp.sum(
        apply_rope(q, jnp.array([[m]]), 100.0) * apply_rope(k, jnp.array([[n]]), 100.0)
    )
    np.testing.assert_allclose(dot(5, 3), dot(9, 7), rtol=1e-5)


def test_swiglu_value_and_custom_vjp_match_autodiff():
    # closed form: silu(g) u = g sigmoid(g) u; its gradient by autodiff of the plain expression
    # (what the custom VJP replaces), including large |g| where sigmoid saturates
    rng = np.random.default_rng(0)
    g = jnp.asarray(
        np.concatenate([rng.normal(size=60) * 3, [-40.0, -12.0, 0.0, 12.0, 40.0]]), jnp.float32
    )
    u = jnp.asarray(rng.normal(size=g.shape), jnp.float32)
    w = jnp.asarray(rng.normal(size=g.shape), jnp.float32)
    np.testing.assert_allclose(
        swiglu(g, u), np.asarray(g) / (1 + np.exp(-np.asarray(g))) * u, rtol=1e-6, atol=1e-7
    )
    ref = jax.grad(lambda g, u: jnp.sum(w * jax.nn.silu(g) * u), argnums=(0, 1))(g, u)
    got = jax.grad(lambda g, u: jnp.sum(w * swiglu(g, u)), argnums=(0, 1))(g, u)
    for a, b in zip(got, ref):
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_tied_logits_value_and_custom_vjp_match_autodiff(dtype, tol):
    # reference: the plain einsum h e^T and its autodiff gradients; leading dims [2, 3]
    rng = np.random.default_rng(1)
    h = jnp.asarray(rng.normal(size=(2, 3, 8)), dtype)
    e = jnp.asarray(rng.normal(size=(11, 8)), dtype)
    w = jnp.asarray(rng.normal(size=(2, 3, 11)), jnp.float32)
    plain = lambda h, e: jnp.einsum("...e,ve->...v", h, e)
    got = tied_logits(h, e)
    assert got.dtype == dtype and got.shape == (2, 3, 11)
    np.testing.assert_allclose(
        np.asarray(got, np.float32),
        np.einsum("bte,ve->btv", np.asarray(h, np.float32), np.asarray(e, np.float32)),
        rtol=tol,
        atol=tol,
    )
    f = lambda fn: jax.grad(lambda h, e: jnp.sum(w * fn(h, e).astype(jnp.float32)), argnums=(0, 1))(
        h, e
    )
    for a, b in zip(f(tied_logits), f(plain)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_allclose(
            np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol
        )


def test_positions_from_mask():
    m = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], bool)
    np.testing.assert_array_equal(positions_from_mask(m), [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]])


def test_causality_and_left_padding_invariance():
    model = _jit(_model(scale=10.0))
    toks = jax.random.randint(jax.random.key(0), (1, 6), 0, FULL.vocab_size)
    ref, _ = model(toks, jnp.arange(6)[None])
    # changing a later token leaves earlier logits unchanged
    toks2 = toks.at[0, 4].set((toks[0, 4] + 1) % FULL.vocab_size)
    out2, _ = model(toks2, jnp.arange(6)[None])
    np.testing.assert_allclose(out2[0, :4], ref[0, :4], atol=1e-5)
    assert np.abs(np.asarray(out2[0, 4:] - ref[0, 4:])).max() > 1e-3
    # 3 left pads with arbitrary pad ids: same logits on the real tokens
    padded = jnp.concatenate([jnp.array([[7, 8, 9]]), toks], axis=1)
    mask = jnp.array([[False] * 3 + [True] * 6])
    out, _ = model(padded, positions_from_mask(mask), mask)
    np.testing.assert_allclose(out[0, 3:], ref[0], atol=1e-5)
    assert np.isfinite(np.asarray(out)).all()


def test_kv_cache_decoding_matches_full_forward():
    m = _model(scale=10.0)
    model = _jit(m)
    B, T = 2, 9
    toks = jax.random.randint(jax.random.key(2), (B, T), 0, FULL.vocab_size)
    mask = jnp.ones((B, T), bool).at[1, :2].set(False)
    pos = positions_from_mask(mask)
    ref, _ = model(toks, pos, mask)
    cache = init_cache(FULL, B, 12)
    logits, cache = model(toks[:, :5], pos[:, :5], mask[:, :5], cache=cache)
    outs = [logits]
    for t in range(5, T):
        logits, cache = model(toks[:, t : t + 1], pos[:, t : t + 1], cache=cache)
        outs.append(logits)
    assert int(cache.index) == T
    got = jnp.concatenate(outs, axis=1)
    np.testing.assert_allclose(got[0], ref[0], atol=1e-5)
    np.testing.assert_allclose(got[1, 2:], ref[1, 2:], atol=1e-5)
    # hidden path + logits() == logits
    h, _ = jax.jit(lambda: m(toks, pos, mask, return_hidden=True))()
    np.testing.assert_allclose(jax.jit(m.logits)(h), ref, atol=1e-5)


def test_decode_cache_matches_full_forward_through_growth_and_per_row_steps():
    from grpo_jax.models.transformer import init_decode_cache, unstack_layers

    m = _model(scale=10.0)
    B, T = 3, 10
    toks = jax.random.randint(jax.random.key(3), (B, T), 0, FULL.vocab_size)
    mask = jnp.ones((B, T), bool).at[1, :2].set(False)
    pos = positions_from_mask(mask)
    ref, _ = _jit(m)(toks, pos, mask)

    @jax.jit
    def run(toks, pos, mask):
        layers = unstack_layers(m)
        cache = init_decode_cache(FULL, B, 6)  # prefill 4 tokens into 6 slots
        logits, cache = m(toks[:, :4], pos[:, :4], mask[:, :4], cache=cache, attend_len=4)
        outs = [logits]
        for t in range(4, T):
            if t == 6:
                cache = cache.grow(8)  # empty slots appended mid-decode
            if t == 8:  # per-row indices from here (the continuous sampler's form)
                cache = cache.grow(T).replace(index=jnp.full((B,), cache.index, jnp.int32))
            logits, cache = m(
                toks[:, t : t + 1], pos[:, t : t + 1], cache=cache, layer_params=layers
            )
            outs.append(logits)
        return jnp.concatenate(outs, axis=1), cache

    got, cache = run(toks, pos, mask)
    assert cache.index.tolist() == [T] * B and len(cache.k) == FULL.num_layers
    assert cache.k[0].shape == (B, FULL.num_kv_heads, T, FULL.head_dim)
    np.testing.assert_allclose(got[0], ref[0], atol=1e-5)
    np.testing.assert_allclose(got[1, 2:], ref[1, 2:], atol=1e-5)
    np.testing.assert_allclose(got[2], ref[2], atol=1e-5)
    c = init_decode_cache(FULL, B, 6)
    assert c.grow(6) is c
    with pytest.raises(ValueError, match="5 slots < the 6"):
        c.grow(5)
    with pytest.raises(ValueError, match="per-row cache index"):
        m(toks[:, :2], pos[:, :2], cache=c.replace(index=jnp.zeros((B,), jnp.int32)))


def test_bfloat16_close_to_float32_and_dtypes():
    model32 = _model()
    g, p = nnx.split(model32, nnx.Param)
    cfg16 = FULL.replace(dtype="bfloat16", param_dtype="bfloat16")
    g16, _ = nnx.split(nnx.eval_shape(lambda: Transformer(cfg16, rngs=nnx.Rngs(0))), nnx.Param)
    model16 = nnx.merge(g16, jax.tree.map(lambda x: x.astype(jnp.bfloat16), p))
    toks = jax.random.randint(jax.random.key(0), (2, 7), 0, FULL.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(7), (2, 7))
    l32, _ = _jit(model32)(toks, pos)
    l16, _ = _jit(model16)(toks, pos)
    assert l32.dtype == jnp.float32 and l16.dtype == jnp.bfloat16
    assert model16.model.embed.get_value().dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(l16, np.float32), l32, atol=0.05 * float(jnp.abs(l32).max()) + 1e-3
    )
    # bf16 compute over fp32 params (mixed precision)
    g_mixed, _ = nnx.split(
        nnx.eval_shape(lambda: Transformer(FULL.replace(dtype="bfloat16"), rngs=nnx.Rngs(0))),
        nnx.Param,
    )
    lm, _ = _jit(nnx.merge(g_mixed, p))(toks, pos)
    assert lm.dtype == jnp.bfloat16


def test_remat_same_value_and_grad():
    model = _model(scale=5.0)
    g, p = nnx.split(model, nnx.Param)
    g_r, _ = nnx.split(
        nnx.eval_shape(lambda: Transformer(FULL.replace(remat=True), rngs=nnx.Rngs(0))), nnx.Param
    )
    toks = jax.random.randint(jax.random.key(0), (2, 5), 0, FULL.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(5), (2, 5))

    def loss(params, gd):
        logits, _ = nnx.merge(gd, params)(toks, pos)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    v1, g1 = jax.jit(jax.value_and_grad(loss), static_argnums=1)(p, g)
    v2, g2 = jax.jit(jax.value_and_grad(loss), static_argnums=1)(p, g_r)
    np.testing.assert_allclose(v1, v2, rtol=1e-6)
    assert jax.tree.structure(g1) == jax.tree.structure(p)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert any(float(jnp.abs(x).max()) > 0 for x in jax.tree.leaves(g1))


@pytest.mark.parametrize("group_size", [1, 4])
def test_attention_recomputed_in_backward_same_grads_less_memory(monkeypatch, group_size):
    """`recompute_in_backward`: the attention probabilities are recomputed in the backward pass,
    not stored. Same loss and gradients as autodiff storing them (the wrapper replaced by the
    identity), per-row and shared-prompt forward alike; XLA's temporary memory shrinks by about
    the stacked probabilities ([layers, rows, heads, T, S] float32)."""
    from grpo_jax import steps
    from grpo_jax.models import transformer

    cfg = FULL.replace(num_layers=3)
    g, p = nnx.split(_model(cfg, scale=5.0), nnx.Param)
    R, Lp, Lc = 4, 40, 88
    rng = np.random.default_rng(0)
    prompt = np.repeat(rng.integers(0, cfg.vocab_size, (R // group_size, Lp)), group_size, 0)
    toks = jnp.asarray(np.concatenate([prompt, rng.integers(0, cfg.vocab_size, (R, Lc))], 1))
    mask = jnp.ones(toks.shape, bool).at[0, :3].set(False)  # a left-padded prompt
    adv = jnp.asarray(rng.normal(size=(R, 1)), jnp.float32)

    def loss(params):
        lp = steps.completion_logprobs(g, params, toks, mask, Lp, 1.0, group_size)
        return -(jnp.exp(lp - jax.lax.stop_gradient(lp)) * adv).mean()

    def compiled():
        return jax.jit(jax.value_and_grad(loss)).lower(p).compile()

    recompute = compiled()
    monkeypatch.setattr(transformer, "recompute_in_backward", lambda fn, static_argnums=(): fn)
    store = compiled()
    (v1, g1), (v2, g2) = recompute(p), store(p)
    np.testing.assert_allclose(v1, v2, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert any(float(jnp.abs(x).max()) > 0 for x in jax.tree.leaves(g1))
    # stored probabilities of the completion queries alone: [layers, R, heads, Lc, Lp + Lc]
    probs_bytes = cfg.num_layers * R * cfg.num_heads * Lc * (Lp + Lc) * 4
    saved = (
        store.memory_analysis().temp_size_in_bytes - recompute.memory_analysis().temp_size_in_bytes
    )
    assert saved > 0.5 * probs_bytes, (saved, probs_bytes)


@pytest.mark.parametrize("remat", [False, True])
def test_attention_recompute_not_nested_in_layer_remat(monkeypatch, remat):
    """Under model.remat the whole layer is recomputed already: the attention core is then not
    wrapped again (which would run its forward a third time)."""
    from grpo_jax.models import transformer

    calls = []
    monkeypatch.setattr(
        transformer, "recompute_in_backward", lambda fn, static_argnums=(): calls.append(1) or fn
    )
    cfg = FULL.replace(remat=remat)
    g, p = nnx.split(_model(cfg), nnx.Param)
    toks = jnp.zeros((2, 6), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
    jax.eval_shape(jax.grad(lambda p: nnx.merge(g, p)(toks, pos)[0].sum()), p)
    assert bool(calls) != remat


def test_critic_model_shares_trunk_layout():
    cfg = FULL
    critic = nnx.merge(*random_params(cfg, 1, cls=CriticModel))
    policy = _model()
    toks = jax.random.randint(jax.random.key(0), (3, 4), 0, cfg.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(4), (3, 4))
    values = jax.jit(lambda: critic(toks, pos))()
    assert values.shape == (3, 4) and values.dtype == jnp.float32
    # the trunk Param tree is the policy's: initialise the critic from the policy
    pol = nnx.state(policy, nnx.Param)["model"]
    nnx.update(critic.model, pol)
    h, _ = jax.jit(lambda: policy(toks, pos, return_hidden=True))()
    expected = h @ critic.value_head.get_value() + critic.value_bias.get_value()
    np.testing.assert_allclose(jax.jit(lambda: critic(toks, pos))(), expected, atol=1e-5)


def test_pure_dict_params_merge():
    model = _model()
    g, p = nnx.split(model, nnx.Param)
    toks = jnp.zeros((1, 3), jnp.int32)
    # the trainer holds params as a pure dict (State.to_pure_dict()); merge accepts it
    out, _ = _jit(nnx.merge(g, p.to_pure_dict()))(toks, jnp.arange(3)[None])
    np.testing.assert_allclose(out, _jit(model)(toks, jnp.arange(3)[None])[0], atol=1e-6)
