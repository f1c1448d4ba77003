"""TwELL / hybrid format: exact round trips and clear errors."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import twell
from twell.format import kept_mask

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def random_hidden(m, n, density, dtype, seed):
    """Gaussian values (half negative) where a Bernoulli(density) mask fires, -|noise| elsewhere."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(m, n, generator=g)
    fire = torch.rand(m, n, generator=g) < density
    return torch.where(fire, values.abs() + 0.01, -values.abs()).to(dtype)


def thresholded(h, threshold):
    return torch.where(kept_mask(h, threshold), h, torch.zeros((), dtype=h.dtype))


@settings(max_examples=150, deadline=None)
@given(
    m=st.integers(0, 40),
    n=st.integers(0, 300),
    tile_log=st.integers(3, 8),
    comp_log=st.integers(0, 3),
    density=st.sampled_from([0.0, 0.01, 0.1, 0.3, 0.7, 1.0]),
    dtype=st.sampled_from(DTYPES),
    threshold=st.sampled_from([0.0, 0.5]),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip_is_exact(m, n, tile_log, comp_log, density, dtype, threshold, seed):
    tile_n, compression = 2**tile_log, 2**comp_log
    h = random_hidden(m, n, density, dtype, seed)
    t = twell.pack(h, tile_n=tile_n, compression=compression, threshold=threshold)
    out = twell.unpack(t)
    assert out.dtype == h.dtype and out.shape == h.shape
    assert torch.equal(out, thresholded(h, threshold))
    # counts are exact and overflow rows are exactly the rows with a tile past its slots
    keep = kept_mask(h, threshold)
    assert torch.equal(t.nnz_per_row(), keep.sum(1))
    assert torch.equal(t.overflow_rows, torch.nonzero((t.counts > t.slots).any(1)).flatten())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layout_of_a_known_matrix(dtype):
    h = torch.tensor(
        [
            [0.0, 1.0, -2.0, 3.0, 0.0, 0.0, 5.0, 0.0, 7.0],  # 2 kept in tile 0, 1 in tile 1, 1 in tile 2
            [1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # 4 kept in tile 0: overflows 2 slots
        ],
        dtype=dtype,
    )
    t = twell.pack(h, tile_n=4, compression=2)
    assert t.slots == 2 and t.n_tiles == 3
    assert t.counts.tolist() == [[2, 1, 1], [4, 0, 0]]
    assert t.indices[0].tolist() == [[1, 3], [2, 0], [0, 0]]
    assert t.values[0].float().tolist() == [[1.0, 3.0], [5.0, 0.0], [7.0, 0.0]]
    assert t.overflow_rows.tolist() == [1]
    assert torch.equal(t.dense, h[1:2])
    stats = t.stats()
    assert stats["nnz_per_row_max"] == 4 and stats["max_per_tile"] == 4 and stats["overflow_rows"] == 1
    assert stats["nnz_per_row_mean"] == 4.0


def test_nan_and_inf_follow_relu():
    h = torch.tensor([[float("nan"), float("inf"), -float("inf"), -0.0, 2.0]])
    out = twell.unpack(twell.pack(h, tile_n=8, compression=1))
    assert torch.equal(out.isnan(), torch.relu(h).isnan())
    assert torch.equal(torch.nan_to_num(out), torch.nan_to_num(torch.relu(h)))


def test_wide_rows_beyond_16_bit_columns():
    h = torch.zeros(2, 70_000)
    h[0, 69_999] = 1.5
    h[1, 65_536] = 2.5
    t = twell.pack(h)
    assert torch.equal(twell.unpack(t), h)


def test_nbytes_counts_every_array():
    t = twell.pack(torch.randn(8, 64), tile_n=32, compression=4)
    arrays = (t.values, t.indices, t.counts, t.overflow_rows, t.dense)
    assert t.nbytes == sum(a.numel() * a.element_size() for a in arrays)


@pytest.mark.parametrize(
    "h, kwargs, error, match",
    [
        (torch.randn(4), {}, ValueError, "2 dims"),
        (torch.randn(2, 3, 4), {}, ValueError, "2 dims"),
        (torch.ones(2, 4, dtype=torch.int32), {}, TypeError, "floating-point"),
        (torch.randn(2, 4), {"tile_n": 10, "compression": 3}, ValueError, "divisible by compression"),
        (torch.randn(2, 4), {"tile_n": 0}, ValueError, "positive int"),
        (torch.randn(2, 4), {"tile_n": 65536, "compression": 1}, ValueError, "tile_n must be <="),
        ([[1.0]], {}, TypeError, "torch.Tensor"),
        (torch.randn(2, 4), {"threshold": float("nan")}, ValueError, "finite"),
    ],
    ids=["rank1", "rank3", "int-dtype", "indivisible", "zero-tile", "tile-too-wide", "not-a-tensor", "nan-threshold"],
)
def test_bad_input_is_refused(h, kwargs, error, match):
    with pytest.raises(error, match=match):
        twell.pack(h, **kwargs)


def test_unpack_refuses_other_types():
    with pytest.raises(TypeError, match="TwELL"):
        twell.unpack(torch.zeros(2, 2))
