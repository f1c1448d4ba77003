"""Calibration's options (CalibrationConfig) and the phases it measures apart."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from twell.format import check_layout
from twell.kernels import policy

PHASES = ("prefill", "decode")


@dataclass
class CalibrationConfig:
    """Options of calibrate(); pass an instance, a dict of the same fields, or None for the defaults.

    layouts: the TwELL layouts considered, (tile_n, slots) pairs, each one the kernels run (powers of
        two, tile widths from 16 to 256, slots <= tile_n: twell.kernels.policy.check_tile). The default:
        tile widths 64, 128 and 256 with a half, a quarter and an eighth of their columns as slots.
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

    layouts: tuple[tuple[int, int], ...] = (
        (64, 32), (64, 16), (64, 8), (128, 64), (128, 32), (128, 16), (256, 128), (256, 64), (256, 32),
    )  # fmt: skip
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
        cfg = dataclasses.replace(cfg, layouts=_layout_pairs(cfg.layouts))
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

    @property
    def tile_widths(self) -> list[int]:
        """The layouts' tile widths, ascending (calibration counts kept entries per tile of each)."""
        return sorted({tile_n for tile_n, _ in self.layouts})

    def preferred_layouts(self) -> list[tuple[int, int]]:
        """The layouts in order of preference: fewest slots per column first (fewest slots to scan), then
        the tile width nearest the kernels' default (the measured layout: a chosen layout is the one the
        layer's kernels run)."""
        return sorted(self.layouts, key=lambda p: (p[1] / p[0], abs(math.log2(p[0] / policy.TILE_N)), -p[0]))


def _layout_pairs(layouts) -> tuple[tuple[int, int], ...]:
    """layouts as a tuple of (tile_n, slots) int pairs the format and the kernels take; ValueError naming
    the bad one."""
    if isinstance(layouts, (str, bytes)) or not isinstance(layouts, Iterable):
        raise ValueError(f"layouts must be a sequence of (tile_n, slots) pairs, got {layouts!r}")
    pairs = []
    for pair in layouts:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"layouts must be (tile_n, slots) pairs, got {pair!r}")
        check_layout(*pair)
        policy.check_tile(*pair)
        pairs.append(tuple(pair))
    if not pairs:
        raise ValueError("layouts must not be empty")
    return tuple(pairs)
