"""TRL's GRPOTrainer (PyTorch, CPU) on the peer-comparison workload (see common.py).

Run with the TRL venv made by setup_envs.sh:

  ~/.cache/grpo_jax/peers/trl/bin/python benchmarks/peers/run_trl.py --out=/tmp/peers/trl.json

Settings equalised with grpo_jax (TRL defaults that differ are overridden and listed in the
result's notes): float32 (TRL defaults to bf16), no gradient checkpointing (TRL defaults to
it on), no vLLM (transformers `generate`), num_generations = samples, one optimizer step per
batch of prompts x samples completions (per_device_train_batch_size = prompts x samples,
steps_per_generation = 1), beta = kl_coef with a reference model, loss_type "dapo" (token
mean, = grpo_jax's token-mean), epsilon 0.2 / epsilon_high 0.28 (grpo_jax's defaults), AdamW
lr 1e-6 constant, grad-norm clip 1.0, the same prompts (text from prompts.json, token ids
checked) and the same reward (grpo_jax's GSM8K verifier).

Timing: a TrainerCallback records each optimizer step's wall time (on_step_begin ->
on_step_end); `_generate_single_turn` (transformers generate), `_calculate_rewards` and the
reference model's log-prob pass are wrapped with timers; update = step - (generation + scoring
+ reference, i.e. `_generate_and_score_completions`).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common


def main(argv=None):
    parser = common.add_workload_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    args = parser.parse_args(argv)

    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback

    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = common.load_prompts(args.prompts)
    tok = AutoTokenizer.from_pretrained(common.model_dir())
    for i, p in enumerate(prompts):
        ids = tok(text=p["text"])["input_ids"]
        if ids != p["ids"]:
            raise SystemExit(
                f"prompt {i}: the transformers tokenizer gives other ids than prompts.json"
            )

    reward = common.reward_fn()

    def gsm8k_reward(prompts, completions, answer, **kwargs):  # TRL reward-function signature
        del prompts, kwargs
        rewards, _, _ = reward(list(completions), list(answer))
        return [float(r) for r in rewards]

    dataset = Dataset.from_list([{"prompt": p["text"], "answer": p["answer"]} for p in prompts])
    batch = args.prompts * args.samples
    mb = common.micro_batch_rows(args)
    accum = batch // mb  # TRL: generation batch = per_device x steps_per_generation = the batch
    outdir = tempfile.mkdtemp(prefix="trl_peers_")
    config = trl.GRPOConfig(
        output_dir=outdir,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        use_cpu=True,
        seed=args.seed,
        max_steps=args.warmup + args.steps,
        per_device_train_batch_size=mb,
        gradient_accumulation_steps=accum,
        steps_per_generation=accum,
        num_generations=args.samples,
        max_completion_length=args.max_new_tokens,
        temperature=args.temperature,
        top_p=1.0,
        top_k=0,
        beta=args.kl_coef,
        num_iterations=1,
        loss_type="dapo",
        epsilon=0.2,
        epsilon_high=0.28,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        bf16=False,
        fp16=False,
        # transformers 5.24 renamed gradient_checkpointing (a deprecated alias now, which TRL's
        # config still defaults to True) to activation_checkpointing: set both off
        activation_checkpointing=False,
        gradient_checkpointing=False,
        cache_implementation=None,  # transformers' default DynamicCache
        use_vllm=False,
        model_init_kwargs={"dtype": torch.float32},
        dataloader_num_workers=0,
        disable_tqdm=True,
    )

    timer = common.Timer()
    steps: list[dict] = []
    counts: dict = {}

    class StepTimes(TrainerCallback):
        def on_step_begin(self, *a, **k):
            timer.pop()
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            wall = time.perf_counter() - self.t0
            ph = timer.pop()
            gen, rew, ref = ph.get("generate", 0.0), ph.get("reward", 0.0), ph.get("reference", 0.0)
            score = ph.get("generate_and_score", 0.0)
            step = {
                "step_s": wall,
                "generate_s": gen,
                "reward_s": rew,
                "reference_s": ref,
                "update_s": wall - score,
                "other_s": score - gen - rew - ref,
                "generated_tokens": counts.get("completion", 0),
                "update_tokens": counts.get("completion", 0) + counts.get("prompt", 0),
                # generate's padded prompt width and decode steps (its DynamicCache ends at
                # prompt_width + completion_width - 1 slots)
                "prompt_width": counts.get("prompt_width", 0),
                "completion_width": counts.get("completion_width", 0),
            }
            steps.append(step)
            print(
                f"[trl] step {len(steps) - 1}: "
                + ", ".join(
                    f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in step.items()
                ),
                flush=True,
            )

    trainer = trl.GRPOTrainer(
        model=common.model_dir(),
        reward_funcs=[gsm8k_reward],
        args=config,
        train_dataset=dataset,
        processing_class=tok,
        callbacks=[StepTimes()],
    )

    with torch.no_grad():
        logits0 = (
            trainer.model(input_ids=torch.tensor([prompts[0]["ids"]])).logits[0].float().numpy()
        )
    nll0 = common.prompt_nll(logits0, prompts[0]["ids"])
    print(f"[trl] prompt 0 NLL {nll0:.5f}", flush=True)

    def wrap(name, fn, pick=None):
        def wrapped(*a, **k):
            key = pick(a, k) if pick else name
            if key is None:
                return fn(*a, **k)
            with timer(key):
                return fn(*a, **k)

        return wrapped

    trainer._generate_single_turn = wrap("generate", trainer._generate_single_turn)
    trainer._calculate_rewards = wrap("reward", trainer._calculate_rewards)
    trainer._get_per_token_logps_and_entropies = wrap(
        "reference",
        trainer._get_per_token_logps_and_entropies,
        pick=lambda a, k: (
            "reference" if (a[0] if a else k.get("model")) is trainer.ref_model else None
        ),
    )
    gen_and_score = trainer._generate_and_score_completions

    def counted(*a, **k):
        with timer("generate_and_score"):
            out = gen_and_score(*a, **k)
        counts["completion"] = int(out["completion_mask"].sum())
        counts["prompt"] = int(out["prompt_mask"].sum())
        counts["prompt_width"] = int(out["prompt_ids"].shape[1])
        counts["completion_width"] = int(out["completion_ids"].shape[1])
        return out

    trainer._generate_and_score_completions = counted

    trainer.train()
    reward.close()
    checkpointing = bool(
        trainer.model.is_activation_checkpointing
        if hasattr(trainer.model, "is_activation_checkpointing")
        else trainer.model.is_gradient_checkpointing
    )
    if checkpointing or trainer.args.activation_checkpointing:
        raise SystemExit("TRL ran with activation (gradient) checkpointing on")
    prompt_len = max(len(p["ids"]) for p in prompts)
    widths = [s["prompt_width"] + s["completion_width"] - 1 for s in steps if s["prompt_width"]]
    notes = [
        "TRL defaults overridden: bf16 -> float32, gradient_checkpointing (transformers 5.24: "
        "activation_checkpointing) on -> off, epsilon_high None -> 0.28",
        "generation: transformers generate (no vLLM), stops when every row has hit EOS; "
        "prompts left-padded to the longest in the batch; KV cache = transformers' DynamicCache "
        "(cache_implementation None), which grows one slot per decode step to prompt + "
        "generated tokens - 1 and attends to the filled slots only",
        f"TRL {trl.__version__} (the figures of 2026-11-30 used 1.13.0): the policy's and the "
        "reference's per-token log-probs go through TRL's fused LM head (`add_fused_lm_head`, "
        "new since 1.13: the head projects, in tiles, only the positions whose label is a "
        "real completion token, never materialising the [rows, positions, vocab] logits; "
        "1.13 computed the logits of every completion position, padding included, with "
        "`logits_to_keep`); a completion ends at any EOS id of the model's generation_config "
        "(here only <|im_end|> = 2, as before); same GRPO settings as before",
        f"torch threads {torch.get_num_threads()}",
        f"reference pass and update in micro-batches of {mb} rows (per_device_train_batch_size "
        f"{mb}, gradient_accumulation_steps = steps_per_generation = {accum}: one generation "
        "of the whole batch and one optimizer step per step)",
    ]
    settings = {
        "sampler": "transformers generate (eager PyTorch, no vLLM)",
        "cache_len": max(widths) if widths else None,
        "cache": f"DynamicCache: grows to prompt ({prompt_len}, left-padded to the longest) + "
        f"generated - 1 slots, at most {prompt_len + args.max_new_tokens - 1} "
        f"(= prompt + max_new_tokens {args.max_new_tokens} - 1); cache_len = the largest "
        "reached in this run's steps",
        "prompt_pad": prompt_len,
        "generate_rows": batch,
        "micro_batch_rows": mb,
        "optimizer_steps": 1,
        "remat": "off (activation_checkpointing=False)",
        "dtype": f"{str(next(trainer.model.parameters()).dtype).replace('torch.', '')} params "
        "and compute (bf16=False)",
    }
    common.write_result(
        args,
        "trl",
        f"trl {trl.__version__} (torch {torch.__version__}, "
        f"transformers {transformers.__version__})",
        steps,
        notes,
        extra={"prompt0_nll": nll0, "settings": settings},
    )


if __name__ == "__main__":
    main()
