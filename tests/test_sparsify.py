"""sparsify / restore / report / save_plan on tiny randomly initialised transformers models, built offline."""

from __future__ import annotations

import json

import pytest
import torch
from ffn_cases import GatedBlock
from models import (
    DEFAULT_NOT_RELU,
    FAMILIES,
    LAYERS,
    MOE_FAMILIES,
    VOCAB,
    build,
    logits,
    modules_of,
    snapshot,
    token_ids,
)

import twell
from twell.passes import find_ffns
from twell.passes.modules import TWELL_MODULES
from twell.passes.projections import linear_weight

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
CONV1D_FAMILIES = {"gpt2"}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_relu_family(family):
    model = build(family)
    _, _, _, _, kind, first_path = FAMILIES[family]
    ids = token_ids()
    expected = logits(model, ids)
    before = snapshot(model)
    storage = {k: v.data_ptr() for k, v in model.state_dict().items()}
    params = {k: id(p) for k, p in model.named_parameters()}

    candidates = find_ffns(model)
    assert len(candidates) == LAYERS
    assert candidates[0].path == first_path
    assert all(c.kind == kind and c.activation == "relu" and c.rewritable for c in candidates), candidates

    assert twell.sparsify(model) is model
    assert sum(isinstance(m, TWELL_MODULES) for m in model.modules()) >= LAYERS
    torch.testing.assert_close(logits(model, ids), expected, atol=1e-5, rtol=1e-5)
    # Same keys, shapes and tensor objects, no second copy: the storage is the same except nn.Linear down
    # projections', re-laid once so that the kernels read rows of down_weight^T (a Conv1D's are already)
    now = {k: v.data_ptr() for k, v in model.state_dict().items()}
    assert list(now) == list(storage)
    moved = {k for k in storage if now[k] != storage[k]}
    downs = [f"{c.path.split('[')[0]}.{c.spec.down}.weight" for c in candidates]
    assert moved == (set() if family in CONV1D_FAMILIES else set(downs)), moved
    assert all(linear_weight(model.get_submodule(k.removesuffix(".weight"))).t().is_contiguous() for k in downs)
    assert {k: id(p) for k, p in model.named_parameters()} == params
    report = twell.report(model)
    assert [r.path for r in report] == [c.path for c in candidates]
    assert all(r.rewritten and r.reason == "" for r in report)

    layout, state = modules_of(model), snapshot(model)
    twell.sparsify(model)  # idempotent
    assert modules_of(model) == layout
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())

    assert twell.restore(model) is model
    assert not any(isinstance(m, TWELL_MODULES) for m in model.modules())
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(v.is_contiguous() for v in after.values()), "restore puts the nn.Linear layout back"
    assert all(torch.equal(after[k], v) and after[k].dtype == v.dtype for k, v in before.items())
    assert torch.equal(logits(model, ids), expected)


@pytest.mark.parametrize("family", ["gpt_neox", "opt"])  # OPT: inline, the activation module traced through
def test_relu_squared(family):
    model = build(family, "relu2")
    ids = token_ids()
    expected = logits(model, ids)
    assert [c.activation for c in find_ffns(model)] == ["relu2"] * LAYERS
    twell.sparsify(model)
    assert all(r.rewritten for r in twell.report(model))
    torch.testing.assert_close(logits(model, ids), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", list(DEFAULT_NOT_RELU))
def test_default_activation_left_untouched(family):
    model = build(family, activation=None)
    ids = token_ids()
    expected = logits(model, ids)
    layout = modules_of(model)
    twell.sparsify(model)
    assert modules_of(model) == layout
    assert torch.equal(logits(model, ids), expected)
    records = twell.report(model).records
    name = DEFAULT_NOT_RELU[family]
    assert len(records) == LAYERS
    for r in records:
        assert r.matched and not r.rewritable and not r.rewritten and r.activation == name
        assert f"activation {name} is not sparse" in r.reason and "ReLU + L1" in r.reason


def test_t5_relu_ffn_with_dropout_inside():
    """T5's DenseReluDense is wo(dropout(relu(wi(x)))): rewritten for eval; in training the replacement
    runs the original forward, so dropout still acts."""
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_ff=64, d_kv=8, num_layers=1, num_heads=4, feed_forward_proj="relu"
    )
    model = transformers.T5ForConditionalGeneration(config).eval()
    ids = token_ids()
    inputs = {"input_ids": ids, "decoder_input_ids": ids}
    with torch.no_grad():
        expected = model(**inputs).logits
        twell.sparsify(model)
        torch.testing.assert_close(model(**inputs).logits, expected, atol=1e-5, rtol=1e-5)
    assert [r.path for r in twell.report(model) if r.rewritten] == [
        "encoder.block.0.layer.1.DenseReluDense",
        "decoder.block.0.layer.2.DenseReluDense",
    ]
    model.train()
    torch.manual_seed(3)
    sparse_train = model(**inputs).logits
    twell.restore(model)
    torch.manual_seed(3)
    assert torch.equal(sparse_train, model(**inputs).logits)


EXPERTS = MOE_FAMILIES["mixtral"][2]["num_local_experts"]


def build_mixtral(activation="relu", seed=0):
    return build("mixtral", activation, seed)


def routed_tokens(model, ids) -> list[list[int]]:
    """Per layer, the number of tokens the router sends to each expert."""
    counts = []
    hooks = [
        layer.mlp.experts.register_forward_hook(
            lambda m, args, out: counts.append(torch.bincount(args[1].flatten(), minlength=EXPERTS).tolist())
        )
        for layer in model.model.layers
    ]
    logits(model, ids)
    for h in hooks:
        h.remove()
    return counts


def test_mixtral_relu_experts_run_through_twell_ops(monkeypatch):
    """transformers 5 stores Mixtral's experts as 3-D parameters: each expert is a candidate, the experts
    module is swapped for one that runs each expert's routed tokens through the op, the router stays."""
    from twell.kernels import reference
    from twell.passes.experts import SparseExperts

    model = build_mixtral()
    ids = token_ids()
    expected = logits(model, ids)
    before = snapshot(model)
    routers = [layer.mlp.gate for layer in model.model.layers]
    candidates = find_ffns(model)
    assert [c.path for c in candidates] == [
        f"model.layers.{i}.mlp.experts.{e}" for i in range(LAYERS) for e in range(EXPERTS)
    ]
    assert all(
        (c.kind, c.activation, c.rewritable, c.hidden_size, c.model_size) == ("gated", "relu", True, 64, 32)
        for c in candidates
    )
    twell.sparsify(model)
    assert all(isinstance(layer.mlp.experts, SparseExperts) for layer in model.model.layers)
    assert [layer.mlp.gate for layer in model.model.layers] == routers
    calls = []
    gated_ffn = reference.gated_ffn_reference
    monkeypatch.setattr(
        reference, "gated_ffn_reference", lambda x, *rest: calls.append(x.shape[0]) or gated_ffn(x, *rest)
    )
    torch.testing.assert_close(logits(model, ids), expected, atol=1e-5, rtol=1e-5)
    routed = routed_tokens(model, ids)
    assert sorted(calls) == sorted([n for layer in routed for n in layer if n] * 2)  # two logits() calls
    # every expert's down weight, as the op takes it ([K, N]), has rows of down_weight.t() contiguous
    for layer in model.model.layers:
        assert all(layer.mlp.experts.down_proj[e].t().is_contiguous() for e in range(EXPERTS))
    assert all(r.rewritten for r in twell.report(model))
    twell.restore(model)
    after = model.state_dict()
    assert list(after) == list(before) and all(v.is_contiguous() for v in after.values())
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert torch.equal(logits(model, ids), expected)


@pytest.mark.parametrize("sparsified", [False, True], ids=["compiled", "sparsified-then-compiled"])
def test_mixtral_compiled(sparsified):
    model = build_mixtral()
    ids = token_ids()
    expected = logits(model, ids)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(twell.sparsify(model) if sparsified else model, backend="twell")
        torch.testing.assert_close(logits(compiled, ids), expected, atol=1e-5, rtol=1e-5)
    finally:
        torch._dynamo.reset()


def test_mixtral_calibration_measures_each_expert(tmp_path):
    model = build_mixtral()
    ids = token_ids()
    expected = logits(model, ids)
    routed = [n for layer in routed_tokens(model, ids) for n in layer]
    # min_speedup 0 and overflow up to 99%: every expert with a layout is rewritten whatever its density
    config = {**QUICK_CALIBRATION, "min_speedup": 0.0, "max_overflow": 0.99}
    twell.sparsify(model, [ids], config=config)
    records = list(twell.report(model))
    assert [r.decision["stats"].get("prefill", {}).get("rows", 0) for r in records] == routed
    densities = [r.decision["density"] for r in records if r.decision["density"] is not None]
    assert len(set(densities)) > 1  # measured per expert, not per layer
    assert [r.rewritten for r in records] == [n > 0 for n in routed]
    torch.testing.assert_close(logits(model, ids), expected, atol=1e-5, rtol=1e-5)
    # each rewritten expert runs with its own decision's layout
    layouts = {r.path: (r.decision["tile_n"], r.decision["slots"]) for r in records}
    configs = twell.layer_configs(model)
    assert set(configs) == {r.path for r in records if r.rewritten}
    assert all((c.tile_n, c.slots) == layouts[path] for path, c in configs.items())
    plan = tmp_path / "plan.json"
    twell.save_plan(model, plan)
    other = twell.sparsify(build_mixtral(), plan=plan)
    assert [r.rewritten for r in twell.report(other)] == [r.rewritten for r in records]
    assert twell.layer_configs(other) == configs
    torch.testing.assert_close(logits(other, ids), expected, atol=1e-5, rtol=1e-5)


def _interleaved(experts):
    experts.is_concatenated = False
    return "experts interleave gate and up rows"


def _post_norm(experts):
    experts.has_post_expert_norm = True
    experts.post_expert_norm = torch.nn.Identity()
    return "experts apply a norm after each expert"


def _own_gate(experts):
    experts.__class__ = type("GatedExperts", (type(experts),), {"_apply_gate": lambda self, out: out.chunk(2, -1)[1]})
    return "GatedExperts has its own _apply_gate"


def _act_hook(experts):
    experts.act_fn.register_forward_hook(lambda m, args, out: out)
    return "activation act has forward hooks"


def _expert_parallel(experts):
    experts._is_expert_parallel = True
    return "experts are split across devices"


def _instance_forward(experts):
    experts.forward = experts.forward  # what offloading hooks do
    return "forward is replaced on the instance"


@pytest.mark.parametrize(
    "change", [_interleaved, _post_norm, _own_gate, _act_hook, _expert_parallel, _instance_forward]
)
def test_experts_twell_cannot_serve_are_reported(change):
    model = build_mixtral()
    reason = change(model.model.layers[0].mlp.experts)
    ids = token_ids()
    expected = logits(model, ids)
    layer0, *rest = find_ffns(model)
    assert (layer0.path, layer0.rewritable, layer0.activation) == ("model.layers.0.mlp.experts", False, "relu")
    assert reason in layer0.reason
    assert len(rest) == EXPERTS and all(c.rewritable for c in rest)
    twell.sparsify(model)
    assert type(model.model.layers[0].mlp.experts).__name__ != "SparseExperts"
    torch.testing.assert_close(logits(model, ids), expected, atol=1e-5, rtol=1e-5)


def test_silu_experts_are_one_record_per_layer_with_the_reason():
    model = build_mixtral(activation="silu")
    records = list(twell.report(model))
    assert [r.path for r in records] == [f"model.layers.{i}.mlp.experts" for i in range(LAYERS)]
    assert all(
        not r.rewritable and r.activation == "silu" and "activation silu is not sparse" in r.reason for r in records
    )


def test_report_table_and_json():
    model = build("llama")
    report = twell.report(model)
    assert [r.rewritten for r in report] == [False] * LAYERS  # not sparsified yet: found, not rewritten
    twell.sparsify(model)
    report = twell.report(model)
    data = json.loads(json.dumps(report.to_dict()))
    assert data["summary"] == {"candidates": LAYERS, "rewritable": LAYERS, "rewritten": LAYERS, "unmatched": 0}
    record = data["records"][0]
    assert record["path"] == "model.layers.0.mlp" and record["activation"] == "relu" and record["rewritten"]
    assert (record["hidden_size"], record["model_size"]) == (64, 32)
    text = str(report)
    assert "model.layers.1.mlp" in text and "2 of 2 FFNs rewritten" in text

    opt = twell.sparsify(build("opt"))
    assert "model.decoder.layers.0[fc1,fc2]" in str(twell.report(opt))  # brackets survive rich markup

    text = str(twell.report(twell.sparsify(build("llama", "silu"))))
    assert max(len(line) for line in text.splitlines()) <= 80 and "model.layers.1.mlp  " in text
    # The reason both layers share is one note under the table.
    assert text.count("not rewritable (1)") == LAYERS and text.count("(1) activation silu is not sparse") == 1


def test_save_pretrained_while_sparsified(tmp_path):
    model = build("phi3")
    ids = token_ids()
    expected = logits(model, ids)
    model.save_pretrained(tmp_path / "dense")
    twell.sparsify(model)
    model.save_pretrained(tmp_path / "sparse")
    # the re-laid down weights are saved in the ordinary layout: the very same file
    files = [p.name for p in (tmp_path / "dense").glob("*.safetensors")]
    assert files and all((tmp_path / "dense" / f).read_bytes() == (tmp_path / "sparse" / f).read_bytes() for f in files)
    loaded = transformers.Phi3ForCausalLM.from_pretrained(tmp_path / "sparse").eval()
    assert not any(isinstance(m, TWELL_MODULES) for m in loaded.modules())
    assert torch.equal(logits(loaded, ids), expected)
    # loading weights into the sparsified model keeps the kernels' layout and the values
    model.load_state_dict(loaded.state_dict())
    assert torch.equal(logits(model, ids), expected)
    assert all(m.down_proj.weight.t().is_contiguous() for m in (layer.mlp for layer in model.model.layers))


def test_dtype_change_after_sparsify_reaches_restored_modules():
    model = build("llama")
    twell.sparsify(model)
    model.to(torch.bfloat16)
    ids = token_ids()
    assert logits(model, ids).dtype == torch.bfloat16
    twell.restore(model)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.model.layers[0].mlp.gate_proj.weight.dtype == torch.bfloat16


QUICK_CALIBRATION = {"decode_steps": 0, "timing_repeats": 0, "progress": False}


def test_calibration_decisions_and_plan(tmp_path):
    pytest.importorskip("twell.calibrate")
    model = build("llama-bias")
    for layer in model.model.layers:  # a negative gate bias: a few percent of neurons fire, as in a sparse model
        layer.mlp.gate_proj.bias.data.fill_(-0.2)
    ids = token_ids()
    expected = logits(model, ids)
    # min_speedup 0: every layer with a TwELL layout is rewritten, whatever the CPU cost model predicts.
    twell.sparsify(model, [ids], config={**QUICK_CALIBRATION, "min_speedup": 0.0})
    report = twell.report(model)
    assert all(r.decision is not None and "density" in r.decision for r in report)
    assert all(r.rewritten and r.decision["rewrite"] for r in report)
    torch.testing.assert_close(logits(model, ids), expected, atol=1e-5, rtol=1e-5)
    json.dumps(report.to_dict())

    plan = tmp_path / "plan.json"
    twell.save_plan(model, plan)
    other = twell.sparsify(build("llama-bias"), plan=plan)
    assert [(r.path, r.rewritten) for r in twell.report(other)] == [(r.path, r.rewritten) for r in report]


def _route_args_of_compiled_ops(model, ids) -> list[tuple]:
    """The route arguments (LayerConfig.op_args) of every twell op call in the model's compiled graphs."""
    seen = []
    ops = (torch.ops.twell.gated_ffn, torch.ops.twell.ffn)

    def backend(gm, example_inputs):
        seen.extend(
            tuple(n.args[-len(twell.LayerConfig().op_args()) :])
            for n in gm.graph.nodes
            if n.target in ops or getattr(n.target, "_overloadpacket", None) in ops
        )
        return gm.forward

    torch._dynamo.reset()
    try:
        with torch.no_grad():
            torch.compile(model, backend=backend)(ids)
    finally:
        torch._dynamo.reset()
    return seen


def test_calibrated_layout_reaches_the_op(tmp_path):
    """The layout calibration chose for a layer (here the only one offered) is what its op is called
    with, as a plan re-applies it; layer_config changes the route limits on top."""
    model = build("llama-bias")
    for layer in model.model.layers:
        layer.mlp.gate_proj.bias.data.fill_(-0.2)
    ids = token_ids()
    config = {**QUICK_CALIBRATION, "min_speedup": 0.0, "max_overflow": 0.99, "layouts": [(32, 8)]}
    twell.sparsify(model, [ids], config=config, layer_config={"prefill_min_m": 4096})
    expected = twell.LayerConfig(tile_n=32, slots=8, prefill_min_m=4096)
    configs = twell.layer_configs(model)
    assert len(configs) == LAYERS and set(configs.values()) == {expected}
    assert _route_args_of_compiled_ops(model, ids) == [expected.op_args()] * LAYERS
    plan = tmp_path / "plan.json"
    twell.save_plan(model, plan)
    other = twell.sparsify(build("llama-bias"), plan=plan)
    assert set(twell.layer_configs(other).values()) == {twell.LayerConfig(tile_n=32, slots=8)}
    with pytest.raises(ValueError, match="each layer's layout is its decision's"):
        twell.sparsify(model, [ids], config=config, layer_config={"tile_n": 64})
    with pytest.raises(ValueError, match="each layer's layout is its decision's"):
        twell.sparsify(build("llama-bias"), plan=plan, layer_config={"slots": 4})


def test_sparsify_gives_each_layer_its_widths_prefill_threshold():
    """Without calibration a layer of width >= 4096 prefills from 8192 tokens, a narrower one from 16384
    (policy.default_config); a layer_config change still wins."""
    from twell.kernels import policy

    narrow, wide = (twell.sparsify(GatedBlock(k, 16)) for k in (64, 4096))
    assert list(twell.layer_configs(narrow).values()) == [policy.DEFAULT]
    assert [c.prefill_min_m for c in twell.layer_configs(wide).values()] == [8192]
    assert list(twell.layer_configs(wide).values()) == [policy.default_config(4096)]
    explicit = twell.sparsify(GatedBlock(4096, 16), layer_config={"prefill_min_m": 16384})
    assert list(twell.layer_configs(explicit).values()) == [policy.DEFAULT]


def test_configure_sets_every_layer_config(monkeypatch):
    """sparsify(layer_config=...) and configure() set what each rewritten FFN hands twell.ops; configure
    in a with block puts the previous configs back."""
    model = twell.sparsify(build("opt"), layer_config={"decode_max_m": 2})  # inline FFNs
    seen = []
    ffn = twell.ops.ffn
    monkeypatch.setattr(twell.ops, "ffn", lambda *a, **k: seen.append(k["config"]) or ffn(*a, **k))
    ids = token_ids()
    logits(model, ids)
    assert seen == [twell.LayerConfig(decode_max_m=2)] * LAYERS
    with twell.configure(model, route="prefill"):
        seen.clear()
        logits(model, ids)
        prefill = twell.LayerConfig().replace(route="prefill")
        assert seen == [prefill] * LAYERS and prefill.prefill_min_m == 1 and prefill.decode_max_m == 0
    assert set(twell.layer_configs(model).values()) == {twell.LayerConfig(decode_max_m=2)}
    twell.configure(model, prefill_min_m=64)
    twell.sparsify(model, layer_config={"train_min_m": 4096})  # already sparsified: changes on top
    assert set(twell.layer_configs(model).values()) == {
        twell.LayerConfig(decode_max_m=2, prefill_min_m=64, train_min_m=4096)
    }
    with pytest.raises(ValueError, match="needs a model sparsified"):
        twell.configure(build("opt"), route="dense")
    with pytest.raises(ValueError, match=r"unknown LayerConfig field\(s\) \['tile'\]"):
        twell.configure(model, tile=64)
    with pytest.raises(ValueError, match="route must be one of"):
        twell.configure(model, route="fast")
    with pytest.raises(ValueError, match="power-of-two tile_n"):
        twell.configure(model, tile_n=96)
    with pytest.raises(TypeError, match="layer_config must be a dict"):
        twell.sparsify(build("opt"), layer_config=twell.LayerConfig())
    assert twell.layer_configs(twell.restore(model)) == {}


def test_training_routing_follows_the_layer_config(monkeypatch):
    """train_min_m reaches the sparse-training routing from the module's config (off by default)."""
    from twell.kernels import library as kernel_ops

    seen = []
    sparse_training = kernel_ops.sparse_training
    monkeypatch.setattr(kernel_ops, "sparse_training", lambda *a: seen.append(a[-1]) or sparse_training(*a))
    model = twell.sparsify(build("llama"))
    logits(model, token_ids())
    twell.configure(model, train_min_m=128)
    logits(model, token_ids())
    assert seen == [None] * LAYERS + [128] * LAYERS


def test_sparsify_with_data_restores_first():
    pytest.importorskip("twell.calibrate")
    model = twell.sparsify(build("llama"))
    # min_speedup above any prediction: calibration says no, and the earlier rewrite is undone.
    twell.sparsify(model, [token_ids()], config={**QUICK_CALIBRATION, "min_speedup": 1e9})
    report = twell.report(model)
    assert all(r.decision is not None and not r.rewritten and r.reason for r in report)
    assert not any(isinstance(m, TWELL_MODULES) for m in model.modules())


def test_errors(tmp_path):
    model = build("llama")
    with pytest.raises(TypeError, match="torch.nn.Module"):
        twell.sparsify("not a model")
    with pytest.raises(ValueError, match="not both"):
        twell.sparsify(model, [token_ids()], plan=tmp_path / "plan.json")
    with pytest.raises(ValueError, match="give calibration_data"):
        twell.sparsify(model, config={})
    with pytest.raises(TypeError, match="plan must be a path"):
        twell.sparsify(model, plan=3)
    with pytest.raises(ValueError, match="no decisions to save"):
        twell.save_plan(twell.sparsify(model), tmp_path / "plan.json")
    assert twell.restore(build("llama")) is not None  # nothing to restore: unchanged


class _HandMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = torch.nn.Linear(16, 48), torch.nn.Linear(16, 48), torch.nn.Linear(48, 16)

    def forward(self, x):
        return self.down(torch.relu(self.gate(x)) * self.up(x))


class _InlineBlock(torch.nn.Module):  # the FFN written inline, as OPT's decoder layer does
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = torch.nn.Linear(16, 48), torch.nn.ReLU(), torch.nn.Linear(48, 16)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


@pytest.mark.parametrize("module", [_HandMLP, _InlineBlock], ids=["module", "inline"])
def test_autocast_and_mixed_dtypes_run_like_the_original(module):
    """A bf16 activation reaching fp32 weights under autocast: the op (one dtype) cannot take it, so
    the rewritten FFN computes as the original linears do."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(module()).eval()
    x = torch.randn(5, 16, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        expected = model(x)
        twell.sparsify(model)
        assert any(r.rewritten for r in twell.report(model).records)
        got = model(x)
    assert torch.equal(got, expected)


def test_hook_added_after_sparsify_takes_effect():
    model = build("llama")
    ids = token_ids()
    twell.sparsify(model)
    before = logits(model, ids)
    handle = model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, out: out * 0)
    hooked = logits(model, ids)
    handle.remove()
    twell.restore(model)
    model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, out: out * 0)
    assert not torch.allclose(hooked, before)
    assert torch.allclose(hooked, logits(model, ids), atol=1e-5)


def test_warmup_runs_every_rewritten_ffn(monkeypatch):
    from twell.passes import modules

    model = twell.sparsify(build("opt"))  # inline FFNs
    calls = []
    run_ffn = modules.run_ffn
    monkeypatch.setattr(
        modules, "run_ffn", lambda spec, g, u, d, x, c: calls.append(x.shape) or run_ffn(spec, g, u, d, x, c)
    )
    seconds = twell.warmup(model, token_counts=(1, 5))
    assert list(seconds) == [1, 5] and all(s >= 0 for s in seconds.values())
    assert sorted(calls) == sorted([(1, 32)] * LAYERS + [(5, 32)] * LAYERS)
    with pytest.raises(ValueError, match="positive ints"):
        twell.warmup(model, token_counts=(0,))
    with pytest.raises(ValueError, match="nothing to warm up in LlamaForCausalLM: it is not sparsified"):
        twell.warmup(build("llama"))


def test_conv1d_ffn_reaches_the_sparse_route_without_copies(monkeypatch):
    """GPT-2's Conv1D weights go to the op as views of the very Parameters. The down weight passes the
    dispatcher's layout test for the sparse kernels (down_weight.t() with unit stride on K); gate weights
    are read through their strides."""
    from twell.kernels import reference

    model = twell.sparsify(build("gpt2"))
    seen = []
    ffn = reference.ffn_reference
    monkeypatch.setattr(
        reference, "ffn_reference", lambda x, up, down, *rest: seen.append((up, down)) or ffn(x, up, down, *rest)
    )
    logits(model, token_ids())
    assert len(seen) == LAYERS
    for (up, down), block in zip(seen, model.transformer.h, strict=True):
        assert down.t().stride(1) == 1  # twell.kernels.dispatch: `wd_t.stride(1) == 1` routes sparse
        assert down.t().data_ptr() == block.mlp.c_proj.weight.data_ptr() and down.shape == (32, 64)
        assert up.data_ptr() == block.mlp.c_fc.weight.data_ptr() and up.shape == (64, 32)


@pytest.mark.parametrize("family", ["gpt2", "bert", "mixtral"])
def test_warmup_runs_conv1d_split_and_expert_ffns(family, monkeypatch):
    from twell.kernels import reference

    model = twell.sparsify(build(family))
    calls = []
    for name in ("ffn_reference", "gated_ffn_reference"):
        original = getattr(reference, name)
        monkeypatch.setattr(reference, name, lambda x, *rest, f=original: calls.append(tuple(x.shape)) or f(x, *rest))
    twell.warmup(model, token_counts=(3,))
    ffns = LAYERS * (EXPERTS if family == "mixtral" else 1)
    assert calls == [(3, 32)] * ffns
