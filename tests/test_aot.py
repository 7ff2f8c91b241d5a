"""Compile-only checks (experiments/aot.py) on a reduced-width stand-in of configs/dapo_qwen3.py.

The same config as the paper's runs (bf16 compute, fp32 master weights, remat, KL to the
reference, mini-batches smaller than R) with a tiny model, compiled on the 8 virtual CPU
devices of tests/conftest.py with the real mesh rules; nothing is allocated.
"""

import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import dapo_qwen3
from experiments import aot
from grpo_jax import cli
from grpo_jax.experiment import build_experiment

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_dapo(arg="8b,rollout_gdro"):
    c = dapo_qwen3.get_config(arg)
    o = c.model.overrides
    o.vocab_size, o.hidden_size, o.intermediate_size, o.num_layers = 256, 64, 128, 2
    o.num_heads, o.num_kv_heads, o.head_dim = 4, 2, 16
    c.rollout.prompts_per_step, c.rollout.max_new_tokens = 16, 16
    c.data.max_prompt_tokens = 16
    c.algorithm.mini_batch_size = 16  # R = 64: 4 gradient steps, as in the paper (1024 / 256)
    if (
        c.rollout.generate_batch_size
    ):  # Prompt-GDRO: 2x the prompts in 2 sampler calls, as the paper's
        c.rollout.prompts_per_step, c.rollout.generate_batch_size = 32, 64
    return c


def _full_bytes(tree):
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


@pytest.fixture(scope="module")
def fsdp_result():
    assert len(jax.devices()) >= 8
    return aot.compile_steps(tiny_dapo())  # mesh: data 1 x fsdp 8 (the TPU layout)


def test_update_arguments_are_sharded_over_the_eight_devices(fsdp_result):
    r = fsdp_result
    assert r["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}
    exp = build_experiment(tiny_dapo(), with_data=False)
    state = exp.abstract_state
    full = _full_bytes(state)
    # every parameter with an "embed" axis (all but the norms) splits 8 ways, and so do Adam's moments
    assert r["state_bytes"] < full / 8 * 1.1
    norms = sum(
        math.prod(x.shape) * x.dtype.itemsize
        for p, x in jax.tree_util.tree_leaves_with_path(state.params)
        if "norm" in jax.tree_util.keystr(p)
    )
    assert r["state_bytes"] == pytest.approx((full - 3 * norms) / 8 + 3 * norms, rel=0.01)
    mb, L, Lc = 16, 32, 16
    # tokens, mask, 4 [mb, Lc] (completion mask, old / reference / sampler log-probs), 2 [mb]
    batch_bytes = (mb * L * (4 + 1) + mb * Lc * 4 * 4 + mb * 4 * 2) / 8
    update = r["steps"]["update"]
    # XLA's per-device argument bytes: the state's shards plus the batch's shards
    assert update["argument"] == pytest.approx(r["state_bytes"] + batch_bytes, rel=0.02)
    assert update["argument"] < full / 4
    assert update["alias"] > 0.9 * r["state_bytes"]  # the state is donated (updated in place)
    assert update["temp"] > 0


def test_sampler_and_logprob_pass_compile_with_sharded_parameters(fsdp_result):
    r = fsdp_result
    assert set(r["steps"]) == {"update", "sampler", "logprobs"}
    params = r["params_bytes"]
    sampler = r["steps"]["sampler"]
    R, Lp = 64, 16
    # arguments: parameter shards + the prompt shards (tokens int32, mask bool) + the rng key
    assert sampler["argument"] == pytest.approx(params + R * Lp * 5 / 8 + 8, rel=0.02)
    assert r["ref_bytes"] == params  # kl_coef > 0: a frozen copy
    # while sampling, the optimizer moments and the reference stay resident
    assert sampler["resident_extra"] == (r["state_bytes"] - params) + r["ref_bytes"]
    assert r["peak"] == max(s["peak"] for s in r["steps"].values())
    assert r["batch"] == {
        "R": 64,
        "mini_batch": 16,
        "micro_batch": 16,
        "generate_batch": 64,
        "decode_slots": 0,
        "prompt_tokens": 16,
        "new_tokens": 16,
    }


def test_tensor_parallel_mesh_and_decode_only_sampler():
    c = tiny_dapo("4b,prompt_gdro,gpu8")  # fsdp 4 x tensor 2 (one GPU node)
    r = aot.compile_steps(c, sampler="decode", update=False, logprobs=False)
    assert r["mesh"] == {"data": 1, "fsdp": 4, "tensor": 2}
    assert set(r["steps"]) == {"prefill", "decode"}
    exp = build_experiment(c, with_data=False)
    full = _full_bytes(exp.abstract_state.params)
    assert r["params_bytes"] < full / 6  # 8-way: fsdp x tensor on the matrices
    # the decode call's arguments hold the whole KV cache shard: 2 layers x G/4 rows x 32 slots,
    # G = 64 rows per sampler call (Prompt-GDRO's R = 128 in 2 calls)
    G = 16 * 4
    assert r["batch"]["R"] == 2 * G and r["batch"]["generate_batch"] == G
    cache = 2 * 2 * (G // 4) * 32 * 2 * 16 * 2  # k+v, L, rows/shard, slots, kvh, hd, bf16
    assert r["steps"]["decode"]["argument"] >= cache


@pytest.mark.parametrize(
    "topology,chip,count",
    [
        ("v5p-8", "v5p", 4),
        ("v5p-512", "v5p", 256),
        ("v4-32", "v4", 16),
        ("v5e-16", "v5e", 16),
        ("v5litepod-8", "v5e", 8),
        ("v6e-8", "v6e", 8),
        ("8xh100", "h100", 8),
        ("h200x8", "h200", 8),
        ("4xa100-40", "a100-40", 4),
        ("h100-8", "h100", 8),
        ("h200-64", "h200", 64),
        ("b200-8", "b200", 8),
    ],
)
def test_topologies(topology, chip, count):
    c, n = aot.parse_topology(topology)
    assert c is aot.CHIPS[chip] and n == count


def test_bad_topology_names_the_accepted_forms():
    with pytest.raises(ValueError, match="v5p-8"):
        aot.parse_topology("tpu-9000")
    with pytest.raises(ValueError, match="TensorCores"):
        aot.parse_topology("v5p-3")


def test_verdict_and_advice():
    chip = aot.CHIPS["v5e"]
    assert aot.verdict(int(15 * aot.GiB), chip, 0.95) == "fits"
    assert aot.verdict(int(15.5 * aot.GiB), chip, 0.95) == "does not fit"
    result = {"steps": {"update": {"peak": 1, "what": "u"}, "logprobs": {"peak": 9, "what": "l"}}}
    assert "mini_batch_size" in aot.advice(result)
    result["steps"]["update"]["peak"] = 99
    assert "micro_batch" in aot.advice(result)


def test_cli_exits_non_zero_with_a_message_when_it_does_not_fit():
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.aot",
            "--config=configs/arithmetic.py:grpo,smoke",
            "--topology=v5e-8",
            "--compiler=cpu",  # the virtual-CPU path (tests/test_aot_tpu.py: the TPU compiler)
            "--mesh=1,-1,1",
            "--sampler=none",
            "--headroom=0.000001",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 1, out.stderr[-2000:]
    assert "does not fit on v5e-8" in out.stderr and "largest step" in out.stderr
    assert "'fsdp': 8" in out.stdout  # the CLI made 8 virtual devices
    np.testing.assert_equal("Traceback" in out.stderr, False)


def test_chip_table_maps_device_kinds_to_published_bandwidth():
    from experiments.aot import CHIPS, chip_of_device

    assert chip_of_device("NVIDIA H200").bandwidth_Bps == 4.8e12
    assert chip_of_device("NVIDIA H100 80GB HBM3").name == "NVIDIA H100 SXM"
    assert chip_of_device("TPU v5 lite").bandwidth_Bps == 819e9
    assert chip_of_device("cpu") is None
    for chip in CHIPS.values():  # every chip has a bandwidth, quoted on its source page
        assert chip.bandwidth_Bps > 0 and chip.device_kinds
        assert "GBps" in chip.source or "B/s" in chip.source, chip.source


def _synthetic_tpu_record():
    """A compiled-for-TPU result of a 1e9-parameter model on 2 v6e chips, with zero compiler
    counts, so every roofline term is the analytic one (computed by hand below)."""
    step = {"flops": 0.0, "bytes": 0.0, "peak": 2 * aot.GiB}
    return {
        "chip": "TPU v6e",
        "topology": "v6e-2",
        "devices": 2,
        "params": 10**9,
        "kv_bytes_per_row": 0,
        "peak": 3 * aot.GiB,
        "verdict": "fits",
        "batch": {
            "R": 4,
            "mini_batch": 2,
            "micro_batch": 2,
            "generate_batch": 4,
            "prompt_tokens": 2,
            "new_tokens": 2,
        },
        "steps": {
            "update": {**step, "rows": 2},
            "sampler": {**step, "rows": 4, "peak": 3 * aot.GiB},
            "logprobs": {**step, "rows": 4},
        },
    }


def test_roofline_and_maxtext_calibration_by_hand():
    r = _synthetic_tpu_record()
    est = aot.roofline(r, aot.CHIPS["v6e"])
    peak, bw, mt = 918e12, 1640e9, 0.4546  # v6e bf16 FLOP/s, HBM B/s, MaxText's v6e MFU
    update = 6 * 1e9 * 2 * 4 / 2 / peak  # 6 N x 2 rows x 4 tokens, over 2 devices
    logprobs = 2 * 1e9 * 4 * 4 / 2 / peak
    decode = 2 * (2 * 1e9) / bw  # 2 new tokens, each reading the 2-byte parameters
    np.testing.assert_allclose(est["step_seconds"], 2 * update + logprobs + decode, rtol=1e-9)
    assert est["steps"]["sampler"]["bound"] == "memory"
    # MaxText-calibrated: the update and log-prob passes at MaxText's MFU, decode unchanged
    cal = 2 * update / mt + logprobs / mt + decode
    np.testing.assert_allclose(est["maxtext_step_seconds"], cal, rtol=1e-9)
    flops = 2 * 6e9 * 2 * 4 + 2e9 * 4 * 4 + 2e9 * 4 * 4
    np.testing.assert_allclose(est["maxtext_mfu"], flops / (cal * 2 * peak), rtol=1e-9)
    assert "maxtext_step_seconds" not in aot.roofline(r, aot.CHIPS["h100"])  # no published MFU
    table = aot.tpu_table([r])
    assert "| 1.00B params | grpo / rollout_gdro | v6e-2 (2) | 1 sampler call of 4 |" in table
    assert "| 2.0 / 3.0 / 2.0 | fits, peak 3.0 |" in table


def test_gpu_topologies_are_whole_nodes_of_eight():
    assert aot.gpu_topology_name(2) == "1x1x2"
    assert aot.gpu_topology_name(8) == "1x1x8"
    assert aot.gpu_topology_name(16) == "1x2x8"
    assert aot.gpu_topology_name(64) == "1x8x8"
    with pytest.raises(ValueError, match="whole nodes"):
        aot.gpu_topology_name(12)
    assert aot.is_gpu_topology("h100-8") and aot.is_gpu_topology("8xh200")
    assert not aot.is_gpu_topology("v5p-8") and not aot.is_gpu_topology("nonsense")


def test_compiler_choice_names_the_missing_plugin(monkeypatch):
    monkeypatch.setattr(aot, "cuda_plugin_missing", lambda: "the CUDA plugin is not installed")
    with pytest.raises(cli.UsageError, match="CUDA plugin is not installed.*--compiler=cpu"):
        aot.choose_compiler("h100-8", "auto")
    assert aot.choose_compiler("h100-8", "cpu") == "cpu"  # the stand-in, asked for by name
    with pytest.raises(cli.UsageError, match="not a TPU slice"):
        aot.choose_compiler("h100-8", "tpu")
    with pytest.raises(cli.UsageError, match="not a GPU topology"):
        aot.choose_compiler("v5p-8", "gpu")
    monkeypatch.setattr(aot, "cuda_plugin_missing", lambda: "")
    assert aot.choose_compiler("b200-8", "auto") == "gpu"


def test_cudnn_attention_calls_counts_forward_and_backward_custom_calls():
    hlo = (
        '%a = custom-call(%p), custom_call_target="__cudnn$fmhaSoftmax", x\n'
        '%b = custom-call(%p), custom_call_target="__cudnn$fmhaSoftmaxBackward", y\n'
        '%c = custom-call(%p), custom_call_target="__cublas$gemm"\n'
    )
    assert aot.cudnn_attention_calls(hlo) == 2
    assert aot.cudnn_attention_calls("fusion(...) __cudnn$fmha in a comment") == 0


def test_gpu_table_row_by_hand():
    r = _synthetic_tpu_record()
    r.update(chip="NVIDIA H100 SXM", topology="h100-2", attention_impl="cudnn")
    r["mesh"] = {"data": 1, "fsdp": 2, "tensor": 1}
    r["steps"]["update"]["cudnn_fmha_calls"] = 3
    r["steps"]["sampler"]["cudnn_fmha_calls"] = 2
    r["steps"]["logprobs"]["cudnn_fmha_calls"] = 1
    est = aot.roofline(r, aot.CHIPS["h100"])
    peak, bw = 989e12, 3.35e12
    by_hand = 2 * (6e9 * 2 * 4 / 2) / peak + (2e9 * 4 * 4 / 2) / peak + 2 * 2e9 / bw
    np.testing.assert_allclose(est["step_seconds"], by_hand, rtol=1e-9)
    table = aot.gpu_table([r])
    assert (
        "| 1.00B params | grpo / rollout_gdro | h100-2 (2 x H100 SXM) | mesh 1 x 2 x 1, 1 sampler call of 4 | "
        "2.0 / 3.0 / 2.0 | fits, peak 3.0 | cudnn (3 / 2 / 1) |"
    ) in table


def test_continuous_batching_sampler_compiles_with_its_slots():
    c = tiny_dapo()
    c.rollout.decode_slots = 16  # 64 rows per sampler call through 16 decode rows
    r = aot.compile_steps(c, update=False, logprobs=False)
    s = r["steps"]["sampler"]
    assert "continuous batching" in s["what"] and "16 decode slots" in s["what"]
    R, Lp = 64, 16
    # parameter shards + prompt shards (int32 tokens, bool mask) + max_lengths (int32) + rng
    assert s["argument"] == pytest.approx(
        r["params_bytes"] + R * Lp * 5 / 8 + R * 4 / 8 + 8, rel=0.02
    )


def test_roofline_of_continuous_batching_reads_the_weights_once_per_slot_batch():
    """4 rows per sampler call through 2 decode slots: in the longest case 2 x new_tokens
    decode steps, each reading the bf16 weights and 2 slots' KV cache (by hand)."""
    r = _synthetic_tpu_record()
    r["kv_bytes_per_row"] = 10**8
    static = aot.roofline(r, aot.CHIPS["v6e"])["steps"]["sampler"]["seconds_per_call"]
    r["batch"]["decode_slots"] = 2
    cont = aot.roofline(r, aot.CHIPS["v6e"])["steps"]["sampler"]["seconds_per_call"]
    bw, new, dev = 1640e9, 2, 2
    np.testing.assert_allclose(static, new * (2e9 + 4 * 1e8 / dev) / bw, rtol=1e-9)
    np.testing.assert_allclose(cont, new * 2 * (2e9 + 2 * 1e8 / dev) / bw, rtol=1e-9)


def test_sampler_compiles_in_the_generation_layout_with_its_reshard():
    c = tiny_dapo()
    c.rollout.generation_layout = "4x2"  # rows over 4, the 2 kv heads (and 4 heads) over 2
    r = aot.compile_steps(c, update=False, logprobs=False)
    assert set(r["steps"]) == {"sampler", "reshard"}
    assert r["generation_layout"]["layout"] == "4x2"
    s, rs = r["steps"]["sampler"], r["steps"]["reshard"]
    assert "data x tensor 4 x 2" in s["what"]
    # the generation copy: every tensor-split matrix halved, the norms whole; more than the
    # training's FSDP shard (1/8 of the matrices), less than the whole model
    gen = r["generation_layout"]["param_bytes"]
    assert r["params_bytes"] < gen < 8 * r["params_bytes"]
    assert rs["output"] == pytest.approx(gen, rel=0.01)  # the compiler pads a few buffers
    assert rs["argument"] == pytest.approx(r["params_bytes"], rel=0.01)
    R, Lp = 64, 16  # parameters + prompt rows over 4 shards (int32 tokens + bool mask) + rng
    assert s["argument"] == pytest.approx(gen + R * Lp * 5 / 4 + 8, rel=0.02)
