"""Exports a training run's latest checkpoint as a Hugging Face model directory.

  python -m experiments.export --workdir=workdirs/run --out=exported/run

Writes config.json, model.safetensors, tokenizer.json, tokenizer_config.json and
generation_config.json (files mode 0644): `transformers.AutoModelForCausalLM.from_pretrained(out)`
and `AutoTokenizer.from_pretrained(out)` load it, and so do `config.model.hf_checkpoint=out` and
`python -m experiments.evaluate --hf_checkpoint=out`. The run's config (`<workdir>/config.json`)
rebuilds the model and its tokenizer (the arithmetic character tokenizer is written as an
equivalent tokenizer.json); the checkpoint is a `state.RunState`, restored as
`experiments/evaluate.py` does. A LoRA run (``config.model.lora.rank > 0``) is exported merged:
each adapted projection becomes ``W + (alpha / rank) A B`` (`grpo_jax.models.lora.merge`), a
plain model without adapters.
"""

from absl import flags

from grpo_jax import cli


def hf_tokenizer(tokenizer):
    """A `grpo_jax.models.tokenizer.Tokenizer` (tokenizer.json-backed) for the run's tokenizer."""
    from grpo_jax.models.tokenizer import CharTokenizer, Tokenizer

    if isinstance(tokenizer, CharTokenizer):
        return Tokenizer.from_char_vocab(
            [tokenizer.decode([i], skip_special_tokens=False) for i in range(tokenizer.vocab_size)],
            num_special=4,
            eos_ids=tokenizer.eos_ids,
            pad_id=tokenizer.pad_id,
            bos_id=tokenizer.bos_id,
            unk_id=tokenizer.unk_id,
        )
    return tokenizer


def export(workdir: str, out: str) -> str:
    """Writes the Hugging Face directory ``out`` from a workdir's checkpoint; returns ``out``."""
    import jax

    from grpo_jax.models import lora
    from grpo_jax.models.loading import save_hf_checkpoint
    from grpo_jax.train import restore_run

    exp, run, step = restore_run(workdir)
    try:
        params = jax.device_get(run.train.params)  # the plain dict a checkpoint restores
        params = jax.device_get(lora.merge(params, exp.model_config))  # LoRA: W + s A B
        cfg = exp.model_config.replace(lora_rank=0)
        save_hf_checkpoint(cfg, params, out, tokenizer=hf_tokenizer(exp.tokenizer))
    finally:
        exp.close()
    print(f"exported step {step} of {workdir} to {out}", flush=True)
    return out


def main(argv):
    del argv
    if not flags.FLAGS["workdir"].value or not flags.FLAGS["out"].value:
        raise cli.UsageError("pass --workdir and --out")
    export(flags.FLAGS["workdir"].value, flags.FLAGS["out"].value)


def define_flags():
    """The command-line flags (defined only when run as a script: importing this module, e.g.
    from a test beside other experiments modules, must not clash with their flags)."""
    flags.DEFINE_string("workdir", None, "Training workdir (its latest checkpoint).")
    flags.DEFINE_string("out", None, "Output directory (created; files are overwritten).")


if __name__ == "__main__":
    define_flags()
    cli.run_absl(main)
