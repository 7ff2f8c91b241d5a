"""Google Tunix's GRPOLearner (JAX) on the peer-comparison workload (see common.py).

Run with the Tunix venv made by setup_envs.sh:

  ~/.cache/grpo_jax/peers/tunix/bin/python benchmarks/peers/run_tunix.py --out=/tmp/peers/tunix.json

The model is Tunix's own Llama3 implementation (`tunix.models.llama3`) built with SmolLM2's
shape (30 layers, d 576, 9 query / 3 KV heads of 64, MLP 1536, vocab 49152, RoPE theta 1e5,
RMSNorm eps 1e-5, tied embeddings) and loaded from the same float32 safetensors with Tunix's
`create_model_from_safe_tensors`. Policy, rollout (the vanilla Tunix sampler) and reference
share one single-device mesh (colocated; actor and rollout share weights; the reference is a
second copy). One global step = `--prompts` prompts x `--samples` generations, one mini-batch,
one optimizer step (AdamW lr 1e-6, grad-norm clip 1.0), beta = kl_coef, the same reward.

Equalised (see the result's notes):
  * Tunix 0.1.7's Llama3 attention calls `apply_rope` without the config's `rope_theta`, so
    every Llama3 model gets the default theta 1e6 (SmolLM2 needs 1e5). The module-level
    `apply_rope` is patched to use the config's theta (no speed effect; fixes the logits).
  * SmolLM2's pad id is its eos <|im_end|> (2), which occurs inside every chat prompt, and
    Tunix masks every pad-id token (attention and positions); Tunix's tokenizer gets
    pad = <|endoftext|> (0) instead.
  * loss_agg_mode "token-mean" (Tunix's default is sequence-mean-token-mean) and the k3 KL
    estimator ("low_var_kl"; Tunix's default "kl" is k1), as grpo_jax and TRL are run.
    Tunix 0.1.7's GRPOConfig has no epsilon_high (symmetric 0.2 clip), which does not matter
    here: with one on-policy update the ratio is exactly 1.

Timing: wrappers around the learner's global step, `rl_cluster.generate` (sampling),
`_compute_rewards`, `rl_cluster.get_ref_per_token_logps` and `rl_cluster.update_actor`.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common


def smollm2_config(llama_lib, hf: dict):
    """Tunix Llama3 ModelConfig with SmolLM2-135M's shape (from the checkpoint's config.json)."""
    return llama_lib.ModelConfig(
        num_layers=hf["num_hidden_layers"],
        vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"],
        num_heads=hf["num_attention_heads"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        num_kv_heads=hf["num_key_value_heads"],
        rope_theta=int(hf["rope_theta"]),
        norm_eps=hf["rms_norm_eps"],
        weight_tying=bool(hf.get("tie_word_embeddings", False)),
    )


def _tokenizer(transformers, mdir: str, prompts: list[dict]):
    """The transformers tokenizer of ``mdir``, checked to give prompts.json's ids."""
    tok = transformers.AutoTokenizer.from_pretrained(mdir)
    # Tunix masks every pad-id token (attention mask and positions = tokens != pad); SmolLM2's pad
    # is its eos <|im_end|>, which also occurs inside chat prompts: pad with <|endoftext|> instead.
    tok.pad_token = "<|endoftext|>"
    if (
        tok.pad_token_id in {i for p in prompts for i in p["ids"]}
        or tok.pad_token_id == tok.eos_token_id
    ):
        raise SystemExit("no pad id free of the prompts for Tunix")
    for i, p in enumerate(prompts):
        if tok.encode(p["text"]) != p["ids"]:
            raise SystemExit(
                f"prompt {i}: the transformers tokenizer gives other ids than prompts.json"
            )
    return tok


def main(argv=None):
    parser = common.add_workload_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument(
        "--no_rope_fix",
        action="store_true",
        help="keep Tunix's apply_rope default theta (1e6) instead of the config's",
    )
    args = parser.parse_args(argv)

    import json

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    import transformers
    import tunix
    from tunix.models.llama3 import model as llama_lib
    from tunix.models.llama3 import params as llama_params
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout
    from tunix.sft import metrics_logger

    prompts = common.load_prompts(args.prompts)
    mdir = common.model_dir()
    with open(os.path.join(mdir, "config.json"), encoding="utf-8") as f:
        hf = json.load(f)
    cfg = smollm2_config(llama_lib, hf)
    notes = []
    if not args.no_rope_fix:
        llama_lib.apply_rope = functools.partial(llama_lib.apply_rope, rope_theta=cfg.rope_theta)
        notes.append(
            "Tunix Llama3 attention ignores config.rope_theta (uses apply_rope's default "
            "1e6); patched to SmolLM2's 1e5"
        )
    tok = _tokenizer(transformers, mdir, prompts)

    # a plain Mesh (Auto axes; jax.make_mesh's default Explicit axes break Tunix's embedding gather)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    with mesh:
        policy = llama_params.create_model_from_safe_tensors(mdir, cfg, mesh, dtype=jnp.float32)
        reference = llama_params.create_model_from_safe_tensors(mdir, cfg, mesh, dtype=jnp.float32)

    ids0 = np.asarray([prompts[0]["ids"]], np.int32)
    n0 = ids0.shape[1]
    with mesh:
        logits0, _ = policy(
            ids0, np.arange(n0, dtype=np.int32)[None], None, np.tril(np.ones((1, n0, n0), bool))
        )
    nll0 = common.prompt_nll(np.asarray(logits0[0]), prompts[0]["ids"])
    extra = {"prompt0_nll": nll0}
    if not args.no_rope_fix:  # the same check with Tunix's unpatched RoPE (theta 1e6)
        patched, llama_lib.apply_rope = llama_lib.apply_rope, llama_lib.apply_rope.func
        with mesh:
            logits_u, _ = policy(
                ids0, np.arange(n0, dtype=np.int32)[None], None, np.tril(np.ones((1, n0, n0), bool))
            )
        llama_lib.apply_rope = patched
        extra["prompt0_nll_unpatched_rope"] = common.prompt_nll(
            np.asarray(logits_u[0]), prompts[0]["ids"]
        )
    print(f"[tunix] prompt 0 NLL {extra}", flush=True)

    prompt_len = max(len(p["ids"]) for p in prompts)
    prompt_tokens_per_step = args.samples * sum(len(p["ids"]) for p in prompts)
    total = args.warmup + args.steps
    mb_prompts = common.micro_batch_rows(args) // args.samples
    logdir = tempfile.mkdtemp(prefix="tunix_peers_")
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(args.learning_rate, b1=0.9, b2=0.999, weight_decay=0.0),
    )
    training_config = rl_cluster_lib.RLTrainingConfig(
        actor_optimizer=tx,
        eval_every_n_steps=10**9,
        max_steps=total,
        # batch sizes in prompts (x num_generations rows): one optimizer step per batch, the
        # update and the reference pass in micro-batches of --micro_batch rows, generation whole
        mini_batch_size=args.prompts,
        train_micro_batch_size=mb_prompts,
        rollout_micro_batch_size=args.prompts,
        compute_logps_micro_batch_size=mb_prompts,
        metrics_logging_options=metrics_logger.MetricsLoggerOptions(
            log_dir=logdir, flush_every_n_steps=1
        ),
        checkpoint_root_directory=None,
    )
    rollout_config = base_rollout.RolloutConfig(
        max_tokens_to_generate=args.max_new_tokens,
        max_prompt_length=prompt_len,
        # Tunix's sampler needs max_prompt_length + max_tokens_to_generate <= kv_cache_size
        # (generate/sampler.py) and writes no slot beyond it: no slack needed
        kv_cache_size=prompt_len + args.max_new_tokens,
        temperature=args.temperature,
        top_p=1.0,
        top_k=None,
        eos_tokens=[tok.eos_token_id],
        data_type=jnp.float32,
    )
    cluster_config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={
            rl_cluster_lib.Role.ACTOR: mesh,
            rl_cluster_lib.Role.REFERENCE: mesh,
            rl_cluster_lib.Role.ROLLOUT: mesh,
        },
        rollout_engine="vanilla",
        offload_to_cpu=False,
        training_config=training_config,
        rollout_config=rollout_config,
    )
    cluster = rl_cluster_lib.RLCluster(
        actor=policy, reference=reference, tokenizer=tok, cluster_config=cluster_config
    )
    algo = grpo_learner.GRPOConfig(
        num_generations=args.samples,
        num_iterations=1,
        beta=args.kl_coef,
        kl_loss_mode="low_var_kl",
        epsilon=0.2,
        loss_agg_mode="token-mean",
    )
    reward = common.reward_fn()

    def gsm8k_reward(prompts, completions, answer, **kwargs):  # Tunix reward-function signature
        del prompts, kwargs
        rewards, _, _ = reward([str(c) for c in completions], [str(a) for a in answer])
        return [float(r) for r in rewards]

    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster, algo_config=algo, reward_fns=[gsm8k_reward], data_shuffle_seed=args.seed
    )

    timer = common.Timer()
    counts = {}
    steps: list[dict] = []

    def timed(name, fn, after=None):
        def wrapped(*a, **k):
            with timer(name):
                out = fn(*a, **k)
                if after is not None:
                    after(out)
            return out

        return wrapped

    def count_rollout(out):
        counts["completion"] = int(sum(len(t) for t in out.tokens))
        # the sampler's prompt width (it pads to max_prompt_length, or to the next power of 2 if
        # a tokenized prompt were longer, e.g. with an added BOS)
        counts["prompt_width"] = int(np.asarray(out.left_padded_prompt_tokens).shape[-1])

    cluster.generate = timed("generate", cluster.generate, count_rollout)
    cluster.get_ref_per_token_logps = timed(
        "reference", cluster.get_ref_per_token_logps, jax.block_until_ready
    )
    cluster.update_actor = timed(
        "update",
        cluster.update_actor,
        lambda _: jax.block_until_ready(nnx_state(cluster.actor_trainer.model)),
    )
    learner._compute_rewards = timed("reward", learner._compute_rewards)
    run_global_step = learner._run_global_step

    def nnx_state(model):
        from flax import nnx

        return nnx.state(model)

    def global_step(*a, **k):
        timer.pop()
        t0 = time.perf_counter()
        out = run_global_step(*a, **k)
        jax.block_until_ready(nnx_state(cluster.actor_trainer.model))
        wall = time.perf_counter() - t0
        ph = timer.pop()
        step = {
            "step_s": wall,
            "generate_s": ph.get("generate", 0.0),
            "reward_s": ph.get("reward", 0.0),
            "reference_s": ph.get("reference", 0.0),
            "update_s": ph.get("update", 0.0),
            "other_s": wall - sum(ph.values()),
            "generated_tokens": counts.get("completion", 0),
            "update_tokens": counts.get("completion", 0) + prompt_tokens_per_step,
            "prompt_width": counts.get("prompt_width", 0),
        }
        steps.append(step)
        print(
            f"[tunix] step {len(steps) - 1}: "
            + ", ".join(
                f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in step.items()
            ),
            flush=True,
        )
        return out

    learner._run_global_step = global_step

    # numpy arrays: the learner repeats each leaf num_generations times with jax.tree.map
    batch = {
        "prompts": np.array([p["text"] for p in prompts]),
        "answer": np.array([p["answer"] for p in prompts]),
    }
    learner.train([dict(batch) for _ in range(total)])
    reward.close()
    if "prompt0_nll_unpatched_rope" in extra:
        notes.append(
            f"prompt-0 NLL {extra['prompt0_nll']:.5f} with the RoPE fix, "
            f"{extra['prompt0_nll_unpatched_rope']:.5f} with Tunix's unpatched RoPE"
        )
    notes += [
        "loss_agg_mode token-mean (Tunix default sequence-mean-token-mean); KL estimator "
        "low_var_kl = k3 (Tunix default 'kl' = k1); no epsilon_high in Tunix 0.1.7's GRPOConfig "
        "(symmetric 0.2 clip; no effect here: one on-policy step has ratio 1)",
        f"rollout: Tunix vanilla sampler, prompts left-padded to {prompt_len}, KV cache "
        f"{rollout_config.kv_cache_size} slots = prompt + max_new_tokens (before 2026-12-01: "
        "+ 256 slots of slack, which Tunix does not need: its sampler only checks prompt + "
        "max_new_tokens <= kv_cache_size); every decode step attends to all "
        f"{rollout_config.kv_cache_size} slots under a mask; actor and rollout share weights, "
        "reference is a second copy",
        f"reference pass and update in micro-batches of {mb_prompts} prompts x {args.samples} "
        "(train_micro_batch_size = compute_logps_micro_batch_size; gradients accumulated "
        "into one optimizer step per mini-batch of all prompts); rollout_micro_batch_size = "
        "all prompts",
        "SmolLM2's pad id = eos id = 2 (<|im_end|>); Tunix builds attention masks and positions "
        "as tokens != pad, which would mask the <|im_end|> tokens inside the chat-template "
        "prompts: Tunix gets pad = <|endoftext|> (id 0, in no prompt) instead",
    ]
    try:
        version = tunix.__version__
    except AttributeError:
        from importlib.metadata import version as _v

        version = _v("google-tunix")
    widths = {s["prompt_width"] for s in steps if s.get("prompt_width")}
    if widths - {prompt_len}:
        notes.append(
            f"the sampler padded prompts to {sorted(widths)} tokens, not {prompt_len}: a tokenized "
            "prompt was longer than prompts.json's"
        )
    extra["settings"] = {
        "sampler": "Tunix vanilla sampler (jitted, static shapes)",
        "cache_len": rollout_config.kv_cache_size,
        "cache": f"static per-row cache: kv_cache_size = prompt {prompt_len} (max_prompt_length, "
        f"left-padded) + max_new_tokens {args.max_new_tokens}, all of it used: its decode loop "
        "also feeds the last generated token (sampling one more that is dropped, one decode step "
        "more than grpo_jax and TRL run); every step attends to all slots under a mask "
        f"(sampler prompt width seen: {sorted(widths) or '?'})",
        "prompt_pad": prompt_len,
        "generate_rows": args.prompts * args.samples,
        "micro_batch_rows": mb_prompts * args.samples,
        "optimizer_steps": 1,
        "remat": f"off (llama3 remat_config={getattr(cfg.remat_config, 'name', cfg.remat_config)})",
        "dtype": "float32 params and compute (create_model_from_safe_tensors dtype, "
        "RolloutConfig.data_type)",
    }
    common.write_result(
        args, "tunix", f"google-tunix {version} (jax {jax.__version__})", steps, notes, extra=extra
    )


if __name__ == "__main__":
    main()
