"""One call of twell's kernels inside a profiler range, for Nsight Compute (the device has `ncu`).

    PYTHONPATH=. ncu --clock-control none --profile-from-start off --set full -o OUT/prof \\
        python benchmarks/ncu_kernels.py decode --tokens 16 1
    ncu --import OUT/prof.ncu-rep --page details > OUT/details.txt

Cases: `decode` (the two decode kernels at each --tokens), `pack` (the pack pass of a cuBLAS gate,
--rows tokens), `updown` (the prefill up+down stage after that pack), `train` (the sparse training
path's forward and backward over --rows tokens, as the op runs them with no hot neurons: pick a kernel
with ncu's `-k regex:_train_dw`). Inputs: benchmarks/ffn.py's
make_inputs, --pattern at --density. Every kernel runs three times before the range (Triton compiles
and autotunes there), once inside it. ncu flushes caches before each profiled kernel by default: its
durations are cold-cache ones, longer than a CUDA-graph replay's (benchmarks/gpu_check.py times those).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

from twell.kernels import backward, policy
from twell.kernels.decode import decode_ffn
from twell.kernels.gate import pack_dense
from twell.kernels.updown import twell_up_down

sys.path.insert(0, os.path.dirname(__file__))
from ffn import make_inputs, weights  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("case", choices=["decode", "pack", "updown", "train"])
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--n", type=int, default=5632)
    parser.add_argument("--density", type=float, default=0.005)
    parser.add_argument("--pattern", choices=["exact", "uniform", "skewed"], default="uniform")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16], help="decode: tokens per call")
    parser.add_argument("--rows", type=int, default=131072, help="pack, updown, train: tokens")
    parser.add_argument("--tile", type=int, nargs=2, default=[128, 16], metavar=("TILE_N", "SLOTS"))
    args = parser.parse_args()
    tile_n, slots = args.tile

    def inputs(m):
        x, block = make_inputs(m, args.k, args.n, args.density, args.pattern)
        w = weights(block)
        wd_t = w["down_weight"].t().contiguous()  # the layout sparsify stores: unit stride on K
        return x, w["gate_weight"], w["gate_bias"], w["up_weight"], wd_t

    if args.case == "decode":
        calls = []
        for m in args.tokens:
            x, wg, bg, wu, wd_t = inputs(m)
            calls.append(lambda x=x, wg=wg, bg=bg, wu=wu, wd_t=wd_t: decode_ffn(x, wg, bg, wu, None, wd_t, None, 0.0))
    elif args.case == "train":
        x, wg, bg, wu, wd_t = inputs(args.rows)
        dy, l1_grad = torch.randn_like(x), torch.ones(1, device=x.device)
        flags = {"threshold": 0.0, "drelu": False, "square": False}

        def step():
            y, ids, gate, up, counts, *_ = backward.train_forward(
                x, wg, bg, wu, None, wd_t, None, width=policy.train_width(wg.shape[0]), forward_pack=True, **flags
            )
            backward.train_backward(dy, l1_grad, x, wg, bg, wu, None, wd_t, False, ids, gate, up, counts, **flags)

        calls = [step]
    else:
        x, wg, bg, wu, wd_t = inputs(args.rows)
        gate = F.linear(x, wg, bg)
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
