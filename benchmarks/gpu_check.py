"""Kernel variants on the GPU in one run: correctness at real shapes, then timings, a short table last.

    PYTHONPATH=. python benchmarks/gpu_check.py decode [--shapes 2048x5632,4096x14336]

Used to choose kernel configurations (the shipped ones are in the kernel files, with the result file
that chose them); benchmarks/ffn.py is the benchmark of record. Writes JSON to $OUT or
benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import triton
from ffn import GRAPH_MAX_M, git_commit, make_inputs, rel_err_sample, timed, weights

import twell
from twell.kernels import decode

DECODE_GATE_UP = [(16, 128, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 4), (16, 256, 4, 3), (32, 64, 4, 6)]
DECODE_DOWN = [(64, 8, 16, 4), (128, 8, 16, 4), (32, 8, 16, 4), (64, 4, 16, 4), (64, 16, 16, 4), (64, 8, 32, 4)]


def decode_point(k, n, m, density, gate_up_configs, down_configs) -> list[dict]:
    x, block = make_inputs(m, k, n, density, "uniform", seed=m + n)
    graph = m <= GRAPH_MAX_M
    with torch.no_grad():
        dense_ms = timed(lambda: block(x), graph)
        twell.sparsify(block)  # the layout users get
        w = weights(block)
        wd_t = w["down_weight"].t()
        rows = []
        for gu in gate_up_configs:
            for dn in down_configs:

                def run(gu=gu, dn=dn):
                    return decode.decode_ffn(
                        x, w["gate_weight"], w["gate_bias"], w["up_weight"], None, wd_t, None, 0.0,
                        gate_up_config=gu, down_config=dn,
                    )  # fmt: skip

                err = rel_err_sample(run(), x, block)
                ms = timed(run, graph)
                rows.append(
                    {"K": k, "N": n, "M": m, "density": density, "gate_up": gu, "down": dn, "dense_ms": dense_ms,
                     "decode_ms": ms, "speedup": dense_ms / ms, "rel_err": err}
                )  # fmt: skip
                print(
                    f"{k:>5} {n:>6} {m:>4} {density:.3f} {str(gu):>18} {str(dn):>16} {dense_ms * 1e3:8.1f}us "
                    f"{ms * 1e3:8.1f}us {dense_ms / ms:5.2f}x err {err:.1e}",
                    flush=True,
                )
        twell.restore(block)
    return rows


def first_call_seconds() -> dict:
    """Wall time of the first call of a new shape in this process (compilation and autotuning)."""
    out = {}
    for m in (1, 32768):
        x, block = make_inputs(m, 2048, 5632, 0.005, "uniform", seed=1)
        twell.sparsify(block)
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            block(x)
        torch.cuda.synchronize()
        out[f"M{m}"] = time.perf_counter() - start
        start = time.perf_counter()
        with torch.no_grad():
            block(x)
        torch.cuda.synchronize()
        out[f"M{m}_second"] = time.perf_counter() - start
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("part", choices=["decode"])
    parser.add_argument("--shapes", default="2048x5632,4096x14336")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": git_commit(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "part": args.part,
        "rows": [],
    }
    if args.part == "decode":
        result["first_call_s"] = first_call_seconds()
        print(result["first_call_s"], flush=True)
        for shape in args.shapes.split(","):
            k, n = map(int, shape.split("x"))
            for m in (1, 16, 64):
                result["rows"] += decode_point(k, n, m, 0.005, DECODE_GATE_UP, DECODE_DOWN[:1])
                best = min((r for r in result["rows"] if r["M"] == m and r["K"] == k), key=lambda r: r["decode_ms"])
                result["rows"] += decode_point(k, n, m, 0.005, [best["gate_up"]], DECODE_DOWN[1:])
            for m in (1, 16, 64, 128, 256):
                for density in (0.01, 0.02, 0.05):
                    result["rows"] += decode_point(k, n, m, density, [decode.GATE_UP_CONFIG], [decode.DOWN_CONFIG])
    out_dir = Path(os.environ["OUT"]) if "OUT" in os.environ else Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"gpu_check-{args.part}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
