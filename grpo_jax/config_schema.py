"""The config schema: one frozen dataclass per section, each field's default written once.

`RunConfig` and its sections are the schema: every field a run reads, with its default and a
comment. The sections the pure functions read are their own option dataclasses
(`losses.PolicyLossConfig` and `advantages.AdvantageConfig` flattened into `algorithm`, the GDRO
classifier and controllers in `gdro`, the field's curricula in `curricula`: their fields are
documented there). `base_config()` generates the ``ml_collections.ConfigDict`` the CLI and the
files in ``configs/`` edit; `typed(config)` turns an edited dict back into a `RunConfig`,
validated once (errors name the field) with the derived values resolved (each switch left at
None takes its mode's or its curriculum's value). `upgrade(saved)` reads a workdir's
``config.json`` written by an older version: fields it lacks take today's defaults, so code reads
every field directly. Units are in the names (`*_steps`, `*_tokens`, `*_per_step`, `*_s`).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any

import ml_collections
from ml_collections import config_dict

from grpo_jax import advantages, algorithms, gdro, losses
from grpo_jax.algorithms import field as curricula_lib
from grpo_jax.models.config import ModelConfig

_frozen = dataclasses.dataclass(frozen=True)


def _section(cls, **metadata):
    """A field holding a nested section (a dataclass), built from its defaults. ``metadata``:
    ``flatten=True`` puts the section's fields in the parent's (CLI names stay flat), ``skip``
    names the fields the config leaves out (the builder sets them)."""
    return dataclasses.field(default_factory=cls, metadata=metadata)


def _free_form():
    """A field holding a free-form dict (its keys are another dataclass's fields, checked there)."""
    return dataclasses.field(default_factory=dict, metadata={"free_form": True})


@_frozen
class LoraSection:
    """LoRA (Hu et al. 2021): train only low-rank adapters W + (alpha / rank) B A on the targeted
    projections; the base weights are frozen and the optimizer state covers the adapters only."""

    rank: int = 0  # adapter rank r (0 = off: full fine-tuning)
    alpha: float = 16.0  # output scale alpha / r
    # projections with an adapter: any of q, k, v, o (attention), gate, up, down (MLP)
    targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")


@_frozen
class ModelSection:
    """The policy model (preset or checkpoint) and its numerics."""

    preset: str = "tiny"  # name in grpo_jax.models.PRESETS (ignored if a checkpoint is given)
    # ModelConfig fields overriding the preset (e.g. hidden_size)
    overrides: dict = _free_form()
    # Hugging Face checkpoint: a local dir (config.json + safetensors) or a hub id ("org/name",
    # "org/name@revision"; the local cache first, downloaded when online); "" = none
    hf_checkpoint: str = ""
    # tokenizer dir (tokenizer.json [+ tokenizer_config.json]) or hub id; "" = the checkpoint's
    tokenizer: str = ""
    # keep only the checkpoint's first N layers (a truncated model: smoke tests of a real
    # checkpoint's pipeline at a fraction of its compute); 0 = all
    first_layers: int = 0
    gguf_path: str = ""  # GGUF file to load (dequantised); "" = none
    # the model's numerics: their defaults are `ModelConfig`'s (one home), which the run's
    # values override. dtype: compute dtype, float32 | bfloat16
    dtype: str = ModelConfig.dtype
    param_dtype: str = ModelConfig.param_dtype  # parameter dtype: float32 | bfloat16
    remat: bool = ModelConfig.remat  # rematerialise activations per layer in the update
    # attention core (grpo_jax.models.attention): auto | einsum | blockwise | splash (TPU) |
    # cudnn (GPU, 16-bit dtype); auto = splash on TPU, cudnn (bf16) or blockwise on GPU, the
    # faster of einsum / blockwise on CPU
    attention_impl: str = ModelConfig.attention_impl
    lora: LoraSection = _section(LoraSection)


@_frozen
class DataSection:
    """The training and held-out data, and how prompts are rendered."""

    # training set: a preset (arithmetic | gsm8k | dapo_math | math500 | ...) or "custom" (your
    # own table: data.path with the columns below; docs/byo.md)
    name: str = "arithmetic"
    # a table: JSONL/JSON/Parquet file, a directory or glob of them, or a Hugging Face dataset id
    # ("hf:org/name"; needs the `datasets` package). With a preset name: that preset's layout
    # read from this file instead of the data directory. "" = the preset's files
    path: str = ""
    eval_path: str = ""  # held-out table of a "custom" run ("" = data.path's eval_split)
    eval_split: str = "test"  # held-out split of a "custom" hub dataset or directory
    prompt_column: str = "problem"  # "custom": the column holding the problem text
    # "custom": the gold answer column ("" = none; rewards read row fields)
    answer_column: str = "answer"
    level_column: str = ""  # "custom": optional integer difficulty column ("" = none, level -1)
    id_column: str = ""  # "custom": optional unique row id column (kept as "source_id")
    # "custom": a column of conversations ([{"role", "content"}, ...], TRL's conversational
    # format) used instead of prompt_column, rendered by the chat template (template="chat"); a
    # final assistant turn is cut off and is the gold answer unless answer_column has one
    messages_column: str = ""
    system_prompt: str = ""  # chat template: a system message ("" = none)
    # instruction appended to each problem (plain/chat); None = the DAPO boxed-answer suffix
    prompt_suffix: str | None = None
    use_tfds: bool = False  # read presets through their TFDS builders (array_record, prepared once)
    # where the array_record files go ("" = $TFDS_DATA_DIR or ~/tensorflow_datasets)
    tfds_data_dir: str = ""
    config: str = ""  # dataset config (dapo_math: full | en_dedup)
    split: str = "train"  # training split
    source_dir: str = ""  # raw data dir; "" = $GRPO_JAX_DATA_DIR or ../shared/data
    template: str = "arithmetic"  # prompt template: arithmetic | plain | chat
    # prompt budget in tokens; prompts are left-padded to the longest train/eval prompt (rounded
    # up to 8), at most this
    max_prompt_tokens: int = 32
    overlong_prompts: str = "skip"  # prompts over budget: skip | truncate (counted either way)
    bad_rows: str = "error"  # rows missing fields: error | skip (counted)
    max_train_examples: int = 0  # cap on training examples (0 = all)
    # grpo_jax.data.arithmetic.ArithmeticConfig fields (checked there)
    arithmetic: dict = _free_form()


@_frozen
class RolloutSection:
    """Sampling: prompts and rollouts per step, lengths, temperature, the decode cache."""

    prompts_per_step: int = 32  # P: prompts drawn per RL step
    # n_bar: rollouts per prompt (the mean under Rollout-GDRO); R = P * n_bar
    rollouts_per_prompt: int = 8
    max_new_tokens: int = 8  # completion budget in tokens
    # rollouts per sampler call (0 = all R in one call); bounds the KV cache
    generate_batch_size: int = 0
    temperature: float = 1.0  # sampling temperature for training rollouts
    top_k: int = 0  # top-k for training rollouts (0 = off)
    top_p: float = 1.0  # top-p for training rollouts (1 = off)
    # continuous batching: decode this many rows, each refilled with the next pending rollout
    # when its completion ends (0 = one static batch; training and evaluation; sampling.py)
    decode_slots: int = 0
    # the static sampler's KV cache (sampling.SamplingConfig.decode_cache): dense (each row
    # holds its prompt's keys/values) | prefix_shared (each group's prompt stored and read once
    # for its rows: the groups of algorithm.shared_prompt_forward, else one row each; same
    # samples up to float rounding; decode_slots = 0 only) | paged (pages of
    # rollout.page_size slots: each row attends to its filled slots only, each group's full
    # prompt pages stored once; the Pallas TPU kernel under attention_impl splash, XLA
    # elsewhere; same samples up to float rounding; decode_slots = 0 only). Training and
    # evaluation
    decode_cache: str = "dense"
    page_size: int = 16  # slots per page of decode_cache=paged (TPU kernel: a multiple of 8)
    # rollouts in flight: step t trains on rollouts generated from the parameters k updates old
    # (policy version t - k), the generation of step t + k dispatched before step t's update;
    # needs algorithm.tis_cap (grpo_jax/rollout_queue.py). 0 = generate, then train (synchronous)
    max_staleness: int = 0

    # the sampler's parameter layout (grpo_jax.generation_layout): training (sample in the
    # training shardings) | auto (the planner's data x tensor split of the devices) | "DxT"
    # (e.g. "2x4": rows over 2, heads / kv-heads / mlp / vocab over 4); resharded once per step
    generation_layout: str = "training"


@_frozen
class EnvSection:
    """Multi-turn episodes with tools (grpo_jax/envs; docs/byo.md)."""

    # a registered environment (calculator | python) or module:Class; "" = one completion per
    # rollout. An episode's tokens (policy turns and observations) fit rollout.max_new_tokens
    name: str = ""
    max_turns: int = 2  # policy turns per episode
    # the most tokens of one policy turn (0 = no cap: a turn may use what is left of the
    # episode's budget, rollout.max_new_tokens in training and eval.max_new_tokens in evaluation)
    turn_tokens: int = 0


@_frozen
class AlgorithmSection:
    """The algorithm and the update's options. The loss's and the advantages' own options (clip
    range, KL, surrogate, estimator, ...) are `losses.PolicyLossConfig`'s and
    `advantages.AdvantageConfig`'s fields, flat in this section (``--config.algorithm.kl_coef``)."""

    # a name registered in grpo_jax.algorithms: grpo | prompt_gdro | rollout_gdro | ppo | dapo |
    # online_filter | learnability | greso
    name: str = "grpo"
    # where the KL is paid (once): reward (per-token reward penalty; ppo only) | loss (a term
    # of the policy loss); left at None, `typed` resolves it to the learner's own
    # (`Learner.default_kl_in`: ppo reward, the others loss)
    kl_in: str | None = None
    num_iterations: int = 1  # passes over each batch of rollouts (mu in GRPO)
    mini_batch_size: int = 0  # rollouts per gradient step (0 = the whole batch R)
    micro_batch_size: int = 0  # rollouts per forward/backward; gradients accumulate over a mini-batch (0 = no accumulation)
    shared_prompt_forward: bool = False  # each group's prompt computed once (prefill, reference pass, update): same values, less compute
    # the update and the reference / old-log-prob passes run on packed token buffers (rows end to
    # end, attention within a row): no compute on padding, the same loss and gradients
    pack_sequences: bool = False
    micro_batch_tokens: int = 0  # with pack_sequences: tokens per forward/backward (0 = micro_batch_size rows at the batch's row length)
    # positions per chunk of the LM head + log-softmax in the log-prob passes and the update: the
    # [R, Lc, V] logits and their gradient never exist whole (same values; 0 = whole logits)
    logprob_chunk_size: int = 0
    overlong_filtering: bool = False  # DAPO: truncated completions drop out of the loss
    overlong_penalty_factor: float = 0.0  # DAPO soft overlong punishment (0 = off)
    overlong_cache_tokens: int = 0  # DAPO L_cache: the penalty ramps over the last N tokens
    reward_scale: str = "pm1"  # pm1 (+1/-1, paper) | 01
    dynamic_sampling: bool = False  # DAPO: drop all-equal groups and re-sample
    dynamic_sampling_max_rounds: int = 3  # extra generation rounds when dynamic sampling
    loss: losses.PolicyLossConfig = _section(
        losses.PolicyLossConfig, flatten=True, skip=("max_len",)
    )
    advantage: advantages.AdvantageConfig = _section(
        advantages.AdvantageConfig, flatten=True, skip=("eps", "nonfinite")
    )

    def __getattr__(self, name: str):
        """The flattened fields read as in the CLI dict: ``run.algorithm.kl_coef`` is
        ``run.algorithm.loss.kl_coef``."""
        for part in ("loss", "advantage"):
            try:
                section = object.__getattribute__(self, part)
            except AttributeError:  # not initialised yet (copy, unpickling)
                break
            if name in {f.name for f in dataclasses.fields(section)}:
                return getattr(section, name)
        raise AttributeError(f"{type(self).__name__} has no field {name!r}")


@_frozen
class GDROSection:
    """The GDRO classifier and controllers (docs/gdro.md; the fields are documented in their
    dataclasses). Each one's ``mode``: corrected (default) | paper; every switch left at None
    takes its mode's value; the classifier's ``delta`` left at None takes the curriculum's own
    margin (`algorithms.Curriculum.hysteresis`)."""

    classifier: gdro.ClassifierConfig = _section(gdro.ClassifierConfig)
    prompt: gdro.PromptGDROConfig = _section(gdro.PromptGDROConfig)
    # n_bar is rollout.rollouts_per_prompt; mu_0 starts at 0
    rollout: gdro.RolloutGDROConfig = _section(gdro.RolloutGDROConfig, skip=("n_bar", "mu_0"))


@_frozen
class CurriculaSection:
    """The field's pass-rate curricula (grpo_jax.algorithms.field; each read only by its
    algorithm; the fields are documented in their dataclasses)."""

    learnability: curricula_lib.LearnabilityConfig = _section(curricula_lib.LearnabilityConfig)
    filter: curricula_lib.FilterConfig = _section(curricula_lib.FilterConfig)
    greso: curricula_lib.GRESOConfig = _section(curricula_lib.GRESOConfig)


@_frozen
class PPOSection:
    """PPO's critic (grpo_jax.algorithms.ppo.PPO; read only when algorithm.name = ppo)."""

    gamma: float = 1.0  # GAE discount
    lam: float = 0.95  # GAE lambda
    value_clip: float = 0.2  # value-loss clip range
    vf_coef: float = 0.5  # value-loss coefficient
    critic_lr: float = 1e-4  # critic learning rate


@_frozen
class OptimizerSection:
    """AdamW, its schedule, and what stops a run that diverges."""

    learning_rate: float = 1e-6  # AdamW peak learning rate
    warmup_steps: int = 0  # linear warm-up (optimizer updates)
    schedule: str = "constant"  # constant | cosine (after warm-up)
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    b1: float = 0.9  # Adam beta1
    b2: float = 0.999  # Adam beta2
    grad_clip: float = 1.0  # global-norm gradient clip (0 = off)
    max_consecutive_skips: int = 5  # stop after this many non-finite updates in a row
    # finite divergence (grpo_jax.divergence): |loss| or the pre-clip grad norm above
    # divergence_warn warns once; above divergence_stop the run checkpoints that step and stops
    # (0 = off)
    divergence_warn: float = 1e3
    divergence_stop: float = 1e6


@_frozen
class SFTSection:
    """The supervised warm start before RL."""

    steps: int = 0  # supervised warm-start steps before RL (0 = none)
    batch_size: int = 64  # examples per warm-start step
    learning_rate: float = 1e-3  # warm-start learning rate


@_frozen
class MeshSection:
    """The device mesh (grpo_jax.sharding)."""

    data: int = 1  # data-parallel axis size (-1 = all remaining devices)
    fsdp: int = 1  # fully-sharded data-parallel axis size
    tensor: int = 1  # tensor-parallel axis size
    num_devices: int = 0  # use the first N devices (0 = all of jax.devices())


@_frozen
class CheckpointSection:
    """Orbax checkpoints of the run state."""

    every_steps: int = 10  # save every N RL steps (and at the end / on SIGTERM)
    keep: int = 3  # keep the last N checkpoints
    overwrite: bool = False  # allow a workdir holding a run with another config


@_frozen
class EvalSection:
    """The held-out evaluation protocol."""

    every_steps: int = 0  # evaluate every N RL steps (0 = only before and after)
    # held-out sets (presets, or "custom": data.eval_path)
    datasets: tuple[str, ...] = ("arithmetic",)
    max_examples: int = 200  # problems per held-out set (0 = all)
    num_samples: int = 8  # samples per problem (k of pass@k, mean@k)
    temperature: float = 0.6  # paper protocol
    top_p: float = 0.8  # paper protocol
    top_k: int = 20  # paper protocol
    # completion budget of the held-out samples; left at None, `typed` resolves it to
    # rollout.max_new_tokens
    max_new_tokens: int | None = None
    batch_size: int = 256  # rollouts per generation call during evaluation


@_frozen
class LoggingSection:
    """The metrics files, TensorBoard and Weights & Biases."""

    every_steps: int = 1  # write a metrics row every N steps
    tensorboard: bool = True  # also write TensorBoard event files
    progress_bar: bool = True  # tqdm bars on stderr (warm start, evaluations, RL steps)
    # completions per step written to samples.jsonl + TensorBoard text (0 = none)
    num_samples: int = 4
    wandb_project: str = ""  # Weights & Biases project ("" = off; needs `pip install wandb`)
    wandb_entity: str = ""  # W&B entity (team or user; "" = your default)
    wandb_mode: str = ""  # online | offline | disabled ("" = wandb's default / WANDB_MODE)
    wandb_name: str = ""  # run name ("" = the workdir's name)


@_frozen
class RewardSection:
    """The reward: the built-in verifier, your functions, a reward model."""

    # your reward: "module:function", called as fn(completions, answers, **row_fields) -> list of
    # floats (or (rewards, correct)), in the killable worker pool; "" = the built-in verifier
    fn: str = ""
    # batched rewards (TRL's reward_funcs): "module:function"s, each called once per batch as
    # fn(completions=, prompts=, answers=, prompt_ids=, **columns) -> floats (None = failed);
    # reward = sum of weights[k] * fns[k] (weights: one per fn, () = all 1); docs/byo.md
    fns: tuple[str, ...] = ()
    weights: tuple[float, ...] = ()
    batch_timeout_s: float = 0.0  # reward.fns: one call's limit (0 = timeout_s x completions)
    task: str = ""  # built-in verifier: math | gsm8k | arithmetic ("" = by dataset)
    correct_above: float = 0.0  # reward.fn without correctness: correct = reward > this
    # regex: format_reward is paid when a completion matches ("" = the task's)
    format_pattern: str = ""
    extract: str = ""  # "module:function" completion -> answer for maj@k ("" = the task's)
    timeout_s: float = 5.0  # per-completion verifier timeout (seconds)
    # a failed reward (raised, hung, not a finite number, wrong count) scores the low reward; stop
    # after this many consecutive steps in which every rollout's reward failed (0 = never)
    max_failed_steps: int = 3
    # the run's last lines warn when more than this share of its rollouts' rewards failed
    warn_failure_rate: float = 0.1
    num_workers: int = 2  # verifier worker processes
    format_reward: float = 0.0  # bonus for a well-formed final answer
    # math-verify: significant digits of numeric comparison (15 scores 1/2^99 == 1/2^98)
    numeric_precision: int = 100
    float_rounding: int = 6  # math-verify: decimals kept when one side is a decimal literal
    # a learned reward model (grpo_jax.rewards.model): a HF *ForSequenceClassification checkpoint
    # (Llama / Qwen2 / Qwen3, one label), a directory or a hub id in the local HF cache ("" = none)
    model: str = ""
    # the training reward = verifier_weight * verifier reward + model_weight * RM score; pass
    # rates / GDRO bins ("correct") and held-out evaluation stay the verifier's
    model_weight: float = 1.0
    verifier_weight: float = 1.0  # 0 = the reward model alone (the verifier still gives correct)
    # what the RM reads: text (the prompt text the policy saw + the completion) | chat (the RM's
    # chat template on the prompt turns + {"role": "assistant", "content": completion})
    model_template: str = "text"
    model_max_tokens: int = 0  # RM input cap: longer texts keep their last tokens (0 = none)
    model_batch_size: int = 0  # rows per RM forward (0 = a round's rollouts at once)
    # RM weights and compute: float32 | bfloat16; left at None, `typed` resolves it to model.dtype
    model_dtype: str | None = None


@_frozen
class RunConfig:
    """The whole run: `base_config()` is its ``ConfigDict`` form, `typed()` reads one back."""

    seed: int = 0  # one seed for init, data order and sampling
    steps: int = 100  # RL steps (one step = generate + score + update)
    model: ModelSection = _section(ModelSection)
    data: DataSection = _section(DataSection)
    rollout: RolloutSection = _section(RolloutSection)
    env: EnvSection = _section(EnvSection)
    algorithm: AlgorithmSection = _section(AlgorithmSection)
    gdro: GDROSection = _section(GDROSection)
    curricula: CurriculaSection = _section(CurriculaSection)
    ppo: PPOSection = _section(PPOSection)
    optimizer: OptimizerSection = _section(OptimizerSection)
    sft: SFTSection = _section(SFTSection)
    mesh: MeshSection = _section(MeshSection)
    checkpoint: CheckpointSection = _section(CheckpointSection)
    eval: EvalSection = _section(EvalSection)
    logging: LoggingSection = _section(LoggingSection)
    reward: RewardSection = _section(RewardSection)


# ------------------------------------------------------------------ dataclasses <-> ConfigDict


def _leaf_fields(cls):
    """(field, type hint) of a section dataclass, in order."""
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)]


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _fill(section: ml_collections.ConfigDict, cls, value=None, skip=()) -> None:
    """Writes the fields of ``cls`` into ``section``: ``value``'s (an instance), or with
    ``value=None`` the fields' declared defaults (a switch that its mode resolves stays None).
    Nested sections become ConfigDicts, flattened ones go in place, a None becomes a typed
    placeholder (``float | None`` -> a float field that may be None).

    Raises:
      ValueError: a flattened field is already in ``section`` (a second home for its default).
    """
    for f, hint in _leaf_fields(cls):
        if f.name in skip:
            continue
        x = None if value is None else getattr(value, f.name)
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            if f.metadata.get("flatten"):
                _fill_flat(section, hint, x, f.metadata.get("skip", ()))
            else:
                section[f.name] = ml_collections.ConfigDict()
                _fill(section[f.name], hint, x, f.metadata.get("skip", ()))
            continue
        x = _default(f) if value is None else x
        if f.metadata.get("free_form"):
            section[f.name] = ml_collections.ConfigDict(dict(x))
        elif x is None:
            kinds = [t for t in typing.get_args(hint) if t is not type(None)]
            section[f.name] = config_dict.placeholder(kinds[0])
        else:
            section[f.name] = x


def _fill_flat(section, cls, value, skip) -> None:
    for f, _ in _leaf_fields(cls):
        if f.name not in skip and f.name in section:
            raise ValueError(
                f"config field {f.name!r} is written in the schema and in {cls.__name__}: its "
                f"default has one home, the dataclass"
            )
    _fill(section, cls, value, skip)


def to_config_dict(run: RunConfig | None = None) -> ml_collections.ConfigDict:
    """The ``ConfigDict`` form of ``run`` (what the CLI edits and ``config.json`` holds); with
    None, every field's declared default (`base_config`). A typed run's resolved switches are
    written as their values."""
    c = ml_collections.ConfigDict()
    _fill(c, RunConfig, run)
    return c


def base_config() -> ml_collections.ConfigDict:
    """Every field with its declared default (the files in ``configs/`` start from it)."""
    return to_config_dict(None)


def typed(config: Mapping[str, Any]) -> RunConfig:
    """The typed, validated run config of a ``ConfigDict`` (or nested dict) on this schema.

    Each option dataclass is built from its section (its own checks run: `__post_init__`), the
    mode switches left at None take their mode's value, and the fields whose default is another
    field's or the algorithm's take it (``gdro.classifier.delta``: the curriculum's margin;
    ``algorithm.kl_in``: the learner's; ``eval.max_new_tokens``: ``rollout.max_new_tokens``;
    ``reward.model_dtype``: ``model.dtype``; Rollout-GDRO's mean budget ``gdro.rollout.n_bar``:
    ``rollout.rollouts_per_prompt``), so every derived value is resolved once and the
    result holds no None standing for another value; fields the schema does not know (a section
    of your own) are left out; lists become tuples.

    Raises:
      ValueError: one line naming the section and the field.
    """
    d = config.to_dict() if isinstance(config, ml_collections.ConfigDict) else _plain(config)
    algo = algorithms.get(d.get("algorithm", {}).get("name", AlgorithmSection.name))
    section = d.get("gdro", {}).get("rollout")
    if section is not None:
        # Rollout-GDRO's mean budget is the run's group size (checked against n_min, n_max);
        # an algorithm that does not allocate rollouts takes it clipped into the section's
        # range (the section is unused, not a reason to refuse the run)
        n_bar = d.get("rollout", {}).get("rollouts_per_prompt", RolloutSection.rollouts_per_prompt)
        if not algo.curriculum.rollout_budget:
            lo = section.get("n_min", gdro.RolloutGDROConfig.n_min)
            n_bar = min(max(n_bar, lo), max(section.get("n_max", gdro.RolloutGDROConfig.n_max), lo))
        section["n_bar"] = n_bar
    run = _typed(RunConfig, d, "config")
    classifier = run.gdro.classifier
    if classifier.delta is None:
        classifier = dataclasses.replace(classifier, delta=algo.curriculum.hysteresis)
    algorithm, ev, reward = run.algorithm, run.eval, run.reward
    if algorithm.kl_in is None:
        algorithm = dataclasses.replace(algorithm, kl_in=algo.learner.default_kl_in)
    if ev.max_new_tokens is None:
        ev = dataclasses.replace(ev, max_new_tokens=run.rollout.max_new_tokens)
    if reward.model_dtype is None:
        reward = dataclasses.replace(reward, model_dtype=run.model.dtype)
    return dataclasses.replace(
        run,
        gdro=dataclasses.replace(run.gdro, classifier=classifier),
        algorithm=algorithm,
        eval=ev,
        reward=reward,
    )


def _plain(m: Mapping[str, Any]) -> dict:
    """A nested mapping as nested dicts (a copy: `typed` sets derived fields in it)."""
    return {k: _plain(v) if isinstance(v, Mapping) else v for k, v in m.items()}


def _typed(cls, d: Mapping[str, Any], where: str):
    """``cls`` (a section of this module) from its dict ``d``; ``where`` names it in errors."""
    kw = {}
    for f, hint in _leaf_fields(cls):
        nested = isinstance(hint, type) and dataclasses.is_dataclass(hint)
        flat = nested and f.metadata.get("flatten")
        if flat:  # the option dataclass's fields, flat in this section
            sub = {g.name: d[g.name] for g in dataclasses.fields(hint) if g.name in d}
        elif f.name in d:
            sub = d[f.name]
        else:  # older configs, and sections a config may leave out: the default
            continue
        if nested and hint.__module__ == __name__:
            kw[f.name] = _typed(hint, sub, f"{where}.{f.name}")
        elif nested:  # an option dataclass: its own checks, named by the section
            try:
                kw[f.name] = hint(**{k: _tuple(v) for k, v in dict(sub).items()})
            except (TypeError, ValueError) as e:
                raise ValueError(f"{where}.{e}" if flat else f"{where}.{f.name}: {e}") from None
        elif f.metadata.get("free_form"):
            kw[f.name] = {k: _tuple(v) for k, v in dict(sub).items()}
        else:
            kw[f.name] = _tuple(sub)
    return cls(**kw)


def _tuple(v):
    return tuple(v) if isinstance(v, list) else v


def upgrade(saved: dict) -> ml_collections.ConfigDict:
    """A saved config (a workdir's ``config.json``, a checkpoint's meta) on today's schema.

    Every field of `base_config()` the saved dict lacks takes its default; the saved values win
    everywhere else. Fields the schema does not know (a removed option, a section of your own)
    are kept as saved. Sequences saved as JSON lists come back as tuples where the default is
    one, so the result compares equal to the config that wrote it. Older spellings are read as
    today's: ``gdro.classifier.delta`` < 0 ("the curriculum's own"), ``eval.max_new_tokens`` 0
    ("rollout.max_new_tokens") and ``reward.model_dtype`` "" ("model.dtype") are None.

    Args:
      saved: nested dict (JSON-decoded).
    Returns: a new, unlocked ``ConfigDict``.
    """
    config = base_config()
    _merge(config, saved)
    classifier = config.get("gdro", {}).get("classifier", {})
    if isinstance(classifier.get("delta"), (int, float)) and classifier["delta"] < 0:
        classifier.delta = None
    for section, key, unset in (("eval", "max_new_tokens", 0), ("reward", "model_dtype", "")):
        if config.get(section, {}).get(key) == unset and isinstance(
            config[section][key], type(unset)
        ):
            config[section][key] = None
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
