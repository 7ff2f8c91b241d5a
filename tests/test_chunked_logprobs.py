"""Log-probs from the hidden states without the whole logits (`logprobs.logprobs_from_hidden`).

Checks: values and gradients (w.r.t. the hidden states and the LM head, tied `[V, E]` and
untied `[E, V]`) equal the full computation `logprobs_from_logits(hidden @ head)` in float32
and bfloat16, for odd `T`, chunk sizes 1 / `T` / non-dividing, temperature != 1, masked NaN/inf
garbage; the entropy output; `steps.completion_logprobs` and a GRPO loss gradient through it
with `logprob_chunk_size` 0 vs > 0 (group size 1 and > 1, row micro-batches); the update built
from a config with the field; the jaxpr of the chunked value-and-grad holds no `[R, Lc, V]`
array (while today's path does); and, with libtpu, the TPU compiler's temporary bytes of an
update at Qwen3's vocabulary with and without chunking.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from test_losses import pl

from grpo_jax import logprobs as logprobs_lib
from grpo_jax import steps
from grpo_jax.errors import ConfigError
from grpo_jax.models.config import ModelConfig
from grpo_jax.models.transformer import Transformer, tied_logits


def _inputs(R, T, E, V, layout, dtype, seed=0):
    g = np.random.default_rng(seed)
    hidden = jnp.asarray(g.normal(size=(R, T, E)), dtype)
    shape = (E, V) if layout == "ev" else (V, E)
    head = jnp.asarray(g.normal(0, 0.5, size=shape), jnp.float32)
    targets = jnp.asarray(g.integers(0, V, (R, T)), jnp.int32)
    cot = jnp.asarray(g.normal(size=(R, T)), jnp.float32)
    return hidden, head, targets, cot


def _full_logits(hidden, head, layout):
    """The unchunked path's logits, as `Transformer.logits` forms them."""
    w = head.astype(hidden.dtype)
    return hidden @ w if layout == "ev" else tied_logits(hidden, w)


def _full(hidden, head, targets, temperature, layout, entropy=False):
    logits = _full_logits(hidden, head, layout)
    lp = logprobs_lib.logprobs_from_logits(logits, targets, temperature)
    if entropy:
        return lp, logprobs_lib.entropy_from_logits(logits, temperature)
    return lp


def _chunked(hidden, head, targets, temperature, layout, chunk_size, entropy=False):
    return logprobs_lib.logprobs_from_hidden(
        hidden,
        head,
        targets,
        temperature,
        head_layout=layout,
        chunk_size=chunk_size,
        return_entropy=entropy,
    )


def _value_and_grads(fn, hidden, head, cot):
    """(values, (d hidden, d head)) of sum(cot * fn(hidden, head)), jitted."""

    def loss(h, w):
        return jnp.sum(cot * fn(h, w))

    vals = jax.jit(fn)(hidden, head)
    return vals, jax.jit(jax.grad(loss, argnums=(0, 1)))(hidden, head)


def _f32(x):
    return np.asarray(jnp.asarray(x, jnp.float32))


def _assert_close(a, b, tol):
    np.testing.assert_allclose(_f32(a), _f32(b), rtol=tol, atol=tol)


# ----------------------------------------------------------------------------- the function


@pytest.mark.parametrize("layout", ["ev", "ve"])
@pytest.mark.parametrize("chunk_size", [1, 3, 7, 128])  # 1, non-dividing, T, > T
def test_float32_values_and_gradients_equal_the_full_logits(layout, chunk_size):
    R, T, E, V, temp = 3, 7, 8, 50, 0.7
    hidden, head, targets, cot = _inputs(R, T, E, V, layout, jnp.float32)
    full = functools.partial(_full, targets=targets, temperature=temp, layout=layout)
    chunk = functools.partial(
        _chunked, targets=targets, temperature=temp, layout=layout, chunk_size=chunk_size
    )
    v_ref, (dh_ref, dw_ref) = _value_and_grads(full, hidden, head, cot)
    v, (dh, dw) = _value_and_grads(chunk, hidden, head, cot)
    assert v.dtype == jnp.float32 and v.shape == (R, T)
    assert dh.dtype == hidden.dtype and dw.dtype == head.dtype and dw.shape == head.shape
    _assert_close(v, v_ref, 1e-5)
    _assert_close(dh, dh_ref, 1e-5)
    _assert_close(dw, dw_ref, 1e-5)


@settings(max_examples=12, deadline=None)
@given(
    R=st.integers(1, 3),
    T=st.integers(1, 9),
    E=st.sampled_from([4, 8]),
    V=st.integers(2, 40),
    chunk_size=st.integers(1, 12),
    layout=st.sampled_from(["ev", "ve"]),
    temp=st.floats(0.3, 2.0),
    seed=st.integers(0, 2**16),
)
def test_float32_property_any_shape_and_chunking(R, T, E, V, chunk_size, layout, temp, seed):
    hidden, head, targets, cot = _inputs(R, T, E, V, layout, jnp.float32, seed)
    full = functools.partial(_full, targets=targets, temperature=temp, layout=layout)
    chunk = functools.partial(
        _chunked, targets=targets, temperature=temp, layout=layout, chunk_size=chunk_size
    )
    for a, b in zip(
        jax.tree.leaves(_value_and_grads(chunk, hidden, head, cot)),
        jax.tree.leaves(_value_and_grads(full, hidden, head, cot)),
    ):
        _assert_close(a, b, 1e-5)


def _relative_error(x, ref):
    return float(np.max(np.abs(_f32(x) - ref)) / max(np.max(np.abs(ref)), 1e-30))


@pytest.mark.parametrize("layout", ["ev", "ve"])
def test_bfloat16_matches_the_full_path_and_accumulates_the_head_gradient_in_float32(layout):
    R, T, E, V, temp, chunk_size = 4, 11, 16, 300, 1.3, 4
    hidden, head, targets, cot = _inputs(R, T, E, V, layout, jnp.bfloat16, seed=3)
    full = functools.partial(_full, targets=targets, temperature=temp, layout=layout)
    chunk = functools.partial(
        _chunked, targets=targets, temperature=temp, layout=layout, chunk_size=chunk_size
    )
    v_ref, (dh_ref, dw_ref) = _value_and_grads(full, hidden, head, cot)
    v, (dh, dw) = _value_and_grads(chunk, hidden, head, cot)
    assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    # the same bfloat16 logits and float32 log-softmax: values equal up to float32 rounding
    _assert_close(v, v_ref, 1e-4)
    assert _relative_error(dh, _f32(dh_ref)) < 1e-2
    assert _relative_error(dw, _f32(dw_ref)) < 2e-2

    # against float32 arithmetic on the same (bf16-rounded) inputs, the chunked head gradient,
    # summed in float32, is at least as accurate as the full path's bfloat16 product
    def exact(h, w):
        w = w.astype(jnp.bfloat16).astype(jnp.float32)
        return _full(h.astype(jnp.float32), w, targets, temp, layout)

    _, (_, dw_exact) = _value_and_grads(exact, hidden, head, cot)
    assert _relative_error(dw, _f32(dw_exact)) <= _relative_error(dw_ref, _f32(dw_exact)) + 1e-3


@pytest.mark.parametrize("layout", ["ev", "ve"])
def test_entropy_values_and_gradients_equal_entropy_from_logits(layout):
    R, T, E, V, temp = 2, 5, 8, 30, 0.8
    hidden, head, targets, cot = _inputs(R, T, E, V, layout, jnp.float32, seed=5)
    cot_h = jnp.asarray(np.random.default_rng(6).normal(size=(R, T)), jnp.float32)

    def loss(fn):
        return lambda h, w: jnp.sum(cot * fn(h, w)[0]) + jnp.sum(cot_h * fn(h, w)[1])

    full = lambda h, w: _full(h, w, targets, temp, layout, entropy=True)
    chunk = lambda h, w: _chunked(h, w, targets, temp, layout, 2, entropy=True)
    for a, b in zip(
        jax.tree.leaves(jax.jit(chunk)(hidden, head)), jax.tree.leaves(jax.jit(full)(hidden, head))
    ):
        _assert_close(a, b, 1e-5)
    g = jax.jit(jax.grad(loss(chunk), argnums=(0, 1)))(hidden, head)
    g_ref = jax.jit(jax.grad(loss(full), argnums=(0, 1)))(hidden, head)
    for a, b in zip(g, g_ref):
        _assert_close(a, b, 1e-5)
    # only the entropy differentiated (zero log-prob cotangent): still the full path's gradient
    only_h = lambda fn: lambda h, w: jnp.sum(cot_h * fn(h, w)[1])
    for a, b in zip(
        jax.grad(only_h(chunk), argnums=(0, 1))(hidden, head),
        jax.grad(only_h(full), argnums=(0, 1))(hidden, head),
    ):
        _assert_close(a, b, 1e-5)
    ent = _f32(jax.jit(chunk)(hidden, head)[1])
    assert np.all(ent >= 0) and np.all(ent <= np.log(V) + 1e-5)


@pytest.mark.parametrize("layout", ["ev", "ve"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_masked_garbage_positions_get_exactly_zero_gradient(layout, dtype):
    R, T, E, V, temp = 3, 9, 8, 40, 0.9
    hidden, head, targets, _ = _inputs(R, T, E, V, layout, dtype, seed=7)
    mask = np.ones((R, T), bool)
    mask[0, 6:] = mask[1, :2] = mask[2, 4] = False
    mask = jnp.asarray(mask)
    garbage = jnp.where(mask[..., None], hidden, jnp.asarray(np.nan, dtype))
    garbage = garbage.at[1, 0, 0].set(jnp.inf).at[0, 7, 3].set(-jnp.inf)
    clean = jnp.where(mask[..., None], hidden, jnp.zeros((), dtype))
    # ids outside [0, V) at masked positions are clamped, never read out of range
    targets = jnp.where(mask, targets, V + 5)

    def loss(h, w):
        lp = _chunked(h, w, targets, temp, layout, 4)
        return jnp.sum(jnp.where(mask, lp, 0.0))

    val, (dh, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(garbage, head)
    val_c, (dh_c, dw_c) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(clean, head)
    assert np.isfinite(float(val)) and float(val) == float(val_c)
    assert np.all(np.isfinite(_f32(dh))) and np.all(np.isfinite(_f32(dw)))
    assert np.all(_f32(dh)[~np.asarray(mask)] == 0.0)
    np.testing.assert_array_equal(_f32(dh), _f32(dh_c))
    np.testing.assert_array_equal(_f32(dw), _f32(dw_c))


def test_no_gradient_to_temperature_and_argument_errors():
    hidden, head, targets, _ = _inputs(2, 4, 8, 20, "ev", jnp.float32)
    lp_sum = lambda t: jnp.sum(logprobs_lib.logprobs_from_hidden(hidden, head, targets, t))
    g = jax.grad(lp_sum)(0.7)
    assert float(g) == 0.0
    z = logprobs_lib.logprobs_from_hidden(hidden[:, :0], head, targets[:, :0])
    assert z.shape == (2, 0) and z.dtype == jnp.float32
    with pytest.raises(ValueError, match="head_layout"):
        logprobs_lib.logprobs_from_hidden(hidden, head, targets, head_layout="vv")
    with pytest.raises(ValueError, match="does not match hidden size"):
        logprobs_lib.logprobs_from_hidden(hidden, head, targets, head_layout="ve")
    with pytest.raises(ValueError, match="temperature"):
        logprobs_lib.logprobs_from_hidden(hidden, head, targets, 0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        logprobs_lib.logprobs_from_hidden(hidden, head, targets, chunk_size=0)
    with pytest.raises(AssertionError):
        logprobs_lib.logprobs_from_hidden(hidden, head, targets[:, :3])


# ----------------------------------------------------------------------------- the model


def _model(tied: bool, vocab=97, dtype="float32"):
    cfg = ModelConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        tie_word_embeddings=tied,
        qk_norm=True,
        dtype=dtype,
    )
    return nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)


def _grouped_batch(P, G, Lp, Lc, vocab=97, seed=0):
    """Rows in groups of G with identical left-padded prompts, ragged completion masks."""
    rng = np.random.default_rng(seed)
    pt = rng.integers(1, vocab, (P, Lp))
    pm = np.ones((P, Lp), bool)
    pm[0, :2] = pm[-1, :1] = False
    ct = rng.integers(1, vocab, (P * G, Lc))
    cm = np.ones((P * G, Lc), bool)
    cm[1, 3:] = cm[-1, 1:] = False
    tokens = jnp.asarray(np.concatenate([np.repeat(pt, G, 0), ct], 1), jnp.int32)
    mask = jnp.asarray(np.concatenate([np.repeat(pm, G, 0), cm], 1))
    return tokens, mask


def _grpo_loss(graphdef, Lp, G, chunk, tokens, mask, adv):
    cmask = mask[:, Lp:].astype(jnp.float32)

    def loss(params):
        lp = steps.completion_logprobs(graphdef, params, tokens, mask, Lp, 0.7, G, chunk)
        old = jax.lax.stop_gradient(lp) - 0.05  # ratio != 1: the clip is active somewhere
        return pl(lp, old, adv, cmask, ref_logprobs=old, kl_coef=0.01)[0]

    return loss


@pytest.mark.parametrize(
    "tied,group_size",
    [(True, 1), (False, 1), (True, 3), (False, 3)],
)
@pytest.mark.slow  # 20-70 s each on a loaded 2-core machine (model compiles)
def test_completion_logprobs_and_grpo_gradient_equal_with_and_without_chunks(tied, group_size):
    graphdef, params = _model(tied)
    P, Lp, Lc = 2, 6, 7
    tokens, mask = _grouped_batch(P, group_size, Lp, Lc)
    adv = jnp.asarray(np.random.default_rng(2).normal(size=(P * group_size,)), jnp.float32)
    # the GRPO loss and its gradient through completion_logprobs: field 0 vs 3 (non-dividing)
    ref = jax.jit(jax.value_and_grad(_grpo_loss(graphdef, Lp, group_size, 0, tokens, mask, adv)))
    new = jax.jit(jax.value_and_grad(_grpo_loss(graphdef, Lp, group_size, 3, tokens, mask, adv)))
    (l0, g0), (l1, g1) = ref(params), new(params)
    np.testing.assert_allclose(l1, l0, rtol=1e-5, atol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), g1, g0)
    # the values, and through row micro-batches (the reference / old-logprobs pass)
    full = steps.completion_logprobs(graphdef, params, tokens, mask, Lp, 0.7, group_size, 0)
    rows = jax.jit(
        lambda p: steps.chunked_completion_logprobs(
            graphdef, p, tokens, mask, Lp, 0.7, group_size, group_size, 3
        )
    )(params)
    np.testing.assert_allclose(rows, full, rtol=1e-5, atol=1e-5)


def _avals(jaxpr):
    """Every variable's abstract value in a closed jaxpr and all its sub-jaxprs."""
    for eqn in jaxpr.eqns:
        for v in (*eqn.invars, *eqn.outvars):
            if hasattr(v, "aval"):
                yield v.aval
        for sub in jax.core.jaxprs_in_params(eqn.params):
            yield from _avals(sub)


def _big_shapes(graphdef, params, tokens, mask, Lp, chunk, V):
    """Shapes of the GRPO value-and-grad's intermediates with a vocabulary axis and at least
    R * Lc * V elements (the whole completion logits, or their gradient, in any layout)."""
    R, Lc = tokens.shape[0], tokens.shape[1] - Lp
    adv = jnp.ones((R,), jnp.float32)
    fn = jax.value_and_grad(_grpo_loss(graphdef, Lp, 1, chunk, tokens, mask, adv))
    closed = jax.make_jaxpr(fn)(params)
    out = set()
    for a in _avals(closed.jaxpr):
        shape = tuple(getattr(a, "shape", ()))
        if V in shape and int(np.prod(shape, dtype=np.int64)) >= R * Lc * V:
            out.add(shape)
    return out


@pytest.mark.parametrize("tied", [True, False])
def test_chunked_value_and_grad_has_no_whole_completion_logits(tied):
    V = 97
    graphdef, params = _model(tied, vocab=V)
    R, Lp, Lc = 4, 5, 24  # R * Lc = 96 > hidden 32: the [V, E] head is not "big"
    tokens, mask = _grouped_batch(R, 1, Lp, Lc, vocab=V)
    # today's path (field 0) builds [R, Lc, V] logits: the detector sees them
    assert (R, Lc, V) in _big_shapes(graphdef, params, tokens, mask, Lp, 0, V)
    # the chunked path: only [R, c, V] chunks
    assert _big_shapes(graphdef, params, tokens, mask, Lp, 8, V) == set()


@pytest.mark.slow  # ~60-200 s: two experiments' log-prob pass and update compiled
def test_update_from_config_uses_the_field_and_matches_the_whole_logits():
    from configs import arithmetic
    from grpo_jax import config_utils, experiment
    from grpo_jax.state import Batch

    def build(chunk):
        c = arithmetic.get_config("grpo,smoke")
        c.mesh.num_devices = 1
        c.logging.tensorboard = False
        c.algorithm.logprob_chunk_size = chunk
        config_utils.validate(c)
        return experiment.build_experiment(c, with_data=False)

    exps = {chunk: build(chunk) for chunk in (0, 3)}
    assert steps.logprob_chunk_size(exps[3]) == 3 and steps.logprob_chunk_size(exps[0]) == 0
    exp = exps[0]
    R = exp.batching.mini_batch_size
    L, Lc = exp.prompt_len + exp.max_new_tokens, exp.max_new_tokens
    g = np.random.default_rng(1)
    old = jnp.asarray(g.normal(-2, 0.1, (R, Lc)), jnp.float32)
    batch = Batch(
        tokens=jnp.asarray(g.integers(1, 10, (R, L)), jnp.int32),
        attention_mask=jnp.ones((R, L), bool),
        completion_mask=jnp.asarray(
            (np.arange(Lc)[None] < g.integers(1, Lc + 1, (R, 1))).astype(np.float32)
        ),
        advantages=jnp.asarray(g.normal(size=(R,)), jnp.float32),
        sample_weights=jnp.ones((R,), jnp.float32),
        old_logprobs=old,
        ref_logprobs=old,
        sampler_logprobs=old,
    )
    out = {}
    for chunk, e in exps.items():
        state = steps.init_train_state(e)
        fns = steps.make_steps(e)
        lp = fns.logprobs(state.params, batch.tokens, batch.attention_mask)
        new, metrics = fns.update(state, batch)
        out[chunk] = (lp, metrics["loss"], metrics["grad_norm"], jax.device_get(new.params))
    np.testing.assert_allclose(out[3][0], out[0][0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[3][1], out[0][1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out[3][2], out[0][2], rtol=1e-4)
    # Adam's first step moves each parameter by lr * g / (|g| + eps) (lr 1e-4 here): a gradient
    # entry near eps turns a 1e-7 rounding difference into a few 1e-6 of parameter, while a
    # dropped or sign-flipped gradient moves it by lr or 2 lr; 0.2 lr separates the two
    lr = exps[0].config.optimizer.learning_rate
    tol = lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=0.2 * lr)
    jax.tree.map(tol, out[3][3], out[0][3])


def test_config_rejects_a_negative_chunk_size():
    from configs import arithmetic
    from grpo_jax import config_utils

    c = arithmetic.get_config("grpo,smoke")
    assert c.algorithm.logprob_chunk_size == 0
    c.algorithm.logprob_chunk_size = -1
    with pytest.raises(ConfigError, match="logprob_chunk_size"):
        config_utils.validate(c)


def _collectives_in_loops(hlo: str, dim: int) -> list[str]:
    """Collective ops (all-gather / all-reduce / reduce-scatter) on an array with a `dim`-sized
    axis inside a `while` body (or a computation it calls) of compiled HLO text."""
    comps = {}
    for block in re.split(r"\n(?=\S)", hlo):
        m = re.match(r"(?:ENTRY )?(%[\w.\-]+)", block)
        if m:
            comps[m.group(1)] = block
    calls = {
        n: set(re.findall(r"(?:calls|to_apply|body|condition)=\{?(%[\w.\-]+)", b))
        for n, b in comps.items()
    }
    todo = re.findall(r"while\(.*?body=(%[\w.\-]+)", hlo)
    inside = set()
    while todo:
        n = todo.pop()
        if n not in inside:
            inside.add(n)
            todo.extend(calls.get(n, ()))
    pattern = re.compile(r"(all-gather|all-reduce|reduce-scatter)(-start)?\(")
    return [
        line.strip()[:120]
        for n in inside
        for line in comps.get(n, "").splitlines()
        if pattern.search(line) and re.search(rf"[\[,]{dim}[\],]", line)
    ]


@pytest.mark.parametrize("tied", [True, False])
def test_fsdp_mesh_same_values_and_no_head_collective_per_chunk(tied):
    from grpo_jax import sharding

    V = 97
    graphdef, params = _model(tied, vocab=V)
    R, Lp, Lc = 8, 4, 12
    tokens, mask = _grouped_batch(R, 1, Lp, Lc, vocab=V)
    adv = jnp.asarray(np.random.default_rng(4).normal(size=(R,)), jnp.float32)
    mesh = sharding.make_mesh({"data": 1, "fsdp": 4, "tensor": 1}, jax.devices()[:4])
    shards = sharding.param_shardings(params, mesh)
    sharded = jax.device_put(params.to_pure_dict(), shards)
    batch = sharding.batch_sharding(mesh, 2)
    t, m = jax.device_put(tokens, batch), jax.device_put(mask, batch)

    def fn(chunk):
        def f(p, t, m):
            return jax.value_and_grad(_grpo_loss(graphdef, Lp, 1, chunk, t, m, adv))(p)

        return jax.jit(sharding.under_mesh(mesh, f))

    chunked = fn(5).lower(sharded, t, m).compile()
    assert _collectives_in_loops(chunked.as_text(), V) == []
    (l1, g1) = chunked(sharded, t, m)
    (l0, g0) = jax.jit(jax.value_and_grad(_grpo_loss(graphdef, Lp, 1, 0, tokens, mask, adv)))(
        params.to_pure_dict()
    )
    np.testing.assert_allclose(l1, l0, rtol=1e-5, atol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), g1, g0)


@pytest.mark.slow  # two TPU compiles of the update: ~3 min each on a loaded 2-core CPU
def test_tpu_compiler_update_temp_memory_at_qwen3_vocabulary():
    """libtpu's compiler for a v5e:2x2 slice (nothing runs): a tiny model's update (16 rows,
    FSDP 4) at Qwen3's vocabulary, 256 completion tokens, whole logits vs 32-position chunks.
    Measured (2026-12-03): temp 962.7 MB vs 87.0 MB per device."""
    from experiments import aot

    if aot.libtpu_missing():
        pytest.skip(aot.libtpu_missing())
    from tests.test_aot import tiny_dapo

    V, Lc = 151_936, 256
    temps = {}
    for chunk in (0, 32):
        c = tiny_dapo()
        c.model.overrides.vocab_size = V
        c.rollout.max_new_tokens = Lc
        c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1
        c.algorithm.logprob_chunk_size = chunk
        r = aot.compile_steps(c, devices=aot.tpu_devices("v5e-4"), sampler="none", logprobs=False)
        temps[chunk] = r["steps"]["update"]["temp"]
    rows = c.algorithm.mini_batch_size // 4  # per device
    logits = rows * Lc * V * 2  # bfloat16 [rows, Lc, V] per device
    assert temps[0] > 2.5 * logits  # the logits and their float32 gradient
    assert temps[32] < temps[0] / 8
