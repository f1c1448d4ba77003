"""twell.train: the L1 activation penalty (eager and sparsified models), relufication, and the training
example's loop."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import twell
import twell.train
from twell.passes.projections import linear_weight

pytest.importorskip("transformers")

from models import build, logits, token_ids  # noqa: E402

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_sparse.py"

# family -> (FFN modules of each layer, by path relative to the layer: gate, up (None: plain), down)
LAYOUT = {
    "llama": ("model.layers", "mlp.gate_proj", "mlp.up_proj"),
    "llama-bias": ("model.layers", "mlp.gate_proj", "mlp.up_proj"),
    "phi3": ("model.layers", "mlp.gate_up_proj", "fused"),
    "gpt_neox": ("gpt_neox.layers", "mlp.dense_h_to_4h", None),
    "opt": ("model.decoder.layers", "fc1", None),
    "gpt2": ("transformer.h", "mlp.c_fc", None),
    "bert": ("bert.encoder.layer", "intermediate.dense", None),
}


def hand_penalty(model, ids, family):
    """mean over layers of sum |h| / (M * N), h computed here from each FFN's input and weights."""
    layers_path, gate_path, up_path = LAYOUT[family]
    layers = model.get_submodule(layers_path)
    inputs, handles = [], []
    for layer in layers:
        gate = layer.get_submodule(gate_path)
        handles.append(gate.register_forward_pre_hook(lambda _m, args: inputs.append(args[0])))
    try:
        model(ids)
    finally:
        for handle in handles:
            handle.remove()
    terms = []
    for layer, x in zip(layers, inputs, strict=True):
        gate = layer.get_submodule(gate_path)
        pre = F.linear(x, linear_weight(gate), gate.bias)
        if up_path == "fused":
            g, u = pre.chunk(2, dim=-1)
            h = torch.relu(g) * u
        elif up_path is not None:
            up = layer.get_submodule(up_path)
            h = torch.relu(pre) * F.linear(x, up.weight, up.bias)
        else:
            h = torch.relu(pre)
        terms.append(h.abs().sum() / h.numel())
    return torch.stack(terms).mean()


@pytest.mark.parametrize("sparsified", [False, True], ids=["eager", "sparsified"])
@pytest.mark.parametrize("family", list(LAYOUT))
def test_penalty_is_the_mean_over_layers_of_mean_abs_h(family, sparsified):
    model, ids = build(family), token_ids()
    with torch.no_grad():
        expected = hand_penalty(model, ids, family)
    if sparsified:
        twell.sparsify(model)
        assert twell.report(model).summary()["rewritten"] == 2
    with twell.train.track_l1(model) as tracker:
        with torch.no_grad():
            model(ids)
        assert len(tracker.l1) == 2
        torch.testing.assert_close(twell.train.l1_penalty(model), expected, rtol=1e-5, atol=0)
        h_density = tracker.density()
    assert all(0.2 < d < 0.8 for d in h_density.values())  # random weights: about half of relu's outputs


@pytest.mark.parametrize("family", ["llama", "phi3", "opt", "gpt2", "bert"])
def test_tracker_paths_are_the_reports(family, tmp_path):
    """One path per FFN across the tracker, twell.report, compile_report and plans, sparsified or not."""
    model = build(family)
    expected = [c.path for c in twell.passes.find_ffns(model)]
    with twell.train.track_l1(model) as tracker:
        assert tracker.paths == expected
    with torch.no_grad():
        torch.compile(model, backend="twell")(token_ids())
    assert [r.path for r in twell.compile_report(model)] == expected
    torch._dynamo.reset()
    twell.sparsify(model, [token_ids()])
    twell.save_plan(model, tmp_path / "plan.json")
    assert [f["path"] for f in json.loads((tmp_path / "plan.json").read_text())["ffns"]] == expected
    assert [r.path for r in twell.report(model)] == expected
    with twell.train.track_l1(model) as tracker:
        with torch.no_grad():
            model(token_ids())
        assert tracker.paths == expected
        assert list(tracker.l1) == expected


def test_density_is_the_fraction_of_nonzero_h():
    model, ids = build("llama"), token_ids()
    kept = []
    with twell.train.track_l1(model) as tracker, torch.no_grad():
        down = model.model.layers[0].mlp.down_proj
        handle = down.register_forward_pre_hook(lambda _m, args: kept.append(args[0] != 0))
        model(ids)
        handle.remove()
        assert tracker.density()["model.layers.0.mlp"] == pytest.approx(kept[0].double().mean().item())


@pytest.mark.parametrize("family", ["llama", "phi3", "opt", "gpt2", "bert"])
def test_gradients_flow_and_match_between_eager_and_sparsified(family):
    """In train() mode, dropout active (GPT-2's and BERT's default): the same draws in both runs."""
    ids = token_ids()
    grads = []
    for sparsified in (False, True):
        model = build(family).train()
        if sparsified:
            twell.sparsify(model)
        with twell.train.track_l1(model):
            torch.manual_seed(3)
            model(ids)
            twell.train.l1_penalty(model).backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
    eager, sparse = grads
    layers_path, gate_path, up_path = LAYOUT[family]
    for i in range(2):
        prefix = f"{layers_path}.{i}."
        assert eager[f"{prefix}{gate_path}.weight"].abs().sum() > 0
        if up_path not in (None, "fused"):
            assert eager[f"{prefix}{up_path}.weight"].abs().sum() > 0
    # through the residual stream, the penalty reaches the attention and the embeddings too
    assert any(g is not None and g.abs().sum() > 0 for n, g in eager.items() if "attn" in n or "attention" in n)
    assert set(eager) == set(sparse)
    for name, grad in eager.items():
        if grad is None:
            assert sparse[name] is None, name
        else:
            torch.testing.assert_close(sparse[name], grad, rtol=1e-4, atol=1e-7, msg=name)


def test_tracking_a_sparsified_model_survives_restore():
    """A SparseFFN's hooks are its original's: after restore the recomputing hook still records h."""
    model, ids = build("llama"), token_ids()
    with torch.no_grad():
        expected = hand_penalty(model, ids, "llama")
    twell.sparsify(model)
    with twell.train.track_l1(model), torch.no_grad():
        twell.restore(model)
        model(ids)
        torch.testing.assert_close(twell.train.l1_penalty(model), expected, rtol=1e-5, atol=0)


class _SquaredPlain(nn.Module):
    """A plain FFN with relu²: h = relu(fc1(x))², the op's squared form."""

    def __init__(self, k=16, n=40):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(k, n), nn.Linear(n, k)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)) ** 2)


def test_sparsified_penalty_of_a_relu_squared_ffn():
    """The sparsified FFN's op gives the penalty of h = relu(.)², as the eager down projection sees it."""
    x = torch.randn(2, 5, 16)
    penalties = []
    for sparsified in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(_SquaredPlain())
        if sparsified:
            twell.sparsify(model)
            assert twell.report(model).summary()["rewritten"] == 1
        with twell.train.track_l1(model), torch.no_grad():
            model(x)
            penalties.append(twell.train.l1_penalty(model))
    torch.testing.assert_close(penalties[1], penalties[0], rtol=1e-5, atol=0)


def test_sparsified_call_that_runs_the_original_forward_recomputes_h():
    """Under autocast a SparseFFN runs its original forward; the penalty is then recomputed from x."""
    ids = token_ids()
    penalties = []
    for sparsified in (False, True):
        model = build("llama")
        if sparsified:
            twell.sparsify(model)
        with twell.train.track_l1(model), torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            model(ids)
            penalties.append(twell.train.l1_penalty(model).float())
    torch.testing.assert_close(penalties[1], penalties[0], rtol=1e-2, atol=0)


def test_penalty_works_under_torch_compile():
    """Dynamo inlines the hooks: the compiled forward records the eager penalty, with the same gradient."""
    model = build("llama").train()
    weight = model.model.layers[0].mlp.gate_proj.weight
    with twell.train.track_l1(model):
        model(token_ids(1))  # a record the compiled forward must replace
        torch.compile(model, backend="aot_eager")(token_ids(2))
        penalty = twell.train.l1_penalty(model)
        (grad,) = torch.autograd.grad(penalty, weight)
        model(token_ids(2))
        expected = twell.train.l1_penalty(model)
        (expected_grad,) = torch.autograd.grad(expected, weight)
    torch.testing.assert_close(penalty, expected)
    torch.testing.assert_close(grad, expected_grad)


def test_compiled_sparse_training_step_of_a_model_compiles_once(monkeypatch):
    """A sparsified model's whole training step (LM loss + L1 penalty, backward, AdamW) compiled, on the
    sparse training path (on CPU through Triton's interpreter: the route's CUDA check lifted): every
    FFN's call is the training op, with no graph break, and after the second step (the tracker's
    record dict goes from empty to filled once) no step compiles again; losses as eager. The layer
    (~50% dense) trains its first call sparse, then dense (train_dense_above): both under compile."""
    from torch._dynamo.utils import counters

    from twell.kernels import backward, library

    # every call with gradients takes the sparse path (on CUDA: those of the kernels' layout)
    monkeypatch.setattr(library, "sparse_training", lambda *args: torch.is_grad_enabled() and args[-1] is not None)
    calls = []
    forward = backward.train_forward
    monkeypatch.setattr(backward, "train_forward", lambda *a, **kw: calls.append(1) or forward(*a, **kw))
    ids = token_ids(3)
    losses = {}
    for compiled in (False, True):
        model = build("llama-bias", num_hidden_layers=1).train()
        twell.sparsify(model, layer_config={"train_min_m": 1, "train_dense_above": 0.3})
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        run = torch.compile(model, backend="aot_eager") if compiled else model
        torch._dynamo.reset()
        losses[compiled], compiles = [], []
        with twell.train.track_l1(model):
            for _ in range(3):
                counters.clear()
                calls.clear()
                optimizer.zero_grad(set_to_none=True)
                loss = run(input_ids=ids, labels=ids).loss + 0.1 * twell.train.l1_penalty(model)
                loss.backward()
                optimizer.step()
                losses[compiled].append(loss.item())
                assert not counters["graph_break"], dict(counters["graph_break"])
                compiles.append(counters["stats"]["unique_graphs"])
                assert len(calls) == 1  # the layer's FFN through the training op
        if compiled:
            assert compiles[2] == 0, compiles
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-4, atol=1e-5)


def test_penalty_records_the_last_forward_only():
    model = build("llama")
    with twell.train.track_l1(model):
        with torch.no_grad():
            model(token_ids(1))
            first = twell.train.l1_penalty(model)
            model(token_ids(2))
            second = twell.train.l1_penalty(model)
            expected = hand_penalty(model, token_ids(2), "llama")
    assert not torch.equal(first, second)
    torch.testing.assert_close(second, expected, rtol=1e-5, atol=0)


def test_tracking_errors_and_removal():
    model = build("llama")
    with pytest.raises(RuntimeError, match="track_l1"):
        twell.train.l1_penalty(model)
    tracker = twell.train.track_l1(model)
    with pytest.raises(RuntimeError, match="no forward recorded"):
        twell.train.l1_penalty(model)
    with pytest.raises(ValueError, match="tracked already"):
        twell.train.track_l1(model)
    down = model.model.layers[0].mlp.down_proj
    assert len(down._forward_pre_hooks) == 1
    tracker.remove()
    assert len(down._forward_pre_hooks) == 0
    with pytest.raises(RuntimeError, match="not tracked"):
        twell.train.l1_penalty(model)
    twell.sparsify(model)  # nothing left behind that would stop the rewrite
    assert twell.report(model).summary()["rewritten"] == 2
    with pytest.raises(TypeError, match="torch.nn.Module"):
        twell.train.track_l1("model")


def test_silu_model_is_refused_until_relufied():
    model = build("llama", activation=None)
    with pytest.raises(ValueError, match=r"(?s)model.layers.0.mlp: activation silu is not sparse.*relufy"):
        twell.train.track_l1(model)
    twell.train.relufy(model)
    with twell.train.track_l1(model):
        model(token_ids())
        assert twell.train.l1_penalty(model) > 0


def test_model_without_ffn_is_refused():
    with pytest.raises(ValueError, match="no FFN found"):
        twell.train.track_l1(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))


# --- relufy ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "activation", "module", "before"),
    [
        ("llama", "silu", "model.layers.{}.mlp.act_fn", "silu (SiLUActivation)"),
        ("mistral", "silu", "model.layers.{}.mlp.act_fn", "silu (SiLUActivation)"),
        ("phi3", "silu", "model.layers.{}.mlp.activation_fn", "silu (SiLUActivation)"),
        ("gemma", "gelu_pytorch_tanh", "model.layers.{}.mlp.act_fn", "gelu_tanh (GELUTanh)"),
        ("gpt_neox", "gelu", "gpt_neox.layers.{}.mlp.act", "gelu (GELUActivation)"),
        ("opt", "gelu", "model.decoder.layers.{}.activation_fn", "gelu (GELUActivation)"),
        ("gpt2", "gelu_new", "transformer.h.{}.mlp.act", "NewGELUActivation (NewGELUActivation)"),
        ("bert", "gelu", "bert.encoder.layer.{}.intermediate.intermediate_act_fn", "gelu (GELUActivation)"),
        ("mixtral", "silu", "model.layers.{}.mlp.experts.act_fn", "silu (SiLUActivation)"),
    ],
)
def test_relufy_switches_to_relu(family, activation, module, before):
    model, ids = build(family, activation=activation), token_ids()
    reference = build(family, activation="relu")  # same seed: the same weights, ReLU activations
    if family == "bert":  # its prediction head's activation is config.hidden_act too: not an FFN's
        reference.cls.predictions.transform.transform_act_fn = model.cls.predictions.transform.transform_act_fn
    relu_logits = logits(reference, ids)
    assert not torch.allclose(logits(model, ids), relu_logits, atol=1e-3)
    classes_before = {type(m) for m in model.modules()}
    report = twell.train.relufy(model)
    torch.testing.assert_close(logits(model, ids), relu_logits, rtol=0, atol=0)
    assert [(c.module, c.before, c.after, c.switched) for c in report] == [
        (module.format(i), before, "relu", True) for i in range(2)
    ]
    assert all(isinstance(model.get_submodule(module.format(i)), nn.ReLU) for i in range(2))
    assert {type(m) for m in model.modules()} - classes_before == {nn.ReLU}
    # the transformers class is untouched: a new model of it still has the original activation
    assert not torch.allclose(logits(build(family, activation=activation), ids), relu_logits, atol=1e-3)
    assert twell.report(model).summary()["rewritable"] == 2 * (4 if family == "mixtral" else 1)  # per expert
    text = str(report)
    assert "relufy: 2 of 2 FFN activations switched to ReLU" in text and module.format(1) in text


@pytest.mark.parametrize(
    ("family", "key", "before"),
    [
        ("llama", "hidden_act", "silu"),
        ("gpt2", "activation_function", "gelu_new"),
        ("opt", "activation_function", "gelu"),
        ("mixtral", "hidden_act", "silu"),
    ],
)
def test_relufy_updates_the_config_so_the_saved_model_is_relu(tmp_path, family, key, before):
    """save_pretrained then from_pretrained gives the relufied model back, whatever the config calls
    its activation (GPT-2 and OPT: activation_function)."""
    model, ids = build(family, activation=before), token_ids()
    report = twell.train.relufy(model)
    assert report.config == f"{key} {before!r} -> 'relu'"
    model.save_pretrained(tmp_path)
    reloaded = type(model).from_pretrained(tmp_path).eval()
    assert getattr(reloaded.config, key) == "relu"
    torch.testing.assert_close(logits(reloaded, ids), logits(model, ids))


def test_relufy_keeps_a_config_whose_activation_is_not_only_the_ffns():
    """BERT's prediction head reads config.hidden_act too: relufy keeps the config and says why."""
    model = build("bert", activation="gelu")
    report = twell.train.relufy(model)
    assert all(c.switched for c in report) and len(report) == 2
    assert report.config.startswith("unchanged: cls.predictions.transform.transform_act_fn (not an FFN)")
    assert model.config.hidden_act == "gelu"


def test_relufy_refuses_models_with_nothing_to_switch():
    expected = r"relufy expected FFNs whose activation is SiLU or GELU"
    with pytest.raises(ValueError, match=expected + r".*model.layers.0.mlp: relu \(already sparse\)"):
        twell.train.relufy(build("llama"))
    with pytest.raises(ValueError, match=expected + r".*model.layers.0.mlp: tanh \(not SiLU or GELU\)"):
        twell.train.relufy(build("llama", activation="tanh"))
    with pytest.raises(ValueError, match=expected + ".*no FFN found"):
        twell.train.relufy(nn.Sequential(nn.Linear(4, 4)))


class InlineSiLU(nn.Module):
    """A gated FFN whose activation is a function call in its forward: nothing to swap."""

    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(8, 32), nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


def test_relufy_refuses_an_activation_written_in_the_forward():
    model = nn.Sequential(InlineSiLU())
    with pytest.raises(ValueError, match=r"0: silu \(the activation is written in the forward"):
        twell.train.relufy(model)


# --- the training example ------------------------------------------------------------------------


def load_example(monkeypatch):
    spec = importlib.util.spec_from_file_location("train_sparse", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_a_short_training_run_reduces_the_l1_term(monkeypatch):
    example = load_example(monkeypatch)
    tiny = dict(
        steps=12, batch_size=4, seq_len=32, hidden_size=32, intermediate_size=128, layers=2, log_every=1, eval_batches=1
    )
    data = example.corpus(1 << 17)
    assert len(data) == 1 << 17 and data.dtype == torch.int64 and int(data.max()) < 256
    torch.manual_seed(0)
    penalised = example.train(example.Settings(**tiny, l1=20.0, l1_warmup=0.0), data, "cpu")
    plain = example.train(example.Settings(**tiny, l1=0.0), data, "cpu")
    l1 = [h["l1"] for h in penalised.history]
    assert [h["step"] for h in penalised.history] == list(range(12))
    assert l1[-1] < 0.5 * l1[0]  # the penalty is working
    assert l1[-1] < 0.5 * plain.history[-1]["l1"]  # and it is the penalty, not the language-model loss
    # twelve steps shrink |h| well before they zero it: held-out density is only measured here
    paths = {f"model.layers.{i}.mlp" for i in range(2)}
    assert set(penalised.density) == set(penalised.random_density) == paths
    assert all(0 <= d <= 1 for d in [*penalised.density.values(), *penalised.random_density.values()])


def test_the_demo_model_is_the_examples_trained_sparse_model(monkeypatch):
    """twell/demo holds train_sparse.py's model, trained: its loss on held-out standard-library source
    is far below an untrained model's (ln 256 = 5.5 nats per byte) and its FFNs are over 99% sparse."""
    from twell.loading import demo_model_dir, load_model

    example = load_example(monkeypatch)
    settings = example.Settings()
    built = example.build_model(settings).config.to_dict()
    shipped = load_model("twell-demo").model
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "hidden_act"):
        assert shipped.config.to_dict()[key] == built[key], key
    data = example.corpus(int(settings.corpus_mb * 2**20))
    held_out = data[int(len(data) * (1 - example.HELD_OUT)) :]
    loss, density, random_density = example.evaluate(shipped, held_out, settings, "cpu")
    assert loss < 2.0
    assert len(density) == 4 and sum(density.values()) / 4 < 0.01
    assert sum(random_density.values()) / 4 < 0.01
    assert sum(f.stat().st_size for f in demo_model_dir().iterdir()) < 2 * 1024 * 1024
