"""Builds everything a run needs from its config: mesh, model, tokenizer, data, reward, optimizer.

`build_experiment(config)` returns an `Experiment`; `train.py` holds the loop. Kept apart so
that evaluation, the AOT compile check and notebooks can build the same pieces.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from grpo_jax import gdro, sampling, sharding
from grpo_jax.config_utils import ConfigError
from grpo_jax.data import pipeline as pipeline_lib
from grpo_jax.data import templates
from grpo_jax.models import config as model_config_lib
from grpo_jax.models import transformer


@dataclasses.dataclass
class Experiment:
    """The built pieces of one run (host objects; device state lives in TrainState)."""

    config: ml_collections.ConfigDict
    mesh: jax.sharding.Mesh
    model_config: Any
    graphdef: Any
    param_shardings: Any
    init_params_fn: Callable[[], Any]
    tokenizer: Any
    prompt_len: int
    max_new_tokens: int
    # training prompts, indexed by prompt id (= position in `examples`)
    prompt_tokens: np.ndarray
    prompt_mask: np.ndarray
    golds: list
    levels: list
    examples: list
    num_prompt_ids: int
    eval_sets: dict
    reward_fn: Any
    train_sampling: Any
    eval_sampling: Any
    tx: Any
    mini_batch_size: int
    generate_batch_size: int
    micro_batch_size: int
    on_policy: bool
    classifier_cfg: Any
    prompt_gdro_cfg: Any
    rollout_gdro_cfg: Any
    num_bins: int
    data_stats: dict
    prompt_group_size: int = 1  # G when config.algorithm.shared_prompt_forward, else 1
    critic_graphdef: Any = None
    critic_init_fn: Callable[[], Any] | None = None
    critic_tx: Any = None
    ref_params: Any = None
    state_shardings: Any = None
    _eval_reward_fns: dict = dataclasses.field(default_factory=dict)

    # --- helpers used by the loop
    @property
    def all_prompt_ids(self) -> jax.Array:
        return jnp.arange(self.num_prompt_ids, dtype=jnp.int32)

    def to_device(self, x: np.ndarray) -> jax.Array:
        """The *global* host batch -> a global array sharded over the batch axes.

        Every process holds the same global numpy batch (the pipeline is deterministic and
        identical on all hosts); each one supplies the shards its devices own.
        """
        x = np.asarray(x)
        return jax.make_array_from_callback(
            x.shape, sharding.batch_sharding(self.mesh, x.ndim), lambda index: x[index]
        )

    @staticmethod
    def to_host(x: jax.Array) -> np.ndarray:
        """A global (possibly multi-host) array -> the full numpy array on every process."""
        if jax.process_count() == 1 or x.is_fully_addressable:
            return np.asarray(x)
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids if int(i) not in self.tokenizer.eos_ids])

    def make_source(self):
        # Every process draws the same *global* batch (process_count=1): the controllers need
        # every prompt's bin, and device arrays are assembled from it shard by shard.
        return pipeline_lib.PromptSource(
            self.examples,
            self.config.rollout.prompts_per_step,
            seed=self.config.seed,
            process_index=0,
            process_count=1,
        )

    def _state_init_fn(self, make_state):
        def init():
            params = jax.lax.with_sharding_constraint(self.init_params_fn(), self.param_shardings)
            kwargs = {}
            if self.critic_init_fn is not None:
                cparams = self.critic_init_fn()
                kwargs = {
                    "critic_params": cparams,
                    "critic_opt_state": self.critic_tx.init(cparams),
                }
            return make_state(
                step=jnp.zeros((), jnp.int32),
                params=params,
                opt_state=self.tx.init(params),
                rng=jax.random.PRNGKey(self.config.seed),
                skips=jnp.zeros((), jnp.int32),
                **kwargs,
            )

        return init

    def _state_shardings_for(self, shapes):
        """Shardings of a TrainState shaped like ``shapes``: parameters by the mesh rules, every
        parameter-shaped optimizer leaf (Adam mu/nu) like its parameter, scalars replicated."""
        repl = sharding.replicated(self.mesh)

        def opt(tx, opt_state, param_sh):
            return optax.tree_map_params(
                tx, lambda _, s: s, opt_state, param_sh, transform_non_params=lambda _: repl
            )

        out = jax.tree.map(lambda _: repl, shapes)
        out = out.replace(
            params=self.param_shardings,
            opt_state=opt(self.tx, shapes.opt_state, self.param_shardings),
        )
        if getattr(shapes, "critic_params", None) is not None:
            critic_sh = sharding.param_shardings(
                nnx.split(_abstract_model(self.model_config, transformer.CriticModel), nnx.Param)[
                    1
                ],
                self.mesh,
            )
            out = out.replace(
                critic_params=critic_sh,
                critic_opt_state=opt(self.critic_tx, shapes.critic_opt_state, critic_sh),
            )
        return out

    def _mesh_context(self):
        return jax.sharding.use_mesh(self.mesh) if hasattr(jax.sharding, "use_mesh") else self.mesh

    def init_state(self, make_state):
        """TrainState created by one jitted init, parameters directly in their sharding.

        Sets ``self.state_shardings`` (the shardings every jitted step takes and returns, so
        steps never recompile because of a sharding change); optimizer moments are sharded like
        their parameters (see ``abstract_state``).
        """
        self.abstract_state(make_state)
        with self._mesh_context():
            return jax.jit(self._state_init_fn(make_state), out_shardings=self.state_shardings)()

    def abstract_state(self, make_state):
        """The TrainState ``init_state`` would build, as ``jax.ShapeDtypeStruct`` with shardings.

        Nothing is allocated or compiled (``jax.eval_shape``); sets ``self.state_shardings``.
        For compile-only checks (experiments/aot.py) and restoring checkpoints.
        """
        with self._mesh_context():
            shapes = jax.eval_shape(self._state_init_fn(make_state))
        self.state_shardings = self._state_shardings_for(shapes)
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
            shapes,
            self.state_shardings,
        )

    def set_ref_params(self, restored, state) -> None:
        """The frozen reference: the starting policy (after any warm start)."""
        if self.config.algorithm.kl_coef <= 0:
            self.ref_params = None
        elif restored is not None:
            self.ref_params = restored
        else:
            self.ref_params = jax.tree.map(jnp.copy, state.params)

    def ref_params_or_none(self, state):
        if self.config.algorithm.kl_coef <= 0:
            return None
        return self.ref_params if self.ref_params is not None else state.params

    def sft_data(self):
        """(tokens [N, Lp + La], attention mask, target mask) for the supervised warm start."""
        answers = [self.tokenizer.encode(str(g)) + [self.tokenizer.eos_ids[0]] for g in self.golds]
        la = min(max(len(a) for a in answers), self.max_new_tokens)
        n = len(answers)
        ans = np.full((n, la), self.tokenizer.pad_id, np.int32)
        amask = np.zeros((n, la), bool)
        for i, a in enumerate(answers):
            a = a[:la]
            ans[i, : len(a)] = a
            amask[i, : len(a)] = True
        tokens = np.concatenate([self.prompt_tokens, ans], axis=1)
        mask = np.concatenate([self.prompt_mask, amask], axis=1)
        target = np.concatenate([np.zeros_like(self.prompt_mask), amask], axis=1).astype(np.float32)
        return tokens, mask, target

    def eval_reward_fn(self, dataset: str):
        """The reward function for a held-out set (shared with training when the task matches)."""
        task = reward_task(dataset)
        if task == reward_task(self.config.data.name):
            return self.reward_fn
        if task not in self._eval_reward_fns:
            self._eval_reward_fns[task] = make_reward_fn(self.config, dataset)
        return self._eval_reward_fns[task]

    def close(self) -> None:
        for fn in [self.reward_fn, *self._eval_reward_fns.values()]:
            close = getattr(fn, "close", None)
            if close is not None:
                close()


def encode_prompts(
    tokenizer, texts: list[str], max_len: int, overlong: str, *, return_overlong: bool = False
):
    """Left-pads token ids to ``max_len``.

    Returns:
      (tokens [N, max_len] int32, mask [N, max_len] bool, kept [N] bool), plus
      overlong [N] bool (longer than ``max_len``, in either mode) with ``return_overlong``.
      Prompts longer than ``max_len`` are dropped (``overlong="skip"``; kept=False) or cut from
      the left (``"truncate"``, keeping the end of the prompt, where the question and template are).
    """
    n = len(texts)
    tokens = np.full((n, max_len), tokenizer.pad_id, np.int32)
    mask = np.zeros((n, max_len), bool)
    kept = np.ones((n,), bool)
    over = np.zeros((n,), bool)
    for i, text in enumerate(texts):
        ids = tokenizer.encode(text)
        if len(ids) > max_len:
            over[i] = True
            if overlong == "skip":
                kept[i] = False
                continue
            ids = ids[-max_len:]
        if ids:
            tokens[i, max_len - len(ids) :] = ids
            mask[i, max_len - len(ids) :] = True
    return (tokens, mask, kept, over) if return_overlong else (tokens, mask, kept)


def _load_model(config, tokenizer):
    mc = config.model
    overrides = dict(mc.overrides.to_dict()) if mc.overrides else {}
    if tokenizer is not None:  # None: compile-only build (vocab from the preset)
        overrides.setdefault("vocab_size", tokenizer.vocab_size)  # a preset sized to the tokenizer
    overrides.update(dtype=mc.dtype, param_dtype=mc.param_dtype, remat=mc.remat)
    if mc.hf_checkpoint or mc.gguf_path:
        from grpo_jax.models import loading

        if mc.hf_checkpoint:
            model_cfg, graphdef, params = loading.load_hf_checkpoint(mc.hf_checkpoint)
        else:
            model_cfg, graphdef, params = loading.load_gguf(mc.gguf_path)
        model_cfg = dataclasses.replace(
            model_cfg, **{k: v for k, v in overrides.items() if k in ("dtype", "remat")}
        )
        graphdef, _ = nnx.split(_abstract_model(model_cfg), nnx.Param)
        pure = params.to_pure_dict() if hasattr(params, "to_pure_dict") else params
        if mc.param_dtype:
            pure = jax.tree.map(lambda x: x.astype(mc.param_dtype), pure)
        return model_cfg, graphdef, lambda: pure
    model_cfg = model_config_lib.get_preset(mc.preset, **overrides)

    def init():
        with nnx.use_eager_sharding(False):
            model = transformer.Transformer(model_cfg, rngs=nnx.Rngs(config.seed))
        return nnx.split(model, nnx.Param)[1].to_pure_dict()

    graphdef, _ = nnx.split(_abstract_model(model_cfg), nnx.Param)
    return model_cfg, graphdef, init


def _abstract_model(model_cfg, cls=None):
    cls = cls or transformer.Transformer
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(lambda: cls(model_cfg, rngs=nnx.Rngs(0)))


def _load_tokenizer(config):
    if config.data.name == "arithmetic":
        from grpo_jax.data import arithmetic

        return arithmetic.CharTokenizer()
    from grpo_jax.models import tokenizer as tokenizer_lib

    try:
        if config.model.hf_checkpoint:
            return tokenizer_lib.Tokenizer.from_dir(config.model.hf_checkpoint)
        if config.model.gguf_path:
            return tokenizer_lib.Tokenizer.from_gguf(config.model.gguf_path)
    except FileNotFoundError as e:
        field = "hf_checkpoint" if config.model.hf_checkpoint else "gguf_path"
        raise ConfigError(
            f"config.model.{field}: {e}; point it at an existing "
            f"{'checkpoint directory' if field == 'hf_checkpoint' else 'GGUF file'}"
        ) from None
    raise ConfigError(
        "config.model: a non-arithmetic dataset needs a tokenizer: set "
        "config.model.hf_checkpoint or config.model.gguf_path"
    )


def _load_examples(config, name: str, split: str, stats: dict | None = None) -> list[dict]:
    """The examples of a split; ``stats`` (if given) gets `datasets.load_with_stats`' counts."""
    if name == "arithmetic":
        from grpo_jax.data import arithmetic

        acfg = arithmetic.ArithmeticConfig(**config.data.arithmetic.to_dict())
        train, evals = arithmetic.make_arithmetic(acfg)
        return train if split == "train" else evals
    from grpo_jax.data import datasets

    try:
        examples, counts = datasets.load_with_stats(
            name,
            split,
            source_dir=config.data.source_dir or None,
            config=(config.data.config or None) if name == config.data.name else None,
            bad_rows=config.data.bad_rows,
        )
    except ValueError as e:
        if "bad row" not in str(e):
            raise
        raise ConfigError(
            f"{e}; in a run: --config.data.bad_rows=skip drops and counts such rows"
        ) from None
    if stats is not None:
        stats.update(counts)
    return examples


def render(config, tokenizer, problem: str) -> str:
    return templates.render_prompt(problem, template=config.data.template, tokenizer=tokenizer)


def reward_task(dataset: str) -> str:
    """The verifier for a dataset: exact integers (arithmetic), GSM8K numbers, or LaTeX math."""
    return {"arithmetic": "arithmetic", "gsm8k": "gsm8k"}.get(dataset, "math")


def make_reward_fn(config, dataset: str | None = None):
    from grpo_jax import rewards

    return rewards.RewardFn(
        rewards.RewardConfig(
            task=reward_task(dataset or config.data.name),
            scale=config.algorithm.reward_scale,
            format_reward=config.reward.format_reward,
            timeout_s=config.reward.timeout_s,
            num_workers=config.reward.num_workers,
        )
    )


def gdro_configs(config):
    """The controllers' static configs from `config.gdro` (they validate on construction)."""
    g = config.gdro
    try:
        cls_cfg = gdro.ClassifierConfig(
            edges=tuple(g.edges),
            history=g.history,
            delta=max(g.delta, 0.0),
            unseen_bin=g.unseen_bin,
            statistic=g.statistic,
            pass_k=g.pass_k,
        )
        pg_cfg = gdro.PromptGDROConfig(
            eta=g.eta_q,
            gamma=g.gamma_q,
            beta=g.beta,
            weight_cap=g.weight_cap,
            score_clip=g.score_clip or None,
            apply=g.apply,
            signal=g.signal,
        )
        rg_cfg = gdro.RolloutGDROConfig(
            allocator=g.allocator,
            n_min=g.n_min,
            n_max=g.n_max,
            n_bar=config.rollout.rollouts_per_prompt,
            eta=g.eta_n,
            gamma=g.gamma_n,
            ema_decay=g.arm_ema,
            alpha_mu=g.alpha_mu,
            v_floor=g.v_floor,
            signal=g.signal,
        )
    except ValueError as e:
        raise ConfigError(f"config.gdro: {e}") from None
    return cls_cfg, pg_cfg, rg_cfg


def build_experiment(config: ml_collections.ConfigDict, *, with_data: bool = True) -> Experiment:
    """Builds the mesh, model, tokenizer, data, reward function and optimizer of a run.

    ``with_data=False`` builds the compile-only pieces: no data, no reward workers and (except
    for the built-in arithmetic tokenizer) no tokenizer: the vocabulary is the preset's (or
    ``config.model.overrides.vocab_size``), eos_ids=(0,), pad 0.
    """
    from grpo_jax import train as train_lib  # make_optimizer

    devices = jax.devices()[: config.mesh.num_devices or None]
    try:
        mesh = sharding.make_mesh(
            {"data": config.mesh.data, "fsdp": config.mesh.fsdp, "tensor": config.mesh.tensor},
            devices,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    P, n_bar = config.rollout.prompts_per_step, config.rollout.rollouts_per_prompt
    R = P * n_bar
    div = sharding.batch_divisor(mesh)
    if R % div:
        raise ConfigError(
            f"config.rollout: prompts_per_step * rollouts_per_prompt = {R} rollouts do not "
            f"divide over the mesh's data x fsdp = {div} shards; make R a multiple of {div}"
        )
    mb = config.algorithm.mini_batch_size or R
    if R % mb or mb % div:
        raise ConfigError(
            f"config.algorithm.mini_batch_size={mb} must divide R={R} and be a multiple of "
            f"the mesh's data x fsdp = {div}"
        )
    micro = config.algorithm.micro_batch_size or mb
    if micro < 0 or mb % micro or micro % div:
        raise ConfigError(
            f"config.algorithm.micro_batch_size={micro} must divide mini_batch_size={mb} and "
            f"be a multiple of the mesh's data x fsdp = {div} (0 = no accumulation)"
        )
    gbs = config.rollout.generate_batch_size or R
    if gbs < 0 or R % gbs or gbs % div:
        raise ConfigError(
            f"config.rollout.generate_batch_size={gbs} must divide R={R} and be a multiple "
            f"of the mesh's data x fsdp = {div} (0 = all R rollouts in one sampler call)"
        )
    group = 1
    if config.algorithm.shared_prompt_forward:
        group = n_bar
        if config.algorithm.name == "rollout_gdro":
            raise ConfigError(
                "config.algorithm.shared_prompt_forward needs groups of equal size; "
                "rollout_gdro allocates a varying number of rollouts per prompt"
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
    load_stats = {}  # the training rows are read first: missing or bad data fails before the weights load
    raw = (
        _load_examples(config, config.data.name, config.data.split, load_stats) if with_data else []
    )
    tokenizer = _load_tokenizer(config) if with_data or config.data.name == "arithmetic" else None
    model_cfg, graphdef, init_fn = _load_model(config, tokenizer)
    abstract_state = nnx.split(_abstract_model(model_cfg), nnx.Param)[1]
    shardings = sharding.param_shardings(abstract_state, mesh)

    lp = config.data.max_prompt_tokens
    data_stats = {}
    examples, eval_sets = [], {}
    tokens = mask = np.zeros((0, lp), np.int32)
    golds, levels = [], []
    if with_data:
        if config.data.max_train_examples:
            raw = raw[: config.data.max_train_examples]
        texts = [render(config, tokenizer, ex["problem"]) for ex in raw]
        tokens, mask, kept, over = encode_prompts(
            tokenizer, texts, lp, config.data.overlong_prompts, return_overlong=True
        )
        data_stats = {
            "train_examples": len(raw),
            "overlong_prompts": int(over.sum()),
            "overlong_prompts_skipped": int((~kept).sum()),
            "bad_rows_skipped": int(load_stats.get("num_skipped", 0)),
        }
        # ids = positions after filtering (stable for a given dataset and config; the classifier keys on them)
        examples = pipeline_lib.reindex([ex for ex, k in zip(raw, kept) if k])
        if not examples:
            raise ConfigError(
                f"config.data.max_prompt_tokens={lp}: every training prompt is longer; raise it"
            )
        tokens, mask = tokens[kept], mask[kept]
        num_ids = len(examples)
        golds = [ex.get("answers", ex["answer"]) for ex in examples]
        levels = [int(ex.get("level", -1)) for ex in examples]
        for name in config.eval.datasets:
            evs = _load_examples(config, name, "eval" if name == "arithmetic" else "test")
            if config.eval.max_examples:
                evs = evs[: config.eval.max_examples]
            eval_sets[name] = evs
        # pad to the longest prompt of the train and eval sets (rounded up to 8), not to the budget:
        # prefill, log-prob and update compute all scale with the padded length
        longest = int(mask.sum(axis=1).max())
        for evs in eval_sets.values():
            longest = max(
                [longest]
                + [len(tokenizer.encode(render(config, tokenizer, ex["problem"]))) for ex in evs]
            )
        trimmed = min(lp, -(-longest // 8) * 8)
        tokens, mask, lp = tokens[:, lp - trimmed :], mask[:, lp - trimmed :], trimmed
        data_stats["prompt_tokens_padded_to"] = lp
    else:
        num_ids = 1

    steps_updates = config.steps * config.algorithm.num_iterations * (R // mb)
    tx = train_lib.make_optimizer(config.optimizer, steps_updates)
    sc = config.rollout
    eos = tuple(tokenizer.eos_ids) if tokenizer is not None else (0,)
    pad_id = tokenizer.pad_id if tokenizer is not None else 0
    train_sampling = sampling.SamplingConfig(
        max_new_tokens=sc.max_new_tokens,
        temperature=sc.temperature,
        top_k=sc.top_k,
        top_p=sc.top_p,
        eos_ids=eos,
        pad_id=pad_id,
        prompt_group_size=group,
    )
    ec = config.eval
    eval_sampling = sampling.SamplingConfig(
        max_new_tokens=ec.max_new_tokens or sc.max_new_tokens,
        temperature=ec.temperature,
        top_k=ec.top_k,
        top_p=ec.top_p,
        eos_ids=eos,
        pad_id=pad_id,
    )
    cls_cfg, pg_cfg, rg_cfg = gdro_configs(config)
    exp = Experiment(
        config=config,
        mesh=mesh,
        model_config=model_cfg,
        graphdef=graphdef,
        param_shardings=shardings,
        init_params_fn=init_fn,
        tokenizer=tokenizer,
        prompt_len=lp,
        max_new_tokens=sc.max_new_tokens,
        prompt_tokens=tokens,
        prompt_mask=mask,
        golds=golds,
        levels=levels,
        examples=examples,
        num_prompt_ids=num_ids,
        eval_sets=eval_sets,
        reward_fn=make_reward_fn(config) if with_data else None,
        train_sampling=train_sampling,
        eval_sampling=eval_sampling,
        tx=tx,
        mini_batch_size=mb,
        generate_batch_size=gbs,
        micro_batch_size=micro,
        prompt_group_size=group,
        on_policy=(config.algorithm.num_iterations == 1 and mb == R),
        classifier_cfg=cls_cfg,
        prompt_gdro_cfg=pg_cfg,
        rollout_gdro_cfg=rg_cfg,
        num_bins=len(config.gdro.edges) + 1,
        data_stats=data_stats,
    )
    if config.algorithm.name == "ppo":
        critic_abstract = _abstract_model(model_cfg, transformer.CriticModel)
        exp.critic_graphdef = nnx.split(critic_abstract, nnx.Param)[0]

        def critic_init():
            with nnx.use_eager_sharding(False):
                critic = transformer.CriticModel(model_cfg, rngs=nnx.Rngs(config.seed + 1))
            return nnx.split(critic, nnx.Param)[1].to_pure_dict()

        exp.critic_init_fn = critic_init
        exp.critic_tx = train_lib.make_optimizer(
            config.optimizer, steps_updates, learning_rate=config.algorithm.ppo_critic_lr
        )
    return exp
