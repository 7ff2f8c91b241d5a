"""Decoder model configuration (Llama / Qwen2 / Qwen3 families) and presets.

`ModelConfig` is a frozen (hashable) dataclass so it can be a `jax.jit` static argument.
`ModelConfig.from_hf_config` reads a Hugging Face `config.json` dict; `PRESETS` holds the
architectures used in the project with the values of their published HF configs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

_DTYPES = ("float32", "bfloat16", "float16")
_FAMILIES = ("llama", "qwen2", "qwen3")


LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
# The attention cores (grpo_jax.models.attention): "auto" picks one by platform.
ATTENTION_IMPLS = ("auto", "einsum", "blockwise", "splash", "cudnn")
# The integer sizes of a ModelConfig (each a positive int).
SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer (pre-RMSNorm, RoPE, GQA, SwiGLU).

    Fields:
      vocab_size, hidden_size, intermediate_size (SwiGLU width), num_layers,
      num_heads (query heads), num_kv_heads (key/value heads, GQA; divides num_heads),
      head_dim (per-head width; may differ from hidden_size // num_heads, e.g. Qwen3).
      rope_theta: RoPE base (Su et al. 2021, "RoFormer", eq. 15), HF rotate_half layout.
      rms_norm_eps: epsilon of RMSNorm (Zhang & Sennrich 2019).
      tie_word_embeddings: lm_head shares the token embedding matrix.
      qk_norm: per-head RMSNorm on queries and keys before RoPE (Qwen3).
      qkv_bias: bias on the q/k/v projections (Qwen2 / Qwen2.5).
      max_position_embeddings: informational (positions are not clipped).
      dtype: activation / compute dtype ("float32" | "bfloat16"); softmax and norms run in float32.
      param_dtype: storage dtype of the parameters.
      remat: rematerialise each layer's activations in the backward pass (jax.checkpoint).
      attention_impl: the attention core (`grpo_jax.models.attention`): "einsum" (grouped
        einsums over the whole [T, S] float32 scores; the einsum core's probabilities are
        recomputed in the backward pass, `recompute_in_backward`), "blockwise" (online-softmax
        tiles in plain XLA with its own VJP: no [T, S] array), "splash" (TPU Pallas kernel),
        "cudnn" (GPU, bfloat16/float16 only) or "auto" (TPU -> splash, GPU -> cudnn for 16-bit
        activations else blockwise, CPU -> `attention.CPU_DEFAULT`). Decoding one token over a
        KV cache always uses the einsum.
      family: "llama" | "qwen2" | "qwen3" (informational; used for HF config export).
      lora_rank, lora_alpha, lora_targets: low-rank adapters (Hu et al. 2021, "LoRA") on the
        named projections ("q", "k", "v", "o", "gate", "up", "down"): W x + (alpha / rank) B A x,
        A [in, rank], B [rank, out] (zero-initialised); rank 0 = no adapters (the plain model).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    qkv_bias: bool = False
    max_position_embeddings: int = 4096
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: bool = False
    attention_impl: str = "auto"
    family: str = "llama"
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple = ("q", "k", "v", "o", "gate", "up", "down")

    def __post_init__(self):
        for name in SIZE_FIELDS:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(
                    f"ModelConfig.{name} must be one of {_DTYPES}, got {getattr(self, name)!r}"
                )
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(
                f"ModelConfig.attention_impl must be one of {ATTENTION_IMPLS}, "
                f"got {self.attention_impl!r}"
            )
        if self.attention_impl == "cudnn" and self.dtype not in ("bfloat16", "float16"):
            raise ValueError(
                f"ModelConfig.attention_impl='cudnn' takes dtype bfloat16 or float16 (cuDNN's "
                f"flash attention), got {self.dtype!r}; use 'blockwise' for float32"
            )
        if self.family not in _FAMILIES:
            raise ValueError(f"ModelConfig.family must be one of {_FAMILIES}, got {self.family!r}")
        if not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise ValueError(f"ModelConfig.lora_rank must be an int >= 0, got {self.lora_rank!r}")
        object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        bad = set(self.lora_targets) - set(LORA_TARGETS)
        if bad:
            raise ValueError(
                f"ModelConfig.lora_targets: unknown {sorted(bad)}; valid: {LORA_TARGETS}"
            )

    @property
    def lora_scale(self) -> float:
        """alpha / rank, the adapters' output scale (0 without adapters)."""
        return self.lora_alpha / self.lora_rank if self.lora_rank else 0.0

    def lora_on(self, target: str) -> bool:
        """Whether projection ``target`` ("q", ..., "down") carries an adapter."""
        return self.lora_rank > 0 and target in self.lora_targets

    def replace(self, **overrides) -> ModelConfig:
        """Copy with some fields changed."""
        return dataclasses.replace(self, **overrides)

    @property
    def num_params(self) -> int:
        """Number of parameters (embedding counted once when tied)."""
        e, f, h, kv, d = (
            self.hidden_size,
            self.intermediate_size,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
        )
        attn = e * h * d * 2 + e * kv * d * 2
        if self.qkv_bias:
            attn += (h + 2 * kv) * d
        if self.qk_norm:
            attn += 2 * d
        layer = attn + 3 * e * f + 2 * e
        emb = self.vocab_size * e * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + emb + e

    @classmethod
    def from_hf_config(cls, d: dict[str, Any], **overrides) -> ModelConfig:
        """Build from a Hugging Face `config.json` dict (LlamaForCausalLM, Qwen2ForCausalLM,
        Qwen3ForCausalLM). `overrides` replace fields afterwards (e.g. dtype="bfloat16").

        Raises ValueError on an unsupported architecture or feature (rope scaling, biases
        other than Qwen2's q/k/v bias, non-SiLU activation).
        """
        model_type = d.get("model_type", "")
        archs = d.get("architectures") or []
        if model_type in ("llama", "mistral") or any("Llama" in a for a in archs):
            family = "llama"
        elif model_type == "qwen2" or any("Qwen2For" in a for a in archs):
            family = "qwen2"
        elif model_type == "qwen3" or any("Qwen3For" in a for a in archs):
            family = "qwen3"
        else:
            raise ValueError(
                f"unsupported HF model_type {model_type!r} (architectures {archs}); "
                f"supported: llama, qwen2, qwen3"
            )
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}; only 'silu' (SwiGLU) is supported")
        rope_scaling = d.get("rope_scaling")
        rope_params = d.get("rope_parameters") or {}
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) not in (
            None,
            "default",
        ):
            raise ValueError(f"unsupported rope_scaling {rope_scaling!r}")
        if rope_params.get("rope_type", "default") != "default":
            raise ValueError(f"unsupported rope_parameters {rope_params!r}")
        if d.get("mlp_bias"):
            raise ValueError("unsupported mlp_bias=True")
        if family != "qwen2" and d.get("attention_bias"):
            raise ValueError("unsupported attention_bias=True for this family (o_proj bias)")
        rope_theta = d.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        num_heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // num_heads
        kw = dict(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rope_theta=float(rope_theta),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qk_norm=family == "qwen3",
            qkv_bias=family == "qwen2",
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            family=family,
        )
        kw.update(overrides)
        return cls(**kw)

    def to_hf_config(self) -> dict[str, Any]:
        """The Hugging Face `config.json` dict for this architecture (inverse of from_hf_config)."""
        arch = {
            "llama": "LlamaForCausalLM",
            "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM",
        }[self.family]
        d = {
            "architectures": [arch],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": True,
            "torch_dtype": self.param_dtype,
        }
        if self.family == "llama":
            d.update(attention_bias=False, mlp_bias=False, rope_scaling=None)
        elif self.family == "qwen2":
            d.update(
                use_sliding_window=False, sliding_window=None, max_window_layers=self.num_layers
            )
        else:
            d.update(
                attention_bias=False,
                use_sliding_window=False,
                sliding_window=None,
                max_window_layers=self.num_layers,
            )
        if self.qkv_bias != (self.family == "qwen2") or self.qk_norm != (self.family == "qwen3"):
            raise ValueError(
                f"family {self.family!r} cannot express qkv_bias={self.qkv_bias}, "
                f"qk_norm={self.qk_norm} in a Hugging Face config"
            )
        return d


_QWEN3 = dict(
    vocab_size=151936,
    head_dim=128,
    num_kv_heads=8,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    qk_norm=True,
    max_position_embeddings=40960,
    family="qwen3",
)

PRESETS: dict[str, ModelConfig] = {
    # Tiny random model for tests and the embedded default (GQA 4:2, QK-norm on).
    "tiny": ModelConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        qk_norm=True,
        max_position_embeddings=512,
        family="qwen3",
    ),
    # HuggingFaceTB/SmolLM2-135M(-Instruct) config.json.
    "smollm2-135m": ModelConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        family="llama",
    ),
    # Qwen/Qwen3-{1.7B,4B,8B} config.json.
    "qwen3-1.7b": ModelConfig(
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=28,
        num_heads=16,
        tie_word_embeddings=True,
        **_QWEN3,
    ),
    "qwen3-4b": ModelConfig(
        hidden_size=2560,
        intermediate_size=9728,
        num_layers=36,
        num_heads=32,
        tie_word_embeddings=True,
        **_QWEN3,
    ),
    "qwen3-8b": ModelConfig(
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=36,
        num_heads=32,
        tie_word_embeddings=False,
        **_QWEN3,
    ),
}


def get_preset(name: str, **overrides) -> ModelConfig:
    """Preset `name` with `overrides` applied. Raises ValueError listing the presets on a bad name."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; available: {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
