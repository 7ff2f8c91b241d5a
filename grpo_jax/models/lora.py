"""LoRA on the plain parameter dicts: the trained adapters apart from the frozen base, and merged
back into the base weights (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language
Models").

With ``ModelConfig.lora_rank = r > 0`` the policy's parameter dict (``nnx.split(model,
nnx.Param)``, ``to_pure_dict()``) holds, beside each targeted projection ``X_proj``, an adapter
``X_lora = {"lora_a": [L, *in, r], "lora_b": [L, r, *out]}`` (`transformer.LoRAAdapter`). The
trainer differentiates and optimises only the adapters (`adapters`), holding the base fixed
(`combine(base, adapters)` rebuilds the full dict); `merge` folds ``W + (alpha / r) A B`` into
a plain parameter dict of the model without adapters (the exported HF weights).

Every function here works on nested dicts of any leaves (arrays, shapes, shardings).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util

from grpo_jax.models import transformer
from grpo_jax.models.config import ModelConfig

SUFFIX = "_lora"


def _is_adapter(path) -> bool:
    return any(str(k).endswith(SUFFIX) for k in path)


def split(params: dict) -> tuple[dict, dict]:
    """(base, adapters): the parameter dict without / with only the ``*_lora`` subtrees."""
    flat = traverse_util.flatten_dict(params)
    base = {k: v for k, v in flat.items() if not _is_adapter(k)}
    ada = {k: v for k, v in flat.items() if _is_adapter(k)}
    return traverse_util.unflatten_dict(base), traverse_util.unflatten_dict(ada)


def adapters(params: dict) -> dict:
    """The adapter subtrees only (what LoRA trains and what its optimizer state covers)."""
    return split(params)[1]


def combine(base: dict, ada: dict) -> dict:
    """The full parameter dict from the base and the adapters (inverse of `split`)."""
    flat = traverse_util.flatten_dict(base)
    flat.update(traverse_util.flatten_dict(ada))
    return traverse_util.unflatten_dict(flat)


def merge(params: dict, config: ModelConfig) -> dict:
    """The plain model's parameters: each ``X_proj`` becomes ``W + (alpha / r) A B`` (in
    float32, cast to W's dtype) and the adapters are dropped. Identity without adapters."""
    base, ada = split(params)
    if not ada:
        return base
    flat = traverse_util.flatten_dict(base)
    scale = float(config.lora_scale)
    flat_ada = traverse_util.flatten_dict(ada)
    for prefix in sorted({k[:-1] for k in flat_ada}):
        a = jnp.asarray(flat_ada[prefix + ("lora_a",)], jnp.float32)
        b = jnp.asarray(flat_ada[prefix + ("lora_b",)], jnp.float32)
        key = prefix[:-1] + (str(prefix[-1])[: -len(SUFFIX)] + "_proj",)
        w = flat[key]
        L, r = a.shape[0], a.shape[-1]
        delta = (a.reshape(L, -1, r) @ b.reshape(L, r, -1)).reshape(w.shape)
        flat[key] = (jnp.asarray(w, jnp.float32) + scale * delta).astype(w.dtype)
    return traverse_util.unflatten_dict(flat)


def init_adapters(config: ModelConfig, seed: int = 0) -> dict:
    """Fresh adapters (A He-uniform, B zeros) for a base loaded from a checkpoint, as the
    model's own initialiser draws them (one key per adapter, folded from ``seed``)."""

    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: transformer.Transformer(config, rngs=nnx.Rngs(0)))
    shapes = adapters(nnx.split(abstract, nnx.Param)[1].to_pure_dict())
    flat = traverse_util.flatten_dict(shapes)
    out = {}
    for i, (path, s) in enumerate(sorted(flat.items())):
        if str(path[-1]) == "lora_b":
            out[path] = jnp.zeros(s.shape, s.dtype)
            continue
        n_in = s.ndim - 2  # [L, *in, r]
        init = jax.nn.initializers.variance_scaling(
            2.0,
            "fan_in",
            "uniform",
            in_axis=tuple(range(1, 1 + n_in)),
            out_axis=-1,
            batch_axis=(0,),
        )
        out[path] = init(jax.random.fold_in(jax.random.PRNGKey(seed), i), s.shape, s.dtype)
    return traverse_util.unflatten_dict(out)


def num_bytes(tree) -> int:
    """Bytes of every array leaf of ``tree``."""
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))
