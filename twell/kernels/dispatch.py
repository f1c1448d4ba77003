"""Per-call choice of path on CUDA: decode kernels, TwELL prefill kernels, or dense. No path reads
anything back to the host, so every path runs inside CUDA graphs and under torch.compile.

Each call brings its layer's twell.kernels.policy.LayerConfig (the op's arguments): its route limits
and TwELL layout; policy.route decides.
- M <= decode_max_m tokens, or up to decode_sparse_max_m for a layer whose prefill calls measured at
  most DECODE_SPARSE_DENSITY: the two decode kernels (gate + up, then down; only active rows of W_u /
  W_d are read).
- M >= prefill_min_m (prefill_min_m_captured for a call being captured into a CUDA graph, where the
  host time is paid once; a captured call below prefill_min_m prefills only on a layer whose prefill
  kernels ran eagerly at its token bucket, and the first eager call of a bucket in that range does:
  nothing tunes or compiles inside a capture): the gate packed to TwELL at the layer's tile_n / slots (fused_gate: the
  persistent TMA GEMM packing in its epilogue, where the operands allow; otherwise cuBLAS + a pack
  pass), then the fused up+down kernels (the main one in the layer's neuron_groups passes over groups of
  tiles), which recompute the gate of tiles that overflow their slots: exact at any sparsity.
- Otherwise dense (also for K > MAX_K, and for a down weight not stored as the kernels read it):
  twell.kernels.dense, cuBLAS with the activation and product in one pass.
- Hot neurons (prefill, the layer's hot_rate): the layer's hot neurons, those firing in more
  than hot_rate of its tokens, are computed by dense products over just those neurons: the packers
  leave them out of TwELL and write their gate pre-activations to an [M, H] buffer instead (the
  overflow recompute leaves them out too); a cuBLAS GEMM over their gathered up rows, the activation,
  then y += h_hot W_d[hot] after the sparse stage. A sparse pair costs a gather of two
  weight rows, a hot neuron's dense columns a few FLOPs a token: neurons firing in a few percent of
  tokens are cheaper dense. Which neurons are hot is measured on the device from a prefill call's
  first HOT_SAMPLE rows, read on the host once landed, re-measured every DENSE_RETRY prefill calls.
  Results never depend on which neurons are hot beyond rounding.
- Layer density: each prefill call queues a copy of its kept-entry counts (sparse and hot) to pinned
  host memory; a later call of the layer reads it once the copy is done (never waiting). A layer whose
  sparse share is denser than its dense_above (less the hot neurons' dense cost) then runs dense for
  DENSE_RETRY prefill calls and probes again: a rewrite must not make a dense layer slower.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from twell.kernels import dense as dense_route
from twell.kernels import policy
from twell.kernels.common import next_power_of_2
from twell.kernels.decode import launch_decode
from twell.kernels.gate import fused_gate_supported, launch_gate_twell, launch_pack_dense
from twell.kernels.updown import launch_up_down


@dataclass
class _Hot:
    """A layer's hot neurons on its device: index [H] (int64, ascending) and pos [N] (int32: the neuron's
    place in index, -1 if not hot)."""

    index: torch.Tensor
    pos: torch.Tensor


@dataclass
class _LayerState:
    dense_calls_left: int = 0
    # (event or None, kept entries on the host: [sparse parts...(, hot)], M * N, the call's _Hot)
    pending: tuple | None = None
    density: float | None = None  # what the last landed probe measured
    hot: _Hot | None = None
    hot_pending: tuple | None = None  # (event or None, neuron counts on the host, the same on the device, rows)
    hot_calls_left: int = 0  # prefill calls before the hot neurons are measured again
    prefilled: bool = False  # a prefill call ran outside a capture (its kernels are compiled and tuned)

    def update(self, config: policy.LayerConfig, k: int) -> None:
        """Take landed probes into account: a landed neuron count sets the hot neurons; past its
        dense_above (policy.dense_above_of, width k), the layer's next prefill calls run dense."""
        if self.hot_pending is not None and (self.hot_pending[0] is None or self.hot_pending[0].query()):
            _, host, device, rows = self.hot_pending
            self.hot_pending = None
            self.hot = None if config.hot_rate is None else _hot_neurons(host, device, rows, config.hot_rate)
        if self.pending is not None and (self.pending[0] is None or self.pending[0].query()):
            _, kept, possible, hot = self.pending
            self.pending = None
            # kept: the up+down launch's parts of the sparse entries' total, then the hot neurons' count
            values = kept.tolist()
            sparse_kept, hot_kept = (sum(values[:-1]), values[-1]) if hot is not None else (sum(values), 0)
            sparse = sparse_kept / max(possible, 1)
            self.density = sparse + hot_kept / max(possible, 1)
            # the hot neurons' dense products cost about their share of dense's up and down projections;
            # a call measured with other hot neurons than the layer's now does not say what the next will cost
            hot_share = len(hot.index) / len(hot.pos) if hot is not None else 0.0
            current = self.hot if config.hot_rate is not None else None
            if hot is current and sparse > policy.dense_above_of(config, k) * (1 - hot_share):
                self.dense_calls_left = policy.DENSE_RETRY


def _hot_neurons(host: torch.Tensor, device: torch.Tensor, rows: int, rate: float) -> _Hot | None:
    """The policy.hot_count most frequent neurons of `rows` sampled tokens (counts on the host and the
    same on the device)."""
    n = host.shape[0]
    hot = policy.hot_count(host, rows, rate)
    if hot == 0:
        return None
    index = torch.sort(torch.argsort(device, descending=True, stable=True)[:hot]).values
    pos = torch.full((n,), -1, dtype=torch.int32, device=device.device)
    pos.index_copy_(0, index, torch.arange(hot, dtype=torch.int32, device=device.device))
    return _Hot(index, pos)


# id(weight behind any view) -> {(shape, offset, token bucket): state}; an entry goes when its tensor is
# freed, so a new tensor at a reused address starts clean
_layers: dict[int, dict[tuple, _LayerState]] = {}


def layer_state(weight: torch.Tensor, m: int) -> _LayerState:
    base = weight._base if weight._base is not None else weight
    if id(base) not in _layers:
        _layers[id(base)] = {}
        weakref.finalize(base, _layers.pop, id(base), None)
    key = (tuple(weight.shape), weight.storage_offset(), next_power_of_2(m))
    states = _layers[id(base)]
    state = states.get(key)
    if state is None:
        state = states[key] = _LayerState()
    return state


def layer_density(weight: torch.Tensor, capturing: bool, config: policy.LayerConfig) -> float | None:
    """The layer's density as its prefill calls measured it (the densest token bucket), None before any
    probe has landed; under CUDA-graph capture, what had landed before."""
    base = weight._base if weight._base is not None else weight
    where = (tuple(weight.shape), weight.storage_offset())
    densities = []
    for key, state in _layers.get(id(base), {}).items():
        if key[:2] == where:
            if not capturing:
                state.update(config, weight.shape[-1])
            if state.density is not None:
                densities.append(state.density)
    return max(densities, default=None)


def forget_layers() -> None:
    """Drop every layer's density history (benchmarks and tests start from a clean state)."""
    _layers.clear()


def _to_host(t: torch.Tensor) -> tuple:
    """(event or None, host copy of t): the copy is queued on the stream, done once the event is."""
    if not t.is_cuda:
        return None, t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return ready, host


def _run(
    x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias, threshold, drelu, square, dense_fn, config
):
    """Shared flow of the gated (up_weight given) and non-gated FFNs; dense_fn(x2d) is the exact fallback;
    config: the layer's policy.LayerConfig."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    # the kernels read biases with unit stride
    gate_bias, up_bias, down_bias = (b.contiguous() if b is not None else None for b in (gate_bias, up_bias, down_bias))
    wd_t = down_weight.t()
    # under CUDA-graph capture the layer's density state is frozen: no event queries, no new probes
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    path, state = _choose(x2, gate_weight, wd_t, config, capturing)
    if path == "dense":
        return dense_fn(x2).reshape(shape)
    args = (x2, gate_weight, gate_bias, up_weight, up_bias, wd_t, down_bias, threshold)
    if path == "decode":
        return launch_decode(*args, drelu=drelu, square=square).reshape(shape)
    return _prefill(*args, drelu, square, config, state, capturing).reshape(shape)


def _choose(x2, gate_weight, wd_t, config, capturing) -> tuple[str, _LayerState | None]:
    """The path of a call ("dense", "decode" or "prefill") and, for prefill, the layer's state.
    The kernels gather rows of down_weight^T [N, K] (wd_t); a per-call transposed copy would cost more
    than the sparse FFN saves at decode sizes, so weights in the plain nn.Linear layout run dense
    (sparsify re-lays them once: twell.passes.modules.store_down_rows)."""
    m, k = x2.shape
    if always_dense(m, k, config, wd_t):
        return "dense", None
    sparse_decode = config.decode_max_m < m <= config.decode_sparse_max_m
    density = layer_density(gate_weight, capturing, config) if sparse_decode else None
    path = policy.route(m, k, config, density, capturing)
    # where captured calls have a prefill threshold of their own: the path of this call in the other mode
    other = path
    if config.prefill_min_m_captured is not None:
        other = policy.route(m, k, config, density, not capturing)
    if path != "prefill" and other != "prefill":
        return path, None
    state = layer_state(gate_weight, m)
    if path != "prefill":  # an eager call where a capture would prefill: the first one tunes the kernels
        if capturing or state.prefilled:
            return path, None
    elif capturing and other != "prefill" and not state.prefilled:
        return "dense", None  # no kernel of this size ran eagerly: none may tune or compile inside the capture
    if not capturing:
        state.update(config, k)
    if state.dense_calls_left > 0:
        state.dense_calls_left -= 1
        return "dense", None
    state.prefilled = state.prefilled or not capturing
    return "prefill", state


def always_dense(m: int, k: int, config: policy.LayerConfig, wd_t: torch.Tensor) -> bool:
    """Whether every call of m tokens of width k on a layer with `config` (down weight rows wd_t) runs
    dense, whatever the layer's measured state and in or out of a CUDA-graph capture."""
    if wd_t.stride(1) != 1:
        return True
    if config.decode_max_m < m <= config.decode_sparse_max_m:  # decode or not by the measured density
        return False
    return policy.route(m, k, config, None, False) == "dense" and policy.route(m, k, config, None, True) == "dense"


def _prefill(
    x2, gate_weight, gate_bias, up_weight, up_bias, wd_t, down_bias, threshold, drelu, square, config, state, capturing
):
    """The prefill path: the gate packed to TwELL (the hot neurons' columns left out), up+down, the hot
    neurons' dense products, and the layer's density and hot-neuron probes."""
    m = x2.shape[0]
    tile_n, slots = config.tile_n, config.slots
    n = gate_weight.shape[0]
    # one density probe in flight per layer: a newer one would never land while the host runs ahead
    probe = state.pending is None and not capturing
    hot = state.hot if config.hot_rate is not None else None
    hot_pos = hot.pos if hot is not None else None
    measure = config.hot_rate is not None and not capturing and state.hot_pending is None and state.hot_calls_left == 0
    if config.hot_rate is not None and not capturing:
        state.hot_calls_left = policy.DENSE_RETRY if measure else max(state.hot_calls_left - 1, 0)
    if config.fused_gate and fused_gate_supported(x2, gate_weight, tile_n):
        words, counts = launch_gate_twell(
            x2, gate_weight, gate_bias, threshold, tile_n, slots, square=square, hot_pos=hot_pos
        )
        if measure:
            state.hot_pending = _measure_neurons(F.linear(x2[: policy.HOT_SAMPLE], gate_weight, gate_bias), threshold)
    else:
        pre = F.linear(x2, gate_weight, gate_bias)
        if measure:
            state.hot_pending = _measure_neurons(pre[: policy.HOT_SAMPLE], threshold)
        words, counts = launch_pack_dense(pre, threshold, tile_n, slots, square=square, hot_pos=hot_pos)
        del pre
    if hot is not None:
        h_hot, hot_kept = _hot_products(
            x2, hot.index, gate_weight, gate_bias, up_weight, up_bias, threshold, drelu, square, probe
        )
    # the op boundary (twell.kernels.library) or twell.ops' direct call checked the inputs: the launchers do not again
    y, kept = launch_up_down(
        x2, words, counts, gate_weight, gate_bias, up_weight, up_bias, wd_t, down_bias, tile_n=tile_n,
        threshold=threshold, drelu=drelu, square=square, hot_pos=hot_pos, groups=config.neuron_groups,
    )  # fmt: skip
    if hot is not None:
        y.addmm_(h_hot, wd_t.index_select(0, hot.index))
    if probe:  # kept: counts' total in parts, from the launch that orders the rows
        if hot is not None:
            kept = torch.cat((kept, hot_kept.reshape(1)))
        state.pending = (*_to_host(kept), m * n, hot)
    return y


def _measure_neurons(pre: torch.Tensor, threshold: float) -> tuple:
    """Probe of the hot neurons: how many of pre's rows each neuron fires in, queued to the host."""
    counts = (pre > threshold).sum(0, dtype=torch.int32)
    return (*_to_host(counts), counts, pre.shape[0])


def _rows(weight, bias, index):
    """The rows `index` of a weight [N, K] and of its bias [N] (or None)."""
    return weight.index_select(0, index), bias.index_select(0, index) if bias is not None else None


def _hot_products(x, index, gate_weight, gate_bias, up_weight, up_bias, threshold, drelu, square, probe):
    """(h [M, H], kept) of the hot neurons `index`: act(g) * up(x), or act(g) (squared) without up, by
    cuBLAS products over their gathered rows, as the dense route computes them; kept: how many of their
    pre-activations g pass the threshold (the density probe's hot share; None without probe)."""
    g = F.linear(x, *_rows(gate_weight, gate_bias, index))
    kept = (g > threshold).sum() if probe else None
    if up_weight is None:
        return dense_route.act_mul_(g, None, threshold, drelu=False, square=square), kept
    u = F.linear(x, *_rows(up_weight, up_bias, index))
    return dense_route.act_mul_(g, u, threshold, drelu=drelu, square=False), kept


def gated_ffn_cuda(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, threshold, drelu, config):
    def dense(x2):
        return dense_route.gated_ffn_dense(
            x2, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, threshold, drelu
        )

    return _run(
        x, gate_weight, gate_bias, up_weight, up_bias, down_weight, down_bias, threshold, drelu, False, dense, config
    )


def ffn_cuda(x, up_weight, down_weight, up_bias, down_bias, threshold, squared, config):
    def dense(x2):
        return dense_route.ffn_dense(x2, up_weight, down_weight, up_bias, down_bias, threshold, squared)

    return _run(x, up_weight, up_bias, None, None, down_weight, down_bias, threshold, False, squared, dense, config)
