"""The backward's last pass: dQ (q's dtype) from the fragment-ordered fp32 accumulator.

One CTA per (query tile, head, sequence): its 256 threads read the tile's two warpgroup blocks in
16-byte pieces in their stored order (``dq_layout.py``: thread t of a block reads what the MMA's
thread t held), write the converted values into a row-major tile in shared memory, and then copy
its rows out in 16-byte pieces, stopping at the sequence's end. The main kernel has scaled dQ
already; this pass only converts and reorders.
"""

from dataclasses import dataclass
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, const_expr
from cutlass.memory import SmemAllocator

from ..common.seqinfo import SequenceInfo
from . import dq_layout
from .wgmma import WARPGROUP_THREADS as _WG

THREADS = 256
#: elements of padding per shared-memory row: its pair stores (8 rows x 4 threads a warp) land in
#: distinct banks, and rows stay 16-byte aligned
_PAD = 8


@dataclass(frozen=True)
class DqConvertConfig:
    """What selects a different compiled conversion."""

    dtype: torch.dtype
    head_dim: int
    tile_m: int
    #: rows x columns of one warpgroup's block; how blocks and the MMA's rows map to the tile
    block_rows: int
    block_cols: int
    split_rows: bool
    transposed: bool
    varlen: bool

    @staticmethod
    def of(cfg) -> "DqConvertConfig":
        """The conversion for a ``HopperBackwardConfig``'s accumulator."""
        return DqConvertConfig(cfg.dtype, cfg.head_dim, cfg.tile_m, cfg.dq_rows_per_warpgroup,
                               cfg.dq_cols_per_warpgroup, cfg.dq_split_rows, cfg.dq_transposed, cfg.varlen)


class DqConvert:
    def __init__(self, cfg: DqConvertConfig):
        self.cfg = cfg
        # the MMA's N (columns of its accumulator) in 8-column chunks
        self.chunks = (cfg.block_rows if cfg.transposed else cfg.block_cols) // 8
        self.block = cfg.block_rows * cfg.block_cols

    @cute.jit
    def __call__(self, mAcc: cute.Tensor, mdQ: cute.Tensor, mCuSeqlensQ: Optional[cute.Tensor], max_seqlen_q: Int32,
                 stream: cuda.CUstream):
        """Dense: acc (B, H, tiles, tile floats), dQ (B, S, H, D). Varlen: acc (H, tiles, tile
        floats), dQ (T, H, D), cu_seqlens (B + 1,)."""
        tile_m = self.cfg.tile_m
        if const_expr(self.cfg.varlen):
            heads, batches, seqlen = mdQ.shape[1], mCuSeqlensQ.shape[0] - 1, max_seqlen_q
        else:
            heads, batches, seqlen = mdQ.shape[2], mdQ.shape[0], mdQ.shape[1]
        row_stride = self.cfg.head_dim + _PAD
        smem = cute.size_in_bytes(mdQ.element_type, cute.make_layout(tile_m * row_stride))
        self.kernel(mAcc, mdQ, mCuSeqlensQ, max_seqlen_q).launch(
            grid=[(seqlen + tile_m - 1) // tile_m, heads, batches], block=[THREADS, 1, 1], smem=smem, stream=stream)

    @cute.kernel
    def kernel(self, mAcc: cute.Tensor, mdQ: cute.Tensor, mCuSeqlensQ: Optional[cute.Tensor], max_seqlen_q: Int32):
        cfg = self.cfg
        d, tile_m = cfg.head_dim, cfg.tile_m
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        if const_expr(cfg.varlen):
            seq = SequenceInfo.create(batch, mdQ.shape[0], mdQ.shape[0], mCuSeqlensQ, mCuSeqlensQ, max_seqlen_q,
                                      max_seqlen_q)
            tile = mAcc[head, dq_layout.first_tile(seq.offset_q, batch, tile_m) + m_block, None]
            rows = seq.seqlen_q
        else:
            seq = SequenceInfo.create(batch, mdQ.shape[1], mdQ.shape[1])
            tile = mAcc[batch, head, m_block, None]
            rows = seq.seqlen_q
        m0 = m_block * tile_m
        if m0 < rows:
            row_stride = d + _PAD
            smem = SmemAllocator()
            sTile = smem.allocate_tensor(mdQ.element_type, cute.make_layout((tile_m, d), stride=(row_stride, 1)), 16)
            wg, t = tidx // _WG, tidx % _WG
            # the MMA's row of this thread's registers 0-1 (2-3 are 8 below) and its first column
            mma_row, mma_col = 16 * (t // 32) + (t % 32) // 4, 2 * (t % 4)
            piece = cute.make_rmem_tensor((4,), Float32)
            for k in cutlass.range_constexpr(self.chunks):
                src = cute.local_tile(tile, (4,), (wg * (self.block // 4) + k * _WG + t,))
                cute.autovec_copy(src, piece)
                for i in cutlass.range_constexpr(4):
                    r, c = mma_row + 8 * (i // 2), mma_col + 8 * k + i % 2
                    if const_expr(cfg.transposed):  # the MMA's rows are this block's head dims
                        row, col = c, wg * cfg.block_cols + r
                    elif const_expr(cfg.split_rows):
                        row, col = wg * cfg.block_rows + r, c
                    else:
                        row, col = r, wg * cfg.block_cols + c
                    sTile[row, col] = piece[i].to(mdQ.element_type)
            cute.arch.sync_threads()
            per_row = d // 8  # 16-byte pieces
            for p in cutlass.range(tidx, tile_m * per_row, THREADS, unroll=1):
                row, part = p // per_row, p % per_row
                if m0 + row < rows:
                    if const_expr(cfg.varlen):
                        dst_row = mdQ[seq.offset_q + m0 + row, head, None]
                    else:
                        dst_row = mdQ[batch, m0 + row, head, None]
                    cute.autovec_copy(cute.local_tile(sTile[row, None], (8,), (part,)),
                                      cute.local_tile(dst_row, (8,), (part,)))
