"""The consumer warpgroups' K/V loop of the Hopper forward kernel (``fwd.HopperAttentionForward``
inherits it). Per K/V tile: S = Q K^T on the tensor cores, the score-and-mask object (softcap, and
the mask where the tile needs it), the online softmax in registers, and O += P V with P as the
register A operand.

The loop is software pipelined: the S GEMM of tile n and the P.V GEMM of tile n - 1 are issued
together and run under the softmax of tile n, and the consumer warpgroups take turns issuing
their GEMMs (``NamedBarrier.GEMM_TURN``), so one warpgroup's softmax hides under another's
tensor-core work. The producer fills the K/V ring in the order this loop waits in: K_0, then
(K_n, V_n-1) pairs, then the last V (``fwd.load_kv``).
"""

from dataclasses import dataclass
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import warpgroup

from ..common.fragments import as_operand_a, as_operand_a_fp8, store_as_16bit_pairs
from ..common.mask import FragmentMask
from ..common.pipelines import release_by_one_lane
from ..common.softmax import OnlineSoftmax
from .barriers import NamedBarrier
from .wgmma import WARPGROUP_THREADS, issue_gemm


@dataclass(frozen=True)
class ConsumerFragments:
    """What a consumer warpgroup's K/V loop works on: the two tiled MMAs, the shared-memory
    operand views, and the register fragments that live across K/V tiles."""

    mma_qk: cute.TiledMma
    mma_pv: cute.TiledMma
    q: cute.Tensor  # this tile's Q stage, as the S GEMM's A operand
    k: cute.Tensor  # every ring stage, as the S GEMM's B operand
    v: cute.Tensor  # every ring stage, as the P.V GEMM's B operand
    s_coords: cute.Tensor  # (row, column) of each score in the tile, partitioned like S
    s_shape: tuple  # per-thread shape of S (allocated per K/V tile)
    p: cute.Tensor  # P of the tile whose P.V is pending, in the input dtype
    acc_o: cute.Tensor
    row_scale: cute.Tensor  # the running max's correction of each row, for O
    v_stages: cute.Tensor  # the ring's stages as (D, keys) V tiles in shared memory


class ConsumerMainloop:
    """Mixed into the kernel class, whose ``cfg`` and input ``dtype`` it reads."""

    @cute.jit
    def mainloop(self, kv_tiles, row_base: Int32, mask: FragmentMask, softmax: OnlineSoftmax,
                 frags: ConsumerFragments, kv_consumer: pipeline.PipelineConsumer, wg: Int32):
        """Every K/V tile of the walk ``kv_tiles`` (``common/kv_walk.py``) into ``frags.acc_o``.
        Returns the advanced ``kv_consumer``."""
        if kv_tiles.total > 0:
            kv_consumer = self.first_tile(kv_tiles, row_base, mask, softmax, frags, kv_consumer)
            # Step 0 came out of the first non-empty segment of the walk.
            first_leading = cutlass.min(kv_tiles.leading_masked, 1)
            first_unmasked = cutlass.min(kv_tiles.unmasked, 1 - first_leading)
            leading = kv_tiles.leading_masked - first_leading
            unmasked = kv_tiles.unmasked - first_unmasked
            trailing = kv_tiles.trailing_masked - (1 - first_leading - first_unmasked)
            step = Int32(1)
            # Counted down: with ``range(count)`` ptxas re-derived the bound from the constant bank
            # in every iteration.
            remaining = leading
            while remaining > 0:
                kv_consumer = self.step(True, kv_tiles, kv_tiles.block(step), kv_tiles.visit(step), row_base, mask,
                                        softmax, frags, kv_consumer, wg)
                step += 1
                remaining -= 1
            remaining = unmasked
            while remaining > 0:  # an unmasked step needs its tile index only for a score mod
                block = kv_tiles.block(step + unmasked - remaining) if const_expr(mask.needs_positions) else None
                kv_consumer = self.step(False, kv_tiles, block, None, row_base, mask, softmax, frags, kv_consumer, wg)
                remaining -= 1
            step += unmasked
            remaining = trailing
            while remaining > 0:
                kv_consumer = self.step(True, kv_tiles, kv_tiles.block(step), kv_tiles.visit(step), row_base, mask,
                                        softmax, frags, kv_consumer, wg)
                step += 1
                remaining -= 1
            # The last P.V.
            v_handle = kv_consumer.wait_and_advance()
            if const_expr(self.cfg.cache_lengths):
                last = kv_tiles.block(kv_tiles.total - 1)
                self.zero_keys_past_end(frags.v_stages[None, None, v_handle.index],
                                        mask.seqlen_k - last * self.cfg.tile_n, wg)
            issue_gemm(frags.mma_pv, frags.acc_o, self.operand_p(frags.p), frags.v[None, None, None, v_handle.index],
                       False)
            warpgroup.wait_group(0)
            release_by_one_lane(v_handle)
        return kv_consumer

    @cute.jit
    def zero_keys_past_end(self, v_stage: cute.Tensor, valid: Int32, wg: Int32):
        """Zero the V rows of keys past a cache's length (``valid`` keys of this tile exist): they
        hold whatever the cache held there, NaN included, and a probability of 0 does not cancel
        a NaN in P.V. Both warpgroups write the same zeros, each before its own GEMM reads them."""
        tile_n, d = self.cfg.tile_n, self.cfg.head_dim_v
        # an empty walk's one tile lies past the keys: valid < 0, and all of its rows are zeroed
        valid = cutlass.max(valid, Int32(0))
        if valid < tile_n:
            lane = cute.arch.thread_idx()[0] % WARPGROUP_THREADS
            for i in cutlass.range(lane, (tile_n - valid) * d, WARPGROUP_THREADS, unroll=1):
                v_stage[i % d, valid + i // d] = self.dtype(0.0)
            cute.arch.fence_view_async_shared()  # the generic-proxy writes, before wgmma reads them
            cute.arch.barrier(barrier_id=NamedBarrier.KEYS_ZEROED + wg, number_of_threads=WARPGROUP_THREADS)

    @cute.jit
    def first_tile(self, kv_tiles, row_base: Int32, mask: FragmentMask, softmax: OnlineSoftmax,
                   frags: ConsumerFragments, kv_consumer: pipeline.PipelineConsumer):
        """The prologue: S_0 alone, its softmax, P_0 into ``frags.p``. It is always masked: the
        cost is one tile, and it spares a dynamic choice of code path."""
        k_handle = kv_consumer.wait_and_advance()
        acc_s = cute.make_rmem_tensor(frags.s_shape, Float32)
        issue_gemm(frags.mma_qk, acc_s, frags.q, frags.k[None, None, None, k_handle.index], True)
        warpgroup.wait_group(0)
        release_by_one_lane(k_handle)
        mask.apply_scores(acc_s, frags.s_coords, row_base, kv_tiles.first_key(0, self.cfg.tile_n), True,
                          kv_tiles.visit(0))
        softmax.update(acc_s, frags.row_scale)  # O is still zero: no rescale
        self.store_p(frags.p, acc_s)
        return kv_consumer

    @cute.jit
    def step(self, masked: cutlass.Constexpr, kv_tiles, block: Optional[Int32], visit, row_base: Int32,
             mask: FragmentMask, softmax: OnlineSoftmax, frags: ConsumerFragments,
             kv_consumer: pipeline.PipelineConsumer, wg: Int32):
        """One pipelined step: S_n and P_{n-1} V_{n-1} issued in this warpgroup's turn, then the
        softmax of S_n under the P.V GEMM, O rescaled, P_n packed. ``block`` (the walk's ``block``
        of step n) and ``visit`` (its ``visit``) place the mask and the score mod; an unmasked
        step without a score mod has neither."""
        acc_s, k_handle, v_handle, kv_consumer = self.issue_step_gemms(frags, kv_consumer, wg)
        col_base = kv_tiles.key_of(block, self.cfg.tile_n) if const_expr(block is not None) else None
        mask.apply_scores(acc_s, frags.s_coords, row_base, col_base, masked, visit)
        softmax.update(acc_s, frags.row_scale)
        # ptxas keeps an mbarrier arrive ahead of a later wgmma wait but hoists both as far as
        # their operands allow. Released here, tied to the softmax's result, K_n's arrive holds
        # the wait for P_{n-1} V_{n-1} below the exponentials, which then run under that GEMM.
        release_by_one_lane(k_handle, anchor=softmax.row_sum[0])
        warpgroup.wait_group(0)
        release_by_one_lane(v_handle)
        softmax.rescale(frags.acc_o, frags.row_scale)
        self.store_p(frags.p, acc_s)
        # Returned so the caller rebinds it: pipeline state advanced here must be a plain local
        # of the enclosing staged loop.
        return kv_consumer

    @cute.jit
    def issue_step_gemms(self, frags: ConsumerFragments, kv_consumer: pipeline.PipelineConsumer, wg: Int32):
        """Wait for K_n, take this warpgroup's turn, issue S_n = Q K_n^T and O += P_{n-1} V_{n-1},
        pass the turn on, and wait for S_n. Returns S_n, the K_n and V_{n-1} handles and the
        advanced pipeline state."""
        num_wgs = self.cfg.num_consumer_warpgroups
        k_handle = kv_consumer.wait_and_advance()
        cute.arch.barrier(barrier_id=NamedBarrier.GEMM_TURN + wg, number_of_threads=2 * WARPGROUP_THREADS)
        acc_s = cute.make_rmem_tensor(frags.s_shape, Float32)
        issue_gemm(frags.mma_qk, acc_s, frags.q, frags.k[None, None, None, k_handle.index], True)
        v_handle = kv_consumer.wait_and_advance()
        issue_gemm(frags.mma_pv, frags.acc_o, self.operand_p(frags.p), frags.v[None, None, None, v_handle.index],
                   False)
        cute.arch.barrier_arrive(barrier_id=NamedBarrier.GEMM_TURN + (wg + 1) % num_wgs,
                                 number_of_threads=2 * WARPGROUP_THREADS)
        warpgroup.wait_group(1)  # S_n is ready; P_{n-1} V_{n-1} may still run
        return acc_s, k_handle, v_handle, kv_consumer

    @cute.jit
    def store_p(self, p: cute.Tensor, acc_s: cute.Tensor):
        """Round the probabilities to the input dtype into the P fragment."""
        if const_expr(self.dtype.width == 8):
            p.store(as_operand_a_fp8(acc_s).load().to(self.dtype))
        else:
            store_as_16bit_pairs(p, acc_s)

    def operand_p(self, p: cute.Tensor) -> cute.Tensor:
        """P as the register A operand of P.V (the fp8 fragment is already in that shape)."""
        return p if const_expr(self.dtype.width == 8) else as_operand_a(p)
