"""Where the fused gate's epilogue time goes: the persistent TMA gate GEMM of twell.kernels.gate with
its epilogue swapped for variants (EPILOGUES), at M=131072, K=2048, N=5632 and M=65536, K=4096,
N=14336, against cuBLAS and cuBLAS + the pack pass. A diagnostic: the variants are not product code.

    cd benchmarks && PYTHONPATH=.. python gate_epilogue.py      (JSON to $OUT or benchmarks/results/)
"""

import json
import os
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from ffn import git_commit, make_inputs, weights
from triton.testing import do_bench
from triton.tools.tensor_descriptor import TensorDescriptor

from twell.kernels.gate import _gate_tile, pack_dense

EPILOGUES = {
    0: "shipped scatter (int64 offsets, pad)",
    1: "relu + TMA store of the dense gate",
    2: "counts only",
    3: "scatter, int32 offsets from a tile base, pad",
    4: "scatter, int32 offsets, no pad",
    5: "one int32 word per slot, int32 offsets, no pad",
}


@triton.jit
def _kernel(
    x_desc,
    w_desc,
    out_desc,
    vals_ptr,
    idx_ptr,
    cnt_ptr,
    word_ptr,
    M,
    N,
    K,
    n_tiles,
    threshold,
    EPI: tl.constexpr,
    TILE_N: tl.constexpr,
    SLOTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr = 8,
):
    grid_m = tl.cdiv(M, BLOCK_M)
    n_out = grid_m * n_tiles
    k_steps = tl.cdiv(K, BLOCK_K)
    for out_tile in tl.range(tl.program_id(0), n_out, tl.num_programs(0)):
        # the shipped mainloop (bf16 inputs: tf32 is the default precision of tl.dot)
        pid_m, tile, acc = _gate_tile(
            x_desc, w_desc, out_tile, grid_m, n_tiles, k_steps, "tf32", TILE_N, BLOCK_M, BLOCK_K, GROUP_M
        )
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_c = tl.arange(0, TILE_N)
        if EPI == 1:
            out_desc.store([pid_m * BLOCK_M, tile * TILE_N], tl.maximum(acc, 0.0).to(out_desc.dtype))
        else:
            acc = acc.to(vals_ptr.dtype.element_ty).to(tl.float32)
            in_bounds = (offs_m < M)[:, None] & ((tile * TILE_N + offs_c) < N)[None, :]
            keep = ((acc > threshold) | (acc != acc)) & in_bounds
            keep_i = keep.to(tl.int32)
            if EPI == 2:
                cnt = tl.sum(keep_i, axis=1)
            else:
                pos = tl.cumsum(keep_i, axis=1) - 1
                cnt = tl.sum(keep_i, axis=1)
                stored = keep & (pos < SLOTS)
                if EPI == 0:
                    slot_ptr = ((offs_m.to(tl.int64) * n_tiles + tile) * SLOTS)[:, None] + pos
                    tl.store(vals_ptr + slot_ptr, acc.to(vals_ptr.dtype.element_ty), mask=stored)
                    tl.store(idx_ptr + slot_ptr, tl.broadcast_to(offs_c[None, :], acc.shape).to(tl.int16), mask=stored)
                else:
                    base = (pid_m * BLOCK_M * n_tiles + tile).to(tl.int64) * SLOTS
                    local = (tl.arange(0, BLOCK_M) * (n_tiles * SLOTS))[:, None] + pos
                    if EPI == 5:
                        bits = acc.to(vals_ptr.dtype.element_ty).to(tl.int16, bitcast=True).to(tl.int32)
                        word = (bits << 16) | tl.broadcast_to(offs_c[None, :], acc.shape)
                        tl.store(word_ptr + base + local, word, mask=stored)
                    else:
                        tl.store(vals_ptr + base + local, acc.to(vals_ptr.dtype.element_ty), mask=stored)
                        tl.store(
                            idx_ptr + base + local,
                            tl.broadcast_to(offs_c[None, :], acc.shape).to(tl.int16),
                            mask=stored,
                        )
                if EPI == 0 or EPI == 3:
                    row_ok = offs_m < M
                    offs_s = tl.arange(0, SLOTS)
                    pad = row_ok[:, None] & (offs_s[None, :] >= cnt[:, None])
                    pad_ptr = ((offs_m.to(tl.int64) * n_tiles + tile) * SLOTS)[:, None] + offs_s[None, :]
                    tl.store(vals_ptr + pad_ptr, tl.zeros([BLOCK_M, SLOTS], vals_ptr.dtype.element_ty), mask=pad)
                    tl.store(idx_ptr + pad_ptr, tl.zeros([BLOCK_M, SLOTS], tl.int16), mask=pad)
            tl.store(cnt_ptr + offs_m.to(tl.int64) * n_tiles + tile, cnt, mask=offs_m < M)


def run(x, wg, epi, bm, bk, warps, stages, tile_n=128, slots=16):
    m, k = x.shape
    n = wg.shape[0]
    n_tiles = triton.cdiv(n, tile_n)
    vals = torch.empty(m, n_tiles, slots, dtype=x.dtype, device=x.device)
    idx = torch.empty(m, n_tiles, slots, dtype=torch.int16, device=x.device)
    cnt = torch.empty(m, n_tiles, dtype=torch.int32, device=x.device)
    words = torch.empty(m, n_tiles, slots, dtype=torch.int32, device=x.device) if epi == 5 else cnt
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if epi == 1 else x
    x_desc = TensorDescriptor(x, list(x.shape), list(x.stride()), [bm, bk])
    w_desc = TensorDescriptor(wg, list(wg.shape), list(wg.stride()), [tile_n, bk])
    o_desc = TensorDescriptor(out, list(out.shape), list(out.stride()), [bm, tile_n])
    progs = torch.cuda.get_device_properties(0).multi_processor_count if x.is_cuda else 4
    grid = (min(progs, triton.cdiv(m, bm) * n_tiles),)
    _kernel[grid](
        x_desc,
        w_desc,
        o_desc,
        vals,
        idx,
        cnt,
        words,
        m,
        n,
        k,
        n_tiles,
        0.0,
        EPI=epi,
        TILE_N=tile_n,
        SLOTS=slots,
        BLOCK_M=bm,
        BLOCK_K=bk,
        num_warps=warps,
        num_stages=stages,
    )
    return vals, idx, cnt


@torch.no_grad()
def shape_rows(k: int, n: int, m: int) -> list[dict]:
    """cuBLAS, cuBLAS + pack, and each (config, epilogue) at one shape; counts checked against pack_dense."""
    x, block = make_inputs(m, k, n, 0.005, "uniform", seed=1)
    wg = weights(block)["gate_weight"]
    cublas = do_bench(lambda: F.linear(x, wg), return_mode="median")
    pre = F.linear(x, wg)
    ref_counts = pack_dense(pre, 0.0, 128, 16)[1]
    pack = do_bench(lambda: pack_dense(pre, 0.0, 128, 16), return_mode="median")
    print(f"K={k} cuBLAS {cublas:.3f} pack {pack:.3f}", flush=True)
    rows = [{"K": k, "N": n, "M": m, "cublas_ms": cublas, "pack_ms": pack}]
    for cfg in ((128, 64, 8, 4), (128, 128, 8, 3), (128, 64, 4, 4)):
        for epi in (1, 2, 0, 3, 4, 5):
            try:
                counts = run(x, wg, epi, *cfg)[2]
                ms = do_bench(lambda e=epi, c=cfg: run(x, wg, e, *c), return_mode="median")
            except Exception as e:  # a config the compiler refuses
                print(cfg, epi, type(e).__name__, str(e)[:200], flush=True)
                continue
            ok = float((counts == ref_counts).float().mean()) if epi != 1 else None
            rows.append({"K": k, "config": cfg, "epi": epi, "ms": ms, "counts_agree": ok})
            print(f"K={k} {cfg} epi {epi}: {ms:.3f} ms ({cublas / ms:.2f}x cuBLAS) counts agree {ok}", flush=True)
    return rows


def main():
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    rows = []
    for k, n, m in ((2048, 5632, 131072), (4096, 14336, 65536)):
        rows += shape_rows(k, n, m)
        torch.cuda.empty_cache()
    out = os.environ.get("OUT", "results")
    path = f"{out}/gate_epilogue-{time.strftime('%Y%m%d-%H%M%S')}.json"
    result = {"commit": git_commit(), "gpu": torch.cuda.get_device_name(), "triton": triton.__version__}
    with open(path, "w") as f:
        json.dump({**result, "epilogues": EPILOGUES, "rows": rows}, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
