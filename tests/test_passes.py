"""The pattern pass on hand-written modules (no transformers): spellings, structure, safety, reasons."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err
from torch import nn

import twell
from twell.passes import find_ffns, scan
from twell.passes import modules as twell_modules
from twell.passes.match import _split_rows
from twell.passes.modules import (
    ActivationPassthrough,
    FFNSpec,
    GatePassthrough,
    InlineFFN,
    SparseFFN,
    dense_ffn,
    run_ffn,
)

K, N = 24, 40


class Gated(nn.Module):
    """down(act(gate(x)) * up(x)) with a configurable activation and operand order."""

    def __init__(self, act, *, bias=False, swap=False, drelu=False):
        super().__init__()
        self.gate_proj = nn.Linear(K, N, bias=bias)
        self.up_proj = nn.Linear(K, N, bias=bias)
        self.down_proj = nn.Linear(N, K, bias=bias)
        self.act, self.swap, self.drelu = act, swap, drelu

    def forward(self, x):
        gate = self.act(self.gate_proj(x))
        up = self.up_proj(x)
        if self.drelu:
            up = F.relu(up)
        return self.down_proj(up * gate if self.swap else gate * up)


class Fused(nn.Module):
    """Phi-3 style: one gate_up linear, split by `split`."""

    def __init__(self, split):
        super().__init__()
        self.gate_up = nn.Linear(K, 2 * N, bias=True)
        self.down = nn.Linear(N, K)
        self.split = split

    def forward(self, x):
        gate, up = self.split(self.gate_up(x))
        return self.down(torch.relu(gate) * up)


class Plain(nn.Module):
    def __init__(self, act, dropout=0.0):
        super().__init__()
        self.fc1 = nn.Linear(K, N)
        self.fc2 = nn.Linear(N, K)
        self.act = act
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return self.fc2(self.drop(self.act(self.fc1(x))))


class Block(nn.Module):
    """A residual block with the FFN written inline (OPT-like), or the activation inline too."""

    def __init__(self, gated=False, functional=False, norm=True):
        super().__init__()
        self.norm = nn.LayerNorm(K) if norm else nn.Identity()
        self.w1 = nn.Linear(K, N)
        self.w3 = nn.Linear(K, N) if gated else None
        self.w2 = nn.Linear(N, K)
        self.act = nn.ReLU()
        self.gated, self.functional = gated, functional

    def forward(self, x):
        h = self.norm(x)
        a = F.relu(self.w1(h)) if self.functional else self.act(self.w1(h))
        if self.gated:
            a = a * self.w3(h)
        return x + self.w2(a)


class Net(nn.Module):
    """A model holding FFN modules (sparsify replaces children, never the model itself)."""

    def __init__(self, *ffns):
        super().__init__()
        self.layers = nn.ModuleList(ffns)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def fat_relu(v):
    return v * (v > 0.25)


ACTIVATIONS = {
    "nn.ReLU": (nn.ReLU(), "relu", 0.0),
    "F.relu": (F.relu, "relu", 0.0),
    "torch.relu": (torch.relu, "relu", 0.0),
    "Tensor.relu": (lambda v: v.relu(), "relu", 0.0),
    "clamp_min": (lambda v: v.clamp_min(0), "relu", 0.0),
    "fatrelu-mul": (fat_relu, "fatrelu", 0.25),
    "fatrelu-mul-float": (lambda v: v * (v > 0.5).float(), "fatrelu", 0.5),
    "fatrelu-where": (lambda v: torch.where(v > 0.1, v, 0.0), "fatrelu", 0.1),
    "F.threshold": (lambda v: F.threshold(v, 0.2, 0.0), "fatrelu", 0.2),
    "nn.Threshold": (nn.Threshold(0.3, 0.0), "fatrelu", 0.3),
    "nn.Threshold-negative": (nn.Threshold(-0.5, 0.0), "fatrelu", -0.5),
}


class ScaledReLU(nn.ReLU):
    """A ReLU subclass with its own forward and a buffer: a leaf of the trace (call_module)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, v):
        return super().forward(v) * self.scale


class LeakyReLUNamedReLU(nn.ReLU):
    """A stateless ReLU subclass with its own forward: traced through."""

    def forward(self, v):
        return F.leaky_relu(v, 0.1)


class ShiftedThreshold(nn.Threshold):
    """An nn.Threshold subclass with its own forward and a buffer: a leaf of the trace (call_module)."""

    def __init__(self):
        super().__init__(0.3, 0.0)
        self.register_buffer("shift", torch.tensor(-1.0))

    def forward(self, v):
        return super().forward(v) + self.shift


# Spellings close to the ReLU family that are not it: each must be reported, never rewritten as relu.
NOT_RELU = {
    "clamp-min-negative": (lambda v: v.clamp(min=-1), "clamp"),
    "clamp_min-negative": (lambda v: v.clamp_min(-0.5), "clamp_min"),
    "clamp-min-positive": (lambda v: torch.clamp(v, min=0.1), "clamp"),
    "clamp-min-and-max": (lambda v: v.clamp(min=0, max=6), "clamp"),
    "clamp-positional-max": (lambda v: torch.clamp(v, 0, 6), "clamp"),
    "clamp-max-only": (lambda v: v.clamp(max=6), "clamp"),
    "F.threshold-value": (lambda v: F.threshold(v, 0.2, -1.0), "threshold"),
    "nn.Threshold-value": (nn.Threshold(0.3, 0.5), "threshold"),
    "where-other-nonzero": (lambda v: torch.where(v > 0.1, v, -1.0), "custom"),
    "mul-ge": (lambda v: v * (v >= 0.1), "custom"),
    "relu-subclass-leaf": (ScaledReLU(), "scaledrelu"),
    "relu-subclass-traced": (LeakyReLUNamedReLU(), "leaky_relu"),
    "threshold-subclass-leaf": (ShiftedThreshold(), "shiftedthreshold"),
    "nn.LeakyReLU": (nn.LeakyReLU(), "leakyrelu"),
    "nn.Hardtanh": (nn.Hardtanh(0.0, 6.0), "hardtanh"),
    "nn.RReLU": (nn.RReLU(), "rrelu"),
}


def _check_rewrite(model: nn.Module, x: torch.Tensor, tol: float = 1e-5) -> torch.Tensor:
    """sparsify gives the same output within tol, keeps state_dict keys; restore is bit-identical."""
    with torch.no_grad():
        expected = model(x)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        twell.sparsify(model)
        got = model(x)
    assert torch.allclose(got, expected, atol=tol, rtol=tol), (got - expected).abs().max()
    assert list(model.state_dict()) == list(state)
    twell.restore(model)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    return got


@pytest.fixture
def x():
    torch.manual_seed(0)
    return torch.randn(3, 5, K)


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_gated_relu_spellings(name, x):
    act, expected_name, threshold = ACTIVATIONS[name]
    torch.manual_seed(1)
    model = Net(Gated(act))
    (c,) = find_ffns(model)
    assert (c.path, c.kind, c.activation, c.rewritable, c.threshold) == (
        "layers.0",
        "gated",
        expected_name,
        True,
        pytest.approx(threshold),
    )
    assert c.gate_module is model.layers[0].gate_proj and c.gate_slice is None
    assert (c.hidden_size, c.model_size) == (N, K)
    _check_rewrite(model, x)


def test_transformers_act2fn_relu(x):
    from transformers.activations import ACT2FN

    model = Net(Gated(ACT2FN["relu"]), Plain(ACT2FN["relu2"]))
    assert [(c.activation, c.rewritable) for c in find_ffns(model)] == [("relu", True), ("relu2", True)]
    _check_rewrite(model, x)


@pytest.mark.parametrize("swap", [False, True], ids=["act*up", "up*act"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_gated_operand_order_and_bias(swap, bias, x):
    torch.manual_seed(2)
    model = Net(Gated(nn.ReLU(), bias=bias, swap=swap))
    (c,) = find_ffns(model)
    assert c.rewritable and c.kind == "gated"
    _check_rewrite(model, x)
    twell.sparsify(model)
    assert isinstance(model.layers[0], SparseFFN)


def test_drelu(x):
    model = Net(Gated(nn.ReLU(), drelu=True, swap=True), Gated(fat_relu, drelu=True))
    candidates = find_ffns(model)
    assert [(c.activation, c.threshold, c.rewritable) for c in candidates] == [
        ("drelu", 0.0, True),
        ("drelu", 0.25, True),
    ]
    _check_rewrite(model, x)


@pytest.mark.parametrize(
    "split",
    [
        lambda t: t.chunk(2, dim=-1),
        lambda t: torch.chunk(t, 2, -1),
        lambda t: t.split(N, dim=-1),
        lambda t: torch.split(t, [N, N], dim=-1),
        lambda t: (t[..., :N], t[..., N:]),
        lambda t: (t.chunk(2, -1)[1], t.chunk(2, -1)[0]),
    ],
    ids=["chunk", "torch.chunk", "split", "split-sizes", "ellipsis-slice", "up-first"],
)
def test_fused_gate_up(split, x):
    torch.manual_seed(3)
    model = Net(Fused(split))
    (c,) = find_ffns(model)
    assert c.rewritable, c.reason
    gate_rows = split(torch.arange(2 * N))[0]
    assert c.gate_module is model.layers[0].gate_up
    assert c.gate_slice == slice(int(gate_rows[0]), int(gate_rows[-1]) + 1)
    _check_rewrite(model, x)


@pytest.mark.parametrize(
    "name, spec, rows",
    [
        ("chunk", 2, [(0, 40), (40, 80)]),
        ("chunk", 3, [(0, 27), (27, 54), (54, 80)]),
        ("chunk", 1, [(0, 80)]),
        ("split", 30, [(0, 30), (30, 60), (60, 80)]),
        ("split", [50, 30], [(0, 50), (50, 80)]),
        ("split", (80,), [(0, 80)]),
        ("split", [50, 20], None),
        ("split", [40.0, 40], None),
        ("chunk", 0, None),
        ("chunk", 2.0, None),
        ("split", 0, None),
        ("split", -40, None),
    ],
)
def test_split_rows_of_a_fused_projection(name, spec, rows):
    expected = [slice(a, b) for a, b in rows] if rows is not None else None
    assert _split_rows(80, name, spec) == expected


def test_full_slice_needs_known_rank():
    # x[:, :N] on a traced value of unknown rank slices dim 1, not necessarily the last: not a gate/up split.
    model = Net(Fused(lambda t: (t[:, :N], t[:, N:])))
    assert find_ffns(model) == []


@pytest.mark.parametrize(
    "act, name, squared",
    [
        (nn.ReLU(), "relu", False),
        (lambda v: F.relu(v) ** 2, "relu2", True),
        (lambda v: torch.square(fat_relu(v)), "fatrelu", True),
    ],
    ids=["relu", "relu-pow2", "fatrelu-squared"],
)
def test_plain(act, name, squared, x):
    model = Net(Plain(act))
    (c,) = find_ffns(model)
    assert (c.kind, c.activation, c.rewritable, c.spec.squared) == ("plain", name, True, squared)
    _check_rewrite(model, x)


def test_sequential_ffn(x):
    model = Net(nn.Sequential(nn.Linear(K, N), nn.ReLU(), nn.Dropout(0.1), nn.Linear(N, K))).eval()
    (c,) = find_ffns(model)
    assert c.path == "layers.0" and c.rewritable
    _check_rewrite(model, x)


def test_eval_dropout_and_training_fallback(x):
    model = Net(Plain(nn.ReLU(), dropout=0.5)).eval()
    _check_rewrite(model, x)
    twell.sparsify(model)
    model.train()
    # In training mode dropout acts: the rewritten module runs the original forward (same random stream).
    torch.manual_seed(7)
    got = model(x)
    twell.restore(model)
    torch.manual_seed(7)
    expected = model(x)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_inline_ffn_in_block(gated, x):
    model = Net(Block(gated=gated))
    (c,) = find_ffns(model)
    assert c.path == ("layers.0[w1,w3,w2]" if gated else "layers.0[w1,w2]")
    assert c.rewritable, c.reason
    _check_rewrite(model, x)
    twell.sparsify(model)
    block = model.layers[0]
    assert isinstance(block.w1, GatePassthrough) and isinstance(block.w2, InlineFFN)
    assert isinstance(block.act, ActivationPassthrough)
    assert block.w1.weight is c.gate_module.weight  # the same Parameter, not a copy


def test_inline_functional_activation_is_reported(x):
    model = Net(Block(functional=True))
    (c,) = find_ffns(model)
    assert not c.rewritable and "written inline" in c.reason
    twell.sparsify(model)
    assert isinstance(model.layers[0].w1, nn.Linear)


class SharedActivation(Block):
    """The FFN's activation module is called again outside the FFN: swapping it for a passthrough would
    change that other call."""

    def forward(self, x):
        return super().forward(x) + self.act(x - 0.5)


class SquaredReLU(nn.Module):
    """Parameter-free, not from torch.nn: traced through, as transformers' activation classes are."""

    def forward(self, v):
        return F.relu(v) ** 2


@pytest.mark.parametrize("act", [nn.ReLU, SquaredReLU], ids=["leaf", "traced-through"])
def test_inline_ffn_whose_activation_module_is_shared_is_not_rewritten(act, x):
    model = Net(SharedActivation())
    model.layers[0].act = act()
    (c,) = find_ffns(model)
    assert not c.rewritable and c.reason == "activation module act is used more than once"
    _check_rewrite(model, x, tol=0.0)
    assert isinstance(model.layers[0].act, act)


def test_inline_gated_ffn_under_autocast_runs_like_the_original(x):
    torch.manual_seed(12)
    model = Net(Block(gated=True, norm=False)).eval()
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        expected = model(x)
        twell.sparsify(model)
        assert isinstance(model.layers[0].w2, InlineFFN)
        got = model(x)
    assert torch.equal(got, expected)


class UsedElsewhere(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(K, N), nn.Linear(K, N), nn.Linear(N, K)

    def forward(self, x):
        hidden = F.relu(self.gate_proj(x))
        y = self.down_proj(hidden * self.up_proj(x))
        return y + hidden.mean(-1, keepdim=True)  # the hidden activation escapes the FFN


def test_hidden_activation_used_elsewhere_is_not_rewritten(x):
    model = Net(UsedElsewhere())
    (c,) = find_ffns(model)
    assert not c.rewritable
    assert "also used outside the FFN" in c.reason
    with torch.no_grad():
        expected = model(x)
        twell.sparsify(model)
        assert torch.equal(model(x), expected)
    assert isinstance(model.layers[0], UsedElsewhere)
    record = twell.report(model)["layers.0[gate_proj,up_proj,down_proj]"]
    assert not record.rewritten and "also used outside" in record.reason


@pytest.mark.parametrize(
    "act, name",
    [
        (nn.SiLU(), "silu"),
        (F.gelu, "gelu"),
        (lambda v: F.gelu(v, approximate="tanh"), "gelu_tanh"),
        (torch.sigmoid, "sigmoid"),
        (lambda v: 0.5 * v * (1.0 + torch.tanh(0.79788456 * (v + 0.044715 * torch.pow(v, 3.0)))), "custom"),
    ],
    ids=["silu", "gelu", "gelu_tanh", "sigmoid", "gelu_new-inline"],
)
def test_non_relu_reported_with_remedy(act, name, x):
    model = Net(Gated(act))
    (c,) = find_ffns(model)
    assert (c.activation, c.rewritable) == (name, False)
    assert f"activation {name} is not sparse" in c.reason and "ReLU + L1" in c.reason
    _check_rewrite(model, x)  # sparsify leaves it alone: logits unchanged
    assert isinstance(model.layers[0], Gated)


@pytest.mark.parametrize("ffn", [Gated, Plain])
@pytest.mark.parametrize("name", list(NOT_RELU))
def test_relu_lookalikes_are_reported_not_rewritten(name, ffn, x):
    act, reported = NOT_RELU[name]
    model = Net(ffn(act)).eval()
    (c,) = find_ffns(model)
    assert (c.activation, c.rewritable) == (reported, False)
    assert f"activation {reported} is not sparse" in c.reason
    _check_rewrite(model, x, tol=0.0)
    assert isinstance(model.layers[0], ffn)


@pytest.mark.parametrize("act", [nn.ReLU6(), F.relu6], ids=["nn.ReLU6", "F.relu6"])
def test_relu6_is_reported_as_sparse_but_clipped(act, x):
    model = Net(Gated(act), Plain(act))
    candidates = find_ffns(model)
    assert [(c.activation, c.rewritable) for c in candidates] == [("relu6", False)] * 2
    assert all(
        c.reason == "activation relu6 is sparse, but twell's ops do not clip the activation at 6" for c in candidates
    )
    _check_rewrite(model, x, tol=0.0)


def _forward_replaced(module):
    module.forward = lambda v: v.clamp(min=-1)
    return "activation act's forward is replaced on the instance"


def _output_hook(module):
    module.register_forward_hook(lambda m, args, out: out * 2)
    return "activation act has forward hooks"


def _input_hook(module):
    module.register_forward_pre_hook(lambda m, args: (args[0] - 1,))
    return "activation act has forward hooks"


@pytest.mark.parametrize("change", [_forward_replaced, _output_hook, _input_hook], ids=["forward", "hook", "pre-hook"])
@pytest.mark.parametrize("act", [nn.ReLU, lambda: nn.Threshold(0.3, 0.0)], ids=["nn.ReLU", "nn.Threshold"])
def test_activation_module_that_runs_more_than_its_forward_is_not_rewritten(act, change, x):
    """The rewritten FFN never calls the activation module: what its call adds would be lost."""
    model = Net(Gated(act()), Plain(act()))
    reasons = [change(layer.act) for layer in model.layers]
    candidates = find_ffns(model)
    assert [c.rewritable for c in candidates] == [False, False]
    assert all(reason in c.reason for c, reason in zip(candidates, reasons, strict=True))
    _check_rewrite(model, x, tol=0.0)


def test_transformers_gelu_new_named_by_its_module():
    from transformers.activations import ACT2FN

    (c,) = find_ffns(Net(Plain(ACT2FN["gelu_new"])))
    assert (c.activation, c.rewritable) == ("NewGELUActivation", False)


def test_relu_squared_gate_not_supported():
    (c,) = find_ffns(Net(Gated(lambda v: F.relu(v) ** 2)))
    assert not c.rewritable and "relu² on the gate" in c.reason


class LoRALinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


def test_linear_with_custom_forward_not_rewritten():
    model = Net(Gated(nn.ReLU()))
    old = model.layers[0].up_proj
    model.layers[0].up_proj = LoRALinear(K, N, bias=False)
    model.layers[0].up_proj.load_state_dict(old.state_dict())
    (c,) = find_ffns(model)
    assert not c.rewritable and "LoRALinear with its own forward" in c.reason


def test_unsupported_dtype_not_rewritten():
    (c,) = find_ffns(Net(Gated(nn.ReLU())).double())
    assert not c.rewritable and "float64" in c.reason


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_dtypes(dtype, x):
    torch.manual_seed(4)
    model = Net(Gated(nn.ReLU(), bias=True), Plain(nn.ReLU())).to(dtype)
    x = x.to(dtype)
    assert all(c.rewritable for c in find_ffns(model))
    with torch.no_grad():
        expected = model(x)
        twell.sparsify(model)
        got = model(x)
    assert got.dtype == dtype and rel_err(got, expected) < 1e-2


def test_model_itself_an_ffn_is_reported():
    (c,) = find_ffns(Gated(nn.ReLU()))
    assert c.path == "" and not c.rewritable and "the model itself" in c.reason


class NeedsMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(K, N), nn.Linear(N, K)

    def forward(self, x, mask):
        return self.down(F.relu(self.up(x))) * mask


class WholeNeedsMask(NeedsMask):
    """An FFN module whose forward takes an argument besides its input: SparseFFN computes from x alone."""

    def forward(self, x, mask):
        return self.down(F.relu(self.up(x)))


class Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(K, N), nn.Linear(N, K)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: FX cannot trace it
            return self.down(F.relu(self.up(x)))
        return x


def test_untraceable_modules_are_reported():
    candidates, unmatched = scan(Net(WholeNeedsMask(), Untraceable()))
    assert [(c.path, c.rewritable) for c in candidates] == [("layers.0", False)]
    assert "needs arguments besides its input: mask" in candidates[0].reason
    assert [u.path for u in unmatched] == ["layers.1"]
    assert "could not trace Untraceable" in unmatched[0].reason


def test_inline_ffn_of_a_module_needing_more_arguments_is_found():
    """BART's encoder layer requires an attention_mask: its inline FFN is traced with the mask None."""
    (candidate,) = scan(Net(NeedsMask()))[0]
    assert candidate.path == "layers.0[up,down]" and candidate.inline


def test_keyword_input_and_extra_arguments_fall_back():
    class WithOption(Gated):
        def forward(self, hidden_states, scale=None):
            y = super().forward(hidden_states)
            return y if scale is None else y * scale

    torch.manual_seed(5)
    model = Net(WithOption(nn.ReLU()))
    ffn = model.layers[0]
    calls = []
    ffn.register_forward_hook(lambda module, args, output: calls.append(1))
    x = torch.randn(2, K)
    with torch.no_grad():
        expected = (ffn(x), ffn(hidden_states=x), ffn(x, 2.0), ffn(hidden_states=x, scale=2.0))
        twell.sparsify(model)
        layer = model.layers[0]
        got = (layer(x), layer(hidden_states=x), layer(x, 2.0), layer(hidden_states=x, scale=2.0))
    assert isinstance(model.layers[0], SparseFFN)
    assert len(calls) == 8  # the hook ran once per call, the fallback included
    for g, e in zip(got, expected, strict=True):
        assert torch.allclose(g, e, atol=1e-6)


def test_module_hooks_keep_running_and_linear_hooks_block_the_rewrite(x):
    model = Net(Gated(nn.ReLU()), Gated(nn.ReLU()))
    seen = []
    model.layers[0].register_forward_hook(lambda module, args, output: seen.append(output))
    model.layers[1].gate_proj.register_forward_hook(lambda module, args, output: None)
    first, second = find_ffns(model)
    assert first.rewritable
    assert not second.rewritable and "gate linear has forward hooks" in second.reason
    with torch.no_grad():
        expected = model(x)
        twell.sparsify(model)
        got = model(x)
    assert isinstance(model.layers[0], SparseFFN) and isinstance(model.layers[1], Gated)
    assert len(seen) == 2 and torch.allclose(seen[1], seen[0], atol=1e-6)
    assert torch.allclose(got, expected, atol=1e-6)


def test_linear_replaced_after_sparsify_runs_the_original_forward(x):
    torch.manual_seed(6)
    model = twell.sparsify(Net(Gated(nn.ReLU())))
    ffn = model.layers[0]
    adapted = LoRALinear(K, N, bias=False)
    adapted.weight = ffn.up_proj.weight
    ffn.up_proj = adapted  # what an adapter library does to the rewritten module's child
    with torch.no_grad():
        got = model(x)
        twell.restore(model)
        assert model.layers[0].up_proj is adapted  # the change survives restore
        expected = model(x)
    assert torch.allclose(got, expected, atol=1e-6)


class DropoutFFN(nn.Module):
    """A plain FFN with functional dropout reading self.training (as T5-style code does) and a buffer of its own."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(K, N), nn.Linear(N, K)
        self.register_buffer("steps", torch.zeros(3))

    def forward(self, x):
        return self.fc2(F.dropout(F.relu(self.fc1(x)), 0.5, self.training))


def _adapt_up_proj(model):
    ffn = model.layers[0]
    adapted = LoRALinear(K, N, bias=False)
    adapted.weight = ffn.up_proj.weight
    ffn.up_proj = adapted


def _load_assign(model):
    torch.manual_seed(9)
    # randn, not randn_like: the values must not depend on a tensor's memory layout
    fresh = {k: torch.randn(v.shape, dtype=v.dtype) for k, v in model.state_dict().items()}
    model.load_state_dict(fresh, assign=True)  # new Parameter and buffer objects


CHANGES = {
    "half": lambda m: m.half(),
    "to-float64": lambda m: m.to(torch.float64),
    "train": lambda m: m.train(),
    "eval": lambda m: m.eval(),
    "load_state_dict-assign": _load_assign,
    "linear-replaced": _adapt_up_proj,
}
MODELS = {
    "module": lambda: Net(Gated(nn.ReLU()), DropoutFFN()),
    "inline": lambda: Net(Block(gated=True), Block()),
}


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize(
    "kind, change",
    # An inline FFN's linears are stand-ins while sparsified, not nn.Linear an adapter would wrap.
    [(kind, change) for kind in MODELS for change in CHANGES if (kind, change) != ("inline", "linear-replaced")],
)
def test_restore_after_changes_is_the_changed_original(kind, change, mode, x):
    """restore(change(sparsify(m))) is change(m): module tree, training flags, tensors and outputs; no
    forward call in between (a forward of the rewritten FFN may sync the original on its own)."""
    torch.manual_seed(8)
    model = MODELS[kind]().train(mode == "train")
    twin = copy.deepcopy(model)
    twell.sparsify(model)
    # Traced in training mode, functional dropout is a real operation: that FFN is left alone.
    expected_rewritten = [True, mode == "eval" or kind == "inline"]
    assert [r.rewritten for r in twell.report(model)] == expected_rewritten
    CHANGES[change](model)
    twell.restore(model)
    CHANGES[change](twin)

    def tree(m):
        return [(name, type(sub), sub.training) for name, sub in m.named_modules()]

    assert tree(model) == tree(twin)
    state, expected = model.state_dict(), twin.state_dict()
    assert list(state) == list(expected)
    assert all(state[k].dtype == v.dtype and torch.equal(state[k], v) for k, v in expected.items())
    x = x.to(next(twin.parameters()).dtype)
    with torch.no_grad():
        torch.manual_seed(10)
        got = model(x)
        torch.manual_seed(10)
        assert torch.equal(got, twin(x))


DENSE_SPECS = {
    "plain": FFNSpec("plain", "gate", None, "down", threshold=0.25),
    "relu2": FFNSpec("plain", "gate", None, "down", threshold=0.25, squared=True),
    "gated": FFNSpec("gated", "gate", "up", "down", threshold=0.25),
    "drelu": FFNSpec("gated", "gate", "up", "down", threshold=0.25, drelu=True),
    "fused": FFNSpec("gated", "gate", "gate", "down", gate_rows=slice(N, 2 * N), up_rows=slice(0, N), threshold=0.25),
}


@pytest.mark.parametrize("name", list(DENSE_SPECS))
def test_dense_ffn_is_the_op(name):
    """The plain-torch form (an inline FFN under autocast or mixed dtypes) computes what the op does,
    pre-activations at the threshold included (dropped)."""
    spec = DENSE_SPECS[name]
    torch.manual_seed(11)
    gate = nn.Linear(K, 2 * N if spec.gate_rows else N)
    up = nn.Linear(K, N) if spec.up == "up" else (gate if spec.up else None)
    down = nn.Linear(N, K)
    x = torch.randn(4, K)
    with torch.no_grad():
        gate.bias.zero_()
        gate.weight[:, 0] = 0.25  # x[0] = e_0: every gate pre-activation of row 0 sits at the threshold
        gate.weight[::2, 0] = 1.0
    x[0] = 0.0
    x[0, 0] = 1.0
    with torch.no_grad():
        expected = run_ffn(spec, gate, up, down, x, twell.LayerConfig())
        assert torch.allclose(dense_ffn(spec, gate, up, down, x), expected, atol=1e-6)


def test_rewritten_ffn_runs_the_op_whenever_it_can(x, monkeypatch):
    """Falling back to the original forward is exact, so only counting op calls shows the op is used:
    positional or keyword input, in eval mode, and in training mode unless dropout acts in the FFN."""
    calls = []
    run_ffn_ = twell_modules.run_ffn
    monkeypatch.setattr(twell_modules, "run_ffn", lambda *args: calls.append(args[0].kind) or run_ffn_(*args))
    model = twell.sparsify(Net(Net(Gated(nn.ReLU())), Plain(nn.ReLU(), dropout=0.1)).eval())  # a nested path too
    with torch.no_grad():
        model(x)
        assert calls == ["gated", "plain"]
        model.layers[0].layers[0](x=x)
        assert calls[2:] == ["gated"]
        model.train()(x)
    assert calls[3:] == ["gated"]


def test_apply_refuses_a_candidate_that_is_not_rewritable():
    from twell.passes.rewrite import apply

    model = Net(Gated(nn.SiLU()))
    (c,) = find_ffns(model)
    with pytest.raises(ValueError, match="'layers.0' is not rewritable: activation silu is not sparse"):
        apply(model, c)


def test_linear_given_an_instance_forward_after_sparsify_runs_the_original_forward(x):
    model = twell.sparsify(Net(Gated(nn.ReLU())))
    with torch.no_grad():
        model.layers[0].up_proj.forward = lambda v: 2 * F.linear(v, model.layers[0].up_proj.weight)
        got = model(x)
        twell.restore(model)
        assert torch.equal(got, model(x))


class LinearCalledTwice(Block):
    def forward(self, x):
        return super().forward(x) + self.w1(x).mean(-1, keepdim=True)


def test_inline_ffn_whose_linear_is_called_again_is_not_rewritten(x):
    model = Net(LinearCalledTwice())
    (c,) = find_ffns(model)
    assert not c.rewritable and c.reason == "linear w1 is called more than once"
    _check_rewrite(model, x, tol=0.0)


class Intermediate(nn.Module):
    """BERT-style first half of a split FFN: act(dense(x))."""

    def __init__(self, act=None, functional=False):
        super().__init__()
        self.dense = nn.Linear(K, N)
        self.act = act if act is not None else nn.ReLU()
        self.functional = functional

    def forward(self, x):
        return F.relu(self.dense(x)) if self.functional else self.act(self.dense(x))


class Output(nn.Module):
    """BERT-style second half: dense(h), dropout, residual and norm."""

    def __init__(self):
        super().__init__()
        self.dense, self.norm, self.drop = nn.Linear(N, K), nn.LayerNorm(K), nn.Dropout(0.1)

    def forward(self, h, residual):
        return self.norm(self.drop(self.dense(h)) + residual)


class DroppingIntermediate(Intermediate):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return self.drop(self.act(self.dense(x)))


class ShiftedIntermediate(Intermediate):
    def forward(self, x):
        return self.act(self.dense(x)) + x.mean()


class ScaledOutput(Output):
    def forward(self, h, residual):
        return self.norm(self.dense(h) + h.mean() + residual)


class SplitBlock(nn.Module):
    def __init__(self, leak=False, **intermediate):
        super().__init__()
        self.intermediate, self.output = Intermediate(**intermediate), Output()
        self.leak = leak

    def forward(self, x):
        h = self.intermediate(x)
        y = self.output(h, x)
        return y + h.mean(-1, keepdim=True) if self.leak else y


SPLIT_PATH = "layers.0[intermediate.dense,output.dense]"


def test_ffn_split_across_two_modules(x):
    torch.manual_seed(13)
    model = Net(SplitBlock()).eval()
    (c,) = find_ffns(model)
    assert (c.path, c.kind, c.activation, c.rewritable) == (SPLIT_PATH, "plain", "relu", True), c.reason
    assert c.gate_module is model.layers[0].intermediate.dense and (c.hidden_size, c.model_size) == (N, K)
    _check_rewrite(model, x)
    twell.sparsify(model)
    block = model.layers[0]
    assert isinstance(block.intermediate.dense, GatePassthrough) and isinstance(block.output.dense, InlineFFN)
    assert isinstance(block.intermediate.act, ActivationPassthrough)
    # training mode: the second half's dropout acts on the FFN's output, as it did
    model.train()
    torch.manual_seed(14)
    got = model(x)
    twell.restore(model)
    torch.manual_seed(14)
    assert torch.allclose(got, model(x), atol=1e-5)


def _swap(**halves):
    def change(block):
        for name, cls in halves.items():
            if cls is not None:
                torch.manual_seed(16)
                setattr(block, name, cls().eval())

    return change


def _hook_intermediate(block):
    block.intermediate.register_forward_hook(lambda m, args, out: out)


SPLIT_REASONS = {
    "activation-inline": (dict(functional=True), None, "activation is written inline in intermediate's forward"),
    "not-sparse": (dict(act=nn.GELU()), None, "activation gelu is not sparse"),
    "output-used-elsewhere": (dict(leak=True), None, "intermediate's output is also used outside output's first"),
    "hooked-half": ({}, _hook_intermediate, "intermediate has forward hooks"),
    "dropout-in-first-half": ({}, _swap(intermediate=DroppingIntermediate), "dropout after the activation"),
}
# Halves that are not act(up(x)) and down(h), ...: no FFN, but a module not analysed, with the reason.
SPLIT_UNMATCHED = {
    "first-computes-more": (ShiftedIntermediate, None, "intermediate passes its output to output, but does not"),
    "second-uses-h-again": (None, ScaledOutput, "output does not use intermediate's output only as the input"),
}


@pytest.mark.parametrize("name", list(SPLIT_UNMATCHED))
def test_split_halves_that_are_not_an_ffn_are_reported(name, x):
    first, second, reason = SPLIT_UNMATCHED[name]
    model = Net(SplitBlock()).eval()
    _swap(intermediate=first, output=second)(model.layers[0])
    candidates, unmatched = scan(model)
    assert candidates == [] and [u.path for u in unmatched] == [SPLIT_PATH]
    assert reason in unmatched[0].reason


@pytest.mark.parametrize("name", list(SPLIT_REASONS))
def test_split_ffn_left_alone_has_its_reason(name, x):
    options, change, reason = SPLIT_REASONS[name]
    model = Net(SplitBlock(**options)).eval()
    if change is not None:
        change(model.layers[0])
    (c,) = find_ffns(model)
    assert c.path == SPLIT_PATH and not c.rewritable and reason in c.reason, c.reason
    _check_rewrite(model, x, tol=0.0)
    assert isinstance(model.layers[0].output.dense, nn.Linear)


class NoActivation(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(K, N), nn.Linear(N, K)

    def forward(self, x):
        return self.down(self.up(x))  # a linear map: no activation between the projections


def test_ffn_shaped_module_without_the_pattern_has_its_reason():
    candidates, unmatched = scan(Net(NoActivation()))
    assert candidates == [] and [u.path for u in unmatched] == ["layers.0"]
    assert "neither down(act(up(x))) nor down(act(gate(x)) * up(x))" in unmatched[0].reason
    text = " ".join(str(twell.report(Net(NoActivation()))).split())
    assert "0 of 0 FFNs rewritten, 1 FFN-shaped modules not analysed" in text and "layers.0 " in text


def _record(calls, name):
    def hook(module, args, output):
        calls.append((name, args[0].shape[-1], output.shape[-1], output.clone()))

    return hook


@pytest.mark.parametrize("member", ["w1", "act", "w3", "w2"])
@pytest.mark.parametrize("where", ["original", "stand-in"])
def test_inline_ffn_honours_hooks_on_its_modules(member, where, x, monkeypatch):
    """A hook registered after sparsify, on the original fc1 / activation / fc2 object or on what stands
    in for it in the layer, sees what it would see without twell; removed, the op runs again."""
    torch.manual_seed(15)
    model = Net(Block(gated=True)).eval()
    originals = dict(model.layers[0].named_children())
    expected_calls = []
    handle = originals[member].register_forward_hook(_record(expected_calls, member))
    with torch.no_grad():
        expected = model(x)
    handle.remove()
    twell.sparsify(model)
    block = model.layers[0]
    target = originals[member] if where == "original" else getattr(block, member)
    calls = []
    handle = target.register_forward_hook(_record(calls, member))
    with torch.no_grad():
        got = model(x)
    assert torch.allclose(got, expected, atol=1e-6)
    ((name, k_in, n_out, output),) = calls
    ((_, k_exp, n_exp, output_exp),) = expected_calls
    assert (k_in, n_out) == (k_exp, n_exp) and torch.allclose(output, output_exp, atol=1e-6)
    handle.remove()
    ops_calls = []
    run_ffn_ = twell_modules.run_ffn
    monkeypatch.setattr(twell_modules, "run_ffn", lambda *args: ops_calls.append(1) or run_ffn_(*args))
    with torch.no_grad():
        assert torch.allclose(model(x), expected, atol=1e-5)
    assert ops_calls == [1]


@pytest.mark.parametrize("half", ["intermediate", "output"])
def test_split_ffn_honours_hooks_on_its_halves(half, x):
    """A hook registered after sparsify on a half of a split FFN sees the hidden activation, as without
    twell (the rewritten halves pass x on, so the FFN then runs its original modules)."""
    torch.manual_seed(17)
    model = Net(SplitBlock()).eval()
    module = getattr(model.layers[0], half)
    seen = []
    handle = module.register_forward_hook(lambda m, args, out: seen.append((args[0].clone(), out.clone())))
    with torch.no_grad():
        expected = model(x)
    handle.remove()
    twell.sparsify(model)
    got_seen = []
    module.register_forward_hook(lambda m, args, out: got_seen.append((args[0].clone(), out.clone())))
    with torch.no_grad():
        got = model(x)
    assert torch.allclose(got, expected, atol=1e-6)
    ((args, out),), ((args_exp, out_exp),) = got_seen, seen
    assert args.shape == args_exp.shape and torch.allclose(args, args_exp, atol=1e-6)
    assert torch.allclose(out, out_exp, atol=1e-6)
