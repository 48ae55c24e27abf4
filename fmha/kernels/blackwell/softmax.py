"""The softmax warpgroups of the Blackwell forward (``fwd.py``): one per Q tile, a row per thread.

Per K/V step a thread loads its row of S (128 fp32 scores) from TMEM, masks it where the walk
says (``fmha.kernels.common.mask.FragmentMask.apply_row_scores``, the rows' bands of
``fmha.masking``), takes the new running max, hands (old max, new max) to the correction
warpgroup through TMEM, and writes P = exp2(S * scale_log2 - max * scale_log2) in the input dtype
over S's columns for the P.V MMA. The running sum stays in a register; after the last step
(sum, max) go to the correction warpgroup for the normalization and the LSE.

A row that has seen only masked scores has max -inf; it is treated as max 0 so that every exp2
gives exactly 0 and no -inf - -inf = NaN appears (``common.softmax.finite_row_max``), and its sum
stays 0, which the correction turns into O = 0 and LSE = -inf.
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr, pipeline
from cutlass.cute.nvgpu import tcgen05

from ..common.mask import FragmentMask, ScoreMods
from ..common.softmax import finite_row_max
from .tmem import P_COLUMN, STATS_COLUMN, TmemPlan

WARPGROUP = 128
#: keys per TMEM store of P (with 32, ptxas kept more exponentials in flight and spilled the
#: left-window kernels' loop state at 184 registers)
KEYS_PER_STORE = 16


class SoftmaxRole:
    """Mixed into ``BlackwellAttentionForward``."""

    @cute.jit
    def softmax(self, which: cutlass.Constexpr, scheduler, tScS, tmem_base, mQ_tma, mK_tma, mCuSeqlensQ,
                mCuSeqlensK, mModTensors, scale_log2: Float32, softcap_factor, window_left, window_right,
                s_consumer: pipeline.PipelineConsumer, stats_producer: pipeline.PipelineProducer, turn):
        """Softmax warpgroup ``which`` (0 or 1) over every tile of the CTA's walk."""
        cfg = self.cfg
        tidx = cute.arch.thread_idx()[0] % WARPGROUP
        tStS = self.tmem.s_tiles(tmem_base)[which]

        # a row of S per thread (lane), 32 columns per load instruction
        load_s = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)), Float32), tStS
        ).get_slice(tidx)
        tLtS = load_s.partition_S(tStS)
        tLcS = load_s.partition_D(tScS)

        tStats = TmemPlan.columns(tStS, STATS_COLUMN, 2)
        cStats = TmemPlan.columns(tScS, 0, 2)
        store_stats = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(2)), Float32), tStats)
        thr_store_stats = store_stats.get_slice(tidx)
        tStats_dst = thr_store_stats.partition_D(tStats)
        stats_shape = thr_store_stats.partition_S(cStats).shape

        # P goes back in chunks of KEYS_PER_STORE keys, so that a chunk's scores die as its P is stored
        words = KEYS_PER_STORE * self.dtype.width // 32
        store_p = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(words)), Float32),
            TmemPlan.columns(tStS, P_COLUMN, words))
        thr_store_p = store_p.get_slice(tidx)
        tStP_dst = tuple(thr_store_p.partition_D(TmemPlan.columns(tStS, P_COLUMN + c * words, words))
                         for c in range(cfg.tile_n // KEYS_PER_STORE))
        p_shape = thr_store_p.partition_S(TmemPlan.columns(tScS, 0, words)).shape

        views = (load_s, tLtS, tLcS, store_stats, tStats_dst, stats_shape, store_p, tStP_dst, p_shape)
        turn_producer, turn_consumer = turn.producer, turn.consumer

        tile_idx = scheduler.first()
        while tile_idx < scheduler.num_tiles:
            tile = scheduler.decode(tile_idx)
            seq = self.sequence(tile, mQ_tma, mK_tma, mCuSeqlensQ, mCuSeqlensK)
            if tile.m_block * cfg.cta_rows < seq.seqlen_q:
                walk = self.kv_walk(tile.m_block, seq, window_left, window_right)
                mods = ScoreMods.of(cfg.mods, mModTensors, tile.batch, tile.head, scale_log2)
                mask = FragmentMask.of(cfg, seq.seqlen_q, seq.seqlen_k, window_left, window_right, softcap_factor,
                                       mods)
                row_base = tile.m_block * cfg.cta_rows + which * cfg.tile_m
                row_max = Float32(-math.inf)
                row_sum = Float32(0.0)
                stats = stats_producer.acquire_and_advance()
                for step in cutlass.range(walk.total, unroll=1):
                    col_base = walk.block(step) * cfg.tile_n
                    row_max, row_sum, stats, s_consumer, stats_producer, turn_producer, turn_consumer = \
                        self.softmax_step(
                            which, walk.needs_mask(step), mask, row_base, col_base, scale_log2, row_max,
                            row_sum, stats, s_consumer, stats_producer, turn_producer, turn_consumer, views)
                # the MMA warp's last commit of this tile: every GEMM reading P is done, S's
                # columns may take the final statistics
                s_handle = s_consumer.wait_and_advance()
                r_stats = cute.make_rmem_tensor(stats_shape, Float32)
                r_stats[0] = row_sum
                r_stats[1] = row_max
                cute.copy(store_stats, r_stats, tStats_dst)
                cute.arch.fence_view_async_tmem_store()
                stats.commit()
                # S's columns go back to the MMA warp only once the correction has read them
                stats_producer.acquire()
                s_handle.release()
            tile_idx, _ = scheduler.consumer_next(tile_idx, None)

    @cute.jit
    def softmax_step(self, which: cutlass.Constexpr, masked, mask: FragmentMask, row_base, col_base,
                     scale_log2: Float32, row_max: Float32, row_sum: Float32, stats,
                     s_consumer: pipeline.PipelineConsumer, stats_producer: pipeline.PipelineProducer,
                     turn_producer: pipeline.PipelineProducer, turn_consumer: pipeline.PipelineConsumer, views):
        """One K/V tile: S -> P in TMEM, the row's running max and sum updated. Returns the state
        the caller's loop carries."""
        load_s, tLtS, tLcS, store_stats, tStats_dst, stats_shape, store_p, tStP_dst, p_shape = views
        s_handle = s_consumer.wait_and_advance()
        s = cute.make_rmem_tensor(tLcS.shape, Float32)
        cute.copy(load_s, tLtS, s)
        mask.apply_row_scores(s, tLcS, row_base + tLcS[0][0], col_base, masked)

        old_max = row_max
        row_max = s.load().reduce(cute.ReductionOp.MAX, row_max, 0)
        safe_max = finite_row_max(row_max)
        r_stats = cute.make_rmem_tensor(stats_shape, Float32)
        r_stats[0] = old_max
        r_stats[1] = safe_max
        cute.copy(store_stats, r_stats, tStats_dst)
        cute.arch.fence_view_async_tmem_store()
        stats.commit()  # the correction warpgroup may rescale O by exp2((old - new) * scale_log2)

        # the two warpgroups take turns at the exponentials
        if const_expr(which == 0):
            turn = turn_producer.acquire_and_advance()
        else:
            turn = turn_consumer.wait_and_advance()
        neg_max_scaled = -safe_max * scale_log2
        chunks = cute.logical_divide(s, cute.make_layout(KEYS_PER_STORE))
        sums = [Float32(0.0), Float32(0.0)]
        for c in cutlass.range_constexpr(cute.size(chunks, mode=[1])):
            chunk = chunks[None, c]
            for i in cutlass.range_constexpr(0, KEYS_PER_STORE, 2):
                chunk[i], chunk[i + 1] = cute.arch.fma_packed_f32x2(
                    (chunk[i], chunk[i + 1]), (scale_log2, scale_log2), (neg_max_scaled, neg_max_scaled))
                chunk[i] = cute.math.exp2(chunk[i], fastmath=True)
                chunk[i + 1] = cute.math.exp2(chunk[i + 1], fastmath=True)
                sums[0], sums[1] = cute.arch.add_packed_f32x2((sums[0], sums[1]), (chunk[i], chunk[i + 1]))
            p_words = cute.make_rmem_tensor(p_shape, Float32)
            p = cute.make_tensor(cute.recast_ptr(p_words.iterator, dtype=self.dtype), cute.make_layout(KEYS_PER_STORE))
            p.store(chunk.load().to(self.dtype))
            cute.copy(store_p, p_words, tStP_dst[c])
            if const_expr(c == cute.size(chunks, mode=[1]) - 1):
                # the other warpgroup's turn once the exponentials are done
                if const_expr(which == 0):
                    turn.commit()
                else:
                    turn.release()
        cute.arch.fence_view_async_tmem_store()
        s_handle.release()  # P is in TMEM: the MMA warp may issue P.V

        stats = stats_producer.acquire_and_advance()
        correction = cute.math.exp2((old_max - safe_max) * scale_log2, fastmath=True)
        row_sum = row_sum * correction + (sums[0] + sums[1])
        return row_max, row_sum, stats, s_consumer, stats_producer, turn_producer, turn_consumer
