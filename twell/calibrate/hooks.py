"""Statistics hooks: a forward hook per candidate FFN (LayerRecorder) counting, per phase, the
pre-activation entries that survive the threshold (PhaseCounter: histograms, so percentiles are exact
at any data size)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable

import torch

from twell.calibrate.config import CalibrationConfig
from twell.distributed import full_hidden
from twell.format import kept_mask

# Quantiles of the per-neuron firing rates kept in the statistics: the shape of a layer's rate
# distribution (dead neurons at the bottom, a long tail of frequent ones at the top).
NEURON_RATE_QUANTILES = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 0.999, 1.0)


def _percentile(hist: torch.Tensor, q: float) -> int:
    """Nearest-rank percentile of the values whose histogram (counts of 0, 1, 2, ...) is `hist`."""
    hist = hist.cpu()
    total = int(hist.sum())
    if total == 0:
        return 0
    rank = max(1, math.ceil(q * total))
    return int(torch.searchsorted(hist.cumsum(0), torch.tensor(rank)).item())


class PhaseCounter:
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

    def overflow_fraction(self, tile_n: int, slots: int) -> float:
        """Fraction of rows with more kept entries than `slots` in some tile of `tile_n` columns."""
        hist = self.tile_max_hist[tile_n]
        return float(hist[slots + 1 :].sum()) / max(self.rows, 1)

    def summary(self, layouts: list[tuple[int, int]]) -> dict:
        rows = self.rows
        values = torch.arange(self.n + 1, device=self.nnz_hist.device)
        nnz_total = int((self.nnz_hist * values).sum())
        overflow: dict[str, dict[str, float]] = {}
        for tile_n, slots in sorted(layouts):
            overflow.setdefault(str(tile_n), {})[str(slots)] = self.overflow_fraction(tile_n, slots)
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


class LayerRecorder:
    """Forward hook on a candidate's gate linear: slices the gate part, thresholds, counts per phase."""

    def __init__(self, candidate, cfg: CalibrationConfig, driver: dict):
        self.candidate = candidate
        self.n = int(candidate.hidden_size)
        self.tile_widths = cfg.tile_widths
        self.driver = driver  # {"phase": ...} set by the loop that runs the model
        self.phases: dict[str, PhaseCounter] = {}
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
            counter = self.phases[phase] = PhaseCounter(self.n, self.tile_widths, h.device, self.shards)
        counter.add(kept_mask(h.detach().reshape(-1, self.n), float(self.candidate.threshold)))

    def dead_neurons(self) -> int:
        counts = sum(c.neuron_counts for c in self.phases.values())
        return int((counts == 0).sum())

    def overflow_fraction(self, tile_n: int, slots: int) -> float:
        rows = sum(c.rows for c in self.phases.values())
        over = sum(c.overflow_fraction(tile_n, slots) * c.rows for c in self.phases.values())
        return over / max(rows, 1)
