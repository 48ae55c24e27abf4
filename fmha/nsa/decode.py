"""NSA decode (docs/nsa.md, "Decode"): the newest query rows of each sequence against a dense KV
cache and a compressed cache that the step keeps up to date.

A step appends ``k_new``/``v_new`` to the cache (``fmha.attention_with_kvcache`` does, in the
window branch), mean-pools the compressed blocks the new keys complete into ``k_cmp_cache`` /
``v_cmp_cache``, then runs the three branches for the last S_q positions of each sequence:

* compression: ``attention_with_kvcache`` over the compressed cache, row r seeing the blocks
  that end at or before its position (one call per row: rows see different counts);
* top-k: the compression probabilities summed over the group and mapped onto selection blocks,
  ranked as the prefill does (``topk.block_scores``, ``topk.rank_blocks``);
* selection: the listed blocks' keys gathered from the cache (``selection.attend_selected``);
* window: ``attention_with_kvcache`` with ``window_size=(window - 1, 0)``.

Every step is tensor operations over shapes the call fixes (no host read of the lengths), so a
step can be captured in a CUDA graph where fmha's decode kernels serve its two attention calls.
It computes no gradients (decode is inference).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..kvcache import attention_with_kvcache
from ..backends import check_backend_name
from .checks import check_geometry, check_scale
from .layout import NSABranches, TokenPositions, num_compressed_blocks, num_selection_blocks, visible_compressed_blocks
from .selection import attend_selected
from .topk import block_scores, overlap_matrix, rank_blocks

__all__ = ["nsa_decode", "pool_new_blocks"]


def _check_caches(q, k_cache, v_cache, k_cmp_cache, v_cmp_cache, cache_seqlens, gates, block, stride):
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k_cmp_cache", k_cmp_cache),
                    ("v_cmp_cache", v_cmp_cache)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (B, S, H, D), got "
                             f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}; put them on one device")
    batch, _, heads_q, _ = q.shape
    heads_k = k_cache.shape[2]
    for name, t in (("k_cmp_cache", k_cmp_cache), ("v_cmp_cache", v_cmp_cache)):
        cache = k_cache if name[0] == "k" else v_cache
        if t.shape[0] != batch or t.shape[2:] != cache.shape[2:] or t.dtype != cache.dtype:
            raise ValueError(f"{name} must be (B, C_max, H_k, D) = ({batch}, C_max, {heads_k}, {cache.shape[-1]}) "
                             f"{cache.dtype} like its cache, got {tuple(t.shape)} {t.dtype}")
    need = num_compressed_blocks(k_cache.shape[1], block, stride)
    if k_cmp_cache.shape[1] != v_cmp_cache.shape[1] or k_cmp_cache.shape[1] < need:
        raise ValueError(f"the compressed caches need at least {need} blocks (num_compressed_blocks of the "
                         f"cache's {k_cache.shape[1]} positions), got {k_cmp_cache.shape[1]} and "
                         f"{v_cmp_cache.shape[1]}")
    if heads_k < 1 or heads_q % heads_k:
        raise ValueError(f"q's {heads_q} heads must be a multiple of the cache's {heads_k}")
    for name, g in zip(("g_cmp", "g_slc", "g_win"), gates):
        if not isinstance(g, Tensor) or tuple(g.shape) != tuple(q.shape[:3]) or g.device != q.device:
            raise ValueError(f"{name} must be a (B, S_q, H_q) = {tuple(q.shape[:3])} tensor on {q.device}, got "
                             f"{tuple(g.shape) if isinstance(g, Tensor) else type(g).__name__}")


def pool_new_blocks(k_cache: Tensor, v_cache: Tensor, k_cmp_cache: Tensor, v_cmp_cache: Tensor, old_lengths: Tensor,
                    new_lengths: Tensor, block: int, stride: int, max_new: int) -> None:
    """Mean-pool into the compressed caches the blocks that complete as each sequence grows from
    ``old_lengths`` to ``new_lengths`` tokens (at most ``max_new`` more): block i, the mean of
    tokens ``[i*stride, i*stride + block)``, for ``num_compressed_blocks(old) <= i <
    num_compressed_blocks(new)``. In place; no host read."""
    batch, capacity = k_cache.shape[0], k_cache.shape[1]
    first = num_compressed_blocks(old_lengths.long().clamp(0, capacity), block, stride)
    last = num_compressed_blocks(new_lengths.long().clamp(0, capacity), block, stride)
    slots = max_new // stride + 1  # the most blocks max_new tokens can complete
    index = first[:, None] + torch.arange(slots, device=k_cache.device)  # (B, J)
    valid = (index < last[:, None]) & (index < k_cmp_cache.shape[1])
    # a slot with no new block writes its first new block's value again (or, with none, leaves
    # the first slot as it is), so that no two writes to one place differ
    lead = first.clamp(max=k_cmp_cache.shape[1] - 1)[:, None]
    index = torch.where(valid, index, torch.where(valid[:, :1], index[:, :1], lead))
    tokens = (index[..., None] * stride + torch.arange(block, device=k_cache.device)).clamp(max=capacity - 1)
    rows = torch.arange(batch, device=k_cache.device)[:, None]
    for cache, cmp in ((k_cache, k_cmp_cache), (v_cache, v_cmp_cache)):
        acc = torch.promote_types(cache.dtype, torch.float32)
        pooled = cache[rows[..., None], tokens].to(acc).mean(2).to(cmp.dtype)  # (B, J, H_k, D)
        keep = valid[..., None, None] | valid[:, :1, None, None]
        cmp[rows, index] = torch.where(keep, pooled, cmp[rows, index])


def _top_k(q, k_cmp_cache, lse_cmp, positions, visible, block, stride, select_block, select_count, scale,
           n_slc):
    """int32 (B*S_q, H_k, n): the prefill's ranking of compression probabilities, for the rows
    at ``positions`` (B, S_q) that see ``visible`` (B, S_q) compressed blocks."""
    batch, s_q, heads_q, _ = q.shape
    heads_k, n_cmp = k_cmp_cache.shape[2], k_cmp_cache.shape[1]
    group = heads_q // heads_k
    acc = torch.promote_types(q.dtype, torch.float32)
    qg = q.to(acc).view(batch, s_q, heads_k, group, -1)
    s = torch.einsum("brhgd,bkhd->brhgk", qg, k_cmp_cache.to(acc)) * scale
    lse = lse_cmp.to(acc).transpose(1, 2).reshape(batch, s_q, heads_k, group, 1)  # (B, H_q, S_q) -> rows
    seen = torch.arange(n_cmp, device=q.device) < visible[..., None]  # (B, S_q, C)
    overlap = overlap_matrix(n_cmp, n_slc, block, stride, select_block, acc, q.device)
    scores = block_scores(s, lse, seen[:, :, None, None, :], overlap).reshape(batch * s_q, heads_k, n_slc)
    return rank_blocks(scores, positions.reshape(-1), select_block, select_count, group)


def nsa_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, k_cmp_cache: Tensor, v_cmp_cache: Tensor,
               cache_seqlens: Tensor, g_cmp: Tensor, g_slc: Tensor, g_win: Tensor, *, k_new: Optional[Tensor] = None,
               v_new: Optional[Tensor] = None, block: int = 32, stride: int = 16, select_block: int = 64,
               select_count: int = 16, window: int = 512, softmax_scale: Optional[float] = None,
               pool: bool = True, backend: str = "auto", return_branches: bool = False):
    """One NSA decode step (module doc). q (B, S_q, H_q, D): the last S_q positions of each
    sequence, whose length is ``cache_seqlens`` (B,) int32 plus S_new; dense caches k_cache
    (B, S_max, H_k, D), v_cache (B, S_max, H_k, D_v); compressed caches (B, C_max, H_k, D / D_v)
    holding ``num_compressed_blocks(cache_seqlens)`` blocks, C_max >= num_compressed_blocks(S_max);
    gates (B, S_q, H_q). ``k_new``/``v_new`` (B, S_new, H_k, D) are written into the cache and,
    with ``pool`` (mean pooling), the blocks they complete into the compressed caches (pass
    ``pool=False`` to keep those up to date yourself). Returns o (B, S_q, H_q, D_v) in q's dtype;
    with ``return_branches``, ``(o, NSABranches)`` (outputs (B, S_q, ...), LSEs (B, H_q, S_q),
    ``selected`` (B, S_q, H_k, n)). The caller advances ``cache_seqlens`` by S_new afterwards.
    The selection branch reads the caches as (B * S_max, H_k, D) rows: a cache that is not
    contiguous is copied for it every step."""
    gates = (g_cmp, g_slc, g_win)
    check_geometry(block, stride, select_block, select_count, window)
    check_backend_name(backend)
    _check_caches(q, k_cache, v_cache, k_cmp_cache, v_cmp_cache, cache_seqlens, gates, block, stride)
    scale = check_scale(softmax_scale, q.shape[-1])
    batch, s_q, heads_q, _ = q.shape
    s_new = 0 if k_new is None else k_new.shape[1]
    # the window branch first: attention_with_kvcache appends (and checks) the new keys
    o_win, lse_win = attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens, k_new=k_new, v_new=v_new, causal=True, window_size=(window - 1, 0),
        softmax_scale=scale, return_lse=True, backend=backend)
    # a length past the cache was flagged by the kernels (or refused by the reference): no read
    # or write below may leave the caches
    lengths = (cache_seqlens.long() + s_new).clamp(0, k_cache.shape[1])
    if pool and s_new:
        pool_new_blocks(k_cache, v_cache, k_cmp_cache, v_cmp_cache, cache_seqlens, lengths, block, stride, s_new)
    positions = lengths[:, None] - s_q + torch.arange(s_q, device=q.device)  # (B, S_q); < 0: no such row
    visible = visible_compressed_blocks(positions.clamp(min=-1), block, stride)
    o_cmp = torch.empty_like(o_win)
    lse_cmp = torch.empty_like(lse_win)
    for r in range(s_q):  # each row sees its own count of compressed blocks
        o_r, lse_r = attention_with_kvcache(
            q[:, r:r + 1].contiguous(), k_cmp_cache, v_cmp_cache, visible[:, r].to(torch.int32).contiguous(), causal=False,
            softmax_scale=scale, return_lse=True, backend=backend)
        o_cmp[:, r:r + 1], lse_cmp[:, :, r:r + 1] = o_r, lse_r
    n_slc = num_selection_blocks(k_cache.shape[1], select_block)
    selected = _top_k(q, k_cmp_cache, lse_cmp, positions, visible, block, stride, select_block, select_count,
                      scale, n_slc)
    cache_rows = (torch.arange(batch, device=q.device) * k_cache.shape[1])[:, None].expand(batch, s_q).reshape(-1)
    where = TokenPositions(cache_rows, positions.reshape(-1), lengths[:, None].expand(batch, s_q).reshape(-1))
    o_slc, lse_slc = attend_selected(q.reshape(batch * s_q, heads_q, -1), k_cache.flatten(0, 1),
                                     v_cache.flatten(0, 1), selected, where, select_block, scale)
    o_slc = o_slc.view(batch, s_q, heads_q, -1)
    lse_slc = lse_slc.view(heads_q, batch, s_q).transpose(0, 1).to(lse_win.dtype)
    acc = torch.promote_types(q.dtype, torch.float32)
    o = sum(g.to(acc)[..., None] * branch.to(acc) for g, branch in zip(gates, (o_cmp, o_slc, o_win))).to(q.dtype)
    if not return_branches:
        return o
    return o, NSABranches(o_cmp, lse_cmp, o_slc, lse_slc, o_win, lse_win, selected.view(batch, s_q, -1, select_count),
                          k_cmp_cache, v_cmp_cache, None)
