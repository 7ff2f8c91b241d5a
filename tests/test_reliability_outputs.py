"""What a run and the scripts after it show: the total wall time of a resumed run, the line that
says where the outputs are, the report of a GRPO run (no empty GDRO heatmap), quiet scripts (no
library INFO logs unless ``--verbosity``), and a damaged checkpoint named in one plain line.

One smoke run in two parts (2 steps, then resumed to 3) serves the tests that need a workdir.
"""

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import time
import types

import jax
import jax.numpy as jnp
import pytest
from test_train import REPO, smoke_config

from grpo_jax import checkpointing, train

_LOG_LINE = re.compile(r"^[IWEF]\d{4} ")  # absl / glog lines (Orbax, JAX)
_FAST = 1000.0  # the first part's clock runs this much faster: its seconds dominate the total


def _meta(workdir, step):
    with open(os.path.join(workdir, "checkpoints", str(step), "meta", "metadata")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """A GRPO smoke run: 2 steps on a clock running `_FAST` times fast, then resumed to 3 steps
    on the real clock (``steps`` may change on a resume). Returns the workdir, the second part's
    stdout and its duration measured here."""
    workdir = str(tmp_path_factory.mktemp("resumed") / "run")
    real = time.perf_counter
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train, "time", types.SimpleNamespace(perf_counter=lambda: _FAST * real()))
        first = train.train_and_evaluate(smoke_config(steps=2), workdir)
    out = io.StringIO()
    t0 = real()
    with contextlib.redirect_stdout(out):
        second = train.train_and_evaluate(smoke_config(steps=3), workdir)
    return {
        "workdir": workdir,
        "first": first,
        "second": second,
        "stdout": out.getvalue(),
        "seconds": real() - t0,
    }


@pytest.mark.slow
def test_resumed_run_wall_seconds_counts_every_part(resumed):
    # checkpoint 2 carries the first part's seconds (its fast clock: thousands); the summary
    # adds the second part's, which this test measured from outside
    before = _meta(resumed["workdir"], 2)["wall_seconds"]
    assert before >= resumed["first"]["wall_seconds"] * 0.5 > 0
    total = resumed["second"]["wall_seconds"]
    assert before < total <= before + resumed["seconds"]
    with open(os.path.join(resumed["workdir"], "summary.json")) as f:
        assert json.load(f)["wall_seconds"] == pytest.approx(total)


@pytest.mark.slow
def test_run_ends_with_where_its_outputs_are(resumed):
    last = resumed["stdout"].strip().splitlines()[-1]
    assert last.startswith(f"outputs in {os.path.abspath(resumed['workdir'])}: ")
    for name in ("summary.json", "metrics.jsonl", "samples.jsonl", "checkpoints/3"):
        assert name in last


@pytest.mark.slow
def test_report_of_a_grpo_run_writes_no_empty_heatmap(resumed, capsys):
    from experiments import report

    rows = [json.loads(line) for line in open(os.path.join(resumed["workdir"], "metrics.jsonl"))]
    train_rows = [r for r in rows if "reward_mean" in r]
    # a GRPO run logs the per-bin lists, all 0 / NaN: nothing to plot
    assert any(isinstance(r.get("gdro/bin_share"), list) for r in train_rows)
    assert not report.informative(train_rows, "gdro/bin_share")
    assert not report.informative(train_rows, "gdro/bin_reward")
    paths = report.render(resumed["workdir"])
    names = sorted(os.path.basename(p) for p in paths)
    assert "curves.png" in names and "gdro_heatmaps.png" not in names
    assert not os.path.exists(os.path.join(resumed["workdir"], "report", "gdro_heatmaps.png"))


def test_informative_bins():
    from experiments import report

    assert report.informative([{"k": [0.0, "nan"]}, {"k": [0.0, 0.25]}], "k")
    assert not report.informative([{"k": [0.0, "nan"]}, {"k": []}, {"other": 1}], "k")


@pytest.mark.slow
def test_export_prints_no_library_info_logs(resumed, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    command = [
        sys.executable,
        "-m",
        "experiments.export",
        f"--workdir={resumed['workdir']}",
        f"--out={tmp_path / 'hf'}",
    ]
    quiet = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert not [line for line in quiet.stderr.splitlines() if _LOG_LINE.match(line)], quiet.stderr
    assert quiet.stdout.strip().splitlines() == [
        f"exported step 3 of {resumed['workdir']} to {tmp_path / 'hf'}"
    ]
    # --verbosity asks for them
    loud = subprocess.run(command + ["--verbosity=0"], cwd=REPO, env=env, capture_output=True)
    assert loud.returncode == 0
    assert any(_LOG_LINE.match(line) for line in loud.stderr.decode().splitlines())


def test_unreadable_checkpoint_warning_is_one_plain_line(tmp_path, capsys):
    d = str(tmp_path / "checkpoints")
    tree = lambda i: {"w": jax.random.normal(jax.random.PRNGKey(i), (256, 256)), "s": jnp.int32(i)}
    ck = checkpointing.Checkpointer(d, keep=3)
    for s in (1, 2):
        ck.save(s, tree(s), {"data": {"position": s}})
    ck.close()
    data = os.path.join(d, "2", "state", "ocdbt.process_0", "d")
    path = max((os.path.join(data, n) for n in os.listdir(data)), key=os.path.getsize)
    with open(path, "r+b") as f:  # a truncated copy: the largest data file cut in half
        f.truncate(os.path.getsize(path) // 2)
    step, _, _ = checkpointing.Checkpointer(d).restore_latest(checkpointing.abstract_like(tree(0)))
    assert step == 1
    captured = capsys.readouterr()
    (line,) = [x for x in captured.out.splitlines() if "is unreadable" in x]
    assert line.startswith(f"WARNING: checkpoint 2 in {d} is unreadable (")
    assert line.endswith("); falling back to checkpoint 1")
    assert "<" not in line and "pybind" not in line and "TensorStore" not in line
    assert "is unreadable" not in captured.err  # not a second time through the logger


def test_plain_reason_drops_library_internals():
    e = Exception(
        "Encountered error while reading array index: (slice(0, 8, 1),). See full TensorStore "
        "details: <bound method pybind11_detail_function_record_v1.spec of TensorStore({\n"
        "  'driver': 'zarr',\n})>."
    )
    assert checkpointing.plain_reason(e) == (
        "Encountered error while reading array index: (slice(0, 8, 1),)"
    )
    assert checkpointing.plain_reason(KeyError("no <object at 0x1> here")) == "KeyError: 'no here'"
    assert len(checkpointing.plain_reason(ValueError("x" * 500))) <= 200 + len("ValueError: ")
