"""Hopper (SM90) fused attention forward, warp specialized.

Roles (one CTA works on one query tile of 64 rows per consumer warpgroup at a time):

* warpgroup 0, the **producer**: its first warp issues TMA loads of the Q tile and of the K and V
  tiles into a ring of shared-memory stages (one mbarrier pipeline; K and V tiles take stages in
  the order the consumers wait for them). It gives most of its registers away (setmaxnreg).
* warpgroups 1..n (n = 2, or 3 for head dim 64), the **consumers**: one tiled ``wgmma`` over
  all, each warpgroup owning 64 query rows. Per K/V tile: S = Q K^T (both operands in shared
  memory), mask if the tile is partially kept, online softmax in registers, P converted in
  registers and used directly as the A operand of O += P V. The default mainloop is software
  pipelined (the S GEMM of tile n+1 and the P.V GEMM of tile n run under the softmax of tile n+1)
  and the warpgroups take turns issuing GEMMs; the K/V loops live in ``mainloop.py``. After the
  last tile: normalize, write O and LSE (``epilogue``: O through shared memory and a TMA store
  where it can, ``epilogue.py``).

K/V tiles the mask leaves empty are never loaded; only the boundary tiles pay for element-wise
masking (``fmha.masking.kv_tile_schedule``, shared with the host and the tests).

Varlen: the host lists the query tiles that exist (``fmha.work_tiles``), and a small kernel run
first gives every sequence its own TMA descriptors (``describe_sequences``), so no load crosses
into a neighbouring sequence. fp8: V arrives key-major from ``v_staging`` and P is fed to the
P.V product in the fp8 A-operand order (``as_operand_a_fp8``).
"""

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum
from cutlass.tensor_utils import TensorMapManager, TensorMapUpdateMode

from fmha.masking import MaskKind, kv_tile_schedule, later_rows_cost_more, num_q_tiles

from ..common.fragments import as_rows_cols, fp8_operand_a_shape
from ..common.mask import FragmentMask
from ..common.scheduler import ClaimingTileScheduler, StaticTileScheduler, TileTableScheduler
from ..common.softmax import MAX_SLACK, OnlineSoftmax
from . import L2_BYTES
from .epilogue import drain_o_stores, store_lse, store_o_direct, store_o_tma, wg_slice_layout
from .mainloop import TURN_BARRIER, ConsumerMainloops
from .wgmma import WARPGROUP_THREADS as _WG

# Named barriers (0 is __syncthreads), one per consumer warpgroup and purpose:
# 1, 2 (, 3): the consumer warpgroups' turns to issue GEMMs (``mainloop.TURN_BARRIER``);
# 4, 5 (, 6): a warpgroup's O rows are staged in shared memory (``epilogue.store_o_tma``).
_O_STAGED_BARRIER = TURN_BARRIER + 3
# Entries of the claimed-tile hand-off (``claim_tiles``): one per tile a CTA holds at once (the
# current one and, with two Q buffers, the next).
_CLAIM_STAGES = 2


def _bshd_to_sdhb(t: cute.Tensor, varlen: bool, d_first: bool = False) -> cute.Tensor:
    """(B, S, H, D) or varlen (T, H, D) -> (S, D, H, B) (or (D, S, H, B) with ``d_first``);
    varlen gets a batch mode of extent 1: sequences are found through cu_seqlens instead."""
    lay = t.layout
    if const_expr(varlen):
        s, h, d = 0, 1, 2
        shape = (lay.shape[s], lay.shape[d], lay.shape[h], 1)
        stride = (lay.stride[s], lay.stride[d], lay.stride[h], 0)
        lay = cute.make_layout(shape, stride=stride)
    else:
        lay = cute.select(lay, mode=[1, 3, 2, 0])
    if const_expr(d_first):
        lay = cute.select(lay, mode=[1, 0, 2, 3])
    return cute.make_tensor(t.iterator, lay)


class HopperAttentionForward(ConsumerMainloops):
    def __init__(
        self,
        head_dim: int,
        mask_kind: MaskKind,
        window_left_bounded: bool,
        window_right_bounded: bool,
        bottom_right: bool,
        varlen: bool,
        persistent: bool,
        tile_m: int = 128,
        tile_n: int = 128,
        kv_stages: int = 4,
        q_stages: int = 1,
        overlap: bool = True,
        pingpong: bool = True,
        v_staged: bool = False,
        serial_max_tiles: int = 0,
        l2_sections: bool = False,
        rescale_before_pv: bool = False,
        softmax_chains: tuple = (1, 1),
        late_k_release: bool = True,
        mask_bits: bool = True,
        tma_store_o: bool = False,
        separate_o_buffer: bool = False,
        lazy_rescale: bool = False,
        claim_tiles: bool = False,
        drop_phases: tuple = (),
        speculative_exp: bool = False,
        p_buffers: int = 1,
    ):
        assert tile_m % 64 == 0 and tile_n % 16 == 0
        self.head_dim = head_dim
        self.mask_kind = mask_kind
        self.window_left_bounded = window_left_bounded
        self.window_right_bounded = window_right_bounded
        self.bottom_right = bottom_right
        self.varlen = varlen
        self.persistent = persistent
        self.tile_m = tile_m
        self.tile_n = tile_n
        # K and V share one ring; K_n, V_n occupy two consecutive stages.
        self.kv_stages = kv_stages
        # Q buffers: with two, a persistent CTA loads the next tile's Q during the current tile.
        self.q_stages = q_stages
        # fp8: V arrives key-major and batched, (B, H_k, D, S_pad), from v_staging.stage_v_fp8.
        self.v_staged = v_staged
        # overlap: the S GEMM of tile n+1 and the P.V GEMM of tile n run while the softmax of
        # tile n+1 computes. pingpong: the consumer warpgroups take turns (round robin) issuing
        # GEMMs, so one's softmax hides under another's tensor-core work.
        self.overlap = overlap
        self.pingpong = pingpong and overlap and tile_m // 64 >= 2
        # Rows that visit at most this many K/V tiles take the serial mainloop (0: always
        # overlapped, the library's choice since the overlapped loop's prologue and epilogue got
        # cheaper; docs/PERFORMANCE.md items 6 and 18). Kept for the benchmark's variants.
        self.serial_max_tiles = serial_max_tiles if overlap else 0
        # Causal-like masks: walk the tiles sorted by cost (last query tile first) in sections of
        # heads whose K/V fit L2 (``cost_sorted_tile``). Persistent: dealt as a snake; one CTA per
        # tile: the hardware hands the sorted tiles to SMs as they free up.
        self.l2_sections = l2_sections and not varlen
        # Overlapped loop: scale O by the previous tile's correction while the S GEMM runs, just
        # before issuing the P.V GEMM, instead of after the softmax.
        self.rescale_before_pv = rescale_before_pv and overlap
        # Independent chains per row for the softmax's max and sum (OnlineSoftmax.update).
        self.softmax_chains = softmax_chains
        # The running max may lag (OnlineSoftmax.max_slack): O is rescaled only when it moves.
        self.max_slack = MAX_SLACK if lazy_rescale else 0.0
        # With a stale max, the overlapped loop's exponentials run against the max a row already
        # has while the tile's max is found alongside (``OnlineSoftmax.update_against_kept_max``;
        # a warp whose rows moved beyond the slack redoes its tile), and P goes into the other of
        # two fragments. Measured, not a default (docs/PERFORMANCE.md, item 22).
        self.speculative_exp = speculative_exp and lazy_rescale and overlap
        # P in two fragments taken in turns (``mainloop_two_p``): 16-bit inputs, overlapped loop
        # (fp8 keeps ``mainloop_overlapped``).
        self.two_p = (p_buffers == 2 or self.speculative_exp) and overlap
        # Overlapped loop: release K_n after the softmax (``overlapped_step``).
        self.late_k_release = late_k_release and overlap
        # Masked tiles: per-thread column bit masks instead of two compares per score.
        self.mask_bits = mask_bits
        # O staged in shared memory and written by TMA (``epilogue.store_o_tma``); needs a
        # fixed-length batch (TMA clips at the tensor's end, not at a sequence's), a 16-bit
        # output, and, staged in the Q buffer, the input's type (``__call__``: ``o_via_tma``).
        self.tma_store_o = tma_store_o and not varlen
        # O's own shared-memory buffer instead of the tile's Q buffer (the host's choice: where
        # shared memory has room for it beside a full K/V ring).
        self.separate_o_buffer = separate_o_buffer and self.tma_store_o
        self.num_consumer_wgs = tile_m // 64
        self.num_threads = _WG * (1 + self.num_consumer_wgs)
        # setmaxnreg budgets: the producer warpgroup gives registers to the consumers; the sums
        # fit the 64K-register file (e.g. 128 * 24 + 256 * 240 <= 65536).
        self.producer_regs, self.consumer_regs = {1: (56, 256), 2: (24, 240), 3: (32, 160)}[
            self.num_consumer_wgs]
        # Causal-like masks give later query tiles more work: start those first.
        self.longest_first = later_rows_cost_more(mask_kind, window_left_bounded)
        # Persistent CTAs claim their tiles one at a time, in the one-CTA-per-tile order
        # (``ClaimingTileScheduler``); the producer hands each claim to the consumers.
        self.claim_tiles = claim_tiles and persistent and not varlen
        # Timing experiments only (``scripts/phase_costs.py``; wrong results): softmax phases
        # left out ("max", "exp", "sum": ``OnlineSoftmax.drop``), "rescale" (O is never
        # rescaled) and "pack" (P is not converted: the P.V GEMM reads a stale fragment).
        self.drop_phases = tuple(drop_phases)

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
        mTileCounter: Optional[cute.Tensor],
        max_seqlen_q: Int32,
        scale_log2: Float32,
        output_scale: Float32,
        window_left: Optional[Int32],
        window_right: Optional[Int32],
        num_ctas: Int32,
        stream: cuda.CUstream,
    ):
        self.dtype = mQ.element_type
        self.out_dtype = mO.element_type
        self.o_via_tma = self.tma_store_o and self.out_dtype.width == 16 and (
            self.separate_o_buffer or self.out_dtype == self.dtype)
        self.o_in_q_buffer = self.o_via_tma and not self.separate_o_buffer
        self.o_in_own_buffer = self.o_via_tma and self.separate_o_buffer
        varlen = self.varlen
        q = _bshd_to_sdhb(mQ, varlen)
        k = _bshd_to_sdhb(mK, varlen)
        if const_expr(self.v_staged):
            # (B, H, D, S) -> (D, S, H, B), keys contiguous: the K-major B of P.V (fp8 needs it)
            v = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[2, 3, 1, 0]))
            v_major, v_smem_major = cute.nvgpu.OperandMajorMode.K, LayoutEnum.ROW_MAJOR
        else:
            v = _bshd_to_sdhb(mV, varlen, d_first=True)  # (D, S, H, B): the MN-major B of P.V
            v_major, v_smem_major = cute.nvgpu.OperandMajorMode.MN, LayoutEnum.COL_MAJOR
        d = self.head_dim
        tile_m, tile_n = self.tile_m, self.tile_n

        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
            Float32, (self.num_consumer_wgs, 1, 1), (64, tile_n),
        )
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, v_major,
            Float32, (self.num_consumer_wgs, 1, 1), (64, d), warpgroup.OperandSource.RMEM,
        )
        sQ_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (tile_m, tile_n, d), self.dtype, self.q_stages)
        sK_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (tile_m, tile_n, d), self.dtype, self.kv_stages)
        sV_layout = sm90_utils.make_smem_layout_b(v_smem_major, (tile_m, d, tile_n), self.dtype, self.kv_stages)

        load_op = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tma_tensor_q = cpasync.make_tiled_tma_atom(
            load_op, q, cute.select(sQ_layout, mode=[0, 1]), (tile_m, d))
        tma_k, tma_tensor_k = cpasync.make_tiled_tma_atom(
            load_op, k, cute.select(sK_layout, mode=[0, 1]), (tile_n, d))
        tma_v, tma_tensor_v = cpasync.make_tiled_tma_atom(
            load_op, v, cute.select(sV_layout, mode=[0, 1]), (d, tile_n))
        # O as staged for the TMA store: the Q tile's layout, in the output type.
        sO_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (tile_m, tile_n, d), self.out_dtype, 1)
        tma_o = tma_tensor_o = None
        if const_expr(self.o_via_tma):
            o_wg_layout = wg_slice_layout(cute.select(sO_layout, mode=[0, 1]), tile_m, d)
            tma_o, tma_tensor_o = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), _bshd_to_sdhb(mO, varlen), o_wg_layout, (64, d))
        self.q_bytes = cute.size_in_bytes(self.dtype, cute.select(sQ_layout, mode=[0, 1]))
        self.kv_bytes = cute.size_in_bytes(self.dtype, cute.select(sK_layout, mode=[0, 1]))

        ring_elems = cute.cosize(sK_layout)
        o_elems = cute.cosize(sO_layout) if const_expr(self.o_in_own_buffer) else 0

        @cute.struct
        class SharedStorage:
            q_mbar: cute.struct.MemRange[cutlass.Int64, self.q_stages * 2]
            kv_mbar: cute.struct.MemRange[cutlass.Int64, self.kv_stages * 2]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sKV: cute.struct.Align[cute.struct.MemRange[self.dtype, ring_elems], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[self.out_dtype, o_elems], 1024]
            # claimed tiles on their way from the producer to the consumers (``claim_tiles``)
            tile_mbar: cute.struct.MemRange[cutlass.Int64, _CLAIM_STAGES * 2 if self.claim_tiles else 0]
            next_tile: cute.struct.MemRange[Int32, _CLAIM_STAGES if self.claim_tiles else 0]

        self.shared_storage = SharedStorage

        num_batches = mCuSeqlensQ.shape[0] - 1 if const_expr(varlen) else q.shape[3]
        seqlen_q = max_seqlen_q if const_expr(varlen) else q.shape[0]
        num_m_blocks = num_q_tiles(seqlen_q, tile_m)
        if const_expr(varlen):
            num_tiles = mTileTable.shape[0] * q.shape[2]  # only the query tiles that hold rows
        else:
            num_tiles = num_m_blocks * q.shape[2] * num_batches
        grid_x = num_tiles
        if const_expr(self.persistent):
            grid_x = cutlass.min(num_tiles, num_ctas)

        if const_expr(varlen):
            # One TMA descriptor per sequence and tensor, bounded to that sequence's rows: a tile
            # that runs past a sequence's end is zero-filled by TMA instead of reading the
            # neighbour's rows (whose V would turn P = 0 into 0 * NaN if it held NaN or inf).
            self.describe_sequences(
                tma_q, tma_k, tma_v, q, k, v, mCuSeqlensQ, mCuSeqlensK, mSeqDescriptors,
            ).launch(grid=[num_batches, 1, 1], block=[32, 1, 1], stream=stream)
        self.kernel(
            tiled_mma_qk, tiled_mma_pv,
            tma_q, tma_tensor_q, tma_k, tma_tensor_k, tma_v, tma_tensor_v, tma_o, tma_tensor_o,
            q, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mTileTable, mSeqDescriptors, mTileCounter, num_m_blocks,
            num_batches,
            scale_log2, output_scale, window_left, window_right,
            sQ_layout, sK_layout, sV_layout, sO_layout,
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
        mSeqDescriptors: Optional[cute.Tensor],
        mTileCounter: Optional[cute.Tensor],
        num_m_blocks: Int32,
        num_batches: Int32,
        scale_log2: Float32,
        output_scale: Float32,
        window_left: Optional[Int32],
        window_right: Optional[Int32],
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_v):
                cpasync.prefetch_descriptor(atom)
            if const_expr(self.o_via_tma):
                cpasync.prefetch_descriptor(tma_o)

        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
        one_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        # TMA pipelines count one arrival per consumer warp on release.
        consumer_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_consumer_wgs * 4)
        # With O staged in the Q buffer, one thread per warpgroup frees it, after the TMA store.
        q_releasers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_consumer_wgs) \
            if const_expr(self.o_in_q_buffer) else consumer_warps
        q_producer, q_consumer = pipeline.PipelineTmaAsync.create(
            num_stages=self.q_stages, producer_group=one_thread, consumer_group=q_releasers,
            tx_count=self.q_bytes, barrier_storage=storage.q_mbar.data_ptr(), defer_sync=True,
        ).make_participants()
        kv_producer, kv_consumer = pipeline.PipelineTmaAsync.create(
            num_stages=self.kv_stages, producer_group=one_thread, consumer_group=consumer_warps,
            tx_count=self.kv_bytes, barrier_storage=storage.kv_mbar.data_ptr(), defer_sync=True,
        ).make_participants()
        claim_producer = claim_consumer = sNextTile = None
        if const_expr(self.claim_tiles):
            sNextTile = storage.next_tile.get_tensor(cute.make_layout(_CLAIM_STAGES))
            # Read by every consumer thread before it releases the entry (each one's arrive
            # orders its own read before the producer's next write there).
            claim_producer, claim_consumer = pipeline.PipelineAsync.create(
                num_stages=_CLAIM_STAGES, producer_group=one_thread,
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_consumer_wgs * _WG),
                barrier_storage=storage.tile_mbar.data_ptr(), defer_sync=True,
            ).make_participants()
        pipeline.pipeline_init_arrive()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sKV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        # V stages alias K stages: the ring holds whichever the schedule put there.
        sV = cute.make_tensor(cute.recast_ptr(sK.iterator, sV_layout.inner), sV_layout.outer)
        sO = None
        if const_expr(self.o_in_own_buffer):
            sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)[None, None, 0]

        if const_expr(self.varlen):
            scheduler = TileTableScheduler.create(mTileTable, mQ_sdhb.shape[2])
        elif const_expr(self.claim_tiles):
            scheduler = ClaimingTileScheduler.create(
                num_m_blocks, mQ_sdhb.shape[2], num_batches, self.longest_first, mTileCounter)
        else:
            section = None
            if const_expr(self.l2_sections):
                # Heads-batches whose K/V fill half the L2, so that the tiles in flight (one
                # section, or the ends of two) keep their K/V there.
                group = mQ_sdhb.shape[2] // mK_tma.shape[2]
                kv_bytes_per_key = self.head_dim * 2 * (self.dtype.width // 8)
                kv_heads = cutlass.max(L2_BYTES // 2 // kv_bytes_per_key // mK_tma.shape[0], 1)
                section = kv_heads * group
            scheduler = StaticTileScheduler.create(
                num_m_blocks, mQ_sdhb.shape[2], num_batches, self.longest_first, self.persistent, section)
        pipeline.pipeline_init_wait()

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.producer(
                    scheduler, mQ_tma, mK_tma, mV_tma, mQ_sdhb, mCuSeqlensQ, mCuSeqlensK, mSeqDescriptors,
                    window_left, window_right, tma_q, tma_k, tma_v, sQ, sK, sV,
                    q_producer, kv_producer, claim_producer, sNextTile,
                )
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self.consumer(
                scheduler, tiled_mma_qk, tiled_mma_pv, mQ_sdhb, mK_tma, mO, mLSE, tma_o, mO_tma,
                mCuSeqlensQ, mCuSeqlensK, scale_log2, output_scale, window_left, window_right,
                sQ, sK, sV, sO, q_consumer, kv_consumer, claim_consumer, sNextTile, tidx - _WG,
            )

    @cute.jit
    def sequence_bounds(self, batch, seqlen_q_static, seqlen_k_static,
                        mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor]):
        """(first row of the sequence in the token dim, length) for q and for k."""
        offset_q, seqlen_q = Int32(0), seqlen_q_static
        offset_k, seqlen_k = Int32(0), seqlen_k_static
        if const_expr(self.varlen):
            offset_q = mCuSeqlensQ[batch]
            seqlen_q = mCuSeqlensQ[batch + 1] - offset_q
            offset_k = mCuSeqlensK[batch]
            seqlen_k = mCuSeqlensK[batch + 1] - offset_k
        return offset_q, seqlen_q, offset_k, seqlen_k

    def takes_serial_loop(self, sched):
        """Whether this tile runs ``mainloop_serial`` (else ``mainloop_overlapped``); the producer
        fills the ring in the order that loop waits in, so both ask here. Per tile (dynamic) when
        short rows take the serial loop, else fixed by ``overlap``."""
        if const_expr(self.serial_max_tiles > 0):
            return sched.total <= self.serial_max_tiles
        return not self.overlap

    def tile_schedule(self, m_block, seqlen_q, seqlen_k, window_left, window_right):
        return kv_tile_schedule(
            m_block, self.tile_m, self.tile_n, seqlen_q, seqlen_k, self.mask_kind,
            window_left, window_right, self.bottom_right, imin=cutlass.min, imax=cutlass.max,
        )

    # ------------------------------------------------------------------ varlen descriptors
    @staticmethod
    def sequence_descriptor(mSeqDescriptors: cute.Tensor, batch, which: int, for_copy: bool = True):
        """Pointer to the 128-byte TMA descriptor of sequence ``batch`` for q (0), k (1), v (2):
        generic for the TMA loads that use it, global for the ops that write it."""
        manager = TensorMapManager(TensorMapUpdateMode.GMEM, 128)
        space = cute.AddressSpace.generic if for_copy else cute.AddressSpace.gmem
        return manager.get_tensormap_ptr(mSeqDescriptors[batch, which, None].iterator, space)

    @cute.kernel
    def describe_sequences(self, tma_q: cute.CopyAtom, tma_k: cute.CopyAtom, tma_v: cute.CopyAtom,
                           q: cute.Tensor, k: cute.Tensor, v: cute.Tensor,
                           mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor,
                           mSeqDescriptors: cute.Tensor):
        """One warp per sequence: copy each TMA atom's descriptor and narrow it to the sequence
        (base address at its first row, extent its length). Runs before the attention kernel on
        the same stream, so the descriptors never change while loads use them."""
        batch = Int32(cute.arch.block_idx()[0])
        offset_q = mCuSeqlensQ[batch]
        offset_k = mCuSeqlensK[batch]
        # An empty sequence is never loaded from; extent 1 keeps its descriptor well formed.
        len_q = cutlass.max(mCuSeqlensQ[batch + 1] - offset_q, 1)
        len_k = cutlass.max(mCuSeqlensK[batch + 1] - offset_k, 1)
        q_seq = cute.make_tensor(q.iterator + offset_q * q.layout.stride[0], cute.make_layout(
            (len_q, q.shape[1], q.shape[2], q.shape[3]), stride=q.layout.stride))
        k_seq = cute.make_tensor(k.iterator + offset_k * k.layout.stride[0], cute.make_layout(
            (len_k, k.shape[1], k.shape[2], k.shape[3]), stride=k.layout.stride))
        targets = [(tma_q, q_seq, 0), (tma_k, k_seq, 1)]
        if const_expr(not self.v_staged):
            v_seq = cute.make_tensor(v.iterator + offset_k * v.layout.stride[1], cute.make_layout(
                (v.shape[0], len_k, v.shape[2], v.shape[3]), stride=v.layout.stride))
            targets.append((tma_v, v_seq, 2))
        for atom, tensor, which in targets:
            ptr = self.sequence_descriptor(mSeqDescriptors, batch, which, for_copy=False)
            with cute.arch.elect_one():
                cpasync.copy_tensormap(atom, ptr)
            cute.arch.sync_warp()
            cute.arch.fence_acq_rel_cta()
            cpasync.update_tma_descriptor(atom, tensor, ptr)
            cute.arch.sync_warp()
        cpasync.fence_tma_desc_release()

    # ------------------------------------------------------------------ producer warp
    @cute.jit
    def producer(
        self, scheduler, mQ_tma, mK_tma, mV_tma, mQ_sdhb,
        mCuSeqlensQ, mCuSeqlensK, mSeqDescriptors, window_left, window_right,
        tma_q, tma_k, tma_v, sQ, sK, sV,
        q_producer: pipeline.PipelineProducer, kv_producer: pipeline.PipelineProducer,
        claim_producer: Optional[pipeline.PipelineProducer], sNextTile: Optional[cute.Tensor],
    ):
        tile_idx = scheduler.first()
        num_tiles = scheduler.num_tiles
        while tile_idx < num_tiles:
            m_block, head, batch = scheduler.decode(tile_idx)
            offset_q, seqlen_q, offset_k, seqlen_k = self.sequence_bounds(
                batch, mQ_sdhb.shape[0], mK_tma.shape[0], mCuSeqlensQ, mCuSeqlensK)
            if m_block * self.tile_m < seqlen_q:
                head_kv = head // (mQ_tma.shape[2] // mK_tma.shape[2])
                desc_q = desc_k = desc_v = None  # None: the descriptor built into the TMA atom
                if const_expr(self.varlen):
                    # This sequence's own descriptors (describe_sequences): coordinates are
                    # relative to its first row and TMA stops at its last.
                    desc_q = self.sequence_descriptor(mSeqDescriptors, batch, 0)
                    desc_k = self.sequence_descriptor(mSeqDescriptors, batch, 1)
                    cpasync.fence_tma_desc_acquire(desc_q)
                    cpasync.fence_tma_desc_acquire(desc_k)
                    if const_expr(not self.v_staged):
                        desc_v = self.sequence_descriptor(mSeqDescriptors, batch, 2)
                        cpasync.fence_tma_desc_acquire(desc_v)
                # varlen tensors have one batch row, the packed tokens; staged V has one per sequence
                row_batch = Int32(0) if const_expr(self.varlen) else batch
                mQ_cur = mQ_tma[None, None, head, row_batch]
                mK_cur = mK_tma[None, None, head_kv, row_batch]
                mV_cur = mV_tma[None, None, head_kv, batch if const_expr(self.v_staged) else row_batch]
                gQ = cute.local_tile(mQ_cur, (self.tile_m, self.head_dim), (m_block, 0))
                gK = cute.local_tile(mK_cur, (self.tile_n, self.head_dim), (None, 0))
                gV = cute.local_tile(mV_cur, (self.head_dim, self.tile_n), (0, None))
                tQsQ, tQgQ = cpasync.tma_partition(
                    tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
                tKsK, tKgK = cpasync.tma_partition(
                    tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
                tVsV, tVgV = cpasync.tma_partition(
                    tma_v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))

                q_handle = q_producer.acquire_and_advance()
                cute.copy(tma_q, tQgQ, tQsQ[None, q_handle.index], tma_bar_ptr=q_handle.barrier,
                          tma_desc_ptr=desc_q)

                sched = self.tile_schedule(m_block, seqlen_q, seqlen_k, window_left, window_right)
                # The ring is filled in the order the consumers wait on it, which depends on the
                # mainloop they run for this tile.
                load = (tma_k, tKgK, tKsK, desc_k, tma_v, tVgV, tVsV, desc_v)
                if self.takes_serial_loop(sched):
                    kv_producer = self.load_kv_serial_order(sched, load, kv_producer)
                else:
                    kv_producer = self.load_kv_overlapped_order(sched, load, kv_producer)
            if const_expr(self.claim_tiles):
                # Claimed once this tile's loads are issued: the consumers get it well before
                # they finish the tile, and the claim order stays the order tiles start in.
                tile_idx = scheduler.claim()
                handle = claim_producer.acquire_and_advance()
                with cute.arch.elect_one():
                    sNextTile[handle.index] = tile_idx
                    handle.commit()
            else:
                tile_idx = scheduler.next(tile_idx)

    @cute.jit
    def load_kv_overlapped_order(self, sched, load, kv_producer: pipeline.PipelineProducer):
        """K_0, then (K_i, V_i-1) pairs, then the last V: the order ``mainloop_overlapped`` waits in."""
        tma_k, tKgK, tKsK, desc_k, tma_v, tVgV, tVsV, desc_v = load
        if sched.total > 0:
            kv_producer = self.load_stage(kv_producer, tma_k, tKgK[None, sched.start], tKsK, desc_k)
            for i in cutlass.range(1, sched.total, unroll=1):
                n_block = sched.start + i
                kv_producer = self.load_stage(kv_producer, tma_k, tKgK[None, n_block], tKsK, desc_k)
                kv_producer = self.load_stage(kv_producer, tma_v, tVgV[None, n_block - 1], tVsV, desc_v)
            kv_producer = self.load_stage(
                kv_producer, tma_v, tVgV[None, sched.start + sched.total - 1], tVsV, desc_v)
        return kv_producer

    @cute.jit
    def load_kv_serial_order(self, sched, load, kv_producer: pipeline.PipelineProducer):
        """(K_i, V_i) pairs: the order ``mainloop_serial`` waits in."""
        tma_k, tKgK, tKsK, desc_k, tma_v, tVgV, tVsV, desc_v = load
        for i in cutlass.range(sched.total, unroll=1):
            n_block = sched.start + i
            kv_producer = self.load_stage(kv_producer, tma_k, tKgK[None, n_block], tKsK, desc_k)
            kv_producer = self.load_stage(kv_producer, tma_v, tVgV[None, n_block], tVsV, desc_v)
        return kv_producer

    @cute.jit
    def load_stage(self, kv_producer: pipeline.PipelineProducer, tma, src, dst_stages, desc):
        """TMA-load one K or V tile (``src``) into the ring's next free stage. The advanced
        producer is returned for the caller to rebind (as in ``overlapped_step``)."""
        handle = kv_producer.acquire_and_advance()
        cute.copy(tma, src, dst_stages[None, handle.index], tma_bar_ptr=handle.barrier, tma_desc_ptr=desc)
        return kv_producer

    # ------------------------------------------------------------------ consumer warpgroups
    @cute.jit
    def consumer(
        self, scheduler, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
        mQ_sdhb, mK_tma, mO, mLSE, tma_o, mO_tma, mCuSeqlensQ, mCuSeqlensK,
        scale_log2: Float32, output_scale: Float32, window_left, window_right,
        sQ, sK, sV, sO: Optional[cute.Tensor], q_consumer: pipeline.PipelineConsumer,
        kv_consumer: pipeline.PipelineConsumer, claim_consumer: Optional[pipeline.PipelineConsumer],
        sNextTile: Optional[cute.Tensor], tidx: Int32,
    ):
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
        s_shape = thr_qk.partition_shape_C((self.tile_m, self.tile_n))
        acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((self.tile_m, self.head_dim)), Float32)
        tScS = thr_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        tOcO = thr_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim)))

        num_rows = cute.size(as_rows_cols(acc_o), mode=[0])
        softmax = OnlineSoftmax.create(scale_log2, num_rows, *self.softmax_chains, self.max_slack,
                                       tuple(x for x in self.drop_phases if x in ("max", "exp", "sum")))
        row_scale = cute.make_rmem_tensor(num_rows, Float32)
        lse_rows = cute.make_rmem_tensor(num_rows, Float32)
        # P of the tile whose P.V is pending; S itself is allocated per tile (a score fragment
        # that outlived its tile would stay live across the loop and crowd out the registers the
        # in-flight GEMMs need).
        p_next = None  # the next P, packed before the P.V that reads ``p`` is done
        if const_expr(self.dtype.width == 8):
            p = cute.make_rmem_tensor(fp8_operand_a_shape(s_shape), self.dtype)
        else:
            p = cute.make_rmem_tensor(s_shape, self.dtype)
            if const_expr(self.two_p):
                p_next = cute.make_rmem_tensor(s_shape, self.dtype)
        if const_expr(self.pingpong):
            if wg == 0:
                # Warpgroup 0 issues first: pre-arrive on its own turn barrier.
                cute.arch.barrier_arrive(barrier_id=TURN_BARRIER, number_of_threads=2 * _WG)

        tile_idx = scheduler.first()
        num_tiles = scheduler.num_tiles
        while tile_idx < num_tiles:
            m_block, head, batch = scheduler.decode(tile_idx)
            offset_q, seqlen_q, offset_k, seqlen_k = self.sequence_bounds(
                batch, mQ_sdhb.shape[0], mK_tma.shape[0], mCuSeqlensQ, mCuSeqlensK)
            if m_block * self.tile_m < seqlen_q:
                mask = FragmentMask(self.mask_kind, seqlen_q, seqlen_k, window_left, window_right,
                                    self.bottom_right, self.mask_bits)
                sched = self.tile_schedule(m_block, seqlen_q, seqlen_k, window_left, window_right)
                row_base = m_block * self.tile_m
                softmax.reset()
                acc_o.fill(0.0)
                q_handle = q_consumer.wait_and_advance()
                frags = (tiled_mma_qk, tiled_mma_pv, tSrQ[None, None, None, q_handle.index], tSrK, tOrV,
                         tScS, s_shape, p, acc_o, row_scale, p_next)
                # The producer filled the ring by the same choice. All warpgroups of the CTA share
                # the tile, so they take the same branch and the ping-pong turn order is left
                # where it was.
                if self.takes_serial_loop(sched):
                    kv_consumer = self.mainloop_serial(sched, row_base, mask, softmax, frags, kv_consumer)
                elif const_expr(p_next is not None):
                    kv_consumer = self.mainloop_two_p(sched, row_base, mask, softmax, frags, kv_consumer, wg)
                else:
                    kv_consumer = self.mainloop_overlapped(sched, row_base, mask, softmax, frags, kv_consumer, wg)
                if const_expr(not self.o_in_q_buffer):
                    q_handle.release()  # else once the O staged in it has been stored
                softmax.finalize(acc_o, output_scale, lse_rows)
                self.epilogue(acc_o, lse_rows, tiled_mma_pv, tOcO, tidx, wg, q_handle, sQ, sO, tma_o, mO_tma,
                              mO, mLSE, m_block, head, batch, offset_q, seqlen_q)
            if const_expr(self.claim_tiles):
                handle = claim_consumer.wait_and_advance()
                tile_idx = sNextTile[handle.index]
                handle.release()
            else:
                tile_idx = scheduler.next(tile_idx)
        if const_expr(self.o_in_own_buffer):
            drain_o_stores()

    @cute.jit
    def epilogue(self, acc_o: cute.Tensor, lse_rows: cute.Tensor, tiled_mma_pv: cute.TiledMma, tOcO: cute.Tensor,
                 tidx: Int32, wg: Int32, q_handle, sQ: cute.Tensor, sO: Optional[cute.Tensor],
                 tma_o: Optional[cute.CopyAtom], mO_tma: Optional[cute.Tensor], mO: cute.Tensor,
                 mLSE: Optional[cute.Tensor], m_block: Int32, head: Int32, batch: Int32, offset_q: Int32,
                 seqlen_q: Int32):
        """Write this warpgroup's rows of the normalized O and their LSE."""
        o_out = cute.make_rmem_tensor_like(acc_o, self.out_dtype)
        o_out.store(acc_o.load().to(self.out_dtype))
        if const_expr(self.o_via_tma):
            staging, release_q = sO, None  # O's own buffer
            if const_expr(self.o_in_q_buffer):
                q_pipe = q_handle.get_origin()
                q_index = q_handle.index
                staging = sQ[None, None, q_index]
                release_q = lambda: q_pipe.sync_object_empty.arrive(q_index, q_pipe.consumer_mask)  # noqa: E731
            store_o_tma(o_out, tiled_mma_pv, self.num_consumer_wgs, tidx, wg, _O_STAGED_BARRIER + wg,
                        staging, tma_o, mO_tma, m_block, head, batch, release_q)
        else:
            store_o_direct(o_out, tOcO, mO, self.varlen, m_block, self.tile_m, head, batch, offset_q, seqlen_q)
        store_lse(lse_rows, tOcO, mLSE, self.varlen, m_block, self.tile_m, head, batch, offset_q, seqlen_q)
