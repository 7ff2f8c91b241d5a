"""The machine's float32 matmul peak and read bandwidth, for run_all.py's floor (issue #10).

  python benchmarks/peers/machine_bounds.py --out=/tmp/bounds.json

Run with grpo_jax's venv, in its own process (run_all.py calls it before the first system and
after the last, so the harness's own process never imports jax). The measurements are the
benchmarks' own functions, imported: `bench_step.matmul_peak` (best of 10 jitted 2048 x 2048
float32 matmuls) and `bench_decode.read_bandwidth` (best of a jitted float32 sum over 1 GiB and
numpy's).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common

sys.path.insert(0, os.path.join(common.REPO, "benchmarks"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="")
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
    print(
        f"[machine_bounds] float32 matmul peak {peak / 1e9:.1f} GFLOP/s, read bandwidth "
        f"{bw['best'] / 1e9:.1f} GB/s (jitted sum {bw['jax_sum'] / 1e9:.1f}, numpy "
        f"{bw['numpy_sum'] / 1e9:.1f})",
        flush=True,
    )
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
