"""Helpers shared by the kernel launchers."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# the launchers' checks, defined once: the layout by policy (it owns the limits), dtypes and threshold
# by the op boundary (twell.kernels.library)
from twell.kernels.checks import FLOAT_DTYPES, check_threshold  # noqa: F401
from twell.kernels.policy import check_tile  # noqa: F401


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of ints, for host code: triton.cdiv is a constexpr function there (a few us a call,
    and a decode call's launcher makes a dozen such calls)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of two >= n (0 for 0), for host code: triton.next_power_of_2's values, without its
    constexpr-function call."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def interpreting() -> bool:
    """True under Triton's CPU interpreter (CI), where autotuning would only cost time."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def autotune_configs(table, to_meta) -> list[triton.Config]:
    """triton.Config list from rows (..., num_warps, num_stages), meta-parameters from to_meta(*row);
    the first row alone when interpreting."""
    rows = table[:1] if interpreting() else table
    return [triton.Config(to_meta(*row), num_warps=row[-2], num_stages=row[-1]) for row in rows]


def _capturing() -> bool:
    """True while the current CUDA stream is being captured into a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class TunedLaunch:
    """Launches an autotuned kernel with the config its autotuner chose for a key, without the
    autotuner's per-call work (its key built from every argument, the lookup, the config's kwargs):
    tens of us of host time a launch.
    The first launch of a key goes through the autotuner (which benchmarks, or reads its disk cache),
    and its choice is kept for the key.

    Under CUDA-graph capture the autotuner cannot run (benchmarking synchronises): a key not tuned yet
    launches the first of the autotuner's configs that its pruning keeps (the tables list the
    measured best first), kept for no key, so the next call outside a capture tunes it
    (untuned_captures counts them).

    key: what selects the autotuner's config, as the caller knows it: the autotune key's values and
    whatever sets the dtypes of the tensor arguments (the autotuner keys by those too); a key merges
    two of the autotuner's keys only where they must share a config (twell.kernels.updown's passes).
    Benchmarks that want the autotuner itself call the kernel.
    """

    def __init__(self, kernel):
        self.kernel = kernel
        self.configs: dict[tuple, triton.Config] = {}
        self.meta: dict[tuple, dict] = {}  # a key's config as launch arguments
        self.best_config: triton.Config | None = None  # the latest launch's (benchmarks record it)
        self.untuned_captures = 0

    def __call__(self, key: tuple, grid, *args, **kwargs) -> None:
        config = self.configs.get(key)
        if config is None:
            if not _capturing():
                self.kernel[grid](*args, **kwargs)
                self.configs[key] = self.best_config = self.kernel.best_config
                self.meta[key] = self.best_config.all_kwargs()
                return
            config = self._untuned(args, kwargs)
            self.untuned_captures += 1
            meta = config.all_kwargs()
        else:
            meta = self.meta[key]
        self.best_config = config
        if config.pre_hook is not None:
            config.pre_hook({**dict(zip(self.kernel.arg_names, args, strict=False)), **kwargs, **meta})
        self.kernel.fn[grid](*args, **kwargs, **meta)

    def _untuned(self, args, kwargs) -> triton.Config:
        """The config of a key first launched under capture: the first the autotuner's pruning keeps."""
        configs = self.kernel.configs
        prune = getattr(self.kernel, "early_config_prune", None)
        if prune is not None:
            configs = prune(configs, dict(zip(self.kernel.arg_names, args, strict=False)), **kwargs)
        return configs[0]


@functools.cache
def persistent_programs(device: torch.device, per_multiprocessor: int) -> int:
    """Programs of a persistent kernel: per_multiprocessor on each multiprocessor of a CUDA device, a
    few elsewhere (the interpreter); cached: launchers ask on every call."""
    if device.type != "cuda":
        return 4
    return per_multiprocessor * torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def compute_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of a CUDA device; cached: the dispatcher asks on every call."""
    return torch.cuda.get_device_capability(device)


def m_bucket(m: int) -> int:
    """Autotune key for the token count: next power of two, so new batch sizes do not re-tune."""
    return next_power_of_2(max(m, 1))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get IEEE dots (fp32 results within 1e-5); tf32 would give ~3e-4."""
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.lru_cache(maxsize=256)
def threshold_in(threshold: float, dtype: torch.dtype) -> float:
    """The threshold as torch compares it with a `dtype` tensor: rounded to that dtype (bf16(0.1) is
    0.10009765625), so kernels keep exactly the entries torch's `v <= threshold` drops. Cached: every
    kernel launch asks, and the rounding takes three small CPU tensor ops (host time per call)."""
    return torch.tensor(float(threshold), dtype=torch.float64).to(dtype).item()


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def tl_dtype(dtype: torch.dtype):
    """Triton's type for a float dtype of FLOAT_DTYPES (a constexpr kernel argument)."""
    return _TL_DTYPES[dtype]


def check_input(name: str, x, *, unit_stride: bool = False) -> None:
    """A launcher's x: a 2-dim float tensor [M, K] (unit stride along K where its kernel reads rows
    whole, with no stride argument)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a 2-dim tensor [M, K], got {got}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
    if unit_stride and x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"{name} must have unit stride along K (rows read whole), got strides {x.stride()}")


def check_operand(name: str, t, shape: tuple, x: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    """t must be a tensor of `shape` on x's device, in `dtype` (default: x's): kernels index it by
    that shape and read it as that type."""
    dtype = x.dtype if dtype is None else dtype
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor {list(shape)} {dtype}, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != x.device:
        raise ValueError(
            f"{name} must be {list(shape)} {dtype} on {x.device}, got {list(t.shape)} {t.dtype} on {t.device}"
        )


def check_bias(name: str, b, size: int, x: torch.Tensor) -> None:
    """An optional bias: [size] in x's dtype and device, unit stride (the kernels read it so)."""
    if b is None:
        return
    check_operand(name, b, (size,), x)
    if size > 1 and b.stride(0) != 1:
        raise ValueError(f"{name} must have unit stride (kernels read it contiguously), got stride {b.stride(0)}")


def check_pos(pos, n: int, x: torch.Tensor) -> None:
    """An optional hot-neuron map: int32 [n] on x's device, contiguous (the kernels index it by neuron;
    -1: not hot). Values are the caller's: the dispatcher builds them from the hot neurons' index."""
    if pos is None:
        return
    check_operand("hot_pos", pos, (n,), x, torch.int32)
    if n > 1 and pos.stride(0) != 1:
        raise ValueError(f"hot_pos must be contiguous, got stride {pos.stride(0)}")
