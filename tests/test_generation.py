"""benchmarks/generation.py: the graph-captured greedy loop gives generate()'s tokens (static cache)."""

import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from generation import GreedyDecoder  # noqa: E402
from models import VOCAB, build  # noqa: E402

import twell  # noqa: E402

PROMPT, NEW = 5, 12


def tiny_model(device):
    model = build("llama-bias").to(device)
    model.generation_config.eos_token_id = None  # generate() would stop there, the loop does not
    return model


def reference_tokens(model, prompt):
    out = model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW, do_sample=False,
        cache_implementation="static", disable_compile=True, pad_token_id=0,
    )  # fmt: skip
    return out[:, PROMPT:]


def check_against_generate(model, batch, graph, forward=None):
    prompt = torch.randint(0, VOCAB, (batch, PROMPT), device=model.device)
    decoder = GreedyDecoder(model, batch, PROMPT + NEW, forward=forward, graph=graph)
    tokens = decoder.generate(prompt, NEW)
    assert torch.equal(tokens, reference_tokens(model, prompt))
    other = torch.randint(0, VOCAB, (batch, PROMPT), device=model.device)  # the decoder is reusable
    assert torch.equal(decoder.generate(other, NEW), reference_tokens(model, other))


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparsified"])
@pytest.mark.parametrize("batch", [1, 3])
def test_loop_matches_generate_on_cpu(batch, sparse):
    model = tiny_model("cpu")
    if sparse:
        twell.sparsify(model)
    check_against_generate(model, batch, graph=False)


def test_step_compiled_with_the_twell_backend_matches_generate():
    """The decode step writes the static cache in place: the compiled graph must keep those writes."""
    model = tiny_model("cpu")
    torch._dynamo.reset()
    check_against_generate(model, 2, graph=False, forward=torch.compile(model, backend="twell"))
    torch._dynamo.reset()


def test_prompt_forward_runs_the_prompt_and_only_it():
    """prompt_forward (e2e.py --compiled-prompt) runs each generation's prompt, the decode steps stay on
    forward, and the tokens are generate()'s."""
    model = tiny_model("cpu")
    seen = {"prompt": [], "step": []}

    def recording(name):
        return lambda **kw: seen[name].append(kw["input_ids"].shape[1]) or model(**kw)

    prompt = torch.randint(0, VOCAB, (2, PROMPT))
    decoder = GreedyDecoder(
        model, 2, PROMPT + NEW, forward=recording("step"), prompt_forward=recording("prompt"), graph=False
    )
    assert torch.equal(decoder.generate(prompt, NEW), reference_tokens(model, prompt))
    assert seen == {"prompt": [PROMPT], "step": [1] * (NEW - 1)}


def test_graph_needs_cuda():
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA model"):
        GreedyDecoder(tiny_model("cpu"), 1, 8, graph=True)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 3])
def test_graph_replay_matches_generate(batch):
    model = tiny_model("cuda")
    check_against_generate(model, batch, graph=True)
