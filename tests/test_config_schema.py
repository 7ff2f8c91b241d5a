"""One typed config that is the schema (issue 43): `RunConfig`'s section dataclasses hold every
default once (the pure functions' option dataclasses are sections themselves), the CLI's
ConfigDict is generated from them and read back by `typed`, validated once."""

import dataclasses
import json

import ml_collections
import pytest

from configs import arithmetic as arithmetic_config
from configs import dapo_qwen3, gsm8k_smollm2
from grpo_jax import advantages, algorithms, config_schema, gdro, losses
from grpo_jax.algorithms import field


def _leaves(cls, prefix=""):
    """(dotted CLI path, declared default, owning dataclass) of every leaf field of ``cls``."""
    out = []
    for f, hint in config_schema._leaf_fields(cls):
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            skip = f.metadata.get("skip", ())
            sub = prefix if f.metadata.get("flatten") else f"{prefix}{f.name}."
            out += [x for x in _leaves(hint, sub) if x[0].rsplit(".", 1)[-1] not in skip]
        else:
            out.append((prefix + f.name, config_schema._default(f), cls))
    return out


def _get(c, path):
    for key in path.split("."):
        c = c[key]
    return c


def test_every_field_has_one_default_and_the_cli_dict_holds_it():
    c = config_schema.base_config()
    leaves = _leaves(config_schema.RunConfig)
    paths = [p for p, _, _ in leaves]
    assert len(paths) == len(set(paths)), "a CLI name with two homes"
    for path, default, owner in leaves:
        value = _get(c, path)
        want = ml_collections.ConfigDict(default) if isinstance(default, dict) else default
        assert value == want, f"{path}: {value!r} vs {owner.__name__}'s {default!r}"
    flat = json.loads(json.dumps(c.to_dict()))

    def count(d):
        return sum(count(v) if isinstance(v, dict) and v else 1 for v in d.values())

    assert count(flat) == len(leaves)  # nothing in the dict that no dataclass declares


def test_the_model_section_takes_its_numerics_defaults_from_model_config():
    from grpo_jax.models.config import ModelConfig

    model = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    shared = [f for f in dataclasses.fields(config_schema.ModelSection) if f.name in model]
    assert {f.name for f in shared} == {"dtype", "param_dtype", "remat", "attention_impl"}
    for f in shared:
        assert f.default == model[f.name], f.name


def test_a_default_written_in_the_schema_too_is_refused():
    section = ml_collections.ConfigDict({"epsilon_high": 0.2})
    with pytest.raises(ValueError, match="epsilon_high.*one home"):
        config_schema._fill_flat(section, losses.PolicyLossConfig, None, ())


def test_the_values_that_won_where_the_two_homes_disagreed():
    c = config_schema.base_config()
    # DAPO's clip-higher, which every CLI run used (and configs/dapo_qwen3.py states)
    assert losses.PolicyLossConfig().epsilon_high == c.algorithm.epsilon_high == 0.28
    # advantages unclipped (TRL, verl; `compute`'s zero-sum guarantee); the paper's +-5 is set
    # by configs/dapo_qwen3.py
    assert advantages.AdvantageConfig().advantage_clip == c.algorithm.advantage_clip == 0.0
    assert dapo_qwen3.get_config("8b,grpo").algorithm.advantage_clip == 5.0
    # "off" is 0 in both homes, not 0 in one and None in the other
    assert (c.algorithm.dual_clip, c.algorithm.tis_cap) == (0.0, 0.0)
    assert (c.gdro.prompt.score_clip, c.gdro.rollout.prior_strength) == (0.0, 0.0)
    assert gdro.PromptGDROConfig(score_clip=None).score_clip == 0.0


CONFIGS = [
    ("base", config_schema.base_config),
    *[
        (f"arithmetic:{a}", lambda a=a: arithmetic_config.get_config(a))
        for a in ("grpo", "prompt_gdro", "rollout_gdro,paper_gdro", "ppo", "grpo,pool", "greso")
    ],
    ("dapo_qwen3:rollout_gdro", lambda: dapo_qwen3.get_config("8b,rollout_gdro")),
    ("gsm8k_smollm2", lambda: gsm8k_smollm2.get_config()),
]


@pytest.mark.parametrize("name,make", CONFIGS, ids=[n for n, _ in CONFIGS])
def test_typed_round_trips_and_equals_what_the_builders_build(name, make):
    c = make()
    run = config_schema.typed(c)
    # dict -> typed -> dict -> typed is a fixed point (the switches stay resolved)
    again = config_schema.to_config_dict(run)
    assert config_schema.typed(again) == run
    assert config_schema.typed(json.loads(json.dumps(c.to_dict()))) == run  # config.json
    # every plain field comes back as written (one left at None, resolved: its value)
    for path, _, owner in _leaves(config_schema.RunConfig):
        if owner.__module__ == config_schema.__name__ and _get(c, path) is not None:
            assert _get(again, path) == _get(c, path), path
    # the option dataclasses the run builds from the dict are the typed ones
    assert losses.PolicyLossConfig.from_config(c.algorithm) == run.algorithm.loss
    assert advantages.AdvantageConfig.from_config(c.algorithm) == run.algorithm.advantage
    assert (
        gdro.ClassifierConfig.from_dict({**c.gdro.classifier, "delta": run.gdro.classifier.delta})
        == run.gdro.classifier
    )
    assert gdro.PromptGDROConfig.from_dict(c.gdro.prompt) == run.gdro.prompt
    assert field.GRESOConfig.from_dict(c.curricula.greso) == run.curricula.greso


def test_the_classifier_margin_is_the_curriculum_own_unless_set():
    """The curricula take the typed config's sections: the margin resolved there, once."""
    c = config_schema.base_config()
    assert c.gdro.classifier.delta is None and gdro.ClassifierConfig().delta is None
    assert gdro.ClassifierConfig().margin == 0.0  # a classifier built alone: no margin
    for name, margin in {"prompt_gdro": 0.03, "rollout_gdro": 0.0, "learnability": 0.0}.items():
        c.algorithm.name = name
        c.gdro.classifier.delta = None
        curriculum = algorithms.get(name).curriculum.from_config(config_schema.typed(c), 16)
        assert curriculum.classifier_config.delta == margin, name
        c.gdro.classifier.delta = 0.05
        assert config_schema.typed(c).gdro.classifier.delta == 0.05, name


def test_a_resume_compares_what_the_fields_resolve_to():
    """A config written with None (the CLI's) and one with the resolved values (a typed
    `RunConfig` written back, e.g. through the Python API) are the same run; a real change is
    still refused."""
    from grpo_jax import config_utils

    c = config_schema.base_config()
    c.algorithm.name = "prompt_gdro"
    resolved = config_schema.to_config_dict(config_schema.typed(c))
    assert resolved.algorithm.kl_in == "loss" and resolved.gdro.classifier.delta == 0.03
    assert config_utils.config_changes(c.to_dict(), resolved.to_dict()) == []
    resolved.gdro.classifier.delta = 0.05
    assert config_utils.config_changes(c.to_dict(), resolved.to_dict()) == [
        ("gdro.classifier.delta", 0.03, 0.05)
    ]
    # a field left at None on both sides follows its source: a change is reported (and
    # allowed) once, on the source field
    for source, value, follower in (
        ("model.dtype", "bfloat16", "reward.model_dtype"),
        ("rollout.max_new_tokens", 16, "eval.max_new_tokens"),
        ("algorithm.name", "ppo", "algorithm.kl_in"),
    ):
        new = config_schema.base_config()
        section, key = source.rsplit(".", 1)
        _get(new, section)[key] = value
        changes = config_utils.config_changes(config_schema.base_config().to_dict(), new.to_dict())
        assert [p for p, _, _ in changes] == [source], (source, changes)
        assert config_utils.check_resume(
            config_schema.base_config().to_dict(), new.to_dict(), "w", allow_changes=(source,)
        ), follower


def test_rollout_gdro_mean_budget_is_the_run_group_size():
    """`gdro.rollout.n_bar` is not a CLI field: typed() sets it from rollout.rollouts_per_prompt
    for the curricula that allocate rollouts, so a budget of 16 with n_min 8 is valid; other
    algorithms do not check the section against their group size."""
    c = config_schema.base_config()
    c.algorithm.name = "rollout_gdro"
    c.rollout.rollouts_per_prompt, c.gdro.rollout.n_min, c.gdro.rollout.n_max = 16, 8, 32
    assert config_schema.typed(c).gdro.rollout.n_bar == 16
    c.rollout.rollouts_per_prompt = 40
    with pytest.raises(ValueError, match=r"config\.gdro\.rollout: .*n_bar .*got 40"):
        config_schema.typed(c)
    c.algorithm.name = "grpo"  # GRPO with 40 rollouts per prompt: the section is not its
    assert config_schema.typed(c).gdro.rollout.n_bar == 32  # unused: clipped into range
    assert config_schema.typed({"steps": 3}).steps == 3  # a partial dict: defaults elsewhere


def test_a_field_whose_default_is_another_field_takes_it_in_the_typed_config():
    """No None (nor 0 / "") stands for another value in the typed config: `typed` resolves it."""
    c = config_schema.base_config()
    c.rollout.max_new_tokens, c.model.dtype, c.algorithm.name = 24, "bfloat16", "ppo"
    run = config_schema.typed(c)
    assert run.eval.max_new_tokens == 24 and run.reward.model_dtype == "bfloat16"
    assert run.algorithm.kl_in == "reward"  # PPO's learner pays the KL in the reward
    c.algorithm.name = "grpo"
    assert config_schema.typed(c).algorithm.kl_in == "loss"
    c.eval.max_new_tokens, c.reward.model_dtype = 40, "float32"  # set: kept
    run = config_schema.typed(c)
    assert run.eval.max_new_tokens == 40 and run.reward.model_dtype == "float32"
    # what the builders read: the evaluation sampler's budget
    from grpo_jax import experiment

    c.eval.max_new_tokens = None
    train, evaluation = experiment._sampling_configs(config_schema.typed(c), None, 4)
    assert evaluation.max_new_tokens == train.max_new_tokens == 24
    # the old spellings: 0 and "" read as None from a saved config; refused when written now
    old = config_schema.upgrade({"eval": {"max_new_tokens": 0}, "reward": {"model_dtype": ""}})
    assert old.eval.max_new_tokens is None and old.reward.model_dtype is None
    from grpo_jax import config_utils
    from grpo_jax.errors import ConfigError

    c.eval.max_new_tokens = 0
    with pytest.raises(ConfigError, match=r"eval\.max_new_tokens=0 must be a positive integer"):
        config_utils.validate(c)


@pytest.mark.parametrize(
    "path,value,message",
    [
        ("algorithm.epsilon_low", 2.0, r"^config\.algorithm\.epsilon_low=2\.0 must be"),
        ("algorithm.scale_rewards", "rows", r"^config\.algorithm\.scale_rewards='rows'"),
        ("gdro.prompt.eta", -1.0, r"^config\.gdro\.prompt: PromptGDROConfig\.eta must be >= 0"),
        ("gdro.classifier.edges", (0.5, 0.2), r"^config\.gdro\.classifier: .*increasing"),
        ("curricula.greso.p_min", 2.0, r"^config\.curricula\.greso: "),
    ],
)
def test_typed_names_the_field(path, value, message):
    c = config_schema.base_config()
    section, key = path.rsplit(".", 1)
    _get(c, section)[key] = value
    with pytest.raises(ValueError, match=message):
        config_schema.typed(c)


def test_an_older_workdir_config_reads_as_today():
    # before the one-home schema the classifier's "curriculum's own" margin was spelled -1
    old = config_schema.upgrade({"gdro": {"classifier": {"delta": -1.0}}})
    assert old.gdro.classifier.delta is None
    kept = config_schema.upgrade({"gdro": {"classifier": {"delta": 0.05}}})
    assert kept.gdro.classifier.delta == 0.05
    assert config_schema.upgrade({}).to_dict() == config_schema.base_config().to_dict()
    # a section of the user's own is kept in the dict and left out of the typed config
    mine = config_schema.upgrade({"mine": {"x": 1}})
    assert mine.mine.x == 1 and config_schema.typed(mine) == config_schema.typed(
        config_schema.base_config()
    )
