"""Per-call choice of path on CUDA: decode kernels, TwELL prefill kernels, or dense.

Thresholds and layout live in twell.kernels.policy.
- M <= DECODE_MAX_M tokens: the two decode kernels (gate + up, then down; only active rows of W_u / W_d
  are read; no host synchronisation, so CUDA graphs capture it).
- M >= PREFILL_MIN_M: gate packed to TwELL (GATE_ROUTE: cuBLAS GEMM + pack kernel, or the Triton GEMM
  with the packing epilogue), then the fused up+down kernel. Rows that overflow a tile's slots or hold
  more than entries_cap(N) entries are recomputed densely (the hybrid safety valve): exact at any sparsity.
- Otherwise dense (also for K > MAX_K).
- A layer whose last prefill call was denser than DENSE_ABOVE runs dense for the next DENSE_RETRY
  calls, then probes again: a rewrite must not make a dense layer slower.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
import triton

from twell.kernels import policy, reference
from twell.kernels.decode import decode_ffn
from twell.kernels.gate import gate_twell, pack_dense
from twell.kernels.updown import twell_up_down

# id(weight behind any view) -> {(shape, offset, token bucket): calls left to run dense}; an entry goes
# when its tensor is freed, so a new tensor at a reused address starts clean
_dense_calls_left: dict[int, dict] = {}


def _streaks(weight: torch.Tensor, m: int) -> tuple[dict, tuple]:
    base = weight._base if weight._base is not None else weight
    if id(base) not in _dense_calls_left:
        _dense_calls_left[id(base)] = {}
        weakref.finalize(base, _dense_calls_left.pop, id(base), None)
    key = (tuple(weight.shape), weight.storage_offset(), triton.next_power_of_2(m))
    return _dense_calls_left[id(base)], key


def _run(x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias, threshold, drelu, square, dense_fn):
    """Shared flow of the gated (up_weight given) and non-gated FFNs; dense_fn(x2d) is the exact fallback."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    # the kernels read biases with unit stride
    gate_bias, up_bias, down_bias = (b.contiguous() if b is not None else None for b in (gate_bias, up_bias, down_bias))
    m = x2.shape[0]
    # The kernels gather rows of down_weight^T [N, K]; a per-call transposed copy would cost more than
    # the sparse FFN saves at decode sizes, so weights in the plain nn.Linear layout run dense
    # (sparsify re-lays them once: twell.passes.modules.store_down_rows).
    wd_t = down_weight.t()
    path = policy.route(m, x2.shape[1], capturing=x.is_cuda and torch.cuda.is_current_stream_capturing())
    if wd_t.stride(1) != 1:
        path = "dense"
    if path == "prefill":  # only prefill calls set or spend a layer's dense streak
        streaks, key = _streaks(gate_weight, m)
        if streaks.get(key, 0) > 0:
            streaks[key] -= 1
            path = "dense"
    if path == "dense":
        return dense_fn(x2).reshape(shape)

    if path == "decode":
        return decode_ffn(
            x2, gate_weight, gate_bias, up_weight, up_bias, wd_t, down_bias, threshold, drelu=drelu, square=square
        ).reshape(shape)

    n = gate_weight.shape[0]
    tile_n, slots = policy.TILE_N, policy.SLOTS
    if policy.GATE_ROUTE == "fused":
        values, indices, counts = gate_twell(x2, gate_weight, gate_bias, threshold, tile_n, slots, square=square)
    else:
        pre = F.linear(x2, gate_weight, gate_bias)
        values, indices, counts = pack_dense(pre, threshold, tile_n, slots, square=square)
        del pre
    per_row = counts.sum(1)
    entries_max = min(policy.entries_cap(n), counts.shape[1] * slots)
    skip = (counts > slots).any(1) | (per_row > entries_max)
    # The host needs two numbers (rows left to the dense path, total density). Copy them out before the
    # up+down kernel is queued and wait only for that copy: the GPU stays busy meanwhile.
    stats = torch.stack([skip.sum(), per_row.sum()])
    ready = None
    if stats.is_cuda:
        stats = stats.to("cpu", non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
    y = twell_up_down(
        x2,
        values,
        indices,
        counts,
        skip.to(torch.int8),
        up_weight,
        up_bias,
        wd_t,
        down_bias,
        tile_n=tile_n,
        max_entries=entries_max,
        drelu=drelu,
    )
    if ready is not None:
        ready.synchronize()
    n_skip, total = stats.tolist()
    if total > policy.DENSE_ABOVE * m * n:
        streaks[key] = policy.DENSE_RETRY
    if n_skip:
        rows = torch.nonzero(skip).flatten()
        y[rows] = dense_fn(x2[rows])
    return y.reshape(shape)


def gated_ffn(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, threshold, drelu):
    def dense(x2):
        return reference.gated_ffn(
            x2, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, threshold, drelu
        )

    return _run(x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias, threshold, drelu, False, dense)


def ffn(x, up_weight, down_weight, up_bias, down_bias, threshold, squared):
    def dense(x2):
        return reference.ffn(x2, up_weight, down_weight, up_bias, down_bias, threshold, squared)

    return _run(x, up_weight, up_bias, None, None, down_weight, down_bias, threshold, False, squared, dense)
