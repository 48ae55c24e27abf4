"""The GPU kernel behind ``v_staging.stage_v_fp8``: V (B, S_k, H_k, D) fp8 -> (B, H_k, D, S_pad)
with keys permuted per block of 32 (``FP8_KEY_ORDER``) and zeros past each sequence's end.

A byte transpose that torch can only do as a strided element-wise copy (one byte per thread,
reads 32x amplified) at a fraction of the memory bandwidth. A CTA stages a tile of 128 keys x D
bytes in shared memory with 16-byte loads (a warp reads whole key rows), then each thread turns
four slot words x 4 head-dim bytes into four 16-byte pieces of four head-dim rows with byte
permutes, so that a warp's store writes 128 contiguous bytes of each of four rows (whole lines
where S_pad is a multiple of 128 keys, else whole 32-byte sectors). (Writing each
thread's 32 keys of 4 rows straight from registers put one 16-byte piece of a different row in
each lane's store: ncu read the L2 at 75% of its throughput and the DRAM at 26%.) Everything is
moved as int32, so the kernel never sees an fp8 type.
"""

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass.memory import SmemAllocator

from fmha.jit.compile import compile_for

from ..common.fp8_order import FP8_KEY_BLOCK as KEY_BLOCK
from ..common.fp8_order import FP8_KEY_ORDER

_THREADS = 128
#: keys of a CTA's tile: four blocks of 32
_TILE_KEYS = 4 * KEY_BLOCK
#: 16-byte pieces of a head-dim row per tile (four slot words each); a warp's store covers
#: all of them for four rows
_ROW_PIECES = _TILE_KEYS // 16

# Slot word q of piece p (slots 16p + 4q .. + 3) holds keys 16p + 2q + (0, 1, 8, 9) of the tile.
_KEY_OFFSETS = (0, 1, 8, 9)
assert all(FP8_KEY_ORDER[4 * w + i] == 16 * (w // 4) + 2 * (w % 4) + _KEY_OFFSETS[i]
           for w in range(KEY_BLOCK // 4) for i in range(4))


def transpose_4x4_bytes(prmt, a, b, c, d):
    """Four words of 4 bytes each (one per key) -> four words, word j holding byte j of a, b, c,
    d; ``prmt`` is ``cute.arch.prmt`` (or, in the tests, a model of it on Python ints)."""
    ab_lo, ab_hi = prmt(a, b, 0x5140), prmt(a, b, 0x7362)  # a0 b0 a1 b1 | a2 b2 a3 b3
    cd_lo, cd_hi = prmt(c, d, 0x5140), prmt(c, d, 0x7362)
    return (prmt(ab_lo, cd_lo, 0x5410), prmt(ab_lo, cd_lo, 0x7632),
            prmt(ab_hi, cd_hi, 0x5410), prmt(ab_hi, cd_hi, 0x7632))


class StageVKernel:
    def __init__(self, head_dim: int, varlen: bool):
        assert head_dim % 16 == 0
        self.words = head_dim // 4  # 4-byte words of a key row
        self.varlen = varlen
        # a key row's 16-byte pieces sit XOR-ed with 4 x its 16-key group (mod this), so that the
        # eight pieces of a warp's loads read distinct banks (D >= 128; 2-way at D=64, 4-way at 32)
        self.swizzle_groups = min(_ROW_PIECES, head_dim // 16)

    @cute.jit
    def __call__(self, src: cute.Tensor, dst: cute.Tensor, cu_seqlens: Optional[cute.Tensor],
                 stream: cuda.CUstream):
        """src: int32 words of V, (B, S_k, H_k, D / 4) or varlen (T_k, H_k, D / 4);
        dst: int32 words of the staged V, (B, H_k, D, S_pad / 4)."""
        num_blocks = dst.shape[3] // (KEY_BLOCK // 4)
        grid_x = (num_blocks * KEY_BLOCK + _TILE_KEYS - 1) // _TILE_KEYS
        self.kernel(src, dst, cu_seqlens, num_blocks).launch(
            grid=[grid_x, dst.shape[1], dst.shape[0]], block=[_THREADS, 1, 1],
            smem=_TILE_KEYS * self.words * 4, stream=stream)

    def swizzled(self, key, word):
        """The shared-memory column of ``word`` in the row of tile key ``key``."""
        return word ^ (4 * ((key // 16) % self.swizzle_groups))

    @cute.kernel
    def kernel(self, src: cute.Tensor, dst: cute.Tensor, cu_seqlens: Optional[cute.Tensor],
               num_blocks: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        tile, head, batch = cute.arch.block_idx()
        words = self.words
        smem = SmemAllocator()
        sRaw = smem.allocate_tensor(Int32, cute.make_layout((_TILE_KEYS, words), stride=(words, 1)), 16)
        if const_expr(self.varlen):
            first = cu_seqlens[batch]
            seqlen = cu_seqlens[batch + 1] - first
        else:
            first = Int32(0)
            seqlen = src.shape[1]
        key0 = tile * _TILE_KEYS
        # the tile's key rows, 16 bytes per thread and load; zeros past the end (P is 0 there, and
        # 0 * (whatever was there) must stay 0)
        pieces = words // 4
        piece = cute.make_rmem_tensor((4,), Int32)
        for i in cutlass.range_constexpr(_TILE_KEYS * pieces // _THREADS):
            c = tidx + i * _THREADS
            key, col = c // pieces, (c % pieces) * 4
            piece.fill(0)
            if key0 + key < seqlen:
                if const_expr(self.varlen):
                    row = src[first + key0 + key, head, None]
                else:
                    row = src[batch, key0 + key, head, None]
                cute.autovec_copy(cute.local_tile(row, (4,), (col // 4,)), piece)
            cute.autovec_copy(piece, cute.local_tile(sRaw[key, None], (4,), (self.swizzled(key, col) // 4,)))
        cute.arch.sync_threads()
        # thread: piece p of the rows of head-dim word w (rows 4w .. 4w + 3), for every w it is given
        p = tidx % _ROW_PIECES
        copy128 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Int32, num_bits_per_copy=128)
        if tile * (_TILE_KEYS // KEY_BLOCK) + p // 2 < num_blocks:  # the piece's block of 32 keys is staged
            for w in cutlass.range(tidx // _ROW_PIECES, words, _THREADS // _ROW_PIECES, unroll=1):
                rows = [cute.make_rmem_tensor((4,), Int32) for _ in range(4)]
                for q in cutlass.range_constexpr(4):
                    keys = [16 * p + 2 * q + off for off in _KEY_OFFSETS]
                    out = transpose_4x4_bytes(cute.arch.prmt, *(sRaw[k, self.swizzled(k, w)] for k in keys))
                    for j in cutlass.range_constexpr(4):
                        rows[j][q] = out[j]
                for j in cutlass.range_constexpr(4):
                    run = dst[batch, head, 4 * w + j, None]
                    g = cute.local_tile(run, (4,), (tile * _ROW_PIECES + p,))
                    g = cute.make_tensor(cute.make_ptr(Int32, g.iterator.toint(), cute.AddressSpace.gmem,
                                                       assumed_align=16), cute.make_layout(4))
                    cute.copy(copy128, rows[j], g)


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
