"""Multi-GPU benchmark: an FSDP2 training step and a tensor-parallel prefill of a Llama-style model,
dense against twell, on every GPU of one host (default 2).

    PYTHONPATH=. torchrun --nproc_per_node 2 benchmarks/multigpu.py   # or: python benchmarks/multigpu.py
    PYTHONPATH=. python benchmarks/multigpu.py --smoke                # CPU, gloo, a tiny model

Without torchrun the script spawns its ranks itself. --smoke runs the same code on the CPU (gloo) at a
tiny size and writes nothing unless --out is given; its timings mean nothing.

Model: Llama-style, ReLU-gated FFNs (hidden 2048, intermediate 5632, 32 heads, vocab 49152, 4 layers by
default), bf16, SDPA attention. Sparsity: gate weights ~ N(0, 1/K) and the gate bias -ndtri(1 - density)
for every neuron, so that on the FFN's RMS-normalised input (pre-activations ~ N(0, 1)) each neuron fires
with probability `density` (0.5%); the densities measured on the run's inputs are recorded.

- FSDP2: each decoder layer and the model fully_shard'ed; each rank trains on its own batch
  (--batch x --seq tokens, default 4 x 8192 = 32768: the size from which twell's prefill kernels run).
  A step is forward with labels (full logits and loss), backward, AdamW step (lr 0, so that both sides
  see the same weights and sparsity). twell: sparsify after fully_shard.
- Tensor parallelism: attention (q/k/v column-wise, o row-wise) and FFN (gate/up column-wise, down
  row-wise) on all ranks; one batch of --batch x --seq tokens, forward of the decoder stack
  (model.model, no LM head), no KV cache, no grad. twell: sparsify after parallelize_module.

Timing: per repetition, all ranks synchronise, run one step and synchronise; a repetition takes as long
as its slowest rank; --reps repetitions after --warmup (kernel compilation and autotuning), medians,
cycling through 3 input sets. tokens/s: FSDP, tokens of all ranks per step; TP, tokens of the batch.
Both sides are eager PyTorch (no torch.compile). Correctness on the measured inputs: relative error of
twell's loss and gradient norm (FSDP), of the last hidden state (TP), against the dense run.
JSON goes to benchmarks/results/ (or --out) from rank 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ffn import git_commit  # the benchmarks' directory is the script's: on sys.path

import twell
from twell.kernels import policy

FULL = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, vocab_size=49152)
TINY = dict(hidden_size=64, intermediate_size=256, num_attention_heads=4, vocab_size=128)


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
    parser.add_argument("--parts", default="fsdp,tp", help="which of fsdp,tp to run")
    parser.add_argument("--out", default=None, help="where the JSON goes (default benchmarks/results/)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.layers, args.batch, args.seq, args.warmup, args.reps = 2, 2, 16, 1, 2
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


def input_sets(args, rank: int, device, count: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    vocab = (TINY if args.smoke else FULL)["vocab_size"]
    return [torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(device) for _ in range(count)]


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


# ---------------------------------------------------------------------------------------------------
# Timing


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step, inputs, args, device) -> list[float]:
    """Seconds of each timed repetition, the slowest rank's."""
    times = []
    for i in range(args.warmup + args.reps):
        synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        step(inputs[i % len(inputs)])
        synchronize(device)
        elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64, device=device)  # NCCL: on GPU
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= args.warmup:
            times.append(elapsed.item())
    return times


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def summary(times: list[float], tokens: int) -> dict:
    median = statistics.median(times)
    return {"times_s": times, "median_s": median, "tokens_per_s": tokens / median}


# ---------------------------------------------------------------------------------------------------
# FSDP2 training step


def fsdp_part(args, mesh, device, dtype) -> dict:
    from torch.distributed.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(args, device, dtype).train()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    inputs = input_sets(args, rank, device)

    def step(ids):
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        return loss.detach()

    def grad_norm() -> torch.Tensor:
        local = sum(p.grad.to_local().double().pow(2).sum() for p in model.parameters() if p.grad is not None)
        dist.all_reduce(local)
        return local.sqrt()

    def checked():
        losses = torch.stack([step(inputs[0]).double()])
        dist.all_reduce(losses)
        return losses / world, grad_norm()

    density = measured_density(model, lambda: step(inputs[0]))
    dense_loss, dense_norm = checked()
    dense = time_steps(step, inputs, args, device)
    twell.sparsify(model)
    twell_loss, twell_norm = checked()
    sparse = time_steps(step, inputs, args, device)
    tokens = args.batch * args.seq * world
    down = model.model.layers[0].mlp.down_proj.weight
    result = {
        "tokens_per_step": tokens,
        "tokens_per_rank": args.batch * args.seq,
        "measured_density": density,
        "rewritten": sum(r.rewritten for r in twell.report(model)),
        "dense": summary(dense, tokens),
        "twell": summary(sparse, tokens),
        "loss_rel_err": rel_err(twell_loss, dense_loss),
        "grad_norm_rel_err": rel_err(twell_norm, dense_norm),
        # FSDP gathers weights in the nn.Linear layout: the op's dense route on GPU (twell.distributed)
        "down_sharded_placements": [str(p) for p in down.placements],
    }
    result["speedup"] = result["dense"]["median_s"] / result["twell"]["median_s"]
    return result


# ---------------------------------------------------------------------------------------------------
# Tensor-parallel prefill


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


def tp_part(args, mesh, device, dtype) -> dict:
    from torch.distributed.tensor.parallel import parallelize_module

    model = build_model(args, device, dtype).eval()
    parallelize_module(model, mesh, tp_plan(model))
    inputs = input_sets(args, 0, device)  # the same tokens on every rank

    @torch.no_grad()
    def step(ids):
        return model.model(input_ids=ids, use_cache=False).last_hidden_state

    density = measured_density(model, lambda: step(inputs[0]))
    dense_out = step(inputs[0])
    dense = time_steps(step, inputs, args, device)
    twell.sparsify(model)
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
        "dense": summary(dense, tokens),
        "twell": summary(sparse, tokens),
        "last_hidden_rel_err": rel_err(twell_out, dense_out),
    }
    result["speedup"] = result["dense"]["median_s"] / result["twell"]["median_s"]
    return result


# ---------------------------------------------------------------------------------------------------
# Ranks


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
            "layer_config": dataclasses.asdict(policy.DEFAULT),  # what sparsify gives every rewritten FFN
        }
        parts = {"fsdp": fsdp_part, "tp": tp_part}
        for name in args.parts.split(","):
            result[name] = parts[name](args, mesh, device, dtype)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if rank == 0:
                r = result[name]
                print(
                    f"{name:>4}: dense {r['dense']['tokens_per_s']:>10.0f} tok/s, twell "
                    f"{r['twell']['tokens_per_s']:>10.0f} tok/s ({r['speedup']:.2f}x), density "
                    f"{r['measured_density']:.4f}, {r['rewritten']} FFNs rewritten",
                    flush=True,
                )
        if rank == 0:
            out = args.out or (None if args.smoke else "benchmarks/results")
            if out is not None:
                path = Path(out) / f"multigpu-{time.strftime('%Y%m%d-%H%M%S')}.json"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(result, indent=1))
                print(f"wrote {path}")
            else:
                print(json.dumps({k: v for k, v in result.items() if k in ("fsdp", "tp")}, indent=1))
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
