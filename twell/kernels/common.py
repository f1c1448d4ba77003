"""Helpers shared by the kernel launchers."""

from __future__ import annotations

import functools
import os

import torch
import triton

from twell.kernels.policy import check_tile  # noqa: F401  (the launchers' layout check; policy owns the limits)


def interpreting() -> bool:
    """True under Triton's CPU interpreter (CI), where autotuning would only cost time."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def autotune_configs(table, to_meta) -> list[triton.Config]:
    """triton.Config list from rows (..., num_warps, num_stages), meta-parameters from to_meta(*row);
    the first row alone when interpreting."""
    rows = table[:1] if interpreting() else table
    return [triton.Config(to_meta(*row), num_warps=row[-2], num_stages=row[-1]) for row in rows]


def m_bucket(m: int) -> int:
    """Autotune key for the token count: next power of two, so new batch sizes do not re-tune."""
    return triton.next_power_of_2(max(m, 1))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get IEEE dots (fp32 results within 1e-5); tf32 would give ~3e-4."""
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.lru_cache(maxsize=256)
def threshold_in(threshold: float, dtype: torch.dtype) -> float:
    """The threshold as torch compares it with a `dtype` tensor: rounded to that dtype (bf16(0.1) is
    0.10009765625), so kernels keep exactly the entries torch's `v <= threshold` drops. Cached: every
    kernel launch asks, and the rounding takes three small CPU tensor ops (host time per call)."""
    return torch.tensor(float(threshold), dtype=torch.float64).to(dtype).item()

