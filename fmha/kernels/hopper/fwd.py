"""Hopper (SM90) fused attention forward, warp specialized. docs/design.md draws it.

Roles (a CTA works on one query tile of 64 rows per consumer warpgroup at a time):

* warpgroup 0, the **producer** (``fwd_producer.py``): its first warp issues the TMA loads of each
  tile's Q and of its K and V tiles into a ring of shared-memory stages, in the order the
  consumers wait for them. It gives most of its registers away (``setmaxnreg``).
* warpgroups 1..n (n = 2, or 3 at head dim <= 64), the **consumers** (``consumer``): each owns 64
  query rows; per K/V tile it computes S = Q K^T, masks it where the tile needs it, runs the
  online softmax in registers and adds P V to O (``mainloop.py``); after the last tile it
  normalizes O and writes O and the LSE (``epilogue``, ``epilogue.py``).

Pipelines (mbarriers) between the roles: Q (``q_stages`` buffers), the K/V ring (``kv_stages``
stages, K and V tiles in turn) and, for claimed tiles, the tile hand-off (``scheduler.py``).
Named barriers among the consumers: ``barriers.NamedBarrier``.

K/V tiles the mask leaves empty are never loaded; only boundary tiles pay for element-wise
masking (``common/kv_walk.py``, shared with the host and the tests). Decode over a KV
cache switches on compile-time options (``config.decode_config``): a GQA group's query heads as
the rows of one tile, key counts per sequence, a query tile's keys split over CTAs (fp32 partials
for ``common/split_combine.py``), paged K/V read through the block table (``load_kv_paged``). Varlen loads go
through per-sequence TMA descriptors (``sequence_descriptors.py``). fp8: V arrives key-major
from ``v_staging`` and P is fed to the P.V product in the fp8 A-operand order. An fp8 cache under
a 16-bit query is loaded into a staging ring and converted into the K/V ring by the producer
warpgroup's other warps (``kv_convert.py``).
"""

import dataclasses
import math
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from fmha.masking import MaskKind, num_q_tiles

from ..common.kv_walk import SelectedKvWalk, kv_walk, listed_walk, masked_for_mods

from ..common.device_tile_list import COST_BINS, DeviceWorkTileList, cost_bins_bytes
from ..common import sequence_descriptors as seq_desc
from ..common.kv_cache import KvCache, cache_capacity
from ..common.fragments import as_rows_cols, fp8_operand_a_shape
from ..common.layouts import bshd_to_sdhb, ring_layout
from ..common.mask import FragmentMask, ScoreMods
from ..common.scheduler import ClaimingTileScheduler, StaticTileScheduler, TileHandOff, TileTableScheduler, WorkTile
from ..common.seqinfo import SequenceInfo
from ..common.softmax import MAX_SLACK, OnlineSoftmax
from .barriers import NamedBarrier
from .config import SMEM_LIMIT, HopperForwardConfig, OStore
from .epilogue import drain_o_stores, store_lse, store_o_direct, store_o_tma, wg_slice_layout
from .fwd_producer import ProducerWarp
from .kv_convert import CONVERTER_THREADS, CONVERTER_WARPS, PRODUCER_CONVERTING_WARPS, CacheConverter
from .mainloop import ConsumerFragments, ConsumerMainloop
from .wgmma import WARPGROUP_THREADS as _WG


class HopperAttentionForward(ProducerWarp, CacheConverter, ConsumerMainloop, seq_desc.SequenceDescriptors,
                             DeviceWorkTileList):
    """The kernel for one ``HopperForwardConfig``; call it (through ``cute.compile``) with the
    tensors and sizes of ``__call__``."""

    def __init__(self, cfg: HopperForwardConfig):
        self.cfg = cfg
        self.num_threads = _WG * (1 + cfg.num_consumer_warpgroups + cfg.converter_warpgroups)
        self.max_slack = MAX_SLACK if cfg.lazy_rescale else 0.0

    # ------------------------------------------------------------------ host-side JIT
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        mCuSeqlensQ: Optional[cute.Tensor],
        mCuSeqlensK: Optional[cute.Tensor],
        mTileTable: Optional[cute.Tensor],
        mTileCount: Optional[cute.Tensor],
        mSeqDescriptors: Optional[cute.Tensor],
        mErrors: Optional[cute.Tensor],
        mTileCounter: Optional[cute.Tensor],
        mCacheSeqlens: Optional[cute.Tensor],
        mBlockTable: Optional[cute.Tensor],
        mSinks: Optional[cute.Tensor],
        mCacheScales: Optional[tuple],
        mModTensors: Optional[tuple],
        mBlockLists: Optional[tuple],
        max_seqlen_q: Int32,
        scale_log2: Float32,
        output_scale: Float32,
        softcap_factor: Optional[Float32],
        window_left: Optional[Int32],
        window_right: Optional[Int32],
        num_ctas: Int32,
        num_splits: Optional[Int32],
        page_size: Optional[Int32],
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        self.dtype = mQ.element_type
        self.out_dtype = mO.element_type
        kv_dtype = mK.element_type  # the query's, or an fp8 cache's (``cfg.kv_converted``)
        varlen = cfg.varlen
        q = bshd_to_sdhb(mQ, varlen)
        k = bshd_to_sdhb(mK, cfg.keys_packed)  # a KV cache keeps its batch mode (paged: one run of pages)
        if const_expr(cfg.v_staged):
            # (B, H, D, S) -> (D, S, H, B), keys contiguous: the K-major B of P.V (fp8 needs it)
            v = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[2, 3, 1, 0]))
            v_major, v_smem_major = cute.nvgpu.OperandMajorMode.K, LayoutEnum.ROW_MAJOR
        elif const_expr(cfg.kv_converted):
            # (S, D, H, B) as K: staged as the cache stores it, converted into the MN-major B of P.V
            v = bshd_to_sdhb(mV, cfg.keys_packed)
            v_major, v_smem_major = cute.nvgpu.OperandMajorMode.MN, LayoutEnum.COL_MAJOR
        else:
            v = bshd_to_sdhb(mV, cfg.keys_packed, d_first=True)  # (D, S, H, B): the MN-major B of P.V
            v_major, v_smem_major = cute.nvgpu.OperandMajorMode.MN, LayoutEnum.COL_MAJOR
        d, dv = cfg.head_dim, cfg.head_dim_v
        tile_m, tile_n = cfg.tile_m, cfg.tile_n
        num_wgs = cfg.num_consumer_warpgroups

        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
            Float32, (num_wgs, 1, 1), (64, tile_n),
        )
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, v_major,
            Float32, (num_wgs, 1, 1), (64, dv), warpgroup.OperandSource.RMEM,
        )
        sQ_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (tile_m, tile_n, d), self.dtype, cfg.q_stages)
        # K and V tiles take turns in one ring, each stage as large as the larger of the two
        stage_elems = tile_n * max(d, dv)
        sK_layout = ring_layout(
            sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (tile_m, tile_n, d), self.dtype, 1),
            cfg.kv_stages, stage_elems)
        sV_layout = ring_layout(
            sm90_utils.make_smem_layout_b(v_smem_major, (tile_m, dv, tile_n), self.dtype, 1),
            cfg.kv_stages, stage_elems)

        # a converted cache's staging ring: K and V tiles (keys, head dim) in the cache's type
        staged_elems = tile_n * max(d, dv)
        sK_staged_layout = sV_staged_layout = None
        if const_expr(cfg.kv_converted):
            sK_staged_layout, sV_staged_layout = (self.staging_layout(width, kv_dtype, staged_elems) for width in (d, dv))

        load_op = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tma_tensor_q = cpasync.make_tiled_tma_atom(
            load_op, q, cute.select(sQ_layout, mode=[0, 1]), (tile_m, d))
        # A paged cache loads each K/V tile in runs of ``kv_load_rows`` keys (``load_kv_paged``).
        kv_rows = cfg.kv_load_rows
        if const_expr(cfg.kv_converted):
            k_loaded, v_loaded = sK_staged_layout, sV_staged_layout
        else:
            k_loaded, v_loaded = sK_layout, sV_layout
        sK_box = cute.select(k_loaded, mode=[0, 1])
        sV_box = cute.select(v_loaded, mode=[0, 1])
        v_box = (kv_rows, dv) if const_expr(cfg.kv_converted) else (dv, kv_rows)
        if const_expr(kv_rows != tile_n):
            sK_box = cute.composition(sK_box, cute.make_layout((kv_rows, d), stride=(1, tile_n)))
            if const_expr(cfg.kv_converted):
                sV_box = cute.composition(sV_box, cute.make_layout((kv_rows, dv), stride=(1, tile_n)))
            else:
                sV_box = cute.composition(sV_box, cute.make_layout((dv, kv_rows), stride=(1, dv)))
        tma_k, tma_tensor_k = cpasync.make_tiled_tma_atom(load_op, k, sK_box, (kv_rows, d))
        tma_v, tma_tensor_v = cpasync.make_tiled_tma_atom(load_op, v, sV_box, v_box)
        # O as staged for the TMA store: the Q tile's layout, in the output type.
        sO_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (tile_m, tile_n, dv), self.out_dtype, 1)
        tma_o = tma_tensor_o = o = None
        if const_expr(cfg.o_via_tma):
            o = bshd_to_sdhb(mO, varlen)
            o_wg_layout = wg_slice_layout(cute.select(sO_layout, mode=[0, 1]), tile_m, dv)
            tma_o, tma_tensor_o = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), o, o_wg_layout,
                                                              (64, dv))
        self.q_bytes = cute.size_in_bytes(self.dtype, cute.select(sQ_layout, mode=[0, 1]))
        # what each K or V load brings (the TMA pipeline's byte counts)
        self.k_bytes = cute.size_in_bytes(kv_dtype, cute.select(k_loaded, mode=[0, 1]))
        self.v_bytes = cute.size_in_bytes(kv_dtype, cute.select(v_loaded, mode=[0, 1]))

        ring_elems = cfg.kv_stages * stage_elems
        o_elems = cute.cosize(sO_layout) if const_expr(cfg.o_store == OStore.TMA_OWN_BUFFER) else 0
        hand_off_stages = TileHandOff.STAGES if cfg.claims_tiles else 0

        @cute.struct
        class SharedStorage:
            q_mbar: cute.struct.MemRange[cutlass.Int64, cfg.q_stages * 2]
            kv_mbar: cute.struct.MemRange[cutlass.Int64, cfg.kv_stages * 2]
            staged_mbar: cute.struct.MemRange[cutlass.Int64, cfg.kv_staging_stages * 2]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sKV: cute.struct.Align[cute.struct.MemRange[self.dtype, ring_elems], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[self.out_dtype, o_elems], 1024]
            sKV_staged: cute.struct.Align[cute.struct.MemRange[kv_dtype, cfg.kv_staging_stages * staged_elems], 1024]
            # claimed tiles on their way from the producer to the consumers
            tile_mbar: cute.struct.MemRange[cutlass.Int64, hand_off_stages * 2]
            next_tile: cute.struct.MemRange[Int32, hand_off_stages]

        if const_expr(SharedStorage.size_in_bytes() > SMEM_LIMIT):  # the launch would fail
            raise ValueError(f"the forward's shared memory ({SharedStorage.size_in_bytes()} bytes with {tile_m}x{tile_n} "
                             f"tiles, {cfg.kv_stages} K/V stages, head dim {d}) exceeds the {SMEM_LIMIT} a Hopper CTA "
                             f"may use")
        self.shared_storage = SharedStorage

        num_batches = mCuSeqlensQ.shape[0] - 1 if const_expr(varlen) else q.shape[3]
        seqlen_q = max_seqlen_q if const_expr(varlen) else q.shape[0]
        num_m_blocks = num_q_tiles(seqlen_q, tile_m)
        # split-KV: split s of batch entry b works as entry s * B + b (``work_of``)
        work_batches = num_batches * num_splits if const_expr(cfg.split_kv) else num_batches
        if const_expr(varlen):
            num_tiles = mTileTable.shape[0] * q.shape[2]  # only the query tiles that hold rows
        else:
            num_tiles = num_m_blocks * q.shape[2] * work_batches
        grid_x = num_tiles
        if const_expr(cfg.persistent):
            grid_x = cutlass.min(num_tiles, num_ctas)

        if const_expr(varlen):
            self.describe_sequences(
                tma_q, tma_k, tma_v, tma_o, q, k, v, o, mCuSeqlensQ, mCuSeqlensK, mSeqDescriptors, mErrors,
                max_seqlen_q,
            ).launch(grid=[num_batches, 1, 1], block=[32, 1, 1], stream=stream)
        if const_expr(cfg.tiles_on_device):
            # over a cache, a sequence's keys are its cache length, at most the capacity
            keys = cache_capacity(mBlockTable, page_size, k) if const_expr(cfg.cache_lengths) else k.shape[0]
            self.list_work_tiles(mCuSeqlensQ, mCuSeqlensK, q.shape[0], keys, max_seqlen_q, None, window_left,
                                 window_right, mTileTable, mTileCount,
                                 mCacheSeqlens if const_expr(cfg.cache_lengths) else None).launch(
                grid=[1, 1, 1], block=[COST_BINS, 1, 1], smem=cost_bins_bytes(), stream=stream)
        self.kernel(
            tiled_mma_qk, tiled_mma_pv,
            tma_q, tma_tensor_q, tma_k, tma_tensor_k, tma_v, tma_tensor_v, tma_o, tma_tensor_o,
            q, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mTileTable, mTileCount, mSeqDescriptors, mTileCounter,
            mCacheSeqlens, mBlockTable, mErrors if const_expr(cfg.cache_lengths) else None, mSinks,
            mCacheScales, mModTensors, mBlockLists,
            num_m_blocks,
            num_batches,
            num_splits,
            page_size,
            scale_log2, output_scale, softcap_factor, window_left, window_right,
            sQ_layout, sK_layout, sV_layout, sO_layout, sK_staged_layout, sV_staged_layout,
        ).launch(
            grid=[grid_x, 1, 1],
            block=[self.num_threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=1,
        )

    # ------------------------------------------------------------------ device
    @cute.kernel
    def kernel(
        self,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        tma_q: cute.CopyAtom,
        mQ_tma: cute.Tensor,
        tma_k: cute.CopyAtom,
        mK_tma: cute.Tensor,
        tma_v: cute.CopyAtom,
        mV_tma: cute.Tensor,
        tma_o: Optional[cute.CopyAtom],
        mO_tma: Optional[cute.Tensor],
        mQ_sdhb: cute.Tensor,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        mCuSeqlensQ: Optional[cute.Tensor],
        mCuSeqlensK: Optional[cute.Tensor],
        mTileTable: Optional[cute.Tensor],
        mTileCount: Optional[cute.Tensor],
        mSeqDescriptors: Optional[cute.Tensor],
        mTileCounter: Optional[cute.Tensor],
        mCacheSeqlens: Optional[cute.Tensor],
        mBlockTable: Optional[cute.Tensor],
        mErrors: Optional[cute.Tensor],
        mSinks: Optional[cute.Tensor],
        mCacheScales: Optional[tuple],
        mModTensors: Optional[tuple],
        mBlockLists: Optional[tuple],
        num_m_blocks: Int32,
        num_batches: Int32,
        num_splits: Optional[Int32],
        page_size: Optional[Int32],
        scale_log2: Float32,
        output_scale: Float32,
        softcap_factor: Optional[Float32],
        window_left: Optional[Int32],
        window_right: Optional[Int32],
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        sK_staged_layout: Optional[cute.ComposedLayout],
        sV_staged_layout: Optional[cute.ComposedLayout],
    ):
        cfg = self.cfg
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_v):
                cpasync.prefetch_descriptor(atom)
            if const_expr(cfg.o_via_tma):
                cpasync.prefetch_descriptor(tma_o)

        storage = SmemAllocator().allocate(self.shared_storage)
        one_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        # TMA pipelines count one arrival per consumer warp on release.
        consumer_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, cfg.num_consumer_warpgroups * 4)
        # With O staged in the Q buffer, one thread per warpgroup frees it, after the TMA store.
        q_releasers = pipeline.CooperativeGroup(pipeline.Agent.Thread, cfg.num_consumer_warpgroups) \
            if const_expr(cfg.o_store == OStore.TMA_Q_BUFFER) else consumer_warps
        q_producer, q_consumer = pipeline.PipelineTmaAsync.create(
            num_stages=cfg.q_stages, producer_group=one_thread, consumer_group=q_releasers,
            tx_count=self.q_bytes, barrier_storage=storage.q_mbar.data_ptr(), defer_sync=True,
        ).make_participants()
        staged_producer = staged_consumer = None
        if const_expr(cfg.kv_converted):
            # TMA -> staging ring -> converting warps -> K/V ring -> consumers
            staged_producer, staged_consumer = pipeline.PipelineTmaAsync.create(
                num_stages=cfg.kv_staging_stages, producer_group=one_thread,
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, CONVERTER_WARPS),
                tx_count=min(self.k_bytes, self.v_bytes), barrier_storage=storage.staged_mbar.data_ptr(),
                defer_sync=True,
            ).make_participants()
            kv_producer, kv_consumer = pipeline.PipelineAsync.create(
                num_stages=cfg.kv_stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, CONVERTER_THREADS),
                consumer_group=consumer_warps, barrier_storage=storage.kv_mbar.data_ptr(), defer_sync=True,
            ).make_participants()
        else:
            kv_producer, kv_consumer = pipeline.PipelineTmaAsync.create(
                num_stages=cfg.kv_stages, producer_group=one_thread, consumer_group=consumer_warps,
                tx_count=min(self.k_bytes, self.v_bytes), barrier_storage=storage.kv_mbar.data_ptr(),
                defer_sync=True,
            ).make_participants()
        hand_off = None
        if const_expr(cfg.claims_tiles):
            hand_off = TileHandOff.create(
                storage.tile_mbar.data_ptr(), storage.next_tile.get_tensor(cute.make_layout(TileHandOff.STAGES)),
                cfg.num_consumer_warpgroups * _WG)
        pipeline.pipeline_init_arrive()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sKV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        # V stages alias K stages: the ring holds whichever the schedule put there.
        sV = cute.make_tensor(cute.recast_ptr(sK.iterator, sV_layout.inner), sV_layout.outer)
        sK_staged = sV_staged = None
        if const_expr(cfg.kv_converted):
            sK_staged = storage.sKV_staged.get_tensor(sK_staged_layout.outer, swizzle=sK_staged_layout.inner)
            sV_staged = cute.make_tensor(cute.recast_ptr(sK_staged.iterator, sV_staged_layout.inner),
                                         sV_staged_layout.outer)
        sO = None
        if const_expr(cfg.o_store == OStore.TMA_OWN_BUFFER):
            sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)[None, None, 0]

        work_batches = num_batches * num_splits if const_expr(cfg.split_kv) else num_batches
        scheduler = self.make_scheduler(mTileTable, mTileCount, mTileCounter, hand_off, num_m_blocks,
                                        mQ_sdhb.shape[2], work_batches)
        cache = KvCache(mCacheSeqlens, mBlockTable, mErrors, num_batches, num_splits, page_size, cfg.page_run > 0)
        pipeline.pipeline_init_wait()

        # the producer loads a converted cache into the staging ring, others into the K/V ring
        k_dst, v_dst, load_pipe = sK, sV, kv_producer
        if const_expr(cfg.kv_converted):
            k_dst, v_dst, load_pipe = sK_staged, sV_staged, staged_producer
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(cfg.register_budgets[0])
            if warp_idx == 0:
                self.producer(
                    scheduler, cache, mQ_tma, mK_tma, mV_tma, mQ_sdhb, mCuSeqlensQ, mCuSeqlensK, mSeqDescriptors,
                    window_left, window_right, tma_q, tma_k, tma_v, sQ, k_dst, v_dst, q_producer, load_pipe,
                    mBlockLists,
                )
            if const_expr(cfg.kv_converted):
                if warp_idx > 0:
                    self.converter(
                        scheduler, cache, mQ_sdhb, mK_tma, mCuSeqlensQ, mCuSeqlensK, window_left, window_right,
                        sK_staged, sV_staged, sK, sV, staged_consumer, kv_producer, mBlockLists,
                        tidx - 32,  # after warp 0's
                    )
        else:
            converting = False
            if const_expr(cfg.kv_converted):
                converting = warp_idx >= 4 * (1 + cfg.num_consumer_warpgroups)  # the converting warpgroup
            if converting:
                cute.arch.setmaxregister_decrease(cfg.register_budgets[0])
                if const_expr(cfg.kv_converted):
                    self.converter(
                        scheduler, cache, mQ_sdhb, mK_tma, mCuSeqlensQ, mCuSeqlensK, window_left, window_right,
                        sK_staged, sV_staged, sK, sV, staged_consumer, kv_producer, mBlockLists,
                        tidx - _WG * (1 + cfg.num_consumer_warpgroups) + 32 * PRODUCER_CONVERTING_WARPS,
                    )
            else:
                cute.arch.setmaxregister_increase(cfg.register_budgets[1])
                self.consumer(
                    scheduler, cache, tiled_mma_qk, tiled_mma_pv, mQ_sdhb, mK_tma, mO, mLSE, mSinks, tma_o, mO_tma,
                    mCuSeqlensQ, mCuSeqlensK, mSeqDescriptors, scale_log2, output_scale, softcap_factor,
                    window_left, window_right, sQ, sK, sV, sO, q_consumer, kv_consumer, tidx - _WG, mModTensors,
                    mBlockLists, mCacheScales,
                )

    def staging_layout(self, width: int, kv_dtype, stage_elems: int) -> cute.ComposedLayout:
        """The staging ring of a converted cache's (keys, ``width``) tiles, swizzled as the 16-bit
        kernel's K tiles are (``lab/bench_fp8_staging.py`` measures an unswizzled one)."""
        cfg = self.cfg
        one = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (cfg.tile_m, cfg.tile_n, width), kv_dtype, 1)
        return ring_layout(one, cfg.kv_staging_stages, stage_elems)

    def make_scheduler(self, mTileTable, mTileCount, mTileCounter, hand_off, num_m_blocks, num_heads, num_batches):
        """The tile walk this configuration's schedule asks for (``scheduler.py``)."""
        cfg = self.cfg
        if const_expr(cfg.varlen):
            return TileTableScheduler.create(mTileTable, num_heads, mTileCount)
        if const_expr(cfg.claims_tiles):
            return ClaimingTileScheduler.create(num_m_blocks, num_heads, num_batches, cfg.longest_first,
                                                mTileCounter, hand_off)
        return StaticTileScheduler.create(num_m_blocks, num_heads, num_batches, cfg.longest_first, cfg.persistent)

    def kv_walk(self, m_block, seq: SequenceInfo, window_left, window_right, split=None, num_splits=None,
                block_lists=None, batch=None, head=None):
        """The K/V tiles this query tile visits (``common/kv_walk.py``), or with split-KV its
        split's share of them; with a block mask (``block_lists``) its list entry at (``batch``,
        ``head``, ``m_block``); with a mask mod and no block mask every tile is masked; NSA
        selection: the entry's selected blocks (``block_lists`` = (counts, first rows, positions))."""
        cfg = self.cfg
        if const_expr(cfg.select_block):
            counts, rows, positions = block_lists
            return SelectedKvWalk(rows[batch, head, m_block, None], positions[batch, head, m_block, None],
                                  counts[batch, head, m_block, 0], counts[batch, head, m_block, 1])
        if const_expr(block_lists is not None):
            counts, indices = block_lists
            return listed_walk((counts[batch, head, m_block, 0], counts[batch, head, m_block, 1]),
                               indices[batch, head, m_block, None], cfg.mask_kind != MaskKind.NONE)
        walk = kv_walk(
            m_block, cfg.tile_m, cfg.tile_n, seq.seqlen_q, seq.seqlen_k, cfg.mask_kind,
            window_left, window_right, cfg.bottom_right, imin=cutlass.min, imax=cutlass.max,
            rows_per_query=cfg.rows_per_query, compression=cfg.compression,
        )
        if const_expr(cfg.split_kv):
            walk = walk.split_share(split, num_splits, imin=cutlass.min, imax=cutlass.max)
        return masked_for_mods(walk, cfg.mods)

    def listed_tiles(self, seq: SequenceInfo):
        """Varlen tile lists (``device_tile_list``): a sequence's query tiles with rows."""
        return num_q_tiles(seq.seqlen_q, self.cfg.tile_m)

    def listed_tile_cost(self, m_block, seq: SequenceInfo, window_left, window_right):
        """A listed query tile's cost: the K/V tiles it visits, plus one (it loads Q and writes O
        even when it visits none)."""
        return self.kv_walk(m_block, seq, window_left, window_right).total + 1

    def work_of(self, tile: WorkTile, cache: KvCache, mQ_sdhb, mK_tma, mCuSeqlensQ, mCuSeqlensK):
        """(batch entry, split, its SequenceInfo) of a work tile: the schedulers count split s of
        entry b as entry s * B + b; a cache gives each sequence its own key count."""
        cfg = self.cfg
        batch, split = tile.batch, None
        if const_expr(cfg.split_kv):
            batch, split = tile.batch % cache.num_batches, tile.batch // cache.num_batches
        if const_expr(cfg.cache_lengths and cfg.varlen):  # a mixed batch: packed queries over a cache
            seq = SequenceInfo.create(batch, mQ_sdhb.shape[0], cache.capacity(mK_tma), mCuSeqlensQ,
                                      cache_seqlens=cache.seqlens)
        elif const_expr(cfg.cache_lengths):
            seq = SequenceInfo.with_cache_length(batch, mQ_sdhb.shape[0], cache.seqlens, cache.capacity(mK_tma))
        else:
            seq = SequenceInfo.create(batch, mQ_sdhb.shape[0], mK_tma.shape[0], mCuSeqlensQ, mCuSeqlensK)
        return batch, split, seq

    # ------------------------------------------------------------------ consumer warpgroups
    @cute.jit
    def consumer(
        self, scheduler, cache: KvCache, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
        mQ_sdhb, mK_tma, mO, mLSE, mSinks, tma_o, mO_tma, mCuSeqlensQ, mCuSeqlensK, mSeqDescriptors,
        scale_log2: Float32, output_scale: Float32, softcap_factor, window_left, window_right,
        sQ, sK, sV, sO: Optional[cute.Tensor], q_consumer: pipeline.PipelineConsumer,
        kv_consumer: pipeline.PipelineConsumer, tidx: Int32, mModTensors: Optional[tuple] = None,
        mBlockLists: Optional[tuple] = None, mCacheScales: Optional[tuple] = None,
    ):
        """Per work tile: the K/V loop into O, then the epilogue."""
        cfg = self.cfg
        # Uniform by construction, but ptxas cannot see it from tidx: without the hint the
        # warpgroup's Q descriptor lives in ordinary registers and every S-GEMM wgmma waits on
        # two R2UR moves into uniform registers.
        wg = cute.arch.make_warp_uniform(tidx // _WG)
        wg_first_thread = wg * _WG
        thr_qk = tiled_mma_qk.get_slice(tidx)
        thr_pv = tiled_mma_pv.get_slice(tidx)
        wg_qk = tiled_mma_qk.get_slice(wg_first_thread)
        wg_pv = tiled_mma_pv.get_slice(wg_first_thread)
        tSrQ = wg_qk.make_fragment_A(wg_qk.partition_A(sQ))
        tSrK = wg_qk.make_fragment_B(wg_qk.partition_B(sK))
        tOrV = wg_pv.make_fragment_B(wg_pv.partition_B(sV))
        s_shape = thr_qk.partition_shape_C((cfg.tile_m, cfg.tile_n))
        acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((cfg.tile_m, cfg.head_dim_v)), Float32)
        tScS = thr_qk.partition_C(cute.make_identity_tensor((cfg.tile_m, cfg.tile_n)))
        tOcO = thr_pv.partition_C(cute.make_identity_tensor((cfg.tile_m, cfg.head_dim_v)))

        num_rows = cute.size(as_rows_cols(acc_o), mode=[0])
        softmax = OnlineSoftmax.create(scale_log2, num_rows, *cfg.softmax_chains, self.max_slack)
        row_scale = cute.make_rmem_tensor(num_rows, Float32)
        lse_rows = cute.make_rmem_tensor(num_rows, Float32)
        sinks_log2 = cute.make_rmem_tensor(num_rows, Float32) if const_expr(cfg.has_sinks) else None
        # P of the tile whose P.V is pending; S itself is allocated per tile (a score fragment
        # that outlived its tile would stay live across the loop and crowd out the registers the
        # in-flight GEMMs need).
        if const_expr(self.dtype.width == 8):
            p = cute.make_rmem_tensor(fp8_operand_a_shape(s_shape), self.dtype)
        else:
            p = cute.make_rmem_tensor(s_shape, self.dtype)
        if wg == 0:
            # Warpgroup 0 issues first: pre-arrive on its own turn barrier.
            cute.arch.barrier_arrive(barrier_id=NamedBarrier.GEMM_TURN, number_of_threads=2 * _WG)

        cursor = scheduler.consumer_cursor()
        tile_idx = scheduler.first()
        num_tiles = scheduler.num_tiles
        while tile_idx < num_tiles:
            tile = scheduler.decode(tile_idx)
            batch, split, seq = self.work_of(tile, cache, mQ_sdhb, mK_tma, mCuSeqlensQ, mCuSeqlensK)
            if tile.m_block * cfg.tile_m < seq.seqlen_q:
                mods = ScoreMods.of(cfg.mods, mModTensors, batch, tile.head, scale_log2)
                mask = FragmentMask.of(cfg, seq.seqlen_q, seq.seqlen_k, window_left, window_right, softcap_factor,
                                       mods)
                kv_tiles = self.kv_walk(tile.m_block, seq, window_left, window_right, split, cache.num_splits,
                                        mBlockLists, batch, tile.head)
                row_base = tile.m_block * cfg.tile_m
                tile_softmax, tile_output_scale = softmax, output_scale
                if const_expr(cfg.kv_scale_tensors):
                    # an fp8 cache's dequantization factors of this sequence and K/V head
                    head_kv = tile.head // (mQ_sdhb.shape[2] // mK_tma.shape[2])
                    scale_k, scale_v = mCacheScales
                    tile_softmax = dataclasses.replace(softmax, scale_log2=scale_log2 * scale_k[batch, head_kv])
                    tile_output_scale = output_scale * scale_v[batch, head_kv]
                tile_softmax.reset()
                acc_o.fill(0.0)
                q_handle = q_consumer.wait_and_advance()
                frags = ConsumerFragments(tiled_mma_qk, tiled_mma_pv, tSrQ[None, None, None, q_handle.index], tSrK,
                                          tOrV, tScS, s_shape, p, acc_o, row_scale, sV)
                kv_consumer = self.mainloop(kv_tiles, row_base, mask, tile_softmax, frags, kv_consumer, wg)
                if const_expr(cfg.o_store != OStore.TMA_Q_BUFFER):
                    q_handle.release()  # else once the O staged in it has been stored
                if const_expr(cfg.has_sinks):
                    self.row_sinks(sinks_log2, mSinks, tOcO, tile, split)
                tile_softmax.finalize(acc_o, tile_output_scale, lse_rows, sinks_log2)
                self.epilogue(acc_o, lse_rows, tiled_mma_pv, tOcO, tidx, wg, q_handle, sQ, sO, tma_o, mO_tma,
                              mO, mLSE, mSeqDescriptors, tile, seq)
            tile_idx, cursor = scheduler.consumer_next(tile_idx, cursor)
        if const_expr(cfg.o_store == OStore.TMA_OWN_BUFFER):
            drain_o_stores()

    @cute.jit
    def row_sinks(self, sinks_log2: cute.Tensor, mSinks: cute.Tensor, tOcO: cute.Tensor, tile, split):
        """Each fragment row's sink logit in log2 units: its query head's (a packed GQA group's
        rows are its heads in turn); -inf in every split but the first, so that merging the splits
        by LSE counts the sink once."""
        cfg = self.cfg
        c = as_rows_cols(tOcO)
        for r in cutlass.range_constexpr(cute.size(sinks_log2)):
            head = tile.head
            if const_expr(cfg.rows_per_query > 1):
                row = tile.m_block * cfg.tile_m + c[r, 0][0]
                head = tile.head * cfg.rows_per_query + row % cfg.rows_per_query
            sink = mSinks[head] * Float32(math.log2(math.e))
            if const_expr(cfg.split_kv):
                sink = Float32(cutlass.select_(split == 0, sink, Float32(-math.inf)))
            sinks_log2[r] = sink

    @cute.jit
    def epilogue(self, acc_o: cute.Tensor, lse_rows: cute.Tensor, tiled_mma_pv: cute.TiledMma, tOcO: cute.Tensor,
                 tidx: Int32, wg: Int32, q_handle, sQ: cute.Tensor, sO: Optional[cute.Tensor],
                 tma_o: Optional[cute.CopyAtom], mO_tma: Optional[cute.Tensor], mO: cute.Tensor,
                 mLSE: Optional[cute.Tensor], mSeqDescriptors: Optional[cute.Tensor], tile, seq: SequenceInfo):
        """Write this warpgroup's rows of the normalized O and their LSE."""
        cfg = self.cfg
        o_out = cute.make_rmem_tensor_like(acc_o, self.out_dtype)
        o_out.store(acc_o.load().to(self.out_dtype))
        if const_expr(cfg.o_via_tma):
            staging, release_q = sO, None  # O's own buffer
            if const_expr(cfg.o_store == OStore.TMA_Q_BUFFER):
                q_pipe = q_handle.get_origin()
                q_index = q_handle.index
                staging = sQ[None, None, q_index]
                release_q = lambda: q_pipe.sync_object_empty.arrive(q_index, q_pipe.consumer_mask)  # noqa: E731
            desc_o, o_batch = None, tile.batch
            if const_expr(cfg.varlen):  # the sequence's own: rows count from its first, in batch row 0
                desc_o, o_batch = seq_desc.sequence_descriptor(mSeqDescriptors, tile.batch, seq_desc.O), Int32(0)
            store_o_tma(o_out, tiled_mma_pv, cfg.num_consumer_warpgroups, tidx, wg, NamedBarrier.O_STAGED + wg,
                        staging, tma_o, mO_tma, tile.m_block, tile.head, o_batch, release_q, desc_o)
        else:
            store_o_direct(o_out, tOcO, mO, cfg.varlen, tile.m_block, cfg.tile_m, tile.head, tile.batch,
                           seq.offset_q, seq.seqlen_q)
        store_lse(lse_rows, tOcO, mLSE, cfg.varlen, tile.m_block, cfg.tile_m, tile.head, tile.batch, seq.offset_q,
                  seq.seqlen_q)
