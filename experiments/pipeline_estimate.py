"""Pipeline estimate of an RL step: generation per decode step from the bytes each chip reads,
over measured completion lengths, beside the compiled training programs' roofline.

Per decode step i (1 .. the call's longest completion - 1) one chip reads
  its parameters in the generation layout (``param_bytes``),
  the shared prompt prefix once per group that still has a row decoding
      (groups x ``prompt_len`` slots x ``kv_slot_bytes``),
  the filled completion slots of its rows still decoding (i slots each),
which is what a paged / ragged decode kernel would read (rows attend to their filled slots
only, a finished row reads nothing). Our XLA decode (`grpo_jax.sampling`) still reads the
whole cache up to its attention bucket; this is the estimate of the kernel, not of it. Its
seconds are max(bytes / HBM bandwidth, FLOPs / peak) plus the tensor-parallel collectives'
bytes / chip-to-chip bandwidth (not overlapped). The chips of one call run in lockstep, so a
step takes the slowest data shard's time and the call waits for its longest row. The prompt
prefill is compute-bound (2 N FLOPs per prompt token, once per group).

The step: synchronous = generation + training + reshard; k = 1 (rollouts one step stale,
generated while the previous batch trains) = max(generation, training) + reshard on the same
chips (the ideal overlap), or on a split of the chips (`split_step`).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class DecodeModel:
    """What one chip holds, reads and computes per decode step in a generation layout.

    param_bytes: parameter bytes per chip. kv_slot_bytes: keys and values of one cache slot
    of one row over all layers, the chip's share (divided by the tensor shards of the kv heads).
    prompt_len: prompt slots per group. group_size: rows sharing a prompt (consecutive rows).
    data: row shards (a call's rows split into ``data`` consecutive blocks). link_bytes_per_row:
    bytes a chip sends per row per step for the tensor-parallel collectives (0 without tensor
    parallelism). flops_per_row: FLOPs per row per step on one chip (2 N / tensor).
    prefill_flops_per_group: FLOPs per chip of one group's prompt prefill (2 N Lp / chips).
    """

    param_bytes: float
    kv_slot_bytes: float
    prompt_len: int
    group_size: int
    data: int
    link_bytes_per_row: float = 0.0
    flops_per_row: float = 0.0
    prefill_flops_per_group: float = 0.0


@dataclasses.dataclass(frozen=True)
class Rates:
    """Per chip: HBM bandwidth and chip-to-chip bandwidth (bytes/s), peak bf16 FLOP/s."""

    hbm_Bps: float
    link_Bps: float
    flops: float


def scale_lengths(lengths, measured_budget: int, budget: int) -> np.ndarray:
    """Completion lengths measured at ``measured_budget`` tokens, scaled to ``budget``:
    ceil(L x budget / measured_budget), capped at ``budget`` (a truncated row, L =
    measured_budget, stays truncated at the new budget). [n] int64."""
    lengths = np.asarray(lengths, np.int64)
    return np.minimum(budget, np.ceil(lengths * budget / measured_budget)).astype(np.int64)


def draw_lengths(pool, rows: int, seed: int = 0) -> np.ndarray:
    """``rows`` lengths drawn with replacement from ``pool`` (numpy default_rng(seed))."""
    return np.random.default_rng(seed).choice(np.asarray(pool, np.int64), size=rows)


def call_seconds(model: DecodeModel, lengths, rates: Rates) -> dict:
    """One sampler call of ``len(lengths)`` rows (completion lengths, >= 1, prefill token
    included) in ``model``'s layout.

    Returns {"seconds", "prefill_seconds", "decode_seconds", "steps" (decode steps run),
    "tokens" (completion tokens), "reads": {"params", "prefix", "completion"}: bytes per
    decode step of the slowest shard, averaged over the steps}.
    Raises ValueError: rows not divisible into ``data`` shards of whole groups.
    """
    L = np.asarray(lengths, np.int64)
    G, d = model.group_size, model.data
    if len(L) % (d * G):
        raise ValueError(f"{len(L)} rows do not split into {d} shards of whole groups of {G}")
    r = len(L) // d
    shards = L.reshape(d, r)
    groups = shards.reshape(d, r // G, G).max(axis=2)  # a group reads its prefix while any row runs
    i = np.arange(1, max(int(L.max()), 1))  # decode steps
    # rows of a shard still decoding at step i: L > i; each reads its i filled slots
    active = (shards[:, :, None] > i[None, None, :]).sum(axis=1)  # [d, steps]
    live_groups = (groups[:, :, None] > i[None, None, :]).sum(axis=1)
    completion = active * i[None, :] * model.kv_slot_bytes
    prefix = live_groups * model.prompt_len * model.kv_slot_bytes
    total = model.param_bytes + prefix + completion  # [d, steps]
    worst = total.argmax(axis=0)  # the slowest shard sets each step's time
    cols = np.arange(len(i))
    reads = total[worst, cols]
    step_s = np.maximum(reads / rates.hbm_Bps, model.flops_per_row * r / rates.flops)
    step_s = step_s + model.link_bytes_per_row * r / rates.link_Bps
    prefill = model.prefill_flops_per_group * (len(L) // G) / rates.flops
    n = max(len(i), 1)
    return {
        "seconds": float(step_s.sum() + prefill),
        "prefill_seconds": float(prefill),
        "decode_seconds": float(step_s.sum()),
        "steps": len(i),
        "tokens": int(L.sum()),
        "reads": {
            "params": model.param_bytes if len(i) else 0.0,
            "prefix": float(prefix[worst, cols].sum() / n),
            "completion": float(completion[worst, cols].sum() / n),
        },
    }


def generation_seconds(model: DecodeModel, lengths, rows_per_call: int, rates: Rates) -> dict:
    """All of a step's rollouts (``lengths`` [R], in row order) in calls of ``rows_per_call``:
    `call_seconds` summed (seconds, steps, tokens) and its reads averaged over the calls."""
    L = np.asarray(lengths, np.int64)
    if len(L) % rows_per_call:
        raise ValueError(f"{len(L)} rollouts do not split into calls of {rows_per_call}")
    calls = [call_seconds(model, c, rates) for c in L.reshape(-1, rows_per_call)]
    out = {k: sum(c[k] for c in calls) for k in ("seconds", "decode_seconds", "steps", "tokens")}
    out["prefill_seconds"] = sum(c["prefill_seconds"] for c in calls)
    out["calls"] = len(calls)
    out["reads"] = {k: float(np.mean([c["reads"][k] for c in calls])) for k in calls[0]["reads"]}
    return out


def step_seconds(generation_s: float, training_s: float, reshard_s: float) -> dict:
    """{"synchronous": generation + training + reshard, "k1": max(generation, training) +
    reshard} (k = 1 on the same chips: the overlap at its ideal)."""
    return {
        "synchronous": generation_s + training_s + reshard_s,
        "k1": max(generation_s, training_s) + reshard_s,
    }


def split_step(
    chips: int, generation_s_on, training_s_on, reshard_s_on, splits=None
) -> dict | None:
    """k = 1 on a split of ``chips``: g generate (``generation_s_on(g)``, None when the
    rollouts do not fit g chips) while chips - g train (``training_s_on(chips - g)``, None
    when the update does not fit), weights sent once per step (``reshard_s_on(g)``). The
    split with the shortest max(generation, training) + reshard, over ``splits`` (default
    the powers of two below ``chips``). Returns {"generate_chips", "train_chips",
    "generation", "training", "reshard", "step"} or None when no split fits."""
    best = None
    for g in splits or [2**k for k in range(int(math.log2(chips)) + 1) if 2**k < chips]:
        gen, train = generation_s_on(g), training_s_on(chips - g)
        if gen is None or train is None:
            continue
        resh = reshard_s_on(g)
        step = max(gen, train) + resh
        if best is None or step < best["step"]:
            best = {
                "generate_chips": g,
                "train_chips": chips - g,
                "generation": gen,
                "training": train,
                "reshard": resh,
                "step": step,
            }
    return best
