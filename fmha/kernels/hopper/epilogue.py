"""Writing a consumer warpgroup's part of the output tile: O (its 64 query rows) and the LSE.

Two ways to write O:

* ``store_o_direct``: every thread stores its accumulator pairs straight to global memory,
  predicated on the sequence length. Each store instruction covers half of every 32-byte sector
  it touches (a quad of threads holds 8 adjacent columns of a row), so L2 sees twice the write
  requests the data needs. Used for fp8 outputs, fp8 varlen at D=256 (no buffer for O), and
  where the host measured it faster (``config.o_store_for``).
* ``store_o_tma``: the warpgroup writes its rows into shared memory with ``stmatrix``, then its
  first warp hands them to a TMA store, which writes whole lines and clips at the tensor's end
  (varlen: at the sequence's end, through the sequence's own descriptor).
  The buffer is O's own where shared memory has room beside the K/V ring (``OStore.TMA_OWN_BUFFER``),
  else the tile's own Q buffer, which no MMA reads any more once the mainloop is over: each
  warpgroup only ever read its own 64 rows of Q, so it can overwrite them without waiting for the
  other warpgroups.
"""

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from ..common.fragments import as_rows_cols
from ..common.tma import tma_tiles
from .wgmma import WARPGROUP_THREADS


def _is_storing_warp():
    """The first warp of each consumer warpgroup (warpgroups start at multiples of 4 warps): it
    issues the warpgroup's TMA stores and waits for them."""
    return cute.arch.make_warp_uniform(cute.arch.warp_idx()) % 4 == 0


def wg_slice_layout(stage_layout, tile_m: int, head_dim: int):
    """The (64, D) rows of one warpgroup within a (tile_m, D) shared-memory tile layout: the
    same swizzled layout, restricted to 64 rows (the slice of warpgroup ``w`` starts
    ``w * 64`` rows in, at a whole number of swizzle periods)."""
    return cute.composition(stage_layout, cute.make_layout((64, head_dim), stride=(1, tile_m)))


@cute.jit
def store_lse(lse_rows: cute.Tensor, tOcO: cute.Tensor, mLSE: Optional[cute.Tensor], varlen: cutlass.Constexpr,
              m_block: Int32, tile_m: cutlass.Constexpr, head: Int32, batch: Int32, offset_q: Int32,
              seqlen_q: Int32):
    """The LSE of this thread's rows, from the thread that holds each row's column 0."""
    if const_expr(mLSE is not None):
        c_rc = as_rows_cols(tOcO)
        row_base = m_block * tile_m
        for r in cutlass.range_constexpr(cute.size(c_rc, mode=[0])):
            row = row_base + c_rc[r, 0][0]
            if row < seqlen_q and c_rc[r, 0][1] == 0:
                if const_expr(varlen):
                    mLSE[head, offset_q + row] = lse_rows[r]
                else:
                    mLSE[batch, head, row] = lse_rows[r]


@cute.jit
def store_o_direct(o_out: cute.Tensor, tOcO: cute.Tensor, mO: cute.Tensor, varlen: cutlass.Constexpr,
                   m_block: Int32, tile_m: cutlass.Constexpr, head: Int32, batch: Int32, offset_q: Int32,
                   seqlen_q: Int32):
    """This thread's rows of O, predicated on the sequence length (a ragged tile never touches a
    neighbouring sequence)."""
    if const_expr(varlen):
        mO_seq = cute.domain_offset((offset_q, 0), mO[None, head, None])
    else:
        mO_seq = mO[batch, None, head, None]
    row_base = m_block * tile_m
    o_rc = as_rows_cols(o_out)
    c_rc = as_rows_cols(tOcO)
    for r in cutlass.range_constexpr(cute.size(o_rc, mode=[0])):
        row = row_base + c_rc[r, 0][0]
        if row < seqlen_q:
            for j in cutlass.range_constexpr(cute.size(o_rc, mode=[1])):
                mO_seq[row, c_rc[r, j][1]] = o_rc[r, j]


@cute.jit
def store_o_tma(o_out: cute.Tensor, tiled_mma_pv: cute.TiledMma, num_wgs: cutlass.Constexpr, tidx: Int32,
                wg: Int32, barrier_id: Int32, sO: cute.Tensor, tma_o: cute.CopyAtom, mO_tma: cute.Tensor, m_block: Int32,
                head: Int32, batch: Int32, release_q, tma_desc_ptr=None, fresh_buffer: cutlass.Constexpr = False):
    """Stage this warpgroup's O rows in ``sO`` and TMA-store them. ``sO`` is the tile's Q
    buffer, or a buffer of O's own when ``release_q`` is None. Q buffer: ``release_q`` runs on the
    storing thread once the TMA has read it, which frees it for the producer's next Q load. Own
    buffer: the store runs on while the next tile computes; the storing thread waits for its read
    only before the next tile's O overwrites it. ``barrier_id``: the warpgroup's own named barrier.
    ``tma_desc_ptr``: a descriptor of the rows' own (a packed sequence's) instead of the atom's,
    fenced by the storing warp before its use.
    ``fresh_buffer``: no store of this warpgroup reads ``sO`` (its first use as a staging buffer),
    so the staging starts without waiting for one; the stores still in flight are left running.

    The store is issued by the warpgroup's first warp as a whole (the TMA copy elects its own
    thread), under a warp-uniform condition: a branch on the thread index here made ptxas keep
    the K/V stage index of the mainloop in ordinary registers (two ``R2UR`` per K/V tile at
    D=64)."""
    storing_warp = _is_storing_warp()
    if const_expr(release_q is None and not fresh_buffer):
        if storing_warp:
            cute.arch.cp_async_bulk_wait_group(0, read=True)  # the previous tile's store
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=WARPGROUP_THREADS)
    # stmatrix writes 8x8 blocks of 16-bit values from the accumulator's own register order.
    st_atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4),
                                  o_out.element_type)
    thr_st = cute.make_tiled_copy_C(st_atom, tiled_mma_pv).get_slice(tidx)
    cute.copy(st_atom, thr_st.retile(o_out), thr_st.partition_D(sO))
    # Generic-proxy writes must be visible to the TMA (async proxy) before it reads them.
    cute.arch.fence_view_async_shared()
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=WARPGROUP_THREADS)
    if storing_warp:
        if const_expr(tma_desc_ptr is not None):
            cpasync.fence_tma_desc_acquire(tma_desc_ptr)
        wg_tile = (64, cute.size(sO, mode=[1]))
        sO_wg = cute.local_tile(sO, wg_tile, (wg, 0))
        gO = cute.local_tile(mO_tma[None, None, head, batch], wg_tile, (m_block * num_wgs + wg, 0))
        tOsO, tOgO = tma_tiles(tma_o, sO_wg, gO)
        cute.copy(tma_o, tOsO, tOgO, tma_desc_ptr=tma_desc_ptr)
        cute.arch.cp_async_bulk_commit_group()
        if const_expr(release_q is not None):
            cute.arch.cp_async_bulk_wait_group(0, read=True)  # a no-op on the lanes that did not store
            cute.arch.sync_warp()
            with cute.arch.elect_one():
                release_q()


@cute.jit
def drain_o_stores():
    """Before the CTA exits: its last TMA store must have read shared memory."""
    if _is_storing_warp():
        cute.arch.cp_async_bulk_wait_group(0, read=True)
