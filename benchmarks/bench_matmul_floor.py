"""The GRPO step's dense matmuls timed at their own shapes: an achievable floor on this backend.

  python benchmarks/bench_matmul_floor.py [--preset=smollm2-135m --prompts=16 --samples=8 \
      --prompt_len=159 --max_new_tokens=128 --micro_batch=8 --out=/tmp/matmul_floor.json]

The peer harness's floor (`benchmarks/peers/run_all.py: floor`) prices every FLOP at the 2048^3
float32 matmul peak. The step's matmuls are smaller and thinner than that (decode at 128 rows,
the prefill of 16 prompts, [576, N] x [N, 1536] weight gradients), and the backend runs them
below its peak even alone. This script lists every dense matmul of one GRPO step of grpo_jax's
peer workload as it computes it: each group's prompt run once and joined with the group's
completion positions into one matmul per projection (`Decoder.shared_prefix`); the tied LM
head on the completion positions only; the reference pass and the update in micro-batches of
whole groups; the sampler's prefill of one row per group and max_new_tokens - 1 decode steps
of all rows (an upper count: the loop stops once every row has ended). It jits each distinct
shape alone (float32, random operands; the best of 2 sweeps x `--repeats` calls each) and sums
time x count per phase. Not counted: attention (its causal FLOPs are reported at the peak),
norms, softmax, sampling, the optimizer: the result is a lower bound on a step that uses this
backend's matmul kernels, whatever else is optimised.

Per layer and N positions, forward: x W for q [E, H D], k and v [E, K D], o [H D, E], gate and
up [E, F], down [F, E]; backward of each y = x W: dx = dy W^T and dW = x^T dy. LM head (tied
embedding [V, E], as in SmolLM2 and Qwen3 1.7B; an untied head has the same FLOPs): logits
h E^T; backward dh = dy E and dE = dy^T h. The shapes and counts of one micro-batch's update
equal the dots of its jaxpr (tests/test_peers.py).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from grpo_jax.models.config import SIZE_FIELDS

# (kind, m, k, n): "fwd" [m, k] x [k, n]; "dx" [m, n] x [k, n]^T; "dw" [m, k]^T x [m, n]
Dot = tuple


def dims(cfg) -> dict:
    """The sizes the dots need (`config.SIZE_FIELDS`), from a `ModelConfig` or any object with
    those fields."""
    return {k: int(getattr(cfg, k)) for k in SIZE_FIELDS}


def layer_dots(d: dict, n: int, backward: bool) -> list[Dot]:
    """The dense dots of one decoder layer over n positions (forward, and backward if asked)."""
    e, f = d["hidden_size"], d["intermediate_size"]
    q, kv = d["num_heads"] * d["head_dim"], d["num_kv_heads"] * d["head_dim"]
    shapes = [(e, q), (e, kv), (e, kv), (q, e), (e, f), (e, f), (f, e)]
    dots = [("fwd", n, a, b) for a, b in shapes]
    if backward:
        dots += [("dx", n, a, b) for a, b in shapes] + [("dw", n, a, b) for a, b in shapes]
    return dots


def head_dots(d: dict, n: int, backward: bool) -> list[Dot]:
    """The tied LM head over n positions, in the layouts of XLA's optimised program: logits
    h E^T against the [V, E] embedding ("dx" layout), dh = dy E ("fwd"), and dE = dy^T h
    straight into [V, E] ("dw"; the VJP's transpose is folded away)."""
    e, v = d["hidden_size"], d["vocab_size"]
    dots = [("dx", n, v, e)]
    if backward:
        dots += [("fwd", n, v, e), ("dw", n, v, e)]
    return dots


def check_workload(prompts: int, samples: int, lp: int, lc: int, micro_batch: int) -> None:
    """Raises ValueError unless the workload is one that grpo_jax runs with a shared prompt in
    micro-batches of whole groups (what `step_dots` counts)."""
    rows = prompts * samples
    if min(prompts, samples, lp) < 1:
        raise ValueError(f"prompts, samples and prompt_len must be >= 1: {prompts, samples, lp}")
    if lc < 2:  # with one new token there is no completion position to share a prompt with
        raise ValueError(f"max_new_tokens must be >= 2, got {lc}")
    if not 0 < micro_batch <= rows or rows % micro_batch or micro_batch % samples:
        raise ValueError(
            f"micro_batch {micro_batch} must be a multiple of samples {samples} that divides "
            f"the {rows} rows"
        )


def step_dots(
    d: dict,
    prompts: int,
    samples: int,
    lp: int,
    lc: int,
    micro_batch: int,
    reference: bool = True,
) -> dict:
    """phase -> Counter of dots for one step (shared prompt; micro-batches of whole groups;
    `reference=False`: no reference pass, as grpo_jax runs with kl_coef 0).

    Raises:
      ValueError: see `check_workload`.
    """
    check_workload(prompts, samples, lp, lc, micro_batch)
    groups = micro_batch // samples
    n_micro = prompts * samples // micro_batch
    layers = d["num_layers"]
    out = {p: collections.Counter() for p in ("generate", "reference", "update")}
    # generate: one prefill row per group ([P, Lp] in one pass), the last position through the
    # head; then Lc - 1 decode steps of all R rows (the first token comes from the prefill)
    for x in layer_dots(d, prompts * lp, False):
        out["generate"][x] += layers
    for x in head_dots(d, prompts, False):
        out["generate"][x] += 1
    for x in layer_dots(d, prompts * samples, False):
        out["generate"][x] += layers * (lc - 1)
    for x in head_dots(d, prompts * samples, False):
        out["generate"][x] += lc - 1
    # reference and update, per micro-batch: the groups' prompts (Lp positions each) and the
    # completions' Lc - 1 input positions per row, joined into one matmul per projection
    # (`Decoder.shared_prefix`); the head on the Lc scored positions of each row
    phases = (("reference", False), ("update", True)) if reference else (("update", True),)
    for phase, backward in phases:
        for x in layer_dots(d, groups * lp + micro_batch * (lc - 1), backward):
            out[phase][x] += layers * n_micro
        for x in head_dots(d, micro_batch * lc, backward):
            out[phase][x] += n_micro
    return out


def attention_flops(
    d: dict, prompts: int, samples: int, lp: int, lc: int, reference: bool = True
) -> dict:
    """Attention score + value FLOPs per phase: 4 x layers x heads x head_dim per query-key
    pair, causal pairs only (the least any implementation must compute; `run_all.floor` counts
    full score matrices); the completion queries score Lp prompt keys and the earlier
    completion keys; the update is 3x the forward."""
    a = 4 * d["num_layers"] * d["num_heads"] * d["head_dim"]
    r = prompts * samples
    prompt_pairs = prompts * lp * (lp + 1) // 2
    completion_pairs = r * sum(lp + t for t in range(1, lc))
    forward = a * (prompt_pairs + completion_pairs)
    # decode step t: each row's new query scores its Lp + t cached keys, the same pairs as the
    # completion positions of the reference pass
    return {
        "generate": a * (prompt_pairs + completion_pairs),
        "reference": forward if reference else 0,
        "update": 3 * forward,
    }


def dot_flops(d: Dot) -> int:
    _, m, k, n = d
    return 2 * m * k * n


def _dot_call(d: Dot):
    """A jitted float32 dot of this kind and shape, and its random operands."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    kind, m, k, n = d
    key = jax.random.PRNGKey(0)
    if kind == "fwd":
        a, b = jax.random.normal(key, (m, k)), jax.random.normal(key, (k, n))
        fn = jax.jit(lambda x, w: x @ w)
    elif kind == "dx":  # dy [m, n] . W [k, n] over n
        a, b = jax.random.normal(key, (m, n)), jax.random.normal(key, (k, n))
        fn = jax.jit(lambda dy, w: lax.dot_general(dy, w, (((1,), (1,)), ((), ()))))
    else:  # x [m, k] . dy [m, n] over m
        a, b = jax.random.normal(key, (m, k)), jax.random.normal(key, (m, n))
        fn = jax.jit(lambda x, dy: lax.dot_general(x, dy, (((0,), (0,)), ((), ()))))
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    fn(a, b).block_until_ready()
    return fn, a, b


def time_dots(dots, repeats: int = 5, passes: int = 2) -> dict:
    """Best wall time (s) of each dot alone: `passes` sweeps over all of them, `repeats` calls
    of each per sweep. Sweeping twice keeps a burst of noise from setting one shape's time."""
    calls = {d: _dot_call(d) for d in dots}
    best = {d: float("inf") for d in dots}
    for _ in range(passes):
        for d, (fn, a, b) in calls.items():
            for _ in range(repeats):
                t = time.perf_counter()
                fn(a, b).block_until_ready()
                best[d] = min(best[d], time.perf_counter() - t)
    return best


def measure(
    d: dict,
    prompts: int,
    samples: int,
    prompt_len: int,
    max_new_tokens: int,
    micro_batch: int,
    peak: float,
    repeats: int = 5,
    reference: bool = True,
) -> dict:
    """Times every distinct dot of one step alone; per phase and in total: dense-matmul FLOPs,
    seconds at their own shapes (`matmul_s`) and at the peak, attention FLOPs at the peak."""
    phases = step_dots(d, prompts, samples, prompt_len, max_new_tokens, micro_batch, reference)
    attn = attention_flops(d, prompts, samples, prompt_len, max_new_tokens, reference)
    distinct = sorted({x for c in phases.values() for x in c})
    timed = time_dots(distinct, repeats)
    rows = []
    for phase, counter in phases.items():
        flops = sum(dot_flops(x) * c for x, c in counter.items())
        rows.append(
            {
                "phase": phase,
                "matmul_flops": flops,
                "matmul_s": sum(timed[x] * c for x, c in counter.items()),
                "matmul_s_at_peak": flops / peak,
                "attention_flops": attn[phase],
                "attention_s_at_peak": attn[phase] / peak,
            }
        )
    total = {
        k: sum(r[k] for r in rows)
        for k in ("matmul_flops", "matmul_s", "matmul_s_at_peak", "attention_s_at_peak")
    }
    return {
        "workload": {
            "prompts": prompts,
            "samples": samples,
            "prompt_len": prompt_len,
            "max_new_tokens": max_new_tokens,
            "micro_batch": micro_batch,
            "reference": reference,
        },
        "dims": d,
        "matmul_peak_flops": peak,
        "phases": rows,
        "total": total,
        "dots": [
            {"kind": x[0], "m": x[1], "k": x[2], "n": x[3], "s": timed[x], "flops": dot_flops(x)}
            for x in distinct
        ],
    }


def table(result: dict) -> list[str]:
    """Markdown rows of `measure`'s result: a line per phase and the step."""
    lines = [
        "| phase | dense matmul TFLOP | at the 2048^3 peak s | timed at their shapes s "
        "| GFLOP/s | attention at the peak s |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["phases"] + [dict(result["total"], phase="step")]:
        lines.append(
            f"| {r['phase']} | {r['matmul_flops'] / 1e12:.2f} | {r['matmul_s_at_peak']:.1f} | "
            f"{r['matmul_s']:.1f} | {r['matmul_flops'] / max(r['matmul_s'], 1e-12) / 1e9:.0f} | "
            f"{r['attention_s_at_peak']:.1f} |"
        )
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt_len", type=int, default=159, help="the peers' full-size prompt")
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--micro_batch", type=int, default=8, help="rows, whole groups")
    p.add_argument("--reference", type=int, default=1, help="0: no reference pass (kl_coef 0)")
    p.add_argument("--repeats", type=int, default=5, help="calls per shape in each of 2 sweeps")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)

    import jax
    from bench_step import cpu_info, matmul_peak

    from grpo_jax.models.config import get_preset

    w = (a.prompts, a.samples, a.prompt_len, a.max_new_tokens, a.micro_batch)
    try:
        check_workload(*w)
    except ValueError as e:
        p.error(str(e))
    peak = matmul_peak(dtype="float32")
    result = measure(
        dims(get_preset(a.preset)), *w, peak=peak, repeats=a.repeats, reference=bool(a.reference)
    )
    result.update(
        preset=a.preset,
        cpu=cpu_info(),
        jax=jax.__version__,
        started_utc=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    )
    print(
        f"{a.preset}: {a.prompts} prompts x {a.samples} samples, Lp {a.prompt_len}, Lc "
        f"{a.max_new_tokens}, micro-batch {a.micro_batch}; float32 2048^3 peak "
        f"{peak / 1e9:.1f} GFLOP/s; jax {jax.__version__}; {len(result['dots'])} distinct dots"
    )
    print("\n".join(table(result)))
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
