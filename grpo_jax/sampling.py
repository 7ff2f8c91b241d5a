"""Jitted autoregressive sampler: one prefill pass + KV-cache decode in lax.while_loops.

`generate(graphdef, params, prompt_tokens, prompt_mask, rng, config)` -> `Rollouts`.
`generate_continuous(..., num_slots=S)` (also `generate` with ``config.decode_slots = S``):
continuous batching, S decode rows refilled with pending requests as completions end.

Shapes are static (R rows, Lp prompt slots, Lc = max_new_tokens), so a training loop with a
fixed batch compiles once. The KV cache (`DecodeCache`: one [R, kv_heads, slots, head_dim]
buffer per layer; or, with ``decode_cache="prefix_shared"``, `PrefixDecodeCache`: each group's
prompt block [R / G, kv_heads, Lp, head_dim] once and a per-row completion cache
[R, kv_heads, c, head_dim]) is carried through the loops and updated in place (dynamic_update_slice);
each layer's attention reads its whole buffer in place, in the layout its einsum consumes, and
the layer weights are unstacked once before the loops (no per-step copy, slice or transpose of
the cache or the weights: tests/test_sampling_hlo.py checks the optimized HLO). With
``decode_cache="paged"`` (`PagedDecodeCache`, pages with left-aligned prompts, each group's
full prompt pages once) each step scatters the rows' new keys/values into their pages and
attends to each row's filled slots (the Pallas TPU paged kernel, reading each group's prompt
pages once and nothing for finished rows, or an XLA path; not covered by the HLO check). The
decode steps run in up to `attention_buckets` chunks, one while_loop each; between chunks the cache
grows (one copy) to the slots the next chunk's last step needs, so a step attends to at most
16-ish more slots than it needs rather than all Lp + Lc. The prompt is processed once; there
is no host sync inside the loops, which exit as soon as every row has produced an EOS id.

Sampling distribution (per step, HF `generate` order): logits / temperature, then top-k, then
top-p (nucleus, Holtzman et al. 2020) on the renormalised top-k distribution. temperature == 0
is greedy argmax (no division). `Rollouts.logprobs` are log_softmax(logits / temperature)
of the sampled token BEFORE top-k/top-p truncation (log_softmax(logits) when temperature == 0),
i.e. what a training forward pass at the same temperature recomputes. The draw is
inverse-CDF sampling with one uniform per row (no [R, V] random bits): the same distribution
as the Gumbel-max trick, other samples for a given key.
"""

from __future__ import annotations

import dataclasses
import functools

import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax.models import attention
from grpo_jax.models.transformer import (
    DECODE_CACHES,
    init_decode_cache,
    positions_from_mask,
    unstack_layers,
)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Static sampling settings (hashable: a jit static argument).

    max_new_tokens: Lc, completion slots per row. temperature: >= 0 (0 = greedy).
    top_k: keep the k most likely tokens (0 = off). top_p: nucleus mass in [0, 1] (1 = off;
    the token that crosses the threshold is kept, so top_p = 0 keeps the argmax).
    eos_ids: token ids that end a completion (kept in it, masked after). pad_id: fill value
    after EOS and for unused slots. prompt_group_size: G > 1 when the rows come in consecutive
    groups of G identical prompts (a GRPO group): the prompt is prefilled once per group and
    its KV cache copied to the G rows (same samples up to float rounding, 1/G of the prefill).
    attention_buckets: at most this many decode chunks, each attending to a cache just long
    enough for its last step (the cache grows between chunks; 1 = every step reads all
    Lp + Lc - 1 slots).
    decode_slots: > 0 = continuous batching with this many decode rows (`generate_continuous`,
    which `generate` then calls); 0 = one static batch of all rows.
    decode_cache: the static sampler's KV-cache layout (`transformer.DECODE_CACHES`): "dense"
    (`DecodeCache`: every row holds its prompt's keys and values, G copies per group, and the
    completion after them) or "prefix_shared" (`PrefixDecodeCache`: each group's prompt block
    stored and read once for its G rows, each row's completion cache separate) or "paged"
    (`PagedDecodeCache`: pages of ``page_size`` slots, prompts left-aligned, each group's full
    prompt pages stored once, and each row attending to its filled slots only; the Pallas TPU
    paged kernel under ``model.attention_impl`` "splash", which reads the prompt pages once per
    group and skips finished rows, XLA elsewhere). Same samples up to
    float rounding (the attention output is summed from two products, or the kernel's tiles);
    static batching only (decode_slots = 0).
    page_size: slots per page of the "paged" cache (>= 1; the TPU kernel wants a multiple of 8
    and a head_dim multiple of 128).
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    eos_ids: tuple[int, ...] = ()
    pad_id: int = 0
    prompt_group_size: int = 1
    attention_buckets: int = 8
    decode_slots: int = 0
    decode_cache: str = "dense"
    page_size: int = 16

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise ValueError(
                f"SamplingConfig.max_new_tokens must be a positive int, got {self.max_new_tokens!r}"
            )
        if self.temperature < 0:
            raise ValueError(f"SamplingConfig.temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"SamplingConfig.top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"SamplingConfig.top_p must be in [0, 1], got {self.top_p}")
        if not isinstance(self.prompt_group_size, int) or self.prompt_group_size < 1:
            raise ValueError(
                f"SamplingConfig.prompt_group_size must be an int >= 1, got "
                f"{self.prompt_group_size!r}"
            )
        if not isinstance(self.attention_buckets, int) or self.attention_buckets < 1:
            raise ValueError(
                f"SamplingConfig.attention_buckets must be an int >= 1, got "
                f"{self.attention_buckets!r}"
            )
        if not isinstance(self.decode_slots, int) or self.decode_slots < 0:
            raise ValueError(
                f"SamplingConfig.decode_slots must be an int >= 0, got {self.decode_slots!r}"
            )
        if self.decode_cache not in DECODE_CACHES:
            raise ValueError(
                f"SamplingConfig.decode_cache must be one of {tuple(DECODE_CACHES)}, got "
                f"{self.decode_cache!r}"
            )
        if self.decode_cache != "dense" and self.decode_slots:
            raise ValueError(
                f"SamplingConfig.decode_cache={self.decode_cache!r} takes static batching "
                f"(decode_slots = 0), got decode_slots={self.decode_slots}"
            )
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise ValueError(
                f"SamplingConfig.page_size must be an int >= 1, got {self.page_size!r}"
            )
        object.__setattr__(self, "eos_ids", tuple(int(e) for e in self.eos_ids))


@flax.struct.dataclass
class Rollouts:
    """Sampler output (R rows, Lp prompt slots, Lc = max_new_tokens).

    tokens [R, Lp + Lc] int32: left-padded prompt + completion (pad_id after EOS).
    completion_tokens [R, Lc] int32. completion_mask [R, Lc] float32: 1 on completion tokens up
    to and including the first EOS. logprobs [R, Lc] float32: log_softmax(logits / T) of each
    sampled token (before top-k/top-p truncation), 0 where masked. lengths [R] int32: number of
    completion tokens (incl. EOS). truncated [R] bool: no EOS within max_new_tokens (or the
    row's budget). decode_utilisation [] float32: `SlotStats.utilisation` of continuous
    batching (None from the static sampler). loss_mask [R, Lc] float32: the tokens trained on
    when they are not all of ``completion_mask`` (multi-turn episodes: the policy's own tokens,
    not the tools' output, `grpo_jax.envs.episodes`); None = ``completion_mask``.
    """

    tokens: jax.Array
    completion_tokens: jax.Array
    completion_mask: jax.Array
    logprobs: jax.Array
    lengths: jax.Array
    truncated: jax.Array
    decode_utilisation: jax.Array | None = None  # [] float32, continuous batching only
    loss_mask: jax.Array | None = None  # [R, Lc] float32, multi-turn episodes only


_BLOCK = 256  # vocabulary block of the two-level inverse-CDF draw


def _last_positive(x: jax.Array) -> jax.Array:
    """x [R, N] >= 0 -> [R] int32, the last index with x > 0 (0 when none)."""
    n = x.shape[-1]
    return (n - 1 - jnp.argmax(x[:, ::-1] > 0, axis=-1)).astype(jnp.int32)


def _inverse_cdf(weights: jax.Array, u: jax.Array) -> jax.Array:
    """One draw per row from unnormalised weights [R, N] >= 0 (float32) with one uniform
    u [R] in [0, 1): the first index whose inclusive cumulative weight exceeds u x total.

    Two levels (blocks of _BLOCK, then within the chosen block), so only [R, N / _BLOCK] and
    [R, _BLOCK] cumulative sums are formed. Float rounding at the top end is clipped to the
    last positive weight, so a zero-weight index is never drawn. Returns [R] int32.
    """
    R, N = weights.shape
    nb = -(-N // _BLOCK)
    w = jnp.pad(weights, ((0, 0), (0, nb * _BLOCK - N))).reshape(R, nb, _BLOCK)
    block_mass = jnp.sum(w, axis=-1)  # [R, nb]
    block_cum = jnp.cumsum(block_mass, axis=-1)
    t = u * block_cum[:, -1]
    b = jnp.minimum(jnp.sum(block_cum <= t[:, None], axis=-1), _last_positive(block_mass))
    b = b.astype(jnp.int32)
    inner = jnp.take_along_axis(w, b[:, None, None], axis=1)[:, 0]  # [R, _BLOCK]
    before = jnp.take_along_axis(block_cum - block_mass, b[:, None], axis=-1)[:, 0]
    inner_cum = jnp.cumsum(inner, axis=-1)
    j = jnp.sum(inner_cum <= (t - before)[:, None], axis=-1)
    j = jnp.minimum(j, _last_positive(inner)).astype(jnp.int32)
    return b * _BLOCK + j


def sample_logits(logits: jax.Array, key: jax.Array, config: SamplingConfig):
    """One sampling step: logits [R, V] -> (token [R] int32, logprob [R] float32).

    Temperature, then top-k, then top-p (see the module docstring); logprob is
    log_softmax(logits / temperature)[token] before truncation (temperature 0: greedy argmax
    and log_softmax(logits)). The draw is inverse-CDF sampling with one uniform per row over
    the (truncated) probabilities, so no [R, V] random bits are generated. jittable; config
    static.
    """
    logits = logits.astype(jnp.float32)
    R, V = logits.shape
    if config.temperature == 0:
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        lse = jax.nn.logsumexp(logits, axis=-1)
        return tok, jnp.take_along_axis(logits, tok[:, None], axis=-1)[:, 0] - lse
    scaled = logits / config.temperature
    top = jnp.max(scaled, axis=-1, keepdims=True)
    lse = jnp.log(jnp.sum(jnp.exp(scaled - top), axis=-1)) + top[:, 0]
    u = jax.random.uniform(key, (R,), jnp.float32)
    k = config.top_k if 0 < config.top_k < V else 0
    if k == 0 and config.top_p >= 1.0:
        tok = _inverse_cdf(jnp.exp(scaled - top), u)
    else:
        # sorted (descending) candidate set: the top-k, or the whole vocabulary for top-p only
        vals, idx = jax.lax.top_k(scaled, k if k else V)
        probs = jnp.exp(vals - vals[:, :1])  # unnormalised, descending
        cum = jnp.cumsum(probs, axis=-1)
        n_keep = jnp.full((R,), probs.shape[-1], jnp.int32)
        if config.top_p < 1.0:
            # keep the tokens whose exclusive cumulative probability is < top_p (a prefix of
            # the sorted order; the argmax always survives, so top_p == 0 is greedy)
            exclusive = (cum - probs) / cum[:, -1:]
            n_keep = jnp.maximum(jnp.sum(exclusive < config.top_p, axis=-1), 1).astype(jnp.int32)
        kept_mass = jnp.take_along_axis(cum, (n_keep - 1)[:, None], axis=-1)[:, 0]
        choice = jnp.minimum(jnp.sum(cum <= (u * kept_mass)[:, None], axis=-1), n_keep - 1)
        tok = jnp.take_along_axis(idx, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return tok, jnp.take_along_axis(scaled, tok[:, None], axis=-1)[:, 0] - lse


def decode_buckets(prompt_len: int, max_new_tokens: int, buckets: int) -> tuple[int, ...]:
    """Static attention lengths of the decode chunks: a tuple of n <= `buckets` slot counts.

    Decode step i (1 <= i < Lc) writes slot Lp + i - 1 and needs slots [0, Lp + i); the steps
    are split into n chunks of at least 16 steps each, and chunk j's steps attend to its end,
    Lp + ends[j] slots (the last one is Lp + Lc - 1, the last step's need).
    """
    steps = max_new_tokens - 1  # decode steps after the token sampled from the prefill
    n = max(1, min(int(buckets), -(-steps // 16)))
    ends = [1 + -(-(j + 1) * steps // n) for j in range(n)]  # last step index + 1 of chunk j
    return tuple(prompt_len + e - 1 for e in ends)


def kv_bytes_per_slot(config, dtype=None) -> int:
    """Bytes of one cache slot of one row over all layers, keys and values:
    2 x num_layers x num_kv_heads x head_dim x itemsize (``dtype``, default config.dtype)."""
    item = jnp.dtype(dtype or config.dtype).itemsize
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * item


def decode_read_bytes(
    *,
    param_bytes: float,
    kv_bytes_per_slot: float,
    rows: int,
    group_size: int,
    prompt_len: int,
    new_tokens: int,
    layout: str = "dense",
    buckets: int | None = 8,
    lengths=None,
    prompt_lengths=None,
    page_size: int = 16,
    compute_tokens: int | None = None,
) -> dict:
    """Analytic bytes read per decoded token by the static sampler's decode loop (the roofline
    of a memory-bound decode: time = bytes / bandwidth).

    A decode step reads every parameter once (``param_bytes``: those one device reads, e.g. the
    all-gathered model under FSDP) and the cache slots it attends to, for all ``rows``:
      "dense":         rows x (Lp + c) slots (each row's own copy of its prompt),
      "prefix_shared": rows / G x Lp prompt slots (each group's block once) + rows x c,
      "paged":         what the Pallas TPU kernel reads from a `PagedDecodeCache`
                       (`attention.paged_decode_pallas_tpu`): each group with a row still
                       decoding its n_g // P full prompt pages once, each row still decoding
                       its own n % P + i slots (prompt's partial page + completion), each
                       rounded up to the kernel's block (`attention.paged_block_pages` pages
                       of P = ``page_size`` slots: at most ``compute_tokens`` keys, default
                       `attention.PAGED_COMPUTE_TOKENS`); n the rows' prompt tokens
                       (``prompt_lengths``, None = Lp each);
                       finished rows read nothing,
    with c the completion slots read at that step: the end of its decode chunk
    (`decode_buckets` with ``buckets`` = ``SamplingConfig.attention_buckets``), or exactly the
    i filled ones of step i for ``buckets=None`` (a ragged kernel). The loop runs decode steps
    1 .. max(lengths) - 1 (it exits when every row has ended; the XLA layouts still read
    finished rows)
    and decodes sum(lengths - 1) tokens (token 0 comes from the prefill); ``lengths``: the
    rows' completion lengths (e.g. `Rollouts.lengths` measured by the sampler), None = every
    row runs to ``new_tokens``. Units: bytes (``kv_bytes_per_slot``: `kv_bytes_per_slot` of
    the model, keys and values of all layers).

    Returns {"params", "prefix", "completion", "total"}: float bytes per decoded token (the
    loop's reads / the tokens it decoded): the parameters, the prompt keys/values, the
    completion keys/values ("paged": the shared pages read and the partial pages' n % P slots,
    then the rest of the own slots read, the completion's filled slots and the rounding).
    Raises ValueError: rows not a multiple of group_size, no decode step (new_tokens or every
    length < 2), lengths not [rows] in [1, new_tokens], prompt_lengths not [rows] in
    [0, prompt_len], page_size < 1, unknown layout.
    """
    if layout not in DECODE_CACHES:
        raise ValueError(f"layout must be one of {tuple(DECODE_CACHES)}, got {layout!r}")
    if group_size < 1 or rows % group_size:
        raise ValueError(f"rows={rows} is not a multiple of group_size={group_size}")
    lengths = [new_tokens] * rows if lengths is None else [int(n) for n in lengths]
    if len(lengths) != rows or not all(1 <= n <= new_tokens for n in lengths):
        raise ValueError(f"lengths must be {rows} completion lengths in [1, {new_tokens}]")
    if max(lengths) < 2:
        raise ValueError("no decode step: every completion has one token (from the prefill)")
    steps = range(1, max(lengths))  # decode step i reads completion slots [0, i)
    if buckets is None:
        comp = list(steps)
    else:
        ends = [e - prompt_len for e in decode_buckets(prompt_len, new_tokens, buckets)]
        comp = [next(e for e in ends if e >= i) for i in steps]
    decoded = sum(n - 1 for n in lengths)
    if layout == "paged":
        return _paged_read_bytes(
            param_bytes,
            kv_bytes_per_slot,
            prompt_len,
            prompt_lengths,
            group_size,
            page_size,
            compute_tokens,
            lengths,
            len(comp),
            decoded,
        )
    prompt_rows = rows if layout == "dense" else rows // group_size
    out = {
        "params": len(comp) * param_bytes / decoded,
        "prefix": len(comp) * prompt_rows * prompt_len * kv_bytes_per_slot / decoded,
        "completion": rows * sum(comp) * kv_bytes_per_slot / decoded,
    }
    return {**out, "total": sum(out.values())}


def _paged_read_bytes(
    param_bytes,
    kv_bytes_per_slot,
    prompt_len,
    prompt_lengths,
    group_size,
    page_size,
    compute_tokens,
    lengths,
    num_steps,
    decoded,
) -> dict:
    """`decode_read_bytes` of the "paged" layout (its docstring): decode step i = 1 ..
    num_steps reads, per group with a live row, its full prompt pages once, and per live row
    its n % P + i own slots, each rounded up to the kernel's block; a row is live at step i
    while i < its length."""
    rows = len(lengths)
    n = [prompt_len] * rows if prompt_lengths is None else [int(x) for x in prompt_lengths]
    if len(n) != rows or not all(0 <= x <= prompt_len for x in n):
        raise ValueError(f"prompt_lengths must be {rows} prompt lengths in [0, {prompt_len}]")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    tokens = attention.PAGED_COMPUTE_TOKENS if compute_tokens is None else compute_tokens
    P, G = page_size, group_size
    block = attention.paged_block_pages(P, tokens) * P  # keys per kernel block
    up = lambda x: -(-x // block) * block
    L, n = np.asarray(lengths, np.int64), np.asarray(n, np.int64)
    shared = up(n[::G] // P * P)  # [groups] slots read per step while a row of it is live
    prefix = completion = 0
    for i in range(1, num_steps + 1):
        live = i < L
        prefix += int(shared[live.reshape(-1, G).any(1)].sum() + (n % P)[live].sum())
        completion += int((up(n % P + i) - n % P)[live].sum())
    out = {
        "params": num_steps * param_bytes / decoded,
        "prefix": prefix * kv_bytes_per_slot / decoded,
        "completion": completion * kv_bytes_per_slot / decoded,
    }
    return {**out, "total": sum(out.values())}


def _prefill(model, prompt_tokens, prompt_mask, group: int, slots: int):
    """One forward pass over every ``group``-th prompt row into a fresh `DecodeCache` of ``slots``
    slots (rows R / group). Returns (last-position logits repeated to [R, V], the cache)."""
    cache = init_decode_cache(model.config, prompt_tokens.shape[0] // group, slots)
    hidden, cache = model(
        prompt_tokens[::group],
        positions_from_mask(prompt_mask)[::group],
        prompt_mask[::group],
        cache=cache,
        return_hidden=True,
        attend_len=prompt_tokens.shape[1],
    )
    logits = model.logits(hidden[:, -1])  # [R / group, V]
    return (jnp.repeat(logits, group, axis=0) if group > 1 else logits), cache


@functools.partial(jax.jit, static_argnames=("graphdef", "config"))
def _generate(graphdef, params, prompt_tokens, prompt_mask, rng, config, max_lengths=None):
    model = nnx.merge(graphdef, params)
    R, Lp = prompt_tokens.shape
    Lc = config.max_new_tokens
    prompt_mask = prompt_mask.astype(bool)
    prompt_tokens = prompt_tokens.astype(jnp.int32)
    prompt_len = jnp.sum(prompt_mask, axis=-1).astype(jnp.int32)  # [R]
    eos = jnp.asarray(config.eos_ids if config.eos_ids else (-1,), jnp.int32)

    # prefill one row per group of G identical prompts (G = 1: every row); its last logits go
    # to the group's rows and its cache becomes the decode cache of `config.decode_cache`
    # (dense: copied to the group's rows, per layer [rows, kv_heads, slots, head_dim];
    # prefix_shared: kept once per group beside a per-row completion cache). The cache starts
    # with as many slots as the first decode chunk needs and grows between chunks
    G = config.prompt_group_size
    ends = decode_buckets(Lp, Lc, config.attention_buckets) if Lc > 1 else ()
    layout = DECODE_CACHES[config.decode_cache]
    first = ends[0] if ends else Lp
    logits, cache = _prefill(model, prompt_tokens, prompt_mask, G, layout.prefill_slots(Lp, first))
    cache = layout.from_prefill(cache, R, first, page_size=config.page_size)
    layers = unstack_layers(model)  # read in place by every decode step

    rng, key = jax.random.split(rng)
    tok, lp = sample_logits(logits, key, config)
    out_tokens = jnp.full((R, Lc), config.pad_id, jnp.int32).at[:, 0].set(tok)
    out_lp = jnp.zeros((R, Lc), jnp.float32).at[:, 0].set(lp)
    done = jnp.isin(tok, eos)
    cap = None if max_lengths is None else jnp.clip(max_lengths.astype(jnp.int32), 1, Lc)
    if cap is not None:
        done = done | (cap <= 1)

    def body(carry):
        i, tok, cache, done, out_tokens, out_lp, rng = carry
        pos = (prompt_len + i - 1)[:, None]
        # the paged cache's kernel skips finished rows (their outputs are replaced below)
        live = ~done[:, None] if config.decode_cache == "paged" else jnp.ones((R, 1), bool)
        hidden, cache = model(
            tok[:, None],
            pos,
            live,
            cache=cache,
            return_hidden=True,
            layer_params=layers,
        )
        logits = model.logits(hidden[:, 0])
        rng, key = jax.random.split(rng)
        new_tok, lp = sample_logits(logits, key, config)
        new_tok = jnp.where(done, config.pad_id, new_tok)
        lp = jnp.where(done, 0.0, lp)
        out_tokens = jax.lax.dynamic_update_slice(out_tokens, new_tok[:, None], (0, i))
        out_lp = jax.lax.dynamic_update_slice(out_lp, lp[:, None], (0, i))
        done = done | jnp.isin(new_tok, eos)
        if cap is not None:
            done = done | (i + 1 >= cap)
        return i + 1, new_tok, cache, done, out_tokens, out_lp, rng

    # decode in chunks of steps; before chunk j the cache grows (one copy) to exactly the
    # `attend_len` slots its last step reads, so every step reads its layers' buffers in place
    # and whole; each chunk is a while_loop that also exits once every row is done
    carry = (jnp.ones((), jnp.int32), tok, cache, done, out_tokens, out_lp, rng)
    for attend_len in ends:
        last_step = attend_len - Lp  # step i reads slots [0, Lp + i)

        def cond(carry, last_step=last_step):
            i, _, _, done, _, _, _ = carry
            return (i <= last_step) & ~jnp.all(done)

        carry = (*carry[:2], carry[2].grow(attend_len), *carry[3:])
        carry = jax.lax.while_loop(cond, body, carry)
    _, _, _, _, out_tokens, out_lp, _ = carry

    return _finish(prompt_tokens, out_tokens, out_lp, eos, cap, config.pad_id)


def _finish(prompt_tokens, out_tokens, out_lp, eos, cap, pad_id) -> Rollouts:
    """Masks after the first EOS (and past each row's budget ``cap`` [R], None = none) and packs
    the `Rollouts`."""
    is_eos = jnp.isin(out_tokens, eos)
    eos_before = (jnp.cumsum(is_eos, axis=-1) - is_eos) > 0  # an EOS strictly earlier
    mask = ~eos_before
    if cap is not None:
        mask = mask & (jnp.arange(out_tokens.shape[1])[None] < cap[:, None])
    maskf = mask.astype(jnp.float32)
    out_tokens = jnp.where(mask, out_tokens, pad_id)
    return Rollouts(
        tokens=jnp.concatenate([prompt_tokens, out_tokens], axis=1),
        completion_tokens=out_tokens,
        completion_mask=maskf,
        logprobs=out_lp * maskf,
        lengths=jnp.sum(mask, axis=-1).astype(jnp.int32),
        truncated=~jnp.any(is_eos & mask, axis=-1),
    )


def generate(
    graphdef,
    params,
    prompt_tokens,
    prompt_mask,
    rng,
    config: SamplingConfig,
    max_lengths=None,
) -> Rollouts:
    """Sample `config.max_new_tokens` tokens after each prompt.

    graphdef, params: `nnx.split(model, nnx.Param)` of a Transformer (it has no other state).
    prompt_tokens [R, Lp] int32, LEFT-padded (the last column is each prompt's last token);
    prompt_mask [R, Lp] bool, True on real prompt tokens; rng: a PRNG key.
    config: SamplingConfig (static). Inputs may be sharded over the batch; nothing is moved.
    max_lengths: optional [R] int32 completion budget per row (a row that reaches it ends,
    ``truncated``; the batch still runs until its longest row ends); None = max_new_tokens.
    Returns Rollouts (see its docstring). Compiles once per (graphdef, config, shapes, dtypes).
    With ``config.decode_slots > 0`` the rows are decoded by continuous batching
    (`generate_continuous`). Raises ValueError on mismatched prompt shapes.
    """
    if prompt_tokens.ndim != 2 or prompt_tokens.shape != prompt_mask.shape:
        raise ValueError(
            f"prompt_tokens {prompt_tokens.shape} and prompt_mask {prompt_mask.shape} "
            f"must both be [R, Lp]"
        )
    if prompt_tokens.shape[0] % config.prompt_group_size:
        raise ValueError(
            f"{prompt_tokens.shape[0]} rows are not a multiple of "
            f"prompt_group_size {config.prompt_group_size}"
        )
    if config.decode_slots:
        out, stats = generate_continuous(
            graphdef,
            params,
            prompt_tokens,
            prompt_mask,
            rng,
            config,
            num_slots=config.decode_slots,
            max_lengths=max_lengths,
        )
        return out.replace(decode_utilisation=stats.utilisation)
    if max_lengths is not None:
        max_lengths = jnp.asarray(max_lengths, jnp.int32)
    return _generate(graphdef, params, prompt_tokens, prompt_mask, rng, config, max_lengths)


# ----------------------------------------------------------------------------- continuous batching


@flax.struct.dataclass
class SlotStats:
    """What continuous batching did (scalars, int32 unless noted).

    iterations: decode steps run. active_slot_steps: slot-steps that decoded a live request.
    utilisation (float32): active_slot_steps / slot-steps run (the decode batch's width summed
    over iterations: ``num_slots`` until the drain phases halve it), the share of the decode
    batch doing useful work (the static sampler's equivalent is mean length / longest length).
    refills: requests started in a freed slot after the first fill.
    """

    iterations: jax.Array
    active_slot_steps: jax.Array
    utilisation: jax.Array
    refills: jax.Array


@functools.partial(jax.jit, static_argnames=("graphdef", "config", "num_slots"))
def _generate_continuous(
    graphdef, params, prompt_tokens, prompt_mask, rng, max_lengths, config, num_slots
):
    model = nnx.merge(graphdef, params)
    R, Lp = prompt_tokens.shape
    Lc, S, G = config.max_new_tokens, num_slots, config.prompt_group_size
    prompt_mask = prompt_mask.astype(bool)
    prompt_tokens = prompt_tokens.astype(jnp.int32)
    prompt_len = jnp.sum(prompt_mask, axis=-1).astype(jnp.int32)  # [R]
    eos = jnp.asarray(config.eos_ids if config.eos_ids else (-1,), jnp.int32)
    cap = jnp.clip(max_lengths.astype(jnp.int32), 1, Lc)  # [R] completion budget per request

    # every distinct prompt is prefilled once, in one batched pass: its keys/values wait in a
    # prompt cache [L, R / G, KVH, Lp, D] until a slot takes the request
    logits, pcache = _prefill(model, prompt_tokens, prompt_mask, G, Lp)
    rng, key = jax.random.split(rng)
    tok0, lp0 = sample_logits(logits, key, config)  # every request's first token
    out_tokens = jnp.full((R, Lc), config.pad_id, jnp.int32).at[:, 0].set(tok0)
    out_lp = jnp.zeros((R, Lc), jnp.float32).at[:, 0].set(lp0)
    live = ~jnp.isin(tok0, eos) & (cap > 1)  # requests that need decode steps
    queue = jnp.argsort(~live, stable=True).astype(jnp.int32)  # live requests first, in order
    n_live = jnp.sum(live).astype(jnp.int32)

    cache = init_decode_cache(model.config, S, Lp + Lc)
    cache = cache.replace(index=jnp.full((S,), Lp, jnp.int32))
    layers = unstack_layers(model)  # read in place by every decode step
    req = jnp.full((S,), R, jnp.int32)  # the request in each slot (R = none)
    step = jnp.ones((S,), jnp.int32)  # completion index the slot samples next
    active = jnp.zeros((S,), bool)

    def fill(state, slots, count):
        """Starts the next `count` queued requests in `slots[:count]` (a prompt-cache copy)."""

        def body(j, st):
            cache, req, step, active, ptr = st
            s, r = slots[j], queue[ptr]
            g = r // G

            def put(dst, src):  # slot s's first Lp slots <- prompt g's [1, KVH, Lp, D]
                row = jax.lax.dynamic_slice_in_dim(src, g, 1, axis=0)
                return jax.lax.dynamic_update_slice(dst, row, (s, 0, 0, 0))

            cache = cache.replace(
                k=tuple(map(put, cache.k, pcache.k)),
                v=tuple(map(put, cache.v, pcache.v)),
                key_mask=jax.lax.dynamic_update_slice(
                    cache.key_mask,
                    jnp.concatenate([prompt_mask[r], jnp.zeros((Lc,), bool)])[None],
                    (s, 0),
                ),
                index=cache.index.at[s].set(Lp),
            )
            return cache, req.at[s].set(r), step.at[s].set(1), active.at[s].set(True), ptr + 1

        return jax.lax.fori_loop(0, count, body, state)

    zero = jnp.zeros((), jnp.int32)
    state = fill((cache, req, step, active, zero), jnp.arange(S), jnp.minimum(S, n_live))

    def body(carry):
        (cache, req, step, active, ptr), out_tokens, out_lp, rng, it, used, slot_steps, refills = (
            carry
        )
        width = active.shape[0]
        r = jnp.minimum(req, R - 1)
        prev = out_tokens[r, step - 1]  # the token each slot feeds (completion index step - 1)
        pos = (prompt_len[r] + step - 1)[:, None]
        hidden, cache = model(
            prev[:, None],
            pos,
            active[:, None],
            cache=cache,
            return_hidden=True,
            layer_params=layers,
        )
        rng, key = jax.random.split(rng)
        new_tok, lp = sample_logits(model.logits(hidden[:, 0]), key, config)
        dest = jnp.where(active, req, R)  # finished / empty slots write nowhere (dropped)
        out_tokens = out_tokens.at[dest, step].set(new_tok, mode="drop")
        out_lp = out_lp.at[dest, step].set(lp, mode="drop")
        finished = active & (jnp.isin(new_tok, eos) | (step + 1 >= cap[r]))
        used = used + jnp.sum(active).astype(jnp.int32)
        step = jnp.where(active, step + 1, step)
        active = active & ~finished
        cache = cache.replace(index=jnp.where(active, cache.index, Lp))
        count = jnp.minimum(jnp.sum(finished), n_live - ptr).astype(jnp.int32)
        slots = jnp.nonzero(finished, size=width, fill_value=0)[0].astype(jnp.int32)
        state = fill((cache, req, step, active, ptr), slots, count)
        return (state, out_tokens, out_lp, rng, it + 1, used, slot_steps + width, refills + count)

    # drain phases: once no request is pending and at most half the slots are live, the live
    # slots move (one gather of their cache rows) to a batch half as wide, down to S / 16
    widths = [S]
    while widths[-1] > 1 and widths[-1] // 2 >= max(1, S // 16):
        widths.append(widths[-1] // 2)
    carry = (state, out_tokens, out_lp, rng, zero, zero, zero, zero)
    for j in range(len(widths)):
        nxt = widths[j + 1] if j + 1 < len(widths) else 0

        def cond(carry, nxt=nxt):
            (_, _, _, active, ptr) = carry[0]
            live = jnp.sum(active)
            return (live > 0) & ((ptr < n_live) | (live > nxt))

        carry = jax.lax.while_loop(cond, body, carry)
        if nxt:
            (cache, req, step, active, ptr), *rest = carry
            keep = jnp.argsort(~active, stable=True)[:nxt]  # the live slots first
            cache = cache.map_rows(lambda x, keep=keep: x[keep])
            carry = ((cache, req[keep], step[keep], active[keep], ptr), *rest)
    _, out_tokens, out_lp, _, it, used, slot_steps, refills = carry

    rollouts = _finish(prompt_tokens, out_tokens, out_lp, eos, cap, config.pad_id)
    stats = SlotStats(
        iterations=it,
        active_slot_steps=used,
        utilisation=used / jnp.maximum(slot_steps, 1).astype(jnp.float32),
        refills=refills,
    )
    return rollouts, stats


_full_int32 = jax.jit(lambda shape, value: jnp.full(shape, value, jnp.int32), static_argnums=(0, 1))


def generate_continuous(
    graphdef,
    params,
    prompt_tokens,
    prompt_mask,
    rng,
    config: SamplingConfig,
    *,
    num_slots: int,
    max_lengths=None,
) -> tuple[Rollouts, SlotStats]:
    """`generate` with continuous batching: ``num_slots`` decode rows, each refilled with the
    next pending request (row of ``prompt_tokens``) as soon as its completion ends.

    Every distinct prompt (one per group of ``config.prompt_group_size`` rows) is prefilled once
    up front into a prompt cache; a request that takes a freed slot copies its prompt's keys and
    values into that slot (``[L, KVH, Lp, D]``, no recomputation) and decodes from there. The
    decode batch stays full while requests are pending, so the wall time follows the total
    number of generated tokens / ``num_slots`` rather than ``R / num_slots`` x the longest
    completion. When nothing is pending and at most half the slots are live, the live slots
    move to a batch half as wide (down to ``num_slots / 16``), so the drain at the end does not
    run a mostly empty batch. Static shapes: one compile per (config, num_slots, shapes).

    Same per-step distribution as `generate` (same logits for the same prefix, up to float
    rounding: the slots attend over all Lp + Lc cache slots under a mask); the random draws
    differ, and at temperature 0 the tokens are the same (tests/test_sampling_continuous.py).

    Args:
      graphdef, params, prompt_tokens [R, Lp] int32 (left-padded), prompt_mask [R, Lp] bool,
        rng, config: as `generate`.
      num_slots: decode rows S (1 <= S; S >= R degenerates to a static batch of R rows).
      max_lengths: optional [R] int32 completion budget per request (<= max_new_tokens; a
        request that reaches it ends, ``truncated``); None = max_new_tokens for every request.

    Returns:
      (Rollouts in request order, SlotStats).

    Raises:
      ValueError: mismatched shapes, num_slots < 1, rows not a multiple of prompt_group_size.
    """
    if prompt_tokens.ndim != 2 or prompt_tokens.shape != prompt_mask.shape:
        raise ValueError(
            f"prompt_tokens {prompt_tokens.shape} and prompt_mask {prompt_mask.shape} "
            f"must both be [R, Lp]"
        )
    R = prompt_tokens.shape[0]
    if R % config.prompt_group_size:
        raise ValueError(
            f"{R} rows are not a multiple of prompt_group_size {config.prompt_group_size}"
        )
    if not isinstance(num_slots, int) or num_slots < 1:
        raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
    if max_lengths is None:
        max_lengths = _full_int32((R,), config.max_new_tokens)  # built on device: no transfer
    elif jnp.shape(max_lengths) != (R,):
        raise ValueError(f"max_lengths must be [{R}], got shape {jnp.shape(max_lengths)}")
    return _generate_continuous(
        graphdef,
        params,
        prompt_tokens,
        prompt_mask,
        rng,
        jnp.asarray(max_lengths, jnp.int32),
        config,
        min(num_slots, R),
    )
