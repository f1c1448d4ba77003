"""Compile a model with the "twell" torch.compile backend.

The backend rewrites every ReLU-gated FFN in the captured graph to a torch.ops.twell call, then compiles
with Inductor. It needs no calibration and leaves the model object untouched; to follow calibration
decisions instead, pass options={"plan": "plan.json"}, or sparsify the model with its calibration data
or plan first. twell.compile_report(model) says what the backend did. For the default backend, pass
twell.passes.backend.TwellInductorPass(plan=...) as options={"pre_grad_custom_pass": ...}. On the CPU,
Inductor needs a C++ compiler.

    python examples/compile_with_backend.py
"""

import torch
import transformers

import twell


def main() -> None:
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_act="relu",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids).logits

        # The backend name "twell" is registered by an entry point of the installed package.
        compiled = torch.compile(model, backend="twell")
        torch.testing.assert_close(compiled(ids).logits, expected, rtol=1e-5, atol=1e-5)
    print("torch.compile(model, backend='twell'): logits match")
    print(twell.compile_report(model))


if __name__ == "__main__":
    main()
