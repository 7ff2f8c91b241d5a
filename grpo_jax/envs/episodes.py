"""Multi-turn episodes on the ordinary sampler: turn-synchronous, static shapes.

Each turn is one sampler call over every row's context so far (its prompt, its turns and the
observations, left-padded to one width ``Lp + Lc``, so the sampler compiles once), stopping at
end of text, at a tool-call close token, or at the turn's budget. A turn that stops at a tool
token goes to the environment (rows in parallel threads); its observation is appended to the
row and the row goes on; a row that ended waits (it is not sampled for) until the batch's last
row ends or ``max_turns`` is reached. Each turn re-prefills the row's context (no decode cache is
kept across turns, see docs/byo.md).

The episode is one row: ``completion_tokens [R, Lc]`` = turn 1, observation 1, turn 2, ...
(``present_mask`` 1 on all of them, the attention mask); ``policy_mask`` 1 on the policy's own
tokens only (the loss mask), so tool output is attended to and never trained on; the sampler's
log-probs on policy tokens, 0 elsewhere.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np

from grpo_jax.envs.base import Environment, EnvStep


@dataclasses.dataclass(frozen=True)
class Episodes:
    """Host arrays of R episodes (Lc = the episode's token budget).

    completion_tokens [R, Lc] int32 (pad after the end); present_mask [R, Lc] float32 (policy
    and observation tokens); policy_mask [R, Lc] float32 (policy tokens: the loss mask);
    logprobs [R, Lc] float32 (the sampler's, on policy tokens; 0 elsewhere); lengths [R] int32
    (tokens used, observations included); truncated [R] bool (the episode did not end with an
    end-of-text token: budget, turns, or the turn's budget ran out); turns [R] int32 (policy
    turns); tool_calls [R] int32; texts: what the reward scores per row
    (`Environment.final_text`); turn_texts: each row's policy turns.
    """

    completion_tokens: np.ndarray
    present_mask: np.ndarray
    policy_mask: np.ndarray
    logprobs: np.ndarray
    lengths: np.ndarray
    truncated: np.ndarray
    turns: np.ndarray
    tool_calls: np.ndarray
    texts: tuple[str, ...]
    turn_texts: tuple[tuple[str, ...], ...]


def stop_token_ids(tokenizer, env: Environment) -> tuple[int, ...]:
    """The token id of each of ``env.stop_strings``.

    Raises:
      ValueError: a stop string that is not exactly one token (one line naming it)."""
    out = []
    for s in env.stop_strings:
        ids = tokenizer.encode(s)
        if len(ids) != 1:
            raise ValueError(
                f"{type(env).__name__}.stop_strings: {s!r} is {len(ids)} tokens of this "
                "tokenizer; a stop must be one token (the sampler stops on token ids)"
            )
        out.append(int(ids[0]))
    return tuple(out)


def _left_pad(rows: Sequence[np.ndarray], width: int, pad_id: int):
    tokens = np.full((len(rows), width), pad_id, np.int32)
    mask = np.zeros((len(rows), width), bool)
    for i, r in enumerate(rows):
        if len(r):
            tokens[i, width - len(r) :] = r
            mask[i, width - len(r) :] = True
    return tokens, mask


def run_episodes(
    generate: Callable,
    tokenizer,
    env: Environment,
    prompt_tokens: np.ndarray,
    prompt_mask: np.ndarray,
    examples: Sequence[dict],
    key: jax.Array,
    *,
    budget: int,
    turn_tokens: int,
    threads: int = 8,
) -> Episodes:
    """Samples one episode per row (module docstring).

    Args:
      generate: ``(tokens [R, Lp + budget] int32, mask [R, Lp + budget] bool, key, max_lengths
        [R] int32) -> sampling.Rollouts`` with ``max_new_tokens = turn_tokens`` and the
        tokenizer's end-of-text ids plus ``stop_token_ids(tokenizer, env)`` as its ``eos_ids``.
      prompt_tokens, prompt_mask: [R, Lp] left-padded prompts (int32, bool).
      examples: R dataset rows (`Environment.reset`).
      key: the batch's sampling key (turn t samples with ``fold_in(key, t)``).
      budget: Lc, tokens per episode (policy turns and observations together).
      turn_tokens: the most tokens of one policy turn.
    Returns: `Episodes`.
    """
    R = prompt_tokens.shape[0]
    stops = set(stop_token_ids(tokenizer, env))
    ends = {int(e) for e in tokenizer.eos_ids}
    prompts = [np.asarray(prompt_tokens[i][np.asarray(prompt_mask[i], bool)]) for i in range(R)]
    comp = np.full((R, budget), tokenizer.pad_id, np.int32)
    policy = np.zeros((R, budget), np.float32)
    logp = np.zeros((R, budget), np.float32)
    used = np.zeros(R, np.int64)
    done = np.zeros(R, bool)
    truncated = np.ones(R, bool)
    turns, calls = np.zeros(R, np.int32), np.zeros(R, np.int32)
    states = [env.reset(dict(ex)) for ex in examples]
    turn_texts: list[list[str]] = [[] for _ in range(R)]
    width = prompt_tokens.shape[1] + budget

    with concurrent.futures.ThreadPoolExecutor(max_workers=threads) as pool:
        for t in range(env.max_turns):
            if done.all():
                break
            ctx, ctx_mask = _left_pad(
                [np.concatenate([p, c[:u]]) for p, c, u in zip(prompts, comp, used)],
                width,
                tokenizer.pad_id,
            )
            caps = np.clip(budget - used, 1, turn_tokens).astype(np.int32)
            ro = generate(ctx, ctx_mask, jax.random.fold_in(key, t), caps)
            toks, lps, lens = (
                np.asarray(jax.device_get(x))
                for x in (ro.completion_tokens, ro.logprobs, ro.lengths)
            )
            asks = []
            for i in np.flatnonzero(~done):
                n = int(min(lens[i], budget - used[i]))
                seg = toks[i, :n]
                comp[i, used[i] : used[i] + n] = seg
                policy[i, used[i] : used[i] + n] = 1.0
                logp[i, used[i] : used[i] + n] = lps[i, :n]
                used[i] += n
                turns[i] += 1
                text = tokenizer.decode([int(x) for x in seg])
                turn_texts[i].append(text)
                last = int(seg[-1]) if n else None
                if last in ends:
                    done[i], truncated[i] = True, False
                elif last in stops and used[i] < budget and t + 1 < env.max_turns:
                    asks.append(i)
                else:  # the turn's budget, the episode's budget or its turns ran out
                    done[i] = True
            answers = pool.map(lambda i: (i, env.step(states[i], turn_texts[i][-1])), asks)
            for i, step in answers:
                _observe(i, step, tokenizer, comp, used, budget, done, truncated, states)
                calls[i] += 1
    present = (np.arange(budget)[None] < used[:, None]).astype(np.float32)
    texts = tuple(env.final_text(states[i], turn_texts[i]) for i in range(R))
    return Episodes(
        completion_tokens=comp,
        present_mask=present,
        policy_mask=policy,
        logprobs=logp,
        lengths=used.astype(np.int32),
        truncated=truncated,
        turns=turns,
        tool_calls=calls,
        texts=texts,
        turn_texts=tuple(tuple(x) for x in turn_texts),
    )


def _observe(i, step: EnvStep, tokenizer, comp, used, budget, done, truncated, states) -> None:
    """Appends row i's observation (cut at the budget); ends the row when the environment
    says so (not truncated) or no room is left for another turn (truncated)."""
    if not isinstance(step, EnvStep):
        raise TypeError(f"Environment.step must return an EnvStep, got {type(step).__name__}")
    if step.state is not None:
        states[i] = step.state
    obs = np.asarray(tokenizer.encode(step.observation), np.int32)[: budget - used[i]]
    comp[i, used[i] : used[i] + len(obs)] = obs
    used[i] += len(obs)
    if step.done:
        done[i], truncated[i] = True, False
    elif used[i] >= budget:
        done[i] = True
