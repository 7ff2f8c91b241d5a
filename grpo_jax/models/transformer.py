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
- Attention: grouped-query attention (Ainslie et al. 2023), float32 softmax, optional per-head
  QK RMSNorm before RoPE (Qwen3), optional q/k/v bias (Qwen2). The core softmax(q k^T) v is
  `config.attention_impl` (`grpo_jax.models.attention`): the grouped einsum over the whole
  [T, S] score matrix ("einsum"), a blockwise online-softmax XLA kernel with its own VJP
  ("blockwise"), the Pallas splash kernel on TPU ("splash") or cuDNN on GPU ("cudnn"); "auto"
  picks by platform. The decode step (one token over a DecodeCache) is always the einsum;
  over a PrefixDecodeCache (each group's prompt block stored once) it is
  `attention.decode_attention_prefix`, over a `paged_cache.PagedDecodeCache` a registered
  paged kernel (`attention.PAGED_DECODE_KERNELS`: Pallas TPU under "splash", else XLA).
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
With LoRA (config.lora_rank = r > 0), each targeted projection X_proj gets a sibling
`X_lora` (`LoRAAdapter`: `lora_a` [L, *in, r], `lora_b` [L, r, *out], Flax `nnx.LoRAParam`s,
a subclass of `nnx.Param`) and computes W x + (alpha / r) B A x; `grpo_jax.models.lora` splits
the adapters from the frozen base and merges them back into W.
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax import sharding
from grpo_jax.models import attention
from grpo_jax.models.attention import Mask
from grpo_jax.models.config import ModelConfig
from grpo_jax.models.paged_cache import PagedDecodeCache

_NEG_INF = attention._NEG_INF  # finite "minus infinity": fully masked rows give no NaN


def _q_start(cache, T: int, A: int):
    """The causal offset of T new queries written at ``cache.index`` and attending the first A
    slots: None (a static 0) when A == T, since the caller guarantees index + T <= A (the
    samplers' prefill into a fresh cache), so that the fused kernels (splash, cuDNN), which
    take a static mask only, run the prefill; else the traced index (blockwise kernel)."""
    return None if A == T else cache.index


def attention_impl(config: ModelConfig) -> str:
    """The concrete attention core of ``config`` ("auto" resolved by ``jax.default_backend()``;
    `grpo_jax.experiment` resolves it by the mesh's devices before building the model)."""
    return attention.resolve_impl(config.attention_impl, config.dtype)


def recompute_in_backward(fn, static_argnums=()):
    """``fn`` (an attention core: queries, keys, values -> outputs) whose backward pass recomputes
    its intermediates from the inputs instead of storing them (``jax.checkpoint`` saving
    nothing inside ``fn``; the rematerialisation of flash attention, Dao et al. 2022, sec. 3.1).

    The attention probabilities are the largest activations of a layer ([rows, heads, T, S]
    float32): stored, the layer scan stacks them for all layers and XLA zero-fills, writes and
    re-lays out those stacks every call; recomputed, the backward pays one more QK^T product
    and softmax (a few % of the layer's FLOPs). SmolLM2-135M on XLA:CPU, one update
    micro-batch (8 rows x (159 + 128), shared prompt, 6 alternated pairs): loss + grad 0.92x
    the time, XLA temporaries 1.64 vs 2.28 GiB (benchmarks/bench_attention_remat.py). Values
    and gradients are unchanged. Not applied under ``model.remat``, which recomputes the whole
    layer already (nesting would run the attention forward a third time).
    ``prevent_cse=False``: the callers run inside the layer ``lax.scan``, where CSE cannot undo
    the recomputation (except for a one-layer model, whose scan XLA removes: there the
    recomputation is merged back into the forward and nothing is saved); outside
    differentiation nothing is recomputed.
    """
    return jax.checkpoint(fn, prevent_cse=False, static_argnums=static_argnums)


def _param(rngs: nnx.Rngs, init, shape, axes, dtype) -> nnx.Param:
    """Param initialised by `init` with logical-axis annotation `axes` (one name per dim).

    eager_sharding=False: the annotation is metadata only; the trainer applies its own
    logical-axis rules (nnx.get_partition_spec) under its mesh.
    """
    assert len(axes) == len(shape), (axes, shape)
    return nnx.Param(
        nnx.with_partitioning(init, axes, eager_sharding=False)(
            rngs.params(), shape, jnp.dtype(dtype)
        )
    )


def _stack(num_layers: int | None, shape, axes):
    """Prepend the stacked-layer axis (logical name None) when num_layers is given."""
    if num_layers is None:
        return tuple(shape), tuple(axes)
    return (num_layers, *shape), (None, *axes)


@jax.custom_vjp
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up (Shazeer 2020, "GLU Variants Improve Transformer", eq. 6), any shape.

    Same values as `jax.nn.silu(gate) * up`; the custom VJP keeps only `gate` and `up` for the
    backward pass and recomputes sigmoid(gate) there. Autodiff of the plain expression keeps
    four [tokens, intermediate] residuals per layer (sigmoid, silu, gate, up), which on XLA:CPU
    turned the MLP's backward into slow transposing copies (benchmarks/bench_swiglu.py).
    """
    return gate * jax.nn.sigmoid(gate) * up


def _swiglu_fwd(gate, up):
    return swiglu(gate, up), (gate, up)


def _swiglu_bwd(res, d):
    gate, up = res
    s = jax.nn.sigmoid(gate)
    # d/dg [g s(g)] = s (1 + g (1 - s)); d/du = silu(g)
    return d * up * s * (1 + gate * (1 - s)), d * gate * s


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


@jax.custom_vjp
def tied_logits(hidden: jax.Array, embed: jax.Array) -> jax.Array:
    """Logits of a tied LM head: hidden [..., E] x embed [V, E] -> [..., V] (hidden's dtype).

    Same values as ``einsum("...e,ve->...v")``; the custom VJP computes the embedding's
    gradient as (h^T dy)^T, a [E, N] x [N, V] product and one [E, V] transpose, where XLA:CPU's
    own transposition of the einsum copied the [N, V] cotangent and ran the [V, N] x [N, E]
    product at about half the rate. SmolLM2-135M on XLA:CPU: one update micro-batch 5.31 vs
    5.83 s (median of 6 alternated pairs), the whole 16-micro-batch update ~1% (within noise).
    """
    return jnp.einsum("...e,ve->...v", hidden, embed)


def _tied_logits_fwd(hidden, embed):
    return tied_logits(hidden, embed), (hidden, embed)


def _tied_logits_bwd(res, dy):
    hidden, embed = res
    d_hidden = jnp.einsum("...v,ve->...e", dy, embed)
    h2, dy2 = hidden.reshape(-1, hidden.shape[-1]), dy.reshape(-1, dy.shape[-1])
    d_embed = jnp.matmul(h2.T, dy2).T  # [E, V] -> [V, E]
    return d_hidden.astype(hidden.dtype), d_embed.astype(embed.dtype)


tied_logits.defvjp(_tied_logits_fwd, _tied_logits_bwd)


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


def _forward_mask(impl: str, key_mask, q_slot, cache, T: int, segment_ids):
    """The attention mask of a forward pass over T tokens written at ``q_slot`` [1, T]:
    key padding ``key_mask`` [B, A] AND causal (AND the same segment for packed rows): a dense
    [B, T, A] array for the einsum path, else a `Mask` (never [B, T, A]; static when the write
    index must be 0). Raises ValueError for segment ids with a cache."""
    if segment_ids is not None and cache is not None:
        raise ValueError("segment_ids (packed rows) take no cache")
    A = key_mask.shape[1]
    if impl == "einsum":
        mask = key_mask[:, None, :] & (jnp.arange(A)[None, None, :] <= q_slot[:, :, None])
        if segment_ids is not None:
            mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
        return mask
    q_start = None if cache is None else _q_start(cache, T, A)
    return Mask(key_mask, q_start=q_start, segment_ids=segment_ids)


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


@flax.struct.dataclass
class DecodeCache:
    """KV cache in the layout the decode attention reads (the sampler's cache).

    k, v: tuples of L per-layer arrays [B, KVH, S, D] (config.dtype). One buffer per layer, so
    a decode step's attention einsum ("bksd") reads a layer's keys in place: on XLA:CPU a slice
    of a stacked [L, ...] cache (the layer scan's) is materialised as a copy before every dot.
    key_mask [B, S] bool and index [] int32 as in KVCache, or index [B] int32: each row's own
    next slot (the continuous-batching sampler, whose rows are at different steps; one token
    per call, written by a scatter of B entries per layer).
    """

    k: tuple
    v: tuple
    key_mask: jax.Array
    index: jax.Array

    def grow(self, slots: int):
        """The cache with ``slots`` slots: empty (zero, masked) slots appended at the end, one
        copy of the cache (a no-op when it already has that many). Raises ValueError when
        ``slots`` is fewer than it holds."""
        S = self.key_mask.shape[1]
        if slots < S:
            raise ValueError(f"DecodeCache.grow: {slots} slots < the {S} it holds")
        if slots == S:
            return self
        pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, slots - S), (0, 0)))
        return self.replace(
            k=tuple(map(pad, self.k)),
            v=tuple(map(pad, self.v)),
            key_mask=jnp.pad(self.key_mask, ((0, 0), (0, slots - S))),
        )

    def map_rows(self, fn):
        """The cache with ``fn`` applied to the row axis of every per-row array: fn(x) of the
        k/v layer arrays and of key_mask (axis 0 of each), and of a per-row index."""
        index = fn(self.index) if jnp.ndim(self.index) == 1 else self.index
        return self.replace(
            k=tuple(fn(x) for x in self.k),
            v=tuple(fn(x) for x in self.v),
            key_mask=fn(self.key_mask),
            index=index,
        )

    @staticmethod
    def prefill_slots(prompt_len: int, slots: int) -> int:
        """Slots of the prefill's cache when decoding starts with ``slots`` slots: all of them
        (the prefill writes the prompt into the decode cache itself)."""
        del prompt_len
        return slots

    @classmethod
    def from_prefill(
        cls, prompt_cache: DecodeCache, rows: int, slots: int, page_size: int | None = None
    ) -> DecodeCache:
        """The decode cache of ``rows`` rows from the prefill's cache of one row per group of
        G = rows / P identical prompts (``prompt_cache``: P rows, ``slots`` slots): each group's
        row copied to its G rows (G copies of the prompt's keys and values). ``page_size``:
        the paged layout's (unused)."""
        del page_size
        G = rows // prompt_cache.key_mask.shape[0]
        if prompt_cache.key_mask.shape[1] != slots:
            raise ValueError(f"prefill cache of {prompt_cache.key_mask.shape[1]} != {slots} slots")
        return prompt_cache.map_rows(lambda x: jnp.repeat(x, G, axis=0)) if G > 1 else prompt_cache


@flax.struct.dataclass
class PrefixDecodeCache:
    """The decode cache with each group's prompt stored once (the sampler's
    ``decode_cache="prefix_shared"`` layout).

    prefix_k, prefix_v: tuples of L per-layer arrays [P, KVH, Lp, D], the prompt's keys and
    values of each group of G = R / P rows (left-padded as the prompts); prefix_mask [P, Lp]
    bool, True on real prompt tokens. k, v: tuples of L per-layer arrays [R, KVH, C, D], each
    row's own completion keys and values, completion token i in slot i (left-aligned: the
    filled slots are [0, index) for every row). index [] int32: the next completion slot.

    A decode step of row r reads its group's prompt block (once for the G rows: one product
    per group, `attention.decode_attention_prefix`) and the C completion slots it holds; the
    sampler grows C between decode chunks to what the chunk's last step needs, as the dense
    cache's slots. Every token fed is a real key (the static sampler's rows); a row's finished
    tail is attended as in the dense cache (its outputs are masked by the sampler).
    """

    prefix_k: tuple
    prefix_v: tuple
    prefix_mask: jax.Array
    k: tuple
    v: tuple
    index: jax.Array

    @staticmethod
    def prefill_slots(prompt_len: int, slots: int) -> int:
        """Slots of the prefill's cache: the prompt's only (the completion cache is separate)."""
        del slots
        return prompt_len

    @classmethod
    def from_prefill(
        cls, prompt_cache: DecodeCache, rows: int, slots: int, page_size: int | None = None
    ) -> PrefixDecodeCache:
        """The cache of ``rows`` rows attending to ``slots`` slots in all (prompt + completion)
        from the prefill's `DecodeCache` of one row per group (P rows, Lp slots, index Lp): its
        keys and values become the prompt block as they are (no copy per row), and an empty
        completion cache of ``slots - Lp`` slots per row is made. ``page_size``: the paged
        layout's (unused)."""
        del page_size
        P, Lp = prompt_cache.key_mask.shape
        if slots < Lp:
            raise ValueError(f"PrefixDecodeCache: {slots} slots < the prompt's {Lp}")
        _, K, _, D = prompt_cache.k[0].shape
        empty = lambda x: jnp.zeros((rows, K, slots - Lp, D), x.dtype)
        return cls(
            prefix_k=prompt_cache.k,
            prefix_v=prompt_cache.v,
            prefix_mask=prompt_cache.key_mask,
            k=tuple(map(empty, prompt_cache.k)),
            v=tuple(map(empty, prompt_cache.v)),
            index=jnp.zeros((), jnp.int32),
        )

    def grow(self, slots: int) -> PrefixDecodeCache:
        """The cache attending to ``slots`` slots in all: its completion cache padded with empty
        slots to ``slots - Lp`` (one copy of the completion cache; none when it has as many).
        Raises ValueError when that is fewer than it holds."""
        C, want = self.k[0].shape[2], slots - self.prefix_mask.shape[1]
        if want < C:
            raise ValueError(f"PrefixDecodeCache.grow: {want} completion slots < the {C} it holds")
        if want == C:
            return self
        pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, want - C), (0, 0)))
        return self.replace(k=tuple(map(pad, self.k)), v=tuple(map(pad, self.v)))


# the sampler's decode cache layouts (`sampling.SamplingConfig.decode_cache`)
DECODE_CACHES = {
    "dense": DecodeCache,
    "prefix_shared": PrefixDecodeCache,
    "paged": PagedDecodeCache,
}


def init_decode_cache(config: ModelConfig, batch_size: int, max_len: int, dtype=None):
    """Empty DecodeCache for `batch_size` rows and `max_len` slots (dtype: config.dtype)."""
    dtype = jnp.dtype(dtype or config.dtype)
    shape = (batch_size, config.num_kv_heads, max_len, config.head_dim)
    L = config.num_layers
    return DecodeCache(
        k=tuple(jnp.zeros(shape, dtype) for _ in range(L)),
        v=tuple(jnp.zeros(shape, dtype) for _ in range(L)),
        key_mask=jnp.zeros((batch_size, max_len), bool),
        index=jnp.zeros((), jnp.int32),
    )


def unstack_layers(model) -> tuple:
    """The per-layer parameter states of a Transformer's stacked layers: a tuple of L
    nnx.State (each leaf [...] = the stacked leaf's slice l). Made once before a decode loop
    and passed as ``layer_params``, so the loop reads each layer's weights in place instead of
    slicing the stacked ones every step (one extra copy of the layer weights while it lives)."""
    _, state = nnx.split(model.model.layers)
    return tuple(jax.tree.map(lambda a, l=l: a[l], state) for l in range(model.config.num_layers))


def init_cache(config: ModelConfig, batch_size: int, max_len: int, dtype=None) -> KVCache:
    """Empty KVCache for `batch_size` rows and `max_len` slots (dtype defaults to config.dtype)."""
    dtype = jnp.dtype(dtype or config.dtype)
    shape = (config.num_layers, batch_size, max_len, config.num_kv_heads, config.head_dim)
    return KVCache(
        k=jnp.zeros(shape, dtype),
        v=jnp.zeros(shape, dtype),
        key_mask=jnp.zeros((batch_size, max_len), bool),
        index=jnp.zeros((), jnp.int32),
    )


class LoRAAdapter(nnx.Module):
    """A stacked low-rank adapter: ``x -> scale * (x A) B`` (Hu et al. 2021, "LoRA").

    The `nnx.LoRA` layer of Flax, with the parameters stacked over layers and any number of
    input/output dims (the projections here are einsums over [E] -> [H, D] etc.): ``lora_a``
    [L, *in_shape, r] (He-uniform over the fan-in, as ``nnx.LoRA``), ``lora_b`` [L, r,
    *out_shape] (zeros, so a fresh adapter leaves the model unchanged). Both are
    ``nnx.LoRAParam`` with logical axes (None, *in_axes, None) / (None, None, *out_axes).
    """

    def __init__(self, in_shape, in_axes, out_shape, out_axes, *, config, rngs, num_layers):
        r = config.lora_rank
        self.scale = float(config.lora_scale)
        self.n_in = len(in_shape)
        n = len(in_shape)
        a_shape, a_axes = _stack(num_layers, (*in_shape, r), (*in_axes, None))
        b_shape, b_axes = _stack(num_layers, (r, *out_shape), (None, *out_axes))
        off = 0 if num_layers is None else 1
        a_init = jax.nn.initializers.variance_scaling(
            2.0,
            "fan_in",
            "uniform",
            in_axis=tuple(range(off, off + n)),
            out_axis=-1,
            batch_axis=tuple(range(off)),
        )
        b_init = nnx.initializers.zeros_init()
        dt = jnp.dtype(config.param_dtype)
        self.lora_a = nnx.LoRAParam(
            nnx.with_partitioning(a_init, a_axes, eager_sharding=False)(rngs.params(), a_shape, dt)
        )
        self.lora_b = nnx.LoRAParam(
            nnx.with_partitioning(b_init, b_axes, eager_sharding=False)(rngs.params(), b_shape, dt)
        )

    def __call__(self, x):
        """x [..., *in_shape] -> [..., *out_shape] in x.dtype."""
        dt = x.dtype
        n = self.n_in
        h = jnp.tensordot(
            x, self.lora_a[...].astype(dt), axes=(tuple(range(x.ndim - n, x.ndim)), tuple(range(n)))
        )
        return jnp.tensordot(h, self.lora_b[...].astype(dt), axes=1) * jnp.asarray(self.scale, dt)


def _lora(config, target, in_shape, in_axes, out_shape, out_axes, rngs, num_layers):
    """The adapter of projection ``target`` (None when it has none: the plain model)."""
    if not config.lora_on(target):
        return None
    return LoRAAdapter(
        in_shape, in_axes, out_shape, out_axes, config=config, rngs=rngs, num_layers=num_layers
    )


def _plus_lora(y, adapter, x):
    """y + adapter(x), or y itself without an adapter (the plain model's program)."""
    return y if adapter is None else y + adapter(x)


class Attention(nnx.Module):
    """GQA self-attention; Params stacked over `num_layers` when given (see module doc)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, num_layers: int | None = None):
        c = config
        self.config = c
        w = nnx.initializers.normal(0.02)
        pd = c.param_dtype
        E, H, K, D = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = _param(
            rngs, w, *_stack(num_layers, (E, H, D), ("embed", "heads", "head_dim")), pd
        )
        self.k_proj = _param(
            rngs, w, *_stack(num_layers, (E, K, D), ("embed", "kv_heads", "head_dim")), pd
        )
        self.v_proj = _param(
            rngs, w, *_stack(num_layers, (E, K, D), ("embed", "kv_heads", "head_dim")), pd
        )
        self.o_proj = _param(
            rngs, w, *_stack(num_layers, (H, D, E), ("heads", "head_dim", "embed")), pd
        )
        if c.qkv_bias:
            z = nnx.initializers.zeros_init()
            self.q_bias = _param(rngs, z, *_stack(num_layers, (H, D), ("heads", "head_dim")), pd)
            self.k_bias = _param(rngs, z, *_stack(num_layers, (K, D), ("kv_heads", "head_dim")), pd)
            self.v_bias = _param(rngs, z, *_stack(num_layers, (K, D), ("kv_heads", "head_dim")), pd)
        if c.qk_norm:
            o = nnx.initializers.ones_init()
            self.q_norm = _param(rngs, o, *_stack(num_layers, (D,), ("norm",)), pd)
            self.k_norm = _param(rngs, o, *_stack(num_layers, (D,), ("norm",)), pd)

    def add_lora(self, rngs: nnx.Rngs, num_layers: int | None = None):
        """Attaches the adapters of ``config.lora_targets`` among q/k/v/o (`Transformer`
        calls it after every base Param is drawn, so the base's initialisation is unchanged)."""
        c = self.config
        E, H, K, D = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        ed, hd = ((E,), ("embed",)), ((H, D), ("heads", "head_dim"))
        kd = ((K, D), ("kv_heads", "head_dim"))
        for name, io in (("q", (ed, hd)), ("k", (ed, kd)), ("v", (ed, kd)), ("o", (hd, ed))):
            adapter = _lora(c, name, *io[0], *io[1], rngs, num_layers)
            if adapter is not None:
                setattr(self, f"{name}_lora", adapter)

    def shared_prefix(self, xp, pos_p, mask_pp, xc, pos_c, mask_cp, mask_cc):
        """Attention of a shared-prompt batch (see `Decoder.shared_prefix`).

        xp [P, Lp, E] prompt stream, xc [P * G, Lc, E] completion stream (rows g*G..g*G+G-1
        continue prompt g); pos_* their rotary positions; mask_pp [P, Lp, Lp], mask_cp
        [P, Lp] (prompt key padding, seen by every completion query of the group), mask_cc
        [P * G, Lc, Lc] bool (the einsum core), or mask_pp / mask_cc as `attention.Mask`s
        (key padding + causal; the other cores). Returns (out_p [P, Lp, E], out_c [P * G, Lc,
        E]); equal to `__call__` on the concatenated rows up to float rounding, with the
        prompt's projections and keys/values computed once per group instead of G times.
        """
        c = self.config
        dt = xp.dtype
        P, Lp, E = xp.shape
        R, Lc, _ = xc.shape
        G = R // P
        K, H, D = c.num_kv_heads, c.num_heads, c.head_dim
        # one projection matmul over the prompt and completion tokens together
        x = jnp.concatenate([xp.reshape(P * Lp, E), xc.reshape(R * Lc, E)])[None]
        pos = jnp.concatenate([pos_p.reshape(-1), pos_c.reshape(-1)])[None]
        q, k, v = self._qkv(x, pos)
        split = lambda a: (
            a[0, : P * Lp].reshape(P, Lp, *a.shape[2:]),
            a[0, P * Lp :].reshape(R, Lc, *a.shape[2:]),
        )
        (qp, qc), (kp, kc), (vp, vc) = split(q), split(k), split(v)

        impl = attention_impl(c)
        if isinstance(mask_pp, Mask):  # a fused / blockwise core: no [Lc, Lp + Lc] scores
            out_p = attention.attend(qp, kp, vp, mask_pp, impl)
            out_c = attention.attend_shared_prefix(
                qc, kp, vp, mask_cp, kc, vc, mask_cc.key_mask, impl
            )
            return self._output(out_p, out_c, P, Lp, R, Lc)

        def core(qp, qc, kp, kc, vp, vc):  # softmax(q k^T) v of both streams
            scale = D**-0.5
            # prompt queries: causal self-attention within the prompt
            out_p = self._attend_core(qp, kp, vp, mask_pp)
            # completion queries: the group's prompt keys (read once per group) + own completion
            qg = qc.reshape(P, G, Lc, K, H // K, D)
            s_cp = jnp.einsum("pntkgd,pskd->pnkgts", qg, kp, preferred_element_type=jnp.float32)
            s_cp = jnp.where(mask_cp[:, None, None, None, None, :], s_cp * scale, _NEG_INF)
            s_cc = jnp.einsum(
                "pntkgd,pnskd->pnkgts",
                qg,
                kc.reshape(P, G, Lc, K, D),
                preferred_element_type=jnp.float32,
            )
            s_cc = jnp.where(mask_cc.reshape(P, G, 1, 1, Lc, Lc), s_cc * scale, _NEG_INF)
            probs = jax.nn.softmax(jnp.concatenate([s_cp, s_cc], axis=-1), axis=-1).astype(dt)
            out_c = jnp.einsum("pnkgts,pskd->pntkgd", probs[..., :Lp], vp) + jnp.einsum(
                "pnkgts,pnskd->pntkgd", probs[..., Lp:], vc.reshape(P, G, Lc, K, D)
            )
            return out_p, out_c

        out_p, out_c = self._recompute(core)(qp, qc, kp, kc, vp, vc)
        return self._output(out_p, out_c, P, Lp, R, Lc)

    def _output(self, out_p, out_c, P, Lp, R, Lc):
        """The output projection of both streams in one matmul: out_p [P, Lp, H, D] (or any
        shape with P * Lp rows), out_c [R, Lc, H, D] -> ([P, Lp, E], [R, Lc, E])."""
        H, D = self.config.num_heads, self.config.head_dim
        dt = out_p.dtype
        out = jnp.concatenate([out_p.reshape(P * Lp, H, D), out_c.reshape(R * Lc, H, D)])
        out = _plus_lora(
            jnp.einsum("thd,hde->te", out, self.o_proj[...].astype(dt)),
            getattr(self, "o_lora", None),
            out,
        )
        E = out.shape[-1]
        return out[: P * Lp].reshape(P, Lp, E), out[P * Lp :].reshape(R, Lc, E)

    def _qkv(self, x, positions):
        """x [B, T, E] -> rotated q [B, T, H, D], k, v [B, T, KVH, D]."""
        c = self.config
        dt = x.dtype
        q = _plus_lora(
            jnp.einsum("bte,ehd->bthd", x, self.q_proj[...].astype(dt)),
            getattr(self, "q_lora", None),
            x,
        )
        k = _plus_lora(
            jnp.einsum("bte,ehd->bthd", x, self.k_proj[...].astype(dt)),
            getattr(self, "k_lora", None),
            x,
        )
        v = _plus_lora(
            jnp.einsum("bte,ehd->bthd", x, self.v_proj[...].astype(dt)),
            getattr(self, "v_lora", None),
            x,
        )
        if c.qkv_bias:
            q = q + self.q_bias[...].astype(dt)
            k = k + self.k_bias[...].astype(dt)
            v = v + self.v_bias[...].astype(dt)
        if c.qk_norm:
            q = rms_norm(q, self.q_norm[...], c.rms_norm_eps)
            k = rms_norm(k, self.k_norm[...], c.rms_norm_eps)
        return apply_rope(q, positions, c.rope_theta), apply_rope(k, positions, c.rope_theta), v

    def _attend(self, q, keys, values, mask, kv_layout="bskd"):
        """q [B, T, H, D], keys/values [B, S, KVH, D] (kv_layout "bskd") or [B, KVH, S, D]
        ("bksd", DecodeCache), mask [B, T, S] bool (the einsum core; float32 additive bias for
        "bksd" with T = 1) or an `attention.Mask` (the blockwise / fused cores, which carry
        their own VJP and store no probabilities) -> [B, T, H, D]. kv_layout "prefix" (a
        `PrefixDecodeCache`, T = 1): keys/values are (prompt block, completion cache) pairs
        and mask the pair of float32 biases of `attention.decode_attention_prefix`. kv_layout
        "paged" (a `PagedDecodeCache`, T = 1): keys/values a layer's pages, mask the
        (prefix_len, own_len, shared_pages, live) of `attention.paged_decode_xla`."""
        if kv_layout == "paged":
            kernel = attention.PAGED_DECODE_KERNELS[
                attention.paged_kernel(attention_impl(self.config))
            ]
            return kernel(q, keys, values, *mask)
        if kv_layout == "prefix":  # a PrefixDecodeCache: (prompt block, completion cache)
            return attention.decode_attention_prefix(
                q, keys[0], values[0], mask[0], keys[1], values[1], mask[1]
            )
        if isinstance(mask, Mask):
            return attention.attend(q, keys, values, mask, attention_impl(self.config), kv_layout)
        dt = q.dtype
        B, T, H, D = q.shape
        K = self.config.num_kv_heads
        if kv_layout == "bksd" and T == 1:
            # one decode token: a rank-4 einsum and an additive mask (mask is then the float32
            # bias [B, 1, S], 0 or _NEG_INF, made once per step); on XLA:CPU the rank-5 form
            # with the unit T axis and a per-layer select run ~3x slower
            qg = q.reshape(B, K, H // K, D)
            scores = jnp.einsum(
                "bkgd,bksd->bkgs", qg, keys.astype(dt), preferred_element_type=jnp.float32
            )
            probs = jax.nn.softmax(scores * (D**-0.5) + mask[:, None], axis=-1).astype(dt)
            out = jnp.einsum("bkgs,bksd->bkgd", probs, values.astype(dt))
            return out.reshape(B, T, H, D)
        return self._recompute(self._attend_core, static_argnums=(4,))(
            q, keys, values, mask, kv_layout
        )

    def _recompute(self, fn, static_argnums=()):
        """``recompute_in_backward(fn)``, or ``fn`` as is under ``model.remat`` (the whole layer
        is recomputed in the backward pass already)."""
        if self.config.remat:
            return fn
        return recompute_in_backward(fn, static_argnums=static_argnums)

    def _attend_core(self, q, keys, values, mask, kv_layout="bskd"):
        """`_attend` for T query tokens (no decode special case): the grouped einsums
        (`attention.einsum_attention`)."""
        return attention.einsum_attention(q, keys, values, mask, kv_layout)

    def __call__(self, x, positions, mask, kv_write, kv_read, kv_layout="bskd"):
        """x [B, T, E]; positions [B, T]; mask [B, T, S] bool (query may attend key);
        kv_write(k, v) stores this step's keys/values [B, T, KVH, D] and kv_read() returns the
        keys/values to attend to, [B, S, KVH, D] (kv_layout "bskd") or [B, KVH, S, D] ("bksd",
        a DecodeCache layer). Returns [B, T, E]."""
        q, k, v = self._qkv(x, positions)
        kv_write(k, v)
        keys, values = kv_read()
        out = self._attend(q, keys, values, mask, kv_layout)
        y = jnp.einsum("bthd,hde->bte", out, self.o_proj[...].astype(x.dtype))
        return _plus_lora(y, getattr(self, "o_lora", None), out)


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, num_layers: int | None = None):
        E, F = config.hidden_size, config.intermediate_size
        w = nnx.initializers.normal(0.02)
        pd = config.param_dtype
        self.gate_proj = _param(rngs, w, *_stack(num_layers, (E, F), ("embed", "mlp")), pd)
        self.up_proj = _param(rngs, w, *_stack(num_layers, (E, F), ("embed", "mlp")), pd)
        self.down_proj = _param(rngs, w, *_stack(num_layers, (F, E), ("mlp", "embed")), pd)
        self.config = config

    def add_lora(self, rngs: nnx.Rngs, num_layers: int | None = None):
        """Attaches the adapters of ``config.lora_targets`` among gate/up/down."""
        c = self.config
        ed, fd = ((c.hidden_size,), ("embed",)), ((c.intermediate_size,), ("mlp",))
        for name, io in (("gate", (ed, fd)), ("up", (ed, fd)), ("down", (fd, ed))):
            adapter = _lora(c, name, *io[0], *io[1], rngs, num_layers)
            if adapter is not None:
                setattr(self, f"{name}_lora", adapter)

    def __call__(self, x):
        dt = x.dtype
        g = _plus_lora(x @ self.gate_proj[...].astype(dt), getattr(self, "gate_lora", None), x)
        u = _plus_lora(x @ self.up_proj[...].astype(dt), getattr(self, "up_lora", None), x)
        h = swiglu(g, u)
        return _plus_lora(h @ self.down_proj[...].astype(dt), getattr(self, "down_lora", None), h)


class Block(nnx.Module):
    """One pre-norm decoder layer (Params stacked over `num_layers` when given)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, num_layers: int | None = None):
        E = config.hidden_size
        o = nnx.initializers.ones_init()
        self.config = config
        self.attn_norm = _param(rngs, o, *_stack(num_layers, (E,), ("norm",)), config.param_dtype)
        self.attn = Attention(config, rngs=rngs, num_layers=num_layers)
        self.mlp_norm = _param(rngs, o, *_stack(num_layers, (E,), ("norm",)), config.param_dtype)
        self.mlp = MLP(config, rngs=rngs, num_layers=num_layers)

    def __call__(self, x, positions, mask, kv_write, kv_read, kv_layout="bskd"):
        eps = self.config.rms_norm_eps
        h = rms_norm(x, self.attn_norm[...], eps)
        x = x + self.attn(h, positions, mask, kv_write, kv_read, kv_layout)
        return x + self.mlp(rms_norm(x, self.mlp_norm[...], eps))

    def shared_prefix(self, xp, pos_p, mask_pp, xc, pos_c, mask_cp, mask_cc):
        """`__call__` for a shared-prompt batch: (xp [P, Lp, E], xc [P * G, Lc, E]) -> same."""
        eps = self.config.rms_norm_eps
        ap, ac = self.attn.shared_prefix(
            rms_norm(xp, self.attn_norm[...], eps),
            pos_p,
            mask_pp,
            rms_norm(xc, self.attn_norm[...], eps),
            pos_c,
            mask_cp,
            mask_cc,
        )
        xp, xc = xp + ap, xc + ac
        # one MLP matmul chain over all tokens of both streams
        P, Lp, E = xp.shape
        x = jnp.concatenate([xp.reshape(-1, E), xc.reshape(-1, E)])
        x = x + self.mlp(rms_norm(x, self.mlp_norm[...], eps))
        return x[: P * Lp].reshape(xp.shape), x[P * Lp :].reshape(xc.shape)


def _layer_block(graphdef, layer_params, l: int):
    """Layer ``l``'s Block from `unstack_layers`' tuple (read in place) or the stacked State
    (sliced here)."""
    state_l = (
        layer_params[l]
        if isinstance(layer_params, (tuple, list))
        else jax.tree.map(lambda a: a[l], layer_params)
    )
    return nnx.merge(graphdef, state_l)


class Decoder(nnx.Module):
    """Embedding + stacked layers + final norm (the trunk shared by Transformer and CriticModel)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.embed = _param(
            rngs,
            nnx.initializers.normal(0.02),
            (config.vocab_size, config.hidden_size),
            ("vocab", "embed"),
            config.param_dtype,
        )
        self.layers = Block(config, rngs=rngs, num_layers=config.num_layers)
        self.final_norm = _param(
            rngs, nnx.initializers.ones_init(), (config.hidden_size,), ("norm",), config.param_dtype
        )

    def __call__(
        self,
        tokens,
        positions,
        attention_mask=None,
        *,
        cache: KVCache | DecodeCache | PrefixDecodeCache | PagedDecodeCache | None = None,
        attend_len: int | None = None,
        layer_params: tuple | None = None,
        segment_ids=None,
    ):
        """Returns (hidden [B, T, E] after the final norm in config.dtype, new_cache or None).

        attend_len (static, with a cache): attend to slots [0, attend_len) only, read in place
        from the cache (the caller guarantees cache.index + T <= attend_len); None = all slots.
        layer_params (DecodeCache only): `unstack_layers` of this model, None = slice here.
        segment_ids [B, T] int32 (no cache): packed rows (`grpo_jax.packing`), a token attends
        to earlier tokens of its own segment only; positions then restart per segment.
        """
        c = self.config
        dt = jnp.dtype(c.dtype)
        B, T = tokens.shape
        if attention_mask is None:
            attention_mask = jnp.ones((B, T), bool)
        attention_mask = attention_mask.astype(bool)
        x = jnp.take(self.embed[...], tokens, axis=0).astype(dt)

        graphdef, layer_state = nnx.split(self.layers)
        if isinstance(cache, DecodeCache | PrefixDecodeCache | PagedDecodeCache):
            layers = layer_state if layer_params is None else layer_params
            return self._decode(graphdef, layers, x, positions, attention_mask, cache, attend_len)
        if cache is None:
            key_mask = attention_mask
            q_slot = jnp.arange(T)[None]
            S = T
        else:
            if jnp.ndim(cache.index) == 1:
                raise ValueError("a per-row cache index takes a DecodeCache and one token per row")
            S = cache.key_mask.shape[1]
            key_mask = jax.lax.dynamic_update_slice(
                cache.key_mask, attention_mask, (0, cache.index)
            )
            q_slot = (cache.index + jnp.arange(T))[None]  # [1, T]
        A = S if attend_len is None else min(int(attend_len), S)  # slots attended
        mask = _forward_mask(attention_impl(c), key_mask[:, :A], q_slot, cache, T, segment_ids)

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
                    fresh["k"] = jax.lax.dynamic_update_slice(
                        ck, k[None].astype(ck.dtype), (l, 0, cache.index, 0, 0)
                    )
                    fresh["v"] = jax.lax.dynamic_update_slice(
                        cv, v[None].astype(cv.dtype), (l, 0, cache.index, 0, 0)
                    )

                def kv_read():
                    size = (1, ck.shape[1], A, *ck.shape[3:])
                    return tuple(
                        jax.lax.dynamic_slice(fresh[n], (l, 0, 0, 0, 0), size)[0]
                        for n in ("k", "v")
                    )

            h = sharding.constrain_batch(h)  # rows over data x fsdp (a no-op without a mesh)
            h = block(h, positions, mask, kv_write, kv_read)
            if cache is not None:
                ck, cv = fresh["k"], fresh["v"]
            return (h, ck, cv), None

        if c.remat:
            body = jax.checkpoint(body)
        ck0 = cache.k if cache is not None else jnp.zeros((), dt)
        cv0 = cache.v if cache is not None else jnp.zeros((), dt)
        (x, ck, cv), _ = jax.lax.scan(
            body, (x, ck0, cv0), (layer_state, jnp.arange(c.num_layers, dtype=jnp.int32))
        )
        x = rms_norm(x, self.final_norm[...], c.rms_norm_eps)
        new_cache = None
        if cache is not None:
            new_cache = cache.replace(k=ck, v=cv, key_mask=key_mask, index=cache.index + T)
        return x, new_cache

    def _decode(self, graphdef, layer_params, x, positions, attention_mask, cache, attend_len):
        """The layers over a DecodeCache: x [B, T, E] -> (hidden [B, T, E], new DecodeCache).

        An unrolled loop over the layers (``layer_params``: one nnx.State per layer, from
        `unstack_layers`, or the stacked State, sliced here). Each layer writes its T new keys
        and values into its own cache buffer in place (a dynamic_update_slice at the shared
        index, or, per-row index [B] with T = 1, a scatter of B entries) and then attends to
        the buffer's first A slots: the whole buffer, read in place, when A = S (the samplers
        grow their cache instead of passing a shorter attend_len, whose slice XLA:CPU copies).
        Raises ValueError for a per-row index with T > 1. A `PrefixDecodeCache` goes to
        `_decode_prefix`.
        """
        if isinstance(cache, PrefixDecodeCache):
            return self._decode_prefix(graphdef, layer_params, x, positions, cache)
        if isinstance(cache, PagedDecodeCache):
            return self._decode_paged(graphdef, layer_params, x, positions, attention_mask, cache)
        c = self.config
        B, T = attention_mask.shape
        S = cache.key_mask.shape[1]
        A = S if attend_len is None else min(int(attend_len), S)  # slots read
        if jnp.ndim(cache.index) == 1:  # rows at different steps (continuous batching)
            if T != 1:
                raise ValueError("a per-row cache index takes a DecodeCache and one token per row")
            rows = jnp.arange(B)
            q_slot = cache.index[:, None]  # [B, 1]

            def put(buf, new):  # new [B, 1, KVH, D] -> buf[b, :, index[b], :]
                return buf.at[rows, :, cache.index, :].set(new[:, 0].astype(buf.dtype))

            key_mask = cache.key_mask.at[rows, cache.index].set(attention_mask[:, 0])
        else:
            q_slot = (cache.index + jnp.arange(T))[None]  # [1, T]

            def put(buf, new):  # new [B, T, KVH, D] -> slots [index, index + T)
                new = jnp.swapaxes(new, 1, 2).astype(buf.dtype)
                return jax.lax.dynamic_update_slice(buf, new, (0, 0, cache.index, 0))

            key_mask = jax.lax.dynamic_update_slice(
                cache.key_mask, attention_mask, (0, cache.index)
            )
        if T > 1 and attention_impl(c) != "einsum":  # a prefill: key padding + causal
            mask = Mask(key_mask[:, :A], q_start=_q_start(cache, T, A))
        else:
            mask = key_mask[:, None, :A] & (jnp.arange(A)[None, None, :] <= q_slot[:, :, None])
        if T == 1:  # the decode step's form (`Attention._attend`): an additive bias
            mask = jnp.where(mask, 0.0, _NEG_INF).astype(jnp.float32)

        ks, vs = list(cache.k), list(cache.v)
        for l in range(c.num_layers):
            block = _layer_block(graphdef, layer_params, l)

            def kv_write(k, v, l=l):
                ks[l], vs[l] = put(ks[l], k), put(vs[l], v)

            def kv_read(l=l):
                return (ks[l][:, :, :A], vs[l][:, :, :A]) if A < S else (ks[l], vs[l])

            x = sharding.constrain_batch(x)  # rows over data x fsdp (a no-op without a mesh)
            x = block(x, positions, mask, kv_write, kv_read, "bksd")
        x = rms_norm(x, self.final_norm[...], c.rms_norm_eps)
        new_cache = cache.replace(
            k=tuple(ks), v=tuple(vs), key_mask=key_mask, index=cache.index + T
        )
        return x, new_cache

    def _decode_prefix(self, graphdef, layer_params, x, positions, cache: PrefixDecodeCache):
        """The layers over a `PrefixDecodeCache`: one token per row, x [R, 1, E] ->
        (hidden [R, 1, E], the cache with the token's keys/values in completion slot
        ``index``). Each layer writes its row keys in place (a dynamic_update_slice at the
        shared index) and attends to its group's prompt block and the completion slots
        [0, index] (`attention.decode_attention_prefix`). Raises ValueError unless T = 1."""
        c = self.config
        if x.shape[1] != 1:
            raise ValueError(f"a PrefixDecodeCache decodes one token per row, got {x.shape[1]}")
        C = cache.k[0].shape[2]
        prefix_bias = jnp.where(cache.prefix_mask, 0.0, _NEG_INF).astype(jnp.float32)
        comp_bias = jnp.where(jnp.arange(C) <= cache.index, 0.0, _NEG_INF)[None]
        bias = (prefix_bias, comp_bias.astype(jnp.float32))

        def put(buf, new):  # new [R, 1, KVH, D] -> slot index
            new = jnp.swapaxes(new, 1, 2).astype(buf.dtype)
            return jax.lax.dynamic_update_slice(buf, new, (0, 0, cache.index, 0))

        ks, vs = list(cache.k), list(cache.v)
        for l in range(c.num_layers):
            block = _layer_block(graphdef, layer_params, l)

            def kv_write(k, v, l=l):
                ks[l], vs[l] = put(ks[l], k), put(vs[l], v)

            def kv_read(l=l):
                return (cache.prefix_k[l], ks[l]), (cache.prefix_v[l], vs[l])

            x = sharding.constrain_batch(x)  # rows over data x fsdp (a no-op without a mesh)
            x = block(x, positions, bias, kv_write, kv_read, "prefix")
        x = rms_norm(x, self.final_norm[...], c.rms_norm_eps)
        return x, cache.replace(k=tuple(ks), v=tuple(vs), index=cache.index + 1)

    def _decode_paged(
        self, graphdef, layer_params, x, positions, attention_mask, cache: PagedDecodeCache
    ):
        """The layers over a `PagedDecodeCache`: one token per row, x [R, 1, E] ->
        (hidden [R, 1, E], the cache with the token's keys/values in each row's next own slot).
        Each layer scatters its R new keys/values into its pages and attends to the row's
        filled slots (`attention.PAGED_DECODE_KERNELS`, chosen by ``model.attention_impl``:
        the Pallas TPU kernel for "splash", else XLA). attention_mask [R, 1] bool: False marks
        a row whose output is not used (a finished row: the Pallas kernel reads nothing for
        it; its token's keys/values are still written). Raises ValueError unless T = 1."""
        c = self.config
        if x.shape[1] != 1:
            raise ValueError(f"a PagedDecodeCache decodes one token per row, got {x.shape[1]}")
        meta = (cache.prefix_len, cache.own_len(), cache.shared_pages, attention_mask[:, 0])
        ks, vs = list(cache.k), list(cache.v)
        for l in range(c.num_layers):
            block = _layer_block(graphdef, layer_params, l)

            def kv_write(k, v, l=l):
                ks[l], vs[l] = cache.put(ks[l], k), cache.put(vs[l], v)

            def kv_read(l=l):
                return ks[l], vs[l]

            x = sharding.constrain_batch(x)  # rows over data x fsdp (a no-op without a mesh)
            x = block(x, positions, meta, kv_write, kv_read, "paged")
        x = rms_norm(x, self.final_norm[...], c.rms_norm_eps)
        return x, cache.replace(k=tuple(ks), v=tuple(vs), index=cache.index + 1)

    def shared_prefix(
        self, prompt_tokens, prompt_positions, prompt_mask, tokens, positions, attention_mask
    ):
        """The forward pass of G completions per prompt with the prompt computed once per group.

        A GRPO group's G rows share their prompt: every layer's prompt activations, keys and
        values are identical across the group. This pass runs the prompt stream on P rows and
        the completion stream on P * G rows, whose queries attend to their group's prompt keys
        and to their own earlier completion keys ("shared-prefix" / Prefix Grouper forward,
        Liu et al. 2025). Gradients w.r.t. the prompt stream are summed over the group by
        autodiff, so values and gradients equal `__call__` on the concatenated rows (up to float
        rounding) for about (P * Lp + R * Lc) / (R * (Lp + Lc)) of the layer FLOPs.

        Args:
          prompt_tokens [P, Lp] int32 (left-padded), prompt_positions [P, Lp] int32,
          prompt_mask [P, Lp] bool: one row per group.
          tokens [R, Lc] int32, positions [R, Lc] int32, attention_mask [R, Lc] bool: the
          completion positions of R = P * G rows; row r continues prompt r // G.
        Returns:
          (hidden_prompt [P, Lp, E], hidden [R, Lc, E]) after the final norm.
        Raises:
          ValueError: R is not a multiple of P.
        """
        c = self.config
        dt = jnp.dtype(c.dtype)
        P, Lp = prompt_tokens.shape
        R, Lc = tokens.shape
        if R % P:
            raise ValueError(f"{R} completion rows are not a multiple of {P} prompts")
        prompt_mask = prompt_mask.astype(bool)
        attention_mask = attention_mask.astype(bool)
        embed = self.embed[...]
        xp = jnp.take(embed, prompt_tokens, axis=0).astype(dt)
        xc = jnp.take(embed, tokens, axis=0).astype(dt)
        if attention_impl(c) == "einsum":
            causal_p = jnp.arange(Lp)[None, :] <= jnp.arange(Lp)[:, None]
            causal_c = jnp.arange(Lc)[None, :] <= jnp.arange(Lc)[:, None]
            mask_pp = prompt_mask[:, None, :] & causal_p[None]
            mask_cc = attention_mask[:, None, :] & causal_c[None]
        else:  # key padding + causal, never [rows, T, S]
            mask_pp, mask_cc = Mask(prompt_mask), Mask(attention_mask)
        graphdef, layer_state = nnx.split(self.layers)

        def body(carry, state_l):
            hp, hc = carry
            block = nnx.merge(graphdef, state_l)
            hp = sharding.constrain_batch(hp)
            hc = sharding.constrain_batch(hc)
            return block.shared_prefix(
                hp, prompt_positions, mask_pp, hc, positions, prompt_mask, mask_cc
            ), None

        if c.remat:
            body = jax.checkpoint(body)
        (hp, hc), _ = jax.lax.scan(body, (xp, xc), layer_state)
        return (
            rms_norm(hp, self.final_norm[...], c.rms_norm_eps),
            rms_norm(hc, self.final_norm[...], c.rms_norm_eps),
        )


class Transformer(nnx.Module):
    """Causal language model: Decoder trunk + lm_head (tied to the embedding when configured)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.model = Decoder(config, rngs=rngs)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = _param(
                rngs,
                nnx.initializers.normal(0.02),
                (config.hidden_size, config.vocab_size),
                ("embed", "vocab"),
                config.param_dtype,
            )
        if config.lora_rank:  # after every base Param: the base draws as without adapters
            self.model.layers.attn.add_lora(rngs, config.num_layers)
            self.model.layers.mlp.add_lora(rngs, config.num_layers)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [..., E] (output of the final norm) -> logits [..., V] in hidden.dtype."""
        dt = hidden.dtype
        if self.lm_head is None:
            return tied_logits(hidden, self.model.embed[...].astype(dt))
        return hidden @ self.lm_head[...].astype(dt)

    def __call__(
        self,
        tokens,
        positions,
        attention_mask=None,
        *,
        cache: KVCache | DecodeCache | None = None,
        return_hidden: bool = False,
        attend_len: int | None = None,
        layer_params: tuple | None = None,
        segment_ids=None,
    ):
        """tokens [B, T] int32; positions [B, T] int32 rotary positions (left padding: count from
        the first real token, see positions_from_mask); attention_mask [B, T] bool, True on real
        tokens (key padding mask combined with the causal mask; None = all real);
        cache: optional KVCache or DecodeCache, the tokens are written at slots
        [cache.index, cache.index + T) and attend to every earlier valid slot (or a
        PrefixDecodeCache, T = 1: the group's prompt block and the row's completion slots); attend_len
        (static, with a cache): only slots [0, attend_len) are read (>= cache.index + T);
        layer_params (with a DecodeCache): `unstack_layers(self)`, made once outside a decode
        loop so that the loop does not slice the stacked layer weights every step.
        segment_ids [B, T] int32 (no cache): packed rows (`grpo_jax.packing`): a token attends
        only to earlier tokens of its own segment (positions restart per segment).

        Returns (logits [B, T, V] in config.dtype, new_cache or None); with return_hidden=True
        the first element is the final-norm hidden state [B, T, E] instead (apply
        `self.logits` to the rows you need, e.g. the last one, to skip the [B, T, V] product).
        Fully-masked query rows (pads) get finite garbage outputs, never NaN.
        """
        h, new_cache = self.model(
            tokens,
            positions,
            attention_mask,
            cache=cache,
            attend_len=attend_len,
            layer_params=layer_params,
            segment_ids=segment_ids,
        )
        if return_hidden:
            return h, new_cache
        return self.logits(h), new_cache


def random_params(config: ModelConfig, seed: int = 0, *, stddev: float = 0.02, cls=None):
    """Host-side (numpy) random init with the same distributions as the module initialisers
    (weights N(0, stddev^2), norms 1, biases 0): `(graphdef, params)` without compiling an init
    program, which takes XLA ~1 s per threefry-normal on a CPU. For tests and benchmarks.
    cls: Transformer (default) or CriticModel."""

    cls = cls or Transformer
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0))), nnx.Param)
    rng = np.random.default_rng(seed)
    flat = []
    for path, var in nnx.to_flat_state(abstract):
        name = str(path[-1])
        if name.endswith("norm"):
            x = np.ones(var.shape)
        elif name.endswith("bias") or name == "lora_b":
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
        self.value_head = _param(
            rngs, nnx.initializers.normal(0.02), (config.hidden_size,), ("embed",), "float32"
        )
        self.value_bias = _param(rngs, nnx.initializers.zeros_init(), (), (), "float32")

    def __call__(self, tokens, positions, attention_mask=None) -> jax.Array:
        """Same inputs as Transformer.__call__ (no cache). Returns values [B, T] float32."""
        h, _ = self.model(tokens, positions, attention_mask)
        return h.astype(jnp.float32) @ self.value_head[...] + self.value_bias[...]
