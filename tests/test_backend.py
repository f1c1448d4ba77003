"""torch.compile(backend="twell") and the Inductor custom pass, on the CPU (Inductor's C++ backend)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from ffn_cases import GatedMLP
from models import DEFAULT_NOT_RELU, FAMILIES, LAYERS, build, logits, modules_of, token_ids
from torch import nn
from torch._dynamo.utils import counters

import twell
from twell.kernels import reference
from twell.passes.backend import TwellInductorPass

transformers = pytest.importorskip("transformers")


@pytest.fixture
def op_calls(monkeypatch):
    """Counts calls of the ops' CPU implementations: proves the compiled graph runs twell ops."""
    calls = {"gated_ffn": 0, "ffn": 0}

    def counting(name):
        original = getattr(reference, f"{name}_reference")

        def wrapper(*args, **kwargs):
            calls[name] += 1
            return original(*args, **kwargs)

        return wrapper

    for name in calls:
        monkeypatch.setattr(reference, f"{name}_reference", counting(name))
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


@pytest.mark.parametrize("family", ["llama", "opt", "bert"])  # module, inline and split rewrites
def test_sparsified_model_compiles_with_default_backend(family, op_calls):
    model = build(family)
    ids = token_ids()
    expected = logits(model, ids)
    twell.sparsify(model)
    op_calls[_op(family)] = 0
    compiled = torch.compile(model, fullgraph=True)
    torch.testing.assert_close(logits(compiled, ids), expected, atol=1e-5, rtol=1e-5)
    assert op_calls[_op(family)] == LAYERS


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
    gc.collect()  # models sparsified with decisions by earlier tests, freed: their decisions are gone
    uuid = TwellInductorPass().uuid()
    assert isinstance(uuid, bytes) and uuid
    assert result.stdout.split() == ["twell.passes.backend", "twell_backend", uuid.hex()]


QUICK_CALIBRATION = {"decode_steps": 0, "timing_repeats": 0, "progress": False, "min_speedup": 0.0}


@pytest.fixture
def plan_keeping_layer_1_dense(tmp_path):
    """A calibration plan for build("llama-bias") that rewrites layer 0 and keeps layer 1 dense."""
    model = build("llama-bias")
    for layer in model.model.layers:  # a negative gate bias: a few percent of neurons fire
        layer.mlp.gate_proj.bias.data.fill_(-0.2)
    twell.sparsify(model, [token_ids()], config=QUICK_CALIBRATION)
    path = tmp_path / "plan.json"
    twell.save_plan(model, path)
    plan = json.loads(path.read_text())
    plan["decisions"]["model.layers.1.mlp"].update(rewrite=False, reason="held back in this test")
    path.write_text(json.dumps(plan))
    return path


@pytest.mark.parametrize("how", ["plan-option", "sparsified-first"])
def test_twell_backend_follows_a_plan_and_reports(how, plan_keeping_layer_1_dense, op_calls):
    model = build("llama-bias")
    ids = token_ids()
    expected = logits(model, ids)
    counters.clear()
    if how == "plan-option":
        compiled = torch.compile(model, backend="twell", options={"plan": str(plan_keeping_layer_1_dense)})
    else:
        compiled = torch.compile(twell.sparsify(model, plan=plan_keeping_layer_1_dense), backend="twell")
    torch.testing.assert_close(logits(compiled, ids), expected, atol=1e-5, rtol=1e-5)
    assert op_calls["gated_ffn"] == 1  # layer 0 only: through the backend, or sparsify's module
    report = twell.compile_report(compiled)
    # the backend found what sparsify left: both layers, or only the one the plan keeps dense
    found = ["model.layers.0.mlp", "model.layers.1.mlp"] if how == "plan-option" else ["model.layers.1.mlp"]
    assert [r.path for r in report] == found
    assert [r.rewritten for r in report] == [True, False][-len(found) :]
    kept = report["model.layers.1.mlp"]
    assert kept.reason == "kept dense by the plan: held back in this test" and kept.decision["density"] > 0
    expected_counts = {"ffn_found": len(found), "ffn_kept": 1}
    if how == "plan-option":
        expected_counts["ffn_rewritten"] = 1
    assert dict(counters["twell"]) == expected_counts
    assert twell.compile_report(model).to_dict() == report.to_dict()  # the model, or its compiled wrapper


def test_twell_backend_plan_of_another_model(plan_keeping_layer_1_dense, op_calls):
    model = build("llama-bias", intermediate_size=48)
    compiled = torch.compile(model, backend="twell", options={"plan": str(plan_keeping_layer_1_dense)})
    with pytest.raises(Exception, match="was made for a different model: model.layers.0.mlp has N x K 48x32"):
        compiled(token_ids())


def test_twell_backend_reports_what_it_left_alone(op_calls):
    model = build("llama", activation=None, num_hidden_layers=1)
    counters.clear()
    torch.compile(model, backend="twell")(token_ids())
    (record,) = twell.compile_report(model)
    assert record.path == "model.layers.0.mlp"  # twell.report's path
    assert not record.rewritable and not record.rewritten and "activation silu is not sparse" in record.reason
    assert dict(counters["twell"]) == {"ffn_found": 1, "ffn_not_rewritable": 1}


def test_inductor_pass_records_and_counters(op_calls):
    model = build("opt")
    ids = token_ids()
    counters.clear()
    twell_pass = TwellInductorPass()
    # without the FX graph cache the pass runs in every process (a cache hit skips it, and its records)
    options = {"post_grad_custom_pre_pass": twell_pass, "fx_graph_cache": False}
    logits(torch.compile(model, fullgraph=True, options=options), ids)  # no_grad: an inference graph
    report = twell_pass.report()
    assert len(report) == LAYERS and all(r.rewritten and r.kind == "plain" for r in report)
    assert all(r.path.startswith("<graph>[") for r in report)  # aten graphs do not tell module paths
    assert counters["twell"]["ffn_rewritten"] == LAYERS == op_calls["ffn"]


def test_twell_backend_leaves_ffns_the_plan_does_not_name(plan_keeping_layer_1_dense, op_calls):
    plan = json.loads(plan_keeping_layer_1_dense.read_text())
    del plan["decisions"]["model.layers.1.mlp"]
    plan_keeping_layer_1_dense.write_text(json.dumps(plan))
    model = build("llama-bias")
    ids = token_ids()
    expected = logits(model, ids)
    compiled = torch.compile(model, backend="twell", options={"plan": str(plan_keeping_layer_1_dense)})
    torch.testing.assert_close(logits(compiled, ids), expected, atol=1e-5, rtol=1e-5)
    layer_0, layer_1 = twell.compile_report(model)
    assert layer_0.rewritten and not layer_1.rewritten and layer_1.decision is None
    assert layer_1.path == "model.layers.1.mlp"
    assert layer_1.reason == f"not in the plan {plan_keeping_layer_1_dense}"
    assert op_calls["gated_ffn"] == 1


@pytest.mark.parametrize("how", ["plan-option", "sparsified-first"])
def test_inductor_pre_grad_pass_follows_a_plan(how, plan_keeping_layer_1_dense, op_calls):
    """As pre_grad_custom_pass, the pass sees dynamo's graph and follows decisions as the backend does."""
    model = build("llama-bias")
    ids = token_ids()
    expected = logits(model, ids)
    if how == "plan-option":
        twell_pass = TwellInductorPass(plan=str(plan_keeping_layer_1_dense))
    else:
        twell.sparsify(model, plan=plan_keeping_layer_1_dense)
        twell_pass = TwellInductorPass()
    counters.clear()
    options = {"pre_grad_custom_pass": twell_pass, "fx_graph_cache": False}
    torch.testing.assert_close(logits(torch.compile(model, options=options), ids), expected, atol=1e-5, rtol=1e-5)
    assert op_calls["gated_ffn"] == 1
    report = twell_pass.report()
    assert [(r.path, r.rewritten) for r in report][-1] == ("model.layers.1.mlp", False)
    assert report["model.layers.1.mlp"].reason == "kept dense by the plan: held back in this test"
    assert counters["twell"]["ffn_kept"] == 1
    assert twell.compile_report(model).to_dict() == report.to_dict()


def test_inductor_post_grad_pass_refuses_a_plan(plan_keeping_layer_1_dense, op_calls):
    twell_pass = TwellInductorPass(plan=str(plan_keeping_layer_1_dense))
    options = {"post_grad_custom_pre_pass": twell_pass, "fx_graph_cache": False}
    with pytest.raises(Exception, match="follows a plan only as pre_grad_custom_pass"):
        logits(torch.compile(build("llama-bias"), options=options), token_ids())


def test_inductor_pass_uuid_follows_plan_and_decisions(plan_keeping_layer_1_dense):
    gc.collect()  # models sparsified by earlier tests, freed: their decisions are gone
    plain = TwellInductorPass().uuid()
    assert TwellInductorPass(plan=str(plan_keeping_layer_1_dense)).uuid() != plain
    model = twell.sparsify(build("llama-bias"), plan=plan_keeping_layer_1_dense)
    assert TwellInductorPass().uuid() != plain
    twell.restore(model)
    assert TwellInductorPass().uuid() == plain


class CachedFFN(nn.Module):
    """An FFN that writes its input into a buffer in place first (as a static KV cache does), the
    write's result unused."""

    def __init__(self, d=16, n=32):
        super().__init__()
        self.gate = nn.Linear(d, n)
        self.up = nn.Linear(d, n, bias=False)
        self.down = nn.Linear(n, d, bias=False)
        self.register_buffer("cache", torch.zeros(8, d))
        self.register_buffer("length", torch.zeros((), dtype=torch.long))

    def forward(self, x, position):
        self.cache.index_copy_(0, position, x)
        self.length.add_(1)
        return self.down(F.relu(self.gate(x)) * self.up(x))


def test_twell_backend_keeps_in_place_writes(op_calls):
    torch.manual_seed(0)
    eager, model = CachedFFN(), CachedFFN()
    model.load_state_dict(eager.state_dict())
    compiled = torch.compile(model, backend="twell", fullgraph=True)
    x, position = torch.randn(2, 16), torch.tensor([3, 5])
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, position), eager(x, position), atol=1e-5, rtol=1e-5)
    assert op_calls["gated_ffn"] == 1
    assert torch.equal(model.cache, eager.cache) and model.cache[3].equal(x[0]) and int(model.length) == 1


@pytest.mark.parametrize("k", [64, 4096])
def test_twell_backend_gives_each_ffn_its_widths_defaults(k):
    """Without a plan the backend's op calls carry policy.default_config(K): from 8192 tokens prefill at
    K >= 4096, from 16384 below."""
    from twell.kernels import policy
    from twell.passes.backend import rewrite_dynamo_graph

    seen = []

    def backend(gm, example_inputs):
        rewrite_dynamo_graph(gm, example_inputs)
        fields = len(policy.OP_FIELDS)
        ops = [n for n in gm.graph.nodes if getattr(n.target, "_overloadpacket", n.target) is torch.ops.twell.gated_ffn]
        seen.extend(policy.op_config(*n.args[-fields:]) for n in ops)
        return gm.forward

    torch._dynamo.reset()
    try:
        with torch.no_grad():
            torch.compile(GatedMLP(k, 16), backend=backend)(torch.randn(2, k))
    finally:
        torch._dynamo.reset()
    assert seen == [policy.default_config(k)]
