"""Mixture-of-experts layers whose experts are 3-D parameters (transformers 5: Mixtral, Qwen-MoE, ...).

Such an experts module holds every expert's projections in one tensor per role and is called as
experts(hidden_states [T, K], top_k_index [T, k], top_k_weights [T, k]) by its MoE block, after the
router. transformers' `use_experts_implementation` marks the class with its layout (`has_gate`,
`is_concatenated`, `is_transposed`, `has_bias`, `has_post_expert_norm`), and transformers' own batched
implementations compute the experts from those marks alone; so does twell:

    gated (has_gate):  gate_up_proj [E, 2N, K] (gate rows first), down_proj [E, K, N]
    plain:             up_proj [E, N, K], down_proj [E, K, N]
    is_transposed:     the last two dims of each swapped ([E, K, 2N], [E, N, K])
    has_bias:          gate_up_proj_bias [E, 2N] / up_proj_bias [E, N], down_proj_bias [E, K]

y[t] = sum over the experts e chosen for token t of top_k_weights[t, j] * expert_e(hidden_states[t]).
The router is left as it is. SparseExperts runs each expert over its routed tokens: the experts the
plan rewrites through twell.ops, the others as transformers' eager loop does.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from twell import ops
from twell.kernels.policy import LayerConfig
from twell.passes.match import SUPPORTED_DTYPES
from twell.passes.modules import FORWARD_HOOKS, StandIn, store_down_rows

# The attributes transformers' use_experts_implementation sets on an experts module.
_MARKS = ("has_gate", "is_concatenated", "is_transposed", "has_bias", "has_post_expert_norm")


@dataclass(frozen=True)
class ExpertsSpec:
    """How every expert of one experts module is computed (see the module doc)."""

    kind: str  # "gated" or "plain"
    transposed: bool
    bias: bool
    threshold: float = 0.0
    squared: bool = False

    @property
    def up_name(self) -> str:
        return "gate_up_proj" if self.kind == "gated" else "up_proj"


def is_experts(module: nn.Module) -> bool:
    """Whether `module` is an experts module marked by transformers' use_experts_implementation."""
    return all(hasattr(module, mark) for mark in _MARKS) and isinstance(
        module._parameters.get("down_proj"), nn.Parameter
    )


def layout(module: nn.Module) -> tuple[ExpertsSpec | None, list[str]]:
    """The experts' layout (kind, transposition, bias), and why twell cannot serve it (empty if it can)."""
    kind = "gated" if module.has_gate else "plain"
    spec = ExpertsSpec(kind, bool(module.is_transposed), bool(module.has_bias))
    problems = []
    if not module.is_concatenated:
        problems.append("experts interleave gate and up rows (is_concatenated=False); twell reads them concatenated")
    if module.has_post_expert_norm:
        problems.append("experts apply a norm after each expert, which twell's ops do not")
    if getattr(module, "_is_expert_parallel", False):
        problems.append("experts are split across devices (expert parallelism)")
    if kind == "gated" and getattr(type(module), "_apply_gate", None) is not _default_apply_gate():
        problems.append(f"{type(module).__name__} has its own _apply_gate, not act(gate) * up")
    if "forward" in module.__dict__:
        problems.append("forward is replaced on the instance (e.g. by offloading hooks)")
    names = [spec.up_name, "down_proj"] + ([f"{spec.up_name}_bias", "down_proj_bias"] if spec.bias else [])
    for name in names:
        tensor = module._parameters.get(name)
        if not isinstance(tensor, nn.Parameter):
            problems.append(f"experts' {name} is not a parameter")
        elif tensor.dtype not in SUPPORTED_DTYPES:
            problems.append(f"experts' {name} has dtype {tensor.dtype}; twell supports float32, float16 and bfloat16")
    if problems:
        return None, problems
    up, down = module._parameters[spec.up_name], module._parameters["down_proj"]
    if up.dim() != 3 or down.dim() != 3 or up.shape[0] != down.shape[0]:
        return None, [f"experts' {spec.up_name} {list(up.shape)} and down_proj {list(down.shape)} are not [E, ., .]"]
    k, n = (down.shape[2], down.shape[1]) if spec.transposed else (down.shape[1], down.shape[2])
    expected = n * (2 if kind == "gated" else 1)
    if tuple(up.shape[1:]) != ((k, expected) if spec.transposed else (expected, k)):
        return None, [f"experts' {spec.up_name} {list(up.shape)} does not fit down_proj {list(down.shape)}"]
    return spec, []


def _default_apply_gate():
    """transformers' act(gate) * up over concatenated [gate; up] rows (loaded with any experts class)."""
    return getattr(sys.modules.get("transformers.integrations.moe"), "_default_apply_gate", None)


def sizes(module: nn.Module, spec: ExpertsSpec) -> tuple[int, int, int]:
    """(experts E, hidden width N, model width K)."""
    down = module._parameters["down_proj"]
    if spec.transposed:
        return down.shape[0], down.shape[1], down.shape[2]
    return down.shape[0], down.shape[2], down.shape[1]


def expert_weights(module: nn.Module, spec: ExpertsSpec, expert: int):
    """Expert `expert`'s (gate, up, down) weights in nn.Linear layouts and their biases, all views of the
    3-D parameters: gate/up [N, K] (up None for plain experts), down [K, N]."""
    params = module._parameters
    up_all, down = params[spec.up_name][expert], params["down_proj"][expert]
    if spec.transposed:
        up_all, down = up_all.t(), down.t()
    up_bias_all = params[f"{spec.up_name}_bias"][expert] if spec.bias else None
    down_bias = params["down_proj_bias"][expert] if spec.bias else None
    if spec.kind == "plain":
        return (up_all, up_bias_all), (None, None), (down, down_bias)
    n = up_all.shape[0] // 2
    gate_bias, up_bias = (up_bias_all[:n], up_bias_all[n:]) if up_bias_all is not None else (None, None)
    return (up_all[:n], gate_bias), (up_all[n:], up_bias), (down, down_bias)


def routed(top_k_index: torch.Tensor, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token indices, top-k slots) of the tokens routed to `expert`."""
    return torch.where(top_k_index == expert)


def _arguments(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    names = ("hidden_states", "top_k_index", "top_k_weights")
    values = list(args[:3]) + [kwargs[name] for name in names[len(args[:3]) :] if name in kwargs]
    if len(values) != 3 or len(args) > 3 or set(kwargs) - set(names):
        return None
    return tuple(values)


def gate_preactivation(module: nn.Module, spec: ExpertsSpec, expert: int, args: tuple, kwargs: dict):
    """Calibration: the gate pre-activation [M_e, N] of the tokens routed to `expert` in one call of
    the experts module, None when none were."""
    found = _arguments(args, kwargs)
    if found is None:
        raise ValueError("experts module called with other arguments than (hidden_states, top_k_index, top_k_weights)")
    hidden_states, top_k_index, _ = found
    tokens, _ = routed(top_k_index, expert)
    if tokens.numel() == 0:
        return None
    (gate, gate_bias), _, _ = expert_weights(module, spec, expert)
    return F.linear(hidden_states[tokens], gate, gate_bias)


class SparseExperts(StandIn):
    """Replaces an experts module: the rewritten experts run through twell.ops over their routed
    tokens, the others in plain torch ops with the original activation module, as transformers' eager
    loop computes them. The router and the MoE block are untouched; forward hooks are the original's.
    layer_configs: each rewritten expert's twell.kernels.policy.LayerConfig (its calibrated layout)."""

    def __init__(self, original: nn.Module, spec: ExpertsSpec):
        super().__init__(original, children=True)
        self.spec = spec
        self.layer_configs: dict[int, LayerConfig] = {}
        self.num_experts = sizes(original, spec)[0]
        for hooks in FORWARD_HOOKS:
            setattr(self, hooks, getattr(original, hooks))

    @property
    def rewritten(self) -> set[int]:
        return set(self.layer_configs)

    def forward(self, *args, **kwargs):
        found = _arguments(args, kwargs)
        down = self._parameters["down_proj"]
        if (
            found is None
            or found[0].dtype != down.dtype
            or torch.is_autocast_enabled(found[0].device.type)
            or any(getattr(self.act_fn, hooks) for hooks in FORWARD_HOOKS)
        ):
            return self.sync_original().forward(*args, **kwargs)
        hidden_states, top_k_index, top_k_weights = found
        out = torch.zeros_like(hidden_states)
        for expert in top_k_index.unique().tolist():
            if not 0 <= expert < self.num_experts:
                continue  # transformers' sentinel for dropped tokens
            tokens, slots = routed(top_k_index, expert)
            y = self.expert_ffn(expert, hidden_states[tokens])
            out.index_add_(0, tokens, (y * top_k_weights[tokens, slots, None]).to(out.dtype))
        return out

    def expert_ffn(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `expert` on its tokens x [M, K]."""
        spec = self.spec
        (gate, gate_bias), (up, up_bias), (down, down_bias) = expert_weights(self, spec, expert)
        config = self.layer_configs.get(expert)
        if config is not None:
            if spec.kind == "plain":
                return ops.ffn(
                    x,
                    gate,
                    down,
                    up_bias=gate_bias,
                    down_bias=down_bias,
                    threshold=spec.threshold,
                    squared=spec.squared,
                    config=config,
                )
            biases = {"gate_bias": gate_bias, "up_bias": up_bias, "down_bias": down_bias}
            return ops.gated_ffn(x, gate, up, down, **biases, threshold=spec.threshold, config=config)
        # As transformers' eager loop: one product for [gate; up], then the activation module.
        params = self._parameters
        weight = params[spec.up_name][expert]
        bias = params[f"{spec.up_name}_bias"][expert] if spec.bias else None
        hidden = F.linear(x, weight.t() if spec.transposed else weight, bias)
        if spec.kind == "gated":
            gate_part, up_part = hidden.chunk(2, dim=-1)
            hidden = self.act_fn(gate_part) * up_part
        else:
            hidden = self.act_fn(hidden)
        return F.linear(hidden, down, down_bias)

    def extra_repr(self) -> str:
        return f"twell experts {self.spec.kind}, rewritten={sorted(self.rewritten)}"


def store_expert_rows(module: nn.Module, spec: ExpertsSpec) -> bool:
    """Re-lay the down projections so that each expert's down_weight.t() is row-major (what the sparse
    kernels gather); a transposed layout ([E, N, K]) has it already. Returns whether it re-laid."""
    return not spec.transposed and store_down_rows(module._parameters["down_proj"])


__all__ = [
    "ExpertsSpec",
    "SparseExperts",
    "expert_weights",
    "gate_preactivation",
    "is_experts",
    "layout",
    "sizes",
    "store_expert_rows",
]
