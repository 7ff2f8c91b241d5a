"""Decoder-only transformer in Flax NNX (Llama / Qwen2 / Qwen3 families) with a KV cache.

Architecture (pre-norm):
  h = embed(tokens)
  for each layer:  h = h + Attn(RMSNorm(h));  h = h + SwiGLU(RMSNorm(h))
  logits = RMSNorm(h) @ W_out      (W_out = embed^T when tie_word_embeddings)

- RMSNorm: Zhang & Sennrich 2019, y = x / sqrt(mean(x^2) + eps) * w (computed in float32).
- RoPE: Su et al. 2021 (RoFormer), Hugging Face "rotate_half" layout: the head dim is split
  into halves (x1, x2) and rotated as (x1 cos - x2 sin, x2 cos + x1 sin) with
  theta_i = rope_theta^(-2i/head_dim). Recomputed from `positions` (no cached tables, so the
  model has no non-Param state: `nnx.split(model, nnx.Param)` captures everything).
- Attention: grouped-query attention (Ainslie et al. 2023) as a grouped einsum, float32
  softmax, optional per-head QK RMSNorm before RoPE (Qwen3), optional q/k/v bias (Qwen2).
- MLP: SwiGLU (Shazeer 2020), down(silu(gate(x)) * up(x)).

Layers are stored stacked (every per-layer Param has a leading `num_layers` axis with logical
axis name None) and run with `jax.lax.scan`, so compile time does not grow with depth.
Logical axis names on Params: "vocab", "embed", "mlp", "heads", "kv_heads", "head_dim", "norm"
(or None). Param tree (HF names in parentheses):
  model.embed [V, E]                    ("vocab", "embed")        (model.embed_tokens)
  model.layers.attn_norm [L, E]         (None, "norm")            (input_layernorm)
  model.layers.attn.q_proj [L, E, H, D] (None, "embed", "heads", "head_dim")
  model.layers.attn.k_proj / v_proj [L, E, KVH, D] (None, "embed", "kv_heads", "head_dim")
  model.layers.attn.o_proj [L, H, D, E] (None, "heads", "head_dim", "embed")
  model.layers.attn.{q,k,v}_bias [L, H|KVH, D]  (qkv_bias only)
  model.layers.attn.{q,k}_norm [L, D]   (None, "norm")            (qk_norm only)
  model.layers.mlp_norm [L, E]          (post_attention_layernorm)
  model.layers.mlp.{gate,up}_proj [L, E, F] (None, "embed", "mlp"); down_proj [L, F, E]
  model.final_norm [E]                  ("norm",)                 (model.norm)
  lm_head [E, V]                        ("embed", "vocab")        (untied only)
"""
from __future__ import annotations

from typing import Optional

import flax
import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax import sharding
from grpo_jax.models.config import ModelConfig

_NEG_INF = -1e30  # finite "minus infinity": fully masked rows give a uniform softmax, not NaN


def _param(rngs: nnx.Rngs, init, shape, axes, dtype) -> nnx.Param:
    """Param initialised by `init` with logical-axis annotation `axes` (one name per dim).

    eager_sharding=False: the annotation is metadata only; the trainer applies its own
    logical-axis rules (nnx.get_partition_spec) under its mesh.
    """
    assert len(axes) == len(shape), (axes, shape)
    return nnx.Param(nnx.with_partitioning(init, axes, eager_sharding=False)(
        rngs.params(), shape, jnp.dtype(dtype)))


def _stack(num_layers: Optional[int], shape, axes):
    """Prepend the stacked-layer axis (logical name None) when num_layers is given."""
    if num_layers is None:
        return tuple(shape), tuple(axes)
    return (num_layers, *shape), (None, *axes)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis in float32, returned in x.dtype (HF Llama/Qwen convention:
    normalise in float32, cast to the input dtype, then scale)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return y.astype(x.dtype) * weight.astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, HF rotate_half layout. x [B, T, N, D]; positions [B, T] int32."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))  # [D/2]
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [B, T, 1, D]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x * cos + rotated * sin


def positions_from_mask(mask: jax.Array) -> jax.Array:
    """Rotary positions for a LEFT-padded batch: [B, T] bool -> [B, T] int32, 0 at the first
    real token (pads get 0)."""
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)


@flax.struct.dataclass
class KVCache:
    """Static-size key/value cache for decoding.

    k, v: [L, B, S, KVH, D] (config.dtype); key_mask: [B, S] bool, True on slots holding a
    real token; index: [] int32, the next slot to write (same for all rows: prompts are
    left-padded, so slot s of every row is written at the same step). Writing past S is
    clamped by dynamic_update_slice: size S >= prompt length + new tokens.
    """
    k: jax.Array
    v: jax.Array
    key_mask: jax.Array
    index: jax.Array


def init_cache(config: ModelConfig, batch_size: int, max_len: int, dtype=None) -> KVCache:
    """Empty KVCache for `batch_size` rows and `max_len` slots (dtype defaults to config.dtype)."""
    dtype = jnp.dtype(dtype or config.dtype)
    shape = (config.num_layers, batch_size, max_len, config.num_kv_heads, config.head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   key_mask=jnp.zeros((batch_size, max_len), bool),
                   index=jnp.zeros((), jnp.int32))


class Attention(nnx.Module):
    """GQA self-attention; Params stacked over `num_layers` when given (see module doc)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, num_layers: Optional[int] = None):
        c = config
        self.config = c
        w = nnx.initializers.normal(0.02)
        pd = c.param_dtype
        E, H, K, D = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = _param(rngs, w, *_stack(num_layers, (E, H, D), ("embed", "heads", "head_dim")), pd)
        self.k_proj = _param(rngs, w, *_stack(num_layers, (E, K, D), ("embed", "kv_heads", "head_dim")), pd)
        self.v_proj = _param(rngs, w, *_stack(num_layers, (E, K, D), ("embed", "kv_heads", "head_dim")), pd)
        self.o_proj = _param(rngs, w, *_stack(num_layers, (H, D, E), ("heads", "head_dim", "embed")), pd)
        if c.qkv_bias:
            z = nnx.initializers.zeros_init()
            self.q_bias = _param(rngs, z, *_stack(num_layers, (H, D), ("heads", "head_dim")), pd)
            self.k_bias = _param(rngs, z, *_stack(num_layers, (K, D), ("kv_heads", "head_dim")), pd)
            self.v_bias = _param(rngs, z, *_stack(num_layers, (K, D), ("kv_heads", "head_dim")), pd)
        if c.qk_norm:
            o = nnx.initializers.ones_init()
            self.q_norm = _param(rngs, o, *_stack(num_layers, (D,), ("norm",)), pd)
            self.k_norm = _param(rngs, o, *_stack(num_layers, (D,), ("norm",)), pd)

    def __call__(self, x, positions, mask, kv_write, kv_read):
        """x [B, T, E]; positions [B, T]; mask [B, T, S] bool (query may attend key);
        kv_write(k, v) stores this step's keys/values [B, T, KVH, D] and kv_read() returns the
        keys/values to attend to [B, S, KVH, D]. Returns [B, T, E]."""
        c = self.config
        dt = x.dtype
        q = jnp.einsum("bte,ehd->bthd", x, self.q_proj[...].astype(dt))
        k = jnp.einsum("bte,ehd->bthd", x, self.k_proj[...].astype(dt))
        v = jnp.einsum("bte,ehd->bthd", x, self.v_proj[...].astype(dt))
        if c.qkv_bias:
            q = q + self.q_bias[...].astype(dt)
            k = k + self.k_bias[...].astype(dt)
            v = v + self.v_bias[...].astype(dt)
        if c.qk_norm:
            q = rms_norm(q, self.q_norm[...], c.rms_norm_eps)
            k = rms_norm(k, self.k_norm[...], c.rms_norm_eps)
        q = apply_rope(q, positions, c.rope_theta)
        k = apply_rope(k, positions, c.rope_theta)
        kv_write(k, v)
        keys, values = kv_read()
        B, T, H, D = q.shape
        K = c.num_kv_heads
        qg = q.reshape(B, T, K, H // K, D)
        scores = jnp.einsum("btkgd,bskd->bkgts", qg, keys.astype(dt),
                            preferred_element_type=jnp.float32) * (D ** -0.5)
        scores = jnp.where(mask[:, None, None, :, :], scores, _NEG_INF)
        probs = jax.nn.softmax(scores, axis=-1).astype(dt)
        out = jnp.einsum("bkgts,bskd->btkgd", probs, values.astype(dt)).reshape(B, T, H, D)
        return jnp.einsum("bthd,hde->bte", out, self.o_proj[...].astype(dt))


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, num_layers: Optional[int] = None):
        E, F = config.hidden_size, config.intermediate_size
        w = nnx.initializers.normal(0.02)
        pd = config.param_dtype
        self.gate_proj = _param(rngs, w, *_stack(num_layers, (E, F), ("embed", "mlp")), pd)
        self.up_proj = _param(rngs, w, *_stack(num_layers, (E, F), ("embed", "mlp")), pd)
        self.down_proj = _param(rngs, w, *_stack(num_layers, (F, E), ("mlp", "embed")), pd)

    def __call__(self, x):
        dt = x.dtype
        g = x @ self.gate_proj[...].astype(dt)
        u = x @ self.up_proj[...].astype(dt)
        return (jax.nn.silu(g) * u) @ self.down_proj[...].astype(dt)


class Block(nnx.Module):
    """One pre-norm decoder layer (Params stacked over `num_layers` when given)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, num_layers: Optional[int] = None):
        E = config.hidden_size
        o = nnx.initializers.ones_init()
        self.config = config
        self.attn_norm = _param(rngs, o, *_stack(num_layers, (E,), ("norm",)), config.param_dtype)
        self.attn = Attention(config, rngs=rngs, num_layers=num_layers)
        self.mlp_norm = _param(rngs, o, *_stack(num_layers, (E,), ("norm",)), config.param_dtype)
        self.mlp = MLP(config, rngs=rngs, num_layers=num_layers)

    def __call__(self, x, positions, mask, kv_write, kv_read):
        eps = self.config.rms_norm_eps
        x = x + self.attn(rms_norm(x, self.attn_norm[...], eps), positions, mask, kv_write, kv_read)
        return x + self.mlp(rms_norm(x, self.mlp_norm[...], eps))


class Decoder(nnx.Module):
    """Embedding + stacked layers + final norm (the trunk shared by Transformer and CriticModel)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.embed = _param(rngs, nnx.initializers.normal(0.02),
                            (config.vocab_size, config.hidden_size), ("vocab", "embed"),
                            config.param_dtype)
        self.layers = Block(config, rngs=rngs, num_layers=config.num_layers)
        self.final_norm = _param(rngs, nnx.initializers.ones_init(), (config.hidden_size,),
                                 ("norm",), config.param_dtype)

    def __call__(self, tokens, positions, attention_mask=None, *, cache: Optional[KVCache] = None):
        """Returns (hidden [B, T, E] after the final norm in config.dtype, new_cache or None)."""
        c = self.config
        dt = jnp.dtype(c.dtype)
        B, T = tokens.shape
        if attention_mask is None:
            attention_mask = jnp.ones((B, T), bool)
        attention_mask = attention_mask.astype(bool)
        x = jnp.take(self.embed[...], tokens, axis=0).astype(dt)

        if cache is None:
            key_mask = attention_mask
            q_slot = jnp.arange(T)
            S = T
        else:
            S = cache.k.shape[2]
            key_mask = jax.lax.dynamic_update_slice(cache.key_mask, attention_mask, (0, cache.index))
            q_slot = cache.index + jnp.arange(T)
        mask = key_mask[:, None, :] & (jnp.arange(S)[None, None, :] <= q_slot[None, :, None])

        graphdef, layer_state = nnx.split(self.layers)

        def body(carry, xs):
            h, ck, cv = carry
            state_l, l = xs
            block = nnx.merge(graphdef, state_l)
            fresh = {}
            if cache is None:
                def kv_write(k, v):
                    fresh["kv"] = (k, v)

                def kv_read():
                    return fresh["kv"]
            else:
                def kv_write(k, v):
                    fresh["k"] = jax.lax.dynamic_update_slice(ck, k[None].astype(ck.dtype), (l, 0, cache.index, 0, 0))
                    fresh["v"] = jax.lax.dynamic_update_slice(cv, v[None].astype(cv.dtype), (l, 0, cache.index, 0, 0))

                def kv_read():
                    return (jax.lax.dynamic_index_in_dim(fresh["k"], l, 0, keepdims=False),
                            jax.lax.dynamic_index_in_dim(fresh["v"], l, 0, keepdims=False))
            h = sharding.constrain_batch(h)  # rows over data x fsdp (a no-op without a mesh)
            h = block(h, positions, mask, kv_write, kv_read)
            if cache is not None:
                ck, cv = fresh["k"], fresh["v"]
            return (h, ck, cv), None

        if c.remat:
            body = jax.checkpoint(body)
        ck0 = cache.k if cache is not None else jnp.zeros((), dt)
        cv0 = cache.v if cache is not None else jnp.zeros((), dt)
        (x, ck, cv), _ = jax.lax.scan(body, (x, ck0, cv0),
                                      (layer_state, jnp.arange(c.num_layers, dtype=jnp.int32)))
        x = rms_norm(x, self.final_norm[...], c.rms_norm_eps)
        new_cache = None
        if cache is not None:
            new_cache = KVCache(k=ck, v=cv, key_mask=key_mask, index=cache.index + T)
        return x, new_cache


class Transformer(nnx.Module):
    """Causal language model: Decoder trunk + lm_head (tied to the embedding when configured)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.model = Decoder(config, rngs=rngs)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = _param(rngs, nnx.initializers.normal(0.02),
                                  (config.hidden_size, config.vocab_size), ("embed", "vocab"),
                                  config.param_dtype)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [..., E] (output of the final norm) -> logits [..., V] in hidden.dtype."""
        dt = hidden.dtype
        if self.lm_head is None:
            return jnp.einsum("...e,ve->...v", hidden, self.model.embed[...].astype(dt))
        return hidden @ self.lm_head[...].astype(dt)

    def __call__(self, tokens, positions, attention_mask=None, *, cache: Optional[KVCache] = None,
                 return_hidden: bool = False):
        """tokens [B, T] int32; positions [B, T] int32 rotary positions (left padding: count from
        the first real token, see positions_from_mask); attention_mask [B, T] bool, True on real
        tokens (key padding mask combined with the causal mask; None = all real);
        cache: optional KVCache, the tokens are written at slots [cache.index, cache.index + T)
        and attend to every earlier valid slot.

        Returns (logits [B, T, V] in config.dtype, new_cache or None); with return_hidden=True
        the first element is the final-norm hidden state [B, T, E] instead (apply
        `self.logits` to the rows you need, e.g. the last one, to skip the [B, T, V] product).
        Fully-masked query rows (pads) get finite garbage outputs, never NaN.
        """
        h, new_cache = self.model(tokens, positions, attention_mask, cache=cache)
        if return_hidden:
            return h, new_cache
        return self.logits(h), new_cache


def random_params(config: ModelConfig, seed: int = 0, *, stddev: float = 0.02, cls=None):
    """Host-side (numpy) random init with the same distributions as the module initialisers
    (weights N(0, stddev^2), norms 1, biases 0): `(graphdef, params)` without compiling an init
    program, which takes XLA ~1 s per threefry-normal on a CPU. For tests and benchmarks.
    cls: Transformer (default) or CriticModel."""
    import numpy as np

    cls = cls or Transformer
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0))), nnx.Param)
    rng = np.random.default_rng(seed)
    flat = []
    for path, var in nnx.to_flat_state(abstract):
        name = str(path[-1])
        if name.endswith("norm"):
            x = np.ones(var.shape)
        elif name.endswith("bias"):
            x = np.zeros(var.shape)
        else:
            x = rng.normal(0.0, stddev, var.shape)
        flat.append((path, var.replace(jnp.asarray(x, dtype=var.dtype))))
    return graphdef, nnx.from_flat_state(flat)


class CriticModel(nnx.Module):
    """Value model (PPO baseline): the same Decoder trunk (`self.model`, same Param layout as
    Transformer.model, so it can be initialised from policy params) + a scalar head."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.model = Decoder(config, rngs=rngs)
        self.value_head = _param(rngs, nnx.initializers.normal(0.02), (config.hidden_size,),
                                 ("embed",), "float32")
        self.value_bias = _param(rngs, nnx.initializers.zeros_init(), (), (), "float32")

    def __call__(self, tokens, positions, attention_mask=None) -> jax.Array:
        """Same inputs as Transformer.__call__ (no cache). Returns values [B, T] float32."""
        h, _ = self.model(tokens, positions, attention_mask)
        return h.astype(jnp.float32) @ self.value_head[...] + self.value_bias[...]
