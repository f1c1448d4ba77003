"""Multi-GPU benchmark: an FSDP2 training step, a tensor-parallel prefill and a tensor-parallel decode step of
a Llama-style model, dense against twell, on every GPU of one host (default 2; 1 runs the same layouts and
kernel paths on one GPU).

    PYTHONPATH=. torchrun --nproc_per_node 2 benchmarks/multigpu.py   # or: python benchmarks/multigpu.py
    PYTHONPATH=. python benchmarks/multigpu.py --nproc 1              # one GPU: FSDP2 / TP of world size 1
    PYTHONPATH=. python benchmarks/multigpu.py --smoke                # CPU, gloo, a tiny model

Without torchrun the script spawns its ranks itself. --smoke runs the same code on the CPU (gloo) at a
tiny size and writes nothing unless --out is given; its timings mean nothing.

Model: Llama-style, ReLU-gated FFNs (hidden 2048, intermediate 5632, 32 heads, vocab 49152, 4 layers by
default), bf16, SDPA attention. Sparsity: gate weights ~ N(0, 1/K) and the gate bias -ndtri(1 - density)
for every neuron, so that on the FFN's RMS-normalised input (pre-activations ~ N(0, 1)) each neuron fires
with probability `density` (0.5%); the densities measured on the run's inputs are recorded.

- FSDP2 ("fsdp"): each decoder layer and the model fully_shard'ed; each rank trains on its own batch
  (--batch x --seq tokens, default 4 x 8192 = 32768). A step is forward with labels (full logits and
  loss) plus LAM x the L1 penalty (twell.train.track_l1 / l1_penalty, on both sides), backward, AdamW
  step (lr 0, so that both sides see the same weights and sparsity). twell: a fresh copy of the model,
  sparsified with the sparse training path on (layer_config train_min_m=1) before fully_shard
  (--fsdp-order sparsify-first, default) or after it (shard-first); FSDP gathers the down weight in the
  nn.Linear layout and every training call takes a transposed copy of it (twell.distributed).
- Tensor parallelism: attention (q/k/v column-wise, o row-wise) and FFN (gate/up column-wise, down
  row-wise) on all ranks; no grad; twell: sparsify after parallelize_module (each rank's down shard
  re-laid in place). "tp": one batch of --batch x --seq tokens, forward of the decoder stack (model.model,
  no LM head), no KV cache. "decode": --decode-batch sequences of one token each through model.model (no
  KV cache: the FFNs' decode shape, M = batch, and attention over one token), --decode-steps calls per
  repetition, eager and, with --graphs (default on GPUs), one call captured in a CUDA graph and replayed;
  twell gets the decode limits calibration would give at the measured density
  (policy.calibrated_decode_max_m / calibrated_batched_max_m: the decode kernels up to 16 tokens at <= 1%).

Timing: per repetition, all ranks synchronise, run one step and synchronise; a repetition takes as long
as its slowest rank; --reps repetitions after --warmup (kernel compilation and autotuning), medians,
cycling through 3 input sets. tokens/s: FSDP, tokens of all ranks per step; TP, tokens of the batch.
Peak memory: torch.cuda.max_memory_allocated of each rank over its side's timed steps. Both sides are
eager PyTorch (no torch.compile). Correctness on the measured inputs: relative error of twell's loss and
gradient norm (FSDP), of the last hidden state (TP), against the dense run. Routes: the paths the twell
ops took in one checked step (twell.kernels.dispatch's choice per call, and the sparse training
forwards), summed over layers. JSON goes to benchmarks/results/ (or --out) from rank 0.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import os
import platform
import socket
import statistics
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ffn import git_commit  # the benchmarks' directory is the script's: on sys.path

import twell
from twell.kernels import policy

FULL = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, vocab_size=49152)
TINY = dict(hidden_size=64, intermediate_size=256, num_attention_heads=4, vocab_size=128)
LAM = 2e-5  # the method's L1 coefficient (PAPER.md: 99.5% sparsity at 2e-5)
TRAIN = {"train_min_m": 1}  # the sparse training path for every training call (benchmarks/train.py's rows)
PARTS = ("fsdp", "tp", "decode")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU (gloo), tiny model: checks that it runs")
    parser.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not run by torchrun")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--density", type=float, default=0.005)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"which of {','.join(PARTS)} to run")
    parser.add_argument("--fsdp-order", choices=("sparsify-first", "shard-first"), default="sparsify-first")
    parser.add_argument("--decode-batch", type=int, default=16)
    parser.add_argument("--decode-steps", type=int, default=20, help="decode calls per timed repetition")
    parser.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=None,
                        help="also time the decode step replayed from a CUDA graph (default: on GPUs)")  # fmt: skip
    parser.add_argument("--out", default=None, help="where the JSON goes (default benchmarks/results/)")
    args = parser.parse_args(argv)
    unknown = set(args.parts.split(",")) - set(PARTS)
    if unknown:
        parser.error(f"--parts: unknown {sorted(unknown)}, known {','.join(PARTS)}")
    if args.smoke:
        args.layers, args.batch, args.seq, args.warmup, args.reps = 2, 2, 16, 1, 2
        args.decode_batch, args.decode_steps = 4, 2
    if args.graphs is None:
        args.graphs = not args.smoke
    return args


# ---------------------------------------------------------------------------------------------------
# Model and inputs


def build_model(args, device, dtype):
    """The Llama-style model with every FFN firing at args.density (module docstring), same on every rank."""
    import transformers

    shape = TINY if args.smoke else FULL
    config = transformers.LlamaConfig(
        **shape,
        num_hidden_layers=args.layers,
        num_key_value_heads=shape["num_attention_heads"],
        max_position_embeddings=max(args.seq, 128),
        hidden_act="relu",
        mlp_bias=True,
        use_cache=False,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    k = shape["hidden_size"]
    threshold = float(torch.special.ndtri(torch.tensor(1.0 - args.density, dtype=torch.float64)))
    with torch.no_grad():
        for layer in model.model.layers:
            mlp = layer.mlp
            mlp.gate_proj.weight.normal_(0.0, k**-0.5)
            mlp.gate_proj.bias.fill_(-threshold)
            mlp.up_proj.weight.normal_(0.0, k**-0.5)
            mlp.up_proj.bias.zero_()
            mlp.down_proj.bias.zero_()
    return model.to(dtype)


def input_sets(args, rank: int, device, count: int = 3, shape=None) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    vocab = (TINY if args.smoke else FULL)["vocab_size"]
    shape = shape or (args.batch, args.seq)
    return [torch.randint(0, vocab, shape, generator=g).to(device) for _ in range(count)]


def measured_density(model, run) -> float:
    """Fraction of gate pre-activations above 0 over every FFN's calls in run(), averaged over ranks
    (under tensor parallelism, each rank sees its slice of the neurons)."""
    kept, total = [], []

    def hook(module, args, output):
        h = output.to_local() if hasattr(output, "to_local") else output
        kept.append((h > 0).sum(dtype=torch.float64))
        total.append(h.numel())

    handles = [layer.mlp.gate_proj.register_forward_hook(hook) for layer in model.model.layers]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    value = torch.stack(kept).sum() / sum(total)
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


@contextlib.contextmanager
def routes():
    """Counter of the paths the twell ops take inside: dispatch's choice per call ("prefill", "decode",
    "batched", "dense") and "train" per sparse training forward."""
    from twell.kernels import backward, dispatch

    counts = Counter()
    choose, train_forward = dispatch._choose, backward.train_forward

    def spied_choose(*args):
        path, state = choose(*args)
        counts[path] += 1
        return path, state

    def spied_train_forward(*args, **kwargs):
        counts["train"] += 1
        return train_forward(*args, **kwargs)

    dispatch._choose, backward.train_forward = spied_choose, spied_train_forward
    try:
        yield counts
    finally:
        dispatch._choose, backward.train_forward = choose, train_forward


# ---------------------------------------------------------------------------------------------------
# Timing


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step, inputs, args, device, warmup=None) -> tuple[list[float], list[float | None]]:
    """(seconds of each timed repetition, the slowest rank's; peak GiB allocated over the timed
    repetitions on each rank, None on the CPU)."""
    times = []
    warmup = args.warmup if warmup is None else warmup
    for i in range(warmup + args.reps):
        if i == warmup and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        step(inputs[i % len(inputs)])
        synchronize(device)
        elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64, device=device)  # NCCL: on GPU
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= warmup:
            times.append(elapsed.item())
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak)
    return times, peaks


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def summary(timed: tuple, tokens: int) -> dict:
    times, peaks = timed
    median = statistics.median(times)
    return {"times_s": times, "median_s": median, "tokens_per_s": tokens / median, "peak_gib_per_rank": peaks}


def compare(result: dict, dense: dict, sparse: dict, tokens: int) -> dict:
    result["dense"], result["twell"] = summary(dense, tokens), summary(sparse, tokens)
    result["speedup"] = result["dense"]["median_s"] / result["twell"]["median_s"]
    return result


def free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------
# FSDP2 training step


def fsdp_part(args, mesh, device, dtype) -> dict:
    from torch.distributed.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    inputs = input_sets(args, rank, device)

    def shard(model):
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)

    def prepared(sparse: bool):
        model = build_model(args, device, dtype).train()
        if sparse and args.fsdp_order == "sparsify-first":
            twell.sparsify(model, layer_config=TRAIN)
        shard(model)
        if sparse and args.fsdp_order == "shard-first":
            twell.sparsify(model, layer_config=TRAIN)
        return model

    def run(sparse: bool):
        """(checked (mean loss, grad norm), routes of that step, timings, measured density, model facts)"""
        model = prepared(sparse)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
        tracker = twell.train.track_l1(model)

        def step(ids):
            optimizer.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids).loss + LAM * twell.train.l1_penalty(model)
            loss.backward()
            optimizer.step()
            return loss.detach()

        density = measured_density(model, lambda: step(inputs[0]))
        with routes() as taken:
            loss = step(inputs[0]).double()
        local = sum(p.grad.to_local().double().pow(2).sum() for p in model.parameters() if p.grad is not None)
        dist.all_reduce(loss)
        dist.all_reduce(local)
        timed = time_steps(step, inputs, args, device)
        facts = {"rewritten": sum(r.rewritten for r in twell.report(model))}
        tracker.remove()
        return (loss / world, local.sqrt()), dict(taken), timed, density, facts

    (dense_loss, dense_norm), _, dense, density, _ = run(False)
    free(device)  # the dense model's cycles (hooks) before the twell copy is built
    (twell_loss, twell_norm), taken, sparse, _, facts = run(True)
    tokens = args.batch * args.seq * world
    result = {
        "order": args.fsdp_order,
        "tokens_per_step": tokens,
        "tokens_per_rank": args.batch * args.seq,
        "lam": LAM,
        "layer_config": TRAIN,
        "measured_density": density,
        **facts,
        "routes": taken,
        "loss_rel_err": rel_err(twell_loss, dense_loss),
        "grad_norm_rel_err": rel_err(twell_norm, dense_norm),
    }
    return compare(result, dense, sparse, tokens)


# ---------------------------------------------------------------------------------------------------
# Tensor parallelism: prefill and decode


def tp_plan(model) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(len(model.model.layers)):
        prefix = f"model.layers.{i}."
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[prefix + name] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[prefix + name] = RowwiseParallel()
    return plan


def parallel_model(args, mesh, device, dtype):
    from torch.distributed.tensor.parallel import parallelize_module

    model = build_model(args, device, dtype).eval()
    parallelize_module(model, mesh, tp_plan(model))
    return model


def tp_part(args, mesh, device, dtype) -> dict:
    model = parallel_model(args, mesh, device, dtype)
    inputs = input_sets(args, 0, device)  # the same tokens on every rank

    @torch.no_grad()
    def step(ids):
        return model.model(input_ids=ids, use_cache=False).last_hidden_state

    density = measured_density(model, lambda: step(inputs[0]))
    dense_out = step(inputs[0])
    dense = time_steps(step, inputs, args, device)
    twell.sparsify(model)
    with routes() as taken:
        twell_out = step(inputs[0])
    sparse = time_steps(step, inputs, args, device)
    tokens = args.batch * args.seq
    with torch.no_grad():
        local_down = model.model.layers[0].mlp.down_proj.weight.to_local()
    result = {
        "tokens_per_step": tokens,
        "measured_density": density,
        "rewritten": sum(r.rewritten for r in twell.report(model)),
        "attention": model.config._attn_implementation,
        "hidden_per_rank": local_down.shape[1],
        "down_shard_rows_layout": local_down.t().is_contiguous(),
        "routes": dict(taken),
        "last_hidden_rel_err": rel_err(twell_out, dense_out),
    }
    return compare(result, dense, sparse, tokens)


def graphed(fn, example: torch.Tensor):
    """fn captured in a CUDA graph on a static copy of `example`: replay(ids) copies ids in and replays."""
    static = example.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up outside the capture (allocator, lazy initialisation)
            fn(static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(static)

    def replay(ids):
        static.copy_(ids)
        graph.replay()
        return out

    return replay


def decode_part(args, mesh, device, dtype) -> dict:
    model = parallel_model(args, mesh, device, dtype)
    inputs = input_sets(args, 0, device, shape=(args.decode_batch, 1))

    @torch.no_grad()
    def call(ids):
        return model.model(input_ids=ids, use_cache=False).last_hidden_state

    def timed_sides(call_of):
        """{"eager": ..., "graph": ...} timings of args.decode_steps calls per repetition."""
        out = {}
        kinds = ("eager", "graph") if args.graphs else ("eager",)
        for kind in kinds:
            try:
                fn = call_of if kind == "eager" else graphed(call_of, inputs[0])
            except Exception as e:  # a capture that fails is recorded, not fatal (DTensor or NCCL in a graph)
                out[kind] = {"error": f"{type(e).__name__}: {e}"[:500]}
                continue

            def steps(ids, fn=fn):
                for _ in range(args.decode_steps):
                    fn(ids)

            out[kind] = time_steps(steps, inputs, args, device)
        return out

    density = measured_density(model, lambda: call(inputs[0]))
    dense_out = call(inputs[0])
    dense = timed_sides(call)
    # the decode limits calibration gives a layer of this density (sparsify without data keeps the defaults)
    limits = {
        "decode_max_m": policy.calibrated_decode_max_m(density),
        "batched_max_m": policy.calibrated_batched_max_m(density),
    }
    twell.sparsify(model, layer_config=limits)
    with routes() as taken:
        twell_out = call(inputs[0])
    sparse = timed_sides(call)
    tokens = args.decode_batch * args.decode_steps
    result = {
        "decode_batch": args.decode_batch,
        "decode_steps": args.decode_steps,
        "measured_density": density,
        "layer_config": limits,
        "routes": dict(taken),
        "last_hidden_rel_err": rel_err(twell_out, dense_out),
    }
    for kind in dense:
        if "error" in dense[kind] or "error" in sparse[kind]:
            result[kind] = {"dense": dense[kind], "twell": sparse[kind]}
        else:
            result[kind] = compare({}, dense[kind], sparse[kind], tokens)
    return result


# ---------------------------------------------------------------------------------------------------
# Ranks


def line(name: str, r: dict) -> str:
    def peaks(side):
        values = side.get("peak_gib_per_rank") or []
        return "" if None in values or not values else f", peak {max(values):.1f} GiB"

    return (
        f"{name:>12}: dense {r['dense']['tokens_per_s']:>10.0f} tok/s{peaks(r['dense'])}, twell "
        f"{r['twell']['tokens_per_s']:>10.0f} tok/s{peaks(r['twell'])} ({r['speedup']:.2f}x)"
    )


def worker(args) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.smoke:
        device, backend, dtype = torch.device("cpu"), "gloo", torch.float32
    else:
        device, backend, dtype = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))), "nccl", torch.bfloat16
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(minutes=10))
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        mesh = init_device_mesh(device.type, (world,))
        names = [None] * world
        dist.all_gather_object(names, torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
        import triton

        result = {
            "gpus": names,
            "world_size": world,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "commit": git_commit(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "smoke": args.smoke,
            "model": {**(TINY if args.smoke else FULL), "layers": args.layers, "dtype": str(dtype), "relu": True},
            "batch": args.batch,
            "seq": args.seq,
            "density": args.density,
            "warmup": args.warmup,
            "reps": args.reps,
            # what sparsify gives every rewritten FFN of the model's width
            "layer_config": dataclasses.asdict(policy.default_config((TINY if args.smoke else FULL)["hidden_size"])),
        }
        parts = {"fsdp": fsdp_part, "tp": tp_part, "decode": decode_part}
        for name in args.parts.split(","):
            result[name] = parts[name](args, mesh, device, dtype)
            free(device)
            if rank == 0:
                r = result[name]
                kinds = [k for k in ("eager", "graph") if k in r]
                rows = [(f"decode {k}", r[k]) for k in kinds] if name == "decode" else [(name, r)]
                for label, row in rows:
                    print(line(label, row) if "speedup" in row else f"{label:>12}: {row}", flush=True)
                print(f"{'':>12}  routes {r['routes']}", flush=True)
        if rank == 0:
            out = args.out or (None if args.smoke else "benchmarks/results")
            if out is not None:
                path = Path(out) / f"multigpu-{time.strftime('%Y%m%d-%H%M%S')}.json"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(result, indent=1))
                print(f"wrote {path}")
            else:
                print(json.dumps({k: v for k, v in result.items() if k in PARTS}, indent=1))
    finally:
        gc.collect()  # models' reference cycles may hold pending collectives: free them before the group
        dist.destroy_process_group()


def _spawned(rank: int, args, world: int, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    worker(args)


def main() -> None:
    args = parse_args()
    if "RANK" in os.environ:  # started by torchrun
        worker(args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_spawned, args=(args, args.nproc, port), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    main()
