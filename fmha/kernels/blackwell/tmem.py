"""Where S, P, O and the softmax's row statistics live in tensor memory (TMEM).

TMEM is 128 lanes x 512 columns of 32 bits; a 128-row MMA tile puts row r in lane r. Columns:

    S0: 0 .. 127        S1: 128 .. 255       (fp32 scores of Q tile 0 / 1, 128 keys)
    O0: 256 .. 256+D-1  O1: 256+D .. 256+2D-1 (fp32 output accumulators)

Inside each S tile, once the softmax has read the scores into registers: columns 0 and 1 hold the
row statistics handed to the correction warpgroup (old and new max per step; sum and max after
the last), and P (in the input dtype, packed 2 or 4 per column) is written from column 32, so
that writing P never overwrites the statistics.
"""

import cutlass.cute as cute


S_COLUMNS = 128
STATS_COLUMN = 0
P_COLUMN = 32


class TmemPlan:
    """Column offsets of this kernel's TMEM tensors and the views the roles take of them. The
    accumulator layouts are taken once (``bind``), before the MMA warp starts setting its tiled
    MMAs' accumulate flag: the other roles must not read state the MMA warp's branch wrote."""

    def __init__(self, head_dim: int, in_width: int):
        self.head_dim = head_dim
        self.in_width = in_width
        self.s_offsets = (0, S_COLUMNS)
        self.o_offsets = (2 * S_COLUMNS, 2 * S_COLUMNS + head_dim)
        #: fp32 columns one row of P takes (128 keys of 16 or 8 bits)
        self.p_columns = S_COLUMNS * in_width // 32

    def bind(self, thr_mma_qk, thr_mma_pv, qk_tiler, pv_tiler):
        """Record the S and O accumulator layouts."""
        self.s_layout = thr_mma_qk.make_fragment_C(thr_mma_qk.partition_shape_C(qk_tiler[:2])).layout
        self.o_layout = thr_mma_pv.make_fragment_C(thr_mma_pv.partition_shape_C(pv_tiler[:2])).layout

    def s_tiles(self, tmem_base):
        """(S0, S1) as the QK MMA's accumulators."""
        return tuple(cute.make_tensor(tmem_base + off, self.s_layout) for off in self.s_offsets)

    def o_tiles(self, tmem_base):
        """(O0, O1) as the PV MMA's accumulators."""
        return tuple(cute.make_tensor(tmem_base + off, self.o_layout) for off in self.o_offsets)

    def bind_p(self, thr_mma_pv, tmem_base, tP_layout):
        """Record the layout and type of P as the PV MMA's TMEM A operand (the MMA warp's)."""
        frag = thr_mma_pv.make_fragment_A(cute.make_tensor(tmem_base, tP_layout.outer))[None, None, None, 0]
        self.p_layout = frag.layout
        self.p_dtype = frag.element_type

    def p_operands(self, tmem_base):
        """(P0, P1) as the PV MMA's TMEM A operands (after ``bind_p``)."""
        return tuple(cute.make_tensor(cute.recast_ptr(tmem_base + off + P_COLUMN, dtype=self.p_dtype),
                                      self.p_layout) for off in self.s_offsets)

    @staticmethod
    def columns(tile: cute.Tensor, first: int, count: int) -> cute.Tensor:
        """``count`` fp32 columns of a 128-row accumulator ``tile`` from column ``first``, as a
        (128, count) view (for the 32x32b TMEM loads and stores of one row per thread)."""
        start = tile.iterator if first == 0 else tile.iterator + first  # coordinate tensors start at 0
        return cute.make_tensor(start, cute.composition(tile.layout, cute.make_layout((128, count))))




