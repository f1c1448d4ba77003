"""How much weight-row reuse real activations offer a block-sparse design: the built-in demo model on
Python source (files of this Python's own standard library), consecutive tokens against the same tokens
in random order.

    PYTHONPATH=. python benchmarks/reuse.py [--files 40] [--blocks 16,64,128]     (CPU is enough)

The gather design (twell's up+down kernel) fetches two weight rows for every active (token, neuron)
pair. A design that computes, per block of B tokens, each neuron active in the block once (a small
dense product over the block's union) fetches them once per (block, neuron). Per layer and block size
this reports: pairs per token, the block's union per token, their ratio (the reuse factor: rows
fetched by gathers over rows fetched once per block) and the share of pairs whose neuron fires in at
least 2 / 4 tokens of its block (what a per-block hot set would compute densely). "shuffled" draws the
same tokens in random order: what uniform, independent rates would give. JSON to
benchmarks/results/reuse-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from ffn import environment, result_path  # noqa: E402

from twell.loading import load_model  # noqa: E402


def stdlib_text(files: int) -> str:
    """The last `files` .py files of the standard library in sorted path order (test folders left
    out): text the demo model did not train on (it trained on the first 8 MB)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(p for p in root.rglob("*.py") if "test" not in p.parts and "tests" not in p.parts)
    return "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in paths[-files:])


def hidden_activations(model, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's FFN hidden activation h [tokens, N] (the down projection's input) for a batch of
    token windows, rows in token order."""
    captured = []
    hooks = [
        layer.mlp.down_proj.register_forward_pre_hook(lambda _m, args: captured.append(args[0].detach()))
        for layer in model.model.layers
    ]
    try:
        with torch.no_grad():
            model(tokens)
    finally:
        for hook in hooks:
            hook.remove()
    return [h.reshape(-1, h.shape[-1]) for h in captured]


def block_stats(active: torch.Tensor, block: int) -> dict:
    """Reuse statistics of a [M, N] bool activity matrix cut into row blocks of `block` (M a multiple)."""
    m, n = active.shape
    per_block = active[: m // block * block].view(-1, block, n)
    fires = per_block.sum(1)  # [blocks, N]: tokens of the block each neuron fires in
    pairs = fires.sum().item()
    union = (fires > 0).sum().item()
    tokens = per_block.shape[0] * block
    return {
        "pairs_per_token": pairs / tokens,
        "union_per_token": union / tokens,
        "reuse": pairs / max(union, 1),
        "pairs_in_2plus": (fires * (fires >= 2)).sum().item() / max(pairs, 1),
        "pairs_in_4plus": (fires * (fires >= 4)).sum().item() / max(pairs, 1),
        "union_share_of_n": union / (per_block.shape[0] * n),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=40, help="standard-library files of text")
    parser.add_argument("--seq", type=int, default=128, help="tokens a window (the demo model's training length)")
    parser.add_argument("--windows", type=int, default=64)
    parser.add_argument("--blocks", default="16,64,128")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    torch.manual_seed(0)
    loaded = load_model()
    stream = list(stdlib_text(args.files).encode("utf-8"))
    need = args.seq * args.windows
    if len(stream) < need:
        raise SystemExit(f"{len(stream)} bytes of text, {need} needed: raise --files")
    tokens = torch.tensor(stream[:need]).view(args.windows, args.seq) % loaded.vocab_size
    layers = hidden_activations(loaded.model.float(), tokens)
    blocks = [int(b) for b in args.blocks.split(",")]
    result = {**environment(), "model": loaded.name, "tokens": need, "layers": []}
    print(f"{'layer':>5} {'order':>9} {'B':>4} {'pairs/tok':>9} {'union/tok':>9} {'reuse':>6} {'in2+':>6} {'in4+':>6}")
    for index, h in enumerate(layers):
        active = h != 0
        shuffled = active[torch.randperm(active.shape[0])]
        row = {"layer": index, "N": active.shape[1], "density": active.float().mean().item(), "blocks": []}
        for block in blocks:
            for order, matrix in (("in order", active), ("shuffled", shuffled)):
                stats = {"block": block, "order": order, **block_stats(matrix, block)}
                row["blocks"].append(stats)
                numbers = ("pairs_per_token", "union_per_token", "reuse", "pairs_in_2plus", "pairs_in_4plus")
                print(f"{index:>5} {order:>9} {block:>4} " + " ".join(f"{stats[k]:>9.2f}" for k in numbers))
        result["layers"].append(row)
    path = result_path(args.out, "reuse")
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path} ({time.strftime('%H:%M:%S')})")


if __name__ == "__main__":
    main()
