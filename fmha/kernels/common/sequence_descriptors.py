"""Varlen: one TMA descriptor per sequence and tensor, bounded to that sequence's rows.

A packed batch's tensors hold every sequence back to back, and a TMA box clips only at the
tensor's end. A query or key tile that runs past its sequence's last row would read the next
sequence's rows (whose V, if it held NaN or inf, would turn P = 0 into 0 * NaN), and a store past
it would write into the next sequence's output (the forward's O, the backward's dK and dV). So before the attention kernel a small
kernel (one warp per sequence, on the same stream) copies each TMA atom's descriptor and narrows it
to one sequence: base address at its first row, extent its length. The kernel then moves data
through the sequence's own descriptors, with coordinates relative to the sequence's first row, and
TMA zero-fills loads (and drops stores) past its end.
"""

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import cpasync
from cutlass.tensor_utils import TensorMapManager, TensorMapUpdateMode

from .error_bits import BAD_OFFSETS
from .errors import flag_error
from .seqinfo import SequenceInfo

#: which descriptor of a sequence's (forward: q, k, v, and O where it stores O by TMA; backward:
#: q, k, v, dO, and dK, dV where it stores them by TMA)
Q, K, V, DO, DK, DV = 0, 1, 2, 3, 4, 5
O = 3  # the forward's fourth: it has no dO


def sequence_descriptor(descriptors: cute.Tensor, batch, which: int, for_copy: bool = True):
    """Pointer to the 128-byte TMA descriptor of sequence ``batch`` for tensor ``which``: generic
    for the TMA copies that use it, global for the ops that write it."""
    manager = TensorMapManager(TensorMapUpdateMode.GMEM, 128)
    space = cute.AddressSpace.generic if for_copy else cute.AddressSpace.gmem
    return manager.get_tensormap_ptr(descriptors[batch, which, None].iterator, space)


@cute.jit
def acquire_descriptor(descriptors: cute.Tensor, batch, which: int):
    """Sequence ``batch``'s descriptor for ``which``, fenced for use by this thread's TMA copies."""
    desc = sequence_descriptor(descriptors, batch, which)
    cpasync.fence_tma_desc_acquire(desc)
    return desc


def sequence_rows(t: cute.Tensor, offset: Int32, length: Int32, row_mode: int) -> cute.Tensor:
    """``t`` restricted to ``length`` rows from row ``offset`` of its mode ``row_mode``."""
    shape = list(t.shape)
    shape[row_mode] = length
    return cute.make_tensor(t.iterator + offset * t.layout.stride[row_mode],
                            cute.make_layout(tuple(shape), stride=t.layout.stride))


@cute.jit
def write_sequence_descriptor(atom: cute.CopyAtom, rows: cute.Tensor, descriptors: cute.Tensor, batch,
                              which: int):
    """The whole warp: copy ``atom``'s descriptor into sequence ``batch``'s slot ``which`` and
    narrow it to ``rows``."""
    ptr = sequence_descriptor(descriptors, batch, which, for_copy=False)
    with cute.arch.elect_one():
        cpasync.copy_tensormap(atom, ptr)
    cute.arch.sync_warp()
    cute.arch.fence_acq_rel_cta()
    cpasync.update_tma_descriptor(atom, rows, ptr)
    cute.arch.sync_warp()


def sequence_extents(seq: SequenceInfo):
    """(offset_q, extent_q, offset_k, extent_k) of a sequence's descriptors. An empty sequence is
    never moved through; extent 1 keeps its descriptors well formed (an empty sequence at the
    tensor's end starts past its last row, but no copy goes through it)."""
    return seq.offset_q, cutlass.max(seq.seqlen_q, 1), seq.offset_k, cutlass.max(seq.seqlen_k, 1)


@cute.jit
def flag_bad_offsets(mCuSeqlensQ: cute.Tensor, mCuSeqlensK: Optional[cute.Tensor], batch, seq: SequenceInfo, total_q,
                     total_k, mErrors: cute.Tensor):
    """Set ``mErrors[0]`` if sequence ``batch``'s offsets are not what ``SequenceInfo`` made of
    them (out of order or of range, longer than the max length the launch was sized by), or if
    the first offset is not 0 or the last not the tensor's row count. Without ``mCuSeqlensK``
    (keys in a KV cache) the query offsets alone, whose last may stop short of the rows (an
    engine's batch padded to a fixed size)."""
    num_batches = mCuSeqlensQ.shape[0] - 1
    bad = mCuSeqlensQ[batch] != seq.offset_q or mCuSeqlensQ[batch + 1] != seq.offset_q + seq.seqlen_q
    if batch == 0:
        bad = bad or mCuSeqlensQ[0] != 0
    if const_expr(mCuSeqlensK is not None):
        if batch == num_batches - 1:
            bad = bad or mCuSeqlensQ[num_batches] != total_q
        bad = bad or mCuSeqlensK[batch] != seq.offset_k or mCuSeqlensK[batch + 1] != seq.offset_k + seq.seqlen_k
        if batch == 0:
            bad = bad or mCuSeqlensK[0] != 0
        if batch == num_batches - 1:
            bad = bad or mCuSeqlensK[num_batches] != total_k
    if bad:
        flag_error(mErrors, BAD_OFFSETS)


class SequenceDescriptors:
    """Mixed into the forward kernel class (reads ``cfg.v_staged``): the descriptor-writing kernel."""

    @cute.kernel
    def describe_sequences(self, tma_q: cute.CopyAtom, tma_k: cute.CopyAtom, tma_v: cute.CopyAtom,
                           tma_o: Optional[cute.CopyAtom], q: cute.Tensor, k: cute.Tensor, v: cute.Tensor,
                           o: Optional[cute.Tensor], mCuSeqlensQ: cute.Tensor, mCuSeqlensK: Optional[cute.Tensor],
                           mSeqDescriptors: cute.Tensor, mErrors: cute.Tensor, max_seqlen_q: Int32):
        """One warp per sequence. q, k, o: (S, D, H, 1); v: (D, S, H, 1). Staged fp8 V has a batch
        row per sequence already and keeps the atom's descriptor; ``tma_o`` is None where O is
        stored from registers. Without ``mCuSeqlensK`` the keys are a KV cache's, read through
        the atoms' own descriptors: only Q and O get a sequence's."""
        batch = Int32(cute.arch.block_idx()[0])
        keys_packed = mCuSeqlensK is not None
        seq = SequenceInfo.create(batch, q.shape[0], k.shape[0], mCuSeqlensQ, mCuSeqlensK, max_seqlen_q)
        flag_bad_offsets(mCuSeqlensQ, mCuSeqlensK, batch, seq, q.shape[0], k.shape[0], mErrors)
        offset_q, len_q, offset_k, len_k = sequence_extents(seq)
        write_sequence_descriptor(tma_q, sequence_rows(q, offset_q, len_q, 0), mSeqDescriptors, batch, Q)
        if const_expr(keys_packed):
            write_sequence_descriptor(tma_k, sequence_rows(k, offset_k, len_k, 0), mSeqDescriptors, batch, K)
        if const_expr(keys_packed and not self.cfg.v_staged):
            write_sequence_descriptor(tma_v, sequence_rows(v, offset_k, len_k, 1), mSeqDescriptors, batch, V)
        if const_expr(tma_o is not None):
            write_sequence_descriptor(tma_o, sequence_rows(o, offset_q, len_q, 0), mSeqDescriptors, batch, O)
        cpasync.fence_tma_desc_release()
