"""Where one batch entry's rows are, for dense and packed (varlen) inputs alike."""

from dataclasses import dataclass
from typing import Optional

import cutlass.cute as cute
from cutlass import Int32


@dataclass(frozen=True)
class SequenceInfo:
    """Sequence ``batch``'s first row in the token dim and its length, for queries and keys.
    Dense batches start every sequence at row 0 of its own batch entry and take the tensors'
    lengths; packed ones read ``cu_seqlens`` (whether they are given is static)."""

    offset_q: Int32
    seqlen_q: Int32
    offset_k: Int32
    seqlen_k: Int32

    @staticmethod
    def create(batch: Int32, seqlen_q_static, seqlen_k_static, cu_seqlens_q: Optional[cute.Tensor] = None,
               cu_seqlens_k: Optional[cute.Tensor] = None) -> "SequenceInfo":
        if cu_seqlens_q is None:
            return SequenceInfo(Int32(0), seqlen_q_static, Int32(0), seqlen_k_static)
        offset_q = cu_seqlens_q[batch]
        seqlen_q = cu_seqlens_q[batch + 1] - offset_q
        offset_k = cu_seqlens_k[batch]
        return SequenceInfo(offset_q, seqlen_q, offset_k, cu_seqlens_k[batch + 1] - offset_k)
