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
    """The backward kernel's. ``DQ_*``: one per consumer warpgroup ``wg`` (``barrier + wg``), its
    128 threads and the dQ writer warp."""

    #: both warpgroups' dS^T is in shared memory for the dQ product (256 threads)
    DS_READY = 1
    #: the writer's reduce-add has read warpgroup ``wg``'s block of the last dQ tile
    DQ_EMPTY = 2
    #: warpgroup ``wg``'s block of the dQ tile is in shared memory for its reduce-add
    DQ_FULL = 4
    #: ``dkv_store_tma``: warpgroup ``wg``'s dV or dK rows are staged for its TMA store (128 threads)
    DKV_STAGED = 6
    #: deterministic selection: warpgroup ``wg``'s turn to add its keys' dK and dV (128 threads)
    DKV_TURN = 8
