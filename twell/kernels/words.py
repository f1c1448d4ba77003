"""One TwELL slot as one word, in Triton: the kernels' side of twell.format.encode / decode.

A slot holds a value's bits in the word's high half and its tile-local column in the low 16 bits:
an int32 word for fp16 / bf16 values, int64 for fp32. One store per packed entry and one load per
read entry (two arrays cost the gate's epilogue 0.6 ms more at 131072 tokens on an H200, measured with
../shared/probes/pack_epilogue_probe.py).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def encode(value, column):
    """Words of `value` (fp16, bf16 or fp32 tensor) and `column` (int, 0 <= column < 2**16)."""
    # if / else with one return: Triton 3.6 compiles the statements after a return inside a
    # compile-time if too (a 32-bit value's 16-bit bitcast then fails: fuzz-20261201-214924.json)
    if value.dtype == tl.float32:
        word = (value.to(tl.int32, bitcast=True).to(tl.int64) << 32) | column.to(tl.int64)
    else:
        word = (value.to(tl.int16, bitcast=True).to(tl.int32) << 16) | column.to(tl.int32)
    return word


@triton.jit
def decode(word, VALUE: tl.constexpr):
    """(value as fp32, column as int32) of words made by encode for values of dtype VALUE."""
    column = (word & 0xFFFF).to(tl.int32)
    if VALUE == tl.float32:  # if / else with one return, as in encode
        value = (word >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    else:
        value = (word >> 16).to(tl.int16).to(VALUE, bitcast=True).to(tl.float32)
    return value, column
