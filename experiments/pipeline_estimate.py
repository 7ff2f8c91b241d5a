"""Pipeline estimate of an RL step: generation per decode step from the bytes each chip reads,
over measured completion lengths, beside the compiled training programs' roofline.

Generation is estimated for each decode the sampler has (`sampler_call_seconds`, from
`grpo_jax.sampling.decode_read_bytes`: the XLA dense and prefix-shared caches up to their
attention buckets, finished rows included, and the paged cache under JAX's Pallas TPU
paged-attention kernel, which reads each group's shared prompt pages once while a row of it
decodes and each live row's filled own pages, rounded up to the kernel's block), and for exact
reads (`call_seconds`: the same reads without page or block rounding, but each step's own
roofline on the slowest data shard, where `sampler_call_seconds` spreads a call's rows and
bytes evenly over the shards). The headline is the built decode of the chip (`built_decode`).
A decode step's seconds are max(bytes / HBM bandwidth, FLOPs / peak) plus the
tensor-parallel collectives' bytes / chip-to-chip bandwidth (not overlapped); a call waits
for its longest row. The prompt prefill is compute-bound (2 N FLOPs per prompt token, once
per group).

The step: synchronous = generation + training + reshard; k = 1 (rollouts one step stale,
generated while the previous batch trains) = max(generation, training) + reshard on the same
chips (the ideal overlap), or on a split of the chips (`split_step`).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from grpo_jax import cli


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
    included) in ``model``'s layout reading exactly what a ragged decode needs (the paged
    kernel's reads without page or block rounding): per decode step i (1 .. the longest
    length - 1) one chip reads its parameters, the shared prompt prefix once per group that
    still has a row decoding (groups x ``prompt_len`` slots) and the i filled slots of each
    row still decoding (a finished row reads nothing); the slowest data shard sets each step.
    The built decodes are `sampler_call_seconds`.

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


# ----------------------------------------------------------------------------- the report's cases


def built_decode(chip) -> str:
    """The built decode a case's headline uses on ``chip`` (an `experiments.aot.Chip`):
    "paged" on a TPU (`rollout.decode_cache=paged` under ``attention_impl`` splash: the Pallas
    TPU paged-attention kernel), "xla_prefix_shared" elsewhere (JAX's Pallas GPU kernels are
    not wired in, and the paged cache's XLA path reads each row's whole own cache every step,
    no less than the prefix-shared cache up to its buckets)."""
    return "paged" if chip.name.startswith("TPU") else "xla_prefix_shared"


def sampler_call_seconds(
    model: DecodeModel,
    lengths,
    rates: Rates,
    *,
    new_tokens: int,
    cache: str,
    buckets: int = 8,
    page_size: int = 16,
    compute_tokens: int | None = None,
) -> dict:
    """One sampler call as the built static sampler runs it (`grpo_jax.sampling`) with the
    ``cache`` layout: "dense" or "prefix_shared" (XLA, each decode chunk reading its cache up
    to its attention bucket, ``buckets``; finished rows still read), or "paged" (the Pallas
    TPU kernel: each group's shared prompt pages once while a row of it decodes, each live
    row's own filled slots, rounded up to the kernel's block of at most ``compute_tokens``
    keys; pages of ``page_size`` slots, prompts of ``prompt_len`` tokens; finished rows read
    nothing). `sampling.decode_read_bytes` over all the call's
    rows with ``model``'s per-chip parameter and slot bytes (the rows spread evenly over the
    data shards), then the same rates as `call_seconds`. Returns `call_seconds`' keys."""
    from grpo_jax import sampling

    L = np.asarray(lengths, np.int64)
    reads = sampling.decode_read_bytes(
        param_bytes=model.param_bytes,
        kv_bytes_per_slot=model.kv_slot_bytes / model.data,
        rows=len(L),
        group_size=model.group_size,
        prompt_len=model.prompt_len,
        new_tokens=new_tokens,
        layout=cache,
        buckets=buckets,
        lengths=L,
        page_size=page_size,
        compute_tokens=compute_tokens,
    )
    decoded = int((L - 1).sum())
    steps = int(L.max()) - 1
    r = len(L) // model.data
    memory_s = reads["total"] * decoded / rates.hbm_Bps
    compute_s = steps * model.flops_per_row * r / rates.flops
    decode = max(memory_s, compute_s) + steps * model.link_bytes_per_row * r / rates.link_Bps
    prefill = model.prefill_flops_per_group * (len(L) // model.group_size) / rates.flops
    per_step = {k: reads[k] * decoded / steps for k in ("params", "prefix", "completion")}
    return {
        "seconds": decode + prefill,
        "prefill_seconds": prefill,
        "decode_seconds": decode,
        "steps": steps,
        "tokens": int(L.sum()),
        "reads": per_step,
    }


def sampler_generation_seconds(
    model: DecodeModel, lengths, rows_per_call: int, rates: Rates, *, new_tokens: int, cache: str
) -> dict:
    """All of a step's rollouts in calls of ``rows_per_call`` with a built decode:
    `sampler_call_seconds` per call, {"seconds": summed, "calls": [each call's dict]}."""
    calls = [
        sampler_call_seconds(model, c, rates, new_tokens=new_tokens, cache=cache)
        for c in np.asarray(lengths, np.int64).reshape(-1, rows_per_call)
    ]
    return {"seconds": sum(c["seconds"] for c in calls), "calls": calls}


def decode_model(
    model_config, layout, chips: int, prompt_len: int, group_size: int, param_bytes=None
):
    """The `DecodeModel` of ``model_config`` (bf16) in a generation ``layout``
    (`generation_layout.Layout`) on ``chips`` chips: the parameter bytes per chip from
    ``param_bytes`` (a compiled record's) or `generation_layout.decode_costs`, the link bytes
    and FLOPs per row from `generation_layout.decode_costs`."""
    from flax import nnx

    from grpo_jax import generation_layout as gl
    from grpo_jax import sampling
    from grpo_jax.models import from_config as model_lib

    abstract = nnx.split(model_lib.abstract_model(model_config), nnx.Param)[1]
    rows = layout.data * group_size
    costs = gl.decode_costs(layout, model_config, abstract, rows=rows, slots=1)
    kv_shards = layout.tensor if model_config.num_kv_heads % layout.tensor == 0 else 1
    n = model_config.num_params
    return DecodeModel(
        param_bytes=float(param_bytes if param_bytes is not None else costs["params"]),
        kv_slot_bytes=sampling.kv_bytes_per_slot(model_config) / kv_shards,
        prompt_len=prompt_len,
        group_size=group_size,
        data=layout.data,
        link_bytes_per_row=costs["link"] / group_size,
        flops_per_row=2 * n / layout.tensor,
        prefill_flops_per_group=2 * n * prompt_len / chips,
    )


LLAMA31_8B = dict(  # meta-llama/Llama-3.1-8B config.json (NeMo-RL's GRPO benchmark model)
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=500000.0,
    tie_word_embeddings=False,
    qk_norm=False,
    family="llama",
)


def training_seconds(
    record: dict, chip, logprob_passes: int = 2, scale: float = 1.0, mfu: float | None = None
) -> float:
    """Roofline seconds of a step's training programs from an `experiments.aot` record: its
    mini-batch updates plus ``logprob_passes`` log-prob passes (old and reference: the step
    runs both when the mini-batch is smaller than the batch and the KL term is on), times
    ``scale`` (rows x tokens x parameters of another workload over the record's). With
    ``mfu`` each program takes at least its model FLOPs at that fraction of peak (the
    MaxText-calibrated figure of `experiments.aot.roofline`)."""
    from experiments import aot

    steps = aot.roofline(record, chip)["steps"]

    def secs(x):
        floor = x["model_flops"] / (record["devices"] * chip.peak_bf16_flops * mfu) if mfu else 0
        return max(x["seconds_per_call"], floor)

    upd = steps["update"]["calls"] * secs(steps["update"])
    return scale * (upd + logprob_passes * secs(steps["logprobs"]))


def _rows_that_fit(usable: float, resident: float, model: DecodeModel, slots: int, R: int, cap):
    """The largest power-of-two sampler call (rows, at most ``cap``, dividing R) whose dense KV
    cache (``slots`` per row) and parameters fit ``usable`` bytes per chip beside
    ``resident`` with 20% left for activations and logits; None when not even one group fits."""
    rows = cap
    while rows >= model.group_size * model.data:
        kv = rows / model.data * slots * model.kv_slot_bytes
        if R % rows == 0 and resident + model.param_bytes + kv <= 0.8 * usable:
            return rows
        rows //= 2
    return None


DECODES = ("xla_dense", "xla_prefix_shared", "paged", "ragged_lse")
# the report's generation columns: the three built decodes (`sampler_call_seconds`'s caches)
# and exact reads on the slowest data shard each step (`call_seconds`)
BUILT_CACHES = {"xla_dense": "dense", "xla_prefix_shared": "prefix_shared", "paged": "paged"}


def estimate_case(case: dict, lengths) -> dict:
    """Every figure of one row of the report's table (see `main` for the cases): today's
    roofline step, the generation layout with each decode of `DECODES` (seconds, reads, the
    synchronous and k = 1 steps), the headline ``built`` decode of the chip (`built_decode`)
    with its steps at MaxText's MFU and the best split."""
    from experiments import aot
    from grpo_jax import generation_layout as gl

    chip, n, cfg = aot.CHIPS[case["chip"]], case["chips"], case["model"]
    rates = Rates(chip.bandwidth_Bps, chip.link_Bps, chip.peak_bf16_flops)
    G, Lp, Lc = case["G"], case["Lp"], case["Lc"]
    lay = gl.Layout.parse(case["layout"])
    gen_rec = case.get("gen_record")
    param_bytes = gen_rec["generation_layout"]["param_bytes"] if gen_rec else None
    model = decode_model(cfg, lay, n, Lp, G, param_bytes)
    rows = case["rows_per_call"]
    built = {
        k: sampler_generation_seconds(model, lengths, rows, rates, new_tokens=Lc, cache=c)
        for k, c in BUILT_CACHES.items()
    }
    ragged = generation_seconds(model, lengths, rows, rates)
    train = training_seconds(case["train_record"], chip, scale=case.get("train_scale", 1.0))
    mfu = aot.MAXTEXT_MFU.get(chip.name, (None,))[0]
    train_cal = training_seconds(
        case["train_record"], chip, scale=case.get("train_scale", 1.0), mfu=mfu
    )
    # the reshard: each chip receives its generation shard less the part it holds (1 / n of it
    # under FSDP over n), at the chip-to-chip bandwidth
    reshard = model.param_bytes * (1 - 1 / n) / chip.link_Bps
    gen = {k: v["seconds"] for k, v in built.items()} | {"ragged_lse": ragged["seconds"]}
    steps = {k: step_seconds(v, train, reshard) for k, v in gen.items()}
    headline = built_decode(chip)
    return {
        "name": case["name"],
        "layout": lay.name,
        "rows_per_call": rows,
        "calls": len(lengths) // rows,
        "today_s": case.get("today_s"),
        "built": headline,
        "training_s": train,
        "training_maxtext_s": train_cal if mfu else None,
        "steps_maxtext": step_seconds(gen[headline], train_cal, reshard) if mfu else None,
        "reshard_s": reshard,
        "reshard_bytes": model.param_bytes * (1 - 1 / n),
        "generation_s": gen,
        "steps": steps,
        "split": _split(case, lengths, rates, train, chip, BUILT_CACHES[headline]),
        "reads_before": _reads_before(case, cfg),
        "reads_after": {k: _mean_reads(v["calls"]) for k, v in built.items()}
        | {"ragged_lse": ragged["reads"]},
        "tokens": int(lengths.sum()),
        "longest": int(lengths.max()),
        "mean_length": float(lengths.mean()),
        "param_bytes_source": "compiled" if gen_rec else "analytic",
    }


def _mean_reads(calls) -> dict:
    return {k: float(np.mean([c["reads"][k] for c in calls])) for k in calls[0]["reads"]}


def _reads_before(case, cfg) -> dict:
    """Today's decode reads per step per chip (the roofline of `experiments.aot`): the whole
    bf16 model (FSDP all-gathers it) and every row's whole cache, prompt slots included."""
    from grpo_jax import sampling

    kv = sampling.kv_bytes_per_slot(cfg)
    rows = case["today_rows_per_call"] / case["chips"]
    return {
        "params": 2 * cfg.num_params,
        "prefix": rows * case["Lp"] * kv,
        "completion": rows * case["Lc"] * kv,
    }


def _split(case, lengths, rates, train_s, chip, cache: str) -> dict | None:
    """k = 1 on a split of the chips (`split_step`): g chips generate with the built ``cache``
    decode (`sampler_call_seconds`) in
    the planner-style layout (tensor = min(g, kv heads), rows over the rest; no training state
    on them, so the largest call that fits), the others train, their time the compiled
    programs' scaled by chips (compute-bound passes, per-chip activations kept by
    micro-batches), if their state fits."""
    from grpo_jax import generation_layout as gl

    n, cfg, rec = case["chips"], case["model"], case["train_record"]
    usable = chip.memory_bytes * 0.95
    upd = rec["steps"]["update"]
    resident = rec["state_bytes"] + rec["ref_bytes"]

    def gen_on(g):
        t = math.gcd(g, cfg.num_kv_heads)
        model = decode_model(cfg, gl.Layout(g // t, t), g, case["Lp"], case["G"])
        rows = _rows_that_fit(usable, 0.0, model, case["Lp"] + case["Lc"], case["R"], case["R"])
        if rows is None:
            return None
        return sampler_generation_seconds(
            model, lengths, rows, rates, new_tokens=case["Lc"], cache=cache
        )["seconds"]

    def train_on(c):
        fits = upd["temp"] + upd["output"] + resident * n / c <= usable
        return train_s * n / c if fits else None

    def send_on(g):  # each generating chip receives its shard; the trainers send g shards
        t = math.gcd(g, cfg.num_kv_heads)
        p = decode_model(cfg, gl.Layout(g // t, t), g, case["Lp"], case["G"]).param_bytes
        return max(p, g * p / (n - g)) / chip.link_Bps

    return split_step(n, gen_on, train_on, send_on)


NEMO_RL = {  # NeMo-RL v0.5 performance summary, H100 BF16, GRPO Llama-3.1-8B (measured)
    "source": "https://github.com/NVIDIA-NeMo/RL/blob/108bffdab368507a5500f27089ea2e7d90a06dea/"
    "docs/about/performance-summary.md",
    "on_policy": {"tokens_per_s_gpu": 1581, "step_s": 92.8, "mean_length": 1019},
    "one_step_off": {"tokens_per_s_gpu": 2478, "step_s": 64.8, "mean_length": 1123},
    "rollouts": 2048,  # 64 prompts x 32 generations; T-GBS 512; max sequence 4,096; 16 GPUs
    # their tokens per rollout, 1,581 x 92.8 s x 16 / 2,048 = 1,146 = 1,019 generated + ~127
    "prompt_tokens": 127,
}


def _load(path):
    import json
    import os

    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def cases(reports: str = "reports") -> list[dict]:
    """The report's cases: the paper's Qwen3-8B Rollout-GDRO step on v5p-128 and v5p-16 (the
    compiled training records of `reports/aot_tpu`, the compiled generation-layout samplers
    where present), and NeMo-RL's Llama-3.1-8B GRPO workload on 16 H100 (the training time
    from the compiled Qwen3-8B h100-16 programs, scaled by rows x tokens x parameters)."""
    from grpo_jax.models import get_preset
    from grpo_jax.models.config import ModelConfig

    qwen = get_preset("qwen3-8b").replace(dtype="bfloat16", param_dtype="bfloat16")
    llama = ModelConfig(**LLAMA31_8B, dtype="bfloat16", param_dtype="bfloat16")
    tpu, gpu = f"{reports}/aot_tpu", f"{reports}/aot_gpu"
    paper = dict(model=qwen, R=1024, G=4, Lp=1024, Lc=4096, chip="v5p")
    h100 = _load(f"{gpu}/8b_h100x16_data2.json")
    nemo_T = 4096
    return [
        dict(
            paper,
            name="v5p-128 (64 chips)",
            chips=64,
            layout="8x8",
            rows_per_call=1024,
            today_rows_per_call=1024,
            train_record=_load(f"{tpu}/8b_v5p128_full.json"),
            gen_record=_load(f"{tpu}/8b_v5p128_gen8x8.json"),
        ),
        dict(
            paper,
            name="v5p-16 (8 chips)",
            chips=8,
            layout="1x8",
            rows_per_call=256,
            today_rows_per_call=256,
            train_record=_load(f"{tpu}/8b_v5p16_micro.json"),
            gen_record=_load(f"{tpu}/8b_v5p16_gen1x8.json"),
        ),
        dict(
            paper,
            name="v5p-16 (8 chips), 512-row calls",
            chips=8,
            layout="1x8",
            rows_per_call=512,  # fits by the planner's analytic memory (not compiled)
            today_rows_per_call=256,
            train_record=_load(f"{tpu}/8b_v5p16_micro.json"),
            gen_record=_load(f"{tpu}/8b_v5p16_gen1x8.json"),
        ),
        dict(
            name="NeMo-RL workload, 16 x H100",
            model=llama,
            chip="h100",
            chips=16,
            R=NEMO_RL["rollouts"],
            G=32,
            Lp=128,
            Lc=nemo_T - 128,
            layout="2x8",
            rows_per_call=1024,
            today_rows_per_call=512,
            train_record=h100,
            train_scale=(NEMO_RL["rollouts"] * nemo_T * llama.num_params)
            / (h100["batch"]["R"] * 5120 * h100["params"]),
            gen_record=None,
        ),
    ]


def case_lengths(case: dict, measured: dict, seed: int = 0) -> np.ndarray:
    """The case's R completion lengths: the measured ones (``measured``: the JSON of
    `benchmarks/gsm8k_lengths.py`) scaled to the case's budget (`scale_lengths`; the NeMo-RL
    case instead by NeMo-RL's measured mean over ours, capped at its budget), drawn with
    replacement (`draw_lengths`)."""
    pool, budget = measured["lengths"], measured["max_new_tokens"]
    if case["chip"] == "h100":
        factor = NEMO_RL["on_policy"]["mean_length"] / float(np.mean(pool))
        pool = np.minimum(case["Lc"], np.ceil(np.asarray(pool) * factor)).astype(np.int64)
    else:
        pool = scale_lengths(pool, budget, case["Lc"])
    return draw_lengths(pool, case["R"], seed)


LABELS = {
    "xla_dense": "XLA dense",
    "xla_prefix_shared": "XLA prefix-shared",
    "paged": "paged, Pallas TPU kernel (prompt read once per group, finished rows skipped)",
    "ragged_lse": "exact reads, slowest data shard each step (no page or block rounding)",
}


def markdown(results: list[dict]) -> str:
    """The report's tables (seconds per RL step; GB read per decode step per chip). The bold
    steps are the chip's built decode (`built_decode`), named in the row."""
    gb = 1e9
    lines = [
        "| slice | generation layout, rows per call | today (aot roofline) | training (4 updates + 2 "
        "log-prob passes; MaxText MFU) | reshard | generation: layout + "
        + " / + ".join(LABELS[k] for k in DECODES)
        + " | built decode | synchronous, built (MaxText MFU) | synchronous, exact reads, "
        "slowest shard | k = 1, same chips, built | k = 1, split, built |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        g, st, sp, b = r["generation_s"], r["steps"], r["split"], r["built"]
        cal = r["training_maxtext_s"]
        lines.append(
            f"| {r['name']} | {r['layout']} ({r['param_bytes_source']} parameter bytes), "
            f"{r['calls']} x {r['rows_per_call']} | "
            + (f"{r['today_s']:.1f}" if r["today_s"] else "-")
            + f" | {r['training_s']:.1f}"
            + (f" ({cal:.1f})" if cal else "")
            + f" | {r['reshard_s'] * 1e3:.1f} ms ({r['reshard_bytes'] / gb:.2f} GB) | "
            + " / ".join(f"{g[k]:.1f}" for k in DECODES)
            + f" | {LABELS[b]} | **{st[b]['synchronous']:.1f}**"
            + (f" ({r['steps_maxtext']['synchronous']:.1f})" if r["steps_maxtext"] else "")
            + f" | {st['ragged_lse']['synchronous']:.1f} | **{st[b]['k1']:.1f}** | "
            + (
                f"{sp['step']:.1f} ({sp['generate_chips']} generate, {sp['train_chips']} train)"
                if sp
                else "no split fits"
            )
            + " |"
        )
    lines += [
        "",
        "GB per decode step per chip: parameters / prompt prefix / completion KV (total)",
        "",
        "| slice | today | " + " | ".join(f"layout + {LABELS[k]}" for k in DECODES) + " |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        cells = [r["reads_before"], *(r["reads_after"][k] for k in DECODES)]
        fmt = [
            f"{c['params'] / gb:.2f} / {c['prefix'] / gb:.2f} / {c['completion'] / gb:.2f} "
            f"({sum(c.values()) / gb:.1f})"
            for c in cells
        ]
        lines.append(f"| {r['name']} | " + " | ".join(fmt) + " |")
    return "\n".join(lines) + "\n"


@cli.entry_point
def main(argv=None) -> list[dict]:
    """The command line (module docstring). Bad input (a missing lengths file or reports
    folder, an unknown flag) is one ``error:`` line and exit 2."""
    import json
    import os

    ap = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="reports/gsm8k_lengths.json")
    ap.add_argument("--reports", default="reports")
    ap.add_argument("--json_out", default="")
    args = ap.parse_args(argv)
    if not os.path.isfile(args.lengths):
        raise FileNotFoundError(f"--lengths={args.lengths}: no such file (measured lengths)")
    if not os.path.isdir(args.reports):
        raise FileNotFoundError(f"--reports={args.reports}: no such folder")
    measured = _load(args.lengths)
    out = []
    for case in cases(args.reports):
        r = estimate_case(case, case_lengths(case, measured))
        if case["chip"] == "h100":
            per_row = NEMO_RL["prompt_tokens"] + r["mean_length"]
            r["tokens_per_s_chip"] = {
                k: case["R"] * per_row / (v * case["chips"])
                for k, v in {
                    "synchronous": r["steps"][r["built"]]["synchronous"],
                    "k1": r["steps"][r["built"]]["k1"],
                    "k1_split": (r["split"] or {}).get("step", float("nan")),
                }.items()
            }
        elif case["train_record"] is not None:
            r["today_s"] = case["train_record"]["roofline"]["step_seconds"]
        out.append(r)
    print(markdown(out), end="", flush=True)
    for r in out:
        if "tokens_per_s_chip" in r:
            print(f"{r['name']}: tokens/s/chip {r['tokens_per_s_chip']}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=1, default=float)
    return out


if __name__ == "__main__":
    main()
