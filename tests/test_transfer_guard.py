"""One RL step crosses between host and device only at the named crossings in
`grpo_jax.transfer`: `to_device` / `put` (explicit puts), `to_host` (explicit gets) and, for the
GDRO controllers' own small arrays, `transfer.controllers()`. Everything else runs under
``jax.transfer_guard("disallow")``, which raises on any implicit transfer (a numpy array handed
to a jitted function, ``np.asarray`` of a device array, a Python scalar in an eager op).
"""

import jax
import numpy as np
import pytest
from test_train import smoke_config

from grpo_jax import steps, train
from grpo_jax import transfer as xfer
from grpo_jax.experiment import build_experiment


def _guarded_step(cfg, monkeypatch) -> tuple[dict, int]:
    """Builds ``cfg``, runs one step to compile, then one step under the guard.
    Returns (the guarded step's metrics row, how often the controllers' crossing was entered)."""
    entered = []
    original = xfer.controllers

    def counting():
        entered.append(1)
        return original()

    monkeypatch.setattr(xfer, "controllers", counting)
    exp = build_experiment(cfg)
    try:
        run, _ = steps.init_run(exp, warm_start=False)
        fns = steps.make_steps(exp)
        source = exp.make_source()
        run = train.rl_step(exp, fns, run, source).run  # compiles (and may transfer constants)
        entered.clear()
        with jax.transfer_guard("disallow"):
            result = train.rl_step(exp, fns, run, source)
        return result.row, len(entered)
    finally:
        exp.close()


@pytest.mark.slow  # ~40 s: four algorithms' steps compiled
@pytest.mark.parametrize("algorithm", ["grpo", "ppo", "prompt_gdro", "rollout_gdro"])
def test_one_rl_step_crosses_only_at_the_named_crossings(algorithm, monkeypatch):
    row, controller_crossings = _guarded_step(smoke_config(algorithm), monkeypatch)
    assert np.isfinite(row["loss"]) and row["skipped_updates"] == 0
    if algorithm in ("grpo", "ppo"):
        assert controller_crossings == 0  # no controllers: nothing crosses outside to_/put
    else:
        assert controller_crossings >= 1


def test_the_guard_catches_an_implicit_transfer():
    """The premise: under the guard a numpy array handed to a jitted function raises."""
    f = jax.jit(lambda x: x + 1)
    f(np.ones(3, np.float32))
    with jax.transfer_guard("disallow"), pytest.raises(Exception, match="Disallowed"):
        f(np.ones(3, np.float32))
    with jax.transfer_guard("disallow"):
        f(xfer.put(np.ones(3, np.float32)))  # the named crossing is explicit


@pytest.mark.slow  # ~25 s
def test_dynamic_sampling_on_an_eight_device_mesh_crosses_only_at_the_named_crossings(
    monkeypatch,
):
    cfg = smoke_config("grpo", **{"algorithm.dynamic_sampling": True})
    cfg.algorithm.dynamic_sampling_max_rounds = 2
    cfg.mesh.num_devices, cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = 8, 2, 2, 2
    row, crossings = _guarded_step(cfg, monkeypatch)
    assert crossings == 0 and row["dynamic_sampling/rounds"] >= 1


@pytest.mark.slow  # ~20 s
def test_continuous_batching_crosses_only_at_the_named_crossings(monkeypatch):
    row, crossings = _guarded_step(
        smoke_config("grpo", **{"rollout.decode_slots": 16}), monkeypatch
    )
    assert crossings == 0 and 0 < row["decode_utilisation"] <= 1


@pytest.mark.slow  # ~30 s
def test_the_packed_update_on_an_eight_device_mesh_crosses_only_at_the_named_crossings(
    monkeypatch,
):
    """Its plans are host arrays: they cross by `transfer.replicate`, never implicitly."""
    cfg = smoke_config(
        "grpo",
        **{
            "algorithm.pack_sequences": True,
            "algorithm.mini_batch_size": 16,
            "algorithm.kl_coef": 0.01,
        },
    )
    cfg.mesh.num_devices, cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = 8, 2, 2, 2
    row, crossings = _guarded_step(cfg, monkeypatch)
    assert crossings == 0 and np.isfinite(row["loss"]) and row["skipped_updates"] == 0
