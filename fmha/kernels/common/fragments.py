"""Views of warpgroup-MMA register fragments.

A Hopper ``wgmma`` accumulator fragment has the per-thread shape ``((2, 2, V), M, N)``: two
adjacent columns, two rows eight apart, and ``V`` column groups eight apart, repeated over the
MMA tiles in M and N. The softmax wants it as a (rows, columns) matrix, and the P.V product wants
the same registers as its A operand. Both are only re-indexings of the same registers, so they
cost nothing at run time.
"""

import cutlass.cute as cute


def _rows_cols_layout(acc_layout: cute.Layout) -> cute.Layout:
    # Work on the compact layout of the same shape: fragment registers are numbered
    # column-major over ((2, 2, V), M, N); regroup that numbering, then compose.
    compact = cute.make_layout(acc_layout.shape)
    shp, std = compact.shape, compact.stride
    regrouped = cute.make_layout(
        ((shp[0][1], shp[1]), (shp[0][0], shp[0][2], shp[2])),
        stride=((std[0][1], std[1]), (std[0][0], std[0][2], std[2])),
    )
    return cute.composition(acc_layout, regrouped)


def as_rows_cols(frag: cute.Tensor) -> cute.Tensor:
    """``((2, 2, V), M, N)`` -> ``((2, M), (2, V, N))``: index [row, col] of this thread's part."""
    return cute.make_tensor(frag.iterator, _rows_cols_layout(frag.layout))


def _operand_a_layout(acc_layout: cute.Layout) -> cute.Layout:
    # A 16-bit A-operand k-block of 16 columns is two 8-column groups of the accumulator; split V
    # into (2, V / 2) and move the V / 2 factor next to the MMA's K repetition.
    split = cute.logical_divide(acc_layout, ((None, None, 2), None, None))
    shp, std = split.shape, split.stride
    return cute.make_layout(
        ((shp[0][0], shp[0][1], shp[0][2][0]), shp[1], (shp[0][2][1], shp[2])),
        stride=((std[0][0], std[0][1], std[0][2][0]), std[1], (std[0][2][1], std[2])),
    )


def as_operand_a(frag: cute.Tensor) -> cute.Tensor:
    """View an accumulator-shaped fragment (already converted to 16-bit) as the register A
    operand ``((2, 2, 2), M, K_blocks)`` of the next warpgroup MMA."""
    return cute.make_tensor(frag.iterator, _operand_a_layout(frag.layout))
