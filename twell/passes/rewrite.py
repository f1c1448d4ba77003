"""Swapping rewritten modules in and out of an eager model (see twell.passes.modules)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from twell.kernels.policy import DEFAULT, LayerConfig
from twell.passes.candidates import Candidate
from twell.passes.experts import ExpertsSpec, SparseExperts, store_expert_rows
from twell.passes.modules import (
    ActivationPassthrough,
    GatePassthrough,
    InlineFFN,
    SparseFFN,
    UpUnit,
    store_contiguous,
    store_down_rows,
)


@dataclass
class Swap:
    """parent.<name> was `original` before sparsify (and is `replacement` while sparsified).
    relaid: (module, parameter name) of the down weight sparsify re-laid (store_down_rows), if any;
    restore lays out whatever tensor the module holds then (load_state_dict(assign=True) may have
    replaced it)."""

    parent: nn.Module
    name: str
    original: nn.Module
    replacement: nn.Module
    relaid: tuple[nn.Module, str] | None = None


def _parent(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent_path, _, name = path.rpartition(".")
    return model.get_submodule(parent_path), name


def apply(model: nn.Module, candidate: Candidate, config: LayerConfig = DEFAULT) -> list[Swap]:
    """Rewrite one rewritable candidate in place, its op called with `config`; returns the swaps that
    undo() reverts."""
    if not candidate.rewritable or candidate.spec is None:
        raise ValueError(f"{candidate.path!r} is not rewritable: {candidate.reason}")
    spec, owner = candidate.spec, candidate.owner
    if isinstance(spec, ExpertsSpec):
        return _apply_expert(model, candidate, config)
    if not candidate.inline:
        parent, name = _parent(model, candidate.path)
        swaps = [Swap(parent, name, owner, SparseFFN(owner, spec, config))]
    else:
        # Names are paths below the owner: children, or grandchildren for an FFN split across two of them.
        group = []
        gate = GatePassthrough(owner.get_submodule(spec.gate), group)
        up = UpUnit(owner.get_submodule(spec.up), group) if spec.up is not None else None
        down = InlineFFN(owner.get_submodule(spec.down), spec, gate, up, group, config)
        replacements = {spec.gate: gate, spec.down: down}
        if up is not None:
            replacements[spec.up] = up
        replacements.update(
            {name: ActivationPassthrough(owner.get_submodule(name), group) for name in candidate.activation_children}
        )
        # A split FFN's halves (BERT's intermediate and output) pass x on while rewritten: hooks on them
        # make the members compute what their originals do, as hooks on the members do.
        group.extend(owner.get_submodule(name.rpartition(".")[0]) for name in (spec.gate, spec.down) if "." in name)
        swaps = [
            Swap(*_parent(owner, name), owner.get_submodule(name), module) for name, module in replacements.items()
        ]
    down = owner.get_submodule(spec.down)  # the original linear: a child shared with SparseFFN, or swapped inline
    for swap in swaps:
        setattr(swap.parent, swap.name, swap.replacement)
    # A Conv1D down weight is [N, K] row-major already: the rows the kernels gather.
    if isinstance(down, nn.Linear) and store_down_rows(down.weight):
        swaps[-1].relaid = (down, "weight")
    return swaps


def _apply_expert(model: nn.Module, candidate: Candidate, config: LayerConfig) -> list[Swap]:
    """One expert: the experts module is swapped for a SparseExperts on its first rewritten expert, and
    each further expert joins that one's rewritten set (no new swap)."""
    parent, name = _parent(model, candidate.path.rpartition(".")[0])
    current = getattr(parent, name)
    if isinstance(current, SparseExperts) and current.sync_original() is candidate.owner:
        current.layer_configs[candidate.expert] = config
        return []
    replacement = SparseExperts(candidate.owner, candidate.spec)
    replacement.layer_configs[candidate.expert] = config
    swap = Swap(parent, name, candidate.owner, replacement)
    setattr(parent, name, replacement)
    if store_expert_rows(candidate.owner, candidate.spec):
        swap.relaid = (candidate.owner, "down_proj")
    return [swap]


def undo(swaps: list[Swap]) -> None:
    """Put the originals back, carrying over tensors that .to()/.half() replaced meanwhile."""
    for swap in reversed(swaps):
        swap.replacement.sync_original()
        setattr(swap.parent, swap.name, swap.original)
    for swap in swaps:  # after every sync: the originals hold the current tensors
        if swap.relaid is not None:
            store_contiguous(getattr(*swap.relaid))
