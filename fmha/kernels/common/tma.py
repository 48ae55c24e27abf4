"""TMA helpers shared by the kernels."""

import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync


def tma_tiles(atom: cute.CopyAtom, smem: cute.Tensor, gmem: cute.Tensor, tile_rank: int = 2):
    """(shared, global) views of ``smem`` (tile, stages...) and ``gmem`` (tile, tiles...) as the
    TMA ``atom`` copies them, for a CTA that is not part of a cluster; the tile is the first
    ``tile_rank`` modes."""
    return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(smem, 0, tile_rank),
                                 cute.group_modes(gmem, 0, tile_rank))
