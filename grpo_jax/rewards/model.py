"""A learned reward model as a reward (``config.reward.model``).

The reward model is a Hugging Face ``*ForSequenceClassification`` checkpoint of the Llama /
Qwen2 / Qwen3 families (a directory, or a hub id already in the local Hugging Face cache):
the decoder trunk (``model.*``, loaded by `grpo_jax.models.loading.load_hf_checkpoint` into the
project's own `grpo_jax.models.transformer.Transformer`, no lm_head) and a bias-free ``score``
Linear ``[1, E]`` applied to the final-norm hidden state of the last non-pad token, as
transformers does: the rightmost position whose token is not ``config.json``'s
``pad_token_id`` (with no ``pad_token_id``: the last real token).

What it scores (``config.reward.model_template``):

* ``"text"`` (default): the prompt text the policy saw (its template applied, e.g. the
  arithmetic task's ``"12+7="`` or the policy's chat template) followed directly by the
  completion text (cut at EOS), tokenised with the reward model's own tokenizer (the policy's
  token ids are never fed to it: the two vocabularies may differ).
* ``"chat"``: the conversation ``[*prompt turns, {"role": "assistant", "content": completion}]``
  rendered by the reward model's chat template (no generation prompt); the prompt turns are the
  row's ``messages`` or ``[{"role": "user", "content": problem}]``. Most released reward models
  were trained on this format.

The frozen weights are placed parameter by parameter directly into the shardings the policy's
(and the frozen reference's) parameters get from `grpo_jax.sharding.param_shardings`; the
forward is one jitted program on the run's mesh, rows over ``data x fsdp``. Texts are scored
in batches of ``config.reward.model_batch_size`` rows padded to a power-of-two length (a few
compiled shapes per run), with one host sync per call.

`ModelReward` combines it with the verifier: ``reward = verifier_weight * verifier_reward +
model_weight * score``; ``correct`` (pass rates, GDRO bins) stays the verifier's.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax import sharding, transfer
from grpo_jax.models import attention as attention_lib
from grpo_jax.models import loading, transformer
from grpo_jax.models import tokenizer as tokenizer_lib
from grpo_jax.models.config import ModelConfig

__all__ = [
    "ModelReward",
    "RewardModelScorer",
    "abstract_params",
    "load_reward_model",
    "make_score_fn",
    "reward_model_config",
    "score_tokens",
]

TEMPLATES = ("text", "chat")
_MIN_LEN = 16  # shortest padded length (lengths are padded to powers of two from here)


def reward_model_config(hf_config: dict, **overrides) -> ModelConfig:
    """The decoder of a ``*ForSequenceClassification`` config.json (no lm_head: tied).

    Raises: ValueError (one line) when the config is not a one-label sequence classifier of a
    supported family."""
    archs = hf_config.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in archs):
        raise ValueError(
            f"not a sequence-classification checkpoint (architectures {archs}); a reward model "
            "is a *ForSequenceClassification model (Llama / Qwen2 / Qwen3) with one label"
        )
    labels = hf_config.get("num_labels") or len(hf_config.get("id2label") or {0: 0})
    if labels != 1:
        raise ValueError(f"the score head has {labels} labels; a reward model has one")
    return ModelConfig.from_hf_config(hf_config, **{**overrides, "tie_word_embeddings": True})


def abstract_params(model_cfg: ModelConfig):
    """(graphdef of the trunk's `Transformer`, {"decoder": abstract Params state, "score":
    ShapeDtypeStruct [E]}) without memory."""
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: transformer.Transformer(model_cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model, nnx.Param)
    score = jax.ShapeDtypeStruct((model_cfg.hidden_size,), jnp.dtype(model_cfg.param_dtype))
    return graphdef, {"decoder": state, "score": score}


def param_shardings(model_cfg: ModelConfig, mesh):
    """The reward model's parameter shardings: the trunk as the policy's and the reference's
    (`grpo_jax.sharding.param_shardings`), the score vector replicated. Pure dicts."""
    _, abstract = abstract_params(model_cfg)
    return {
        "decoder": sharding.param_shardings(abstract["decoder"], mesh),
        "score": sharding.replicated(mesh),
    }


def load_reward_model(path_or_id: str, mesh, *, dtype: str = "float32", platform=None):
    """Loads a reward-model checkpoint onto ``mesh``.

    Args:
      path_or_id: a checkpoint directory or a hub id in the local Hugging Face cache (never
        downloaded).
      mesh: the run's mesh; parameters are placed in `param_shardings`.
      dtype: "float32" | "bfloat16": the weights' storage and compute dtype.
      platform: the mesh's platform (resolves attention_impl "auto"; None: the default).
    Returns:
      (ModelConfig, graphdef, params {"decoder": pure dict, "score": [E]}, pad_token_id or None,
      `grpo_jax.models.tokenizer.Tokenizer`).
    Raises:
      FileNotFoundError / ValueError (one line) naming the missing file or what is wrong.
    """
    path = loading.resolve_checkpoint(path_or_id, what="reward model", download=False)
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"checkpoint config not found: {cfg_path}")
    with open(cfg_path, encoding="utf-8") as f:
        hf_cfg = json.load(f)
    impl = attention_lib.resolve_impl("auto", dtype, platform)
    model_cfg = reward_model_config(hf_cfg, dtype=dtype, param_dtype=dtype, attention_impl=impl)
    score = loading.read_tensor(path, "score.weight")
    if score is None or tuple(score.shape) != (1, model_cfg.hidden_size):
        got = "no tensor" if score is None else f"shape {tuple(score.shape)}"
        raise ValueError(
            f"{path}: expected the score head 'score.weight' [1, {model_cfg.hidden_size}] (a "
            f"reward model has num_labels=1), got {got}"
        )
    tokenizer = tokenizer_lib.Tokenizer.from_dir(path)
    shards = param_shardings(model_cfg, mesh)
    _, graphdef, decoder = loading.load_hf_checkpoint(
        path, mesh=mesh, shardings=shards["decoder"], **_cfg_fields(model_cfg)
    )
    score = jax.device_put(score[0].astype(dtype), shards["score"])
    params = {"decoder": decoder.to_pure_dict(), "score": score}
    return model_cfg, graphdef, params, hf_cfg.get("pad_token_id"), tokenizer


def _cfg_fields(model_cfg: ModelConfig) -> dict:
    keep = ("dtype", "param_dtype", "attention_impl", "tie_word_embeddings")
    return {k: getattr(model_cfg, k) for k in keep}


def score_tokens(graphdef, params, tokens, mask, *, pad_id: int | None) -> jax.Array:
    """The reward model's score of each row.

    Args:
      graphdef, params: `abstract_params` / `load_reward_model`'s.
      tokens: [B, T] int32, padded either side; mask: [B, T] bool, True on real tokens.
      pad_id: config.json's ``pad_token_id``: the scored position is the rightmost real token
        that is not it (transformers' rule; None = the rightmost real token).
    Returns:
      [B] float32 scores (a row without real tokens gets a finite, meaningless score).
    """
    model = nnx.merge(graphdef, params["decoder"])
    positions = transformer.positions_from_mask(mask)
    hidden, _ = model(tokens, positions, mask, return_hidden=True)  # [B, T, E]
    real = mask if pad_id is None else mask & (tokens != pad_id)
    last = jnp.argmax(jnp.where(real, jnp.arange(tokens.shape[1]), -1), axis=-1)  # [B]
    h = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]  # [B, E]
    return h.astype(jnp.float32) @ params["score"].astype(jnp.float32)


def make_score_fn(graphdef, mesh, shardings, pad_id: int | None):
    """``score(params, tokens [B, T] int32, mask [B, T] bool) -> [B] float32``, jitted on
    ``mesh`` (params in ``shardings``, rows over the batch axes; B a multiple of them)."""
    batch = sharding.batch_sharding(mesh, 2)
    fn = functools.partial(score_tokens, graphdef, pad_id=pad_id)
    return jax.jit(
        sharding.under_mesh(mesh, fn),
        in_shardings=(shardings, batch, batch),
        out_shardings=sharding.batch_sharding(mesh),
    )


def _padded_len(n: int, cap: int) -> int:
    """The padded length of a batch whose longest row has ``n`` tokens: a power of two from
    `_MIN_LEN` (few compiled shapes), at most ``cap`` when ``cap > 0`` (rows were cut to it)."""
    length = max(_MIN_LEN, 1 << max(n - 1, 0).bit_length())
    return min(length, cap) if cap > 0 else length


class RewardModelScorer:
    """A frozen reward model that scores texts on the run's mesh (see the module docstring).

    Attributes:
      model_config, graphdef, params: the loaded model (params sharded, see `param_shardings`).
      tokenizer: the reward model's own tokenizer; pad_id: config.json's pad_token_id.
      batch_size: rows per forward (0 = all rows of a call at once); max_tokens: longer texts
        keep their last max_tokens tokens (0 = no cap); template: "text" | "chat".
    """

    def __init__(
        self,
        model_config,
        graphdef,
        params,
        tokenizer,
        mesh,
        *,
        pad_id=None,
        batch_size: int = 0,
        max_tokens: int = 0,
        template: str = "text",
    ):
        if template not in TEMPLATES:
            raise ValueError(f"template must be one of {TEMPLATES}, got {template!r}")
        self.model_config, self.graphdef, self.params = model_config, graphdef, params
        self.tokenizer, self.mesh, self.pad_id = tokenizer, mesh, pad_id
        self.batch_size, self.max_tokens, self.template = batch_size, max_tokens, template
        shardings = jax.tree.map(lambda x: x.sharding, params)
        self._score = make_score_fn(graphdef, mesh, shardings, pad_id)

    @classmethod
    def load(cls, path_or_id: str, mesh, *, dtype: str = "float32", platform=None, **kw):
        """`load_reward_model` + a scorer (``kw``: batch_size, max_tokens, template)."""
        cfg, graphdef, params, pad_id, tok = load_reward_model(
            path_or_id, mesh, dtype=dtype, platform=platform
        )
        return cls(cfg, graphdef, params, tok, mesh, pad_id=pad_id, **kw)

    def texts(self, prompts: Sequence[str], completions: Sequence[str], examples=None) -> list:
        """What the reward model reads for each (prompt, completion) (``template``; "chat"
        reads the rows' example dicts ``examples``: ``messages`` or ``problem``)."""
        if self.template == "text":
            return [p + c for p, c in zip(prompts, completions)]
        if examples is None:
            raise ValueError("the 'chat' template needs the rows' examples")
        out = []
        for ex, c in zip(examples, completions):
            turns = ex.get("messages") or [{"role": "user", "content": str(ex["problem"])}]
            convo = [*turns, {"role": "assistant", "content": c}]
            out.append(self.tokenizer.apply_chat_template(convo, add_generation_prompt=False))
        return out

    def encode(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray, int]:
        """(tokens [N, T] int32 right-padded, mask [N, T] bool, rows cut to max_tokens)."""
        # a chat-rendered text carries the template's own BOS (transformers tokenizes it so too)
        ids = self.tokenizer.encode_batch(list(texts), add_special_tokens=self.template == "text")
        cut = 0
        if self.max_tokens > 0:
            cut = sum(len(x) > self.max_tokens for x in ids)
            ids = [x[-self.max_tokens :] for x in ids]
        length = _padded_len(max((len(x) for x in ids), default=1), self.max_tokens)
        tokens = np.full((len(ids), length), self.tokenizer.pad_id, np.int32)
        mask = np.zeros((len(ids), length), bool)
        for i, x in enumerate(ids):
            tokens[i, : len(x)], mask[i, : len(x)] = x, True
        return tokens, mask, cut

    def score(self, texts: Sequence[str]) -> tuple[np.ndarray, int]:
        """Scores ``texts``: ([N] float32, rows cut to max_tokens). One host sync."""
        tokens, mask, cut = self.encode(texts)
        n, div = len(texts), sharding.batch_divisor(self.mesh)
        b = self.batch_size or -(-n // div) * div
        rows = -(-n // b) * b  # padding rows have no real tokens; their scores are dropped
        tokens = np.pad(tokens, ((0, rows - n), (0, 0)), constant_values=self.tokenizer.pad_id)
        mask = np.pad(mask, ((0, rows - n), (0, 0)))
        parts = [
            self._score(
                self.params,
                transfer.to_device(self.mesh, tokens[s : s + b]),
                transfer.to_device(self.mesh, mask[s : s + b]),
            )
            for s in range(0, rows, b)
        ]
        scores = np.concatenate(transfer.to_host(parts))[:n]
        return scores.astype(np.float32), cut


class ModelReward:
    """The training reward with a reward model: the verifier's reward, correctness and stats,
    plus the reward model's score of (prompt, completion).

    ``__call__(completions, golds, examples=None, prompts=None) -> (rewards [R] float32,
    correct [R] bool, stats)`` with ``rewards = verifier_weight * verifier_rewards +
    model_weight * scores``; ``prompts`` ([R] the prompt texts the policy saw) are required.
    Stats add ``model_score_sum`` (float, the sum of the raw scores), ``num_model_scored`` and
    ``num_model_truncated``. ``verifier`` is the verifier alone (evaluation uses it).
    """

    takes_examples = True
    takes_prompts = True

    def __init__(
        self,
        verifier,
        scorer: RewardModelScorer,
        *,
        model_weight: float = 1.0,
        verifier_weight: float = 1.0,
    ):
        self.verifier, self.scorer = verifier, scorer
        self.model_weight, self.verifier_weight = float(model_weight), float(verifier_weight)

    def extract(self, completion: str):
        """The verifier's answer extraction (maj@k)."""
        return self.verifier.extract(completion)

    def __call__(self, completions, golds, examples=None, prompts=None):
        if prompts is None or len(prompts) != len(completions):
            raise ValueError("a reward model needs the prompt text of every completion (prompts=)")
        kw = {"examples": examples} if getattr(self.verifier, "takes_examples", False) else {}
        rewards, correct, stats = self.verifier(completions, golds, **kw)
        t0 = time.perf_counter()
        scores, cut = self.scorer.score(self.scorer.texts(prompts, completions, examples))
        combined = np.float32(self.verifier_weight) * np.asarray(rewards, np.float32)
        combined = combined + np.float32(self.model_weight) * scores
        stats = dict(stats)
        stats["model_score_sum"] = float(scores.sum(dtype=np.float64))
        stats["num_model_scored"] = len(scores)
        stats["num_model_truncated"] = cut
        stats["seconds"] = stats.get("seconds", 0.0) + time.perf_counter() - t0
        return combined.astype(np.float32), correct, stats

    def close(self) -> None:
        """Stops the verifier's workers."""
        close = getattr(self.verifier, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> ModelReward:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
