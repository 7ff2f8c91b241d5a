"""A new surrogate is one function and one registry line (`losses.register_surrogate`), chosen by
`config.algorithm.policy_loss_type` and trained from the config like the built-in ones."""

import os

import numpy as np
import pytest
from test_train import smoke_config

from grpo_jax import config_utils, losses, train, writers
from grpo_jax.errors import ConfigError


@pytest.fixture
def registry(monkeypatch):
    """A copy of the registry for one test (registrations do not leak into other tests)."""
    monkeypatch.setattr(losses, "SURROGATES", dict(losses.SURROGATES))


def _register_tripled():
    @losses.register_surrogate("tripled")  # the registry line
    def tripled(x: losses.SurrogateInputs, cfg: losses.PolicyLossConfig):  # the function
        """-3 A rho, unclipped; every token flagged as clipped (so the metric shows it)."""
        return -3.0 * x.advantages * x.ratio, x.mask


def test_registered_name_is_a_config_choice_and_duplicates_are_refused(registry):
    cfg = smoke_config("grpo", **{"algorithm.policy_loss_type": "tripled"})
    with pytest.raises(ConfigError, match="config.algorithm.policy_loss_type="):
        config_utils.validate(cfg)
    _register_tripled()
    config_utils.validate(cfg)
    with pytest.raises(ValueError, match="already registered"):
        _register_tripled()
    with pytest.raises(ValueError, match="dual_clip=2.0 applies to policy_loss_type='clip'"):
        losses.PolicyLossConfig(policy_loss_type="tripled", dual_clip=2.0)


@pytest.fixture
def varied_reward(tmp_path, monkeypatch):
    """A user reward that varies within groups (the smoke model never answers correctly, so the
    verifier's rewards, and with them the advantages, would all be equal)."""
    (tmp_path / "lengthy.py").write_text(
        "def by_length(completions, answers, **fields):\n"
        "    return [float(len(c) % 3) for c in completions]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    )
    return "lengthy:by_length"


@pytest.mark.slow
def test_new_surrogate_trains_two_steps_from_the_config(registry, varied_reward, tmp_path):
    _register_tripled()

    def run(name):
        cfg = smoke_config(
            "grpo",
            steps=2,
            **{
                "algorithm.policy_loss_type": name,
                "algorithm.tis_cap": 2.0,
                "reward.fn": varied_reward,
            },
        )
        train.train_and_evaluate(cfg, str(tmp_path / name))
        rows = writers.read_jsonl(str(tmp_path / name / "metrics.jsonl"))
        return [r for r in rows if "pg_loss" in r]

    new, clip = run("tripled"), run("clip")
    assert [r["step"] for r in new] == [1, 2]
    for r in new:
        assert np.isfinite(r["loss"]) and r["skipped_updates"] == 0
        assert r["clip_fraction"] == 1.0  # the new surrogate's own flag reached metrics.jsonl
        assert 0 < r["tis_weight_mean"] <= 2.0 and 0 <= r["tis_clip_fraction"] <= 1
    # step 1 samples the same rollouts in both runs (same seed and warm start) at ratio ~1, where
    # clip's surrogate is -A rho: the new one's policy-gradient loss is three times it
    assert clip[0]["clip_fraction"] < 1.0 and abs(clip[0]["pg_loss"]) > 1e-6
    np.testing.assert_allclose(new[0]["pg_loss"], 3.0 * clip[0]["pg_loss"], rtol=1e-3)
