"""Functional entry points: sparse-aware FFNs with nn.Linear weight layouts.

Both are exact at any sparsity (overflowing rows take a dense path, and shapes where sparse would not
pay run dense) and run on any device: Triton kernels on CUDA, plain PyTorch elsewhere.
"""

from __future__ import annotations

import torch

from twell.kernels import checks, library, policy, reference
from twell.kernels.policy import LayerConfig


def gated_ffn(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    *,
    gate_bias: torch.Tensor | None = None,
    up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    threshold: float = 0.0,
    drelu: bool = False,
    return_l1: bool = False,
    config: LayerConfig | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """y = down(relu_t(gate(x)) * up(x)) for x [..., K].

    gate_weight, up_weight: [N, K]; down_weight: [K, N] (nn.Linear layouts; down_weight is read
    fastest when down_weight.t() is contiguous). relu_t keeps values > threshold (0: ReLU).
    drelu: ReLU on up(x) too (dReLU). Returns [..., K] in the dtype of x.

    config: the layer's twell.kernels.policy.LayerConfig (None: the defaults of its width,
    policy.default_config(K)): which path a call takes on CUDA (route limits) and the TwELL layout of the
    prefill path.

    Under autograd on CUDA with that layout (and K <= 8192, at least config.train_min_m tokens: opt-in,
    None by default), the forward keeps a compact record of the hidden activation h and the backward is
    sparse too (twell.kernels.backward); otherwise backward recomputes through the dense reference.
    return_l1: return (y, l1, density) instead: l1 the mean |h| over h [..., N] (fp32, differentiable:
    twell.train's penalty term), density the fraction of nonzero h (a tensor, no grad). Training
    sparsely they come from the forward at no extra cost; otherwise h is recomputed (two more products).
    """
    args = (x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, float(threshold))
    return _run(args, bool(drelu), False, return_l1, config)


def ffn(
    x: torch.Tensor,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    *,
    up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    threshold: float = 0.0,
    squared: bool = False,
    return_l1: bool = False,
    config: LayerConfig | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """y = down(relu_t(up(x))) for x [..., K] (OPT, ReLU-Falcon); squared: relu² (Nemotron).

    up_weight: [N, K]; down_weight: [K, N]. Returns [..., K] in the dtype of x. Training, return_l1
    and config as for gated_ffn.
    """
    args = (x, up_weight, None, down_weight, up_bias, None, down_bias, float(threshold))
    return _run(args, False, bool(squared), return_l1, config)


def _run(args: tuple, drelu: bool, squared: bool, return_l1: bool, config: LayerConfig | None):
    """The sparse training op where it applies, else the op of the FFN's kind (with the layer's route
    arguments); with its L1 terms."""
    x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, threshold = args
    if config is None:
        config = policy.default_config(x.shape[-1] if x.dim() else 0)  # a bad x: the op's checks name it
    elif not isinstance(config, LayerConfig):
        raise TypeError(f"config must be a twell.kernels.policy.LayerConfig or None, got {type(config).__name__}")
    biases = (gate_bias, up_bias, down_bias)
    if library.sparse_training(x, gate_weight, up_weight, down_weight, biases, config.train_min_m):
        width = policy.train_width(gate_weight.shape[0])
        train = (width, config.train_entries, config.train_dense_above, config.train_hot, config.train_forward_pack)
        y, *_, l1_sum, nonzero = torch.ops.twell.ffn_train(*args, drelu, squared, *train)
        if not return_l1:
            return y
    else:
        y = _without_op(args, drelu, squared, config)
        if y is None and up_weight is None:
            route = config.op_args()
            y = torch.ops.twell.ffn(x, gate_weight, down_weight, gate_bias, down_bias, threshold, squared, *route)
        elif y is None:
            y = torch.ops.twell.gated_ffn(*args, drelu, *config.op_args())
        if not return_l1:
            return y
        h = reference.hidden(x, gate_weight, up_weight, gate_bias, up_bias, threshold, drelu, squared)
        l1_sum, nonzero = h.abs().sum(dtype=torch.float32), torch.count_nonzero(h)
    numel = x.numel() // max(x.shape[-1], 1) * gate_weight.shape[0]
    return y, l1_sum / numel, nonzero / numel


# The device whose calls without autograd skip the op (twell.ops runs the dispatcher itself)
DIRECT_DEVICE = "cuda"


def _without_op(args: tuple, drelu: bool, squared: bool, config: LayerConfig) -> torch.Tensor | None:
    """y of a call twell.ops runs without the op (_plain_call's), None where the op must run."""
    if not _plain_call(args):
        return None
    if torch.compiler.is_compiling():  # traced as the dense FFN's torch ops, else as the op
        return _traced_dense(args, drelu, squared) if _always_dense(args, config) else None
    if torch._C._len_torch_dispatch_stack():  # a mode that records ops one by one sees the op
        return None
    return _direct(args, drelu, squared, config)


def _plain_call(args: tuple) -> bool:
    """A call on DIRECT_DEVICE without autograd, on plain tensors. Eagerly (and under no dispatch mode)
    twell.ops runs the op's CUDA implementation itself (_direct), without the custom op's layers: an
    eager prefill call through the module then costs 0.539 ms of host time, what the op called alone
    costs (0.553); the module's own ~0.09 ms (0.539 against the dispatcher's 0.451) used to come on top
    of the op, so ~0.1 ms a call is saved (estimated from one run on an H100 host,
    host_time-20261205-142322.json; the old path was not timed there). Under torch.compile a size every
    state routes dense is traced as the dense FFN's torch ops (_traced_dense), which Inductor compiles
    as it compiles the dense model: a compiled prompt of 16-1024 tokens paid the op's host path,
    0.2-0.27 ms a layer, where dense compiled pays none (whole generation 0.94x of dense compiled at
    batch 16, e2e-20261202-222107.json); traced, the prompt costs what dense's does (batch 64: 10.01
    against 9.79 ms, e2e-20261205-033502.json)."""
    x, down_weight = args[0], args[3]
    tensors = [t for t in args[:7] if t is not None]
    if x.device.type != DIRECT_DEVICE:
        return False
    if x.dim() == 0 or not isinstance(down_weight, torch.Tensor) or down_weight.dim() != 2:
        return False  # the op's checks name what is wrong
    if any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in tensors):  # fake, functional, DTensor
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def _always_dense(args: tuple, config: LayerConfig) -> bool:
    """Whether the CUDA dispatcher routes this call dense in every state (dynamo guards the token count)."""
    from twell.kernels import dispatch

    x, down_weight = args[0], args[3]
    return dispatch.always_dense(x.numel() // max(x.shape[-1], 1), x.shape[-1], config, down_weight.t())


def _check(args: tuple) -> None:
    """The op's input checks (its errors), for the calls twell.ops runs without the op."""
    x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, threshold = args
    if up_weight is None:
        checks.check_plain(x, gate_weight, down_weight, gate_bias, down_bias, threshold)
    else:
        checks.check_gated(x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, threshold)


def _direct(args: tuple, drelu: bool, squared: bool, config: LayerConfig) -> torch.Tensor:
    """The op's CUDA implementation called directly, after its checks: the same dispatcher, the same
    route and bits."""
    from twell.kernels import dispatch

    _check(args)
    x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, threshold = args
    if up_weight is None:
        return dispatch.ffn_cuda(x, gate_weight, down_weight, gate_bias, down_bias, threshold, squared, config)
    return dispatch.gated_ffn_cuda(
        x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, threshold, drelu, config
    )


def _traced_dense(args: tuple, drelu: bool, squared: bool) -> torch.Tensor:
    """The FFN in plain torch ops (reference.hidden), after the op's checks: what a compiled call every
    state routes dense is traced as, for Inductor to fuse."""
    _check(args)
    x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias, threshold = args
    h = reference.hidden(x, gate_weight, up_weight, gate_bias, up_bias, threshold, drelu, squared)
    return torch.nn.functional.linear(h, down_weight, down_bias)


__all__ = ["LayerConfig", "gated_ffn", "ffn"]
