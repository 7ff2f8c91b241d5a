"""The session's persistent compilation cache (tests/conftest.py): set for this process and
inherited by subprocesses, hit on CPU, and a hit computes the same bits as the compile."""

import os
import subprocess
import sys

import jax

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


def test_a_cache_hit_on_cpu_computes_the_same_bits_as_the_compile(tmp_path):
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path))  # empty: the first compiles
    outs = [
        subprocess.run(
            [sys.executable, "-c", _PROGRAM], env=env, capture_output=True, text=True, check=True
        ).stdout.split()
        for _ in range(2)
    ]
    assert [o[0] for o in outs] == ["miss", "hit"]
    assert outs[0][1] == outs[1][1]
