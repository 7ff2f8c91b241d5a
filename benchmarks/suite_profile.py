"""Where the test suite's time goes: per test, wall seconds and JAX's trace / lower / XLA compile
seconds and compile count (in the pytest process; a test's subprocesses count as wall only).

A pytest plugin, then a summary:

    python -m pytest -n 2 -q -p benchmarks.suite_profile            # writes $SUITE_PROFILE_DIR
    python benchmarks/suite_profile.py [N]                           # per module, N slowest tests

Rows go to ``$SUITE_PROFILE_DIR`` (default /tmp/suite_profile), one JSON file per worker.
To see what a machine whose persistent cache never hits pays (jax#38445, some AVX-512 Xeons):
``JAX_ENABLE_COMPILATION_CACHE=false``. Numbers: benchmarks/test_suite_time.md.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import sys
import time

import pytest

_DIR = os.environ.get("SUITE_PROFILE_DIR", "/tmp/suite_profile")
_EVENTS = {
    "jaxpr_trace_duration": "trace",
    "jaxpr_to_mlir_module_duration": "lower",
    "backend_compile_duration": "compile",
}
_acc: dict = {}
_rows: list = []


def _listener(event, duration, **_):
    key = _EVENTS.get(event.rsplit("/", 1)[-1])
    if key:
        _acc[key] = _acc.get(key, 0.0) + duration
        if key == "compile":
            _acc["n_compile"] = _acc.get("n_compile", 0) + 1


def pytest_configure(config):
    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(_listener)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _acc.clear()
    start = time.time()
    yield
    _rows.append({"id": item.nodeid, "wall": time.time() - start, **_acc})


def pytest_sessionfinish(session):
    os.makedirs(_DIR, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(os.path.join(_DIR, f"rows_{worker}_{os.getpid()}.json"), "w") as f:
        json.dump(_rows, f)


def summary(rows, slowest: int = 0) -> str:
    keys = ("wall", "trace", "lower", "compile", "n_compile")
    total, by_module = collections.Counter(), collections.defaultdict(collections.Counter)
    for r in rows:
        module = r["id"].split("::")[0]
        by_module[module]["n"] += 1
        for k in keys:
            total[k] += r.get(k, 0)
            by_module[module][k] += r.get(k, 0)
    lines = [f"{len(rows)} tests; worker-seconds " + ", ".join(f"{k} {total[k]:.0f}" for k in keys)]
    lines.append(
        f"{'module':52s} {'n':>4s} {'wall':>6s} {'trace':>6s} {'lower':>6s} "
        f"{'compile':>7s} {'#comp':>6s}"
    )
    for module, c in sorted(by_module.items(), key=lambda kv: -kv[1]["wall"]):
        lines.append(
            f"{module:52s} {c['n']:4d} {c['wall']:6.0f} {c['trace']:6.0f} "
            f"{c['lower']:6.0f} {c['compile']:7.0f} {c['n_compile']:6d}"
        )
    for r in sorted(rows, key=lambda r: -r["wall"])[:slowest]:
        lines.append(f"{r['wall']:7.1f} s  compile {r.get('compile', 0):6.1f} s  {r['id']}")
    return "\n".join(lines)


if __name__ == "__main__":
    rows = [r for f in glob.glob(os.path.join(_DIR, "rows_*.json")) for r in json.load(open(f))]
    print(summary(rows, int(sys.argv[1]) if len(sys.argv) > 1 else 0))
