"""`python -m experiments.evaluate --suite=math` (issue 34): suite resolution, the bootstrap
confidence intervals against closed forms, a rerun reproducing the files exactly (a tiny random
HF checkpoint on a tiny data directory in the prepare_data layout), and bad inputs as one
``error:`` line with exit code 2."""

import json
import math
import os
import string
import subprocess
import sys

import numpy as np
import pytest

from grpo_jax import evaluation, metrics
from grpo_jax.models import loading
from grpo_jax.models.config import get_preset
from grpo_jax.models.tokenizer import Tokenizer
from grpo_jax.models.transformer import random_params

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUITE = ("math500", "aime24", "aime25", "amc23", "gsm8k")


# ------------------------------------------------------------------ suite resolution
def test_the_math_suite_and_explicit_datasets():
    assert evaluation.resolve_datasets("math") == SUITE
    assert evaluation.resolve_datasets("", ["gsm8k", " aime24"]) == ("gsm8k", "aime24")
    assert evaluation.resolve_datasets("", []) == ()
    with pytest.raises(ValueError, match="not both"):
        evaluation.resolve_datasets("math", ["gsm8k"])
    with pytest.raises(ValueError, match="unknown suite 'code'; suites: math"):
        evaluation.resolve_datasets("code")
    with pytest.raises(ValueError, match="unknown dataset.*aime26"):
        evaluation.resolve_datasets("", ["gsm8k", "aime26"])


# ------------------------------------------------------------------ confidence intervals
def test_a_constant_matrix_has_a_degenerate_bootstrap_and_an_exact_interval():
    for value in (0.0, 1.0, 0.3):
        assert metrics.bootstrap_ci(np.full(7, value)) == (value, value)
    # all solved / none solved: Clopper-Pearson of N (0) successes in N, alpha = 0.05
    results = {
        "a": evaluation.EvalResult({}, np.ones((5, 4), bool), np.full(5, -1)),
        "b": evaluation.EvalResult({}, np.ones((3, 4), bool), np.full(3, -1)),
        "c": evaluation.EvalResult({}, np.zeros((30, 4), bool), np.full(30, -1)),
    }
    ci = evaluation.confidence_intervals(results, 4, num_resamples=200)
    low5 = pytest.approx([0.025 ** (1 / 5), 1.0])
    assert ci["per_dataset"]["a"] == {"mean_at_4": low5, "pass_at_4": low5}
    # 0 of 30 (AIME's size): upper bound 1 - 0.025^(1/30) = 0.1157
    assert ci["per_dataset"]["c"]["pass_at_4"] == pytest.approx([0.0, 0.11570], abs=1e-5)
    # pooled: 8 of 38 problems solved; Clopper-Pearson by the beta quantiles (scipy-free check:
    # the bounds solve P(X >= 8 | p_low) = 0.025 and P(X <= 8 | p_high) = 0.025)
    low, high = ci["pooled"]["pass_at_4"]
    binom = lambda p, x: math.comb(38, x) * p**x * (1 - p) ** (38 - x)
    assert sum(binom(low, x) for x in range(8, 39)) == pytest.approx(0.025, abs=1e-9)
    assert sum(binom(high, x) for x in range(0, 9)) == pytest.approx(0.025, abs=1e-9)
    # every sample of a problem agrees here, so mean@4 is 0/1 per problem too: the same interval
    assert ci["pooled"]["mean_at_4"] == pytest.approx([low, high])


def test_the_exact_interval_is_monotone_in_the_number_solved():
    results = lambda x: {"b": evaluation.EvalResult({}, np.arange(30)[:, None] < x, None)}
    highs = [evaluation.confidence_intervals(results(x), 1)["per_dataset"]["b"] for x in range(4)]
    uppers = [h["pass_at_1"][1] for h in highs]
    assert uppers == sorted(uppers) and len(set(uppers)) == 4
    assert highs[0]["mean_at_1"] == highs[0]["pass_at_1"] == pytest.approx([0.0, 0.11570], abs=1e-5)
    # an interior constant (every problem at 1/4 of its samples) stays the bootstrap's point
    quarter = np.zeros((6, 4), bool)
    quarter[:, 0] = True
    ci = evaluation.confidence_intervals({"q": evaluation.EvalResult({}, quarter, None)}, 4)
    assert ci["per_dataset"]["q"]["mean_at_4"] == [0.25, 0.25]


def test_two_problems_match_the_exact_bootstrap_distribution():
    # values (0, 1): a replicate mean is 0, 1/2, 1 with probabilities 1/4, 1/2, 1/4, so the
    # 2.5% and 97.5% quantiles are 0 and 1; an 80% interval ((10%, 90%) quantiles) is too
    assert metrics.bootstrap_ci([0.0, 1.0]) == (0.0, 1.0)
    assert metrics.bootstrap_ci([0.0, 1.0], confidence=0.4) == (0.5, 0.5)  # 30% and 70%: 1/2


def test_the_interval_matches_the_normal_approximation_and_holds_the_estimate():
    rng = np.random.default_rng(1)
    correct = rng.random((400, 4)) < rng.random((400, 1))  # problems of varied difficulty
    scores = evaluation.per_problem_scores(correct, 4)
    for key, v in scores.items():
        low, high = metrics.bootstrap_ci(v, seed=3)
        half = 1.959964 * v.std() / np.sqrt(v.size)  # plug-in standard error of the mean
        assert low < v.mean() < high, key
        assert (high - low) / 2 == pytest.approx(half, rel=0.08), key
        assert metrics.bootstrap_ci(v, seed=3) == (low, high)  # seeded: identical
    # per-problem scores: mean@k is the row mean, pass@k (n = k) is "any correct"
    np.testing.assert_allclose(scores["mean_at_4"], correct.mean(axis=1))
    np.testing.assert_allclose(scores["pass_at_4"], correct.any(axis=1))


def test_the_pooled_interval_is_stratified_by_benchmark():
    # mean@2 of 1/2 on every problem of "a", 1 on every problem of "b" (not 0/1 scores, so the
    # bootstrap): stratified replicates keep 3 of each, so the pooled score is exactly 3/4 in
    # every replicate (unstratified it would vary)
    half = np.zeros((3, 2), bool)
    half[:, 0] = True
    results = {
        "a": evaluation.EvalResult({}, half, np.full(3, -1)),
        "b": evaluation.EvalResult({}, np.ones((3, 2), bool), np.full(3, -1)),
    }
    ci = evaluation.confidence_intervals(results, 2, num_resamples=500)
    assert ci["pooled"]["mean_at_2"] == pytest.approx([0.75, 0.75])
    assert metrics.bootstrap_ci([0.5, 0.5, 0.5, 1, 1, 1], num_resamples=500) != (0.75, 0.75)


def test_bad_interval_arguments_raise():
    with pytest.raises(ValueError, match="confidence"):
        metrics.bootstrap_ci([0.0, 1.0], confidence=1.0)
    with pytest.raises(ValueError, match="num_resamples"):
        metrics.bootstrap_ci([0.0, 1.0], num_resamples=0)
    with pytest.raises(ValueError, match="finite"):
        metrics.bootstrap_ci([0.0, float("nan")])
    assert np.isnan(metrics.bootstrap_ci([])).all()


# ------------------------------------------------------------------ the command
def _rows(name: str, i: int) -> dict:
    if name == "gsm8k":
        return {"question": f"What is {i} + {i}?", "answer": f"{i} + {i}\n#### {2 * i}"}
    return {"problem": f"Compute ${i} \\times 3$.", "answer": str(3 * i), "level": 1 + i % 5}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(checkpoint dir, data dir): a random 2-layer model with a character tokenizer, and three
    problems per suite benchmark in the prepare_data layout."""
    root = tmp_path_factory.mktemp("bench")
    chars = [c for c in string.printable if c not in "\x0b\x0c"]
    tok = Tokenizer.from_char_vocab(
        ["<pad>", "<eos>", "<unk>", *chars], num_special=3, eos_ids=[1], pad_id=0, unk_id=2
    )
    cfg = get_preset("tiny", vocab_size=tok.vocab_size)
    _, params = random_params(cfg, 0, stddev=0.5)
    ckpt = loading.save_hf_checkpoint(cfg, params, str(root / "ckpt"), tokenizer=tok)
    data = root / "data"
    for name in SUITE:
        (data / name).mkdir(parents=True)
        lines = [json.dumps(_rows(name, i)) for i in range(1, 4)]
        (data / name / "test.jsonl").write_text("\n".join(lines) + "\n")
    return ckpt, str(data)


def _evaluate(*args, cwd=REPO):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    env.pop("XLA_FLAGS", None)  # one CPU device: the conftest's 8 virtual ones only cost time
    env.pop(evaluation.datasets.ENV_VAR, None)
    return subprocess.run(
        [sys.executable, "-m", "experiments.evaluate", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _suite_args(ckpt, data, out):
    return [
        f"--hf_checkpoint={ckpt}",
        "--suite=math",
        f"--source_dir={data}",
        "--template=plain",
        "--max_examples=2",
        "--num_samples=3",
        "--max_new_tokens=6",
        "--max_prompt_tokens=48",
        "--batch_size=6",
        "--bootstrap_resamples=500",
        f"--output={out}",
    ]


@pytest.mark.slow  # three subprocess runs: ~30-40 s on a shared 2-core CPU
def test_rerunning_the_suite_reproduces_the_table_and_json(tiny, tmp_path):
    ckpt, data = tiny
    outs = []
    for i in range(2):
        out = tmp_path / f"run{i}" / "benchmark.json"
        out.parent.mkdir()
        proc = _evaluate(*_suite_args(ckpt, data, out))
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs.append(out)
    first, second = (json.loads(o.read_text()) for o in outs)
    assert first == second
    assert outs[0].with_suffix(".md").read_text() == outs[1].with_suffix(".md").read_text()
    assert sorted(first["per_dataset"]) == sorted(SUITE)  # sort_keys=True in the file
    for name, r in first["per_dataset"].items():
        assert r["num_problems"] == 2
        for key in ("mean_at_3", "pass_at_3"):
            low, high = r["ci"][key]
            assert 0.0 <= low <= r[key] <= high <= 1.0, (name, key)
    assert first["pooled"]["num_problems"] == 10
    paper = {"num_samples": 3, "temperature": 0.6, "top_p": 0.8, "top_k": 20, "seed": 0}
    assert {key: first["protocol"][key] for key in paper} == paper
    assert first["protocol"]["max_new_tokens"] == 6
    files = first["data"]["files"]
    assert files["aime24"][0]["file"] == "aime24/test.jsonl"
    assert len(files["aime24"][0]["sha256"]) == 64 and files["aime24"][0]["pinned_sha256"]
    assert set(first["versions"]) >= {"jax", "grpo_jax"}
    table = outs[0].with_suffix(".md").read_text()
    assert "percentile-bootstrap" in table and "| **pooled** | 10 |" in table
    # each benchmark's key is folded from its name: GSM8K alone scores as within the suite
    alone = tmp_path / "alone.json"
    args = [a for a in _suite_args(ckpt, data, alone) if a != "--suite=math"]
    proc = _evaluate(*args, "--datasets=gsm8k")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(alone.read_text())["per_dataset"]["gsm8k"] == first["per_dataset"]["gsm8k"]


BAD = [
    (["--suite=code"], "unknown suite"),
    (["--datasets=aime26"], "unknown dataset"),
    (["--suite=math", "--datasets=gsm8k"], "not both"),
    (["--num_samples=0"], "--num_samples must be >= 1"),
    (["--temperature=-0.1"], "--temperature must be >= 0"),
    (["--top_p=0"], "--top_p must lie in (0, 1]"),
    (["--top_p=1.5"], "--top_p must lie in (0, 1]"),
    (["--num_samples=four"], "num_samples"),
    (["--gguf=/nonexistent/m.gguf"], "conflict"),
]


@pytest.mark.parametrize("extra,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_inputs_are_one_line(tiny, extra, message):
    ckpt, data = tiny
    proc = _evaluate(f"--hf_checkpoint={ckpt}", f"--source_dir={data}", *extra)
    _assert_one_error_line(proc, message)


def _assert_one_error_line(proc, message):
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    assert message in lines[0] and "Traceback" not in proc.stderr


def test_missing_models_and_data_are_one_line(tiny, tmp_path):
    ckpt, data = tiny
    cases = [
        ([f"--workdir={tmp_path / 'none'}"], "no config.json"),
        ([f"--hf_checkpoint={tmp_path / 'none'}"], "checkpoint directory not found"),
        ([f"--gguf={tmp_path / 'none.gguf'}"], "file not found"),
        ([], "pass one of --workdir, --hf_checkpoint or --gguf"),
        ([f"--hf_checkpoint={ckpt}", "--suite=math", f"--source_dir={tmp_path}"], "prepare_data"),
    ]
    (tmp_path / "a_file").write_text("")
    bad_out = f"--output={tmp_path / 'a_file' / 'benchmark.json'}"  # fails before any sampling
    cases.append(([f"--hf_checkpoint={ckpt}", f"--source_dir={data}", bad_out], "--output="))
    for args, message in cases:
        _assert_one_error_line(_evaluate(*args), message)
