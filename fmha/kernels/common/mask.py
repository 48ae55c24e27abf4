"""Element-wise masking of a score fragment, from the same row bands the host uses
(``fmha.masking.row_key_bounds``). Only tiles the tile schedule marks as masked call this."""

import math
from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from fmha.masking import MaskKind, row_key_bounds

from .fragments import as_rows_cols


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

    def key_bounds(self, row):
        return row_key_bounds(
            row, self.seqlen_q, self.seqlen_k, self.kind, self.window_left, self.window_right,
            self.bottom_right, imin=cutlass.min, imax=cutlass.max,
        )

    @cute.jit
    def apply(self, acc_s: cute.Tensor, coords: cute.Tensor, row_base, col_base):
        """Set masked scores of ``acc_s`` to -inf. ``coords`` is the identity tensor of the tile
        partitioned like ``acc_s``; ``row_base``/``col_base`` place the tile in the sequence."""
        s = as_rows_cols(acc_s)
        c = as_rows_cols(coords)
        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
            lo, hi = self.key_bounds(row_base + c[r, 0][0])
            for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
                col = col_base + c[r, j][1]
                if col < lo or col >= hi:
                    s[r, j] = Float32(-math.inf)
