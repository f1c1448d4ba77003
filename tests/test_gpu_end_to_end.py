"""On the GPU: a sparsified bf16 Llama runs through the Triton paths and matches the untouched model."""

import copy

import pytest
import torch
from conftest import rel_err

import twell
from twell.kernels import dispatch, policy


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 300], ids=["decode", "prefill"])
def test_sparsified_llama_matches_on_gpu(monkeypatch, tokens):
    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(policy, "DECODE_MAX_M", 64)
    monkeypatch.setattr(policy, "PREFILL_MIN_M", 65)
    dispatch._dense_calls_left.clear()
    calls = []
    monkeypatch.setattr(dispatch, "decode_up_down", lambda *a, **k: calls.append("decode") or decode(*a, **k))
    monkeypatch.setattr(dispatch, "twell_up_down", lambda *a, **k: calls.append("prefill") or updown(*a, **k))
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        hidden_act="relu",
        mlp_bias=True,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    for layer in model.model.layers:  # a negative gate bias makes the ReLU gate sparse (~2% active)
        torch.nn.init.constant_(layer.mlp.gate_proj.bias, -0.65)
    model = model.to("cuda", torch.bfloat16)
    untouched = copy.deepcopy(model)
    twell.sparsify(model)
    ids = torch.randint(0, 128, (1, tokens), device="cuda")
    with torch.no_grad():
        ref = untouched(ids).logits.float()
        out = model(ids).logits.float()
    assert calls and set(calls) == {"decode" if tokens == 1 else "prefill"}
    assert rel_err(out, ref) <= 2e-2


decode = dispatch.decode_up_down
updown = dispatch.twell_up_down
