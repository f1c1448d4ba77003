"""Tiny randomly initialised transformers models, built offline from configs, shared by the model tests."""

from __future__ import annotations

import torch

VOCAB, LAYERS = 100, 2
DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
# family -> (config class, model class, config kwargs, name of the activation option, kind of FFN, path of layer 0)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, "hidden_act", "gated", "model.layers.0.mlp"),
    "llama-bias": ("LlamaConfig", "LlamaForCausalLM", {"mlp_bias": True}, "hidden_act", "gated", "model.layers.0.mlp"),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}, "hidden_act", "gated", "model.layers.0.mlp"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, "hidden_act", "gated", "model.layers.0.mlp"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}, "hidden_act", "gated", "model.layers.0.mlp"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}, "hidden_act", "gated", "model.layers.0.mlp"),
    # transformers v5 Gemma reads `hidden_act` (v4's `hidden_activation` is gone).
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 8}, "hidden_act", "gated", "model.layers.0.mlp"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}, "hidden_act", "gated", "model.layers.0.mlp"),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"mlp_bias": True}, "hidden_act", "gated", "model.layers.0.mlp"),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}, "hidden_act", "plain", "gpt_neox.layers.0.mlp"),
    # GPT-2's projections are transformers' Conv1D: weights stored [in, out], computed by addmm.
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        {"n_inner": 64, "bos_token_id": 0, "eos_token_id": 0},
        "activation_function",
        "plain",
        "transformer.h.0.mlp",
    ),
    # BERT splits its FFN across two modules: intermediate (act(dense(x))) and output (dense(h), residual, norm).
    "bert": (
        "BertConfig",
        "BertForMaskedLM",
        {},
        "hidden_act",
        "plain",
        "bert.encoder.layer.0[intermediate.dense,output.dense]",
    ),
    "opt": (
        "OPTConfig",
        "OPTForCausalLM",
        {"ffn_dim": 64, "word_embed_proj_dim": 32, "pad_token_id": 1, "intermediate_size": None},
        "activation_function",
        "plain",
        "model.decoder.layers.0[fc1,fc2]",
    ),
}
# Mixture-of-experts families (experts stored as 3-D parameters), same fields; their path is expert 0's.
MOE_FAMILIES = {
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"num_local_experts": 4, "num_experts_per_tok": 2},
        "hidden_act",
        "gated",
        "model.layers.0.mlp.experts.0",
    ),
}
# Families whose default activation is not ReLU (OPT's is ReLU).
DEFAULT_NOT_RELU = {
    "llama": "silu",
    "phi3": "silu",
    "gemma": "gelu_tanh",
    "olmo2": "silu",
    "gpt_neox": "gelu",
    "gpt2": "NewGELUActivation",
    "bert": "gelu",
}


def build(family: str, activation: str | None = "relu", seed: int = 0, **overrides):
    """A `family` model in eval mode, with `activation` (None: the family's default) and config overrides."""
    import transformers

    config_cls, model_cls, extra, act_key, _, _ = {**FAMILIES, **MOE_FAMILIES}[family]
    kwargs = {**DECODER, **extra, **overrides}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    if family == "opt":
        kwargs.pop("num_key_value_heads")
    if activation is not None:
        kwargs[act_key] = activation
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**kwargs)
    return getattr(transformers, model_cls)(config).eval()


def token_ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(seed))


def replanned_llama(folder, edit):
    """The tiny llama sparsified from a plan: calibrated once on token_ids() (no decode steps or timing,
    every layer rewritten), its saved plan's decisions each changed in place by edit(decision), and a
    fresh model sparsified from the edited plan."""
    import json

    import twell

    config = {"decode_steps": 0, "timing_repeats": 0, "progress": False, "min_speedup": 0.0, "max_overflow": 0.99}
    plan = folder / "plan.json"
    twell.save_plan(twell.sparsify(build("llama"), [token_ids()], config=config), plan)
    data = json.loads(plan.read_text())
    for decision in data["decisions"].values():
        edit(decision)
    plan.write_text(json.dumps(data))
    return twell.sparsify(build("llama"), plan=plan)


def logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def modules_of(model) -> list[tuple[str, int]]:
    return [(name, id(m)) for name, m in model.named_modules()]


# The supported-architectures tables of README.md and docs/architectures.md are generated from the
# families above (tests/test_docs.py checks them): `python tests/models.py` rewrites them.
TABLE_START, TABLE_END = "<!-- architectures: generated by tests/models.py -->", "<!-- architectures: end -->"
TESTED = "sparsify, restore, compile"
MOE_TESTED = "sparsify, restore, calibration per expert, compile"


def _found_as(family: str, path: str) -> str:
    if family in MOE_FAMILIES:
        return "experts stored as 3-D parameters, one FFN per expert"
    if "[" not in path:
        return "Conv1D projections (weights [in, out])" if family == "gpt2" else "its MLP module"
    return "split across two modules" if "." in path.split("[")[1] else "inline in the decoder layer"


def architectures_table() -> str:
    """The markdown table of the families the tests build, with ReLU: what twell finds and how tested."""
    rows = [
        "| family | transformers class | FFN | found as | first FFN's path | tested |",
        "|---|---|---|---|---|---|",
    ]
    for families, tested in ((FAMILIES, TESTED), (MOE_FAMILIES, MOE_TESTED)):
        for family, (_, model_cls, _, _, kind, path) in families.items():
            rows.append(f"| {family} | `{model_cls}` | {kind} | {_found_as(family, path)} | `{path}` | {tested} |")
    return "\n".join(rows)


def with_table(text: str) -> str:
    """`text` with the part between the table markers replaced by the current table."""
    head, _, rest = text.partition(TABLE_START)
    _, _, tail = rest.partition(TABLE_END)
    return f"{head}{TABLE_START}\n{architectures_table()}\n{TABLE_END}{tail}"


TABLE_PAGES = ("README.md", "docs/architectures.md")

if __name__ == "__main__":
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    for page in TABLE_PAGES:
        (root / page).write_text(with_table((root / page).read_text()))
