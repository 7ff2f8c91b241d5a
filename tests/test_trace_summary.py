"""benchmarks/trace_summary.py: wall-time attribution of a jax.profiler trace."""

import os
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))

import trace_summary as ts


def test_attribute_wall_hand_computed():
    # A alone on [0, 2), A and B on [2, 4) (half each), B alone on [4, 6), nothing on [6, 10)
    shares, idle = ts.attribute_wall([("A", 0, 4), ("B", 2, 6)], 0, 10)
    assert shares == pytest.approx({"A": 3.0, "B": 3.0})
    assert idle == pytest.approx(4.0)
    # two open intervals of one label count twice: A 2 x 2/3, B 2/3
    shares, idle = ts.attribute_wall([("A", 0, 2), ("A", 0, 2), ("B", 0, 2)], 0, 2)
    assert shares == pytest.approx({"A": 4 / 3, "B": 2 / 3})
    assert idle == 0
    # clipped to [start, end); an interval outside it counts nothing
    shares, idle = ts.attribute_wall([("A", -5, 1), ("B", 3, 9), ("C", 20, 30)], 0, 4)
    assert shares == pytest.approx({"A": 1.0, "B": 1.0})
    assert idle == pytest.approx(2.0)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from("abc"), st.floats(0, 100), st.floats(0, 50)),
        max_size=20,
    )
)
def test_attribute_wall_shares_and_idle_add_up_to_the_wall(raw):
    intervals = [(label, t0, t0 + d) for label, t0, d in raw]
    shares, idle = ts.attribute_wall(intervals, 10.0, 90.0)
    assert sum(shares.values()) + idle == pytest.approx(80.0)
    assert idle >= -1e-9 and all(v >= 0 for v in shares.values())
    # no label gets more than its intervals' total length inside the window
    for label, got in shares.items():
        own = sum(max(0.0, min(t1, 90.0) - max(t0, 10.0)) for k, t0, t1 in intervals if k == label)
        assert got <= own + 1e-9


def test_thunk_kind_and_fusion_signatures():
    assert ts.thunk_kind("ynn_fusion.27") == "ynn_fusion"
    assert ts.thunk_kind("copy_bitcast_fusion.1.2") == "copy_bitcast_fusion"
    assert ts.thunk_kind("while") == "while"
    hlo = (
        "%fused_computation.7 (param_0.1: f32[128,576], param_1.2: f32[576,1536]) -> "
        "f32[128,1536] {\n  ROOT %dot.1 = f32[128,1536]{1,0} dot(...)\n}\n"
        "ENTRY %main {\n  %ynn_fusion.3 = f32[128,1536]{1,0} fusion(%a, %b), kind=kCustom, "
        "calls=%fused_computation.7, metadata={}\n}\n"
    )
    assert ts.fusion_signatures(hlo) == {
        "ynn_fusion.3": "f32[128,1536] <- f32[128,576], f32[576,1536]"
    }


def _events(*rows):
    return [{"ph": "X", "name": n, "ts": t, "dur": d} for n, t, d in rows]


def test_summarize_skips_executor_events_and_reports_seconds():
    events = _events(
        ("ThunkExecutor::Execute (wait for completion)", 0, 10_000_000),
        ("ThunkExecutor::Execute", 0, 10_000_000),
        ("ynn_fusion.1", 0, 6_000_000),
        ("ynn_fusion.2", 3_000_000, 3_000_000),
        ("copy_fusion.4", 7_000_000, 1_000_000),
        ("SlinkyThreadPool::Await", 0, 9_000_000),
    )
    wall, shares, idle = ts.summarize(events)
    assert wall == pytest.approx(10.0)
    assert shares == pytest.approx({"ynn_fusion": 6.0, "copy_fusion": 1.0})
    assert idle == pytest.approx(3.0)
    with pytest.raises(ValueError, match="XLA:CPU"):
        ts.summarize(_events(("ynn_fusion.1", 0, 5)))


def test_cli_on_a_real_trace(tmp_path, capsys):
    import jax
    import jax.numpy as jnp

    f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
    x = jnp.ones((256, 256))
    jax.block_until_ready(f(x))
    jax.profiler.start_trace(str(tmp_path), create_perfetto_trace=True)
    jax.block_until_ready(f(x))
    jax.profiler.stop_trace()
    hlo = tmp_path / "hlo.txt"
    hlo.write_text(f.lower(x).compile().as_text())
    ts.main([str(tmp_path), "--by=shape", f"--hlo={hlo}"])
    out = capsys.readouterr().out
    assert out.startswith("wall ")
    wall, shares, idle = ts.summarize(ts.load_events(str(tmp_path)))
    assert wall > 0 and sum(shares.values()) + idle == pytest.approx(wall)
    with pytest.raises(SystemExit, match="no \\*.trace.json.gz"):
        ts.main([str(tmp_path / "missing")])
