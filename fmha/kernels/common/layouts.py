"""Views of the user's tensors in the order the kernels index them."""

import cutlass.cute as cute
from cutlass import const_expr
from cutlass.tensor_utils import LayoutEnum


def bshd_to_sdhb(t: cute.Tensor, varlen: bool, d_first: bool = False) -> cute.Tensor:
    """(B, S, H, D) or varlen (T, H, D) -> (S, D, H, B) (or (D, S, H, B) with ``d_first``);
    varlen gets a batch mode of extent 1: sequences are found through cu_seqlens instead."""
    lay = t.layout
    if const_expr(varlen):
        s, h, d = 0, 1, 2
        shape = (lay.shape[s], lay.shape[d], lay.shape[h], 1)
        stride = (lay.stride[s], lay.stride[d], lay.stride[h], 0)
        lay = cute.make_layout(shape, stride=stride)
    else:
        lay = cute.select(lay, mode=[1, 3, 2, 0])
    if const_expr(d_first):
        lay = cute.select(lay, mode=[1, 0, 2, 3])
    return cute.make_tensor(t.iterator, lay)


def rows_first(t: cute.Tensor) -> cute.Tensor:
    """A per-row statistic (B, H, S) -> (S, H, B) (packed sequences: B = 1)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 1, 0]))


def ring_layout(one_stage: cute.ComposedLayout, stages: int, stage_elems: int) -> cute.ComposedLayout:
    """A swizzled shared-memory tile layout (``one_stage``: (rows, cols, 1)) repeated ``stages``
    times ``stage_elems`` elements apart, so that tiles of different sizes (K's and V's) can take
    turns in the same ring of stages."""
    tile = cute.select(one_stage.outer, mode=[0, 1])
    outer = cute.append(tile, cute.make_layout(stages, stride=stage_elems))
    return cute.make_composed_layout(one_stage.inner, 0, outer)


def mma_operand_smem_layout(operand: str, layout: LayoutEnum, mma_tiler_mnk: tuple, dtype, stages: int,
                            atom_major_size: int):
    """``sm90_utils.make_smem_layout_a`` / ``_b`` (``operand`` "a" / "b") with the swizzle atom
    chosen for ``atom_major_size`` elements of the major mode instead of the whole tile's: a
    product that reads half of the major mode (a warpgroup's half of the head dim) needs that
    half to start on an atom boundary."""
    import cutlass.utils.hopper_helpers as sm90_utils

    if operand == "a":
        shape, is_k_major = cute.slice_(mma_tiler_mnk, (None, 0, None)), layout.is_k_major_a()
    else:
        shape, is_k_major = cute.slice_(mma_tiler_mnk, (0, None, None)), layout.is_k_major_b()
    atom = sm90_utils.make_smem_layout_atom(sm90_utils.get_smem_layout_atom(layout, dtype, atom_major_size), dtype)
    return cute.tile_to_shape(atom, cute.append(shape, stages), order=(0, 1, 2) if is_k_major else (1, 0, 2))
