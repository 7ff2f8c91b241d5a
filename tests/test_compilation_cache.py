"""The session's persistent compilation cache (tests/conftest.py): set for this process and
inherited by subprocesses, uncapped (no lock, no directory scan per write), hit on CPU, a hit
computes the same bits as the compile, and a torn entry is a miss, not a wrong program."""

import os
import subprocess
import sys

import jax
import pytest
from jax._src import compilation_cache

_PROGRAM = """
import sys
import jax, jax.numpy as jnp
from jax._src import monitoring
events = []
monitoring.register_event_listener(lambda name, **kw: events.append(name))
@jax.jit
def f(x):
    h = jnp.tanh(x @ x.T) + jnp.exp(-x[:, :1] ** 2)
    return jax.nn.softmax(h, axis=-1).sum(0) + jnp.linalg.norm(h)
x = jax.random.normal(jax.random.PRNGKey(3), (96, 96))
y = jax.device_get(f(x))
hit = "/jax/compilation_cache/cache_hits" in events
sys.stdout.write(("hit " if hit else "miss ") + y.tobytes().hex())
"""


def test_the_session_cache_is_set_here_and_in_subprocesses():
    cache = os.environ["JAX_COMPILATION_CACHE_DIR"]
    assert cache and os.path.isdir(cache)
    assert jax.config.jax_compilation_cache_dir == cache
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
    out = subprocess.run(
        [sys.executable, "-c", "import jax; print(jax.config.jax_compilation_cache_dir)"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == cache


def test_the_session_cache_is_uncapped_so_a_write_scans_nothing():
    # a cap (> 0) makes every write stat and read every entry of the directory (O(N^2) over the
    # suite's ~6,000 writes, under a lock both workers share): conftest.py
    assert jax.config.jax_compilation_cache_max_size == -1
    jax.jit(lambda x: x * 3 + 1)(jax.numpy.arange(5.0)).block_until_ready()  # opens the cache
    cache = compilation_cache._cache
    assert cache is not None and not cache.eviction_enabled


def test_a_torn_entry_is_a_miss_with_a_warning_and_the_same_bits(tmp_path):
    # uncapped, an entry is written in place: a read racing the write sees a prefix of it.
    # zlib (JAX's codec without zstandard) rejects it, so the program compiles again
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path))
    run = lambda: subprocess.run(
        [sys.executable, "-c", _PROGRAM], env=env, capture_output=True, text=True, check=True
    )
    first = run()
    (entry,) = [p for p in tmp_path.iterdir() if p.name.startswith("jit_f-")]
    data = entry.read_bytes()
    entry.write_bytes(data[: len(data) // 2])
    torn = run()
    assert "Error reading persistent compilation cache entry for 'jit_f'" in torn.stderr
    assert torn.stdout.split()[1] == first.stdout.split()[1]


def test_a_cache_hit_on_cpu_computes_the_same_bits_as_the_compile(tmp_path):
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path))  # empty: the first compiles
    runs = [
        subprocess.run(
            [sys.executable, "-c", _PROGRAM], env=env, capture_output=True, text=True, check=True
        )
        for _ in range(2)
    ]
    outs = [r.stdout.split() for r in runs]
    if outs[1][0] == "miss" and "Target machine feature" in runs[1].stderr:
        pytest.skip(
            "XLA:CPU's loader refuses this CPU's own cache entries (its LLVM tuning flags, e.g. "
            "+prefer-no-gather, read as missing features: jax#38445), so every read misses here"
        )
    assert [o[0] for o in outs] == ["miss", "hit"]
    assert outs[0][1] == outs[1][1]


def test_cache_entries_carry_no_avx512_tuning_flags(tmp_path):
    # jax#38445: an entry compiled for an AVX-512 target records +prefer-no-gather and
    # +prefer-no-scatter, which XLA:CPU's loader reads as missing features on some Xeons (every
    # read misses there). Under the tests' flags (--xla_cpu_max_isa=AVX2, conftest.py) the
    # entry's recorded target has neither, on any x86 machine
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 only: the flags are x86 LLVM tuning features")
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path))
    subprocess.run([sys.executable, "-c", _PROGRAM], env=env, capture_output=True, check=True)
    entries = [
        p for p in tmp_path.iterdir() if p.name.startswith("jit_f-") and p.name.endswith("-cache")
    ]
    assert entries, sorted(p.name for p in tmp_path.iterdir())
    data = compilation_cache.decompress_executable(entries[0].read_bytes())
    assert b"x86_64" in data  # the recorded target machine is there to read
    assert b"prefer-no-gather" not in data and b"prefer-no-scatter" not in data
    assert b"+avx512f" not in data


_CRASHES_ONCE = """
import ctypes, os

def test_crashes_once(tmp_path_factory):
    marker = os.path.join(os.environ["MARKER_DIR"], "crashed")
    if not os.path.exists(marker):
        open(marker, "w").close()
        ctypes.string_at(0)  # a segfault, as a native library's would be

def test_fails():
    assert False, "an ordinary failure"
"""


def test_only_a_crashed_workers_test_runs_again(tmp_path):
    """pytest.ini: a test whose xdist worker died in native code runs once more (shown as a rerun);
    an assertion failure is reported as it is, never rerun."""
    (tmp_path / "test_crash.py").write_text(_CRASHES_ONCE)
    ini = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pytest.ini")
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", ini, "--rootdir", str(tmp_path), "-n", "2", "-q"]
        + ["-p", "no:cacheprovider", str(tmp_path / "test_crash.py")],
        env=dict(os.environ, MARKER_DIR=str(tmp_path)),
        capture_output=True,
        text=True,
    )
    last = out.stdout.strip().splitlines()[-1]
    assert out.returncode == 1 and "1 failed, 1 passed, 1 rerun" in last, out.stdout[-2000:]
    assert "FAILED" in out.stdout and "test_fails" in out.stdout.split("short test summary")[-1]
