"""The jitted programs of one RL step, and the run's set-up: `make_steps(exp)`, `init_run(exp)`.

Everything here runs on device. `make_steps` returns one typed `Steps` bundle (the sampler, the
advantage estimator, the log-prob pass, the policy update and the on-device training loop over
mini-batches); `init_run` builds a run's initial `RunState` (parameters in their sharding, the
optional supervised warm start, the frozen reference, the curriculum's state). The trainer
(`grpo_jax.train`), `experiments/compare`, the benchmarks and the tests all start a run with
these two functions.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from grpo_jax import advantages as advantages_lib
from grpo_jax import (
    checkpointing,
    generation_layout,
    losses,
    packing,
    rollout_queue,
    sampling,
    sharding,
)
from grpo_jax import logprobs as logprobs_lib
from grpo_jax.experiment import Experiment
from grpo_jax.models import lora as lora_lib
from grpo_jax.models.transformer import positions_from_mask
from grpo_jax.state import (
    Batch,
    RunState,
    TrainState,
    apply_optimizer,
    last_learning_rate,
    make_schedule,
    master_weights,
    total_updates,
)

# ----------------------------------------------------------------------------- log-probs


def completion_logprobs(
    graphdef,
    params,
    tokens,
    attention_mask,
    prompt_len: int,
    temperature: float,
    group_size: int = 1,
    logprob_chunk_size: int = 0,
):
    """Log-probs of the completion tokens under the policy, float32 [R, Lc].

    The logits at position t score token t+1 (one-position shift); only the Lc completion
    positions are scored. Temperature as when sampling (grpo.md, "Log-probs from logits").

    Args:
      tokens [R, Lp + Lc] int32 (prompt left-padded to Lp = prompt_len, then the completion),
      attention_mask [R, Lp + Lc] bool, temperature: float (> 0).
      group_size: G > 1 when rows come in consecutive groups of G with identical prompt tokens
        and mask (a GRPO group): the prompt is then run once per group (`Decoder.shared_prefix`),
        the same values up to float rounding for less compute. 1 = every row on its own.
      logprob_chunk_size: 0 = project the hidden states to the whole [R, Lc, V] logits
        (`model.logits`) and take the log-softmax from them; > 0 = `logprobs.logprobs_from_hidden`
        with chunks of this many positions: the LM head, log-softmax and their backward run a
        chunk at a time, so neither the [R, Lc, V] logits nor their gradient ever exist whole
        (the same values up to float rounding; config.algorithm.logprob_chunk_size).
    Raises:
      ValueError: R is not a multiple of group_size.
    """
    model = nnx.merge(graphdef, params)
    positions = positions_from_mask(attention_mask)
    R, L = tokens.shape
    if group_size > 1 and L - prompt_len > 1:
        if R % group_size:
            raise ValueError(f"{R} rows are not a multiple of group_size {group_size}")
        G, lp = group_size, prompt_len
        hp, hc = model.model.shared_prefix(
            tokens[::G, :lp],
            positions[::G, :lp],
            attention_mask[::G, :lp],
            tokens[:, lp:-1],
            positions[:, lp:-1],
            attention_mask[:, lp:-1],
        )
        # position Lp - 1 (the prompt's last token) scores the first completion token
        hidden = jnp.concatenate([jnp.repeat(hp[:, -1:], G, axis=0), hc], axis=1)
    else:
        hidden, _ = model(
            tokens[:, :-1], positions[:, :-1], attention_mask[:, :-1], return_hidden=True
        )
        hidden = hidden[:, prompt_len - 1 :]
    # project only the Lc completion positions to the vocabulary (the prompt's logits are never
    # used: at Lp = 256, Lc = 64 that is 5x less logits memory and LM-head compute)
    targets = tokens[:, prompt_len:]
    return head_logprobs(model, hidden, targets, temperature, logprob_chunk_size)


def packed_token_logprobs(model, tokens, buffers, temperature: float, logprob_chunk_size=0):
    """Log-probs of the scored positions' next tokens in packed buffers: float32 [k, H].

    Args:
      model: the merged policy (`nnx.merge`).
      tokens: [R, L] int32, the padded batch the buffers read.
      buffers: one micro-batch of a `packing.MicroBatches`: (src_row, src_col, segment_ids,
        positions) [k, T] and head_slot [k, H] int32. Slot (b, t) holds token
        ``tokens[src_row, src_col]``; a scored slot's log-prob is that of the next token of its
        row, ``tokens[src_row, src_col + 1]``.
      temperature, logprob_chunk_size: as `completion_logprobs`. The transformer runs on the
        k x T packed tokens, the LM head on the k x H scored slots only (each buffer's own, so a
        buffer's work stays on its device).
    """
    src_row, src_col, seg, positions, head_slot = buffers
    tokens = jnp.asarray(tokens)
    inputs = packing.pack(tokens, src_row, src_col, seg)
    hidden, _ = model(inputs, positions, seg > 0, segment_ids=seg, return_hidden=True)
    hidden = jnp.take_along_axis(hidden, head_slot[..., None], axis=1)  # [k, H, E]
    row = jnp.take_along_axis(src_row, head_slot, axis=1)
    col = jnp.take_along_axis(src_col, head_slot, axis=1)
    targets = tokens[row, jnp.minimum(col + 1, tokens.shape[1] - 1)]  # [k, H]
    return head_logprobs(model, hidden, targets, temperature, logprob_chunk_size)


def _scatter_scored(lp, head_row, head_col, rows: int, cols: int):
    """Scored log-probs [..., H] -> [rows, cols] float32 at (head_row, head_col); 0 elsewhere
    (entries with head_row = rows are dropped)."""
    out = jnp.zeros((rows, cols), jnp.float32)
    return out.at[head_row.reshape(-1), head_col.reshape(-1)].add(
        lp.reshape(-1).astype(jnp.float32), mode="drop"
    )


def packed_completion_logprobs(
    graphdef,
    params,
    tokens,
    prompt_len: int,
    temperature: float,
    micro: packing.MicroBatches,
    logprob_chunk_size: int = 0,
):
    """`completion_logprobs` on packed buffers, one micro-batch of ``micro`` at a time
    (``lax.map``): float32 [R, Lc], the same values on the scored completion tokens up to
    float rounding, 0 elsewhere.

    Args: as `completion_logprobs`; ``micro``: `packing.MicroBatches` of ``tokens``' rows
    scoring the completions (`packing.micro_batches` of `packing.spans` of the attention mask
    with ``scored=(prompt_len - 1, completion tokens)``; `packed_logprob_plan`).
    """

    def one(buffers):
        model = nnx.merge(graphdef, params)
        return packed_token_logprobs(model, tokens, buffers, temperature, logprob_chunk_size)

    lp = jax.lax.map(one, tuple(micro[:5]))  # [M, k, H]
    R, L = tokens.shape
    return _scatter_scored(lp, micro.head_row, micro.head_col, R, L - prompt_len)


def head_logprobs(model, hidden, targets, temperature: float, logprob_chunk_size: int = 0):
    """Log-probs [..., P] float32 of ``targets`` [..., P] from final hidden states [..., P, E]
    through the policy's LM head: the whole logits (``logprob_chunk_size`` 0) or
    `logprobs.logprobs_from_hidden` a chunk of positions at a time (`completion_logprobs`)."""
    if logprob_chunk_size > 0:
        head, layout = lm_head_of(model)
        return logprobs_lib.logprobs_from_hidden(
            hidden,
            head,
            targets,
            temperature,
            head_layout=layout,
            chunk_size=logprob_chunk_size,
            prepare_head=_head_gather(head.shape, layout),
        )
    return logprobs_lib.logprobs_from_logits(model.logits(hidden), targets, temperature)


def lm_head_of(model) -> tuple[jax.Array, str]:
    """The policy's LM head as `Transformer.logits` reads it: `(lm_head [E, V], "ev")` when
    untied, else the tied embedding `(model.embed [V, E], "ve")` (the parameter's dtype; the
    layout string is `logprobs.logprobs_from_hidden`'s `head_layout`)."""
    if model.lm_head is None:
        return model.model.embed[...], "ve"
    return model.lm_head[...], "ev"


def _head_gather(shape, layout: str):
    """`prepare_head` for `logprobs.logprobs_from_hidden` under a mesh that shards the head's
    embedding axis (FSDP): a sharding constraint that gathers that axis (the vocabulary axis
    keeps its tensor-parallel sharding), applied once per pass before the chunk loops. Without
    it the TPU compiler gathered the head inside every chunk's iteration, forward and backward
    (v5e:2x2, FSDP 4). None without a mesh in context or without FSDP."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or "fsdp" not in mesh.axis_names or mesh.shape["fsdp"] == 1:
        return None
    logical = ("embed", "vocab") if layout == "ev" else ("vocab", "embed")
    rules = tuple((name, None if name == "embed" else axes) for name, axes in sharding.RULES)
    spec = sharding.logical_to_spec(logical, shape, mesh, rules)
    return functools.partial(jax.lax.with_sharding_constraint, shardings=spec)


def logprob_chunk_size(exp: Experiment) -> int:
    """``config.algorithm.logprob_chunk_size`` (0 when an older config lacks it)."""
    return int(exp.run.algorithm.logprob_chunk_size)


def split_rows(x, chunks: int, group: int = 1):
    """[R, ...] -> [chunks, R / chunks, ...]: chunk j holds the groups {i * chunks + j} of
    ``group`` consecutive rows (group 1: rows {i * chunks + j}). A batch sharded in contiguous
    row blocks over ``data`` x ``fsdp`` is split without moving a row between devices, and a
    GRPO group stays whole (``group`` = rollouts per prompt). Inverse: ``merge_rows``."""
    per = x.shape[0] // chunks
    x = x.reshape(per // group, chunks, group, *x.shape[1:])
    return jnp.swapaxes(x, 0, 1).reshape(chunks, per, *x.shape[3:])


def merge_rows(x, group: int = 1):
    """Inverse of ``split_rows``: [chunks, R / chunks, ...] -> [R, ...]."""
    chunks, per = x.shape[:2]
    x = x.reshape(chunks, per // group, group, *x.shape[2:])
    return jnp.swapaxes(x, 0, 1).reshape(chunks * per, *x.shape[3:])


def chunked_completion_logprobs(
    graphdef,
    params,
    tokens,
    attention_mask,
    prompt_len: int,
    temperature: float,
    rows_per_chunk: int,
    group_size: int = 1,
    logprob_chunk_size: int = 0,
):
    """``completion_logprobs`` computed ``rows_per_chunk`` rows at a time (``lax.map``).

    Peak memory is one chunk's activations and logits instead of the whole batch's (at Qwen3-8B
    x 1024 rollouts x 5,120 tokens: 43 GiB instead of 156 GiB per device on 64 chips,
    ``reports/aot.md``). Chunk ``j`` holds rows ``{i * C + j}`` (``split_rows``, whole groups of
    ``group_size``), so no row changes device. Rows are independent, so the values equal the
    unchunked ones up to float rounding. One pass when ``rows_per_chunk`` does not divide R.

    Args: as ``completion_logprobs``. Returns: [R, Lc] float32.
    """
    R = tokens.shape[0]
    if rows_per_chunk <= 0 or rows_per_chunk >= R or R % rows_per_chunk:
        return completion_logprobs(
            graphdef,
            params,
            tokens,
            attention_mask,
            prompt_len,
            temperature,
            group_size,
            logprob_chunk_size,
        )
    chunks = R // rows_per_chunk
    out = jax.lax.map(
        lambda a: completion_logprobs(
            graphdef, params, a[0], a[1], prompt_len, temperature, group_size, logprob_chunk_size
        ),
        (split_rows(tokens, chunks, group_size), split_rows(attention_mask, chunks, group_size)),
    )
    return merge_rows(out, group_size)


# ----------------------------------------------------------------------------- the update


def _zero_grads(params):
    """Zero gradient accumulators (low-precision parameters: summed in float32)."""
    return jax.tree.map(
        lambda p: jnp.zeros_like(p, jnp.promote_types(p.dtype, jnp.float32)), params
    )


def _all_finite(tree) -> jax.Array:
    """True when every element of every leaf is finite (bool [])."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def _select(ok, new, old):
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


# `losses.policy_loss` aux entries that are bookkeeping of the micro-batch sum, not metrics
_INTERNAL_AUX = ("loss_sum", "denominator", "num_tokens")
# aux entries that are partial sums over micro-batches (each against the whole denominator)
_SUMMED_AUX = ("pg_loss",)


def _accumulate_rows(fn, params, batch: Batch, denominator, micro: int, group: int):
    """(loss, aux, grads) of ``fn`` over the batch's rows, ``micro`` rows per pass.

    The whole mini-batch's loss denominator is passed to every micro-batch, so the summed
    losses and gradients equal the one-pass ones (``losses.policy_loss``, "Micro-batching").
    Micro-batch j holds rows {i * n + j} (``split_rows``): no row changes device.
    """
    rows = batch.tokens.shape[0]
    if micro >= rows:
        (loss, aux), grads = jax.value_and_grad(fn, has_aux=True)(params, batch)
        return loss, aux, grads
    n = rows // micro

    def body(acc, micro_batch):
        (loss, aux), g = jax.value_and_grad(fn, has_aux=True)(params, micro_batch, denominator)
        return jax.tree.map(jnp.add, acc, g), (loss, aux)

    grads, (loss, aux) = jax.lax.scan(
        body, _zero_grads(params), jax.tree.map(lambda x: split_rows(x, n, group), batch)
    )
    # per-rollout losses back in row order; the surrogate (computed against the whole
    # mini-batch's denominator) summed; clip fraction, KL, ratio, TIS: mean of micro-batches
    aux = {
        k: merge_rows(v, group)
        if k == "per_rollout_loss"
        else jnp.sum(v)
        if k in _SUMMED_AUX
        else jnp.mean(v)
        for k, v in aux.items()
    }
    return jnp.sum(loss), aux, grads


def _accumulate_packed(fn, params, batch: Batch, denominator, micro_batches):
    """(loss, aux, grads) of ``fn`` over the packed micro-batches of ``micro_batches``
    (`packing.MicroBatches` of the batch's rows): one forward/backward per k x T token
    buffer set, every micro-batch against the whole mini-batch's denominator, so loss and
    gradients equal `_accumulate_rows`' (any `loss_agg_mode`: a row lies in one micro-batch, the
    others see it fully masked). Token-mean diagnostics (clip fraction, KL, ratio, TIS) are
    weighted by each micro-batch's tokens: the mini-batch's own token means (the padded path
    averages its micro-batches' means, the same only with one micro-batch)."""

    def body(acc, xs):
        buffers, j = xs
        (loss, aux), g = jax.value_and_grad(fn, has_aux=True)(
            params, batch, denominator, (buffers, j, micro_batches)
        )
        return jax.tree.map(jnp.add, acc, g), (loss, aux)

    M = micro_batches.num_micro
    grads, (loss, aux) = jax.lax.scan(
        body, _zero_grads(params), (tuple(micro_batches[:7]), jnp.arange(M))
    )
    w = aux["num_tokens"] / jnp.maximum(jnp.sum(aux["num_tokens"]), 1.0)
    additive = ("per_rollout_loss", "loss_sum", "num_tokens", *_SUMMED_AUX)
    aux = {k: jnp.sum(v, axis=0) if k in additive else jnp.sum(v * w) for k, v in aux.items()}
    return jnp.sum(loss), {**aux, "denominator": denominator}, grads


def policy_gradients(exp: Experiment) -> Callable:
    """The unjitted ``gradients(params, batch, micro_batches=None) -> (loss, aux, grads)`` of the
    policy loss over one mini-batch, as the update computes them: micro-batches of rows
    (``algorithm.micro_batch_size``), or the packed micro-batches of a `packing.MicroBatches`
    of the batch's rows (`packing.micro_batches`). Loss float32 []; aux as
    `losses.policy_loss`'s (token-mean entries over the mini-batch); grads like ``params``."""
    return _update_fns(exp)[1]


def _update_fn(exp: Experiment):
    """The unjitted ``update(state, batch, micro_batches=None) -> (state, metrics)`` of one
    mini-batch."""
    return _update_fns(exp)[0]


def _update_fns(exp: Experiment):
    """(``update``, ``gradients``): `_update_fn`'s and `policy_gradients`' functions."""
    cfg = exp.run.algorithm
    graphdef, lp = exp.graphdef, exp.prompt_len
    temperature = float(exp.run.rollout.temperature)
    on_policy, micro, group = (
        exp.batching.on_policy,
        exp.batching.micro_batch_size,
        exp.batching.prompt_group_size,
    )
    learner = exp.learner
    lp_chunk = logprob_chunk_size(exp)
    # the KL to the reference is paid once: here, unless the learner puts it in the per-token
    # rewards (PPO's default, `config.algorithm.kl_in`)
    kl_coef = cfg.kl_coef if learner.kl_in == "loss" else 0.0
    loss_cfg = dataclasses.replace(cfg.loss, max_len=exp.max_new_tokens, kl_coef=kl_coef)

    def loss_fn(params, batch: Batch, denominator=None, packed=None):
        """The policy loss of ``batch``'s rows; ``packed`` = (micro-batch j's arrays of a
        `packing.MicroBatches`, j, the whole plan): of the rows of micro-batch j only, computed
        on its buffers."""
        mask = batch.completion_mask
        if packed is None:
            logprobs = completion_logprobs(
                graphdef, params, batch.tokens, batch.attention_mask, lp, temperature, group,
                lp_chunk,
            )  # fmt: skip
        else:
            buffers, j, micro = packed
            model = nnx.merge(graphdef, params)
            scored = packed_token_logprobs(model, batch.tokens, buffers[:5], temperature, lp_chunk)
            logprobs = _scatter_scored(scored, buffers[5], buffers[6], *mask.shape)
            inside = micro.micro_of == j
            mask = jnp.where(inside[:, None], mask, jnp.zeros_like(mask))
        old = jax.lax.stop_gradient(logprobs) if on_policy else batch.old_logprobs
        return losses.policy_loss(
            logprobs,
            old,
            batch.advantages,
            mask,
            loss_cfg,
            ref_logprobs=batch.ref_logprobs if kl_coef > 0 else None,
            sampler_logprobs=batch.sampler_logprobs if loss_cfg.tis_cap else None,
            sample_weights=batch.sample_weights,
            denominator=denominator,
        )

    accumulate = functools.partial(_accumulate_rows, micro=micro, group=group)
    accumulate_packed = _accumulate_packed

    def gradients(params, batch: Batch, micro_batches=None, fn=loss_fn):
        den = losses.loss_denominator(
            batch.completion_mask, cfg.loss_agg_mode, max_len=exp.max_new_tokens
        )
        if micro_batches is None:
            return accumulate(fn, params, batch, den)
        return accumulate_packed(fn, params, batch, den, micro_batches)

    def update(state: TrainState, batch: Batch, micro_batches=None):
        """One AdamW step; a non-finite loss, gradient norm or new parameter skips it (state
        kept, ``skips`` + 1; a good step resets ``skips``). ``micro_batches``: the batch's
        `packing.MicroBatches` (the packed update), or None (padded micro-batches of rows).

        With LoRA only the adapters are differentiated and updated: the frozen base is a
        constant of the loss (no base gradient is computed) and passes through unchanged."""
        fn, trained = loss_fn, state.params
        if exp.lora:
            base, trained = lora_lib.split(state.params)

            def fn(adapters, batch, denominator=None, packed=None):
                return loss_fn(lora_lib.combine(base, adapters), batch, denominator, packed)

        loss, aux, grads = gradients(trained, batch, micro_batches, fn)
        gnorm = optax.global_norm(jax.tree.map(lambda g: g.astype(jnp.float32), grads))
        new_trained, opt_state = apply_optimizer(exp.tx, grads, state.opt_state, trained)
        ok = jnp.isfinite(loss) & jnp.isfinite(gnorm) & _all_finite(new_trained)
        params = exp.with_trainable(state.params, _select(ok, new_trained, trained))
        # every diagnostic of the loss (clip fraction, KL, ratio, TIS weights, ...) reaches
        # metrics.jsonl; only the micro-batching internals stay here
        metrics = {
            "loss": loss,
            "grad_norm": gnorm,
            **{k: v for k, v in aux.items() if k not in _INTERNAL_AUX},
            "update_ok": ok,
        }
        new = state.replace(
            params=params,
            opt_state=_select(ok, opt_state, state.opt_state),
            skips=jnp.where(ok, 0, state.skips + 1),
        )
        new, extra = learner.extra_update(new, batch, accumulate)
        return new, {**metrics, **extra}

    return update, gradients


def _take(mesh, batch, idx):
    """Rows ``idx`` of every leaf, laid out over the batch sharding (an eager ``x[idx]`` comes
    back replicated, which a multi-process jit refuses as an argument)."""
    return jax.tree.map(
        lambda x: jax.lax.with_sharding_constraint(x[idx], sharding.batch_sharding(mesh, x.ndim)),
        batch,
    )


def minibatch_order(exp: Experiment) -> Callable:
    """``order(key) -> [num_iterations, N, mini_batch_size] int32``: the batch rows of each
    pass's N mini-batches. Each pass shuffles the rows with its own key from ``key`` (whole
    groups when each group's prompt runs once); with one mini-batch the rows stay in order."""
    R = exp.batching.rollouts_per_step
    mb, g, iters = (
        exp.batching.mini_batch_size,
        exp.batching.prompt_group_size,
        exp.run.algorithm.num_iterations,
    )
    n_mb = R // mb

    def order(key):
        if n_mb == 1:
            return jnp.broadcast_to(jnp.arange(R, dtype=jnp.int32), (iters, 1, R))

        def one(k):
            perm = jax.random.permutation(k, R // g)[:, None] * g + jnp.arange(g)
            return perm.reshape(n_mb, mb).astype(jnp.int32)

        return jnp.stack([one(k) for k in jax.random.split(key, iters)])

    return order


def _train_fn(exp: Experiment, update):
    """``train(state, batch, key, plan=None) -> (state, metrics)``: ``num_iterations`` passes
    over the batch in mini-batches (`minibatch_order` of ``key``), all on device
    (``lax.scan``); with one mini-batch the batch is used as it is.

    ``plan``: a `packing.StepPlan` (its ``rows`` are `minibatch_order`'s, computed on the host
    with the same key): every update runs on packed micro-batches. Metrics: the mean over all
    updates of each update metric, ``skipped_updates`` (int32 count), ``learning_rate`` (the
    policy's, at the step's last applied update: `state.last_learning_rate`), and
    ``per_rollout_loss`` [R] float32 of the first pass, in row order (the controllers' signal).
    """
    R = exp.batching.rollouts_per_step
    n_mb = R // exp.batching.mini_batch_size
    order = minibatch_order(exp)
    schedule = make_schedule(exp.run.optimizer, total_updates(exp.run, exp.batching))

    def train(state, batch, key, plan=None):
        idx = order(key) if plan is None else plan.rows
        micro = None if plan is None else plan.micro

        def one_pass(state, xs):
            rows, mbs = xs
            if n_mb == 1:
                state, m = update(state, batch, jax.tree.map(lambda x: x[0], mbs))
                return state, jax.tree.map(lambda x: x[None], m)
            take = lambda s, a: update(s, _take(exp.mesh, batch, a[0]), a[1])
            return jax.lax.scan(take, state, (rows, mbs))

        first_pass = jax.tree.map(lambda x: x[0], (idx, micro))
        state, first = one_pass(state, first_pass)
        passes = [first]
        if idx.shape[0] > 1:
            rest_xs = jax.tree.map(lambda x: x[1:], (idx, micro))
            state, rest = jax.lax.scan(one_pass, state, rest_xs)
            passes.append(jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), rest))
        out = {}
        for k in first:
            if k == "per_rollout_loss":
                continue
            v = jnp.concatenate([m[k].reshape(-1) for m in passes])
            if k == "update_ok":
                out["skipped_updates"] = jnp.sum(~v)
            else:
                out[k] = jnp.mean(v)
        out["per_rollout_loss"] = (
            jnp.zeros((R,), jnp.float32)
            .at[idx[0].reshape(-1)]
            .set(first["per_rollout_loss"].reshape(-1))
        )
        lr = last_learning_rate(schedule, state.opt_state)
        if lr is not None:
            out["learning_rate"] = lr
        return state, out

    return train


def packing_shape(exp: Experiment, length: int) -> tuple[int, int]:
    """(T, k) of the packed passes over rows of ``length`` tokens: buffers of T = length - 1
    tokens (the longest model input, so every row fits whole) and k buffers per micro-batch:
    ``algorithm.micro_batch_tokens // T`` (0: ``micro_batch_size`` rows' worth, the padded
    micro-batch's tokens), at least 1, rounded up to a multiple of the mesh's data x fsdp
    shards (every shard gets whole buffers)."""
    T, div = int(length) - 1, sharding.batch_divisor(exp.mesh)
    budget = exp.batching.micro_batch_tokens or exp.batching.micro_batch_size * T
    return T, -(-max(1, budget // T) // div) * div


def packed_logprob_plan(exp: Experiment, attention_mask) -> packing.MicroBatches:
    """The reference / old-log-prob pass's packed micro-batches for a batch (host; ``attention_mask``
    host [R, L] bool). Raises: ValueError as `packing.micro_batches`."""
    T, k = packing_shape(exp, attention_mask.shape[1])
    return packing.micro_batches(
        *packing.spans(attention_mask),
        T,
        k,
        multiple=sharding.batch_divisor(exp.mesh),
        scored=_scored_completions(exp, attention_mask),
    )


def _scored_completions(exp: Experiment, attention_mask):
    """`packing.micro_batches`' ``scored`` of our layout: completion token c of a row is scored
    at input position Lp - 1 + c, for its real tokens (host [R, L] mask; contiguous from Lp)."""
    return exp.prompt_len - 1, np.asarray(attention_mask)[:, exp.prompt_len :].sum(axis=1)


def packed_step_plan(exp: Experiment, attention_mask, rows) -> packing.StepPlan:
    """The packed update's plan for a batch (host): ``rows`` = `Steps.minibatch_order` of the
    step's shuffle key. Raises: ValueError as `packing.step_plan` (a row would be dropped)."""
    T, k = packing_shape(exp, attention_mask.shape[1])
    scored, div = _scored_completions(exp, attention_mask), sharding.batch_divisor(exp.mesh)
    return packing.step_plan(attention_mask, rows, T, k, multiple=div, scored=scored)


# ----------------------------------------------------------------------------- the bundle


@dataclasses.dataclass(frozen=True)
class Steps:
    """The jitted programs of one RL step (built once per run by `make_steps`).

    Attributes:
      generate: ``(params, prompt_tokens [r, Lp] int32, prompt_mask [r, Lp] bool, key) ->
        sampling.Rollouts`` with the run's training `SamplingConfig`.
      advantages: ``(rewards [R] float32, segment_ids [R] int32) -> (advantages [R] float32,
        stats)`` (group-relative estimator of ``config.algorithm``).
      logprobs: ``(params, tokens [R, L] int32, attention_mask [R, L] bool, micro_batches=None)
        -> [R, Lc]`` (reference / old log-probs, a micro-batch of rows at a time; of packed
        micro-batches when given a `packing.MicroBatches` (`packed_logprob_plan`)).
      finish_batch: ``(state, batch, rewards [R]) -> batch`` (the learner's; PPO: GAE).
      update: ``(state, batch, micro_batches=None) -> (state, metrics)``: one mini-batch step,
        donated state (packed with the batch's `packing.MicroBatches`).
      train: ``(state, batch, key, plan=None) -> (state, metrics)``: all passes and
        mini-batches of a step on device, donated state (metrics and ``plan``, a
        `packing.StepPlan` for the packed update, as `_train_fn`).
      minibatch_order: ``key -> [num_iterations, N, mini_batch_size] int32``, the rows of each
        mini-batch `train` uses for that key (`minibatch_order`; the packed update's plan reads
        it on the host).
      shape_rewards: ``(rewards [R] float32, lengths [R] int32) -> [R] float32``: DAPO's soft
        overlong punishment added when ``algorithm.overlong_penalty_factor`` (else unchanged).
      masks: ``(prompt_mask [R, Lp] bool, completion_mask [R, Lc], truncated [R] bool,
        loss_mask [R, Lc] | None) -> (attention_mask [R, Lp + Lc] bool, loss mask [R, Lc])``
        (the loss mask is ``loss_mask`` when given (multi-turn episodes), else the completion
        mask; DAPO overlong filtering zeroes truncated rows when ``algorithm.overlong_filtering``).
      generate_turn: ``(params, tokens [r, W] int32, mask [r, W] bool, key, max_lengths [r]
        int32) -> sampling.Rollouts``: one policy turn of multi-turn episodes
        (``exp.turn_sampling``; None without ``config.env.name``).
      take: ``(tree, idx [n] int32) -> tree`` rows laid out over the batch sharding.
      concat: ``([tree, ...]) -> tree`` joined along the rows, over the batch sharding.
      to_generation: ``params -> params`` in the sampler's layout
        (`generation_layout.for_experiment`: `generation_layout.reshard`, once per sampling
        round before `generate`; the identity in the training layout). `generate` takes the
        parameters in that layout and returns the rollouts in the training batch sharding.
    """

    generate: Callable
    advantages: Callable
    logprobs: Callable
    finish_batch: Callable
    update: Callable
    train: Callable
    shape_rewards: Callable
    masks: Callable
    take: Callable
    concat: Callable
    to_generation: Callable
    minibatch_order: Callable
    generate_turn: Callable | None = None


@dataclasses.dataclass(frozen=True)
class _PlanLast:
    """A jitted program whose last argument, a packing plan, may be left out (None: padded).
    ``jax.jit``'s ``in_shardings`` need every positional argument, so the call fills it in;
    ``lower`` as the jitted function's (`experiments.aot`)."""

    jitted: Callable
    num_args: int

    def __call__(self, *args):
        return self.jitted(*args, *(None,) * (self.num_args - len(args)))

    def lower(self, *args):
        return self.jitted.lower(*args, *(None,) * (self.num_args - len(args)))


def _in_generation_layout(mesh, gen_mesh, sample: Callable) -> Callable:
    """``sample`` (run under ``gen_mesh``) with its prompts and key moved onto that mesh's rows
    and its rollouts back onto the training ``mesh``'s (the same devices: `device_put`s)."""

    def put(tree, m):
        return jax.tree.map(
            lambda x: jax.device_put(
                x, sharding.batch_sharding(m, x.ndim) if x.ndim else sharding.replicated(m)
            ),
            tree,
        )

    def generate(params, prompt_tokens, prompt_mask, key):
        tokens, mask = put((prompt_tokens, prompt_mask), gen_mesh)
        key = jax.device_put(key, sharding.replicated(gen_mesh))
        return put(sample(params, tokens, mask, key), mesh)

    return generate


def make_steps(exp: Experiment) -> Steps:
    """Jits the step's programs for ``exp`` (nothing is compiled until first called)."""
    algo = exp.run.algorithm
    P = exp.run.rollout.prompts_per_step
    mesh = exp.mesh
    batch_sh, replicated = sharding.batch_sharding(mesh), sharding.replicated(mesh)
    update = _update_fn(exp)

    def sample(params, prompt_tokens, prompt_mask, key):
        return sampling.generate(
            exp.graphdef, params, prompt_tokens, prompt_mask, key, exp.train_sampling
        )

    generate, to_generation = sharding.under_mesh(mesh, sample), (lambda params: params)
    gen_mesh, gen_shardings = generation_layout.for_experiment(exp)
    if gen_mesh is not None:
        generate = _in_generation_layout(mesh, gen_mesh, sharding.under_mesh(gen_mesh, sample))
        to_generation = functools.partial(
            generation_layout.reshard, shardings=gen_shardings, dtype=exp.model_config.dtype
        )

    def logprobs(params, tokens, attention_mask, micro_batches=None):
        kw = dict(
            prompt_len=exp.prompt_len,
            temperature=float(exp.run.rollout.temperature),
            logprob_chunk_size=logprob_chunk_size(exp),
        )
        if micro_batches is not None:
            return packed_completion_logprobs(
                exp.graphdef, params, tokens, micro=micro_batches, **kw
            )
        return chunked_completion_logprobs(
            exp.graphdef,
            params,
            tokens,
            attention_mask,
            rows_per_chunk=exp.batching.micro_batch_size,
            group_size=exp.batching.prompt_group_size,
            **kw,
        )

    def shape_rewards(rewards, lengths):
        if not algo.overlong_penalty_factor:
            return rewards
        penalty = advantages_lib.overlong_penalty(  # DAPO (Yu et al. 2025, Eq. 13)
            lengths, exp.max_new_tokens, algo.overlong_cache_tokens, algo.overlong_penalty_factor
        )
        return rewards + penalty

    def masks(prompt_mask, completion_mask, truncated, loss_mask=None):
        attention_mask = jnp.concatenate([prompt_mask, completion_mask > 0], axis=1)
        loss_mask = completion_mask if loss_mask is None else loss_mask
        if algo.overlong_filtering:  # DAPO: truncated completions carry no loss
            return attention_mask, losses.overlong_filter(loss_mask, truncated)
        return attention_mask, loss_mask

    def generate_turn(params, tokens, mask, key, max_lengths):
        return sampling.generate(
            exp.graphdef, params, tokens, mask, key, exp.turn_sampling, max_lengths
        )

    def concat(parts):
        return jax.tree.map(
            lambda *a: jax.lax.with_sharding_constraint(
                jnp.concatenate(a), sharding.batch_sharding(mesh, a[0].ndim)
            ),
            *parts,
        )

    return Steps(
        generate=generate,
        advantages=jax.jit(
            functools.partial(
                advantages_lib.compute,
                num_segments=P,
                cfg=dataclasses.replace(algo.advantage, nonfinite="mask"),
            )
        ),
        logprobs=jax.jit(sharding.under_mesh(mesh, logprobs)),
        # out_shardings: the batch `train` / `update` take (their in_shardings), whatever
        # layout the rollouts, advantages and curriculum weights came in (e.g. replicated)
        finish_batch=jax.jit(
            sharding.under_mesh(mesh, exp.learner.finish_batch), out_shardings=batch_sh
        ),
        update=_PlanLast(
            jax.jit(
                sharding.under_mesh(mesh, update),
                in_shardings=(exp.state_shardings, batch_sh, replicated),
                out_shardings=(exp.state_shardings, None),
                donate_argnums=0,
            ),
            3,
        ),
        train=_PlanLast(
            jax.jit(
                sharding.under_mesh(mesh, _train_fn(exp, update)),
                in_shardings=(exp.state_shardings, batch_sh, replicated, replicated),
                out_shardings=(exp.state_shardings, None),
                donate_argnums=0,
            ),
            4,
        ),
        minibatch_order=jax.jit(minibatch_order(exp)),
        shape_rewards=jax.jit(shape_rewards),
        masks=jax.jit(masks),
        take=jax.jit(functools.partial(_take, mesh)),
        concat=jax.jit(concat),
        to_generation=to_generation,
        generate_turn=sharding.under_mesh(mesh, generate_turn) if exp.environment else None,
    )


# ----------------------------------------------------------------------------- set-up


def init_train_state(exp: Experiment) -> TrainState:
    """The initial train state, made by one jitted init directly in ``exp.state_shardings``."""
    with exp.mesh_context():
        return jax.jit(exp.state_init_fn, out_shardings=exp.state_shardings)()


def abstract_run_state(exp: Experiment) -> RunState:
    """The checkpoint tree the trainer saves, as shapes and shardings (nothing allocated): the
    template every restore of a run's checkpoint reads it with (`Checkpointer.restore_latest`).
    """
    return RunState(
        train=exp.abstract_state,
        controllers=checkpointing.abstract_like(exp.curriculum.init()),
        ref_params=exp.abstract_state.params if exp.uses_reference else None,
        in_flight=rollout_queue.abstract(exp),
    )


def init_run(exp: Experiment, *, params=None, warm_start: bool = True) -> tuple[RunState, dict]:
    """A run's initial state: parameters, the supervised warm start, reference and controllers.

    Args:
      exp: the built experiment.
      params: start from these policy parameters (a pure dict, e.g. a shared warm start)
        instead of the model's initialisation; the optimizer state is fresh either way.
      warm_start: run ``config.sft`` (when ``sft.steps > 0`` and ``params`` is None).
    Returns:
      (RunState, sft metrics dict: empty without a warm start). The reference is a copy of the
      starting policy (after the warm start) when ``config.algorithm.kl_coef > 0``.
    """
    state = init_train_state(exp)
    sft_metrics = {}
    if params is None and warm_start and exp.run.sft.steps > 0:
        params, sft_metrics = supervised_warmstart(exp, state.params)
    if params is not None:
        state = jax.device_put(
            state.replace(params=params, opt_state=exp.opt_init(params)), exp.state_shardings
        )
    ref = jax.tree.map(jnp.copy, state.params) if exp.uses_reference else None
    return RunState(train=state, controllers=exp.curriculum.init(), ref_params=ref), sft_metrics


def supervised_warmstart(exp: Experiment, params) -> tuple[Any, dict]:
    """Short supervised fine-tuning on (prompt, gold answer) pairs before RL (``config.sft``).

    Used by the embedded default so RL starts from a policy that knows the answer format (a
    model at 0% reward gets no GRPO signal). Returns (params, metrics).

    With LoRA the warm start trains the base (the "pretrained" weights the adapters then sit
    on; the fresh adapters, B = 0, are the identity and stay as initialised).
    """
    cfg = exp.run.sft
    tokens, mask, target_mask = exp.sft_data()
    n = tokens.shape[0]
    tx = optax.adamw(cfg.learning_rate, b1=0.9, b2=0.99, weight_decay=0.0)
    if (exp.run.model.param_dtype or "float32") != "float32":
        tx = master_weights(tx)
    adapters = None
    if exp.lora:
        params, adapters = lora_lib.split(params)
    opt_state = tx.init(params)
    graphdef = exp.graphdef
    # one compilation: the state goes in committed and leaves as it came in (else the second call
    # compiles again: the optimizer's uncommitted step count, and output specs XLA chose, P() for
    # P(None, None), are other argument shardings)
    rep = sharding.replicated(exp.mesh)
    state_sh = jax.tree.map(
        lambda x: x.sharding if isinstance(x.sharding, jax.sharding.NamedSharding) else rep,
        (params, opt_state),
    )
    params, opt_state = jax.device_put((params, opt_state), state_sh)

    @functools.partial(jax.jit, donate_argnums=(0, 1), out_shardings=(*state_sh, None))
    def step(params, opt_state, tok, msk, tmask):
        def loss_fn(p):
            if adapters is not None:
                p = lora_lib.combine(p, adapters)
            model = nnx.merge(graphdef, p)
            logits, _ = model(tok[:, :-1], positions_from_mask(msk)[:, :-1], msk[:, :-1])
            lp = logprobs_lib.logprobs_from_logits(logits, tok[:, 1:])
            m = tmask[:, 1:]
            return -(lp * m).sum() / jnp.maximum(m.sum(), 1.0)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        params, opt_state = apply_optimizer(tx, grads, opt_state, params)
        return params, opt_state, loss

    gen = np.random.default_rng(exp.run.seed + 1)
    t0 = time.perf_counter()
    loss = float("nan")
    iterator = range(cfg.steps)
    if exp.run.logging.progress_bar and jax.process_index() == 0:
        from tqdm.auto import tqdm

        iterator = tqdm(iterator, desc="warm start", dynamic_ncols=True, leave=False)
    for _ in iterator:
        idx = gen.choice(n, size=cfg.batch_size, replace=n < cfg.batch_size)
        params, opt_state, loss = step(
            params,
            opt_state,
            jnp.asarray(tokens[idx]),
            jnp.asarray(mask[idx]),
            jnp.asarray(target_mask[idx]),
        )
    if adapters is not None:
        params = lora_lib.combine(params, adapters)
    return params, {
        "sft_loss": float(loss),
        "sft_seconds": time.perf_counter() - t0,
        "sft_steps": cfg.steps,
    }
