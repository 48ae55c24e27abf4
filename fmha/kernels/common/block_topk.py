"""NSA's top-k block selection in one kernel (``fmha.nsa.topk``, docs/nsa.md "Selection"): for
each packed query token and K/V head, the selection blocks its selection attention reads, without
the (T x T_c) score matrix ever leaving the chip.

A CTA takes ``64 / g`` consecutive tokens of one K/V head, their GQA group of g query heads as
the 64 rows of its tile (row ``p * g + j``: token p, head ``h * g + j``). It walks the compressed
keys its tokens' sequences show them, 64 at a time: S = Q K_cmp^T on the tensor cores (warp MMAs,
each warp 16 rows), the compression probabilities ``exp(S * scale - lse)`` kept where the
compressed block is visible to the row's token, and each added to the score of every selection
block its compressed block overlaps, in shared memory (one fp32 per token and selection block:
``score_capacity`` of them). Then one warp per token ranks its blocks: the current, the previous
and the first block forced in (in that order), then the highest scores, the lower block winning a
tie, among blocks that start at or before the token; written in ascending order, -1 padded.

Sums are fp32 in another order than the PyTorch path's, so near-ties may rank differently.
Architecture-independent (warp MMAs, plain loads; sm_80 and later); nothing is read on the host.
"""

import math
from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warp
from cutlass.memory import SmemAllocator

#: query rows (GQA heads x tokens) and compressed keys per tile
TILE_ROWS = 64
TILE_KEYS = 64
WARPS = 4
THREADS = 32 * WARPS
LOG2_E = math.log2(math.e)


@dataclass(frozen=True)
class BlockTopKConfig:
    """What selects a different compiled top-k."""

    dtype: torch.dtype
    head_dim: int
    #: query heads per K/V head (a divisor of 64)
    group: int
    block: int  # l: tokens per compressed block
    stride: int  # d: tokens between compressed blocks
    select_block: int  # l': tokens per selection block
    select_count: int  # n: blocks per token (at most 32)
    #: selection blocks held per token (a power of two, at least the longest sequence's)
    score_capacity: int

    @property
    def tokens_per_tile(self) -> int:
        return TILE_ROWS // self.group

    @property
    def overlap_span(self) -> int:
        """The most selection blocks one compressed block overlaps."""
        return (self.block + self.select_block - 2) // self.select_block + 1

    def shared_bytes(self) -> int:
        staged = WARPS * (16 // min(self.group, 16)) * TILE_KEYS * 4
        return self.tokens_per_tile * (self.score_capacity * 4 + 3 * 4) + staged + TILE_ROWS * 4 + 64


def _storage(cfg: BlockTopKConfig):
    p = cfg.tokens_per_tile

    @cute.struct
    class Storage:
        scores: cute.struct.Align[cute.struct.MemRange[Float32, p * cfg.score_capacity], 16]
        # per warp, per token of the warp (one part of a token past 16 rows), per compressed key
        staged: cute.struct.MemRange[Float32, WARPS * (16 // min(cfg.group, 16)) * TILE_KEYS]
        row_lse: cute.struct.MemRange[Float32, TILE_ROWS]  # log2 units; +inf: the row keeps nothing
        first_key: cute.struct.MemRange[Int32, p]  # the token's sequence's first compressed key
        seen: cute.struct.MemRange[Int32, p]  # compressed blocks the token sees
        position: cute.struct.MemRange[Int32, p]  # in its sequence; -1: no token (past T, or another CTA's)

    return Storage


class BlockTopK:
    def __init__(self, cfg: BlockTopKConfig):
        self.cfg = cfg

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mLse: cute.Tensor, mCu: cute.Tensor, mCuCmp: cute.Tensor,
                 mSeqOf: cute.Tensor, mOut: cute.Tensor, scale_log2: Float32, stream: cuda.CUstream):
        """mQ (T, H_q, D), mK the compressed keys (T_c, H_k, D), mLse (H_q, T) fp32 natural-log
        LSE of the compression branch, mCu/mCuCmp (B + 1) int32 offsets of tokens and compressed
        keys, mSeqOf (T,) int32 each token's sequence, mOut (T, H_k, n) int32. Needs T >= 64 / g
        and T_c >= 64 (the host pads smaller inputs)."""
        tokens = mQ.shape[0]
        heads_k = mK.shape[1]
        mma = cute.make_tiled_mma(warp.MmaF16BF16Op(mQ.element_type, Float32, (16, 8, 16)), (WARPS, 1, 1),
                                  permutation_mnk=(TILE_ROWS, 16, 16))
        self.kernel(mQ, mK, mLse, mCu, mCuCmp, mSeqOf, mOut, scale_log2, mma).launch(
            grid=[cute.ceil_div(tokens, self.cfg.tokens_per_tile), heads_k, 1], block=[THREADS, 1, 1],
            smem=_storage(self.cfg).size_in_bytes(), stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mLse: cute.Tensor, mCu: cute.Tensor, mCuCmp: cute.Tensor,
               mSeqOf: cute.Tensor, mOut: cute.Tensor, scale_log2: Float32, mma: cute.TiledMma):
        cfg = self.cfg
        p_tile = cfg.tokens_per_tile
        tidx = cute.arch.thread_idx()[0]
        tile, head_k, _ = cute.arch.block_idx()
        tokens = mQ.shape[0]
        t0 = tile * p_tile
        # the last tile is moved back to end at T (its first tokens are the previous tile's), so
        # that every load of the tile is in bounds
        t_start = cutlass.min(t0, tokens - p_tile)
        storage = SmemAllocator().allocate(_storage(cfg))
        scores = storage.scores.get_tensor(cute.make_layout(p_tile * cfg.score_capacity))
        row_lse = storage.row_lse.get_tensor(cute.make_layout(TILE_ROWS))
        first_key = storage.first_key.get_tensor(cute.make_layout(p_tile))
        seen = storage.seen.get_tensor(cute.make_layout(p_tile))
        position = storage.position.get_tensor(cute.make_layout(p_tile))
        staged = storage.staged.get_tensor(cute.make_layout(WARPS * (16 // min(cfg.group, 16)) * TILE_KEYS))
        self.describe_tokens(mLse, mCu, mCuCmp, mSeqOf, t0, t_start, head_k, scores, row_lse, first_key, seen,
                             position, tidx)
        cute.arch.sync_threads()
        self.add_block_probabilities(mQ, mK, t_start, head_k, scale_log2, mma, scores, staged, row_lse, first_key,
                                     seen, position, tidx)
        cute.arch.sync_threads()
        self.rank_blocks(mOut, t_start, head_k, scores, position, tidx)

    @cute.jit
    def describe_tokens(self, mLse, mCu, mCuCmp, mSeqOf, t0, t_start, head_k, scores, row_lse, first_key, seen,
                        position, tidx):
        """Each token's sequence facts and each row's LSE into shared memory; the scores to 0."""
        cfg = self.cfg
        g, p_tile = cfg.group, cfg.tokens_per_tile
        end = mCu[mCu.shape[0] - 1]  # rows past the last offset (padding) are no token
        for p in cutlass.range(tidx, p_tile, THREADS, unroll=1):
            t = t_start + p
            b = mSeqOf[t]
            pos = t - mCu[b]
            first_key[p] = mCuCmp[b]
            # blocks i with i * d + l - 1 <= pos
            seen[p] = cutlass.select_(pos + 1 >= cfg.block, (pos + 1 - cfg.block) // cfg.stride + 1, Int32(0))
            position[p] = cutlass.select_((t >= t0) & (t < end), pos, Int32(-1))
        for r in cutlass.range(tidx, TILE_ROWS, THREADS, unroll=1):
            t = t_start + r // g
            lse = mLse[head_k * g + r % g, t]
            # a row that sees no compressed block has LSE -inf; its columns are all masked
            row_lse[r] = cutlass.select_(lse == -math.inf, Float32(math.inf), lse * LOG2_E)
        for i in cutlass.range(tidx, p_tile * cfg.score_capacity, THREADS, unroll=1):
            scores[i] = Float32(0.0)

    @cute.jit
    def add_block_probabilities(self, mQ, mK, t_start, head_k, scale_log2, mma, scores, staged, row_lse, first_key,
                                seen, position, tidx):
        """Walk the compressed keys the tile's tokens see, 64 at a time: each token's kept
        probabilities summed over its rows (shuffles within the warp), staged per compressed
        block, then added to the selection blocks they overlap."""
        cfg = self.cfg
        g, p_tile = cfg.group, cfg.tokens_per_tile
        lane = tidx % 32
        warp_idx = tidx // 32
        thr = mma.get_slice(tidx)
        # rows (head j, token p) -> q[t_start + p, head_k * g + j]
        q_rows = cute.make_layout(((g, p_tile), cfg.head_dim), stride=((mQ.stride[1], mQ.stride[0]), 1))
        gQ = cute.make_tensor(mQ[t_start, head_k * g, None].iterator, q_rows)
        tSgQ = thr.partition_A(gQ)
        tSrQ = thr.make_fragment_A(tSgQ)
        cute.autovec_copy(tSgQ, tSrQ)
        tScS = thr.partition_C(cute.make_identity_tensor((TILE_ROWS, TILE_KEYS)))
        acc = cute.make_rmem_tensor(thr.partition_shape_C((TILE_ROWS, TILE_KEYS)), Float32)
        # the m16n8 accumulator: values (column, column + 1) of row lane / 4, then the same of
        # row lane / 4 + 8; the token sums below rely on it
        assert cute.size(acc, mode=[0]) == 4 and cute.size(acc, mode=[1]) == 1
        # this thread's two rows: their token's sequence facts, hoisted out of the key loop
        fk = cute.make_rmem_tensor(2, Int32)
        sn = cute.make_rmem_tensor(2, Int32)
        lse2 = cute.make_rmem_tensor(2, Float32)
        for h in cutlass.range_constexpr(2):
            r = tScS[2 * h][0]
            p = r // g
            fk[h] = first_key[p]
            # a token that is no token of this CTA keeps nothing
            sn[h] = cutlass.select_(position[p] >= 0, seen[p], Int32(0))
            lse2[h] = row_lse[r]
        keys = mK.shape[0]
        # the keys from the first token's sequence's first one to the last token's last visible one
        c_lo = first_key[0]
        c_hi = cutlass.min(first_key[p_tile - 1] + seen[p_tile - 1], keys)
        k_rows = cute.make_layout((TILE_KEYS, cfg.head_dim), stride=(mK.stride[0], 1))
        for c_tile in cutlass.range(c_lo, c_hi, TILE_KEYS, unroll=1):
            # moved back to end at T_c like the last token tile: columns before c_tile are masked
            c_start = cutlass.min(c_tile, keys - TILE_KEYS)
            gK = cute.make_tensor(mK[c_start, head_k, None].iterator, k_rows)
            tSgK = thr.partition_B(gK)
            tSrK = thr.make_fragment_B(tSgK)
            cute.autovec_copy(tSgK, tSrK)
            acc.fill(0.0)
            for kb in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
                cute.gemm(mma, acc, tSrQ[None, None, kb], tSrK[None, None, kb], acc)
            for i in cutlass.range_constexpr(cute.size(acc)):
                h = (i // 2) % 2
                c = c_start + tScS[i][1]
                local = c - fk[h]
                keep = (c >= c_tile) & (local >= 0) & (local < sn[h])
                prob = cute.math.exp2(acc[i] * scale_log2 - lse2[h], fastmath=True)
                acc[i] = cutlass.select_(keep, prob, Float32(0.0))
            self.stage_token_sums(acc, tScS, staged, warp_idx, lane)
            cute.arch.sync_warp()
            self.add_staged(c_start, scores, staged, first_key, position, warp_idx, lane)
            cute.arch.sync_warp()  # the staged sums are read before the next tile's are written

    @cute.jit
    def stage_token_sums(self, acc, tScS, staged, warp_idx, lane):
        """Each token's probabilities summed over its rows of this warp, into ``staged`` (per
        warp, per token of the warp, per column): butterflies over the lanes of a token's rows,
        and the two row halves of a thread for a token of 16 or more rows."""
        cfg = self.cfg
        rows_per_token = min(cfg.group, 16)
        tokens_per_warp = 16 // rows_per_token
        steps = int(math.log2(min(rows_per_token, 8)))
        for s in cutlass.range_constexpr(steps):
            for i in cutlass.range_constexpr(cute.size(acc)):
                acc[i] = acc[i] + cute.arch.shuffle_sync_bfly(acc[i], offset=4 << s)
        if (lane >> 2) % min(rows_per_token, 8) == 0:
            for i in cutlass.range_constexpr(cute.size(acc)):
                h = (i // 2) % 2
                if cutlass.const_expr(rows_per_token < 16 or h == 0):
                    value = acc[i]
                    if cutlass.const_expr(rows_per_token == 16):
                        value = value + acc[i + 2]
                    token = (tScS[i][0] % 16) // rows_per_token
                    staged[(warp_idx * tokens_per_warp + token) * TILE_KEYS + tScS[i][1]] = value

    @cute.jit
    def add_staged(self, c_start, scores, staged, first_key, position, warp_idx, lane):
        """The warp's staged sums onto selection blocks: block j of a token takes its compressed
        blocks i with i * d < (j + 1) * l' and i * d + l > j * l'. A token of more than 16 rows
        spans warps, which add with atomics."""
        cfg = self.cfg
        g, d, l, lsel, cap = cfg.group, cfg.stride, cfg.block, cfg.select_block, cfg.score_capacity
        rows_per_token = min(g, 16)
        tokens_per_warp = 16 // rows_per_token
        # selection blocks 64 consecutive compressed blocks overlap
        span = (63 * d + l - 1) // lsel + 2
        for idx in cutlass.range(lane, tokens_per_warp * span, 32, unroll=1):
            q = idx // span
            p = warp_idx * tokens_per_warp + q
            if cutlass.const_expr(g > 16):
                p = warp_idx * 16 // g
            i_start = c_start - first_key[p]  # column 0's compressed block in the token's sequence
            j = cutlass.max(i_start, 0) * d // lsel + idx % span
            i_lo = cutlass.max((j * lsel - l + 1 + d - 1) // d, 0)
            if j * lsel - l + 1 <= 0:
                i_lo = Int32(0)
            i_hi = ((j + 1) * lsel - 1) // d
            n_lo = cutlass.max(i_lo - i_start, 0)
            n_hi = cutlass.min(i_hi - i_start, TILE_KEYS - 1)
            if position[p] >= 0 and n_lo <= n_hi and j < cap:
                total = Float32(0.0)
                base = (warp_idx * tokens_per_warp + q) * TILE_KEYS
                for n in cutlass.range(n_lo, n_hi + 1, unroll=1):
                    total += staged[base + n]
                if cutlass.const_expr(g > 16):
                    cute.arch.atomic_add(scores.iterator + (p * cap + j), total)
                else:
                    scores[p * cap + j] = scores[p * cap + j] + total

    @cute.jit
    def rank_blocks(self, mOut, t_start, head_k, scores, position, tidx):
        """One warp per token: the forced blocks, then the best scores, ascending."""
        cfg = self.cfg
        n, cap, lsel = cfg.select_count, cfg.score_capacity, cfg.select_block
        lane = tidx % 32
        # forced blocks outrank every score: a block's score is at most the group's head count
        top = Float32(2.0 * cfg.group + 2.0)
        for p in cutlass.range(tidx // 32, cfg.tokens_per_tile, WARPS, unroll=1):
            pos = position[p]
            if pos >= 0:
                t = t_start + p
                current = cutlass.min(pos // lsel, cap - 1)  # below cap unless the offsets are bad
                if current + 1 <= n:  # every block so far
                    if lane < n:
                        mOut[t, head_k, lane] = cutlass.select_(lane <= current, lane, Int32(-1))
                else:
                    base = p * cap
                    if lane == 0:  # the forced tiers, later ones overriding: first, previous, current
                        scores[base] = top
                        scores[base + current - 1] = 2.0 * top
                        scores[base + current] = 3.0 * top
                    cute.arch.sync_warp()
                    mine = Int32(0)
                    for k in cutlass.range(n, unroll=1):
                        best = Float32(-1.0)
                        best_j = Int32(cap)
                        for j in cutlass.range(lane, current + 1, 32, unroll=1):
                            v = scores[base + j]
                            if v > best:  # ascending j: the lower block keeps a tie
                                best, best_j = v, j
                        for s in cutlass.range_constexpr(5):
                            other = cute.arch.shuffle_sync_bfly(best, offset=1 << s)
                            other_j = cute.arch.shuffle_sync_bfly(best_j, offset=1 << s)
                            if other > best or (other == best and other_j < best_j):
                                best, best_j = other, other_j
                        if lane == k:
                            mine = best_j
                        if best_j % 32 == lane:  # its owner takes it out of the running
                            scores[base + best_j] = Float32(-2.0)
                    # ascending: each chosen block's rank among the chosen
                    rank = Int32(0)
                    for k in cutlass.range(n, unroll=1):
                        other = cute.arch.shuffle_sync(mine, k)
                        if other < mine:
                            rank += 1
                    if lane < n:
                        mOut[t, head_k, rank] = mine
