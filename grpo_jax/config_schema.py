"""The config schema: every field a run reads, with its default and a comment.

`base_config()` is the dict the CLI edits (the files in ``configs/`` start from it and change
what their experiment needs). Every field has one default: the fields of the pure functions'
option dataclasses (`losses.PolicyLossConfig`, `advantages.AdvantageConfig`, the GDRO
classifier and controllers, the field's curricula) are generated from those dataclasses
(`DATACLASS_FIELDS`; their docs are there), the rest are written here. `upgrade(saved)` reads a
workdir's ``config.json`` written by an older version: fields it lacks take today's defaults, so
code reads every field directly.

Sections: model, data, rollout, algorithm, gdro, ppo, optimizer, sft, mesh, checkpoint, eval,
logging, reward. Units are in the names (`*_steps`, `*_tokens`, `*_per_step`, `*_s`).
"""

from __future__ import annotations

import dataclasses
import typing

import ml_collections
from ml_collections import config_dict

from grpo_jax import advantages, gdro, losses
from grpo_jax.algorithms import field

# (section path, option dataclass, its fields the section leaves out: set by the builder)
DATACLASS_FIELDS = (
    ("algorithm", losses.PolicyLossConfig, ("max_len",)),
    ("algorithm", advantages.AdvantageConfig, ("eps", "nonfinite")),
    ("gdro.classifier", gdro.ClassifierConfig, ()),
    ("gdro.prompt", gdro.PromptGDROConfig, ()),
    ("gdro.rollout", gdro.RolloutGDROConfig, ("n_bar", "mu_0")),
    ("curricula.learnability", field.LearnabilityConfig, ()),
    ("curricula.filter", field.FilterConfig, ()),
    ("curricula.greso", field.GRESOConfig, ()),
)


def _add_dataclass_fields(section: ml_collections.ConfigDict, cls, skip=()) -> None:
    """Adds ``cls``'s fields (less ``skip``) to ``section`` with their defaults; a None default
    becomes a typed placeholder (``float | None`` -> a float field that may be None).

    Raises:
      ValueError: a field is already in ``section`` (a second home for its default).
    """
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        if f.name in section:
            raise ValueError(
                f"config field {f.name!r} is written in the schema and in {cls.__name__}: its "
                f"default has one home, the dataclass"
            )
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = f.default
        if default is None:
            kinds = [t for t in typing.get_args(hints[f.name]) if t is not type(None)]
            section[f.name] = config_dict.placeholder(kinds[0])
        else:
            section[f.name] = default


def _section(c: ml_collections.ConfigDict, path: str) -> ml_collections.ConfigDict:
    for key in path.split("."):
        c = c[key]
    return c


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0  # one seed for init, data order and sampling
    c.steps = 100  # RL steps (one step = generate + score + update)

    _model_fields(c)
    _data_fields(c)
    _rollout_fields(c)
    _env_fields(c)
    _algorithm_fields(c)
    _gdro_fields(c)
    _training_fields(c)
    _evaluation_and_logging_fields(c)
    _reward_fields(c)
    for path, cls, skip in DATACLASS_FIELDS:
        _add_dataclass_fields(_section(c, path), cls, skip)
    return c


def _model_fields(c: ml_collections.ConfigDict) -> None:
    """The policy model (preset or checkpoint) and its numerics."""
    c.model = ml_collections.ConfigDict()
    c.model.preset = "tiny"  # name in grpo_jax.models.PRESETS (ignored if a checkpoint is given)
    # ModelConfig fields overriding the preset (e.g. hidden_size)
    c.model.overrides = ml_collections.ConfigDict()
    # Hugging Face checkpoint: a local dir (config.json + safetensors) or a hub id ("org/name",
    # "org/name@revision"; the local cache first, downloaded when online); "" = none
    c.model.hf_checkpoint = ""
    # tokenizer dir (tokenizer.json [+ tokenizer_config.json]) or hub id; "" = the checkpoint's
    c.model.tokenizer = ""
    c.model.gguf_path = ""  # GGUF file to load (dequantised); "" = none
    c.model.dtype = "float32"  # compute dtype: float32 | bfloat16
    c.model.param_dtype = "float32"  # parameter dtype: float32 | bfloat16
    c.model.remat = False  # rematerialise activations per layer in the update
    # attention core (grpo_jax.models.attention): auto | einsum | blockwise | splash (TPU) |
    # cudnn (GPU, 16-bit dtype); auto = splash on TPU, cudnn (bf16) or blockwise on GPU, the
    # faster of einsum / blockwise on CPU
    c.model.attention_impl = "auto"
    # LoRA (Hu et al. 2021): train only low-rank adapters W + (alpha / rank) B A on the targeted
    # projections; the base weights are frozen and the optimizer state covers the adapters only
    c.model.lora = ml_collections.ConfigDict()
    c.model.lora.rank = 0  # adapter rank r (0 = off: full fine-tuning)
    c.model.lora.alpha = 16.0  # output scale alpha / r
    # projections with an adapter: any of q, k, v, o (attention), gate, up, down (MLP)
    c.model.lora.targets = ("q", "k", "v", "o", "gate", "up", "down")


def _data_fields(c: ml_collections.ConfigDict) -> None:
    """The training and held-out data, and how prompts are rendered."""
    c.data = ml_collections.ConfigDict()
    # training set: a preset (arithmetic | gsm8k | dapo_math | math500 | ...) or "custom" (your
    # own table: data.path with the columns below; docs/byo.md)
    c.data.name = "arithmetic"
    # a table: JSONL/JSON/Parquet file, a directory or glob of them, or a Hugging Face dataset id
    # ("hf:org/name"; needs the `datasets` package). With a preset name: that preset's layout
    # read from this file instead of the data directory. "" = the preset's files
    c.data.path = ""
    c.data.eval_path = ""  # held-out table of a "custom" run ("" = data.path's eval_split)
    c.data.eval_split = "test"  # held-out split of a "custom" hub dataset or directory
    c.data.prompt_column = "problem"  # "custom": the column holding the problem text
    c.data.answer_column = (
        "answer"  # "custom": the gold answer column ("" = none; rewards read row fields)
    )
    c.data.level_column = ""  # "custom": optional integer difficulty column ("" = none, level -1)
    c.data.id_column = ""  # "custom": optional unique row id column (kept as "source_id")
    # "custom": a column of conversations ([{"role", "content"}, ...], TRL's conversational
    # format) used instead of prompt_column, rendered by the chat template (template="chat"); a
    # final assistant turn is cut off and is the gold answer unless answer_column has one
    c.data.messages_column = ""
    c.data.system_prompt = ""  # chat template: a system message ("" = none)
    # instruction appended to each problem (plain/chat); None = the DAPO boxed-answer suffix
    c.data.prompt_suffix = config_dict.placeholder(str)
    c.data.use_tfds = (
        False  # read presets through their TFDS builders (array_record, prepared once)
    )
    c.data.tfds_data_dir = (
        ""  # where the array_record files go ("" = $TFDS_DATA_DIR or ~/tensorflow_datasets)
    )
    c.data.config = ""  # dataset config (dapo_math: full | en_dedup)
    c.data.split = "train"  # training split
    c.data.source_dir = ""  # raw data dir; "" = $GRPO_JAX_DATA_DIR or ../shared/data
    c.data.template = "arithmetic"  # prompt template: arithmetic | plain | chat
    c.data.max_prompt_tokens = 32  # prompt budget in tokens; prompts are left-padded to the longest train/eval prompt (rounded up to 8), at most this
    c.data.overlong_prompts = "skip"  # prompts over budget: skip | truncate (counted either way)
    c.data.bad_rows = "error"  # rows missing fields: error | skip (counted)
    c.data.max_train_examples = 0  # cap on training examples (0 = all)
    # grpo_jax.data.arithmetic.ArithmeticConfig fields
    c.data.arithmetic = ml_collections.ConfigDict()


def _rollout_fields(c: ml_collections.ConfigDict) -> None:
    """Sampling: prompts and rollouts per step, lengths, temperature."""
    c.rollout = ml_collections.ConfigDict()
    c.rollout.prompts_per_step = 32  # P: prompts drawn per RL step
    # n_bar: rollouts per prompt (the mean under Rollout-GDRO); R = P * n_bar
    c.rollout.rollouts_per_prompt = 8
    c.rollout.max_new_tokens = 8  # completion budget in tokens
    # rollouts per sampler call (0 = all R in one call); bounds the KV cache
    c.rollout.generate_batch_size = 0
    c.rollout.temperature = 1.0  # sampling temperature for training rollouts
    c.rollout.top_k = 0  # top-k for training rollouts (0 = off)
    c.rollout.top_p = 1.0  # top-p for training rollouts (1 = off)
    # continuous batching: decode this many rows, each refilled with the next pending rollout
    # when its completion ends (0 = one static batch; training and evaluation; sampling.py)
    c.rollout.decode_slots = 0
    # the static sampler's KV cache (sampling.SamplingConfig.decode_cache): dense (each row
    # holds its prompt's keys/values) | prefix_shared (each group's prompt stored and read once
    # for its rows: the groups of algorithm.shared_prompt_forward, else one row each; same
    # samples up to float rounding; decode_slots = 0 only) | paged (pages of
    # rollout.page_size slots: each row attends to its filled slots only, each group's full
    # prompt pages stored once; the Pallas TPU kernel under attention_impl splash, XLA
    # elsewhere; same samples up to float rounding; decode_slots = 0 only). Training and
    # evaluation
    c.rollout.decode_cache = "dense"
    c.rollout.page_size = 16  # slots per page of decode_cache=paged (TPU kernel: a multiple of 8)
    # rollouts in flight: step t trains on rollouts generated from the parameters k updates old
    # (policy version t - k), the generation of step t + k dispatched before step t's update;
    # needs algorithm.tis_cap (grpo_jax/rollout_queue.py). 0 = generate, then train (synchronous)
    c.rollout.max_staleness = 0

    # the sampler's parameter layout (grpo_jax.generation_layout): training (sample in the
    # training shardings) | auto (the planner's data x tensor split of the devices) | "DxT"
    # (e.g. "2x4": rows over 2, heads / kv-heads / mlp / vocab over 4); resharded once per step
    c.rollout.generation_layout = "training"


def _env_fields(c: ml_collections.ConfigDict) -> None:
    """Multi-turn episodes with tools (grpo_jax/envs; docs/byo.md)."""
    c.env = ml_collections.ConfigDict()
    # a registered environment (calculator | python) or module:Class; "" = one completion per
    # rollout. An episode's tokens (policy turns and observations) fit rollout.max_new_tokens
    c.env.name = ""
    c.env.max_turns = 2  # policy turns per episode
    c.env.turn_tokens = 0  # the most tokens of one policy turn (0 = rollout.max_new_tokens)


def _algorithm_fields(c: ml_collections.ConfigDict) -> None:
    """The algorithm and the update's options; the loss's and the advantages' own options
    (clip range, KL, surrogate, estimator, ...) come from `DATACLASS_FIELDS`."""
    c.algorithm = ml_collections.ConfigDict()
    # a name registered in grpo_jax.algorithms: grpo | prompt_gdro | rollout_gdro | ppo | dapo |
    # online_filter | learnability | greso
    c.algorithm.name = "grpo"
    # where the KL is paid (once): None = the learner's default (ppo: reward, others: loss) |
    # reward (per-token reward penalty; ppo only) | loss (a term of the policy loss)
    c.algorithm.kl_in = config_dict.placeholder(str)
    c.algorithm.num_iterations = 1  # passes over each batch of rollouts (mu in GRPO)
    c.algorithm.mini_batch_size = 0  # rollouts per gradient step (0 = the whole batch R)
    c.algorithm.micro_batch_size = 0  # rollouts per forward/backward; gradients accumulate over a mini-batch (0 = no accumulation)
    c.algorithm.shared_prompt_forward = False  # each group's prompt computed once (prefill, reference pass, update): same values, less compute
    # positions per chunk of the LM head + log-softmax in the log-prob passes and the update: the
    # [R, Lc, V] logits and their gradient never exist whole (same values; 0 = whole logits)
    c.algorithm.logprob_chunk_size = 0
    c.algorithm.overlong_filtering = False  # DAPO: truncated completions drop out of the loss
    c.algorithm.overlong_penalty_factor = 0.0  # DAPO soft overlong punishment (0 = off)
    c.algorithm.overlong_cache_tokens = 0  # DAPO L_cache: the penalty ramps over the last N tokens
    c.algorithm.reward_scale = "pm1"  # pm1 (+1/-1, paper) | 01
    c.algorithm.dynamic_sampling = False  # DAPO: drop all-equal groups and re-sample
    c.algorithm.dynamic_sampling_max_rounds = 3  # extra generation rounds when dynamic sampling


def _gdro_fields(c: ml_collections.ConfigDict) -> None:
    """The GDRO classifier and controllers (docs/gdro.md) and the field's pass-rate curricula
    (grpo_jax.algorithms.field; read only by their algorithm): each subsection holds the fields
    of the dataclass it builds (`DATACLASS_FIELDS`; docs there). Each section's `mode`:
    corrected (default) | paper; every switch left at None takes its mode's value; the
    classifier's `delta` left at None takes the curriculum's own margin."""
    c.gdro = ml_collections.ConfigDict()
    c.gdro.classifier = ml_collections.ConfigDict()
    c.gdro.prompt = ml_collections.ConfigDict()
    c.gdro.rollout = ml_collections.ConfigDict()
    c.curricula = ml_collections.ConfigDict()
    c.curricula.learnability = ml_collections.ConfigDict()  # algorithm.name = learnability
    c.curricula.filter = ml_collections.ConfigDict()  # algorithm.name = online_filter
    c.curricula.greso = ml_collections.ConfigDict()  # algorithm.name = greso


def _training_fields(c: ml_collections.ConfigDict) -> None:
    """PPO's critic, the optimizer, the SFT warm start, mesh, checkpoints."""
    c.ppo = ml_collections.ConfigDict()  # PPO's critic (read only when algorithm.name = ppo)
    c.ppo.gamma = 1.0  # GAE discount
    c.ppo.lam = 0.95  # GAE lambda
    c.ppo.value_clip = 0.2  # value-loss clip range
    c.ppo.vf_coef = 0.5  # value-loss coefficient
    c.ppo.critic_lr = 1e-4  # critic learning rate

    c.optimizer = ml_collections.ConfigDict()
    c.optimizer.learning_rate = 1e-6  # AdamW peak learning rate
    c.optimizer.warmup_steps = 0  # linear warm-up (optimizer updates)
    c.optimizer.schedule = "constant"  # constant | cosine (after warm-up)
    c.optimizer.weight_decay = 0.0  # AdamW decoupled weight decay
    c.optimizer.b1 = 0.9  # Adam beta1
    c.optimizer.b2 = 0.999  # Adam beta2
    c.optimizer.grad_clip = 1.0  # global-norm gradient clip (0 = off)
    c.optimizer.max_consecutive_skips = 5  # stop after this many non-finite updates in a row
    # finite divergence (grpo_jax.divergence): |loss| or the pre-clip grad norm above
    # divergence_warn warns once; above divergence_stop the run checkpoints that step and stops
    # (0 = off)
    c.optimizer.divergence_warn = 1e3
    c.optimizer.divergence_stop = 1e6

    c.sft = ml_collections.ConfigDict()
    c.sft.steps = 0  # supervised warm-start steps before RL (0 = none)
    c.sft.batch_size = 64  # examples per warm-start step
    c.sft.learning_rate = 1e-3  # warm-start learning rate

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = 1  # data-parallel axis size (-1 = all remaining devices)
    c.mesh.fsdp = 1  # fully-sharded data-parallel axis size
    c.mesh.tensor = 1  # tensor-parallel axis size
    c.mesh.num_devices = 0  # use the first N devices (0 = all of jax.devices())

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every_steps = 10  # save every N RL steps (and at the end / on SIGTERM)
    c.checkpoint.keep = 3  # keep the last N checkpoints
    c.checkpoint.overwrite = False  # allow a workdir holding a run with another config


def _evaluation_and_logging_fields(c: ml_collections.ConfigDict) -> None:
    """The held-out evaluation protocol and the metrics files."""
    c.eval = ml_collections.ConfigDict()
    c.eval.every_steps = 0  # evaluate every N RL steps (0 = only before and after)
    c.eval.datasets = ("arithmetic",)  # held-out sets (presets, or "custom": data.eval_path)
    c.eval.max_examples = 200  # problems per held-out set (0 = all)
    c.eval.num_samples = 8  # samples per problem (k of pass@k, mean@k)
    c.eval.temperature = 0.6  # paper protocol
    c.eval.top_p = 0.8  # paper protocol
    c.eval.top_k = 20  # paper protocol
    c.eval.max_new_tokens = 0  # 0 = rollout.max_new_tokens
    c.eval.batch_size = 256  # rollouts per generation call during evaluation

    c.logging = ml_collections.ConfigDict()
    c.logging.every_steps = 1  # write a metrics row every N steps
    c.logging.tensorboard = True  # also write TensorBoard event files
    c.logging.progress_bar = True  # tqdm bars on stderr (warm start, evaluations, RL steps)
    c.logging.num_samples = (
        4  # completions per step written to samples.jsonl + TensorBoard text (0 = none)
    )
    c.logging.wandb_project = ""  # Weights & Biases project ("" = off; needs `pip install wandb`)
    c.logging.wandb_entity = ""  # W&B entity (team or user; "" = your default)
    c.logging.wandb_mode = ""  # online | offline | disabled ("" = wandb's default / WANDB_MODE)
    c.logging.wandb_name = ""  # run name ("" = the workdir's name)


def _reward_fields(c: ml_collections.ConfigDict) -> None:
    """The reward: the built-in verifier, your function, a reward model."""
    c.reward = ml_collections.ConfigDict()
    # your reward: "module:function", called as fn(completions, answers, **row_fields) -> list of
    # floats (or (rewards, correct)), in the killable worker pool; "" = the built-in verifier
    c.reward.fn = ""
    # batched rewards (TRL's reward_funcs): "module:function"s, each called once per batch as
    # fn(completions=, prompts=, answers=, prompt_ids=, **columns) -> floats (None = failed);
    # reward = sum of weights[k] * fns[k] (weights: one per fn, () = all 1); docs/byo.md
    c.reward.fns = ()
    c.reward.weights = ()
    c.reward.batch_timeout_s = 0.0  # reward.fns: one call's limit (0 = timeout_s x completions)
    c.reward.task = ""  # built-in verifier: math | gsm8k | arithmetic ("" = by dataset)
    c.reward.correct_above = 0.0  # reward.fn without correctness: correct = reward > this
    c.reward.format_pattern = (
        ""  # regex: format_reward is paid when a completion matches ("" = the task's)
    )
    c.reward.extract = ""  # "module:function" completion -> answer for maj@k ("" = the task's)
    c.reward.timeout_s = 5.0  # per-completion verifier timeout (seconds)
    # a failed reward (raised, hung, not a finite number, wrong count) scores the low reward; stop
    # after this many consecutive steps in which every rollout's reward failed (0 = never)
    c.reward.max_failed_steps = 3
    # the run's last lines warn when more than this share of its rollouts' rewards failed
    c.reward.warn_failure_rate = 0.1
    c.reward.num_workers = 2  # verifier worker processes
    c.reward.format_reward = 0.0  # bonus for a well-formed final answer
    # math-verify: significant digits of numeric comparison (15 scores 1/2^99 == 1/2^98)
    c.reward.numeric_precision = 100
    c.reward.float_rounding = 6  # math-verify: decimals kept when one side is a decimal literal
    # a learned reward model (grpo_jax.rewards.model): a HF *ForSequenceClassification checkpoint
    # (Llama / Qwen2 / Qwen3, one label), a directory or a hub id in the local HF cache ("" = none)
    c.reward.model = ""
    # the training reward = verifier_weight * verifier reward + model_weight * RM score; pass
    # rates / GDRO bins ("correct") and held-out evaluation stay the verifier's
    c.reward.model_weight = 1.0
    c.reward.verifier_weight = 1.0  # 0 = the reward model alone (the verifier still gives correct)
    # what the RM reads: text (the prompt text the policy saw + the completion) | chat (the RM's
    # chat template on the prompt turns + {"role": "assistant", "content": completion})
    c.reward.model_template = "text"
    c.reward.model_max_tokens = 0  # RM input cap: longer texts keep their last tokens (0 = none)
    c.reward.model_batch_size = 0  # rows per RM forward (0 = a round's rollouts at once)
    c.reward.model_dtype = ""  # RM weights and compute: float32 | bfloat16 ("" = model.dtype)


def upgrade(saved: dict) -> ml_collections.ConfigDict:
    """A saved config (a workdir's ``config.json``, a checkpoint's meta) on today's schema.

    Every field of `base_config()` the saved dict lacks takes its default; the saved values win
    everywhere else. Fields the schema does not know (a removed option, a section of your own)
    are kept as saved. Sequences saved as JSON lists come back as tuples where the default is
    one, so the result compares equal to the config that wrote it. Older spellings are read as
    today's: ``gdro.classifier.delta`` < 0 ("the curriculum's own") is None.

    Args:
      saved: nested dict (JSON-decoded).
    Returns: a new, unlocked ``ConfigDict``.
    """
    config = base_config()
    _merge(config, saved)
    classifier = config.get("gdro", {}).get("classifier", {})
    if isinstance(classifier.get("delta"), (int, float)) and classifier["delta"] < 0:
        classifier.delta = None
    return config


def _merge(config: ml_collections.ConfigDict, saved: dict) -> None:
    for key, value in saved.items():
        if key not in config:
            config[key] = value
            continue
        current = config[key]
        if isinstance(current, ml_collections.ConfigDict) and isinstance(value, dict):
            _merge(current, value)
        elif isinstance(current, tuple) and isinstance(value, list):
            config[key] = tuple(value)
        elif isinstance(current, config_dict.FieldReference) or current is None:
            config[key] = value
        else:
            with config.ignore_type():
                config[key] = value
