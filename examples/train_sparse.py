"""Train a small ReLU Llama with the L1 activation penalty until its FFNs are more than 99% sparse.

    python examples/train_sparse.py                    # L1 run, then an L1 = 0 run, compare
    python examples/train_sparse.py --save twell/demo  # what made twell's built-in demo model

Corpus: the Python standard library's source files (every machine has them), read as bytes (vocabulary
256), files in sorted path order; the last 5% of the bytes are held out. The model is a 4-layer Llama
(hidden 64, ReLU-gated FFNs of width 1024) trained with AdamW; the loss is the language-model loss plus
lambda * twell.train.l1_penalty(model), with lambda warmed up linearly over the first part of training
so the model first learns, then sparsifies. Each batch also holds a few rows of uniformly random
bytes, left out of the language-model loss but inside the penalty: the model learns to stay sparse on
input unlike its corpus too, which is what `twell report` measures without --data. Runs on the GPU
when there is one, else the CPU.

Prints progress (rich), then for both runs the held-out loss and each FFN's density (fraction of the
hidden activation h that is nonzero), measured on held-out text and on random bytes: the difference
in loss is what the sparsity costs. On a GPU it then times one training step of the L1 model as
trained (dense) beside the same model after twell.sparsify with the sparse training path on
(LayerConfig train_min_m=1: the forward keeps a compact record of h, the backward is sparse too).
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import twell
import twell.train

SEED = 0
HELD_OUT = 0.05


@dataclass
class Settings:
    steps: int = 1200
    l1: float = 60.0  # lambda at the end of its warm-up
    l1_warmup: float = 0.3  # fraction of the steps over which lambda rises from 0
    batch_size: int = 16  # rows of text per step
    random_rows: int = 4  # rows of random bytes per step (penalised, not in the language-model loss)
    seq_len: int = 128
    lr: float = 3e-3
    corpus_mb: float = 8.0
    hidden_size: int = 64
    intermediate_size: int = 1024
    layers: int = 4
    seed: int = SEED
    log_every: int = 50
    eval_batches: int = 8


@dataclass
class Result:
    model: torch.nn.Module
    loss: float  # held-out language-model loss, nats per byte
    density: dict[str, float]  # FFN path -> fraction of h nonzero on held-out text
    random_density: dict[str, float]  # the same on random bytes
    history: list[dict] = field(default_factory=list)  # logged training steps
    seconds: float = 0.0

    @property
    def mean_density(self) -> float:
        return sum(self.density.values()) / len(self.density)

    @property
    def mean_random_density(self) -> float:
        return sum(self.random_density.values()) / len(self.random_density)


def corpus(limit_bytes: int) -> torch.Tensor:
    """Bytes of the standard library's .py files in sorted path order (tests excluded), up to limit_bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).parts
        if relative[0] in ("site-packages", "dist-packages") or any(p in ("test", "tests") for p in relative):
            continue
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit_bytes:
            break
    if total < 1 << 16:
        raise RuntimeError(f"found only {total} bytes of Python source under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit_bytes]), dtype=torch.uint8).long()


def build_model(settings: Settings):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,  # bytes
        hidden_size=settings.hidden_size,
        intermediate_size=settings.intermediate_size,
        num_hidden_layers=settings.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_act="relu",
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(settings.seed)
    return LlamaForCausalLM(config)


def windows(data: torch.Tensor, count: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """[count, seq_len] random windows of `data`."""
    starts = torch.randint(0, len(data) - seq_len, (count,), generator=gen)
    return torch.stack([data[s : s + seq_len] for s in starts.tolist()])


def training_batch(data: torch.Tensor, settings: Settings, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, labels) [batch_size + random_rows, seq_len]: text windows, then random bytes labelled -100
    (ignored by the loss)."""
    text = windows(data, settings.batch_size, settings.seq_len, gen)
    noise = torch.randint(0, 256, (settings.random_rows, settings.seq_len), generator=gen)
    ignored = torch.full_like(noise, -100)
    return torch.cat([text, noise]), torch.cat([text, ignored])


def l1_weight(step: int, settings: Settings) -> float:
    warmup = max(1, round(settings.l1_warmup * settings.steps))
    return settings.l1 * min(1.0, step / warmup)


def lr_at(step: int, settings: Settings) -> float:
    """Linear warm-up over 5% of the steps, then cosine decay to 10%."""
    warmup = max(1, settings.steps // 20)
    if step < warmup:
        return settings.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, settings.steps - warmup)
    return settings.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def _mean(densities: list[dict[str, float]]) -> dict[str, float]:
    return {path: sum(d[path] for d in densities) / len(densities) for path in densities[0]}


@torch.no_grad()
def evaluate(model, data: torch.Tensor, settings: Settings, device) -> tuple[float, dict[str, float], dict[str, float]]:
    """Held-out loss (nats per byte) and per-FFN density over fixed windows of `data`, and per-FFN
    density on random bytes."""
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(settings.seed + 1)
    losses, densities, random_densities = [], [], []
    with twell.train.track_l1(model) as tracker:
        for _ in range(settings.eval_batches):
            ids = windows(data, settings.batch_size, settings.seq_len, gen).to(device)
            losses.append(model(ids, labels=ids).loss.item())
            densities.append(tracker.density())
            model(torch.randint(0, 256, (settings.batch_size, settings.seq_len), generator=gen).to(device))
            random_densities.append(tracker.density())
    model.train(was_training)
    return sum(losses) / len(losses), _mean(densities), _mean(random_densities)


def train(settings: Settings, data: torch.Tensor, device, *, progress=None, label: str = "") -> Result:
    """Train a fresh model on data[: held-out split] with the L1 schedule of `settings`; evaluate on the rest."""
    split = int(len(data) * (1 - HELD_OUT))
    train_data, held_out = data[:split], data[split:]
    model = build_model(settings).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.0, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(settings.seed)
    history = []
    task = progress.add_task(label, total=settings.steps) if progress is not None else None
    start = time.perf_counter()
    with twell.train.track_l1(model) as tracker:
        for step in range(settings.steps):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, settings)
            ids, labels = (t.to(device) for t in training_batch(train_data, settings, gen))
            lm_loss = model(ids, labels=labels).loss
            penalty = twell.train.l1_penalty(model)
            lam = l1_weight(step, settings)
            loss = lm_loss + lam * penalty if lam > 0 else lm_loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            if step % settings.log_every == 0 or step == settings.steps - 1:
                density = tracker.density()
                history.append(
                    {
                        "step": step,
                        "loss": lm_loss.item(),
                        "l1": penalty.item(),
                        "lambda": lam,
                        "density": list(density.values()),
                    }
                )
                if progress is not None:
                    mean = sum(density.values()) / len(density)
                    progress.console.print(
                        f"{label} step {step:5d}  loss {lm_loss.item():.3f}  l1 {penalty.item():.2e}  "
                        f"lambda {lam:.2g}  density {mean:6.2%}  per layer "
                        + " ".join(f"{d:.2%}" for d in density.values())
                    )
            if progress is not None:
                progress.advance(task)
    seconds = time.perf_counter() - start
    loss, density, random_density = evaluate(model, held_out, settings, device)
    return Result(model.eval(), loss, density, random_density, history, seconds)


def step_times(model, data: torch.Tensor, settings: Settings, steps: int = 20) -> dict[str, float]:
    """Median ms (host clock, synchronised) of one training step (forward, language-model loss + L1
    penalty, backward, AdamW) on copies of `model` (on a GPU): dense, and sparsified with the sparse
    training path. The optimizer's learning rate is 0, so every step sees the same weights."""
    device = next(model.parameters()).device
    ids, labels = (t.to(device) for t in training_batch(data, settings, torch.Generator().manual_seed(settings.seed)))
    times = {}
    for label in ("dense", "twell sparse"):
        copied = copy.deepcopy(model).train()
        if label != "dense":
            twell.sparsify(copied, layer_config={"train_min_m": 1})
        optimizer = torch.optim.AdamW(copied.parameters(), lr=0.0)
        with twell.train.track_l1(copied):
            samples = []
            for i in range(steps + 3):  # 3 untimed: autotuning and warm-up
                start = time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                loss = copied(ids, labels=labels).loss + settings.l1 * twell.train.l1_penalty(copied)
                loss.backward()
                optimizer.step()
                torch.cuda.synchronize()
                if i >= 3:
                    samples.append(time.perf_counter() - start)
        times[label] = statistics.median(samples) * 1e3
    return times


def save(result: Result, out: Path) -> None:
    """The model in float16 (safetensors), as twell's demo model directory holds it."""
    out.mkdir(parents=True, exist_ok=True)
    model = result.model.to("cpu", torch.float16)
    model.save_pretrained(out)
    (out / "generation_config.json").unlink(missing_ok=True)


def main() -> None:
    defaults = Settings()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=defaults.steps, help=f"training steps (default {defaults.steps})")
    parser.add_argument("--l1", type=float, default=defaults.l1, help=f"lambda after warm-up (default {defaults.l1})")
    parser.add_argument(
        "--l1-warmup", type=float, default=defaults.l1_warmup, help="fraction of steps to warm up lambda"
    )
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size, help="rows of text per step")
    parser.add_argument("--random-rows", type=int, default=defaults.random_rows, help="rows of random bytes per step")
    parser.add_argument("--seq-len", type=int, default=defaults.seq_len)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--no-baseline", action="store_true", help="skip the L1 = 0 comparison run")
    parser.add_argument("--save", type=Path, help="write the L1-trained model here (float16 safetensors)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.table import Table

    settings = Settings(
        steps=args.steps,
        l1=args.l1,
        l1_warmup=args.l1_warmup,
        batch_size=args.batch_size,
        random_rows=args.random_rows,
        seq_len=args.seq_len,
        lr=args.lr,
        seed=args.seed,
    )
    console = Console()
    data = corpus(int(settings.corpus_mb * 2**20))
    console.print(f"corpus: {len(data) / 2**20:.1f} MB of standard-library source, device {args.device}, {settings}")
    runs = [("L1", settings)]
    if not args.no_baseline:
        runs.append(("L1=0", Settings(**{**settings.__dict__, "l1": 0.0})))
    results = {}
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console) as progress:
        for label, run_settings in runs:
            results[label] = train(run_settings, data, args.device, progress=progress, label=label)

    table = Table(title="held-out text (loss in nats per byte), and random bytes", title_justify="left")
    table.add_column("run")
    table.add_column("loss", justify="right")
    table.add_column("density", justify="right")
    table.add_column("per layer", justify="right")
    table.add_column("density (random)", justify="right")
    table.add_column("per layer (random)", justify="right")
    table.add_column("train time", justify="right")
    for label, result in results.items():
        table.add_row(
            label,
            f"{result.loss:.4f}",
            f"{result.mean_density:.2%}",
            " ".join(f"{d:.2%}" for d in result.density.values()),
            f"{result.mean_random_density:.2%}",
            " ".join(f"{d:.2%}" for d in result.random_density.values()),
            f"{result.seconds / 60:.1f} min",
        )
    console.print(table)
    if "L1=0" in results:
        cost = results["L1"].loss - results["L1=0"].loss
        console.print(f"loss cost of sparsity: {cost:+.4f} nats per byte")
    if torch.device(args.device).type == "cuda":
        times = step_times(results["L1"].model, data, settings)
        tokens = (settings.batch_size + settings.random_rows) * settings.seq_len
        console.print(
            f"training step of the L1 model ({tokens} tokens): dense {times['dense']:.2f} ms, twell sparse "
            f"training path {times['twell sparse']:.2f} ms ({times['dense'] / times['twell sparse']:.2f}x)"
        )
    if args.save is not None:
        save(results["L1"], args.save)
        console.print(f"saved the L1 model to {args.save}")


if __name__ == "__main__":
    main()
