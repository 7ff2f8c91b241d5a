"""The machine's float32 matmul peak and read bandwidth, for run_all.py's floor (issue #10).

  python benchmarks/peers/machine_bounds.py --out=/tmp/bounds.json

Run with grpo_jax's venv, in its own process (run_all.py calls it before the first system and
after the last, so the harness's own process never imports jax). The measurements are the
benchmarks' own functions, imported: `bench_step.matmul_peak` (best of 10 jitted 2048 x 2048
float32 matmuls) and `bench_decode.read_bandwidth` (best of a jitted float32 sum over 1 GiB and
numpy's). Given the workload (`--prompt_len` > 0, as run_all.py passes it), it also times
grpo_jax's dense matmuls of one step at their own shapes (`bench_matmul_floor.measure`, the
converted checkpoint's sizes): the step's floor with this backend's matmul kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common

sys.path.insert(0, os.path.join(common.REPO, "benchmarks"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt_len", type=int, default=0, help="0: no matmul floor")
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--micro_batch", type=int, default=8, help="rows per micro-batch")
    parser.add_argument("--kl_coef", type=float, default=0.001, help="0: no reference pass")
    args = parser.parse_args(argv)
    load = os.getloadavg()
    t0 = time.time()
    import jax
    from bench_decode import read_bandwidth
    from bench_step import matmul_peak

    peak = matmul_peak(dtype="float32")
    bw = read_bandwidth()
    result = {
        "matmul_peak_flops": peak,
        "read_bandwidth_Bps": bw["best"],
        "read_bandwidth": bw,
        "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t0)),
        "wall_s": time.time() - t0,
        "loadavg_start": list(load),
        "device": str(jax.devices()[0]),
        "jax": jax.__version__,
    }
    if args.prompt_len > 0:
        import bench_matmul_floor

        sizes = bench_matmul_floor.dims(types.SimpleNamespace(**common.model_shape()))
        try:  # the peak and bandwidth above are kept whatever happens here
            result["matmul_floor"] = bench_matmul_floor.measure(
                sizes,
                args.prompts,
                args.samples,
                args.prompt_len,
                args.max_new_tokens,
                args.micro_batch,
                peak=peak,
                reference=args.kl_coef > 0,
            )
        except Exception as e:  # recorded in the JSON and the log, not fatal
            result["matmul_floor_failed"] = f"{type(e).__name__}: {e}"
            print(f"[machine_bounds] matmul floor not measured: {e}", flush=True)
        else:
            total = result["matmul_floor"]["total"]
            print(
                f"[machine_bounds] grpo_jax's dense matmuls of one step at their own shapes: "
                f"{total['matmul_s']:.1f} s ({total['matmul_s_at_peak']:.1f} s at the peak)",
                flush=True,
            )
        result["wall_s"] = time.time() - t0
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
