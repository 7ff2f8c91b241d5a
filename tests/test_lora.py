"""LoRA: adapters-only training, the optimizer state's size, merging, and rank 0 = the plain model."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, traverse_util

from configs import arithmetic
from grpo_jax import experiment, steps, train
from grpo_jax.models import config as model_config_lib
from grpo_jax.models import lora, positions_from_mask, transformer
from grpo_jax.state import Batch


def lora_config(rank=2, **overrides):
    c = arithmetic.get_config("grpo,smoke,lora")
    c.mesh.num_devices = 1
    c.logging.tensorboard = False
    c.model.lora.rank = rank
    for key, value in overrides.items():
        node = c
        *path, last = key.split(".")
        for p in path:
            node = node[p]
        node[last] = value
    return c


def random_batch(exp, R, seed=1):
    L, Lc = exp.prompt_len + exp.max_new_tokens, exp.max_new_tokens
    g = np.random.default_rng(seed)
    cmask = (np.arange(Lc)[None] < g.integers(1, Lc + 1, (R, 1))).astype(np.float32)
    old = jnp.asarray(g.normal(-2, 0.1, (R, Lc)), jnp.float32)
    return Batch(
        tokens=jnp.asarray(g.integers(1, 10, (R, L)), jnp.int32),
        attention_mask=jnp.ones((R, L), bool),
        completion_mask=jnp.asarray(cmask),
        advantages=jnp.asarray(g.normal(size=(R,)), jnp.float32),
        sample_weights=jnp.ones((R,), jnp.float32),
        old_logprobs=old,
        ref_logprobs=old,
        sampler_logprobs=old,
    )


def _flat(tree):
    return traverse_util.flatten_dict(jax.device_get(tree))


def test_rank_zero_is_the_plain_model_and_fresh_adapters_change_nothing():
    mc = model_config_lib.get_preset("tiny")
    plain = nnx.split(transformer.Transformer(mc, rngs=nnx.Rngs(0)), nnx.Param)[1].to_pure_dict()
    zero = transformer.Transformer(mc.replace(lora_rank=0), rngs=nnx.Rngs(0))
    assert jax.tree.all(
        jax.tree.map(np.array_equal, nnx.split(zero, nnx.Param)[1].to_pure_dict(), plain)
    )
    adapted = transformer.Transformer(mc.replace(lora_rank=4), rngs=nnx.Rngs(0))
    params = nnx.split(adapted, nnx.Param)[1].to_pure_dict()
    base, ada = lora.split(params)
    # the base draws are the plain model's; 7 targets x (A, B) adapters, all nnx.LoRAParam
    assert jax.tree.all(jax.tree.map(np.array_equal, base, plain))
    assert len(jax.tree.leaves(ada)) == 14
    assert len(jax.tree.leaves(nnx.state(adapted, nnx.LoRAParam))) == 14
    tok = jnp.asarray([[3, 4, 5, 6, 7]])
    pos = jnp.arange(5)[None]
    a = transformer.Transformer(mc, rngs=nnx.Rngs(0))(tok, pos)[0]
    np.testing.assert_array_equal(adapted(tok, pos)[0], a)  # B = 0: bitwise the plain model
    # config.model.lora.rank = 0 (the default): no adapter in the state, AdamW over everything
    exp = experiment.build_experiment(lora_config(rank=0), with_data=False)
    state = steps.init_train_state(exp)
    assert not exp.lora and not lora.adapters(jax.device_get(state.params))
    assert lora.num_bytes(state.opt_state) > 2 * lora.num_bytes(state.params)


def test_update_trains_only_the_adapters_and_the_optimizer_state_covers_only_them():
    exp = experiment.build_experiment(lora_config(), with_data=False)
    state = steps.init_train_state(exp)
    before = _flat(state.params)
    R = exp.config.rollout.prompts_per_step * exp.config.rollout.rollouts_per_prompt
    update = steps.make_steps(exp).update
    for seed in (1, 2):
        state, m = update(state, random_batch(exp, R, seed))
        assert bool(m["update_ok"])
    after = _flat(state.params)
    assert set(after) == set(before)
    for k in before:
        if lora._is_adapter(k):
            continue
        np.testing.assert_array_equal(after[k], before[k], err_msg=str(k))  # base frozen
    changed = [k for k in before if lora._is_adapter(k) and not np.array_equal(after[k], before[k])]
    assert {k[-1] for k in changed} == {"lora_a", "lora_b"}
    # AdamW's moments are shaped like the adapters: the state is ~2 x the adapters' bytes
    adam = state.opt_state[-1][0]  # chain(clip, adamw) -> adamw = chain(scale_by_adam, ...)
    assert jax.tree.structure(adam.mu) == jax.tree.structure(lora.adapters(state.params))
    ada_bytes = lora.num_bytes(lora.adapters(state.params))
    assert lora.num_bytes(state.opt_state) <= 2 * ada_bytes + 64
    full = experiment.build_experiment(lora_config(rank=0), with_data=False)
    full_bytes = lora.num_bytes(full.abstract_state.opt_state)
    assert lora.num_bytes(state.opt_state) <= 0.05 * full_bytes
    # the gradient is taken w.r.t. the adapters only: no base-shaped cotangent is produced
    base, ada = lora.split(state.params)
    batch = random_batch(exp, R)

    def loss(a):
        return steps.completion_logprobs(
            exp.graphdef,
            lora.combine(base, a),
            batch.tokens,
            batch.attention_mask,
            exp.prompt_len,
            1.0,
        ).sum()

    g = jax.grad(loss)(ada)
    assert jax.tree.structure(g) == jax.tree.structure(ada)


def test_merged_weights_give_the_adapted_model_logits():
    mc = model_config_lib.get_preset("tiny").replace(lora_rank=3, lora_alpha=6.0)
    model = transformer.Transformer(mc, rngs=nnx.Rngs(0))
    params = nnx.split(model, nnx.Param)[1].to_pure_dict()
    g = np.random.default_rng(0)
    flat = traverse_util.flatten_dict(params)
    for k in flat:  # non-zero B (a fresh adapter merges to W itself)
        if k[-1] == "lora_b":
            flat[k] = jnp.asarray(g.normal(0, 0.1, flat[k].shape), jnp.float32)
    params = traverse_util.unflatten_dict(flat)
    graphdef = nnx.split(model, nnx.Param)[0]
    tok = jnp.asarray(g.integers(1, mc.vocab_size, (2, 7)), jnp.int32)
    pos = positions_from_mask(jnp.ones_like(tok, bool))
    adapted = nnx.merge(graphdef, params)(tok, pos)[0]
    plain_cfg = mc.replace(lora_rank=0)
    plain_def = nnx.split(transformer.Transformer(plain_cfg, rngs=nnx.Rngs(0)), nnx.Param)[0]
    merged = lora.merge(params, mc)
    assert not lora.adapters(merged)
    out = nnx.merge(plain_def, merged)(tok, pos)[0]
    assert (
        float(jnp.abs(adapted - nnx.merge(plain_def, lora.split(params)[0])(tok, pos)[0]).max())
        > 1e-3
    )
    np.testing.assert_allclose(out, adapted, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_lora_run_checkpoints_adapters_and_exports_merged_weights(tmp_path):
    from experiments import export
    from grpo_jax.models.loading import load_hf_checkpoint

    # a format bonus: rewards vary within groups even before the smoke model is ever right
    cfg = lora_config(steps=2, **{"optimizer.learning_rate": 1e-2, "reward.format_reward": 0.5})
    workdir = str(tmp_path / "run")
    summary = train.train_and_evaluate(cfg, workdir)
    assert summary["steps"] == 2
    from grpo_jax.train import restore_run

    exp, run, step = restore_run(workdir)
    try:
        params = jax.device_get(run.train.params)
        assert step == 2 and lora.adapters(params)
        b = [v for k, v in _flat(params).items() if k[-1] == "lora_b"]
        assert any(np.abs(x).max() > 0 for x in b)  # the adapters trained and were saved
        out = export.export(workdir, str(tmp_path / "hf"))
        mc, graphdef, hf = load_hf_checkpoint(out)
        assert mc.lora_rank == 0
        tok = jnp.asarray([[5, 6, 7, 8, 9]], jnp.int32)
        pos = jnp.arange(5)[None]
        ours = nnx.merge(exp.graphdef, params)(tok, pos)[0]
        theirs = nnx.merge(graphdef, hf)(tok, pos)[0]
        np.testing.assert_allclose(theirs, ours, rtol=1e-5, atol=1e-5)
    finally:
        exp.close()
    assert os.path.exists(os.path.join(out, "model.safetensors"))
