"""Builds everything a run needs from its config: mesh, model, tokenizer, data, reward,
optimizer and the algorithm's curriculum and learner.

`build_experiment(config)` returns an `Experiment`, an immutable description of the run; the
device programs are made from it by `grpo_jax.steps.make_steps` and the loop is
`grpo_jax.train`. Kept apart so that evaluation, the AOT compile check and notebooks can build
the same pieces.
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

from grpo_jax import algorithms, sampling, sharding
from grpo_jax.config_utils import ConfigError
from grpo_jax.data import pipeline as pipeline_lib
from grpo_jax.data import templates
from grpo_jax.models import attention as attention_lib
from grpo_jax.models import config as model_config_lib
from grpo_jax.models import lora as lora_lib
from grpo_jax.models import transformer
from grpo_jax.rewards import from_config as reward_lib
from grpo_jax.state import make_optimizer


@dataclasses.dataclass(frozen=True, eq=False)
class Experiment:
    """The built pieces of one run (host objects; device state lives in `state.RunState`).

    Immutable once built; ``dataclasses.replace`` makes variants (e.g. other shardings).

    Attributes:
      config: the run's ``ml_collections.ConfigDict``.
      mesh: the device mesh (axes data, fsdp, tensor).
      model_config, graphdef, param_shardings, init_params_fn: the policy: its architecture,
        ``nnx`` graph, parameter shardings and a pure ``() -> params`` initialiser.
      tokenizer: ``encode``/``decode``/``eos_ids``/``pad_id`` (None in compile-only builds).
      prompt_len: Lp, prompts left-padded to it; max_new_tokens: Lc.
      prompt_tokens [N, Lp] int32, prompt_mask [N, Lp] bool, golds [N], levels [N], examples
        [N]: the training pool, indexed by prompt id.
      eval_sets: held-out set name -> examples; reward_fn: the training reward;
        eval_reward_fns: held-out set name -> its reward function.
      train_sampling, eval_sampling: `sampling.SamplingConfig` of rollouts and evaluation.
      tx: the policy's optax optimizer.
      mini_batch_size, micro_batch_size, generate_batch_size: rows per update, per
        forward/backward, per sampler call; prompt_group_size: G with a shared prompt forward.
      on_policy: one pass over one mini-batch (old log-probs = current ones, never computed).
      algorithm, curriculum, learner: the registered algorithm and its built strategies.
      data_stats: counts of the data loading (overlong prompts, skipped rows, ...).
      sft_examples: the dataset's separate warm-start pool ([] = warm start on the RL pool).
      state_shardings, abstract_state: the train state's shardings and shapes (every jitted
        step takes and returns these, so steps never recompile because of a sharding change).
    """

    config: ml_collections.ConfigDict
    mesh: jax.sharding.Mesh
    model_config: model_config_lib.ModelConfig
    graphdef: Any
    param_shardings: Any
    init_params_fn: Callable[[], Any]
    tokenizer: Any
    prompt_len: int
    max_new_tokens: int
    prompt_tokens: np.ndarray
    prompt_mask: np.ndarray
    golds: list
    levels: list
    examples: list
    eval_sets: dict
    reward_fn: Any
    eval_reward_fns: dict
    train_sampling: sampling.SamplingConfig
    eval_sampling: sampling.SamplingConfig
    tx: optax.GradientTransformation
    mini_batch_size: int
    generate_batch_size: int
    micro_batch_size: int
    prompt_group_size: int
    on_policy: bool
    algorithm: algorithms.Algorithm
    curriculum: algorithms.Curriculum
    learner: algorithms.Learner
    data_stats: dict
    sft_examples: list = dataclasses.field(default_factory=list)
    state_shardings: Any = None
    abstract_state: Any = None

    @property
    def num_bins(self) -> int:
        return self.curriculum.num_bins

    def make_source(self) -> pipeline_lib.PromptSource:
        """The training prompt stream. Every process draws the same *global* batch: the
        controllers need every prompt's bin, and device arrays are assembled from it shard by
        shard (`transfer.to_device`)."""
        return pipeline_lib.PromptSource(
            self.examples,
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
        that reads row fields (``takes_examples``, e.g. `grpo_jax.rewards.UserRewardFn`)."""
        golds = [self.golds[r] for r in rows]
        if getattr(self.reward_fn, "takes_examples", False):
            return self.reward_fn(completions, golds, examples=[self.examples[r] for r in rows])
        return self.reward_fn(completions, golds)

    def render(self, problem) -> str:
        """A prompt's text (``config.data.template``): a problem string or a conversation's
        turns (`templates.prompt_of(example)`)."""
        return render(self.config, self.tokenizer, problem)

    def sft_data(self):
        """(tokens [N, Lp + La] int32, attention mask bool, target mask float32) for the
        supervised warm start: each prompt followed by its gold answer and EOS. The prompts are
        the dataset's own warm-start pool when it has one (disjoint from the RL prompts: the
        arithmetic task with ``num_sft > 0``), else the training pool."""
        if self.sft_examples:
            texts = [self.render(templates.prompt_of(ex)) for ex in self.sft_examples]
            prompts, prompt_mask, _ = templates.encode_prompts(
                self.tokenizer, texts, self.prompt_len, "truncate"
            )
            golds = [ex["answer"] for ex in self.sft_examples]
        else:
            prompts, prompt_mask, golds = self.prompt_tokens, self.prompt_mask, self.golds
        answers = [self.tokenizer.encode(str(g)) + [self.tokenizer.eos_ids[0]] for g in golds]
        la = min(max(len(a) for a in answers), self.max_new_tokens)
        n = len(answers)
        ans = np.full((n, la), self.tokenizer.pad_id, np.int32)
        amask = np.zeros((n, la), bool)
        for i, a in enumerate(answers):
            a = a[:la]
            ans[i, : len(a)] = a
            amask[i, : len(a)] = True
        tokens = np.concatenate([prompts, ans], axis=1)
        mask = np.concatenate([prompt_mask, amask], axis=1)
        target = np.concatenate([np.zeros_like(prompt_mask), amask], axis=1)
        return tokens, mask, target.astype(np.float32)

    def close(self) -> None:
        """Stops the reward worker processes."""
        for fn in {id(f): f for f in [self.reward_fn, *self.eval_reward_fns.values()]}.values():
            close = getattr(fn, "close", None)
            if close is not None:
                close()


def state_shardings(exp_mesh, tx, param_shardings, learner, shapes, trained_shardings=None):
    """Shardings of a train state shaped like ``shapes``: parameters by the mesh rules, every
    parameter-shaped optimizer leaf (Adam mu/nu, a master copy) like its parameter, the rest
    replicated. ``trained_shardings``: those of the optimised parameters when the optimizer
    covers only part of them (LoRA adapters; default all of ``param_shardings``)."""
    repl = sharding.replicated(exp_mesh)
    out = jax.tree.map(lambda _: repl, shapes)
    trained = param_shardings if trained_shardings is None else trained_shardings
    opt = optax.tree_map_params(
        tx, lambda _, s: s, shapes.opt_state, trained, transform_non_params=lambda _: repl
    )
    return out.replace(
        params=param_shardings, opt_state=opt, **learner.extra_shardings(shapes, exp_mesh)
    )


def _load_model(config, tokenizer, platform=None):
    """(ModelConfig, graphdef, init) of ``config.model``; ``platform`` (the mesh's devices')
    resolves ``model.attention_impl="auto"`` (None: the default backend's)."""
    mc = config.model
    overrides = dict(mc.overrides.to_dict()) if mc.overrides else {}
    if tokenizer is not None:  # None: compile-only build (vocab from the preset)
        overrides.setdefault("vocab_size", tokenizer.vocab_size)  # a preset sized to the tokenizer
    overrides.update(dtype=mc.dtype, param_dtype=mc.param_dtype, remat=mc.remat)
    overrides["attention_impl"] = attention_lib.resolve_impl(
        _opt(mc, "attention_impl", "auto"), mc.dtype, platform
    )
    lc = _opt(mc, "lora", None)
    if lc is not None and int(lc.rank) > 0:
        overrides.update(
            lora_rank=int(lc.rank), lora_alpha=float(lc.alpha), lora_targets=tuple(lc.targets)
        )
    if mc.hf_checkpoint or mc.gguf_path:
        from grpo_jax.models import loading

        if mc.hf_checkpoint:
            model_cfg, graphdef, params = loading.load_hf_checkpoint(mc.hf_checkpoint)
        else:
            model_cfg, graphdef, params = loading.load_gguf(mc.gguf_path)
        keep = ("dtype", "remat", "attention_impl", "lora_rank", "lora_alpha", "lora_targets")
        model_cfg = dataclasses.replace(
            model_cfg, **{k: v for k, v in overrides.items() if k in keep}
        )
        graphdef, _ = nnx.split(_abstract_model(model_cfg), nnx.Param)
        pure = params.to_pure_dict() if hasattr(params, "to_pure_dict") else params
        if mc.param_dtype:
            pure = jax.tree.map(lambda x: x.astype(mc.param_dtype), pure)
        if model_cfg.lora_rank:  # fresh adapters on the loaded base, in its storage dtype
            dt = mc.param_dtype or model_cfg.param_dtype
            ada = lora_lib.init_adapters(model_cfg.replace(param_dtype=dt), config.seed)
            pure = lora_lib.combine(pure, ada)
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


def _opt(section, name: str, default):
    """A config field that older configs (a workdir's config.json) may lack."""
    return section.get(name, default) if hasattr(section, "get") else default


def _load_tokenizer(config):
    own = _opt(config.model, "tokenizer", "")
    pretrained = own or config.model.hf_checkpoint or config.model.gguf_path
    if config.data.name == "arithmetic" and not pretrained:  # the built-in character vocabulary
        from grpo_jax.data import arithmetic

        return arithmetic.CharTokenizer()
    from grpo_jax.models import loading
    from grpo_jax.models import tokenizer as tokenizer_lib

    field = "tokenizer" if own else "hf_checkpoint" if config.model.hf_checkpoint else "gguf_path"
    try:
        if own or config.model.hf_checkpoint:
            src = own or config.model.hf_checkpoint
            return tokenizer_lib.Tokenizer.from_dir(loading.resolve_checkpoint(src, what=field))
        if config.model.gguf_path:
            return tokenizer_lib.Tokenizer.from_gguf(config.model.gguf_path)
    except FileNotFoundError as e:
        raise ConfigError(
            f"config.model.{field}: {e}; point it at an existing "
            f"{'GGUF file' if field == 'gguf_path' else 'directory (tokenizer.json) or hub id'}"
        ) from None
    raise ConfigError(
        "config.model: a non-arithmetic dataset needs a tokenizer: set "
        "config.model.hf_checkpoint, config.model.gguf_path or config.model.tokenizer"
    )


def _columns(config):
    from grpo_jax.data import datasets

    d = config.data
    return datasets.Columns(
        prompt=_opt(d, "prompt_column", "problem"),
        answer=_opt(d, "answer_column", "answer"),
        level=_opt(d, "level_column", ""),
        id=_opt(d, "id_column", ""),
        messages=_opt(d, "messages_column", ""),
    )


def _is_table_dir(path: str) -> bool:
    import os

    return os.path.isdir(os.path.expanduser(path)) or path.startswith("hf:") or "*" in path


def _load_examples(
    config, name: str, split: str, stats: dict | None = None, *, train: bool | None = None
) -> list[dict]:
    """The examples of a split; ``stats`` (if given) gets `datasets.load_with_stats`' counts.

    ``name``: a preset, or ``"custom"`` (``config.data.path`` with ``config.data.*_column``;
    held-out rows from ``config.data.eval_path``, else ``data.path``'s ``data.eval_split``).
    A preset equal to ``config.data.name`` with ``config.data.path`` set reads its layout from
    that table. ``train``: the training split (default: ``split == config.data.split``).
    """
    d = config.data
    if train is None:
        train = split == d.split
    if name == "arithmetic":
        from grpo_jax.data import arithmetic

        acfg = arithmetic.ArithmeticConfig(**d.arithmetic.to_dict())
        splits = arithmetic.make_splits(acfg)
        return splits[split if split in ("train", "sft") else "eval"]
    from grpo_jax import data as data_lib
    from grpo_jax.data import datasets

    path, eval_path = _opt(d, "path", ""), _opt(d, "eval_path", "")
    table = None
    if name == datasets.CUSTOM:
        if train:
            table = path
        elif eval_path:
            table, split = eval_path, d.split
        elif path and _is_table_dir(path):
            table, split = path, _opt(d, "eval_split", "test")
        else:
            raise ConfigError(
                "config.eval.datasets has 'custom': set config.data.eval_path to your held-out "
                "table (or make config.data.path a directory / hub id with an eval_split)"
            )
        if not table:
            raise ConfigError(
                "config.data.name='custom' needs config.data.path (a JSONL/Parquet file, a "
                "directory, or a hub id 'hf:org/name')"
            )
    elif name == d.name and (path or eval_path):
        if train:
            table = path or None
        elif eval_path:
            table = eval_path
        elif path and _is_table_dir(path):
            table = path
    try:
        if table is not None:
            examples, counts = datasets.load_table_with_stats(
                table,
                split,
                columns=_columns(config),
                name=name,
                config=(d.config or None) if name == d.name else None,
                bad_rows=d.bad_rows,
            )
        else:
            examples, counts = data_lib.load_with_stats(
                name,
                split,
                use_tfds=bool(_opt(d, "use_tfds", False)),
                tfds_data_dir=_opt(d, "tfds_data_dir", "") or None,
                source_dir=d.source_dir or None,
                config=(d.config or None) if name == d.name else None,
                bad_rows=d.bad_rows,
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


def render(config, tokenizer, problem) -> str:
    """A prompt's text under ``config.data.template`` (with ``data.prompt_suffix``, None = the
    DAPO boxed-answer suffix for a problem string and none for a conversation, and
    ``data.system_prompt`` for the chat template). ``problem``: a string or a conversation's
    turns (`templates.prompt_of`)."""
    d = config.data
    kw = {}
    if d.template != "arithmetic":
        kw["suffix"] = _opt(d, "prompt_suffix", None)
        if _opt(d, "system_prompt", ""):
            kw["system"] = d.system_prompt
    return templates.render_prompt(problem, template=d.template, tokenizer=tokenizer, **kw)


def build_experiment(
    config: ml_collections.ConfigDict, *, with_data: bool = True, devices=None
) -> Experiment:
    """Builds the mesh, model, tokenizer, data, reward function and optimizer of a run.

    ``devices`` (default ``jax.devices()``) are the mesh's devices: ``experiments.aot`` passes a
    TPU topology's devices (``jax.experimental.topologies``) to compile for a slice it lacks.

    ``with_data=False`` builds the compile-only pieces: no data, no reward workers and (except
    for the built-in arithmetic tokenizer) no tokenizer: the vocabulary is the preset's (or
    ``config.model.overrides.vocab_size``), eos_ids=(0,), pad 0.
    """
    try:
        algo = algorithms.get(config.algorithm.name)
    except ValueError as e:
        raise ConfigError(f"config.algorithm.name: {e}") from None
    devices = list(jax.devices() if devices is None else devices)[: config.mesh.num_devices or None]
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
    load_stats = {}  # the training rows are read first: missing or bad data fails before the weights load
    raw = (
        _load_examples(config, config.data.name, config.data.split, load_stats) if with_data else []
    )
    tokenizer = _load_tokenizer(config) if with_data or config.data.name == "arithmetic" else None
    model_cfg, graphdef, init_fn = _load_model(config, tokenizer, devices[0].platform)
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
        texts = [render(config, tokenizer, templates.prompt_of(ex)) for ex in raw]
        tokens, mask, kept, over = templates.encode_prompts(
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
            evs = _load_examples(
                config, name, "eval" if name == "arithmetic" else "test", train=False
            )
            if config.eval.max_examples:
                evs = evs[: config.eval.max_examples]
            eval_sets[name] = evs
        # pad to the longest prompt of the train and eval sets (rounded up to 8), not to the budget:
        # prefill, log-prob and update compute all scale with the padded length
        longest = int(mask.sum(axis=1).max())
        for evs in eval_sets.values():
            longest = max(
                [longest]
                + [
                    len(tokenizer.encode(render(config, tokenizer, templates.prompt_of(ex))))
                    for ex in evs
                ]
            )
        trimmed = min(lp, -(-longest // 8) * 8)
        tokens, mask, lp = tokens[:, lp - trimmed :], mask[:, lp - trimmed :], trimmed
        data_stats["prompt_tokens_padded_to"] = lp
    else:
        num_ids = 1

    steps_updates = config.steps * config.algorithm.num_iterations * (R // mb)
    # bfloat16 parameters train through a float32 master copy (state.master_weights)
    tx = make_optimizer(
        config.optimizer, steps_updates, master=(config.model.param_dtype or "float32") != "float32"
    )
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
        decode_slots=int(_opt(sc, "decode_slots", 0)),
    )
    ec = config.eval
    eval_sampling = sampling.SamplingConfig(
        max_new_tokens=ec.max_new_tokens or sc.max_new_tokens,
        temperature=ec.temperature,
        top_k=ec.top_k,
        top_p=ec.top_p,
        eos_ids=eos,
        pad_id=pad_id,
        decode_slots=int(_opt(sc, "decode_slots", 0)),
    )
    if (sc.top_k or sc.top_p < 1) and not config.algorithm.tis_cap:
        logging.warning(
            "config.rollout top_k/top_p truncate the sampler, but its log-probs (and so the "
            "ratio's 'old' policy) are the untruncated ones; set config.algorithm.tis_cap "
            "(e.g. 2) for the truncated-importance-sampling correction"
        )
    has_sft_pool = (
        with_data and config.data.name == "arithmetic" and config.data.arithmetic.get("num_sft", 0)
    )
    curriculum, learner = build_strategies(config, algo, num_ids, model_cfg, steps_updates, lp)
    reward_fn, eval_reward_fns = (
        reward_lib.make_reward_fns(config, eval_sets) if with_data else (None, {})
    )
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
        eval_sets=eval_sets,
        reward_fn=reward_fn,
        eval_reward_fns=eval_reward_fns,
        train_sampling=train_sampling,
        eval_sampling=eval_sampling,
        tx=tx,
        mini_batch_size=mb,
        generate_batch_size=gbs,
        micro_batch_size=micro,
        prompt_group_size=group,
        on_policy=(config.algorithm.num_iterations == 1 and mb == R),
        algorithm=algo,
        curriculum=curriculum,
        learner=learner,
        data_stats=data_stats,
        sft_examples=_load_examples(config, config.data.name, "sft") if has_sft_pool else [],
    )
    with exp.mesh_context():
        shapes = jax.eval_shape(exp.state_init_fn)
    trained = lora_lib.adapters(shardings) if model_cfg.lora_rank else None
    shards = state_shardings(mesh, tx, shardings, learner, shapes, trained)
    abstract = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shards
    )
    return dataclasses.replace(exp, state_shardings=shards, abstract_state=abstract)


def build_strategies(config, algo, num_prompts, model_cfg, total_updates, prompt_len):
    """The algorithm's curriculum and learner, built from their config sections.

    Raises: ConfigError naming the section of a bad value.
    """
    try:
        curriculum = algo.curriculum.from_config(config, num_prompts=num_prompts)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"config.gdro: {e}") from None
    learner = algo.learner.from_config(config, model_cfg, total_updates, prompt_len=prompt_len)
    return curriculum, learner
