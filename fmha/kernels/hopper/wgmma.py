"""Issuing warpgroup MMAs over the K blocks of a fragment."""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup

WARPGROUP_THREADS = 128


@cute.jit
def issue_gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, a: cute.Tensor, b: cute.Tensor,
               zero_init: cutlass.Constexpr[bool]):
    """acc (+)= a @ b over the K blocks (mode 2) of ``a``/``b``, issued asynchronously and
    committed as one group; the caller waits with ``warpgroup.wait_group``."""
    warpgroup.fence()
    # A fresh atom per call: toggling ACCUMULATE on a shared tiled MMA inside staged loops would
    # make the toggled value escape its region.
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for kb in cutlass.range_constexpr(cute.size(a, mode=[2])):
        cute.gemm(atom, acc, a[None, None, kb], b[None, None, kb], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
