"""Which path a call takes, and the TwELL layout the kernels use: read by the dispatcher (per call)
and by calibration's cost model (to predict what the dispatcher will do). No Triton import here.

Thresholds measured on an H200, bf16, against the dense FFN in the same run (benchmarks/NOTES.md):
decode wins at every density up to 5% for 1-8 tokens (1.03-1.85x at K=2048, 1.22-1.77x at K=4096;
gpu_check-decode-20261130-165108.json) and loses at 16 tokens and 5% (0.85x), so it serves up to 8,
and up to 16 on layers whose prefill calls measured them at most 1% dense.
Prefill wins from 16384 tokens at 0.5% (1.20-1.40x at K=2048 by pattern, ffn-20261130-184434.json;
1.01-1.32x at K=4096, ffn-20261130-184835.json). At 8192 its GPU time wins (CUDA-graph replays
0.63-0.79 ms against dense 0.86 ms) but an eager call spends 0.8-1.1 ms on the host (Triton's launch
path for four kernels with ~40 arguments each, and the dispatcher's small torch ops), so eager timings
swing between 1.21x and 0.65x from run to run (ffn-20261130-231225.json, ffn-20261130-234316.json):
those calls stay dense.
Tests and benchmarks set these module attributes to route calls to the kernels.
"""

from __future__ import annotations

TILE_N = 128
SLOTS = 16  # compression 8, as the reference code
DECODE_MAX_M = 8
# 9-16 tokens: decode where the layer is known sparse (1.19-1.37x at <= 1%; 1.06-1.17x at 2%, 0.85x at 5%)
DECODE_SPARSE_MAX_M = 16
DECODE_SPARSE_DENSITY = 0.01
PREFILL_MIN_M: int | None = 16384
# Gate of the prefill path: the persistent TMA GEMM with the packing epilogue (True) or cuBLAS + the
# pack pass (False); the faster measured at K=2048/N=5632 and K=4096/N=14336 on an H200.
FUSED_GATE = False
MAX_K = 8192  # wider models run dense: the up+down kernel keeps whole x and y rows in registers
# Mean density above which a layer's prefill runs dense: 1.28x at 0.5%, 0.99-1.00x at 1% (NOTES.md v5/v6).
DENSE_ABOVE = 0.008
DENSE_RETRY = 64  # dense calls before such a layer is probed again
# Training calls (autograd recording) of at least this many tokens take the sparse training path
# (twell.kernels.backward); None: none does. Off by default: a training step through it measured
# 0.16-0.31x of dense at 32768 tokens (dx and dW kernels 6-7x their floors, train-20261130-234135.json).
TRAIN_MIN_M: int | None = None


def route(m: int, k: int, density: float | None = None) -> str:
    """ "decode", "prefill" or "dense" for a call of m tokens of width k; density: the layer's, where
    measured."""
    if m == 0 or k > MAX_K:
        return "dense"
    if m <= DECODE_MAX_M or (m <= DECODE_SPARSE_MAX_M and density is not None and density <= DECODE_SPARSE_DENSITY):
        return "decode"
    if PREFILL_MIN_M is not None and m >= PREFILL_MIN_M:
        return "prefill"
    return "dense"


def train_width(n: int) -> int:
    """Record slots per token row of the sparse training path for N hidden neurons: a power of two
    >= N/32 (>= 3% density, several times the 0.5-1% a trained sparse model keeps, so only unusually
    dense rows take the dense backup; the record costs 8 bytes a slot), at least 64, at most N rounded
    up to a power of two."""
    return min(1 << max(n - 1, 0).bit_length(), max(64, 1 << (-(-n // 32) - 1).bit_length()))
