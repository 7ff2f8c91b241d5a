"""Activation sharding (constrain_batch / under_mesh) and the mini-batched log-prob pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from grpo_jax import sharding, steps
from grpo_jax.models.config import get_preset
from grpo_jax.models.transformer import Transformer

CFG = get_preset("tiny", vocab_size=61, num_layers=2)


def _mesh(data=2, fsdp=2, tensor=2):
    return sharding.make_mesh(
        {"data": data, "fsdp": fsdp, "tensor": tensor}, jax.devices()[: data * fsdp * tensor]
    )


def test_constrain_batch_is_a_no_op_without_a_mesh_and_pins_rows_under_one():
    mesh = _mesh()
    x = jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(mesh, PartitionSpec()))
    f = jax.jit(lambda x: sharding.constrain_batch(x * 1.0))
    assert f(x).sharding.spec == PartitionSpec()  # no mesh in context
    y = sharding.under_mesh(mesh, f)(x)
    assert y.sharding.spec == PartitionSpec(("data", "fsdp"))  # 4 row shards
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    odd = jax.device_put(jnp.ones((6, 4)), NamedSharding(mesh, PartitionSpec()))  # 6 rows / 4
    assert sharding.under_mesh(mesh, f)(odd).sharding.spec == PartitionSpec()


def test_every_decoder_layer_input_is_constrained_when_traced_under_a_mesh():
    mesh = _mesh()
    graphdef, params = nnx.split(Transformer(CFG, rngs=nnx.Rngs(0)), nnx.Param)

    def fwd(params, tokens):
        model = nnx.merge(graphdef, params)
        pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        return model(tokens, pos)[0]

    tokens = jnp.ones((8, 5), jnp.int32)
    plain = jax.jit(fwd).lower(params, tokens).as_text()
    pinned = jax.jit(sharding.under_mesh(mesh, fwd)).lower(params, tokens).as_text()
    assert "sharding_constraint" not in plain
    assert '[{"data", "fsdp"}, {}, {}]' in pinned  # [B, T, E] rows over data x fsdp


@pytest.mark.parametrize("rows_per_chunk", [1, 2, 4, 8, 3])
def test_chunked_logprobs_equal_the_one_pass_values(rows_per_chunk):
    graphdef, params = nnx.split(Transformer(CFG, rngs=nnx.Rngs(1)), nnx.Param)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, CFG.vocab_size, (8, 9)), jnp.int32)
    mask = jnp.asarray(np.arange(9)[None, :] >= rng.integers(0, 3, (8, 1)))  # left padding
    full = steps.completion_logprobs(graphdef, params, tokens, mask, 4, 0.7)
    chunked = jax.jit(
        lambda p, t, m: steps.chunked_completion_logprobs(graphdef, p, t, m, 4, 0.7, rows_per_chunk)
    )(params, tokens, mask)
    assert chunked.shape == (8, 5)
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(full), rtol=1e-5, atol=1e-5)


def test_chunked_logprobs_on_a_sharded_batch_keep_the_row_order():
    mesh = _mesh(data=2, fsdp=4, tensor=1)
    graphdef, params = nnx.split(Transformer(CFG, rngs=nnx.Rngs(2)), nnx.Param)
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(1, CFG.vocab_size, (16, 7)), jnp.int32)
    mask = jnp.ones((16, 7), bool)
    full = np.asarray(steps.completion_logprobs(graphdef, params, tokens, mask, 3, 1.0))
    batch = sharding.batch_sharding(mesh, 2)
    fn = jax.jit(
        sharding.under_mesh(
            mesh, lambda p, t, m: steps.chunked_completion_logprobs(graphdef, p, t, m, 3, 1.0, 8)
        )
    )
    out = fn(params, jax.device_put(tokens, batch), jax.device_put(mask, batch))
    np.testing.assert_allclose(np.asarray(out), full, rtol=1e-5, atol=1e-5)
