"""Element-wise masking of a score fragment, from the same row bands the host uses
(``fmha.masking.row_key_bounds``). Only tiles the tile schedule marks as masked call this.

A row's kept keys are one interval ``[lo, hi)``. Instead of two compares per score, each thread
turns the interval into a 32-bit mask over its own columns of the row (``kept_column_bits``) and
tests one constant bit per score, which ptxas lowers to R2P + FSEL."""

import math
from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32
from cutlass.cutlass_dsl import dsl_user_op

from fmha.masking import MaskKind, row_key_bounds

from .fragments import as_rows_cols, ptx_b32

# A thread's columns of one row of a warpgroup-MMA accumulator, in ``as_rows_cols`` order: pairs
# of adjacent columns, the pairs 8 apart. Column i of the thread's row sits at offset
# ``column_offset(i)`` from the thread's first column; 32 of them (a chunk) span 128 columns.
CHUNK = 32


def column_offset(i: int) -> int:
    return 8 * (i // 2) + i % 2


def _count_below(limit, imin, imax):
    """How many of a chunk's columns have offsets below ``limit`` (any integer)."""
    h = imin(imax(limit, 0), 4 * CHUNK)
    return 2 * (h >> 3) + imin(h & 7, 2)


def kept_column_bits(lo_rel, hi_rel, chunk: int, shr=None, shl=None, imin=min, imax=max):
    """Bit i set iff the thread's column ``CHUNK * chunk + i`` is kept, for a row keeping offsets
    ``[lo_rel, hi_rel)`` relative to the thread's first column. ``shr``/``shl`` shift 0xFFFFFFFF
    by 0..32 with PTX semantics (32 gives 0); the defaults do it on Python ints."""
    shr = shr or (lambda n: (0xFFFFFFFF >> n) if n < 32 else 0)
    shl = shl or (lambda n: (0xFFFFFFFF << n) & 0xFFFFFFFF if n < 32 else 0)
    base = 4 * CHUNK * chunk
    below_hi = shr(CHUNK - _count_below(hi_rel - base, imin, imax))
    from_lo = shl(_count_below(lo_rel - base, imin, imax))
    return below_hi & from_lo


@dsl_user_op
def _ones_shifted(amount: Int32, left: bool, *, loc=None, ip=None) -> Uint32:
    """0xFFFFFFFF shifted by ``amount`` in 0..32, in PTX (whose shift by 32 gives 0; the same
    shift in LLVM IR would be poison)."""
    op = "shl" if left else "shr"
    return Uint32(ptx_b32(f"{op}.b32 $0, -1, $1;", "=r,r", [Int32(amount)], loc=loc, ip=ip))


@dataclass(frozen=True)
class FragmentMask:
    """Mask parameters of one (sequence, query tile); ``kind``/``bottom_right`` and the
    None-ness of each window side are static, the rest is dynamic."""

    kind: MaskKind
    seqlen_q: Any
    seqlen_k: Any
    window_left: Any = None
    window_right: Any = None
    bottom_right: bool = False
    #: rows per query position (a packed GQA group, ``kv_tile_schedule``): ``seqlen_q`` counts rows
    rows_per_query: int = 1

    def key_bounds(self, row):
        g = self.rows_per_query
        return row_key_bounds(
            row // g if g > 1 else row, self.seqlen_q // g if g > 1 else self.seqlen_q, self.seqlen_k, self.kind,
            self.window_left, self.window_right, self.bottom_right, imin=cutlass.min, imax=cutlass.max,
        )

    @cute.jit
    def apply(self, acc_s: cute.Tensor, coords: cute.Tensor, row_base, col_base):
        """Set masked scores of ``acc_s`` (a warpgroup-MMA accumulator) to -inf. ``coords`` is the
        identity tensor of the tile partitioned like ``acc_s``; ``row_base``/``col_base`` place the
        tile in the sequence."""
        s = as_rows_cols(acc_s)
        c = as_rows_cols(coords)
        num_cols = cute.size(s, mode=[1])
        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
            lo, hi = self.key_bounds(row_base + c[r, 0][0])
            first = col_base + c[r, 0][1]
            for k in cutlass.range_constexpr((num_cols + CHUNK - 1) // CHUNK):
                keep = kept_column_bits(
                    lo - first, hi - first, k, lambda n: _ones_shifted(n, False),
                    lambda n: _ones_shifted(n, True), cutlass.min, cutlass.max)
                for i in cutlass.range_constexpr(min(CHUNK, num_cols - CHUNK * k)):
                    kept = cutlass.Boolean(keep & (cutlass.Uint32(1) << i))
                    s[r, CHUNK * k + i] = s[r, CHUNK * k + i] if kept else Float32(-math.inf)
