"""Kernel variants on the GPU in one run: correctness at real shapes, then timings, a short table last.

    PYTHONPATH=. python benchmarks/gpu_check.py decode [--shapes 2048x5632,4096x14336]
    PYTHONPATH=. python benchmarks/gpu_check.py batched [--tokens 16,32,64,128,256] [--sweep] [--stream-sweep]
        [--rows-sweep] [--variants installed,calibrated,decode,rows]

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
DECODE_VARIANTS = {
    1: [{}, {"down_rows": False}],
    16: [{}],
    64: [{}],
}


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
            except Exception as e:  # a config the compiler refuses (shared memory, registers)
                print(f"{variant}: {type(e).__name__}", flush=True)
                continue
            rows.append(
                {"K": k, "N": n, "M": m, "density": density, "variant": variant, "dense_ms": dense_ms,
                 "decode_ms": ms, "speedup": dense_ms / ms, "rel_err": err}
            )  # fmt: skip
            print(
                f"{k:>5} {n:>6} {m:>4} {density:.3f} {str(variant):>60} {dense_ms * 1e3:8.1f}us "
                f"{ms * 1e3:8.1f}us {dense_ms / ms:5.2f}x err {err:.1e}",
                flush=True,
            )
    return rows


def batched_floor_bytes(k, n, m, union) -> int:
    """The batched decode's bytes floor (bf16): W_g once, the union's rows of W_u and W_d, x and y."""
    return 2 * (n * k + 2 * union * k + 2 * m * k)


def batched_variants(m, sweep, stream_sweep=False, rows_sweep=False) -> list[tuple[str, dict]]:
    """(name, batched_decode_ffn keyword arguments) to time at m tokens: the launcher's choice (the walk
    design), the stream design (its partials summed by the last arrival, and by the sum kernel) and the
    rows design; with rows_sweep the rows design's BLOCK_N / CH / UP_K / DOWN_K / SPLITS / warps / stages and a
    partials cap of 32 MB; with
    sweep the walk's up kernel BLOCK_N, down WALK / STEPS around its table and a wider partials cap; with
    stream_sweep the stream design's up BLOCK_N / BLOCK_K / CH / stages / K_SPLITS and down BLOCK_K / GROUP /
    CHUNK."""
    bucket = decode._batched_bucket(m)
    up, down = decode.STREAM_UP_CONFIG[bucket], decode.STREAM_DOWN_CONFIG[bucket]
    variants = [
        ("batched", {}),
        ("stream", {"design": "stream"}),
        ("stream sum-kernel", {"design": "stream", "down_config": (*down[:4], not down[4])}),
        ("rows", {"design": "rows"}),
    ]
    if rows_sweep:
        rows = decode.ROWS_CONFIG[bucket]
        rows_sweep = (
            ("BLOCK_N", 1, (32, 64, 128, 256)),
            ("CH", 2, (16, 64)),
            ("UP_K", 3, (256, 1024)),
            ("DOWN_K", 4, (64, 256, 512)),
            ("SPLITS", 5, (1, 2, 4, 8)),
            ("warps", 6, (4,)),
            ("stages", 7, (2, 4)),
        )
        for name, i, values in rows_sweep:
            for value in values:
                if value != rows[i]:
                    changed = {"design": "rows", "up_config": (*rows[:i], value, *rows[i + 1 :])}
                    if name == "BLOCK_N":  # as named: no partials cap widening it
                        changed["max_parts_bytes"] = 1 << 40
                    variants.append((f"rows {name} {value}", changed))
        variants.append(("rows partials cap 32 MB", {"design": "rows", "max_parts_bytes": 32 << 20}))
    if stream_sweep:
        up_sweep = (
            ("BLOCK_N", 1, (32, 128)),
            ("BLOCK_K", 2, (128, 256, 512)),
            ("stages", 5, (2, 4)),
            ("CH", 3, (16, 32)),
            ("K_SPLITS", 6, (1, 4, 8)),
        )
        for name, i, values in up_sweep:
            for value in values:
                if value != up[i]:
                    changed = (*up[:i], value, *up[i + 1 :])
                    variants.append((f"stream up {name} {value}", {"design": "stream", "up_config": changed}))
        for name, i, values in (("BLOCK_K", 0, (32, 128)), ("GROUP", 1, (4, 16)), ("CHUNK", 2, (64, 128))):
            for value in values:
                if value != down[i]:
                    changed = (*down[:i], value, *down[i + 1 :])
                    variants.append((f"stream down {name} {value}", {"design": "stream", "down_config": changed}))
    if not sweep:
        return variants
    bucket = decode._batched_bucket(m)
    up, down = decode.BATCHED_UP_CONFIG[bucket], decode.BATCHED_DOWN_CONFIG[bucket]
    for block_n in (16, 32, 64, 128):
        if block_n != up[1]:
            variants.append((f"up BLOCK_N {block_n}", {"up_config": (up[0], block_n, *up[2:])}))
    for walk in (32, 64, 128):
        if walk != down[2]:
            variants.append((f"down WALK {walk}", {"down_config": (*down[:2], walk, *down[3:])}))
    for steps in (1, 2, 4, 8, 16):
        if steps != down[3]:
            variants.append((f"down STEPS {steps}", {"down_config": (*down[:3], steps, *down[4:])}))
    variants.append(("partials cap 64 MB", {"max_parts_bytes": 64 << 20}))
    return variants


# batched_point's variants whose in-graph kernel times are recorded at 0.5% (the sweeps' are not)
PROFILED = ("installed", "calibrated", "decode", "batched", "stream", "stream sum-kernel", "rows")


def batched_point(k, n, m, density, pattern, sweep, stream_sweep=False, rows_sweep=False, only=None) -> list[dict]:
    """At one point, per layer of a graph over LAYERS_PER_GRAPH layers: dense; the module as sparsify
    installs it, and with the LayerConfig calibration gives a layer of this density ("calibrated":
    policy.calibrated_decode_max_m / calibrated_batched_max_m); the one-token design's kernels forced
    (decode_ffn); the batched decode (each variant), with its bytes floor, the union it met, and at 0.5%
    the time of each kernel of dense and of the PROFILED variants in the graph. only: the variant names
    to time (None: all)."""
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
        floor = batched_floor_bytes(k, n, m, union)

        def args(b):
            w = ws[id(b)]
            return (x, w["gate_weight"], w["gate_bias"], w["up_weight"], None, w["down_weight"].t(), None, 0.0)

        calibrated = {
            "decode_max_m": policy.calibrated_decode_max_m(density),
            "batched_max_m": policy.calibrated_batched_max_m(density),
        }
        calls = [
            ("installed", lambda b: b(x)),
            ("calibrated", lambda b: b(x)),
            ("decode", lambda b: decode.decode_ffn(*args(b))),
        ]
        for name, kwargs in batched_variants(m, sweep, stream_sweep, rows_sweep):
            calls.append((name, lambda b, kw=kwargs: decode.batched_decode_ffn(*args(b), **kw)))
        if only is not None:
            calls = [(name, call) for name, call in calls if name in only]
        for name, call in calls:
            configured = [twell.configure(b, **calibrated) for b in blocks] if name == "calibrated" else []
            try:
                err = rel_err_sample(call(block), x, block)
                ms = per_layer(call)
                profiled = density == 0.005 and name in PROFILED
                kernels = graph_kernel_us(lambda c=call: [c(b) for b in blocks]) if profiled else None
            except Exception as e:  # a config the compiler refuses (shared memory, registers)
                print(f"{name}: {type(e).__name__}: {e}", flush=True)
                continue
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
                f"{k:>5} {n:>6} {m:>4} {density:.3f} union {union / n:6.1%} {name:>20} dense {dense_ms * 1e3:7.1f}us"
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
    parser.add_argument("--sweep", action="store_true", help="batched: also the walk configs around the shipped ones")
    parser.add_argument("--stream-sweep", action="store_true", help="batched: also the stream design's configs")
    parser.add_argument("--rows-sweep", action="store_true", help="batched: also the rows design's configs")
    parser.add_argument("--variants", default=None, help="batched: only these variants (names, comma-separated)")
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
                    low = density == 0.005  # the sweeps at 0.5% only
                    sweeps = (args.sweep and low, args.stream_sweep and low, args.rows_sweep and low)
                    only = args.variants.split(",") if args.variants else None
                    result["rows"] += batched_point(k, n, m, density, args.pattern, *sweeps, only=only)
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
