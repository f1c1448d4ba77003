"""torch.compile(model, backend="twell") on mixture-of-experts models: what it rewrites (a shared
expert's 2-D FFN) and, for each expert stored as 3-D parameters it leaves alone, a record saying why.
A report that lists nothing would be a silent no-op."""

import pytest
import torch

import twell
from twell.passes import find_ffns
from twell.passes.decided import EXPERTS_NOT_COMPILED

transformers = pytest.importorskip("transformers")

from models import DECODER, build, logits, token_ids  # noqa: E402

EXPERTS = 4
# family -> (config class, model class, config kwargs, FFNs per layer the backend rewrites)
MOE = {
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(moe_intermediate_size=48, shared_expert_intermediate_size=64, num_experts=EXPERTS, num_experts_per_tok=2),
        1,  # the shared expert
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(moe_intermediate_size=48, num_experts=EXPERTS, num_experts_per_tok=2, head_dim=8),
        0,
    ),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=EXPERTS, num_experts_per_tok=2), 0),
}


def build_moe(family):
    if family == "mixtral":
        return build("mixtral")
    config_cls, model_cls, extra, _ = MOE[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**DECODER, **extra, "hidden_act": "relu"})
    return getattr(transformers, model_cls)(config).eval()


@pytest.mark.parametrize("family", ["mixtral", *MOE])
def test_compile_reports_every_expert_it_leaves_alone(family):
    model = build_moe(family)
    ids = token_ids()
    expected = logits(model, ids)
    ffns = find_ffns(model)
    experts = [c.path for c in ffns if c.expert is not None]
    assert len(experts) == 2 * EXPERTS
    torch._dynamo.reset()
    try:
        torch.testing.assert_close(logits(torch.compile(model, backend="twell"), ids), expected, atol=1e-5, rtol=1e-5)
    finally:
        torch._dynamo.reset()
    report = twell.compile_report(model)
    assert sorted(r.path for r in report) == sorted(c.path for c in ffns)  # every FFN, none silently
    left = [r for r in report if not r.rewritten]
    assert [r.path for r in left] == experts and all(r.reason == EXPERTS_NOT_COMPILED for r in left)
    rewritten = [r.path for r in report if r.rewritten]
    assert len(rewritten) == 2 * (MOE[family][3] if family in MOE else 0)


def test_experts_sparsified_before_compiling_are_not_reported_as_left_alone():
    model = twell.sparsify(build_moe("olmoe"))
    assert twell.report(model).summary()["rewritten"] == 2 * EXPERTS
    assert list(twell.compile_report(model)) == []
