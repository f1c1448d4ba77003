"""twell inside PyTorch's distributed stack: FSDP2 and tensor parallelism, 2 processes on the CPU (gloo).

Each test spawns two ranks that compare, in float32, what the sharded and sparsified model computes
(logits, loss, every gradient) with the untouched model run in one process on the same data. A rank
that fails raises; torch.multiprocessing.spawn then stops the other and re-raises here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import faulthandler
import gc
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import rel_err
from models import LAYERS, VOCAB
from models import build as build_family

import twell

pytest.importorskip("transformers")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("needs torch.distributed with gloo", allow_module_level=True)

WORLD = 2
L1_COEFF = 0.05  # large enough that a wrong L1 gradient shows in every FFN weight's gradient


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(worker) -> None:
    mp.spawn(_bootstrap, args=(worker, _free_port()), nprocs=WORLD, join=True)


def _bootstrap(rank: int, worker, port: int) -> None:
    faulthandler.enable()  # a rank killed by a signal (an abort in C++) shows its Python stack
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # a rank waiting on a collective the other will never join fails instead of hanging
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    import transformers

    transformers.logging.set_verbosity_error()
    try:
        from torch.distributed.device_mesh import init_device_mesh

        worker(rank, init_device_mesh("cpu", (WORLD,)))
    finally:
        # Models form reference cycles (hooks, stand-ins) that may hold gloo's pending work objects;
        # freed at interpreter shutdown instead, they abort the process.
        gc.collect()
        dist.destroy_process_group()
    # Skip the interpreter's teardown: C++ destructors that run at exit (gloo's and the store's threads)
    # have aborted a rank that had passed, under load in CI (the destruction-order problem of
    # pytorch/pytorch#90848). A failure has raised above, so exiting here only ever reports a pass.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextlib.contextmanager
def op_calls():
    """(gate weight shape, whether the down weight has the rows layout the kernels read) of every
    twell.ops call made inside (each rewritten FFN calls one)."""
    import twell.ops

    calls = []
    originals = twell.ops.gated_ffn, twell.ops.ffn

    def recording(fn, down_index):
        def call(x, gate_weight, *args, **kwargs):
            from torch.distributed.tensor import DTensor

            assert not isinstance(gate_weight, DTensor), "the op must see this rank's tensors"
            calls.append((tuple(gate_weight.shape), args[down_index].t().is_contiguous()))
            return fn(x, gate_weight, *args, **kwargs)

        return call

    twell.ops.gated_ffn, twell.ops.ffn = recording(originals[0], 1), recording(originals[1], 0)
    try:
        yield calls
    finally:
        twell.ops.gated_ffn, twell.ops.ffn = originals


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def assert_close(name, got, want, tol=1e-5):
    err = rel_err(full(got), want)
    assert err < tol, f"{name}: relative error {err:.2e} (rank {dist.get_rank()})"


def assert_same_on_every_rank(value) -> None:
    values = [None] * WORLD
    dist.all_gather_object(values, value)
    assert all(v == values[0] for v in values), values


def build():
    """The tiny Llama (ReLU, biases on the FFN's linears), the same on every rank."""
    return build_family("llama", mlp_bias=True, seed=3)


def batch(rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(10 + rank))


class RankCost:
    """A cost model that predicts differently on each rank (as timings on two GPUs differ): rank 0
    rewrites every layer, rank 1 none, unless calibration makes them agree."""

    name = "differs by rank"

    def time_ratio(self, **shape) -> float:
        return 0.5 if dist.get_rank() == 0 else 2.0


# max_overflow: the tiny random models are about half dense
CALIBRATION = {
    "progress": False,
    "timing_repeats": 0,
    "decode_steps": 1,
    "max_overflow": 0.99,
    "cost_model": RankCost(),
}


def rewritten(model) -> list[str]:
    return sorted(r.path for r in twell.report(model) if r.rewritten)


# ---------------------------------------------------------------------------------------------------
# FSDP2


class L1:
    """The method's L1 penalty, (1/L) * sum over layers of mean |h|, h = relu(gate(x)) * up(x) recomputed
    by a forward hook on each FFN from its input and weights (inside the FSDP unit's run, where the
    weights are gathered). take() returns the sum since the last take."""

    def __init__(self, model):
        self.mlps = [layer.mlp for layer in model.model.layers]
        self.value = torch.zeros(())
        for mlp in self.mlps:
            mlp.register_forward_hook(self.hook)

    def hook(self, mlp, args, output) -> None:
        import torch.nn.functional as F

        x = args[0]
        h = F.relu(F.linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias)) * F.linear(
            x, mlp.up_proj.weight, mlp.up_proj.bias
        )
        self.value = self.value + h.abs().mean() / len(self.mlps)

    def take(self) -> torch.Tensor:
        value, self.value = self.value, torch.zeros(())
        return value


STEPS, LR = 2, 0.5


def fsdp_reference():
    """Per step: the loss of each rank's batch and the gradients of their mean, in one process, dense."""
    model = build().train()
    l1 = L1(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    steps = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        losses = []
        for rank in range(WORLD):
            ids = batch(rank)
            loss = model(ids, labels=ids).loss + L1_COEFF * l1.take()
            (loss / WORLD).backward()  # FSDP averages the ranks' gradients
            losses.append(loss.detach())
        steps.append((losses, {n: p.grad.clone() for n, p in model.named_parameters()}))
        optimizer.step()
    return steps


def fully_shard_layers(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def sharded_first(mesh):
    model = build().train()
    fully_shard_layers(model, mesh)
    return twell.sparsify(model, layer_config={"train_min_m": 1})


def sparsified_first(mesh):
    model = twell.sparsify(build().train(), layer_config={"train_min_m": 1})
    fully_shard_layers(model, mesh)  # sparsify left the down weights contiguous: FSDP takes them
    return model


def fsdp_worker(rank, mesh):
    reference = fsdp_reference()
    for order in (sharded_first, sparsified_first):
        model = order(mesh)
        assert rewritten(model) == [f"model.layers.{i}.mlp" for i in range(LAYERS)], order.__name__
        l1 = L1(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        for step, (losses, grads) in enumerate(reference):
            optimizer.zero_grad()
            ids = batch(rank)
            with op_calls() as calls:
                loss = model(ids, labels=ids).loss + L1_COEFF * l1.take()
                loss.backward()
            # every FFN ran the twell op on the whole weight FSDP gathered, in the rows layout: a training
            # call of at least train_min_m tokens gets its copy (twell.distributed.rows_for_call)
            assert calls == [((64, 32), True)] * LAYERS, (order.__name__, calls)
            where = f"{order.__name__}, step {step}"
            assert_close(f"{where} loss", loss.detach(), losses[rank])
            for name, p in model.named_parameters():
                assert_close(f"{where} grad of {name}", p.grad, grads[name])
            optimizer.step()

    # Without gradients: a prefill-sized call gets the rows layout, a decode-sized one keeps FSDP's
    # (and runs dense on a GPU); both compute what the dense model does.
    dense, model = build(), sparsified_first(mesh).eval()
    ids = batch(rank)
    for route, rows in (("prefill", True), ("decode", False)):
        with torch.no_grad(), twell.configure(model, route=route), op_calls() as calls:
            assert_close(f"logits, {route} route", model(ids).logits, dense(ids).logits)
        assert calls == [((64, 32), rows)] * LAYERS, (route, calls)

    # Calibration with each rank's own data and a cost model that differs by rank: one decision.
    calibrated = build()
    fully_shard_layers(calibrated, mesh)
    twell.sparsify(calibrated, calibration_data=[batch(rank)], config=CALIBRATION)
    assert rewritten(calibrated) == [f"model.layers.{i}.mlp" for i in range(LAYERS)]  # rank 0's
    assert_same_on_every_rank(twell.report(calibrated).to_dict())


def test_fsdp2_training_matches_one_process():
    """fully_shard then sparsify, and sparsify then fully_shard: two SGD steps with the L1 penalty give
    the losses and gradients of the dense model in one process, every op call reading the gathered
    down weight in the rows layout."""
    _spawn(fsdp_worker)


@contextlib.contextmanager
def one_rank_group(backend: str):
    """The default process group with this process as its only rank (FSDP2 with a world size of 1 runs
    the layouts and kernel paths of several ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cuda" if backend == "nccl" else "cpu", (1,))
    finally:
        gc.collect()
        dist.destroy_process_group()


@pytest.mark.gpu
def test_fsdp2_takes_the_sparse_routes_on_one_gpu(monkeypatch):
    """FSDP2 (world size 1, NCCL), in both orders of sparsify and fully_shard: a prefill-sized call takes
    the prefill kernels and a training call the sparse training path, on the weights FSDP gathered;
    a decode-sized call runs dense (its down weight keeps FSDP's nn.Linear layout); loss and gradients
    are the dense model's within bf16 rounding."""
    from twell.kernels import backward, dispatch

    paths, trained = [], []
    choose, train_forward = dispatch._choose, backward.train_forward

    def spied_choose(*args):
        path, state = choose(*args)
        paths.append(path)
        return path, state

    monkeypatch.setattr(dispatch, "_choose", spied_choose)
    monkeypatch.setattr(backward, "train_forward", lambda *a, **kw: trained.append(1) or train_forward(*a, **kw))

    def on_gpu(model):
        return model.to("cuda", torch.bfloat16)

    ids = batch(0).cuda()
    dense = on_gpu(build()).train()
    want = dense(ids, labels=ids)
    want.loss.backward()
    grads = {name: p.grad for name, p in dense.named_parameters()}
    with one_rank_group("nccl") as mesh:
        for order in ("sharded first", "sparsified first"):
            model = on_gpu(build()).train()
            if order == "sharded first":
                fully_shard_layers(model, mesh)
            twell.sparsify(model, layer_config={"train_min_m": 1})
            if order == "sparsified first":
                fully_shard_layers(model, mesh)
            trained.clear()
            got = model(ids, labels=ids)
            got.loss.backward()
            assert len(trained) == LAYERS, (order, trained)
            assert_close(f"{order}: loss", got.loss.detach().float(), want.loss.detach().float(), tol=2e-2)
            for name, p in model.named_parameters():
                assert_close(f"{order}: grad of {name}", p.grad.float(), grads[name].float(), tol=5e-2)
            model.eval()
            for route, path in (("prefill", "prefill"), (None, "dense")):
                paths.clear()
                x = ids if route else ids[:1, :1]
                with torch.no_grad(), twell.configure(model, **({"route": route} if route else {})):
                    logits = model(x).logits
                assert paths == [path] * LAYERS, (order, route, paths)
                with torch.no_grad():
                    assert_close(f"{order}: logits, {path}", logits.float(), dense(x).logits.float(), tol=2e-2)


# ---------------------------------------------------------------------------------------------------
# Tensor parallelism


def parallelize(model, mesh, attention=True):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {}
    for i in range(len(model.model.layers)):
        names = {"mlp.gate_proj": "col", "mlp.up_proj": "col", "mlp.down_proj": "row"}
        if attention:
            names.update({f"self_attn.{p}_proj": "col" for p in "qkv"}, **{"self_attn.o_proj": "row"})
        for name, style in names.items():
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel() if style == "col" else RowwiseParallel()
    return parallelize_module(model, mesh, plan)


def down_rows(model, layer=0) -> bool:
    """Whether this rank's shard of the down weight has the rows layout the kernels gather."""
    with torch.no_grad():
        return model.model.layers[layer].mlp.down_proj.weight.to_local().t().is_contiguous()


def tp_worker(rank, mesh):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    ids = batch(0)  # tensor parallelism: the same tokens on every rank
    reference = build()
    out = reference(ids, labels=ids)
    out.loss.backward()
    all_ffns = [f"model.layers.{i}.mlp" for i in range(LAYERS)]

    # parallelize_module, then sparsify: each rank's down shard is re-laid
    model = parallelize(build(), mesh)
    twell.sparsify(model)
    assert rewritten(model) == all_ffns
    assert down_rows(model)
    with op_calls() as calls:
        got = model(ids, labels=ids)
        got.loss.backward()
    assert calls == [((32, 32), True)] * LAYERS, calls  # each rank: its 32 of the 64 neurons, in place
    assert_close("logits", got.logits.detach(), out.logits)
    for name, p in model.named_parameters():
        assert_close(f"grad of {name}", p.grad, dict(reference.named_parameters())[name].grad)
    # a hook of someone else's on a linear: the FFN runs its original forward (PyTorch's TP)
    handle = model.model.layers[0].mlp.gate_proj.register_forward_hook(lambda *args: None)
    with op_calls() as calls:
        assert_close("logits, extra hook", model(ids).logits.detach(), out.logits)
    assert calls == [((32, 32), True)] * (LAYERS - 1), calls
    handle.remove()
    twell.restore(model)
    assert not down_rows(model)
    assert_close("logits after restore", model(ids).logits.detach(), out.logits)

    # An FFN written inline in its layer (OPT's fc1/fc2) is not rewritten when its linears are sharded.
    opt_reference = build_family("opt")
    opt = build_family("opt")
    plan = {}
    for i in range(LAYERS):
        plan.update(
            {f"model.decoder.layers.{i}.fc1": ColwiseParallel(), f"model.decoder.layers.{i}.fc2": RowwiseParallel()}
        )
    parallelize_module(opt, mesh, plan)
    twell.sparsify(opt)
    assert rewritten(opt) == []
    assert all("tensor-parallel" in r.reason for r in twell.report(opt)), twell.report(opt).to_dict()
    assert_close("OPT logits", opt(ids).logits.detach(), opt_reference(ids).logits.detach())

    # sparsify, then parallelize_module: exact too; the shards have the nn.Linear layout, so a
    # decode-sized call keeps it (dense on a GPU) and a prefill-sized one gets a copy in the rows layout
    model = parallelize(twell.sparsify(build()), mesh)
    assert not down_rows(model)
    for route, rows in (("decode", False), ("prefill", True)):
        with twell.configure(model, route=route), op_calls() as calls:
            got = model(ids, labels=ids)
            got.loss.backward()
        assert calls == [((32, 32), rows)] * LAYERS, (route, calls)
        assert_close(f"logits, sparsified first, {route}", got.logits.detach(), out.logits)
        for name, p in model.named_parameters():
            want = dict(reference.named_parameters())[name].grad
            assert_close(f"grad of {name}, sparsified first, {route}", p.grad, want)
        model.zero_grad(set_to_none=True)

    # Sequence parallelism: the plan's layouts are honoured (sequence-sharded input and output)

    layer = build().model.layers[0]
    plan = {
        "mlp.gate_proj": ColwiseParallel(input_layouts=Shard(1)),
        "mlp.up_proj": ColwiseParallel(input_layouts=Shard(1)),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }
    parallelize_module(layer, mesh, plan)
    twell.sparsify(layer)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(5))
    with op_calls() as calls:
        y = layer.mlp(x.chunk(WORLD, dim=1)[rank])
    assert calls == [((32, 32), True)], calls
    with torch.no_grad():
        want = reference.model.layers[0].mlp(x).chunk(WORLD, dim=1)[rank]
    assert_close("sequence-parallel FFN output", y.detach(), want)

    # Calibration: layer 0's neurons fire often on rank 0's slice and rarely on rank 1's
    def skewed():
        model = build()
        with torch.no_grad():
            model.model.layers[0].mlp.gate_proj.bias[:32] += 1.0
            model.model.layers[0].mlp.gate_proj.bias[32:] -= 1.0
        return model

    data = [batch(0), batch(1)]
    unsharded = skewed()
    single = twell.calibrate(unsharded, twell.passes.find_ffns(unsharded), data, config=CALIBRATION)
    model = parallelize(skewed(), mesh)
    twell.sparsify(model, calibration_data=data, config=CALIBRATION)
    assert rewritten(model) == all_ffns  # rank 0's cost model decided
    assert_same_on_every_rank(twell.report(model).to_dict())
    for record in twell.report(model):
        decision, expected = record.decision, single[record.path]
        # measured over all 64 neurons: the counts of the unsharded model
        assert decision["density"] == pytest.approx(expected.density), record.path
        assert decision["dead_neurons"] == expected.dead_neurons
        for phase in ("prefill", "decode"):
            assert decision["stats"][phase]["nnz_per_row"] == expected.stats[phase]["nnz_per_row"]


def test_tensor_parallel_matches_one_process():
    """gate/up column-wise, down row-wise: each rank runs the twell op on its neurons; logits and every
    gradient equal the unsharded model's; calibration measures all neurons and decides once."""
    _spawn(tp_worker)


def test_rows_for_call_copies_for_the_prefill_and_training_paths_only():
    """A down weight in the nn.Linear layout gets a transposed copy for a call that takes the prefill
    path or may take the sparse training path, none for a decode-sized call or one stored as rows;
    the copy's gradient reaches the weight."""
    from twell.distributed import rows_for_call
    from twell.kernels.policy import DEFAULT
    from twell.passes.modules import FFNWeights

    g = torch.Generator().manual_seed(7)
    k, n = 24, 40
    down = torch.randn(k, n, generator=g, requires_grad=True)
    weights = FFNWeights(torch.randn(n, k, generator=g), None, torch.randn(n, k, generator=g), None, down, None)
    prefill, decode = torch.randn(DEFAULT.prefill_min_m, k), torch.randn(3, k)
    with torch.no_grad():
        assert rows_for_call(weights, decode, DEFAULT) is weights
        got = rows_for_call(weights, prefill, DEFAULT).down
        assert got.t().is_contiguous() and torch.equal(got, down)
        rows = dataclasses.replace(weights, down=down.detach().t().contiguous().t())
        assert rows_for_call(rows, prefill, DEFAULT) is rows
    training = DEFAULT.replace(train_min_m=3)
    assert rows_for_call(weights, decode, DEFAULT) is weights  # train_min_m None: no sparse training
    got = rows_for_call(weights, decode, training).down
    assert got.t().is_contiguous()
    dy = torch.randn(k, n, generator=g)
    (got * dy).sum().backward()
    assert torch.equal(down.grad, dy)
    with torch.no_grad():
        assert rows_for_call(weights, decode, training) is weights  # no autograd recording


def test_sparsify_leaves_down_weights_contiguous_in_a_process_group():
    """With the default process group initialised, sparsify stores plain down weights as they are (so
    that fully_shard can follow); without one, it re-lays them for the kernels."""
    alone = twell.sparsify(build())
    assert down_rows_plain(alone)
    with one_rank_group("gloo"):
        grouped = twell.sparsify(build())
        assert not down_rows_plain(grouped)
        ids = batch(0)
        with torch.no_grad():
            assert_close("logits in a process group", grouped(ids).logits, build()(ids).logits)


def down_rows_plain(model) -> bool:
    return all(layer.mlp.down_proj.weight.t().is_contiguous() for layer in model.model.layers)
