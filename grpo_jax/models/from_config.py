"""The policy of a run, built from its config (``config.model``): tokenizer and model."""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from grpo_jax.errors import ConfigError
from grpo_jax.models import attention as attention_lib
from grpo_jax.models import config as model_config_lib
from grpo_jax.models import loading, transformer
from grpo_jax.models import lora as lora_lib
from grpo_jax.models import tokenizer as tokenizer_lib


def load_tokenizer(config):
    """The run's tokenizer: ``config.model.tokenizer``, else the checkpoint's (HF dir / hub id
    or GGUF); the built-in character vocabulary for the arithmetic task without a checkpoint.

    Raises: ConfigError naming the ``config.model`` field of a missing file, or when a
    non-arithmetic dataset has no tokenizer at all.
    """
    mc = config.model
    own = mc.tokenizer
    if config.data.name == "arithmetic" and not (own or mc.hf_checkpoint or mc.gguf_path):
        return tokenizer_lib.CharTokenizer()
    field = "tokenizer" if own else "hf_checkpoint" if mc.hf_checkpoint else "gguf_path"
    try:
        if own or mc.hf_checkpoint:
            src = loading.resolve_checkpoint(own or mc.hf_checkpoint, what=field)
            return tokenizer_lib.Tokenizer.from_dir(src)
        if mc.gguf_path:
            return tokenizer_lib.Tokenizer.from_gguf(mc.gguf_path)
    except FileNotFoundError as e:
        kind = "GGUF file" if field == "gguf_path" else "directory (tokenizer.json) or hub id"
        raise ConfigError(f"config.model.{field}: {e}; point it at an existing {kind}") from None
    raise ConfigError(
        "config.model: a non-arithmetic dataset needs a tokenizer: set "
        "config.model.hf_checkpoint, config.model.gguf_path or config.model.tokenizer"
    )


def abstract_model(model_cfg, cls=None):
    """The model of ``model_cfg`` with shapes only (``nnx.eval_shape``; no memory)."""
    cls = cls or transformer.Transformer
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(lambda: cls(model_cfg, rngs=nnx.Rngs(0)))


def _overrides(config, tokenizer, platform) -> dict:
    mc = config.model
    overrides = dict(mc.overrides) if mc.overrides else {}
    if tokenizer is not None:  # None: compile-only build (vocab from the preset)
        overrides.setdefault("vocab_size", tokenizer.vocab_size)  # a preset sized to the tokenizer
    overrides.update(dtype=mc.dtype, param_dtype=mc.param_dtype, remat=mc.remat)
    overrides["attention_impl"] = attention_lib.resolve_impl(mc.attention_impl, mc.dtype, platform)
    if int(mc.lora.rank) > 0:
        overrides.update(
            lora_rank=int(mc.lora.rank),
            lora_alpha=float(mc.lora.alpha),
            lora_targets=tuple(mc.lora.targets),
        )
    return overrides


def _first_layers(model_cfg, pure, n):
    """(config, params) of the checkpoint's first ``n`` layers (a truncated model: smoke tests
    of a real checkpoint's pipeline at a fraction of its compute). Raises ConfigError unless
    1 <= n <= its layers (checked here too: `build_experiment` may be called unvalidated)."""
    total = model_cfg.num_layers
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= total:
        raise ConfigError(
            f"config.model.first_layers={n!r}: the checkpoint has {total} layers; give "
            f"1..{total}, or 0 for all"
        )
    pure = {**pure, "model": {**pure["model"]}}
    pure["model"]["layers"] = jax.tree.map(lambda x: x[:n], pure["model"]["layers"])
    return dataclasses.replace(model_cfg, num_layers=n), pure


def load_model(config, tokenizer, platform=None):
    """(ModelConfig, graphdef, init) of ``config.model``: a preset initialised from
    ``config.seed``, or a checkpoint's weights (HF dir / hub id, GGUF; its first
    ``model.first_layers`` layers when > 0) with fresh LoRA adapters when
    ``model.lora.rank > 0``. ``init() -> params`` (a pure dict) is pure; ``platform`` (the
    mesh's devices') resolves ``model.attention_impl="auto"`` (None: the default backend's).
    Raises ConfigError: ``model.first_layers`` not an integer in 0 .. the checkpoint's layers."""
    mc = config.model
    overrides = _overrides(config, tokenizer, platform)
    if not (mc.hf_checkpoint or mc.gguf_path):
        model_cfg = model_config_lib.get_preset(mc.preset, **overrides)

        def init():
            with nnx.use_eager_sharding(False):
                model = transformer.Transformer(model_cfg, rngs=nnx.Rngs(config.seed))
            return nnx.split(model, nnx.Param)[1].to_pure_dict()

        graphdef, _ = nnx.split(abstract_model(model_cfg), nnx.Param)
        return model_cfg, graphdef, init
    if mc.hf_checkpoint:
        model_cfg, _, params = loading.load_hf_checkpoint(mc.hf_checkpoint)
    else:
        model_cfg, _, params = loading.load_gguf(mc.gguf_path)
    keep = ("dtype", "remat", "attention_impl", "lora_rank", "lora_alpha", "lora_targets")
    model_cfg = dataclasses.replace(model_cfg, **{k: v for k, v in overrides.items() if k in keep})
    pure = params.to_pure_dict() if hasattr(params, "to_pure_dict") else params
    if mc.first_layers:
        model_cfg, pure = _first_layers(model_cfg, pure, mc.first_layers)
    graphdef, _ = nnx.split(abstract_model(model_cfg), nnx.Param)
    if mc.param_dtype:
        pure = jax.tree.map(lambda x: x.astype(mc.param_dtype), pure)
    if model_cfg.lora_rank:  # fresh adapters on the loaded base, in its storage dtype
        dt = mc.param_dtype or model_cfg.param_dtype
        ada = lora_lib.init_adapters(model_cfg.replace(param_dtype=dt), config.seed)
        pure = lora_lib.combine(pure, ada)
    return model_cfg, graphdef, lambda: pure
