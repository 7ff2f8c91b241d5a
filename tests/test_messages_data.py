"""Conversational (messages-format) tables: ``data.messages_column`` rows of ``{"role",
"content"}`` turns, rendered by the tokenizer's chat template; the gold answer from a named
column or the final assistant turn; bad rows name file:row; a run trains and evaluates."""

import json
import os
import re

import numpy as np
import pytest
from test_byo import byo_config, user_files  # noqa: F401 (fixture)

from grpo_jax import config_utils, experiment, train
from grpo_jax.data import datasets, templates
from grpo_jax.data import from_config as data_from_config
from grpo_jax.errors import ConfigError

CHATML = "<|im_start|>{role}\n{content}<|im_end|>\n"


def _chat(n, seed, final_assistant=True):
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        a, b = (int(x) for x in rng.integers(0, 10, 2))
        turns = [{"role": "user", "content": f"What is {a}+{b}?"}]
        if i % 2:  # some rows carry their own system turn
            turns.insert(0, {"role": "system", "content": "Reply with a number."})
        if final_assistant:
            turns.append({"role": "assistant", "content": str(a + b)})
        rows.append({"messages": turns, "uid": f"c{seed}-{i}"})
    return rows


def _write(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


@pytest.fixture
def chat_files(user_files, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.syspath_prepend(str(user_files["root"]))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(user_files["root"]), os.environ.get("PYTHONPATH", "")])
    )
    return {
        **user_files,
        "train": _write(tmp_path / "train.jsonl", _chat(12, 0)),
        "test": _write(tmp_path / "test.jsonl", _chat(6, 1)),
    }


def chat_config(files, **overrides):
    return byo_config(
        files,
        **{
            "data.messages_column": "messages",
            "data.answer_column": "answer",  # absent: the final assistant turn is the gold
            "data.level_column": "",
            "data.template": "chat",
            "data.prompt_suffix": None,
            "data.max_prompt_tokens": 96,
            **overrides,
        },
    )


def test_conversation_cuts_the_final_assistant_turn_and_checks_the_turns():
    turns = [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": " 4 "}]
    assert datasets.conversation(turns, "messages") == ([turns[0]], " 4 ")
    assert datasets.conversation(turns[:1], "messages") == ([turns[0]], None)
    convert = datasets.column_converter(datasets.Columns(messages="messages", answer="gold"))
    ex = convert({"messages": turns, "gold": 7})
    assert ex["answer"] == "7" and ex["messages"] == turns[:1] and ex["problem"] == "Hi?"
    assert convert({"messages": turns})["answer"] == "4"  # no gold column: the assistant's turn
    # without messages_column a raw "messages" column is not taken for the prompt
    plain = datasets.column_converter(datasets.Columns(prompt="q", answer="gold"))
    ex = plain({"q": "Hi?", "gold": 1, "messages": turns, "note": "kept"})
    assert templates.prompt_of(ex) == "Hi?" and ex["note"] == "kept"
    for bad, why in (
        ("not a list", "not a non-empty list"),
        ([], "not a non-empty list"),
        ([{"role": "robot", "content": "x"}], "turn 0 has no role"),
        ([{"role": "user", "content": " "}], "turn 0 (user) has no text"),
        ([{"role": "assistant", "content": "4"}], "must end with a user turn"),
        ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], "user turn"),
    ):
        with pytest.raises(datasets._BadRow, match=re.escape(why)):
            datasets.conversation(bad, "messages")


def test_bad_conversation_row_names_file_and_row(chat_files, tmp_path):
    rows = _chat(3, 0)
    rows[1]["messages"] = [{"role": "user"}]
    cfg = chat_config(chat_files, **{"data.path": _write(tmp_path / "bad.jsonl", rows)})
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2: 'messages' turn 0 \(user\)"):
        experiment.build_experiment(cfg)


def test_conversations_render_through_the_chat_template(chat_files):
    from grpo_jax.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(chat_files["tokenizer"])
    cfg = chat_config(chat_files, **{"data.system_prompt": "Be brief."})
    turns = [{"role": "user", "content": "What is 1+2?"}]
    own = [{"role": "system", "content": "Reply."}, *turns]
    head = CHATML.format(role="system", content="Be brief.")
    user = CHATML.format(role="user", content="What is 1+2?")
    assert data_from_config.render(cfg, tok, turns) == head + user + "<|im_start|>assistant\n"
    # a conversation with its own system turn keeps it; no suffix unless one is set
    own_head = CHATML.format(role="system", content="Reply.")
    assert data_from_config.render(cfg, tok, own) == own_head + user + "<|im_start|>assistant\n"
    cfg.data.prompt_suffix = "Answer:"
    suffixed = CHATML.format(role="user", content="What is 1+2? Answer:")
    assert data_from_config.render(cfg, tok, turns).endswith(suffixed + "<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="chat template"):
        templates.render_prompt(turns, template="plain", tokenizer=tok)


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"data.template": "plain"}, "set config.data.template='chat'"),
        ({"data.name": "gsm8k"}, "applies to your own table"),
    ],
)
def test_messages_column_config_errors_are_one_line(chat_files, overrides, match):
    with pytest.raises(ConfigError, match=match) as e:
        config_utils.validate(chat_config(chat_files, **overrides))
    assert "\n" not in str(e.value)


def test_messages_table_trains_and_evaluates_end_to_end(chat_files, tmp_path):
    cfg = chat_config(chat_files)
    exp = experiment.build_experiment(cfg)
    try:
        first = exp.pool.examples[0]
        assert [t["role"] for t in first["messages"]][-1] == "user"
        a, b = (int(x) for x in first["problem"][len("What is ") : -1].split("+"))
        assert exp.pool.golds[0] == str(a + b)  # the cut-off assistant turn
        text = exp.render(templates.prompt_of(first))
        assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
    finally:
        exp.close()
    summary = train.train_and_evaluate(cfg, str(tmp_path / "run"))
    assert summary["steps"] == 2 and summary["data"]["train_examples"] == 12
    ev = summary["eval_after"]["per_dataset"]["custom"]
    assert ev["num_problems"] == 4 and np.isfinite(ev["mean_at_1"])
    rows = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows if "reward_mean" in r] == [1, 2]
