"""Kernel variants on the GPU in one run: correctness at real shapes, then timings, a short table last.

    PYTHONPATH=. python benchmarks/gpu_check.py decode [--shapes 2048x5632,4096x14336]
    PYTHONPATH=. python benchmarks/gpu_check.py batched [--tokens 16,32,64,128,256]
        [--variants installed,calibrated,decode]

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
import torch.nn.functional as F
import triton
from ffn import LAYERS_PER_GRAPH, git_commit, make_inputs, neuron_permuted, rel_err_sample, timed, weights
from triton.testing import do_bench

import twell
from twell.kernels import decode, gate, policy, updown
from twell.kernels.gate import pack_dense

# decode_ffn keyword arguments to compare ({}: the launcher's choice), per tokens per call, each timed at
# 0.5%, 1% and 5%: (BLOCK_K, SPLITS, CHUNK, SPLIT_MIN, num_warps) of the down kernel (decode.DOWN_CONFIG);
# prefetch=False: kernel 1 leaves the W_d rows in HBM.
# down_rows=False: one token by the list (ids, hc, counts) instead of block rows (the choice at K <= 2048).
# pipeline: neuron blocks a kernel-1 program, each block's up rows read with the next block's gate, at the
# launcher's BLOCK_N 64 and at 32 / 16; programs a token block at N=5632 / 14336: 44 / 112 (64, 2),
# 88 / 224 (32, 2), 118 / 299 (16, 3), 44 / 112 (32, 4), against 88 / 224 for one block a program.
PIPELINES = [
    {"pipeline": 2},
    {"pipeline": 2, "gate_up_config": (32, 128, 4, 4, False)},
    {"pipeline": 3, "gate_up_config": (16, 128, 4, 4, False)},
    {"pipeline": 4, "gate_up_config": (32, 128, 4, 4, False)},
]
DECODE_VARIANTS = {1: [{}, {"down_rows": False}], 16: [{}, *PIPELINES], 64: [{}, *PIPELINES]}


def decode_point(k, n, m, density, variants, pattern) -> list[dict]:
    """Each variant (decode_ffn keyword arguments: configs; {}: the launcher's choice) of the decode
    kernels at one point, timed per layer of a graph over LAYERS_PER_GRAPH layers (as benchmarks/ffn.py
    times decode-sized calls), dense the same way."""
    x, block = make_inputs(m, k, n, density, pattern, seed=m + n)
    blocks = [block] + [neuron_permuted(block, i) for i in range(1, LAYERS_PER_GRAPH)]

    def per_layer(fn):
        return timed(lambda: [fn(b) for b in blocks], True) / len(blocks)

    with torch.no_grad():
        dense_ms = per_layer(lambda b: b(x))
        for b in blocks:
            twell.sparsify(b)  # the layout users get
        ws = {id(b): weights(b) for b in blocks}
        rows = []
        for variant in variants:

            def run(b, variant=variant):
                w = ws[id(b)]
                return decode.decode_ffn(
                    x, w["gate_weight"], w["gate_bias"], w["up_weight"], None, w["down_weight"].t(), None, 0.0,
                    **variant,
                )  # fmt: skip

            try:
                err = rel_err_sample(run(block), x, block)
                ms = per_layer(run)
                kernels = graph_kernel_us(lambda: [run(b) for b in blocks]) if density == 0.005 else None
            except Exception as e:  # a config the compiler refuses (shared memory, registers)
                print(f"{variant}: {type(e).__name__}", flush=True)
                continue
            rows.append(
                {"K": k, "N": n, "M": m, "density": density, "variant": variant, "dense_ms": dense_ms,
                 "decode_ms": ms, "speedup": dense_ms / ms, "rel_err": err}
            )  # fmt: skip
            if kernels is not None:  # each kernel's time in the graph, summed over its layers
                rows[-1]["kernels_us"] = kernels
            print(
                f"{k:>5} {n:>6} {m:>4} {density:.3f} {str(variant):>60} {dense_ms * 1e3:8.1f}us "
                f"{ms * 1e3:8.1f}us {dense_ms / ms:5.2f}x err {err:.1e}",
                flush=True,
            )
    return rows


def floor_bytes(k, n, m, union) -> int:
    """A sparse FFN call's bytes floor (bf16): W_g once, the union's rows of W_u and W_d, x and y."""
    return 2 * (n * k + 2 * union * k + 2 * m * k)


VARIANTS = ("installed", "calibrated", "decode")


def batched_point(k, n, m, density, pattern, only=None) -> list[dict]:
    """Calls of m tokens (serving steps), per layer of a graph over LAYERS_PER_GRAPH layers: dense; the
    module as sparsify installs it ("installed"), and with the LayerConfig calibration gives a layer of
    this density and K ("calibrated": policy.calibrated_decode_max_m); the decode kernels forced
    ("decode": decode_ffn). Each with the bytes floor and the union it met, and at 0.5% the time of each
    kernel of dense and of the variant in the graph. only: the variant names to time (None: all)."""
    x, block = make_inputs(m, k, n, density, pattern, seed=m + n)
    blocks = [block] + [neuron_permuted(block, i) for i in range(1, LAYERS_PER_GRAPH)]

    def per_layer(fn):
        return timed(lambda: [fn(b) for b in blocks], True) / len(blocks)

    rows = []
    with torch.no_grad():
        dense_ms = per_layer(lambda b: b(x))
        dense_kernels = graph_kernel_us(lambda: [b(x) for b in blocks]) if density == 0.005 else None
        for b in blocks:
            twell.sparsify(b)
        ws = {id(b): weights(b) for b in blocks}
        w = ws[id(block)]
        kept = F.linear(x, w["gate_weight"], w["gate_bias"]) > 0
        union = int(kept.any(0).sum())
        floor = floor_bytes(k, n, m, union)

        def args(b):
            w = ws[id(b)]
            return (x, w["gate_weight"], w["gate_bias"], w["up_weight"], None, w["down_weight"].t(), None, 0.0)

        calibrated = {"decode_max_m": policy.calibrated_decode_max_m(density, k)}
        calls = [
            ("installed", lambda b: b(x)),
            ("calibrated", lambda b: b(x)),
            ("decode", lambda b: decode.decode_ffn(*args(b))),
        ]
        if only is not None:
            calls = [(name, call) for name, call in calls if name in only]
        for name, call in calls:
            configured = [twell.configure(b, **calibrated) for b in blocks] if name == "calibrated" else []
            try:
                err = rel_err_sample(call(block), x, block)
                ms = per_layer(call)
                kernels = graph_kernel_us(lambda c=call: [c(b) for b in blocks]) if density == 0.005 else None
            finally:
                for c in configured:
                    c.__exit__(None, None, None)
            row = {"K": k, "N": n, "M": m, "density": density, "pattern": pattern, "variant": name,
                   "dense_ms": dense_ms, "ms": ms, "speedup": dense_ms / ms, "rel_err": err, "union": union,
                   "floor_bytes": floor, "tb_s_of_floor": floor / ms / 1e9}  # fmt: skip
            if kernels is not None:
                row["kernels_us"], row["dense_kernels_us"] = kernels, dense_kernels
            if name == "calibrated":
                row["layer_config"] = calibrated
            rows.append(row)
            print(
                f"{k:>5} {n:>6} {m:>4} {density:.3f} union {union / n:6.1%} {name:>10} dense {dense_ms * 1e3:7.1f}us"
                f" {ms * 1e3:7.1f}us {dense_ms / ms:5.2f}x floor {floor / 1e6:6.1f} MB ({floor / ms / 1e9:4.2f} TB/s)"
                f" err {err:.1e}",
                flush=True,
            )
    return rows


def gate_point(k, n, m) -> list[dict]:
    """The gate GEMM with the TwELL epilogue (each config, two tile widths) against cuBLAS alone and
    cuBLAS + the pack pass; then the up+down kernel on its output."""
    x, block = make_inputs(m, k, n, 0.005, "uniform", seed=m + n)
    twell.sparsify(block)  # W_down in the layout the kernels read
    w = weights(block)
    wg, bg = w["gate_weight"], w["gate_bias"]
    rows = []
    with torch.no_grad():
        cublas_ms = do_bench(lambda: F.linear(x, wg, bg), return_mode="median")
        pre = F.linear(x, wg, bg)
        tile_n, slots = block.mlp.layer_config.tile_n, block.mlp.layer_config.slots
        ref = pack_dense(pre, 0.0, tile_n, slots)
        pack_ms = do_bench(lambda t=tile_n, s=slots: pack_dense(pre, 0.0, t, s), return_mode="median")
        for config in gate.PACK_CONFIGS:
            ms = do_bench(lambda c=config: pack_dense(pre, 0.0, tile_n, slots, config=c), return_mode="median")
            same = (pack_dense(pre, 0.0, tile_n, slots, config=config)[1] == ref[1]).float().mean().item()
            rows.append({"K": k, "N": n, "M": m, "tile_n": tile_n, "pack_config": config, "pack_ms": ms})
            print(f"{k:>5} {n:>6} {m:>6} pack {str(config):>22} {ms:6.3f} ms, counts agree {same:.5f}", flush=True)
        for config in gate.GATE_CONFIGS:
            try:
                out = gate.gate_twell(x, wg, bg, 0.0, tile_n, slots, config=config)
                ms = do_bench(
                    lambda t=tile_n, s=slots, c=config: gate.gate_twell(x, wg, bg, 0.0, t, s, config=c),
                    return_mode="median",
                )
            except Exception as e:  # a config the compiler refuses (shared memory, registers)
                print(f"{tile_n} {config}: {type(e).__name__}", flush=True)
                continue
            same_counts = (out[1] == ref[1]).float().mean().item()
            row = {
                "K": k,
                "N": n,
                "M": m,
                "tile_n": tile_n,
                "config": config,
                "cublas_ms": cublas_ms,
                "pack_ms": pack_ms,
                "fused_ms": ms,
                "vs_cublas": cublas_ms / ms,
                "same_counts": same_counts,
            }
            rows.append(row)  # fmt: skip
            print(
                f"{k:>5} {n:>6} {m:>6} tile {tile_n:>3} {str(config):>22} cuBLAS {cublas_ms:6.3f} +pack "
                f"{pack_ms:6.3f} fused {ms:6.3f} ({cublas_ms / ms:4.2f}x cuBLAS) counts agree {same_counts:.5f}",
                flush=True,
            )
        words, counts = ref
        up_ms = do_bench(
            lambda t=tile_n, v=words, c=counts: updown.twell_up_down(
                x, v, c, wg, bg, w["up_weight"], None, w["down_weight"].t(), None, tile_n=t, threshold=0.0
            ),
            return_mode="median",
        )
        tb_s = int(counts.sum()) * 4 * k / up_ms / 1e9
        rows.append({"K": k, "N": n, "M": m, "tile_n": tile_n, "updown_ms": up_ms, "updown_tb_s": tb_s})
        overflow = int((counts > slots).sum())
        print(f"{k:>5} {n:>6} {m:>6} tile {tile_n:>3} up+down: {up_ms:6.3f} ms "
              f"({tb_s:4.1f} TB/s of weight rows), overflow tiles {overflow}", flush=True)  # fmt: skip
    return rows


def kernel_times(k, n, m, pattern, layer_config=None) -> dict:
    """Mean CUDA time of each kernel of the sparsified module's call (torch.profiler, 50 eager calls):
    where the time of a path goes, launch gaps excluded. layer_config: sparsify's (LayerConfig changes)."""
    x, block = make_inputs(m, k, n, 0.005, pattern, seed=m + n)
    twell.sparsify(block, layer_config=layer_config)
    with torch.no_grad():
        for _ in range(3):
            block(x)
        torch.cuda.synchronize()
        times = profiled_us(lambda: block(x), 50)
    print(f"{k}x{n} M={m} {pattern}: " + ", ".join(f"{name} {us:.1f}us" for name, us in times.items()), flush=True)
    return {"K": k, "N": n, "M": m, "pattern": pattern, "kernel_us": times}


def profiled_us(call, calls) -> dict:
    """Mean CUDA time of each kernel per call() (torch.profiler over `calls` calls), by kernel name."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if us:
            times[event.key[:60]] = us / calls
    return times


def graph_kernel_us(fn, replays=20) -> dict:
    """Mean CUDA time per replay of each kernel of fn captured in one CUDA graph: the kernels' own
    durations where the graph runs them, launch gaps excluded."""
    fn()
    graph_obj = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph_obj):
        fn()
    for _ in range(3):
        graph_obj.replay()
    torch.cuda.synchronize()
    return profiled_us(graph_obj.replay, replays)


def floors_point(k, n, m, pattern) -> dict:
    """Per layer of an 8-layer graph at 0.5% (`pattern`): dense, cuBLAS's gate GEMV alone and with its
    ReLU, two tiny kernels (the cost of a launch in a graph), the decode kernels, the decode kernels
    without the up phase (non-gated: gate GEMV + down), and each kernel's time inside the graph."""
    x, block = make_inputs(m, k, n, 0.005, pattern, seed=m + n)
    blocks = [block] + [neuron_permuted(block, i) for i in range(1, LAYERS_PER_GRAPH)]

    def per_layer(fn):
        return timed(lambda: [fn(b) for b in blocks], True) / len(blocks) * 1e3

    out = {"K": k, "N": n, "M": m, "pattern": pattern}
    with torch.no_grad():
        out["dense_us"] = per_layer(lambda b: b(x))
        out["dense_kernels_us"] = graph_kernel_us(lambda: [b(x) for b in blocks])
        for b in blocks:
            twell.sparsify(b)
        ws = {id(b): weights(b) for b in blocks}
        small = torch.zeros(k, device="cuda")
        out["two_tiny_kernels_us"] = per_layer(lambda b: small.add(1.0).mul(2.0))
        out["cublas_gate_us"] = per_layer(lambda b: F.linear(x, ws[id(b)]["gate_weight"], ws[id(b)]["gate_bias"]))
        out["cublas_gate_relu_us"] = per_layer(
            lambda b: F.relu(F.linear(x, ws[id(b)]["gate_weight"], ws[id(b)]["gate_bias"]))
        )

        def run(b, up=True, rows=None):
            w = ws[id(b)]
            return decode.decode_ffn(
                x, w["gate_weight"], w["gate_bias"], w["up_weight"] if up else None, None, w["down_weight"].t(),
                None, 0.0, down_rows=rows,
            )  # fmt: skip

        out["decode_us"] = per_layer(run)
        out["decode_no_up_us"] = per_layer(lambda b: run(b, up=False))
        out["decode_kernels_us"] = graph_kernel_us(lambda: [run(b) for b in blocks])
        if m == 1:  # the other one-token path
            rows = k > 2048
            out[f"decode_rows_{rows}_us"] = per_layer(lambda b: run(b, rows=rows))
            out[f"decode_rows_{rows}_kernels_us"] = graph_kernel_us(lambda: [run(b, rows=rows) for b in blocks])
    print(json.dumps(out), flush=True)
    return out


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
    parser.add_argument("part", choices=["decode", "batched", "first-call", "prefill", "profile", "floors"])
    parser.add_argument("--shapes", default="2048x5632,4096x14336")
    parser.add_argument("--pattern", default="exact", help="decode and floors inputs (ffn.py's patterns)")
    parser.add_argument("--tokens", default=None, help="floors (default 1,16,64), batched (16,32,64,128,256)")
    parser.add_argument("--densities", default="0.005,0.01,0.05", help="batched")
    parser.add_argument("--variants", default=None, help=f"batched: only these of {VARIANTS} (comma-separated)")
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
    out_dir = Path(os.environ["OUT"]) if "OUT" in os.environ else Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"gpu_check-{args.part}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    if args.part == "first-call":
        result["first_call_s"] = first_call_seconds()
        print(result["first_call_s"], flush=True)
    elif args.part == "decode":
        for shape in args.shapes.split(","):
            k, n = map(int, shape.split("x"))
            for m, variants in DECODE_VARIANTS.items():
                for density in (0.005, 0.01, 0.05):
                    result["rows"] += decode_point(k, n, m, density, variants, args.pattern)
            path.write_text(json.dumps(result, indent=1))  # kept if a later shape runs out of time
    elif args.part == "batched":
        for shape in args.shapes.split(","):
            k, n = map(int, shape.split("x"))
            for m in map(int, (args.tokens or "16,32,64,128,256").split(",")):
                for density in map(float, args.densities.split(",")):
                    only = args.variants.split(",") if args.variants else None
                    result["rows"] += batched_point(k, n, m, density, args.pattern, only=only)
                path.write_text(json.dumps(result, indent=1))  # kept if a later point runs out of time
    elif args.part == "floors":
        for shape in args.shapes.split(","):
            k, n = map(int, shape.split("x"))
            for m in map(int, (args.tokens or "1,16,64").split(",")):
                result["rows"].append(floors_point(k, n, m, args.pattern))
    elif args.part == "profile":
        for k, n, m, pattern in ((2048, 5632, 1, "uniform"), (2048, 5632, 16, "uniform"), (4096, 14336, 16, "uniform")):
            # the decode kernels, whatever the shipped threshold
            result["rows"].append(kernel_times(k, n, m, pattern, {"decode_max_m": m} if m > 8 else None))
    else:
        for k, n, m in ((2048, 5632, 131072), (4096, 14336, 65536)):
            result["rows"] += gate_point(k, n, m)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
