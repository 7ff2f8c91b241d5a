"""The sandboxed Python tool (grpo_jax/tools/sandbox.py, issue 44): each refusal is checked
against something that works without the sandbox (a listening socket, a readable file, a
writable directory), and every failure comes back as an observation."""

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from grpo_jax.tools import SandboxLimits, run_python

FAST = SandboxLimits(cpu_seconds=1, wall_seconds=5, memory_bytes=1 << 30, file_bytes=1 << 20)


def test_code_runs_and_its_output_is_the_observation():
    r = run_python("import math\nprint(math.comb(10, 3), sum(range(5)))", FAST)
    assert (r.status, r.returncode, r.stdout) == ("ok", 0, "120 10\n")
    assert r.observation() == "120 10\n"


def test_a_crashing_tool_is_an_observation_not_an_exception():
    r = run_python("print('before')\nraise ValueError('boom')", FAST)
    assert r.status == "error" and r.returncode == 1
    assert r.observation() == "before\nValueError: boom\n"
    assert run_python("1 +", FAST).observation().startswith("SyntaxError")


def test_the_network_is_refused_even_to_a_listening_local_server():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    threading.Thread(target=lambda: server.accept(), daemon=True).start()
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert plain.stdout == "connected\n"  # reachable without the sandbox
    r = run_python(code, FAST)
    assert (
        r.status == "error" and "PermissionError" in r.observation() and "connected" not in r.stdout
    )
    server.close()


def test_files_outside_its_directory_are_refused_and_inside_allowed(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    r = run_python(f"print(open({str(secret)!r}).read())", FAST)
    assert r.status == "error" and "s3cret" not in r.stdout
    assert "outside its directory" in r.observation()
    target = tmp_path / "written.txt"
    r = run_python(f"open({str(target)!r}, 'w').write('x')", FAST)
    assert r.status == "error" and not target.exists()
    r = run_python("import os\nos.remove(" + repr(str(secret)) + ")", FAST)
    assert r.status == "error" and secret.exists()
    r = run_python("open('a.txt', 'w').write('ok')\nprint(open('a.txt').read())", FAST)
    assert (r.status, r.stdout) == ("ok", "ok\n")


def test_each_call_gets_a_fresh_empty_directory():
    run_python("open('left.txt', 'w').write('x')", FAST)
    r = run_python("import os\nprint(sorted(os.listdir('.')))", FAST)
    assert r.stdout == "['.net', '.stderr', '.stdout']\n"


def test_processes_and_ctypes_are_refused():
    for code in (
        "import subprocess\nsubprocess.run(['true'])",
        "import os\nos.system('true')",
        "import os\nos.fork()",
        "import ctypes\nctypes.CDLL(None).getpid()",
    ):
        r = run_python(code, FAST)
        assert r.status == "error" and "PermissionError" in r.observation(), code


def test_runaway_cpu_is_stopped_by_its_cpu_limit():
    t0 = time.monotonic()
    r = run_python("while True:\n    pass", FAST)
    assert r.status == "cpu_limit" and time.monotonic() - t0 < FAST.wall_seconds
    assert r.observation() == "[cpu limit]\n"


def test_runaway_memory_is_stopped_by_its_memory_limit():
    r = run_python("x = bytearray(2 << 30)\nprint('allocated')", FAST)
    assert r.status == "memory_limit" and "allocated" not in r.stdout


def test_a_sleeping_tool_is_killed_at_its_wall_clock_limit():
    limits = SandboxLimits(cpu_seconds=5, wall_seconds=1)
    t0 = time.monotonic()
    r = run_python("import time\nprint('start', flush=True)\ntime.sleep(60)", limits)
    assert r.status == "timeout" and r.stdout == "start\n"
    assert time.monotonic() - t0 < 10


def test_runaway_output_is_cut_and_said():
    r = run_python("print('x' * (4 << 20))", FAST)
    assert r.status == "output_limit" and len(r.stdout) == FAST.output_bytes
    assert r.observation().endswith("[output limit]\n")


@pytest.mark.parametrize("field", ["cpu_seconds", "wall_seconds", "memory_bytes"])
def test_limits_must_be_positive(field):
    with pytest.raises(ValueError, match=field):
        SandboxLimits(**{field: 0})


def test_the_network_namespace_is_reported():
    r = run_python("print(1)", FAST)
    assert isinstance(r.network_isolated, bool)
    if os.geteuid() == 0:  # root may always make a network namespace
        assert r.network_isolated
