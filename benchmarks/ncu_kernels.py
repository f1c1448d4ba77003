"""One call of twell's kernels inside a profiler range, for Nsight Compute (the device has `ncu`).

    PYTHONPATH=. ncu --clock-control none --profile-from-start off --set full -o OUT/prof \\
        python benchmarks/ncu_kernels.py decode --tokens 16 1
    ncu --import OUT/prof.ncu-rep --page details > OUT/details.txt

Cases: `decode` (the two decode kernels at each --tokens), `pack` (the pack pass of a cuBLAS gate,
--rows tokens), `updown` (the prefill up+down stage after that pack). Inputs are random with a gate
bias that keeps --density of the gate outputs (g ~ N(0, 1) before the bias), so no weight file is
needed. Every kernel runs three times before the range (Triton compiles and autotunes there), once
inside it. ncu flushes caches before each profiled kernel by default: its durations are cold-cache
ones, longer than a CUDA-graph replay's (benchmarks/gpu_check.py times those).
"""

from __future__ import annotations

import argparse
from statistics import NormalDist

import torch

from twell.kernels.decode import decode_ffn
from twell.kernels.gate import pack_dense
from twell.kernels.updown import twell_up_down


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("case", choices=["decode", "pack", "updown"])
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--n", type=int, default=5632)
    parser.add_argument("--density", type=float, default=0.005)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16], help="decode: tokens per call")
    parser.add_argument("--rows", type=int, default=131072, help="pack, updown: tokens")
    parser.add_argument("--tile", type=int, nargs=2, default=[128, 16], metavar=("TILE_N", "SLOTS"))
    args = parser.parse_args()
    torch.manual_seed(0)
    dev, dt, k, n = "cuda", torch.bfloat16, args.k, args.n
    wg, wu = ((torch.randn(n, k, device=dev) / k**0.5).to(dt) for _ in range(2))
    wd_t = (torch.randn(n, k, device=dev) / n**0.5).to(dt)
    bg = torch.full((n,), -NormalDist().inv_cdf(1 - args.density), device=dev, dtype=dt)
    tile_n, slots = args.tile
    if args.case == "decode":
        xs = [torch.randn(m, k, device=dev, dtype=dt) for m in args.tokens]
        calls = [lambda x=x: decode_ffn(x, wg, bg, wu, None, wd_t, None, 0.0) for x in xs]
    else:
        x = torch.randn(args.rows, k, device=dev, dtype=dt)
        gate = torch.addmm(bg, x, wg.t())
        if args.case == "pack":
            calls = [lambda: pack_dense(gate, 0.0, tile_n, slots)]
        else:
            packed = pack_dense(gate, 0.0, tile_n, slots)
            del gate
            calls = [lambda: twell_up_down(x, *packed, wg, bg, wu, None, wd_t, None, tile_n=tile_n, threshold=0.0)]
    for _ in range(3):
        for call in calls:
            call()
    torch.cuda.synchronize()
    cudart = torch.cuda.cudart()
    cudart.cudaProfilerStart()
    for call in calls:
        call()
    torch.cuda.synchronize()
    cudart.cudaProfilerStop()


if __name__ == "__main__":
    main()
