"""The backward's per-row inputs, in one pass before its main kernel.

For every (query row, head): ``delta = (rowsum(dO * O) - dLSE) * delta_scale`` in fp32 (the
bf16 backward passes its score scale, so that dS comes out scaled) and the LSE in log2 units
(+inf for rows that keep no key, whose LSE is -inf: their P = exp2(s - inf) is then 0). One thread
per row reads the row's O and dO with 16-byte loads; the outputs have the LSE's layout. Doing
this in torch instead took fp32 copies of O and dO and four more passes over them.
"""

import math
from dataclasses import dataclass
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, const_expr

ROWS_PER_CTA = 128


@dataclass(frozen=True)
class BackwardRowsConfig:
    """What selects a different compiled row pass."""

    dtype: torch.dtype
    head_dim: int
    varlen: bool
    has_dlse: bool


class BackwardRows:
    def __init__(self, cfg: BackwardRowsConfig):
        self.cfg = cfg

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mdLSE: Optional[cute.Tensor],
                 mLSE2: cute.Tensor, mDelta: cute.Tensor, delta_scale: Float32, stream: cuda.CUstream):
        """O, dO: (B, S, H, D) or varlen (T, H, D); LSE, dLSE, LSE2, delta: (B, H, S) or (H, T)."""
        if const_expr(self.cfg.varlen):
            rows, heads, batches = mO.shape[0], mO.shape[1], 1
        else:
            rows, heads, batches = mO.shape[1], mO.shape[2], mO.shape[0]
        self.kernel(mO, mdO, mLSE, mdLSE, mLSE2, mDelta, delta_scale, rows).launch(
            grid=[(rows + ROWS_PER_CTA - 1) // ROWS_PER_CTA, heads, batches], block=[ROWS_PER_CTA, 1, 1],
            stream=stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mdLSE: Optional[cute.Tensor],
               mLSE2: cute.Tensor, mDelta: cute.Tensor, delta_scale: Float32, rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        block, head, batch = cute.arch.block_idx()
        row = block * ROWS_PER_CTA + tidx
        if row < rows:
            if const_expr(self.cfg.varlen):
                o_row, do_row = mO[row, head, None], mdO[row, head, None]
                at = (head, row)
            else:
                o_row, do_row = mO[batch, row, head, None], mdO[batch, row, head, None]
                at = (batch, head, row)
            o = cute.make_rmem_tensor(o_row.layout, o_row.element_type)
            do = cute.make_rmem_tensor(do_row.layout, do_row.element_type)
            cute.autovec_copy(o_row, o)
            cute.autovec_copy(do_row, do)
            delta = (o.load().to(Float32) * do.load().to(Float32)).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            if const_expr(mdLSE is not None):
                delta = delta - mdLSE[at]
            mDelta[at] = delta * delta_scale
            lse = mLSE[at]
            lse2 = lse * Float32(math.log2(math.e))
            if lse == -Float32(math.inf):
                lse2 = Float32(math.inf)
            mLSE2[at] = lse2
