"""Training benchmark: one FFN layer's forward + backward with the L1 activation penalty, dense autograd
(eager and torch.compile, the faster counts) against twell's sparse training path.

Run on a GPU:  PYTHONPATH=. python benchmarks/train.py [--shapes 2048x5632,4096x14336] [--ms 16384,32768]
               PYTHONPATH=. python benchmarks/train.py --smoke      # tiny shapes, a minute with compiles
               PYTHONPATH=. python benchmarks/train.py --model      # a whole model's training step
Without CUDA, --smoke checks the sparse training op's gradients through Triton's interpreter on the CPU
(TRITON_INTERPRET=1, fp32) and times nothing; a full run needs CUDA.

A step: y = layer(x); loss = <y, dy> + lam * l1_penalty (twell.train: mean |h| over the layer's
[M, N] hidden activation); backward to x and every parameter (grads set to None before each step, as
an optimizer's zero_grad does). Both sides run what users run: the Llama-style ReLU-gated FFN of
benchmarks/ffn.py with twell.train.track_l1 on it, dense; and the same module after twell.sparsify
(its weight layouts, its modules), tracked the same way. The compiled dense side is the same step as
one function of the weights, compiled once (dynamic shapes); so is twell's (twell_compiled: the
sparse training op on the sparsified weights, the L1 term from its own sum |h|), where Inductor fuses
the loss's elementwise work around the op as it does for dense. Inputs: benchmarks/ffn.py's
make_inputs (uniform and skewed firing rates).

Per point: medians of triton.testing.do_bench over 3 input sets, peak memory of a step above what
was allocated before it, the gradient error of twell against dense eager (dx on a row sample, every
weight gradient whole, ‖a−b‖/‖b‖), and per-product kernel times of twell's step from the profiler:
gate GEMM (cuBLAS), sparse forward, dx, dW, the neuron sort, and the rest (zeroing, casts, L1). The
closing table gives each product's time against its floor: gathered weight rows at ~8 TB/s through
L2 (fwd: W_u, W_d rows per pair; dx: W_g, W_u, W_d), x and dy rows gathered per pair at ~4 TB/s from
HBM (dW: they exceed L2), and the GEMM at the measured cuBLAS rate. JSON to benchmarks/results/.

--model: a whole model's training step (model_main): a Llama-style ReLU model at the paper's 2B shape
(hidden 2048, intermediate 5632, 32 heads, vocabulary 49152; --layers of them, 8 by default; random
weights built from a transformers LlamaConfig with hidden_act="relu" and gate biases, nothing
downloaded), --batch x --seq tokens (16 x 2048), the 0.5% skewed profile of benchmarks/e2e.py set
through the gate biases on the batch each step trains on. A step: language-model loss + LAM *
twell.train.l1_penalty(model), backward, AdamW step. Rows: dense eager, dense compiled
(torch.compile(model)), twell eager and twell compiled (twell.sparsify(model, [batch],
layer_config={"train_min_m": 1}): calibrated on the step's batch, so each layer's train_hot is
calibration's choice, policy.calibrated_train_hot, unless --hot sets every layer's; then compiled); the
weights are restored before each row, with a fresh optimizer; the JSON's "calibration" holds each
layer's choice and the shares it came from. Per row: median step ms, tokens/s, peak memory (GB, weights
and optimizer state included) and energy per token (NVML; null without it).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

import torch

SMOKE_WITHOUT_CUDA = not torch.cuda.is_available() and "--smoke" in sys.argv
if SMOKE_WITHOUT_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch.nn.functional as F  # noqa: E402
from ffn import ceilings, environment, make_inputs, peak_mb, result_path  # noqa: E402  (the benchmarks' directory is on sys.path)
from triton.testing import do_bench  # noqa: E402

import twell  # noqa: E402
import twell.ops  # noqa: E402, F401  (registers torch.ops.twell.*)
import twell.train  # noqa: E402
from twell.kernels import backward, policy, reference  # noqa: E402

LAM = 2e-5  # the paper's L1 coefficient
INPUT_SETS = 3
REP_MS = 300  # do_bench's repetition time: at least 5 steps at the largest shape (~60 ms a dense step)
L2_TB_S = 8.0  # gathered rows of an L2-resident matrix (PAPER: 8.2-9.4 TB/s measured)
HBM_TB_S = 4.0  # device copy (4.26 TB/s measured)
STAGES = {  # profiler kernel-name fragments -> stage
    "_train_forward_kernel": "fwd_sparse",
    # --forward-pack: the prefill kernels and the record kernel (the up+down launch's row-order argsort
    # is a radix sort: counted in "sort")
    "_pack_dense_kernel": "fwd_sparse",
    "_row_totals_kernel": "fwd_sparse",
    "_twell_up_down_kernel": "fwd_sparse",
    "_heavy_kernel": "fwd_sparse",
    "_pack_record_kernel": "fwd_sparse",
    "_train_dx_kernel": "dx",
    "_train_dw_kernel": "dw",
    "RadixSort": "sort",
    "radix": "sort",
    "searchsorted": "sort",
    "gemm": "gemm",
    "nvjet": "gemm",
    "cutlass": "gemm",
    "sm90_": "gemm",
}


def dense_loss(x, dy, gate_weight, gate_bias, up_weight, down_weight):
    """The dense layer's loss as one function of the weights (torch.compile's side; AOT autograd
    compiles its backward too)."""
    hidden = F.relu(F.linear(x, gate_weight, gate_bias)) * F.linear(x, up_weight)
    return (F.linear(hidden, down_weight) * dy).float().sum() + LAM * hidden.abs().float().mean()


def twell_loss(x, dy, gate_weight, gate_bias, up_weight, down_weight, entries, dense_above, hot, forward_pack):
    """The sparsified layer's loss as one function of its weights (twell's compiled side): the sparse
    training op, its L1 term the mean |h| from the op's own sum (as twell.train's penalty takes it)."""
    n = gate_weight.shape[0]
    y, *_, l1_sum, _ = torch.ops.twell.ffn_train(
        x, gate_weight, up_weight, down_weight, gate_bias, None, None, 0.0, False, False, policy.train_width(n),
        entries, dense_above, hot, forward_pack,
    )  # fmt: skip
    return (y * dy).float().sum() + LAM * l1_sum / (x.shape[0] * n)


def module_step(block, x, dy):
    """The user's step on a (dense or sparsified) tracked module; returns (dx, grads by parameter name)."""
    block.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = block(x)
    loss = (y * dy).float().sum() + LAM * twell.train.l1_penalty(block)
    loss.backward()
    return x.grad, {name: p.grad for name, p in block.named_parameters()}


def _params(block):
    mlp = block.mlp
    return mlp.gate_proj.weight, mlp.gate_proj.bias, mlp.up_proj.weight, mlp.down_proj.weight


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def stage_times(fn, steps=3) -> dict:
    """Kernel time per stage of fn (ms per call), from the profiler's device times, and the sparse
    forward's and the rest's ("other": zeroing, casts, copies, the L1 term, the dense passes' elementwise
    kernels) by kernel (fwd_sparse_kernels, other_kernels)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    times = {stage: 0.0 for stage in set(STAGES.values()) | {"other"}}
    forward, other = {}, {}  # the sparse forward's kernels apart (--forward-pack runs five), and the rest's
    for event in prof.key_averages():
        total = getattr(event, "device_time_total", None)
        total = event.cuda_time_total if total is None else total
        if total <= 0:
            continue
        stage = next((s for frag, s in STAGES.items() if frag in event.key), "other")
        times[stage] += total / 1e3 / steps
        by_kernel = forward if stage == "fwd_sparse" else other if stage == "other" else None
        if by_kernel is not None:
            by_kernel[event.key[:60]] = by_kernel.get(event.key[:60], 0.0) + total / 1e3 / steps
    return {**{f"{stage}_ms": t for stage, t in times.items()}, "fwd_sparse_kernels": forward, "other_kernels": other}


def host_ms(fn, calls=20) -> float:
    """Median host time of one call of fn (ms): from an idle GPU (synchronized before the call, not after)
    to fn's return; a step whose host time exceeds its kernels' time is bound by its launches (or waits
    on the GPU somewhere: then this includes the kernels before the wait)."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def host_profile(fn, calls=5, top=30) -> list:
    """cProfile of calls of fn: the `top` functions by own time, ms per call (--host-profile)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler).sort_stats("tottime")
    rows = []
    for (path, line, name), (_, ncalls, tottime, cumtime, _) in list(stats.stats.items()):
        rows.append({"function": f"{os.path.basename(path)}:{line} {name}", "calls": ncalls / calls,
                     "own_ms": tottime * 1e3 / calls, "cum_ms": cumtime * 1e3 / calls})  # fmt: skip
    return sorted(rows, key=lambda r: -r["own_ms"])[:top]


def floors(k, n, m, pairs, gemm_tflop_s) -> dict:
    """Each product's floor (ms) on the measured ceilings; bytes/flops in the module docstring."""
    row = 2 * k  # bytes of one bf16 row
    return {
        "gemm_floor_ms": 2 * m * k * n / gemm_tflop_s / 1e9,
        "fwd_sparse_floor_ms": (pairs * 2 * row / L2_TB_S + (m * n * 2 + 2 * m * row) / HBM_TB_S) / 1e9,
        "dx_floor_ms": (pairs * 3 * row / L2_TB_S + 2 * m * row / HBM_TB_S) / 1e9,
        "dw_floor_ms": (pairs * 2 * row + 3 * n * k * 4 * 2) / HBM_TB_S / 1e9,
    }


def bench_point(
    k, n, m, density, pattern, compiled, twell_compiled, gemm_tflop_s, entries, dense_above, hot, forward_pack,
    with_host_profile=False,
) -> dict:  # fmt: skip
    x0, block = make_inputs(m, k, n, density, pattern, seed=m + n)
    block.train()
    # more input sets for the same layer: x does not depend on the weights (make_inputs), only its seed
    xs = [x0] + [make_inputs(m, k, 8, density, pattern, seed=m + n + i)[0] for i in range(1, INPUT_SETS)]
    dys = [torch.randn_like(x) for x in xs]
    params = [p.requires_grad_() for p in _params(block)]
    i = iter(range(1 << 30))

    def nxt():
        j = next(i) % INPUT_SETS
        return xs[j], dys[j]

    def dense_compiled():
        x, dy = nxt()
        x = x.detach().requires_grad_()
        return torch.autograd.grad(compiled(x, dy, *params), [x, *params])

    def user_step():
        return module_step(block, *nxt())

    def measure(step):
        """(median ms, peak MB, grads on the first input set) of a tracked module's step."""
        step()  # compiles and autotunes outside the timing
        ms = do_bench(step, warmup=50, rep=REP_MS, return_mode="median")
        block.zero_grad(set_to_none=True)
        peak = peak_mb(lambda: module_step(block, x0, dys[0]))
        return ms, peak, module_step(block, x0, dys[0])

    tracker = twell.train.track_l1(block)
    dense_ms, dense_peak, (dense_dx, dense_grads) = measure(user_step)
    tracker.remove()
    dense_compiled()
    compiled_ms = do_bench(dense_compiled, warmup=50, rep=REP_MS, return_mode="median")

    # the sparse training path is opt-in: at every size
    layer_config = {"train_min_m": 1, "train_entries": entries, "train_dense_above": dense_above, "train_hot": hot}
    layer_config["train_forward_pack"] = forward_pack
    twell.sparsify(block, layer_config=layer_config)
    tracker = twell.train.track_l1(block)
    twell_ms, twell_peak, (twell_dx, twell_grads) = measure(user_step)
    stages = stage_times(lambda: module_step(block, x0, dys[0]))
    tracker.remove()
    sparse_params = [p.requires_grad_() for p in _params(block)]

    def sparse_compiled():
        x, dy = nxt()
        x = x.detach().requires_grad_()
        return torch.autograd.grad(twell_compiled(x, dy, *sparse_params), [x, *sparse_params])

    sparse_compiled()
    twell_compiled_ms = do_bench(sparse_compiled, warmup=50, rep=REP_MS, return_mode="median")
    compiled_stages = stage_times(sparse_compiled)
    hosts = {"dense_compiled_host_ms": host_ms(dense_compiled), "twell_compiled_host_ms": host_ms(sparse_compiled)}
    if with_host_profile:
        hosts["twell_compiled_host_profile"] = host_profile(sparse_compiled)
    with torch.no_grad():
        pre = F.linear(x0, params[0], params[1])
        nnz = (pre > 0).sum(1)
        del pre
    sample = torch.linspace(0, m - 1, min(m, 1024), device=x0.device).long()
    width = policy.train_width(n)
    row = {
        "K": k,
        "N": n,
        "M": m,
        "density": density,
        "pattern": pattern,
        "width": width,
        "train_entries": entries,
        "train_dense_above": dense_above,
        "train_hot": hot,
        "train_forward_pack": forward_pack,
        "nnz_mean": nnz.float().mean().item(),
        "nnz_max": nnz.max().item(),
        "backup_rows": (nnz > width).sum().item(),
        "dense_eager_ms": dense_ms,
        "dense_compiled_ms": compiled_ms,
        "twell_ms": twell_ms,
        "twell_compiled_ms": twell_compiled_ms,
        "speedup": min(dense_ms, compiled_ms) / twell_ms,
        "speedup_compiled": min(dense_ms, compiled_ms) / twell_compiled_ms,
        "dense_peak_mb": dense_peak,
        "twell_peak_mb": twell_peak,
        "memory_ratio": twell_peak / dense_peak,
        "dx_err": rel(twell_dx[sample], dense_dx[sample]),
        **{f"{name}_err": rel(twell_grads[name], g) for name, g in dense_grads.items()},
        **stages,
        **{f"compiled_{name}": t for name, t in compiled_stages.items()},
        **hosts,
        **floors(k, n, m, nnz.sum().item(), gemm_tflop_s),
    }
    twell.restore(block)
    return row


def smoke_without_cuda() -> None:
    """The sparse training op's gradients against float64 dense autograd, through the interpreter."""
    print("no CUDA device: --smoke checks the sparse training op through Triton's interpreter (fp32, CPU)")
    x, block = make_inputs(40, 32, 96, 0.05, "skewed", dtype=torch.float32, device="cpu")
    wg, bg, wu, wd = (p.detach() for p in _params(twell.sparsify(block)))
    leaves = [t.clone().requires_grad_() for t in (x, wg, bg, wu, wd)]
    y = torch.ops.twell.ffn_train(
        leaves[0], leaves[1], leaves[3], leaves[4], leaves[2], None, None, 0.0, False, False, 16
    )[0]  # fmt: skip
    dy = torch.randn_like(y)
    y.backward(dy)
    ref_leaves = [t.double().requires_grad_() for t in (x, wg, bg, wu, wd)]
    xr, wgr, bgr, wur, wdr = ref_leaves
    reference.gated_ffn_reference(xr, wgr, wur, wdr, bgr).backward(dy.double())
    errors = {
        name: rel(a.grad, b.grad) for name, a, b in zip(("x", "wg", "bg", "wu", "wd"), leaves, ref_leaves, strict=True)
    }
    print(json.dumps(errors))
    if max(errors.values()) > 1e-4:
        raise SystemExit(f"gradient error above 1e-4: {errors}")
    print("ok: gradients within 1e-4 of float64 dense autograd; a timed run needs CUDA")


MODEL_SHAPE = {  # the paper's 2B shape
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 49152,
}
MODEL_ROWS = ("dense-eager", "dense-compiled", "twell-eager", "twell-compiled")
MODEL_DENSITY = 0.005  # the skewed profile's mean (benchmarks/ffn.py's skewed_rates)
MODEL_LR = 1e-6  # AdamW: small enough that the timed steps leave the gate biases' sparsity in place


def model_step(model, forward, optimizer, ids):
    """One training step: language-model loss + LAM * L1 penalty, backward, AdamW."""
    optimizer.zero_grad(set_to_none=True)
    loss = forward(input_ids=ids, labels=ids, use_cache=False).loss + LAM * twell.train.l1_penalty(model)
    loss.backward()
    optimizer.step()
    return loss.detach()


def time_steps(step, steps: int, meter) -> dict:
    """Median ms of `steps` timed steps (CUDA events, synchronised after each), peak GB, mJ per token
    (set by the caller) and the last loss."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times, energy_start = [], meter.energy_mj()
    for _ in range(steps):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        loss = step()
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end))
    energy_end = meter.energy_mj()
    return {
        "ms": statistics.median(times),
        "times_ms": times,
        "peak_gb": torch.cuda.max_memory_allocated() / 2**30,
        "energy_mj": None if energy_start is None else (energy_end - energy_start) / steps,
        "loss": loss.item(),
    }


def kernel_table(step, steps: int = 2, top: int = 30) -> dict:
    """--profile: where a model step's GPU time goes (the `top` kernels by device time, ms per step and
    launches per step) and what Dynamo did (graph breaks, recompilations) during the profiled steps."""
    from torch._dynamo.utils import counters
    from torch.profiler import ProfilerActivity, profile

    counters.clear()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        total = getattr(event, "device_time_total", None)
        total = event.cuda_time_total if total is None else total
        if total > 0:
            rows.append((total / 1e3 / steps, event.count / steps, event.key[:120]))
    rows.sort(reverse=True)
    return {
        "device_ms": sum(r[0] for r in rows),
        "launches": sum(r[1] for r in rows),
        "kernels": [{"ms": ms, "per_step": n, "name": name} for ms, n, name in rows[:top]],
        "dynamo": {k: dict(v) for k, v in counters.items() if k in ("graph_break", "stats", "recompiles")},
    }


def calibration_choice(model, seconds: float) -> dict:
    """What calibration chose for the twell rows: each rewritten layer's train_hot and every layer's
    shares of kept pairs held by its most frequent neurons (Decision.hot_pair_shares)."""
    records = [r for r in twell.report(model) if r.decision is not None]
    return {
        "seconds": seconds,
        "train_hot": {path: c.train_hot for path, c in twell.layer_configs(model).items()},
        "hot_pair_shares": {r.path: r.decision["hot_pair_shares"] for r in records},
        "density": {r.path: r.decision["density"] for r in records},
    }


def model_main(args, constants: dict) -> None:
    """The whole-model training step (module docstring, --model)."""
    from decode import llama, set_gate_biases
    from e2e import ROW_SPREAD, Meter, share_gate_direction
    from ffn import skewed_rates

    torch.backends.cuda.matmul.allow_tf32 = False
    shape = {**MODEL_SHAPE, "num_hidden_layers": args.layers}
    model = llama("cuda", torch.bfloat16, max_position_embeddings=args.seq, **shape)
    g = torch.Generator().manual_seed(2)
    share_gate_direction(model, ROW_SPREAD, g)
    calib = torch.randint(0, shape["vocab_size"], (args.batch, args.seq), generator=g).cuda()
    rates = [skewed_rates(shape["intermediate_size"], MODEL_DENSITY, g) for _ in range(args.layers)]
    layers = set_gate_biases(model, rates, calib)
    model.train()
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    # the step trains on the batch the biases were set on: on other random sequences the same biases
    # fire 3.5x as often (1.7% against 0.49%, train-model-20261201-214218.json), since in a random-weight
    # model a sequence's tokens share components (attention averages them) that 16 sequences sample
    # too thinly for the thresholds to hold on new ones
    ids = calib
    if args.fresh_ids:  # a variant: other sequences than the biases were set on (1.7% dense, skewed)
        ids = torch.randint(0, shape["vocab_size"], (args.batch, args.seq), generator=g).cuda()
    tokens = args.batch * args.seq
    meter = Meter(cuda=True)
    result = {
        **environment(transformers=__import__("transformers").__version__),
        "lam": LAM,
        "config": shape,
        "batch": args.batch,
        "seq": args.seq,
        "parameters_b": sum(p.numel() for p in model.parameters()) / 1e9,
        "layers": layers,
        "train_entries": args.entries,
        "train_dense_above": args.dense_above,
        "train_hot": args.hot,  # None: calibration's, per layer (result["calibration"])
        "train_forward_pack": args.forward_pack,
        "fresh_ids": args.fresh_ids,
        "backward_constants": constants,
        "rows": {},
    }
    path = result_path(args.out, "train-model")
    for row in args.rows.split(","):
        if row not in MODEL_ROWS:
            raise SystemExit(f"--rows takes {','.join(MODEL_ROWS)}, got {row!r}")
        if row.startswith("twell") and not hasattr(model, "_twell_sparsified"):
            # the sparse training path: opt-in; calibrated on the step's batch (the layers' train_hot)
            layer_config = {"train_min_m": 1, "train_entries": args.entries, "train_dense_above": args.dense_above}
            if args.hot is not None:
                layer_config["train_hot"] = args.hot
            layer_config["train_forward_pack"] = args.forward_pack
            started = time.perf_counter()
            config = {"progress": False, "cost_model": "analytic", "decode_steps": 0, "timing_repeats": 0}
            twell.sparsify(model, [calib], config=config, layer_config=layer_config)
            result["calibration"] = calibration_choice(model, time.perf_counter() - started)
            print(f"calibration: train_hot by layer {list(result['calibration']['train_hot'].values())}", flush=True)
            model._twell_sparsified = True
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(initial[name])
        optimizer = torch.optim.AdamW(model.parameters(), lr=MODEL_LR, fused=True)
        forward = torch.compile(model) if row.endswith("compiled") else model
        with twell.train.track_l1(model) as tracker:
            step = functools.partial(model_step, model, forward, optimizer, ids)
            start = time.perf_counter()
            for _ in range(args.warmup):  # compilation and autotuning
                step()
            torch.cuda.synchronize()
            measured = {"warmup_s": time.perf_counter() - start, **time_steps(step, args.steps, meter)}
            measured["density"] = statistics.mean(tracker.density().values())
            if args.profile:
                measured["profile"] = table = kernel_table(step)
                print(f"{row}: {table['device_ms']:.1f} ms on the device, {table['launches']:.0f} launches a step")
        del optimizer, step, forward
        torch.cuda.empty_cache()
        measured["tokens_per_s"] = tokens / measured["ms"] * 1e3
        measured["energy_mj_per_token"] = None if measured["energy_mj"] is None else measured["energy_mj"] / tokens
        result["rows"][row] = measured
        path.write_text(json.dumps(result, indent=1))  # kept if a later row fails
        print(
            f"{row:>15}: {measured['ms']:8.1f} ms  {measured['tokens_per_s']:9.0f} tok/s  "
            f"{measured['peak_gb']:6.1f} GB  density {measured['density']:.4f}  loss {measured['loss']:.4f}",
            flush=True,
        )
    dense = [r["ms"] for name, r in result["rows"].items() if name.startswith("dense")]
    for name, r in result["rows"].items():
        if dense and name.startswith("twell"):
            r["speedup"] = min(dense) / r["ms"]
            print(f"{name}: {r['speedup']:.2f}x tokens/s of the faster dense row")
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


def set_backward_constants(settings: list[str]) -> dict:
    """Apply NAME=VALUE settings to twell.kernels.backward's int constants (benchmark variants: the
    launchers read them at each call); returns every such constant's value, for the result file."""
    for setting in settings:
        name, _, value = setting.partition("=")
        if not (name.isupper() and isinstance(getattr(backward, name, None), int) and value.isdigit()):
            raise SystemExit(f"--backward-constant takes NAME=INT for an int constant of backward, got {setting!r}")
        setattr(backward, name, int(value))
    return {name: v for name, v in vars(backward).items() if name.isupper() and isinstance(v, int)}


def variant_points(k, n, m, density, pattern, variants: list[str], forward_pack: bool, shipped: dict) -> list:
    """One input's per-product kernel times (stage_times) of the sparse forward + backward at the kernel
    level under each variant (','-separated NAME=INT settings of backward's constants; '' the shipped
    ones), with each variant's largest gradient difference from the shipped constants'."""
    x, block = make_inputs(m, k, n, density, pattern, seed=m + n)
    wg, bg, wu, wd = (p.detach() for p in _params(block))
    wd_t = wd.t().contiguous()
    dy, l1_grad = torch.randn_like(x), torch.ones(1, device=x.device)
    # the layer's measured state as the op keeps it (train_dense_above: the dense passes' row counts)
    flags = {"threshold": 0.0, "drelu": False, "square": False, "dense_above": policy.TRAIN_DENSE_ABOVE}
    backward.forget_train_layers()

    def step():
        y, ids, gate, up, counts, *_ = backward.train_forward(
            x, wg, bg, wu, None, wd_t, None, width=policy.train_width(n), forward_pack=forward_pack, **flags
        )
        return backward.train_backward(dy, l1_grad, x, wg, bg, wu, None, wd_t, False, ids, gate, up, counts, **flags)

    reference = step()
    points = []
    for variant in variants:
        set_backward_constants([v for v in variant.split(",") if v])
        err = max(rel(a, b) for a, b in zip(step(), reference, strict=True) if b.numel())
        point = {"K": k, "N": n, "M": m, "density": density, "pattern": pattern, "variant": variant}
        points.append({**point, "max_rel_diff": err, **stage_times(step)})
        for name, value in shipped.items():
            setattr(backward, name, value)
        t = points[-1]
        print(
            f"{k}x{n} {m} {density} {pattern} [{variant or 'shipped'}] fwd {t['fwd_sparse_ms']:.2f} dx {t['dx_ms']:.2f}"
            f" dW {t['dw_ms']:.2f} sort {t['sort_ms']:.2f} other {t['other_ms']:.2f} diff {err:.1e}",
            flush=True,
        )
    return points


def variants_main(args, shipped: dict) -> None:
    """--variants: variant_points at every point; JSON train-variants-*.json."""
    result = {**environment(), "backward_constants": shipped, "points": []}
    path = result_path(args.out, "train-variants")
    for shape in args.shapes.split(","):
        k, n = map(int, shape.split("x"))
        for m in map(int, args.ms.split(",")):
            for pattern in args.patterns.split(","):
                for density in map(float, args.densities.split(",")):
                    variants = args.variants.split(";")
                    result["points"] += variant_points(k, n, m, density, pattern, variants, args.forward_pack, shipped)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="2048x5632,4096x14336")
    parser.add_argument("--ms", default="16384,32768")
    parser.add_argument("--densities", default="0.005,0.01")
    parser.add_argument("--patterns", default="uniform,skewed")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: interpreter check only)")
    parser.add_argument(
        "--host-profile", action="store_true", help="each point's twell compiled step under cProfile (host_profile)"
    )
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--entries", type=int, default=1, help="twell's LayerConfig.train_entries")
    parser.add_argument(
        "--backward-constant",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a variant: set an int constant of twell.kernels.backward (BACKUP_SHARE, DW_BLOCK_K, DW_WARPS, ...)",
    )
    parser.add_argument(
        "--variants",
        default=None,
        metavar="A;B",
        help="kernel times only, per variant: ';'-separated variants, each ','-separated NAME=INT settings of "
        "backward's constants (an empty variant: the shipped ones); variant_points",
    )
    parser.add_argument("--model", action="store_true", help="a whole model's training step (module docstring)")
    parser.add_argument("--layers", type=int, default=8, help="--model: decoder layers")
    parser.add_argument("--batch", type=int, default=16, help="--model: sequences a step")
    parser.add_argument("--seq", type=int, default=2048, help="--model: tokens a sequence")
    parser.add_argument("--rows", default=",".join(MODEL_ROWS), help="--model: which rows")
    parser.add_argument("--steps", type=int, default=10, help="--model: timed steps a row")
    parser.add_argument("--warmup", type=int, default=3, help="--model: untimed steps a row")
    parser.add_argument("--profile", action="store_true", help="--model: kernel table and Dynamo counters a row")
    parser.add_argument("--fresh-ids", action="store_true", help="--model: train on other sequences than calibrated")
    parser.add_argument(
        "--dense-above",
        type=lambda v: None if v == "none" else float(v),
        default=policy.TRAIN_DENSE_ABOVE,
        help="twell's LayerConfig.train_dense_above (default: the shipped value; none: every call sparse; 0: "
        "every call after the first dense)",
    )
    parser.add_argument(
        "--hot",
        type=int,
        default=None,
        help="twell's LayerConfig.train_hot for every layer (a variant; default: --model calibration's choice per "
        "layer, a layer alone the shipped default)",
    )
    parser.add_argument(
        "--forward-pack",
        action=argparse.BooleanOptionalAction,
        default=policy.TRAIN_FORWARD_PACK,
        help="twell's LayerConfig.train_forward_pack: the forward through the prefill kernels (default: the "
        "shipped value; --no-forward-pack: the row kernel's forward, a variant)",
    )
    args = parser.parse_args()
    if SMOKE_WITHOUT_CUDA:
        smoke_without_cuda()
        return
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/train.py times on a CUDA GPU; without one, run it with --smoke")
    constants = set_backward_constants(args.backward_constant)
    if args.variants is not None:
        variants_main(args, constants)
        return
    if args.model:
        model_main(args, constants)
        return
    if args.smoke:
        args.shapes, args.ms, args.densities, args.patterns = "256x704", "4096", "0.01", "skewed"
    torch.backends.cuda.matmul.allow_tf32 = False
    compiled = torch.compile(dense_loss, dynamic=True)
    # the layer's settings bound as constants: dynamic=True would trace an int argument as a symbol
    args.hot = policy.TRAIN_HOT if args.hot is None else args.hot  # a layer alone is not calibrated
    settings = {"entries": args.entries, "dense_above": args.dense_above, "hot": args.hot}
    settings["forward_pack"] = args.forward_pack
    twell_compiled = torch.compile(functools.partial(twell_loss, **settings), dynamic=True)
    result = {**environment(), "ceilings": ceilings(), "lam": LAM, "backward_constants": constants, "points": []}
    print(json.dumps(result["ceilings"]), flush=True)
    path = result_path(args.out, "train-smoke" if args.smoke else "train")
    columns = "K N M dens pat nnz max bkup dense twell x twc xc memx err gemm fl fwd fl dx fl dW fl sort other oth_c"
    header = " ".join(f"{c:>6}" for c in columns.split())
    lines = [header]
    print(header, flush=True)
    for shape in args.shapes.split(","):
        k, n = map(int, shape.split("x"))
        for m in map(int, args.ms.split(",")):
            for pattern in args.patterns.split(","):
                for density in map(float, args.densities.split(",")):
                    row = bench_point(
                        k,
                        n,
                        m,
                        density,
                        pattern,
                        compiled,
                        twell_compiled,
                        result["ceilings"]["gemm_tflop_s"],
                        args.entries,
                        args.dense_above,
                        args.hot,
                        args.forward_pack,
                        args.host_profile,
                    )
                    torch.cuda.empty_cache()
                    result["points"].append(row)
                    path.write_text(json.dumps(result, indent=1))  # kept if a later point fails
                    err = max(v for name, v in row.items() if name.endswith("_err"))
                    line = (
                        f"{k:>6} {n:>6} {m:>6} {density:>6.3f} {pattern:>6} {row['nnz_mean']:>6.1f} "
                        f"{row['nnz_max']:>6} {row['backup_rows']:>6} "
                        f"{min(row['dense_eager_ms'], row['dense_compiled_ms']):>6.2f} {row['twell_ms']:>6.2f} "
                        f"{row['speedup']:>6.2f} {row['twell_compiled_ms']:>6.2f} {row['speedup_compiled']:>6.2f} "
                        f"{row['memory_ratio']:>6.2f} {err:>6.0e} "
                        + " ".join(
                            f"{row[f'{s}_ms']:>6.2f} {row[f'{s}_floor_ms']:>6.2f}"
                            for s in ("gemm", "fwd_sparse", "dx", "dw")
                        )
                        + f" {row['sort_ms']:>6.2f} {row['other_ms']:>6.2f} {row['compiled_other_ms']:>6.2f}"
                    )
                    lines.append(line)
                    print(line, flush=True)
    path.write_text(json.dumps(result, indent=1))
    print("\n".join(lines))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
