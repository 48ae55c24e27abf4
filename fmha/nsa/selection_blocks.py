"""Selection attention on fmha's attention kernels: a selection list is a block-sparse mask.

The packed tokens (T, H, D) become one dense sequence of T rows under a causal mask. Query t of KV
group g keeps key j when j lies in a block that ``selected[t, g]`` lists, in t's own sequence:

* a ``BlockMask`` (64 x 64 blocks, one head per query head) marks partial the blocks that some
  query of a query block selects, so the kernels visit only those tiles (fmha's forward walks
  each query tile's list, the backward each key tile's transposed one);
* the mask mod ``selected_keys(select_block, group)`` decides per element, from each token's
  sequence start and a bit set of its selected blocks (``words[g, t, i]`` holds blocks
  ``32 i .. 32 i + 31``), both passed as ``aux``.

Built on the device from ``selected`` and ``cu_seqlens`` with tensor ops, without a host sync
(CUDA-graph safe). The bit set is sized by the packed length T, so that any key position's block
has a word and the mod needs no clamp: H_k * T * ceil(T / (32 * select_block)) int32 (32 MB at
T = 64k, H_k = 4, blocks of 64). A block an unchecked list names twice counts once here (the
PyTorch path counts it twice); an index past every block keeps nothing.
"""

from __future__ import annotations

import functools
import math
from typing import Tuple

import torch

from .. import mods as M
from ..block_mask import PARTIAL, BlockMask
from .layout import token_positions

#: the block mask's granularity (fmha's kernels coarsen it to their tiles)
BLOCK = 64


@functools.lru_cache(maxsize=None)
def selected_keys(select_block: int, group: int):
    """The mask mod of selection blocks of ``select_block`` tokens shared by ``group`` query
    heads: one function per geometry, so each compiles once."""

    def keep(b, h, q_idx, kv_idx, aux):
        starts, words = aux
        rel = kv_idx - starts[q_idx]
        block = M.maximum(rel, 0) // select_block
        word = words[h // group, q_idx, block // 32]
        return (rel >= 0) & (((word >> (block % 32)) & 1) != 0)

    return keep


def selection_mask(selected: torch.Tensor, cu_seqlens: torch.Tensor, select_block: int,
                   heads_q: int) -> Tuple[BlockMask, tuple]:
    """(block mask, aux) of ``selected`` (T, H_k, n) int32 over packed tokens with ``cu_seqlens``
    (T x T, one head per query head), for ``fmha.attention(..., causal=True)``."""
    total, heads_k, _ = selected.shape
    group = heads_q // heads_k
    device = selected.device
    where = token_positions(cu_seqlens, total)
    # the bit set: bit s of token t's row of group g when it selects block s
    num_words = max(1, math.ceil(math.ceil(max(total, 1) / select_block) / 32))
    sel = selected.long()
    used = (sel >= 0) & (sel < 32 * num_words)  # an index past every block keeps nothing
    s = torch.where(used, sel, torch.zeros_like(sel))
    # a block an unchecked list names twice sets its bit once
    order = torch.where(used, sel, torch.full_like(sel, -1)).sort(dim=-1).values
    fresh = torch.ones_like(order, dtype=torch.bool)
    fresh[..., 1:] = order[..., 1:] != order[..., :-1]
    block = order.clamp(min=0)
    bits = torch.where((order >= 0) & fresh, torch.ones_like(block) << (block % 32), torch.zeros_like(block))
    words = torch.zeros((total, heads_k, num_words), dtype=torch.int64, device=device)
    words.scatter_add_(2, block // 32, bits)
    words = words.to(torch.int32).permute(1, 0, 2).contiguous()  # (H_k, T, words); bit 31 wraps to the sign
    # the blocks: query block t // BLOCK visits the key blocks its queries' selected keys (j <= t) fall in
    t = torch.arange(total, device=device).view(total, 1, 1)
    first = where.start.view(total, 1, 1) + s * select_block
    last = torch.minimum(first + select_block - 1, t)
    live = used & (first <= t)
    spans = (select_block + BLOCK - 2) // BLOCK + 1  # key blocks one selection block can touch
    key_block = ((first // BLOCK).unsqueeze(-1) + torch.arange(spans, device=device))
    live = live.unsqueeze(-1) & (key_block <= (last // BLOCK).unsqueeze(-1))
    nq = nk = -(-total // BLOCK)
    # flat indices, the dead ones to a spare last slot: no boolean indexing, so no host sync
    g = torch.arange(heads_k, device=device).view(1, heads_k, 1, 1)
    flat = (g * nq + (t // BLOCK).view(total, 1, 1, 1)) * nk + key_block.clamp(max=nk - 1)
    flat = torch.where(live, flat, torch.full_like(flat, heads_k * nq * nk))
    states = torch.zeros(heads_k * nq * nk + 1, dtype=torch.uint8, device=device)
    states.scatter_(0, flat.flatten(), PARTIAL)
    states = states[:-1].view(heads_k, nq, nk)
    states = states.repeat_interleave(group, dim=0)[None]  # (1, H_q, nq, nk)
    aux = (where.start.to(torch.int32), words)
    return BlockMask(states, (BLOCK, BLOCK), (total, total), selected_keys(select_block, group), aux), aux
