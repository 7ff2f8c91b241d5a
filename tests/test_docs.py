"""The prose that restates the code stays true: README's test command is what CI installs, the
notebooks do not restate config defaults (they drift), docs/byo.md names the intervals that
`experiments.evaluate` computes."""

import json
import os
import re
import shlex

import numpy as np

from grpo_jax import evaluation

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(*path):
    with open(os.path.join(REPO, *path), encoding="utf-8") as f:
        return f.read()


def _pip_installs(commands):
    """The ``pip install`` commands among shell lines, normalised (no -q, no quotes)."""
    out = []
    for line in commands:
        for part in line.split("&&"):
            words = [w for w in shlex.split(part) if w not in ("-q", "python", "-m")]
            if words[:2] == ["pip", "install"] and "--upgrade" not in words:
                out.append(words)
    return out


def test_readme_test_command_installs_what_ci_installs():
    readme = _read("README.md")
    step = readme[readme.index("2. Install the test extras") :]
    command = re.search(r"```bash\n(.*?)\n\s*```", step, re.S).group(1).strip()
    # the main suite's part of .ci/run: the XLA:GPU step after it installs its own extra
    ci = _read(".ci", "run").split("# --- XLA:GPU without a GPU")[0].splitlines()
    ci = [line for line in ci if not line.startswith("#")]
    assert _pip_installs([command]) == _pip_installs(ci)
    assert "python -m pytest -n 2 -q" in command and any(
        line.startswith("python -m pytest -n 2 -q") for line in ci
    )


def test_notebook_03_restates_no_config_default():
    nb = json.loads(_read("notebooks", "03_train_tiny.ipynb"))
    text = "\n".join("".join(cell["source"]) for cell in nb["cells"])
    stale = re.findall(r"default \d+|\d+ RL steps|\d+ warm-start", text)
    assert not stale, stale  # the cell prints the full run's values from the config instead
    assert "full.steps" in text and "full.rollout.prompts_per_step" in text


def test_byo_names_the_pass_at_k_interval_evaluate_computes():
    # 3 problems, 2 samples, none solved: pass@2 is 0 for each problem; a bootstrap interval
    # would be [0, 0], the exact Clopper-Pearson one is [0, 1 - 0.025^(1/3)]
    result = evaluation.EvalResult(
        summary={}, correct=np.zeros((3, 2), bool), levels=np.full(3, -1)
    )
    ci = evaluation.confidence_intervals({"t": result}, 2, num_resamples=50)
    np.testing.assert_allclose(ci["per_dataset"]["t"]["pass_at_2"], [0.0, 1 - 0.025 ** (1 / 3)])
    byo = " ".join(_read("docs", "byo.md").split())
    sentence = byo[byo.index("mean@k and pass@k come with") :][:300]
    assert "Clopper-Pearson" in sentence, sentence
