"""Every command-line entry point answers bad input the same way (`grpo_jax.cli`): one
``error: ...`` line on stderr naming the flag, path or value, exit status 2, no traceback, and
before anything compiles.

Each entry point runs in one subprocess (`_DRIVER`) that imports JAX once and forks a child per
case, which executes the script as ``__main__`` (what ``python -m experiments.X`` does).
"""

import json
import os
import subprocess
import sys

import pytest
from test_train import smoke_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Imports the heavy libraries once, then runs `module` as __main__ for each argv in `cases`
# (JSON) in a forked child (fresh flags, nothing shared between cases; a case that hangs or trains
# is killed by SIGALRM); prints [{code, stderr}] as JSON.
_DRIVER = r"""
import importlib, json, os, runpy, signal, sys, traceback
module, cases, preload = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
for name in filter(None, preload.split(",")):
    importlib.import_module(name)  # no backend is started: the children start their own
results = []
for argv in cases:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.dup2(w, 2)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        signal.alarm(120)
        sys.argv = [module] + argv
        code = 0
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        err = f.read()
    status = os.waitpid(pid, 0)[1]
    results.append({"code": os.waitstatus_to_exitcode(status), "stderr": err})
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_errors")
    (root / "empty").mkdir()
    (root / "nockpt").mkdir()  # a run's config.json, no checkpoint
    with open(root / "nockpt" / "config.json", "w") as f:
        json.dump(smoke_config().to_dict(), f, default=str)
    return {
        "missing": str(root / "missing"),
        "empty": str(root / "empty"),
        "nockpt": str(root / "nockpt"),
        "root": str(root),
    }


_PAIR = ["--coordinator_address=localhost:1", "--num_processes=2"]  # never reached: refused first
_K1 = ["--config.rollout.max_staleness=1", "--workdir={missing}"]

# entry point -> [(argv, what the error line must name)]; {missing} / {empty}: see `dirs`
CASES = {
    "experiments.run": [
        (["--nope=1"], "nope"),
        (["--distributed=maybe"], "maybe"),
        (["--config.stepz=3", "--workdir={missing}"], "config.stepz"),
        (["--config.rollout.top_p=2", "--workdir={missing}"], "top_p"),
        (["positional", "--workdir={missing}"], "positional"),
        # the two-group run (docs/disaggregated.md): refused before joining the job
        (["--role=generate", "--workdir={missing}"], "--role=generate is one group"),
        (["--role=train", *_PAIR, "--process_id=0", "--workdir={missing}"], "max_staleness"),
        (["--role=train", *_PAIR, "--process_id=0", "--train_processes=2", *_K1], "1 <= T"),
        (["--role=generate", *_PAIR, "--process_id=0", *_K1], "--role=generate on process 0"),
    ],
    "experiments.evaluate": [
        (["--workdir={missing}"], "{missing}"),
        (["--workdir={empty}"], "{empty}"),
        (["--workdir={nockpt}"], "{nockpt}"),
        (["--workdir={empty}", "--max_examples=lots"], "lots"),
        (["--nope=1"], "nope"),
    ],
    "experiments.benchmark": [
        (["--workdir={missing}", "--suite=math"], "{missing}"),
        (["--nope=1"], "nope"),
    ],
    "experiments.export": [
        (["--workdir={missing}", "--out={root}/o"], "{missing}"),
        (["--workdir={empty}", "--out={root}/o"], "{empty}"),
        (["--workdir={nockpt}", "--out={root}/o"], "no checkpoint in {nockpt}"),
        (["--workdir={empty}"], "--out"),
        (["--nope=1"], "nope"),
    ],
    "experiments.report": [
        (["--workdir={missing}"], "{missing}"),
        (["--workdir={empty}"], "{empty}"),
        ([], "workdir"),
        (["--workdir={empty}", "--nope=1"], "nope"),
    ],
    "experiments.oracle": [
        (["--config=configs/nope.py:grpo", "--out={root}/o"], "configs/nope.py"),
        (["--num_samples=lots"], "lots"),
        (["--set=no.such.key=1", "--out={root}/o"], "no.such.key"),
        (["--nope=1"], "--nope"),
    ],
    "experiments.compare": [
        (["--report_only", "--out={empty}"], "{empty}"),
        (["--workers=lots"], "lots"),
        (["--lrs=fast"], "fast"),
        (["--nope=1"], "--nope"),
    ],
    "experiments.memory": [
        (["--model=no-such-model", "--out_dir={root}/m"], "no-such-model"),
        (["--batch_rollouts=lots"], "lots"),
        (["--nope=1"], "--nope"),
    ],
    "experiments.aot": [
        (["--topology=v9z-3"], "v9z-3"),
        (["--tpu_table={missing}/a.json"], "{missing}"),
        (["--mesh=1,2", "--topology=8xh100", "--compiler=cpu"], "--mesh=1,2"),
        (["--nope=1", "--topology=8xh100"], "nope"),
    ],
    "experiments.pipeline_estimate": [
        (["--lengths={missing}/l.json"], "{missing}"),
        (["--reports={missing}"], "{missing}"),
        (["--nope=1"], "--nope"),
    ],
    "experiments.prepare_data": [
        ([], "--out"),
        (["--out={root}/d", "--dataset=no_such_set"], "no_such_set"),
        (["--out={root}/d", "--dataset=gsm8k", "--from={missing}"], "{missing}"),
        (["--out={root}/d", "--nope=1"], "nope"),
    ],
    "experiments.staleness": [
        (["--seeds=lots"], "--seeds=lots"),
        (["--seeds=-1,2"], "--seeds=-1,2"),
        (["--config=configs/nope.py:grpo", "--runs={root}/sr"], "configs/nope.py"),
        (["--report_only", "--runs={empty}", "--out={root}/st"], "{empty}"),
        (["--nope=1"], "nope"),
    ],
    "experiments.simulate_gdro": [
        (["--steps=0", "--out_dir={root}/s"], "--steps"),
        (["--allocators=uniform,bogus", "--out_dir={root}/s"], "bogus"),
        (["--nope=1"], "--nope"),
    ],
    "grpo_jax.cli": [  # the `grpo-jax` console script
        (["trian"], "trian"),
        (["export", "--workdir={missing}", "--out={root}/o"], "{missing}"),
        (["report", "--workdir={empty}"], "{empty}"),
    ],
}


_HEAVY = "jax,grpo_jax.train"  # what most entry points import: once per driver, not per case
_PRELOAD = {"experiments.report": "", "experiments.prepare_data": ""}  # they import no JAX


def _run_cases(module, cases, dirs):
    argvs = [[a.format(**dirs) for a in argv] for argv, _ in cases]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER, module, json.dumps(argvs), _PRELOAD.get(module, _HEAVY)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # ~5 s per entry point (its imports), ~60 s in all on 2 busy cores
@pytest.mark.parametrize("module", sorted(CASES))
def test_bad_input_is_one_error_line_and_exit_2(module, dirs):
    results = _run_cases(module, CASES[module], dirs)
    for (argv, named), res in zip(CASES[module], results):
        err = res["stderr"]
        lines = err.strip().splitlines()
        where = f"{module} {' '.join(argv)}: exit {res['code']}, stderr:\n{err[-2000:]}"
        assert res["code"] == 2, where
        assert "Traceback" not in err, where
        assert len(lines) == 1 and lines[0].startswith("error: "), where
        assert named.format(**dirs) in lines[0], where


def test_entry_points_cover_every_script():
    from grpo_jax import cli

    scripts = {f"experiments.{name}" for name in cli.commands(REPO)}
    assert scripts <= set(CASES), sorted(scripts - set(CASES))
