"""Where one decode step of a whole model spends its GPU time: dense against twell.sparsify'd, eager.

The model benchmark (e2e.py) measured the sparsified 2B model's generation at batch 1 no faster than
dense although its decode FFN kernels run 2.3x alone. This script takes the same model and sparsity
profile (e2e.py's 2B shape, skewed profile), runs eager decode steps (not captured: the profiler sees
each kernel) under torch.profiler and writes per step: the CUDA time, the number of kernels, and the
kernels grouped by name (count and time per step), dense and twell, at batch 1 and 16.

    cd benchmarks && PYTHONPATH=.. python step_profile.py     # CUDA only; JSON to results/
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from decode import llama, set_gate_biases  # noqa: E402
from e2e import CALIB_TOKENS, ROW_SPREAD, SHAPES, profile_rates, share_gate_direction  # noqa: E402
from ffn import environment, result_path  # noqa: E402
from generation import GreedyDecoder  # noqa: E402

import twell  # noqa: E402

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
    kernels = {}
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if us and event.count:
            kernels[event.key[:80]] = {"count": event.count / STEPS, "us": us / STEPS}
    kernels = dict(sorted(kernels.items(), key=lambda kv: -kv[1]["us"]))
    return {
        "cuda_us": sum(k["us"] for k in kernels.values()),
        "kernels_per_step": sum(k["count"] for k in kernels.values()),
        "kernels": kernels,
    }


def main():
    shape = SHAPES["2b"]
    model = llama("cuda", torch.bfloat16, max_position_embeddings=2048, **shape)
    g = torch.Generator().manual_seed(2)
    share_gate_direction(model, ROW_SPREAD, g)
    calib = torch.randint(0, shape["vocab_size"], (CALIB_TOKENS // 256, 256), generator=g).cuda()
    rates = profile_rates("skewed", shape["num_hidden_layers"], shape["intermediate_size"], g, None)
    set_gate_biases(model, rates, calib)
    result = environment() | {"model": "2b", "profile": "skewed", "steps": STEPS, "rows": []}
    path = result_path(os.path.join(os.path.dirname(__file__), "results"), "step_profile")
    for row in ("dense", "twell"):
        if row == "twell":
            twell.sparsify(model)
            result["report"] = twell.report(model).summary()
        for batch in (1, 16):
            prompt = torch.randint(0, shape["vocab_size"], (batch, 16), generator=g).cuda()
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
