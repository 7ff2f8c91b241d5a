"""Evaluates a policy with the paper's protocol on held-out math benchmarks (or arithmetic).

Either a training workdir (its latest checkpoint and config) or a model on disk:

  python -m experiments.evaluate --workdir=workdirs/arith
  python -m experiments.evaluate --hf_checkpoint=DIR --datasets=gsm8k,math500
  python -m experiments.evaluate --gguf=PATH --datasets=gsm8k --max_examples=32

A workdir is evaluated with its own config's protocol (eval sets, samples, temperature, top-p,
top-k, problem count, batch size) and the training run's evaluation seed (``config.seed + 7``,
as `grpo_jax.train` uses), so re-evaluating a finished run reproduces its summary.json
``eval_after``; any flag given overrides. Models on disk default to the paper protocol: 8
samples per problem at temperature 0.6, top-p 0.8, top-k 20 (gdro.md section 5), seed 0.
Reports mean@k, unbiased pass@k and maj@k (answers extracted as the reward extracts them) per
benchmark and pooled: JSON on stdout (last line) and in --output, a markdown table beside it.
Exit status 0 on success. `--exclude_train_overlap` drops problems that also occur in
DAPO-Math-17k (counted).
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
_K = flags.DEFINE_integer("num_samples", None, "Samples per problem (k; default 8 / the run's).")
_TEMPERATURE = flags.DEFINE_float("temperature", None, "Sampling temperature (0.6 / the run's).")
_TOP_P = flags.DEFINE_float("top_p", None, "Top-p (0.8 / the run's).")
_TOP_K = flags.DEFINE_integer("top_k", None, "Top-k (0 = off; 20 / the run's).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 512, "Completion budget (models on disk).")
_MAX_PROMPT = flags.DEFINE_integer("max_prompt_tokens", 512, "Prompt budget (models on disk).")
_MAX_EXAMPLES = flags.DEFINE_integer(
    "max_examples", None, "Problems per benchmark (0 = all; default all / the run's)."
)
_BATCH = flags.DEFINE_integer("batch_size", None, "Rollouts per generation call (64 / the run's).")
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
_SEED = flags.DEFINE_integer(
    "seed", None, "Sampling seed (default: the run's evaluation seed, config.seed + 7; else 0)."
)

_PAPER = {"num_samples": 8, "temperature": 0.6, "top_p": 0.8, "top_k": 20, "batch_size": 64}


def _flag(flag, default):
    return default if flag.value is None else flag.value


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
    maj = p.get(f"maj_at_{k}")
    rows.append(
        f"| **pooled** | {p['num_problems']} | {p['mean_at_1']:.4f} | {p['pass_at_1']:.4f} | "
        f"{p[f'pass_at_{k}']:.4f} | {'' if maj is None else f'{maj:.4f}'} |"
    )
    return head + "\n".join(rows) + "\n"


def run(argv=None) -> dict:
    del argv
    import jax

    from grpo_jax import evaluation, rewards, sampling, sharding, train
    from grpo_jax.data import datasets, templates

    if _WORKDIR.value:

        def configure(config):  # the run's protocol, unless a flag overrides it
            e = config.eval
            e.num_samples = _flag(_K, e.num_samples)
            e.temperature = _flag(_TEMPERATURE, e.temperature)
            e.top_p, e.top_k = _flag(_TOP_P, e.top_p), _flag(_TOP_K, e.top_k)
            e.max_examples = _flag(_MAX_EXAMPLES, e.max_examples)
            e.batch_size = _flag(_BATCH, e.batch_size)
            if _DATASETS.value:
                e.datasets = tuple(_DATASETS.value)

        exp, run, step = train.restore_run(_WORKDIR.value, need_reward=True, configure=configure)
        config = exp.config
        k = config.eval.num_samples
        protocol = {
            "num_samples": k,
            "temperature": config.eval.temperature,
            "top_p": config.eval.top_p,
            "top_k": config.eval.top_k,
        }
        seed = _flag(_SEED, config.seed + 7)  # grpo_jax.train's evaluation key
        try:
            result = evaluation.evaluate(exp, run.train.params, jax.random.PRNGKey(seed))
        finally:
            exp.close()
        result = {
            "pooled": {kk: v for kk, v in result.items() if kk != "per_dataset"},
            "per_dataset": result["per_dataset"],
            "checkpoint_step": step,
        }
        result["pooled"]["num_problems"] = sum(
            r["num_problems"] for r in result["per_dataset"].values()
        )
    else:
        from grpo_jax.models import loading
        from grpo_jax.models import tokenizer as tokenizer_lib

        if _HF.value:
            model_cfg, graphdef, params = loading.load_hf_checkpoint(_HF.value)
            tok = tokenizer_lib.Tokenizer.from_dir(loading.resolve_checkpoint(_HF.value))
        elif _GGUF.value:
            model_cfg, graphdef, params = loading.load_gguf(_GGUF.value)
            tok = tokenizer_lib.Tokenizer.from_gguf(_GGUF.value)
        else:
            raise SystemExit("error: pass --workdir, --hf_checkpoint or --gguf")
        k = _flag(_K, _PAPER["num_samples"])
        protocol = {
            "num_samples": k,
            "temperature": _flag(_TEMPERATURE, _PAPER["temperature"]),
            "top_p": _flag(_TOP_P, _PAPER["top_p"]),
            "top_k": _flag(_TOP_K, _PAPER["top_k"]),
        }
        seed = _flag(_SEED, 0)
        params = params.to_pure_dict() if hasattr(params, "to_pure_dict") else params
        mesh = sharding.make_mesh({"data": -1})
        names = _DATASETS.value or ["gsm8k"]
        scfg = sampling.SamplingConfig(
            max_new_tokens=_MAX_NEW.value,
            temperature=protocol["temperature"],
            top_k=protocol["top_k"],
            top_p=protocol["top_p"],
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
        rng = jax.random.PRNGKey(seed)
        for name in names:
            examples = datasets.load(name, "test", source_dir=_SOURCE.value or None)
            before = len(examples)
            if train_problems:
                examples = [
                    ex for ex in examples if _normalise(ex["problem"]) not in train_problems
                ]
            if _MAX_EXAMPLES.value:
                examples = examples[: _MAX_EXAMPLES.value]
            if not examples:
                raise SystemExit(f"error: no problems left in {name}")
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
                    batch_size=_flag(_BATCH, _PAPER["batch_size"]),
                    rng=key,
                    mesh=mesh,
                    progress=True,
                ).summary
            res["excluded_train_overlap"] = before - len(examples) if train_problems else 0
            per_dataset[name] = res
        total = sum(r["num_problems"] for r in per_dataset.values()) or 1
        pooled = {
            key: sum(r[key] * r["num_problems"] for r in per_dataset.values()) / total
            for key in ("mean_at_1", "pass_at_1", f"pass_at_{k}", f"maj_at_{k}")
        }
        pooled["num_problems"] = total
        result = {"pooled": pooled, "per_dataset": per_dataset}
    result["protocol"] = {**protocol, "seed": seed}
    out = _OUT.value or os.path.join(_WORKDIR.value or ".", "eval.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=2, sort_keys=True, default=float)
    table = markdown_table(result, k)
    with open(os.path.splitext(out)[0] + ".md", "w") as f:
        f.write(table)
    print(table)
    print(f"wrote {out}")
    print(json.dumps(result, sort_keys=True, default=float), flush=True)
    return result


def main(argv):
    run(argv)  # returns None: absl exits 0 (a returned dict would be the exit status)


if __name__ == "__main__":
    app.run(main)
