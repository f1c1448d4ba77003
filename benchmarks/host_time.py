"""Host time of one prefill call: what an eager call spends on the CPU before its kernels run.

Run on a GPU:  PYTHONPATH=. python benchmarks/host_time.py [--ms 4096,8192,16384] [--shape 2048x5632]
For each token count, on ffn.py's FFN module (uniform 0.5%) after twell.sparsify with the prefill
path forced: the host time per call (calls issued back to back, the GPU kept busy by a long kernel
queued first, so no call waits for the device), the GPU time per call (CUDA-graph replay) and the
eager time per call (what a user's eager call takes: the larger of the two, roughly), and
the host time, eager time, GPU operations and cProfile of the module's default route (twell_default_*:
what an eager call of that size, e.g. a prompt's, takes as sparsify installs it), the host time of the
dispatcher called directly (*_dispatch_host_ms: the module and twell.ops left out, the rest of
twell_host_ms, which has no op layers: twell.ops calls the dispatcher itself for eager calls without
autograd; twell_op_host_ms: torch.ops.twell.gated_ffn called directly, its layers and the dispatcher,
the module and twell.ops left out); the
same three for the dense module; the GPU time of the module's default route with
prefill_min_m_captured at the call's size (twell_captured_gpu_ms: its capture after the usual
warm-up calls takes the prefill path, which captured_prefill checks); the GPU operations of one call
(torch.profiler), and a cProfile of the host side (top functions by own time) for each setting. JSON
to benchmarks/results/ (or $OUT).

On the CPU:  PYTHONPATH=. python benchmarks/host_time.py --cpu
The dispatcher's prefill path (twell.kernels.dispatch.gated_ffn_cuda) on small CPU tensors (the host side
of a CUDA call does not depend on the sizes; tiny CPU ops cost about what a CUDA op's dispatch and
launch cost the host), every Triton launch replaced by a stub that records it and returns (the
autotuner runs, tuning without timing): the Python-side host time of the wrappers without the
Triton launches themselves, with and without the density probe, with and without hot neurons, the
torch ops of one call (each a launch on CUDA, bar views and allocations), the Triton launches and
their argument counts, and the op boundary's time (torch.ops.twell.gated_ffn on meta tensors: its
dispatch, checks and fake). Runs on any tree (also an older commit's, for a comparison).
Then the dispatcher's decode path the same way (16 tokens, the route forced: a short prompt's call on a
calibrated layer). The last point: the eager module path on CPU tensors (x [16, 64], a ReLU LlamaMLP
K=64 N=176), us a call of the dense module, of its SparseFFN after twell.sparsify, of twell.ops.gated_ffn, of
torch.ops.twell.gated_ffn, of the op's own function (checks + plain-torch reference, the custom op's
layers left out), of SparseFFN and of twell.ops with the op replaced by a stub returning x (their
Python alone), and a cProfile of the SparseFFN call.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import time
import unittest.mock
from types import SimpleNamespace

import torch
from ffn import environment, make_inputs, result_path, timed

import twell
from twell.kernels import dispatch, library  # library: registers torch.ops.twell.*
from twell.kernels.policy import LayerConfig
from twell.passes.modules import SparseFFN

CALLS = 20
# aten ops that launch nothing on CUDA (views, allocation, metadata)
NO_LAUNCH = {"empty", "empty_like", "view", "_unsafe_view", "t", "transpose", "reshape", "slice", "select", "alias"}
NO_LAUNCH |= {"detach"}


def host_ms(fn) -> float:
    """Median host time of one call, with the GPU busy (a ~50 ms sleep kernel queued first)."""
    samples = []
    for _ in range(5):
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)  # ~50 ms of GPU time: the calls below queue behind it
        start = time.perf_counter()
        for _ in range(CALLS):
            fn()
        samples.append((time.perf_counter() - start) / CALLS * 1e3)
    torch.cuda.synchronize()
    return sorted(samples)[len(samples) // 2]


def profile(fn, top: int = 25, calls: int = CALLS) -> tuple[float, str]:
    """cProfile of `calls` calls of fn (on CUDA, the device idle before and after): Python calls a call,
    and the top `top` functions by own time."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    if cuda:
        torch.cuda.synchronize()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    return stats.total_calls / calls, out.getvalue()


def gpu_ops(fn) -> list[str]:
    """Names of the GPU operations (kernels, copies, fills) one call runs, in order (torch.profiler)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return [e.name[:80] for e in sorted(events, key=lambda e: e.time_range.start)]


def point(m: int, k: int, n: int, pattern: str) -> dict:
    x, block = make_inputs(m, k, n, 0.005, pattern, seed=m + n)
    call = lambda: block(x)  # noqa: E731
    row = {"K": k, "N": n, "M": m, "pattern": pattern}
    with torch.no_grad():
        row["dense_host_ms"] = host_ms(call)
        row["dense_gpu_ms"] = timed(call, True)
        row["dense_eager_ms"] = timed(call, False)
        twell.sparsify(block)
        # the route sparsify installs, as an eager call of this size takes it (a prompt's call)
        dispatch.forget_layers()
        call()
        row["twell_default_host_ms"] = host_ms(call)
        row["twell_default_eager_ms"] = timed(call, False)
        row["twell_default_gpu_ops"] = gpu_ops(call)
        row["twell_default_profile"] = profile(call)[1]
        with twell.configure(block, route="decode"):  # a calibrated layer's 9-16-token call (a short prompt)
            call()
            row["twell_decode_host_ms"] = host_ms(call)
            row["twell_decode_eager_ms"] = timed(call, False)
            row["twell_decode_gpu_ms"] = timed(call, True)
            row["twell_decode_profile"] = profile(call)[1]
        with twell.configure(block, route="prefill"):
            dispatch.forget_layers()
            call()
            torch.cuda.synchronize()
            gated_ffn_cuda, seen = dispatch.gated_ffn_cuda, []
            dispatch.gated_ffn_cuda = lambda *a: seen.append(a) or gated_ffn_cuda(*a)
            try:
                call()
            finally:
                dispatch.gated_ffn_cuda = gated_ffn_cuda
            direct = lambda: gated_ffn_cuda(*seen[0])  # noqa: E731
            op_args = (*seen[0][:-1], *seen[0][-1].op_args())  # the FFN's arguments, then its config's
            row["twell_op_host_ms"] = host_ms(lambda: torch.ops.twell.gated_ffn(*op_args))
            row["twell_host_ms"] = host_ms(call)
            row["twell_dispatch_host_ms"] = host_ms(direct)  # the dispatcher alone, no op layers
            row["twell_gpu_ms"] = timed(call, True)
            row["twell_eager_ms"] = timed(call, False)
            row["twell_profile"] = profile(call)[1]
            row["twell_gpu_ops"] = gpu_ops(call)
        with twell.configure(block, prefill_min_m_captured=m):
            dispatch.forget_layers()
            up_down, routed = dispatch.launch_up_down, []
            dispatch.launch_up_down = lambda *a, **k: (
                routed.append(torch.cuda.is_current_stream_capturing()) or up_down(*a, **k)
            )
            try:
                row["twell_captured_gpu_ms"] = timed(call, True)
            finally:
                dispatch.launch_up_down = up_down
            row["captured_prefill"] = True in routed
    row["profile"] = row["twell_profile"]
    row["speedup_eager"] = row["dense_eager_ms"] / row["twell_eager_ms"]
    row["speedup_default_eager"] = row["dense_eager_ms"] / row["twell_default_eager_ms"]
    row["speedup_gpu"] = row["dense_gpu_ms"] / row["twell_gpu_ms"]
    row["speedup_captured"] = row["dense_gpu_ms"] / row["twell_captured_gpu_ms"]
    return row


class _NotLanded:
    """A probe's event that never completes: the meta tensors' copies are never read back."""

    def query(self) -> bool:
        return False


@contextlib.contextmanager
def _stubbed_launches(launches: list):
    """Triton launches recorded (kernel name, argument count) instead of run; the autotuner runs as on
    the GPU (its per-call key and lookup) but tunes without timing (every config scores the same, the
    first is kept) and without its disk cache."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    def launch(self, *args, grid, warmup, **kwargs):
        launches.append((self.__name__, len(args) + len(kwargs)))

    def untimed_tuning(self, tuning_key, configs, bench_fn):
        bench_fn()
        return False

    saved = JITFunction.run, Autotuner._bench, Autotuner.check_disk_cache, dispatch._to_host
    JITFunction.run = launch
    Autotuner._bench = lambda self, *args, config, **kwargs: [1.0, 1.0, 1.0]
    Autotuner.check_disk_cache = untimed_tuning
    dispatch._to_host = lambda t: (_NotLanded(), t)
    try:
        yield
    finally:
        JITFunction.run, Autotuner._bench, Autotuner.check_disk_cache, dispatch._to_host = saved


def _aten_ops(fn) -> list[str]:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Record() as record:
        fn()
    return record.ops


def _us_per_call(fn, calls: int = 200) -> float:
    """CPU time of this thread per call (us), the least of 7 runs: waiting for a shared host's cores
    does not count."""
    samples = []
    for _ in range(7):
        start = time.thread_time()
        for _ in range(calls):
            fn()
        samples.append((time.thread_time() - start) / calls * 1e6)
    return min(samples)


def cpu_point(hot: int, m: int = 64, k: int = 64, n: int = 256) -> dict:
    """The dispatcher's prefill path on CPU tensors (module docstring), with `hot` hot neurons."""
    torch.set_num_threads(1)  # tiny ops: threads only add contention with other processes
    torch.set_flush_denormal(True)  # the stubs leave buffers unwritten: no slow denormal arithmetic
    x = torch.randn(m, k)
    gate_weight, up_weight = torch.randn(n, k), torch.randn(n, k)
    down_weight = torch.randn(n, k).t()  # the layout sparsify gives W_down: rows of W_d^T contiguous
    gate_bias = torch.randn(n)
    config = LayerConfig().replace(route="prefill")
    args = (x, gate_weight, up_weight, down_weight, gate_bias, None, None, 0.0, False, config)
    launches = []
    row = {"K": k, "N": n, "M": m, "hot": hot}
    with _stubbed_launches(launches), torch.no_grad():
        dispatch.forget_layers()
        state = dispatch.layer_state(gate_weight, m)
        state.hot_calls_left = 1 << 30  # the hot-neuron probe is due once every DENSE_RETRY calls: not timed
        if hot:
            pos = torch.full((n,), -1, dtype=torch.int32)
            pos[:hot] = torch.arange(hot, dtype=torch.int32)
            state.hot = dispatch._Hot(torch.arange(hot), pos)
        call = lambda: dispatch.gated_ffn_cuda(*args)  # noqa: E731
        call()  # the first call of a key tunes (here: takes the first config)

        def probing():
            state.pending = None  # as if the last probe had landed: this call queues one
            call()

        row["us_no_probe"] = _us_per_call(call)
        row["us_probe"] = _us_per_call(probing)
        launches.clear()
        row["aten_ops_probe"] = _aten_ops(probing)
        row["triton_launches"] = launches[:]
        row["launching_aten_ops"] = [op for op in row["aten_ops_probe"] if op not in NO_LAUNCH]
        row["python_calls_per_call"], row["profile"] = profile(probing, top=15, calls=50)
        boundary = [t.to("meta") if t is not None else None for t in args[:7]]
        boundary = (*boundary, 0.0, False)
        row["us_op_boundary_fake"] = _us_per_call(lambda: library.gated_ffn(*boundary, *config.op_args()))
    return row


def cpu_decode_point(m: int = 16, k: int = 64, n: int = 256) -> dict:
    """The dispatcher's decode path on CPU tensors, launches stubbed (module docstring): a short prompt's
    call on a calibrated layer."""
    torch.set_num_threads(1)
    x = torch.randn(m, k)
    gate_weight, up_weight = torch.randn(n, k), torch.randn(n, k)
    down_weight = torch.randn(n, k).t()
    config = LayerConfig().replace(route="decode")
    args = (x, gate_weight, up_weight, down_weight, None, None, None, 0.0, False, config)
    launches = []
    row = {"K": k, "N": n, "M": m, "route": "decode"}
    with _stubbed_launches(launches), torch.no_grad():
        call = lambda: dispatch.gated_ffn_cuda(*args)  # noqa: E731
        call()
        row["us_no_probe"] = _us_per_call(call)
        launches.clear()
        call()
        row["triton_launches"] = launches[:]
        row["python_calls_per_call"], row["profile"] = profile(call, top=15, calls=50)
    return row


def module_point(m: int = 16, k: int = 64, n: int = 176) -> dict:
    """The eager module path's host cost on CPU tensors (module docstring): where SparseFFN's time goes."""
    import transformers

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=k, intermediate_size=n, hidden_act="relu")
    mlp = transformers.models.llama.modeling_llama.LlamaMLP(config).eval()
    x = torch.randn(m, k)
    row = {"K": k, "N": n, "M": m}
    with torch.no_grad():
        row["us_dense_module"] = _us_per_call(lambda: mlp(x))
        sparse = twell.sparsify(torch.nn.Sequential(mlp))[0]  # a child: sparsify swaps it
        assert isinstance(sparse, SparseFFN), type(sparse)
        gate, up, down = sparse.gate_proj.weight, sparse.up_proj.weight, sparse.down_proj.weight
        route = sparse.layer_config.op_args()
        ffn_args = (x, gate, up, down, None, None, None, 0.0, False)
        row["us_sparse_module"] = _us_per_call(lambda: sparse(x))
        row["us_twell_ops"] = _us_per_call(lambda: twell.ops.gated_ffn(x, gate, up, down))
        row["us_op"] = _us_per_call(lambda: torch.ops.twell.gated_ffn(*ffn_args, *route))
        row["us_op_inner"] = _us_per_call(lambda: library.gated_ffn._init_fn(*ffn_args, *route))
        stub = SimpleNamespace(gated_ffn=lambda x, *args: x)  # the only torch.ops.twell op such a call makes
        with unittest.mock.patch.object(twell.ops, "torch", SimpleNamespace(ops=SimpleNamespace(twell=stub))):
            row["us_sparse_module_stub_op"] = _us_per_call(lambda: sparse(x))
            row["us_twell_ops_stub_op"] = _us_per_call(lambda: twell.ops.gated_ffn(x, gate, up, down))
        row["python_calls_per_call"], row["profile"] = profile(lambda: sparse(x), top=20, calls=50)
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ms", default="4096,8192,16384")
    parser.add_argument("--shape", default="2048x5632")
    parser.add_argument("--pattern", default="uniform")
    parser.add_argument("--cpu", action="store_true", help="the dispatcher's Python-side cost on meta tensors")
    parser.add_argument("--hot", default="0,32", help="--cpu: hot neurons of the layer (of N=256)")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    k, n = map(int, args.shape.split("x"))
    result = {**environment(), "calls": CALLS, "cpu": args.cpu, "points": []}
    if args.cpu:
        points = [*(lambda h=int(h): cpu_point(h) for h in args.hot.split(",")), cpu_decode_point, module_point]
    else:
        points = (lambda m=int(m): point(m, k, n, args.pattern) for m in args.ms.split(","))
    for measure in points:
        row = measure()
        result["points"].append(row)
        print({key: v for key, v in row.items() if "profile" not in key and key != "aten_ops_probe"})
        key = "profile" if args.cpu else "twell_profile"
        print(key, row[key], sep="\n")
    path = result_path(args.out, "host_time-cpu" if args.cpu else "host_time")
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
