"""Where a KV cache's keys are, for the decode configurations of the forward kernels.

A cache holds ``seqlens[b]`` keys for sequence b. Dense, they are the first rows of its batch
entry. Paged, key p is row ``p % page_size`` of page ``block_table[b, p //
page_size]`` of a cache the kernel sees as one run of ``num_pages * page_size`` rows. Values the
host did not read (lengths, page numbers) are clamped here so that nothing is read out of bounds,
and a bad one raises the device error flag (``fmha.device_errors``)."""

from dataclasses import dataclass
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .error_bits import BAD_BLOCK_TABLE, BAD_CACHE_LENGTH
from .errors import flag_error


# Frozen: the DSL treats it as read-only inside dynamic loops.
@dataclass(frozen=True)
class KvCache:
    seqlens: Optional[cute.Tensor]  # (B,) int32, or None without a cache
    block_table: Optional[cute.Tensor]  # (B, max_pages) int32, or None for a dense cache
    errors: Optional[cute.Tensor]  # (1,) int32 device error flag
    num_batches: Int32
    num_splits: Int32
    page_size: Int32
    paged: bool

    def capacity(self, mK_tma: cute.Tensor):
        """Keys a sequence can hold (``cache_capacity``)."""
        return cache_capacity(self.block_table if self.paged else None, self.page_size, mK_tma)

    @cute.jit
    def flag_bad_length(self, batch: Int32, mK_tma: cute.Tensor):
        length = self.seqlens[batch]
        if length < 0 or length > self.capacity(mK_tma):
            flag_error(self.errors, BAD_CACHE_LENGTH)

    def page_of(self, batch: Int32, key: Int32) -> Int32:
        """The block-table entry of sequence ``batch``'s key ``key`` (the table's last column
        for keys past it), unchecked: ``physical_row`` checks it."""
        return self.block_table[batch, cutlass.min(key // self.page_size, self.block_table.shape[1] - 1)]

    @cute.jit
    def physical_row(self, page: Int32, key: Int32, seqlen_k: Int32, num_rows: Int32) -> Int32:
        """The cache row of a key in ``page`` (``page_of``). Keys past the sequence (the rest of
        its last tile) read a clamped page: the kernel masks them and zeroes their V rows."""
        ps = self.page_size
        num_pages = num_rows // ps
        if (page < 0 or page >= num_pages) and key < seqlen_k:
            flag_error(self.errors, BAD_BLOCK_TABLE)
        page = cutlass.min(cutlass.max(page, 0), num_pages - 1)
        return page * ps + key % ps


def cache_capacity(block_table: Optional[cute.Tensor], page_size, mK: cute.Tensor):
    """Keys a sequence can hold: the block table's pages, or the dense cache's rows (mode 0 of
    ``mK``, keys first)."""
    if cutlass.const_expr(block_table is not None):
        return block_table.shape[1] * page_size
    return mK.shape[0]
