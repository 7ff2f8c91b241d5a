"""End-to-end tests of the training loop on the embedded default at smoke size."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import arithmetic, common
from grpo_jax import algorithms, config_utils, steps, train, writers
from grpo_jax.errors import ConfigError
from grpo_jax.state import Batch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Fields that measure time (or depend on it) differ between runs; everything else must match.
_TIMING = ("time/", "tokens_per_s/", "reward/seconds")


def smoke_config(algorithm="grpo", **overrides):
    c = arithmetic.get_config(f"{algorithm},smoke")
    c.mesh.num_devices = 1
    c.logging.tensorboard = False
    for key, value in overrides.items():
        node = c
        *path, last = key.split(".")
        for p in path:
            node = node[p]
        node[last] = value
    return c


def deterministic_rows(workdir):
    rows = writers.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    return [{k: v for k, v in r.items() if not k.startswith(_TIMING)} for r in rows]


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["grpo", "prompt_gdro", "rollout_gdro", "ppo"])
def test_smoke_run_writes_summary_metrics_and_checkpoints(tmp_path, algorithm):
    cfg = smoke_config(algorithm)
    if algorithm == "rollout_gdro":
        # the paper's controllers: never-seen prompts sit in bin 0 (the corrected default keeps
        # them in their own state, outside the per-bin n_b and bin_share checked below, and at
        # smoke size every prompt is new)
        common.paper_gdro(cfg)
    summary = train.train_and_evaluate(cfg, str(tmp_path))
    assert summary["algorithm"] == algorithm and summary["steps"] == 3
    for phase in ("eval_before", "eval_after"):
        assert {"mean_at_1", "pass_at_8"} <= set(summary[phase])
    on_disk = json.load(open(tmp_path / "summary.json"))
    assert on_disk["steps"] == 3
    rows = writers.read_jsonl(str(tmp_path / "metrics.jsonl"))
    train_rows = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3]
    for r in train_rows:
        assert np.isfinite(r["loss"]) and r["skipped_updates"] == 0
        assert sum(r["bin_counts"]) == 8
    if algorithm == "rollout_gdro":
        assert all(
            sum(np.multiply(r["rollout_gdro/n_b"], r["gdro/bin_share"])) > 0 for r in train_rows
        )
    if algorithm == "ppo":
        assert all(np.isfinite(r["value_loss"]) for r in train_rows)
    assert sorted(os.listdir(tmp_path / "checkpoints"))[-1] == "3"


def _sigterm_after(workdir, step, proc_pid):
    """Sends SIGTERM to `proc_pid` once metrics.jsonl holds a row for `step`."""
    path = os.path.join(workdir, "metrics.jsonl")

    def watch():
        for _ in range(6000):
            if os.path.exists(path) and any(
                json.loads(l).get("step") == step and "reward_mean" in l
                for l in open(path)
                if l.strip()
            ):
                os.kill(proc_pid, signal.SIGTERM)
                return
            time.sleep(0.05)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


# bfloat16 parameters (float32 compute; float32 master weights and Adam moments)
_BF16 = {"model.param_dtype": "bfloat16"}
_LORA = {"model.lora.rank": 2, "model.lora.alpha": 4.0}


@pytest.mark.slow
@pytest.mark.parametrize(
    "algorithm,overrides",
    [
        ("grpo", {}),
        ("prompt_gdro", {}),
        ("rollout_gdro", {}),
        pytest.param("rollout_gdro", {"gdro.rollout.allocator": "shrunk"}, id="shrunk"),
        pytest.param("grpo", _BF16, id="grpo-bfloat16"),
        pytest.param("grpo", _LORA, id="grpo-lora"),
    ],
)
def test_resume_after_sigterm_reproduces_uninterrupted_run(tmp_path, algorithm, overrides):
    cfg = smoke_config(algorithm, steps=6, **{"checkpoint.every_steps": 100, **overrides})
    straight = tmp_path / "straight"
    train.train_and_evaluate(cfg, str(straight))

    interrupted = tmp_path / "interrupted"
    watcher = _sigterm_after(str(interrupted), 3, os.getpid())
    result = train.train_and_evaluate(cfg, str(interrupted))
    watcher.join(timeout=1)
    assert result.get("preempted"), result
    stopped_at = result["step"]
    assert 3 <= stopped_at < 6
    assert not os.path.exists(interrupted / "summary.json")
    train.train_and_evaluate(cfg, str(interrupted))  # resumes from the SIGTERM checkpoint

    a, b = deterministic_rows(str(straight)), deterministic_rows(str(interrupted))
    # rows 0..6, then the final evaluation's row (step 6)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 1, 2, 3, 4, 5, 6]
    assert a == b  # bitwise: every loss, reward, bin
    samples = (straight / "samples.jsonl").read_text()
    assert samples and (interrupted / "samples.jsonl").read_text() == samples


def _warm_start_once(monkeypatch):
    """Runs of one test whose warm starts are the same (same seed, model, data and `sft`) share
    the first one's result (the warm start is not what these tests check)."""
    done = {}
    real = steps.supervised_warmstart

    def once(exp, params):
        key = json.dumps([exp.config.seed, exp.config.sft.to_dict(), exp.config.model.to_dict()])
        key += json.dumps(exp.config.data.to_dict(), default=str)
        if key not in done:
            done[key] = real(exp, params)
        warm, metrics = done[key]
        return jax.tree.map(jnp.copy, warm), dict(metrics)  # a run may donate its buffers

    monkeypatch.setattr(steps, "supervised_warmstart", once)


@pytest.mark.slow
def test_prompt_gdro_at_step_size_zero_is_grpo(tmp_path, monkeypatch):
    """eta = 0, either way of applying the weights: the same prompts, weights and updates as GRPO
    (the bins' own diagnostics and the classifier's hysteresis margin differ, nothing that
    trains). One GRPO reference for both, one warm start for all three."""
    _warm_start_once(monkeypatch)
    # a pool of 16: prompts recur from step 3 on, so the controllers have bins to weigh; some
    # groups are informative after 150 warm-start steps
    common = {"steps": 4, "sft.steps": 150, "rollout.rollouts_per_prompt": 8}
    common["data.arithmetic.num_train"] = 16
    train.train_and_evaluate(smoke_config("grpo", **common), str(tmp_path / "grpo"))
    a = deterministic_rows(str(tmp_path / "grpo"))
    assert any(r.get("advantage_abs_mean", 0) > 0 for r in a)  # the runs had a gradient
    drop = lambda r: {k: v for k, v in r.items() if not k.startswith(("gdro/", "bin_counts"))}
    for apply in ("advantage_weight", "resample"):
        pg = smoke_config(
            "prompt_gdro", **common, **{"gdro.prompt.eta": 0.0, "gdro.prompt.apply": apply}
        )
        train.train_and_evaluate(pg, str(tmp_path / apply))
        b = deterministic_rows(str(tmp_path / apply))
        assert [r["step"] for r in a] == [r["step"] for r in b], apply
        assert [drop(r) for r in a] == [drop(r) for r in b], apply


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [{}, _BF16], ids=["float32", "bfloat16"])
def test_one_device_and_eight_device_mesh_give_the_same_losses(tmp_path, overrides):
    one = smoke_config("grpo", steps=2, **overrides)
    eight = smoke_config("grpo", steps=2, **overrides)
    eight.mesh.num_devices, eight.mesh.data, eight.mesh.fsdp, eight.mesh.tensor = 8, 2, 2, 2
    train.train_and_evaluate(one, str(tmp_path / "one"))
    train.train_and_evaluate(eight, str(tmp_path / "eight"))
    a = [r for r in writers.read_jsonl(str(tmp_path / "one" / "metrics.jsonl")) if "loss" in r]
    b = [r for r in writers.read_jsonl(str(tmp_path / "eight" / "metrics.jsonl")) if "loss" in r]
    assert len(a) == len(b) == 2
    # bfloat16 gradients: other reduction orders can round an entry differently (8 bits)
    tol = dict(rtol=1e-2, atol=1e-4) if overrides else dict(rtol=1e-4, atol=1e-5)
    for ra, rb in zip(a, b):
        assert ra["reward_mean"] == rb["reward_mean"]
        np.testing.assert_allclose(ra["loss"], rb["loss"], atol=1e-5)
        np.testing.assert_allclose(ra["grad_norm"], rb["grad_norm"], **tol)


def test_incompatible_workdir_is_refused_unless_overwrite(tmp_path):
    cfg = smoke_config("grpo")
    config_utils.check_workdir(cfg, str(tmp_path))
    other = smoke_config("grpo")
    other.optimizer.learning_rate = 0.5
    with pytest.raises(ConfigError, match="optimizer.learning_rate"):
        config_utils.check_workdir(other, str(tmp_path))
    other.steps = 99  # resumable fields alone do not count as a different run
    cfg.steps = 99
    config_utils.check_workdir(cfg, str(tmp_path))
    other.checkpoint.overwrite = True
    config_utils.check_workdir(other, str(tmp_path))


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("gdro.rollout.n_min", 1, "n_min"),
        ("algorithm.name", "grpo2", "algorithm.name"),
        ("rollout.prompts_per_step", 0, "prompts_per_step"),
        ("gdro.classifier.edges", (0.5, 0.2), "edges"),
    ],
)
def test_bad_config_values_raise_one_line_errors(field, value, match):
    cfg = smoke_config("rollout_gdro", **{field: value})
    with pytest.raises(ConfigError, match=match) as e:
        config_utils.validate(cfg)
    assert "\n" not in str(e.value)


def _run_cli(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "experiments.run", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_cli_misspelled_key_names_the_closest_valid_key(tmp_path):
    out = _run_cli(
        "--config=configs/arithmetic.py:grpo,smoke",
        "--config.rollout.prompt_per_step=4",
        f"--workdir={tmp_path}",
    )
    assert out.returncode == 2
    assert "config.rollout.prompts_per_step" in out.stderr
    assert "Traceback" not in out.stderr


def test_mesh_that_does_not_match_the_devices_is_a_config_error(tmp_path):
    from grpo_jax.experiment import build_experiment

    cfg = smoke_config("grpo")
    cfg.mesh.num_devices, cfg.mesh.data = 1, 2
    with pytest.raises(ConfigError, match="needs 2 devices"):
        build_experiment(cfg)


def _fake_round(rewards_by_group, ids, n=2, Lp=3, Lc=2, offset=0):
    """A sampling round whose rollout tokens encode (round offset + row) for checking the gather."""
    from grpo_jax import gdro
    from grpo_jax.sampling import Rollouts

    P = len(ids)
    rewards = np.asarray(rewards_by_group, np.float32).reshape(-1)
    rows_tag = offset + np.arange(P * n)
    informative = np.asarray([max(g) > min(g) for g in rewards_by_group])
    alloc = gdro.fixed_allocation(np.zeros(P, np.int32), n, 2)
    rollouts = Rollouts(
        tokens=jnp.asarray(np.repeat(rows_tag[:, None], Lp + Lc, 1), jnp.int32),
        completion_tokens=jnp.zeros((P * n, Lc), jnp.int32),
        completion_mask=jnp.ones((P * n, Lc)),
        logprobs=jnp.zeros((P * n, Lc)),
        lengths=jnp.full((P * n,), Lc, jnp.int32),
        truncated=jnp.zeros((P * n,), bool),
    )
    placement = algorithms.Placement(bins=np.zeros(P, np.int32), success=None, allocation=alloc)
    return train.Round(
        ids=np.asarray(ids, np.int32),
        placement=placement,
        rows=np.repeat(np.asarray(ids), n),
        rollouts=rollouts,
        prompt_mask=jnp.ones((P * n, Lp), bool),
        rewards=rewards,
        correct=rewards > 0,
        lengths=np.full(P * n, Lc),
        informative=informative,
        kept=informative,
        reward_stats={},
        times={},
    )


def test_dynamic_sampling_keeps_informative_groups_first_then_fills():
    import types

    from grpo_jax import config_schema, sharding

    config = smoke_config("grpo")
    config.rollout.rollouts_per_prompt = 2
    config.rollout.prompts_per_step = 3
    exp = types.SimpleNamespace(
        config=config,
        run=config_schema.typed(config),
        num_bins=2,
        mesh=sharding.make_mesh({"data": 1}, jax.devices()[:1]),
        batching=types.SimpleNamespace(rollouts_per_step=6),
    )
    take = jax.jit(lambda tree, idx: jax.tree.map(lambda x: x[idx], tree))
    concat = lambda parts: jax.tree.map(lambda *a: jnp.concatenate(a), *parts)
    fns = types.SimpleNamespace(take=take, concat=concat)
    # round 0: groups (prompt 10: all wrong, 11: mixed, 12: all right); round 1: 20 mixed, 21 equal
    r0 = _fake_round([[-1, -1], [1, -1], [1, 1]], [10, 11, 12], offset=0)
    r1 = _fake_round([[-1, 1], [-1, -1], [-1, -1]], [20, 21, 22], offset=100)
    out = train.keep_informative_groups(exp, fns, [r0, r1])
    np.testing.assert_array_equal(out.ids, [11, 20, 10])  # informative first, then fill
    np.testing.assert_array_equal(out.informative, [True, True, False])
    np.testing.assert_array_equal(out.rewards, [1, -1, -1, 1, -1, -1])
    np.testing.assert_array_equal(out.rows, [11, 11, 20, 20, 10, 10])
    np.testing.assert_array_equal(np.asarray(out.rollouts.tokens)[:, 0], [2, 3, 100, 101, 0, 1])
    np.testing.assert_array_equal(out.placement.segment_ids, [0, 0, 1, 1, 2, 2])


def test_dynamic_sampling_with_rollout_gdro_is_a_config_error():
    cfg = smoke_config("rollout_gdro", **{"algorithm.dynamic_sampling": True})
    with pytest.raises(ConfigError, match="dynamic_sampling"):
        config_utils.validate(cfg)


@pytest.mark.slow
def test_dynamic_sampling_run_samples_extra_rounds_and_keeps_shapes(tmp_path):
    cfg = smoke_config(
        "grpo",
        steps=2,
        **{"algorithm.dynamic_sampling": True, "algorithm.dynamic_sampling_max_rounds": 2},
    )
    train.train_and_evaluate(cfg, str(tmp_path))
    rows = [r for r in writers.read_jsonl(str(tmp_path / "metrics.jsonl")) if "reward_mean" in r]
    assert len(rows) == 2
    P = cfg.rollout.prompts_per_step
    for r in rows:
        assert 1 <= r["dynamic_sampling/rounds"] <= 3
        assert r["dynamic_sampling/kept_informative"] == min(
            P, r["dynamic_sampling/informative_groups"]
        )
        if r["dynamic_sampling/informative_groups"] < P:  # too few found: every round was used
            assert r["dynamic_sampling/rounds"] == 3
        assert np.isfinite(r["loss"])


@pytest.mark.slow
def test_generation_in_several_sampler_calls_trains_with_the_same_shapes(tmp_path):
    cfg = smoke_config("grpo", steps=1, **{"rollout.generate_batch_size": 8})
    R = cfg.rollout.prompts_per_step * cfg.rollout.rollouts_per_prompt
    assert R > 8 and R % 8 == 0
    train.train_and_evaluate(cfg, str(tmp_path))
    row = [r for r in writers.read_jsonl(str(tmp_path / "metrics.jsonl")) if "reward_mean" in r][0]
    assert np.isfinite(row["loss"]) and row["skipped_updates"] == 0


def test_generate_batch_size_must_divide_the_rollouts():
    from grpo_jax.experiment import build_experiment

    cfg = smoke_config("grpo", **{"rollout.generate_batch_size": 7})
    with pytest.raises(ConfigError, match="generate_batch_size"):
        build_experiment(cfg, with_data=False)


@pytest.mark.slow
@pytest.mark.parametrize(
    "algorithm,agg,overrides",
    [
        ("grpo", "seq-mean-token-mean", {"algorithm.tis_cap": 2.0}),
        ("ppo", "token-mean", {}),
        pytest.param("grpo", "token-mean", _LORA, id="grpo-lora"),
    ],
)
def test_gradient_accumulation_equals_one_pass(algorithm, agg, overrides):
    from grpo_jax.experiment import build_experiment

    def run(micro):
        cfg = smoke_config(
            algorithm,
            **{
                "algorithm.micro_batch_size": micro,
                "algorithm.loss_agg_mode": agg,
                "algorithm.kl_coef": 0.01,
                **overrides,
            },
        )
        exp = build_experiment(cfg, with_data=False)
        state = steps.init_train_state(exp)
        R = cfg.rollout.prompts_per_step * cfg.rollout.rollouts_per_prompt
        L, Lc = exp.prompt_len + exp.max_new_tokens, exp.max_new_tokens
        g = np.random.default_rng(1)
        cmask = (np.arange(Lc)[None] < g.integers(1, Lc + 1, (R, 1))).astype(np.float32)
        adv = g.normal(size=(R, Lc) if algorithm == "ppo" else (R,)).astype(np.float32)
        old_logprobs = jnp.asarray(g.normal(-2, 0.1, (R, Lc)), jnp.float32)
        fields = dict(
            tokens=jnp.asarray(g.integers(1, 10, (R, L)), jnp.int32),
            attention_mask=jnp.ones((R, L), bool),
            completion_mask=jnp.asarray(cmask),
            advantages=jnp.asarray(adv),
            sample_weights=jnp.asarray(g.uniform(0.5, 2, R), jnp.float32),
            old_logprobs=old_logprobs,
            ref_logprobs=jnp.asarray(g.normal(-2, 0.1, (R, Lc)), jnp.float32),
            sampler_logprobs=old_logprobs,
        )
        returns = jnp.asarray(g.normal(size=(R, Lc)), jnp.float32)
        old_values = jnp.asarray(g.normal(size=(R, Lc)), jnp.float32)
        if algorithm == "ppo":
            batch = algorithms.PPOBatch(**fields, returns=returns, old_values=old_values)
        else:
            batch = Batch(**fields)
        new, m = steps.make_steps(exp).update(state, batch)
        return jax.device_get((new.params, m))

    (p_one, m_one), (p_acc, m_acc) = run(0), run(8)  # 32 rollouts: one pass vs 4 x 8
    # every diagnostic of the loss reaches the update's metrics (TIS's too), none of its
    # micro-batching bookkeeping; the surrogate part is summed over micro-batches like the loss
    assert set(m_acc) == set(m_one)
    assert {"pg_loss", "clip_fraction", "approx_kl", "ratio_mean"} <= set(m_one)
    assert ("kl" in m_one) == (algorithm != "ppo")  # PPO pays the KL in its token rewards
    assert not {"loss_sum", "denominator", "num_tokens"} & set(m_one)
    assert ("tis_weight_mean" in m_one) == ("algorithm.tis_cap" in overrides)
    for k in ("loss", "grad_norm", "pg_loss") + (("value_loss",) if algorithm == "ppo" else ()):
        np.testing.assert_allclose(m_acc[k], m_one[k], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        m_acc["per_rollout_loss"], m_one["per_rollout_loss"], rtol=1e-5, atol=1e-6
    )
    # parameters after one AdamW step: Adam's g / sqrt(g^2) turns float rounding in near-zero
    # gradient entries into differences of up to ~lr in single entries
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=5e-6), p_acc, p_one)


def test_micro_batch_size_must_divide_the_mini_batch():
    from grpo_jax.experiment import build_experiment

    cfg = smoke_config("grpo", **{"algorithm.micro_batch_size": 5})
    with pytest.raises(ConfigError, match="micro_batch_size"):
        build_experiment(cfg, with_data=False)


def test_prompts_are_padded_to_the_longest_prompt_not_the_budget():
    from grpo_jax.experiment import build_experiment

    cfg = smoke_config("grpo", **{"data.max_prompt_tokens": 64})
    exp = build_experiment(cfg)
    exp.close()
    longest = int(exp.pool.mask.sum(axis=1).max())
    assert exp.prompt_len == -(-longest // 8) * 8 < 64  # rounded up to 8, below the budget
    assert exp.pool.stats["prompt_tokens_padded_to"] == exp.prompt_len
    assert exp.pool.mask[:, -1].all()  # still left-padded: every row ends real


def _grouped_batch(P=3, G=4, Lp=6, Lc=5, vocab=97, seed=0):
    """Rows in groups of G with identical left-padded prompts, ragged completion masks."""
    rng = np.random.default_rng(seed)
    pt = rng.integers(1, vocab, (P, Lp))
    pm = np.ones((P, Lp), bool)
    pm[0, :2] = pm[2, :1] = False
    ct = rng.integers(1, vocab, (P * G, Lc))
    cm = np.ones((P * G, Lc), bool)
    cm[1, 3:] = cm[5, 1:] = False
    tokens = jnp.asarray(np.concatenate([np.repeat(pt, G, 0), ct], 1), jnp.int32)
    mask = jnp.asarray(np.concatenate([np.repeat(pm, G, 0), cm], 1))
    return tokens, mask


def test_shared_prompt_forward_equals_the_per_row_forward_values_and_gradients():
    from flax import nnx

    from grpo_jax.models.config import ModelConfig
    from grpo_jax.models.transformer import Transformer

    cfg = ModelConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
        qk_norm=True,
        qkv_bias=True,
    )
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    P, G, Lp, Lc = 3, 4, 6, 5
    tokens, mask = _grouped_batch(P, G, Lp, Lc)
    # jitted, as the update runs them (eagerly: ~230 op-by-op compiles)
    lp = jax.jit(
        lambda p, g: steps.completion_logprobs(graphdef, p, tokens, mask, Lp, 0.7, group_size=g),
        static_argnums=1,
    )
    np.testing.assert_allclose(lp(params, G), lp(params, 1), rtol=1e-5, atol=1e-5)
    w = jnp.asarray(np.random.default_rng(1).normal(size=(P * G, Lc)), jnp.float32) * mask[:, Lp:]
    grads = [jax.jit(jax.grad(lambda p, g=g: jnp.sum(w * lp(p, g))))(params) for g in (1, G)]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), *grads)
    # micro-batches of whole groups (3 chunks of one group each)
    chunked = steps.chunked_completion_logprobs(
        graphdef, params, tokens, mask, Lp, 0.7, rows_per_chunk=4, group_size=G
    )
    np.testing.assert_allclose(chunked, lp(params, 1), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="multiple of group_size"):
        steps.completion_logprobs(graphdef, params, tokens[:10], mask[:10], Lp, 0.7, group_size=G)


def test_split_rows_keeps_groups_whole_and_merge_inverts_it():
    x = jnp.arange(24)
    s = steps.split_rows(x, 3, group=4)  # 6 groups of 4 -> chunk j = groups j, j + 3
    assert s.tolist() == [
        [0, 1, 2, 3, 12, 13, 14, 15],
        [4, 5, 6, 7, 16, 17, 18, 19],
        [8, 9, 10, 11, 20, 21, 22, 23],
    ]
    assert steps.merge_rows(s, group=4).tolist() == x.tolist()
    assert steps.split_rows(x, 3).tolist()[0] == [0, 3, 6, 9, 12, 15, 18, 21]  # group 1: strided
    assert steps.merge_rows(steps.split_rows(x, 3)).tolist() == x.tolist()


@pytest.mark.slow
def test_shared_prompt_run_matches_the_per_row_run(tmp_path):
    n = smoke_config("grpo").rollout.rollouts_per_prompt
    rows = {}
    for shared in (False, True):
        cfg = smoke_config(
            "grpo",
            steps=2,
            **{
                "algorithm.shared_prompt_forward": shared,
                "algorithm.micro_batch_size": 2 * n,
                "algorithm.kl_coef": 0.01,
            },
        )
        train.train_and_evaluate(cfg, str(tmp_path / str(shared)))
        rows[shared] = [
            r
            for r in writers.read_jsonl(str(tmp_path / str(shared) / "metrics.jsonl"))
            if "loss" in r
        ]
    assert len(rows[True]) == len(rows[False]) == 2
    for a, b in zip(rows[True], rows[False]):
        assert a["reward_mean"] == b["reward_mean"]  # the same samples
        for k in ("loss", "grad_norm", "kl"):
            np.testing.assert_allclose(a[k], b[k], rtol=1e-4, atol=1e-5)
    # several shuffled mini-batches of whole groups
    cfg = smoke_config(
        "grpo",
        steps=1,
        **{
            "algorithm.shared_prompt_forward": True,
            "algorithm.mini_batch_size": 2 * n,
            "algorithm.num_iterations": 2,
        },
    )
    train.train_and_evaluate(cfg, str(tmp_path / "mini"))
    row = [r for r in writers.read_jsonl(str(tmp_path / "mini" / "metrics.jsonl")) if "loss" in r][
        0
    ]
    assert np.isfinite(row["loss"]) and row["skipped_updates"] == 0


@pytest.mark.parametrize(
    "algorithm,overrides,match",
    [
        ("rollout_gdro", {}, "equal size"),
        ("grpo", {"algorithm.micro_batch_size": 2}, "multiple of rollouts_per_prompt"),
    ],
)
def test_shared_prompt_forward_config_errors(algorithm, overrides, match):
    from grpo_jax.experiment import build_experiment

    cfg = smoke_config(algorithm, **{"algorithm.shared_prompt_forward": True, **overrides})
    if "algorithm.micro_batch_size" in overrides:
        assert cfg.rollout.rollouts_per_prompt > 2
    with pytest.raises(ConfigError, match=match):
        build_experiment(cfg, with_data=False)


def test_warm_start_compiles_its_step_once(caplog):
    """The supervised warm start's step is one program: its second call hits the in-memory jit
    cache (the state returns with the shardings it came in with; a step count that went in
    uncommitted, or an output spec XLA rewrote, made every warm start compile twice)."""
    import logging

    from grpo_jax.experiment import build_experiment

    exp = build_experiment(smoke_config("grpo", **{"sft.steps": 3}))
    try:
        state = steps.init_train_state(exp)
        with jax.log_compiles(), caplog.at_level(logging.WARNING):
            params, sft = steps.supervised_warmstart(exp, state.params)
    finally:
        exp.close()
    lowered = [r.getMessage() for r in caplog.records if "Compiling jit(step)" in r.getMessage()]
    assert sft["sft_steps"] == 3 and np.isfinite(sft["sft_loss"])
    assert len(lowered) == 1, [m[:200] for m in lowered]
