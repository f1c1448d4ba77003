"""The gate + pack stage of the prefill path, every route in one run: cuBLAS alone (the floor of its
GEMM), the pack pass after it (each config), the fused gate (each config), and
the kernel before the fused gate's rebuild (its epilogue as a variant of one diagnostic kernel, below),
at K=2048 N=5632 M=131072 (0.5% uniform and topic runs) and K=4096 N=14336 M=32768 (uniform).

    PYTHONPATH=. python benchmarks/gate_epilogue.py      (JSON to $OUT or benchmarks/results/)

Every packed result is checked against pack_dense's default (counts and the words inside them): the
pack pass bit for bit; the fused gate by the share of counts that agree (its fp32 sums differ from
cuBLAS's in the last bits, so a few entries at the threshold may go either way).

The diagnostic kernel: one kernel with each choice the kernel before the rebuild and the probe
(../shared/probes/pack_epilogue_probe.py: 4.97 ms at M=131072, K=2048, N=5632) differ in as a flag:
DEVICE_DESC (descriptors made in the kernel or on the host), FLATTEN (tl.range flatten=True),
CONST_STEP (the persistent loop's step a constexpr SM count or tl.num_programs), FULL (the epilogue's
features: FULL_LEVELS). OLD_EPILOGUE is the kernel before the rebuild with its whole-tile epilogue
(9.2-9.5 ms before; its two-half version, 6.03-6.22, is not rebuilt here).
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.testing import do_bench
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).parent))
from ffn import environment, make_inputs, weights  # noqa: E402

from twell.kernels import gate  # noqa: E402
from twell.kernels.words import encode  # noqa: E402

FULL_LEVELS = {
    0: "the probe's: bf16 value > 0",
    1: "shipped: bias, fp32 copy of the rounded gate, run-time threshold, NaN kept, row and column masks",
    2: "bias, run-time threshold on the bf16 value, NaN kept, column mask",
    6: "value > 0, NaN kept",
    7: "bf16 compare with a run-time threshold (NaN dropped)",
}


@triton.jit
def _variant_kernel(
    x_desc, w_desc, x_ptr, w_ptr, b_ptr, words_ptr, cnt_ptr, M, N, K, n_tiles, threshold,
    DEVICE_DESC: tl.constexpr, FLATTEN: tl.constexpr, CONST_STEP: tl.constexpr, FULL: tl.constexpr,
    NUM_SMS: tl.constexpr, TILE_N: tl.constexpr, SLOTS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    if DEVICE_DESC:
        xd = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
        wd = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[K, 1], block_shape=[TILE_N, BLOCK_K])
    else:
        xd = x_desc
        wd = w_desc
    grid_m = tl.cdiv(M, BLOCK_M)
    n_out = grid_m * n_tiles
    k_steps = tl.cdiv(K, BLOCK_K)
    step = NUM_SMS if CONST_STEP else tl.num_programs(0)
    for out_tile in tl.range(tl.program_id(0), n_out, step, flatten=FLATTEN):
        group = out_tile // (GROUP_M * n_tiles)
        first_m = group * GROUP_M
        group_size = tl.minimum(grid_m - first_m, GROUP_M)
        pid_m = first_m + (out_tile % (GROUP_M * n_tiles)) % group_size
        tile = (out_tile % (GROUP_M * n_tiles)) // group_size
        acc = tl.zeros([BLOCK_M, TILE_N], dtype=tl.float32)
        for ks in range(k_steps):
            a = xd.load([pid_m * BLOCK_M, ks * BLOCK_K])
            b = wd.load([tile * TILE_N, ks * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_c = tl.arange(0, TILE_N)
        if FULL == 1:
            cols = tile * TILE_N + offs_c
            acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
            acc = acc.to(tl.bfloat16).to(tl.float32)
            in_bounds = (offs_m < M)[:, None] & (cols < N)[None, :]
            keep = ((acc > threshold) | (acc != acc)) & in_bounds
            value = acc.to(tl.bfloat16)
        elif FULL == 2:
            cols = tile * TILE_N + offs_c
            acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
            value = acc.to(tl.bfloat16)
            v = value.to(tl.float32)
            keep = ((v > threshold) | (v != v)) & (cols < N)[None, :]
        elif FULL == 6:
            value = acc.to(tl.bfloat16)
            v = value.to(tl.float32)
            keep = (v > 0.0) | (v != v)
        elif FULL == 7:
            value = acc.to(tl.bfloat16)
            keep = value > threshold.to(tl.bfloat16)
        else:
            value = acc.to(tl.bfloat16)
            keep = value.to(tl.float32) > 0.0
        keep_i = keep.to(tl.int32)
        pos = tl.cumsum(keep_i, axis=1) - 1
        cnt = tl.sum(keep_i, axis=1)
        rows = offs_m.to(tl.int64)
        base = ((rows * n_tiles + tile) * SLOTS)[:, None] + pos
        word = encode(value, tl.broadcast_to(offs_c[None, :], value.shape))
        tl.store(words_ptr + base, word, mask=keep & (pos < SLOTS) & (offs_m < M)[:, None])
        tl.store(cnt_ptr + rows * n_tiles + tile, cnt, mask=offs_m < M)


OLD_EPILOGUE = {"DEVICE_DESC": False, "FLATTEN": True, "CONST_STEP": False, "FULL": 1}


def run(x, wg, bg, flags, config, tile_n=128, slots=16):
    bm, bk, warps, stages = config
    m, k = x.shape
    n = wg.shape[0]
    n_tiles = triton.cdiv(n, tile_n)
    words = torch.empty(m, n_tiles, slots, dtype=torch.int32, device=x.device)
    counts = torch.empty(m, n_tiles, dtype=torch.int32, device=x.device)
    x_desc = TensorDescriptor(x, list(x.shape), list(x.stride()), [bm, bk])
    w_desc = TensorDescriptor(wg, list(wg.shape), list(wg.stride()), [tile_n, bk])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = (min(sms, triton.cdiv(m, bm) * n_tiles),)
    _variant_kernel[grid](
        x_desc, w_desc, x, wg, bg, words, counts, m, n, k, n_tiles, 0.0, **flags, NUM_SMS=grid[0], TILE_N=tile_n,
        SLOTS=slots, BLOCK_M=bm, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return words, counts


def counted(words, counts, slots=16):
    """The words inside each count (the rest are unspecified)."""
    valid = torch.arange(slots, device=words.device) < counts.clamp(max=slots).unsqueeze(-1)
    return torch.where(valid, words, 0)


@torch.no_grad()
def shape_rows(k: int, n: int, m: int, pattern: str) -> list[dict]:
    x, block = make_inputs(m, k, n, 0.005, pattern, seed=1)
    w = weights(block)
    wg, bg = w["gate_weight"], w["gate_bias"]
    cublas = do_bench(lambda: F.linear(x, wg, bg), return_mode="median")
    pre = F.linear(x, wg, bg)
    ref_words, ref_counts = gate.pack_dense(pre, 0.0, 128, 16)
    ref_words = counted(ref_words, ref_counts)
    rows = [{"K": k, "N": n, "M": m, "pattern": pattern, "cublas_ms": cublas, "kept": int(ref_counts.sum())}]
    print(f"K={k} N={n} M={m} {pattern}: cuBLAS {cublas:.3f} ms", flush=True)

    def record(route, config, fn, exact=True):
        words, counts = fn()
        ms = do_bench(fn, return_mode="median")
        agree = float((counts == ref_counts).float().mean())
        same = bool(torch.equal(counts, ref_counts) and torch.equal(counted(words, counts), ref_words))
        row = {"route": route, "config": config, "ms": ms, "counts_agree": agree, "bit_exact": same}
        total = ms + (cublas if route.startswith("pack") else 0.0)
        row["gate_plus_pack_ms"] = total
        rows.append(row)
        flag = "" if (same if exact else agree > 0.999) else "  ** MISMATCH **"
        print(f"  {route:12s} {str(config):22s} {ms:7.3f} ms  gate+pack {total:7.3f} ({total / cublas:.3f}x cuBLAS)"
              f"  counts agree {agree:.6f} exact {same}{flag}", flush=True)  # fmt: skip

    for config in gate.PACK_CONFIGS:
        record("pack-scan", config, lambda c=config: gate.pack_dense(pre, 0.0, 128, 16, config=c))
    for config in gate.GATE_CONFIGS:
        try:
            record("fused", config, lambda c=config: gate.gate_twell(x, wg, bg, 0.0, 128, 16, config=c), exact=False)
        except Exception as e:  # a config the compiler refuses
            print(f"  fused {config}: {type(e).__name__} {str(e)[:160]}", flush=True)
    old = (128, 64, 8, 4)
    record("old-fused", old, lambda: run(x, wg, bg, OLD_EPILOGUE, old), exact=False)
    return rows


def main():
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    rows = []
    for k, n, m, pattern in (
        (2048, 5632, 131072, "uniform"),
        (2048, 5632, 131072, "topics"),
        (4096, 14336, 32768, "uniform"),
    ):
        rows += shape_rows(k, n, m, pattern)
        torch.cuda.empty_cache()
    out = Path(os.environ.get("OUT", "benchmarks/results"))
    path = out / f"gate_epilogue-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({**environment(), "full_levels": FULL_LEVELS, "rows": rows}, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
