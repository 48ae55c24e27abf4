"""Where one batch entry's rows are, for dense and packed (varlen) inputs alike."""

from dataclasses import dataclass
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Int32


@dataclass(frozen=True)
class SequenceInfo:
    """Sequence ``batch``'s first row in the token dim and its length, for queries and keys.
    Dense batches start every sequence at row 0 of its own batch entry and take the tensors'
    lengths; packed ones read ``cu_seqlens`` (whether they are given is static).

    Packed offsets the host did not read may be wrong; they are clamped here, so that every
    kernel sees the same rows and none lies outside the tensors (``total_*``: their row counts)
    or past ``max_seqlen_*`` where the launch was sized by it. The descriptor kernel flags the
    offsets that needed it (``sequence_descriptors.flag_bad_offsets``)."""

    offset_q: Int32
    seqlen_q: Int32
    offset_k: Int32
    seqlen_k: Int32

    @staticmethod
    def create(batch: Int32, seqlen_q_static, seqlen_k_static, cu_seqlens_q: Optional[cute.Tensor] = None,
               cu_seqlens_k: Optional[cute.Tensor] = None, max_seqlen_q=None, max_seqlen_k=None,
               cache_seqlens: Optional[cute.Tensor] = None) -> "SequenceInfo":
        """``seqlen_*_static``: dense, the sequence lengths; packed, the tensors' row counts.
        ``cache_seqlens``: packed queries over a KV cache (a mixed batch): the keys are the first
        ``cache_seqlens[batch]`` of sequence ``batch``'s cache, which holds ``seqlen_k_static``.
        Packed queries without either: the keys are ``seqlen_k_static`` rows from row 0."""
        if cu_seqlens_q is None:
            return SequenceInfo(Int32(0), seqlen_q_static, Int32(0), seqlen_k_static)
        offset_q, seqlen_q = _rows(cu_seqlens_q, batch, seqlen_q_static, max_seqlen_q)
        if cutlass.const_expr(cache_seqlens is not None):
            return SequenceInfo(offset_q, seqlen_q, Int32(0), _cache_length(cache_seqlens, batch, seqlen_k_static))
        if cutlass.const_expr(cu_seqlens_k is None):
            return SequenceInfo(offset_q, seqlen_q, Int32(0), seqlen_k_static)
        offset_k, seqlen_k = _rows(cu_seqlens_k, batch, seqlen_k_static, max_seqlen_k)
        return SequenceInfo(offset_q, seqlen_q, offset_k, seqlen_k)

    @staticmethod
    def with_cache_length(batch: Int32, seqlen_q, cache_seqlens: cute.Tensor, capacity) -> "SequenceInfo":
        """A dense query block over a cache whose sequence ``batch`` holds ``cache_seqlens[batch]``
        keys, clamped to ``[0, capacity]`` (what the cache can hold; the kernel flags the rest)."""
        return SequenceInfo(Int32(0), seqlen_q, Int32(0), _cache_length(cache_seqlens, batch, capacity))


def _cache_length(cache_seqlens: cute.Tensor, batch: Int32, capacity):
    """Sequence ``batch``'s cached keys, within ``[0, capacity]`` (the kernel flags the rest)."""
    return cutlass.min(cutlass.max(cache_seqlens[batch], 0), capacity)


def _rows(cu_seqlens: cute.Tensor, batch: Int32, total, max_seqlen):
    """(first row, length) of sequence ``batch``, within [0, total) and at most ``max_seqlen``."""
    start = cutlass.min(cutlass.max(cu_seqlens[batch], 0), total)
    length = cutlass.min(cutlass.max(cu_seqlens[batch + 1], start), total) - start
    if max_seqlen is not None:
        length = cutlass.min(length, max_seqlen)
    return start, length
