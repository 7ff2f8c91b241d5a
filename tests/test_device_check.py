"""benchmarks/device_check.py on a CPU: its plan, its argument checks and its table (the GPU
run itself needs a GPU; ``--dry_run`` prints what it would do)."""

import os
import subprocess
import sys

import jax

from benchmarks import device_check
from benchmarks.bench_step import apply_overrides, load_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args):
    return subprocess.run(
        [sys.executable, "benchmarks/device_check.py", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_dry_run_prints_every_phase_and_writes_nothing(tmp_path):
    out = tmp_path / "check"
    proc = _run("--dry_run", f"--out={out}")
    assert proc.returncode == 0, proc.stderr
    for name in device_check.plan("X"):
        assert f"[{name}] (limit " in proc.stdout, name
    assert "'not slow'" in proc.stdout  # commands printed as a shell would take them
    assert "JAX_PLATFORMS=cuda" in proc.stdout and "--compiler=gpu" in proc.stdout
    assert not out.exists()


def test_bad_arguments_exit_2_with_one_line(tmp_path):
    bad = _run("--dry_run", "--phases=identity,warp_drive")
    assert bad.returncode == 2 and "warp_drive" in bad.stderr
    assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    assert _run("--dry_run", "--budget_s=0").returncode == 2
    f = tmp_path / "a_file"
    f.write_text("")
    assert "is a file" in _run("--dry_run", f"--out={f}").stderr


def test_step_phases_build_the_model_shapes_they_name():
    from grpo_jax.experiment import build_experiment

    shapes = {}
    for name, sets in (("smollm2", device_check._SMOLLM2), ("qwen3", device_check._QWEN3_06B)):
        config = load_config(os.path.join(REPO, "configs/arithmetic.py") + ":grpo")
        apply_overrides(config, sets + device_check._BF16)
        mc = build_experiment(config, with_data=False, devices=jax.devices()[:1]).model_config
        shapes[name] = (mc.hidden_size, mc.intermediate_size, mc.num_layers, mc.num_heads)
        shapes[name] += (mc.num_kv_heads, mc.head_dim, mc.dtype)
    assert shapes["smollm2"] == (576, 1536, 30, 9, 3, 64, "bfloat16")  # SmolLM2-135M
    assert shapes["qwen3"] == (1024, 3072, 28, 16, 8, 128, "bfloat16")  # Qwen3-0.6B


def test_table_reads_each_phase():
    report = {
        "started": "20261206-000000",
        "phases": {
            "identity": {
                "status": "ok",
                "seconds": 2.0,
                "result": {"devices": 1, "device_kind": "NVIDIA H100 80GB HBM3", "versions": {}},
            },
            "step_qwen3_06b": {
                "status": "ok",
                "seconds": 40.0,
                "result": {
                    "params": 6e8,
                    "generate_tokens_per_s": 1234.4,
                    "update_tokens_per_s": 99.6,
                    "peak_bytes_in_use": 3 * 2**30,
                },
            },
            "tests": {"status": "failed", "seconds": 90.0, "output_tail": "x\n3 failed, 9 passed"},
            "memory": {"status": "timed out", "seconds": 60.0},
        },
    }
    text = device_check.table(report)
    assert "1 x NVIDIA H100 80GB HBM3" in text
    assert (
        "| step_qwen3_06b | ok | 40.0 | 600M params; generate 1234 tok/s, update 100 tok/s; peak 3.00 GiB |"
        in text
    )
    assert "| tests | failed | 90.0 | 3 failed, 9 passed |" in text
    assert "| memory | timed out | 60.0 |  |" in text
