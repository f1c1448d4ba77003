"""torch.compile(backend="twell") and the Inductor custom pass, on the CPU (Inductor's C++ backend)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from models import DEFAULT_NOT_RELU, FAMILIES, LAYERS, build, logits, modules_of, token_ids
from torch import nn

import twell
from twell.kernels import reference
from twell.passes.backend import TwellInductorPass

transformers = pytest.importorskip("transformers")


@pytest.fixture
def op_calls(monkeypatch):
    """Counts calls of the ops' CPU implementations: proves the compiled graph runs twell ops."""
    calls = {"gated_ffn": 0, "ffn": 0}

    def counting(name):
        original = getattr(reference, name)

        def wrapper(*args, **kwargs):
            calls[name] += 1
            return original(*args, **kwargs)

        return wrapper

    for name in calls:
        monkeypatch.setattr(reference, name, counting(name))
    torch._dynamo.reset()
    yield calls
    torch._dynamo.reset()


def _op(family: str) -> str:
    return "gated_ffn" if FAMILIES[family][4] == "gated" else "ffn"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_twell_backend_fullgraph(family, op_calls):
    model = build(family, num_hidden_layers=1)  # one layer: Inductor's CPU compile time grows with the graph
    ids = token_ids()
    expected = logits(model, ids)
    layout = modules_of(model)
    compiled = torch.compile(model, backend="twell", fullgraph=True)
    torch.testing.assert_close(logits(compiled, ids), expected, atol=1e-5, rtol=1e-5)
    assert op_calls[_op(family)] == 1
    assert modules_of(model) == layout  # the backend rewrites the graph, not the model


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_twell_backend_leaves_non_relu_alone(family, op_calls):
    model = build(family, activation=None, num_hidden_layers=1)
    assert family in DEFAULT_NOT_RELU
    ids = token_ids()
    expected = logits(model, ids)
    torch.testing.assert_close(logits(torch.compile(model, backend="twell", fullgraph=True), ids), expected)
    assert op_calls == {"gated_ffn": 0, "ffn": 0}


@pytest.mark.parametrize("family", ["phi3", "opt", "gpt2"])
def test_inductor_custom_pass(family, op_calls):
    model = build(family)
    ids = token_ids()
    expected = logits(model, ids)
    before = torch._inductor.config.post_grad_custom_pre_pass
    compiled = torch.compile(model, fullgraph=True, options={"post_grad_custom_pre_pass": TwellInductorPass()})
    torch.testing.assert_close(logits(compiled, ids), expected, atol=1e-5, rtol=1e-5)
    assert op_calls[_op(family)] == LAYERS
    assert torch._inductor.config.post_grad_custom_pre_pass is before  # scoped to that compilation


def test_sparsified_model_compiles_with_default_backend(op_calls):
    model = build("llama")
    ids = token_ids()
    expected = logits(model, ids)
    twell.sparsify(model)
    op_calls["gated_ffn"] = 0
    compiled = torch.compile(model, fullgraph=True)
    torch.testing.assert_close(logits(compiled, ids), expected, atol=1e-5, rtol=1e-5)
    assert op_calls["gated_ffn"] == LAYERS


class GatedFFN(nn.Module):
    def __init__(self):
        super().__init__()
        self.w_gate, self.w_up, self.w_down = nn.Linear(16, 48), nn.Linear(16, 48), nn.Linear(48, 16)

    def forward(self, x):
        return self.w_down(F.relu(self.w_gate(x)) * self.w_up(x))


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.ffn = GatedFFN()

    def forward(self, x):
        return x + self.ffn(x)


def test_backend_config_does_not_leak(op_calls):
    config = torch._inductor.config.get_config_copy()
    torch.compile(TinyNet(), backend="twell", options={"max_autotune": False, "fx_graph_cache": False})(
        torch.randn(2, 16)
    )
    assert op_calls["gated_ffn"] == 1
    assert torch._inductor.config.get_config_copy() == config


def test_twell_backend_gradients(op_calls):
    torch.manual_seed(0)
    model = TinyNet()
    x = torch.randn(4, 16, requires_grad=True)
    model(x).square().sum().backward()
    expected = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad()
    x.grad = None
    torch.compile(model, backend="twell", fullgraph=True)(x).square().sum().backward()
    got = [p.grad for p in model.parameters()] + [x.grad]
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
    assert op_calls["gated_ffn"] >= 1


def test_entry_point_needs_no_twell_import_and_uuid_is_stable():
    code = (
        "import sys, torch\n"
        "from torch._dynamo.backends.registry import lookup_backend\n"
        "assert 'twell' not in sys.modules\n"
        "backend = lookup_backend('twell')\n"
        "from twell.passes.backend import TwellInductorPass\n"
        "print(backend.__module__, backend.__name__, TwellInductorPass().uuid().hex())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    # Same uuid in another process: Inductor's FX graph cache keys on it.
    uuid = TwellInductorPass().uuid()
    assert isinstance(uuid, bytes) and uuid
    assert result.stdout.split() == ["twell.passes.backend", "twell_backend", uuid.hex()]
