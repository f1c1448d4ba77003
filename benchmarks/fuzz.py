"""Fuzz of the FFN ops against float64: random shapes, dtypes, densities, biases, thresholds, FFN kinds,
every route forced and the default one.

    PYTHONPATH=. python benchmarks/fuzz.py [--cases 500] [--seed 0] [--time-limit 480] [--workers 12]
    PYTHONPATH=. python benchmarks/fuzz.py --replay 17            # one case again, by its seed
    PYTHONPATH=. python benchmarks/fuzz.py --smoke                # CPU: a few tiny cases, interpreter

Each case (its own seed: --seed * 100003 + index, so any case replays alone) draws M (1 to ~70000 on a
GPU), K (odd, not a multiple of 16, 2048, 4096, 8192, and past policy.MAX_K), N (awkward and real),
the dtype, the FFN (gated ReLU, drelu, plain ReLU, relu²), a bias on each projection or not, the
threshold (0, positive, negative, not always representable in the dtype), the TwELL layout, the route
(LayerConfig.replace(route=...) for decode / prefill / dense, or the defaults of its width), fused_gate,
hot_rate, the down weight's layout and x's shape and strides. Rows: a density each (empty to fully
dense, exact counts through a per-row offset feature), and bursts that fill one tile with exactly
`slots` active neurons, one more (overflow) or all of it; "hot" neurons that fire in ~30% of rows.

A call goes through torch.ops.twell.gated_ffn / ffn (on the CPU, whose ops run the reference, through
twell.kernels.dispatch, the function the CUDA op calls, under TRITON_INTERPRET=1). Calls that may take
the prefill path run twice on the same weights: the first measures the layer's hot neurons, the
second uses them. Before each call the CUDA caching allocator is refilled with NaN bytes (0xFF: NaN in
every float dtype, -1 in the int ones), so anything a kernel leaves unwritten reads as NaN.

Check, on a sample of rows (the first and last 32, burst rows, 256 random: the float64 reference of every
row would cost more than the kernels): every output element finite, and
    ||out - ref|| <= tol ||ref|| + allowance        (tol: fp32 1e-5, fp16/bf16 1e-2)
over the sample, and per row with ||ref_row|| floored at a tenth of the sample's rms row norm and at
the norm of the row computed on absolute values (|x| |W| through every product: the scale of a dot
product's rounding error, kept by a row whose terms cancel). The
allowance covers entries whose gate pre-activation lies so near the threshold that the kernels'
rounding (fp32 accumulation, the dtype's rounding of a stored gate, the threshold rounded to the dtype)
may keep or drop them: the sum of what each such entry would add, |h_ij| ||W_d[:, j]||. The case log
records how large it was, the summary the largest (bf16 at positive thresholds: a few percent). Both
bounds widen to twice what the plain PyTorch FFN on the same rows in the case's dtype misses them by
(rounding alone fails them on bf16 rows whose output nearly cancels), so a failure is twell erring
more than the untouched model does.

Work runs in worker processes on the one GPU (Triton compiles are CPU-bound and there are many
variants): a case that raises is recorded and the worker goes on; one whose worker dies or hangs (a CUDA
error poisons the process) is recorded and a fresh worker takes the next. Writes one JSON line per case
to fuzz-<time>.jsonl and the summary (cases, failures with their seeds, GPU, torch / triton versions,
commit: TWELL_COMMIT where set) to fuzz-<time>.json, in $OUT or benchmarks/results/; prints a short
table last. Exit status 1 when a case failed.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import queue
import random
import sys
import time
import traceback
from pathlib import Path

STARTED = time.monotonic()  # a script run's --time-limit counts from here (imports included)

import torch  # noqa: E402

# without a GPU the kernels run in Triton's interpreter, which must be chosen before triton is imported
if not torch.cuda.is_available() or "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ffn import environment, result_path  # noqa: E402

import twell.kernels.library  # noqa: E402,F401  (registers torch.ops.twell.*, which the CUDA cases call)
from twell.kernels import dispatch, policy  # noqa: E402
from twell.kernels import reference as ref_ops  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
# worst relative rounding of a gate value stored in the dtype (half an ulp at the bottom of a binade)
STORE_ULP = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
FP32_ULP = 2.0**-23
DTYPE_NAMES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
KINDS = ("gated", "drelu", "relu", "relu2")
SAMPLE_RANDOM_ROWS = 256
CASE_TIMEOUT = 240  # seconds a worker may spend on one case (the first cases compile many kernels)
FATAL = ("CUDA error", "illegal memory access", "device-side assert", "unspecified launch failure", "CUBLAS")

# shapes on a GPU: K odd / not a multiple of 16 / the models' / past MAX_K (dense); N awkward / real
GPU_K = [33, 255, 1001, 2047, 4095, 8191, 24, 1000, 2056, 3080, 5000, 8184, 2048, 2048, 4096, 4096, 8192, 8200]
GPU_N = [1, 7, 100, 130, 777, 1000, 3001, 5000, 2048, 5632, 5632, 8192, 11008, 14336, 14336]
GPU_M = [1, 2, 3, 8, 9, 16, 17, 64, 257, 1000, 4096, 16383, 16384, 32768, 65536, 70000]
CPU_K = [5, 24, 33, 40]
CPU_N = [1, 7, 40, 100]
CPU_M = [1, 3, 8, 9, 17, 40]


def case_seed(seed: int, index: int) -> int:
    return seed * 100003 + index


def draw_case(cseed: int, device: str) -> dict:
    """The parameters of case `cseed` (plain values: the log line and the replay)."""
    rng = random.Random(cseed)
    gpu = device != "cpu"
    dtype = rng.choices(["bf16", "fp16", "fp32"], [45, 25, 30])[0] if gpu else rng.choice(["fp32", "fp16"])
    kind = rng.choices(KINDS, [55, 15, 15, 15])[0]
    route = rng.choices(["default", "decode", "prefill", "dense"], [25, 20, 40, 15])[0]
    k = rng.choice(GPU_K if gpu else CPU_K)
    n = rng.choice(GPU_N if gpu else CPU_N)
    if rng.random() < 0.5:
        m = rng.choice(GPU_M if gpu else CPU_M)
    else:
        m = int(math.exp(rng.uniform(0, math.log(70000 if gpu else 48))))
    if route == "decode":
        m = min(m, 4096 if gpu else 17)
    # size M so that a case takes well under a second of GPU time (its float64 sample and its kernels)
    # and a few GB: M N <= 2^28, M K <= 2^28, M N K <= 2^40 (fp32: 2^39, CUDA-core GEMMs)
    budget = min(2**28 // max(n, 1), 2**28 // k, (2**39 if dtype == "fp32" else 2**40) // max(n * k, 1))
    m = max(1, min(m, budget))
    if rng.random() < 0.75:  # other layouts are other kernel variants: each compiles (seconds)
        tile_n, slots = policy.TILE_N, policy.SLOTS
    else:
        tile_n = rng.choice([16, 32, 64, 128, 256])
        slots = rng.choice([s for s in (1, 2, 4, 8, 16, 32, 64) if s <= tile_n])
    threshold = rng.choices([0.0, 0.0, round(rng.uniform(0.01, 0.5), 3), -round(rng.uniform(0.01, 0.3), 3), 0.25])[0]
    densities = [0.0, 0.001, 0.005, 0.02, 0.1, 0.5, 1.0]
    case = {
        "seed": cseed,
        "dtype": dtype,
        "kind": kind,
        "route": route,
        "m": m,
        "k": k,
        "n": n,
        "tile_n": tile_n,
        "slots": slots,
        "threshold": threshold,
        "gate_bias": rng.random() < 0.4,
        "up_bias": kind in ("gated", "drelu") and rng.random() < 0.4,
        "down_bias": rng.random() < 0.4,
        "fused_gate": rng.random() < 0.5,
        "hot_rate": rng.choice([None, policy.HOT_RATE, policy.HOT_RATE, 0.0]),
        "density": rng.choices(densities, [3, 10, 30, 15, 8, 3, 2])[0],
        "special_rows": rng.choice([0.0, 0.05, 0.3]),  # share of empty and fully dense rows
        "burst_rows": rng.choice([0.0, 0.1, 0.5]),  # share of rows with a burst tile
        "hot_neurons": rng.random() < 0.35,
        "down_layout": rng.choices(["rows", "linear"], [9, 1])[0],  # linear: nn.Linear's, runs dense
        "x_layout": rng.choices(["2d", "3d", "strided"], [75, 15, 10])[0],
    }
    # the path policy.route gives the call (a down weight in nn.Linear's layout runs dense)
    case["path"] = policy.route(m, k, config_of(case)) if case["down_layout"] == "rows" else "dense"
    return case


def config_of(case: dict) -> policy.LayerConfig:
    changes = {
        "tile_n": case["tile_n"],
        "slots": case["slots"],
        "fused_gate": case["fused_gate"],
        "hot_rate": case["hot_rate"],
    }
    route = None if case["route"] == "default" else case["route"]
    return policy.default_config(case["k"]).replace(route=route, **changes)


def make_inputs(case: dict, device: str) -> dict:
    """The case's tensors in its dtype on `device` (drawn on the device by its seed)."""
    dtype = DTYPE_NAMES[case["dtype"]]
    m, k, n, t = case["m"], case["k"], case["n"], case["threshold"]
    g = torch.Generator(device=device).manual_seed(case["seed"])
    rng = random.Random(case["seed"] ^ 0x5EED)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    x = randn(m, k)
    wg = randn(n, k, scale=k**-0.5)
    # feature columns the generator steers: the last is a per-row offset (its gate weights one), the one
    # before it turns the hot neurons on, the ones before that each fill part of one tile (a burst)
    features = k - 1
    wg[:, -1] = 1.0
    x[:, -1] = 0.0
    if case["hot_neurons"] and k >= 3 and n >= 2 * policy.HOT_ALIGN:
        hot = torch.randperm(n, generator=g, device=device)[: min(64, n // 4)]
        wg[:, -2] = 0.0
        wg[hot, -2] = 3.0
        x[:, -2] = (torch.rand(m, generator=g, device=device) < 0.3).to(dtype)
        features = k - 2
    tile_n, slots = case["tile_n"], case["slots"]
    bursts = []  # (feature column, neurons it turns on)
    for b in range(min(4, features - 1)):
        tile = rng.randrange(triton.cdiv(n, tile_n))
        width = min(tile_n, n - tile * tile_n)
        fill = rng.choice([slots, slots + 1, tile_n])
        if fill > width:
            continue
        col = features - 1 - b
        neurons = torch.tensor(rng.sample(range(width), fill), device=device) + tile * tile_n
        wg[:, col] = 0.0
        wg[neurons, col] = 1.0
        x[:, col] = 0.0
        bursts.append((col, neurons))
    gate_bias = randn(n, scale=0.01) if case["gate_bias"] else None

    def gate():
        return torch.nn.functional.linear(x.float(), wg.float(), gate_bias.float() if gate_bias is not None else None)

    # per-row density: the row's offset puts the threshold between its c-th and (c+1)-th largest value
    # (exact before the offset's rounding to the dtype); burst rows start empty
    pre = gate()
    density = torch.full((m,), case["density"], device=device)
    special = torch.rand(m, generator=g, device=device) < case["special_rows"]
    density = torch.where(special, (torch.rand(m, generator=g, device=device) < 0.5).float(), density)
    burst = (torch.rand(m, generator=g, device=device) < case["burst_rows"]) & (len(bursts) > 0)
    density = torch.where(burst, 0.0, density)
    count = torch.where(density > 0, (density * n).round().clamp_min(1), 0.0).long().clamp(0, n)
    offset = torch.empty(m, device=device)
    for lo in range(0, m, 4096):
        top = pre[lo : lo + 4096].sort(dim=1, descending=True).values
        c = count[lo : lo + 4096]
        above = top.gather(1, (c - 1).clamp_min(0)[:, None])[:, 0]
        below = top.gather(1, c.clamp_max(n - 1)[:, None])[:, 0]
        mid = torch.where(c == 0, top[:, 0] + 0.5, torch.where(c == n, top[:, -1] - 0.5, (above + below) / 2))
        offset[lo : lo + 4096] = t - mid
    x[:, -1] = offset.to(dtype)
    if bursts:
        # a burst row: its tile's chosen neurons lifted past the threshold (the lowest just past it, where a
        # wrong threshold shows), every other neuron below it
        pre = gate()
        which = torch.randint(len(bursts), (m,), generator=g, device=device)
        for b, (col, neurons) in enumerate(bursts):
            lift = (t - pre[:, neurons]).amax(1).clamp_min(0) + 0.02
            x[:, col] = torch.where(burst & (which == b), lift, 0.0).to(dtype)
    gated = case["kind"] in ("gated", "drelu")
    wd_rows = randn(n, k, scale=n**-0.5)  # down_weight.t(): the layout sparsify stores
    down_weight = wd_rows.t() if case["down_layout"] == "rows" else wd_rows.t().contiguous()
    tensors = {
        "x": x,
        "gate_weight": wg,
        "up_weight": randn(n, k, scale=k**-0.5) if gated else None,
        "down_weight": down_weight,
        "gate_bias": gate_bias,
        "up_bias": randn(n, scale=0.1) if case["up_bias"] else None,
        "down_bias": randn(k, scale=0.1) if case["down_bias"] else None,
    }
    return tensors


def shaped_x(x: torch.Tensor, layout: str) -> torch.Tensor:
    """x as the call receives it: [M, K], [2, M/2, K] (even M), or rows of a wider tensor."""
    m, k = x.shape
    if layout == "3d" and m % 2 == 0:
        return x.reshape(2, m // 2, k)
    if layout == "strided":
        wide = torch.full((m, k + 8), float("nan"), dtype=x.dtype, device=x.device)
        wide[:, :k] = x
        return wide[:, :k]
    return x


def call_op(case: dict, t: dict, x: torch.Tensor, config: policy.LayerConfig) -> torch.Tensor:
    """The FFN through the public ops on CUDA; on the CPU through the dispatcher the CUDA op calls."""
    th = case["threshold"]
    kind = case["kind"]
    if kind in ("gated", "drelu"):
        args = (x, t["gate_weight"], t["up_weight"], t["down_weight"], t["gate_bias"], t["up_bias"], t["down_bias"])
        if x.is_cuda:
            return torch.ops.twell.gated_ffn(*args, th, kind == "drelu", *config.op_args())
        return dispatch.gated_ffn_cuda(*args, th, kind == "drelu", config)
    args = (x, t["gate_weight"], t["down_weight"], t["gate_bias"], t["down_bias"])
    if x.is_cuda:
        return torch.ops.twell.ffn(*args, th, kind == "relu2", *config.op_args())
    return dispatch.ffn_cuda(*args, th, kind == "relu2", config)


def sample_rows(case: dict, t: dict, device: str) -> torch.Tensor:
    """Rows whose outputs are checked in float64: the first and last 32, every kind of special row, random."""
    m = case["m"]
    g = torch.Generator(device="cpu").manual_seed(case["seed"] + 1)
    picks = [
        torch.arange(min(m, 32)),
        torch.arange(max(0, m - 32), m),
        torch.randperm(m, generator=g)[:SAMPLE_RANDOM_ROWS],
    ]
    steered = t["x"][:, -6:-1].cpu()  # the burst features' columns (and the hot one)
    for col in range(steered.shape[1]):
        picks.append(torch.nonzero(steered[:, col] != 0)[:32, 0])
    return torch.unique(torch.cat(picks)).to(device)


def reference_check(case: dict, t: dict, rows: torch.Tensor) -> dict:
    """float64 reference of the sampled rows, and the allowance for entries at the threshold."""
    dtype = DTYPE_NAMES[case["dtype"]]
    d = {name: (v.double() if v is not None else None) for name, v in t.items() if name != "x"}
    xs = t["x"][rows].double()
    th, kind = case["threshold"], case["kind"]
    if kind in ("gated", "drelu"):
        ref = ref_ops.gated_ffn_reference(
            xs, d["gate_weight"], d["up_weight"], d["down_weight"], d["gate_bias"], d["up_bias"], d["down_bias"], th,
            kind == "drelu",
        )  # fmt: skip
    else:
        ref = ref_ops.ffn_reference(
            xs, d["gate_weight"], d["down_weight"], d["gate_bias"], d["down_bias"], th, kind == "relu2"
        )
    pre = torch.nn.functional.linear(xs, d["gate_weight"], d["gate_bias"])
    spread = torch.nn.functional.linear(xs * xs, d["gate_weight"] ** 2).sqrt()
    band = STORE_ULP[dtype] * pre.abs() + 8 * FP32_ULP * math.sqrt(case["k"] / 2) * spread
    if d["gate_bias"] is not None:
        band += FP32_ULP * d["gate_bias"].abs()
    rounded = torch.tensor(th, dtype=torch.float64).to(dtype).double().item()
    lo, hi = min(th, rounded), max(th, rounded)
    near = (pre >= lo - band) & (pre <= hi + band)
    if kind in ("gated", "drelu"):
        up = torch.nn.functional.linear(xs, d["up_weight"], d["up_bias"])
        value = pre.abs() * (up.clamp_min(0) if kind == "drelu" else up.abs())
    else:
        value = pre * pre if kind == "relu2" else pre.abs()
    column = d["down_weight"].norm(dim=0)
    allowance = (torch.where(near, value, 0.0) * column).sum(1)
    active = (pre > th).double().mean().item()
    return {
        "ref": ref,
        "allowance": allowance,
        "near": int(near.sum()),
        "active": active,
        "magnitude": magnitude(case, d, xs, pre).norm(dim=1),
    }


def magnitude(case: dict, d: dict, xs: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """The sampled rows' output computed on absolute values (|x| |W| through every product, the kept
    entries only, to first order in h's factors): the scale of a dot product's rounding error, which a
    row whose terms cancel keeps while its output shrinks (the dense route failed such fp32 rows against
    the output's own norm, fuzz-20261201-230643.json)."""
    kind, th = case["kind"], case["threshold"]
    a = d["gate_weight"].abs()
    gate = torch.nn.functional.linear(xs.abs(), a, d["gate_bias"].abs() if d["gate_bias"] is not None else None)
    kept = pre > th
    if kind in ("gated", "drelu"):
        up_b = d["up_bias"].abs() if d["up_bias"] is not None else None
        up = torch.nn.functional.linear(xs, d["up_weight"], d["up_bias"])
        up_mag = torch.nn.functional.linear(xs.abs(), d["up_weight"].abs(), up_b)
        h = gate * up.abs() + pre.abs() * up_mag
    else:
        h = 2 * pre.abs() * gate if kind == "relu2" else gate
    out = torch.nn.functional.linear(torch.where(kept, h, 0.0), d["down_weight"].abs())
    return out + (d["down_bias"].abs() if d["down_bias"] is not None else 0.0)


def plain_pytorch(case: dict, t: dict) -> torch.Tensor:
    """The FFN as the untouched model computes it: the reference's PyTorch ops in the case's dtype
    (cuBLAS on a GPU) over all M rows (compare samples them), the yardstick of what rounding alone costs at
    this case's shapes. All rows, because cuBLAS picks its kernel by shape: in seed 146 of
    fuzz-20261201-230643.json (bf16, M=22510, K=1001) the whole batch's gate GEMM gave 0.0305 for a
    pre-activation of 0.0263 (float64; 0.0262 from a GEMM of the sampled rows), past the threshold
    0.029, so a neuron fired for twell's cuBLAS gate as it would for the model's own (likely torch's
    default reduced-precision bf16 reduction)."""
    xs = t["x"]
    th, kind = case["threshold"], case["kind"]
    if kind in ("gated", "drelu"):
        return ref_ops.gated_ffn_reference(
            xs, t["gate_weight"], t["up_weight"], t["down_weight"], t["gate_bias"], t["up_bias"], t["down_bias"], th,
            kind == "drelu",
        )  # fmt: skip
    return ref_ops.ffn_reference(
        xs, t["gate_weight"], t["down_weight"], t["gate_bias"], t["down_bias"], th, kind == "relu2"
    )


def compare(out: torch.Tensor, rows: torch.Tensor, check: dict, tol: float, baseline: dict | None = None) -> dict:
    """The case's verdict fields for one output. baseline: compare's fields for the plain PyTorch FFN on
    the same rows; twell may err as much as rounding in the case's dtype does there, twice over (bf16
    rows whose output nearly cancels miss the absolute bounds through rounding alone: the dense route
    failed them in fuzz-20261201-214924.json)."""
    finite = bool(torch.isfinite(out).all())
    ref, allowance = check["ref"], check["allowance"]
    got = out.reshape(-1, out.shape[-1])[rows].double()
    diff = (got - ref).norm(dim=1)
    ref_rows = ref.norm(dim=1)
    floor = 0.1 * ref_rows.square().mean().sqrt()
    err = (diff.square().sum().sqrt() / ref_rows.square().sum().sqrt().clamp_min(1e-30)).item()
    allow = (allowance.square().sum().sqrt() / ref_rows.square().sum().sqrt().clamp_min(1e-30)).item()
    scale = torch.maximum(torch.maximum(ref_rows, floor), check["magnitude"])
    row_ratio = (diff / (tol * scale.clamp_min(1e-30) + allowance)).max().item()
    err_bound, row_bound = tol + allow, 1.0
    if baseline is not None:
        err_bound = max(err_bound, 2 * baseline["rel_err"])
        row_bound = max(row_bound, 2 * baseline["worst_row"])
    ok = finite and err <= err_bound and row_ratio <= row_bound  # NaN compares false: never passes
    return {"ok": ok, "finite": finite, "rel_err": err, "allowance": allow, "worst_row": row_ratio}


def poison_allocator(case: dict, device: str) -> None:
    """Refill the CUDA caching allocator with 0xFF bytes: the call's fresh buffers start as NaN / -1."""
    if device == "cpu":
        return
    torch.cuda.empty_cache()
    element = DTYPE_NAMES[case["dtype"]].itemsize
    m, k, n = case["m"], case["k"], case["n"]
    tiles = triton.cdiv(n, case["tile_n"])
    large = m * (2 * k * element + n * element + tiles * case["slots"] * (element + 2) + tiles * 4 + 2 * 256 * 4)
    block = torch.empty(min(large + (64 << 20), 4 << 30), dtype=torch.uint8, device=device).fill_(255)
    small = [torch.empty(1 << 19, dtype=torch.uint8, device=device).fill_(255) for _ in range(32)]
    del block, small


def poison_reaches_new_buffers(device: str) -> bool | None:
    """Whether fresh CUDA buffers of the sizes a call allocates read as NaN after poison_allocator (None
    on the CPU, which has no caching allocator)."""
    if device == "cpu":
        return None
    case = {"dtype": "bf16", "m": 4096, "k": 2048, "n": 5632, "tile_n": policy.TILE_N, "slots": policy.SLOTS}
    poison_allocator(case, device)
    fresh = [torch.empty(4096, 2048, dtype=torch.bfloat16, device=device), torch.empty(100, device=device)]
    return all(bool(t.isnan().all()) for t in fresh)


def run_case(case: dict, device: str) -> dict:
    """One case: its record (the parameters, then the verdict of each call, or the exception)."""
    start = time.perf_counter()
    record = dict(case)
    try:
        dispatch.forget_layers()
        t = make_inputs(case, device)
        config = config_of(case)
        rows = sample_rows(case, t, device)
        check = reference_check(case, t, rows)
        record["near_threshold"] = check["near"]
        record["active"] = round(check["active"], 5)  # share of kept gate entries in the sample
        calls = 2 if record["path"] == "prefill" else 1
        tol = TOL[DTYPE_NAMES[case["dtype"]]]
        baseline = compare(plain_pytorch(case, t), rows, check, tol)
        record["baseline"] = baseline
        verdicts = []
        for _ in range(calls):
            x = shaped_x(t["x"], case["x_layout"])
            poison_allocator(case, device)
            out = call_op(case, t, x, config)
            if out.shape != x.shape or out.dtype != x.dtype:
                raise ValueError(f"output {list(out.shape)} {out.dtype}, expected {list(x.shape)} {x.dtype}")
            if device != "cpu":
                torch.cuda.synchronize()
            verdicts.append(compare(out, rows, check, tol, baseline))
            del out
        state = dispatch.layer_state(t["gate_weight"], case["m"]) if record["path"] == "prefill" else None
        record["hot_used"] = len(state.hot.index) if state is not None and state.hot is not None else 0
        record["calls"] = verdicts
        record["ok"] = all(v["ok"] for v in verdicts)
        record["rel_err"] = max(v["rel_err"] for v in verdicts)
        record["tol"] = tol
    except Exception as error:  # a crash of one case is a result: record it, go on
        record["ok"] = False
        record["error"] = f"{type(error).__name__}: {error}"[:2000]
        record["traceback"] = traceback.format_exc()[-4000:]
    record["seconds"] = round(time.perf_counter() - start, 3)
    return record


def _worker(wid: int, device: str, inbox, outbox) -> None:
    """Runs the cases the parent sends (None: stop); after a CUDA error (the context is lost) the parent
    replaces it."""
    outbox.put(("ready", wid, None))
    while True:
        case = inbox.get()
        if case is None:
            return
        record = run_case(case, device)
        outbox.put(("done", wid, record))


class Pool:
    """Worker processes on one GPU; the parent knows which case each runs, so a dead or hung worker's
    case is recorded as a crash and a fresh worker takes the next case."""

    def __init__(self, workers: int, device: str):
        self.ctx = mp.get_context("spawn")
        self.device = device
        self.outbox = self.ctx.Queue()
        self.workers: dict[int, tuple] = {}  # wid -> (process, inbox)
        self.running: dict[int, tuple] = {}  # wid -> (case, start time)
        self.next_id = 0
        self.idle_deaths = 0
        for _ in range(workers):
            self.spawn()

    def spawn(self) -> None:
        wid, self.next_id = self.next_id, self.next_id + 1
        inbox = self.ctx.Queue()
        process = self.ctx.Process(target=_worker, args=(wid, self.device, inbox, self.outbox), daemon=True)
        process.start()
        self.workers[wid] = (process, inbox)

    def stop(self, wid: int, kill: bool = False) -> None:
        process, inbox = self.workers.pop(wid)
        if kill:
            process.kill()
        else:
            inbox.put(None)
        process.join(timeout=10)
        if process.is_alive():
            process.kill()

    def run(self, cases: list, deadline: float, on_record) -> list:
        """Run `cases` until done or `deadline` (time.monotonic()); returns the cases left unstarted or
        unfinished."""
        todo = list(cases)
        idle = []
        while todo or self.running:
            now = time.monotonic()
            if now > deadline:
                break
            try:
                kind, wid, record = self.outbox.get(timeout=0.5)
            except queue.Empty:
                kind = None
            if kind == "done":
                self.running.pop(wid, None)
                on_record(record)
                if any(word in record.get("error", "") for word in FATAL):
                    self.stop(wid, kill=True)
                    self.spawn()
                else:
                    idle.append(wid)
            elif kind == "ready":
                idle.append(wid)
            for wid, (process, _) in list(self.workers.items()):
                case_start = self.running.get(wid)
                dead = not process.is_alive()
                hung = case_start is not None and now - case_start[1] > CASE_TIMEOUT
                if dead or hung:
                    if case_start is None:  # died before taking a case: its start-up fails
                        self.idle_deaths += 1
                        if self.idle_deaths > 3:
                            raise RuntimeError(f"fuzz workers die at start-up (exit code {process.exitcode})")
                    else:
                        why = f"worker exit code {process.exitcode}" if dead else f"no result in {CASE_TIMEOUT} s"
                        on_record(
                            {**case_start[0], "ok": False, "error": f"crash: {why}", "seconds": now - case_start[1]}
                        )
                        self.running.pop(wid)
                    self.stop(wid, kill=True)
                    idle = [w for w in idle if w != wid]
                    if todo:
                        self.spawn()
            # stop handing out cases when the next could not finish before the deadline on a warm worker
            while idle and todo and deadline - time.monotonic() > 20:
                wid = idle.pop()
                case = todo.pop(0)
                self.running[wid] = (case, time.monotonic())
                self.workers[wid][1].put(case)
        left = todo + [case for case, _ in self.running.values()]
        # idle workers leave when told, busy or still starting ones are killed after a few seconds
        for wid, (process, inbox) in self.workers.items():
            if wid in self.running:
                process.kill()
            else:
                inbox.put(None)
        end = time.monotonic() + 3
        for process, _ in self.workers.values():
            process.join(timeout=max(0.0, end - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        self.workers.clear()
        self.running.clear()
        return left


def summarize(records: list, unfinished: list, args, seconds: float) -> dict:
    failures = [r for r in records if not r["ok"]]
    return {
        **environment(),
        "poison_effective": poison_reaches_new_buffers(args.device),
        "device": args.device,
        "seed": args.seed,
        "cases_requested": args.cases,
        "cases": len(records),
        "passed": len(records) - len(failures),
        "failed": len(failures),
        "unfinished": [c["seed"] for c in unfinished],
        "seconds": round(seconds, 1),
        "failures": [
            {
                key: r.get(key)
                for key in ("seed", "dtype", "kind", "route", "path", "m", "k", "n", "rel_err", "tol", "error")
            }
            for r in failures
        ],
        "largest_allowance": max((c["allowance"] for r in records for c in r.get("calls", [])), default=0.0),
        "by_path": table_rows(records),
    }


def table_rows(records: list) -> list:
    groups: dict[tuple, dict] = {}
    for r in records:
        key = (r.get("path", "?"), r["dtype"])
        row = groups.setdefault(key, {"path": key[0], "dtype": key[1], "cases": 0, "failed": 0, "worst": 0.0, "hot": 0})
        row["cases"] += 1
        row["failed"] += not r["ok"]
        row["hot"] += r.get("hot_used", 0) > 0
        if r.get("rel_err") is not None and math.isfinite(r["rel_err"]):
            row["worst"] = max(row["worst"], r["rel_err"] / r["tol"])
    return [groups[key] for key in sorted(groups)]


def print_table(summary: dict) -> None:
    print(f"{'path':<8} {'dtype':<5} {'cases':>5} {'failed':>6} {'hot':>4} {'worst err/tol':>13}")
    for row in summary["by_path"]:
        counts = f"{row['cases']:>5} {row['failed']:>6} {row['hot']:>4}"
        print(f"{row['path']:<8} {row['dtype']:<5} {counts} {row['worst']:>13.3g}")
    for f in summary["failures"]:
        print(f"FAILED seed {f['seed']}: {f['dtype']} {f['kind']} {f['route']}->{f.get('path')} M={f['m']} K={f['k']} "
              f"N={f['n']} err={f.get('rel_err')} {f.get('error') or ''}"[:300])  # fmt: skip
    print(
        f"{summary['cases']} cases, {summary['failed']} failed, {len(summary['unfinished'])} unfinished, "
        f"{summary['seconds']} s on {summary['gpu']} (torch {summary['torch']}, triton {summary['triton']}, "
        f"commit {summary['commit']}); allocator poisoned: {summary['poison_effective']}, largest allowance "
        f"{summary['largest_allowance']:.3g}"
    )


def main(argv=None, started: float | None = None) -> int:
    """The sweep; its --time-limit counts from `started` (time.monotonic(); None: this call), so a caller
    that imported the module long before (a test suite) still gets the whole limit."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=None, help="default: 500 on a GPU, 4 with --smoke")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-limit", type=float, default=480.0, help="seconds; stops cleanly before it")
    parser.add_argument("--device", default=None, help="cuda (default where there is one) or cpu")
    parser.add_argument("--workers", type=int, default=None, help="processes on the GPU (0: in this one)")
    parser.add_argument("--replay", type=int, action="append", default=[], help="a case seed to run alone")
    parser.add_argument("--smoke", action="store_true", help="CPU, interpreter, a few tiny cases")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    if args.device is None:
        args.device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("the CPU runs the kernels under TRITON_INTERPRET=1 (set it, or pass --smoke)")
    if args.cases is None:
        args.cases = 4 if args.device == "cpu" else 500
    if args.workers is None:
        # Triton's compiles (one core each) take most of a run: all but a few cores, a few GB of GPU memory each
        args.workers = 0 if args.device == "cpu" else min(12, max(1, (os.cpu_count() or 2) - 4))
    seeds = args.replay or [case_seed(args.seed, i) for i in range(args.cases)]
    cases = [draw_case(s, args.device) for s in seeds]
    start = time.monotonic() if started is None else started
    deadline = start + args.time_limit
    path = result_path(args.out, "fuzz")
    records = []
    with open(path.with_suffix(".jsonl"), "w") as log:

        def on_record(record):
            records.append(record)
            log.write(json.dumps(record) + "\n")
            log.flush()
            mark = "ok  " if record["ok"] else "FAIL"
            print(f"{mark} seed {record['seed']} {record['dtype']} {record['kind']} {record['route']} M={record['m']} "
                  f"K={record['k']} N={record['n']} err={record.get('rel_err')} {record.get('error', '')[:200]}",
                  flush=True)  # fmt: skip

        if args.workers == 0:
            unfinished = []
            for i, case in enumerate(cases):
                if time.monotonic() > deadline:
                    unfinished = cases[i:]
                    break
                on_record(run_case(case, args.device))
        else:
            unfinished = Pool(args.workers, args.device).run(cases, deadline - 5, on_record)
    summary = summarize(records, unfinished, args, time.monotonic() - start)
    summary["log"] = str(path.with_suffix(".jsonl"))
    path.write_text(json.dumps(summary, indent=1))
    print_table(summary)
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main(started=STARTED))
