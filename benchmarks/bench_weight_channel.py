"""The weight channel's cost: publish (copy into the wire layout) and fetch (one pull) times.

Two processes on this host under one `jax.distributed` job (1 CPU device each): process 0
publishes a params tree of ``--mib`` MiB of bfloat16 (``--leaves`` equal matrices) ``--repeats``
times; process 1 fetches each version with `WeightSubscriber.fetch`. Reported by process 1: the
median publish time (process 0's, read from the key-value store), the median fetch time and the
bytes per second of the fetch. Numbers are reported, never asserted; on CPU they measure the
engine's socket path on loopback, not DCN or a GPU/TPU fabric.

Run: PYTHONPATH=. python benchmarks/bench_weight_channel.py [--mib 64] [--leaves 16] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time


def _tree(mib: int, leaves: int, fill: float):
    import jax.numpy as jnp

    rows = mib * 2**20 // 2 // leaves // 1024
    return {f"w{i}": jnp.full((rows, 1024), fill + i, jnp.bfloat16) for i in range(leaves)}


def _worker(args) -> None:
    import jax

    from grpo_jax import distributed, weight_channel

    distributed.initialize("on", f"localhost:{args.port}", 2, args.process_id, timeout_s=60)
    kv = weight_channel.coordination_client()
    if args.process_id == 0:
        pub = weight_channel.WeightPublisher("bench", host="127.0.0.1", keep=args.repeats)
        for v in range(1, args.repeats + 1):
            params = jax.block_until_ready(_tree(args.mib, args.leaves, float(v)))
            t = time.perf_counter()
            pub.publish(params, v)
            kv.key_value_set(f"bench/publish_s/{v}", repr(time.perf_counter() - t))
        kv.blocking_key_value_get("bench/done", 600_000)
        pub.close()
    else:
        like = jax.eval_shape(lambda: _tree(args.mib, args.leaves, 0.0))
        sub = weight_channel.WeightSubscriber("bench", like, host="127.0.0.1", timeout_s=600)
        fetch = []
        for v in range(1, args.repeats + 1):
            sub.wait_for_version(v)
            t = time.perf_counter()
            sub.fetch(v)
            fetch.append(time.perf_counter() - t)
        publish = [
            float(kv.blocking_key_value_get(f"bench/publish_s/{v}", 60_000))
            for v in range(1, args.repeats + 1)
        ]
        kv.key_value_set("bench/done", "1")
        mb = args.mib * 2**20
        f, p = statistics.median(fetch), statistics.median(publish)
        print(
            f"{args.mib} MiB bf16 in {args.leaves} leaves, {args.repeats} versions: "
            f"publish {p * 1e3:.1f} ms, fetch {f * 1e3:.1f} ms ({mb / f / 1e9:.2f} GB/s)",
            flush=True,
        )
    jax.distributed.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--leaves", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--process_id", type=int, default=-1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.process_id >= 0:
        return _worker(args)
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, os.path.abspath(__file__), f"--port={port}"]
    cmd += [f"--mib={args.mib}", f"--leaves={args.leaves}", f"--repeats={args.repeats}"]
    procs = [subprocess.Popen([*cmd, f"--process_id={i}"], env=env) for i in range(2)]
    codes = [p.wait() for p in procs]
    sys.exit(max(codes))


if __name__ == "__main__":
    main()
