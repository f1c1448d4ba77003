"""Per-call choice of path on CUDA: decode kernels, TwELL prefill kernels, or dense. No path reads
anything back to the host, so every path runs inside CUDA graphs and under torch.compile.

Each call brings its layer's twell.kernels.policy.LayerConfig (the op's arguments): its route limits
and TwELL layout; policy.route decides.
- M <= decode_max_m tokens, or up to decode_sparse_max_m for a layer whose prefill calls measured at
  most DECODE_SPARSE_DENSITY: the two decode kernels (gate + up, then down; only active rows of W_u /
  W_d are read).
- M >= prefill_min_m: the gate packed to TwELL at the layer's tile_n / slots (fused_gate: the
  persistent TMA GEMM packing in its epilogue, where the operands allow; otherwise cuBLAS + a pack
  pass), then the fused up+down kernels, which recompute the gate of tiles that overflow their slots:
  exact at any sparsity.
- Otherwise dense (also for K > MAX_K, and for a down weight not stored as the kernels read it):
  twell.kernels.dense, cuBLAS with the activation and product in one pass.
- Layer density: each prefill call queues a copy of its kept-entry count to pinned host memory; a
  later call of the layer reads it once the copy is done (never waiting). A layer denser than its
  dense_above then runs dense for DENSE_RETRY prefill calls and probes again: a rewrite must not make
  a dense layer slower.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton

from twell.kernels import dense as dense_route
from twell.kernels import policy
from twell.kernels.decode import decode_ffn
from twell.kernels.gate import fused_gate_supported, gate_twell, pack_dense
from twell.kernels.updown import twell_up_down


@dataclass
class _LayerState:
    dense_calls_left: int = 0
    pending: tuple | None = None  # (event or None, kept-entry count on the host, M * N)
    density: float | None = None  # what the last landed probe measured

    def update(self, dense_above: float) -> None:
        """Take the last probe's density into account once its copy has landed; past dense_above, the
        layer's next prefill calls run dense."""
        if self.pending is None:
            return
        ready, kept, possible = self.pending
        if ready is not None and not ready.query():
            return
        self.pending = None
        self.density = kept.item() / max(possible, 1)
        if self.density > dense_above:
            self.dense_calls_left = policy.DENSE_RETRY


# id(weight behind any view) -> {(shape, offset, token bucket): state}; an entry goes when its tensor is
# freed, so a new tensor at a reused address starts clean
_layers: dict[int, dict[tuple, _LayerState]] = {}


def layer_state(weight: torch.Tensor, m: int) -> _LayerState:
    base = weight._base if weight._base is not None else weight
    if id(base) not in _layers:
        _layers[id(base)] = {}
        weakref.finalize(base, _layers.pop, id(base), None)
    key = (tuple(weight.shape), weight.storage_offset(), triton.next_power_of_2(m))
    return _layers[id(base)].setdefault(key, _LayerState())


def layer_density(weight: torch.Tensor, capturing: bool, dense_above: float) -> float | None:
    """The layer's density as its prefill calls measured it (the densest token bucket), None before any
    probe has landed; under CUDA-graph capture, what had landed before."""
    base = weight._base if weight._base is not None else weight
    where = (tuple(weight.shape), weight.storage_offset())
    densities = []
    for key, state in _layers.get(id(base), {}).items():
        if key[:2] == where:
            if not capturing:
                state.update(dense_above)
            if state.density is not None:
                densities.append(state.density)
    return max(densities, default=None)


def forget_layers() -> None:
    """Drop every layer's density history (benchmarks and tests start from a clean state)."""
    _layers.clear()


def _probe(counts: torch.Tensor, possible: int) -> tuple:
    kept = counts.sum(dtype=torch.int64)
    if not kept.is_cuda:
        return None, kept, possible
    host = torch.empty((), dtype=torch.int64, pin_memory=True)
    host.copy_(kept, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return ready, host, possible


def _run(
    x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias, threshold, drelu, square, dense_fn, config
):
    """Shared flow of the gated (up_weight given) and non-gated FFNs; dense_fn(x2d) is the exact fallback;
    config: the layer's policy.LayerConfig."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    # the kernels read biases with unit stride
    gate_bias, up_bias, down_bias = (b.contiguous() if b is not None else None for b in (gate_bias, up_bias, down_bias))
    m = x2.shape[0]
    # The kernels gather rows of down_weight^T [N, K]; a per-call transposed copy would cost more than
    # the sparse FFN saves at decode sizes, so weights in the plain nn.Linear layout run dense
    # (sparsify re-lays them once: twell.passes.modules.store_down_rows).
    wd_t = down_weight.t()
    # under CUDA-graph capture the layer's density state is frozen: no event queries, no new probes
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    sparse_decode = config.decode_max_m < m <= config.decode_sparse_max_m
    density = layer_density(gate_weight, capturing, config.dense_above) if sparse_decode else None
    path = policy.route(m, x2.shape[1], config, density) if wd_t.stride(1) == 1 else "dense"
    if path == "prefill":
        state = layer_state(gate_weight, m)
        if not capturing:
            state.update(config.dense_above)
        if state.dense_calls_left > 0:
            state.dense_calls_left -= 1
            path = "dense"
    if path == "dense":
        return dense_fn(x2).reshape(shape)
    if path == "decode":
        return decode_ffn(
            x2, gate_weight, gate_bias, up_weight, up_bias, wd_t, down_bias, threshold, drelu=drelu, square=square
        ).reshape(shape)

    tile_n, slots = config.tile_n, config.slots
    if config.fused_gate and fused_gate_supported(x2, gate_weight, tile_n):
        values, indices, counts = gate_twell(x2, gate_weight, gate_bias, threshold, tile_n, slots, square=square)
    else:
        pre = F.linear(x2, gate_weight, gate_bias)
        values, indices, counts = pack_dense(pre, threshold, tile_n, slots, square=square)
        del pre
    y = twell_up_down(
        x2,
        values,
        indices,
        counts,
        gate_weight,
        gate_bias,
        up_weight,
        up_bias,
        wd_t,
        down_bias,
        tile_n=tile_n,
        threshold=threshold,
        drelu=drelu,
        square=square,
    )
    # one probe in flight per layer: a newer one would never land while the host runs ahead of the GPU
    if state.pending is None and not capturing:
        state.pending = _probe(counts, m * gate_weight.shape[0])
    return y.reshape(shape)


def gated_ffn(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, threshold, drelu, config):
    def dense(x2):
        return dense_route.gated_ffn(
            x2, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, threshold, drelu
        )

    return _run(
        x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias, threshold, drelu, False, dense, config
    )


def ffn(x, up_weight, down_weight, up_bias, down_bias, threshold, squared, config):
    def dense(x2):
        return dense_route.ffn(x2, up_weight, down_weight, up_bias, down_bias, threshold, squared)

    return _run(x, up_weight, up_bias, None, None, down_weight, down_bias, threshold, False, squared, dense, config)
