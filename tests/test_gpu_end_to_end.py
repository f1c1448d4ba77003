"""On the GPU: a sparsified bf16 Llama runs through the Triton paths and matches the untouched model."""

import copy

import pytest
import torch
from conftest import rel_err
from ffn_cases import GatedBlock

import twell
from twell.kernels import dispatch


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 300], ids=["decode", "prefill"])
def test_sparsified_llama_matches_on_gpu(monkeypatch, tokens):
    transformers = pytest.importorskip("transformers")
    dispatch.forget_layers()
    calls = []
    monkeypatch.setattr(dispatch, "launch_decode", lambda *a, **k: calls.append("decode") or decode(*a, **k))
    monkeypatch.setattr(dispatch, "launch_up_down", lambda *a, **k: calls.append("prefill") or updown(*a, **k))
    model = _tiny_llama(transformers)
    untouched = copy.deepcopy(model)
    twell.sparsify(model, layer_config={"decode_max_m": 64, "prefill_min_m": 65})
    ids = torch.randint(0, 128, (1, tokens), device="cuda")
    with torch.no_grad():
        ref = untouched(ids).logits.float()
        out = model(ids).logits.float()
    assert calls and set(calls) == {"decode" if tokens == 1 else "prefill"}
    assert rel_err(out, ref) <= 2e-2


decode = dispatch.launch_decode
updown = dispatch.launch_up_down


def _tiny_llama(transformers):
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
    return model.to("cuda", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_sparsified_llama_generates_the_same_tokens(monkeypatch, cache):
    """Greedy generation, the prompt through the prefill kernels and every step through the decode
    kernels (with a static cache transformers compiles the step, CUDA graphs included): the same
    tokens as the untouched model."""
    transformers = pytest.importorskip("transformers")
    dispatch.forget_layers()
    calls = []
    monkeypatch.setattr(dispatch, "launch_decode", lambda *a, **k: calls.append("decode") or decode(*a, **k))
    monkeypatch.setattr(dispatch, "launch_up_down", lambda *a, **k: calls.append("prefill") or updown(*a, **k))
    model = _tiny_llama(transformers)
    untouched = copy.deepcopy(model)
    twell.sparsify(model, layer_config={"prefill_min_m": 65})
    prompt = torch.randint(0, 128, (2, 40), device="cuda")  # 80 tokens: the prefill path
    kwargs = {"max_new_tokens": 12, "min_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    with torch.no_grad():
        ref = untouched.generate(prompt, **kwargs)
        out = model.generate(prompt, **kwargs)
    assert "prefill" in calls and ("decode" in calls or cache == "static")  # compiled steps run inside graphs
    assert torch.equal(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16], ids=["m1", "m16"])
def test_sparsified_forward_copies_no_weight(tokens):
    """The rewritten module's forward allocates nothing weight-sized (no per-call re-layout of W_down)."""
    k, n = 1024, 4096
    block = GatedBlock(k, n).to("cuda", torch.bfloat16).eval()
    twell.sparsify(block)
    assert twell.report(block).summary()["rewritten"] == 1
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        block(x)  # compile and tune outside the measured call
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        block(x)
        torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < k * n * 2 // 4


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 300], ids=["decode", "prefill"])
def test_sparse_paths_capture_in_cuda_graphs_and_compile_whole(monkeypatch, tokens):
    """No host synchronisation on either sparse path: a CUDA-graph capture of the module replays to the
    eager result, and torch.compile(fullgraph=True) traces it without a graph break."""
    dispatch.forget_layers()
    calls = []
    monkeypatch.setattr(dispatch, "launch_decode", lambda *a, **k: calls.append("decode") or decode(*a, **k))
    monkeypatch.setattr(dispatch, "launch_up_down", lambda *a, **k: calls.append("prefill") or updown(*a, **k))
    torch.manual_seed(0)
    block = GatedBlock(256, 1024).to("cuda", torch.bfloat16).eval()
    torch.nn.init.constant_(block.mlp.gate_proj.bias, -0.05)
    twell.sparsify(block, layer_config={"decode_max_m": 8, "prefill_min_m": 257})
    x = torch.randn(tokens, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        eager = block(x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = block(x)
        graph.replay()
        torch.cuda.synchronize()
        compiled = torch.compile(block, fullgraph=True)(x)
    assert set(calls) == {"decode" if tokens == 1 else "prefill"}
    assert torch.equal(captured, eager)
    assert rel_err(compiled, eager) <= 1e-2
