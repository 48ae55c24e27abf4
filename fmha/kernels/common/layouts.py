"""Views of the user's tensors in the order the kernels index them."""

import cutlass.cute as cute
from cutlass import const_expr


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
