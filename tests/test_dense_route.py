"""The dense route's fused activation * product (twell.kernels.dense) against PyTorch's ops: the same
bits, NaN kept, any size (CPU: Triton's interpreter)."""

import pytest
import torch
from conftest import DEVICE, HAS_CUDA
from ffn_cases import make_ffn

from twell.kernels import dense, reference

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])
# sizes below, at and past one program's block, and a 2-dim shape that is no multiple of it
SHAPES = [(1, 5), (1, dense.BLOCK), (3, 1000), (37, 300)]


def _expected(g, u, threshold, drelu, square):
    h = reference.thresholded_relu(g, threshold)
    if u is not None:
        return h * (torch.relu(u) if drelu else u)
    return h * h if square else h


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(
    "gated,drelu,square,threshold",
    [(True, False, False, 0.0), (True, True, False, 0.1), (False, False, True, 0.0), (False, False, False, 0.1)],
    ids=["gated", "drelu-fatrelu", "relu2", "plain-fatrelu"],
)
def test_act_mul_is_the_same_bits_as_torch(dtype, shape, gated, drelu, square, threshold):
    gen = torch.Generator().manual_seed(sum(shape))
    g = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    u = torch.randn(shape, generator=gen).to(dtype).to(DEVICE) if gated else None
    g.view(-1)[::7] = float("nan")  # NaN is kept by relu and carried by the product
    g.view(-1)[5::13] = threshold  # dropped: the threshold itself is not above it
    if u is not None:
        u.view(-1)[3::11] = float("nan")
    expected = _expected(g, u, threshold, drelu, square)
    out = dense.act_mul_(g.clone(), u, threshold, drelu=drelu, square=square)
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
def test_dense_route_matches_the_reference(gated):
    """The whole dense route (GEMMs, fused activation, product) against reference.gated_ffn_reference / ffn: the
    same ops in the same order, so the same values; biases and a down weight stored as rows of its
    transpose (the layout sparsify leaves)."""
    case = make_ffn(13, 24, 70, [0.0, 0.1, 1.0], torch.float32, DEVICE, seed=2, biases=True, gated=gated)
    c = {k: v.float() if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    down = c["down_weight"].t().contiguous().t()  # [K, N] view of [N, K] rows
    if gated:
        args = (c["x"], c["gate_weight"], c["up_weight"], down, c["gate_bias"], c["up_bias"], c["down_bias"], 0.0)
        out, ref = dense.gated_ffn_dense(*args, False), reference.gated_ffn_reference(*args, False)
    else:
        args = (c["x"], c["up_weight"], down, c["up_bias"], c["down_bias"], 0.0)
        out, ref = dense.ffn_dense(*args, True), reference.ffn_reference(*args, True)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


def test_act_mul_refuses_what_it_cannot_index():
    g = torch.zeros(4, 6, device=DEVICE)
    with pytest.raises(ValueError, match="contiguous g and u of one shape"):
        dense.act_mul_(g.t(), None, 0.0, drelu=False, square=False)
    with pytest.raises(ValueError, match="contiguous g and u of one shape"):
        dense.act_mul_(g, torch.zeros(4, 5, device=DEVICE), 0.0, drelu=False, square=False)
    assert dense.act_mul_(g[:0], None, 0.0, drelu=False, square=False).numel() == 0
