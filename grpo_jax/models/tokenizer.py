"""Tokenizer wrapper around `tokenizers.Tokenizer` (HF checkpoint directory or GGUF vocab).

Protocol shared with `CharTokenizer` (below, the arithmetic task's character vocabulary):
  encode(text) -> list[int]; decode(ids) -> str (stops at nothing; the caller cuts);
  pad_id: int; eos_ids: tuple[int, ...]; bos_id: int | None; vocab_size: int;
  apply_chat_template(messages, add_generation_prompt=True) -> str.

Sources:
- `Tokenizer.from_dir(path)`: `tokenizer.json` (+ `tokenizer_config.json` for eos/pad/bos and the
  chat template, `chat_template.jinja`, `generation_config.json` for extra EOS ids).
- `Tokenizer.from_gguf(path)`: byte-level BPE rebuilt from the GGUF's `tokenizer.ggml.*` vocab
  and merges, with the pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre` (for "smollm":
  single digits, then the GPT-2 split, as in SmolLM2's own tokenizer.json).
Chat templates are rendered with jinja2 like transformers does (trim_blocks, lstrip_blocks);
without jinja2 installed a plain ChatML rendering is used.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors

# Pre-tokenizer split patterns of llama.cpp's `tokenizer.ggml.pre` types (llama-vocab.cpp) that
# are also the patterns of the corresponding HF tokenizer.json files.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _token_str(tok: Any) -> str | None:
    if tok is None:
        return None
    if isinstance(tok, dict):
        return tok.get("content")
    return str(tok)


def _read_json(path: str) -> dict:
    """A JSON file's content; ValueError naming the file when it is not valid JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


class Tokenizer:
    """Text <-> token ids for a causal LM (see module docstring for the protocol)."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        eos_ids: Sequence[int],
        pad_id: int,
        bos_id: int | None = None,
        chat_template: str | None = None,
        add_bos: bool = False,
    ):
        """tokenizer: a `tokenizers.Tokenizer`; eos_ids: ids ending a completion (first = the
        canonical EOS); pad_id: padding id; bos_id: BOS id or None; chat_template: jinja2 source
        (None: ChatML); add_bos: prepend bos_id in encode (when the tokenizer's own
        post-processor does not already)."""
        if not eos_ids:
            raise ValueError("Tokenizer needs at least one eos id")
        self.tokenizer = tokenizer
        self.eos_ids = tuple(int(e) for e in eos_ids)
        self.pad_id = int(pad_id)
        self.bos_id = None if bos_id is None else int(bos_id)
        self.chat_template = chat_template
        self.add_bos = bool(add_bos) and self.bos_id is not None

    # ------------------------------------------------------------------ construction
    @classmethod
    def load(cls, path: str) -> Tokenizer:
        """From a checkpoint directory (tokenizer.json) or a `.gguf` file."""
        if str(path).endswith(".gguf"):
            return cls.from_gguf(path)
        return cls.from_dir(path)

    @classmethod
    def from_dir(cls, path: str) -> Tokenizer:
        """From a HF checkpoint directory. Raises FileNotFoundError naming tokenizer.json."""
        tj = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tj):
            raise FileNotFoundError(f"tokenizer file not found: {tj}")
        tk = tokenizers.Tokenizer.from_file(tj)
        cfg_path = os.path.join(path, "tokenizer_config.json")
        cfg = _read_json(cfg_path) if os.path.isfile(cfg_path) else {}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates
            template = {t["name"]: t["template"] for t in template}.get("default")
        jinja_path = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()

        def tid(name):
            s = _token_str(cfg.get(name))
            return None if s is None else tk.token_to_id(s)

        eos: list[int] = []
        if tid("eos_token") is not None:
            eos.append(tid("eos_token"))
        for extra in ("generation_config.json", "config.json"):
            p = os.path.join(path, extra)
            if os.path.isfile(p):
                e = _read_json(p).get("eos_token_id")
                for i in e if isinstance(e, list) else [e] if e is not None else []:
                    if int(i) not in eos:
                        eos.append(int(i))
        if not eos:
            raise ValueError(
                f"{path}: no eos token in tokenizer_config.json / generation_config.json"
            )
        pad = tid("pad_token")
        bos = tid("bos_token")
        return cls(
            tk,
            eos_ids=eos,
            pad_id=eos[0] if pad is None else pad,
            bos_id=bos,
            chat_template=template,
            add_bos=False,
        )  # BOS, if any, comes from tokenizer.json

    @classmethod
    def from_char_vocab(
        cls,
        tokens: Sequence[str],
        *,
        num_special: int,
        eos_ids: Sequence[int],
        pad_id: int,
        bos_id: int | None = None,
        unk_id: int | None = None,
    ) -> Tokenizer:
        """A character-level tokenizer (one id per character, the first ``num_special`` tokens
        special), e.g. the arithmetic `CharTokenizer` as a tokenizer.json: encodes and decodes
        like it (no BOS/EOS added; special tokens kept by `decode`)."""
        vocab = {t: i for i, t in enumerate(tokens)}
        unk = tokens[unk_id] if unk_id is not None else None
        tk = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[], unk_token=unk))
        tk.decoder = decoders.Fuse()
        tk.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in tokens[:num_special]]
        )
        return cls(tk, eos_ids=eos_ids, pad_id=pad_id, bos_id=bos_id, add_bos=False)

    @classmethod
    def from_gguf(cls, path: str, reader=None) -> Tokenizer:
        """Byte-level BPE from a GGUF file's embedded vocabulary (tokenizer.ggml.model == "gpt2").

        reader: an open gguf.GGUFReader for `path` (opening one takes seconds).
        Raises FileNotFoundError / ValueError (unsupported tokenizer model) naming the file.
        """
        import gguf

        if reader is None:
            if not os.path.isfile(path):
                raise FileNotFoundError(f"GGUF file not found: {path}")
            reader = gguf.GGUFReader(path)
        f = reader.fields

        def get(key, default=None):
            return f[key].contents() if key in f else default

        model = get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(
                f"{path}: tokenizer.ggml.model={model!r}; only byte-level BPE ('gpt2') is supported"
            )
        tokens = get("tokenizer.ggml.tokens")
        types = get("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = [tuple(m.split(" ", 1)) for m in get("tokenizer.ggml.merges")]
        vocab = {t: i for i, t in enumerate(tokens)}
        tk = tokenizers.Tokenizer(
            tokenizers.models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
        )
        pre = get("tokenizer.ggml.pre", "default")
        byte_level = pre_tokenizers.ByteLevel(
            add_prefix_space=False, trim_offsets=True, use_regex=False
        )
        if pre == "smollm":
            tk.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Digits(individual_digits=True),
                    pre_tokenizers.ByteLevel(
                        add_prefix_space=False, trim_offsets=True, use_regex=True
                    ),
                ]
            )
        elif pre in ("qwen2", "deepseek-r1-qwen"):
            tk.normalizer = normalizers.NFC()
            tk.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"), byte_level]
            )
        elif pre in ("llama3", "llama-v3", "llama-bpe"):
            tk.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"), byte_level]
            )
        else:  # "gpt2", "default" and others: the GPT-2 split
            tk.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(_GPT2_SPLIT), behavior="isolated"), byte_level]
            )
        tk.decoder = decoders.ByteLevel()
        tk.post_processor = processors.ByteLevel(trim_offsets=False)
        special = [
            AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3
        ]  # 3 = CONTROL
        user = [
            AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types)
            if ty == 4
        ]  # 4 = USER_DEFINED
        if special:
            tk.add_special_tokens(special)
        if user:
            tk.add_tokens(user)
        eos = get("tokenizer.ggml.eos_token_id")
        if eos is None:
            raise ValueError(f"{path}: no tokenizer.ggml.eos_token_id")
        eos_ids = [int(eos)]
        eot = get("tokenizer.ggml.eot_token_id")
        if eot is not None and int(eot) not in eos_ids:
            eos_ids.append(int(eot))
        pad = get("tokenizer.ggml.padding_token_id", eos)
        bos = get("tokenizer.ggml.bos_token_id")
        return cls(
            tk,
            eos_ids=eos_ids,
            pad_id=int(pad),
            bos_id=None if bos is None else int(bos),
            chat_template=get("tokenizer.chat_template"),
            add_bos=bool(get("tokenizer.ggml.add_bos_token", False)),
        )

    # ------------------------------------------------------------------ protocol
    @property
    def vocab_size(self) -> int:
        """Number of token ids (including added/special tokens)."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (special-token strings such as "<|im_end|>" map to their ids;
        BOS prepended only where the tokenizer adds one, as transformers' tokenizer does)."""
        ids = self.tokenizer.encode(text, add_special_tokens=True).ids
        if self.add_bos and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def encode_batch(
        self, texts: Sequence[str], *, add_special_tokens: bool = True
    ) -> list[list[int]]:
        """encode() for several texts (parallel in the Rust tokenizer). ``add_special_tokens=
        False``: the text's own tokens only (no BOS/post-processor additions), for text a chat
        template rendered with its BOS already in it (transformers' ``apply_chat_template``)."""
        batch = self.tokenizer.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        out = [e.ids for e in batch]
        if self.add_bos and add_special_tokens:
            out = [ids if ids and ids[0] == self.bos_id else [self.bos_id] + ids for ids in out]
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids` (all of them: the caller cuts at EOS / the completion mask)."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self.tokenizer.id_to_token(int(i))

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs
    ) -> str:
        """Render `messages` ([{"role": ..., "content": ...}]) with the chat template (jinja2,
        transformers' settings; extra keyword arguments such as enable_thinking go to the
        template). Without a template, or without jinja2, ChatML is used."""
        template = self.chat_template or _CHATML
        try:
            import jinja2
            import jinja2.ext
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:  # plain ChatML
            text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
            return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(
                x,
                ensure_ascii=ensure_ascii,
                indent=indent,
                separators=separators,
                sort_keys=sort_keys,
            )

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        tok = self.tokenizer.id_to_token
        return env.from_string(template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=tok(self.bos_id) if self.bos_id is not None else "",
            eos_token=tok(self.eos_ids[0]),
            **template_kwargs,
        )

    # ------------------------------------------------------------------ saving
    def save(self, path: str) -> None:
        """Write tokenizer.json + tokenizer_config.json (+ generation eos ids in
        generation_config.json if absent) so `transformers.AutoTokenizer` and `from_dir` load it."""
        os.makedirs(path, exist_ok=True)
        tk = self.tokenizer
        if self.add_bos:  # bake the BOS into the post-processor, as HF tokenizer.json does
            tk = tokenizers.Tokenizer.from_str(tk.to_str())
            b = tk.id_to_token(self.bos_id)
            tk.post_processor = processors.TemplateProcessing(
                single=f"{b} $A", pair=f"{b} $A {b} $B", special_tokens=[(b, self.bos_id)]
            )
        tk.save(os.path.join(path, "tokenizer.json"))
        added = {
            str(i): {
                "content": t.content,
                "lstrip": t.lstrip,
                "rstrip": t.rstrip,
                "normalized": t.normalized,
                "single_word": t.single_word,
                "special": t.special,
            }
            for i, t in sorted(self.tokenizer.get_added_tokens_decoder().items())
        }
        tok = self.tokenizer.id_to_token
        cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": self.add_bos,
            "add_prefix_space": False,
            "added_tokens_decoder": added,
            "bos_token": tok(self.bos_id) if self.bos_id is not None else None,
            "eos_token": tok(self.eos_ids[0]),
            "pad_token": tok(self.pad_id),
            "unk_token": None,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1_000_000,
        }
        if self.chat_template is not None:
            cfg["chat_template"] = self.chat_template
        with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=2, ensure_ascii=False)


# The arithmetic task's character vocabulary (no checkpoint: the built-in tokenizer).
_SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
_CHARS = "0123456789+-*/=() .,?abcdefghijklmnopqrstuvwxyz"


class CharTokenizer:
    """Character-level tokenizer with the same protocol as the HF tokenizer wrapper.

    Vocabulary (51 ids): 0 ``<pad>``, 1 ``<bos>``, 2 ``<eos>``, 3 ``<unk>``, then one id per
    character of ``"0123456789+-*/=() .,?abcdefghijklmnopqrstuvwxyz"`` (digits are ids 4..13).
    Characters outside the vocabulary encode to ``<unk>`` (upper case is *not* folded).

    `encode` does not add BOS or EOS (``add_bos=True`` prepends BOS); `decode` drops special
    tokens by default (HF's ``skip_special_tokens``) and does not stop at EOS unless asked
    (``stop_at_eos=True``): the trainer cuts completions at EOS via the completion mask.
    """

    pad_id: int = 0
    bos_id: int | None = 1
    eos_id: int = 2
    unk_id: int = 3
    eos_ids: tuple[int, ...] = (2,)

    def __init__(self):
        self._itos = list(_SPECIALS) + list(_CHARS)
        self._stoi = {c: i for i, c in enumerate(_CHARS, start=len(_SPECIALS))}
        self.vocab_size = len(self._itos)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of `text` (one per character), optionally with BOS first."""
        ids = [self._stoi.get(c, self.unk_id) for c in text]
        return ([self.bos_id] + ids) if add_bos else ids

    def decode(
        self, ids: Sequence[int], skip_special_tokens: bool = True, stop_at_eos: bool = False
    ) -> str:
        """Text of `ids`. Special tokens are dropped (or rendered as ``<eos>`` etc. when
        ``skip_special_tokens=False``); with ``stop_at_eos`` decoding stops at the first EOS."""
        out = []
        for i in ids:
            i = int(i)
            if stop_at_eos and i in self.eos_ids:
                break
            if i < len(_SPECIALS):
                if not skip_special_tokens:
                    out.append(self._itos[i])
                continue
            if i >= self.vocab_size:
                raise ValueError(f"token id {i} out of range [0, {self.vocab_size})")
            out.append(self._itos[i])
        return "".join(out)

    def apply_chat_template(
        self,
        messages: Sequence[dict],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **unused,
    ) -> str | list[int]:
        """Trivial chat template: the content of the last user message (no markup)."""
        del add_generation_prompt, unused
        user = [m["content"] for m in messages if m.get("role") == "user"]
        if not user:
            raise ValueError("apply_chat_template: no user message")
        text = user[-1]
        return self.encode(text) if tokenize else text

    def __len__(self) -> int:
        return self.vocab_size
