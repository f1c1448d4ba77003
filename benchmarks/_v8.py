"""scratch: v8c heavy-row split variants (not committed)"""
import json, os, sys, time
from pathlib import Path
import torch, torch.nn.functional as F, triton
from triton.testing import do_bench
sys.path.insert(0, os.path.dirname(__file__))
from ffn import make_inputs, weights
import twell
from twell.kernels import gate, updown
from twell.kernels.gate import pack_dense

torch.backends.cuda.matmul.allow_tf32 = False
rows = []
def bench(f):
    return do_bench(f, warmup=10, rep=60, return_mode="median")
for k, n, m, pattern in [(2048, 5632, 131072, "exact"), (2048, 5632, 131072, "uniform"), (2048, 5632, 131072, "skewed"),
                         (2048, 5632, 8192, "uniform"), (2048, 5632, 8192, "exact"), (2048, 5632, 32768, "uniform"), (2048, 5632, 4096, "uniform"),
                         (4096, 14336, 65536, "uniform"), (4096, 14336, 8192, "uniform")]:
    x, block = make_inputs(m, k, n, 0.005, pattern, seed=m + n)
    with torch.no_grad():
        dense = bench(lambda: block(x))
        twell.sparsify(block)
        w = weights(block)
        wg, bg, wu, wdt = w["gate_weight"], w["gate_bias"], w["up_weight"], w["down_weight"].t()
        pre = F.linear(x, wg, bg)
        cub = bench(lambda: F.linear(x, wg, bg))
        v, i, c = pack_dense(pre, 0.0, 128, 16)
        pk = bench(lambda: pack_dense(pre, 0.0, 128, 16))
        args = (x, v, i, c, wg, bg, wu, None, wdt, None)
        ref = (F.relu(pre.double()) * F.linear(x.double(), wu.double())) @ wdt.double()
        row = dict(K=k, N=n, M=m, pattern=pattern, dense=dense, cublas=cub, pack=pk, updown={})
        best = 1e9
        for width in (256, 128, 64):
            for splits in (4, 8, 16):
                for order in (True, False):
                    if not order and (width, splits) != (256, 8):
                        continue
                    updown.MAX_WIDTH, updown.SPLITS = width, splits
                    out = updown.twell_up_down(*args, tile_n=128, threshold=0.0, order=order)
                    err = ((out.double() - ref).norm() / ref.norm()).item()
                    again = updown.twell_up_down(*args, tile_n=128, threshold=0.0, order=order)
                    t = bench(lambda: updown.twell_up_down(*args, tile_n=128, threshold=0.0, order=order))
                    best = min(best, t)
                    row["updown"][f"w{width}-s{splits}-o{int(order)}"] = (t, err, torch.equal(out, again))
                    print(f"  width {width} splits {splits} order {order}: {t:.3f} ms err {err:.1e} deterministic {torch.equal(out, again)}", flush=True)
        print(f"{k}x{n} M={m} {pattern}: dense {dense:.3f} cublas {cub:.3f} pack {pk:.3f} updown(best) {best:.3f} "
              f"-> {dense / (cub + pk + best):.2f}x   pairs/row {c.sum().item()/m:.1f} maxrow {c.sum(1).max().item()}", flush=True)
        rows.append(row)
        del x, block, pre, v, i, c, ref
out = Path(os.environ.get("OUT", "benchmarks/results"))
out.mkdir(parents=True, exist_ok=True)
(out / f"gpu_check-v8c-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(json.dumps({"commit": os.environ.get("TWELL_COMMIT"), "rows": rows}, indent=1))
