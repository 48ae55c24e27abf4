"""The NSA oracle: every branch, the top-k and their composition, computed exactly as docs/nsa.md
defines them, in ``compute_dtype`` (fp64 by default). Simple over fast: one sequence and one
query head at a time, whole score matrices, the ranking as a Python sort. Plain torch operations,
so autograd differentiates it (gates, q, k, v, and the pooling; the top-k's indices are not
differentiable). It shares nothing with the fast path but the block geometry (``layout``).

Layouts: packed q (T, H_q, D), k (T, H_k, D), v (T, H_k, D_v) with ``cu_seqlens``; LSEs (H_q, T).
"""

from __future__ import annotations

import math

import torch

from .layout import NSABranches, compressed_cu_seqlens, num_compressed_blocks, num_selection_blocks, pack

__all__ = [
    "mean_pool_reference",
    "compression_attention_reference",
    "select_blocks_reference",
    "selection_attention_reference",
    "window_attention_reference",
    "nsa_reference",
]


def _sequences(cu_seqlens: torch.Tensor):
    offsets = cu_seqlens.tolist()
    return [slice(a, b) for a, b in zip(offsets[:-1], offsets[1:])]


def _scale(softmax_scale, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale


def _masked_attention(q, k, v, keep, scale):
    """One sequence: q (T, H_q, D), k (S, H_k, D), v (S, H_k, D_v); ``keep`` (T, S) for every
    head or (H_k, T, S). Returns o (T, H_q, D_v) and lse (H_q, T); a row keeping nothing gets 0
    and -inf."""
    group = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for h in range(q.shape[1]):
        kh = h // group
        mask = keep if keep.dim() == 2 else keep[kh]
        s = (q[:, h] @ k[:, kh].T * scale).masked_fill(~mask, -math.inf)
        m = s.amax(dim=-1, keepdim=True) if s.shape[-1] else s.new_full((s.shape[0], 1), -math.inf)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(s - m)
        total = p.sum(-1, keepdim=True)
        some = total > 0
        outs.append(p @ v[:, kh] / torch.where(some, total, torch.ones_like(total)))
        lse = m + torch.log(torch.where(some, total, torch.ones_like(total)))
        lses.append(torch.where(some, lse, torch.full_like(lse, -math.inf)).squeeze(-1))
    return torch.stack(outs, 1), torch.stack(lses, 0)


def _attend_packed(q, k, v, cu_q, cu_k, keep_of, scale, cdt):
    """Per sequence: ``keep_of(b, T_q, T_k)`` gives that sequence's mask."""
    q, k, v = (t.to(cdt) for t in (q, k, v))
    outs, lses = [], []
    for b, (sq, sk) in enumerate(zip(_sequences(cu_q), _sequences(cu_k))):
        o, lse = _masked_attention(q[sq], k[sk], v[sk], keep_of(b, sq, sk), scale)
        outs.append(o)
        lses.append(lse)
    if not outs:
        return q.new_zeros(q.shape[:-1] + (v.shape[-1],)), q.new_zeros((q.shape[1], 0))
    return torch.cat(outs, 0), torch.cat(lses, 1)


def mean_pool_reference(x, cu_seqlens, block: int, stride: int, compute_dtype=torch.float64):
    """Compressed block i of each sequence: the mean of its tokens [i*stride, i*stride + block)."""
    rows = []
    for seq in _sequences(cu_seqlens):
        xs = x[seq].to(compute_dtype)
        for i in range(num_compressed_blocks(xs.shape[0], block, stride)):
            rows.append(xs[i * stride:i * stride + block].mean(0))
    if not rows:
        return x.new_zeros((0,) + tuple(x.shape[1:]), dtype=compute_dtype)
    return torch.stack(rows, 0)


def compression_attention_reference(q, k_cmp, v_cmp, cu_seqlens, cu_seqlens_cmp, block: int, stride: int, *,
                                    softmax_scale=None, compute_dtype=torch.float64):
    """Query t attends to its sequence's compressed blocks i with i*stride + block - 1 <= t."""
    def keep(b, sq, sk):
        t = torch.arange(sq.stop - sq.start, device=q.device)[:, None]
        i = torch.arange(sk.stop - sk.start, device=q.device)[None, :]
        return i * stride + block - 1 <= t

    return _attend_packed(q, k_cmp, v_cmp, cu_seqlens, cu_seqlens_cmp, keep, _scale(softmax_scale, q.shape[-1]),
                          compute_dtype)


def window_attention_reference(q, k, v, cu_seqlens, window: int, *, softmax_scale=None,
                               compute_dtype=torch.float64):
    """Query t attends to keys t - window + 1 .. t of its sequence."""
    def keep(b, sq, sk):
        t = torch.arange(sq.stop - sq.start, device=q.device)[:, None]
        s = torch.arange(sk.stop - sk.start, device=q.device)[None, :]
        return (s <= t) & (s > t - window)

    return _attend_packed(q, k, v, cu_seqlens, cu_seqlens, keep, _scale(softmax_scale, q.shape[-1]), compute_dtype)


def selection_attention_reference(q, k, v, selected, cu_seqlens, select_block: int, *, softmax_scale=None,
                                  compute_dtype=torch.float64):
    """Query t (every head of KV group h) attends to the keys s <= t of the blocks in
    ``selected[t, h]`` (-1 entries ignored), softmax over their union."""
    def keep(b, sq, sk):
        n_tok = sq.stop - sq.start
        sel = selected[sq].long()  # (T, H_k, n)
        n_blocks = num_selection_blocks(n_tok, select_block)
        # one flag per (token, head, block); -1 lands in a spare column that nothing reads
        chosen = torch.zeros(sel.shape[0], sel.shape[1], n_blocks + 1, dtype=torch.bool, device=q.device)
        chosen.scatter_(2, torch.where(sel >= 0, sel, n_blocks), True)
        pos = torch.arange(n_tok, device=q.device)
        in_block = chosen[:, :, pos // select_block].permute(1, 0, 2)  # (H_k, T, S)
        return in_block & (pos[None, None, :] <= pos[None, :, None])

    return _attend_packed(q, k, v, cu_seqlens, cu_seqlens, keep, _scale(softmax_scale, q.shape[-1]), compute_dtype)


def _ranked(scores, t: int, select_block: int, select_count: int):
    """The selected blocks of query t from its selection scores (a list over the sequence's
    blocks): candidates are the blocks starting at or before t; the current block, the one
    before it and block 0 come first (in that order), then the highest scores, the lower index
    winning a tie; returned in ascending order, padded with -1."""
    current = t // select_block
    tier = {0: 1}
    tier[current - 1] = 2  # later assignments win where the blocks coincide
    tier[current] = 3
    candidates = range(current + 1)
    order = sorted(candidates, key=lambda j: (-tier.get(j, 0), -scores[j], j))
    chosen = sorted(order[:select_count])
    return chosen + [-1] * (select_count - len(chosen))


def select_blocks_reference(q, k_cmp, cu_seqlens, cu_seqlens_cmp, block: int, stride: int, select_block: int,
                            select_count: int, *, softmax_scale=None, compute_dtype=torch.float64):
    """int32 (T, H_k, select_count): per query and KV group, the blocks ``_ranked`` picks from
    scores that sum, over the group's heads and over the compressed blocks overlapping each
    selection block, the compression branch's attention probabilities."""
    scale = _scale(softmax_scale, q.shape[-1])
    heads_k = k_cmp.shape[1]
    group = q.shape[1] // heads_k
    out = torch.full((q.shape[0], heads_k, select_count), -1, dtype=torch.int32)
    with torch.no_grad():
        for sq, sc in zip(_sequences(cu_seqlens), _sequences(cu_seqlens_cmp)):
            n_tok, n_cmp = sq.stop - sq.start, sc.stop - sc.start
            if n_tok == 0:
                continue
            qs, ks = q[sq].to(compute_dtype), k_cmp[sc].to(compute_dtype)
            t = torch.arange(n_tok, device=q.device)[:, None]
            i = torch.arange(n_cmp, device=q.device)
            visible = i[None, :] * stride + block - 1 <= t
            n_blocks = num_selection_blocks(n_tok, select_block)
            j = torch.arange(n_blocks, device=q.device)
            # compressed [i*d, i*d + l) meets selection [j*l', (j+1)*l')
            overlap = ((i[:, None] * stride < (j[None, :] + 1) * select_block)
                       & (i[:, None] * stride + block > j[None, :] * select_block)).to(compute_dtype)
            for h in range(heads_k):
                importance = torch.zeros(n_tok, n_cmp, dtype=compute_dtype, device=q.device)
                for g in range(h * group, (h + 1) * group):
                    s = (qs[:, g] @ ks[:, h].T * scale).masked_fill(~visible, -math.inf)
                    p = torch.softmax(s, -1).nan_to_num(0.0)  # a row seeing nothing: all 0
                    importance += p
                scores = (importance @ overlap).tolist()
                ranked = [_ranked(scores[row], row, select_block, select_count) for row in range(n_tok)]
                out[sq, h] = torch.tensor(ranked, dtype=torch.int32)
    return out.to(q.device)


def nsa_reference(q, k, v, g_cmp, g_slc, g_win, *, cu_seqlens=None, block=32, stride=16, select_block=64,
                  select_count=16, window=512, k_cmp=None, v_cmp=None, selected=None, softmax_scale=None,
                  compute_dtype=torch.float64, return_branches=False):
    """NSA as docs/nsa.md defines it: o = g_cmp*o_cmp + g_slc*o_slc + g_win*o_win in
    ``compute_dtype``. Dense (B, S, H, D) inputs with gates (B, S, H_q), or packed ones with
    ``cu_seqlens``; k_cmp/v_cmp default to mean pooling, ``selected`` to the top-k. Inputs are
    assumed valid. With ``return_branches``, also an ``NSABranches``."""
    packed = pack((q, k, v, g_cmp, g_slc, g_win, selected), cu_seqlens)
    q_, k_, v_, gc, gs, gw, sel = packed.tensors
    cu = packed.cu_seqlens
    cu_cmp = compressed_cu_seqlens(cu, block, stride)
    if k_cmp is None:
        k_cmp_, v_cmp_ = (mean_pool_reference(t, cu, block, stride, compute_dtype) for t in (k_, v_))
    else:
        k_cmp_, v_cmp_ = (t.reshape((-1,) + tuple(t.shape[-2:])) for t in (k_cmp, v_cmp))
    kw = dict(softmax_scale=softmax_scale, compute_dtype=compute_dtype)
    o_cmp, lse_cmp = compression_attention_reference(q_, k_cmp_, v_cmp_, cu, cu_cmp, block, stride, **kw)
    if sel is None:
        sel = select_blocks_reference(q_, k_cmp_, cu, cu_cmp, block, stride, select_block, select_count, **kw)
    o_slc, lse_slc = selection_attention_reference(q_, k_, v_, sel, cu, select_block, **kw)
    o_win, lse_win = window_attention_reference(q_, k_, v_, cu, window, **kw)
    o = sum(g.to(compute_dtype)[..., None] * branch for g, branch in ((gc, o_cmp), (gs, o_slc), (gw, o_win)))
    o = packed.unpack(o)
    if not return_branches:
        return o
    n_cmp = None if packed.batch is None else num_compressed_blocks(packed.length, block, stride)
    branches = NSABranches(packed.unpack(o_cmp), packed.unpack_lse(lse_cmp), packed.unpack(o_slc),
                           packed.unpack_lse(lse_slc), packed.unpack(o_win), packed.unpack_lse(lse_win),
                           packed.unpack(sel), packed.unpack(k_cmp_, n_cmp), packed.unpack(v_cmp_, n_cmp),
                           None if packed.batch is not None else cu_cmp)
    return o, branches
