"""Optional Weights & Biases logging (config.logging.wandb_project), against a stand-in `wandb`
module that records the calls (no account, no network, wandb need not be installed)."""

import sys
import types

import pytest

from configs import arithmetic
from grpo_jax import train, writers
from grpo_jax.errors import ConfigError


class _FakeRun:
    def __init__(self, log, kwargs):
        self.log_calls, self.kwargs, self.finished = log, kwargs, False

    def log(self, data, step=None):
        self.log_calls.append((step, data))

    def finish(self):
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch):
    mod = types.ModuleType("wandb")
    mod.runs = []

    def init(**kwargs):
        run = _FakeRun([], kwargs)
        mod.runs.append(run)
        return run

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data

    mod.init, mod.Table = init, Table
    monkeypatch.setitem(sys.modules, "wandb", mod)
    return mod


def _config(steps=2):
    c = arithmetic.get_config("grpo,smoke")
    c.mesh.num_devices = 1
    c.logging.tensorboard = False
    c.steps = steps
    c.logging.wandb_project = "grpo-test"
    c.logging.wandb_mode = "offline"
    return c


@pytest.mark.slow
def test_run_logs_every_row_and_samples_and_resumes_the_same_wandb_run(tmp_path, fake_wandb):
    c = _config(steps=2)
    train.train_and_evaluate(c, str(tmp_path))
    (run,) = fake_wandb.runs
    kw = run.kwargs
    assert kw["project"] == "grpo-test" and kw["mode"] == "offline" and kw["resume"] == "allow"
    assert kw["name"] == tmp_path.name and kw["config"]["steps"] == 2 and kw["entity"] is None
    assert run.finished
    rows = writers.read_jsonl(str(tmp_path / "metrics.jsonl"))
    scalars = [(s, d) for s, d in run.log_calls if "samples" not in d]
    # the same steps and values as metrics.jsonl (scalars only; per-bin lists stay in the JSONL)
    assert [s for s, _ in scalars] == [r["step"] for r in rows]
    for (_, d), r in zip(scalars, rows):
        assert d == {k: v for k, v in r.items() if isinstance(v, (int, float)) and k != "step"}
    assert any(k.startswith("eval/") for k in scalars[-1][1])  # the final evaluation
    tables = [d["samples"] for _, d in run.log_calls if "samples" in d]
    assert tables and tables[0].columns == ["prompt", "completion", "answer", "reward"]
    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    assert kw["id"] == run_id
    # a longer run in the same workdir continues the same W&B run
    c.steps = 3
    train.train_and_evaluate(c, str(tmp_path), allow_changes=("steps",))
    assert fake_wandb.runs[1].kwargs["id"] == run_id
    assert [s for s, d in fake_wandb.runs[1].log_calls if "samples" not in d][0] == 3


def test_wandb_project_without_wandb_is_one_line_config_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(ConfigError, match="pip install wandb") as e:
        writers.MetricsWriter(str(tmp_path), tensorboard=False, wandb={"project": "p"})
    assert "\n" not in str(e.value) and "wandb_project" in str(e.value)


def test_no_project_means_no_wandb(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # never imported
    w = writers.MetricsWriter(str(tmp_path), tensorboard=False, wandb={"project": ""})
    w.write(1, {"loss": 1.0})
    w.close()
    assert not (tmp_path / "wandb_run_id").exists()
