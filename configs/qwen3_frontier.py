"""Stage B of the GDRO mechanism test: Qwen3-Base on a pre-checked DAPO-Math subset, one chip.

Arguments: `<algorithm>[,1.7b|4b][,paper_gdro]` (algorithm first, as
experiments.compare passes it; default 1.7b). The paper's values (configs/dapo_qwen3.py:
clip 0.2 / 0.28, k3 KL 0.001, token-mean, +-1 rewards, AdamW) at a size one accelerator runs:
P = 128 prompts x n_bar = 4, 2,048 response tokens, 512 prompt tokens, 150 RL steps over a
1,024-prompt pool (every prompt visited ~19 times, the testbed rule of the CPU mechanism test),
two mini-batches per step (the paper mode's loss signal is then non-zero).

Two local paths, read from the environment when the config is built (and recorded in each
run's config.json): `GRPO_JAX_QWEN3_BASE` (the Qwen3-<size>-Base checkpoint directory: config.json,
safetensors, tokenizer) and `GRPO_JAX_STAGE_B_DATA` (the pre-checked subset: train.jsonl and
test.jsonl written by `experiments.oracle --subset_out`). reports/gdro_stage_b.md has the plan:
the pre-check, the comparison and their estimated accelerator-hours. Without a checkpoint the
preset's architecture with random weights is built (compile-only checks: experiments/aot.py).
"""

import os

from configs import common, dapo_qwen3

SIZES = ("1.7b", "4b")


def get_config(arg: str = "grpo"):
    algorithm, parts = common.parse_arg(arg, flags=(*SIZES, "paper_gdro"))
    size = next((s for s in SIZES if s in parts), "1.7b")
    c = dapo_qwen3.get_config(f"{size},{algorithm}")  # the paper's values, then the changes
    c.steps = 150  # RL steps: 150 x 128 / 1024 = 18.75 visits per prompt
    c.model.hf_checkpoint = os.environ.get("GRPO_JAX_QWEN3_BASE", "")
    c.data.name = "custom"  # the oracle's pre-checked subset of DAPO-Math-17k (en_dedup)
    c.data.config = None
    c.data.path = os.environ.get("GRPO_JAX_STAGE_B_DATA", "")
    c.data.prompt_column = "problem"
    c.data.answer_column = "answer"
    c.data.level_column = "oracle_stratum"  # per-stratum metrics (0: p=0 ... 4: p=1)
    c.data.max_prompt_tokens = 512  # DAPO problems: 99% under 400 tokens with the suffix
    c.reward.task = "math"  # math-verify, as the dapo_math preset
    c.rollout.prompts_per_step = 128  # P
    c.rollout.rollouts_per_prompt = 4  # n_bar (the paper's)
    c.rollout.max_new_tokens = 2048  # half the paper's 4,096: the cost (reports/gdro_stage_b.md)
    # 2 sampler calls of 256 rows: a 256 x 2,560-slot bf16 KV cache is 75 GB at 1.7B (28 layers x
    # 8 KV heads x 128 x 2 x 2 bytes = 115 kB per token); 512 rows (150 GB) fit no single chip
    c.rollout.generate_batch_size = 256
    c.algorithm.mini_batch_size = 256  # 2 gradient steps per batch
    c.algorithm.micro_batch_size = (
        32  # remat checkpoints 32 x 2,560 x 2,048 x 2 B x 28 layers = 9 GB
    )
    c.eval.datasets = ("custom",)  # the subset's held-out rows (compare: validation / test halves)
    c.eval.max_examples = 0
    c.eval.num_samples = 16  # pass@8 unbiased from 16 (an eval of 512 problems: 8,192 rollouts)
    c.eval.max_new_tokens = 2048
    c.eval.every_steps = 50
    c.eval.batch_size = 256
    c.checkpoint.every_steps = 25
    if "paper_gdro" in parts:
        common.paper_gdro(c)
    return c
