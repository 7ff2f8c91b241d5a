"""One home per setting: the config fields the pure functions' option dataclasses also hold are
generated from those dataclasses (`grpo_jax.config_schema.DATACLASS_FIELDS`), so the command
line and a notebook calling the functions get the same defaults."""

import dataclasses

import ml_collections
import pytest

from grpo_jax import advantages, algorithms, config_schema, gdro, losses
from grpo_jax.algorithms import field


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _section(config, path):
    for key in path.split("."):
        config = config[key]
    return config


def test_every_option_dataclass_field_is_in_its_section_with_the_dataclass_default():
    c = config_schema.base_config()
    for path, cls, skip in config_schema.DATACLASS_FIELDS:
        section = _section(c, path)
        for f in dataclasses.fields(cls):
            if f.name in skip:
                assert f.name not in section, f"{path}.{f.name}"
            else:
                assert section[f.name] == _default(f), f"{path}.{f.name}"


def test_the_default_sections_build_the_default_dataclasses():
    c = config_schema.base_config()
    assert losses.PolicyLossConfig.from_config(c.algorithm) == losses.PolicyLossConfig()
    assert advantages.AdvantageConfig.from_config(c.algorithm) == advantages.AdvantageConfig()
    for path, cls in (
        ("gdro.classifier", gdro.ClassifierConfig),
        ("gdro.prompt", gdro.PromptGDROConfig),
        ("gdro.rollout", gdro.RolloutGDROConfig),
        ("curricula.learnability", field.LearnabilityConfig),
        ("curricula.filter", field.FilterConfig),
        ("curricula.greso", field.GRESOConfig),
    ):
        assert cls.from_dict(_section(c, path)) == cls(), path


def test_a_default_written_in_the_schema_too_is_refused():
    section = ml_collections.ConfigDict({"epsilon_high": 0.2})
    with pytest.raises(ValueError, match="epsilon_high.*one home"):
        config_schema._add_dataclass_fields(section, losses.PolicyLossConfig)


def test_the_values_that_won_where_the_two_homes_disagreed():
    c = config_schema.base_config()
    # DAPO's clip-higher, which every CLI run used (and configs/dapo_qwen3.py states)
    assert losses.PolicyLossConfig().epsilon_high == c.algorithm.epsilon_high == 0.28
    # advantages unclipped (TRL, verl; `compute`'s zero-sum guarantee); the paper's +-5 is set
    # by configs/dapo_qwen3.py
    assert advantages.AdvantageConfig().advantage_clip == c.algorithm.advantage_clip == 0.0
    # "off" is 0 in both homes, not 0 in one and None in the other
    assert (c.algorithm.dual_clip, c.algorithm.tis_cap) == (0.0, 0.0)
    assert (c.gdro.prompt.score_clip, c.gdro.rollout.prior_strength) == (0.0, 0.0)
    assert gdro.PromptGDROConfig(score_clip=None).score_clip == 0.0


def test_the_classifier_margin_is_the_curriculum_own_unless_set():
    c = config_schema.base_config()
    assert c.gdro.classifier.delta is None and gdro.ClassifierConfig().delta == 0.0
    own = {"prompt_gdro": 0.03, "rollout_gdro": 0.0, "learnability": 0.0}
    for name, delta in own.items():
        curriculum = algorithms.get(name).curriculum
        assert curriculum.config_kwargs(c)["classifier_config"].delta == delta, name
    c.gdro.classifier.delta = 0.05
    for name in own:
        curriculum = algorithms.get(name).curriculum
        assert curriculum.config_kwargs(c)["classifier_config"].delta == 0.05, name


def test_an_older_workdir_config_reads_as_today():
    # before the one-home schema the classifier's "curriculum's own" margin was spelled -1
    old = config_schema.upgrade({"gdro": {"classifier": {"delta": -1.0}}})
    assert old.gdro.classifier.delta is None
    assert (
        config_schema.upgrade({"gdro": {"classifier": {"delta": 0.05}}}).gdro.classifier.delta
        == 0.05
    )
    assert config_schema.upgrade({}).to_dict() == config_schema.base_config().to_dict()
