"""Blackwell (SM100) fused attention forward, warp specialized; docs/blackwell.md draws it.

A CTA works on 256 query rows at a time: two Q tiles of 128 rows, each owned by one softmax
warpgroup, with S, P and O in tensor memory (TMEM). Roles, by warp (``WarpRoles``):

* warps 0-3 / 4-7, **softmax 0 / 1** (``softmax.py``): per K/V tile, load S from TMEM (a row per
  thread), mask it where the walk says, update the row's running max and sum, write P (in the
  input dtype) back over S and the old/new max for the correction warpgroup;
* warps 8-11, **correction** (``correction.py``): rescale O in TMEM when a row max grew, and after
  the last tile normalize O, write the LSE and stage O in shared memory (or store it, varlen);
* warp 12, **MMA**: allocates TMEM and issues every ``tcgen05`` MMA: S_i = Q_i K^T and O_i += P_i V
  for both Q tiles, interleaved so one tile's softmax overlaps the other's GEMMs;
* warp 13, **load**: TMA loads of Q0, Q1 and the walk's K and V tiles into a ring of stages;
* warp 14, **epilogue**: TMA stores of the staged O tiles;
* warp 15 idles (a whole 4th warpgroup keeps the register budgets per warpgroup).

Pipelines (mbarriers): load -> MMA (Q, K/V), MMA -> softmax (S ready / P consumed), softmax ->
correction (row statistics), MMA -> correction (O accumulated / rescaled), correction ->
epilogue (O staged), and softmax 0 -> softmax 1 (turns at the exponentials). Every role walks
the same tiles (``fmha.kernels.common.scheduler``) and the same K/V tiles per tile
(``common/kv_walk.py``).
"""

from typing import Any, NamedTuple, Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, Int64, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from fmha.masking import num_q_tiles

from ..common.scheduler import StaticTileScheduler, TileTableScheduler
from ..common.seqinfo import SequenceInfo
from ..common import sequence_descriptors as seq_desc
from ..common.kv_walk import kv_walk, masked_for_mods
from ..common.layouts import bshd_to_sdhb
from .config import REGISTERS_CORRECTION, REGISTERS_OTHER, REGISTERS_SOFTMAX, BlackwellForwardConfig
from .correction import CorrectionRole
from .softmax import SoftmaxRole
from .tmem import TmemPlan


class WarpRoles:
    SOFTMAX0 = (0, 1, 2, 3)
    SOFTMAX1 = (4, 5, 6, 7)
    CORRECTION = (8, 9, 10, 11)
    MMA = 12
    LOAD = 13
    EPILOGUE = 14
    IDLE = 15
    NUM_WARPS = 16


WARP = 32
WARPGROUP = 128
# named barrier ids (0 is the CTA-wide barrier the DSL uses)
TMEM_ALLOC_BARRIER = 1


class BlackwellAttentionForward(SoftmaxRole, CorrectionRole, seq_desc.SequenceDescriptors):
    """The kernel for one ``BlackwellForwardConfig``; call it (through ``cute.compile``) with the
    tensors and sizes of ``__call__``."""

    def __init__(self, cfg: BlackwellForwardConfig):
        self.cfg = cfg
        self.num_threads = WARP * WarpRoles.NUM_WARPS
        self.q_stages = 2  # Q0 and Q1 of the current tile
        self.epi_stages = 2  # O0 and O1 staged for the TMA store

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
        mSeqDescriptors: Optional[cute.Tensor],
        mErrors: Optional[cute.Tensor],
        mSinks: Optional[cute.Tensor],
        mModTensors: Optional[tuple],
        max_seqlen_q: Int32,
        scale_log2: Float32,
        output_scale: Float32,
        softcap_factor: Optional[Float32],
        window_left: Optional[Int32],
        window_right: Optional[Int32],
        num_ctas: Int32,
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        self.dtype = mQ.element_type
        self.out_dtype = mO.element_type
        varlen = cfg.varlen
        q = bshd_to_sdhb(mQ, varlen)
        k = bshd_to_sdhb(mK, varlen)
        v = bshd_to_sdhb(mV, varlen, d_first=True)  # (D, S, H, B): the MN-major B of P.V
        o = bshd_to_sdhb(mO, varlen)
        d = cfg.head_dim
        self.qk_tiler = (cfg.tile_m, cfg.tile_n, d)
        self.pv_tiler = (cfg.tile_m, d, cfg.tile_n)
        self.tmem = TmemPlan(d, self.dtype.width)

        one_cta = tcgen05.CtaGroup.ONE
        K_MAJOR, MN_MAJOR = tcgen05.OperandMajorMode.K, tcgen05.OperandMajorMode.MN
        tiled_mma_qk = sm100_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_MAJOR, K_MAJOR, Float32, one_cta, self.qk_tiler[:2])
        # P comes from TMEM, K-major (a row of P per TMEM lane)
        tiled_mma_pv = sm100_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_MAJOR, MN_MAJOR, Float32, one_cta, self.pv_tiler[:2],
            tcgen05.OperandSource.TMEM)

        sQ_layout = sm100_utils.make_smem_layout_a(tiled_mma_qk, self.qk_tiler, self.dtype, self.q_stages)
        sK_layout = sm100_utils.make_smem_layout_b(tiled_mma_qk, self.qk_tiler, self.dtype, cfg.kv_stages)
        tP_layout = sm100_utils.make_smem_layout_a(tiled_mma_pv, self.pv_tiler, self.dtype, 1)
        sV_layout = sm100_utils.make_smem_layout_b(tiled_mma_pv, self.pv_tiler, self.dtype, cfg.kv_stages)
        self.epi_tile = (cfg.tile_m, d)
        sO_layout = sm100_utils.make_smem_layout_epi(self.out_dtype, LayoutEnum.ROW_MAJOR, self.epi_tile,
                                                     self.epi_stages)

        load_op = cpasync.CopyBulkTensorTileG2SOp(one_cta)
        tma_q, tma_tensor_q = cute.nvgpu.make_tiled_tma_atom_A(
            load_op, q, cute.select(sQ_layout, mode=[0, 1, 2]), self.qk_tiler, tiled_mma_qk)
        tma_k, tma_tensor_k = cute.nvgpu.make_tiled_tma_atom_B(
            load_op, k, cute.select(sK_layout, mode=[0, 1, 2]), self.qk_tiler, tiled_mma_qk)
        tma_v, tma_tensor_v = cute.nvgpu.make_tiled_tma_atom_B(
            load_op, v, cute.select(sV_layout, mode=[0, 1, 2]), self.pv_tiler, tiled_mma_pv)
        tma_o = tma_tensor_o = None
        if const_expr(cfg.o_via_tma):
            tma_o, tma_tensor_o = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), o, cute.select(sO_layout, mode=[0, 1]), self.epi_tile)
        self.q_bytes = cute.size_in_bytes(self.dtype, cute.select(sQ_layout, mode=[0, 1, 2]))
        self.kv_bytes = cute.size_in_bytes(self.dtype, cute.select(sK_layout, mode=[0, 1, 2]))
        o_elems = cute.cosize(sO_layout) if const_expr(cfg.o_via_tma) else 0

        @cute.struct
        class SharedStorage:
            q_mbar: cute.struct.MemRange[Int64, self.q_stages * 2]
            kv_mbar: cute.struct.MemRange[Int64, cfg.kv_stages * 2]
            s0_mbar: cute.struct.MemRange[Int64, 2]
            s1_mbar: cute.struct.MemRange[Int64, 2]
            stats0_mbar: cute.struct.MemRange[Int64, 2]
            stats1_mbar: cute.struct.MemRange[Int64, 2]
            o_mbar: cute.struct.MemRange[Int64, 2 * 2]
            staged_mbar: cute.struct.MemRange[Int64, self.epi_stages * 2]
            turn_mbar: cute.struct.MemRange[Int64, 2]
            tmem_dealloc_mbar: cute.struct.MemRange[Int64, 1]
            tmem_base: Int32
            sO: cute.struct.Align[cute.struct.MemRange[self.out_dtype, o_elems], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sKV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]

        self.shared_storage = SharedStorage

        num_batches = mCuSeqlensQ.shape[0] - 1 if const_expr(varlen) else q.shape[3]
        seqlen_q = max_seqlen_q if const_expr(varlen) else q.shape[0]
        num_m_blocks = num_q_tiles(seqlen_q, cfg.cta_rows)
        if const_expr(varlen):
            num_tiles = mTileTable.shape[0] * q.shape[2]  # only the row blocks that hold rows
        else:
            num_tiles = num_m_blocks * q.shape[2] * num_batches
        grid_x = num_tiles
        if const_expr(cfg.persistent):
            grid_x = cutlass.min(num_tiles, num_ctas)

        if const_expr(varlen):
            self.describe_sequences(
                tma_q, tma_k, tma_v, None, q, k, v, None, mCuSeqlensQ, mCuSeqlensK, mSeqDescriptors, mErrors,
                max_seqlen_q,  # O: stored from registers for varlen
            ).launch(grid=[num_batches, 1, 1], block=[32, 1, 1], stream=stream)
        self.kernel(
            tiled_mma_qk, tiled_mma_pv,
            tma_q, tma_tensor_q, tma_k, tma_tensor_k, tma_v, tma_tensor_v, tma_o, tma_tensor_o,
            mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mTileTable, mSeqDescriptors, mSinks, mModTensors, num_m_blocks,
            num_batches, scale_log2, output_scale, softcap_factor, window_left, window_right,
            sQ_layout, sK_layout, tP_layout, sV_layout, sO_layout,
        ).launch(
            grid=[grid_x, 1, 1],
            block=[self.num_threads, 1, 1],
            cluster=[1, 1, 1],
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
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        mCuSeqlensQ: Optional[cute.Tensor],
        mCuSeqlensK: Optional[cute.Tensor],
        mTileTable: Optional[cute.Tensor],
        mSeqDescriptors: Optional[cute.Tensor],
        mSinks: Optional[cute.Tensor],
        mModTensors: Optional[tuple],
        num_m_blocks: Int32,
        num_batches: Int32,
        scale_log2: Float32,
        output_scale: Float32,
        softcap_factor: Optional[Float32],
        window_left: Optional[Int32],
        window_right: Optional[Int32],
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        tP_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
    ):
        cfg = self.cfg
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == WarpRoles.LOAD:
            for atom in (tma_q, tma_k, tma_v):
                cpasync.prefetch_descriptor(atom)
            if const_expr(cfg.o_via_tma):
                cpasync.prefetch_descriptor(tma_o)

        storage = SmemAllocator().allocate(self.shared_storage)
        pipes = self.make_pipelines(storage)
        tmem_dealloc_mbar = storage.tmem_dealloc_mbar.data_ptr()
        if warp_idx == WarpRoles.IDLE:
            # the softmax warpgroups and the correction warpgroup are the last to touch TMEM
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(tmem_dealloc_mbar, 3 * WARPGROUP)
        cute.arch.mbarrier_init_fence()
        pipeline.pipeline_init_arrive()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sKV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        # V stages alias K stages: the ring holds whichever the load order put there
        sV = cute.make_tensor(cute.recast_ptr(sK.iterator, sV_layout.inner), sV_layout.outer)
        sO = None
        if const_expr(cfg.o_via_tma):
            sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        scheduler = self.make_scheduler(mTileTable, num_m_blocks, mQ_tma.shape[2], num_batches)
        thr_qk, thr_pv = tiled_mma_qk.get_slice(0), tiled_mma_pv.get_slice(0)
        self.tmem.bind(thr_qk, thr_pv, self.qk_tiler, self.pv_tiler)
        # partitions the softmax and correction roles take, before the MMA warp sets flags on the MMAs
        tScS = thr_qk.partition_C(cute.make_identity_tensor((cfg.tile_m, cfg.tile_n)))
        tOcO = thr_pv.partition_C(cute.make_identity_tensor((cfg.tile_m, cfg.head_dim)))
        tOsO = None
        if const_expr(cfg.o_via_tma):
            tOsO = (thr_pv.partition_C(sO[None, None, 0]), thr_pv.partition_C(sO[None, None, 1]))
        pipeline.pipeline_init_wait()

        if warp_idx == WarpRoles.LOAD:
            cute.arch.setmaxregister_decrease(REGISTERS_OTHER)
            self.load(scheduler, tiled_mma_qk, tiled_mma_pv, mQ_tma, mK_tma, mV_tma, mCuSeqlensQ, mCuSeqlensK,
                      mSeqDescriptors, window_left, window_right, tma_q, tma_k, tma_v, sQ, sK, sV,
                      pipes.q.producer, pipes.kv.producer)
        if warp_idx == WarpRoles.MMA:
            cute.arch.setmaxregister_decrease(REGISTERS_OTHER)
            self.mma(scheduler, tiled_mma_qk, tiled_mma_pv, mQ_tma, mK_tma, mCuSeqlensQ, mCuSeqlensK,
                     window_left, window_right, sQ, sK, sV, tP_layout, storage, tmem_dealloc_mbar, pipes)
        if warp_idx == WarpRoles.EPILOGUE:
            cute.arch.setmaxregister_decrease(REGISTERS_OTHER)
            if const_expr(cfg.o_via_tma):
                self.store_o(scheduler, mQ_tma, mK_tma, tma_o, mO_tma, sO, pipes.staged.consumer)
        if warp_idx == WarpRoles.IDLE:
            cute.arch.setmaxregister_decrease(REGISTERS_OTHER)
        if warp_idx < WarpRoles.CORRECTION[0]:
            cute.arch.setmaxregister_increase(REGISTERS_SOFTMAX)
            tmem_base = self.wait_for_tmem(storage)
            which = warp_idx // 4  # 0: softmax 0, 1: softmax 1 (uniform per warpgroup)
            if which == 0:
                self.softmax(0, scheduler, tScS, tmem_base, mQ_tma, mK_tma, mCuSeqlensQ, mCuSeqlensK, mModTensors,
                             scale_log2, softcap_factor, window_left, window_right, pipes.s0.consumer,
                             pipes.stats0.producer,
                             pipes.turn)
            else:
                self.softmax(1, scheduler, tScS, tmem_base, mQ_tma, mK_tma, mCuSeqlensQ, mCuSeqlensK, mModTensors,
                             scale_log2, softcap_factor, window_left, window_right, pipes.s1.consumer,
                             pipes.stats1.producer,
                             pipes.turn)
            cute.arch.mbarrier_arrive(tmem_dealloc_mbar)
        if warp_idx >= WarpRoles.CORRECTION[0] and warp_idx < WarpRoles.MMA:
            cute.arch.setmaxregister_decrease(REGISTERS_CORRECTION)
            tmem_base = self.wait_for_tmem(storage)
            self.correction(scheduler, tScS, tOcO, tOsO, tmem_base, mQ_tma, mK_tma, mO, mLSE, mSinks, mCuSeqlensQ,
                            mCuSeqlensK, scale_log2, output_scale, window_left, window_right, pipes)
            cute.arch.mbarrier_arrive(tmem_dealloc_mbar)

    def make_pipelines(self, storage) -> "KernelPipelines":
        """The kernel's mbarrier pipelines, as (producer, consumer) participants."""
        cfg = self.cfg
        thread = lambda n: pipeline.CooperativeGroup(pipeline.Agent.Thread, n)  # noqa: E731
        issuer = thread(1)  # TMA transactions and tcgen05 commits arrive once
        warpgroup = thread(WARPGROUP)

        def pair(kind, stages, producer, consumer, mbar, **extra) -> Participants:
            p = kind.create(num_stages=stages, producer_group=producer, consumer_group=consumer,
                            barrier_storage=mbar.data_ptr(), defer_sync=True, **extra)
            return Participants(*p.make_participants())

        return KernelPipelines(
            q=pair(pipeline.PipelineTmaUmma, self.q_stages, issuer, issuer, storage.q_mbar, tx_count=self.q_bytes),
            kv=pair(pipeline.PipelineTmaUmma, cfg.kv_stages, issuer, issuer, storage.kv_mbar,
                    tx_count=self.kv_bytes),
            s0=pair(pipeline.PipelineUmmaAsync, 1, issuer, warpgroup, storage.s0_mbar),
            s1=pair(pipeline.PipelineUmmaAsync, 1, issuer, warpgroup, storage.s1_mbar),
            stats0=pair(pipeline.PipelineAsync, 1, warpgroup, warpgroup, storage.stats0_mbar),
            stats1=pair(pipeline.PipelineAsync, 1, warpgroup, warpgroup, storage.stats1_mbar),
            o=pair(pipeline.PipelineUmmaAsync, 2, issuer, warpgroup, storage.o_mbar),
            staged=pair(pipeline.PipelineAsync, self.epi_stages, warpgroup, thread(WARP), storage.staged_mbar),
            turn=pair(pipeline.PipelineAsync, 1, warpgroup, warpgroup, storage.turn_mbar),
        )

    def make_scheduler(self, mTileTable, num_m_blocks, num_heads, num_batches):
        """The tile walk of this configuration (``scheduler.py``); every role walks it alike."""
        cfg = self.cfg
        if const_expr(cfg.varlen):
            return TileTableScheduler.create(mTileTable, num_heads)
        return StaticTileScheduler.create(num_m_blocks, num_heads, num_batches, cfg.longest_first, cfg.persistent)

    def sequence(self, tile, mQ_tma, mK_tma, mCuSeqlensQ, mCuSeqlensK) -> SequenceInfo:
        return SequenceInfo.create(tile.batch, mQ_tma.shape[0], mK_tma.shape[0], mCuSeqlensQ, mCuSeqlensK)

    def kv_walk(self, m_block, seq: SequenceInfo, window_left, window_right):
        """The K/V tiles this CTA's rows visit (``common/kv_walk.py``): every role walks the same
        tiles for both Q tiles (the MMA warp interleaves their GEMMs on each K/V stage), so the
        walk is over all the CTA's rows; the pipelines expect at least one tile, so a CTA whose
        rows keep no key visits one fully masked tile past the keys."""
        cfg = self.cfg
        walk = kv_walk(m_block, cfg.cta_rows, cfg.tile_n, seq.seqlen_q, seq.seqlen_k, cfg.mask_kind, window_left,
                       window_right, cfg.bottom_right, imin=cutlass.min, imax=cutlass.max,
                       compression=cfg.compression)
        walk = walk.at_least_one_tile(seq.seqlen_k, cfg.tile_n, imin=cutlass.min, imax=cutlass.max)
        return masked_for_mods(walk, cfg.mods)

    @cute.jit
    def wait_for_tmem(self, storage):
        """TMEM's base address, once the MMA warp has allocated it."""
        cute.arch.barrier(barrier_id=TMEM_ALLOC_BARRIER, number_of_threads=WARP + 3 * WARPGROUP)
        return cute.arch.retrieve_tmem_ptr(Float32, alignment=16, ptr_to_buffer_holding_addr=storage.tmem_base)

    # ------------------------------------------------------------------ load warp
    @cute.jit
    def load(self, scheduler, tiled_mma_qk, tiled_mma_pv, mQ_tma, mK_tma, mV_tma, mCuSeqlensQ, mCuSeqlensK,
             mSeqDescriptors, window_left, window_right, tma_q, tma_k, tma_v, sQ, sK, sV,
             q_producer: pipeline.PipelineProducer, kv_producer: pipeline.PipelineProducer):
        """Per tile: Q0, K_0, Q1, V_0, then (K_i, V_i) for the rest of the walk: the order the MMA
        warp waits in."""
        cfg = self.cfg
        thr_qk = tiled_mma_qk.get_slice(0)
        thr_pv = tiled_mma_pv.get_slice(0)
        tile_idx = scheduler.first()
        while tile_idx < scheduler.num_tiles:
            tile = scheduler.decode(tile_idx)
            seq = self.sequence(tile, mQ_tma, mK_tma, mCuSeqlensQ, mCuSeqlensK)
            if tile.m_block * cfg.cta_rows < seq.seqlen_q:
                head_kv = tile.head // (mQ_tma.shape[2] // mK_tma.shape[2])
                desc_q = desc_k = desc_v = None  # None: the descriptor built into the TMA atom
                if const_expr(cfg.varlen):
                    # this sequence's own descriptors: rows relative to its first, TMA stops at its last
                    desc_q = seq_desc.acquire_descriptor(mSeqDescriptors, tile.batch, seq_desc.Q)
                    desc_k = seq_desc.acquire_descriptor(mSeqDescriptors, tile.batch, seq_desc.K)
                    desc_v = seq_desc.acquire_descriptor(mSeqDescriptors, tile.batch, seq_desc.V)
                row_batch = Int32(0) if const_expr(cfg.varlen) else tile.batch
                gQ = cute.flat_divide(mQ_tma[None, None, tile.head, row_batch], cute.select(self.qk_tiler, mode=[0, 2]))
                gK = cute.flat_divide(mK_tma[None, None, head_kv, row_batch], cute.select(self.qk_tiler, mode=[1, 2]))
                gV = cute.flat_divide(mV_tma[None, None, head_kv, row_batch], cute.select(self.pv_tiler, mode=[1, 2]))
                tQsQ, tQgQ = self.tma_tiles(tma_q, sQ, thr_qk.partition_A(gQ))
                tKsK, tKgK = self.tma_tiles(tma_k, sK, thr_qk.partition_B(gK))
                tVsV, tVgV = self.tma_tiles(tma_v, sV, thr_pv.partition_B(gV))
                walk = self.kv_walk(tile.m_block, seq, window_left, window_right)
                q_tile0 = 2 * tile.m_block

                q_producer = self.load_one(q_producer, tma_q, tQgQ[None, q_tile0, 0], tQsQ, desc_q)
                kv_producer = self.load_one(kv_producer, tma_k, tKgK[None, walk.block(0), 0], tKsK, desc_k)
                q_producer = self.load_one(q_producer, tma_q, tQgQ[None, q_tile0 + 1, 0], tQsQ, desc_q)
                kv_producer = self.load_one(kv_producer, tma_v, tVgV[None, 0, walk.block(0)], tVsV, desc_v)
                for i in cutlass.range(1, walk.total, unroll=1):
                    n_block = walk.block(i)
                    kv_producer = self.load_one(kv_producer, tma_k, tKgK[None, n_block, 0], tKsK, desc_k)
                    kv_producer = self.load_one(kv_producer, tma_v, tVgV[None, 0, n_block], tVsV, desc_v)
            tile_idx, _ = scheduler.producer_next(tile_idx, None)

    @staticmethod
    def tma_tiles(atom, smem, gmem_mma):
        """(shared, global) views for TMA of an MMA-partitioned operand: the first three modes
        (MMA, rest M/N, rest K) are one TMA box."""
        return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(smem, 0, 3),
                                     cute.group_modes(gmem_mma, 0, 3))

    @cute.jit
    def load_one(self, producer: pipeline.PipelineProducer, atom, src, dst_stages, desc):
        """TMA-load one tile into the next free stage; returns the advanced producer for the
        caller to rebind (pipeline state carried by a loop must be a local of that loop)."""
        handle = producer.acquire_and_advance()
        cute.copy(atom, src, dst_stages[None, handle.index], tma_bar_ptr=handle.barrier, tma_desc_ptr=desc)
        return producer

    # ------------------------------------------------------------------ MMA warp
    @cute.jit
    def mma(self, scheduler, tiled_mma_qk, tiled_mma_pv, mQ_tma, mK_tma, mCuSeqlensQ, mCuSeqlensK,
            window_left, window_right, sQ, sK, sV, tP_layout, storage, tmem_dealloc_mbar, pipes):
        """Allocate TMEM; per tile: S0 = Q0 K_0^T, S1 = Q1 K_0^T, O0 = P0 V_0, then per K/V tile i
        >= 1: S0 = Q0 K_i^T, O1 += P1 V_{i-1}, S1 = Q1 K_i^T, O0 += P0 V_i; last O1 += P1 V_last.
        Each GEMM waits for its inputs (TMA stages, P from softmax) and for O's correction."""
        cfg = self.cfg
        cute.arch.alloc_tmem(Int32(cfg.tmem_columns), storage.tmem_base)
        cute.arch.barrier(barrier_id=TMEM_ALLOC_BARRIER, number_of_threads=WARP + 3 * WARPGROUP)
        tmem_base = cute.arch.retrieve_tmem_ptr(Float32, alignment=16, ptr_to_buffer_holding_addr=storage.tmem_base)
        thr_qk = tiled_mma_qk.get_slice(0)
        thr_pv = tiled_mma_pv.get_slice(0)
        tSrQ = thr_qk.make_fragment_A(sQ)
        tSrK = thr_qk.make_fragment_B(sK)
        tOrV = thr_pv.make_fragment_B(sV)
        self.tmem.bind_p(thr_pv, tmem_base, tP_layout)
        q_consumer, kv_consumer = pipes.q.consumer, pipes.kv.consumer
        s0_producer, s1_producer, o_producer = pipes.s0.producer, pipes.s1.producer, pipes.o.producer

        tile_idx = scheduler.first()
        while tile_idx < scheduler.num_tiles:
            tile = scheduler.decode(tile_idx)
            seq = self.sequence(tile, mQ_tma, mK_tma, mCuSeqlensQ, mCuSeqlensK)
            if tile.m_block * cfg.cta_rows < seq.seqlen_q:
                walk = self.kv_walk(tile.m_block, seq, window_left, window_right)
                tStS0, tStS1, tOtO0, tOtO1, tOrP0, tOrP1 = self.mma_tmem_views(storage)
                q0 = q_consumer.wait_and_advance()
                k_stage = kv_consumer.wait_and_advance()
                s0 = s0_producer.acquire_and_advance()
                tiled_mma_qk = self.gemm(tiled_mma_qk, tStS0, tSrQ[None, None, None, q0.index], tSrK[None, None, None, k_stage.index],
                          False)
                s0.commit()
                q1 = q_consumer.wait_and_advance()
                s1 = s1_producer.acquire_and_advance()
                tiled_mma_qk = self.gemm(tiled_mma_qk, tStS1, tSrQ[None, None, None, q1.index], tSrK[None, None, None, k_stage.index],
                          False)
                s1.commit()
                k_stage.release()

                v_stage = kv_consumer.wait_and_advance()
                o0 = o_producer.acquire_and_advance()
                s0 = s0_producer.acquire_and_advance()  # P0 written
                tiled_mma_pv = self.gemm(tiled_mma_pv, tOtO0, tOrP0, tOrV[None, None, None, v_stage.index], False)
                o0.commit()
                o1_accumulates = cutlass.Boolean(False)
                for _ in cutlass.range(1, walk.total, unroll=1):
                    tStS0, tStS1, tOtO0, tOtO1, tOrP0, tOrP1 = self.mma_tmem_views(storage)
                    k_stage = kv_consumer.wait_and_advance()
                    # S0's columns are free: P0 was read by the P.V above, issued earlier in order
                    tiled_mma_qk = self.gemm(tiled_mma_qk, tStS0, tSrQ[None, None, None, q0.index],
                              tSrK[None, None, None, k_stage.index], False)
                    s0.commit()
                    o1 = o_producer.acquire_and_advance()
                    s1 = s1_producer.acquire_and_advance()  # P1 written
                    tiled_mma_pv = self.gemm(tiled_mma_pv, tOtO1, tOrP1, tOrV[None, None, None, v_stage.index], o1_accumulates)
                    o1_accumulates = cutlass.Boolean(True)
                    o1.commit()
                    v_stage.release()
                    tiled_mma_qk = self.gemm(tiled_mma_qk, tStS1, tSrQ[None, None, None, q1.index],
                              tSrK[None, None, None, k_stage.index], False)
                    s1.commit()
                    k_stage.release()
                    v_stage = kv_consumer.wait_and_advance()
                    o0 = o_producer.acquire_and_advance()
                    s0 = s0_producer.acquire_and_advance()  # P0 written
                    tiled_mma_pv = self.gemm(tiled_mma_pv, tOtO0, tOrP0, tOrV[None, None, None, v_stage.index], True)
                    o0.commit()
                q0.release()
                q1.release()
                tStS0, tStS1, tOtO0, tOtO1, tOrP0, tOrP1 = self.mma_tmem_views(storage)
                o1 = o_producer.acquire_and_advance()
                s1 = s1_producer.acquire_and_advance()  # P1 written
                tiled_mma_pv = self.gemm(tiled_mma_pv, tOtO1, tOrP1, tOrV[None, None, None, v_stage.index], o1_accumulates)
                o1.commit()
                v_stage.release()
                # the softmax warpgroups wait for these to write their final statistics into S's columns
                s0.commit()
                s1.commit()
            tile_idx, _ = scheduler.consumer_next(tile_idx, None)

        cute.arch.relinquish_tmem_alloc_permit()
        cute.arch.mbarrier_wait(tmem_dealloc_mbar, 0)
        cute.arch.dealloc_tmem(tmem_base, Int32(cfg.tmem_columns))

    def mma_tmem_views(self, storage):
        """S0, S1, O0, O1, P0, P1 from TMEM's base address read again from shared memory: taken
        where they are used, so that ptxas does not keep every k-block's address of them live
        across the loops (they overflowed the uniform registers into local memory)."""
        tmem_base = cute.arch.retrieve_tmem_ptr(Float32, alignment=16,
                                                ptr_to_buffer_holding_addr=storage.tmem_base)
        return (*self.tmem.s_tiles(tmem_base), *self.tmem.o_tiles(tmem_base), *self.tmem.p_operands(tmem_base))

    @cute.jit
    def gemm(self, tiled_mma, acc, a, b, accumulate):
        """acc (+)= a b over the K blocks of one tile; ``accumulate`` (dynamic or static) for the
        first block."""
        # a rolled loop: unrolled, ptxas keeps every k-block's operand descriptors live across the
        # tile loops, more than the uniform registers hold
        for kb in cutlass.range(cute.size(a, mode=[2]), unroll=1):
            tiled_mma.set(tcgen05.Field.ACCUMULATE, (kb != 0) | cutlass.Boolean(accumulate))
            cute.gemm(tiled_mma, acc, a[None, None, kb], b[None, None, kb], acc)
        return tiled_mma  # rebound by the caller: its accumulate flag is loop-carried state


class Participants(NamedTuple):
    """A pipeline's producer and consumer participants."""

    producer: Any
    consumer: Any


class KernelPipelines(NamedTuple):
    """The kernel's pipelines (docs/blackwell.md, "Pipelines")."""

    q: Participants  # load -> MMA: Q0, Q1 loaded / free after the tile's last Q K^T
    kv: Participants  # load -> MMA: a K or V tile loaded / its GEMMs done
    s0: Participants  # MMA -> softmax 0: S0 computed / P0 written (S0's columns free again)
    s1: Participants  # MMA -> softmax 1: likewise
    stats0: Participants  # softmax 0 -> correction: (old, new) max per step, (sum, max) after the last
    stats1: Participants  # softmax 1 -> correction: likewise
    o: Participants  # MMA -> correction: O0, O1 in turn, P V added / O rescaled
    staged: Participants  # correction -> epilogue warp: O0, O1 in shared memory / stored
    turn: Participants  # softmax 0 -> softmax 1: turns at the exponentials (the MUFU units are shared)
