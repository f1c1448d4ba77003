"""Sparsify a Hugging Face model and check that its logits do not change.

The model is a tiny ReLU-gated Llama built from a config, with random weights: nothing is downloaded.
With a real checkpoint, load it with AutoModelForCausalLM.from_pretrained instead; the rest is the same.

    python examples/sparsify_hf_model.py
"""

import torch
import transformers

import twell


def build_model() -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_act="relu",  # twell rewrites ReLU-gated FFNs; a SiLU model is reported, not rewritten
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def main() -> None:
    model = build_model()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids).logits

    twell.sparsify(model)  # in place: every ReLU-gated FFN now calls torch.ops.twell.gated_ffn
    print(twell.report(model))
    with torch.no_grad():
        actual = model(ids).logits
    # Exact up to float rounding: on a CUDA GPU the Triton kernels run, elsewhere plain PyTorch.
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    print(f"logits match: max difference {(actual - expected).abs().max().item():.2e}")

    twell.restore(model)  # the original modules back, state_dict bit for bit
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected)
    print("restored")


if __name__ == "__main__":
    main()
