"""torch.ops.twell.*: the functional API, input checks, torch.compile tracing and autograd (CPU)."""

import pytest
import torch
from conftest import rel_err
from ffn_cases import gated_ref, make_ffn, plain_ref

import twell
import twell.kernels.library  # noqa: F401  (registers torch.ops.twell.*: the tests call them by name)
from twell.kernels import policy, reference


def _gated_args(case):
    return (case["x"], case["gate_weight"], case["up_weight"], case["down_weight"])


@pytest.mark.parametrize("variant", ["relu", "fatrelu", "drelu"])
def test_gated_op_matches_reference_with_and_without_grad(variant):
    case = make_ffn(9, 24, 70, [0.0, 0.1, 1.0], torch.float32, biases=True)
    kwargs = {
        "gate_bias": case["gate_bias"],
        "up_bias": case["up_bias"],
        "down_bias": case["down_bias"],
        "threshold": 0.05 if variant == "fatrelu" else 0.0,
        "drelu": variant == "drelu",
    }
    fast = twell.ops.gated_ffn(*_gated_args(case), **kwargs)  # nothing requires grad: in-place dense path
    x = case["x"].clone().requires_grad_()
    args = (case["gate_bias"], case["up_bias"], case["down_bias"], kwargs["threshold"], kwargs["drelu"])
    slow = reference.gated_ffn_reference(x, *_gated_args(case)[1:], *args)  # recorded by autograd: out of place
    assert slow.grad_fn is not None
    assert torch.equal(fast, slow.detach())
    assert rel_err(fast, gated_ref(case, kwargs["threshold"], kwargs["drelu"])) <= 1e-5


@pytest.mark.parametrize("squared", [False, True], ids=["relu", "relu2"])
def test_plain_op_matches_reference(squared):
    case = make_ffn(5, 16, 40, [0.2], torch.float32, biases=True, gated=False)
    y = twell.ops.ffn(
        case["x"],
        case["up_weight"],
        case["down_weight"],
        up_bias=case["up_bias"],
        down_bias=case["down_bias"],
        squared=squared,
    )
    assert rel_err(y, plain_ref(case, squared=squared)) <= 1e-5


def test_leading_dims_and_compile_without_graph_break():
    case = make_ffn(6, 16, 40, [0.2], torch.float32)
    x = case["x"].reshape(2, 3, 16)

    def f(x):
        return twell.ops.gated_ffn(x, case["gate_weight"], case["up_weight"], case["down_weight"]) * 2

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), f(x))
    assert f(x).shape == (2, 3, 16)


def test_gradients_match_float64_reference():
    case = make_ffn(7, 16, 40, [0.3], torch.float32, biases=True)
    leaves = {k: v.clone().requires_grad_() for k, v in case.items()}
    y = twell.ops.gated_ffn(
        leaves["x"],
        leaves["gate_weight"],
        leaves["up_weight"],
        leaves["down_weight"],
        gate_bias=leaves["gate_bias"],
        up_bias=leaves["up_bias"],
        down_bias=leaves["down_bias"],
    )
    grad = torch.randn_like(y)
    y.backward(grad)
    ref_leaves = {k: v.double().requires_grad_() for k, v in case.items()}
    gated_ref(ref_leaves).backward(grad.double())
    for name in leaves:
        assert rel_err(leaves[name].grad, ref_leaves[name].grad) <= 1e-5, name


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"x": torch.randn(3, 15)}, ValueError, r"x must have shape \[\.\.\., 16\]"),
        ({"up_weight": torch.randn(41, 16)}, ValueError, r"up_weight must have shape \[40, 16\]"),
        ({"down_weight": torch.randn(40, 16)}, ValueError, r"down_weight must have shape \[16, 40\]"),
        ({"up_weight": torch.randn(40, 16, dtype=torch.float16)}, TypeError, "up_weight must have the dtype of x"),
        ({"x": torch.ones(3, 16, dtype=torch.int64)}, TypeError, "x must be float32, float16 or bfloat16"),
        ({"gate_bias": torch.randn(39)}, ValueError, r"gate_bias must have shape \[40\]"),
        ({"gate_weight": torch.randn(40)}, ValueError, "gate_weight must be a 2-dim tensor"),
        ({"threshold": float("inf")}, ValueError, "threshold must be a finite float"),
    ],
    ids=[
        "x-width",
        "up-shape",
        "down-layout",
        "dtype-mismatch",
        "int-input",
        "bias-shape",
        "gate-rank",
        "inf-threshold",
    ],
)
def test_bad_input_names_the_tensor(change, error, match):
    args = {
        "x": torch.randn(3, 16),
        "gate_weight": torch.randn(40, 16),
        "up_weight": torch.randn(40, 16),
        "down_weight": torch.randn(16, 40),
        "gate_bias": None,
        "threshold": 0.0,
    }
    args.update(change)
    with pytest.raises(error, match=match):
        twell.ops.gated_ffn(
            args["x"],
            args["gate_weight"],
            args["up_weight"],
            args["down_weight"],
            gate_bias=args["gate_bias"],
            threshold=args["threshold"],
        )


@pytest.mark.parametrize("threshold", [0.0, 0.25, 1.0, -0.5])
def test_reference_activation_keeps_what_the_format_keeps(threshold):
    """v is kept iff not (v <= threshold): values at the threshold are dropped, NaN is kept."""
    v = torch.tensor([-1.0, -0.5, -0.0, 0.0, 0.25, 0.5, 1.0, 2.0, float("nan")])
    expected = torch.where(twell.format.kept_mask(v, threshold), v, torch.zeros(()))
    for got in (reference.thresholded_relu(v, threshold), reference._thresholded_relu_(v.clone(), threshold)):
        assert torch.equal(got.isnan(), expected.isnan())
        assert torch.equal(got.nan_to_num(), expected.nan_to_num())


REFERENCE_VARIANTS = {
    "gated": (reference.gated_ffn_reference, {}),
    "gated-fatrelu": (reference.gated_ffn_reference, {"threshold": 0.3}),
    "drelu": (reference.gated_ffn_reference, {"drelu": True}),
    "plain": (reference.ffn_reference, {}),
    "plain-fatrelu": (reference.ffn_reference, {"threshold": 0.3}),
    "relu2": (reference.ffn_reference, {"squared": True}),
}


def _reference_args(fn):
    case = make_ffn(6, 16, 40, [0.3], torch.float64, biases=True, gated=fn is reference.gated_ffn_reference)
    return {name: t for name, t in case.items() if t is not None}


def _formula(fn, args, threshold=0.0, drelu=False, squared=False):
    """The FFN written out, independently of the reference module."""
    x = args["x"]
    if fn is reference.ffn_reference:
        h = x @ args["up_weight"].T + args["up_bias"]
        h = h * (h > threshold)
        return (h * h if squared else h) @ args["down_weight"].T + args["down_bias"]
    g = x @ args["gate_weight"].T + args["gate_bias"]
    u = x @ args["up_weight"].T + args["up_bias"]
    return (g * (g > threshold) * (u * (u > 0) if drelu else u)) @ args["down_weight"].T + args["down_bias"]


@pytest.mark.parametrize("variant", list(REFERENCE_VARIANTS))
def test_reference_in_place_and_autograd_paths_agree_with_the_formula(variant):
    """Without autograd the reference works in place, with it out of place: both are the FFN, and
    gradients flow when any one input requires them."""
    fn, kwargs = REFERENCE_VARIANTS[variant]
    args = _reference_args(fn)
    expected = _formula(fn, args, **kwargs)
    assert torch.allclose(fn(**args, **kwargs), expected, atol=1e-12)
    for name in args:
        leaves = {k: v.clone().requires_grad_(k == name) for k, v in args.items()}
        y = fn(**leaves, **kwargs)
        assert torch.allclose(y, expected, atol=1e-12), name
        (grad,) = torch.autograd.grad(y.sum(), leaves[name])
        (want,) = torch.autograd.grad(_formula(fn, leaves, **kwargs).sum(), leaves[name])
        assert torch.allclose(grad, want, atol=1e-12), name


def test_ops_take_the_layer_config_as_arguments():
    """The route arguments are part of the op schemas (fake kernels, autograd and torch.compile see
    them); bad values fail on any device, naming the argument."""
    case = make_ffn(6, 16, 40, [0.2], torch.float32, biases=True)
    config = twell.LayerConfig(tile_n=32, slots=4, prefill_min_m=64, fused_gate=True)
    gated = (*_gated_args(case), case["gate_bias"], case["up_bias"], case["down_bias"], 0.0, False)
    plain = (case["x"], case["gate_weight"], case["down_weight"], case["gate_bias"], case["down_bias"], 0.0, True)
    torch.library.opcheck(torch.ops.twell.gated_ffn.default, (*gated, *config.op_args()))
    torch.library.opcheck(torch.ops.twell.ffn.default, (*plain, *config.op_args()))
    assert torch.equal(torch.ops.twell.gated_ffn(*gated), torch.ops.twell.gated_ffn(*gated, *config.op_args()))
    with pytest.raises(ValueError, match="power-of-two slots, got 3"):
        torch.ops.twell.gated_ffn(*gated, 32, 3)
    with pytest.raises(ValueError, match="prefill_min_m must be a non-negative int or None, got -1"):
        torch.ops.twell.ffn(*plain, 32, 4, 8, 16, -1)
    with pytest.raises(ValueError, match=r"hot_rate must be a number in \[0, 1\] or None, got 1.5"):
        torch.ops.twell.gated_ffn(*gated, *config.op_args()[:7], 1.5)
    with pytest.raises(ValueError, match="neuron_groups must be a positive int, got 0"):
        torch.ops.twell.ffn(*plain, *config.op_args()[:-1], 0)
    with pytest.raises(TypeError, match="config must be a twell.kernels.policy.LayerConfig"):
        twell.ops.gated_ffn(*_gated_args(case), config={"tile_n": 32})

    def f(x):
        return twell.ops.gated_ffn(x, *_gated_args(case)[1:], config=config)

    assert torch.equal(torch.compile(f, fullgraph=True, backend="aot_eager")(case["x"]), f(case["x"]))


def test_layer_config_route():
    """policy.route decides from the layer's config; replace(route=...) forces a path."""
    default = twell.LayerConfig()
    assert [policy.route(m, 2048, default) for m in (0, 8, 9, 16384)] == ["dense", "decode", "dense", "prefill"]
    assert policy.route(16, 2048, default, density=0.005) == "decode"  # known sparse: up to 16 tokens
    assert policy.route(16, 2048, default.replace(decode_sparse_max_m=8), density=0.005) == "dense"
    assert policy.route(100, 2048, default.replace(prefill_min_m=100)) == "prefill"
    assert policy.route(1 << 20, 2048, default.replace(prefill_min_m=None)) == "dense"
    for path in policy.ROUTES:
        forced = default.replace(route=path)
        assert {policy.route(m, 2048, forced, density=0.5) for m in (1, 9, 16, 100, 1 << 20)} == {path}
        assert policy.route(4, policy.MAX_K + 1, forced) == "dense"  # K the kernels cannot take
    assert default.replace(route="prefill").dense_above == 1.0  # no measured density sends it dense
    # dense_above None (the default): by the layer's width
    assert [policy.dense_above_of(default, k) for k in (1024, 2048, 4095, 4096, 8192)] == [0.008] * 3 + [0.007] * 2
    assert policy.dense_above_of(default.replace(dense_above=0.02), 4096) == 0.02
    with pytest.raises(ValueError, match="dense_above must be a number or None, got '0.01'"):
        twell.LayerConfig(dense_above="0.01")


def test_prefill_threshold_by_width():
    """Layers of width >= 4096 prefill from 8192 tokens (a call's GPU work hides its host time there),
    narrower ones from 16384; default_config is DEFAULT with its width's threshold."""
    assert [policy.prefill_min_m_of(k) for k in (64, 2048, 4095, 4096, 8192)] == [16384] * 3 + [8192] * 2
    assert policy.default_config(2048) == policy.DEFAULT
    assert policy.default_config(4096) == policy.DEFAULT.replace(prefill_min_m=8192)
    assert policy.route(8192, 4096, policy.default_config(4096)) == "prefill"
    assert policy.route(8191, 4096, policy.default_config(4096)) == "dense"
    assert policy.route(8192, 2048, policy.default_config(2048)) == "dense"


@pytest.mark.parametrize("k", [64, 4096])
def test_functions_without_a_config_run_their_widths_defaults(k, monkeypatch):
    """twell.ops' functions called without a config route by policy.default_config(K)."""
    from twell.kernels import dispatch

    seen = []
    for name in ("gated_ffn_cuda", "ffn_cuda"):
        monkeypatch.setattr(dispatch, name, lambda x, *a: seen.append(a[-1]) or torch.zeros_like(x))
    monkeypatch.setattr(twell.ops, "DIRECT_DEVICE", "cpu")  # the direct call reaches the dispatcher
    x, w, wd = torch.randn(1, k), torch.randn(8, k), torch.randn(k, 8)
    twell.ops.gated_ffn(x, w, w, wd)
    twell.ops.ffn(x, w, wd)
    twell.ops.ffn(x, w, wd, config=policy.DEFAULT)
    assert seen == [policy.default_config(k)] * 2 + [policy.DEFAULT]


@pytest.fixture
def direct(monkeypatch):
    """twell.ops' direct call enabled on the CPU (it is for CUDA): records each call of the dispatcher it
    makes (its route arguments) and each dense-route call, "dense" (the CPU op itself runs the reference
    and calls neither)."""
    from twell.kernels import dense, dispatch

    calls = []
    for name in ("gated_ffn_cuda", "ffn_cuda"):
        real = getattr(dispatch, name)
        monkeypatch.setattr(dispatch, name, lambda *a, _real=real: calls.append(a[-1]) or _real(*a))
    for name in ("gated_ffn_dense", "ffn_dense"):
        real = getattr(dense, name)
        monkeypatch.setattr(dense, name, lambda *a, _real=real: calls.append("dense") or _real(*a))
    monkeypatch.setattr(twell.ops, "DIRECT_DEVICE", "cpu")
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("variant", ["relu-bias", "fatrelu", "drelu", "plain", "plain-relu2"])
def test_direct_dense_route_is_the_op_bit_for_bit(variant, dtype, direct):
    """Eager, no autograd, a size every state routes dense (64 tokens: above the decode limits, below
    prefill): twell.ops runs the dispatcher itself, whose dense route (the Triton act_mul in the
    interpreter) gives the same bits as the op's (3-D x, biases, thresholds, relu², dReLU)."""
    gated = not variant.startswith("plain")
    case = make_ffn(64, 24, 70, [0.0, 0.1, 0.5], torch.float32, biases=variant == "relu-bias", gated=gated)
    case = {name: t.to(dtype) if t is not None else None for name, t in case.items()}
    x = case["x"].reshape(4, 16, 24)
    threshold = 0.05 if variant == "fatrelu" else 0.0
    if gated:
        biases = {"gate_bias": case["gate_bias"], "up_bias": case["up_bias"], "down_bias": case["down_bias"]}
        y = twell.ops.gated_ffn(x, *_gated_args(case)[1:], threshold=threshold, drelu=variant == "drelu", **biases)
        args = (*_gated_args(case)[1:], *biases.values(), threshold, variant == "drelu")
        op = torch.ops.twell.gated_ffn(x, *args)
    else:
        squared = variant == "plain-relu2"
        y = twell.ops.ffn(x, case["up_weight"], case["down_weight"], squared=squared)
        op = torch.ops.twell.ffn(x, case["up_weight"], case["down_weight"], None, None, 0.0, squared)
    assert direct == [twell.LayerConfig(), "dense"]
    assert y.shape == x.shape and torch.equal(y, op)


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
@pytest.mark.parametrize("route", ["decode", "prefill"])
def test_direct_call_takes_every_route_with_the_layers_config(route, gated, direct):
    """The sparse routes too: the layer's config reaches the dispatcher unchanged (no op arguments
    round trip), and the result is the FFN's (float64 reference)."""
    case = make_ffn(24, 16, 300, [0.02, 0.0, 0.05], torch.float32, biases=True, gated=gated)
    config = twell.LayerConfig().replace(route=route, hot_rate=None)
    x = case["x"].reshape(2, 12, 16)
    if gated:
        biases = {"gate_bias": case["gate_bias"], "up_bias": case["up_bias"], "down_bias": case["down_bias"]}
        y = twell.ops.gated_ffn(x, *_gated_args(case)[1:], **biases, config=config)
        want = gated_ref(case)
    else:
        biases = {"up_bias": case["up_bias"], "down_bias": case["down_bias"]}
        y = twell.ops.ffn(x, case["up_weight"], case["down_weight"], **biases, config=config)
        want = plain_ref(case)
    assert direct == [config]
    assert y.shape == x.shape and rel_err(y.reshape(want.shape), want) < 1e-5


def test_direct_call_not_under_autograd_tensor_subclasses_or_dispatch_modes(direct):
    from torch.utils._python_dispatch import TorchDispatchMode

    case = make_ffn(64, 16, 40, [0.2], torch.float32)
    x = case["x"].clone().requires_grad_()
    twell.ops.gated_ffn(x, *_gated_args(case)[1:]).sum().backward()  # the op's autograd
    assert direct == [] and x.grad is not None
    with torch.no_grad():  # a leaf needing grad, but no graph recorded: direct
        twell.ops.gated_ffn(x, *_gated_args(case)[1:])
    assert direct == [twell.LayerConfig(), "dense"]

    class Marked(torch.Tensor):
        pass

    direct.clear()
    twell.ops.gated_ffn(case["x"].as_subclass(Marked), *_gated_args(case)[1:])
    assert direct == []

    class Seen(TorchDispatchMode):  # a recording mode sees the op, not the dispatcher's kernels one by one
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Seen() as seen:
        twell.ops.gated_ffn(*_gated_args(case))
    assert direct == [] and seen.ops == ["twell.gated_ffn.default"]


def _traced_calls(fn, sizes, k):
    """The calls each graph torch.compile (fullgraph) traced for fn holds, compiling fn at each token
    count of `sizes` in turn (the second size of a dimension makes it dynamic)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append([str(node.target) for node in gm.graph.nodes if node.op == "call_function"])
        return gm.forward

    torch._dynamo.reset()  # no dynamic dimension or cache entry left by an earlier test
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    outputs = [(compiled(x), fn(x)) for x in (torch.randn(m, k) for m in sizes)]
    return graphs, outputs


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
def test_compiled_dense_size_traces_plain_ops(gated, direct):
    """Under torch.compile a size every state routes dense is traced as the dense FFN's torch ops (no
    twell op: Inductor compiles it as it compiles the dense model), with dynamo guarding the decision: a
    later decode-size call of the same dynamic graph traces the op. Results equal eager's."""
    n, k = 40, 16
    case = make_ffn(1, k, n, [0.2], torch.float32, biases=True, gated=gated)
    down = case["down_weight"]  # make_ffn's: sparsify's layout, rows of down_weight^T contiguous

    def fn(x):
        if gated:
            return twell.ops.gated_ffn(x, case["gate_weight"], case["up_weight"], down, gate_bias=case["gate_bias"])
        return twell.ops.ffn(x, case["up_weight"], down, up_bias=case["up_bias"], squared=True)

    graphs, outputs = _traced_calls(fn, (64, 100, 8, 300), k)
    op = "twell.gated_ffn" if gated else "twell.ffn"
    assert [op in calls for calls in graphs] == [False, False, True]  # static 64, dynamic 9+, then 8 tokens
    assert all("linear" in " ".join(calls) for calls in graphs[:2])
    for compiled, eager in outputs:
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    # eager calls run the dispatcher (the three dense sizes its dense route), never the traced ops
    assert direct.count("dense") == 3 and len(direct) == 4 + 3


def test_compiled_call_keeps_the_op_where_a_state_routes_sparse(direct):
    """Prefill sizes, and every size with the down weight in the nn.Linear layout, as the eager call."""
    case = make_ffn(1, 16, 40, [0.2], torch.float32)
    config = twell.LayerConfig(prefill_min_m=32)
    graphs, _ = _traced_calls(lambda x: twell.ops.gated_ffn(x, *_gated_args(case)[1:], config=config), [64], 16)
    assert any("twell.gated_ffn" in call for call in graphs[0])
    linear_layout = case["down_weight"].contiguous()  # [K, N]: the kernels do not read it, dense in every state
    graphs, _ = _traced_calls(lambda x: twell.ops.gated_ffn(x, *_gated_args(case)[1:3], linear_layout), [8], 16)
    assert not any("twell.gated_ffn" in call for call in graphs[0])


def test_direct_call_checks_as_the_op(direct):
    case = make_ffn(64, 16, 40, [0.2], torch.float32)
    with pytest.raises(ValueError, match="up_weight"):
        twell.ops.gated_ffn(case["x"], case["gate_weight"], case["up_weight"][:30], case["down_weight"])
    with pytest.raises(ValueError, match="threshold"):
        twell.ops.gated_ffn(*_gated_args(case), threshold=float("inf"))
    assert direct == []  # the checks ran first


@pytest.mark.gpu
@pytest.mark.parametrize("route,m", [("dense", 256), ("decode", 8), ("prefill", 256)])
def test_direct_call_on_cuda_is_the_op(route, m):
    """bf16, K=2048 N=5632 (an eager prompt's or decode step's call): twell.ops on a sparsify-style down
    weight (rows stored [N, K]) gives the op's bits on each route, eagerly and replayed from a CUDA graph."""
    torch.manual_seed(0)
    x = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16)
    gate, up = (torch.randn(5632, 2048, device="cuda", dtype=torch.bfloat16) / 45 for _ in range(2))
    down = (torch.randn(5632, 2048, device="cuda", dtype=torch.bfloat16) / 75).t()  # the kernels' layout
    config = twell.LayerConfig().replace(route=route, hot_rate=None)
    args = (x, gate, up, down)
    op = torch.ops.twell.gated_ffn(*args, None, None, None, 0.0, False, *config.op_args())
    assert torch.equal(twell.ops.gated_ffn(*args, config=config), op)
    graph, out = torch.cuda.CUDAGraph(), None
    with torch.cuda.graph(graph):
        out = twell.ops.gated_ffn(*args, config=config)
    out.fill_(float("nan"))
    graph.replay()
    assert torch.equal(out, op)
