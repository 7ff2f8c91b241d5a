"""Where grpo_jax's update time goes on the peer workload: timers around its pieces.

  python benchmarks/peers/profile_grpo_jax.py --prompts=4 --samples=8 \
      --max_new_tokens=64 --repeats=3

On a synthetic batch of the workload's shape ([R, Lp + Lc] tokens, all completion tokens
real), times separately (jitted, median of `--repeats`, after a compile call):
  forward        the reference log-prob pass (`steps.make_steps(exp).logprobs`)
  loss+grad      `jax.value_and_grad` of the same GRPO loss the update uses
  optimizer      clip + AdamW (`exp.tx.update` + `optax.apply_updates`) on given gradients
  guard          the update's non-finite guard (`_all_finite` over the new parameters and
                 the three `_select`s over parameters and optimizer state)
  update         the whole jitted update (`steps.make_steps(exp).update`), donated state
so that update ~ loss+grad + optimizer + guard shows what the non-gradient parts cost; and
the forward and loss+grad with the LM head ([E, V] product + log-softmax) applied to the
completion positions only (`return_hidden=True` + `model.logits` on the last Lc rows) instead
of to every position, the change this profile suggests for `steps.completion_logprobs` (since
adopted: it now projects the completion positions only).
`--trace_dir` additionally writes a jax.profiler trace of one update call.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common

sys.path.insert(0, common.REPO)


def timeit(fn, repeats):
    import jax

    jax.block_until_ready(fn())  # compile
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main(argv=None):
    parser = common.add_workload_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--trace_dir", default="")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    import run_grpo_jax

    from grpo_jax import logprobs as logprobs_lib
    from grpo_jax import losses, steps
    from grpo_jax.experiment import build_experiment
    from grpo_jax.models.transformer import positions_from_mask
    from grpo_jax.state import Batch

    prompts = common.load_prompts(args.prompts)
    lp = max(len(p["ids"]) for p in prompts)
    exp = build_experiment(run_grpo_jax.make_config(args, lp))
    state = steps.init_train_state(exp)
    fns = steps.make_steps(exp)
    R, lc = args.prompts * args.samples, args.max_new_tokens
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(
        np.concatenate(
            [
                np.repeat(exp.pool.tokens, args.samples, 0),
                rng.integers(3, exp.model_config.vocab_size, (R, lc)),
            ],
            1,
        ).astype(np.int32)
    )
    mask = jnp.asarray(
        np.concatenate([np.repeat(exp.pool.mask, args.samples, 0), np.ones((R, lc), bool)], 1)
    )
    cmask = jnp.ones((R, lc), jnp.float32)
    adv = jnp.asarray(rng.standard_normal(R).astype(np.float32))
    logprobs_fn = fns.logprobs
    ref = logprobs_fn(state.params, tokens, mask)
    batch = Batch(
        tokens=tokens,
        attention_mask=mask,
        completion_mask=cmask,
        advantages=adv,
        sample_weights=jnp.ones((R,), jnp.float32),
        old_logprobs=ref,
        ref_logprobs=ref,
        sampler_logprobs=ref,
    )
    cfg = exp.run.algorithm
    T = float(exp.run.rollout.temperature)

    def sliced_logprobs(graphdef, params, tokens, mask, prompt_len, temperature):
        """Proposed completion_logprobs: the [.., V] head only on the Lc completion positions."""
        from flax import nnx

        model = nnx.merge(graphdef, params)
        positions = positions_from_mask(mask)
        h, _ = model(tokens[:, :-1], positions[:, :-1], mask[:, :-1], return_hidden=True)
        logits = model.logits(h[:, prompt_len - 1 :])
        return logprobs_lib.logprobs_from_logits(logits, tokens[:, prompt_len:], temperature)

    def loss_fn(params, logprob_fn=steps.completion_logprobs):  # as in the update (steps.py)
        lps = logprob_fn(exp.graphdef, params, tokens, mask, lp, T)
        loss, _ = losses.policy_loss(
            lps,
            jax.lax.stop_gradient(lps),
            adv,
            cmask,
            dataclasses.replace(cfg.loss, max_len=exp.max_new_tokens),
            ref_logprobs=ref,
            sample_weights=batch.sample_weights,
        )
        return loss

    grad_fn = jax.jit(jax.value_and_grad(loss_fn))
    grad_sliced_fn = jax.jit(jax.value_and_grad(lambda p: loss_fn(p, sliced_logprobs)))
    fwd_sliced = jax.jit(lambda p: sliced_logprobs(exp.graphdef, p, tokens, mask, lp, T))
    np.testing.assert_allclose(
        np.asarray(fwd_sliced(state.params)), np.asarray(ref), atol=1e-4, rtol=1e-4
    )
    _, grads = grad_fn(state.params)

    @jax.jit
    def opt_fn(params, opt_state, grads):
        updates, opt_state = exp.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    @jax.jit
    def guard_fn(new, old, opt_new, opt_old, loss, gnorm):
        ok = jnp.isfinite(loss) & jnp.isfinite(gnorm) & steps._all_finite(new)
        return (steps._select(ok, new, old), steps._select(ok, opt_new, opt_old))

    new_params, new_opt = opt_fn(state.params, state.opt_state, grads)
    update = fns.update
    holder = {"state": state}

    def run_update():
        holder["state"], m = update(holder["state"], batch)
        return m["loss"]

    times = {
        "forward (reference pass)": timeit(
            lambda: logprobs_fn(state.params, tokens, mask), args.repeats
        ),
        "forward, head on completion only": timeit(lambda: fwd_sliced(state.params), args.repeats),
        "loss+grad": timeit(lambda: grad_fn(state.params), args.repeats),
        "loss+grad, head on completion only": timeit(
            lambda: grad_sliced_fn(state.params), args.repeats
        ),
        "optimizer (clip+AdamW)": timeit(
            lambda: opt_fn(state.params, state.opt_state, grads), args.repeats
        ),
        "non-finite guard": timeit(
            lambda: guard_fn(
                new_params,
                state.params,
                new_opt,
                state.opt_state,
                jnp.float32(1.0),
                jnp.float32(1.0),
            ),
            args.repeats,
        ),
    }
    # the update donates its state: run it on a copy so the arrays above stay valid
    holder["state"] = jax.tree.map(jnp.copy, state)
    times["whole update (steps.update)"] = timeit(run_update, args.repeats)
    if args.trace_dir:
        jax.profiler.start_trace(args.trace_dir)
        jax.block_until_ready(run_update())
        jax.profiler.stop_trace()
    tok = int(np.asarray(mask).sum())
    print(
        f"R={R} rows x {lp + lc} positions ({tok} real tokens), {args.repeats} repeats, median s:"
    )
    for k, v in times.items():
        print(f"  {k:<32}{v:8.3f}")
    parts = times["loss+grad"] + times["optimizer (clip+AdamW)"] + times["non-finite guard"]
    print(f"  {'sum of the three parts':<32}{parts:8.3f}")
    exp.close()


if __name__ == "__main__":
    main()
