"""`grpo-jax <command>`: the checkout's experiments/ from any directory, without installing
top-level `experiments` / `configs` packages (names other projects use)."""

import os
import subprocess
import sys

from grpo_jax import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _run(args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "grpo_jax.cli", *args],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_run_from_another_directory_resolves_the_checkout_configs(tmp_path):
    out = _run(["run", "--config=configs/arithmetic.py:grpo,smoke", "--print_config"], tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "steps: 3" in out.stdout  # the smoke config, resolved beside the package


def test_unknown_command_is_one_line_and_exit_2(tmp_path):
    out = _run(["trian"], tmp_path)
    assert out.returncode == 2
    (line,) = out.stderr.strip().splitlines()
    assert "unknown command 'trian'" in line and "run" in line


def test_commands_are_the_experiment_scripts():
    assert {"run", "evaluate", "export", "compare", "oracle"} <= set(cli.commands(REPO))
    assert cli.checkout_root() == REPO


def test_only_grpo_jax_is_installed_as_a_package(tmp_path):
    # from a directory outside the checkout, the scripts' package names are not importable
    code = "import importlib.util as u; print(u.find_spec('configs'), u.find_spec('experiments'))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=_env(), capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.split() == ["None", "None"], out.stdout
