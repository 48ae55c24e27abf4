"""The backward's per-row inputs, in one pass before its main kernel.

For every (query row, head): ``delta = (rowsum(dO * O) - dLSE) * delta_scale`` in fp32 (the
bf16 backward passes its score scale, so that dS comes out scaled) and the LSE in log2 units
(+inf for rows that keep no key, whose LSE is -inf: their P = exp2(s - inf) is then 0); and the
row's share of the tiled fp32 dQ accumulator zeroed, which saves a separate fill pass over it.
Each row is read by a group of threads, 16-byte pieces of O and of dO each (a group's lanes read
adjacent pieces, so that a warp's loads cover whole cache lines); the group adds its partial sums
by butterfly shuffles. The outputs
have the LSE's layout.
"""

import math
from dataclasses import dataclass
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, const_expr

from .seqinfo import SequenceInfo

THREADS_PER_CTA = 256
LOAD_BYTES = 16


@dataclass(frozen=True)
class BackwardRowsConfig:
    """What selects a different compiled row pass."""

    dtype: torch.dtype
    head_dim: int
    varlen: bool
    has_dlse: bool
    #: query rows per tile of the dQ accumulator (the Hopper backward's fragment-ordered one,
    #: ``kernels/hopper/dq_layout.py``): (B, H, tiles, tile_m * D) / varlen (H, tiles, tile_m * D),
    #: sequence b's tiles from (cu_seqlens[b] + b * tile_m) // tile_m
    dq_tile_m: int
    #: Q's head dim, the accumulator's D (``head_dim`` is O's); None: O's
    dq_head_dim: int = None

    @property
    def pieces_per_row(self) -> int:
        """16-byte pieces of a row of O."""
        return self.head_dim * self.dtype.itemsize // LOAD_BYTES

    @property
    def threads_per_row(self) -> int:
        """The largest power of two up to 32 that divides the row's pieces (the group must not
        straddle a warp, and its butterfly needs a power of two): D=128 in bf16 one piece per thread
        over 16 threads, D=96 three pieces per thread over 4."""
        pieces = self.pieces_per_row
        return min(pieces & -pieces, 32)

    @property
    def pieces_per_thread(self) -> int:
        return self.pieces_per_row // self.threads_per_row

    @property
    def dq_chunks_per_lane(self) -> int:
        """Chunks of an accumulator row (8 floats each) that each lane of a row's group zeroes."""
        return -(-(self.dq_head_dim // 8) // self.threads_per_row)

    def __post_init__(self):
        if self.dq_head_dim is None:
            object.__setattr__(self, "dq_head_dim", self.head_dim)
        if self.pieces_per_row < 1 or self.pieces_per_row * LOAD_BYTES != self.head_dim * self.dtype.itemsize:
            raise ValueError(f"the backward's row pass needs head_dim * element size to be a multiple of 16 bytes, "
                             f"got head_dim {self.head_dim} of {self.dtype}")


def tile_rows_zeroed(row_in_tile, last_of_sequence, tile_m: int) -> tuple:
    """The tile-local rows ``[first, stop)`` whose ``D`` consecutive floats a query row's group
    zeroes in a tiled accumulator (one whose tile of ``tile_m`` rows is ``tile_m * D`` floats in an
    order of its own): its own index's, and with the sequence's last row (``last_of_sequence`` 1,
    else 0) the rest of its tile, so that the real rows of every tile together cover the whole tile
    with contiguous stores. Plain arithmetic: the same function serves Python ints (tests) and the
    kernel's values."""
    return row_in_tile, row_in_tile + 1 + last_of_sequence * (tile_m - 1 - row_in_tile)


class BackwardRows:
    def __init__(self, cfg: BackwardRowsConfig):
        self.cfg = cfg
        self.rows_per_cta = THREADS_PER_CTA // cfg.threads_per_row

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mdLSE: Optional[cute.Tensor],
                 mLSE2: cute.Tensor, mDelta: cute.Tensor, mdQaccum: cute.Tensor, mCuSeqlensQ: Optional[cute.Tensor],
                 delta_scale: Float32, stream: cuda.CUstream):
        """O, dO: (B, S, H, D) or varlen (T, H, D); LSE, dLSE, LSE2, delta: (B, H, S) or (H, T); dQaccum:
        see ``dq_tile_m``; cu_seqlens (B + 1,): varlen only."""
        if const_expr(self.cfg.varlen):
            rows, heads, batches = mO.shape[0], mO.shape[1], 1
        else:
            rows, heads, batches = mO.shape[1], mO.shape[2], mO.shape[0]
        self.kernel(mO, mdO, mLSE, mdLSE, mLSE2, mDelta, mdQaccum, mCuSeqlensQ, delta_scale, rows).launch(
            grid=[(rows + self.rows_per_cta - 1) // self.rows_per_cta, heads, batches], block=[THREADS_PER_CTA, 1, 1],
            stream=stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mdLSE: Optional[cute.Tensor],
               mLSE2: cute.Tensor, mDelta: cute.Tensor, mdQaccum: cute.Tensor, mCuSeqlensQ: Optional[cute.Tensor],
               delta_scale: Float32, rows: Int32):
        group = self.cfg.threads_per_row
        piece = LOAD_BYTES // self.cfg.dtype.itemsize  # elements of O per thread
        tidx, _, _ = cute.arch.thread_idx()
        block, head, batch = cute.arch.block_idx()
        lane = tidx % group
        row = block * self.rows_per_cta + tidx // group
        partial = Float32(0.0)
        if row < rows:
            if const_expr(self.cfg.varlen):
                o_row, do_row = mO[row, head, None], mdO[row, head, None]
            else:
                o_row, do_row = mO[batch, row, head, None], mdO[batch, row, head, None]
            for i in cutlass.range_constexpr(self.cfg.pieces_per_thread):
                at = lane + i * group
                o_piece, do_piece = (cute.local_tile(t, (piece,), (at,)) for t in (o_row, do_row))
                o = cute.make_rmem_tensor(o_piece.layout, o_piece.element_type)
                do = cute.make_rmem_tensor(do_piece.layout, do_piece.element_type)
                cute.autovec_copy(o_piece, o)
                cute.autovec_copy(do_piece, do)
                partial = partial + (o.load().to(Float32) * do.load().to(Float32)).reduce(
                    cute.ReductionOp.ADD, Float32(0.0), 0)
            self.zero_tile_rows(mdQaccum, mCuSeqlensQ, row, rows, head, batch, lane)
        # every lane of the warp takes part (a row's group never straddles a warp)
        for i in cutlass.range_constexpr(group.bit_length() - 1):
            partial = partial + cute.arch.shuffle_sync_bfly(partial, offset=group >> (i + 1))
        if row < rows and lane == 0:
            at = (head, row) if const_expr(self.cfg.varlen) else (batch, head, row)
            delta = partial
            if const_expr(mdLSE is not None):
                delta = delta - mdLSE[at]
            mDelta[at] = delta * delta_scale
            lse = mLSE[at]
            lse2 = lse * Float32(math.log2(math.e))
            if lse == -Float32(math.inf):
                lse2 = Float32(math.inf)
            mLSE2[at] = lse2

    @cute.jit
    def zero_tile_rows(self, mdQaccum: cute.Tensor, mCuSeqlensQ: Optional[cute.Tensor], row, rows, head, batch, lane):
        """Zero the columns of this ``lane``'s pieces of O (16-byte loads' worth each) in the tiled
        accumulator's rows that ``tile_rows_zeroed`` gives query row ``row``: a warp's stores cover
        whole lines, whatever the order within the tile (that of the fragments, which would
        scatter them)."""
        tile_m, d = self.cfg.dq_tile_m, self.cfg.dq_head_dim
        piece = LOAD_BYTES // self.cfg.dtype.itemsize
        start, end = Int32(0), rows
        if const_expr(self.cfg.varlen):
            # the sequence of this packed row: the last b with cu_seqlens[b] <= row (empty ones
            # skipped); offsets the host did not read are clamped as every kernel clamps them, and
            # a row outside its sequence's clamped rows (bad offsets, flagged later) zeroes nothing
            lo, hi = Int32(0), Int32(mCuSeqlensQ.shape[0] - 2)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if mCuSeqlensQ[mid] <= row:
                    lo = mid
                else:
                    hi = mid - 1
            seq = SequenceInfo.create(lo, rows, rows, mCuSeqlensQ, mCuSeqlensQ)
            start, end = seq.offset_q, seq.offset_q + seq.seqlen_q
            batch = lo
        if row >= start and row < end:
            padded = row - start
            if const_expr(self.cfg.varlen):
                padded = (start + batch * tile_m) // tile_m * tile_m + padded  # dq_layout.first_tile
                tile = mdQaccum[head, padded // tile_m, None]
            else:
                tile = mdQaccum[batch, head, padded // tile_m, None]
            first, stop = tile_rows_zeroed(padded % tile_m, Int32(row == end - 1), tile_m)
            zeros = cute.make_rmem_tensor((piece,), Float32)
            zeros.fill(0.0)
            chunks = d // piece
            for r in cutlass.range(first, stop, unroll=1):
                for i in cutlass.range_constexpr(self.cfg.dq_chunks_per_lane):
                    at = lane + i * self.cfg.threads_per_row
                    if const_expr(chunks % self.cfg.threads_per_row == 0):
                        cute.autovec_copy(zeros, cute.local_tile(tile, (piece,), (r * chunks + at,)))
                    elif at < chunks:
                        cute.autovec_copy(zeros, cute.local_tile(tile, (piece,), (r * chunks + at,)))
