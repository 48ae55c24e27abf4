"""The consumer warpgroups of the Hopper backward (``bwd.HopperAttentionBackward`` inherits
them): per query tile S^T and dP^T, P^T and dS^T in registers, dV, dK and dQ's products, dQ
staged for the writer; dK and dV written at the end. docs/design.md draws the kernel."""

import math
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import warpgroup

from fmha.masking import MaskKind

from ..common import sequence_descriptors as seq_desc
from ..common.fragments import as_operand_a, as_rows_cols, store_as_16bit_pairs
from ..common.kv_walk import mask_mod_on_every_tile
from ..common.mask import FragmentMask, ScoreMods, softcap_slope
from ..common.pipelines import release_by_one_lane
from ..common.seqinfo import SequenceInfo
from .barriers import NamedBarrierBwd
from .epilogue import drain_o_stores, store_o_direct, store_o_tma
from .wgmma import WARPGROUP_THREADS as _WG
from .wgmma import issue_gemm

#: rows of fp32 in 16 bytes: a TMA box's first row is a multiple of it
ROW_ALIGN = 4
#: query columns of a thread's S^T fragment whose LSE it holds in registers for a tile (D=128's 64-row tile)
_HELD_COLUMNS = 16
#: ``split_head_dim``: the dS^T/P^T buffer that holds P^T
_P_BUFFER = 2


def _transposed(t: cute.Tensor) -> cute.Tensor:
    """The same shared-memory tensor with its first two modes swapped: a K-major operand tile
    seen as the MN-major operand of another product."""
    modes = [1, 0] + list(range(2, cute.rank(t.layout)))
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=modes))


class BackwardConsumer:
    """Mixed into the kernel class, whose ``cfg``, ``dtype`` and tiles it reads."""

    @cute.jit
    def consumer(self, mma_sdp, mma_dkv, mma_dv, mma_dq, sQ, sdO, sK, sV, sdS, sdQ, sLSE2, sDelta,
                 qdo_consumer: pipeline.PipelineConsumer, kv_consumer: pipeline.PipelineConsumer, mdK, mdV,
                 tma_dk, mdK_tma, tma_dv, mdV_tma, mSeqDescriptors: Optional[cute.Tensor],
                 scale_log2: Float32, out_scale: Float32, score_scale: Float32, softcap_factor, window_left,
                 window_right, n_block, head_kv, batch, group, visits, seq: SequenceInfo, tidx: Int32,
                 mModTensors: Optional[tuple] = None):
        """Warpgroups 1 and 2: per query tile the five products and the element-wise work between
        them; dK and dV stay in registers until the end."""
        cfg = self.cfg
        seqlen_q, seqlen_k = seq.seqlen_q, seq.seqlen_k
        d, dv, tile_m, tile_n = cfg.head_dim, cfg.head_dim_v, self.tile_m, self.tile_n
        wg = cute.arch.make_warp_uniform(tidx // _WG)
        wg_sdp = mma_sdp.get_slice(wg * _WG)
        wg_dkv = mma_dkv.get_slice(wg * _WG)
        wg_dv = mma_dv.get_slice(wg * _WG)
        wg_dq = mma_dq.get_slice(0)
        thr_sdp = mma_sdp.get_slice(tidx)
        thr_dkv = mma_dkv.get_slice(tidx)
        thr_dv = mma_dv.get_slice(tidx)
        thr_dq = mma_dq.get_slice(tidx % _WG)
        tSrK = wg_sdp.make_fragment_A(wg_sdp.partition_A(sK))[None, None, None, 0]
        tSrQ = wg_sdp.make_fragment_B(wg_sdp.partition_B(sQ))
        tPrV = wg_sdp.make_fragment_A(wg_sdp.partition_A(sV))[None, None, None, 0]
        tPrdO = wg_sdp.make_fragment_B(wg_sdp.partition_B(sdO))
        tVrdO = wg_dv.make_fragment_B(wg_dv.partition_B(_transposed(sdO)))
        tKrQ = wg_dkv.make_fragment_B(wg_dkv.partition_B(_transposed(sQ)))
        tKrdS = tVrP = None
        if const_expr(cfg.split_head_dim):  # dK's and dV's A operands: dS^T and P^T of both warpgroups
            tKrdS = wg_dkv.make_fragment_A(wg_dkv.partition_A(sdS))
            tVrP = wg_dv.make_fragment_A(wg_dv.partition_A(sdS))[None, None, None, _P_BUFFER]
        if const_expr(cfg.dq_transposed):
            # this warpgroup's half of the head dim of K^T (dQ^T's A operand: d x keys), all of dS^T
            # (its B operand: rows x keys)
            sK_half = cute.local_tile(_transposed(sK)[None, None, 0], (d // 2, tile_n), (wg, 0))
            tQrK = wg_dq.make_fragment_A(wg_dq.partition_A(sK_half))
            tQrdS = wg_dq.make_fragment_B(wg_dq.partition_B(_transposed(sdS)))
        elif const_expr(cfg.dq_split_rows):
            # this warpgroup's query rows of dS (dQ's A operand: rows x keys), all of K
            dS_rows = cute.local_tile(_transposed(sdS), (cfg.dq_rows_per_warpgroup, tile_n), (wg, 0, None))
            tQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(dS_rows))
            tQrK = wg_dq.make_fragment_B(wg_dq.partition_B(_transposed(sK)[None, None, 0]))
        else:
            tQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(_transposed(sdS)))
            # this warpgroup's half of the head dim of K (dQ's B operand: d x keys)
            sK_half = cute.local_tile(_transposed(sK)[None, None, 0], (d // 2, tile_n), (wg, 0))
            tQrK = wg_dq.make_fragment_B(wg_dq.partition_B(sK_half))
        s_shape = thr_sdp.partition_shape_C((tile_n, tile_m))
        tScS = as_rows_cols(thr_sdp.partition_C(cute.make_identity_tensor((tile_n, tile_m))))
        acc_dk = cute.make_rmem_tensor(thr_dkv.partition_shape_C((tile_n, d)), Float32)
        acc_dv = cute.make_rmem_tensor(thr_dv.partition_shape_C((tile_n, dv)), Float32)
        acc_dk.fill(0.0)
        acc_dv.fill(0.0)
        # this thread's accumulator registers 4k..4k+3 as chunk k: one 16-byte store each
        tdQsdQ = sdQ[None, tidx % _WG, None, wg]
        # dS^T from the accumulator registers into shared memory, 8x8 blocks at a time
        st_atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        thr_st = cute.make_tiled_copy_C(st_atom, mma_sdp).get_slice(tidx)
        tdSsdS = thr_st.partition_D(sdS)
        n0 = n_block * tile_n
        num_cols = cute.size(tScS, mode=[1])
        dp_scale = out_scale * score_scale if const_expr(cfg.ds_prescaled) else out_scale
        inv_scale_log2 = Float32(1.0) / scale_log2 if const_expr(cfg.softcap) else None

        # the score mod's slope: a constant of the mod (1.0 without one), else one per score
        constant_slope = FragmentMask.of(cfg, seqlen_q, seqlen_k, window_left, window_right, softcap_factor,
                                         ScoreMods.of(cfg.mods, mModTensors, batch, head_kv,
                                                      scale_log2)).constant_slope()
        slopes = None
        if const_expr(constant_slope is None):
            slopes = as_rows_cols(cute.make_rmem_tensor(s_shape, Float32))
        kv_handle = kv_consumer.wait_and_advance()
        tile_parity = Int32(0)
        for g in cutlass.range(group, unroll=1):
            head = head_kv * group + g
            # the score-and-mask object (``common/mask.py``) of this head (a mod reads the head), on S^T
            head_mask = FragmentMask.of(cfg, seqlen_q, seqlen_k, window_left, window_right, softcap_factor,
                                        ScoreMods.of(cfg.mods, mModTensors, batch, head, scale_log2))
            m_start, m_end = visits.range(head)
            for i in cutlass.range(m_start, m_end, unroll=1):
                m_block = visits.tile_at(i, head)
                m0 = m_block * tile_m
                handle = qdo_consumer.wait_and_advance()
                stage = handle.index
                ds_buf = stage
                if const_expr(cfg.split_head_dim):
                    ds_buf = tile_parity
                    tile_parity ^= 1
                acc_s = cute.make_rmem_tensor(s_shape, Float32)
                acc_dp = cute.make_rmem_tensor(s_shape, Float32)
                issue_gemm(mma_sdp, acc_s, tSrK, tSrQ[None, None, None, stage], True)
                issue_gemm(mma_sdp, acc_dp, tPrV, tPrdO[None, None, None, stage], True)
                # tiles start at multiples of tile_m (of 4) rows into the sequence
                skip = seq.offset_q % ROW_ALIGN
                # the columns' LSE, loaded while the products run where registers allow (loaded at
                # its use, each exponential waited on it); D=64's 32 columns would spill
                held_lse = None
                if const_expr(num_cols <= _HELD_COLUMNS):
                    held_lse = self.column_rows(sLSE2, tScS, skip, stage)
                    if const_expr(not cfg.exps_before_dp_wait):
                        # rows past a ragged tile's sequence: an LSE of +inf makes their P 0, with
                        # no branch after the exponentials
                        for j in cutlass.range_constexpr(num_cols):
                            held_lse[j] = Float32(cutlass.select_(m0 + tScS[0, j][1] >= seqlen_q,
                                                                  Float32(math.inf), held_lse[j]))
                warpgroup.wait_group(1)  # S^T is ready; dP^T still runs
                s = as_rows_cols(acc_s)
                head_mask.softcap(s)  # before the mask, as the forward's
                head_mask.score_mod_transposed(s, tScS, m0, n0, slopes)
                # keys past the sequence (the last K/V tile's zero rows) are masked too: their P
                # would be 2^-lse, which for a row of very negative scores overflows dS
                partial = False  # a block mask's tile that needs its mask mod per element
                if const_expr(cfg.mods is not None and cfg.mods.block_sparse):
                    partial = visits.partial(i, head)
                if const_expr(cfg.select_block):  # the entry's positions, for this warpgroup's block
                    if visits.partial(i, head):
                        head_mask.apply_selected_transposed(s, tScS, m0, n0, n0 + wg * cfg.select_block,
                                                            visits.positions(i, wg))
                elif const_expr(mask_mod_on_every_tile(cfg.mods)):
                    head_mask.apply_transposed(s, tScS, m0, n0)  # a mask mod without a block mask: every tile
                elif const_expr(cfg.mask_kind != MaskKind.NONE):
                    last = cutlass.min(m0 + tile_m, seqlen_q) - 1
                    lo_last, _ = head_mask.key_bounds(last)
                    _, hi_first = head_mask.key_bounds(m0)
                    # bands end at seqlen_k at the latest
                    if not (lo_last <= n0 and hi_first >= n0 + tile_n) or partial:
                        head_mask.apply_transposed(s, tScS, m0, n0)
                elif n0 + tile_n > seqlen_k or partial:
                    head_mask.apply_transposed(s, tScS, m0, n0)
                for j in cutlass.range_constexpr(num_cols):
                    lse2 = self.column_lse(held_lse, sLSE2, tScS, skip, stage, j)
                    for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
                        s[r, j] = cute.math.exp2(s[r, j] * scale_log2 - lse2, fastmath=True)
                # P of the rows past a ragged tile's sequence (their LSE rows are another
                # sequence's or padding) to 0; the branch also keeps ptxas from moving the wait
                # for dP^T above the exponentials, as it does in straight-line code
                if const_expr(cfg.exps_before_dp_wait or held_lse is None) and m0 + tile_m > seqlen_q:
                    for j in cutlass.range_constexpr(num_cols):
                        if m0 + tScS[0, j][1] >= seqlen_q:
                            for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
                                s[r, j] = Float32(0.0)
                p16 = cute.make_rmem_tensor(s_shape, self.dtype)
                store_as_16bit_pairs(p16, acc_s)
                if const_expr(cfg.split_head_dim):  # the other warpgroup's dV product reads it too
                    cute.copy(st_atom, thr_st.retile(p16), tdSsdS[None, None, None, _P_BUFFER])
                warpgroup.wait_group(0)
                dp = as_rows_cols(acc_dp)
                for j in cutlass.range_constexpr(num_cols):
                    # 0 past the sequence: P is 0 there, and so is dP (dO's rows read as zeros),
                    # but the padding may hold anything
                    col = tScS[0, j][1]
                    delta = Float32(cutlass.select_(m0 + col >= seqlen_q, Float32(0.0), sDelta[skip + col, stage]))
                    for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
                        dp[r, j] = s[r, j] * (dp[r, j] * dp_scale - delta)
                    if const_expr(cfg.softcap):  # through the cap: dS times its slope, from P
                        lse2 = self.column_lse(held_lse, sLSE2, tScS, skip, stage, j)
                        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
                            dp[r, j] = dp[r, j] * softcap_slope(s[r, j], lse2, inv_scale_log2)
                    if const_expr(slopes is not None):  # through the score mod
                        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
                            dp[r, j] = dp[r, j] * slopes[r, j]
                    elif const_expr(constant_slope != 1.0):
                        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
                            dp[r, j] = dp[r, j] * Float32(constant_slope)
                ds16 = cute.make_rmem_tensor(s_shape, self.dtype)
                store_as_16bit_pairs(ds16, acc_dp)
                # dS^T of both warpgroups (all the tile's keys) for the dQ product; the buffer
                # alternates with the stage, so the other warpgroup may still read the last one
                ds_first = cfg.ds_stored_before_dv or cfg.split_head_dim
                if const_expr(ds_first):
                    cute.copy(st_atom, thr_st.retile(ds16), tdSsdS[None, None, None, ds_buf])
                if const_expr(not cfg.split_head_dim):
                    issue_gemm(mma_dv, acc_dv, as_operand_a(p16), tVrdO[None, None, None, stage], False)
                if const_expr(not ds_first):
                    cute.copy(st_atom, thr_st.retile(ds16), tdSsdS[None, None, None, stage])
                cute.arch.fence_view_async_shared()
                cute.arch.barrier(barrier_id=NamedBarrierBwd.DS_READY, number_of_threads=2 * _WG)
                if const_expr(cfg.split_head_dim):
                    issue_gemm(mma_dv, acc_dv, tVrP, tVrdO[None, None, None, stage], False)
                    issue_gemm(mma_dkv, acc_dk, tKrdS[None, None, None, ds_buf], tKrQ[None, None, None, stage], False)
                if const_expr(cfg.dq_transposed):
                    acc_dq = cute.make_rmem_tensor(
                        thr_dq.partition_shape_C((cfg.dq_cols_per_warpgroup, cfg.dq_rows_per_warpgroup)), Float32)
                    issue_gemm(mma_dq, acc_dq, tQrK, tQrdS[None, None, None, ds_buf], True)
                else:
                    acc_dq = cute.make_rmem_tensor(
                        thr_dq.partition_shape_C((cfg.dq_rows_per_warpgroup, cfg.dq_cols_per_warpgroup)), Float32)
                    issue_gemm(mma_dq, acc_dq, tQrdS[None, None, None, ds_buf], tQrK, True)
                if const_expr(cfg.split_head_dim):
                    # dV and dK have read Q and dO: the next tile's load runs under dQ's product
                    warpgroup.wait_group(1)
                    release_by_one_lane(handle)
                    warpgroup.wait_group(0)
                else:
                    issue_gemm(mma_dkv, acc_dk, as_operand_a(ds16), tKrQ[None, None, None, stage], False)
                    warpgroup.wait_group(1)  # dV and dQ are done; dK still runs
                # stage this warpgroup's half of dQ once the writer's last add has read it
                cute.arch.barrier(barrier_id=NamedBarrierBwd.DQ_EMPTY + wg, number_of_threads=_WG + 32)
                if const_expr(not cfg.ds_prescaled):
                    acc_dq.store(acc_dq.load() * score_scale)
                cute.autovec_copy(cute.make_tensor(acc_dq.iterator, cute.make_layout(tdQsdQ.shape)), tdQsdQ)
                cute.arch.fence_view_async_shared()
                cute.arch.barrier_arrive(barrier_id=NamedBarrierBwd.DQ_FULL + wg, number_of_threads=_WG + 32)
                if const_expr(not cfg.split_head_dim):
                    warpgroup.wait_group(0)
                    release_by_one_lane(handle)
        release_by_one_lane(kv_handle)
        # two store_dkv calls: the DSL traces both sides of a runtime branch, and only selection's
        # visits have the accumulators of a split list
        if const_expr(cfg.list_pieces > 1):
            if visits.split(head_kv):  # one share of a list that several CTAs walk
                if const_expr(cfg.deterministic):  # the shares add in order: wait for this one's turn
                    turn = visits.dkv_turn(head_kv, wg)
                    self.wait_for_dkv_turn(turn, visits.piece, tidx, wg)
                self.add_dkv_partials(acc_dk, acc_dv, thr_dkv, thr_dv, visits, n_block, head_kv, seq, score_scale,
                                      out_scale)
                if const_expr(cfg.deterministic):
                    self.pass_dkv_turn(turn, visits.piece + 1, tidx, wg)
            else:
                self.store_dkv(acc_dk, acc_dv, thr_dkv, thr_dv, mma_dkv, mma_dv, sK, sV, mdK, mdV, tma_dk, mdK_tma,
                               tma_dv, mdV_tma, mSeqDescriptors, score_scale, out_scale, n_block, head_kv, batch,
                               seq, tidx, wg)
        else:
            self.store_dkv(acc_dk, acc_dv, thr_dkv, thr_dv, mma_dkv, mma_dv, sK, sV, mdK, mdV, tma_dk, mdK_tma,
                           tma_dv, mdV_tma, mSeqDescriptors, score_scale, out_scale, n_block, head_kv, batch, seq,
                           tidx, wg)

    @cute.jit
    def wait_for_dkv_turn(self, turn, piece, tidx, wg):
        """Deterministic selection: warpgroup ``wg`` waits until the shares before ``piece`` of
        its list have added their dK and dV of its keys (one lane spins, the barrier orders the
        warpgroup's adds after what it saw)."""
        if tidx % _WG == 0:
            while cute.arch.load(turn, Int32, sem="acquire", scope="gpu") != piece:
                pass
        cute.arch.barrier(barrier_id=NamedBarrierBwd.DKV_TURN + wg, number_of_threads=_WG)

    @cute.jit
    def pass_dkv_turn(self, turn, next_piece, tidx, wg):
        """Deterministic selection: once every thread's adds are visible, the next share's turn."""
        cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier(barrier_id=NamedBarrierBwd.DKV_TURN + wg, number_of_threads=_WG)
        if tidx % _WG == 0:
            cute.arch.store(turn, next_piece, sem="release", scope="gpu")

    @cute.jit
    def add_dkv_partials(self, acc_dk, acc_dv, thr_dkv, thr_dv, visits, n_block, head_kv, seq: SequenceInfo,
                         score_scale: Float32, out_scale: Float32):
        """dK and dV of this CTA's share of a split list, added in fp32 into the accumulators
        (``SelectedQueryVisits.dkv_partials``) that the host converts once every share has added."""
        cfg = self.cfg
        dk_scale = Float32(1.0) if const_expr(cfg.ds_prescaled) else score_scale
        mdKacc, mdVacc = visits.dkv_partials()
        for acc, thr, m_acc, width, scale in ((acc_dk, thr_dkv, mdKacc, cfg.head_dim, dk_scale),
                                              (acc_dv, thr_dv, mdVacc, cfg.head_dim_v, out_scale)):
            rows = cute.domain_offset((seq.offset_k, 0), m_acc[None, head_kv, None])
            vals = as_rows_cols(acc)
            coords = as_rows_cols(thr.partition_C(cute.make_identity_tensor((self.tile_n, width))))
            for r in cutlass.range_constexpr(cute.size(vals, mode=[0])):
                row = n_block * self.tile_n + coords[r, 0][0]
                if row < seq.seqlen_k:
                    for j in cutlass.range_constexpr(cute.size(vals, mode=[1])):
                        at = rows.iterator + cute.crd2idx((row, coords[r, j][1]), rows.layout)
                        cute.arch.red(at, vals[r, j] * scale, op="add", dtype=Float32, sem="relaxed", scope="gpu")

    @cute.jit
    def store_dkv(self, acc_dk, acc_dv, thr_dkv, thr_dv, mma_dkv, mma_dv, sK, sV, mdK, mdV, tma_dk, mdK_tma,
                  tma_dv, mdV_tma, mSeqDescriptors, score_scale: Float32, out_scale: Float32, n_block, head_kv,
                  batch, seq: SequenceInfo, tidx, wg):
        """dK and dV from registers to global memory in the inputs' type."""
        cfg = self.cfg
        d, dv, tile_n = cfg.head_dim, cfg.head_dim_v, self.tile_n
        seqlen_k = seq.seqlen_k
        dk_out = cute.make_rmem_tensor_like(acc_dk, self.dtype)
        dv_out = cute.make_rmem_tensor_like(acc_dv, self.dtype)
        if const_expr(cfg.ds_prescaled):
            dk_out.store(acc_dk.load().to(self.dtype))
        else:
            dk_out.store((acc_dk.load() * score_scale).to(self.dtype))
        dv_out.store((acc_dv.load() * out_scale).to(self.dtype))
        if const_expr(cfg.dkv_store_tma):
            # dV first, into this warpgroup's own rows of V (only its own dP^T products read them);
            # dK's rows of K are read by both warpgroups' dQ products, so both finish first. Each
            # buffer is staged once: dK is staged while dV's store still reads V's buffer
            staged = NamedBarrierBwd.DKV_STAGED + wg
            desc_dk = desc_dv = None
            row_batch = batch
            if const_expr(cfg.varlen):  # the sequence's own descriptors: the stores stop at its end
                desc_dk = seq_desc.acquire_descriptor(mSeqDescriptors, batch, seq_desc.DK)
                desc_dv = seq_desc.acquire_descriptor(mSeqDescriptors, batch, seq_desc.DV)
                row_batch = Int32(0)
            store_o_tma(dv_out, mma_dv, 2, tidx, wg, staged, sV[None, None, 0], tma_dv, mdV_tma, n_block,
                        head_kv, row_batch, None, desc_dv, fresh_buffer=cfg.dk_staged_under_dv_store)
            cute.arch.barrier(barrier_id=NamedBarrierBwd.DS_READY, number_of_threads=2 * _WG)
            store_o_tma(dk_out, mma_dkv, 2, tidx, wg, staged, sK[None, None, 0], tma_dk, mdK_tma, n_block,
                        head_kv, row_batch, None, desc_dk, fresh_buffer=cfg.dk_staged_under_dv_store)
            drain_o_stores()
        else:
            tdKcdK = thr_dkv.partition_C(cute.make_identity_tensor((tile_n, d)))
            tdVcdV = tdKcdK if const_expr(dv == d) else thr_dv.partition_C(cute.make_identity_tensor((tile_n, dv)))
            store_o_direct(dk_out, tdKcdK, mdK, cfg.varlen, n_block, tile_n, head_kv, batch, seq.offset_k, seqlen_k)
            store_o_direct(dv_out, tdVcdV, mdV, cfg.varlen, n_block, tile_n, head_kv, batch, seq.offset_k, seqlen_k)

    def column_lse(self, held_lse: Optional[cute.Tensor], sLSE2: cute.Tensor, tScS: cute.Tensor, skip, stage, j: int):
        """Query column ``j``'s LSE (log2 units): from registers where ``column_rows`` holds it, else
        from shared memory."""
        return held_lse[j] if const_expr(held_lse is not None) else sLSE2[skip + tScS[0, j][1], stage]

    @cute.jit
    def column_rows(self, sRows: cute.Tensor, tScS: cute.Tensor, skip, stage) -> cute.Tensor:
        """This thread's query columns' entries of a row statistic of ``stage``, into registers."""
        num_cols = cute.size(tScS, mode=[1])
        vals = cute.make_rmem_tensor((num_cols,), Float32)
        for j in cutlass.range_constexpr(num_cols):
            vals[j] = sRows[skip + tScS[0, j][1], stage]
        return vals
