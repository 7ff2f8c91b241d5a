"""Test setup: 8 virtual CPU devices so sharding tests run on one CPU host, and one JAX
persistent compilation cache for the whole session.

The cache: every test module (and every end-to-end run in a subprocess) builds the same jitted
programs again (a smoke experiment's step functions are new closures per experiment), so the
first compile of each program is written to a directory that the pytest-xdist workers and the
subprocesses share through the environment (set here in the controlling process, before the
workers and any subprocess start; they inherit it). Thresholds 0: every program is cached.
A cached program is the same executable: results are bit-identical (the resume tests compare
cache-hit runs with the run that compiled, bit for bit). No size cap: a capped JAX cache
(``JAX_COMPILATION_CACHE_MAX_SIZE`` > 0) takes a file lock and, on every write, stats and reads
every entry of the directory to decide what to evict, so the suite's ~6,000 writes cost O(N^2):
at 1,000-3,000 entries one write took 0.12-0.38 s under the lock both workers share, and two Pallas
interpreter tests took 142 s instead of 27 (benchmarks/test_suite_time.md). Uncapped, entries
are written in place without a lock; a read that races a write sees a torn entry, which zlib's
checksum rejects (a miss, one warning, a compile), never a wrong program:
`tests/test_compilation_cache.py` checks both. Set ``JAX_COMPILATION_CACHE_DIR`` yourself to
keep a cache across sessions; otherwise a fresh temporary one is removed at exit. XLA:CPU's
loader refuses the entries of an AVX-512 target on some Xeons (jax#38445: XLA adds the LLVM
tuning flags +prefer-no-gather/+prefer-no-scatter there, read back as missing CPU features), so
every read would miss: the tests compile for AVX2 at most (below), whose entries carry no such
flag.
"""

import atexit
import os
import shutil
import tempfile

# XLA:CPU compile flags for the tests' tiny programs (most of the suite's time is compiling
# ~7,500 of them, each once): LLVM at -O0 and the classic fusion emitters compile a program
# ~3x faster than the defaults and run it a little slower (benchmarks/test_suite_time.md);
# results stay within every test's tolerance, and each comparison test runs both sides under
# the same flags (subprocesses inherit them)
# (a subprocess that sets XLA_FLAGS itself adds $GRPO_JAX_TEST_COMPILE_FLAGS)
# (--xla_cpu_max_isa=AVX2: the persistent cache's entries are loadable on AVX-512 Xeons too,
# see above; the tests' tiny programs lose nothing measurable)
os.environ["GRPO_JAX_TEST_COMPILE_FLAGS"] = (
    "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false --xla_cpu_max_isa=AVX2"
)
os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_force_host_platform_device_count=8 " + os.environ["GRPO_JAX_TEST_COMPILE_FLAGS"],
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # the controller (or a plain pytest) only
    _cache = tempfile.mkdtemp(prefix="grpo_jax_tests_jax_cache_")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# No cap (-1): no lock and no scan of the whole directory on every write (docstring)
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", "-1")

import jax

jax.config.update("jax_enable_x64", False)
