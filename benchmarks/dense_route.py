"""The dense route (twell.kernels.dense) against eager and compiled dense, in pieces, at prefill shapes:
whether a dense-route call can be slower than the dense module it replaces (the down GEMM on the rows
layout sparsify stores, the fused activation against relu_ + mul_, the gate's bias: cuBLASLt's bias
epilogue in the route, a bias add Inductor may fuse into its pointwise kernel when compiled).

    cd benchmarks && PYTHONPATH=.. python dense_route.py [--shapes 2048x5632x131072,...]  # CUDA only
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(__file__))
from ffn import environment, result_path  # noqa: E402

from twell.kernels import dense  # noqa: E402

SHAPES = ((4096, 14336, 32768), (2048, 5632, 32768))


def bench(fn) -> float:
    return do_bench(fn, rep=300, return_mode="median")


def shape_times(k: int, n: int, m: int) -> dict:
    """Median ms of each piece at one shape."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    wg, wu = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(2))
    wd = torch.randn(k, n, device="cuda", dtype=torch.bfloat16) / n**0.5
    rows = wd.t().contiguous()  # [N, K]: the layout sparsify stores
    h = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    g, u = F.linear(x, wg), F.linear(x, wu)
    zero_k = torch.zeros(k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)

    def ffn_bias(x):  # ffn.py's module: a gate bias, none on up and down
        return F.linear(F.relu(F.linear(x, wg, bias)) * F.linear(x, wu), wd)

    compiled = torch.compile(ffn_bias)
    return {
        "eager_ffn": bench(lambda: F.linear(F.relu(F.linear(x, wg)) * F.linear(x, wu), wd)),
        "route_plain_down": bench(lambda: dense.gated_ffn_dense(x, wg, wu, wd, None, None, None, 0.0, False)),
        "route_rows_down": bench(lambda: dense.gated_ffn_dense(x, wg, wu, rows.t(), None, None, None, 0.0, False)),
        "down_gemm_plain": bench(lambda: F.linear(h, wd)),
        "down_gemm_rows": bench(lambda: F.linear(h, rows.t())),
        # the same product through addmm with a zero bias (cuBLASLt's bias epilogue: another kernel choice)
        "down_gemm_rows_addmm": bench(lambda: torch.addmm(zero_k, h, rows)),
        "gate_gemm": bench(lambda: F.linear(x, wg)),
        "act_mul": bench(lambda: dense.act_mul_(g, u, 0.0, drelu=False, square=False)),
        "relu_then_mul_eager": bench(lambda: g.relu_().mul_(u)),
        "eager_ffn_gate_bias": bench(lambda: ffn_bias(x)),
        "compiled_ffn_gate_bias": bench(lambda: compiled(x)),
        "route_rows_down_gate_bias": bench(
            lambda: dense.gated_ffn_dense(x, wg, wu, rows.t(), bias, None, None, 0.0, False)
        ),
        "gate_gemm_bias": bench(lambda: F.linear(x, wg, bias)),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES), help="KxNxM,...")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    torch.manual_seed(0)
    result = environment() | {"rows": []}
    for k, n, m in (map(int, s.split("x")) for s in args.shapes.split(",")):
        ms = shape_times(k, n, m)
        print(k, n, m, {key: round(v, 3) for key, v in ms.items()}, flush=True)
        result["rows"].append({"K": k, "N": n, "M": m, "ms": ms})
    path = result_path(args.out, "dense_route")
    path.write_text(json.dumps(result, indent=1))
    print(path)


if __name__ == "__main__":
    main()
