"""A learned reward model as a reward (``config.reward.model``, `grpo_jax.rewards.model`).

Parity with transformers' ``*ForSequenceClassification`` needs the `parity` extra (torch +
transformers): tiny random checkpoints are built with transformers and saved to tmp_path
(nothing is downloaded).
"""

import json
import string

import jax
import numpy as np
import pytest

from grpo_jax import sharding, train, writers
from grpo_jax.errors import ConfigError
from grpo_jax.rewards import from_config as reward_from_config
from grpo_jax.rewards import model as rm
from tests.test_train import smoke_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

_CHARS = string.digits + string.ascii_letters + "+-=*/ .,?:!()"
_VOCAB = {"<pad>": 0, "<eos>": 1, "[UNK]": 2, **{ch: i + 3 for i, ch in enumerate(_CHARS)}}
_COMMON = dict(
    vocab_size=len(_VOCAB),
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    num_labels=1,
    pad_token_id=0,
    eos_token_id=1,
)


def _save_tokenizer(path):
    """A character-level tokenizer (one id per character) that transformers loads too."""
    import tokenizers

    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(_VOCAB, unk_token="[UNK]"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Split(
        tokenizers.Regex(r"[\s\S]"), behavior="isolated"
    )
    tk.add_special_tokens(["<pad>", "<eos>"])
    tk.save(str(path / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "[UNK]",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))


def make_rm(path, family="qwen2", seed=0, cls_name="ForSequenceClassification"):
    """A tiny random HF reward model (+ tokenizer) saved in ``path``; returns the torch model."""
    cfg = {
        "qwen3": lambda: transformers.Qwen3Config(head_dim=32, rope_theta=1e6, **_COMMON),
        "qwen2": lambda: transformers.Qwen2Config(rope_theta=1e4, **_COMMON),
        "llama": lambda: transformers.LlamaConfig(rope_theta=1e4, **_COMMON),
    }[family]()
    torch.manual_seed(seed)
    auto = {
        "ForSequenceClassification": transformers.AutoModelForSequenceClassification,
        "ForCausalLM": transformers.AutoModelForCausalLM,
    }[cls_name]
    model = auto.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # larger-than-default weights so every branch matters
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
            else:
                p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.5)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    _save_tokenizer(path)
    return model


def _hf_scores(model, path, texts, side):
    # the tokenizer.json pipeline as saved (AutoTokenizer would rebuild a Qwen2 one from the
    # config's model_type)
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(path / "tokenizer.json"), pad_token="<pad>", eos_token="<eos>"
    )
    tok.padding_side = side
    enc = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        return model(**enc).logits[:, 0].numpy(), enc["attention_mask"].numpy()


def _mesh(n=1):
    return sharding.make_mesh({"data": n}, jax.devices()[:n])


_TEXTS = ["12+7=19", "3+4=", "What is 2*21? 42", "a", "100-1=99 and more text here"]


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_scores_match_transformers(family, tmp_path):
    model = make_rm(tmp_path, family)
    scorer = rm.RewardModelScorer.load(str(tmp_path), _mesh(2), batch_size=2)
    ours, cut = scorer.score(_TEXTS)
    assert ours.shape == (len(_TEXTS),) and ours.dtype == np.float32 and cut == 0
    for side in ("right", "left"):
        ref, mask = _hf_scores(model, tmp_path, _TEXTS, side)
        assert mask.min() == 0  # the batch is padded
        diff = float(np.abs(ours - ref).max())
        print(f"{family} ({side} padding in transformers): max |score diff| = {diff:.2e}")
        assert diff <= 1e-4, (family, side, ours, ref)
    assert np.abs(ours).max() > 0.1 and np.ptp(ours) > 0.1  # not a degenerate comparison


def test_pad_token_inside_text_follows_transformers(tmp_path):
    """transformers scores the rightmost token that is not pad_token_id, even inside the text."""
    model = make_rm(tmp_path, "qwen2", seed=1)
    texts = ["1+1=2<pad>", "7*6=42"]
    scorer = rm.RewardModelScorer.load(str(tmp_path), _mesh(1))
    ours, _ = scorer.score(texts)
    ref, _ = _hf_scores(model, tmp_path, texts, "right")
    np.testing.assert_allclose(ours, ref, atol=1e-4)


def test_max_tokens_keeps_the_last_tokens(tmp_path):
    model = make_rm(tmp_path, "llama")
    scorer = rm.RewardModelScorer.load(str(tmp_path), _mesh(1), max_tokens=8)
    ours, cut = scorer.score(_TEXTS)
    assert cut == 2  # "What is 2*21? 42" and the long one
    ref, _ = _hf_scores(model, tmp_path, [t[-8:] for t in _TEXTS], "right")
    np.testing.assert_allclose(ours, ref, atol=1e-4)


def test_chat_template_renders_the_conversation(tmp_path):
    make_rm(tmp_path, "qwen2")
    scorer = rm.RewardModelScorer.load(str(tmp_path), _mesh(1), template="chat")
    texts = scorer.texts(["ignored"], ["42"], [{"problem": "6*7?"}])
    assert texts == ["<|im_start|>user\n6*7?<|im_end|>\n<|im_start|>assistant\n42<|im_end|>\n"]


def test_chat_template_with_its_own_bos_is_tokenized_as_transformers_does(tmp_path):
    """A Llama-3-style reward model: the tokenizer's post-processor adds BOS and the chat
    template writes it too; the rendered conversation must carry one BOS (transformers'
    ``apply_chat_template(tokenize=True)``), not two."""
    import tokenizers

    make_rm(tmp_path, "llama")
    vocab = {**_VOCAB, "<bos>": len(_VOCAB)}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Split(
        tokenizers.Regex(r"[\s\S]"), behavior="isolated"
    )
    tk.add_special_tokens(["<pad>", "<eos>", "<bos>"])
    tk.post_processor = tokenizers.processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    tk.save(str(tmp_path / "tokenizer.json"))
    template = (
        "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    )
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **{f"{t}_token": f"<{t}>" for t in ("eos", "pad", "bos")},
        "unk_token": "[UNK]",
        "chat_template": template,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    scorer = rm.RewardModelScorer.load(str(tmp_path), _mesh(1), template="chat")
    texts = scorer.texts(["ignored"], ["42"], [{"problem": "6*7?"}])
    tokens, mask, _ = scorer.encode(texts)
    ours = tokens[0][mask[0]].tolist()
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    convo = [{"role": "user", "content": "6*7?"}, {"role": "assistant", "content": "42"}]
    ref = hf.apply_chat_template(convo, tokenize=True)
    ref = list(ref["input_ids"] if hasattr(ref, "keys") else ref)
    assert ours == ref and ours.count(vocab["<bos>"]) == 1


def _config(**overrides):
    return smoke_config("grpo", **overrides)


def test_bad_reward_model_is_one_line(tmp_path):
    mesh = _mesh(1)
    missing = _config(**{"reward.model": str(tmp_path / "nope")})
    with pytest.raises(ConfigError, match=r"config\.reward\.model=.*not found") as e:
        reward_from_config.make_reward_fns(missing, (), mesh)
    assert "\n" not in str(e.value)
    hub = _config(**{"reward.model": "no-such-org/no-such-rm"})
    with pytest.raises(ConfigError, match=r"config\.reward\.model=.*local Hugging Face cache"):
        reward_from_config.make_reward_fns(hub, (), mesh)
    make_rm(tmp_path / "lm", "qwen2", cls_name="ForCausalLM")
    causal = _config(**{"reward.model": str(tmp_path / "lm")})
    with pytest.raises(ConfigError, match="not a sequence-classification checkpoint") as e:
        reward_from_config.make_reward_fns(causal, (), mesh)
    assert "\n" not in str(e.value) and "config.reward.model=" in str(e.value)


def test_reward_model_fields_are_validated():
    from grpo_jax import config_utils

    for field, value, match in (
        ("reward.model_weight", 0.0, "model_weight=0"),
        ("reward.model_template", "raw", "model_template"),
        ("reward.model_dtype", "int8", "model_dtype"),
        ("reward.model_batch_size", -1, "model_batch_size"),
        ("reward.verifier_weight", float("nan"), "verifier_weight"),
    ):
        cfg = _config(**{"reward.model": "some/rm", field: value})
        with pytest.raises(ConfigError, match=match):
            config_utils.validate(cfg)
    config_utils.validate(_config(**{"reward.model": "some/rm", "reward.verifier_weight": 0.0}))


def test_combined_reward_weights_the_verifier_and_the_score(tmp_path):
    make_rm(tmp_path, "qwen2")
    cfg = _config(
        **{
            "reward.model": str(tmp_path),
            "reward.model_weight": 0.5,
            "reward.verifier_weight": 2.0,
        }
    )
    train_fn, evals = reward_from_config.make_reward_fns(cfg, ("arithmetic",), _mesh(1))
    try:
        assert isinstance(train_fn, rm.ModelReward)
        assert evals["arithmetic"] is train_fn.verifier  # evaluation: the verifier alone
        completions, golds, prompts = ["19", "5"], ["19", "7"], ["12+7=", "3+4="]
        rewards, correct, stats = train_fn(completions, golds, prompts=prompts)
        v_rewards, v_correct, _ = train_fn.verifier(completions, golds)
        scores, _ = train_fn.scorer.score(["12+7=19", "3+4=5"])
        np.testing.assert_allclose(rewards, 2.0 * v_rewards + 0.5 * scores, rtol=1e-6)
        np.testing.assert_array_equal(correct, v_correct)
        assert stats["num_model_scored"] == 2
        assert stats["model_score_sum"] == pytest.approx(float(scores.sum()), rel=1e-6)
        with pytest.raises(ValueError, match="prompt text"):
            train_fn(completions, golds)
    finally:
        train_fn.close()


@pytest.mark.slow
def test_grpo_trains_with_a_reward_model(tmp_path):
    make_rm(tmp_path / "rm", "qwen2")
    cfg = _config(
        steps=2,
        **{
            "reward.model": str(tmp_path / "rm"),
            "reward.model_weight": 1.0,
            "reward.verifier_weight": 1.0,
            "eval.every_steps": 0,
        },
    )
    train.train_and_evaluate(cfg, str(tmp_path / "run"))
    rows = writers.read_jsonl(str(tmp_path / "run" / "metrics.jsonl"))
    rows = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    R = cfg.rollout.prompts_per_step * cfg.rollout.rollouts_per_prompt
    for r in rows:
        print({k: r[k] for k in ("step", "reward_mean", "pass_rate", "reward/model_score_mean")})
        assert np.isfinite(r["loss"]) and r["skipped_updates"] == 0
        assert np.isfinite(r["reward_mean"]) and np.isfinite(r["reward/model_score_mean"])
        assert r["reward/num_model_scored"] == R and r["reward/num_model_truncated"] == 0
        assert r["reward/model_score_mean"] != 0.0
        # reward = verifier (pm1: mean 2 pass_rate - 1) + the RM's score
        verifier_mean = 2.0 * r["pass_rate"] - 1.0
        assert r["reward_mean"] == pytest.approx(verifier_mean + r["reward/model_score_mean"])
        assert r["advantage_abs_mean"] > 0  # the scores vary within groups
