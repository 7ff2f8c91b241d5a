"""The paper's setup: Qwen3-{1.7B,4B,8B}-Base, RL from base on DAPO-Math-17k (English, de-duplicated).

Arguments: `<size>,<algorithm>[,<mesh>]` with size 1.7b | 4b | 8b, algorithm grpo | prompt_gdro |
rollout_gdro | ppo, mesh tpu (FSDP over every chip of a v5p slice; default) | gpu8 (one node of
8 GPUs: fsdp 4 x tensor 2). Values from the paper's Appendix A (spec gdro.md section 5).
Point `--config.model.hf_checkpoint` at the Qwen3 Base checkpoint directory (config.json,
safetensors, tokenizer). Without one the preset's architecture is used with random weights (for
compile-only checks: experiments/aot.py).
"""

from configs import common

SIZES = {"1.7b": "qwen3-1.7b", "4b": "qwen3-4b", "8b": "qwen3-8b"}


def get_config(arg: str = "8b,grpo"):
    size, _, rest = (arg or "8b,grpo").partition(",")
    if size not in SIZES:
        raise ValueError(
            f"unknown model size {size!r}: the first part is one of {', '.join(SIZES)}"
        )
    algorithm, parts = common.parse_arg(rest, flags=("tpu", "gpu8", "paper_gdro"))
    mesh = "gpu8" if "gpu8" in parts else "tpu"
    c = common.base_config()
    c.steps = 1000  # paper: 1000 steps (Prompt-GDRO script: 500)
    c.model.preset = SIZES[size]  # architecture when no checkpoint is given
    c.model.hf_checkpoint = ""  # Qwen3-<size>-Base directory (set on the command line)
    c.model.dtype = "bfloat16"  # compute dtype on accelerators
    c.model.param_dtype = "float32"  # master weights for AdamW at lr 1e-6
    c.model.remat = True  # rematerialise layers: 4096-token responses
    c.data.name = "dapo_math"  # DAPO-Math-17k
    c.data.config = "en_dedup"  # English, de-duplicated subset (13,987 rows here; paper ~14.1k)
    c.data.template = "plain"  # base model: problem + the paper's suffix
    c.data.max_prompt_tokens = 1024  # prompt budget
    c.rollout.prompts_per_step = 256  # paper: 256 prompts x 4 rollouts
    c.rollout.rollouts_per_prompt = 4  # n_bar = 4 (Rollout-GDRO mean budget)
    c.rollout.max_new_tokens = 4096  # paper: 4096 response tokens
    c.rollout.temperature = 1.0  # paper: train temperature 1.0
    c.algorithm.epsilon_low = 0.2  # paper: clip 0.2 / 0.28
    c.algorithm.epsilon_high = 0.28
    c.algorithm.kl_coef = 0.001  # paper: KL loss 0.001 (k3) to the frozen base
    c.algorithm.kl_kind = "k3"
    c.algorithm.loss_agg_mode = "token-mean"  # paper: token-mean
    c.algorithm.advantage_clip = 5.0  # paper: advantages clipped to +-5
    c.algorithm.reward_scale = "pm1"  # paper: +1 / -1 from the math verifier
    c.algorithm.mini_batch_size = 256  # rollouts per gradient step (4 steps per batch)
    # completion log-probs in 512-position chunks: never the whole [rows, 4096, 151936] logits
    # (docs/architecture.md: TPU-compiled memory)
    c.algorithm.logprob_chunk_size = 512
    c.optimizer.learning_rate = 1e-6  # paper: AdamW lr 1e-6
    c.optimizer.weight_decay = 0.01
    c.gdro.prompt.signal = c.gdro.rollout.signal = "surrogate_loss"  # paper default loss signal
    c.eval.datasets = ("math500", "aime24", "aime25", "amc23", "minerva_math", "olympiadbench")
    c.eval.max_examples = 0  # all problems
    c.eval.every_steps = 50
    c.eval.num_samples = 8  # paper: 8 samples, T 0.6, top-p 0.8, top-k 20
    c.eval.max_new_tokens = 4096
    c.eval.batch_size = 512
    c.checkpoint.every_steps = 25
    c.reward.num_workers = 8
    if algorithm == "prompt_gdro":
        c.rollout.prompts_per_step = 512  # the paper's Prompt-GDRO script: 512 prompts x 500 steps
        # 2 sampler calls of 1024 rows: the KV cache of GRPO's step
        c.rollout.generate_batch_size = 1024
        c.steps = 500
    if mesh == "gpu8":
        c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, 4, 2
        c.algorithm.micro_batch_size = 8  # accumulation: 2 sequences per fsdp shard per pass
        c.rollout.generate_batch_size = 64  # sampler calls of 64 rows (16 rows per shard)
    else:
        c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1
    common.apply_algorithm(c, algorithm)
    if "paper_gdro" in parts:  # the paper's controllers (docs/gdro.md)
        common.paper_gdro(c)
    return c
