"""End-to-end model benchmark: Llama-style ReLU models, dense against twell, prefill and generation.

Run on a GPU:  PYTHONPATH=. python benchmarks/e2e.py [--models 2b,8b] [--rows ...] [--layers 2b=8]
Check on a CPU: PYTHONPATH=. python benchmarks/e2e.py --smoke   (tiny models, eager rows; JSON to /tmp)

Models (bf16, random weights, ReLU gates with biases, SDPA attention): "2b", the paper's 2B shape
(hidden 2048, intermediate 5632, 38 layers, 32 heads, vocabulary 49152); "8b", an 8B-like shape (4096 /
14336, 32 heads, 8 KV heads, vocabulary 128256) with 4 of its layers, so its times are also given per layer.

Sparsity profiles, set through the gate biases from each layer's own inputs (benchmarks/decode.py's
set_gate_biases) on the measured tokens themselves (the prefill points on the first point's sequences,
generation on every batch's prompts and greedy continuation; other random sequences fire a random-weight
model's neurons ~2.5x as often), on gate weights that share one random direction with weight 0.3
per layer, so that tokens far along it fire many neurons: heavy-tailed active neurons per row (on
Gaussian inputs at the 2B shape and the skewed profile, p99 3.9x and max 13x the mean, against 1.5x and
2x with independent neurons; what the model's own tokens give is in the JSON):
- "skewed": 0.5% mean density; 30% dead neurons, the others log-normal rates (sigma 1.5)
  (benchmarks/ffn.py's skewed_rates);
- "demo": the per-neuron rate distribution twell's calibration measures on the trained demo model
  (twell/demo) over Python source (twell's own, byte-level: the same text on every machine): each layer
  takes the rate quantiles of the demo layer at the same relative depth, scaled to that layer's
  measured density (0.2% to 1.4% per layer).
What each layer then fires on the tokens its biases were set on is in the JSON (profiles.*.layers on
8192 random tokens, .prefill_layers, .generation_layers).

Rows (--rows): "dense-eager"; "dense-compiled" (torch.compile(model)); "twell-eager" (twell.sparsify(
model): every FFN rewritten, no calibration); "twell-compiled" (torch.compile(twell.sparsify(model)): the
backend="twell" alone leaves the down weights in the layout that sends the ops to their dense route,
0.98x of dense compiled in e2e-20261130-234915.json); "twell-calibrated-compiled" /
"twell-calibrated-eager": twell.sparsify(model, prompts) first calibrates on the benchmark's own
generation prompts (every --batches prompt; calibration's default greedy decode steps measure the decode
density, --cost-model its cost model), as a user's twell.calibrate or the CLI would, so each layer's
LayerConfig comes from its calibrated density and K (calls of up to 16 or 32 tokens on the decode kernels
where the measured table says they win, policy.calibrated_decode_max_m); the JSON's "calibration" holds
every layer's LayerConfig and, per batch, how many layers' decode calls take which route. Compiled once
per row (the twell rows once per profile): the prefill points share one dynamic-shape graph, generation
one graph per batch size.
Dense times do not depend on the profile (the same kernels on other values): the dense rows run once, on
the first profile. Speedups are against the faster dense row at each point.

Timed, per model, profile and row (each call a CUDA-event pair, synchronised after each; median of
at least 3 calls and at least --min-time seconds, after untimed calls whose seconds, compilation,
autotuning and graph capture included, are recorded as warmup_s: --warmup per prefill point, one per
generation):
- prefill: one forward of [batch, seq] random tokens, no KV cache, logits of the last position only
  (as a serving prefill); seq in --seqs, batch = tokens / seq for tokens in --tokens (--seqs '': no
  prefill points, generation only; the logits check then has no point either). Each point
  records its layer count: all of them by default (the 2B's 131072-token points take about 1 s and
  under 20 GB per forward by FLOP and byte counts); --layers reduces a model's layers.
- generation: benchmarks/generation.py's greedy loop (static cache, the decode step replayed as a
  CUDA graph), a --prompt token prompt + --new-tokens tokens, at each of --batches. The prompt's
  forward runs the row's model eagerly (compiling it too would cost two more compilations per row):
  in the twell rows the sparsified model, whose FFN calls pay the op's eager host path (a prompt
  forward of 16-1024 tokens is host-bound: 10-24 ms for 12 layers between runs), the decode steps the
  row's forward; with --compiled-prompt the compiled rows run the prompt through their compiled forward
  too (a variant; tables.py keeps its whole-generation points apart). tokens_per_s = batch
  * new tokens / time of the whole generation, prompt included; each timed call also stamps the stream once
  the prompt's forward and greedy token are issued, which splits it: prompt_ms (the median time up to
  the stamp) and the decode steps' (after it, the same calls: one run's host drift and the prompt's
  eager jitter do not leak into it): decode_ms_per_step (the new tokens after the first, each one
  graph replay) and decode_tokens_per_s = batch / decode_ms_per_step, what a served model's
  steps give (decode_speedup, against the faster dense row's).
- with --step-kernels, per generation point, one decode step's kernels (count, per name: count and us),
  the row's forward run uncaptured under torch.profiler (benchmarks/step_profile.py's step_kernels).
- peak memory (torch.cuda.max_memory_allocated over the timed calls, weights included) and energy
  per token (NVML's total-energy counter around the timed calls / tokens; null without NVML).
- prefill time breakdown, eager rows: CUDA events recorded by hooks around every layer's attention and
  FFN module during the timed calls themselves: attention (projections, RoPE, SDPA), FFN, and the rest
  (norms, residual adds, embedding, head). Recording an event costs microseconds of host time while a
  prefill forward keeps the GPU busy for tens to thousands of milliseconds with the host far ahead,
  so the events do not move the measured times; torch.profiler's tracing would. Compiled rows have no
  breakdown (hooks inside a compiled graph would break it).
Correctness, against dense eager on the same profile: relative error of the first prefill point's
last-position logits, and the first decode step at which any generated token differs (random weights
make near-ties likely: a late divergence is expected, an early one is a bug).
JSON to benchmarks/results/e2e-<timestamp>.json (or --out), written after every row; a table last.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import transformers

sys.path.insert(0, os.path.dirname(__file__))
from decode import first_divergence, llama, set_gate_biases, set_generation_biases  # noqa: E402
from ffn import environment, parse_variants, result_path, skewed_rates  # noqa: E402
from generation import GreedyDecoder  # noqa: E402

import twell  # noqa: E402
from twell.kernels import dispatch, policy  # noqa: E402

SHAPES = {
    "2b": dict(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=38,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=49152,
    ),
    "8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=4,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
}
SMOKE_SHAPES = {
    "2b": dict(
        hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=256,
    ),
    "8b": dict(
        hidden_size=64, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=512,
    ),
}  # fmt: skip
# run order: compiled rows need a dense model
ROWS = (
    "dense-eager", "dense-compiled", "twell-compiled", "twell-calibrated-compiled", "twell-eager",
    "twell-calibrated-eager",
)  # fmt: skip
TWELL_COMPILED = ("twell-compiled", "twell-calibrated-compiled")
# rows whose sparsify calibrates on the benchmark's own generation prompts first (twell.sparsify(model,
# prompts): the layers' decisions and LayerConfigs from what they measured, as a user's calibration gives)
CALIBRATED = ("twell-calibrated-compiled", "twell-calibrated-eager")
DENSITY = 0.005
ROW_SPREAD = 0.3  # weight of the gate direction all neurons of a layer share
CALIB_TOKENS = 8192


# ---------------------------------------------------------------------------------------------------
# Sparsity profiles


@torch.no_grad()
def share_gate_direction(model, weight: float, generator) -> None:
    """w_n <- sqrt(1 - weight^2) w_n + weight |w_n| d for one random unit d per layer: the neurons'
    pre-activations share the component along d, so the rows far along d fire many neurons."""
    for layer in model.model.layers:
        w = layer.mlp.gate_proj.weight
        d = torch.randn(w.shape[1], generator=generator).to(w.device, torch.float32)
        d /= d.norm()
        mixed = math.sqrt(1 - weight**2) * w.float() + weight * w.float().norm(dim=1, keepdim=True) * d
        w.copy_(mixed)


def demo_profile(windows: int) -> dict:
    """Per layer of the demo model: density and firing-rate quantiles, measured by twell.calibrate on
    `windows` windows of 128 bytes of twell's own source."""
    from twell.loading import load_model, read_texts, tokenize
    from twell.passes import find_ffns

    loaded = load_model(None)
    package = Path(twell.__file__).parent
    files = sorted(package.rglob("*.py"))
    stream = tokenize([text for f in files for text in read_texts(f)], None, loaded.vocab_size)
    ids = torch.tensor(stream[: windows * 128]).view(-1, 128)
    config = {"cost_model": "analytic", "decode_steps": 0, "timing_repeats": 0, "progress": False}
    decisions = twell.calibrate(loaded.model, find_ffns(loaded.model), list(ids.split(16)), config=config)
    layers = [{"density": d.density, "neuron_rates": d.stats["prefill"]["neuron_rates"]} for d in decisions.values()]
    return {"text": f"twell/**/*.py, the first {ids.numel()} bytes", "layers": layers}


def rates_from_quantiles(quantiles: dict, density: float, n: int, generator) -> torch.Tensor:
    """n rates following the quantile function (linear between the given quantiles), in random
    neuron order, scaled to mean `density`."""
    qs = torch.tensor([float(q) for q in quantiles])
    values = torch.tensor(list(quantiles.values()))
    at = (torch.arange(n) + 0.5) / n
    upper = torch.searchsorted(qs, at).clamp(1, len(qs) - 1)
    frac = (at - qs[upper - 1]) / (qs[upper] - qs[upper - 1])
    rates = values[upper - 1] + frac * (values[upper] - values[upper - 1])
    rates = rates[torch.randperm(n, generator=generator)]
    return (rates * density / rates.mean()).clamp(max=1.0)


def profile_rates(profile: str, layers: int, n: int, generator, demo: dict | None) -> list[torch.Tensor]:
    if profile == "skewed":
        return [skewed_rates(n, DENSITY, generator) for _ in range(layers)]
    demo_layers = demo["layers"]
    picked = [demo_layers[i * len(demo_layers) // layers] for i in range(layers)]
    return [rates_from_quantiles(d["neuron_rates"], d["density"], n, generator) for d in picked]


def gate_biases(model) -> list[torch.Tensor]:
    return [layer.mlp.gate_proj.bias.detach().clone() for layer in model.model.layers]


@torch.no_grad()
def load_gate_biases(model, biases) -> None:
    for layer, bias in zip(model.model.layers, biases, strict=True):
        layer.mlp.gate_proj.bias.copy_(bias)


# ---------------------------------------------------------------------------------------------------
# Measurement


class Meter:
    """Times calls (CUDA events per call, or the host clock on a CPU); NVML energy; peak memory."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.nvml = None
        if cuda:
            try:
                import pynvml

                pynvml.nvmlInit()
                handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
                pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)  # raises where the GPU does not report it
                self.nvml = (pynvml, handle)
            except Exception as e:  # no pynvml, no NVML, or no energy counter: energy stays null
                print(f"no NVML energy counter ({type(e).__name__}: {e}): energy is recorded as null")

    def stamp(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def elapsed_ms(self, start, end) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def energy_mj(self) -> float | None:
        if self.nvml is None:
            return None
        pynvml, handle = self.nvml
        return float(pynvml.nvmlDeviceGetTotalEnergyConsumption(handle))

    @torch.no_grad()
    def measure(self, fn, *, units: int, warmup: int, min_time: float, breakdown=None, split=None) -> dict:
        """Median ms of fn(); energy per unit (token) over the timed calls; peak GB; the breakdown's
        medians (a Breakdown, collected per call); split: a list each call of fn appends one stamp to
        (self.stamp()), giving the medians of each timed call's time before it and after it (split_ms:
        [before, after])."""
        start = time.perf_counter()
        for _ in range(warmup):
            fn()
            self.sync()
            if breakdown is not None:
                breakdown.take()
        warmup_s = time.perf_counter() - start
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        times, parts, tails = [], [], []
        if split is not None:
            split.clear()
        energy_start = self.energy_mj()
        while len(times) < 3 or sum(times) < min_time * 1e3:
            begin = self.stamp()
            fn()
            end = self.stamp()
            self.sync()
            times.append(self.elapsed_ms(begin, end))
            if split is not None:
                tails.append(self.elapsed_ms(split.pop(), end))
            if breakdown is not None:
                parts.append(breakdown.take())
        energy_end = self.energy_mj()
        result = {
            "ms": statistics.median(times),
            "calls": len(times),
            "warmup_s": warmup_s,
            "peak_gb": torch.cuda.max_memory_allocated() / 2**30 if self.cuda else None,
            "energy_mj_per_token": None if energy_start is None else (energy_end - energy_start) / (len(times) * units),
        }
        if tails:
            result["split_ms"] = [
                statistics.median(t - a for t, a in zip(times, tails, strict=True)),
                statistics.median(tails),
            ]
        if parts:
            attention = statistics.median(p[0] for p in parts)
            ffn = statistics.median(p[1] for p in parts)
            rest = statistics.median(t - a - f for t, (a, f) in zip(times, parts, strict=True))
            result["breakdown_ms"] = {"attention": attention, "ffn": ffn, "rest": rest}
        return result


class Breakdown:
    """Hooks that stamp the start and end of every layer's attention and FFN module calls."""

    def __init__(self, model, meter: Meter):
        self.meter = meter
        self.spans = {"attention": [], "ffn": []}
        self.handles = []
        for layer in model.model.layers:
            for part, module in (("attention", layer.self_attn), ("ffn", layer.mlp)):
                opened = []
                self.handles.append(module.register_forward_pre_hook(lambda *_, o=opened: o.append(meter.stamp())))
                self.handles.append(
                    module.register_forward_hook(
                        lambda *_, o=opened, s=self.spans[part]: s.append((o.pop(), meter.stamp()))
                    )
                )

    def take(self) -> tuple[float, float]:
        """(attention ms, FFN ms) since the last take; call after a synchronisation."""
        totals = tuple(sum(self.meter.elapsed_ms(a, b) for a, b in self.spans[p]) for p in ("attention", "ffn"))
        for spans in self.spans.values():
            spans.clear()
        return totals

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


class Workload:
    """The inputs of one model's measurements, the same for every row."""

    def __init__(self, args, vocab: int, device: str):
        g = torch.Generator().manual_seed(1)
        self.prefill = []
        for seq in ints(args.seqs):
            for tokens in ints(args.tokens):
                ids = torch.randint(0, vocab, (tokens // seq, seq), generator=g).to(device)
                self.prefill.append({"seq": seq, "batch": tokens // seq, "tokens": tokens, "ids": ids})
        self.prompts = {
            b: torch.randint(0, vocab, (b, args.prompt), generator=g).to(device) for b in ints(args.batches)
        }
        self.new_tokens = args.new_tokens
        self.max_len = args.prompt + args.new_tokens


def ints(csv: str) -> list[int]:
    """The integers of a comma-separated flag ('' gives none)."""
    return [int(v) for v in csv.split(",") if v]


def prefill_call(forward, ids):
    return lambda: forward(input_ids=ids, use_cache=False, logits_to_keep=1).logits


def run_row(meter, model, forward, work: Workload, args, *, eager: bool, decoders, reference, biases) -> dict:
    """Every measurement of one row: prefill points, generation per batch, correctness; biases: the
    profile's gate biases for the prefill points and for generation (run_model)."""
    layers = model.config.num_hidden_layers
    row = {"prefill": [], "generation": []}
    breakdown = Breakdown(model, meter) if eager else None
    if work.prefill:
        load_gate_biases(model, biases["prefill"])
    try:
        for i, point in enumerate(work.prefill):
            if not eager:  # one dynamic-shape graph for every prefill point
                torch._dynamo.maybe_mark_dynamic(point["ids"], 0)
                torch._dynamo.maybe_mark_dynamic(point["ids"], 1)
            call = prefill_call(forward, point["ids"])
            m = meter.measure(
                call, units=point["tokens"], warmup=args.warmup, min_time=args.min_time, breakdown=breakdown
            )
            m.update({k: point[k] for k in ("seq", "batch", "tokens")}, layers=layers)
            m["tokens_per_s"] = point["tokens"] / m["ms"] * 1e3
            m["ms_per_layer"] = m["ms"] / layers
            row["prefill"].append(m)
            if i == 0:
                with torch.no_grad():
                    row["logits_rel_err"] = rel_err(call().float(), reference["logits"])
            print(f"  prefill {point['batch']:>3} x {point['seq']:>5}: {m['ms']:9.2f} ms", flush=True)
    finally:
        if breakdown is not None:
            breakdown.remove()
    load_gate_biases(model, biases["generation"])
    for b, prompt in work.prompts.items():
        decoder = decoders[b]
        m = measure_generation(meter, decoder, prompt, work.new_tokens, args.min_time)
        m["first_divergent_step"] = first_divergence(decoder.generate(prompt, work.new_tokens), reference["tokens"][b])
        if args.step_kernels and meter.cuda:  # after the timed calls: the profiler's set-up stays out of them
            from step_profile import step_kernels  # it imports this module

            m["step_kernels"] = step_kernels(decoder, prompt)
        row["generation"].append(m)
        decode = f", decode steps {m['decode_tokens_per_s']:9.1f}" if m["decode_tokens_per_s"] else ""
        print(
            f"  generation batch {b:>3}: {m['tokens_per_s']:9.1f} tok/s (prompt {m['prompt_ms']:.2f} ms{decode})",
            flush=True,
        )
    return row


def measure_generation(meter, decoder, prompt, new_tokens: int, min_time: float) -> dict:
    """The whole generation's median (warm-up: one call, the capture with it), and of the same calls the
    prompt's share (up to a stamp after its forward) and the decode steps' (from that stamp)."""
    b = prompt.shape[0]
    stamps = []
    m = meter.measure(
        lambda: decoder.generate(prompt, new_tokens, after_prompt=lambda: stamps.append(meter.stamp())),
        units=b * new_tokens, warmup=1, min_time=min_time, split=stamps,
    )  # fmt: skip
    m.update(batch=b, prompt=prompt.shape[1], new_tokens=new_tokens)
    m["tokens_per_s"] = b * new_tokens / m["ms"] * 1e3
    (m["prompt_ms"], decode_ms), m["prompt_calls"] = m.pop("split_ms"), m["calls"]
    steps = new_tokens - 1
    step_ms = decode_ms / steps if steps else None
    m["decode_ms_per_step"] = step_ms
    m["decode_tokens_per_s"] = b / step_ms * 1e3 if step_ms and step_ms > 0 else None
    return m


def chosen_configs(model, work: Workload) -> dict:
    """What calibration chose: each rewritten layer's LayerConfig fields ("layer_configs", by path), per
    generation batch how many layers route its decode calls where ("routes": the route from the
    LayerConfig alone, as before any prefill call has measured a density), and each layer's decision
    (reason, predicted speedups, density, decode_cap)."""
    configs = twell.layer_configs(model)
    width = model.config.hidden_size
    routes = {}
    for b in work.prompts:
        counts = collections.Counter(policy.route(b, width, c) for c in configs.values())
        routes[str(b)] = dict(sorted(counts.items()))
    decisions = {
        r.path: {key: r.decision.get(key) for key in ("reason", "predicted_speedup", "density", "decode_cap")}
        for r in twell.report(model)
        if r.decision
    }
    return {
        "rewritten": len(configs),
        "layer_configs": {path: dataclasses.asdict(c) for path, c in configs.items()},
        "routes": routes,
        "decisions": decisions,
    }


def make_decoders(model, work, cuda, forward=None, compiled_prompt=False) -> dict:
    """A decoder per generation batch; compiled_prompt: the prompt's forward through `forward` too."""
    prompt_forward = forward if compiled_prompt else None
    return {
        b: GreedyDecoder(model, b, work.max_len, forward=forward, graph=cuda, prompt_forward=prompt_forward)
        for b in work.prompts
    }


# ---------------------------------------------------------------------------------------------------
# Driver


def run_model(name, shape, args, meter, demo, cuda, save) -> dict:
    """Every row of one model; `save(result)` is called after each row with the results so far."""
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    model = llama(
        device, dtype, max_position_embeddings=max(ints(args.seqs) + [args.prompt + args.new_tokens]), **shape
    )
    g = torch.Generator().manual_seed(2)
    share_gate_direction(model, ROW_SPREAD, g)
    calib = torch.randint(0, shape["vocab_size"], (CALIB_TOKENS // 256, 256), generator=g).to(device)
    if args.smoke:
        calib = calib[:, :64]
    work = Workload(args, shape["vocab_size"], device)
    # Bias sets a profile. In a random-weight model a sequence's tokens share components (attention
    # averages them), so biases set on some random sequences fire far more often on others: the biases
    # set on 256-token sequences ran the 16 x 2048 prefill at 0.5-1.5% a layer, 1.1% on average, and 5 of
    # 12 layers took the dense route (step_profile-20261205-025503.json); the decode calls of generation
    # likewise ran at 1.1-1.5% (the calibrated rows' measured decode densities, e2e-20261202-121235.json).
    # So each kind of point runs on biases set on its own tokens: the prefill points on the first prefill
    # point's sequences, generation on the generated sequences themselves (every batch's prompts and their
    # greedy continuation under the biases set on CALIB_TOKENS tokens of 256-token sequences).
    dense_decoders = make_decoders(model, work, cuda)
    profiles, biases = {}, {}
    for profile in args.profiles.split(","):
        rates = profile_rates(profile, shape["num_hidden_layers"], shape["intermediate_size"], g, demo)
        layers = set_gate_biases(model, rates, calib)
        profiles[profile] = {
            "density": statistics.mean(s["density"] for s in layers),
            "dead_fraction": statistics.mean(s["dead_fraction"] for s in layers),
            "layers": layers,
        }
        if work.prompts:
            runs = [(d, work.prompts[b]) for b, d in dense_decoders.items()]
            generation_layers = set_generation_biases(model, rates, runs, work.new_tokens)
            profiles[profile]["generation_density"] = statistics.mean(s["density"] for s in generation_layers)
            profiles[profile]["generation_layers"] = generation_layers
        biases[profile] = {"generation": gate_biases(model)}
        if work.prefill:
            prefill_layers = set_gate_biases(model, rates, work.prefill[0]["ids"])
            biases[profile]["prefill"] = gate_biases(model)
            profiles[profile]["prefill_density"] = statistics.mean(s["density"] for s in prefill_layers)
            profiles[profile]["prefill_layers"] = prefill_layers
    result = {
        "model": name,
        "config": shape,
        "parameters_b": sum(p.numel() for p in model.parameters()) / 1e9,
        "profiles": profiles,
        "rows": [],
    }
    # Reference outputs per profile: dense eager, the decoders reused by the dense eager row.
    references = {}
    for profile in profiles:
        logits = None
        if work.prefill:
            load_gate_biases(model, biases[profile]["prefill"])
            with torch.no_grad():
                logits = prefill_call(model, work.prefill[0]["ids"])().float()
        load_gate_biases(model, biases[profile]["generation"])
        tokens = {b: d.generate(work.prompts[b], work.new_tokens) for b, d in dense_decoders.items()}
        references[profile] = {"logits": logits, "tokens": tokens}
    first = next(iter(profiles))
    compiled = {}

    def measure(row_name, profile):
        reference = references[profile or first]
        row_biases = biases[profile or first]
        if row_name == "dense-eager":
            return run_row(
                meter, model, model, work, args, eager=True, decoders=dense_decoders, reference=reference,
                biases=row_biases,
            )  # fmt: skip
        if row_name in CALIBRATED:
            started = time.perf_counter()
            twell.sparsify(
                model, list(work.prompts.values()), config={"progress": False, "cost_model": args.cost_model}
            )
            calibration = {"seconds": time.perf_counter() - started, **chosen_configs(model, work)}
        if row_name in ("twell-eager", "twell-calibrated-eager"):
            if row_name == "twell-eager":
                twell.sparsify(model, layer_config=args.layer_config)
            decoders = make_decoders(model, work, cuda)
            row = run_row(
                meter, model, model, work, args, eager=True, decoders=decoders, reference=reference, biases=row_biases
            )
            row["report"] = twell.report(model).summary()
            if row_name in CALIBRATED:
                row["calibration"] = calibration
            return row
        if row_name in TWELL_COMPILED:  # sparsified per profile (restored after each row), so compiled anew
            if row_name not in CALIBRATED:
                twell.sparsify(model, layer_config=args.layer_config)
            torch._dynamo.reset()
            forward = torch.compile(model)
        else:
            if row_name not in compiled:  # biases change in place: one compilation serves every profile
                torch._dynamo.reset()
                compiled[row_name] = torch.compile(model)
            forward = compiled[row_name]
        # captured per profile: a graph keeps the paths the layers' measured densities chose at capture
        decoders = make_decoders(model, work, cuda, forward, args.compiled_prompt)
        row = run_row(
            meter, model, forward, work, args, eager=False, decoders=decoders, reference=reference, biases=row_biases
        )
        if row_name in TWELL_COMPILED:
            row["report"] = twell.report(model).summary()
        if row_name in CALIBRATED:
            row["calibration"] = calibration
        return row

    for row_name in args.rows.split(","):
        for profile in [None] if row_name.startswith("dense") else profiles:  # dense times: any profile's
            started = time.perf_counter()
            print(f"{name}: {row_name}" + (f" ({profile})" if profile else ""), flush=True)
            load_gate_biases(model, biases[profile or first]["generation"])  # calibration: generation's
            dispatch.forget_layers()
            try:
                row = measure(row_name, profile)
            except Exception as e:  # recorded, and the other rows still run
                traceback.print_exc()
                row = {"error": f"{type(e).__name__}: {e}", "prefill": [], "generation": []}
            finally:
                twell.restore(model)  # after twell-eager; a no-op otherwise
            row.update(row=row_name, profile=profile, wall_s=time.perf_counter() - started)
            result["rows"].append(row)
            save(result)
            if cuda:
                torch.cuda.empty_cache()
    add_speedups(result)
    return result


def add_speedups(result: dict) -> None:
    """speedup: the faster dense row's time over this row's, per prefill point and generation batch;
    decode_speedup: the same of the generation's decode steps alone (where both were measured)."""
    dense = [r for r in result["rows"] if r["row"].startswith("dense") and "error" not in r]
    if not dense:
        return
    for row in result["rows"]:
        for kind in ("prefill", "generation"):
            for i, m in enumerate(row[kind]):
                m["speedup"] = min(d[kind][i]["ms"] for d in dense) / m["ms"]
        for i, m in enumerate(row["generation"]):
            steps = [d["generation"][i]["decode_ms_per_step"] for d in dense]
            if m["decode_ms_per_step"] and all(s and s > 0 for s in steps) and m["decode_ms_per_step"] > 0:
                m["decode_speedup"] = min(steps) / m["decode_ms_per_step"]


def table(models: list[dict]) -> str:
    lines = []
    for model in models:
        done = [r for r in model["rows"] if "error" not in r]
        if not done:
            continue
        prefill = [f"pf {p['batch']}x{p['seq']}" for p in done[0]["prefill"]]
        generation = [f"{kind} b{g['batch']}" for kind in ("gen", "steps") for g in done[0]["generation"]]
        lines.append(f"{model['model']}: tokens/s (x speedup against the faster dense row)")
        lines.append(
            f"{'row':>15} {'profile':>8} " + " ".join(f"{c:>16}" for c in prefill + generation) + "  logit err"
        )
        for row in model["rows"]:
            if "error" in row:
                lines.append(f"{row['row']:>15} {row['profile'] or '-':>8} failed: {row['error'][:100]}")
                continue
            cells = [
                f"{m['tokens_per_s']:>9.0f} ({m.get('speedup', 1):.2f}x)" for m in row["prefill"] + row["generation"]
            ]
            cells += [
                f"{m['decode_tokens_per_s']:>9.0f} ({m.get('decode_speedup', 1):.2f}x)"
                if m["decode_tokens_per_s"]
                else "-"
                for m in row["generation"]
            ]
            err = row.get("logits_rel_err")
            err = "-" if err is None else f"{err:.1e}"
            lines.append(
                f"{row['row']:>15} {row['profile'] or '-':>8} " + " ".join(f"{c:>16}" for c in cells) + f"  {err}"
            )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="2b,8b")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--layers", default="", help="per-model layer counts, e.g. 2b=8,8b=2")
    parser.add_argument("--profiles", default="skewed,demo")
    parser.add_argument("--seqs", default="2048,8192")
    parser.add_argument("--tokens", default="32768,131072", help="tokens per prefill forward")
    parser.add_argument("--batches", default="1,16,64,128", help="generation batch sizes")
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per prefill point")
    parser.add_argument("--min-time", type=float, default=0.5, help="seconds of timed calls per measurement")
    parser.add_argument(
        "--cost-model", default="auto", help="the calibrated rows' calibration cost model (auto: benchmark on CUDA)"
    )
    parser.add_argument(
        "--compiled-prompt",
        action="store_true",
        help="compiled rows: the prompt's forward through the row's compiled forward too (a variant: by default "
        "it runs eagerly, host-bound and jittery, as generate() runs a prompt outside a compiled step)",
    )
    parser.add_argument(
        "--step-kernels",
        action="store_true",
        help="CUDA: per generation point, the kernels of one decode step (step_profile.step_kernels: the row's "
        "forward run uncaptured under torch.profiler, the same kernels its graph replays)",
    )
    parser.add_argument(
        "--layer-config",
        default="",
        help="LayerConfig changes for the twell rows that do not calibrate (twell-eager, twell-compiled), "
        "e.g. 'prefill_min_m=8192'",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU, eager rows, JSON to /tmp")
    parser.add_argument("--out", default=None, help="result folder (default benchmarks/results; /tmp with --smoke)")
    args = parser.parse_args()
    variants = parse_variants(args.layer_config)
    if len(variants) > 1:
        parser.error("--layer-config takes one set of changes (no ';')")
    args.layer_config = variants[0][1] if variants else None
    cuda = torch.cuda.is_available() and not args.smoke
    shapes = SHAPES
    if args.smoke:
        shapes = SMOKE_SHAPES
        args.rows = ",".join(r for r in args.rows.split(",") if r.endswith("eager"))
        args.seqs, args.tokens, args.batches, args.prompt, args.new_tokens = "16,32", "64,128", "1,2", 4, 6
        args.warmup, args.min_time = 1, 0.0
    elif not cuda:
        parser.error("needs a CUDA GPU (or --smoke)")
    layer_counts = dict(item.split("=") for item in args.layers.split(",") if item)
    unknown = sorted(set(args.rows.split(",")) - set(ROWS))
    if unknown:
        parser.error(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    args.rows = ",".join(r for r in ROWS if r in args.rows.split(","))
    path = result_path(args.out or (tempfile.gettempdir() if args.smoke else "benchmarks/results"), "e2e")
    meter = Meter(cuda)
    result = {
        **environment(transformers=transformers.__version__),
        "smoke": args.smoke,
        "args": vars(args),
        "models": [],
    }
    demo = demo_profile(16 if args.smoke else 128) if "demo" in args.profiles.split(",") else None
    result["demo_profile"] = demo
    for name in args.models.split(","):
        shape = dict(shapes[name])
        shape["num_hidden_layers"] = int(layer_counts.get(name, shape["num_hidden_layers"]))
        entry = {"model": name, "rows": []}
        result["models"].append(entry)

        def save(partial, entry=entry):
            entry.update(partial)
            path.write_text(json.dumps(result, indent=1))

        save(run_model(name, shape, args, meter, demo, cuda, save))
    print(table(result["models"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
