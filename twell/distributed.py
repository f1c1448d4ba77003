"""twell inside PyTorch's distributed stack: FSDP2 (fully_shard) and tensor parallelism (DTensor).

The down weight's layout. The kernels gather rows of down_weight^T ([N, K], one row per hidden neuron);
on one GPU sparsify re-lays the weight once so that its transpose is contiguous. Under FSDP2 that
cannot hold: FSDP accepts contiguous parameters only and all-gathers them contiguous in the nn.Linear
layout ([K, N] row-major) before every forward and backward, into a tensor it frees again after. So
- in a program whose process group is initialised (as fully_shard needs), sparsify leaves plain down
  weights in the nn.Linear layout (store_down_rows), and fully_shard takes the model in either order;
- a call whose down weight lacks the rows layout (FSDP's gathered weight, a tensor-parallel shard laid
  out by parallelize_module after sparsify) gets a transposed copy for that call where it takes the
  prefill or the sparse training path (rows_for_call): 2 * N * K * itemsize bytes of DRAM traffic,
  K=2048 N=5632 bf16: 46 MB, ~11 us at 4 TB/s, against 1-10 ms for such a call; its backward passes
  the gradient through the transpose (AccumulateGrad lays it out as FSDP's parameter: one more such
  copy). Decode calls run dense there, as they do for any weight in that layout: a copy would cost
  about what the sparse decode saves (dense reads 3 * N * K * 2 bytes, the sparse decode about a
  third of that; the copy moves two thirds), and under FSDP each call already waits for the gather.
The other way, a parameter stored transposed ([N, K], sharded on neurons) so that FSDP gathers the
rows layout itself, would change the parameter's shape for named_parameters, optimizers and gradients,
and could not follow fully_shard applied before sparsify (FSDP has sharded the nn.Linear parameter
then); decode under FSDP2 is what it would add.

FSDP2: fully_shard all-gathers a module's parameters before its forward, so a rewritten FFN inside a
sharded module sees ordinary tensors: the layout above is all it needs from here.

Tensor parallelism (torch.distributed.tensor.parallel, gate and up ColwiseParallel, down
RowwiseParallel): each rank holds a slice of the hidden neurons. The rewritten FFN runs the gate
linear's input hook (the plan's input layout, made replicated), calls the twell op on the local
shards (its slice of the neurons: an exact partial sum of the output), and hands that partial sum as
a DTensor to the down linear's output hook, which reduces it as the plan says (all-reduce, or
reduce-scatter for sequence parallelism). Gradients flow through the same DTensor conversions. The
rank's down shard [K, N / ranks] is kept for good, so sparsify re-lays it in place (store_local_rows)
when the model is parallelized first; parallelized after sparsify, the shard is contiguous again
(distribute_tensor lays shards out so) and its calls take rows_for_call's copy.

Calibration of a sharded model: each gate's output slices are gathered so that every layer is
measured over all its neurons (TwELL tiles counted within each rank's slice, as the kernels run
them), and the decisions of rank 0 are broadcast, so that every rank rewrites the same layers.

Nothing here imports torch.distributed.tensor (a tensor can only be a DTensor once the program has
loaded it) or the ops (until a tensor-parallel FFN runs).
"""

from __future__ import annotations

import dataclasses
import sys

import torch
from torch import nn

# hooks that TP styles never register: a linear carrying one of these has hooks of someone else
_KWARGS_HOOKS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def _dtensor_api():
    """torch.distributed.tensor, if the program has loaded it (else no tensor is a DTensor)."""
    return sys.modules.get("torch.distributed.tensor")


def is_dtensor(t) -> bool:
    api = _dtensor_api()
    return api is not None and isinstance(t, api.DTensor)


def sharded(model: nn.Module) -> bool:
    """Whether any parameter of `model` is a DTensor (sharded by FSDP2 or tensor parallelism)."""
    return _dtensor_api() is not None and any(is_dtensor(p) for p in model.parameters())


def tensor_parallel_linear(module: nn.Module) -> bool:
    """A linear parallelized by a torch.distributed.tensor.parallel style on a 1-D mesh, carrying the
    style's hooks (one input hook, one output hook) and no others."""
    return (
        is_dtensor(getattr(module, "weight", None))  # first: the flag's getattr misses on plain linears
        and getattr(module, "_distribute_module_applied", False)
        and module.weight.device_mesh.ndim == 1
        and len(module._forward_pre_hooks) <= 1
        and len(module._forward_hooks) <= 1
        and not any(getattr(module, hooks) for hooks in _KWARGS_HOOKS)
    )


def _placed(t: torch.Tensor | None, mesh, placement) -> bool:
    return t is None or (is_dtensor(t) and t.device_mesh == mesh and tuple(t.placements) == (placement,))


def tensor_parallel(spec, gate: nn.Module, up: nn.Module | None, down: nn.Module) -> bool:
    """Whether the FFN's linears are sharded as run_tensor_parallel runs them: gate and up column-wise
    (weight and bias Shard(0)), down row-wise (weight Shard(1), bias replicated), one 1-D mesh, no
    fused gate_up linear."""
    api = _dtensor_api()
    linears = [m for m in (gate, up, down) if m is not None]
    if api is None or spec.gate_rows is not None or not all(tensor_parallel_linear(m) for m in linears):
        return False
    mesh = gate.weight.device_mesh
    column, row = api.Shard(0), api.Shard(1)
    return (
        all(_placed(m.weight, mesh, column) and _placed(m.bias, mesh, column) for m in linears[:-1])
        and _placed(down.weight, mesh, row)
        and _placed(down.bias, mesh, api.Replicate())
    )


def _input_hooks(module: nn.Module, x):
    args = (x,)
    for hook in module._forward_pre_hooks.values():
        result = hook(module, args)
        if result is not None:
            args = result if isinstance(result, tuple) else (result,)
    return args[0]


def _output_hooks(module: nn.Module, output):
    for hook in module._forward_hooks.values():
        result = hook(module, (), output)
        if result is not None:
            output = result
    return output


def run_tensor_parallel(spec, gate: nn.Module, up: nn.Module | None, down: nn.Module, x: torch.Tensor, config):
    """The FFN of `spec` (twell.passes.modules.FFNSpec) on x [..., K] with the layer's LayerConfig,
    its linears sharded as tensor_parallel() checks: the twell op on this rank's neurons, the partial
    sums reduced by the down linear's RowwiseParallel output hook. Returns what that hook returns (by
    default the replicated output as a local tensor)."""
    from twell.passes.modules import call_op, ffn_weights

    api = _dtensor_api()
    # The gate's ColwiseParallel input hook: the plan's input layout (replicated, or sequence-sharded
    # and all-gathered) as a replicated DTensor.
    x = _input_hooks(gate, x)
    if not is_dtensor(x) or tuple(x.placements) != (api.Replicate(),):
        raise ValueError(
            f"the gate linear's tensor-parallel input hook must give a replicated DTensor, got "
            f"{getattr(x, 'placements', type(x).__name__)}"
        )
    mesh = gate.weight.device_mesh
    # This rank's share of dL/dx is a partial sum over its neurons: reduced in backward.
    x_local = x.to_local(grad_placements=(api.Partial(),))

    # the down bias once, not per rank: DTensor adds a replicated bias to the reduced sum
    weights = dataclasses.replace(ffn_weights(spec, gate, up, down), down_bias=None).map(lambda t: t.to_local())
    y = call_op(spec, weights, x_local, config)
    y = api.DTensor.from_local(y, mesh, (api.Partial(),), run_check=False)
    if down.bias is not None:
        y = y + down.bias
    return _output_hooks(down, y)


def process_group_initialised() -> bool:
    """Whether the program has initialised torch.distributed's default process group (then sparsify
    leaves plain down weights in the nn.Linear layout: the module docstring)."""
    api = sys.modules.get("torch.distributed")
    return api is not None and api.is_available() and api.is_initialized()


def rows_for_call(weights, x: torch.Tensor, config):
    """`weights` (twell.passes.modules.FFNWeights) for the op's call on x [..., K] with the layer's
    LayerConfig: as given where the down weight [K, N] is stored as the kernels read it (its transpose
    contiguous), else with a transposed copy of it (differentiable) where the call takes the prefill
    path (policy.route) or may take the sparse training path (autograd recording, at least
    config.train_min_m tokens); decode-sized calls keep the nn.Linear layout and run dense."""
    from twell.kernels import policy

    down = weights.down
    if down.dim() != 2 or down.stride(0) == 1 or x.dim() < 1 or x.shape[-1] == 0:
        return weights
    k = x.shape[-1]
    m = x.numel() // k
    tensors = (x, *(getattr(weights, f.name) for f in dataclasses.fields(weights)))
    training = (
        config.train_min_m is not None
        and m >= config.train_min_m
        and k <= policy.MAX_K
        and torch.is_grad_enabled()
        and any(t is not None and t.requires_grad for t in tensors)
    )
    if not training and policy.route(m, k, config) != "prefill":
        return weights
    if type(down) not in (torch.Tensor, nn.Parameter):  # a tensor subclass (quantised): its own way
        return weights
    return dataclasses.replace(weights, down=down.t().contiguous().t())


def store_local_rows(weight: torch.Tensor) -> bool:
    """store_down_rows for a row-wise sharded (Shard(1), 1-D mesh) DTensor down weight: re-lay this
    rank's shard [K, N / ranks] so that its transpose is contiguous. Other DTensors (FSDP's shards,
    which FSDP requires contiguous) are left alone. Returns whether it re-laid the shard."""
    api = _dtensor_api()
    if (
        weight.dim() != 2
        or weight.device_mesh.ndim != 1
        or tuple(weight.placements) != (api.Shard(1),)
        or weight._local_tensor.t().is_contiguous()
    ):
        return False
    # The DTensor's own local tensor object (to_local() may return a new one): same object, new strides.
    with torch.no_grad():
        local = weight._local_tensor
        local.data = local.data.t().contiguous().t()
    return True


def store_local_contiguous(weight: torch.Tensor) -> None:
    """Undo store_local_rows."""
    local = weight._local_tensor
    if not local.is_contiguous():
        with torch.no_grad():
            local.data = local.data.contiguous()


# ---------------------------------------------------------------------------------------------------
# Calibration


def full_hidden(gate_module: nn.Module, h: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the gate linear's output over all its output features, the number of slices they are sharded
    into) for the output h of `gate_module`: a column-wise sharded linear gives this rank's slice (a
    local tensor or a DTensor), gathered here from every rank (a collective: every rank's hook calls it)."""
    if is_dtensor(h):
        shards = h.device_mesh.size() if any(p.is_shard() for p in h.placements) else 1
        return h.full_tensor(), shards
    weight = getattr(gate_module, "weight", None)
    if not is_dtensor(weight) or h.shape[-1] == weight.shape[0]:
        return h, 1
    api = _dtensor_api()
    if weight.device_mesh.ndim != 1 or tuple(weight.placements) != (api.Shard(0),):
        raise ValueError(
            f"the gate linear's weight is a DTensor placed {tuple(weight.placements)} on a "
            f"{weight.device_mesh.ndim}-D mesh: calibration reads column-wise sharded gates (Shard(0), 1-D mesh)"
        )
    shape = (*h.shape[:-1], weight.shape[0])
    stride = [1]
    for size in reversed(shape[1:]):
        stride.insert(0, stride[0] * size)
    # shape given: the last rank's slice is smaller when the features do not split evenly
    gathered = api.DTensor.from_local(
        h.contiguous(),
        weight.device_mesh,
        (api.Shard(h.dim() - 1),),
        run_check=False,
        shape=shape,
        stride=tuple(stride),
    )
    return gathered.full_tensor(), weight.device_mesh.size()


def agree(model: nn.Module, decisions: dict) -> dict:
    """Rank 0's decisions on every rank, for a sharded model in an initialised process group (every rank
    must call this); otherwise `decisions` unchanged."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and sharded(model)):
        return decisions
    box = [decisions]
    dist.broadcast_object_list(box, src=0)
    return box[0]


__all__ = [
    "agree",
    "full_hidden",
    "is_dtensor",
    "process_group_initialised",
    "rows_for_call",
    "run_tensor_parallel",
    "sharded",
    "store_local_contiguous",
    "store_local_rows",
    "tensor_parallel",
    "tensor_parallel_linear",
]
