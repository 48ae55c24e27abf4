"""The KV-cache append pass: ``attention_with_kvcache``'s new keys and values written into the cache
at positions ``cache_seqlens[b] ..`` before the attention kernel reads it, in one launch.
Architecture-independent: plain loads and stores, one CTA per (new position, K/V head, batch
entry), one thread per column of the wider head dim.

A position past the cache (or below 0), or on a block-table entry that is not a page of the cache,
writes nothing (the attention kernel flags the call, ``fmha.device_errors``); nothing is read back
on the host, so the pass captures in a CUDA graph."""

from dataclasses import dataclass
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass.cute as cute
import torch
from cutlass import Int32, const_expr


@dataclass(frozen=True)
class KvAppendConfig:
    dtype: torch.dtype
    head_dim: int
    head_dim_v: int
    paged: bool


class KvAppend:
    def __init__(self, cfg: KvAppendConfig):
        self.cfg = cfg

    @cute.jit
    def __call__(self, mKNew: cute.Tensor, mVNew: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
                 mCacheSeqlens: cute.Tensor, mBlockTable: Optional[cute.Tensor], capacity: Int32,
                 stream: cuda.CUstream):
        """mKNew (B, S_new, H_k, D), mVNew (B, S_new, H_k, D_v); mK/mV dense (B, S_max, H_k, D[_v])
        or paged (num_pages, page_size, H_k, D[_v]) with mBlockTable (B, max_pages); ``capacity``:
        positions per sequence (S_max, or max_pages x page_size)."""
        batch, s_new, heads = mKNew.shape[0], mKNew.shape[1], mKNew.shape[2]
        self.kernel(mKNew, mVNew, mK, mV, mCacheSeqlens, mBlockTable, capacity).launch(
            grid=[s_new, heads, batch], block=[max(self.cfg.head_dim, self.cfg.head_dim_v), 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mKNew: cute.Tensor, mVNew: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
               mCacheSeqlens: cute.Tensor, mBlockTable: Optional[cute.Tensor], capacity: Int32):
        i, h, b = cute.arch.block_idx()
        col, _, _ = cute.arch.thread_idx()
        pos = mCacheSeqlens[b] + i
        row = b
        slot = pos
        fits = (pos >= 0) & (pos < capacity)
        if const_expr(self.cfg.paged):
            page_size = mK.shape[1]
            logical = pos // page_size
            fits = fits & (logical < mBlockTable.shape[1])
            page = Int32(-1)
            if fits:
                page = mBlockTable[b, logical]
            fits = fits & (page >= 0) & (page < mK.shape[0])
            row = page
            slot = pos - logical * page_size
        if fits:
            if col < self.cfg.head_dim:
                mK[row, slot, h, col] = mKNew[b, i, h, col]
            if col < self.cfg.head_dim_v:
                mV[row, slot, h, col] = mVNew[b, i, h, col]
