"""Whole-model decode: a Llama-style ReLU model's greedy generation, dense against twell.sparsify.

Run on a GPU:  PYTHONPATH=. python benchmarks/decode.py [--layers 4] [--batches 1,16] [--new-tokens 64]

Model: hidden 2048, intermediate 5632 (the FFN shape of benchmarks/ffn.py), 16 heads, random bf16
weights. Each layer's gate bias is set from that layer's own inputs (random prompts through the layers
below it, already biased) so that every neuron fires on `density` of the tokens: uniform neuron
rates, with whatever row spread the model's activations give.
Per batch size: greedy `generate()` with a static cache, eager (transformers 5.17 did not compile the
step itself, and compiling the forward with mode="reduce-overhead" under generate() failed: its CUDA
graphs' outputs are overwritten by the next step), dense first, then the same model after
twell.sparsify; each timed as the median of --repeats runs after one warm-up run. Eager, each FFN
call's host launch overhead is part of the time. tokens/s = batch * new tokens / time. The generated
tokens of both are compared (random weights make near-ties in the logits likely, so a late
divergence is reported, not hidden). JSON to benchmarks/results/ (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

sys.path.insert(0, os.path.dirname(__file__))
from ffn import git_commit  # noqa: E402

import twell  # noqa: E402


def build(layers: int, density: float, seed: int = 0, calib_tokens: int = 4096):
    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        hidden_act="relu",
        mlp_bias=True,
        max_position_embeddings=4096,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, config.vocab_size, (calib_tokens // 256, 256), device="cuda")
    keep = round((1 - density) * calib_tokens)
    for layer in model.model.layers:  # bottom up: a layer's inputs depend on the biases below it
        seen = []
        hook = layer.mlp.register_forward_pre_hook(lambda mod, args, seen=seen: seen.append(args[0].detach()))
        with torch.no_grad():
            model(ids)
        hook.remove()
        pre = F.linear(seen[0].reshape(-1, config.hidden_size), layer.mlp.gate_proj.weight).float()
        with torch.no_grad():
            layer.mlp.gate_proj.bias.copy_(-pre.kthvalue(keep, dim=0).values)
    return model


def timed_generate(model, prompt, new_tokens, repeats):
    def run():
        return model.generate(
            prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
            cache_implementation="static", pad_token_id=0,
        )  # fmt: skip

    with torch.no_grad():
        out = run()  # warm-up: compilation, graph capture, autotuning
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            run()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    return out[:, prompt.shape[1] :], statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--density", type=float, default=0.005)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    model = build(args.layers, args.density)
    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "commit": git_commit(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "args": vars(args),
        "rows": [],
    }
    prompts = {b: torch.randint(0, 32000, (b, args.prompt), device="cuda") for b in map(int, args.batches.split(","))}
    dense = {b: timed_generate(model, p, args.new_tokens, args.repeats) for b, p in prompts.items()}
    twell.sparsify(model)
    print(twell.report(model).summary(), flush=True)
    for b, prompt in prompts.items():
        tokens, seconds = timed_generate(model, prompt, args.new_tokens, args.repeats)
        ref, dense_s = dense[b]
        same = (tokens == ref).all(0)
        diverged = int((~same).nonzero()[0]) if not same.all() else None
        row = {
            "batch": b,
            "dense_s": dense_s,
            "twell_s": seconds,
            "dense_tok_s": b * args.new_tokens / dense_s,
            "twell_tok_s": b * args.new_tokens / seconds,
            "speedup": dense_s / seconds,
            "same_tokens": diverged is None,
            "first_divergent_step": diverged,
        }
        result["rows"].append(row)
        print(
            f"batch {b:>3}: dense {row['dense_tok_s']:8.1f} tok/s, twell {row['twell_tok_s']:8.1f} tok/s "
            f"({row['speedup']:.2f}x); same tokens: {row['same_tokens']} (first divergence: {diverged})",
            flush=True,
        )
    out_dir = Path(os.environ["OUT"]) if "OUT" in os.environ else Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"decode-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
