"""The TwELL layout with its overflow rows: the executable spec every kernel is tested against.

A hidden matrix h [M, N] is cut into column tiles of ``tile_n`` columns (the last one may be partial).
Inside each (row, tile) the entries that survive the threshold are packed, in column order, to the
front of the tile's ``slots`` slots, each one word holding the value and the tile-local column index
(the reference code's layout), and the true count is kept per (row, tile). A layout is the pair
(tile_n, slots); the paper's compression factor C is tile_n / slots (the defaults, 128 and 16, are
C = 8, as the reference code, and the kernels' twell.kernels.policy.TILE_N / SLOTS). A row whose count
exceeds ``slots`` in any tile is an overflow row: it goes *whole* into a dense backup matrix, with its
row id, so no value is dropped (the paper's "hybrid" format).

Layout (chosen for the kernels, see twell/kernels):
    words    [M, n_tiles, slots]  word_dtype(dtype of h): the value's bits in the high half, the column
                                  inside the tile in the low 16 bits (global column = tile * tile_n +
                                  column): int32 for fp16 / bf16 values, int64 for fp32. Slots past the
                                  count are unspecified (the kernels leave them unwritten: zeroing them
                                  cost 0.3 ms a call at 131072 tokens on an H200); consumers mask by count.
                                  Tile-local columns lift the 16-bit global-index limit of the reference
                                  code: any N works, tile_n <= 65536
    counts   [M, n_tiles]         int32, true number of kept entries (may exceed slots)
    overflow_rows [R]             int64, ascending: rows with some count > slots
    dense    [R, N]               dtype of h, the thresholded overflow rows

For overflow rows the ELL part holds the first ``slots`` entries of each tile but consumers must ignore
it: the dense backup is authoritative. "Kept" means ``not (h <= threshold)``: ReLU semantics, NaN kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DEFAULT_TILE_N = 128
DEFAULT_SLOTS = 16
MAX_TILE_N = 1 << 16  # tile-local columns fill a word's low 16 bits
COLUMN_MASK = 0xFFFF


def check_layout(tile_n: int, slots: int) -> None:
    """Validate a (tile_n, slots) layout: positive ints, slots <= tile_n <= MAX_TILE_N."""
    for name, value in (("tile_n", tile_n), ("slots", slots)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if tile_n > MAX_TILE_N:
        raise ValueError(f"tile_n must be <= {MAX_TILE_N} (16-bit tile-local columns), got {tile_n}")
    if slots > tile_n:
        raise ValueError(f"slots must be <= tile_n, got slots={slots}, tile_n={tile_n}")


def kept_mask(h: torch.Tensor, threshold: float) -> torch.Tensor:
    """Entries that survive the activation: not (h <= threshold). NaN survives, as in torch.relu."""
    return ~(h <= threshold)


def word_dtype(dtype: torch.dtype) -> torch.dtype:
    """The integer type of one slot for values of `dtype`: twice the value's width."""
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"TwELL values must be float16, bfloat16 or float32, got {dtype}")
    return torch.int64 if dtype == torch.float32 else torch.int32


def encode(values: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """Words of (value, tile-local column) pairs: value bits << half the word width | column."""
    bits, wide = (torch.int32, torch.int64) if values.dtype == torch.float32 else (torch.int16, torch.int32)
    half = 8 * values.element_size()
    return (values.view(bits).to(wide) << half) | columns.to(wide)


def decode(words: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(values in `dtype`, tile-local columns as int64) of words made by encode."""
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    half = 8 * torch.empty((), dtype=dtype).element_size()
    return (words >> half).to(bits).view(dtype), (words & COLUMN_MASK).long()


@dataclass
class TwELL:
    """TwELL matrix with its overflow rows' dense backup. See the module docstring for the layout."""

    words: torch.Tensor
    counts: torch.Tensor
    overflow_rows: torch.Tensor
    dense: torch.Tensor
    shape: tuple[int, int]
    tile_n: int
    threshold: float = 0.0

    @property
    def slots(self) -> int:
        return self.words.shape[-1]

    @property
    def dtype(self) -> torch.dtype:
        """The values' dtype (the dense backup's, which exists even with no overflow row)."""
        return self.dense.dtype

    def valid(self) -> torch.Tensor:
        """[M, n_tiles, slots] bool: the slots inside each count (the only ones that hold entries)."""
        return torch.arange(self.slots, device=self.words.device) < self.counts.unsqueeze(-1)

    @property
    def values(self) -> torch.Tensor:
        """[M, n_tiles, slots] values of the slots, 0 past each count."""
        values = decode(self.words, self.dtype)[0]
        return torch.where(self.valid(), values, torch.zeros((), dtype=self.dtype, device=values.device))

    @property
    def columns(self) -> torch.Tensor:
        """[M, n_tiles, slots] int64 tile-local columns of the slots, 0 past each count."""
        return torch.where(self.valid(), decode(self.words, self.dtype)[1], 0)

    @property
    def n_tiles(self) -> int:
        return self.counts.shape[-1]

    @property
    def nbytes(self) -> int:
        """Bytes of all arrays together (what storing this activation costs)."""
        arrays = (self.words, self.counts, self.overflow_rows, self.dense)
        return sum(a.numel() * a.element_size() for a in arrays)

    def nnz_per_row(self) -> torch.Tensor:
        """[M] int64: number of kept entries in each row (exact, overflow rows included)."""
        return self.counts.sum(dim=1, dtype=torch.int64)

    def stats(self) -> dict:
        """Nonzeros per row (mean, max), max per tile, overflow rows and the storage size."""
        m, n = self.shape
        nnz = self.nnz_per_row()
        return {
            "rows": m,
            "cols": n,
            "tile_n": self.tile_n,
            "slots": self.slots,
            "nnz_per_row_mean": nnz.double().mean().item() if m else 0.0,
            "nnz_per_row_max": int(nnz.max().item()) if m else 0,
            "max_per_tile": int(self.counts.max().item()) if self.counts.numel() else 0,
            "overflow_rows": int(self.overflow_rows.numel()),
            "density": nnz.double().sum().item() / max(m * n, 1),
            "nbytes": self.nbytes,
        }


def pack(
    h: torch.Tensor,
    *,
    tile_n: int = DEFAULT_TILE_N,
    slots: int = DEFAULT_SLOTS,
    threshold: float = 0.0,
) -> TwELL:
    """Pack h [M, N] into TwELL with `slots` slots per tile of `tile_n` columns (rows that overflow
    them: into the dense backup), keeping entries > threshold (threshold 0 is ReLU)."""
    if not isinstance(h, torch.Tensor):
        raise TypeError(f"h must be a torch.Tensor, got {type(h).__name__}")
    if h.dim() != 2:
        raise ValueError(f"h must have shape [M, N] (2 dims), got {h.dim()} dims: {tuple(h.shape)}")
    if h.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"h must be a floating-point tensor (fp32, fp16, bf16), got {h.dtype}")
    check_layout(tile_n, slots)
    if not math.isfinite(threshold):
        raise ValueError(f"threshold must be a finite float, got {threshold}")
    m, n = h.shape
    n_tiles = -(-n // tile_n)
    keep = kept_mask(h, threshold)
    pad = n_tiles * tile_n - n
    hp = torch.nn.functional.pad(h, (0, pad)).view(m, n_tiles, tile_n)
    keepp = torch.nn.functional.pad(keep, (0, pad), value=False).view(m, n_tiles, tile_n)

    counts = keepp.sum(dim=-1, dtype=torch.int32)
    # A stable sort on "not kept" moves the kept columns to the front, in column order.
    order = torch.argsort((~keepp).to(torch.int8), dim=-1, stable=True)[..., :slots]
    # the spec zeroes the slots past each count (kernels leave them as they were)
    valid = torch.arange(slots, device=h.device) < counts.unsqueeze(-1)
    words = torch.where(valid, encode(torch.gather(hp, -1, order), order), 0)

    overflow_rows = torch.nonzero((counts > slots).any(dim=1)).flatten()
    dense = torch.where(keep[overflow_rows], h[overflow_rows], torch.zeros((), dtype=h.dtype, device=h.device))
    return TwELL(words, counts, overflow_rows, dense, (m, n), tile_n, float(threshold))


def unpack(t: TwELL) -> torch.Tensor:
    """Dense [M, N] matrix of a TwELL: the thresholded input of pack(), bit for bit."""
    if not isinstance(t, TwELL):
        raise TypeError(f"unpack expects a TwELL, got {type(t).__name__}")
    m, n = t.shape
    slots, n_tiles = t.slots, t.n_tiles
    out = torch.zeros(m, n_tiles * t.tile_n, dtype=t.dtype, device=t.words.device)
    tile_base = (torch.arange(n_tiles, device=out.device) * t.tile_n).view(1, n_tiles, 1)
    cols = t.columns + tile_base
    # Padding slots add an exact 0 to column 0 of their tile; every kept column receives one value.
    out.scatter_add_(1, cols.view(m, n_tiles * slots), t.values.view(m, n_tiles * slots))
    out = out[:, :n]
    if t.overflow_rows.numel():
        out[t.overflow_rows] = t.dense
    return out


__all__ = [
    "TwELL",
    "pack",
    "unpack",
    "encode",
    "decode",
    "word_dtype",
    "check_layout",
    "kept_mask",
    "DEFAULT_TILE_N",
    "DEFAULT_SLOTS",
]
