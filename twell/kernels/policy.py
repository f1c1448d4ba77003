"""Which path a call takes, and the TwELL layout of the prefill path. No Triton import here.

Each rewritten FFN carries a LayerConfig: the module sparsify installs owns it (its layout from the
layer's calibration, where there was one), the ops take its fields as arguments, the dispatcher routes
each call with route(), and calibration's cost model predicts with the same function and values. The
module constants below are the measured defaults of those fields, and the kernels' fixed limits;
nothing assigns them at runtime (to change a layer's route, give it another LayerConfig:
twell.sparsify(model, layer_config=...) or twell.configure(model, ...)).

Defaults measured on an H200, bf16, against the dense FFN in the same run (benchmarks/NOTES.md):
decode wins at every density up to 5% for 1-8 tokens (1.03-1.85x at K=2048, 1.22-1.77x at K=4096;
gpu_check-decode-20261130-165108.json) and loses at 16 tokens and 5% (0.85x), so it serves up to 8,
and up to 16 on layers whose prefill calls measured them at most 1% dense.
Prefill wins from 16384 tokens at 0.5% (1.20-1.40x at K=2048 by pattern, ffn-20261130-184434.json;
1.01-1.32x at K=4096, ffn-20261130-184835.json). Below that, calls stay dense: an eager prefill call
spends 1.25-1.27 ms on the host (Triton's launch path with ~40 arguments a kernel, the autotuner, the
dispatcher's small torch ops) against dense's 0.14-0.18, and its kernels as graph replays take 0.457 /
0.792 ms at 4096 / 8192 tokens against dense 0.436 / 0.851 (host_time-20261201-091757.json). At
K >= 4096 a call's GPU work hides the host time from 8192 tokens (PREFILL_MIN_M_BY_WIDTH).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

# Defaults of LayerConfig's fields (see there).
TILE_N = 128
SLOTS = 16  # tile_n / slots = 8: the reference code's compression factor
DECODE_MAX_M = 8
# 9-16 tokens: decode where the layer is known sparse (1.19-1.37x at <= 1%; 1.06-1.17x at 2%, 0.85x at 5%)
DECODE_SPARSE_MAX_M = 16
PREFILL_MIN_M = 16384
# The prefill threshold of a layer sparsify installs, by width: (min K, tokens) rows, the first with
# K >= min K (default_config; LayerConfig's own default is PREFILL_MIN_M, the narrow layers' value). An
# eager prefill call costs ~0.54 ms on the host whatever its size; a call of width 4096 (N=14336) and 8192
# tokens is ~4 ms of GPU work, so that hides behind it where at K=2048 it does not: the module from 4096
# tokens at K=4096, 8192 tokens, 0.5%: exact 1.16x, uniform 1.07x, skewed 1.50x (0.7% uniform 0.97x),
# and at 4096 tokens 1.23x / 1.03x / 1.43x but 0.95x at 0.7% (ffn-20261205-153342.json); 8 layers of
# the 8B shape, eager, skewed, at 8192 tokens 1.09x against 1.02x dense-routed (e2e-20261205-153500.json;
# both H100). K=2048 stays at 16384 (ffn-20261205-142133.json, e2e-20261205-152911.json).
PREFILL_MIN_M_BY_WIDTH: tuple[tuple[int, int], ...] = ((4096, 8192), (0, PREFILL_MIN_M))
# Gate of the prefill path: the persistent TMA GEMM with the packing epilogue (True) or cuBLAS + the
# pack pass (False); the faster measured at K=2048/N=5632 and K=4096/N=14336 on an H200.
FUSED_GATE = False
# Mean density above which a layer's prefill runs dense, by width: (min K, density) rows, the first with
# K >= min K (LayerConfig.dense_above None: by these rows). The sparse path's crossover depends on K:
# the wider layer's gathered weight rows (235 MB of W_u + W_d at K=4096, N=14336, against 46 MB at
# K=2048) do not stay in L2. Measured on the module (H200, bf16, 32768 tokens, against the faster dense;
# ffn-20261205-094950.json): K=4096 uniform 1.14x / 1.00x / 0.91x at 0.6 / 0.7 / 0.8% (the dense route
# 1.00x at 1%); K=2048 uniform 1.36x at 0.65%, 1.07x forced sparse at 1% (131072 tokens) but topics (448
# hot neurons) 0.90x forced sparse there (ffn-20261205-095017.json): 0.8% stays below K=4096.
DENSE_ABOVE: tuple[tuple[int, float], ...] = ((4096, 0.007), (0, 0.008))
# Hot neurons on the prefill path: neurons firing in more than this share of a layer's prefill
# tokens (measured on the device from a call's first HOT_SAMPLE rows) are computed by dense products
# over just those neurons (the packer leaves their columns out; cuBLAS: their gate and up columns over
# their gathered rows, then their share of the down projection), the rest sparse. A sparse (token,
# neuron) pair gathers 8 KB of weight rows at ~8 TB/s of L2 (~1 ns); a hot neuron costs ~0.02 ns a
# token (measured at K=2048): dense pays from a few percent of tokens (benchmarks/NOTES.md v15).
HOT_RATE: float | None = 0.02
# Training calls (autograd recording) of at least this many tokens take the sparse training path
# (twell.kernels.backward); None: none does. Off by default: a training step through it measured
# 0.16-0.31x of dense at 32768 tokens (dx and dW kernels 6-7x their floors, train-20261130-234135.json).
TRAIN_MIN_M: int | None = None
# Record entries the sparse training path's forward and dx row kernels gather a step: 1, the kernel
# measured in train-20261201-042508.json (one weight row per load, a dependent chain per entry); 2-8
# keep that many rows' loads in flight a program (TRAIN_ENTRIES: the values the kernels take). Not yet
# measured on the GPU: 1 until it is (benchmarks/NOTES.md, v27).
TRAIN_ENTRIES_DEFAULT = 1
TRAIN_ENTRIES = (1, 2, 4, 8)
# Training calls by measured density: a layer whose last measured sparse-path call was denser than this
# (nonzero h over M x N), or had more than backward.BACKUP_MAX_SHARE of its rows past the record width,
# trains its next call dense (cuBLAS, the record unused; measured on the device, read once landed), and
# its backward's dense pass takes as many rows as it measured past the width (the rows past the pass
# walk all N neurons a row, ~10 ms a K=2048 row a program: 25 ms a layer at 1.7% skewed,
# train-model-20261201-230531.json). None: every call sparse, the pass at 1 row in BACKUP_SHARE. The
# switch measured right on the 2B model (train-model-20261202-020334.json: 0.87x at 1.7% with it, 0.42x
# without); dense mode runs dense autograd's nine products on its kept g, u, h (backward._dense_forward).
# 0.007: the sparse step measured 1.04x / 1.08x eager / compiled at 0.65% uniform (the benchmark's
# "0.5%", 36.5 of 5632 a row; train-20261202-020403.json) and ~0.64x at 1.2% (v11), dense mode 0.97-0.99x
# / 1.01-1.03x at 0.65-5% (train-20261202-034750.json): level near 0.69% (benchmarks/NOTES.md,
# "Session 4, fifth GPU run").
TRAIN_DENSE_ABOVE: float | None = 0.007
# The hot-neuron hybrid of the sparse training path: a layer's train_hot most frequent neurons of its
# previous call (a multiple of HOT_ALIGN) by cuBLAS products over just them, forward and backward; the
# record holds the rest. 0 (off) for a layer without calibration: on uniform rates it is predicted
# slower; calibration chooses it per layer (calibrated_train_hot).
TRAIN_HOT = 0
# Calibration's train_hot: of TRAIN_HOT_SIZES (at most HOT_MAX_SHARE of N), the H whose hot products
# save the most, by the layer's share of kept (token, neuron) pairs held by its H most frequent neurons:
# a token's saving is share * kept-per-row sparse pairs moved off the record kernels less H *
# TRAIN_HOT_RATE, the hot products' cost of one (token, hot neuron) in sparse pairs; 0 where no H saves.
# Measured at K=2048 N=5632 32768 tokens, 0.5% skewed (32.3 kept a row; train-20261202-055339.json
# against train-20261202-034919.json): H=256, whose neurons held ~44% of the pairs, took 2.84 ms off
# the pair-bound kernels (fwd + dx + dW: 6.1 ns a moved pair) and added 1.77 (gemm +0.54, the hot part's
# torch elementwise ops +1.15; 0.21 ns a (token, hot neuron)): 0.035 of a pair; with those ops fused
# into two kernels (backward._hot_hidden, _hot_grads) predicted ~0.12 ns (0.020). 0.025 between: the
# skewed layer takes 256 (saving ~7.8 pairs a token: 1.3x of dense compiled), a uniform one (top 256
# ~5-12% of the pairs, each firing on ~0.7% of the tokens) 0. A size saves only where its neurons fire
# in more than TRAIN_HOT_RATE of the tokens on average (benchmarks/NOTES.md, "Training hot v2").
# Measured with the fused kernels (train-20261202-072256.json): skewed H=256 1.44x of dense compiled
# ("other" 1.50 / 1.12 ms eager / compiled against 2.20 / 1.83 unfused), uniform H=256 0.97x;
# calibration chose 256 on every layer of the 8-layer 2B-shape model: 1.11x (train-model-20261202-072408.json).
TRAIN_HOT_SIZES = (128, 256, 512)
TRAIN_HOT_RATE = 0.025
# The sparse training forward through the prefill kernels (backward._pack_forward: the pack pass over the
# dense gate, the up+down kernel, a light kernel writing the record from the TwELL words) in place of the
# one-row-a-program record kernel. K=2048, N=5632, 32768 tokens, 0.5%: the forward 2.58 -> 1.94 ms uniform
# (step 1.07x -> 1.13x of dense compiled, train-20261202-055339 / -072958.json), 2.03 -> 1.34 skewed (1.16x
# -> 1.24x, train-20261202-113748.json), 1.47 -> 0.96 skewed with 256 hot neurons (1.44x -> 1.55x,
# train-20261202-113926.json); benchmarks/NOTES.md, "Session 6, first GPU run".
TRAIN_FORWARD_PACK = True
# Prefill threshold of calls captured into a CUDA graph (their host time is paid once, at capture), where
# an eager call is host-bound: the kernels' GPU time in a graph replay against dense, K=2048 0.5%:
# 1.04x / 1.205x / 1.375x at 4096 / 8192 / 16384 tokens uniform (host_time-20261202-033002.json), 1.42x
# at 8192 skewed (host_time-20261202-035026.json): from 8192 (benchmarks/NOTES.md, "Prefill host v2").
PREFILL_MIN_M_CAPTURED: int | None = 8192
# Passes of the prefill up+down kernel, each over a contiguous group of the TwELL tiles, so that its
# gathered W_u / W_d rows (235 MB at K=4096, N=14336; 46 MB at K=2048, N=5632) stay in the H200's ~50 MB
# L2; y is carried between passes in fp32 (M x K x 8 bytes a pass boundary). Simulated passes (each
# writing its own y) measured 8.63 -> 7.18 ms at two passes, K=4096 uniform 0.5%, 32768 tokens, and no
# gain on skewed rates or at K=2048 (updown_groups-20261205-033435.json); the built passes (fp32 carry)
# did not: 8.61 against 8.69 ms at two passes, uniform, 5.62 against 5.91 skewed, slower at three or four,
# with the autotuner choosing 4 warps for them where one pass takes 8 (updown_groups-20261205-042107.json),
# and not at the one pass's config either: 8.97 against 8.72 ms (updown_groups-20261205-054543.json;
# benchmarks/NOTES.md, session 11). 1: one pass.
NEURON_GROUPS = 1

# The decode kernels' reach from calibration: (min K, max density, tokens) rows, a layer of width K
# >= min K calibrated at most `max density` dense in its decode calls taking the decode kernels for
# calls of up to `tokens` (its decode_max_m; the first row that holds, else DECODE_MAX_M). A row's
# tokens: the largest measured token count up to which every measured count beats the dense route (as
# sparsify installs the module) by >= 3%, per layer in CUDA-graph replays (H200, bf16;
# gpu_check-batched-20261202-024931.json, decode / installed): K=4096 16 tokens 1.53x / 1.46x / 1.14x
# at 0.5% / 1% / 5%, 32 tokens 1.19x / 1.11x / 0.81x, 64 tokens 0.94x; K=2048 16 tokens 1.20x / 1.13x /
# 0.84x, 32 tokens 1.02x / 0.94x (64 tokens 1.04x at 0.5% does not count: 32 loses its 3%). Only K=2048
# and 4096 measured: a K between takes the K=2048 rows, a K below 2048 the same (unmeasured).
DECODE_REACH: tuple[tuple[int, float, int], ...] = ((4096, 0.01, 32), (4096, 0.05, 16), (0, 0.01, 16))

# Sparse training from calibration: (min K, max density, tokens) rows, a layer of width >= min K calibrated
# at most `max density` dense taking the sparse training path for calls of at least `tokens` tokens (its
# train_min_m; the first row that holds). Measured (H200, bf16, 0.5%, compiled against the faster dense):
# K=4096 N=14336 16384 tokens 1.08x uniform / 1.38x skewed, 32768 tokens 1.14x / 1.36x
# (train-20261202-184944.json); K=2048 N=5632 32768 tokens 1.27x / 1.37x (train-20261202-184420.json), but
# 16384 tokens 0.82-0.90x uniform, 0.87-1.03x skewed in two runs of this session (-184420.json, -184806.json;
# 1.06x / 1.17x in session 6's -115632.json): there the step's host time (twell 4.8-6.1 ms against 4.4 ms
# of kernels, train.py's twell_compiled_host_ms) bounds it, and the host's speed varies between machines.
TRAIN_CROSSOVER: tuple[tuple[int, float, int], ...] = ((4096, 0.005, 16384), (0, 0.005, 32768))

# Fixed for every layer:
DECODE_SPARSE_DENSITY = 0.01  # "known sparse" for decode_sparse_max_m: the 1% of DECODE_SPARSE_MAX_M's
MAX_K = 8192  # wider models run dense: the up+down kernel keeps whole x and y rows in registers
DENSE_RETRY = 64  # dense calls before a layer past dense_above is probed again
HOT_SAMPLE = 8192  # rows of a prefill call whose gate sets the layer's hot neurons
HOT_ALIGN = 16  # hot neurons come in multiples of this (GEMM shapes); fewer: no dense products
HOT_MAX_SHARE = 0.25  # at most this share of N is hot (past it the layer is dense: dense_above)
# decode_max_m / prefill_min_m of a route that takes every call (K permitting): any token count
EVERY = 1 << 62
ROUTES = ("decode", "prefill", "dense")


def check_tile(tile_n: int, slots: int) -> None:
    """The TwELL layouts the Triton kernels take: power-of-two tile_n in [16, 256], power-of-two
    slots <= tile_n."""
    for name, value in (("tile_n", tile_n), ("slots", slots)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1 or value & (value - 1):
            raise ValueError(f"the Triton kernels need a power-of-two {name}, got {value!r}")
    if not 16 <= tile_n <= 256:
        raise ValueError(f"the Triton kernels need 16 <= tile_n <= 256, got {tile_n}")
    if slots > tile_n:
        raise ValueError(f"slots must be <= tile_n, got slots={slots}, tile_n={tile_n}")


def check_train_dense_above(value) -> None:
    """LayerConfig.train_dense_above: None or a density in [0, 1]."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1):
        raise ValueError(f"train_dense_above must be a number in [0, 1] or None, got {value!r}")


def check_train_hot(value) -> None:
    """LayerConfig.train_hot: a non-negative multiple of HOT_ALIGN."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value % HOT_ALIGN:
        raise ValueError(f"train_hot must be a non-negative multiple of {HOT_ALIGN}, got {value!r}")


def check_neuron_groups(value, name: str = "neuron_groups") -> None:
    """LayerConfig.neuron_groups (the up+down launcher's `groups`): a positive int."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class LayerConfig:
    """How one rewritten FFN's calls run; defaults: the measured values of this module.

    tile_n, slots: TwELL layout of the prefill path (calibration picks it per layer: its decision's
        tile_n and slots); powers of two, 16 <= tile_n <= 256, slots <= tile_n.
    decode_max_m: calls of at most this many tokens take the decode kernels, and calls of up to
        decode_sparse_max_m tokens do on a layer whose prefill calls measured it at most
        DECODE_SPARSE_DENSITY dense (calibration sets decode_max_m from the layer's density and K,
        calibrated_decode_max_m).
    prefill_min_m: calls of at least this many tokens take the prefill kernels (None: none does);
        sparsify gives each layer its width's (default_config).
    dense_above: a layer whose prefill call measured it denser than this runs its next DENSE_RETRY
        prefill calls dense (None: by the layer's width, DENSE_ABOVE's rows; dense_above_of).
    fused_gate: the prefill gate through the TMA GEMM with the packing epilogue, where the operands
        allow (else cuBLAS + the pack pass).
    hot_rate: on the prefill path, neurons firing in more than this share of the layer's tokens are
        computed by dense products over just those neurons, the rest sparse (None: all sparse).
    train_min_m: training calls (autograd recording) of at least this many tokens take the sparse
        training path (None: none does).
    train_entries: record entries the sparse training path's row kernels (forward, dx) gather a step,
        one of TRAIN_ENTRIES.
    train_dense_above: on the sparse training path, a layer whose last measured call was denser than
        this, or had more than 1/8 of its rows past the record width, trains its next call dense (dense
        autograd's products, its activations kept as dense autograd keeps them), and its backward's
        dense pass is sized by the rows it measured past the width (None: never).
    prefill_min_m_captured: calls being captured into a CUDA graph take the prefill kernels from this
        many tokens, or from prefill_min_m where that is lower (None: from prefill_min_m; a layer with
        no prefill_min_m has no prefill in captures either). A layer whose prefill kernels never ran outside a
        capture at the call's token bucket runs such a call dense (autotuning and first compilation
        cannot happen inside a capture): its first eager call of that size in the captured range runs
        the prefill kernels instead of dense (what torch.compile's CUDA-graph warm-up runs), so the
        capture after it has them tuned.
    train_hot: on the sparse training path, this many neurons (a multiple of HOT_ALIGN; 0: off), the
        most frequent of the layer's previous call, are computed by dense products over just them,
        forward and backward; the record holds the others.
    train_forward_pack: the sparse training path's forward through the prefill kernels (TwELL pack,
        up+down) and a kernel writing the record from the TwELL words (relu² FFNs keep the row kernel).
    neuron_groups: the prefill up+down kernel as this many passes, each over a contiguous group of
        TwELL tiles (so of neurons), y carried between them in fp32: each pass's gathered weight rows
        fit L2 where the whole matrices do not; at the one pass's kernel config, and rows past the
        up+down row width whose passes each fit it are walked in the passes (1: one pass).
    Every other call runs dense, as do all calls with K > MAX_K.
    """

    tile_n: int = TILE_N
    slots: int = SLOTS
    decode_max_m: int = DECODE_MAX_M
    decode_sparse_max_m: int = DECODE_SPARSE_MAX_M
    prefill_min_m: int | None = PREFILL_MIN_M
    dense_above: float | None = None
    fused_gate: bool = FUSED_GATE
    hot_rate: float | None = HOT_RATE  # op_args' order: train_min_m is no op argument
    train_min_m: int | None = TRAIN_MIN_M
    train_entries: int = TRAIN_ENTRIES_DEFAULT
    train_dense_above: float | None = TRAIN_DENSE_ABOVE
    prefill_min_m_captured: int | None = PREFILL_MIN_M_CAPTURED
    train_hot: int = TRAIN_HOT
    train_forward_pack: bool = TRAIN_FORWARD_PACK
    neuron_groups: int = NEURON_GROUPS

    def __post_init__(self):
        check_tile(self.tile_n, self.slots)
        limits = ("decode_max_m", "decode_sparse_max_m", "prefill_min_m", "train_min_m")
        for name in (*limits, "prefill_min_m_captured"):
            value = getattr(self, name)
            optional = name in ("prefill_min_m", "train_min_m", "prefill_min_m_captured")
            if (value is None and optional) or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
                continue
            expected = "a non-negative int or None" if optional else "a non-negative int"
            raise ValueError(f"{name} must be {expected}, got {value!r}")
        above = self.dense_above
        if above is not None and (isinstance(above, bool) or not isinstance(above, (int, float))):
            raise ValueError(f"dense_above must be a number or None, got {above!r}")
        for name in ("fused_gate", "train_forward_pack"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        entries = self.train_entries
        if not isinstance(entries, int) or isinstance(entries, bool) or entries not in TRAIN_ENTRIES:
            raise ValueError(f"train_entries must be one of {TRAIN_ENTRIES}, got {entries!r}")
        check_train_dense_above(self.train_dense_above)
        check_train_hot(self.train_hot)
        check_neuron_groups(self.neuron_groups)
        rate = self.hot_rate
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1):
            raise ValueError(f"hot_rate must be a number in [0, 1] or None, got {rate!r}")

    def replace(self, *, route: str | None = None, **changes) -> LayerConfig:
        """A copy with `changes` (field values). route: "decode", "prefill" or "dense" sets
        the route limits so that every call takes that path (K permitting; a forced prefill never falls
        back to dense for a measured density), before `changes`."""
        known = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(set(changes) - set(known))
        if unknown:
            raise ValueError(f"unknown LayerConfig field(s) {unknown}; known: {known} and route")
        if route is not None:
            if route not in ROUTES:
                raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
            decode = EVERY if route == "decode" else 0
            limits = {"decode_max_m": decode, "decode_sparse_max_m": decode}
            limits["prefill_min_m"] = 1 if route == "prefill" else None
            limits["prefill_min_m_captured"] = None  # captured calls take the forced route too
            if route == "prefill":
                limits["dense_above"] = 1.0  # no density exceeds 1
            changes = {**limits, **changes}
        return dataclasses.replace(self, **changes)

    def op_args(self) -> tuple:
        """The fields the ops take, in their schema's order (after the FFN's own arguments): OP_FIELDS."""
        return tuple(getattr(self, name) for name in OP_FIELDS)


DEFAULT = LayerConfig()


# the fields op_args passes, in its order
OP_FIELDS = (
    "tile_n", "slots", "decode_max_m", "decode_sparse_max_m", "prefill_min_m", "dense_above", "fused_gate",
    "hot_rate", "prefill_min_m_captured", "neuron_groups",
)  # fmt: skip


def op_config(*args) -> LayerConfig:
    """The LayerConfig of an op call's arguments (op_args' order), validated."""
    return LayerConfig(**dict(zip(OP_FIELDS, args, strict=False)))


@functools.lru_cache(maxsize=256, typed=True)  # typed: fused_gate True is not tile_n 1
def from_op_args(*args) -> LayerConfig:
    """op_config, cached: the dispatcher asks on every call."""
    return op_config(*args)


def route(m: int, k: int, config: LayerConfig, density: float | None = None, capturing: bool = False) -> str:
    """ "decode", "prefill" or "dense" for a call of m tokens of width k on a layer with `config`;
    density: the layer's, where measured; capturing: the call is being captured into a CUDA graph (its
    prefill threshold: prefill_min_m_captured where set)."""
    if m == 0 or k > MAX_K:
        return "dense"
    if m <= config.decode_max_m:
        return "decode"
    if m <= config.decode_sparse_max_m and density is not None and density <= DECODE_SPARSE_DENSITY:
        return "decode"
    prefill_min_m = config.prefill_min_m
    if capturing and prefill_min_m is not None and config.prefill_min_m_captured is not None:
        prefill_min_m = min(prefill_min_m, config.prefill_min_m_captured)
    if prefill_min_m is not None and m >= prefill_min_m:
        return "prefill"
    return "dense"


def prefill_min_m_of(k: int) -> int:
    """The prefill threshold of a layer of width k: PREFILL_MIN_M_BY_WIDTH's first row with k >= min K."""
    return next(tokens for min_k, tokens in PREFILL_MIN_M_BY_WIDTH if k >= min_k)


@functools.lru_cache(maxsize=64)  # twell.ops' functions ask on every call without a config
def default_config(k: int) -> LayerConfig:
    """The LayerConfig of a layer of width k before any change: DEFAULT with its width's prefill
    threshold (prefill_min_m_of). What sparsify installs without calibration, what a calibrated
    decision starts from, and what twell.ops' functions run without a config."""
    return DEFAULT.replace(prefill_min_m=prefill_min_m_of(k))


def dense_above_of(config: LayerConfig, k: int) -> float:
    """The density past which a layer of width k with `config` runs its prefill calls dense: its
    dense_above, or where that is None the density of DENSE_ABOVE's first (min K, density) row with
    k >= min K."""
    if config.dense_above is not None:
        return config.dense_above
    return next(density for min_k, density in DENSE_ABOVE if k >= min_k)


def calibrated_decode_max_m(
    density: float | None, k: int = 0, config: LayerConfig = DEFAULT, reach=DECODE_REACH
) -> int:
    """The decode_max_m of a layer of width k calibrated at `density` (mean kept fraction of its decode
    calls): the tokens of reach's first (min K, max density, tokens) row with k >= min K and density <=
    max density, or `config`'s decode_max_m where that is more or no row holds (or the density was not
    measured). What a prefill call's measured density does at run time for 9-16 tokens
    (decode_sparse_max_m), decided once from calibration instead and by the measured reach, so a served
    model whose prompts are short takes the decode kernels too."""
    if density is None:
        return config.decode_max_m
    tokens = next((t for min_k, most, t in reach if k >= min_k and density <= most), 0)
    return max(config.decode_max_m, tokens)


def calibrated_train_min_m(density: float | None, k: int = 0, crossover=TRAIN_CROSSOVER) -> int | None:
    """The train_min_m of a layer of width k calibrated at `density` (mean kept fraction of its calls):
    the tokens of crossover's first (min K, max density, tokens) row with k >= min K and density <= max
    density; None (dense training) where none holds or the density was not measured."""
    if density is None:
        return None
    return next((tokens for min_k, most, tokens in crossover if k >= min_k and density <= most), None)


def calibrated_train_hot(
    shares, kept_per_row: float | None, n: int, sizes=TRAIN_HOT_SIZES, rate: float = TRAIN_HOT_RATE
) -> int:
    """The train_hot of a layer of n neurons calibrated at kept_per_row kept neurons a token (density *
    n), shares: {str(H): share of its kept pairs held by its H most frequent neurons} (empty: not
    measured): the H of `sizes` (at most HOT_MAX_SHARE of n) with the largest positive saving share *
    kept_per_row - H * rate (TRAIN_HOT_RATE); 0 where none has one."""
    best, saving = 0, 0.0
    if not shares or kept_per_row is None:
        return best
    for h in sizes:
        share = shares.get(str(h))
        if share is None or h > n * HOT_MAX_SHARE:
            continue
        if share * kept_per_row - h * rate > saving:
            best, saving = h, share * kept_per_row - h * rate
    return best


def hot_count(counts, rows: int, rate: float) -> int:
    """How many neurons a layer's prefill calls compute by dense products: those that fired in more than
    `rate` of `rows` tokens (counts: per neuron, a tensor), at most HOT_MAX_SHARE of them, in multiples
    of HOT_ALIGN (0: none). The dispatcher takes the most frequent that many; calibration predicts so."""
    n = counts.shape[0]
    return min(int((counts > rate * rows).sum()), int(n * HOT_MAX_SHARE)) // HOT_ALIGN * HOT_ALIGN


def train_width(n: int) -> int:
    """Record slots per token row of the sparse training path for N hidden neurons: a power of two
    >= N/32 (>= 3% density, several times the 0.5-1% a trained sparse model keeps, so only unusually
    dense rows take the dense backup; the record costs 8 bytes a slot), at least 64, at most N rounded
    up to a power of two."""
    return min(1 << max(n - 1, 0).bit_length(), max(64, 1 << (-(-n // 32) - 1).bit_length()))
