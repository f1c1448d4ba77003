"""Calibration: measure each FFN's activation sparsity, decide where twell pays, and save the decisions.

    candidates = twell.passes.find_ffns(model)
    decisions = twell.calibrate(model, candidates, batches)   # {Candidate.path: Decision}
    save_plan(decisions, candidates, "plan.json"); load_plan("plan.json", candidates)

Measurement: forward hooks on each candidate's ``gate_module`` (the linear whose output, the
pre-activation, is thresholded; for one expert of a mixture-of-experts layer, the experts module, whose
call gives that expert's pre-activation through the candidate's ``measure``) count, per call, the
entries that survive ``not (h <= threshold)``:
nonzeros per row, per (row, tile) for each candidate tile width, per neuron. Prefill-shaped calls
(many tokens per sequence) and decode-shaped calls (one token per sequence, from a few greedy cached
decode steps after each batch) are kept apart. Separately, the model and each FFN module (on the inputs
it received) are timed on the first batch, for the FFN share of model time.

Decision, per layer: the TwELL layout (tile width, compression) with the fewest slots whose overflow
rows stay under ``max_overflow``; then, per phase, the cost model's predicted FFN speedup at the
phase's measured density and tokens per call, for the layer as it would run: its LayerConfig
(Decision.layer_config: that layout, the default route limits, and sparsify's layer_config changes),
routed by twell.kernels.policy.route as the dispatcher routes it; rewrite when either phase's
prediction reaches ``min_speedup``. A phase of a rewritten layer predicted slower than dense runs
dense (Decision.dense_phases: its route limits turned off). A rewritten layer runs with that same
LayerConfig.

Sharded models (FSDP2, tensor parallelism; every rank calls calibrate): a column-wise sharded gate's
slices are gathered, so each layer is measured over all its neurons (tiles counted within each rank's
slice, as the kernels run them; the cost model sees the width one rank runs); FFNs are not timed on
their own; and rank 0's decisions are broadcast, so every rank rewrites the same layers.

Cost models:

- ``AnalyticCostModel`` (CPU, or no GPU): documented fits. Calls the dispatcher runs dense
  (twell.kernels.policy.route with the layer's LayerConfig: too few tokens for prefill, K too wide,
  density past its dense_above, 0.8% by default) have ratio 1. Prefill calls: the twell/dense time
  ratio is ``a + b * density``, fitted to twell's own kernels on an H200 (benchmarks/NOTES.md, K=2048,
  N=5632, 131072 tokens: ratio 0.83 at 0.5% density, mean of two timings 0.78 and 0.88; 1.00 at 1%).
  The fit is for K=2048: at K=4096, N=14336 the measured ratio at 0.5% is 0.95 (1.05x), so it is
  optimistic for wider models. Decode calls: the same form with intercept and slope measured at one
  token and at 16 (``AnalyticCostModel.decode_one`` / ``decode_16``), linear in log2(tokens) between.
  With the default ``min_speedup`` of 1.05, layers at or under 0.8% are rewritten for prefill, and
  layers up to several percent for their decode steps. On the CPU twell runs plain PyTorch, so this
  predicts GPU behaviour, not CPU time.
- ``BenchmarkCostModel`` (CUDA): times dense PyTorch against ``torch.ops.twell.*`` at the layer's shape
  and measured density (synthetic inputs: a gate threshold at the normal quantile that keeps that
  density) with the layer's LayerConfig, cached on disk per GPU name / dtype / shape / density bucket
  / LayerConfig. The timer is injectable, so
  the model is testable without a GPU.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import re
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from twell.distributed import agree, full_hidden, sharded
from twell.format import check_layout, kept_mask
from twell.kernels import policy
from twell.kernels.policy import LayerConfig

PLAN_FORMAT = "twell-plan"
PLAN_VERSION = 1
PHASES = ("prefill", "decode")
# Quantiles of the per-neuron firing rates kept in the statistics: the shape of a layer's rate
# distribution (dead neurons at the bottom, a long tail of frequent ones at the top).
NEURON_RATE_QUANTILES = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 0.999, 1.0)


# ---------------------------------------------------------------------------------------------------
# Configuration


@dataclass
class CalibrationConfig:
    """Options of calibrate(); pass an instance, a dict of the same fields, or None for the defaults.

    tile_widths, compressions: TwELL layouts considered (each pair must satisfy format.check_layout and
        be one the kernels run: power-of-two tile widths from 16 to 256, twell.kernels.policy.check_tile).
    max_overflow: largest tolerated fraction of rows that overflow a tile's slots (they run dense).
    min_speedup: rewrite a layer only if its predicted FFN speedup reaches this.
    decode_steps: greedy cached decode steps after each batch (Hugging Face-style models only), so that
        decode-shaped (one token) calls are measured too; 0 disables.
    timing_repeats: repetitions (best of) when timing the model and each FFN on the first batch, for the
        FFN share of model time; 0 disables.
    benchmark_tokens: tokens per call (M) at which the cost model predicts prefill calls; None: the
        median of the calibration's own calls, raised to the size from which twell's prefill kernels
        run (the layer's LayerConfig.prefill_min_m: serving prefills are larger than calibration's).
    cost_model: "auto" (benchmark on CUDA, analytic elsewhere), "analytic", "benchmark", or an object
        with ``name`` and ``time_ratio(...)`` (see CostModel).
    cache_dir: where the benchmark cost model keeps its timings (default: $TWELL_CACHE_DIR, else
        $XDG_CACHE_HOME/twell, else ~/.cache/twell).
    progress: show a progress bar over batches on stderr, when stderr is a terminal.
    """

    tile_widths: tuple[int, ...] = (64, 128, 256)
    compressions: tuple[int, ...] = (2, 4, 8)
    max_overflow: float = 0.01
    min_speedup: float = 1.05
    decode_steps: int = 4
    timing_repeats: int = 5
    benchmark_tokens: int | None = None
    cost_model: Any = "auto"
    cache_dir: str | os.PathLike | None = None
    progress: bool = True

    @classmethod
    def coerce(cls, config: CalibrationConfig | Mapping | None) -> CalibrationConfig:
        if config is None:
            return cls()
        if isinstance(config, cls):
            cfg = config
        elif isinstance(config, Mapping):
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(config) - known)
            if unknown:
                raise ValueError(f"unknown calibration option(s) {unknown}; known: {sorted(known)}")
            cfg = cls(**config)
        else:
            raise TypeError(f"config must be a CalibrationConfig, a dict or None, got {type(config).__name__}")
        for name in ("tile_widths", "compressions"):
            values = getattr(cfg, name)
            if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
                raise ValueError(f"{name} must be a sequence of ints, got {values!r}")
        cfg.layouts()
        if isinstance(cfg.min_speedup, bool) or not isinstance(cfg.min_speedup, (int, float)):
            raise ValueError(f"min_speedup must be a number, got {cfg.min_speedup!r}")
        if not math.isfinite(cfg.min_speedup) or cfg.min_speedup < 0:  # 0: rewrite every layer that fits
            raise ValueError(f"min_speedup must be a finite number >= 0, got {cfg.min_speedup!r}")
        if not 0.0 <= cfg.max_overflow < 1.0:
            raise ValueError(f"max_overflow must be in [0, 1), got {cfg.max_overflow}")
        for name in ("decode_steps", "timing_repeats"):
            if not isinstance(getattr(cfg, name), int) or getattr(cfg, name) < 0:
                raise ValueError(f"{name} must be a non-negative int, got {getattr(cfg, name)!r}")
        if cfg.benchmark_tokens is not None and (not isinstance(cfg.benchmark_tokens, int) or cfg.benchmark_tokens < 1):
            raise ValueError(f"benchmark_tokens must be a positive int or None, got {cfg.benchmark_tokens!r}")
        return cfg

    def layouts(self) -> list[tuple[int, int]]:
        """Valid (tile_n, compression) pairs, in order of preference: most compression first (fewest
        slots to scan), then the tile width nearest the kernels' default (the measured layout: a chosen
        layout is the one the layer's kernels run)."""
        pairs = []
        for tile_n in self.tile_widths:
            for compression in self.compressions:
                policy.check_tile(tile_n, check_layout(tile_n, compression))
                pairs.append((tile_n, compression))
        if not pairs:
            raise ValueError("tile_widths and compressions must not be empty")
        return sorted(pairs, key=lambda p: (-p[1], abs(math.log2(p[0] / policy.TILE_N)), -p[0]))


# ---------------------------------------------------------------------------------------------------
# Per-layer statistics


def _percentile(hist: torch.Tensor, q: float) -> int:
    """Nearest-rank percentile of the values whose histogram (counts of 0, 1, 2, ...) is `hist`."""
    hist = hist.cpu()
    total = int(hist.sum())
    if total == 0:
        return 0
    rank = max(1, math.ceil(q * total))
    return int(torch.searchsorted(hist.cumsum(0), torch.tensor(rank)).item())


class _PhaseCounter:
    """Running counts for one (layer, phase): histograms, so percentiles are exact at any data size."""

    def __init__(self, n: int, tile_widths: Iterable[int], device: torch.device, shards: int = 1):
        self.n = n
        self.shards = shards  # tensor parallelism: each rank's slice of the neurons is tiled on its own
        self.calls = 0
        self.rows_per_call: list[int] = []
        self.nnz_hist = torch.zeros(n + 1, dtype=torch.int64, device=device)
        self.tile_max_hist = {t: torch.zeros(min(t, n) + 1, dtype=torch.int64, device=device) for t in tile_widths}
        self.neuron_counts = torch.zeros(n, dtype=torch.int64, device=device)

    def add(self, keep: torch.Tensor) -> None:
        """keep: [M, N] bool, the surviving entries of one call."""
        m, n = keep.shape
        self.calls += 1
        self.rows_per_call.append(m)
        self.nnz_hist += torch.bincount(keep.sum(dim=1), minlength=n + 1)
        self.neuron_counts += keep.sum(dim=0)
        for tile_n, hist in self.tile_max_hist.items():
            per_tile = []
            for part in keep.chunk(self.shards, dim=1):  # the slices of DTensor's Shard (torch.chunk)
                n_tiles = -(-part.shape[1] // tile_n)
                padded = torch.nn.functional.pad(part, (0, n_tiles * tile_n - part.shape[1]))
                per_tile.append(padded.view(m, n_tiles, tile_n).sum(dim=-1))
            hist += torch.bincount(torch.cat(per_tile, dim=1).max(dim=1).values, minlength=hist.numel())

    @property
    def rows(self) -> int:
        return int(self.nnz_hist.sum())

    def overflow_fraction(self, tile_n: int, compression: int) -> float:
        """Fraction of rows with more kept entries than slots (tile_n // compression) in some tile."""
        hist = self.tile_max_hist[tile_n]
        slots = tile_n // compression
        return float(hist[slots + 1 :].sum()) / max(self.rows, 1)

    def summary(self, layouts: list[tuple[int, int]]) -> dict:
        rows = self.rows
        values = torch.arange(self.n + 1, device=self.nnz_hist.device)
        nnz_total = int((self.nnz_hist * values).sum())
        overflow: dict[str, dict[str, float]] = {}
        for tile_n, compression in sorted(layouts):
            overflow.setdefault(str(tile_n), {})[str(compression)] = self.overflow_fraction(tile_n, compression)
        return {
            "calls": self.calls,
            "rows": rows,
            "rows_per_call_median": int(statistics.median(self.rows_per_call)),
            "density": nnz_total / max(rows * self.n, 1),
            "nnz_per_row": {
                "mean": nnz_total / max(rows, 1),
                "p50": _percentile(self.nnz_hist, 0.5),
                "p99": _percentile(self.nnz_hist, 0.99),
                "max": int(torch.nonzero(self.nnz_hist).max()) if rows else 0,
            },
            "max_nnz_per_tile": {
                str(t): int(torch.nonzero(h).max()) if rows else 0 for t, h in self.tile_max_hist.items()
            },
            "overflow_rows": overflow,
            "neuron_rates": self.neuron_rate_quantiles(),
        }

    def neuron_rate_quantiles(self) -> dict[str, float]:
        """{quantile: rate}: nearest-rank quantiles of the fraction of rows in which each neuron fired."""
        rates = (self.neuron_counts.double() / max(self.rows, 1)).sort().values.cpu()
        return {str(q): float(rates[max(1, math.ceil(q * self.n)) - 1]) for q in NEURON_RATE_QUANTILES}


class _LayerRecorder:
    """Forward hook on a candidate's gate linear: slices the gate part, thresholds, counts per phase."""

    def __init__(self, candidate, cfg: CalibrationConfig, driver: dict):
        self.candidate = candidate
        self.n = int(candidate.hidden_size)
        self.tile_widths = cfg.tile_widths
        self.driver = driver  # {"phase": ...} set by the loop that runs the model
        self.phases: dict[str, _PhaseCounter] = {}
        self.shards = 1  # slices of the neurons under tensor parallelism (the cost model sees one)

    def __call__(self, module, args, kwargs, output) -> None:
        if self.candidate.measure is None:
            h, self.shards = full_hidden(module, output)
        else:  # an expert: its pre-activation from the experts module's call (experts are not sharded here)
            h = self.candidate.measure(args, kwargs, output)
            if h is None:  # no token was routed to this expert in this call
                return
        if self.candidate.gate_slice is not None:
            h = h[..., self.candidate.gate_slice]
        if h.shape[-1] != self.n:
            raise ValueError(
                f"{self.candidate.path}: the gate output has {h.shape[-1]} features, the candidate says "
                f"hidden_size={self.n}"
            )
        # Decode: the cached one-token steps calibrate drives, or any call where each sequence brings one
        # token ([B, 1, N] or [1, N]; models that flatten tokens, like OPT, are only known by the driver).
        tokens_per_sequence = h.shape[-2] if h.dim() >= 3 else (h.shape[0] if h.dim() == 2 else 1)
        phase = "decode" if self.driver["phase"] == "decode" or tokens_per_sequence == 1 else "prefill"
        counter = self.phases.get(phase)
        if counter is None:
            counter = self.phases[phase] = _PhaseCounter(self.n, self.tile_widths, h.device, self.shards)
        counter.add(kept_mask(h.detach().reshape(-1, self.n), float(self.candidate.threshold)))

    def dead_neurons(self) -> int:
        counts = sum(c.neuron_counts for c in self.phases.values())
        return int((counts == 0).sum())

    def overflow_fraction(self, tile_n: int, compression: int) -> float:
        rows = sum(c.rows for c in self.phases.values())
        over = sum(c.overflow_fraction(tile_n, compression) * c.rows for c in self.phases.values())
        return over / max(rows, 1)


# ---------------------------------------------------------------------------------------------------
# Cost models


class CostModel(Protocol):
    """Predicts twell's FFN time relative to dense (below 1: twell is faster)."""

    name: str

    def time_ratio(
        self, *, kind: str, m: int, k: int, n: int, density: float, dtype: torch.dtype, config: LayerConfig
    ) -> float:
        """twell time / dense time for one FFN call: x [m, k], hidden width n, `density` kept, on a
        layer that runs with `config` (its layout and route limits)."""


@dataclass
class AnalyticCostModel:
    """time ratio = intercept + slope * density, fitted to twell's kernels on an H200 (see module doc).

    Prefill calls: the intercept is the dense gate GEMM plus the pack pass and fixed overheads (0.66 of
    the dense FFN), the slope the sparse up/down stage per unit density. Decode calls: (intercept, slope)
    measured at one token (decode_one) and at 16 (decode_16), between them linear in log2(tokens).
    """

    intercept: float = 0.66
    slope: float = 34.0
    # K=2048, N=5632, CUDA-graph replays against the faster dense: one token 0.415-0.450 of dense at 0.5%
    # (by pattern), 0.433-0.478 at 1%, 0.508 at 5% (ffn-20261201-131614.json); 16 tokens 0.81-0.84 at
    # 0.5%, 0.90 at 1%, 1.20 at 5% (ffn-20261201-114900.json). K=4096 measured faster at 0.5% (one token
    # 0.39-0.41, 16 tokens 0.69-0.73).
    decode_one: tuple[float, float] = (0.43, 1.6)
    decode_16: tuple[float, float] = (0.79, 8.2)
    name: str = "analytic (density threshold, twell kernels on H200)"

    def time_ratio(
        self, *, kind: str, m: int, k: int, n: int, density: float, dtype: torch.dtype, config=policy.DEFAULT
    ) -> float:
        path = policy.route(m, k, config, density)
        if path == "decode":
            return self.decode_ratio(m, density)
        # calls the dispatcher sends to the dense route cost what dense costs (eager parity, measured)
        if path != "prefill" or density > config.dense_above:
            return 1.0
        return self.intercept + self.slope * density

    def decode_ratio(self, m: int, density: float) -> float:
        """The decode kernels' time ratio for calls of m tokens (past 16 extrapolated: 64 tokens, forced,
        measured 1.00 / 1.10 of dense's time at 0.5 / 1%, the extrapolation 1.02 / 1.07)."""
        f = math.log2(max(m, 1)) / 4
        (a1, b1), (a16, b16) = self.decode_one, self.decode_16
        return a1 + (a16 - a1) * f + (b1 + (b16 - b1) * f) * density

    def break_even_density(self, speedup: float = 1.0) -> float:
        """Largest density at which the predicted speedup is at least `speedup`."""
        return (1.0 / speedup - self.intercept) / self.slope


def _default_cache_dir() -> Path:
    if os.environ.get("TWELL_CACHE_DIR"):
        return Path(os.environ["TWELL_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "twell"


def cuda_median_time(fn: Callable[[], Any], warmup: int = 3, reps: int = 15) -> float:
    """Median seconds of fn() on the current CUDA stream (CUDA events), after warm-up (autotuning)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def cuda_graph_time(fn: Callable[[], Any], calls: int = 8) -> float:
    """Median seconds of one fn() as a CUDA-graph replay (`calls` of them captured in one graph, so the
    replay's launch is shared): how decode steps run when served (static cache, compiled with
    reduce-overhead); timed eagerly, calls this small measure the host's launches."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compiles and autotunes outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return cuda_median_time(graph.replay) / calls


class BenchmarkCostModel:
    """Micro-benchmark of dense vs twell at a layer's shape and density, cached on disk.

    Cache key: GPU name, twell version, kind, dtype, M bucketed to the next power of two, K, N, the
    density bucketed to quarter octaves (the benchmark runs at the bucket's centre), and the layer's
    LayerConfig (the op runs with it), and "graph" for calls timed as graph replays (below), so a
    model's layers share timings and reruns are free. Inputs are synthetic: x ~ N(0, 1), gate weights
    ~ N(0, 1/K), and the gate threshold at the normal quantile keeping `density` (uniform, not a real
    model's skewed neurons: a conservative estimate).

    Calls the layer's route sends to the decode kernels are timed as CUDA-graph replays, both sides
    (graph_timer); if either cannot be captured, both are timed eagerly.

    timer, graph_timer: fn -> seconds (defaults: cuda_median_time, cuda_graph_time); device_name: the
    cache's GPU name (default: the CUDA device's). All injectable, so the model is testable on the CPU.
    """

    def __init__(
        self,
        *,
        device: str | torch.device = "cuda",
        timer: Callable[[Callable[[], Any]], float] | None = None,
        graph_timer: Callable[[Callable[[], Any]], float] | None = None,
        device_name: str | None = None,
        cache_dir: str | os.PathLike | None = None,
    ):
        self.device = torch.device(device)
        self.timer = timer or cuda_median_time
        self.graph_timer = graph_timer or cuda_graph_time
        if device_name is None:
            if self.device.type != "cuda":
                raise ValueError("BenchmarkCostModel needs a CUDA device, or an explicit device_name and timer")
            device_name = torch.cuda.get_device_name(self.device)
        self.device_name = device_name
        self.cache_path = Path(cache_dir or _default_cache_dir()) / "costs.json"
        self.name = f"benchmark on {device_name}"
        self._cache = self._read_cache()

    def _read_cache(self) -> dict:
        try:
            data = json.loads(self.cache_path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _write_cache(self) -> None:
        self.cache_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.cache_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self._cache, indent=1, sort_keys=True))
        os.replace(tmp, self.cache_path)

    @staticmethod
    def density_bucket(density: float) -> float:
        """Quarter-octave bucket centre of a density in [1e-4, 1]."""
        density = min(max(density, 1e-4), 1.0)
        return min(2.0 ** (round(math.log2(density) * 4) / 4), 1.0)

    @staticmethod
    def tokens_bucket(m: int) -> int:
        return 1 << max(0, int(m) - 1).bit_length()

    def cache_key(
        self, *, kind: str, m: int, k: int, n: int, density: float, dtype: torch.dtype, config=policy.DEFAULT
    ) -> str:
        import twell

        dtype_name = str(dtype).removeprefix("torch.")
        bucket_m, bucket_d = self.tokens_bucket(m), self.density_bucket(density)
        route = ",".join(map(str, config.op_args()))
        graph = "|graph" if policy.route(bucket_m, k, config, bucket_d) == "decode" else ""
        return (
            f"{self.device_name}|twell {twell.__version__}|{kind}|{dtype_name}|M{bucket_m}|K{k}|N{n}|d{bucket_d:.6g}"
            f"|{route}{graph}"
        )

    def timings(
        self, *, kind: str, m: int, k: int, n: int, density: float, dtype: torch.dtype, config=policy.DEFAULT
    ) -> dict:
        """{"dense_s", "twell_s"} for the bucketed case, measured once then read from the cache."""
        key = self.cache_key(kind=kind, m=m, k=k, n=n, density=density, dtype=dtype, config=config)
        if key not in self._cache:
            bucket_m, bucket_d = self.tokens_bucket(m), self.density_bucket(density)
            dense_fn, twell_fn = self._cases(kind, bucket_m, k, n, bucket_d, dtype, config)
            entry = None
            if key.endswith("|graph"):
                try:
                    entry = self._measure(self.graph_timer, dense_fn, twell_fn, "graph")
                except RuntimeError:  # a capture that fails: both sides eager, as for other calls
                    pass
            self._cache[key] = entry or self._measure(self.timer, dense_fn, twell_fn, "eager")
            self._write_cache()
        return self._cache[key]

    @staticmethod
    def _measure(timer, dense_fn, twell_fn, timing: str) -> dict:
        return {"dense_s": float(timer(dense_fn)), "twell_s": float(timer(twell_fn)), "timing": timing}

    def time_ratio(
        self, *, kind: str, m: int, k: int, n: int, density: float, dtype: torch.dtype, config=policy.DEFAULT
    ) -> float:
        t = self.timings(kind=kind, m=m, k=k, n=n, density=density, dtype=dtype, config=config)
        return t["twell_s"] / t["dense_s"]

    def _cases(self, kind: str, m: int, k: int, n: int, density: float, dtype: torch.dtype, config: LayerConfig):
        import torch.nn.functional as F

        import twell.ops

        gen = torch.Generator(device=self.device).manual_seed(0)

        def randn(*shape, scale=1.0):
            return torch.randn(*shape, generator=gen, device=self.device, dtype=torch.float32).mul_(scale).to(dtype)

        x = randn(m, k)
        # w_down laid out as sparsify stores it (w_down.t() contiguous): in the nn.Linear layout the
        # dispatcher runs every call dense, and the twell side would time dense
        w_gate, w_up = randn(n, k, scale=k**-0.5), randn(n, k, scale=k**-0.5)
        w_down = randn(n, k, scale=n**-0.5).t()
        # Pre-activations are ~N(0, 1): keeping those above the (1 - density) normal quantile keeps `density`.
        threshold = (
            float(torch.special.ndtri(torch.tensor(1.0 - density, dtype=torch.float64))) if density < 1 else -1e9
        )
        if kind == "gated":
            dense = lambda: F.linear(torch.relu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)
            sparse = lambda: twell.ops.gated_ffn(x, w_gate, w_up, w_down, threshold=threshold, config=config)
        else:
            dense = lambda: F.linear(torch.relu(F.linear(x, w_gate)), w_down)
            sparse = lambda: twell.ops.ffn(x, w_gate, w_down, threshold=threshold, config=config)
        return dense, sparse


def resolve_cost_model(spec: Any, device: torch.device, cache_dir=None) -> CostModel:
    """The cost model named by CalibrationConfig.cost_model, for a model that lives on `device`."""
    if spec == "auto":
        spec = "benchmark" if device.type == "cuda" else "analytic"
    if spec == "analytic":
        return AnalyticCostModel()
    if spec == "benchmark":
        return BenchmarkCostModel(device=device, cache_dir=cache_dir)
    if isinstance(spec, str) or not callable(getattr(spec, "time_ratio", None)):
        raise ValueError(f"cost_model must be 'auto', 'analytic', 'benchmark' or a CostModel, got {spec!r}")
    return spec


# ---------------------------------------------------------------------------------------------------
# Decisions


@dataclass
class Decision:
    """What calibration decided for one FFN, and the measurements behind it.

    rewrite / reason: the decision and why. tile_n / compression: the TwELL layout (None when not
    rewritten for lack of a layout). density: mean kept fraction over all calls. stats: per phase
    ("prefill", "decode") the counts of _PhaseCounter.summary. predicted_speedup: FFN time dense / twell,
    per phase. time_share: fraction of model time spent in this FFN, per phase (dense; for an FFN
    written inline in a bigger module, the time of its linears). min_speedup: the threshold the
    predicted speedups were held against (None when nothing was predicted). dense_phases: the phases of
    a rewritten FFN whose calls run dense because twell was predicted slower there (their
    predicted_speedup is then 1).
    """

    path: str
    rewrite: bool
    reason: str
    kind: str = "gated"
    hidden_size: int = 0
    model_size: int = 0
    threshold: float = 0.0
    tile_n: int | None = None
    compression: int | None = None
    density: float | None = None
    dead_neurons: int | None = None
    overflow_rows: float | None = None
    predicted_speedup: dict[str, float] = field(default_factory=dict)
    time_share: dict[str, float] = field(default_factory=dict)
    stats: dict[str, dict] = field(default_factory=dict)
    cost_model: str | None = None
    min_speedup: float | None = None
    dense_phases: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        """JSON-serialisable dict (round-trips through from_dict)."""
        return dataclasses.asdict(self)

    def layer_config(self, changes: Mapping | None = None) -> LayerConfig:
        """The LayerConfig the FFN runs with once rewritten: this decision's layout (the defaults without
        one) and its dense phases' routes turned off, then `changes` (checked by layer_changes)."""
        density = self.stats.get("decode", {}).get("density", self.density)
        config = policy.DEFAULT.replace(batched_max_m=policy.calibrated_batched_max_m(density))
        if self.tile_n is not None:
            config = config.replace(tile_n=self.tile_n, slots=self.tile_n // self.compression)
        return config.replace(**{**self.route_changes(), **(changes or {})})

    def route_changes(self) -> dict:
        """LayerConfig changes that send the dense phases' calls to the dense route."""
        changes = {}
        if "decode" in self.dense_phases:
            changes.update(decode_max_m=0, decode_sparse_max_m=0, batched_max_m=0)
        if "prefill" in self.dense_phases:
            changes["prefill_min_m"] = None
        return changes

    @classmethod
    def from_dict(cls, data: Mapping) -> Decision:
        known = {f.name for f in dataclasses.fields(cls)}
        missing = {"path", "rewrite", "reason"} - set(data)
        if missing:
            raise ValueError(f"decision is missing {sorted(missing)}")
        decision = cls(**{k: v for k, v in data.items() if k in known})
        if not isinstance(decision.dense_phases, list) or not set(decision.dense_phases) <= set(PHASES):
            raise ValueError(f"decision for {decision.path}: dense_phases must be a list of {PHASES}")
        if decision.tile_n is not None or decision.compression is not None:
            try:
                check_layout(decision.tile_n, decision.compression)
            except ValueError as e:
                raise ValueError(f"decision for {decision.path}: invalid TwELL layout: {e}") from None
        return decision


def layer_changes(changes: Mapping | None, calibrated: bool) -> dict:
    """sparsify's layer_config: LayerConfig field changes (and "route", see LayerConfig.replace) for
    every rewritten FFN, checked. calibrated: the layers' layouts come from decisions, so the changes
    may not set tile_n or slots."""
    if changes is None:
        return {}
    if not isinstance(changes, Mapping):
        raise TypeError(f"layer_config must be a dict of LayerConfig fields, got {type(changes).__name__}")
    changes = dict(changes)
    policy.DEFAULT.replace(**changes)  # unknown fields and bad values fail here, before any model runs
    layout = sorted({"tile_n", "slots"} & set(changes))
    if calibrated and layout:
        raise ValueError(
            f"layer_config sets {layout}: with calibration data or a plan, each layer's layout is its decision's"
        )
    return changes


def _decide(
    candidate, recorder: _LayerRecorder, cfg: CalibrationConfig, cost: CostModel, shares, dtype, changes: dict
) -> Decision:
    decision = Decision(
        path=candidate.path,
        rewrite=False,
        reason="",
        kind=candidate.kind,
        hidden_size=int(candidate.hidden_size),
        model_size=int(candidate.model_size),
        threshold=float(candidate.threshold),
        time_share={p: s for p, s in shares.items() if s is not None},
        cost_model=cost.name,
    )
    # A tile wider than the layer only adds empty slots: keep tile widths up to N (the smallest if none).
    all_layouts = cfg.layouts()
    narrowest = min(t for t, _ in all_layouts)
    layouts = [(t, c) for t, c in all_layouts if t <= max(decision.hidden_size, narrowest)]
    if not recorder.phases:
        decision.reason = "never called during calibration"
        return decision
    decision.stats = {p: c.summary(layouts) for p, c in recorder.phases.items()}
    rows = sum(c.rows for c in recorder.phases.values())
    kept = sum(s["density"] * s["rows"] for s in decision.stats.values())
    decision.density = kept / max(rows, 1)
    decision.dead_neurons = recorder.dead_neurons()

    fitting = [(t, c) for t, c in layouts if recorder.overflow_fraction(t, c) <= cfg.max_overflow]
    if not fitting:
        t, c = min(layouts, key=lambda p: recorder.overflow_fraction(*p))
        decision.overflow_rows = recorder.overflow_fraction(t, c)
        decision.reason = (
            f"too dense for TwELL: {decision.overflow_rows:.1%} of rows overflow even at tile {t} / compression "
            f"{c} (limit {cfg.max_overflow:.1%})"
        )
        return decision
    decision.tile_n, decision.compression = fitting[0]
    decision.overflow_rows = recorder.overflow_fraction(*fitting[0])
    config = decision.layer_config(changes)  # what the layer will run with
    for phase, counter in recorder.phases.items():
        stats = decision.stats[phase]
        m = _predicted_tokens(cfg, phase, stats["rows_per_call_median"], config)
        density, hot_share = _sparse_share(counter, config, stats, m, decision.model_size)
        ratio = cost.time_ratio(
            kind=candidate.kind,
            m=m,
            k=decision.model_size,
            n=-(-decision.hidden_size // recorder.shards),  # the width each rank runs
            density=density,
            dtype=dtype,
            config=config,
        )
        if ratio < 1.0:  # the hot neurons' dense products cost about their share of the dense FFN
            ratio = min(1.0, ratio + hot_share)
        # Overflow rows run dense inside the hybrid format.
        overflow = counter.overflow_fraction(decision.tile_n, decision.compression)
        decision.predicted_speedup[phase] = 1.0 / ((1.0 - overflow) * ratio + overflow)
    # Rewrite where any phase pays; a phase twell would slow down then runs dense (its route turned
    # off), so no phase of a rewritten FFN is predicted slower than dense.
    speedups = decision.predicted_speedup
    best = max(speedups, key=speedups.get)
    decision.min_speedup = float(cfg.min_speedup)
    decision.rewrite = speedups[best] >= cfg.min_speedup
    verdict = "reaching" if decision.rewrite else "below"
    decision.reason = (
        f"predicted {speedups[best]:.2f}x ({best}, {decision.stats[best]['density']:.2%} dense), "
        f"{verdict} the {cfg.min_speedup:.2f}x threshold"
    )
    if decision.rewrite:
        decision.dense_phases = [p for p in PHASES if speedups.get(p, 1.0) < 1.0]
        for phase in decision.dense_phases:
            decision.reason += f"; {phase} calls run dense (predicted {speedups[phase]:.2f}x)"
            speedups[phase] = 1.0
    return decision


# Fewer calibration rows than this give no hot-neuron estimate: from a few rows a neuron's rate cannot
# tell 2% from 0 (the dispatcher measures from up to policy.HOT_SAMPLE rows of a prefill call).
HOT_MIN_ROWS = 1024


def _sparse_share(counter: _PhaseCounter, config: LayerConfig, stats: dict, m: int, k: int) -> tuple[float, float]:
    """(density left to the sparse kernels, hot neurons / N) for calls of m tokens: on the prefill path
    the layer's hot neurons (policy.hot_count over the calibration rows) run as dense products;
    stats["hot_neurons"] records how many."""
    density, rows = stats["density"], counter.rows
    if config.hot_rate is None or rows < HOT_MIN_ROWS or policy.route(m, k, config) != "prefill":
        return density, 0.0
    hot = policy.hot_count(counter.neuron_counts, rows, config.hot_rate)
    stats["hot_neurons"] = hot
    if hot == 0:
        return density, 0.0
    hot_pairs = int(counter.neuron_counts.sort(descending=True).values[:hot].sum())
    return max(density - hot_pairs / (rows * counter.n), 0.0), hot / counter.n


def _predicted_tokens(cfg: CalibrationConfig, phase: str, observed: int, config: LayerConfig) -> int:
    """Tokens per call the cost model predicts for: decode as observed; prefill at benchmark_tokens,
    else at least the size from which the layer's prefill kernels run (calibration batches are smaller
    than serving prefills)."""
    if phase != "prefill":
        return observed
    return cfg.benchmark_tokens or max(observed, config.prefill_min_m or 0)


def predicted_model_speedup(decisions: Mapping[str, Decision], phase: str = "prefill") -> dict:
    """Amdahl over the rewritten FFNs, for `phase`: {"timed_ffns", "ffn_time_share",
    "rewritten_time_share", "speedup"}. Uses each decision's measured time share; FFNs without one
    (not timed) count as no time, so with timed_ffns == 0 the speedup is 1 for want of a measurement.
    """
    share = rewritten_share = 0.0
    saved = 0.0
    timed = 0
    for d in decisions.values():
        s = d.time_share.get(phase)
        if s is None:
            continue
        timed += 1
        share += s
        if d.rewrite and phase in d.predicted_speedup:
            rewritten_share += s
            saved += s * (1.0 - 1.0 / d.predicted_speedup[phase])
    return {
        "timed_ffns": timed,
        "ffn_time_share": share,
        "rewritten_time_share": rewritten_share,
        "speedup": 1.0 / (1.0 - saved),
    }


# ---------------------------------------------------------------------------------------------------
# Running the model


def _model_device(model: torch.nn.Module) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def _model_dtype(model: torch.nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _as_kwargs(batch, device: torch.device) -> dict:
    if isinstance(batch, torch.Tensor):
        if batch.dtype not in (torch.int64, torch.int32) or batch.dim() not in (1, 2):
            raise ValueError(
                f"a tensor batch must hold token ids [batch, seq] or [seq], got {batch.dtype} {list(batch.shape)}"
            )
        batch = {"input_ids": batch if batch.dim() == 2 else batch.unsqueeze(0)}
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"calibration batches must be token-id tensors or dicts of forward kwargs, got {type(batch).__name__}"
        )
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _cache_argument(model: torch.nn.Module) -> str | None:
    """Name of the KV-cache argument of a Hugging Face causal LM (transformers renamed it in 5.x), or
    None for models without one (or without a config that enables caching): those get no decode steps."""
    if getattr(getattr(model, "config", None), "use_cache", None) is None:
        return None
    parameters = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return name
    return None


def _run_batch(model, kwargs: dict, decode_steps: int, on_phase: Callable[[str], None] = lambda phase: None) -> None:
    """One prefill call, then `decode_steps` greedy one-token calls on the KV cache where supported."""
    on_phase("prefill")
    cache_argument = _cache_argument(model) if decode_steps and "input_ids" in kwargs else None
    if cache_argument is None:
        model(**kwargs)
        return
    out = model(**{**kwargs, "use_cache": True})
    mask = kwargs.get("attention_mask")
    on_phase("decode")
    for _ in range(decode_steps):
        cache = out.get(cache_argument) if isinstance(out, Mapping) else None
        if cache is None or out.get("logits") is None:
            return
        token = out["logits"][:, -1:].argmax(dim=-1)
        step = {"input_ids": token, cache_argument: cache, "use_cache": True}
        if mask is not None:
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            step["attention_mask"] = mask
        out = model(**step)


def _progress(items: list, enabled: bool, description: str):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    # On stderr, so stdout stays clean for reports and JSON; and only on a terminal: elsewhere (a log
    # file, a pipe) a transient bar leaves nothing to read but a blank line.
    console = Console(stderr=True)
    disable = not (enabled and console.is_terminal)
    with Progress(*columns, console=console, transient=True, disable=disable) as progress:
        yield from progress.track(items, description=description)


_INLINE_PATH = re.compile(r"^(?P<owner>.*)\[(?P<linears>[^\[\]]+)\]$")


def _ffn_modules(model: torch.nn.Module, path: str) -> list[torch.nn.Module] | None:
    """The modules whose time is the FFN's: its own module, or for an FFN written inline in a bigger
    module ("owner[fc1,fc2]") its linears (the elementwise activation between them is left out)."""
    try:
        return [model.get_submodule(path)]
    except AttributeError:
        pass
    inline = _INLINE_PATH.match(path)
    if inline is None:
        return None
    try:
        owner = model.get_submodule(inline["owner"])
        return [owner.get_submodule(name.strip()) for name in inline["linears"].split(",")]
    except AttributeError:
        return None


def _time_shares(model, batch: dict, ffns: Mapping[str, list[torch.nn.Module]], repeats: int, decode_steps: int):
    """Per path and phase: the fraction of the model's time spent in that FFN (no statistics hooks).

    One run of `batch` records the inputs of every call of the FFNs' modules; then, `repeats` times,
    the model runs the batch (timed per phase) and each FFN's modules rerun their recorded inputs
    (timed), keeping the best times. Timing FFN calls inside a model run would be noise-bound: one FFN
    call of a small model lasts about as long as a scheduler hiccup on a busy machine.
    """
    cuda = _model_device(model).type == "cuda"

    def now() -> float:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    phase = {"now": None}
    modules = {id(m): m for ms in ffns.values() for m in ms}
    calls = {key: {p: [] for p in PHASES} for key in modules}

    def recorder(key):
        def hook(module, args, kwargs):
            calls[key][phase["now"]].append((args, kwargs))

        return hook

    handles = [m.register_forward_pre_hook(recorder(key), with_kwargs=True) for key, m in modules.items()]
    try:
        _run_batch(model, batch, decode_steps, lambda p: phase.update(now=p))  # also the warm-up
    finally:
        for h in handles:
            h.remove()

    # Interleaved repeats, best of each: noise on a shared machine only ever adds time.
    best_model = dict.fromkeys(PHASES, math.inf)
    best_module = {key: dict.fromkeys(PHASES, math.inf) for key in modules}
    for _ in range(repeats):
        run = {"phase": None, "since": 0.0, "times": dict.fromkeys(PHASES, 0.0)}

        def on_phase(p, run=run):
            t = now()
            if run["phase"] is not None:
                run["times"][run["phase"]] += t - run["since"]
            run["phase"], run["since"] = p, t

        _run_batch(model, batch, decode_steps, on_phase)
        on_phase(None)
        for p in PHASES:
            best_model[p] = min(best_model[p], run["times"][p])
        for key, module in modules.items():
            for p in PHASES:
                if calls[key][p]:
                    start = now()
                    for args, kwargs in calls[key][p]:
                        module(*args, **kwargs)
                    best_module[key][p] = min(best_module[key][p], now() - start)
    shares: dict[str, dict[str, float]] = {path: {} for path in ffns}
    for p in PHASES:
        phase_shares = {}
        for path, ms in ffns.items():
            times = [best_module[id(m)][p] for m in ms]
            if best_model[p] > 0 and all(t < math.inf for t in times):
                phase_shares[path] = sum(times) / best_model[p]
        # FFNs taking more than the whole model: the machine's load spoiled the timing; report none.
        if sum(phase_shares.values()) <= 1.0:
            for path, share in phase_shares.items():
                shares[path][p] = share
    return shares


@torch.no_grad()
def calibrate(model: torch.nn.Module, candidates, data, *, config=None, layer_config=None) -> dict[str, Decision]:
    """Measure each candidate FFN over `data` and decide whether rewriting it to twell pays.

    model: the model to run (left unchanged; eval mode during calibration, its mode restored after).
    candidates: twell.passes.find_ffns(model) records (path, kind, rewritable, reason, gate_module,
        gate_slice, measure, threshold, hidden_size, model_size).
    data: an iterable of batches: token-id tensors [batch, seq] or dicts of forward kwargs.
    config: CalibrationConfig, a dict of its fields, or None.
    layer_config: LayerConfig field changes the rewritten layers will run with (sparsify's), so that
        the cost model predicts for them; not tile_n or slots (calibration chooses the layout).
    Returns {candidate.path: Decision}, one per candidate; candidates that are not rewritable get
    rewrite=False with their own reason and no measurements.
    """
    cfg = CalibrationConfig.coerce(config)
    changes = layer_changes(layer_config, calibrated=True)
    candidates = list(candidates)
    device, dtype = _model_device(model), _model_dtype(model)
    batches = [_as_kwargs(b, device) for b in data]
    if not batches:
        raise ValueError("calibration data is empty: give at least one batch")

    measured = [c for c in candidates if c.rewritable]
    # resolved before the model runs, so a bad cost_model fails fast
    cost = resolve_cost_model(cfg.cost_model, device, cfg.cache_dir) if measured else AnalyticCostModel()
    driver = {"phase": "prefill"}
    recorders = {c.path: _LayerRecorder(c, cfg, driver) for c in measured}
    was_training = model.training
    model.eval()
    try:
        ffns = {c.path: ms for c in measured if (ms := _ffn_modules(model, c.path))}
        shares = {}
        # A sharded model's FFNs cannot be rerun on their own (FSDP gathers their weights only inside
        # the model's run), and ranks would time them differently: no time shares.
        if cfg.timing_repeats and ffns and not sharded(model):
            shares = _time_shares(model, batches[0], ffns, cfg.timing_repeats, cfg.decode_steps)

        handles = [c.gate_module.register_forward_hook(recorders[c.path], with_kwargs=True) for c in measured]
        try:
            # Nothing to measure (no rewritable FFN): no need to run the model at all.
            for kwargs in _progress(batches if measured else [], cfg.progress, "calibrating"):
                _run_batch(model, kwargs, cfg.decode_steps, lambda phase: driver.update(phase=phase))
        finally:
            for h in handles:
                h.remove()
    finally:
        model.train(was_training)

    decisions = {}
    for c in candidates:
        if c.rewritable:
            decisions[c.path] = _decide(c, recorders[c.path], cfg, cost, shares.get(c.path, {}), dtype, changes)
        else:
            decisions[c.path] = Decision(
                path=c.path,
                rewrite=False,
                reason=c.reason,
                kind=c.kind,
                hidden_size=int(c.hidden_size),
                model_size=int(c.model_size),
                threshold=float(c.threshold),
            )
    return agree(model, decisions)


# ---------------------------------------------------------------------------------------------------
# Plans


def _fingerprint(candidate) -> dict:
    return {
        "path": candidate.path,
        "kind": candidate.kind,
        "activation": candidate.activation,
        "hidden_size": int(candidate.hidden_size),
        "model_size": int(candidate.model_size),
    }


def save_plan(decisions: Mapping[str, Decision], candidates, path: str | os.PathLike) -> None:
    """Write decisions as a JSON plan, with the model's FFNs (from candidates) to check it against later."""
    import twell

    candidates = list(candidates)
    unknown = sorted(set(decisions) - {c.path for c in candidates})
    if unknown:
        raise ValueError(f"decisions for FFNs that are not among the candidates: {unknown}")
    plan = {
        "format": PLAN_FORMAT,
        "version": PLAN_VERSION,
        "twell_version": twell.__version__,
        "ffns": [_fingerprint(c) for c in candidates],
        "decisions": {p: d.to_dict() for p, d in decisions.items()},
    }
    Path(path).write_text(json.dumps(plan, indent=1) + "\n")


def read_plan(path: str | os.PathLike) -> tuple[dict, dict[str, Decision]]:
    """The plan's FFN fingerprints {path: {path, kind, activation, hidden_size, model_size}} and its
    decisions, unchecked against any model. Raises ValueError when the file is not a twell plan of this
    format version."""
    plan = _read_plan_file(path)
    planned = {f["path"]: f for f in plan.get("ffns", [])}
    return planned, {p: Decision.from_dict(d) for p, d in plan.get("decisions", {}).items()}


def _read_plan_file(path: str | os.PathLike) -> dict:
    try:
        plan = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"cannot read plan {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise ValueError(f"plan {path} is not valid JSON: {e}") from None
    if not isinstance(plan, dict) or plan.get("format") != PLAN_FORMAT:
        raise ValueError(f'{path} is not a twell plan (no "format": "{PLAN_FORMAT}")')
    if plan.get("version") != PLAN_VERSION:
        raise ValueError(
            f"plan {path} has format version {plan.get('version')!r}; this twell reads version {PLAN_VERSION}: "
            "calibrate again"
        )
    return plan


def load_plan(path: str | os.PathLike, candidates) -> dict[str, Decision]:
    """Read a plan written by save_plan and check it fits the model whose FFNs are `candidates`.

    Raises ValueError with the reason when the file is not a twell plan, has another format version,
    or was made for a different model (other FFN paths, kinds, activations or shapes), or when it
    rewrites an FFN that is not rewritable in this model.
    """
    planned, decisions = read_plan(path)
    candidates = list(candidates)
    present = {c.path: _fingerprint(c) for c in candidates}
    missing, extra = sorted(set(planned) - set(present)), sorted(set(present) - set(planned))
    if missing or extra:
        parts = [f"plan has {len(planned)} FFNs, the model {len(present)}"]
        if missing:
            parts.append(f"not in the model: {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
        if extra:
            parts.append(f"not in the plan: {', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}")
        raise ValueError(f"plan {path} was made for a different model: {'; '.join(parts)}")
    for p, fingerprint in present.items():
        for key, value in fingerprint.items():
            if planned[p].get(key) != value:
                raise ValueError(
                    f"plan {path} was made for a different model: {p} has {key}={value!r}, "
                    f"the plan {planned[p].get(key)!r}"
                )
    by_path = {c.path: c for c in candidates}
    for p, d in decisions.items():
        if p not in by_path:
            raise ValueError(f"plan {path} has a decision for {p}, which is not an FFN of its own list")
        if d.rewrite and not by_path[p].rewritable:
            raise ValueError(f"plan {path} rewrites {p}, which is not rewritable in this model: {by_path[p].reason}")
        if d.rewrite:
            try:
                d.layer_config()
            except ValueError as e:
                raise ValueError(
                    f"plan {path} rewrites {p} with a layout the kernels cannot run ({e}): calibrate again"
                ) from None
    return decisions


__all__ = [
    "CalibrationConfig",
    "CostModel",
    "AnalyticCostModel",
    "BenchmarkCostModel",
    "Decision",
    "calibrate",
    "cuda_median_time",
    "layer_changes",
    "load_plan",
    "predicted_model_speedup",
    "read_plan",
    "resolve_cost_model",
    "save_plan",
]
