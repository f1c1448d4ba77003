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
