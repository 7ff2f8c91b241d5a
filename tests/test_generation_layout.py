"""The generation layout (`grpo_jax.generation_layout`): the sampler's parameters resharded
from the training layout equal the training ones, the sampler gives the same rollouts in
either layout (8 virtual CPU devices), and the planner picks what a hand computation says."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax import generation_layout as gl
from grpo_jax import sharding
from grpo_jax.models import get_preset, transformer
from grpo_jax.models.transformer import random_params
from grpo_jax.sampling import SamplingConfig, generate

CFG = get_preset("tiny", vocab_size=600, num_layers=2, tie_word_embeddings=False)
GD, PARAMS = random_params(CFG, 1, stddev=0.2)
PARAMS = (
    PARAMS.to_pure_dict() if isinstance(PARAMS, nnx.State) else PARAMS
)  # as training holds them
ABSTRACT = nnx.split(transformer.Transformer(CFG, rngs=nnx.Rngs(0)), nnx.Param)[1]


def _training(params):
    mesh = sharding.make_mesh({"data": 1, "fsdp": 8, "tensor": 1})
    shardings = sharding.param_shardings(ABSTRACT, mesh)
    return mesh, jax.device_put(params, shardings)


@pytest.mark.parametrize("spec", ["2x4", "4x2", "8x1"])
def test_resharded_parameters_equal_the_training_ones_every_time(spec):
    mesh, params = _training(PARAMS)
    gmesh = gl.mesh_for(gl.Layout.parse(spec), mesh)
    shardings = gl.param_shardings(ABSTRACT, gmesh)
    for step in range(2):  # a changed parameter is resharded too
        params = jax.tree.map(lambda x, step=step: x + step, params)
        out = gl.reshard(params, shardings)
        for a, b, sh in zip(
            jax.tree.leaves(params), jax.tree.leaves(out), jax.tree.leaves(shardings)
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            assert b.sharding == sh
    specs = {str(s.spec) for s in jax.tree.leaves(shardings)}
    tensor = gl.Layout.parse(spec).tensor
    assert any("tensor" in s for s in specs) == (tensor > 1)
    assert not any("fsdp" in s for s in specs)  # nothing sharded over the training axis


def test_a_reshard_to_the_compute_dtype_casts_and_samples_the_same():
    # float32 master weights, bfloat16 compute: the generation copy in bfloat16 holds the
    # values the model would cast to at every use, so the rollouts are bit-identical
    gd16, _ = random_params(CFG.replace(dtype="bfloat16"), 1, stddev=0.2)
    mesh, params = _training(PARAMS)
    gmesh = gl.mesh_for(gl.Layout(4, 2), mesh)
    shardings = gl.param_shardings(ABSTRACT, gmesh)
    cast = gl.reshard(params, shardings, dtype="bfloat16")
    for a, b, sh in zip(jax.tree.leaves(params), jax.tree.leaves(cast), jax.tree.leaves(shardings)):
        assert b.dtype == jnp.bfloat16 and b.sharding == sh
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.bfloat16)), np.asarray(b))
    toks = jnp.asarray(np.random.default_rng(1).integers(1, 600, (8, 6)), jnp.int32)
    mask = jnp.ones((8, 6), bool)
    cfg = SamplingConfig(max_new_tokens=8, temperature=1.0)
    ref = _sample(gl.reshard(params, shardings), gmesh, toks, mask, cfg, gd16)
    out = _sample(cast, gmesh, toks, mask, cfg, gd16)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(out.logprobs), np.asarray(ref.logprobs))


def _sample(params, mesh, toks, mask, cfg, graphdef=GD):
    def call(p, t, m):
        return generate(graphdef, p, t, m, jax.random.key(3), cfg)

    batch = sharding.batch_sharding(mesh, 2)
    return sharding.under_mesh(mesh, call)(
        params, jax.device_put(toks, batch), jax.device_put(mask, batch)
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampler_in_the_generation_layout_equals_the_training_layout(temperature):
    rng = np.random.default_rng(0)
    toks = jnp.asarray(rng.integers(1, 600, (8, 6)), jnp.int32)
    mask = jnp.asarray(np.arange(6)[None] >= rng.integers(0, 4, (8, 1)))
    cfg = SamplingConfig(max_new_tokens=12, temperature=temperature, eos_ids=(7,))
    mesh, params = _training(PARAMS)
    ref = _sample(params, mesh, toks, mask, cfg)
    gmesh = gl.mesh_for(gl.Layout(4, 2), mesh)  # rows over 4, kv heads (2) over 2
    gparams = gl.reshard(params, gl.param_shardings(ABSTRACT, gmesh))
    out = _sample(gparams, gmesh, toks, mask, cfg)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(ref.lengths))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(ref.logprobs), atol=2e-5)


def _hand_costs(t, d, rows, slots):
    """decode_costs of the tiny model by hand (float32, 2 layers, E 64, F 128, H 4 x 16,
    K 2 x 16, V 600 untied): per-device parameter bytes of a data d x tensor t layout."""
    E, F, V, L, H, K, D = 64, 128, 600, 2, 4, 2, 16
    kv_t = t if K % t == 0 else 1
    h_t = t if H % t == 0 else 1
    f_t = t if F % t == 0 else 1
    v_t = t if V % t == 0 else 1
    per_layer = (E * H * D / h_t + 2 * E * K * D / kv_t + H * D * E / h_t) + 3 * E * F / f_t
    per_layer += 2 * E + 2 * D  # the two RMSNorms and q/k norms, replicated
    params = 4 * (L * per_layer + 2 * V * E / v_t + E)
    kv = rows / d * slots * (2 * L * K * D * 4) / kv_t
    return params, kv


def test_decode_costs_match_a_hand_computation():
    for t, d in ((1, 8), (2, 4), (4, 2)):
        c = gl.decode_costs(gl.Layout(d, t), CFG, ABSTRACT, rows=16, slots=40)
        params, kv = _hand_costs(t, d, 16, 40)
        assert c["params"] == pytest.approx(params)
        assert c["kv"] == pytest.approx(kv)


def test_the_planner_picks_the_fastest_layout_that_fits():
    # bytes only (the CPU's default Hardware): per device params + kv + link, by hand
    slots, rows = 40, 16
    times = {}
    for lay in gl.candidates(8, rows):
        p, kv = _hand_costs(lay.tensor, lay.data, rows, slots)
        r, t = rows / lay.data, lay.tensor
        link = (t - 1) / t * r * (2 * 2 * 2 * 64 * 4 + 600 * 4)
        times[lay.name] = (p + kv + link, t)
    expect = min(times, key=lambda k: times[k])
    assert gl.plan(CFG, ABSTRACT, 8, rows=rows, slots=slots).layout.name == expect
    # a memory limit that only the layouts with the kv heads split hold
    mems = {
        k: sum(_hand_costs(int(k.split("x")[1]), int(k.split("x")[0]), rows, slots)) for k in times
    }
    limit = mems["4x2"] + 1
    fits = [k for k in times if mems[k] <= limit]
    expect = min(fits, key=lambda k: times[k])
    hw = gl.Hardware(memory_bytes=limit)
    assert gl.plan(CFG, ABSTRACT, 8, rows=rows, slots=slots, hardware=hw).layout.name == expect
    # compiled memory overrides the analytic one: only 8x1 "compiled" small enough
    choice = gl.plan(
        CFG,
        ABSTRACT,
        8,
        rows=rows,
        slots=slots,
        hardware=gl.Hardware(memory_bytes=100.0),
        compiled_bytes=lambda lay: 50.0 if lay.name == "8x1" else None,
    )
    assert choice.layout.name == "8x1" and choice.candidates["8x1"]["compiled"]
    with pytest.raises(ValueError, match="no generation layout fits"):
        gl.plan(CFG, ABSTRACT, 8, rows=rows, slots=slots, hardware=gl.Hardware(memory_bytes=1.0))


def test_layout_parse_refuses_a_bad_spec():
    assert gl.Layout.parse("2x4") == gl.Layout(2, 4)
    for bad in ("2", "0x8", "ax2", "2x4x1"):
        with pytest.raises(ValueError, match="DxT"):
            gl.Layout.parse(bad)


def _smoke(layout, steps=2):
    from configs import arithmetic

    c = arithmetic.get_config("grpo,smoke")
    c.steps, c.logging.tensorboard = steps, False
    c.mesh.num_devices, c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 8, 1, 8, 1
    c.rollout.generation_layout = layout
    return c


@pytest.mark.slow
def test_a_run_sampling_in_a_generation_layout_equals_the_training_layout(tmp_path):
    from grpo_jax import train, writers

    for name in ("training", "4x2"):
        train.train_and_evaluate(_smoke(name), str(tmp_path / name))
    a, b = (
        [r for r in writers.read_jsonl(str(tmp_path / n / "metrics.jsonl")) if "loss" in r]
        for n in ("training", "4x2")
    )
    assert len(a) == len(b) == 2
    for ra, rb in zip(a, b):  # the same rollouts (tokens, so rewards), log-probs to rounding
        assert ra["reward_mean"] == rb["reward_mean"]
        assert ra["generated_tokens"] == rb["generated_tokens"]
        np.testing.assert_allclose(ra["loss"], rb["loss"], atol=1e-5)


def test_a_bad_generation_layout_is_a_config_error():
    from grpo_jax import steps
    from grpo_jax.errors import ConfigError
    from grpo_jax.experiment import build_experiment

    for bad, match in (
        ("2x2", "needs 4 devices"),
        ("3x3", "do not divide"),
        ("4:2", "DxT"),
        ("8x1x1", "DxT"),
    ):
        with pytest.raises(ConfigError, match=match) as e:
            steps.make_steps(build_experiment(_smoke(bad), with_data=False))
        assert "config.rollout.generation_layout" in str(e.value) and "\n" not in str(e.value)


def test_auto_takes_the_planners_layout():
    from grpo_jax.experiment import build_experiment

    exp = build_experiment(_smoke("auto"), with_data=False)
    gmesh, shardings = gl.for_experiment(exp)
    abstract = nnx.split(transformer.Transformer(exp.model_config, rngs=nnx.Rngs(0)), nnx.Param)[1]
    expect = gl.plan(
        exp.model_config,
        abstract,
        8,
        rows=exp.batching.generate_batch_size,
        slots=exp.prompt_len + exp.max_new_tokens,
    ).layout
    assert (gmesh.shape["data"], gmesh.shape["tensor"]) == (expect.data, expect.tensor)
    assert gl.for_experiment(build_experiment(_smoke("training"), with_data=False)) == (None, None)
