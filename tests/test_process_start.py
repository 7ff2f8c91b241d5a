"""What a run's process imports before its work starts: never torch or scipy.stats.

Every `python -m experiments.run` (and each of the test suite's ~hundreds of end-to-end
subprocesses) pays its imports: tensorboardX imports torch where it is installed (3.3 s of a
2-core CPU) only to accept torch tensors, and scipy.stats costs ~1 s for the benchmark
intervals alone (`metrics.clopper_pearson` imports it when called).
"""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PROGRAM = """
import sys, tempfile
import experiments.run
from grpo_jax import metrics, writers
d = tempfile.mkdtemp()
w = writers.MetricsWriter(d, tensorboard=True)
w.write(1, {"loss": 0.5})
w.close()
import glob
events = glob.glob(d + "/tensorboard/events.out.tfevents.*")
print("torch" in sys.modules, "scipy.stats" in sys.modules, len(events))
print(metrics.clopper_pearson([1.0, 0.0, 1.0, 1.0]), "scipy.stats" in sys.modules)
"""


def test_a_run_process_imports_neither_torch_nor_scipy_stats():
    pytest.importorskip("tensorboardX")
    out = subprocess.run(
        [sys.executable, "-c", _PROGRAM], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out[0] == "False False 1", out  # the event file written, torch not imported
    # the interval still computes (scipy.stats imported on that call): hand-checked values
    interval, imported = out[1].rsplit(" ", 1)
    low, high = (float(v) for v in interval.strip("[]").split(","))
    assert abs(low - 0.1941) < 1e-4 and abs(high - 0.9937) < 1e-4 and imported == "True"


def test_a_process_that_imported_torch_keeps_it_for_the_writer(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("tensorboardX")
    program = (
        "import torch, sys\n"
        "from grpo_jax import writers\n"
        f"w = writers.MetricsWriter({str(tmp_path)!r}, tensorboard=True)\n"
        "w.close()\n"
        "print(sys.modules['torch'] is torch)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "True"
