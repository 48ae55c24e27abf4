"""Native Sparse Attention (DeepSeek, 2025) on fmha: compression, top-k selection and sliding
window branches, gated (docs/nsa.md).

``nsa_attention`` composes the branches; each is also a function of its own with the seam a
kernel plugs into (``compression_attention``, ``select_blocks``, ``selection_attention``,
``window_attention``). ``NativeSparseAttention`` is the nn.Module layer; ``fmha.nsa.reference``
the fp64 oracle. This package imports fmha's public modules; fmha's core never imports it.
"""

from .compression import compression_attention
from .decode import nsa_decode, pool_new_blocks
from .functional import nsa_attention, window_attention
from .layout import NSABranches, compressed_cu_seqlens, num_compressed_blocks, num_selection_blocks
from .module import NativeSparseAttention, apply_rotary
from .pooling import MLPPool, compressed_blocks, mean_pool
from .reference import nsa_reference
from .selection import selection_attention
from .topk import select_blocks

__all__ = [
    "nsa_attention",
    "nsa_decode",
    "pool_new_blocks",
    "compression_attention",
    "select_blocks",
    "selection_attention",
    "window_attention",
    "mean_pool",
    "compressed_blocks",
    "MLPPool",
    "NativeSparseAttention",
    "NSABranches",
    "apply_rotary",
    "nsa_reference",
    "compressed_cu_seqlens",
    "num_compressed_blocks",
    "num_selection_blocks",
]
