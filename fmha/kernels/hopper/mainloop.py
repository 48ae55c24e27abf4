"""The consumer warpgroups' K/V loops of the Hopper kernel (``fwd.HopperAttentionForward``
inherits them): per K/V tile, S = Q K^T on the tensor cores, the mask where the tile needs it,
the online softmax in registers, and O += P V with P as the register A operand.

* ``mainloop_overlapped``, the default: software pipelined, the S GEMM of tile n and the P.V GEMM
  of tile n - 1 run under the softmax of tile n, and with ping-pong the warpgroups take turns
  issuing their GEMMs (named barriers ``TURN_BARRIER + wg``).
* ``mainloop_two_p``: the same with P in two fragments taken in turns, optionally with the
  exponentials run against the kept max (docs/PERFORMANCE.md, item 22; measured, not a default).
* ``mainloop_serial``: one tile at a time (a benchmark variant since item 18).

The producer fills the K/V ring in the order the chosen loop waits in (``fwd.load_kv_*_order``).
"""

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import warpgroup

from ..common.fragments import as_operand_a, as_operand_a_fp8, store_as_16bit_pairs
from ..common.mask import FragmentMask
from ..common.softmax import OnlineSoftmax
from .wgmma import WARPGROUP_THREADS as _WG
from .wgmma import issue_gemm

# Named barriers 1, 2 (, 3): the consumer warpgroups' turns to issue GEMMs (0 is __syncthreads).
TURN_BARRIER = 1


class ConsumerMainloops:
    """Mixed into the kernel class, whose attributes (tile sizes, the knobs of ``__init__``) and
    input dtype they read."""

    @cute.jit
    def mainloop_serial(self, sched, row_base: Int32, mask: FragmentMask, softmax: OnlineSoftmax,
                        frags, kv_consumer: pipeline.PipelineConsumer):
        """One K/V tile at a time: S = Q K^T, wait, softmax, O += P V, wait."""
        tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrV, tScS, s_shape, p, acc_o, row_scale, p_next = frags
        n_block = sched.start
        for i in cutlass.range(sched.total, unroll=1):
            k_handle = kv_consumer.wait_and_advance()
            acc_s = cute.make_rmem_tensor(s_shape, Float32)
            issue_gemm(tiled_mma_qk, acc_s, tSrQ, tSrK[None, None, None, k_handle.index], True)
            warpgroup.wait_group(0)
            self.release_by_one_lane(k_handle)
            # Only the boundary tiles of the schedule pay for the element-wise mask.
            if i < sched.leading_masked or i >= sched.leading_masked + sched.unmasked:
                mask.apply(acc_s, tScS, row_base, n_block * self.tile_n)
            softmax.update(acc_s, row_scale)
            self.rescale(softmax, acc_o, row_scale)
            self.store_p(p, acc_s)
            v_handle = kv_consumer.wait_and_advance()
            issue_gemm(tiled_mma_pv, acc_o, self.operand_p(p), tOrV[None, None, None, v_handle.index], False)
            warpgroup.wait_group(0)
            self.release_by_one_lane(v_handle)
            n_block += 1
        return kv_consumer

    @cute.jit
    def first_tile(self, sched, row_base: Int32, mask: FragmentMask, softmax: OnlineSoftmax, frags,
                   kv_consumer: pipeline.PipelineConsumer):
        """The pipelined loops' prologue: S_0 alone, its softmax, P_0 into ``p``. It is always
        masked: the cost is one tile, and it spares a dynamic choice of code path."""
        tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrV, tScS, s_shape, p, acc_o, row_scale, p_next = frags
        k_handle = kv_consumer.wait_and_advance()
        acc_s = cute.make_rmem_tensor(s_shape, Float32)
        issue_gemm(tiled_mma_qk, acc_s, tSrQ, tSrK[None, None, None, k_handle.index], True)
        warpgroup.wait_group(0)
        self.release_by_one_lane(k_handle)
        mask.apply(acc_s, tScS, row_base, sched.start * self.tile_n)
        softmax.update(acc_s, row_scale)  # O is still zero: no rescale
        self.store_p(p, acc_s)
        return kv_consumer

    @cute.jit
    def mainloop_overlapped(self, sched, row_base: Int32, mask: FragmentMask, softmax: OnlineSoftmax,
                            frags, kv_consumer: pipeline.PipelineConsumer, wg: Int32):
        """Software-pipelined over K/V tiles: while the softmax of tile n runs, the tensor cores
        compute P_{n-1} V_{n-1}. The ring order (K_0, K_1, V_0, K_2, V_1, ..., V_last) matches."""
        tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrV, tScS, s_shape, p, acc_o, row_scale, p_next = frags
        if sched.total > 0:
            kv_consumer = self.first_tile(sched, row_base, mask, softmax, frags, kv_consumer)
            # Tile 0 came out of the first non-empty group of the schedule.
            first_leading = cutlass.min(sched.leading_masked, 1)
            first_unmasked = cutlass.min(sched.unmasked, 1 - first_leading)
            leading = sched.leading_masked - first_leading
            unmasked = sched.unmasked - first_unmasked
            trailing = sched.trailing_masked - (1 - first_leading - first_unmasked)
            n_block = sched.start + 1
            # Counted down: with ``range(count)`` ptxas re-derived the bound from the constant bank
            # in every iteration (9 uniform-datapath instructions per K/V tile).
            remaining = leading
            while remaining > 0:
                kv_consumer = self.overlapped_step(True, n_block, row_base, mask, softmax, frags, kv_consumer, wg)
                n_block += 1
                remaining -= 1
            remaining = unmasked
            while remaining > 0:
                kv_consumer = self.overlapped_step(False, n_block, row_base, mask, softmax, frags, kv_consumer, wg)
                remaining -= 1
            n_block += unmasked
            remaining = trailing
            while remaining > 0:
                kv_consumer = self.overlapped_step(True, n_block, row_base, mask, softmax, frags, kv_consumer, wg)
                n_block += 1
                remaining -= 1
            # Epilogue: the last P.V.
            if const_expr(self.rescale_before_pv):
                self.rescale(softmax, acc_o, row_scale)
            v_handle = kv_consumer.wait_and_advance()
            issue_gemm(tiled_mma_pv, acc_o, self.operand_p(p), tOrV[None, None, None, v_handle.index], False)
            warpgroup.wait_group(0)
            self.release_by_one_lane(v_handle)
        return kv_consumer

    @cute.jit
    def issue_step_gemms(self, frags, kv_consumer: pipeline.PipelineConsumer, wg: Int32, p_operand: cute.Tensor,
                         rescale_with: Optional[OnlineSoftmax] = None):
        """The GEMM half of an overlapped step: wait for K_n, take this warpgroup's turn, issue
        S_n = Q K_n^T and O += P_{n-1} V_{n-1} (``p_operand``; O first rescaled by the previous
        tile's correction when ``rescale_with`` is given), pass the turn on, and wait for S_n.
        Returns S_n, the K_n and V_{n-1} handles and the advanced pipeline state."""
        tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrV, tScS, s_shape, p, acc_o, row_scale, p_next = frags
        k_handle = kv_consumer.wait_and_advance()
        if const_expr(self.pingpong):
            cute.arch.barrier(barrier_id=TURN_BARRIER + wg, number_of_threads=2 * _WG)
        acc_s = cute.make_rmem_tensor(s_shape, Float32)
        issue_gemm(tiled_mma_qk, acc_s, tSrQ, tSrK[None, None, None, k_handle.index], True)
        if const_expr(rescale_with is not None):
            self.rescale(rescale_with, acc_o, row_scale)  # the previous tile's correction
        v_handle = kv_consumer.wait_and_advance()
        issue_gemm(tiled_mma_pv, acc_o, p_operand, tOrV[None, None, None, v_handle.index], False)
        if const_expr(self.pingpong):
            cute.arch.barrier_arrive(barrier_id=TURN_BARRIER + (wg + 1) % self.num_consumer_wgs,
                                     number_of_threads=2 * _WG)
        warpgroup.wait_group(1)  # S_n is ready; P_{n-1} V_{n-1} may still run
        return acc_s, k_handle, v_handle, kv_consumer

    @cute.jit
    def overlapped_step(self, masked: cutlass.Constexpr, n_block: Int32, row_base: Int32,
                        mask: FragmentMask, softmax: OnlineSoftmax, frags,
                        kv_consumer: pipeline.PipelineConsumer, wg: Int32):
        tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrV, tScS, s_shape, p, acc_o, row_scale, p_next = frags
        acc_s, k_handle, v_handle, kv_consumer = self.issue_step_gemms(
            frags, kv_consumer, wg, self.operand_p(p), softmax if const_expr(self.rescale_before_pv) else None)
        if const_expr(not self.late_k_release):
            self.release_by_one_lane(k_handle)
        if const_expr(masked):
            mask.apply(acc_s, tScS, row_base, n_block * self.tile_n)
        softmax.update(acc_s, row_scale)
        if const_expr(self.late_k_release):
            # ptxas keeps an mbarrier arrive ahead of a later wgmma wait but hoists both as far as
            # their operands allow. Released here, tied to the softmax's result, K_n's arrive holds
            # the wait for P_{n-1} V_{n-1} below the exponentials, which then run under that GEMM
            # instead of after it.
            self.release_by_one_lane(k_handle, anchor=softmax.row_sum[0])
        warpgroup.wait_group(0)
        self.release_by_one_lane(v_handle)
        if const_expr(not self.rescale_before_pv):
            self.rescale(softmax, acc_o, row_scale)
        self.store_p(p, acc_s)
        # Returned so the caller rebinds it: pipeline state advanced here must be a plain local
        # of the enclosing staged loop.
        return kv_consumer

    @cute.jit
    def mainloop_two_p(self, sched, row_base: Int32, mask: FragmentMask, softmax: OnlineSoftmax,
                       frags, kv_consumer: pipeline.PipelineConsumer, wg: Int32):
        """``mainloop_overlapped`` with P in two fragments taken in turns (16-bit inputs): P_n is
        packed while P_{n-1} V_{n-1} still reads the other one, instead of after it. Steps come
        in pairs so that which fragment is which stays static; a step masks its tile when the
        schedule says so (a run-time branch instead of one loop per group)."""
        tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrV, tScS, s_shape, p, acc_o, row_scale, p_next = frags
        if sched.total > 0:
            kv_consumer = self.first_tile(sched, row_base, mask, softmax, frags, kv_consumer)
            unmasked_from = sched.leading_masked
            unmasked_to = sched.leading_masked + sched.unmasked
            i = Int32(1)
            remaining = sched.total - 1
            while remaining >= 2:
                kv_consumer = self.two_p_step((i < unmasked_from) | (i >= unmasked_to), sched.start + i, row_base,
                                              mask, softmax, frags, kv_consumer, wg, p, p_next)
                kv_consumer = self.two_p_step((i + 1 < unmasked_from) | (i + 1 >= unmasked_to),
                                              sched.start + i + 1, row_base, mask, softmax, frags, kv_consumer,
                                              wg, p_next, p)
                i += 2
                remaining -= 2
            odd = remaining == 1
            if odd:
                kv_consumer = self.two_p_step((i < unmasked_from) | (i >= unmasked_to), sched.start + i, row_base,
                                              mask, softmax, frags, kv_consumer, wg, p, p_next)
            # Epilogue: the last P.V, from whichever fragment holds the last P.
            v_handle = kv_consumer.wait_and_advance()
            if odd:
                issue_gemm(tiled_mma_pv, acc_o, as_operand_a(p_next), tOrV[None, None, None, v_handle.index], False)
            else:
                issue_gemm(tiled_mma_pv, acc_o, as_operand_a(p), tOrV[None, None, None, v_handle.index], False)
            warpgroup.wait_group(0)
            self.release_by_one_lane(v_handle)
        return kv_consumer

    @cute.jit
    def two_p_step(self, masked, n_block: Int32, row_base: Int32, mask: FragmentMask, softmax: OnlineSoftmax,
                   frags, kv_consumer: pipeline.PipelineConsumer, wg: Int32, p_in: cute.Tensor,
                   p_out: cute.Tensor):
        """``overlapped_step`` reading P_{n-1} from ``p_in`` and packing P_n into ``p_out``."""
        tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrV, tScS, s_shape, p, acc_o, row_scale, p_next = frags
        acc_s, k_handle, v_handle, kv_consumer = self.issue_step_gemms(frags, kv_consumer, wg, as_operand_a(p_in))
        if masked:
            mask.apply(acc_s, tScS, row_base, n_block * self.tile_n)
        if const_expr(self.speculative_exp):
            probs = cute.make_rmem_tensor(s_shape, Float32)
            redo = softmax.update_against_kept_max(acc_s, probs, row_scale)
            # Packed before the branch, so the fp32 probabilities die as they are made.
            store_as_16bit_pairs(p_out, probs)
            if redo:
                softmax.update(acc_s, row_scale)
                store_as_16bit_pairs(p_out, acc_s)
        else:
            softmax.update(acc_s, row_scale)
            store_as_16bit_pairs(p_out, acc_s)
        # As in ``overlapped_step``: K_n's release, tied to the softmax's result, holds the wait
        # for P_{n-1} V_{n-1} below the exponentials.
        self.release_by_one_lane(k_handle, anchor=softmax.row_sum[0])
        warpgroup.wait_group(0)
        self.release_by_one_lane(v_handle)
        self.rescale(softmax, acc_o, row_scale)
        return kv_consumer

    @cute.jit
    def release_by_one_lane(self, handle, anchor: Optional[Float32] = None):
        """``handle.release()`` by an elected lane of each warp (the pipeline's own test reads the
        thread index again at every release). With ``anchor`` (a softmax row sum: never negative,
        so the condition always holds; NaN compares false and releases too) the release is made
        data-dependent on it."""
        pipe = handle.get_origin()
        with cute.arch.elect_one():
            if const_expr(anchor is None):
                pipe.sync_object_empty.arrive(handle.index, pipe.consumer_mask)
            elif not (anchor < Float32(0.0)):
                pipe.sync_object_empty.arrive(handle.index, pipe.consumer_mask)

    @cute.jit
    def rescale(self, softmax: OnlineSoftmax, acc_o: cute.Tensor, row_scale: cute.Tensor):
        if const_expr("rescale" not in self.drop_phases):
            softmax.rescale(acc_o, row_scale)

    @cute.jit
    def store_p(self, p: cute.Tensor, acc_s: cute.Tensor):
        """Round the probabilities to the input dtype into the P fragment."""
        if const_expr("pack" in self.drop_phases):
            pass
        elif const_expr(self.dtype.width == 8):
            p.store(as_operand_a_fp8(acc_s).load().to(self.dtype))
        else:
            store_as_16bit_pairs(p, acc_s)

    def operand_p(self, p: cute.Tensor) -> cute.Tensor:
        """P as the register A operand of P.V (the fp8 fragment is already in that shape)."""
        return p if const_expr(self.dtype.width == 8) else as_operand_a(p)
