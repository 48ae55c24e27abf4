"""Helpers on the DSL's mbarrier pipelines, shared by the kernels."""

from typing import Optional

import cutlass.cute as cute
from cutlass import Float32, const_expr


@cute.jit
def release_by_one_lane(handle, anchor: Optional[Float32] = None):
    """``handle.release()`` by an elected lane of each warp (the pipeline's own test reads the
    thread index again at every release). With ``anchor`` (a softmax row sum: never negative, so
    the condition always holds; NaN compares false and releases too) the release is made
    data-dependent on it, which keeps ptxas from hoisting it."""
    pipe = handle.get_origin()
    with cute.arch.elect_one():
        if const_expr(anchor is None):
            pipe.sync_object_empty.arrive(handle.index, pipe.consumer_mask)
        elif not (anchor < Float32(0.0)):
            pipe.sync_object_empty.arrive(handle.index, pipe.consumer_mask)
