"""TMA helpers shared by the kernels."""

import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import dsl_user_op


def tma_tiles(atom: cute.CopyAtom, smem: cute.Tensor, gmem: cute.Tensor, tile_rank: int = 2):
    """(shared, global) views of ``smem`` (tile, stages...) and ``gmem`` (tile, tiles...) as the
    TMA ``atom`` copies them, for a CTA that is not part of a cluster; the tile is the first
    ``tile_rank`` modes."""
    return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(smem, 0, tile_rank),
                                 cute.group_modes(gmem, 0, tile_rank))


@dsl_user_op
def bulk_reduce_add_f32(gmem: cute.Pointer, smem: cute.Pointer, num_bytes: int, *, loc=None, ip=None):
    """Add ``num_bytes`` (a multiple of 16) of fp32 from shared memory ``smem`` into global
    memory at ``gmem``: one bulk reduce of contiguous bytes, no tensor map (completes with the
    bulk group: ``cp_async_bulk_commit_group`` / ``cp_async_bulk_wait_group``)."""
    llvm.inline_asm(
        None,
        [gmem.llvm_ptr, smem.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip), Int32(num_bytes).ir_value(loc=loc, ip=ip)],
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;",
        "l,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )

