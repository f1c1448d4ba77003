"""FFN block benchmark: dense PyTorch (eager and torch.compile, the faster counts) against twell.

Run on a GPU:  PYTHONPATH=. python benchmarks/ffn.py [--shapes 2048x5632,4096x14336] [--ms 1,16] [--repeats 3]
Checks correctness at every measured point (relative error of twell against a float64 reference on a
row sample) and writes JSON to benchmarks/results/ (or --out).

Both sides are what users run: a Llama-style ReLU-gated FFN module, dense (eager and compiled) and after
twell.sparsify (its modules, its weight layouts). Calls of up to 256 tokens are timed as CUDA-graph
replays, as serving stacks run them: one graph over 8 such FFN layers (neuron-permuted copies: the same
sparsity on distinct weights, so each layer reads its own from HBM), time per layer.

Inputs: "exact": every row has exactly round(density * N) active neurons (the best case of a
fixed-slot format). Otherwise x ~ N(0, 1) rows scaled by exp(ROW_SCALE z), z ~ N(0, 1) (so the active
neurons per row are heavy-tailed), and the gate bias shifts each neuron so that it fires on p_n of the
scaled rows in expectation (scaled_quantile; until 2026-12-05 on p_n of unscaled rows, which ran
"uniform 0.5%" at 0.65%, "skewed 0.5%" at 0.58%, "topics 0.5%" at 0.55%). "uniform": p_n = density
for all n; "skewed": 30% of neurons never fire, the rest have log-normal rates (sigma 1.5) with the
same mean; "topics": tokens come in runs of 256 sharing one of 16 topics, each neuron belongs to a
topic and 90% of a token's active neurons come from its topic's (topic_tokens); "topics-mixed": the same
with each token's topic drawn alone (runs of 1), so tokens that share neurons are not neighbours: the
two measure what token order is worth to the kernels.
Floors: gate GEMM alone (cuBLAS), and bytes over the measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import json
import math
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

import twell
from twell.calibrate.timing import cuda_graph
from twell.kernels import dispatch, policy, reference
from twell.kernels.gate import gate_twell, pack_dense
from twell.kernels.updown import _up_down_launch as updown_launch
from twell.kernels.updown import twell_up_down

MS = [1, 16, 128, 8192, 32768, 131072]
DENSITIES = [0.005, 0.01, 0.02, 0.05]
GRAPH_MAX_M = 256  # decode-sized calls are timed as CUDA-graph replays, as serving stacks run them
# layers per graph for those calls: a model's decode step replays one graph over all its layers, each
# with its own weights (read from HBM, not L2), and one replay's fixed cost spread over them
LAYERS_PER_GRAPH = 8


class GatedFFN(torch.nn.Module):
    """A Llama-style ReLU-gated FFN; the gate bias sets each neuron's firing rate."""

    def __init__(self, k, n):
        super().__init__()
        self.gate_proj = torch.nn.Linear(k, n)
        self.up_proj = torch.nn.Linear(k, n, bias=False)
        self.down_proj = torch.nn.Linear(n, k, bias=False)

    def forward(self, x):
        return self.down_proj(F.relu(self.gate_proj(x)) * self.up_proj(x))


class Block(torch.nn.Module):
    """What sparsify rewrites: a module holding the FFN (here the whole forward)."""

    def __init__(self, k, n):
        super().__init__()
        self.mlp = GatedFFN(k, n)

    def forward(self, x):
        return self.mlp(x)


def skewed_rates(n, density, generator):
    """Firing rates [n] on the generator's device: 30% dead neurons, the rest log-normal (sigma 1.5),
    mean `density` (capped at 0.5 per neuron)."""
    rates = torch.exp(1.5 * torch.randn(n, device=generator.device, generator=generator))
    rates[torch.rand(n, device=generator.device, generator=generator) < 0.3] = 0.0
    return (rates * density * n / rates.sum()).clamp(max=0.5)


ROW_SCALE = 0.12  # x rows scaled by exp(ROW_SCALE z), z ~ N(0, 1)
TOPICS = 16  # topics of the "topics" pattern, each owning N / TOPICS neurons
TOPIC_RUN = 256  # consecutive tokens of one topic
TOPIC_SHARE = 0.9  # of a token's active neurons, the share from its topic's own
PATTERNS = ("exact", "uniform", "skewed", "topics", "topics-mixed")


def scaled_quantile(rates: torch.Tensor) -> torch.Tensor:
    """c per rate p with E_z[1 - Phi(c / exp(ROW_SCALE z))] = p, z ~ N(0, 1): a neuron whose gate bias is
    -c sigma (sigma: its gate weights' norm) fires on p of the rows of x scaled by exp(ROW_SCALE z) in
    expectation. Bisection over c in [-10, 10] on a quadrature of z; 1 - Phi(c / s) is decreasing in c."""
    normal = torch.distributions.Normal(0.0, 1.0)
    z = torch.linspace(-6.0, 6.0, 2001, device=rates.device)
    weight = normal.log_prob(z).exp()
    weight = weight / weight.sum()
    scale = torch.exp(ROW_SCALE * z)
    lo = torch.full_like(rates, -10.0)
    hi = torch.full_like(rates, 10.0)
    for _ in range(50):
        mid = (lo + hi) / 2
        fires = ((1 - normal.cdf(mid[:, None] / scale[None, :])) * weight).sum(1)
        above = fires > rates
        lo = torch.where(above, mid, lo)
        hi = torch.where(above, hi, mid)
    return (lo + hi) / 2


def topic_tokens(x, w_gate, density, generator, run=TOPIC_RUN):
    """In place on x [M, K] and w_gate [N, K], the "topics" pattern; returns the gate bias [N]. Tokens
    come in runs of `run` sharing a topic (drawn per run); each neuron belongs to one of TOPICS
    topics and fires with probability p_in on its topic's tokens, p_out on others, so that TOPIC_SHARE of
    a token's `density` comes from its topic. The last TOPICS input features are the token's topic as
    one-hot; a neuron's gate weight on its topic's feature lifts its pre-activation from the p_out to
    the p_in quantile (quantiles of the scaled rows, scaled_quantile)."""
    m, k = x.shape
    n = w_gate.shape[0]
    device = x.device
    random_cols = k - TOPICS
    topic_of_neuron = torch.randint(0, TOPICS, (n,), device=device, generator=generator)
    runs = torch.randint(0, TOPICS, (-(-m // run),), device=device, generator=generator)
    topic_of_token = runs.repeat_interleave(run)[:m]
    x[:, random_cols:] = torch.nn.functional.one_hot(topic_of_token, TOPICS).to(x.dtype)
    sigma = w_gate[:, :random_cols].norm(dim=1)
    p_in = min(TOPIC_SHARE * density * TOPICS, 0.5)
    p_out = (1 - TOPIC_SHARE) * density * TOPICS / (TOPICS - 1)
    q_in, q_out = scaled_quantile(torch.tensor([p_in, p_out], device=device))
    w_gate[:, random_cols:] = 0.0
    w_gate[torch.arange(n, device=device), random_cols + topic_of_neuron] = sigma * (q_out - q_in)
    return -sigma * q_out


def make_inputs(m, k, n, density, pattern, seed=0, dtype=torch.bfloat16, device="cuda"):
    """x [M, K] and a Block whose FFN fires at `density` with the given pattern (module docstring)."""
    if pattern not in PATTERNS:
        raise ValueError(f"pattern must be one of {PATTERNS}, got {pattern!r}")
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, device=device, generator=g)
    w_gate = torch.randn(n, k, device=device, generator=g) / math.sqrt(k)
    shift = torch.zeros(n, device=device)
    if pattern == "exact":  # every row exactly round(density * N) active: the last input feature is
        # a per-row offset (its gate weights are one) halfway between the r-th and (r+1)-th pre-activations
        r = max(1, round(density * n))
        x[:, -1] = 0.0
        w_gate[:, -1] = 1.0
        top = torch.topk(x @ w_gate.T, r + 1, dim=1).values
        x[:, -1] = -(top[:, r - 1] + top[:, r]) / 2
    elif pattern in ("topics", "topics-mixed"):
        x *= torch.exp(ROW_SCALE * torch.randn(m, 1, device=device, generator=g))
        shift = topic_tokens(x, w_gate, density, g, TOPIC_RUN if pattern == "topics" else 1)
    else:
        x *= torch.exp(ROW_SCALE * torch.randn(m, 1, device=device, generator=g))
        rates = torch.full((n,), density, device=device) if pattern == "uniform" else skewed_rates(n, density, g)
        sigma = w_gate.norm(dim=1)
        shift = -sigma * scaled_quantile(rates.clamp(1e-7, 1 - 1e-7))
        shift[rates == 0] = -50.0 * sigma[rates == 0]
    block = Block(k, n).to(device)
    with torch.no_grad():
        mlp = block.mlp
        mlp.gate_proj.weight.copy_(w_gate)
        mlp.gate_proj.bias.copy_(shift)
        mlp.up_proj.weight.copy_(torch.randn(n, k, device=device, generator=g) / math.sqrt(k))
        mlp.down_proj.weight.copy_(torch.randn(k, n, device=device, generator=g) / math.sqrt(n))
    return x.to(dtype), block.to(dtype).eval()


def timed(fn, graph: bool) -> float:
    """Median ms; decode-sized calls captured in a CUDA graph and timed as replays."""
    if not graph:
        return do_bench(fn, warmup=25, rep=120, return_mode="median")
    return do_bench(cuda_graph(fn).replay, warmup=25, rep=120, return_mode="median")


def peak_mb(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def neuron_permuted(block, seed):
    """A copy of block with its neurons permuted: the same function (and sparsity) on other weights."""
    clone = copy.deepcopy(block)
    mlp = clone.mlp
    perm = torch.randperm(mlp.gate_proj.out_features, generator=torch.Generator().manual_seed(seed)).cuda()
    with torch.no_grad():
        for t in (mlp.gate_proj.weight, mlp.gate_proj.bias, mlp.up_proj.weight):
            t.copy_(t[perm])
        mlp.down_proj.weight.copy_(mlp.down_proj.weight[:, perm])
    return clone


def weights(block) -> dict:
    mlp = block.mlp
    return {
        "gate_weight": mlp.gate_proj.weight,
        "gate_bias": mlp.gate_proj.bias,
        "up_weight": mlp.up_proj.weight,
        "down_weight": mlp.down_proj.weight,
    }


def rel_err_sample(out, x, block, rows=1024):
    idx = torch.linspace(0, out.shape[0] - 1, min(rows, out.shape[0]), device="cuda").long()
    c = {name: t.double() for name, t in weights(block).items()}
    ref = reference.gated_ffn_reference(
        x[idx].double(), c["gate_weight"], c["up_weight"], c["down_weight"], c["gate_bias"]
    )
    return ((out[idx].double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def ceilings() -> dict:
    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    copy_ms = do_bench(lambda: b.copy_(a), return_mode="median")
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    gemm_ms = do_bench(lambda: x @ x, return_mode="median")
    return {"copy_tb_s": 2 * 2**30 / copy_ms / 1e9, "gemm_tflop_s": 2 * 8192**3 / gemm_ms / 1e9}


def dense_ffn(x, gate_weight, gate_bias, up_weight, down_weight):
    return F.linear(F.relu(F.linear(x, gate_weight, gate_bias)) * F.linear(x, up_weight), down_weight)


def warm_call(block, x):
    """block(x) once the layer's first call measured it (its density, its hot neurons) and the
    measurement landed: what every later call of the layer runs."""
    block(x)
    torch.cuda.synchronize()
    return block(x)


def largest_hot():
    """The largest set of hot neurons (computed by dense products) of any layer state the dispatcher
    holds, or None."""
    hots = [st.hot for d in dispatch._layers.values() for st in d.values() if st.hot is not None]
    return max(hots, key=lambda h: len(h.index), default=None)


def hot_neurons() -> int:
    hot = largest_hot()
    return 0 if hot is None else len(hot.index)


def bench_point(k, n, m, density, pattern, compiled, variants=(), module_variants=(), repeats=1) -> dict:
    """One point: the dense module (eager, and torch.compile) against the same module after
    twell.sparsify, called exactly as a user calls it (W_down in the layout sparsify gives it).
    Decode-sized calls: times per layer of a graph over LAYERS_PER_GRAPH such modules.
    repeats: the three timings taken that many times, interleaved (restore, dense, compiled, sparsify,
    twell), each ms the median of its runs (*_runs_ms): single timings of one point drift by up to ~10%
    between runs at 131072 tokens (ffn-20261205-142347.json / -142801.json).
    variants: LayerConfig changes timed on the forced prefill (prefill[name]_*); module_variants: timed
    on the module as installed with those changes (twell[name]_*), after the module at its defaults
    again (twell[default]_*), each from a clean layer state, in one loop."""
    x, block = make_inputs(m, k, n, density, pattern, seed=m + n)
    graph = m <= GRAPH_MAX_M
    blocks = [block] + [neuron_permuted(block, i) for i in range(1, LAYERS_PER_GRAPH if graph else 1)]

    def per_layer(fn):
        return timed(lambda: [fn(b) for b in blocks], graph) / len(blocks)

    with torch.no_grad():
        dense_ms = per_layer(lambda b: b(x))
        ws = {id(b): weights(b) for b in blocks}
        compiled_ms = per_layer(lambda b: compiled(x, **ws[id(b)]))
        for b in blocks:
            twell.sparsify(b)
        dispatch.forget_layers()
        out = warm_call(block, x)
        err = rel_err_sample(out, x, block)
        hot = hot_neurons()
        dispatch.forget_layers()
        runs = {"dense": [dense_ms], "compiled": [compiled_ms], "twell": [per_layer(lambda b: b(x))]}
        for _ in range(repeats - 1):
            for b in blocks:
                twell.restore(b)
            runs["dense"].append(per_layer(lambda b: b(x)))
            runs["compiled"].append(per_layer(lambda b: compiled(x, **ws[id(b)])))
            for b in blocks:
                twell.sparsify(b)
            dispatch.forget_layers()
            runs["twell"].append(per_layer(lambda b: b(x)))
        dense_ms, compiled_ms, twell_ms = (statistics.median(runs[side]) for side in ("dense", "compiled", "twell"))
        w = weights(block)
        gate = F.relu(F.linear(x, w["gate_weight"], w["gate_bias"]))
        nnz = (gate != 0).sum(1).float()
        del gate
        row = {
            "K": k,
            "N": n,
            "M": m,
            "density": density,
            "pattern": pattern,
            "layers_per_graph": len(blocks) if graph else None,
            "nnz_mean": nnz.mean().item(),
            "nnz_max": nnz.max().item(),
            "dense_eager_ms": dense_ms,
            "dense_compiled_ms": compiled_ms,
            "twell_ms": twell_ms,
            "speedup": min(dense_ms, compiled_ms) / twell_ms,
            "rel_err": err,
            "hot_neurons": hot,
            "twell_peak_mb": peak_mb(lambda: block(x)),
            "path": policy.route(m, k, block.mlp.layer_config),
            "dense_after": any(st.dense_calls_left for d in dispatch._layers.values() for st in d.values()),
            **({f"{side}_runs_ms": v for side, v in runs.items()} if repeats > 1 else {}),
        }
        twell.restore(block)
        row["dense_peak_mb"] = peak_mb(lambda: block(x))
        twell.sparsify(block)
        # every path the dispatcher can take, forced on every layer (a forced prefill does not fall back
        # to dense on a measured density), to set its thresholds from data
        for path in ("decode", "prefill"):
            if (path == "decode" and m > 1024) or (path == "prefill" and m < 128):
                continue
            with contextlib.ExitStack() as forced:
                for b in blocks:
                    forced.enter_context(twell.configure(b, route=path))
                dispatch.forget_layers()
                row[f"{path}_err"] = rel_err_sample(warm_call(block, x), x, block)
                dispatch.forget_layers()
                row[f"{path}_ms"] = per_layer(lambda b: b(x)) if path == "decode" else timed(lambda: block(x), False)
        # the forced prefill under other LayerConfig values (--variants); from 4096 tokens, where the
        # prefill threshold is measured ('prefill_min_m=4096,dense_above=0.008': the defaults but the sparse
        # path from 4096 tokens)
        if m >= 4096:
            for name, changes in variants:
                with twell.configure(block, route="prefill", **changes):
                    dispatch.forget_layers()
                    row[f"prefill[{name}]_err"] = rel_err_sample(warm_call(block, x), x, block)
                    row[f"prefill[{name}]_neurons"] = hot_neurons()
                    row[f"prefill[{name}]_ms"] = timed(lambda: block(x), False)
        if module_variants:
            for name, changes in (("default", {}), *module_variants):
                with contextlib.ExitStack() as configured:
                    for b in blocks:
                        configured.enter_context(twell.configure(b, **changes))
                    dispatch.forget_layers()
                    row[f"twell[{name}]_err"] = rel_err_sample(warm_call(block, x), x, block)
                    row[f"twell[{name}]_neurons"] = hot_neurons()
                    dispatch.forget_layers()
                    row[f"twell[{name}]_ms"] = per_layer(lambda b: b(x))
        if m >= 8192:
            with twell.configure(block, route="prefill"):  # the stages at the default hot_rate's neurons
                dispatch.forget_layers()
                warm_call(block, x)
                row.update(prefill_stages(x, w, block.mlp.layer_config))
    return row


def prefill_stages(x, w, config) -> dict:
    """Stage breakdown of the prefill path (its kernels called directly, same inputs, at the layout of
    the layer's LayerConfig)."""
    wg, bg = w["gate_weight"], w["gate_bias"]
    tile_n, slots = config.tile_n, config.slots
    row = {"cublas_gate_ms": do_bench(lambda: F.linear(x, wg, bg), return_mode="median")}
    pre = F.linear(x, wg, bg)
    row["pack_ms"] = do_bench(lambda: pack_dense(pre, 0.0, tile_n, slots), return_mode="median")
    row["fused_gate_ms"] = do_bench(lambda: gate_twell(x, wg, bg, 0.0, tile_n, slots), return_mode="median")
    words, counts = gate_twell(x, wg, bg, 0.0, tile_n, slots)
    wd_t = w["down_weight"].t()
    row["updown_ms"] = do_bench(
        lambda: twell_up_down(x, words, counts, wg, bg, w["up_weight"], None, wd_t, None, tile_n=tile_n, threshold=0.0),
        return_mode="median",
    )
    row["updown_config"] = str(updown_launch.best_config)
    pairs = int(counts.sum())
    row["updown_l2_tb_s"] = pairs * 2 * x.shape[1] * 2 / row["updown_ms"] / 1e9
    row["overflow_tiles"] = int((counts > slots).sum())
    hot = largest_hot()
    if hot is not None:  # the pieces of the hybrid by neuron, at the layer's hot neurons
        words, counts = pack_dense(pre, 0.0, tile_n, slots, hot_pos=hot.pos)
        row["pack_hot_ms"] = do_bench(
            lambda: pack_dense(pre, 0.0, tile_n, slots, hot_pos=hot.pos), return_mode="median"
        )
        wu = w["up_weight"]

        def products():
            return dispatch._hot_products(x, hot.index, wg, bg, wu, None, 0.0, False, False, False)[0]

        row["hot_up_ms"] = do_bench(products, return_mode="median")  # the hot neurons' gate and up products
        h_hot = products()
        y = torch.empty_like(x)
        row["hot_down_ms"] = do_bench(lambda: y.addmm_(h_hot, wd_t.index_select(0, hot.index)), return_mode="median")
        row["updown_hot_ms"] = do_bench(
            lambda: twell_up_down(
                x, words, counts, wg, bg, wu, None, wd_t, None, tile_n=tile_n, threshold=0.0,
                hot_pos=hot.pos,
            ),
            return_mode="median",
        )  # fmt: skip
        row["hot_pairs_share"] = 1 - int(counts.sum()) / pairs
    return row


def git_commit() -> str:
    """TWELL_COMMIT if set (the device machine's copy of the tree may carry a stale .git), else HEAD."""
    if os.environ.get("TWELL_COMMIT"):
        return os.environ["TWELL_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def environment(**versions) -> dict:
    """What every result file records: GPU (or "cpu"), torch, triton, python, commit, time, and
    `versions` (e.g. transformers=...)."""
    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        **versions,
        "python": platform.python_version(),
        "commit": git_commit(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def result_path(out: str, kind: str) -> Path:
    """$OUT (the device machine's output folder) if set, else `out`: <dir>/<kind>-<timestamp>.json."""
    out_dir = Path(os.environ["OUT"]) if "OUT" in os.environ else Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}.json"


def parse_variants(text: str) -> list[tuple[str, dict]]:
    """'a=1,b=None;c=True' -> [("a=1,b=None", {"a": 1, "b": None}), ("c=True", {"c": True})]: values as
    Python literals."""
    variants = []
    for variant in filter(None, text.split(";")):
        pairs = (item.split("=", 1) for item in variant.split(","))
        variants.append((variant, {key.strip(): ast.literal_eval(value.strip()) for key, value in pairs}))
    return variants


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="2048x5632,4096x14336")
    parser.add_argument("--ms", default=",".join(map(str, MS)))
    parser.add_argument("--densities", default=",".join(map(str, DENSITIES)))
    parser.add_argument("--patterns", default="exact,uniform,skewed")
    parser.add_argument("--other-densities", default="0.005,0.01", help="densities of the exact and skewed patterns")
    parser.add_argument(
        "--variants",
        default="",
        help="LayerConfig changes to time the forced prefill at, ';' between variants, e.g. "
        "'fused_gate=True;fused_gate=False,hot_rate=None'",
    )
    parser.add_argument(
        "--module-variants",
        default="",
        help="LayerConfig changes to time the module as installed at (twell.configure), as --variants; "
        "e.g. 'hot_rate=0.03;hot_rate=0.04;hot_rate=None'",
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="time dense and twell this many times, interleaved (medians)"
    )
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    compiled = torch.compile(dense_ffn, dynamic=True)  # the same FFN as a function: compiled once
    result = {**environment(), "ceilings": ceilings(), "points": []}
    print(json.dumps(result["ceilings"]))
    path = result_path(args.out, "ffn")
    columns = "K N M dens pat nnz max dense twell x err hot dec pre gateC pack fused updn TB/s ovfl memD memT"
    header = " ".join(f"{c:>7}" for c in columns.split())
    lines = [header]
    print(header, flush=True)
    for shape in args.shapes.split(","):
        k, n = map(int, shape.split("x"))
        for m in map(int, args.ms.split(",")):
            for pattern in args.patterns.split(","):
                dens = args.densities if pattern == "uniform" else args.other_densities
                for density in map(float, dens.split(",")):
                    row = bench_point(
                        k, n, m, density, pattern, compiled, parse_variants(args.variants),
                        parse_variants(args.module_variants), args.repeats,
                    )  # fmt: skip
                    torch.cuda.empty_cache()
                    result["points"].append(row)
                    path.write_text(json.dumps(result, indent=1))  # kept if a later point fails
                    line = (
                        f"{k:>5} {n:>6} {m:>7} {density:>6.3f} {pattern:>7} {row['nnz_mean']:>6.1f} "
                        f"{row['nnz_max']:>5.0f} {min(row['dense_eager_ms'], row['dense_compiled_ms']):>8.3f} "
                        f"{row['twell_ms']:>8.3f} {row['speedup']:>5.2f} {row['rel_err']:>8.1e} "
                        f"{row['hot_neurons']:>5} "
                        f"{row.get('decode_ms', 0):>7.3f} {row.get('prefill_ms', 0):>7.3f} "
                        f"{row.get('cublas_gate_ms', 0):>6.2f} {row.get('pack_ms', 0):>5.2f} "
                        f"{row.get('fused_gate_ms', 0):>6.2f} "
                        f"{row.get('updown_ms', 0):>6.2f} "
                        f"{row.get('updown_l2_tb_s', 0):>5.1f} "
                        f"{row.get('overflow_tiles', 0):>6} {row['dense_peak_mb']:>7.0f} {row['twell_peak_mb']:>7.0f}"
                    )
                    timed_variants = [v for v, _ in parse_variants(args.variants) if f"prefill[{v}]_ms" in row]
                    line += "".join(f"  [{v}] {row[f'prefill[{v}]_ms']:.3f}" for v in timed_variants)
                    module = [(key[:-3], v) for key, v in row.items() if key[:6] == "twell[" and key[-3:] == "_ms"]
                    line += "".join(f"  {name} {v:.3f}" for name, v in module)
                    lines.append(line)
                    print(line, flush=True)
    path.write_text(json.dumps(result, indent=1))
    print("\n".join(lines[-40:]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
