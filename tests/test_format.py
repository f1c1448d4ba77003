"""TwELL format (with its overflow rows): exact round trips and clear errors."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import twell
from twell.format import DEFAULT_SLOTS, DEFAULT_TILE_N, MAX_TILE_N, decode, encode, kept_mask, word_dtype
from twell.kernels import policy

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
    slots_log=st.integers(0, 3),
    density=st.sampled_from([0.0, 0.01, 0.1, 0.3, 0.7, 1.0]),
    dtype=st.sampled_from(DTYPES),
    threshold=st.sampled_from([0.0, 0.5]),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip_is_exact(m, n, tile_log, slots_log, density, dtype, threshold, seed):
    tile_n = 2**tile_log
    slots = tile_n >> slots_log
    h = random_hidden(m, n, density, dtype, seed)
    t = twell.pack(h, tile_n=tile_n, slots=slots, threshold=threshold)
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
    t = twell.pack(h, tile_n=4, slots=2)
    assert t.slots == 2 and t.n_tiles == 3
    assert t.counts.tolist() == [[2, 1, 1], [4, 0, 0]]
    assert t.columns[0].tolist() == [[1, 3], [2, 0], [0, 0]]
    assert t.values[0].float().tolist() == [[1.0, 3.0], [5.0, 0.0], [7.0, 0.0]]
    assert t.overflow_rows.tolist() == [1]
    assert torch.equal(t.dense, h[1:2])
    assert (t.values.dtype, t.words.dtype, t.counts.dtype) == (dtype, word_dtype(dtype), torch.int32)
    assert t.words.dtype == (torch.int64 if dtype == torch.float32 else torch.int32)
    assert (t.overflow_rows.dtype, t.dense.dtype, t.shape, t.tile_n, t.threshold) == (
        torch.int64,
        dtype,
        (2, 9),
        4,
        0.0,
    )
    assert t.nnz_per_row().tolist() == [4, 4]
    assert t.stats() == {
        "rows": 2,
        "cols": 9,
        "tile_n": 4,
        "slots": 2,
        "nnz_per_row_mean": 4.0,
        "nnz_per_row_max": 4,
        "max_per_tile": 4,
        "overflow_rows": 1,
        "density": 8 / 18,
        "nbytes": t.nbytes,
    }


def test_stats_of_degenerate_shapes():
    empty = twell.pack(torch.zeros(0, 5), tile_n=4, slots=2).stats()
    assert (empty["nnz_per_row_mean"], empty["nnz_per_row_max"], empty["max_per_tile"], empty["density"]) == (
        0,
        0,
        0,
        0,
    )
    assert twell.pack(torch.zeros(3, 0), tile_n=4, slots=2).stats()["max_per_tile"] == 0
    assert twell.pack(torch.ones(1, 1), tile_n=4, slots=2).stats()["density"] == 1.0


def test_threshold_is_kept_with_the_matrix():
    t = twell.pack(torch.tensor([[0.2, 0.7, 0.5]]), tile_n=4, slots=4, threshold=0.5)
    assert t.threshold == 0.5 and t.counts.tolist() == [[1]]


def test_entries_are_packed_in_column_order():
    """Within a (row, tile) the kept entries come in column order (a stable packing), at wide tiles too."""
    h = random_hidden(4, 1024, 0.3, torch.float32, seed=3)
    t = twell.pack(h, tile_n=512, slots=512)
    for row, tile in zip(*torch.nonzero(t.counts).T.tolist(), strict=True):
        kept = t.columns[row, tile, : t.counts[row, tile]]
        assert torch.equal(kept, torch.nonzero(kept_mask(h[row, tile * 512 : (tile + 1) * 512], 0.0)).flatten())


def test_unpack_reads_only_the_counted_slots():
    """What lies past each count (kernel scratch) does not reach the dense matrix."""
    h = random_hidden(6, 40, 0.2, torch.float32, seed=4)
    t = twell.pack(h, tile_n=16, slots=8)
    padding = torch.arange(t.slots) >= t.counts.unsqueeze(-1)
    assert padding.any()
    garbage = torch.randint(-(2**62), 2**62, t.words.shape, dtype=torch.int64).to(t.words.dtype)
    t.words = torch.where(padding, garbage, t.words)
    assert torch.equal(twell.unpack(t), thresholded(h, 0.0))


@pytest.mark.parametrize("row", [[1.0, 2.0, -1.0], [-1.0]], ids=["3-columns", "1-empty-column"])
@pytest.mark.parametrize("tile_n", [1, MAX_TILE_N], ids=["one-column", "widest"])
def test_extreme_tile_widths(tile_n, row):
    h = torch.tensor([row])
    assert torch.equal(twell.unpack(twell.pack(h, tile_n=tile_n, slots=1)), torch.relu(h))


def test_nan_and_inf_follow_relu():
    h = torch.tensor([[float("nan"), float("inf"), -float("inf"), -0.0, 2.0]])
    out = twell.unpack(twell.pack(h, tile_n=8, slots=8))
    assert torch.equal(out.isnan(), torch.relu(h).isnan())
    assert torch.equal(torch.nan_to_num(out), torch.nan_to_num(torch.relu(h)))


def test_wide_rows_beyond_16_bit_columns():
    h = torch.zeros(2, 70_000)
    h[0, 69_999] = 1.5
    h[1, 65_536] = 2.5
    t = twell.pack(h)
    assert torch.equal(twell.unpack(t), h)


def test_the_default_layout_is_the_kernels():
    """One default layout: pack's is the one every rewritten layer's kernels run (LayerConfig's)."""
    t = twell.pack(torch.randn(3, 300))
    assert (t.tile_n, t.slots) == (DEFAULT_TILE_N, DEFAULT_SLOTS) == (policy.TILE_N, policy.SLOTS)
    assert t.n_tiles == 3


def test_nbytes_counts_every_array():
    t = twell.pack(torch.randn(8, 64), tile_n=32, slots=8)
    arrays = (t.words, t.counts, t.overflow_rows, t.dense)
    assert t.nbytes == sum(a.numel() * a.element_size() for a in arrays)


@pytest.mark.parametrize(
    "h, kwargs, error, match",
    [
        (torch.randn(4), {}, ValueError, "2 dims"),
        (torch.randn(2, 3, 4), {}, ValueError, "2 dims"),
        (torch.ones(2, 4, dtype=torch.int32), {}, TypeError, "floating-point"),
        (torch.randn(2, 4), {"tile_n": 4, "slots": 5}, ValueError, "slots must be <= tile_n, got slots=5, tile_n=4"),
        (torch.randn(2, 4), {"tile_n": 0}, ValueError, "tile_n must be a positive int, got 0"),
        (torch.randn(2, 4), {"slots": True}, ValueError, "slots must be a positive int, got True"),
        (torch.randn(2, 4), {"tile_n": 2 * MAX_TILE_N, "slots": 1}, ValueError, "tile_n must be <="),
        (torch.randn(2, 4, dtype=torch.float64), {}, TypeError, "floating-point"),
        ([[1.0]], {}, TypeError, "h must be a torch.Tensor, got list"),
        (torch.randn(2, 4), {"threshold": float("nan")}, ValueError, "finite"),
    ],
    ids=[
        "rank1",
        "rank3",
        "int-dtype",
        "more-slots-than-columns",
        "zero-tile",
        "bool-slots",
        "tile-too-wide",
        "float64",
        "not-a-tensor",
        "nan-threshold",
    ],
)
def test_bad_input_is_refused(h, kwargs, error, match):
    with pytest.raises(error, match=match):
        twell.pack(h, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_words_hold_any_value_and_column_bit_for_bit(dtype):
    """encode / decode: every value's bits (NaN, infinities, -0, subnormals, negatives) and every
    16-bit column survive, whatever the sign of the value (its bits fill the word's high half)."""
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, -1.5, 3.0], dtype=dtype)
    tiny = torch.tensor([torch.finfo(dtype).tiny / 4, -torch.finfo(dtype).tiny / 4], dtype=dtype)
    values = torch.cat((specials, tiny, torch.randn(200).to(dtype)))
    columns = torch.randint(0, MAX_TILE_N, values.shape)
    columns[:3] = torch.tensor([0, MAX_TILE_N - 1, 1 << 15])
    out_values, out_columns = decode(encode(values, columns), dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(out_values.view(bits), values.view(bits))
    assert torch.equal(out_columns, columns)


def test_unpack_refuses_other_types():
    with pytest.raises(TypeError, match="unpack expects a TwELL, got Tensor"):
        twell.unpack(torch.zeros(2, 2))
