"""Host time of one prefill call: what an eager call spends on the CPU before its kernels run.

Run on a GPU:  PYTHONPATH=. python benchmarks/host_time.py [--ms 4096,8192] [--shape 2048x5632]
For each token count, on ffn.py's FFN module (uniform 0.5%) after twell.sparsify with the prefill
path forced: the host time per call (calls issued back to back, the GPU kept busy by a long kernel
queued first, so no call waits for the device), the GPU time per call (CUDA-graph replay), the same
for the dense module, and a cProfile of the host side (top functions by own time). JSON to
benchmarks/results/ (or $OUT).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch
from ffn import environment, make_inputs, result_path, timed

import twell
from twell.kernels import dispatch

CALLS = 20


def host_ms(fn) -> float:
    """Median host time of one call, with the GPU busy (a ~50 ms sleep kernel queued first)."""
    samples = []
    for _ in range(5):
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)  # ~50 ms of GPU time: the calls below queue behind it
        start = time.perf_counter()
        for _ in range(CALLS):
            fn()
        samples.append((time.perf_counter() - start) / CALLS * 1e3)
    torch.cuda.synchronize()
    return sorted(samples)[len(samples) // 2]


def profile(fn, top: int = 25) -> str:
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(CALLS):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def point(m: int, k: int, n: int, pattern: str) -> dict:
    x, block = make_inputs(m, k, n, 0.005, pattern, seed=m + n)
    call = lambda: block(x)  # noqa: E731
    row = {"K": k, "N": n, "M": m, "pattern": pattern}
    with torch.no_grad():
        row["dense_host_ms"] = host_ms(call)
        row["dense_gpu_ms"] = timed(call, True)
        twell.sparsify(block)
        with twell.configure(block, route="prefill"):
            dispatch.forget_layers()
            call()
            torch.cuda.synchronize()
            row["twell_host_ms"] = host_ms(call)
            row["twell_gpu_ms"] = timed(call, True)
            row["twell_eager_ms"] = timed(call, False)
            row["profile"] = profile(call)
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ms", default="4096,8192")
    parser.add_argument("--shape", default="2048x5632")
    parser.add_argument("--pattern", default="uniform")
    args = parser.parse_args()
    k, n = map(int, args.shape.split("x"))
    result = {**environment(), "calls": CALLS, "points": []}
    for m in map(int, args.ms.split(",")):
        row = point(m, k, n, args.pattern)
        result["points"].append(row)
        print({key: v for key, v in row.items() if key != "profile"})
        print(row["profile"])
    path = result_path("benchmarks/results", "host_time")
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
