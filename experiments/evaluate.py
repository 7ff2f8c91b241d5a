"""Evaluates a policy with the paper's protocol on held-out math benchmarks (or arithmetic).

Either a training workdir (its latest checkpoint and config) or a model on disk:

  python -m experiments.evaluate --workdir=workdirs/arith
  python -m experiments.evaluate --hf_checkpoint=DIR --datasets=gsm8k,math500
  python -m experiments.evaluate --gguf=PATH --datasets=gsm8k --max_examples=32
  python -m experiments.evaluate --hf_checkpoint=DIR --suite=math      # = experiments.benchmark

``--suite=math`` runs MATH-500, AIME 2024, AIME 2025, AMC 2023 and GSM8K (the suites are
`grpo_jax.evaluation.SUITES`; ``--datasets`` names sets one by one; not both). The data are
read from local files in the `experiments.prepare_data` layout (``--source_dir``, else
``$GRPO_JAX_DATA_DIR``, else ``../shared/data``), never downloaded; each file's sha256 is
recorded (and compared with prepare_data's pinned one).

A workdir is evaluated with its own config's protocol (eval sets, samples, temperature, top-p,
top-k, problem count, batch size) and the training run's evaluation seed (``config.seed + 7``,
as `grpo_jax.train` uses), so re-evaluating a finished run reproduces its summary.json
``eval_after``; any flag given overrides. Models on disk default to the paper protocol: 8
samples per problem at temperature 0.6, top-p 0.8, top-k 20 (gdro.md section 5), seed 0; each
benchmark's sampling key is ``fold_in(PRNGKey(seed), crc32(name))``, so a benchmark scores the
same alone or in a suite.

Reports mean@k, unbiased pass@k (Chen et al. 2021) and maj@k (answers extracted as the reward
extracts them) per benchmark and pooled over the benchmarks (problem-weighted), with 95%
confidence intervals for mean@k and pass@k over problems: exact Clopper-Pearson where every
per-problem score is 0 or 1 (pass@k, mean@1; `grpo_jax.metrics.clopper_pearson`), else a
percentile bootstrap (Efron 1979; `grpo_jax.metrics.bootstrap_ci`, 10,000 resamples seeded with
the sampling seed; the pooled interval resamples within each benchmark). The intervals cover the
choice of problems only,
not the sampling of the k completions. Rerunning a command reproduces its files exactly.

Output: JSON (results, intervals, protocol, model, data files with sha256, versions) in
--output (default ``<workdir or .>/benchmark.json`` with --suite, else ``eval.json``), the
markdown table beside it (``.md``), the table and the JSON (last line) on stdout. Exit 0 on
success; a bad input (flags, paths, data) is one ``error: ...`` line on stderr and exit 2.
`--exclude_train_overlap` drops problems that also occur in DAPO-Math-17k (counted).
"""

import json
import os
import platform
import re
import sys
import tempfile
import zlib

import flax
import jax
from absl import flags

import grpo_jax
from experiments import prepare_data
from grpo_jax import cli, config_schema, evaluation, rewards, sampling, sharding, train
from grpo_jax.data import datasets, templates
from grpo_jax.data import from_config as data_lib
from grpo_jax.models import loading
from grpo_jax.models import tokenizer as tokenizer_lib

_WORKDIR = flags.DEFINE_string("workdir", "", "Training workdir to evaluate (latest checkpoint).")
_HF = flags.DEFINE_string("hf_checkpoint", "", "Hugging Face checkpoint directory.")
_GGUF = flags.DEFINE_string("gguf", "", "GGUF file (dequantised).")
_SUITE = flags.DEFINE_string(
    "suite",
    "",
    "Benchmark suite: " + "; ".join(f"{s} = {','.join(d)}" for s, d in evaluation.SUITES.items()),
)
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
    "source_dir",
    "",
    "Data dir in the prepare_data layout (default: the workdir config's data.source_dir, "
    "else $GRPO_JAX_DATA_DIR or ../shared/data).",
)
_OUT = flags.DEFINE_string(
    "output",
    "",
    "JSON output path (default <workdir or .>/benchmark.json with --suite, else eval.json); "
    "a .md table is written beside it.",
)
_SEED = flags.DEFINE_integer(
    "seed", None, "Sampling seed (default: the run's evaluation seed, config.seed + 7; else 0)."
)
_RESAMPLES = flags.DEFINE_integer(
    "bootstrap_resamples", 10_000, "Bootstrap resamples of the confidence intervals."
)
_CONFIDENCE = flags.DEFINE_float("confidence", 0.95, "Coverage of the confidence intervals.")

_PAPER = {"num_samples": 8, "temperature": 0.6, "top_p": 0.8, "top_k": 20, "batch_size": 64}
_PREPARE_HINT = (
    "build the data with `python -m experiments.prepare_data --out=DIR` "
    f"and pass --source_dir=DIR (or set {datasets.ENV_VAR}=DIR)"
)


def _flag(flag, default):
    return default if flag.value is None else flag.value


def _normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def _check_flags() -> None:
    """ValueError (one line) for inconsistent or out-of-range flags; nothing is loaded yet."""
    given = [f"--{f.name}" for f in (_WORKDIR, _HF, _GGUF) if f.value]
    if len(given) != 1:
        what = "pass one of" if not given else f"{' and '.join(given)} conflict: pass only one of"
        raise ValueError(f"{what} --workdir, --hf_checkpoint or --gguf")
    checks = [
        (_K.value is None or _K.value >= 1, f"--num_samples must be >= 1, got {_K.value}"),
        (
            _TEMPERATURE.value is None or _TEMPERATURE.value >= 0,
            f"--temperature must be >= 0, got {_TEMPERATURE.value}",
        ),
        (
            _TOP_P.value is None or 0 < _TOP_P.value <= 1,
            f"--top_p must lie in (0, 1], got {_TOP_P.value}",
        ),
        (_TOP_K.value is None or _TOP_K.value >= 0, f"--top_k must be >= 0, got {_TOP_K.value}"),
        (
            _MAX_EXAMPLES.value is None or _MAX_EXAMPLES.value >= 0,
            f"--max_examples must be >= 0, got {_MAX_EXAMPLES.value}",
        ),
        (
            _BATCH.value is None or _BATCH.value >= 1,
            f"--batch_size must be >= 1, got {_BATCH.value}",
        ),
        (_MAX_NEW.value >= 1, f"--max_new_tokens must be >= 1, got {_MAX_NEW.value}"),
        (_MAX_PROMPT.value >= 1, f"--max_prompt_tokens must be >= 1, got {_MAX_PROMPT.value}"),
        (
            _TEMPLATE.value in ("chat", "plain"),
            f"--template must be chat or plain, got {_TEMPLATE.value!r}",
        ),
        (_RESAMPLES.value >= 1, f"--bootstrap_resamples must be >= 1, got {_RESAMPLES.value}"),
        (0 < _CONFIDENCE.value < 1, f"--confidence must lie in (0, 1), got {_CONFIDENCE.value}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    if _WORKDIR.value and _EXCLUDE.value:
        raise ValueError(
            "--exclude_train_overlap applies to models on disk (--hf_checkpoint, --gguf); a "
            "--workdir is evaluated on its run's own held-out sets"
        )
    if _WORKDIR.value and not os.path.isfile(os.path.join(_WORKDIR.value, "config.json")):
        raise FileNotFoundError(f"--workdir={_WORKDIR.value}: no config.json (not a training run)")
    if _GGUF.value and not os.path.isfile(_GGUF.value):
        raise FileNotFoundError(f"--gguf={_GGUF.value}: file not found")
    if _HF.value:
        loading.resolve_checkpoint(_HF.value)  # one line naming a missing directory


def _workdir_config():
    with open(os.path.join(_WORKDIR.value, "config.json")) as f:
        return config_schema.upgrade(json.load(f))


def _data_files(names, source_dir: str, config=None) -> dict:
    """``{name: [{"file", "sha256", "pinned_sha256"}]}`` of the test files the sets read (sha256
    of the bytes read; pinned: `experiments.prepare_data.SOURCES`). With a run's ``config``, a
    set read from your own table (``custom``, or a preset under ``data.path`` /
    ``data.eval_path``) lists that table's local files (no pin). FileNotFoundError: one line
    telling the user to run prepare_data."""
    pinned = {rel: sha for srcs in prepare_data.SOURCES.values() for rel, _, sha in srcs}
    pinned.update(prepare_data.DAPO_PARTS)
    out = {}
    for name, split in names:
        table, table_split = data_lib.eval_table(config, name) if config else (None, split)
        if table is not None:
            out[name] = _table_files(table, table_split)
            continue
        if name not in datasets.DATASETS:  # arithmetic (generated): no file
            out[name] = []
            continue
        try:
            root = datasets.resolve_source_dir(name, source_dir or None)
            files = datasets.source_files(name, split, root)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{str(e).split('; set ')[0]}; {_PREPARE_HINT}") from None
        out[name] = []
        for f in files:
            rel = f.relative_to(root).as_posix()
            sha = prepare_data.sha256_file(str(f))
            if pinned.get(rel) and pinned[rel] != sha:
                print(f"warning: {f}: sha256 differs from prepare_data's pin", file=sys.stderr)
            out[name].append({"file": rel, "sha256": sha, "pinned_sha256": pinned.get(rel, "")})
    return out


def _table_files(table: str, split: str) -> list[dict]:
    """The sha256 of each local file of a table (none for a hub dataset)."""
    try:
        files = datasets.table_files(table, split)
    except FileNotFoundError:
        return []  # a hub id ("hf:org/name"): no local file
    return [
        {"file": str(f), "sha256": prepare_data.sha256_file(str(f)), "pinned_sha256": ""}
        for f in files
    ]


def _evaluate_workdir(names, source_dir: str) -> tuple[dict, dict, dict]:
    """``({name: EvalResult}, protocol, model)`` of a workdir's latest checkpoint."""

    def configure(config):  # the run's protocol, unless a flag overrides it
        e = config.eval
        e.num_samples = _flag(_K, e.num_samples)
        e.temperature = _flag(_TEMPERATURE, e.temperature)
        e.top_p, e.top_k = _flag(_TOP_P, e.top_p), _flag(_TOP_K, e.top_k)
        e.max_examples = _flag(_MAX_EXAMPLES, e.max_examples)
        e.batch_size = _flag(_BATCH, e.batch_size)
        e.datasets = tuple(names)
        config.data.source_dir = source_dir
        config.reward.model = ""  # evaluation scores with the verifier alone (no RM to load)

    exp, run, step = train.restore_run(_WORKDIR.value, need_reward=True, configure=configure)
    seed = _flag(_SEED, exp.run.seed + 7)  # grpo_jax.train's evaluation key
    try:
        results = evaluation.evaluate_sets(exp, run.train.params, jax.random.PRNGKey(seed))
    finally:
        exp.close()
    e = exp.run.eval
    protocol = {
        "num_samples": e.num_samples,
        "temperature": e.temperature,
        "top_p": e.top_p,
        "top_k": e.top_k,
        "max_new_tokens": exp.eval_sampling.max_new_tokens,
        "max_prompt_tokens": exp.prompt_len,
        "max_examples": e.max_examples,
        "batch_size": e.batch_size,
        "seed": seed,
    }
    return results, protocol, {"workdir": _WORKDIR.value, "checkpoint_step": int(step)}


def _load_model():
    """``(graphdef, params, tokenizer, model)`` of --hf_checkpoint or --gguf."""
    if _HF.value:
        path = loading.resolve_checkpoint(_HF.value)
        _, graphdef, params = loading.load_hf_checkpoint(path)
        tok = tokenizer_lib.Tokenizer.from_dir(path)
        model = {"hf_checkpoint": _HF.value}
    else:
        _, graphdef, params = loading.load_gguf(_GGUF.value)
        tok = tokenizer_lib.Tokenizer.from_gguf(_GGUF.value)
        model = {"gguf": _GGUF.value}
    params = params.to_pure_dict() if hasattr(params, "to_pure_dict") else params
    return graphdef, params, tok, model


def _examples(name: str, train_problems: set) -> tuple[list, int]:
    """A benchmark's problems (train overlap dropped, first --max_examples) and the count dropped."""
    examples = datasets.load(name, "test", source_dir=_SOURCE.value or None)
    before = len(examples)
    if train_problems:
        examples = [ex for ex in examples if _normalise(ex["problem"]) not in train_problems]
    dropped = before - len(examples)
    if _MAX_EXAMPLES.value:
        examples = examples[: _MAX_EXAMPLES.value]
    if not examples:
        raise ValueError(f"no problems left in {name}")
    return examples, dropped


def _call_rows(batch_size: int, k: int, num_problems: int, mesh) -> int:
    """Rollouts per sampling call for a benchmark of ``num_problems``: ``batch_size``, or fewer
    when the whole benchmark needs fewer (a small run is not padded to a full call), kept a
    multiple of the mesh's batch shards. Depends on the benchmark alone, so it scores the same
    alone or in a suite."""
    rows = max(min(batch_size, k * num_problems) // k, 1) * k
    return rows if rows % sharding.batch_divisor(mesh) == 0 else batch_size


def _output_path() -> str:
    """--output (or its default), its folder created and checked writable before any work: a
    bad path fails at once, not after the sampling."""
    default = "benchmark.json" if _SUITE.value else "eval.json"
    out = _OUT.value or os.path.join(_WORKDIR.value or ".", default)
    folder = os.path.dirname(os.path.abspath(out))
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ValueError(f"--output={out}: cannot write in {folder} ({e.strerror})") from None
    if os.path.isdir(out):
        raise ValueError(f"--output={out} is a directory; give a file name (e.g. benchmark.json)")
    return out


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _evaluate_on_disk(names) -> tuple[dict, dict, dict, dict]:
    """``({name: EvalResult}, protocol, model, {name: train overlap dropped})``."""
    graphdef, params, tok, model = _load_model()
    k = _flag(_K, _PAPER["num_samples"])
    protocol = {
        "num_samples": k,
        "temperature": _flag(_TEMPERATURE, _PAPER["temperature"]),
        "top_p": _flag(_TOP_P, _PAPER["top_p"]),
        "top_k": _flag(_TOP_K, _PAPER["top_k"]),
        "max_new_tokens": _MAX_NEW.value,
        "max_prompt_tokens": _MAX_PROMPT.value,
        "max_examples": _MAX_EXAMPLES.value or 0,
        "batch_size": _flag(_BATCH, _PAPER["batch_size"]),
        "template": _TEMPLATE.value,
        "seed": _flag(_SEED, 0),
    }
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
    mesh = sharding.make_mesh({"data": -1})
    results, dropped = {}, {}
    for name in names:
        examples, dropped[name] = _examples(name, train_problems)
        batch = _call_rows(protocol["batch_size"], k, len(examples), mesh)
        task = "gsm8k" if name == "gsm8k" else "math"
        with rewards.RewardFn(rewards.RewardConfig(task=task)) as reward_fn:
            results[name] = evaluation.evaluate_policy(
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
                batch_size=batch,
                rng=jax.random.fold_in(
                    jax.random.PRNGKey(protocol["seed"]), zlib.crc32(name.encode())
                ),
                mesh=mesh,
                progress=True,
                desc=name,
            )
    return results, protocol, model, dropped


def _fmt_ci(value: float, ci) -> str:
    return f"{value:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"


def markdown_table(result: dict) -> str:
    """The per-benchmark table (mean@k and pass@k with their CIs, pass@1, maj@k) and its caption."""
    p, ci = result["protocol"], result["confidence_intervals"]
    k = p["num_samples"]
    caption = (
        f"k = {k} samples per problem, temperature {p['temperature']}, top-p {p['top_p']}, "
        f"top-k {p['top_k']}, at most {p['max_new_tokens']} new tokens, seed {p['seed']}. "
        f"pass@k: unbiased estimator (Chen et al. 2021). [low, high]: {ci['confidence']:.0%} "
        f"percentile-bootstrap CI over problems (Efron 1979; {ci['resamples']} resamples, seed "
        f"{ci['seed']}; pooled: problem-weighted, resampled within each benchmark), exact "
        "Clopper-Pearson where every per-problem score is 0 or 1 (pass@k: always)."
    )
    head = (
        f"| benchmark | problems | mean@{k} [{ci['confidence']:.0%} CI] | pass@{k} "
        f"[{ci['confidence']:.0%} CI] | pass@1 | maj@{k} |\n|---|---|---|---|---|---|\n"
    )
    rows = []
    named = [*result["per_dataset"].items(), ("**pooled**", result["pooled"])]
    for name, r in named:
        maj = r.get(f"maj_at_{k}")
        rows.append(
            f"| {name} | {r['num_problems']} | {_fmt_ci(r['mean_at_1'], r['ci'][f'mean_at_{k}'])} "
            f"| {_fmt_ci(r[f'pass_at_{k}'], r['ci'][f'pass_at_{k}'])} | {r['pass_at_1']:.3f} | "
            f"{'' if maj is None else f'{maj:.3f}'} |"
        )
    if any(low == high for _, r in named for low, high in r["ci"].values()):
        rows.append(
            "\nA zero-width interval: every problem had the same (fractional) score, which "
            "resampling problems cannot see past."
        )
    return f"{caption}\n\n{head}" + "\n".join(rows) + "\n"


def assemble(results: dict, protocol: dict, *, seed: int) -> dict:
    """The JSON result: per-dataset and pooled summaries, each with its ``ci``."""
    k = protocol["num_samples"]
    ci = evaluation.confidence_intervals(
        results, k, confidence=_CONFIDENCE.value, num_resamples=_RESAMPLES.value, seed=seed
    )
    per_dataset = {}
    for name, r in results.items():
        per_dataset[name] = {**r.summary, "ci": ci["per_dataset"][name]}
    keys = ["mean_at_1", f"mean_at_{k}", "pass_at_1", f"pass_at_{k}", f"maj_at_{k}"]
    pooled = evaluation.pooled_summary(per_dataset, keys)
    pooled["ci"] = ci["pooled"]
    return {
        "per_dataset": per_dataset,
        "pooled": pooled,
        "protocol": protocol,
        "confidence_intervals": {
            "method": "percentile bootstrap over problems (Efron 1979); pooled: stratified "
            "by benchmark; exact Clopper-Pearson where every per-problem score is 0 or 1",
            "confidence": _CONFIDENCE.value,
            "resamples": _RESAMPLES.value,
            "seed": seed,
        },
    }


def run(argv=None) -> dict:
    """The whole command (flags already parsed); returns the JSON result."""
    del argv
    _check_flags()
    out = _output_path()
    names = evaluation.resolve_datasets(_SUITE.value, _DATASETS.value)
    if _WORKDIR.value:
        config = _workdir_config()
        source_dir = _SOURCE.value or config.data.source_dir
        names = names or tuple(config.eval.datasets)
    else:
        config, source_dir, names = None, _SOURCE.value, names or ("gsm8k",)
    reads = [(n, "arithmetic" if n == "arithmetic" else "test") for n in names]
    files = _data_files(
        reads + [("dapo_math", "train")] * _EXCLUDE.value,
        source_dir,
        config,
    )
    if _WORKDIR.value:
        results, protocol, model = _evaluate_workdir(names, source_dir)
        dropped = {}
    else:
        results, protocol, model, dropped = _evaluate_on_disk(names)
    result = assemble(results, protocol, seed=protocol["seed"])
    for name, n in dropped.items():
        result["per_dataset"][name]["excluded_train_overlap"] = n
    result.update(
        suite=_SUITE.value,
        model=model,
        data={"source_dir": str(source_dir or datasets.default_source_dir() or ""), "files": files},
        versions={
            "grpo_jax": grpo_jax.__version__,
            "jax": jax.__version__,
            "flax": flax.__version__,
            "python": platform.python_version(),
        },
    )
    if "checkpoint_step" in model:
        result["checkpoint_step"] = model["checkpoint_step"]
    _write_atomically(out, json.dumps(result, indent=2, sort_keys=True, default=float))
    table = markdown_table(result)
    _write_atomically(os.path.splitext(out)[0] + ".md", table)
    print(table)
    print(f"wrote {out}")
    print(json.dumps(result, sort_keys=True, default=float), flush=True)
    return result


def main(argv):
    """Runs `run` (under `grpo_jax.cli.run_absl`: a bad input is one ``error:`` line, exit 2)."""
    run(argv)  # returns None: absl exits 0 (a returned dict would be the exit status)


if __name__ == "__main__":
    cli.run_absl(main)
