"""The GPU kernel behind ``v_staging.stage_v_fp8``: V (B, S_k, H_k, D) fp8 -> (B, H_k, D, S_pad)
with keys permuted per block of 32 (``FP8_KEY_ORDER``) and zeros past each sequence's end.

A byte transpose that torch can only do as a strided element-wise copy (one byte per thread,
reads 32x amplified) at a fraction of the memory bandwidth. Here each thread owns four
consecutive head-dim bytes of one block of 32 keys: it reads one 32-bit word per key (a warp
reads whole key rows, coalesced), transposes the 4 x 32 bytes in registers with byte permutes,
and writes four 32-byte runs of slots, one per head-dim row. Everything is moved as int32, so
the kernel never sees an fp8 type.
"""

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from fmha.jit.compile import compile_for

from ..common.fp8_order import FP8_KEY_BLOCK as KEY_BLOCK
from ..common.fp8_order import FP8_KEY_ORDER
from .v_relayout import transpose_4x4_bytes

_THREADS = 128

# Slots 4w .. 4w + 3 of a block hold the keys base, base + 1, base + 8, base + 9 (base =
# FP8_KEY_ORDER[4w]): each output word gathers one byte from each of four key words.
_WORD_KEYS = tuple(tuple(FP8_KEY_ORDER[4 * w + i] for i in range(4)) for w in range(KEY_BLOCK // 4))


class StageVKernel:
    def __init__(self, head_dim: int, varlen: bool):
        assert head_dim % 4 == 0 and _THREADS % (head_dim // 4) == 0
        self.words = head_dim // 4  # threads per key block: one per 4 head-dim bytes
        self.blocks_per_cta = _THREADS // self.words
        self.varlen = varlen

    @cute.jit
    def __call__(self, src: cute.Tensor, dst: cute.Tensor, cu_seqlens: Optional[cute.Tensor],
                 stream: cuda.CUstream):
        """src: int32 words of V, (B, S_k, H_k, D / 4) or varlen (T_k, H_k, D / 4);
        dst: int32 words of the staged V, (B, H_k, D, S_pad / 4)."""
        num_blocks = dst.shape[3] // (KEY_BLOCK // 4)
        grid_x = (num_blocks + self.blocks_per_cta - 1) // self.blocks_per_cta
        self.kernel(src, dst, cu_seqlens, num_blocks).launch(
            grid=[grid_x, dst.shape[1], dst.shape[0]], block=[_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, src: cute.Tensor, dst: cute.Tensor, cu_seqlens: Optional[cute.Tensor],
               num_blocks: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bx, head, batch = cute.arch.block_idx()
        word = tidx % self.words
        key_block = bx * self.blocks_per_cta + tidx // self.words
        if key_block < num_blocks:
            if const_expr(self.varlen):
                first = cu_seqlens[batch]
                seqlen = cu_seqlens[batch + 1] - first
            else:
                first = Int32(0)
                seqlen = src.shape[1]
            key0 = key_block * KEY_BLOCK
            keys = cute.make_rmem_tensor(KEY_BLOCK, Int32)
            for k in cutlass.range_constexpr(KEY_BLOCK):
                # Zeros past the end: P is 0 there, and 0 * (whatever was there) must stay 0.
                keys[k] = Int32(0)
                if key0 + k < seqlen:
                    if const_expr(self.varlen):
                        keys[k] = src[first + key0 + k, head, word]
                    else:
                        keys[k] = src[batch, key0 + k, head, word]
            # one run of slot words per head-dim byte of this thread
            rows = [cute.make_rmem_tensor(KEY_BLOCK // 4, Int32) for _ in range(4)]
            for w in cutlass.range_constexpr(KEY_BLOCK // 4):
                ka, kb, kc, kd = _WORD_KEYS[w]
                out = transpose_4x4_bytes(cute.arch.prmt, keys[ka], keys[kb], keys[kc], keys[kd])
                for j in cutlass.range_constexpr(4):
                    rows[j][w] = out[j]
            copy128 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Int32, num_bits_per_copy=128)
            for j in cutlass.range_constexpr(4):
                run = dst[batch, head, 4 * word + j, None]
                g = cute.local_tile(run, (KEY_BLOCK // 4,), (key_block,))
                g = cute.make_tensor(cute.make_ptr(Int32, g.iterator.toint(), cute.AddressSpace.gmem,
                                                   assumed_align=32), cute.make_layout(KEY_BLOCK // 4))
                cute.copy(copy128, cute.flat_divide(rows[j], (4,)), cute.flat_divide(g, (4,)))


def compile_stage_v(head_dim: int, varlen: bool, extra_options: str = ""):
    """Compile for sm_90a with symbolic sizes (no GPU needed); called with torch int32 views."""
    words = head_dim // 4
    sym, sym64 = cute.sym_int, cute.sym_int64
    if varlen:
        src = cute.runtime.make_fake_tensor(Int32, (sym(), sym(), words), stride=(sym64(divisibility=4), sym64(divisibility=4), 1), assumed_align=16)
        cu = cute.runtime.make_fake_tensor(Int32, (sym(),), stride=(1,), assumed_align=4)
    else:
        src = cute.runtime.make_fake_tensor(
            Int32, (sym(), sym(), sym(), words),
            stride=(sym64(divisibility=4), sym64(divisibility=4), sym64(divisibility=4), 1), assumed_align=16)
        cu = None
    dst = cute.runtime.make_fake_tensor(
        Int32, (sym(), sym(), head_dim, sym()),
        stride=(sym64(divisibility=8), sym64(divisibility=8), sym64(divisibility=8), 1), assumed_align=32)
    return compile_for("sm_90a", StageVKernel(head_dim, varlen), src, dst, cu, extra_options=extra_options)
