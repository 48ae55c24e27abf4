"""Varlen: one TMA descriptor per sequence and tensor, bounded to that sequence's rows.

A packed batch's tensors hold every sequence back to back, and a TMA box clips only at the
tensor's end. A query or key tile that runs past its sequence's last row would read the next
sequence's rows (whose V, if it held NaN or inf, would turn P = 0 into 0 * NaN). So before the
attention kernel a small kernel (``describe_sequences``, one warp per sequence, on the same
stream) copies each TMA atom's descriptor and narrows it to one sequence: base address at its
first row, extent its length. The producer then loads through the sequence's own descriptors,
with coordinates relative to the sequence's first row, and TMA zero-fills past its end.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import cpasync
from cutlass.tensor_utils import TensorMapManager, TensorMapUpdateMode

#: which descriptor of a sequence's three
Q, K, V = 0, 1, 2


def sequence_descriptor(descriptors: cute.Tensor, batch, which: int, for_copy: bool = True):
    """Pointer to the 128-byte TMA descriptor of sequence ``batch`` for q, k or v: generic for
    the TMA loads that use it, global for the ops that write it."""
    manager = TensorMapManager(TensorMapUpdateMode.GMEM, 128)
    space = cute.AddressSpace.generic if for_copy else cute.AddressSpace.gmem
    return manager.get_tensormap_ptr(descriptors[batch, which, None].iterator, space)


class SequenceDescriptors:
    """Mixed into the kernel class (reads ``cfg.v_staged``): the descriptor-writing kernel."""

    @cute.kernel
    def describe_sequences(self, tma_q: cute.CopyAtom, tma_k: cute.CopyAtom, tma_v: cute.CopyAtom,
                           q: cute.Tensor, k: cute.Tensor, v: cute.Tensor,
                           mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor,
                           mSeqDescriptors: cute.Tensor):
        """One warp per sequence: copy each TMA atom's descriptor and narrow it to the sequence.
        Staged fp8 V has a batch row per sequence already and keeps the atom's descriptor."""
        batch = Int32(cute.arch.block_idx()[0])
        offset_q = mCuSeqlensQ[batch]
        offset_k = mCuSeqlensK[batch]
        # An empty sequence is never loaded from; extent 1 keeps its descriptor well formed.
        len_q = cutlass.max(mCuSeqlensQ[batch + 1] - offset_q, 1)
        len_k = cutlass.max(mCuSeqlensK[batch + 1] - offset_k, 1)
        q_seq = cute.make_tensor(q.iterator + offset_q * q.layout.stride[0], cute.make_layout(
            (len_q, q.shape[1], q.shape[2], q.shape[3]), stride=q.layout.stride))
        k_seq = cute.make_tensor(k.iterator + offset_k * k.layout.stride[0], cute.make_layout(
            (len_k, k.shape[1], k.shape[2], k.shape[3]), stride=k.layout.stride))
        targets = [(tma_q, q_seq, Q), (tma_k, k_seq, K)]
        if const_expr(not self.cfg.v_staged):
            v_seq = cute.make_tensor(v.iterator + offset_k * v.layout.stride[1], cute.make_layout(
                (v.shape[0], len_k, v.shape[2], v.shape[3]), stride=v.layout.stride))
            targets.append((tma_v, v_seq, V))
        for atom, tensor, which in targets:
            ptr = sequence_descriptor(mSeqDescriptors, batch, which, for_copy=False)
            with cute.arch.elect_one():
                cpasync.copy_tensormap(atom, ptr)
            cute.arch.sync_warp()
            cute.arch.fence_acq_rel_cta()
            cpasync.update_tma_descriptor(atom, tensor, ptr)
            cute.arch.sync_warp()
        cpasync.fence_tma_desc_release()
