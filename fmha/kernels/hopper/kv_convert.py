"""The converting warps of the Hopper forward kernel (``fwd.HopperAttentionForward`` inherits them),
for an fp8 KV cache under a 16-bit query.

``wgmma`` multiplies operands of one type, and a bf16/fp16 query must not be rounded to fp8. So the
producer warp TMA-loads each K and V tile of the cache, in the cache's type, into a staging ring,
and seven converting warps (warps 1..3 of the producer warpgroup, idle otherwise, and a warpgroup
of their own after the consumer) convert each staged tile into the K/V ring the consumers read,
in the query's type and the layouts the 16-bit kernel has: the consumers' loop does not change.
e4m3 values are exact in bf16 and fp16, so the conversion rounds nothing; the cache's scales fold
into the score and output scales (launch scalars, or read per work tile from tensors).

Both staged tiles are (keys, head dim) with the head dim contiguous, as the cache stores them;
V is written transposed into the ring's (head dim, keys) view. The converters walk the same work
tiles and K/V walk as the producer and take the stages in its order (K_0, then (K_n, V_n-1), then
the last V: ``fwd_producer.in_kv_order``).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, pipeline

from ..common.kv_cache import KvCache
from ..common.pipelines import release_by_one_lane
from .fwd_producer import in_kv_order

#: warps 1..3 of the producer warpgroup (converting threads 0..95), then the converting
#: warpgroup (threads 96..223)
PRODUCER_CONVERTING_WARPS = 3
CONVERTER_WARPS = PRODUCER_CONVERTING_WARPS + 4
CONVERTER_THREADS = 32 * CONVERTER_WARPS
#: elements a thread converts at a time: 8 bytes read, 16 written
VECTOR = 8
#: keys of a converting thread's unit of work: one swizzle period of the staged tile
UNIT_ROWS = 8


def keys_first(stages: cute.Tensor) -> cute.Tensor:
    """A (head dim, keys, stages) ring viewed as (keys, head dim, stages)."""
    return cute.make_tensor(stages.iterator, cute.select(stages.layout, mode=[1, 0, 2]))


class CacheConverter:
    """Mixed into the kernel class, whose ``cfg``, ``dtype``, ``work_of`` and ``kv_walk`` it reads."""

    @cute.jit
    def converter(self, scheduler, cache: KvCache, mQ_sdhb, mK_tma, mCuSeqlensQ, mCuSeqlensK, window_left,
                  window_right, sK_staged, sV_staged, sK, sV, staged_consumer: pipeline.PipelineConsumer,
                  kv_producer: pipeline.PipelineProducer, mBlockLists, tidx: Int32):
        """Per work tile: each staged K/V tile of its walk into the K/V ring. ``tidx``: 0 ..
        ``CONVERTER_THREADS`` - 1 over the converting warps."""
        cfg = self.cfg
        sV_rows = keys_first(sV)
        cursor = scheduler.consumer_cursor()
        tile_idx = scheduler.first()
        num_tiles = scheduler.num_tiles
        while tile_idx < num_tiles:
            tile = scheduler.decode(tile_idx)
            batch, split, seq = self.work_of(tile, cache, mQ_sdhb, mK_tma, mCuSeqlensQ, mCuSeqlensK)
            if tile.m_block * cfg.tile_m < seq.seqlen_q:
                kv_tiles = self.kv_walk(tile.m_block, seq, window_left, window_right, split, cache.num_splits,
                                        mBlockLists, batch, tile.head)
                staged_consumer, kv_producer = in_kv_order(
                    kv_tiles.total, (staged_consumer, kv_producer),
                    lambda i, st: self.convert_stage(sK_staged, sK, cfg.head_dim, *st, tidx),
                    lambda i, st, last: self.convert_stage(sV_staged, sV_rows, cfg.head_dim_v, *st, tidx))
            tile_idx, cursor = scheduler.consumer_next(tile_idx, cursor)

    @cute.jit
    def convert_stage(self, src_stages: cute.Tensor, dst_stages: cute.Tensor, width: cutlass.Constexpr,
                      staged_consumer: pipeline.PipelineConsumer, kv_producer: pipeline.PipelineProducer,
                      tidx: Int32):
        """The next staged tile (keys, ``width``) into the K/V ring's next free stage, viewed as
        (keys, ``width``) too. Returns both advanced pipeline states."""
        src_handle = staged_consumer.wait_and_advance()
        dst_handle = kv_producer.acquire_and_advance()
        src = src_stages[None, None, src_handle.index]
        dst = dst_stages[None, None, dst_handle.index]
        # a unit: VECTOR columns of UNIT_ROWS keys, all loaded before any is converted, so that
        # the loads' latencies overlap
        per_row = width // VECTOR
        for unit in cutlass.range(tidx, self.cfg.tile_n // UNIT_ROWS * per_row, CONVERTER_THREADS, unroll=1):
            block, col = unit // per_row, unit % per_row
            rows = []
            for r in cutlass.range_constexpr(UNIT_ROWS):
                rows.append(cute.local_tile(src, (1, VECTOR), (block * UNIT_ROWS + r, col)).load())
            for r in cutlass.range_constexpr(UNIT_ROWS):
                cute.local_tile(dst, (1, VECTOR), (block * UNIT_ROWS + r, col)).store(rows[r].to(self.dtype))
        cute.arch.fence_view_async_shared()  # generic-proxy writes, before the consumers' wgmma reads them
        dst_handle.commit()
        cute.arch.sync_warp()  # every lane has read the staged tile before one lane frees it
        release_by_one_lane(src_handle)
        return staged_consumer, kv_producer
