"""The Hopper kernels' named barriers (hardware barriers 1..15; 0 is ``__syncthreads``).
Forward: one of each per consumer warpgroup ``wg`` (at most three), ``barrier + wg``."""

import enum

#: consumer warpgroups a CTA can have (192-row tiles)
MAX_CONSUMER_WARPGROUPS = 3


class NamedBarrier(enum.IntEnum):
    #: warpgroup ``wg`` may issue its GEMMs (ping-pong: the turn passes to ``wg + 1``)
    GEMM_TURN = 1
    #: warpgroup ``wg``'s O rows are staged in shared memory for its TMA store
    O_STAGED = GEMM_TURN + MAX_CONSUMER_WARPGROUPS
    #: warpgroup ``wg`` has zeroed the V rows past a cache's last key (``mainloop.zero_keys_past_end``)
    KEYS_ZEROED = O_STAGED + MAX_CONSUMER_WARPGROUPS


class NamedBarrierBwd(enum.IntEnum):
    """The backward kernel's (both consumer warpgroups, 256 threads each time)."""

    #: both warpgroups' dQ products of the previous query tile are done reading dS^T
    DS_FREE = 1
    #: both warpgroups' dS^T is in shared memory for the dQ product
    DS_READY = 2
    #: both warpgroups' halves of the dQ tile are in shared memory for the TMA reduce-add
    DQ_STAGED = 3
