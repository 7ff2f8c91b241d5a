"""Prompt templates.

* ``"plain"``: ``problem + " " + suffix`` (no chat markup): for base models, the paper's RL-from-
  base setting (spec/gdro.md §5: Qwen3-Base with the DAPO suffix below).
* ``"chat"``: the tokenizer's chat template with one user message ``problem + " " + suffix``
  (and an optional system message), ``add_generation_prompt=True``: for instruct models such
  as SmolLM2-135M-Instruct.
* ``"arithmetic"``: ``problem + "="`` (`grpo_jax.data.arithmetic.format_prompt`); no suffix.

`suffix` defaults to `DAPO_SUFFIX` for plain/chat; pass ``suffix=""`` for none.

A conversational row (``data.messages_column``: a list of ``{"role", "content"}`` turns ending
with the user's) renders through the chat template as it is: the system message only when the
turns have none, the suffix only when given explicitly (appended to the last user turn).
"""

from __future__ import annotations

import numpy as np

from grpo_jax.data.arithmetic import format_prompt

__all__ = ["DAPO_SUFFIX", "TEMPLATES", "prompt_of", "render_prompt", "render_example"]

DAPO_SUFFIX = "Let's think step by step and output the final answer within \\boxed{}."
TEMPLATES = ("plain", "chat", "arithmetic")


def prompt_of(example: dict):
    """What `render_prompt` renders for a dataset example: its conversation's prompt turns
    (``example["messages"]``, a messages-format row) or else its problem text."""
    return example.get("messages") or example["problem"]


def render_prompt(
    problem,
    *,
    template: str = "plain",
    tokenizer=None,
    suffix: str | None = None,
    system: str | None = None,
) -> str:
    """Render the prompt text the model sees for one problem.

    Args:
      problem: problem statement, or a conversation (list of ``{"role", "content"}`` turns,
        the last one the user's; ``template="chat"`` only).
      template: ``"plain"`` | ``"chat"`` | ``"arithmetic"``.
      tokenizer: needed for ``"chat"``: anything with
        ``apply_chat_template(messages, add_generation_prompt=True, tokenize=False) -> str``
        (our HF wrapper, `CharTokenizer`, or a transformers tokenizer).
      suffix: instruction appended after the problem (one space between); None =
        `DAPO_SUFFIX` for plain/chat. Not allowed for ``"arithmetic"``.
      system: optional system message (chat only).

    Returns:
      The prompt string (to be tokenised without adding further special tokens by the caller,
      except a BOS the model family needs).

    Raises:
      ValueError: unknown template, empty problem, missing tokenizer for chat, suffix or system
        given where unused.
    """
    if template not in TEMPLATES:
        raise ValueError(f"template must be one of {TEMPLATES}, got {template!r}")
    if isinstance(problem, (list, tuple)):
        return _render_conversation(list(problem), template, tokenizer, suffix, system)
    if not isinstance(problem, str) or not problem.strip():
        raise ValueError("render_prompt: empty problem")
    if template == "arithmetic":
        if suffix or system:
            raise ValueError("the arithmetic template takes no suffix or system message")

        return format_prompt(problem)
    suffix = DAPO_SUFFIX if suffix is None else suffix
    content = f"{problem.strip()} {suffix}" if suffix else problem.strip()
    if template == "plain":
        if system:
            raise ValueError("the plain template takes no system message (use template='chat')")
        return content
    if tokenizer is None:
        raise ValueError("template='chat' needs a tokenizer with apply_chat_template")
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": content}
    ]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _render_conversation(turns, template, tokenizer, suffix, system) -> str:
    if template != "chat" or tokenizer is None:
        raise ValueError(
            "a conversation (data.messages_column) renders through the chat template: set "
            "template='chat' and give a tokenizer with apply_chat_template"
        )
    if not turns or turns[-1].get("role") != "user":
        raise ValueError("a conversation prompt must end with a user turn")
    if suffix:
        last = turns[-1]
        turns = [*turns[:-1], {**last, "content": f"{last['content'].strip()} {suffix}"}]
    if system and not any(t.get("role") == "system" for t in turns):
        turns = [{"role": "system", "content": system}, *turns]
    return tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)


def render_example(example: dict, **kwargs) -> str:
    """`render_prompt(prompt_of(example), **kwargs)`."""
    return render_prompt(prompt_of(example), **kwargs)


def encode_prompts(
    tokenizer, texts: list[str], max_len: int, overlong: str, *, return_overlong: bool = False
):
    """Left-pads token ids to ``max_len``.

    Returns:
      (tokens [N, max_len] int32, mask [N, max_len] bool, kept [N] bool), plus
      overlong [N] bool (longer than ``max_len``, in either mode) with ``return_overlong``.
      Prompts longer than ``max_len`` are dropped (``overlong="skip"``; kept=False) or cut from
      the left (``"truncate"``, keeping the end of the prompt, where the question and template are).
    """
    n = len(texts)
    tokens = np.full((n, max_len), tokenizer.pad_id, np.int32)
    mask = np.zeros((n, max_len), bool)
    kept = np.ones((n,), bool)
    over = np.zeros((n,), bool)
    for i, text in enumerate(texts):
        ids = tokenizer.encode(text)
        if len(ids) > max_len:
            over[i] = True
            if overlong == "skip":
                kept[i] = False
                continue
            ids = ids[-max_len:]
        if ids:
            tokens[i, max_len - len(ids) :] = ids
            mask[i, max_len - len(ids) :] = True
    return (tokens, mask, kept, over) if return_overlong else (tokens, mask, kept)
