"""Where a whole model spends its GPU time: dense against twell.sparsify'd, by kernel.

The model benchmark (e2e.py) measures the sparsified 2B model against dense, but not where the
difference goes. This script takes the same model and sparsity profile (e2e.py's 2B shape, skewed
profile) and writes, under torch.profiler, the CUDA time, the number of kernels, and the kernels
grouped by name (count and time per call), dense and twell:
- `decode` (default): eager decode steps (not captured: the profiler sees each kernel) at batch 1 and 16;
- `prefill`: the compiled prefill forward (e2e.py's twell-compiled and dense-compiled rows, --layers of
  the 2B shape, --batch x --seq tokens), with each forward's median time by CUDA events and its host
  time (from an idle GPU to the call's return): e2e.py's prefill saved 0.74 ms a layer where the FFN
  alone saves 1.2 ms at 32768 tokens (e2e-20261202-221810.json, ffn-20261202-221123.json).

    cd benchmarks && PYTHONPATH=.. python step_profile.py [decode|prefill]   # CUDA only; JSON to results/
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from decode import llama, set_gate_biases, set_generation_biases  # noqa: E402
from e2e import CALIB_TOKENS, ROW_SPREAD, SHAPES, profile_rates, share_gate_direction  # noqa: E402
from ffn import environment, result_path  # noqa: E402
from generation import GreedyDecoder  # noqa: E402

import twell  # noqa: E402
from twell.kernels import dispatch  # noqa: E402

STEPS = 5


@torch.no_grad()
def step_kernels(decoder: GreedyDecoder, prompt: torch.Tensor) -> dict:
    """Per decode step (mean of STEPS eager steps after the prompt): CUDA us, kernel count, per kernel name."""
    decoder._prefill(prompt)
    for _ in range(2):
        decoder._step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            decoder._step()
        torch.cuda.synchronize()
    table = kernel_table(prof, STEPS)
    return {"cuda_us": table["cuda_us"], "kernels_per_step": table["kernels_per_call"], "kernels": table["kernels"]}


def kernel_table(prof, calls: int) -> dict:
    """Per kernel name (80 characters): count and us per call, largest first, and their totals."""
    kernels = {}
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if us and event.count:
            kernels[event.key[:80]] = {"count": event.count / calls, "us": us / calls}
    kernels = dict(sorted(kernels.items(), key=lambda kv: -kv[1]["us"]))
    return {
        "cuda_us": sum(k["us"] for k in kernels.values()),
        "kernels_per_call": sum(k["count"] for k in kernels.values()),
        "kernels": kernels,
    }


@torch.no_grad()
def prefill_kernels(forward, ids, calls: int = 3) -> dict:
    """A compiled prefill forward: median ms (CUDA events, 10 calls), host ms (from an idle GPU to
    the call's return, median of 5), and the kernels of `calls` calls under torch.profiler."""

    def call():
        return forward(input_ids=ids, use_cache=False, logits_to_keep=1).logits

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    times, hosts = [], []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    for _ in range(5):
        torch.cuda.synchronize()
        began = time.perf_counter()
        call()
        hosts.append((time.perf_counter() - began) * 1e3)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    return {"ms": statistics.median(times), "host_ms": statistics.median(hosts)} | kernel_table(prof, calls)


def layer_state(mlp) -> dict:
    """The dispatcher's state of a sparsified FFN's prefill calls (every token bucket it saw)."""
    weight = mlp.gate_proj.weight
    states = dispatch._layers.get(id(weight), {})
    return {
        str(key[2]): {
            "density": state.density,
            "dense_calls_left": state.dense_calls_left,
            "hot": None if state.hot is None else len(state.hot.index),
        }
        for key, state in states.items()
    }


def prefill_main(args):
    shape = SHAPES["2b"] | {"num_hidden_layers": args.layers}
    model = llama("cuda", torch.bfloat16, max_position_embeddings=args.seq, **shape)
    g = torch.Generator().manual_seed(2)
    share_gate_direction(model, ROW_SPREAD, g)
    rates = profile_rates("skewed", shape["num_hidden_layers"], shape["intermediate_size"], g, None)
    ids = torch.randint(0, shape["vocab_size"], (args.batch, args.seq), generator=g).cuda()
    set_gate_biases(model, rates, ids)  # on the measured sequences, as e2e.py's prefill points
    result = environment() | {"part": "prefill", "model": "2b", "profile": "skewed", "config": shape}
    result |= {"batch": args.batch, "seq": args.seq, "rows": []}
    path = result_path(os.path.join(os.path.dirname(__file__), "results"), "step_profile")
    for row in ("dense-compiled", "twell-compiled"):
        if row == "twell-compiled":
            twell.sparsify(model)
        torch._dynamo.reset()
        point = prefill_kernels(torch.compile(model), ids)
        if row == "twell-compiled":  # what each layer's prefill calls measured, and whether they now run dense
            point["layers"] = [layer_state(layer.mlp) for layer in model.model.layers]
        top = ", ".join(
            f"{name[:40]} x{k['count']:.0f} {k['us']:.0f}us" for name, k in list(point["kernels"].items())[:10]
        )
        print(f"{row}: {point['ms']:.2f} ms (host {point['host_ms']:.2f}), {point['cuda_us']:.0f} us of kernels; {top}")
        result["rows"].append({"row": row} | point)
        path.write_text(json.dumps(result, indent=1))
    print(path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("part", nargs="?", default="decode", choices=["decode", "prefill"])
    parser.add_argument("--layers", type=int, default=12, help="prefill: layers of the 2B shape")
    parser.add_argument("--batch", type=int, default=16, help="prefill: sequences a forward")
    parser.add_argument("--seq", type=int, default=2048, help="prefill: tokens a sequence")
    args = parser.parse_args()
    if args.part == "prefill":
        return prefill_main(args)
    shape = SHAPES["2b"]
    model = llama("cuda", torch.bfloat16, max_position_embeddings=2048, **shape)
    g = torch.Generator().manual_seed(2)
    share_gate_direction(model, ROW_SPREAD, g)
    calib = torch.randint(0, shape["vocab_size"], (CALIB_TOKENS // 256, 256), generator=g).cuda()
    rates = profile_rates("skewed", shape["num_hidden_layers"], shape["intermediate_size"], g, None)
    set_gate_biases(model, rates, calib)
    prompts = {batch: torch.randint(0, shape["vocab_size"], (batch, 16), generator=g).cuda() for batch in (1, 16)}
    # the decode steps' density as the profile's: biases set on the profiled prompts and their continuation
    runs = [(GreedyDecoder(model, batch, 80, graph=False), prompt) for batch, prompt in prompts.items()]
    layers = set_generation_biases(model, rates, runs, 2 + STEPS)
    result = environment() | {"model": "2b", "profile": "skewed", "steps": STEPS, "rows": []}
    result["generation_density"] = statistics.mean(s["density"] for s in layers)
    path = result_path(os.path.join(os.path.dirname(__file__), "results"), "step_profile")
    for row in ("dense", "twell"):
        if row == "twell":
            twell.sparsify(model)
            result["report"] = twell.report(model).summary()
        for batch, prompt in prompts.items():
            decoder = GreedyDecoder(model, batch, 80, graph=False)
            step = step_kernels(decoder, prompt)
            top = list(step["kernels"].items())[:8]
            top = ", ".join(f"{name[:40]} x{k['count']:.0f} {k['us']:.0f}us" for name, k in top)
            print(f"{row} b{batch}: {step['cuda_us']:.0f} us, {step['kernels_per_step']:.0f} kernels; {top}")
            result["rows"].append({"row": row, "batch": batch} | step)
            path.write_text(json.dumps(result, indent=1))
    print(path)


if __name__ == "__main__":
    main()
