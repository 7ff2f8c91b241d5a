"""Executes every notebook in notebooks/ top to bottom (nbclient, kernel python3, cwd = repo root).

A notebook passes when every cell runs without an exception. Each test prints one line
(`notebook NAME executed without error in S s`) past pytest's capture, so it shows in
`python -m pytest -n 2 -q` too, and records the time as the junit property `seconds`.
"""

import importlib.util
import os
import sys
import time

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
if importlib.util.find_spec("ipykernel") is None:  # the kernel's package; not imported here
    pytest.skip("ipykernel is not installed", allow_module_level=True)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK_DIR = os.path.join(REPO, "notebooks")
NOTEBOOKS = sorted(f for f in os.listdir(NOTEBOOK_DIR) if f.endswith(".ipynb"))
CELL_TIMEOUT_S = 600


def _kernel_env(tmp_dir):
    """The test process's environment with conftest.py's compile flags but not its 8 virtual
    devices (the notebooks run on one CPU device, as in Colab), with the CPU backend and with
    temporary files (notebook 03's workdir) under pytest's `tmp_dir`."""
    env = dict(os.environ)
    env["TMPDIR"] = str(tmp_dir)
    env["XLA_FLAGS"] = os.environ.get("GRPO_JAX_TEST_COMPILE_FLAGS", "")  # conftest.py
    env.pop("MPLBACKEND", None)  # the kernel picks the inline backend (figures as PNG)
    env["JAX_PLATFORMS"] = "cpu"
    return env


def test_three_notebooks_exist():
    assert NOTEBOOKS == [
        "01_grpo_in_pictures.ipynb",
        "02_gdro_controllers.ipynb",
        "03_train_tiny.ipynb",
    ]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_stored_without_outputs(name):
    nb = nbformat.read(os.path.join(NOTEBOOK_DIR, name), as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, name
    assert all(c.outputs == [] and c.execution_count is None for c in code), (
        f"{name} holds outputs; regenerate it with `python notebooks/build_notebooks.py`"
    )
    first = code[0].source
    assert '"google.colab" in sys.modules' in first and "%pip install" in first
    assert "sys.path.insert(0" in first


def _build_script():
    spec = importlib.util.spec_from_file_location(
        "build_notebooks", os.path.join(NOTEBOOK_DIR, "build_notebooks.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_matches_build_script(name):
    with open(os.path.join(NOTEBOOK_DIR, name), encoding="utf-8") as f:
        stored = f.read()
    assert stored == _build_script().build(name), (
        f"{name} differs from notebooks/build_notebooks.py; edit the script and rerun it"
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_executes(name, tmp_path, capfd, record_property):
    nb = nbformat.read(os.path.join(NOTEBOOK_DIR, name), as_version=4)
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=CELL_TIMEOUT_S, resources={"metadata": {"path": REPO}}
    )
    t0 = time.perf_counter()
    client.execute(cwd=REPO, env=_kernel_env(tmp_path))  # raises CellExecutionError on any error
    seconds = time.perf_counter() - t0
    record_property("seconds", round(seconds, 1))
    errors = [
        o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"
    ]
    assert not errors, errors
    figures = sum(
        1
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if o.output_type == "display_data" and "image/png" in o.get("data", {})
    )
    assert figures >= 2, f"{name}: expected figures, got {figures}"
    with capfd.disabled():
        sys.stderr.write(f"\nnotebook {name} executed without error in {seconds:.1f} s\n")
        sys.stderr.flush()
