"""Where the wall time of a `jax.profiler` trace goes, by XLA:CPU thunk.

  python benchmarks/trace_summary.py TRACE_DIR [--hlo=HLO.txt] [--by=kind|shape] [--top=20]

TRACE_DIR: a directory written by ``jax.profiler.start_trace(TRACE_DIR,
create_perfetto_trace=True)``; the newest ``*.trace.json.gz`` under it is read. Each instant of
the traced call (from the first to the last ``ThunkExecutor::Execute (wait ...)`` event) is
split equally among the thunks running at that instant, so independent thunks that overlap on
the host's threads are not counted twice and the shares add up to the wall time; "no thunk" is
the time when none runs (asynchronous Eigen ``dot`` thunks finish in it: their events cover
only the launch). ``--by=kind`` groups thunks by name without the numeric suffix
(``ynn_fusion.27`` -> ``ynn_fusion``); ``--by=shape`` labels each fusion with its output and
operand shapes from ``--hlo`` (``jitted.lower(...).compile().as_text()`` of the same program).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re

# executor, thread-pool and Python-side events: not thunks
_NOT_THUNKS = ("ThunkExecutor", "$", "Slinky", "ThreadpoolListener", "end:", "PjitFunction")


def thunk_kind(name: str) -> str:
    """A thunk's name without its numeric suffix: ``ynn_fusion.27`` -> ``ynn_fusion``."""
    return re.sub(r"(\.\d+)+$", "", name)


def attribute_wall(intervals, start: float, end: float) -> tuple[dict, float]:
    """Split the wall time [start, end) among labelled intervals.

    intervals: iterable of (label, t0, t1) with t0 <= t1 (any unit). At every instant the time
    is shared equally by the intervals open then (two overlapping intervals get half each).
    Returns ({label: time}, idle): the shares (clipped to [start, end)) and the time no
    interval covers; sum(shares) + idle == end - start.
    """
    points = []
    for label, t0, t1 in intervals:
        t0, t1 = max(t0, start), min(t1, end)
        if t1 > t0:
            points += [(t0, 1, label), (t1, -1, label)]
    points.sort(key=lambda p: (p[0], p[1]))
    shares: dict = collections.defaultdict(float)
    active: collections.Counter = collections.Counter()
    idle, last = 0.0, start
    for t, delta, label in points:
        if t > last:
            n = sum(active.values())
            if n == 0:
                idle += t - last
            else:
                for k, v in active.items():
                    shares[k] += (t - last) * v / n
            last = t
        active[label] += delta
        if not active[label]:
            del active[label]
    idle += max(end - last, 0.0)
    return dict(shares), idle


def fusion_signatures(hlo_text: str) -> dict[str, str]:
    """{fusion instruction name: "output shape <- operand shapes"} from compiled HLO text."""
    params = {}
    for m in re.finditer(r"^%([\w.\-]+) \(([^)]*)\) -> ", hlo_text, re.M):
        params[m.group(1)] = re.sub(r"param_[\w.]+: ", "", m.group(2))
    out = {}
    for m in re.finditer(r"^\s*%([\w.\-]+) = (\S+) fusion\(.*?calls=%([\w.\-]+)", hlo_text, re.M):
        shape = re.sub(r"\{[\d,]*\}", "", m.group(2))
        operands = re.sub(r"\{[\d,]*\}", "", params.get(m.group(3), "?"))
        out[m.group(1)] = f"{shape} <- {operands}"
    return out


def load_events(trace_dir: str) -> list[dict]:
    """The complete ("X") events of the newest perfetto trace under ``trace_dir``.

    Raises FileNotFoundError when there is none."""
    files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not files:
        raise FileNotFoundError(f"{trace_dir}: no *.trace.json.gz (create_perfetto_trace=True?)")
    with gzip.open(max(files, key=os.path.getmtime)) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def summarize(events: list[dict], signatures: dict[str, str] | None = None):
    """(wall s, {label: s}, no-thunk s) of one traced call (see the module docstring)."""
    calls = [e for e in events if e["name"].startswith("ThunkExecutor::Execute (wait")]
    if not calls:
        raise ValueError("no 'ThunkExecutor::Execute (wait ...)' event: not an XLA:CPU trace?")
    start = min(e["ts"] for e in calls)
    end = max(e["ts"] + e["dur"] for e in calls)

    def label(name):
        if signatures is not None and name in signatures:
            return f"{thunk_kind(name)} {signatures[name]}"
        return thunk_kind(name)

    intervals = [
        (label(e["name"]), e["ts"], e["ts"] + e["dur"])
        for e in events
        if not e["name"].startswith(_NOT_THUNKS)
    ]
    shares, idle = attribute_wall(intervals, start, end)
    us = 1e-6  # trace times are microseconds
    return (end - start) * us, {k: v * us for k, v in shares.items()}, idle * us


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace_dir")
    p.add_argument("--hlo", default="", help="compiled HLO text of the traced program")
    p.add_argument("--by", choices=("kind", "shape"), default="kind")
    p.add_argument("--top", type=int, default=20)
    a = p.parse_args(argv)
    if a.by == "shape" and not a.hlo:
        p.error("--by=shape needs --hlo")
    try:
        events = load_events(a.trace_dir)
        signatures = None
        if a.by == "shape":
            with open(a.hlo) as f:
                signatures = fusion_signatures(f.read())
        wall, shares, idle = summarize(events, signatures)
    except (OSError, ValueError) as e:
        raise SystemExit(f"trace_summary: {e}") from None
    print(f"wall {wall:.3f} s; no thunk running {idle:.3f} s ({100 * idle / wall:.1f}%)")
    for k, v in sorted(shares.items(), key=lambda kv: -kv[1])[: a.top]:
        print(f"{v:9.3f} s {100 * v / wall:5.1f}%  {k[:160]}")


if __name__ == "__main__":
    main()
