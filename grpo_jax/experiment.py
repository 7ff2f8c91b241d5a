"""Builds everything a run needs from its config: mesh, model, tokenizer, data, reward,
optimizer and the algorithm's curriculum and learner.

`build_experiment(config)` returns an `Experiment`, an immutable description of the run; the
device programs are made from it by `grpo_jax.steps.make_steps` and the loop is
`grpo_jax.train`. Kept apart so that evaluation, the AOT compile check and notebooks can build
the same pieces. The builders of each part live with the part: `grpo_jax.data.from_config`,
`grpo_jax.models.from_config`, `grpo_jax.rewards.from_config`, the algorithm's strategies'
``from_config``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from grpo_jax import algorithms, config_schema, sampling, sharding
from grpo_jax import state as state_lib
from grpo_jax.data import from_config as data_lib
from grpo_jax.data import pipeline as pipeline_lib
from grpo_jax.data import templates
from grpo_jax.envs import from_config as envs_from_config
from grpo_jax.errors import ConfigError
from grpo_jax.models import config as model_config_lib
from grpo_jax.models import from_config as model_lib
from grpo_jax.models import lora as lora_lib
from grpo_jax.rewards import from_config as reward_lib


@dataclasses.dataclass(frozen=True)
class Batching:
    """How one RL step's R rollouts are cut up (every size a multiple of the mesh's data x fsdp).

    Attributes:
      rollouts_per_step: R = prompts_per_step x rollouts_per_prompt (the mean budget).
      mini_batch_size: rows per optimizer update; micro_batch_size: rows per forward/backward
        (gradients accumulate over a mini-batch); generate_batch_size: rows per sampler call.
      prompt_group_size: G with a shared prompt forward (1 = off).
      on_policy: one pass over one mini-batch (old log-probs = current ones, never computed).
      pack_sequences, micro_batch_tokens: the packed update (`config.algorithm`; `packing`).
    """

    rollouts_per_step: int
    mini_batch_size: int
    micro_batch_size: int
    generate_batch_size: int
    prompt_group_size: int
    on_policy: bool
    pack_sequences: bool = False
    micro_batch_tokens: int = 0

    @classmethod
    def from_config(cls, config, mesh, algo: algorithms.Algorithm) -> Batching:
        """The batching of ``config.rollout`` / ``config.algorithm`` on ``mesh`` (the one
        mesh-dependent config check).

        Raises: ConfigError naming the field that does not divide, or is not a multiple of the
        mesh's data x fsdp shards.
        """
        P, n_bar = config.rollout.prompts_per_step, config.rollout.rollouts_per_prompt
        R, div = P * n_bar, sharding.batch_divisor(mesh)
        if R % div:
            raise ConfigError(
                f"config.rollout: prompts_per_step * rollouts_per_prompt = {R} rollouts do not "
                f"divide over the mesh's data x fsdp = {div} shards; make R a multiple of {div}"
            )
        mb = config.algorithm.mini_batch_size or R
        micro = config.algorithm.micro_batch_size or mb
        gbs = config.rollout.generate_batch_size or R
        for name, v, whole, what, zero in (
            ("algorithm.mini_batch_size", mb, R, "R", "the whole batch"),
            ("algorithm.micro_batch_size", micro, mb, "mini_batch_size", "no accumulation"),
            ("rollout.generate_batch_size", gbs, R, "R", "all R rollouts in one sampler call"),
        ):
            if v < 0 or whole % v or v % div:
                raise ConfigError(
                    f"config.{name}={v} must divide {what}={whole} and be a multiple of the "
                    f"mesh's data x fsdp = {div} (0 = {zero})"
                )
        group = 1
        if config.algorithm.shared_prompt_forward:
            group = n_bar
            if not algo.curriculum.fixed_group_size:
                raise ConfigError(
                    "config.algorithm.shared_prompt_forward needs groups of equal size; "
                    f"{algo.name} allocates a varying number of rollouts per prompt"
                )
            for name, v in (
                ("algorithm.mini_batch_size", mb),
                ("algorithm.micro_batch_size", micro),
                ("rollout.generate_batch_size", gbs),
            ):
                if v % group:
                    raise ConfigError(
                        f"config.{name}={v} must be a multiple of rollouts_per_prompt={group} "
                        "with config.algorithm.shared_prompt_forward (whole groups per pass)"
                    )
        pack, budget = config.algorithm.pack_sequences, config.algorithm.micro_batch_tokens
        if budget < 0:
            raise ConfigError(
                f"config.algorithm.micro_batch_tokens={budget} must be >= 0 (0 = "
                "micro_batch_size rows' worth)"
            )
        if budget and not pack:
            raise ConfigError(
                "config.algorithm.micro_batch_tokens is read only with "
                "config.algorithm.pack_sequences=True"
            )
        if pack and group > 1:
            raise ConfigError(
                "config.algorithm.pack_sequences and shared_prompt_forward are two layouts of "
                "the update's rows; set one of them"
            )
        on_policy = config.algorithm.num_iterations == 1 and mb == R
        return cls(R, mb, micro, gbs, group, on_policy, bool(pack), int(budget))


@dataclasses.dataclass(frozen=True, eq=False)
class Experiment:
    """The built pieces of one run (host objects; device state lives in `state.RunState`).

    Immutable once built; ``dataclasses.replace`` makes variants (e.g. other shardings).

    Attributes:
      config: the run's ``ml_collections.ConfigDict`` (what the CLI edits; ``config.json``).
      run: the same, typed and validated, its derived values resolved
        (`config_schema.typed`); the builders read their sections from it.
      mesh: the device mesh (axes data, fsdp, tensor).
      model_config, graphdef, param_shardings, init_params_fn: the policy: its architecture,
        ``nnx`` graph, parameter shardings and a pure ``() -> params`` initialiser.
      tokenizer: ``encode``/``decode``/``eos_ids``/``pad_id`` (None in compile-only builds).
      tx: the policy's optax optimizer.
      pool: the training prompts and held-out sets (`grpo_jax.data.from_config.PromptPool`).
      batching: how a step's rollouts are cut up (`Batching`).
      train_sampling, eval_sampling: `sampling.SamplingConfig` of rollouts and evaluation.
      environment, turn_sampling: the multi-turn environment of ``config.env.name`` and the
        `sampling.SamplingConfig` of one policy turn (its stops added to the end ids), or None.
      reward_fn: the training reward; eval_reward_fns: held-out set name -> its reward.
      algorithm, curriculum, learner: the registered algorithm and its built strategies.
      state_shardings, abstract_state: the train state's shardings and shapes (every jitted
        step takes and returns these, so steps never recompile because of a sharding change).
    """

    config: ml_collections.ConfigDict
    run: config_schema.RunConfig
    mesh: jax.sharding.Mesh
    model_config: model_config_lib.ModelConfig
    graphdef: Any
    param_shardings: Any
    init_params_fn: Callable[[], Any]
    tokenizer: Any
    tx: optax.GradientTransformation
    pool: data_lib.PromptPool
    batching: Batching
    train_sampling: sampling.SamplingConfig
    eval_sampling: sampling.SamplingConfig
    reward_fn: Any
    eval_reward_fns: dict
    algorithm: algorithms.Algorithm
    curriculum: algorithms.Curriculum
    learner: algorithms.Learner
    state_shardings: Any = None
    abstract_state: Any = None
    environment: Any = None  # a `grpo_jax.envs.Environment` (config.env.name), else None
    turn_sampling: sampling.SamplingConfig | None = None  # one turn of its episodes

    @property
    def num_bins(self) -> int:
        return self.curriculum.num_bins

    @property
    def prompt_len(self) -> int:
        """Lp: prompts are left-padded to it (``pool.prompt_len``)."""
        return self.pool.prompt_len

    @property
    def max_new_tokens(self) -> int:
        """Lc: the rollouts' completion budget."""
        return self.train_sampling.max_new_tokens

    def make_source(self) -> pipeline_lib.PromptSource:
        """The training prompt stream. Every process draws the same *global* batch: the
        controllers need every prompt's bin, and device arrays are assembled from it shard by
        shard (`transfer.to_device`)."""
        return pipeline_lib.PromptSource(
            self.pool.examples,
            self.config.rollout.prompts_per_step,
            seed=self.config.seed,
            process_index=0,
            process_count=1,
        )

    @property
    def uses_reference(self) -> bool:
        """Whether the run keeps a frozen reference policy (``config.algorithm.kl_coef > 0``)."""
        return self.config.algorithm.kl_coef > 0

    @property
    def lora(self) -> bool:
        """Whether the policy trains LoRA adapters only (``config.model.lora.rank > 0``)."""
        return self.model_config.lora_rank > 0

    def trainable(self, params):
        """The parameters the optimizer updates: the adapters with LoRA, else all of them
        (works on any tree shaped like the parameters: shardings, shapes)."""
        return lora_lib.adapters(params) if self.lora else params

    def with_trainable(self, params, trained):
        """``params`` with its trained part replaced by ``trained`` (inverse of `trainable`)."""
        return lora_lib.combine(lora_lib.split(params)[0], trained) if self.lora else trained

    def opt_init(self, params):
        """A fresh optimizer state for ``params`` (over ``trainable(params)`` only)."""
        return self.tx.init(self.trainable(params))

    def state_init_fn(self):
        """The train state's pure initialiser (parameters constrained to their shardings)."""
        params = jax.lax.with_sharding_constraint(self.init_params_fn(), self.param_shardings)
        return self.learner.state_cls(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=self.opt_init(params),
            rng=jax.random.PRNGKey(self.config.seed),
            skips=jnp.zeros((), jnp.int32),
            **self.learner.init_extra(),
        )

    def mesh_context(self):
        return jax.sharding.use_mesh(self.mesh) if hasattr(jax.sharding, "use_mesh") else self.mesh

    def score(self, completions, rows):
        """The training reward of ``completions`` for the prompts ``rows`` (ids into the pool):
        ``reward_fn(completions, golds)``, plus the rows' example dicts for a reward function
        that reads row fields (``takes_examples``, e.g. `grpo_jax.rewards.custom.UserRewardFn`)
        and the prompt texts the policy saw for one that reads them (``takes_prompts``, the
        reward model's `grpo_jax.rewards.model.ModelReward`)."""
        golds = [self.pool.golds[r] for r in rows]
        kw = {}
        if getattr(self.reward_fn, "takes_examples", False):
            kw["examples"] = [self.pool.examples[r] for r in rows]
        if getattr(self.reward_fn, "takes_prompts", False):
            text = {r: self.render(templates.prompt_of(self.pool.examples[r])) for r in set(rows)}
            kw["prompts"] = [text[r] for r in rows]
        return self.reward_fn(completions, golds, **kw)

    def render(self, problem) -> str:
        """A prompt's text (`grpo_jax.data.from_config.render`)."""
        return data_lib.render(self.config, self.tokenizer, problem)

    def sft_data(self):
        """(tokens [N, Lp + La] int32, attention mask bool, target mask float32) for the
        supervised warm start: each prompt followed by its gold answer and EOS (with a
        multi-turn environment that demonstrates, its `Environment.demonstration`: the tool's
        output attended to, not a target). The prompts are the dataset's own warm-start pool
        when it has one (disjoint from the RL prompts: the arithmetic task with
        ``num_sft > 0``), else the training pool."""
        pool, tok = self.pool, self.tokenizer
        if pool.sft_examples:
            examples = pool.sft_examples
            texts = [self.render(templates.prompt_of(ex)) for ex in examples]
            prompts, prompt_mask, _ = templates.encode_prompts(
                tok, texts, self.prompt_len, "truncate"
            )
            golds = [ex["answer"] for ex in examples]
        else:
            examples, prompts, prompt_mask, golds = (
                pool.examples,
                pool.tokens,
                pool.mask,
                pool.golds,
            )
        demo = getattr(self.environment, "demonstration", lambda ex: None)
        answers = []
        for ex, gold in zip(examples, golds):
            parts = demo(ex) or [(str(gold), True)]
            ids = [(i, trained) for text, trained in parts for i in tok.encode(text)]
            answers.append(ids + [(tok.eos_ids[0], True)])
        la = min(max(len(a) for a in answers), self.max_new_tokens)
        n = len(answers)
        ans = np.full((n, la), tok.pad_id, np.int32)
        amask = np.zeros((n, la), bool)
        atarget = np.zeros((n, la), bool)
        for i, a in enumerate(answers):
            a = a[:la]
            ans[i, : len(a)] = [t for t, _ in a]
            amask[i, : len(a)] = True
            atarget[i, : len(a)] = [trained for _, trained in a]
        tokens = np.concatenate([prompts, ans], axis=1)
        mask = np.concatenate([prompt_mask, amask], axis=1)
        target = np.concatenate([np.zeros_like(prompt_mask), atarget], axis=1)
        return tokens, mask, target.astype(np.float32)

    def close(self) -> None:
        """Stops the reward worker processes."""
        for fn in {id(f): f for f in [self.reward_fn, *self.eval_reward_fns.values()]}.values():
            close = getattr(fn, "close", None)
            if close is not None:
                close()


def _sampling_configs(run: config_schema.RunConfig, tokenizer, group: int):
    """(training, evaluation) `sampling.SamplingConfig` of ``run.rollout`` / ``run.eval``."""
    sc, ec = run.rollout, run.eval
    common = dict(
        eos_ids=tuple(tokenizer.eos_ids) if tokenizer is not None else (0,),
        pad_id=tokenizer.pad_id if tokenizer is not None else 0,
        decode_cache=sc.decode_cache,
        decode_slots=int(sc.decode_slots),  # continuous batching
        page_size=int(sc.page_size),  # paged KV cache
    )
    train = sampling.SamplingConfig(
        max_new_tokens=sc.max_new_tokens,
        temperature=sc.temperature,
        top_k=sc.top_k,
        top_p=sc.top_p,
        prompt_group_size=group,
        **common,
    )
    evaluation = sampling.SamplingConfig(
        max_new_tokens=ec.max_new_tokens,
        temperature=ec.temperature,
        top_k=ec.top_k,
        top_p=ec.top_p,
        **common,
    )
    if (sc.top_k or sc.top_p < 1) and not run.algorithm.tis_cap:
        logging.warning(
            "config.rollout top_k/top_p truncate the sampler, but its log-probs (and so the "
            "ratio's 'old' policy) are the untruncated ones; set config.algorithm.tis_cap "
            "(e.g. 2) for the truncated-importance-sampling correction"
        )
    return train, evaluation


def build_experiment(
    config: ml_collections.ConfigDict, *, with_data: bool = True, devices=None, rewards=None
) -> Experiment:
    """Builds the mesh, model, tokenizer, data, reward function and optimizer of a run.

    ``devices`` (default ``jax.devices()``) are the mesh's devices: ``experiments.aot`` passes a
    TPU topology's devices (``jax.experimental.topologies``) to compile for a slice it lacks.

    ``with_data=False`` builds the compile-only pieces: no data, no reward workers and (except
    for the built-in arithmetic tokenizer) no tokenizer: the vocabulary is the preset's (or
    ``config.model.overrides.vocab_size``), eos_ids=(0,), pad 0. ``rewards``: the Python API's
    reward callables, ``{"callable:<name>": fn}`` (`reward_lib.make_reward_fn`).

    Raises: ConfigError naming the config field of a bad value, path or data row.
    """
    try:
        algo = algorithms.get(config.algorithm.name)
    except ValueError as e:
        raise ConfigError(f"config.algorithm.name: {e}") from None
    try:
        run = config_schema.typed(config)
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from None
    devices = list(jax.devices() if devices is None else devices)[: run.mesh.num_devices or None]
    try:
        mesh = sharding.make_mesh(
            {"data": run.mesh.data, "fsdp": run.mesh.fsdp, "tensor": run.mesh.tensor},
            devices,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    batching = Batching.from_config(run, mesh, algo)
    # the training rows are read first: missing or bad data fails before the weights load
    load_stats = {}
    train_split = run.data.split
    raw = data_lib.load_examples(run, run.data.name, train_split, load_stats) if with_data else []
    needs_tokenizer = with_data or run.data.name == "arithmetic"
    tokenizer = model_lib.load_tokenizer(run) if needs_tokenizer else None
    # the pool (and its data-dependent ranges, `data_lib.check_pool`) before the weights load
    pool = (
        data_lib.build_pool(run, tokenizer, raw, load_stats)
        if with_data
        else data_lib.PromptPool.empty(run.data.max_prompt_tokens)
    )
    model_cfg, graphdef, init_fn = model_lib.load_model(run, tokenizer, devices[0].platform)
    shardings = sharding.param_shardings(
        nnx.split(model_lib.abstract_model(model_cfg), nnx.Param)[1], mesh
    )
    steps_updates = state_lib.total_updates(run, batching)
    # bfloat16 parameters train through a float32 master copy (state.master_weights)
    tx = state_lib.make_optimizer(
        run.optimizer, steps_updates, master=(run.model.param_dtype or "float32") != "float32"
    )
    train_sampling, eval_sampling = _sampling_configs(run, tokenizer, batching.prompt_group_size)
    curriculum, learner = build_strategies(
        run, algo, pool.num_ids, model_cfg, steps_updates, pool.prompt_len
    )
    make_rewards = reward_lib.make_reward_fns if with_data else (lambda *_: (None, {}))
    reward_fn, eval_reward_fns = make_rewards(run, pool.eval_sets, mesh, rewards)
    environment, turn_sampling = envs_from_config.environment(run, tokenizer, train_sampling)
    exp = Experiment(
        config=config,
        run=run,
        mesh=mesh,
        model_config=model_cfg,
        graphdef=graphdef,
        param_shardings=shardings,
        init_params_fn=init_fn,
        tokenizer=tokenizer,
        tx=tx,
        pool=pool,
        batching=batching,
        train_sampling=train_sampling,
        eval_sampling=eval_sampling,
        reward_fn=reward_fn,
        eval_reward_fns=eval_reward_fns,
        algorithm=algo,
        curriculum=curriculum,
        learner=learner,
        environment=environment,
        turn_sampling=turn_sampling,
    )
    with exp.mesh_context():
        shapes = jax.eval_shape(exp.state_init_fn)
    trained = lora_lib.adapters(shardings) if model_cfg.lora_rank else None
    shards = state_lib.state_shardings(mesh, tx, shardings, learner, shapes, trained)
    abstract = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shards
    )
    return dataclasses.replace(exp, state_shardings=shards, abstract_state=abstract)


def build_strategies(run, algo, num_prompts, model_cfg, total_updates, prompt_len):
    """The algorithm's curriculum and learner, built from the typed config's sections
    (``run``: `config_schema.typed`).

    Raises: ConfigError naming the section of a bad value.
    """
    try:
        curriculum = algo.curriculum.from_config(run, num_prompts=num_prompts)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"config.gdro: {e}") from None
    learner = algo.learner.from_config(run, model_cfg, total_updates, prompt_len=prompt_len)
    return curriculum, learner
