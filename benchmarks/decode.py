"""Whole-model decode: a Llama-style ReLU model's greedy generation, dense against twell.sparsify.

Run on a GPU:  PYTHONPATH=. python benchmarks/decode.py [--layers 4] [--batches 1,16] [--new-tokens 64]

Model: hidden 2048, intermediate 5632 (the FFN shape of benchmarks/ffn.py), 16 heads, random bf16
weights. Each layer's gate bias is set from that layer's own inputs (the layers below it already biased)
so that every neuron fires on `density` of the tokens: uniform neuron rates, with whatever row spread the
model's activations give. The inputs are the measured prompts and their greedy continuation
(set_generation_biases; biases set on other random sequences fire ~2.5x as often on these).
Per batch size and loop: greedy decoding with a static cache through benchmarks/generation.py, dense
first, then the same model after twell.sparsify. Loops: "graph", the decode step replayed as a CUDA
graph (what serving runs; no host launch overhead), and "eager", the same loop without the graph
(each FFN call's host launch overhead is part of the time: twell's ~0.2 ms per call dominates there).
Timed: the whole generation (the prompt's forward and every decode step), median of --repeats runs
after one warm-up run (compilation, autotuning, graph capture). tokens/s = batch * new tokens / time.
The generated tokens of both are compared (random weights make near-ties in the logits likely, so a
late divergence is reported, not hidden). JSON to benchmarks/results/ (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import transformers

sys.path.insert(0, os.path.dirname(__file__))
from ffn import environment, result_path  # noqa: E402
from generation import GreedyDecoder  # noqa: E402

import twell  # noqa: E402


def llama(device="cuda", dtype=torch.bfloat16, seed=0, **config) -> transformers.LlamaForCausalLM:
    """A random-weight Llama-style causal LM with ReLU gates and gate biases (`config`: LlamaConfig fields)."""
    config = transformers.LlamaConfig(hidden_act="relu", mlp_bias=True, eos_token_id=None, **config)
    torch.manual_seed(seed)
    with torch.device(device):  # initialised where it runs: seconds, not minutes, at billions of parameters
        model = transformers.LlamaForCausalLM(config)
    return model.to(dtype).eval()


@torch.no_grad()
def set_gate_biases(model, rates, ids) -> list[dict]:
    """Set every layer's gate bias from that layer's own inputs, so that neuron n of layer l fires on
    rates[l][n] of the tokens `ids` [batch, seq]; rate 0 gives a dead neuron.

    One forward, bottom up: a hook before each FFN sets its bias from its input, so each layer sees
    inputs already shaped by the biases below it. Returns per layer, measured on those tokens: density,
    dead fraction, active neurons per row (mean, p99, max).
    """
    stats = []

    def set_bias(mlp, args, rates):
        x = args[0].reshape(-1, args[0].shape[-1])
        pre = F.linear(x, mlp.gate_proj.weight).float()  # [T, N]
        ordered = pre.sort(dim=0).values
        tokens = pre.shape[0]
        fire = (rates.to(pre.device) * tokens).round().long().clamp(0, tokens - 1)  # tokens each neuron fires on
        threshold = ordered.gather(0, (tokens - 1 - fire).unsqueeze(0)).squeeze(0)
        span = ordered[-1] - ordered[0]
        threshold = torch.where(fire == 0, ordered[-1] + span, threshold)  # dead: above anything seen
        mlp.gate_proj.bias.copy_(-threshold)
        active = (pre + mlp.gate_proj.bias.float() > 0).sum(1).float()
        stats.append(
            {
                "density": active.mean().item() / pre.shape[1],
                "dead_fraction": (fire == 0).float().mean().item(),
                "nnz_mean": active.mean().item(),
                "nnz_p99": active.quantile(0.99).item(),
                "nnz_max": active.max().item(),
            }
        )

    layers = model.model.layers
    hooks = [
        layer.mlp.register_forward_pre_hook(lambda mod, args, r=layer_rates: set_bias(mod, args, r))
        for layer, layer_rates in zip(layers, rates, strict=True)
    ]
    try:
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
    finally:
        for hook in hooks:
            hook.remove()
    return stats


@torch.no_grad()
def set_generation_biases(model, rates, runs, new_tokens: int) -> list[dict]:
    """set_gate_biases on generated sequences themselves: each (decoder, prompt [b, P]) of `runs` generates
    `new_tokens` greedy tokens under the model's current biases, and the biases are then set on every
    prompt with its continuation, so that decode calls fire at `rates` (biases set on other random
    sequences fire a random-weight model's neurons ~2.5x as often: attention averages a sequence's
    tokens, which then share components). Returns set_gate_biases's stats on those tokens."""
    sequences = torch.cat([torch.cat([prompt, decoder.generate(prompt, new_tokens)], 1) for decoder, prompt in runs])
    return set_gate_biases(model, rates, sequences)


def build(layers: int, density: float, calib_tokens: int = 4096):
    model = llama(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=4096,
    )
    ids = torch.randint(0, 32000, (calib_tokens // 256, 256), device="cuda")
    set_gate_biases(model, [torch.full((5632,), density)] * layers, ids)
    return model


def timed_generation(model, prompt, new_tokens, repeats, graph):
    decoder = GreedyDecoder(model, prompt.shape[0], prompt.shape[1] + new_tokens, graph=graph)
    out = decoder.generate(prompt, new_tokens)  # warm-up: compilation, autotuning, graph capture
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        decoder.generate(prompt, new_tokens)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return out, statistics.median(times)


def first_divergence(tokens, ref) -> int | None:
    """The first decode step at which any sequence's token differs, None if none does."""
    same = (tokens == ref).all(0)
    return None if same.all() else int((~same).nonzero()[0])


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
    result = {**environment(transformers=transformers.__version__), "args": vars(args), "rows": []}
    prompts = {b: torch.randint(0, 32000, (b, args.prompt), device="cuda") for b in map(int, args.batches.split(","))}
    runs = [(GreedyDecoder(model, b, args.prompt + args.new_tokens, graph=False), p) for b, p in prompts.items()]
    rates = [torch.full((5632,), args.density)] * args.layers
    result["generation_layers"] = set_generation_biases(model, rates, runs, args.new_tokens)
    loops = {"graph": True, "eager": False}
    dense = {
        (b, loop): timed_generation(model, p, args.new_tokens, args.repeats, graph)
        for b, p in prompts.items()
        for loop, graph in loops.items()
    }
    twell.sparsify(model)
    print(twell.report(model).summary(), flush=True)
    for (b, loop), (ref, dense_s) in dense.items():
        tokens, seconds = timed_generation(model, prompts[b], args.new_tokens, args.repeats, loops[loop])
        diverged = first_divergence(tokens, ref)
        row = {
            "batch": b,
            "loop": loop,
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
            f"batch {b:>3}, {loop:>5} loop: dense {row['dense_tok_s']:8.1f} tok/s, twell {row['twell_tok_s']:8.1f} "
            f"tok/s ({row['speedup']:.2f}x); same tokens: {row['same_tokens']} (first divergence: {diverged})",
            flush=True,
        )
    path = result_path(args.out, "decode")
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
