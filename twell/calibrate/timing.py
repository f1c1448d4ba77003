"""CUDA timing, shared by the benchmark cost model and the benchmarks (benchmarks/ffn.py)."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch


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
    return cuda_median_time(cuda_graph(fn, calls).replay) / calls


def cuda_graph(fn: Callable[[], Any], calls: int = 1) -> torch.cuda.CUDAGraph:
    """`calls` calls of fn() captured in one CUDA graph, after three warm-up calls on a side stream
    (compilation and autotuning stay outside the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph
