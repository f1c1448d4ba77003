"""Regenerate twell's built-in demo model (twell/demo/): a tiny ReLU-gated Llama with sparse FFNs.

    python examples/make_demo_model.py            # writes twell/demo/{config.json,model.safetensors}

The model is untrained; its FFN sparsity is built into the weights so that `twell report` has
something real to measure. How:

- A "bias channel": every token embedding holds a large constant in channel 0, and no attention or
  FFN output writes to that channel (row 0 of o_proj and down_proj is zero), so after each RMSNorm
  channel 0 is a near-constant positive value. Column 0 of gate_proj then acts as a per-neuron bias.
- Each neuron gets a target firing rate: log-normal around the layer's mean density (real sparse
  models have skewed rates), and a share of neurons is dead (never fires). Layer by layer, the
  script measures the gate pre-activations on random byte tokens and sets the bias column to the
  quantile that gives each neuron its rate. The layers span both sides of twell's CPU break-even
  density (about 0.9%), so the report shows both decisions.

Deterministic: a fixed seed, CPU float32 arithmetic, stored as float16 (about 1.7 MB).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

SEED = 0
# Mean density (fraction of active neurons per token) of each layer's ReLU gate.
LAYER_DENSITIES = (0.003, 0.006, 0.016, 0.04)
DEAD_FRACTIONS = (0.25, 0.2, 0.1, 0.05)
BIAS_CHANNEL_VALUE = 4.0
CALIBRATION_TOKENS = (16, 128)  # [batch, seq] of random bytes used to place the biases
OUT_DIR = Path(__file__).resolve().parent.parent / "twell" / "demo"


def demo_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=256,  # byte-level: the CLI feeds raw UTF-8 bytes when a checkpoint has no tokenizer
        hidden_size=64,
        intermediate_size=1024,
        num_hidden_layers=len(LAYER_DENSITIES),
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_act="relu",
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def _neuron_rates(n: int, density: float, dead_fraction: float, gen: torch.Generator) -> torch.Tensor:
    """Per-neuron firing rates with mean `density`, skewed (log-normal), some exactly 0 (dead)."""
    rates = torch.exp(torch.randn(n, generator=gen, dtype=torch.float64))
    dead = torch.rand(n, generator=gen, dtype=torch.float64) < dead_fraction
    rates = rates.masked_fill(dead, 0.0)
    return (rates * density * n / rates.sum()).clamp(max=0.5)


def _ffn_inputs(model, mlp, tokens) -> torch.Tensor:
    """[tokens, hidden]: what `mlp` receives when the model runs on `tokens`."""
    captured = []
    handle = mlp.register_forward_pre_hook(lambda _module, args: captured.append(args[0]))
    try:
        model(tokens)
    finally:
        handle.remove()
    return captured[0].reshape(-1, captured[0].shape[-1])


@torch.no_grad()
def build_demo_model():
    """The demo LlamaForCausalLM (float32, eval mode), deterministic for a given torch version."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(SEED)
    gen = torch.Generator().manual_seed(SEED)
    model = LlamaForCausalLM(demo_config()).eval()
    embed = model.model.embed_tokens.weight
    embed.normal_(0.0, 1.0, generator=gen)
    embed[:, 0] = BIAS_CHANNEL_VALUE
    tokens = torch.randint(0, embed.shape[0], CALIBRATION_TOKENS, generator=gen)

    for layer, density, dead_fraction in zip(model.model.layers, LAYER_DENSITIES, DEAD_FRACTIONS, strict=True):
        layer.self_attn.o_proj.weight[0].zero_()
        mlp = layer.mlp
        mlp.down_proj.weight[0].zero_()
        gate = mlp.gate_proj.weight
        n, k = gate.shape
        gate.normal_(0.0, k**-0.5, generator=gen)
        gate[:, 0] = 0.0

        x = _ffn_inputs(model, mlp, tokens).double()
        # Pre-activation per unit of the bias channel: the neuron fires where z > -bias * x0.
        z = (x @ gate.double().t()) / x[:, :1]
        rates = _neuron_rates(n, density, dead_fraction, gen)
        # The (1 - rate) quantile of z fires `rate` of the tokens; dead neurons sit past the maximum.
        ordered = z.sort(dim=0).values
        rank = ((1.0 - rates) * (z.shape[0] - 1)).round().long()
        cutoff = ordered[rank, torch.arange(n)]
        cutoff = torch.where(rates > 0, cutoff, ordered[-1] + z.std(dim=0) * 4)
        gate[:, 0] = (-cutoff).float()
    return model


def save_demo_model(out_dir: Path) -> None:
    model = build_demo_model().to(torch.float16)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    for stale in ("generation_config.json",):
        (out_dir / stale).unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT_DIR, help=f"output directory (default {OUT_DIR})")
    save_demo_model(parser.parse_args().out)


if __name__ == "__main__":
    main()
