"""Evaluates a policy with the paper's protocol on held-out math benchmarks (or arithmetic).

Either a training workdir (its latest checkpoint and config) or a model on disk:

  python -m experiments.evaluate --workdir=workdirs/arith
  python -m experiments.evaluate --hf_checkpoint=DIR --datasets=gsm8k,math500
  python -m experiments.evaluate --gguf=PATH --datasets=gsm8k --max_examples=32

Defaults: 8 samples per problem at temperature 0.6, top-p 0.8, top-k 20 (gdro.md section 5).
Reports mean@k, unbiased pass@k and maj@k per benchmark and pooled, as JSON and a markdown
table. `--exclude_train_overlap` drops problems that also occur in DAPO-Math-17k (counted).
"""

import json
import os
import re

from absl import app, flags

_WORKDIR = flags.DEFINE_string("workdir", "", "Training workdir to evaluate (latest checkpoint).")
_HF = flags.DEFINE_string("hf_checkpoint", "", "Hugging Face checkpoint directory.")
_GGUF = flags.DEFINE_string("gguf", "", "GGUF file (dequantised).")
_DATASETS = flags.DEFINE_list(
    "datasets",
    [],
    "Benchmarks: gsm8k, math500, aime24, aime25, amc23, "
    "minerva_math, olympiadbench (default: the workdir config's eval sets, "
    "else gsm8k).",
)
_K = flags.DEFINE_integer("num_samples", 8, "Samples per problem (k).")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.6, "Sampling temperature.")
_TOP_P = flags.DEFINE_float("top_p", 0.8, "Top-p.")
_TOP_K = flags.DEFINE_integer("top_k", 20, "Top-k (0 = off).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 512, "Completion budget (models on disk).")
_MAX_PROMPT = flags.DEFINE_integer("max_prompt_tokens", 512, "Prompt budget (models on disk).")
_MAX_EXAMPLES = flags.DEFINE_integer("max_examples", 0, "Problems per benchmark (0 = all).")
_BATCH = flags.DEFINE_integer("batch_size", 64, "Rollouts per generation call.")
_TEMPLATE = flags.DEFINE_string(
    "template", "chat", "Prompt template for models on disk: chat | plain."
)
_EXCLUDE = flags.DEFINE_bool(
    "exclude_train_overlap",
    False,
    "Drop problems that also occur in DAPO-Math-17k (counted in the output).",
)
_SOURCE = flags.DEFINE_string(
    "source_dir", "", "Raw data dir (default $GRPO_JAX_DATA_DIR or ../shared/data)."
)
_OUT = flags.DEFINE_string(
    "output",
    "",
    "JSON output path (default <workdir>/eval.json or ./eval.json); "
    "a .md table is written beside it.",
)
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")


def _normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def markdown_table(results: dict, k: int) -> str:
    head = f"| benchmark | problems | mean@{k} | pass@1 | pass@{k} | maj@{k} |\n|---|---|---|---|---|---|\n"
    rows = []
    for name, r in results["per_dataset"].items():
        rows.append(
            f"| {name} | {r['num_problems']} | {r['mean_at_1']:.4f} | {r['pass_at_1']:.4f} | "
            f"{r[f'pass_at_{k}']:.4f} | {r.get(f'maj_at_{k}', float('nan')):.4f} |"
        )
    p = results["pooled"]
    rows.append(
        f"| **pooled** | {p['num_problems']} | {p['mean_at_1']:.4f} | {p['pass_at_1']:.4f} | "
        f"{p[f'pass_at_{k}']:.4f} | |"
    )
    return head + "\n".join(rows) + "\n"


def run(argv=None) -> dict:
    del argv
    import jax

    from grpo_jax import evaluation, rewards, sampling, sharding
    from grpo_jax.data import datasets, templates

    k = _K.value
    if _WORKDIR.value:
        import ml_collections

        from grpo_jax import checkpointing, steps
        from grpo_jax.experiment import build_experiment
        from grpo_jax.state import RunState

        with open(os.path.join(_WORKDIR.value, "config.json")) as f:
            config = ml_collections.ConfigDict(json.load(f))
        config.eval.num_samples, config.eval.temperature = k, _TEMPERATURE.value
        config.eval.top_p, config.eval.top_k = _TOP_P.value, _TOP_K.value
        if _DATASETS.value:
            config.eval.datasets = tuple(_DATASETS.value)
        config.eval.max_examples = _MAX_EXAMPLES.value
        exp = build_experiment(config)
        state = steps.init_train_state(exp)
        ckpt = checkpointing.Checkpointer(os.path.join(_WORKDIR.value, "checkpoints"))
        template = RunState(  # the checkpoint tree the trainer saves (train.train_and_evaluate)
            train=state,
            controllers=exp.curriculum.init(),
            ref_params=state.params if config.algorithm.kl_coef > 0 else None,
        )
        restored = ckpt.restore_latest(checkpointing.abstract_like(template))
        if restored is None:
            raise SystemExit(f"error: no checkpoint in {_WORKDIR.value}/checkpoints")
        step, run, _ = restored
        result = evaluation.evaluate(exp, run.train.params, jax.random.PRNGKey(_SEED.value))
        result = {
            "pooled": {kk: v for kk, v in result.items() if kk != "per_dataset"},
            "per_dataset": result["per_dataset"],
            "checkpoint_step": step,
        }
        result["pooled"]["num_problems"] = sum(
            r["num_problems"] for r in result["per_dataset"].values()
        )
        exp.close()
    else:
        from grpo_jax.models import loading
        from grpo_jax.models import tokenizer as tokenizer_lib

        if _HF.value:
            model_cfg, graphdef, params = loading.load_hf_checkpoint(_HF.value)
            tok = tokenizer_lib.Tokenizer.from_dir(_HF.value)
        elif _GGUF.value:
            model_cfg, graphdef, params = loading.load_gguf(_GGUF.value)
            tok = tokenizer_lib.Tokenizer.from_gguf(_GGUF.value)
        else:
            raise SystemExit("error: pass --workdir, --hf_checkpoint or --gguf")
        params = params.to_pure_dict() if hasattr(params, "to_pure_dict") else params
        mesh = sharding.make_mesh({"data": -1})
        names = _DATASETS.value or ["gsm8k"]
        scfg = sampling.SamplingConfig(
            max_new_tokens=_MAX_NEW.value,
            temperature=_TEMPERATURE.value,
            top_k=_TOP_K.value,
            top_p=_TOP_P.value,
            eos_ids=tuple(tok.eos_ids),
            pad_id=tok.pad_id,
        )
        train_problems = set()
        if _EXCLUDE.value:
            train_problems = {
                _normalise(ex["problem"])
                for ex in datasets.load(
                    "dapo_math", "train", source_dir=_SOURCE.value or None, config="full"
                )
            }
        per_dataset = {}
        rng = jax.random.PRNGKey(_SEED.value)
        for name in names:
            examples = datasets.load(name, "test", source_dir=_SOURCE.value or None)
            before = len(examples)
            if train_problems:
                examples = [
                    ex for ex in examples if _normalise(ex["problem"]) not in train_problems
                ]
            if _MAX_EXAMPLES.value:
                examples = examples[: _MAX_EXAMPLES.value]
            task = "gsm8k" if name == "gsm8k" else "math"
            with rewards.RewardFn(rewards.RewardConfig(task=task)) as reward_fn:
                rng, key = jax.random.split(rng)
                res = evaluation.evaluate_policy(
                    graphdef,
                    params,
                    examples,
                    tokenizer=tok,
                    reward_fn=reward_fn,
                    sampling_config=scfg,
                    render=lambda p: templates.render_prompt(
                        p, template=_TEMPLATE.value, tokenizer=tok
                    ),
                    prompt_len=_MAX_PROMPT.value,
                    k=k,
                    batch_size=_BATCH.value,
                    rng=key,
                    mesh=mesh,
                    progress=True,
                )
            res["excluded_train_overlap"] = before - len(examples) if train_problems else 0
            per_dataset[name] = res
        total = sum(r["num_problems"] for r in per_dataset.values()) or 1
        pooled = {
            key: sum(r[key] * r["num_problems"] for r in per_dataset.values()) / total
            for key in ("mean_at_1", "pass_at_1", f"pass_at_{k}")
        }
        pooled["num_problems"] = total
        result = {"pooled": pooled, "per_dataset": per_dataset}
    result["protocol"] = {
        "num_samples": k,
        "temperature": _TEMPERATURE.value,
        "top_p": _TOP_P.value,
        "top_k": _TOP_K.value,
    }
    out = _OUT.value or os.path.join(_WORKDIR.value or ".", "eval.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=2, sort_keys=True, default=float)
    table = markdown_table(result, k)
    with open(os.path.splitext(out)[0] + ".md", "w") as f:
        f.write(table)
    print(table)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    app.run(run)
