"""Bring your own model, data and reward (docs/byo.md): a user table with its own column names,
a user reward function from a module, a tokenizer directory; trained from the config alone;
exported to a Hugging Face directory that transformers loads with the same logits."""

import json
import os
import stat
import sys

import numpy as np
import pytest

from configs import common
from grpo_jax import experiment, train
from grpo_jax.data import datasets
from grpo_jax.data import from_config as data_from_config
from grpo_jax.errors import ConfigError
from grpo_jax.rewards import from_config as reward_from_config

CHARS = "0123456789+-*=?. abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"

REWARD_MODULE = """
import os

LOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calls.txt")


def score(completions, answers, **fields):
    with open(LOG, "a") as f:
        f.write(f"{os.getpid()} {sorted(fields)}\\n")
    # 0.25 / -0.5: distinct from the built-in verifier's +1/-1
    return [0.25 if str(a) in c else -0.5 for c, a in zip(completions, answers)]


def graded(completions, answers, **fields):
    rewards = [float(len(c) % 3) for c in completions]
    correct = [h == "yes" for h in fields.get("hint", ["no"] * len(completions))]
    return rewards, correct


def broken(completions, answers, **fields):
    raise RuntimeError("boom")
"""


def write_char_tokenizer(path) -> str:
    """A character-level tokenizer.json + tokenizer_config.json (no hub, no download)."""
    from tokenizers import Tokenizer, decoders, models

    os.makedirs(path, exist_ok=True)
    specials = ["<pad>", "<eos>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + list(CHARS))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<eos>",
                "pad_token": "<pad>",
                "unk_token": "<unk>",
            },
            f,
        )
    return str(path)


def _rows(n, seed):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        a, b = (int(x) for x in rng.integers(0, 10, 2))
        out.append(
            {
                "question_text": f"What is {a}+{b}?",
                "solution_value": a + b,
                "difficulty": 1 + (i % 2),
                "uid": f"q{seed}-{i}",
                "hint": "yes" if i % 2 else "no",
            }
        )
    return out


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def user_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("byo")
    (root / "my_rewards.py").write_text(REWARD_MODULE)
    return {
        "root": root,
        "train": _write_jsonl(root / "train.jsonl", _rows(24, 0)),
        "test": _write_jsonl(root / "test.jsonl", _rows(6, 1)),
        "tokenizer": write_char_tokenizer(root / "tok"),
    }


@pytest.fixture
def on_path(user_files, monkeypatch):
    monkeypatch.syspath_prepend(str(user_files["root"]))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(user_files["root"]), os.environ.get("PYTHONPATH", "")])
    )
    return user_files


def byo_config(files, **overrides):
    c = common.base_config()
    c.steps = 2
    c.model.preset = "tiny"
    c.model.tokenizer = files["tokenizer"]
    c.model.overrides.hidden_size = 32
    c.model.overrides.intermediate_size = 64
    c.model.overrides.num_layers = 1
    c.model.overrides.num_heads = 2
    c.model.overrides.num_kv_heads = 1
    c.model.overrides.head_dim = 16
    c.data.name = "custom"
    c.data.path = files["train"]
    c.data.eval_path = files["test"]
    c.data.prompt_column = "question_text"
    c.data.answer_column = "solution_value"
    c.data.level_column = "difficulty"
    c.data.id_column = "uid"
    c.data.template = "plain"
    c.data.prompt_suffix = "Answer:"
    c.data.max_prompt_tokens = 32
    c.reward.fn = "my_rewards:score"
    c.reward.num_workers = 1
    c.rollout.prompts_per_step = 2
    c.rollout.rollouts_per_prompt = 2
    c.rollout.max_new_tokens = 4
    c.eval.datasets = ("custom",)
    c.eval.num_samples = 2
    c.eval.max_examples = 4
    c.eval.batch_size = 8
    c.checkpoint.every_steps = 1
    c.mesh.num_devices = 1
    c.logging.progress_bar = False
    c.logging.tensorboard = False
    c.optimizer.learning_rate = 1e-3
    for k, v in overrides.items():
        node = c
        *parents, leaf = k.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = v
    return c


@pytest.fixture(scope="module")
def trained(user_files, tmp_path_factory):
    """The must-show run: user table + user reward + tokenizer dir, 2 steps from the config."""
    sys.path.insert(0, str(user_files["root"]))
    try:
        workdir = str(tmp_path_factory.mktemp("run"))
        cfg = byo_config(user_files)
        summary = train.train_and_evaluate(cfg, workdir)
    finally:
        sys.path.remove(str(user_files["root"]))
    return cfg, workdir, summary


def test_user_table_and_reward_train_two_steps_from_the_config(trained, user_files):
    cfg, workdir, summary = trained
    assert summary["steps"] == 2
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    steps = [r for r in rows if r.get("step", 0) > 0]
    assert len(steps) == 2
    for r in steps:  # the user's reward values, not the built-in verifier's +1/-1
        assert -0.5 <= r["reward_mean"] <= 0.25
        assert r["reward_mean"] != -1.0
    calls = (user_files["root"] / "calls.txt").read_text().splitlines()
    assert calls and all(int(line.split()[0]) != os.getpid() for line in calls)  # in workers
    assert summary["data"]["train_examples"] == 24
    ev = summary["eval_after"]["per_dataset"]["custom"]
    assert ev["num_problems"] == 4 and np.isfinite(ev["maj_at_2"])
    assert set(ev["per_level"]) == {"1", "2"}  # the level column


def test_user_reward_gets_row_fields_and_may_return_correctness(on_path):
    cfg = byo_config(on_path, **{"reward.fn": "my_rewards:graded"})
    examples = data_from_config.load_examples(cfg, "custom", "train")
    fn = reward_from_config.make_reward_fn(cfg)
    try:
        rewards, correct, stats = fn(["ab", "abc"], [1, 2], examples=examples[:2])
        np.testing.assert_allclose(rewards, [2.0, 0.0])
        np.testing.assert_array_equal(correct, [ex["hint"] == "yes" for ex in examples[:2]])
        assert stats["num_crashes"] == 0
    finally:
        fn.close()
    ex = examples[0]
    assert ex["problem"] == "What is 8+6?" and ex["answer"] == "14" and ex["source_id"] == "q0-0"
    assert ex["level"] == 1 and ex["question_text"] == ex["problem"] and ex["hint"] == "no"


def test_experiment_score_passes_row_fields(on_path):
    cfg = byo_config(on_path)
    exp = experiment.build_experiment(cfg)
    try:
        open(on_path["root"] / "calls.txt", "w").close()
        rewards, _, _ = exp.score(["14", "x"], [0, 0])
        np.testing.assert_allclose(rewards, [0.25, -0.5])
        fields = (on_path["root"] / "calls.txt").read_text().splitlines()[0]
        assert "'hint'" in fields and "'question_text'" in fields and "'level'" in fields
    finally:
        exp.close()


def test_crashing_user_reward_scores_low_and_is_counted(on_path):
    cfg = byo_config(on_path, **{"reward.fn": "my_rewards:broken"})
    fn = reward_from_config.make_reward_fn(cfg)
    try:
        rewards, correct, stats = fn(["1", "2"], ["1", "2"])
        np.testing.assert_allclose(rewards, [-1.0, -1.0])
        assert not correct.any() and stats["num_crashes"] == 2
    finally:
        fn.close()


def test_reward_fn_that_does_not_import_is_a_one_line_config_error(on_path):
    cfg = byo_config(on_path, **{"reward.fn": "no_such_module_xyz:score"})
    with pytest.raises(ConfigError, match=r"config.reward.fn: .*no_such_module_xyz"):
        reward_from_config.make_reward_fn(cfg)


def test_bad_rows_name_the_file_and_row(tmp_path):
    path = _write_jsonl(tmp_path / "t.jsonl", [{"q": "ok", "a": 1}, {"q": "", "a": 2}])
    cols = datasets.Columns(prompt="q", answer="a")
    with pytest.raises(ValueError, match=r"t.jsonl:2: missing or empty 'q'"):
        datasets.load_table_with_stats(path, columns=cols)
    ex, stats = datasets.load_table_with_stats(path, columns=cols, bad_rows="skip")
    assert len(ex) == 1 and stats["num_skipped"] == 1
    dup = _write_jsonl(
        tmp_path / "d.jsonl", [{"q": "x", "a": 1, "k": 1}, {"q": "y", "a": 1, "k": 1}]
    )
    with pytest.raises(ValueError, match=r"d.jsonl:2: duplicate 'k'"):
        datasets.load_table_with_stats(dup, columns=datasets.Columns("q", "a", id="k"))
    lvl = _write_jsonl(tmp_path / "l.jsonl", [{"q": "x", "a": 1, "lv": "hard"}])
    with pytest.raises(ValueError, match=r"l.jsonl:1: 'lv' is not an integer level"):
        datasets.load_table_with_stats(lvl, columns=datasets.Columns("q", "a", level="lv"))


def test_parquet_and_directory_tables_match_jsonl(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = _rows(5, 3)
    _write_jsonl(tmp_path / "train.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "mine.parquet")
    (tmp_path / "dir").mkdir()
    pq.write_table(
        pa.Table.from_pylist(rows[:2]), tmp_path / "dir" / "train-00000-of-00002.parquet"
    )
    pq.write_table(
        pa.Table.from_pylist(rows[2:]), tmp_path / "dir" / "train-00001-of-00002.parquet"
    )
    pq.write_table(pa.Table.from_pylist(rows[:1]), tmp_path / "dir" / "test-00000-of-00001.parquet")
    cols = datasets.Columns("question_text", "solution_value", "difficulty", "uid")
    a = datasets.load_table_with_stats(str(tmp_path / "train.jsonl"), columns=cols)[0]
    b = datasets.load_table_with_stats(str(tmp_path / "mine.parquet"), columns=cols)[0]
    c = datasets.load_table_with_stats(str(tmp_path / "dir"), "train", columns=cols)[0]
    assert a == b == c and len(a) == 5
    assert len(datasets.load_table_with_stats(str(tmp_path / "dir"), "test", columns=cols)[0]) == 1
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([rows[0], {**rows[1], "question_text": None}]), bad)
    with pytest.raises(ValueError, match=r"bad.parquet:2: missing or empty 'question_text'"):
        datasets.load_table_with_stats(str(bad), columns=cols)


def test_hub_dataset_without_the_datasets_package_is_one_line(tmp_path):
    try:
        import datasets as _  # noqa: F401

        pytest.skip("the datasets package is installed")
    except ImportError:
        pass
    with pytest.raises(FileNotFoundError, match=r"'hf:org/name'.*pip install datasets"):
        list(datasets.read_table("hf:org/name"))


def test_preset_layout_from_a_user_file(tmp_path):
    path = _write_jsonl(
        tmp_path / "my_gsm8k.jsonl",
        [{"question": "1+1?", "answer": "so\n#### 2"}, {"question": "2+2?", "answer": "#### 4"}],
    )
    ex, _ = datasets.load_table_with_stats(path, "train", name="gsm8k")
    assert [e["answer"] for e in ex] == ["2", "4"] and ex[0]["dataset"] == "gsm8k"


def test_prompt_suffix_and_system_prompt(on_path):
    from grpo_jax.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(on_path["tokenizer"])
    cfg = byo_config(on_path)
    assert data_from_config.render(cfg, tok, "What is 1+1?") == "What is 1+1? Answer:"
    cfg.data.prompt_suffix = None  # the default: the DAPO boxed-answer suffix
    assert data_from_config.render(cfg, tok, "Q").endswith("within \\boxed{}.")
    cfg.data.template, cfg.data.system_prompt, cfg.data.prompt_suffix = "chat", "Be brief.", ""
    text = data_from_config.render(cfg, tok, "Q")
    assert (
        text
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"
    )


def test_unknown_hub_id_offline_is_one_line_naming_it(monkeypatch, tmp_path):
    from grpo_jax.models import loading

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(FileNotFoundError, match=r"'nobody/no-such-model-xyz'.*hub id") as e:
        loading.resolve_checkpoint("nobody/no-such-model-xyz")
    assert "\n" not in str(e.value)
    with pytest.raises(FileNotFoundError, match="directory not found"):
        loading.resolve_checkpoint(str(tmp_path / "missing"))


def test_hub_id_resolves_from_the_local_cache(monkeypatch, tmp_path):
    """A hub id found in the HF cache loads offline (a cache laid out as huggingface_hub does)."""
    from grpo_jax.models import get_preset, loading
    from grpo_jax.models.transformer import random_params

    cache = tmp_path / "hub"
    snap = cache / "models--me--tiny" / "snapshots" / ("a" * 40)
    cfg = get_preset("tiny", vocab_size=40)
    _, params = random_params(cfg, 0)
    loading.save_hf_checkpoint(cfg, params, str(snap))
    (cache / "models--me--tiny" / "refs").mkdir()
    (cache / "models--me--tiny" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    assert os.path.samefile(loading.resolve_checkpoint("me/tiny"), snap)
    cfg2, _, _ = loading.load_hf_checkpoint("me/tiny")
    assert cfg2.hidden_size == cfg.hidden_size


def test_tfds_path_gives_the_same_prompts_as_jsonl(tmp_path):
    pytest.importorskip("tensorflow_datasets")
    src = tmp_path / "data" / "gsm8k"
    src.mkdir(parents=True)
    rows = [{"question": f"What is {i}+1?", "answer": f"#### {i + 1}"} for i in range(6)]
    _write_jsonl(src / "train.jsonl", rows)
    _write_jsonl(src / "test.jsonl", rows[:2])
    c = common.base_config()
    c.data.name, c.data.template, c.data.source_dir = "gsm8k", "plain", str(tmp_path / "data")
    plain = data_from_config.load_examples(c, "gsm8k", "train")
    c.data.use_tfds, c.data.tfds_data_dir = True, str(tmp_path / "tfds")
    via_tfds = data_from_config.load_examples(c, "gsm8k", "train")
    assert [e["problem"] for e in plain] == [e["problem"] for e in via_tfds]
    assert [e["answer"] for e in plain] == [e["answer"] for e in via_tfds]
    assert list((tmp_path / "tfds").rglob("*.array_record*"))  # prepared once, read back


# ------------------------------------------------------------------------------------ export
def test_export_writes_a_hugging_face_directory(trained, tmp_path):
    from experiments import export

    cfg, workdir, _ = trained
    out = export.export(workdir, str(tmp_path / "hf"))
    names = set(os.listdir(out))
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    } <= names
    for n in names:
        assert stat.S_IMODE(os.stat(os.path.join(out, n)).st_mode) == 0o644, n
    from grpo_jax.models.loading import load_hf_checkpoint

    mc, _, params = load_hf_checkpoint(out)
    assert mc.hidden_size == 32 and mc.num_layers == 1


def test_export_loads_in_transformers_with_the_same_logits(trained, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from experiments import export
    from grpo_jax import checkpointing, steps
    from grpo_jax.models import positions_from_mask

    cfg, workdir, _ = trained
    out = export.export(workdir, str(tmp_path / "hf"))
    exp = experiment.build_experiment(cfg)
    try:
        ckpt = checkpointing.Checkpointer(os.path.join(workdir, "checkpoints"))
        _, run, _ = ckpt.restore_latest(steps.abstract_run_state(exp))
        ckpt.close()
        tok = transformers.AutoTokenizer.from_pretrained(out)
        text = "What is 3+4? Answer:"
        ids = tok(text)["input_ids"]
        assert ids == exp.tokenizer.encode(text)
        toks = np.asarray([ids], np.int32)
        mask = np.ones_like(toks, bool)
        ours = np.asarray(
            nnx.merge(exp.graphdef, jax.device_get(run.train.params))(
                jnp.asarray(toks), positions_from_mask(jnp.asarray(mask)), jnp.asarray(mask)
            )[0],
            np.float32,
        )
    finally:
        exp.close()
    model = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(toks, dtype=torch.long)).logits.float().numpy()
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------ prepare_data
SHARED = datasets.default_source_dir()
needs_shared = pytest.mark.skipif(
    SHARED is None or not (SHARED / "dapo_math_17k" / "dapo_math_17k.parquet").is_file(),
    reason="shared data not available",
)


@needs_shared
def test_prepare_data_from_a_local_copy_rebuilds_the_files(tmp_path):
    from experiments import prepare_data

    out = tmp_path / "data"
    done = prepare_data.prepare(str(out), ["gsm8k", "aime24", "dapo_math"], from_dir=str(SHARED))
    assert set(done) == {"gsm8k", "aime24", "dapo_math"}
    for rel in (
        "gsm8k/train.jsonl",
        "aime24/test.jsonl",
        "dapo_math_17k/dapo_math_17k.derived.part1.jsonl",  # derived from the parquet
        "dapo_math_17k/dapo_math_17k.derived.part2.jsonl",
    ):
        assert (out / rel).read_bytes() == (SHARED / rel).read_bytes(), rel
        assert stat.S_IMODE(os.stat(out / rel).st_mode) == 0o644
    ex = datasets.load("dapo_math", "train", source_dir=str(out))
    assert len(ex) == 13987  # the en_dedup filter, applied at load time
    with pytest.raises(ValueError, match="unknown dataset"):
        prepare_data.prepare(str(out), ["nope"], from_dir=str(SHARED))


def test_hub_id_not_in_the_cache_is_downloaded_when_online(monkeypatch, tmp_path):
    """The online path with a stand-in for huggingface_hub.snapshot_download (no network)."""
    import huggingface_hub

    from grpo_jax.models import loading

    calls = []

    def fake_download(**kw):
        calls.append(kw)
        if kw.get("local_files_only"):
            raise FileNotFoundError("not cached")
        if kw["repo_id"] == "me/broken":
            raise OSError("HTTP 404\nnot found")
        return str(tmp_path)

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    assert loading.resolve_checkpoint("me/tiny@v1") == str(tmp_path)
    assert [c.get("local_files_only", False) for c in calls] == [True, False]
    assert calls[1]["repo_id"] == "me/tiny" and calls[1]["revision"] == "v1"
    assert "model.safetensors" in " ".join(calls[1]["allow_patterns"]) or any(
        "safetensors" in p for p in calls[1]["allow_patterns"]
    )
    with pytest.raises(FileNotFoundError, match="download failed: OSError: HTTP 404") as e:
        loading.resolve_checkpoint("me/broken")
    assert "\n" not in str(e.value)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline: never tries the download
    calls.clear()
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE"):
        loading.resolve_checkpoint("me/tiny")
    assert len(calls) == 1
