"""Jitted autoregressive sampler: one prefill pass + KV-cache decode in a lax.while_loop.

`generate(graphdef, params, prompt_tokens, prompt_mask, rng, config)` -> `Rollouts`.

Shapes are static (R rows, Lp prompt slots, Lc = max_new_tokens), so a training loop with a
fixed batch compiles once. The KV cache has Lp + Lc slots and is updated in place
(dynamic_update_slice on a loop carry); the prompt is processed once; there is no host sync
inside the loop, which exits as soon as every row has produced an EOS id.

Sampling distribution (per step, HF `generate` order): logits / temperature, then top-k, then
top-p (nucleus, Holtzman et al. 2020) on the renormalised top-k distribution. temperature == 0
is greedy argmax (no division). `Rollouts.logprobs` are log_softmax(logits / temperature)
of the sampled token BEFORE top-k/top-p truncation (log_softmax(logits) when temperature == 0),
i.e. what a training forward pass at the same temperature recomputes.
"""

from __future__ import annotations

import dataclasses
import functools

import flax
import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax.models.transformer import init_cache, positions_from_mask


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
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    eos_ids: tuple[int, ...] = ()
    pad_id: int = 0
    prompt_group_size: int = 1

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
        object.__setattr__(self, "eos_ids", tuple(int(e) for e in self.eos_ids))


@flax.struct.dataclass
class Rollouts:
    """Sampler output (R rows, Lp prompt slots, Lc = max_new_tokens).

    tokens [R, Lp + Lc] int32: left-padded prompt + completion (pad_id after EOS).
    completion_tokens [R, Lc] int32. completion_mask [R, Lc] float32: 1 on completion tokens up
    to and including the first EOS. logprobs [R, Lc] float32: log_softmax(logits / T) of each
    sampled token (before top-k/top-p truncation), 0 where masked. lengths [R] int32: number of
    completion tokens (incl. EOS). truncated [R] bool: no EOS within max_new_tokens.
    """

    tokens: jax.Array
    completion_tokens: jax.Array
    completion_mask: jax.Array
    logprobs: jax.Array
    lengths: jax.Array
    truncated: jax.Array


def sample_logits(logits: jax.Array, key: jax.Array, config: SamplingConfig):
    """One sampling step: logits [R, V] -> (token [R] int32, logprob [R] float32).

    Temperature, then top-k, then top-p (see the module docstring); logprob is
    log_softmax(logits / temperature)[token] before truncation (temperature 0: greedy argmax
    and log_softmax(logits)). jittable; config static.
    """
    logits = logits.astype(jnp.float32)
    if config.temperature == 0:
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return tok, jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]
    scaled = logits / config.temperature
    logp = jax.nn.log_softmax(scaled, axis=-1)
    V = logits.shape[-1]
    k = config.top_k if 0 < config.top_k < V else 0
    if k == 0 and config.top_p >= 1.0:
        tok = jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)
    else:
        # sorted (descending) candidate set: the top-k, or the whole vocabulary for top-p only
        vals, idx = jax.lax.top_k(scaled, k if k else V)
        if config.top_p < 1.0:
            probs = jax.nn.softmax(vals, axis=-1)
            exclusive_cum = jnp.cumsum(probs, axis=-1) - probs
            keep = exclusive_cum < config.top_p
            keep = keep.at[:, 0].set(True)  # the argmax always survives (top_p == 0)
            vals = jnp.where(keep, vals, -jnp.inf)
        choice = jax.random.categorical(key, vals, axis=-1)
        tok = jnp.take_along_axis(idx, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return tok, jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]


@functools.partial(jax.jit, static_argnames=("graphdef", "config"))
def _generate(graphdef, params, model_state, prompt_tokens, prompt_mask, rng, config):
    if model_state is None:
        model = nnx.merge(graphdef, params)
    else:
        model = nnx.merge(graphdef, params, model_state)
    R, Lp = prompt_tokens.shape
    Lc = config.max_new_tokens
    prompt_mask = prompt_mask.astype(bool)
    prompt_tokens = prompt_tokens.astype(jnp.int32)
    positions = positions_from_mask(prompt_mask)
    prompt_len = jnp.sum(prompt_mask, axis=-1).astype(jnp.int32)  # [R]
    eos = jnp.asarray(config.eos_ids if config.eos_ids else (-1,), jnp.int32)

    # prefill one row per group of G identical prompts (G = 1: every row), then copy its cache
    # and last logits to the group's rows
    G = config.prompt_group_size
    cache = init_cache(model.config, R // G, Lp + Lc)
    hidden, cache = model(
        prompt_tokens[::G], positions[::G], prompt_mask[::G], cache=cache, return_hidden=True
    )
    logits = model.logits(hidden[:, -1])  # [R / G, V]
    if G > 1:
        logits = jnp.repeat(logits, G, axis=0)
        cache = cache.replace(
            k=jnp.repeat(cache.k, G, axis=1),
            v=jnp.repeat(cache.v, G, axis=1),
            key_mask=jnp.repeat(cache.key_mask, G, axis=0),
        )

    rng, key = jax.random.split(rng)
    tok, lp = sample_logits(logits, key, config)
    out_tokens = jnp.full((R, Lc), config.pad_id, jnp.int32).at[:, 0].set(tok)
    out_lp = jnp.zeros((R, Lc), jnp.float32).at[:, 0].set(lp)
    done = jnp.isin(tok, eos)

    def cond(carry):
        i, _, _, done, _, _, _ = carry
        return (i < Lc) & ~jnp.all(done)

    def body(carry):
        i, tok, cache, done, out_tokens, out_lp, rng = carry
        pos = (prompt_len + i - 1)[:, None]
        hidden, cache = model(
            tok[:, None], pos, jnp.ones((R, 1), bool), cache=cache, return_hidden=True
        )
        logits = model.logits(hidden[:, 0])
        rng, key = jax.random.split(rng)
        new_tok, lp = sample_logits(logits, key, config)
        new_tok = jnp.where(done, config.pad_id, new_tok)
        lp = jnp.where(done, 0.0, lp)
        out_tokens = jax.lax.dynamic_update_slice(out_tokens, new_tok[:, None], (0, i))
        out_lp = jax.lax.dynamic_update_slice(out_lp, lp[:, None], (0, i))
        done = done | jnp.isin(new_tok, eos)
        return i + 1, new_tok, cache, done, out_tokens, out_lp, rng

    carry = (jnp.ones((), jnp.int32), tok, cache, done, out_tokens, out_lp, rng)
    _, _, _, _, out_tokens, out_lp, _ = jax.lax.while_loop(cond, body, carry)

    is_eos = jnp.isin(out_tokens, eos)
    eos_before = (jnp.cumsum(is_eos, axis=-1) - is_eos) > 0  # an EOS strictly earlier
    mask = ~eos_before
    lengths = jnp.sum(mask, axis=-1).astype(jnp.int32)
    truncated = ~jnp.any(is_eos & mask, axis=-1)
    out_tokens = jnp.where(mask, out_tokens, config.pad_id)
    maskf = mask.astype(jnp.float32)
    return Rollouts(
        tokens=jnp.concatenate([prompt_tokens, out_tokens], axis=1),
        completion_tokens=out_tokens,
        completion_mask=maskf,
        logprobs=out_lp * maskf,
        lengths=lengths,
        truncated=truncated,
    )


def generate(
    graphdef,
    params,
    prompt_tokens,
    prompt_mask,
    rng,
    config: SamplingConfig,
    *,
    model_state: nnx.State | None = None,
) -> Rollouts:
    """Sample `config.max_new_tokens` tokens after each prompt.

    graphdef, params: `nnx.split(model, nnx.Param)` of a Transformer (model_state: any other
    state from `nnx.split(model, nnx.Param, ...)`; the Transformer has none).
    prompt_tokens [R, Lp] int32, LEFT-padded (the last column is each prompt's last token);
    prompt_mask [R, Lp] bool, True on real prompt tokens; rng: a PRNG key.
    config: SamplingConfig (static). Inputs may be sharded over the batch; nothing is moved.
    Returns Rollouts (see its docstring). Compiles once per (graphdef, config, shapes, dtypes).
    Raises ValueError on mismatched prompt shapes.
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
    return _generate(graphdef, params, model_state, prompt_tokens, prompt_mask, rng, config)
