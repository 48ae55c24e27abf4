"""Varlen: the list of work tiles of a packed batch, built on the GPU.

The host builds this list (``fmha.work_tiles``) when it has read the sequence lengths. When it has
not (max lengths given, so that a call never waits for the GPU), a one-CTA kernel launched before
the attention kernel builds the same kind of list from ``cu_seqlens``: every (sequence, tile)
that exists, costliest first, and the count of its entries, which the kernel reads instead of
the table's capacity (the kernels clamp it to the capacity). The forward lists query tiles with rows (cost: the K/V tiles they visit,
plus one), the backward K/V tiles with keys (cost: the query tiles they visit, plus one). The
sort is a counting sort on the cost in shared memory (entries of one cost land in any order: a
tile's result does not depend on when it runs). Costs above ``COST_BINS - 1`` share the top bin.

Mixed into a kernel class that has ``listed_tiles(seq)`` (how many tiles sequence ``seq`` has)
and ``listed_tile_cost(tile, seq, window_left, window_right)``.
"""

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.memory import SmemAllocator

from .seqinfo import SequenceInfo

#: threads of the listing CTA: one cost bin each
COST_BINS = 1024


def _bins_struct():
    @cute.struct
    class Bins:
        counts: cute.struct.MemRange[Int32, COST_BINS]  # tiles per bin, then each bin's next slot
        warp_sums: cute.struct.MemRange[Int32, COST_BINS // 32]

    return Bins


def cost_bins_bytes() -> int:
    """Shared memory of the listing CTA."""
    return _bins_struct().size_in_bytes()


class DeviceWorkTileList:

    @cute.kernel
    def list_work_tiles(self, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: Optional[cute.Tensor], total_q: Int32,
                        total_k: Int32, max_seqlen_q: Int32, max_seqlen_k, window_left, window_right,
                        mTileTable: cute.Tensor, mTileCount: cute.Tensor, mCacheSeqlens: Optional[cute.Tensor] = None):
        """One CTA of ``COST_BINS`` threads: ``mTileTable[:count]`` = (batch, tile) by cost,
        ``mTileCount[0]`` = count. ``max_seqlen_k``: None where the kernel does not clamp to it.
        ``mCacheSeqlens``: queries over a KV cache (``SequenceInfo.create``), ``total_k`` its
        capacity per sequence, no ``mCuSeqlensK``."""
        tidx = cute.arch.thread_idx()[0]
        storage = SmemAllocator().allocate(_bins_struct())
        counts = storage.counts.get_tensor(cute.make_layout(COST_BINS))
        warp_sums = storage.warp_sums.get_tensor(cute.make_layout(COST_BINS // 32))
        counts[tidx] = Int32(0)
        cute.arch.sync_threads()
        self.visit_tiles(mCuSeqlensQ, mCuSeqlensK, total_q, total_k, max_seqlen_q, max_seqlen_k, window_left,
                         window_right, counts, None, tidx, mCacheSeqlens)
        cute.arch.sync_threads()
        # bin r holds cost COST_BINS - 1 - r: an exclusive prefix sum over r puts costlier first
        mine = counts[tidx]
        start, total = exclusive_block_sum(mine, warp_sums, tidx)
        counts[tidx] = start
        if tidx == 0:
            mTileCount[0] = total
        cute.arch.sync_threads()
        self.visit_tiles(mCuSeqlensQ, mCuSeqlensK, total_q, total_k, max_seqlen_q, max_seqlen_k, window_left,
                         window_right, counts, mTileTable, tidx, mCacheSeqlens)

    @cute.jit
    def visit_tiles(self, mCuSeqlensQ, mCuSeqlensK, total_q, total_k, max_seqlen_q, max_seqlen_k, window_left,
                    window_right, counts: cute.Tensor, mTileTable, tidx, mCacheSeqlens=None):
        """Every tile, sequences dealt over the threads: count it in its cost bin, or
        (``mTileTable`` given) write it to its bin's next slot."""
        num_batches = mCuSeqlensQ.shape[0] - 1
        for batch in cutlass.range(tidx, num_batches, COST_BINS, unroll=1):
            # clamped as the attention kernel's descriptor pass clamps them
            seq = SequenceInfo.create(batch, total_q, total_k, mCuSeqlensQ, mCuSeqlensK, max_seqlen_q, max_seqlen_k,
                                      mCacheSeqlens)
            for tile in cutlass.range(self.listed_tiles(seq), unroll=1):
                cost = self.listed_tile_cost(tile, seq, window_left, window_right)
                slot = counts.iterator + (COST_BINS - 1 - cutlass.min(cost, COST_BINS - 1))
                if cutlass.const_expr(mTileTable is None):
                    cute.arch.atomic_add(slot, Int32(1))
                else:
                    at = cute.arch.atomic_add(slot, Int32(1))
                    if at < mTileTable.shape[0]:  # offsets the launch flags as bad may list more than fits
                        mTileTable[at, 0] = batch
                        mTileTable[at, 1] = tile


@cute.jit
def exclusive_block_sum(value: Int32, warp_sums: cute.Tensor, tidx):
    """(sum of ``value`` over the threads before this one, sum over all) across a CTA of
    ``COST_BINS`` threads; ``warp_sums``: shared scratch of one entry per warp."""
    lane = tidx % 32
    warp = tidx // 32
    inclusive = value
    for shift in cutlass.range_constexpr(5):
        up = cute.arch.shuffle_sync_up(inclusive, 1 << shift)
        if lane >= (1 << shift):
            inclusive = inclusive + up
    if lane == 31:
        warp_sums[warp] = inclusive
    cute.arch.sync_threads()
    if warp == 0:
        total = warp_sums[lane]
        for shift in cutlass.range_constexpr(5):
            up = cute.arch.shuffle_sync_up(total, 1 << shift)
            if lane >= (1 << shift):
                total = total + up
        warp_sums[lane] = total  # inclusive over warps
    cute.arch.sync_threads()
    before_warp = Int32(0)
    if warp > 0:
        before_warp = warp_sums[warp - 1]
    grand_total = warp_sums[COST_BINS // 32 - 1]
    return before_warp + inclusive - value, grand_total
