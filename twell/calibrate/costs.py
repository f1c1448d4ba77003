"""Cost models: twell's FFN time relative to dense, from documented fits (AnalyticCostModel) or
micro-benchmarks at the layer's shape and density (BenchmarkCostModel)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from twell.calibrate.timing import cuda_graph_time, cuda_median_time
from twell.kernels import policy
from twell.kernels.policy import LayerConfig


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
        if path != "prefill" or density > policy.dense_above_of(config, k):
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
