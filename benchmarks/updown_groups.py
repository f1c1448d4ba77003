"""Does the up+down kernel gather faster when each pass touches only a group of neurons whose weight rows
fit in L2? A measurement of the idea before it is built into the kernel.

At K=4096, N=14336 the up+down kernel moves its gathered W_u / W_d rows at ~5 TB/s (9.9 ms at 32768
tokens, uniform 0.5%: ffn-20261202-221207.json) against 8-9 TB/s at K=2048, where both matrices (46 MB)
fit the H200's L2 (~50 MB); at K=4096 they are 235 MB. Run as G passes, pass g over the TwELL tiles of
neuron group g only (the counts of the other tiles zeroed), each pass's rows are 235 / G MB. Each pass
here writes its own bf16 y and the passes' outputs are summed afterwards (a kernel built for it would
carry an fp32 partial of y between passes instead): the timing is the G up+down launches alone, the
summation left out, so it bounds what the built kernel can gain from below by its y traffic. The built
passes (launch_up_down(groups=G), LayerConfig.neuron_groups: y carried in fp32) are timed next to it, and
checked to give the one pass's bits on the rows both walk alike (rows past the row width whose passes each
fit it are walked in the built passes, by the heavy-row kernel in one pass: their error against the one
pass is recorded, and how many there are).

Run on a GPU:  PYTHONPATH=. python benchmarks/updown_groups.py [--shapes 4096x14336,2048x5632] [--groups 1,2,4,8]
JSON to benchmarks/results/ (or $OUT).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from ffn import environment, make_inputs, result_path, weights
from triton.testing import do_bench

from twell.kernels.gate import pack_dense
from twell.kernels.policy import SLOTS, TILE_N
from twell.kernels.updown import launch_up_down, row_width


def heavy_rows(counts: torch.Tensor, groups: int, width: int) -> torch.Tensor:
    """The rows the built passes leave to the heavy-row kernel: an overflowing tile, or more than `width`
    entries in some pass."""
    passes = torch.stack([part.sum(1) for part in group_counts(counts, groups)], 1)
    return (counts > SLOTS).any(1) | (passes > width).any(1)


def group_counts(counts: torch.Tensor, groups: int) -> list[torch.Tensor]:
    """counts [M, T] as `groups` copies, copy g keeping the tiles of the g-th contiguous range only."""
    tiles = counts.shape[1]
    bounds = [tiles * g // groups for g in range(groups + 1)]
    parts = []
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        part = torch.zeros_like(counts)
        part[:, lo:hi] = counts[:, lo:hi]
        parts.append(part)
    return parts


@torch.no_grad()
def point(k: int, n: int, m: int, density: float, pattern: str, group_list: list[int]) -> dict:
    x, block = make_inputs(m, k, n, density, pattern, seed=m + n)
    w = weights(block)
    wd_t = w["down_weight"].t().contiguous()
    pre = F.linear(x, w["gate_weight"], w["gate_bias"])
    words, counts = pack_dense(pre, 0.0, TILE_N, SLOTS)
    del pre
    args = (x, words)
    rest = (w["gate_weight"], w["gate_bias"], w["up_weight"], None, wd_t, None)

    def passes(parts):
        return [launch_up_down(*args, c, *rest, tile_n=TILE_N, threshold=0.0)[0] for c in parts]

    def built(groups):
        return launch_up_down(*args, counts, *rest, tile_n=TILE_N, threshold=0.0, groups=groups)[0]

    one_pass = passes([counts])[0]
    reference = one_pass.float()
    entries = counts.sum().item()
    row = {"K": k, "N": n, "M": m, "density": density, "pattern": pattern, "entries": entries, "groups": {}}
    for groups in group_list:
        parts = group_counts(counts, groups)
        y = torch.stack(passes(parts)).float().sum(0)
        err = ((y - reference).norm() / reference.norm()).item()
        ms = do_bench(lambda parts=parts: passes(parts), warmup=25, rep=100, return_mode="median")
        y_built = built(groups)
        heavy = heavy_rows(counts, groups, row_width(counts.shape[1], SLOTS))
        heavy_one = heavy_rows(counts, 1, row_width(counts.shape[1], SLOTS))
        alike = heavy == heavy_one
        same_bits = torch.equal(y_built[alike], one_pass[alike])
        built_err = ((y_built.float() - reference).norm() / reference.norm()).item()
        del y_built
        built_ms = do_bench(lambda groups=groups: built(groups), warmup=25, rep=100, return_mode="median")
        gathered = entries * 2 * k * x.element_size()  # W_u and W_d rows a kept entry
        row["groups"][str(groups)] = {
            "ms": ms, "gather_tb_s": gathered / ms / 1e9, "rel_err": err, "built_ms": built_ms,
            "built_gather_tb_s": gathered / built_ms / 1e9, "built_same_bits": same_bits, "built_rel_err": built_err,
            "heavy_rows_one_pass": int(heavy_one.sum()), "rows_walked_in_passes": int((heavy_one & ~heavy).sum()),
        }  # fmt: skip
        bits = "the same bits" if same_bits else "OTHER BITS"
        bits += f" where walked alike, {built_err:.1e} from one pass ({int((heavy_one & ~heavy).sum())} rows walked"
        bits += f" in the passes of {int(heavy_one.sum())} heavy in one)"
        print(f"K={k} N={n} M={m} {pattern} {density}: {groups} passes {ms:.3f} ms "
              f"({gathered / ms / 1e9:.2f} TB/s of gathered rows), sum vs one pass {err:.1e}; built "
              f"{built_ms:.3f} ms ({gathered / built_ms / 1e9:.2f} TB/s), {bits}", flush=True)  # fmt: skip
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="4096x14336,2048x5632")
    parser.add_argument("--ms", default="32768")
    parser.add_argument("--patterns", default="uniform,skewed")
    parser.add_argument("--density", type=float, default=0.005)
    parser.add_argument("--groups", default="1,2,4,8,16")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    result = {**environment(), "points": []}
    path = result_path(args.out, "updown_groups")
    group_list = [int(g) for g in args.groups.split(",")]
    for shape in args.shapes.split(","):
        k, n = map(int, shape.split("x"))
        for m in map(int, args.ms.split(",")):
            for pattern in args.patterns.split(","):
                result["points"].append(point(k, n, m, args.density, pattern, group_list))
                path.write_text(json.dumps(result, indent=1))
                torch.cuda.empty_cache()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
