"""The producer warp of the Hopper forward kernel (``fwd.HopperAttentionForward`` inherits it):
per work tile the TMA loads of Q and of the K/V tiles its mask keeps, into the ring in the order
the consumers' loop (``mainloop.py``) waits for them; from a paged cache each tile in runs that
stay within a page, looked up through the block table."""

from typing import Callable

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr, pipeline

from ..common import sequence_descriptors as seq_desc
from ..common.kv_cache import KvCache
from ..common.seqinfo import SequenceInfo
from ..common.tma import tma_tiles


@cute.jit
def in_kv_order(total, state, load_k: Callable, load_v: Callable):
    """K_0, then (K_n, V_n-1) pairs, then the last V: the order in which ``mainloop`` waits for
    the K/V ring's stages, for whoever fills it (the producer's loads, a converted cache's
    converting warps). ``load_k(i, state)`` and ``load_v(i, state, last)`` fill step i's tile
    and return ``state`` advanced (the pipeline states they carry through the loop)."""
    if total > 0:
        state = load_k(0, state)
        for i in cutlass.range(1, total, unroll=1):
            state = load_k(i, state)
            state = load_v(i - 1, state, False)
        state = load_v(total - 1, state, True)
    return state


class ProducerWarp:
    """Mixed into the kernel class, whose ``cfg``, byte counts and ``work_of`` it reads."""

    @cute.jit
    def producer(
        self, scheduler, cache: KvCache, mQ_tma, mK_tma, mV_tma, mQ_sdhb,
        mCuSeqlensQ, mCuSeqlensK, mSeqDescriptors, window_left, window_right,
        tma_q, tma_k, tma_v, sQ, sK, sV,
        q_producer: pipeline.PipelineProducer, kv_producer: pipeline.PipelineProducer, mBlockLists=None,
    ):
        """Per work tile: Q, then the K/V tiles its mask keeps, in the order the mainloop waits."""
        cfg = self.cfg
        cursor = scheduler.producer_cursor()
        tile_idx = scheduler.first()
        num_tiles = scheduler.num_tiles
        while tile_idx < num_tiles:
            tile = scheduler.decode(tile_idx)
            batch, split, seq = self.work_of(tile, cache, mQ_sdhb, mK_tma, mCuSeqlensQ, mCuSeqlensK)
            if const_expr(cfg.cache_lengths):
                cache.flag_bad_length(batch, mK_tma)
            if tile.m_block * cfg.tile_m < seq.seqlen_q:
                head_kv = tile.head // (mQ_tma.shape[2] // mK_tma.shape[2])
                desc_q = desc_k = desc_v = None  # None: the descriptor built into the TMA atom
                if const_expr(cfg.varlen):
                    # This sequence's own descriptors: coordinates are relative to its first row
                    # and TMA stops at its last (a cache's keys have none: they are found by
                    # batch entry or page).
                    desc_q = seq_desc.acquire_descriptor(mSeqDescriptors, batch, seq_desc.Q)
                    if const_expr(cfg.keys_packed):
                        desc_k = seq_desc.acquire_descriptor(mSeqDescriptors, batch, seq_desc.K)
                    if const_expr(cfg.keys_packed and not cfg.v_staged):
                        desc_v = seq_desc.acquire_descriptor(mSeqDescriptors, batch, seq_desc.V)
                # varlen tensors have one batch row, the packed tokens; staged V has one per
                # sequence; a paged cache is one run of pages; a dense cache a row per sequence
                row_batch = Int32(0) if const_expr(cfg.varlen) else batch
                kv_batch = Int32(0) if const_expr(cfg.page_run or cfg.keys_packed) else batch
                mQ_cur = mQ_tma[None, None, tile.head, row_batch]
                mK_cur = mK_tma[None, None, head_kv, kv_batch]
                mV_cur = mV_tma[None, None, head_kv, batch if const_expr(cfg.v_staged) else kv_batch]
                gQ = cute.local_tile(mQ_cur, (cfg.tile_m, cfg.head_dim), (tile.m_block, 0))
                tQsQ, tQgQ = tma_tiles(tma_q, sQ, gQ)

                q_handle = q_producer.acquire_and_advance()
                cute.copy(tma_q, tQgQ, tQsQ[None, q_handle.index], tma_bar_ptr=q_handle.barrier, tma_desc_ptr=desc_q)

                kv_tiles = self.kv_walk(tile.m_block, seq, window_left, window_right, split, cache.num_splits,
                                        mBlockLists, batch, tile.head)
                if const_expr(cfg.page_run):
                    kv_producer = self.load_kv_paged(kv_tiles, cache, batch, seq, mK_cur, mV_cur, tma_k, tma_v,
                                                     sK, sV, kv_producer)
                else:
                    gK = cute.local_tile(mK_cur, (cfg.tile_n, cfg.head_dim), (None, 0))
                    if const_expr(cfg.kv_converted):  # staged as K is: (keys, head dim)
                        gV = cute.local_tile(mV_cur, (cfg.tile_n, cfg.head_dim_v), (None, 0))
                    else:
                        gV = cute.local_tile(mV_cur, (cfg.head_dim_v, cfg.tile_n), (0, None))
                    tKsK, tKgK = tma_tiles(tma_k, sK, gK)
                    tVsV, tVgV = tma_tiles(tma_v, sV, gV)
                    k_tile = lambda i: tKgK[None, kv_tiles.block(i)]  # noqa: E731
                    v_tile = lambda i: tVgV[None, kv_tiles.block(i)]  # noqa: E731
                    if const_expr(cfg.select_block):  # any key row
                        k_tile = lambda i: self.rows_from(tma_k, sK, mK_cur, kv_tiles.block(i), True)  # noqa: E731
                        v_tile = lambda i: self.rows_from(tma_v, sV, mV_cur, kv_tiles.block(i), False)  # noqa: E731
                    kv_producer = self.load_kv((tma_k, k_tile, tKsK, desc_k), (tma_v, v_tile, tVsV, desc_v), kv_tiles,
                                               kv_producer)
            # Claimed tiles are claimed once this tile's loads are issued: the consumers get the
            # claim well before they finish the tile, and the claim order stays the start order.
            tile_idx, cursor = scheduler.producer_next(tile_idx, cursor)

    @cute.jit
    def load_kv(self, k_load, v_load, kv_tiles, kv_producer: pipeline.PipelineProducer):
        """The walk's K/V tiles in ring order (``in_kv_order``). ``k_load``/``v_load``: (TMA atom,
        the global tile of step i as ``tile(i)``, shared stages, descriptor or None)."""
        tma_k, k_tile, tKsK, desc_k = k_load
        tma_v, v_tile, tVsV, desc_v = v_load
        return in_kv_order(kv_tiles.total, kv_producer,
                           lambda i, p: self.load_stage(p, tma_k, k_tile(i), tKsK, desc_k, True),
                           lambda i, p, last: self.load_stage(p, tma_v, v_tile(i), tVsV, desc_v, False))

    def rows_from(self, tma, s_stages, m_cur: cute.Tensor, row, is_k: bool):
        """The TMA source of a tile of a walk over key rows (``SelectedKvWalk``): ``tile_n``
        keys from row ``row`` on, wherever it lies (TMA fills zeros past the last key)."""
        cfg = self.cfg
        if const_expr(is_k):  # (keys, head dim)
            tile = cute.local_tile(cute.domain_offset((row, 0), m_cur), (cfg.tile_n, cfg.head_dim), (0, 0))
        else:  # V as (head dim, keys)
            tile = cute.local_tile(cute.domain_offset((0, row), m_cur), (cfg.head_dim_v, cfg.tile_n), (0, 0))
        return tma_tiles(tma, s_stages, tile)[1]

    @cute.jit
    def load_stage(self, kv_producer: pipeline.PipelineProducer, tma, src, dst_stages, desc, is_k: cutlass.Constexpr):
        """TMA-load one K (``is_k``) or V tile (``src``) into the ring's next free stage. The
        advanced producer is returned for the caller to rebind."""
        handle = self.acquire_stage(kv_producer, is_k)
        cute.copy(tma, src, dst_stages[None, handle.index], tma_bar_ptr=handle.barrier, tma_desc_ptr=desc)
        return kv_producer

    @cute.jit
    def acquire_stage(self, kv_producer: pipeline.PipelineProducer, is_k: cutlass.Constexpr):
        """The ring's next free stage, its barrier expecting this tile's bytes: the pipeline
        expects the smaller of a K and a V tile, and the larger adds the difference (while the
        stage still waits for every byte, so its phase cannot complete in between)."""
        handle = kv_producer.acquire_and_advance()
        extra = (self.k_bytes - self.v_bytes) if const_expr(is_k) else (self.v_bytes - self.k_bytes)
        if const_expr(extra > 0):
            with cute.arch.elect_one():
                cute.arch.mbarrier_expect_tx(handle.barrier, extra)
        return handle

    @cute.jit
    def load_kv_paged(self, kv_tiles, cache: KvCache, batch: Int32, seq: SequenceInfo, mK_cur: cute.Tensor,
                      mV_cur: cute.Tensor, tma_k, tma_v, sK, sV, kv_producer: pipeline.PipelineProducer):
        """``load_kv`` from a paged cache: each K or V tile in runs of ``kv_load_rows`` keys, each
        run from the page the block table names (every run lies within one page). A tile's pages
        are looked up once, for its K, and kept for its V one step later: the state carries the
        page rows of the V tile due next and of the K tile loaded last (``page_lookups`` values
        each, flat)."""
        lookups = self.page_lookups

        def load_k(i, state):
            p, last_k_rows = state[0], state[1 + lookups:]
            rows = self.page_rows(cache, batch, seq, kv_tiles.block(i), mK_cur.shape[0])
            return (self.load_stage_paged(p, rows, mK_cur, tma_k, sK, True),) + last_k_rows + rows

        def load_v(i, state, last):
            p, v_rows, k_rows = state[0], state[1:1 + lookups], state[1 + lookups:]
            p = self.load_stage_paged(p, k_rows if last else v_rows, mV_cur, tma_v, sV, False)
            return (p,) + v_rows + k_rows

        state = in_kv_order(kv_tiles.total, (kv_producer,) + (Int32(0),) * (2 * lookups), load_k, load_v)
        return state[0]

    @property
    def page_lookups(self) -> int:
        """Block-table lookups per K/V tile: one per lane of the producer warp, 32 runs each."""
        return -(-(self.cfg.tile_n // self.cfg.kv_load_rows) // 32)

    @cute.jit
    def page_rows(self, cache: KvCache, batch: Int32, seq: SequenceInfo, n_block: Int32, num_rows: Int32) -> tuple:
        """Lookup j, lane i of the producer warp: the cache row where run 32 j + i of K/V tile
        ``n_block`` starts (one block-table round trip per 32 runs)."""
        cfg = self.cfg
        runs = cfg.tile_n // cfg.kv_load_rows
        rows = ()
        for j in cutlass.range_constexpr(self.page_lookups):
            run = cutlass.min(j * 32 + cute.arch.lane_idx(), runs - 1)
            key = n_block * cfg.tile_n + run * cfg.kv_load_rows
            rows = rows + (cache.physical_row(cache.page_of(batch, key), key, seq.seqlen_k, num_rows),)
        return rows

    @cute.jit
    def load_stage_paged(self, kv_producer: pipeline.PipelineProducer, lane_rows: tuple, m_cur: cute.Tensor, tma,
                         s_stages, is_k: cutlass.Constexpr):
        """One K (``is_k``) or V tile into the ring's next stage, run r from the cache row lane
        r % 32 of lookup r // 32 holds (``page_rows``)."""
        cfg = self.cfg
        rows = cfg.kv_load_rows
        handle = self.acquire_stage(kv_producer, is_k)
        for run in cutlass.range_constexpr(cfg.tile_n // rows):
            row = cute.arch.shuffle_sync(lane_rows[run // 32], run % 32)
            stage = s_stages[None, None, handle.index]
            if const_expr(is_k or cfg.kv_converted):  # (keys, head dim): K, or a converted cache's V
                width = cfg.head_dim if const_expr(is_k) else cfg.head_dim_v
                dst = cute.local_tile(stage, (rows, width), (run, 0))
                src = cute.local_tile(m_cur, (rows, width), (row // rows, 0))
            else:
                dst = cute.local_tile(stage, (cfg.head_dim_v, rows), (0, run))
                src = cute.local_tile(m_cur, (cfg.head_dim_v, rows), (0, row // rows))
            t_s, t_g = tma_tiles(tma, dst, src)
            cute.copy(tma, t_g, t_s, tma_bar_ptr=handle.barrier)
        return kv_producer
