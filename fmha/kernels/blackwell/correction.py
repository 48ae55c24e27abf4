"""The correction warpgroup and the epilogue warp of the Blackwell forward (``fwd.py``).

Correction: O_i in TMEM accumulates P V over the K/V tiles while the row max may still grow.
Before the MMA warp adds the next P V to O_i, O_i must be multiplied by exp2((old max - new max)
* scale_log2) of the step that produced that P; the MMA warp waits for this warpgroup's release of
O_i (the ``o`` pipeline). Rows whose max did not move have factor 1; a warp skips the TMEM round
trip when none of its 32 rows moved. After a tile's last step the warpgroup reads each row's
(sum, max), writes the LSE, and normalizes O: into shared memory for the epilogue warp's TMA
store, or (varlen, where a TMA box would run into the next sequence) straight to global memory,
predicated on the sequence's length.
"""

import math

import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.tensor_utils import LayoutEnum

from ..common.softmax import row_lse_and_inverse
from .tmem import STATS_COLUMN, TmemPlan

WARPGROUP = 128
#: O columns per TMEM round trip of the rescale
RESCALE_COLUMNS = 16


class CorrectionRole:
    """Mixed into ``BlackwellAttentionForward``."""

    @cute.jit
    def correction(self, scheduler, tScS, tOcO, tOsO, tmem_base, mQ_tma, mK_tma, mO, mLSE, mSinks, mCuSeqlensQ,
                   mCuSeqlensK, scale_log2: Float32, output_scale: Float32, window_left, window_right, pipes):
        """``tScS``/``tOcO``: coordinates of S/O as the MMAs partition them; ``tOsO``: the two O
        staging tiles, likewise (None for varlen); ``mSinks``: the (H_q,) fp32 sink logits, or None."""
        cfg = self.cfg
        tidx = cute.arch.thread_idx()[0] % WARPGROUP
        tOtO = self.tmem.o_tiles(tmem_base)
        tStS = self.tmem.s_tiles(tmem_base)
        tStats0 = TmemPlan.columns(tStS[0], STATS_COLUMN, 2)
        load_stats = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(2)), Float32), tStats0)
        thr_load_stats = load_stats.get_slice(tidx)
        stats_src = tuple(thr_load_stats.partition_S(TmemPlan.columns(t, STATS_COLUMN, 2)) for t in tStS)
        tLcStats = thr_load_stats.partition_D(TmemPlan.columns(tScS, 0, 2))
        my_row = tLcStats[0][0]  # this thread's row (TMEM lane) in a Q tile
        views = (load_stats, stats_src, tLcStats, tOtO, tOcO, tOsO, my_row, tidx)

        stats0_consumer, stats1_consumer = pipes.stats0.consumer, pipes.stats1.consumer
        o_consumer = pipes.o.consumer
        staged_producer = pipes.staged.producer

        tile_idx = scheduler.first()
        while tile_idx < scheduler.num_tiles:
            tile = scheduler.decode(tile_idx)
            seq = self.sequence(tile, mQ_tma, mK_tma, mCuSeqlensQ, mCuSeqlensK)
            if tile.m_block * cfg.cta_rows < seq.seqlen_q:
                walk = self.kv_walk(tile.m_block, seq, window_left, window_right)
                # the first step's statistics need no rescale: nothing is in O yet
                handle = stats0_consumer.wait_and_advance()
                handle.release()
                handle = stats1_consumer.wait_and_advance()
                handle.release()
                for _ in cutlass.range(1, walk.total, unroll=1):
                    stats0_consumer, o_consumer = self.correct_step(0, stats0_consumer, o_consumer, scale_log2,
                                                                    views)
                    stats1_consumer, o_consumer = self.correct_step(1, stats1_consumer, o_consumer, scale_log2,
                                                                    views)
                sink_log2 = None
                if const_expr(cfg.has_sinks):  # the tile's query head's, in log2 units
                    sink_log2 = mSinks[tile.head] * Float32(math.log2(math.e))
                stats0_consumer, o_consumer, staged_producer = self.finish_q_tile(
                    0, stats0_consumer, o_consumer, staged_producer, scale_log2, output_scale, sink_log2, mO, mLSE,
                    tile, seq, views)
                stats1_consumer, o_consumer, staged_producer = self.finish_q_tile(
                    1, stats1_consumer, o_consumer, staged_producer, scale_log2, output_scale, sink_log2, mO, mLSE,
                    tile, seq, views)
            tile_idx, _ = scheduler.consumer_next(tile_idx, None)

    @cute.jit
    def correct_step(self, t: cutlass.Constexpr, stats_consumer: pipeline.PipelineConsumer,
                     o_consumer: pipeline.PipelineConsumer, scale_log2: Float32, views):
        """Q tile ``t``, one K/V step after the first: rescale O_t by the step's max change once
        the previous step's P V is in it."""
        load_stats, stats_src, tLcStats, tOtO, tOcO, tOsO, my_row, tidx = views
        handle = stats_consumer.wait_and_advance()
        stats = self.read_stats(load_stats, stats_src[t], tLcStats)
        handle.release()
        factor = cute.math.exp2((stats[0] - stats[1]) * scale_log2, fastmath=True)
        o_handle = o_consumer.wait_and_advance()
        self.rescale(tOtO[t], factor, tidx)
        cute.arch.fence_view_async_tmem_store()
        o_handle.release()
        return stats_consumer, o_consumer

    @cute.jit
    def finish_q_tile(self, t: cutlass.Constexpr, stats_consumer: pipeline.PipelineConsumer,
                      o_consumer: pipeline.PipelineConsumer, staged_producer: pipeline.PipelineProducer,
                      scale_log2: Float32, output_scale: Float32, sink_log2, mO, mLSE, tile, seq, views):
        """Q tile ``t`` after its last step: LSE, then O normalized into the staging buffer (or to
        global memory)."""
        cfg = self.cfg
        load_stats, stats_src, tLcStats, tOtO, tOcO, tOsO, my_row, tidx = views
        handle = stats_consumer.wait_and_advance()
        stats = self.read_stats(load_stats, stats_src[t], tLcStats)
        handle.release()
        lse, inv = row_lse_and_inverse(stats[1], stats[0], scale_log2, output_scale, sink_log2)
        row = tile.m_block * cfg.cta_rows + t * cfg.tile_m + my_row
        self.store_lse(mLSE, lse, row, tile, seq)
        o_handle = o_consumer.wait_and_advance()  # the last P V is in O_t
        if const_expr(cfg.o_via_tma):
            staged = staged_producer.acquire_and_advance()
            self.stage_o(tOtO[t], tOcO, tOsO[t], inv, tidx)
            # the TMA store (async proxy) must see the shared-memory writes
            cute.arch.fence_view_async_shared()
            staged.commit()
        else:
            self.store_o_rows(tOtO[t], inv, mO, row, tile, seq, tidx)
        cute.arch.fence_view_async_tmem_load()
        o_handle.release()
        return stats_consumer, o_consumer, staged_producer

    @cute.jit
    def read_stats(self, load_stats, src, coords):
        """This row's two statistics columns, in registers."""
        r = cute.make_rmem_tensor(coords.shape, Float32)
        cute.copy(load_stats, src, r)
        cute.arch.fence_view_async_tmem_load()
        return r

    @cute.jit
    def rescale(self, tOtO: cute.Tensor, factor: Float32, tidx):
        """O *= factor for this thread's row, RESCALE_COLUMNS columns per TMEM round trip; a warp
        none of whose rows moved leaves its lanes alone."""
        if cute.arch.vote_any_sync(factor != Float32(1.0)):
            d = self.cfg.head_dim
            chunk = TmemPlan.columns(tOtO, 0, RESCALE_COLUMNS)
            load = tcgen05.make_tmem_copy(cute.make_copy_atom(
                tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(RESCALE_COLUMNS)), Float32), chunk).get_slice(tidx)
            store = tcgen05.make_tmem_copy(cute.make_copy_atom(
                tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(RESCALE_COLUMNS)), Float32), chunk).get_slice(tidx)
            coords = load.partition_D(TmemPlan.columns(cute.make_identity_tensor((128, d)), 0, RESCALE_COLUMNS))
            for c in cutlass.range_constexpr(d // RESCALE_COLUMNS):
                part = TmemPlan.columns(tOtO, c * RESCALE_COLUMNS, RESCALE_COLUMNS)
                r = cute.make_rmem_tensor(coords.shape, Float32)
                cute.copy(load, load.partition_S(part), r)
                for j in cutlass.range_constexpr(0, cute.size(r), 2):
                    r[j], r[j + 1] = cute.arch.mul_packed_f32x2((r[j], r[j + 1]), (factor, factor))
                cute.copy(store, r, store.partition_D(part))

    @cute.jit
    def store_lse(self, mLSE, lse: Float32, row, tile, seq):
        if const_expr(mLSE is not None):
            if row < seq.seqlen_q:
                if const_expr(self.cfg.varlen):
                    mLSE[tile.head, seq.offset_q + row] = lse
                else:
                    mLSE[tile.batch, tile.head, row] = lse

    @cute.jit
    def stage_o(self, tOtO: cute.Tensor, tOcO: cute.Tensor, tOsO: cute.Tensor, inv: Float32, tidx):
        """O * inv in the output dtype into a staging tile (``tOsO``: 128 x D as the P.V MMA
        partitions it), RESCALE_COLUMNS columns at a time (more fp32 columns in flight do not fit
        the warpgroup's registers)."""
        d = self.cfg.head_dim
        cols = RESCALE_COLUMNS
        tOtO_blocks = cute.logical_divide(tOtO, cute.make_layout((128, cols)))
        tOsO_blocks = cute.logical_divide(tOsO, cute.make_layout((128, cols)))
        tOcO_blocks = cute.logical_divide(tOcO, cute.make_layout((128, cols)))
        load_op = sm100_utils.get_tmem_load_op(self.pv_tiler, LayoutEnum.ROW_MAJOR, self.out_dtype, Float32,
                                               (self.cfg.tile_m, cols), use_2cta_instrs=False)
        tiled_load = tcgen05.make_tmem_copy(load_op, tOtO_blocks[(None, None), 0])
        thr_load = tiled_load.get_slice(tidx)
        smem_store = cute.make_tiled_copy_D(
            sm100_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.out_dtype, Float32, tiled_load), tiled_load)
        src = thr_load.partition_S(tOtO_blocks[(None, None), None])
        dst = thr_load.partition_D(tOsO_blocks[(None, None), None])
        crd = thr_load.partition_D(tOcO_blocks[(None, None), None])
        for b in cutlass.range_constexpr(d // cols):
            r = cute.make_rmem_tensor(crd[None, 0, 0, b].shape, Float32)
            cute.copy(tiled_load, src[None, 0, 0, b], r)
            for j in cutlass.range_constexpr(0, cute.size(r), 2):
                r[j], r[j + 1] = cute.arch.mul_packed_f32x2((r[j], r[j + 1]), (inv, inv))
            out = cute.make_rmem_tensor(r.shape, self.out_dtype)
            out.store(r.load().to(self.out_dtype))
            cute.copy(smem_store, out, dst[None, 0, 0, b])

    @cute.jit
    def store_o_rows(self, tOtO: cute.Tensor, inv: Float32, mO: cute.Tensor, row, tile, seq, tidx):
        """Varlen: this thread's row of O * inv straight to global memory, if the row is in its
        sequence (mO: (T, H, D))."""
        d = self.cfg.head_dim
        cols = RESCALE_COLUMNS
        chunk = TmemPlan.columns(tOtO, 0, cols)
        load = tcgen05.make_tmem_copy(cute.make_copy_atom(
            tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(cols)), Float32), chunk).get_slice(tidx)
        coords = load.partition_D(TmemPlan.columns(cute.make_identity_tensor((128, d)), 0, cols))
        g_row = mO[seq.offset_q + row, tile.head, None]
        if row < seq.seqlen_q:
            for c in cutlass.range_constexpr(d // cols):
                r = cute.make_rmem_tensor(coords.shape, Float32)
                cute.copy(load, load.partition_S(TmemPlan.columns(tOtO, c * cols, cols)), r)
                out = cute.make_rmem_tensor(cols, self.out_dtype)
                for j in cutlass.range_constexpr(cols):
                    out[j] = (r[j] * inv).to(self.out_dtype)
                g = cute.make_tensor(g_row.iterator + c * cols, cute.make_layout(cols))
                cute.autovec_copy(out, g)

    # ------------------------------------------------------------------ epilogue warp
    @cute.jit
    def store_o(self, scheduler, mQ_tma, mK_tma, tma_o, mO_tma, sO, staged_consumer: pipeline.PipelineConsumer):
        """TMA-store each staged O tile; its buffer is free again once the store has read it."""
        cfg = self.cfg
        tile_idx = scheduler.first()
        while tile_idx < scheduler.num_tiles:
            tile = scheduler.decode(tile_idx)
            seq = self.sequence(tile, mQ_tma, mK_tma, None, None)
            if tile.m_block * cfg.cta_rows < seq.seqlen_q:
                gO = cute.flat_divide(mO_tma[None, None, tile.head, tile.batch], self.epi_tile)
                tOsO, tOgO = cpasync.tma_partition(tma_o, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2),
                                                   cute.group_modes(gO, 0, 2))
                o0 = staged_consumer.wait_and_advance()
                cute.copy(tma_o, tOsO[None, 0], tOgO[None, 2 * tile.m_block, 0])
                cute.arch.cp_async_bulk_commit_group()
                o1 = staged_consumer.wait_and_advance()
                cute.copy(tma_o, tOsO[None, 1], tOgO[None, 2 * tile.m_block + 1, 0])
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(1, read=True)
                o0.release()
                cute.arch.cp_async_bulk_wait_group(0, read=True)
                o1.release()
            tile_idx, _ = scheduler.consumer_next(tile_idx, None)
