"""A sparsified model's decode step under torch.compile, as benchmarks/e2e.py's compiled rows run it: one
graph with no graph break, compiled once per batch size (a third batch size reuses the second's dynamic
graph, as dense's does), none again across steps and generations, per-layer LayerConfigs included (what
calibration gives); and Inductor's code for it calls the op once a layer on the parameters themselves,
which no other launch of the step reads (issue 27: no per-step copy of a weight, no kernel added on them)."""

import re
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_cache, run_and_get_code

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from generation import GreedyDecoder  # noqa: E402
from models import LAYERS, VOCAB, build  # noqa: E402

import twell  # noqa: E402

PROMPT, NEW = 4, 5
# a line of Inductor's wrapper code that launches work: a generated kernel (C++ or Triton), an extern
# kernel (GEMMs) or a fallback op (SDPA, twell's)
LAUNCH = re.compile(
    r"^\s*(?:buf\d+ = )?(cpp_fused_\w+\(|triton_\w+\.run\(|extern_kernels\.\w+\(|torch\.ops\.\w+\.\w+\.\w+\()"
)
OP = "torch.ops.twell.gated_ffn.default("


def sparsified(per_layer: bool):
    model = twell.sparsify(build("llama-bias"))
    if per_layer:  # a LayerConfig per layer, as calibration leaves them (here: layer 0 decodes up to 16 tokens)
        mlp = model.model.layers[0].mlp
        mlp.layer_config = mlp.layer_config.replace(decode_max_m=16, tile_n=64)
    return model


def compiled_counts() -> dict:
    return {
        "graphs": counters["stats"]["unique_graphs"],
        "frames": counters["frames"]["ok"],
        "graph_breaks": sum(counters["graph_break"].values()),
    }


def test_decode_steps_compile_once_a_batch_size_without_graph_breaks():
    model = sparsified(per_layer=True)  # one layer as installed, one as calibrated
    torch._dynamo.reset()
    forward = torch.compile(model)
    compiled = {}
    for batch in (1, 16, 4):  # 16: the decode_sparse_max_m edge; 4 after 16: the dynamic graph again
        prompt = torch.randint(0, VOCAB, (batch, PROMPT))
        decoder = GreedyDecoder(model, batch, PROMPT + NEW, forward=forward, graph=False)
        counters.clear()
        tokens = decoder.generate(prompt, NEW)
        compiled[batch] = compiled_counts()
        counters.clear()
        again = decoder.generate(prompt, NEW)
        assert compiled_counts() == {"graphs": 0, "frames": 0, "graph_breaks": 0}, batch
        assert torch.equal(tokens, again)
        assert torch.equal(tokens, GreedyDecoder(model, batch, PROMPT + NEW, graph=False).generate(prompt, NEW))
    one = {"graphs": 1, "frames": 1, "graph_breaks": 0}
    assert compiled == {1: one, 16: one, 4: {"graphs": 0, "frames": 0, "graph_breaks": 0}}
    torch._dynamo.reset()


def step_code(model, batch=2) -> list[str]:
    """The lines of Inductor's wrapper code for the model's compiled decode step that launch work."""
    torch._dynamo.reset()
    decoder = GreedyDecoder(model, batch, PROMPT + NEW, forward=torch.compile(model), graph=False)
    with fresh_cache():
        _, codes = run_and_get_code(decoder.generate, torch.randint(0, VOCAB, (batch, PROMPT)), 3)
    torch._dynamo.reset()
    (code,) = codes  # the prompt runs eagerly: the step is the one graph
    return [line for line in code.splitlines() if LAUNCH.match(line)]


def test_compiled_step_calls_the_op_on_the_parameters_and_nothing_else_reads_them():
    lines = step_code(sparsified(per_layer=False))
    ops = [line for line in lines if OP in line]
    assert len(ops) == LAYERS
    ffn_parameters = set()
    for line in ops:  # x, then the three weights and three biases: graph inputs (parameters), not copies
        args = [a.strip() for a in line.split(OP, 1)[1].split(",")]
        assert re.fullmatch(r"buf\d+", args[0]), line
        assert all(re.fullmatch(r"arg\d+_1", a) for a in args[1:7]), line
        ffn_parameters.update(args[1:7])
    others = [line for line in lines if OP not in line]  # no kernel of the step copies or reads them besides
    assert not [(a, line) for a in ffn_parameters for line in others if re.search(rf"\b{a}\b", line)]
