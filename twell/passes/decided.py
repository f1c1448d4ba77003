"""What sparsify decided, and what compilation did, for each FFN, keyed by its gate weight.

The compile backend sees a model's weights only as graph inputs (the very Parameter objects), never the
model: so the decisions of `sparsify(model, calibration_data or plan)` are looked up here by the gate
weight of each FFN the backend finds, and what the backend did to each FFN is kept here for
`twell.compile_report(model)`. Both maps hold their keys weakly, by identity: they forget a weight when it is freed.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.utils.weak import WeakIdKeyDictionary

# gate weight -> (candidate path, Decision): set by sparsify with decisions, dropped by restore
_decisions = WeakIdKeyDictionary()
# gate weight -> twell.report.Record: what the latest compilation that found this FFN did to it
_compiled = WeakIdKeyDictionary()


def remember(candidates, decisions: dict) -> None:
    """Record sparsify's decision for every candidate FFN with a gate weight (experts have none here)."""
    for c in candidates:
        weight = getattr(c.gate_module, "weight", None)
        if isinstance(weight, torch.nn.Parameter) and c.path in decisions:
            _decisions[weight] = (c.path, decisions[c.path])


def forget(candidates) -> None:
    for c in candidates:
        weight = getattr(c.gate_module, "weight", None)
        if isinstance(weight, torch.nn.Parameter):
            _decisions.pop(weight, None)


def decision_for(weight) -> tuple[str, object] | None:
    """(path, Decision) sparsify made for the FFN whose gate weight is `weight`, if any."""
    return _decisions.get(weight) if isinstance(weight, torch.nn.Parameter) else None


def decisions_digest() -> bytes:
    """The decisions of every live sparsified model (with the layouts the rewrites get), as bytes that
    change when any of them does."""
    lines = (f"{path} {d.rewrite} {d.reason} {d.tile_n} {d.slots}" for path, d in _decisions.values())
    return "\n".join(sorted(lines)).encode()


def record_compiled(weight, record) -> None:
    if isinstance(weight, torch.nn.Parameter):
        _compiled[weight] = record


# Why the compile backend leaves a mixture-of-experts layer's experts alone.
EXPERTS_NOT_COMPILED = (
    "experts stored as 3-D parameters are not rewritten by torch.compile's twell backend (it matches "
    "FFNs of 2-D projections): call twell.sparsify(model) before torch.compile, which rewrites them"
)


def compiled_records(model: torch.nn.Module) -> list:
    """What compilation did to the FFNs of `model` (in the order of their gate weights in the model),
    each under the path twell.report gives it: a compiled graph shows the projections' module paths,
    not whether the module holding them is the FFN (LlamaMLP: "model.layers.0.mlp") or computes it
    inline (OPT's layer: "model.decoder.layers.0[fc1,fc2]"). Then one record per expert the backend
    leaves alone (not sparsified before compiling), with the reason: the backend never sees them as
    FFNs, so without these a Mixtral's report would be empty."""
    from twell.passes import experts
    from twell.passes.candidates import find_ffns
    from twell.report import candidate_record

    candidates = find_ffns(model)
    paths = {}
    for c in candidates:
        weight = getattr(c.gate_module, "weight", None)
        if isinstance(weight, torch.nn.Parameter):
            paths.setdefault(weight, c.path)
    compiled = [p for p in model.parameters() if p in _compiled]
    records = [dataclasses.replace(_compiled[p], path=paths[p]) if p in paths else _compiled[p] for p in compiled]
    for c in candidates:
        if experts.is_experts(c.gate_module):
            reason = EXPERTS_NOT_COMPILED if c.rewritable else c.reason
            records.append(candidate_record(c, False, reason))
    return records


__all__ = [
    "EXPERTS_NOT_COMPILED",
    "compiled_records",
    "decision_for",
    "decisions_digest",
    "forget",
    "record_compiled",
    "remember",
]
