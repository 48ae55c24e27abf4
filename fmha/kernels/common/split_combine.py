"""The split-KV combine pass: merge the fp32 partial results of ``num_splits`` CTAs that shared a
query tile's keys into O and the LSE (docs/semantics.md, "Merging partial results"), and undo
the GQA packing of the rows on the way (``fmha.split_kv``). Architecture-independent: plain
loads and stores, one CTA per (batch entry, packed row, K/V head), one thread per column of D.

A row's LSE is ``m + log(sum_s exp(lse_s - m))`` with ``m`` the largest split LSE; its O is the
sum of the splits' O weighted by ``exp(lse_s - LSE)``. A row no split kept anything of (every
``lse_s`` = -inf) gets O = 0 and LSE = -inf."""

import math
from dataclasses import dataclass
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, const_expr


@dataclass(frozen=True)
class SplitCombineConfig:
    out_dtype: torch.dtype
    head_dim: int
    has_lse: bool


class SplitCombine:
    def __init__(self, cfg: SplitCombineConfig):
        self.cfg = cfg

    @cute.jit
    def __call__(self, mOParts: cute.Tensor, mLseParts: cute.Tensor, mO: cute.Tensor, mLSE: Optional[cute.Tensor],
                 num_splits: Int32, rows_per_query: Int32, stream: cuda.CUstream):
        """mOParts (n * B, R, H_k, D) fp32 and mLseParts (n * B, H_k, R), R = S_q * g packed rows;
        mO (B, S_q, H_k * g, D) and mLSE (B, H_k * g, S_q)."""
        num_rows, heads = mOParts.shape[1], mOParts.shape[2]
        batch = mO.shape[0]
        self.kernel(mOParts, mLseParts, mO, mLSE, num_splits, rows_per_query).launch(
            grid=[num_rows, heads, batch], block=[self.cfg.head_dim, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mOParts: cute.Tensor, mLseParts: cute.Tensor, mO: cute.Tensor, mLSE: Optional[cute.Tensor],
               num_splits: Int32, rows_per_query: Int32):
        row, head, b = cute.arch.block_idx()
        col, _, _ = cute.arch.thread_idx()
        batch = mO.shape[0]
        top = Float32(-math.inf)
        nan_seen = Int32(0)
        for s in cutlass.range(num_splits, unroll=1):
            part = mLseParts[s * batch + b, head, row]
            top = cute.arch.fmax(top, part)
            if part != part:
                nan_seen = Int32(1)
        if nan_seen != 0:  # fmax skips NaN: a NaN from the inputs stays NaN, as without a split
            top = Float32(math.nan)
        finite_top = top if top != Float32(-math.inf) else Float32(0.0)
        log2e = Float32(math.log2(math.e))
        total = Float32(0.0)
        acc = Float32(0.0)
        for s in cutlass.range(num_splits, unroll=1):
            # exp2 of -inf is 0: a split that kept nothing weighs nothing
            w = cute.math.exp2((mLseParts[s * batch + b, head, row] - finite_top) * log2e, fastmath=True)
            total += w
            acc += w * mOParts[s * batch + b, row, head, col]
        out = Float32(0.0)
        lse = Float32(-math.inf)
        if top != Float32(-math.inf):
            out = acc / total
            lse = finite_top + cute.math.log2(total, fastmath=True) / log2e
        position = row // rows_per_query
        head_q = head * rows_per_query + row % rows_per_query
        mO[b, position, head_q, col] = out.to(mO.element_type)
        if const_expr(mLSE is not None):
            if col == 0:
                mLSE[b, head_q, position] = lse
